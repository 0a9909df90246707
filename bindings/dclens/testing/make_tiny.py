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

Weight files (written by dclens.testing.checkpoint, the one fixture writer):
safetensors as the safetensors package writes them, PyTorch zip as torch.save
writes it (data.pkl pickled by the standard pickle module), and sharded:
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, or
`pytorch_model-0000i-of-0000n.bin` + `pytorch_model.bin.index.json`.

The random weights are drawn by dclens.testing.make_tiny_weights. This module,
that one and dclens.testing.checkpoint import nothing of the engine (they run
before it is built) and never import torch; `import dclens` does not import them.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys
from collections import OrderedDict

import numpy as np

from .._core.checks import Error
from .._core.help import HelpFormatter
from .checkpoint import (  # noqa: F401  (re-exported for tests/passes/test_reference_selfcheck.py)
    _TORCH_STORAGE,
    DTYPES,
    ST_DTYPE,
    TorchTensor,
    _module_metadata,
    pickle_state_dict,
    round_to_dtype,
    write_index,
    write_safetensors,
    write_torch_zip,
)
from .layouts import dcformer_tensors, dcpythia_tensors, gpt_neox_tensors
from .make_tiny_weights import _dcformer_weights, _dcpythia_weights, _Gen, _gpt_neox_weights

__all__ = [
    "make_tiny",
    "round_to_dtype",
    "write_safetensors",
    "write_torch_zip",
    "TorchTensor",
    "pickle_state_dict",
    "dcpythia_config",
    "gpt_neox_config",
    "dcformer_config",
    "tiny_config",
]


# --------------------------------------------------------------------------- configs


# the keyword arguments both DCMHA config writers take (dcpythia_config, dcformer_config)
_DC_SHARED = (
    "dim",
    "dtype",
    "intermediate",
    "n_head",
    "n_layer",
    "query_wise",
    "use_dcmha",
    "use_qk_norm",
    "vocab",
    "window_size",
    "window_type",
)


def _dc_config(architecture, a):
    """The config.json keys DCPythia and DCFormer++ share, in the order the published
    configs have them (sorted); a: the _DC_SHARED arguments of the model's config
    writer by name (its own keys it adds itself). A missing or unknown one is a
    TypeError, as for any keyword argument."""
    missing, unknown = sorted(set(_DC_SHARED) - set(a)), sorted(set(a) - set(_DC_SHARED))
    if missing or unknown:
        raise TypeError(
            "%s config: missing keyword arguments %s, unexpected %s"
            % (architecture, missing or "none", unknown or "none")
        )
    name = architecture.lower()
    return dict(
        architectures=[architecture],
        auto_map={
            "AutoConfig": f"configuration_{name}.{architecture}Config",
            "AutoModelForCausalLM": f"modeling_{name}.{architecture}",
        },
        block_size=2048,
        dim=a["dim"],
        head_dim=a["dim"] // a["n_head"],
        intermediate_size=a["intermediate"],
        is_training=False,
        model_type=name,
        n_head=a["n_head"],
        n_layer=a["n_layer"],
        n_local_heads=a["n_head"],
        q_chunk_size=128,
        query_wise=bool(a["query_wise"]),
        torch_dtype=a["dtype"],
        use_dcmha=bool(a["use_dcmha"]),
        use_gradient_checkpointing=False,
        use_qk_norm=bool(a["use_qk_norm"]),
        vocab_size=a["vocab"],
        window_size=a["window_size"],
        window_type=a["window_type"],
    )


def _sorted_config(shared, **own):
    """shared (_dc_config's keys) with the model's own keys, all in sorted order."""
    return dict(sorted({**shared, **own}.items()))


