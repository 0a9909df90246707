"""Gradients of the section-5 variants (model-spec.md 5: static Talking-Heads
branch, grouped composition, key-wise only, Mixture-of-Head routing) against
central differences of the float64 reference (tests/reference.py) on the
checkpoint's own rounded weights; the same bits with recomputation.

MoH: the top-k selection is discrete; the gradient flows through the routing
scores of the selected heads. The central differences here move no logit
across a selection boundary (eps 1e-4 on random weights; a crossing would
show as a mismatch, not pass silently).
"""
import warnings

import numpy as np
import pytest

import dclens
from test_grad import check_hook_gradients, check_param_gradients
from test_variants import BASE, VARIANTS

NAMES = ["key_wise", "static-derived-f16-torch", "talking-heads", "groups2", "groups4-static-qw",
         "groups2-key_wise", "moh-hs0", "moh-hs1", "moh-hs2-static", "moh-no-dcmha"]


def _make(tiny_factory, name):
    kw = dict(BASE)
    kw.update(VARIANTS[name])
    kw["vocab"] = 24
    d, sd, cfg = tiny_factory(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dclens.LoadWarning)
        return dclens.load(d), sd, cfg


@pytest.mark.parametrize("name", NAMES)
def test_variant_gradients_match_finite_differences(tiny_factory, name):
    m, sd, cfg = _make(tiny_factory, name)
    rng = np.random.default_rng(11)
    toks = rng.integers(0, 24, 7)
    target = ("logprob", 5, 3)
    names = m.hook_names
    from dclens.grad import param_table
    params = [r[0] for r in param_table(m) if r[0] in sd]
    if m.config.use_dcmha or m.config.moh_shared_heads is not None:   # its own parameters are among them
        assert any(p.endswith(("pre_proj.w", "post_proj.w", "dyn_w_proj.qkw")) or "moh" in p or "gate" in p
                   for p in params), params
    g = m.gradients(toks, target, names + params)
    check_hook_gradients(m, sd, cfg, toks, target, g, rng, names, picks=2, what=name)
    check_param_gradients(sd, cfg, toks, target, g, rng, params, what=name)


@pytest.mark.parametrize("name", ["groups4-static-qw", "moh-hs2-static", "groups2-key_wise"])
def test_variant_recompute_gives_the_same_bits(tiny_factory, name):
    m, sd, cfg = _make(tiny_factory, name)
    toks = np.random.default_rng(12).integers(0, 24, (2, 8))
    from dclens.grad import param_table
    wrt = m.hook_names + [r[0] for r in param_table(m)]
    low = m.estimate_backward_memory(8, 2)["recompute"]
    ga = m.gradients(toks, ("loss",), wrt)
    gb = m.gradients(toks, ("loss",), wrt, max_tape_bytes=low)
    for n in wrt:
        assert np.array_equal(ga[n], gb[n]), n
