"""Attribution graphs (dclens.features.attribution_graph) against the replacement model run
by the engine itself: write hooks freeze the composed patterns, the norms' scales (each norm
recomputed from its current input with the clean run's scale) and the MLPs (the transcoder's
output plus its error), and a finite difference of a source in that run is its edge to every
target, for every edge of small graphs; the compose nodes' edges into the logits against a
finite difference with that layer's composition live. Plus circuit-tracer's scores and
pruning on hand-made adjacencies, the JSON format, and bad input."""

import json

import numpy as np
import pytest

from dclens import Error, features
from dclens.features import compose_nodes
from dclens.features.attribution_graph import AttributionGraph, Node, attribution_graph
from dclens.features.replacement import Replacement

PROMPT = np.array([0, 5, 9, 3, 17, 5, 9], np.int32)


def _model(tiny_factory, **kw):
    import dclens

    d, _, _ = tiny_factory(n_layer=2, dim=32, n_head=4, vocab=64, seed=7, **kw)
    return dclens.load(d)


def _transcoders(model, F=12, seed=0, hook="ln_mlp"):
    c = model.config
    rng = np.random.default_rng(seed)
    out = []
    for l in range(c.n_layer):
        cfg = features.SAEConfig(
            d_in=c.d_model, d_sae=F, hook_name="blocks.%d.%s" % (l, hook), hook_name_out="blocks.%d.mlp.out" % l
        )
        tc = features.SAE(cfg)
        tc.set_parameters(
            W_enc=rng.normal(0, 1 / np.sqrt(c.d_model), (c.d_model, F)).astype(np.float32),
            b_enc=np.full(F, -0.6, np.float32),
            W_dec=rng.normal(0, 0.3, (F, c.d_model)).astype(np.float32),
            b_dec=rng.normal(0, 0.1, c.d_model).astype(np.float32),
        )
        out.append(tc)
    return out


def _norm(model, name, x, sigma):
    """A norm of x [T, D] with the scale frozen at sigma [T] (the spec's LayerNorm / RMSNorm)."""
    w = model.weight(name + ".weight").astype(np.float64)
    if model.config.norm == "rms":
        return x / sigma[:, None] * w
    return (x - x.mean(-1, keepdims=True)) / sigma[:, None] * w + model.weight(name + ".bias")


def _sigma(model, x):
    v = (x * x).mean(-1) if model.config.norm == "rms" else x.var(-1)
    return np.sqrt(v + model.config.norm_eps)


