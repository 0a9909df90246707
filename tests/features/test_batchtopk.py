"""BatchTopK and dead-feature resampling (dclens.features): the engine against float64 numpy
references written from docs/features.md, the threshold's running estimate, thread-count
independence, the SAELens format's round trip, resampling inside train_sae (resumed bit for bit),
and bad input each a dclens.Error naming the argument."""

import json

import numpy as np
import pytest

import dclens
from dclens import features as F
from dclens.features.sae import THRESHOLD_LR


def make(d_in=12, d_sae=20, k=3, n_threads=1, seed=1, d_out=0):
    c = F.SAEConfig(
        d_in=d_in,
        d_sae=d_sae,
        arch="batchtopk",
        k=k,
        d_out=d_out,
        hook_name="blocks.0.mlp_input" if d_out else "blocks.0.resid_post",
        hook_name_out="blocks.0.mlp.out" if d_out else "",
    )
    sae = F.SAE(c, seed=seed, n_threads=n_threads)
    rng = np.random.default_rng(seed)
    sae.set_parameters(**{n: rng.normal(0, 0.5, v.shape) for n, v in sae.parameters().items() if n != "threshold"})
    return sae


def ref_batchtopk(p, c, x, t):
    """Training: the k N largest positive pre of the batch (ties to the lower flat index);
    the loss, the gradients, the smallest kept activation."""
    N = x.shape[0]
    xin = x - p["b_dec"] if c.apply_b_dec_to_input else x
    pre = xin @ p["W_enc"] + p["b_enc"]
    flat = np.maximum(pre, 0).ravel()
    keep = np.argsort(-flat, kind="stable")[: c.k * N]
    keep = keep[flat[keep] > 0]
    acts = np.zeros_like(flat)
    acts[keep] = flat[keep]
    acts = acts.reshape(pre.shape)
    recon = acts @ p["W_dec"] + p["b_dec"]
    dR = 2 * (recon - t) / N
    g = {"W_dec": acts.T @ dR, "b_dec": dR.sum(0)}
    dP = np.where(acts != 0, dR @ p["W_dec"].T, 0)
    g["W_enc"], g["b_enc"] = xin.T @ dP, dP.sum(0)
    if c.apply_b_dec_to_input:
        g["b_dec"] = g["b_dec"] - (dP @ p["W_enc"].T).sum(0)
    return ((recon - t) ** 2).sum(1).mean(), g, acts, flat[keep].min()


@pytest.mark.parametrize("transcoder", [False, True], ids=["sae", "transcoder"])
def test_training_and_inference_match_the_reference(transcoder):
    sae = make(d_out=7 if transcoder else 0)
    c = sae.cfg
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (16, c.d_in)).astype(np.float32)
    t = rng.normal(0, 1, (16, c.width_out)).astype(np.float32) if transcoder else x
    p = {k: v.astype(np.float64) for k, v in sae.parameters().items()}
    fired = np.zeros(c.d_sae, np.int64)
    stats, g = sae.loss_and_grads(x, t if transcoder else None, fired)
    mse, wg, acts, lowest = ref_batchtopk(p, c, x.astype(np.float64), t.astype(np.float64))
    assert stats["mse"] == pytest.approx(mse, rel=1e-5) and stats["loss"] == stats["mse"]
    assert stats["l0"] == pytest.approx(3.0)  # k per row on average
    rows = (acts != 0).sum(1)
    assert rows.min() != rows.max()  # not a per-row TopK: the batch's
    np.testing.assert_array_equal(fired, (acts != 0).sum(0))
    assert set(g) == set(wg) | {"threshold"} and g["threshold"][0] == 0
    for k in wg:
        np.testing.assert_allclose(g[k], wg[k], atol=2e-5, rtol=1e-4, err_msg=k)
    sae.step(1, lr=0.0)  # lr 0: only the threshold moves, toward the smallest kept activation
    thr = sae.parameters()["threshold"][0]
    pre32 = np.sort(sae.run(x)["pre"].ravel())[::-1]  # the engine's float32 pre-activations
    assert pre32[3 * 16 - 1] == pytest.approx(lowest, rel=1e-6)
    assert thr == np.float32(THRESHOLD_LR) * pre32[3 * 16 - 1]
    np.testing.assert_array_equal(sae.threshold, np.full(c.d_sae, thr))
    sae.set_parameters(threshold=[0.4])  # inference: JumpReLU-style at the one threshold
    out = sae.run(x)
    np.testing.assert_array_equal(out["acts"], np.where(out["pre"] > np.float32(0.4), out["pre"], 0))
    assert 0 < (out["acts"] != 0).mean() < 1


