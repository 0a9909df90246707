"""Cache helpers take TransformerLens's ActivationCache arguments (issue 41):
logit_attrs' tokens (an id, a token string, [1], [T], [B], [B, T]) and
incorrect_tokens, pos_slice in every form of TransformerLens's Slice (int, None,
slice, tuple = slice(*tuple), list / array / range / mask), batch_slice and
has_batch_dim, layer=-1 as the final residual, get_full_resid_decomposition with
apply_ln and pos_slice together (and mlp_input on a sequential block), each
checked against a float64 computation written here from the cache and the
weights; and every bad argument is a dclens.Error naming it."""

import numpy as np
import pytest

import dclens
from dclens import cache as dc

from conftest import rel_err

DCP = dict(model_type="dcpythia", n_layer=2, window_size=3, seed=81)
SEQ = dict(model_type="dcpythia", n_layer=2, window_size=3, use_parallel_residual=False, seed=82)
T = 11
EXACT = 1e-9  # the same float64 operations on the same float32 cache, in another order
ENGINE = 1e-5  # against an engine activation (float32), as tests/api/test_api.py


def _toks(model, seed=0, n=T):
    return np.random.default_rng(seed).integers(0, model.config.vocab, size=n)


@pytest.fixture(scope="module", params=[DCP, SEQ], ids=["parallel", "sequential"])
def run(request, tiny_factory):
    d, sd, cfg = tiny_factory(**request.param)
    model = dclens.load(d)
    toks = _toks(model)
    _, cache = model.run_with_cache(toks)
    _, bcache = model.run_with_cache(np.stack([toks, _toks(model, 1)]))
    return model, sd, cache, bcache


def _ln_lin(model, comps, total, w):
    """The LayerNorm as a linear map: (c - mean c) / sigma(total) * w, float64."""
    comps = np.asarray(comps, np.float64)
    total = np.asarray(total, np.float64)
    tc = total - total.mean(-1, keepdims=True)
    scale = np.sqrt((tc**2).mean(-1, keepdims=True) + model.config.norm_eps)
    return (comps - comps.mean(-1, keepdims=True)) / scale * np.asarray(w, np.float64)


def _final_normed(model, cache):
    """decompose_resid()'s components through ln_final by hand, [C, ..., D]."""
    comps = cache.decompose_resid()
    return _ln_lin(model, comps, cache["resid_post", -1], model.ln_final_w)


def _wu(model):
    return np.asarray(model.W_U, np.float64)


# ---------------------------------------------------------------- logit_attrs


def test_logit_attrs_token_forms(run):
    model, _, cache, _ = run
    WU = _wu(model)
    normed = _final_normed(model, cache)  # [C, T, D]
    stack = cache.decompose_resid()
    toks = _toks(model, 5)
    for tokens, want in (
        (5, normed @ WU[:, 5]),
        (np.int64(5), normed @ WU[:, 5]),
        (np.array(5), normed @ WU[:, 5]),
        (np.array([5]), normed @ WU[:, 5]),  # one token for every position
        (toks, np.einsum("ctd,dt->ct", normed, WU[:, toks])),  # one per position
        (list(toks), np.einsum("ctd,dt->ct", normed, WU[:, toks])),
    ):
        got = cache.logit_attrs(stack, tokens)
        assert got.shape == want.shape and rel_err(got, want) <= EXACT, tokens
    diff = cache.logit_attrs(stack, toks, incorrect_tokens=toks[::-1])
    assert rel_err(diff, np.einsum("ctd,dt->ct", normed, WU[:, toks] - WU[:, toks[::-1]])) <= EXACT
    # the module function is the same
    assert np.array_equal(dc.logit_attrs(cache, stack, 5), cache.logit_attrs(stack, 5))


def test_logit_attrs_one_position_with_one_token_arrays(run):
    """The issue's call: a [C, D] stack (pos_slice=-1) with [1] tokens and [1] incorrect_tokens."""
    model, sd, cache, _ = run
    WU = _wu(model)
    stack = cache.decompose_resid(layer=-1, pos_slice=-1)
    got = cache.logit_attrs(stack, tokens=np.array([5]), incorrect_tokens=np.array([6]), pos_slice=-1)
    want = _final_normed(model, cache)[:, -1] @ (WU[:, 5] - WU[:, 6])
    assert got.shape == (stack.shape[0],) and rel_err(got, want) <= EXACT
    # summed with ln_final's bias it is the logit difference the model gives
    logits = np.asarray(model(_toks(model)), np.float64)  # the prompt of the cache
    bias = sd["norm.bias"] @ (WU[:, 5] - WU[:, 6])
    assert abs(got.sum() + bias - (logits[-1, 5] - logits[-1, 6])) <= ENGINE * np.abs(logits).max()