class EngineReplacement:
    """The replacement model of PROMPT run by the engine with write hooks (independent of
    dclens.features.replacement): run(delta) perturbs mlp.out / embed and returns every
    target's value."""

    def __init__(self, model, tcs, tokens=PROMPT):
        self.m, self.tcs, self.toks, L = model, tcs, tokens, model.config.n_layer
        pat = "attn.pattern_composed" if model.config.use_dcmha else "attn.pattern"
        names = ["blocks.%d.%s" % (l, w) for l in range(L) for w in ("resid_pre", "mlp_input", "mlp.out", pat)]
        names += ["blocks.%d.resid_post" % (L - 1)] + [tc.cfg.hook_name for tc in tcs]
        self.logits, cache = model.run_with_cache(tokens, names=names)
        self.c = {n: np.asarray(cache[n], np.float64) for n in names}
        self.pat = pat
        self.sig = {}
        for l in range(L):
            self.sig["attn", l] = _sigma(model, self.c["blocks.%d.resid_pre" % l])
            self.sig["mlp", l] = _sigma(model, self.c["blocks.%d.mlp_input" % l])
        self.sig["final"] = _sigma(model, self.c["blocks.%d.resid_post" % (L - 1)])

    def run(self, mlp_delta=None, embed_delta=None, live_compose=None, dyn_delta=None, extra_hooks=()):
        """-> (logits [V] at the last position, pre-activations [L][T, F], u0 [L][T, D] (the
        attention norm of the residual without its bias)). mlp_delta: {layer: [T, D]} added
        to mlp.out; embed_delta [T, D]; live_compose: a layer whose composed pattern is not
        frozen; dyn_delta: (layer, [T, D]) added to that layer's attn.dyn_input; extra_hooks:
        more (name, fn) pairs, after these."""
        m, L = self.m, self.m.config.n_layer
        seen, pre, u0 = {}, [None] * L, [None] * L

        def keep(a, n):
            seen[n] = np.asarray(a, np.float64).copy()

        def ln(kind, l, src, norm):
            def fn(a, n):
                x = seen[src]
                if kind == "attn":
                    u0[l] = _norm(m, norm, x, self.sig[kind, l]) - (
                        0 if m.config.norm == "rms" else m.weight(norm + ".bias")
                    )
                out = _norm(m, norm, x, self.sig[kind, l] if kind != "final" else self.sig["final"])
                if kind == "mlp":
                    tc = self.tcs[l]
                    xin = out if tc.cfg.hook_name.endswith("ln_mlp") else x
                    pre[l] = xin @ tc.W_enc.astype(np.float64) + tc.parameters()["b_enc"]
                return out.astype(np.float32)

            return fn

        hooks = []
        if embed_delta is not None:
            hooks.append(("embed", lambda a, n: (np.asarray(a, np.float64) + embed_delta).astype(np.float32)))
        for l in range(L):
            b = "blocks.%d." % l
            hooks += [(b + "resid_pre", keep), (b + "mlp_input", keep)]
            hooks.append((b + "ln_attn", ln("attn", l, b + "resid_pre", "layers.%d.attention_norm" % l)))
            if dyn_delta is not None and dyn_delta[0] == l:
                hooks.append(
                    (b + "attn.dyn_input", lambda a, n: (np.asarray(a, np.float64) + dyn_delta[1]).astype(np.float32))
                )
            if live_compose != l:
                hooks.append((b + self.pat, lambda a, n, v=self.c[b + self.pat]: v.astype(np.float32)))
            hooks.append((b + "ln_mlp", ln("mlp", l, b + "mlp_input", "layers.%d.ffn_norm" % l)))
            out = self.c[b + "mlp.out"] + (mlp_delta or {}).get(l, 0)
            hooks.append((b + "mlp.out", lambda a, n, v=out: v.astype(np.float32)))
        last = "blocks.%d.resid_post" % (L - 1)
        hooks += [(last, keep), ("ln_final", ln("final", -1, last, "norm"))] + list(extra_hooks)
        logits = np.asarray(m.run_with_hooks(self.toks, fwd_hooks=hooks), np.float64)
        return logits[-1], pre, u0


def _target_values(g: AttributionGraph, run) -> np.ndarray:
    """Every target node's value in one replacement run (features: pre-activation; logits:
    minus the mean logit; compose: w . u0 is not a value of the run, so NaN)."""
    logits, pre, _ = run
    out = np.full(len(g), np.nan)
    for i, n in enumerate(g.nodes):
        if n.kind == "feature":
            out[i] = pre[n.layer][n.pos, n.index]
        elif n.kind == "logit":
            out[i] = logits[n.index] - logits.mean()
    return out


def _source_vector(rep, n) -> np.ndarray:
    """What a source node writes into the residual, per unit of its activation."""
    if n.kind == "feature":
        return rep.transcoders[n.layer].W_dec[n.index].astype(np.float64)
    return rep.error[n.layer][n.pos] if n.kind == "error" else rep.embed[n.pos]


def _fd_columns(g, er, rep):
    """Each source's column of the adjacency by central differences in the engine's run."""
    T, D = len(PROMPT), er.m.config.d_model
    cols = {}
    for j, n in enumerate(g.nodes):
        if n.kind not in ("feature", "error", "token"):
            continue
        vec, scale = _source_vector(rep, n), (n.value if n.kind == "feature" else 1.0)
        eps = 0.5 / max(np.abs(vec).max(), 1e-9)
        d = np.zeros((T, D))
        d[n.pos] = eps * vec
        if n.kind == "token":
            plus, minus = er.run(embed_delta=d), er.run(embed_delta=-d)
        else:
            plus, minus = er.run(mlp_delta={n.layer: d}), er.run(mlp_delta={n.layer: -d})
        cols[j] = scale * (_target_values(g, plus) - _target_values(g, minus)) / (2 * eps)
    return cols