def dcpythia_config(
    *,
    rotary_pct,
    use_parallel_residual,
    use_linear_bias,
    tie_word_embeddings,
    use_sw=False,
    moh=None,
    compose_groups=1,
    key_wise=False,
    **shared,
):
    """config.json with the keys of the published DCPythia-6.9B config (shared: n_layer, dim,
    n_head, vocab, intermediate, window_size, window_type, query_wise, use_qk_norm, use_dcmha
    and dtype, the keys every DCMHA config has)."""
    cfg = _sorted_config(
        _dc_config("DCPythia", shared),
        bos_token_id=0,
        eos_token_id=0,
        norm_eps=1e-05,
        rope_base=10000,
        rotary_pct=rotary_pct,
        tie_word_embeddings=bool(tie_word_embeddings),
        transformers_version="4.33.2",
        use_linear_bias=bool(use_linear_bias),
        use_parallel_residual=bool(use_parallel_residual),
    )
    # attention variants of model-spec.md section 5, only written when switched on
    if use_sw:
        cfg["use_sw"] = True
    if moh is not None:
        cfg["moh"] = {"shared_heads": int(moh["shared_heads"]), "routed_topk": int(moh["routed_topk"])}
    if compose_groups != 1:
        cfg["compose_groups"] = int(compose_groups)
    if key_wise:
        cfg["key_wise"] = True
    return cfg


def dcformer_config(*, mgate_dim, rope_base=500000.0, **shared):
    """config.json with the keys of the official DCFormer config (pytorch/dcformer/config.json;
    shared: as for dcpythia_config)."""
    return _sorted_config(
        _dc_config("DCFormer", shared),
        bos_token_id=1,
        eos_token_id=2,
        mgate=bool(mgate_dim),
        mgate_dim=int(mgate_dim) if mgate_dim else 44,
        norm_eps=1e-06,
        prefill_pad=True,
        rope_base=rope_base,
        tie_word_embeddings=False,
        transformers_version="4.46.3",
    )


def gpt_neox_config(
    *, n_layer, dim, n_head, vocab, intermediate, rotary_pct, use_parallel_residual, tie_word_embeddings, dtype
):
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


def _is_f32_buffer(name):
    """Tensors always stored as F32 whatever the checkpoint dtype (HF buffers)."""
    return name.endswith("attention.masked_bias") or name.endswith("rotary_emb.inv_freq")


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
            elif model_type in ("dcpythia", "dcformer") and not fused_qkv:
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


