"""dclens.features: the engine's SAE / transcoder against a float64 numpy reference written
from the formulas (docs/features.md), thread-count independence, resumed training bit for
bit, the SAELens format both ways, and bad input each a dclens.Error naming the argument."""

import json
import os
import struct

import numpy as np
import pytest

import dclens
from dclens import features as F
from dclens._core.dictionaries import EngineSAE

ARCHS = ("relu", "topk", "jumprelu")


# ---------------------------------------------------------------- the float64 reference


def ref_forward(p, c, x):
    """pre, acts, recon in float64 (SAELens's formulas)."""
    xin = x - p["b_dec"] if c.apply_b_dec_to_input else x
    pre = xin @ p["W_enc"] + p["b_enc"]
    if c.arch == "relu":
        acts = np.maximum(pre, 0)
    elif c.arch == "jumprelu":
        acts = np.where(pre > np.exp(p["log_threshold"]), pre, 0)
    else:  # the k largest per row (ties to the lower index), ReLU'd
        order = np.argsort(-pre, axis=1, kind="stable")[:, : c.k]
        acts = np.zeros_like(pre)
        np.put_along_axis(acts, order, np.maximum(np.take_along_axis(pre, order, 1), 0), 1)
    return pre, acts, acts @ p["W_dec"] + p["b_dec"]


def ref_loss_grads(p, c, x, t):
    """The loss and every gradient, by hand (JumpReLU's threshold: the rectangle pseudo-derivative)."""
    N = x.shape[0]
    pre, acts, recon = ref_forward(p, c, x)
    mse = ((recon - t) ** 2).sum(1).mean()
    thr = np.exp(p["log_threshold"]) if c.arch == "jumprelu" else None
    sp = {"relu": acts.sum(1).mean(), "jumprelu": (pre > thr).sum(1).mean() if thr is not None else 0.0}.get(
        c.arch, 0.0
    )
    loss = mse + c.sparsity_coef * sp
    dR = 2 * (recon - t) / N
    g = {"W_dec": acts.T @ dR, "b_dec": dR.sum(0)}
    dA = dR @ p["W_dec"].T
    if c.arch == "relu":
        dP = np.where(pre > 0, dA + c.sparsity_coef / N, 0)
    elif c.arch == "topk":
        dP = np.where(acts != 0, dA, 0)
    else:
        dP = np.where(pre > thr, dA, 0)
        eps = c.bandwidth
        rect = (np.abs((pre - thr) / eps) < 0.5).astype(np.float64)
        dthr = (-(thr / eps) * dA * rect - c.sparsity_coef / N / eps * rect).sum(0)
        g["log_threshold"] = dthr * thr
    xin = x - p["b_dec"] if c.apply_b_dec_to_input else x
    g["W_enc"] = xin.T @ dP
    g["b_enc"] = dP.sum(0)
    if c.apply_b_dec_to_input:
        g["b_dec"] = g["b_dec"] - (dP @ p["W_enc"].T).sum(0)
    return {"loss": loss, "mse": mse, "l0": (acts != 0).sum(1).mean()}, g


def make_sae(arch, transcoder=False, n_threads=1, seed=1, d_in=12, d_sae=20):
    c = F.SAEConfig(
        d_in=d_in,
        d_sae=d_sae,
        arch=arch,
        k=5,
        d_out=7 if transcoder else 0,
        hook_name="blocks.0.mlp_input" if transcoder else "blocks.0.resid_post",
        hook_name_out="blocks.0.mlp.out" if transcoder else "",
        sparsity_coef=0.05,
        bandwidth=0.2,
    )
    sae = F.SAE(c, seed=seed, n_threads=n_threads)
    rng = np.random.default_rng(seed)
    vals = {k: rng.normal(0, 0.5, v.shape).astype(np.float32) for k, v in sae.parameters().items()}
    if arch == "jumprelu":
        vals["log_threshold"] = rng.uniform(-1.5, -0.5, d_sae).astype(np.float32)
    sae.set_parameters(**vals)
    return sae