def test_ties_go_to_the_lower_index_and_threads_do_not_matter():
    sae = make()
    sae.set_parameters(W_enc=np.zeros((12, 20)), b_enc=np.ones(20))  # every pre-activation 1
    fired = np.zeros(20, np.int64)
    sae.loss_and_grads(np.ones((4, 12), np.float32), fired=fired)
    np.testing.assert_array_equal(fired, [1] * 12 + [0] * 8)  # 12 = k N: row 0's first 12
    runs = []
    for threads in (1, 2):
        s = make(d_in=40, d_sae=300, n_threads=threads)
        rng = np.random.default_rng(3)
        for step in range(1, 4):
            s.loss_and_grads(rng.normal(0, 1, (9, 40)).astype(np.float32))
            s.step(step, lr=0.01)
        runs.append({k: v.tobytes() for k, v in s.parameters().items()})
    assert runs[0] == runs[1]


def test_saelens_round_trip(tmp_path):
    sae = make()
    sae.set_parameters(threshold=[0.123456789])
    F.save(sae, tmp_path / "b")
    cfg = json.loads((tmp_path / "b" / "cfg.json").read_text())
    assert cfg["architecture"] == "jumprelu" and cfg["dclens"]["arch"] == "batchtopk"
    w = F.read_safetensors(str(tmp_path / "b" / "sae_weights.safetensors"))
    np.testing.assert_array_equal(w["threshold"], np.full(20, np.float32(0.123456789)))
    back = F.load(tmp_path / "b")
    assert back.cfg == sae.cfg
    for k, v in sae.parameters().items():
        assert v.tobytes() == back.parameters()[k].tobytes(), k
    x = np.random.default_rng(2).normal(0, 1, (8, 12)).astype(np.float32)
    np.testing.assert_array_equal(back.encode(x), sae.encode(x))
    del cfg["dclens"]  # as SAELens reads it: a JumpReLU at the same thresholds
    (tmp_path / "b" / "cfg.json").write_text(json.dumps(cfg))
    jr = F.load(tmp_path / "b")
    assert jr.cfg.arch == "jumprelu"
    np.testing.assert_allclose(jr.threshold, sae.threshold, rtol=1e-6)


def ref_resample(p, c, x, t, recon, dead):
    err = ((t.astype(np.float64) - recon) ** 2).sum(1)
    order = sorted(range(len(x)), key=lambda r: (-err[r], r))
    want = {k: v.copy() for k, v in p.items()}
    alive = np.ones(c.d_sae, bool)
    alive[dead] = False
    norm = 0.2 * np.linalg.norm(p["W_enc"][:, alive], axis=0).mean()
    for j, f in enumerate(dead):
        r = order[j % len(x)]
        d = t[r] - p["b_dec"]
        want["W_dec"][f] = d / np.linalg.norm(d)
        e = x[r] - p["b_dec"] if c.apply_b_dec_to_input else x[r]
        want["W_enc"][:, f] = e / np.linalg.norm(e) * norm
        want["b_enc"][f] = 0
    return want


