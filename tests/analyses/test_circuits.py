"""Circuits against products formed directly from the generated state dict."""

import math

import numpy as np
import pytest

import dclens
from dclens import circuits

from conftest import rel_err
from tolerances import f32_tol, f64_tol

erf_vec = np.vectorize(math.erf)

DCP = dict(model_type="dcpythia", n_layer=2, dim=32, n_head=4, seed=41, fused_qkv=False)
NEOX = dict(model_type="gpt_neox", n_layer=2, dim=32, n_head=4, seed=42)


def _heads(sd, cfg, layer):
    """Per-head W_Q, W_K, W_V [Dh, D] and wo [D, D] straight from the checkpoint names."""
    if cfg["model_type"] == "gpt_neox":
        D, N = cfg["hidden_size"], cfg["num_attention_heads"]
        Dh = D // N
        w = sd["gpt_neox.layers.%d.attention.query_key_value.weight" % layer].reshape(N, 3, Dh, D)
        wo = sd["gpt_neox.layers.%d.attention.dense.weight" % layer]
        return w[:, 0], w[:, 1], w[:, 2], wo
    D, N = cfg["dim"], cfg["n_head"]
    Dh = D // N
    p = "layers.%d.attention." % layer
    if p + "wqkv.weight" in sd:
        wq, wk, wv = np.split(sd[p + "wqkv.weight"], 3)
    else:
        wq, wk, wv = sd[p + "wq.weight"], sd[p + "wk.weight"], sd[p + "wv.weight"]
    r = lambda w: w.reshape(N, Dh, D)
    return r(wq), r(wk), r(wv), sd[p + "wo.weight"]


@pytest.mark.parametrize("kw", [DCP, NEOX], ids=["dcpythia", "gpt_neox"])
def test_qk_ov_circuits(tiny_factory, kw):
    d, sd, cfg = tiny_factory(**kw)
    model = dclens.load(d)
    Dh = model.config.head_dim
    for layer in range(2):
        WQ, WK, WV, WO = _heads(sd, cfg, layer)
        for n in range(model.config.n_head):
            qk = circuits.qk_circuit(model, layer, n)
            assert qk.shape == (model.config.d_model,) * 2
            want = WQ[n].T.astype(np.float64) @ WK[n]
            # full(): a float32 product of the factors (a reduction of length Dh)
            prod = f32_tol(Dh, 1, want.size)
            assert rel_err(qk.full(), want) <= prod
            # singular values: float64 QR + SVD of the float32 factors vs SVD of the
            # float64 product; Weyl: |d sigma| <= ||dM||_2, below D * max|dM|
            np.testing.assert_allclose(
                qk.singular_values(),
                np.linalg.svd(want, compute_uv=False)[:Dh],
                rtol=0,
                atol=f64_tol(Dh, 3, Dh) * want.shape[0] * np.abs(want).max(),
            )
            ov = circuits.ov_circuit(model, layer, n)
            want = WV[n].T.astype(np.float64) @ WO[:, n * Dh : (n + 1) * Dh].T
            assert rel_err(ov.full(), want) <= prod


def _ln(x, w, b, eps):
    mu = x.mean()
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean() + eps) * w + b


def test_ov_readout_eqn12(tiny_factory):
    d, sd, cfg = tiny_factory(**DCP)
    model = dclens.load(d)
    layer, head, tok = 1, 2, 17
    Dh, eps = model.config.head_dim, cfg["norm_eps"]
    e = sd["tok_embeddings.weight"][tok].astype(np.float64)
    h = _ln(e, sd["layers.0.ffn_norm.weight"], sd["layers.0.ffn_norm.bias"], eps)
    u = h @ sd["layers.0.feed_forward.w1.weight"].T + sd["layers.0.feed_forward.w1.bias"]
    g = 0.5 * u * (1 + erf_vec(u / np.sqrt(2)))
    e = e + g @ sd["layers.0.feed_forward.w2.weight"].T + sd["layers.0.feed_forward.w2.bias"]
    x = _ln(e, sd["layers.%d.attention_norm.weight" % layer], sd["layers.%d.attention_norm.bias" % layer], eps)
    _, _, WV, WO = _heads(sd, cfg, layer)
    out = (x @ WV[head].T) @ WO[:, head * Dh : (head + 1) * Dh].T
    logits = out @ sd["output.weight"].T
    want = np.argsort(-logits)[:5]
    got = circuits.ov_readout(model, layer, head, tok, k=5)
    assert [t for t, _ in got] == list(want)
    # the readout: OV then the unembedding (reductions of length D), in float32
    np.testing.assert_allclose(
        [v for _, v in got],
        logits[want],
        rtol=0,
        atol=f32_tol(model.config.d_model, 3, logits.size) * np.abs(logits).max(),
    )


@pytest.mark.parametrize("kind", ["qk", "ov"])
def test_head_diversity_matches_explicit_concatenation(tiny_factory, kind):
    d, sd, cfg = tiny_factory(**DCP)
    model = dclens.load(d)
    f = circuits.qk_circuit if kind == "qk" else circuits.ov_circuit
    M = np.concatenate([f(model, 0, n).full() for n in range(model.config.n_head)], axis=1)  # [D, N*D]
    s = np.linalg.svd(M, compute_uv=False) ** 2
    curve = np.cumsum(s) / s.sum()
    got = circuits.diversity_curve(model, 0, kind)
    # M's blocks are float32 products (full()), the curve's Gram is float64: the
    # squared singular values differ by twice the products' relative rounding
    tol = 2 * f32_tol(model.config.head_dim, 1, M.size, sides=2)
    np.testing.assert_allclose(got[: len(curve)], curve, rtol=0, atol=tol)
    assert (
        abs(circuits.head_diversity(model, 0, kind) - np.concatenate([curve, np.ones(len(got) - len(curve))]).mean())
        < tol
    )
    assert 0 < circuits.head_diversity(model, 0, kind) <= 1


def test_circuit_errors(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    with pytest.raises(dclens.Error, match="head 9"):
        circuits.qk_circuit(model, 0, 9)
    with pytest.raises(dclens.Error, match="layer 5"):
        circuits.ov_circuit(model, 5, 0)
    with pytest.raises(dclens.Error, match="no weight named"):
        model.weight("layers.0.nope")
