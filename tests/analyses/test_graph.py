"""dclens.graph (issue 37): the edge graph with DCMHA's composition edges,
exact edge patching, EAP / EAP-IG, circuits and faithfulness. Checked
against the float64 reference: a patched edge is an intervention at the
receiver written from the spec, an EAP score the reference's directional
derivative along the edge's difference."""

import warnings

import numpy as np
import pytest

import dclens
from dclens import graph, patching

from reference import ref_forward

DCP = dict(model_type="dcpythia", n_layer=2, window_size=5, seed=21)
NEOX = dict(model_type="gpt_neox", n_layer=2, seed=23)
GROUPED = dict(model_type="dcpythia", n_layer=2, compose_groups=2, use_sw=True, seed=36)
SEQ = dict(model_type="dcpythia", n_layer=2, use_parallel_residual=False, seed=46)
GOOD, BAD, POS = 3, 5, -1


def _load(tiny_factory, kw):
    d, sd, cfg = tiny_factory(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dclens.load(d), sd, cfg


def _prompts(m, T=13, B=2, seed=0):
    rng = np.random.default_rng(seed)
    c = rng.integers(0, m.config.vocab, size=(B, T))
    x = c.copy()
    x[:, 3] = rng.integers(0, m.config.vocab, size=B)  # a minimal edit
    x[:, 7] = rng.integers(0, m.config.vocab, size=B)
    return c, x


def _metric(lg):
    return float(lg[POS, GOOD] - lg[POS, BAD])


def test_edge_names_and_counts(tiny_factory):
    m, _, _ = _load(tiny_factory, DCP)
    g = graph.build(m)
    L, N = 2, m.config.n_head
    assert g.edges == graph.build(m).edges  # stable
    assert len(set(g.edges)) == len(g.edges)
    assert "embed->L0.H0.q" in g.edges and "L0.H1->L1.H2.k" in g.edges and "L1.mlp->logits" in g.edges
    assert "L0.H1->L0.mlp" not in g.edges  # parallel residual: head l does not feed MLP l
    assert "L0.mlp->L1.dyn" in g.edges and "L0.H2->L0.H3.post.kp" in g.edges and "L1.H0->L1.H0.pre.qg" in g.edges
    assert "L0.H2->L0.H3.pre.qg" not in g.edges  # gates are a head's own
    comp = [e for e in g.edges if g.detail[e].kind == "comp"]
    assert len(comp) == L * 2 * (N * 3 + N * N * 2)  # per phase: skip/qg/kg self + qp/kp for every pair
    # senders upstream only: nothing of layer 1 reaches layer 0
    assert not any(e.startswith("L1.") and ("->L0." in e) for e in g.edges)
    neox, _, _ = _load(tiny_factory, NEOX)
    gn = graph.build(neox)
    assert all(gn.detail[e].kind == "resid" for e in gn.edges)
    assert not any(".dyn" in e for e in gn.edges)
    seq, _, _ = _load(tiny_factory, SEQ)
    assert "L0.H1->L0.mlp" in graph.build(seq).edges  # sequential: it does
    grp, _, _ = _load(tiny_factory, GROUPED)
    gg = graph.build(grp)
    Ng = grp.config.n_head
    assert "L0.H0->L0.H1.post.static" in gg.edges
    assert "L0.H0->L0.H%d.post.qp" % (Ng - 1) not in gg.edges  # across the two groups: left out


@pytest.mark.parametrize("kw", [DCP, NEOX, GROUPED, SEQ], ids=["dcpythia", "gpt_neox", "grouped-static", "sequential"])
def test_no_edge_is_clean_every_edge_is_corrupted(tiny_factory, kw):
    m, _, _ = _load(tiny_factory, kw)
    c, x = _prompts(m)
    g = graph.build(m)
    clean = np.mean([_metric(lg) for lg in m.forward(c)])
    corr = np.mean([_metric(lg) for lg in m.forward(x)])
    assert abs(graph.patch(m, c, x, _metric, [], graph=g) - clean) <= 1e-5 * max(abs(clean), 1)
    got = graph.patch(m, c, x, _metric, g.edges, graph=g)
    assert abs(got - corr) <= 2e-4 * max(abs(corr), 1), (got, corr)
    assert abs(clean - corr) > 1e-2  # the prompts differ


def _ref_delta(sd, cfg, c, x, sender):
    """The sender's value in the corrupted minus the clean run, float64 reference."""
    name, head = graph._sender_hook(sender)
    _, cc = ref_forward(sd, cfg, c, cache=True)
    _, xc = ref_forward(sd, cfg, x, cache=True)
    d = xc[name] - cc[name]
    return d[:, head] if head >= 0 else d


def _ref_metric_with(sd, cfg, toks, rx, add):
    """The reference's metric with `add` put into a receiver's input."""
    name, head = graph._receiver_hook(rx, cfg.get("num_hidden_layers", cfg.get("n_layer", 2)))

    def f(a):
        a = a.copy()
        if head >= 0:
            a[:, head] += add
        else:
            a += add
        return a

    return _metric(ref_forward(sd, cfg, toks, interventions={name: f}))


@pytest.mark.parametrize("kw", [DCP, NEOX], ids=["dcpythia", "gpt_neox"])
def test_one_residual_edge_against_the_reference(tiny_factory, kw):
    m, sd, cfg = _load(tiny_factory, kw)
    c, x = _prompts(m, B=1)
    g = graph.build(m)
    L = m.config.n_layer
    for edge in ("embed->L1.H1.k", "L0.H2->L1.H0.q", "L0.mlp->logits", "L0.H3->L1.mlp"):
        e = g.detail[edge]
        delta = _ref_delta(sd, cfg, c[0], x[0], e.sender)
        name, head = graph._receiver_hook(e.receiver, L)
        want = _metric(ref_forward(sd, cfg, c[0], interventions={name: (lambda a, d=delta, h=head: _add(a, d, h))}))
        got = graph.patch(m, c, x, _metric, [edge], graph=g)
        assert abs(got - want) <= 2e-4 * max(abs(want), 1), (edge, got, want)


def _add(a, d, head):
    a = a.copy()
    if head >= 0:
        a[:, head] += d
    else:
        a += d
    return a


def test_one_composition_edge_against_the_reference(tiny_factory):
    """L1.H0 -> L1.H2 through post.kp: target 2's kp branch gets source 0's
    corrupted pattern times the clean map entry, written here from the spec."""
    m, sd, cfg = _load(tiny_factory, DCP)
    c, x = _prompts(m, B=1)
    g = graph.build(m)
    edge = "L1.H0->L1.H2.post.kp"
    assert edge in g.edges
    _, cc = ref_forward(sd, cfg, c[0], cache=True)
    _, xc = ref_forward(sd, cfg, x[0], cache=True)
    P_c, P_x = cc["blocks.1.attn.pattern"][0], xc["blocks.1.attn.pattern"][0]
    kw1, kw2 = cc["blocks.1.attn.dyn.post.kw1"], cc["blocks.1.attn.dyn.post.kw2"]  # [S, R, N]
    coef = np.einsum("sr,sr->s", kw1[:, :, 0], kw2[:, :, 2])  # source 0 -> target 2, per key
    T = c.shape[1]
    window = m.config.window_size if 1 in m.config.local_layers else 0
    t, s = np.indices((T, T))
    mask = (s <= t) & ((window <= 0) | (t - s <= window))
    add = np.where(mask, (P_x - P_c) * coef[None, :], 0.0)

    def f(a):
        a = a.copy()
        a[2] += add
        return a

    want = _metric(ref_forward(sd, cfg, c[0], interventions={"blocks.1.attn.post.kp": f}))
    got = graph.patch(m, c, x, _metric, [edge], graph=g)
    assert abs(got - want) <= 2e-4 * max(abs(want), 1), (got, want)
    assert abs(got - _metric(m.forward(c[0]))) > 1e-4  # the edge mattered


@pytest.mark.parametrize("kw", [DCP, NEOX], ids=["dcpythia", "gpt_neox"])
def test_eap_is_the_reference_directional_derivative(tiny_factory, kw):
    """EAP(edge) = d metric(receiver input + eps delta) / d eps at 0, with the
    reference (central differences, float64)."""
    m, sd, cfg = _load(tiny_factory, kw)
    c, x = _prompts(m, B=1)
    g = graph.build(m)
    s = graph.attribute_edges(m, c, x, ("logit_diff", POS, GOOD, BAD), method="eap", graph=g, progress=False)
    L = m.config.n_layer
    for edge in ("embed->L1.H1.k", "L0.H2->L1.H0.q", "L0.mlp->logits", "L0.H3->L1.mlp", "embed->L0.H1.v"):
        e = g.detail[edge]
        delta = _ref_delta(sd, cfg, c[0], x[0], e.sender)
        name, head = graph._receiver_hook(e.receiver, L)
        h = 1e-3

        def at(eps, name=name, delta=delta, head=head):
            return _metric(ref_forward(sd, cfg, c[0], interventions={name: lambda a: _add(a, eps * delta, head)}))

        fd = (at(h) - at(-h)) / (2 * h)
        got = s.scores[g.edges.index(edge)]
        assert abs(got - fd) <= 2e-3 * max(abs(fd), 1e-2), (edge, got, fd)


def test_eap_ig_circuits_and_faithfulness(tiny_factory):
    m, _, _ = _load(tiny_factory, DCP)
    c, x = _prompts(m)
    g = graph.build(m)
    s = graph.attribute_edges(
        m, c, x, ("logit_diff", POS, GOOD, BAD), method="eap-ig", steps=4, graph=g, progress=False
    )
    assert s.scores.shape == (len(g.edges),) and s.method == "eap-ig" and s.steps == 4
    top = s.top(5)
    assert len(top) == 5 and abs(top[0][1]) >= abs(top[-1][1])
    full = graph.Circuit(g, frozenset(g.edges))
    assert graph.faithfulness(m, full, c, x, _metric) == pytest.approx(1.0, abs=1e-4)
    assert graph.faithfulness(m, graph.Circuit(g, frozenset()), c, x, _metric) == pytest.approx(0.0, abs=1e-3)
    circ = s.circuit(top_n=40)
    assert len(circ.edges) == 40 and "logits" in circ.nodes
    f = graph.faithfulness(m, circ, c, x, _metric)
    assert np.isfinite(f)
    assert s.circuit(threshold=0.0).edges == frozenset(g.edges)


def test_bad_input(tiny_factory):
    m, _, _ = _load(tiny_factory, DCP)
    c, x = _prompts(m)
    g = graph.build(m)
    t = ("logit_diff", POS, GOOD, BAD)
    cases = [
        (lambda: graph.patch(m, c, x, _metric, ["embed->L0.H0.qq"], graph=g), "did you mean"),
        (lambda: graph.patch(m, c, x[:, :-1], _metric, []), "must pair up"),
        (lambda: graph.patch(m, c, x, lambda lg: float("nan"), []), "NaN"),
        (lambda: graph.patch(m, c, x, "logit_diff", []), "metric must be a function"),
        (lambda: graph.patch(m, c, x, _metric, "embed->L0.H0.q"), "edges must be a list"),
        (lambda: graph.attribute_edges(m, c, x, t, method="eap-ig", steps=0), "steps"),
        (lambda: graph.attribute_edges(m, c, x, t, method="acdc"), "method must be"),
        (lambda: graph.attribute_edges(m, c, x, t, max_grad_bytes=0), "max_grad_bytes 0 is out of range"),
        (lambda: graph.attribute_edges(m, c, x, t, roles="end"), "roles must be a dict"),
        (lambda: graph.attribute_edges(m, c, x, _metric), "target tuple"),
        (lambda: graph.EdgeScores(g, np.zeros(len(g.edges)), "eap", 1).circuit(), "top_n or threshold"),
        (lambda: graph.faithfulness(m, ["embed->L0.H0.q"], c, x, _metric), "Circuit"),
        (lambda: graph.path_patch_sweep(m, c, x, _metric, "logits", graph=g), "receivers must be a non-empty list"),
        (lambda: graph.path_patch_sweep(m, c, x, _metric, [], graph=g), "receivers must be a non-empty list"),
        (lambda: graph.EdgeScores(g, np.zeros(len(g.edges)), "eap", 1).circuit(threshold=True), "threshold"),
    ]
    for call, said in cases:
        with pytest.raises(dclens.Error, match=said):
            call()
    with (
        m.hooks([("blocks.0.attn.z", lambda a, n: a)]),
        pytest.raises(dclens.Error, match="graph.attribute_edges: 1 hook in force"),
    ):
        graph.attribute_edges(m, c, x, t)


def test_patching_metrics_carry_their_target(tiny_factory):
    m, _, _ = _load(tiny_factory, DCP)
    c, x = _prompts(m, B=1)
    met = patching.logit_diff(GOOD, BAD)
    a = graph.attribute_edges(m, c, x, met, progress=False)
    b = graph.attribute_edges(m, c, x, ("logit_diff", -1, GOOD, BAD), progress=False)
    np.testing.assert_array_equal(a.scores, b.scores)


def test_path_patching(tiny_factory):
    m, _, _ = _load(tiny_factory, DCP)
    c, x = _prompts(m)
    g = graph.build(m)
    # one receiver: the same as that one edge; every receiver of a sender: all its edges
    one = graph.path_patch(m, c, x, _metric, "L0.H1", ["L1.H2.q"], graph=g)
    assert one == graph.patch(m, c, x, _metric, ["L0.H1->L1.H2.q"], graph=g)
    rx = [e.split("->")[1] for e in g.edges if e.startswith("L0.H1->")]
    allp = graph.path_patch(m, c, x, _metric, "L0.H1", rx, graph=g)
    assert allp == graph.patch(m, c, x, _metric, ["L0.H1->" + r for r in rx], graph=g)
    sweep = graph.path_patch_sweep(m, c, x, _metric, ["logits"], graph=g, progress=False)
    assert set(sweep) == set(g.senders) and sweep["L1.mlp"] == graph.patch(
        m, c, x, _metric, ["L1.mlp->logits"], graph=g
    )
    with pytest.raises(dclens.Error, match="did you mean"):
        graph.path_patch(m, c, x, _metric, "L0.H1", ["L0.H2.q"], graph=g)  # not downstream
    with pytest.raises(dclens.Error, match="unknown sender"):
        graph.path_patch(m, c, x, _metric, "L9.H1", ["logits"], graph=g)


def test_circuit_picture(tiny_factory):
    m, _, _ = _load(tiny_factory, DCP)
    c, x = _prompts(m)
    s = graph.attribute_edges(m, c, x, ("logit_diff", POS, GOOD, BAD), progress=False)
    circ = s.circuit(top_n=30)
    assert set(circ.scores) == set(circ.edges)
    png = circ._repr_png_()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    fig = circ.plot(title="t")
    assert fig.axes[0].get_title() == "t"


def test_position_aware_scores_sum_to_the_scores(tiny_factory):
    m, _, _ = _load(tiny_factory, DCP)
    c, x = _prompts(m)
    t = ("logit_diff", POS, GOOD, BAD)
    a = graph.attribute_edges(m, c, x, t, progress=False)
    b = graph.attribute_edges(m, c, x, t, positions=True, progress=False)
    assert a.per_position is None and b.per_position.shape == (len(a.scores), c.shape[1])
    np.testing.assert_allclose(b.scores, a.scores, atol=1e-6 * max(1.0, np.abs(a.scores).max()))
    # the embedding differs at the two edited positions only (3 and 7): so do its edges' scores
    i = a.graph.edges.index("embed->L1.H0.k")
    nz = np.nonzero(b.per_position[i])[0]
    assert set(nz) <= {3, 7} and len(nz) > 0
    with pytest.raises(dclens.Error, match="positions must be True or False"):
        graph.attribute_edges(m, c, x, t, positions="yes")


def test_pairs_of_different_lengths_are_padded(tiny_factory):
    """Pairs of 13 and 9 tokens in one padded batch: each score, patch and
    faithfulness equals the mean of the pairs run alone (pad positions are
    read by nothing real: the attention is causal), on either padding side."""
    from dclens._core.batch import pad

    m, _, _ = _load(tiny_factory, DCP)
    c13, x13 = _prompts(m, T=13, B=1, seed=1)
    c9, x9 = _prompts(m, T=9, B=1, seed=2)
    g = graph.build(m)
    t = ("logit_diff", POS, GOOD, BAD)
    for side in ("right", "left"):
        c = pad([c13[0], c9[0]], side, pad_id=7)
        x = pad([x13[0], x9[0]], side, pad_id=7)
        both = graph.attribute_edges(m, c, x, t, graph=g, progress=False).scores
        alone = [graph.attribute_edges(m, a, b, t, graph=g, progress=False).scores for a, b in ((c13, x13), (c9, x9))]
        np.testing.assert_allclose(both, np.mean(alone, 0), rtol=1e-4, atol=1e-5 * np.abs(both).max())
        edges = ["L0.H1->L1.H2.q", "embed->L1.mlp", "L0.H2->L0.H3.post.kp", "L1.H0->logits"]
        for es in ([], edges, g.edges):
            got = graph.patch(m, c, x, _metric, es, graph=g)
            want = np.mean([graph.patch(m, a, b, _metric, es, graph=g) for a, b in ((c13, x13), (c9, x9))])
            assert got == pytest.approx(want, rel=1e-5, abs=1e-5), (side, len(es))
        ig = graph.attribute_edges(m, c, x, t, method="eap-ig", steps=2, graph=g, progress=False).scores
        ig1 = [
            graph.attribute_edges(m, a, b, t, method="eap-ig", steps=2, graph=g, progress=False).scores
            for a, b in ((c13, x13), (c9, x9))
        ]
        np.testing.assert_allclose(ig, np.mean(ig1, 0), rtol=1e-4, atol=1e-5 * np.abs(ig).max())
    c, x = pad([c13[0], c9[0]]), pad([x13[0], x9[0]])
    with pytest.raises(dclens.Error, match="positions=True: the prompt pairs have different lengths"):
        graph.attribute_edges(m, c, x, t, positions=True, progress=False)
    with pytest.raises(dclens.Error, match="pair 1 has 9 clean and 10 corrupted tokens"):
        graph.patch(m, c, pad([x13[0], np.r_[x9[0], 1]]), _metric, [], graph=g)
    # a bare (tokens, lengths) pair that is left-padded: refused, not read as right-padded
    lt = pad([c13[0], c9[0]], "left", pad_id=7)
    with pytest.raises(dclens.Error, match="row 1 of this .tokens, lengths. pair looks left-padded"):
        graph.patch(m, (lt.tokens, lt.lengths), x, _metric, [], graph=g)


def test_equal_baselines_warn(tiny_factory):
    m, _, _ = _load(tiny_factory, DCP)
    c, _ = _prompts(m)
    with pytest.warns(patching.PatchingWarning, match="nearly equal"):
        s = graph.attribute_edges(m, c, c, ("logit_diff", POS, GOOD, BAD), progress=False)
    assert not np.any(s.scores)  # no difference anywhere: every score is 0


def test_roles_align_positions_across_pairs_of_different_lengths(tiny_factory):
    """per_role of a padded batch equals, per pair alone, the position-aware
    scores summed over that pair's positions of the role, averaged."""
    from dclens._core.batch import pad

    m, _, _ = _load(tiny_factory, DCP)
    c13, x13 = _prompts(m, T=13, B=1, seed=1)
    c9, x9 = _prompts(m, T=9, B=1, seed=2)
    g = graph.build(m)
    t = ("logit_diff", POS, GOOD, BAD)
    roles = [
        {"edit": [3, 7], "span": (4, 7), "end": -1},
        {"edit": [3, 7], "span": (4, 7), "end": -1},
    ]
    s = graph.attribute_edges(m, pad([c13[0], c9[0]]), pad([x13[0], x9[0]]), t, graph=g, roles=roles, progress=False)
    assert s.roles == ("edit", "span", "end") and s.per_role.shape == (len(g.edges), 3)
    want = np.zeros_like(s.per_role)
    for (c, x), n in (((c13, x13), 13), ((c9, x9), 9)):
        pp = graph.attribute_edges(m, c, x, t, graph=g, positions=True, progress=False).per_position
        want += np.stack([pp[:, [3, 7]].sum(1), pp[:, 4:7].sum(1), pp[:, n - 1]], axis=1) / 2
    np.testing.assert_allclose(s.per_role, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    # roles that cover every position add up to the scores
    part = graph.attribute_edges(m, c13, x13, t, graph=g, roles={"head": (0, 5), "tail": (5, 13)}, progress=False)
    np.testing.assert_allclose(part.per_role.sum(1), part.scores, atol=1e-6 * np.abs(part.scores).max())
    bad = [
        ({"a": 20}, "roles\\['a'\\] of pair 0"),
        ({"a": (5, 5)}, "span .* is empty"),
        ([{"a": 1}], "a list of 2 such dicts"),
        ([{"a": 1}, {"b": 1}], "pair 1 names roles"),
        ({3: 1}, "name the roles with strings"),
    ]
    for r, said in bad:
        with pytest.raises(dclens.Error, match=said):
            graph.attribute_edges(m, pad([c13[0], c9[0]]), pad([x13[0], x9[0]]), t, graph=g, roles=r, progress=False)


@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_gradients_in_chunks_of_layers_give_the_same_scores(tiny_factory, method):
    """max_grad_bytes too small for every receiver's gradient at once: one
    backward per layer, each scored as it comes; the same scores (per
    position and per role too)."""
    m, _, _ = _load(tiny_factory, DCP)
    c, x = _prompts(m)
    g = graph.build(m)
    kw = dict(method=method, steps=3, graph=g, positions=True, roles={"edit": [3, 7], "end": -1}, progress=False)
    t = ("logit_diff", POS, GOOD, BAD)
    whole = graph.attribute_edges(m, c, x, t, **kw)
    split = graph.attribute_edges(m, c, x, t, max_grad_bytes=1, **kw)  # a layer per backward
    for a, b in (
        (whole.scores, split.scores),
        (whole.per_position, split.per_position),
        (whole.per_role, split.per_role),
    ):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * np.abs(a).max())


@pytest.mark.parametrize("kw", [DCP, NEOX], ids=["dcpythia", "gpt_neox"])
def test_eap_ig_activations_against_the_reference(tiny_factory, kw):
    """eap-ig-activations with steps=1: each of the 2 L + 1 nodes in turn at
    its clean/corrupted midpoint (a constant of the run); an edge's score is
    the mean over those runs of the reference's directional derivative along
    the edge's difference, the node held at its midpoint."""
    m, sd, cfg = _load(tiny_factory, kw)
    c, x = _prompts(m, B=1)
    g = graph.build(m)
    s = graph.attribute_edges(
        m, c, x, ("logit_diff", POS, GOOD, BAD), method="eap-ig-activations", steps=1, graph=g, progress=False
    )
    L = m.config.n_layer
    _, cc = ref_forward(sd, cfg, c[0], cache=True)
    _, xc = ref_forward(sd, cfg, x[0], cache=True)
    nodes = ["embed"] + ["blocks.%d.%s" % (l, n) for l in range(L) for n in ("attn.head_out", "mlp.out")]
    for edge in ("embed->L1.H1.k", "L0.H2->L1.H0.q", "L0.mlp->logits", "embed->L0.H1.v"):
        e = g.detail[edge]
        delta = _ref_delta(sd, cfg, c[0], x[0], e.sender)
        name, head = graph._receiver_hook(e.receiver, L)
        h, fds = 1e-3, []
        for node in nodes:
            mid = (cc[node] + xc[node]) / 2

            def at(eps, node=node, mid=mid, name=name, delta=delta, head=head):
                iv = {node: lambda a, mid=mid: mid.copy(), name: lambda a: _add(a, eps * delta, head)}
                return _metric(ref_forward(sd, cfg, c[0], interventions=iv))

            fds.append((at(h) - at(-h)) / (2 * h))
        want = float(np.mean(fds))
        got = s.scores[g.edges.index(edge)]
        assert abs(got - want) <= 3e-3 * max(abs(want), 1e-2), (edge, got, want)


MOH = dict(model_type="dcpythia", n_layer=2, moh={"shared_heads": 1, "routed_topk": 2}, use_sw=True, seed=41)
DCF = dict(model_type="dcformer", n_layer=2, intermediate=64, mgate_dim=4, vocab=24, seed=7)


@pytest.mark.parametrize("kw", [DCP, NEOX, MOH, DCF], ids=["dcpythia", "gpt_neox", "moh", "dcformer"])
def test_heads_differences_from_z_are_head_outs(tiny_factory, kw):
    """attribute reads a head's difference as (z_x - z_c) W_O,n (head_out's
    definition, hooks.md) instead of head_out itself: the same senders'
    differences to float32 rounding, MoH's gated heads included."""
    d, _, _ = tiny_factory(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dclens.LoadWarning)
        m = dclens.load(d)
    g = graph.build(m)
    rng = np.random.default_rng(0)
    c = rng.integers(0, m.config.vocab, (2, 9))
    x = c.copy()
    x[:, 3] = (x[:, 3] + 1) % m.config.vocab
    names = sorted({graph._sender_read(s, z) for s in g.senders for z in (False, True)})
    _, cc = m.run_with_cache(c, names=names)
    _, xc = m.run_with_cache(x, names=names)
    cc, xc = {n: np.asarray(v) for n, v in cc.items()}, {n: np.asarray(v) for n, v in xc.items()}
    from_z = graph._sender_deltas(g, cc, xc, m)
    from_out = graph._sender_deltas(g, cc, xc)
    heads = [i for i, s in enumerate(g.senders) if s.startswith("L") and ".H" in s]
    assert heads and np.abs(from_out[heads]).max() > 0
    np.testing.assert_allclose(from_z, from_out, rtol=0, atol=2e-6 * np.abs(from_out).max())


def test_a_circuit_threshold_may_be_a_numpy_number(tiny_factory):
    m, _, _ = _load(tiny_factory, DCP)
    g = graph.build(m)
    sc = graph.EdgeScores(g, np.linspace(0, 1, len(g.edges)), "eap", 1)
    assert sc.circuit(threshold=np.float32(0.5)).edges == sc.circuit(threshold=0.5).edges


def test_lent_terms_refuses_what_it_cannot_compute(tiny_factory):
    from dclens import interventions as iv

    m, _, _ = _load(tiny_factory, DCP)  # no static branch
    c, _ = _prompts(m, B=1)
    _, cache = m.run_with_cache(c[0], names=["blocks.1.attn.pattern"])
    X = np.asarray(cache["blocks.1.attn.pattern"])
    with pytest.raises(dclens.ArgumentError, match="branch must be 'qp', 'kp' or 'static'"):
        iv.lent_terms(m, 1, "post", "skip", X, {}, 0)
    with pytest.raises(dclens.ArgumentError, match="source"):
        iv.lent_terms(m, 1, "post", "qp", X, {}, m.config.n_head)
    with pytest.raises(dclens.Error, match="no static"):
        iv.lent_terms(m, 1, "post", "static", X, {}, 0)
