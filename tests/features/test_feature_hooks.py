"""Features as hooks (dclens.features.hooks, .dashboard): dictionaries spliced in through the
model's write hooks against hand-written hooks doing the same, feature edits against manual
edits, top-activating contexts against a brute-force numpy pass, the logit effect against its
formula, and bad input each a dclens.Error naming the argument."""

import numpy as np
import pytest

import dclens
from dclens import features as F

D = 32


@pytest.fixture(scope="module")
def model(tiny_factory):
    d, _, _ = tiny_factory(n_layer=2, dim=D, vocab=64)
    return dclens.load(d)


@pytest.fixture(scope="module")
def toks():
    return np.random.default_rng(0).integers(0, 64, (10, 7)).astype(np.int32)


def _random(sae, seed=1, scale=0.4):
    rng = np.random.default_rng(seed)
    sae.set_parameters(**{k: rng.normal(0, scale, v.shape) for k, v in sae.parameters().items()})
    return sae


@pytest.fixture(scope="module")
def sae():
    return _random(F.SAE(F.SAEConfig(d_in=D, d_sae=48, arch="topk", k=6, hook_name="blocks.1.hook_resid_pre")))


@pytest.fixture(scope="module")
def transcoder():
    c = F.SAEConfig(d_in=D, d_sae=40, arch="relu", hook_name="blocks.0.mlp_input", hook_name_out="blocks.0.mlp.out")
    return _random(F.SAE(c), seed=2, scale=0.2)


def _manual_sae(sae, edit=None, error=False):
    """The hook a researcher would write: encode, edit, decode (+ the unedited error)."""

    def fn(act, name):
        x = act.reshape(-1, sae.cfg.d_in)
        acts = sae.encode(x)
        new = acts.copy()
        if edit is not None:
            edit(new.reshape(act.shape[:-1] + (sae.cfg.d_sae,)))  # [B, T, d_sae], a view
        out = sae.decode(new) + ((x - sae.decode(acts)) if error else 0)
        return out.reshape(act.shape)

    return fn


def test_error_term_gives_the_plain_pass(model, toks, sae, transcoder):
    plain = model(toks)
    for s in (sae, transcoder, [sae, transcoder]):
        logits, cache = F.run_with_saes(model, toks, s, use_error_term=True, names=[])
        np.testing.assert_array_equal(logits, plain)
    for s in (sae, transcoder):
        e, a = (cache[F.feature_hook_name(s, w)] for w in ("error", "acts"))
        assert np.abs(e).max() > 0.1 and 0 < (a != 0).mean() < 1  # a real error, features on and off
    spliced = F.run_with_saes(model, toks, sae, names=[])[0]
    assert np.abs(spliced - plain).max() > 1e-2  # without the error term the splice matters


def test_splicing_equals_a_manual_hook(model, toks, sae, transcoder):
    logits, cache = F.run_with_saes(model, toks, sae, names=["blocks.1.resid_pre"])
    want = model.run_with_hooks(toks, fwd_hooks=[("blocks.1.resid_pre", _manual_sae(sae))])
    np.testing.assert_allclose(logits, want, rtol=1e-6, atol=1e-6)
    x = cache["blocks.1.resid_pre.sae.input"]
    assert x.shape == (10, 7, D) and cache["blocks.1.resid_pre.sae.acts"].shape == (10, 7, 48)
    np.testing.assert_array_equal(cache["blocks.1.resid_pre.sae.acts"], sae.encode(x))
    np.testing.assert_allclose(
        cache["blocks.1.resid_pre.sae.recon"] + cache["blocks.1.resid_pre.sae.error"], x, atol=1e-5
    )
    np.testing.assert_allclose(cache["blocks.1.resid_pre"], cache["blocks.1.resid_pre.sae.recon"], atol=1e-6)
    # a transcoder: its output from the input hook of the same pass
    fed = {}
    manual = [
        ("blocks.0.mlp_input", dclens.read_only(lambda a, n: fed.update(x=np.array(a)))),
        ("blocks.0.mlp.out", lambda a, n: transcoder.forward(fed["x"]).reshape(a.shape)),
    ]
    got = F.run_with_saes(model, toks, transcoder, names=[])[0]
    np.testing.assert_allclose(got, model.run_with_hooks(toks, fwd_hooks=manual), rtol=1e-5, atol=1e-5)
    # the same hooks in a with block; one sequence (no batch axis)
    with model.hooks(F.sae_hooks(model, [sae])):
        np.testing.assert_allclose(model(toks[3]), logits[3], rtol=1e-5, atol=1e-5)


