"""Generation with the engine's incremental decoder (dcs_decoder in dclens.h).

The decoder keeps per layer the K/V cache and the KW cache (key-side
composition weights kw1, kw2, kdd of both phases, as the published DCFormer
module keeps); local layers keep only their window. Feeding tokens step by
step gives the logits of a full forward over the whole text (tested).

    text = model.generate("The cat", max_new_tokens=20)              # greedy
    ids = model.generate(toks, 20, temperature=0.8, top_k=40, seed=0, return_type="tokens")

Hooks work while decoding: fwd_hooks are called at every step with the
step's activations ([1, n, ...] for the n tokens fed; attention maps
[1, N, n, P] over the P positions so far, see dclens.h).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core.checks import ArgumentError, EngineObject, Error, check_index, check_str, is_choice, token_array
from .._core.hooks import HookFn

if TYPE_CHECKING:
    from .._core.protocols import ModelLike as Model


class Decoder(EngineObject):
    """An incremental decoding session on a model (one sequence).

    >>> dec = Decoder(model)
    >>> logits = dec.step(prompt_ids)      # [n, V]: prefill
    >>> logits = dec.step([next_id])       # [1, V]

    Parameters
    ----------
    model : dclens.Model
        The model; the engine keeps it alive until its last decoder is freed.

    Raises
    ------
    dclens.Error
        The engine cannot make a decoder (out of memory).
    """

    def __init__(self, model: Model):
        self.model = model
        self._d = model.runner.new_decoder()  # the engine's decoder (runner.EngineDecoder)

    @property
    def pos(self) -> int:
        """Tokens fed so far."""
        return self._d.pos()

    def layer_keys(self, layer: int) -> int:
        """The key positions a layer's caches hold now.

        Parameters
        ----------
        layer : int
            The layer, in [0, n_layer).

        Returns
        -------
        int
            The positions held: every token fed so far, or at most window_size + 1 on a local
            layer.

        Raises
        ------
        dclens.ArgumentError
            A layer out of range (dclens.ArgumentTypeError: not an integer).
        """
        layer = check_index(
            "layer", layer, 0, self.model.config.n_layer, " (model has %d layers)" % self.model.config.n_layer
        )
        n = self._d.layer_keys(layer)
        if n < 0:
            raise ArgumentError("layer %r is out of range (model has %d layers)" % (layer, self.model.config.n_layer))
        return n

    def step(self, tokens, fwd_hooks: Sequence[tuple[str, HookFn]] = (), logits: bool = True, cache_names=()) -> Any:
        """Feed the next tokens and compute them against everything fed before.

        Parameters
        ----------
        tokens : array_like of int
            [n] token ids (n >= 1; the first step is the prompt, later ones usually one).
        fwd_hooks : sequence of (str, callable)
            Hooks called with this step's activations ([1, n, ...]; attention maps
            [1, N, n, P] over the P positions so far), on top of the model's hooks in force.
        logits : bool
            Compute the logits (False: None in their place, for a step only hooks read).
        cache_names : sequence of str or None
            Hook names to keep this step's activations of (None: every hook; empty: none).

        Returns
        -------
        logits : numpy.ndarray or None
            [n, V] float32, the logits of the n tokens.
        cache : dclens.Cache
            Only when cache_names is None or not empty, as ``(logits, cache)``: this step's
            activations.

        Raises
        ------
        dclens.ArgumentError
            Tokens that are not a non-empty integer array, or an id outside the vocabulary.
        dclens.Error
            Logits holding NaN or inf, an unknown hook name (UnknownNameError), a hook
            function that fails, or more positions than a decoder takes (16M).
        """
        m = self.model
        toks = np.ascontiguousarray(token_array(tokens).reshape(-1))
        if toks.size == 0 or toks.dtype.kind not in "iu":
            raise ArgumentError("decode: tokens must be a non-empty integer array, got %r" % (tokens,))
        if toks.min() < 0 or toks.max() >= m.config.vocab:
            raise ArgumentError(
                "decode: token id %d is out of range [0, %d)"
                % (toks.max() if toks.max() >= m.config.vocab else toks.min(), m.config.vocab)
            )
        toks = toks.astype(np.int32)
        r = m.runner
        run = r.new_run(False)
        want_cache = cache_names is None or bool(cache_names)
        fns = [(m.resolve_hook(name), fn) for name, fn in m.hooks_in_force(fwd_hooks)]
        want = r.hook_plan(run, r.select(cache_names) if want_cache else (), fns)
        out = np.empty((toks.size, m.config.vocab), dtype=np.float32) if logits else None
        self._d.step(run, want, toks, out)
        if out is not None and not np.isfinite(out).all():
            raise Error(
                "decode: the logits hold NaN or inf (non-finite weights, an overflow, or a hook that wrote huge values)"
            )
        run.cache.model = m
        return (out, run.cache) if want_cache else out


def _sample(logits: np.ndarray, temperature: float, top_k: int | None, rng) -> int:
    if temperature == 0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / temperature
    if not np.all(np.isfinite(x)):  # a temperature so small the logits overflow: its limit, the argmax
        return int(np.argmax(logits))
    if top_k is not None and top_k < x.size:
        cut = np.partition(x, -top_k)[-top_k]
        x = np.where(x >= cut, x, -np.inf)
    x = x - x.max()
    p = np.exp(x)
    p /= p.sum()
    return int(rng.choice(x.size, p=p))


def _stops(stop, vocab: int):
    """stop (None, a token id, a string, or a list / tuple / 1-D array of
    them) -> (set of ids in [0, vocab), list of non-empty strings)."""
    if stop is None:
        return set(), []
    if isinstance(stop, (str, numbers.Integral, np.integer)) and not isinstance(stop, (bool, np.bool_)):
        items = [stop]
    elif isinstance(stop, (list, tuple)) or (isinstance(stop, np.ndarray) and stop.ndim == 1):
        items = list(stop)
    else:
        raise Error(
            "generate: stop must be a token id, a string, or a list of them, not %s %r" % (type(stop).__name__, stop)
        )
    ids, strs = set(), []
    for s in items:
        if isinstance(s, str):
            if not s:
                raise Error("generate: stop holds an empty string (it would stop at once)")
            strs.append(check_str("generate: stop string", s))
        else:
            ids.add(check_index("generate: stop token id", s, 0, vocab, " (the vocabulary)"))
    return ids, strs


def generate(
    model: Model,
    prompt,
    max_new_tokens: int = 20,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop: None | str | int | Sequence[str | int] = None,
    seed: int | None = None,
    fwd_hooks: Sequence[tuple[str, HookFn]] = (),
    return_type: str = "auto",
    verbose: bool = False,
):
    """Continue `prompt` (a string, a [T] token array, or a list of either)
    by up to max_new_tokens tokens.

    temperature=0 is greedy (argmax); otherwise softmax(logits / temperature)
    sampling, restricted to the top_k tokens when top_k is given (seed for a
    repeatable stream). stop: a token id, a string, or a list of them;
    generation ends after a stop token, or once the decoded continuation
    contains a stop string (the string is kept). return_type: "str" (prompt
    plus continuation), "tokens" (prompt ids plus new ids, [T + new]), or
    "auto" (str for a str prompt, tokens otherwise). A list of prompts gives
    a list of results (each decoded on its own).

    Parameters
    ----------
    model : dclens.Model
        The model.
    prompt : str or array_like of int or list
        A string, [T] token ids, or a list of either.
    max_new_tokens : int
        At most this many new tokens (>= 0).
    temperature : float
        0: greedy; > 0: sampling from softmax(logits / temperature).
    top_k : int or None
        Sample among the top_k tokens only (>= 1; None: all).
    stop : str or int or sequence of str or int or None
        Stop after this token id, or once the continuation contains this string (kept).
    seed : int or None
        The sampler's seed (>= 0), for a repeatable stream.
    fwd_hooks : sequence of (str, callable)
        Hooks called at every decoding step (Decoder.step).
    return_type : {"auto", "str", "tokens"}
        "str": the prompt plus the continuation as text; "tokens": [T + new] int64 ids;
        "auto": str for a str prompt, tokens otherwise.
    verbose : bool
        Print each new token as it comes.

    Returns
    -------
    str or numpy.ndarray or list
        The prompt and its continuation (see return_type); a list of them for a list of
        prompts.

    Raises
    ------
    dclens.ArgumentError
        A negative max_new_tokens or seed, a negative or non-finite temperature, a top_k
        below 1, an unknown return_type, or an empty prompt or one not [T].
    dclens.Error
        A stop that is not a token id, a non-empty string or a list of them, or a failing
        decoding step (Decoder.step).
    """
    if isinstance(prompt, (list, tuple)) and prompt and (isinstance(prompt[0], str) or np.ndim(prompt[0]) == 1):
        return [
            generate(model, p, max_new_tokens, temperature, top_k, stop, seed, fwd_hooks, return_type, verbose)
            for p in prompt
        ]
    check_index("generate: max_new_tokens", max_new_tokens, 0, 2**31)
    if not (
        isinstance(temperature, (numbers.Real, np.floating, np.integer))
        and not isinstance(temperature, (bool, np.bool_))
        and np.isfinite(temperature)
        and temperature >= 0
    ):
        raise ArgumentError("generate: temperature must be a finite number >= 0, got %r" % (temperature,))
    if top_k is not None:
        check_index("generate: top_k", top_k, 1, 2**31, " (or None)")
    if not is_choice(return_type, ("auto", "str", "tokens")):
        raise ArgumentError("generate: return_type must be 'auto', 'str' or 'tokens', not %r" % (return_type,))
    is_text = isinstance(prompt, str)
    toks = model.to_tokens(prompt) if is_text else token_array(prompt)
    if toks.ndim != 1 or toks.size == 0:
        raise ArgumentError(
            "generate: the prompt must be a non-empty string or [T] token array, got shape %s" % (toks.shape,)
        )
    if toks.size + max_new_tokens > 1 << 24:
        raise ArgumentError(
            "generate: max_new_tokens %d after a %d-token prompt is more positions than a decoder takes (16M)"
            % (max_new_tokens, toks.size)
        )
    stop_ids, stop_strs = _stops(stop, model.config.vocab)
    if stop_strs:  # matched against the decoded continuation: the tokenizer is needed before any step
        try:
            _ = model.tokenizer
        except Error as e:
            raise Error("generate: stop strings %r need the model's tokenizer: %s" % (stop_strs, e)) from None
    if seed is not None:
        check_index("generate: seed", seed, 0, 2**63)
    rng = np.random.default_rng(seed)
    dec = Decoder(model)
    new: list[int] = []
    if max_new_tokens:
        logits = dec.step(toks, fwd_hooks=fwd_hooks)[-1]
        for i in range(max_new_tokens):
            t = _sample(logits, float(temperature), top_k, rng)
            new.append(t)
            if verbose:
                print(model.to_string([t]), end="", flush=True)
            if t in stop_ids or (stop_strs and any(s in model.to_string(new) for s in stop_strs)):
                break
            if i + 1 < max_new_tokens:
                logits = dec.step([t], fwd_hooks=fwd_hooks)[-1]
    out = np.concatenate([np.asarray(toks, dtype=np.int64), np.asarray(new, dtype=np.int64)])
    if return_type == "tokens" or (return_type == "auto" and not is_text):
        return out
    return model.to_string(out)
