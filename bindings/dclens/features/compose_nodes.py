"""The compose nodes of an attribution graph: how much a layer's dynamic-weight input at a
position moves a logit (docs/features.md, "Compose nodes").

The replacement model freezes each layer's composed pattern, so the DCMHA compose is a
constant there and the features that *set* the composition get no edge. A compose node
(layer l, position p) opens it again for one layer at a time: the gradient of a logit with
respect to u = blocks.{l}.ln_attn[p], the normed residual the dynamic-weight MLP reads (its
query-side and key-side weights: model-spec.md 2, steps 4 and 6-9), through

    u -> dynamic weights (pre and post) -> pre-compose -> mask, softmax -> post-compose
      -> z = P' v -> the head outputs -> the frozen-linear model above layer l -> the logit,

everything else (q, k, v, the norms' scales, the other layers) held at the clean run. The
node's value is that gradient against u's frozen-norm part (u without its bias), its
first-order contribution; edges *into* it are the direct effects of the features, errors and
embeddings on that quantity, in the same frozen-linear model as every other edge.

DCPythia's compose with one group (compose_groups 1), no static branch and no key-wise-only
variant: the others are refused by name.
"""

from __future__ import annotations

import math

import numpy as np

from .._core.checks import Error

_EPS_W1 = 1e-6  # the RMS norm of w1 over heads (model-spec.md 2, step 4)


def check_supported(c) -> None:
    """Refuse, by name, the compose variants whose backward is not written here.

    Parameters
    ----------
    c : dclens.Config
        The model's configuration.

    Raises
    ------
    dclens.Error
        A model without DCMHA, or one with compose_groups > 1, the static branch (use_sw),
        key-wise composition, Mixture-of-Head routing or DCFormer++'s layout.
    """
    if not c.use_dcmha:
        raise Error("compose nodes: the model has no DCMHA compose (pass compose=False)")
    bad = [
        name
        for name, on in (
            ("compose_groups > 1", c.compose_groups != 1),
            ("use_sw (the static branch)", c.use_sw),
            ("key_wise", c.key_wise),
            ("Mixture-of-Head routing", c.moh_shared_heads is not None),
            ("DCFormer++ (model_type dcformer)", c.model_type == "dcformer"),
        )
        if on
    ]
    if bad:
        raise Error("compose nodes: not written for %s; pass compose=False" % ", ".join(bad))


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _gelu_grad(x: np.ndarray) -> np.ndarray:
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    return cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def dyn_forward(model, layer: int, u: np.ndarray) -> dict:
    """Layer `layer`'s dynamic weights from u [T, D] (float64), and what their backward needs.

    Parameters
    ----------
    model : dclens.Model
        A DCPythia model (check_supported).
    layer : int
        The layer.
    u : numpy.ndarray
        [T, D] the normed residual (blocks.{layer}.ln_attn).

    Returns
    -------
    dict
        "pre" and "post": each a dict of qw1 (after its norm), qw2, kw1, kw2 [T, R, N], qdd,
        kdd [T, N] (the hooks attn.dyn.{phase}.*); "h" [T, 4, K] (before gelu), "w" [T, 4, 2R, N]
        (before the norm), "dd" [T, 4, N] (before tanh).
    """
    c = model.config
    p = "layers.%d.attention.dyn_w_proj." % layer
    dw1 = model.weight(p + "dw1").astype(np.float64)[:, 0]  # [D, 4, K]
    qkw = model.weight(p + "qkw").astype(np.float64)[0]  # [4, K, 2R, N]
    ddw = model.weight(p + "dd").astype(np.float64)[:, 0]  # [D, 4N]
    R, N, T = c.dyn_rank, c.n_head, len(u)
    h = np.einsum("td,dck->tck", u, dw1)
    w = np.einsum("tck,ckjn->tcjn", _gelu(h), qkw)
    w1 = w[:, :, :R]
    w1n = w1 / np.sqrt((w1 * w1).mean(-1, keepdims=True) + _EPS_W1)
    dd = (u @ ddw).reshape(T, 4, N)
    gate = np.tanh(dd)
    out = {"h": h, "w": w, "dd": dd}
    for phase, (qs, ks) in (("pre", (0, 1)), ("post", (2, 3))):
        out[phase] = {
            "qw1": w1n[:, qs],
            "qw2": w[:, qs, R:],
            "kw1": w1n[:, ks],
            "kw2": w[:, ks, R:],
            "qdd": gate[:, qs],
            "kdd": gate[:, ks],
        }
    return out


def _compose_back(X: np.ndarray, gY: np.ndarray, dw: dict, key_side: bool) -> tuple[np.ndarray, dict]:
    """One phase's compose Y = X + qp + kp + qg + kg ([N, T, S] each, model-spec.md 2 step 6),
    transposed: gY -> (gX, the gradients of its dynamic weights by name)."""
    qw1, qw2, qdd = dw["qw1"], dw["qw2"], dw["qdd"]
    a_q = np.einsum("nts,tin->its", X, qw1)
    b_q = np.einsum("mts,tim->its", gY, qw2)
    g = {
        "qw2": np.einsum("mts,its->tim", gY, a_q),
        "qw1": np.einsum("nts,its->tin", X, b_q),
        "qdd": np.einsum("mts,mts->tm", gY, X),
    }
    gX = gY * (1.0 + qdd.T[:, :, None]) + np.einsum("tin,its->nts", qw1, b_q)
    if key_side:
        kw1, kw2, kdd = dw["kw1"], dw["kw2"], dw["kdd"]
        a_k = np.einsum("nts,sin->its", X, kw1)
        b_k = np.einsum("mts,sim->its", gY, kw2)
        g["kw2"] = np.einsum("mts,its->sim", gY, a_k)
        g["kw1"] = np.einsum("nts,its->sin", X, b_k)
        g["kdd"] = np.einsum("mts,mts->sm", gY, X)
        gX = gX + gY * kdd.T[:, None, :] + np.einsum("sin,its->nts", kw1, b_k)
    return gX, g


