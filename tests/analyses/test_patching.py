"""dclens.patching: identities and agreement with unbatched single patches."""

import numpy as np
import pytest

import dclens
from dclens import interventions as iv
from dclens import patching

from conftest import rel_err
from tolerances import forward_tol, tiny

# a patched pass vs a plain one: two float32 passes (hooks move layers to the
# full path); a logit difference carries twice the logits' error
TWO_PASSES = forward_tol(tiny(), 16, 16 * 64, sides=2)

DCP = dict(model_type="dcpythia", n_layer=2, window_size=3, seed=71)
DCP_QW = dict(model_type="dcpythia", n_layer=2, window_size=3, query_wise=True, seed=72)
NEOX = dict(model_type="gpt_neox", n_layer=2, seed=73)
OVERS = ["layer,head", "layer,pos", "layer,head,pos", "layer,phase,branch", "composition"]


def _pair(model, T=8):
    rng = np.random.default_rng(1)
    return rng.integers(0, model.config.vocab, T), rng.integers(0, model.config.vocab, T)


@pytest.mark.parametrize("kw", [DCP, DCP_QW], ids=["dcpythia", "query_wise"])
@pytest.mark.parametrize("over", OVERS)
def test_patching_clean_into_clean_changes_nothing(tiny_factory, kw, over):
    d, _, _ = tiny_factory(**kw)
    model = dclens.load(d)
    clean, _ = _pair(model)
    metric = patching.logit_diff(3, 4)
    with pytest.warns(dclens.PatchingWarning, match="nearly equal"):
        r = patching.sweep(model, clean, clean, metric, over=over, progress=False)
    assert r.clean == r.corrupted and "nearly equal" in r.baseline_note
    v = r.values[np.isfinite(r.values)]
    scale = np.abs(model(clean)).max()
    assert v.size and np.abs(v - r.clean).max() <= 2 * TWO_PASSES * scale
    # one cell per pass: bit-identical to the unpatched run
    with pytest.warns(dclens.PatchingWarning):
        r1 = patching.sweep(model, clean, clean, metric, over=over, batch_size=1, layers=[1], progress=False)
    v1 = r1.values[np.isfinite(r1.values)]
    assert np.all(v1 == r1.clean)
    if over == "layer,phase,branch" and model.config.query_wise:
        assert np.isnan(r.values[:, :, 2]).all() and np.isnan(r.values[:, :, 4]).all()  # kp, kg absent


@pytest.mark.filterwarnings("ignore::dclens.PatchingWarning")  # random prompts: only the cells matter here
@pytest.mark.parametrize("over", ["layer,head", "layer,pos", "layer,head,pos", "layer,phase,branch", "composition"])
def test_sweep_cells_equal_single_patches(tiny_factory, over):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    clean, corr = _pair(model)
    metric = patching.prob(5, pos=-2)
    r = patching.sweep(model, clean, corr, metric, over=over, batch_size=7, progress=False)
    _, cache = model.run_with_cache(clean)
    if over == "layer,head":
        one = model.run_with_hooks(corr, fwd_hooks=[iv.patch(model, "blocks.1.attn.z", cache, head=2)])
        cell = r.values[1, 2]
    elif over == "layer,pos":
        one = model.run_with_hooks(corr, fwd_hooks=[iv.patch(model, "blocks.1.resid_pre", cache, positions=[5])])
        cell = r.values[1, 5]
    elif over == "layer,head,pos":
        one = model.run_with_hooks(corr, fwd_hooks=[iv.patch(model, "blocks.0.attn.z", cache, head=3, positions=[6])])
        cell = r.values[0, 3, 6]
    elif over == "layer,phase,branch":
        one = model.run_with_hooks(corr, fwd_hooks=[iv.patch(model, "blocks.0.attn.pre.kp", cache)])
        cell = r.values[0, 0, 2]
    else:
        # entry C[n=1, m=3] of layer 1's post map at clean values: the same as patching the
        # whole composed map when only that entry differs -- check against a direct computation
        from dclens import routing

        _, xc = model.run_with_cache(corr)
        delta = routing.composition_maps(model, cache, 1, "post") - routing.composition_maps(model, xc, 1, "post")
        add = (delta[:, :, 1, 3] * xc["blocks.1.attn.pattern"][1]).astype(np.float32)

        def fn(a, n):
            a[3] += add
            return a

        one = model.run_with_hooks(corr, fwd_hooks=[("blocks.1.attn.pattern_composed", fn)])
        cell = r.values[1, 1, 3]
    assert abs(cell - metric(one)) <= 2 * TWO_PASSES * np.abs(one).max()  # batched sweep vs one pass
    assert r.corrupted == pytest.approx(metric(model(corr)))
    assert r.clean == pytest.approx(metric(model(clean)))


