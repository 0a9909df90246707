"""The explorer page in a real headless Chromium (Debian's chromium + chromedriver,
installed by scripts/install-deps.sh; selenium from the [test] extra, pointed at
/usr/bin/chromedriver so it never downloads a driver).

One page is built for a held-out benchmark line of ~200 tokens on the bundled
DCPythia with its MHA twin; fragments, clicks and selects choose views, and
what #dcs-selected reports is compared with the engine's activations
(run_with_cache), routing.routing_matrix and routing.flows, within the stored
precision (explorer.stored_step; the branches and flows, which the page computes
from the stored phase input and dynamic weights, within the bound that
precision gives them). Also: no request leaves the page (DevTools performance
log), no console error, the screenshot is not blank, the size budget."""

import io
import json
import os
import shutil

import numpy as np
import pytest

import dclens
from dclens import explorer, routing
from dclens._core.mask import allowed
from dclens._core.names import hook_name

CHROMIUM, DRIVER = (
    shutil.which("chromium") or "/usr/bin/chromium",
    shutil.which("chromedriver") or "/usr/bin/chromedriver",
)
if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
    pytest.skip(
        "chromium / chromedriver not installed (scripts/install-deps.sh installs them)", allow_module_level=True
    )
# chromium is there, so selenium must be too (pip install -e .[test]): an ImportError is a failure
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

BUDGET = 3 * 1000 * 1000  # bytes: a 200-token prompt on the bundled twins, with the twin


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from synth_tasks import load_dataset
    from synth_tasks.corpus import HELDOUT_FILE

    model, twin = dclens.load("dcpythia-tiny"), dclens.load("pythia-tiny")
    line = next(l for l in load_dataset(HELDOUT_FILE) if len(model.to_tokens(l.text)) >= 200)
    toks = model.to_tokens(line.text)[:200]
    ig = np.arange(model.config.n_layer * model.config.n_head, dtype=float).reshape(model.config.n_layer, -1) - 7
    ex = dclens.explore(model, toks, twin=twin, attribution=ig, progress=False)
    path = str(tmp_path_factory.mktemp("explorer") / "page.html")
    ex.save(path)
    _, cache = model.run_with_cache(toks)
    _, tcache = twin.run_with_cache(toks, names=lambda n: n.endswith("attn.pattern"))
    return model, toks, ex, path, cache, tcache


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1400",
        "--no-first-run",
        "--disable-extensions",
    ):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    d.set_page_load_timeout(30)
    yield d
    d.quit()


def _open(d, path, frag, reload=False):
    """Go to the page at `frag`: a new page loads and reads the fragment; the same
    page with another fragment gets a hashchange (reload=True: loads it again)."""
    d.get("file://%s#%s" % (path, frag))
    if reload:
        d.refresh()
    want = dict(p.split("=", 1) for p in frag.split("&"))
    return _read(d, {k: v for k, v in want.items() if k in ("view", "layer", "head", "query", "phase", "key")})


def _read(d, expect=None):
    """Wait until the page has drawn (and shows what `expect` names), then read #dcs-selected."""
    js = (
        "var s = document.getElementById('dcs-selected'); if (document.body.dataset.error) return true;"
        "if (document.body.dataset.ready !== '1') return false; var e = arguments[0];"
        "for (var k in e) if (s.dataset[k] !== e[k]) return false; return true;"
    )
    WebDriverWait(d, 20).until(lambda d: d.execute_script(js, expect or {}))
    assert d.execute_script("return document.body.dataset.error || ''") == ""
    el = d.find_element(By.ID, "dcs-selected")
    state = {k: el.get_attribute("data-" + k) for k in ("view", "layer", "head", "query", "phase", "key")}
    return state, json.loads(el.get_attribute("data-values"))


def _row_check(got, want, step, visible):
    got = np.array([np.nan if v is None else v for v in got])
    assert got.shape == want.shape
    assert np.isnan(got[~visible]).all(), "masked keys must be null"
    err = np.abs(got[visible] - want[visible])
    assert (err <= step / 2 * (1 + 1e-5) + 1e-7).all(), "max error %g, step %g" % (err.max(), step)


def _vis(model, layer, T):
    c = model.config
    return allowed(T, T, c.window_size if layer in c.local_layers else 0)


