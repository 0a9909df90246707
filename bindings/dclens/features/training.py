"""Training a dictionary on activations streamed from the model's passes (docs/features.md).

Each step is one pass of ``seqs_per_step`` sequences of the source: the hook's activations
(and a transcoder's target hook's) of every position are one batch of rows for the engine's
dcs_sae_grad + dcs_sae_adamw. Only one batch is in memory at a time. A checkpoint (``.npz``,
read without pickle) holds the parameters, AdamW's moments, the step, the data position and the
dead-feature counters, so a stopped training resumes bit-identically.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._core import progress as _progress
from .._core.checks import Error, is_finite_number
from .sae import SAE, SAEConfig, check_fits

CHECKPOINT_FORMAT = "dclens-sae-checkpoint-1"


@dataclass
class TrainSAEConfig:
    """How to train: steps, batch, AdamW, dead features, checkpoints.

    Attributes
    ----------
    steps : int
        Steps in all (a resumed run continues to this many).
    seqs_per_step : int
        Sequences of the source per step (rows = seqs_per_step x context_size).
    lr, beta1, beta2, eps, weight_decay : float
        AdamW (weight decay on W_enc and W_dec only).
    dead_steps : int
        A feature is dead when it has not fired for this many steps (reported).
    dead_after : int
        Resample a feature that has not fired for this many tokens (SAE.resample: from the
        rows of the current batch reconstructed worst); 0: never.
    checkpoint : str or None
        A checkpoint file: written every checkpoint_every steps and at the end.
    checkpoint_every : int
        Steps between checkpoints (0: only at the end).
    resume : bool
        Continue from `checkpoint` when it exists.
    progress : bool or None
        dclens.progress: None a bar where watched, plain lines in a log.

    Raises
    ------
    dclens.Error
        A field of the wrong type or out of range (naming it).
    """

    steps: int = 100
    seqs_per_step: int = 4
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    dead_steps: int = 50
    dead_after: int = 0
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: bool = True
    progress: bool | None = None

    def __post_init__(self) -> None:
        for f in ("steps", "seqs_per_step", "dead_steps", "dead_after", "checkpoint_every"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (1 if f == "seqs_per_step" else 0):
                raise Error("TrainSAEConfig.%s must be an integer >= %d, not %r" % (f, f == "seqs_per_step", v))
        for f in ("lr", "beta1", "beta2", "eps", "weight_decay"):
            if not is_finite_number(getattr(self, f)):
                raise Error("TrainSAEConfig.%s must be a finite number, not %r" % (f, getattr(self, f)))


@dataclass
class TrainState:
    """Where a training stands: steps done, sequences read, steps since each feature fired.

    Attributes
    ----------
    step : int
        Steps done.
    position : int
        Sequences of the source consumed.
    since_fired : numpy.ndarray
        int64 [d_sae]: steps since each feature was last active.
    history : list of dict
        Per step: loss, mse, l0, dead (fraction), tokens, resampled (features).
    tokens_since_fired : numpy.ndarray
        int64 [d_sae]: tokens since each feature was last active (or resampled).
    """

    step: int
    position: int
    since_fired: np.ndarray
    history: list
    tokens_since_fired: np.ndarray


def activations(model, source, start: int, n: int, hooks: tuple[str, ...]) -> list[np.ndarray] | None:
    """The activations [rows, width] at `hooks` of sequences start .. start+n-1 of `source`
    (one pass), or None at the source's end.

    Parameters
    ----------
    model : dclens.Model
        The model.
    source : object
        A token source (dclens.features.sources).
    start, n : int
        The sequences.
    hooks : tuple of str
        dclens hook names (per-position layouts).

    Returns
    -------
    list of numpy.ndarray or None
        One float32 [m x T, width] array per hook.

    Raises
    ------
    dclens.Error
        Tokens the model refuses, or a hook that fails.
    """
    toks = source.batch(start, n)
    if len(toks) == 0:
        return None
    _, cache = model.run_with_cache(np.asarray(toks, np.int32), names=list(hooks), return_type=None)
    out = []
    for h in hooks:
        a = np.asarray(cache[h], np.float32)
        out.append(np.ascontiguousarray(a.reshape(a.shape[0] * a.shape[1], -1)))
    return out


def save_checkpoint(path: str, sae: SAE, state: TrainState, tc: TrainSAEConfig) -> None:
    """Write a training checkpoint (npz; the file is replaced atomically).

    Parameters
    ----------
    path : str
        The file.
    sae : SAE
        The dictionary (parameters and AdamW moments).
    state : TrainState
        The step, data position and counters.
    tc : TrainSAEConfig
        The training's settings (recorded).
    """
    arrays: dict[str, Any] = {}
    for slot in ("param", "mom", "var"):
        for k, v in sae.parameters(slot).items():
            arrays["%s/%s" % (slot, k)] = v
    meta = {
        "format": CHECKPOINT_FORMAT,
        "sae": sae.cfg.to_dict(),
        "step": state.step,
        "position": state.position,
        "lr": tc.lr,
        "seqs_per_step": tc.seqs_per_step,
        "history": state.history,
    }
    arrays["since_fired"] = state.since_fired
    arrays["tokens_since_fired"] = state.tokens_since_fired
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def load_checkpoint(path: str, sae: SAE, tc: TrainSAEConfig) -> TrainState:
    """Read a training checkpoint into `sae` (parameters, moments) and return its state.

    Parameters
    ----------
    path : str
        The file save_checkpoint wrote.
    sae : SAE
        A dictionary of the same configuration.
    tc : TrainSAEConfig
        The settings; seqs_per_step must be the checkpoint's (the data position counts by it).

    Returns
    -------
    TrainState
        Where the training stopped.

    Raises
    ------
    dclens.Error
        A file that is not such a checkpoint, or one of another SAE configuration or batch.
    """
    try:
        z = np.load(path, allow_pickle=False)
        meta = json.loads(bytes(z["meta"]).decode())
    except (OSError, ValueError, KeyError) as e:
        raise Error("checkpoint %s is not a dclens SAE checkpoint: %s" % (path, e)) from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise Error("checkpoint %s is not a dclens SAE checkpoint (format %r)" % (path, meta.get("format")))
    if SAEConfig(**meta["sae"]) != sae.cfg:
        raise Error("checkpoint %s is of another SAE configuration: %s" % (path, meta["sae"]))
    if meta["seqs_per_step"] != tc.seqs_per_step:
        raise Error(
            "checkpoint %s was trained with seqs_per_step %d, not %d" % (path, meta["seqs_per_step"], tc.seqs_per_step)
        )
    for slot in ("param", "mom", "var"):
        names = [k.split("/", 1)[1] for k in z.files if k.startswith(slot + "/")]
        sae.set_parameters(slot, **{n: z["%s/%s" % (slot, n)] for n in names})
    since = np.array(z["since_fired"], np.int64)
    tokens = np.array(z["tokens_since_fired"], np.int64) if "tokens_since_fired" in z.files else np.zeros_like(since)
    return TrainState(int(meta["step"]), int(meta["position"]), since, list(meta["history"]), tokens)


def train_sae(model, sae: SAE, source, tc: TrainSAEConfig | None = None, **kw) -> TrainState:
    """Train `sae` on its hook's activations over `source`, streamed one pass per step.

    Parameters
    ----------
    model : dclens.Model
        The model whose activations it learns.
    sae : SAE
        The dictionary (trained in place); cfg.hook_name (and hook_name_out for a transcoder)
        say what it reads.
    source : object
        A token source: dclens.features.TokenArrays, TextFile, JsonlFile.
    tc : TrainSAEConfig or None
        The settings (None: the defaults, or **kw).
    **kw
        TrainSAEConfig fields, when tc is None.

    Returns
    -------
    TrainState
        The step, data position, dead-feature counters and the per-step history.

    Raises
    ------
    dclens.Error
        An SAE that does not fit the model's hook, a bad checkpoint, NaN in the activations
        (naming the row), or a loss that diverges.
    """
    tc = tc if tc is not None else TrainSAEConfig(**kw)
    check_fits(model, sae)
    c = sae.cfg
    hooks = (c.hook_name, c.hook_name_out) if c.is_transcoder else (c.hook_name,)
    if tc.checkpoint and tc.resume and os.path.exists(tc.checkpoint):
        state = load_checkpoint(tc.checkpoint, sae, tc)
    else:
        state = TrainState(0, 0, np.zeros(c.d_sae, np.int64), [], np.zeros(c.d_sae, np.int64))
    bar = _progress.bar(total=tc.steps, initial=state.step, desc="sae", unit="step", progress=tc.progress)
    try:
        while state.step < tc.steps:
            t0 = time.perf_counter()
            acts = activations(model, source, state.position, tc.seqs_per_step, hooks)
            if acts is None:
                break  # the source is exhausted
            fired = np.zeros(c.d_sae, np.int64)
            stats, _ = sae.loss_and_grads(acts[0], acts[1] if c.is_transcoder else None, fired)
            state.step += 1
            sae.step(state.step, tc.lr, tc.beta1, tc.beta2, tc.eps, tc.weight_decay)
            state.position += tc.seqs_per_step
            state.since_fired = np.where(fired > 0, 0, state.since_fired + 1)
            dead = float(np.mean(state.since_fired >= tc.dead_steps))
            rows = acts[0].shape[0]
            state.tokens_since_fired = np.where(fired > 0, 0, state.tokens_since_fired + rows)
            again = np.nonzero(state.tokens_since_fired >= tc.dead_after)[0] if tc.dead_after else np.zeros(0, np.int64)
            if again.size:
                sae.resample(acts[0], acts[1] if c.is_transcoder else None, again)
                state.tokens_since_fired[again] = 0
            state.history.append(
                {
                    "loss": stats["loss"],
                    "mse": stats["mse"],
                    "l0": stats["l0"],
                    "dead": dead,
                    "tokens": rows,
                    "resampled": int(again.size),
                }
            )
            bar.update(1)
            tok_s = rows / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(
                loss="%.4g" % stats["loss"], l0="%.1f" % stats["l0"], dead="%.1f%%" % (100 * dead), tok_s="%.0f" % tok_s
            )
            if tc.checkpoint and tc.checkpoint_every and state.step % tc.checkpoint_every == 0:
                save_checkpoint(tc.checkpoint, sae, state, tc)
    finally:
        bar.close()
    if tc.checkpoint:
        save_checkpoint(tc.checkpoint, sae, state, tc)
    return state
