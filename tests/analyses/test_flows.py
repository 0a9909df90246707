"""routing.flows (issue 24): what each source head lends one target entry through
each compose branch, against an independent decomposition -- the reference's
compose_branches (tests/reference.py, model-spec.md 2 step 6) run on the cached
scores / pattern with every source head but one zeroed -- and their sum against
the engine's composed maps and branch hooks, on the bundled DCPythia and on the
variants (query-wise, key-wise, static branch, grouped composition)."""

import numpy as np
import pytest

import dclens
from dclens import routing

from reference import compose_branches

EPS32 = float(np.finfo(np.float32).eps)
PROMPT = (
    "The red car drove past the old bridge while the small dog ran after a ball, "
    "and then the children laughed near the quiet river until the sun went down behind the hills"
)


@pytest.fixture(scope="module")
def bundled():
    m = dclens.load("dcpythia-tiny")
    toks = m.to_tokens(PROMPT)
    assert len(toks) > m.config.window_size + 2  # the local layers' window masks some keys
    _, cache = m.run_with_cache(toks)
    return m, toks, cache


def _dyn(cache, layer, phase):
    p = "blocks.%d.attn.dyn.%s." % (layer, phase)
    return {k: cache[p + k].astype(np.float64) for k in ("qw1", "qw2", "qdd", "kw1", "kw2", "kdd") if p + k in cache}


def _visible(T, t, window):
    s = np.arange(T)
    return (s <= t) & ((window <= 0) | (t - s <= window))


def _reference_flows(m, cache, layer, phase, head, t, static=None):
    """[N, branches, T] by linearity: source n's part of each branch is the branch
    of the input with every row but n zeroed (reference.compose_branches)."""
    c = m.config
    X = cache["blocks.%d.attn.%s" % (layer, "scores" if phase == "pre" else "pattern")].astype(np.float64)
    N, T, _ = X.shape
    vis = _visible(T, t, c.window_size if layer in c.local_layers else 0)
    names = routing.flow_branches(m)
    out = np.zeros((N, len(names), T))
    for n in range(N):
        A = np.zeros_like(X)
        A[n] = X[n]
        br = compose_branches(A, _dyn(cache, layer, phase), c.query_wise, static, c.compose_groups)
        for b, name in enumerate(names):
            if name in br:
                out[n, b] = br[name][head, t] * vis
    return out, vis


def _check_sums(m, cache, F, layer, phase, head, t, vis):
    """Over sources: each branch hook; over sources and branches: the composed map,
    to float32 rounding of the engine's sums (tolerance from the terms' size)."""
    scale = np.abs(F).sum((0, 1)) + 1e-30  # [T]
    tol = 64 * EPS32 * scale
    composed = cache["blocks.%d.attn.%s" % (layer, "scores_composed" if phase == "pre" else "pattern_composed")]
    assert np.all(np.abs(F.sum((0, 1)) - composed[head, t])[vis] <= tol[vis])
    for b, name in enumerate(routing.flow_branches(m)):
        hook_name = "blocks.%d.attn.%s.%s" % (layer, phase, name)
        if hook_name not in cache:  # a branch this variant does not have
            assert not F[:, b].any(), name
            continue
        hook = cache[hook_name][head, t]
        assert np.all(np.abs(F[:, b].sum(0) - hook)[vis] <= tol[vis]), name
    assert not F[:, :, ~vis].any()


CASES = [
    (0, "pre", 1, -1),
    (0, "post", 4, 20),
    (1, "post", 1, -1),
    (2, "pre", 0, 37),
    (3, "post", 5, -3),
    (-1, "pre", -2, 5),
    (2, "post", 3, -1),
]


@pytest.mark.parametrize("layer,phase,head,query", CASES)
def test_flows_against_reference_and_composed(bundled, layer, phase, head, query):
    m, toks, cache = bundled
    F = routing.flows(m, None, layer, phase, head, query, cache=cache)  # from the cache: no pass
    T = len(toks)
    assert F.shape == (m.config.n_head, len(dclens.BRANCHES), T) and F.dtype == np.float64
    t = query % T
    ref, vis = _reference_flows(m, cache, layer % 4, phase, head % 6, t)
    assert np.abs(F - ref).max() <= 1e-9 * max(np.abs(ref).max(), 1.0)
    _check_sums(m, cache, F, layer % 4, phase, head % 6, t, vis)
    # the gates and skip come from the head itself only
    others = np.arange(6) != head % 6
    assert not F[others][:, [0, 3, 4]].any()
    # with its own pass (capturing fewer hooks: float32 rounding may differ)
    fresh = m.flows(toks, layer, phase, head, query)
    assert np.all(np.abs(fresh - F) <= 64 * EPS32 * (np.abs(F) + np.abs(F).max()))


