"""The lending nodes of an attribution graph: head m's QK circuit read by head n through the
pre-compose's projection branches (docs/attribution-graphs.md, "Lending nodes").

In DCMHA's pre-compose (model-spec.md 2, step 6) head n's composed score borrows every
other head's raw score:

    A'[n, t, s] = A[n, t, s] (1 + qdd + kdd) + sum_m C[m, n, t, s] A[m, t, s],
    C[m, n, t, s] = sum_i qw1[t, i, m] qw2[t, i, n] + sum_i kw1[s, i, m] kw2[s, i, n]

(the qp and kp branches). A lending node (layer l, lender m, borrower n != m) is that term
for one pair of heads, weighed by what it does to the logits:

    V[m, n] = sum_{t, s} H[n, t, s] C[m, n, t, s] A[m, t, s],

H the gradient of the logit at head n's composed score (through the mask, softmax and
post-compose of layer l, the frozen-linear model above it: compose_nodes.compose_backward).
V is the first-order effect of removing the lending (C[m, n] = 0) on the logit. It is
bilinear in head m's queries and keys, A[m, t, s] = q_m[t] . k_m[s] / sqrt(Dh); its
incoming edges are first order too: a source's activation times its decoder vector dotted
with the gradient of V at the residual it writes, through q_m and k_m (rotary, QK-norm with
its scale frozen, the frozen attention norm) and the frozen-linear model below layer l.
"""

from __future__ import annotations

import numpy as np

from .compose_nodes import dyn_forward

_EPS_QK = 1e-6  # QK-norm's (model-spec.md 2, step 2)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool = False) -> np.ndarray:
    """GPT-NeoX's rotate-half rotary on the first 2h dims of x [T, N, Dh] (cos, sin [T, h]);
    inverse: the transpose (the rotation by minus the angle)."""
    h = cos.shape[1]
    if h == 0:
        return x
    s = -sin if inverse else sin
    c, s = cos[:, None, :], s[:, None, :]
    out = x.copy()
    a, b = x[..., :h], x[..., h : 2 * h]
    out[..., :h] = a * c - b * s
    out[..., h : 2 * h] = a * s + b * c
    return out


class QK:
    """Layer l's queries and keys as the replacement model sees them: from the frozen
    attention norm's output (blocks.{l}.ln_attn), QK-norm with its scale frozen, rotary.

    Parameters
    ----------
    rep : Replacement
        Made with compose=True (it keeps ln_attn).
    layer : int
        The layer.

    Attributes
    ----------
    q, k : numpy.ndarray
        [T, N, Dh] float64: what attn.q / attn.k hold.
    """

    def __init__(self, rep, layer: int):
        c, m = rep.c, rep.model
        D, N, Dh, T = c.d_model, c.n_head, c.head_dim, rep.T
        self.rep, self.layer = rep, layer
        p = "layers.%d.attention." % layer
        w = m.weight(p + "wqkv.weight").astype(np.float64)  # [3D, D]
        self.Wq, self.Wk = w[:D].reshape(N, Dh, D), w[D : 2 * D].reshape(N, Dh, D)
        u = rep.extra["blocks.%d.ln_attn" % layer]  # [T, D]
        qr, kr = u @ w[:D].T, u @ w[D : 2 * D].T
        if c.linear_bias:
            b = m.weight(p + "wqkv.bias").astype(np.float64)
            qr, kr = qr + b[:D], kr + b[D : 2 * D]
        qr, kr = qr.reshape(T, N, Dh), kr.reshape(T, N, Dh)
        self.scale_q = self.scale_k = None
        if c.qk_norm:
            self.rho_q = np.sqrt((qr * qr).mean(-1) + _EPS_QK)  # [T, N], frozen
            self.rho_k = np.sqrt((kr * kr).mean(-1) + _EPS_QK)
            self.scale_q = m.weight(p + "q_norm.scale").astype(np.float64)
            self.scale_k = m.weight(p + "k_norm.scale").astype(np.float64)
            qr = qr / self.rho_q[..., None] * self.scale_q
            kr = kr / self.rho_k[..., None] * self.scale_k
        h = c.rotary_dim // 2
        ang = np.arange(T)[:, None] * c.rope_base ** (-2.0 * np.arange(h) / max(c.rotary_dim, 1))
        self.cos, self.sin = np.cos(ang), np.sin(ang)
        self.q, self.k = _rotate(qr, self.cos, self.sin), _rotate(kr, self.cos, self.sin)
        self.scores = np.einsum("tnd,snd->nts", self.q, self.k) / np.sqrt(Dh)  # [N, T, S]

    def grad(self, head: int, G: np.ndarray) -> np.ndarray:
        """The gradient at the residual (the layer's level) of sum_{t,s} G[t, s] A[head, t, s],
        G [T, S] (A's other factors held): through k and q, rotary, frozen QK-norm, wqkv and
        the frozen attention norm. Returns [T, D]."""
        Dh = self.rep.c.head_dim
        gq = (G @ self.k[:, head]) / np.sqrt(Dh)  # [T, Dh]
        gk = (G.T @ self.q[:, head]) / np.sqrt(Dh)  # [S, Dh]
        g = []
        for gx, scale, rho, W in ((gq, self.scale_q, "rho_q", self.Wq), (gk, self.scale_k, "rho_k", self.Wk)):
            gx = _rotate(gx[:, None], self.cos, self.sin, inverse=True)[:, 0]
            if scale is not None:
                gx = gx * scale / getattr(self, rho)[:, head, None]
            g.append(gx @ W[head])  # [T, D]
        return self.rep.norm_T(("attn", self.layer), g[0] + g[1])


def lend_maps(model, layer: int, u: np.ndarray, key_side: bool) -> np.ndarray:
    """C[m, n, t, s] of the pre-compose's qp and kp branches, [N, N, T, S] (the lender first),
    from the dynamic weights of u [T, D] (blocks.{layer}.ln_attn)."""
    pre = dyn_forward(model, layer, u)["pre"]
    C = np.einsum("tim,tin->mnt", pre["qw1"], pre["qw2"])[..., None]
    if key_side:
        C = C + np.einsum("sim,sin->mns", pre["kw1"], pre["kw2"])[:, :, None, :]
    return np.broadcast_to(C, C.shape[:2] + (u.shape[0], u.shape[0])).copy()


def lending_values(C: np.ndarray, scores: np.ndarray, H: np.ndarray) -> np.ndarray:
    """V[k, m, n] = sum_{t,s} H[k, n, t, s] C[m, n, t, s] A[m, t, s] for every lender m and
    borrower n (the diagonal m = n is a head's own score through qp / kp, not a lending: the
    graph has no node for it). H [K, N, T, S], C [N, N, T, S], scores A [N, T, S]."""
    return np.einsum("knts,mnts,mts->kmn", H, C, scores)
