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
import math

import numpy as np

from .._core.checks import ArgumentError, check_index, is_choice, token_array
from ..model import Error, Model


@dataclasses.dataclass
class FactoredMatrix:
    """M = A @ B with A [D, r], B [r, D]; never forms M unless asked.

    Parameters
    ----------
    A : numpy.ndarray
        [D, r], the left factor (a 2-D array of numbers).
    B : numpy.ndarray
        [r, D'], the right factor (its rows: A's columns).

    Raises
    ------
    dclens.Error
        A or B is not a 2-D numeric array, or A's columns are not B's rows.
    """

    A: np.ndarray
    B: np.ndarray

    def __post_init__(self):
        for what in ("A", "B"):
            v = getattr(self, what)
            if not isinstance(v, np.ndarray) or v.ndim != 2 or v.dtype.kind not in "fiu":
                raise Error(
                    "FactoredMatrix: %s must be a 2-D array of numbers, not %s"
                    % (what, v.shape if isinstance(v, np.ndarray) else type(v).__name__)
                )
        if self.A.shape[1] != self.B.shape[0]:
            raise Error(
                "FactoredMatrix: A %s and B %s do not chain (A's columns must be B's rows)"
                % (self.A.shape, self.B.shape)
            )

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of M = A @ B: (A's rows, B's columns), without forming M."""
        return self.A.shape[0], self.B.shape[1]

    def full(self) -> np.ndarray:
        """The product formed.

        Returns
        -------
        numpy.ndarray
            M = A @ B, [D, D'] in the factors' dtype.
        """
        return self.A @ self.B

    def singular_values(self) -> np.ndarray:
        """Singular values of A @ B via QR of the factors (M is never formed).

        Returns
        -------
        numpy.ndarray
            [r] float64, descending (r: the inner dimension).
        """
        qa, ra = np.linalg.qr(self.A.astype(np.float64))
        qb, rb = np.linalg.qr(self.B.T.astype(np.float64))
        return np.linalg.svd(ra @ rb.T, compute_uv=False)

    def gram(self) -> np.ndarray:
        """M M^T = A (B B^T) A^T, without forming M.

        Returns
        -------
        numpy.ndarray
            [D, D] float64.
        """
        A = self.A.astype(np.float64)
        return A @ (self.B.astype(np.float64) @ self.B.T.astype(np.float64)) @ A.T


_NO_HEAD = object()


def _check(model: Model, layer: int, head=_NO_HEAD) -> None:
    c = model.config
    check_index("layer", layer, 0, c.n_layer, " (model has %d layers)" % c.n_layer)
    if head is not _NO_HEAD:
        check_index("head", head, 0, c.n_head, " (model has %d heads)" % c.n_head)


def _head_rows(model: Model, layer: int, head: int, part: int) -> np.ndarray:
    """Head `head`'s rows [Dh, D] of the layer's wqkv [3D, D]: part 0 W_Q, 1 W_K, 2 W_V
    (layer and head checked)."""
    _check(model, layer, head)
    D, Dh = model.config.d_model, model.config.head_dim
    w = model.weight("layers.%d.attention.wqkv.weight" % layer)  # [3D, D]
    return w[part * D + head * Dh : part * D + (head + 1) * Dh]


def qk_circuit(model: Model, layer: int, head: int) -> FactoredMatrix:
    """The QK circuit of a head: W_Q,n W_K,n^T, kept factored.

    x_query W_QK x_key^T is the head's score before rotary and QK-norm (the circuit is the
    weight-space product).

    Parameters
    ----------
    model : dclens.Model
        The model whose query and key weights are read.
    layer : int
        The head's layer, in [0, n_layer).
    head : int
        The head, in [0, n_head).

    Returns
    -------
    FactoredMatrix
        A = W_Q,n [D, Dh], B = W_K,n^T [Dh, D].

    Raises
    ------
    dclens.ArgumentError
        A layer or head out of range (dclens.ArgumentTypeError: not an integer).
    """
    wq = _head_rows(model, layer, head, 0)  # [Dh, D]
    wk = _head_rows(model, layer, head, 1)  # [Dh, D]
    return FactoredMatrix(wq.T.copy(), wk.copy())


def ov_circuit(model: Model, layer: int, head: int) -> FactoredMatrix:
    """The OV circuit of a head: W_V,n W_O,n, kept factored (x W_OV is what the head writes).

    Parameters
    ----------
    model : dclens.Model
        The model whose value and output weights are read.
    layer : int
        The layer, in [0, n_layer).
    head : int
        The head, in [0, n_head).

    Returns
    -------
    FactoredMatrix
        A = W_V,n [D, Dh], B = W_O,n [Dh, D].

    Raises
    ------
    dclens.ArgumentError
        A layer or head out of range (dclens.ArgumentTypeError: not an integer).
    """
    wv = _head_rows(model, layer, head, 2)  # [Dh, D]
    Dh = model.config.head_dim
    wo = model.weight("layers.%d.attention.wo.weight" % layer)[:, head * Dh : (head + 1) * Dh]  # [D, Dh]
    return FactoredMatrix(wv.T.copy(), wo.T.copy())


def _layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _swiglu_hidden(model: Model, layer: int, h: np.ndarray, u: np.ndarray) -> np.ndarray:
    """A SwiGLU MLP's hidden units (DCFormer++): silu(u) * (h w3^T), each of
    the mgate_dim groups scaled by softmax(h mg^T) when the gate is on."""
    c = model.config
    p = "layers.%d.feed_forward." % layer
    hid = u / (1.0 + np.exp(-u)) * (h @ model.weight(p + "w3.weight").T.astype(np.float64))
    if c.mgate_dim:
        g = h @ model.weight(p + "mg.weight").T.astype(np.float64)  # [K, E]
        g = np.exp(g - g.max(-1, keepdims=True))
        g /= g.sum(-1, keepdims=True)
        hid = (hid.reshape(len(h), c.mgate_dim, -1) * g[:, :, None]).reshape(hid.shape)
    return hid


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _norm(model: Model, x: np.ndarray, name: str) -> np.ndarray:
    """The block norm `name` ("layers.{l}.attention_norm" / "ffn_norm") of x [K, D], float64."""
    c = model.config
    if c.norm == "rms":  # DCFormer++: RMSNorm, a weight only
        return _rmsnorm(x, model.weight(name + ".weight"), c.norm_eps)
    return _layernorm(x, model.weight(name + ".weight"), model.weight(name + ".bias"), c.norm_eps)


def _mlp(model: Model, layer: int, x: np.ndarray) -> np.ndarray:
    """MLP `layer`'s output for the residual x [K, D] it reads (its norm applied here), float64."""
    c = model.config
    p = "layers.%d.feed_forward." % layer
    h = _norm(model, x, "layers.%d.ffn_norm" % layer)
    u = h @ model.weight(p + "w1.weight").T.astype(np.float64)
    if c.linear_bias:
        u = u + model.weight(p + "w1.bias")
    hid = _swiglu_hidden(model, layer, h, u) if c.mlp == "swiglu" else _gelu(u)
    out = hid @ model.weight(p + "w2.weight").T.astype(np.float64)
    if c.linear_bias:
        out = out + model.weight(p + "w2.bias")
    return out


