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

Baselines: every sweep scores the clean and the corrupted prompt first
(PatchResult.clean / .corrupted) and warns (PatchingWarning) when they are
too close to tell apart (|clean - corrupted| < MIN_GAP of the larger |value|)
or when the metric is not higher on the clean prompt: normalized() would
then divide by ~0 or flip every sign. strict=True raises dclens.Error
instead; PatchResult.baseline_note says what was found ("" when fine).

Identities (tested): patching the clean run into itself changes nothing;
patching an activation everywhere (run_patched) reproduces the clean run.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from .._core import progress as _progress_mod
from .._core.batch import is_padded_pair, prompt_pairs, role_weights
from .._core.checks import (
    ArgumentError,
    ArgumentTypeError,
    check_index,
    check_layers,
    check_str,
    is_choice,
    metric_value,
)
from .._core.mask import allowed, layer_window
from .._core.names import BRANCHES, PHASES, canonical, hook_name
from ..distributed import run_cells
from ..model import Cache, Error, Model
from . import interventions as iv
from . import routing

Metric = Callable[[np.ndarray], float]

# clean and corrupted metrics closer than this fraction of the larger |value| are "the same"
MIN_GAP = 0.05


class PatchingWarning(UserWarning):
    """The clean and corrupted baselines of a patching sweep do not make a
    meaningful 0..1 scale for normalized() (too close, or in the wrong order)."""


# ---------------------------------------------------------------- metrics


def _metric_row(logits: np.ndarray, pos, tokens) -> np.ndarray:
    """logits[pos] [V] as float64, with pos and the tokens checked against the logits' shape."""
    lg = np.asarray(logits)
    if lg.ndim != 2 or lg.dtype.kind != "f":
        raise Error("metric: logits must be a [T, V] float array, got %s %s" % (lg.dtype, lg.shape))
    T, V = lg.shape
    row = lg[check_index("metric: pos", pos, -T, T, " for %d positions" % T)].astype(np.float64)
    for what, t in tokens:
        check_index("metric: %s token" % what, t, 0, V, " (the vocabulary)")
    return row


def logit_diff(correct: int, wrong: int, pos: int = -1) -> Metric:
    """logits[pos, correct] - logits[pos, wrong].

    A metric for patching.sweep, ablation_sweep and dclens.graph; it carries its
    gradient target (``metric.target``, ("logit_diff", pos, correct, wrong)), so
    graph.attribute_edges takes it too.

    Parameters
    ----------
    correct : int
        The token id of the right answer.
    wrong : int
        The token id of the wrong answer.
    pos : int
        The position read, in [-T, T) (default -1: the last).

    Returns
    -------
    callable
        metric(logits) -> float for one prompt's logits [T, V] (a float array): the
        logit difference, in logits (computed in float64). The metric checks its
        arguments when called, not here: it raises dclens.Error for logits of another
        shape or dtype, dclens.ArgumentError for a pos or token id out of range of them
        and dclens.ArgumentTypeError for a pos or token id that is not an integer.
    """

    def metric(logits: np.ndarray) -> float:
        x = _metric_row(logits, pos, (("correct", correct), ("wrong", wrong)))
        return float(x[correct]) - float(x[wrong])

    metric.target = ("logit_diff", pos, correct, wrong)  # type: ignore[attr-defined]  # its gradient: graph.attribute_edges
    return metric


def prob(token: int, pos: int = -1) -> Metric:
    """softmax(logits[pos])[token].

    A metric for patching.sweep and ablation_sweep (it has no gradient target:
    graph.attribute_edges takes logprob instead).

    Parameters
    ----------
    token : int
        The token id whose probability is read.
    pos : int
        Where: a position in [-T, T) (default -1: the last).

    Returns
    -------
    callable
        metric(logits) -> float: the probability, in [0, 1], of one prompt's logits
        [T, V] (a float array; computed in float64). The metric checks its arguments
        when called, not here: it raises dclens.Error for logits of another shape or
        dtype, dclens.ArgumentError for a pos or token id out of range of them and
        dclens.ArgumentTypeError for a pos or token id that is not an integer.
    """

    def metric(logits: np.ndarray) -> float:
        x = _metric_row(logits, pos, (("the", token),))
        x = np.exp(x - x.max())
        return float(x[token] / x.sum())

    return metric


def logprob(token: int, pos: int = -1) -> Metric:
    """log softmax(logits[pos])[token].

    A metric for patching.sweep, ablation_sweep and dclens.graph (``metric.target``
    is ("logprob", pos, token), the gradient target of graph.attribute_edges).

    Parameters
    ----------
    token : int
        The token id whose log-probability is read.
    pos : int
        The position, in [-T, T) (default -1: the last).

    Returns
    -------
    callable
        metric(logits) -> float for one prompt's logits [T, V] (a float array): the
        log-probability, in nats (<= 0, computed in float64). The metric checks its
        arguments when called, not here: it raises dclens.Error for logits of another
        shape or dtype, dclens.ArgumentError for a pos or token id out of range of them
        and dclens.ArgumentTypeError for a pos or token id that is not an integer.
    """

    def metric(logits: np.ndarray) -> float:
        x = _metric_row(logits, pos, (("the", token),))
        m = x.max()
        return float(x[token] - m - np.log(np.exp(x - m).sum()))

    metric.target = ("logprob", pos, token)  # type: ignore[attr-defined]
    return metric


# ---------------------------------------------------------------- result


