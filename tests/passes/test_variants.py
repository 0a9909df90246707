"""The attention family of DCMHA (model-spec.md 5, issue 16): tiny models of each
variant against the independent numpy reference (tests/reference.py) -- logits,
every hook (the new static / routing / router_logits ones included), routing and
head load -- plus the null-versus-missing config keys, strided torch views, the
query-wise load note, and the variant interventions."""

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

import dclens
from dclens import interventions as iv

from conftest import rel_err
from reference import ref_composition_map, ref_forward
from tolerances import f32_tol, f64_tol, forward_tol, tiny

# engine vs float64 reference over the longest prompt here (T = 300), 3 layers at most
TOL = forward_tol(tiny(n_layer=3), 300, 300 * 64)
# two float32 passes of one prompt (a batch row vs alone, another hook set)
TWO_PASSES = forward_tol(tiny(n_layer=3), 30, 3 * 30 * 64, sides=2)
BASE = dict(model_type="dcpythia", n_layer=2, window_size=5)

VARIANTS = {
    # name: make_tiny kwargs
    "query_wise": dict(query_wise=True, seed=31),
    "key_wise": dict(key_wise=True, seed=32),
    "static": dict(use_sw=True, seed=33),
    "static-derived-f16-torch": dict(use_sw=True, extra_derived=True, dtype="float16", fmt="torch", seed=34),
    "talking-heads": dict(use_sw=True, dyn_scale=0.0, seed=35),  # every dynamic weight zero
    "groups2": dict(compose_groups=2, seed=36),
    "groups4-static-qw": dict(compose_groups=4, use_sw=True, query_wise=True, n_head=8, dim=64, seed=37),
    "groups2-key_wise": dict(compose_groups=2, key_wise=True, seed=38),
    "moh-hs0": dict(moh={"shared_heads": 0, "routed_topk": 2}, seed=39),
    "moh-hs1": dict(moh={"shared_heads": 1, "routed_topk": 2}, seed=40),
    "moh-hs2-static": dict(moh={"shared_heads": 2, "routed_topk": 1}, use_sw=True, seed=41),
    "moh-no-dcmha": dict(moh={"shared_heads": 1, "routed_topk": 1}, use_dcmha=False, seed=42),
    "null-window": dict(window_size=None, seed=43),
    "views-transpose": dict(fmt="torch", torch_views="transpose", dtype="bfloat16", seed=44),
    "views-expand": dict(fmt="torch", torch_views="expand", extra_derived=True, seed=45),
}


_MADE = {}


def _make(tmp_path_factory, name):
    """(dir, state_dict, config) of a variant's tiny checkpoint, made once."""
    from dclens.testing.make_tiny import make_tiny

    if name not in _MADE:
        kw = dict(BASE)
        kw.update(VARIANTS[name])
        d = str(tmp_path_factory.mktemp("variant"))
        sd, cfg = make_tiny(d, **kw)
        _MADE[name] = (d, sd, cfg)
    return _MADE[name]


@pytest.fixture(scope="session")
def variant(tmp_path_factory):
    return lambda name: _make(tmp_path_factory, name)


def _load(d):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dclens.LoadWarning)
        return dclens.load(d)


def _tokens(V, T=23, seed=0):
    return np.random.default_rng(seed).integers(0, V, size=T)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_every_hook_matches_reference(variant, name):
    d, sd, cfg = variant(name)
    model = _load(d)
    toks = _tokens(model.config.vocab)
    logits, cache = model.run_with_cache(toks, names=model.hook_names)
    ref_logits, ref_cache = ref_forward(sd, cfg, toks, cache=True)
    assert set(cache) == set(ref_cache), set(cache) ^ set(ref_cache)
    for n in model.hook_names:
        assert cache[n].shape == ref_cache[n].shape, n
        assert rel_err(cache[n], ref_cache[n]) <= TOL, n
    assert rel_err(logits, ref_logits) <= TOL
    np.testing.assert_array_equal(model.forward(toks), logits)  # hooks change nothing


