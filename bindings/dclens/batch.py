"""Batches of prompts: padding, the batch-axis rule, and the one call path of
forward / run_with_cache / run_with_hooks.

Rules (docs/api.md):
- Input: a string, a [T] token array, a list of strings, a [B, T] array, or
  (tokens [B, T], lengths [B]) (what to_tokens(list) returns; lengths may
  also be given as lengths=...). Rows shorter than T are padded, on the
  right (default) or the left (padding_side="left").
- Batch axis: results have a leading batch axis when the input is batched
  (list of strings, 2-D tokens), or always with load(..., always_batch=True).
- Padding never feeds real tokens: the engine runs every row right-padded
  from position 0 (under the causal mask later positions never reach earlier
  ones); left-padded rows are moved there and back, so logits, caches and
  hook functions all see the layout the caller gave. Values at padded
  positions are meaningless (computed on the pad token). Every real position
  equals the prompt run on its own (tested).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from . import names as _names
from ._checks import Error, token_array
from .cache import Cache
from .hooks import is_read_only, read_only

_MAP_PREFIXES = ("attn.pre.", "attn.post.")
_MAPS = ("attn.scores", "attn.scores_composed", "attn.pattern", "attn.pattern_composed")
_POST_SOFTMAX = ("attn.pattern", "attn.pattern_composed")


def _suffix(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("blocks.") else name


def is_map(name: str) -> bool:
    """Is the hook an [N, T, S] attention map?"""
    s = _suffix(name)
    return s in _MAPS or s.startswith(_MAP_PREFIXES)


def pad(rows: Sequence[np.ndarray], padding_side: str = "right", pad_id: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Pad 1-D token arrays to [B, max T]; returns (tokens, lengths)."""
    if padding_side not in ("right", "left"):
        raise Error("padding_side must be 'right' or 'left', not %r" % (padding_side,))
    rows = [np.asarray(r).reshape(-1) for r in rows]
    if not rows or any(r.size == 0 for r in rows):
        raise Error("pad: every prompt needs at least one token")
    T = max(r.size for r in rows)
    out = np.full((len(rows), T), pad_id, dtype=np.int32)
    for i, r in enumerate(rows):
        if padding_side == "right":
            out[i, : r.size] = r
        else:
            out[i, T - r.size :] = r
    return out, np.array([r.size for r in rows], dtype=np.int64)


def _roll_rows(a: np.ndarray, shifts: np.ndarray, axes: Tuple[int, ...]) -> np.ndarray:
    """Row b of a (axis 0) rolled by shifts[b] along each of axes."""
    out = np.empty_like(a)
    for b, k in enumerate(shifts):
        out[b] = np.roll(a[b], int(k), axis=tuple(x - 1 for x in axes)) if k else a[b]
    return out


def _pos_axes(name: str) -> Tuple[int, ...]:
    return (2, 3) if is_map(name) else (1,)


def normalize(model, tokens, lengths=None, padding_side: str = "right"):
    """(tokens as given: [T] or [B, T] int array, lengths or None, batched)."""
    if padding_side not in ("right", "left"):
        raise Error("padding_side must be 'right' or 'left', not %r" % (padding_side,))
    if isinstance(tokens, tuple) and len(tokens) == 2 and np.ndim(tokens[0]) == 2 and np.ndim(tokens[1]) == 1:
        if lengths is not None:
            raise Error("lengths given twice (in the tokens tuple and as lengths=)")
        tokens, lengths = tokens
    if isinstance(tokens, (list, tuple)) and tokens and all(isinstance(t, str) for t in tokens):
        if lengths is not None:
            raise Error("lengths= goes with a [B, T] token array, not with a list of strings")
        tokens, lengths = model.to_tokens(list(tokens), padding_side=padding_side)
    elif isinstance(tokens, str):
        tokens = model.to_tokens(tokens)
    a = token_array(tokens)
    if lengths is not None:
        if a.ndim != 2:
            raise Error("lengths= needs [B, T] tokens, got shape %s" % (a.shape,))
        ln = np.asarray(lengths)
        if ln.ndim != 1 or ln.shape[0] != a.shape[0] or ln.dtype.kind not in "iu":
            raise Error("lengths must be [B] = [%d] integers, got %r" % (a.shape[0], lengths))
        if ln.size and (ln.min() < 1 or ln.max() > a.shape[1]):
            raise Error("lengths must be in [1, T=%d], got %s" % (a.shape[1], ln.tolist()))
        lengths = ln.astype(np.int64)
    return a, lengths, a.ndim == 2