@dataclasses.dataclass
class PatchResult:
    """values [axes...] of metric(patched run); clean / corrupted baselines.

    What patching.sweep returns (shown as its plot in a notebook).

    Attributes
    ----------
    values : numpy.ndarray
        float64, one axis per name in `axes`: the metric with that cell patched, e.g.
        [L, N] ("layer,head"), [L, T] ("layer,pos"), [L, N, T], [L, 2, 5]
        ("layer,phase,branch", NaN where a branch does not exist) or [L, N, N]
        ("composition"). Over a batch of prompt pairs, the mean over the pairs.
    axes : tuple of str
        The axes' names: "layer", "head", "pos" (or "role"), "phase", "branch",
        "source head", "target head".
    labels : tuple of list of str
        Each axis' tick labels (layer numbers, "H3", positions or role names, ...).
    clean : float
        The metric of the clean prompt (the mean over pairs).
    corrupted : float
        The metric of the corrupted prompt (the mean over pairs).
    what : str
        What was patched, e.g. "layer,head (attn.z)", "layer,pos (resid_pre)",
        "composition (post)" or "layer,phase,branch"; over a batch of prompt pairs
        followed by ", mean over B pairs".
    baseline_note : str
        Why clean and corrupted cannot anchor normalized() (baseline_problem), or "".
    pos_tokens : tuple of (list of str, list of str) or None
        The clean and corrupted tokens at the "pos" axis' positions; None without a
        tokenizer, without a "pos" axis, with roles, or over a batch of prompt pairs.
    pairs : int
        How many prompt pairs are averaged (1: one pair).
    """

    values: np.ndarray
    axes: tuple[str, ...]
    labels: tuple[list[str], ...]
    clean: float
    corrupted: float
    what: str
    baseline_note: str = ""  # why the baselines are suspect ("" when they are not)
    # the clean and corrupted prompts' tokens at the "pos" axis' positions (None: no tokenizer / no pos axis)
    pos_tokens: tuple[list[str], list[str]] | None = None
    pairs: int = 1  # prompt pairs averaged (a sweep over a batch of pairs)

    def normalized(self) -> np.ndarray:
        """(values - corrupted) / (clean - corrupted): 0 no effect, 1 full recovery
        (meaningful only when clean is clearly above corrupted: see baseline_note).

        Returns
        -------
        numpy.ndarray
            The shape of `values`, unitless.

        Raises
        ------
        dclens.Error
            The clean and corrupted metrics are exactly equal.
        """
        d = self.clean - self.corrupted
        if d == 0:
            raise Error("normalized: the clean and corrupted metrics are equal (%g)" % self.clean)
        return (self.values - self.corrupted) / d

    def plot(self, normalize: bool = False, title: str | None = None):
        """A matplotlib Figure (diverging colours centred on the corrupted
        metric, or on 0 when normalized); 3-axis results get one panel per layer.

        Parameters
        ----------
        normalize : bool
            Show normalized() (0: no effect, 1: full recovery) instead of the metric.
        title : str or None
            The title (None: what was patched, with the clean and corrupted metrics).

        Returns
        -------
        matplotlib.figure.Figure
            As dclens.plots.plot_patching draws it.

        Raises
        ------
        dclens.Error
            normalize=True with equal clean and corrupted metrics (normalized()).
        """
        from ..viz.plots import plot_patching  # lazy: viz.plots loads matplotlib, when a figure is drawn

        return plot_patching(self, normalize=normalize, title=title)

    def _repr_png_(self):
        return self.plot()._repr_png_()


# ---------------------------------------------------------------- helpers


def _tokens(model: Model, x) -> np.ndarray:
    a = model.to_tokens(x) if isinstance(x, str) else np.asarray(x)
    if a.ndim != 1 or a.size == 0 or a.dtype.kind not in "iu":
        raise Error("patching works on one prompt: a string or [T] integer tokens, got %r" % (x,))
    return a


def _progress(total: int, progress: bool | None, desc: str):
    """dclens.progress's bar (None: a bar where someone watches, plain lines in a log)."""
    return _progress_mod.bar(total=total, desc=desc, progress=progress, leave=False)


def _layers(model: Model, layers) -> list[int]:
    return check_layers(layers, model.config.n_layer, negative=True)


Cell = tuple[str, Callable[[np.ndarray, np.ndarray], None]]  # (hook name, apply(act_row, clean_act))


def _run_cells(
    model: Model,
    corrupted: np.ndarray,
    cells: list[list[Cell]],
    clean_cache: Cache,
    metric: Metric,
    batch_size: int,
    progress,
    desc: str,
    ray=None,
) -> np.ndarray:
    """metric of the corrupted run with each cell's patches applied, batched
    (ray: the batches on Ray workers, dclens.distributed)."""
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ArgumentError("batch_size must be an integer >= 1, got %r" % (batch_size,))
    if ray is not None:
        return run_cells(model, corrupted, cells, clean_cache, metric, int(batch_size), progress, desc, ray, _run_cells)
    out = np.empty(len(cells))
    bar = _progress(len(cells), progress, desc)
    try:
        for start in range(0, len(cells), batch_size):
            chunk = cells[start : start + batch_size]
            B = len(chunk)
            by_name: dict[str, list[tuple[int, Callable]]] = {}
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
                out[start + b] = metric_value(metric, logits[b])
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
        raise ArgumentError(
            "clean and corrupted prompts must have the same number of tokens (%d vs %d)" % (c.size, x.size)
        )
    if not callable(metric):
        raise ArgumentError("metric must be a function of the [T, V] logits, got %r" % (metric,))
    clean_logits, clean_cache = model.run_with_cache(c, names=list(names))
    corr_logits = model.forward(x)
    return c, x, clean_cache, metric_value(metric, clean_logits), metric_value(metric, corr_logits)


def baseline_problem(clean: float, corrupted: float, min_gap: float = MIN_GAP) -> str:
    """What is wrong with a (clean, corrupted) pair of metrics as the ends of
    normalized()'s 0..1 scale, or "" when nothing is.

    The check every sweep makes of its baselines (PatchResult.baseline_note).

    Parameters
    ----------
    clean : float
        The metric of the clean prompt.
    corrupted : float
        The metric of the corrupted prompt.
    min_gap : float
        |clean - corrupted| at or below min_gap times the larger of |clean| and
        |corrupted| is too close to tell apart (default MIN_GAP, 0.05).

    Returns
    -------
    str
        A message when either metric is not finite, when they are within min_gap of
        each other (or equal), or when corrupted is above clean; "" otherwise.
    """
    if not (np.isfinite(clean) and np.isfinite(corrupted)):
        return "the clean (%r) or corrupted (%r) metric is not finite: normalized() is meaningless" % (clean, corrupted)
    scale = max(abs(clean), abs(corrupted))
    gap = clean - corrupted
    if abs(gap) <= min_gap * scale or gap == 0:
        return (
            "the clean and corrupted metrics are nearly equal (clean %.4g, corrupted %.4g, difference %.2g, "
            "under %g of their size): normalized() divides by that difference and gives arbitrary values; "
            "the corruption does not change what the metric measures" % (clean, corrupted, gap, min_gap)
        )
    if gap < 0:
        return (
            "the metric is higher on the corrupted prompt than on the clean one (clean %.4g, corrupted %.4g): "
            "normalized() flips every sign (1 = back to the *lower* clean value); swap the prompts or "
            "the metric's answers" % (clean, corrupted)
        )
    return ""