# what ov_logits / ov_readout feed a head for a token (see ov_logits)
OV_INPUTS = ("direct", "paper", "prompt")


def ov_input(model: Model, layer: int, tokens, resid: str = "direct") -> np.ndarray:
    """The residual (before the head's norm) that ov_logits feeds the heads of a layer.

    Parameters
    ----------
    model : dclens.Model
        The model whose embedding (and earlier blocks) give the residual.
    layer : int
        The layer whose heads read it, in [0, n_layer).
    tokens : array_like of int
        [K] token ids (or one id).
    resid : {"direct", "paper", "prompt"}
        Which residual r(x): see ov_logits.

    Returns
    -------
    numpy.ndarray
        [K, D] float64, one row per token.

    Raises
    ------
    dclens.ArgumentError
        An unknown `resid`, tokens that are not a non-empty 1-D sequence of integers, or a
        layer or token id out of range.
    """
    c = model.config
    check_index("layer", layer, 0, c.n_layer, " (model has %d layers)" % c.n_layer)
    if not is_choice(resid, OV_INPUTS):
        raise ArgumentError("resid must be one of %s, not %r" % (", ".join(repr(r) for r in OV_INPUTS), resid))
    toks = token_array(tokens)
    toks = np.atleast_1d(toks)
    if toks.ndim != 1 or toks.size == 0 or toks.dtype.kind not in "iu":
        raise ArgumentError("tokens must be a non-empty 1-D sequence of token ids, got %r" % (tokens,))
    for t in toks:
        check_index("token id", int(t), 0, c.vocab)
    if resid == "prompt":  # each token alone as a prompt: the engine's residual entering `layer`
        _, cache = model.run_with_cache(toks[:, None], names=["blocks.%d.resid_pre" % layer])
        return np.asarray(cache["blocks.%d.resid_pre" % layer], np.float64).reshape(len(toks), c.d_model)
    e = model.weight("tok_embeddings.weight")[toks].astype(np.float64)  # [K, D]
    if resid == "paper":  # Eqn 12 as printed: MLP 0 added whatever the layer
        return e + _mlp(model, 0, e)
    # the token's direct path: attention of `layer` reads the block input in both layouts,
    # which holds the outputs of MLPs 0 .. layer-1 (not MLP `layer`: parallel, it reads the
    # same input; sequential, it comes after the attention). On this path MLP k reads the
    # running residual: with the parallel residual that is its block input; a sequential
    # block's MLP also reads its attention's output, which needs a context and is left out.
    for k in range(layer):
        e = e + _mlp(model, k, e)
    return e