@pytest.mark.parametrize("arch", ["batchtopk", "relu", "jumprelu"])
def test_resampling_matches_the_reference(arch):
    c = F.SAEConfig(d_in=12, d_sae=20, arch=arch, k=3, hook_name="blocks.0.resid_post")
    sae = F.SAE(c, seed=4, n_threads=1)
    rng = np.random.default_rng(4)
    sae.set_parameters(W_enc=rng.normal(0, 0.5, (12, 20)), b_dec=rng.normal(0, 0.1, 12))
    sae.set_parameters("mom", W_enc=np.ones((12, 20)), b_enc=np.ones(20))
    x = rng.normal(0, 1, (6, 12)).astype(np.float32)
    p = {k: v.astype(np.float64) for k, v in sae.parameters().items()}
    recon = sae.forward(x).astype(np.float64)
    dead = [3, 11, 0, 17, 5, 8, 19]  # more than the rows: the worst ones again
    want = ref_resample(p, c, x.astype(np.float64), x.astype(np.float64), recon, dead)
    sae.resample(x, dead=dead)
    got = sae.parameters()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6, err_msg=k)
    mom = sae.parameters("mom")
    assert (mom["W_enc"][:, dead] == 0).all() and (mom["b_enc"][dead] == 0).all()
    assert (mom["W_enc"][:, 1] == 1).all()  # a live feature's moments stay


@pytest.fixture(scope="module")
def model(tiny_factory):
    d, _, _ = tiny_factory(n_layer=2, dim=32, vocab=64)
    return dclens.load(d)


def test_train_sae_resamples_and_resumes_bit_identically(model, tmp_path):
    toks = np.random.default_rng(0).integers(0, 64, (40, 8)).astype(np.int32)
    cfg = F.SAEConfig(d_in=32, d_sae=64, arch="batchtopk", k=2, hook_name="blocks.1.resid_pre")
    kw = dict(seqs_per_step=2, dead_after=32, progress=False)  # dead after 2 steps of 16 tokens
    whole = F.SAE(cfg, seed=5, n_threads=1)
    s_whole = F.train_sae(model, whole, F.TokenArrays(toks), steps=6, **kw)
    assert sum(h["resampled"] for h in s_whole.history) > 0
    ck = str(tmp_path / "ck.npz")
    F.train_sae(model, F.SAE(cfg, seed=5, n_threads=1), F.TokenArrays(toks), steps=3, checkpoint=ck, **kw)
    resumed = F.SAE(cfg, seed=9, n_threads=2)
    s_res = F.train_sae(model, resumed, F.TokenArrays(toks), steps=6, checkpoint=ck, **kw)
    assert s_res.history == s_whole.history
    np.testing.assert_array_equal(s_res.tokens_since_fired, s_whole.tokens_since_fired)
    for s in ("param", "mom", "var"):
        for k, v in whole.parameters(s).items():
            assert v.tobytes() == resumed.parameters(s)[k].tobytes(), (s, k)


def test_bad_input_names_the_argument():
    sae = make()
    x = np.zeros((4, 12), np.float32)
    with pytest.raises(dclens.Error, match="x must be a non-empty batch"):
        sae.resample(x[:0], dead=[1])
    with pytest.raises(dclens.Error, match="dead holds feature 20"):
        sae.resample(x, dead=[1, 20])
    with pytest.raises(dclens.Error, match="dead must be a list of feature indices"):
        sae.resample(x, dead=[[1]])
    with pytest.raises(dclens.Error, match="target must end in a dimension of 7"):
        make(d_out=7).resample(x, np.zeros((4, 5)), dead=[1])
    with pytest.raises(dclens.Error, match="needs a target"):
        make(d_out=7).resample(x, dead=[1])
    with pytest.raises(dclens.Error, match=r"SAEConfig.k must be in 1..d_sae \(20\) for batchtopk"):
        F.SAEConfig(d_in=12, d_sae=20, arch="batchtopk", k=21)
    with pytest.raises(dclens.Error, match="TrainSAEConfig.dead_after"):
        F.TrainSAEConfig(dead_after=-1)
