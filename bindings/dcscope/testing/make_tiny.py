"""Generate small random checkpoints in the exact published layouts.

    state_dict, config = make_tiny(out_dir, "dcpythia", dtype="float16", fmt="torch", shards=2)

writes `out_dir/config.json` and the weights, and returns what the files hold:
`state_dict` maps every tensor name written to a float32 numpy array (the values
after rounding to `dtype`, widened exactly), `config` is the dict in config.json.

Layouts (see shared/docs/model-spec.md):

* DCPythia (`model_type` "dcpythia"): `tok_embeddings`, `layers.{l}.attention.wqkv`
  (or wq/wk/wv with `fused_qkv=False`), `wo`, `q_norm.scale`, `k_norm.scale`,
  `dyn_w_proj.dw1` [D,1,4,K], `qkw` [1,4,K,2R,N], `dd` [D,1,4N], `feed_forward.w1/w2`,
  `attention_norm`, `ffn_norm`, `norm`, `output`; config.json with the keys of the
  published DCPythia-6.9B config.
* Pythia (`model_type` "gpt_neox"): Hugging Face GPTNeoXForCausalLM names, with
  `query_key_value` rows grouped per head (head n owns rows [n*3*Dh, (n+1)*3*Dh):
  its q, then k, then v).

Weight files:

* safetensors (`fmt="safetensors"`): written with `safetensors.numpy.save_file`
  for F32/F16; numpy has no bfloat16, so BF16 files (and any file when
  `st_writer="manual"`) are written by a small writer that produces the same
  bytes as the package (tensors sorted by element size then name, header padded
  with spaces to a multiple of 8).
* PyTorch zip (`fmt="torch"`): written without torch, as `torch.save` writes it:
  a zip64 archive of uncompressed records `<archive>/data.pkl`, `byteorder`,
  `data/<key>`, `version`, `.data/serialization_id`; every record's data starts
  on a 64-byte boundary thanks to an `FB` extra field in its local header (absent
  from the central directory), each record is followed by a data descriptor.
  data.pkl is a protocol-2 pickle assembled opcode by opcode, memo (BINPUT/BINGET)
  included, matching what CPython's pickler emits for torch's reduce of a state dict.
* Sharded: `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`,
  or `pytorch_model-0000i-of-0000n.bin` + `pytorch_model.bin.index.json`.

This module deliberately imports nothing from dcscope (it runs before the engine is
built) and never imports torch.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import zlib
from collections import OrderedDict

import numpy as np

__all__ = [
    "make_tiny",
    "round_to_dtype",
    "write_safetensors",
    "write_torch_zip",
    "TorchTensor",
    "pickle_state_dict",
    "dcpythia_config",
    "gpt_neox_config",
]

DTYPES = ("float32", "float16", "bfloat16")
_ST_NAME = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_TORCH_STORAGE = {"float32": "FloatStorage", "float16": "HalfStorage", "bfloat16": "BFloat16Storage"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


# --------------------------------------------------------------------------- dtypes

def _c_order(a):
    """C-contiguous copy if needed, keeping 0-d arrays 0-d (np.ascontiguousarray does not)."""
    a = np.asarray(a)
    return a if a.flags.c_contiguous else a.copy(order="C")


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


# --------------------------------------------------------------------------- configs

def dcpythia_config(*, n_layer, dim, n_head, vocab, intermediate, window_size, window_type,
                    query_wise, use_qk_norm, use_parallel_residual, use_linear_bias, use_dcmha,
                    rotary_pct, tie_word_embeddings, dtype, use_sw=False, moh=None, compose_groups=1,
                    key_wise=False):
    """config.json with the keys of the published DCPythia-6.9B config."""
    cfg = OrderedDict()
    cfg["architectures"] = ["DCPythia"]
    cfg["auto_map"] = {
        "AutoConfig": "configuration_dcpythia.DCPythiaConfig",
        "AutoModelForCausalLM": "modeling_dcpythia.DCPythia",
    }
    cfg["block_size"] = 2048
    cfg["bos_token_id"] = 0
    cfg["dim"] = dim
    cfg["eos_token_id"] = 0
    cfg["head_dim"] = dim // n_head
    cfg["intermediate_size"] = intermediate
    cfg["is_training"] = False
    cfg["model_type"] = "dcpythia"
    cfg["n_head"] = n_head
    cfg["n_layer"] = n_layer
    cfg["n_local_heads"] = n_head
    cfg["norm_eps"] = 1e-05
    cfg["q_chunk_size"] = 128
    cfg["query_wise"] = bool(query_wise)
    cfg["rope_base"] = 10000
    cfg["rotary_pct"] = rotary_pct
    cfg["tie_word_embeddings"] = bool(tie_word_embeddings)
    cfg["torch_dtype"] = dtype
    cfg["transformers_version"] = "4.33.2"
    cfg["use_dcmha"] = bool(use_dcmha)
    cfg["use_gradient_checkpointing"] = False
    cfg["use_linear_bias"] = bool(use_linear_bias)
    cfg["use_parallel_residual"] = bool(use_parallel_residual)
    cfg["use_qk_norm"] = bool(use_qk_norm)
    cfg["vocab_size"] = vocab
    cfg["window_size"] = window_size
    cfg["window_type"] = window_type
    # attention variants of model-spec.md section 5, only written when switched on
    if use_sw:
        cfg["use_sw"] = True
    if moh is not None:
        cfg["moh"] = {"shared_heads": int(moh["shared_heads"]), "routed_topk": int(moh["routed_topk"])}
    if compose_groups != 1:
        cfg["compose_groups"] = int(compose_groups)
    if key_wise:
        cfg["key_wise"] = True
    return dict(cfg)


def gpt_neox_config(*, n_layer, dim, n_head, vocab, intermediate, rotary_pct,
                    use_parallel_residual, tie_word_embeddings, dtype):
    """config.json as Hugging Face writes it for a Pythia GPTNeoXForCausalLM."""
    cfg = OrderedDict()
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    cfg["bos_token_id"] = 0
    cfg["eos_token_id"] = 0
    cfg["hidden_act"] = "gelu"
    cfg["hidden_size"] = dim
    cfg["initializer_range"] = 0.02
    cfg["intermediate_size"] = intermediate
    cfg["layer_norm_eps"] = 1e-05
    cfg["max_position_embeddings"] = 2048
    cfg["model_type"] = "gpt_neox"
    cfg["num_attention_heads"] = n_head
    cfg["num_hidden_layers"] = n_layer
    cfg["rotary_emb_base"] = 10000
    cfg["rotary_pct"] = rotary_pct
    cfg["tie_word_embeddings"] = bool(tie_word_embeddings)
    cfg["torch_dtype"] = dtype
    cfg["transformers_version"] = "4.24.0"
    cfg["use_cache"] = True
    cfg["use_parallel_residual"] = bool(use_parallel_residual)
    cfg["vocab_size"] = vocab
    return dict(cfg)


# --------------------------------------------------------------------------- random weights

class _Gen:
    def __init__(self, seed, weight_scale, dyn_scale):
        self.rng = np.random.default_rng(seed)
        self.ws = float(weight_scale)
        self.dyn = float(dyn_scale)

    def normal(self, shape, std):
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def linear(self, out_f, in_f, gain=1.0):
        return self.normal((out_f, in_f), gain * self.ws / np.sqrt(in_f))

    def bias(self, n):
        return self.normal((n,), 0.1)

    def ln(self, n):
        return (1.0 + self.normal((n,), 0.1)).astype(np.float32), self.normal((n,), 0.1)


def _dcpythia_weights(g, *, n_layer, dim, n_head, vocab, intermediate, rank, fused_qkv,
                      use_qk_norm, use_linear_bias, use_dcmha, write_unused_dyn,
                      tie_word_embeddings, extra_derived, use_sw, moh, compose_groups=1):
    """Random DCPythia state dict, float32, in torch state_dict() order.

    Scales: LayerNorm outputs are O(1) per dim; linear weights have std gain/sqrt(in),
    so q/k/v and MLP activations are O(1); QK-norm scales ~1.2 make scores O(1-2).
    Dynamic weights: x @ dw1 ~ N(0, 1) per hidden unit, gelu(.) has rms ~0.65; qkw
    std 0.6/sqrt(K) gives w2 entries ~0.4, so qp/kp ~ sqrt(R*N)*0.4*|A| are comparable
    to skip; dd std 1/sqrt(D) gives tanh gates ~ +-0.6 (qg/kg ~ 0.6*skip).
    The output embedding has std 3/sqrt(D): logits of std ~3.
    """
    D, N, F, V, R = dim, n_head, intermediate, vocab, rank
    Dh = D // N
    K = 4 * N
    G = int(compose_groups)
    Mg = N // G  # heads per composition group: the published layout's G axis
    sd = OrderedDict()
    sd["tok_embeddings.weight"] = g.normal((V, D), 1.0)
    for l in range(n_layer):
        p = f"layers.{l}."
        wqkv = g.linear(3 * D, D)
        bqkv = g.bias(3 * D) if use_linear_bias else None
        if fused_qkv:
            sd[p + "attention.wqkv.weight"] = wqkv
            if use_linear_bias:
                sd[p + "attention.wqkv.bias"] = bqkv
        else:
            for i, nm in enumerate(("wq", "wk", "wv")):
                sd[p + f"attention.{nm}.weight"] = np.ascontiguousarray(wqkv[i * D:(i + 1) * D])
                if use_linear_bias:
                    sd[p + f"attention.{nm}.bias"] = np.ascontiguousarray(bqkv[i * D:(i + 1) * D])
        sd[p + "attention.wo.weight"] = g.linear(D, D)
        if use_linear_bias:
            sd[p + "attention.wo.bias"] = g.bias(D)
        if use_dcmha or write_unused_dyn:
            q = p + "attention.dyn_w_proj."
            dw1 = g.normal((D, G, 4, K), g.dyn / np.sqrt(D))
            qkw = g.normal((G, 4, K, 2 * R, Mg), g.dyn * 0.6 / np.sqrt(K))
            dd = g.normal((D, G, 4 * Mg), g.dyn / np.sqrt(D))
            sd[q + "dw1"], sd[q + "qkw"], sd[q + "dd"] = dw1, qkw, dd
            pre_w = post_w = None
            if use_sw:
                pre_w = g.normal((G, Mg, Mg), 0.3)
                post_w = g.normal((G, Mg, Mg), 0.3)
            if extra_derived and G == 1:
                # merge_weights() of the published module: dw_m = [dw1 | dd] flattened,
                # qkw_m = qkw reshaped (4, K, 2R*N), sw = static maps + identity.
                sd[q + "dw_m"] = np.concatenate([dw1.reshape(D, -1), dd[:, 0, :]], axis=-1)
                sd[q + "qkw_m"] = qkw.reshape(4, K, -1).copy()
                eye = np.eye(N, dtype=np.float32)
                if use_sw:
                    sd[q + "sw"] = np.stack([pre_w[0], post_w[0]]) + eye
                else:
                    sd[q + "sw"] = np.stack([eye, eye])
            if use_sw:
                sd[q + "pre_proj.w"] = pre_w
                sd[q + "post_proj.w"] = post_w
            elif extra_derived:
                # identity buffers of CrossHeadProjection when use_sw is off
                sd[q + "pre_proj.w"] = np.broadcast_to(np.eye(Mg, dtype=np.float32), (G, Mg, Mg)).copy()
                sd[q + "post_proj.w"] = np.broadcast_to(np.eye(Mg, dtype=np.float32), (G, Mg, Mg)).copy()
        if moh is not None:
            hs = int(moh["shared_heads"])
            sd[p + "attention.moh.wg.weight"] = g.linear(N - hs, D, gain=2.0)
            if hs > 1:
                sd[p + "attention.moh.wg_1.weight"] = g.linear(hs, D, gain=2.0)
            if hs > 0:
                sd[p + "attention.moh.wg_0.weight"] = g.linear(2, D, gain=2.0)
        if use_qk_norm:
            sd[p + "attention.q_norm.scale"] = (1.2 + g.normal((Dh,), 0.2)).astype(np.float32)
            sd[p + "attention.k_norm.scale"] = (1.2 + g.normal((Dh,), 0.2)).astype(np.float32)
        sd[p + "feed_forward.w1.weight"] = g.linear(F, D)
        if use_linear_bias:
            sd[p + "feed_forward.w1.bias"] = g.bias(F)
        sd[p + "feed_forward.w2.weight"] = g.linear(D, F)
        if use_linear_bias:
            sd[p + "feed_forward.w2.bias"] = g.bias(D)
        sd[p + "ffn_norm.weight"], sd[p + "ffn_norm.bias"] = g.ln(D)
        sd[p + "attention_norm.weight"], sd[p + "attention_norm.bias"] = g.ln(D)
    sd["norm.weight"], sd["norm.bias"] = g.ln(D)
    out = g.normal((V, D), 3.0 / np.sqrt(D))
    if not tie_word_embeddings:
        sd["output.weight"] = out
    return sd


def _gpt_neox_weights(g, *, n_layer, dim, n_head, vocab, intermediate, rotary_pct,
                      tie_word_embeddings, extra_derived):
    """Random Pythia state dict, float32, in Hugging Face state_dict() order."""
    D, N, F, V = dim, n_head, intermediate, vocab
    Dh = D // N
    r = int(Dh * rotary_pct)
    sd = OrderedDict()
    sd["gpt_neox.embed_in.weight"] = g.normal((V, D), 1.0)
    for l in range(n_layer):
        p = f"gpt_neox.layers.{l}."
        sd[p + "input_layernorm.weight"], sd[p + "input_layernorm.bias"] = g.ln(D)
        sd[p + "post_attention_layernorm.weight"], sd[p + "post_attention_layernorm.bias"] = g.ln(D)
        if extra_derived:
            # buffers HF used to save; loaders must ignore them (attention.bias, a bool
            # causal mask, is not written: safetensors/torch bool storages are out of scope)
            sd[p + "attention.masked_bias"] = np.array(-1e9, dtype=np.float32)
            sd[p + "attention.rotary_emb.inv_freq"] = (
                1.0 / (10000.0 ** (np.arange(0, r, 2, dtype=np.float64) / r))).astype(np.float32)
        # rows grouped per head: [N, (q, k, v), Dh, D]
        sd[p + "attention.query_key_value.weight"] = g.linear(3 * D, D, gain=1.2)
        sd[p + "attention.query_key_value.bias"] = g.bias(3 * D)
        sd[p + "attention.dense.weight"] = g.linear(D, D)
        sd[p + "attention.dense.bias"] = g.bias(D)
        sd[p + "mlp.dense_h_to_4h.weight"] = g.linear(F, D)
        sd[p + "mlp.dense_h_to_4h.bias"] = g.bias(F)
        sd[p + "mlp.dense_4h_to_h.weight"] = g.linear(D, F)
        sd[p + "mlp.dense_4h_to_h.bias"] = g.bias(D)
    sd["gpt_neox.final_layer_norm.weight"], sd["gpt_neox.final_layer_norm.bias"] = g.ln(D)
    out = g.normal((V, D), 3.0 / np.sqrt(D))
    if not tie_word_embeddings:
        sd["embed_out.weight"] = out
    return sd


def _is_f32_buffer(name):
    """Tensors always stored as F32 whatever the checkpoint dtype (HF buffers)."""
    return name.endswith("attention.masked_bias") or name.endswith("rotary_emb.inv_freq")


# --------------------------------------------------------------------------- safetensors

def _have_safetensors() -> bool:
    import importlib.util
    return importlib.util.find_spec("safetensors") is not None


def write_safetensors(path, tensors, metadata=None, *, writer="auto"):
    """Write `tensors` (name -> (dtype, raw little-endian numpy array)) to `path`.

    writer: "package" uses safetensors.numpy.save_file (F32/F16 only), "manual" the
    local writer, "auto" the package unless a tensor is bfloat16.
    """
    if metadata is None:
        metadata = {"format": "pt"}
    has_bf16 = any(dt == "bfloat16" for dt, _ in tensors.values())
    if writer == "auto":          # the package when installed (test extra), else the local writer
        writer = "manual" if has_bf16 or not _have_safetensors() else "package"
    if writer == "package":
        if has_bf16:
            raise ValueError("safetensors.numpy cannot write bfloat16; use writer='manual'")
        if not _have_safetensors():
            raise ValueError("writer='package' needs the safetensors package (pip install "
                             "'dcscope[test]'); writer='manual' or 'auto' works without it")
        from safetensors.numpy import save_file
        save_file({k: _c_order(a) for k, (dt, a) in tensors.items()}, str(path), metadata=metadata)
        return
    if writer != "manual":
        raise ValueError(f"unknown safetensors writer {writer!r}")
    # Same layout as the Rust serializer: tensors sorted by decreasing element size,
    # then by name; compact JSON header (__metadata__ first) padded with spaces to 8.
    order = sorted(tensors, key=lambda k: (-_ITEMSIZE[tensors[k][0]], k))
    header = OrderedDict()
    header["__metadata__"] = dict(metadata)
    blobs, off = [], 0
    for k in order:
        dt, a = tensors[k]
        b = _c_order(a).tobytes()
        header[k] = {"dtype": _ST_NAME[dt], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - len(hjson) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for b in blobs:
            f.write(b)


# --------------------------------------------------------------------------- pickle emitter

class _Global:
    """A GLOBAL reference (module, name); one instance per distinct global so that the
    pickle memo hits on reuse exactly as with the real class objects."""

    def __init__(self, module, name):
        self.module, self.name = module, name


class _Reduce:
    """func(*args), optionally followed by SETITEMS of `dictitems` and BUILD of `state`
    (what pickle's save_reduce emits for an object whose __reduce_ex__ returns it)."""

    def __init__(self, func, args, dictitems=None, state=None):
        self.func, self.args, self.dictitems, self.state = func, args, dictitems, state


class _PersId:
    """An object replaced by a persistent id (torch's storages)."""

    def __init__(self, pid):
        self.pid = pid


class _Pickler2:
    """A protocol-2 pickle writer for the few object kinds a torch state dict needs,
    emitting the same opcodes, in the same order, with the same memo numbering as
    CPython's pickle.Pickler (memo keyed by object identity)."""

    def __init__(self):
        self.out = bytearray(b"\x80\x02")  # PROTO 2
        self.memo = {}  # id(obj) -> (index, obj)  (obj kept alive, as pickle does)

    # memo
    def _put(self, obj):
        idx = len(self.memo)
        self.memo[id(obj)] = (idx, obj)
        self.out += (b"q" + struct.pack("<B", idx)) if idx < 256 else (b"r" + struct.pack("<I", idx))

    def _get(self, obj):
        hit = self.memo.get(id(obj))
        if hit is None:
            return False
        idx = hit[0]
        self.out += (b"h" + struct.pack("<B", idx)) if idx < 256 else (b"j" + struct.pack("<I", idx))
        return True

    def save(self, obj):
        out = self.out
        if isinstance(obj, _PersId):
            self.save(obj.pid)  # the pid tuple is pickled (and memoized) like any tuple
            out += b"Q"  # BINPERSID
            return
        if obj is None:
            out += b"N"
            return
        if obj is True or obj is False:
            out += b"\x88" if obj else b"\x89"  # NEWTRUE / NEWFALSE
            return
        if isinstance(obj, (int, np.integer)):
            self._save_int(int(obj))
            return
        if self._get(obj):
            return
        if isinstance(obj, str):
            b = obj.encode("utf-8", "surrogatepass")
            out += b"X" + struct.pack("<I", len(b)) + b  # BINUNICODE
            self._put(obj)
        elif isinstance(obj, tuple):
            self._save_tuple(obj)
        elif isinstance(obj, _Global):
            out += b"c" + obj.module.encode("ascii") + b"\n" + obj.name.encode("ascii") + b"\n"
            self._put(obj)
        elif isinstance(obj, _Reduce):
            self.save(obj.func)
            self.save(obj.args)
            self.out += b"R"  # REDUCE
            self._put(obj)
            if obj.dictitems is not None:
                self._batch_setitems(obj.dictitems)
            if obj.state is not None:
                self.save(obj.state)
                self.out += b"b"  # BUILD
        elif isinstance(obj, dict):
            out += b"}"  # EMPTY_DICT
            self._put(obj)
            self._batch_setitems(list(obj.items()))
        else:
            raise TypeError(f"cannot pickle {type(obj).__name__}")

    def _save_int(self, v):
        if 0 <= v <= 0xFF:
            self.out += b"K" + struct.pack("<B", v)
        elif 0 <= v <= 0xFFFF:
            self.out += b"M" + struct.pack("<H", v)
        elif -0x80000000 <= v <= 0x7FFFFFFF:
            self.out += b"J" + struct.pack("<i", v)
        else:
            n = (v.bit_length() >> 3) + 1
            enc = v.to_bytes(n, "little", signed=True)
            if v < 0 and n > 1 and enc[-1] == 0xFF and (enc[-2] & 0x80) != 0:
                enc = enc[:-1]
            self.out += (b"\x8a" + struct.pack("<B", len(enc)) + enc) if len(enc) < 256 else (
                b"\x8b" + struct.pack("<i", len(enc)) + enc)

    def _save_tuple(self, t):
        if len(t) == 0:
            self.out += b")"  # EMPTY_TUPLE, never memoized
            return
        if len(t) <= 3:
            for e in t:
                self.save(e)
            self.out += (b"\x85", b"\x86", b"\x87")[len(t) - 1]  # TUPLE1/2/3
            self._put(t)
            return
        self.out += b"("  # MARK
        for e in t:
            self.save(e)
        self.out += b"t"  # TUPLE
        self._put(t)

    def _batch_setitems(self, items):
        items = list(items)
        for i in range(0, len(items), 1000):  # pickle's _BATCHSIZE
            batch = items[i:i + 1000]
            if len(batch) > 1:
                self.out += b"("
                for k, v in batch:
                    self.save(k)
                    self.save(v)
                self.out += b"u"  # SETITEMS
            else:
                k, v = batch[0]
                self.save(k)
                self.save(v)
                self.out += b"s"  # SETITEM

    def dump(self, obj):
        self.save(obj)
        self.out += b"."  # STOP
        return bytes(self.out)


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


def _module_metadata(names):
    """`state_dict()._metadata`: {module prefix: {'version': 1}} in pre-order."""
    meta, seen = [], set()
    for n in names:
        parts = n.split(".")[:-1]
        for i in range(len(parts) + 1):
            pre = ".".join(parts[:i])
            if pre not in seen:
                seen.add(pre)
                meta.append(pre)
    return meta


def pickle_state_dict(tensors, *, container="ordereddict"):
    """data.pkl bytes for `tensors` (name -> TorchTensor) as torch.save(state_dict) writes it.

    container: "ordereddict" (collections.OrderedDict, what Module.state_dict() returns,
    here without its _metadata), "ordereddict_meta" (with the `_metadata` attribute,
    BUILD at the end, as torch.save(model.state_dict()) writes), or "dict" (a plain
    dict, as Hugging Face's shard dicts are).
    Returns (pickle_bytes, storage_keys) where storage_keys maps storage_id -> key str
    in order of first appearance.
    """
    g_odict = _Global("collections", "OrderedDict")
    g_rebuild = _Global("torch._utils", "_rebuild_tensor_v2")
    g_storage = {}
    s_storage, s_cpu = "storage", "cpu"  # one object each, like the interned literals
    keys = OrderedDict()
    items = []
    for name, t in tensors.items():
        if t.storage_id not in keys:
            keys[t.storage_id] = str(len(keys))
        st = _TORCH_STORAGE[t.dtype]
        if st not in g_storage:
            g_storage[st] = _Global("torch", st)
        pid = _PersId((s_storage, g_storage[st], keys[t.storage_id], s_cpu, t.storage_numel))
        args = (pid, t.offset, tuple(t.shape), tuple(t.stride), False, _Reduce(g_odict, ()))
        items.append((str(name), _Reduce(g_rebuild, args)))
    if container == "dict":
        top = dict(items)
    elif container == "ordereddict":
        top = _Reduce(g_odict, (), dictitems=items)
    elif container == "ordereddict_meta":
        meta_items = [(pre, {"version": 1}) for pre in _module_metadata(tensors.keys())]
        # the 'version' key is one (interned) object in every per-module dict
        kv = "version"
        meta_items = [(pre, {kv: 1}) for pre, _ in meta_items]
        top = _Reduce(g_odict, (), dictitems=items,
                      state={"_metadata": _Reduce(g_odict, (), dictitems=meta_items)})
    else:
        raise ValueError(f"unknown pickle container {container!r}")
    data = _Pickler2().dump(top)
    return data, dict(keys)


# --------------------------------------------------------------------------- torch zip

_DOS_TIME = 0  # 00:00:00
_DOS_DATE = ((2024 - 1980) << 9) | (1 << 5) | 1  # 2024-01-01: fixed for reproducible files
_FIELD_ALIGNMENT = 64


def _hash_combine(seed, value):
    """c10::hash_combine on 64-bit size_t."""
    m = (1 << 64) - 1
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & m) + (seed >> 2)) & m)) & m


