"""The fast CPU path (issue 12): fused attention equals the full path,
F16/BF16 weights kept as stored match the reference, logits_at, threads.

Fused vs full: a no-op hook on a layer's attn.scores forces that layer onto
the full (materialising) path; with one on every layer the whole pass is the
full path, compared with the plain (all fused) pass.
F16/BF16: make_tiny returns the weights exactly as stored (rounded to the
file's dtype), and tests/reference.py runs in float64 on those rounded
values; the engine keeps the 16-bit matrices and widens them per tile inside
the GEMM, so the only difference left is float32 arithmetic (same tolerance
as the float32 parity tests).

Tolerances (tests/tolerances.py): fused vs full are two float32 passes that
sum in different orders (blocked online softmax vs materialised scores, and
whatever the BLAS kernel does), so both carry an error: forward_tol(...,
sides=2), from the longest reduction max(D, F, T), the pass's depth and the
number of logits. Against the float64 reference only the engine's error
counts (sides=1).
"""

import numpy as np
import pytest

import dclens

from conftest import rel_err
from reference import ref_forward
from tolerances import f32_tol, forward_tol

CASES = {
    "dcp-global-local": dict(model_type="dcpythia", n_layer=4, window_type="LGLL", window_size=5, seed=21),
    "dcp-window-null": dict(model_type="dcpythia", window_size=None, seed=22),
    "dcp-query-wise": dict(model_type="dcpythia", query_wise=True, window_size=6, seed=23),
    "dcp-no-dcmha": dict(model_type="dcpythia", use_dcmha=False, window_size=4, seed=24),
    "neox": dict(model_type="gpt_neox", seed=25),
    "dcp-f16": dict(model_type="dcpythia", dtype="float16", window_size=7, seed=26),
}


def _full_path(model, toks):
    """Logits with every layer on the full path (a no-op hook on its scores)."""
    hooks = [("blocks.%d.attn.scores" % l, lambda a, n: None) for l in range(model.config.n_layer)]
    return model.run_with_hooks(toks, fwd_hooks=hooks)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_equals_full(tiny_factory, name):
    d, sd, cfg = tiny_factory(**CASES[name])
    model = dclens.load(d)
    toks = np.random.default_rng(3).integers(0, model.config.vocab, size=(3, 75))  # > 2 query blocks
    fused = model.forward(toks)
    full = _full_path(model, toks)
    # two float32 summation orders: the bound of each, twice (was 2e-6, one kernel's result)
    assert rel_err(fused, full) <= forward_tol(cfg, toks.shape[1], fused.size, sides=2)
    for b in range(3):  # engine float32 vs float64 reference
        assert rel_err(fused[b], ref_forward(sd, cfg, toks[b])) <= forward_tol(cfg, toks.shape[1], fused[b].size)


def test_one_hooked_layer_mixes_paths(tiny_factory):
    d, sd, cfg = tiny_factory(**CASES["dcp-global-local"])
    model = dclens.load(d)
    toks = np.random.default_rng(4).integers(0, model.config.vocab, size=(2, 70))
    logits, cache = model.run_with_cache(toks, names=["blocks.1.attn.pattern_composed", "blocks.2.attn.z"])
    # layer 1 on the full path, the others fused, vs all fused: two summation orders
    assert rel_err(logits, model.forward(toks)) <= forward_tol(cfg, 70, logits.size, sides=2)
    assert cache["blocks.1.attn.pattern_composed"].shape == (2, model.config.n_head, 70, 70)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mt", ["dcpythia", "gpt_neox"])
def test_16bit_weights_kept_match_reference(tiny_factory, dtype, mt):
    """Weights widened per tile in the GEMM (several tiles per matrix here)."""
    d, sd, cfg = tiny_factory(model_type=mt, dtype=dtype, dim=64, n_head=4, intermediate=1024, window_size=8, seed=27)
    model = dclens.load(d)
    toks = np.random.default_rng(5).integers(0, model.config.vocab, size=40)
    # the reference runs on the rounded 16-bit values: only float32 arithmetic differs
    assert rel_err(model.forward(toks), ref_forward(sd, cfg, toks)) <= forward_tol(cfg, 40, 40 * cfg["vocab_size"])
    # the weights read back are the stored (rounded) values, exactly
    assert np.array_equal(
        model.weight("layers.0.feed_forward.w1.weight"),
        sd["layers.0.feed_forward.w1.weight"] if mt == "dcpythia" else sd["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"],
    )


def test_16bit_unfused_qkv(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="dcpythia", dtype="float16", fused_qkv=False, seed=28)
    toks = np.arange(30) % cfg["vocab_size"]
    assert rel_err(dclens.load(d).forward(toks), ref_forward(sd, cfg, toks)) <= forward_tol(
        cfg, 30, 30 * cfg["vocab_size"]
    )


