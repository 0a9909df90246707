"""Robustness II: threads, hook-array lifetime, files changing under a loaded
model, non-regular files, non-finite values, Ctrl-C, and every refusal a
dclens.Error naming what is wrong (docs/bad-inputs.md lists each case).

Every case that could hang runs with a timeout (a subprocess, or a joined
thread), so a regression fails instead of blocking the suite.
"""

import gc
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import dclens

from conftest import rel_err
from tolerances import forward_tol, tiny

BASE = dict(model_type="dcpythia", n_layer=2, seed=31)
TOKS = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], dtype=np.int32)


@pytest.fixture
def good(tiny_factory, tmp_path):
    d, _, _ = tiny_factory(**BASE)
    dst = tmp_path / "model"
    shutil.copytree(d, dst)
    return dst


@pytest.fixture(scope="module")
def model(tiny_factory):
    d, _, _ = tiny_factory(**BASE)
    return dclens.load(d)


def _st_read(path):
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _st_write(path, header, data):
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def _set_tensor_values(d, name, fn):
    """Rewrite tensor `name` of d/model.safetensors (F32) through fn(array)."""
    p = d / "model.safetensors"
    header, data = _st_read(p)
    b, e = header[name]["data_offsets"]
    assert header[name]["dtype"] == "F32"
    a = np.frombuffer(data[b:e], np.float32).copy()
    fn(a)
    _st_write(p, header, data[:b] + a.tobytes() + data[e:])


def _load_error(d):
    with pytest.raises(dclens.Error) as ei:
        dclens.load(d)
    return str(ei.value)


# ---------------------------------------------------------------- threads


def test_two_threads_one_model(model):
    ref = model.forward(TOKS)
    ref_h = model.run_with_cache(TOKS, names="blocks.1.attn.pattern")[1]["blocks.1.attn.pattern"]
    errors = []

    def worker(k):
        try:
            for i in range(30):
                if (i + k) % 2:
                    np.testing.assert_array_equal(model.forward(TOKS), ref)
                else:
                    _, c = model.run_with_cache(TOKS, names="blocks.1.attn.pattern")
                    np.testing.assert_array_equal(c["blocks.1.attn.pattern"], ref_h)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts)
    assert not errors, errors[0]


def test_two_models_run_in_parallel(tiny_factory):
    """A model busy in one thread (its hook waits) does not hold up another
    model in another thread: the lock is per model."""
    d, _, _ = tiny_factory(**BASE)
    a, b = dclens.load(d), dclens.load(d)
    ref = b.forward(TOKS)
    entered, release = threading.Event(), threading.Event()

    def slow_hook(act, name):
        entered.set()
        assert release.wait(30)

    out = {}
    ta = threading.Thread(target=lambda: out.setdefault("a", a.run_with_hooks(TOKS, [("blocks.0.ln_attn", slow_hook)])))
    ta.start()
    assert entered.wait(30)
    tb = threading.Thread(target=lambda: out.setdefault("b", b.forward(TOKS)))
    tb.start()
    tb.join(30)
    finished_while_a_busy = not tb.is_alive()
    release.set()
    ta.join(30)
    assert finished_while_a_busy
    np.testing.assert_array_equal(out["b"], ref)
    np.testing.assert_array_equal(out["a"], ref)


def test_hook_cannot_reenter_its_model_but_may_read_weights(model):
    seen = {}

    def hook(act, name):
        seen["w"] = model.weight("norm.weight").copy()
        model.forward(TOKS)

    with pytest.raises(dclens.Error, match="already running a pass"):
        model.run_with_hooks(TOKS, [("blocks.0.ln_attn", hook)])
    assert seen["w"].shape == (model.config.d_model,)
    np.testing.assert_array_equal(model.forward(TOKS), model.forward(TOKS))


# ---------------------------------------------------------------- hook arrays


def test_hook_keeps_array_across_passes_and_del_model(tiny_factory):
    d, _, _ = tiny_factory(**BASE)
    m = dclens.load(d)
    kept = []

    def keep(act, name):
        kept.append(act)

    names = ["blocks.0.attn.pattern", "blocks.1.mlp.post", "logits"]
    _, cache = m.run_with_cache(TOKS, names=names)
    m.run_with_hooks(TOKS, [(n, keep) for n in names])
    first = [k.copy() for k in kept]
    for n, k in zip(names, first):
        np.testing.assert_array_equal(k, cache[n])
    # more passes, other tokens: the pooled engine buffers are reused
    for _ in range(3):
        m.forward(TOKS[::-1].copy())
        m.run_with_cache(TOKS[:5], names=names)
    for k, f in zip(kept, first):
        np.testing.assert_array_equal(k, f)
        assert k.base is None or k.base.flags.owndata  # owns its memory
    del m, cache
    gc.collect()
    for k, f in zip(kept, first):
        k += 1.0  # writes are safe too
        np.testing.assert_array_equal(k, f + 1.0)


