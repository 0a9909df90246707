"""CUDA backend against the CPU backend: logits, every hook, hook writes.

Every GPU test is skipped (with the engine's reason) where dclens was built
without CUDA or no GPU is usable; the one test that needs no GPU checks that
asking for device="cuda" there fails with an informative error.

Tolerance: max |cuda - cpu| <= TOL * max |cpu|, per tensor (both backends
are float32; they differ only in summation order and libm ulps): the error
model of tests/tolerances.py for the largest case here ("mid-dcp": D 256,
F 1024, 4 layers, every activation of a pass), both sides; libm's few ulps
per transcendental are inside the per-stage gain COND.
"""

import numpy as np
import pytest

import dclens

from conftest import rel_err
from tolerances import forward_tol, tiny

TOL = forward_tol(tiny(dim=256, n_layer=4, vocab_size=1000), 64, 8 * 64 * 1000, sides=2)

HAVE_GPU = dclens.cuda_available()
WHY = "" if HAVE_GPU else dclens.cuda_unavailable_reason()
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no GPU: %s" % WHY)

MODELS = {
    # name: (make_tiny kwargs, batch, seq len)
    "tiny-dcp": (dict(model_type="dcpythia", seed=21), 2, 13),
    "tiny-dcp-lgll-window4": (
        dict(model_type="dcpythia", n_layer=4, window_type="LGLL", window_size=4, seed=22),
        2,
        17,
    ),
    "tiny-dcp-query-wise": (dict(model_type="dcpythia", query_wise=True, window_size=4, seed=23), 2, 11),
    "tiny-dcp-f16-serial": (
        dict(model_type="dcpythia", dtype="float16", use_parallel_residual=False, window_size=4, seed=24),
        1,
        12,
    ),
    "tiny-neox": (dict(model_type="gpt_neox", seed=25), 2, 13),
    # attention variants (docs/variants.md)
    "tiny-dcp-static-groups": (
        dict(model_type="dcpythia", use_sw=True, compose_groups=2, window_size=4, seed=28),
        2,
        13,
    ),
    "tiny-dcp-key-wise-moh": (
        dict(
            model_type="dcpythia", key_wise=True, window_size=None, moh={"shared_heads": 1, "routed_topk": 2}, seed=29
        ),
        2,
        13,
    ),
    # DCFormer++ (docs/dcformer-spec.md): RMSNorm, SwiGLU with the group gate, full-width rotary
    "tiny-dcformer-lgll-mgate": (
        dict(
            model_type="dcformer", n_layer=4, window_type="LGLL", window_size=4, intermediate=64, mgate_dim=4, seed=30
        ),
        2,
        15,
    ),
    "mid-dcp": (dict(model_type="dcpythia", n_layer=4, dim=256, n_head=8, vocab=1000, window_size=16, seed=26), 2, 70),
    "mid-neox": (dict(model_type="gpt_neox", n_layer=4, dim=256, n_head=8, vocab=1000, seed=27), 2, 70),
}


@pytest.fixture(scope="module")
def pair_factory(tiny_factory):
    """name -> (cpu model, cuda model, tokens [B, T]), loaded once per module."""
    loaded = {}

    def get(name):
        if name not in loaded:
            kw, B, T = MODELS[name]
            d, _sd, _cfg = tiny_factory(**kw)
            cpu = dclens.load(d, device="cpu")
            gpu = dclens.load(d, device="cuda")
            rng = np.random.default_rng(len(name))
            toks = rng.integers(0, cpu.config.vocab, size=(B, T))
            loaded[name] = (cpu, gpu, toks)
        return loaded[name]

    return get


def test_cuda_unavailable_is_reported():
    """Without a GPU (or a CUDA build), device='cuda' fails and says why."""
    if HAVE_GPU:
        pytest.skip("a GPU is present")
    assert isinstance(WHY, str) and WHY, "cuda_unavailable_reason() gave no reason"
    assert dclens.cuda_available() is False


def test_cuda_load_error_names_the_reason(tiny_factory):
    if HAVE_GPU:
        pytest.skip("a GPU is present")
    d, _sd, _cfg = tiny_factory(model_type="dcpythia", seed=21)
    with pytest.raises(dclens.Error) as ei:
        dclens.load(d, device="cuda")
    msg = str(ei.value)
    assert "cuda" in msg.lower() and "not available" in msg


@needs_gpu
@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_cpu(pair_factory, name):
    cpu, gpu, toks = pair_factory(name)
    want = cpu.forward(toks)
    got = gpu.forward(toks)
    assert got.shape == want.shape and got.dtype == np.float32
    assert rel_err(got, want) <= TOL
    # unbatched call, and one sequence alone
    assert rel_err(gpu.forward(toks[0]), cpu.forward(toks[0])) <= TOL