def test_variant_hook_names(variant):
    c = _load(variant("moh-hs2-static")[0])
    names = c.hook_names
    for n in (
        "blocks.0.attn.pre.static",
        "blocks.1.attn.post.static",
        "blocks.0.attn.routing",
        "blocks.1.attn.router_logits",
    ):
        assert n in names
    # forward order: static after kg, routing before z
    assert names.index("blocks.0.attn.pre.kg") + 1 == names.index("blocks.0.attn.pre.static")
    assert names.index("blocks.0.attn.routing") + 1 == names.index("blocks.0.attn.z")
    kw = _load(variant("key_wise")[0])
    assert "blocks.0.attn.dyn.pre.kw1" in kw.hook_names and "blocks.0.attn.pre.qp" not in kw.hook_names
    for model, hook, why in [
        (kw, "blocks.0.attn.pre.qg", "key_wise: no query-wise branches"),
        (kw, "blocks.0.attn.pre.static", "use_sw is off"),
        (kw, "blocks.0.attn.routing", "no Mixture-of-Head routing"),
    ]:
        with pytest.raises(dclens.Error, match=why):
            model.run_with_cache(_tokens(64, 5), names=[hook])


@pytest.mark.parametrize("name", ["static", "groups4-static-qw", "key_wise", "groups2"])
def test_branches_and_composition_maps(variant, name):
    d, sd, cfg = variant(name)
    model = _load(d)
    c = model.config
    toks = _tokens(c.vocab)
    _, cache = model.run_with_cache(toks)
    branches = [b for b in ("skip", "qp", "kp", "qg", "kg", "static") if "blocks.0.attn.pre.%s" % b in cache]
    for l in range(c.n_layer):
        for phase, src, dst in (("pre", "scores", "scores_composed"), ("post", "pattern", "pattern_composed")):
            a = "blocks.%d.attn." % l
            total = sum(cache[a + phase + "." + b] for b in branches)
            # the composed map is the float32 sum of <= 6 branch terms
            assert rel_err(total, cache[a + dst]) <= f32_tol(6, 1, total.size, sides=2)
            W = sd.get("layers.%d.attention.dyn_w_proj.%s_proj.w" % (l, phase)) if c.use_sw else None
            for t, s in [(7, 3), (12, 12), (22, 20)]:
                C = model.composition_map(toks, l, phase, t, s)
                Cref = ref_composition_map(cache, l, phase, t, s, c.n_head, W, c.compose_groups)
                # C from composition_map's own pass vs from this cache's weights
                assert rel_err(C, Cref) <= TWO_PASSES
                comp = cache[a + dst][:, t, s]
                np.testing.assert_allclose(
                    C.T @ cache[a + src][:, t, s], comp, rtol=0, atol=TWO_PASSES * max(1.0, np.abs(comp).max())
                )
                if c.compose_groups > 1:  # block-diagonal: no flow between groups
                    Mg = c.n_head // c.compose_groups
                    off = np.ones_like(C, dtype=bool)
                    for g in range(c.compose_groups):
                        off[g * Mg : (g + 1) * Mg, g * Mg : (g + 1) * Mg] = False
                    assert np.all(C[off] == 0)


def test_talking_heads_is_static_map(variant):
    """With every dynamic weight zero the composition is the fixed I + W."""
    d, sd, cfg = variant("talking-heads")
    model = _load(d)
    toks = _tokens(model.config.vocab)
    _, cache = model.run_with_cache(toks, names=lambda n: n.startswith("blocks.1.attn."))
    W = sd["layers.1.attention.dyn_w_proj.pre_proj.w"][0].astype(np.float64)
    A = cache["blocks.1.attn.scores"].astype(np.float64)
    want = np.einsum("nts,nm->mts", A, np.eye(len(W)) + W)
    # one float32 product with an N x N map (a reduction of length N) on float32 scores
    assert rel_err(cache["blocks.1.attn.scores_composed"], want) <= f32_tol(len(W), 2, want.size)
    for b in ("qp", "kp", "qg", "kg"):
        assert np.all(cache["blocks.1.attn.pre." + b] == 0)


def _ref_head_load(ref_cache, L, hs, k):
    """Fraction of tokens whose top-k routed heads (by router logit) include each head."""
    out = []
    for l in range(L):
        lg = ref_cache["blocks.%d.attn.router_logits" % l]
        top = np.argsort(-lg, axis=-1, kind="stable")[:, :k]
        sel = np.zeros_like(lg, dtype=bool)
        np.put_along_axis(sel, top, True, axis=-1)
        out.append(sel.mean(0))
    return np.array(out)


