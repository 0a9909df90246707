"""matplotlib versions of the engine's heatmaps, for restyling.

Pure numpy + matplotlib (no engine needed): give them arrays, e.g. from
``model.run_with_cache``. The figures match dclens.heatmaps' PNGs:

- sequential ``viridis`` for patterns in [0, 1], diverging ``RdBu_r``
  centred on zero (symmetric range) for signed quantities;
- the causal upper triangle (s > t) covered by a light grey hatch;
- token labels with leading/trailing spaces shown as a middle dot, newlines
  as a return arrow, long tokens cut with "..", and only every k-th token
  labelled when there are too many;
- each panel its own colour range and colour bar (scale="own", the default),
  or one range and bar for all panels (scale="shared", to compare them).

    import dclens.plots as dp
    fig = dp.plot_heads(cache["blocks.3.attn.pattern"], tokens, "layer 3")
    fig.savefig("layer3.png")

Functions that make a whole figure return a ``matplotlib.figure.Figure``
(a subclass that renders itself as PNG: it shows as the cell's value in
Jupyter with or without ``%matplotlib inline``; it is not registered with
pyplot, so nothing shows twice; in a script, save it with ``fig.savefig``). ``plot_pattern`` draws into an Axes
you give it and returns the image (pass it to ``fig.colorbar``).
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure as _MplFigure
from matplotlib.patches import FancyArrowPatch, Polygon

__all__ = [
    "format_token",
    "plot_pattern",
    "plot_heads",
    "plot_branches",
    "plot_routing",
    "plot_patching",
    "plot_flows",
    "plot_circuit",
    "SEQUENTIAL_CMAP",
    "DIVERGING_CMAP",
]

SEQUENTIAL_CMAP = "viridis"
DIVERGING_CMAP = "RdBu_r"
MASK_FACE = "#d6d6d6"  # the engine's mask grey (214, 214, 214)
MASK_HATCH = "#a8a8a8"  # and its hatch (168, 168, 168)
NAN_COLOR = "#ff00ff"  # NaN cells, as in the engine
MAX_LABEL_CHARS = 12
MAX_LABELS = 48  # per axis; beyond that every k-th token is labelled
MAX_PATCH_LABELS = 160  # positions of a patching plot labelled one by one (the figure widens)


# ---------------------------------------------------------------- helpers


class Figure(_MplFigure):
    """A matplotlib Figure that displays itself in Jupyter (PNG) without
    ``%matplotlib inline`` (IPython finds _repr_png_ on any object)."""

    def _repr_png_(self) -> bytes:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: matplotlib loads when a figure is drawn

        if self.canvas is None or not hasattr(self.canvas, "print_png"):
            FigureCanvasAgg(self)
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100)
        return buf.getvalue()


def format_token(tok, max_chars: int = MAX_LABEL_CHARS) -> str:
    """A token as a tick label: visible leading/trailing spaces ('\u00b7'),
    '\u21b5' for newlines, '\u2192' for tabs, cut to max_chars with '..'.

    Parameters
    ----------
    tok : object
        The token (its str()).
    max_chars : int
        The longest label, in characters (a longer one ends in "..").

    Returns
    -------
    str
        The label; characters that cannot be printed become '\ufffd'.
    """
    s = str(tok)
    s = s.replace("\r\n", "\n").replace("\r", "\n")
    core = s.strip(" ")
    if core:
        lead = len(s) - len(s.lstrip(" "))
        trail = len(s) - len(s.rstrip(" "))
        s = "\u00b7" * lead + core + "\u00b7" * trail
    else:
        s = "\u00b7" * len(s)
    s = s.replace("\n", "\u21b5").replace("\t", "\u2192")
    s = "".join(c if c.isprintable() else "\ufffd" for c in s)
    if len(s) > max_chars:
        s = s[: max(max_chars - 2, 1)] + ".."
    return s


def _as_2d(a, what: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError("%s must be a non-empty [T, S] array, got shape %s" % (what, arr.shape))
    return arr


def _visible(arr: np.ndarray, mask_upper: bool) -> np.ndarray:
    """Finite values that are not under the causal mask."""
    if mask_upper:
        t, s = np.indices(arr.shape[-2:])
        keep = np.broadcast_to(s <= t, arr.shape)
        arr = arr[keep]
    arr = np.asarray(arr, dtype=np.float64).ravel()
    return arr[np.isfinite(arr)]


def _range(arrays, diverging: bool, mask_upper: bool, vmin, vmax) -> tuple[float, float]:
    """The engine's auto range: sequential [min, max], diverging +-max|x|
    (all zero: +-1); computed over unmasked finite cells of all maps."""
    if vmin is not None and vmax is not None:
        if not (np.isfinite(vmin) and np.isfinite(vmax) and vmin < vmax):
            raise ValueError("need finite vmin < vmax, got %r, %r" % (vmin, vmax))
        return float(vmin), float(vmax)
    vals = np.concatenate([_visible(np.asarray(a), mask_upper) for a in arrays])
    if diverging:
        m = float(np.abs(vals).max()) if vals.size else 0.0
        if not m > 0:
            m = 1.0
        lo, hi = -m, m
    elif vals.size == 0:
        lo, hi = 0.0, 1.0
    else:
        lo, hi = float(vals.min()), float(vals.max())
        if not hi > lo:
            d = abs(lo) * 0.1 or 0.5
            lo, hi = lo - d, hi + d
    if vmin is not None:
        lo = float(vmin)
    if vmax is not None:
        hi = float(vmax)
    return lo, hi


def _cmap(diverging: bool):
    return colormaps[DIVERGING_CMAP if diverging else SEQUENTIAL_CMAP].with_extremes(bad=NAN_COLOR)


def _mask_polygon(T: int, S: int) -> np.ndarray | None:
    """Staircase outline of the cells s > t, in imshow data coordinates."""
    n = min(T, S - 1)  # rows that have at least one masked cell
    if n <= 0:
        return None
    pts = [(0.5, -0.5), (S - 0.5, -0.5), (S - 0.5, n - 0.5)]
    for t in range(n - 1, -1, -1):
        pts.append((t + 0.5, t + 0.5))
        pts.append((t + 0.5, t - 0.5))
    return np.array(pts)


def _ticks(n: int, max_labels: int | None) -> range:
    m = MAX_LABELS if max_labels is None else max(int(max_labels), 1)
    return range(0, n, max(1, math.ceil(n / m)))


def _label_size(ax, n: int) -> float:
    """A tick-label font size (points) that fits n labels along the axes' shorter side."""
    fig = ax.get_figure()
    pos = ax.get_position()
    side_in = min(pos.width * fig.get_figwidth(), pos.height * fig.get_figheight())
    return float(min(7.0, max(3.0, 0.8 * side_in * 72 / max(n, 1))))


