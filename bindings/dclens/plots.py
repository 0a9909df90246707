"""matplotlib versions of the engine's heatmaps, for restyling.

Pure numpy + matplotlib (no engine needed): give them arrays, e.g. from
``model.run_with_cache``. The figures match dclens.heatmaps' PNGs:

- sequential ``viridis`` for patterns in [0, 1], diverging ``RdBu_r``
  centred on zero (symmetric range) for signed quantities;
- the causal upper triangle (s > t) covered by a light grey hatch;
- token labels with leading/trailing spaces shown as a middle dot, newlines
  as a return arrow, long tokens cut with "..", and only every k-th token
  labelled when there are too many;
- one shared colour bar per figure.

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

import math
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure as _MplFigure
from matplotlib.patches import Polygon

__all__ = [
    "format_token",
    "plot_pattern",
    "plot_heads",
    "plot_branches",
    "plot_routing",
    "plot_patching",
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


# ---------------------------------------------------------------- helpers


class Figure(_MplFigure):
    """A matplotlib Figure that displays itself in Jupyter (PNG) without
    ``%matplotlib inline`` (IPython finds _repr_png_ on any object)."""

    def _repr_png_(self) -> bytes:
        import io
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        if self.canvas is None or not hasattr(self.canvas, "print_png"):
            FigureCanvasAgg(self)
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100)
        return buf.getvalue()


def format_token(tok, max_chars: int = MAX_LABEL_CHARS) -> str:
    """A token as a tick label: visible leading/trailing spaces ('\u00b7'),
    '\u21b5' for newlines, '\u2192' for tabs, cut to max_chars with '..'."""
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


def _range(arrays, diverging: bool, mask_upper: bool, vmin, vmax) -> Tuple[float, float]:
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


def _mask_polygon(T: int, S: int) -> Optional[np.ndarray]:
    """Staircase outline of the cells s > t, in imshow data coordinates."""
    n = min(T, S - 1)  # rows that have at least one masked cell
    if n <= 0:
        return None
    pts = [(0.5, -0.5), (S - 0.5, -0.5), (S - 0.5, n - 0.5)]
    for t in range(n - 1, -1, -1):
        pts.append((t + 0.5, t + 0.5))
        pts.append((t + 0.5, t - 0.5))
    return np.array(pts)


def _ticks(n: int, max_labels: Optional[int]) -> range:
    m = MAX_LABELS if max_labels is None else max(int(max_labels), 1)
    return range(0, n, max(1, math.ceil(n / m)))


def _label_axes(ax, T: int, S: int, tokens, key_tokens, max_labels, show_rows=True, show_cols=True):
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
                set_labels([str(i) for i in idx], fontsize=7, rotation=rot)
            else:
                set_labels([])
            continue
        labels = list(labels)
        if len(labels) != n:
            raise ValueError("%d %s labels for %d %ss" % (len(labels), axis, n, axis))
        set_labels([format_token(labels[i]) for i in idx], fontsize=7, rotation=rot, family="monospace")
    ax.tick_params(length=2, pad=1)


# ---------------------------------------------------------------- public


def plot_pattern(
    ax,
    pattern,
    tokens: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    diverging: bool = False,
    mask_upper: bool = True,
    *,
    vmin: Optional[float] = None,
    vmax: Optional[float] = None,
    key_tokens: Optional[Sequence[str]] = None,
    max_labels: Optional[int] = None,
    show_row_labels: bool = True,
    show_col_labels: bool = True,
):
    """Draw one [T, S] map into ax and return the AxesImage.

    tokens label the rows (queries) and, when len(tokens) == S, the columns
    (keys); key_tokens labels the columns explicitly. The image data is the
    input itself (masked cells are hidden by a hatched patch, not changed).
    vmin/vmax default to the engine's auto range over unmasked cells."""
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
    _label_axes(ax, T, S, tokens, key_tokens, max_labels, show_row_labels, show_col_labels)
    if title is not None:
        ax.set_title(title, fontsize=9, fontweight="bold")
    return im