def ov_logits(model: Model, layer: int, head: int, tokens, *, resid: str = "direct") -> np.ndarray:
    """The OV read-out (DCFormer Appendix G, Eqn 12) for many tokens at once:
    [K, V] logits of what head `head` of `layer` writes when it attends to a
    token x of `tokens` [K] and nothing else,

        logits = Unembed(LN_attn,layer(r(x)) W_V,n W_O,n)

    with r(x) the residual the head reads for x (biases of V/O are left out:
    a circuit is the weight product). `resid` chooses r(x):

    "direct" (default): what the head really reads along the token's own path,
        without attention (which needs a context): the embedding plus the
        outputs of MLPs 0 .. layer-1, each applied to the residual it reads on
        that path. Attention of block l reads the block input in both residual
        layouts (model.config.parallel_residual: attention and MLP read it side
        by side; sequential: the MLP comes after the attention), so MLP l is
        never part of it, and a layer-0 head reads the bare embedding. For
        layer 1 this is Eqn 12.
    "paper": Eqn 12 as printed, e = Embed(x) + MLP_0(LN_mlp,0(Embed(x))) at
        every layer. At layer 0 no head reads this: MLP 0 runs beside (parallel
        residual) or after (sequential) the layer-0 attention.
    "prompt": the residual entering `layer` when x alone is the prompt (a
        forward pass of the engine, every earlier block including each layer's
        attention of x to itself).

    On the bundled models the "direct" read-out is the closest of the three to
    what the head writes in context (docs/api.md, "OV read-out").

    Parameters
    ----------
    model : dclens.Model
        The model: its OV circuits, then the unembedding.
    layer : int
        The layer, in [0, n_layer).
    head : int
        The head, in [0, n_head).
    tokens : array_like of int
        [K] token ids (or one id).
    resid : {"direct", "paper", "prompt"}
        Which residual r(x) the head reads, as above.

    Returns
    -------
    numpy.ndarray
        [K, V] float32 logits, one row per token.

    Raises
    ------
    dclens.ArgumentError
        A layer, head or token id out of range, an unknown `resid`, or tokens that are not
        a non-empty 1-D sequence of integers.
    """
    _check(model, layer, head)
    x = ov_input(model, layer, tokens, resid)
    ov = ov_circuit(model, layer, head)
    out = (_norm(model, x, "layers.%d.attention_norm" % layer) @ ov.A) @ ov.B  # [K, D]
    # the unembedding: output.weight, or the embedding when tied (no output.weight then)
    unembed = "output.weight" if "output.weight" in model.weight_names() else "tok_embeddings.weight"
    return out.astype(np.float32) @ model.weight(unembed).T  # [K, V]


