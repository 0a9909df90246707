"""The composition explorer: one self-contained HTML page to look at how heads compose.

    ex = dclens.explore(model, "Ruth has a sweater. ...", twin=pythia, attribution=("logprob", -1, tok))
    ex                        # shows itself in Jupyter / JupyterLab / VS Code (_repr_html_)
    ex.save("page.html")      # a file that works from file://: no CDN, no request leaves the page

The page shows the token strip (hover or click a query), every head's
attention row at the query (softmax pattern and composed weights side by
side, and the MHA twin's), the selected head's compose branches per key (pre
and post), the routing matrix [N, N] of the query as a heatmap and as a head
graph, the flows into one (head, query, key) by source head and branch (what
routing.flows computes), the query's dynamic weights and, with attribution=,
integrated gradients per head as a ranking that selects heads (the page then
opens on the top-ranked head), and with circuit= (a dclens.graph.Circuit) a
Circuit tab: the circuit as a layered graph, its edges with their scores and,
at the page's query, each composition edge's clean map entry and lent share
and each head's own share of its composed attention. Colours: sequential only for the softmax
patterns (and the post-compose skip branch, the pattern itself), diverging
around 0 for every signed quantity (docs/explorer.md, "Colours").

The passes run with the hooks in force (model.add_hook, `with model.hooks(...)`;
the twin's own hooks for the twin): the page shows the hooked model.

Data: the phase inputs (scores, pattern), the composed maps, the twin's
pattern, the routing matrices and the dynamic weights of each layer, maps by
their visible cells only (causal, and the window of local layers), as 8-bit
integers with a float32 scale per row (a map's row is one (head, query);
unsigned, step max/255, for arrays that are never negative; signed, step
max|x|/127, otherwise; 16-bit for the small dynamic weights), deflate-compressed per layer and decoded by the page
when the layer is first shown (DecompressionStream). A decoded value is
within half a step of the engine's (`stored_step`). The branches and flows
are not stored: the page computes them from the phase input and the dynamic
weights, as routing.flows does (docs/explorer.md).

Test contract (docs/explorer.md): the fragment #layer=L&head=H&query=Q&view=V
(V: pattern, pattern_composed, branch:NAME, routing, flows; also phase=pre|post,
key=K, tab=circuit) selects a view on load; once drawn, document.body.dataset.ready is "1"
and #dcs-selected carries the displayed numbers as JSON in data-values.
"""

from __future__ import annotations

import base64
import html as _html
import json
import os
import re
import warnings
import zlib
from collections.abc import Sequence

import numpy as np

from .._core.checks import (
    ArgumentError,
    ArgumentTypeError,
    Error,
    c_path,
    check_bool,
    check_index,
    show_path,
    token_array,
)
from .._core.mask import allowed, layer_window
from .._core.names import BRANCHES, PHASES, hook_name
from ..analysis import graph as _graph
from ..analysis import routing
from ..analysis.graph import _comp_coef, _masked, _node_of
from ..analysis.routing import flow_branches
from .heatmaps import colormap_rgb

_PAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "explorer_page")
_LIMIT_BYTES = 256 << 20  # refuse pages whose raw data would exceed this (name layers=)
_WARN_BYTES = 32 << 20  # warn above this (a browser holds it, a notebook stores it)
# the maps of a phase, by hook suffix: its input, its branches, its sum
_PHASE_MAPS = {"pre": ("attn.scores", "attn.scores_composed"), "post": ("attn.pattern", "attn.pattern_composed")}


