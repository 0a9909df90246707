"""Heatmaps: decoded PNGs compared cell by cell with the activations they draw."""

import io
import os
import subprocess
import sys

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
    img = _decode(png)
    P, T, S = maps.shape
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
                    assert px == hm.colormap_rgb(maps[p, t, s], vmin, vmax, diverging), (p, t, s)
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
    m = float(np.abs(maps[:, visible]).max())  # auto diverging range: +-max|x| over drawn cells
    _check_cells(png, maps, -m, m, True)

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
    png = hm.attention_heatmap(model, text, layer=0, vmin=0.0, vmax=1.0)
    _, cache = model.run_with_cache(toks, names=["blocks.0.attn.pattern"])
    pat = cache["blocks.0.attn.pattern"]
    T = len(toks)
    outside = np.array([[t - s > w for s in range(T)] for t in range(T)])
    assert np.all(pat[:, outside] == 0)  # the engine's local mask
    _check_cells(png, pat, 0.0, 1.0, False, window=w)
    png1 = hm.attention_heatmap(model, text, layer=1, vmin=0.0, vmax=1.0)  # global layer: no window mask
    _, cache = model.run_with_cache(toks, names=["blocks.1.attn.pattern"])
    _check_cells(png1, cache["blocks.1.attn.pattern"], 0.0, 1.0, False)


def test_repr_png_and_save(tok_model, tmp_path):
    model = dclens.load(tok_model)
    png = dclens.attention_heatmap(model, "a b c d", layer=0, head=0)
    assert isinstance(dclens.heatmap(np.eye(3)), dclens.PNG)
    assert png._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    p = png.save(tmp_path / "x.png")
    assert open(p, "rb").read() == bytes(png)
    with pytest.raises(dclens.Error, match="cannot write"):
        png.save(tmp_path / "no" / "such" / "dir" / "x.png")


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