def test_logit_attrs_token_strings():
    model = dclens.load("dcpythia-tiny")
    toks = model.to_tokens("The cat sat on the mat and looked at the dog")
    _, cache = model.run_with_cache(toks)
    stack = cache.decompose_resid(pos_slice=-1)
    a, b = model.to_single_token(" dog"), model.to_single_token(" cat")
    assert np.array_equal(cache.logit_attrs(stack, " dog", pos_slice=-1), cache.logit_attrs(stack, a, pos_slice=-1))
    assert np.array_equal(
        cache.logit_attrs(stack, " dog", " cat", pos_slice=-1), cache.logit_attrs(stack, a, b, pos_slice=-1)
    )
    with pytest.raises(dclens.Error):  # not one token
        cache.logit_attrs(stack, " dog and cat", pos_slice=-1)
    with pytest.raises(dclens.Error, match="tokens"):
        cache.logit_attrs(stack, [" dog", " cat"], pos_slice=-1)


def test_logit_attrs_batched(run):
    model, _, _, bcache = run
    WU = _wu(model)
    normed = _final_normed(model, bcache)  # [C, B, T, D]
    stack = bcache.decompose_resid()
    per_prompt = np.array([3, 9])
    per_pos = _toks(model, 7)
    both = np.stack([per_pos, per_pos[::-1]])
    cases = (
        (4, normed @ WU[:, 4]),
        (per_prompt, np.einsum("cbtd,db->cbt", normed, WU[:, per_prompt])),  # [B]: one per prompt
        (per_pos, np.einsum("cbtd,dt->cbt", normed, WU[:, per_pos])),  # [T]: one per position
        (both, np.einsum("cbtd,dbt->cbt", normed, WU[:, both])),  # [B, T]
    )
    for tokens, want in cases:
        got = bcache.logit_attrs(stack, tokens)
        assert got.shape == want.shape and rel_err(got, want) <= EXACT, tokens
    # one position: [C, B, D] with one token per prompt
    got = bcache.logit_attrs(bcache.decompose_resid(pos_slice=-1), per_prompt, pos_slice=-1)
    assert rel_err(got, np.einsum("cbd,db->cb", normed[:, :, -1], WU[:, per_prompt])) <= EXACT
    # batch_slice: taken from the stack here, and from the scale
    for bs, idx in ((1, 1), ([1], [1]), (slice(0, 1), slice(0, 1)), ((1, 2), slice(1, 2))):
        got = bcache.logit_attrs(stack, 4, batch_slice=bs)
        want = (normed @ WU[:, 4])[:, idx]
        assert got.shape == want.shape and rel_err(got, want) <= EXACT, bs
    # has_batch_dim=False: the stack is already one prompt's; batch_slice picks the scale
    got = bcache.logit_attrs(stack[:, 1], 4, batch_slice=1, has_batch_dim=False)
    assert rel_err(got, (normed @ WU[:, 4])[:, 1]) <= EXACT
    # has_ln: the stack is already normalised
    assert rel_err(bcache.logit_attrs(normed, 4, has_ln=True), normed @ WU[:, 4]) <= EXACT


# ---------------------------------------------------------------- pos_slice, layer


class _TLSlice:
    """Duck type of transformer_lens.utils.Slice (its .slice and .mode)."""

    def __init__(self, s, mode):
        self.slice, self.mode = s, mode

    def __repr__(self):
        return "Slice(%r)" % (self.slice,)


POS_FORMS = [
    (None, slice(None)),
    (-1, -1),
    (3, 3),
    (np.int64(-2), -2),
    (slice(2, 9), slice(2, 9)),
    (slice(None, None, 3), slice(None, None, 3)),
    ((2, 9), slice(2, 9)),  # TransformerLens: a tuple is slice(*tuple)
    ((5,), slice(5)),
    ((1, 10, 2), slice(1, 10, 2)),
    ([1, 3, 7], [1, 3, 7]),
    (np.array([0, -1]), [0, -1]),
    (range(4, 7), [4, 5, 6]),
    (np.arange(T) % 2 == 0, np.arange(T) % 2 == 0),  # a mask
    (_TLSlice(slice(2, 9), "slice"), slice(2, 9)),
    (_TLSlice(np.array([1, 4]), "array"), [1, 4]),
]


