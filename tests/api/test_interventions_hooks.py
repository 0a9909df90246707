"""One result convention for interventions (issue 37, "Also seen"): every
dclens.interventions helper returns a dclens.Hooks (a list of (name, fn)
pairs), accepted wherever hooks are: alone, spliced into a list, or nested as
one element of a list (flattened), in run_with_hooks, run_with_cache,
`with model.hooks(...)`, add_hook, generate and Decoder.step. The nested and
flat forms give the logits of the old forms (one (name, fn) tuple in a list,
or a plain list of pairs)."""

import warnings

import numpy as np
import pytest

import dclens
from dclens import interventions as iv
from dclens.analysis.generate import Decoder

DCP = dict(model_type="dcpythia", n_layer=2, window_size=3, seed=61)
# Mixture-of-Head routing and the static (Talking-Heads) branch, for force_routing,
# scale_router_logits and disable_static
MOH_SW = dict(model_type="dcpythia", n_layer=2, moh={"shared_heads": 1, "routed_topk": 2}, use_sw=True, seed=41)


def _load(tiny_factory, kw):
    d, _, _ = tiny_factory(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dclens.LoadWarning)
        return dclens.load(d)


def _toks(model, T=11, seed=0):
    return np.random.default_rng(seed).integers(0, model.config.vocab, size=T)


def _helpers(model, moh):
    """name -> (Hooks, number of pairs it must hold, whether the old helper returned one tuple)."""
    toks = _toks(model, seed=5)
    _, other = model.run_with_cache(toks, names=["blocks.1.attn.z"])
    out = {
        "ablate_head": (iv.ablate_head(model, 1, 2), 1, True),
        "ablate_head-mean": (iv.ablate_head(model, 0, 1, kind="mean", mean=np.ones(model.config.head_dim)), 1, True),
        "scale": (iv.scale(model, "blocks.0.attn.z", 0.3, head=1), 1, True),
        "patch": (iv.patch(model, "blocks.1.attn.z", other, head=0), 1, True),
        "disable_branch": (iv.disable_branch(model, "post", "kp"), model.config.n_layer, False),
        "disable_dynamic": (iv.disable_dynamic(model, layers=[1]), 8, False),
        "block_lending": (iv.block_lending(model, 0, 1, "post"), 7, False),
    }
    if moh:
        out["disable_static"] = (iv.disable_static(model, layers=[0]), 2, False)
        out["force_routing"] = (iv.force_routing(model, 1, heads=[1, 3], weights=[0.5, 2.0]), 1, True)
        out["scale_router_logits"] = (iv.scale_router_logits(model, 0.3), model.config.n_layer, False)
    return out


@pytest.mark.parametrize("kw", [DCP, MOH_SW], ids=["dcpythia", "moh-static"])
def test_every_helper_returns_hooks(tiny_factory, kw):
    model = _load(tiny_factory, kw)
    helpers = _helpers(model, kw is MOH_SW)
    for name, (h, n, _) in helpers.items():
        assert type(h) is dclens.Hooks and isinstance(h, list), name
        assert len(h) == n, (name, len(h))
        for pair in h:
            assert isinstance(pair, tuple) and len(pair) == 2 and callable(pair[1]), name
            assert pair[0] in model.hook_names, (name, pair[0])
        text = repr(h)
        assert text.startswith("Hooks(%d hook" % n), text
        assert all(p[0] in text for p in h[:12]), text
        made_by = {"disable_dynamic": "disable_branch"}.get(name, name.split("-")[0])
        assert made_by in text, text  # what the hook does: the helper that made it
    assert dclens.Hooks is iv.Hooks


@pytest.mark.parametrize("kw", [DCP, MOH_SW], ids=["dcpythia", "moh-static"])
def test_flat_spliced_nested_and_old_forms_give_the_same_logits(tiny_factory, kw):
    model = _load(tiny_factory, kw)
    toks = _toks(model)
    plain = model(toks)
    for name, (h, _, one_pair) in _helpers(model, kw is MOH_SW).items():
        old = [tuple(h[0])] if one_pair else list(h)  # what [helper(...)] / helper(...) passed before
        want = model.run_with_hooks(toks, fwd_hooks=old)
        assert np.abs(want - plain).max() > 1e-4, name  # the intervention moves the logits
        for form in (h, [h], [*h], list(h), dclens.Hooks([h])):
            np.testing.assert_array_equal(model.run_with_hooks(toks, fwd_hooks=form), want, err_msg=name)
        np.testing.assert_array_equal(model.run_with_cache(toks, names=["embed"], fwd_hooks=[h])[0], want)
        for form in (h, [h]):
            with model.hooks(form):
                np.testing.assert_array_equal(model(toks), want, err_msg=name)
        model.add_hook(h)
        try:
            np.testing.assert_array_equal(model(toks), want, err_msg=name)
        finally:
            model.reset_hooks()
        np.testing.assert_array_equal(model(toks), plain)


