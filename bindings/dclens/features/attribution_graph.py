"""Attribution graphs of transcoder features, with edges into DCMHA's compose
(docs/features.md, "Attribution graphs"; Ameisen et al. 2025, circuit-tracer's definitions).

    g = features.attribution_graph(model, "The cat sat on the", transcoders)
    g.scores()                      # (replacement score, completeness score)
    kept = g.prune(0.8, 0.98)       # node and edge masks by influence on the logits
    g.to_json("graph.json")         # circuit-tracer / Neuronpedia's graph format

Nodes, in this order: the active transcoder features (layer, position, feature), the compose
nodes (layer, position: compose_nodes.py), the lending nodes (layer, lender head, borrower
head: lending_nodes.py), one error node per layer and position, one token
(embedding) node per position, and the logit targets (the most likely next tokens, up to
max_n_logits or desired_logit_prob of the mass). adjacency[target, source] is the direct
effect of the source on the target in the replacement model (replacement.py): on a feature's
pre-activation, on a compose node's value, or on a logit minus the mean logit. A feature's
edge is its activation times its decoder vector dotted with the target's gradient at the
residual it writes; an error's, its vector; a token's, its embedding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._core import progress as _progress
from .._core.checks import Error, check_index
from . import compose_nodes, lending_nodes
from .replacement import Replacement
from .sae import SAE

KINDS = ("feature", "compose", "lend", "error", "token", "logit")


@dataclass(frozen=True)
class Node:
    """One node of an attribution graph.

    Attributes
    ----------
    kind : {"feature", "compose", "lend", "error", "token", "logit"}
        What it is.
    layer : int
        The transcoder's / compose's / lending's / error's layer; -1 for a token, n_layer for
        a logit.
    pos : int
        The position (-1 for a lending node: it spans the prompt).
    index : int
        The feature's index; lender * n_head + borrower for a lending node; the token id of a
        token or logit node; -1 otherwise.
    value : float
        A feature's activation, a compose or lending node's value, a logit's (demeaned)
        logit, the norm of an error's or a token's vector.
    heads : tuple of int
        A lending node's (lender m, borrower n); () otherwise.
    """

    kind: str
    layer: int
    pos: int
    index: int
    value: float
    heads: tuple = ()

    @property
    def name(self) -> str:
        """A short label: "L2.F17@5", "L1.compose@5", "L1.H3>H0" (head 3 lends to head 0),
        "L3.err@5", "tok@5", "logit 42"."""
        if self.kind == "feature":
            return "L%d.F%d@%d" % (self.layer, self.index, self.pos)
        if self.kind == "compose":
            return "L%d.compose@%d" % (self.layer, self.pos)
        if self.kind == "lend":
            return "L%d.H%d>H%d" % ((self.layer,) + tuple(self.heads))
        if self.kind == "error":
            return "L%d.err@%d" % (self.layer, self.pos)
        return "tok@%d" % self.pos if self.kind == "token" else "logit %d" % self.index


class AttributionGraph:
    """Nodes and the adjacency of direct effects (what attribution_graph returns).

    Parameters
    ----------
    nodes : list of Node
        In the order of KINDS.
    adjacency : numpy.ndarray
        [n, n] float64, adjacency[target, source].
    logit_probs : numpy.ndarray
        The logit targets' probabilities.
    tokens : numpy.ndarray
        The prompt's token ids [T].
    n_layer : int
        The model's layers.
    """

    def __init__(self, nodes: list[Node], adjacency: np.ndarray, logit_probs: np.ndarray, tokens, n_layer: int):
        self.nodes, self.adjacency = nodes, adjacency
        self.logit_probs = np.asarray(logit_probs, np.float64)
        self.tokens, self.n_layer = np.asarray(tokens), n_layer
        kinds = np.array([n.kind for n in nodes])
        self.index = {k: np.nonzero(kinds == k)[0] for k in KINDS}

    def __len__(self) -> int:
        return len(self.nodes)

    def _logit_weights(self) -> np.ndarray:
        w = np.zeros(len(self))
        w[self.index["logit"]] = self.logit_probs
        return w

    def influence(self) -> np.ndarray:
        """Each node's total influence on the logit targets (circuit-tracer's: the rows of
        |adjacency| normalised to sum 1, summed over paths of every length, weighted by the
        targets' probabilities).

        Returns
        -------
        numpy.ndarray
            [n] float64, >= 0.
        """
        return _influence(_normalized(self.adjacency), self._logit_weights())

    def top(self, k: int = 10, kinds: Sequence[str] | None = None) -> list[tuple[Node, float]]:
        """The k nodes of the most influence on the logit targets.

        Parameters
        ----------
        k : int
            How many (>= 1).
        kinds : sequence of str or None
            Only nodes of these kinds (KINDS: "feature", "compose", "lend", "error", "token",
            "logit"); None: every kind but the logits.

        Returns
        -------
        list of tuple
            (node, influence) pairs, the largest influence first (ties: the earlier node).

        Raises
        ------
        dclens.Error
            k below 1, or a kind not in KINDS.
        """
        k = check_index("top: k", k, 1, 1 << 30)
        kinds = [kd for kd in KINDS if kd != "logit"] if kinds is None else list(kinds)
        bad = [kd for kd in kinds if kd not in KINDS]
        if bad:
            raise Error("top: unknown node kind %r (kinds are %s)" % (bad[0], ", ".join(KINDS)))
        idx = np.sort(np.concatenate([self.index[kd] for kd in kinds]))
        infl = self.influence()
        order = idx[np.argsort(-infl[idx], kind="stable")][:k]
        return [(self.nodes[i], float(infl[i])) for i in order]

    def inputs(self, node: int, k: int = 10) -> list[tuple[Node, float]]:
        """The k largest direct effects into a node (its row of the adjacency): which features,
        errors and tokens set a compose or lending node, feed a feature, or move a logit.

        Parameters
        ----------
        node : int
            The node's index (into nodes).
        k : int
            How many (>= 1).

        Returns
        -------
        list of tuple
            (source node, edge weight) pairs, the largest |weight| first; only nonzero edges.

        Raises
        ------
        dclens.Error
            A node index out of range, or k below 1.
        """
        node = check_index("inputs: node", node, 0, len(self), " (%d nodes)" % len(self))
        k = check_index("inputs: k", k, 1, 1 << 30)
        row = self.adjacency[node]
        order = np.argsort(-np.abs(row), kind="stable")[:k]
        return [(self.nodes[j], float(row[j])) for j in order if row[j] != 0.0]

    def scores(self) -> tuple[float, float]:
        """The replacement and completeness scores (circuit-tracer's compute_graph_scores).

        Returns
        -------
        tuple of float
            (replacement: the share of the tokens' and errors' influence on the logits that
            is the tokens'; completeness: the influence-weighted share of every node's
            inputs that does not come from error nodes), each in [0, 1].
        """
        A = _normalized(self.adjacency)
        w = self._logit_weights()
        infl = _influence(A, w)
        tok, err = infl[self.index["token"]].sum(), infl[self.index["error"]].sum()
        replacement = float(tok / (tok + err)) if tok + err > 0 else 1.0
        non_error = 1.0 - A[:, self.index["error"]].sum(-1)
        out = infl + w
        return replacement, float((non_error * out).sum() / out.sum())

    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> tuple[np.ndarray, np.ndarray]:
        """The nodes and edges that carry most of the influence on the logits
        (circuit-tracer's prune_graph).

        Parameters
        ----------
        node_threshold : float
            Keep the most influential nodes that together hold this share of the influence.
        edge_threshold : float
            Then the edges, scored as normalised weight times their target's influence,
            that hold this share.

        Returns
        -------
        tuple of numpy.ndarray
            (node_mask [n] bool, edge_mask [n, n] bool). Tokens and logits are always kept;
            a kept feature, compose, lending or error node has a kept outgoing edge, a kept
            feature, compose or lending node a kept incoming one.

        Raises
        ------
        dclens.Error
            A threshold outside [0, 1].
        """
        for what, v in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise Error("prune: %s must be a number in [0, 1], not %r" % (what, v))
        w = self._logit_weights()
        infl = _influence(_normalized(self.adjacency), w)
        node = infl >= _threshold(infl, node_threshold)
        always = np.concatenate([self.index["token"], self.index["logit"]])
        node[always] = True
        pruned = self.adjacency * node[:, None] * node[None, :]
        An = _normalized(pruned)
        edge_score = An * (_influence(An, w) + w)[:, None]
        edge = edge_score >= _threshold(edge_score.ravel(), edge_threshold)
        edge &= node[:, None] & node[None, :]
        targets = np.concatenate([self.index[k] for k in ("feature", "compose", "lend")])
        inner = np.concatenate([targets, self.index["error"]])
        while True:
            before = node.copy()
            node[inner] &= edge[:, inner].any(0)
            node[targets] &= edge[targets].any(1)
            edge &= node[:, None] & node[None, :]
            if (node == before).all():
                return node, edge

    def to_json(self, path, node_threshold: float = 0.8, edge_threshold: float = 0.98, slug: str = "dclens") -> str:
        """Write the pruned graph in circuit-tracer's / Neuronpedia's graph JSON.

        Parameters
        ----------
        path : str or os.PathLike
            The file to write.
        node_threshold, edge_threshold : float
            As for prune.
        slug : str
            The graph's name (metadata.slug).

        Returns
        -------
        str
            The path written.

        Raises
        ------
        dclens.Error
            A threshold outside [0, 1], or a file that cannot be written.
        """
        node_mask, edge_mask = self.prune(node_threshold, edge_threshold)
        infl = self.influence()
        ids = {i: _node_id(n, self.n_layer) for i, n in enumerate(self.nodes)}
        keep = [int(i) for i in np.nonzero(node_mask)[0]]
        rank = {int(i): k for k, i in enumerate(self.index["logit"])}  # a logit node's target index
        nodes = [_node_json(self.nodes[i], ids[i], float(infl[i]), self, rank.get(i, -1)) for i in keep]
        t, s = np.nonzero(edge_mask)
        links = [
            {"source": ids[int(b)], "target": ids[int(a)], "weight": float(self.adjacency[a, b])} for a, b in zip(t, s)
        ]
        doc = {
            "metadata": {
                "slug": slug,
                "scan": "dclens",
                "prompt_tokens": [str(int(x)) for x in self.tokens],
                "prompt": " ".join(str(int(x)) for x in self.tokens),
                "node_threshold": node_threshold,
                "schema_version": 1,
            },
            "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
            "nodes": nodes,
            "links": links,
        }
        path = os.fspath(path)
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(doc, f)
        except OSError as e:
            raise Error("%s: cannot write the graph: %s" % (path, e.strerror or e)) from e
        return path


def _node_id(n: Node, L: int) -> str:
    if n.kind == "feature":
        return "%d_%d_%d" % (n.layer, n.index, n.pos)
    if n.kind == "compose":
        return "%d_-2_%d" % (n.layer, n.pos)
    if n.kind == "lend":
        return "%d_-3_%d" % (n.layer, n.index)
    if n.kind == "error":
        return "%d_-1_%d" % (n.layer, n.pos)
    if n.kind == "token":
        return "E_%d_%d" % (n.index, n.pos)
    return "%d_%d_%d" % (L + 1, n.index, n.pos)


_FEATURE_TYPES = {
    "feature": "cross layer transcoder",
    "compose": "dcmha compose input",
    "lend": "dcmha head lending",
    "error": "mlp reconstruction error",
    "token": "embedding",
    "logit": "logit",
}


def _node_json(n: Node, node_id: str, influence: float, g: AttributionGraph, k: int) -> dict:
    layer = "E" if n.kind == "token" else str(n.layer + 1 if n.kind == "logit" else n.layer)
    d = {
        "node_id": node_id,
        "jsNodeId": node_id,
        "feature": n.index,
        "layer": layer,
        "ctx_idx": n.pos if n.pos >= 0 else len(g.tokens) - 1,  # a lending node: the last position
        "feature_type": _FEATURE_TYPES[n.kind],
        "influence": influence,
        "activation": n.value,
        "clerp": n.name,
    }
    if n.kind == "logit":
        d.update(token_prob=float(g.logit_probs[k]), is_target_logit=k == 0, layer=str(g.n_layer + 1))
    return d


def _normalized(A: np.ndarray) -> np.ndarray:
    a = np.abs(A)
    return a / np.maximum(a.sum(1, keepdims=True), 1e-10)


def _influence(A: np.ndarray, w: np.ndarray) -> np.ndarray:
    """w A + w A^2 + ...: the graph is acyclic (sources earlier than targets), so this ends."""
    cur = w @ A
    total = cur.copy()
    for _ in range(len(w) + 1):
        cur = cur @ A
        if not cur.any():
            return total
        total += cur
    raise Error("attribution graph: influence did not converge (the adjacency has a cycle)")


def _threshold(scores: np.ndarray, share: float) -> float:
    s = np.sort(scores)[::-1]
    total = s.sum()
    if total <= 0:
        return 0.0
    i = int(np.searchsorted(np.cumsum(s) / total, share))
    return float(s[min(i, len(s) - 1)])


# ---------------------------------------------------------------- building the graph


def _logit_targets(logits: np.ndarray, max_n: int, mass: float) -> tuple[np.ndarray, np.ndarray]:
    x = logits[-1] - logits[-1].max()
    p = np.exp(x) / np.exp(x).sum()
    order = np.argsort(-p, kind="stable")
    n = min(max_n, int(np.searchsorted(np.cumsum(p[order]), mass)) + 1)
    return order[:n], p[order[:n]]


def attribution_graph(
    model,
    prompt,
    transcoders: Sequence[SAE],
    *,
    max_n_logits: int = 10,
    desired_logit_prob: float = 0.95,
    compose: bool | None = None,
    batch_size: int = 256,
    progress: bool | None = None,
) -> AttributionGraph:
    """The attribution graph of one prompt in the replacement model of `transcoders`.

    Parameters
    ----------
    model : dclens.Model
        The model (not Mixture-of-Head).
    prompt : str or array_like of int
        One prompt: text or [T] token ids.
    transcoders : sequence of SAE
        One transcoder per layer, blocks.{l}.ln_mlp (or mlp_input) -> blocks.{l}.mlp.out.
    max_n_logits : int
        The most logit targets (>= 1).
    desired_logit_prob : float
        Targets are the likeliest next tokens until they hold this much probability, in (0, 1].
    compose : bool or None
        The compose and lending nodes (compose_nodes.py, lending_nodes.py); None: where the
        model has a DCMHA compose that compose_nodes supports.
    batch_size : int
        Targets per backward batch (>= 1; memory ~ batch_size * T * d_model * 8 bytes).
    progress : bool or None
        dclens.progress's bar over the target batches.

    Returns
    -------
    AttributionGraph
        Its nodes, adjacency and logit targets.

    Raises
    ------
    dclens.Error
        A prompt that is not one sequence, transcoders that do not fit the model (naming the
        layer), max_n_logits or batch_size below 1, desired_logit_prob outside (0, 1], or
        compose=True on a model compose_nodes does not support.
    """
    c = model.config
    max_n_logits = check_index("attribution_graph: max_n_logits", max_n_logits, 1, 1 << 20)
    batch_size = check_index("attribution_graph: batch_size", batch_size, 1, 1 << 20)
    if not isinstance(desired_logit_prob, (int, float)) or not 0.0 < desired_logit_prob <= 1.0:
        raise Error("attribution_graph: desired_logit_prob must be in (0, 1], not %r" % (desired_logit_prob,))
    if compose is None:
        try:
            compose_nodes.check_supported(c)
            compose = True
        except Error:
            compose = False
    elif compose:
        compose_nodes.check_supported(c)
    toks = model.to_tokens(prompt) if isinstance(prompt, str) else np.asarray(prompt)
    rep = Replacement(model, toks, transcoders, compose=bool(compose))
    return _Builder(rep, max_n_logits, desired_logit_prob, bool(compose)).build(batch_size, progress)


class _Builder:
    """attribution_graph's steps: the nodes, the logits' backward (and the compose nodes
    from it), then the rows of every target batch."""

    def __init__(self, rep: Replacement, max_n: int, mass: float, compose: bool):
        self.rep, self.compose = rep, compose
        L, T = rep.L, rep.T
        self.logit_tok, self.logit_p = _logit_targets(rep.logits, max_n, mass)
        feats = [(l, t, f) for l in range(L) for t, f in zip(*np.nonzero(rep.acts[l]))]
        self.feats = np.array(feats, np.int64).reshape(-1, 3)
        nodes = [Node("feature", int(l), int(t), int(f), float(rep.acts[l][t, f])) for l, t, f in feats]
        self.n_feat = len(nodes)
        self.n_comp = L * T if compose else 0
        self.comp0 = len(nodes)
        nodes += [Node("compose", l, t, -1, 0.0) for l in range(L) for t in range(T)] if compose else []
        N = rep.c.n_head
        self.lends = [(l, m, n) for l in range(L) for m in range(N) for n in range(N) if m != n] if compose else []
        self.lend0 = len(nodes)
        nodes += [Node("lend", l, -1, m * N + n, 0.0, (m, n)) for l, m, n in self.lends]
        self.err0 = len(nodes)
        nodes += [Node("error", l, t, -1, float(np.linalg.norm(rep.error[l][t]))) for l in range(L) for t in range(T)]
        self.tok0 = len(nodes)
        nodes += [Node("token", -1, t, int(rep.tokens[t]), float(np.linalg.norm(rep.embed[t]))) for t in range(T)]
        self.logit0 = len(nodes)
        W_U = rep.W_U
        self.logit_vec = W_U[self.logit_tok] - W_U.mean(0)  # [n_logits, D]: logit minus the mean logit
        lg = rep.logits[-1]
        nodes += [Node("logit", L, T - 1, int(k), float(lg[k] - lg.mean())) for k in self.logit_tok]
        self.nodes = nodes
        self.A = np.zeros((len(nodes), len(nodes)))
        self.W_enc = [tc.W_enc.astype(np.float64) for tc in rep.transcoders]  # [D, F]
        self.W_dec = [tc.W_dec for tc in rep.transcoders]  # [F, D] float32, as G
        self.err32 = [e.astype(np.float32) for e in rep.error]
        self.embed32 = rep.embed.astype(np.float32)
        # the sources writing into each residual level: layer l's features and errors -> l + 1;
        # a layer's features at one position are consecutive nodes (sorted by layer, position)
        self.by_pos: list[list[tuple[int, int, int]]] = [[] for _ in range(L)]  # (t, first, end)
        for i, (l, t, _) in enumerate(self.feats.tolist()):
            if self.by_pos[l] and self.by_pos[l][-1][0] == t:
                self.by_pos[l][-1] = (t, self.by_pos[l][-1][1], i + 1)
            else:
                self.by_pos[l].append((t, i, i + 1))

    def build(self, batch_size: int, progress) -> AttributionGraph:
        rep = self.rep
        targets = [("logit", i) for i in range(len(self.logit_tok))]
        comp_seeds = self._compose_seeds() if self.compose else None
        if self.compose:
            targets += [("compose", i) for i in range(self.n_comp)]
            targets += [("lend", i) for i in range(len(self.lends))]
        targets += [("feature", i) for i in range(self.n_feat)]
        batches = [targets[i : i + batch_size] for i in range(0, len(targets), batch_size)]
        for batch in _progress.bar(batches, desc="attribution graph: target batches", progress=progress):
            seeds: dict = {}
            rows = []
            for k, (kind, i) in enumerate(batch):
                rows.append(self._row(kind, i))
                for key, pos, vec in self._seed(kind, i, comp_seeds):
                    seeds.setdefault(key, []).append((k, pos, vec))
            self._edges(np.array(rows), rep.backward(len(batch), seeds))
        return AttributionGraph(self.nodes, self.A, self.logit_p, rep.tokens, rep.L)

    def _row(self, kind: str, i: int) -> int:
        return {"logit": self.logit0, "compose": self.comp0, "lend": self.lend0, "feature": 0}[kind] + i

    def _seed(self, kind: str, i: int, comp_seeds) -> list:
        """Where target i of `kind` reads the residual: (point, position, vector) triples."""
        rep = self.rep
        if kind == "logit":
            return [(("resid", rep.L), rep.T - 1, rep.norm_T_at("final", rep.T - 1, self.logit_vec[i]))]
        if kind == "compose":
            l, t = divmod(i, rep.T)
            return [(("resid", l), t, comp_seeds[l][t])]
        if kind == "lend":  # every position: head m's queries and keys
            l = self.lends[i][0]
            return [(("resid", l), t, v) for t, v in enumerate(self.lend_seeds[i])]
        l, t, f = (int(x) for x in self.feats[i])
        return [(("mlp_input", l), t, rep.read_seed(l, t, self.W_enc[l][:, f]))]

    def _edges(self, rows: np.ndarray, levels) -> None:
        """Fill adjacency[rows] from the gradients at each residual level."""
        rep, A = self.rep, self.A
        for level, G in levels:
            if level == 0:
                A[rows, self.tok0 : self.tok0 + rep.T] = np.einsum("ktd,td->kt", G, self.embed32)
                continue
            l = level - 1  # layer l's features and errors write into level l + 1
            e0 = self.err0 + l * rep.T
            A[rows, e0 : e0 + rep.T] = np.einsum("ktd,td->kt", G, self.err32[l])
            for t, c0, c1 in self.by_pos[l]:
                f = self.feats[c0:c1, 2]
                A[rows, c0:c1] = (G[:, t] @ self.W_dec[l][f].T) * rep.acts[l][t, f]

    def _compose_seeds(self) -> list[np.ndarray]:
        """The compose nodes' input vectors (at each level's residual), their values and their
        edges into the logits, from one backward of the logit targets; the lending nodes'
        likewise (self.lend_seeds)."""
        rep = self.rep
        n = len(self.logit_tok)
        seeds = {
            ("resid", rep.L): [(k, rep.T - 1, rep.norm_T_at("final", rep.T - 1, self.logit_vec[k])) for k in range(n)]
        }
        G_at = {level: G.copy() for level, G in rep.backward(n, seeds)}
        out = []
        w = self.logit_p / self.logit_p.sum()
        for l in range(rep.L):
            G_out = G_at[l + 1]  # the attention of layer l writes level l + 1 (or h, equal here)
            g_u, g_scores = compose_nodes.compose_backward(rep, l, G_out)  # [n, T, D] at u = ln_attn
            self._lending(l, g_scores, w)
            u0 = rep.norm_frozen(("attn", l), rep.resid[l])  # u without its bias
            per_logit = (g_u * u0).sum(-1)  # [n, T]: each logit's first-order share
            g = np.einsum("k,ktd->td", w, g_u)
            for t in range(rep.T):
                i = self.comp0 + l * rep.T + t
                node = self.nodes[i]
                self.nodes[i] = Node(node.kind, node.layer, node.pos, -1, float(g[t] @ u0[t]))
                self.A[self.logit0 : self.logit0 + n, i] = per_logit[:, t]
            out.append(rep.norm_T(("attn", l), g))  # [T, D]
        return out

    def _lending(self, l: int, g_scores: np.ndarray, w: np.ndarray) -> None:
        """Layer l's lending nodes: values, edges into the logits, seeds (lending_nodes.py)."""
        rep, N = self.rep, self.rep.c.n_head
        if not hasattr(self, "lend_seeds"):
            self.lend_seeds: list = [None] * len(self.lends)
        qk = lending_nodes.QK(rep, l)
        C = lending_nodes.lend_maps(rep.model, l, rep.extra["blocks.%d.ln_attn" % l], not rep.c.query_wise)
        V = lending_nodes.lending_values(C, qk.scores, g_scores)  # [n, M, N]
        Hw = np.einsum("k,knts->nts", w, g_scores)
        n_logit = len(self.logit_tok)
        for i, (layer, m, n) in enumerate(self.lends):
            if layer != l:
                continue
            j = self.lend0 + i
            self.nodes[j] = Node("lend", l, -1, m * N + n, float(w @ V[:, m, n]), (m, n))
            self.A[self.logit0 : self.logit0 + n_logit, j] = V[:, m, n]
            self.lend_seeds[i] = qk.grad(m, Hw[n] * C[m, n])
