"""Ready-made hook functions for the common interventions.

Every helper returns a ``Hooks``: a list of (name, fn) pairs, accepted
wherever hooks are (run_with_hooks, run_with_cache, ``with model.hooks``,
add_hook, generate), alone, spliced into a list, or nested in one:

    logits = model.run_with_hooks(tokens, fwd_hooks=ablate_head(model, layer=2, head=5))
    logits = model.run_with_hooks(tokens, fwd_hooks=[
        *disable_branch(model, "post", "kp", layers=[3]),
        *ablate_head(model, layer=2, head=5),
    ])
    hooks = disable_branch(model, "post", "kp") + ablate_head(model, 2, 5)   # a Hooks too
    with model.hooks([ablate_head(model, 2, 5)]): ...                         # nested: flattened
    hooks                       # repr: each hook point and what the hook does

Head-indexed activations (layouts of shared/docs/hooks.md, without the batch
axis for 1-D tokens): attn.z / q / k / v [T, N, Dh], head_out [T, N, D],
scores, pattern, branches [N, T, S].
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .._core import hooks as _hooks
from .._core.checks import (
    ArgumentError,
    check_index,
    check_int_list,
    check_layers,
    check_str,
    is_choice,
    is_finite_number,
)
from .._core.hooks import Hooks
from .._core.mask import allowed, layer_window
from .._core.names import BRANCHES, PHASES, canonical, hook_name
from ..model import Cache, Error, Model
from . import routing

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
# hooks with one number per (position, head) ([T, N]: the gates, the MoH routing)
_SCALAR_PER_HEAD = frozenset(["attn.routing"] + ["attn.dyn.%s.%s" % (ph, w) for ph in PHASES for w in ("qdd", "kdd")])


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
    idx: list[Any] = [slice(None)] * ndim
    idx[ndim + axis] = head
    return tuple(idx)


def _check_head(model: Model, layer: int, head: int) -> None:
    c = model.config
    check_index("layer", layer, 0, c.n_layer, " (model has %d layers)" % c.n_layer)
    check_index("head", head, 0, c.n_head, " (model has %d heads)" % c.n_head)


def _named(fn, label: str):
    """fn, named after the call that made it (Hooks' repr and the errors that
    list hooks in force show the name)."""
    fn.__name__ = fn.__qualname__ = label
    return fn


def _zeroing(label: str):
    """A fresh hook function that zeroes the whole activation, named label."""

    def fn(act, _name):
        act[...] = 0.0
        return act

    return _named(fn, label)


def ablate_head(
    model: Model, layer: int, head: int, kind: str = "zero", mean: np.ndarray | None = None, point: str = "attn.z"
) -> Hooks:
    """Remove head `head` of `layer` from the residual stream.

    Parameters
    ----------
    model : Model
    layer, head : int
        The head.
    kind : {"zero", "mean"}
        "zero" sets its per-head activation at ``point`` to 0; "mean"
        replaces it by ``mean``.
    mean : array, optional
        With kind="mean": the replacement (e.g. ``mean_activation(cache of
        many runs, ...)``), broadcast over positions: shape [Dh] or [T, Dh]
        for attn.z.
    point : str
        The head-indexed hook to ablate at (default "attn.z").

    Returns
    -------
    Hooks
        One (name, fn) pair: the head's slice replaced.

    Raises
    ------
    dclens.Error
        A layer or head out of range, a point without a head axis, a bad
        kind, a missing or non-finite mean or one of the wrong last axis.
    """
    _check_head(model, layer, head)
    check_str("ablate_head: point", point)
    try:
        name = _canon(hook_name(layer, point))
        _head_axis(model, name)
    except Error as e:
        raise ArgumentError("ablate_head: point %r: %s" % (point, e)) from None
    if not is_choice(kind, ("zero", "mean")):
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
        if kind == "zero":
            act[idx] = 0.0
            return act
        try:
            act[idx] = np.broadcast_to(np.asarray(mean, np.float32), act[idx].shape)
        except ValueError:
            raise Error(
                "ablate_head %s: mean has shape %s, which does not fit this run's head slice %s (a key axis "
                "follows the prompt's length: take the mean from prompts of this length)"
                % (name, np.shape(mean), act[idx].shape)
            ) from None
        return act

    return Hooks([(name, _named(fn, "ablate_head(layer=%d, head=%d, kind=%r)" % (layer, head, kind)))])


def mean_activation(cache: Cache, layer: int, head: int, point: str = "attn.z") -> np.ndarray:
    """Mean of a head's activation over positions (and batch): e.g. [Dh] for attn.z.

    Parameters
    ----------
    cache : dclens.Cache
        A cache holding the hook (``run_with_cache``), of one prompt or a
        batch.
    layer : int
        The layer (>= 0).
    head : int
        The head, 0 .. the hook's head count - 1.
    point : str, default "attn.z"
        A per-head hook point of the layer ("attn.z", "attn.q",
        "attn.head_out", "attn.pattern", ...).

    Returns
    -------
    numpy.ndarray
        The head's activation averaged over every axis but the last: [Dh]
        for attn.z, [D] for attn.head_out, [S] for a pattern's rows, [R]
        for a dynamic weight; a 0-d array (the mean over positions) for the
        hooks with one number per position and head (the gates
        ``attn.dyn.*.qdd`` / ``kdd``, ``attn.routing``).

    Raises
    ------
    dclens.ArgumentError
        A layer or head out of range, or a point that is not a hook name
        (dclens.ArgumentTypeError: not an integer, not a string).
    dclens.Error
        The cache does not hold that hook, or the point has no head axis.
    """
    check_index("mean_activation: layer", layer, 0, 1 << 20)
    check_str("mean_activation: point", point)
    try:
        name = hook_name(layer, point)
    except Error as e:
        raise ArgumentError("mean_activation: point %r: %s" % (point, e)) from None
    if name not in cache:
        raise Error("mean_activation: the cache has no %s (layer %d, point %r)" % (name, layer, point))
    a = cache[name]
    idx = _head_index(name, 0, a.ndim)
    n_head = a.shape[[i for i, x in enumerate(idx) if x == 0][0]]
    check_index("head", head, 0, n_head, " (the cache's %s has %d heads)" % (name, n_head))
    per_head = a[_head_index(name, head, a.ndim)]
    if _suffix(name) in _SCALAR_PER_HEAD:  # [(B,) T]: one number per head and position
        return np.asarray(per_head.mean(), a.dtype)
    return per_head.reshape(-1, per_head.shape[-1]).mean(axis=0)


def disable_branch(model: Model, phase: str, branch: str, layers: Iterable[int] | None = None) -> Hooks:
    """Zero one compose branch of pre- or post-compose in the chosen layers:
    the composed sum then lacks it.

    Parameters
    ----------
    model : Model
    phase : {"pre", "post"}
    branch : {"skip", "qp", "kp", "qg", "kg"}
    layers : list of int, optional
        The layers (default all).

    Returns
    -------
    Hooks
        One (name, fn) pair per layer, the branch zeroed.

    Raises
    ------
    dclens.Error
        A bad phase, branch or layer, or a branch the model lacks.
    """
    if not is_choice(phase, PHASES):
        raise Error("phase must be 'pre' or 'post', not %r" % (phase,))
    if not is_choice(branch, BRANCHES):
        raise Error("branch must be one of %s, not %r" % (", ".join(BRANCHES), branch))
    hooks = Hooks()
    for l in _layers(model, layers):
        name = hook_name(l, "attn.%s.%s" % (phase, branch))
        model.parse_hook(name)
        hooks.append((name, _zeroing("disable_branch(%r, %r)" % (phase, branch))))
    return hooks


def disable_dynamic(model: Model, layers: Iterable[int] | None = None) -> Hooks:
    """Zero every dynamic branch (qp, kp, qg, kg) of both phases: the layers then
    compute plain multi-head attention with the same weights.

    Parameters
    ----------
    model : Model
    layers : list of int, optional
        The layers (default all).

    Returns
    -------
    Hooks
        disable_branch's pairs for every dynamic branch the model has.

    Raises
    ------
    dclens.Error
        A bad layer, or a model without a compose.
    """
    out = Hooks()
    for phase in PHASES:
        for b in BRANCHES[1:]:
            if b in ("kp", "kg") and model.config.query_wise:
                continue
            if b in ("qp", "qg") and getattr(model.config, "key_wise", False):
                continue
            out += disable_branch(model, phase, b, layers)
    return out


def scale(model: Model, name: str, factor: float, head: int | None = None) -> Hooks:
    """Multiply an activation (or one head's slice of it) by `factor`.

    Parameters
    ----------
    model : Model
    name : str
        The hook (either spelling).
    factor : float
        A finite number.
    head : int, optional
        Only this head's slice (a head-indexed hook).

    Returns
    -------
    Hooks
        One (name, fn) pair multiplying the hook by factor.

    Raises
    ------
    dclens.Error
        An unknown hook, a factor that is not a finite number, a head out of
        range or on a hook without a head axis.
    """
    name = _canon(name)
    model.parse_hook(name)
    if not is_finite_number(factor):
        raise Error("scale %s: factor must be a finite number, got %r" % (name, factor))
    if head is not None:
        _head_axis(model, name)
        _check_head(model, 0, head)

    def fn(act, _name):
        idx = Ellipsis if head is None else _head_index(name, head, act.ndim)
        with np.errstate(over="ignore", invalid="ignore"):
            act[idx] *= factor
        # |factor| <= 1 cannot overflow a finite activation: only a larger one is checked
        if abs(factor) > 1 and not np.all(np.isfinite(act[idx])):
            raise Error(
                "scale %s: factor %r takes the activation past float32's range (it held values up to %g)"
                % (name, factor, float(np.max(np.abs(act[idx] / factor))) if factor else 0.0)
            )
        return act

    return Hooks([(name, _named(fn, "scale(%s%r)" % ("" if head is None else "head=%d, " % head, factor)))])


def patch(
    model: Model, name: str, source: Cache, head: int | None = None, positions: Sequence[int] | None = None
) -> Hooks:
    """Replace an activation by the one in `source` (another run's cache), for
    all of it, one head, and/or some positions.

    Parameters
    ----------
    model : Model
    name : str
        The hook (either spelling).
    source : Cache
        Another run's cache holding ``name`` (of the same shape as this run's).
    head : int, optional
        Only this head's slice (a head-indexed hook).
    positions : list of int, optional
        Only these positions: the T axis (second from the front for
        [T, ...] layouts), or the query axis of [N, T, S] maps.

    Returns
    -------
    Hooks
        One (name, fn) pair writing the source's values.

    Raises
    ------
    dclens.Error
        An unknown hook, a source without it, a head or position out of
        range; when the hook runs, a source of another shape.
    """
    name = _canon(name)
    model.parse_hook(name)
    if head is not None:
        check_index("head", head, 0, model.config.n_head, " (model has %d heads)" % model.config.n_head)
    if positions is not None:
        positions = check_int_list("positions", positions, 0, 1 << 24)
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

    label = "patch(from source%s%s)" % (
        "" if head is None else ", head=%d" % head,
        "" if positions is None else ", positions=%s" % list(positions),
    )
    return Hooks([(name, _named(fn, label))])


# ------------------------------------------------------------ attention variants
# (model-spec.md 5: the static Talking-Heads branch, Mixture-of-Head routing)


def _layers(model: Model, layers: Iterable[int] | None) -> list[int]:
    return check_layers(layers, model.config.n_layer)


def disable_static(model: Model, phases: Sequence[str] = ("pre", "post"), layers: Iterable[int] | None = None) -> Hooks:
    """Zero the static (Talking-Heads) composition branch of the given phases
    and layers (use_sw models): the composition maps lose their fixed W term.

    Parameters
    ----------
    model : Model
        A model with the static branch (use_sw).
    phases : list of {"pre", "post"}
    layers : list of int, optional
        The layers (default all).

    Returns
    -------
    Hooks
        One (name, fn) pair per phase and layer.

    Raises
    ------
    dclens.Error
        A model without the static branch, bad phases or layers.
    """
    if not model.config.use_sw:
        raise Error("%s has no static composition branch (use_sw is off)" % model.name)
    hooks = Hooks()
    if isinstance(phases, str) or not isinstance(phases, (list, tuple)):
        raise Error(
            "disable_static: phases must be a list of 'pre' / 'post', not %s %r" % (type(phases).__name__, phases)
        )
    for ph in phases:
        if not is_choice(ph, PHASES):
            raise Error("phase must be 'pre' or 'post', not %r" % (ph,))
        for l in _layers(model, layers):
            name = hook_name(l, "attn.%s.static" % ph)
            model.parse_hook(name)
            hooks.append((name, _zeroing("disable_static(%r)" % ph)))
    return hooks


def _moh(model: Model) -> tuple[int, int]:
    c = model.config
    if c.moh_shared_heads is None:
        raise Error("%s has no Mixture-of-Head routing ('moh' is not in its config)" % model.name)
    return c.moh_shared_heads, c.moh_routed_topk


def force_routing(
    model: Model,
    layer: int,
    heads: Sequence[int],
    weights: Sequence[float] | None = None,
    positions: Sequence[int] | None = None,
) -> Hooks:
    """Force the MoH routing of `layer`: the routing scores (attn.routing, [T, N])
    become `weights` (default 1 each) on `heads` and 0 on every other head, at
    every position or only at `positions`. The gate multiplies each head's z.

    Parameters
    ----------
    model : Model
        A Mixture-of-Head model.
    layer : int
    heads : list of int
        The heads routed to.
    weights : list of float, optional
        One finite weight per head (default 1 each).
    positions : list of int, optional
        Only these positions (default all).

    Returns
    -------
    Hooks
        One (name, fn) pair setting the router's weights.

    Raises
    ------
    dclens.Error
        A model without MoH routing, a layer or head out of range, weights
        of the wrong length or not finite.
    """
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

    return Hooks([(name, _named(fn, "force_routing(heads=%s)" % heads))])


def scale_router_logits(
    model: Model, factor: float, layers: Iterable[int] | None = None, heads: Sequence[int] | None = None
) -> Hooks:
    """Multiply the MoH router logits (attn.router_logits, [T, N - hs]) by `factor`
    (all routed heads, or the routed-head indices `heads`, 0 = first routed head):
    < 1 flattens the routing distribution, > 1 sharpens it; the top-k selection
    and the routing scores are recomputed from the scaled logits.

    Parameters
    ----------
    model : Model
        A Mixture-of-Head model.
    factor : float
    layers : list of int, optional
        The layers (default all).
    heads : list of int, optional
        Routed-head indices (default all routed heads).

    Returns
    -------
    Hooks
        One (name, fn) pair per layer scaling its router logits.

    Raises
    ------
    dclens.Error
        A model without MoH routing, a routed head or layer out of range.
    """
    hs, _ = _moh(model)
    NR = model.config.n_head - hs
    if heads is not None:
        heads = [int(h) for h in heads]
        for h in heads:
            if not 0 <= h < NR:
                raise Error("routed head %d is out of range (%d routed heads)" % (h, NR))
    out = Hooks()
    for l in _layers(model, layers):
        name = hook_name(l, "attn.router_logits")
        model.parse_hook(name)

        def fn(act, _name):
            if heads is None:
                act *= factor
            else:
                act[..., heads] *= factor
            return act

        out.append((name, _named(fn, "scale_router_logits(%r)" % (factor,))))
    return out


# ------------------------------------------------------------ a head's lending (DCMHA)

LENDING_BRANCHES = ("qp", "kp", "static")  # the branches through which one head lends to another


def lent_terms(model: Model, layer: int, phase: str, branch: str, X: np.ndarray, dyn: dict, source: int) -> np.ndarray:
    """What source head `source` lends every other head through one branch:
    delta [..., N (target), T, S] with delta[n] = X[source] * map[source, n]
    for n != source (0 at n = source; masked cells 0), float64.

    X [..., N, T, S] the phase input (scores for pre, pattern for post; a
    leading batch axis allowed), dyn the layer's dynamic weights of that
    phase by short name (qw1 [..., T, R, N], kw1 [..., S, R, N], ...):
        qp: map[t][m, n] = sum_r qw1[t, r, m] qw2[t, r, n]   (per query t)
        kp: map[s][m, n] = sum_r kw1[s, r, m] kw2[s, r, n]   (per key s)
        static: map[m, n] = W[m, n]                          (fixed)
    times the compose-group mask. These are routing.flows' terms.

    Parameters
    ----------
    model : dclens.Model
        A DCMHA model.
    layer : int
        The layer (its window masks the cells).
    phase : {"pre", "post"}
        Which compose the map belongs to.
    branch : {"qp", "kp", "static"}
        The lending branch ("static" only on a Talking-Heads model).
    X : numpy.ndarray
        [..., N, T, S] the phase input: raw scores (pre) or the softmax
        pattern (post).
    dyn : dict of str to numpy.ndarray
        The layer's dynamic weights of that phase by short name ("qw1",
        "qw2" [..., T, R, N]; "kw1", "kw2" [..., S, R, N]); unused for
        "static".
    source : int
        The lending head m.

    Returns
    -------
    numpy.ndarray
        [..., N, T, S] float64: what each target head n receives from
        ``source`` (0 for n = source and at masked cells).

    Raises
    ------
    dclens.ArgumentError
        A branch other than "qp", "kp", "static", or a source head out of
        range.
    dclens.Error
        "static" on a model without the static branch.
    """
    N = model.config.n_head
    if branch not in ("qp", "kp", "static"):
        raise ArgumentError(
            "lent_terms: branch must be 'qp', 'kp' or 'static' (the lending branches), not %r" % (branch,)
        )
    check_index("lent_terms: source", source, 0, N, " (the model has %d heads)" % N)
    if branch == "static" and routing.static_map(model, layer, phase) is None:
        raise Error("lent_terms: %s has no static (Talking-Heads) branch" % model.name)
    T, S = X.shape[-2:]
    visible = allowed(T, S, layer_window(model, layer))
    x = np.where(visible, X[..., source, :, :].astype(np.float64), 0.0)  # [..., T, S], masked cells 0
    block = routing._group_block(model)[source]  # [N]
    if branch == "qp":
        coef = np.einsum("...tr,...trn->...tn", dyn["qw1"][..., source], dyn["qw2"]) * block  # [..., T, N]
        delta = np.einsum("...ts,...tn->...nts", x, coef)
    elif branch == "kp":
        coef = np.einsum("...sr,...srn->...sn", dyn["kw1"][..., source], dyn["kw2"]) * block  # [..., S, N]
        delta = np.einsum("...ts,...sn->...nts", x, coef)
    else:
        W = routing.static_map(model, layer, phase)
        assert W is not None
        delta = np.einsum("...ts,n->...nts", x, W[source] * block)
    delta[..., source, :, :] = 0.0
    assert delta.shape[-3] == N
    return delta


def block_lending(
    model: Model,
    layer: int,
    head: int,
    phase: str = "post",
    branches: Sequence[str] = ("qp", "kp"),
    kind: str = "zero",
    mean: np.ndarray | None = None,
) -> Hooks:
    """Remove what `head` of `layer` lends the other heads through the compose:
    the head keeps its own attention (its composed map, including its own
    terms of every branch) and its output; every other head's branch map loses
    head's term (routing.flows' F[head, branch] for targets n != head).

    phase: "pre" (head lends its raw scores), "post" (its softmax pattern) or
    "both". branches: of "qp", "kp" and, on Talking-Heads models (use_sw),
    "static". kind="mean" lends `mean` [T, S] (e.g. head's pattern averaged
    over reference prompts) in place of head's own input instead of nothing.

    Parameters
    ----------
    model : Model
        A DCMHA model.
    layer, head : int
        The lending head.
    phase : {"pre", "post", "both"}
    branches : list of {"qp", "kp", "static"}
    kind : {"zero", "mean"}
    mean : array [T, S], optional
        With kind="mean": what the head lends instead.

    Returns
    -------
    Hooks
        For run_with_hooks / model.hooks: read-only ones at the phase input
        and the dynamic weights, and one writing each branch map; they read
        the pass they run in, so they compose with other hooks.

    Raises
    ------
    dclens.Error
        A model without a compose, a layer or head out of range, a bad
        phase, branch (or one the model lacks), kind or mean.
    """
    c = model.config
    _check_head(model, layer, head)
    if not c.use_dcmha:
        raise Error(
            "block_lending: %s has no compose (plain multi-head attention): no head lends to another" % model.name
        )
    if not is_choice(phase, PHASES + ("both",)):
        raise Error("block_lending: phase must be 'pre', 'post' or 'both', not %r" % (phase,))
    if isinstance(branches, str) or not isinstance(branches, (list, tuple)) or not branches:
        raise Error(
            "block_lending: branches must be a non-empty list of %s, not %r" % (", ".join(LENDING_BRANCHES), branches)
        )
    if not is_choice(kind, ("zero", "mean")):
        raise Error("block_lending: kind must be 'zero' or 'mean', not %r" % (kind,))
    if (kind == "mean") != (mean is not None):
        raise Error("block_lending: mean= goes with kind='mean' (and kind='mean' needs it)")
    if mean is not None:
        mean = np.asarray(mean, np.float64)
        if mean.ndim != 2 or mean.shape[0] != mean.shape[1] or not np.all(np.isfinite(mean)):
            raise Error("block_lending: mean must be a finite [T, S] map, got shape %s" % (mean.shape,))
    out = Hooks()
    for ph in PHASES if phase == "both" else (phase,):
        present = [b for b in branches if hook_name(layer, "attn.%s.%s" % (ph, b)) in model.hook_names]
        for b in branches:
            if not is_choice(b, LENDING_BRANCHES):
                raise Error("block_lending: branch must be one of %s, not %r" % (", ".join(LENDING_BRANCHES), b))
            if b not in present:
                raise Error("block_lending: %s has no %s branch at layer %d (phase %s)" % (model.name, b, layer, ph))
        out += _lending_hooks(model, layer, head, ph, present, mean)
    return out


def _lending_hooks(model: Model, layer: int, head: int, phase: str, branches, mean) -> Hooks:
    seen: dict = {}  # this pass's phase input and dynamic weights, read before the branches
    src = hook_name(layer, "attn.%s" % ("scores" if phase == "pre" else "pattern"))
    want = {w for b in branches if b != "static" for w in (b[0] + "w1", b[0] + "w2")}

    def keep(key):
        return _hooks.read_only(
            _named(
                lambda act, _n: seen.__setitem__(key, np.array(act, np.float64)),
                "block_lending(L%dH%d) reads it" % (layer, head),
            )
        )

    hooks = Hooks([(hook_name(layer, "attn.dyn.%s.%s" % (phase, w)), keep(w)) for w in sorted(want)])
    hooks.append((src, keep("X")))
    for b in branches:

        def fn(act, _name, b=b):
            X = seen["X"]
            if mean is not None:
                if mean.shape != X.shape[-2:]:
                    raise Error("block_lending: mean has shape %s, this pass's maps %s" % (mean.shape, X.shape[-2:]))
                X = X.copy()
                X[..., head, :, :] -= mean
            act -= lent_terms(model, layer, phase, b, X, seen, head).astype(np.float32)
            return act

        hooks.append((hook_name(layer, "attn.%s.%s" % (phase, b)), _named(fn, "block_lending(L%dH%d)" % (layer, head))))
    return hooks