def test_ablate_head_is_the_hand_written_hook(tiny_factory):
    model = _load(tiny_factory, DCP)
    toks = _toks(model)

    def zero_head_2(a, _name):
        a[:, 2] = 0.0
        return a

    want = model.run_with_hooks(toks, [("blocks.1.attn.z", zero_head_2)])
    np.testing.assert_array_equal(model.run_with_hooks(toks, iv.ablate_head(model, 1, 2)), want)


def test_mixed_lists_sums_and_decoding(tiny_factory):
    model = _load(tiny_factory, DCP)
    toks = _toks(model)
    a, b = iv.ablate_head(model, 1, 2), iv.disable_branch(model, "post", "kp")
    seen = []
    look = ("blocks.1.attn.z", dclens.read_only(lambda act, _n: seen.append(act.copy())))
    flat = [*a, *b, look]
    want = model.run_with_hooks(toks, flat)
    assert seen and np.all(seen[-1][:, 2] == 0)  # the reader ran after the ablation
    for form in ([a, b, look], [a, *b, look], a + b + [look], [*a] + b + [look]):
        got = model.run_with_hooks(toks, form)
        np.testing.assert_array_equal(got, want)
    assert type(a + b) is dclens.Hooks and type([look] + a) is dclens.Hooks and type(b[:1]) is dclens.Hooks
    assert [p[0] for p in a + b] == [p[0] for p in [*a, *b]]
    # generation and the decoder take the nested form too
    g1 = model.generate(toks[:5], max_new_tokens=4, fwd_hooks=[a, b])
    g2 = model.generate(toks[:5], max_new_tokens=4, fwd_hooks=[*a, *b])
    np.testing.assert_array_equal(g1, g2)
    s1, s2 = Decoder(model).step(toks, fwd_hooks=[a]), Decoder(model).step(toks, fwd_hooks=a)
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_allclose(s1, model.run_with_hooks(toks, a), rtol=1e-4, atol=1e-4)


def test_bad_hooks_are_refused_naming_the_argument(tiny_factory):
    model = _load(tiny_factory, DCP)
    toks = _toks(model)
    h = iv.ablate_head(model, 1, 2)
    for call, cls, match in [
        (lambda: dclens.Hooks([("blocks.0.attn.z", 3)]), dclens.Error, "is not callable"),
        (lambda: dclens.Hooks([5]), dclens.Error, r"Hooks must be a list of \(name, fn\) pairs"),
        (lambda: dclens.Hooks("abc"), dclens.Error, "Hooks must be a list"),
        (lambda: model.run_with_hooks(toks, [list(h)]), dclens.Error, r"fwd_hooks must be a list of \(name, fn\)"),
        (lambda: model.run_with_hooks(toks, tuple(h[0])), dclens.Error, "put it in a list"),
        (lambda: model.add_hook(h, lambda a, n: None), dclens.ArgumentError, "add_hook: give a Hooks alone"),
        (lambda: model.add_hook("blocks.0.attn.z"), dclens.ArgumentError, "add_hook: fn is missing"),
        (lambda: model.add_hook(h + [("blocks.0.attn.nope", h[0][1])]), dclens.Error, "blocks.0.attn.nope"),
    ]:
        with pytest.raises(cls, match=match):
            call()
    assert model.hooks_in_force() == []  # nothing half-added


def test_mean_ablation_of_a_gate_is_its_mean_over_positions(tiny_factory):
    """A gate ([T, N]: one number per position and head) mean-ablated from
    reference prompts of another length: the head's gate set to its mean over
    the reference's positions, as a hand-written hook does."""
    from dclens import patching

    d, _, _ = tiny_factory(**DCP)
    m = dclens.load(d)
    rng = np.random.default_rng(2)
    toks, ref = rng.integers(0, m.config.vocab, 9), rng.integers(0, m.config.vocab, 6)
    name = "blocks.1.attn.dyn.post.qdd"
    _, rc = m.run_with_cache(ref, names=[name])
    mean = iv.mean_activation(rc, 1, 2, "attn.dyn.post.qdd")
    assert mean.shape == () and float(mean) == pytest.approx(float(np.asarray(rc[name])[:, 2].mean()))
    met = patching.logit_diff(3, 4)
    r = patching.ablation_sweep(m, toks, met, mode="mean", reference=ref, hook="attn.dyn.post.qdd", progress=False)

    def fn(act, _n):
        act[:, 2] = mean
        return act

    want = met(m.run_with_hooks(toks, fwd_hooks=[(name, fn)]))
    assert r.values[1, 2] == pytest.approx(want, rel=1e-5, abs=1e-6)