def _label_axes(
    ax, T: int, S: int, tokens, key_tokens, max_labels, show_rows=True, show_cols=True, size: float | None = None
):
    if size is None:
        size = _label_size(ax, min(max(T, S), MAX_LABELS if max_labels is None else max(int(max_labels), 1)))
    rows = tokens
    cols = key_tokens if key_tokens is not None else (tokens if tokens is not None and len(tokens) == S else None)
    for n, labels, set_ticks, set_labels, axis, rot in (
        (T, rows if show_rows else None, ax.set_yticks, ax.set_yticklabels, "row", 0),
        (S, cols if show_cols else None, ax.set_xticks, ax.set_xticklabels, "column", 90),
    ):
        idx = list(_ticks(n, max_labels))
        set_ticks(idx)
        if labels is None:
            if (axis == "row" and show_rows) or (axis == "column" and show_cols):
                set_labels([str(i) for i in idx], fontsize=size, rotation=rot)
            else:
                set_labels([])
            continue
        labels = list(labels)
        if len(labels) != n:
            raise ValueError("%d %s labels for %d %ss" % (len(labels), axis, n, axis))
        set_labels([format_token(labels[i]) for i in idx], fontsize=size, rotation=rot, family="monospace")
    ax.tick_params(length=2, pad=1)


# ---------------------------------------------------------------- public