def _active(cache, sae):
    a = cache[F.feature_hook_name(sae)]
    return int(np.argmax((a != 0).sum((0, 1))))


def test_feature_edits_equal_manual_edits(model, toks, sae):
    _, clean = F.run_with_saes(model, toks, sae, use_error_term=True, names=[])
    f = _active(clean, sae)
    plain = model(toks)

    def zero(a):
        a[..., f] = 0

    got = F.run_with_saes(model, toks, sae, use_error_term=True, fwd_hooks=F.ablate_features(sae, f), names=[])
    want = model.run_with_hooks(toks, fwd_hooks=[("blocks.1.resid_pre", _manual_sae(sae, zero, error=True))])
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    assert np.abs(got[0] - plain).max() > 1e-3  # the ablation changed the output
    assert (got[1][F.feature_hook_name(sae)][..., f] == 0).all()

    def steer2(a):
        a[..., 1:3, f] += 2.5

    got = F.run_with_saes(model, toks, sae, use_error_term=True, fwd_hooks=F.steer(sae, f, 2.5, positions=[1, 2]))
    want = model.run_with_hooks(toks, fwd_hooks=[("blocks.1.resid_pre", _manual_sae(sae, steer2, error=True))])
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    # patching: the features of another run's tokens at the last position
    other = np.roll(toks, 1, axis=0)
    src = F.run_with_saes(model, other, sae, names=[])[1][F.feature_hook_name(sae)]

    def patch(a):
        a[..., -1, :] = src[..., -1, :]

    hooks = F.patch_features(sae, src, positions=-1)
    got = F.run_with_saes(model, toks, sae, use_error_term=True, fwd_hooks=hooks, names=[])
    want = model.run_with_hooks(toks, fwd_hooks=[("blocks.1.resid_pre", _manual_sae(sae, patch, error=True))])
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    # a hook function of one's own on the features, next to a model hook
    seen = []
    mine = [("blocks.1.hook_resid_pre.sae.acts", dclens.read_only(lambda a, n: seen.append((n, a.shape))))]
    F.run_with_saes(model, toks, sae, fwd_hooks=mine + [("blocks.0.resid_post", lambda a, n: None)], names=[])
    assert seen == [("blocks.1.resid_pre.sae.acts", (10, 7, 48))]


