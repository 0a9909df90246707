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
from ._checks import ArgumentError, Error, UnknownNameError, check_bool, check_index, is_choice, unknown_name
from .names import hook_name

if TYPE_CHECKING:
    from ._protocols import ModelLike as Model


class MissingActivation(UnknownNameError):
    """A cache key that names no activation it holds: a dclens.Error, and a
    KeyError as dict lookups raise (so `in`, .get and except KeyError work);
    .suggestions holds the closest hook names when the key is no hook at all."""

    def __str__(self):
        return Exception.__str__(self)  # KeyError's str() would quote the message


class Cache(dict):
    """Activations by hook name (numpy arrays), from run_with_cache.

    Keys are dclens hook names; lookups also take TransformerLens names
    (cache["blocks.0.attn.hook_pattern"]) and (short name, layer) pairs
    (cache["pattern", 0], cache["resid_post", -1]). repr shows names and
    shapes only. The analysis helpers (decompose_resid, stack_head_results,
    accumulated_resid, apply_ln_to_stack, logit_attrs) are in dclens.cache."""

    model: Optional["Model"] = None
    has_batch_dim: bool = False  # set by run_with_cache: a leading batch axis on every entry

    def _key(self, key):
        if not isinstance(key, (str, tuple)):
            raise MissingActivation(
                "cache key must be a hook name or (name, layer), not %s %r" % (type(key).__name__, key)
            )
        if isinstance(key, tuple):
            if not 1 <= len(key) <= 2:
                raise ArgumentError("cache key must be a name or (name, layer), got %r" % (key,))
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
            raise self._missing(k, key) from None

    def _missing(self, k, key) -> MissingActivation:
        """Why cache[key] fails: a hook of the model that this run did not capture,
        or a name the model does not have (with the closest names)."""
        was = "" if k == key else " (from %r)" % (key,)
        model = self.model
        if model is not None and k not in model.hook_names:
            e = unknown_name(
                "hook",
                k,
                model.hook_names,
                "",
                "dclens.hook_names(model)",
                message="cache has no %r%s: it is not a hook of %s" % (k, was, model.name),
            )
            return MissingActivation(e.args[0], name=k, suggestions=e.suggestions)
        return MissingActivation(
            "cache has no %r%s: it was not captured in this run (the cache holds %d activations); "
            "capture it with run_with_cache(names=[%r, ...])" % (k, was, len(self), k),
            name=k,
            suggestions=[],
        )

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

    # ---------------------------------------------------------- TransformerLens' ActivationCache

    def remove_batch_dim(self) -> "Cache":
        """Drop the batch axis of a cache of one prompt (B = 1), in place (as
        TransformerLens does); returns the cache."""
        if not self.has_batch_dim:
            return self
        sizes = {k: v.shape[0] for k, v in self.items()}
        if any(b != 1 for b in sizes.values()):
            raise ArgumentError(
                "remove_batch_dim: the cache holds a batch of %d prompts, not one" % max(sizes.values())
            )
        for k in list(self):
            dict.__setitem__(self, k, dict.__getitem__(self, k)[0])
        self.has_batch_dim = False
        return self

    def stack_activation(
        self, activation_name: str, layer: int = -1, sublayer_type: Optional[str] = None
    ) -> np.ndarray:
        """[layers, ...]: one activation of every block before `layer` (-1:
        all), stacked. activation_name as in hook_name ("pattern", "resid_post",
        "attn.post.kp", or a TransformerLens name such as "hook_pattern");
        sublayer_type prefixes it ("attn", "mlp", "ln1", "ln2") as
        TransformerLens's get_act_name does."""
        model = _model(self)
        L = model.config.n_layer
        if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool) or not (layer == -1 or 0 < layer <= L):
            raise ArgumentError("stack_activation: layer must be -1 or in [1, %d], got %r" % (L, layer))
        upto = L if layer == -1 else int(layer)
        name = activation_name
        if sublayer_type is not None:
            name = "%s.%s" % (sublayer_type, name)
        if name.startswith("hook_"):
            name = name[len("hook_") :]
        return np.stack([self[hook_name(name, l)] for l in range(upto)])

    def get_full_resid_decomposition(
        self,
        layer: Optional[int] = None,
        mlp_input: bool = False,
        expand_neurons: bool = True,
        apply_ln: bool = False,
        pos_slice=None,
        return_labels: bool = False,
    ):
        """[C, ..., D]: the residual entering `layer` (None: the final one) as
        the sum of every head (L{l}H{n}), every MLP neuron (L{l}N{i}: its
        mlp.post value times its W_out row; expand_neurons=False: one
        {l}_mlp_out per layer, bias included), the embedding, and the biases
        (attention output biases, and with expand_neurons the MLP output
        biases) as one last "bias" component, as TransformerLens's cache does.
        mlp_input: DCPythia and Pythia run attention and MLP in parallel, so
        the MLP of `layer` reads the same residual (the same decomposition).
        pos_slice: an index or slice of the position axis, applied to every
        component. Components sum to the residual to float rounding."""
        del mlp_input  # parallel residual: the MLP input is the attention input
        model = _model(self)
        upto = _layer_arg(model, layer)
        parts, labels = _head_parts(self, model, upto)
        bias: Union[float, np.ndarray] = 0.0
        if upto:
            bias = np.asarray(model.b_O[:upto], np.float64).sum(0)
        for l in range(upto):
            if expand_neurons:
                post = np.asarray(_need(self, hook_name(l, "mlp.post")), np.float64)  # [..., T, F]
                w_out = np.asarray(model.W_out[l], np.float64)  # [F, D]
                parts += [post[..., i, None] * w_out[i] for i in range(w_out.shape[0])]
                labels += ["L%dN%d" % (l, i) for i in range(w_out.shape[0])]
                bias = bias + np.asarray(model.b_out[l], np.float64)
            else:
                parts.append(_need(self, hook_name(l, "mlp.out")))
                labels.append("%d_mlp_out" % l)
        emb = _need(self, "embed")
        parts.append(emb)
        labels.append("embed")
        parts.append(np.broadcast_to(np.asarray(bias, np.float64), emb.shape))
        labels.append("bias")
        out = np.stack([np.asarray(p, np.float64) for p in parts])
        if pos_slice is not None:
            out = out[..., pos_slice, :]  # the position axis is -2
        if apply_ln:
            if pos_slice is not None:
                raise ArgumentError(
                    "get_full_resid_decomposition: apply_ln with pos_slice is not supported; "
                    "apply it before slicing (apply_ln_to_stack)"
                )
            out = apply_ln_to_stack(self, out, layer=layer)
        return (out, labels) if return_labels else out

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
        raise ArgumentError("layer must be an integer in [-%d, %d] or None, got %r" % (L, L, layer))
    return int(layer) % (L + 1) if layer < 0 else int(layer)


