"""dclens.analysis: every measure recomputed independently from cached
activations (run_with_cache), written here the plain way (explicit data
matrices, SVD, per-pair composition maps from tests/reference.py)."""

import numpy as np
import pytest

import dclens
from dclens import analysis, circuits

from reference import ref_composition_map
from tolerances import f32_tol, f64_tol

# analysis recomputes, in float64 numpy, quantities of float32 activations
# that the test also reads from caches of passes with the same hooks (so the
# same float32 values): only float64 rounding of two algorithms differs
# (SVD vs eigen-decomposition, chunked vs whole sums), relative to the
# largest value: f64_tol of the reduction length, a few stages deep.
F64 = f64_tol(4096, 4, 4096)

DATA_SEED = 5


def _data(V, n=3, T=13):
    rng = np.random.default_rng(DATA_SEED)
    return [rng.integers(0, V, size=T + i) for i in range(n)]  # unequal lengths


@pytest.fixture(scope="module")
def dcp(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="dcpythia", n_layer=2, window_size=4, use_sw=True, seed=61)
    return dclens.load(d), sd


def _caches(model, data, names):
    return [model.run_with_cache(t, names=names)[1] for t in data]


def test_head_output_pca_heads_mode(dcp):
    model, _ = dcp
    data = _data(model.config.vocab)
    res = analysis.head_output_pca(model, data, progress=False)
    N = model.config.n_head
    for l in range(model.config.n_layer):
        caches = _caches(model, data, ["blocks.%d.attn.head_out" % l])
        # one sample per head: its outputs over every token, flattened
        X = np.concatenate(
            [c["blocks.%d.attn.head_out" % l].transpose(1, 0, 2).reshape(N, -1) for c in caches], axis=1
        ).astype(np.float64)
        Xc = X - X.mean(0, keepdims=True)
        sv = np.linalg.svd(Xc, compute_uv=False)
        ratio = sv**2 / (sv**2).sum()
        r = res[l]
        np.testing.assert_allclose(r.ratio, ratio, rtol=0, atol=F64)  # ratios <= 1
        np.testing.assert_allclose(r.variance, sv**2 / (N - 1), rtol=0, atol=F64 * sv[0] ** 2 / (N - 1))
        assert r.n_components_90 == int(np.argmax(np.cumsum(ratio) >= 0.9) + 1)
        assert r.n_samples == N and r.mode == "heads"


def test_head_output_pca_tokens_mode(dcp):
    model, _ = dcp
    data = _data(model.config.vocab)
    res = analysis.head_output_pca(model, data, layers=[1], mode="tokens", progress=False)
    X = np.concatenate(
        [c["blocks.1.attn.z"].reshape(len(t), -1) for c, t in zip(_caches(model, data, ["blocks.1.attn.z"]), data)]
    ).astype(np.float64)
    sv = np.linalg.svd(X - X.mean(0), compute_uv=False)
    np.testing.assert_allclose(res[1].ratio[: len(sv)], sv**2 / (sv**2).sum(), rtol=0, atol=F64)
    assert res[1].n_samples == len(X) and res[1].n_components_90 >= 1


def test_qk_ov_diversity_reuses_circuits(dcp):
    model, _ = dcp
    div = analysis.qk_ov_diversity(model)
    N, D, Dh = model.config.n_head, model.config.d_model, model.config.head_dim
    for l in range(model.config.n_layer):
        w = model.weight("layers.%d.attention.wqkv.weight" % l).astype(np.float64)
        # QK of every head as a full [D, D] matrix, concatenated: [D, N*D]
        M = np.concatenate([w[n * Dh : (n + 1) * Dh].T @ w[D + n * Dh : D + (n + 1) * Dh] for n in range(N)], axis=1)
        sv = np.linalg.svd(M, compute_uv=False)
        cum = np.cumsum(sv**2) / (sv**2).sum()
        # M's blocks here are float64 products, qk_ov_diversity's float32 ones
        # (a reduction of length Dh): squared singular values, twice that
        assert div["qk"][l] == pytest.approx(cum.mean(), rel=2 * f32_tol(Dh, 1, M.size, sides=2))
        assert div["ov"][l] == pytest.approx(circuits.head_diversity(model, l, "ov"))


def test_head_similarity(dcp):
    model, _ = dcp
    data = _data(model.config.vocab)
    N, D, Dh = model.config.n_head, model.config.d_model, model.config.head_dim
    S = analysis.head_similarity(model, 0, data, progress=False)
    H = np.concatenate(
        [
            c["blocks.0.attn.head_out"].transpose(1, 0, 2).reshape(N, -1)
            for c in _caches(model, data, ["blocks.0.attn.head_out"])
        ],
        axis=1,
    ).astype(np.float64)
    Hn = H / np.linalg.norm(H, axis=1, keepdims=True)
    np.testing.assert_allclose(S, Hn @ Hn.T, rtol=0, atol=F64)  # cosines <= 1
    np.testing.assert_allclose(np.diag(S), 1.0)
    Sov = analysis.head_similarity(model, 1, kind="ov")
    wqkv = model.weight("layers.1.attention.wqkv.weight").astype(np.float64)
    wo = model.weight("layers.1.attention.wo.weight").astype(np.float64)
    F = np.stack(
        [(wqkv[2 * D + n * Dh : 2 * D + (n + 1) * Dh].T @ wo[:, n * Dh : (n + 1) * Dh].T).ravel() for n in range(N)]
    )
    F /= np.linalg.norm(F, axis=1, keepdims=True)
    # float32 OV products in analysis vs float64 here: cosines of vectors
    # carrying a relative error f32_tol(Dh)
    np.testing.assert_allclose(Sov, F @ F.T, rtol=0, atol=2 * f32_tol(Dh, 1, F.size, sides=2))
    with pytest.raises(dclens.Error, match="needs a dataset"):
        analysis.head_similarity(model, 0)


