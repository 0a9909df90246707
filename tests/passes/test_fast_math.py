"""The engine's branch-free GELU erf and softmax exp (dcs_erf, dcs_exp in
dcs_math.h, issue 28) against float64 math, on a pass's own activations:
the GELU output hook (mlp.post) against 0.5 x (1 + erf(x / sqrt 2)) of the
GELU input hook (mlp.pre), and the attention pattern against the masked
softmax of the scores (Pythia: no compose in between; the full path, which
these hooks select, runs the same dcs_softmax_row as the fused one).

Bounds, from float32 rounding (U32 = 2^-24) of the same float32 inputs,
not from one CPU's result (the reference is float64):
GELU: u = x / sqrt 2 rounded (moves erf by <= 2/sqrt(pi) |u| U32), dcs_erf's
own error <= 1.2e-7 absolute (scripts/fit_erf.py), 1 + erf rounded
(U32 (1 + |erf|)), then 0.5 x (...) two roundings (2 U32 |gelu|).
Softmax: z - max rounded (relative |z - max| U32 in exp), dcs_exp within
2 ulp (4 U32; 1.2 ulp measured), the sum in 16 lanes of <= ceil(S/16)
terms then the 16 lanes (depth ceil(S/16) + 16), one divide (U32).
"""

import math

import numpy as np

import dclens

U32 = 2.0**-24


def _hooks(model, toks, names):
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n in names)
    return {n: np.asarray(cache[n], np.float64) for n in names}


def test_gelu_matches_float64_erf(tiny_factory):
    d, _, _ = tiny_factory(model_type="gpt_neox", seed=41)
    model = dclens.load(d)
    toks = np.random.default_rng(0).integers(0, model.config.vocab, size=(2, 33))
    c = _hooks(model, toks, ["blocks.0.mlp.pre", "blocks.0.mlp.post"])
    x = c["blocks.0.mlp.pre"]
    erf = np.vectorize(math.erf)(x / math.sqrt(2))
    ref = 0.5 * x * (1 + erf)
    u = np.abs(x) / math.sqrt(2)
    bound = 0.5 * np.abs(x) * (1.13 * u * U32 + 1.2e-7 + U32 * (1 + np.abs(erf))) + 2 * U32 * np.abs(ref)
    assert np.abs(x).max() > 1.0  # both pieces of dcs_erf are exercised
    assert np.all(np.abs(c["blocks.0.mlp.post"] - ref) <= bound)


def test_softmax_matches_float64(tiny_factory):
    d, _, _ = tiny_factory(model_type="gpt_neox", seed=42)
    model = dclens.load(d)
    T = 40  # > 16 keys: whole lanes and a remainder
    toks = np.random.default_rng(1).integers(0, model.config.vocab, size=(1, T))
    c = _hooks(model, toks, ["blocks.0.attn.scores", "blocks.0.attn.pattern"])
    s, p = c["blocks.0.attn.scores"], c["blocks.0.attn.pattern"]  # [B, N, T, S]
    mask = np.tril(np.ones((T, T), bool))
    z = np.where(mask, s, -np.inf)
    e = np.exp(z - z.max(-1, keepdims=True))
    ref = e / e.sum(-1, keepdims=True)
    zmx = np.where(mask, np.abs(s - s.max(-1, keepdims=True, where=mask, initial=-np.inf)), 0)
    bound = (np.abs(zmx) + 4 + math.ceil(T / 16) + 16 + 1) * U32 * ref + 1e-45
    assert np.all(p[..., ~mask] == 0)
    assert np.all(np.abs(p - ref) <= bound)