def _torch_zip_bytes(records, archive_name):
    """Zip bytes as PyTorchStreamWriter (miniz, zip64 mode) writes them.

    Per record: local header (version needed 0, flags 0x0808 = data descriptor + UTF-8,
    stored, crc and sizes 0), name, extra field 'FB' + u16 n + n*'Z' so that the data
    starts on a 64-byte boundary, data, data descriptor (PK\\x07\\x08, crc, sizes).
    Central directory entries carry the real crc/sizes and no extra field. Then the
    zip64 end-of-central-directory record and locator, then the classic EOCD.
    """
    buf = bytearray()
    central = bytearray()
    flags = 0x0808
    for name, data in records:
        full = f"{archive_name}/{name}".encode("utf-8")
        data = bytes(data)
        cursor = len(buf)
        if len(data) >= 0xFFFFFFFF or cursor >= 0xFFFFFFFF:
            raise ValueError("records of 4 GiB or more are not supported by this writer")
        start = cursor + 30 + len(full) + 4
        pad = (-start) % _FIELD_ALIGNMENT
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        crc = zlib.crc32(data) & 0xFFFFFFFF
        buf += struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, _DOS_TIME, _DOS_DATE,
                           0, 0, 0, len(full), len(extra))
        buf += full + extra
        assert len(buf) % _FIELD_ALIGNMENT == 0
        buf += data
        buf += struct.pack("<IIII", 0x08074B50, crc, len(data), len(data))
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, flags, 0, _DOS_TIME, _DOS_DATE,
                               crc, len(data), len(data), len(full), 0, 0, 0, 0, 0, cursor)
        central += full
    cd_ofs, cd_size, n = len(buf), len(central), len(records)
    buf += central
    z64_ofs = len(buf)
    buf += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, n, n, cd_size, cd_ofs)
    buf += struct.pack("<IIQI", 0x07064B50, 0, z64_ofs, 1)
    buf += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                       min(cd_size, 0xFFFFFFFF), min(cd_ofs, 0xFFFFFFFF), 0)
    return bytes(buf)


