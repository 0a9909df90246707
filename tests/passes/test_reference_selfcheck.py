"""Self-checks of the numpy reference (tests/reference.py) and of the tiny-checkpoint
writers (dclens.testing.make_tiny), independent of the C engine.

The reference checks pin invariants of model-spec.md / hooks.md; the writer checks
read the files back with independent minimal readers (safetensors header parsing,
zipfile + a restricted pickle.Unpickler) and compare with what make_tiny returned.

Tolerances: both sides are float64 computations of one quantity in different
orders, on reductions of at most 64 terms and at most 10 chained stages, with
values of order 1 (F64_ABS) or, for logits, up to 10 times that: the error
model of tests/tolerances.py in float64 (f64_tol).
"""

import importlib.util
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import types
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(HERE)
MAKE_TINY_PATH = os.path.join(ROOT, "bindings", "dclens", "testing", "make_tiny.py")
sys.path.insert(0, HERE)

import reference as ref  # noqa: E402
from tolerances import f64_tol  # noqa: E402

F64_ABS = 10 * f64_tol(64, 10, 10**5)  # values up to 10

try:  # the package import needs the built engine; the generator itself does not
    from dclens.testing import make_tiny as mt
except Exception:  # pragma: no cover - depends on the build state
    _spec = importlib.util.spec_from_file_location("_dclens_make_tiny", MAKE_TINY_PATH)
    mt = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(mt)


T = 20  # longer than the default window (8), so local layers matter


