"""The model as a graph of edges, for circuits (issue 37): edges between
senders and receivers through the residual stream, and, in DCMHA, the edges
by which one head lends its scores or weights to another through a compose
branch. Exact edge patching (the reference), edge attribution (EAP, and its
integrated-gradients form EAP-IG), circuits and their faithfulness.

    g = dclens.graph.build(model)
    g.edges[:3]            # ['embed->L0.H0.q', 'embed->L0.H0.k', 'embed->L0.H0.v']
    s = dclens.graph.attribute_edges(model, clean, corrupted, ("logit_diff", -1, good, bad), method="eap-ig")
    s.top(10)              # [(edge, score), ...] largest |score| first
    c = s.circuit(top_n=50)
    dclens.graph.faithfulness(model, c, clean, corrupted, metric)

Nodes (docs/circuits.md):
- senders: ``embed``, ``L{l}.H{h}`` (the head's output, attn.head_out),
  ``L{l}.mlp`` (mlp.out);
- receivers: ``L{l}.H{h}.q`` / ``.k`` / ``.v`` (the residual as that head's
  Q, K, V input reads it: attn.{q,k,v}_input), ``L{l}.dyn`` (the residual the
  layer's dynamic-weight MLP reads: attn.dyn_input; DCMHA only), ``L{l}.mlp``
  (mlp_input), ``logits`` (the final norm's input).
Edges:
- residual ``"{sender}->{receiver}"`` for every sender upstream of the
  receiver (a head of layer l reaches the MLP of layer l only in a
  sequential block);
- composition, DCMHA only: ``"L{l}.H{m}->L{l}.H{n}.{pre|post}.{qp|kp}"``
  (source head m's phase input, the raw scores for pre, the softmax pattern
  for post, as lent to target head n through that branch; ``static`` too on
  Talking-Heads models; pairs across compose groups left out; the branches
  a query- or key-wise model lacks left out), and the self branches
  ``"L{l}.H{n}->L{l}.H{n}.{pre|post}.{skip|qg|kg}"``.

Patching a set of edges: each receiver sees, for each patched edge into it,
the sender's value in the corrupted run in place of its value in this run
(residual: the difference added to the receiver's input before its norm;
composition: the source head's corrupted phase input times this run's map
entry), and everything else as this run computes it. So no edge gives the
clean run and every edge the corrupted one (tested to float32 rounding).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import warnings
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from .._core import memplan, tapes
from .._core import progress as _progress
from .._core.batch import prompt_pairs, role_weights
from .._core.checks import ArgumentError, Error, check_index, metric_value, unknown_name
from .._core.hooks import read_only
from .._core.mask import allowed, layer_window
from .._core.names import hook_name
from . import routing
from .grad import target_value_and_grad
from .patching import MIN_GAP, PatchingWarning

METHODS = ("eap", "eap-ig", "eap-ig-activations")
BRANCH_COEF = ("qp", "kp", "static")  # branches through which a head lends to others
SELF_BRANCHES = ("skip", "qg", "kg")


@dataclasses.dataclass(frozen=True)
class Edge:
    """One edge: its name and where patching or attributing it reads and writes.

    Attributes
    ----------
    name : str
        "{sender}->{receiver}" (module docstring, docs/circuits.md).
    kind : str
        "resid" (through the residual stream) or "comp" (inside a layer,
        through a compose branch).
    sender : str
        The sender node: "embed", "L{l}.H{h}" or "L{l}.mlp".
    receiver : str
        The receiver node ("L3.H2.q", "L3.dyn", "L3.mlp", "logits") or, for
        "comp", "L{l}.H{n}.{phase}.{branch}".
    layer : int
        The receiver's layer (-1: the logits).
    head : int
        The receiver's head (-1: none).
    src_head : int
        "comp": the source head m whose phase input is lent (-1 otherwise).
    phase : str
        "comp": "pre" (scores) or "post" (weights); "" otherwise.
    branch : str
        "comp": "skip", "qp", "kp", "qg", "kg" or "static"; "" otherwise.
    """

    name: str
    kind: str  # "resid" or "comp"
    sender: str  # node name
    receiver: str  # node name ("L3.H2.q", "logits", ...) or, for "comp", "L{l}.H{n}.{phase}.{branch}"
    layer: int  # the receiver's layer (-1: logits)
    head: int  # the receiver's head (-1: none)
    src_head: int = -1  # comp: the source head
    phase: str = ""  # comp: "pre" / "post"
    branch: str = ""  # comp: skip, qp, kp, qg, kg, static

    @property
    def node(self) -> str:
        """The node the receiver belongs to: a head for its q, k, v and
        branches; the layer's dyn or MLP; the logits."""
        if self.receiver == "logits" or self.receiver.endswith((".mlp", ".dyn")):
            return self.receiver
        return "L%d.H%d" % (self.layer, self.head)

    @property
    def lends(self) -> bool:
        """A composition edge through which one head lends to another (qp, kp, static)."""
        return self.kind == "comp" and self.branch in BRANCH_COEF


@dataclasses.dataclass
class Graph:
    """Nodes and edges of a model (build): ``edges`` names, stable across runs.

    Attributes
    ----------
    senders : list of str
        "embed", then per layer its heads "L{l}.H{h}" and "L{l}.mlp", in
        forward order.
    receivers : list of str
        Per layer its heads' "L{l}.H{h}.q" / ".k" / ".v", "L{l}.dyn" (DCMHA)
        and "L{l}.mlp", then "logits".
    edges : list of str
        Every edge's name, residual and composition, in a fixed order (the
        order of ``EdgeScores.scores``).
    detail : dict of str to Edge
        Each edge's parts by name.
    n_layer : int
        The model's layers.
    n_head : int
        Heads per layer.
    """

    senders: list[str]
    receivers: list[str]
    edges: list[str]
    detail: dict[str, Edge]
    n_layer: int
    n_head: int

    def index(self, names: Sequence[str]) -> list[int]:
        """Positions of edge names in ``edges``.

        Parameters
        ----------
        names : sequence of str
            Edge names (``edges``' spelling).

        Returns
        -------
        list of int
            Each name's position in ``edges``, in the order given.

        Raises
        ------
        dclens.UnknownNameError
            A name that is not an edge of this graph (with the closest names).
        """
        pos = {e: i for i, e in enumerate(self.edges)}
        out = []
        for n in names:
            if n not in pos:
                raise unknown_name("edge", n, self.edges, "", "graph.build(model).edges")
            out.append(pos[n])
        return out


@functools.cache  # names of a few thousand edges, asked per edge per pass
def _sender_hook(s: str) -> tuple[str, int]:
    """(hook name, head or -1) of a sender node."""
    if s == "embed":
        return "embed", -1
    l, rest = s[1:].split(".", 1)
    if rest == "mlp":
        return hook_name(int(l), "mlp.out"), -1
    return hook_name(int(l), "attn.head_out"), int(rest[1:])


@functools.cache
def _receiver_hook(r: str, n_layer: int) -> tuple[str, int]:
    """(hook name, head or -1) where a residual edge into receiver r is patched."""
    if r == "logits":
        return hook_name(n_layer - 1, "resid_post"), -1
    parts = r.split(".")
    l = int(parts[0][1:])
    if parts[1] == "dyn":
        return hook_name(l, "attn.dyn_input"), -1
    if parts[1] == "mlp":
        return "blocks.%d.mlp_input" % l, -1
    return hook_name(l, "attn.%s_input" % parts[2]), int(parts[1][1:])