def test_composition_stats(dcp):
    model, sd = dcp
    data = _data(model.config.vocab, n=2, T=9)
    stats = analysis.composition_stats(model, data, chunk=4, progress=False)
    c = model.config
    N = c.n_head
    for l in range(c.n_layer):
        w = c.window_size if l in c.local_layers else 0
        for ph, src in (("pre", "scores"), ("post", "pattern")):
            W = sd["layers.%d.attention.dyn_w_proj.%s_proj.w" % (l, ph)][0].astype(np.float64)
            p = "blocks.%d.attn.dyn.%s." % (l, ph)
            names = [p + k for k in ("qw1", "qw2", "qdd", "kw1", "kw2", "kdd")] + ["blocks.%d.attn.%s" % (l, src)]
            br = {b: 0.0 for b in ("qp", "kp", "qg", "kg", "static", "total")}
            flow, pairs, queries = np.zeros((N, N)), 0, 0
            for toks, cache in zip(data, _caches(model, data, names)):
                T = len(toks)
                X = cache["blocks.%d.attn.%s" % (l, src)]
                for t in range(T):
                    R = np.zeros((N, N))
                    for s in range(T):
                        if s > t or (w > 0 and t - s > w):
                            continue
                        C = ref_composition_map(cache, l, ph, t, s, N, W)
                        br["total"] += np.abs(C - np.eye(N)).sum()
                        br["qp"] += np.abs(cache[p + "qw1"][t].T @ cache[p + "qw2"][t]).sum()
                        br["kp"] += np.abs(cache[p + "kw1"][s].T @ cache[p + "kw2"][s]).sum()
                        br["qg"] += np.abs(cache[p + "qdd"][t]).sum()
                        br["kg"] += np.abs(cache[p + "kdd"][s]).sum()
                        br["static"] += np.abs(W).sum()
                        R += X[:, t, s][:, None] * (C - np.eye(N))
                        pairs += 1
                    flow += np.abs(R)
                    queries += 1
            st = stats[(l, ph)]
            assert st.n_pairs == pairs and st.n_queries == queries
            for b, v in br.items():
                # float32 sums over pairs * N * N terms (chunked) vs float64 here
                tol = f32_tol(pairs * N * N, 2, N * N, sides=2)
                assert st.mean_abs[b] == pytest.approx(v / (pairs * N * N), rel=tol), (l, ph, b)
            np.testing.assert_allclose(
                st.pair_flow,
                flow / queries,
                rtol=0,
                atol=f32_tol(queries * N, 2, N * N, sides=2) * (flow / queries).max(),
            )
            top = sorted(((n, m) for n in range(N) for m in range(N) if n != m), key=lambda x: -flow[x])
            assert [(n, m) for n, m, _ in st.top_pairs[:3]] == top[:3]


def test_head_load_needs_moh_and_plots(dcp):
    model, _ = dcp
    with pytest.raises(dclens.Error, match="no Mixture-of-Head routing"):
        analysis.head_load(model, _data(model.config.vocab), progress=False)
    data = _data(model.config.vocab, n=2)
    figs = [
        analysis.plot_pca(analysis.head_output_pca(model, data, progress=False)),
        analysis.plot_similarity(analysis.head_similarity(model, 0, data, progress=False)),
        analysis.plot_composition_stats(analysis.composition_stats(model, data, progress=False)),
        analysis.plot_head_load(np.full((2, 3), 0.5)),
        analysis.plot_diversity(analysis.qk_ov_diversity(model)),
    ]
    import io

    for f in figs:
        buf = io.BytesIO()
        f.savefig(buf, format="png")
        assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"
    S = analysis.head_similarity(model, 0, data, progress=False)
    img = figs[1].axes[0].images[0].get_array()
    np.testing.assert_array_equal(np.asarray(img), S)


def test_progress_bar_and_bad_dataset(dcp, capsys):
    model, _ = dcp
    analysis.head_output_pca(model, _data(model.config.vocab, n=2), layers=[0], progress=True)
    assert "head-output PCA" in capsys.readouterr().err
    with pytest.raises(dclens.Error, match="dataset is empty"):
        analysis.head_output_pca(model, [], progress=False)
    with pytest.raises(dclens.Error, match="dataset item 1"):
        analysis.head_output_pca(model, [np.arange(3), np.zeros((2, 2), int)], progress=False)