@pytest.mark.parametrize("transcoder", [False, True], ids=["sae", "transcoder"])
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_loss_and_gradients_match_the_reference(arch, transcoder):
    sae = make_sae(arch, transcoder)
    c = sae.cfg
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (16, c.d_in)).astype(np.float32)
    t = rng.normal(0, 1, (16, c.width_out)).astype(np.float32) if transcoder else x
    p = {k: v.astype(np.float64) for k, v in sae.parameters().items()}
    pre, acts, recon = ref_forward(p, c, x.astype(np.float64))
    out = sae.run(x)
    np.testing.assert_allclose(out["pre"], pre, atol=1e-5)
    np.testing.assert_allclose(out["acts"], acts, atol=1e-5)
    np.testing.assert_allclose(out["recon"], recon, atol=1e-5)
    np.testing.assert_allclose(sae.encode(x), acts, atol=1e-5)
    np.testing.assert_allclose(sae.decode(out["acts"]), recon, atol=1e-5)
    assert 0 < (acts != 0).mean() < 1  # some features on, some off: the masks are tested
    fired = np.zeros(c.d_sae, np.int64)
    stats, g = sae.loss_and_grads(x, t if transcoder else None, fired)
    want, wg = ref_loss_grads(p, c, x.astype(np.float64), t.astype(np.float64))
    for k in ("loss", "mse", "l0"):
        assert stats[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
    np.testing.assert_array_equal(fired, (acts != 0).sum(0))
    assert set(g) == set(wg)
    for k in g:
        np.testing.assert_allclose(g[k], wg[k], atol=2e-5, rtol=1e-4, err_msg=k)
        assert np.abs(wg[k]).max() > 0, k  # every gradient is exercised
    sae.close()


def train_steps(sae, n, seed=3):
    rng = np.random.default_rng(seed)
    for step in range(1, n + 1):
        x = rng.normal(0, 1, (9, sae.cfg.d_in)).astype(np.float32)
        sae.loss_and_grads(x)
        sae.step(step, lr=0.01, weight_decay=0.01)
    return {s: sae.parameters(s) for s in ("param", "mom", "var")}


@pytest.mark.parametrize("arch", ARCHS)
def test_same_bits_on_one_and_two_threads(arch):
    a = train_steps(make_sae(arch, n_threads=1, d_in=40, d_sae=300), 3)
    b = train_steps(make_sae(arch, n_threads=2, d_in=40, d_sae=300), 3)
    for s in a:
        for k in a[s]:
            assert a[s][k].tobytes() == b[s][k].tobytes(), (arch, s, k)


# ---------------------------------------------------------------- with a model


@pytest.fixture(scope="module")
def model(tiny_factory):
    d, _, _ = tiny_factory(n_layer=2, dim=32, vocab=64)
    return dclens.load(d)


@pytest.fixture(scope="module")
def toks():
    return np.random.default_rng(0).integers(0, 64, (64, 8)).astype(np.int32)


def test_resumed_training_is_bit_identical(model, toks, tmp_path):
    cfg = F.SAEConfig(d_in=32, d_sae=48, arch="topk", k=4, hook_name="blocks.1.hook_resid_pre")
    src = F.TokenArrays(toks)
    whole = F.SAE(cfg, seed=5, n_threads=1)
    s_whole = F.train_sae(model, whole, src, steps=6, seqs_per_step=3, progress=False)
    ck = str(tmp_path / "ck.npz")
    half = F.SAE(cfg, seed=5, n_threads=1)
    F.train_sae(model, half, src, steps=3, seqs_per_step=3, checkpoint=ck, progress=False)
    half.close()
    resumed = F.SAE(cfg, seed=99, n_threads=2)  # another init and pool: the checkpoint decides
    s_res = F.train_sae(model, resumed, src, steps=6, seqs_per_step=3, checkpoint=ck, progress=False)
    assert s_res.step == s_whole.step == 6 and s_res.position == s_whole.position == 18
    assert s_res.history == s_whole.history
    np.testing.assert_array_equal(s_res.since_fired, s_whole.since_fired)
    for s in ("param", "mom", "var"):
        for k, v in whole.parameters(s).items():
            assert v.tobytes() == resumed.parameters(s)[k].tobytes(), (s, k)
    assert s_whole.history[-1]["loss"] < s_whole.history[0]["loss"] * 1.5  # it trains, finitely
    with pytest.raises(dclens.Error, match="seqs_per_step"):
        F.train_sae(model, resumed, src, steps=8, seqs_per_step=2, checkpoint=ck, progress=False)


def test_evaluate_an_exact_dictionary_recovers_everything(model, toks):
    """W_enc = [I, -I], W_dec = [I; -I], ReLU: the reconstruction is the activation itself."""
    d = 32
    sae = F.SAE(F.SAEConfig(d_in=d, d_sae=2 * d, hook_name="blocks.0.hook_resid_post", apply_b_dec_to_input=False))
    eye = np.eye(d, dtype=np.float32)
    sae.set_parameters(W_enc=np.concatenate([eye, -eye], 1), W_dec=np.concatenate([eye, -eye], 0))
    r = F.evaluate(model, sae, F.TokenArrays(toks), n_batches=2, seqs_per_batch=3)
    assert r["explained_variance"] == pytest.approx(1.0, abs=1e-6)
    assert r["ce_with_sae"] == pytest.approx(r["ce_clean"], abs=1e-4)
    assert r["ce_zero_ablation"] > r["ce_clean"] + 0.01
    assert r["ce_loss_recovered"] == pytest.approx(1.0, abs=1e-3)
    assert r["tokens"] == 48 and 0 < r["l0"] < 2 * d


def test_transcoder_trains_and_evaluates(model, toks):
    cfg = F.SAEConfig(
        d_in=32,
        d_sae=64,
        arch="jumprelu",
        hook_name="blocks.1.mlp_input",
        hook_name_out="blocks.1.hook_mlp_out",
        sparsity_coef=1e-3,
    )
    tc = F.SAE(cfg, n_threads=1)
    st = F.train_sae(model, tc, F.TokenArrays(toks), steps=4, progress=False)
    assert st.step == 4 and all(np.isfinite(h["loss"]) for h in st.history)
    r = F.evaluate(model, tc, F.TokenArrays(toks), n_batches=1, start=40)
    assert np.isfinite(r["ce_with_sae"]) and r["tokens"] == 32


def test_activations_stream_is_the_cache(model, toks):
    (a,) = F.activations(model, F.TokenArrays(toks), 2, 3, ("blocks.0.resid_post",))
    _, cache = model.run_with_cache(toks[2:5], names=["blocks.0.resid_post"])
    np.testing.assert_array_equal(a, cache["blocks.0.resid_post"].reshape(-1, 32))
    assert F.activations(model, F.TokenArrays(toks), 64, 3, ("blocks.0.resid_post",)) is None


def test_token_function_and_text_sources(tmp_path):
    src = F.TokenArrays(lambda i: np.arange(i, i + 5) % 50, n=10)
    np.testing.assert_array_equal(src.batch(8, 4), [np.arange(8, 13), np.arange(9, 14)])
    m = dclens.load("dcpythia-tiny")
    text = tmp_path / "t.txt"
    text.write_text("Ruth has a sweater.\n\nSteven has a taxi and a hat.\n")
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"text": "Ruth has a sweater."}\n{"text": "Steven has a taxi and a hat."}\n')
    a, b = F.TextFile(text, m, 4), F.JsonlFile(jl, m, 4)
    whole = a.batch(0, 100)
    np.testing.assert_array_equal(whole, b.batch(0, 100))
    np.testing.assert_array_equal(np.concatenate([a.batch(0, 1), a.batch(1, 1), a.batch(2, 5)]), whole)
    np.testing.assert_array_equal(a.batch(1, 1), whole[1:2])  # from any position
    ids = np.concatenate(
        [
            m.to_tokens("Ruth has a sweater.", prepend_bos=True),
            m.to_tokens("Steven has a taxi and a hat.", prepend_bos=True),
        ]
    )
    assert whole.shape[1] == 4 and len(ids) // 4 == len(whole) > 1
    np.testing.assert_array_equal(whole.ravel(), ids[: whole.size])
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"txt": 3}\n')
    with pytest.raises(dclens.Error, match="line 2 has no string under key 'text'"):
        F.JsonlFile(tmp_path / "bad.jsonl", m, 4).batch(0, 10)


