"""A head's lending as an intervention (interventions.block_lending) and the
ablation sweeps (patching.ablation_sweep), issue 41: against a hand hook on
the dynamic weights, against the float64 reference with the lent terms
written here from the spec, and each sweep cell against its single run."""

import numpy as np
import pytest

import dclens
from dclens import interventions as iv
from dclens import patching

from conftest import rel_err
from reference import ref_forward
from tolerances import forward_tol, tiny

TOL = forward_tol(tiny(), 24, 24 * 64)
DCP = dict(model_type="dcpythia", n_layer=2, window_size=5, seed=21)
GROUPED_STATIC = dict(compose_groups=2, use_sw=True, seed=36)
KEY_WISE = dict(compose_groups=2, key_wise=True, seed=38)


def _tokens(model, T=19, seed=0):
    return np.random.default_rng(seed).integers(0, model.config.vocab, size=T)


def _mask(T, window):
    t, s = np.indices((T, T))
    return (s <= t) & ((window <= 0) | (t - s <= window))


def _ref_lending(layer, head, phase, branches, N, G, window, W=None):
    """Reference interventions removing head's lent terms (written from
    model-spec.md's compose: qp[n] = sum_m X[m] sum_r qw1[t,r,m] qw2[t,r,n],
    kp with kw1/kw2 at the key, static with W[m, n]; group-block mask)."""
    seen = {}
    pre = "blocks.%d.attn." % layer
    group = np.arange(N) // (N // G)
    same = group == group[head]

    def keep(key):
        def f(a):
            seen[key] = a.copy()
            return a

        return f

    def branch(b):
        def f(a):
            X = np.where(_mask(a.shape[-1], window), seen["X"][head], 0.0)  # [T, S]
            if b == "qp":
                c = np.einsum("tr,trn->tn", seen["qw1"][:, :, head], seen["qw2"])  # [T, N]
                lent = X[None] * c.T[:, :, None]
            elif b == "kp":
                c = np.einsum("sr,srn->sn", seen["kw1"][:, :, head], seen["kw2"])  # [S, N]
                lent = X[None] * c.T[:, None, :]
            else:
                lent = X[None] * W[head][:, None, None]
            lent = lent * same[:, None, None]
            lent[head] = 0
            return a - lent

        return f

    out = {pre + ("scores" if phase == "pre" else "pattern"): keep("X")}
    for b in branches:
        if b != "static":
            for w in (b[0] + "w1", b[0] + "w2"):
                out[pre + "dyn.%s.%s" % (phase, w)] = keep(w)
        out[pre + "%s.%s" % (phase, b)] = branch(b)
    return out


@pytest.mark.filterwarnings("ignore:.*key_wise is set")
@pytest.mark.parametrize(
    "kw,branches",
    [(DCP, ("qp", "kp")), (GROUPED_STATIC, ("qp", "kp", "static")), (KEY_WISE, ("kp",))],
    ids=["dcpythia", "groups2-static", "groups2-key_wise"],
)
@pytest.mark.parametrize("phase", ["pre", "post"])
def test_block_lending_matches_the_reference(tiny_factory, kw, branches, phase):
    d, sd, cfg = tiny_factory(**kw)
    model = dclens.load(d)
    c = model.config
    toks = _tokens(model)
    layer, head = 1, 1
    got = model.run_with_hooks(toks, iv.block_lending(model, layer, head, phase, branches))
    W = None
    if "static" in branches:
        from dclens import routing

        W = routing.static_map(model, layer, phase)
    window = c.window_size if layer in c.local_layers else 0
    want = ref_forward(
        sd, cfg, toks, interventions=_ref_lending(layer, head, phase, branches, c.n_head, c.compose_groups, window, W)
    )
    assert rel_err(got, want) <= TOL
    assert rel_err(got, model.forward(toks)) > 100 * TOL  # the lending mattered


