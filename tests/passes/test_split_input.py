"""The split inputs (hooks.md, issue 37): attn.{q,k,v}_input [T, N, D], the
residual stream as each head's Q, K, V input reads it, and the residual as
the dynamic-weight MLP (attn.dyn_input) and the MLP (mlp_input) read it,
[T, D]. Read: copies of the residual; written: only that reader changes;
their gradients, for edge attribution. Against the float64 reference."""

import numpy as np
import pytest

import dclens

from conftest import rel_err
from reference import ref_forward
from reference_dcformer import ref_forward_dcformer
from tolerances import forward_tol, tiny

TOL = forward_tol(tiny(), 24, 24 * 64)
DCP = dict(model_type="dcpythia", n_layer=2, window_size=5, seed=21)
SEQ = dict(model_type="dcpythia", n_layer=2, use_parallel_residual=False, dtype="float16", fmt="torch", seed=46)
NEOX = dict(model_type="gpt_neox", n_layer=2, seed=23)
DCF = dict(model_type="dcformer", n_layer=2, intermediate=64, mgate_dim=4, vocab=24, seed=7)  # RMS norms
PARTS = ("q", "k", "v")


def _tokens(model, T=19, seed=0):
    return np.random.default_rng(seed).integers(0, model.config.vocab, size=T)


@pytest.mark.parametrize("kw", [DCP, SEQ, NEOX], ids=["dcpythia", "sequential-f16", "gpt_neox"])
def test_read_is_the_residual_per_head(tiny_factory, kw):
    d, sd, cfg = tiny_factory(**kw)
    m = dclens.load(d)
    toks = _tokens(m)
    names = ["blocks.1.resid_pre"] + ["blocks.1.attn.%s_input" % p for p in PARTS] + ["blocks.1.attn.q"]
    logits, cache = m.run_with_cache(toks, names=names)
    N = m.config.n_head
    for p in PARTS:
        a = cache["blocks.1.attn.%s_input" % p]
        assert a.shape == (toks.size, N, m.config.d_model)
        np.testing.assert_array_equal(a, np.repeat(cache["blocks.1.resid_pre"][:, None], N, axis=1))
    # reading changes nothing, to the bit
    np.testing.assert_array_equal(logits, m.forward(toks))
    _, ref = ref_forward(sd, cfg, toks, cache=True)
    assert rel_err(cache["blocks.1.attn.k_input"], ref["blocks.1.attn.k_input"]) <= TOL


@pytest.mark.parametrize("kw", [DCP, SEQ, NEOX], ids=["dcpythia", "sequential-f16", "gpt_neox"])
@pytest.mark.parametrize("part", PARTS)
def test_writing_one_heads_copy_changes_that_head_only(tiny_factory, kw, part):
    d, sd, cfg = tiny_factory(**kw)
    m = dclens.load(d)
    toks = _tokens(m)
    n, rng = 2, np.random.default_rng(5)
    noise = rng.standard_normal((toks.size, m.config.d_model))
    name = "blocks.1.attn.%s_input" % part

    def hook(a, _name):
        a[:, n] += noise.astype(np.float32)
        return a

    got, cache = m.run_with_hooks(toks, [(name, hook)], cache_names=["blocks.1.attn." + part])
    want = ref_forward(
        sd,
        cfg,
        toks,
        interventions={name: lambda a: a + np.pad(noise[:, None], ((0, 0), (n, a.shape[1] - n - 1), (0, 0)))},
    )
    assert rel_err(got, want) <= TOL
    assert rel_err(got, m.forward(toks)) > 100 * TOL  # the write mattered
    _, plain = m.run_with_cache(toks, names=["blocks.1.attn." + part])
    act, base = cache["blocks.1.attn." + part], plain["blocks.1.attn." + part]
    other = [h for h in range(m.config.n_head) if h != n]
    assert np.abs(act[:, n] - base[:, n]).max() > 1e-3
    # the other heads: the same values, from their own (unchanged) copies (rounding of a per-head product)
    assert np.abs(act[:, other] - base[:, other]).max() <= 1e-5 * max(np.abs(base).max(), 1.0)