# ---------------------------------------------------------------- the SAELens format


@pytest.mark.parametrize("arch", ARCHS)
def test_saelens_round_trip(arch, tmp_path):
    sae = make_sae(arch)
    d = F.save(sae, tmp_path / arch)
    cfg = json.loads((tmp_path / arch / "cfg.json").read_text())
    assert cfg["hook_name"] == "blocks.0.hook_resid_post" and cfg["hook_layer"] == 0
    assert cfg["architecture"] == {"relu": "standard", "topk": "topk", "jumprelu": "jumprelu"}[arch]
    assert (cfg["activation_fn_kwargs"] == {"k": 5}) == (arch == "topk")
    t = F.read_safetensors(os.path.join(d, "sae_weights.safetensors"))
    assert sorted(t) == sorted(["W_enc", "b_enc", "W_dec", "b_dec"] + (["threshold"] if arch == "jumprelu" else []))
    back = F.load(d)
    assert back.cfg == sae.cfg
    x = np.random.default_rng(2).normal(0, 1, (10, 12)).astype(np.float32)
    np.testing.assert_allclose(back.run(x)["acts"], sae.run(x)["acts"], atol=1e-6)
    if arch == "jumprelu":
        np.testing.assert_allclose(t["threshold"], sae.threshold, rtol=1e-6)


