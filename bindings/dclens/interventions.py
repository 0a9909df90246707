"""Ready-made hook functions for the common interventions.

Each helper returns (name, fn) pairs for Model.run_with_hooks:

    logits = model.run_with_hooks(tokens, fwd_hooks=[
        *disable_branch(model, "post", "kp", layers=[3]),
        ablate_head(model, layer=2, head=5),
    ])

Head-indexed activations (layouts of shared/docs/hooks.md, without the batch
axis for 1-D tokens): attn.z / q / k / v [T, N, Dh], head_out [T, N, D],
scores, pattern, branches [N, T, S].
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ._checks import check_index
from .model import Cache, Error, Model
from .names import BRANCHES, PHASES, hook_name


# Axis of the head index in each head-indexed hook (counted from the end,
# so the same number works with or without a leading batch axis).
_HEAD_AXIS_FROM_END = {
    "attn.q": -2,
    "attn.k": -2,
    "attn.v": -2,
    "attn.z": -2,
    "attn.head_out": -2,
    "attn.scores": -3,
    "attn.scores_composed": -3,
    "attn.pattern": -3,
    "attn.pattern_composed": -3,
    **{"attn.%s.%s" % (ph, b): -3 for ph in PHASES for b in BRANCHES},
    # dynamic weights [T, R, N] / [S, R, N] and gates [T, N] / [S, N]: head last
    **{"attn.dyn.%s.%s" % (ph, w): -1 for ph in PHASES for w in ("qw1", "qw2", "kw1", "kw2", "qdd", "kdd")},
    "attn.pre.static": -3,
    "attn.post.static": -3,
    "attn.routing": -1,
}


def _head_axis(model: Model, name: str) -> int:
    """Check (before any pass) that `name` exists and has a head axis."""
    model.parse_hook(name)
    axis = _HEAD_AXIS_FROM_END.get(_suffix(name))
    if axis is None:
        raise Error(
            "hook %s has no head axis (head-indexed hooks: %s)"
            % (name, ", ".join(sorted(k for k in _HEAD_AXIS_FROM_END if "dyn" not in k)) + ", attn.dyn.*")
        )
    return axis


def _canon(name: str) -> str:
    from .names import canonical

    return canonical(name)


def _position_axis_from_end(name: str) -> int:
    """Axis of the (query) position: -3 for [T, N, X] layouts, else -2."""
    s = _suffix(name)
    four_d = s in ("attn.q", "attn.k", "attn.v", "attn.z", "attn.head_out") or (
        s.startswith("attn.dyn.") and s[-1] in "12"
    )
    return -3 if four_d else -2


def _suffix(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("blocks.") else name


def _head_index(name: str, head: int, ndim: int) -> tuple:
    axis = _HEAD_AXIS_FROM_END.get(_suffix(name))
    if axis is None:
        raise Error("hook %s has no head axis" % name)
    idx = [slice(None)] * ndim
    idx[ndim + axis] = head
    return tuple(idx)


def _check_head(model: Model, layer: int, head: int) -> None:
    c = model.config
    check_index("layer", layer, 0, c.n_layer, " (model has %d layers)" % c.n_layer)
    check_index("head", head, 0, c.n_head, " (model has %d heads)" % c.n_head)


def ablate_head(
    model: Model, layer: int, head: int, kind: str = "zero", mean: Optional[np.ndarray] = None, point: str = "attn.z"
) -> Tuple[str, object]:
    """Remove head `head` of `layer` from the residual stream.

    kind="zero" sets its per-head output (attn.z by default) to 0; kind="mean"
    replaces it by `mean` (e.g. mean_activation(cache_of_many_runs, ...)),
    broadcast over positions: shape [Dh] or [T, Dh] for attn.z."""
    _check_head(model, layer, head)
    name = _canon(hook_name(layer, point))
    _head_axis(model, name)
    if kind not in ("zero", "mean"):
        raise Error("ablate_head: kind must be 'zero' or 'mean', not %r" % (kind,))
    if kind == "mean" and mean is None:
        raise Error("ablate_head: kind='mean' needs the mean activation (mean=...)")
    if kind == "mean":
        mean = np.asarray(mean, dtype=np.float32)
        if not np.all(np.isfinite(mean)):
            raise Error("ablate_head %s: the mean has NaN or inf values" % name)
        c = model.config
        last = {
            "attn.z": c.head_dim,
            "attn.q": c.head_dim,
            "attn.k": c.head_dim,
            "attn.v": c.head_dim,
            "attn.head_out": c.d_model,
        }.get(_suffix(name))
        if last is not None and (mean.ndim == 0 or mean.shape[-1] != last):
            raise Error(
                "ablate_head %s: mean has shape %s; its last axis must be %d (one head's slice)"
                % (name, mean.shape, last)
            )

    def fn(act, _name):
        idx = _head_index(name, head, act.ndim)
        act[idx] = 0.0 if kind == "zero" else np.broadcast_to(np.asarray(mean, np.float32), act[idx].shape)
        return act

    return name, fn


def mean_activation(cache: Cache, layer: int, head: int, point: str = "attn.z") -> np.ndarray:
    """Mean of a head's activation over positions (and batch): e.g. [Dh] for attn.z."""
    name = hook_name(layer, point)
    if name not in cache:
        raise Error("cache has no %s" % name)
    a = cache[name]
    per_head = a[_head_index(name, head, a.ndim)]
    return per_head.reshape(-1, per_head.shape[-1]).mean(axis=0)


