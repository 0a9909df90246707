"""Analyses of a Cache: residual-stream decompositions and direct logit
attribution (TransformerLens' ActivationCache helpers).

Activations keep their layout ([T, D], or [B, T, D] for a batch); a stack
adds a leading component axis C: [C, T, D] / [C, B, T, D].

The residual stream is exactly additive in DCPythia and Pythia (parallel or
sequential residual alike):

    resid_post[L-1] = embed + sum_l (attn.out[l] + mlp.out[l])
    attn.out[l]     = sum_n head_out[l, n] + b_O[l]

so decompose_resid / stack_head_results sum back to the residual, and
dla() returns components that sum to the logit: LayerNorm is linear once
its scale (from the full residual) is fixed, and ln_final's bias is its own
component.

    logits, cache = model.run_with_cache(toks)
    attrs, labels = dclens.cache.dla(cache, token=tok, pos=-1)
    assert abs(attrs.sum() - logits[-1, tok]) < 1e-3
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

import numpy as np

from . import names as _names
from ._checks import Error
from .names import hook_name

if TYPE_CHECKING:
    from .model import Model


class Cache(dict):
    """Activations by hook name (numpy arrays), from run_with_cache.

    Keys are dclens hook names; lookups also take TransformerLens names
    (cache["blocks.0.attn.hook_pattern"]) and (short name, layer) pairs
    (cache["pattern", 0], cache["resid_post", -1]). repr shows names and
    shapes only. The analysis helpers (decompose_resid, stack_head_results,
    accumulated_resid, apply_ln_to_stack, logit_attrs) are in dclens.cache."""

    model: Optional["Model"] = None

    def _key(self, key):
        if isinstance(key, tuple):
            if not 1 <= len(key) <= 2:
                raise Error("cache key must be a name or (name, layer), got %r" % (key,))
            layer = key[1] if len(key) == 2 else None
            if layer is not None and isinstance(layer, (int, np.integer)) and layer < 0 and self.model is not None:
                layer += self.model.config.n_layer
            return _names.hook_name(key[0], layer)
        return _names.canonical(key)

    def __getitem__(self, key):
        k = self._key(key)
        try:
            return dict.__getitem__(self, k)
        except KeyError:
            raise KeyError(
                "cache has no %r%s (it holds %d activations; capture it with names=[...])"
                % (k, "" if k == key else " (from %r)" % (key,), len(self))
            ) from None

    def __contains__(self, key):
        try:
            return dict.__contains__(self, self._key(key))
        except Error:
            return False

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __repr__(self) -> str:
        items = ["%s %s" % (k, list(v.shape)) for k, v in self.items()]
        shown = items[:12] + (["... %d more" % (len(items) - 12)] if len(items) > 12 else [])
        return "Cache(%d activations: %s)" % (len(self), ", ".join(shown))

    __str__ = __repr__

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(repr(self))

    def decompose_resid(self, **kw):
        return decompose_resid(self, **kw)

    def accumulated_resid(self, **kw):
        return accumulated_resid(self, **kw)

    def stack_head_results(self, **kw):
        return stack_head_results(self, **kw)

    def apply_ln_to_stack(self, stack, **kw):
        return apply_ln_to_stack(self, stack, **kw)

    def logit_attrs(self, stack, tokens, **kw):
        return logit_attrs(self, stack, tokens, **kw)

    def layer(self, l: int) -> Dict[str, np.ndarray]:
        """The activations of block l, keyed by the name after 'blocks.{l}.'."""
        p = "blocks.%d." % l
        return {k[len(p) :]: v for k, v in self.items() if k.startswith(p)}

    def stack(self, suffix: str) -> np.ndarray:
        """[L, ...]: one per-layer hook across all layers that were captured."""
        keys = sorted(
            (k for k in self if k.startswith("blocks.") and k.split(".", 2)[2] == suffix),
            key=lambda k: int(k.split(".")[1]),
        )
        if not keys:
            raise Error("cache has no 'blocks.*.%s'" % suffix)
        return np.stack([self[k] for k in keys])


def _need(cache: Cache, name: str) -> np.ndarray:
    if name not in cache:
        raise Error("cache has no %s: capture it (run_with_cache(names=None) captures every hook)" % name)
    return cache[name]


def _model(cache: Cache):
    if cache.model is None:
        raise Error("this cache has no model attached (it was not made by run_with_cache)")
    return cache.model


def _layer_arg(model, layer: Optional[int]) -> int:
    L = model.config.n_layer
    if layer is None:
        return L
    if not isinstance(layer, (int, np.integer)) or not -L <= layer <= L:
        raise Error("layer must be an integer in [-%d, %d] or None, got %r" % (L, L, layer))
    return int(layer) % (L + 1) if layer < 0 else int(layer)


def _final_resid(cache: Cache, model, layer: int) -> np.ndarray:
    """The residual entering block `layer` (layer == L: the final residual)."""
    L = model.config.n_layer
    if layer == L:
        return _need(cache, hook_name(L - 1, "resid_post"))
    return _need(cache, hook_name(layer, "resid_pre"))


def accumulated_resid(cache: Cache, layer: Optional[int] = None, apply_ln: bool = False, return_labels: bool = False):
    """[layer + 1, ..., D]: the residual entering blocks 0 .. layer-1, then the
    one entering `layer` (None: after the last block). Labels "0_pre",
    "1_pre", ..., "final_post"."""
    model = _model(cache)
    L = model.config.n_layer
    upto = _layer_arg(model, layer)
    parts = [_need(cache, hook_name(l, "resid_pre")) for l in range(upto)]
    labels = ["%d_pre" % l for l in range(upto)]
    if upto == L:
        parts.append(_need(cache, hook_name(L - 1, "resid_post")))
        labels.append("final_post")
    else:
        parts.append(_need(cache, hook_name(upto, "resid_pre")))
        labels.append("%d_pre" % upto)
    out = np.stack(parts)
    if apply_ln:
        out = apply_ln_to_stack(cache, out, layer=layer, whole=True)
    return (out, labels) if return_labels else out


def decompose_resid(cache: Cache, layer: Optional[int] = None, apply_ln: bool = False, return_labels: bool = False):
    """[1 + 2*layer, ..., D]: embed, then attn.out and mlp.out of each block
    before `layer` (None: all); they sum to the residual entering `layer`."""
    model = _model(cache)
    upto = _layer_arg(model, layer)
    parts, labels = [_need(cache, "embed")], ["embed"]
    for l in range(upto):
        parts += [_need(cache, hook_name(l, "attn.out")), _need(cache, hook_name(l, "mlp.out"))]
        labels += ["%d_attn_out" % l, "%d_mlp_out" % l]
    out = np.stack(parts)
    if apply_ln:
        out = apply_ln_to_stack(cache, out, layer=layer)
    return (out, labels) if return_labels else out


def stack_head_results(
    cache: Cache,
    layer: Optional[int] = None,
    apply_ln: bool = False,
    return_labels: bool = False,
    incl_remainder: bool = False,
):
    """[layer*N (+1), ..., D]: every head's head_out of the blocks before
    `layer` (None: all), labels "L{l}H{n}"; incl_remainder adds the rest of
    the residual (embed, attention biases, MLPs) as a last component."""
    model = _model(cache)
    upto = _layer_arg(model, layer)
    N = model.config.n_head
    parts, labels = [], []
    for l in range(upto):
        ho = _need(cache, hook_name(l, "attn.head_out"))  # [..., T, N, D]
        parts += [ho[..., n, :] for n in range(N)]
        labels += ["L%dH%d" % (l, n) for n in range(N)]
    if not parts and not incl_remainder:
        raise Error("stack_head_results: no layers before layer %d" % upto)
    if incl_remainder:
        total = _final_resid(cache, model, upto)
        rest = total - (np.sum(parts, axis=0) if parts else 0)
        parts.append(rest)
        labels.append("remainder")
    out = np.stack(parts)
    if apply_ln:
        out = apply_ln_to_stack(cache, out, layer=layer)
    return (out, labels) if return_labels else out


def apply_ln_to_stack(cache: Cache, stack: np.ndarray, layer: Optional[int] = None, whole: bool = False) -> np.ndarray:
    """The LayerNorm before `layer`'s attention (None: ln_final) applied to
    each component as the linear map it is once the scale is fixed by the
    full residual at that point: (c - mean(c)) / sigma(total) * w, bias left
    out. Summed over components it gives LN(total) - b. whole=True: each
    component is itself a full residual (accumulated_resid) and gets its own
    scale."""
    model = _model(cache)
    upto = _layer_arg(model, layer)
    c = model.config
    if upto == c.n_layer:
        w = np.asarray(model.ln_final_w, np.float64)
    else:
        w = np.asarray(model.weight("layers.%d.attention_norm.weight" % upto), np.float64)
    stack = np.asarray(stack, np.float64)
    centred = stack - stack.mean(-1, keepdims=True)
    if whole:
        scale = np.sqrt((centred**2).mean(-1, keepdims=True) + c.norm_eps)
    else:
        total = np.asarray(_final_resid(cache, model, upto), np.float64)
        tc = total - total.mean(-1, keepdims=True)
        scale = np.sqrt((tc**2).mean(-1, keepdims=True) + c.norm_eps)
        if stack.shape[1:] != total.shape:
            raise Error(
                "apply_ln_to_stack: stack is %s, expected [C, %s]"
                % (list(stack.shape), ", ".join(map(str, total.shape)))
            )
    return centred / scale * w


def logit_attrs(cache: Cache, stack: np.ndarray, tokens, incorrect_tokens=None, has_ln: bool = False) -> np.ndarray:
    """Direct logit attribution of each component: [C, ...] =
    ln(stack) @ W_U[:, tokens] (minus W_U[:, incorrect_tokens] if given).
    tokens: an id, or an int array shaped like stack's middle axes
    (e.g. [T] for a [C, T, D] stack). has_ln: the stack already went
    through apply_ln_to_stack."""
    model = _model(cache)
    normed = np.asarray(stack, np.float64) if has_ln else apply_ln_to_stack(cache, stack)
    WU = np.asarray(model.W_U, np.float64)  # [D, V]
    mid = normed.shape[1:-1]

    def cols(t):
        t = np.asarray(t)
        if t.dtype.kind not in "iu" or (t.size and (t.min() < 0 or t.max() >= WU.shape[1])):
            raise Error("logit_attrs: tokens must be ids in [0, %d)" % WU.shape[1])
        return np.broadcast_to(WU.T[t], mid + (WU.shape[0],)) if t.ndim else WU[:, int(t)]

    d = cols(tokens)
    if incorrect_tokens is not None:
        d = d - cols(incorrect_tokens)
    return (normed * d).sum(-1)


def dla(
    cache: Cache, token: int, pos: int = -1, batch: Optional[int] = None, by: str = "head"
) -> Tuple[np.ndarray, List[str]]:
    """Direct logit attribution of the logit of `token` at position `pos`,
    into components that sum to that logit (to float rounding): embed, then
    per layer each head (by="head") or the whole attention (by="layer"), the
    attention output bias, the MLP, and last ln_final's bias. Returns
    (attrs [C] float64, labels). batch: the row of a batched cache."""
    model = _model(cache)
    if by not in ("head", "layer"):
        raise Error("dla: by must be 'head' or 'layer', not %r" % (by,))
    L, N = model.config.n_layer, model.config.n_head

    def at(name):
        a = _need(cache, name)
        if batch is not None:
            a = a[batch]
        if a.ndim < 2:
            raise Error("dla: %s has no position axis (pass batch= for a batched cache)" % name)
        return a[pos]

    if batch is None and _need(cache, "embed").ndim == 3:
        raise Error("dla: the cache is batched: pass batch=<row>")
    parts, labels = [at("embed")], ["embed"]
    bo = model.b_O
    for l in range(L):
        if by == "head":
            ho = at(hook_name(l, "attn.head_out"))  # [N, D]
            parts += list(ho)
            labels += ["L%dH%d" % (l, n) for n in range(N)]
            parts.append(bo[l])
            labels.append("L%d.attn_bias" % l)
        else:
            parts.append(at(hook_name(l, "attn.out")))
            labels.append("L%d.attn" % l)
        parts.append(at(hook_name(l, "mlp.out")))
        labels.append("L%d.mlp" % l)
    stack = np.asarray(np.stack(parts), np.float64)  # [C, D]
    total = np.asarray(at(hook_name(L - 1, "resid_post")), np.float64)
    eps = model.config.norm_eps
    tc = total - total.mean()
    scale = np.sqrt((tc**2).mean() + eps)
    w = np.asarray(model.ln_final_w, np.float64)
    u = np.asarray(model.W_U, np.float64)[:, int(token)]
    attrs = ((stack - stack.mean(-1, keepdims=True)) / scale * w) @ u
    bias = float(np.asarray(model.ln_final_b, np.float64) @ u)
    return np.concatenate([attrs, [bias]]), labels + ["ln_final.bias"]