def test_hook_writes_still_apply(model):
    ref = model.forward(TOKS)

    def zero(act, name):
        act[...] = 0.0  # in place, no return

    out = model.run_with_hooks(TOKS, [("blocks.1.mlp.out", zero)])
    # an effect far above float32 rounding of a pass (tests/tolerances.py)
    assert rel_err(out, ref) > 10 * forward_tol(tiny(), len(TOKS), out.size, sides=2)
    ret = model.run_with_hooks(TOKS, [("blocks.1.mlp.out", lambda a, n: np.zeros_like(a))])
    np.testing.assert_array_equal(out, ret)
    np.testing.assert_array_equal(model.forward(TOKS), ref)


def test_exception_traceback_holds_no_engine_view(model):
    def bad(act, name):
        raise RuntimeError("kaput")

    with pytest.raises(dclens.Error) as ei:
        model.run_with_hooks(TOKS, [("blocks.0.attn.z", bad)])
    model.forward(TOKS[::-1].copy())  # reuse the buffers
    tb = ei.value.__cause__.__traceback__
    while tb is not None:
        for v in tb.tb_frame.f_locals.values():
            if isinstance(v, np.ndarray):
                assert v.base is None or v.base.flags.owndata, tb.tb_frame.f_code.co_name
        tb = tb.tb_next


# ---------------------------------------------------------------- files changing


def test_weight_file_truncated_or_rewritten_after_load(good):
    m = dclens.load(good)
    ref = m.forward(TOKS)
    p = good / "model.safetensors"
    raw = p.read_bytes()
    p.write_bytes(b"\xff" * len(raw))  # rewritten in place
    np.testing.assert_array_equal(m.forward(TOKS), ref)
    os.truncate(p, 0)  # truncated: no SIGBUS
    np.testing.assert_array_equal(m.forward(TOKS), ref)
    np.testing.assert_array_equal(m.weight("norm.weight"), m.weight("norm.weight"))


def _load_in_subprocess(d, timeout=60):
    code = (
        "import dclens, sys\n"
        "try:\n    m = dclens.load(sys.argv[1]); m.tokenizer\nexcept dclens.Error as e:\n"
        "    print('ERR', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_fifo_refused_without_hanging(good, name):
    os.remove(good / name) if (good / name).exists() else None
    os.mkfifo(good / name)
    out = _load_in_subprocess(good)  # a hang fails by timeout
    assert out.startswith("ERR") and name in out and "not a regular file" in out


def test_dangling_symlink_is_named(good):
    os.remove(good / "config.json")
    os.symlink(good / "nowhere.json", good / "config.json")
    assert "dangling symbolic link" in _load_error(good)


# ---------------------------------------------------------------- non-finite


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_weight_named_at_load(good, value):
    def poison(a):
        a[3] = value

    _set_tensor_values(good, "layers.1.feed_forward.w2.weight", poison)
    msg = _load_error(good)
    assert "model.safetensors" in msg and "layers.1.feed_forward.w2.weight" in msg
    assert "element 3" in msg and ("NaN" in msg or "inf" in msg)


def test_nonfinite_f16_weight(tiny_factory, tmp_path):
    d, _, _ = tiny_factory(model_type="dcpythia", n_layer=2, seed=5, dtype="float16")
    dst = tmp_path / "m16"
    shutil.copytree(d, dst)
    p = dst / "model.safetensors"
    header, data = _st_read(p)
    b, e = header["norm.weight"]["data_offsets"]
    data = data[:b] + struct.pack("<H", 0x7E00) + data[b + 2 :]
    _st_write(p, header, data)
    assert "'norm.weight' holds NaN at element 0" in _load_error(dst)


def test_norm_eps_zero_refused(good):
    cfg = json.loads((good / "config.json").read_text())
    cfg["norm_eps"] = 0
    (good / "config.json").write_text(json.dumps(cfg))
    assert "'norm_eps' must be a number in (0, 1]" in _load_error(good)


def test_overflowing_hook_gives_error_not_nan_logits(model):
    def huge(act, name):
        act[...] = 3e38

    with pytest.raises(dclens.Error, match="logits hold NaN or inf"):
        model.run_with_hooks(TOKS, [("ln_final", huge)])
    assert np.isfinite(model.forward(TOKS)).all()


def test_overflowing_weights_no_benchmark_score(good, tmp_path):
    """Finite but huge weights overflow to inf logits: the benchmark stops
    with an error and writes no results."""
    _set_tensor_values(good, "norm.weight", lambda a: a.__setitem__(slice(None), 3e38))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"task_id": "task0", "texts": "\na b [ c ]\n"}) + "\n")
    from conftest import shared_path

    tok = shared_path("data", "gpt-neox-20b-tokenizer.json")
    from synth_tasks.cli import main

    out = tmp_path / "out"
    rc = main(
        [
            "--model",
            str(good),
            "--data",
            str(data),
            "--out",
            str(out),
            "--tokenizer",
            tok,
            "--no-progress",
            "--no-plots",
        ]
    )
    assert rc != 0
    assert not (out / "results.json").exists()