def disable_branch(
    model: Model, phase: str, branch: str, layers: Optional[Iterable[int]] = None
) -> List[Tuple[str, object]]:
    """Zero one compose branch (skip, qp, kp, qg, kg) of pre- or post-compose in
    the chosen layers (all by default): the composed sum then lacks it."""
    if phase not in PHASES:
        raise Error("phase must be 'pre' or 'post', not %r" % (phase,))
    if branch not in BRANCHES:
        raise Error("branch must be one of %s, not %r" % (", ".join(BRANCHES), branch))
    layers = range(model.config.n_layer) if layers is None else list(layers)
    hooks = []
    for l in layers:
        l = check_index("layer", l, 0, model.config.n_layer, " (model has %d layers)" % model.config.n_layer)
        name = hook_name(l, "attn.%s.%s" % (phase, branch))
        model.parse_hook(name)
        hooks.append((name, _zero))
    return hooks


def disable_dynamic(model: Model, layers: Optional[Iterable[int]] = None) -> List[Tuple[str, object]]:
    """Zero every dynamic branch (qp, kp, qg, kg) of both phases: the layers then
    compute plain multi-head attention with the same weights."""
    out = []
    for phase in PHASES:
        for b in BRANCHES[1:]:
            if b in ("kp", "kg") and model.config.query_wise:
                continue
            if b in ("qp", "qg") and getattr(model.config, "key_wise", False):
                continue
            out += disable_branch(model, phase, b, layers)
    return out


def scale(model: Model, name: str, factor: float, head: Optional[int] = None) -> Tuple[str, object]:
    """Multiply an activation (or one head's slice of it) by `factor`."""
    name = _canon(name)
    model.parse_hook(name)
    if not isinstance(factor, (int, float, np.integer, np.floating)) or not np.isfinite(factor):
        raise Error("scale %s: factor must be a finite number, got %r" % (name, factor))
    if head is not None:
        _head_axis(model, name)
        _check_head(model, 0, head)

    def fn(act, _name):
        if head is None:
            act *= factor
        else:
            act[_head_index(name, head, act.ndim)] *= factor
        return act

    return name, fn


def patch(
    model: Model, name: str, source: Cache, head: Optional[int] = None, positions: Optional[Sequence[int]] = None
) -> Tuple[str, object]:
    """Replace an activation by the one in `source` (another run's cache), for
    all of it, one head, and/or some positions (the T axis, second from the
    front for [T, ...] layouts, or the query axis of [N, T, S] maps)."""
    name = _canon(name)
    model.parse_hook(name)
    if head is not None:
        check_index("head", head, 0, model.config.n_head, " (model has %d heads)" % model.config.n_head)
    if positions is not None:
        positions = [check_index("position", p, 0, 1 << 24) for p in positions]
    if name not in source:
        raise Error("patch: the source cache has no %s" % name)
    src = source[name]
    if head is not None:
        _head_axis(model, name)
        _check_head(model, 0, head)
    if positions is not None:
        positions = list(positions)
        ax = src.ndim + _position_axis_from_end(name)
        T = src.shape[ax]
        for p in positions:
            if not isinstance(p, (int, np.integer)) or not -T <= p < T:
                raise Error("patch %s: position %r is out of range for %d positions" % (name, p, T))

    def fn(act, _name):
        if src.shape != act.shape:
            raise Error("patch %s: source has shape %s, this run %s" % (name, src.shape, act.shape))
        idx = [slice(None)] * act.ndim
        if head is not None:
            idx = list(_head_index(name, head, act.ndim))
        if positions is not None:
            idx[act.ndim + _position_axis_from_end(name)] = list(positions)
        act[tuple(idx)] = src[tuple(idx)]
        return act

    return name, fn