def _flow_reference(model, cache, layer, phase, m, t):
    """Flows into head m at query t [N, B, T] from the cached phase input and dyn
    weights (model-spec.md 2 step 6, written here from the spec; query-wise,
    key-wise, grouped and static variants too), and the bound on the page's
    error given the stored precision of each factor."""
    c = model.config
    N, branches = c.n_head, routing.flow_branches(model)
    src = hook_name(layer, "attn.scores" if phase == "pre" else "attn.pattern")
    X = cache[src].astype(np.float64)
    T = X.shape[-1]
    vis = _vis(model, layer, T)
    x = np.where(vis[t], X[:, t], 0.0)  # [N, S]
    dx = explorer.stored_step(X, vis)[:, t][:, None] / 2  # [N, 1]
    dyn = {
        k: cache[hook_name(layer, "attn.dyn.%s.%s" % (phase, k))].astype(np.float64)
        for k in ("qw1", "qw2", "kw1", "kw2", "qdd", "kdd")
        if hook_name(layer, "attn.dyn.%s.%s" % (phase, k)) in cache
    }
    half = {k: explorer.stored_step(v, bits=16) / 2 for k, v in dyn.items()}  # [T, R] or [T]
    Mg = N // c.compose_groups
    block = (np.arange(N) // Mg == m // Mg).astype(float)  # [N]: heads that may lend to m

    def proj(w1, w2, pos):  # (w1[pos]^T w2[pos])[:, m] and its bound, [N] each
        a, bm = dyn[w1][pos], dyn[w2][pos][:, m][:, None]  # [R, N], [R, 1]
        da, db = half[w1][pos][:, None], half[w2][pos][:, None]  # [R, 1]: one step per row
        return (a * bm).sum(0) * block, (np.abs(a) * db + da * np.abs(bm) + da * db).sum(0) * block

    B = len(branches)
    coef, dcoef = np.zeros((N, B, T)), np.zeros((N, B, T))
    coef[m, 0] = 1.0
    if "qw1" in dyn:
        qc, dqc = proj("qw1", "qw2", t)
        coef[:, 1], dcoef[:, 1] = qc[:, None], dqc[:, None]
        coef[m, 3], dcoef[m, 3] = dyn["qdd"][t, m], half["qdd"][t]
    for s in range(T):
        if "kw1" in dyn:
            coef[:, 2, s], dcoef[:, 2, s] = proj("kw1", "kw2", s)
            coef[m, 4, s], dcoef[m, 4, s] = dyn["kdd"][s, m], half["kdd"][s]
    if "static" in branches:
        W = routing.static_map(model, layer, phase)  # [N, N]
        coef[:, 5] = W[:, m][:, None]
        dcoef[:, 5] = (explorer.stored_step(W, bits=16) / 2)[:, None]
    F = x[:, None, :] * coef
    bound = np.abs(x)[:, None, :] * dcoef + dx[:, :, None] * (np.abs(coef) + dcoef)
    return F, bound * (1 + 1e-5) + 1e-7, vis[t]


def test_size_budget_and_contents(built):
    model, toks, ex, path, _, _ = built
    assert len(toks) == 200
    assert len(ex) <= BUDGET, "page is %d bytes, budget %d" % (len(ex), BUDGET)
    assert os.path.getsize(path) == len(ex)
    assert ex.layers == [0, 1, 2, 3]
    assert (
        "<script src" not in ex.html
        and "<link" not in ex.html
        and "http://" not in ex.html.replace("http://www.w3.org/2000/svg", "")
    )


@pytest.mark.parametrize(
    "layer,head,query,view",
    [
        (1, 2, 150, "pattern"),
        (1, 2, 150, "pattern_composed"),
        (0, 5, 199, "pattern_composed"),
        (3, 0, 60, "pattern"),
        (2, 4, 120, "scores_composed"),
        (3, 1, 199, "twin"),
    ],
)
def test_rows_match_the_engine(built, browser, layer, head, query, view):
    model, toks, ex, path, cache, tcache = built
    state, got = _open(browser, path, "layer=%d&head=%d&query=%d&view=%s" % (layer, head, query, view))
    assert state["view"] == view and (state["layer"], state["head"], state["query"]) == (
        str(layer),
        str(head),
        str(query),
    )
    src = tcache if view == "twin" else cache
    name = hook_name(layer, "attn.pattern" if view == "twin" else "attn." + view)
    vis = _vis(dclens.load("pythia-tiny") if view == "twin" else model, layer, len(toks))
    want = src[name].astype(np.float64)
    _row_check(got, want[head, query], explorer.stored_step(want, vis)[head, query], vis[query])


@pytest.mark.parametrize(
    "phase,branch,layer,head,query",
    [
        ("post", "skip", 1, 2, 150),
        ("post", "qp", 1, 2, 150),
        ("post", "kp", 3, 4, 199),
        ("post", "qg", 0, 1, 100),
        ("post", "kg", 2, 3, 180),
        ("pre", "kp", 1, 0, 150),
        ("pre", "qg", 3, 5, 77),
    ],
)
def test_branches_match_the_engine(built, browser, phase, branch, layer, head, query):
    model, toks, ex, path, cache, _ = built
    frag = "layer=%d&head=%d&query=%d&view=branch:%s" % (layer, head, query, branch)
    state, got = _open(browser, path, frag + ("&phase=pre" if phase == "pre" else ""))
    assert state["phase"] == phase
    want = cache[hook_name(layer, "attn.%s.%s" % (phase, branch))][head, query].astype(np.float64)
    _, bound, vis = _flow_reference(model, cache, layer, phase, head, query)
    got = np.array([np.nan if v is None else v for v in got])
    assert np.isnan(got[~vis]).all()
    b = dclens.BRANCHES.index(branch)
    err = np.abs(got[vis] - want[vis])
    tol = bound[:, b].sum(0)[vis] + 2e-6 * np.abs(want[vis]).max()  # float32 hooks vs float64 sums
    assert (err <= tol).all(), "max error %g over tolerance" % (err - tol).max()
    assert np.abs(want[vis]).max() > 0


@pytest.mark.parametrize(
    "phase,layer,head,query,key",
    [
        ("post", 1, 2, 150, 69),
        ("post", 3, 0, 199, 3),
        ("pre", 0, 4, 90, 70),
        ("pre", 2, 1, 40, 12),
    ],
)
def test_flows_match_routing_flows(built, browser, phase, layer, head, query, key):
    model, toks, ex, path, cache, _ = built
    state, got = _open(
        browser, path, "layer=%d&head=%d&query=%d&key=%d&view=flows&phase=%s" % (layer, head, query, key, phase)
    )
    assert state["key"] == str(key)
    want = routing.flows(model, toks, layer, phase, head, query, cache=cache)[:, :, key]  # [N, B]
    ref, bound, _ = _flow_reference(model, cache, layer, phase, head, query)
    np.testing.assert_allclose(ref[:, :, key], want, rtol=1e-9, atol=1e-12)  # the reference agrees
    got = np.array(got, dtype=float)
    assert got.shape == want.shape
    assert (np.abs(got - want) <= bound[:, :, key]).all()
    assert bound[:, :, key].max() <= 0.02 * np.abs(ref).max()  # the tolerance is no blanket
    # and the flows sum to the composed entry
    total = cache[hook_name(layer, "attn.%s" % ("scores_composed" if phase == "pre" else "pattern_composed"))]
    assert abs(want.sum() - total[head, query, key]) < 1e-4 * max(1.0, abs(total[head, query, key]))


@pytest.mark.parametrize("phase,layer,query", [("post", 1, 150), ("pre", 3, 199), ("post", 0, 45)])
def test_routing_matches_routing_matrix(built, browser, phase, layer, query):
    model, toks, ex, path, cache, _ = built
    _, got = _open(
        browser, path, "layer=%d&head=0&query=%d&view=routing&phase=%s" % (layer, query, phase), reload=True
    )  # the fragment read on load
    want = routing.routing_matrix(model, toks, layer, phase, query)
    got = np.array(got, dtype=float)
    step = explorer.stored_step(routing.routing_matrices(model, cache, phase, layers=[layer])[0])[query]  # [N]
    assert got.shape == want.shape
    assert (np.abs(got - want) <= step[:, None] / 2 * (1 + 1e-5) + 1e-9).all()


def test_clicks_and_selects(built, browser):
    model, toks, ex, path, cache, _ = built
    _open(browser, path, "layer=1&head=2&query=150&view=pattern_composed")
    # click a token: it becomes the query
    browser.find_element(By.CSS_SELECTOR, '#dcs-tokens .tok[data-pos="97"]').click()
    state, got = _read(browser)
    assert state["query"] == "97" and state["view"] == "pattern_composed"
    want = cache[hook_name(1, "attn.pattern_composed")].astype(np.float64)
    vis = _vis(model, 1, len(toks))
    _row_check(got, want[2, 97], explorer.stored_step(want, vis)[2, 97], vis[97])
    assert "query=97" in browser.execute_script("return location.hash")
    # change the layer (a local one: its window is masked), the head and the view
    Select(browser.find_element(By.ID, "dcs-layer")).select_by_value("2")
    browser.find_element(By.CSS_SELECTOR, '#dcs-heads button[data-head="5"]').click()
    Select(browser.find_element(By.ID, "dcs-view")).select_by_value("pattern")
    state, got = _read(browser)
    assert (state["layer"], state["head"], state["query"], state["view"]) == ("2", "5", "97", "pattern")
    want = cache[hook_name(2, "attn.pattern")].astype(np.float64)
    vis = _vis(model, 2, len(toks))
    assert not vis[97].all() and (vis[97].sum() == model.config.window_size + 1)
    _row_check(got, want[5, 97], explorer.stored_step(want, vis)[5, 97], vis[97])
    # routing view for the same query
    Select(browser.find_element(By.ID, "dcs-view")).select_by_value("routing")
    state, got = _read(browser)
    assert state["view"] == "routing" and np.array(got).shape == (6, 6)
    # masked tokens are drawn hatched in the strip
    cls = browser.find_element(By.CSS_SELECTOR, '#dcs-tokens .tok[data-pos="10"]').get_attribute("class")
    assert "masked" in cls
    # hovering a token previews it as the query; leaving it goes back to the clicked one
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).move_to_element(
        browser.find_element(By.CSS_SELECTOR, '#dcs-tokens .tok[data-pos="120"]')
    ).perform()
    state, got = _read(browser, {"query": "120"})
    assert state["view"] == "routing" and "query=97" in browser.execute_script("return location.hash")
    ActionChains(browser).move_to_element(browser.find_element(By.ID, "dcs-selected-title")).perform()
    assert _read(browser, {"query": "97"})[0]["query"] == "97"
    # the arrow keys move the query
    browser.find_element(By.TAG_NAME, "body").send_keys("\ue012")  # ArrowLeft
    assert _read(browser, {"query": "96"})[0]["query"] == "96"