class Explorer:
    """A built explorer page: `html` (str), `save(path)`, shown inline in notebooks.

    Made by ``dclens.explore``; in a notebook it shows as an iframe holding
    the page (its ids, styles and scripts apart from the notebook's).

    Parameters
    ----------
    html : str
        The self-contained page (data, script and styles inline).
    model_name : str
        The model's name, shown in ``repr``.
    layers : list of int
        The layers the page holds.
    n_tokens : int
        The prompt's tokens.

    Attributes
    ----------
    html, model_name, layers, n_tokens
        As given.
    """

    def __init__(self, html: str, model_name: str, layers: list[int], n_tokens: int):
        self.html = html
        self.model_name = model_name
        self.layers = layers
        self.n_tokens = n_tokens

    def __len__(self) -> int:
        return len(self.html.encode("utf-8"))

    def __repr__(self) -> str:
        return "<dclens.Explorer %s, %d tokens, layers %s, %d bytes>" % (
            self.model_name,
            self.n_tokens,
            self.layers,
            len(self),
        )

    def save(self, path: str | os.PathLike) -> str:
        """Write the page to a file (UTF-8), to open in any browser offline.

        Parameters
        ----------
        path : str, bytes or os.PathLike
            The file to write (replaced if it exists).

        Returns
        -------
        str
            The path written, as a string.

        Raises
        ------
        dclens.Error
            A path that is not one (not str, bytes or os.PathLike, or holding
            a NUL), or a file that cannot be written (the OS's reason).
        """
        c_path("save: path", path)  # a path, or an Error naming it
        path = show_path(path)
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(self.html)
        except OSError as e:
            raise Error("%s: cannot write the explorer page: %s" % (path, e.strerror or e)) from e
        return path

    def _repr_html_(self) -> str:
        # an iframe: the page's ids, styles and scripts stay apart from the notebook's
        return (
            '<iframe srcdoc="%s" style="width:100%%;height:1060px;border:1px solid #ddd" '
            'title="dclens explorer"></iframe>' % _html.escape(self.html, quote=True)
        )


# ---------------------------------------------------------------- encoding


def stored_step(values: np.ndarray, visible: np.ndarray | None = None, bits: int = 8) -> np.ndarray:
    """The quantisation step of each stored row: for an attention map [N, T, S]
    with its `visible` [T, S] mask, per (head, query) over the visible keys
    ([N, T]); for any other array, per row of its last axis. The step is
    max/255 when the whole array is never negative (at its visible cells),
    max|x|/127 otherwise (with bits=16, the dynamic weights: 65535 and 32767); a
    decoded value is within step/2 of the original.

    Parameters
    ----------
    values : numpy.ndarray
        [N, T, S] an attention map (with ``visible``) or any array whose last
        axis is a stored row.
    visible : numpy.ndarray, optional
        [T, S] bool: the cells the page stores (the causal / window mask).
    bits : int, default 8
        Bits per stored value (8: maps; 16: the dynamic weights).

    Returns
    -------
    numpy.ndarray
        float64, the values' shape without its last axis ([N, T] for a
        map): each row's step.
    """
    a = np.asarray(values, np.float64)
    if visible is not None:
        cells = a[:, visible]
        a = np.where(visible, a, 0.0)
    else:
        cells = a
    unsigned = bool((cells >= 0).all())
    top = float(2**bits - 1 if unsigned else 2 ** (bits - 1) - 1)
    return np.abs(a).max(axis=-1) / top


