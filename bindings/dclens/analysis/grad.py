"""Gradients: the engine's tape (forward keeping activations, then backward)
seen from Python, and Model.gradients.

Targets (one scalar per sequence; a batch's gradient w.r.t. an activation of
sequence b is that of sequence b's own target, as if run one by one):

* ``("logit", pos, token)``         logits[pos, token]
* ``("logprob", pos, token)``       log softmax(logits[pos])[token]
* ``("logit_diff", pos, good, bad)`` logits[pos, good] - logits[pos, bad]
* ``"loss"`` or ``("loss", mask)``  mean next-token cross-entropy over the
  predicting positions t < T-1 (mask: bool [T] or [B, T] selecting them)

``pos`` may be negative (from the end). Gradients can be asked at every hook
point of the model (hooks.md layout, batch axis first for a 2-D token array)
and for every parameter by canonical name (``Model.weight`` names).

Weights stay in their stored dtype (an F16/BF16 checkpoint is not widened);
the tape follows the memory plan of memplan.py under ``max_tape_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._core import memplan, tapes
from .._core.checks import Error
from .._core.memplan import param_table
from .._core.tapes import Tape  # noqa: F401  (dclens.grad.Tape: its home before tapes.py)


def _weight_shape(model, name: str) -> tuple[int, ...]:
    """A weight's shape, without reading it (Model.weight would widen it)."""
    return model.runner.weight_shape(name)


# ------------------------------------------------------------------ targets


def _pos(pos, T: int, what: str) -> int:
    if not isinstance(pos, (int, np.integer)) or not -T <= int(pos) < T:
        raise Error("target %s: position %r is outside the sequence of %d tokens" % (what, pos, T))
    return int(pos) % T


def _tok(tok, V: int, what: str) -> int:
    if not isinstance(tok, (int, np.integer)) or not 0 <= int(tok) < V:
        raise Error("target %s: token %r is outside the vocabulary [0, %d)" % (what, tok, V))
    return int(tok)