def _check_baselines(clean: float, corrupted: float, strict: bool, depth: int = 1) -> str:
    """baseline_problem, warned (PatchingWarning, at the caller `depth` frames above sweep) or raised (strict)."""
    note = baseline_problem(clean, corrupted)
    if note:
        if strict:
            raise Error("patching: " + note)
        warnings.warn("patching: " + note, PatchingWarning, stacklevel=2 + depth)
    return note


# ---------------------------------------------------------------- sweeps


def sweep(
    model: Model,
    clean,
    corrupted,
    metric: Metric,
    over: str = "layer,head",
    hook: str | None = None,
    layers=None,
    positions=None,
    queries=None,
    batch_size: int = 16,
    progress: bool | None = None,
    strict: bool = False,
    ray=None,
    roles=None,
    _groups: tuple[tuple[str, ...], list[list[int]]] | None = None,
) -> PatchResult:
    """Patch clean activations into the corrupted run, one cell at a time
    (see the module docstring for `over`). hook: the per-layer hook suffix
    (default attn.z for heads, resid_pre for positions). positions: the
    positions of a "pos" sweep (default all). queries: the query positions a
    "composition" patch touches (default all). The clean and corrupted
    metrics are computed first and checked (baseline_problem): a
    PatchingWarning when they cannot anchor normalized(), an Error with
    strict=True (before any cell runs). ray: run the cells' batches on
    Ray workers ("local:N", an address or a dclens.distributed.Cluster; the
    same values as without): docs/distributed.md.

    Batches of prompt pairs: ``clean`` and ``corrupted`` as lists of
    strings, [B, T] tokens or model.to_tokens pairs (pairs of different
    lengths padded; each pair one length), ``metric`` one function or a list
    of one per pair. Each pair is swept alone and the cells, the clean and
    the corrupted metrics are averaged over the pairs (PatchResult.pairs =
    B). Position axes need the pairs aligned: by absolute position when every
    pair has one length, else by ``roles`` ({"subject": 3, "end": -1,
    "list": (4, 9)} for every pair, or one dict per pair; a position, a
    (start, stop) span or a list of positions, negative from each pair's
    end): a "pos" cell then patches every position of its role at once and
    the axis is labelled by the roles' names.

    Parameters
    ----------
    model : dclens.Model
        The model.
    clean : str or numpy.ndarray or list of str or tuple
        The clean prompt: a string or [T] integer tokens; or a batch of prompt pairs
        (a list of strings, [B, T] tokens or model.to_tokens' (tokens, lengths)).
    corrupted : str or numpy.ndarray or list of str or tuple
        The corrupted prompt(s), as `clean`; each pair of one length.
    metric : callable or list of callable
        A function of one prompt's [T, V] logits to a number (logit_diff, prob,
        logprob, ...); over a batch, one for all pairs or a list of one per pair.
    over : str
        "layer,head", "layer,pos", "layer,head,pos", "layer,phase,branch" or
        "composition" (spaces ignored; module docstring).
    hook : str or None
        The per-layer hook suffix patched (default "attn.z" for the head sweeps, which
        need a head-indexed hook, "resid_pre" for "layer,pos"); for "composition" the
        phase, "pre" or "post" (default "post"). Not read by "layer,phase,branch".
    layers : list of int or None
        The layers, in [-L, L) (negative: from the end); None: all.
    positions : list of int or None
        The positions of a "pos" axis, in [-T, T) (negative: from the end; labelled
        by their index in [0, T)); None: all. Not with roles. Only the sweeps with a
        "pos" axis use them.
    queries : list of int or None
        The query positions a "composition" cell patches, in [-T, T); None: all. Not
        read by the other sweeps.
    batch_size : int
        Patched copies of the corrupted prompt per forward pass (>= 1).
    progress : bool or None
        A progress bar: None where someone watches (plain lines in a log), True,
        False.
    strict : bool
        Raise, not warn, when the baselines cannot anchor normalized().
    ray : str or dclens.distributed.Cluster or None
        Run the batches of cells on Ray workers ("local:N", "auto", an address or a
        Cluster); None: here.
    roles : dict or list of dict or None
        Position roles ({"subject": 3, "end": -1, "list": (4, 9)}, or one dict per pair):
        a "pos" axis of one cell per role, labelled by the roles' names.

    Returns
    -------
    PatchResult
        values [L, N], [L, T] (or [L, P] for P positions, [L, R] for R roles), [L, N, T]
        (likewise [L, N, P] or [L, N, R]), [L, 2, 5] or [L, N, N] for the L layers asked
        (the order given), with the clean and corrupted metrics; over a batch of prompt
        pairs, the means over the pairs.

    Raises
    ------
    dclens.ArgumentError
        An unknown `over`, a metric that is not a function (or a list holding one that is
        not), a layer, position or query out of range, positions with roles, prompts of
        different token lengths, a metric list of the wrong length, batch_size below 1,
        or pairs of different lengths on a position axis without roles; over, positions
        or queries of the wrong type are dclens.ArgumentTypeError. All of these are
        refused before the model runs.
    dclens.Error
        A prompt that is not a string or [T] integer tokens, layers that are not a list
        of integers, a hook without a head axis for a head sweep or one the model does
        not have, "layer,phase,branch" or "composition" on a plain multi-head attention
        model, a composition phase other than "pre" / "post", or, with strict=True,
        baselines that baseline_problem refuses (before any cell runs).

    Warns
    -----
    PatchingWarning
        The baselines cannot anchor normalized() (strict=False).
    """
    args = dict(locals())  # exactly sweep's arguments, for a batch's per-pair calls
    if _groups is None:  # the user's call (not a pair of a batch): every argument checked before any pass
        _check_sweep_args(metric, over, positions, queries, roles)
    if _is_pairs(clean) or _is_pairs(corrupted) or isinstance(metric, list):
        return _sweep_pairs(args)
    if roles is not None:
        _groups = _role_groups(model, corrupted, roles)
    check_str("over", over)
    if not callable(metric):
        raise Error(
            "sweep: metric must be a function of the logits (patching.logit_diff(...), ...), not %s %r"
            % (type(metric).__name__, metric)
        )
    over = over.replace(" ", "")
    layers = _layers(model, layers)
    if over == "composition":
        return _sweep_composition(
            model, clean, corrupted, metric, layers, hook or "post", queries, batch_size, progress, strict, ray
        )
    suffix, names = _sweep_hooks(model, over, hook, layers)
    for n in names:
        model.parse_hook(n)
    c_t, x_t, cache, m_clean, m_corr = _baselines(model, clean, corrupted, metric, names)
    note = _check_baselines(m_clean, m_corr, strict)
    pos = _sweep_positions(x_t.size, positions, _groups)  # checked by every sweep, read by the "pos" axes
    if over == "layer,phase,branch":
        cells, where = _branch_cells(names, layers)
        vals = _run_cells(model, x_t, cells, cache, metric, batch_size, progress, "patching " + over, ray)
        return PatchResult(_branch_values(vals, where, len(layers)), *_branch_axes(layers), m_clean, m_corr, over, note)
    cells = _sweep_cells(over, names, model.config.n_head, pos, cache)
    shape, axes, labels = _sweep_axes(over, layers, model.config.n_head, pos, _groups)
    words = _words(model, c_t, x_t, pos) if "pos" in axes else None
    vals = _run_cells(model, x_t, cells, cache, metric, batch_size, progress, "patching " + over, ray)
    return PatchResult(vals.reshape(shape), axes, labels, m_clean, m_corr, "%s (%s)" % (over, suffix), note, words)