def write_torch_zip(path, tensors, storages, *, archive_name="archive", container="ordereddict",
                    torch_style="2.1"):
    """Write a torch.save-style zip checkpoint.

    tensors: name -> TorchTensor; storages: storage_id -> raw little-endian bytes.
    archive_name: the folder inside the zip ("archive" as for torch.save to a buffer;
    None for what torch.save(obj, path) uses: the file's basename without extension).
    torch_style: "2.1" (records data.pkl, byteorder, data/<key> in lexicographic key
    order, version, .data/serialization_id) or "2.7" (adds .format_version "1" and
    .storage_alignment "64" after data.pkl; data/<key> in numeric order).
    """
    if archive_name is None:
        archive_name = os.path.splitext(os.path.basename(str(path)))[0]
    data_pkl, keys = pickle_state_dict(tensors, container=container)
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
    with open(path, "wb") as f:
        f.write(_torch_zip_bytes(records, archive_name))


# --------------------------------------------------------------------------- sharding

def _storage_plan(names, model_type, fused_qkv, share_storage):
    """storage groups for the torch writer: list of (storage_id, [names...]) where the
    names of one group are laid out back to back in one storage (views at offsets)."""
    groups = OrderedDict()
    for n in names:
        sid = ("own", n)
        if share_storage:
            if n.endswith(("norm.weight", "norm.bias", "layernorm.weight", "layernorm.bias")):
                sid = ("ln", n.rsplit(".", 1)[0])  # LayerNorm weight + bias in one storage
            elif model_type == "dcpythia" and not fused_qkv:
                for nm in ("wq", "wk", "wv"):
                    tag = f".attention.{nm}."
                    if tag in n:
                        sid = ("qkv", n.replace(tag, ".attention.wqkv."))  # wq/wk/wv rows of one storage
        groups.setdefault(sid, []).append(n)
    return list(groups.items())


