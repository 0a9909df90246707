#!/usr/bin/env python3
"""Write the fuzzers' seed corpora: a few small, valid checkpoints.

    python3 engine/fuzz/make_corpus.py [OUT_DIR]     (default: engine/fuzz/corpus)

OUT_DIR/safetensors/  safetensors files (F32/F16/BF16, metadata, padding,
                      unaligned offsets, an empty tensor, a skipped bool buffer)
OUT_DIR/torchzip/     PyTorch zip checkpoints laid out as torch.save writes
                      them: archive/data.pkl (pickle protocol 2 of an
                      OrderedDict of _rebuild_tensor_v2 calls, made by
                      Python's own pickler, so the opcode stream is the real
                      one), archive/data/<key>, archive/byteorder, version.

torch is not needed: tiny stand-ins for torch._utils._rebuild_tensor_v2 and
the storage classes are registered under their real module names, which is
all the pickler records. Only the standard library is used.
"""
import collections
import io
import json
import os
import pickle
import struct
import sys
import types
import zipfile

# ---------------------------------------------------------------- safetensors


def safetensors_bytes(tensors, metadata=None, pad_to=8):
    """tensors: list of (name, dtype, shape, raw bytes)."""
    header, blobs, off = {}, [], 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    if pad_to:
        text += b" " * (-len(text) % pad_to)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def f32(*v):
    return struct.pack("<%df" % len(v), *v)


def f16(*v):
    return struct.pack("<%de" % len(v), *v)


def bf16(*v):
    return b"".join(struct.pack("<f", x)[2:] for x in v)


# ---------------------------------------------------------------- torch zip

def _fake_torch():
    """Register stand-ins so pickle writes torch's global names."""
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):
        raise RuntimeError("never called")
    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch._utils = utils
    for cls in ("FloatStorage", "HalfStorage", "BFloat16Storage", "BoolStorage"):
        setattr(torch, cls, type(cls, (), {"__module__": "torch"}))
    sys.modules.setdefault("torch", torch)
    sys.modules.setdefault("torch._utils", utils)
    return sys.modules["torch"]


class Storage:
    def __init__(self, cls, key, raw, elsize):
        self.cls, self.key, self.raw, self.numel = cls, key, raw, len(raw) // elsize


class Tensor:
    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, tuple(size), tuple(stride), False,
                     collections.OrderedDict())

    def __reduce_ex__(self, proto):
        return (sys.modules["torch._utils"]._rebuild_tensor_v2, self.args)


class TorchPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            return ("storage", obj.cls, obj.key, "cpu", obj.numel)
        return None


def contiguous_stride(size):
    stride, acc = [], 1
    for d in reversed(size):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def torchzip_bytes(state, storages, prefix="archive", protocol=2, zip64=False):
    """state: OrderedDict name -> Tensor; storages: list of Storage."""
    buf = io.BytesIO()
    TorchPickler(buf, protocol=protocol).dump(state)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        with z.open(prefix + "/data.pkl", "w", force_zip64=zip64) as f:
            f.write(buf.getvalue())
        z.writestr(prefix + "/byteorder", "little")
        for s in storages:
            z.writestr(prefix + "/data/" + s.key, s.raw)
        z.writestr(prefix + "/version", "3\n")
        z.writestr(prefix + "/.data/serialization_id", "1234567890")
    return out.getvalue()


def torch_example(dtype="HalfStorage", pack=f16, elsize=2, **kw):
    torch = _fake_torch()
    cls = getattr(torch, dtype)
    s0 = Storage(cls, "0", pack(*[0.5 * i for i in range(12)]), elsize)
    s1 = Storage(cls, "1", pack(1.0, 2.0, 3.0), elsize)
    sd = collections.OrderedDict()
    sd["layers.0.attention.wqkv.weight"] = Tensor(s0, 0, (3, 2), contiguous_stride((3, 2)))
    sd["layers.0.attention.wo.weight"] = Tensor(s0, 6, (2, 3), contiguous_stride((2, 3)))
    sd["norm.weight"] = Tensor(s1, 0, (3,), (1,))
    sd["scalar"] = Tensor(s1, 2, (), ())
    sd._metadata = collections.OrderedDict([("", {"version": 1}),
                                            ("layers.0", {"version": 1})])
    return torchzip_bytes(sd, [s0, s1], **kw)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus")
    st_dir, tz_dir = os.path.join(out, "safetensors"), os.path.join(out, "torchzip")
    os.makedirs(st_dir, exist_ok=True)
    os.makedirs(tz_dir, exist_ok=True)
    seeds = {
        "f32.safetensors": safetensors_bytes([("a", "F32", [2, 2], f32(1, 2, 3, 4))]),
        "mixed.safetensors": safetensors_bytes(
            [("w.f16", "F16", [3], f16(1, -2, 0.5)),
             ("w.bf16", "BF16", [1, 3], bf16(1, 2, 3)),
             ("w.f32", "F32", [1], f32(7)),          # offset 12: unaligned for F32
             ("empty", "F32", [0, 4], b"")],
            metadata={"format": "pt"}),
        "buffer.safetensors": safetensors_bytes(
            [("gpt_neox.layers.0.attention.bias", "BOOL", [1, 1, 2, 2], b"\1\0\1\1"),
             ("gpt_neox.layers.0.attention.masked_bias", "F32", [], f32(-1e9))], pad_to=0),
    }
    for name, data in seeds.items():
        with open(os.path.join(st_dir, name), "wb") as f:
            f.write(data)
    zips = {
        "f16.bin": torch_example(),
        "f32.bin": torch_example("FloatStorage", f32, 4),
        "bf16.bin": torch_example("BFloat16Storage", bf16, 2),
        "proto4.bin": torch_example(protocol=4, prefix="pytorch_model"),
        "zip64.bin": torch_example(zip64=True),
    }
    for name, data in zips.items():
        with open(os.path.join(tz_dir, name), "wb") as f:
            f.write(data)
    print("wrote %d safetensors and %d torch zip seeds under %s" % (len(seeds), len(zips), out))


if __name__ == "__main__":
    main()
