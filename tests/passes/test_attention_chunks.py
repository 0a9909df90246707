"""Attention by query chunks (Model.attention_rows, dcs_model_set_attention_rows):
the path a backend without a fused kernel (CUDA) takes where no map is hooked or
kept, and the variants the CPU's fused kernel does not compute take for long
inputs. Each chunk runs the full path's kernels on a block of query rows and the
keys they can see; checked here against the independent float64 references, the
full path, the decoder, hooks and the tape, with chunk sizes that cut windows,
sequences and batches at odd places."""

import warnings

import numpy as np
import pytest

import dclens

from conftest import rel_err
from reference import ref_forward
from reference_dcformer import ref_forward_dcformer
from tolerances import forward_tol, tiny

T = 37
TOL = forward_tol(tiny(n_layer=3), T, T * 64)
TWO_PASSES = forward_tol(tiny(n_layer=3), T, 3 * T * 64, sides=2)

CONFIGS = {
    # name: make_tiny kwargs (window 5: local layers whose keys a chunk trims on both sides)
    "dcpythia": dict(window_type="LGLL", n_layer=4, window_size=5, seed=51),
    "query_wise": dict(query_wise=True, window_size=5, seed=52),
    "key_wise": dict(key_wise=True, seed=53),
    "static-groups2": dict(use_sw=True, compose_groups=2, seed=54),
    "moh": dict(moh={"shared_heads": 1, "routed_topk": 2}, seed=55),
    "no-dcmha": dict(use_dcmha=False, seed=56),
    "gpt_neox": dict(model_type="gpt_neox", seed=57),
    "dcformer": dict(model_type="dcformer", intermediate=128, seed=58),
}
_MADE = {}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from dclens.testing.make_tiny import make_tiny

    def get(name):
        if name not in _MADE:
            d = str(tmp_path_factory.mktemp("chunks"))
            sd, cfg = make_tiny(d, **CONFIGS[name])
            _MADE[name] = (d, sd, cfg)
        return _MADE[name]

    return get


def _load(d, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dclens.LoadWarning)
        return dclens.load(d, **kw)


def _reference(name, sd, cfg, toks):
    ref = ref_forward_dcformer if CONFIGS[name].get("model_type") == "dcformer" else ref_forward
    return ref(sd, cfg, toks)


def _batch(V, seed=0):
    return np.random.default_rng(seed).integers(0, V, size=(2, T))


@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chunks_match_reference_and_full_path(made, name, rows):
    d, sd, cfg = made(name)
    model = _load(d)
    toks = _batch(model.config.vocab)
    model.attention_rows = -1
    full = model.forward(toks)
    model.attention_rows = rows
    assert model.attention_rows == rows
    chunked = model.forward(toks)
    assert rel_err(chunked, full) <= TWO_PASSES
    for b in range(toks.shape[0]):
        assert rel_err(chunked[b], _reference(name, sd, cfg, toks[b])) <= TOL
    # a batch row computed alone: the chunks of one sequence do not see another's
    np.testing.assert_allclose(model.forward(toks[1]), chunked[1], rtol=0, atol=TWO_PASSES * np.abs(full).max())


@pytest.mark.parametrize("name", ["dcpythia", "static-groups2", "key_wise"])
def test_decoder_on_chunks(made, name):
    """Prefill and decoding steps (t0 > 0, keys from the cache) by chunks."""
    d, sd, cfg = made(name)
    model = _load(d)
    prompt = _batch(model.config.vocab, seed=1)[0, :20]
    model.attention_rows = -1
    want = model.generate(prompt, max_new_tokens=12, temperature=0.0)
    model.attention_rows = 3
    got = model.generate(prompt, max_new_tokens=12, temperature=0.0)
    np.testing.assert_array_equal(got, want)
    full = _reference(name, sd, cfg, np.asarray(got).ravel()[:T])
    model.attention_rows = 7
    assert rel_err(model.forward(np.asarray(got).ravel()[:T]), full) <= TOL


def test_hooked_layer_takes_full_path_others_chunks(made):
    """A hook on one layer's map: that layer materialises it (the hook sees the
    whole [N, T, S] map), the others stay chunked; nothing else changes."""
    d, sd, cfg = made("static-groups2")
    model = _load(d)
    toks = _batch(model.config.vocab, seed=2)[0]
    model.attention_rows = 4
    plain = model.forward(toks)
    logits, cache = model.run_with_cache(toks, names=["blocks.1.attn.pattern", "blocks.0.attn.pre.static"])
    assert cache["blocks.1.attn.pattern"].shape == (model.config.n_head, T, T)
    assert rel_err(logits, plain) <= TWO_PASSES
    # a write hook on a chunked model: zeroing a layer's composed pattern
    # changes the run the same way on either path
    zero = [("blocks.0.attn.pattern_composed", lambda x, hook: np.zeros_like(x))]
    with_chunks = model.run_with_hooks(toks, fwd_hooks=zero)
    model.attention_rows = -1
    assert rel_err(with_chunks, model.run_with_hooks(toks, fwd_hooks=zero)) <= TWO_PASSES


def test_gradients_unchanged_by_the_setting(made):
    """The tape keeps the maps, so it takes the fused / full path whatever the
    setting: the same gradient bit for bit."""
    d, sd, cfg = made("dcpythia")
    model = _load(d)
    toks = _batch(model.config.vocab, seed=3)[0]
    want = model.gradients(toks, target=("logit", T - 1, int(toks[-1])), wrt="blocks.1.attn.z")
    model.attention_rows = 6
    got = model.gradients(toks, target=("logit", T - 1, int(toks[-1])), wrt="blocks.1.attn.z")
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_auto_chunks_long_inputs_of_unfused_variants(made):
    """auto (0): a variant without the fused kernel whose [B, N, T, S] map is
    over 64 MiB runs by chunks: the pass holds one chunk of at most 64 MiB where
    the full path holds the map, and gives the full path's logits."""
    d, sd, cfg = made("static-groups2")
    model = _load(d)
    N, Tl = model.config.n_head, 3000
    map_bytes = N * Tl * Tl * 4
    assert map_bytes > 64 << 20
    toks = np.random.default_rng(4).integers(0, model.config.vocab, size=Tl)
    warnings.simplefilter("ignore", dclens.ContextWarning)  # past the tiny model's n_ctx
    auto = model.forward(toks)
    chunked_peak = model.last_pass_memory()["peak"]
    model.attention_rows = -1
    full = model.forward(toks)
    full_peak = model.last_pass_memory()["peak"]
    assert map_bytes <= full_peak and chunked_peak <= full_peak - map_bytes + (64 << 20), (
        chunked_peak,
        map_bytes,
        full_peak,
    )
    assert rel_err(auto, full) <= forward_tol(tiny(n_layer=3), Tl, 3 * Tl * 64, sides=2)


@pytest.mark.parametrize("bad", [-2, 1.5, "8", True, None, 1 << 40])
def test_bad_attention_rows(made, bad):
    model = _load(made("dcpythia")[0])
    model.attention_rows = 9
    with pytest.raises(dclens.Error, match="attention_rows"):
        model.attention_rows = bad
    assert model.attention_rows == 9  # unchanged


def test_attention_rows_not_from_a_hook(made):
    model = _load(made("dcpythia")[0])

    def hook(x, hook):
        model.attention_rows = 3

    with pytest.raises(dclens.Error, match="attention_rows: not from a hook"):
        model.run_with_hooks(np.arange(5), fwd_hooks=[("blocks.0.hook_resid_pre", hook)])
    assert model.attention_rows == 0