def make_tiny(
    out_dir,
    model_type="dcpythia",
    *,
    n_layer=2,
    dim=32,
    n_head=4,
    vocab=64,
    intermediate=None,
    rank=2,
    window_size=8,
    window_type=None,
    query_wise=False,
    use_qk_norm=True,
    use_parallel_residual=True,
    use_linear_bias=True,
    use_dcmha=True,
    rotary_pct=0.25,
    dtype="float32",
    fmt="safetensors",
    shards=1,
    fused_qkv=True,
    tie_word_embeddings=False,
    seed=0,
    weight_scale=1.0,
    dyn_scale=1.0,
    tokenizer=None,
    extra_derived=False,
    share_storage=False,
    write_unused_dyn=True,
    use_sw=False,
    moh=None,
    compose_groups=1,
    key_wise=False,
    torch_views=None,
    archive_name="archive",
    pickle_container="ordereddict",
    torch_style="2.1",
    mgate_dim=0,
):
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
      mgate_dim: DCFormer++ ("dcformer") only: E > 0 writes the MLP group gate
        feed_forward.mg [E, D] and "mgate": true (E must divide intermediate).
        DCFormer++ ignores use_parallel_residual, use_linear_bias, rotary_pct,
        tie_word_embeddings, use_sw, moh, compose_groups, key_wise (its module has
        none of them); intermediate defaults to DCFormerConfig's (the multiple of
        256 at or above int(8 dim / 3)).
      torch_views: torch format only, tensors stored as strided views the way
        torch.save keeps them: "transpose" stores every 2-D weight's storage
        transposed with stride (1, rows); "expand" makes every LayerNorm bias a
        constant stored as one element with stride (0,) (and, with extra_derived,
        the identity `sw` buffer an expanded eye, stride (0, N, 1)).
      archive_name / pickle_container / torch_style: see write_torch_zip and
        pickle_state_dict.
    """
    opts = _resolved(locals())  # every argument by name: each step below takes its own from it
    os.makedirs(out_dir, exist_ok=True)
    config_of, weights_of, layout_of = _MODEL_TYPES[model_type]
    config = _forward(config_of, opts)
    sd32 = _forward(weights_of, opts, _Gen(seed, weight_scale, dyn_scale))
    _check_layout(model_type, sd32, _forward(layout_of, opts))
    if torch_views == "expand":
        sd32 = _constant_norm_biases(sd32)

    raw, state_dict, tdtype = _round_to_storage(sd32, dtype)
    _write_config(out_dir, config, tokenizer)
    _forward(_write_weights, opts, out_dir, raw, tdtype)
    return {n: np.array(state_dict[n], dtype=np.float32) for n in state_dict}, dict(config)


def tiny_config(model_type="dcpythia", **options):
    """The config.json make_tiny writes, without writing anything.

    Parameters
    ----------
    model_type : str
        "dcpythia", "dcformer" or "gpt_neox", as make_tiny's.
    **options
        make_tiny's keyword options; the others keep make_tiny's defaults.

    Returns
    -------
    dict
        What make_tiny(out_dir, model_type, **options) writes to config.json.

    Raises
    ------
    TypeError
        For a name that is not one of make_tiny's options.
    ValueError
        For the options make_tiny refuses.
    """
    args = inspect.signature(make_tiny).bind(None, model_type, **options)
    args.apply_defaults()
    return _forward(_MODEL_TYPES[model_type][0], _resolved(args.arguments))


# --------------------------------------------------------------------------- steps of make_tiny

# per model type: its config.json writer, its weight drawer, its layout table
_MODEL_TYPES = {
    "dcpythia": (dcpythia_config, _dcpythia_weights, dcpythia_tensors),
    "dcformer": (dcformer_config, _dcformer_weights, dcformer_tensors),
    "gpt_neox": (gpt_neox_config, _gpt_neox_weights, gpt_neox_tensors),
}


def _resolved(args):
    """make_tiny's arguments by name (args) checked, with intermediate and rank as
    written and dyn (whether dyn_w_proj is written: the layout table's switch)."""
    opts = dict(args)
    _forward(_check_options, opts)
    opts.update(_forward(_widths, opts))
    opts["dyn"] = opts["use_dcmha"] or opts["write_unused_dyn"]
    return opts


def _forward(fn, opts, *args):
    """Call one step of make_tiny with its options taken from make_tiny's.

    Parameters
    ----------
    fn : callable
        The step; each of its keyword-only parameters is passed opts[name] where opts
        has that name (a parameter with a default keeps it otherwise), and its **shared
        (the DCMHA config writers) the _DC_SHARED names.
    opts : dict
        make_tiny's arguments by name (with intermediate and rank as written, and dyn).
    *args
        fn's positional arguments.

    Returns
    -------
    object
        What fn returns.
    """
    params = inspect.signature(fn).parameters
    names = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    if "shared" in params:
        names += _DC_SHARED
    return fn(*args, **{n: opts[n] for n in names if n in opts})


def _check_options(
    *, model_type, dtype, fmt, dim, n_head, window_type, use_sw, moh, compose_groups, torch_views, share_storage
):
    """The ValueErrors of make_tiny's arguments, before anything is written."""
    if model_type not in ("dcpythia", "gpt_neox", "dcformer"):
        raise ValueError(f"model_type must be 'dcpythia', 'dcformer' or 'gpt_neox', not {model_type!r}")
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


def _widths(*, model_type, dim, n_head, intermediate, rank, mgate_dim):
    """{"intermediate", "rank"} as written: the MLP width's default (DCFormerConfig's for
    dcformer, else 4*dim) and dcformer's fixed rank 2; refuses a misplaced mgate_dim."""
    if model_type == "dcformer":
        if intermediate is None:  # DCFormerConfig's default
            n = int(2 * (4 * dim) / 3)
            intermediate = n if n % 256 == 0 else n + 256 - n % 256
        if mgate_dim and int(intermediate) % int(mgate_dim):
            raise ValueError("mgate_dim must divide intermediate")
        if n_head < 2 or n_head % 2:
            raise ValueError("dcformer needs an even n_head (its dynamic rank is n_head // (n_head // 2) = 2)")
        rank = 2
    elif mgate_dim:
        raise ValueError("mgate_dim is a dcformer switch")
    intermediate = 4 * dim if intermediate is None else int(intermediate)
    return dict(intermediate=intermediate, rank=rank)


def _check_layout(model_type, sd32, layout):
    """AssertionError unless the drawn names and shapes are the layout table's, in its order."""
    drawn = OrderedDict((n, tuple(a.shape)) for n, a in sd32.items())
    if drawn != layout:
        raise AssertionError(
            "make_tiny drew %s, the layout table has %s"
            % (sorted(set(drawn.items()) ^ set(layout.items())), model_type)
        )


def _constant_norm_biases(sd32):
    """sd32 with every LayerNorm bias one repeated value (torch_views="expand" stores it
    as one element with stride (0,))."""
    return OrderedDict(
        (n, np.full_like(a, a[0]) if n.endswith(("norm.bias", "layernorm.bias")) else a) for n, a in sd32.items()
    )


def _round_to_storage(sd32, dtype):
    """(raw, state_dict, tdtype): per name the stored array (raw bits of its dtype), its
    values widened to float32, and its dtype (the HF buffers stay float32)."""
    raw, state_dict, tdtype = OrderedDict(), OrderedDict(), {}
    for name, a in sd32.items():
        dt = "float32" if _is_f32_buffer(name) else dtype
        r, w = round_to_dtype(a, dt)
        raw[name], state_dict[name], tdtype[name] = r, w, dt
    return raw, state_dict, tdtype


def _write_config(out_dir, config, tokenizer):
    """out_dir/config.json, and the tokenizer.json copied from `tokenizer` when given."""
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, os.path.join(out_dir, "tokenizer.json"))