def test_local_window_is_masked(bundled):
    m, toks, cache = bundled
    t = len(toks) - 1
    F = m.flows(toks, 0, "pre", 2, t, cache=cache)
    far = np.arange(len(toks)) < t - m.config.window_size
    assert far.any() and not F[:, :, far].any()
    # the composed scores there are not zero (composition comes before the mask)
    assert np.abs(cache["blocks.0.attn.scores_composed"][2, t, far]).max() > 0


def test_flows_cache_errors(bundled):
    m, toks, cache = bundled
    part = dclens.Cache({k: v for k, v in cache.items() if not k.endswith("post.kw1")})
    with pytest.raises(dclens.Error, match="blocks.1.attn.dyn.post.kw1"):
        m.flows(toks, 1, "post", 0, -1, cache=part)
    with pytest.raises(dclens.Error, match="tokens has 5"):
        m.flows(toks[:5], 1, "post", 0, -1, cache=cache)
    _, bc = m.run_with_cache(np.stack([toks[:6], toks[:6]]), names=lambda n: n.startswith("blocks.1.attn"))
    with pytest.raises(dclens.Error, match="one sequence"):
        m.flows(None, 1, "post", 0, -1, cache=bc)
    for bad, match in (
        ((1, "mid", 0, 0), "phase"),
        ((4, "pre", 0, 0), "layer"),
        ((1, "pre", 6, 0), "head"),
        ((1, "pre", 0, len(toks)), "query"),
    ):
        with pytest.raises(dclens.Error, match=match):
            m.flows(toks, *bad, cache=cache)
    with pytest.raises(dclens.Error, match="tokens or a cache"):
        m.flows(None, 1, "pre", 0, 0)


def test_flow_table(bundled):
    m, toks, cache = bundled
    F = m.flows(toks, 1, "post", 3, -1, cache=cache)
    tab = routing.flow_table(m, toks, 1, "post", 3, -1, k=7, cache=cache)
    assert len(tab) == 7
    vals = [f.value for f in tab]
    assert np.all(np.diff(np.abs(vals)) <= 0)
    assert abs(vals[0]) == np.abs(F).max()
    words = m.to_str_tokens(toks)
    for f in tab:
        assert F[f.source, dclens.BRANCHES.index(f.branch), f.key] == f.value and f.token == words[f.key]
        assert f.share == pytest.approx(f.value / np.abs(F).sum())  # of the sum of |value|: signed
    assert tab.total == pytest.approx(F.sum()) and tab.abs_total == pytest.approx(np.abs(F).sum())
    text = str(tab)
    assert "layer 1 head 3" in text and repr(words[tab[0].key])[:14] in text
    assert "sum |value|" in text
    assert routing.flow_table(m, toks, 1, "post", 3, -1, k=7, F=F) == tab


def _n_visible(m, layer, t):
    w = m.config.window_size if layer in m.config.local_layers else 0
    return t + 1 if w <= 0 else min(t + 1, w + 1)


@pytest.mark.parametrize("layer,phase,head,query", CASES)
def test_flow_table_counts_visible_keys_only(bundled, layer, phase, head, query):
    """Issue 41: the table and its title count the keys the query sees (causal mask and
    a local layer's window), and every flow there is listed with k large enough."""
    m, toks, cache = bundled
    T = len(toks)
    t, L = query % T, m.config.n_layer
    F = m.flows(toks, layer, phase, head, query, cache=cache)
    tab = routing.flow_table(m, toks, layer, phase, head, query, k=10**6, F=F)
    n = _n_visible(m, layer % L, t)
    assert tab.visible_keys == n and "over the %d visible keys (of %d)" % (n, T) in str(tab)
    assert len(tab) == m.config.n_head * len(dclens.BRANCHES) * n
    keys = {f.key for f in tab}
    assert keys == set(range(t + 1 - n, t + 1))
    # the shares: signed, over the sum of |value|, and their |.| sum to 1
    assert sum(abs(f.share) for f in tab) == pytest.approx(1.0)
    assert sum(f.share for f in tab) == pytest.approx(tab.total / tab.abs_total)
    # masked keys in a given F are left out, not counted
    G = F.copy()
    G[:, :, [s for s in range(T) if s not in keys]] = 1e6
    assert routing.flow_table(m, toks, layer, phase, head, query, k=10**6, F=G) == tab


