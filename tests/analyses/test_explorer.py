"""The explorer page without a browser: what it stores decodes to the engine's
activations within the stored precision, the size budget, misuse raises
dclens.Error, the CLI, and nothing in the page points outside it.
(tests/browser/test_explorer_browser.py drives the page itself in Chromium.)"""

import base64
import json
import re
import zlib

import numpy as np
import pytest

import dclens
from dclens import explorer, routing
from dclens._core.mask import allowed
from dclens._core.names import hook_name
from dclens.cli.commands import main as cli_main

BUDGET = 3 * 1000 * 1000
TEXT = "Ruth has a sweater. Steven has a taxi. Ruth does not have a kind of"


@pytest.fixture(scope="module")
def models():
    return dclens.load("dcpythia-tiny"), dclens.load("pythia-tiny")


@pytest.fixture(scope="module")
def line200(models):
    from synth_tasks import load_dataset
    from synth_tasks.corpus import HELDOUT_FILE

    model = models[0]
    line = next(l for l in load_dataset(HELDOUT_FILE) if len(model.to_tokens(l.text)) >= 200)
    return model.to_tokens(line.text)[:200]


def _script(html, id_):
    return json.loads(re.search(r'<script type="application/json" id="%s">(.*?)</script>' % id_, html, re.S).group(1))


def decode(html):
    """{layer: {name: 1-D float64 values}} and META, read as the page reads them."""
    meta, blobs = _script(html, "dcs-meta"), _script(html, "dcs-blobs")
    out = {}
    for l, b64 in blobs.items():
        buf = zlib.decompress(base64.b64decode(b64))
        arrs = {}
        for name, e in meta["manifest"][l].items():
            dt = {"u8": np.uint8, "i8": np.int8, "u16": "<u2", "i16": "<i2"}[e["kind"]]
            q = np.frombuffer(buf, dt, e["n"], e["data"]).astype(np.float64)
            sc = np.frombuffer(buf, "<f4", e["rows"], e["scale"]).astype(np.float64)
            arrs[name] = (q, sc, e["shape"])
        out[int(l)] = arrs
    return out, meta


def test_stored_values_decode_to_the_engine_within_half_a_step(models, line200):
    model, twin = models
    ex = dclens.explore(model, line200, twin=twin, progress=False)
    assert len(ex) <= BUDGET, "200-token page with the twin: %d bytes > %d" % (len(ex), BUDGET)
    data, meta = decode(ex.html)
    assert meta["layers"] == [0, 1, 2, 3] and meta["T"] == 200 and meta["twin"] == "pythia-tiny"
    _, cache = model.run_with_cache(line200)
    _, tcache = twin.run_with_cache(line200, names=lambda n: n.endswith("attn.pattern"))
    T, c = 200, model.config
    for l, arrs in data.items():
        vis = allowed(T, T, c.window_size if l in c.local_layers else 0)
        checks = {
            name: (cache[hook_name(l, "attn." + name)], vis)
            for name in ("scores", "pattern", "scores_composed", "pattern_composed")
        }
        checks["twin.pattern"] = (tcache[hook_name(l, "attn.pattern")], allowed(T, T, 0))
        for name, (want, v) in checks.items():
            q, sc, shape = arrs[name]
            assert shape == list(want.shape)
            rows = np.repeat(sc, np.tile(v.sum(1), want.shape[0]))  # scale of each stored cell
            got, exp = q * rows, want[:, v].reshape(-1).astype(np.float64)
            step = np.repeat(explorer.stored_step(want, v).reshape(-1), np.tile(v.sum(1), want.shape[0]))
            assert (np.abs(got - exp) <= step / 2 * (1 + 1e-5) + 1e-12).all(), (l, name)
            assert np.abs(exp).max() > 0
        for ph in dclens.PHASES:
            R = routing.routing_matrices(model, cache, ph, layers=[l])[0]
            q, sc, shape = arrs["routing." + ph]
            assert shape == [T, c.n_head, c.n_head]
            err = np.abs(q * np.repeat(sc, c.n_head) - R.reshape(-1))
            assert (err <= np.repeat(explorer.stored_step(R).reshape(-1), c.n_head) / 2 * (1 + 1e-5) + 1e-12).all()
            for k in ("qw1", "qw2", "kw1", "kw2", "qdd", "kdd"):
                want = cache[hook_name(l, "attn.dyn.%s.%s" % (ph, k))].astype(np.float64)
                q, sc, shape = arrs["dyn.%s.%s" % (ph, k)]
                K = want.shape[-1]
                err = np.abs(q * np.repeat(sc, K) - want.reshape(-1))
                assert (
                    arrs["dyn.%s.%s" % (ph, k)] and meta["manifest"][str(l)]["dyn.%s.%s" % (ph, k)]["kind"][1:] == "16"
                )
                step = explorer.stored_step(want, bits=16)
                assert (err <= np.repeat(step.reshape(-1), K) / 2 * (1 + 1e-5) + 1e-12).all()


