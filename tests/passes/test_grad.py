"""Gradients of the engine's backward against central differences of the
independent float64 reference forward (tests/reference.py), on tiny models.

Tolerance (tests/tolerances.py), max |engine - fd| / scale over the sampled
entries of a tensor, scale = max(|fd| sampled, |engine gradient| anywhere in
the tensor, 1e-3):
* the engine's float32 rounding: a forward and a backward pass (twice the
  forward's depth, longest reduction F = 128) relative to the tensor's
  largest gradient: f32_tol(128, 2 * forward_depth(L), entries);
* central differences of the float64 reference with step EPS: truncation
  EPS^2 / 6 times a third derivative of the order of the first on these O(1)
  activations, and float64 rounding U64 / EPS (both far smaller).
"""

import numpy as np
import pytest

import dclens

import reference as R
from tolerances import U64, f32_tol, forward_depth

EPS = 1e-4
TOL = f32_tol(128, 2 * forward_depth(2), 2000) + EPS**2 / 6 + U64 / EPS

VARIANTS = [
    ("dcpythia", {}),
    ("dcpythia", {"window_size": 3, "use_parallel_residual": False}),
    ("dcpythia", {"query_wise": True, "use_qk_norm": False, "tie_word_embeddings": True}),
    ("dcpythia", {"use_dcmha": False, "use_linear_bias": False}),
    ("gpt_neox", {}),
    ("gpt_neox", {"use_parallel_residual": False}),
]


def _target_fn(cfg, toks, target):
    kind = target[0]

    def f(sd, iv=None):
        lg = R.ref_forward(sd, cfg, toks, interventions=iv)
        if kind == "loss":
            row = lg[:-1]
            mx = row.max(-1, keepdims=True)
            lse = np.log(np.exp(row - mx).sum(-1)) + mx[:, 0]
            return float(np.mean(lse - row[np.arange(len(row)), toks[1:]]))
        p = target[1]
        if kind == "logit_diff":
            return lg[p, target[2]] - lg[p, target[3]]
        v = lg[p, target[2]]
        if kind == "logprob":
            v = v - (np.log(np.exp(lg[p] - lg[p].max()).sum()) + lg[p].max())
        return v

    return f


def _check(pairs, what, gmax=0.0):
    e = np.array(pairs, np.float64)
    scale = max(np.abs(e[:, 0]).max(), float(gmax), 1e-3)
    err = np.abs(e[:, 0] - e[:, 1]).max() / scale
    assert err <= TOL, "%s: engine vs central differences rel err %.2e\n%s" % (what, err, e)


def check_hook_gradients(m, sd, cfg, toks, target, g, rng, names, picks=3, what=""):
    """Every hook in names: the engine's gradient g[n] at `picks` random and
    `picks` nonzero entries against central differences of the reference."""
    f = _target_fn(cfg, toks, target)
    _, cache = R.ref_forward(sd, cfg, toks, cache=True)
    for n in names:
        a = cache[n]
        assert g[n].shape == a.shape, n
        idx = [tuple(rng.integers(0, s) for s in a.shape) for _ in range(picks)]
        nz = np.argwhere(np.abs(g[n]) > 1e-6)
        if len(nz):
            idx += [tuple(nz[i]) for i in rng.integers(0, len(nz), picks)]
        if n.endswith(".attn.pattern") and m.config.use_dcmha:
            # the engine post-composes the allowed pairs only (model-spec 2.9): an
            # edit at a masked pattern entry changes nothing there
            idx = [ix for ix in idx if ix[-1] <= ix[-2]]
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
        _check(pairs, (what + " " + n).strip(), np.abs(g[n]).max())


def check_param_gradients(sd, cfg, toks, target, g, rng, params, what=""):
    """Parameters stored under their canonical names: the two largest and one
    random entry of each gradient against central differences."""
    f = _target_fn(cfg, toks, target)
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
        _check(pairs, (what + " " + canon).strip(), np.abs(flat).max())


@pytest.mark.parametrize("mt,kw", VARIANTS)
def test_hook_gradients_match_finite_differences(tiny_factory, mt, kw):
    d, sd, cfg = tiny_factory(model_type=mt, vocab=24, **kw)
    m = dclens.load(d)
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 24, 7)
    target = ("logprob", 5, 3)
    g = m.gradients(toks, target, m.hook_names)
    check_hook_gradients(m, sd, cfg, toks, target, g, rng, m.hook_names)