def _role_groups(model: Model, corrupted, roles) -> tuple[tuple[str, ...], list[list[int]]]:
    """One pair's roles as (the roles' names, each role's positions)."""
    groups = role_weights(roles, np.array([_tokens(model, corrupted).size]), _tokens(model, corrupted).size)
    return (groups[0], [list(np.nonzero(groups[1][0, :, r])[0]) for r in range(len(groups[0]))])


def _head_hooks(model: Model, layers: list[int], suffix: str) -> list[str]:
    """The hook `suffix` of each layer, each checked to have a head axis (sweep and ablation_sweep)."""
    names = [hook_name(l, suffix) for l in layers]
    for n in names:
        iv._head_axis(model, n)  # the hook must have a head axis
    return names


def _sweep_hooks(model: Model, over: str, hook: str | None, layers: list[int]) -> tuple[str | None, list[str]]:
    """The hook suffix (None: the compose branches) and the hook names a sweep (not "composition") patches."""
    if over in ("layer,head", "layer,head,pos"):
        suffix = hook or "attn.z"
        return suffix, _head_hooks(model, layers, suffix)
    if over == "layer,pos":
        suffix = hook or "resid_pre"
        return suffix, [hook_name(l, suffix) for l in layers]
    if over == "layer,phase,branch":
        if not model.config.use_dcmha:
            raise Error("%s has no compose branches (plain multi-head attention)" % model.name)
        names = [
            hook_name(l, "attn.%s.%s" % (ph, b))
            for l in layers
            for ph in PHASES
            for b in BRANCHES
            if hook_name(l, "attn.%s.%s" % (ph, b)) in model.hook_names
        ]
        return None, names
    raise ArgumentError(
        "over must be 'layer,head', 'layer,pos', 'layer,head,pos', 'layer,phase,branch' or "
        "'composition', not %r" % (over,)
    )


def _sweep_positions(T: int, positions, groups) -> list:
    """The cells of a "pos" axis: positions in [0, T), or each role's list of positions."""
    pos: list = list(range(T)) if positions is None else [_pos(p, T) for p in positions]
    if groups is not None:  # a cell per role: all its positions at once
        if positions is not None:
            raise ArgumentError("sweep: give positions= or roles=, not both")
        pos = groups[1]
    return pos


def _sweep_cells(over: str, names: list[str], n_head: int, pos: list, cache: Cache) -> list[list[Cell]]:
    """The cells of a "layer,head", "layer,pos" or "layer,head,pos" sweep, in the result's order."""
    cells: list[list[Cell]] = []
    for n in names:
        nd = cache[n].ndim
        if over == "layer,head":
            for h in range(n_head):
                cells.append([(n, _setter(iv._head_index(n, h, nd)))])
        elif over == "layer,pos":
            ax = nd + iv._position_axis_from_end(n)
            for p in pos:
                idx: list[Any] = [slice(None)] * nd
                idx[ax] = p
                cells.append([(n, _setter(tuple(idx)))])
        else:  # layer,head,pos
            ax = nd + iv._position_axis_from_end(n)
            for h in range(n_head):
                for p in pos:
                    idx2: list[Any] = list(iv._head_index(n, h, nd))
                    idx2[ax] = p
                    cells.append([(n, _setter(tuple(idx2)))])
    return cells


def _sweep_axes(
    over: str, layers: list[int], n_head: int, pos: list, groups
) -> tuple[tuple[int, ...], tuple[str, ...], tuple[list[str], ...]]:
    """(shape, axes, labels) of a "layer,head", "layer,pos" or "layer,head,pos" sweep."""
    layer_labels, head_labels = [str(l) for l in layers], _head_labels(n_head)
    pos_axis = "role" if groups else "pos"
    pos_labels = list(groups[0]) if groups else [str(p) for p in pos]
    if over == "layer,head":
        return (len(layers), n_head), ("layer", "head"), (layer_labels, head_labels)
    if over == "layer,pos":
        return (len(layers), len(pos)), ("layer", pos_axis), (layer_labels, pos_labels)
    return (len(layers), n_head, len(pos)), ("layer", "head", pos_axis), (layer_labels, head_labels, pos_labels)


