"""DCFormer++ (model_type "dcformer", docs/dcformer-spec.md): the engine against
logits the official module computed on checkpoints it wrote
(tests/data/dcformer_official, scripts/official_dcformer_logits.py), and against
the independent numpy reference (tests/reference_dcformer.py) on make-tiny
checkpoints in every official layout and dtype; hooks, interventions, the
decoder, analysis and errors."""

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import dclens
from dclens import interventions as iv
from dclens.analysis.generate import Decoder

from conftest import ROOT, rel_err
from reference_dcformer import hook_names_dcformer, ref_forward_dcformer

OFFICIAL = os.path.join(ROOT, "tests", "data", "dcformer_official")
CASES = json.loads(Path(OFFICIAL, "cases.json").read_text())["cases"]
# float32 through <= 4 layers and 300 positions: the official module's rotary
# angles are float32 products (position * frequency), ~1e-5 relative at T = 300
TOL = 1e-4


def _load(d):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dclens.LoadWarning)
        return dclens.load(d)


def _copy_with(src, tmp_path, **cfg_over):
    d = str(tmp_path / os.path.basename(src))
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("official_logits.npy"))
    cfg = json.loads(Path(d, "config.json").read_text())
    cfg.update(cfg_over)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


@pytest.mark.parametrize("case", [c for c in CASES if c["path"] == "official_inference"], ids=lambda c: c["name"])
def test_official_inference_logits(case, tmp_path):
    """The official inference masks keep window_size - 1 past keys (spec 6.1):
    its logits are the engine's with window_size - 1, to float32 rounding, on
    typed (LGLL) and null layouts past the 256 window, mgate and q/k norm on
    and off, the .bin / safetensors / wq-wk-wv split files it wrote."""
    src = os.path.join(OFFICIAL, case["name"])
    ref = np.load(os.path.join(src, "official_logits.npy"))
    toks, pos = np.array(case["tokens"]), case["positions"]
    w = case["window_size"]
    d = _copy_with(src, tmp_path, **({"window_size": w - 1} if w else {}))
    lg = _load(d).forward(toks)[pos]
    assert rel_err(lg, ref) <= TOL
    if w and len(toks) > w:  # the window convention is what makes them equal
        assert rel_err(_load(src).forward(toks)[pos], ref) > 1e-2


