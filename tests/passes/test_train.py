"""Training: loss falls on a small repeating corpus, checkpoints reload with
dclens.load and reproduce the trained logits, a run split over sittings equals
an uninterrupted one, AdamW matches its formula."""

import json
import os

import numpy as np
import pytest

import dclens
from dclens._engine import ffi, lib
from dclens.train.loop import TrainConfig, read_weights, train

from tolerances import U32


def _corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text("the cat sat on the mat. the dog sat on the log. " * 40)
    return str(p)


def _cfg(out, data, mt, **kw):
    base = dict(
        out=str(out),
        model_type=mt,
        n_layer=2,
        dim=32,
        n_head=4,
        seq_len=24,
        batch_size=4,
        steps=40,
        lr=3e-3,
        min_lr=3e-4,
        warmup=5,
        data=data,
        tokenizer="bytes",
        ckpt_every=20,
        log_every=10,
        progress=False,
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("mt", ["dcpythia", "gpt_neox"])
def test_loss_falls_and_checkpoint_reloads(tmp_path, mt):
    data = _corpus(tmp_path)
    final = train(_cfg(tmp_path / "run", data, mt))
    rows = [l.split(",") for l in (tmp_path / "run" / "loss.csv").read_text().split("\n")[1:] if l]
    losses = [float(r[1]) for r in rows]
    assert len(losses) == 40
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
    # the final checkpoint is a model dclens.load reads, with the trained weights
    m = dclens.load(final)
    assert m.config.model_type == mt
    last = sorted(d for d in os.listdir(tmp_path / "run") if d.startswith("step-"))[-1]
    st = json.loads((tmp_path / "run" / last / "train_state.json").read_text())
    assert st["step"] == 40
    toks = np.frombuffer(b"the cat sat on the", np.uint8).astype(np.int32)
    logits = m.forward(toks)
    # the training model's own forward after the last step: resume a 0-step sitting
    m2 = dclens.load(tmp_path / "run" / last)
    np.testing.assert_array_equal(m2.forward(toks), logits)
    # the trained model predicts the corpus: "the cat sat on the" -> " "
    assert int(np.argmax(logits[-1])) == ord(" ") or np.argmax(logits[-2]) == ord("e")
    assert os.path.exists(tmp_path / "run" / "train.log")
    assert "step 40/40" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.parametrize("mt", ["dcpythia", "gpt_neox"])
def test_resume_equals_uninterrupted(tmp_path, mt):
    data = _corpus(tmp_path)
    kw = dict(steps=12, ckpt_every=5)
    a = train(_cfg(tmp_path / "a", data, mt, **kw))
    c = _cfg(tmp_path / "b", data, mt, **kw)
    train(c, stop_after=7)  # checkpoints at 5 and 7, stops
    b = train(_cfg(tmp_path / "b", data, mt, **kw))  # resumes from 7
    wa, wb = read_weights(dclens.load(a)), read_weights(dclens.load(b))
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)
    la = (tmp_path / "a" / "loss.csv").read_text().split("\n")
    lb = (tmp_path / "b" / "loss.csv").read_text().split("\n")
    assert [l.split(",")[1] for l in la[1:] if l] == [l.split(",")[1] for l in lb[1:] if l]