def _branch_cells(names: list[str], layers: list[int]) -> tuple[list[list[Cell]], dict[int, tuple[int, int, int]]]:
    """The cells of a "layer,phase,branch" sweep and where each goes in the [L, 2, 5] result."""
    cells: list[list[Cell]] = []
    where = {}
    for n in names:
        parts = n.split(".")
        l, ph, b = int(parts[1]), parts[3], parts[4]
        where[len(cells)] = (layers.index(l), PHASES.index(ph), BRANCHES.index(b))
        cells.append([(n, _setter(Ellipsis))])
    return cells, where


def _branch_axes(layers: list[int]) -> tuple[tuple[str, ...], tuple[list[str], ...]]:
    """(axes, labels) of a "layer,phase,branch" sweep."""
    return ("layer", "phase", "branch"), ([str(l) for l in layers], list(PHASES), list(BRANCHES))


def _branch_values(vals: np.ndarray, where: dict[int, tuple[int, int, int]], L: int) -> np.ndarray:
    """The cells' metrics placed in [L, 2, 5], NaN where a branch does not exist."""
    out = np.full((L, 2, 5), np.nan)
    for i, ix in where.items():
        out[ix] = vals[i]
    return out


def _head_labels(N: int) -> list[str]:
    """Tick labels of a head axis: H0 ... H{N-1}."""
    return ["H%d" % h for h in range(N)]


def _composition_hooks(phase: str, l: int) -> tuple[str, str]:
    """Layer l's hooks around the composition of `phase`: (its input X [N, T, S], the composed map)."""
    if phase == "pre":
        return hook_name(l, "attn.scores"), hook_name(l, "attn.scores_composed")
    return hook_name(l, "attn.pattern"), hook_name(l, "attn.pattern_composed")


def _dyn_hooks(model: Model, layers: list[int], phase: str) -> list[str]:
    """The dynamic-weight hooks of `phase` in `layers` (what the composition maps are made of)."""
    return [n for l in layers for n in model.hook_names if n.startswith(hook_name(l, "attn.dyn.%s." % phase))]


def _is_pairs(x) -> bool:
    """A batch of prompts (not one prompt): a list of strings, [B, T] tokens or a (tokens, lengths) pair."""
    if isinstance(x, (list, tuple)) and x and all(isinstance(s, str) for s in x):
        return True
    return is_padded_pair(x) or (isinstance(x, np.ndarray) and x.ndim == 2)


SWEEPS = ("layer,head", "layer,pos", "layer,head,pos", "layer,phase,branch", "composition")


def _check_sweep_args(metric, over, positions, queries, roles) -> None:
    """sweep's arguments that need no model pass: the same Error classes as ablation_sweep's."""
    check_str("over", over)
    if not is_choice(over.replace(" ", ""), SWEEPS):
        raise ArgumentError("over must be one of %s, not %r" % (", ".join(map(repr, SWEEPS)), over))
    if isinstance(metric, list):
        bad = [f for f in metric if not callable(f)]
        if not metric or bad:
            raise ArgumentError(
                "metric must be a function of the [T, V] logits or a list of them (one per prompt pair), "
                "got a list holding %r" % (bad[0] if bad else metric,)
            )
    elif not callable(metric):
        raise ArgumentError(
            "metric must be a function of the [T, V] logits (patching.logit_diff(...), ...), got %r" % (metric,)
        )
    for what, v in (("positions", positions), ("queries", queries)):
        if v is None:
            continue
        if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple, range, np.ndarray)):
            raise ArgumentTypeError("%s must be a list of token positions, not %s %r" % (what, type(v).__name__, v))
        bad = [p for p in v if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer))]
        if bad:
            raise ArgumentTypeError("%s must be integer token positions, not %r" % (what, bad[0]))
    if roles is not None and positions is not None:
        raise ArgumentError("sweep: give positions= or roles=, not both")


def _sweep_pairs(args: dict) -> PatchResult:
    """sweep over a batch of prompt pairs (`args`: sweep's arguments): each pair alone, averaged
    (sweep's docstring)."""
    model, metric, over, positions, roles = (args[k] for k in ("model", "metric", "over", "positions", "roles"))
    pr = prompt_pairs(model, args["clean"], args["corrupted"])
    B, T = pr.clean.shape
    if isinstance(metric, list):
        if len(metric) != B or not all(callable(f) for f in metric):
            raise ArgumentError(
                "sweep: metric is a list of %d for %d prompt pairs (one function per pair)" % (len(metric), B)
            )
        metrics = metric
    else:
        metrics = [metric] * B
    has_pos = "pos" in over.replace(" ", "").split(",")
    groups = None
    if roles is not None and positions is not None:  # before any pass
        raise ArgumentError("sweep: give positions= or roles=, not both")
    if roles is not None:
        names, W = role_weights(roles, pr.lengths, T)
        groups = [(names, [list(np.nonzero(W[b, :, r])[0]) for r in range(len(names))]) for b in range(B)]
    elif has_pos and pr.padded:
        raise ArgumentError(
            "sweep over %s: the pairs have different lengths (%s), so a position is not one place in every "
            "pair; name the positions by role (roles={...})" % (over, sorted(set(pr.lengths.tolist())))
        )
    # the baselines first (strict: refused before any cell runs), each pair in its own length
    lc, lx = model.forward(pr.clean), model.forward(pr.corrupted)
    m_clean = float(np.mean([metric_value(f, lc[b, :n]) for b, (f, n) in enumerate(zip(metrics, pr.lengths))]))
    m_corr = float(np.mean([metric_value(f, lx[b, :n]) for b, (f, n) in enumerate(zip(metrics, pr.lengths))]))
    note = _check_baselines(m_clean, m_corr, args["strict"], depth=2)
    results = []
    bar = _progress_mod.bar(range(B), desc="patching %s over %d pairs" % (over, B), progress=args["progress"])
    for b in bar:
        n = int(pr.lengths[b])
        with warnings.catch_warnings():  # the baselines are checked on the means below
            warnings.simplefilter("ignore", PatchingWarning)
            results.append(
                sweep(
                    **dict(
                        args,
                        clean=pr.clean[b, :n],
                        corrupted=pr.corrupted[b, :n],
                        metric=metrics[b],
                        progress=False,
                        strict=False,
                        roles=None,
                        _groups=groups[b] if groups else None,
                    )
                )
            )
    r0 = results[0]
    return PatchResult(
        np.mean([r.values for r in results], 0),
        r0.axes,
        r0.labels,
        m_clean,
        m_corr,
        "%s, mean over %d pairs" % (r0.what, B),
        note,
        None,
        B,
    )