def test_no_request_leaves_the_page_and_no_console_error(built, browser):
    model, toks, ex, path, cache, _ = built
    browser.get_log("performance")  # drop what earlier tests logged
    browser.get_log("browser")
    _open(browser, path, "layer=3&head=1&query=100&view=flows", reload=True)  # a full load, logged
    Select(browser.find_element(By.ID, "dcs-layer")).select_by_value("0")
    _read(browser)
    urls = []
    for entry in browser.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] in ("Network.requestWillBeSent", "Network.webSocketCreated"):
            urls.append(msg["params"].get("request", {}).get("url") or msg["params"].get("url"))
    assert urls, "the performance log saw no request at all (not even the page)"
    assert all(u.split("#")[0] == "file://" + path for u in urls), urls
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_screenshot_is_not_blank(built, browser):
    from PIL import Image

    model, toks, ex, path, cache, _ = built
    _open(browser, path, "layer=1&head=2&query=150&view=branch:kp")
    img = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
    a = np.asarray(img)
    assert a.shape[0] > 500 and a.shape[1] > 800
    assert len(np.unique(a.reshape(-1, 3), axis=0)) > 200  # heatmaps, text, tables
    assert (a < 250).any(axis=-1).mean() > 0.1  # not a white page


def test_notebook_view_runs_in_its_iframe(built, browser, tmp_path):
    """_repr_html_ (Jupyter, VS Code) is an iframe whose srcdoc is the page: it draws there too."""
    model, toks, ex, path, cache, _ = built
    small = dclens.explore(model, toks[:40], layers=[1], progress=False)
    host = tmp_path / "notebook.html"
    host.write_text(
        "<!DOCTYPE html><html><body><p>cell output</p>%s</body></html>" % small._repr_html_(), encoding="utf-8"
    )
    browser.get("file://%s" % host)
    browser.switch_to.frame(browser.find_element(By.TAG_NAME, "iframe"))
    try:
        state, got = _read(browser)
        assert (state["layer"], state["query"], state["view"]) == ("1", "39", "pattern_composed")
        _, c40 = model.run_with_cache(toks[:40], names=[hook_name(1, "attn.pattern_composed")])
        want = c40[hook_name(1, "attn.pattern_composed")].astype(np.float64)
        vis = _vis(model, 1, 40)
        _row_check(got, want[0, 39], explorer.stored_step(want, vis)[0, 39], vis[39])
    finally:
        browser.switch_to.default_content()