def plot_pattern(
    ax,
    pattern,
    tokens: Sequence[str] | None = None,
    title: str | None = None,
    diverging: bool = False,
    mask_upper: bool = True,
    *,
    vmin: float | None = None,
    vmax: float | None = None,
    key_tokens: Sequence[str] | None = None,
    max_labels: int | None = None,
    show_row_labels: bool = True,
    show_col_labels: bool = True,
    label_size: float | None = None,
):
    """Draw one [T, S] map into ax and return the AxesImage.

    The image data is the input itself (masked cells are hidden by a hatched patch, not
    changed).

    Parameters
    ----------
    ax : matplotlib.axes.Axes
        Where to draw.
    pattern : array_like
        [T, S] values (non-empty).
    tokens : sequence of str or None
        Labels of the rows (queries) and, when len(tokens) == S, of the columns (keys).
    title : str or None
        The axes' title.
    diverging : bool
        RdBu_r centred on zero (signed values) rather than viridis.
    mask_upper : bool
        Hatch the causal upper triangle (s > t).
    vmin : float or None
        The low end of the colour range (None: the engine's auto range over the unmasked
        finite cells).
    vmax : float or None
        The high end of the colour range (None: likewise).
    key_tokens : sequence of str or None
        Labels of the columns, explicitly.
    max_labels : int or None
        At most this many labels per axis (every k-th token; None: MAX_LABELS).
    show_row_labels : bool
        Label the rows.
    show_col_labels : bool
        Label the columns.
    label_size : float or None
        The labels' font size in points (None: what fits the axes).

    Returns
    -------
    matplotlib.image.AxesImage
        The image (pass it to fig.colorbar).

    Raises
    ------
    ValueError
        A map that is not a non-empty [T, S] array, labels of the wrong length, or
        vmin / vmax both given but not finite with vmin < vmax.
    """
    a = _as_2d(pattern, "pattern")
    T, S = a.shape
    lo, hi = _range([a], diverging, mask_upper, vmin, vmax)
    im = ax.imshow(a, cmap=_cmap(diverging), vmin=lo, vmax=hi, interpolation="nearest", aspect="equal")
    if mask_upper:
        poly = _mask_polygon(T, S)
        if poly is not None:
            ax.add_patch(
                Polygon(
                    poly,
                    closed=True,
                    facecolor=MASK_FACE,
                    edgecolor=MASK_HATCH,
                    hatch="////",
                    linewidth=0,
                    zorder=im.get_zorder() + 0.5,
                    label="_mask",
                )
            )
    _label_axes(ax, T, S, tokens, key_tokens, max_labels, show_row_labels, show_col_labels, label_size)
    if title is not None:
        ax.set_title(title, fontsize=9, fontweight="bold")
    return im