@pytest.mark.parametrize(
    "variant",
    [
        dict(model_type="dcpythia"),
        dict(model_type="dcpythia", use_parallel_residual=False),
        dict(model_type="dcpythia", query_wise=True),
        dict(model_type="gpt_neox"),
        dict(model_type="dcformer"),
    ],
    ids=["dcpythia", "sequential", "query_wise", "pythia", "dcformer"],
)
def test_every_edge_is_a_finite_difference_of_the_replacement_model(tiny_factory, variant):
    m = _model(tiny_factory, **variant)
    tcs = _transcoders(m, hook="mlp_input" if variant.get("use_parallel_residual") is False else "ln_mlp")
    g = attribution_graph(m, PROMPT, tcs, compose=False, progress=False, batch_size=7)
    er = EngineReplacement(m, tcs)
    rep = Replacement(m, PROMPT, tcs)
    # the replacement run with nothing perturbed is the model: errors added back
    logits0, _, _ = er.run()
    assert np.abs(logits0 - np.asarray(er.logits[-1], np.float64)).max() < 1e-4
    assert g.index["feature"].size >= 5  # the transcoders fire
    rows = np.concatenate([g.index["feature"], g.index["logit"]])
    scale = np.abs(g.adjacency[rows]).max()
    for j, col in _fd_columns(g, er, rep).items():
        np.testing.assert_allclose(g.adjacency[rows, j], col[rows], atol=2e-4 * scale, err_msg=g.nodes[j].name)


def test_compose_nodes_edges_into_the_logits_are_the_live_compose_derivative(tiny_factory):
    m = _model(tiny_factory, model_type="dcpythia")
    tcs = _transcoders(m)
    g = attribution_graph(m, PROMPT, tcs, compose=True, progress=False)
    rep = Replacement(m, PROMPT, tcs, compose=True)
    er = EngineReplacement(m, tcs)
    rng = np.random.default_rng(3)
    T, D = len(PROMPT), m.config.d_model
    logit_rows = g.index["logit"]
    checked = 0
    for l in range(m.config.n_layer):
        for t in (2, T - 1):
            i = next(k for k in g.index["compose"] if g.nodes[k].layer == l and g.nodes[k].pos == t)
            # a direction that leaves the norm's scale alone to first order: centred, orthogonal to x
            x = rep.resid[l][t] - rep.resid[l][t].mean()
            delta = rng.normal(size=D)
            delta -= delta.mean()
            delta -= x * (delta @ x) / (x @ x)
            eps = 1e-2 / np.abs(delta).max()
            d = np.zeros((T, D))
            d[t] = eps * delta
            lp = er.run(live_compose=l, dyn_delta=(l, d))[0]
            lm = er.run(live_compose=l, dyn_delta=(l, -d))[0]
            slope = [
                (lp[n.index] - lp.mean() - lm[n.index] + lm.mean()) / (2 * eps)
                for n in (g.nodes[k] for k in logit_rows)
            ]
            # d logit / d eps = g_u . (w * delta / sigma): the compose gradient at u, through the frozen norm
            G_at = {
                lv: Gl.copy()
                for lv, Gl in rep.backward(
                    len(logit_rows),
                    {
                        ("resid", rep.L): [
                            (
                                k,
                                T - 1,
                                rep.norm_T_at("final", len(PROMPT) - 1, rep.W_U[g.nodes[r].index] - rep.W_U.mean(0)),
                            )
                            for k, r in enumerate(logit_rows)
                        ]
                    },
                )
            }
            g_u = compose_nodes.compose_grad(rep, l, G_at[l + 1])[:, t]
            want = rep.norm_T(("attn", l), g_u[:, None, :] * np.ones((1, T, 1)))[:, t] @ delta
            np.testing.assert_allclose(slope, want, rtol=2e-2, atol=1e-3 * max(np.abs(want).max(), 1e-6))
            # and the graph's edge compose -> logit is that gradient against u without its bias
            u0 = rep.norm_frozen(("attn", l), rep.resid[l])[t]
            np.testing.assert_allclose(g.adjacency[logit_rows, i], g_u @ u0, rtol=1e-9, atol=1e-12)
            checked += 1
    assert checked == 2 * m.config.n_layer