from test_flows import VARIANTS  # noqa: E402  (the variants routing.flows is tested on)


@pytest.mark.filterwarnings("ignore::dclens.LoadWarning")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_flows_and_branches_of_variants(tiny_factory, browser, tmp_path, name):
    """The page's flows and branches on generated models with query-wise, key-wise,
    static and grouped composition, against routing.flows and the branch hooks."""
    d, _, _ = tiny_factory(model_type="dcpythia", n_layer=2, window_size=5, **VARIANTS[name])
    model = dclens.load(d)
    toks = np.arange(11) % 50 + 3
    path = str(tmp_path / "page.html")
    dclens.explore(model, toks, progress=False).save(path)
    _, cache = model.run_with_cache(toks)
    branches = routing.flow_branches(model)
    for layer, phase, head, t, key in ((0, "pre", 1, 9, 6), (1, "post", model.config.n_head - 1, 10, 3)):
        frag = "layer=%d&head=%d&query=%d&phase=%s&key=%d" % (layer, head, t, phase, key)
        _, got = _open(browser, path, frag + "&view=flows")
        want = routing.flows(model, toks, layer, phase, head, t, cache=cache)
        ref, bound, vis = _flow_reference(model, cache, layer, phase, head, t)
        np.testing.assert_allclose(ref, want, rtol=1e-9, atol=1e-12)
        got = np.array(got, dtype=float)
        assert got.shape == (model.config.n_head, len(branches))
        assert (np.abs(got - want[:, :, key]) <= bound[:, :, key]).all(), name
        for b in ("qp", "kp", "static"):
            if b not in branches:
                continue
            _, row = _open(browser, path, frag + "&view=branch:" + b)
            row = np.array([np.nan if v is None else v for v in row])
            hook = hook_name(layer, "attn.%s.%s" % (phase, b))
            want_row = cache[hook][head, t].astype(np.float64) if hook in cache else want[:, branches.index(b)].sum(0)
            tol = bound[:, branches.index(b)].sum(0) + 2e-6 * max(np.abs(want_row[vis]).max(), 1e-6)
            assert np.isnan(row[~vis]).all() and (np.abs(row[vis] - want_row[vis]) <= tol[vis]).all(), (name, b)