def test_top_activating_is_the_brute_force_pass(model, toks, sae):
    _, cache = model.run_with_cache(toks, names=["blocks.1.resid_pre"])
    every = sae.encode(cache["blocks.1.resid_pre"].reshape(-1, D))  # [rows, d_sae]
    count = (every != 0).sum(0)
    rare = int(np.argmin(np.where(count > 0, count, 10**9)))
    feats = [int(np.argmax(count)), rare, 5, 17]
    k = int(count[rare]) + 3  # the rare feature's last contexts are ties at 0
    r = F.top_activating(model, sae, F.TokenArrays(toks), k=k, seqs_per_batch=3, features=feats)
    a = every[:, feats].T  # [4, rows]
    order = np.argsort(-a, axis=1, kind="stable")[:, :k]  # ties to the earlier token
    np.testing.assert_allclose(r.acts, np.take_along_axis(a, order, 1), rtol=1e-5)  # passes of 3 rows vs 10
    np.testing.assert_array_equal(r.features, feats)
    np.testing.assert_array_equal(r.seq, order // 7)
    np.testing.assert_array_equal(r.pos, order % 7)
    np.testing.assert_array_equal(r.tokens, toks[order // 7])
    assert (r.acts[1, -3:] == 0).all() and (r.acts[:2, 0] > 0).all()  # ties at 0 and real maxima both tested
    part = F.top_activating(model, sae, F.TokenArrays(toks), k=2, n_seqs=4, start=3, seqs_per_batch=8)
    b = sae.encode(cache["blocks.1.resid_pre"][3:7].reshape(-1, D)).T
    np.testing.assert_array_equal(part.seq, np.argsort(-b, axis=1, kind="stable")[:, :2] // 7 + 3)


def test_logit_effect_is_the_direction_through_norm_and_unembedding(model, sae):
    r = F.feature_logit_effect(model, sae, 7, k=4)
    want = (sae.W_dec[7].astype(np.float64) * model.ln_final_w) @ model.W_U
    np.testing.assert_allclose(r.effect, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(r.top, np.argsort(-want)[:4])
    np.testing.assert_array_equal(r.bottom, np.argsort(want)[:4])
    np.testing.assert_allclose(r.top_values, want[r.top], rtol=1e-5)


def test_bad_input_names_the_argument(model, toks, sae, transcoder):
    def wrong(**kw):
        return F.SAE(F.SAEConfig(**{"d_in": D, "d_sae": 8, "hook_name": "blocks.0.resid_post", **kw}))

    with pytest.raises(dclens.Error, match=r"saes\[0\].*blocks\.9"):
        F.run_with_saes(model, toks, wrong(hook_name="blocks.9.resid_post"))
    with pytest.raises(dclens.Error, match=r"saes\[1\].*d_in"):
        F.run_with_saes(model, toks, [sae, wrong(d_in=D + 1)])
    with pytest.raises(dclens.Error, match=r"saes\[1\].*both use hook"):
        F.run_with_saes(model, toks, [sae, wrong(hook_name="blocks.1.resid_pre")])
    with pytest.raises(dclens.Error, match="saes must be"):
        F.run_with_saes(model, toks, [])
    with pytest.raises(dclens.Error, match="idx 48 is out of range"):
        F.ablate_features(sae, [1, 48])
    with pytest.raises(dclens.Error, match="feature -1 is out of range"):
        F.steer(sae, -1, 1.0)
    with pytest.raises(dclens.Error, match="coef"):
        F.steer(sae, 1, float("nan"))
    with pytest.raises(dclens.Error, match="source_acts must end in d_sae"):
        F.patch_features(sae, np.zeros((10, 7, 5)))
    with pytest.raises(dclens.Error, match="source_acts has shape"):
        F.run_with_saes(model, toks[:2], sae, fwd_hooks=F.patch_features(sae, np.zeros((3, 7, 48))))
    with pytest.raises(dclens.Error, match="positions holds 7"):
        F.run_with_saes(model, toks, sae, fwd_hooks=F.ablate_features(sae, 1, positions=[7]))
    with pytest.raises(dclens.Error, match="fwd_hooks: blocks.0.resid_post.sae.acts is no feature hook"):
        F.run_with_saes(model, toks, sae, fwd_hooks=[("blocks.0.resid_post.sae.acts", lambda a, n: None)])
    with pytest.raises(dclens.Error, match="names: .*sae.pre is no run_with_saes cache entry"):
        F.run_with_saes(model, toks, sae, names=["blocks.1.resid_pre.sae.pre"])
    with pytest.raises(dclens.Error, match="feature 48 is out of range"):
        F.feature_logit_effect(model, sae, 48)
    with pytest.raises(dclens.Error, match=r"k \(65\) is more than the vocabulary"):
        F.feature_logit_effect(model, sae, 1, k=65)
    with pytest.raises(dclens.Error, match="not the residual stream"):
        F.feature_logit_effect(model, wrong(hook_name="blocks.0.attn.z"), 1)
    with pytest.raises(dclens.Error, match=r"k \(71\) is more than the 70 positions"):
        F.top_activating(model, sae, F.TokenArrays(toks), k=71)
    with pytest.raises(dclens.Error, match="features 48 is out of range|feature 48 is out of range"):
        F.top_activating(model, sae, F.TokenArrays(toks), features=[48])
    with pytest.raises(dclens.Error, match="n_seqs is needed"):
        F.top_activating(model, sae, F.TokenArrays(lambda i: np.zeros(4, np.int32)))
    with pytest.raises(dclens.Error, match="k must be an integer >= 1"):
        F.top_activating(model, sae, F.TokenArrays(toks), k=0)