class _Blob:
    """Arrays of one layer packed into one buffer: per array a float32 scale per
    row, then one byte per value; `manifest` says where each array lies."""

    def __init__(self):
        self.parts: list[bytes] = []
        self.size = 0
        self.manifest: dict[str, dict] = {}

    def _put(self, data: bytes) -> int:
        off = self.size
        pad = (-len(data)) % 4
        self.parts.append(data + b"\0" * pad)
        self.size += len(data) + pad
        return off

    def rows(self, name: str, values: np.ndarray, row_starts: np.ndarray, shape: Sequence[int], bits: int = 8) -> None:
        """values: 1-D, rows beginning at row_starts (ascending, first 0); bits 8 or 16."""
        v = np.asarray(values, np.float64)
        if not np.isfinite(v).all():
            raise Error("explore: %s holds NaN or inf" % name)
        unsigned = bool((v >= 0).all())
        peak = np.maximum.reduceat(v if unsigned else np.abs(v), row_starts) if v.size else np.zeros(0)
        top = float(2**bits - 1 if unsigned else 2 ** (bits - 1) - 1)
        scale = (peak / top).astype(np.float32).astype(np.float64)  # quantise with the scale as stored
        per_cell = np.repeat(scale, np.diff(np.append(row_starts, v.size)))
        q = np.clip(np.rint(np.divide(v, per_cell, out=np.zeros_like(v), where=per_cell > 0)), -top, top)
        kind = ("u" if unsigned else "i") + str(bits)
        dtypes: dict[str, type | str] = {"u8": np.uint8, "i8": np.int8, "u16": "<u2", "i16": "<i2"}
        q = q.astype(dtypes[kind])
        self.manifest[name] = {
            "kind": kind,
            "shape": list(shape),
            "scale": self._put(scale.astype("<f4").tobytes()),
            "rows": int(len(scale)),
            "data": self._put(q.tobytes()),
            "n": int(v.size),
        }

    def dense(self, name: str, a: np.ndarray, bits: int = 8) -> None:
        """An array stored whole, one scale per row of its last axis."""
        a = np.asarray(a)
        k = a.shape[-1]
        self.rows(name, a.reshape(-1), np.arange(0, a.size, k), a.shape, bits)

    def payload(self) -> str:
        return base64.b64encode(zlib.compress(b"".join(self.parts), 9)).decode("ascii")


def _n_visible(T: int, window: int) -> int:
    """allowed(T, T, window).sum(), without building it."""
    if window <= 0 or window + 1 >= T:
        return T * (T + 1) // 2
    w = window + 1
    return w * (w + 1) // 2 + (T - w) * w


def _put_map(blob: _Blob, name: str, a: np.ndarray, vis: np.ndarray) -> None:
    """An attention map [N, T, S] by its visible cells, row (head, query) by row."""
    N, T, _ = a.shape
    per_row = vis.sum(axis=1)  # [T]
    starts = np.concatenate([[0], np.cumsum(np.tile(per_row, N))[:-1]])
    blob.rows(name, a[:, vis].reshape(-1), starts, a.shape)


# ---------------------------------------------------------------- data of one layer


def _layer_names(model, layer: int) -> list[str]:
    c = model.config
    names = [hook_name(layer, "attn.scores"), hook_name(layer, "attn.pattern")]
    if c.use_dcmha:
        for ph in PHASES:
            names.append(hook_name(layer, _PHASE_MAPS[ph][1]))
            names += [n for n in model.hook_names if n.startswith(hook_name(layer, "attn.dyn.%s." % ph))]
    return names


def _layer_blob(model, cache, layer: int, twin_cache, twin) -> _Blob:
    c = model.config
    T = cache[hook_name(layer, "attn.pattern")].shape[-1]
    vis = allowed(T, T, layer_window(model, layer))
    blob = _Blob()
    for ph in PHASES:
        src, total = _PHASE_MAPS[ph]
        _put_map(blob, src.split(".", 1)[1], cache[hook_name(layer, src)], vis)
        if not c.use_dcmha:
            continue
        _put_map(blob, total.split(".", 1)[1], cache[hook_name(layer, total)], vis)
        # the branches are not stored: the page computes them, and the flows, from the
        # phase input and the dynamic weights (model-spec.md 2, step 6)
        blob.dense("routing.%s" % ph, routing.routing_matrices(model, cache, ph, layers=[layer])[0])
        for n in model.hook_names:
            if n.startswith(hook_name(layer, "attn.dyn.%s." % ph)):
                blob.dense(n.split("attn.", 1)[1], cache[n], bits=16)  # small; the flows multiply them
        W = routing.static_map(model, layer, ph)
        if W is not None:
            blob.dense("static.%s" % ph, W, bits=16)
    if twin_cache is not None and layer < twin.config.n_layer:
        twin_vis = allowed(T, T, layer_window(twin, layer))
        _put_map(blob, "twin.pattern", twin_cache[hook_name(layer, "attn.pattern")], twin_vis)
    return blob


