"""Incremental decoding (dcs_decoder) and generate: every step equals a full forward."""

import numpy as np
import pytest

import dclens
from dclens import interventions as iv
from dclens.analysis.generate import Decoder

from conftest import rel_err
from tolerances import forward_tol, tiny

# window 3 on layers 0 and 2 (global + local), 20 tokens: local layers evict keys
DCP = dict(model_type="dcpythia", n_layer=3, window_size=3, seed=41)
DCP_QW = dict(model_type="dcpythia", n_layer=2, window_size=3, query_wise=True, seed=42)
DCP_LGLL = dict(model_type="dcpythia", n_layer=4, window_size=2, window_type="LGLL", seed=43)
NEOX = dict(model_type="gpt_neox", n_layer=2, seed=44)
KINDS = [DCP, DCP_QW, DCP_LGLL, NEOX]
IDS = ["dcpythia", "query_wise", "lgll", "pythia"]
# incremental decoding vs a full pass: two float32 passes (GEMMs of 1 row vs
# T rows, a KV cache instead of materialised scores), 4 layers at most, T = 20
# (tests/tolerances.py; was 2e-5, what one kernel gave)
TOL = forward_tol(tiny(n_layer=4), 20, 20 * 64, sides=2)


def _toks(model, T=20, seed=0):
    return np.random.default_rng(seed).integers(0, model.config.vocab, size=T)


@pytest.mark.parametrize("kw", KINDS, ids=IDS)
@pytest.mark.parametrize("chunks", [[1] * 20, [7, 1, 1, 5, 1, 5], [20]], ids=["steps", "mixed", "prefill"])
def test_incremental_equals_full_forward(tiny_factory, kw, chunks):
    d, _, _ = tiny_factory(**kw)
    model = dclens.load(d)
    toks = _toks(model)
    full = model.forward(toks)
    dec = Decoder(model)
    out, at = [], 0
    for n in chunks:
        out.append(dec.step(toks[at : at + n]))
        at += n
    assert dec.pos == 20
    inc = np.concatenate(out)
    assert inc.shape == full.shape
    assert rel_err(inc, full) <= TOL
    c = model.config
    for l in range(c.n_layer):  # local layers keep only their window
        assert dec.layer_keys(l) == (min(20, c.window_size + 1) if l in c.local_layers else 20)


@pytest.mark.parametrize("kw", [DCP, NEOX], ids=["dcpythia", "pythia"])
def test_hooks_while_decoding(tiny_factory, kw):
    d, _, _ = tiny_factory(**kw)
    model = dclens.load(d)
    toks = _toks(model, 12, 3)
    hooks = [
        iv.ablate_head(model, 1, 2),
        iv.scale(model, "blocks.0.attn.k", 0.5, head=1),
        iv.scale(model, "blocks.1.attn.v", -1.0, head=3),
        iv.scale(model, "blocks.0.mlp.post", 1.5),
    ]
    if model.config.use_dcmha:
        hooks += iv.disable_branch(model, "post", "kp", layers=[0]) + iv.disable_branch(model, "pre", "qg")
        hooks += [
            iv.scale(model, "blocks.1.attn.dyn.post.kw1", 3.0, head=0),
            iv.scale(model, "blocks.0.attn.dyn.pre.kdd", 0.0),
        ]
    full = model.run_with_hooks(toks, fwd_hooks=hooks)
    dec = Decoder(model)
    inc = np.concatenate([dec.step(toks[:5], fwd_hooks=hooks)] + [dec.step([t], fwd_hooks=hooks) for t in toks[5:]])
    assert rel_err(inc, full) <= TOL
    assert rel_err(inc, model.forward(toks)) > 10 * TOL  # the hooks mattered, far above rounding


