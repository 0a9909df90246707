"""Sparse dictionaries: an SAE or a transcoder on one hook's activations (docs/features.md).

The arithmetic is the engine's (engine/src/features/sae.c, through dclens._core.dictionaries);
this module holds the configuration, the initialisation, the numpy views of the parameters and
the check that a dictionary fits a model's hook.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._core.checks import Error, check_bool, is_finite_number
from .._core.dictionaries import ARCHS, EngineSAE
from .._core.names import canonical

PARAMS = ("W_enc", "b_enc", "W_dec", "b_dec", "log_threshold", "threshold")
THRESHOLD_LR = 0.01  # BatchTopK's running threshold: dclens.h's DCS_SAE_THRESHOLD_LR


@dataclass
class SAEConfig:
    """What an SAE (or transcoder) is: its widths, activation and hook(s).

    Attributes
    ----------
    d_in : int
        Input width: the hook's activation per position, flattened.
    d_sae : int
        Dictionary width (the number of features).
    arch : {"relu", "topk", "jumprelu", "batchtopk"}
        The activation: ReLU (L1 penalty), TopK (k per row, no penalty), JumpReLU (L0 penalty,
        per-feature threshold) or BatchTopK (k x N per batch of N rows in training, no penalty;
        at inference one threshold, SAELens's running estimate).
    k : int
        TopK: features kept per row, BatchTopK: per row on average (1 <= k <= d_sae); set to 0
        for the others.
    hook_name : str
        The hook it reads (dclens or TransformerLens spelling; stored as dclens's).
    d_out : int
        Output width of a transcoder (0: d_in, an SAE or a same-width transcoder).
    hook_name_out : str
        A transcoder's target hook ("" for an SAE).
    apply_b_dec_to_input : bool
        Subtract b_dec from the input before encoding (an SAE only).
    normalize_decoder : bool
        Unit-norm rows of W_dec after every training step.
    sparsity_coef : float
        ReLU: the L1 coefficient; JumpReLU: the L0 coefficient.
    bandwidth : float
        JumpReLU: the width of the threshold's pseudo-derivative.
    init_threshold : float
        JumpReLU: the initial threshold.
    model_name, dataset_path : str
        Provenance, written to SAELens's cfg.json.
    context_size : int
        Tokens per sequence it was trained on (0: unknown).
    prepend_bos : bool
        Whether its training sequences started with BOS.

    Raises
    ------
    dclens.Error
        A field of the wrong type or out of range (naming it): an unknown arch, k outside
        1..d_sae for topk, a threshold <= 0, a non-finite coefficient.
    """

    d_in: int
    d_sae: int
    arch: str = "relu"
    k: int = 0
    hook_name: str = ""
    d_out: int = 0
    hook_name_out: str = ""
    apply_b_dec_to_input: bool = True
    normalize_decoder: bool = False
    sparsity_coef: float = 0.0
    bandwidth: float = 0.001
    init_threshold: float = 0.001
    model_name: str = ""
    dataset_path: str = ""
    context_size: int = 0
    prepend_bos: bool = True

    def __post_init__(self) -> None:
        for f in ("d_in", "d_sae", "k", "d_out", "context_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise Error("SAEConfig.%s must be an integer, not %r" % (f, v))
        if self.arch not in ARCHS:
            raise Error("SAEConfig.arch must be one of %s, not %r" % (", ".join(ARCHS), self.arch))
        if self.arch in ("topk", "batchtopk") and not 1 <= self.k <= self.d_sae:
            raise Error("SAEConfig.k must be in 1..d_sae (%d) for %s, not %d" % (self.d_sae, self.arch, self.k))
        if self.arch not in ("topk", "batchtopk"):
            self.k = 0  # (Batch)TopK's alone
        for f in ("sparsity_coef", "bandwidth", "init_threshold"):
            if not is_finite_number(getattr(self, f)):
                raise Error("SAEConfig.%s must be a finite number, not %r" % (f, getattr(self, f)))
        if self.arch == "jumprelu" and not self.init_threshold > 0:
            raise Error("SAEConfig.init_threshold must be > 0, not %r" % self.init_threshold)
        for f in ("apply_b_dec_to_input", "normalize_decoder", "prepend_bos"):
            check_bool("SAEConfig." + f, getattr(self, f))
        for f in ("hook_name", "hook_name_out", "model_name", "dataset_path"):
            if not isinstance(getattr(self, f), str):
                raise Error("SAEConfig.%s must be a string, not %r" % (f, getattr(self, f)))
        self.hook_name = canonical(self.hook_name)
        self.hook_name_out = canonical(self.hook_name_out)
        if self.hook_name_out and self.apply_b_dec_to_input:
            self.apply_b_dec_to_input = False  # a transcoder's b_dec is of its output

    @property
    def is_transcoder(self) -> bool:
        """Whether it maps one hook to another (hook_name_out set)."""
        return bool(self.hook_name_out)

    @property
    def width_out(self) -> int:
        """The output width (d_out, or d_in when 0)."""
        return self.d_out or self.d_in

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (JSON-ready).

        Returns
        -------
        dict
            Field name -> value.
        """
        return dataclasses.asdict(self)


class SAE:
    """A sparse autoencoder or transcoder whose arithmetic runs in the engine.

    Parameters
    ----------
    cfg : SAEConfig
        What it is.
    seed : int
        The initialisation's seed: W_dec rows uniform then unit-norm, W_enc = W_dec^T (a
        transcoder: W_enc uniform of its own), biases 0, JumpReLU's threshold init_threshold.
    n_threads : int
        The engine pool's threads (0: one per core). Results do not depend on it.

    Raises
    ------
    dclens.Error
        A config the engine refuses (named field), e.g. k > d_sae.
    """

    def __init__(self, cfg: SAEConfig, seed: int = 0, n_threads: int = 0):
        if not isinstance(cfg, SAEConfig):
            raise Error("cfg must be an SAEConfig, not %s" % type(cfg).__name__)
        self.cfg = cfg
        self._e = EngineSAE(
            cfg.d_in,
            cfg.d_out,
            cfg.d_sae,
            cfg.arch,
            cfg.k,
            cfg.apply_b_dec_to_input,
            cfg.normalize_decoder,
            float(cfg.sparsity_coef),
            float(cfg.bandwidth),
            n_threads,
        )
        self._init(seed)

    def _init(self, seed: int) -> None:
        c = self.cfg
        rng = np.random.default_rng(seed)
        w_dec = rng.uniform(-1, 1, (c.d_sae, c.width_out))
        w_dec /= np.linalg.norm(w_dec, axis=1, keepdims=True)
        bound = 1.0 / math.sqrt(c.d_in)
        w_enc = (
            w_dec.T.copy()
            if not c.is_transcoder and c.width_out == c.d_in
            else rng.uniform(-bound, bound, (c.d_in, c.d_sae))
        )
        values = {"W_enc": w_enc, "W_dec": w_dec}
        if c.arch == "jumprelu":
            values["log_threshold"] = np.full(c.d_sae, math.log(c.init_threshold))
        self.set_parameters(**values)

    # ------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Free the engine's memory now; later calls raise dclens.Error."""
        self._e.close()

    def __enter__(self) -> SAE:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.cfg
        kind = "transcoder %s -> %s" % (c.hook_name, c.hook_name_out) if c.is_transcoder else "SAE on %s" % c.hook_name
        return "<dclens.features.SAE %s, %s %d -> %d%s>" % (
            kind,
            c.arch,
            c.d_in,
            c.d_sae,
            ", k=%d" % c.k if c.arch in ("topk", "batchtopk") else "",
        )

    # ------------------------------------------------------------ parameters

    def _shape(self, name: str) -> tuple[int, ...]:
        c = self.cfg
        return {
            "W_enc": (c.d_in, c.d_sae),
            "b_enc": (c.d_sae,),
            "W_dec": (c.d_sae, c.width_out),
            "b_dec": (c.width_out,),
            "log_threshold": (c.d_sae,),
            "threshold": (1,),
        }[name]

    def parameters(self, slot: str = "param") -> dict[str, np.ndarray]:
        """The parameters (or their gradients / AdamW moments), float32 copies by name.

        Parameters
        ----------
        slot : {"param", "grad", "mom", "var"}
            What to read.

        Returns
        -------
        dict
            W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_out], b_dec [d_out], and
            log_threshold [d_sae] for JumpReLU, threshold [1] for BatchTopK.
        """
        return {n: self._e.get(slot, i).reshape(self._shape(n)) for i, n in enumerate(self._e.names)}

    def set_parameters(self, slot: str = "param", /, **values) -> None:
        """Write some of the parameters (or gradients / moments) by name.

        Parameters
        ----------
        slot : {"param", "grad", "mom", "var"}
            What to write.
        **values : array_like
            name=array of that parameter's shape.

        Raises
        ------
        dclens.Error
            An unknown name, a wrong shape or a value that is not finite.
        """
        for n, v in values.items():
            if n not in self._e.names:
                raise Error("%s is no parameter of this SAE (%s)" % (n, ", ".join(self._e.names)))
            a = np.asarray(v, np.float32)
            if a.shape != self._shape(n):
                raise Error("%s must be of shape %s, not %s" % (n, list(self._shape(n)), list(a.shape)))
            self._e.set(slot, self._e.names.index(n), a)

    @property
    def W_enc(self) -> np.ndarray:
        """[d_in, d_sae] encoder (a copy)."""
        return self.parameters()["W_enc"]

    @property
    def W_dec(self) -> np.ndarray:
        """[d_sae, d_out] decoder (a copy); row f is feature f's direction."""
        return self.parameters()["W_dec"]

    @property
    def threshold(self) -> np.ndarray | None:
        """The [d_sae] inference thresholds: JumpReLU's (exp of log_threshold), BatchTopK's one
        threshold repeated; None for other activations."""
        p = self.parameters()
        if "threshold" in p:
            return np.full(self.cfg.d_sae, p["threshold"][0], np.float32)
        return np.exp(p["log_threshold"]) if "log_threshold" in p else None

    # ------------------------------------------------------------ passes

    def _rows(self, x, width: int, what: str) -> tuple[np.ndarray, tuple[int, ...]]:
        a = np.asarray(x, np.float32)
        if a.ndim < 1 or a.shape[-1] != width:
            raise Error(
                "%s must end in a dimension of %d (the SAE's width), not shape %s" % (what, width, list(a.shape))
            )
        if a.size == 0:
            raise Error("%s is empty (shape %s): nothing to encode" % (what, list(a.shape)))
        return a.reshape(-1, width), a.shape[:-1]

    def _output(self, x, key: str, width: int) -> np.ndarray:
        """One output of the engine's forward ("acts" or "recon", [..., width]) of x [..., d_in]."""
        rows, lead = self._rows(x, self.cfg.d_in, "x")
        return self._e.forward(rows, want=(key,))[key].reshape(lead + (width,))

    def run(self, x) -> dict[str, np.ndarray]:
        """The forward of x [..., d_in]: pre-activations, feature activations, reconstruction.

        Parameters
        ----------
        x : array_like
            Activations [..., d_in].

        Returns
        -------
        dict
            pre and acts [..., d_sae], recon [..., d_out] (float32).

        Raises
        ------
        dclens.Error
            A wrong width, an empty array, or NaN / inf in x (naming the row).
        """
        rows, lead = self._rows(x, self.cfg.d_in, "x")
        out = self._e.forward(rows)
        return {k: v.reshape(lead + v.shape[1:]) for k, v in out.items()}

    def encode(self, x) -> np.ndarray:
        """Feature activations [..., d_sae] of x [..., d_in].

        Parameters
        ----------
        x : array_like
            The hook's activations [..., d_in] to encode.

        Returns
        -------
        numpy.ndarray
            float32 [..., d_sae].

        Raises
        ------
        dclens.Error
            As for run.
        """
        return self._output(x, "acts", self.cfg.d_sae)

    def decode(self, acts) -> np.ndarray:
        """The reconstruction acts @ W_dec + b_dec, [..., d_out], of feature activations.

        Parameters
        ----------
        acts : array_like
            Feature activations [..., d_sae] (any values: an edited encoding too).

        Returns
        -------
        numpy.ndarray
            The reconstruction, float32 [..., d_out].

        Raises
        ------
        dclens.Error
            A wrong width or NaN / inf in acts.
        """
        rows, lead = self._rows(acts, self.cfg.d_sae, "acts")
        if not np.isfinite(rows).all():
            raise Error("acts holds NaN or inf (row %d)" % int(np.nonzero(~np.isfinite(rows).all(1))[0][0]))
        p = self.parameters()
        return (rows @ p["W_dec"] + p["b_dec"]).astype(np.float32).reshape(lead + (self.cfg.width_out,))

    def forward(self, x) -> np.ndarray:
        """The reconstruction [..., d_out] of x [..., d_in] (the engine's forward).

        Parameters
        ----------
        x : array_like
            Activations [..., d_in] to reconstruct.

        Returns
        -------
        numpy.ndarray
            float32 [..., d_out].

        Raises
        ------
        dclens.Error
            As for run.
        """
        return self._output(x, "recon", self.cfg.width_out)

    __call__ = forward

    def loss_and_grads(self, x, target=None, fired: np.ndarray | None = None) -> tuple[dict[str, float], dict]:
        """The training loss on one batch and its gradients (left in the engine for step()).

        Parameters
        ----------
        x : array_like
            Inputs [N, d_in].
        target : array_like or None
            A transcoder's targets [N, d_out] (None: x, an SAE).
        fired : numpy.ndarray or None
            int64 [d_sae], incremented by the rows where each feature is active.

        Returns
        -------
        tuple
            ({loss, mse, sparsity, l0}, the gradients by parameter name).

        Raises
        ------
        dclens.Error
            An empty batch, a wrong width, NaN / inf in x or target (naming it), a transcoder
            without target.
        """
        rows, _ = self._rows(x, self.cfg.d_in, "x")
        t = None if target is None else self._rows(target, self.cfg.width_out, "target")[0]
        stats = self._e.grad(rows, t, fired)
        return stats, self.parameters("grad")

    def resample(self, x, target=None, dead=()) -> None:
        """Re-initialise dead features from the rows of this batch reconstructed worst
        (Anthropic's resampling, deterministic: docs/features.md).

        Feature dead[j] takes the row with the (j mod N)-th largest squared error: W_dec row =
        the unit (target row - b_dec), W_enc column = the unit (centred) input row times 0.2 x
        the live features' mean W_enc column norm, b_enc = 0, and their AdamW moments 0.

        Parameters
        ----------
        x : array_like
            The batch [N, d_in].
        target : array_like or None
            A transcoder's targets [N, d_out] (None: x).
        dead : sequence of int
            The features to re-initialise.

        Raises
        ------
        dclens.Error
            An empty batch (naming x), a feature out of range (naming dead), NaN / inf in x or
            target, a transcoder without target.
        """
        a = np.asarray(x, np.float32)
        if a.ndim != 2 or a.shape[0] == 0:
            raise Error(
                "x must be a non-empty batch [N, %d] to resample from, not shape %s" % (self.cfg.d_in, list(a.shape))
            )
        rows, _ = self._rows(a, self.cfg.d_in, "x")
        t = None if target is None else self._rows(target, self.cfg.width_out, "target")[0]
        d = np.asarray(dead)
        if d.ndim != 1 or (d.size and d.dtype.kind not in "iu"):
            raise Error("dead must be a list of feature indices, not %r" % (dead,))
        if d.size and not (0 <= d.min() and d.max() < self.cfg.d_sae):
            raise Error(
                "dead holds feature %d, not in 0..%d" % (int(d[(d < 0) | (d >= self.cfg.d_sae)][0]), self.cfg.d_sae - 1)
            )
        self._e.resample(rows, t, d.astype(np.int32))

    def step(
        self,
        step: int,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        """One AdamW step on the gradients of the last loss_and_grads.

        Parameters
        ----------
        step : int
            The step number, from 1 (AdamW's bias corrections).
        lr, beta1, beta2, eps, weight_decay : float
            AdamW's hyperparameters (weight decay on W_enc and W_dec only).

        Raises
        ------
        dclens.Error
            step < 1 or hyperparameters out of range.
        """
        self._e.adamw(step, lr, beta1, beta2, eps, weight_decay)


def hook_width(model, name: str) -> tuple[str, int]:
    """The dclens name of a per-position hook of `model` and its width per position.

    Parameters
    ----------
    model : dclens.Model
        The model.
    name : str
        A hook name in either spelling.

    Returns
    -------
    tuple
        (dclens name, the product of its dimensions after [B, T]).

    Raises
    ------
    dclens.Error
        A hook the model does not have, or one whose layout is not position-first (an
        attention map, ...).
    """
    full = model.resolve_hook(name)
    point, _ = model.parse_hook(full)
    a, b = model.runner.hook_shape(point, 1, 2), model.runner.hook_shape(point, 1, 3)
    if len(a) < 3 or a[1] != 2 or b[1] != 3 or a[2:] != b[2:]:
        raise Error(
            "hook %s is not one activation per position (its layout %s): no dictionary reads it" % (full, list(a))
        )
    return full, int(np.prod(a[2:]))


def check_fits(model, sae: SAE) -> None:
    """Refuse an SAE whose hook(s) or widths do not fit `model`.

    Parameters
    ----------
    model : dclens.Model
        The model.
    sae : SAE
        The dictionary.

    Raises
    ------
    dclens.Error
        No hook_name, a hook the model lacks, or a width that differs from the hook's.
    """
    c = sae.cfg
    if not c.hook_name:
        raise Error("sae.cfg.hook_name is empty: which hook does the SAE read?")
    for field, name, width in (("d_in", c.hook_name, c.d_in), ("d_out", c.hook_name_out, c.width_out)):
        if not name:
            continue
        full, w = hook_width(model, name)
        if w != width:
            raise Error("sae.cfg.%s is %d but hook %s of this model has width %d" % (field, width, full, w))