def build(model) -> Graph:
    """The model's graph: senders, receivers and every edge (module docstring).

    Parameters
    ----------
    model : dclens.Model
        A loaded model (DCPythia, DCFormer++, Pythia and their variants):
        Pythia's graph has residual edges only; DCMHA adds the composition
        edges its compose maps have (pairs across compose groups left out).

    Returns
    -------
    Graph
        The nodes and edges, named as docs/circuits.md says.
    """
    c, plan = model.config, model.plan
    L, N = c.n_layer, c.n_head
    senders, receivers, edges = ["embed"], [], []
    detail: dict[str, Edge] = {}
    G = max(1, c.compose_groups if c.use_dcmha else 1)

    def add(e: Edge) -> None:
        edges.append(e.name)
        detail[e.name] = e

    for l in range(L):
        pl = plan[l]
        heads_rx = ["L%d.H%d.%s" % (l, h, x) for h in range(N) for x in ("q", "k", "v")]
        layer_rx = heads_rx + (["L%d.dyn" % l] if pl.dcmha else [])
        for r in layer_rx:
            receivers.append(r)
            head = int(r.split(".")[1][1:]) if ".H" in r else -1
            for s in senders:
                add(Edge("%s->%s" % (s, r), "resid", s, r, l, head))
        # composition inside the layer
        if pl.dcmha:
            for ph in ("pre", "post"):
                for n in range(N):
                    for b in SELF_BRANCHES:
                        if _has_branch(model, l, ph, b):
                            add(_comp_edge(l, n, n, ph, b))
                    for b in BRANCH_COEF:
                        if not _has_branch(model, l, ph, b):
                            continue
                        for m in range(N):
                            if m * G // N != n * G // N:
                                continue  # across compose groups: zero weight
                            add(_comp_edge(l, m, n, ph, b))
        heads_tx = ["L%d.H%d" % (l, h) for h in range(N)]
        mlp_rx = "L%d.mlp" % l
        receivers.append(mlp_rx)
        upstream = senders + ([] if pl.parallel_residual else heads_tx)
        for s in upstream:
            add(Edge("%s->%s" % (s, mlp_rx), "resid", s, mlp_rx, l, -1))
        senders += heads_tx + ["L%d.mlp" % l]
    receivers.append("logits")
    for s in senders:
        add(Edge("%s->logits" % s, "resid", s, "logits", -1, -1))
    return Graph(senders, receivers, edges, detail, L, N)


def _comp_edge(l: int, m: int, n: int, phase: str, branch: str) -> Edge:
    """Source head m's phase input lent to target head n through a branch of layer l."""
    rx = "L%d.H%d.%s.%s" % (l, n, phase, branch)
    return Edge("L%d.H%d->%s" % (l, m, rx), "comp", "L%d.H%d" % (l, m), rx, l, n, m, phase, branch)


def _has_branch(model, l: int, phase: str, branch: str) -> bool:
    return hook_name(l, "attn.%s.%s" % (phase, branch)) in model.runner.hook_table.key


# ---------------------------------------------------------------- inputs


