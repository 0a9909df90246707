"""Bad input: every broken checkpoint gives dclens.Error naming the file and
what is wrong; none crashes the process; a malicious pickle runs nothing.

The broken files are crafted here, independently of the engine's loaders.
"""

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import dclens

BASE = dict(model_type="dcpythia", n_layer=2, seed=31)


@pytest.fixture
def good(tiny_factory, tmp_path):
    """A fresh copy of a good safetensors checkpoint, free to break."""
    d, _, _ = tiny_factory(**BASE)
    dst = tmp_path / "model"
    shutil.copytree(d, dst)
    return dst


def _st_read(path):
    """Independent safetensors reader: header dict and data bytes."""
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _st_write(path, header, data, pad=True):
    h = json.dumps(header).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def _load_error(d):
    with pytest.raises(dclens.Error) as ei:
        dclens.load(str(d))
    return str(ei.value)


def test_missing_dir(tmp_path):
    msg = _load_error(tmp_path / "nope")
    assert "config.json" in msg


def test_missing_config(good):
    os.remove(good / "config.json")
    assert "config.json" in _load_error(good)


def test_bad_json_config(good):
    (good / "config.json").write_text('{"model_type": "dcpythia", "dim": 32,,}')
    msg = _load_error(good)
    assert "config.json" in msg and "JSON" in msg


