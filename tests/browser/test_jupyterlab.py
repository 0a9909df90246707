"""What a researcher sees in JupyterLab: a real JupyterLab server and headless Chromium
(Debian's chromium + chromedriver, selenium from the [test] extra, as in
tests/test_explorer_browser.py) open a notebook written into a temporary directory, run
its cells with this Python as the kernel, and look at the DOM:

- dclens.explore(...) is an iframe in the cell's output; its page draws
  (body[data-ready="1"]) and a head click changes #dcs-selected[data-values] to the
  engine's values (within the stored precision, explorer.stored_step, as the explorer
  tests); no request leaves the page: every URL Chromium loads is the server's own
  127.0.0.1 port (or data:, blob:, about:);
- attention_heatmap and a PatchResult are <img> outputs of the PNG's size;
- a tqdm.auto bar (synth_tasks.evaluate, and patching.sweep(progress=True)) is a widget,
  not a flood of text, and the synth bar ends at 100 %;
- a dclens.Error shows its one-line message, not a traceback through the package;
- each notebook of notebooks/ (a copy, in the server's directory) runs top to bottom by
  the lab's "Run All" in a fresh kernel, all of them side by side: every code cell gets its
  execution count (1, 2, ... in order) and no output is an error or a traceback on stderr;
- the server (and its kernels) is stopped and its directory removed whatever the outcome.

The server listens on one TCP port of 127.0.0.1, chosen free (another one when it is
taken); kernels talk to it over Unix sockets (KernelManager.transport="ipc"), so no other
port is opened. Screenshots of each view are saved under the test's temporary directory
(pytest's basetemp, .../test_jupyterlab*/); DCLENS_DOCS_IMG=1 also copies the explorer's
to docs/img/explorer-jupyterlab.png. Bad set-ups: no chromium -> skip, saying why;
JupyterLab exits or does not answer -> a failure with the last lines of its log."""

import contextlib
import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import dclens
from dclens import explorer
from dclens._core.mask import allowed
from dclens._core.names import hook_name

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import run_notebooks as rn  # noqa: E402

PKG_DIR = os.path.dirname(os.path.abspath(dclens.__file__))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
KERNEL = "dclens-test"
START_S = 90  # JupyterLab answers /api/status within this, or the test fails with its log
RUN_S = 120  # the notebook's cells
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
NOTEBOOKS_S = 300  # notebooks/*.ipynb, all run side by side (about 2 min on 2 cores)
# variables the notebooks read to run on other models (scripts/run_notebooks.py) or other files:
# unset in the server's environment, so they run on the bundled models and the repository's
# files, as tests/analyses/test_notebooks.py runs them
NOTEBOOK_ENV = rn.NOTEBOOK_ENV + ("DCLENS_MODELS_DIR", "DCLENS_SEED_CASE_STUDY")

TEXT = "Mary has a dog. Tom has a cat. Mary has a"  # the explorer's and the heatmap's prompt
# patching: dcpythia-tiny's metric is clearly higher on the clean prompt (no PatchingWarning in the output)
CLEAN, CORRUPTED, ANSWER = (
    "Mary has a dog. Tom has a cat. Mary has a",
    "Mary has a cat. Tom has a dog. Mary has a",
    " cat",
)
LAYER, HEAD = 1, 3  # the explorer's layer, and the head the test clicks

# the notebook: one view per code cell, the user error last (Run All stops at an error)
CELLS = {
    "setup": "import dclens\nmodel = dclens.load('dcpythia-tiny')\ntoks = model.to_tokens(%r)\nprint(len(toks), 'tokens')"
    % TEXT,
    "explorer": "dclens.explore(model, toks, layers=[%d], progress=False)" % LAYER,
    "heatmap": "dclens.attention_heatmap(model, %r, layer=0)" % TEXT,
    "patching": (
        "from dclens import patching\n"
        "metric = patching.logprob(int(model.to_tokens(%r)[-1]))\n"
        "res = patching.sweep(model, %r, %r, metric, progress=True)\n"
        "res" % (ANSWER, CLEAN, CORRUPTED)
    ),
    "synth": (
        "from synth_tasks import load_dataset, evaluate\n"
        "from synth_tasks.corpus import HELDOUT_FILE\n"
        "result = evaluate(model, list(load_dataset(HELDOUT_FILE))[:32])  # progress=None: a bar where someone watches\n"
        "print('accuracy %.3f' % result.summary['overall']['acc'])"
    ),
    "error": "dclens.attention_heatmap(model, %r, layer=9)  # a user error: the model has 4 layers" % TEXT,
}
NOTEBOOK = "dclens_in_jupyterlab.ipynb"


