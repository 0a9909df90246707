"""Attribution at hook points: integrated gradients and gradient x activation.

    res = model.attribute(tokens, ("logit_diff", -1, good, bad), at=["blocks.3.attn.head_out"],
                          method="ig", steps=32, baseline="zero")
    res.attributions["blocks.3.attn.head_out"]   # [T, N, D], the activation's layout
    res.per_head["blocks.3.attn.head_out"]       # [N]: each head's total
    res.gap["blocks.3.attn.head_out"]            # IG completeness gap

Integrated gradients (Sundararajan et al. 2017) at one hook point h with
activation a and baseline a0: the activation at h is replaced by
a0 + alpha (a - a0) and everything downstream recomputed; the attribution is
(a - a0) * mean over alpha of dF/dh, alpha at the midpoints (k + 1/2)/steps
of `steps` intervals. The interpolation points run through the engine as one
batch, in chunks of `chunk` (None: as many as the tape's memory budget
max_tape_bytes holds, memplan.ig_batch). Completeness: the attributions sum to
F(a) - F(a0); `gap` = sum - (F(a) - F(a0)) (shrinks as steps grows).
Each hook in `at` is attributed on its own (the others keep their values).

Baselines: "zero", "mean" (the activation's mean over the token axis, per
feature, broadcast to every position), or an array of the activation's shape.
Per-head sums are given for hooks with a head axis (q, k, v, z, head_out,
scores, patterns, compose branches, dynamic weights and gates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .._core import memplan, tapes
from .._core import progress as _progress
from .._core.checks import Error, check_index, is_choice
from .grad import target_value_and_grad

# hook suffix -> axis of the heads in the single-sequence layout
_HEAD_AXIS = {
    "attn.q": 1,
    "attn.k": 1,
    "attn.v": 1,
    "attn.z": 1,
    "attn.head_out": 1,
    "attn.scores": 0,
    "attn.pattern": 0,
    "attn.scores_composed": 0,
    "attn.pattern_composed": 0,
}


def _head_axis(name: str) -> int | None:
    if not name.startswith("blocks."):
        return None
    suffix = name.split(".", 2)[2]
    if suffix in _HEAD_AXIS:
        return _HEAD_AXIS[suffix]
    if suffix.startswith(("attn.pre.", "attn.post.")):
        return 0
    if suffix.startswith("attn.dyn."):
        return -1  # [T, R, N] or [T, N]
    return None


@dataclasses.dataclass
class Attribution:
    """What attribute() returns: the attribution of a target to each hook point of `at`.

    For a batch ([B, T] tokens) every value carries a leading batch axis [B, ...]; for
    one sequence ([T] tokens) it has none, and the per-sequence numbers are floats.

    Attributes
    ----------
    method : str
        "ig" (integrated gradients) or "grad_x_act" (gradient x activation).
    target_value : numpy.ndarray or float
        F(a), the target on the unchanged activations: [B] float64, or a float.
    attributions : dict of str to numpy.ndarray
        Hook name -> the attribution, float32, in the activation's layout (hooks.md),
        e.g. [T, N, D] for ``blocks.{l}.attn.head_out`` ([B, T, N, D] for a batch).
    per_head : dict of str to numpy.ndarray
        Hook name -> [N] (or [B, N]): each head's total, for the hooks with a head axis
        (q, k, v, z, head_out, scores, patterns, compose branches, dynamic weights and
        gates); other hooks are not in it.
    baseline_value : dict of str to numpy.ndarray or float
        IG only: hook name -> F(a0), the target with the activation at its baseline.
    gap : dict of str to numpy.ndarray or float
        IG only: hook name -> sum(attributions) - (F(a) - F(a0)), the completeness gap,
        which shrinks as `steps` grows.
    """

    method: str
    target_value: np.ndarray | float  # F(a) per sequence ([B] or scalar)
    attributions: dict[str, np.ndarray]  # name -> activation layout
    per_head: dict[str, np.ndarray]  # name -> [N] (or [B, N])
    baseline_value: dict[str, np.ndarray | float]  # IG: F(a0) per hook
    gap: dict[str, np.ndarray | float]  # IG: sum(attr) - (F(a) - F(a0))


def _baseline_array(baseline) -> np.ndarray:
    """A baseline given as numbers: a float32 array of finite values, or Error naming 'baseline'."""
    try:
        a0 = np.asarray(baseline, np.float32)
    except (TypeError, ValueError, OverflowError) as e:
        raise Error("attribute: baseline must be 'zero', 'mean' or an array of numbers: %s" % e) from None
    if not np.all(np.isfinite(a0)):
        raise Error("attribute: baseline holds NaN or inf")
    return a0


def attribute(
    model,
    tokens,
    target,
    at: Sequence[str],
    method: str = "ig",
    steps: int = 32,
    baseline="zero",
    progress: bool | None = None,
    chunk: int | None = None,
    max_tape_bytes: int | None = None,
) -> Attribution:
    """Integrated gradients or gradient x activation of a target at hook points.

    Model.attribute calls this. Each hook of `at` is attributed on its own (the others keep
    their values). Integrated gradients replace the activation a at the hook by
    a0 + alpha (a - a0), alpha at the midpoints (k + 1/2) / steps, recompute everything
    downstream, and give (a - a0) times the mean gradient; the interpolation points run
    through the engine as batches of `chunk`.

    Parameters
    ----------
    model : dclens.Model
        The model (no hooks of Model.hooks() in force: attribution runs its own passes).
    tokens : array_like of int
        Token ids, [T] or [B, T].
    target : str or tuple
        The scalar attributed, per sequence (dclens.grad): ("logit", pos, token),
        ("logprob", pos, token), ("logit_diff", pos, good, bad), "loss" or ("loss", mask).
    at : str or sequence of str
        The hook point(s) to attribute to (hook names of this model).
    method : {"ig", "grad_x_act"}
        Integrated gradients (default) or gradient x activation (one backward pass).
    steps : int
        IG: the number of interpolation intervals (>= 1).
    baseline : {"zero", "mean"} or array_like
        IG: a0, zeros, the activation's mean over the token axis (per feature, broadcast to
        every position), or numbers of the activation's shape ([...] or [B, ...]).
    progress : bool or None
        A progress bar over the IG batches (dclens.progress); None: one when there are more
        than 8 batches.
    chunk : int or None
        IG: interpolation points per engine batch; None: as many as `max_tape_bytes`
        allows (memplan.ig_batch).
    max_tape_bytes : int or None
        The memory budget of the gradient tape, bytes (None: the default of dclens.memplan).

    Returns
    -------
    Attribution
        The attributions per hook, their per-head totals, F(a) and, for IG, F(a0) and
        the completeness gap.

    Raises
    ------
    dclens.Error
        A `method`, `steps`, `chunk`, `at` or `baseline` that is not allowed (a baseline of
        the wrong shape, or holding NaN or inf), a target or token ids the model cannot
        take, an unknown hook name (UnknownNameError), hooks in force, or a budget too
        small for one pass.
    """
    toks, batched, at, pts, steps, chunk, budget = _attribute_plan(
        model, tokens, at, method, steps, chunk, baseline, max_tape_bytes
    )
    fa, base_grads, acts, first, resid = _activations(model, toks, target, at, pts, budget)
    out = Attribution(method, fa if batched else float(fa[0]), {}, {}, {}, {})
    if method == "grad_x_act":
        for n in at:
            out.attributions[n] = acts[n] * base_grads[pts[n]]
    else:
        out.attributions, out.baseline_value, out.gap = _integrated_gradients(
            model, toks, target, at, pts, acts, first, resid, fa, steps, chunk, baseline, budget, progress, batched
        )
    _add_per_head(out, at, batched)
    return out


def _attribute_plan(model, tokens, at, method, steps, chunk, baseline, max_tape_bytes):
    """attribute's arguments checked, before any pass: (toks [B, T], batched, at, pts, steps, chunk, budget)."""
    model.runner.refuse_hooks("attribute")
    if not is_choice(method, ("ig", "grad_x_act")):
        raise Error("attribute: method must be 'ig' or 'grad_x_act', not %r" % (method,))
    steps = check_index("attribute: steps", steps, 1, 2**31)
    if chunk is not None:  # None: as many steps per batch as the memory budget allows
        chunk = check_index("attribute: chunk", chunk, 1, 2**31)
    toks, batched = model.token_ids(tokens)
    if isinstance(at, str):
        at = [at]
    if not isinstance(at, (list, tuple)):
        raise Error("attribute: at must be a hook name or a list of them, not %s %r" % (type(at).__name__, at))
    at = list(at)
    if not at:
        raise Error("attribute: 'at' is empty")
    pts = {n: model.parse_hook(n) for n in at}
    budget = memplan.check_budget(max_tape_bytes, model)
    if isinstance(baseline, str) and baseline not in ("zero", "mean"):
        raise Error("attribute: baseline must be 'zero', 'mean' or an array, not %r" % (baseline,))
    if not isinstance(baseline, str):
        _baseline_array(baseline)
    return toks, batched, at, pts, steps, chunk, budget