def _head_parts(cache: Cache, model, upto: int) -> Tuple[List[np.ndarray], List[str]]:
    """Every head's head_out ([..., T, D] each) of the blocks before `upto`, labels "L{l}H{n}"."""
    N = model.config.n_head
    parts, labels = [], []
    for l in range(upto):
        ho = _need(cache, hook_name(l, "attn.head_out"))  # [..., T, N, D]
        parts += [ho[..., n, :] for n in range(N)]
        labels += ["L%dH%d" % (l, n) for n in range(N)]
    return parts, labels


def _final_resid(cache: Cache, model, layer: int, mlp_input: bool = False) -> np.ndarray:
    """The residual entering block `layer` (layer == L: the final residual); with
    mlp_input, the one its MLP reads (a sequential block's resid_mid)."""
    L = model.config.n_layer
    if layer == L:
        return _need(cache, hook_name(L - 1, "resid_post"))
    pre = _need(cache, hook_name(layer, "resid_pre"))
    if mlp_input and not model.config.parallel_residual:
        return pre + _need(cache, hook_name(layer, "attn.out"))
    return pre


def _pos_slice(a: np.ndarray, pos_slice) -> np.ndarray:
    """pos_slice (TransformerLens' argument) on the position axis of [..., T, D]:
    None keeps all, an int picks one (the axis goes), a slice / list / array picks several."""
    if pos_slice is None:
        return a
    if isinstance(pos_slice, (bool, np.bool_)) or not isinstance(
        pos_slice, (int, np.integer, slice, list, tuple, range, np.ndarray)
    ):
        raise Error("pos_slice must be None, an int, a slice or a list of positions, not %r" % (pos_slice,))
    idx = list(pos_slice) if isinstance(pos_slice, (tuple, range)) else pos_slice
    try:
        return a[(Ellipsis, idx, slice(None))]
    except IndexError as e:
        raise Error("pos_slice %r: %s (positions: %d)" % (pos_slice, e, a.shape[-2])) from None


def _mid(cache: Cache, l: int) -> np.ndarray:
    """resid_pre + attn.out of block l: a sequential block's resid_mid (what its MLP reads);
    with the parallel residual (DCPythia, Pythia) no block reads this sum."""
    return _need(cache, hook_name(l, "resid_pre")) + _need(cache, hook_name(l, "attn.out"))