def test_official_training_path_keeps_window_size_keys(tmp_path):
    """The official training path masks t - s <= window_size, the engine's
    convention; it rounds probabilities to bfloat16 (spec 6.4), so agreement is
    to bfloat16 rounding, and window_size - 1 is far off."""
    case = next(c for c in CASES if c["path"] == "official_training")
    src = os.path.join(OFFICIAL, case["name"])
    ref = np.load(os.path.join(src, "official_logits.npy"))
    toks, pos = np.array(case["tokens"]), case["positions"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = dclens.load(src)
    assert any("is_training" in str(w.message) for w in seen)
    assert rel_err(model.forward(toks)[pos], ref) <= 0.02  # bf16 probabilities: ~2^-9 each
    assert rel_err(_load(_copy_with(src, tmp_path, window_size=case["window_size"] - 1)).forward(toks)[pos], ref) > 0.2


def test_official_checkpoint_config_and_notes():
    src = os.path.join(OFFICIAL, "lgll_mgate_qknorm")
    with pytest.warns(dclens.LoadWarning, match="window_size - 1"):
        model = dclens.load(src)
    c = model.config
    assert (c.model_type, c.norm, c.mlp, c.mgate_dim, c.rotary_dim, c.parallel_residual) == (
        "dcformer",
        "rms",
        "swiglu",
        4,
        c.head_dim,
        False,
    )
    assert c.local_layers == (0, 2, 3)  # LGLL
    assert not c.tie_embeddings and not c.linear_bias


# ------------------------------------------------------------------ make-tiny x reference

LAYOUTS = [
    dict(dtype="float32", fmt="safetensors", shards=1, mgate_dim=4, use_qk_norm=True, window_type="LGLL", n_layer=4),
    dict(dtype="float16", fmt="torch", shards=2, mgate_dim=0, use_qk_norm=False, window_type=None, n_layer=2),
    dict(
        dtype="bfloat16",
        fmt="safetensors",
        shards=2,
        mgate_dim=8,
        use_qk_norm=True,
        window_type="LG",
        n_layer=2,
        fused_qkv=False,
        extra_derived=True,
    ),
    dict(
        dtype="float32",
        fmt="torch",
        shards=1,
        mgate_dim=2,
        use_qk_norm=True,
        window_size=None,
        n_layer=2,
        fused_qkv=False,
        share_storage=True,
    ),
]


@pytest.mark.parametrize("kw", LAYOUTS, ids=["f32-st-lgll", "f16-bin2-null", "bf16-st2-split", "f32-bin-global"])
def test_reference_every_layout(tiny_factory, kw):
    kw = dict(dict(window_size=3, intermediate=64, dim=32, n_head=4, vocab=64, seed=27), **kw)
    d, sd, cfg = tiny_factory(model_type="dcformer", **kw)
    model = _load(d)
    toks = np.random.default_rng(1).integers(0, 64, size=14)
    logits, cache = model.run_with_cache(toks, names=model.hook_names)
    ref, rcache = ref_forward_dcformer(sd, cfg, toks, cache=True)
    assert rel_err(logits, ref) <= 2e-5
    assert model.hook_names == hook_names_dcformer(cfg)  # forward order
    assert sorted(cache.keys()) == sorted(model.hook_names)
    for name in rcache:
        assert rel_err(cache[name], rcache[name]) <= 5e-5, name


def test_config_defaults(tmp_path):
    """DCFormerConfig's defaults: intermediate_size = the multiple of 256 at or
    above int(8 dim / 3), rope_base 500000, norm_eps 1e-5, 44 mgate groups."""
    from dclens.testing.make_tiny import make_tiny

    sd, cfg = make_tiny(str(tmp_path), "dcformer", dim=32, n_head=4, vocab=64, intermediate=256, mgate_dim=44 * 0)
    for k in ("intermediate_size", "rope_base", "norm_eps", "mgate_dim"):
        cfg.pop(k)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    model = _load(str(tmp_path))
    c = model.config
    assert (c.d_ff, c.rope_base, c.norm_eps, c.mgate_dim) == (256, 500000.0, pytest.approx(1e-5), 0)
    toks = np.arange(10)
    assert rel_err(model.forward(toks), ref_forward_dcformer(sd, cfg, toks)) <= 2e-5


def test_gate_hook_and_interventions(tiny_factory):
    """mlp.gate is a hook point: a written gate is the one applied (here a
    uniform gate, and one group switched off), as in the reference."""
    d, sd, cfg = tiny_factory(
        model_type="dcformer",
        n_layer=2,
        dim=32,
        n_head=4,
        vocab=64,
        intermediate=64,
        mgate_dim=4,
        window_size=3,
        seed=5,
    )
    model = _load(d)
    toks = np.arange(11) % 64

    def gate_fn(g):
        g = np.full_like(g, 0.25)
        g[..., 1] = 0.0
        return g

    got = model.run_with_hooks(
        toks,
        fwd_hooks=[("blocks.1.mlp.gate", lambda a, hook: gate_fn(a)), iv.scale(model, "blocks.0.mlp.pre_linear", 0.5)],
    )
    ref = ref_forward_dcformer(
        sd, cfg, toks, interventions={"blocks.1.mlp.gate": gate_fn, "blocks.0.mlp.pre_linear": lambda a: 0.5 * a}
    )
    assert rel_err(got, ref) <= 2e-5
    assert rel_err(got, model.forward(toks)) > 1e-3
    with pytest.raises(dclens.Error, match="mgate"):
        _load(tiny_factory(model_type="dcformer", mgate_dim=0, seed=6)[0]).run_with_cache(
            toks, names_filter=["blocks.0.mlp.gate"]
        )
    with pytest.raises(dclens.Error, match="SwiGLU"):
        _load(tiny_factory(model_type="dcpythia", seed=7)[0]).run_with_cache(
            toks, names_filter=["blocks.0.mlp.pre_linear"]
        )


@pytest.mark.parametrize("chunks", [[1] * 16, [5, 1, 7, 3]], ids=["steps", "mixed"])
def test_decoder_equals_full_forward(tiny_factory, chunks):
    d, _, _ = tiny_factory(
        model_type="dcformer", n_layer=4, window_type="LGLL", window_size=3, mgate_dim=4, intermediate=64, seed=8
    )
    model = _load(d)
    toks = np.random.default_rng(2).integers(0, model.config.vocab, size=16)
    full = model.forward(toks)
    dec, out, at = Decoder(model), [], 0
    for n in chunks:
        out.append(dec.step(toks[at : at + n]))
        at += n
    assert rel_err(np.concatenate(out), full) <= 2e-5
    hooks = [iv.scale(model, "blocks.1.mlp.gate", 2.0), iv.ablate_head(model, 0, 1)]
    want = model.run_with_hooks(toks, fwd_hooks=hooks)
    dec = Decoder(model)
    inc = np.concatenate([dec.step(toks[:6], fwd_hooks=hooks)] + [dec.step([t], fwd_hooks=hooks) for t in toks[6:]])
    assert rel_err(inc, want) <= 2e-5
    assert list(model.generate(toks[:4], max_new_tokens=3)[:4]) == list(toks[:4])


def test_analysis_on_rmsnorm(tiny_factory):
    """DLA components sum to the logit with RMSNorm (no centring); routing and
    circuits run; the composed pattern equals C^T applied to the scores."""
    from dclens import circuits

    d, sd, cfg = tiny_factory(
        model_type="dcformer",
        n_layer=2,
        dim=32,
        n_head=4,
        vocab=64,
        intermediate=64,
        mgate_dim=4,
        window_size=None,
        seed=9,
    )
    model = _load(d)
    toks = np.arange(9)
    logits, cache = model.run_with_cache(toks)
    from dclens.cache import dla

    attrs, labels = dla(cache, 5, pos=-1)
    assert abs(float(np.sum(attrs)) - float(logits[-1, 5])) <= 1e-4 * max(1.0, abs(float(logits[-1, 5])))
    R = model.routing_matrix(toks, layer=1, phase="post", query=8)
    assert R.shape == (4, 4)
    ov = circuits.ov_logits(model, 1, 2, [3, 4])
    assert ov.shape == (2, 64) and np.isfinite(ov).all()
    # ov_logits by hand: e + MLP_0(RMS(e)) (SwiGLU with the gate), RMS_attn,1, W_V W_O, unembed
    ref_sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    e = ref_sd["tok_embeddings.weight"][[3, 4]]
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg["norm_eps"]) * w
    h = rms(e, ref_sd["layers.0.ffn_norm.weight"])
    u, u3 = h @ ref_sd["layers.0.feed_forward.w1.weight"].T, h @ ref_sd["layers.0.feed_forward.w3.weight"].T
    g = np.exp(h @ ref_sd["layers.0.feed_forward.mg.weight"].T)
    g /= g.sum(-1, keepdims=True)
    post = (u / (1 + np.exp(-u)) * u3).reshape(2, 4, -1) * g[:, :, None]
    e = e + post.reshape(2, -1) @ ref_sd["layers.0.feed_forward.w2.weight"].T
    Dh = 8
    wv = ref_sd["layers.1.attention.wqkv.weight"][64 + 2 * Dh : 64 + 3 * Dh]
    wo = ref_sd["layers.1.attention.wo.weight"][:, 2 * Dh : 3 * Dh]
    want = (rms(e, ref_sd["layers.1.attention_norm.weight"]) @ wv.T @ wo.T) @ ref_sd["output.weight"].T
    assert rel_err(ov, want) <= 1e-5
    qk = circuits.qk_circuit(model, 1, 0).full()
    wq, wk = ref_sd["layers.1.attention.wqkv.weight"][:Dh], ref_sd["layers.1.attention.wqkv.weight"][32 : 32 + Dh]
    assert rel_err(qk, wq.T @ wk) <= 1e-6


