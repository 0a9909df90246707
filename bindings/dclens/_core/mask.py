"""The attention mask, written once: which keys a query sees.

Query t sees key s when s <= t (causal) and, on a local layer with window
w > 0, when t - s <= w (the engine's dcs_allowed). A layer's window is the
one the engine decided at load (model.plan[layer].window; 0 on a global
layer). Everything in dclens that hides, zeroes or leaves out masked cells
asks these two functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def allowed(T: int, S: int, window: int = 0, t0: int = 0) -> np.ndarray:
    """[T, S] bool: True where query t, at position t0 + t, may see key s:
    s <= t0 + t and, with window > 0, t0 + t - s <= window."""
    t = np.arange(t0, t0 + T)[:, None]
    s = np.arange(S)[None, :]
    return (s <= t) & ((window <= 0) | (t - s <= window))


def layer_window(model: Any, layer: int) -> int:
    """The attention window of a layer of a model, from its layer plan (0: a
    global layer, or a layer the model does not have)."""
    plan = model.plan
    return int(plan[layer].window) if 0 <= layer < len(plan) else 0