def ov_readout(
    model: Model, layer: int, head: int, token, k: int = 10, *, resid: str = "direct"
) -> list[tuple[int, float]]:
    """What head n's OV circuit writes for `token` (an id, or a string that is
    one token): the top-k (token id, logit) pairs of ov_logits, which says
    what the head reads (`resid`: "direct", the default, the input the head
    really reads; "paper", Eqn 12 as printed; "prompt", the token alone as a
    prompt).

    Parameters
    ----------
    model : dclens.Model
        The model.
    layer : int
        The layer, in [0, n_layer).
    head : int
        The head, in [0, n_head).
    token : int or str
        A token id, or a string that is exactly one token.
    k : int
        How many tokens to give (>= 1).
    resid : {"direct", "paper", "prompt"}
        Which residual the head reads (ov_logits).

    Returns
    -------
    list of tuple
        The top-k (token id, logit) pairs, largest logit first.

    Raises
    ------
    dclens.Error
        A string that is not one token, a token id, layer or head out of range, k below 1,
        or an unknown `resid`.
    """
    c = model.config
    if isinstance(token, str):
        token = model.to_single_token(token)
    token = check_index("token id", token, 0, c.vocab)
    k = check_index("k", k, 1, 2**31)
    logits = ov_logits(model, layer, head, [token], resid=resid)[0]
    top = np.argsort(-logits, kind="stable")[:k]
    return [(int(t), float(logits[t])) for t in top]


def head_diversity(model: Model, layer: int, kind: str = "qk") -> float:
    """DCFormer Figure 5 (after Cordonnier et al. 2020): concatenate the layer's
    per-head QK (or OV) matrices [D, N*D], take principal components, and return
    the mean cumulative captured variance (mean over k of the fraction of
    variance in the top k components). Lower means more diverse heads.

    Parameters
    ----------
    model : dclens.Model
        The model whose per-head circuits are compared.
    layer : int
        The layer, in [0, n_layer).
    kind : {"qk", "ov"}
        The QK or the OV circuits.

    Returns
    -------
    float
        The mean of diversity_curve, in (0, 1].

    Raises
    ------
    dclens.Error
        A layer out of range, or an unknown kind.
    """
    _check(model, layer)
    curve = diversity_curve(model, layer, kind)
    return float(curve.mean())


def diversity_curve(model: Model, layer: int, kind: str = "qk") -> np.ndarray:
    """Cumulative captured variance of a layer's concatenated per-head circuit matrices.

    Parameters
    ----------
    model : dclens.Model
        The model.
    layer : int
        The layer whose heads' circuits are stacked, in [0, n_layer).
    kind : {"qk", "ov"}
        The QK or the OV circuits.

    Returns
    -------
    numpy.ndarray
        [D] float64: entry k-1 is the fraction of the variance in the top k principal
        components of [M_0, ..., M_{N-1}] ([D, N*D]); all ones when the matrices are zero.

    Raises
    ------
    dclens.Error
        An unknown kind, or a layer out of range.
    """
    if not is_choice(kind, ("qk", "ov")):
        raise Error("kind must be 'qk' or 'ov', not %r" % (kind,))
    f = qk_circuit if kind == "qk" else ov_circuit
    G = sum(f(model, layer, n).gram() for n in range(model.config.n_head))  # [D, D] = M M^T
    ev = np.clip(np.linalg.eigvalsh(G)[::-1], 0, None)
    total = ev.sum()
    if total <= 0:
        return np.ones_like(ev)
    return np.cumsum(ev) / total