def _metric_values(metric, logits: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The metric of each pair's logits (its real positions, [len, V]): one
    callable for every pair, or a list of one per pair."""
    fns = _per_pair(metric, len(logits), callable, "a function of the [T, V] logits")
    vals = np.array([metric_value(f, lg[:n]) for f, lg, n in zip(fns, logits, lengths)])
    if not np.all(np.isfinite(vals)):
        bad = np.nonzero(~np.isfinite(vals))[0]
        raise Error("metric: returned %r for prompt pair %d (NaN or inf)" % (vals[bad[0]], bad[0]))
    return vals


# ---------------------------------------------------------------- exact patching


def _per_pair(metric, B: int, ok, what: str) -> list:
    """metric for each of B pairs: one for all, or a list of B."""
    if isinstance(metric, list):
        if len(metric) != B:
            raise ArgumentError("metric: a list of %d metrics for %d prompt pairs (one per pair)" % (len(metric), B))
        fns = metric
    else:
        fns = [metric] * B
    for f in fns:
        if not ok(f):
            raise ArgumentError("metric must be %s (or a list of one per pair), got %r" % (what, f))
    return fns


def _edges(graph: Graph, edges) -> list[Edge]:
    if isinstance(edges, str) or not isinstance(edges, (list, tuple, set, frozenset)):
        raise ArgumentError("edges must be a list of edge names (graph.edges), not %r" % (edges,))
    graph.index(list(edges))  # unknown names: an Error with did-you-mean
    return [graph.detail[e] for e in edges]


def _sender_values(model, toks: np.ndarray, senders: Sequence[str]) -> dict[str, np.ndarray]:
    names = sorted({_sender_hook(s)[0] for s in senders})
    _, cache = model.run_with_cache(toks, names=names)
    return {n: np.asarray(cache[n]) for n in names}


@functools.cache
def _phase_names(l: int, phase: str, branch: str) -> tuple[str, ...]:
    """The hooks a composition edge's term reads: the phase input and the dynamic weights it needs."""
    x = hook_name(l, "attn.%s" % ("scores" if phase == "pre" else "pattern"))
    need = {"qp": ("qw1", "qw2"), "kp": ("kw1", "kw2"), "qg": ("qdd",), "kg": ("kdd",)}.get(branch, ())
    return (x,) + tuple(hook_name(l, "attn.dyn.%s.%s" % (phase, w)) for w in need)


def _comp_coef(model, e: Edge, vals: dict[str, np.ndarray]) -> np.ndarray:
    """[..., T, S] the map entry (source e.src_head -> target e.head) of the edge's branch."""
    l, ph, m, n = e.layer, e.phase, e.src_head, e.head
    d = lambda w: vals[hook_name(l, "attn.dyn.%s.%s" % (ph, w))].astype(np.float64)  # noqa: E731
    X = vals[hook_name(l, "attn.%s" % ("scores" if ph == "pre" else "pattern"))]
    T, S = X.shape[-2:]
    if e.branch == "skip":
        return np.ones(X.shape[:-3] + (T, S))
    if e.branch == "qg":
        return np.broadcast_to(d("qdd")[..., :, n, None], X.shape[:-3] + (T, S))
    if e.branch == "kg":
        return np.broadcast_to(d("kdd")[..., None, :, n], X.shape[:-3] + (T, S))
    block = routing._group_block(model)[m, n]
    if e.branch == "qp":
        c = np.einsum("...tr,...tr->...t", d("qw1")[..., m], d("qw2")[..., n]) * block
        return np.broadcast_to(c[..., :, None], X.shape[:-3] + (T, S))
    if e.branch == "kp":
        c = np.einsum("...sr,...sr->...s", d("kw1")[..., m], d("kw2")[..., n]) * block
        return np.broadcast_to(c[..., None, :], X.shape[:-3] + (T, S))
    W = routing.static_map(model, l, ph)
    assert W is not None
    return np.full(X.shape[:-3] + (T, S), W[m, n] * block)


def _phase_input(vals: dict[str, np.ndarray], e: Edge) -> np.ndarray:
    X = vals[hook_name(e.layer, "attn.%s" % ("scores" if e.phase == "pre" else "pattern"))]
    return X[..., e.src_head, :, :].astype(np.float64)


def _masked(model, l: int, a: np.ndarray) -> np.ndarray:
    T, S = a.shape[-2:]
    return np.where(allowed(T, S, layer_window(model, l)), a, 0.0)


def patch(model, clean, corrupted, metric: Callable, edges: Sequence[str], graph: Graph | None = None) -> float:
    """The metric (averaged over prompt pairs) of the clean run with exactly
    ``edges`` patched from the corrupted run (module docstring). ``edges=[]``
    gives the clean metric, every edge the corrupted one.

    Parameters
    ----------
    model : dclens.Model
    clean, corrupted : str, list of str, array_like of int, or (tokens, lengths)
        The prompt pairs: [B, T] tokens (or text, or ``model.to_tokens``'s
        pair, either padding side); each pair one length, pairs of
        different lengths right-padded (pad positions count nothing).
    metric : callable or list of callable
        A function of one pair's logits [T, V] (its real positions) to a
        number, e.g. ``dclens.patching.logit_diff(good, bad)``; or a list of
        one per pair.
    edges : list of str
        The edges to patch (``Graph.edges`` names); the rest stay clean.
    graph : Graph, optional
        The model's graph (``build(model)`` when None: pass it to reuse it).

    Returns
    -------
    float
        The metric of the patched clean run, averaged over the pairs.

    Raises
    ------
    dclens.ArgumentError
        ``edges`` not a list of names, or a metric list of the wrong length.
    dclens.UnknownNameError
        An edge name the graph does not have (with the closest names).
    dclens.Error
        Pairs whose clean and corrupted prompts differ in length, or a
        metric that is NaN or inf.
    """
    g = graph or build(model)
    es = _edges(g, edges)
    pr = prompt_pairs(model, clean, corrupted)
    _per_pair(metric, len(pr.clean), callable, "a function of the [T, V] logits")
    hooks = _patch_hooks(model, g, es, pr.corrupted)
    logits = model.run_with_hooks(pr.clean, hooks)
    return float(np.mean(_metric_values(metric, logits, pr.lengths)))


def _corrupted_values(model, es: list[Edge], xtoks: np.ndarray) -> dict[str, np.ndarray]:
    """What the edges read of the corrupted run: senders' outputs, phase inputs."""
    names = sorted({_sender_hook(e.sender)[0] for e in es if e.kind == "resid"})
    names += sorted({_phase_names(e.layer, e.phase, e.branch)[0] for e in es if e.kind == "comp"})
    if not names:
        return {}
    _, cc = model.run_with_cache(xtoks, names=names)
    return {n: np.asarray(cc[n]) for n in names}


def patch_each(
    model, clean, corrupted, metric, edges: Sequence[str], graph: Graph | None = None, progress=None
) -> np.ndarray:
    """The metric (averaged over pairs) with each edge patched alone:
    ``patch(..., [edge])`` for every edge, the corrupted run read once.

    Parameters
    ----------
    model : dclens.Model
        The model; its corrupted run is read once for all the edges.
    clean, corrupted : str, list of str, array_like of int, or (tokens, lengths)
        The prompt pairs, as in ``patch``.
    metric : callable or list of callable
        A function of one pair's [T, V] logits, as in ``patch``.
    edges : list of str
        The edges, each patched on its own (``Graph.edges`` names).
    graph : Graph, optional
        The model's graph, as in ``patch``.
    progress : bool, optional
        None: a bar where someone watches, plain lines in a log; True: a
        bar; False: nothing (``dclens.progress``).

    Returns
    -------
    numpy.ndarray
        [len(edges)] float64: the metric with that edge alone patched.

    Raises
    ------
    dclens.ArgumentError
        ``edges`` not a list of names, or a metric list of the wrong length.
    dclens.UnknownNameError
        An edge name the graph does not have.
    dclens.Error
        Pairs of unequal lengths, or a metric that is NaN or inf.
    """
    g = graph or build(model)
    es = _edges(g, edges)
    pr = prompt_pairs(model, clean, corrupted)
    _per_pair(metric, len(pr.clean), callable, "a function of the [T, V] logits")
    corr = _corrupted_values(model, es, pr.corrupted)
    out = np.empty(len(es))
    for i, e in enumerate(_progress.bar(es, desc="graph.patch_each", progress=progress)):
        logits = model.run_with_hooks(pr.clean, _patch_hooks(model, g, [e], pr.corrupted, corr))
        out[i] = float(np.mean(_metric_values(metric, logits, pr.lengths)))
    return out


def _patch_hooks(model, g: Graph, es: list[Edge], xtoks: np.ndarray, corr: dict[str, np.ndarray] | None = None):
    """The hooks of one patched clean run (batched like xtoks)."""
    resid = [e for e in es if e.kind == "resid"]
    comp = [e for e in es if e.kind == "comp"]
    if corr is None:
        corr = _corrupted_values(model, es, xtoks)
    cur: dict[str, np.ndarray] = {}

    def keep(name):
        return read_only(lambda a, _n: cur.__setitem__(name, np.array(a)))

    hooks: list[tuple[str, Callable]] = []
    reads = sorted(
        {_sender_hook(e.sender)[0] for e in resid} | {n for e in comp for n in _phase_names(e.layer, e.phase, e.branch)}
    )
    hooks += [(n, keep(n)) for n in reads]
    by_rx: dict[str, list[Edge]] = {}
    for e in resid:
        by_rx.setdefault(_receiver_hook(e.receiver, g.n_layer)[0], []).append(e)
    for rx, group in by_rx.items():

        def add_resid(a, _n, group=group):
            for e in group:
                sh, sh_head = _sender_hook(e.sender)
                # the head's slice first: the difference of one head, not of all
                at = (Ellipsis, sh_head, slice(None)) if sh_head >= 0 else (Ellipsis,)
                delta = corr[sh][at] - cur[sh][at]
                _, rh = _receiver_hook(e.receiver, g.n_layer)
                if rh >= 0:
                    a[..., rh, :] += delta.astype(np.float32)
                else:
                    a += delta.astype(np.float32)
            return a

        hooks.append((rx, add_resid))
    by_branch: dict[str, list[Edge]] = {}
    for e in comp:
        by_branch.setdefault(hook_name(e.layer, "attn.%s.%s" % (e.phase, e.branch)), []).append(e)
    for bh, group in by_branch.items():

        def add_comp(a, _n, group=group):
            for e in group:
                dx = _phase_input(corr, e) - _phase_input(cur, e)
                term = _masked(model, e.layer, dx * _comp_coef(model, e, cur))
                a[..., e.head, :, :] += term.astype(np.float32)
            return a

        hooks.append((bh, add_comp))
    return hooks


# ---------------------------------------------------------------- edge attribution


@dataclasses.dataclass
class EdgeScores:
    """Scores aligned with ``graph.edges`` (attribute): the metric's estimated
    change when that edge alone is patched from the corrupted run.

    Attributes
    ----------
    graph : Graph
        The graph the scores belong to.
    scores : numpy.ndarray
        [len(graph.edges)] float64, in the metric's units, averaged over
        the prompt pairs.
    method : str
        "eap", "eap-ig" or "eap-ig-activations".
    steps : int
        The interpolation steps (1 for "eap").
    per_position : numpy.ndarray or None
        [len(graph.edges), T] (``positions=True``): by token position (a
        composition edge by its query position); their sum over positions
        is ``scores``.
    per_role : numpy.ndarray or None
        [len(graph.edges), len(roles)] (``roles=``): by role.
    roles : tuple of str
        The role names of ``per_role``'s columns.
    """

    graph: Graph
    scores: np.ndarray  # [len(graph.edges)] float64
    method: str
    steps: int
    per_position: np.ndarray | None = None  # [len(graph.edges), T] (positions=True): by token / query position
    per_role: np.ndarray | None = None  # [len(graph.edges), len(roles)] (roles=): by role
    roles: tuple[str, ...] = ()

    def top(self, k: int = 20) -> list[tuple[str, float]]:
        """The k edges of largest |score|, largest first.

        Parameters
        ----------
        k : int, default 20
            How many (>= 1; fewer when the graph has fewer edges).

        Returns
        -------
        list of (str, float)
            (edge name, score) pairs, ties in graph order.

        Raises
        ------
        dclens.ArgumentError
            k not an integer >= 1.
        """
        k = check_index("top: k", k, 1, 1 << 40)
        order = np.argsort(-np.abs(self.scores), kind="stable")[:k]
        return [(self.graph.edges[i], float(self.scores[i])) for i in order]

    def to_pandas(self):
        """The scores as a table.

        Returns
        -------
        pandas.DataFrame
            One row per edge in graph order: edge, kind, sender, receiver,
            score.

        Raises
        ------
        dclens.Error
            pandas is not installed.
        """
        try:
            import pandas as pd  # optional: pandas is not a dependency
        except ImportError:
            raise Error("EdgeScores.to_pandas needs pandas (pip install pandas)") from None
        d = self.graph.detail
        return pd.DataFrame(
            {
                "edge": self.graph.edges,
                "kind": [d[e].kind for e in self.graph.edges],
                "sender": [d[e].sender for e in self.graph.edges],
                "receiver": [d[e].receiver for e in self.graph.edges],
                "score": self.scores,
            }
        )

    def circuit(self, top_n: int | None = None, threshold: float | None = None) -> Circuit:
        """The edges of largest |score| as a circuit.

        Parameters
        ----------
        top_n : int, optional
            Keep the top_n edges by |score|.
        threshold : float, optional
            Keep the edges with |score| >= threshold (metric units, >= 0).
            Give exactly one of top_n and threshold.

        Returns
        -------
        Circuit
            The kept edges with their scores.

        Raises
        ------
        dclens.ArgumentError
            Both or neither of top_n and threshold, top_n < 1, or a
            threshold that is negative or not finite.
        """
        if (top_n is None) == (threshold is None):
            raise ArgumentError("circuit: give top_n or threshold (one of them)")
        if top_n is not None:
            keep = [e for e, _ in self.top(top_n)]
        else:
            if (
                isinstance(threshold, (bool, np.bool_))
                or not isinstance(threshold, (int, float, np.integer, np.floating))
                or not np.isfinite(threshold)
                or threshold < 0
            ):
                raise ArgumentError("circuit: threshold must be a finite number >= 0, got %r" % (threshold,))
            keep = [e for e, s in zip(self.graph.edges, self.scores) if abs(s) >= threshold]
        sc = dict(zip(self.graph.edges, self.scores))
        return Circuit(self.graph, frozenset(keep), {e: float(sc[e]) for e in keep})


@dataclasses.dataclass(frozen=True)
class Circuit:
    """A set of edges of a graph.

    Attributes
    ----------
    graph : Graph
        The graph the edges belong to.
    edges : frozenset of str
        The circuit's edges (``graph.edges`` names).
    scores : dict of str to float, optional
        Each edge's score when the circuit came from ``EdgeScores.circuit``
        (None otherwise; not compared by ``==``).
    """

    graph: Graph
    edges: frozenset
    scores: dict[str, float] | None = dataclasses.field(default=None, compare=False)  # edge -> score

    def plot(self, title: str | None = None):
        """The circuit as a layered picture (a matplotlib Figure): the embedding
        at the bottom, a row per layer (its heads and MLP), the logits at the
        top; residual edges as lines between rows, composition edges as arcs
        inside a row (orange: lending through qp / kp / static; grey: a head's
        own branches); widths by |score|, colour by sign (blue +, red -).

        Parameters
        ----------
        title : str, optional
            The figure's title (None: the number of edges, and of those the
            composition edges).

        Returns
        -------
        matplotlib.figure.Figure
            The picture (shown inline in a notebook).
        """
        from ..viz.plots import plot_circuit  # lazy: viz.plots loads matplotlib, when a figure is drawn

        return plot_circuit(self, title)

    def _repr_png_(self):
        buf = io.BytesIO()
        self.plot().savefig(buf, format="png", dpi=80)
        return buf.getvalue()

    @property
    def nodes(self) -> list[str]:
        """The senders and receivers of edges that reach the logits through the circuit."""
        into: dict[str, list[Edge]] = {}
        for e in self.edges:
            d = self.graph.detail[e]
            into.setdefault(_node_of(d), []).append(d)
        seen, todo = set(), ["logits"]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for d in into.get(n, []):
                todo.append(d.sender)
        order = {n: i for i, n in enumerate(self.graph.senders + self.graph.receivers)}
        return sorted(seen, key=lambda n: order.get(n, -1))


def _node_of(d: Edge) -> str:
    """The node an edge's receiver belongs to (Edge.node)."""
    return d.node


def _is_target(metric) -> bool:
    t = getattr(metric, "target", metric)
    return isinstance(t, tuple) and bool(t) and isinstance(t[0], str)


def _target(metric) -> tuple:
    if _is_target(metric):
        return getattr(metric, "target", metric)
    raise ArgumentError(
        "metric: edge attribution differentiates the metric, so give a target tuple (('logit_diff', pos, good, "
        "bad), ('logprob', pos, tok), ('logit', pos, tok)) or a dclens.patching metric, not %r" % (metric,)
    )


def _grad_names(model, g: Graph) -> list[str]:
    names = set()
    for e in g.detail.values():
        if e.kind == "resid":
            names.add(_receiver_hook(e.receiver, g.n_layer)[0])
        else:
            names.add(hook_name(e.layer, "attn.%s.%s" % (e.phase, e.branch)))
    order = {n: i for i, n in enumerate(model.hook_names)}
    return sorted(names, key=order.__getitem__)


def attribute_edges(
    model,
    clean,
    corrupted,
    metric,
    *,
    method: str = "eap",
    steps: int = 16,
    graph: Graph | None = None,
    max_tape_bytes: int | None = None,
    progress: bool | None = None,
    positions: bool = False,
    roles=None,
    max_grad_bytes: int | None = None,
) -> EdgeScores:
    """Score every edge of the graph by edge attribution patching.

    An edge's score is (sender's corrupted value - its clean value) . d
    metric / d (receiver's input), summed over positions and averaged over
    the prompt pairs: a first-order estimate of ``patch(..., [edge]) -
    patch(..., [])``. For a composition edge the sender's value is the
    source head's phase input times the clean run's map entry, and the
    gradient is at the target head's branch map.

    Parameters
    ----------
    model : dclens.Model
    clean, corrupted : prompts
        A string, a list of strings, [B, T] integer tokens, or the
        (tokens, lengths) pair ``model.to_tokens`` returns (either padding
        side): B prompt pairs, each pair one length; pairs of different
        lengths are right-padded, and pad positions score nothing.
    metric : target tuple, patching metric, or a list of one per pair
        What is differentiated: ``("logit_diff", pos, good, bad)``,
        ``("logprob", pos, tok)``, ``("logit", pos, tok)`` (pos counts in
        each pair's own length: -1 is its last real token), or a
        ``dclens.patching.logit_diff`` / ``logprob`` metric.
    method : {"eap", "eap-ig", "eap-ig-activations"}
        "eap": the gradient of the clean run (Syed et al. 2023). "eap-ig":
        the gradient averaged over ``steps`` runs whose input embeddings lie
        on the line from the clean prompts' to the corrupted ones', at the
        midpoints (k + 1/2) / steps (Hanna et al. 2024's input
        interpolation, "EAP-IG-inputs" in the MIB benchmark).
        "eap-ig-activations" (MIB's "EAP-IG-activations"): for each node in
        turn (the embedding, each layer's attention output, each layer's
        MLP output), ``steps`` runs with that node's output moved along the
        line from its clean to its corrupted value (the same midpoints; the
        node's moved value is a constant of the run, so no gradient passes
        through it), everything else computed from the clean prompts; the
        gradient averaged over all (2 L + 1) * steps runs. It tracks what one
        edge patched alone does better than "eap-ig" (BENCHMARKS.md).
    steps : int
        EAP-IG's number of runs (>= 1): in all ("eap-ig") or per node
        ("eap-ig-activations").
    graph : Graph, optional
        ``build(model)``, when it is at hand.
    max_tape_bytes : int, optional
        The gradient tape's memory budget (docs/gradients.md).
    progress : bool, optional
        A progress bar over the runs (None: in a terminal or notebook).
    positions : bool
        Also score each edge per position (``EdgeScores.per_position``
        [E, T]: a residual edge by the token position of its difference, a
        composition edge by the query position); not with padding.
    roles : dict or list of dicts, optional
        Positions aligned by role across pairs of different lengths (as
        position-aware EAP's schemas): ``{"subject": 3, "end": -1, "list":
        (4, 9)}`` for every pair, or one such dict per pair; a role is a
        position (negative: from the pair's own end), a (start, stop) span or
        a list of positions. Also scores each edge per role
        (``EdgeScores.per_role`` [E, R], names in ``.roles``): a residual edge
        by the role of its difference's position, a composition edge by the
        role of the query position. Positions in no role count in
        ``.scores`` only.
    max_grad_bytes : int, optional
        The most the gradients asked of one backward may take (None: a
        quarter of the free memory). When every receiver's gradient does not
        fit at once (a 6.9B-shaped model: the per-head q/k/v inputs' are
        [B, T, N, D] per layer), the layers go in chunks: one backward run
        in stages (``Tape.backward_stage``), each chunk's gradients scored as
        its stage hands them out and let go: the same scores, no backward
        run twice.

    Returns
    -------
    EdgeScores
        ``.scores`` [len(graph.edges)] float64, aligned with ``graph.edges``.

    Raises
    ------
    dclens.Error
        Bad prompts (pairs of different lengths, a left-padded bare pair),
        a bad ``metric``, ``method``, ``steps`` or ``positions`` (with
        padding), hooks in force on the model (gradients are of the plain
        model), a metric that is NaN or inf, a tape over the budget. The
        clean and corrupted metrics nearly equal (or the corrupted one
        higher) warn with ``dclens.PatchingWarning``, as ``patching.sweep``.
    """
    if not isinstance(positions, bool):
        raise ArgumentError("positions must be True or False, not %r" % (positions,))
    if method not in METHODS:
        raise ArgumentError("method must be one of %s, not %r" % (", ".join(map(repr, METHODS)), method))
    steps = check_index("steps", steps, 1, 1 << 20) if method != "eap" else 1
    if max_grad_bytes is not None:
        max_grad_bytes = check_index("max_grad_bytes", max_grad_bytes, 1, 1 << 62)
    model.runner.refuse_hooks("graph.attribute_edges")
    plan = _eap_plan(model, graph or build(model), clean, corrupted, metric, method, steps, positions, roles)
    budget = memplan.check_budget(max_tape_bytes, model)
    runs = _EapRuns(model, plan)  # the corrupted run's reads (and, but for "eap", the clean run's)
    scorer = _EdgeScorer(model, plan, runs.cc, runs.xc)
    bar = _progress.bar(total=len(plan.runs), desc="graph.attribute_edges (%s)" % method, progress=progress)
    try:
        grads = _gradient_runs(model, plan, runs, scorer, budget, max_grad_bytes, bar)
    finally:
        if bar is not None:
            bar.close()
    _warn_if_no_gap(plan, runs.clogits, runs.xlogits)
    if grads:
        scorer.add(grads)
    return scorer.scores(len(plan.runs))


attribute = attribute_edges  # its name before graph.attribute_edges (one "attribute" per meaning: Model.attribute
# is the per-hook attribution of dclens.attribution)


@dataclasses.dataclass
class _EapPlan:
    """What graph.attribute_edges computes, fixed before any pass: the pairs, the
    targets, the hooks both runs read, the runs (the node moved, how far
    along clean -> corrupted), the weightings of the scores."""

    g: Graph
    pr: Any  # batch.PromptPairs
    targets: list
    method: str
    steps: int
    from_z: bool  # the heads' differences from attn.z (head_out itself is moved by eap-ig-activations)
    sread: set  # the hooks the senders' values are read from
    names: list  # every hook both runs read: the senders' and the composition's
    moved: list  # the nodes moved along the line: the embedding (and the layers' outputs)
    runs: list  # (node, alpha)
    cols: list  # the scores' weightings: None (the total), per position (eye), per role (W or None)
    role_names: tuple
    positions: bool


def _eap_plan(model, g: Graph, clean, corrupted, metric, method: str, steps: int, positions: bool, roles) -> _EapPlan:
    """Check the prompts, metric and roles and plan the runs (no pass yet)."""
    pr = prompt_pairs(model, clean, corrupted)
    if positions and pr.padded:
        raise ArgumentError(
            "positions=True: the prompt pairs have different lengths (%s), so a position is not one place "
            "in every pair; score pairs of one length (or positions=False)" % sorted(set(pr.lengths.tolist()))
        )
    B, T = pr.clean.shape
    role_names, W = role_weights(roles, pr.lengths, T) if roles is not None else ((), None)
    if not isinstance(metric, list):
        _target(metric)  # one for every pair: checked before any pass
    targets = [_target(t) for t in _per_pair(metric, B, _is_target, "a target tuple or a patching metric")]
    comp = [e for e in g.detail.values() if e.kind == "comp"]
    # the heads' differences from z (N times smaller than head_out; head_out_n = z_n W_O,n, hooks.md)
    # unless head_out itself is moved (EAP-IG-activations)
    from_z = method != "eap-ig-activations"
    sread = {_sender_read(s, from_z) for s in g.senders}
    names = sorted(sread | {n for e in comp for n in _phase_names(e.layer, e.phase, e.branch)})
    alphas = (np.arange(steps) + 0.5) / steps if method != "eap" else np.zeros(1)
    moved = ["embed"]
    if method == "eap-ig-activations":
        moved += [hook_name(l, x) for l in range(g.n_layer) for x in ("attn.head_out", "mlp.out")]
    runs = [(n, a) for n in moved for a in alphas]
    cols = [None] + ([np.broadcast_to(np.eye(T, dtype=np.float32), (B, T, T))] if positions else []) + [W]
    return _EapPlan(g, pr, targets, method, steps, from_z, sread, names, moved, runs, cols, role_names, positions)


def _metric_and_grad(plan: _EapPlan, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[B] metric values and d(sum)/d logits [B, T, V], each pair in its length."""
    pr = plan.pr
    vals, dl = np.empty(len(plan.targets)), np.zeros(logits.shape, np.float32)
    for b, t in enumerate(plan.targets):
        n = int(pr.lengths[b])
        v, d = target_value_and_grad(t, logits[b : b + 1, :n], pr.clean[b : b + 1, :n])
        vals[b], dl[b, :n] = float(v[0]), d[0]
    if not np.all(np.isfinite(vals)):
        bad = int(np.nonzero(~np.isfinite(vals))[0][0])
        raise Error("metric: %r for prompt pair %d (NaN or inf: the logits are not finite)" % (vals[bad], bad))
    return vals, dl


class _EapRuns:
    """The plain passes graph.attribute_edges reads: the corrupted prompts' values
    (xc) and logits, and, but for "eap" (whose tape reads the clean run
    itself), the clean ones' (cc)."""

    def __init__(self, model, plan: _EapPlan):
        self.xlogits, xcache = model.run_with_cache(plan.pr.corrupted, names=plan.names)
        self.xc = {n: np.asarray(v) for n, v in xcache.items()}
        del xcache
        self.cc: dict[str, np.ndarray] = {}
        self.clogits = None
        if plan.method != "eap":  # the tape runs interpolated inputs: the clean values from a plain pass
            self.clogits, ccache = model.run_with_cache(plan.pr.clean, names=plan.names)
            self.cc = {n: np.asarray(v) for n, v in ccache.items()}
            del ccache


class _EdgeScorer:
    """The edges' scores summed over pairs and runs, one sum per weighting
    (total, per position, per role), added as gradients come."""

    def __init__(self, model, plan: _EapPlan, cc: dict, xc: dict):
        self.model, self.plan, self.cc, self.xc = model, plan, cc, xc
        self.S: np.ndarray | None = None  # the senders' differences [senders, B, T, D] (_sender_deltas)
        self.acc: list = [None] * len(plan.cols)

    def fold(self) -> None:
        """S, which replaces the runs' copies of the senders' values."""
        p = self.plan
        self.S = _sender_deltas(p.g, self.cc, self.xc, self.model if p.from_z else None)
        for n in p.sread - set(p.moved):
            self.cc.pop(n, None), self.xc.pop(n, None)

    def add(self, grads: dict) -> None:
        """Add the scores these gradients give (every receiver they reach)."""
        if self.S is None:  # from z: after the passes (numpy's BLAS threads idle while the engine runs)
            self.fold()
        assert self.S is not None
        cols = self.plan.cols
        for i, Wi in enumerate(cols):
            if i == len(cols) - 1 and Wi is None:
                continue
            v = _resid_scores(self.plan.g, self.S, grads, Wi) + _comp_scores(
                self.model, self.plan.g, self.cc, self.xc, grads, Wi
            )
            self.acc[i] = v if self.acc[i] is None else self.acc[i] + v

    def scores(self, n_runs: int) -> EdgeScores:
        """The mean over pairs and runs."""
        p = self.plan
        k = len(p.targets) * n_runs
        out = EdgeScores(p.g, self.acc[0] / k, p.method, p.steps, roles=p.role_names)
        if p.positions:
            out.per_position = self.acc[1] / k
        if p.cols[-1] is not None:
            out.per_role = self.acc[-1] / k
        return out


def _gradient_runs(model, plan: _EapPlan, runs: _EapRuns, scorer: _EdgeScorer, budget, max_grad_bytes, bar) -> dict:
    """The backward of every run. One chunk of layers (every receiver's
    gradient fits at once): the gradients summed over the runs, returned to
    be scored once. More chunks: one backward in stages, each chunk's
    gradients scored as its stage hands them out (the scores are linear in
    the gradient) and let go; {} returned."""
    ctoks = plan.pr.clean.astype(np.int32)
    B, T = ctoks.shape
    reads = [model.parse_hook(n) for n in plan.names]
    gnames = _grad_names(model, plan.g)
    grads: dict[str, np.ndarray] = {}
    chunks = None
    with tapes.lease(model, B, T, budget) as tape:
        for node, a in plan.runs:
            if plan.method == "eap":  # the clean run itself: its values read by the same pass
                logits, got = tape.forward(ctoks, None, reads=reads)
                runs.cc = scorer.cc = {n: got[p] for n, p in zip(plan.names, reads)}
                runs.clogits = logits
            else:
                v_c, v_x = runs.cc[node], runs.xc[node]
                logits = tape.forward(ctoks, {model.parse_hook(node): v_c + np.float32(a) * (v_x - v_c)})
            if chunks is None:
                chunks = _grad_chunks(model, tape, gnames, max_grad_bytes)
            if scorer.S is None and not plan.from_z:  # head_out's copies are large: folded into S at once
                scorer.fold()
            _, dl = _metric_and_grad(plan, logits)
            for i, chunk in enumerate(chunks):  # chunks of layers whose gradients fit at once: one
                pts = [model.parse_hook(n) for n in chunk]  # backward, in stages (a stage per chunk)
                if len(chunks) == 1:
                    got = tape.backward(dl, None, pts)
                    for n, p in zip(chunk, pts):  # all at once: sum the gradients over the steps
                        grads[n] = got[p] if n not in grads else grads[n] + got[p]
                else:
                    got = tape.backward_stage(dl if i == 0 else None, min(l for _, l in pts), pts)
                    scorer.add({n: got[p] for n, p in zip(chunk, pts)})
                del got
            if bar is not None:
                bar.update(1)
    return grads


def _warn_if_no_gap(plan: _EapPlan, clogits, xlogits) -> None:
    """A PatchingWarning when the clean and corrupted metrics nearly agree."""
    m_clean, m_corr = (float(_metric_and_grad(plan, lg)[0].mean()) for lg in (clogits, xlogits))
    if abs(m_clean - m_corr) <= MIN_GAP * max(abs(m_clean), abs(m_corr)):
        warnings.warn(
            "graph.attribute_edges: the clean and corrupted metrics are nearly equal (clean %.4g, corrupted %.4g): "
            "the corruption does not move what the metric measures, so the scores say little" % (m_clean, m_corr),
            PatchingWarning,
            stacklevel=3,
        )


def _sender_read(s: str, from_z: bool) -> str:
    """The hook a sender's value is read from: its own, or a head's attn.z (from_z)."""
    hook, head = _sender_hook(s)
    return hook.replace(".head_out", ".z") if from_z and head >= 0 else hook


def _sender_deltas(g: Graph, cc, xc, model=None) -> np.ndarray:
    """[senders, B, T, D] float32: every sender's corrupted - clean value, in
    graph order; with a model, a head's from attn.z: (z_x - z_c)[.., n, :]
    W_O[:, n's Dh columns]^T (head_out's definition, hooks.md)."""
    B, T, D = np.asarray(cc["embed"]).shape
    S = np.empty((len(g.senders), B, T, D), np.float32)
    wo: dict[int, np.ndarray] = {}
    for i, s in enumerate(g.senders):
        hook, head = _sender_hook(s)
        if head >= 0 and model is not None:
            l = int(s[1:].split(".")[0])
            if l not in wo:
                wo = {l: model.weight("layers.%d.attention.wo.weight" % l)}  # [D, N*Dh]
            zn = _sender_read(s, True)
            dz = np.subtract(xc[zn][..., head, :], cc[zn][..., head, :], dtype=np.float32)  # [B, T, Dh]
            Dh = dz.shape[-1]
            np.matmul(dz, wo[l][:, head * Dh : (head + 1) * Dh].T, out=S[i])
            continue
        x, c = np.asarray(xc[hook]), np.asarray(cc[hook])
        if head >= 0:  # a head of [B, T, N, D]
            x, c = x[..., head, :], c[..., head, :]
        np.subtract(x, c, out=S[i], dtype=np.float32)
    return S


def _grad_chunks(model, tape, gnames: list[str], max_bytes: int | None) -> list[list[str]]:
    """The gradient hooks in chunks of whole layers whose gradients together
    take at most max_bytes (None: a quarter of the free memory, at least
    256 MiB); one chunk when all fit."""
    if max_bytes is None:
        max_bytes = max(256 << 20, memplan.available_memory() // 4)
    size = {n: 4 * int(np.prod(tape._shape(model.parse_hook(n)[0]))) for n in gnames}
    by_layer: dict[int, list[str]] = {}
    for n in gnames:
        by_layer.setdefault(int(n.split(".")[1]), []).append(n)
    chunks: list[list[str]] = []
    used = 0
    for l in sorted(by_layer, reverse=True):  # from the top: the backward reaches them first
        b = sum(size[n] for n in by_layer[l])
        if not chunks or used + b > max_bytes:
            chunks.append([])
            used = 0
        chunks[-1] += by_layer[l]
        used += b
    return chunks


def _resid_scores(g: Graph, S: np.ndarray, grads, W: np.ndarray | None = None) -> np.ndarray:
    """The residual edges' EAP scores, summed over pairs ([E]; with W [B, T,
    P], [E, P]: position t of pair b counted in column p by W[b, t, p]), for
    the receivers whose gradients are in ``grads`` (0 elsewhere). S: the
    senders' differences (_sender_deltas). Senders run in graph order, so
    the senders upstream of a layer's receivers are a prefix of them: per
    layer, one product of that prefix [nS, B*T*D] with the gradients of every
    receiver of the layer ([receivers, B*T*D], read transposed)."""
    scores = np.zeros((len(g.edges), W.shape[-1]) if W is not None else len(g.edges))
    by_rx: dict[str, list[Edge]] = {}
    for e in g.detail.values():
        if e.kind == "resid" and _receiver_hook(e.receiver, g.n_layer)[0] in grads:
            by_rx.setdefault(e.receiver, []).append(e)
    sidx = {s: i for i, s in enumerate(g.senders)}
    pos = {e: i for i, e in enumerate(g.edges)}
    buf = np.empty(0, np.float32)
    for layer in list(range(g.n_layer)) + [-1]:
        rxs = [r for r in by_rx if by_rx[r][0].layer == layer]
        if not rxs:
            continue
        k = 1 + max(sidx[e.sender] for r in rxs for e in by_rx[r])  # the upstream prefix
        cols: dict[tuple[str, int], int] = {}
        hooks = list(dict.fromkeys(_receiver_hook(r, g.n_layer)[0] for r in rxs))
        width = [np.asarray(grads[h]).shape[-2] if np.ndim(grads[h]) == 4 else 1 for h in hooks]
        # [receivers, B, T, D]: a head's rows moved in whole D-blocks (a fast copy), the product's
        # right operand read transposed by the BLAS
        if buf.size < sum(width) * S[0].size:  # one buffer for every layer (its pages touched once)
            buf = np.empty(sum(width) * S[0].size, np.float32)
        Gl = buf[: sum(width) * S[0].size].reshape((sum(width),) + S.shape[1:])
        for hook, w in zip(hooks, width):
            G = np.asarray(grads[hook], np.float32)
            c0 = len(cols)
            if G.ndim == 4:  # [B, T, N, D] -> rows c0 .. c0 + N
                Gl[c0 : c0 + w] = np.moveaxis(G, -2, 0)
                cols.update({(hook, n): c0 + n for n in range(w)})
            else:
                Gl[c0] = G
                cols[(hook, -1)] = c0
        if W is not None:
            prod = np.einsum("sbtd,cbtd,btp->scp", S[:k], Gl, W, optimize=True)
        else:
            prod = S[:k].reshape(k, -1) @ Gl.reshape(len(cols), -1).T
        for r in rxs:
            c = cols[_receiver_hook(r, g.n_layer)]
            for e in by_rx[r]:
                scores[pos[e.name]] = prod[sidx[e.sender], c]
    return scores


def _comp_scores(model, g: Graph, cc, xc, grads, W: np.ndarray | None = None) -> np.ndarray:
    """Every composition edge's EAP score, summed over pairs (with W [B, T,
    P], by query position as _resid_scores): for layer l, phase and branch
    at once, sum over (b, t, s) of dX[m] C[m, n] dM/dbranch[n] (dX the
    source head's phase input difference, C the clean run's map entry), as
    batched products."""
    scores = np.zeros((len(g.edges), W.shape[-1]) if W is not None else len(g.edges))
    pos = {e: i for i, e in enumerate(g.edges)}
    groups: dict[tuple[int, str, str], list[Edge]] = {}
    for e in g.detail.values():
        if e.kind == "comp":
            groups.setdefault((e.layer, e.phase, e.branch), []).append(e)

    def dyn(l, ph, w):  # a dynamic weight of the clean run: [B, T, R, N] or gates [B, T, N]
        return np.asarray(cc[hook_name(l, "attn.dyn.%s.%s" % (ph, w))], np.float32)

    def diag(v):  # [N] or [N, P] -> [N, N(, P)]
        out = np.zeros((v.shape[0],) + v.shape, v.dtype)
        out[np.arange(v.shape[0]), np.arange(v.shape[0])] = v
        return out

    deltas: dict[tuple[int, str], np.ndarray] = {}  # (layer, phase) -> its input's difference, every branch's
    for (l, ph, b), es in groups.items():
        if hook_name(l, "attn.%s.%s" % (ph, b)) not in grads:
            continue
        if (l, ph) not in deltas:
            xname = hook_name(l, "attn.%s" % ("scores" if ph == "pre" else "pattern"))
            X = np.asarray(xc[xname], np.float32) - np.asarray(cc[xname], np.float32)
            deltas = {(l, ph): _masked(model, l, X).astype(np.float32)}  # [B, N, T, S]; the last one only
        dx = deltas[(l, ph)]
        gb = np.asarray(grads[hook_name(l, "attn.%s.%s" % (ph, b))], np.float32)  # [B, N, T, S]
        if b in ("skip", "qg", "kg"):
            prod = dx * gb
            if b == "skip":
                q = prod.sum(-1)  # [B, N, T]
            elif b == "qg":
                q = np.swapaxes(dyn(l, ph, "qdd"), 1, 2) * prod.sum(-1)
            else:
                q = np.einsum("bsn,bnts->bnt", dyn(l, ph, "kdd"), prod, optimize=True)
            mn = diag(np.einsum("bnt,btp->np", q, W) if W is not None else q.sum((0, 2)))
        elif b == "qp":
            C = np.swapaxes(dyn(l, ph, "qw1"), -1, -2) @ dyn(l, ph, "qw2")  # [B, T, m, n]
            P = dx.transpose(0, 2, 1, 3) @ gb.transpose(0, 2, 3, 1)  # [B, T, m, n]
            mn = np.einsum("btmn,btp->mnp", C * P, W) if W is not None else (C * P).sum((0, 1))
        elif b == "kp":
            C = np.swapaxes(dyn(l, ph, "kw1"), -1, -2) @ dyn(l, ph, "kw2")  # [B, S, m, n]
            if W is not None:  # by query position: sum over keys per (b, t)
                q = np.einsum("bsmn,bmts,bnts->bmnt", C, dx, gb, optimize=True)
                mn = np.einsum("bmnt,btp->mnp", q, W)
            else:
                P = dx.transpose(0, 3, 1, 2) @ gb.transpose(0, 3, 2, 1)  # [B, S, m, n]
                mn = (C * P).sum((0, 1))
        else:
            Ws = routing.static_map(model, l, ph)
            assert Ws is not None
            if W is not None:
                q = np.einsum("bmts,bnts->bmnt", dx, gb, optimize=True)
                mn = Ws[:, :, None] * np.einsum("bmnt,btp->mnp", q, W)
            else:
                Bn, N = dx.shape[:2]
                mn = Ws * (dx.reshape(Bn, N, -1) @ np.swapaxes(gb.reshape(Bn, N, -1), 1, 2)).sum(0)
        if b in BRANCH_COEF:
            block = routing._group_block(model)
            mn = mn * (block[:, :, None] if W is not None else block)
        for e in es:
            scores[pos[e.name]] = mn[e.src_head, e.head]
    return scores


def faithfulness(model, circuit: Circuit, clean, corrupted, metric: Callable) -> float:
    """The fraction of the clean - corrupted gap the circuit keeps: every edge
    outside it patched from the corrupted run (1: all of it, 0: none).

    Parameters
    ----------
    model : dclens.Model
    circuit : Circuit
        The edges kept clean (``EdgeScores.circuit``).
    clean, corrupted : str, list of str, array_like of int, or (tokens, lengths)
        The prompt pairs, as in ``patch``.
    metric : callable or list of callable
        A function of one pair's [T, V] logits, as in ``patch``.

    Returns
    -------
    float
        (metric with the other edges patched - corrupted metric) / (clean
        metric - corrupted metric): 1 keeps the whole gap; below 0 or above
        1 when the outside edges overshoot.

    Raises
    ------
    dclens.ArgumentError
        ``circuit`` not a Circuit, or a metric list of the wrong length.
    dclens.Error
        The clean and corrupted metrics are equal (no gap), pairs of unequal
        lengths, or a metric that is NaN or inf.
    """
    if not isinstance(circuit, Circuit):
        raise ArgumentError("circuit must be a dclens.graph.Circuit (EdgeScores.circuit), not %r" % (circuit,))
    g = circuit.graph
    m_clean = patch(model, clean, corrupted, metric, [], graph=g)
    m_corr = patch(model, clean, corrupted, metric, g.edges, graph=g)
    if abs(m_clean - m_corr) < 1e-9 * max(abs(m_clean), 1.0):
        raise Error("faithfulness: the clean and corrupted metrics are equal (%g): no gap to keep" % m_clean)
    out = [e for e in g.edges if e not in circuit.edges]
    return (patch(model, clean, corrupted, metric, out, graph=g) - m_corr) / (m_clean - m_corr)


# ---------------------------------------------------------------- path patching


def path_patch(
    model, clean, corrupted, metric, sender: str, receivers: Sequence[str], graph: Graph | None = None
) -> float:
    """Path patching (Wang et al. 2022): the sender's corrupted output reaches
    only the named receivers (nodes: "L3.H2.q", "L2.dyn", "L4.mlp", "logits",
    or composition targets "L1.H4.post.kp" for a head of the sender's layer),
    every other path from it frozen at its clean value. The metric averaged
    over prompt pairs.

    Parameters
    ----------
    model : dclens.Model
        The model whose sender's paths are patched.
    clean, corrupted : str, list of str, array_like of int, or (tokens, lengths)
        The prompt pairs, as in ``patch``.
    metric : callable or list of callable
        A function of one pair's [T, V] logits, as in ``patch``.
    sender : str
        A sender node ("embed", "L{l}.H{h}", "L{l}.mlp").
    receivers : list of str
        The nodes its corrupted output reaches (each downstream of it).
    graph : Graph, optional
        The model's graph, as in ``patch``.

    Returns
    -------
    float
        The metric with the paths patched, averaged over the pairs.

    Raises
    ------
    dclens.UnknownNameError
        A sender the graph does not have, or a receiver not downstream of
        the sender (with the receivers it has).
    dclens.ArgumentError
        ``receivers`` not a non-empty list.
    dclens.Error
        Pairs of unequal lengths, or a metric that is NaN or inf.
    """
    g = graph or build(model)
    if sender not in g.senders:
        raise unknown_name("sender", sender, g.senders, "", "graph.build(model).senders")
    if isinstance(receivers, str) or not isinstance(receivers, (list, tuple)) or not receivers:
        raise ArgumentError("receivers must be a non-empty list of receiver nodes, not %r" % (receivers,))
    edges = []
    for r in receivers:
        name = "%s->%s" % (sender, r)
        if name not in g.detail:
            targets = sorted({e.split("->", 1)[1] for e in g.edges if e.startswith(sender + "->")})
            raise unknown_name("receiver of %s" % sender, r, targets, "", "the receivers downstream of it")
        edges.append(name)
    return patch(model, clean, corrupted, metric, edges, graph=g)


def path_patch_sweep(
    model,
    clean,
    corrupted,
    metric,
    receivers: Sequence[str],
    senders: Sequence[str] | None = None,
    graph: Graph | None = None,
    progress=None,
) -> dict[str, float]:
    """path_patch of every sender upstream of all the receivers (or of
    ``senders``) into them.

    Parameters
    ----------
    model : dclens.Model
    clean, corrupted : str, list of str, array_like of int, or (tokens, lengths)
        The prompt pairs, as in ``patch``.
    metric : callable or list of callable
        A function of one pair's [T, V] logits, as in ``patch``.
    receivers : list of str
        The receiver nodes every sender's corrupted output reaches.
    senders : list of str, optional
        The senders to sweep (None: every sender upstream of all the
        receivers).
    graph : Graph, optional
        The model's graph, as in ``patch``.
    progress : bool, optional
        A bar over the senders: None where someone watches (plain lines in a
        log), True always, False never.

    Returns
    -------
    dict of str to float
        sender -> the metric with its paths into the receivers patched.

    Raises
    ------
    dclens.UnknownNameError
        A sender or receiver the graph does not have downstream of it.
    dclens.ArgumentError
        ``receivers`` not a non-empty list.
    """
    g = graph or build(model)
    if isinstance(receivers, str) or not isinstance(receivers, (list, tuple)) or not receivers:
        raise ArgumentError("receivers must be a non-empty list of receiver nodes, not %r" % (receivers,))
    if senders is None:
        senders = [s for s in g.senders if all("%s->%s" % (s, r) in g.detail for r in receivers)]
    out: dict[str, float] = {}
    for s in _progress.bar(list(senders), desc="graph.path_patch_sweep", progress=progress):
        out[s] = path_patch(model, clean, corrupted, metric, s, receivers, graph=g)
    return out
