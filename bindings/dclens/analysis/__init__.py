"""The analyses: what dclens computes from a loaded model.

Offered as Model methods, below Model (they import only dclens._core and
dclens.cache): grad (gradients of a pass), attribution (gradient x
activation per hook), routing (composition maps, routing, flows, gates),
generate (incremental decoding).

Built on Model: heads (head diversity, redundancy, composition statistics,
MoH load over a dataset), qkov (QK / OV circuits), interventions, patching,
graph (the edge graph of heads, MLPs and composition edges: EAP, EAP-IG,
edge and path patching), prompting (test_prompt).

``dclens.analysis.head_output_pca`` and the other names of heads stay the
names of this package (``from dclens import analysis`` before the
subpackages): they are looked up on first use, because Model imports grad
and routing from this package before Model exists, and heads needs Model."""

from __future__ import annotations

import importlib
from typing import Any

# heads' public names (heads.__all__; tests/api check that the two agree)
_HEADS = frozenset(
    [
        "CompositionStats",
        "PCAResult",
        "composition_stats",
        "head_load",
        "head_output_pca",
        "head_similarity",
        "iter_dataset",
        "plot_composition_stats",
        "plot_diversity",
        "plot_head_load",
        "plot_pca",
        "plot_similarity",
        "qk_ov_diversity",
    ]
)


def __getattr__(name: str) -> Any:
    if name in _HEADS:
        return getattr(importlib.import_module(__name__ + ".heads"), name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HEADS))