def test_evaluate_refuses_nonfinite_logits():
    from synth_tasks.dataset import Dataset, lines_from_records
    from synth_tasks.evaluate import evaluate

    class NanModel:
        name = "nan"

        def forward(self, toks):
            out = np.zeros(toks.shape + (64,), np.float32)
            out[..., 0] = np.nan
            return out

    class Tok:
        def encode(self, text, add_special_tokens=False):
            class E:
                pass

            e = E()
            e.ids = [ord(c) % 64 for c in text]
            e.offsets = [(i, i + 1) for i in range(len(text))]
            return e

    ds = Dataset(lines_from_records([{"task_id": "task0", "texts": "\nab [ c ]\n"}]))
    with pytest.raises(ValueError, match="NaN or inf logits"):
        evaluate(NanModel(), ds, tokenizer=Tok(), progress=False)


# ---------------------------------------------------------------- Ctrl-C


@pytest.fixture(scope="module")
def deep(tiny_factory):
    d, _, _ = tiny_factory(model_type="dcpythia", n_layer=24, seed=3)
    return dclens.load(d)


@pytest.fixture
def ctrl_c():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test: a process started in the
    background by a non-interactive shell (`cmd &`, nohup) inherits SIGINT ignored, and
    Python then installs no handler, so Ctrl-C could not be tested there."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def _sigint_after(seconds):
    t = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    t.start()
    return t


def test_ctrl_c_stops_a_plain_forward(deep, ctrl_c):
    toks = np.zeros(512, np.int32)
    t0 = time.perf_counter()
    ref = deep.forward(toks)
    full = time.perf_counter() - t0
    timer = _sigint_after(full * 0.15)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        deep.forward(toks)
        time.sleep(10)  # not reached unless the pass ignored Ctrl-C
    took = time.perf_counter() - t0
    timer.join()
    assert took < 0.7 * full, (took, full)
    np.testing.assert_array_equal(deep.forward(toks), ref)  # still usable


def test_ctrl_c_stops_a_hooked_forward(deep, ctrl_c):
    calls = []

    def slow(act, name):
        calls.append(name)
        time.sleep(0.02)

    hooks = [("blocks.%d.resid_post" % l, slow) for l in range(deep.config.n_layer)]
    timer = _sigint_after(0.1)
    with pytest.raises(KeyboardInterrupt):
        deep.run_with_hooks(TOKS, hooks)
        time.sleep(10)
    timer.join()
    assert 0 < len(calls) < deep.config.n_layer
    assert np.isfinite(deep.forward(TOKS)).all()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_hook_raising_interrupt_propagates_as_itself(model, exc):
    def hook(act, name):
        raise exc()

    with pytest.raises(exc):
        model.run_with_hooks(TOKS, [("blocks.0.attn.z", hook)])
    assert np.isfinite(model.forward(TOKS)).all()


# ---------------------------------------------------------------- JSON rules


def test_duplicate_key_in_config(good):
    text = (good / "config.json").read_text().rstrip().rstrip("}") + ', "dim": 64}'
    (good / "config.json").write_text(text)
    msg = _load_error(good)
    assert "config.json" in msg and "key 'dim' appears twice" in msg


def test_bom_in_config(good):
    (good / "config.json").write_bytes(b"\xef\xbb\xbf" + (good / "config.json").read_bytes())
    assert "byte-order mark" in _load_error(good)


def test_nul_in_safetensors_name(good):
    p = good / "model.safetensors"
    header, data = _st_read(p)
    header["norm.weight\u0000evil"] = header.pop("norm.weight")
    _st_write(p, header, data)
    msg = _load_error(good)
    assert "model.safetensors" in msg and "NUL" in msg


def test_long_tensor_name_keeps_the_reason(good):
    p = good / "model.safetensors"
    header, data = _st_read(p)
    header["layers.0." + "x" * 3000] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    _st_write(p, header, data)
    msg = _load_error(good)
    assert "unexpected tensor" in msg and "not part of a dcpythia model" in msg


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "kw",
    [
        dict(layer=0.5),
        dict(layer=1.0),
        dict(layer=True),
        dict(layer=np.float32(1)),
        dict(layer=2),
        dict(layer=-1),
        dict(layer=2**70),
        dict(query=1.0),
        dict(query=np.float64(3)),
        dict(query=len(TOKS)),
        dict(query="3"),
    ],
)
def test_routing_indices_checked(model, kw):
    args = dict(layer=1, phase="post", query=5)
    args.update(kw)
    with pytest.raises(dclens.Error, match="layer|query"):
        model.routing_matrix(TOKS, **args)