def test_errors(tiny_factory, tmp_path):
    d, _, cfg = tiny_factory(model_type="dcformer", n_layer=2, mgate_dim=4, intermediate=64, seed=10)
    bad = str(tmp_path / "bad")
    shutil.copytree(d, bad)
    for over, match in (
        (dict(mgate_dim=5), "mgate_dim 5 does not divide intermediate_size 64"),
        (dict(n_local_heads=2), "grouped-query"),
        (dict(window_type="LLG"), "window_type"),
    ):
        with open(os.path.join(bad, "config.json"), "w") as f:
            json.dump(dict(cfg, **over), f)
        with pytest.raises(dclens.Error, match=match):
            dclens.load(bad)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda sd: sd.pop("layers.1.feed_forward.w3.weight"), "missing tensor 'layers.1.feed_forward.w3.weight'"),
        (lambda sd: sd.pop("layers.0.feed_forward.mg.weight"), "missing tensor 'layers.0.feed_forward.mg.weight'"),
        (lambda sd: sd.update({"norm.bias": np.zeros(32, np.float32)}), "unexpected tensor 'norm.bias'"),
        (
            lambda sd: sd.update({"layers.0.feed_forward.w3.weight": np.zeros((64, 31), np.float32)}),
            r"'layers.0.feed_forward.w3.weight' has shape \[64, 31\], expected \[64, 32\]",
        ),
    ],
    ids=["no-w3", "no-mg", "norm-bias", "w3-shape"],
)
def test_bad_checkpoints_are_named(tiny_factory, tmp_path, change, match):
    from dclens.testing.checkpoint import write_safetensors

    d, sd, cfg = tiny_factory(model_type="dcformer", n_layer=2, mgate_dim=4, intermediate=64, seed=15)
    sd = dict(sd)
    change(sd)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    write_safetensors(str(bad / "model.safetensors"), {k: ("F32", v.shape, v) for k, v in sd.items()})
    with pytest.raises(dclens.Error, match=match):
        dclens.load(str(bad))


