"""Routing: how attention scores and weights move between heads (hooks.md).

For DCMHA layer l, phase pre|post, query t and key s, the composition map
C[t,s] (N x N, C[n, m] = weight of source head n in target head m) is

    C[t,s] = I + qw1[t]^T qw2[t] + kw1[s]^T kw2[s] + diag(qdd[t]) + diag(kdd[s])
             (+ W, the static Talking-Heads term, with use_sw)

so that composed[:, t, s] = C[t,s]^T @ raw[:, t, s]; with compose_groups G
the projection terms (and W) are block-diagonal. For Pythia (plain MHA)
every map is the identity.

Routing weights: the post phase weights each map by the softmax pattern
(how much attention it routes); the pre phase weights it by the raw scores,
which are signed logits (q.k / sqrt(Dh), before the softmax), so pre-phase
routing matrices are signed and can cancel.

From a cache (no extra pass), vectorised over every query and layer:

    _, cache = model.run_with_cache(toks)
    R = routing.routing_matrices(model, cache, "post")       # [L, T, N, N]
    C = routing.composition_maps(model, cache, 3, "pre", query=-1)   # [S, N, N]

Flows split one composed entry by where it comes from: flows(model, toks,
layer, phase, head, query)[n, b, s] is the part of target `head`'s composed
score (pre) or weight (post) at (query, key s) that source head n lends
through branch b (flow_branches(model)); they sum to scores_composed /
pattern_composed at the visible keys (flow_table: the largest, with tokens).

Positions may be negative (counted from the end, as in Python). Maps of
masked pairs (a key after the query, or outside a local layer's window)
are defined but never used by the model: asking for one warns
(MaskedPairWarning).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._core.checks import ArgumentError, Error, check_index, check_int_list, check_layers, is_choice, token_array
from .._core.mask import allowed, layer_window
from .._core.names import BRANCHES, PHASES, hook_name
from .._core.warning_types import MaskedPairWarning
from ..cache import Cache

if TYPE_CHECKING:
    from .._core.protocols import ModelLike as Model


def _pos(v: int, T: int, what: str) -> int:
    """A query/key position in [-T, T) (negative: from the end), as [0, T)."""
    return check_index("%s position" % what, v, -T, T, " for %d tokens" % T) % T


def _warn_masked(model: Model, layer: int, t: int, s: int) -> None:
    w = layer_window(model, layer)
    if not allowed(1, s + 1, w, t0=t)[0, s]:
        warnings.warn(
            "layer %d, query %d, key %d is a masked pair (%s): the model never uses its map"
            % (layer, t, s, "key after query" if s > t else "outside the window of %d" % w),
            MaskedPairWarning,
            stacklevel=3,
        )


def _dyn_names(layer: int, phase: str, query_wise: bool, key_wise: bool = False):
    p = hook_name(layer, "attn.dyn.%s." % phase)
    names = [] if key_wise else [p + "qw1", p + "qw2", p + "qdd"]
    if not query_wise:
        names += [p + "kw1", p + "kw2", p + "kdd"]
    return names


def _check(
    model: Model, tokens, layer: int, phase: str, query: int | None = None, key: int | None = None
) -> np.ndarray:
    toks = model.to_tokens(tokens) if isinstance(tokens, str) else token_array(tokens)
    if toks.ndim != 1:
        raise ArgumentError("routing works on one sequence: tokens must be 1-D, got shape %s" % (toks.shape,))
    T = toks.shape[0]
    if not is_choice(phase, PHASES):
        raise ArgumentError("phase must be 'pre' or 'post', not %r" % (phase,))
    check_index("layer", layer, 0, model.config.n_layer, " (model has %d layers)" % model.config.n_layer)
    for what, v in (("query", query), ("key", key)):
        if v is not None:
            _pos(v, T, what)
    return toks


def dynamic_weights(model: Model, tokens, layer: int, phase: str) -> dict[str, np.ndarray]:
    """The dynamic weights of one layer and phase: qw1, qw2 [T, R, N] (qw1
    normalised), qdd [T, N], and (unless query_wise) kw1, kw2 [S, R, N], kdd [S, N].

    One pass of `tokens` that captures the layer's ``attn.dyn.{phase}.*`` hooks
    (hooks.md); a key-wise model has no query-side weights.

    Parameters
    ----------
    model : dclens.Model
        A DCMHA model.
    tokens : str or numpy.ndarray
        One prompt: a string (model.to_tokens) or [T] integer token ids.
    layer : int
        The layer, in [0, L).
    phase : {"pre", "post"}
        Pre-compose (of the raw scores) or post-compose (of the softmax pattern).

    Returns
    -------
    dict of str to numpy.ndarray
        By short name: "qw1", "qw2" [T, R, N] (qw1 after its RMS norm) and "qdd" [T, N]
        unless the model is key_wise; "kw1", "kw2" [S, R, N] and "kdd" [S, N] (S = T)
        unless it is query_wise. The engine's float32 arrays.

    Raises
    ------
    dclens.ArgumentError
        tokens that are not one sequence (not 1-D), a phase other than "pre" / "post",
        or a layer out of range (dclens.ArgumentTypeError: not an integer).
    dclens.Error
        A model without dynamic composition (plain multi-head attention).
    """
    toks = _check(model, tokens, layer, phase)
    if not model.config.use_dcmha:
        raise Error("%s has no dynamic composition (plain multi-head attention)" % model.name)
    names = _dyn_names(layer, phase, model.config.query_wise, model.config.key_wise)
    _, cache = model.run_with_cache(toks, names=names)
    return {n.rsplit(".", 1)[1]: cache[n] for n in names}


def static_map(model: Model, layer: int, phase: str) -> np.ndarray | None:
    """The static (Talking-Heads) term W [N, N] of a layer and phase (block-diagonal
    with compose_groups), or None when the model has no static branch.

    Read from the weights (``layers.{l}.attention.dyn_w_proj.{phase}_proj.w``): no pass.

    Parameters
    ----------
    model : dclens.Model
        The model.
    layer : int
        The layer, in [0, L).
    phase : {"pre", "post"}
        The compose phase.

    Returns
    -------
    numpy.ndarray or None
        W [N, N] float64, W[m, n] the weight of source head m in target head n (zero
        between compose groups); None when the model has no static branch (use_sw False:
        no published or bundled model has it).

    Raises
    ------
    dclens.ArgumentError
        A layer out of range (dclens.ArgumentTypeError: not an integer), or a
        phase other than "pre" / "post".
    """
    check_index("layer", layer, 0, model.config.n_layer, " (model has %d layers)" % model.config.n_layer)
    if not is_choice(phase, PHASES):
        raise ArgumentError("phase must be 'pre' or 'post', not %r" % (phase,))
    if not model.config.use_sw:
        return None
    w = model.weight("layers.%d.attention.dyn_w_proj.%s_proj.w" % (layer, phase))  # [G, Mg, Mg]
    return _block_diag(w.astype(np.float64))


def _block_diag(blocks: np.ndarray) -> np.ndarray:
    G, Mg, _ = blocks.shape
    out = np.zeros((G * Mg, G * Mg))
    for g in range(G):
        out[g * Mg : (g + 1) * Mg, g * Mg : (g + 1) * Mg] = blocks[g]
    return out


def maps_from_weights(
    dyn: dict[str, np.ndarray], query: int, keys=None, groups: int = 1, static: np.ndarray | None = None
) -> np.ndarray:
    """C[t=query, s] for the given keys (default: all), [len(keys), N, N]. With
    `groups` G the dynamic projections mix heads only within each of G blocks;
    `static` [N, N] is the fixed Talking-Heads term (use_sw).

    C[t, s] = I + (qw1[t]^T qw2[t]) * block + diag(qdd[t]) + (kw1[s]^T kw2[s]) * block
    + diag(kdd[s]) (+ static), each side's terms only where `dyn` holds them (module
    docstring); no pass.

    Parameters
    ----------
    dyn : dict of str to numpy.ndarray
        One sequence's dynamic weights of one layer and phase, by short name, as
        dynamic_weights returns them: qw1, qw2 [T, R, N], qdd [T, N] and / or kw1, kw2
        [S, R, N], kdd [S, N] (no batch axis).
    query : int
        The query position t, in [-S, S) (negative: from the end).
    keys : list of int or None
        The key positions s (negative: from the end); None: every position, masked
        pairs included.
    groups : int
        The compose groups G, in [1, N], a divisor of N (model.config.compose_groups).
    static : numpy.ndarray or None
        The static term W [N, N] (static_map), or None.

    Returns
    -------
    numpy.ndarray
        [len(keys), N, N] float64: out[i][n, m], the weight of source head n in target
        head m at (query, keys[i]).

    Raises
    ------
    dclens.Error
        dyn not a dict holding qdd or kdd, gates with a batch axis, a query or key out of range, keys not a list of
        integers, groups out of [1, N] or not dividing N, or static not a [N, N] array
        of numbers (dclens.ArgumentError / ArgumentTypeError for the ranges and types).
    """
    if not isinstance(dyn, dict) or not ("qdd" in dyn or "kdd" in dyn):
        raise Error(
            "maps_from_weights: dyn must be the dict dynamic_weights returns (qw1, qw2, qdd, ...), not %s"
            % type(dyn).__name__
        )
    for side in (("qw1", "qw2", "qdd"), ("kw1", "kw2", "kdd")):
        have = [k for k in side if k in dyn]
        if have and len(have) < 3:  # a side's terms are used together or not at all
            raise Error(
                "maps_from_weights: dyn holds %s but not %s (a side of the composition needs all three, as "
                "dynamic_weights returns them)" % (", ".join(have), ", ".join(k for k in side if k not in dyn))
            )
    some = dyn["qdd"] if "qdd" in dyn else dyn["kdd"]
    if np.ndim(some) != 2:
        raise Error(
            "maps_from_weights: the gates must be [S, N] of one sequence, got shape %s (a batch: index one "
            "sequence first, e.g. {k: v[b] for k, v in dyn.items()})" % (np.shape(some),)
        )
    S, N = some.shape
    query = _pos(query, S, "query")
    keys = range(S) if keys is None else check_int_list("keys", keys, 0, S, wrap=True)
    groups = check_index("groups", groups, 1, N + 1, " (n_head %d)" % N)
    if N % groups:
        raise Error("groups %d does not divide n_head %d" % (groups, N))
    if static is not None:
        static = np.asarray(static)
        if static.shape != (N, N) or static.dtype.kind not in "fiu":
            raise Error("static must be a [%d, %d] array of numbers, got %s %s" % (N, N, static.dtype, static.shape))
    block = np.kron(np.eye(groups), np.ones((N // groups, N // groups)))
    base = np.eye(N)
    if "qw1" in dyn:  # absent for key-wise-only composition
        qw1, qw2, qdd = dyn["qw1"][query], dyn["qw2"][query], dyn["qdd"][query]
        base = base + (qw1.T.astype(np.float64) @ qw2) * block + np.diag(qdd)
    if static is not None:
        base = base + static
    out = np.empty((len(keys), N, N))
    for i, s in enumerate(keys):
        c = base.copy()
        if "kw1" in dyn:
            c += (dyn["kw1"][s].T.astype(np.float64) @ dyn["kw2"][s]) * block + np.diag(dyn["kdd"][s])
        out[i] = c
    return out


def composition_map(model: Model, tokens, layer: int, phase: str, query: int, key: int) -> np.ndarray:
    """The N x N map C[query, key] of a layer and phase (identity for Pythia).

    One pass of `tokens` (dynamic_weights) for a DCMHA model; composition_maps reads
    the same maps from a cache without one. A masked pair (a key after the query, or
    outside a local layer's window) warns with MaskedPairWarning: its map is defined
    but the model never uses it.

    Parameters
    ----------
    model : dclens.Model
        The model (one pass of it for a DCMHA model).
    tokens : str or numpy.ndarray
        One prompt: a string or [T] integer token ids.
    layer : int
        The layer, in [0, L).
    phase : {"pre", "post"}
        The compose phase.
    query : int
        The query position t, in [-T, T) (negative: from the end).
    key : int
        The key position s, in [-T, T).

    Returns
    -------
    numpy.ndarray
        C[t, s] [N, N] float64, C[n, m] the weight of source head n in target head m;
        the identity for plain multi-head attention.

    Raises
    ------
    dclens.ArgumentError
        tokens not 1-D, a phase other than "pre" / "post", or a layer, query or key out of
        range (dclens.ArgumentTypeError: not an integer).

    Warns
    -----
    MaskedPairWarning
        The pair is masked (key after the query, or outside a local layer's window);
        plain multi-head attention models warn too.
    """
    toks = _check(model, tokens, layer, phase, query, key)
    T = toks.shape[0]
    query, key = _pos(query, T, "query"), _pos(key, T, "key")
    _warn_masked(model, layer, query, key)
    if not model.config.use_dcmha:
        return np.eye(model.config.n_head)
    return maps_from_weights(
        dynamic_weights(model, toks, layer, phase),
        query,
        [key],
        model.config.compose_groups,
        static_map(model, layer, phase),
    )[0]


def routing_matrix(model: Model, tokens, layer: int, phase: str, query: int) -> np.ndarray:
    """Head-to-head routing at one query position, weighted by what it routes.

    R[n, m] = sum over visible keys s of X[n, t, s] * C[t, s][n, m], where X is
    the phase's input: the raw scores (pre) or the softmax pattern (post). So
    R[n, m] is how much of source head n's attention (at query t) lands in
    target head m; sum_n R[n, m] = sum_s composed[m, t, s] (over the same visible keys).

    One pass of `tokens`; routing_matrices gives every query of every layer from a
    cache. The pre phase weights by signed logits, so its R can cancel.

    Parameters
    ----------
    model : dclens.Model
        The model: one pass of it.
    tokens : str or numpy.ndarray
        One prompt: a string or [T] integer token ids.
    layer : int
        The layer, in [0, L).
    phase : {"pre", "post"}
        "pre": X is the raw scores (q.k / sqrt(Dh)); "post": the softmax pattern.
    query : int
        The query position t, in [-T, T) (negative: from the end).

    Returns
    -------
    numpy.ndarray
        R [N, N] float64; for plain multi-head attention the diagonal matrix of
        sum_s X[n, t, s].

    Raises
    ------
    dclens.ArgumentError
        tokens not 1-D, a phase other than "pre" / "post", or a layer or query out of
        range (dclens.ArgumentTypeError: not an integer).
    """
    toks = _check(model, tokens, layer, phase, query)
    query = _pos(query, toks.shape[0], "query")
    src = hook_name(layer, "attn.%s" % ("scores" if phase == "pre" else "pattern"))
    names = [src] + (
        _dyn_names(layer, phase, model.config.query_wise, model.config.key_wise) if model.config.use_dcmha else []
    )
    _, cache = model.run_with_cache(toks, names=names)
    keys = np.flatnonzero(allowed(1, query + 1, layer_window(model, layer), t0=query)[0]).tolist()
    x = cache[src][:, query, keys].astype(np.float64)  # [N, len(keys)]
    if not model.config.use_dcmha:
        return np.diag(x.sum(axis=1))
    dyn = {n.rsplit(".", 1)[1]: cache[n] for n in names[1:]}
    maps = maps_from_weights(
        dyn, query, keys, model.config.compose_groups, static_map(model, layer, phase)
    )  # [len(keys), N, N]
    return np.einsum("ns,snm->nm", x, maps)


def gates(model: Model, tokens, layer: int) -> dict[str, np.ndarray]:
    """The dynamic gates of a layer: {'pre.qdd': [T, N], 'pre.kdd', 'post.qdd', 'post.kdd'}
    (how much each head keeps of its own score/weight, per token).

    One pass of `tokens`; gates_from_cache reads them from a cache.

    Parameters
    ----------
    model : dclens.Model
        A DCMHA model.
    tokens : str or numpy.ndarray
        One prompt: a string or [T] integer token ids.
    layer : int
        The layer, in [0, L).

    Returns
    -------
    dict of str to numpy.ndarray
        "{phase}.{side}" -> [T, N] float32 gates (tanh), for both phases and the sides
        the model has: qdd and kdd, qdd alone (query_wise) or kdd alone (key_wise).

    Raises
    ------
    dclens.ArgumentError
        tokens not 1-D, or a layer out of range (dclens.ArgumentTypeError: not an
        integer).
    dclens.Error
        A model without dynamic composition (plain multi-head attention).
    """
    toks = _check(model, tokens, layer, "pre")
    if not model.config.use_dcmha:
        raise Error("%s has no dynamic gates (plain multi-head attention)" % model.name)
    sides = ("qdd",) if model.config.query_wise else ("kdd",) if model.config.key_wise else ("qdd", "kdd")
    names = [hook_name(layer, "attn.dyn.%s.%s" % (ph, s)) for ph in PHASES for s in sides]
    _, cache = model.run_with_cache(toks, names=names)
    return {n.split("dyn.", 1)[1]: cache[n] for n in names}


def routing_from_cache(
    cache: Cache,
    layer: int,
    phase: str,
    query: int,
    key: int,
    n_head: int,
    groups: int = 1,
    static: np.ndarray | None = None,
) -> np.ndarray:
    """C[query, key] from a cache that holds the layer's dyn.* activations
    (negative positions count from the end; groups / static as in maps_from_weights).

    No pass, and no warning for a masked pair (composition_map warns).

    Parameters
    ----------
    cache : dclens.Cache
        A cache of one sequence (no batch axis) holding ``blocks.{layer}.attn.dyn.{phase}.*``
        (qdd or kdd at least, with the w1 / w2 weights of the sides the model has).
    layer : int
        The layer, >= 0 (no model to check it against: it names the cached hooks).
    phase : {"pre", "post"}
        The compose phase.
    query : int
        The query position t, in [-T, T).
    key : int
        The key position s, in [-T, T).
    n_head : int
        The number of heads N (model.config.n_head): the cached gates must have N heads.
    groups : int
        The compose groups G (model.config.compose_groups).
    static : numpy.ndarray or None
        The static term W [N, N] (static_map), or None.

    Returns
    -------
    numpy.ndarray
        C[t, s] [N, N] float64.

    Raises
    ------
    dclens.ArgumentError
        A phase other than "pre" / "post", a layer or n_head that is not a positive
        integer.
    dclens.Error
        A cache without the layer's qdd and kdd for the phase, gates of another head
        count than n_head, or what maps_from_weights refuses (a query or key out of
        range, bad groups or static).
    """
    if not is_choice(phase, PHASES):
        raise ArgumentError("phase must be 'pre' or 'post', not %r" % (phase,))
    check_index("layer", layer, 0, 1 << 20)
    check_index("n_head", n_head, 1, 1 << 20)
    p = hook_name(layer, "attn.dyn.%s." % phase)
    if p + "qdd" not in cache and p + "kdd" not in cache:
        raise Error("cache has no %sqdd or %skdd (capture the dyn hooks of layer %d)" % (p, p, layer))
    dyn = {k: cache[p + k] for k in ("qw1", "qw2", "qdd", "kw1", "kw2", "kdd") if p + k in cache}
    gate = dyn["qdd"] if "qdd" in dyn else dyn["kdd"]
    if gate.shape[-1] != n_head:
        raise Error("routing_from_cache: n_head is %d but the cached gates have %d heads" % (n_head, gate.shape[-1]))
    T = gate.shape[0]
    return maps_from_weights(dyn, _pos(query, T, "query"), [_pos(key, T, "key")], groups, static)[0]


# ---------------------------------------------------------------- from a cache, vectorised


def _cache_dyn(model: Model, cache: Cache, layer: int, phase: str) -> dict[str, np.ndarray]:
    if not is_choice(phase, PHASES):
        raise ArgumentError("phase must be 'pre' or 'post', not %r" % (phase,))
    out = {}
    for n in _dyn_names(layer, phase, model.config.query_wise, model.config.key_wise):
        if n not in cache:
            raise Error("cache has no %s (capture the dyn hooks: names=lambda n: '.attn.dyn.' in n)" % n)
        a = cache[n]
        if a.ndim != (4 if n[-1] in "12" else 3) - 1:
            raise Error("routing from a cache works on one sequence: %s has shape %s" % (n, a.shape))
        out[n.rsplit(".", 1)[1]] = a.astype(np.float64)
    return out


def _group_block(model: Model) -> np.ndarray:
    """[N, N] 0/1 mask of the head pairs a grouped composition may mix (all ones for G = 1)."""
    N, G = model.config.n_head, model.config.compose_groups
    return np.kron(np.eye(G), np.ones((N // G, N // G)))


def composition_maps(model: Model, cache: Cache, layer: int, phase: str, query=None, key=None) -> np.ndarray:
    """Composition maps C[t, s] from a cache, no pass: [T, S, N, N] for every
    pair, [S, N, N] for one query, [T, N, N] for one key, [N, N] for both.
    Masked pairs are included (they are defined); a single masked pair warns.

    Parameters
    ----------
    model : dclens.Model
        The model the cache is of.
    cache : dclens.Cache
        From run_with_cache of one sequence: the layer's attn.pattern or attn.scores (or
        dyn gates) for T, and, for a DCMHA model, its ``attn.dyn.{phase}.*`` hooks.
    layer : int
        The layer, in [-L, L) (negative: from the end).
    phase : {"pre", "post"}
        The compose phase.
    query : int or None
        One query position, in [-T, T); None: every query.
    key : int or None
        One key position, in [-T, T); None: every key.

    Returns
    -------
    numpy.ndarray
        float64 maps, C[..., n, m] the weight of source head n in target head m, of shape
        [T, S, N, N], [S, N, N] (query given), [T, N, N] (key given) or [N, N] (both);
        identities for plain multi-head attention.

    Raises
    ------
    dclens.ArgumentError
        A layer, query or key out of range (dclens.ArgumentTypeError: not an integer),
        or, for a DCMHA model, a phase other than "pre" / "post".
    dclens.Error
        A cache without the layer's attention or (DCMHA) its dyn hooks, or dyn hooks of
        a batch.

    Warns
    -----
    MaskedPairWarning
        Both query and key given and the pair is masked.
    """
    N, L = model.config.n_head, model.config.n_layer
    layer = check_index("composition_maps: layer", layer, -L, L, " (model has %d layers)" % L) % L
    T = _cache_T(model, cache, layer)
    qi = None if query is None else _pos(query, T, "query")
    ki = None if key is None else _pos(key, T, "key")
    if qi is not None and ki is not None:
        _warn_masked(model, layer, qi, ki)
    if not model.config.use_dcmha:
        shape = ([] if qi is not None else [T]) + ([] if ki is not None else [T]) + [N, N]
        return np.broadcast_to(np.eye(N), shape).copy()
    d = _cache_dyn(model, cache, layer, phase)
    tq = slice(None) if qi is None else slice(qi, qi + 1)
    ks = slice(None) if ki is None else slice(ki, ki + 1)
    I = np.eye(N)
    block = _group_block(model)  # [N, N] 0/1
    static = static_map(model, layer, phase)
    base = I if static is None else I + static
    nq = len(range(T)[tq])
    qpart = np.broadcast_to(base, (nq, N, N)).copy()  # [Tq, N, N]
    if "qw1" in d:
        qpart += np.einsum("tin,tim->tnm", d["qw1"][tq], d["qw2"][tq]) * block + np.einsum(
            "tn,nm->tnm", d["qdd"][tq], I
        )
    out = qpart[:, None]
    if "kw1" in d:
        kpart = np.einsum("sin,sim->snm", d["kw1"][ks], d["kw2"][ks]) * block + np.einsum("sn,nm->snm", d["kdd"][ks], I)
        out = out + kpart[None]
    else:
        out = np.broadcast_to(out, (out.shape[0], len(range(T)[ks]), N, N)).copy()
    if qi is not None:
        out = out[0]
        if ki is not None:
            out = out[0]
    elif ki is not None:
        out = out[:, 0]
    return out


def _cache_T(model: Model, cache: Cache, layer: int) -> int:
    for n in (
        hook_name(layer, "attn.pattern"),
        hook_name(layer, "attn.scores"),
        hook_name(layer, "attn.dyn.pre.qdd"),
        hook_name(layer, "attn.dyn.post.qdd"),
        hook_name(layer, "attn.dyn.pre.kdd"),
        hook_name(layer, "attn.dyn.post.kdd"),
    ):
        if n in cache:
            return cache[n].shape[-1] if "dyn" not in n else cache[n].shape[-2]
    raise Error("cache has nothing of layer %d's attention (capture its pattern and dyn hooks)" % layer)


def routing_matrices(model: Model, cache: Cache, phase: str, layers=None, queries=None) -> np.ndarray:
    """Head-to-head routing R[l, t] [N, N] for every query t (or `queries`)
    and every layer (or `layers`), from a cache in one vectorised step:

        R[l, t][n, m] = sum over visible keys s of X[n, t, s] C[t, s][n, m]

    with X the pattern (post) or the raw scores, signed logits (pre).
    Equals routing_matrix(model, tokens, l, phase, t) without its pass.
    Needs blocks.{l}.attn.{pattern|scores} and the layer's dyn.* hooks.

    Parameters
    ----------
    model : dclens.Model
        The model the cache is of.
    cache : dclens.Cache
        From run_with_cache of one sequence (no batch axis).
    phase : {"pre", "post"}
        "pre": X is the raw scores; "post": the softmax pattern.
    layers : list of int or None
        The layers, in [-L, L) (negative: from the end); None: every layer.
    queries : list of int or None
        The query positions, in [-T, T); None: every position.

    Returns
    -------
    numpy.ndarray
        [len(layers), len(queries), N, N] float64 (len(queries) = T by default), in
        the order given; for plain multi-head attention each R is diagonal.

    Raises
    ------
    dclens.ArgumentError
        A phase other than "pre" / "post", or a layer or query out of range
        (dclens.ArgumentTypeError: not an integer).
    dclens.Error
        layers or queries not a list of integers, a cache without the phase input or the
        dyn hooks of a layer, or a cache of a batch.
    """
    if not is_choice(phase, PHASES):
        raise ArgumentError("phase must be 'pre' or 'post', not %r" % (phase,))
    L, N = model.config.n_layer, model.config.n_head
    layers = check_layers(layers, L, negative=True)
    if not layers:
        raise ArgumentError("routing_matrices: layers is empty (give at least one layer, or None for all)")
    out = []
    for l in layers:
        src = hook_name(l, "attn.%s" % ("scores" if phase == "pre" else "pattern"))
        if src not in cache:
            raise Error("cache has no %s (capture it for routing)" % src)
        X = cache[src]
        if X.ndim != 3:
            raise Error("routing from a cache works on one sequence: %s has shape %s" % (src, X.shape))
        T = X.shape[-1]
        qs = (
            np.arange(T)
            if queries is None
            else np.array(check_int_list("queries", queries, 0, T, wrap=True), dtype=np.int64)
        )
        X = X.astype(np.float64)[:, qs] * allowed(T, T, layer_window(model, l))[qs]  # [N, Tq, S]
        rows = X.sum(-1).T  # [Tq, N]
        if not model.config.use_dcmha:
            out.append(np.einsum("tn,nm->tnm", rows, np.eye(N)))
            continue
        d = _cache_dyn(model, cache, l, phase)
        block = _group_block(model)
        static = static_map(model, l, phase)
        base = np.eye(N) if static is None else np.eye(N) + static
        R = rows[:, :, None] * base  # [Tq, N, N]
        if "qw1" in d:
            q1, q2, qd = d["qw1"][qs], d["qw2"][qs], d["qdd"][qs]
            R = (
                R
                + rows[:, :, None] * (np.einsum("tin,tim->tnm", q1, q2) * block)
                + np.einsum("tn,nm->tnm", rows * qd, np.eye(N))
            )
        if "kw1" in d:
            # sum_s X[n,t,s] kw1[s,i,n] kw2[s,i,m]  and  diag(sum_s X[n,t,s] kdd[s,n])
            R = R + np.einsum("nts,sin,sim->tnm", X, d["kw1"], d["kw2"], optimize=True) * block
            R = R + np.einsum("tn,nm->tnm", np.einsum("nts,sn->tn", X, d["kdd"]), np.eye(N))
        out.append(R)
    return np.stack(out)


def gates_from_cache(model: Model, cache: Cache, layer: int) -> dict[str, np.ndarray]:
    """gates() from a cache: {'pre.qdd': [T, N], ...}.

    Parameters
    ----------
    model : dclens.Model
        A DCMHA model, the one the cache is of.
    cache : dclens.Cache
        Holding ``blocks.{layer}.attn.dyn.{pre,post}.{qdd,kdd}`` (the sides the model has).
    layer : int
        The layer, in [0, L).

    Returns
    -------
    dict of str to numpy.ndarray
        As gates(): "{phase}.{side}" -> the cached gates, [T, N] for one sequence
        (a batched cache's [B, T, N] as they are).

    Raises
    ------
    dclens.ArgumentError
        A layer out of range (dclens.ArgumentTypeError: not an integer).
    dclens.Error
        A model without dynamic composition, or a cache without one of the gates.
    """
    check_index("layer", layer, 0, model.config.n_layer, " (model has %d layers)" % model.config.n_layer)
    if not model.config.use_dcmha:
        raise Error("%s has no dynamic gates (plain multi-head attention)" % model.name)
    sides = ("qdd",) if model.config.query_wise else ("kdd",) if model.config.key_wise else ("qdd", "kdd")
    out = {}
    for ph in PHASES:
        for sd in sides:
            n = hook_name(layer, "attn.dyn.%s.%s" % (ph, sd))
            if n not in cache:
                raise Error("cache has no %s" % n)
            out["%s.%s" % (ph, sd)] = cache[n]
    return out


# ---------------------------------------------------------------- flows: one target entry, by source and branch


def flow_branches(model: Model) -> tuple:
    """The branch axis of flows(): BRANCHES, plus "static" for a model with the
    Talking-Heads branch (use_sw; no published or bundled model has it).

    Parameters
    ----------
    model : dclens.Model
        The model (use_sw adds the static branch).

    Returns
    -------
    tuple of str
        ("skip", "qp", "kp", "qg", "kg"), with "static" last when the model has use_sw.
    """
    return BRANCHES + (("static",) if model.config.use_sw else ())


def _flow_inputs(model: Model, tokens, cache: Cache | None, layer: int, phase: str) -> Cache:
    """A cache holding the phase input (scores / pattern) and the dyn.* hooks of the layer:
    `cache` itself when it holds them all (checked against `tokens`), else a new pass."""
    src = hook_name(layer, "attn.%s" % ("scores" if phase == "pre" else "pattern"))
    names = [src] + (
        _dyn_names(layer, phase, model.config.query_wise, model.config.key_wise) if model.config.use_dcmha else []
    )
    if cache is None:
        if tokens is None:
            raise Error("flows: give tokens or a cache=")
        _, cache = model.run_with_cache(_check(model, tokens, layer, phase), names=names)
        return cache
    missing = [n for n in names if n not in cache]
    if missing:
        raise Error("flows: cache= has no %s (capture them: names=%r)" % (", ".join(missing), names))
    if cache[src].ndim != 3:
        raise Error("flows work on one sequence: %s in cache= has shape %s" % (src, cache[src].shape))
    if tokens is not None:
        T = _check(model, tokens, layer, phase).shape[0]
        if cache[src].shape[-1] != T:
            raise Error("flows: cache= holds %d positions but tokens has %d" % (cache[src].shape[-1], T))
    return cache


def flows(
    model: Model, tokens, layer: int, phase: str, head: int, query: int, *, cache: Cache | None = None
) -> np.ndarray:
    """Where target `head`'s composed score (pre) or weight (post) at (`query`, key)
    comes from: F [N (source head), len(flow_branches(model)), T (key)], float64,

        F[n, skip, s] = X[n,t,s]                       (n == head only)
        F[n, qp, s]   = X[n,t,s] (qw1[t]^T qw2[t])[n, head]
        F[n, kp, s]   = X[n,t,s] (kw1[s]^T kw2[s])[n, head]
        F[n, qg, s]   = X[n,t,s] qdd[t, n]             (n == head only)
        F[n, kg, s]   = X[n,t,s] kdd[s, n]             (n == head only)
        F[n, static, s] = X[n,t,s] W[n, head]          (use_sw models only)

    with t = query and X the phase's input: the raw scores (pre, signed logits)
    or the softmax pattern (post). With compose_groups the projection and
    static terms are zero between groups; with query_wise (key_wise) the key-
    (query-) side branches are zero. Masked keys (after the query, outside a
    local layer's window) are zero. F.sum((0, 1)) is scores_composed[head, t]
    (pre) or pattern_composed[head, t] (post) at every visible key. For plain
    MHA only the skip branch is non-zero (F sums to the scores / pattern).

    layer, head and query may be negative (from the end). cache= (from
    run_with_cache, one sequence) holding the layer's scores or pattern and its
    dyn.* hooks avoids a pass; tokens may then be None.

    Parameters
    ----------
    model : dclens.Model
        The model.
    tokens : str or numpy.ndarray or None
        One prompt: a string or [T] integer token ids; None with cache= (when given with
        it, its length is checked against the cache).
    layer : int
        The layer, in [-L, L).
    phase : {"pre", "post"}
        The compose phase.
    head : int
        The target head, in [-N, N).
    query : int
        The query position t, in [-T, T).
    cache : dclens.Cache or None
        A cache of one sequence holding the layer's phase input and dyn.* hooks; None:
        one pass of `tokens`.

    Returns
    -------
    numpy.ndarray
        F [N (source head), len(flow_branches(model)), T (key)] float64.

    Raises
    ------
    dclens.Error
        Neither tokens nor cache, a cache without the hooks it needs, of a batch or of
        another length than tokens.
    dclens.ArgumentError
        A phase other than "pre" / "post", a layer, head or query out of range
        (dclens.ArgumentTypeError: not an integer), or tokens not 1-D.
    """
    if not is_choice(phase, PHASES):
        raise ArgumentError("phase must be 'pre' or 'post', not %r" % (phase,))
    L, N = model.config.n_layer, model.config.n_head
    layer = check_index("layer", layer, -L, L, " (model has %d layers)" % L) % L
    head = check_index("head", head, -N, N, " (model has %d heads)" % N) % N
    cache = _flow_inputs(model, tokens, cache, layer, phase)
    X = cache[hook_name(layer, "attn.%s" % ("scores" if phase == "pre" else "pattern"))]  # [N, T, S]
    T = X.shape[-1]
    t = _pos(query, T, "query")
    x = X[:, t, :].astype(np.float64) * allowed(T, T, layer_window(model, layer))[t]  # [N, S]
    branches = flow_branches(model)
    b = {name: i for i, name in enumerate(branches)}
    F = np.zeros((N, len(branches), T))
    F[head, b["skip"]] = x[head]
    if not model.config.use_dcmha:
        return F
    d = _cache_dyn(model, cache, layer, phase)
    block = _group_block(model)[:, head]  # [N] 0/1
    if "qw1" in d:
        F[:, b["qp"]] = x * ((d["qw1"][t].T @ d["qw2"][t][:, head]) * block)[:, None]  # [N, S]
        F[head, b["qg"]] = x[head] * d["qdd"][t, head]
    if "kw1" in d:
        kmap = np.einsum("sin,si->ns", d["kw1"], d["kw2"][:, :, head]) * block[:, None]  # [N, S]
        F[:, b["kp"]] = x * kmap
        F[head, b["kg"]] = x[head] * d["kdd"][:, head]
    if "static" in b:
        W = static_map(model, layer, phase)
        assert W is not None  # a static branch: the model has use_sw
        F[:, b["static"]] = x * W[:, head][:, None]
    return F


class Flow(NamedTuple):
    """One entry of a flow_table: source head, branch and key, what it lends.

    Attributes
    ----------
    source : int
        The source head n.
    branch : str
        The branch, one of flow_branches(model).
    key : int
        The key position s.
    token : str
        The key's token (its position as text when the model has no tokenizer or
        flow_table was given no tokens).
    value : float
        F[source, branch, key]: what the source lends the target entry (signed).
    share : float
        value / the sum of |value| over every flow into the entry at the visible keys:
        signed (NaN when that sum is 0).
    """

    source: int
    branch: str
    key: int
    token: str
    value: float
    share: float  # value / (sum of |value| over every flow into the entry at the visible keys): signed


class FlowTable(list):
    """The largest flows into one target entry (a list of Flow), largest |value|
    first; str() / print() show it as a table. total: the composed entries
    summed over the visible keys (signed); abs_total: the sum of |value| over
    every flow at the visible keys, what each share is a fraction of;
    visible_keys: how many keys the query sees (causal mask, local window).

    Made by flow_table, which sets the attributes below (the class defaults are
    those of an empty table).

    Attributes
    ----------
    title : str
        The table's first line: layer, head, phase, query, visible key count and
        the two sums.
    total : float
        The sum of every flow (source, branch, visible key): the composed entries
        summed over the visible keys, signed.
    abs_total : float
        The sum of |value| over the same flows; each Flow.share is value / abs_total.
    visible_keys : int
        How many keys the query sees (causal mask, local window).
    """

    title = ""
    total = 0.0
    abs_total = 0.0
    visible_keys = 0

    def __str__(self) -> str:
        rows = [
            self.title,
            "%6s %-6s %5s  %-14s %10s %8s" % ("source", "branch", "key", "token", "value", "share"),
        ]
        for f in self:
            rows.append(
                "%6d %-6s %5d  %-14s %10.4f %+7.1f%%"
                % (f.source, f.branch, f.key, repr(f.token)[:14], f.value, 100 * f.share)
            )
        return "\n".join(rows)

    __repr__ = __str__

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))


def _flow_array(model: Model, F, n_branches: int) -> np.ndarray:
    """F= of flow_table: a [N, branches, T] array of numbers, as float64."""
    try:
        a = np.asarray(F)
    except (TypeError, ValueError) as e:
        raise ArgumentError("flow_table: F must be the array flows() returns: %s" % e) from None
    N = model.config.n_head
    if a.dtype.kind not in "fiu" or a.ndim != 3 or a.shape[:2] != (N, n_branches) or a.shape[2] == 0:
        raise ArgumentError(
            "flow_table: F must be the [%d, %d, T] array of numbers flows() returns, got %s %s"
            % (N, n_branches, a.dtype, list(a.shape))
        )
    return a.astype(np.float64)


def flow_table(
    model: Model,
    tokens,
    layer: int,
    phase: str,
    head: int,
    query: int,
    k: int = 10,
    *,
    cache: Cache | None = None,
    F: np.ndarray | None = None,
) -> FlowTable:
    """The k largest (|value|) (source, branch, key) flows into target `head` at
    `query` (see flows), with each key's token, over the keys the query sees
    (keys after it and, on a local layer, outside its window are left out and
    not counted). F= reuses an array from flows() (tokens may then be None).

    Each flow's share is value / S, S = the sum of |value| over every flow
    (source, branch, visible key) into the entry: signed, the |share|s of all
    flows sum to 100%. Flows are signed: the pre phase splits raw scores
    (logits, either sign) and in both phases the composition maps can be
    negative, so a share of the signed sum would be meaningless where terms
    cancel. The title gives the signed sum of the composed entries over the
    visible keys (FlowTable.total), S (abs_total) and the visible key count.

    Parameters
    ----------
    model : dclens.Model
        The model.
    tokens : str or numpy.ndarray or None
        One prompt: a string or [T] integer token ids (the keys' tokens); None with
        cache= or F= (keys then shown by position).
    layer, phase, head, query
        The flows' layer, compose phase, target head and query position, as for flows.
    k : int
        How many flows to list (>= 1).
    cache : dclens.Cache or None
        As for flows: a cache that spares the pass (not read when F is given).
    F : numpy.ndarray or None
        The [N, len(flow_branches(model)), T] array flows() returned for this layer,
        phase, head and query; None: flows() is computed.

    Returns
    -------
    FlowTable
        A list of at most k Flow, largest |value| first, with ``title``, ``total``,
        ``abs_total`` and ``visible_keys``.

    Raises
    ------
    dclens.ArgumentError
        k below 1, a phase other than "pre" / "post", a layer, head or query out of
        range (dclens.ArgumentTypeError: not an integer), an F that is not such an
        array, or tokens of another length than F.
    dclens.Error
        What flows refuses (no tokens and no cache, a cache without the hooks).
    """
    k = check_index("k", k, 1, 1 << 30)
    if not is_choice(phase, PHASES):
        raise ArgumentError("phase must be 'pre' or 'post', not %r" % (phase,))
    L, N = model.config.n_layer, model.config.n_head
    layer = check_index("layer", layer, -L, L, " (model has %d layers)" % L) % L
    head = check_index("head", head, -N, N, " (model has %d heads)" % N) % N
    branches = flow_branches(model)
    toks = None
    if tokens is not None:
        toks = _check(model, tokens, layer, phase)
    if F is None:
        F = flows(model, toks, layer, phase, head, query, cache=cache)
    else:
        F = _flow_array(model, F, len(branches))
    T = F.shape[-1]
    if toks is not None and len(toks) != T:
        raise ArgumentError("flow_table: tokens has %d positions but F has %d keys" % (len(toks), T))
    t = _pos(query, T, "query")
    keys = np.flatnonzero(allowed(T, T, layer_window(model, layer))[t])  # the keys the query sees
    Fv = F[:, :, keys]  # masked keys lend nothing: they are left out
    words = None
    if toks is not None:
        with contextlib.suppress(Error):  # no tokenizer.json: keys are shown by position
            words = model.to_str_tokens(toks)
    total = float(Fv.sum())
    abs_total = float(np.abs(Fv).sum())
    out = FlowTable()
    for i in np.argsort(-np.abs(Fv), axis=None, kind="stable")[:k]:
        n, bi, j = np.unravel_index(i, Fv.shape)
        s = int(keys[j])
        v = float(Fv[n, bi, j])
        out.append(
            Flow(
                int(n),
                branches[bi],
                s,
                words[s] if words is not None else str(s),
                v,
                v / abs_total if abs_total else float("nan"),
            )
        )
    n_vis = len(keys)
    out.title = (
        "flows into layer %d head %d, %s-compose, query %d, over the %d visible keys (of %d): "
        "composed entries sum to %.4f; share = value / sum |value| of all flows (%.4f)"
        % (layer, head, phase, t, n_vis, T, total, abs_total)
    )
    out.total = total
    out.abs_total = abs_total
    out.visible_keys = n_vis
    return out
