"""Attention heatmaps rendered to PNG by the engine (libpng, built-in font).

    png = dclens.attention_heatmap(model, "The cat sat on the mat", layer=1)
    png                      # displays inline in Jupyter (_repr_png_)
    png.save("layer1.png")

Sequential colours (viridis-like) for patterns in [0, 1]; a diverging map
centred on zero for signed quantities (scores, compose branches, composed
weights). matplotlib versions of the same figures are in dclens.plots.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Union

import numpy as np

from ._engine import ffi, lib
from ._checks import check_index
from .model import Error, Model
from .names import BRANCHES, hook_name

SEQUENTIAL, DIVERGING = 0, 1


class PNG:
    """PNG bytes that show themselves in Jupyter and can be saved."""

    def __init__(self, data: bytes):
        self.data = data

    def _repr_png_(self) -> bytes:
        return self.data

    def __bytes__(self) -> bytes:
        return self.data

    def __len__(self) -> int:
        return len(self.data)

    def save(self, path: Union[str, os.PathLike]) -> str:
        path = os.fspath(path)
        try:
            with open(path, "wb") as f:
                f.write(self.data)
        except OSError as e:
            raise Error("%s: cannot write the PNG: %s" % (path, e.strerror or e))
        return path


def colormap_rgb(value: float, vmin: float, vmax: float, diverging: bool = False) -> tuple:
    """The engine's colour for a value (for tests and legends)."""
    rgb = ffi.new("uint8_t[3]")
    lib.dcs_colormap_rgb(DIVERGING if diverging else SEQUENTIAL, float(value), float(vmin), float(vmax), rgb)
    return rgb[0], rgb[1], rgb[2]


def _spec(
    maps,
    tokens,
    key_tokens,
    titles,
    title,
    diverging,
    mask_upper,
    vmin,
    vmax,
    grid_cols,
    cell_px,
    mask_window=0,
    panel_windows=None,
    axis_titles=True,
):
    """The dcs_heatmap_spec of a call, and the cffi objects it points into."""
    a = np.asarray(maps, dtype=np.float32)
    if a.ndim == 2:
        a = a[None]
    if a.ndim != 3 or 0 in a.shape:
        raise Error("heatmap: maps must be [T, S] or [P, T, S] and non-empty, got shape %s" % (np.shape(maps),))
    a = np.ascontiguousarray(a)
    P, T, S = a.shape
    keep = [a]  # every object the spec points into stays alive with it

    def cstr(text):
        c = ffi.new("char[]", str(text).encode("utf-8", "replace"))
        keep.append(c)
        return c

    def cstrs(strs, n, what):
        if strs is None:
            return ffi.NULL
        strs = list(strs)
        if len(strs) != n:
            raise Error("heatmap: %d %s labels for %d %ss" % (len(strs), what, n, what))
        arr = ffi.new("const char *[]", [cstr(x) for x in strs])
        keep.append(arr)
        return arr

    titles = list(titles) if titles is not None else [None] * P
    if len(titles) != P:
        raise Error("heatmap: %d titles for %d panels" % (len(titles), P))
    panels = ffi.new("dcs_panel[]", P)
    keep.append(panels)
    if panel_windows is not None:
        panel_windows = list(panel_windows)
        if len(panel_windows) != P:
            raise Error("heatmap: %d panel windows for %d panels" % (len(panel_windows), P))
    for i in range(P):
        if panel_windows is not None:
            w = panel_windows[i]
            panels[i].mask_window = -1 if not w or w <= 0 else int(w)
        panels[i].data = ffi.cast("const float *", ffi.from_buffer(a[i]))
        panels[i].rows, panels[i].cols = T, S
        if titles[i] is not None:
            panels[i].title = cstr(titles[i])
    spec = ffi.new("dcs_heatmap_spec *")
    spec.panels, spec.n_panels = panels, P
    spec.grid_cols = grid_cols
    spec.colormap = DIVERGING if diverging else SEQUENTIAL
    spec.auto_range = 1 if (vmin is None or vmax is None) else 0
    if not spec.auto_range:
        spec.vmin, spec.vmax = vmin, vmax
    spec.row_labels = cstrs(tokens, T, "row")
    spec.col_labels = cstrs(key_tokens if key_tokens is not None else (tokens if S == T else None), S, "column")
    spec.mask_upper = 1 if mask_upper else 0
    spec.mask_window = int(mask_window or 0)
    spec.cell_px = int(cell_px or 0)
    spec.axis_titles = 1 if axis_titles else 0
    if title is not None:
        spec.title = cstr(title)
    return spec, keep


