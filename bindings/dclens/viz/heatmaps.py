"""Attention heatmaps rendered to PNG by the engine (libpng, built-in font).

    img = dclens.attention_heatmap(model, "The cat sat on the mat", layer=1)
    img                      # a Heatmap: displays inline in Jupyter (_repr_png_)
    img.save("layer1.png")   # writes the PNG; bytes(img) is the same PNG bytes, img.size (w, h)

attention_heatmap's default picture is at most MAX_WIDTH (1800) pixels wide,
so it reads at 100% with every token labelled: the near-square grid of panels
with cells shrunk down to a text line, then fewer panels a row (grid_cols= and
cell_px= set either yourself).

Sequential colours (viridis-like) for patterns in [0, 1]; a diverging map
centred on zero for signed quantities (scores, compose branches, composed
weights). Each panel has its own colour range and colour bar (scale="own",
the default), or all share one (scale="shared", to compare them). Every
token is labelled: a prompt longer than AUTO_WINDOW tokens is shown as a
window of positions up to the query (the title says which; window= /
positions= choose), and one longer than MAX_TOKENS needs window= or
positions=. matplotlib versions of the same figures are in dclens.plots.
"""

from __future__ import annotations

import inspect
import math
import os
import struct
from collections.abc import Sequence

import numpy as np

from .._core.binding import ffi, lib
from .._core.checks import (
    ArgumentTypeError,
    c_path,
    check_bool,
    check_index,
    check_str,
    is_choice,
    is_finite_number,
    show_path,
    token_array,
)
from .._core.mask import allowed, layer_window
from .._core.names import BRANCHES, hook_name
from ..model import Error, Model

SEQUENTIAL, DIVERGING = 0, 1
AUTO_WINDOW = 64  # longer prompts: a window of this many positions up to the query, unless told
MAX_TOKENS = 512  # longer prompts are refused without window= or positions=
MAX_WIDTH = 1800  # attention_heatmap's default picture: at most this wide where every token stays labelled
MIN_CELL = 10  # the engine's text line (DCS_FONT_LINE): the smallest cell with every token labelled