def test_make_tiny_cli(tmp_path):
    out = str(tmp_path / "t")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dclens.cli",
            "make-tiny",
            out,
            "--model-type",
            "dcformer",
            "--mgate-dim",
            "4",
            "--intermediate",
            "64",
            "--dtype",
            "bfloat16",
            "--format",
            "torch",
            "--shards",
            "2",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    model = _load(out)
    assert model.config.model_type == "dcformer" and model.config.mgate_dim == 4
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dclens.cli",
            "make-tiny",
            out,
            "--model-type",
            "dcformer",
            "--n-head",
            "3",
            "--dim",
            "24",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "even --n-head" in r.stderr


# ------------------------------------------------------------------ gradients

GRAD_TOL, EPS = 2e-3, 1e-4  # as tests/passes/test_grad.py: float32 engine vs float64 central differences


def _fd_target(sd, cfg, toks, target):
    def f(sd_, iv=None):
        lg = ref_forward_dcformer(sd_, cfg, toks, interventions=iv)
        if target[0] == "loss":
            row = lg[:-1]
            mx = row.max(-1, keepdims=True)
            return float(np.mean(np.log(np.exp(row - mx).sum(-1)) + mx[:, 0] - row[np.arange(len(row)), toks[1:]]))
        p, t = target[1], target[2]
        return lg[p, t] - (np.log(np.exp(lg[p] - lg[p].max()).sum()) + lg[p].max())

    return f


def _bump(ix, step):
    """An intervention adding `step` at index ix."""
    return lambda x: np.add.at(x, ix, step) or x


def _close(pairs, what):
    e = np.array(pairs, np.float64)
    err = np.abs(e[:, 0] - e[:, 1]).max() / max(np.abs(e[:, 0]).max(), 1e-3)
    assert err <= GRAD_TOL, "%s: engine vs central differences rel err %.2e" % (what, err)


GRAD_KW = dict(model_type="dcformer", n_layer=2, vocab=24, intermediate=64, mgate_dim=4, window_size=3, seed=12)


def test_hook_gradients_match_finite_differences(tiny_factory):
    d, sd, cfg = tiny_factory(**GRAD_KW)
    m = _load(d)
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 24, 7)
    target = ("logprob", 5, 3)
    f = _fd_target(sd, cfg, toks, target)
    names = [n for n in m.hook_names if not n.endswith(("attn.pattern",))]
    g = m.gradients(toks, target, names)
    _, cache = ref_forward_dcformer(sd, cfg, toks, cache=True)
    for n in names:
        a = cache[n]
        assert g[n].shape == a.shape, n
        idx = [tuple(rng.integers(0, s) for s in a.shape) for _ in range(2)]
        nz = np.argwhere(np.abs(g[n]) > 1e-6)
        idx += [tuple(nz[i]) for i in rng.integers(0, len(nz), 2)] if len(nz) else []
        _close([((f(sd, {n: _bump(ix, EPS)}) - f(sd, {n: _bump(ix, -EPS)})) / (2 * EPS), g[n][ix]) for ix in idx], n)


