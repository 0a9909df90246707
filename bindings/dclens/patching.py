"""Activation patching: which activations carry the difference between a
clean and a corrupted prompt.

Each cell of a sweep runs the corrupted prompt with one piece of activation
replaced by its value in the clean run and scores the logits with `metric`
(any function of the [T, V] logits, e.g. logit_diff or prob below). Cells
run batched: `batch_size` patched copies of the corrupted prompt go through
one forward pass, each row patched at its own place (rows never mix).

    from dclens import patching
    m = patching.logit_diff(model.to_single_token(" Mary"), model.to_single_token(" John"))
    r = patching.sweep(model, clean, corrupted, m, over="layer,head")     # [L, N]
    r.plot()                                                              # a Figure
    r.normalized()                                                        # 0 = corrupted, 1 = clean

Sweeps (`over`):
- "layer,head": a head's activation (hook attn.z by default; any head-indexed
  hook: q, k, v, head_out, pattern, pattern_composed, dyn.*.qw1 ...) -> [L, N]
- "layer,pos": a position of a [T, ...] hook (resid_pre by default) -> [L, T]
- "layer,head,pos": one head at one position (attn.z) -> [L, N, T]
- "layer,phase,branch": one compose branch map of DCMHA (attn.pre.kp ...)
  -> [L, 2, 5] (phase pre/post x branch skip, qp, kp, qg, kg; NaN where a
  branch does not exist, e.g. query_wise)
- "composition": single entries of the composition map: for layer l and
  phase, entry C[n, m] (source head n -> target head m) set to its clean
  value at every pair (or at `queries`) -> [L, N, N]. Only dclens can
  do this: the composed map of the corrupted run gets
  (C_clean[t,s][n,m] - C_corr[t,s][n,m]) * X_corr[n,t,s] added in target m.

Identities (tested): patching the clean run into itself changes nothing;
patching an activation everywhere (run_patched) reproduces the clean run.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .model import Cache, Error, Model
from .names import BRANCHES, PHASES, hook_name

Metric = Callable[[np.ndarray], float]


# ---------------------------------------------------------------- metrics


def logit_diff(correct: int, wrong: int, pos: int = -1) -> Metric:
    """logits[pos, correct] - logits[pos, wrong]."""

    def metric(logits: np.ndarray) -> float:
        return float(logits[pos, correct]) - float(logits[pos, wrong])

    return metric


def prob(token: int, pos: int = -1) -> Metric:
    """softmax(logits[pos])[token]."""

    def metric(logits: np.ndarray) -> float:
        x = logits[pos].astype(np.float64)
        x = np.exp(x - x.max())
        return float(x[token] / x.sum())

    return metric


def logprob(token: int, pos: int = -1) -> Metric:
    """log softmax(logits[pos])[token]."""

    def metric(logits: np.ndarray) -> float:
        x = logits[pos].astype(np.float64)
        m = x.max()
        return float(x[token] - m - np.log(np.exp(x - m).sum()))

    return metric


# ---------------------------------------------------------------- result


@dataclasses.dataclass
class PatchResult:
    """values [axes...] of metric(patched run); clean / corrupted baselines."""

    values: np.ndarray
    axes: Tuple[str, ...]
    labels: Tuple[List[str], ...]
    clean: float
    corrupted: float
    what: str

    def normalized(self) -> np.ndarray:
        """(values - corrupted) / (clean - corrupted): 0 no effect, 1 full recovery."""
        d = self.clean - self.corrupted
        if d == 0:
            raise Error("normalized: the clean and corrupted metrics are equal (%g)" % self.clean)
        return (self.values - self.corrupted) / d

    def plot(self, normalize: bool = False, title: Optional[str] = None):
        """A matplotlib Figure (diverging colours centred on the corrupted
        metric, or on 0 when normalized); 3-axis results get one panel per layer."""
        from .plots import plot_patching

        return plot_patching(self, normalize=normalize, title=title)

    def _repr_png_(self):
        return self.plot()._repr_png_()


# ---------------------------------------------------------------- helpers


def _tokens(model: Model, x) -> np.ndarray:
    a = model.to_tokens(x) if isinstance(x, str) else np.asarray(x)
    if a.ndim != 1 or a.size == 0 or a.dtype.kind not in "iu":
        raise Error("patching works on one prompt: a string or [T] integer tokens, got %r" % (x,))
    return a


def _progress(total: int, progress: Optional[bool], desc: str):
    """A tqdm bar when progress is true (None: when stderr is a terminal)."""
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False)


def _layers(model: Model, layers) -> List[int]:
    L = model.config.n_layer
    if layers is None:
        return list(range(L))
    out = []
    for l in layers:
        if not isinstance(l, (int, np.integer)) or not -L <= l < L:
            raise Error("layer %r is out of range (model has %d layers)" % (l, L))
        out.append(int(l) % L)
    return out


Cell = Tuple[str, Callable[[np.ndarray, np.ndarray], None]]  # (hook name, apply(act_row, clean_act))


def _run_cells(
    model: Model,
    corrupted: np.ndarray,
    cells: List[List[Cell]],
    clean_cache: Cache,
    metric: Metric,
    batch_size: int,
    progress,
    desc: str,
) -> np.ndarray:
    """metric of the corrupted run with each cell's patches applied, batched."""
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise Error("batch_size must be an integer >= 1, got %r" % (batch_size,))
    out = np.empty(len(cells))
    bar = _progress(len(cells), progress, desc)
    try:
        for start in range(0, len(cells), batch_size):
            chunk = cells[start : start + batch_size]
            B = len(chunk)
            by_name: Dict[str, List[Tuple[int, Callable]]] = {}
            for b, patches in enumerate(chunk):
                for name, apply in patches:
                    by_name.setdefault(name, []).append((b, apply))
            hooks = []
            for name, items in by_name.items():
                src = clean_cache[name]

                def fn(act, _n, items=items, src=src):
                    for b, apply in items:
                        apply(act[b], src)
                    return act

                hooks.append((name, fn))
            toks = np.broadcast_to(corrupted, (B, corrupted.size))
            logits = model.run_with_hooks(np.ascontiguousarray(toks), fwd_hooks=hooks)
            for b in range(B):
                out[start + b] = float(metric(logits[b]))
            if bar is not None:
                bar.update(B)
    finally:
        if bar is not None:
            bar.close()
    return out