def _stored(mt, canon, cfg):
    """checkpoint name of a canonical parameter and a map of flat indices."""
    if mt == "dcpythia":
        return canon, lambda i, shape: i
    D, N = cfg["hidden_size"], cfg["num_attention_heads"]
    Dh = D // N
    names = {
        "tok_embeddings.weight": "gpt_neox.embed_in.weight",
        "output.weight": "embed_out.weight",
        "norm.weight": "gpt_neox.final_layer_norm.weight",
        "norm.bias": "gpt_neox.final_layer_norm.bias",
    }
    if canon in names:
        return names[canon], lambda i, shape: i
    l, rest = canon.split(".", 2)[1:]
    sub = {
        "attention_norm.weight": "input_layernorm.weight",
        "attention_norm.bias": "input_layernorm.bias",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.bias": "post_attention_layernorm.bias",
        "attention.wo.weight": "attention.dense.weight",
        "attention.wo.bias": "attention.dense.bias",
        "feed_forward.w1.weight": "mlp.dense_h_to_4h.weight",
        "feed_forward.w1.bias": "mlp.dense_h_to_4h.bias",
        "feed_forward.w2.weight": "mlp.dense_4h_to_h.weight",
        "feed_forward.w2.bias": "mlp.dense_4h_to_h.bias",
        "attention.wqkv.weight": "attention.query_key_value.weight",
        "attention.wqkv.bias": "attention.query_key_value.bias",
    }[rest]
    name = "gpt_neox.layers.%s.%s" % (l, sub)
    if "query_key_value" not in name:
        return name, lambda i, shape: i

    def regroup(i, shape):
        cols = shape[1] if len(shape) == 2 else 1
        r, c = divmod(i, cols)
        j, rem = divmod(r, D)
        n, dd = divmod(rem, Dh)
        return (n * 3 * Dh + j * Dh + dd) * cols + c

    return name, regroup


@pytest.mark.parametrize("mt,kw", VARIANTS)
def test_parameter_gradients_match_finite_differences(tiny_factory, mt, kw):
    d, sd, cfg = tiny_factory(model_type=mt, vocab=24, **kw)
    m = dclens.load(d)
    rng = np.random.default_rng(2)
    toks = rng.integers(0, 24, 6)
    target = ("loss",)
    f = _target_fn(cfg, toks, target)
    from dclens.analysis.grad import param_table

    names = [r[0] for r in param_table(m)]
    g = m.gradients(toks, target, names)
    for canon in names:
        if m.config.tie_embeddings and canon == "output.weight":
            continue
        stored, idxmap = _stored(mt, canon, cfg)
        base = np.asarray(sd[stored], np.float64)
        flat_g = g[canon].ravel()
        picks = list(rng.integers(0, flat_g.size, 3)) + list(np.argsort(-np.abs(flat_g))[:3])
        pairs = []
        for i in picks:
            j = idxmap(int(i), base.shape)
            vals = []
            for s in (EPS, -EPS):
                p = base.copy().ravel()
                p[j] += s
                sd2 = dict(sd)
                sd2[stored] = p.reshape(base.shape)
                vals.append(f(sd2))
            pairs.append(((vals[0] - vals[1]) / (2 * EPS), flat_g[i]))
        _check(pairs, canon, np.abs(flat_g).max())


@pytest.mark.parametrize("mt", ["dcpythia", "gpt_neox"])
@pytest.mark.parametrize("target", [("logit", -1, 5), ("logit_diff", 3, 1, 2), ("loss",)])
def test_batch_equals_one_by_one(tiny_factory, mt, target):
    d, sd, cfg = tiny_factory(model_type=mt, vocab=24)
    m = dclens.load(d)
    toks = np.random.default_rng(3).integers(0, 24, (3, 9))
    wrt = ["blocks.1.attn.head_out", "blocks.0.resid_pre", "blocks.1.attn.v", "tok_embeddings.weight"]
    if m.config.use_dcmha:
        wrt += ["blocks.0.attn.post.kp", "blocks.1.attn.dyn.pre.qw1"]
    gb, vb = m.gradients(toks, target, wrt, return_value=True)
    BATCHED = f32_tol(128, 2 * forward_depth(2), gb["tok_embeddings.weight"].size, sides=2)
    acc = 0
    for b in range(3):
        g1, v1 = m.gradients(toks[b], target, wrt, return_value=True)
        # batched vs one by one: two float32 passes, forward and backward, both sides
        assert abs(v1 - vb[b]) <= BATCHED * max(1, abs(v1))
        for n in wrt:
            if n == "tok_embeddings.weight":
                continue
            np.testing.assert_allclose(gb[n][b], g1[n], rtol=0, atol=BATCHED * np.abs(g1[n]).max(), err_msg=n)
        acc = acc + g1["tok_embeddings.weight"]
    np.testing.assert_allclose(gb["tok_embeddings.weight"], acc, rtol=0, atol=BATCHED * np.abs(acc).max())


def test_gradient_errors(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="dcpythia", vocab=24)
    m = dclens.load(d)
    toks = np.arange(6)
    with pytest.raises(dclens.Error, match="blocks.9.attn.z"):
        m.gradients(toks, ("logit", 0, 1), ["blocks.9.attn.z"])
    with pytest.raises(dclens.Error, match="position"):
        m.gradients(toks, ("logit", 6, 1), ["embed"])
    with pytest.raises(dclens.Error, match="vocabulary"):
        m.gradients(toks, ("logprob", 0, 99), ["embed"])
    with pytest.raises(dclens.Error, match="unknown target"):
        m.gradients(toks, ("prob", 0, 1), ["embed"])
    with pytest.raises(dclens.Error, match="mask"):
        m.gradients(toks, ("loss", np.zeros(6, bool)), ["embed"])
