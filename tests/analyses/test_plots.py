"""dclens.plots: the matplotlib figures (no engine needed).

plots.py is loaded from its file so that these tests run without the
compiled engine (importing the dclens package loads it)."""

import importlib.util
import io
import os

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.image import AxesImage  # noqa: E402
from matplotlib.patches import Polygon  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "dclens_plots_under_test", os.path.join(ROOT, "bindings", "dclens", "viz", "plots.py")
)
dp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dp)

TOKENS = [" The", " cat", " sat", " on", " the", " mat", ".", " It", " was", " very", " happy", "\n"]
PNG_SIG = b"\x89PNG\r\n\x1a\n"


def pattern(T, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(T, T))
    logits[np.triu_indices(T, 1)] = -np.inf
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def images(fig):
    """The heatmap images of a figure, in axes order (colour bars excluded)."""
    out = []
    for ax in fig.axes:
        out += [im for im in ax.get_images() if isinstance(im, AxesImage)]
    return out


def mask_patches(ax):
    return [p for p in ax.patches if isinstance(p, Polygon) and p.get_label() == "_mask"]


def png_bytes(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=60)
    return buf.getvalue()


def test_format_token():
    assert dp.format_token(" the") == "\u00b7the"
    assert dp.format_token("a b ") == "a b\u00b7"
    assert dp.format_token("  ") == "\u00b7\u00b7"
    assert dp.format_token("\n") == "\u21b5"
    assert dp.format_token("\r\n") == "\u21b5"
    assert dp.format_token("\t") == "\u2192"
    assert dp.format_token(" caf\u00e9") == "\u00b7caf\u00e9"
    long = dp.format_token(" supercalifragilistic")
    assert len(long) == dp.MAX_LABEL_CHARS and long.endswith("..")


def test_plot_pattern_data_mask_labels():
    p = pattern(12)
    fig = Figure()
    ax = fig.subplots()
    im = dp.plot_pattern(ax, p, TOKENS, "L3 H5")
    # The image data is the input, untouched.
    assert np.array_equal(np.asarray(im.get_array()), p)
    assert im.get_cmap().name.startswith("viridis")
    lo, hi = im.get_clim()
    vis = p[np.tril_indices(12)]
    assert lo == pytest.approx(vis.min()) and hi == pytest.approx(vis.max())
    # The mask covers exactly the cells s > t.
    (poly,) = mask_patches(ax)
    path = poly.get_path()
    for t in range(12):
        for s in range(12):
            assert path.contains_point((s, t)) == (s > t), (t, s)
    assert poly.get_hatch()
    # Labels: rows and columns, leading spaces visible.
    ylabels = [t.get_text() for t in ax.get_yticklabels()]
    xlabels = [t.get_text() for t in ax.get_xticklabels()]
    assert ylabels[0] == "\u00b7The" and ylabels[-1] == "\u21b5"
    assert xlabels == ylabels
    assert ax.get_title() == "L3 H5"
    assert png_bytes(fig).startswith(PNG_SIG)


def test_plot_pattern_no_mask_diverging_fixed_range():
    a = np.linspace(-2, 3, 20, dtype=np.float32).reshape(4, 5)
    fig = Figure()
    ax = fig.subplots()
    im = dp.plot_pattern(ax, a, diverging=True, mask_upper=False)
    assert im.get_cmap().name.startswith("RdBu_r")
    assert im.get_clim() == pytest.approx((-3.0, 3.0))  # symmetric +-max|x|
    assert not mask_patches(ax)
    # No tokens: indices; non-square map.
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(i) for i in range(5)]
    im2 = dp.plot_pattern(Figure().subplots(), a, vmin=-1, vmax=1, diverging=True)
    assert im2.get_clim() == (-1.0, 1.0)
    with pytest.raises(ValueError):
        dp.plot_pattern(ax, a, vmin=1, vmax=1)
    with pytest.raises(ValueError):
        dp.plot_pattern(ax, np.zeros((3,)))
    with pytest.raises(ValueError):
        dp.plot_pattern(ax, pattern(4), tokens=["a", "b"])


