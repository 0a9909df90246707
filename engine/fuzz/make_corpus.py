#!/usr/bin/env python3
"""Write the fuzzers' seed corpora: small, real-shaped inputs for each target.

    python3 engine/fuzz/make_corpus.py [OUT_DIR]     (default: engine/fuzz/corpus)

OUT_DIR/safetensors/  safetensors files (F32/F16/BF16, metadata, padding,
                      unaligned offsets, an empty tensor, a skipped bool buffer)
OUT_DIR/torchzip/     PyTorch zip checkpoints laid out as torch.save writes
                      them (data.pkl: pickle protocol 2 or 4 of an
                      OrderedDict of _rebuild_tensor_v2 calls made by the
                      standard pickle module; zip64 or classic end records)

The files are written by dclens.testing.checkpoint, the one writer of every
test fixture, and the config.json seeds by make_tiny's config writers; torch
is not needed. synth_tasks (from this repository) makes the JSONL seeds.
"""
import json
import os
import struct
import sys
from collections import OrderedDict

from dclens.testing.checkpoint import TorchTensor, safetensors_bytes, torch_checkpoint_bytes
from dclens.testing.layouts import dcpythia_tensors
from dclens.testing.make_tiny import dcpythia_config as _dcp_config, gpt_neox_config as _neox_config


def f32(*v):
    return struct.pack("<%df" % len(v), *v)


def f16(*v):
    return struct.pack("<%de" % len(v), *v)


def bf16(*v):
    return b"".join(struct.pack("<f", x)[2:] for x in v)


# ---------------------------------------------------------------- torch zip

def torch_views_example():
    """Strided views as torch.save keeps them: transposed and expanded (stride 0)."""
    sd = OrderedDict()
    sd["t"] = TorchTensor("s0", "float16", 12, 0, (3, 4), (1, 3))          # a [4, 3] storage read transposed
    sd["x"] = TorchTensor("s0", "float16", 12, 6, (5, 3), (0, 1))          # one row expanded
    sd["sw"] = TorchTensor("s0", "float16", 12, 0, (2, 2, 2), (0, 2, 1))   # eye(N).expand(2, N, N) style
    return torch_checkpoint_bytes(sd, {"s0": f16(*[0.5 * i for i in range(12)])})


def torch_example(dtype="float16", pack=f16, **kw):
    sd = OrderedDict()
    sd["layers.0.attention.wqkv.weight"] = TorchTensor("s0", dtype, 12, 0, (3, 2))
    sd["layers.0.attention.wo.weight"] = TorchTensor("s0", dtype, 12, 6, (2, 3))
    sd["norm.weight"] = TorchTensor("s1", dtype, 3, 0, (3,))
    sd["scalar"] = TorchTensor("s1", dtype, 3, 2, ())
    storages = {"s0": pack(*[0.5 * i for i in range(12)]), "s1": pack(1.0, 2.0, 3.0)}
    return torch_checkpoint_bytes(sd, storages, container="ordereddict_meta", **kw)


# ---------------------------------------------------------------- config.json

def dcpythia_config(dim=4096, n_head=32, n_layer=32, intermediate=16384, vocab=50257, **over):
    """config.json of the published DCPythia-6.9B (model-spec.md section 2), or
    smaller, with `over` replacing or adding keys."""
    cfg = _dcp_config(n_layer=n_layer, dim=dim, n_head=n_head, vocab=vocab, intermediate=intermediate,
                      window_size=256, window_type=None, query_wise=False, use_qk_norm=True,
                      use_parallel_residual=True, use_linear_bias=True, use_dcmha=True, rotary_pct=0.25,
                      tie_word_embeddings=False, dtype="float16")
    cfg.update(over)
    return cfg


def pythia_config(hidden=512, heads=8, layers=6, intermediate=2048, vocab=50304, **over):
    """config.json of a Pythia GPTNeoXForCausalLM (pythia-70m's by default)."""
    cfg = _neox_config(n_layer=layers, dim=hidden, n_head=heads, vocab=vocab, intermediate=intermediate,
                       rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False, dtype="float16")
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
    """The tensor names of a DCPythia checkpoint (dclens.testing.layouts)."""
    return list(dcpythia_tensors(n_layer=n_layer, dim=64, n_head=4, vocab=512, intermediate=256))


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
        "f32.safetensors": safetensors_bytes({"a": ("F32", [2, 2], f32(1, 2, 3, 4))}, sort=False),
        "mixed.safetensors": safetensors_bytes(
            {"w.f16": ("F16", [3], f16(1, -2, 0.5)),
             "w.bf16": ("BF16", [1, 3], bf16(1, 2, 3)),
             "w.f32": ("F32", [1], f32(7)),          # offset 12: unaligned for F32
             "empty": ("F32", [0, 4], b"")},
            metadata={"format": "pt"}, sort=False),
        "buffer.safetensors": safetensors_bytes(
            {"gpt_neox.layers.0.attention.bias": ("BOOL", [1, 1, 2, 2], b"\1\0\1\1"),
             "gpt_neox.layers.0.attention.masked_bias": ("F32", [], f32(-1e9))}, sort=False, pad_to=0),
    }
    for name, data in seeds.items():
        with open(os.path.join(st_dir, name), "wb") as f:
            f.write(data)
    zips = {
        "f16.bin": torch_example(zip64=False),
        "f32.bin": torch_example("float32", f32),
        "bf16.bin": torch_example("bfloat16", bf16),
        "proto4.bin": torch_example(protocol=4, archive_name="pytorch_model"),
        "zip64.bin": torch_example(),
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