class PNG:
    """A PNG picture: shows itself in Jupyter (_repr_png_), bytes(png) is the
    PNG file's bytes, png.save(path) writes them, png.size is (width, height).

    Parameters
    ----------
    data : bytes
        The PNG file's bytes (kept as .data).
    """

    def __init__(self, data: bytes):
        self.data = data

    def _repr_png_(self) -> bytes:
        return self.data

    def __bytes__(self) -> bytes:
        return self.data

    def __len__(self) -> int:
        return len(self.data)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels, from the PNG header."""
        w, h = struct.unpack(">II", self.data[16:24])
        return int(w), int(h)

    def __repr__(self) -> str:
        return "<dclens.%s %dx%d PNG, %d bytes>" % ((type(self).__name__,) + self.size + (len(self.data),))

    def save(self, path: str | os.PathLike) -> str:
        """Write the PNG to a file.

        Parameters
        ----------
        path : str or os.PathLike
            The file to write (replaced if it exists).

        Returns
        -------
        str
            The path written, as text.

        Raises
        ------
        dclens.Error
            `path` is not a path (dclens.ArgumentTypeError) or holds a NUL, or the file
            cannot be written (the message names the path and the system's reason).
        """
        c_path("save: path", path)  # a path, or an Error naming it
        path = show_path(path)
        try:
            with open(path, "wb") as f:
                f.write(self.data)
        except OSError as e:
            raise Error("%s: cannot write the PNG: %s" % (path, e.strerror or e)) from e
        return path


def colormap_rgb(value: float, vmin: float, vmax: float, diverging: bool = False) -> tuple:
    """The engine's colour for a value (for tests and legends).

    Parameters
    ----------
    value : float
        The value.
    vmin : float
        The low end of the colour range.
    vmax : float
        The high end of the colour range.
    diverging : bool
        The diverging map (centred on zero, for signed values) rather than the sequential
        one (viridis-like).

    Returns
    -------
    tuple of int
        (red, green, blue), each in [0, 255].
    """
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
    scale="own",
    panel_diverging=None,
    panel_vmin=None,
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
        if isinstance(strs, (str, bytes)) or not isinstance(strs, (list, tuple, np.ndarray)):
            raise Error(
                "heatmap: the %s labels (tokens / key_tokens) must be a list of strings, not %s %r"
                % (what, type(strs).__name__, strs)
            )
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
    if scale not in ("own", "shared"):
        raise Error("heatmap: scale must be 'own' or 'shared', not %r" % (scale,))
    own = scale == "own" and not (vmin is not None and vmax is not None)
    if panel_diverging is not None:
        panel_diverging = [bool(d) for d in panel_diverging]
        if len(panel_diverging) != P:
            raise Error("heatmap: %d panel_diverging for %d panels" % (len(panel_diverging), P))
        if not own and len(set(panel_diverging)) > 1:
            raise Error("heatmap: panels with different colour maps need scale='own'")
    if panel_vmin is not None:
        panel_vmin = list(panel_vmin)
        if len(panel_vmin) != P:
            raise Error("heatmap: %d panel_vmin for %d panels" % (len(panel_vmin), P))
    for i in range(P):
        if panel_windows is not None:
            w = panel_windows[i]
            panels[i].mask_window = -1 if not w or w <= 0 else int(w)
        if own and panel_diverging is not None:
            panels[i].own_colormap = 1
            panels[i].colormap = DIVERGING if panel_diverging[i] else SEQUENTIAL
        lo = vmin if panel_vmin is None or panel_vmin[i] is None else panel_vmin[i]
        if own and (lo is not None or vmax is not None):
            # one end fixed (a softmax pattern from 0), the other from this panel's data
            lo, hi = _one_end(a[i], mask_upper, lo, vmax)
            panels[i].own_range, panels[i].vmin, panels[i].vmax = 1, lo, hi
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
    spec.panel_scales = 1 if own else 0
    if title is not None:
        spec.title = cstr(title)
    return spec, keep


def _one_end(maps, mask_upper: bool, vmin, vmax):
    """(vmin, vmax) with a missing end taken from the visible data."""
    if vmin is not None and vmax is not None:
        return float(vmin), float(vmax)
    vis = _visible_values(maps, mask_upper)
    if vmin is None:
        vmin = float(vis.min()) if vis.size else 0.0
        if not vmin < vmax:
            vmin = vmax - 1.0
    else:
        vmax = float(vis.max()) if vis.size else 1.0
        if not vmax > vmin:
            vmax = vmin + 1.0
    return float(vmin), float(vmax)


class Heatmap(PNG):
    """A rendered heatmap (what heatmap and attention_heatmap return): a PNG
    (bytes(h) the PNG bytes, h.save(path), h.size, inline in Jupyter) plus
    the geometry of its cells (cell_box).

    Parameters
    ----------
    data : bytes
        The PNG file's bytes.
    args : dict
        heatmap's checked arguments, from which cell_box recomputes the layout.
    """

    def __init__(self, data: bytes, args: dict):
        super().__init__(data)
        self._args = args

    def cell_box(self, panel: int, t: int, s: int):
        """Where a cell of a panel is in the picture.

        Parameters
        ----------
        panel : int
            The panel, in [0, P).
        t : int
            The cell's row (query position), in [0, T).
        s : int
            The cell's column (key position), in [0, S).

        Returns
        -------
        tuple of int
            (x, y, side): the cell's top-left corner and its side, in pixels.

        Raises
        ------
        dclens.Error
            A panel or cell outside the picture (the engine's message).
        """
        spec, _keep = _spec(**self._args)
        x, y, c = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
        err = ffi.new("char[]", 512)
        if lib.dcs_heatmap_geometry(spec, panel, t, s, ffi.NULL, ffi.NULL, x, y, c, err, 512) != lib.DCS_OK:
            raise Error(ffi.string(err).decode(errors="replace"))
        return x[0], y[0], c[0]


def heatmap(
    maps,
    *,
    tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    titles: Sequence[str] | None = None,
    title: str | None = None,
    diverging: bool = False,
    mask_upper: bool = True,
    vmin: float | None = None,
    vmax: float | None = None,
    grid_cols: int = 0,
    cell_px: int = 0,
    mask_window: int = 0,
    panel_windows: Sequence[int] | None = None,
    axis_titles: bool = True,
    scale: str = "own",
    panel_diverging: Sequence[bool] | None = None,
    panel_vmin: Sequence[float | None] | None = None,
) -> Heatmap:
    """Render one [T, S] map or a stack [P, T, S] of them as a grid of panels.

    Parameters
    ----------
    maps : array_like
        [T, S] or [P, T, S] numbers (non-empty); non-finite cells are drawn as missing.
    tokens : sequence of str or None
        Labels of the rows (queries) and, unless key_tokens is given, of the columns.
    key_tokens : sequence of str or None
        Labels of the columns (keys).
    titles : sequence of str or None
        One title per panel.
    title : str or None
        The picture's title.
    diverging : bool
        A diverging map centred on zero (signed values) rather than the sequential one.
    mask_upper : bool
        Hatch the causal upper triangle (s > t).
    vmin : float or None
        The low end of the colour range (None: from the data). vmin or vmax alone fixes
        that end; the other comes from the data (each panel's own, with scale="own").
    vmax : float or None
        The high end of the colour range (None: from the data).
    grid_cols : int
        Panels per grid row (0: all in one row).
    cell_px : int
        Pixels per cell (0: chosen from the size).
    mask_window : int
        > 0: also hatch the cells with t - s > mask_window (a local-attention layer).
    panel_windows : sequence of int or None
        Each panel's own window (0 or None: global).
    axis_titles : bool
        Label the rows "query" and the columns "key".
    scale : {"own", "shared"}
        "own" (default): each panel its own colour range and colour bar; "shared": one
        range and bar for all (vmin and vmax both given: shared).
    panel_diverging : sequence of bool or None
        Per panel, diverging or sequential colours (scale="own").
    panel_vmin : sequence of float or None
        Per panel, a fixed low end of the range (None: from the data).

    Returns
    -------
    Heatmap
        bytes(h) is the PNG, h.save(path) writes it, h.size is (width, height), and it
        shows itself in Jupyter (_repr_png_).

    Raises
    ------
    dclens.Error
        maps that are not a non-empty [T, S] / [P, T, S] array of numbers, a non-finite
        vmin / vmax, a flag that is not a bool, a negative grid_cols, cell_px or
        mask_window, labels or per-panel lists of the wrong length, or a picture the engine
        refuses (too large).
    """
    return _render(_heatmap_args(dict(locals())))  # locals(): exactly heatmap's arguments


# heatmap's keyword arguments and their defaults (what _fit starts from)
_HEATMAP_DEFAULTS = {k: p.default for k, p in inspect.signature(heatmap).parameters.items() if p.kind is p.KEYWORD_ONLY}


def _heatmap_args(a: dict) -> dict:
    """heatmap's arguments (a dict holding each of them) checked: the keywords of _spec."""
    a = dict(a)
    try:
        a["maps"] = np.asarray(a["maps"], dtype=np.float32)
    except (TypeError, ValueError, OverflowError) as e:
        raise Error("heatmap: maps must be a [T, S] or [P, T, S] array of numbers: %s" % e) from None
    for what in ("vmin", "vmax"):
        if a[what] is not None and not is_finite_number(a[what]):
            raise Error("heatmap: %s must be a finite number or None, not %r" % (what, a[what]))
    for what in ("diverging", "mask_upper", "axis_titles"):
        check_bool("heatmap: " + what, a[what])
    # the engine takes C ints: larger values are refused here, by name
    for what, note in (("mask_window", "none"), ("grid_cols", "one row"), ("cell_px", "chosen from the size")):
        check_index("heatmap: " + what, a[what], 0, 2**31, " (0: %s)" % note)
    if (a["vmin"] is None) != (a["vmax"] is None) and a["scale"] != "own":
        a["vmin"], a["vmax"] = _one_end(a["maps"], a["mask_upper"], a["vmin"], a["vmax"])
    return a


def _geometry(args: dict) -> tuple[int, int, int] | None:
    """(width, height, cell) of the picture heatmap would draw, without drawing it; None where the
    engine refuses it (too large)."""
    spec, _keep = _spec(**args)
    w, h, c = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
    if lib.dcs_heatmap_geometry(spec, 0, 0, 0, w, h, ffi.NULL, ffi.NULL, c, ffi.NULL, 0) != lib.DCS_OK:
        return None
    return w[0], h[0], c[0]


def _render(args: dict) -> Heatmap:
    spec, _keep = _spec(**args)
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
        a = a[..., allowed(*a.shape[-2:])]
    a = a.ravel()
    return a[np.isfinite(a)]


def _view(T: int, query, window, positions):
    """The [a, b) range of positions a heatmap shows, and a note saying which (None: all)."""
    if positions is not None:
        if window is not None:
            raise Error("heatmap: give positions= or window=, not both")
        if isinstance(positions, slice):
            positions = range(T)[positions]
        if isinstance(positions, tuple) and len(positions) == 2:  # (start, stop)
            positions = range(*positions) if all(isinstance(p, (int, np.integer)) for p in positions) else None
        try:
            pos = list(positions)
        except TypeError:
            pos = []
        if (
            not pos
            or any(not isinstance(p, (int, np.integer)) for p in pos)
            or pos != list(range(pos[0], pos[0] + len(pos)))
            or not 0 <= pos[0] <= pos[-1] < T
        ):
            raise Error(
                "heatmap: positions must be (start, stop), a range, a slice or a list of consecutive "
                "positions within the %d tokens" % T
            )
        a, b = int(pos[0]), int(pos[-1]) + 1
        return a, b, "positions %d-%d of %d" % (a, b - 1, T) if (a, b) != (0, T) else None
    q = T - 1 if query is None else check_index("heatmap: query", query, -T, T, " for %d tokens" % T) % T
    if window is None:
        if T > MAX_TOKENS:
            raise Error(
                "heatmap: the prompt has %d tokens, more than the %d a readable heatmap shows (every "
                "token labelled); pass window=%d (the %d positions up to query=, default the last) or "
                "positions=(start, stop)" % (T, MAX_TOKENS, AUTO_WINDOW, AUTO_WINDOW)
            )
        if T <= AUTO_WINDOW:
            return 0, T, None
        window = AUTO_WINDOW
    window = check_index("heatmap: window", window, 1, 1 << 30)
    a, b = max(0, q + 1 - window), q + 1
    if (a, b) == (0, T):
        return 0, T, None
    return a, b, "positions %d-%d of %d, up to the query %d (window=%d)" % (a, b - 1, T, q, window)


def _grid_choices(n: int, first: int) -> list:
    """Items a grid row, from `first` down to 1, each the fewest for its number of rows."""
    out: list = []
    for rows in range(math.ceil(n / first), n + 1):
        k = math.ceil(n / rows)
        if k not in out:
            out.append(k)
    return out


def _fit(maps: np.ndarray, kw: dict, per: int, first: int, fit_cols: bool, fit_cell: bool) -> tuple[int, int]:
    """grid_cols and cell_px (those the caller left unset) for a picture at most MAX_WIDTH wide
    with every token labelled: `first` items a row with the cells shrunk down to MIN_CELL, then
    fewer items a row (an item: `per` panels side by side, a head's pattern and composed map).
    Where nothing fits: `first` items a row and the engine's cell."""
    cols = [per * k for k in _grid_choices(len(maps) // per, first)] if fit_cols else [kw["grid_cols"]]

    def size(gc, cell):
        return _geometry(_heatmap_args({**_HEATMAP_DEFAULTS, **kw, "maps": maps, "grid_cols": gc, "cell_px": cell}))

    for gc in cols:
        if fit_cell:  # from the engine's cell down to a text line (or the engine's, if smaller)
            auto = size(gc, 0)
            cells: Sequence[int] = [] if auto is None else range(auto[2], min(auto[2], MIN_CELL) - 1, -1)
        else:
            cells = [kw["cell_px"]]
        for cell in cells:
            g = size(gc, cell)
            if g is not None and g[0] <= MAX_WIDTH:
                return gc, cell
    return cols[0], 0 if fit_cell else kw["cell_px"]


# what attention_heatmap passes on to heatmap (it sets tokens, titles and panel_diverging itself)
_PASSED_ON = (
    "key_tokens",
    "title",
    "diverging",
    "mask_upper",
    "vmin",
    "vmax",
    "grid_cols",
    "cell_px",
    "mask_window",
    "panel_windows",
    "axis_titles",
    "scale",
    "panel_vmin",
)


def _prompt_tokens(model: Model, text_or_tokens) -> np.ndarray:
    """The [T] tokens of attention_heatmap's prompt (a string or token ids), checked."""
    if isinstance(text_or_tokens, str):
        if not text_or_tokens:
            raise Error("heatmap: the text is empty")
        tokens = model.to_tokens(text_or_tokens)
    else:
        tokens = token_array(text_or_tokens)
    if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
        raise Error(
            "heatmap: tokens must be a string or a non-empty 1-D integer token array, got %s %s"
            % (tokens.dtype, tokens.shape)
        )
    return tokens


def _branch_maps(model: Model, tokens, layer, head: int | None, phase: str) -> tuple[list[np.ndarray], list[str], str]:
    """hook="branches": one head's compose branches of `phase` and their sum,
    their titles and the picture's."""
    if head is None or layer == "all":
        raise Error("heatmap: hook='branches' needs one layer and one head")
    if not is_choice(phase, ("pre", "post")):
        raise Error("heatmap: phase must be 'pre' or 'post'")
    names = [hook_name(layer, "attn.%s.%s" % (phase, b_)) for b_ in BRANCHES + ("static",)]
    names = [n for n in names if n in model.hook_names]
    total = hook_name(layer, "attn.%s" % ("scores_composed" if phase == "pre" else "pattern_composed"))
    _, cache = model.run_with_cache(tokens, names=names + [total])
    maps = [cache[n][head] for n in names] + [cache[total][head]]
    titles = [n.rsplit(".", 1)[1] for n in names] + ["sum"]
    return maps, titles, "%s: L%s H%d %s-compose branches" % (model.name, layer, head, phase)


def _hook_maps(model: Model, tokens, layer, head: int | None, hooks: list[str], pair: bool):
    """The panels of `hooks` for every head (or `head`) of `layer` (or of every
    layer, layer="all"): maps, titles, windows, diverging or not, and the low
    end of each colour bar (0 for a softmax pattern, else None)."""
    c = model.config
    if pair and not c.use_dcmha:
        raise Error("heatmap: %s has no composed weights (plain multi-head attention): use hook='pattern'" % model.name)
    layers = list(range(c.n_layer)) if layer == "all" else [layer]
    if layer == "all" and head is None:
        raise Error("heatmap: layer='all' needs a head")
    names = [hook_name(l, "attn.%s" % h) for l in layers for h in hooks]
    for n in names:
        model.parse_hook(n)
    _, cache = model.run_with_cache(tokens, names=names)
    heads = list(range(c.n_head)) if head is None else [head]
    maps: list[np.ndarray] = []
    titles: list[str] = []
    windows: list[int] = []
    div: list[bool] = []
    low: list[float | None] = []
    for l in layers:
        for h in heads:
            for hk in hooks:
                arr = cache[hook_name(l, "attn.%s" % hk)]
                if arr.ndim != 3:
                    raise Error("heatmap: hook %s is not an [N, T, S] map" % hook_name(l, "attn.%s" % hk))
                maps.append(arr[h])
                what = {"pattern": "softmax", "pattern_composed": "composed"}.get(hk, hk) if pair else ""
                titles.append(
                    ("L%s H%d %s" % (l, h, what)).strip()
                    + (" (local)" if layer == "all" and l in c.local_layers else "")
                )
                windows.append(layer_window(model, l))
                softmax = hk.endswith("pattern") and not hk.endswith("_composed")
                div.append(not softmax)
                low.append(0.0 if softmax else None)  # a softmax pattern's colour bar starts at 0
    return maps, titles, windows, div, low


def attention_heatmap(
    model: Model,
    text_or_tokens,
    layer: int | str = 0,
    head: int | None = None,
    hook: str | None = None,
    phase: str = "post",
    *,
    query: int | None = None,
    window: int | None = None,
    positions=None,
    **kw,
) -> Heatmap:
    """Heatmaps of a model's attention on a prompt.

    - layer=L, head=None: every head of layer L for `hook` (pattern,
      pattern_composed, scores, scores_composed, pre.kp, post.qg, ...);
      the default for DCPythia shows each head's composed weights (the
      weights the model applies to v) beside its softmax pattern, for Pythia
      the pattern;
    - layer="all", head=H: head H across all layers;
    - hook="branches", layer=L, head=H: the compose branches of `phase` (five;
      six with use_sw) side by side with their sum.
    Each panel has its own colour range and bar (scale="shared" to compare);
    every token is labelled. A prompt of more than AUTO_WINDOW (64) tokens
    shows the `window` positions up to `query` (default: the last token) and
    says which in the title; positions=(start, stop) picks another range;
    more than MAX_TOKENS (512) tokens needs one of them. Local layers'
    windows are hatched; a softmax pattern's colour bar starts at 0.

    Size: the picture is at most MAX_WIDTH (1800) pixels wide, so it reads
    at 100%: panels go in a near-square grid (the branches in one row) with
    cells shrunk down to a text line (MIN_CELL, 10 px: every token still
    labelled), then in fewer columns (a head's pattern stays beside its
    composed map); grid_cols= and cell_px= fix either (then only the other is
    chosen). Only where even one item a row at 10-px cells is wider (a
    window of more than about 70 tokens) is the picture wider.

    Parameters
    ----------
    model : dclens.Model
        The model.
    text_or_tokens : str or array_like of int
        The prompt: a non-empty string, or [T] token ids.
    layer : int or "all"
        The layer, or "all" (with a head) for one head across every layer.
    head : int or None
        One head, or None for every head of the layer.
    hook : str or None
        What to draw: "pattern", "pattern_composed", "scores", "scores_composed", a branch
        ("pre.kp", "post.qg", ...), "branches" (the compose branches of `phase` and their
        sum), or "pattern+composed"; None: "pattern+composed" for a DCMHA model, else
        "pattern".
    phase : {"pre", "post"}
        The compose phase of hook="branches".
    query : int or None
        The query position the window ends at (negative: from the end; None: the last).
    window : int or None
        Show the `window` positions up to `query` (None: all of a prompt up to AUTO_WINDOW
        tokens, else AUTO_WINDOW).
    positions : tuple or range or slice or list of int or None
        The consecutive positions to show instead: (start, stop), a range, a slice or a list.
    **kw
        Passed on to heatmap(): key_tokens, title, diverging, mask_upper, vmin, vmax,
        grid_cols, cell_px, mask_window, panel_windows, axis_titles, scale, panel_vmin.

    Returns
    -------
    Heatmap
        The picture, as heatmap() returns it (bytes(h), h.save(path), h.size, inline).

    Raises
    ------
    dclens.ArgumentTypeError
        A keyword argument heatmap() does not take.
    dclens.Error
        An empty prompt or bad tokens, a layer or head out of range, an unknown hook,
        hook="branches" without one layer and one head, layer="all" without a head,
        composed weights asked of a plain-MHA model, both window= and positions=, a prompt
        over MAX_TOKENS without either, or one scale for maps that need their own.
    """
    unknown = sorted(set(kw) - set(_PASSED_ON))
    if unknown:
        raise ArgumentTypeError(
            "heatmap: unknown keyword argument %s (attention_heatmap passes on %s)"
            % (", ".join(unknown), ", ".join(_PASSED_ON))
        )
    fit_cols, fit_cell = not kw.get("grid_cols"), not kw.get("cell_px")
    tokens = _prompt_tokens(model, text_or_tokens)
    a, b, note = _view(tokens.size, query, window, positions)  # refuse before any pass
    try:
        labels = model.to_str_tokens(tokens)
    except Error:
        labels = [str(int(t)) for t in tokens]
    labels = labels[a:b]
    c = model.config
    if hook is not None:
        hook = check_str("heatmap: hook", hook)
    if head is not None:
        head = check_index("heatmap: head", head, 0, c.n_head, " (model has %d heads)" % c.n_head)
    if not is_choice(layer, ("all",)):
        layer = check_index("heatmap: layer", layer, 0, c.n_layer, " (model has %d layers)" % c.n_layer)
        if layer_window(model, layer):
            kw.setdefault("mask_window", layer_window(model, layer))
    if hook is None:
        hook = "pattern+composed" if c.use_dcmha and hook != "branches" else "pattern"
    view = lambda m: m[..., a:b, a:b]

    def draw(maps, per: int, first: int, **opts) -> Heatmap:  # heatmap() with the default size fitted
        stack = np.ascontiguousarray(view(np.stack(maps)), dtype=np.float32)
        if fit_cols or fit_cell:
            opts["grid_cols"], opts["cell_px"] = _fit(stack, opts, per, first, fit_cols, fit_cell)
        return heatmap(stack, **opts)

    def titled(t):
        return t if note is None else "%s; %s" % (t, note)

    if hook == "branches":
        maps, titles, default_title = _branch_maps(model, tokens, layer, head, phase)
        kw["title"] = titled(kw.get("title", default_title))
        return draw(maps, 1, len(maps), tokens=labels, titles=titles, diverging=True, **kw)

    pair = hook == "pattern+composed"
    hooks = ["pattern", "pattern_composed"] if pair else [hook]
    maps, titles, windows, div, low = _hook_maps(model, tokens, layer, head, hooks, pair)
    if layer == "all":
        kw.setdefault("panel_windows", windows)
        default_title = "%s: head %s across layers: %s" % (model.name, head, hook)
    elif pair:
        default_title = "%s: layer %s, %s: softmax pattern | composed weights (applied to v)" % (
            model.name,
            layer,
            "every head" if head is None else "head %d" % head,
        )
    else:
        name = hook_name(layer, "attn.%s" % hook)
        default_title = "%s: %s" % (model.name, name if head is None else "%s head %d" % (name, head))
    kw["title"] = titled(kw.get("title", default_title))
    per = len(hooks)  # a near-square grid (32 heads: 6 x 6) where it fits, a pattern beside its composed map
    first = max(1, math.ceil(math.sqrt(len(maps) / per)))
    if "diverging" in kw:
        div = [bool(kw["diverging"])] * len(maps)
    else:
        kw["diverging"] = div[0]
    if kw.get("scale", "own") == "shared" or (kw.get("vmin") is not None and kw.get("vmax") is not None):
        if len(set(div)) > 1:
            raise Error(
                "heatmap: the softmax pattern and the composed weights need their own scales (scale='own') or one hook"
            )
        if not kw["diverging"] and low[0] == 0.0:
            kw.setdefault("vmin", 0.0)
        return draw(maps, per, first, tokens=labels, titles=titles, **kw)
    if kw.get("vmin") is None and not kw["diverging"]:
        kw["panel_vmin"] = low
    return draw(maps, per, first, tokens=labels, titles=titles, panel_diverging=div, **kw)