def test_long_prompt_every_kth_label():
    T = 200
    toks = [TOKENS[i % 12] for i in range(T)]
    fig = Figure()
    ax = fig.subplots()
    dp.plot_pattern(ax, pattern(T), toks)
    yt = ax.get_yticks()
    assert 1 < len(yt) <= dp.MAX_LABELS
    step = int(yt[1] - yt[0])
    assert step > 1
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[1] == dp.format_token(toks[step])


def test_plot_heads_grid():
    N, T = 5, 8
    pats = np.stack([pattern(T, seed=i) for i in range(N)])
    fig = dp.plot_heads(pats, TOKENS[:T], "layer 3: hook_pattern", ncols=3, scale="shared")
    assert isinstance(fig, Figure)
    # 5 panels (the sixth grid slot is removed) + 1 colour bar.
    assert len(fig.axes) == N + 1
    ims = images(fig)
    assert len(ims) == N
    for i, im in enumerate(ims):
        assert np.array_equal(np.asarray(im.get_array()), pats[i])
    clims = {im.get_clim() for im in ims}
    assert len(clims) == 1  # one shared range
    # the default: each panel its own range and colour bar
    own = dp.plot_heads(pats, TOKENS[:T], ncols=3)
    assert len(own.axes) == 2 * N
    for i, im in enumerate(images(own)):
        vis = pats[i][np.tril_indices(T)]
        assert im.get_clim() == pytest.approx((vis.min(), vis.max()))
    titles = [ax.get_title() for ax in fig.axes[:N]]
    assert titles == ["H%d" % i for i in range(N)]
    assert fig._suptitle.get_text() == "layer 3: hook_pattern"
    # Query labels only on the first column of each grid row.
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()][0] == "\u00b7The"
    assert all(t.get_text() == "" for t in fig.axes[1].get_yticklabels())
    assert all(mask_patches(ax) for ax in fig.axes[:N])
    assert png_bytes(fig).startswith(PNG_SIG)


def test_plot_heads_titles_and_errors():
    pats = np.stack([pattern(6, seed=i) for i in range(3)])
    fig = dp.plot_heads(pats, titles=["L0 H2", "L1 H2", "L2 H2"], vmin=0, vmax=1)
    assert [ax.get_title() for ax in fig.axes[:3]] == ["L0 H2", "L1 H2", "L2 H2"]
    assert images(fig)[0].get_clim() == (0.0, 1.0)
    with pytest.raises(ValueError):
        dp.plot_heads(pats[0])
    with pytest.raises(ValueError):
        dp.plot_heads(pats, titles=["a"])


def test_plot_branches_sum_and_symmetric_scale():
    T = 7
    rng = np.random.default_rng(1)
    names = ["skip", "qp", "kp", "qg", "kg"]
    br = {n: np.tril(rng.normal(size=(T, T))).astype(np.float32) for n in names}
    fig = dp.plot_branches(br, TOKENS[:T], "L3 H5 branches", scale="shared")
    ims = images(fig)
    assert len(ims) == 6 and len(fig.axes) == 7
    assert [ax.get_title() for ax in fig.axes[:6]] == names + ["sum"]
    for n, im in zip(names, ims):
        assert np.array_equal(np.asarray(im.get_array()), br[n])
    total = np.sum([br[n].astype(np.float64) for n in names], axis=0)
    assert np.allclose(np.asarray(ims[5].get_array()), total)
    m = max(np.abs(a[np.tril_indices(T)]).max() for a in list(br.values()) + [total])
    for im in ims:
        assert im.get_clim() == pytest.approx((-m, m))
        assert im.get_cmap().name.startswith("RdBu_r")
    assert png_bytes(fig).startswith(PNG_SIG)
    # by default each branch its own symmetric scale and colour bar (a small branch is not washed out)
    own = dp.plot_branches(br, TOKENS[:T])
    assert len(own.axes) == 12
    for a, im in zip(list(br.values()) + [total], images(own)):
        mm = np.abs(a[np.tril_indices(T)]).max()
        assert im.get_clim() == pytest.approx((-mm, mm))
    # A given sum is used as is; a fixed scale.
    br2 = dict(br, sum=np.ones((T, T), np.float32))
    fig2 = dp.plot_branches(br2, vmax=2.0)
    ims2 = images(fig2)
    assert len(ims2) == 6 and np.array_equal(np.asarray(ims2[5].get_array()), br2["sum"])
    assert ims2[0].get_clim() == (-2.0, 2.0)
    with pytest.raises(ValueError):
        dp.plot_branches({"a": np.zeros((3, 3)), "b": np.zeros((3, 4))})
    with pytest.raises(ValueError):
        dp.plot_branches({})