def test_page_is_self_contained_and_escapes_text(models):
    model, _ = models
    ex = dclens.explore(model, "</script><script>alert(1)</script> <!-- x", progress=False)
    h = ex.html
    assert h.count("</script>") == 3 and h.count("<script") == 3  # meta, blobs, code: the text cannot close one
    assert not re.search(r"""(src|href)\s*=\s*["'](?!#)""", h)  # nothing loaded from anywhere
    assert not re.search(r"https?://", re.sub(r"http://www\.w3\.org/2000/svg", "", h))
    assert "default-src 'none'" in h  # the CSP forbids any request
    meta = _script(h, "dcs-meta")
    assert "".join(meta["tokens"]) == "</script><script>alert(1)</script> <!-- x"
    frame = ex._repr_html_()
    assert frame.startswith('<iframe srcdoc="') and "<script" not in frame  # escaped into the attribute


def test_layers_bound_what_is_embedded_and_attribution(models):
    model, _ = models
    ig = np.arange(24.0).reshape(4, 6)
    ex = dclens.explore(model, TEXT, layers=[3, -3], attribution=ig, progress=False)
    meta = _script(ex.html, "dcs-meta")
    assert ex.layers == meta["layers"] == [1, 3]
    assert sorted(_script(ex.html, "dcs-blobs")) == ["1", "3"]
    assert meta["ig"]["values"] == ig[[1, 3]].tolist()
    assert "Explorer dcpythia-tiny" in repr(ex)
    # an Attribution result from model.attribute, and a target tuple computing one
    toks = model.to_tokens(TEXT)
    r = model.attribute(toks, ("logprob", -1, int(toks[-1])), at=[hook_name(3, "attn.head_out")], steps=4)
    ex = dclens.explore(model, toks, layers=[3], attribution=r, progress=False)
    assert np.allclose(_script(ex.html, "dcs-meta")["ig"]["values"][0], r.per_head[hook_name(3, "attn.head_out")])


def test_plain_mha_model_builds(models):
    _, twin = models
    ex = dclens.explore(twin, TEXT, progress=False)
    meta = _script(ex.html, "dcs-meta")
    assert meta["dcmha"] is False and meta["flow_branches"] == ["skip"]
    assert set(meta["manifest"]["0"]) == {"scores", "pattern"}


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(layers=[4]), "layers entry 4 is out of range"),
        (dict(layers=[]), "layers= is empty"),
        (dict(attribution=np.zeros((4, 5))), "attribution= must be [n_layer, n_head]"),
        (dict(attribution=np.full((4, 6), np.nan)), "finite"),
    ],
)
def test_misuse_raises(models, kw, msg):
    model, _ = models
    with pytest.raises(dclens.Error, match=re.escape(msg)):
        dclens.explore(model, TEXT, progress=False, **kw)


def test_misuse_raises_more(models, tmp_path):
    model, twin = models
    with pytest.raises(dclens.Error, match="one sequence"):
        dclens.explore(model, np.zeros((2, 3), dtype=np.int32))
    r = model.attribute(model.to_tokens(TEXT), ("logprob", -1, 5), at=[hook_name(0, "attn.head_out")], steps=2)
    with pytest.raises(dclens.Error, match="blocks.1.attn.head_out"):
        dclens.explore(model, TEXT, layers=[0, 1], attribution=r, progress=False)
    ex = dclens.explore(model, TEXT, layers=[0], progress=False)
    with pytest.raises(dclens.Error, match="cannot write the explorer page"):
        ex.save(str(tmp_path / "no" / "such" / "dir" / "p.html"))
    with pytest.raises(dclens.Error, match="would embed about"):
        dclens.explore(model, np.zeros(4000, dtype=np.int32))