# (intermediate_size is not required: missing or null means 4 * dim, as in
# DCPythiaConfig; tests/passes/test_variants.py checks it)
@pytest.mark.parametrize("key", ["dim", "n_head", "n_layer", "vocab_size", "model_type"])
def test_missing_config_key(good, key):
    cfg = json.loads((good / "config.json").read_text())
    del cfg[key]
    (good / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(good)
    assert "config.json" in msg and key in msg


def test_unknown_model_type(good):
    cfg = json.loads((good / "config.json").read_text())
    cfg["model_type"] = "llama"
    (good / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(good)
    assert "config.json" in msg and "llama" in msg


def test_bad_config_value(good):
    cfg = json.loads((good / "config.json").read_text())
    cfg["n_head"] = 5  # does not divide dim
    (good / "config.json").write_text(json.dumps(cfg))
    assert "divisible" in _load_error(good)
    cfg["n_head"] = "four"
    (good / "config.json").write_text(json.dumps(cfg))
    assert "n_head" in _load_error(good)


def test_no_weights(good):
    os.remove(good / "model.safetensors")
    assert "no weights" in _load_error(good)


def _modify_tensors(good, fn):
    path = good / "model.safetensors"
    header, data = _st_read(path)
    meta = header.pop("__metadata__", None)
    tensors = {}
    for k, v in header.items():
        b, e = v["data_offsets"]
        tensors[k] = (v["dtype"], v["shape"], data[b:e])
    fn(tensors)
    out, blob = {}, b""
    for k, (dt, shape, raw) in tensors.items():
        out[k] = {"dtype": dt, "shape": shape, "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    if meta:
        out["__metadata__"] = meta
    _st_write(path, out, blob)


def test_missing_tensor(good):
    _modify_tensors(good, lambda t: t.pop("layers.1.attention.wo.weight"))
    msg = _load_error(good)
    assert "missing tensor 'layers.1.attention.wo.weight'" in msg


def test_extra_tensor(good):
    def add(t):
        t["layers.0.attention.surprise"] = ("F32", [2], b"\0" * 8)

    _modify_tensors(good, add)
    msg = _load_error(good)
    assert "model.safetensors" in msg and "layers.0.attention.surprise" in msg


def test_misshaped_tensor(good):
    def reshape(t):
        dt, shape, raw = t["norm.weight"]
        t["norm.weight"] = (dt, [shape[0] // 2, 2], raw)

    _modify_tensors(good, reshape)
    msg = _load_error(good)
    assert "model.safetensors" in msg and "norm.weight" in msg and "shape" in msg


def test_truncated_file(good):
    path = good / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])
    assert "model.safetensors" in _load_error(good)
    path.write_bytes(raw[:5])
    assert "model.safetensors" in _load_error(good)


def test_bad_offsets_and_absurd_header(good):
    path = good / "model.safetensors"
    header, data = _st_read(path)
    k = next(k for k in header if k != "__metadata__")
    header[k]["data_offsets"] = [0, len(data) + 4096]
    _st_write(path, header, data)
    assert "model.safetensors" in _load_error(good)
    path.write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    assert "model.safetensors" in _load_error(good)
    _st_write(path, {"x": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 4]}}, b"\0" * 4)
    assert "model.safetensors" in _load_error(good)


def test_unknown_dtype(good):
    def to_f64(t):
        dt, shape, raw = t["norm.bias"]
        t["norm.bias"] = ("F64", shape, raw + raw)

    _modify_tensors(good, to_f64)
    msg = _load_error(good)
    assert "model.safetensors" in msg and "F64" in msg


class _Evil:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def _torch_zip(path, pkl: bytes):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/version", "3\n")


@pytest.mark.parametrize("protocol", [2, 4])
def test_malicious_pickle_runs_nothing(good, tmp_path, protocol):
    marker = tmp_path / "pwned"
    os.remove(good / "model.safetensors")
    _torch_zip(good / "pytorch_model.bin", pickle.dumps({"w": _Evil("touch %s" % marker)}, protocol=protocol))
    # in a subprocess: a crash or a side effect would show there
    code = "import dclens, sys\ntry:\n    dclens.load(sys.argv[1])\nexcept dclens.Error as e:\n    print('ERR', e)\n"
    r = subprocess.run([sys.executable, "-c", code, str(good)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERR") and "pytorch_model.bin" in r.stdout and "system" in r.stdout
    assert not marker.exists()


def test_pickle_with_eval_global(good):
    os.remove(good / "model.safetensors")
    pkl = b"\x80\x02cbuiltins\neval\nq\x00X\x04\x00\x00\x001+1q\x01\x85q\x02Rq\x03."
    _torch_zip(good / "pytorch_model.bin", pkl)
    msg = _load_error(good)
    assert "pytorch_model.bin" in msg and "builtins.eval" in msg


def test_not_a_zip(good):
    os.remove(good / "model.safetensors")
    (good / "pytorch_model.bin").write_bytes(b"this is not a zip file at all" * 10)
    assert "pytorch_model.bin" in _load_error(good)


def test_bad_index(good):
    os.remove(good / "model.safetensors")
    (good / "model.safetensors.index.json").write_text('{"weight_map": {"norm.weight": "../../etc/passwd"}}')
    assert "model.safetensors.index.json" in _load_error(good)
    (good / "model.safetensors.index.json").write_text(
        '{"weight_map": {"norm.weight": "model-00001-of-00002.safetensors"}}'
    )
    assert "model-00001-of-00002.safetensors" in _load_error(good)


def test_bad_tokens(tiny_factory):
    d, _, _ = tiny_factory(**BASE)
    m = dclens.load(d)
    with pytest.raises(dclens.Error, match="out of range"):
        m.forward(np.array([0, m.config.vocab]))
    with pytest.raises(dclens.Error, match="integers"):
        m.forward(np.array([0.5, 1.0]))
    with pytest.raises(dclens.Error, match="non-empty"):
        m.forward(np.zeros((0,), int))
    with pytest.raises(dclens.Error, match="tokenizer.json"):
        m.to_tokens("hello")


def test_cuda_device_error_is_clear(tiny_factory):
    if dclens.cuda_available():
        pytest.skip("a GPU is present")
    d, _, _ = tiny_factory(**BASE)
    with pytest.raises(dclens.Error, match="cuda"):
        dclens.load(d, device="cuda")
    assert dclens.cuda_unavailable_reason()