def plot_heads(
    patterns,
    tokens: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    *,
    titles: Optional[Sequence[str]] = None,
    ncols: Optional[int] = None,
    diverging: bool = False,
    mask_upper: bool = True,
    vmin: Optional[float] = None,
    vmax: Optional[float] = None,
    max_labels: Optional[int] = None,
    panel_size: float = 2.6,
) -> Figure:
    """A grid of [T, S] maps (all heads of a layer, or one head across
    layers) with one shared colour range and colour bar.

    patterns: [N, T, S]. titles default to "H0", "H1", ...; ncols defaults to
    about sqrt(N) (at most 8). Query labels are on the first column of each
    grid row, key labels under every panel."""
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
    lo, hi = _range(list(p), diverging, mask_upper, vmin, vmax)
    fig = Figure(figsize=(panel_size * ncols + 1.2, panel_size * nrows + (0.6 if title else 0.2)), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    im, used = None, []
    for i in range(nrows * ncols):
        ax = axes[i // ncols][i % ncols]
        if i >= N:
            fig.delaxes(ax)
            continue
        im = plot_pattern(
            ax,
            p[i],
            tokens,
            titles[i],
            diverging,
            mask_upper,
            vmin=lo,
            vmax=hi,
            max_labels=max_labels,
            show_row_labels=(i % ncols == 0),
        )
        used.append(ax)
    fig.colorbar(im, ax=used, shrink=0.8, pad=0.02)
    if title:
        fig.suptitle(title, fontweight="bold")
    return fig


def plot_branches(
    branches: Mapping[str, np.ndarray],
    tokens: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    *,
    sum_name: str = "sum",
    add_sum: bool = True,
    mask_upper: bool = True,
    vmax: Optional[float] = None,
    max_labels: Optional[int] = None,
    panel_size: float = 2.6,
) -> Figure:
    """The compose branches of a head side by side with their sum, on one
    symmetric diverging scale (+-max|x| over all panels, or +-vmax).

    branches: name -> [T, S] (e.g. skip, qp, kp, qg, kg). If it has no entry
    called sum_name and add_sum is true, the element-wise sum of the
    branches is appended as the last panel."""
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
    if vmax is None:
        lo, hi = _range(maps, True, mask_upper, None, None)
    else:
        hi = float(abs(vmax))
        if not hi > 0:
            raise ValueError("vmax must be nonzero")
        lo = -hi
    return plot_heads(
        np.stack(maps),
        tokens,
        title,
        titles=names,
        ncols=len(maps),
        diverging=True,
        mask_upper=mask_upper,
        vmin=lo,
        vmax=hi,
        max_labels=max_labels,
        panel_size=panel_size,
    )


def plot_routing(
    matrix,
    source_labels: Optional[Sequence[str]] = None,
    target_labels: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    *,
    diverging: Optional[bool] = None,
    vmin: Optional[float] = None,
    vmax: Optional[float] = None,
    annotate: Optional[bool] = None,
    cell_size: float = 0.35,
) -> Figure:
    """A head-to-head matrix: source heads on rows, target heads on columns.

    diverging defaults to True when the matrix has negative entries.
    Labels default to "H0", "H1", ...; annotate writes the values in the
    cells (default: when the matrix is at most 12 x 12)."""
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


def plot_patching(result, normalize: bool = False, title: Optional[str] = None, panel_size: float = 3.2) -> Figure:
    """A patching sweep (dclens.patching.PatchResult) as heatmaps: 2-axis
    results in one panel, 3-axis results one panel per entry of the first
    axis (layer). Diverging colours centred on the corrupted metric (or on 0
    when normalize=True: 0 no effect, 1 full recovery)."""
    v = result.normalized() if normalize else np.asarray(result.values, dtype=np.float64)
    centre = 0.0 if normalize else result.corrupted
    d = v - centre
    m = float(np.nanmax(np.abs(d))) if np.isfinite(d).any() else 1.0
    m = m if m > 0 else 1.0
    panels = [v] if v.ndim == 2 else list(v)
    ptitles = [None] if v.ndim == 2 else ["%s %s" % (result.axes[0], lab) for lab in result.labels[0]]
    rows_ax, cols_ax = (result.axes[0], result.axes[1]) if v.ndim == 2 else (result.axes[1], result.axes[2])
    rlab, clab = (result.labels[0], result.labels[1]) if v.ndim == 2 else (result.labels[1], result.labels[2])
    ncols = min(len(panels), 4)
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(
        figsize=(
            panel_size * ncols + 1.2,
            panel_size * nrows * max(0.4, min(1.5, len(rlab) / max(len(clab), 1))) + 0.8,
        ),
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
        step = max(1, math.ceil(len(clab) / MAX_LABELS))
        ax.set_xticks(range(0, len(clab), step))
        ax.set_xticklabels(clab[::step], fontsize=7, rotation=90)
        ax.set_ylabel(rows_ax)
        ax.set_xlabel(cols_ax)
        if ptitles[i]:
            ax.set_title(ptitles[i], fontsize=9)
    fig.colorbar(
        im,
        ax=[a for a in axes.ravel() if a.figure is fig and a in fig.axes],
        shrink=0.8,
        label="normalized metric" if normalize else "metric",
    )
    fig.suptitle(
        title or "activation patching: %s (clean %.3g, corrupted %.3g)" % (result.what, result.clean, result.corrupted),
        fontsize=10,
        fontweight="bold",
    )
    return fig