def test_compose_nodes_incoming_edges_are_finite_differences(tiny_factory):
    """A compose node's value is linear in the residual it reads; every source's edge into it
    is the finite difference of that value (w . u0) in the frozen run."""
    m = _model(tiny_factory, model_type="dcpythia")
    tcs = _transcoders(m)
    g = attribution_graph(m, PROMPT, tcs, compose=True, progress=False)
    rep = Replacement(m, PROMPT, tcs, compose=True)
    er = EngineReplacement(m, tcs)
    comp = g.index["compose"]
    # the node's seed direction at u: w = its value / (its u0), recovered from the graph build
    n_logit = len(g.index["logit"])
    G_at = {
        lv: Gl.copy()
        for lv, Gl in rep.backward(
            n_logit,
            {
                ("resid", rep.L): [
                    (
                        k,
                        len(PROMPT) - 1,
                        rep.norm_T_at("final", len(PROMPT) - 1, rep.W_U[g.nodes[r].index] - rep.W_U.mean(0)),
                    )
                    for k, r in enumerate(g.index["logit"])
                ]
            },
        )
    }
    wts = g.logit_probs / g.logit_probs.sum()
    gdir = {l: np.einsum("k,ktd->td", wts, compose_nodes.compose_grad(rep, l, G_at[l + 1])) for l in range(rep.L)}
    for i in comp:
        n = g.nodes[i]
        u0 = rep.norm_frozen(("attn", n.layer), rep.resid[n.layer])[n.pos]
        assert n.value == pytest.approx(float(gdir[n.layer][n.pos] @ u0), rel=1e-9, abs=1e-12)

    def values(run):
        return np.array(
            [gdir[g.nodes[i].layer][g.nodes[i].pos] @ run[2][g.nodes[i].layer][g.nodes[i].pos] for i in comp]
        )

    T, D = len(PROMPT), m.config.d_model
    sources = [j for j, n in enumerate(g.nodes) if n.kind in ("feature", "error", "token")]
    scale = np.abs(g.adjacency[np.ix_(comp, sources)]).max()
    for j in sources:
        n = g.nodes[j]
        vec = _source_vector(rep, n)
        eps = 0.5 / max(np.abs(vec).max(), 1e-9)
        d = np.zeros((T, D))
        d[n.pos] = eps * vec
        if n.kind == "token":
            fd = values(er.run(embed_delta=d)) - values(er.run(embed_delta=-d))
        else:
            fd = values(er.run(mlp_delta={n.layer: d})) - values(er.run(mlp_delta={n.layer: -d}))
        fd *= (n.value if n.kind == "feature" else 1.0) / (2 * eps)
        np.testing.assert_allclose(g.adjacency[comp, j], fd, atol=2e-4 * scale, err_msg=n.name)


def test_dyn_forward_is_the_engines_dynamic_weights(tiny_factory):
    for kw in (dict(), dict(query_wise=True)):
        m = _model(tiny_factory, model_type="dcpythia", **kw)
        ws = ("qw1", "qw2", "qdd") + (() if kw else ("kw1", "kw2", "kdd"))
        names = ["blocks.1.ln_attn"] + ["blocks.1.attn.dyn.%s.%s" % (ph, w) for ph in ("pre", "post") for w in ws]
        _, cache = m.run_with_cache(PROMPT, names=names)
        fw = compose_nodes.dyn_forward(m, 1, np.asarray(cache["blocks.1.ln_attn"], np.float64))
        for ph in ("pre", "post"):
            for w in ws:
                np.testing.assert_allclose(
                    fw[ph][w], cache["blocks.1.attn.dyn.%s.%s" % (ph, w)], atol=2e-5, err_msg=ph + w
                )


# ---------------------------------------------------------------- scores, pruning, JSON


def _chain_graph(err_weight: float) -> AttributionGraph:
    """token -> feature -> logit, and an error -> logit edge of err_weight."""
    nodes = [
        Node("feature", 0, 0, 3, 1.0),
        Node("error", 0, 0, -1, 1.0),
        Node("token", -1, 0, 7, 1.0),
        Node("logit", 1, 0, 2, 1.0),
    ]
    A = np.zeros((4, 4))
    A[0, 2] = 2.0  # token -> feature
    A[3, 0] = 1.0  # feature -> logit
    A[3, 1] = err_weight
    return AttributionGraph(nodes, A, np.array([1.0]), np.array([7]), 1)


