"""Figures of the dataset measures of dclens.analysis.heads (head_output_pca,
head_similarity, composition_stats, head_load, qk_ov_diversity): each a
dclens.plots.Figure, which shows itself inline in Jupyter.

    from dclens import analysis
    analysis.plot_pca(analysis.head_output_pca(model, data))   # also dclens.viz.measures.plot_pca
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .plots import Figure

__all__ = ["plot_pca", "plot_similarity", "plot_composition_stats", "plot_head_load", "plot_diversity"]


def _fig(w, h) -> Figure:
    return Figure(figsize=(w, h), layout="constrained")


def plot_pca(results: Mapping[int, Any], title: str | None = None) -> Figure:
    """Cumulative captured variance per layer, with the 90% line.

    Parameters
    ----------
    results : dict of int to PCAResult
        head_output_pca's result.
    title : str or None
        The axes' title (None: "PCA of head outputs").

    Returns
    -------
    Figure
        One curve per layer (shown inline in Jupyter).
    """
    fig = _fig(6, 4)
    ax = fig.add_subplot()
    for l, r in sorted(results.items()):
        ax.plot(
            np.arange(1, len(r.cumulative) + 1),
            r.cumulative,
            marker=".",
            label="layer %d (%d for 90%%)" % (l, r.n_components_90),
        )
    ax.axhline(0.9, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("principal components")
    ax.set_ylabel("captured variance")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize="small")
    ax.set_title(title or "PCA of head outputs")
    return fig


def plot_similarity(S: np.ndarray, title: str | None = None) -> Figure:
    """A head-by-head similarity matrix (diverging colours, range [-1, 1]).

    Parameters
    ----------
    S : array_like
        [N, N] similarities, as head_similarity gives them.
    title : str or None
        The axes' title (None: "head similarity").

    Returns
    -------
    Figure
        The matrix with a colour bar.
    """
    fig = _fig(4.5, 4)
    ax = fig.add_subplot()
    im = ax.imshow(np.asarray(S), cmap="RdBu_r", vmin=-1, vmax=1)
    ax.set_xlabel("head")
    ax.set_ylabel("head")
    ax.set_title(title or "head similarity")
    fig.colorbar(im, ax=ax)
    return fig


def plot_composition_stats(stats: Mapping[tuple[int, str], Any], title: str | None = None) -> Figure:
    """Mean |C - I| per branch and layer, and the pair-flow matrix of the largest.

    Parameters
    ----------
    stats : dict of tuple to CompositionStats
        composition_stats' result (not empty).
    title : str or None
        The figure's title (None: "composition statistics").

    Returns
    -------
    Figure
        Left: one bar group per (layer, phase), a bar per branch; right: pair_flow of the
        (layer, phase) with the largest total.
    """
    fig = _fig(10, 4)
    ax, ax2 = fig.subplots(1, 2)
    keys = sorted(stats)
    branches = list(next(iter(stats.values())).mean_abs)
    x = np.arange(len(keys))
    wdt = 0.8 / len(branches)
    for i, b in enumerate(branches):
        ax.bar(x + i * wdt, [stats[k].mean_abs[b] for k in keys], wdt, label=b)
    ax.set_xticks(x + 0.4 - wdt / 2, ["L%d %s" % k for k in keys], rotation=45, fontsize="small")
    ax.set_ylabel("mean |C - I|")
    ax.legend(fontsize="small")
    best = max(keys, key=lambda k: stats[k].mean_abs["total"])
    im = ax2.imshow(stats[best].pair_flow, cmap="viridis")
    ax2.set_title("flow source -> target, layer %d %s" % best)
    ax2.set_xlabel("target head")
    ax2.set_ylabel("source head")
    fig.colorbar(im, ax=ax2)
    fig.suptitle(title or "composition statistics")
    return fig


def plot_head_load(load: np.ndarray, title: str | None = None) -> Figure:
    """Head load as a heatmap.

    Parameters
    ----------
    load : array_like
        [L, routed heads], as head_load gives it.
    title : str or None
        The axes' title (None: "MoH head load").

    Returns
    -------
    Figure
        Layers down, routed heads across, with a colour bar.
    """
    fig = _fig(5, 3.5)
    ax = fig.add_subplot()
    im = ax.imshow(np.asarray(load), cmap="viridis", vmin=0, aspect="auto")
    ax.set_xlabel("routed head")
    ax.set_ylabel("layer")
    ax.set_title(title or "MoH head load")
    fig.colorbar(im, ax=ax)
    return fig


def plot_diversity(
    div: Mapping[str, np.ndarray], layers: Sequence[int] | None = None, title: str | None = None
) -> Figure:
    """QK / OV diversity (mean cumulative captured variance) per layer.

    Parameters
    ----------
    div : dict of str to numpy.ndarray
        qk_ov_diversity's result: kind -> one value per layer.
    layers : sequence of int or None
        The layers the values are of, for the x axis (None: 0, 1, ...).
    title : str or None
        The axes' title (None: "head diversity (DCFormer Fig. 5)").

    Returns
    -------
    Figure
        One line per kind.
    """
    fig = _fig(5, 3.5)
    ax = fig.add_subplot()
    for kind, v in div.items():
        xs = list(layers) if layers is not None else list(range(len(v)))
        ax.plot(xs, v, marker="o", label=kind.upper())
    ax.set_xlabel("layer")
    ax.set_ylabel("mean captured variance (lower: more diverse)")
    ax.legend()
    ax.set_title(title or "head diversity (DCFormer Fig. 5)")
    return fig