def _baselines(model: Model, clean, corrupted, metric, names: Sequence[str]):
    c = _tokens(model, clean)
    x = _tokens(model, corrupted)
    if c.size != x.size:
        raise Error("clean and corrupted prompts must have the same number of tokens (%d vs %d)" % (c.size, x.size))
    if not callable(metric):
        raise Error("metric must be a function of the [T, V] logits, got %r" % (metric,))
    clean_logits, clean_cache = model.run_with_cache(c, names=list(names))
    corr_logits = model.forward(x)
    return c, x, clean_cache, float(metric(clean_logits)), float(metric(corr_logits))


# ---------------------------------------------------------------- sweeps


def sweep(
    model: Model,
    clean,
    corrupted,
    metric: Metric,
    over: str = "layer,head",
    hook: Optional[str] = None,
    layers=None,
    positions=None,
    queries=None,
    batch_size: int = 16,
    progress: Optional[bool] = None,
) -> PatchResult:
    """Patch clean activations into the corrupted run, one cell at a time
    (see the module docstring for `over`). hook: the per-layer hook suffix
    (default attn.z for heads, resid_pre for positions). positions: the
    positions of a "pos" sweep (default all). queries: the query positions a
    "composition" patch touches (default all)."""
    from . import interventions as iv

    over = over.replace(" ", "")
    c = model.config
    layers = _layers(model, layers)
    if over in ("layer,head", "layer,head,pos"):
        suffix = hook or "attn.z"
        names = [hook_name(l, suffix) for l in layers]
        for n in names:
            iv._head_axis(model, n)  # the hook must have a head axis
    elif over == "layer,pos":
        suffix = hook or "resid_pre"
        names = [hook_name(l, suffix) for l in layers]
    elif over == "layer,phase,branch":
        if not c.use_dcmha:
            raise Error("%s has no compose branches (plain multi-head attention)" % model.name)
        names = [
            hook_name(l, "attn.%s.%s" % (ph, b))
            for l in layers
            for ph in PHASES
            for b in BRANCHES
            if hook_name(l, "attn.%s.%s" % (ph, b)) in model.hook_names
        ]
    elif over == "composition":
        return _sweep_composition(
            model, clean, corrupted, metric, layers, hook or "post", queries, batch_size, progress
        )
    else:
        raise Error(
            "over must be 'layer,head', 'layer,pos', 'layer,head,pos', 'layer,phase,branch' or "
            "'composition', not %r" % (over,)
        )
    for n in names:
        model.parse_hook(n)
    c_t, x_t, cache, m_clean, m_corr = _baselines(model, clean, corrupted, metric, names)
    T = x_t.size
    pos = list(range(T)) if positions is None else [_pos(p, T) for p in positions]
    cells: List[List[Cell]] = []
    if over == "layer,head":
        for n in names:
            for h in range(c.n_head):
                cells.append([(n, _setter(iv._head_index(n, h, cache[n].ndim)))])
        shape, axes = (len(layers), c.n_head), ("layer", "head")
        labels = ([str(l) for l in layers], ["H%d" % h for h in range(c.n_head)])
    elif over == "layer,pos":
        for n in names:
            nd = cache[n].ndim
            ax = nd + iv._position_axis_from_end(n)
            for p in pos:
                idx = [slice(None)] * nd
                idx[ax] = p
                cells.append([(n, _setter(tuple(idx)))])
        shape, axes = (len(layers), len(pos)), ("layer", "pos")
        labels = ([str(l) for l in layers], [str(p) for p in pos])
    elif over == "layer,head,pos":
        for n in names:
            nd = cache[n].ndim
            ax = nd + iv._position_axis_from_end(n)
            for h in range(c.n_head):
                for p in pos:
                    idx = list(iv._head_index(n, h, nd))
                    idx[ax] = p
                    cells.append([(n, _setter(tuple(idx)))])
        shape, axes = (len(layers), c.n_head, len(pos)), ("layer", "head", "pos")
        labels = ([str(l) for l in layers], ["H%d" % h for h in range(c.n_head)], [str(p) for p in pos])
    else:  # layer,phase,branch
        shape, axes = (len(layers), 2, 5), ("layer", "phase", "branch")
        labels = ([str(l) for l in layers], list(PHASES), list(BRANCHES))
        where = {}
        for n in names:
            parts = n.split(".")
            l, ph, b = int(parts[1]), parts[3], parts[4]
            where[len(cells)] = (layers.index(l), PHASES.index(ph), BRANCHES.index(b))
            cells.append([(n, _setter(Ellipsis))])
        vals = _run_cells(model, x_t, cells, cache, metric, batch_size, progress, "patching " + over)
        out = np.full(shape, np.nan)
        for i, ix in where.items():
            out[ix] = vals[i]
        return PatchResult(out, axes, labels, m_clean, m_corr, over)
    vals = _run_cells(model, x_t, cells, cache, metric, batch_size, progress, "patching " + over)
    return PatchResult(vals.reshape(shape), axes, labels, m_clean, m_corr, "%s (%s)" % (over, suffix))


