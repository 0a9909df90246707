"""The CPU compose backward's row kernel runs the keys in aligned blocks of 16
(zero-padded, engine/src/backends/cpu_backward.c, compose_row_bw), and with no
hook between the two compose phases the post-compose, softmax and pre-compose
backward run fused row by row (compose_softmax_bw). A sequence long enough for
several blocks, T not a multiple of 16 (a partial last block) and a window that
starts rows past the first block (S0 > 0), against central differences of the
independent float64 reference (tolerances as test_grad.py)."""

import numpy as np

import dclens

from test_grad import check_hook_gradients, check_param_gradients

T = 41  # blocks [0, 16) [16, 32) [32, 48); with window 19 row 40 has keys 21..40


def _setup(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="dcpythia", vocab=24, window_size=19)
    m = dclens.load(d)
    toks = np.random.default_rng(29).integers(0, 24, T)
    params = [n for n in sd if n.startswith("layers.0.attention.dyn")]
    assert params and m.config.use_dcmha
    return m, sd, cfg, toks, params


def test_compose_blocks_match_finite_differences(tiny_factory):
    m, sd, cfg, toks, params = _setup(tiny_factory)
    rng = np.random.default_rng(29)
    target = ("logprob", T - 1, 3)
    # hooks between the phases: the unfused path
    hooks = [
        n
        for n in m.hook_names
        if n.startswith("blocks.0.attn.") and (".dyn." in n or n.endswith((".scores", ".pattern")))
    ]
    g = m.gradients(toks, target, hooks + params)
    check_hook_gradients(m, sd, cfg, toks, target, g, rng, hooks, picks=2)
    check_param_gradients(sd, cfg, toks, target, g, rng, params, what="unfused")
    # parameters alone: the fused path
    gf = m.gradients(toks, target, params)
    check_param_gradients(sd, cfg, toks, target, gf, rng, params, what="fused")


def test_fused_maps_backward_same_bits(tiny_factory):
    """the fused backward runs the unfused one's per-row arithmetic: the same bits
    (layer 0's attention through the maps: its scores' gradient asked, so not by
    query blocks, attention_bw)"""
    m, sd, cfg, toks, params = _setup(tiny_factory)
    names = params + ["layers.1.attention.dyn_w_proj.qkw", "tok_embeddings.weight"]
    for target in [("loss",), ("logprob", T - 1, 3)]:
        fused = m.gradients(toks, target, names + ["blocks.0.attn.scores"])
        for hook in ["blocks.0.attn.pattern", "blocks.0.attn.scores_composed", "blocks.0.attn.pre.kp"]:
            unfused = m.gradients(toks, target, names + ["blocks.0.attn.scores", hook])
            for n in names:
                assert np.array_equal(fused[n], unfused[n]), (hook, n)


def test_attention_backward_by_query_blocks(tiny_factory):
    """the attention backward by blocks of 32 query rows (attention_bw: the
    gradient maps only in its scratch, dk and dv summed block by block), with a
    block whose keys start past the first 16 (T 80, window 19: rows 64..79 see
    keys from 45): against central differences of the float64 reference, within
    float32 rounding of the path through the maps, and the same bits at 1, 2 and
    3 threads"""
    d, sd, cfg = tiny_factory(model_type="dcpythia", vocab=24, window_size=19)
    toks = np.random.default_rng(31).integers(0, 24, 80)
    names = [n for n in sd if n.startswith("layers.0.attention.")] + ["tok_embeddings.weight"]
    target = ("logprob", 79, 3)
    by_threads = [dclens.load(d, n_threads=k).gradients(toks, target, names) for k in (1, 2, 3)]
    g = by_threads[0]
    for other in by_threads[1:]:
        for n in names:
            assert np.array_equal(g[n], other[n]), n
    check_param_gradients(sd, cfg, toks, target, g, np.random.default_rng(31), names[:6], what="by blocks")
    m = dclens.load(d)
    maps = m.gradients(toks, target, names + ["blocks.%d.attn.scores" % l for l in range(cfg["n_layer"])])
    for n in names:  # float32 sums in another order: a few units in the last place of the largest
        scale = np.abs(maps[n]).max()
        assert np.abs(g[n] - maps[n]).max() <= 1e-5 * scale + 1e-30, n


def test_kept_maps_read_only_where_written(tiny_factory):
    """the tape's fused forward writes the kept scores (and, composed, the pattern
    before the post-compose) only where the backward reads them: a tape whose
    maps hold other values at the masked pairs (a forward through the maps with
    its scores overridden by large values, then one at a shorter T, which lays
    rows out at another stride) gives the same bits as a fresh tape"""
    from dclens._core.tapes import Tape

    d, sd, cfg = tiny_factory(model_type="dcpythia", vocab=24, window_size=19)
    m = dclens.load(d)
    B = 2
    rng = np.random.default_rng(41)
    toks = rng.integers(0, 24, (B, T))
    dl = rng.standard_normal((B, T, 24)).astype(np.float32)
    wrt = [m.parse_hook("blocks.0.resid_pre")]
    fresh = Tape(m, B, T)
    fresh.forward(toks, logits=False)
    want = fresh.backward(dl, None, wrt)[wrt[0]]
    tp = Tape(m, B, T)
    ov = {}
    for l in range(cfg["n_layer"]):
        p = m.parse_hook("blocks.%d.attn.scores" % l)
        ov[p] = 1e4 * rng.standard_normal(tp._shape(p[0])).astype(np.float32)
    tp.forward(toks, overrides=ov, logits=False)
    tp.backward(dl, None, wrt)
    tp.reshape(B, 30)
    tp.forward(toks[:, :30], logits=False)
    tp.backward(dl[:, :30], None, wrt)
    tp.reshape(B, T)
    tp.forward(toks, logits=False)
    got = tp.backward(dl, None, wrt)[wrt[0]]
    assert np.array_equal(got, want)