@pytest.mark.parametrize("pos_slice,index", POS_FORMS, ids=[repr(p)[:20] for p, _ in POS_FORMS])
def test_pos_slice_forms(run, pos_slice, index):
    model, sd, cache, _ = run
    WU = _wu(model)
    full_normed = _final_normed(model, cache)  # [C, T, D]
    comps = cache.decompose_resid(pos_slice=pos_slice)
    assert np.array_equal(comps, cache.decompose_resid()[:, index])
    got = cache.logit_attrs(comps, 6, pos_slice=pos_slice)
    assert rel_err(got, full_normed[:, index] @ WU[:, 6]) <= EXACT
    normed = cache.decompose_resid(pos_slice=pos_slice, apply_ln=True)
    assert rel_err(normed, full_normed[:, index]) <= EXACT
    heads = cache.stack_head_results(pos_slice=pos_slice, apply_ln=True, incl_remainder=True)
    assert rel_err(heads.sum(0) + sd["norm.bias"], np.asarray(cache["ln_final"])[index]) <= ENGINE
    acc = cache.accumulated_resid(pos_slice=pos_slice)
    assert np.array_equal(acc, cache.accumulated_resid()[:, index])
    full = cache.get_full_resid_decomposition(pos_slice=pos_slice, apply_ln=True, expand_neurons=False)
    assert rel_err(full.sum(0) + sd["norm.bias"], np.asarray(cache["ln_final"])[index]) <= ENGINE


def test_layer_minus_one_is_the_final_residual(run):
    model, _, cache, _ = run
    L = model.config.n_layer
    for f in (cache.decompose_resid, cache.accumulated_resid, cache.stack_head_results):
        want = f(layer=None)
        assert np.array_equal(f(layer=-1), want) and np.array_equal(f(layer=L), want)
    full = cache.get_full_resid_decomposition(layer=None, expand_neurons=False)
    assert np.array_equal(cache.get_full_resid_decomposition(layer=-1, expand_neurons=False), full)
    # other negatives count from the end: -2 is the residual entering the last block
    assert np.array_equal(cache.decompose_resid(layer=-2), cache.decompose_resid(layer=L - 1))
    assert cache.stack_activation("pattern", layer=None).shape[0] == L
    # layer 0: no heads before it, an empty stack (TransformerLens)
    empty, labels = cache.stack_head_results(layer=0, return_labels=True)
    assert empty.shape == (0, T, model.config.d_model) and labels == []
    assert cache.stack_head_results(layer=0, pos_slice=-1).shape == (0, model.config.d_model)


def test_apply_ln_to_stack_arguments(run):
    model, _, cache, bcache = run
    comps = cache.decompose_resid()
    normed = _final_normed(model, cache)
    assert rel_err(cache.apply_ln_to_stack(comps, layer=-1), normed) <= EXACT
    assert rel_err(cache.apply_ln_to_stack(residual_stack=comps), normed) <= EXACT
    # recompute_ln: each component a whole residual with its own statistics
    acc = cache.accumulated_resid()
    own = cache.apply_ln_to_stack(acc, recompute_ln=True)
    assert rel_err(own, _ln_lin(model, acc, acc, model.ln_final_w)) <= EXACT
    assert np.array_equal(own, cache.accumulated_resid(apply_ln=True))
    # batched: batch_slice on the stack and on the scale
    bcomps = bcache.decompose_resid()
    bnormed = _final_normed(model, bcache)
    assert rel_err(bcache.apply_ln_to_stack(bcomps, batch_slice=[1]), bnormed[:, [1]]) <= EXACT


# ---------------------------------------------------------------- get_full_resid_decomposition


