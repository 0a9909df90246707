"""Circuits of a head (Elhage et al. 2021 terms; hooks.md "Circuits").

QK circuit of head n:  W_QK = W_Q,n W_K,n^T  [D, D]  (x_query W_QK x_key^T)
OV circuit of head n:  W_OV = W_V,n W_O,n    [D, D]  (x W_OV is what the head writes)
with W_Q,n = wqkv[q rows of head n]^T [D, Dh] and W_O,n = wo[:, n*Dh:(n+1)*Dh]^T
[Dh, D]. Both are kept factored (A [D, Dh] @ B [Dh, D]); the D x D product is
only formed by .full(). QK-norm and rotary sit between the factors in the real
model; the circuit is the weight-space product, as in the literature.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ._checks import check_index
from .model import Error, Model


@dataclasses.dataclass
class FactoredMatrix:
    """M = A @ B with A [D, r], B [r, D]; never forms M unless asked."""

    A: np.ndarray
    B: np.ndarray

    @property
    def shape(self) -> Tuple[int, int]:
        return self.A.shape[0], self.B.shape[1]

    def full(self) -> np.ndarray:
        return self.A @ self.B

    def singular_values(self) -> np.ndarray:
        """Singular values of A @ B (r of them) via QR of the factors."""
        qa, ra = np.linalg.qr(self.A.astype(np.float64))
        qb, rb = np.linalg.qr(self.B.T.astype(np.float64))
        return np.linalg.svd(ra @ rb.T, compute_uv=False)

    def gram(self) -> np.ndarray:
        """M M^T [D, D] = A (B B^T) A^T."""
        A = self.A.astype(np.float64)
        return A @ (self.B.astype(np.float64) @ self.B.T.astype(np.float64)) @ A.T


def _check(model: Model, layer: int, head: Optional[int] = None) -> None:
    c = model.config
    check_index("layer", layer, 0, c.n_layer, " (model has %d layers)" % c.n_layer)
    if head is not None:
        check_index("head", head, 0, c.n_head, " (model has %d heads)" % c.n_head)


def _wqkv(model: Model, layer: int) -> np.ndarray:
    return model.weight("layers.%d.attention.wqkv.weight" % layer)  # [3D, D]


def qk_circuit(model: Model, layer: int, head: int) -> FactoredMatrix:
    """W_Q,n W_K,n^T as factors [D, Dh] @ [Dh, D]."""
    _check(model, layer, head)
    D, Dh = model.config.d_model, model.config.head_dim
    w = _wqkv(model, layer)
    wq = w[head * Dh : (head + 1) * Dh]  # [Dh, D]
    wk = w[D + head * Dh : D + (head + 1) * Dh]  # [Dh, D]
    return FactoredMatrix(wq.T.copy(), wk.copy())


def ov_circuit(model: Model, layer: int, head: int) -> FactoredMatrix:
    """W_V,n W_O,n as factors [D, Dh] @ [Dh, D]."""
    _check(model, layer, head)
    D, Dh = model.config.d_model, model.config.head_dim
    wv = _wqkv(model, layer)[2 * D + head * Dh : 2 * D + (head + 1) * Dh]  # [Dh, D]
    wo = model.weight("layers.%d.attention.wo.weight" % layer)[:, head * Dh : (head + 1) * Dh]  # [D, Dh]
    return FactoredMatrix(wv.T.copy(), wo.T.copy())


def _layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu(x: np.ndarray) -> np.ndarray:
    from math import erf, sqrt

    return 0.5 * x * (1.0 + np.vectorize(erf)(x / sqrt(2.0)))


def ov_logits(model: Model, layer: int, head: int, tokens) -> np.ndarray:
    """DCFormer Appendix G, Eqn 12, for many tokens at once: [K, V] logits of
    what head `head` of `layer` writes for each token x of `tokens` [K]:

        e = Embed(x); e = e + MLP_0(LN_mlp,0(e)); logits = Unembed(LN_attn,l(e) W_V,n W_O,n).

    Biases of V/O are left out (a circuit is the weight product)."""
    _check(model, layer, head)
    c = model.config
    toks = np.atleast_1d(np.asarray(tokens))
    if toks.ndim != 1 or toks.size == 0 or toks.dtype.kind not in "iu":
        raise Error("ov_logits: tokens must be a non-empty 1-D sequence of token ids")
    for t in toks:
        check_index("token id", int(t), 0, c.vocab)
    e = model.weight("tok_embeddings.weight")[toks].astype(np.float64)  # [K, D]
    ln = lambda x, name: _layernorm(x, model.weight(name + ".weight"), model.weight(name + ".bias"), c.norm_eps)
    h = ln(e, "layers.0.ffn_norm")
    w1, w2 = model.weight("layers.0.feed_forward.w1.weight"), model.weight("layers.0.feed_forward.w2.weight")
    u = h @ w1.T.astype(np.float64)
    if c.linear_bias:
        u = u + model.weight("layers.0.feed_forward.w1.bias")
    mlp = _gelu(u) @ w2.T.astype(np.float64)
    if c.linear_bias:
        mlp = mlp + model.weight("layers.0.feed_forward.w2.bias")
    e = e + mlp
    ov = ov_circuit(model, layer, head)
    out = (ln(e, "layers.%d.attention_norm" % layer) @ ov.A) @ ov.B  # [K, D]
    # the unembedding: output.weight, or the embedding when tied (no output.weight then)
    unembed = "output.weight" if "output.weight" in model.weight_names() else "tok_embeddings.weight"
    return out.astype(np.float32) @ model.weight(unembed).T  # [K, V]


def ov_readout(model: Model, layer: int, head: int, token: int, k: int = 10) -> List[Tuple[int, float]]:
    """DCFormer Appendix G, Eqn 12: what head n's OV circuit writes for `token`
    (see ov_logits). Returns the top-k (token id, logit) pairs."""
    c = model.config
    token = check_index("token id", token, 0, c.vocab)
    logits = ov_logits(model, layer, head, [token])[0]
    top = np.argsort(-logits)[:k]
    return [(int(t), float(logits[t])) for t in top]


def head_diversity(model: Model, layer: int, kind: str = "qk") -> float:
    """DCFormer Figure 5 (after Cordonnier et al. 2020): concatenate the layer's
    per-head QK (or OV) matrices [D, N*D], take principal components, and return
    the mean cumulative captured variance (mean over k of the fraction of
    variance in the top k components). Lower means more diverse heads."""
    _check(model, layer)
    curve = diversity_curve(model, layer, kind)
    return float(curve.mean())


def diversity_curve(model: Model, layer: int, kind: str = "qk") -> np.ndarray:
    """Cumulative captured variance [D] of the concatenated per-head matrices."""
    if kind not in ("qk", "ov"):
        raise Error("kind must be 'qk' or 'ov', not %r" % (kind,))
    f = qk_circuit if kind == "qk" else ov_circuit
    G = sum(f(model, layer, n).gram() for n in range(model.config.n_head))  # [D, D] = M M^T
    ev = np.clip(np.linalg.eigvalsh(G)[::-1], 0, None)
    total = ev.sum()
    if total <= 0:
        return np.ones_like(ev)
    return np.cumsum(ev) / total