def _activations(model, toks: np.ndarray, target, at: Sequence[str], pts: dict, budget: int):
    """F(a) [B], the gradients at every hook, the activations [B, ...], each hook's first layer and the
    residual streams [B, T, D] entering those layers."""
    B, T = toks.shape
    # activations and F(a): one pass with gradients at every hook (grad x act needs no more);
    # tapes leased from the model's cache (tapes.py), reused by the next call
    with tapes.lease(model, B, T, budget) as tape0:
        logits = tape0.forward(toks)
        fa, dl = target_value_and_grad(target, logits, toks)
        base_grads = tape0.backward(dl, None, list(pts.values()))
    # IG at a hook of layer l runs tapes from layer l, on the residual stream entering it
    first = {n: pts[n][1] if model.runner.point_is_layered(pts[n][0]) else 0 for n in at}
    resid_names = sorted({"blocks.%d.resid_pre" % l for l in first.values() if l})
    _, cache = model.runner.run(toks, capture=list(at) + [r for r in resid_names if r not in at], logits=False)
    resid = {
        l: np.asarray(cache["blocks.%d.resid_pre" % l], np.float32).reshape(B, T, -1) for l in set(first.values()) if l
    }
    acts = {n: np.asarray(cache[n], np.float32).reshape((B,) + base_grads[pts[n]].shape[1:]) for n in at}
    return fa, base_grads, acts, first, resid