def test_plot_routing():
    rng = np.random.default_rng(2)
    m = rng.normal(size=(6, 6))
    fig = dp.plot_routing(m, title="L2 -> L3")
    assert len(fig.axes) == 2  # matrix + colour bar
    (im,) = images(fig)
    assert np.array_equal(np.asarray(im.get_array()), m)
    assert im.get_cmap().name.startswith("RdBu_r")  # negatives -> diverging
    ax = fig.axes[0]
    assert ax.get_ylabel() == "source head" and ax.get_xlabel() == "target head"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["H%d" % i for i in range(6)]
    assert len(ax.texts) == 36  # annotated
    assert png_bytes(fig).startswith(PNG_SIG)
    # Non-negative, bigger, custom labels: sequential, not annotated.
    m2 = np.abs(rng.normal(size=(16, 20)))
    fig2 = dp.plot_routing(m2, ["s%d" % i for i in range(16)], ["t%d" % i for i in range(20)])
    (im2,) = images(fig2)
    assert im2.get_cmap().name.startswith("viridis")
    assert len(fig2.axes[0].texts) == 0
    with pytest.raises(ValueError):
        dp.plot_routing(m, source_labels=["a"])


def test_flows_plot():
    """plots.flows: source x key (summed over branches, masked keys blank) and source x branch at a key."""
    rng = np.random.default_rng(3)
    N, B, T = 4, 5, 9
    F = rng.normal(size=(N, B, T))
    F[:, :, 7:] = 0.0  # masked keys
    fig = dp.plot_flows(F, TOKENS[:T], target="L1H2", title="flows")
    left, right = images(fig)
    got = np.asarray(left.get_array())
    assert np.allclose(got[:, :7], F.sum(1)[:, :7]) and np.isnan(got[:, 7:]).all()
    key = int(np.argmax(np.abs(F.sum((0, 1)))))
    tab = np.asarray(right.get_array())
    assert np.allclose(tab[:N, :B], F[:, :, key]) and np.isnan(tab[N]).all() and np.isnan(tab[:, B]).all()
    texts = [t.get_text() for t in fig.axes[1].texts]
    assert texts[-1] == "%.3f" % F[:, :, key].sum()  # the grand total, bottom right
    assert fig.axes[1].get_title().startswith("at key %d" % key)
    assert png_bytes(fig).startswith(PNG_SIG)
    assert dp.plot_flows(F, key=-3).axes[1].get_title().startswith("at key 6")
    six = dp.plot_flows(np.concatenate([F, F[:, :1]], axis=1))  # a use_sw model's sixth branch
    assert [t.get_text() for t in six.axes[1].get_xticklabels()][-2:] == ["static", "total"]
    for bad in (dict(F=F[0]), dict(F=F, tokens=TOKENS[:3]), dict(F=F, key=T), dict(F=F, branches=["a"])):
        with pytest.raises(ValueError):
            dp.plot_flows(**bad)


def test_patching_plot_labels_tokens_and_wraps_title():
    class R:  # a PatchResult's fields
        values = np.arange(12.0).reshape(2, 6)
        axes = ("layer", "pos")
        labels = (["0", "1"], [str(i) for i in range(6)])
        clean, corrupted, what = 5.0, 0.0, "layer,pos (resid_pre) with a long description " * 3
        pos_tokens = ([" a", " b", " c", " d", " e", " f"], [" a", " b", " X", " d", " e", " f"])

        def normalized(self):
            return self.values / 5.0

    fig = dp.plot_patching(R())
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["·a", "·b", "·c|·X", "·d", "·e", "·f"]
    assert ax.get_xticklabels()[2].get_color() == "#c00000"
    assert "\n" in fig._suptitle.get_text()  # wrapped, not clipped
    w = fig.get_figwidth() * fig.dpi
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    r = FigureCanvasAgg(fig).get_renderer()
    bb = fig._suptitle.get_window_extent(renderer=r)
    assert bb.x0 >= 0 and bb.x1 <= w
