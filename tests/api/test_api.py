"""The researcher's API: TransformerLens-style names and conveniences, batches
of prompts, weights by role, cache helpers, routing from a cache, and the
fixes of issue 15."""

import os
import re
import stat
import subprocess
import sys
import warnings

import numpy as np
import pytest

import dclens
from dclens import cache as dc
from dclens import circuits, routing
from dclens import interventions as iv

from conftest import rel_err, shared_path
from reference import ref_forward
from tolerances import f32_tol, f64_tol, forward_tol, tiny

DCP = dict(model_type="dcpythia", n_layer=2, window_size=3, seed=61)
DCP_QW = dict(model_type="dcpythia", n_layer=2, window_size=3, query_wise=True, seed=62)
NEOX = dict(model_type="gpt_neox", n_layer=2, seed=63)
SEQ = dict(model_type="dcpythia", n_layer=2, window_size=3, use_parallel_residual=False, seed=64)
TOL = forward_tol(tiny(), 40, 40 * 64)  # engine vs float64 reference (tests/tolerances.py)
# a batch row vs the same prompt alone (or a pass with other hooks, so other
# layers on the fused path): two float32 passes with other GEMM blockings
TWO_PASSES = forward_tol(tiny(), 40, 3 * 40 * 64, sides=2)
# residual decompositions: the stream is a float32 sum of 1 + 2 L components
RESID_SUM = f32_tol(1 + 2 * 2, 1, 11 * 32)
PROMPTS = ["When Mary and John went to the store, John gave a drink to", "Hello", "The cat sat on the mat"]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from dclens.testing.make_tiny import make_tiny

    d = str(tmp_path_factory.mktemp("apitext"))
    make_tiny(
        d,
        model_type="dcpythia",
        n_layer=2,
        dim=32,
        n_head=4,
        vocab=50304,
        window_size=3,
        tokenizer=shared_path("data", "gpt-neox-20b-tokenizer.json"),
        seed=65,
    )
    return dclens.load(d)


def _toks(model, T=11, seed=0):
    return np.random.default_rng(seed).integers(0, model.config.vocab, size=T)


# ---------------------------------------------------------------- names


