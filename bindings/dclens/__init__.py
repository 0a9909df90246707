"""dclens: look inside attention heads that talk to each other.

An exact C engine (CPU, CUDA) for DCPythia (DCFormer's dynamically composable
multi-head attention) and Pythia, with hooks on every activation.

    import dclens
    model = dclens.load("path/to/checkpoint")        # config.json + weights
    dclens.bundled_models()                           # models shipped with the package,
    model = dclens.load("dcpythia-tiny")              # loadable by name
    logits = model.forward(tokens)                     # [T, V] or [B, T, V]
    logits, cache = model.run_with_cache(tokens)       # every hook
    cache["blocks.0.attn.post.kp"]                     # [N, T, S]
    dclens.hook_name(0, "attn.post.kp")               # "blocks.0.attn.post.kp"
    model.run_with_hooks(tokens, [(name, fn)])         # fn(act, name) may write act;
    dclens.read_only(fn)                              # ... or only read it (no copy back)
    dclens.attention_heatmap(model, "The cat sat", layer=0)   # PNG, inline in Jupyter
    model.generate("The cat", max_new_tokens=10)       # incremental decoding in the engine

TransformerLens habits work: names_filter=, hook_* names, cache["pattern", 0],
model.hooks(...) as a context manager, return_type="loss", batches of prompts
(docs/api.md).
"""

from .model import Cache, Config, Error, LoadWarning, Model, cuda_available, cuda_unavailable_reason, load
from .heatmaps import PNG, attention_heatmap, heatmap
from .bundled import BundledModel, bundled_models
from . import analysis, circuits, interventions, routing
from . import cache, names, patching
from .names import BRANCHES, PHASES, hook_name
from .hooks import read_only
from .generate import Decoder, generate

__all__ = [
    "BRANCHES",
    "BundledModel",
    "Cache",
    "Config",
    "Decoder",
    "Error",
    "LoadWarning",
    "Model",
    "PHASES",
    "PNG",
    "analysis",
    "attention_heatmap",
    "bundled_models",
    "cache",
    "circuits",
    "cuda_available",
    "cuda_unavailable_reason",
    "generate",
    "heatmap",
    "hook_name",
    "interventions",
    "load",
    "names",
    "patching",
    "read_only",
    "routing",
]
__version__ = "0.1.0"
