"""The CPU compose backward's row kernel runs the keys in aligned blocks of 16
(zero-padded, engine/src/backends/cpu_backward.c, compose_row_bw): a sequence
long enough for several blocks, T not a multiple of 16 (a partial last block)
and a window that starts rows past the first block (S0 > 0), against central
differences of the independent float64 reference (tolerances as test_grad.py)."""

import numpy as np

import dclens
from test_grad import check_hook_gradients, check_param_gradients


def test_compose_blocks_match_finite_differences(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="dcpythia", vocab=24, window_size=19)
    m = dclens.load(d)
    rng = np.random.default_rng(29)
    toks = rng.integers(0, 24, 41)  # blocks [0, 16) [16, 32) [32, 48); row 40 keys 21..40
    target = ("logprob", 40, 3)
    hooks = [n for n in m.hook_names if n.startswith("blocks.0.attn.") and (".dyn." in n or n.endswith((".scores", ".pattern")))]
    params = [n for n in sd if n.startswith("layers.0.attention.dyn")]
    assert hooks and params
    g = m.gradients(toks, target, hooks + params)
    check_hook_gradients(m, sd, cfg, toks, target, g, rng, hooks, picks=2)
    check_param_gradients(sd, cfg, toks, target, g, rng, params)
