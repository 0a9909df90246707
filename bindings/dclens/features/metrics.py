"""A dictionary's quality as SAELens reports it (docs/features.md, "Quality"):
explained variance, L0, dead and dense features, and the CE loss recovered when the
reconstruction replaces the activation through a write hook."""

from __future__ import annotations

import numpy as np

from .._core.checks import Error
from .sae import SAE, check_fits
from .training import activations


def _splice(sae: SAE, fed: dict):
    """The write hook that puts the reconstruction in place of the activation (an SAE: of the
    activation itself; a transcoder: of the input its read-only partner left in `fed`)."""

    def replace(act, name):
        a = np.asarray(act)
        src = fed["x"] if sae.cfg.is_transcoder else a
        rows = np.asarray(src, np.float32).reshape(-1, sae.cfg.d_in)
        return sae.forward(rows).reshape(a.shape)

    return replace


def _ce_losses(model, sae: SAE, toks: np.ndarray) -> tuple[float, float, float]:
    """(clean, with the reconstruction spliced in, with the activation zeroed) next-token CE."""
    c = sae.cfg
    target = c.hook_name_out if c.is_transcoder else c.hook_name
    fed: dict = {}

    def keep(act, name):
        fed["x"] = np.array(act, np.float32)

    clean = model.forward(toks, return_type="loss")
    hooks = [(target, _splice(sae, fed))]
    if c.is_transcoder:
        hooks.insert(0, (c.hook_name, keep))
    spliced = model.run_with_hooks(toks, fwd_hooks=hooks, return_type="loss")
    zero = model.run_with_hooks(toks, fwd_hooks=[(target, lambda a, n: np.zeros_like(a))], return_type="loss")
    return float(clean), float(spliced), float(zero)


def evaluate(
    model, sae: SAE, source, n_batches: int = 4, seqs_per_batch: int = 4, start: int = 0, dense_threshold: float = 0.1
) -> dict:
    """SAELens's quality numbers of `sae` on sequences of `source`.

    Parameters
    ----------
    model : dclens.Model
        The model.
    sae : SAE
        The dictionary (an SAE or a transcoder).
    source : object
        A token source (dclens.features.sources).
    n_batches, seqs_per_batch : int
        Passes, and sequences per pass.
    start : int
        The first sequence (e.g. past the training's position: held-out data).
    dense_threshold : float
        A feature active on more than this fraction of tokens is dense.

    Returns
    -------
    dict
        explained_variance (1 - sum |y - y_hat|^2 / sum |y - mean y|^2 over the tokens), mse,
        l0 (mean active features per token), dead (fraction never active), dense (fraction
        active above dense_threshold), ce_clean, ce_with_sae, ce_zero_ablation,
        ce_loss_recovered = (ce_zero - ce_sae) / (ce_zero - ce_clean), tokens.

    Raises
    ------
    dclens.Error
        An SAE that does not fit the model, an empty source, or bad n_batches / seqs_per_batch.
    """
    for what, v in (("n_batches", n_batches), ("seqs_per_batch", seqs_per_batch)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise Error("%s must be an integer >= 1, not %r" % (what, v))
    check_fits(model, sae)
    c = sae.cfg
    hooks = (c.hook_name, c.hook_name_out) if c.is_transcoder else (c.hook_name,)
    rss = l0 = 0.0
    n_tok = n_batch = 0
    fired = np.zeros(c.d_sae, np.int64)
    ce = np.zeros(3)
    y_sum, y_sq = np.zeros(c.width_out), np.zeros(c.width_out)  # running sums: tss without keeping y
    for b in range(n_batches):
        pos = start + b * seqs_per_batch
        acts = activations(model, source, pos, seqs_per_batch, hooks)
        if acts is None:
            break
        x, y = acts[0], acts[-1]
        out = sae.run(x)
        rss += float(((out["recon"].astype(np.float64) - y) ** 2).sum())
        y_sum += y.astype(np.float64).sum(0)
        y_sq += (y.astype(np.float64) ** 2).sum(0)
        n_batch += 1
        active = out["acts"] != 0
        l0 += float(active.sum())
        fired += active.sum(0)
        n_tok += x.shape[0]
        ce += _ce_losses(model, sae, source.batch(pos, seqs_per_batch))
    if n_tok == 0:
        raise Error("source has no sequences from position %d: nothing to evaluate" % start)
    tss = float((y_sq - y_sum**2 / n_tok).sum())
    ce /= n_batch
    clean, spliced, zero = (float(v) for v in ce)
    return {
        "explained_variance": 1.0 - rss / tss if tss > 0 else float("nan"),
        "mse": rss / n_tok,
        "l0": l0 / n_tok,
        "dead": float(np.mean(fired == 0)),
        "dense": float(np.mean(fired / n_tok > dense_threshold)),
        "ce_clean": clean,
        "ce_with_sae": spliced,
        "ce_zero_ablation": zero,
        "ce_loss_recovered": (zero - spliced) / (zero - clean) if zero != clean else float("nan"),
        "tokens": n_tok,
    }
