"""dclens: look inside attention heads that talk to each other.

An exact C engine (CPU, CUDA) for DCPythia (DCFormer's dynamically composable
multi-head attention) and Pythia, with hooks on every activation.

    import dclens
    model = dclens.load("path/to/checkpoint")        # config.json + weights
    model = dclens.load("org/name", revision="main") # a Hugging Face Hub id (local cache first)
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
    dclens.explore(model, "The cat sat").save("p.html")   # interactive composition explorer

TransformerLens habits work: names_filter=, hook_* names, cache["pattern", 0],
model.hooks(...) as a context manager, return_type="loss", batches of prompts
(docs/api.md).
"""

from . import (
    _binding,  # noqa: F401  (the BLAS library first, then dclens._engine: a dclens.Error if either fails)
    analysis,
    attribution,
    blas,
    cache,
    circuits,
    grad,
    graph,
    hub,
    interventions,
    memplan,
    names,
    patching,
    progress,
    routing,
)
from ._checks import ArgumentError, ArgumentTypeError, NotFoundError, UnknownNameError
from .blas import BlasWarning
from .bundled import BundledModel, bundled_models
from .explorer import Explorer, explore
from .generate import Decoder, generate
from .heatmaps import PNG, attention_heatmap, heatmap
from .hooks import HookPoint, Hooks, read_only
from .model import (
    Cache,
    Config,
    ContextWarning,
    Error,
    LoadWarning,
    Model,
    TLConfig,
    cuda_available,
    cuda_unavailable_reason,
    from_pretrained,
    load,
)
from .names import BRANCHES, PHASES, hook_name, hook_names
from .patching import PatchingWarning
from .prompting import test_prompt

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BRANCHES",
    "BlasWarning",
    "BundledModel",
    "Cache",
    "Config",
    "ContextWarning",
    "Decoder",
    "Error",
    "Explorer",
    "HookPoint",
    "Hooks",
    "LoadWarning",
    "Model",
    "NotFoundError",
    "PHASES",
    "PNG",
    "PatchingWarning",
    "TLConfig",
    "UnknownNameError",
    "analysis",
    "attention_heatmap",
    "attribution",
    "blas",
    "bundled_models",
    "cache",
    "circuits",
    "cuda_available",
    "cuda_unavailable_reason",
    "explore",
    "from_pretrained",
    "generate",
    "grad",
    "heatmap",
    "hook_name",
    "hook_names",
    "hub",
    "interventions",
    "load",
    "memplan",
    "names",
    "patching",
    "graph",
    "progress",
    "read_only",
    "routing",
    "test_prompt",
]
__version__ = "0.1.0"