def test_decoding_cache_layouts(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _toks(model, 10, 5)
    _, full = model.run_with_cache(toks)
    dec = Decoder(model)
    dec.step(toks[:6])
    _, c = dec.step(toks[6:8], cache_names=None)
    N = model.config.n_head
    for name in ["blocks.0.attn.pattern", "blocks.1.attn.pattern_composed", "blocks.2.attn.post.kp"]:
        assert c[name].shape == (N, 2, 8)
        np.testing.assert_allclose(c[name], full[name][:, 6:8, :8], atol=TOL * max(1, np.abs(full[name]).max()))
    for name in ["blocks.1.attn.dyn.pre.kw1", "blocks.2.attn.z", "blocks.0.resid_post", "logits"]:
        np.testing.assert_allclose(c[name], full[name][6:8], rtol=0, atol=TOL * max(1, np.abs(full[name]).max()))
    # on a local layer, keys no longer held read 0 in pre-softmax maps
    assert np.all(c["blocks.0.attn.scores"][:, :, :2] == 0)


def test_failed_step_leaves_decoder_usable(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _toks(model, 9, 6)
    dec = Decoder(model)
    a = dec.step(toks[:4])

    def boom(x, n):
        raise RuntimeError("kaput")

    with pytest.raises(dclens.Error, match="blocks.1.attn.z.*kaput"):
        dec.step(toks[4:6], fwd_hooks=[("blocks.1.attn.z", boom)])
    assert dec.pos == 4
    b = dec.step(toks[4:])
    assert rel_err(np.concatenate([a, b]), model.forward(toks)) <= TOL
    with pytest.raises(dclens.Error, match="out of range"):
        dec.step([model.config.vocab])
    with pytest.raises(dclens.Error, match="non-empty"):
        dec.step([])
    with pytest.raises(dclens.Error, match="layer 7 is out of range"):
        dec.layer_keys(7)


@pytest.mark.parametrize("kw", [DCP, NEOX], ids=["dcpythia", "pythia"])
def test_generate_greedy_is_argmax_of_full_forwards(tiny_factory, kw):
    d, _, _ = tiny_factory(**kw)
    model = dclens.load(d)
    prompt = _toks(model, 5, 7)
    out = model.generate(prompt, max_new_tokens=8)
    assert out.shape == (13,)
    np.testing.assert_array_equal(out[:5], prompt)
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(np.argmax(model.forward(np.array(seq))[-1])))
    np.testing.assert_array_equal(out, seq)


def test_generate_options(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    prompt = _toks(model, 4, 8)
    greedy = model.generate(prompt, 6)
    np.testing.assert_array_equal(model.generate(prompt, 6, temperature=1.0, top_k=1, seed=3), greedy)
    a = model.generate(prompt, 6, temperature=1.5, seed=11)
    np.testing.assert_array_equal(a, model.generate(prompt, 6, temperature=1.5, seed=11))
    stop = int(greedy[6])
    np.testing.assert_array_equal(model.generate(prompt, 6, stop=stop), greedy[:7])
    np.testing.assert_array_equal(model.generate(prompt, 0), prompt)
    two = model.generate([prompt, prompt[:2]], 3)
    np.testing.assert_array_equal(two[0], greedy[:7])
    for bad, match in [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(return_type="x"), "return_type"),
    ]:
        with pytest.raises(dclens.Error, match=match):
            model.generate(prompt, **{"max_new_tokens": 2, **bad})


VARIANT_KINDS = {
    "key_wise": dict(key_wise=True, seed=71),
    "static": dict(use_sw=True, seed=72),
    "groups2": dict(compose_groups=2, n_head=4, seed=73),
    "groups4-static-qw": dict(compose_groups=4, use_sw=True, query_wise=True, n_head=8, dim=64, seed=75),
    "groups2-key_wise": dict(compose_groups=2, key_wise=True, seed=76),
    "moh-hs1": dict(moh={"shared_heads": 1, "routed_topk": 2}, seed=74),
    "moh-hs2-static": dict(moh={"shared_heads": 2, "routed_topk": 1}, use_sw=True, seed=77),
    "moh-no-dcmha": dict(moh={"shared_heads": 0, "routed_topk": 2}, use_dcmha=False, seed=78),
}


@pytest.mark.parametrize("name", sorted(VARIANT_KINDS))
def test_variants_decode_like_full_forwards(tiny_factory, name):
    """The section-5 variants decode step by step (local layers evicting keys)
    to the logits of full forward passes."""
    d, _, _ = tiny_factory(model_type="dcpythia", n_layer=3, window_size=3, **VARIANT_KINDS[name])
    model = dclens.load(d)
    toks = _toks(model)
    full = model.forward(toks)
    dec = Decoder(model)
    out, at = [], 0
    for n in [7, 1, 1, 5, 1, 5]:
        out.append(dec.step(toks[at : at + n]))
        at += n
    assert rel_err(np.concatenate(out), full) <= TOL
    np.testing.assert_array_equal(model.generate(toks[:4], max_new_tokens=3)[:4], toks[:4])