def test_index_arguments_everywhere(model):
    from dclens import circuits
    from dclens import interventions as iv

    np.testing.assert_array_equal(
        model.routing_matrix(TOKS, layer=np.int64(1), phase="post", query=np.int32(5)),
        model.routing_matrix(TOKS, layer=1, phase="post", query=5),
    )
    with pytest.raises(dclens.Error, match="key position"):
        model.composition_map(TOKS, 1, "post", query=5, key=2.0)
    with pytest.raises(dclens.Error, match="head"):
        circuits.qk_circuit(model, 0, 1.5)
    with pytest.raises(dclens.Error, match="token id"):
        circuits.ov_readout(model, 0, 1, token=3.0)
    with pytest.raises(dclens.Error, match="head"):
        iv.ablate_head(model, 0, head=True)
    with pytest.raises(dclens.Error, match="layer"):
        iv.disable_branch(model, "post", "kp", layers=[0.0])
    with pytest.raises(dclens.Error, match="layer"):
        dclens.attention_heatmap(model, TOKS, layer=0.5)


def test_refusals_are_errors(model, good):
    with pytest.raises(dclens.Error, match="weight name must be a string"):
        model.weight(None)
    with pytest.raises(dclens.Error, match="NUL"):
        model.weight("norm.weight\0junk")
    with pytest.raises(dclens.Error, match="NUL"):
        model.parse_hook("logits\0junk")
    with pytest.raises(dclens.Error, match="NUL"):
        model.run_with_cache(TOKS, names=["logits\0"])
    with pytest.raises(dclens.Error, match="names must be"):
        model.run_with_cache(TOKS, names=123)
    with pytest.raises(dclens.Error, match="ragged|pad"):
        model.forward([[1, 2, 3], [4, 5]])
    with pytest.raises(dclens.Error, match="integers"):
        model.forward([[1, 2], ["a", 3]])
    with pytest.raises(dclens.Error, match="n_threads"):
        dclens.load(good, n_threads=2**40)
    with pytest.raises(dclens.Error, match="n_threads"):
        dclens.load(good, n_threads=1.5)
    with pytest.raises(dclens.Error, match="model path"):
        dclens.load(123)
    with pytest.raises(dclens.Error, match="NUL"):
        dclens.load(str(good) + "\0/x")
    with pytest.raises(dclens.Error, match="device"):
        dclens.load(good, device=None)


def test_bytes_and_non_utf8_paths(good, tmp_path):
    ref = dclens.load(good).forward(TOKS)
    np.testing.assert_array_equal(dclens.load(os.fsencode(str(good))).forward(TOKS), ref)
    odd = os.path.join(os.fsencode(str(tmp_path)), b"mod\xffel")
    shutil.copytree(os.fsencode(str(good)), odd)
    for p in (odd, os.fsdecode(odd)):
        m = dclens.load(p)
        assert isinstance(m.path, str)
        np.testing.assert_array_equal(m.forward(TOKS), ref)
    shutil.rmtree(odd)
    msg = _load_error(odd)
    assert "cannot open" in msg


def test_oversized_cache_refused_before_allocating(model):
    toks = np.zeros((64, 4096), np.int32)
    with pytest.raises(dclens.Error, match="run_with_cache: caching .* hooks .* needs"):
        model.run_with_cache(toks)


# ---------------------------------------------------------------- CLI and dataset