@needs_gpu
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_hook_matches_cpu(pair_factory, name):
    cpu, gpu, toks = pair_factory(name)
    lc, cc = cpu.run_with_cache(toks)
    lg, cg = gpu.run_with_cache(toks)
    assert rel_err(lg, lc) <= TOL
    names = cpu.hook_names
    names = names() if callable(names) else names
    assert set(cg) == set(cc) == set(names)
    bad = []
    for k in sorted(cc):
        a, b = cg[k], cc[k]
        if a.shape != b.shape or a.dtype != np.float32:
            bad.append("%s: shape %s vs %s" % (k, a.shape, b.shape))
        elif not np.all(np.isfinite(a)) or rel_err(a, b) > TOL:
            bad.append("%s: rel err %.3g" % (k, rel_err(a, b)))
    assert not bad, "hooks differ between cuda and cpu:\n" + "\n".join(bad)


@needs_gpu
@pytest.mark.parametrize("name", ["tiny-dcp-lgll-window4", "mid-dcp"])
def test_masked_pattern_entries_are_zero_on_gpu(pair_factory, name):
    cpu, gpu, toks = pair_factory(name)
    _, cg = gpu.run_with_cache(toks, names=lambda n: n.endswith("pattern_composed"))
    T = toks.shape[1]
    upper = np.triu(np.ones((T, T), bool), k=1)
    for k, v in cg.items():
        assert np.all(v[..., upper] == 0), k


@needs_gpu
def test_gpu_is_deterministic(pair_factory):
    _cpu, gpu, toks = pair_factory("mid-dcp")
    assert np.array_equal(gpu.forward(toks), gpu.forward(toks))


def _zero(act, name):
    act[...] = 0


def _halve(act, name):
    return act * 0.5


HOOK_WRITES = [
    # (model, hook, fn)
    ("tiny-dcp", "blocks.0.attn.post.kp", _zero),  # the example
    ("mid-dcp", "blocks.0.attn.post.kp", _zero),
    ("mid-dcp", "blocks.1.attn.pre.qg", _halve),
    ("mid-dcp", "blocks.2.attn.pattern", _halve),
    ("mid-dcp", "blocks.1.attn.pattern_composed", _halve),
    ("mid-dcp", "blocks.0.attn.dyn.post.qw1", _zero),
    ("mid-dcp", "blocks.3.attn.head_out", _halve),
    ("mid-dcp", "blocks.1.mlp.post", _halve),
    ("mid-dcp", "blocks.2.resid_pre", _halve),
    ("mid-dcp", "embed", _halve),
    ("tiny-dcp-query-wise", "blocks.0.attn.post.qp", _zero),
    ("mid-neox", "blocks.1.attn.pattern", _halve),
    ("mid-neox", "blocks.0.attn.z", _zero),
]


@needs_gpu
@pytest.mark.parametrize("name,hook,fn", HOOK_WRITES, ids=["%s:%s" % (m, h) for m, h, _ in HOOK_WRITES])
def test_hook_write_matches_cpu(pair_factory, name, hook, fn):
    cpu, gpu, toks = pair_factory(name)
    want = cpu.run_with_hooks(toks, fwd_hooks=[(hook, fn)])
    got = gpu.run_with_hooks(toks, fwd_hooks=[(hook, fn)])
    assert rel_err(got, want) <= TOL
    # the write really reached the device: the result moved away from the plain pass
    plain = gpu.forward(toks)
    assert rel_err(got, plain) > TOL, "hook %s had no effect on the cuda pass" % hook


@needs_gpu
def test_hook_write_then_cache_matches_cpu(pair_factory):
    """Zeroing post.kp of layer 0: the hooked pass's downstream hooks agree too."""
    cpu, gpu, toks = pair_factory("mid-dcp")
    hooks = [("blocks.0.attn.post.kp", _zero)]
    names = ["blocks.0.attn.post.kp", "blocks.0.attn.pattern_composed", "blocks.1.attn.pattern", "logits"]
    lc, cc = cpu.run_with_hooks(toks, fwd_hooks=hooks, cache_names=names)
    lg, cg = gpu.run_with_hooks(toks, fwd_hooks=hooks, cache_names=names)
    assert rel_err(lg, lc) <= TOL
    assert not np.any(cg["blocks.0.attn.post.kp"])
    for k in names:
        assert rel_err(cg[k], cc[k]) <= TOL, k