def test_full_decomposition_apply_ln_with_pos_slice(run):
    """The issue's call: layer=-1, apply_ln=True, pos_slice=-1."""
    model, sd, cache, _ = run
    got, labels = cache.get_full_resid_decomposition(layer=-1, apply_ln=True, pos_slice=-1, return_labels=True)
    full = cache.get_full_resid_decomposition(layer=-1)
    assert got.shape == (len(labels), model.config.d_model)
    assert rel_err(got, _ln_lin(model, full[:, -1], cache["resid_post", -1][-1], model.ln_final_w)) <= EXACT
    assert rel_err(got.sum(0) + sd["norm.bias"], cache["ln_final"][-1]) <= ENGINE
    # the same through logit_attrs: the neurons, heads, embed and bias sum to the logit
    tok = 7
    attrs = cache.logit_attrs(full[:, -1], tok, pos_slice=-1)
    logits = np.asarray(model(_toks(model)), np.float64)
    assert abs(attrs.sum() + sd["norm.bias"] @ _wu(model)[:, tok] - logits[-1, tok]) <= ENGINE * np.abs(logits).max()


def test_full_decomposition_mlp_input_and_projection(run):
    model, sd, cache, bcache = run
    c = model.config
    N = c.n_head
    for layer in (0, 1):
        comps, labels = cache.get_full_resid_decomposition(layer=layer, mlp_input=True, return_labels=True)
        mid = np.asarray(cache["resid_pre", layer], np.float64)
        if not c.parallel_residual:  # a sequential block's MLP reads its attention's output too
            mid = mid + cache["attn.out", layer]
        assert ("L%dH0" % layer in labels) == (not c.parallel_residual)
        assert sum(lab.startswith("L%dH" % layer) for lab in labels) == (0 if c.parallel_residual else N)
        assert rel_err(comps.sum(0), mid) <= ENGINE
        normed = cache.get_full_resid_decomposition(layer=layer, mlp_input=True, apply_ln=True, pos_slice=[2, 5])
        assert rel_err(normed.sum(0) + sd["layers.%d.ffn_norm.bias" % layer], cache["ln_mlp", layer][[2, 5]]) <= ENGINE
        # the attention's input: the same with or without mlp_input on a parallel block
        plain = cache.get_full_resid_decomposition(layer=layer, apply_ln=True, pos_slice=[2, 5])
        assert rel_err(plain.sum(0) + sd["layers.%d.attention_norm.bias" % layer], cache["ln_attn", layer][[2, 5]]) <= (
            ENGINE
        )
    # project_output_onto: [D] drops the last axis, [D, K] makes it K
    full = cache.get_full_resid_decomposition(expand_neurons=False)
    v = np.random.default_rng(3).normal(size=(c.d_model, 2))
    assert rel_err(cache.get_full_resid_decomposition(expand_neurons=False, project_output_onto=v), full @ v) <= EXACT
    one = cache.get_full_resid_decomposition(expand_neurons=False, project_output_onto=v[:, 0], pos_slice=-1)
    assert rel_err(one, full[:, -1] @ v[:, 0]) <= EXACT
    # a batch
    bfull = bcache.get_full_resid_decomposition()
    assert bfull.shape[1:] == (2, T, c.d_model)
    assert rel_err(bfull.sum(0), bcache["resid_post", -1]) <= ENGINE


# ---------------------------------------------------------------- bad arguments