def test_cli_messages(good, tmp_path, capsys):
    from dclens.cli.commands import main

    from conftest import shared_path

    shutil.copy(shared_path("data", "gpt-neox-20b-tokenizer.json"), good / "tokenizer.json")
    f = tmp_path / "afile"
    f.write_text("x")
    assert main(["info", "--model", str(f)]) == 1
    assert "must be a checkpoint directory" in capsys.readouterr().err
    assert (
        main(
            [
                "heatmap",
                "--model",
                str(good),
                "--text",
                "!#",
                "--layer",
                "0",
                "--head",
                "99",
                "--out",
                str(tmp_path / "h.png"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "heatmap: heatmap:" not in err and "dclens heatmap: error: head 99" in err


def test_synth_out_checked_before_evaluation(good, tmp_path, capsys):
    from synth_tasks.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"task_id": "task0", "texts": "\na b [ c ]\n"}) + "\n")
    f = tmp_path / "afile"
    f.write_text("x")
    t0 = time.perf_counter()
    assert main(["--model", "/nonexistent", "--data", str(data), "--out", str(f)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert main(["--model", "/nonexistent", "--data", str(data), "--out", str(f / "sub")]) == 2
    assert "not writable" in capsys.readouterr().err
    assert time.perf_counter() - t0 < 10


def test_dataset_endless_line_and_devices(tmp_path):
    from synth_tasks.dataset import MAX_LINE_BYTES, DatasetError, load_dataset

    with pytest.raises(DatasetError, match="not a regular file"):
        load_dataset("/dev/zero")
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DatasetError, match="not a regular file"):
        load_dataset(fifo)  # no writer: would block without O_NONBLOCK
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.write(b'{"task_id": "t", "texts": "' + b"a" * (MAX_LINE_BYTES + 10))
    with pytest.raises(DatasetError, match=r"big.jsonl:1: line longer than"):
        load_dataset(big)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"task_id": "task0", "texts": "\\na [ b ]\\n", "task_id": "task9"}\n')
    with pytest.raises(DatasetError, match="key 'task_id' appears twice"):
        load_dataset(dup)


def test_ctrl_c_stops_a_decoding_step(deep, ctrl_c):
    from dclens.analysis.generate import Decoder

    toks = np.zeros(384, np.int32)
    dec = Decoder(deep)
    t0 = time.perf_counter()
    ref = dec.step(toks)
    full = time.perf_counter() - t0
    dec = Decoder(deep)
    timer = _sigint_after(full * 0.15)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        dec.step(toks)
        time.sleep(10)
    took = time.perf_counter() - t0
    timer.join()
    assert took < 0.7 * full, (took, full)
    assert dec.pos == 0  # the step was undone
    np.testing.assert_array_equal(dec.step(toks), ref)


def test_cli_unknown_command_and_make_tiny_refusals(tmp_path, capsys):
    from dclens.cli.commands import main

    assert main(["bogus"]) == 2
    assert "unknown command 'bogus'" in capsys.readouterr().err
    assert main(["make-tiny", str(tmp_path / "m"), "--dim", "0"]) == 1
    assert "--dim must be at least 1, not 0" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # refused before writing
    f = tmp_path / "afile"
    f.write_text("x")
    assert main(["make-tiny", str(f)]) == 1
    assert "exists and is not a directory" in capsys.readouterr().err
    assert main(["make-tiny", str(f / "sub")]) == 1  # cannot be created
    assert "dclens make-tiny: error: cannot write" in capsys.readouterr().err
    # no safetensors package is needed: dclens.testing.checkpoint writes the files
    assert main(["make-tiny", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    assert dclens.load(tmp_path / "plain").forward(TOKS % 64).shape == (len(TOKS), 64)


# ---------------------------------------------------------------- Robustness III (issue 22)


def test_weights_dangling_symlink_named(good):
    """A weights file that is a link to nothing is named as such, not reported as 'no weights found'."""
    os.remove(good / "model.safetensors")
    os.symlink(good / "gone.safetensors", good / "model.safetensors")
    with pytest.raises(dclens.Error) as ei:
        dclens.load(good)
    assert str(ei.value) == (
        "%s/model.safetensors: cannot open: a dangling symbolic link (its target does not exist)" % good
    )


def test_shard_name_with_double_dot_accepted(tiny_factory, tmp_path):
    """'model..v2.safetensors' has no '/': it cannot leave the directory and loads."""
    d, _, _ = tiny_factory(model_type="dcpythia", n_layer=2, seed=31, shards=2)
    dst = tmp_path / "m"
    shutil.copytree(d, dst)
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    ren = {}
    for shard in sorted(set(idx["weight_map"].values())):
        new = shard.replace("model-", "model..v2-")
        os.rename(dst / shard, dst / new)
        ren[shard] = new
    idx["weight_map"] = {k: ren[v] for k, v in idx["weight_map"].items()}
    (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert all(".." in v for v in idx["weight_map"].values())
    want = dclens.load(d).forward(TOKS)
    np.testing.assert_array_equal(dclens.load(dst).forward(TOKS), want)
    # ".." itself and a name with '/' are still refused
    for bad in ("..", "../x.safetensors", "sub/x.safetensors"):
        idx["weight_map"] = {k: bad for k in idx["weight_map"]}
        (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
        with pytest.raises(dclens.Error, match="index.json"):
            dclens.load(dst)


def test_config_pseudo_file_read_to_its_end(good, tmp_path):
    """A config.json that reports size 0 but has content on read (/proc-style)
    is read, not called 'changed while being read': /proc/self/comm of a
    process that named itself '{}' reads as the JSON object {}."""
    os.remove(good / "config.json")
    os.symlink("/proc/self/comm", good / "config.json")
    assert os.stat(good / "config.json").st_size == 0
    code = (
        "import dclens, sys\nopen('/proc/self/comm', 'w').write('{}')\n"
        "try:\n    dclens.load(sys.argv[1])\nexcept dclens.Error as e:\n    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(good)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "%s/config.json: missing required key 'model_type'" % good
    assert "changed while being read" not in r.stdout


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits,what", [(0, "+inf"), (1, "-inf"), (2, "NaN")])
def test_half_weight_nonfinite_named_at_load(tiny_factory, tmp_path, dtype, bits, what):
    """inf / NaN in an F16 or BF16 matrix kept in its dtype is named at load,
    as in a float32 weight, not first seen as non-finite logits."""
    d, _, _ = tiny_factory(model_type="dcpythia", n_layer=2, seed=31, dtype=dtype)
    dst = tmp_path / "m"
    shutil.copytree(d, dst)
    p = dst / "model.safetensors"
    header, data = _st_read(p)
    name = "layers.1.feed_forward.w1.weight"
    assert header[name]["dtype"] == ("F16" if dtype == "float16" else "BF16")
    pat = {"float16": (0x7C00, 0xFC00, 0x7E00), "bfloat16": (0x7F80, 0xFF80, 0x7FC0)}[dtype][bits]
    b = header[name]["data_offsets"][0]
    data = bytearray(data)
    data[b + 2 * 5 : b + 2 * 6] = struct.pack("<H", pat)
    _st_write(p, header, bytes(data))
    with pytest.raises(dclens.Error) as ei:
        dclens.load(dst)
    assert str(ei.value) == "%s: tensor '%s' holds %s at element 5" % (p, name, what)


def test_fused_16bit_parts_nonfinite_named(tiny_factory, tmp_path):
    """Unfused wq/wk/wv (concatenated in their dtype) and a neox fused qkv
    (regrouped) are scanned too, with the stored tensor's name."""
    for kw, name in (
        (dict(model_type="dcpythia", fused_qkv=False), "layers.0.attention.wk.weight"),
        (dict(model_type="gpt_neox"), "gpt_neox.layers.0.attention.query_key_value.weight"),
    ):
        d, _, _ = tiny_factory(n_layer=2, seed=32, dtype="float16", **kw)
        dst = tmp_path / kw["model_type"]
        shutil.copytree(d, dst)
        p = dst / "model.safetensors"
        header, data = _st_read(p)
        b = header[name]["data_offsets"][0]
        data = bytearray(data)
        data[b : b + 2] = struct.pack("<H", 0x7C00)
        _st_write(p, header, bytes(data))
        with pytest.raises(dclens.Error, match=r"tensor '%s' holds \+inf at element 0" % name):
            dclens.load(dst)


@pytest.mark.parametrize(
    "stop,msg",
    [
        (1.5, "stop must be a token id, a string, or a list of them, not float 1.5"),
        (b"ab", "stop must be a token id, a string, or a list of them, not bytes"),
        ({"a": 1}, "stop must be a token id, a string, or a list of them, not dict"),
        ([None], "stop token id must be an integer, not NoneType None"),
        ([object()], "stop token id must be an integer, not object"),
        (2**70, r"stop token id 1180591620717411303424 is out of range \[0, 64\)"),
        (-1, r"stop token id -1 is out of range"),
        ([3, True], "stop token id must be an integer, not bool"),
        ("", "stop holds an empty string"),
    ],
)
def test_generate_stop_refused_by_name(model, stop, msg):
    with pytest.raises(dclens.Error, match="generate: " + msg):
        model.generate(TOKS[:4], max_new_tokens=2, stop=stop)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(seed="x"), "generate: seed must be an integer, not str"),
        (dict(seed=-1), r"generate: seed -1 is out of range"),
        (dict(max_new_tokens=True), "generate: max_new_tokens must be an integer, not bool"),
        (dict(top_k=2.0), "generate: top_k must be an integer, not float"),
        (dict(temperature=True), "generate: temperature must be a finite number"),
    ],
)
def test_generate_arguments_refused_by_name(model, kw, msg):
    with pytest.raises(dclens.Error, match=msg):
        model.generate(TOKS[:4], **dict(dict(max_new_tokens=2), **kw))


def test_generate_stop_accepted_forms(model):
    greedy = model.generate(TOKS[:4], max_new_tokens=4)
    first = int(greedy[4])
    for stop in (first, np.int64(first), [first], (first,), np.array([first, 0])):
        out = model.generate(TOKS[:4], max_new_tokens=4, stop=stop)
        np.testing.assert_array_equal(out, greedy[:5])


@pytest.mark.parametrize("copy", ["pickle", "copy", "deepcopy"])
def test_decoder_pickle_refused(model, copy):
    # a Model pickles as a reference to its files (issue 26, tests/api/test_pickle.py);
    # a Decoder holds the engine's K/V caches and cannot
    import copy as copymod
    import pickle

    fn = {"pickle": pickle.dumps, "copy": copymod.copy, "deepcopy": copymod.deepcopy}[copy]
    from dclens.analysis.generate import Decoder

    with pytest.raises(dclens.Error, match="a dclens.Decoder cannot be pickled or copied"):
        fn(Decoder(model))


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(cell_px=2**31), r"heatmap: cell_px 2147483648 is out of range \[0, 2147483648\)"),
        (dict(grid_cols=2**40), r"heatmap: grid_cols 1099511627776 is out of range"),
        (dict(cell_px=-1), r"heatmap: cell_px -1 is out of range"),
        (dict(grid_cols=1.5), r"heatmap: grid_cols must be an integer, not float"),
    ],
)
def test_heatmap_sizes_beyond_c_int(model, kw, msg):
    with pytest.raises(dclens.Error, match=msg):
        dclens.heatmap(np.ones((3, 3)), **kw)
    with pytest.raises(dclens.Error, match=msg):
        dclens.attention_heatmap(model, TOKS[:5], layer=0, **kw)


