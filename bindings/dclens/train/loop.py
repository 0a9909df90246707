"""Training small DCPythia / Pythia models on the CPU with the engine's backward.

    from dclens.train import TrainConfig, train
    train(TrainConfig(out="runs/dc", model_type="dcpythia", n_layer=4, dim=192, n_head=6,
                      seq_len=128, batch_size=16, steps=3000, data="synth", tokenizer="bpe:4096"))

or ``dclens train --out runs/dc --model-type dcpythia ...`` (see ``dclens train -h``).

* Optimiser: AdamW (decoupled weight decay on matrices only, not on norms,
  biases, QK-norm scales), global-norm gradient clipping, cosine learning
  rate with linear warm-up down to ``min_lr``.
* Data: a text file, a .jsonl of benchmark records, or the synthetic-task
  generator (``data="synth"``), tokenized once (bytes, a tokenizer.json, or a
  byte-level BPE trained on the corpus, ``tokenizer="bpe:N"``) into
  ``out/tokens.npy``; batch ``s`` is B windows of T+1 tokens (or, with
  ``lines``, B whole sequences padded to T, padding not scored) drawn from a
  generator seeded with (seed, s), so the data of a step does not depend on
  how the run was split into sittings.
* Checkpoints: ``out/step-NNNNNN/`` holds config.json + model.safetensors in the
  model type's own layout (``dclens.load`` reads it), tokenizer.json, and
  optimizer.npz + train_state.json for resuming; the last ``keep`` are kept,
  the final one is also copied to ``out/final``. A run restarted with the same
  ``out`` resumes from the last checkpoint and gives the same weights as an
  uninterrupted run (same machine, same thread count).
* Progress: a tqdm bar (loss, tokens/s, ETA), ``out/train.log`` plain lines,
  ``out/loss.csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import numbers
import os
import re
import shutil
import struct
import time
import zipfile
from typing import Any

import numpy as np

from .._core import plugins
from .._core import progress as _progress
from .._core.checks import Error
from .._core.help import HelpFormatter
from ..analysis.grad import Tape, param_table
from ..model import cuda_available, cuda_unavailable_reason, load
from . import run_record


@dataclasses.dataclass
class AdamW:
    """AdamW's hyper-parameters for one step (train_step sets lr from the schedule).

    The engine's optimizer (dcs_adamw_step) reads them as float32.

    Parameters
    ----------
    beta1 : float
        The first moment's decay.
    beta2 : float
        The second moment's decay.
    eps : float
        Added to the second moment's square root.
    weight_decay : float
        Decoupled weight decay (on the parameters the layout marks as decayed).
    lr : float
        The learning rate of this step.
    """

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    lr: float = 0.0


@dataclasses.dataclass
class TrainConfig:
    """The options of a training run (train(); `dclens train` has one flag per field).

    check() refuses a wrong type or range by the option's name before anything is written;
    train() calls it.

    Attributes
    ----------
    out : str
        The run directory (resumed if it holds checkpoints).
    model_type : str
        "dcpythia" (DCMHA), "dcformer" (DCFormer++) or "gpt_neox" (Pythia, plain MHA).
    n_layer : int
        Transformer blocks.
    dim : int
        The model width d_model.
    n_head : int
        Attention heads (dim / n_head a multiple of 8, except for dcformer).
    d_ff : int
        The MLP width (0: 4 * dim).
    vocab : int
        The vocabulary size (0: the tokenizer's; a larger value pads it).
    window_size : int or None
        The local attention window of the local layers (None: every layer global).
    window_type : str or None
        Which layers are local: "LG" (even layers), "LGLL", "LGL6" (None: LG when
        window_size is given).
    rank : int
        dcpythia: the rank R of the dynamic compose weights.
    seq_len : int
        Tokens per training sequence (the context the model is trained for).
    batch_size : int
        Sequences per step.
    steps : int
        Optimiser steps of the whole run.
    lr : float
        The peak learning rate (AdamW).
    min_lr : float
        The learning rate at the end of the cosine decay (<= lr).
    warmup : int
        Steps of linear warm-up.
    weight_decay : float
        AdamW's decoupled weight decay (matrices only).
    grad_clip : float
        The global gradient-norm clip (0: none).
    beta1 : float
        AdamW's beta1, in [0, 1).
    beta2 : float
        AdamW's beta2, in [0, 1).
    eps : float
        AdamW's epsilon (> 0).
    seed : int
        The seed of the initial weights and of the batches.
    data : str
        "synth", "synth:LINES_PER_TASK", a .jsonl of benchmark records or a text file.
    lines : bool
        One sequence per record / line, padded (not packed windows).
    bucket : bool
        With lines: batches of lines of similar length, each padded only to its longest
        line (batch()).
    tokenizer : str
        "bytes", "bpe:N" (a byte-level BPE fitted to the corpus, N in [258, 2**20]) or a
        tokenizer.json path.
    ckpt_every : int
        Steps between checkpoints.
    keep : int
        Checkpoints kept (the final one is also copied to out/final).
    log_every : int
        Steps between lines of out/train.log (out/loss.csv gets every step).
    n_threads : int
        CPU threads (0: all cores).
    device : str
        Where the model trains: "cpu" or "cuda" (the tape and its backward on the GPU).
    progress : bool or None
        dclens.progress: None, a bar where someone watches and plain lines in a log;
        True, a bar; False, none.
    mgate_dim : int
        dcformer: E > 0 turns the MLP group gate on (E groups; E must divide d_ff).
    """

    out: str
    model_type: str = "dcpythia"  # or "gpt_neox", "dcformer" (DCFormer++)
    n_layer: int = 4
    dim: int = 192
    n_head: int = 6
    d_ff: int = 0  # 0: 4 * dim
    vocab: int = 0  # 0: the tokenizer's size
    window_size: int | None = None  # dcpythia: None = every layer global
    window_type: str | None = None  # dcpythia: None (LG: even layers local), "LG", "LGLL", "LGL6"
    rank: int = 2  # dcpythia dynamic rank R
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    seed: int = 0
    data: str = "synth"  # "synth", "synth:LINES_PER_TASK", a .jsonl of records or a text file
    lines: bool = False  # one sequence per record / line (padded), not packed windows
    bucket: bool = False  # lines: batches of lines of similar length, T per batch (see batch())
    tokenizer: str = "bytes"  # "bytes", "bpe:N" or a tokenizer.json path
    ckpt_every: int = 200
    keep: int = 2
    log_every: int = 10
    n_threads: int = 0
    device: str = "cpu"  # "cuda": the tape, its backward and the weights on the GPU (issue 23)
    progress: bool | None = None  # dclens.progress: None: a bar where watched, plain lines in a log
    mgate_dim: int = 0  # dcformer: E > 0 turns the MLP group gate on (E | d_ff)

    def check(self) -> None:
        """Every option's type and range, each refused by name (--flag) before anything is written.

        Raises
        ------
        dclens.Error
            The first option of the wrong type or out of range, or options that do not go
            together (dim not a multiple of n_head, a head dim not a multiple of 8 outside
            dcformer, min_lr above lr, bucket without lines, mgate_dim outside dcformer or
            not dividing d_ff), or a tokenizer that is not bytes, bpe:N or a file.
        """
        if not isinstance(self.out, (str, os.PathLike)) or "\0" in os.fspath(self.out) or not os.fspath(self.out):
            raise Error("train: out must be a directory path, not %r" % (self.out,))
        if not isinstance(self.model_type, str) or self.model_type not in ("dcpythia", "gpt_neox", "dcformer"):
            raise Error("model_type must be 'dcpythia', 'dcformer' or 'gpt_neox', not %r" % (self.model_type,))
        _int_option("mgate_dim", self.mgate_dim, 0)
        for k in (
            "n_layer",
            "dim",
            "n_head",
            "seq_len",
            "batch_size",
            "steps",
            "ckpt_every",
            "keep",
            "log_every",
            "rank",
        ):
            _int_option(k, getattr(self, k), 1)
        for k in ("d_ff", "vocab", "n_threads", "warmup"):
            _int_option(k, getattr(self, k), 0)
        if self.mgate_dim and (self.model_type != "dcformer" or (self.d_ff or 4 * self.dim) % self.mgate_dim):
            raise Error("train: mgate_dim %d needs model_type 'dcformer' and must divide d_ff" % self.mgate_dim)
        if not isinstance(self.device, str) or self.device not in ("cpu", "cuda"):
            raise Error("train: --device must be 'cpu' or 'cuda', not %r" % (self.device,))
        _int_option("seed", self.seed, 0, 2**63)
        if self.window_size is not None:
            _int_option("window_size", self.window_size, 1)
        if not (self.window_type is None or isinstance(self.window_type, str)) or self.window_type not in (
            None,
            "LG",
            "LGLL",
            "LGL6",
        ):
            raise Error("train: --window-type must be None, 'LG', 'LGLL' or 'LGL6', not %r" % (self.window_type,))
        if self.dim % self.n_head:
            raise Error("train: dim %d is not a multiple of n_head %d" % (self.dim, self.n_head))
        if (self.dim // self.n_head) % 8 and self.model_type != "dcformer":
            raise Error(
                "train: head dim %d must be a multiple of 8 (rotary on a quarter of it)" % (self.dim // self.n_head)
            )
        for k, lo, hi in (
            ("lr", 0, None),
            ("min_lr", 0, None),
            ("weight_decay", 0, None),
            ("grad_clip", 0, None),
            ("beta1", 0, 1),
            ("beta2", 0, 1),
            ("eps", 0, None),
        ):
            v = getattr(self, k)
            if (
                isinstance(v, (bool, np.bool_))
                or not isinstance(v, (numbers.Real, np.floating, np.integer))
                or not math.isfinite(f := float(v))
                or f < lo
                or (hi is not None and f >= hi)
            ):
                raise Error(
                    "train: --%s must be a finite number in [%g, %s), not %r"
                    % (k.replace("_", "-"), lo, "inf" if hi is None else "%g" % hi, v)
                )
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr and self.grad_clip >= 0):
            raise Error("train: need lr > 0, 0 <= min_lr <= lr, warmup >= 0, grad_clip >= 0")
        if not self.eps > 0:
            raise Error("train: --eps must be > 0, not %r" % (self.eps,))
        for k in ("lines", "bucket"):
            if not isinstance(getattr(self, k), (bool, np.bool_)):
                raise Error("train: %s must be True or False, not %r" % (k, getattr(self, k)))
        if self.bucket and not self.lines:
            raise Error("train: --bucket sorts lines into batches by length: it needs --lines")
        if self.progress is not None and not isinstance(self.progress, (bool, np.bool_)):
            raise Error("train: progress must be True, False or None, not %r" % (self.progress,))
        if not isinstance(self.data, str) or not self.data or "\0" in self.data:
            raise Error("train: --data must be 'synth', 'synth:N' or a file path, not %r" % (self.data,))
        self._check_tokenizer()

    def _check_tokenizer(self) -> None:
        t = self.tokenizer
        if not isinstance(t, str) or "\0" in t:
            raise Error("train: --tokenizer must be 'bytes', 'bpe:N' or a tokenizer.json path, not %r" % (t,))
        if t.startswith("bpe:"):
            n = t[4:]
            if not (n.isascii() and n.isdigit() and 258 <= int(n) <= 1 << 20):
                raise Error(
                    "train: --tokenizer %r: N of bpe:N must be an integer in [258, 1048576] (the 256 "
                    "bytes, the end-of-text token and at least one merge)" % (t,)
                )
        elif t != "bytes" and not os.path.isfile(t):
            raise Error("train: --tokenizer %r is not 'bytes', 'bpe:N' or a tokenizer.json file" % (t,))


def _int_option(k: str, v, lo: int, hi: int = 2**31) -> int:
    """An integer option in [lo, hi) (bool refused), or Error naming --k."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Integral, np.integer)):
        raise Error("train: --%s must be an integer, not %s %r" % (k.replace("_", "-"), type(v).__name__, v))
    if not lo <= int(v) < hi:
        raise Error("train: --%s %d is out of range [%d, %d)" % (k.replace("_", "-"), v, lo, hi))
    return int(v)


# ------------------------------------------------------------------ safetensors


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Write float32 tensors as a safetensors file (8-byte length, JSON header, data).

    The file is written beside the path and renamed into place (never half written).

    Parameters
    ----------
    path : str
        The file to write.
    tensors : dict of str to numpy.ndarray
        Name -> array (stored as little-endian float32, in name order).
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, off = [], 0
    for k in sorted(tensors):
        b = np.ascontiguousarray(tensors[k], dtype="<f4").tobytes()
        header[k] = {"dtype": "F32", "shape": list(tensors[k].shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


# ------------------------------------------------------------------ configs and init


def model_config(c: TrainConfig, vocab: int) -> dict:
    """The config.json of the model a run trains, in its model type's own keys.

    Parameters
    ----------
    c : TrainConfig
        The run's options.
    vocab : int
        The vocabulary size.

    Returns
    -------
    dict
        DCPythia's, DCFormer's (the official config's keys, docs/dcformer-spec.md) or
        GPT-NeoX's config: sizes from `c`, rotary on a quarter of each head (DCPythia,
        Pythia), float32, max_position_embeddings = seq_len where the type has it.
    """
    F = c.d_ff or 4 * c.dim
    sizes = {"dim": c.dim, "n_head": c.n_head, "head_dim": c.dim // c.n_head, "n_layer": c.n_layer}
    dcmha = {
        "use_qk_norm": True,
        "window_size": c.window_size,
        "window_type": c.window_type,
        "query_wise": False,
        "use_dcmha": True,
    }
    ids = {"bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32"}
    if c.model_type == "dcpythia":
        return {
            "architectures": ["DCPythia"],
            "model_type": "dcpythia",
            **sizes,
            "intermediate_size": F,
            "vocab_size": vocab,
            "norm_eps": 1e-5,
            "rope_base": 10000,
            "rotary_pct": 0.25,
            "use_parallel_residual": True,
            "use_linear_bias": True,
            **dcmha,
            "tie_word_embeddings": False,
            "max_position_embeddings": c.seq_len,  # the context trained for (model.cfg.n_ctx)
            **ids,
        }
    if c.model_type == "dcformer":  # the official DCFormer config's keys (docs/dcformer-spec.md)
        return {
            "architectures": ["DCFormer"],
            "model_type": "dcformer",
            **sizes,
            "n_local_heads": c.n_head,
            "intermediate_size": F,
            "vocab_size": vocab,
            "norm_eps": 1e-6,
            "rope_base": 10000.0,
            **dcmha,
            "mgate": bool(c.mgate_dim),
            "mgate_dim": c.mgate_dim or 44,
            "tie_word_embeddings": False,
            "is_training": False,
            **ids,
        }
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "hidden_size": c.dim,
        "num_attention_heads": c.n_head,
        "num_hidden_layers": c.n_layer,
        "intermediate_size": F,
        "vocab_size": vocab,
        "rotary_pct": 0.25,
        "rotary_emb_base": 10000,
        "layer_norm_eps": 1e-5,
        "use_parallel_residual": True,
        "hidden_act": "gelu",
        "tie_word_embeddings": False,
        "max_position_embeddings": c.seq_len,
        "initializer_range": 0.02,
        **ids,
    }


def init_weights(c: TrainConfig, vocab: int) -> dict[str, np.ndarray]:
    """GPT-NeoX-like init in canonical (dcpythia) names: N(0, 0.02) matrices and
    embeddings, output projections (wo, w2) N(0, 0.02 / sqrt(2 L)), zero biases,
    unit norms; DCMHA: dw1 N(0, 1/D) so the hidden layer is O(1), qkw and dd
    small (N(0, 0.01 / sqrt(K)), N(0, 0.01 / sqrt(D))) so every composition map
    starts near the identity C = I.

    Parameters
    ----------
    c : TrainConfig
        The run's options (the sizes, model_type, mgate_dim and seed).
    vocab : int
        The vocabulary size.

    Returns
    -------
    dict of str to numpy.ndarray
        Canonical name -> float32 weight (DCFormer++: no biases, RMSNorm weights, SwiGLU's
        w3 and the gate mg).
    """
    rng = np.random.default_rng(c.seed)
    D, N, L, F = c.dim, c.n_head, c.n_layer, c.d_ff or 4 * c.dim
    Dh, R, K = D // N, c.rank, 4 * N
    std, out_std = 0.02, 0.02 / math.sqrt(2 * L)

    def nrm(shape, s):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    sd = {"tok_embeddings.weight": nrm((vocab, D), std)}
    if c.model_type == "dcformer":  # DCFormer++: no biases, RMSNorm weights, SwiGLU w3, the gate mg
        for l in range(L):
            p = "layers.%d." % l
            sd[p + "attention_norm.weight"] = np.ones(D, np.float32)
            sd[p + "ffn_norm.weight"] = np.ones(D, np.float32)
            sd[p + "attention.wqkv.weight"] = nrm((3 * D, D), std)
            sd[p + "attention.wo.weight"] = nrm((D, D), out_std)
            sd[p + "attention.q_norm.scale"] = np.ones(Dh, np.float32)
            sd[p + "attention.k_norm.scale"] = np.ones(Dh, np.float32)
            sd[p + "attention.dyn_w_proj.dw1"] = nrm((D, 1, 4, K), 1 / math.sqrt(D))
            sd[p + "attention.dyn_w_proj.qkw"] = nrm((1, 4, K, 2 * R, N), 0.01 / math.sqrt(K))
            sd[p + "attention.dyn_w_proj.dd"] = nrm((D, 1, 4 * N), 0.01 / math.sqrt(D))
            sd[p + "feed_forward.w1.weight"] = nrm((F, D), std)
            sd[p + "feed_forward.w3.weight"] = nrm((F, D), std)
            sd[p + "feed_forward.w2.weight"] = nrm((D, F), out_std)
            if c.mgate_dim:
                sd[p + "feed_forward.mg.weight"] = nrm((c.mgate_dim, D), std)
        sd["norm.weight"] = np.ones(D, np.float32)
        sd["output.weight"] = nrm((vocab, D), std)
        return sd
    for l in range(L):
        p = "layers.%d." % l
        sd[p + "attention_norm.weight"] = np.ones(D, np.float32)
        sd[p + "attention_norm.bias"] = np.zeros(D, np.float32)
        sd[p + "ffn_norm.weight"] = np.ones(D, np.float32)
        sd[p + "ffn_norm.bias"] = np.zeros(D, np.float32)
        sd[p + "attention.wqkv.weight"] = nrm((3 * D, D), std)
        sd[p + "attention.wqkv.bias"] = np.zeros(3 * D, np.float32)
        sd[p + "attention.wo.weight"] = nrm((D, D), out_std)
        sd[p + "attention.wo.bias"] = np.zeros(D, np.float32)
        sd[p + "feed_forward.w1.weight"] = nrm((F, D), std)
        sd[p + "feed_forward.w1.bias"] = np.zeros(F, np.float32)
        sd[p + "feed_forward.w2.weight"] = nrm((D, F), out_std)
        sd[p + "feed_forward.w2.bias"] = np.zeros(D, np.float32)
        if c.model_type == "dcpythia":
            sd[p + "attention.q_norm.scale"] = np.ones(Dh, np.float32)
            sd[p + "attention.k_norm.scale"] = np.ones(Dh, np.float32)
            sd[p + "attention.dyn_w_proj.dw1"] = nrm((D, 1, 4, K), 1 / math.sqrt(D))
            sd[p + "attention.dyn_w_proj.qkw"] = nrm((1, 4, K, 2 * R, N), 0.01 / math.sqrt(K))
            sd[p + "attention.dyn_w_proj.dd"] = nrm((D, 1, 4 * N), 0.01 / math.sqrt(D))
    sd["norm.weight"] = np.ones(D, np.float32)
    sd["norm.bias"] = np.zeros(D, np.float32)
    sd["output.weight"] = nrm((vocab, D), std)
    return sd


_NEOX_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention_norm.bias": "input_layernorm.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.bias": "post_attention_layernorm.bias",
    "attention.wqkv.weight": "attention.query_key_value.weight",
    "attention.wqkv.bias": "attention.query_key_value.bias",
    "attention.wo.weight": "attention.dense.weight",
    "attention.wo.bias": "attention.dense.bias",
    "feed_forward.w1.weight": "mlp.dense_h_to_4h.weight",
    "feed_forward.w1.bias": "mlp.dense_h_to_4h.bias",
    "feed_forward.w2.weight": "mlp.dense_4h_to_h.weight",
    "feed_forward.w2.bias": "mlp.dense_4h_to_h.bias",
}
_NEOX_TOP = {
    "tok_embeddings.weight": "gpt_neox.embed_in.weight",
    "output.weight": "embed_out.weight",
    "norm.weight": "gpt_neox.final_layer_norm.weight",
    "norm.bias": "gpt_neox.final_layer_norm.bias",
}


def to_layout(sd: dict[str, np.ndarray], model_type: str, n_head: int) -> dict[str, np.ndarray]:
    """Canonical weight names to the checkpoint names of a model type.

    Parameters
    ----------
    sd : dict of str to numpy.ndarray
        Canonical name -> weight.
    model_type : str
        "dcpythia" and "dcformer" keep the canonical names; otherwise GPT-NeoX's.
    n_head : int
        Heads (GPT-NeoX's fused q/k/v rows are regrouped per head, model-spec 3).

    Returns
    -------
    dict of str to numpy.ndarray
        Checkpoint name -> weight (a new dict; a GPT-NeoX query_key_value a new array).
    """
    if model_type in ("dcpythia", "dcformer"):
        return dict(sd)
    out = {}
    for k, v in sd.items():
        if k in _NEOX_TOP:
            out[_NEOX_TOP[k]] = v
            continue
        _, l, rest = k.split(".", 2)
        name = "gpt_neox.layers.%s.%s" % (l, _NEOX_LAYER[rest])
        if "query_key_value" in name:
            D = v.shape[0] // 3
            Dh = D // n_head
            # canonical row j*D + n*Dh + d -> stored row n*3*Dh + j*Dh + d
            v = v.reshape((3, n_head, Dh) + v.shape[1:]).swapaxes(0, 1).reshape(v.shape)
        out[name] = np.ascontiguousarray(v)
    return out


def read_weights(model) -> dict[str, np.ndarray]:
    """Every weight of a loaded model by canonical name.

    Parameters
    ----------
    model : dclens.Model
        The loaded model whose weights are copied.

    Returns
    -------
    dict of str to numpy.ndarray
        Canonical name -> a fresh float32 copy of the weight.

    Raises
    ------
    dclens.Error
        The engine cannot read a weight.
    """
    return {name: model.runner.read_weight(name) for name, *_ in param_table(model)}


def write_model(dirpath: str, sd: dict[str, np.ndarray], config: dict, tokenizer_json: str | None) -> None:
    """Write a checkpoint directory dclens.load reads: model.safetensors, config.json and
    tokenizer.json.

    Parameters
    ----------
    dirpath : str
        The directory (made if missing).
    sd : dict of str to numpy.ndarray
        Canonical name -> weight (written in config's model type's layout, to_layout).
    config : dict
        The config.json (model_config), with model_type and the head count.
    tokenizer_json : str or None
        A tokenizer.json to copy in (None: none, a byte-level run).
    """
    os.makedirs(dirpath, exist_ok=True)
    write_safetensors(
        os.path.join(dirpath, "model.safetensors"),
        to_layout(sd, config["model_type"], int(config.get("n_head") or config["num_attention_heads"])),
    )
    with open(os.path.join(dirpath, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer_json:
        shutil.copyfile(tokenizer_json, os.path.join(dirpath, "tokenizer.json"))


# ------------------------------------------------------------------ data


def _corpus_texts(c: TrainConfig) -> list[str]:
    """The corpus as a list of sequences' texts (brackets of the benchmark's
    answers removed): generated synthetic lines, the records of a .jsonl file
    (``texts``), or a text file (its lines with ``lines``, else the whole file)."""
    if c.data == "synth" or c.data.startswith("synth:"):
        source, arg = "synth", c.data.partition(":")[2]
    elif not os.path.isfile(c.data):
        raise Error("train: data %r is neither 'synth' nor a text file" % (c.data,))
    elif c.data.endswith(".jsonl"):
        source, arg = "jsonl", c.data
    else:
        source = None
    if source is not None:  # synth_tasks.train_data, found by name
        fn = plugins.find(plugins.TRAIN_DATA, source)
        try:
            return fn(arg, c.seed)
        except ValueError as e:
            raise Error("train: data %s: %s" % (c.data, e)) from None
    with open(c.data, encoding="utf-8", errors="replace") as f:
        text = f.read()
    return [t for t in text.split("\n") if t.strip()] if c.lines else [text]


def _tokenizer(c: TrainConfig, texts: list[str], tok_path: str):
    """encode(list of str) -> list of id lists, vocab size, saved tokenizer path."""
    if c.tokenizer == "bytes":
        return (lambda ts: [list(t.encode("utf-8")) for t in ts]), 256, None
    from tokenizers import Tokenizer  # lazy: tokenizers loads with the first tokenizer

    if c.tokenizer.startswith("bpe:"):
        from tokenizers import decoders, models, pre_tokenizers, trainers  # lazy: with the first tokenizer

        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        tr = trainers.BpeTrainer(
            vocab_size=int(c.tokenizer[4:]),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<|endoftext|>"],
            show_progress=False,
        )
        tk.train_from_iterator(texts, tr)
        tk.save(tok_path)
    else:
        if not os.path.isfile(c.tokenizer):
            raise Error("train: tokenizer %r is not 'bytes', 'bpe:N' or a tokenizer.json file" % (c.tokenizer,))
        shutil.copyfile(c.tokenizer, tok_path)
        tk = Tokenizer.from_file(tok_path)
    return (lambda ts: [e.ids for e in tk.encode_batch(ts, add_special_tokens=False)]), tk.get_vocab_size(), tok_path


def _tokenize(c: TrainConfig, texts: list[str], tok_path: str):
    """All sequences' ids concatenated, their start offsets [n+1], vocab, tokenizer path.
    Packed runs (not ``lines``) end every sequence with a newline."""
    enc, vocab, path = _tokenizer(c, texts, tok_path)
    if not c.lines:
        texts = [t if t.endswith("\n") else t + "\n" for t in texts]
    seqs = enc(texts)
    offsets = np.zeros(len(seqs) + 1, np.int64)
    offsets[1:] = np.cumsum([len(q) for q in seqs])
    ids = np.fromiter((i for q in seqs for i in q), np.int32, count=int(offsets[-1]))
    return ids, offsets, vocab, path


# bucket: the lines of BUCKET_STEPS steps are drawn together, sorted by length
# and cut into that many batches, taken in a shuffled order; each batch's T is
# its longest line rounded up to a multiple of BUCKET_ROUND (at most seq_len)
BUCKET_STEPS = 64
BUCKET_ROUND = 8


def batch(tokens: np.ndarray, c: TrainConfig, step: int, offsets: np.ndarray | None = None):
    # offsets (lines): [n, 2] start and end of every sequence of >= 2 tokens
    """Inputs [B, T] and next-token targets [B, T] of step `step` (a function of
    seed and step only). Packed: B windows of T+1 tokens of the stream. With
    ``lines``: B whole sequences (first T+1 tokens), padded with id 0 whose
    targets are -1 (not scored). With ``bucket`` too: B lines of similar
    length (steps s of one group of BUCKET_STEPS share a draw of lines sorted
    by length, the group's batches in a shuffled order), padded only to the
    batch's longest line rounded up to BUCKET_ROUND (T <= seq_len).

    Parameters
    ----------
    tokens : numpy.ndarray
        The corpus' token ids, concatenated ([n] int32).
    c : TrainConfig
        The run's options (seed, seq_len, batch_size, lines, bucket).
    step : int
        The step (from 1).
    offsets : numpy.ndarray or None
        With lines: [n, 2] start and end of every sequence of 2 tokens or more in `tokens`.

    Returns
    -------
    x : numpy.ndarray
        [B, T] int32 inputs.
    y : numpy.ndarray
        [B, T] int32 next-token targets (-1: padding, not scored).
    """
    if not c.lines:
        rng = np.random.default_rng([c.seed, step])
        starts = rng.integers(0, len(tokens) - c.seq_len - 1, c.batch_size)
        w = np.stack([tokens[s : s + c.seq_len + 1] for s in starts])
        return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])
    assert offsets is not None, "lines mode needs the sequence offsets"
    T = c.seq_len
    if c.bucket:
        group, i = divmod(step - 1, BUCKET_STEPS)
        rng = np.random.default_rng([c.seed, group, BUCKET_STEPS])  # not a step's [seed, step] stream
        pool = rng.integers(0, len(offsets), BUCKET_STEPS * c.batch_size)
        n_in = np.minimum(offsets[pool, 1] - offsets[pool, 0], c.seq_len + 1) - 1  # inputs of each line
        pool = pool[np.argsort(n_in, kind="stable")].reshape(BUCKET_STEPS, c.batch_size)
        idx = pool[rng.permutation(BUCKET_STEPS)[i]]
        longest = int((np.minimum(offsets[idx, 1] - offsets[idx, 0], c.seq_len + 1) - 1).max())
        T = min(c.seq_len, -(-longest // BUCKET_ROUND) * BUCKET_ROUND)
    else:
        idx = np.random.default_rng([c.seed, step]).integers(0, len(offsets), c.batch_size)
    x = np.zeros((c.batch_size, T), np.int32)
    y = np.full((c.batch_size, T), -1, np.int32)
    for b, i in enumerate(idx):
        q = tokens[offsets[i, 0] : min(offsets[i, 1], offsets[i, 0] + T + 1)]
        x[b, : len(q) - 1] = q[:-1]
        y[b, : len(q) - 1] = q[1:]
    return x, y


def lr_at(c: TrainConfig, step: int) -> float:
    """The learning rate of a step: linear warm-up over `warmup` steps, then cosine from
    lr to min_lr at `steps`.

    Parameters
    ----------
    c : TrainConfig
        The run's options (lr, min_lr, warmup, steps).
    step : int
        The step (from 1).

    Returns
    -------
    float
        The learning rate.
    """
    if step <= c.warmup:
        return c.lr * step / max(1, c.warmup)
    p = (step - c.warmup) / max(1, c.steps - c.warmup)
    return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * min(1.0, p)))


# ------------------------------------------------------------------ checkpoints

_STEP_DIR = re.compile(r"step-[0-9]{6}")


def _ckpts(out: str) -> list[str]:
    """Every checkpoint directory of the run, oldest first (exact names
    step-NNNNNN: a staging or moved-aside directory is none)."""
    if not os.path.isdir(out):
        return []
    ds = [d for d in os.listdir(out) if _STEP_DIR.fullmatch(d) and os.path.isdir(os.path.join(out, d))]
    return [os.path.join(out, d) for d in sorted(ds)]


def _write_state(dirpath: str, step: int, loss, c: TrainConfig) -> None:
    with open(os.path.join(dirpath, "train_state.json"), "w") as f:
        json.dump({"step": step, "loss": loss, "config": run_record.options_of(c)}, f, indent=2)


def _save(out: str, model, mom, var, step: int, c: TrainConfig, config: dict, tok_path, loss: float) -> str:
    """Checkpoint `step`: weights, config, optimizer and state written into a
    staging directory from one state, then renamed into place."""
    name = "step-%06d" % step
    tmp = run_record.staging(out, name)
    write_model(tmp, read_weights(model), config, tok_path)
    np.savez(os.path.join(tmp, "optimizer.npz"), mom=mom, var=var)
    _write_state(tmp, step, loss, c)
    d = os.path.join(out, name)
    run_record.install_dir(tmp, d)
    for old in _ckpts(out)[: -c.keep]:
        shutil.rmtree(old, ignore_errors=True)
    return d


def _open_checkpoint(d: str, c: TrainConfig, want_config: dict, n_threads: int):
    """(model, step, mom, var, config.json) of checkpoint d; ValueError(why) if
    it is damaged, Error if it holds another model than these options give."""
    state = run_record.load_json(os.path.join(d, "train_state.json"), "train_state.json")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or "step-%06d" % step != os.path.basename(d):
        raise ValueError("train_state.json says step %r" % (step,))
    cfg = run_record.load_json(os.path.join(d, "config.json"), "config.json")
    diff = run_record.config_differences(cfg, want_config)
    if diff:
        raise Error(
            "train: %s/config.json describes another model than these options: %s; use a new "
            "--out, or the run's options" % (d, ", ".join(diff))
        )
    try:
        model = load(d, n_threads=n_threads, device=c.device)
    except Error as e:
        raise ValueError(str(e)) from None
    model.runner.make_trainable()
    P = model.runner.param_total()
    if step == 0:
        return model, 0, np.zeros(P, np.float32), np.zeros(P, np.float32), cfg
    try:
        with np.load(os.path.join(d, "optimizer.npz")) as z:
            mom, var = (np.ascontiguousarray(z[k], np.float32) for k in ("mom", "var"))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError("optimizer.npz unreadable: %s" % (e,)) from None
    if mom.shape != (P,) or var.shape != (P,):
        raise ValueError("optimizer.npz holds %s and %s moments, the model %d parameters" % (mom.shape, var.shape, P))
    return model, step, mom, var, cfg


def _damaged(out: str, ck: list[str], why: str) -> Error:
    d = ck[-1]
    prev = (
        (
            "the one before it, %s, is offered: move the damaged one aside (mv %s %s.damaged) and run "
            "again to resume from it" % (ck[-2], d, d)
        )
        if len(ck) > 1
        else "there is no earlier checkpoint: start a new --out"
    )
    return Error("train: the newest checkpoint %s is damaged (%s); %s" % (d, why, prev))


def _check_options(c: TrainConfig, ck: list[str]) -> list[str]:
    """Refuse a resume whose options differ from the run's record (run.json, or
    for a run made before it, the newest checkpoint's train_state.json); the
    log lines saying what was compared and what changed."""
    rec = run_record.read_record(c.out)
    if rec is not None:
        source = os.path.join(c.out, run_record.RUN_FILE)
        recorded = rec["options"]
    elif ck:
        source = os.path.join(ck[-1], "train_state.json")
        try:
            recorded = run_record.load_json(source, "train_state.json").get("config")
        except ValueError as e:
            raise _damaged(c.out, ck, str(e)) from e
        if not isinstance(recorded, dict) or not recorded:  # nothing to compare but its config.json
            return [
                "resume: %s records no options: only its config.json was compared (a run made before run.json)" % source
            ]
    else:
        return []
    refused, accepted = run_record.differences(recorded, c)
    if refused:
        run_record.refuse(c.out, "as " + source + " records", refused)
    notes = [
        "resume: options compared with %s%s"
        % (source, "" if rec is not None else " and its config.json (a run made before run.json)")
    ]
    notes.append(
        "resume: changed for this sitting: %s" % ", ".join(accepted) if accepted else "resume: no option changed"
    )
    return notes


class _Log:
    def __init__(self, f, csv):
        self.f, self.csv = f, csv

    def line(self, s: str) -> None:
        self.f.write(time.strftime("%Y-%m-%d %H:%M:%S ") + s + "\n")


@contextlib.contextmanager
def _open_log(out: str):
    """The run's train.log and loss.csv, appended to (line-buffered), closed on leaving."""
    with open(os.path.join(out, "train.log"), "a", buffering=1) as f:
        new = not os.path.exists(os.path.join(out, "loss.csv"))
        with open(os.path.join(out, "loss.csv"), "a", buffering=1) as csv:
            if new:
                csv.write("step,loss,lr,grad_norm,tokens_per_s\n")
            yield _Log(f, csv)


# ------------------------------------------------------------------ the loop


def train_step(c: TrainConfig, model, tape: Tape, x, y, grads, mom, var, hp, step: int):
    """One optimiser step on inputs x [B, T] and targets y [B, T] (T at most
    the tape's: a bucketed batch reshapes it): forward, mean cross-entropy,
    backward into grads, global-norm clipping, AdamW on the model's weights
    (mom, var updated).

    Parameters
    ----------
    c : TrainConfig
        The run's options (grad_clip and the schedule).
    model : dclens.Model
        The model trained (its weights updated in place).
    tape : dclens.grad.Tape
        The gradient tape of the model.
    x : numpy.ndarray
        [B, T] int32 inputs.
    y : numpy.ndarray
        [B, T] int32 targets (-1: not scored).
    grads : numpy.ndarray
        [P] float32 buffer of the flat gradient (overwritten).
    mom : numpy.ndarray
        [P] float32 AdamW first moments (updated).
    var : numpy.ndarray
        [P] float32 AdamW second moments (updated).
    hp : AdamW
        AdamW's hyper-parameters (its lr set to lr_at(c, step)); anything with the same
        five attributes (a cffi ``dcs_adamw *``) works too.
    step : int
        The step (from 1).

    Returns
    -------
    loss : float
        The mean cross-entropy of the scored targets.
    grad_norm : float
        The global gradient norm before clipping.

    Raises
    ------
    dclens.Error
        A gradient that is not finite, or an engine failure of the step.
    """
    if x.shape != (tape.B, tape.T):
        tape.reshape(*x.shape)
    tape.forward(x, logits=False)
    loss = tape.loss(y)
    grads[:] = 0
    tape.backward(None, grads)
    gn = float(np.sqrt(np.dot(grads, grads)))
    if not math.isfinite(gn):
        raise Error("train: step %d: the gradient is not finite (loss %g); lower lr" % (step, loss))
    if c.grad_clip and gn > c.grad_clip:
        grads *= c.grad_clip / gn
    hp.lr = lr_at(c, step)
    model.runner.adamw_step(grads, mom, var, step, hp)
    return loss, gn


def train(c: TrainConfig, stop_after: int | None = None) -> str:
    """Train (or resume) the run in c.out.

    Parameters
    ----------
    c : TrainConfig
        The run's options (a resumed run must not change those its run.json records).
    stop_after : int or None
        End this sitting after that many steps (checkpointing there); None: run to c.steps.

    Returns
    -------
    str
        The last checkpoint's directory: out/final when the run reached c.steps, else the
        sitting's last out/step-NNNNNN.

    Raises
    ------
    dclens.Error
        Options check() refuses, or that differ from the run's record, device "cuda"
        without CUDA, a corpus too small (fewer than seq_len + 2 tokens, or no line of 2),
        data that is neither synth nor a file, a damaged checkpoint, or a step whose
        gradient is not finite.
    """
    c.check()
    if c.device == "cuda" and not cuda_available():  # before anything is written
        raise Error("train: device 'cuda' is not available: %s" % cuda_unavailable_reason())
    os.makedirs(c.out, exist_ok=True)
    ck = _ckpts(c.out)
    notes = _check_options(c, ck)
    run_record.remove_staging(c.out)  # what a sitting killed while writing left
    tok_file = os.path.join(c.out, "tokens.npy")
    tok_json = os.path.join(c.out, "tokenizer.json")
    tok_path: str | None = tok_json
    off_file = os.path.join(c.out, "offsets.npy")
    vocab_file = os.path.join(c.out, "vocab.json")
    if os.path.exists(vocab_file):  # written last of the three
        tokens, offsets = np.load(tok_file), np.load(off_file)
        vocab = run_record.load_json(vocab_file, "vocab.json")["vocab"]
        tok_path = tok_json if os.path.exists(tok_json) else None
    else:
        tokens, offsets, vocab, tok_path = _tokenize(c, _corpus_texts(c), tok_json)
        vocab = max(vocab, c.vocab)
        for f, a in ((tok_file, tokens), (off_file, offsets)):
            with open(f + ".tmp", "wb") as fh:
                np.save(fh, a)
            os.replace(f + ".tmp", f)
        run_record.write_json_atomic(vocab_file, {"vocab": vocab})
    if c.lines:
        keep = np.diff(offsets) >= 2
        if not keep.any():
            raise Error("train: no sequence of the corpus has 2 tokens or more")
        offsets = np.stack([offsets[:-1][keep], offsets[1:][keep]], 1)  # [n, 2] start, end
    elif len(tokens) < c.seq_len + 2:
        raise Error("train: the corpus has %d tokens, fewer than seq_len + 2" % len(tokens))
    config = model_config(c, vocab)
    recorded = os.path.exists(os.path.join(c.out, run_record.RUN_FILE))
    if ck:
        try:
            model, start, mom, var, config = _open_checkpoint(ck[-1], c, config, c.n_threads)
        except ValueError as e:
            raise _damaged(c.out, ck, str(e)) from e
        start_dir = ck[-1]
        if not recorded:  # a legacy run, checked: record it now
            run_record.write_record(c.out, c, vocab)
            notes.append("resume: wrote %s from these options" % os.path.join(c.out, run_record.RUN_FILE))
    else:
        if not recorded:  # before the first step
            run_record.write_record(c.out, c, vocab)
        start_dir = os.path.join(c.out, "step-000000")
        tmp = run_record.staging(c.out, "step-000000")
        write_model(tmp, init_weights(c, vocab), config, tok_path)
        _write_state(tmp, 0, None, c)
        run_record.install_dir(tmp, start_dir)
        model, start, mom, var, config = _open_checkpoint(start_dir, c, config, c.n_threads)
    P = model.runner.param_total()
    grads = np.zeros(P, np.float32)
    tape = Tape(model, c.batch_size, c.seq_len)
    hp = AdamW(beta1=c.beta1, beta2=c.beta2, eps=c.eps, weight_decay=c.weight_decay)
    end = c.steps if stop_after is None else min(c.steps, start + stop_after)
    with _open_log(c.out) as log:
        for n in notes:
            log.line(n)
        log.line(
            "start step %d of %d: %s %d layers d=%d heads=%d vocab=%d params=%d B=%d T=%d"
            % (start, c.steps, c.model_type, c.n_layer, c.dim, c.n_head, vocab, P, c.batch_size, c.seq_len)
        )
        bar = _progress.bar(
            total=c.steps, initial=start, desc="train", unit="step", progress=c.progress, dynamic_ncols=True
        )
        last, t_last, ntok, s_last = start_dir, time.perf_counter(), 0, start
        loss = float("nan")
        try:
            for step in range(start + 1, end + 1):
                x, y = batch(tokens, c, step, offsets)
                loss, gn = train_step(c, model, tape, x, y, grads, mom, var, hp, step)
                ntok += int((y >= 0).sum()) if c.lines else x.size
                now = time.perf_counter()
                tps = ntok / max(now - t_last, 1e-9)
                if bar is not None:
                    bar.set_postfix(loss="%.4f" % loss, tok_s="%.0f" % tps, refresh=False)
                    bar.update(1)
                log.csv.write("%d,%.6f,%.6g,%.4f,%.1f\n" % (step, loss, hp.lr, gn, tps))
                if step % c.log_every == 0 or step == end:
                    eta = (c.steps - step) * (now - t_last) / max(1, step - s_last)
                    log.line(
                        "step %d/%d loss %.4f lr %.3g grad_norm %.3f tokens/s %.0f eta %.0fs"
                        % (step, c.steps, loss, hp.lr, gn, tps, eta)
                    )
                    t_last, ntok, s_last = now, 0, step
                if step % c.ckpt_every == 0 or step == end:
                    last = _save(c.out, model, mom, var, step, c, config, tok_path, loss)
        finally:
            if bar is not None:
                bar.close()
    if end == c.steps:
        final = os.path.join(c.out, "final")
        tmp = run_record.staging(c.out, "final")
        for name in os.listdir(last):
            if name != "optimizer.npz":
                shutil.copyfile(os.path.join(last, name), os.path.join(tmp, name))
        run_record.install_dir(tmp, final)
        return final
    return last


# --help text of each option of `dclens train` (TrainConfig's fields)
HELP = {
    "out": "run directory (resumed if it holds checkpoints)",
    "model_type": "dcpythia (DCMHA), dcformer (DCFormer++) or gpt_neox (Pythia, plain MHA)",
    "mgate_dim": "dcformer: E > 0 turns the MLP group gate on (E groups; must divide --d-ff)",
    "n_layer": "number of transformer blocks",
    "dim": "model width d_model",
    "n_head": "attention heads (dim / n_head must be a multiple of 8)",
    "d_ff": "MLP width (0: 4 * dim)",
    "vocab": "vocabulary size (0: the tokenizer's)",
    "window_size": "local attention window of the local layers (default: every layer global)",
    "window_type": "which layers are local: LG (even layers), LGLL, LGL6 (default: LG when --window-size is given)",
    "rank": "dcpythia: rank R of the dynamic compose weights",
    "seq_len": "tokens per training sequence (the context the model is trained for)",
    "batch_size": "sequences per step",
    "steps": "optimiser steps of the whole run",
    "lr": "peak learning rate (AdamW)",
    "min_lr": "learning rate at the end of the cosine decay",
    "warmup": "steps of linear warm-up",
    "weight_decay": "AdamW decoupled weight decay (matrices only)",
    "grad_clip": "global gradient-norm clip (0: none)",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "eps": "AdamW epsilon",
    "seed": "seed of the initial weights and of the batches",
    "data": "synth, synth:LINES_PER_TASK, a .jsonl of benchmark records or a text file",
    "lines": "one sequence per record / line, padded (not packed)",
    "bucket": "with --lines: batches of lines of similar length, each padded only to its longest line "
    "(recorded: a run resumes with the bucketing it started with)",
    "tokenizer": "bytes, bpe:N (a byte-level BPE fitted to the corpus) or a tokenizer.json path",
    "ckpt_every": "steps between checkpoints",
    "keep": "checkpoints kept (the final one is also copied to OUT/final)",
    "log_every": "steps between lines of OUT/train.log and OUT/loss.csv",
    "n_threads": "CPU threads (0: all cores)",
    "device": "where the model trains: cpu or cuda (the backward on the GPU; AdamW steps each weight on the host)",
}


def build_parser():
    """The argument parser of `dclens train`.

    Returns
    -------
    argparse.ArgumentParser
        One flag per TrainConfig field (but progress) with its help and default, and
        --stop-after and --no-progress.
    """
    p = argparse.ArgumentParser(
        prog="dclens train", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    for f in dataclasses.fields(TrainConfig):
        if f.name == "progress":
            continue
        flag = "--" + f.name.replace("_", "-")
        h = HELP[f.name]
        if f.name == "out":
            p.add_argument(flag, required=True, help=h)
        elif f.name == "window_size":
            p.add_argument(flag, type=int, default=None, help=h)
        elif f.name == "window_type":
            p.add_argument(flag, default=None, choices=["LG", "LGLL", "LGL6"], help=h)
        elif f.name in ("lines", "bucket"):
            p.add_argument(flag, action="store_true", help=h)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default, help=h)
    p.add_argument("--stop-after", type=int, default=None, help="end this sitting after N steps (resume later)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (train.log still gets its lines)")
    return p


def main(argv=None) -> int:
    """dclens train: command-line front end of train().

    Parameters
    ----------
    argv : list of str or None
        The arguments (None: sys.argv[1:]).

    Returns
    -------
    int
        0, once the checkpoint's directory is printed (errors are raised).
    """
    a = vars(build_parser().parse_args(argv))
    stop = a.pop("stop_after")
    a["progress"] = False if a.pop("no_progress") else None
    d = train(TrainConfig(**a), stop_after=stop)
    print("checkpoint: %s" % d)
    return 0