def test_half_weights_gradients_match_finite_differences(tiny_factory):
    """fp16 weights stay 16-bit in the tape (gemm_w reads w1/w3/w2 as stored):
    hook and SwiGLU parameter gradients against central differences of the
    reference on the stored (rounded) weights."""
    d, sd, cfg = tiny_factory(**dict(GRAD_KW, dtype="float16"))
    m = _load(d)
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 24, 6)
    target = ("logprob", 4, 7)
    f = _fd_target(sd, cfg, toks, target)
    names = ["blocks.0.mlp.pre_linear", "blocks.1.mlp.gate", "blocks.0.resid_pre"]
    params = ["layers.0.feed_forward.w3.weight", "layers.1.feed_forward.w1.weight"]
    g = m.gradients(toks, target, names + params)
    for n in names:
        nz = np.argwhere(np.abs(g[n]) > 1e-6)
        idx = [tuple(nz[i]) for i in rng.integers(0, len(nz), 3)]
        _close([((f(sd, {n: _bump(ix, EPS)}) - f(sd, {n: _bump(ix, -EPS)})) / (2 * EPS), g[n][ix]) for ix in idx], n)
    for canon in params:
        base = np.asarray(sd[canon], np.float64)
        flat = g[canon].ravel()
        pairs = []
        for i in np.argsort(-np.abs(flat))[:3]:
            vals = []
            for s in (EPS, -EPS):
                p = base.copy().ravel()
                p[i] += s
                vals.append(f(dict(sd, **{canon: p.reshape(base.shape)})))
            pairs.append(((vals[0] - vals[1]) / (2 * EPS), flat[i]))
        _close(pairs, "float16 " + canon)


def test_parameter_gradients_match_finite_differences(tiny_factory):
    d, sd, cfg = tiny_factory(**GRAD_KW)
    m = _load(d)
    rng = np.random.default_rng(2)
    toks = rng.integers(0, 24, 6)
    f = _fd_target(sd, cfg, toks, ("loss",))
    from dclens.analysis.grad import param_table

    names = [r[0] for r in param_table(m)]
    assert "layers.1.feed_forward.w3.weight" in names and "layers.0.feed_forward.mg.weight" in names
    g = m.gradients(toks, ("loss",), names)
    for canon in names:
        base = np.asarray(sd[canon], np.float64)
        flat = g[canon].ravel()
        pairs = []
        for i in list(rng.integers(0, flat.size, 2)) + list(np.argsort(-np.abs(flat))[:2]):
            vals = []
            for s in (EPS, -EPS):
                p = base.copy().ravel()
                p[i] += s
                vals.append(f(dict(sd, **{canon: p.reshape(base.shape)})))
            pairs.append(((vals[0] - vals[1]) / (2 * EPS), flat[i]))
        _close(pairs, canon)


def test_integrated_gradients_completeness(tiny_factory):
    """IG at the group gate and the heads: attributions sum to F(a) - F(0)
    up to the Riemann gap, which shrinks with the steps."""
    d, _, _ = tiny_factory(**GRAD_KW)
    m = _load(d)
    toks = np.arange(8) % 24
    at = ["blocks.1.mlp.gate", "blocks.1.attn.head_out"]
    coarse = m.attribute(toks, ("logprob", -1, 3), at=at, method="ig", steps=4)
    fine = m.attribute(toks, ("logprob", -1, 3), at=at, method="ig", steps=64)
    for n in at:
        total = abs(float(np.sum(fine.attributions[n])))
        assert total > 1e-3, n
        assert abs(fine.gap[n]) <= 0.02 * total + 1e-4, n
        assert abs(fine.gap[n]) <= abs(coarse.gap[n]) + 1e-6, n
    assert fine.per_head["blocks.1.attn.head_out"].shape == (4,)


