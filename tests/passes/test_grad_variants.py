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

import reference as R
from test_grad import check_hook_gradients, check_param_gradients
from test_variants import BASE, VARIANTS

NAMES = [
    "key_wise",
    "static-derived-f16-torch",
    "talking-heads",
    "groups2",
    "groups4-static-qw",
    "groups2-key_wise",
    "moh-hs0",
    "moh-hs1",
    "moh-hs2-static",
    "moh-no-dcmha",
]


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
    from dclens.analysis.grad import param_table

    params = [r[0] for r in param_table(m) if r[0] in sd]
    if m.config.use_dcmha or m.config.moh_shared_heads is not None:  # its own parameters are among them
        assert any(
            p.endswith(("pre_proj.w", "post_proj.w", "dyn_w_proj.qkw")) or "moh" in p or "gate" in p for p in params
        ), params
    g = m.gradients(toks, target, names + params)
    check_hook_gradients(m, sd, cfg, toks, target, g, rng, names, picks=2, what=name)
    check_param_gradients(sd, cfg, toks, target, g, rng, params, what=name)


@pytest.mark.parametrize("name", ["groups4-static-qw", "moh-hs2-static", "groups2-key_wise"])
def test_variant_recompute_gives_the_same_bits(tiny_factory, name):
    m, sd, cfg = _make(tiny_factory, name)
    toks = np.random.default_rng(12).integers(0, 24, (2, 8))
    from dclens.analysis.grad import param_table

    wrt = m.hook_names + [r[0] for r in param_table(m)]
    low = m.estimate_backward_memory(8, 2)["recompute"]
    ga = m.gradients(toks, ("loss",), wrt)
    gb = m.gradients(toks, ("loss",), wrt, max_tape_bytes=low)
    for n in wrt:
        assert np.array_equal(ga[n], gb[n]), n


@pytest.mark.parametrize("name", ["moh-hs2-static", "groups2-key_wise"])
def test_variant_trains(tiny_factory, name):
    """A few AdamW steps on a variant: the loss falls, the variant's own
    weights (static maps, router, dynamic projections) change, and the
    forward then reads the trained weights (the reference forward on
    Model.weight reads agrees with it)."""
    from dclens._engine import ffi, lib
    from dclens.analysis.grad import Tape, param_table

    from conftest import rel_err

    m, sd, cfg = _make(tiny_factory, name)
    assert lib.dcs_model_make_trainable(m._m) == 0
    P = int(lib.dcs_param_total(m._m))
    grads, mom, var = (np.zeros(P, np.float32) for _ in range(3))
    toks = np.random.default_rng(13).integers(0, 24, (2, 9))
    tape = Tape(m, 2, 8)
    hp = ffi.new("dcs_adamw *")
    hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay = 3e-2, 0.9, 0.95, 1e-8, 0.0
    p = lambda a: ffi.cast("float *", ffi.from_buffer(a))
    losses = []
    for step in range(1, 7):
        tape.forward(toks[:, :8], logits=False)
        losses.append(tape.loss(toks[:, 1:]))
        grads[:] = 0
        tape.backward(None, grads)
        assert lib.dcs_adamw_step(m._m, p(grads), p(mom), p(var), step, hp) == 0
    assert losses[-1] < losses[0] - 0.05, losses
    names = [r[0] for r in param_table(m)]
    trained = dict(sd, **{n: np.asarray(m.weight(n), np.float32) for n in names if n in sd})
    assert any(not np.array_equal(trained[n], sd[n]) for n in names if "proj.w" in n or "moh" in n or "qkw" in n)
    ref = R.ref_forward(trained, cfg, toks[0])
    assert rel_err(m.forward(toks[0]), ref) <= 1e-4
