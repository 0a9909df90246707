"""Heatmaps: decoded PNGs compared cell by cell with the activations they draw."""

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import dclens
from dclens import heatmaps as hm

from conftest import shared_path

MASK = {(214, 214, 214), (168, 168, 168)}


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    from dclens.testing.make_tiny import make_tiny

    d = str(tmp_path_factory.mktemp("tokmodel"))
    make_tiny(
        d,
        model_type="dcpythia",
        n_layer=2,
        dim=32,
        n_head=4,
        vocab=50304,
        window_size=6,
        tokenizer=shared_path("data", "gpt-neox-20b-tokenizer.json"),
        seed=51,
    )
    return d


def _decode(png):
    img = Image.open(io.BytesIO(bytes(png)))
    assert img.format == "PNG"
    return np.asarray(img.convert("RGB"))


def _check_cells(png, maps, vmin, vmax, diverging, mask_upper=True, window=0, windows=None):
    """Every cell's centre pixel against the colour of its value; vmin, vmax and diverging
    may be per-panel lists (each panel its own scale)."""
    img = _decode(png)
    P, T, S = maps.shape
    per = lambda v, p: v[p] if isinstance(v, (list, tuple)) else v
    for p in range(P):
        if windows is not None:
            window = windows[p]
        for t in range(T):
            for s in range(S):
                x, y, c = png.cell_box(p, t, s)
                px = tuple(int(v) for v in img[y + c // 2, x + c // 2])
                if mask_upper and (s > t or (window > 0 and t - s > window)):
                    assert px in MASK, (p, t, s, px)
                else:
                    assert px == hm.colormap_rgb(maps[p, t, s], per(vmin, p), per(vmax, p), per(diverging, p)), (
                        p,
                        t,
                        s,
                    )
    return img


def test_pattern_heatmap_cells_match_values(tok_model):
    model = dclens.load(tok_model)
    text = "When Mary and John went to the store, John gave a drink to"
    toks = model.to_tokens(text)
    _, cache = model.run_with_cache(toks, names=["blocks.1.attn.pattern"])
    pat = cache["blocks.1.attn.pattern"]
    png = hm.heatmap(
        pat,
        tokens=model.to_str_tokens(toks),
        titles=["H%d" % n for n in range(4)],
        title="L1 pattern",
        vmin=0.0,
        vmax=1.0,
    )
    img = _check_cells(png, pat, 0.0, 1.0, False)
    x, y, c = png.cell_box(0, 0, 0)
    assert img.shape[0] > y + c * len(toks) and img.shape[1] > x + c * len(toks)


def test_attention_heatmap_all_heads_and_branches(tok_model):
    model = dclens.load(tok_model)
    text = "The cat sat on the mat because it was tired"
    toks = model.to_tokens(text)
    png = hm.attention_heatmap(model, text, layer=0, hook="pattern", vmin=0.0, vmax=1.0)
    _, cache = model.run_with_cache(toks)
    _check_cells(png, cache["blocks.0.attn.pattern"], 0.0, 1.0, False, window=model.config.window_size)

    png = hm.attention_heatmap(model, text, layer=1, head=2, hook="branches", phase="post")
    maps = np.stack(
        [cache["blocks.1.attn.post.%s" % b][2] for b in hm.BRANCHES] + [cache["blocks.1.attn.pattern_composed"][2]]
    )
    T = len(toks)
    visible = np.tril(np.ones((T, T), bool))
    m = [float(np.abs(a[visible]).max()) for a in maps]  # each panel: +-max|x| over its drawn cells
    _check_cells(png, maps, [-x for x in m], m, True)
    shared = hm.attention_heatmap(model, text, layer=1, head=2, hook="branches", phase="post", scale="shared")
    m = float(np.abs(maps[:, visible]).max())  # scale="shared": one range over all panels
    _check_cells(shared, maps, -m, m, True)

    png = hm.attention_heatmap(model, text, layer="all", head=1, hook="pattern_composed", vmin=-1.0, vmax=1.0)
    maps = np.stack([cache["blocks.%d.attn.pattern_composed" % l][1] for l in range(2)])
    # each panel hatches its own layer's window: layer 0 is local, layer 1 global
    c = model.config
    _check_cells(png, maps, -1.0, 1.0, True, windows=[c.window_size if l in c.local_layers else 0 for l in range(2)])


def test_local_layer_window_is_masked(tok_model):
    model = dclens.load(tok_model)
    assert 0 in model.config.local_layers
    text = "one two three four five six seven eight nine ten eleven twelve"
    toks = model.to_tokens(text)
    w = model.config.window_size
    assert len(toks) > w + 2
    png = hm.attention_heatmap(model, text, layer=0, hook="pattern", vmin=0.0, vmax=1.0)
    _, cache = model.run_with_cache(toks, names=["blocks.0.attn.pattern"])
    pat = cache["blocks.0.attn.pattern"]
    T = len(toks)
    outside = np.array([[t - s > w for s in range(T)] for t in range(T)])
    assert np.all(pat[:, outside] == 0)  # the engine's local mask
    _check_cells(png, pat, 0.0, 1.0, False, window=w)
    png1 = hm.attention_heatmap(model, text, layer=1, hook="pattern", vmin=0.0, vmax=1.0)  # global: no window
    _, cache = model.run_with_cache(toks, names=["blocks.1.attn.pattern"])
    _check_cells(png1, cache["blocks.1.attn.pattern"], 0.0, 1.0, False)


def test_default_shows_composed_beside_softmax(tok_model):
    """DCPythia's default: per head the softmax pattern (sequential, from 0 to its own max) beside the
    composed weights it applies to v (diverging, +-its own max|x|), each with its own colour bar."""
    model = dclens.load(tok_model)
    text = "The cat sat on the mat because it was tired"
    toks = model.to_tokens(text)
    png = hm.attention_heatmap(model, text, layer=1)
    _, cache = model.run_with_cache(toks)
    T, N = len(toks), model.config.n_head
    vis = np.tril(np.ones((T, T), bool))
    maps, lo, hi, div = [], [], [], []
    for h in range(N):
        pat, comp = cache["blocks.1.attn.pattern"][h], cache["blocks.1.attn.pattern_composed"][h]
        m = float(np.abs(comp[vis]).max())
        maps += [pat, comp]
        lo += [0.0, -m]
        hi += [float(pat[vis].max()), m]
        div += [False, True]
    _check_cells(png, np.stack(maps), lo, hi, div)
    with pytest.raises(dclens.Error, match="own scales"):
        hm.attention_heatmap(model, text, layer=1, scale="shared")


def test_long_prompts_show_a_window(tok_model):
    """Every token labelled: more than AUTO_WINDOW tokens show a window up to the query (the title
    says which), positions= picks a range, and more than MAX_TOKENS are refused before any pass."""
    model = dclens.load(tok_model)
    toks = (np.arange(100) * 37 + 11) % 50000
    _, cache = model.run_with_cache(toks, names=["blocks.1.attn.pattern"])
    pat = cache["blocks.1.attn.pattern"]
    png = hm.attention_heatmap(model, toks, layer=1, head=3, hook="pattern", vmin=0.0, vmax=1.0)
    W = hm.AUTO_WINDOW
    _check_cells(png, pat[3:4, 100 - W :, 100 - W :], 0.0, 1.0, False)
    with pytest.raises(dclens.Error, match="outside"):
        png.cell_box(0, W, 0)
    png = hm.attention_heatmap(model, toks, layer=1, head=3, hook="pattern", vmin=0.0, vmax=1.0, window=8, query=50)
    _check_cells(png, pat[3:4, 43:51, 43:51], 0.0, 1.0, False)
    png = hm.attention_heatmap(model, toks, layer=1, head=3, hook="pattern", vmin=0.0, vmax=1.0, positions=(10, 30))
    _check_cells(png, pat[3:4, 10:30, 10:30], 0.0, 1.0, False)
    assert hm._view(100, 50, 8, None)[2] == "positions 43-50 of 100, up to the query 50 (window=8)"
    assert hm._view(30, None, None, None) == (0, 30, None)
    long = np.zeros(hm.MAX_TOKENS + 1, np.int64)
    with pytest.raises(dclens.Error, match=r"513 tokens.*window=.*positions="):
        hm.attention_heatmap(model, long, layer=1)
    for bad in (
        dict(positions=(5, 2)),
        dict(positions=[1, 3]),
        dict(positions=(0, 5), window=3),
        dict(window=0),
        dict(query=100),
    ):
        with pytest.raises(dclens.Error, match="positions|window|query"):
            hm.attention_heatmap(model, toks, layer=1, **bad)


def test_repr_png_and_save(tok_model, tmp_path):
    """One documented return: a Heatmap (a dclens.PNG) whose bytes(h) is the PNG, what save() writes and
    what Jupyter shows (_repr_png_); h.size is its (width, height)."""
    model = dclens.load(tok_model)
    for i, png in enumerate([dclens.attention_heatmap(model, "a b c d", layer=0, head=0), dclens.heatmap(np.eye(3))]):
        assert isinstance(png, hm.Heatmap) and isinstance(png, dclens.PNG)
        data = bytes(png)
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and png._repr_png_() == data and len(png) == len(data)
        p = png.save(tmp_path / ("x%d.png" % i))
        assert p == str(tmp_path / ("x%d.png" % i)) and Path(p).read_bytes() == data
        assert png.size == Image.open(io.BytesIO(data)).size and "%dx%d PNG" % png.size in repr(png)
    for f in (hm.heatmap, hm.attention_heatmap):
        assert "bytes(h)" in f.__doc__ and "save(path)" in f.__doc__
    with pytest.raises(dclens.Error, match="cannot write"):
        png.save(tmp_path / "no" / "such" / "dir" / "x.png")
    with pytest.raises(dclens.ArgumentTypeError, match="save: path"):
        png.save(None)


def test_default_one_layer_picture_reads_at_100_percent():
    """attention_heatmap's default one-layer picture (every head, pattern beside composed) is at most
    MAX_WIDTH pixels wide with every token labelled (cells of a text line or more), up to the 64
    tokens a default window shows; grid_cols= and cell_px= still decide when given."""
    model = dclens.load("dcpythia-small")
    assert hm.MAX_WIDTH <= 1800 and model.config.n_head == 8
    for T in (6, 27, 56, 64):
        toks = (np.arange(T) * 37 + 11) % 1000
        for kw in (dict(layer=0), dict(layer=1, hook="pattern"), dict(layer=0, head=3, hook="branches")):
            png = hm.attention_heatmap(model, toks, **kw)
            assert png.size[0] <= hm.MAX_WIDTH, (T, kw, png.size)
            assert png.cell_box(0, 0, 0)[2] >= hm.MIN_CELL, (T, kw)
    png = hm.attention_heatmap(model, toks, layer=0, grid_cols=6, cell_px=10)  # the old default grid
    assert png.size[0] > 2 * hm.MAX_WIDTH and png.cell_box(0, 0, 0)[2] == 10
    assert hm.attention_heatmap(model, toks, layer=0, cell_px=13).cell_box(0, 0, 0)[2] == 13
    x0 = [hm.attention_heatmap(model, toks, layer=0, grid_cols=4).cell_box(p, 0, 0)[0] for p in range(5)]
    assert x0[0] < x0[1] < x0[2] < x0[3] and x0[4] == x0[0]  # four panels a row, as asked
    with pytest.raises(dclens.ArgumentTypeError, match="unknown keyword argument cell_size"):
        hm.attention_heatmap(model, toks, layer=0, cell_size=3)


def test_heatmap_errors(tok_model):
    model = dclens.load(tok_model)
    with pytest.raises(dclens.Error, match="unknown hook"):
        hm.attention_heatmap(model, "a b", layer=0, hook="patern")
    with pytest.raises(dclens.Error, match="layer 7"):
        hm.attention_heatmap(model, "a b", layer=7)
    with pytest.raises(dclens.Error, match="head 9"):
        hm.attention_heatmap(model, "a b", layer=0, head=9)
    with pytest.raises(dclens.Error, match="empty"):
        hm.attention_heatmap(model, "", layer=0)
    with pytest.raises(dclens.Error, match="shape"):
        hm.heatmap(np.zeros((0, 3)))
    with pytest.raises(dclens.Error):
        hm.heatmap(np.zeros((3, 3)), vmin=1.0, vmax=0.0)
    with pytest.raises(dclens.Error, match="labels"):
        hm.heatmap(np.zeros((3, 3)), tokens=["a", "b"])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dclens.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_heatmap(tok_model, tmp_path):
    out = tmp_path / "h.png"
    r = _cli("heatmap", "--model", tok_model, "--text", "Hello world, hello", "--layer", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    img = Image.open(out)
    assert img.size[0] > 50 and img.size[1] > 50
    # the one-layer picture of a longer line reads at 100%, unless --cell-px / --grid-cols say otherwise
    text = "When Mary and John went to the store, John gave a drink to Mary because she was thirsty " * 3
    for extra, wide in (([], False), (["--cell-px", "24", "--grid-cols", "8"], True)):
        r = _cli("heatmap", "--model", tok_model, "--text", text, "--layer", "0", "--out", str(out), *extra)
        assert r.returncode == 0, r.stderr
        assert (Image.open(out).size[0] > hm.MAX_WIDTH) == wide, (extra, Image.open(out).size)
    r = _cli(
        "heatmap",
        "--model",
        tok_model,
        "--text",
        "x y",
        "--layer",
        "1",
        "--hook",
        "post.kp",
        "--head",
        "0",
        "--out",
        str(tmp_path / "k.png"),
    )
    assert r.returncode == 0, r.stderr
    for bad, msg in [
        (["--layer", "5"], "layer 5"),
        (["--layer", "0", "--head", "11"], "head 11"),
        (["--layer", "0", "--hook", "nope"], "unknown hook"),
        (["--layer", "0", "--out", "/nonexistent/dir/x.png"], "cannot write"),
    ]:
        args = ["heatmap", "--model", tok_model, "--text", "x y", "--out", str(tmp_path / "e.png")] + bad
        r = _cli(*args)
        assert r.returncode == 1 and msg in r.stderr, (bad, r.stderr)