def _weight_file_names(fmt, shards):
    """The weight files of fmt: one file, or `shards` numbered shards."""
    if fmt == "safetensors":
        if shards == 1:
            return ["model.safetensors"]
        return [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    if shards == 1:
        return ["pytorch_model.bin"]
    return [f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin" for i in range(shards)]


def _write_weights(
    out_dir,
    raw,
    tdtype,
    *,
    model_type,
    fused_qkv,
    fmt,
    shards,
    share_storage,
    torch_views,
    archive_name,
    pickle_container,
    torch_style,
):
    """The weight files of `raw` (name -> stored array, of dtype tdtype[name]) in fmt,
    in `shards` files (with their index when more than one)."""
    nbytes = {n: raw[n].nbytes for n in raw}
    names = list(raw)
    # plan storages (torch) and shards
    plan = _storage_plan(names, model_type, fused_qkv, share_storage and fmt == "torch")
    group_of = {n: sid for sid, ns in plan for n in ns}
    shard_lists = _split_shards(names, group_of, nbytes, shards)
    fnames = _weight_file_names(fmt, shards)
    for fname, shard_names in zip(fnames, shard_lists):
        path = os.path.join(out_dir, fname)
        if fmt == "safetensors":
            write_safetensors(
                path, {n: (ST_DTYPE[tdtype[n]], raw[n].shape, raw[n]) for n in shard_names}, {"format": "pt"}
            )
        else:
            tensors, storages = _torch_storages(shard_names, raw, tdtype, group_of, torch_views)
            write_torch_zip(
                path, tensors, storages, archive_name=archive_name, container=pickle_container, torch_style=torch_style
            )
    if shards > 1:
        iname = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
        write_index(
            os.path.join(out_dir, iname),
            {n: fname for fname, ns in zip(fnames, shard_lists) for n in ns},
            sum(nbytes.values()),
        )


def _torch_storages(shard_names, raw, tdtype, group_of, torch_views):
    """(tensors, storages) of one torch shard: TorchTensor per name in state-dict order,
    and the bytes of each storage (group_of[name]: its storage id)."""
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
    return OrderedDict((n, tensors[n]) for n in shard_names), storages  # tensors in state-dict order


def _strided_view(a, name, kind):
    """(storage array, stride) storing `a` as a strided view, or None to store it plainly."""
    if kind == "transpose" and a.ndim == 2 and a.shape[0] > 1 and a.shape[1] > 1:
        return np.ascontiguousarray(a.T), (1, a.shape[0])
    if kind == "expand" and a.ndim == 1 and name.endswith(("norm.bias", "layernorm.bias")):
        return a[:1].copy(), (0,)
    # the identity buffer torch.eye(N).expand(2, N, N)
    if kind == "expand" and name.endswith("dyn_w_proj.sw") and a.ndim == 3 and np.array_equal(a[0], a[1]):
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


def build_parser(prog="dclens make-tiny"):
    """The argument parser of `dclens make-tiny` (every option with help and default)."""
    ap = argparse.ArgumentParser(
        prog=prog,
        formatter_class=HelpFormatter,
        description="Write a tiny random DCPythia / DCFormer++ / Pythia checkpoint directory.",
    )
    # one flat option list (no argparse groups): the help lists them in this order
    _add_size_options(ap)
    _add_architecture_options(ap)
    _add_file_options(ap)
    _add_weight_options(ap)
    _add_variant_options(ap)
    _add_torch_options(ap)
    return ap


def _add_size_options(ap):
    """OUT_DIR, the model type and the sizes."""
    ap.add_argument("out_dir", help="directory to write (config.json, weights, optional tokenizer.json)")
    ap.add_argument(
        "--type",
        "--model-type",
        dest="model_type",
        default="dcpythia",
        choices=["dcpythia", "dcformer", "gpt_neox"],
        help="model type: DCPythia (DCMHA), DCFormer++ or Pythia (MHA)",
    )
    ap.add_argument(
        "--mgate-dim",
        type=int,
        default=0,
        help="dcformer: E > 0 turns the MLP group gate on (E groups; must divide --intermediate)",
    )
    ap.add_argument("--n-layer", type=int, default=2, help="transformer blocks")
    ap.add_argument("--dim", type=int, default=32, help="model width d_model")
    ap.add_argument("--n-head", type=int, default=4, help="attention heads")
    ap.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4*dim)")
    ap.add_argument("--rank", type=int, default=2, help="dynamic compose rank R (dcpythia)")


def _add_architecture_options(ap):
    """The attention window and the architecture switches of config.json."""
    B = argparse.BooleanOptionalAction
    ap.add_argument(
        "--window-size",
        type=lambda v: None if v == "null" else int(v),
        default=8,
        help="local attention window ('null': every layer global)",
    )
    ap.add_argument(
        "--window-type", default=None, choices=["LG", "LGLL", "LGL6"], help="which layers are local (default: LG)"
    )
    ap.add_argument("--query-wise", action=B, default=False, help="query-wise-only composition")
    ap.add_argument("--use-qk-norm", action=B, default=True, help="RMS norm of q and k")
    ap.add_argument("--use-parallel-residual", action=B, default=True, help="attention and MLP in parallel")
    ap.add_argument("--use-linear-bias", action=B, default=True, help="biases on the linear layers")
    ap.add_argument("--use-dcmha", action=B, default=True, help="dcpythia: composed attention (off: MHA layers)")
    ap.add_argument(
        "--write-unused-dyn",
        action=B,
        default=True,
        help="query-wise models: also write the ignored key-side dynamic weights",
    )
    ap.add_argument("--rotary-pct", type=float, default=0.25, help="fraction of each head's dims rotated")


def _add_file_options(ap):
    """The stored dtype, the file format and sharding, and the tensor names."""
    B = argparse.BooleanOptionalAction
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES), help="stored weight type")
    ap.add_argument(
        "--format",
        dest="fmt",
        default="safetensors",
        choices=["safetensors", "torch"],
        help="weight file format (torch: a torch.save zip, written without torch)",
    )
    ap.add_argument("--shards", type=int, default=1, help="weight files (with an index when > 1)")
    ap.add_argument("--fused-qkv", action=B, default=True, help="one fused query/key/value matrix per layer")
    ap.add_argument("--tie-word-embeddings", action=B, default=False, help="unembedding = embedding matrix")