def accumulated_resid(
    cache: Cache,
    layer: Optional[int] = None,
    incl_mid: bool = False,
    apply_ln: bool = False,
    pos_slice=None,
    mlp_input: bool = False,
    return_labels: bool = False,
):
    """[layer + 1, ..., D]: the residual entering blocks 0 .. layer-1, then the
    one entering `layer` (None: after the last block). Labels "0_pre",
    "1_pre", ..., "final_post".

    TransformerLens' arguments: incl_mid adds each block's resid_mid
    (resid_pre + attn.out, "{l}_mid") after its resid_pre; mlp_input adds the
    mid of `layer` itself. With the parallel residual of GPT-NeoX (DCPythia,
    Pythia) attention and MLP both read resid_pre, so that sum is an
    intermediate no block reads, given for comparison. pos_slice selects
    positions (an int drops the position axis); apply_ln normalises each
    entry as a whole residual."""
    for what, v in (("incl_mid", incl_mid), ("apply_ln", apply_ln), ("mlp_input", mlp_input)):
        check_bool(what, v)
    model = _model(cache)
    L = model.config.n_layer
    upto = _layer_arg(model, layer)
    parts, labels = [], []
    for l in range(upto):
        parts.append(_need(cache, hook_name(l, "resid_pre")))
        labels.append("%d_pre" % l)
        if incl_mid:
            parts.append(_mid(cache, l))
            labels.append("%d_mid" % l)
    if upto == L:
        parts.append(_need(cache, hook_name(L - 1, "resid_post")))
        labels.append("final_post")
    else:
        parts.append(_need(cache, hook_name(upto, "resid_pre")))
        labels.append("%d_pre" % upto)
        if mlp_input:
            parts.append(_mid(cache, upto))
            labels.append("%d_mid" % upto)
    out = _pos_slice(np.stack(parts), pos_slice)
    if apply_ln:
        out = apply_ln_to_stack(cache, out, layer=layer, whole=True)
    return (out, labels) if return_labels else out


def decompose_resid(
    cache: Cache,
    layer: Optional[int] = None,
    mlp_input: bool = False,
    mode: str = "all",
    apply_ln: bool = False,
    pos_slice=None,
    incl_embeds: bool = True,
    return_labels: bool = False,
):
    """[1 + 2*layer, ..., D]: embed, then attn.out and mlp.out of each block
    before `layer` (None: all); they sum to the residual entering `layer`.

    TransformerLens' arguments: mode "attn" / "mlp" keeps only those
    components ("all": both); incl_embeds=False leaves out embed; mlp_input
    adds attn.out of `layer` when its MLP reads it (a sequential block; with
    the parallel residual of DCPythia and Pythia the MLP reads resid_pre, so
    nothing is added); pos_slice selects positions; apply_ln applies the
    LayerNorm of `layer` (its MLP's with mlp_input; ln_final for None) as a
    linear map."""
    for what, v in (("mlp_input", mlp_input), ("apply_ln", apply_ln), ("incl_embeds", incl_embeds)):
        check_bool(what, v)
    model = _model(cache)
    if mode not in ("all", "attn", "mlp"):
        raise Error("decompose_resid: mode must be 'all', 'attn' or 'mlp', not %r" % (mode,))
    upto = _layer_arg(model, layer)
    parts, labels = ([_need(cache, "embed")], ["embed"]) if incl_embeds else ([], [])
    for l in range(upto):
        if mode != "mlp":
            parts.append(_need(cache, hook_name(l, "attn.out")))
            labels.append("%d_attn_out" % l)
        if mode != "attn":
            parts.append(_need(cache, hook_name(l, "mlp.out")))
            labels.append("%d_mlp_out" % l)
    if mlp_input and upto < model.config.n_layer and mode != "mlp" and not model.config.parallel_residual:
        parts.append(_need(cache, hook_name(upto, "attn.out")))
        labels.append("%d_attn_out" % upto)
    if not parts:
        raise Error("decompose_resid: no components (mode=%r, incl_embeds=False, layer %d)" % (mode, upto))
    out = _pos_slice(np.stack(parts), pos_slice)
    if apply_ln:
        out = apply_ln_to_stack(cache, out, layer=layer, mlp_input=mlp_input, pos_slice=pos_slice)
    return (out, labels) if return_labels else out


def stack_head_results(
    cache: Cache,
    layer: Optional[int] = None,
    return_labels: bool = False,
    incl_remainder: bool = False,
    pos_slice=None,
    apply_ln: bool = False,
):
    """[layer*N (+1), ..., D]: every head's head_out of the blocks before
    `layer` (None: all), labels "L{l}H{n}"; incl_remainder adds the rest of
    the residual (embed, attention biases, MLPs) as a last component;
    pos_slice selects positions (TransformerLens' arguments)."""
    for what, v in (("incl_remainder", incl_remainder), ("apply_ln", apply_ln)):
        check_bool(what, v)
    model = _model(cache)
    upto = _layer_arg(model, layer)
    parts, labels = _head_parts(cache, model, upto)
    if not parts and not incl_remainder:
        raise Error("stack_head_results: no layers before layer %d" % upto)
    if incl_remainder:
        total = _final_resid(cache, model, upto)
        rest = total - (np.sum(parts, axis=0) if parts else 0)
        parts.append(rest)
        labels.append("remainder")
    out = _pos_slice(np.stack(parts), pos_slice)
    if apply_ln:
        out = apply_ln_to_stack(cache, out, layer=layer, pos_slice=pos_slice)
    return (out, labels) if return_labels else out


