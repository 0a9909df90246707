"""The CUDA backend's 16-bit weights and its warp-per-row kernels (issue 39).

16-bit weights: `load(..., device="cuda", dtype="float16" | "bfloat16")` keeps the
weight matrices on the device in that type and runs each product with the
activations rounded to it (tensor cores, float32 accumulation). The CPU with the
same dtype keeps the same 16-bit weights but multiplies float32 activations, so
the two differ by the rounding of the products' inputs: about 2^-11 (float16) and
2^-8 (bfloat16) relative per product, a few of them in series per layer. TOL16
allows a few times that, relative to max |logit|.

Warp-per-row kernels: DCLENS_CUDA_KERNELS=new at load (read when the backend is
created) runs cuda_rows.cuh's LayerNorm / softmax kernels and pinned hook
staging; they must agree with the CPU as the default kernels do (test_cuda.py's
TOL). scripts/gpu_check.sh also runs the C kernel tests both ways.

Every GPU test is skipped where there is no GPU (the engine's reason).
"""

import warnings

import numpy as np
import pytest

import dclens

from conftest import rel_err
from tolerances import forward_tol, tiny

HAVE_GPU = dclens.cuda_available()
needs_gpu = pytest.mark.skipif(
    not HAVE_GPU, reason="no GPU: %s" % ("" if HAVE_GPU else dclens.cuda_unavailable_reason())
)

TOL = forward_tol(tiny(dim=256, n_layer=4, vocab_size=1000), 64, 8 * 64 * 1000, sides=2)
TOL16 = {"float16": 2e-2, "bfloat16": 1e-1}

KW = dict(model_type="dcpythia", n_layer=4, dim=256, n_head=8, vocab=1000, window_size=16, seed=41)


def _toks(vocab, B=2, T=40):
    return np.random.default_rng(5).integers(0, vocab, size=(B, T))


@needs_gpu
def test_auto_is_float32_on_cuda(tiny_factory):
    d, _, _ = tiny_factory(**dict(KW, dtype="bfloat16"))
    assert dclens.load(d, device="cuda").dtype == "float32"  # the verified path stays the default
    assert dclens.load(d, device="cuda", dtype="auto").dtype == "float32"
    assert dclens.load(d, device="cpu").dtype == "bfloat16"


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("stored", ["float32", "stored"])
def test_16bit_logits_and_hooks_match_cpu(tiny_factory, dtype, stored):
    d, _, _ = tiny_factory(**dict(KW, dtype=dtype if stored == "stored" else "float32"))
    cpu = dclens.load(d, dtype=dtype)
    gpu = dclens.load(d, device="cuda", dtype=dtype)
    assert gpu.dtype == cpu.dtype == dtype
    toks = _toks(cpu.config.vocab)
    want, cw = cpu.run_with_cache(toks)
    got, cg = gpu.run_with_cache(toks)
    assert got.dtype == np.float32 and rel_err(got, want) <= TOL16[dtype]
    for name in cw:
        assert cg[name].dtype == np.float32
        assert rel_err(cg[name], cw[name]) <= TOL16[dtype], name
    # the weights read back are the kept 16-bit values, exactly
    for name in ("layers.0.attention.wqkv.weight", "tok_embeddings.weight", "output.weight"):
        np.testing.assert_array_equal(gpu.weight(name), cpu.weight(name))


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_gradients_match_cpu(tiny_factory, dtype):
    d, _, _ = tiny_factory(**KW)
    cpu = dclens.load(d, dtype=dtype)
    gpu = dclens.load(d, device="cuda", dtype=dtype)
    toks = _toks(cpu.config.vocab, B=1, T=24)[0]
    wrt = ["blocks.0.resid_pre", "blocks.2.attn.pattern", "layers.1.attention.wo.weight"]
    gc = cpu.gradients(toks, ("logit", 23, 7), wrt)
    gg = gpu.gradients(toks, ("logit", 23, 7), wrt)
    for k in wrt:
        assert np.isfinite(gg[k]).all() and rel_err(gg[k], gc[k]) <= 2 * TOL16[dtype], k