_ZERO_BASELINE = (
    "%s uses a zero baseline%s (each head's output scaled up from 0), which is why it can rank heads "
    "differently from DLA or activation patching (which compare with a corrupted run)."
)


def _ig_per_head(model, toks, layers: list[int], attribution) -> dict | None:
    """attribution= as {"label", "values": [len(layers)][N], "top": [layer, head] (the largest
    |value|, the page opens there), "query" (the target's position, or None), "note"}: an
    Attribution result, an [L, N] array, or a target tuple for model.attribute (IG at each
    head_out, with a zero baseline)."""
    if attribution is None:
        return None
    N = model.config.n_head
    label, query, note = "attribution per head (given)", None, ""
    if isinstance(attribution, tuple):
        at = [hook_name(l, "attn.head_out") for l in layers]
        label, note = "IG of %s at head outputs" % (attribution[0],), _ZERO_BASELINE % ("IG", "")
        pos = attribution[1] if len(attribution) > 1 else None
        if isinstance(pos, (int, np.integer)) and not isinstance(pos, bool) and -len(toks) <= pos < len(toks):
            query = int(pos) % len(toks)  # the page opens at the target's position
        attribution = model.attribute(toks, attribution, at=at, method="ig", steps=32)
    elif hasattr(attribution, "per_head"):
        if getattr(attribution, "method", "ig") == "ig":
            label, note = (
                "IG per head",
                _ZERO_BASELINE % ("IG from model.attribute", " unless baseline= said otherwise"),
            )
        else:
            label = "%s per head" % (attribution.method,)
    if hasattr(attribution, "per_head"):
        missing = [l for l in layers if hook_name(l, "attn.head_out") not in attribution.per_head]
        if missing:
            raise Error(
                "explore: attribution= has no per-head values at blocks.%d.attn.head_out "
                "(attribute at=[...head_out of every layer shown])" % missing[0]
            )
        vals = np.stack([np.asarray(attribution.per_head[hook_name(l, "attn.head_out")], np.float64) for l in layers])
    else:
        try:
            a = np.asarray(attribution, np.float64)
        except (TypeError, ValueError) as e:
            raise ArgumentError(
                "explore: attribution= must be a target tuple, an Attribution or an [n_layer, n_head] array "
                "of numbers: %s" % e
            ) from None
        if a.ndim != 2 or a.shape[1] != N or a.shape[0] not in (model.config.n_layer, len(layers)):
            raise Error(
                "explore: attribution= must be [n_layer, n_head] = [%d, %d] (or one row per layer "
                "shown), got shape %s" % (model.config.n_layer, N, a.shape)
            )
        vals = a[layers] if a.shape[0] == model.config.n_layer else a
    if vals.shape != (len(layers), N) or not np.isfinite(vals).all():
        raise Error(
            "explore: attribution= gives per-head values of shape %s, need [%d, %d] and finite"
            % (vals.shape, len(layers), N)
        )
    top = np.unravel_index(int(np.argmax(np.abs(vals))), vals.shape)
    return {
        "label": label,
        "values": vals.tolist(),
        "top": [layers[int(top[0])], int(top[1])],
        "query": query,
        "note": note,
    }