def _words(model: Model, clean: np.ndarray, corrupted: np.ndarray, pos: list[int]):
    """The clean and corrupted tokens at `pos` as text, or None without a tokenizer."""
    try:
        a, b = model.to_str_tokens(clean), model.to_str_tokens(corrupted)
    except Error:
        return None
    return [a[p] for p in pos], [b[p] for p in pos]


def _pos(p, T: int) -> int:
    if not isinstance(p, (int, np.integer)) or not -T <= p < T:
        raise ArgumentError("position %r is out of range for %d tokens" % (p, T))
    return int(p) % T


def _setter(idx):
    def apply(act, src):
        act[idx] = src[idx]

    return apply


def _sweep_composition(
    model: Model, clean, corrupted, metric, layers, phase, queries, batch_size, progress, strict, ray=None
):
    c = model.config
    if not c.use_dcmha:
        raise Error("%s has no composition maps (plain multi-head attention)" % model.name)
    if not is_choice(phase, PHASES):
        raise Error("a composition sweep takes hook='pre' or hook='post' (the phase), not %r" % (phase,))
    src = lambda l: _composition_hooks(phase, l)[0]
    target = lambda l: _composition_hooks(phase, l)[1]
    names = _dyn_hooks(model, layers, phase)
    c_t, x_t, ccache, m_clean, m_corr = _baselines(model, clean, corrupted, metric, names)
    note = _check_baselines(m_clean, m_corr, strict, depth=2)
    _, xcache = model.run_with_cache(x_t, names=names + [src(l) for l in layers])
    T, N = x_t.size, c.n_head
    qmask = np.zeros(T, bool)
    if queries is None:
        qmask[:] = True
    else:
        qmask[[_pos(q, T) for q in queries]] = True
    cells: list[list[Cell]] = []
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
    vals = _run_cells(model, x_t, cells, ccache_t, metric, batch_size, progress, "patching composition", ray)
    return PatchResult(
        vals.reshape(len(layers), N, N),
        ("layer", "source head", "target head"),
        ([str(l) for l in layers], ["H%d" % h for h in range(N)], ["H%d" % h for h in range(N)]),
        m_clean,
        m_corr,
        "composition (%s)" % phase,
        note,
    )


def run_patched(model: Model, tokens, source: Cache, names: Sequence[str], return_cache: bool = False):
    """Logits of a run of `tokens` with every activation in `names` replaced,
    whole, by its value in `source` (another run's cache).

    Parameters
    ----------
    model : dclens.Model
        The model.
    tokens : str or numpy.ndarray
        The run's tokens, of the shape the source run had (as for run_with_hooks).
    source : dclens.Cache
        Another run's cache holding every name in `names`.
    names : list of str
        Hook names (either spelling) to replace whole.
    return_cache : bool
        Also return the cache of every hook of the patched run.

    Returns
    -------
    numpy.ndarray or tuple
        The logits [T, V] ([B, T, V] for a batch); with return_cache, (logits, cache).

    Raises
    ------
    dclens.Error
        names not a list or tuple, a source cache without one of the names, or an
        activation whose shape is not the source's (raised from the pass).
    dclens.UnknownNameError
        A name that is no hook of the model.
    """
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise Error("run_patched: names must be a list of hook names, not %s %r" % (type(names).__name__, names))
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


# ---------------------------------------------------------------- ablation sweeps


@dataclasses.dataclass
class AblationResult:
    """values [axes...] of metric(ablated run), one cell ablated at a time;
    baseline: the metric of the run with nothing ablated (hooks in force
    apply to both).

    What patching.ablation_sweep returns (shown as its plot in a notebook).

    Attributes
    ----------
    values : numpy.ndarray
        float64: [L, N] ("layer,head", "source") or [L, N, N] ("composition"), the
        metric with that cell ablated.
    axes : tuple of str
        The axes' names: ("layer", "head"), ("layer", "source head") or ("layer",
        "source head", "target head").
    labels : tuple of list of str
        Each axis' tick labels.
    baseline : float
        The metric of the prompt with nothing ablated.
    what : str
        What was ablated, e.g. "layer,head (attn.z)".
    mode : str
        "zero" or "mean".
    """

    values: np.ndarray
    axes: tuple[str, ...]
    labels: tuple[list[str], ...]
    baseline: float
    what: str
    mode: str  # "zero" or "mean"

    def effect(self) -> np.ndarray:
        """values - baseline: what ablating each cell changes (negative: the cell helped).

        Returns
        -------
        numpy.ndarray
            The shape of `values`, in the metric's units.
        """
        return self.values - self.baseline

    def plot(self, title: str | None = None):
        """A matplotlib Figure, diverging colours centred on the baseline.

        Parameters
        ----------
        title : str or None
            The title (None: the mode, what was ablated and the baseline).

        Returns
        -------
        matplotlib.figure.Figure
            As dclens.plots.plot_patching draws it; 3-axis results one panel per layer.
        """
        from ..viz.plots import plot_patching  # lazy: viz.plots loads matplotlib, when a figure is drawn

        as_patch = PatchResult(self.values, self.axes, self.labels, self.baseline, self.baseline, self.what)
        return plot_patching(
            as_patch, title=title or "%s ablation: %s (baseline %.3g)" % (self.mode, self.what, self.baseline)
        )

    def _repr_png_(self):
        return self.plot()._repr_png_()


ABLATION_SWEEPS = ("layer,head", "source", "composition")


