"""dcscope: look inside attention heads that talk to each other.

An exact C engine (CPU, CUDA) for DCPythia (DCFormer's dynamically composable
multi-head attention) and Pythia, with hooks on every activation.

    import dcscope
    model = dcscope.load("path/to/checkpoint")        # config.json + weights
    dcscope.bundled_models()                           # models shipped with the package,
    model = dcscope.load("dcpythia-tiny")              # loadable by name
    logits = model.forward(tokens)                     # [T, V] or [B, T, V]
    logits, cache = model.run_with_cache(tokens)       # every hook
    cache["blocks.0.attn.post.kp"]                     # [N, T, S]
    dcscope.attention_heatmap(model, "The cat sat", layer=0)   # PNG, inline in Jupyter
"""
from .model import Cache, Config, Error, Model, cuda_available, cuda_unavailable_reason, load
from .heatmaps import PNG, attention_heatmap, heatmap
from .bundled import BundledModel, bundled_models
from . import circuits, interventions, routing

__all__ = ["BundledModel", "Cache", "Config", "Error", "Model", "PNG", "attention_heatmap", "bundled_models",
           "circuits", "cuda_available",
           "cuda_unavailable_reason", "heatmap", "interventions", "load", "routing"]
__version__ = "0.1.0"
