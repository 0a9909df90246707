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
from test_grad import EPS, _check, _target_fn
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
    f = _target_fn(cfg, toks, target)
    names = m.hook_names
    from dclens.grad import param_table
    params = [r[0] for r in param_table(m) if r[0] in sd]
    g = m.gradients(toks, target, names + params)
    _, cache = R.ref_forward(sd, cfg, toks, cache=True)
    for n in names:
        a = cache[n]
        assert g[n].shape == a.shape, n
        idx = [tuple(rng.integers(0, s) for s in a.shape) for _ in range(2)]
        nz = np.argwhere(np.abs(g[n]) > 1e-6)
        if len(nz):
            idx += [tuple(nz[i]) for i in rng.integers(0, len(nz), 2)]
        if n.endswith(".attn.pattern"):
            idx = [ix for ix in idx if ix[-1] <= ix[-2]]   # masked pairs are not post-composed
        pairs = []
        for ix in idx:
            def pert(s, ix=ix):
                def fn(x):
                    x = x.copy()
                    x[ix] += s
                    return x
                return fn
            fd = (f(sd, {n: pert(EPS)}) - f(sd, {n: pert(-EPS)})) / (2 * EPS)
            pairs.append((fd, g[n][ix]))
        _check(pairs, "%s %s" % (name, n))
    assert any(".attn.pre_sw" in p or "pre_proj" in p or "moh" in p or "dyn_w_proj" in p for p in params) \
        or not m.config.use_dcmha
    for canon in params:
        base = np.asarray(sd[canon], np.float64)
        flat = g[canon].ravel()
        pairs = []
        for i in list(np.argsort(-np.abs(flat))[:2]) + [int(rng.integers(0, flat.size))]:
            vals = []
            for s in (EPS, -EPS):
                p = base.copy().ravel()
                p[i] += s
                vals.append(f(dict(sd, **{canon: p.reshape(base.shape)})))
            pairs.append(((vals[0] - vals[1]) / (2 * EPS), flat[i]))
        _check(pairs, "%s %s" % (name, canon))


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