@pytest.mark.parametrize("kw", [DCP, SEQ, NEOX, DCF], ids=["dcpythia", "sequential-f16", "gpt_neox", "dcformer-rms"])
def test_gradient_matches_finite_differences_of_the_reference(tiny_factory, kw):
    """d logit / d q_input (k, v) along a random direction per head: the
    engine's gradient against a central difference of the float64 reference."""
    d, sd, cfg = tiny_factory(**kw)
    m = dclens.load(d)
    toks = _tokens(m)
    T, N, D = toks.size, m.config.n_head, m.config.d_model
    tok, pos = 7, T - 1
    names = ["blocks.%d.attn.%s_input" % (l, p) for l in (0, 1) for p in PARTS]
    names += ["blocks.%d.mlp_input" % l for l in (0, 1)]
    names += ["blocks.%d.attn.dyn_input" % l for l in (0, 1)] if m.config.use_dcmha else []
    g = m.gradients(toks, ("logit", pos, tok), wrt=names)
    rng = np.random.default_rng(11)
    for name in names:
        per_head = name.endswith(("q_input", "k_input", "v_input"))
        assert g[name].shape == ((T, N, D) if per_head else (T, D))
        for n in (0, N - 1) if per_head else (None,):
            v = np.zeros(g[name].shape)
            if per_head:
                v[:, n] = rng.standard_normal((T, D))
            else:
                v[:] = rng.standard_normal((T, D))
            h = 1e-4

            def at(eps, name=name, v=v):
                ref = ref_forward_dcformer if cfg.get("model_type") == "dcformer" else ref_forward
                return ref(sd, cfg, toks, interventions={name: lambda a: a + eps * v})[pos, tok]

            fd = (at(h) - at(-h)) / (2 * h)
            got = float(np.sum(g[name].astype(np.float64) * v))
            assert abs(got - fd) <= 2e-3 * max(abs(fd), 1.0), (name, n, got, fd)


@pytest.mark.parametrize("kw", [DCP, SEQ], ids=["dcpythia", "sequential-f16"])
@pytest.mark.parametrize("name", ["attn.dyn_input", "mlp_input"])
def test_the_dyn_and_mlp_inputs(tiny_factory, kw, name):
    d, sd, cfg = tiny_factory(**kw)
    m = dclens.load(d)
    toks = _tokens(m)
    hook = "blocks.1." + name
    names = [hook, "blocks.1.resid_pre", "blocks.1.attn.out"]
    logits, cache = m.run_with_cache(toks, names=names)
    np.testing.assert_array_equal(logits, m.forward(toks))  # a read changes no bit
    x = cache["blocks.1.resid_pre"]
    if name == "mlp_input" and not m.config.parallel_residual:
        x = x + cache["blocks.1.attn.out"]  # a sequential block's MLP reads x + attn.out
    np.testing.assert_allclose(cache[hook], x, atol=1e-6 * np.abs(x).max())
    noise = np.random.default_rng(3).standard_normal(x.shape)

    def write(a, _n):
        a += noise.astype(np.float32)
        return a

    got, c2 = m.run_with_hooks(toks, [(hook, write)], cache_names=["blocks.1.attn.q", "blocks.1.attn.dyn.pre.qw1"])
    want = ref_forward(sd, cfg, toks, interventions={hook: lambda a: a + noise})
    assert rel_err(got, want) <= TOL
    assert rel_err(got, logits) > 100 * TOL
    # only its reader changed: the heads' q are as before
    _, c1 = m.run_with_cache(toks, names=["blocks.1.attn.q", "blocks.1.attn.dyn.pre.qw1"])
    np.testing.assert_array_equal(c2["blocks.1.attn.q"], c1["blocks.1.attn.q"])
    same = np.array_equal(c2["blocks.1.attn.dyn.pre.qw1"], c1["blocks.1.attn.dyn.pre.qw1"])
    assert same == (name == "mlp_input")


def test_asking_a_split_gradient_changes_no_other_gradient(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    m = dclens.load(d)
    toks = _tokens(m)
    base = ["blocks.0.resid_pre", "blocks.1.attn.z", "layers.0.attention.dyn_w_proj.dw1", "layers.1.ffn_norm.weight"]
    extra = ["blocks.1.attn.dyn_input", "blocks.1.mlp_input", "blocks.1.attn.q_input", "blocks.0.attn.v_input"]
    a = m.gradients(toks, ("logit", -1, 3), wrt=base)
    b = m.gradients(toks, ("logit", -1, 3), wrt=base + extra)
    for k in base:
        np.testing.assert_array_equal(a[k], b[k])


def test_a_tape_refuses_to_override_a_split_input(tiny_factory):
    from dclens._core.tapes import Tape

    d, _, _ = tiny_factory(**DCP)
    m = dclens.load(d)
    toks = _tokens(m)[None]
    tape = Tape(m, 1, toks.shape[1])
    p, l = m.parse_hook("blocks.0.attn.q_input")
    with pytest.raises(dclens.Error, match="override of attn.q_input .* is not differentiated"):
        tape.forward(toks, overrides={(p, l): np.zeros((1, toks.shape[1], m.config.n_head, m.config.d_model))})