# ---------------------------------------------------------------- the server


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server on 127.0.0.1:port (token auth) in its own temporary directory."""

    def __init__(self, workdir, port, token, proc, log_path):
        self.workdir, self.port, self.token, self.proc, self.log_path = workdir, port, token, proc, log_path
        self.notebooks = os.path.join(workdir, "notebooks")

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM (the server shuts its kernels down), then SIGKILL to the process group
        after 20 s, and to any kernel still alive (kernels run in sessions of their own);
        then the directory is removed."""
        kernels = _descendants(self.proc.pid)
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
            # a kernel the server left behind (it shares the server's process group)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in kernels:  # still ours: its command line names a file of this server's directory
                try:
                    with open("/proc/%d/cmdline" % pid, "rb") as f:
                        if self.workdir.encode() in f.read():
                            os.kill(pid, signal.SIGKILL)
                except (OSError, ProcessLookupError, PermissionError):
                    pass
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _descendants(pid: int) -> list:
    """The processes started by `pid`, and by them (Linux /proc; [] elsewhere)."""
    children = {}
    try:
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open("/proc/%s/stat" % d) as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                children.setdefault(ppid, []).append(int(d))
    except OSError:
        return []
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _write_config(workdir: str):
    """Directories and settings of this server alone (no user configuration is read), the
    kernelspec of this Python, and the environment the server (and so the kernel) runs in."""
    d = {k: os.path.join(workdir, k) for k in ("notebooks", "config", "data", "runtime", "settings", "ipython")}
    for p in d.values():
        os.makedirs(p)
    # this Python under our name and under "python3", the notebooks' kernelspec (a python3 of
    # another installation, first on the system's path, is not used)
    for name in (KERNEL, "python3"):
        kdir = os.path.join(d["data"], "kernels", name)
        os.makedirs(kdir)
        with open(os.path.join(kdir, "kernel.json"), "w") as f:
            json.dump(
                {
                    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "Python (dclens tests)",
                    "language": "python",
                },
                f,
            )
    # the notebook renders every cell (no windowing), and asks about no news and no updates
    for plugin, values in {
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        p = os.path.join(d["settings"], plugin + ".jupyterlab-settings")
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            json.dump(values, f)
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=d["config"],
        JUPYTER_DATA_DIR=d["data"],
        JUPYTER_RUNTIME_DIR=d["runtime"],
        JUPYTER_PATH=d["data"],  # our kernelspec first; the installed lab extensions still load
        IPYTHONDIR=d["ipython"],
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("MPLBACKEND", None)  # the kernel's inline backend
    for name in NOTEBOOK_ENV:
        env.pop(name, None)
    return d, env


def start_lab(port=None, args=(), tries: int = 3, timeout: float = START_S) -> Lab:
    """Start JupyterLab on 127.0.0.1:port (default: a free one) in a new temporary directory
    and wait until it answers. A port that is taken (the log says so) -> another port; a
    server that exits or does not answer -> pytest.fail with the last lines of its log (the
    directory removed)."""
    workdir = tempfile.mkdtemp(prefix="dclens-jupyterlab-")
    try:
        d, env = _write_config(workdir)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    token = secrets.token_hex(16)
    for attempt in range(tries):
        port = port or free_port()
        log_path = os.path.join(workdir, "server-%d.log" % attempt)
        cmd = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            "--port=%d" % port,
            "--port-retries=0",  # a taken port is an error we see, not a silent port+1
            "--IdentityProvider.token=%s" % token,
            "--ServerApp.root_dir=%s" % d["notebooks"],
            "--ServerApp.terminals_enabled=False",
            "--KernelManager.transport=ipc",  # kernels on Unix sockets: no TCP port but the server's
            "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: the test runs cells by command
            "--LabApp.user_settings_dir=%s" % d["settings"],
            "--LabApp.workspaces_dir=%s" % d["settings"],
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",  # no look-ups on PyPI
            *(["--allow-root"] if os.geteuid() == 0 else []),
            *args,
        ]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        lab = Lab(workdir, port, token, proc, log_path)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(lab.url + "/api/status?token=" + token, timeout=5) as r:
                    if r.status == 200:
                        return lab
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        tail = lab.log_tail()
        if proc.poll() is not None and "already in use" in tail and attempt + 1 < tries:
            port = None  # taken (by someone else, or since we looked): another one
            continue
        what = (
            "exited with status %s" % proc.returncode if proc.poll() is not None else "did not answer in %d s" % timeout
        )
        try:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        pytest.fail("JupyterLab on 127.0.0.1:%d %s; the last lines of its log:\n%s" % (port, what, tail), pytrace=False)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- the browser