def _loss(logits: np.ndarray, toks: np.ndarray, lengths, padding_side: str, per_token: bool):
    """Next-token cross-entropy; logits [B, T, V], toks [B, T]."""
    B, T, _ = logits.shape
    if T < 2:
        if per_token:
            return np.zeros((B, 0), np.float32)
        raise Error("return_type='loss' needs at least 2 tokens")
    x = logits[:, :-1].astype(np.float64)
    mx = x.max(-1, keepdims=True)
    lse = np.log(np.exp(x - mx).sum(-1)) + mx[..., 0]
    tgt = np.take_along_axis(x, toks[:, 1:, None].astype(np.int64), -1)[..., 0]
    nll = lse - tgt  # [B, T-1]
    real = np.ones((B, T - 1), dtype=bool)
    if lengths is not None:
        t = np.arange(T - 1)[None]
        ln = lengths[:, None]
        real = (t < ln - 1) if padding_side == "right" else (t >= T - ln)
    nll = np.where(real, nll, 0.0)
    if per_token:
        return nll.astype(np.float32)
    n = real.sum()
    if n == 0:
        raise Error("return_type='loss': no prompt has 2 or more real tokens")
    return float(nll.sum() / n)


def call(
    model,
    tokens,
    *,
    lengths=None,
    padding_side: str = "right",
    return_type: Optional[str] = "logits",
    capture: Sequence[str] = (),
    fns=(),
    with_cache: bool = False,
    loss_per_token: bool = False,
):
    """The one path of forward / run_with_cache / run_with_hooks."""
    if return_type not in ("logits", "loss", "both", None):
        raise Error("return_type must be 'logits', 'loss', 'both' or None, not %r" % (return_type,))
    a, lengths, batched = normalize(model, tokens, lengths, padding_side)
    if a.ndim not in (1, 2):
        raise Error("tokens must be a non-empty [T] or [B, T] array, got shape %s" % (a.shape,))
    if not batched and model.always_batch:
        a, batched = a[None], True
    fns = [(_names.canonical(n), fn) for n, fn in list(fns) + list(model._ctx_hooks)]
    for n, fn in fns:
        if not callable(fn):
            raise Error("hook %s: %r is not callable" % (n, fn))
    shifts = None
    if batched and lengths is not None and padding_side == "left":
        shifts = (a.shape[1] - lengths).astype(np.int64)
        if shifts.any():
            a = _roll_rows(np.asarray(a), -shifts, (1,))
            fns = [(n, _left_view(fn, n, shifts)) for n, fn in fns]
        else:
            shifts = None
    need_logits = return_type is not None
    logits, cache = model._run(a, capture=list(capture), fns=fns, logits=need_logits)
    if fns:
        _apply_mask_rule(model, cache)
    if shifts is not None:
        if logits is not None:
            logits = _roll_rows(logits, shifts, (1,))
        for k in list(cache):
            dict.__setitem__(cache, k, _roll_rows(cache[k], shifts, _pos_axes(k)))
        a = _roll_rows(a, shifts, (1,))
    cache.model = model
    out = logits
    if return_type in ("loss", "both"):
        lg = logits if batched else logits[None]
        tk = a if batched else a[None]
        loss = _loss(lg, np.asarray(tk), lengths, padding_side, loss_per_token)
        if not batched and loss_per_token:
            loss = loss[0]
        out = loss if return_type == "loss" else (logits, loss)
    return (out, cache) if with_cache else out


def _left_view(fn, name: str, shifts: np.ndarray):
    """A hook function of a left-padded call: it sees (and writes) the
    left-padded layout while the engine runs right-padded."""
    axes = _pos_axes(name)
    if is_read_only(fn):

        def look(act, hook_name):
            left = _roll_rows(act, shifts, axes)
            left.flags.writeable = False
            return fn(left, hook_name)

        return read_only(look)

    def wrapped(act, hook_name):
        left = _roll_rows(act, shifts, axes)
        r = fn(left, hook_name)
        if r is not None:
            left = np.asarray(r)
            if left.shape != act.shape:
                raise Error(
                    "hook %s: the hook function returned shape %s, expected %s" % (hook_name, left.shape, act.shape)
                )
        act[...] = _roll_rows(left.astype(act.dtype, copy=False), -shifts, axes)
        return act

    return wrapped


def _apply_mask_rule(model, cache: Cache) -> None:
    """Cached post-softmax maps show what the pass used: masked cells 0
    (the engine zeroes them after a hook writes there; hooks.md)."""
    c = model.config
    for k in list(cache):
        s = _suffix(k)
        if not (s in _POST_SOFTMAX or s.startswith("attn.post.")):
            continue
        v = cache[k]
        T, S = v.shape[-2:]
        layer = int(k.split(".")[1])
        w = c.window_size if layer in c.local_layers else 0
        t, j = np.indices((T, S))
        allowed = (j <= t) & ((w <= 0) | (t - j <= w))
        if not np.all(v[..., ~allowed] == 0):
            v = v.copy()
            v[..., ~allowed] = 0
            dict.__setitem__(cache, k, v)