def _integrated_gradients(
    model, toks, target, at, pts, acts, first, resid, fa, steps, chunk, baseline, budget, progress, batched
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray | float], dict[str, np.ndarray | float]]:
    """IG at each hook of `at` in turn, under one progress bar: (attributions, F(a0), gaps) per hook."""
    B, T = toks.shape
    chunks = {n: chunk or memplan.ig_batch(model, T, steps, pts[n][0], budget, first[n])[0] for n in at}
    total = sum(B * ((steps + chunks[n] - 1) // chunks[n]) for n in at)
    bar = _progress.bar(
        total=total,
        desc="integrated gradients",
        unit="batch",
        progress=progress if progress is not None or total > 8 else False,
    )
    alphas = (np.arange(steps) + 0.5) / steps
    attributions: dict[str, np.ndarray] = {}
    baseline_value: dict[str, np.ndarray | float] = {}
    gaps: dict[str, np.ndarray | float] = {}
    try:
        for n in at:
            a = acts[n]
            a0 = _ig_baseline(n, a, baseline, batched)
            l0 = first[n]
            attr, f0 = _ig_hook(model, toks, target, pts[n], a, a0, l0, resid.get(l0), chunks[n], alphas, budget, bar)
            attributions[n] = attr.astype(np.float32)
            gap = attr.reshape(B, -1).sum(1) - (fa - f0)
            baseline_value[n] = f0 if batched else float(f0[0])
            gaps[n] = gap if batched else float(gap[0])
    finally:
        if bar is not None:
            bar.close()
    return attributions, baseline_value, gaps


def _ig_baseline(name: str, a: np.ndarray, baseline, batched: bool) -> np.ndarray:
    """a0 [B, ...] for the activations a [B, ...] at hook `name`, or Error for a baseline of the wrong shape."""
    if isinstance(baseline, str):
        return (
            np.zeros_like(a)
            if baseline == "zero"
            else np.broadcast_to(a.mean(axis=_token_axis(name) + 1, keepdims=True), a.shape).astype(np.float32)
        )
    a0 = _baseline_array(baseline)
    if a0.shape == a.shape[1:]:
        a0 = np.broadcast_to(a0, a.shape)
    if a0.shape != a.shape:
        raise Error(
            "attribute: baseline for %s has shape %s, expected %s"
            % (name, a0.shape, a.shape[1:] if not batched else a.shape)
        )
    return a0


def _ig_hook(model, toks, target, p, a, a0, l0: int, resid, step: int, alphas, budget: int, bar):
    """IG at hook point p, sequence by sequence on one leased tape: (attributions [B, ...] float64, F(a0) [B])."""
    B, T = toks.shape
    steps = len(alphas)
    attr = np.zeros_like(a, dtype=np.float64)
    f0 = np.zeros(B)
    k0 = min(step, steps)
    with tapes.lease(model, k0, T, budget, l0, memplan.ig_extra(model, T, k0, p[0])) as tape:
        for b in range(B):
            attr[b], f0[b] = _ig_sequence(
                tape, toks[b : b + 1], target, p, a[b], a0[b], resid[b : b + 1] if l0 else None, step, alphas, bar
            )
    return attr, f0


def _ig_sequence(tape, tok, target, p, a, a0, resid, step: int, alphas, bar):
    """IG of one sequence (tok [1, T], a and a0 its activation and baseline): (attribution float64, F(a0))."""
    T = tok.shape[1]
    steps = len(alphas)
    gsum = np.zeros(a.shape, np.float64)
    diff = a - a0
    for c0 in range(0, steps, step):
        al = alphas[c0 : c0 + step]
        k = len(al)
        if tape.B != k:
            tape.reshape(k, T)  # the last chunk: a prefix of the buffers
        # a0 + alpha (a - a0), float32, built in place (no batch-sized temporaries)
        interp = np.empty((k,) + a.shape, np.float32)
        np.multiply(al.astype(np.float32).reshape((k,) + (1,) * a.ndim), diff[None], out=interp)
        interp += a0[None]
        lg = tape.forward(
            np.repeat(tok, k, 0),
            {p: interp},
            resid=np.repeat(resid, k, 0) if resid is not None else None,
        )
        _, d = target_value_and_grad(target, lg, np.repeat(tok, k, 0))
        g = tape.backward(d, None, [p])[p]
        for gj in g:  # one interpolation point at a time
            gsum += gj
        if bar is not None:
            bar.update(1)
    attr = (a - a0) * gsum / steps
    # F(a0): the baseline run, on the same tape
    tape.reshape(1, T)
    lg0 = tape.forward(tok, {p: np.ascontiguousarray(a0[None], np.float32)}, resid=resid)
    return attr, target_value_and_grad(target, lg0, tok)[0][0]


def _add_per_head(out: Attribution, at: Sequence[str], batched: bool) -> None:
    """out.per_head filled ([B, N] or [N]) and, for one sequence, the batch axis dropped from out.attributions."""
    for n in at:
        ax = _head_axis(n)
        attr = out.attributions[n]
        if ax is not None:
            ax = ax + 1 if ax >= 0 else attr.ndim - 1
            axes = tuple(i for i in range(1, attr.ndim) if i != ax)
            out.per_head[n] = attr.sum(axis=axes) if batched else attr.sum(axis=axes)[0]
        if not batched:
            out.attributions[n] = attr[0]


def _token_axis(name: str) -> int:
    """Axis of the query/token positions in the single-sequence layout."""
    ax = _head_axis(name)
    return 1 if ax == 0 else 0