def test_adamw_step_matches_formula(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="gpt_neox", vocab=24)
    m = dclens.load(d)
    assert lib.dcs_model_make_trainable(m._m) == 0
    from dclens.analysis.grad import param_table

    tab = param_table(m)
    P = int(lib.dcs_param_total(m._m))
    w0 = read_weights(m)
    rng = np.random.default_rng(0)
    g = rng.standard_normal(P).astype(np.float32)
    mom = rng.standard_normal(P).astype(np.float32) * 0.1
    var = np.abs(rng.standard_normal(P)).astype(np.float32) * 0.1
    mom0, var0 = mom.copy(), var.copy()
    hp = ffi.new("dcs_adamw *")
    hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay = 0.01, 0.9, 0.95, 1e-8, 0.1
    p = lambda a: ffi.cast("float *", ffi.from_buffer(a))
    assert lib.dcs_adamw_step(m._m, p(g), p(mom), p(var), 3, hp) == 0
    w1 = read_weights(m)
    for name, off, n, decay in tab:
        gg, mm, vv = (x[off : off + n].astype(np.float64) for x in (g, mom0, var0))
        mm = 0.9 * mm + 0.1 * gg
        vv = 0.95 * vv + 0.05 * gg * gg
        upd = (mm / (1 - 0.9**3)) / (np.sqrt(vv / (1 - 0.95**3)) + 1e-8)
        w = w0[name].ravel().astype(np.float64)
        exp = w - 0.01 * (upd + (0.1 if decay else 0.0) * w)
        # no reduction: about 10 float32 operations per element, each rounding by
        # at most u (U32) of its operands' sizes (a sum that cancels, as the
        # momentum 0.9 m + 0.1 g may, keeps the error of its terms), and the
        # hyperparameters held as float32 (each up to u off), amplified by the
        # bias corrections' cancellation 1 - beta^t (beta^t / (1 - beta^t) <= 6
        # at t = 3): 10 + 6 * 3 < 32 u of the terms' sizes
        terms = (
            (0.9 * np.abs(mom0[off : off + n]) + 0.1 * np.abs(gg)) / (1 - 0.9**3) / (np.sqrt(vv / (1 - 0.95**3)) + 1e-8)
        )
        bound = 32 * U32 * (np.abs(w) + 0.01 * (terms + 0.1 * np.abs(w)))
        assert np.all(np.abs(w1[name].ravel() - exp) <= bound), name
        assert decay == (w0[name].ndim >= 2)


def test_train_errors(tmp_path):
    with pytest.raises(dclens.Error, match="model_type"):
        train(_cfg(tmp_path / "x", "synth", "llama"))
    with pytest.raises(dclens.Error, match="multiple"):
        train(_cfg(tmp_path / "x", "synth", "dcpythia", dim=30))
    with pytest.raises(dclens.Error, match="neither"):
        train(_cfg(tmp_path / "x", str(tmp_path / "missing.txt"), "dcpythia"))


def test_cli_train_synth(tmp_path, capsys):
    from dclens.cli.commands import main

    rc = main(
        [
            "train",
            "--out",
            str(tmp_path / "r"),
            "--n-layer",
            "1",
            "--dim",
            "32",
            "--n-head",
            "4",
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--steps",
            "3",
            "--data",
            "synth:1",
            "--no-progress",
            "--ckpt-every",
            "2",
        ]
    )
    assert rc == 0
    assert "checkpoint:" in capsys.readouterr().out
    m = dclens.load(tmp_path / "r" / "final")
    assert m.config.vocab == 256


def test_lines_mode_jsonl_with_tokenizer(tmp_path):
    """One record per sequence, padded (padding not scored), a tokenizer.json,
    a windowed dcpythia; the loss falls and the checkpoint keeps the tokenizer."""
    recs = [
        '{"task_id": "t", "texts": "\\nthe cat is [ an animal]\\nthe dog is [ an animal]\\n"}',
        '{"task_id": "t", "texts": "\\nred is [ a colour]\\nblue is [ a colour]\\n"}',
    ] * 20
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(recs) + "\n")
    c = _cfg(tmp_path / "run", str(p), "dcpythia", lines=True, tokenizer="bpe:300", seq_len=32, window_size=4, steps=40)
    final = train(c)
    losses = [float(l.split(",")[1]) for l in (tmp_path / "run" / "loss.csv").read_text().split("\n")[1:] if l]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
    m = dclens.load(final)
    assert m.config.local_layers == (0,) and m.config.window_size == 4
    ids = m.to_tokens("red is a colour")
    assert m.forward(ids).shape == (len(ids), m.config.vocab)
    from dclens.train.loop import batch

    toks = np.load(tmp_path / "run" / "tokens.npy")
    offs = np.load(tmp_path / "run" / "offsets.npy")
    o2 = np.stack([offs[:-1], offs[1:]], 1)
    x, y = batch(toks, c, 3, o2)
    for b in range(c.batch_size):
        n = int((y[b] >= 0).sum())
        assert n > 3 and (y[b, n:] == -1).all() and (x[b, 1:n] == y[b, : n - 1]).all()