def ablation_sweep(
    model: Model,
    tokens,
    metric: Metric,
    over: str = "layer,head",
    mode: str = "zero",
    reference=None,
    layers=None,
    phase: str = "post",
    branches: Sequence[str] = ("qp", "kp"),
    hook: str | None = None,
    batch_size: int = 16,
    progress: bool | None = None,
    ray=None,
) -> AblationResult:
    """Ablate one cell at a time in one prompt and score the logits with
    `metric` (no corrupted prompt: the counterpart of sweep).

    over:
    - "layer,head": a head's output (hook attn.z by default) -> [L, N];
      mode="mean": its mean over the reference prompts' positions
      (mean_activation), reference: prompts of any length (of the prompt's
      length for a hook with a key axis: attn.scores, attn.pattern, a
      branch map ...);
    - "source": what a head lends the others through the compose
      (interventions.block_lending with `phase` ("pre", "post" or "both")
      and `branches`) -> [L, N]; mode="mean": the head lends its input
      averaged over the reference prompts instead;
    - "composition": one entry C[m, n] of the composition map (source m ->
      target n, every query/key pair; `phase` "pre" or "post") -> [L, N, N]:
      the term X[m] C[m, n] leaves target n's composed map (zero) or
      becomes X[m] mean(C[m, n]) (mean over the reference prompts).
    For "source" and "composition", reference prompts must have the
    prompt's length (the means are per query/key cell). The hooks in force
    (add_hook, `with model.hooks`) apply to every run, the baseline too.

    Parameters
    ----------
    model : dclens.Model
        The model ("source" and "composition" need DCMHA).
    tokens : str or numpy.ndarray
        One prompt: a string or [T] integer tokens.
    metric : callable
        A function of the [T, V] logits to a number (logit_diff, prob, logprob, ...).
    over : {"layer,head", "source", "composition"}
        What one cell ablates (spaces ignored).
    mode : {"zero", "mean"}
        Ablate to zero, or to the mean over the reference prompts.
    reference : str or list of str or numpy.ndarray or None
        With mode="mean" (and only then): the prompts averaged over, a string, a list of
        strings of one token length or [B, T'] integer tokens; for "source" and
        "composition" of the prompt's length T.
    layers : list of int or None
        The layers, in [-L, L) (negative: from the end); None: all.
    phase : str
        "source": "pre", "post" or "both"; "composition": "pre" or "post". Not read by
        "layer,head".
    branches : sequence of str
        "source": the branches whose lending is blocked, of "qp", "kp" and "static"
        (block_lending).
    hook : str or None
        "layer,head": the head-indexed hook suffix ablated (default "attn.z").
    batch_size : int
        Ablated copies of the prompt per forward pass (>= 1).
    progress : bool or None
        A progress bar: None where someone watches (plain lines in a log), True,
        False.
    ray : str or dclens.distributed.Cluster or None
        Run the batches of cells on Ray workers, as patching.sweep.

    Returns
    -------
    AblationResult
        values [L, N] ("layer,head", "source") or [L, N, N] ("composition") for the
        layers asked, with the baseline.

    Raises
    ------
    dclens.ArgumentError
        An unknown over, mode or phase, a metric that is not callable, reference without
        mode="mean" (or mode="mean" without it), reference prompts of different or wrong
        lengths or not token ids, a layer out of range, or batch_size below 1.
    dclens.Error
        A prompt that is not a string or [T] integer tokens, layers that are not a list of
        integers, "source" or "composition" on a plain multi-head attention model, a hook
        without a head axis (or one the model does not have), "layer,head" with
        mode="mean" on a hook with a key axis and reference prompts of another length
        (raised from the pass), or what block_lending refuses.
    """
    over = _check_ablation_args(over, mode, metric, reference)
    toks = _tokens(model, tokens)
    T, N, c = toks.size, model.config.n_head, model.config
    layers = _layers(model, layers)
    if over != "layer,head" and not c.use_dcmha:
        raise Error("%s has no compose (plain multi-head attention): over=%r needs DCMHA" % (model.name, over))
    ref = None if reference is None else _reference(model, reference, T if over != "layer,head" else None, over)
    baseline = metric_value(metric, model.forward(toks))
    if over == "layer,head":
        cells, src = _head_ablation_cells(model, layers, hook or "attn.z", ref)
    elif over == "source":
        cells, src = _source_ablation_cells(model, layers, phase, branches, mode, ref)
    else:
        cells, src = _composition_ablation_cells(model, toks, layers, phase, ref)
    shape, axes, labels, what = _ablation_axes(over, layers, N, hook or "attn.z", phase, branches)
    vals = _run_cells(model, toks, cells, src, metric, batch_size, progress, "%s ablation %s" % (mode, over), ray)
    return AblationResult(vals.reshape(shape), axes, labels, baseline, what, mode)


def _check_ablation_args(over, mode, metric, reference) -> str:
    """ablation_sweep's arguments that need no model: `over` without spaces, or ArgumentError."""
    check_str("over", over)
    over = over.replace(" ", "")
    if not is_choice(over, ABLATION_SWEEPS):
        raise ArgumentError("over must be one of %s, not %r" % (", ".join(map(repr, ABLATION_SWEEPS)), over))
    if not is_choice(mode, ("zero", "mean")):
        raise ArgumentError("mode must be 'zero' or 'mean', not %r" % (mode,))
    if not callable(metric):
        raise ArgumentError("metric must be a function of the [T, V] logits, got %r" % (metric,))
    if (mode == "mean") != (reference is not None):
        raise ArgumentError("reference= (prompts to average over) goes with mode='mean', and mode='mean' needs it")
    return over


def _head_ablation_cells(model: Model, layers: list[int], suffix: str, ref) -> tuple[list[list[Cell]], Cache]:
    """ablation_sweep "layer,head": a cell per head (zero, or its mean over the reference prompts `ref`)."""
    names = _head_hooks(model, layers, suffix)
    if ref is not None:
        _, rc = model.run_with_cache(ref, names=names)
    cells: list[list[Cell]] = []
    src = _no_source(names)
    for n in names:
        for h in range(model.config.n_head):
            idx = iv._head_index(n, h, _ndim(model, n))
            value = 0.0 if ref is None else iv.mean_activation(rc, int(n.split(".")[1]), h, suffix)
            cells.append([(n, _filler(idx, value))])
    return cells, src