def test_block_lending_equals_a_hand_hook_on_the_dynamic_weights(tiny_factory):
    """Zero head's column of qw1 / kw1 (it lends nothing through the
    projections, itself included) and give its own projection terms back
    through its gates qdd / kdd: the same model, up to rounding."""
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _tokens(model)
    L, H = 1, 2

    # the hand hooks of one pass, sharing st: what w1 / w2 read, dd adds back
    def w1(st, key):
        def f(a, n):
            st[key] = a.copy()
            a[..., H] = 0
            return a

        return f

    def w2(st, key):
        def f(a, n):
            st[key] = a.copy()

        return dclens.read_only(f)

    def dd(st, side):
        def f(a, n):
            a[..., H] += np.einsum("tr,tr->t", st[side + "w1"][..., H], st[side + "w2"][..., H])
            return a

        return f

    for phase in ("pre", "post"):
        st = {}
        p = "blocks.%d.attn.dyn.%s." % (L, phase)
        hand = [
            (p + "qw1", w1(st, "qw1")),
            (p + "qw2", w2(st, "qw2")),
            (p + "kw1", w1(st, "kw1")),
            (p + "kw2", w2(st, "kw2")),
            (p + "qdd", dd(st, "q")),
            (p + "kdd", dd(st, "k")),
        ]
        a = model.run_with_hooks(toks, iv.block_lending(model, L, H, phase))
        b = model.run_with_hooks(toks, hand)
        assert rel_err(a, b) <= TOL
        assert rel_err(a, model.forward(toks)) > 100 * TOL


