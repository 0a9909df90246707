"""Weights by role, TransformerLens-style (both model types; gpt_neox
checkpoints are mapped onto the canonical dcpythia names by the engine).

Shapes (L layers, N heads, D model dim, Dh head dim, F MLP width, V vocab):

| property | shape | from |
|---|---|---|
| W_E | [V, D] | tok_embeddings.weight |
| W_U | [D, V] | output.weight^T (the embedding^T when tied) |
| W_Q, W_K, W_V | [L, N, D, Dh] | q/k/v rows of attention.wqkv.weight, per head, transposed |
| b_Q, b_K, b_V | [L, N, Dh] | attention.wqkv.bias (zeros without linear bias) |
| W_O | [L, N, Dh, D] | columns n*Dh..(n+1)*Dh of attention.wo.weight, transposed |
| b_O | [L, D] | attention.wo.bias |
| W_in, b_in | [L, D, F], [L, F] | feed_forward.w1 |
| W_out, b_out | [L, F, D], [L, D] | feed_forward.w2 |
| ln_attn_w, ln_attn_b, ln_mlp_w, ln_mlp_b | [L, D] | attention_norm, ffn_norm |
| ln_final_w, ln_final_b | [D] | norm |
| q_norm, k_norm | [L, Dh] | QK-norm scales (DCPythia with use_qk_norm) |
| dyn_w1, dyn_qkw, dyn_dd | per layer as stored, stacked [L, ...] | dyn_w_proj.dw1, qkw, dd (DCMHA) |

x @ W_Q[l, n] + b_Q[l, n] is head n's query (before QK-norm and rotary);
z[n] @ W_O[l, n] is head n's head_out. Each property reads every layer
(a 6.9B model's W_Q is 2 GiB): use model.weight(name) for one tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .checks import Error


class WeightsMixin:
    """Model properties for weights by role (see the module docstring)."""

    if TYPE_CHECKING:  # what the mixin reads of the Model it is mixed into
        runner: Any
        config: Any
        name: str

        def weight(self, name: str) -> np.ndarray: ...

    def weight_names(self) -> list[str]:
        """The canonical names of every weight the model holds."""
        return self.runner.weight_names()

    def _has_weight(self, name: str) -> bool:
        names = self.__dict__.get("_weight_name_set")
        if names is None:
            names = self.__dict__["_weight_name_set"] = frozenset(self.weight_names())
        return name in names

    def _per_layer(self, fmt: str, shape_if_absent=None) -> np.ndarray:
        out = []
        for l in range(self.config.n_layer):
            n = fmt % l
            if self._has_weight(n):
                out.append(np.array(self.weight(n)))
            elif shape_if_absent is not None:
                out.append(np.zeros(shape_if_absent, np.float32))
            else:
                raise Error("%s has no weight %s" % (self.name, n))
        return np.stack(out)

    def _split_heads(self, part: int) -> np.ndarray:
        c = self.config
        D, N, Dh = c.d_model, c.n_head, c.head_dim
        w = self._per_layer("layers.%d.attention.wqkv.weight")  # [L, 3D, D]
        w = w[:, part * D : (part + 1) * D].reshape(c.n_layer, N, Dh, D)
        return np.ascontiguousarray(w.transpose(0, 1, 3, 2))  # [L, N, D, Dh]

    def _split_bias(self, part: int) -> np.ndarray:
        c = self.config
        b = self._per_layer("layers.%d.attention.wqkv.bias", (3 * c.d_model,))
        return b[:, part * c.d_model : (part + 1) * c.d_model].reshape(c.n_layer, c.n_head, c.head_dim)

    @property
    def W_E(self) -> np.ndarray:
        return np.array(self.weight("tok_embeddings.weight"))

    @property
    def W_U(self) -> np.ndarray:
        name = "output.weight" if self._has_weight("output.weight") else "tok_embeddings.weight"
        return np.ascontiguousarray(self.weight(name).T)

    W_Q = property(lambda self: self._split_heads(0))
    W_K = property(lambda self: self._split_heads(1))
    W_V = property(lambda self: self._split_heads(2))
    b_Q = property(lambda self: self._split_bias(0))
    b_K = property(lambda self: self._split_bias(1))
    b_V = property(lambda self: self._split_bias(2))

    @property
    def W_O(self) -> np.ndarray:
        c = self.config
        w = self._per_layer("layers.%d.attention.wo.weight")  # [L, D, D] (out, in)
        w = w.reshape(c.n_layer, c.d_model, c.n_head, c.head_dim)
        return np.ascontiguousarray(w.transpose(0, 2, 3, 1))  # [L, N, Dh, D]

    b_O = property(lambda self: self._per_layer("layers.%d.attention.wo.bias", (self.config.d_model,)))
    W_in = property(
        lambda self: np.ascontiguousarray(self._per_layer("layers.%d.feed_forward.w1.weight").transpose(0, 2, 1))
    )
    b_in = property(lambda self: self._per_layer("layers.%d.feed_forward.w1.bias", (self.config.d_ff,)))
    W_out = property(
        lambda self: np.ascontiguousarray(self._per_layer("layers.%d.feed_forward.w2.weight").transpose(0, 2, 1))
    )
    b_out = property(lambda self: self._per_layer("layers.%d.feed_forward.w2.bias", (self.config.d_model,)))
    ln_attn_w = property(lambda self: self._per_layer("layers.%d.attention_norm.weight"))
    ln_attn_b = property(lambda self: self._per_layer("layers.%d.attention_norm.bias", (self.config.d_model,)))
    ln_mlp_w = property(lambda self: self._per_layer("layers.%d.ffn_norm.weight"))
    ln_mlp_b = property(lambda self: self._per_layer("layers.%d.ffn_norm.bias", (self.config.d_model,)))
    ln_final_w = property(lambda self: np.array(self.weight("norm.weight")))
    ln_final_b = property(
        lambda self: (
            np.array(self.weight("norm.bias"))
            if self._has_weight("norm.bias")
            else np.zeros(self.config.d_model, np.float32)
        )
    )
    q_norm = property(lambda self: self._per_layer("layers.%d.attention.q_norm.scale"))
    k_norm = property(lambda self: self._per_layer("layers.%d.attention.k_norm.scale"))
    dyn_w1 = property(lambda self: self._per_layer("layers.%d.attention.dyn_w_proj.dw1"))
    dyn_qkw = property(lambda self: self._per_layer("layers.%d.attention.dyn_w_proj.qkw"))
    dyn_dd = property(lambda self: self._per_layer("layers.%d.attention.dyn_w_proj.dd"))