def _add_weight_options(ap):
    """The random weights, the tokenizer and the extra tensors written."""
    B = argparse.BooleanOptionalAction
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--weight-scale", type=float, default=1.0, help="scale of the random weights")
    ap.add_argument("--dyn-scale", type=float, default=1.0, help="scale of the dynamic compose weights")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json to copy into OUT_DIR")
    ap.add_argument(
        "--extra-derived",
        action=B,
        default=False,
        help="also write the derived tensors of the published module (merged dw_m, qkw_m, sw; identity projections)",
    )
    ap.add_argument(
        "--share-storage",
        action=B,
        default=False,
        help="torch format: LayerNorm weight+bias (and unfused wq/wk/wv) share one storage",
    )


def _add_variant_options(ap):
    """The attention variants of model-spec.md section 5 (dcpythia)."""
    B = argparse.BooleanOptionalAction
    ap.add_argument("--use-sw", action=B, default=False, help="static (Talking-Heads) compose branch")
    ap.add_argument("--moh", default=None, metavar="HS,K", help="MoH routing: shared heads, routed top-k")
    ap.add_argument("--compose-groups", type=int, default=1, help="G: heads composed within G groups")
    ap.add_argument("--key-wise", action=B, default=False, help="key-wise-only composition")


def _add_torch_options(ap):
    """How the torch format's zip is laid out."""
    ap.add_argument(
        "--torch-views",
        default=None,
        choices=["transpose", "expand"],
        help="torch format: store tensors as strided views",
    )
    ap.add_argument(
        "--archive-name",
        default="archive",
        help="folder inside torch zips; 'auto' = file basename without extension, as torch.save(path)",
    )
    ap.add_argument(
        "--pickle-container",
        default="ordereddict",
        choices=["ordereddict", "ordereddict_meta", "dict"],
        help="torch format: the pickled container of the state dict",
    )
    ap.add_argument(
        "--torch-style",
        default="2.1",
        choices=["2.1", "2.7"],
        help="torch format: the zip layout of that torch version",
    )


