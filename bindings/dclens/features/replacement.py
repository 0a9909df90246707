"""The local replacement model of one prompt (docs/features.md, "Attribution graphs").

Ameisen et al. 2025 (circuit-tracer): on one prompt, every MLP is replaced by its
transcoder plus an error term (what the transcoder misses, a constant), and the attention
patterns and the norms' scales are frozen at their values in the clean run. What is left is
linear in the residual stream: a feature's decoder vector reaches a later feature's encoder,
or a logit, along the residual and through the heads' OV circuits (value -> pattern -> output,
the patterns fixed). For DCMHA the frozen pattern is the *composed* one (attn.pattern_composed):
the compose's dynamic weights are frozen with it. What they were computed from, the
dynamic-weight input of each layer, is what ``compose_grad`` opens again (the compose nodes of
attribution_graph).

Residual levels: level l (0 <= l < L) is blocks.{l}.resid_pre, level L the last block's
resid_post. A layer-l transcoder feature, its error node and (level 0) the embeddings write
into level l + 1 (0); a layer-l feature reads blocks.{l}.mlp_input (level l itself with the
parallel residual, level l plus the attention's output otherwise) through the frozen MLP norm;
the logits read level L through the frozen final norm.

Everything here is numpy on the cached activations of one engine pass: the clean values and the
frozen scales in float64, the batched backward's products (backward, attn_T) in float32, as
the engine computes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._core.checks import Error
from .sae import SAE

# the input hooks a layer's transcoder may read, and the output hook it must write
_TC_INPUTS = ("ln_mlp", "mlp_input")
_COMPOSE_READS = ("ln_attn", "attn.scores", "attn.pattern", "attn.v")


def _hook(layer: int, what: str) -> str:
    return "blocks.%d.%s" % (layer, what)


class Replacement:
    """The frozen-linear replacement model of `tokens` with one transcoder per layer.

    Parameters
    ----------
    model : dclens.Model
        A DCPythia, DCFormer++ or Pythia model (not Mixture-of-Head).
    tokens : array_like of int
        One prompt, [T] token ids.
    transcoders : sequence of SAE
        transcoders[l] maps blocks.{l}.ln_mlp (or blocks.{l}.mlp_input) to blocks.{l}.mlp.out.
    compose : bool
        Also keep what the compose's backward reads (ln_attn, scores, pattern, v: `extra`).

    Attributes
    ----------
    resid : list of numpy.ndarray
        The L + 1 residual levels [T, D] (float64).
    acts, pre : list of numpy.ndarray
        Per layer, the transcoder's feature activations and pre-activations [T, F].
    error : list of numpy.ndarray
        Per layer, mlp.out minus the transcoder's output [T, D].
    logits : numpy.ndarray
        [T, V] float64, the model's.

    Raises
    ------
    dclens.Error
        A model with Mixture-of-Head routing, tokens that are not one prompt, or a
        transcoder list that does not have one transcoder per layer from the MLP's input
        to blocks.{l}.mlp.out (naming the layer).
    """

    def __init__(self, model, tokens, transcoders: Sequence[SAE], compose: bool = False):
        c = model.config
        if c.moh_shared_heads is not None:
            raise Error("attribution graph: Mixture-of-Head models are not supported (their head gates are not frozen)")
        toks = np.asarray(tokens)
        if toks.ndim != 1 or toks.size == 0 or toks.dtype.kind not in "iu":
            raise Error("attribution graph: tokens must be one prompt, [T] integer ids (got shape %s)" % (toks.shape,))
        self.model, self.tokens, self.c = model, toks.astype(np.int64), c
        self.L, self.T = c.n_layer, int(toks.size)
        self.transcoders = _check_transcoders(model, transcoders)
        self.reads_norm = [tc.cfg.hook_name.endswith("ln_mlp") for tc in self.transcoders]
        self._pattern = "attn.pattern_composed" if c.use_dcmha else "attn.pattern"
        names = ["embed", _hook(self.L - 1, "resid_post")]
        for l in range(self.L):
            names += [_hook(l, w) for w in ("resid_pre", "mlp_input", "mlp.out", self._pattern)]
            names.append(self.transcoders[l].cfg.hook_name)
            if compose:  # what the compose's backward reads (compose_nodes)
                names += [_hook(l, w) for w in ("ln_attn", "attn.scores", "attn.pattern", "attn.v")]
        logits, cache = model.run_with_cache(self.tokens.astype(np.int32), names=sorted(set(names)))
        get = lambda n: np.asarray(cache[n], np.float64)  # noqa: E731
        self.logits = np.asarray(logits, np.float64)
        self.embed = get("embed")
        self.resid = [get(_hook(l, "resid_pre")) for l in range(self.L)] + [get(_hook(self.L - 1, "resid_post"))]
        self.mlp_input = [get(_hook(l, "mlp_input")) for l in range(self.L)]
        self.pattern = [get(_hook(l, self._pattern)) for l in range(self.L)]  # [N, T, S]
        self.extra = {n: get(n) for n in names if compose and n.split(".", 2)[-1] in _COMPOSE_READS}
        self._weights()
        self.acts, self.pre, self.error = [], [], []
        for l, tc in enumerate(self.transcoders):
            x = np.asarray(cache[tc.cfg.hook_name], np.float32)
            run = tc.run(x)
            self.acts.append(np.asarray(run["acts"], np.float64))
            self.pre.append(np.asarray(run["pre"], np.float64))
            self.error.append(get(_hook(l, "mlp.out")) - np.asarray(run["recon"], np.float64))

    # ------------------------------------------------------------ weights and frozen norms

    def _weights(self) -> None:
        c, m = self.c, self.model
        D, N, Dh = c.d_model, c.n_head, c.head_dim
        self.rms = c.norm == "rms"
        self.Wv: list[np.ndarray] = []
        self.Wo: list[np.ndarray] = []
        # the frozen norms by which: ("attn", l), ("mlp", l) or "final": weight [D], scale [T]
        self.norm_w: dict[Any, np.ndarray] = {}
        self.sigma: dict[Any, np.ndarray] = {}
        for l in range(self.L):
            wqkv = m.weight("layers.%d.attention.wqkv.weight" % l).astype(np.float64)  # [3D, D]
            self.Wv.append(wqkv[2 * D : 3 * D].reshape(N, Dh, D))  # head n's rows [Dh, D]
            self.Wo.append(m.weight("layers.%d.attention.wo.weight" % l).astype(np.float64))  # [D, N*Dh]
            self.norm_w[("attn", l)] = m.weight("layers.%d.attention_norm.weight" % l).astype(np.float64)
            self.norm_w[("mlp", l)] = m.weight("layers.%d.ffn_norm.weight" % l).astype(np.float64)
            self.sigma[("attn", l)] = self._sigma(self.resid[l])
            self.sigma[("mlp", l)] = self._sigma(self.mlp_input[l])
        self.norm_w["final"] = m.weight("norm.weight").astype(np.float64)
        self.sigma["final"] = self._sigma(self.resid[self.L])
        self.W_U = m.weight("output.weight").astype(np.float64)  # [V, D]
        self._f32()

    def _sigma(self, x: np.ndarray) -> np.ndarray:
        """The norm's scale per position [T], frozen: sqrt(var + eps) (RMS: sqrt(mean x^2 + eps))."""
        v = (x * x).mean(-1) if self.rms else x.var(-1)
        return np.sqrt(v + self.c.norm_eps)

    def norm_T(self, which, g: np.ndarray) -> np.ndarray:
        """The transpose of a frozen norm's Jacobian applied to g [..., T, D] at its output:
        the gradient at its input. which: ("attn", l), ("mlp", l) or "final"."""
        out = g * (self.norm_w[which] / self.sigma[which][:, None])
        return out if self.rms else out - out.mean(-1, keepdims=True)

    def norm_frozen(self, which, x: np.ndarray) -> np.ndarray:
        """The frozen norm of x [T, D] (without its bias): what norm_T is the transpose of."""
        y = x if self.rms else x - x.mean(-1, keepdims=True)
        return y / self.sigma[which][:, None] * self.norm_w[which]

    # ------------------------------------------------------------ the linear backward

    def _f32(self) -> None:
        """float32 copies of what the batched backward multiplies by (its products run at
        float32 speed; a gradient is a sum of a few thousand terms, ~1e-6 relative)."""
        f = np.float32
        self._Wo32 = [w.astype(f) for w in self.Wo]
        self._Wv32 = [w.reshape(w.shape[0] * w.shape[1], -1).astype(f) for w in self.Wv]  # [N*Dh, D]
        self._PT32 = [np.ascontiguousarray(np.swapaxes(p, 1, 2), f) for p in self.pattern]  # [N, S, T]
        self._attn_scale32 = [
            (self.norm_w["attn", l] / self.sigma["attn", l][:, None]).astype(f) for l in range(self.L)
        ]

    def attn_T(self, l: int, G: np.ndarray) -> np.ndarray:
        """Layer l's frozen attention, transposed: G [K, T, D] (float32) at its output -> the
        gradient at the residual it reads (values through the frozen pattern and norm)."""
        N, Dh, K, T = self.c.n_head, self.c.head_dim, G.shape[0], self.T
        gz = (G @ self._Wo32[l]).reshape(K, T, N, Dh).transpose(2, 1, 0, 3).reshape(N, T, K * Dh)
        gv = self._PT32[l] @ gz  # [N, S, K*Dh]: sum over t of P[n, t, s] gz
        gv = gv.reshape(N, T, K, Dh).transpose(2, 1, 0, 3).reshape(K * T, N * Dh)
        g = (gv @ self._Wv32[l]).reshape(K, T, -1) * self._attn_scale32[l]  # [K, S, D]
        return g if self.rms else g - g.mean(-1, keepdims=True)

    def norm_T_at(self, which, pos: int, g: np.ndarray) -> np.ndarray:
        """norm_T for one position: g [..., D] at the norm's output at `pos`."""
        out = g * (self.norm_w[which] / self.sigma[which][pos])
        return out if self.rms else out - out.mean(-1, keepdims=True)

    def read_seed(self, layer: int, pos: int, v: np.ndarray) -> np.ndarray:
        """A vector v [D] on layer `layer`'s transcoder input at `pos` as a gradient at
        blocks.{layer}.mlp_input[pos]."""
        return self.norm_T_at(("mlp", layer), pos, v) if self.reads_norm[layer] else v

    def backward(self, K: int, seeds: dict) -> Iterator[tuple[int, np.ndarray]]:
        """The gradients of K targets at every residual level, from the top down.

        seeds maps ("resid", level) or ("mlp_input", layer) to a list of (k, pos, vector [D]):
        target k reads that point at that position with that vector (its gradient there).
        Yields (level, G) for level = L .. 0 from the highest level a target reads, G [K, T, D]
        float32 the gradient at that level (read it before the next step: it may be reused)."""
        G = np.zeros((K, self.T, self.c.d_model), np.float32)
        live = False  # no target reads above this level yet: G is zero, nothing to carry down
        for level in range(self.L, -1, -1):
            if level < self.L:
                l = level
                if self.c.parallel_residual:  # r_{l+1} = r_l + attn(r_l) + mlp(r_l)
                    G = G + self.attn_T(l, G) if live else G
                    live |= _add(G, seeds.get(("mlp_input", l), ()))
                else:  # h = r_l + attn(r_l); r_{l+1} = h + mlp(h)
                    live |= _add(G, seeds.get(("mlp_input", l), ()))
                    G = G + self.attn_T(l, G) if live else G
            live |= _add(G, seeds.get(("resid", level), ()))
            if live:  # (above the highest target G is zero: no edges there)
                yield level, G