def test_flow_table_pre_phase_signed(bundled):
    """Pre-phase flows are signed logits: the shares keep the sign, and they are of the
    sum of |value| (the signed sum can be near zero where terms cancel)."""
    m, toks, cache = bundled
    T = len(toks)
    tab = routing.flow_table(m, toks, 0, "pre", 2, T - 1, k=10**6, cache=cache)
    neg = [f for f in tab if f.value < 0]
    assert neg and all(f.share < 0 for f in neg)
    assert max(abs(f.share) for f in tab) <= 1
    assert tab.abs_total > abs(tab.total)
    scores = cache["blocks.0.attn.scores_composed"][2, T - 1].astype(np.float64)
    keys = sorted({f.key for f in tab})
    assert tab.total == pytest.approx(scores[keys].sum(), rel=1e-4)


def test_flow_table_errors(bundled):
    m, toks, cache = bundled
    F = m.flows(toks, 1, "post", 3, -1, cache=cache)
    for kw, match in (
        (dict(F=F[:, :3]), "F must be"),
        (dict(F=F[0]), "F must be"),
        (dict(F=np.full(F.shape, "x")), "F must be"),
        (dict(F=[[1, 2], [3]]), "F"),
        (dict(F=F, tokens=toks[:5]), "tokens has 5"),
        (dict(F=F, layer=9), "layer 9"),
        (dict(F=F, head=9), "head 9"),
        (dict(F=F, phase="mid"), "phase"),
        (dict(F=F, phase=np.array(["pre"])), "phase"),
        (dict(F=F, query=len(toks)), "query"),
        (dict(F=F, query=1.0), "query"),
        (dict(F=F, k=0), "k"),
        (dict(F=F, k=2.0), "k"),
        (dict(cache=cache, tokens=np.stack([toks, toks])), "one sequence"),
    ):
        args = dict(tokens=toks, layer=1, phase="post", head=3, query=-1)
        args.update(kw)
        with pytest.raises(dclens.Error, match=match):
            routing.flow_table(
                m, args.pop("tokens"), args.pop("layer"), args.pop("phase"), args.pop("head"), args.pop("query"), **args
            )


VARIANTS = {
    "query_wise": dict(query_wise=True, seed=31),
    "key_wise": dict(key_wise=True, seed=32),
    "static": dict(use_sw=True, seed=33),
    "groups4-static-qw": dict(compose_groups=4, use_sw=True, query_wise=True, n_head=8, dim=64, seed=37),
    "groups2": dict(compose_groups=2, seed=36),
}


@pytest.mark.filterwarnings("ignore::dclens.LoadWarning")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_flows_variants(tiny_factory, name):
    d, sd, cfg = tiny_factory(model_type="dcpythia", n_layer=2, window_size=5, **VARIANTS[name])
    m = dclens.load(d)
    toks = np.arange(11) % 50 + 3
    _, cache = m.run_with_cache(toks)
    for layer, phase, head, t in ((0, "pre", 1, 9), (1, "post", m.config.n_head - 1, 10), (0, "post", 2, 4)):
        F = m.flows(toks, layer, phase, head, t, cache=cache)
        assert F.shape == (m.config.n_head, 5 + m.config.use_sw, len(toks))
        static = sd.get("layers.%d.attention.dyn_w_proj.%s_proj.w" % (layer, phase))  # [G, Mg, Mg]
        ref, vis = _reference_flows(m, cache, layer, phase, head, t, static)
        assert np.abs(F - ref).max() <= 1e-9 * max(np.abs(ref).max(), 1.0)
        _check_sums(m, cache, F, layer, phase, head, t, vis)
        if m.config.compose_groups > 1:  # no flow between groups
            Mg = m.config.n_head // m.config.compose_groups
            assert not F[np.arange(m.config.n_head) // Mg != head // Mg].any()


def test_flows_mha(tiny_factory):
    d, _, _ = tiny_factory(model_type="gpt_neox", n_layer=2, seed=5)
    m = dclens.load(d)
    toks = np.arange(9) + 2
    _, cache = m.run_with_cache(toks, names=lambda n: n.endswith("pattern"))
    F = m.flows(toks, 1, "post", 2, 6, cache=cache)
    assert F.shape == (4, 5, 9) and not np.delete(F, 0, axis=1).any() and not np.delete(F, 2, axis=0).any()
    assert np.array_equal(F[2, 0], cache["blocks.1.attn.pattern"][2, 6].astype(np.float64))
