"""One rule for every pass (issue 41): a pass runs exactly the hooks in force
(add_hook, `with model.hooks(...)`, the call's fwd_hooks, in that order),
whatever path computes it, or refuses; and padded batches carry their side.

The matrix: every entry point x every way to set a hook, each against a
plain full forward (run_with_hooks) with the same hook."""

import numpy as np
import pytest

import dclens
from dclens import interventions as iv
from dclens import patching, routing

MODEL = "dcpythia-tiny"
pytestmark = pytest.mark.skipif(
    MODEL not in [b.name for b in dclens.bundled_models()], reason="bundled models not installed"
)
PROMPT = "Ruth has a sweater. Steven has a taxi. Ruth has a"
OTHER = "The cat sat on the mat. The dog sat"


@pytest.fixture(scope="module")
def model():
    return dclens.load(MODEL)


def _hook(model):
    """An intervention that moves every logit: head 2 of layer 1 ablated, and
    the residual into layer 2 scaled."""
    return iv.ablate_head(model, 1, 2) + iv.scale(model, "blocks.2.resid_pre", 0.5)


def _ways(model, hooks):
    """The ways to put hooks in force, each a context manager."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        with model.hooks(hooks):
            yield

    @contextlib.contextmanager
    def added():
        for n, fn in hooks:
            model.add_hook(n, fn)
        try:
            yield
        finally:
            model.reset_hooks()

    return {"with model.hooks": ctx, "add_hook": added}


WAYS = ["with model.hooks", "add_hook"]


@pytest.mark.parametrize("way", WAYS)
def test_every_forward_path_runs_the_hooks_in_force(model, way):
    toks = model.to_tokens(PROMPT)
    hooks = _hook(model)
    want = model.run_with_hooks(toks, hooks)  # the plain full forward with the hook
    plain = model.forward(toks)
    assert np.abs(want - plain).max() > 0.1  # the hook matters
    rows = model.to_tokens([PROMPT, OTHER])
    want_b = model.run_with_hooks(rows, hooks)
    want_loss = model.run_with_hooks(toks, hooks, return_type="loss")
    with _ways(model, hooks)[way]():
        np.testing.assert_array_equal(model.forward(toks), want)
        np.testing.assert_array_equal(model(toks), want)
        np.testing.assert_allclose(model.forward(toks, logits_at="last"), want[-1], atol=1e-5)
        np.testing.assert_allclose(model.forward(toks, logits_at=[2, 5]), want[[2, 5]], atol=1e-5)
        np.testing.assert_allclose(model.forward(toks[None], logits_at="last")[0], want[-1], atol=1e-5)
        logits, cache = model.run_with_cache(toks, names=["blocks.1.attn.z"])
        np.testing.assert_array_equal(logits, want)
        assert np.all(cache["blocks.1.attn.z"][:, 2] == 0)  # the cache shows the ablation
        np.testing.assert_array_equal(model.run_with_hooks(toks, []), want)
        got_b = model.forward(rows)
        np.testing.assert_allclose(got_b, want_b, atol=1e-5)
        loss = model.forward(toks, return_type="loss")
        assert loss == pytest.approx(want_loss, abs=1e-6)
        gen = model.generate(toks, max_new_tokens=3, return_type="tokens")
    assert list(gen[: toks.size]) == list(toks)
    # generate under the hook equals greedy decoding by full hooked forwards
    seq = list(toks)
    for _ in range(3):
        seq.append(int(np.argmax(model.run_with_hooks(np.array(seq), hooks)[-1])))
    assert list(gen) == seq
    assert not model.runner.ctx_hooks  # the way cleaned up after itself


@pytest.mark.parametrize("way", WAYS)
def test_gradient_paths_refuse_naming_the_hooks(model, way):
    toks = model.to_tokens(PROMPT)
    hooks = _hook(model)
    with _ways(model, hooks)[way]():
        with pytest.raises(
            dclens.Error, match=r"gradients: 2 hooks in force .*blocks\.1\.attn\.z.*blocks\.2\.resid_pre"
        ):
            model.gradients(toks, ("logit", -1, 5), wrt=["blocks.0.attn.z"])
        with pytest.raises(dclens.Error, match=r"attribute: 2 hooks in force"):
            model.attribute(toks, ("logit", -1, 5), at=["blocks.0.attn.z"], steps=2, progress=False)
    # outside, both run again
    assert model.gradients(toks, ("logit", -1, 5), wrt=["blocks.0.attn.z"])["blocks.0.attn.z"].shape[0] == toks.size


def test_order_model_hooks_first_then_the_calls(model):
    toks = model.to_tokens(PROMPT)
    seen = {}

    @dclens.read_only
    def look(a, n):
        seen["z"] = a.copy()

    with model.hooks([iv.ablate_head(model, 1, 2)]):
        model.run_with_hooks(toks, [("blocks.1.attn.z", look)])
    assert np.all(seen["z"][:, 2] == 0)  # the call's read-only hook saw the intervention in force


def test_analyses_see_the_hooks_in_force(model):
    toks = model.to_tokens(PROMPT)
    T = toks.size

    def flat(a, n):  # uniform post-softmax weights over the visible keys
        t, s = np.indices(a.shape[-2:])
        a[...] = np.where(s <= t, 1.0 / (t + 1), 0.0)
        return a

    with model.hooks([("blocks.1.attn.pattern", flat)]):
        F = model.flows(toks, 1, "post", head=0, query=T - 1)
        _, cache = model.run_with_cache(toks, names=["blocks.1.attn.pattern"])
    # the flows' skip term is the pattern the pass used: the hook's
    assert F[0, 0, :T].sum() == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(F[0, 0], 1.0 / T, atol=1e-7)
    np.testing.assert_allclose(cache["blocks.1.attn.pattern"][:, -1], 1.0 / T, atol=1e-7)
    # routing from a cache of the hooked pass equals the entry point's own pass
    with model.hooks([("blocks.1.attn.pattern", flat)]):
        R = model.routing_matrix(toks, 1, "post", query=T - 1)
        _, full = model.run_with_cache(toks)
    np.testing.assert_allclose(R, routing.routing_matrices(model, full, "post", layers=[1], queries=[T - 1])[0, 0])


def test_patching_and_prompting_under_hooks(model):
    clean = "Ruth has a sweater. Steven has a taxi. Ruth has a"
    corrupted = "Ruth has a taxi. Steven has a sweater. Ruth has a"
    metric = patching.logit_diff(model.to_single_token(" taxi"), model.to_single_token(" sweater"))
    hooks = [iv.ablate_head(model, 2, 1)]
    with model.hooks(hooks):
        r = patching.sweep(model, clean, corrupted, metric, over="layer,head", layers=[3], progress=False)
    assert r.clean == pytest.approx(metric(model.run_with_hooks(model.to_tokens(clean), hooks)), abs=1e-5)
    assert r.corrupted == pytest.approx(metric(model.run_with_hooks(model.to_tokens(corrupted), hooks)), abs=1e-5)
    # one cell by hand: the clean z of L3H0 patched into the corrupted run, the hook in force on both
    _, cc = model.run_with_hooks(model.to_tokens(clean), hooks, cache_names=["blocks.3.attn.z"])
    cell = model.run_with_hooks(model.to_tokens(corrupted), hooks + [iv.patch(model, "blocks.3.attn.z", cc, head=0)])
    assert r.values[0, 0] == pytest.approx(metric(cell), abs=1e-5)


# ---------------------------------------------------------------- padding


def test_left_padding_round_trip(model):
    a, b = PROMPT, "Ruth has a cat."
    one = model.forward(model.to_tokens(b))
    for side in ("left", "right"):
        p = model.to_tokens([a, b], padding_side=side)
        assert p.padding_side == side
        toks, lens = p  # still unpacks as a pair
        got = model.forward(p)
        row = got[1, -lens[1] :] if side == "left" else got[1, : lens[1]]
        np.testing.assert_allclose(row, one, atol=1e-4)
        # run_with_cache and run_with_hooks read the side too
        _, cache = model.run_with_cache(p, names=["blocks.0.resid_pre"])
        np.testing.assert_allclose(model.run_with_hooks(p, []), got, atol=1e-6)
        assert cache["blocks.0.resid_pre"].shape[:2] == toks.shape
        # explicit and matching: fine; the other side: refused, naming padding_side
        np.testing.assert_allclose(model.forward(p, padding_side=side), got, atol=1e-6)
        other = "right" if side == "left" else "left"
        with pytest.raises(
            dclens.ArgumentError, match="padding_side='%s', but these tokens were padded on the %s" % (other, side)
        ):
            model.forward(p, padding_side=other)


def test_a_bare_left_padded_pair_is_refused_not_misread(model):
    toks, lens = model.to_tokens([PROMPT, "Ruth has a cat."], padding_side="left")
    with pytest.raises(dclens.ArgumentError, match="row 1 looks left-padded"):
        model.forward((np.asarray(toks), np.asarray(lens)))
    with pytest.raises(dclens.ArgumentError, match="looks left-padded"):
        model.run_with_cache(np.asarray(toks), lengths=lens)
    # saying the side makes it right
    one = model.forward(model.to_tokens("Ruth has a cat."))
    got = model.forward((np.asarray(toks), np.asarray(lens)), padding_side="left")
    np.testing.assert_allclose(got[1, -lens[1] :], one, atol=1e-4)
    # a bare right-padded pair is read as before
    rt, rl = model.to_tokens([PROMPT, "Ruth has a cat."])
    np.testing.assert_allclose(model.forward((np.asarray(rt), np.asarray(rl)))[1, : rl[1]], one, atol=1e-4)


def test_paths_without_padding_refuse_a_padded_pair(model):
    p = model.to_tokens([PROMPT, "Ruth has a cat."], padding_side="left")
    for call in (
        lambda: model.forward(p, logits_at="last"),
        lambda: model.gradients(p, ("logit", -1, 5), wrt=["blocks.0.attn.z"]),
    ):
        with pytest.raises(dclens.Error, match="a padded batch"):
            call()


def test_padded_pickles_with_its_side(model):
    import pickle

    p = model.to_tokens([PROMPT, "Ruth has a cat."], padding_side="left")
    q = pickle.loads(pickle.dumps(p))
    assert q.padding_side == "left" and np.array_equal(q[0], p[0]) and np.array_equal(q.lengths, p.lengths)