def test_the_head_keeps_its_own_attention(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks = _tokens(model)
    names = ["blocks.1.attn.pattern_composed", "blocks.1.attn.z"]
    _, before = model.run_with_cache(toks, names=names)
    _, after = model.run_with_hooks(toks, iv.block_lending(model, 1, 3, "post"), cache_names=names)
    m = _mask(toks.size, model.config.window_size if 1 in model.config.local_layers else 0)
    np.testing.assert_array_equal(
        after["blocks.1.attn.pattern_composed"][3][m], before["blocks.1.attn.pattern_composed"][3][m]
    )
    np.testing.assert_array_equal(after["blocks.1.attn.z"][:, 3], before["blocks.1.attn.z"][:, 3])
    assert np.abs(after["blocks.1.attn.z"] - before["blocks.1.attn.z"]).max() > 1e-3  # the others lost its terms
    # lending its own input as the "mean" changes nothing
    _, pc = model.run_with_cache(toks, names=["blocks.1.attn.pattern"])
    same = model.run_with_hooks(
        toks, iv.block_lending(model, 1, 3, "post", kind="mean", mean=pc["blocks.1.attn.pattern"][3])
    )
    assert rel_err(same, model.forward(toks)) <= TOL


def test_block_lending_bad_input(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    neox = dclens.load(tiny_factory(model_type="gpt_neox", n_layer=2, seed=23)[0])
    cases = [
        (lambda: iv.block_lending(neox, 0, 0), "no compose"),
        (lambda: iv.block_lending(model, 0, 9), "head"),
        (lambda: iv.block_lending(model, 0, 0, "mid"), "phase must be"),
        (lambda: iv.block_lending(model, 0, 0, branches="qp"), "branches must be a non-empty list"),
        (lambda: iv.block_lending(model, 0, 0, branches=["qg"]), "branch must be one of qp, kp, static"),
        (lambda: iv.block_lending(model, 0, 0, branches=["static"]), "no static branch"),
        (lambda: iv.block_lending(model, 0, 0, kind="mean"), "mean= goes with kind='mean'"),
        (lambda: iv.block_lending(model, 0, 0, kind="mean", mean=np.zeros(3)), "finite \\[T, S\\] map"),
    ]
    for call, said in cases:
        with pytest.raises(dclens.Error, match=said):
            call()


# ---------------------------------------------------------------- ablation sweeps


def _metric(model):
    return patching.logit_diff(3, 5)


@pytest.mark.parametrize("phase", ["pre", "post", "both"])
def test_source_sweep_cells_equal_single_runs(tiny_factory, phase):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks, metric = _tokens(model), _metric(model)
    r = patching.ablation_sweep(model, toks, metric, over="source", phase=phase, batch_size=3, progress=False)
    assert r.values.shape == (2, model.config.n_head) and r.axes == ("layer", "source head")
    assert r.baseline == pytest.approx(metric(model.forward(toks)), abs=1e-6)
    for l in range(2):
        for h in range(model.config.n_head):
            one = metric(model.run_with_hooks(toks, iv.block_lending(model, l, h, phase)))
            assert r.values[l, h] == pytest.approx(one, abs=1e-4)
    assert np.abs(r.effect()).max() > 1e-3


def test_head_sweep_cells_equal_single_runs(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks, metric = _tokens(model), _metric(model)
    other = _tokens(model, 11, seed=3)
    for mode, ref in (("zero", None), ("mean", other[None])):
        r = patching.ablation_sweep(model, toks, metric, over="layer,head", mode=mode, reference=ref, progress=False)
        _, rc = model.run_with_cache(other, names=["blocks.0.attn.z", "blocks.1.attn.z"])
        for l in range(2):
            for h in range(model.config.n_head):
                mean = iv.mean_activation(rc, l, h) if mode == "mean" else None
                one = metric(model.run_with_hooks(toks, [iv.ablate_head(model, l, h, mode, mean)]))
                assert r.values[l, h] == pytest.approx(one, abs=1e-4)


def test_composition_sweep_cells(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks, metric = _tokens(model), _metric(model)
    N = model.config.n_head
    r = patching.ablation_sweep(model, toks, metric, over="composition", phase="post", progress=False)
    assert r.values.shape == (2, N, N)
    # one cell by hand: source 1 -> target 2 at layer 1 leaves target 2's composed map
    from dclens import routing

    _, cache = model.run_with_cache(toks)
    C = routing.composition_maps(model, cache, 1, "post")  # [T, S, N, N]
    window = model.config.window_size if 1 in model.config.local_layers else 0
    X = np.where(_mask(toks.size, window), cache["blocks.1.attn.pattern"][1], 0.0)

    def fn(a, n):
        a[2] -= (C[:, :, 1, 2] * X).astype(np.float32)
        return a

    one = metric(model.run_with_hooks(toks, [("blocks.1.attn.pattern_composed", fn)]))
    assert r.values[1, 1, 2] == pytest.approx(one, abs=1e-4)
    # mean over a reference of the prompt itself: every entry keeps its value
    same = patching.ablation_sweep(
        model, toks, metric, over="composition", mode="mean", reference=toks[None], progress=False
    )
    np.testing.assert_allclose(same.values, same.baseline, atol=1e-4)
    same = patching.ablation_sweep(
        model, toks, metric, over="source", mode="mean", reference=toks[None], progress=False
    )
    np.testing.assert_allclose(same.values, same.baseline, atol=1e-4)


def test_ablation_sweep_bad_input(tiny_factory):
    d, _, _ = tiny_factory(**DCP)
    model = dclens.load(d)
    toks, metric = _tokens(model), _metric(model)
    neox = dclens.load(tiny_factory(model_type="gpt_neox", n_layer=2, seed=23)[0])
    cases = [
        (lambda: patching.ablation_sweep(model, toks, metric, over="pos"), "over must be one of"),
        (lambda: patching.ablation_sweep(model, toks, metric, mode="resample"), "mode must be 'zero' or 'mean'"),
        (lambda: patching.ablation_sweep(model, toks, metric, mode="mean"), "reference="),
        (lambda: patching.ablation_sweep(model, toks, metric, reference=toks[None]), "reference="),
        (lambda: patching.ablation_sweep(model, toks, "logit_diff"), "metric must be a function"),
        (lambda: patching.ablation_sweep(neox, toks, metric, over="source"), "needs DCMHA"),
        (
            lambda: patching.ablation_sweep(model, toks, metric, over="source", mode="mean", reference=toks[None, :5]),
            "need the prompt's 19 tokens",
        ),
        (
            lambda: patching.ablation_sweep(model, toks, metric, over="composition", phase="both"),
            "phase='pre' or 'post'",
        ),
        (lambda: patching.ablation_sweep(model, toks, metric, over="source", phase="mid"), "phase must be"),
    ]
    for call, said in cases:
        with pytest.raises(dclens.Error, match=said):
            call()
