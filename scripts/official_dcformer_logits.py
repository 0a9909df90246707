"""Checkpoints written by the official DCFormer module, and the logits it computes.

    python scripts/official_dcformer_logits.py --module /tmp/DCFormer/pytorch/dcformer \\
        --out tests/data/dcformer_official

imports `modeling_dcformer` and `configuration_dcformer` from --module (the
`pytorch/dcformer/` folder of github.com/Caiyun-AI/DCFormer; this script holds
none of their code), builds small models for the cases below in float32, draws
every parameter at scales where composition and the group gate matter (the
module's own init makes the dynamic weights ~1e-4), saves each with the module's
own `save_pretrained` (torch .bin or safetensors, single or sharded with their
index; one case also with the wq/wk/wv split the module's load hook accepts) and runs the module's inference forward
(its prefill path: `setup_caches`, then one call over the whole sequence). The
logits at the positions listed in `cases.json` are stored as float32 .npy.
One case also runs the module's training path (`is_training`: chunked attention,
probabilities rounded to bfloat16, masks t - s <= w) for the window-convention check.

Needs torch and transformers (the official module was written for 4.46.3) in
an environment of its own; dclens does not import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import numpy as np

CASES = [
    # name, config overrides, T, save format
    (
        "lgll_mgate_qknorm",
        dict(n_layer=4, window_type="LGLL", window_size=256, mgate=True, mgate_dim=4, use_qk_norm=True),
        300,
        "bin",
    ),
    (
        "null_nomgate_noqknorm",
        dict(n_layer=2, window_type=None, window_size=256, mgate=False, use_qk_norm=False),
        300,
        "safetensors-sharded",
    ),
    (
        "lg_mgate_split_qkv",
        dict(n_layer=2, window_type="LG", window_size=256, mgate=True, mgate_dim=8, use_qk_norm=True),
        40,
        "split",
    ),
    (
        "global_only",
        dict(n_layer=2, window_type=None, window_size=None, mgate=True, mgate_dim=2, use_qk_norm=True),
        40,
        "bin-sharded",
    ),
    (
        "training_path_lg",
        dict(n_layer=2, window_type=None, window_size=6, mgate=True, mgate_dim=4, use_qk_norm=True, block_size=64),
        48,
        "safetensors",
    ),
]
BASE = dict(
    vocab_size=48,
    dim=16,
    n_head=4,
    intermediate_size=32,
    rope_base=10000.0,
    norm_eps=1e-6,
    block_size=768,
    torch_dtype="float32",
    use_dcmha=True,
    query_wise=False,
)


def positions(T):
    """The stored logit rows: the first 16, every 13th, the last 8."""
    return sorted(set(range(min(T, 16))) | set(range(0, T, 13)) | set(range(max(0, T - 8), T)))


def redraw(model, torch, gen):
    """Every parameter at a scale where each part of the layer matters."""
    D = model.config.dim
    for name, p in model.named_parameters():
        if name.endswith(("_m",)):
            continue  # merged copies, rebuilt below
        if name.endswith("norm.weight"):
            v = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith(("q_norm.scale", "k_norm.scale")):
            v = 1.2 + 0.2 * torch.randn(p.shape, generator=gen)
        elif name.endswith("dyn_w_proj.dw1") or name.endswith("dyn_w_proj.dd"):
            v = torch.randn(p.shape, generator=gen) / D**0.5
        elif name.endswith("dyn_w_proj.qkw"):
            v = torch.randn(p.shape, generator=gen) * 0.6 / p.shape[2] ** 0.5
        elif name == "tok_embeddings.weight":
            v = torch.randn(p.shape, generator=gen)
        elif name == "output.weight":
            v = torch.randn(p.shape, generator=gen) * 3.0 / D**0.5
        elif name.endswith("mg.weight"):
            v = torch.randn(p.shape, generator=gen) * 2.0 / p.shape[1] ** 0.5
        else:  # Linear weights [out, in]
            v = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
        with torch.no_grad():
            p.copy_(v.to(p.dtype))
    for layer in model.layers:
        layer.attention.dyn_w_proj.merge_weights()


def run_case(mod, cfgmod, torch, out, name, over, T, fmt, seed):
    kw = dict(BASE, **over)
    training = name.startswith("training")
    cfg = cfgmod.DCFormerConfig(is_training=training, **kw)
    torch.manual_seed(seed)
    model = mod.DCFormer(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    redraw(model, torch, gen)
    d = os.path.join(out, name)
    if os.path.exists(d):
        shutil.rmtree(d)
    if fmt == "split":
        # the wq/wk/wv layout the module's load hook accepts: written, then loaded back
        model.save_pretrained(d, safe_serialization=False)
        sd = torch.load(os.path.join(d, "pytorch_model.bin"), weights_only=True)
        for key in [k for k in sd if k.endswith("attention.wqkv.weight")]:
            w = sd.pop(key)
            D = cfg.dim
            for i, nm in enumerate(("wq", "wk", "wv")):
                sd[key.replace("wqkv", nm)] = w[i * D : (i + 1) * D].clone()
        torch.save(sd, os.path.join(d, "pytorch_model.bin"))
        cfg = cfgmod.DCFormerConfig(is_training=training, **kw)  # save_pretrained made torch_dtype a str
        fresh = mod.DCFormer(cfg).to(torch.float32).eval()
        fresh.load_state_dict(sd)  # through the module's load_hook
        model = fresh
        for layer in model.layers:
            layer.attention.dyn_w_proj.merge_weights()
    else:
        # safetensors refuses qkw_m, a view of qkw: the merged copies are left out there
        st = fmt.startswith("safetensors")
        sd = {
            k: v
            for k, v in model.state_dict().items()
            if not st or not k.endswith(("dyn_w_proj.dw_m", "dyn_w_proj.qkw_m"))
        }
        model.save_pretrained(
            d, state_dict=sd, safe_serialization=st, max_shard_size="20KB" if fmt.endswith("sharded") else "5GB"
        )
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=gen)
    with torch.no_grad():
        model.setup_caches(max_batch_size=1)
        if training:
            logits = model(ids, return_tensor=True)
        else:
            logits = model(ids, input_pos=torch.arange(T)[None], return_tensor=True, batch_indexes=torch.arange(1))
    pos = positions(T)
    lg = logits[0].float().numpy()[pos]
    if not np.isfinite(lg).all():
        raise SystemExit(f"{name}: the official module gave non-finite logits")
    np.save(os.path.join(d, "official_logits.npy"), lg.astype(np.float32))
    return {
        "name": name,
        "tokens": ids[0].tolist(),
        "positions": pos,
        "format": fmt,
        "path": "official_training" if training else "official_inference",
        "window_size": kw.get("window_size"),
        "window_type": kw.get("window_type"),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", required=True, help="the pytorch/dcformer folder of Caiyun-AI/DCFormer")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=27)
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(a.module))
    import configuration_dcformer as cfgmod
    import modeling_dcformer as mod
    import torch

    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    cases = [
        run_case(mod, cfgmod, torch, a.out, name, over, T, fmt, a.seed + i)
        for i, (name, over, T, fmt) in enumerate(CASES)
    ]
    meta = {
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "command": "python scripts/official_dcformer_logits.py --module PATH/pytorch/dcformer --out " + a.out,
        "cases": cases,
    }
    with open(os.path.join(a.out, "cases.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print("wrote", a.out, [c["name"] for c in cases])


if __name__ == "__main__":
    main()