class Heatmap(PNG):
    """A rendered heatmap: PNG bytes plus the geometry of its cells."""

    def __init__(self, data: bytes, args: tuple):
        super().__init__(data)
        self._args = args

    def cell_box(self, panel: int, t: int, s: int):
        """(x, y, side) in pixels of cell (t, s) of a panel."""
        spec, _keep = _spec(*self._args)
        x, y, c = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
        err = ffi.new("char[]", 512)
        if lib.dcs_heatmap_geometry(spec, panel, t, s, ffi.NULL, ffi.NULL, x, y, c, err, 512) != lib.DCS_OK:
            raise Error(ffi.string(err).decode(errors="replace"))
        return x[0], y[0], c[0]


def heatmap(
    maps,
    *,
    tokens: Optional[Sequence[str]] = None,
    key_tokens: Optional[Sequence[str]] = None,
    titles: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    diverging: bool = False,
    mask_upper: bool = True,
    vmin: Optional[float] = None,
    vmax: Optional[float] = None,
    grid_cols: int = 0,
    cell_px: int = 0,
    mask_window: int = 0,
    panel_windows: Optional[Sequence[int]] = None,
    axis_titles: bool = True,
) -> Heatmap:
    """Render one [T, S] map or a stack [P, T, S] of them as a grid of panels.

    tokens label the rows (queries) and, unless key_tokens is given, the
    columns. vmin/vmax fix the colour range (default: from the data).
    mask_upper hatches the causal upper triangle; mask_window > 0 also
    hatches cells with t - s > mask_window (a local-attention layer);
    panel_windows gives each panel its own window (0 or None: global).
    Rows are labelled "query", columns "key" (axis_titles). grid_cols:
    panels per grid row (0: all in one row); cell_px: pixels per cell (0:
    chosen from the size). vmin or vmax alone fixes that end of the range,
    the other comes from the data."""
    if (vmin is None) != (vmax is None):
        vis = _visible_values(maps, mask_upper)
        if vmin is None:
            vmin = float(vis.min()) if vis.size else 0.0
            if not vmin < vmax:
                vmin = vmax - 1.0
        else:
            vmax = float(vis.max()) if vis.size else 1.0
            if not vmax > vmin:
                vmax = vmin + 1.0
    if not isinstance(grid_cols, (int, np.integer)) or grid_cols < 0:
        raise Error("heatmap: grid_cols must be an integer >= 0, got %r" % (grid_cols,))
    if not isinstance(cell_px, (int, np.integer)) or cell_px < 0:
        raise Error("heatmap: cell_px must be an integer >= 0, got %r" % (cell_px,))
    args = (
        maps,
        tokens,
        key_tokens,
        titles,
        title,
        diverging,
        mask_upper,
        vmin,
        vmax,
        grid_cols,
        cell_px,
        mask_window,
        panel_windows,
        axis_titles,
    )
    spec, _keep = _spec(*args)
    out = ffi.new("uint8_t **")
    n = ffi.new("size_t *")
    err = ffi.new("char[]", 512)
    st = lib.dcs_heatmap_png(spec, out, n, err, 512)
    if st != lib.DCS_OK:
        raise Error("heatmap: " + ffi.string(err).decode(errors="replace"))
    try:
        return Heatmap(bytes(ffi.buffer(out[0], n[0])), args)
    finally:
        lib.dcs_buffer_free(out[0])


def _visible_values(maps, mask_upper: bool) -> np.ndarray:
    a = np.asarray(maps, dtype=np.float64)
    if a.ndim < 2:
        return a.ravel()
    if mask_upper:
        t, s = np.indices(a.shape[-2:])
        a = a[..., s <= t]
    a = a.ravel()
    return a[np.isfinite(a)]