def test_patching_everything_reproduces_the_clean_run(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    clean, corr = _pair(model)
    _, cache = model.run_with_cache(clean)
    want = model(clean)
    got = patching.run_patched(model, corr, cache, ["blocks.0.resid_pre"])
    np.testing.assert_array_equal(got, want)
    # every head's z, every MLP out and the embedding: the residual is rebuilt from clean parts
    names = ["embed"] + ["blocks.%d.attn.z" % l for l in range(2)] + ["blocks.%d.mlp.out" % l for l in range(2)]
    assert rel_err(patching.run_patched(model, corr, cache, names), want) <= TWO_PASSES
    # a layer,pos sweep at layer 0 patched at every position at once = the clean run
    r = patching.sweep(model, clean, corr, patching.logit_diff(2, 1), over="layer,pos", layers=[0], progress=False)
    assert r.values.shape == (1, 8)
    assert r.normalized().shape == (1, 8)


def test_patching_errors_and_plot(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    clean, corr = _pair(model)
    m = patching.logit_diff(2, 1)
    for kw, match in [
        (dict(over="heads"), "over must be"),
        (dict(hook="resid_pre"), "has no head axis"),
        (dict(layers=[5]), "layer 5 is out of range"),
        (dict(batch_size=0), "batch_size"),
        (dict(over="layer,pos", positions=[99]), "position 99"),
    ]:
        with pytest.raises(dclens.Error, match=match):
            patching.sweep(model, clean, corr, m, progress=False, **kw)
    with pytest.raises(dclens.Error, match="same number of tokens"):
        patching.sweep(model, clean, corr[:5], m, progress=False)
    d2, _, _ = tiny_factory(**NEOX)
    with pytest.raises(dclens.Error, match="no composition maps"):
        patching.sweep(dclens.load(d2), clean, corr, m, over="composition", progress=False)
    r = patching.sweep(model, clean, corr, m, over="layer,head,pos", progress=True)  # a tqdm bar on stderr
    assert r.plot()._repr_png_()[:4] == b"\x89PNG"
    assert patching.sweep(model, clean, corr, m, progress=False).plot(normalize=True)._repr_png_()[:4] == b"\x89PNG"


def test_sweep_arguments_refused_before_any_pass(tiny_factory, monkeypatch):
    """One pair or a batch of pairs, the same mistake gets the same Error class, before the model runs."""
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    clean, corr = _pair(model)
    m = patching.logit_diff(2, 1)
    ran = []
    monkeypatch.setattr(model.runner, "run", lambda *a, **k: ran.append(1))
    cases = [
        (dict(metric=3), dclens.ArgumentError, "metric must be a function"),
        (dict(metric=[m, 3]), dclens.ArgumentError, "a list holding 3"),
        (dict(over=5), dclens.ArgumentTypeError, "over must be a string"),
        (dict(over="heads"), dclens.ArgumentError, "over must be one of"),
        (dict(over="layer,pos", positions=3), dclens.ArgumentTypeError, "positions must be a list"),
        (dict(over="layer,pos", positions=["a"]), dclens.ArgumentTypeError, "integer token positions, not 'a'"),
        (dict(over="layer,pos", positions=[True]), dclens.ArgumentTypeError, "integer token positions"),
        (dict(over="composition", queries="x"), dclens.ArgumentTypeError, "queries must be a list"),
        (dict(over="layer,pos", positions=[0], roles={"a": [0]}), dclens.ArgumentError, "not both"),
    ]
    for pairs in (False, True):
        c, x = ([clean, clean], [corr, corr]) if pairs else (clean, corr)
        for kw, cls, match in cases:
            kw = dict(kw)
            metric = kw.pop("metric", m)
            if isinstance(metric, list) and not pairs:
                continue
            with pytest.raises(cls, match=match):
                patching.sweep(model, c, x, metric, progress=False, **kw)
    assert not ran


def test_baselines_are_checked(tiny_factory):
    """Equal or swapped prompts warn (PatchingWarning) and strict=True raises before any cell;
    the issue's two cases are named for what they do to normalized()."""
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    clean, corr = _pair(model)
    m = patching.logit_diff(2, 1)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = patching.sweep(model, clean, corr, m, over="layer,head", progress=False)  # clean clearly above
    assert r.clean > r.corrupted and r.baseline_note == ""
    for over in OVERS:
        with pytest.warns(dclens.PatchingWarning, match="higher on the corrupted prompt") as w:
            r = patching.sweep(model, corr, clean, m, over=over, layers=[1], progress=False)
        assert w[0].filename == __file__  # points at the caller's line
        assert "%.4g" % r.clean in r.baseline_note and "%.4g" % r.corrupted in r.baseline_note
        with pytest.warns(dclens.PatchingWarning, match="nearly equal"):
            patching.sweep(model, clean, clean, m, over=over, layers=[1], progress=False)
        with pytest.raises(dclens.Error, match="flips every sign"):
            patching.sweep(model, corr, clean, m, over=over, progress=False, strict=True)
    assert "nearly equal" in patching.baseline_problem(-1.441, -1.448)
    assert "flips every sign" in patching.baseline_problem(1.885, 3.036)
    assert "not finite" in patching.baseline_problem(float("nan"), 1.0)
    assert patching.baseline_problem(4.18, -2.17) == "" and patching.baseline_problem(0.5, 0.0) == ""
    assert "nearly equal" in patching.baseline_problem(0.0, 0.0)


@pytest.mark.filterwarnings("ignore::dclens.PatchingWarning")  # random prompts: only the cells matter here
@pytest.mark.parametrize("over", ["layer,head", "layer,pos", "layer,phase,branch", "composition"])
def test_sweep_over_pairs_is_the_mean_of_each_pair(tiny_factory, over):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    rng = np.random.default_rng(5)
    c = rng.integers(0, model.config.vocab, (2, 8))
    x = rng.integers(0, model.config.vocab, (2, 8))
    mets = [patching.logit_diff(3, 4), patching.logit_diff(5, 6)]
    r = patching.sweep(model, c, x, mets, over=over, progress=False)
    one = [patching.sweep(model, c[b], x[b], mets[b], over=over, progress=False) for b in range(2)]
    assert r.pairs == 2 and r.axes == one[0].axes
    np.testing.assert_allclose(r.values, (one[0].values + one[1].values) / 2, rtol=1e-6, atol=1e-6)
    # the baselines from one batched pass per side: float32 rounding apart from the pairs' own
    assert r.clean == pytest.approx((one[0].clean + one[1].clean) / 2, abs=1e-4)
    assert r.corrupted == pytest.approx((one[0].corrupted + one[1].corrupted) / 2, abs=1e-4)


@pytest.mark.filterwarnings("ignore::dclens.PatchingWarning")
def test_sweep_over_pairs_of_different_lengths_by_role(tiny_factory):
    """Pairs of 8 and 6 tokens aligned by role: a role's cell patches all its
    positions at once; a one-position role equals that position's cell of
    the pair's own sweep; the result is the mean over pairs."""
    from dclens._core.batch import pad

    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    rng = np.random.default_rng(6)
    c8, x8 = rng.integers(0, model.config.vocab, 8), rng.integers(0, model.config.vocab, 8)
    c6, x6 = rng.integers(0, model.config.vocab, 6), rng.integers(0, model.config.vocab, 6)
    met = patching.logit_diff(3, 4)
    roles = {"first": 0, "end": -1, "middle": (2, 5)}
    r = patching.sweep(model, pad([c8, c6]), pad([x8, x6]), met, over="layer,pos", roles=roles, progress=False)
    assert r.axes == ("layer", "role") and r.labels[1] == ["first", "end", "middle"]
    # the sweeps batch their cells (16 a pass): the same cell in batches of other sizes is a
    # product of other shapes, float32 rounding apart (docs/tolerances.md), and a logit
    # difference carries twice the logits' error
    tol = 2 * TWO_PASSES * float(max(np.abs(model(c8)).max(), np.abs(model(c6)).max()))
    per = []
    for c, x in ((c8, x8), (c6, x6)):
        plain = patching.sweep(model, c, x, met, over="layer,pos", progress=False)
        by_role = patching.sweep(model, c, x, met, over="layer,pos", roles=roles, progress=False)
        np.testing.assert_allclose(by_role.values[:, 0], plain.values[:, 0], rtol=0, atol=tol)  # "first"
        np.testing.assert_allclose(by_role.values[:, 1], plain.values[:, -1], rtol=0, atol=tol)  # "end"
        # "middle": positions 2, 3, 4 patched together, by hand
        _, cache = model.run_with_cache(c)
        src = np.asarray(cache["blocks.1.resid_pre"])

        def fn(act, _n, src=src):
            act[2:5] = src[2:5]
            return act

        lg = model.run_with_hooks(x, fwd_hooks=[("blocks.1.resid_pre", fn)])
        assert by_role.values[1, 2] == pytest.approx(met(lg), rel=0, abs=tol)
        per.append(by_role.values)
    np.testing.assert_allclose(r.values, np.mean(per, 0), rtol=0, atol=tol)
    with pytest.raises(dclens.Error, match="name the positions by role"):
        patching.sweep(model, pad([c8, c6]), pad([x8, x6]), met, over="layer,pos", progress=False)
    with pytest.raises(dclens.ArgumentError, match="positions= or roles=, not both"):
        patching.sweep(model, pad([c8, c6]), pad([x8, x6]), met, over="layer,pos", positions=[0], roles=roles)
    with pytest.raises(dclens.Error, match="a list of 1 for 2 prompt pairs"):
        patching.sweep(model, pad([c8, c6]), pad([x8, x6]), [met], over="layer,head", progress=False)
    with pytest.raises(dclens.Error, match="positions= or roles="):
        patching.sweep(model, c8, x8, met, over="layer,pos", positions=[1], roles=roles, progress=False)
