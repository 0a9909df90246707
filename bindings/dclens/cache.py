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

The helpers take TransformerLens's arguments and their forms (layer None or
-1: the final residual; pos_slice / batch_slice as its Slice; logit_attrs'
tokens as an id, a token string or an array); any other value is a
dclens.ArgumentError (ArgumentTypeError: of the wrong type) naming the argument,
and a cache without its model, or without an activation a helper reads, a
dclens.Error naming it (capture every hook: run_with_cache(names=None)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ._core import names as _names
from ._core.checks import (
    ArgumentError,
    ArgumentTypeError,
    Error,
    UnknownNameError,
    check_bool,
    check_index,
    check_str,
    is_choice,
    unknown_name,
)
from ._core.names import hook_name

if TYPE_CHECKING:
    from ._core.protocols import ModelLike as Model

# TransformerLens' SliceInput (see _slice_arg): None, an int, a slice, a tuple (slice(*tuple)),
# a list / range / 1-D array of indices, or a transformer_lens Slice
SliceInput = Any


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
    shapes only. The analysis helpers of dclens.cache are also its methods, with
    TransformerLens's signatures: cache.decompose_resid(...) is
    dclens.cache.decompose_resid(cache, ...), likewise accumulated_resid,
    stack_head_results, apply_ln_to_stack and logit_attrs."""

    model: Model | None = None
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
        """An activation, or `default` when the cache does not hold it.

        Parameters
        ----------
        key : str or tuple
            A hook name (either spelling) or (short name, layer), as for cache[key].
        default : object
            What to return for a key the cache does not hold (or an invalid key).

        Returns
        -------
        numpy.ndarray or object
            The activation, or `default`.
        """
        if key not in self:  # an invalid key too (__contains__)
            return default
        return self[key]

    def __repr__(self) -> str:
        items = ["%s %s" % (k, list(v.shape)) for k, v in self.items()]
        shown = items[:12] + (["... %d more" % (len(items) - 12)] if len(items) > 12 else [])
        return "Cache(%d activations: %s)" % (len(self), ", ".join(shown))

    __str__ = __repr__

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(repr(self))

    # ---------------------------------------------------------- TransformerLens' ActivationCache

    def remove_batch_dim(self) -> Cache:
        """Drop the batch axis of a cache of one prompt (B = 1), in place (as
        TransformerLens does).

        Returns
        -------
        Cache
            This cache (unchanged when it has no batch axis).

        Raises
        ------
        dclens.ArgumentError
            The cache holds a batch of more than one prompt.
        """
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
        self, activation_name: str, layer: int | None = -1, sublayer_type: str | None = None
    ) -> np.ndarray:
        """[layers, ...]: one activation of every block before `layer` (-1 or
        None: all), stacked. activation_name as in hook_name ("pattern", "resid_post",
        "attn.post.kp", or a TransformerLens name such as "hook_pattern");
        sublayer_type prefixes it ("attn", "mlp", "ln1", "ln2") as
        TransformerLens's get_act_name does.

        Parameters
        ----------
        activation_name : str
            The activation, as hook_name takes it.
        layer : int or None
            Stack blocks 0 .. layer-1, layer in [1, L] (-1 or None: all).
        sublayer_type : str or None
            A prefix of the name.

        Returns
        -------
        numpy.ndarray
            [layers, ...] (the activations' own shape after the first axis).

        Raises
        ------
        dclens.ArgumentError
            A layer that is not -1, None or in [1, L], or a name that is not a string or
            holds a NUL (dclens.ArgumentTypeError).
        dclens.Error
            A cache without its model, an unknown name, or an activation it does not hold
            (dclens.UnknownNameError).
        """
        model = _model(self)
        L = model.config.n_layer
        if layer is None:
            layer = -1
        if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool) or not (layer == -1 or 0 < layer <= L):
            raise ArgumentError("stack_activation: layer must be -1, None or in [1, %d], got %r" % (L, layer))
        upto = L if layer == -1 else int(layer)
        name = check_str("stack_activation: activation_name", activation_name)
        if sublayer_type is not None:
            name = "%s.%s" % (check_str("stack_activation: sublayer_type", sublayer_type), name)
        if name.startswith("hook_"):
            name = name[len("hook_") :]
        return np.stack([self[hook_name(name, l)] for l in range(upto)])

    def get_full_resid_decomposition(
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        expand_neurons: bool = True,
        apply_ln: bool = False,
        pos_slice: SliceInput = None,
        return_labels: bool = False,
        project_output_onto=None,
    ):
        """[C, ..., D]: the residual entering `layer` (None or -1: the final one,
        as in TransformerLens; other negatives count from the end) as the sum of
        every head (L{l}H{n}), every MLP neuron (L{l}N{i}: its mlp.post value
        times its W_out row; expand_neurons=False: one {l}_mlp_out per layer,
        bias included), the embedding, and the biases (attention output biases,
        and with expand_neurons the MLP output biases) as one last "bias"
        component, as TransformerLens's cache does. Components sum to the
        residual to float rounding.

        mlp_input: the residual the MLP of `layer` reads. With the parallel
        residual (DCPythia, Pythia) that is the attention's input, the same
        decomposition; in a sequential block it also holds that block's heads
        (and its attention bias). Ignored for the final residual.
        apply_ln: the LayerNorm of `layer` (its MLP's with mlp_input; ln_final
        for the final residual) as a linear map (apply_ln_to_stack).
        pos_slice: positions, as TransformerLens's Slice: an int (the position
        axis goes), a slice, a tuple (start, stop[, step]) or a list / array of
        positions; taken before apply_ln, which then uses the LayerNorm scale of
        those positions. project_output_onto: a [D] or [D, K] array the
        components are projected onto last (the D axis becomes K, or goes).

        Parameters
        ----------
        layer : int or None
            The block whose input residual (None or -1: the final residual).
        mlp_input : bool
            The residual the MLP of `layer` reads.
        expand_neurons : bool
            One component per MLP neuron (False: one per MLP).
        apply_ln : bool
            Apply `layer`'s norm as a linear map.
        pos_slice : int or slice or tuple or list or None
            Positions (an int drops the position axis; None: all).
        return_labels : bool
            Also return the labels.
        project_output_onto : array_like or None
            [D] or [D, K], projected onto last.

        Returns
        -------
        numpy.ndarray or tuple
            [C, ..., D] float64 (D becomes K, or goes, with project_output_onto); with
            return_labels, (stack, labels).

        Raises
        ------
        dclens.Error
            A flag that is not a bool, a layer or position out of range, a projection of the
            wrong shape (ArgumentError, ArgumentTypeError), a cache without its model or an
            activation it needs.
        """
        for what, v in (
            ("mlp_input", mlp_input),
            ("expand_neurons", expand_neurons),
            ("apply_ln", apply_ln),
            ("return_labels", return_labels),
        ):
            check_bool("get_full_resid_decomposition: " + what, v)
        model = _model(self)
        c = model.config
        upto = _layer_arg(model, layer)
        pos = _slice_arg("get_full_resid_decomposition: pos_slice", pos_slice)
        proj = None if project_output_onto is None else _projection(project_output_onto, c.d_model)
        # a sequential block's MLP reads its attention's output too: its heads and bias join
        heads_upto = upto + 1 if mlp_input and upto < c.n_layer and not c.parallel_residual else upto
        at = lambda x: _take(np.asarray(x, np.float64), pos, -2, "get_full_resid_decomposition: pos_slice")
        head_parts, labels = _head_parts(self, model, heads_upto)
        parts = [at(p)[None] for p in head_parts]
        bias = np.zeros(c.d_model)
        if heads_upto:
            bias = bias + np.asarray(model.b_O[:heads_upto], np.float64).sum(0)
        for l in range(upto):
            if expand_neurons:
                post = at(_need(self, hook_name(l, "mlp.post")))  # [..., F]
                w_out = np.asarray(model.W_out[l], np.float64)  # [F, D]
                parts.append(np.moveaxis(post[..., None] * w_out, -2, 0))  # [F, ..., D]
                labels += ["L%dN%d" % (l, i) for i in range(w_out.shape[0])]
                bias = bias + np.asarray(model.b_out[l], np.float64)
            else:
                parts.append(at(_need(self, hook_name(l, "mlp.out")))[None])
                labels.append("%d_mlp_out" % l)
        emb = at(_need(self, "embed"))
        parts.append(emb[None])
        labels.append("embed")
        parts.append(np.broadcast_to(bias, emb.shape)[None])
        labels.append("bias")
        out = np.concatenate(parts)
        if apply_ln:
            out = apply_ln_to_stack(self, out, layer=upto, mlp_input=mlp_input, pos_slice=pos_slice)
        if proj is not None:
            out = out @ proj
        return (out, labels) if return_labels else out

    def layer(self, l: int) -> dict[str, np.ndarray]:
        """The activations of one block.

        Parameters
        ----------
        l : int
            The block.

        Returns
        -------
        dict of str to numpy.ndarray
            Keyed by the name after 'blocks.{l}.' ("attn.pattern", "mlp.out", ...); empty when
            the cache holds none of that block.
        """
        p = "blocks.%d." % l
        return {k[len(p) :]: v for k, v in self.items() if k.startswith(p)}

    def stack(self, suffix: str) -> np.ndarray:
        """One per-layer hook across all the layers that were captured.

        Parameters
        ----------
        suffix : str
            The name after 'blocks.{l}.' ("attn.pattern", "resid_post", ...).

        Returns
        -------
        numpy.ndarray
            [layers captured, ...], in layer order.

        Raises
        ------
        dclens.Error
            The cache has no 'blocks.*.{suffix}'.
        """
        keys = sorted(
            (k for k in self if k.startswith("blocks.") and k.split(".", 2)[2] == suffix),
            key=lambda k: int(k.split(".")[1]),
        )
        if not keys:
            raise Error("cache has no 'blocks.*.%s'" % suffix)
        return np.stack([self[k] for k in keys])


def _stack_args(cache: Cache, layer: int | None, pos_slice: SliceInput, **flags):
    """What the stacking helpers check first: each flag a bool (an ArgumentTypeError naming
    it), the cache's model, the layer and the positions -> (model, upto, pos)."""
    for what, v in flags.items():
        check_bool(what, v)
    model = _model(cache)
    return model, _layer_arg(model, layer), _slice_arg("pos_slice", pos_slice)


def _need(cache: Cache, name: str) -> np.ndarray:
    if name not in cache:
        raise Error("cache has no %s: capture it (run_with_cache(names=None) captures every hook)" % name)
    return cache[name]


def _model(cache: Cache):
    if not isinstance(cache, Cache):
        raise ArgumentTypeError("cache must be a dclens.Cache (from run_with_cache), not %s" % type(cache).__name__)
    if cache.model is None:
        raise Error("this cache has no model attached (it was not made by run_with_cache)")
    return cache.model


def _layer_arg(model, layer: int | None) -> int:
    """The residual a helper works on, as the index of the block it enters (n_layer:
    the final residual). None and -1 mean the final residual (TransformerLens);
    other negatives count from the end (-2: the one entering the last block)."""
    L = model.config.n_layer
    if layer is None:
        return L
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
        raise ArgumentTypeError("layer must be an integer or None, not %s %r" % (type(layer).__name__, layer))
    if not -(L + 1) <= layer <= L:
        raise ArgumentError(
            "layer %d is out of range [%d, %d] (-1 or None: the final residual; %d blocks)" % (layer, -(L + 1), L, L)
        )
    return int(layer) % (L + 1) if layer < 0 else int(layer)


def _head_parts(cache: Cache, model, upto: int) -> tuple[list[np.ndarray], list[str]]:
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


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _slice_arg(what: str, value):
    """A TransformerLens Slice input as a numpy index for one axis, or None (keep all):

        None                        every index (nothing taken)
        int                         that index; the axis goes
        slice                       that slice
        tuple (stop,), (start, stop), (start, stop, step)   slice(*tuple), as TransformerLens
        list / range / 1-D array    those indices (a bool array: a mask); torch tensors too
        transformer_lens Slice      its .slice

    Anything else is an Error naming `what`."""
    if value is None:
        return None
    if hasattr(value, "mode") and hasattr(value, "slice") and not isinstance(value, np.ndarray):
        value = value.slice  # transformer_lens.utils.Slice
    if _is_int(value):
        return int(value)
    if isinstance(value, tuple):
        if not 1 <= len(value) <= 3 or not all(v is None or _is_int(v) for v in value):
            raise ArgumentError(
                "%s: a tuple is a slice, as in TransformerLens: (stop,), (start, stop) or (start, stop, step) "
                "of integers, not %r (a list gives positions)" % (what, value)
            )
        value = slice(*[None if v is None else int(v) for v in value])
    if isinstance(value, slice):
        for part, v in (("start", value.start), ("stop", value.stop), ("step", value.step)):
            if v is not None and not _is_int(v):
                raise ArgumentTypeError(
                    "%s: the slice's %s must be an integer or None, not %s %r" % (what, part, type(v).__name__, v)
                )
        if value.step == 0:
            raise ArgumentError("%s: the slice's step must not be 0" % what)
        return value
    if isinstance(value, (str, bytes, bool, np.bool_, float, dict, set)) or value is Ellipsis:
        raise ArgumentTypeError(
            "%s must be None, an int, a slice, a tuple (start, stop[, step]) or a list of indices, not %s %r"
            % (what, type(value).__name__, value)
        )
    try:
        arr = np.asarray(list(value) if isinstance(value, range) else value)
    except (TypeError, ValueError) as e:
        raise ArgumentTypeError("%s: not a list of indices (%s): %r" % (what, e, value)) from None
    if arr.ndim == 0 and arr.dtype.kind in "iu":
        return int(arr)
    if arr.ndim != 1:
        raise ArgumentError("%s: a list of indices must be 1-D, got shape %s" % (what, arr.shape))
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind == "b":
        return arr
    if arr.dtype.kind not in "iu":
        raise ArgumentTypeError("%s: indices must be integers, got %s values: %r" % (what, arr.dtype, value))
    return arr.astype(np.int64)


def _take(a: np.ndarray, index, axis: int, what: str) -> np.ndarray:
    """a[index] along `axis` (index from _slice_arg; None keeps a), bounds checked
    with an Error naming `what`."""
    if index is None:
        return a
    n = a.shape[axis]
    if isinstance(index, int):
        if not -n <= index < n:
            raise ArgumentError("%s %d is out of range for an axis of %d" % (what, index, n))
    elif isinstance(index, np.ndarray):
        if index.dtype == bool:
            if index.shape[0] != n:
                raise ArgumentError("%s: a mask of %d values for an axis of %d" % (what, index.shape[0], n))
        elif index.size and (index.min() < -n or index.max() >= n):
            bad = index[(index < -n) | (index >= n)][0]
            raise ArgumentError("%s: index %d is out of range for an axis of %d" % (what, bad, n))
    ix: list[Any] = [slice(None)] * a.ndim
    ix[axis] = index
    return a[tuple(ix)]


def _mid(cache: Cache, l: int) -> np.ndarray:
    """resid_pre + attn.out of block l: a sequential block's resid_mid (what its MLP reads);
    with the parallel residual (DCPythia, Pythia) no block reads this sum."""
    return _need(cache, hook_name(l, "resid_pre")) + _need(cache, hook_name(l, "attn.out"))


def accumulated_resid(
    cache: Cache,
    layer: int | None = None,
    incl_mid: bool = False,
    apply_ln: bool = False,
    pos_slice: SliceInput = None,
    mlp_input: bool = False,
    return_labels: bool = False,
):
    """The residual stream accumulated block by block: the residual entering blocks
    0 .. layer-1, then the one entering `layer`. Labels "0_pre", "1_pre", ..., "final_post".

    With the parallel residual of GPT-NeoX (DCPythia, Pythia) attention and MLP both read
    resid_pre, so a resid_mid (incl_mid, mlp_input) is an intermediate no block reads,
    given for comparison.

    Parameters
    ----------
    cache : dclens.Cache
        From run_with_cache, with the activations it reads (the model attached).
    layer : int or None
        Accumulate up to the residual entering this block (None or -1: up to the final
        residual, after the last block; other negatives count from the end).
    incl_mid : bool
        Add each block's resid_mid (resid_pre + attn.out, "{l}_mid") after its resid_pre.
    apply_ln : bool
        Normalise each entry as a whole residual (its own LayerNorm statistics: a logit
        lens).
    pos_slice : int or slice or tuple or list or None
        Positions (TransformerLens' Slice: an int drops the position axis, a slice, a
        tuple (start, stop[, step]), or a list / array of positions; None: all).
    mlp_input : bool
        Add the mid of `layer` itself.
    return_labels : bool
        Also return the components' labels, as ``(stack, labels)``.

    Returns
    -------
    numpy.ndarray or tuple
        [layer + 1 (more with incl_mid), ..., D] (..., the activations' [T] or [B, T] as
        pos_slice leaves them); with return_labels, (stack, labels).

    Raises
    ------
    dclens.Error
        An argument out of range or of the wrong form, or a cache without its model or
        without the resid_pre / resid_mid / resid_post it stacks (module docstring).
    """
    model, upto, pos = _stack_args(
        cache, layer, pos_slice, incl_mid=incl_mid, apply_ln=apply_ln, mlp_input=mlp_input, return_labels=return_labels
    )
    L = model.config.n_layer
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
    out = np.stack([_take(p, pos, -2, "pos_slice") for p in parts])
    if apply_ln:
        out = apply_ln_to_stack(cache, out, layer=upto, recompute_ln=True)
    return (out, labels) if return_labels else out


def decompose_resid(
    cache: Cache,
    layer: int | None = None,
    mlp_input: bool = False,
    mode: str = "all",
    apply_ln: bool = False,
    pos_slice: SliceInput = None,
    incl_embeds: bool = True,
    return_labels: bool = False,
):
    """The residual entering a block as the sum of its parts: embed, then attn.out and
    mlp.out of each block before `layer`.

    Parameters
    ----------
    cache : dclens.Cache
        From run_with_cache, with the activations it reads (the model attached).
    layer : int or None
        The block whose input residual is decomposed (None or -1: the final residual, after
        the last block; other negatives count from the end).
    mlp_input : bool
        Add attn.out of `layer` when its MLP reads it (a sequential block; with the parallel
        residual of DCPythia and Pythia the MLP reads resid_pre, so nothing is added).
    mode : {"all", "attn", "mlp"}
        Keep only the attention or the MLP components ("all": both).
    apply_ln : bool
        Apply the LayerNorm of `layer` (its MLP's with mlp_input; ln_final for the final
        residual) as a linear map (apply_ln_to_stack).
    pos_slice : int or slice or tuple or list or None
        Positions (TransformerLens' Slice: an int drops the position axis, a slice, a
        tuple (start, stop[, step]), or a list / array of positions; None: all).
    incl_embeds : bool
        Include embed (False leaves it out).
    return_labels : bool
        Also return the components' labels, as ``(stack, labels)``.

    Returns
    -------
    numpy.ndarray or tuple
        [1 + 2*layer, ..., D] (fewer with mode or incl_embeds=False), summing to the
        residual entering `layer`; with return_labels, (stack, labels) with labels "embed",
        "{l}_attn_out", "{l}_mlp_out".

    Raises
    ------
    dclens.Error
        An argument out of range or of the wrong form, or a cache without its model or
        without the embed / attn.out / mlp.out it stacks (module docstring).
    """
    if not is_choice(mode, ("all", "attn", "mlp")):
        raise ArgumentError("decompose_resid: mode must be 'all', 'attn' or 'mlp', not %r" % (mode,))
    model, upto, pos = _stack_args(
        cache,
        layer,
        pos_slice,
        mlp_input=mlp_input,
        apply_ln=apply_ln,
        incl_embeds=incl_embeds,
        return_labels=return_labels,
    )
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
        raise ArgumentError("decompose_resid: no components (mode=%r, incl_embeds=False, layer %d)" % (mode, upto))
    out = np.stack([_take(p, pos, -2, "pos_slice") for p in parts])
    if apply_ln:
        out = apply_ln_to_stack(cache, out, layer=upto, mlp_input=mlp_input, pos_slice=pos_slice)
    return (out, labels) if return_labels else out


def stack_head_results(
    cache: Cache,
    layer: int | None = -1,
    return_labels: bool = False,
    incl_remainder: bool = False,
    pos_slice: SliceInput = None,
    apply_ln: bool = False,
):
    """Every head's head_out of the blocks before `layer`, stacked, labels "L{l}H{n}".

    Layer 0 without the remainder gives an empty [0, ..., D] stack, as in TransformerLens.

    Parameters
    ----------
    cache : dclens.Cache
        From run_with_cache, with the activations it reads (the model attached).
    layer : int or None
        The block whose input the heads feed (-1 or None: all blocks).
    return_labels : bool
        Also return the components' labels, as ``(stack, labels)``.
    incl_remainder : bool
        Add the rest of the residual entering `layer` (embed, attention biases, MLPs) as a
        last component, "remainder".
    pos_slice : int or slice or tuple or list or None
        Positions (TransformerLens' Slice: an int drops the position axis, a slice, a
        tuple (start, stop[, step]), or a list / array of positions; None: all).
    apply_ln : bool
        Apply the LayerNorm of `layer` as a linear map (apply_ln_to_stack).

    Returns
    -------
    numpy.ndarray or tuple
        [layer * N (+1), ..., D]; with return_labels, (stack, labels).

    Raises
    ------
    dclens.Error
        An argument out of range or of the wrong form, or a cache without its model or
        without the heads' head_out (module docstring).
    """
    model, upto, pos = _stack_args(
        cache, layer, pos_slice, incl_remainder=incl_remainder, apply_ln=apply_ln, return_labels=return_labels
    )
    parts, labels = _head_parts(cache, model, upto)
    if incl_remainder:
        total = _final_resid(cache, model, upto)
        rest = total - (np.sum(parts, axis=0) if parts else 0)
        parts.append(rest)
        labels.append("remainder")
    if parts:
        out = np.stack([_take(p, pos, -2, "pos_slice") for p in parts])
    else:
        out = np.zeros((0,) + _take(_need(cache, "embed"), pos, -2, "pos_slice").shape, np.float32)
    if apply_ln:
        out = apply_ln_to_stack(cache, out, layer=upto, pos_slice=pos_slice)
    return (out, labels) if return_labels else out


def _centre(config, x: np.ndarray) -> np.ndarray:
    """x less its mean over the last axis for LayerNorm; as is for RMSNorm
    (DCFormer++), which scales without centring."""
    return x if config.norm == "rms" else x - x.mean(-1, keepdims=True)


def _stack_arg(what: str, stack, d_model: int) -> np.ndarray:
    """A residual stack [C, ..., D] as float64, or an Error naming `what`."""
    try:
        a = np.asarray(stack)
    except (TypeError, ValueError) as e:
        raise ArgumentTypeError("%s must be an array [C, ..., D] of numbers: %s" % (what, e)) from None
    if a.dtype.kind not in "fiu" or isinstance(stack, (str, bytes)):
        raise ArgumentTypeError("%s must be an array [C, ..., D] of numbers, not %s" % (what, type(stack).__name__))
    if a.ndim < 2 or a.shape[-1] != d_model:
        raise ArgumentError(
            "%s must be [C, ..., %d] (components first, d_model last), got shape %s" % (what, d_model, list(a.shape))
        )
    return a.astype(np.float64)


def _projection(value, d_model: int) -> np.ndarray:
    """project_output_onto: a [D] or [D, K] array of numbers, as float64."""
    try:
        p = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise ArgumentTypeError("project_output_onto must be a [D] or [D, K] array: %s" % e) from None
    if p.dtype.kind not in "fiu" or p.ndim not in (1, 2) or p.shape[0] != d_model:
        raise ArgumentError(
            "project_output_onto must be a [%d] or [%d, K] array of numbers, got %s %s"
            % (d_model, d_model, p.dtype, list(p.shape))
        )
    return p.astype(np.float64)


def _has_batch(cache: Cache, has_batch_dim) -> bool:
    """has_batch_dim as given (a bool), or (None) whether the cache's activations have a batch axis."""
    if has_batch_dim is not None:
        return check_bool("has_batch_dim", has_batch_dim)
    for name in ("embed", hook_name(0, "resid_pre")):
        if name in cache:
            return cache[name].ndim == 3
    return bool(cache.has_batch_dim)


def apply_ln_to_stack(
    cache: Cache,
    residual_stack,
    layer: int | None = None,
    mlp_input: bool = False,
    pos_slice: SliceInput = None,
    batch_slice: SliceInput = None,
    has_batch_dim: bool | None = None,
    recompute_ln: bool = False,
    *,
    whole: bool = False,
) -> np.ndarray:
    """The LayerNorm (RMSNorm for DCFormer++) before `layer`'s attention (its
    MLP's with mlp_input; None or -1: ln_final) applied to each component of
    residual_stack [C, ..., D] as the linear map it is once the scale is fixed
    by the full residual at that point: (c - mean(c)) / sigma(total) * w, bias
    left out. Summed over components it gives LN(total) - b.

    TransformerLens' arguments: pos_slice: the positions the stack holds (as
    given to the decomposition; the stack is already sliced). batch_slice: a
    slice of the batch axis, taken here from the stack (axis 1, when
    has_batch_dim) and from the scale. has_batch_dim: whether the stack has a
    batch axis after C (None: whether the cache has one). recompute_ln (or
    whole=True): each component is itself a full residual (accumulated_resid)
    and gets its own statistics, at any layer.

    Parameters
    ----------
    cache : dclens.Cache
        From run_with_cache, with the activations it reads (the model attached).
    residual_stack : array_like
        [C, ..., D] components (a decomposition of this cache's residual).
    layer : int or None
        The block whose norm is applied (None or -1: ln_final).
    mlp_input : bool
        The norm of `layer`'s MLP rather than its attention's.
    pos_slice : int or slice or tuple or list or None
        The positions the stack holds, as given to the decomposition.
    batch_slice : int or slice or tuple or list or None
        A slice of the batch axis, taken here from the stack and the scale.
    has_batch_dim : bool or None
        Whether the stack has a batch axis after C (None: whether the cache has one).
    recompute_ln : bool
        Each component gets its own statistics (a full residual).
    whole : bool
        The same as recompute_ln.

    Returns
    -------
    numpy.ndarray
        The normalised stack, float64, of the stack's shape (less what batch_slice takes).

    Raises
    ------
    dclens.Error
        A stack whose shape does not fit, an argument out of range or of the wrong form, or
        a cache without its model or the residual whose LayerNorm scale it applies.
    """
    model = _model(cache)
    for what, v in (("mlp_input", mlp_input), ("recompute_ln", recompute_ln), ("whole", whole)):
        check_bool("apply_ln_to_stack: " + what, v)
    upto = _layer_arg(model, layer)
    c = model.config
    stack = _stack_arg("apply_ln_to_stack: residual_stack", residual_stack, c.d_model)
    pos = _slice_arg("pos_slice", pos_slice)
    bat = _slice_arg("batch_slice", batch_slice)
    batched = _has_batch(cache, has_batch_dim)
    if bat is not None and batched:
        if stack.ndim < 3:
            raise ArgumentError("batch_slice: the stack %s has no batch axis after C" % list(stack.shape))
        stack = _take(stack, bat, 1, "batch_slice")
    if upto == c.n_layer:
        w = np.asarray(model.ln_final_w, np.float64)
    else:
        w = np.asarray(
            model.weight("layers.%d.%s.weight" % (upto, "ffn_norm" if mlp_input else "attention_norm")), np.float64
        )
    centred = _centre(c, stack)
    if whole or recompute_ln:
        scale = np.sqrt((centred**2).mean(-1, keepdims=True) + c.norm_eps)
    else:
        total = np.asarray(_final_resid(cache, model, upto, mlp_input), np.float64)
        if bat is not None:
            if total.ndim != 3:
                raise ArgumentError("batch_slice: the cache has no batch axis (one prompt)")
            total = _take(total, bat, 0, "batch_slice")
        total = _take(total, pos, -2, "pos_slice")
        tc = _centre(c, total)
        scale = np.sqrt((tc**2).mean(-1, keepdims=True) + c.norm_eps)
        if stack.shape[1:] != total.shape:
            where = (
                "at pos_slice %r" % (pos_slice,) if pos_slice is not None else "; pass the pos_slice it was made with"
            )
            if batch_slice is not None:
                where += " and batch_slice %r" % (batch_slice,)
            raise ArgumentError(
                "apply_ln_to_stack: residual_stack is %s, expected [C, %s] (the residual %s)"
                % (list(stack.shape), ", ".join(map(str, total.shape)), where)
            )
    return centred / scale * w


def _token_ids(what: str, tokens, model) -> np.ndarray:
    """tokens for logit_attrs: a token string (one token), an id, or an integer
    array (list, numpy, torch) of ids, as an int64 array; else an Error naming `what`."""
    V = model.config.vocab
    if isinstance(tokens, str):
        return np.asarray(model.to_single_token(tokens), np.int64)
    if isinstance(tokens, (bool, np.bool_)):
        raise ArgumentTypeError("%s must be a token id, a token string or an array of ids, not bool" % what)
    try:
        t = np.asarray(tokens)
    except (TypeError, ValueError) as e:
        raise ArgumentTypeError("%s must be a token id, a token string or an array of ids: %s" % (what, e)) from None
    if t.dtype.kind not in "iu" or t.dtype == bool:
        if t.dtype.kind in "US" or t.dtype == object:
            raise ArgumentTypeError(
                "%s: give one token string, or ids (to_tokens / to_single_token), not %r" % (what, tokens)
            )
        raise ArgumentTypeError("%s must be integer token ids, not %s values %r" % (what, t.dtype, tokens))
    if t.size and (t.min() < 0 or t.max() >= V):
        bad = t[(t < 0) | (t >= V)].flat[0]
        raise ArgumentError("%s: token id %d is out of range [0, %d) (the vocabulary)" % (what, bad, V))
    return t.astype(np.int64)


def logit_attrs(
    cache: Cache,
    residual_stack,
    tokens,
    incorrect_tokens=None,
    pos_slice: SliceInput = None,
    batch_slice: SliceInput = None,
    has_batch_dim: bool | None = None,
    *,
    has_ln: bool = False,
) -> np.ndarray:
    """Direct logit attribution of each component, as TransformerLens's
    ActivationCache.logit_attrs: [C, ...] = apply_ln_to_stack(stack) @
    W_U[:, tokens] (minus W_U[:, incorrect_tokens] if given).

    tokens: a token string (one token), an id, or an array of ids: [] or [1]
    one token for every position; [T] one per position; [B] one per prompt
    (a batched stack [C, B, T, D], at every position); [B, T] one per prompt
    and position. They must fit the stack as left by pos_slice / batch_slice.
    incorrect_tokens: the same forms, the same shape as tokens (a logit
    difference). pos_slice: the positions the stack holds (it is already
    sliced). batch_slice: taken from the stack's batch axis here.
    has_batch_dim: whether the stack has a batch axis after C (None: as the
    cache). has_ln (dclens): the stack already went through apply_ln_to_stack.

    Parameters
    ----------
    cache : dclens.Cache
        From run_with_cache, with the activations it reads (the model attached).
    residual_stack : array_like
        [C, ..., D] components.
    tokens : int or str or array_like of int
        As above.
    incorrect_tokens : int or str or array_like of int or None
        As above; None: no difference.
    pos_slice : int or slice or tuple or list or None
        The positions the stack holds (it is already sliced).
    batch_slice : int or slice or tuple or list or None
        Taken from the stack's batch axis here.
    has_batch_dim : bool or None
        Whether the stack has a batch axis after C.
    has_ln : bool
        The stack is already normalised.

    Returns
    -------
    numpy.ndarray
        [C, ...] float64: each component's logit (difference).

    Raises
    ------
    dclens.ArgumentError
        Token ids outside the vocabulary, incorrect_tokens not of the shape of tokens, or
        tokens that do not fit the stack (dclens.ArgumentTypeError: not token ids or one
        token string).
    dclens.Error
        A cache without its model or the activations apply_ln_to_stack needs.
    """
    model = _model(cache)
    check_bool("logit_attrs: has_ln", has_ln)
    t = _token_ids("logit_attrs: tokens", tokens, model)
    WU = np.asarray(model.W_U, np.float64)  # [D, V]
    d = WU.T[t]  # tokens.shape + [D]
    if incorrect_tokens is not None:
        ti = _token_ids("logit_attrs: incorrect_tokens", incorrect_tokens, model)
        if ti.shape != t.shape:
            raise ArgumentError(
                "logit_attrs: incorrect_tokens must have the shape of tokens: %s vs %s"
                % (list(ti.shape), list(t.shape))
            )
        d = d - WU.T[ti]
    batched = _has_batch(cache, has_batch_dim)
    if has_ln:
        normed = _stack_arg("logit_attrs: residual_stack", residual_stack, model.config.d_model)
        bat = _slice_arg("batch_slice", batch_slice)
        if bat is not None and batched:
            normed = _take(normed, bat, 1, "batch_slice")
    else:
        normed = apply_ln_to_stack(
            cache, residual_stack, pos_slice=pos_slice, batch_slice=batch_slice, has_batch_dim=has_batch_dim
        )
    mid = normed.shape[1:-1]
    if batched and normed.ndim == 4 and d.ndim == 2 and d.shape[0] == normed.shape[1]:
        d = d[:, None, :]  # [B] tokens on a [C, B, T, D] stack: one per prompt, at every position
    while d.ndim - 1 > len(mid) and d.shape[0] == 1:  # [1] tokens on a [C, D] stack
        d = d[0]
    try:
        fits = np.broadcast_shapes(d.shape[:-1], mid) == mid
    except ValueError:
        fits = False
    if not fits:
        raise ArgumentError(
            "logit_attrs: tokens of shape %s do not fit the stack's middle axes %s (stack %s): give one token, "
            "[T] (one per position), [B] (one per prompt) or [B, T], after pos_slice / batch_slice"
            % (list(t.shape), list(mid), list(normed.shape))
        )
    return (normed * d).sum(-1)


class DLA(NamedTuple):
    """dla's result; unpacks as ``values, labels``.

    Attributes
    ----------
    values : numpy.ndarray
        [C] float64, summing to the logit.
    labels : list of str
        [C] names of the components ("embed", "L{l}H{n}", "L{l}.attn_bias", "L{l}.mlp",
        ..., "ln_final.bias").
    """

    values: np.ndarray
    labels: list[str]

    def top(self, k: int = 10) -> list[tuple[str, float]]:
        """The components of largest |value|.

        Parameters
        ----------
        k : int
            How many (a negative k gives none).

        Returns
        -------
        list of tuple
            (label, value) pairs, largest |value| first.
        """
        order = np.argsort(-np.abs(self.values), kind="stable")[: max(0, int(k))]
        return [(self.labels[i], float(self.values[i])) for i in order]


def dla(cache: Cache, token: int, pos: int = -1, batch: int | None = None, by: str = "head") -> DLA:
    """Direct logit attribution of the logit of `token` at position `pos`,
    into components that sum to that logit (to float rounding): embed, then
    per layer each head (by="head") or the whole attention (by="layer"), the
    attention output bias, the MLP, and last ln_final's bias. Returns a DLA
    (values [C] float64, labels), which unpacks as (values, labels).

    Parameters
    ----------
    cache : dclens.Cache
        From run_with_cache, with the activations it reads (the model attached).
    token : int
        The token id whose logit is attributed.
    pos : int
        The position (negative: from the end).
    batch : int or None
        The row of a batched cache (required for one).
    by : {"head", "layer"}
        One component per head (and each layer's attention bias), or per layer's attention.

    Returns
    -------
    DLA
        values [C] float64 summing to the logit, and their labels.

    Raises
    ------
    dclens.ArgumentError
        An unknown `by`, or a token, position or batch row out of range.
    dclens.Error
        A batched cache without batch=, a cache without its model or without the
        activations it needs (embed, head_out or attn.out, mlp.out, the last resid_post).
    """
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
    return DLA(np.concatenate([attrs, [bias]]), labels + ["ln_final.bias"])


# The analyses above as Cache's methods (TransformerLens's ActivationCache has them there):
# cache.decompose_resid(layer, ...) is decompose_resid(cache, layer, ...), one definition each.
for _analysis in (decompose_resid, accumulated_resid, stack_head_results, apply_ln_to_stack, logit_attrs):
    setattr(Cache, _analysis.__name__, _analysis)
del _analysis
