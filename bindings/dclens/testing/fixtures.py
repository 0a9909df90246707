"""The valid checkpoints the C tests read, written before they run.

    python3 -m dclens.testing.fixtures OUT_DIR      (CMakeLists.txt: the ctest fixture "fixtures")

OUT_DIR/<name>/ holds config.json and model.safetensors of a tiny model
(2 layers, D = 16, 4 heads, d_ff 32, vocab 50, window 4, rank 2):

    dcpythia            DCPythia, fused wqkv, data 8-aligned
    dcpythia_unfused    the same model with wq/wk/wv (rows of wqkv)
    dcpythia_unaligned  the same as dcpythia with the data misaligned for floats
    dcpythia_bf16       dcpythia stored as BF16 (each value's upper 16 bits)
    neox                Pythia (GPT-NeoX names), with the buffers loaders ignore

and OUT_DIR/loaders/ the torch.save zips of test_loaders.c (five tensors
viewing two storages: F16 0, 0.5, .. 5.5 and F32 1, 2, 3):

    torch1/pytorch_model.bin   one file (classic end records, OrderedDict with _metadata)
    torch2/                    two shards (the second with zip64 end records) + index
    zip64.bin                  the one file with zip64 end records

Names and shapes come from dclens.testing.layouts, config.json as
make_tiny writes it, the files from dclens.testing.checkpoint. The
values are engine/tests/test_engine.c's value(name, i), a hash of the
stored tensor's name and the element index (unfused q/k/v take the rows of
the fused tensor), so the C test can check any weight it reads.
Malformed inputs are built byte by byte in the C tests themselves.
"""

from __future__ import annotations

import json
import os
import sys
from collections import OrderedDict
from typing import Any

import numpy as np

from .checkpoint import TorchTensor, safetensors_bytes, torch_checkpoint_bytes, write_index
from .layouts import dcpythia_tensors, gpt_neox_tensors
from .make_tiny import tiny_config

DIMS: dict[str, Any] = dict(n_layer=2, dim=16, n_head=4, vocab=50, intermediate=32)
WINDOW, RANK, ROTARY_PCT = 4, 2, 0.5

_M64 = (1 << 64) - 1


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _name_hash(s: str) -> int:
    h = 1469598103934665603
    for c in s.encode("utf-8"):
        h = ((h ^ c) * 1099511628211) & _M64
    return h


def value(name: str, first: int, n: int) -> np.ndarray:
    """float32 [n]: value(name, first + i) of test_engine.c. Norm weights and
    QK-norm scales near 1, the rest uniform in [-0.4, 0.4)."""
    i = np.arange(first, first + n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix(np.uint64(_name_hash(name)) ^ _splitmix(i))
    u = 2.0 * ((h >> np.uint64(11)).astype(np.float64) / 9007199254740992.0) - 1.0
    if name.endswith(("norm.weight", "layernorm.weight", ".scale")):
        return (1.0 + 0.1 * u).astype(np.float32)
    return (0.4 * u).astype(np.float32)


def _values(name: str, shape) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    for j, part in enumerate(("wq", "wk", "wv")):  # rows j of the fused wqkv
        tag = ".attention.%s." % part
        if tag in name:
            return value(name.replace(tag, ".attention.wqkv."), j * n, n).reshape(shape)
    return value(name, 0, n).reshape(shape)


def _write(out: str, name: str, config: dict, layout, *, bf16: bool = False, aligned: bool = True) -> None:
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    tensors = {}
    for n, shape in layout.items():
        v = _values(n, shape)
        if bf16:
            tensors[n] = ("BF16", shape, (v.view(np.uint32) >> np.uint32(16)).astype("<u2"))
        else:
            tensors[n] = ("F32", shape, v.astype("<f4"))
    data = safetensors_bytes(tensors, {"format": "pt"}, pad_to=8 if aligned else 0)
    if not aligned and (8 + int.from_bytes(data[:8], "little")) % 4 == 0:
        # one more header space: the data then starts off a 4-byte boundary
        n = int.from_bytes(data[:8], "little")
        data = (n + 1).to_bytes(8, "little") + data[8 : 8 + n] + b" " + data[8 + n :]
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(data)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def _loader_zips(out: str) -> None:
    """test_loaders.c's kSpecs: wqkv [3, 2] and wo [2, 3] viewing one F16
    storage, norm.weight [3], a scalar and a [2, 1] column of stride (1, 7)
    viewing one F32 storage."""
    d = os.path.join(out, "loaders")
    for sub in ("torch1", "torch2"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    halves = (np.arange(12, dtype=np.float32) * 0.5).astype("<f2").tobytes()
    floats = np.array([1, 2, 3], dtype="<f4").tobytes()
    specs = OrderedDict(
        [
            ("layers.0.attention.wqkv.weight", TorchTensor("h", "float16", 12, 0, (3, 2))),
            ("layers.0.attention.wo.weight", TorchTensor("h", "float16", 12, 6, (2, 3))),
            ("norm.weight", TorchTensor("f", "float32", 3, 0, (3,))),
            ("scalar", TorchTensor("f", "float32", 3, 2, ())),
            ("col", TorchTensor("f", "float32", 3, 1, (2, 1), (1, 7))),  # size-1 dim: any stride
        ]
    )
    storages = {"h": halves, "f": floats}

    def put(path, names, **kw):
        with open(os.path.join(d, path), "wb") as f:
            f.write(torch_checkpoint_bytes(OrderedDict((n, specs[n]) for n in names), storages, **kw))

    names = list(specs)
    put("torch1/pytorch_model.bin", names, container="ordereddict_meta", zip64=False)
    put("zip64.bin", names, container="ordereddict_meta")
    shards = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    put("torch2/" + shards[0], names[:2], zip64=False)
    put("torch2/" + shards[1], names[2:])
    write_index(
        os.path.join(d, "torch2", "pytorch_model.bin.index.json"),
        {n: shards[0] if i < 2 else shards[1] for i, n in enumerate(names)},
        36,
    )


def write_fixtures(out: str) -> list:
    """Write every fixture directory under `out`; returns their names."""
    dcp_cfg = tiny_config("dcpythia", **DIMS, window_size=WINDOW, rotary_pct=ROTARY_PCT)
    neox_cfg = tiny_config("gpt_neox", **DIMS, rotary_pct=ROTARY_PCT)
    fused = dcpythia_tensors(**DIMS, rank=RANK)
    _write(out, "dcpythia", dcp_cfg, fused)
    _write(out, "dcpythia_unfused", dcp_cfg, dcpythia_tensors(**DIMS, rank=RANK, fused_qkv=False))
    _write(out, "dcpythia_unaligned", dcp_cfg, fused, aligned=False)
    _write(out, "dcpythia_bf16", dict(dcp_cfg, torch_dtype="bfloat16"), fused, bf16=True)
    _write(out, "neox", neox_cfg, gpt_neox_tensors(**DIMS, rotary_pct=ROTARY_PCT, extra_derived=True))
    _loader_zips(out)
    return ["dcpythia", "dcpythia_unfused", "dcpythia_unaligned", "dcpythia_bf16", "neox", "loaders"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python3 -m dclens.testing.fixtures OUT_DIR", file=sys.stderr)
        return 2
    names = write_fixtures(argv[0])
    print("wrote %d fixture checkpoints under %s: %s" % (len(names), argv[0], ", ".join(names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
