"""What a feature's dashboard shows (SAELens / Neuronpedia): its top-activating contexts over a
token source, streamed one pass at a time, and the logit effect of its decoder direction
(docs/features.md, "Features as hooks").
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._core.checks import ArgumentError, Error, check_index, check_int_list
from .._core.names import canonical
from .sae import SAE, check_fits

# hooks whose activation is (a term of) the residual stream: a decoder direction there is read
# by the final norm and the unembedding
_RESID = ("resid_pre", "resid_mid", "resid_post", "mlp.out", "attn.out", "embed")


def _check_k(k, what: str = "k") -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ArgumentError("%s must be an integer >= 1, not %r" % (what, k))
    return int(k)


class TopActivations(NamedTuple):
    """The top-k contexts of each feature (best first; ties to the earlier token).

    Attributes
    ----------
    features : numpy.ndarray
        int64 [n_f]: the features, in the order asked.
    acts : numpy.ndarray
        float32 [n_f, k]: their activations there.
    seq : numpy.ndarray
        int64 [n_f, k]: the sequence's index in the source.
    pos : numpy.ndarray
        int64 [n_f, k]: the position in that sequence.
    tokens : numpy.ndarray
        int32 [n_f, k, T]: that sequence's tokens.
    """

    features: np.ndarray
    acts: np.ndarray
    seq: np.ndarray
    pos: np.ndarray
    tokens: np.ndarray


def top_activating(
    model,
    sae: SAE,
    source,
    k: int = 10,
    *,
    features=None,
    n_seqs: int | None = None,
    seqs_per_batch: int = 8,
    start: int = 0,
) -> TopActivations:
    """The k token positions where each feature is most active over a token source.

    One pass per ``seqs_per_batch`` sequences; only the running top k (and its sequences'
    tokens) is kept between passes, never the dataset.

    Parameters
    ----------
    model : dclens.Model
        The model whose activations the dictionary reads.
    sae : SAE
        The dictionary (a transcoder: encoded from its input hook).
    source : object
        A token source (dclens.features.TokenArrays, TextFile, JsonlFile).
    k : int
        Contexts per feature.
    features : int or sequence of int or None
        Which features (None: all d_sae).
    n_seqs : int or None
        Read at most this many sequences (None: to the source's end).
    seqs_per_batch : int
        Sequences per pass.
    start : int
        The first sequence.

    Returns
    -------
    TopActivations
        features, acts, seq, pos [n_f, k] and the contexts' tokens [n_f, k, T].

    Raises
    ------
    dclens.Error
        A dictionary that does not fit the model, a feature out of range (naming features),
        k < 1 or more than the positions the source gave, an unbounded source without n_seqs.
    """
    check_fits(model, sae)
    k = _check_k(k)
    seqs_per_batch = _check_k(seqs_per_batch, "seqs_per_batch")
    if features is None:
        feats = np.arange(sae.cfg.d_sae)
    else:
        v = [features] if isinstance(features, (int, np.integer)) and not isinstance(features, bool) else features
        feats = np.asarray(check_int_list("features", v, 0, sae.cfg.d_sae), np.int64)
    if n_seqs is None and getattr(source, "n", 0) is None and not hasattr(source, "path"):
        raise ArgumentError("n_seqs is needed with an unbounded source (a token function without n)")
    if n_seqs is not None:
        _check_k(n_seqs, "n_seqs")
    T = int(source.context_size)
    nf = len(feats)
    best = np.full((nf, 0), -np.inf, np.float32)
    best_row = np.zeros((nf, 0), np.int64)  # global row: seq * T + pos
    best_tok: np.ndarray = np.zeros((nf, 0, T), np.int32)
    at, stop = int(start), None if n_seqs is None else int(start) + int(n_seqs)
    while stop is None or at < stop:
        n = seqs_per_batch if stop is None else min(seqs_per_batch, stop - at)
        toks = np.asarray(source.batch(at, n), np.int32)
        if len(toks) == 0:
            break
        _, cache = model.run_with_cache(toks, names=[sae.cfg.hook_name], return_type=None)
        x = np.asarray(cache[sae.cfg.hook_name], np.float32)
        a = sae.encode(x.reshape(x.shape[0] * x.shape[1], -1))[:, feats].T  # [n_f, rows]
        rows = at * T + np.arange(a.shape[1], dtype=np.int64)
        # the kept ones come first and have lower rows: a stable sort breaks ties to the earlier token
        vals = np.concatenate([best, a], 1)
        order = np.argsort(-vals, axis=1, kind="stable")[:, :k]
        cand_row = np.concatenate([best_row, np.broadcast_to(rows, a.shape)], 1)
        kept = best.shape[1]
        old = order < kept
        tok = np.empty(order.shape + (T,), np.int32)
        tok[old] = best_tok[np.nonzero(old)[0], order[old]]
        tok[~old] = toks[(order[~old] - kept) // T]
        best, best_row, best_tok = np.take_along_axis(vals, order, 1), np.take_along_axis(cand_row, order, 1), tok
        at += len(toks)
    if best.shape[1] < k:
        raise ArgumentError("k (%d) is more than the %d positions the source gave" % (k, best.shape[1]))
    return TopActivations(feats, best, best_row // T, best_row % T, best_tok)


class LogitEffect(NamedTuple):
    """A feature's direct effect on the logits (the "logit lens" of its decoder direction).

    Attributes
    ----------
    effect : numpy.ndarray
        float32 [V]: (W_dec[feature] * ln_final_w) @ W_U.
    top, bottom : numpy.ndarray
        int64 [k]: the tokens it raises most / lowers most (ties to the lower id).
    top_values, bottom_values : numpy.ndarray
        float32 [k]: effect at those tokens.
    """

    effect: np.ndarray
    top: np.ndarray
    top_values: np.ndarray
    bottom: np.ndarray
    bottom_values: np.ndarray


def feature_logit_effect(model, sae: SAE, feature: int, k: int = 10) -> LogitEffect:
    """The logit effect of a feature's decoder direction: through the final norm's weight and
    the unembedding, the tokens it promotes and suppresses (SAELens / Neuronpedia).

    Parameters
    ----------
    model : dclens.Model
        The model.
    sae : SAE
        A dictionary writing to the residual stream (its output hook resid_*, attn.out or
        mlp.out, of width d_model).
    feature : int
        The feature (0 .. d_sae - 1).
    k : int
        Tokens at each end (1 .. d_vocab).

    Returns
    -------
    LogitEffect
        effect [V] and the top / bottom k tokens with their values.

    Raises
    ------
    dclens.Error
        A dictionary that does not fit the model or does not write to the residual stream,
        a feature out of range (naming feature), k outside 1..d_vocab.
    """
    check_fits(model, sae)
    f = check_index("feature", feature, 0, sae.cfg.d_sae)
    V = int(model.cfg.d_vocab)
    k = _check_k(k)
    if k > V:
        raise ArgumentError("k (%d) is more than the vocabulary (%d tokens)" % (k, V))
    out = canonical(sae.cfg.hook_name_out or sae.cfg.hook_name)
    suffix = out.split(".", 2)[2] if out.startswith("blocks.") else out
    if suffix not in _RESID or sae.cfg.width_out != model.cfg.d_model:
        raise Error(
            "sae writes to %s, not the residual stream (%s): its decoder directions have no logit effect"
            % (out, ", ".join(_RESID))
        )
    d = sae.W_dec[f].astype(np.float64) * np.asarray(model.ln_final_w, np.float64)
    effect = (d @ np.asarray(model.W_U, np.float64)).astype(np.float32)
    up = np.argsort(-effect, kind="stable")[:k]
    down = np.argsort(effect, kind="stable")[:k]
    return LogitEffect(effect, up.astype(np.int64), effect[up], down.astype(np.int64), effect[down])
