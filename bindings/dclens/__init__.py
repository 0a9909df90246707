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

The package is layers, bottom up (docs/architecture.md, tests/api/test_imports.py):
_core (the engine binding and the plumbing), cache and the analyses Model offers
as methods, model (Model), features (sparse dictionaries), distributed (Ray), viz's figures, analysis (the
rest), viz.explorer, train, cli. The modules' names before the subpackages
(dclens.graph, dclens.patching, dclens.circuits, ...) are the same module
objects under their old names (OLD_NAMES).
"""

import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import sys as _sys
from typing import Any as _Any

from . import analysis, cache, features
from ._core import binding as _binding  # noqa: F401  (the BLAS library, then dclens._engine: a dclens.Error if either fails)
from ._core import blas, hub, memplan, names, progress
from ._core.blas import BlasWarning
from ._core.bundled import BundledModel, bundled_models
from ._core.checks import ArgumentError, ArgumentTypeError, NotFoundError, UnknownNameError
from ._core.hooks import HookPoint, Hooks, read_only
from ._core.names import BRANCHES, PHASES, hook_name, hook_names
from .analysis import attribution, grad, graph, interventions, patching, routing
from .analysis import qkov as circuits
from .analysis.generate import Decoder, generate
from .analysis.patching import PatchingWarning
from .analysis.prompting import test_prompt
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
from .viz.explorer import Explorer, explore
from .viz.heatmaps import PNG, attention_heatmap, heatmap

# dclens.<old name> before the subpackages -> the module it names now. Each
# old name is that module itself (`import dclens.graph`, `from dclens.graph
# import Circuit`, `dclens.graph`); plots (matplotlib) is imported on first use.
OLD_NAMES = {
    "attribution": "analysis.attribution",
    "batch": "_core.batch",
    "blas": "_core.blas",
    "bundled": "_core.bundled",
    "circuits": "analysis.qkov",
    "explorer": "viz.explorer",
    "generate": "analysis.generate",
    "grad": "analysis.grad",
    "graph": "analysis.graph",
    "heatmaps": "viz.heatmaps",
    "hooks": "_core.hooks",
    "hub": "_core.hub",
    "interventions": "analysis.interventions",
    "mask": "_core.mask",
    "memplan": "_core.memplan",
    "names": "_core.names",
    "patching": "analysis.patching",
    "plots": "viz.plots",
    "plugins": "_core.plugins",
    "progress": "_core.progress",
    "prompting": "analysis.prompting",
    "reference": "_core.reference",
    "routing": "analysis.routing",
    "run_record": "train.run_record",
    "runner": "_core.runner",
    "tapes": "_core.tapes",
    "warning_types": "_core.warning_types",
    "weights": "_core.weights",
}


class _OldNames(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """Finds dclens.<old name> not yet imported (plots): the new module itself."""

    def find_spec(self, fullname: str, path: _Any = None, target: _Any = None) -> _Any:
        pkg, _, old = fullname.partition(".")
        if pkg != __name__ or old not in OLD_NAMES:
            return None
        return _importlib_util.spec_from_loader(fullname, self)

    def create_module(self, spec: _Any) -> _Any:
        module = _importlib.import_module(__name__ + "." + OLD_NAMES[spec.name.partition(".")[2]])
        spec.loader_state = module.__spec__  # importlib sets module.__spec__ to this spec: put it back
        return module

    def exec_module(self, module: _Any) -> None:
        module.__spec__ = module.__spec__.loader_state


for _old, _new in OLD_NAMES.items():
    if _old != "plots":  # plots loads matplotlib: on first use (_OldNames, __getattr__)
        _module = _importlib.import_module(__name__ + "." + _new)
        _sys.modules[__name__ + "." + _old] = _module
        globals().setdefault(_old, _module)  # dclens.generate stays the function
_sys.meta_path.append(_OldNames())


def __getattr__(name: str) -> _Any:
    """dclens.plots: imported on first use (it loads matplotlib)."""
    if name in OLD_NAMES:
        return _importlib.import_module(__name__ + "." + name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


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
    "features",
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