def plot_heads(
    patterns,
    tokens: Sequence[str] | None = None,
    title: str | None = None,
    *,
    titles: Sequence[str] | None = None,
    ncols: int | None = None,
    diverging: bool = False,
    mask_upper: bool = True,
    vmin: float | None = None,
    vmax: float | None = None,
    max_labels: int | None = None,
    panel_size: float = 2.6,
    scale: str = "own",
    diverging_panels: Sequence[bool] | None = None,
) -> Figure:
    """A grid of [T, S] maps (all heads of a layer, or one head across
    layers).

    Query labels are on the first column of each grid row, key labels under every panel.

    Parameters
    ----------
    patterns : array_like
        [N, T, S]: one map per panel (non-empty).
    tokens : sequence of str or None
        Token labels (rows, and columns when there are S of them).
    title : str or None
        The figure's title.
    titles : sequence of str or None
        One title per panel (default "H0", "H1", ...).
    ncols : int or None
        Panels per grid row (default about sqrt(N), at most 8).
    diverging : bool
        Diverging colours for every panel (unless diverging_panels says otherwise).
    mask_upper : bool
        Hatch the causal upper triangle.
    vmin : float or None
        The low end of the colour range (None: from the data).
    vmax : float or None
        The high end (None: from the data); vmin and vmax both given: one shared scale.
    max_labels : int or None
        At most this many labels per axis.
    panel_size : float
        A panel's side in inches (at least what labels every token needs, up to 6).
    scale : {"own", "shared"}
        "own" (default): each panel its own colour range and colour bar; "shared": one
        range and one bar for all.
    diverging_panels : sequence of bool or None
        Per panel, diverging or sequential colours (default: `diverging` for all).

    Returns
    -------
    Figure
        A matplotlib Figure that shows itself in Jupyter.

    Raises
    ------
    ValueError
        patterns not a non-empty [N, T, S] array, titles or diverging_panels of the wrong
        length, an unknown scale, a shared scale over panels with different colour maps, or
        a bad vmin / vmax.
    """
    p = np.asarray(patterns)
    if p.ndim != 3 or 0 in p.shape:
        raise ValueError("patterns must be a non-empty [N, T, S] array, got shape %s" % (p.shape,))
    N, T, S = p.shape
    if titles is None:
        titles = ["H%d" % i for i in range(N)]
    titles = list(titles)
    if len(titles) != N:
        raise ValueError("%d titles for %d panels" % (len(titles), N))
    if ncols is None:
        ncols = min(N, 8, max(1, math.ceil(math.sqrt(N))))
    ncols = max(1, min(int(ncols), N))
    nrows = math.ceil(N / ncols)
    panel_size = max(panel_size, min(0.075 * max(T, S), 6.0))  # room for a label per token
    shown = min(max(T, S), MAX_LABELS if max_labels is None else max(int(max_labels), 1))
    size = float(min(7.0, max(3.5, 0.85 * panel_size * 72 / shown)))
    if scale not in ("own", "shared"):
        raise ValueError("scale must be 'own' or 'shared', not %r" % (scale,))
    div = [diverging] * N if diverging_panels is None else [bool(d) for d in diverging_panels]
    if len(div) != N:
        raise ValueError("%d diverging_panels for %d panels" % (len(div), N))
    shared = scale == "shared" or (vmin is not None and vmax is not None)
    if shared and len(set(div)) > 1:
        raise ValueError("a shared scale needs one colour map: diverging_panels differ")
    lo, hi = _range(list(p), div[0], mask_upper, vmin, vmax) if shared else (None, None)
    fig = Figure(
        figsize=(panel_size * ncols + (1.2 if shared else 0.9 * ncols), panel_size * nrows + (0.6 if title else 0.2)),
        layout="constrained",
    )
    axes = fig.subplots(nrows, ncols, squeeze=False)
    im, used = None, []
    for i in range(nrows * ncols):
        ax = axes[i // ncols][i % ncols]
        if i >= N:
            fig.delaxes(ax)
            continue
        a, b = (lo, hi) if shared else _range([p[i]], div[i], mask_upper, vmin, vmax)
        im = plot_pattern(
            ax,
            p[i],
            tokens,
            titles[i],
            div[i],
            mask_upper,
            vmin=a,
            vmax=b,
            max_labels=max_labels,
            show_row_labels=(i % ncols == 0),
            label_size=size,
        )
        used.append(ax)
        if not shared:
            fig.colorbar(im, ax=ax, shrink=0.8, pad=0.02)
    if shared:
        assert im is not None  # N >= 1 panels
        fig.colorbar(im, ax=used, shrink=0.8, pad=0.02)
    if title:
        fig.suptitle(title, fontweight="bold")
    return fig


def plot_branches(
    branches: Mapping[str, np.ndarray],
    tokens: Sequence[str] | None = None,
    title: str | None = None,
    *,
    sum_name: str = "sum",
    add_sum: bool = True,
    mask_upper: bool = True,
    vmax: float | None = None,
    max_labels: int | None = None,
    panel_size: float = 2.6,
    scale: str = "own",
) -> Figure:
    """The compose branches of a head side by side with their sum, each on
    its own symmetric diverging scale and colour bar (scale="own": a small
    branch is not washed out by a large one), or all on one (scale="shared":
    +-max|x| over all panels; or +-vmax).

    Parameters
    ----------
    branches : mapping of str to array_like
        Name -> [T, S] (e.g. skip, qp, kp, qg, kg), all of one shape.
    tokens : sequence of str or None
        Token labels.
    title : str or None
        The figure's title.
    sum_name : str
        The title of the sum's panel.
    add_sum : bool
        When `branches` has no entry called sum_name, append the element-wise sum of the
        branches as the last panel.
    mask_upper : bool
        Hatch the causal upper triangle.
    vmax : float or None
        One symmetric range +-|vmax| for every panel (nonzero).
    max_labels : int or None
        At most this many labels per axis.
    panel_size : float
        A panel's side in inches.
    scale : {"own", "shared"}
        "own": each panel its own symmetric range; "shared": +-max|x| over all panels.

    Returns
    -------
    Figure
        One row of panels.

    Raises
    ------
    ValueError
        No branches, maps that are not non-empty [T, S] arrays of one shape, a zero vmax,
        or an unknown scale.
    """
    if not branches:
        raise ValueError("branches is empty")
    names = list(branches.keys())
    maps = [_as_2d(branches[n], "branch %r" % n) for n in names]
    shape = maps[0].shape
    for n, m in zip(names, maps):
        if m.shape != shape:
            raise ValueError("branch %r is %s but %r is %s" % (n, m.shape, names[0], shape))
    if add_sum and sum_name not in branches:
        maps.append(np.sum(np.stack([np.asarray(m, dtype=np.float64) for m in maps]), axis=0))
        names.append(sum_name)
    if vmax is not None:
        hi = float(abs(vmax))
        if not hi > 0:
            raise ValueError("vmax must be nonzero")
        lo = -hi
    elif scale == "shared":
        lo, hi = _range(maps, True, mask_upper, None, None)
    else:
        lo = hi = None  # type: ignore[assignment]  # each panel its own range
    kw: dict[str, Any] = dict(mask_upper=mask_upper, vmin=lo, vmax=hi, max_labels=max_labels, panel_size=panel_size)
    return plot_heads(np.stack(maps), tokens, title, titles=names, ncols=len(maps), diverging=True, scale=scale, **kw)


def plot_routing(
    matrix,
    source_labels: Sequence[str] | None = None,
    target_labels: Sequence[str] | None = None,
    title: str | None = None,
    *,
    diverging: bool | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
    annotate: bool | None = None,
    cell_size: float = 0.35,
) -> Figure:
    """A head-to-head matrix: source heads on rows, target heads on columns.

    Parameters
    ----------
    matrix : array_like
        [sources, targets] values (non-empty), e.g. routing.routing_matrix's [N, N].
    source_labels : sequence of str or None
        Row labels (default "H0", "H1", ...).
    target_labels : sequence of str or None
        Column labels (default "H0", "H1", ...).
    title : str or None
        The axes' title.
    diverging : bool or None
        Diverging colours centred on zero (None: when the matrix has negative entries).
    vmin : float or None
        The low end of the colour range (None: from the data).
    vmax : float or None
        The high end of the colour range (None: from the data).
    annotate : bool or None
        Write the values in the cells (None: when the matrix is at most 12 x 12).
    cell_size : float
        A cell's side in inches.

    Returns
    -------
    Figure
        The matrix with a colour bar.

    Raises
    ------
    ValueError
        A matrix that is not a non-empty 2-D array, labels of the wrong length, or a bad
        vmin / vmax.
    """
    m = _as_2d(matrix, "matrix")
    R, C = m.shape
    if diverging is None:
        diverging = bool(np.nanmin(m) < 0) if np.isfinite(m).any() else False
    lo, hi = _range([m], diverging, False, vmin, vmax)
    if annotate is None:
        annotate = R <= 12 and C <= 12
    src = list(source_labels) if source_labels is not None else ["H%d" % i for i in range(R)]
    tgt = list(target_labels) if target_labels is not None else ["H%d" % i for i in range(C)]
    if len(src) != R or len(tgt) != C:
        raise ValueError("%d source / %d target labels for a %dx%d matrix" % (len(src), len(tgt), R, C))
    w = max(3.0, cell_size * C + 1.8)
    h = max(2.5, cell_size * R + (1.3 if title else 1.0))
    fig = Figure(figsize=(w, h), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(m, cmap=_cmap(diverging), vmin=lo, vmax=hi, interpolation="nearest", aspect="equal")
    ax.set_xticks(range(C))
    ax.set_xticklabels(tgt, rotation=90, fontsize=7)
    ax.set_yticks(range(R))
    ax.set_yticklabels(src, fontsize=7)
    ax.set_xlabel("target head")
    ax.set_ylabel("source head")
    ax.tick_params(length=2, pad=1)
    if annotate:
        cmap = im.get_cmap()
        norm = im.norm
        # Fixed decimals for the matrix's scale: "0.43", "-3.10", "12.5".
        big = float(np.nanmax(np.abs(m[np.isfinite(m)]))) if np.isfinite(m).any() else 1.0
        decimals = min(4, max(0, 2 - int(math.floor(math.log10(big))))) if big > 0 else 2
        for i in range(R):
            for j in range(C):
                v = m[i, j]
                if not np.isfinite(v):
                    continue
                r, g, b, _ = cmap(norm(v))
                dark = 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5
                txt = "%.*f" % (decimals, v)
                if float(txt) == 0:
                    txt = txt.lstrip("-")
                ax.text(j, i, txt, ha="center", va="center", fontsize=6, color="white" if dark else "black")
    fig.colorbar(im, ax=ax, shrink=0.8, pad=0.02)
    if title:
        ax.set_title(title, fontsize=10, fontweight="bold")
    return fig


def _position_labels(result, clab):
    """Tick labels of a "pos" axis: the clean token ("clean|corrupted" where they differ) and
    which of them differ; the position numbers without tokens."""
    words = getattr(result, "pos_tokens", None)
    if not words:
        return list(clab), [False] * len(clab)
    clean, corr = words
    out, diff = [], []
    for c, x in zip(clean, corr):
        out.append(format_token(c) if c == x else "%s|%s" % (format_token(c, 8), format_token(x, 8)))
        diff.append(c != x)
    return out, diff


def plot_patching(result, normalize: bool = False, title: str | None = None, panel_size: float = 3.2) -> Figure:
    """A patching sweep (dclens.patching.PatchResult) as heatmaps: 2-axis
    results in one panel, 3-axis results one panel per entry of the first
    axis (layer). Diverging colours centred on the corrupted metric (or on 0
    when normalize=True: 0 no effect, 1 full recovery). Positions are
    labelled by their token ("clean|corrupted", in red, where the prompts
    differ); the title wraps to the figure's width.

    Parameters
    ----------
    result : dclens.patching.PatchResult
        The sweep's result (2 or 3 axes).
    normalize : bool
        Show result.normalized() (0: no effect, 1: full recovery) rather than the metric.
    title : str or None
        The figure's title (None: "activation patching: " with what was patched and the
        clean and corrupted metrics).
    panel_size : float
        A panel's height in inches (widened to label every column).

    Returns
    -------
    Figure
        One panel (2 axes) or one per entry of the first axis (3 axes), with colour bars.
    """
    v = result.normalized() if normalize else np.asarray(result.values, dtype=np.float64)
    centre = 0.0 if normalize else result.corrupted
    d = v - centre
    m = float(np.nanmax(np.abs(d))) if np.isfinite(d).any() else 1.0
    m = m if m > 0 else 1.0
    panels = [v] if v.ndim == 2 else list(v)
    ptitles = [None] if v.ndim == 2 else ["%s %s" % (result.axes[0], lab) for lab in result.labels[0]]
    rows_ax, cols_ax = (result.axes[0], result.axes[1]) if v.ndim == 2 else (result.axes[1], result.axes[2])
    rlab, clab = (result.labels[0], result.labels[1]) if v.ndim == 2 else (result.labels[1], result.labels[2])
    diff = [False] * len(clab)
    if cols_ax == "pos":
        clab, diff = _position_labels(result, clab)
        cols_ax = "position (token)"
    ncols = min(len(panels), 4)
    nrows = math.ceil(len(panels) / ncols)
    # wide enough for one 7-pt label per column
    width = max(panel_size * ncols, ncols * len(clab) * 0.16) + 1.4
    label_in = 0.07 * max((len(x) for x in clab), default=0) if cols_ax.startswith("position") else 0.0
    fig = Figure(
        figsize=(width, panel_size * nrows * max(0.4, min(1.5, len(rlab) / max(len(clab), 1))) + 1.4 + label_in),
        layout="constrained",
    )
    axes = fig.subplots(nrows, ncols, squeeze=False)
    im = None
    for i in range(nrows * ncols):
        ax = axes[i // ncols][i % ncols]
        if i >= len(panels):
            fig.delaxes(ax)
            continue
        im = ax.imshow(
            panels[i], cmap=_cmap(True), vmin=centre - m, vmax=centre + m, interpolation="nearest", aspect="auto"
        )
        ax.set_yticks(range(len(rlab)))
        ax.set_yticklabels(rlab, fontsize=7)
        step = max(1, math.ceil(len(clab) / MAX_PATCH_LABELS))
        ax.set_xticks(range(0, len(clab), step))
        ax.set_xticklabels(clab[::step], fontsize=7, rotation=90, family="monospace")
        for t, dd in zip(ax.get_xticklabels(), diff[::step]):
            if dd:
                t.set_color("#c00000")
        ax.set_ylabel(rows_ax)
        ax.set_xlabel(cols_ax)
        if ptitles[i]:
            ax.set_title(ptitles[i], fontsize=9)
    assert im is not None  # at least one panel
    fig.colorbar(
        im,
        ax=[a for a in axes.ravel() if a.figure is fig and a in fig.axes],
        shrink=0.8,
        label="normalized metric" if normalize else "metric",
    )
    text = title or "activation patching: %s (clean %.3g, corrupted %.3g)" % (
        result.what,
        result.clean,
        result.corrupted,
    )
    fig.suptitle(textwrap.fill(text, max(20, int(width * 72 / (10 * 0.62)))), fontsize=10, fontweight="bold")
    return fig


def plot_flows(
    F,
    tokens: Sequence[str] | None = None,
    *,
    key: int | None = None,
    branches: Sequence[str] | None = None,
    target: str | None = None,
    title: str | None = None,
    cell_size: float = 0.42,
) -> Figure:
    """Where one composed entry comes from (dclens.routing.flows' array F
    [N source, branch, T key]), two panels:

    - left: source head x key, summed over branches (which head lends at
      which key; masked keys are blank), the detailed key boxed;
    - right: at `key` (default: the key with the largest |composed value|),
      source head x branch with the values written in, and the totals.

    Parameters
    ----------
    F : array_like
        [N source heads, branches, T keys]: what each source head lends through each branch
        at each key (routing.flows).
    tokens : sequence of str or None
        Labels of the T keys.
    key : int or None
        The key of the right panel (negative: from the end; None: the key with the largest
        |composed value|).
    branches : sequence of str or None
        Names of the branch axis (default: skip, qp, kp, qg, kg, and static when F has six,
        as routing.flow_branches gives).
    target : str or None
        The target head's name, for the titles.
    title : str or None
        The figure's title.
    cell_size : float
        A cell's size in inches.

    Returns
    -------
    Figure
        The two panels with colour bars.

    Raises
    ------
    ValueError
        F not a non-empty [N, branches, T] array, branch names or tokens of the wrong
        length, or a key out of range.
    """
    F = np.asarray(F, dtype=np.float64)
    if F.ndim != 3 or 0 in F.shape:
        raise ValueError("F must be a non-empty [N, branches, T] array, got shape %s" % (F.shape,))
    N, B, T = F.shape
    if branches is None:
        branches = ["skip", "qp", "kp", "qg", "kg", "static"][:B] if B in (5, 6) else ["b%d" % i for i in range(B)]
    branches = list(branches)
    if len(branches) != B:
        raise ValueError("%d branch names for %d branches" % (len(branches), B))
    if tokens is not None and len(tokens) != T:
        raise ValueError("%d tokens for %d keys" % (len(tokens), T))
    total = F.sum((0, 1))  # [T]
    if key is None:
        key = int(np.argmax(np.abs(total)))
    if not -T <= key < T:
        raise ValueError("key %d is out of range for %d keys" % (key, T))
    key %= T
    by_key = F.sum(1)  # [N, T]
    shown = np.where((F != 0).any((0, 1)), by_key, np.nan)  # masked keys blank
    detail = F[:, :, key]  # [N, B]
    who = target or "the target head"
    keylab = [format_token(t) for t in tokens] if tokens is not None else [str(i) for i in range(T)]
    w_left = max(3.0, cell_size * 0.55 * T + 1.2)
    w_right = cell_size * (B + 1) + 2.2
    fig = Figure(figsize=(w_left + w_right, max(2.6, cell_size * N + 2.2)), layout="constrained")
    ax0, ax1 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [w_left, w_right]})
    m0 = float(np.nanmax(np.abs(shown))) if np.isfinite(shown).any() else 1.0
    im0 = ax0.imshow(
        shown,
        cmap=_cmap(True).with_extremes(bad="#eeeeee"),
        vmin=-(m0 or 1),
        vmax=m0 or 1,
        interpolation="nearest",
        aspect="auto",
    )
    ax0.add_patch(
        Polygon(
            [(key - 0.5, -0.5), (key + 0.5, -0.5), (key + 0.5, N - 0.5), (key - 0.5, N - 0.5)],
            closed=True,
            fill=False,
            edgecolor="k",
            linewidth=1.2,
        )
    )
    step = max(1, math.ceil(T / MAX_PATCH_LABELS))
    ax0.set_xticks(range(0, T, step))
    ax0.set_xticklabels(keylab[::step], rotation=90, fontsize=6 if T > 40 else 7, family="monospace")
    ax0.set_yticks(range(N))
    ax0.set_yticklabels(["H%d" % n for n in range(N)], fontsize=7)
    ax0.set_xlabel("key")
    ax0.set_ylabel("source head")
    ax0.set_title("what each head lends %s, summed over branches" % who, fontsize=9)
    fig.colorbar(im0, ax=ax0, shrink=0.8, pad=0.01)
    table = np.concatenate(
        [
            np.concatenate([detail, detail.sum(1, keepdims=True)], 1),
            np.concatenate([detail.sum(0), [detail.sum()]])[None],
        ],
        0,
    )  # [N+1, B+1]
    m1 = float(np.abs(detail).max()) or 1.0
    img = table.copy()
    img[N, :] = img[:, B] = np.nan  # totals: written, not coloured
    im1 = ax1.imshow(
        img, cmap=_cmap(True).with_extremes(bad="white"), vmin=-m1, vmax=m1, interpolation="nearest", aspect="auto"
    )
    for i in range(N + 1):
        for j in range(B + 1):
            v = table[i, j]
            txt = "%.3f" % v if abs(v) >= 5e-4 else ("0" if v == 0 else "%.0e" % v)
            ax1.text(
                j,
                i,
                txt,
                ha="center",
                va="center",
                fontsize=6.5,
                fontweight="bold" if (i == N or j == B) else "normal",
                color="white" if (i < N and j < B and abs(v) > 0.6 * m1) else "black",
            )
    ax1.axhline(N - 0.5, color="k", lw=0.8)
    ax1.axvline(B - 0.5, color="k", lw=0.8)
    ax1.set_xticks(range(B + 1))
    ax1.set_xticklabels(branches + ["total"], fontsize=7)
    ax1.set_yticks(range(N + 1))
    ax1.set_yticklabels(["H%d" % n for n in range(N)] + ["total"], fontsize=7)
    ax1.set_xlabel("branch")
    ax1.set_title("at key %d %s: %.3f" % (key, keylab[key], total[key]), fontsize=9)
    fig.colorbar(im1, ax=ax1, shrink=0.8, pad=0.01)
    if title:
        fig.suptitle(title, fontsize=10, fontweight="bold")
    return fig


flows = plot_flows  # its name before plot_flows (routing.flows computes, plots.plot_flows draws)


def plot_circuit(c, title: str | None = None) -> Figure:
    """A circuit (dclens.graph.Circuit) as a layered picture: the embedding at
    the bottom, a row per layer (its heads and MLP), the logits at the top;
    residual edges as lines between rows, composition edges as arcs inside a
    row (orange: lending through qp / kp / static; a head's own branches as
    an orange ring on the head); widths by |score|, colour by sign (blue +,
    red -).

    Parameters
    ----------
    c : dclens.graph.Circuit
        The circuit (its graph, edges and, if any, scores).
    title : str, optional
        The figure's title (None: the number of edges, and of those the
        composition edges).

    Returns
    -------
    Figure
        The picture (shown inline in a notebook).
    """
    g = c.graph
    L, N = g.n_layer, g.n_head
    xy: dict[str, tuple[float, float]] = {"embed": (N / 2, 0.0), "logits": (N / 2, L + 1.0)}
    for l in range(L):
        for h in range(N):
            xy["L%d.H%d" % (l, h)] = (float(h), l + 1.0)
        xy["L%d.mlp" % l] = (N + 0.8, l + 1.35)
        xy["L%d.dyn" % l] = (-0.8, l + 1.35)
    scores = c.scores or {}
    top = max([abs(v) for v in scores.values()] + [1e-12])
    fig = Figure(figsize=(max(6.0, 0.7 * N + 2.5), 1.1 * L + 2.5), layout="constrained")
    ax = fig.subplots()
    used = set()
    for name in sorted(c.edges):
        d = g.detail[name]
        src = xy[d.sender]
        dst = xy[d.node]
        used.update([d.sender, d.node])
        v = scores.get(name, 1.0 if not scores else 0.0)
        w = 0.5 + 3.5 * abs(v) / top
        if d.kind == "comp":
            own = not d.lends
            col = "#999999" if own else "#e08a00"
            if own:
                continue  # a head's own branches: drawn as the head's ring below
            arc: dict[str, Any] = dict(connectionstyle="arc3,rad=0.45", alpha=0.85)  # lending, in a layer
            ax.add_patch(FancyArrowPatch(src, dst, arrowstyle="-|>", mutation_scale=8, lw=w, color=col, **arc))
        else:
            col = "#2060c0" if v >= 0 else "#c03030"
            ax.add_patch(
                FancyArrowPatch(
                    src, dst, arrowstyle="-|>", mutation_scale=8, lw=w, color=col, alpha=0.55, shrinkA=6, shrinkB=6
                )
            )
    own_heads = {g.detail[e].node for e in c.edges if g.detail[e].kind == "comp" and not g.detail[e].lends}
    for n, (x, y) in xy.items():
        on = n in used or n in own_heads
        ax.scatter(
            [x],
            [y],
            s=140 if on else 40,
            c="#333333" if on else "#dddddd",
            zorder=3,
            edgecolors="#e08a00" if n in own_heads else "none",
            linewidths=2,
        )
        if on:
            ax.annotate(
                n if "." not in n else n.split(".", 1)[1],
                (x, y),
                xytext=(0, 7),
                textcoords="offset points",
                ha="center",
                fontsize=7,
            )
    ax.set_yticks(range(L + 2))
    ax.set_yticklabels(["embed"] + ["layer %d" % l for l in range(L)] + ["logits"], fontsize=8)
    ax.set_xticks([])
    ax.set_xlim(-1, N + 2)
    ax.set_ylim(-0.6, L + 1.6)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(
        title
        or "circuit: %d edges (%d composition)" % (len(c.edges), sum(1 for e in c.edges if g.detail[e].kind == "comp")),
        fontsize=10,
    )
    return fig