@pytest.mark.parametrize("name", ["moh-hs0", "moh-hs1", "moh-hs2-static"])
def test_moh_routing_and_head_load(variant, name):
    from dclens import analysis

    d, sd, cfg = variant(name)
    model = _load(d)
    c = model.config
    hs, k = c.moh_shared_heads, c.moh_routed_topk
    seqs = [_tokens(c.vocab, 17, s) for s in range(3)]
    ref = [ref_forward(sd, cfg, t, cache=True)[1] for t in seqs]
    for toks, rc in zip(seqs, ref):
        _, cache = model.run_with_cache(toks, names=lambda n: "rout" in n)
        for l in range(c.n_layer):
            g = cache["blocks.%d.attn.routing" % l]
            assert rel_err(g, rc["blocks.%d.attn.routing" % l]) <= TOL
            assert np.all((g[:, hs:] > 0).sum(-1) == k)  # k routed heads per token
            np.testing.assert_array_equal(g[:, hs:] > 0, rc["blocks.%d.attn.routing" % l][:, hs:] > 0)
    load = analysis.head_load(model, seqs, progress=False)
    want = np.mean([_ref_head_load(rc, c.n_layer, hs, k) for rc in ref], axis=0)  # equal lengths
    assert load.shape == (c.n_layer, c.n_head - hs)
    # counts of routed heads averaged: exact but for float64 rounding of the means
    np.testing.assert_allclose(load, want, atol=f64_tol(len(seqs) * 30, 1, load.size))
    np.testing.assert_allclose(load.sum(-1), k)


def test_moh_unselected_heads_write_nothing(variant):
    d, sd, cfg = variant("moh-hs0")
    model = _load(d)
    _, cache = model.run_with_cache(_tokens(model.config.vocab), names=lambda n: n.startswith("blocks.0.attn."))
    off = cache["blocks.0.attn.routing"] == 0
    assert off.any() and np.all(cache["blocks.0.attn.z"][off] == 0)
    assert np.all(cache["blocks.0.attn.head_out"][off] == 0)


# ------------------------------------------------------------ interventions


def test_disable_static_matches_reference(variant):
    d, sd, cfg = variant("static")
    model = _load(d)
    toks = _tokens(model.config.vocab)
    got = model.run_with_hooks(toks, fwd_hooks=iv.disable_static(model, layers=[1]))
    want = ref_forward(
        sd,
        cfg,
        toks,
        interventions={"blocks.1.attn.pre.static": np.zeros_like, "blocks.1.attn.post.static": np.zeros_like},
    )
    assert rel_err(got, want) <= TOL
    assert rel_err(got, model.forward(toks)) > 10 * TOL  # an effect, far above rounding
    # every static branch off == the same model without use_sw
    got_all = model.run_with_hooks(toks, fwd_hooks=iv.disable_static(model))
    assert rel_err(got_all, ref_forward(sd, dict(cfg, use_sw=False), toks)) <= TOL
    with pytest.raises(dclens.Error, match="use_sw is off"):
        iv.disable_static(_load(variant("groups2")[0]))


def test_force_routing_matches_reference(variant):
    d, sd, cfg = variant("moh-hs1")
    model = _load(d)
    toks = _tokens(model.config.vocab)
    N = model.config.n_head
    got, cache = model.run_with_hooks(
        toks,
        fwd_hooks=[iv.force_routing(model, 1, [0, 3], [0.5, 2.0])],
        cache_names=["blocks.1.attn.routing", "blocks.1.attn.z"],
    )
    row = np.zeros(N)
    row[[0, 3]] = [0.5, 2.0]
    want = ref_forward(sd, cfg, toks, interventions={"blocks.1.attn.routing": lambda g: np.tile(row, (len(g), 1))})
    assert rel_err(got, want) <= TOL
    np.testing.assert_array_equal(cache["blocks.1.attn.routing"], np.tile(row, (len(toks), 1)).astype(np.float32))
    assert np.all(cache["blocks.1.attn.z"][:, [1, 2]] == 0)
    with pytest.raises(dclens.Error, match="head 9 is out of range"):
        iv.force_routing(model, 0, [9])