def test_a_page_with_some_layers_says_so(built, browser, tmp_path):
    model, toks, ex, path, cache, _ = built
    small = str(tmp_path / "some.html")
    dclens.explore(model, toks[:30], layers=[1, 3], progress=False).save(small)
    browser.get("file://%s#layer=0&head=1&query=20&view=pattern" % small)  # layer 0 is not in it
    state, _ = _read(browser, {"query": "20"})
    assert (state["layer"], state["head"], state["view"]) == ("1", "1", "pattern")
    assert "layers 1, 3 of 4" in browser.find_element(By.ID, "dcs-holds").text
    assert "layer (not in this page)" in browser.find_element(By.ID, "dcs-status").text


# ---------------------------------------------------------------- issue 41: what the page opens on, and how it reads


def _js_ready(d):
    WebDriverWait(d, 20).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
    assert d.execute_script("return document.body.dataset.error || ''") == ""


def test_opens_on_the_top_ig_head(built, browser, tmp_path):
    """With attribution= the page opens (no fragment) on the head of largest |IG| and, for a
    target tuple, at the target's position; the IG panel says IG uses a zero baseline."""
    model, toks, ex, path, cache, _ = built
    ig = np.zeros((4, 6))
    ig[3, 4], ig[1, 0] = -5.0, 3.0  # the top |value| is negative, and not on layer 0 or head 0
    arr = str(tmp_path / "ig.html")
    dclens.explore(model, toks[:30], layers=[1, 3], attribution=ig, progress=False).save(arr)
    browser.get("file://%s" % arr)
    state, _ = _read(browser)
    assert (state["layer"], state["head"], state["query"]) == ("3", "4", "29")
    on = browser.find_elements(By.CSS_SELECTOR, "#dcs-ig .igrow.on")
    assert len(on) == 1 and on[0].text.startswith("L3 H4")
    target = str(tmp_path / "target.html")
    dclens.explore(model, toks[:30], layers=[1, 2], attribution=("logprob", 20, int(toks[21])), progress=False).save(
        target
    )
    browser.get("file://%s" % target)
    state, _ = _read(browser)
    vals = np.array(
        json.loads(browser.execute_script("return document.getElementById('dcs-meta').textContent"))["ig"]["values"]
    )
    l, h = np.unravel_index(np.argmax(np.abs(vals)), vals.shape)
    assert (state["layer"], state["head"], state["query"]) == (str([1, 2][l]), str(h), "20")
    assert "zero baseline" in browser.find_element(By.ID, "dcs-ig").text
    assert "activation patching" in browser.find_element(By.ID, "dcs-ig").text


def test_bar_view_has_a_value_axis(built, browser):
    model, toks, ex, path, cache, _ = built
    for frag in ("layer=1&head=2&query=150&view=pattern_composed", "layer=3&head=0&query=60&view=pattern"):
        _, got = _open(browser, path, frag)
        vals = np.array([v for v in got if v is not None])
        lo, hi = min(0.0, vals.min()), max(0.0, vals.max())
        axis = browser.find_element(By.CSS_SELECTOR, "#dcs-selected .axis")
        ticks = json.loads(axis.get_attribute("data-ticks"))
        assert len(ticks) >= 3 and 0 in ticks and ticks == sorted(ticks)
        assert all(lo - 1e-9 <= t <= hi + 1e-9 for t in ticks)
        assert max(ticks) >= 0.5 * hi and (lo == 0 or min(ticks) <= 0.5 * lo)
        labels = [float(s.text) for s in axis.find_elements(By.TAG_NAME, "span")]
        assert labels == ticks  # written on the page, not only in the data


_PIXEL = "var c = arguments[0], x = arguments[1]; return Array.from(c.getContext('2d').getImageData(x, 7, 1, 1).data.slice(0, 3));"


def _strip(browser, label):
    rows = browser.find_elements(By.CSS_SELECTOR, "#dcs-branches .strip-row")
    return next(r for r in rows if r.find_element(By.CLASS_NAME, "lab").text == label).find_element(
        By.TAG_NAME, "canvas"
    )


