#!/usr/bin/env python3
"""Write the fuzzers' seed corpora: small, real-shaped inputs for each target.

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
all the pickler records. Only the standard library is used (and
synth_tasks, from this repository, for the JSONL seeds).
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
    def entry(name):          # fixed timestamp: the seeds are byte-for-byte reproducible
        return zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        with z.open(entry(prefix + "/data.pkl"), "w", force_zip64=zip64) as f:
            f.write(buf.getvalue())
        z.writestr(entry(prefix + "/byteorder"), "little")
        for s in storages:
            z.writestr(entry(prefix + "/data/" + s.key), s.raw)
        z.writestr(entry(prefix + "/version"), "3\n")
        z.writestr(entry(prefix + "/.data/serialization_id"), "1234567890")
    return out.getvalue()


def torch_views_example():
    """Strided views as torch.save keeps them: transposed and expanded (stride 0)."""
    torch = _fake_torch()
    s0 = Storage(torch.HalfStorage, "0", f16(*[0.5 * i for i in range(12)]), 2)
    sd = collections.OrderedDict()
    sd["t"] = Tensor(s0, 0, (3, 4), (1, 3))         # a [4, 3] storage read transposed
    sd["x"] = Tensor(s0, 6, (5, 3), (0, 1))         # one row expanded
    sd["sw"] = Tensor(s0, 0, (2, 2, 2), (0, 2, 1))  # eye(N).expand(2, N, N) style
    return torchzip_bytes(sd, [s0])


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


# ---------------------------------------------------------------- config.json

def dcpythia_config(dim=4096, n_head=32, n_layer=32, intermediate=16384, vocab=50257,
                    **over):
    """config.json with the keys of the published DCPythia-6.9B config
    (model-spec.md section 2), in the order Hugging Face writes them."""
    cfg = {
        "architectures": ["DCPythia"],
        "auto_map": {"AutoConfig": "configuration_dcpythia.DCPythiaConfig",
                     "AutoModelForCausalLM": "modeling_dcpythia.DCPythia"},
        "block_size": 2048, "bos_token_id": 0, "dim": dim, "eos_token_id": 0,
        "head_dim": dim // n_head, "intermediate_size": intermediate, "is_training": False,
        "model_type": "dcpythia", "n_head": n_head, "n_layer": n_layer,
        "n_local_heads": n_head, "norm_eps": 1e-05, "q_chunk_size": 128,
        "query_wise": False, "rope_base": 10000, "rotary_pct": 0.25,
        "tie_word_embeddings": False, "torch_dtype": "float16",
        "transformers_version": "4.33.2", "use_dcmha": True,
        "use_gradient_checkpointing": False, "use_linear_bias": True,
        "use_parallel_residual": True, "use_qk_norm": True, "vocab_size": vocab,
        "window_size": 256, "window_type": None,
    }
    cfg.update(over)
    return cfg


def pythia_config(hidden=512, heads=8, layers=6, intermediate=2048, vocab=50304, **over):
    """config.json of a Pythia GPTNeoXForCausalLM (pythia-70m's by default)."""
    cfg = {
        "architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0,
        "hidden_act": "gelu", "hidden_size": hidden, "initializer_range": 0.02,
        "intermediate_size": intermediate, "layer_norm_eps": 1e-05,
        "max_position_embeddings": 2048, "model_type": "gpt_neox",
        "num_attention_heads": heads, "num_hidden_layers": layers,
        "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
        "torch_dtype": "float16", "transformers_version": "4.24.0", "use_cache": True,
        "use_parallel_residual": True, "vocab_size": vocab,
    }
    cfg.update(over)
    return cfg


def config_seeds():
    def js(obj, indent=2):
        return (json.dumps(obj, indent=indent) + "\n").encode()
    tiny = dict(dim=64, n_head=4, n_layer=4, intermediate=256, vocab=512)
    broken_dim = dcpythia_config(**tiny)
    del broken_dim["dim"]
    return {
        "dcpythia-6.9b.json": js(dcpythia_config()),
        "dcpythia-tiny-lgll.json": js(dcpythia_config(**tiny, window_type="LGLL",
                                                      query_wise=True,
                                                      tie_word_embeddings=True), None),
        "dcpythia-tiny-lgl6.json": js(dcpythia_config(**tiny, window_type="LGL6",
                                                      window_size=16, use_dcmha=False,
                                                      use_qk_norm=False)),
        "dcpythia-tiny-g.json": js(dcpythia_config(**tiny, window_type="G", rotary_pct=1.0,
                                                   norm_eps=1e-6, rope_base=500000.0)),
        "pythia-70m.json": js(pythia_config()),
        "pythia-6.9b.json": js(pythia_config(4096, 32, 32, 16384, 50432)),
        "pythia-tiny-seq.json": js(pythia_config(64, 4, 2, 256, 512, use_parallel_residual=False,
                                                 tie_word_embeddings=True, rotary_pct=1.0)),
        # attention variants and null keys (docs/variants.md)
        "dcpythia-tiny-variants.json": js(dcpythia_config(**tiny, use_sw=True, compose_groups=2,
                                                          moh={"shared_heads": 1, "routed_topk": 2},
                                                          window_size=None)),
        "dcpythia-tiny-nulls.json": js(dcpythia_config(**tiny, key_wise=True, use_qk_norm=None,
                                                       intermediate_size=None, moh=None)),
        # refused ones: each names the key (or the JSON error)
        "bad-missing-dim.json": js(broken_dim, None),
        "bad-indivisible.json": js(dcpythia_config(dim=100, n_head=3, n_layer=1,
                                                   intermediate=8, vocab=8), None),
        "bad-window-type.json": js(dcpythia_config(**tiny, window_type="LLG"), None),
        "bad-use-sw.json": js(dcpythia_config(**tiny, use_sw=True), None),
        "bad-moh.json": js(dcpythia_config(**tiny, moh={"shared_heads": 2,
                                                          "routed_topk": 2}), None),
        "bad-types.json": b'{"model_type": "dcpythia", "dim": "4096", "n_head": 32.5, '
                          b'"n_layer": 1e999, "intermediate_size": -1, "vocab_size": 0, '
                          b'"use_qk_norm": 1, "rotary_pct": 2.0}\n',
        "bad-act.json": js(pythia_config(64, 4, 2, 256, 512, hidden_act="gelu_new"), None),
        "bad-model-type.json": b'{"model_type": "llama", "hidden_size": 64}\n',
        "bad-truncated.json": js(dcpythia_config())[:200],
        "bad-array.json": b'[{"model_type": "gpt_neox"}]\n',
    }


# ---------------------------------------------------------------- index json

def dcpythia_names(n_layer=2):
    names = ["tok_embeddings.weight", "norm.weight", "norm.bias", "output.weight"]
    for l in range(n_layer):
        p = "layers.%d." % l
        names += [p + "attention_norm.weight", p + "attention_norm.bias",
                  p + "ffn_norm.weight", p + "ffn_norm.bias",
                  p + "attention.wqkv.weight", p + "attention.wqkv.bias",
                  p + "attention.wo.weight", p + "attention.wo.bias",
                  p + "attention.q_norm.scale", p + "attention.k_norm.scale",
                  p + "attention.dyn_w_proj.dw1", p + "attention.dyn_w_proj.qkw",
                  p + "attention.dyn_w_proj.dd",
                  p + "feed_forward.w1.weight", p + "feed_forward.w1.bias",
                  p + "feed_forward.w2.weight", p + "feed_forward.w2.bias"]
    return names


def index_bytes(names, shard_fmt, n_shards, total_size=123456):
    wm = {}
    for i, name in enumerate(names):
        k = i * n_shards // len(names) + 1
        wm[name] = shard_fmt % (k, n_shards)
    return (json.dumps({"metadata": {"total_size": total_size}, "weight_map": wm},
                       indent=2, sort_keys=True) + "\n").encode()


def index_seeds():
    st = "model-%05d-of-%05d.safetensors"
    pt = "pytorch_model-%05d-of-%05d.bin"
    neox = ["gpt_neox.embed_in.weight", "gpt_neox.final_layer_norm.weight",
            "gpt_neox.final_layer_norm.bias", "embed_out.weight",
            "gpt_neox.layers.0.attention.bias", "gpt_neox.layers.0.attention.masked_bias",
            "gpt_neox.layers.0.attention.rotary_emb.inv_freq",
            "gpt_neox.layers.0.attention.query_key_value.weight",
            "gpt_neox.layers.0.mlp.dense_h_to_4h.weight"]
    return {
        "dcpythia-safetensors.json": index_bytes(dcpythia_names(2), st, 2),
        "dcpythia-torch.json": index_bytes(dcpythia_names(1), pt, 3),
        "pythia-torch.json": index_bytes(neox, pt, 2),
        "one-shard.json": b'{"weight_map": {"a": "model.safetensors"}}',
        "bad-dotdot.json": b'{"weight_map": {"a": "../model.safetensors", "b": "x/y"}}\n',
        "bad-not-string.json": b'{"metadata": {}, "weight_map": {"a": 3, "b": null}}\n',
        "bad-duplicate.json": b'{"weight_map": {"a": "s1", "b": "s2", "a": "s2"}}\n',
        "bad-empty.json": b'{"metadata": {"total_size": 0}, "weight_map": {}}\n',
        "bad-array.json": b'{"weight_map": ["a", "b"]}\n',
    }


# ---------------------------------------------------------------- jsonl

def jsonl_seeds():
    """Published-format lines from synth_tasks.generate (a handful of tasks,
    one file each plus a multi-line one) and some malformed lines."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:
        sys.path.insert(0, root)
    from synth_tasks import generate
    recs = generate(task_ids=["task0", "task5", "task17", "task40"], lines_per_task=1, seed=7)
    line = [(json.dumps(r) + "\n").encode() for r in recs]
    return {
        "task0.jsonl": line[0],
        "task5.jsonl": line[1],
        "multi-bom-crlf.jsonl": b"\xef\xbb\xbf" + line[2].replace(b"\n", b"\r\n") +
                                b"\n   \n" + line[3],
        "ascii-escaped.jsonl": (json.dumps(recs[3], ensure_ascii=True) + "\n").encode(),
        "bad-lines.jsonl": b'{"task_id": "t", "texts": "\\na [ b \\n"}\n'
                           b'{"task_id": "t", "texts": "\\na [ ] c\\n"}\n'
                           b'{"task_id": 3, "texts": "x"}\n'
                           b'["task0", "texts"]\n'
                           b'{"task_id": "t"\n'
                           b'\xff\xfe not utf-8\n',
        # regression: json's decoder raised RecursionError (not DatasetError)
        "deep-nesting.jsonl": line[0] + b'{"task_id": "t", "texts": "a [ b ]", "x": ' +
                              b"[" * 3000 + b"\n",
    }


def write_seeds(out, sub, seeds):
    d = os.path.join(out, sub)
    os.makedirs(d, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    return len(seeds)


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
        "views.bin": torch_views_example(),
    }
    for name, data in zips.items():
        with open(os.path.join(tz_dir, name), "wb") as f:
            f.write(data)
    n_cfg = write_seeds(out, "config", config_seeds())
    n_idx = write_seeds(out, "index", index_seeds())
    n_jl = write_seeds(out, "jsonl", jsonl_seeds())
    print("wrote %d safetensors, %d torch zip, %d config, %d index and %d jsonl seeds under %s"
          % (len(seeds), len(zips), n_cfg, n_idx, n_jl, out))


if __name__ == "__main__":
    main()