def test_cli(tmp_path, capsys):
    out = tmp_path / "page.html"
    assert (
        cli_main(
            [
                "explore",
                "--model",
                "dcpythia-tiny",
                "--twin",
                "pythia-tiny",
                "--text",
                TEXT,
                "--layers",
                "0,2-3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "wrote %s" % out in capsys.readouterr().out
    meta = _script(out.read_text(encoding="utf-8"), "dcs-meta")
    assert meta["layers"] == [0, 2, 3] and meta["twin"] == "pythia-tiny"
    assert cli_main(["explore", "--model", "dcpythia-tiny", "--text", "a", "--layers", "x", "--out", str(out)]) == 1
    assert "--layers must be" in capsys.readouterr().err


def test_a_large_page_warns(models, monkeypatch):
    model, _ = models
    monkeypatch.setattr(explorer, "_WARN_BYTES", 1000)
    with pytest.warns(UserWarning, match=r"layers=\[\.\.\.\] keeps the page smaller"):
        dclens.explore(model, TEXT, layers=[0], progress=False)


def _pattern_rows(html, layer, T, window=0):
    """The stored softmax pattern of a layer, decoded to [N, T, S] (0 at masked cells)."""
    data, meta = decode(html)
    q, sc, shape = data[layer]["pattern"]
    vis = allowed(T, T, window)
    out = np.zeros(shape)
    out[:, vis] = (q * np.repeat(sc, np.tile(vis.sum(1), shape[0]))).reshape(shape[0], -1)
    return out


def test_hooks_in_force_change_what_the_page_shows(models):
    """explore runs its passes with the hooks in force (with model.hooks(...), add_hook): a head whose
    pattern a hook zeroes shows zeros in the page's data, and its composed weights change."""
    model, twin = models
    toks = model.to_tokens(TEXT)
    T, name = len(toks), hook_name(1, "attn.pattern")

    def zero_head_2(a, hook):
        a[2] = 0.0
        return a

    plain = dclens.explore(model, toks, layers=[1], twin=twin, progress=False)
    with model.hooks([(name, zero_head_2)]):
        hooked = dclens.explore(model, toks, layers=[1], twin=twin, progress=False)
    before, after = _pattern_rows(plain.html, 1, T), _pattern_rows(hooked.html, 1, T)
    assert np.abs(before[2]).max() > 0.5 and np.abs(after[2]).max() == 0.0
    np.testing.assert_array_equal(before[0], after[0])  # other heads: as stored without the hook
    (p_data, _), (h_data, _) = decode(plain.html), decode(hooked.html)
    assert not np.array_equal(p_data[1]["pattern_composed"][0], h_data[1]["pattern_composed"][0])
    np.testing.assert_array_equal(p_data[1]["twin.pattern"][0], h_data[1]["twin.pattern"][0])  # the twin's own hooks
    model.add_hook(name, zero_head_2)
    try:
        assert np.abs(_pattern_rows(dclens.explore(model, toks, layers=[1], progress=False).html, 1, T)[2]).max() == 0
        # IG runs no Python hook: a target tuple refuses rather than ranking the un-hooked model
        with pytest.raises(dclens.Error, match=r"explore\(attribution=.*1 hook in force.*blocks\.1\.attn\.pattern"):
            dclens.explore(model, toks, layers=[1], attribution=("logprob", -1, 5), progress=False)
    finally:
        model.reset_hooks()


def test_the_page_opens_on_the_top_ig_head(models):
    model, _ = models
    toks = model.to_tokens(TEXT)
    ig = np.zeros((4, 6))
    ig[2, 3], ig[0, 1], ig[3, 5] = -4.0, 3.0, 1.0
    meta = _script(dclens.explore(model, toks, attribution=ig, progress=False).html, "dcs-meta")
    assert meta["ig"]["top"] == [2, 3] and meta["ig"]["query"] is None and meta["ig"]["note"] == ""
    meta = _script(dclens.explore(model, toks, layers=[3, 1], attribution=ig, progress=False).html, "dcs-meta")
    assert meta["ig"]["top"] == [3, 5]  # the largest |value| among the layers shown
    meta = _script(
        dclens.explore(model, toks, layers=[1], attribution=("logprob", -3, int(toks[-2])), progress=False).html,
        "dcs-meta",
    )
    vals = np.abs(meta["ig"]["values"][0])
    assert meta["ig"]["top"] == [1, int(np.argmax(vals))] and meta["ig"]["query"] == len(toks) - 3
    assert "zero baseline" in meta["ig"]["note"] and "activation patching" in meta["ig"]["note"]


def test_misuse_raises_argument_errors(models, tmp_path):
    model, _ = models
    for kw, cls, msg in [
        (dict(attribution="abc"), dclens.ArgumentError, "attribution="),
        (dict(twin=5), dclens.ArgumentTypeError, "twin="),
        (dict(progress="yes"), dclens.Error, "progress"),
    ]:
        with pytest.raises(cls, match=msg):
            dclens.explore(model, TEXT, layers=[0], **kw)
    with pytest.raises(dclens.ArgumentError, match="text must be"):
        dclens.explore(model, ["a", "b"], progress=False)
    with pytest.raises(dclens.ArgumentTypeError, match="save: path"):
        dclens.explore(model, TEXT, layers=[0], progress=False).save(None)


# ---------------------------------------------------------------- the circuit tab (issue 37)

CLEAN = "Ruth has a sweater. Steven has a taxi. Ruth has a"
CORRUPTED = "Ruth has a taxi. Steven has a sweater. Ruth has a"


def _circuit(model, top_n=40):
    from dclens import graph

    good, bad = model.to_single_token(" sweater"), model.to_single_token(" taxi")
    s = graph.attribute_edges(model, CLEAN, CORRUPTED, ("logit_diff", -1, good, bad), progress=False)
    return s, s.circuit(top_n=top_n)


def _map_entry(cache, d):
    """A composition edge's map entry C[m, n] from the dynamic weights, as model-spec.md writes
    it: over queries for qp / qg, over keys for kp / kg, 1 for skip."""
    m, n = d.src_head, d.head

    def dyn(w):
        return cache[hook_name(d.layer, "attn.dyn.%s.%s" % (d.phase, w))].astype(np.float64)

    if d.branch == "skip":
        return 1.0
    if d.branch in ("qg", "kg"):
        return dyn(d.branch[0] + "dd")[:, n]
    w = d.branch[0]  # q or k: [T, R, N] each
    return (dyn(w + "w1")[:, :, m] * dyn(w + "w2")[:, :, n]).sum(-1)


def test_circuit_tab_data_equal_the_engines_values(models):
    """The circuit's edges and scores as given; each composition edge's map entry and what it lends
    at every query equal routing.flows (the engine's pass); each head's own share its routing column."""
    from dclens import graph

    model, _ = models
    _, c = _circuit(model)
    toks = model.to_tokens(CLEAN)
    T, N = len(toks), model.config.n_head
    meta = _script(dclens.explore(model, CLEAN, circuit=c, progress=False).html, "dcs-meta")
    got = meta["circuit"]
    g = c.graph
    edges = {e["name"]: e for e in got["edges"]}
    assert set(edges) == set(c.edges) and got["n_edges"] == len(c.edges) == len(got["edges"])
    comp = [e for e in c.edges if g.detail[e].kind == "comp"]
    assert got["n_comp"] == len(comp) > 0, "the test circuit needs composition edges"
    assert {e: edges[e]["score"] for e in c.edges} == c.scores
    assert [abs(e["score"]) for e in got["edges"]] == sorted((abs(v) for v in c.scores.values()), reverse=True)
    want_nodes = {n for e in c.edges for n in (g.detail[e].sender, graph._node_of(g.detail[e]))}
    assert {n["id"] for n in got["nodes"]} == want_nodes
    assert {n["id"] for n in got["nodes"] if n["reaches"]} == set(c.nodes) & want_nodes
    _, cache = model.run_with_cache(toks)
    branches = routing.flow_branches(model)
    flows = {}
    for name in comp:
        d, e = g.detail[name], edges[name]
        assert (e["sender"], e["node"], e["part"]) == (
            d.sender,
            "L%d.H%d" % (d.layer, d.head),
            d.phase + "." + d.branch,
        )
        for t in range(T):
            key = (d.layer, d.phase, d.head, t)
            if key not in flows:
                flows[key] = routing.flows(model, toks, d.layer, d.phase, d.head, t, cache=cache)
            F = flows[key][d.src_head, branches.index(d.branch)]  # [S]: X[m, t, s] C[t, s][m, n]
            np.testing.assert_allclose(e["lent"][t], F.sum(), rtol=2e-5, atol=1e-5)
        assert e["axis"] == {"skip": "none", "qg": "query", "qp": "query", "kg": "key", "kp": "key"}[d.branch]
        np.testing.assert_allclose(e["coef"], _map_entry(cache, d), rtol=2e-5, atol=1e-6)
    for name in set(c.edges) - set(comp):
        assert "coef" not in edges[name] and edges[name]["kind"] == "resid"
    heads = [n for n in got["nodes"] if n["kind"] == "head"]
    assert heads
    for n in heads:
        R = np.stack([routing.routing_matrix(model, toks, n["layer"], "post", t) for t in range(T)])[:, :, n["head"]]
        own, others = R[:, n["head"]], np.abs(np.delete(R, n["head"], axis=1)).sum(-1)
        np.testing.assert_allclose(n["own"], own, rtol=2e-5, atol=1e-5)
        np.testing.assert_allclose(n["total"], R.sum(-1), rtol=2e-5, atol=1e-5)
        np.testing.assert_allclose(n["share"], np.abs(own) / (np.abs(own) + others), rtol=2e-5, atol=1e-6)
        assert 0 <= min(n["share"]) and max(n["share"]) <= 1 and N > 1


def test_circuit_of_a_plain_mha_model_and_of_some_layers(models):
    model, twin = models
    _, c = _circuit(twin, top_n=15)
    got = _script(dclens.explore(twin, CLEAN, circuit=c, progress=False).html, "dcs-meta")["circuit"]
    assert got["n_comp"] == 0 and got["dcmha"] is False and len(got["edges"]) == 15
    assert all(v == 1.0 for n in got["nodes"] if n["kind"] == "head" for v in n["share"])  # no composition
    # a page holding some layers still carries the whole circuit (its values from the same pass)
    _, c = _circuit(model)
    full = _script(dclens.explore(model, CLEAN, circuit=c, progress=False).html, "dcs-meta")["circuit"]
    some = _script(dclens.explore(model, CLEAN, layers=[3], circuit=c, progress=False).html, "dcs-meta")
    assert some["layers"] == [3] and some["circuit"] == full
    assert _script(dclens.explore(model, CLEAN, progress=False).html, "dcs-meta")["circuit"] is None
    empty = _circuit(model)[0].circuit(threshold=1e9)
    got = _script(dclens.explore(model, CLEAN, circuit=empty, progress=False).html, "dcs-meta")["circuit"]
    assert got["edges"] == [] and got["nodes"] == []


def test_circuit_misuse_names_the_argument(models):
    model, twin = models
    scores, c = _circuit(model)
    small = dclens.load("dcpythia-small")  # 6 layers, 8 heads: out of range for the tiny model
    _, big = _circuit(small, top_n=60)
    assert any(".H6" in n or ".H7" in n or n.startswith(("L4", "L5")) for n in big.nodes)
    _, mha = _circuit(twin)
    for kw, cls, msg in [
        (dict(circuit=scores), dclens.ArgumentTypeError, r"circuit= takes a dclens.graph.Circuit, not EdgeScores"),
        (dict(circuit=list(c.edges)), dclens.ArgumentTypeError, r"circuit= must be a dclens.graph.Circuit"),
        (dict(circuit=big), dclens.ArgumentError, r"circuit= edge .* out of range for dcpythia-tiny .*another model"),
        (dict(circuit=mha), dclens.ArgumentError, r"circuit= was found on the graph of another model"),
    ]:
        with pytest.raises(cls, match=msg):
            dclens.explore(model, CLEAN, progress=False, **kw)
    with pytest.raises(dclens.ArgumentError, match=r"circuit= was found on the graph of another model.*no edge"):
        dclens.explore(twin, CLEAN, circuit=c, progress=False)