def target_value_and_grad(target, logits: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A target's value per sequence and its gradient with respect to the logits.

    Parameters
    ----------
    target : str or tuple
        ("logit", pos, token), ("logprob", pos, token), ("logit_diff", pos, good, bad),
        "loss" or ("loss", mask) (the module's docstring); pos may be negative (from the end).
    logits : numpy.ndarray
        [B, T, V] logits of the sequences.
    tokens : numpy.ndarray
        [B, T] token ids of the sequences (the "loss" target reads the next tokens).

    Returns
    -------
    values : numpy.ndarray
        [B] float64: the target of each sequence.
    grad : numpy.ndarray
        [B, T, V] float32: d(sum of values) / d logits.

    Raises
    ------
    dclens.Error
        A target of an unknown kind or the wrong length, a position outside the sequence, a
        token outside the vocabulary, a loss on fewer than 2 tokens, or a loss mask that is
        not bool [T] / [B, T] or selects no predicting position of a sequence.
    """
    B, T, V = logits.shape
    d = np.zeros((B, T, V), np.float32)  # float64 where it is computed: one row per sequence
    if isinstance(target, str):
        target = (target,)
    if not isinstance(target, (tuple, list)) or not target or not isinstance(target[0], str):
        raise Error(
            "target must be ('logit', pos, tok), ('logprob', pos, tok), "
            "('logit_diff', pos, good, bad) or 'loss' / ('loss', mask); got %r" % (target,)
        )
    kind = target[0]
    if kind in ("logit", "logprob"):
        if len(target) != 3:
            raise Error("target %s needs (kind, pos, token), got %r" % (kind, target))
        p, t = _pos(target[1], T, kind), _tok(target[2], V, kind)
        row = logits[:, p].astype(np.float64)
        val = row[:, t].copy()
        dp = np.zeros_like(row)
        dp[:, t] = 1.0
        if kind == "logprob":
            mx = row.max(-1, keepdims=True)
            e = np.exp(row - mx)
            sm = e / e.sum(-1, keepdims=True)
            val = val - (np.log(e.sum(-1)) + mx[:, 0])
            dp -= sm
        d[:, p] = dp
    elif kind == "logit_diff":
        if len(target) != 4:
            raise Error("target logit_diff needs (kind, pos, good, bad), got %r" % (target,))
        p = _pos(target[1], T, kind)
        g, b = _tok(target[2], V, kind), _tok(target[3], V, kind)
        val = logits[:, p, g].astype(np.float64) - logits[:, p, b].astype(np.float64)
        d[:, p, g] += 1.0
        d[:, p, b] -= 1.0
    elif kind == "loss":
        if len(target) > 2:
            raise Error("target loss takes an optional mask only, got %r" % (target,))
        if T < 2:
            raise Error("target loss needs at least 2 tokens")
        mask = np.ones((B, T), bool)
        if len(target) == 2 and target[1] is not None:
            mk = np.asarray(target[1])
            if mk.dtype != bool or mk.shape not in ((T,), (B, T)):
                raise Error("loss mask must be a bool array of shape [T] or [B, T], got %s %s" % (mk.dtype, mk.shape))
            mask = np.broadcast_to(mk, (B, T)).copy()
        mask[:, T - 1] = False
        val = np.zeros(B)
        for b in range(B):
            pos = np.nonzero(mask[b])[0]
            if not len(pos):
                raise Error("loss mask selects no predicting position in sequence %d" % b)
            nxt = tokens[b, pos + 1]
            row = logits[b, pos].astype(np.float64)
            mx = row.max(-1, keepdims=True)
            e = np.exp(row - mx)
            lse = np.log(e.sum(-1)) + mx[:, 0]
            val[b] = float(np.mean(lse - row[np.arange(len(pos)), nxt]))
            sm = e / e.sum(-1, keepdims=True)
            sm[np.arange(len(pos)), nxt] -= 1.0
            d[b, pos] = sm / len(pos)
    else:
        raise Error("unknown target kind %r (logit, logprob, logit_diff, loss)" % (kind,))
    return val, d


# ------------------------------------------------------------------ gradients


def gradients(model, tokens, target, wrt: Sequence[str], return_value: bool = False, max_tape_bytes: int | None = None):
    """The gradient of a target with respect to hook activations and parameters.

    Model.gradients calls this. One gradient pass (forward keeping activations, then
    backward) on the engine's tape; a batch's gradient for sequence b is that of sequence
    b's own target, as if run one by one.

    Parameters
    ----------
    model : dclens.Model
        The model (no hooks of Model.hooks() in force: the tape runs no Python hook).
    tokens : array_like of int
        Token ids, [T] or [B, T].
    target : str or tuple
        ("logit", pos, token), ("logprob", pos, token), ("logit_diff", pos, good, bad),
        "loss" or ("loss", mask) (the module's docstring).
    wrt : str or sequence of str
        Hook names (hooks.md) and parameter names (Model.weight's names) to differentiate by.
    return_value : bool
        Also return the target's value.
    max_tape_bytes : int or None
        The tape's memory budget in bytes (None: dclens.memplan's default for the device).

    Returns
    -------
    grads : dict of str to numpy.ndarray
        Name -> float32 gradient: a hook's in its activation layout (with a leading [B] axis
        for [B, T] tokens), a parameter's in the weight's shape (summed over the batch).
    value : numpy.ndarray or float
        Only with return_value=True, as ``(grads, value)``: the target, [B] or a float.

    Raises
    ------
    dclens.Error
        `wrt` empty or not names, a name that is neither a hook of this model nor a
        parameter, a target the tokens cannot take (target_value_and_grad), hooks in force,
        or a budget too small for the pass.
    """
    model.runner.refuse_hooks("gradients")
    toks, batched = model.token_ids(tokens)
    B, T = toks.shape
    if isinstance(wrt, str):
        wrt = [wrt]
    if not isinstance(wrt, (list, tuple)):
        raise Error(
            "gradients: wrt must be a hook or parameter name or a list of them, not %s %r" % (type(wrt).__name__, wrt)
        )
    wrt = list(wrt)
    if not wrt:
        raise Error("gradients: wrt is empty (give hook names or parameter names)")
    params = {r[0]: (i,) + r for i, r in enumerate(param_table(model))}
    hooks, pnames = {}, []
    for n in wrt:
        if isinstance(n, str) and n in params:
            pnames.append(n)
            continue
        try:
            hooks[n] = model.parse_hook(n)
        except Error as e:
            raise Error("gradients: %r is neither a hook of this model nor a parameter name (%s)" % (n, e)) from None
    # a tape of the model's cache (tapes.py): its buffers are reused by the next call
    with tapes.lease(model, B, T, memplan.check_budget(max_tape_bytes, model)) as tape:
        logits = tape.forward(toks)
        val, dl = target_value_and_grad(target, logits, toks)
        # one buffer per parameter asked for (never a flat gradient of all of them)
        pbufs = {params[n][0]: np.zeros(params[n][3], np.float32) for n in pnames}
        g = tape.backward(dl, None, list(hooks.values()), params=pbufs)
    out = {}
    for n, pl in hooks.items():
        a = g[pl]
        out[n] = a if batched else a[0]
    for n in pnames:
        out[n] = pbufs[params[n][0]].reshape(_weight_shape(model, n))
    if return_value:
        return out, (val if batched else float(val[0]))
    return out