def _add(G: np.ndarray, items) -> bool:
    """G[k, pos] += v for each item; whether there was any."""
    for k, pos, v in items:
        G[k, pos] += v
    return bool(items)


def _check_transcoders(model, transcoders) -> list[SAE]:
    L = model.config.n_layer
    try:
        tcs = list(transcoders)
    except TypeError:
        raise Error("attribution graph: transcoders must be a list of %d transcoders, one per layer" % L) from None
    if len(tcs) != L:
        raise Error("attribution graph: %d transcoders for a model of %d layers (one per layer)" % (len(tcs), L))
    D = model.config.d_model
    for l, tc in enumerate(tcs):
        if not isinstance(tc, SAE):
            raise Error("attribution graph: transcoders[%d] is %s, not a dclens.features.SAE" % (l, type(tc).__name__))
        cfg = tc.cfg
        ins = [_hook(l, w) for w in _TC_INPUTS]
        if cfg.hook_name not in ins or cfg.hook_name_out != _hook(l, "mlp.out"):
            raise Error(
                "attribution graph: transcoders[%d] maps %r -> %r; layer %d's must map %s -> %r"
                % (l, cfg.hook_name, cfg.hook_name_out, l, " or ".join(map(repr, ins)), _hook(l, "mlp.out"))
            )
        if cfg.d_in != D or cfg.width_out != D:
            raise Error(
                "attribution graph: transcoders[%d] is %d -> %d wide, the model's width is %d"
                % (l, cfg.d_in, cfg.width_out, D)
            )
    return tcs