@pytest.mark.parametrize("tok", ["bpe:X", "bpe:-5", "bpe:", "bpe:12", "bpe:1e3", "bpe:99999999999"])
def test_train_tokenizer_bpe_refused(tmp_path, tok):
    from dclens.train.loop import TrainConfig, train

    with pytest.raises(
        dclens.Error, match=r"--tokenizer '%s': N of bpe:N must be an integer in \[258, " % tok.replace("+", r"\+")
    ):
        train(TrainConfig(out=str(tmp_path / "r"), tokenizer=tok, steps=1))
    assert not os.path.exists(tmp_path / "r")  # refused before anything is written
    r = subprocess.run(
        [sys.executable, "-m", "dclens.cli", "train", "--out", str(tmp_path / "r"), "--tokenizer", tok],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("dclens train: error: --tokenizer")


def _fuzz_findings(model, cache):
    """(call, message) for each refusal the API fuzz (tests/api/test_fuzz_api.py)
    found as a raw Python exception, now a dclens.Error naming the argument."""
    from dclens import analysis, attribution, circuits, names, patching, routing
    from dclens import cache as dc
    from dclens import interventions as iv

    logits = model.forward(TOKS[:6])
    odd = np.array([1, "a"], dtype=object)
    return [
        (lambda: analysis.qk_ov_diversity(model, layers=False), "layers must be None or a list of layer indices"),
        (lambda: analysis.qk_ov_diversity(model, layers=[1, "a"]), "layer must be an integer, not str"),
        (lambda: analysis.head_output_pca(model, None, progress=False), "dataset must be a string, a token array"),
        (lambda: analysis.head_similarity(model, None), "layer must be an integer, not NoneType"),
        (lambda: analysis.composition_stats(model, [TOKS], chunk=0, progress=False), r"chunk 0 is out of range"),
        (lambda: analysis.composition_stats(model, [TOKS], top=0.0, progress=False), "top must be an integer"),
        (lambda: routing.routing_matrices(model, cache, odd), "phase must be 'pre' or 'post'"),
        (lambda: routing.flows(model, TOKS, 0, np.array(["pre", "post"]), 0, 3), "phase must be 'pre' or 'post'"),
        (lambda: routing.routing_matrices(model, cache, "post", queries=""), "queries must be a list of integers"),
        (
            lambda: routing.maps_from_weights(routing.dynamic_weights(model, TOKS, 0, "post"), 0, groups=0),
            r"groups 0 is out of range",
        ),
        (
            lambda: routing.maps_from_weights(routing.dynamic_weights(model, TOKS, 0, "post"), len(TOKS)),
            r"query position 12 is out of range",
        ),
        (
            lambda: routing.maps_from_weights(
                {k: v[None] for k, v in routing.dynamic_weights(model, TOKS, 0, "post").items()}, 0
            ),
            r"the gates must be \[S, N\] of one sequence, got shape \(1, 12, ",
        ),
        (
            lambda: routing.maps_from_weights(
                {k: v for k, v in routing.dynamic_weights(model, TOKS, 0, "post").items() if k != "kw1"}, 0
            ),
            r"dyn holds kw2, kdd but not kw1",
        ),
        (lambda: circuits.qk_circuit(model, 0, None), "head must be an integer, not NoneType"),
        (lambda: circuits.ov_readout(model, 0, 0, 1, k=0.0), "k must be an integer, not float"),
        (lambda: circuits.FactoredMatrix(None, None), "FactoredMatrix: A must be a 2-D array"),
        (lambda: dc.accumulated_resid(cache, apply_ln=odd), "apply_ln must be True or False"),
        (lambda: dc.dla(cache, 64), r"dla: token 64 is out of range \[0, 64\)"),
        (lambda: dc.dla(cache, 3, pos=len(TOKS)), r"dla: pos 12 is out of range"),
        (lambda: cache[[]], "cache key must be a hook name or \\(name, layer\\), not list"),
        (lambda: names.tl_alias(None), "hook name must be a string, not NoneType"),
        (lambda: patching.logit_diff(3, 4, pos=None)(logits), "metric: pos must be an integer, not NoneType"),
        (lambda: patching.prob(64)(logits), r"metric: the token 64 is out of range"),
        (lambda: patching.sweep(model, TOKS, TOKS, None, over=None), "over must be a string"),
        (lambda: patching.run_patched(model, TOKS, cache, None), "run_patched: names must be a list of hook names"),
        (lambda: model.run_with_hooks(TOKS, fwd_hooks=None), "fwd_hooks must be a list of \\(name, fn\\) pairs"),
        (lambda: model.gradients(TOKS, "loss", None), "gradients: wrt must be a hook or parameter name"),
        (lambda: attribution.attribute(model, TOKS, "loss", None), "attribute: at must be a hook name"),
        (
            lambda: attribution.attribute(model, TOKS, "loss", ["blocks.0.attn.z"], baseline={}),
            "attribute: baseline must be 'zero', 'mean' or an array of numbers",
        ),
        (lambda: dclens.heatmap(""), "heatmap: maps must be a \\[T, S\\] or \\[P, T, S\\] array of numbers"),
        # found by the API fuzz at 300-1500 examples per callable (each was a bare Python error)
        (lambda: model.to_str_tokens([[1], [1, 2]]), "tokens must be a \\[T\\] or \\[B, T\\] array of integers"),
        (lambda: model.to_string([[1], [1, 2]]), "tokens must be a \\[T\\] or \\[B, T\\] array of integers"),
        (lambda: routing.gates(model, [[1], [1, 2]], 0), "tokens must be a \\[T\\] or \\[B, T\\] array of integers"),
        (lambda: model.forward(np.array([TOKS, TOKS]), lengths=[[1], [1, 2]]), "lengths must be \\[B\\] = \\[2\\]"),
        (lambda: model.forward(TOKS, loss_per_token=np.array([])), "loss_per_token must be True or False"),
        (lambda: model.add_hook("blocks.0.attn.z", lambda a, h: None, read_only=np.array([])), "read_only must be"),
        (lambda: dclens.heatmap(np.ones((2, 2)), tokens=False), "labels \\(tokens / key_tokens\\) must be a list"),
        (lambda: dclens.heatmap(np.ones((2, 2)), vmin=-(2**1100)), "heatmap: vmin must be a finite number"),
        (lambda: dclens.attention_heatmap(model, TOKS, layer=0, head=0, hook=np.array([])), "hook must be a string"),
        (lambda: iv.scale(model, "blocks.0.attn.z", -(2**1100)), "factor must be a finite number"),
        (lambda: iv.scale(model, "blocks.0.attn.z", True), "factor must be a finite number"),
        (lambda: model.run_with_hooks(TOKS, iv.scale(model, "blocks.0.attn.z", 1e300)), "past float32's range"),
        (lambda: iv.patch(model, "blocks.0.attn.z", cache, positions=False), "positions must be a list of integers"),
        (
            lambda: model.run_with_hooks(TOKS, iv.ablate_head(model, 0, 0, "mean", np.zeros(3), "attn.pattern")),
            "mean has shape \\(3,\\), which does not fit",
        ),
        (lambda: patching.sweep(model, TOKS, TOKS, lambda lg: None), "metric must return a number"),
        (lambda: routing.routing_matrices(model, cache, "post", layers=[]), "layers is empty"),
        (lambda: model.generate(TOKS, max_new_tokens=2**30), "more positions than a decoder takes"),
        (lambda: dclens.heatmap(np.ones((2, 2)), vmin="", vmax=1.0), "heatmap: vmin must be a finite number"),
        (lambda: dclens.heatmap(np.ones((2, 2)), diverging=odd), "heatmap: diverging must be True or False"),
        (lambda: dclens.attention_heatmap(model, [1, "a"], layer=0), "heatmap: tokens must be a string or"),
        (lambda: iv.disable_branch(model, odd, "kp"), "phase must be 'pre' or 'post'"),
        (lambda: iv.disable_dynamic(model, layers=False), "layers must be None or a list of layer indices"),
        (lambda: iv.mean_activation(cache, 0, 4), r"head 4 is out of range \[0, 4\)"),
        (lambda: iv.ablate_head(model, 0, 0, point=0), "ablate_head: point must be a string"),
        (lambda: routing.gates_from_cache(model, cache, ""), "layer must be an integer, not str"),
    ]


def test_fuzz_findings_refused_by_name(model):
    """Every finding of the API fuzz, replayed: a dclens.Error with the message
    docs/bad-inputs.md quotes (section Robustness III), never the raw exception."""
    import re

    _, cache = model.run_with_cache(TOKS)
    for call, msg in _fuzz_findings(model, cache):
        with pytest.raises(dclens.Error) as ei:
            call()
        assert re.search(msg, str(ei.value)), (msg, str(ei.value))


def test_missing_cache_key_is_error_and_key_error(model):
    from dclens.cache import MissingActivation

    _, cache = model.run_with_cache(TOKS, names=["embed"])
    with pytest.raises(MissingActivation) as ei:
        cache["blocks.0.attn.z"]
    assert isinstance(ei.value, KeyError) and isinstance(ei.value, dclens.Error)
    assert str(ei.value).startswith("cache has no 'blocks.0.attn.z'")
    assert cache.get("blocks.0.attn.z") is None and "blocks.0.attn.z" not in cache