def _dyn_back(model, layer: int, fw: dict, grads: dict, u_shape) -> np.ndarray:
    """The dynamic-weight MLP transposed: the gradients of its outputs (grads[phase][name])
    -> the gradient at u [T, D]."""
    c = model.config
    R, N = c.dyn_rank, c.n_head
    p = "layers.%d.attention.dyn_w_proj." % layer
    dw1 = model.weight(p + "dw1").astype(np.float64)[:, 0]  # [D, 4, K]
    qkw = model.weight(p + "qkw").astype(np.float64)[0]  # [4, K, 2R, N]
    ddw = model.weight(p + "dd").astype(np.float64)[:, 0]  # [D, 4N]
    w = fw["w"]
    g_w1n, g_w = np.zeros_like(w[:, :, :R]), np.zeros_like(w)
    g_gate = np.zeros_like(fw["dd"])
    for phase, (qs, ks) in (("pre", (0, 1)), ("post", (2, 3))):
        gp = grads[phase]
        g_w1n[:, qs], g_w[:, qs, R:], g_gate[:, qs] = gp["qw1"], gp["qw2"], gp["qdd"]
        if "kw1" in gp:
            g_w1n[:, ks], g_w[:, ks, R:], g_gate[:, ks] = gp["kw1"], gp["kw2"], gp["kdd"]
    w1 = w[:, :, :R]
    r = np.sqrt((w1 * w1).mean(-1, keepdims=True) + _EPS_W1)  # [T, 4, R, 1]
    g_w[:, :, :R] = g_w1n / r - w1 * (g_w1n * w1).sum(-1, keepdims=True) / (N * r**3)
    g_h = np.einsum("tcjn,ckjn->tck", g_w, qkw) * _gelu_grad(fw["h"])
    g_dd = (g_gate * (1.0 - np.tanh(fw["dd"]) ** 2)).reshape(u_shape[0], -1)
    return np.einsum("tck,dck->td", g_h, dw1) + g_dd @ ddw.T


def compose_grad(rep, layer: int, G_out: np.ndarray) -> np.ndarray:
    """Gradients at u = blocks.{layer}.ln_attn through layer `layer`'s compose alone
    (compose_backward's first part).

    Parameters
    ----------
    rep : Replacement
        The replacement model, made with compose=True.
    layer : int
        The layer whose compose is opened.
    G_out : numpy.ndarray
        [K, T, D] the gradients of K targets at the residual the layer's attention writes
        (the level above it with the parallel residual), in the frozen-linear model.

    Returns
    -------
    numpy.ndarray
        [K, T, D] float64: each target's gradient with respect to u, through the dynamic
        weights of both phases (the rest of the pass frozen).
    """
    return compose_backward(rep, layer, G_out)[0]


def compose_backward(rep, layer: int, G_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """compose_grad, and the gradients at the layer's composed scores on the way.

    Parameters
    ----------
    rep : Replacement
        The replacement model, made with compose=True.
    layer : int
        The layer.
    G_out : numpy.ndarray
        [K, T, D], as for compose_grad.

    Returns
    -------
    tuple of numpy.ndarray
        (g_u [K, T, D] as compose_grad's, g_scores [K, N, T, S]: each target's gradient at
        attn.scores_composed, the pre-compose's output, through the mask and softmax and the
        post-compose; zero where masked).
    """
    c = rep.c
    key_side = not c.query_wise
    x = rep.extra
    hk = "blocks.%d." % layer
    u, A = x[hk + "ln_attn"], x[hk + "attn.scores"]
    P, v = x[hk + "attn.pattern"], x[hk + "attn.v"]  # [N, T, S], [S, N, Dh]
    fw = dyn_forward(rep.model, layer, u)
    N, Dh = c.n_head, c.head_dim
    out = np.empty(G_out.shape)
    g_scores = np.empty((G_out.shape[0],) + A.shape)
    for k in range(G_out.shape[0]):
        gz = (G_out[k] @ rep.Wo[layer]).reshape(rep.T, N, Dh)  # [T, N, Dh]
        gPc = np.einsum("tnd,snd->nts", gz, v)  # at the composed pattern P'
        gP, g_post = _compose_back(P, gPc, fw["post"], key_side)
        gAc = P * (gP - (P * gP).sum(-1, keepdims=True))  # softmax (masked entries: P = 0)
        _, g_pre = _compose_back(A, gAc, fw["pre"], key_side)
        out[k] = _dyn_back(rep.model, layer, fw, {"pre": g_pre, "post": g_post}, u.shape)
        g_scores[k] = gAc
    return out, g_scores
