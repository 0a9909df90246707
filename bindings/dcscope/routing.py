"""Routing: how attention scores and weights move between heads (hooks.md).

For DCMHA layer l, phase pre|post, query t and key s, the composition map
C[t,s] (N x N, C[n, m] = weight of source head n in target head m) is

    C[t,s] = I + qw1[t]^T qw2[t] + kw1[s]^T kw2[s] + diag(qdd[t]) + diag(kdd[s])

so that composed[:, t, s] = C[t,s]^T @ raw[:, t, s]. For Pythia (plain MHA)
every map is the identity.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from ._checks import check_index
from .model import Cache, Error, Model

PHASES = ("pre", "post")


def _dyn_names(layer: int, phase: str, query_wise: bool):
    p = "blocks.%d.attn.dyn.%s." % (layer, phase)
    names = [p + "qw1", p + "qw2", p + "qdd"]
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
    check_index("layer", layer, 0, model.config.n_layer, " (model has %d layers)" % model.config.n_layer)
    for what, v in (("query", query), ("key", key)):
        if v is not None:
            check_index("%s position" % what, v, 0, T, " for %d tokens" % T)
    return toks


def dynamic_weights(model: Model, tokens, layer: int, phase: str) -> Dict[str, np.ndarray]:
    """The dynamic weights of one layer and phase: qw1, qw2 [T, R, N] (qw1
    normalised), qdd [T, N], and (unless query_wise) kw1, kw2 [S, R, N], kdd [S, N]."""
    toks = _check(model, tokens, layer, phase)
    if not model.config.use_dcmha:
        raise Error("%s has no dynamic composition (plain multi-head attention)" % model.name)
    names = _dyn_names(layer, phase, model.config.query_wise)
    _, cache = model.run_with_cache(toks, names=names)
    return {n.rsplit(".", 1)[1]: cache[n] for n in names}


def maps_from_weights(dyn: Dict[str, np.ndarray], query: int, keys=None) -> np.ndarray:
    """C[t=query, s] for the given keys (default: all), [len(keys), N, N]."""
    qw1, qw2, qdd = dyn["qw1"][query], dyn["qw2"][query], dyn["qdd"][query]
    N = qdd.shape[0]
    S = dyn["qw1"].shape[0]
    keys = range(S) if keys is None else keys
    base = np.eye(N) + qw1.T.astype(np.float64) @ qw2 + np.diag(qdd)
    out = np.empty((len(keys), N, N))
    for i, s in enumerate(keys):
        c = base.copy()
        if "kw1" in dyn:
            c += dyn["kw1"][s].T.astype(np.float64) @ dyn["kw2"][s] + np.diag(dyn["kdd"][s])
        out[i] = c
    return out


def composition_map(model: Model, tokens, layer: int, phase: str, query: int, key: int) -> np.ndarray:
    """The N x N map C[query, key] of a layer and phase (identity for Pythia)."""
    toks = _check(model, tokens, layer, phase, query, key)
    if not model.config.use_dcmha:
        return np.eye(model.config.n_head)
    return maps_from_weights(dynamic_weights(model, toks, layer, phase), query, [key])[0]


def routing_matrix(model: Model, tokens, layer: int, phase: str, query: int) -> np.ndarray:
    """Head-to-head routing at one query position, weighted by what it routes.

    R[n, m] = sum over visible keys s of X[n, t, s] * C[t, s][n, m], where X is
    the phase's input: the raw scores (pre) or the softmax pattern (post). So
    R[n, m] is how much of source head n's attention (at query t) lands in
    target head m; sum_n R[n, m] = sum_s composed[m, t, s]."""
    toks = _check(model, tokens, layer, phase, query)
    N = model.config.n_head
    src = "blocks.%d.attn.%s" % (layer, "scores" if phase == "pre" else "pattern")
    names = [src] + (_dyn_names(layer, phase, model.config.query_wise) if model.config.use_dcmha else [])
    _, cache = model.run_with_cache(toks, names=names)
    window = model.config.window_size if layer in model.config.local_layers else 0
    keys = [s for s in range(query + 1) if window <= 0 or query - s <= window]
    x = cache[src][:, query, keys].astype(np.float64)          # [N, len(keys)]
    if not model.config.use_dcmha:
        return np.diag(x.sum(axis=1))
    dyn = {n.rsplit(".", 1)[1]: cache[n] for n in names[1:]}
    maps = maps_from_weights(dyn, query, keys)                  # [len(keys), N, N]
    return np.einsum("ns,snm->nm", x, maps)


def gates(model: Model, tokens, layer: int) -> Dict[str, np.ndarray]:
    """The dynamic gates of a layer: {'pre.qdd': [T, N], 'pre.kdd', 'post.qdd', 'post.kdd'}
    (how much each head keeps of its own score/weight, per token)."""
    toks = _check(model, tokens, layer, "pre")
    if not model.config.use_dcmha:
        raise Error("%s has no dynamic gates (plain multi-head attention)" % model.name)
    sides = ("qdd",) if model.config.query_wise else ("qdd", "kdd")
    names = ["blocks.%d.attn.dyn.%s.%s" % (layer, ph, s) for ph in PHASES for s in sides]
    _, cache = model.run_with_cache(toks, names=names)
    return {n.split("dyn.", 1)[1]: cache[n] for n in names}


def routing_from_cache(cache: Cache, layer: int, phase: str, query: int, key: int, n_head: int) -> np.ndarray:
    """C[query, key] from a cache that holds the layer's dyn.* activations."""
    p = "blocks.%d.attn.dyn.%s." % (layer, phase)
    if p + "qw1" not in cache:
        raise Error("cache has no %sqw1 (capture the dyn hooks of layer %d)" % (p, layer))
    dyn = {k: cache[p + k] for k in ("qw1", "qw2", "qdd", "kw1", "kw2", "kdd") if p + k in cache}
    return maps_from_weights(dyn, query, [key])[0]
