"""Hooks: every activation against the numpy reference, writes, and invariants."""

import numpy as np
import pytest

import dclens
from dclens import interventions as iv

from conftest import rel_err
from reference import ref_composition_map, ref_forward
from tolerances import f32_tol, forward_tol, tiny

# engine vs float64 reference, any hook of a 2-layer pass (tests/tolerances.py)
TOL = forward_tol(tiny(), 24, 24 * 64)
# two float32 passes of one prompt (batched vs alone, other hooks): both sides
TWO_PASSES = forward_tol(tiny(), 24, 2 * 24 * 64, sides=2)
DCP = dict(model_type="dcpythia", n_layer=2, window_size=5, seed=21)
DCP_QW = dict(model_type="dcpythia", n_layer=2, window_size=5, query_wise=True, seed=22)
NEOX = dict(model_type="gpt_neox", n_layer=2, seed=23)


def _tokens(model, T=19, seed=0):
    return np.random.default_rng(seed).integers(0, model.config.vocab, size=T)


@pytest.mark.parametrize("kw", [DCP, DCP_QW, NEOX], ids=["dcpythia", "query_wise", "gpt_neox"])
def test_every_hook_matches_reference(tiny_factory, kw):
    d, sd, cfg = tiny_factory(**kw)
    model = dclens.load(d)
    toks = _tokens(model)
    logits, cache = model.run_with_cache(toks, names=model.hook_names)  # the split inputs too
    ref_logits, ref_cache = ref_forward(sd, cfg, toks, cache=True)
    assert set(cache) == set(model.hook_names)
    # every hook but the split inputs, when no name is given (they copy the residual per reader)
    _, every = model.run_with_cache(toks)
    assert set(every) == {n for n in model.hook_names if not n.endswith(dclens.names.SPLIT_INPUTS)}
    assert set(cache) == set(ref_cache), set(cache) ^ set(ref_cache)
    for name in model.hook_names:
        assert cache[name].shape == ref_cache[name].shape, name
        assert rel_err(cache[name], ref_cache[name]) <= TOL, name
    assert rel_err(logits, ref_logits) <= TOL