@pytest.mark.parametrize("factor,heads", [(0.25, None), (4.0, [1])])
def test_scale_router_logits_matches_reference(variant, factor, heads):
    d, sd, cfg = variant("moh-hs1")
    model = _load(d)
    toks = _tokens(model.config.vocab)

    def ref_fn(lg):
        lg = lg.copy()
        if heads is None:
            lg *= factor
        else:
            lg[:, heads] *= factor
        return lg

    got = model.run_with_hooks(toks, fwd_hooks=iv.scale_router_logits(model, factor, layers=[0], heads=heads))
    want = ref_forward(sd, cfg, toks, interventions={"blocks.0.attn.router_logits": ref_fn})
    assert rel_err(got, want) <= TOL
    assert rel_err(got, model.forward(toks)) > 2 * TOL  # an effect, above rounding
    with pytest.raises(dclens.Error, match="no Mixture-of-Head routing"):
        iv.scale_router_logits(_load(variant("static")[0]), 2.0)


# ------------------------------------------------------------ config: null versus missing


def _rewrite_config(src, dst, **changes):
    shutil.copytree(src, dst)
    p = os.path.join(dst, "config.json")
    cfg = json.loads(Path(p).read_text())
    for k, v in changes.items():
        if v is KeyError:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    Path(p).write_text(json.dumps(cfg))
    return cfg


def test_null_window_is_all_global_at_long_length(variant):
    """ "window_size": null = no local layer (the published module reads it so);
    before issue 16 it fell back to 256 and differed at T = 300."""
    d, sd, cfg = variant("null-window")
    assert cfg["window_size"] is None
    model = _load(d)
    assert model.config.local_layers == () and model.config.window_size == 0
    toks = _tokens(model.config.vocab, 300, 3)
    got = model.forward(toks)
    assert rel_err(got, ref_forward(sd, cfg, toks)) <= TOL
    # a 256 window would have changed the even layers at T = 300
    assert rel_err(got, ref_forward(sd, dict(cfg, window_size=256), toks)) > 10 * TOL


def test_missing_and_null_keys(tiny_factory, tmp_path):
    d, sd, cfg = tiny_factory(model_type="dcpythia", n_layer=2, window_size=5, seed=46)
    toks = _tokens(64, 11)
    # missing window_size = 256: layer 0 local
    c2 = _rewrite_config(d, str(tmp_path / "nowin"), window_size=KeyError)
    m = _load(str(tmp_path / "nowin"))
    assert m.config.local_layers == (0,) and m.config.window_size == 256
    assert rel_err(m.forward(toks), ref_forward(sd, c2, toks)) <= TOL
    # a null switch is off (None is falsy to the published module)
    c3 = _rewrite_config(d, str(tmp_path / "nullqk"), use_qk_norm=None, use_parallel_residual=None)
    m = _load(str(tmp_path / "nullqk"))
    assert not m.config.qk_norm and not m.config.parallel_residual
    want = ref_forward(sd, dict(c3, use_qk_norm=False, use_parallel_residual=False), toks)
    assert rel_err(m.forward(toks), want) <= TOL
    # missing use_qk_norm: DCPythiaConfig's default (False)
    _rewrite_config(d, str(tmp_path / "noqk"), use_qk_norm=KeyError)
    assert not _load(str(tmp_path / "noqk")).config.qk_norm
    # null intermediate_size = 4 * dim (make_tiny's default width)
    _rewrite_config(d, str(tmp_path / "nullff"), intermediate_size=None)
    assert _load(str(tmp_path / "nullff")).config.d_ff == 4 * cfg["dim"]
    # null moh / use_sw / compose_groups: the variant is off
    _rewrite_config(d, str(tmp_path / "nulls"), moh=None, use_sw=None, compose_groups=None)
    m = _load(str(tmp_path / "nulls"))
    assert m.config.moh_shared_heads is None and not m.config.use_sw and m.config.compose_groups == 1
    # a null number is refused, naming the key
    for key in ("norm_eps", "rope_base", "rotary_pct", "n_head"):
        _rewrite_config(d, str(tmp_path / ("null_" + key)), **{key: None})
        with pytest.raises(dclens.Error, match="'%s' is null" % key):
            dclens.load(str(tmp_path / ("null_" + key)))


def test_query_and_key_wise_together_refused(tiny_factory, tmp_path):
    d, _, _ = tiny_factory(model_type="dcpythia", n_layer=2, window_size=5, seed=46)
    _rewrite_config(d, str(tmp_path / "both"), query_wise=True, key_wise=True)
    with pytest.raises(dclens.Error, match="query_wise and key_wise are both true"):
        dclens.load(str(tmp_path / "both"))


