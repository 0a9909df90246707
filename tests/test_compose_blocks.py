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
    """the fused backward runs the unfused one's per-row arithmetic: the same bits"""
    m, sd, cfg, toks, params = _setup(tiny_factory)
    names = params + ["layers.1.attention.dyn_w_proj.qkw", "tok_embeddings.weight"]
    for target in [("loss",), ("logprob", T - 1, 3)]:
        fused = m.gradients(toks, target, names)
        for hook in ["blocks.0.attn.pattern", "blocks.0.attn.scores_composed", "blocks.0.attn.pre.kp"]:
            unfused = m.gradients(toks, target, names + [hook])
            for n in names:
                assert np.array_equal(fused[n], unfused[n]), (hook, n)
