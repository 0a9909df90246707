"""Training runs that cannot corrupt themselves (issue 22): the run directory
records its options before the first step; a resume with an option that
shapes the model, tokenizer, data or schedule is refused in one line naming
each; sitting options may change and the log says so; a run made before
run.json existed is checked against its newest checkpoint; checkpoints are
staged and renamed into place; a damaged newest checkpoint is named and the
previous one offered."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dclens
from dclens.train import loop as T
from dclens.train.loop import TrainConfig, read_weights, train


def _corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text("abcabd abcabd abcabe " * 30)
    return str(p)


def _cfg(out, data, **kw):
    base = dict(
        out=str(out),
        model_type="dcpythia",
        n_layer=1,
        dim=16,
        n_head=2,
        seq_len=8,
        batch_size=2,
        steps=6,
        lr=3e-3,
        min_lr=3e-4,
        warmup=1,
        data=data,
        tokenizer="bytes",
        ckpt_every=2,
        log_every=1,
        keep=3,
        progress=False,
    )
    base.update(kw)
    return TrainConfig(**base)


def _log(out):
    return Path(out, "train.log").read_text()


def _steps(out):
    return sorted(d for d in os.listdir(out) if d.startswith("step-"))


def test_record_written_before_first_step(tmp_path):
    data = _corpus(tmp_path)
    c = _cfg(tmp_path / "r", data)
    train(c, stop_after=0)
    rec = json.loads((tmp_path / "r" / "run.json").read_text())
    assert rec["options"]["dim"] == 16 and rec["options"]["data"] == os.path.abspath(data)
    assert rec["vocab"] == 256
    assert _steps(tmp_path / "r") == ["step-000000"]


def test_resume_with_other_architecture_refused(tmp_path):
    data = _corpus(tmp_path)
    out = tmp_path / "r"
    train(_cfg(out, data), stop_after=4)
    before = {d: sorted(os.listdir(out / d)) for d in _steps(out)}
    with pytest.raises(dclens.Error) as ei:
        train(_cfg(out, data, dim=32, n_head=4, lr=1e-2))
    msg = str(ei.value)
    assert "\n" not in msg
    for part in (
        "--dim 32 (the run: 16)",
        "--n-head 4 (the run: 2)",
        "--lr 0.01 (the run: 0.003)",
        str(out / "run.json"),
    ):
        assert part in msg, msg
    # nothing written: same checkpoints, newest still step 4
    assert {d: sorted(os.listdir(out / d)) for d in _steps(out)} == before
    assert json.loads((out / "step-000004" / "train_state.json").read_text())["step"] == 4


@pytest.mark.parametrize(
    "opt",
    [
        dict(tokenizer="bpe:300"),
        dict(seed=5),
        dict(lines=True),
        dict(rank=3),
        dict(window_size=4),
        dict(model_type="gpt_neox"),
        dict(warmup=2),
        dict(d_ff=32),
        dict(seq_len=12),
        dict(batch_size=3),
    ],
)
def test_each_shaping_option_refused(tmp_path, opt):
    data = _corpus(tmp_path)
    out = tmp_path / "r"
    train(_cfg(out, data), stop_after=2)
    k = next(iter(opt))
    with pytest.raises(dclens.Error, match="--%s " % k.replace("_", "-")):
        train(_cfg(out, data, **opt))


def test_sitting_options_accepted_and_logged(tmp_path):
    data = _corpus(tmp_path)
    out = tmp_path / "r"
    train(_cfg(out, data), stop_after=2)
    # d_ff 0 and 64 are the same model (4 * dim): not a difference
    final = train(_cfg(out, data, steps=8, n_threads=1, log_every=2, ckpt_every=4, keep=2, d_ff=64))
    log = _log(out)
    assert "resume: options compared with %s" % (out / "run.json") in log
    assert "changed for this sitting: --steps 8 (the run: 6)" in log
    assert "--n-threads 1 (the run: 0)" in log and "--d-ff" not in log
    assert json.loads(Path(final, "train_state.json").read_text())["step"] == 8
    dclens.load(final)


def test_legacy_run_checked_against_its_checkpoint(tmp_path):
    """A run made before run.json: the newest checkpoint's train_state.json
    (and config.json) are what a resume is compared with, and the log says so."""
    data = _corpus(tmp_path)
    out = tmp_path / "r"
    a = train(_cfg(tmp_path / "a", data))  # uninterrupted
    train(_cfg(out, data), stop_after=4)
    os.remove(out / "run.json")  # as a run made before this change
    with pytest.raises(dclens.Error) as ei:
        train(_cfg(out, data, dim=32))
    assert "--dim 32 (the run: 16)" in str(ei.value)
    assert str(out / "step-000004" / "train_state.json") in str(ei.value)
    b = train(_cfg(out, data))
    log = _log(out)
    assert (
        "resume: options compared with %s and its config.json (a run made before run.json)"
        % (out / "step-000004" / "train_state.json")
    ) in log
    assert "wrote %s" % (out / "run.json") in log
    wa, wb = read_weights(dclens.load(a)), read_weights(dclens.load(b))
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


def test_legacy_checkpoint_config_contradicting_options(tmp_path):
    """A legacy checkpoint whose train_state.json records nothing usable: its
    config.json still stops a resume with another architecture."""
    data = _corpus(tmp_path)
    out = tmp_path / "r"
    train(_cfg(out, data), stop_after=2)
    os.remove(out / "run.json")
    st = out / "step-000002" / "train_state.json"
    Path(st).write_text(json.dumps({"step": 2, "loss": 1.0}))
    with pytest.raises(dclens.Error, match=r"config.json describes another model.*dim 32 \(the checkpoint: 16\)"):
        train(_cfg(out, data, dim=32))
    train(_cfg(out, data))
    assert "train_state.json records no options: only its config.json was compared" in _log(out)


def test_legacy_checkpoint_without_context_key_resumes(tmp_path):
    """Checkpoints written before config.json recorded max_position_embeddings
    (the context trained for: it shapes no weight) resume; a recorded value that
    differs is still refused."""
    data = _corpus(tmp_path)
    out = tmp_path / "r"
    train(_cfg(out, data), stop_after=2)
    os.remove(out / "run.json")
    cj = out / "step-000002" / "config.json"
    cfg = json.loads(Path(cj).read_text())
    ctx = cfg.pop("max_position_embeddings")
    Path(cj).write_text(json.dumps(cfg))
    final = train(_cfg(out, data))
    assert json.loads(Path(final, "train_state.json").read_text())["step"] == 6
    out2 = tmp_path / "r2"
    train(_cfg(out2, data), stop_after=2)
    os.remove(out2 / "run.json")
    cj = out2 / "step-000002" / "config.json"
    Path(cj).write_text(json.dumps(dict(json.loads(Path(cj).read_text()), max_position_embeddings=ctx + 1)))
    with pytest.raises(dclens.Error, match=r"max_position_embeddings %d \(the checkpoint: %d\)" % (ctx, ctx + 1)):
        train(_cfg(out2, data))


def test_damaged_newest_checkpoint_named_previous_offered(tmp_path):
    data = _corpus(tmp_path)
    out = tmp_path / "r"
    train(_cfg(out, data), stop_after=4)  # step-000000, 2, 4
    w = out / "step-000004" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(dclens.Error) as ei:
        train(_cfg(out, data))
    msg = str(ei.value)
    assert "newest checkpoint %s is damaged" % (out / "step-000004") in msg
    assert "the one before it, %s, is offered" % (out / "step-000002") in msg
    shutil.move(str(out / "step-000004"), str(out / "step-000004.damaged"))
    final = train(_cfg(out, data))  # resumes from step 2
    assert json.loads(Path(final, "train_state.json").read_text())["step"] == 6
    assert "start step 2 of 6" in _log(out)


@pytest.mark.parametrize("damage", ["optimizer", "state", "no_state", "step_mismatch"])
def test_damaged_newest_checkpoint_kinds(tmp_path, damage):
    data = _corpus(tmp_path)
    out = tmp_path / "r"
    train(_cfg(out, data), stop_after=4)
    d = out / "step-000004"
    if damage == "optimizer":
        (d / "optimizer.npz").write_bytes(b"PK\x03\x04 not a zip")
    elif damage == "state":
        (d / "train_state.json").write_text('{"step": 4,')
    elif damage == "no_state":
        os.remove(d / "train_state.json")
    else:
        (d / "train_state.json").write_text(json.dumps({"step": 3}))
    with pytest.raises(dclens.Error, match="newest checkpoint .*step-000004 is damaged .*step-000002, is offered"):
        train(_cfg(out, data))


def test_damaged_only_checkpoint(tmp_path):
    data = _corpus(tmp_path)
    out = tmp_path / "r"
    train(_cfg(out, data), stop_after=0)
    os.remove(out / "step-000000" / "model.safetensors")
    with pytest.raises(dclens.Error, match="there is no earlier checkpoint: start a new --out"):
        train(_cfg(out, data))


def test_crash_while_saving_leaves_previous_whole(tmp_path, monkeypatch):
    """A sitting killed while writing a checkpoint: the staging directory is
    never taken for a checkpoint, the previous ones are whole, and the next
    sitting resumes from the last whole one to the same weights."""
    data = _corpus(tmp_path)
    out = tmp_path / "r"
    a = train(_cfg(tmp_path / "a", data))
    real = np.savez

    def crash(path, **kw):
        if "step-000004" in str(path):
            real(path, **kw)
            raise KeyboardInterrupt("killed")
        return real(path, **kw)

    monkeypatch.setattr(T.np, "savez", crash)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(out, data))
    monkeypatch.setattr(T.np, "savez", real)
    assert _steps(out) == ["step-000000", "step-000002"]
    assert os.path.isdir(out / ".tmp-step-000004")
    os.makedirs(out / ".tmp-step-000008")  # an older crash's leftover
    b = train(_cfg(out, data))
    assert not os.path.exists(out / ".tmp-step-000008")
    assert not os.path.exists(out / ".tmp-step-000004")
    wa, wb = read_weights(dclens.load(a)), read_weights(dclens.load(b))
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


def test_final_config_matches_weights(tmp_path):
    data = _corpus(tmp_path)
    out = tmp_path / "r"
    final = train(_cfg(out, data, steps=4))
    cfg = json.loads(Path(final, "config.json").read_text())
    m = dclens.load(final)
    assert cfg["dim"] == m.config.d_model == 16
    assert not os.path.exists(os.path.join(final, "optimizer.npz"))
    assert not [d for d in os.listdir(out) if d.startswith((".tmp-", ".old-"))]


def test_cli_resume_refusal_one_line(tmp_path):
    data = _corpus(tmp_path)
    out = tmp_path / "r"
    args = [
        "--out",
        str(out),
        "--n-layer",
        "1",
        "--dim",
        "16",
        "--n-head",
        "2",
        "--seq-len",
        "8",
        "--batch-size",
        "2",
        "--steps",
        "4",
        "--data",
        data,
        "--no-progress",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "dclens.cli", "train"] + args + ["--stop-after", "2"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    args[args.index("--dim") + 1] = "32"
    args[args.index("--n-head") + 1] = "4"
    r = subprocess.run([sys.executable, "-m", "dclens.cli", "train"] + args, capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("dclens train: error: ")
    assert "--dim 32 (the run: 16)" in r.stderr and "Traceback" not in r.stderr