def tokens(n=T, vocab=64, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def gen(tmp, name, **kw):
    return mt.make_tiny(str(tmp / name), **kw)


@pytest.fixture(scope="module")
def dc(tmp):
    sd, cfg = gen(tmp, "dc")
    logits, cache = ref.ref_forward(sd, cfg, tokens(), cache=True)
    return sd, cfg, logits, cache


# =========================================================================== reference


def test_cache_has_exactly_the_hook_names(dc):
    sd, cfg, logits, cache = dc
    assert list(cache) == ref.hook_names(cfg)
    N, Dh, D, R, F = 4, 8, 32, 2, 128
    assert cache["blocks.0.attn.q"].shape == (T, N, Dh)
    assert cache["blocks.0.attn.scores"].shape == (N, T, T)
    assert cache["blocks.0.attn.dyn.pre.qw1"].shape == (T, R, N)
    assert cache["blocks.0.attn.dyn.post.kdd"].shape == (T, N)
    assert cache["blocks.0.attn.head_out"].shape == (T, N, D)
    assert cache["blocks.1.mlp.pre"].shape == (T, F)
    assert logits.shape == (T, 64)
    # logits of a useful size, O(1..10)
    assert 0.5 < logits.std() < 10


def test_naive_loops_layer0(dc):
    """Steps 4, 5, 10 of model-spec.md recomputed with plain loops from the cached
    attention input, as a check of the reference's einsum index conventions."""
    import math

    sd, cfg, _, c = dc
    D, N, Dh, K, R = 32, 4, 8, 16, 2
    p = "layers.0.attention."
    x = c["blocks.0.ln_attn"]
    dw1, qkw, dd = (sd[p + "dyn_w_proj." + n].astype(np.float64) for n in ("dw1", "qkw", "dd"))

    def gelu(v):
        return 0.5 * v * (1 + math.erf(v / math.sqrt(2)))

    for t in (0, 7, 19):
        for slot, phase, side in [(0, "pre", "q"), (1, "pre", "k"), (2, "post", "q"), (3, "post", "k")]:
            hid = [gelu(sum(x[t, d] * dw1[d, 0, slot, kk] for d in range(D))) for kk in range(K)]
            w = np.array(
                [[sum(hid[kk] * qkw[0, slot, kk, r, n] for kk in range(K)) for n in range(N)] for r in range(2 * R)]
            )
            w1 = np.array([row / math.sqrt(sum(v * v for v in row) / N + 1e-6) for row in w[:R]])
            gate = [math.tanh(sum(x[t, d] * dd[d, 0, slot * N + n] for d in range(D))) for n in range(N)]
            a = f"blocks.0.attn.dyn.{phase}.{side}"
            np.testing.assert_allclose(c[a + "w1"][t], w1, atol=F64_ABS)
            np.testing.assert_allclose(c[a + "w2"][t], w[R:], atol=F64_ABS)
            np.testing.assert_allclose(c[a + "dd"][t], gate, atol=F64_ABS)
    q, k, v = c["blocks.0.attn.q"], c["blocks.0.attn.k"], c["blocks.0.attn.v"]
    P = c["blocks.0.attn.pattern_composed"]
    wo = sd[p + "wo.weight"].astype(np.float64)
    for n in range(N):
        for t in (0, 9, 19):
            for s in (0, 3, t):
                A = sum(q[t, n, d] * k[s, n, d] for d in range(Dh)) / math.sqrt(Dh)
                assert abs(A - c["blocks.0.attn.scores"][n, t, s]) < F64_ABS
            z = [sum(P[n, t, s] * v[s, n, d] for s in range(T)) for d in range(Dh)]
            np.testing.assert_allclose(c["blocks.0.attn.z"][t, n], z, atol=F64_ABS)
            ho = [sum(z[d] * wo[e, n * Dh + d] for d in range(Dh)) for e in range(D)]
            np.testing.assert_allclose(c["blocks.0.attn.head_out"][t, n], ho, atol=F64_ABS)


def test_five_branches_sum_to_composed(dc):
    _, cfg, _, c = dc
    for l in range(2):
        a = f"blocks.{l}.attn."
        pre = sum(c[a + "pre." + b] for b in ("skip", "qp", "kp", "qg", "kg"))
        post = sum(c[a + "post." + b] for b in ("skip", "qp", "kp", "qg", "kg"))
        np.testing.assert_allclose(pre, c[a + "scores_composed"], rtol=0, atol=F64_ABS)
        np.testing.assert_allclose(post, c[a + "pattern_composed"], rtol=0, atol=F64_ABS)
        np.testing.assert_array_equal(c[a + "pre.skip"], c[a + "scores"])
        np.testing.assert_array_equal(c[a + "post.skip"], c[a + "pattern"])


def test_dynamic_branches_are_not_negligible(dc):
    """The generator's scales make every compose branch visibly matter."""
    _, _, _, c = dc
    for l in range(2):
        for phase in ("pre", "post"):
            a = f"blocks.{l}.attn.{phase}."
            skip = np.sqrt((c[a + "skip"] ** 2).mean())
            for b in ("qp", "kp", "qg", "kg"):
                rms = np.sqrt((c[a + b] ** 2).mean())
                assert 0.2 * skip < rms < 5 * skip, (l, phase, b, rms, skip)


def test_composition_map(dc):
    _, _, _, c = dc
    N = 4
    for l in range(2):
        a = f"blocks.{l}.attn."
        for t in range(T):
            for s in range(T):  # every pair, masked ones included
                C = ref.ref_composition_map(c, l, "pre", t, s, N)
                np.testing.assert_allclose(
                    C.T @ c[a + "scores"][:, t, s], c[a + "scores_composed"][:, t, s], rtol=0, atol=F64_ABS
                )
                C = ref.ref_composition_map(c, l, "post", t, s, N)
                np.testing.assert_allclose(
                    C.T @ c[a + "pattern"][:, t, s], c[a + "pattern_composed"][:, t, s], rtol=0, atol=F64_ABS
                )


def test_mask_and_softmax(dc):
    _, cfg, _, c = dc
    h = ref.Hyper(cfg)
    for l in range(2):
        a = f"blocks.{l}.attn."
        mask = ref.attention_mask(T, h.is_local(l), h.window_size)
        P, PC = c[a + "pattern"], c[a + "pattern_composed"]
        assert np.all(P[:, ~mask] == 0.0)
        assert np.all(PC[:, ~mask] == 0.0)  # composition after the mask keeps zeros exact
        for b in ("skip", "qp", "kp", "qg", "kg"):
            assert np.all(c[a + "post." + b][:, ~mask] == 0.0)
        np.testing.assert_allclose(P.sum(-1), 1.0, rtol=0, atol=F64_ABS)
        assert np.all(P >= 0)
        # scores_composed is defined everywhere, masked pairs included
        assert np.all(c[a + "scores_composed"][:, ~mask] != 0.0)
    # composed pattern is not a distribution
    assert np.abs(c["blocks.0.attn.pattern_composed"].sum(-1) - 1).max() > 1e-3


def test_window_matters(tmp, dc):
    sd, cfg, logits, c = dc
    h = ref.Hyper(cfg)
    assert [h.is_local(l) for l in range(2)] == [True, False]
    t_idx, s_idx = np.nonzero(np.tril(np.ones((T, T), bool), -(cfg["window_size"] + 1)))
    assert len(t_idx) > 0
    assert np.all(c["blocks.0.attn.pattern"][:, t_idx, s_idx] == 0)  # local layer
    assert np.all(c["blocks.1.attn.pattern"][:, t_idx, s_idx] > 0)  # global layer
    glob = dict(cfg, window_size=10_000)
    lg = ref.ref_forward(sd, glob, tokens())
    assert np.abs(lg - logits).max() > 1e-2
    # within the window the two agree on layer 0's first positions
    np.testing.assert_allclose(lg[: cfg["window_size"] + 1], logits[: cfg["window_size"] + 1], atol=F64_ABS)


@pytest.mark.parametrize(
    "wtype,expect",
    [
        ("LG", [1, 0, 1, 0, 1, 0, 1, 0]),
        ("LGLL", [1, 0, 1, 1, 1, 0, 1, 1]),
        ("LGL6", [1, 0, 1, 1, 1, 1, 1, 1]),
        (None, [1, 0, 1, 0, 1, 0, 1, 0]),
    ],
)
def test_window_patterns(wtype, expect):
    cfg = mt.dcpythia_config(
        n_layer=8,
        dim=32,
        n_head=4,
        vocab=64,
        intermediate=128,
        window_size=8,
        window_type=wtype,
        query_wise=False,
        use_qk_norm=True,
        use_parallel_residual=True,
        use_linear_bias=True,
        use_dcmha=True,
        rotary_pct=0.25,
        tie_word_embeddings=False,
        dtype="float32",
    )
    h = ref.Hyper(cfg)
    assert [int(h.is_local(l)) for l in range(8)] == expect


def test_window_type_lgll_in_forward(tmp):
    sd, cfg = gen(tmp, "lgll", n_layer=4, window_type="LGLL", window_size=4, seed=3)
    _, c = ref.ref_forward(sd, cfg, tokens(12), cache=True)
    far = np.tril(np.ones((12, 12), bool), -5)
    for l, local in enumerate([True, False, True, True]):
        P = c[f"blocks.{l}.attn.pattern"][:, far]
        assert np.all(P == 0) if local else np.all(P > 0)


def test_zero_dynamic_weights_is_plain_mha(dc):
    sd, cfg, logits, _ = dc
    zeroed = dict(sd)
    for l in range(2):
        p = f"layers.{l}.attention.dyn_w_proj."
        zeroed[p + "qkw"] = np.zeros_like(sd[p + "qkw"])
        zeroed[p + "dd"] = np.zeros_like(sd[p + "dd"])
    lz, cz = ref.ref_forward(zeroed, cfg, tokens(), cache=True)
    mha_cfg = dict(cfg, use_dcmha=False)
    lm, cm = ref.ref_forward(sd, mha_cfg, tokens(), cache=True)  # dyn_w_proj present but unused
    np.testing.assert_allclose(lz, lm, rtol=0, atol=F64_ABS)
    for l in range(2):
        np.testing.assert_allclose(
            cz[f"blocks.{l}.attn.pattern_composed"], cm[f"blocks.{l}.attn.pattern"], rtol=0, atol=F64_ABS
        )
    # and the dynamic weights do change the model
    assert np.abs(logits - lm).max() > 0.1
    # plain MHA has no compose / dyn hooks
    assert not any(".dyn." in k or ".pre." in k or ".post." in k or "composed" in k for k in cm)


def test_use_dcmha_false_without_dyn_tensors(tmp):
    sd, cfg = gen(tmp, "mha", use_dcmha=False, write_unused_dyn=False)
    assert not any("dyn_w_proj" in k for k in sd)
    sd2, _ = gen(tmp, "mha2", use_dcmha=False, write_unused_dyn=True)
    assert any("dyn_w_proj" in k for k in sd2)
    a = ref.ref_forward(sd, cfg, tokens())
    b = ref.ref_forward({k: v for k, v in sd2.items()}, cfg, tokens())
    assert a.shape == b.shape  # different random draws; both run; dyn ignored
    common = {k: v for k, v in sd2.items() if "dyn_w_proj" not in k}
    np.testing.assert_array_equal(ref.ref_forward(common, cfg, tokens()), b)


def test_head_out_sums_to_out(dc, tmp):
    sd, cfg, _, c = dc
    for l in range(2):
        a = f"blocks.{l}.attn."
        np.testing.assert_allclose(
            c[a + "head_out"].sum(1) + sd[f"layers.{l}.attention.wo.bias"], c[a + "out"], rtol=0, atol=F64_ABS
        )
    sd, cfg = gen(tmp, "nobias", use_linear_bias=False)
    assert not any(k.endswith(".bias") and ("attention.w" in k or "feed_forward" in k) for k in sd)
    assert "layers.0.attention_norm.bias" in sd  # LayerNorm biases stay
    _, c = ref.ref_forward(sd, cfg, tokens(), cache=True)
    np.testing.assert_allclose(c["blocks.0.attn.head_out"].sum(1), c["blocks.0.attn.out"], rtol=0, atol=F64_ABS)


def test_residual_structure(tmp, dc):
    sd, cfg, _, c = dc  # parallel
    for l in range(2):
        b = f"blocks.{l}."
        np.testing.assert_allclose(
            c[b + "resid_post"], c[b + "resid_pre"] + c[b + "attn.out"] + c[b + "mlp.out"], atol=F64_ABS
        )
        ln = ref.layer_norm(
            c[b + "resid_pre"], sd[f"layers.{l}.ffn_norm.weight"], sd[f"layers.{l}.ffn_norm.bias"], 1e-5
        )
        np.testing.assert_allclose(c[b + "ln_mlp"], ln, atol=F64_ABS)
    np.testing.assert_allclose(c["blocks.1.resid_pre"], c["blocks.0.resid_post"], atol=0)
    sd, cfg = gen(tmp, "serial", use_parallel_residual=False)
    lg_serial, c = ref.ref_forward(sd, cfg, tokens(), cache=True)
    for l in range(2):
        b = f"blocks.{l}."
        mid = c[b + "resid_pre"] + c[b + "attn.out"]
        ln = ref.layer_norm(mid, sd[f"layers.{l}.ffn_norm.weight"], sd[f"layers.{l}.ffn_norm.bias"], 1e-5)
        np.testing.assert_allclose(c[b + "ln_mlp"], ln, atol=F64_ABS)
        np.testing.assert_allclose(c[b + "resid_post"], mid + c[b + "mlp.out"], atol=F64_ABS)
    lg_par = ref.ref_forward(sd, dict(cfg, use_parallel_residual=True), tokens())
    assert np.abs(lg_par - lg_serial).max() > 1e-3


def test_qk_norm_and_rotary(dc, tmp):
    sd, cfg, _, c = dc
    q = c["blocks.0.attn.q"]
    # position 0 is unrotated: q/rms(q) * scale exactly
    pre = ref.linear(c["blocks.0.ln_attn"], sd["layers.0.attention.wqkv.weight"], sd["layers.0.attention.wqkv.bias"])
    q0 = pre[0, :32].reshape(4, 8)
    q0 = q0 / np.sqrt((q0**2).mean(-1, keepdims=True) + 1e-6) * sd["layers.0.attention.q_norm.scale"]
    np.testing.assert_allclose(q[0], q0, atol=F64_ABS)
    # rotary keeps norms of the rotated pairs and leaves dims >= r alone (r = 2 here)
    r = ref.Hyper(cfg).rotary_dims
    assert r == 2
    x = np.random.default_rng(0).standard_normal((T, 4, 8))
    y = ref.rotary(x, r, 10000.0)
    np.testing.assert_array_equal(y[..., r:], x[..., r:])
    np.testing.assert_allclose(np.hypot(y[..., 0], y[..., 1]), np.hypot(x[..., 0], x[..., 1]), atol=F64_ABS)
    # angle of pair j at position t is t * base^(-2j/r)
    y = ref.rotary(np.tile(np.array([1.0, 0.0, 0.0, 0.0]), (T, 1, 1)), 4, 100.0)
    ang = np.arange(T)[:, None] * 100.0 ** (-2 * np.arange(2) / 4)
    np.testing.assert_allclose(y[:, 0, 0], np.cos(ang[:, 0]), atol=F64_ABS)
    np.testing.assert_allclose(y[:, 0, 2], np.sin(ang[:, 0]), atol=F64_ABS)
    y = ref.rotary(np.tile(np.array([0.0, 1.0, 0.0, 0.0]), (T, 1, 1)), 4, 100.0)  # pair j=1: dims (1, 3)
    np.testing.assert_allclose(y[:, 0, 1], np.cos(ang[:, 1]), atol=F64_ABS)
    np.testing.assert_allclose(y[:, 0, 3], np.sin(ang[:, 1]), atol=F64_ABS)
    sd, cfg = gen(tmp, "noqk", use_qk_norm=False)
    assert not any("q_norm" in k for k in sd)
    ref.ref_forward(sd, cfg, tokens())


def test_query_wise(tmp):
    sd, cfg = gen(tmp, "qw", query_wise=True)
    assert sd["layers.0.attention.dyn_w_proj.dw1"].shape == (32, 1, 4, 16)  # still 4 slots
    _, c = ref.ref_forward(sd, cfg, tokens(), cache=True)
    assert list(c) == ref.hook_names(cfg)
    assert not any(k.endswith((".kw1", ".kw2", ".kdd", ".kp", ".kg")) for k in c)
    for l in range(2):
        a = f"blocks.{l}.attn."
        np.testing.assert_allclose(
            sum(c[a + "pre." + b] for b in ("skip", "qp", "qg")), c[a + "scores_composed"], atol=F64_ABS
        )
        for t, s in [(3, 1), (T - 1, 0), (T - 1, T - 1)]:
            C = ref.ref_composition_map(c, l, "post", t, s)
            np.testing.assert_allclose(
                C.T @ c[a + "pattern"][:, t, s], c[a + "pattern_composed"][:, t, s], atol=F64_ABS
            )
    # the key slots are unused: changing them changes nothing
    sd2 = dict(sd)
    for l in range(2):
        p = f"layers.{l}.attention.dyn_w_proj."
        qkw = sd[p + "qkw"].copy()
        qkw[0, [1, 3]] = 7.0
        dd = sd[p + "dd"].copy().reshape(32, 1, 4, 4)
        dd[:, :, [1, 3]] = -3.0
        sd2[p + "qkw"], sd2[p + "dd"] = qkw, dd.reshape(32, 1, 16)
    np.testing.assert_array_equal(ref.ref_forward(sd2, cfg, tokens()), ref.ref_forward(sd, cfg, tokens()))


def test_fused_unfused_extra_derived_same_logits(tmp, dc):
    _, _, logits, _ = dc
    sd, cfg = gen(tmp, "unfused", fused_qkv=False, extra_derived=True)
    assert "layers.0.attention.wq.weight" in sd and "layers.0.attention.wqkv.weight" not in sd
    for k in ("dw_m", "qkw_m", "sw", "pre_proj.w", "post_proj.w"):
        assert f"layers.1.attention.dyn_w_proj.{k}" in sd
    np.testing.assert_allclose(sd["layers.0.attention.dyn_w_proj.pre_proj.w"][0], np.eye(4))
    np.testing.assert_allclose(ref.ref_forward(sd, cfg, tokens()), logits, rtol=0, atol=10 * F64_ABS)


def test_tie_word_embeddings(tmp):
    sd, cfg = gen(tmp, "tie", tie_word_embeddings=True)
    assert "output.weight" not in sd and cfg["tie_word_embeddings"] is True
    lg, c = ref.ref_forward(sd, cfg, tokens(), cache=True)
    np.testing.assert_allclose(lg, c["ln_final"] @ sd["tok_embeddings.weight"].T.astype(np.float64), atol=F64_ABS)


def test_interventions(dc):
    sd, cfg, logits, c = dc
    names = ref.hook_names(cfg)
    same = ref.ref_forward(sd, cfg, tokens(), interventions={n: (lambda a: a) for n in names})
    np.testing.assert_array_equal(same, logits)
    lz, cz = ref.ref_forward(
        sd, cfg, tokens(), cache=True, interventions={"blocks.1.attn.post.kp": lambda a: np.zeros_like(a)}
    )
    a = "blocks.1.attn."
    assert np.all(cz[a + "post.kp"] == 0)
    np.testing.assert_allclose(
        cz[a + "pattern_composed"], sum(cz[a + "post." + b] for b in ("skip", "qp", "qg", "kg")), atol=F64_ABS
    )
    np.testing.assert_array_equal(cz["blocks.0.resid_post"], c["blocks.0.resid_post"])  # upstream untouched
    assert np.abs(lz - logits).max() > 1e-3
    # patch layer 0's pattern with uniform causal attention: the post branches follow it
    mask = np.tril(np.ones((T, T)))
    uniform = np.broadcast_to(mask / mask.sum(-1, keepdims=True), (4, T, T))
    _, cp = ref.ref_forward(
        sd, cfg, tokens(), cache=True, interventions={"blocks.0.attn.pattern": lambda p: uniform.copy()}
    )
    for t, s in [(5, 2), (19, 0), (10, 10)]:
        C = ref.ref_composition_map(cp, 0, "post", t, s)
        np.testing.assert_allclose(C.T @ uniform[:, t, s], cp["blocks.0.attn.pattern_composed"][:, t, s], atol=F64_ABS)
    # dynamic-weight hooks feed the composition
    _, cd = ref.ref_forward(
        sd, cfg, tokens(), cache=True, interventions={"blocks.0.attn.dyn.pre.qdd": lambda g: np.ones_like(g)}
    )
    np.testing.assert_allclose(cd["blocks.0.attn.pre.qg"], cd["blocks.0.attn.scores"], atol=0)
    with pytest.raises(KeyError):
        ref.ref_forward(sd, cfg, tokens(), interventions={"blocks.9.attn.z": lambda a: a})
    with pytest.raises(ValueError):
        ref.ref_forward(sd, cfg, tokens(), interventions={"embed": lambda a: a[:-1]})


def _neox_to_dcpythia(sd, n_layer, D, N):
    """Same weights in the DCPythia layout (q, k, v row blocks instead of per-head groups)."""
    Dh = D // N
    out = {
        "tok_embeddings.weight": sd["gpt_neox.embed_in.weight"],
        "output.weight": sd["embed_out.weight"],
        "norm.weight": sd["gpt_neox.final_layer_norm.weight"],
        "norm.bias": sd["gpt_neox.final_layer_norm.bias"],
    }
    for l in range(n_layer):
        p, q = f"gpt_neox.layers.{l}.", f"layers.{l}."
        w = sd[p + "attention.query_key_value.weight"].reshape(N, 3, Dh, D).transpose(1, 0, 2, 3)
        b = sd[p + "attention.query_key_value.bias"].reshape(N, 3, Dh).transpose(1, 0, 2)
        out[q + "attention.wqkv.weight"] = w.reshape(3 * D, D)
        out[q + "attention.wqkv.bias"] = b.reshape(3 * D)
        for a, bb in [("attention_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]:
            out[q + a + ".weight"], out[q + a + ".bias"] = sd[p + bb + ".weight"], sd[p + bb + ".bias"]
        out[q + "attention.wo.weight"], out[q + "attention.wo.bias"] = (
            sd[p + "attention.dense.weight"],
            sd[p + "attention.dense.bias"],
        )
        for a, bb in [("w1", "dense_h_to_4h"), ("w2", "dense_4h_to_h")]:
            out[q + f"feed_forward.{a}.weight"] = sd[p + f"mlp.{bb}.weight"]
            out[q + f"feed_forward.{a}.bias"] = sd[p + f"mlp.{bb}.bias"]
    return out


@pytest.mark.parametrize("parallel", [True, False])
def test_gpt_neox_matches_dcpythia_mha(tmp, parallel):
    sd, cfg = gen(
        tmp,
        f"neox{parallel}",
        model_type="gpt_neox",
        n_layer=2,
        dim=32,
        n_head=4,
        use_parallel_residual=parallel,
        extra_derived=True,
        rotary_pct=0.5,
    )
    assert "gpt_neox.layers.0.attention.rotary_emb.inv_freq" in sd
    lg, c = ref.ref_forward(sd, cfg, tokens(), cache=True)
    assert list(c) == ref.hook_names(cfg)
    assert not any(".dyn." in k or ".pre." in k or ".post." in k or "composed" in k for k in c)
    dc_cfg = mt.dcpythia_config(
        n_layer=2,
        dim=32,
        n_head=4,
        vocab=64,
        intermediate=128,
        window_size=10_000,
        window_type=None,
        query_wise=False,
        use_qk_norm=False,
        use_parallel_residual=parallel,
        use_linear_bias=True,
        use_dcmha=False,
        rotary_pct=0.5,
        tie_word_embeddings=False,
        dtype="float32",
    )
    lg2, c2 = ref.ref_forward(_neox_to_dcpythia(sd, 2, 32, 4), dc_cfg, tokens(), cache=True)
    np.testing.assert_allclose(lg, lg2, rtol=0, atol=10 * F64_ABS)
    np.testing.assert_allclose(c["blocks.1.attn.pattern"], c2["blocks.1.attn.pattern"], atol=F64_ABS)
    assert 0.5 < lg.std() < 10
    h = ref.Hyper(cfg)
    assert not any(h.is_local(l) for l in range(2))
    np.testing.assert_allclose(c["blocks.0.attn.pattern"].sum(-1), 1, atol=F64_ABS)


def test_static_composition(tmp):
    sd, cfg = gen(tmp, "sw", use_sw=True, extra_derived=True)
    assert cfg["use_sw"] is True
    _, c = ref.ref_forward(sd, cfg, tokens(), cache=True)
    assert list(c) == ref.hook_names(cfg) and "blocks.0.attn.pre.static" in c
    for l in range(2):
        a = f"blocks.{l}.attn."
        for phase, src, dst in (("pre", "scores", "scores_composed"), ("post", "pattern", "pattern_composed")):
            W = sd[f"layers.{l}.attention.dyn_w_proj.{phase}_proj.w"][0].astype(np.float64)
            np.testing.assert_allclose(
                sum(c[a + phase + "." + b] for b in ("skip", "qp", "kp", "qg", "kg", "static")),
                c[a + dst],
                atol=F64_ABS,
            )
            for t, s in [(4, 4), (19, 3), (2, 9)]:
                C = ref.ref_composition_map(c, l, phase, t, s, static=W)
                np.testing.assert_allclose(C.T @ c[a + src][:, t, s], c[a + dst][:, t, s], atol=F64_ABS)
        mask = ref.attention_mask(T, ref.Hyper(cfg).is_local(l), 8)
        assert np.all(c[a + "pattern_composed"][:, ~mask] == 0)


@pytest.mark.parametrize("hs,k", [(0, 2), (1, 2), (2, 1)])
def test_moh_routing(tmp, hs, k):
    sd, cfg = gen(tmp, f"moh{hs}{k}", moh={"shared_heads": hs, "routed_topk": k})
    lg, c = ref.ref_forward(sd, cfg, tokens(), cache=True)
    assert list(c) == ref.hook_names(cfg)
    g = c["blocks.0.attn.routing"]
    assert g.shape == (T, 4) and c["blocks.0.attn.router_logits"].shape == (T, 4 - hs)
    routed = g[:, hs:]
    assert np.all((routed > 0).sum(-1) == k)
    if hs == 0:
        np.testing.assert_allclose(routed.sum(-1), k, atol=F64_ABS)
    else:
        assert np.all(g[:, :hs] > 0)
    np.testing.assert_allclose(
        c["blocks.0.attn.head_out"].sum(1) + sd["layers.0.attention.wo.bias"], c["blocks.0.attn.out"], atol=F64_ABS
    )
    assert np.all(c["blocks.0.attn.z"][g == 0] == 0)  # unselected heads contribute nothing


# =========================================================================== writers

_ST_DT = {"F32": ("<f4", None), "F16": ("<f2", None), "BF16": ("<u2", "bf16")}


def read_safetensors_raw(path):
    """Minimal independent safetensors reader -> {name: float32 array}."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    assert n % 8 == 0
    header = json.loads(blob[8 : 8 + n])
    base = 8 + n
    out, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            assert info == {"format": "pt"}
            continue
        b, e = info["data_offsets"]
        npdt, kind = _ST_DT[info["dtype"]]
        a = np.frombuffer(blob[base + b : base + e], dtype=npdt).reshape(info["shape"])
        if kind == "bf16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a.astype(np.float32)
        end = max(end, e)
    assert base + end == len(blob)
    return out, header


class _StorageType:
    def __init__(self, name):
        self.name = name


_STORAGE_DT = {"FloatStorage": ("<f4", None), "HalfStorage": ("<f2", None), "BFloat16Storage": ("<u2", "bf16")}


class _Rebuilt:
    pass


def read_torch_zip(path):
    """Independent minimal torch-zip reader: zipfile + a restricted Unpickler.
    Returns ({name: float32 array}, {name: (storage key, offset)}, prefix, raw pickle)."""
    z = zipfile.ZipFile(path)
    assert z.testzip() is None  # CRCs
    pkl = [n for n in z.namelist() if n.endswith("/data.pkl")]
    assert len(pkl) == 1
    prefix = pkl[0][: -len("/data.pkl")]
    assert all(n.startswith(prefix + "/") for n in z.namelist())
    assert z.read(prefix + "/byteorder") == b"little"
    assert z.read(prefix + "/version") == b"3\n"
    storages, where = {}, {}

    def rebuild(storage, offset, size, stride, requires_grad, hooks, *rest):
        flat, key = storage
        r = _Rebuilt()
        itemsize = flat.dtype.itemsize
        r.array = np.lib.stride_tricks.as_strided(
            flat[offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride)
        ).copy()
        r.where = (key, offset)
        r.stride = tuple(stride)
        assert requires_grad is False and isinstance(hooks, OrderedDict) and not hooks
        return r

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("collections", "OrderedDict"):
                return OrderedDict
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return rebuild
            if module == "torch" and name in _STORAGE_DT:
                return _StorageType(name)
            raise pickle.UnpicklingError(f"global {module}.{name} not allowed")

        def persistent_load(self, pid):
            tag, st, key, loc, numel = pid
            assert tag == "storage" and loc == "cpu" and isinstance(st, _StorageType)
            if key not in storages:
                npdt, kind = _STORAGE_DT[st.name]
                a = np.frombuffer(z.read(f"{prefix}/data/{key}"), dtype=npdt)
                assert a.size == numel
                if kind == "bf16":
                    a = (a.astype(np.uint32) << 16).view(np.float32)
                storages[key] = (a.astype(np.float32), key)
            return storages[key]

    raw = z.read(prefix + "/data.pkl")
    obj = Restricted(io.BytesIO(raw)).load()
    assert isinstance(obj, dict)
    arrays = {k: v.array for k, v in obj.items()}
    where = {k: v.where for k, v in obj.items()}
    read_torch_zip.last_strides = {k: v.stride for k, v in obj.items()}
    return arrays, where, prefix, raw


def check_zip_layout(path):
    """Raw zip structure as torch writes it: 64-byte aligned data via an 'FB' local
    extra field, no extra in the central directory, data descriptors, zip64 EOCD."""
    blob = Path(path).read_bytes()
    z = zipfile.ZipFile(path)
    for info in z.infolist():
        off = info.header_offset
        sig, ver, flags, method, _, _, crc, csz, usz, nlen, xlen = struct.unpack("<IHHHHHIIIHH", blob[off : off + 30])
        assert sig == 0x04034B50 and method == 0 and flags == 0x0808 and ver == 0
        assert (crc, csz, usz) == (0, 0, 0)  # sizes in the data descriptor
        extra = blob[off + 30 + nlen : off + 30 + nlen + xlen]
        assert extra[:2] == b"FB" and struct.unpack("<H", extra[2:4])[0] == xlen - 4
        assert set(extra[4:]) <= {ord("Z")}
        data_start = off + 30 + nlen + xlen
        assert data_start % 64 == 0
        assert info.extra == b""  # central directory copy has no extra field
        dd = struct.unpack("<IIII", blob[data_start + info.file_size : data_start + info.file_size + 16])
        assert dd == (0x08074B50, info.CRC, info.file_size, info.file_size)
    assert blob[-22:-18] == b"PK\x05\x06" and blob[-42:-38] == b"PK\x06\x07"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shards", [1, 3])
def test_safetensors_roundtrip(tmp, dtype, shards):
    d = tmp / f"st_{dtype}_{shards}"
    sd, cfg = mt.make_tiny(str(d), dtype=dtype, shards=shards, extra_derived=True, seed=5)
    assert json.loads((d / "config.json").read_text()) == cfg and cfg["torch_dtype"] == dtype
    if shards == 1:
        files = ["model.safetensors"]
    else:
        index = json.loads((d / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        assert index["metadata"]["total_size"] == sum(v.size * (4 if dtype == "float32" else 2) for v in sd.values())
    got = {}
    for f in files:
        part, header = read_safetensors_raw(d / f)
        if shards > 1:
            assert all(index["weight_map"][k] == f for k in part)
        if dtype != "bfloat16":
            from safetensors.numpy import load_file

            pk = load_file(str(d / f))
            assert set(pk) == set(part)
            for k in pk:
                np.testing.assert_array_equal(pk[k].astype(np.float32), part[k])
        got.update(part)
    assert set(got) == set(sd)
    for k in sd:
        assert got[k].shape == sd[k].shape
        np.testing.assert_array_equal(got[k], sd[k])
        if dtype == "float16":
            np.testing.assert_array_equal(sd[k].astype(np.float16).astype(np.float32), sd[k])
        if dtype == "bfloat16":
            assert np.all(sd[k].view(np.uint32) & 0xFFFF == 0)


@pytest.mark.parametrize("model_type", ["dcpythia", "gpt_neox"])
def test_safetensors_writer_matches_package(tmp, model_type):
    """The fixture writer's bytes are the safetensors package's for the same tensors."""
    save_file = pytest.importorskip("safetensors.numpy").save_file
    a = tmp / f"stman_{model_type}"
    kw = dict(dtype="float16", extra_derived=True, seed=2)  # neox: F32 buffers mixed with F16
    mt.make_tiny(str(a), model_type, **kw)
    part, _ = read_safetensors_raw(a / "model.safetensors")
    f16 = {k: (v if k.endswith(("masked_bias", "inv_freq")) else v.astype(np.float16)) for k, v in part.items()}
    save_file(f16, str(tmp / f"stpkg_{model_type}.safetensors"), metadata={"format": "pt"})
    assert (a / "model.safetensors").read_bytes() == (tmp / f"stpkg_{model_type}.safetensors").read_bytes()


@pytest.mark.parametrize(
    "opts",
    [
        dict(dtype="float16", shards=2, fused_qkv=False, share_storage=True),
        dict(dtype="bfloat16", shards=1, extra_derived=True, pickle_container="ordereddict_meta"),
        dict(dtype="float32", shards=3, pickle_container="dict", torch_style="2.7", archive_name=None),
        dict(model_type="gpt_neox", dtype="float16", shards=2, extra_derived=True, share_storage=True),
        dict(dtype="float16", shards=2, torch_views="transpose", compose_groups=2, use_sw=True),
        dict(dtype="float32", shards=1, torch_views="expand", extra_derived=True),
    ],
)
def test_torch_zip_roundtrip(tmp, opts):
    opts = dict(opts)
    model_type = opts.pop("model_type", "dcpythia")
    d = tmp / ("pt_" + "_".join(f"{k}{v}" for k, v in opts.items()) + model_type)
    views = opts.get("torch_views")
    sd, cfg = mt.make_tiny(str(d), model_type, fmt="torch", seed=7, **opts)
    shards = opts["shards"]
    if shards == 1:
        files = ["pytorch_model.bin"]
    else:
        index = json.loads((d / "pytorch_model.bin.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert files == [f"pytorch_model-{i:05d}-of-{shards:05d}.bin" for i in range(1, shards + 1)]
    got, where = {}, {}
    for f in files:
        check_zip_layout(d / f)
        arrays, w, prefix, raw = read_torch_zip(d / f)
        expect_prefix = os.path.splitext(f)[0] if opts.get("archive_name", "archive") is None else "archive"
        assert prefix == expect_prefix
        names = zipfile.ZipFile(d / f).namelist()
        recs = [n[len(prefix) + 1 :] for n in names]
        assert recs[0] == "data.pkl" and recs[-2:] == ["version", ".data/serialization_id"]
        if opts.get("torch_style") == "2.7":
            assert recs[1:4] == [".format_version", ".storage_alignment", "byteorder"]
        else:
            assert recs[1] == "byteorder"
        if shards > 1:
            assert all(index["weight_map"][k] == f for k in arrays)
        keys = [r[len("data/") :] for r in recs if r.startswith("data/")]
        assert sorted(keys, key=int) == [str(i) for i in range(len(keys))]
        assert keys == (sorted(keys, key=int) if opts.get("torch_style") == "2.7" else sorted(keys))
        got.update(arrays)
        where.update({k: (f, v) for k, v in w.items()})
        assert raw[:2] == b"\x80\x02" and raw[-1:] == b"."
    assert list(got) == list(sd) or set(got) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(got[k], sd[k])
    if views:  # stored as strided views (the independent reader applies the strides)
        read_torch_zip(d / files[0])
        strides = list(read_torch_zip.last_strides.values())
        want = (1, 96) if views == "transpose" else (0,)
        assert any(st == want for st in strides), strides
    if opts.get("share_storage"):
        if model_type == "dcpythia":
            D = 32
            for kind, step in (("weight", D * D), ("bias", D)):
                ws = [where[f"layers.0.attention.{n}.{kind}"] for n in ("wq", "wk", "wv")]
                assert len({(f, key) for f, (key, _) in ws}) == 1  # one storage
                assert [off for _, (_, off) in ws] == [0, step, 2 * step]
            ln = "layers.1.ffn_norm."
        else:
            ln = "gpt_neox.layers.1.input_layernorm."
        (f1, (k1, o1)), (f2, (k2, o2)) = where[ln + "weight"], where[ln + "bias"]
        assert (f1, k1) == (f2, k2) and (o1, o2) == (0, 32)


def test_pickle_bytes_match_cpython_pickler(monkeypatch):
    """data.pkl is byte-identical to what CPython's protocol-2 pickler emits for the
    objects torch.save pickles (stand-in torch module with the same globals)."""
    torch = types.ModuleType("torch")
    tu = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*a):  # pragma: no cover - never called
        pass

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    tu._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch._utils = tu
    for nm in ("FloatStorage", "HalfStorage", "BFloat16Storage"):
        cls = type(nm, (), {})
        cls.__module__ = "torch"
        setattr(torch, nm, cls)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch._utils", tu)

    class Storage:
        def __init__(self, dtype, numel):
            self.dtype, self.numel = dtype, numel

    class Typed:  # Tensor._typed_storage() returns a fresh wrapper each time
        def __init__(self, st):
            self.st = st

    class Tensor:
        def __init__(self, t, st):
            self.t, self.st = t, st

        def __reduce_ex__(self, proto):
            t = self.t
            return (
                _rebuild_tensor_v2,
                (Typed(self.st), t.offset, tuple(list(t.shape)), tuple(list(t.stride)), False, OrderedDict()),
            )

    tensors = OrderedDict()
    for i in range(40):  # > 256 memo entries: LONG_BINPUT / LONG_BINGET
        tensors[f"layers.{i}.attention.w"] = mt.TorchTensor(("s", i // 3), "float16", 300, (i % 3) * 100, (10, 10))
    tensors["masked_bias"] = mt.TorchTensor("x", "float32", 1, 0, ())
    tensors["big"] = mt.TorchTensor("y", "bfloat16", 140000, 70000, (70000,))
    tensors["huge"] = mt.TorchTensor("z", "float32", 3_000_000_000, 0, (3_000_000_000,))

    for container in ("ordereddict", "dict", "ordereddict_meta"):
        stor, objs = {}, []
        for n, t in tensors.items():
            stor.setdefault(t.storage_id, Storage(t.dtype, t.storage_numel))
            objs.append((str(n), Tensor(t, stor[t.storage_id])))
        id_map = {}

        def persistent_id(obj, id_map=id_map):
            if isinstance(obj, Typed):
                key = id_map.setdefault(id(obj.st), str(len(id_map)))
                return ("storage", getattr(torch, mt._TORCH_STORAGE[obj.st.dtype]), key, "cpu", obj.st.numel)
            return None

        if container == "dict":
            top = dict(objs)
        else:
            top = OrderedDict(objs)
            if container == "ordereddict_meta":
                top._metadata = OrderedDict((p, dict(version=1)) for p in mt._module_metadata(tensors))
        buf = io.BytesIO()
        p = pickle.Pickler(buf, protocol=2)
        p.persistent_id = persistent_id
        p.dump(top)
        mine, keys = mt.pickle_state_dict(tensors, container=container)
        assert mine == buf.getvalue(), container
        assert list(keys.values()) == [str(i) for i in range(len(keys))]


def test_cli(tmp):
    out = tmp / "cli"
    args = [
        str(out),
        "--type",
        "dcpythia",
        "--dtype",
        "float16",
        "--format",
        "torch",
        "--shards",
        "2",
        "--no-fused-qkv",
        "--share-storage",
        "--window-type",
        "LGLL",
        "--n-layer",
        "4",
        "--query-wise",
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "bindings") + os.pathsep + env.get("PYTHONPATH", "")
    try:  # as documented when the package imports; else the file itself
        importlib.import_module("dclens.testing.make_tiny")
        cmd = [sys.executable, "-m", "dclens.testing.make_tiny"]
    except Exception:
        cmd = [sys.executable, MAKE_TINY_PATH]
    r = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["window_type"] == "LGLL" and cfg["query_wise"] is True and cfg["n_layer"] == 4
    assert cfg["torch_dtype"] == "float16"
    assert sorted(os.listdir(out)) == [
        "config.json",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
    ]
    sd, _ = mt.make_tiny(
        str(tmp / "cli_same"),
        "dcpythia",
        dtype="float16",
        fmt="torch",
        shards=2,
        fused_qkv=False,
        share_storage=True,
        window_type="LGLL",
        n_layer=4,
        query_wise=True,
    )
    got = {}
    for f in ("pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"):
        got.update(read_torch_zip(out / f)[0])
    assert set(got) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(got[k], sd[k])


def test_tokenizer_copy(tmp):
    tok = os.path.join(ROOT, "..", "shared", "data", "gpt-neox-20b-tokenizer.json")
    if not os.path.exists(tok):
        pytest.skip("shared tokenizer not available")
    d = tmp / "tok"
    mt.make_tiny(str(d), "gpt_neox", tokenizer=tok)
    assert (d / "tokenizer.json").read_bytes() == Path(tok).read_bytes()
    cfg = json.loads((d / "config.json").read_text())
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
        "rotary_pct",
        "rotary_emb_base",
        "layer_norm_eps",
        "use_parallel_residual",
        "hidden_act",
        "max_position_embeddings",
        "tie_word_embeddings",
        "torch_dtype",
        "architectures",
    ):
        assert key in cfg
    assert cfg["architectures"] == ["GPTNeoXForCausalLM"] and cfg["model_type"] == "gpt_neox"