def test_scores_as_circuit_tracer_defines_them():
    r, comp = _chain_graph(0.0).scores()
    assert r == 1.0 and comp == 1.0  # everything through features
    r, comp = _chain_graph(1.0).scores()
    # normalised rows: the logit's inputs half feature, half error; the feature's all token.
    # influence on the logit: feature 0.5, error 0.5, token 0.5 (through the feature)
    assert r == pytest.approx(0.5)  # tokens 0.5 / (tokens 0.5 + errors 0.5)
    # non-error share of each node's inputs (1, 1, 1, 0.5) weighted by influence + logit weight
    assert comp == pytest.approx((0.5 + 0.5 + 0.5 + 0.5 * 1.0) / 2.5)


def test_prune_keeps_the_influential_path():
    g = _chain_graph(0.01)
    node, edge = g.prune(0.8, 0.98)
    assert node.tolist() == [True, False, True, True]
    assert edge[3, 0] and edge[0, 2] and not edge[3, 1]
    with pytest.raises(Error, match="node_threshold"):
        g.prune(1.5)


def test_top_and_inputs_read_the_influence_and_the_rows():
    g = _chain_graph(0.5)
    # influence: feature 2/3, error 1/3, token 2/3 (through the feature)
    top = g.top(2)
    assert [n.kind for n, _ in top] == ["feature", "token"] and top[0][1] == pytest.approx(2 / 3)
    assert [n.kind for n, _ in g.top(5, kinds=["error"])] == ["error"]
    ins = g.inputs(3)  # the logit's row: feature 1.0, error 0.5
    assert [(n.kind, w) for n, w in ins] == [("feature", 1.0), ("error", 0.5)]
    assert g.inputs(2) == []  # a token has no inputs
    with pytest.raises(Error, match="unknown node kind"):
        g.top(3, kinds=["head"])
    with pytest.raises(Error, match="inputs: node"):
        g.inputs(4)
    with pytest.raises(Error, match="top: k"):
        g.top(0)


def test_json_is_circuit_tracers_format(tiny_factory, tmp_path):
    m = _model(tiny_factory, model_type="dcpythia")
    g = attribution_graph(m, PROMPT, _transcoders(m), progress=False)
    p = g.to_json(tmp_path / "g.json", node_threshold=1.0, edge_threshold=1.0)
    with open(p) as f:
        doc = json.load(f)
    assert set(doc) == {"metadata", "qParams", "nodes", "links"}
    ids = {n["node_id"] for n in doc["nodes"]}
    kinds = {n["feature_type"] for n in doc["nodes"]}
    assert {"cross layer transcoder", "embedding", "logit", "dcmha compose input"} <= kinds
    assert all(lk["source"] in ids and lk["target"] in ids for lk in doc["links"])
    assert sum(n.get("is_target_logit", False) for n in doc["nodes"]) == 1
    with pytest.raises(Error, match="cannot write"):
        g.to_json(tmp_path / "missing" / "g.json")


def test_bad_input_is_an_error_naming_it(tiny_factory):
    m = _model(tiny_factory, model_type="dcpythia")
    tcs = _transcoders(m)
    with pytest.raises(Error, match="3 transcoders for a model of 2 layers"):
        attribution_graph(m, PROMPT, tcs[:1] + tcs)
    with pytest.raises(Error, match=r"transcoders\[1\] maps"):
        attribution_graph(m, PROMPT, [tcs[0], tcs[0]])
    with pytest.raises(Error, match="max_n_logits"):
        attribution_graph(m, PROMPT, tcs, max_n_logits=0)
    with pytest.raises(Error, match="desired_logit_prob"):
        attribution_graph(m, PROMPT, tcs, desired_logit_prob=0.0)
    with pytest.raises(Error, match="one prompt"):
        attribution_graph(m, np.stack([PROMPT, PROMPT]), tcs)
    p = _model(tiny_factory, model_type="gpt_neox")
    with pytest.raises(Error, match="no DCMHA compose"):
        attribution_graph(p, PROMPT, _transcoders(p), compose=True)
    sw = _model(tiny_factory, model_type="dcpythia", use_sw=True)
    with pytest.raises(Error, match="use_sw"):
        attribution_graph(sw, PROMPT, _transcoders(sw), compose=True)
    assert len(attribution_graph(sw, PROMPT, _transcoders(sw), progress=False).index["compose"]) == 0


# ---------------------------------------------------------------- lending nodes


