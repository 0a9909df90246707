"""Sparse dictionaries on any hook: SAEs and transcoders trained in the engine on activations
streamed from the model's passes, their quality as SAELens reports it, and SAELens's file
format both ways (docs/features.md).

    from dclens import features
    cfg = features.SAEConfig(d_in=32, d_sae=256, arch="topk", k=8, hook_name="blocks.0.resid_post")
    sae = features.SAE(cfg)
    src = features.TokenArrays(tokens)                    # [S, T] ids, or fn(i) -> [T]
    features.train_sae(model, sae, src, steps=200, checkpoint="sae.npz")
    features.evaluate(model, sae, src, start=800)         # explained variance, L0, CE recovered
    features.save(sae, "out/")                            # cfg.json + sae_weights.safetensors
    sae2 = features.load("out/")
    g = features.attribution_graph(model, toks, transcoders)     # feature graph, compose nodes
    logits, cache = features.run_with_saes(model, toks, [sae], use_error_term=True)   # <hook>.sae.acts
    features.run_with_saes(model, toks, [sae], fwd_hooks=features.ablate_features(sae, [3]))
"""

from .attribution_graph import AttributionGraph, Node, attribution_graph
from .dashboard import LogitEffect, TopActivations, feature_logit_effect, top_activating
from .hooks import ablate_features, feature_hook_name, patch_features, run_with_saes, sae_hooks, steer
from .metrics import evaluate
from .sae import SAE, SAEConfig, check_fits, hook_width
from .saelens import load, read_safetensors, saelens_cfg, save, write_safetensors
from .sources import JsonlFile, TextFile, TokenArrays
from .training import TrainSAEConfig, TrainState, activations, load_checkpoint, save_checkpoint, train_sae

__all__ = [
    "SAE",
    "SAEConfig",
    "TrainSAEConfig",
    "TrainState",
    "TokenArrays",
    "TextFile",
    "JsonlFile",
    "train_sae",
    "evaluate",
    "save",
    "load",
    "saelens_cfg",
    "read_safetensors",
    "write_safetensors",
    "save_checkpoint",
    "load_checkpoint",
    "activations",
    "check_fits",
    "hook_width",
    "attribution_graph",
    "AttributionGraph",
    "Node",
    "run_with_saes",
    "sae_hooks",
    "feature_hook_name",
    "ablate_features",
    "steer",
    "patch_features",
    "top_activating",
    "feature_logit_effect",
    "TopActivations",
    "LogitEffect",
]
