"""Checkpoint files as Hugging Face and torch.save write them, without torch.

The one writer of every test fixture (make_tiny, the fuzz corpus, the C
tests' checkpoints: dclens.testing.fixtures):

    write_safetensors(path, {name: ("F16", shape, raw bytes)}, metadata)
    write_torch_zip(path, {name: TorchTensor(...)}, {storage_id: raw bytes})
    write_index(path, {name: shard file}, total_size)

safetensors: an 8-byte little-endian header length, the JSON header
(`__metadata__` first, compact, padded with spaces to a multiple of 8),
then the data, tensors ordered as the Rust serializer orders them (by
decreasing element size, then name), so the bytes equal the safetensors
package's.

PyTorch zip: what torch.save writes. data.pkl is a pickle (protocol 2 by
default) of the state dict made by the standard pickle module: the tensors
reduce to torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
False, OrderedDict()) and the storages become persistent ids
("storage", torch.<Dtype>Storage, key, "cpu", numel), the records
torch's persistent_load reads. torch's globals are written by name (torch
need not be importable: the pure-Python Pickler lets a subclass write a
GLOBAL for an object of its own). The zip is PyTorchStreamWriter's: stored
records <archive>/data.pkl, byteorder, data/<key>, version,
.data/serialization_id, each record's data on a 64-byte boundary (an "FB"
extra field), a data descriptor after each, zip64 end records.

Only the standard library and numpy are used; nothing of dclens.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zlib
from collections import OrderedDict

import numpy as np

__all__ = [
    "DTYPES",
    "ST_DTYPE",
    "TorchTensor",
    "index_bytes",
    "pickle_state_dict",
    "round_to_dtype",
    "safetensors_bytes",
    "torch_checkpoint_bytes",
    "torch_zip_bytes",
    "write_index",
    "write_safetensors",
    "write_torch_zip",
]

DTYPES = ("float32", "float16", "bfloat16")
ST_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_TORCH_STORAGE = {
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "bool": "BoolStorage",
}
_ST_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
}


# --------------------------------------------------------------------------- dtypes


def _f32_to_bf16_bits(a):
    """float32 array -> uint16 bfloat16 bit patterns, round to nearest even."""
    u = np.array(a, dtype=np.float32, order="C").view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def round_to_dtype(a, dtype):
    """Round `a` to `dtype`. Returns (raw, widened): raw is the little-endian array as
    stored in the file (uint16 bit patterns for bfloat16), widened its exact float32 value."""
    a = np.asarray(a, dtype=np.float32)
    if dtype == "float32":
        raw = a.astype("<f4")
        return raw, raw.astype(np.float32)
    if dtype == "float16":
        raw = a.astype("<f2")
        return raw, raw.astype(np.float32)
    if dtype == "bfloat16":
        raw = _f32_to_bf16_bits(a).astype("<u2")
        widened = (raw.astype(np.uint32) << 16).view(np.float32)
        return raw, widened.reshape(a.shape)
    raise ValueError(f"unsupported dtype {dtype!r}; use one of {DTYPES}")


# --------------------------------------------------------------------------- safetensors


def safetensors_bytes(tensors, metadata=None, *, sort=True, pad_to=8):
    """The bytes of a safetensors file of `tensors`: name -> (dtype, shape, raw)
    with dtype a safetensors name ("F32", "BF16", "BOOL", ...) and raw the
    little-endian bytes (or an array, written as its bytes). metadata: the
    __metadata__ dict, or None for none. sort=False keeps the given order
    (the fuzz corpus' unaligned offsets); pad_to=0 leaves the header unpadded."""
    order = list(tensors)
    if sort:
        order.sort(key=lambda k: (-_ST_ITEMSIZE.get(tensors[k][0], 1), k))
    header = OrderedDict()
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    blobs, off = [], 0
    for k in order:
        dt, shape, raw = tensors[k]
        b = raw if isinstance(raw, (bytes, bytearray)) else np.ascontiguousarray(raw).tobytes()
        header[k] = {"dtype": dt, "shape": [int(s) for s in shape], "data_offsets": [off, off + len(b)]}
        blobs.append(bytes(b))
        off += len(b)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    if pad_to:
        text += b" " * (-len(text) % pad_to)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def write_safetensors(path, tensors, metadata=None, **kw):
    """Write safetensors_bytes(tensors, metadata, **kw) to `path`
    (metadata defaults to {"format": "pt"}, as torch's save_file writes)."""
    data = safetensors_bytes(tensors, {"format": "pt"} if metadata is None else metadata, **kw)
    with open(path, "wb") as f:
        f.write(data)


# --------------------------------------------------------------------------- torch pickle


class TorchTensor:
    """A tensor as torch.save sees it: a view (offset, shape, stride in elements) into
    a storage identified by `storage_id` (any hashable; equal ids share one storage)."""

    def __init__(self, storage_id, dtype, storage_numel, offset, shape, stride=None):
        self.storage_id = storage_id
        self.dtype = dtype
        self.storage_numel = int(storage_numel)
        self.offset = int(offset)
        self.shape = tuple(int(s) for s in shape)
        if stride is None:
            stride, acc = [], 1
            for s in reversed(self.shape):
                stride.append(acc)
                acc *= s
            stride = tuple(reversed(stride))
        self.stride = tuple(int(s) for s in stride)


class _Global:
    """A module-level name written as a pickle GLOBAL without importing it."""

    def __init__(self, module, name):
        self.module, self.name = module, name

    def __call__(self, *args):  # pickle's save_reduce wants a callable; it is never called
        raise TypeError("%s.%s is only a name in a pickle" % (self.module, self.name))


class _Storage:
    """A tensor's storage as torch pickles it: a persistent id."""

    def __init__(self, cls, key, numel):
        self.cls, self.key, self.numel = cls, key, numel


class _Tensor:
    """A tensor as torch pickles it: a call of _rebuild_tensor_v2."""

    def __init__(self, rebuild, storage, t):
        self.rebuild, self.storage, self.t = rebuild, storage, t


class _TorchPickler(pickle._Pickler):
    """pickle's Pickler writing torch's records for _Tensor and _Storage and a
    GLOBAL for _Global. The pure-Python Pickler (pickle._Pickler) emits the
    same opcodes with the same memo as the C one; it is used because the C
    one checks that a global can be imported, and torch is not needed here."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_torch_global(self, obj):
        if self.proto >= 4:
            self.save(obj.module)
            self.save(obj.name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + obj.module.encode("utf-8") + b"\n" + obj.name.encode("utf-8") + b"\n")
        self.memoize(obj)

    dispatch[_Global] = save_torch_global  # type: ignore[assignment]  # pickle dispatch takes the subclass

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", obj.cls, obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, _Tensor):
            t = obj.t
            return obj.rebuild, (obj.storage, t.offset, tuple(t.shape), tuple(t.stride), False, OrderedDict())
        return NotImplemented


def _module_metadata(names):
    """`state_dict()._metadata`: the module prefixes in pre-order."""
    meta, seen = [], set()
    for n in names:
        parts = n.split(".")[:-1]
        for i in range(len(parts) + 1):
            pre = ".".join(parts[:i])
            if pre not in seen:
                seen.add(pre)
                meta.append(pre)
    return meta


def pickle_state_dict(tensors, *, container="ordereddict", protocol=2):
    """data.pkl bytes for `tensors` (name -> TorchTensor) as torch.save(state_dict) writes it.

    container: "ordereddict" (collections.OrderedDict, what Module.state_dict() returns,
    here without its _metadata), "ordereddict_meta" (with the `_metadata` attribute,
    BUILD at the end, as torch.save(model.state_dict()) writes), or "dict" (a plain
    dict, as Hugging Face's shard dicts are).
    Returns (pickle_bytes, storage_keys) where storage_keys maps storage_id -> key str
    in order of first appearance.
    """
    globals_ = {}

    def glob(module, name):  # one object per global: the memo then hits as with torch's
        return globals_.setdefault((module, name), _Global(module, name))

    rebuild = glob("torch._utils", "_rebuild_tensor_v2")
    keys = OrderedDict()
    items = []
    for name, t in tensors.items():
        key = keys.setdefault(t.storage_id, str(len(keys)))
        storage = _Storage(glob("torch", _TORCH_STORAGE[t.dtype]), key, t.storage_numel)
        items.append((str(name), _Tensor(rebuild, storage, t)))
    if container == "dict":
        top = dict(items)
    elif container in ("ordereddict", "ordereddict_meta"):
        top = OrderedDict(items)
        if container == "ordereddict_meta":
            top._metadata = OrderedDict((pre, {"version": 1}) for pre in _module_metadata(tensors))
    else:
        raise ValueError(f"unknown pickle container {container!r}")
    buf = io.BytesIO()
    _TorchPickler(buf, protocol=protocol).dump(top)
    return buf.getvalue(), dict(keys)


# --------------------------------------------------------------------------- torch zip

_DOS_TIME = 0  # 00:00:00
_DOS_DATE = ((2024 - 1980) << 9) | (1 << 5) | 1  # 2024-01-01: fixed for reproducible files
_FIELD_ALIGNMENT = 64


def _hash_combine(seed, value):
    """c10::hash_combine on 64-bit size_t."""
    m = (1 << 64) - 1
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & m) + (seed >> 2)) & m)) & m


def torch_zip_bytes(records, archive_name, *, zip64=True):
    """Zip bytes as PyTorchStreamWriter (miniz, zip64 mode) writes them.

    Per record: local header (version needed 0, flags 0x0808 = data descriptor + UTF-8,
    stored, crc and sizes 0), name, extra field 'FB' + u16 n + n*'Z' so that the data
    starts on a 64-byte boundary, data, data descriptor (PK\\x07\\x08, crc, sizes).
    Central directory entries carry the real crc/sizes and no extra field. Then the
    zip64 end-of-central-directory record and locator (zip64=False leaves them
    out), then the classic EOCD.
    """
    buf = bytearray()
    central = bytearray()
    flags = 0x0808
    for name, data in records:
        full = f"{archive_name}/{name}".encode()
        data = bytes(data)
        cursor = len(buf)
        if len(data) >= 0xFFFFFFFF or cursor >= 0xFFFFFFFF:
            raise ValueError("records of 4 GiB or more are not supported by this writer")
        start = cursor + 30 + len(full) + 4
        pad = (-start) % _FIELD_ALIGNMENT
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        crc = zlib.crc32(data) & 0xFFFFFFFF
        buf += struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, _DOS_TIME, _DOS_DATE, 0, 0, 0, len(full), len(extra)
        )
        buf += full + extra
        assert len(buf) % _FIELD_ALIGNMENT == 0
        buf += data
        buf += struct.pack("<IIII", 0x08074B50, crc, len(data), len(data))
        central += struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            0,
            0,
            flags,
            0,
            _DOS_TIME,
            _DOS_DATE,
            crc,
            len(data),
            len(data),
            len(full),
            0,
            0,
            0,
            0,
            0,
            cursor,
        )
        central += full
    cd_ofs, cd_size, n = len(buf), len(central), len(records)
    buf += central
    if zip64:
        z64_ofs = len(buf)
        buf += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, n, n, cd_size, cd_ofs)
        buf += struct.pack("<IIQI", 0x07064B50, 0, z64_ofs, 1)
    buf += struct.pack(
        "<IHHHHIIH",
        0x06054B50,
        0,
        0,
        min(n, 0xFFFF),
        min(n, 0xFFFF),
        min(cd_size, 0xFFFFFFFF),
        min(cd_ofs, 0xFFFFFFFF),
        0,
    )
    return bytes(buf)


def torch_checkpoint_bytes(
    tensors, storages, *, archive_name="archive", container="ordereddict", torch_style="2.1", protocol=2, zip64=True
):
    """The bytes of a torch.save-style zip checkpoint.

    tensors: name -> TorchTensor; storages: storage_id -> raw little-endian bytes.
    archive_name: the folder inside the zip ("archive" as for torch.save to a buffer).
    torch_style: "2.1" (records data.pkl, byteorder, data/<key> in lexicographic key
    order, version, .data/serialization_id) or "2.7" (adds .format_version "1" and
    .storage_alignment "64" after data.pkl; data/<key> in numeric order).
    protocol / zip64: the pickle protocol, and whether the zip64 end records are written.
    """
    data_pkl, keys = pickle_state_dict(tensors, container=container, protocol=protocol)
    records = [("data.pkl", data_pkl)]
    if torch_style == "2.7":
        records += [(".format_version", b"1"), (".storage_alignment", b"64")]
    elif torch_style != "2.1":
        raise ValueError(f"unknown torch_style {torch_style!r}")
    records.append(("byteorder", b"little"))
    by_key = {k: sid for sid, k in keys.items()}
    key_order = sorted(by_key) if torch_style == "2.1" else sorted(by_key, key=int)
    for k in key_order:
        records.append((f"data/{k}", storages[by_key[k]]))
    records.append(("version", b"3\n"))
    name_hash, crc_comb = 0, 0
    for name, data in records:
        name_hash = _hash_combine(name_hash, zlib.crc32(name.encode()) & 0xFFFFFFFF)
        crc_comb = _hash_combine(crc_comb, zlib.crc32(bytes(data)) & 0xFFFFFFFF)
    serialization_id = f"{name_hash % 10**20:020d}{crc_comb % 10**20:020d}"
    records.append((".data/serialization_id", serialization_id.encode("ascii")))
    return torch_zip_bytes(records, archive_name, zip64=zip64)


def write_torch_zip(path, tensors, storages, *, archive_name="archive", **kw):
    """Write torch_checkpoint_bytes(tensors, storages, ...) to `path`;
    archive_name=None is what torch.save(obj, path) uses: the file's
    basename without extension."""
    if archive_name is None:
        archive_name = os.path.splitext(os.path.basename(str(path)))[0]
    data = torch_checkpoint_bytes(tensors, storages, archive_name=archive_name, **kw)
    with open(path, "wb") as f:
        f.write(data)


# --------------------------------------------------------------------------- sharded index


def index_bytes(weight_map, total_size):
    """model.safetensors.index.json / pytorch_model.bin.index.json as Hugging Face writes it."""
    return (
        json.dumps(
            {"metadata": {"total_size": int(total_size)}, "weight_map": dict(weight_map)}, indent=2, sort_keys=True
        )
        + "\n"
    ).encode("utf-8")


def write_index(path, weight_map, total_size):
    with open(path, "wb") as f:
        f.write(index_bytes(weight_map, total_size))