def _rotary(x, T, rot_dim, base):
    """The spec's rotary (model-spec.md 2, step 3) on the first rot_dim dims of x [T, N, Dh]."""
    h = rot_dim // 2
    ang = np.arange(T)[:, None] * base ** (-2.0 * np.arange(h) / rot_dim)
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    out = x.copy()
    out[..., :h] = x[..., :h] * c - x[..., h:rot_dim] * s
    out[..., h:rot_dim] = x[..., :h] * s + x[..., h:rot_dim] * c
    return out


def test_lending_qk_is_the_engines_queries_and_keys(tiny_factory):
    from dclens.features.lending_nodes import QK

    m = _model(tiny_factory, model_type="dcpythia")
    rep = Replacement(m, PROMPT, _transcoders(m), compose=True)
    _, cache = m.run_with_cache(PROMPT, names=["blocks.1.attn.q", "blocks.1.attn.k", "blocks.1.attn.scores"])
    qk = QK(rep, 1)
    np.testing.assert_allclose(qk.q, cache["blocks.1.attn.q"], atol=2e-5)
    np.testing.assert_allclose(qk.k, cache["blocks.1.attn.k"], atol=2e-5)
    np.testing.assert_allclose(qk.scores, cache["blocks.1.attn.scores"], atol=2e-4)


def _lend_part(cache, l, m_, n_, key_side=True):
    """Head m's share of head n's pre-compose qp and kp at layer l [T, S], from the engine's hooks."""
    b = "blocks.%d.attn." % l
    A = np.asarray(cache[b + "scores"], np.float64)[m_]
    q = np.einsum("ti,ti->t", cache[b + "dyn.pre.qw1"][:, :, m_], cache[b + "dyn.pre.qw2"][:, :, n_])
    qp = A * q[:, None]
    kp = np.zeros_like(qp)
    if key_side:
        k = np.einsum("si,si->s", cache[b + "dyn.pre.kw1"][:, :, m_], cache[b + "dyn.pre.kw2"][:, :, n_])
        kp = A * k[None, :]
    return qp, kp


def _lend_run(er, l, hn, parts, eps):
    """The replacement run with layer l's compose live and head n's pre.qp / pre.kp plus eps
    times the given parts (head m's share): -> logits at the last position."""

    def add(part):
        def fn(a, name):
            a = np.asarray(a, np.float64).copy()
            a[hn] += eps * part
            return a.astype(np.float32)

        return fn

    hooks = [("blocks.%d.attn.pre.%s" % (l, b), add(p)) for b, p in zip(("qp", "kp"), parts)]
    return er.run(live_compose=l, extra_hooks=hooks)[0]


def test_lending_edges_into_the_logits_are_the_lending_derivative(tiny_factory):
    """Scaling head m's share of head n's pre-compose by (1 + eps), the rest of layer l's
    compose live and every other layer frozen, moves logit k by eps * V[k, m, n]."""
    m = _model(tiny_factory, model_type="dcpythia")
    tcs = _transcoders(m)
    g = attribution_graph(m, PROMPT, tcs, compose=True, progress=False)
    er = EngineReplacement(m, tcs)
    ws = ("qw1", "qw2", "kw1", "kw2")
    names = ["blocks.%d.attn.%s" % (l, w) for l in range(2) for w in ["scores"] + ["dyn.pre." + x for x in ws]]
    _, cache = m.run_with_cache(PROMPT, names=names)
    logit_rows = g.index["logit"]
    lend = [i for i in g.index["lend"]]
    assert len(lend) == 2 * 4 * 3
    for i in lend[::5]:
        node = g.nodes[i]
        l, (hm, hn) = node.layer, node.heads
        qp, kp = _lend_part(cache, l, hm, hn)

        eps = 1e-2
        lp, lm = (_lend_run(er, l, hn, (qp, kp), e) for e in (eps, -eps))
        slope = [
            (lp[n.index] - lp.mean() - lm[n.index] + lm.mean()) / (2 * eps) for n in (g.nodes[k] for k in logit_rows)
        ]
        want = g.adjacency[logit_rows, i]
        np.testing.assert_allclose(slope, want, rtol=2e-2, atol=2e-3 * max(np.abs(want).max(), 1e-6), err_msg=node.name)