def _check_circuit(model, circuit):
    """The Circuit given as circuit=, checked against the model: (circuit, the
    model's graph), or (None, None)."""
    if circuit is None:
        return None, None
    if isinstance(circuit, _graph.EdgeScores):
        raise ArgumentTypeError(
            "explore: circuit= takes a dclens.graph.Circuit, not EdgeScores: pass scores.circuit(top_n=...) "
            "or scores.circuit(threshold=...)"
        )
    if not isinstance(circuit, _graph.Circuit):
        raise ArgumentTypeError(
            "explore: circuit= must be a dclens.graph.Circuit (EdgeScores.circuit) or None, not %s"
            % type(circuit).__name__
        )
    c = model.config
    cg = circuit.graph
    for name in sorted(circuit.edges):
        d = cg.detail.get(name) if isinstance(name, str) else None
        if d is None:
            raise ArgumentError("explore: circuit= holds %r, which is not an edge of its own graph" % (name,))
        for node in (d.sender, _graph._node_of(d)):
            if node.startswith("L"):
                l, rest = node[1:].split(".", 1)
                if int(l) >= c.n_layer or (rest.startswith("H") and int(rest[1:]) >= c.n_head):
                    raise ArgumentError(
                        "explore: circuit= edge %s names %s, out of range for %s (%d layers, %d heads): "
                        "a circuit of another model?" % (name, node, model.name, c.n_layer, c.n_head)
                    )
    g = _graph.build(model)
    if g.edges != cg.edges:
        missing = [e for e in sorted(circuit.edges) if e not in g.detail]
        raise ArgumentError(
            "explore: circuit= was found on the graph of another model (%d edges; %s has %d%s)"
            % (
                len(cg.edges),
                model.name,
                len(g.edges),
                ", and no edge %s" % missing[0] if missing else "",
            )
        )
    return circuit, g


def _circuit_names(model, g, circuit) -> list[str]:
    """The hooks the circuit tab reads: every layer with a head of the circuit."""
    layers = sorted({int(n[1:].split(".")[0]) for n in _circuit_nodes(g, circuit) if ".H" in n})
    return [n for l in layers for n in _layer_names(model, l)]


def _circuit_nodes(g, circuit) -> list[str]:
    """Every node an edge of the circuit touches: embed, then by layer its
    dynamic-weight input, heads and MLP, then the logits."""

    def key(n: str) -> tuple[int, int, int]:
        if n in ("embed", "logits"):
            return (-1 if n == "embed" else g.n_layer, 0, 0)
        l, rest = n[1:].split(".", 1)
        return (int(l), {"dyn": 0, "mlp": 2}.get(rest, 1), int(rest[1:]) if rest.startswith("H") else 0)

    touched = {n for e in circuit.edges for n in (g.detail[e].sender, _node_of(g.detail[e]))}
    return sorted(touched, key=key)


def _r6(a) -> list[float] | float:
    """Values as JSON numbers with 6 significant digits (float32 holds about 7)."""
    a = np.asarray(a, np.float64)
    if not np.isfinite(a).all():
        raise Error("explore: the circuit's values hold NaN or inf (a hook in force wrote them?)")
    if a.ndim == 0:
        return float("%.6g" % a)
    return [float("%.6g" % v) for v in a]