def _zero(act, _name):
    act[...] = 0.0
    return act


# ------------------------------------------------------------ attention variants
# (model-spec.md 5: the static Talking-Heads branch, Mixture-of-Head routing)


def _layers(model: Model, layers: Optional[Iterable[int]]) -> List[int]:
    out = list(range(model.config.n_layer)) if layers is None else [int(l) for l in layers]
    for l in out:
        if not 0 <= l < model.config.n_layer:
            raise Error("layer %d is out of range (model has %d layers)" % (l, model.config.n_layer))
    return out


def disable_static(
    model: Model, phases: Sequence[str] = ("pre", "post"), layers: Optional[Iterable[int]] = None
) -> List[Tuple[str, object]]:
    """Zero the static (Talking-Heads) composition branch of the given phases
    and layers (use_sw models): the composition maps lose their fixed W term."""
    if not model.config.use_sw:
        raise Error("%s has no static composition branch (use_sw is off)" % model.name)
    hooks = []
    for ph in phases:
        if ph not in PHASES:
            raise Error("phase must be 'pre' or 'post', not %r" % (ph,))
        for l in _layers(model, layers):
            name = hook_name(l, "attn.%s.static" % ph)
            model.parse_hook(name)
            hooks.append((name, _zero))
    return hooks


def _moh(model: Model) -> Tuple[int, int]:
    c = model.config
    if c.moh_shared_heads is None:
        raise Error("%s has no Mixture-of-Head routing ('moh' is not in its config)" % model.name)
    return c.moh_shared_heads, c.moh_routed_topk


def force_routing(
    model: Model,
    layer: int,
    heads: Sequence[int],
    weights: Optional[Sequence[float]] = None,
    positions: Optional[Sequence[int]] = None,
) -> Tuple[str, object]:
    """Force the MoH routing of `layer`: the routing scores (attn.routing, [T, N])
    become `weights` (default 1 each) on `heads` and 0 on every other head, at
    every position or only at `positions`. The gate multiplies each head's z."""
    _moh(model)
    N = model.config.n_head
    heads = [int(h) for h in heads]
    for h in heads:
        _check_head(model, layer, h)
    w = np.ones(len(heads)) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (len(heads),) or not np.all(np.isfinite(w)):
        raise Error("force_routing: weights must be %d finite numbers, one per head" % len(heads))
    row = np.zeros(N, dtype=np.float32)
    row[heads] = w
    name = hook_name(layer, "attn.routing")

    def fn(act, _name):
        idx = [slice(None)] * act.ndim
        if positions is not None:
            idx[act.ndim - 2] = list(positions)
        act[tuple(idx)] = row
        return act

    return name, fn


def scale_router_logits(
    model: Model, factor: float, layers: Optional[Iterable[int]] = None, heads: Optional[Sequence[int]] = None
) -> List[Tuple[str, object]]:
    """Multiply the MoH router logits (attn.router_logits, [T, N - hs]) by `factor`
    (all routed heads, or the routed-head indices `heads`, 0 = first routed head):
    < 1 flattens the routing distribution, > 1 sharpens it; the top-k selection
    and the routing scores are recomputed from the scaled logits."""
    hs, _ = _moh(model)
    NR = model.config.n_head - hs
    if heads is not None:
        heads = [int(h) for h in heads]
        for h in heads:
            if not 0 <= h < NR:
                raise Error("routed head %d is out of range (%d routed heads)" % (h, NR))
    out = []
    for l in _layers(model, layers):
        name = hook_name(l, "attn.router_logits")
        model.parse_hook(name)

        def fn(act, _name):
            if heads is None:
                act *= factor
            else:
                act[..., heads] *= factor
            return act

        out.append((name, fn))
    return out