def test_neox_null_keys(tiny_factory, tmp_path):
    d, sd, cfg = tiny_factory(model_type="gpt_neox", n_layer=2, seed=47)
    toks = _tokens(64, 11)
    c2 = _rewrite_config(d, str(tmp_path / "n1"), use_parallel_residual=None)
    m = _load(str(tmp_path / "n1"))
    assert not m.config.parallel_residual
    assert rel_err(m.forward(toks), ref_forward(sd, dict(c2, use_parallel_residual=False), toks)) <= TOL
    _rewrite_config(d, str(tmp_path / "n2"), layer_norm_eps=None)
    with pytest.raises(dclens.Error, match="'layer_norm_eps' is null"):
        dclens.load(str(tmp_path / "n2"))


# ------------------------------------------------------------ load note, views


def test_query_wise_key_weights_noted_once(variant, tiny_factory, tmp_path):
    from safetensors.numpy import load_file, save_file

    d, sd, cfg = tiny_factory(model_type="dcpythia", n_layer=2, window_size=5, query_wise=True, seed=48)
    with pytest.warns(dclens.LoadWarning, match="key-wise weights .* ignored.*PyTorch module") as rec:
        m = dclens.load(d)
    assert len(rec) == 1 and len(m.load_warnings) == 1
    # zero key slots carry nothing: no note
    dst = tmp_path / "qw0"
    shutil.copytree(d, dst)
    t = load_file(str(dst / "model.safetensors"))
    for l in range(2):
        p = "layers.%d.attention.dyn_w_proj." % l
        t[p + "qkw"][:, 1::2] = 0
        dd = t[p + "dd"].reshape(32, 1, 4, 4)
        dd[:, :, 1::2] = 0
        t[p + "dd"] = dd.reshape(32, 1, 16)
    save_file(t, str(dst / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", dclens.LoadWarning)
        assert dclens.load(str(dst)).load_warnings == []
    with pytest.warns(dclens.LoadWarning, match="key_wise is set but dyn_w_proj carries query-wise"):
        dclens.load(variant("key_wise")[0])


def test_strided_views_out_of_bounds_refused(tiny_factory, tmp_path):
    """A transposed view that reaches past its storage is refused, naming the tensor."""
    from dclens.testing.make_tiny import TorchTensor, round_to_dtype, write_torch_zip

    d, _, _ = tiny_factory(model_type="gpt_neox", n_layer=2, seed=47)
    shutil.copy(os.path.join(d, "config.json"), tmp_path / "config.json")
    raw, _ = round_to_dtype(np.arange(6, dtype=np.float32), "float32")
    p = tmp_path / "pytorch_model.bin"
    write_torch_zip(str(p), {"w": TorchTensor("s", "float32", 6, 0, (3, 2), (1, 4))}, {"s": raw.tobytes()})
    with pytest.raises(dclens.Error, match="tensor 'w': view of size \\(3, 2\\), stride \\(1, 4\\).*outside storage"):
        dclens.load(str(tmp_path))


def test_static_branch_memory(variant):
    """Hooking one branch materialises all six of that layer and phase."""
    d, _, _ = variant("static")
    model = _load(d)
    B, T = 2, 13
    toks = np.stack([_tokens(64, T, 1), _tokens(64, T, 2)])
    model.forward(toks)
    base = model.last_pass_memory()
    model.run_with_cache(toks, names=["blocks.1.attn.post.static"])
    N = model.config.n_head
    assert model.last_pass_memory()["total"] - base["total"] == 6 * B * N * T * T * 4


@pytest.mark.parametrize("name", ["moh-hs2-static", "groups4-static-qw", "key_wise"])
def test_batched_variants_equal_single_rows(variant, name):
    d, sd, cfg = variant(name)
    model = _load(d)
    toks = np.stack([_tokens(model.config.vocab, 15, s) for s in (1, 2, 3)])
    got, cache = model.run_with_cache(toks, names=lambda n: n.endswith(("routing", "pre.static", "pattern_composed")))
    for b in range(3):
        one, c1 = model.run_with_cache(toks[b], names=list(cache))
        np.testing.assert_allclose(got[b], one, rtol=0, atol=TWO_PASSES * np.abs(one).max())
        for n in cache:
            np.testing.assert_allclose(cache[n][b], c1[n], rtol=0, atol=TWO_PASSES * max(1.0, np.abs(c1[n]).max()))
        assert rel_err(one, ref_forward(sd, cfg, toks[b])) <= TOL