def _split_shards(names, groups_of_name, nbytes, shards):
    """Contiguous shards of roughly equal size; tensors of one storage group stay together."""
    units = []  # list of lists of names, in order
    unit_of = {}
    for n in names:
        gid = groups_of_name[n]
        if gid not in unit_of:
            unit_of[gid] = len(units)
            units.append([])
        units[unit_of[gid]].append(n)
    if shards < 1:
        raise ValueError("shards must be >= 1")
    if shards > len(units):
        raise ValueError(f"cannot split {len(units)} tensor groups into {shards} shards")
    sizes = [sum(nbytes[n] for n in u) for u in units]
    total = sum(sizes)
    out, acc = [[]], 0
    for i, (u, s) in enumerate(zip(units, sizes)):
        need = shards - len(out)  # shards still to open after the current one
        left = len(units) - i  # units left, this one included
        if out[-1] and need > 0 and (left <= need or acc + s / 2 > total * len(out) / shards):
            out.append([])
        out[-1].extend(u)
        acc += s
    assert len(out) == shards, (len(out), shards)
    return out


# --------------------------------------------------------------------------- main entry

def make_tiny(out_dir, model_type="dcpythia", *, n_layer=2, dim=32, n_head=4, vocab=64,
              intermediate=None, rank=2, window_size=8, window_type=None, query_wise=False,
              use_qk_norm=True, use_parallel_residual=True, use_linear_bias=True, use_dcmha=True,
              rotary_pct=0.25, dtype="float32", fmt="safetensors", shards=1, fused_qkv=True,
              tie_word_embeddings=False, seed=0, weight_scale=1.0, dyn_scale=1.0, tokenizer=None,
              extra_derived=False, share_storage=False, write_unused_dyn=True, use_sw=False,
              moh=None, compose_groups=1, key_wise=False, torch_views=None, archive_name="archive",
              pickle_container="ordereddict", torch_style="2.1", st_writer="auto"):
    """Write a tiny random checkpoint directory; return (state_dict, config).

    state_dict: name -> np.float32 array of exactly what the files hold (after rounding
    to `dtype`). config: the dict written to config.json.

    Options beyond the obvious ones:
      rank: R of the dynamic projections (qkw has 2R rows per slot); K = 4*n_head.
      fused_qkv: DCPythia only; False writes attention.wq/wk/wv instead of wqkv (same
        values for the same seed: the rows of the fused matrix).
      weight_scale: multiplies the std of every linear weight; dyn_scale: of dw1/qkw/dd.
      tokenizer: path of a tokenizer.json copied into the directory.
      extra_derived: DCPythia: also write dyn_w_proj.dw_m/qkw_m/sw and the identity
        pre_proj.w/post_proj.w buffers; Pythia: attention.masked_bias and
        attention.rotary_emb.inv_freq (F32). Loaders must ignore all of them.
      share_storage: torch format: LayerNorm weight+bias share one storage, and unfused
        wq/wk/wv (weights, and biases) are views into one storage at offsets.
      write_unused_dyn: with use_dcmha=False still write dyn_w_proj (the published
        module always has it); loaders must not use it.
      use_sw / moh: attention variants of model-spec.md section 5 (DCPythia only);
        moh = {"shared_heads": hs, "routed_topk": k}.
      compose_groups: G, heads composed within G groups (the published layout's G
        axis: dw1 [D,G,4,K], qkw [G,4,K,2R,N/G], dd [D,G,4N/G], pre/post_proj.w
        [G,N/G,N/G]); written to config.json as "compose_groups" when not 1.
      key_wise: the key-wise-only ablation ("key_wise": true in config.json; the
        weights keep all 4 slots, the query ones then unused).
      window_size: None writes "window_size": null (no local layers).
      torch_views: torch format only, tensors stored as strided views the way
        torch.save keeps them: "transpose" stores every 2-D weight's storage
        transposed with stride (1, rows); "expand" makes every LayerNorm bias a
        constant stored as one element with stride (0,) (and, with extra_derived,
        the identity `sw` buffer an expanded eye, stride (0, N, 1)).
      archive_name / pickle_container / torch_style: see write_torch_zip and
        pickle_state_dict. st_writer: "auto" | "package" | "manual" (safetensors).
    """
    if model_type not in ("dcpythia", "gpt_neox"):
        raise ValueError(f"model_type must be 'dcpythia' or 'gpt_neox', not {model_type!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"fmt must be 'safetensors' or 'torch', not {fmt!r}")
    if dim % n_head:
        raise ValueError("dim must be a multiple of n_head")
    if window_type not in (None, "LG", "LGLL", "LGL6"):
        raise ValueError(f"window_type must be None, 'LG', 'LGLL' or 'LGL6', not {window_type!r}")
    if model_type == "gpt_neox" and (use_sw or moh is not None or compose_groups != 1):
        raise ValueError("use_sw / moh / compose_groups are DCPythia switches")
    if n_head % int(compose_groups):
        raise ValueError("compose_groups must divide n_head")
    if torch_views not in (None, "transpose", "expand"):
        raise ValueError(f"torch_views must be None, 'transpose' or 'expand', not {torch_views!r}")
    if torch_views is not None and (fmt != "torch" or share_storage):
        raise ValueError("torch_views needs fmt='torch' and share_storage=False")
    intermediate = 4 * dim if intermediate is None else int(intermediate)
    os.makedirs(out_dir, exist_ok=True)
    g = _Gen(seed, weight_scale, dyn_scale)

    if model_type == "dcpythia":
        config = dcpythia_config(
            n_layer=n_layer, dim=dim, n_head=n_head, vocab=vocab, intermediate=intermediate,
            window_size=window_size, window_type=window_type, query_wise=query_wise,
            use_qk_norm=use_qk_norm, use_parallel_residual=use_parallel_residual,
            use_linear_bias=use_linear_bias, use_dcmha=use_dcmha, rotary_pct=rotary_pct,
            tie_word_embeddings=tie_word_embeddings, dtype=dtype, use_sw=use_sw, moh=moh,
            compose_groups=compose_groups, key_wise=key_wise)
        sd32 = _dcpythia_weights(
            g, n_layer=n_layer, dim=dim, n_head=n_head, vocab=vocab, intermediate=intermediate,
            rank=rank, fused_qkv=fused_qkv, use_qk_norm=use_qk_norm, use_linear_bias=use_linear_bias,
            use_dcmha=use_dcmha, write_unused_dyn=write_unused_dyn,
            tie_word_embeddings=tie_word_embeddings, extra_derived=extra_derived, use_sw=use_sw, moh=moh,
            compose_groups=compose_groups)
    else:
        config = gpt_neox_config(
            n_layer=n_layer, dim=dim, n_head=n_head, vocab=vocab, intermediate=intermediate,
            rotary_pct=rotary_pct, use_parallel_residual=use_parallel_residual,
            tie_word_embeddings=tie_word_embeddings, dtype=dtype)
        sd32 = _gpt_neox_weights(
            g, n_layer=n_layer, dim=dim, n_head=n_head, vocab=vocab, intermediate=intermediate,
            rotary_pct=rotary_pct, tie_word_embeddings=tie_word_embeddings, extra_derived=extra_derived)

    if torch_views == "expand":
        for name in sd32:
            if name.endswith(("norm.bias", "layernorm.bias")):
                sd32[name] = np.full_like(sd32[name], sd32[name][0])  # one value, stride (0,)

    # round to the storage dtype
    raw, state_dict, tdtype = OrderedDict(), OrderedDict(), {}
    for name, a in sd32.items():
        dt = "float32" if _is_f32_buffer(name) else dtype
        r, w = round_to_dtype(a, dt)
        raw[name], state_dict[name], tdtype[name] = r, w, dt
    nbytes = {n: raw[n].nbytes for n in raw}
    names = list(raw)

    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, os.path.join(out_dir, "tokenizer.json"))

    # plan storages (torch) and shards
    plan = _storage_plan(names, model_type, fused_qkv, share_storage and fmt == "torch")
    group_of = {n: sid for sid, ns in plan for n in ns}
    shard_lists = _split_shards(names, group_of, nbytes, shards)

    if fmt == "safetensors":
        fnames = ["model.safetensors"] if shards == 1 else [
            f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    else:
        fnames = ["pytorch_model.bin"] if shards == 1 else [
            f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin" for i in range(shards)]

    for fname, shard_names in zip(fnames, shard_lists):
        path = os.path.join(out_dir, fname)
        if fmt == "safetensors":
            write_safetensors(path, {n: (tdtype[n], raw[n]) for n in shard_names}, {"format": "pt"},
                              writer=st_writer)
        else:
            tensors, storages = OrderedDict(), {}
            sids = []
            for n in shard_names:
                if group_of[n] not in sids:
                    sids.append(group_of[n])
            for sid in sids:
                members = [n for n in shard_names if group_of[n] == sid]
                # members of a storage laid out in the order wq, wk, wv / weight, bias
                members.sort(key=_storage_member_rank)
                dts = {tdtype[n] for n in members}
                assert len(dts) == 1
                view = _strided_view(raw[members[0]], members[0], torch_views) if len(members) == 1 else None
                if view is not None:  # one tensor stored as a strided view of its storage
                    data, stride = view
                    n = members[0]
                    storages[sid] = data.tobytes()
                    tensors[n] = TorchTensor(sid, tdtype[n], data.size, 0, raw[n].shape, stride)
                    continue
                storages[sid] = b"".join(raw[n].tobytes() for n in members)
                numel = sum(raw[n].size for n in members)
                off = 0
                for n in members:
                    tensors[n] = TorchTensor(sid, tdtype[n], numel, off, raw[n].shape)
                    off += raw[n].size
            tensors = OrderedDict((n, tensors[n]) for n in shard_names)  # state-dict order
            write_torch_zip(path, tensors, storages, archive_name=archive_name,
                            container=pickle_container, torch_style=torch_style)
        _normal_mode(path)

    if shards > 1:
        index = {
            "metadata": {"total_size": int(sum(nbytes.values()))},
            "weight_map": {n: fname for fname, ns in zip(fnames, shard_lists) for n in ns},
        }
        iname = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
        with open(os.path.join(out_dir, iname), "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")

    return {n: np.array(state_dict[n], dtype=np.float32) for n in state_dict}, dict(config)


def _normal_mode(path):
    """The mode a plain open() gives (0666 less the umask): the safetensors
    package writes through a private temporary file (mode 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _strided_view(a, name, kind):
    """(storage array, stride) storing `a` as a strided view, or None to store it plainly."""
    if kind == "transpose" and a.ndim == 2 and a.shape[0] > 1 and a.shape[1] > 1:
        return np.ascontiguousarray(a.T), (1, a.shape[0])
    if kind == "expand" and a.ndim == 1 and name.endswith(("norm.bias", "layernorm.bias")):
        return a[:1].copy(), (0,)
    if kind == "expand" and name.endswith("dyn_w_proj.sw") and a.ndim == 3:
        if np.array_equal(a[0], a[1]):  # the identity buffer torch.eye(N).expand(2, N, N)
            return a[0].copy(), (0, a.shape[2], 1)
    return None


def _storage_member_rank(name):
    for i, tag in enumerate((".wq.", ".wk.", ".wv.")):
        if tag in name:
            return i
    return 0 if name.endswith("weight") else 1


# --------------------------------------------------------------------------- CLI

def _parse_moh(s):
    if s is None:
        return None
    hs, k = s.split(",")
    return {"shared_heads": int(hs), "routed_topk": int(k)}


def main(argv=None, prog="dcscope make-tiny"):
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Write a tiny random DCPythia / Pythia checkpoint directory.")
    ap.add_argument("out_dir")
    ap.add_argument("--type", dest="model_type", default="dcpythia", choices=["dcpythia", "gpt_neox"])
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4*dim)")
    ap.add_argument("--rank", type=int, default=2)
    ap.add_argument("--window-size", type=lambda v: None if v == "null" else int(v), default=8,
                    help="local window, or 'null' (no local layers)")
    ap.add_argument("--window-type", default=None, choices=["LG", "LGLL", "LGL6"])
    ap.add_argument("--query-wise", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--use-qk-norm", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--use-parallel-residual", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--use-linear-bias", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--use-dcmha", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--write-unused-dyn", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--rotary-pct", type=float, default=0.25)
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--format", dest="fmt", default="safetensors", choices=["safetensors", "torch"])
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--fused-qkv", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weight-scale", type=float, default=1.0)
    ap.add_argument("--dyn-scale", type=float, default=1.0)
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json to copy into OUT_DIR")
    ap.add_argument("--extra-derived", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--share-storage", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--use-sw", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--moh", default=None, metavar="HS,K", help="MoH routing: shared heads, routed top-k")
    ap.add_argument("--compose-groups", type=int, default=1, help="G: heads composed within G groups")
    ap.add_argument("--key-wise", action=argparse.BooleanOptionalAction, default=False,
                    help="key-wise-only composition")
    ap.add_argument("--torch-views", default=None, choices=["transpose", "expand"],
                    help="torch format: store tensors as strided views")
    ap.add_argument("--archive-name", default="archive",
                    help="folder inside torch zips; 'auto' = file basename without extension, as torch.save(path)")
    ap.add_argument("--pickle-container", default="ordereddict", choices=["ordereddict", "ordereddict_meta", "dict"])
    ap.add_argument("--torch-style", default="2.1", choices=["2.1", "2.7"])
    ap.add_argument("--st-writer", default="auto", choices=["auto", "package", "manual"])
    a = ap.parse_args(argv)
    _check_cli_args(a)
    try:
        sd, cfg = _make_tiny_cli(a)
    except OSError as e:
        from ..model import Error
        raise Error("make-tiny: cannot write %s: %s" % (e.filename or a.out_dir, e.strerror or e)) from None
    total = sum(v.size for v in sd.values())
    print(f"wrote {a.out_dir}: {cfg['model_type']}, {len(sd)} tensors, {total} parameters, "
          f"{a.dtype}, {a.fmt}, {a.shards} shard(s)")
    return 0


def _check_cli_args(a) -> None:
    """Sizes refused up front (before anything is written), as dcscope.Error."""
    from ..model import Error
    for flag, v, lo in (("--n-layer", a.n_layer, 1), ("--dim", a.dim, 1), ("--n-head", a.n_head, 1),
                        ("--vocab", a.vocab, 1), ("--rank", a.rank, 1), ("--shards", a.shards, 1),
                        ("--window-size", a.window_size, 1), ("--intermediate", a.intermediate, 1)):
        if v is not None and v < lo:
            raise Error("make-tiny: %s must be at least %d, not %d" % (flag, lo, v))
    if a.dim % a.n_head:
        raise Error("make-tiny: --dim %d is not divisible by --n-head %d" % (a.dim, a.n_head))
    if os.path.lexists(a.out_dir) and not os.path.isdir(a.out_dir):
        raise Error("make-tiny: %s exists and is not a directory" % a.out_dir)


def _make_tiny_cli(a):
    return make_tiny(
        a.out_dir, a.model_type, n_layer=a.n_layer, dim=a.dim, n_head=a.n_head, vocab=a.vocab,
        intermediate=a.intermediate, rank=a.rank, window_size=a.window_size, window_type=a.window_type,
        query_wise=a.query_wise, use_qk_norm=a.use_qk_norm, use_parallel_residual=a.use_parallel_residual,
        use_linear_bias=a.use_linear_bias, use_dcmha=a.use_dcmha, rotary_pct=a.rotary_pct, dtype=a.dtype,
        fmt=a.fmt, shards=a.shards, fused_qkv=a.fused_qkv, tie_word_embeddings=a.tie_word_embeddings,
        seed=a.seed, weight_scale=a.weight_scale, dyn_scale=a.dyn_scale, tokenizer=a.tokenizer,
        extra_derived=a.extra_derived, share_storage=a.share_storage, write_unused_dyn=a.write_unused_dyn,
        use_sw=a.use_sw, moh=_parse_moh(a.moh), compose_groups=a.compose_groups, torch_views=a.torch_views,
        key_wise=a.key_wise,
        archive_name=None if a.archive_name == "auto" else a.archive_name,
        pickle_container=a.pickle_container, torch_style=a.torch_style, st_writer=a.st_writer)


if __name__ == "__main__":
    sys.exit(main(prog="python -m dcscope.testing.make_tiny"))