def main(argv=None, prog="dclens make-tiny"):
    ap = build_parser(prog)
    a = ap.parse_args(argv)
    _check_cli_args(a)
    try:
        sd, cfg = _make_tiny_cli(a)
    except OSError as e:
        raise Error("make-tiny: cannot write %s: %s" % (e.filename or a.out_dir, e.strerror or e)) from None
    total = sum(v.size for v in sd.values())
    print(
        f"wrote {a.out_dir}: {cfg['model_type']}, {len(sd)} tensors, {total} parameters, "
        f"{a.dtype}, {a.fmt}, {a.shards} shard(s)"
    )
    return 0


def _check_cli_args(a) -> None:
    """Sizes refused up front (before anything is written), as dclens.Error."""
    for flag, v, lo in (
        ("--n-layer", a.n_layer, 1),
        ("--dim", a.dim, 1),
        ("--n-head", a.n_head, 1),
        ("--vocab", a.vocab, 1),
        ("--rank", a.rank, 1),
        ("--shards", a.shards, 1),
        ("--window-size", a.window_size, 1),
        ("--intermediate", a.intermediate, 1),
    ):
        if v is not None and v < lo:
            raise Error("make-tiny: %s must be at least %d, not %d" % (flag, lo, v))
    if a.dim % a.n_head:
        raise Error("make-tiny: --dim %d is not divisible by --n-head %d" % (a.dim, a.n_head))
    if a.mgate_dim < 0 or (a.mgate_dim and a.model_type != "dcformer"):
        raise Error(
            "make-tiny: --mgate-dim %d: the group gate is a dcformer switch (E >= 1, or 0 for none)" % a.mgate_dim
        )
    if a.model_type == "dcformer" and a.n_head % 2:
        raise Error("make-tiny: dcformer needs an even --n-head (its dynamic rank is n_head // (n_head // 2) = 2)")
    if a.model_type == "dcformer" and a.mgate_dim and a.intermediate and a.intermediate % a.mgate_dim:
        raise Error("make-tiny: --mgate-dim %d does not divide --intermediate %d" % (a.mgate_dim, a.intermediate))
    if os.path.lexists(a.out_dir) and not os.path.isdir(a.out_dir):
        raise Error("make-tiny: %s exists and is not a directory" % a.out_dir)


def _make_tiny_cli(a):
    """make_tiny of the parsed command line (the parser's dests are make_tiny's parameters)."""
    archive_name = None if a.archive_name == "auto" else a.archive_name
    return make_tiny(**dict(vars(a), moh=_parse_moh(a.moh), archive_name=archive_name))


if __name__ == "__main__":
    sys.exit(main(prog="python -m dclens.testing.make_tiny"))