def test_one_colour_rule_for_signed_quantities(built, browser):
    """qp, kp, qg, kg (and pre-softmax values) on the diverging map centred at 0, whatever the signs of
    the row; sequential only for the softmax patterns and the post-compose skip branch."""
    model, toks, ex, path, cache, _ = built
    meta = json.loads(browser.execute_script("return document.getElementById('dcs-meta').textContent") or "{}") or None
    seen_one_signed = False
    for layer, head, query in ((1, 2, 150), (0, 1, 100), (3, 5, 77), (2, 3, 180)):
        _, got = _open(browser, path, "layer=%d&head=%d&query=%d&view=branch:qg" % (layer, head, query))
        meta = json.loads(browser.execute_script("return document.getElementById('dcs-meta').textContent"))
        row = np.array([np.nan if v is None else v for v in got])
        seen_one_signed |= bool(np.nanmin(row) >= 0)  # a qg row of one sign (the gate qdd[t, m] > 0)
        for b in ("qp", "kp", "qg", "kg", "sum"):
            assert _strip(browser, b).get_attribute("data-cmap") == "div", b
        assert _strip(browser, "skip").get_attribute("data-cmap") == "seq"
        assert _strip(browser, "pattern").get_attribute("data-cmap") == "seq"
        c = _strip(browser, "qg")
        cell = int(c.get_attribute("width")) // len(toks)
        s = int(np.nanargmax(np.abs(row)))
        want = meta["cmap"]["div"][3 * 255 : 3 * 256] if row[s] > 0 else meta["cmap"]["div"][0:3]
        assert browser.execute_script(_PIXEL, c, s * cell + cell // 2) == want
        assert browser.find_element(By.CSS_SELECTOR, "#dcs-selected canvas").get_attribute("data-cmap") == "div"
        heads = browser.find_elements(By.CSS_SELECTOR, "#dcs-heads-panel .strip-row")
        kinds = {
            r.find_element(By.CLASS_NAME, "lab").text.split()[1]: r.find_element(By.TAG_NAME, "canvas").get_attribute(
                "data-cmap"
            )
            for r in heads
        }
        assert kinds == {"pat": "seq", "comp": "div", "twin": "seq"}
    assert seen_one_signed, "no qg row of one sign: the test would not see the old rule"
    _open(browser, path, "layer=1&head=2&query=150&view=branch:skip&phase=pre")
    assert _strip(browser, "skip").get_attribute("data-cmap") == "div"  # pre: the skip branch is the scores
    assert _strip(browser, "scores").get_attribute("data-cmap") == "div"


def test_tables_fit_or_scroll_under_themselves(browser, tmp_path):
    """8 heads (dcpythia-small): the routing, flows and dynamic-weight tables fit in a 1400-px window
    and no panel is clipped; a table that cannot fit scrolls in its own box."""
    model = dclens.load("dcpythia-small")
    p = str(tmp_path / "small.html")
    dclens.explore(
        model, model.to_tokens("Ruth has a sweater. Steven has a taxi. Ruth does not have"), layers=[1], progress=False
    ).save(p)
    browser.get("file://%s" % p)
    _js_ready(browser)
    boxes = browser.execute_script(
        "return [...document.querySelectorAll('table.mat')].map(t => { const w = t.parentElement, p = t.closest('.dcs-panel');"
        " return [t.className, getComputedStyle(w).overflowX, w.scrollWidth, w.clientWidth, p.scrollWidth, p.clientWidth,"
        " w.getBoundingClientRect().right, p.getBoundingClientRect().right]; })"
    )
    assert {b[0] for b in boxes} == {"mat routing", "mat flows", "mat dyn"}
    for cls, ov, sw, cw, psw, pcw, right, pright in boxes:
        assert ov == "auto", cls
        assert sw <= cw + 1, "%s: %d px in a %d-px box" % (cls, sw, cw)  # fits
        assert psw <= pcw + 1 and right <= pright + 1, cls  # its panel is not clipped


def test_ig_panel_fits_a_1400x1800_view(built, browser):
    model, toks, ex, path, cache, _ = built
    browser.set_window_size(1400, 1800)
    try:
        _open(browser, path, "layer=1&head=2&query=150&view=pattern_composed", reload=True)
        r = browser.execute_script(
            "const r = document.getElementById('dcs-ig-section').getBoundingClientRect();"
            "return [r.top, r.bottom, r.right, window.innerHeight, window.innerWidth]"
        )
        assert r[0] >= 0 and r[1] <= r[3] and r[2] <= r[4], r
        assert len(browser.find_elements(By.CSS_SELECTOR, "#dcs-ig .igrow")) == 12
    finally:
        browser.set_window_size(1400, 1400)


def test_flows_shown_once_and_the_stored_value_labelled_rounded(built, browser):
    model, toks, ex, path, cache, _ = built
    layer, head, query, key = 1, 2, 150, 69
    _open(browser, path, "layer=%d&head=%d&query=%d&key=%d&view=flows" % (layer, head, query, key))
    count = (
        "return [document.querySelectorAll('table.%s').length, document.getElementById('dcs-%s').parentElement.hidden]"
    )
    assert browser.execute_script(count % ("flows", "flows")) == [1, True]
    note = browser.find_element(By.CSS_SELECTOR, "#dcs-selected .note").text
    assert "pattern_composed as stored, rounded to 8 bits" in note and "stored pattern_composed" not in note
    want = cache[hook_name(layer, "attn.pattern_composed")].astype(np.float64)
    step = explorer.stored_step(want, _vis(model, layer, len(toks)))[head, query]
    shown = float(browser.find_element(By.CSS_SELECTOR, "#dcs-selected .rounded").text)
    assert abs(shown - want[head, query, key]) <= step / 2 + 5e-4  # the 8-bit value, printed to 3 decimals
    _open(browser, path, "layer=%d&head=%d&query=%d&key=%d&view=pattern" % (layer, head, query, key))
    assert browser.execute_script(count % ("flows", "flows")) == [1, False]  # in its panel
    _open(browser, path, "layer=%d&head=%d&query=%d&view=routing" % (layer, head, query))
    assert browser.execute_script(count % ("routing", "routing")) == [1, True]


# ---------------------------------------------------------------- issue 37: the circuit tab


@pytest.fixture(scope="module")
def circuit_page(tmp_path_factory):
    from dclens import graph

    model = dclens.load("dcpythia-tiny")
    clean, corrupted = (
        "Ruth has a sweater. Steven has a taxi. Ruth has a",
        "Ruth has a taxi. Steven has a sweater. Ruth has a",
    )
    good, bad = model.to_single_token(" sweater"), model.to_single_token(" taxi")
    c = graph.attribute_edges(model, clean, corrupted, ("logit_diff", -1, good, bad), progress=False).circuit(top_n=40)
    path = str(tmp_path_factory.mktemp("circuit") / "circuit.html")
    dclens.explore(model, clean, circuit=c, progress=False).save(path)
    return model, model.to_tokens(clean), c, path


def _circuit_values(d):
    return json.loads(d.find_element(By.ID, "dcs-circuit").get_attribute("data-values"))


def test_circuit_tab_draws_the_circuit_and_selects_heads(circuit_page, browser):
    from dclens import graph

    model, toks, c, path = circuit_page
    T, g = len(toks), c.graph
    browser.get_log("performance")  # drop what earlier tests logged
    browser.get_log("browser")
    browser.get("file://%s" % path)  # no fragment: a page with a circuit opens on its tab
    state, _ = _read(browser)
    assert browser.execute_script("return document.body.classList.contains('tab-circuit')")
    assert "tab=circuit" in browser.execute_script("return location.hash")
    assert browser.find_element(By.ID, "dcs-circuit-section").is_displayed()
    assert not browser.find_element(By.ID, "dcs-heads-panel").is_displayed()  # the maps' panels: the other tab
    nodes = {n for e in c.edges for n in (g.detail[e].sender, graph._node_of(g.detail[e]))}
    svg = browser.find_element(By.ID, "dcs-circuit-svg")
    drawn = [e.get_attribute("data-node") for e in svg.find_elements(By.CSS_SELECTOR, "g.cnode")]
    assert sorted(drawn) == sorted(nodes)
    paths = svg.find_elements(By.CSS_SELECTOR, "path.cedge")
    assert sorted(p.get_attribute("data-edge") for p in paths) == sorted(c.edges)
    n_comp = sum(1 for e in c.edges if g.detail[e].kind == "comp")
    assert len(svg.find_elements(By.CSS_SELECTOR, "path.cedge.comp")) == n_comp > 0
    assert len(browser.find_elements(By.CSS_SELECTOR, "#dcs-circuit tr[data-edge]")) == len(c.edges)
    # the page's values at its query: what each composition edge lends there, as routing.flows gives it
    t = int(state["query"])
    vals = _circuit_values(browser)
    assert vals["query"] == t and set(vals["edges"]) == set(c.edges)
    _, cache = model.run_with_cache(toks)
    for name in c.edges:
        d = g.detail[name]
        if d.kind != "comp":
            assert vals["edges"][name] == {"coef": None, "lent": None}
            continue
        F = routing.flows(model, toks, d.layer, d.phase, d.head, t, cache=cache)
        want = F[d.src_head, routing.flow_branches(model).index(d.branch)].sum()
        assert abs(vals["edges"][name]["lent"] - want) <= 2e-5 * max(1.0, abs(want)), name
    # the circuit's heads are marked among the head buttons of the layer shown
    layer = int(state["layer"])
    marked = {
        int(b.get_attribute("data-head")) for b in browser.find_elements(By.CSS_SELECTOR, "#dcs-heads button.circ")
    }
    assert marked == {int(n.split(".H")[1]) for n in nodes if n.startswith("L%d.H" % layer)}
    # clicking a head node selects it in the rest of the page
    other = next(
        e
        for e in svg.find_elements(By.CSS_SELECTOR, "g.cnode")
        if e.get_attribute("data-head") not in ("-1", state["head"]) and e.get_attribute("data-layer") == str(layer)
    )
    want_head = other.get_attribute("data-head")
    other.click()
    state2, row = _read(browser, {"head": want_head})
    assert (state2["layer"], state2["head"]) == (str(layer), want_head)
    assert "head=%s" % want_head in browser.execute_script("return location.hash")
    on = browser.find_elements(By.CSS_SELECTOR, "#dcs-circuit-svg g.cnode.on")
    assert [e.get_attribute("data-node") for e in on] == ["L%d.H%s" % (layer, want_head)]
    # the selected view shows that head's row: the engine's composed weights, as stored
    want = cache[hook_name(layer, "attn.pattern_composed")].astype(np.float64)
    vis = _vis(model, layer, T)
    _row_check(row, want[int(want_head), t], explorer.stored_step(want, vis)[int(want_head), t], vis[t])
    # clicking a composition edge's row selects its receiving head and the branch it goes through
    name = next(e for e in sorted(c.edges) if g.detail[e].kind == "comp" and g.detail[e].head != int(want_head))
    d = g.detail[name]
    browser.find_element(By.CSS_SELECTOR, '#dcs-circuit tr[data-edge="%s"]' % name).click()
    state3, _ = _read(browser, {"head": str(d.head), "view": "branch:" + d.branch})
    assert (state3["layer"], state3["phase"]) == (str(d.layer), d.phase)
    # another query: the values follow it
    browser.find_element(By.CSS_SELECTOR, '#dcs-tokens .tok[data-pos="5"]').click()
    _read(browser, {"query": "5"})
    assert _circuit_values(browser)["query"] == 5
    # the other tab, and back through the fragment
    browser.find_element(By.ID, "dcs-tab-maps").click()
    _read(browser)
    assert not browser.execute_script("return document.body.classList.contains('tab-circuit')")
    assert browser.find_element(By.ID, "dcs-heads-panel").is_displayed()
    assert "tab=maps" in browser.execute_script("return location.hash")
    rows = browser.find_elements(By.CSS_SELECTOR, "#dcs-heads-panel .strip-row.circ")
    assert rows and all(
        r.find_element(By.CLASS_NAME, "lab").text.split()[0] in ("H%d" % h for h in marked) for r in rows
    )
    browser.find_element(By.ID, "dcs-tab-circuit").click()
    _read(browser)
    assert browser.find_element(By.ID, "dcs-circuit-svg").is_displayed()
    assert not browser.find_element(By.ID, "dcs-heads-panel").is_displayed()
    _open(browser, path, "layer=%d&head=0&query=7&view=pattern&tab=maps" % layer)
    assert not browser.execute_script("return document.body.classList.contains('tab-circuit')")
    _open(browser, path, "layer=%d&head=0&query=7&view=pattern&tab=circuit" % layer)
    assert browser.execute_script("return document.body.classList.contains('tab-circuit')")
    assert _circuit_values(browser)["query"] == 7
    # nothing left the page, and no console error
    urls = []
    for entry in browser.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] in ("Network.requestWillBeSent", "Network.webSocketCreated"):
            urls.append(msg["params"].get("request", {}).get("url") or msg["params"].get("url"))
    assert urls and all(u.split("#")[0] == "file://" + path for u in urls), urls
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_circuit_tab_fits_a_1400x1800_view(circuit_page, browser):
    """The graph, the heads' table and the edges' table in a 1400 x 1800 window: nothing clipped
    on the right, the graph and its side table inside the window's height."""
    model, toks, c, path = circuit_page
    browser.set_window_size(1400, 1800)
    try:
        browser.get("file://%s#tab=circuit" % path)
        browser.refresh()
        _read(browser)
        r = browser.execute_script(
            "const w = window.innerWidth, h = window.innerHeight, box = (id) => document.getElementById(id).getBoundingClientRect();"
            "const p = document.getElementById('dcs-circuit-section');"
            "return [box('dcs-circuit-svg').right, box('dcs-circuit-svg').bottom, document.querySelector('.circ-side').getBoundingClientRect().right,"
            " document.querySelector('.circ-edges').getBoundingClientRect().bottom, p.scrollWidth, p.clientWidth, w, h]"
        )
        svg_right, svg_bottom, side_right, table_bottom, sw, cw, w, h = r
        assert svg_right <= w and side_right <= w and svg_bottom <= h and table_bottom <= h, r
        assert sw <= cw + 1, r  # the circuit panel does not scroll sideways
    finally:
        browser.set_window_size(1400, 1400)


def test_a_page_without_a_circuit_has_no_circuit_tab(built, browser):
    model, toks, ex, path, cache, _ = built
    _open(browser, path, "layer=1&head=2&query=150&view=pattern&tab=circuit")  # read on load or on hashchange
    assert not browser.find_element(By.ID, "dcs-tabs").is_displayed()
    assert not browser.find_element(By.ID, "dcs-circuit-section").is_displayed()
    assert not browser.execute_script("return document.body.classList.contains('tab-circuit')")
    assert "tab (no circuit in this page)" in browser.find_element(By.ID, "dcs-status").text
    assert "tab=" not in browser.execute_script("return location.hash")
    assert browser.find_element(By.ID, "dcs-heads-panel").is_displayed()