def _centre(config, x: np.ndarray) -> np.ndarray:
    """x less its mean over the last axis for LayerNorm; as is for RMSNorm
    (DCFormer++), which scales without centring."""
    return x if config.norm == "rms" else x - x.mean(-1, keepdims=True)


def apply_ln_to_stack(
    cache: Cache,
    stack: np.ndarray,
    layer: Optional[int] = None,
    mlp_input: bool = False,
    pos_slice=None,
    whole: bool = False,
) -> np.ndarray:
    """The LayerNorm (RMSNorm for DCFormer++) before `layer`'s attention (its MLP's with mlp_input;
    None: ln_final) applied to each component as the linear map it is once
    the scale is fixed by the full residual at that point: (c - mean(c)) /
    sigma(total) * w, bias left out. Summed over components it gives
    LN(total) - b. pos_slice: the positions the stack holds (as given to the
    decomposition). whole=True: each component is itself a full residual
    (accumulated_resid) and gets its own scale."""
    model = _model(cache)
    upto = _layer_arg(model, layer)
    c = model.config
    if upto == c.n_layer:
        w = np.asarray(model.ln_final_w, np.float64)
    else:
        w = np.asarray(
            model.weight("layers.%d.%s.weight" % (upto, "ffn_norm" if mlp_input else "attention_norm")), np.float64
        )
    stack = np.asarray(stack, np.float64)
    centred = _centre(c, stack)
    if whole:
        scale = np.sqrt((centred**2).mean(-1, keepdims=True) + c.norm_eps)
    else:
        total = np.asarray(_pos_slice(_final_resid(cache, model, upto, mlp_input), pos_slice), np.float64)
        tc = _centre(c, total)
        scale = np.sqrt((tc**2).mean(-1, keepdims=True) + c.norm_eps)
        if stack.shape[1:] != total.shape:
            raise Error(
                "apply_ln_to_stack: stack is %s, expected [C, %s]%s"
                % (
                    list(stack.shape),
                    ", ".join(map(str, total.shape)),
                    "" if pos_slice is not None else " (pass the pos_slice the stack was made with)",
                )
            )
    return centred / scale * w


def logit_attrs(
    cache: Cache, stack: np.ndarray, tokens, incorrect_tokens=None, has_ln: bool = False, pos_slice=None
) -> np.ndarray:
    """Direct logit attribution of each component: [C, ...] =
    ln(stack) @ W_U[:, tokens] (minus W_U[:, incorrect_tokens] if given).
    tokens: an id, or an int array shaped like stack's middle axes
    (e.g. [T] for a [C, T, D] stack). has_ln: the stack already went
    through apply_ln_to_stack. pos_slice: the positions the stack holds."""
    model = _model(cache)
    normed = np.asarray(stack, np.float64) if has_ln else apply_ln_to_stack(cache, stack, pos_slice=pos_slice)
    WU = np.asarray(model.W_U, np.float64)  # [D, V]
    mid = normed.shape[1:-1]

    def cols(t):
        t = np.asarray(t)
        if t.dtype.kind not in "iu" or (t.size and (t.min() < 0 or t.max() >= WU.shape[1])):
            raise ArgumentError("logit_attrs: tokens must be ids in [0, %d)" % WU.shape[1])
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
    if not is_choice(by, ("head", "layer")):
        raise ArgumentError("dla: by must be 'head' or 'layer', not %r" % (by,))
    L, N = model.config.n_layer, model.config.n_head
    token = check_index("dla: token", token, 0, model.config.vocab, " (the vocabulary)")
    T = _need(cache, "embed").shape[-2]
    pos = check_index("dla: pos", pos, -T, T, " for %d positions" % T)
    if batch is not None:
        batch = check_index(
            "dla: batch", batch, 0, _need(cache, "embed").shape[0] if _need(cache, "embed").ndim == 3 else 1
        )

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
    tc = _centre(model.config, total)
    scale = np.sqrt((tc**2).mean() + eps)
    w = np.asarray(model.ln_final_w, np.float64)
    u = np.asarray(model.W_U, np.float64)[:, int(token)]
    attrs = (_centre(model.config, stack) / scale * w) @ u
    bias = float(np.asarray(model.ln_final_b, np.float64) @ u)
    return np.concatenate([attrs, [bias]]), labels + ["ln_final.bias"]
