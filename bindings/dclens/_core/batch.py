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

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .checks import ArgumentError, Error, check_index, is_choice, token_array
from .hooks import is_read_only, read_only
from .mask import allowed, layer_window

_MAP_PREFIXES = ("attn.pre.", "attn.post.")
_MAPS = ("attn.scores", "attn.scores_composed", "attn.pattern", "attn.pattern_composed")
_POST_SOFTMAX = ("attn.pattern", "attn.pattern_composed")


def _suffix(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("blocks.") else name


def is_map(name: str) -> bool:
    """Is the hook an [N, T, S] attention map?"""
    s = _suffix(name)
    return s in _MAPS or s.startswith(_MAP_PREFIXES)


class Padded(tuple):
    """What model.to_tokens([...]) returns: the pair (tokens [B, T], lengths
    [B]) that unpacks as before (``toks, lens = model.to_tokens([a, b])``),
    which also remembers its padding: ``.padding_side`` ("right" or "left")
    and ``.pad_id``. Every batch path (forward, run_with_cache,
    run_with_hooks) reads the side from it, so a left-padded batch passed
    back is never read as right-padded; giving another padding_side= with it
    is an Error."""

    tokens: np.ndarray
    lengths: np.ndarray
    padding_side: str
    pad_id: int

    def __new__(cls, tokens: np.ndarray, lengths: np.ndarray, padding_side: str, pad_id: int = 0) -> Padded:
        self = super().__new__(cls, (tokens, lengths))
        self.tokens, self.lengths = tokens, lengths
        self.padding_side, self.pad_id = padding_side, int(pad_id)
        return self

    def __getnewargs__(self):  # pickles with its side
        return (self.tokens, self.lengths, self.padding_side, self.pad_id)

    def __repr__(self) -> str:
        return "Padded(tokens=%r, lengths=%r, padding_side=%r, pad_id=%d)" % (
            self.tokens,
            self.lengths,
            self.padding_side,
            self.pad_id,
        )


def is_padded_pair(x) -> bool:
    """Is x a (tokens [B, T], lengths [B]) pair (a Padded or a bare tuple)?"""
    return isinstance(x, tuple) and len(x) == 2 and np.ndim(x[0]) == 2 and np.ndim(x[1]) == 1


def pad(rows: Sequence[np.ndarray], padding_side: str = "right", pad_id: int = 0) -> Padded:
    """Pad 1-D token arrays to [B, max T]; returns Padded (tokens, lengths)
    that remembers padding_side."""
    if not is_choice(padding_side, ("right", "left")):
        raise ArgumentError("padding_side must be 'right' or 'left', not %r" % (padding_side,))
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
    return Padded(out, np.array([r.size for r in rows], dtype=np.int64), padding_side, pad_id)


def _looks_left_padded(a: np.ndarray, lengths: np.ndarray) -> int | None:
    """A row of a batch read as right-padded that is left-padded instead:
    every shorter row starts with T - length copies of one token (the pad),
    and some such row's right tail (what right padding would call padding)
    holds other tokens. Returns such a row's index, or None."""
    T = a.shape[1]
    short = [b for b in range(a.shape[0]) if lengths[b] < T]
    if not short or sum(T - int(lengths[b]) for b in short) < 2:
        return None  # one padded position says nothing
    v = a[short[0], 0]
    if not all(np.all(a[b, : T - int(lengths[b])] == v) for b in short):
        return None
    for b in short:
        if np.any(a[b, int(lengths[b]) :] != v):
            return b
    return None


def _roll_rows(a: np.ndarray, shifts: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Row b of a (axis 0) rolled by shifts[b] along each of axes."""
    out = np.empty_like(a)
    for b, k in enumerate(shifts):
        out[b] = np.roll(a[b], int(k), axis=tuple(x - 1 for x in axes)) if k else a[b]
    return out


def _pos_axes(name: str) -> tuple[int, ...]:
    return (2, 3) if is_map(name) else (1,)


def normalize(model, tokens, lengths=None, padding_side: str | None = None, prepend_bos: bool | None = None):
    """(tokens as given: [T] or [B, T] int array, lengths or None, batched,
    padding side). Text is tokenized with model.to_tokens (prepend_bos: see
    there).

    The side of a padded batch: a Padded (to_tokens) carries it; otherwise
    padding_side= says it; a bare (tokens, lengths) pair or lengths= with
    no padding_side is read as right-padded after a check: a batch that
    looks left-padded (pad tokens in front, tokens in the right tail) is
    refused, never misread."""
    if padding_side is not None and not is_choice(padding_side, ("right", "left")):
        raise ArgumentError("padding_side must be 'right' or 'left', not %r" % (padding_side,))
    side_known = padding_side is not None
    if is_padded_pair(tokens):
        if lengths is not None:
            raise ArgumentError("lengths given twice (in the tokens tuple and as lengths=)")
        if isinstance(tokens, Padded):
            if padding_side is not None and padding_side != tokens.padding_side:
                raise ArgumentError(
                    "padding_side=%r, but these tokens were padded on the %s (to_tokens(..., padding_side=%r)); "
                    "drop padding_side= or pad them again" % (padding_side, tokens.padding_side, tokens.padding_side)
                )
            padding_side, side_known = tokens.padding_side, True
        tokens, lengths = tokens
    side = padding_side or "right"
    if isinstance(tokens, (list, tuple)) and tokens and all(isinstance(t, str) for t in tokens):
        if lengths is not None:
            raise ArgumentError("lengths= goes with a [B, T] token array, not with a list of strings")
        tokens, lengths = model.to_tokens(list(tokens), padding_side=side, prepend_bos=prepend_bos)
        side_known = True
    elif isinstance(tokens, str):
        tokens = model.to_tokens(tokens, prepend_bos=prepend_bos)
    a = token_array(tokens)
    if lengths is not None:
        if a.ndim != 2:
            raise Error("lengths= needs [B, T] tokens, got shape %s" % (a.shape,))
        try:
            ln = np.asarray(lengths)
        except (ValueError, TypeError, OverflowError):  # ragged, or ints past int64
            ln = np.asarray([], dtype=object)
        if ln.ndim != 1 or ln.shape[0] != a.shape[0] or ln.dtype.kind not in "iu":
            raise ArgumentError("lengths must be [B] = [%d] integers, got %r" % (a.shape[0], lengths))
        if ln.size and (ln.min() < 1 or ln.max() > a.shape[1]):
            raise ArgumentError("lengths must be in [1, T=%d], got %s" % (a.shape[1], ln.tolist()))
        lengths = ln.astype(np.int64)
        if not side_known and a.dtype.kind in "iu":
            b = _looks_left_padded(a, lengths)
            if b is not None:
                raise ArgumentError(
                    "tokens: row %d looks left-padded (its first %d tokens are all %d, its right tail holds other "
                    "tokens) but no padding side was given, and a bare (tokens, lengths) pair is read as right-padded; "
                    "pass padding_side='left' (or 'right' if this is right), or use what model.to_tokens([...]) "
                    "returns, which remembers its side" % (b, a.shape[1] - int(lengths[b]), int(a[b, 0]))
                )
    return a, lengths, a.ndim == 2, side


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
    prompts: tuple,
    return_type: str | None = "logits",
    *,
    capture: Sequence[str] = (),
    fns=(),
    with_cache: bool = False,
    loss_per_token: bool = False,
):
    """The one path of forward / run_with_cache / run_with_hooks; prompts is their
    (tokens, lengths, padding_side, prepend_bos) as given."""
    tokens, lengths, padding_side, prepend_bos = prompts
    if not is_choice(return_type, ("logits", "loss", "both", None)):
        raise ArgumentError("return_type must be 'logits', 'loss', 'both' or None, not %r" % (return_type,))
    a, lengths, batched, padding_side = normalize(model, tokens, lengths, padding_side, prepend_bos)
    if a.ndim not in (1, 2):
        raise ArgumentError("tokens must be a non-empty [T] or [B, T] array, got shape %s" % (a.shape,))
    if not batched and model.always_batch:
        a, batched = a[None], True
    fns = model.hooks_in_force(fns)
    shifts = None
    if batched and lengths is not None and padding_side == "left":
        shifts = (a.shape[1] - lengths).astype(np.int64)
        if shifts.any():
            a = _roll_rows(np.asarray(a), -shifts, (1,))
            fns = [(n, _left_view(fn, n, shifts)) for n, fn in fns]
        else:
            shifts = None
    need_logits = return_type is not None
    model.token_ids(a)  # checked, and a ContextWarning for a long prompt
    logits, cache = model.runner.run(a, capture=list(capture), fns=fns, logits=need_logits)
    if fns:
        _apply_mask_rule(model, cache)
    if shifts is not None:
        if logits is not None:
            logits = _roll_rows(logits, shifts, (1,))
        for k in list(cache):
            dict.__setitem__(cache, k, _roll_rows(cache[k], shifts, _pos_axes(k)))
        a = _roll_rows(a, shifts, (1,))
    cache.model = model
    cache.has_batch_dim = bool(batched)
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


def _apply_mask_rule(model, cache) -> None:  # cache: a dclens.Cache
    """Cached post-softmax maps show what the pass used: masked cells 0
    (the engine zeroes them after a hook writes there; hooks.md)."""
    for k in list(cache):
        s = _suffix(k)
        if not (s in _POST_SOFTMAX or s.startswith("attn.post.")):
            continue
        v = cache[k]
        T, S = v.shape[-2:]
        masked = ~allowed(T, S, layer_window(model, int(k.split(".")[1])))
        if not np.all(v[..., masked] == 0):
            v = v.copy()
            v[..., masked] = 0
            dict.__setitem__(cache, k, v)


# ---------------------------------------------------------------- prompt pairs


class Pairs(NamedTuple):
    """Prompt pairs as the pair analyses (dclens.graph, patching.sweep over
    pairs) run them: clean and corrupted
    [B, T] int64, right-padded, and each pair's length [B] (both prompts of a
    pair have it: positions past it are padding, which no real position
    reads, the attention being causal)."""

    clean: np.ndarray
    corrupted: np.ndarray
    lengths: np.ndarray

    @property
    def padded(self) -> bool:
        return bool(np.any(self.lengths < self.clean.shape[1]))


def _rows(model, x, what: str) -> tuple[np.ndarray, np.ndarray]:
    """One side's prompts as right-padded [B, T] int64 and lengths [B]."""
    if isinstance(x, str):
        x = [x]
    if isinstance(x, (list, tuple)) and x and all(isinstance(s, str) for s in x):
        x = model.to_tokens(list(x))  # a Padded, on the right
    if is_padded_pair(x):
        toks, lens = np.asarray(x[0]), np.asarray(x[1])
        if toks.dtype.kind not in "iu" or lens.dtype.kind not in "iu" or lens.shape != toks.shape[:1]:
            raise ArgumentError("%s: a (tokens [B, T], lengths [B]) pair of integers, got %r" % (what, x))
        T = toks.shape[1]
        if np.any(lens < 1) or np.any(lens > T):
            raise ArgumentError("%s: lengths must be in 1..%d (the tokens' T), got %s" % (what, T, lens.tolist()))
        side = x.padding_side if isinstance(x, Padded) else "right"
        if not isinstance(x, Padded):
            b = _looks_left_padded(toks, lens)
            if b is not None:
                raise ArgumentError(
                    "%s: row %d of this (tokens, lengths) pair looks left-padded; pass the Padded that "
                    "model.to_tokens returns (it knows its side) or right-padded tokens" % (what, b)
                )
        if side == "left":  # the same prompts, right-padded (positions are relative: rotary)
            toks = np.stack([np.roll(r, -(T - int(n))) for r, n in zip(toks, lens)])
        return toks.astype(np.int64), lens.astype(np.int64)
    a = token_array(x)
    if a.ndim == 1:
        a = a[None]
    if a.ndim != 2 or a.size == 0 or a.dtype.kind not in "iu":
        raise ArgumentError(
            "%s must be prompts: a string, a list of strings, [B, T] integer tokens or a (tokens, lengths) "
            "pair from model.to_tokens" % what
        )
    return a.astype(np.int64), np.full(a.shape[0], a.shape[1], np.int64)


def prompt_pairs(model, clean, corrupted) -> Pairs:
    """Clean and corrupted prompts, paired up: padded to one T on the right
    (different lengths across pairs), one length within each pair."""
    c, lc = _rows(model, clean, "clean")
    x, lx = _rows(model, corrupted, "corrupted")
    if len(c) != len(x):
        raise ArgumentError("clean and corrupted must pair up: %d vs %d prompts" % (len(c), len(x)))
    bad = np.nonzero(lc != lx)[0]
    if bad.size:
        b = int(bad[0])
        raise ArgumentError(
            "clean and corrupted must pair up: pair %d has %d clean and %d corrupted tokens (edge patching "
            "compares them position by position: one length per pair)" % (b, lc[b], lx[b])
        )
    T = max(c.shape[1], x.shape[1])
    c = np.pad(c, ((0, 0), (0, T - c.shape[1])))
    x = np.pad(x, ((0, 0), (0, T - x.shape[1])))
    return Pairs(c, x, lc)


def role_weights(roles, lengths: np.ndarray, T: int) -> tuple[tuple[str, ...], np.ndarray]:
    """The role names and W [B, T, R]: 1 where position t of pair b is in role r."""
    B = len(lengths)
    if isinstance(roles, dict):
        roles = [roles] * B
    if not isinstance(roles, (list, tuple)) or len(roles) != B or not all(isinstance(r, dict) for r in roles):
        raise ArgumentError(
            "roles must be a dict {role: position, span or positions} for every pair, or a list of %d such "
            "dicts (one per pair), not %r" % (B, roles)
        )
    names = tuple(roles[0])
    if not names or not all(isinstance(n, str) for n in names):
        raise ArgumentError("roles: name the roles with strings, got %r" % (list(names),))
    W = np.zeros((B, T, len(names)), np.float32)
    for b, rb in enumerate(roles):
        if tuple(rb) != names:
            raise ArgumentError(
                "roles: pair %d names roles %s, pair 0 %s (the same roles, in one order)" % (b, list(rb), list(names))
            )
        n = int(lengths[b])
        for r, name in enumerate(names):
            spec = rb[name]
            if isinstance(spec, tuple) and len(spec) == 2:
                lo, hi = (int(check_index("roles[%r] of pair %d" % (name, b), v, -n, n + 1)) for v in spec)
                lo, hi = lo % n if lo < 0 else lo, hi % n if hi < 0 else hi
                if not lo < hi:
                    raise ArgumentError("roles[%r] of pair %d: the span %r is empty" % (name, b, spec))
                at = list(range(lo, hi))
            else:
                at = [spec] if not isinstance(spec, (list, range)) else list(spec)
                at = [int(check_index("roles[%r] of pair %d" % (name, b), v, -n, n)) % n for v in at]
                if not at:
                    raise ArgumentError("roles[%r] of pair %d: no position" % (name, b))
            W[b, at, r] = 1.0
    return names, W