def test_capture_changes_no_logit(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _tokens(model)
    plain = model.forward(toks)
    logits, cache = model.run_with_cache(toks)
    np.testing.assert_array_equal(plain, logits)
    logits2, _ = model.run_with_cache(toks, names=lambda n: n.endswith("post.kp"))
    np.testing.assert_array_equal(plain, logits2)


def test_names_selection_and_batched_layout(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = np.stack([_tokens(model, 11, 1), _tokens(model, 11, 2)])
    _, cache = model.run_with_cache(toks, names=["blocks.1.attn.post.kp", "logits"])
    assert set(cache) == {"blocks.1.attn.post.kp", "logits"}
    N = model.config.n_head
    assert cache["blocks.1.attn.post.kp"].shape == (2, N, 11, 11)
    _, c1 = model.run_with_cache(toks[1], names="blocks.1.attn.post.kp")
    kp = cache["blocks.1.attn.post.kp"]
    np.testing.assert_allclose(kp[1], c1["blocks.1.attn.post.kp"], atol=TWO_PASSES * np.abs(kp).max())


@pytest.mark.parametrize("phase", ["pre", "post"])
def test_branches_sum_to_composed(tiny_factory, phase):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    _, cache = model.run_with_cache(_tokens(model))
    total = "scores_composed" if phase == "pre" else "pattern_composed"
    for l in range(model.config.n_layer):
        s = sum(cache["blocks.%d.attn.%s.%s" % (l, phase, b)] for b in iv.BRANCHES)
        # the composed map is the float32 sum of the branches (6 terms, and their
        # own rounding): one reduction of length 6
        assert rel_err(s, cache["blocks.%d.attn.%s" % (l, total)]) <= f32_tol(6, 1, s.size, sides=2)


def test_composition_map_reproduces_composed(tiny_factory):
    d, sd, cfg = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _tokens(model)
    _, cache = model.run_with_cache(toks)
    _, ref_cache = ref_forward(sd, cfg, toks, cache=True)
    N = model.config.n_head
    for layer, phase, t, s in [(0, "pre", 7, 3), (1, "post", 12, 12), (1, "pre", 18, 0), (0, "post", 9, 5)]:
        C = model.composition_map(toks, layer, phase, t, s)
        raw = cache["blocks.%d.attn.%s" % (layer, "scores" if phase == "pre" else "pattern")][:, t, s]
        comp = cache["blocks.%d.attn.%s" % (layer, "scores_composed" if phase == "pre" else "pattern_composed")][
            :, t, s
        ]
        # C from the engine's dynamic weights (float32 pass of its own) applied to
        # the float32 raw scores: a pass's error on both sides, relative to max |comp|
        np.testing.assert_allclose(C.T @ raw, comp, rtol=0, atol=TWO_PASSES * max(1, np.abs(comp).max()))
        Cref = ref_composition_map(ref_cache, layer, phase, t, s, N)
        assert rel_err(C, Cref) <= TOL


def test_routing_matrix_column_sums(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _tokens(model)
    _, cache = model.run_with_cache(toks, names=["blocks.1.attn.pattern_composed"])
    R = model.routing_matrix(toks, 1, "post", 10)
    row = cache["blocks.1.attn.pattern_composed"][:, 10, :].sum(axis=1)
    # sums over N heads of values from two float32 passes
    np.testing.assert_allclose(
        R.sum(axis=0), row, rtol=0, atol=(TWO_PASSES + f32_tol(model.config.n_head)) * max(1, np.abs(row).max())
    )


def test_neox_routing_is_identity(tiny_factory):
    d, _, _ = tiny_factory(**NEOX)
    model = dclens.load(d)
    toks = _tokens(model)
    np.testing.assert_array_equal(model.composition_map(toks, 0, "post", 5, 2), np.eye(model.config.n_head))
    with pytest.raises(dclens.Error, match="does not exist"):
        model.run_with_cache(toks, names=["blocks.0.attn.post.kp"])


@pytest.mark.parametrize("phase,branch", [("post", "kp"), ("pre", "qp"), ("pre", "skip"), ("post", "qg")])
def test_zeroed_branch_matches_reference(tiny_factory, phase, branch):
    d, sd, cfg = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _tokens(model)
    name = "blocks.1.attn.%s.%s" % (phase, branch)
    got = model.run_with_hooks(toks, fwd_hooks=iv.disable_branch(model, phase, branch, layers=[1]))
    want = ref_forward(sd, cfg, toks, interventions={name: np.zeros_like})
    assert rel_err(got, want) <= TOL
    assert rel_err(got, model.forward(toks)) > 10 * TWO_PASSES  # the branch mattered, far above rounding


def test_zero_dynamic_is_mha(tiny_factory):
    d, sd, cfg = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _tokens(model)
    got = model.run_with_hooks(toks, fwd_hooks=iv.disable_dynamic(model))
    mha = dict(cfg, use_dcmha=False)
    want = ref_forward(sd, mha, toks)
    assert rel_err(got, want) <= TOL


def test_head_ablation_matches_weight_surgery(tiny_factory):
    d, sd, cfg = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _tokens(model)
    layer, head = 1, 2
    got = model.run_with_hooks(toks, fwd_hooks=[iv.ablate_head(model, layer, head)])
    Dh = model.config.head_dim
    sd2 = dict(sd)
    wo = sd2["layers.%d.attention.wo.weight" % layer].copy()
    wo[:, head * Dh : (head + 1) * Dh] = 0
    sd2["layers.%d.attention.wo.weight" % layer] = wo
    assert rel_err(got, ref_forward(sd2, cfg, toks)) <= TOL


def test_head_out_write_and_pattern_write(tiny_factory):
    d, sd, cfg = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _tokens(model)

    def halve_head0(a, name):
        a[:, 0] *= 0.5
        return a

    def scale_pattern(a, name):
        return a * 0.9

    for name, fn, ref_fn in [
        ("blocks.0.attn.head_out", halve_head0, lambda a: np.concatenate([a[:, :1] * 0.5, a[:, 1:]], 1)),
        ("blocks.1.attn.pattern_composed", scale_pattern, lambda a: a * 0.9),
        ("blocks.0.resid_post", lambda a, n: a + 1.0, lambda a: a + 1.0),
        ("blocks.1.attn.dyn.post.qdd", lambda a, n: np.zeros_like(a), np.zeros_like),
    ]:
        got = model.run_with_hooks(toks, fwd_hooks=[(name, fn)])
        want = ref_forward(sd, cfg, toks, interventions={name: ref_fn})
        assert rel_err(got, want) <= TOL, name


def test_patch_from_other_run(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    a, b = _tokens(model, 13, 5), _tokens(model, 13, 6)
    name = "blocks.1.resid_pre"
    _, cache_b = model.run_with_cache(b, names=[name])
    got = model.run_with_hooks(a, fwd_hooks=[iv.patch(model, name, cache_b)])
    # patching the whole residual entering the last block makes run a behave like run b
    np.testing.assert_allclose(got, model.forward(b), atol=TWO_PASSES * np.abs(got).max())


def test_hook_errors_are_clear_and_model_stays_usable(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _tokens(model)
    ok = model.forward(toks)
    with pytest.raises(dclens.Error, match="unknown hook 'blocks.0.attn.nope'"):
        model.run_with_cache(toks, names=["blocks.0.attn.nope"])
    with pytest.raises(dclens.Error, match="layer 9 is out of range"):
        model.run_with_hooks(toks, fwd_hooks=[("blocks.9.attn.z", lambda a, n: a)])
    with pytest.raises(dclens.Error, match=r"blocks.0.attn.z.*shape"):
        model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.z", lambda a, n: a[:3])])
    with pytest.raises(dclens.Error, match=r"blocks.0.attn.z.*dtype"):
        model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.z", lambda a, n: a.astype(np.int64))])
    with pytest.raises(dclens.Error, match=r"blocks.1.mlp.out.*NaN"):
        model.run_with_hooks(toks, fwd_hooks=[("blocks.1.mlp.out", lambda a, n: a * np.nan)])

    def boom(a, n):
        raise RuntimeError("kaput")

    with pytest.raises(dclens.Error, match=r"blocks.0.ln_attn.*kaput"):
        model.run_with_hooks(toks, fwd_hooks=[("blocks.0.ln_attn", boom)])
    np.testing.assert_array_equal(model.forward(toks), ok)


def test_mean_ablation(tiny_factory):
    d, sd, cfg = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _tokens(model)
    _, cache = model.run_with_cache(toks, names=["blocks.0.attn.z"])
    mean = iv.mean_activation(cache, 0, 1)
    got = model.run_with_hooks(toks, fwd_hooks=[iv.ablate_head(model, 0, 1, kind="mean", mean=mean)])

    def ref_fn(z):
        z = z.copy()
        z[:, 1] = mean
        return z

    assert rel_err(got, ref_forward(sd, cfg, toks, interventions={"blocks.0.attn.z": ref_fn})) <= TOL


def test_hooks_not_asked_for_allocate_nothing(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    B, T = 2, 13
    toks = np.stack([_tokens(model, T, 1), _tokens(model, T, 2)])
    N, L = model.config.n_head, model.config.n_layer
    model.forward(toks)
    base = model.last_pass_memory()
    model.run_with_cache(toks, names=["blocks.0.attn.z", "blocks.1.resid_post"])
    assert model.last_pass_memory() == base  # capture of existing tensors: no new buffers
    branch = B * N * T * T * 4
    model.run_with_cache(toks, names=["blocks.0.attn.pattern"])
    full = model.last_pass_memory()
    assert full["total"] - base["total"] == branch  # that layer's map (full path); the others fused
    model.run_with_cache(toks, names=["blocks.1.attn.post.kp"])
    one = model.last_pass_memory()
    assert one["total"] - base["total"] == 6 * branch  # its map and five post branches, no more
    model.run_with_cache(toks, names=lambda n: ".attn.post." in n)
    every = model.last_pass_memory()
    assert every["total"] - base["total"] == L * 6 * branch
    assert every["peak"] == one["peak"]  # one layer's branches live at a time


# ---------------------------------------------------------------- names, read-only hooks


def test_hook_name_either_order_and_table(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    assert dclens.hook_name(1, "attn.post.kp") == "blocks.1.attn.post.kp"
    assert dclens.hook_name("attn.post.kp", 1) == "blocks.1.attn.post.kp"
    assert dclens.hook_name(0, "pattern") == dclens.hook_name("pattern", 0) == "blocks.0.attn.pattern"
    assert dclens.hook_name(0, "hook_resid_pre") == "blocks.0.resid_pre"  # TransformerLens suffix
    assert dclens.hook_name("embed") == "embed"
    assert model.hook_name(-1, "attn.pre.qg") == "blocks.1.attn.pre.qg"
    with pytest.raises(dclens.Error, match="not a per-layer hook"):
        dclens.hook_name(0, "logits")
    with pytest.raises(dclens.Error, match="layer 2 is out of range"):
        model.hook_name(2, "attn.post.kp")
    # the name table agrees with the engine's own parser, both ways
    for n in model.hook_names:
        assert model.runner.hook_table.name[model.parse_hook(n)] == n
    assert len(set(model.hook_names)) == len(model.hook_names)
    with pytest.raises(dclens.Error, match="blocks.7.attn.q"):
        model.parse_hook("blocks.7.attn.q")  # not in the table: the engine says why


def test_read_only_hooks(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _tokens(model)
    plain, cache = model.run_with_cache(toks)
    seen = {}

    @dclens.read_only
    def look(act, name):
        assert not act.flags.writeable
        seen[name] = act.copy()

    names = ["blocks.0.attn.post.kp", "blocks.1.mlp.out", "logits"]
    out = model.run_with_hooks(toks, [(n, look) for n in names])
    np.testing.assert_array_equal(out, plain)  # bit for bit: nothing written back
    for n in names:
        np.testing.assert_array_equal(seen[n], cache[n])

    def zero(act, name):
        act[...] = 0

    # the flag declares every hook of the call read-only: a write is refused
    with pytest.raises(dclens.Error, match="hook blocks.1.mlp.out.*read-only"):
        model.run_with_hooks(toks, [("blocks.1.mlp.out", zero)], read_only=True)
    with pytest.raises(dclens.Error, match="read-only but returned an array"):
        model.run_with_hooks(toks, [("blocks.1.mlp.out", dclens.read_only(lambda a, n: a * 0))])
    # the same function without the flag writes
    assert rel_err(model.run_with_hooks(toks, [("blocks.1.mlp.out", zero)]), plain) > 10 * TWO_PASSES
    # a read-only hook after a writing one at the same point sees the write
    out2, c2 = model.run_with_hooks(
        toks, [("blocks.1.mlp.out", zero), ("blocks.1.mlp.out", look)], cache_names=["blocks.1.mlp.out"]
    )
    assert not seen["blocks.1.mlp.out"].any() and not c2["blocks.1.mlp.out"].any()
    # with model.hooks(..., read_only=True) and add_hook(read_only=True)
    with model.hooks([("blocks.0.attn.pattern", lambda a, n: seen.__setitem__("ctx", a))], read_only=True):
        np.testing.assert_array_equal(model.forward(toks), plain)
    assert not seen["ctx"].flags.writeable
    model.add_hook("blocks.0.attn.z", zero, read_only=True)
    try:
        with pytest.raises(dclens.Error, match="read-only"):
            model.forward(toks)
    finally:
        model.reset_hooks()
    # the cache of a pass with read-only hooks is writable, like any cache
    _, c3 = model.run_with_cache(toks, names=["blocks.0.attn.z"], fwd_hooks=[("blocks.0.attn.z", look)])
    c3["blocks.0.attn.z"][...] += 1.0
    assert repr(look).startswith("read_only(")


def test_read_only_hook_left_padded_batch(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    a, b = _tokens(model, 7, 1), _tokens(model, 4, 2)
    toks = np.zeros((2, 7), np.int64)
    toks[0], toks[1, 3:] = a, b
    lengths = np.array([7, 4])
    got = []
    model.run_with_hooks(
        toks,
        [("blocks.0.resid_post", dclens.read_only(lambda x, n: got.append(x)))],
        lengths=lengths,
        padding_side="left",
    )
    _, c = model.run_with_cache(b, names=["blocks.0.resid_post"])
    assert not got[0].flags.writeable
    assert rel_err(got[0][1, 3:], c["blocks.0.resid_post"]) <= TOL  # the left-padded layout