def test_spec_names_the_hooks(tiny_factory):
    """docs/dcformer-spec.md section 7 names exactly the hooks DCFormer++ has
    beyond DCPythia's."""
    import re

    spec = Path(ROOT, "docs", "dcformer-spec.md").read_text()
    sec = spec[spec.index("## 7. Hooks") : spec.index("## 8.")]
    named = set(re.findall(r"blocks\.\{l\}\.([a-z_.]+[a-z])", sec))
    dcf = _load(tiny_factory(model_type="dcformer", mgate_dim=4, intermediate=64, seed=13)[0])
    dcp = _load(tiny_factory(model_type="dcpythia", seed=13)[0])
    suffix = lambda names: {n.split(".", 2)[2] for n in names if n.startswith("blocks.0.")}
    assert named == suffix(dcf.hook_names) - suffix(dcp.hook_names) == {"mlp.pre_linear", "mlp.gate"}


def test_training_loss_falls_and_reloads(tmp_path):
    """dclens train --model-type dcformer: the loss falls on a repeating corpus
    and the checkpoint is a DCFormer++ dclens.load reads (with its gate)."""
    from dclens.train.loop import TrainConfig, train

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. the dog sat on the log. " * 40)
    final = train(
        TrainConfig(
            out=str(tmp_path / "run"),
            model_type="dcformer",
            n_layer=2,
            dim=32,
            n_head=4,
            d_ff=64,
            mgate_dim=4,
            window_size=4,
            seq_len=24,
            batch_size=4,
            steps=30,
            lr=3e-3,
            min_lr=3e-4,
            warmup=5,
            data=str(corpus),
            tokenizer="bytes",
            ckpt_every=30,
            log_every=10,
            progress=False,
        )
    )
    losses = [float(l.split(",")[1]) for l in (tmp_path / "run" / "loss.csv").read_text().split("\n")[1:] if l]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
    m = _load(final)
    assert (m.config.model_type, m.config.mgate_dim, m.config.local_layers) == ("dcformer", 4, (0,))


def test_patching_and_heatmaps(tiny_factory):
    """A head-patching sweep runs on DCFormer++; its cell (layer 1, head 2)
    equals a run that patches that head's clean z by hand; heatmaps render."""
    from dclens import patching

    d, _, _ = tiny_factory(model_type="dcformer", n_layer=2, intermediate=64, mgate_dim=4, window_size=3, seed=14)
    model = _load(d)
    clean, corrupted = np.arange(1, 9), np.array([5, 2, 3, 4, 9, 6, 7, 8])
    metric = patching.logit_diff(3, 4)
    r = patching.sweep(model, clean, corrupted, metric, over="layer,head", progress=False)
    assert r.values.shape == (2, 4)
    assert r.clean == pytest.approx(metric(model.forward(clean)), rel=1e-5, abs=1e-5)
    _, cache = model.run_with_cache(clean, names_filter=["blocks.1.attn.z"])
    z = cache["blocks.1.attn.z"]
    one = model.run_with_hooks(corrupted, fwd_hooks=[("blocks.1.attn.z", lambda a, hook: _put_head(a, z, 2))])
    assert metric(one) == pytest.approx(r.values[1, 2], rel=1e-4, abs=1e-4)
    png = dclens.attention_heatmap(model, clean, layer=0, hook="pattern_composed")
    assert bytes(png.data if hasattr(png, "data") else png)[:8] == b"\x89PNG\r\n\x1a\n"


def _put_head(a, z, head):
    a = a.copy()
    a[..., head, :] = z[..., head, :]
    return a


def test_synth_uses_the_checkpoints_tokenizer(tmp_path):
    """dclens synth on a DCFormer++ directory with its own tokenizer.json."""
    from dclens.testing.make_tiny import make_tiny

    tok = os.path.join(ROOT, "..", "shared", "data", "gpt-neox-20b-tokenizer.json")
    if not os.path.exists(tok):
        pytest.skip("../shared/data is not there")
    d = str(tmp_path / "m")
    make_tiny(d, "dcformer", vocab=50304, dim=16, n_head=4, intermediate=32, mgate_dim=4, tokenizer=tok)
    r = subprocess.run(
        [sys.executable, "-m", "dclens.cli", "synth", "--model", d, "--limit", "2", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["lines"] == 2 and res["skipped_lines"] == 0 and res["per_task"]