def _pos(p, T: int) -> int:
    if not isinstance(p, (int, np.integer)) or not -T <= p < T:
        raise Error("position %r is out of range for %d tokens" % (p, T))
    return int(p) % T


def _setter(idx):
    def apply(act, src):
        act[idx] = src[idx]

    return apply


def _sweep_composition(model: Model, clean, corrupted, metric, layers, phase, queries, batch_size, progress):
    from . import routing

    c = model.config
    if not c.use_dcmha:
        raise Error("%s has no composition maps (plain multi-head attention)" % model.name)
    if phase not in PHASES:
        raise Error("a composition sweep takes hook='pre' or hook='post' (the phase), not %r" % (phase,))
    dyn = lambda l: [n for n in model.hook_names if n.startswith(hook_name(l, "attn.dyn.%s." % phase))]
    src = lambda l: hook_name(l, "attn.%s" % ("scores" if phase == "pre" else "pattern"))
    target = lambda l: hook_name(l, "attn.%s" % ("scores_composed" if phase == "pre" else "pattern_composed"))
    names = [n for l in layers for n in dyn(l)]
    c_t, x_t, ccache, m_clean, m_corr = _baselines(model, clean, corrupted, metric, names)
    _, xcache = model.run_with_cache(x_t, names=names + [src(l) for l in layers])
    T, N = x_t.size, c.n_head
    qmask = np.zeros(T, bool)
    if queries is None:
        qmask[:] = True
    else:
        qmask[[_pos(q, T) for q in queries]] = True
    cells: List[List[Cell]] = []
    for l in layers:
        delta = routing.composition_maps(model, ccache, l, phase) - routing.composition_maps(model, xcache, l, phase)
        X = xcache[src(l)].astype(np.float64)  # [N, T, S]
        for n in range(N):
            for m_ in range(N):
                add = (delta[:, :, n, m_] * X[n] * qmask[:, None]).astype(np.float32)  # [T, S]

                def apply(act, _src, m_=m_, add=add):
                    act[m_] += add

                cells.append([(target(l), apply)])
    # the patched run reads the target hook; the clean cache needs it only as a source placeholder
    ccache_t = Cache()
    for l in layers:
        dict.__setitem__(ccache_t, target(l), np.zeros(1, np.float32))
    vals = _run_cells(model, x_t, cells, ccache_t, metric, batch_size, progress, "patching composition")
    return PatchResult(
        vals.reshape(len(layers), N, N),
        ("layer", "source head", "target head"),
        ([str(l) for l in layers], ["H%d" % h for h in range(N)], ["H%d" % h for h in range(N)]),
        m_clean,
        m_corr,
        "composition (%s)" % phase,
    )


def run_patched(model: Model, tokens, source: Cache, names: Sequence[str], return_cache: bool = False):
    """Logits of a run of `tokens` with every activation in `names` replaced,
    whole, by its value in `source` (another run's cache)."""
    from .names import canonical

    hooks = []
    for n in names:
        n = canonical(n)
        model.parse_hook(n)
        if n not in source:
            raise Error("run_patched: the source cache has no %s" % n)
        src = source[n]

        def fn(act, _n, src=src):
            if act.shape != src.shape:
                raise Error("run_patched %s: source has shape %s, this run %s" % (_n, src.shape, act.shape))
            act[...] = src
            return act

        hooks.append((n, fn))
    if return_cache:
        return model.run_with_hooks(tokens, fwd_hooks=hooks, cache_names=None)
    return model.run_with_hooks(tokens, fwd_hooks=hooks)