def _bad_calls(cache, bcache, D):
    stack = cache.decompose_resid()
    one = cache.decompose_resid(pos_slice=-1)
    return [
        (lambda: cache.logit_attrs(stack, 1.5), "tokens"),
        (lambda: cache.logit_attrs(stack, True), "tokens"),
        (lambda: cache.logit_attrs(stack, [1.0, 2.0]), "tokens"),
        (lambda: cache.logit_attrs(stack, 10**9), "tokens: token id"),
        (lambda: cache.logit_attrs(stack, -1), "tokens: token id"),
        (lambda: cache.logit_attrs(stack, [[1, 2], [3]]), "tokens"),
        (lambda: cache.logit_attrs(stack, {"a": 1}), "tokens"),
        (lambda: cache.logit_attrs(stack, np.arange(5)), "tokens of shape \\[5\\]"),
        (lambda: cache.logit_attrs(one, np.array([5, 6]), pos_slice=-1), "tokens of shape \\[2\\]"),
        (lambda: cache.logit_attrs(one, [5], incorrect_tokens=[6, 7], pos_slice=-1), "incorrect_tokens"),
        (lambda: cache.logit_attrs(one, 5, incorrect_tokens=2.5, pos_slice=-1), "incorrect_tokens"),
        (lambda: cache.logit_attrs(one, 5), "pos_slice"),  # a one-position stack without its pos_slice
        (lambda: cache.logit_attrs(stack, 5, has_ln="no"), "has_ln"),
        (lambda: cache.logit_attrs("stack", 5), "residual_stack"),
        (lambda: cache.logit_attrs(np.zeros((3, T, D + 1)), 5), "residual_stack"),
        (lambda: cache.logit_attrs(np.zeros(D), 5), "residual_stack"),
        (lambda: cache.logit_attrs(stack, 5, batch_slice=0), "batch_slice"),  # one prompt: no batch axis
        (lambda: bcache.logit_attrs(bcache.decompose_resid(), 5, batch_slice=5), "batch_slice"),
        (lambda: bcache.logit_attrs(bcache.decompose_resid(), 5, batch_slice="x"), "batch_slice"),
        (lambda: bcache.logit_attrs(bcache.decompose_resid(), 5, has_batch_dim="yes"), "has_batch_dim"),
        (lambda: cache.decompose_resid(pos_slice="last"), "pos_slice"),
        (lambda: cache.decompose_resid(pos_slice=1.5), "pos_slice"),
        (lambda: cache.decompose_resid(pos_slice=True), "pos_slice"),
        (lambda: cache.decompose_resid(pos_slice=99), "pos_slice"),
        (lambda: cache.decompose_resid(pos_slice=[0, 99]), "pos_slice"),
        (lambda: cache.decompose_resid(pos_slice=[[0]]), "pos_slice"),
        (lambda: cache.decompose_resid(pos_slice=[0.5]), "pos_slice"),
        (lambda: cache.decompose_resid(pos_slice=np.ones(3, bool)), "pos_slice"),
        (lambda: cache.decompose_resid(pos_slice=(1, 2, 3, 4)), "pos_slice"),
        (lambda: cache.decompose_resid(pos_slice=(1.5,)), "pos_slice"),
        (lambda: cache.decompose_resid(pos_slice=slice(0, 2.5)), "pos_slice"),
        (lambda: cache.decompose_resid(pos_slice=slice(None, None, 0)), "pos_slice"),
        (lambda: cache.decompose_resid(pos_slice={1}), "pos_slice"),
        (lambda: cache.get_full_resid_decomposition(pos_slice="x"), "pos_slice"),
        (lambda: cache.stack_head_results(pos_slice=[99]), "pos_slice"),
        (lambda: cache.accumulated_resid(pos_slice=object()), "pos_slice"),
        (lambda: cache.apply_ln_to_stack(stack, pos_slice=-1), "residual_stack is"),
        (lambda: cache.decompose_resid(layer=True), "layer"),
        (lambda: cache.decompose_resid(layer=1.0), "layer"),
        (lambda: cache.decompose_resid(layer=99), "layer"),
        (lambda: cache.decompose_resid(layer=-99), "layer"),
        (lambda: cache.get_full_resid_decomposition(layer="1"), "layer"),
        (lambda: cache.stack_head_results(layer=np.float64(1)), "layer"),
        (lambda: cache.stack_activation("pattern", layer=0), "layer"),
        (lambda: cache.stack_activation(3), "activation_name"),
        (lambda: cache.decompose_resid(mode=np.array(["all"])), "mode"),
        (lambda: cache.decompose_resid(mode="heads"), "mode"),
        (lambda: cache.get_full_resid_decomposition(expand_neurons="no"), "expand_neurons"),
        (lambda: cache.get_full_resid_decomposition(mlp_input=1), "mlp_input"),
        (lambda: cache.get_full_resid_decomposition(return_labels=None), "return_labels"),
        (lambda: cache.get_full_resid_decomposition(project_output_onto=np.zeros(D + 1)), "project_output_onto"),
        (lambda: cache.get_full_resid_decomposition(project_output_onto="v"), "project_output_onto"),
        (lambda: cache.stack_head_results(incl_remainder="yes"), "incl_remainder"),
        (lambda: cache.accumulated_resid(incl_mid=None), "incl_mid"),
        (lambda: cache.apply_ln_to_stack(stack, recompute_ln="yes"), "recompute_ln"),
        (lambda: dc.logit_attrs({}, stack, 5), "cache"),
    ]


def test_bad_arguments_are_dclens_errors_naming_them(run):
    model, _, cache, bcache = run
    for call, match in _bad_calls(cache, bcache, model.config.d_model):
        with pytest.raises(dclens.Error, match=match):
            call()