def _circuit_payload(model, circuit, g, cache) -> dict:
    """What the page's Circuit tab shows, from this prompt's pass (``cache``).

    Parameters
    ----------
    model : dclens.Model
    circuit : dclens.graph.Circuit
        Checked against the model (explore does it).
    g : dclens.graph.Graph
        ``graph.build(model)``.
    cache : Cache
        The prompt's pass, holding the layers' maps and dynamic weights of
        every layer with a head of the circuit (one sequence, no batch axis).

    Returns
    -------
    dict
        ``nodes``: every node an edge touches (``id``, ``kind``, ``layer``,
        ``head``, ``reaches``: whether it reaches the logits through the
        circuit, ``Circuit.nodes``; a head also ``own``, ``total`` and
        ``share`` [T], post-compose, from ``routing_matrices``' R[t]: own =
        R[t][h, h], the part of its composed attention at query t that comes
        from its own pattern; total = the sum over sources of R[t][:, h], all
        of it; share = |own| / (|own| + sum over other heads m of
        |R[t][m, h]|), its own share of the flow into it, 1 without
        composition).
        ``edges``, largest |score| first: ``name``, ``kind``, ``sender``,
        ``node`` (the receiving node), ``part`` (q, k, v; or the branch, as
        "post.kp"), ``score`` (or None); a composition edge also ``axis``
        ("query", "key" or "none") and ``coef`` (the clean map entry
        C[m, n] of its branch, ``graph._comp_coef``: [T] over queries for
        qp / qg, over keys for kp / kg, one number for skip / static) and
        ``lent`` [T]: sum over visible keys s of X[m, t, s] C[t, s][m, n],
        what the source head's scores (pre) or pattern (post) give the
        target at query t through that branch.

    Raises
    ------
    dclens.Error
        Values that are not finite.
    """
    c = model.config
    scores = circuit.scores or {}
    reach = set(circuit.nodes)
    nodes, R = [], {}
    for n in _circuit_nodes(g, circuit):
        node: dict = {"id": n, "reaches": n in reach, "layer": -1, "head": -1}
        if n in ("embed", "logits"):
            node["kind"] = n
        else:
            l, rest = n[1:].split(".", 1)
            node["layer"] = int(l)
            if rest.startswith("H"):
                node.update(kind="head", head=int(rest[1:]))
                if node["layer"] not in R:
                    R[node["layer"]] = routing.routing_matrices(model, cache, "post", layers=[node["layer"]])[0]
                Rl = R[node["layer"]][:, :, node["head"]]  # [T, sources]
                own = Rl[:, node["head"]]
                others = np.abs(np.delete(Rl, node["head"], axis=1)).sum(-1)
                node["own"], node["total"] = _r6(own), _r6(Rl.sum(-1))
                # |own| / (|own| + sum of |what each other head lends|): its share of the flow into it
                node["share"] = _r6(
                    np.divide(
                        np.abs(own), np.abs(own) + others, out=np.ones_like(own), where=(np.abs(own) + others) > 0
                    )
                )
            else:
                node["kind"] = rest  # mlp, dyn
        nodes.append(node)
    edges = []
    pos = {e: i for i, e in enumerate(g.edges)}
    order = sorted(circuit.edges, key=lambda e: (-abs(scores.get(e, 0.0)), pos[e]))
    for name in order:
        d = g.detail[name]
        e: dict = {
            "name": name,
            "kind": d.kind,
            "sender": d.sender,
            "node": _node_of(d),
            "score": float(scores[name]) if name in scores else None,
            "layer": d.layer,
        }
        if d.kind == "resid":
            e["part"] = d.receiver.rsplit(".", 1)[1] if ".H" in d.receiver else ""
        else:
            e.update(part="%s.%s" % (d.phase, d.branch), phase=d.phase, branch=d.branch, src=d.src_head, dst=d.head)
            C = _comp_coef(model, d, cache)  # [T, S]
            X = cache[hook_name(d.layer, "attn.%s" % ("scores" if d.phase == "pre" else "pattern"))]
            e["lent"] = _r6(_masked(model, d.layer, X[d.src_head].astype(np.float64) * C).sum(-1))
            if d.branch in ("qp", "qg"):
                e["axis"], e["coef"] = "query", _r6(C[:, 0])
            elif d.branch in ("kp", "kg"):
                e["axis"], e["coef"] = "key", _r6(C[0, :])  # the same for every query
            else:
                e["axis"], e["coef"] = "none", _r6(C[0, 0])
        edges.append(e)
    return {
        "nodes": nodes,
        "edges": edges,
        "n_edges": len(edges),
        "n_comp": sum(1 for e in edges if e["kind"] == "comp"),
        "dcmha": bool(c.use_dcmha),
    }


def _labels(model, toks: np.ndarray) -> list[str]:
    """The tokens as text; "<id>" for a model directory without a tokenizer (given ids)."""
    if not os.path.lexists(os.path.join(model.path, "tokenizer.json")):
        return ["<%d>" % int(i) for i in toks]
    return [str(s) for s in model.to_str_tokens(toks)]