def _source_ablation_cells(
    model: Model, layers: list[int], phase: str, branches: Sequence[str], mode: str, ref
) -> tuple[list[list[Cell]], Cache]:
    """ablation_sweep "source": a cell per head, its lending blocked (interventions.block_lending)."""
    if not is_choice(phase, PHASES + ("both",)):
        raise ArgumentError("phase must be 'pre', 'post' or 'both', not %r" % (phase,))
    means = {}
    if ref is not None:
        xs = [_composition_hooks(ph, l)[0] for l in layers for ph in PHASES]
        _, rc = model.run_with_cache(ref, names=xs)
        means = {n: rc[n].astype(np.float64).mean(0) for n in xs}  # [N, T, S]
    cells: list[list[Cell]] = []
    names: list[str] = []
    for l in layers:
        for h in range(model.config.n_head):
            hooks = iv.Hooks()
            for ph in PHASES if phase == "both" else (phase,):
                mean = None if ref is None else means[_composition_hooks(ph, l)[0]][h]
                hooks += iv.block_lending(model, l, h, ph, branches, mode, mean)
            cells.append([(n, _row_hook(fn)) for n, fn in hooks])
            names += [n for n, _ in hooks]
    return cells, _no_source(names)


def _composition_ablation_cells(
    model: Model, toks: np.ndarray, layers: list[int], phase: str, ref
) -> tuple[list[list[Cell]], Cache]:
    """ablation_sweep "composition": a cell per entry C[m, n] of each layer's composition map."""
    if not is_choice(phase, PHASES):
        raise ArgumentError("a composition sweep takes phase='pre' or 'post', not %r" % (phase,))
    T, N = toks.size, model.config.n_head
    dyn = _dyn_hooks(model, layers, phase)
    _, cache = model.run_with_cache(toks, names=dyn + [_composition_hooks(phase, l)[0] for l in layers])
    if ref is not None:
        _, rc = model.run_with_cache(ref, names=dyn)
    cells: list[list[Cell]] = []
    src = _no_source([_composition_hooks(phase, l)[1] for l in layers])
    for l in layers:
        x_name, target = _composition_hooks(phase, l)
        C = routing.composition_maps(model, cache, l, phase)  # [T, S, N, N]
        if ref is None:
            goal = np.zeros_like(C)
        else:
            goal = np.mean(
                [routing.composition_maps(model, _row_cache(rc, b, dyn), l, phase) for b in range(ref.shape[0])],
                axis=0,
            )
        X = np.where(allowed(T, T, layer_window(model, l)), cache[x_name].astype(np.float64), 0.0)  # [N, T, S]
        for m_ in range(N):
            for n_ in range(N):
                add = ((goal[:, :, m_, n_] - C[:, :, m_, n_]) * X[m_]).astype(np.float32)  # [T, S]
                cells.append([(target, _adder(n_, add))])
    return cells, src


def _ablation_axes(
    over: str, layers: list[int], N: int, suffix: str, phase: str, branches: Sequence[str]
) -> tuple[tuple[int, ...], tuple[str, ...], tuple[list[str], ...], str]:
    """(shape, axes, labels, what) of an ablation sweep."""
    layer_labels = [str(l) for l in layers]
    if over == "layer,head":
        return (len(layers), N), ("layer", "head"), (layer_labels, _head_labels(N)), "layer,head (%s)" % suffix
    if over == "source":
        what = "source (%s lending through %s)" % (phase, ", ".join(branches))
        return (len(layers), N), ("layer", "source head"), (layer_labels, _head_labels(N)), what
    return (
        (len(layers), N, N),
        ("layer", "source head", "target head"),
        (layer_labels, _head_labels(N), _head_labels(N)),
        "composition (%s)" % phase,
    )


def _no_source(names) -> Cache:
    """The source Cache of ablation cells, which read none: a placeholder per hook name."""
    src = Cache()
    placeholder = np.zeros(1, np.float32)
    for n in names:
        dict.__setitem__(src, n, placeholder)
    return src


def _ndim(model: Model, name: str) -> int:
    """The rank of a hook's activation for one sequence (the engine's shape has a batch axis first)."""
    return len(model.runner.hook_shape(model.parse_hook(name)[0], 1, 1)) - 1


def _reference(model: Model, reference, T: int | None, over: str) -> np.ndarray:
    """ablation_sweep's reference prompts as [B, T'] tokens (T' = T when T is given)."""
    if isinstance(reference, str):
        reference = [reference]
    if isinstance(reference, list) and reference and all(isinstance(r, str) for r in reference):
        rows = [model.to_tokens(r) for r in reference]
        if len({r.size for r in rows}) != 1:
            raise ArgumentError(
                "reference: the prompts have different token lengths (%s); give prompts of one length"
                % sorted({r.size for r in rows})
            )
        ref = np.stack(rows)
    else:
        ref = np.asarray(reference)
        if ref.ndim == 1:
            ref = ref[None]
    if ref.ndim != 2 or ref.size == 0 or ref.dtype.kind not in "iu":
        raise ArgumentError(
            "reference must be a string, a list of strings of one token length or [B, T] integer tokens, got %r"
            % (reference,)
        )
    if T is not None and ref.shape[1] != T:
        raise ArgumentError(
            "reference: over=%r averages per query/key cell, so the reference prompts need the prompt's %d tokens "
            "(got %d)" % (over, T, ref.shape[1])
        )
    return ref


def _filler(idx, value):
    def apply(act, _src):
        act[idx] = value

    return apply


def _adder(target: int, add: np.ndarray):
    def apply(act, _src):
        act[target] += add

    return apply


def _row_hook(fn):
    """A hook function of one sequence as a patching cell (act: that row)."""

    def apply(act, _src):
        r = fn(act, "")
        if r is not None and r is not act:
            act[...] = r

    return apply


def _row_cache(cache: Cache, b: int, names: Sequence[str]) -> Cache:
    out = Cache()
    for n in names:
        dict.__setitem__(out, n, cache[n][b])
    return out