def _hand_safetensors(path, tensors):
    """A safetensors file built byte by byte here (not by dclens's writer), F16 for b_enc."""
    header, blobs, off = {}, [], 0
    for k, (dt, a) in tensors.items():
        b = a.astype("<f2" if dt == "F16" else "<f4").tobytes()
        header[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_a_hand_written_saelens_file_loads(tmp_path, model):
    rng = np.random.default_rng(4)
    w = {
        "W_enc": rng.normal(0, 1, (32, 40)),
        "b_enc": np.full(40, 0.25),
        "W_dec": rng.normal(0, 1, (40, 32)),
        "b_dec": rng.normal(0, 1, 32),
    }
    cfg = {  # an older SAELens's spelling: hook_point, standard + activation_fn_str topk
        "architecture": "standard",
        "d_in": 32,
        "d_sae": 40,
        "hook_point": "blocks.1.hook_resid_pre",
        "hook_point_layer": 1,
        "activation_fn_str": "topk",
        "activation_fn_kwargs": {"k": 6},
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "model_name": "pythia-70m-deduped",
        "dtype": "float32",
        "device": "cpu",
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    _hand_safetensors(
        tmp_path / "sae_weights.safetensors", {k: ("F16" if k == "b_enc" else "F32", v) for k, v in w.items()}
    )
    sae = F.load(tmp_path)
    assert sae.cfg.arch == "topk" and sae.cfg.k == 6 and sae.cfg.hook_name == "blocks.1.resid_pre"
    F.check_fits(model, sae)
    x = rng.normal(0, 1, (8, 32))
    c = F.SAEConfig(d_in=32, d_sae=40, arch="topk", k=6)
    _, acts, recon = ref_forward({k: v.astype(np.float32).astype(np.float64) for k, v in w.items()}, c, x)
    np.testing.assert_allclose(sae.encode(x), acts, atol=1e-4)
    np.testing.assert_allclose(sae.forward(x), recon, atol=1e-4)


# ---------------------------------------------------------------- bad input


def test_bad_input_names_the_argument(model, tmp_path):
    with pytest.raises(dclens.Error, match="k must be in 1..d_sae"):
        F.SAEConfig(d_in=4, d_sae=8, arch="topk", k=9)
    with pytest.raises(dclens.Error, match="k must be in 1..d_sae"):  # the engine's own check
        EngineSAE(4, 0, 8, "topk", 9, True, False, 0.0, 0.1, 1)
    with pytest.raises(dclens.Error, match="d_sae must be >= 1"):
        EngineSAE(4, 0, 0, "relu", 0, True, False, 0.0, 0.1, 1)
    with pytest.raises(dclens.Error, match="arch must be one of"):
        F.SAEConfig(d_in=4, d_sae=8, arch="gated")
    sae = F.SAE(F.SAEConfig(d_in=48, d_sae=64, hook_name="blocks.0.resid_pre"))
    with pytest.raises(dclens.Error, match="d_in is 48 but hook blocks.0.resid_pre of this model has width 32"):
        F.check_fits(model, sae)
    with pytest.raises(dclens.Error, match="d_in is 48"):
        F.train_sae(model, sae, F.TokenArrays(np.zeros((4, 4), np.int32)), steps=1, progress=False)
    sae.cfg.hook_name = "blocks.0.no_such_hook"
    with pytest.raises(dclens.Error, match="no_such_hook"):
        F.check_fits(model, sae)
    sae.cfg.hook_name = "blocks.0.attn.pattern"
    with pytest.raises(dclens.Error, match="not one activation per position"):
        F.check_fits(model, sae)
    x = np.ones((3, 48), np.float32)
    x[1, 5] = np.nan
    with pytest.raises(dclens.Error, match="x row 1 holds NaN"):
        sae.encode(x)
    with pytest.raises(dclens.Error, match="x row 1 holds NaN"):
        sae.loss_and_grads(x)
    with pytest.raises(dclens.Error, match="x is empty"):
        sae.encode(np.zeros((0, 48), np.float32))
    with pytest.raises(dclens.Error, match="x must end in a dimension of 48"):
        sae.encode(np.zeros((2, 47), np.float32))
    with pytest.raises(dclens.Error, match="step must be >= 1"):
        sae.step(0, lr=0.1)
    sae.close()
    sae.close()
    with pytest.raises(dclens.Error, match="closed"):
        sae.encode(np.ones((1, 48), np.float32))


def test_files_of_another_format(tmp_path):
    with pytest.raises(dclens.Error, match="cfg.json is missing"):
        F.load(tmp_path)
    (tmp_path / "cfg.json").write_text('{"d_in": 4, "d_sae": 8, "hook_name": "blocks.0.hook_resid_pre"}')
    with open(tmp_path / "sae_weights.safetensors", "wb") as f:
        np.savez(f, a=np.zeros(3))  # a zip, not safetensors
    with pytest.raises(dclens.Error, match="is not a safetensors file"):
        F.load(tmp_path)
    (tmp_path / "sae_weights.safetensors").write_bytes(struct.pack("<Q", 6) + b"nojson" + b"\0" * 8)
    with pytest.raises(dclens.Error, match="header is not JSON"):
        F.load(tmp_path)
    _hand_safetensors(tmp_path / "sae_weights.safetensors", {"W_enc": ("F32", np.zeros((4, 8)))})
    with pytest.raises(dclens.Error, match="has no tensor b_enc"):
        F.load(tmp_path)
    (tmp_path / "cfg.json").write_text('{"architecture": "gated", "d_in": 4, "d_sae": 8, "hook_name": "x"}')
    with pytest.raises(dclens.Error, match="architecture 'gated'"):
        F.load(tmp_path)
    (tmp_path / "cfg.json").write_text("not json")
    with pytest.raises(dclens.Error, match="cfg.json is not JSON"):
        F.load(tmp_path)
    (tmp_path / "ck.npz").write_bytes(b"garbage")
    sae = F.SAE(F.SAEConfig(d_in=4, d_sae=8))
    with pytest.raises(dclens.Error, match="is not a dclens SAE checkpoint"):
        F.load_checkpoint(str(tmp_path / "ck.npz"), sae, F.TrainSAEConfig())