def test_logits_at(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="dcpythia", window_size=4, seed=29)
    model = dclens.load(d)
    toks = np.random.default_rng(6).integers(0, model.config.vocab, size=(3, 20))
    full = model.forward(toks)
    # same values up to float32 summation order: the unembedding GEMM (length D)
    # has fewer rows, so its kernel may block differently; what comes before it
    # is the same pass. One reduction of length D, two sides.
    tol = f32_tol(cfg["dim"], 1, full.size, sides=2)
    _same = lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=tol * np.abs(full).max())
    _same(model.forward(toks, logits_at="last"), full[:, -1])
    _same(model.forward(toks[0], logits_at="last"), full[0, -1])
    _same(model.forward(toks, logits_at=5), full[:, 5])
    _same(model.forward(toks, logits_at=[0, 7, 19]), full[:, [0, 7, 19]])
    pos = np.array([[1, 2], [19, 0], [3, 3]])
    got = model.forward(toks, logits_at=pos)
    assert got.shape == (3, 2, model.config.vocab)
    for b in range(3):
        _same(got[b], full[b, pos[b]])
    # with the final hooks asked for, the full unembedding runs and rows are gathered
    lg, cache = model.runner.run(toks, capture=["logits"], logits_at=pos)
    _same(lg[1], full[1, pos[1]])
    _same(cache["logits"], full)


@pytest.mark.parametrize("bad", ["first", 20, -1, [[1], [2]], np.zeros((3, 21), int), [0.5], []])
def test_logits_at_bad(tiny_factory, bad):
    d, _, _ = tiny_factory(model_type="dcpythia", window_size=4, seed=29)
    model = dclens.load(d)
    toks = np.zeros((3, 20), int)
    with pytest.raises(dclens.Error, match="logits_at"):
        model.forward(toks, logits_at=bad)


def test_two_models_different_thread_counts(tiny_factory):
    """Each model has its own pool; OpenBLAS runs single-threaded inside the
    pools, so one model's setting does not change the other's results."""
    d, sd, cfg = tiny_factory(model_type="dcpythia", window_size=16, seed=12, intermediate=2048)
    m1, m2 = dclens.load(d, n_threads=1), dclens.load(d, n_threads=2)
    toks = np.random.default_rng(7).integers(0, m1.config.vocab, size=(2, 150))
    a, b = m1.forward(toks), m2.forward(toks)
    # the pool splits work by the shape alone (never by the thread count) and OpenBLAS runs
    # single-threaded in it: every thread count computes the same bits
    assert np.array_equal(a, b)
    assert rel_err(a[0], ref_forward(sd, cfg, toks[0])) <= forward_tol(cfg, 150, a[0].size)
    m3 = dclens.load(d, n_threads=3)  # loading another changes neither; 3 threads give the same bits
    assert np.array_equal(m1.forward(toks), a)
    assert np.array_equal(m3.forward(toks), a)
    del m3


@pytest.mark.parametrize("name", ["dcpythia-tiny", "pythia-tiny"])
def test_thread_count_does_not_change_results(name):
    """The bundled twins (float16 weights: the per-tile widening GEMM, gemm_w) on a
    benchmark-sized batch: the pool's GEMM blocks and weight tiles depend on the shape
    alone, so logits and captured activations are the same bits with 1, 2, 3 and 16 threads
    (a Ray worker of 1 thread equals a 2-thread run). Before, 3 threads cut the products
    differently and the logits moved by ~2e-5."""
    toks = np.random.default_rng(3).integers(0, 2000, size=(4, 250))
    runs = [
        dclens.load(name, n_threads=n).run_with_cache(toks, names=lambda n: "pattern" in n or "mlp.out" in n)
        for n in (1, 2, 3, 16)
    ]
    for logits, cache in runs[1:]:
        assert np.array_equal(logits, runs[0][0])
        assert all(np.array_equal(cache[k], runs[0][1][k]) for k in cache)


@pytest.mark.parametrize("name", ["dcp-global-local", "dcp-window-null"])
def test_compose_rank2_loops_same_bits(tiny_factory, name):
    """The compose's fused rank-2 loops (dcs_compose_pre_r2/post_r2, taken
    when no compose branch is hooked) against its general loops (taken when
    one is: a no-op hook on pre.qp and post.qp): the same float operations in
    the same order per element, so the same bits (issue 28). Both passes run
    the full path (a no-op hook on the scores of every layer)."""
    d, sd, cfg = tiny_factory(**CASES[name])
    model = dclens.load(d)
    assert model.config.dyn_rank == 2
    toks = np.random.default_rng(5).integers(0, model.config.vocab, size=(2, 40))
    L = model.config.n_layer
    noop = lambda a, n: None  # noqa: E731
    scores = [("blocks.%d.attn.scores" % l, noop) for l in range(L)]
    branches = [("blocks.%d.attn.%s.qp" % (l, ph), noop) for l in range(L) for ph in ("pre", "post")]
    fast = model.run_with_hooks(toks, fwd_hooks=scores)
    general = model.run_with_hooks(toks, fwd_hooks=scores + branches)
    assert np.array_equal(fast, general)