def _browser():
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        pytest.skip("chromium / chromedriver not installed (scripts/install-deps.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-default-apps",
        "--disable-sync",
    ):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    d.set_page_load_timeout(60)
    return d


def _notebook() -> dict:
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# dclens in JupyterLab", "id": "title"}]
    for name, src in CELLS.items():
        cells.append(
            {"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": None, "id": name}
        )
    return {
        "cells": cells,
        "metadata": {
            "kernelspec": {"name": KERNEL, "display_name": "Python (dclens tests)", "language": "python"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


_KERNEL_IDLE = (
    "const a = window.jupyterapp; if (!a) return false; const w = a.shell.currentWidget;"
    "if (!w || !w.sessionContext || !w.content || !w.context.isReady) return false;"
    "const k = w.sessionContext.session && w.sessionContext.session.kernel;"
    "return !!k && k.status === 'idle' && k.connectionStatus === 'connected';"
)
_ALL_RUN = (
    "const w = window.jupyterapp.shell.currentWidget; const k = w.sessionContext.session.kernel;"
    "const cells = w.content.widgets.filter(c => c.model.type === 'code');"
    "const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent);"
    "return k.status === 'idle' && cells.every(c => c.model.executionCount !== null)"
    " && prompts.length === cells.length && prompts.every(p => /\\[\\d+\\]/.test(p));"
)


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return tmp_path_factory.mktemp("jupyterlab_screenshots")


@pytest.fixture(scope="module")
def driver():
    """Headless Chromium, for every test of the module (skips without chromium)."""
    d = _browser()
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def lab(driver):
    """One JupyterLab server for every test of the module (after the driver: without chromium
    the tests skip before any server starts); stopped, its directory removed, at the end."""
    server = start_lab()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def session(driver, lab, shots):
    """The notebook of CELLS run in JupyterLab in Chromium: (driver, lab, seconds per phase)."""
    from selenium.webdriver.support.ui import WebDriverWait

    with open(os.path.join(lab.notebooks, NOTEBOOK), "w") as f:
        json.dump(_notebook(), f)
    t0 = time.monotonic()
    driver.get("%s/lab/tree/%s?token=%s" % (lab.url, NOTEBOOK, lab.token))
    try:
        WebDriverWait(driver, START_S).until(lambda d: d.execute_script(_KERNEL_IDLE))
    except Exception:
        driver.save_screenshot(str(shots / "not-ready.png"))
        pytest.fail("the notebook's kernel was not idle in %d s; server log:\n%s" % (START_S, lab.log_tail()))
    times = {"open": time.monotonic() - t0}
    driver.execute_script("window.jupyterapp.shell.collapseLeft()")  # the notebook as wide as the window
    driver.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    try:
        WebDriverWait(driver, RUN_S).until(lambda d: d.execute_script(_ALL_RUN))
    except Exception:
        driver.save_screenshot(str(shots / "not-run.png"))
        pytest.fail("the notebook's cells did not all run in %d s; server log:\n%s" % (RUN_S, lab.log_tail()))
    time.sleep(0.5)  # the last outputs and widget states reach the DOM
    times["run"] = time.monotonic() - t0 - times["open"]
    driver.save_screenshot(str(shots / "notebook.png"))
    return driver, lab, times


def _output(driver, cell: str):
    """The output area of code cell `cell` (a key of CELLS)."""
    from selenium.webdriver.common.by import By

    i = list(CELLS).index(cell)
    area = driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")[i]
    driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", area)
    time.sleep(0.2)
    return area.find_element(By.CSS_SELECTOR, ".jp-Cell-outputArea")


def _outputs(driver, cell: str) -> list:
    """The outputs of code cell `cell` in the notebook's model (what would be saved)."""
    js = (
        "const w = window.jupyterapp.shell.currentWidget;"
        "return JSON.stringify(w.content.widgets.find(c => c.model.id === arguments[0]).model.outputs.toJSON());"
    )
    return json.loads(driver.execute_script(js, cell))


def _png_size(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _selected(driver, expect=None):
    """#dcs-selected's state and values once the page has drawn what `expect` names."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    js = (
        "var s = document.getElementById('dcs-selected'); if (document.body.dataset.error) return true;"
        "if (document.body.dataset.ready !== '1') return false; var e = arguments[0];"
        "for (var k in e) if (s.dataset[k] !== e[k]) return false; return true;"
    )
    WebDriverWait(driver, 30).until(lambda d: d.execute_script(js, expect or {}))
    assert driver.execute_script("return document.body.dataset.error || ''") == ""
    el = driver.find_element(By.ID, "dcs-selected")
    state = {k: el.get_attribute("data-" + k) for k in ("view", "layer", "head", "query")}
    return state, json.loads(el.get_attribute("data-values"))


def _urls_loaded(driver) -> list:
    """The URLs Chromium requested (and websockets it opened) since the last call."""
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] in ("Network.requestWillBeSent", "Network.webSocketCreated"):
            urls.append(msg["params"].get("request", {}).get("url") or msg["params"].get("url"))
    return urls


def _foreign(urls, lab) -> list:
    """The URLs that are not the server's own 127.0.0.1 port, data:, blob: or about:."""
    own = ("http://127.0.0.1:%d/" % lab.port, "ws://127.0.0.1:%d/" % lab.port, "data:", "blob:", "about:")
    return [u for u in urls if not u.startswith(own)]


# ---------------------------------------------------------------- the checks


def test_explorer_in_the_notebook_output(session, shots):
    from selenium.webdriver.common.by import By

    driver, lab, _ = session
    out = _output(driver, "explorer")
    frames = out.find_elements(By.CSS_SELECTOR, "iframe")
    assert len(frames) == 1 and frames[0].get_attribute("title") == "dclens explorer"
    assert frames[0].size["height"] >= 1000 and frames[0].size["width"] >= 800  # shown, at its height
    model = dclens.load("dcpythia-tiny")
    toks = model.to_tokens(TEXT)
    T = len(toks)
    _, cache = model.run_with_cache(toks, names=[hook_name(LAYER, "attn.pattern_composed")])
    want = cache[hook_name(LAYER, "attn.pattern_composed")].astype(np.float64)
    c = model.config
    vis = allowed(T, T, c.window_size if LAYER in c.local_layers else 0)
    step = explorer.stored_step(want, vis)
    driver.switch_to.frame(frames[0])
    try:
        state, before = _selected(driver)
        assert (state["view"], state["layer"], state["head"], state["query"]) == (
            "pattern_composed",
            str(LAYER),
            "0",
            str(T - 1),
        )
        driver.find_element(By.CSS_SELECTOR, '#dcs-heads button[data-head="%d"]' % HEAD).click()
        state, after = _selected(driver, {"head": str(HEAD)})
    finally:
        driver.switch_to.default_content()
    assert after != before  # the click changed what #dcs-selected shows ...
    for head, got in ((0, before), (HEAD, after)):  # ... to the engine's row of that head
        got = np.array([np.nan if v is None else v for v in got], dtype=float)
        assert got.shape == (T,)
        vis_row = vis[T - 1]
        assert np.isnan(got[~vis_row]).all()
        err = np.abs(got[vis_row] - want[head, T - 1][vis_row])
        assert (err <= step[head, T - 1] / 2 * (1 + 1e-5) + 1e-7).all(), "head %d: max error %g" % (head, err.max())
    _output(driver, "explorer")  # the cell at the top of the notebook's view: its input, then the page
    driver.save_screenshot(str(shots / "explorer.png"))
    if os.environ.get("DCLENS_DOCS_IMG") == "1":
        shutil.copyfile(str(shots / "explorer.png"), os.path.join(ROOT, "docs", "img", "explorer-jupyterlab.png"))


def test_no_request_leaves_the_page(session):
    """Every URL Chromium loaded (the lab, its kernel websocket, the explorer's iframe) is
    the server's own 127.0.0.1 port, or data:, blob:, about:."""
    driver, lab, _ = session
    urls = _urls_loaded(driver)
    assert any(u.startswith(lab.url + "/lab") for u in urls), "the performance log saw no page load"
    assert any(u.startswith("ws://127.0.0.1:%d/api/kernels/" % lab.port) for u in urls), "no kernel websocket"
    assert _foreign(urls, lab) == []
    # and the kernel talks to the server over Unix sockets: no TCP port of its own
    runtime = os.path.join(lab.workdir, "runtime")
    conns = [
        json.loads(_read(os.path.join(runtime, f)))
        for f in os.listdir(runtime)
        if f.startswith("kernel-") and f.endswith(".json")
    ]
    assert conns and all(c["transport"] == "ipc" for c in conns), conns


@pytest.mark.parametrize("cell", ["heatmap", "patching"])
def test_pictures_are_img_outputs_of_their_size(session, shots, cell):
    from selenium.webdriver.common.by import By

    driver, lab, _ = session
    model = dclens.load("dcpythia-tiny")
    if cell == "heatmap":
        want = tuple(dclens.attention_heatmap(model, TEXT, layer=0).size)
    else:
        from dclens import patching

        metric = patching.logprob(int(model.to_tokens(ANSWER)[-1]))
        want = _png_size(patching.sweep(model, CLEAN, CORRUPTED, metric, progress=False)._repr_png_())
    out = _output(driver, cell)
    imgs = out.find_elements(By.CSS_SELECTOR, ".jp-RenderedImage img")
    assert len(imgs) == 1, out.get_attribute("innerHTML")[:2000]
    img = imgs[0]
    natural = tuple(driver.execute_script("return [arguments[0].naturalWidth, arguments[0].naturalHeight]", img))
    assert natural == want
    assert img.get_attribute("src").startswith("data:image/png;base64,")
    w, h = img.size["width"], img.size["height"]
    assert 0 < w <= natural[0] + 1 and h > 0  # shown, never stretched wider than the PNG
    assert abs(w / h - natural[0] / natural[1]) < 0.02  # nor out of its proportions
    out.screenshot(str(shots / ("%s.png" % cell)))


def test_progress_bars_are_widgets(session, shots):
    from selenium.webdriver.common.by import By

    driver, lab, _ = session
    out = _output(driver, "synth")
    bars = out.find_elements(By.CSS_SELECTOR, ".widget-hprogress")
    assert len(bars) == 1, "no progress widget: %s" % out.text
    progress = bars[0].find_element(By.CSS_SELECTOR, ".progress-bar")
    assert progress.value_of_css_property("width") == bars[0].find_element(
        By.CSS_SELECTOR, ".progress"
    ).value_of_css_property("width")  # full
    assert "width: 100%" in progress.get_attribute("style")
    label = out.find_element(By.CSS_SELECTOR, ".widget-hbox").text
    assert "100%" in label and "32/32" in label, label
    assert "accuracy" in out.text
    # no text bar: tqdm's text lines would be stderr outputs
    assert out.find_elements(By.CSS_SELECTOR, '[data-mime-type="application/vnd.jupyter.stderr"]') == []
    out.screenshot(str(shots / "progress.png"))
    # patching.sweep(progress=True)'s bar (leave=False) was a widget too, closed at the end: no text left behind
    patch = _output(driver, "patching")
    assert patch.find_elements(By.CSS_SELECTOR, '[data-mime-type="application/vnd.jupyter.stderr"]') == []
    assert "Error displaying widget" not in patch.text and "%|" not in patch.text
    for cell in ("synth", "patching"):  # what the notebook stores: a widget view, no stream on stderr
        outputs = _outputs(driver, cell)
        assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs), (cell, outputs)
        assert not [o for o in outputs if o.get("name") == "stderr"], (cell, outputs)


def test_a_user_error_shows_its_one_line_message(session, shots):
    from selenium.webdriver.common.by import By

    driver, lab, _ = session
    model = dclens.load("dcpythia-tiny")
    with pytest.raises(dclens.Error) as e:
        dclens.attention_heatmap(model, TEXT, layer=9)
    message = "%s: %s" % (type(e.value).__name__, e.value)
    out = _output(driver, "error")
    err = out.find_elements(By.CSS_SELECTOR, '[data-mime-type="application/vnd.jupyter.stderr"]')
    assert len(err) == 1
    out.screenshot(str(shots / "error.png"))
    text = err[0].text
    assert message in text, text  # the message, whole, on its line
    lines = [l for l in text.splitlines() if l.strip()]
    inside = [l for l in lines if PKG_DIR in l or "site-packages/dclens" in l]
    assert inside == [] and len(lines) <= 6, text


# ---------------------------------------------------------------- the notebooks of notebooks/

# Open each notebook, wait for its kernel, clear its outputs and start "Run All" without
# waiting for it: the next notebook opens while the first runs (their kernels side by side).
_OPEN_AND_RUN = """
const paths = arguments[0], done = arguments[arguments.length - 1];
const app = window.jupyterapp;
const sleep = ms => new Promise(r => setTimeout(r, ms));
(async () => {
  const ids = [];
  for (const path of paths) {
    const w = await app.commands.execute('docmanager:open', {path: path, factory: 'Notebook'});
    await w.context.ready;
    await w.sessionContext.ready;
    let k = null;
    for (let i = 0; i < 1200; i++) {
      k = w.sessionContext.session && w.sessionContext.session.kernel;
      if (k && k.status === 'idle' && k.connectionStatus === 'connected') break;
      await sleep(100);
    }
    if (!(k && k.status === 'idle')) throw new Error(path + ': its kernel is not idle after 120 s');
    app.shell.activateById(w.id);
    await app.commands.execute('notebook:clear-all-cell-outputs', {widgetId: w.id});
    app.commands.execute('notebook:run-all-cells', {widgetId: w.id});
    ids.push(w.id);
  }
  return ids;
})().then(ids => done({ids: ids}), e => done({error: String((e && e.stack) || e)}));
"""

# Each notebook as the lab shows it: its kernel's status, and for each non-empty code cell
# the model's execution count, the prompt the DOM shows, the text of the stderr outputs in
# the DOM (tracebacks render there) and the error outputs of the model.
_NOTEBOOK_STATE = """
const app = window.jupyterapp;
const out = [];
for (const id of arguments[0]) {
  const w = [...app.shell.widgets('main')].find(x => x.id === id);
  if (!w) { out.push({id: id, missing: true}); continue; }
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  const cells = w.content.widgets.filter(c => c.model.type === 'code' && c.model.sharedModel.getSource().trim());
  const errors = [];
  for (const c of cells)
    for (const o of c.model.outputs.toJSON())
      if (o.output_type === 'error') errors.push(o.ename + ': ' + o.evalue);
  out.push({
    id: id,
    path: w.context.path,
    status: k ? k.status : 'no kernel',
    counts: cells.map(c => c.model.executionCount),
    prompts: cells.map(c => c.node.querySelector('.jp-InputPrompt').textContent.trim()),
    stderr: [...w.content.node.querySelectorAll(
      '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')].map(e => e.textContent),
    errors: errors,
  });
}
return JSON.stringify(out);
"""

# a traceback, or an exception's "Name: message" line (a dclens.Error shows only that)
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\s*[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:", re.M)


def _finished(state: dict) -> bool:
    """Run All is over: the kernel is idle and every cell ran, or one failed (the cells after
    it were not run)."""
    if state.get("missing"):
        return True
    failed = state["errors"] or any(_TRACEBACK.search(t) for t in state["stderr"])
    return state["status"] == "idle" and (all(c is not None for c in state["counts"]) or bool(failed))


def test_the_notebooks_run_in_jupyterlab(driver, lab, shots):
    """notebooks/*.ipynb (copies, laid out as in the repository: notebooks/ beside a link to
    docs/, which 02 reads) run by the lab's Run All, each in a fresh kernel, side by side."""
    from selenium.webdriver.support.ui import WebDriverWait

    assert NOTEBOOKS, "no notebooks/*.ipynb"
    os.makedirs(os.path.join(lab.notebooks, "notebooks"))
    os.symlink(os.path.join(ROOT, "docs"), os.path.join(lab.notebooks, "docs"))
    paths = []
    for src in NOTEBOOKS:
        shutil.copyfile(src, os.path.join(lab.notebooks, "notebooks", os.path.basename(src)))
        paths.append("notebooks/" + os.path.basename(src))
    driver.get("%s/lab?token=%s" % (lab.url, lab.token))
    WebDriverWait(driver, START_S).until(
        lambda d: d.execute_script(
            "return !!(window.jupyterapp && window.jupyterapp.commands.hasCommand('docmanager:open'))"
        )
    )
    driver.set_script_timeout(NOTEBOOKS_S)
    t0 = time.monotonic()
    started = driver.execute_async_script(_OPEN_AND_RUN, paths)
    assert "error" not in started, "%s\nserver log:\n%s" % (started["error"], lab.log_tail())
    ids = started["ids"]
    took = {}

    def all_finished(d):
        states = json.loads(d.execute_script(_NOTEBOOK_STATE, ids))
        for s in states:
            if _finished(s):
                took.setdefault(s.get("path", s["id"]), time.monotonic() - t0)
        return states if len(took) == len(ids) else False

    try:
        states = WebDriverWait(driver, NOTEBOOKS_S, poll_frequency=1).until(all_finished)
    except Exception:
        driver.save_screenshot(str(shots / "notebooks-not-run.png"))
        states = json.loads(driver.execute_script(_NOTEBOOK_STATE, ids))
        pytest.fail(
            "Run All did not end in %d s: %s\nserver log:\n%s"
            % (NOTEBOOKS_S, [(s.get("path"), s.get("status"), s.get("counts")) for s in states], lab.log_tail()),
            pytrace=False,
        )
    print("notebooks in JupyterLab, seconds from the first Run All to the end of each:", took)
    assert [s.get("path") for s in states] == paths
    for s in states:
        driver.execute_script("window.jupyterapp.shell.activateById(arguments[0])", s["id"])
        time.sleep(0.3)
        driver.save_screenshot(str(shots / ("notebook-%s.png" % os.path.basename(s["path"])[:-6])))
        tracebacks = [t for t in s["stderr"] if _TRACEBACK.search(t)]
        assert s["errors"] == [] and tracebacks == [], "%s: %s" % (s["path"], (s["errors"] + tracebacks)[0][-3000:])
        n = len(s["counts"])
        assert n > 0 and s["counts"] == list(range(1, n + 1)), (s["path"], s["counts"])  # every cell, in order
        assert s["prompts"] == ["[%d]:" % i for i in range(1, n + 1)], (s["path"], s["prompts"])  # as shown
    assert _foreign(_urls_loaded(driver), lab) == []


# ---------------------------------------------------------------- bad set-ups


def test_a_taken_port_gets_another_and_the_server_leaves_nothing():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        taken = s.getsockname()[1]
        lab = start_lab(port=taken)
        try:
            assert lab.port != taken
            with urllib.request.urlopen(lab.url + "/api/status?token=" + lab.token, timeout=10) as r:
                assert r.status == 200
            assert "already in use" in _read(os.path.join(lab.workdir, "server-0.log"))
        finally:
            lab.stop()
    assert lab.proc.poll() is not None and not os.path.exists(lab.workdir)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        assert s.connect_ex(("127.0.0.1", lab.port)) != 0  # nothing listens there any more


def test_a_server_that_fails_to_start_fails_with_its_log():
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(pytest.fail.Exception) as e:
        start_lab(args=["--ServerApp.root_dir=/nonexistent/dclens-test-dir"])
    msg = str(e.value)
    assert "JupyterLab on 127.0.0.1:" in msg and "exited with status" in msg and "last lines of its log" in msg
    assert "/nonexistent/dclens-test-dir" in msg  # the server's own words about why
    left = {p for p in set(os.listdir(tempfile.gettempdir())) - before if p.startswith("dclens-jupyterlab-")}
    assert left == set()