@needs_gpu
def test_16bit_model_stays_usable_after_a_failed_pass(tiny_factory):
    d, _, _ = tiny_factory(**KW)
    gpu = dclens.load(d, device="cuda", dtype="bfloat16")
    toks = _toks(gpu.config.vocab)
    want = gpu.forward(toks)
    with pytest.raises(dclens.Error):
        gpu.run_with_hooks(toks, fwd_hooks=[("blocks.1.attn.z", lambda a, hook: 1 / 0)])
    np.testing.assert_array_equal(gpu.forward(toks), want)


@needs_gpu
@pytest.mark.parametrize(
    "kw",
    [
        KW,
        dict(model_type="dcpythia", n_layer=4, window_type="LGLL", window_size=4, seed=22),
        dict(model_type="gpt_neox", n_layer=2, dim=256, n_head=8, vocab=1000, seed=27),
        dict(
            model_type="dcformer", n_layer=4, window_type="LGLL", window_size=4, intermediate=64, mgate_dim=4, seed=30
        ),
    ],
    ids=["dcp", "dcp-lgll", "neox", "dcformer"],
)
def test_new_row_kernels_match_cpu(tiny_factory, monkeypatch, kw):
    d, _, _ = tiny_factory(**kw)
    cpu = dclens.load(d)
    monkeypatch.setenv("DCLENS_CUDA_KERNELS", "new")
    gpu = dclens.load(d, device="cuda")
    toks = _toks(cpu.config.vocab, B=2, T=33)
    want, cw = cpu.run_with_cache(toks)
    got, cg = gpu.run_with_cache(toks)
    assert rel_err(got, want) <= TOL
    for name in cw:
        assert rel_err(cg[name], cw[name]) <= TOL, name
    # hooks that write go through the pinned staging buffer and back
    half = [("blocks.0.attn.pattern", lambda a, hook: a * 0.5), ("blocks.1.mlp.out", lambda a, hook: a + 1.0)]
    assert rel_err(gpu.run_with_hooks(toks, fwd_hooks=half), cpu.run_with_hooks(toks, fwd_hooks=half)) <= TOL
    wrt = ["blocks.0.resid_pre", "blocks.1.attn.pattern"]
    gc = cpu.gradients(toks[0], ("logit", 32, 3), wrt)
    gg = gpu.gradients(toks[0], ("logit", 32, 3), wrt)
    for k in wrt:
        assert rel_err(gg[k], gc[k]) <= 10 * TOL, k


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_memory_exhausted_mid_pass(tiny_factory, dtype):
    """A pass that cannot fit on the device: an Error that says what frees memory; the model stays usable."""
    d, _, _ = tiny_factory(**KW)
    gpu = dclens.load(d, device="cuda", dtype=dtype)
    toks = _toks(gpu.config.vocab)
    want = gpu.forward(toks)
    big = np.zeros((64, 16384), dtype=np.int64)  # one [64, 8, 16384, 16384] map: 512 GiB
    with pytest.raises(dclens.Error) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ContextWarning: past the trained context
        gpu.forward(big, logits_at=16383)
    assert "smaller batch" in str(e.value) or "memory" in str(e.value)
    np.testing.assert_array_equal(gpu.forward(toks), want)


@needs_gpu
def test_training_a_16bit_cuda_model_is_refused(tiny_factory):
    """Training updates float32 weights: a model keeping 16-bit weights on the device says how to load it."""
    from dclens._engine import lib

    d, _, _ = tiny_factory(**KW)
    gpu = dclens.load(d, device="cuda", dtype="bfloat16")
    assert lib.dcs_model_make_trainable(gpu.runner.handle) != 0
    assert "dtype='float32'" in gpu.runner.errmsg()
    toks = _toks(gpu.config.vocab)
    assert np.isfinite(gpu.forward(toks)).all()  # still usable