def test_tl_names_and_cache_shorthand(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _toks(model)
    _, c1 = model.run_with_cache(
        toks, names_filter=["blocks.1.attn.hook_pattern", "hook_embed", "blocks.0.attn.hook_z"]
    )
    assert set(c1) == {"blocks.1.attn.pattern", "embed", "blocks.0.attn.z"}
    _, c2 = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    assert set(c2) == {"blocks.0.attn.pattern", "blocks.1.attn.pattern"}
    np.testing.assert_array_equal(c2["pattern", 1], c1["blocks.1.attn.pattern"])
    np.testing.assert_array_equal(c2["pattern", -1], c2["blocks.1.attn.hook_pattern"])
    assert "blocks.0.attn.hook_pattern" in c2 and ("pattern", 0) in c2 and ("z", 0) not in c2
    r = repr(c1)
    assert r.startswith("Cache(3 activations:") and "blocks.1.attn.pattern [4, 11, 11]" in r
    assert not re.search(r"\d\.\d", r)  # names and shapes, no values
    assert dclens.hook_name("pattern", 3) == "blocks.3.attn.pattern"
    assert dclens.hook_name("post.kp", 2) == "blocks.2.attn.post.kp"
    # the TL spelling works wherever a hook is named (gradients suggested it, then refused it)
    assert model.parse_hook("blocks.0.hook_resid_pre") == model.parse_hook("blocks.0.resid_pre")
    g = model.gradients(toks, ("logit", 1, 2), ["blocks.0.hook_resid_pre", "blocks.0.resid_pre"])
    np.testing.assert_array_equal(g["blocks.0.hook_resid_pre"], g["blocks.0.resid_pre"])
    assert dclens.hook_name("result", 0) == "blocks.0.attn.head_out"
    assert dclens.hook_name("embed") == "embed"
    assert dclens.hook_name("blocks.1.ln1.hook_normalized") == "blocks.1.ln_attn"
    assert model.hook_name("resid_post", -1) == "blocks.1.resid_post"
    for bad, match in [
        (("pattern",), "give a layer"),
        (("nope", 0), "unknown short name"),
        (("embed", 1), "not a per-layer"),
    ]:
        with pytest.raises(dclens.Error, match=match):
            dclens.hook_name(*bad)
    with pytest.raises(KeyError, match="cache has no 'blocks.0.mlp.out'"):
        c1["mlp_out", 0]
    with pytest.raises(dclens.Error, match="names or names_filter"):
        model.run_with_cache(toks, names=["embed"], names_filter=["embed"])
    with pytest.raises(dclens.Error, match="unknown hook 'blocks.0.attn.hook_nope'"):
        model.run_with_cache(toks, names_filter=["blocks.0.attn.hook_nope"])


def test_hooks_context_manager_add_hook_and_cache_names_none(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _toks(model)
    plain = model(toks)
    ablate = iv.ablate_head(model, 1, 2)
    want = model.run_with_hooks(toks, fwd_hooks=[ablate])
    with model.hooks([ablate]):
        np.testing.assert_array_equal(model(toks), want)
        _, c = model.run_with_cache(toks, names=["blocks.1.attn.z"])
        assert np.all(c["z", 1][:, 2] == 0)
    np.testing.assert_array_equal(model(toks), plain)
    model.add_hook("blocks.1.attn.hook_z", ablate[0][1])  # a Hooks holds (name, fn) pairs
    np.testing.assert_array_equal(model(toks), want)
    model.reset_hooks()
    np.testing.assert_array_equal(model(toks), plain)
    logits, cache = model.run_with_hooks(toks, fwd_hooks=[ablate], cache_names=None)
    assert set(cache) == {n for n in model.hook_names if not n.endswith(dclens.names.SPLIT_INPUTS)}
    np.testing.assert_array_equal(logits, want)
    assert model.run_with_hooks(toks, fwd_hooks=[ablate]).shape == want.shape  # no cache by default


def test_batch_axis_option(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d, always_batch=True)
    toks = _toks(model)
    logits, cache = model.run_with_cache(toks, names=["blocks.0.attn.pattern"])
    assert logits.shape == (1, 11, model.config.vocab)
    assert cache["pattern", 0].shape == (1, 4, 11, 11)
    seen = []
    model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.z", lambda a, n: seen.append(a.shape))])
    assert seen == [(1, 11, 4, 8)]
    plain = dclens.load(d)
    assert plain(toks).shape == (11, model.config.vocab)


# ---------------------------------------------------------------- tokens and batches


def test_tokens_helpers(text_model):
    m = text_model
    toks, lens = m.to_tokens(PROMPTS)
    assert toks.shape == (3, max(lens)) and lens.tolist() == [len(m.to_tokens(p)) for p in PROMPTS]
    strs = m.to_str_tokens(toks, lengths=lens)
    assert isinstance(strs, list) and len(strs) == 3 and strs[1] == m.to_str_tokens("Hello")
    assert len(m.to_str_tokens(toks)) == 3 and len(m.to_str_tokens(toks)[0]) == toks.shape[1]
    assert m.to_str_tokens(PROMPTS)[2] == m.to_str_tokens(PROMPTS[2])
    assert m.to_string(m.to_tokens(PROMPTS[0])) == PROMPTS[0]
    assert m.to_string(toks[:, :1]) == [m.to_str_tokens(p)[0] for p in PROMPTS]
    assert m.to_single_token(" Mary") == int(m.to_tokens(" Mary")[0])
    with pytest.raises(dclens.Error, match="not one"):
        m.to_single_token(" Mary and John")
    left, llens = m.to_tokens(PROMPTS, padding_side="left")
    assert np.array_equal(left[1, -1:], m.to_tokens("Hello")) and np.array_equal(llens, lens)


@pytest.mark.parametrize("side", ["right", "left"])
def test_batched_prompts_equal_one_by_one(text_model, side):
    m = text_model
    toks, lens = m.to_tokens(PROMPTS, padding_side=side)
    T = toks.shape[1]
    hook = iv.ablate_head(m, 1, 1)
    names = [
        "blocks.0.attn.pattern",
        "blocks.1.attn.pattern_composed",
        "blocks.1.resid_post",
        "blocks.0.attn.dyn.pre.kw1",
    ]
    for call in ("cache", "hooks", "strings"):
        if call == "cache":
            logits, cache = m.run_with_cache((toks, lens), names=names, padding_side=side)
        elif call == "hooks":
            logits, cache = m.run_with_hooks(toks, fwd_hooks=[hook], cache_names=names, lengths=lens, padding_side=side)
        else:
            logits, cache = m.run_with_cache(PROMPTS, names=names, padding_side=side)
        for i, p in enumerate(PROMPTS):
            n = lens[i]
            sl = slice(0, n) if side == "right" else slice(T - n, T)
            one, c1 = (
                m.run_with_cache(p, names=names)
                if call != "hooks"
                else m.run_with_hooks(p, fwd_hooks=[hook], cache_names=names)
            )
            assert rel_err(logits[i, sl], one) <= TWO_PASSES, (call, i)
            for name in names:
                a = cache[name][i]
                a = a[:, sl, sl] if a.ndim == 3 and name.endswith(("pattern", "composed")) else a[sl]
                assert rel_err(a, c1[name]) <= TWO_PASSES, (call, i, name)


def test_left_padded_hooks_see_the_callers_layout(text_model):
    m = text_model
    toks, lens = m.to_tokens(PROMPTS, padding_side="left")
    seen = []

    def last_pos(a, n):  # writes at the last position of every row
        seen.append(a.shape)
        a[:, -1] = 0.0
        return a

    lg = m.run_with_hooks(toks, fwd_hooks=[("blocks.1.mlp.out", last_pos)], lengths=lens, padding_side="left")
    for i, p in enumerate(PROMPTS):
        one = m.run_with_hooks(p, fwd_hooks=[("blocks.1.mlp.out", lambda a, n: np.concatenate([a[:-1], 0 * a[-1:]]))])
        assert rel_err(lg[i, -1], one[-1]) <= TWO_PASSES
    assert seen == [(3, toks.shape[1], 32)]

    def halve_last_query(a, n):  # an attention map: both position axes follow the caller's layout
        a[..., -1, :] *= 0.5
        return a

    lg = m.run_with_hooks(
        toks, fwd_hooks=[("blocks.1.attn.pattern_composed", halve_last_query)], lengths=lens, padding_side="left"
    )
    for i, p in enumerate(PROMPTS):
        one = m.run_with_hooks(p, fwd_hooks=[("blocks.1.attn.pattern_composed", halve_last_query)])
        assert rel_err(lg[i, -1], one[-1]) <= TWO_PASSES
        assert rel_err(lg[i, -1], m(p)[-1]) > 10 * TWO_PASSES  # an effect, far above rounding


def test_loss(text_model):
    m = text_model
    p = PROMPTS[0]
    lg = m(p).astype(np.float64)
    t = m.to_tokens(p)
    lp = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
    want = -lp[np.arange(len(t) - 1), t[1:]]
    # the engine's loss: a float32 log-softmax over V (a reduction of length V)
    # of float32 logits, whose error relative to max|logit| is TWO_PASSES-like
    lt = f32_tol(64, 2, want.size) * max(1.0, float(np.abs(lg).max()))
    assert abs(m(p, return_type="loss") - want.mean()) < lt
    np.testing.assert_allclose(m.forward(p, return_type="loss", loss_per_token=True), want, rtol=0, atol=lt)
    logits, loss = m.forward(p, return_type="both")
    assert logits.shape == lg.shape and abs(loss - want.mean()) < lt
    # batch: the mean over every real predicted token, padding left out, either side
    per = [m.forward(q, return_type="loss", loss_per_token=True) for q in PROMPTS]
    total = np.concatenate(per).mean()
    for side in ("right", "left"):
        # batched vs one by one: two passes (TWO_PASSES on the logits) then the log-softmax
        assert abs(m.forward(PROMPTS, return_type="loss", padding_side=side) - total) < lt + TWO_PASSES * float(
            np.abs(lg).max()
        )
    assert m.forward(p, return_type=None) is None
    with pytest.raises(dclens.Error, match="return_type"):
        m.forward(p, return_type="probs")


def test_bad_batch_inputs(text_model):
    m = text_model
    toks, lens = m.to_tokens(PROMPTS)
    for kw, match in [
        (dict(lengths=[1, 2]), r"lengths must be \[B\]"),
        (dict(lengths=[0, 1, 1]), "lengths must be in"),
        (dict(lengths=lens, padding_side="middle"), "padding_side"),
    ]:
        with pytest.raises(dclens.Error, match=match):
            m.forward(toks, **kw)
    with pytest.raises(dclens.Error, match="needs \\[B, T\\]"):
        m.forward(toks[0], lengths=[3])
    with pytest.raises(dclens.Error, match="to_tokens"):
        m.to_tokens([1, 2])


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize("kw", [DCP, NEOX], ids=["dcpythia", "pythia"])
def test_weights_by_role(tiny_factory, kw):
    d, _, _ = tiny_factory(**kw)
    model = dclens.load(d)
    c = model.config
    toks = _toks(model)
    logits, cache = model.run_with_cache(toks)
    names = model.weight_names()
    assert "tok_embeddings.weight" in names and "layers.1.attention.wo.weight" in names
    assert model.W_Q.shape == (c.n_layer, c.n_head, c.d_model, c.head_dim) == model.W_K.shape == model.W_V.shape
    assert model.W_O.shape == (c.n_layer, c.n_head, c.head_dim, c.d_model)
    assert model.W_E.shape == (c.vocab, c.d_model) and model.W_U.shape == (c.d_model, c.vocab)
    # each check recomputes one stage in float64 from the engine's float32 input:
    # one reduction (f32_tol(D or F)), well inside TOL (a whole pass's bound)
    for l in range(c.n_layer):
        x = cache["ln_attn", l].astype(np.float64)
        v = np.einsum("td,ndh->tnh", x, model.W_V[l]) + model.b_V[l]
        assert rel_err(v, cache["v", l]) <= TOL
        ho = np.einsum("tnh,nhd->tnd", cache["z", l].astype(np.float64), model.W_O[l])
        assert rel_err(ho, cache["head_out", l]) <= TOL
        assert rel_err(ho.sum(1) + model.b_O[l], cache["attn.out", l]) <= TOL
        mlp_pre = cache["ln_mlp", l] @ model.W_in[l] + model.b_in[l]
        assert rel_err(mlp_pre, cache["mlp.pre", l]) <= TOL
        assert rel_err(cache["mlp.post", l] @ model.W_out[l] + model.b_out[l], cache["mlp_out", l]) <= TOL
        if not c.qk_norm:
            q = np.einsum("td,ndh->tnh", x, model.W_Q[l]) + model.b_Q[l]
            r = c.rotary_dim
            assert rel_err(q[..., r:], cache["q", l][..., r:]) <= TOL  # dims past rotary: unchanged
    assert rel_err(cache["ln_final"] @ model.W_U, logits) <= TOL
    assert model.ln_final_w.shape == (c.d_model,) and model.ln_attn_w.shape == (c.n_layer, c.d_model)
    if c.use_dcmha:
        assert model.dyn_w1.shape[0] == c.n_layer and model.q_norm.shape == (c.n_layer, c.head_dim)


# ---------------------------------------------------------------- cache helpers, DLA


@pytest.mark.parametrize("kw", [DCP, NEOX, SEQ], ids=["dcpythia", "pythia", "sequential"])
def test_residual_decompositions_and_dla(tiny_factory, kw):
    d, _, _ = tiny_factory(**kw)
    model = dclens.load(d)
    toks = _toks(model)
    logits, cache = model.run_with_cache(toks)
    final = cache["resid_post", -1]
    comps, labels = cache.decompose_resid(return_labels=True)
    assert comps.shape == (1 + 2 * model.config.n_layer,) + final.shape and labels[0] == "embed"
    assert rel_err(comps.sum(0), final) <= RESID_SUM
    heads, hl = cache.stack_head_results(return_labels=True, incl_remainder=True)
    assert hl[0] == "L0H0" and hl[-1] == "remainder"
    assert rel_err(heads.sum(0), final) <= RESID_SUM + f32_tol(model.config.n_head, 1, final.size)  # + the head sum
    acc = cache.accumulated_resid(layer=1)
    np.testing.assert_array_equal(acc[1], cache["resid_pre", 1])
    # LN as a linear map: summed components + ln_final bias = ln_final
    normed = cache.apply_ln_to_stack(comps)
    # + the LayerNorm (a reduction of length D, gain COND)
    assert rel_err(normed.sum(0) + model.ln_final_b, cache["ln_final"]) <= RESID_SUM + f32_tol(32, 1, final.size)
    tok = int(toks[3])
    attrs = cache.logit_attrs(comps, tokens=tok)  # [C, T]
    UNEMBED = RESID_SUM + f32_tol(32, 2, logits.size)  # + LayerNorm and the unembedding (length D)
    assert rel_err(attrs.sum(0) + model.ln_final_b @ model.W_U[:, tok], logits[:, tok]) <= UNEMBED
    diff = cache.logit_attrs(comps, tokens=np.full(11, tok), incorrect_tokens=np.full(11, 0))
    bias_diff = model.ln_final_b @ (model.W_U[:, tok] - model.W_U[:, 0])
    assert rel_err(diff.sum(0) + bias_diff, logits[:, tok] - logits[:, 0]) <= 2 * UNEMBED
    for by in ("head", "layer"):
        a, lab = dc.dla(cache, token=tok, pos=-2, by=by)
        assert len(a) == len(lab) and lab[-1] == "ln_final.bias"
        assert abs(a.sum() - logits[-2, tok]) <= UNEMBED * np.abs(logits).max()
    _, bcache = model.run_with_cache(np.stack([toks, toks]))
    r = dc.dla(cache, token=tok, pos=-2)  # a named result (values, labels) that unpacks as before
    assert r.values is r[0] and r.labels is r[1] and r.top(1)[0][1] == r.values[np.argmax(np.abs(r.values))]
    a, _ = dc.dla(bcache, token=tok, pos=-1, batch=1)
    assert abs(a.sum() - logits[-1, tok]) <= (UNEMBED + TWO_PASSES) * np.abs(logits).max()  # batched pass
    with pytest.raises(dclens.Error, match="batch="):
        dc.dla(bcache, token=tok)
    _, small = model.run_with_cache(toks, names=["embed"])
    with pytest.raises(dclens.Error, match="cache has no blocks.0.attn.out"):
        small.decompose_resid()


# ---------------------------------------------------------------- routing from a cache


@pytest.mark.parametrize("kw", [DCP, DCP_QW, NEOX], ids=["dcpythia", "query_wise", "pythia"])
@pytest.mark.parametrize("phase", ["pre", "post"])
def test_routing_from_cache_equals_per_query_calls(tiny_factory, kw, phase):
    d, _, _ = tiny_factory(**kw)
    model = dclens.load(d)
    toks = _toks(model, 9, 2)
    _, cache = model.run_with_cache(toks)
    R = routing.routing_matrices(model, cache, phase)  # one step, every query and layer
    L, N = model.config.n_layer, model.config.n_head
    assert R.shape == (L, 9, N, N)
    # routing_matrix runs its own pass (only its hooks: other layers may take the
    # fused path): float32 inputs of two passes; the map itself is float64 numpy.
    rt = forward_tol(tiny(), 9, 2 * 9 * 9 * N * N, sides=2)
    same = f64_tol(9, 2, 9 * 9 * N * N)  # one cache, float64, vectorised vs looped
    for l in range(L):
        for t in range(9):
            np.testing.assert_allclose(R[l, t], model.routing_matrix(toks, l, phase, t), rtol=rt, atol=rt)
    np.testing.assert_allclose(
        routing.routing_matrices(model, cache, phase, layers=[-1], queries=[-1])[0, 0],
        model.routing_matrix(toks, L - 1, phase, -1),
        rtol=rt,
        atol=rt,
    )
    C = routing.composition_maps(model, cache, 1, phase)
    assert C.shape == (9, 9, N, N)
    for t, s in [(5, 2), (8, 8), (3, 0)]:
        np.testing.assert_allclose(C[t, s], model.composition_map(toks, 1, phase, t, s), rtol=rt, atol=rt)
    np.testing.assert_allclose(routing.composition_maps(model, cache, 1, phase, query=-1), C[-1], atol=same)
    np.testing.assert_allclose(routing.composition_maps(model, cache, 1, phase, key=2), C[:, 2], atol=same)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model.composition_map(toks, 1, phase, 2, 5)
        routing.composition_maps(model, cache, 0, phase, query=8, key=1)  # outside layer 0's window (local)
    assert len(w) == (2 if 0 in model.config.local_layers else 1)
    assert all(issubclass(x.category, routing.MaskedPairWarning) for x in w)
    with pytest.raises(dclens.Error, match="query position -10 is out of range"):
        model.routing_matrix(toks, 0, phase, -10)
    np.testing.assert_allclose(model.routing_matrix(None, 1, phase, -2, cache=cache), R[1, -2], atol=same)
    np.testing.assert_allclose(model.composition_map(None, 1, phase, 4, 1, cache=cache), C[4, 1], atol=same)
    if model.config.use_dcmha:
        g = model.gates(None, 1, cache=cache)
        for k, v in model.gates(toks, 1).items():
            np.testing.assert_array_equal(g[k], v)
        G, W = model.config.compose_groups, routing.static_map(model, 1, phase)
        np.testing.assert_allclose(routing.routing_from_cache(cache, 1, phase, 4, 1, N, G, W), C[4, 1], atol=same)
        with pytest.raises(dclens.Error, match="n_head is %d but the cached gates have %d heads" % (N + 1, N)):
            routing.routing_from_cache(cache, 1, phase, 4, 1, N + 1, G, W)
        with pytest.raises(dclens.ArgumentError, match="phase must be"):
            routing.routing_from_cache(cache, 1, "middle", 4, 1, N, G, W)


# ---------------------------------------------------------------- fixes


@pytest.mark.parametrize("kw", [DCP, NEOX], ids=["dcpythia", "pythia"])
def test_writes_to_masked_cells_are_ignored(tiny_factory, kw):
    d, _, _ = tiny_factory(**kw)
    model = dclens.load(d)
    toks = _toks(model, 9, 4)
    plain = model(toks)

    def fill_masked(a, n):
        T = a.shape[-1]
        a[..., ~np.tril(np.ones((T, T), bool))] = 7.6
        return a

    names = [
        "blocks.%d.attn.%s" % (l, p) for l in range(2) for p in ("pattern", "pattern_composed", "post.kp", "scores")
    ]
    names = [n for n in names if n in model.hook_names]
    for n in names:
        logits, cache = model.run_with_hooks(toks, fwd_hooks=[(n, fill_masked)], cache_names=[n])
        np.testing.assert_array_equal(logits, plain, err_msg=n)
        if "scores" not in n:
            assert np.all(cache[n][..., ~np.tril(np.ones((9, 9), bool))] == 0), n


def test_head_helpers_take_dyn_hooks_and_check_arguments_up_front(tiny_factory):
    d, sd, cfg = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _toks(model)
    name = "blocks.1.attn.dyn.pre.qdd"
    got = model.run_with_hooks(toks, fwd_hooks=[iv.scale(model, name, 0.0, head=2)])

    def zero_head2(a):
        a = a.copy()
        a[:, 2] = 0
        return a

    assert rel_err(got, ref_forward(sd, cfg, toks, interventions={name: zero_head2})) <= TOL
    _, other = model.run_with_cache(_toks(model, 11, 9), names=["blocks.0.attn.dyn.post.kw2"])
    h = iv.patch(model, "blocks.0.attn.dyn.post.kw2", other, head=1)
    _, c = model.run_with_hooks(toks, fwd_hooks=[h], cache_names=["blocks.0.attn.dyn.post.kw2"])
    np.testing.assert_array_equal(c["blocks.0.attn.dyn.post.kw2"][..., 1], other["blocks.0.attn.dyn.post.kw2"][..., 1])
    iv.ablate_head(model, 0, 3, point="attn.dyn.post.qw1")
    for call, match in [
        (lambda: iv.scale(model, "blocks.0.resid_pre", 2.0, head=1), "has no head axis"),
        (lambda: iv.scale(model, "blocks.0.attn.z", 2.0, head=9), "head 9 is out of range"),
        (lambda: iv.scale(model, "blocks.0.attn.z", float("nan")), "finite"),
        (lambda: iv.patch(model, "blocks.0.attn.dyn.post.kw2", other, positions=[40]), "position 40"),
        (lambda: iv.ablate_head(model, 0, 1, point="mlp.out"), "has no head axis"),
        (lambda: iv.ablate_head(model, 0, 1, kind="mean", mean=np.zeros(5)), "last axis must be 8"),
    ]:
        with pytest.raises(dclens.Error, match=match):
            call()


def test_ov_readout_tied_embeddings(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="dcpythia", n_layer=2, seed=66, tie_word_embeddings=True)
    model = dclens.load(d)
    top = circuits.ov_readout(model, 1, 2, token=5, k=3)
    assert len(top) == 3
    np.testing.assert_array_equal(model.W_U, model.W_E.T)


def test_figures_show_without_matplotlib_inline():
    from dclens import plots

    fig = plots.plot_heads(np.random.default_rng(0).random((2, 5, 5)))
    png = fig._repr_png_()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_heatmap_fixes(text_model, tmp_path):
    from dclens import heatmaps as hm

    m = text_model
    png = hm.attention_heatmap(m, PROMPTS[0], layer=1, hook="pattern")
    assert png._args["panel_vmin"] == [0.0] * m.config.n_head  # each panel's colour bar from 0 for a softmax pattern
    assert hm.attention_heatmap(m, PROMPTS[0], layer=1, hook="pattern", scale="shared")._args["vmin"] == 0.0
    png = hm.attention_heatmap(m, PROMPTS[0], layer="all", head=0, hook="pattern")
    assert m.name in png._args["title"]  # the model name in the title
    assert png._args["panel_windows"] == [m.config.window_size if l in m.config.local_layers else 0 for l in range(2)]
    no_axes = hm.heatmap(np.eye(4), axis_titles=False)
    with_axes = hm.heatmap(np.eye(4))
    import io

    from PIL import Image

    w0, h0 = Image.open(io.BytesIO(bytes(no_axes))).size
    w1, h1 = Image.open(io.BytesIO(bytes(with_axes))).size
    assert w1 > w0 and h1 > h0  # room for "query" / "key"
    with pytest.raises(dclens.Error, match="grid_cols"):
        hm.heatmap(np.eye(4), grid_cols=-1)


# ---------------------------------------------------------------- command line


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dclens.cli", *args], capture_output=True, text=True)


def test_cli_info_make_tiny_and_heatmap(tmp_path, text_model):
    out = tmp_path / "tiny"
    r = _cli("make-tiny", str(out), "--seed", "3")
    assert r.returncode == 0, r.stderr
    mask = os.umask(0)
    os.umask(mask)
    for f in os.listdir(out):
        assert stat.S_IMODE(os.stat(out / f).st_mode) == 0o666 & ~mask, f
    assert "usage: dclens make-tiny" in _cli("make-tiny", "--help").stdout
    r = _cli("info", "--model", str(out))
    assert r.returncode == 0 and "9.999999747" not in r.stdout and "1e-05" in r.stdout
    assert "blocks.{l}.attn.pattern" in r.stdout and "[N=4, T, S]" in r.stdout
    pngs = []
    for cols in ("1", "4"):
        p = tmp_path / ("h%s.png" % cols)
        r = _cli(
            "heatmap",
            "--model",
            text_model.path,
            "--text",
            "The cat sat",
            "--layer",
            "0",
            "--grid-cols",
            cols,
            "--cell-px",
            "6",
            "--out",
            str(p),
        )
        assert r.returncode == 0, r.stderr
        from PIL import Image

        pngs.append(Image.open(p).size)
    assert pngs[0][1] > pngs[1][1]  # one panel per row: a taller picture than 4 per row


def test_synth_limit_samples_across_tasks(tmp_path):
    from synth_tasks.dataset import load_dataset, sample_across_tasks

    ds = load_dataset(shared_path("data", "synthetic_dataset.jsonl"))
    few = sample_across_tasks(ds, 20)
    assert len(few) == 20 and len({l.task_id for l in few}) == 20
    assert [l.lineno for l in few] == sorted(l.lineno for l in few)
    assert len({l.task_id for l in ds.lines[:20]}) < 5  # what --limit used to take


# ---------------------------------------------------------------- TransformerLens arguments (issue 24)


def _ln(x, w, b, eps):
    x = np.asarray(x, np.float64)
    c = x - x.mean(-1, keepdims=True)
    return c / np.sqrt((c**2).mean(-1, keepdims=True) + eps) * w + b


@pytest.mark.parametrize("kw", [DCP, SEQ], ids=["parallel", "sequential"])
def test_residual_helpers_take_tl_arguments(tiny_factory, kw):
    """incl_mid, mlp_input, mode, incl_embeds, pos_slice and apply_ln, checked against the
    cached residual and the LayerNorms recomputed here from the checkpoint's weights."""
    d, sd, cfg = tiny_factory(**kw)
    model = dclens.load(d)
    eps = model.config.norm_eps
    toks = _toks(model)
    _, cache = model.run_with_cache(toks)
    acc, lab = cache.accumulated_resid(incl_mid=True, return_labels=True)
    assert lab == ["0_pre", "0_mid", "1_pre", "1_mid", "final_post"]
    for l in range(2):
        mid = acc[lab.index("%d_mid" % l)]
        assert rel_err(mid, cache["resid_pre", l] + cache["attn_out", l]) <= 1e-6
        if not model.config.parallel_residual:  # a sequential block's MLP reads resid_mid
            ln = _ln(mid, sd["layers.%d.ffn_norm.weight" % l], sd["layers.%d.ffn_norm.bias" % l], eps)
            assert rel_err(ln, cache["ln_mlp", l]) <= 1e-5
    a1, l1 = cache.accumulated_resid(layer=1, mlp_input=True, return_labels=True)
    assert l1 == ["0_pre", "1_pre", "1_mid"]
    np.testing.assert_array_equal(cache.accumulated_resid(pos_slice=-1), cache.accumulated_resid()[:, -1])
    # decompose_resid: modes, embeds, positions; each LayerNorm as a linear map sums to the LN output
    comps, labels = cache.decompose_resid(mode="attn", incl_embeds=False, return_labels=True)
    assert labels == ["0_attn_out", "1_attn_out"]
    assert cache.decompose_resid(mode="mlp", return_labels=True)[1] == ["embed", "0_mlp_out", "1_mlp_out"]
    pos = [1, 3, 7]
    part = cache.decompose_resid(pos_slice=pos, apply_ln=True)
    assert rel_err(part.sum(0) + sd["norm.bias"], cache["ln_final"][pos]) <= 1e-5
    for mlp_input in (False, True):
        comps, labels = cache.decompose_resid(
            layer=1, mlp_input=mlp_input, apply_ln=True, pos_slice=slice(2, 9), return_labels=True
        )
        name = "ffn_norm" if mlp_input else "attention_norm"
        want = cache["ln_mlp" if mlp_input else "ln_attn", 1][2:9]
        assert rel_err(comps.sum(0) + sd["layers.1.%s.bias" % name], want) <= 1e-5, mlp_input
        assert ("1_attn_out" in labels) == (mlp_input and not model.config.parallel_residual)
    heads = cache.stack_head_results(pos_slice=-2, apply_ln=True, incl_remainder=True)
    assert rel_err(heads.sum(0) + sd["norm.bias"], cache["ln_final"][-2]) <= 1e-5
    tok = int(toks[4])
    attrs = cache.logit_attrs(cache.decompose_resid(pos_slice=-1), tokens=tok, pos_slice=-1)
    logits = model(toks)
    assert rel_err(attrs.sum() + sd["norm.bias"] @ model.W_U[:, tok], logits[-1, tok]) <= 1e-5
    for bad, match in (
        (dict(mode="heads"), "mode"),
        (dict(pos_slice=99), "pos_slice"),
        (dict(pos_slice="last"), "pos_slice"),
        (dict(mode="mlp", incl_embeds=False, layer=0), "no components"),
    ):
        with pytest.raises(dclens.Error, match=match):
            cache.decompose_resid(**bad)


def test_test_prompt(capsys):
    model = dclens.load("dcpythia-tiny")
    prompt, answer = "Kenneth likes Manchester. Margaret likes Novosibirsk. Kenneth does not long for", "Novosibirsk"
    r = dclens.test_prompt(model, prompt, answer, top_k=4)
    out = capsys.readouterr().out
    ids = model.to_tokens(prompt + " " + answer)
    P = len(model.to_tokens(prompt))
    z = np.asarray(model(ids), np.float64)
    for i, a in enumerate(r):
        p = np.exp(z[P - 1 + i] - z[P - 1 + i].max())
        p /= p.sum()
        assert a.prob == pytest.approx(p[ids[P + i]], rel=1e-4)
        assert a.rank == int((p > p[ids[P + i]]).sum())
        assert len(a.top) == 4 and a.top[0][1] == pytest.approx(p.max(), rel=1e-4)
        assert ("Rank %d: %r" % (a.rank, a.token)) in out
    assert dclens.test_prompt(prompt, answer, model, print_details=False, top_k=4) == r  # TL order
    assert capsys.readouterr().out == ""
    with pytest.raises(dclens.Error, match="dclens.Model"):
        dclens.test_prompt("a", "b", "c")
    with pytest.raises(dclens.Error, match="non-empty"):
        dclens.test_prompt(model, prompt, " ")


def test_hook_predicates_filters_and_cache_misses(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _toks(model, 6)
    seen = []
    model.run_with_hooks(toks, fwd_hooks=[(lambda n: n.endswith("hook_pattern"), lambda a, n: seen.append(n))])
    assert seen == ["blocks.0.attn.pattern", "blocks.1.attn.pattern"]
    halved = model.run_with_hooks(toks, fwd_hooks=[(lambda n: n == "blocks.1.attn.z", lambda a, n: a * 0.5)])
    one = model.run_with_hooks(toks, fwd_hooks=[("blocks.1.attn.z", lambda a, n: a * 0.5)])
    np.testing.assert_array_equal(halved, one)
    with model.hooks([(lambda n: n.endswith("mlp.out"), lambda a, n: a * 0)]):
        zeroed = model(toks)
    np.testing.assert_array_equal(
        zeroed, model.run_with_hooks(toks, fwd_hooks=[("blocks.%d.mlp.out" % l, lambda a, n: a * 0) for l in range(2)])
    )
    with pytest.raises(dclens.Error, match=r"matches no hook.*closest to what it mentions: attn.hook_pattern"):
        model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_patern"))
    with pytest.raises(dclens.Error, match="matches no hook"):
        model.run_with_hooks(toks, fwd_hooks=[(lambda n: False, lambda a, n: None)])
    _, cache = model.run_with_cache(toks, names=["blocks.0.attn.pattern"])
    with pytest.raises(KeyError, match="not captured in this run"):
        cache["blocks.1.attn.pattern"]
    with pytest.raises(KeyError, match=r"not a hook of .*did you mean 'blocks.\d.attn.pattern_composed'"):
        cache["blocks.0.attn.pattern_composd"]
    with pytest.raises(KeyError, match=r"\('pattern', 5\)\): it is not a hook"):
        cache["pattern", 5]