def _colormaps() -> dict:
    """The PNG renderer's two colour maps (dclens.heatmaps), 256 steps each, so the page colours alike."""
    seq = [c for i in range(256) for c in colormap_rgb(i / 255.0, 0.0, 1.0)]
    div = [c for i in range(256) for c in colormap_rgb(-1.0 + 2.0 * i / 255.0, -1.0, 1.0, diverging=True)]
    return {"seq": seq, "div": div}


def _layers(model, layers) -> list[int]:
    L = model.config.n_layer
    if layers is None:
        return list(range(L))
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        layers = [layers]
    out = sorted({check_index("layers entry", l, -L, L, " (model has %d layers)" % L) % L for l in layers})
    if not out:
        raise Error("explore: layers= is empty")
    return out


def _template(name: str) -> str:
    with open(os.path.join(_PAGE_DIR, name), encoding="utf-8") as f:
        return f.read()


def _script_json(obj) -> str:
    """JSON safe inside a <script> element."""
    return json.dumps(obj, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")


def explore(
    model, text, layers=None, twin=None, attribution=None, *, circuit=None, progress: bool | None = None
) -> Explorer:
    """Build the explorer page for `text` (a string or [T] tokens) on `model`.

    The forward passes run with the hooks in force (add_hook, `with
    model.hooks(...)`), so the page shows the hooked model. IG runs no Python
    hook: a target tuple with hooks in force raises dclens.Error (compute the
    attribution outside the with block and pass its result).

    Parameters
    ----------
    model : dclens.Model
    text : str or [T] integer tokens
    layers : int or list of int, optional
        The layers to embed (default all; the page says which it holds).
    twin : dclens.Model, optional
        A second model with the same tokenizer and head count (the MHA
        twin), whose attention is drawn beside.
    attribution : target tuple, Attribution or [n_layer, n_head] array, optional
        Per-head values shown as a ranking: a target tuple for
        model.attribute (IG at every shown layer's head_out with a zero
        baseline, e.g. ("logprob", -1, token); the page opens at its
        position), its result, or an array; the page opens on the head with
        the largest |value|.
    circuit : dclens.graph.Circuit, optional
        ``EdgeScores.circuit(top_n=...)`` of this model: the page gets a
        Circuit tab (the circuit as a layered graph, its edges and scores,
        and at the page's query each composition edge's clean map entry and
        what it lends, each head's own share of its composed attention),
        and the circuit's heads are marked wherever heads are listed. Its
        values come from this prompt's pass (docs/explorer.md, "Circuit
        tab"); clicking a head in it selects the head.
    progress : bool, optional
        A tqdm bar over the layers (default: when stderr is a terminal).

    Returns
    -------
    Explorer
        The page (``.html``, ``.save(path)``; shows itself in notebooks).

    Raises
    ------
    dclens.Error
        A layer out of range, an attribution of the wrong shape or without
        the layers shown, a twin that tokenizes differently or is not a
        model, a circuit that is not a ``graph.Circuit`` or is one of
        another model (a layer or head out of range, another graph), a page
        whose data would exceed 256 MB, a target tuple with hooks in force.
    """
    from tqdm.auto import tqdm  # lazy: tqdm loads with the first progress bar

    if progress is not None:
        check_bool("explore: progress", progress)
    if twin is not None and not hasattr(twin, "run_with_cache"):
        raise ArgumentTypeError("explore: twin= must be a dclens model or None, not %s" % type(twin).__name__)
    toks = model.to_tokens(text) if isinstance(text, str) else token_array(text)
    if toks.ndim != 1 or toks.size == 0 or toks.dtype.kind not in "iu":
        raise ArgumentError(
            "explore: text must be a string or one sequence of integer tokens, got %s %s" % (toks.dtype, toks.shape)
        )
    T = int(toks.size)
    c = model.config
    lays = _layers(model, layers)
    circ, cgraph = _check_circuit(model, circuit)
    if isinstance(attribution, tuple):  # IG runs no Python hook: refuse before any pass
        model.runner.refuse_hooks("explore(attribution=%r) computes integrated gradients" % (attribution,))
    # bytes before compression: the stored maps' visible cells (+ routing and dyn rows, [T, N] each)
    n_maps = 2 + (2 + 4 * c.n_head / T if c.use_dcmha else 0) + (twin is not None)
    est = sum(_n_visible(T, layer_window(model, l)) for l in lays) * c.n_head * n_maps
    if est > _LIMIT_BYTES:
        raise Error(
            "explore: %d tokens x %d layers would embed about %d MB; pass layers=[...] (fewer layers) "
            "or a shorter text" % (T, len(lays), int(est) >> 20)
        )
    if est > _WARN_BYTES:
        warnings.warn(
            "explore: %d tokens x %d layers embed about %d MB before compression; layers=[...] "
            "keeps the page smaller" % (T, len(lays), int(est) >> 20),
            stacklevel=2,
        )
    twin_cache = None
    if twin is not None:
        ttoks = np.asarray(twin.to_tokens(text) if isinstance(text, str) else text)
        if ttoks.shape != toks.shape or (ttoks != toks).any():
            raise Error(
                "explore: twin= %s tokenizes the text differently from %s (the twins must share "
                "a tokenizer)" % (twin.name, model.name)
            )
        if twin.config.n_head != c.n_head:
            raise Error(
                "explore: twin= %s has %d heads, %s has %d" % (twin.name, twin.config.n_head, model.name, c.n_head)
            )
        _, twin_cache = twin.run_with_cache(
            toks, names=[hook_name(l, "attn.pattern") for l in lays if l < twin.config.n_layer]
        )
    bar = tqdm(
        total=len(lays) + 1, desc="explore", leave=False, disable=None if progress is None else not progress
    )  # None: only on a terminal
    try:
        names = [n for l in lays for n in _layer_names(model, l)]
        if circ is not None:
            names += _circuit_names(model, cgraph, circ)
        _, cache = model.run_with_cache(toks, names=list(dict.fromkeys(names)))
        bar.update(1)
        blobs, manifests = {}, {}
        for l in lays:
            b = _layer_blob(model, cache, l, twin_cache, twin)
            blobs[str(l)], manifests[str(l)] = b.payload(), b.manifest
            bar.update(1)
    finally:
        bar.close()

    meta = {
        "model": model.name,
        "twin": twin.name if twin is not None else None,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "T": T,
        "layers": lays,
        "windows": {str(l): layer_window(model, l) for l in lays},
        "twin_windows": {str(l): layer_window(twin, l) for l in lays} if twin is not None else None,
        "dcmha": bool(c.use_dcmha),
        "branches": list(BRANCHES),
        "flow_branches": list(flow_branches(model)) if c.use_dcmha else ["skip"],
        "groups": int(getattr(c, "compose_groups", 1) or 1),
        "tokens": _labels(model, toks),
        "ig": _ig_per_head(model, toks, lays, attribution),
        "circuit": _circuit_payload(model, circ, cgraph, cache) if circ is not None else None,
        "cmap": _colormaps(),
        "manifest": manifests,
    }
    fill = {
        "/*CSS*/": _template("explorer.css"),
        "/*JS*/": _template("explorer.js"),
        "/*META*/": _script_json(meta),
        "/*BLOBS*/": _script_json(blobs),
        "<!--TITLE-->": _html.escape("dclens explorer: %s" % model.name),
    }
    # one pass over the template: nothing inserted is searched again
    page = re.sub(r"/\*(?:CSS|JS|META|BLOBS)\*/|<!--TITLE-->", lambda m: fill[m.group(0)], _template("explorer.html"))
    return Explorer(page, model.name, lays, T)