def _frozen_qk_hooks(m, l, rho, seen):
    """Hooks that recompute layer l's q and k from the current ln_attn with QK-norm's scale
    frozen at rho (the spec's steps 1-3), and capture the scores."""
    c = m.config
    D, N, Dh = c.d_model, c.n_head, c.head_dim
    p = "layers.%d.attention." % l
    w = m.weight(p + "wqkv.weight").astype(np.float64)
    b = m.weight(p + "wqkv.bias").astype(np.float64)

    def keep(a, n):
        seen[n] = np.asarray(a, np.float64).copy()

    def side(j, scale_name):
        def fn(a, n):
            u = seen["blocks.%d.ln_attn" % l]
            raw = (u @ w[j * D : (j + 1) * D].T + b[j * D : (j + 1) * D]).reshape(len(u), N, Dh)
            x = raw / rho[j][..., None] * m.weight(p + scale_name).astype(np.float64)
            return _rotary(x, len(u), c.rotary_dim, c.rope_base).astype(np.float32)

        return fn

    b_ = "blocks.%d." % l
    return [
        (b_ + "ln_attn", keep),
        (b_ + "attn.q", side(0, "q_norm.scale")),
        (b_ + "attn.k", side(1, "k_norm.scale")),
        (b_ + "attn.scores", keep),
    ]


def test_lending_incoming_edges_are_finite_differences(tiny_factory):
    """A lending node's value is bilinear in head m's queries and keys: with QK-norm's scale
    frozen too, a central difference of each source is exactly its (first-order) edge."""
    from dclens.features import lending_nodes

    m = _model(tiny_factory, model_type="dcpythia")
    tcs = _transcoders(m)
    g = attribution_graph(m, PROMPT, tcs, compose=True, progress=False)
    rep = Replacement(m, PROMPT, tcs, compose=True)
    er = EngineReplacement(m, tcs)
    T, D, L = len(PROMPT), m.config.d_model, m.config.n_layer
    logit_rows = g.index["logit"]
    seeds = {
        ("resid", L): [
            (k, T - 1, rep.norm_T_at("final", T - 1, rep.W_U[g.nodes[r].index] - rep.W_U.mean(0)))
            for k, r in enumerate(logit_rows)
        ]
    }
    G_at = {lv: Gl.copy() for lv, Gl in rep.backward(len(logit_rows), seeds)}
    w = g.logit_probs / g.logit_probs.sum()
    l = 1
    _, gS = compose_nodes.compose_backward(rep, l, G_at[l + 1])
    Hw = np.einsum("k,knts->nts", w, gS)
    qk = lending_nodes.QK(rep, l)
    C = lending_nodes.lend_maps(m, l, rep.extra["blocks.%d.ln_attn" % l], True)
    rho = (qk.rho_q, qk.rho_k)
    lend = [i for i in g.index["lend"] if g.nodes[i].layer == l]
    coef = {i: Hw[g.nodes[i].heads[1]] * C[g.nodes[i].heads] for i in lend}

    def values(delta_kw):
        seen = {}
        er.run(extra_hooks=_frozen_qk_hooks(m, l, rho, seen), **delta_kw)
        A = seen["blocks.%d.attn.scores" % l]
        return np.array([(coef[i] * A[g.nodes[i].heads[0]]).sum() for i in lend])

    v0 = values({})
    np.testing.assert_allclose(v0, [g.nodes[i].value for i in lend], rtol=1e-4, atol=1e-7)
    sources = [j for j, n in enumerate(g.nodes) if n.kind in ("feature", "error", "token") and n.layer < l]
    scale = np.abs(g.adjacency[np.ix_(lend, sources)]).max()
    assert scale > 0
    for j in sources:
        n = g.nodes[j]
        vec = _source_vector(rep, n)
        eps = 0.5 / max(np.abs(vec).max(), 1e-9)
        d = np.zeros((T, D))
        d[n.pos] = eps * vec
        if n.kind == "token":
            plus, minus = values({"embed_delta": d}), values({"embed_delta": -d})
        else:
            plus, minus = values({"mlp_delta": {n.layer: d}}), values({"mlp_delta": {n.layer: -d}})
        fd = (plus - minus) * (n.value if n.kind == "feature" else 1.0) / (2 * eps)
        np.testing.assert_allclose(g.adjacency[lend, j], fd, atol=1e-3 * scale, err_msg=n.name)
