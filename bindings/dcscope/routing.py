"""Routing: how attention scores and weights move between heads (hooks.md).

For DCMHA layer l, phase pre|post, query t and key s, the composition map
C[t,s] (N x N, C[n, m] = weight of source head n in target head m) is

    C[t,s] = I + qw1[t]^T qw2[t] + kw1[s]^T kw2[s] + diag(qdd[t]) + diag(kdd[s])
             (+ W, the static Talking-Heads term, with use_sw)

so that composed[:, t, s] = C[t,s]^T @ raw[:, t, s]; with compose_groups G
the projection terms (and W) are block-diagonal. For Pythia (plain MHA)
every map is the identity.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from .model import Cache, Error, Model

PHASES = ("pre", "post")


def _dyn_names(layer: int, phase: str, query_wise: bool, key_wise: bool = False):
    p = "blocks.%d.attn.dyn.%s." % (layer, phase)
    names = [] if key_wise else [p + "qw1", p + "qw2", p + "qdd"]
    if not query_wise:
        names += [p + "kw1", p + "kw2", p + "kdd"]
    return names


def _check(model: Model, tokens, layer: int, phase: str, query: Optional[int] = None,
           key: Optional[int] = None) -> np.ndarray:
    toks = np.asarray(model.to_tokens(tokens) if isinstance(tokens, str) else tokens)
    if toks.ndim != 1:
        raise Error("routing works on one sequence: tokens must be 1-D, got shape %s" % (toks.shape,))
    T = toks.shape[0]
    if phase not in PHASES:
        raise Error("phase must be 'pre' or 'post', not %r" % (phase,))
    if not 0 <= layer < model.config.n_layer:
        raise Error("layer %d is out of range (model has %d layers)" % (layer, model.config.n_layer))
    for what, v in (("query", query), ("key", key)):
        if v is not None and not 0 <= v < T:
            raise Error("%s position %d is out of range for %d tokens" % (what, v, T))
    return toks


def dynamic_weights(model: Model, tokens, layer: int, phase: str) -> Dict[str, np.ndarray]:
    """The dynamic weights of one layer and phase: qw1, qw2 [T, R, N] (qw1
    normalised), qdd [T, N], and (unless query_wise) kw1, kw2 [S, R, N], kdd [S, N]."""
    toks = _check(model, tokens, layer, phase)
    if not model.config.use_dcmha:
        raise Error("%s has no dynamic composition (plain multi-head attention)" % model.name)
    names = _dyn_names(layer, phase, model.config.query_wise, model.config.key_wise)
    _, cache = model.run_with_cache(toks, names=names)
    return {n.rsplit(".", 1)[1]: cache[n] for n in names}


def static_map(model: Model, layer: int, phase: str) -> Optional[np.ndarray]:
    """The static (Talking-Heads) term W [N, N] of a layer and phase (block-diagonal
    with compose_groups), or None when the model has no static branch."""
    if not model.config.use_sw:
        return None
    w = model.weight("layers.%d.attention.dyn_w_proj.%s_proj.w" % (layer, phase))   # [G, Mg, Mg]
    return _block_diag(w.astype(np.float64))


def _block_diag(blocks: np.ndarray) -> np.ndarray:
    G, Mg, _ = blocks.shape
    out = np.zeros((G * Mg, G * Mg))
    for g in range(G):
        out[g * Mg:(g + 1) * Mg, g * Mg:(g + 1) * Mg] = blocks[g]
    return out


def maps_from_weights(dyn: Dict[str, np.ndarray], query: int, keys=None, groups: int = 1,
                      static: Optional[np.ndarray] = None) -> np.ndarray:
    """C[t=query, s] for the given keys (default: all), [len(keys), N, N]. With
    `groups` G the dynamic projections mix heads only within each of G blocks;
    `static` [N, N] is the fixed Talking-Heads term (use_sw)."""
    some = dyn["qdd"] if "qdd" in dyn else dyn["kdd"]
    S, N = some.shape
    keys = range(S) if keys is None else keys
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
    """The N x N map C[query, key] of a layer and phase (identity for Pythia)."""
    toks = _check(model, tokens, layer, phase, query, key)
    if not model.config.use_dcmha:
        return np.eye(model.config.n_head)
    return maps_from_weights(dynamic_weights(model, toks, layer, phase), query, [key],
                             model.config.compose_groups, static_map(model, layer, phase))[0]


def routing_matrix(model: Model, tokens, layer: int, phase: str, query: int) -> np.ndarray:
    """Head-to-head routing at one query position, weighted by what it routes.

    R[n, m] = sum over visible keys s of X[n, t, s] * C[t, s][n, m], where X is
    the phase's input: the raw scores (pre) or the softmax pattern (post). So
    R[n, m] is how much of source head n's attention (at query t) lands in
    target head m; sum_n R[n, m] = sum_s composed[m, t, s]."""
    toks = _check(model, tokens, layer, phase, query)
    N = model.config.n_head
    src = "blocks.%d.attn.%s" % (layer, "scores" if phase == "pre" else "pattern")
    names = [src] + (_dyn_names(layer, phase, model.config.query_wise, model.config.key_wise)
                     if model.config.use_dcmha else [])
    _, cache = model.run_with_cache(toks, names=names)
    window = model.config.window_size if layer in model.config.local_layers else 0
    keys = [s for s in range(query + 1) if window <= 0 or query - s <= window]
    x = cache[src][:, query, keys].astype(np.float64)          # [N, len(keys)]
    if not model.config.use_dcmha:
        return np.diag(x.sum(axis=1))
    dyn = {n.rsplit(".", 1)[1]: cache[n] for n in names[1:]}
    maps = maps_from_weights(dyn, query, keys, model.config.compose_groups,
                             static_map(model, layer, phase))   # [len(keys), N, N]
    return np.einsum("ns,snm->nm", x, maps)


def gates(model: Model, tokens, layer: int) -> Dict[str, np.ndarray]:
    """The dynamic gates of a layer: {'pre.qdd': [T, N], 'pre.kdd', 'post.qdd', 'post.kdd'}
    (how much each head keeps of its own score/weight, per token)."""
    toks = _check(model, tokens, layer, "pre")
    if not model.config.use_dcmha:
        raise Error("%s has no dynamic gates (plain multi-head attention)" % model.name)
    sides = ("qdd",) if model.config.query_wise else ("kdd",) if model.config.key_wise else ("qdd", "kdd")
    names = ["blocks.%d.attn.dyn.%s.%s" % (layer, ph, s) for ph in PHASES for s in sides]
    _, cache = model.run_with_cache(toks, names=names)
    return {n.split("dyn.", 1)[1]: cache[n] for n in names}


def routing_from_cache(cache: Cache, layer: int, phase: str, query: int, key: int, n_head: int,
                       groups: int = 1, static: Optional[np.ndarray] = None) -> np.ndarray:
    """C[query, key] from a cache that holds the layer's dyn.* activations."""
    p = "blocks.%d.attn.dyn.%s." % (layer, phase)
    if p + "qw1" not in cache:
        raise Error("cache has no %sqw1 (capture the dyn hooks of layer %d)" % (p, layer))
    dyn = {k: cache[p + k] for k in ("qw1", "qw2", "qdd", "kw1", "kw2", "kdd") if p + k in cache}
    return maps_from_weights(dyn, query, [key], groups, static)[0]