def attention_heatmap(
    model: Model,
    text_or_tokens,
    layer: Union[int, str] = 0,
    head: Optional[int] = None,
    hook: str = "pattern",
    phase: str = "post",
    **kw,
) -> Heatmap:
    """Heatmaps of a model's attention on a prompt.

    - layer=L, head=None: every head of layer L for `hook` (pattern,
      pattern_composed, scores, scores_composed, pre.kp, post.qg, ...);
    - layer="all", head=H: head H across all layers;
    - hook="branches", layer=L, head=H: the compose branches of `phase` (five;
      six with use_sw) side by side with their sum.
    Panels go in a near-square grid (grid_cols=N to choose); local layers'
    windows are hatched; a softmax pattern's colour bar starts at 0."""
    if isinstance(text_or_tokens, str):
        if not text_or_tokens:
            raise Error("heatmap: the text is empty")
        tokens = model.to_tokens(text_or_tokens)
        labels = model.to_str_tokens(tokens)
    else:
        tokens = np.asarray(text_or_tokens)
        try:
            labels = model.to_str_tokens(tokens)
        except Error:
            labels = [str(int(t)) for t in tokens]
    if tokens.ndim != 1 or tokens.size == 0:
        raise Error("heatmap: need a non-empty 1-D token sequence")
    c = model.config
    if head is not None:
        head = check_index("heatmap: head", head, 0, c.n_head, " (model has %d heads)" % c.n_head)
    if layer != "all":
        layer = check_index("heatmap: layer", layer, 0, c.n_layer, " (model has %d layers)" % c.n_layer)
    if layer != "all" and layer in c.local_layers:
        kw.setdefault("mask_window", c.window_size)

    if hook == "branches":
        if head is None or layer == "all":
            raise Error("heatmap: hook='branches' needs one layer and one head")
        if phase not in ("pre", "post"):
            raise Error("heatmap: phase must be 'pre' or 'post'")
        names = [hook_name(layer, "attn.%s.%s" % (phase, b)) for b in BRANCHES + ("static",)]
        names = [n for n in names if n in model.hook_names]
        total = hook_name(layer, "attn.%s" % ("scores_composed" if phase == "pre" else "pattern_composed"))
        _, cache = model.run_with_cache(tokens, names=names + [total])
        maps = [cache[n][head] for n in names] + [cache[total][head]]
        titles = [n.rsplit(".", 1)[1] for n in names] + ["sum"]
        kw.setdefault("title", "%s: L%d H%d %s-compose branches" % (model.name, layer, head, phase))
        return heatmap(np.stack(maps), tokens=labels, titles=titles, diverging=True, **kw)

    if layer == "all":
        if head is None:
            raise Error("heatmap: layer='all' needs a head")
        names = [hook_name(l, "attn.%s" % hook) for l in range(c.n_layer)]
        for n in names:
            model.parse_hook(n)
        _, cache = model.run_with_cache(tokens, names=names)
        maps = np.stack([cache[n][head] for n in names])
        titles = ["L%d H%d%s" % (l, head, " (local)" if l in c.local_layers else "") for l in range(c.n_layer)]
        kw.setdefault("panel_windows", [c.window_size if l in c.local_layers else 0 for l in range(c.n_layer)])
        kw.setdefault("title", "%s: head %d across layers: %s" % (model.name, head, hook))
    else:
        name = hook_name(layer, "attn.%s" % hook)
        model.parse_hook(name)
        _, cache = model.run_with_cache(tokens, names=[name])
        a = cache[name]
        if a.ndim != 3:
            raise Error("heatmap: hook %s is not an [N, T, S] map" % name)
        if head is None:
            maps, titles = a, ["L%d H%d" % (layer, n) for n in range(c.n_head)]
        else:
            maps, titles = a[head : head + 1], ["L%d H%d" % (layer, head)]
        kw.setdefault("title", "%s: %s" % (model.name, name if head is None else "%s head %d" % (name, head)))
    kw.setdefault("diverging", not hook.endswith("pattern"))
    if not kw.get("grid_cols"):  # a near-square grid, not one long strip (32 heads: 6 x 6)
        kw["grid_cols"] = max(1, int(np.ceil(np.sqrt(len(maps)))))
    if hook.endswith("pattern") and not hook.endswith("_composed") and not kw["diverging"]:
        # a softmax pattern: the colour bar starts at 0 (not at the smallest weight seen)
        kw.setdefault("vmin", 0.0)
    return heatmap(maps, tokens=labels, titles=titles, **kw)
