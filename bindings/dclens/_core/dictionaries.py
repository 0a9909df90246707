"""The engine's sparse dictionaries (dclens.h, "sparse dictionaries"; engine/src/features/sae.c).

One of the few modules that call the engine (tests/api/test_imports.py, ENGINE_USERS): an
:class:`EngineSAE` owns one ``dcs_sae`` and every call on it. The C object is freed by
:meth:`EngineSAE.close` or when the Python object is collected, whichever comes first; after
close, every call raises dclens.Error (no pointer to freed memory is ever used or handed out:
arrays returned are numpy copies).
"""

from __future__ import annotations

import threading

import numpy as np

from .binding import check_status, ffi, lib
from .checks import EngineObject, Error, decode_msg

ARCHS = ("relu", "topk", "jumprelu", "batchtopk")
_ARCH_CODE = {"relu": 0, "topk": 1, "jumprelu": 2, "batchtopk": 3}
# what get / set read or write
SLOTS = {"param": 0, "grad": 1, "mom": 2, "var": 3}


class EngineSAE(EngineObject):
    """A dcs_sae: the parameters, their gradients and AdamW moments, on the engine's CPU pool.

    Parameters
    ----------
    d_in, d_out, d_sae : int
        Input width, output width (d_in for an SAE) and dictionary width.
    arch : {"relu", "topk", "jumprelu", "batchtopk"}
        The activation.
    k : int
        TopK: features kept per row; BatchTopK: per row on average (k x N per batch).
    apply_b_dec_to_input, normalize_decoder : bool
        Subtract b_dec from the input; unit-norm decoder rows after each step.
    sparsity_coef, bandwidth : float
        ReLU's L1 / JumpReLU's L0 coefficient; JumpReLU's pseudo-derivative width.
    n_threads : int
        The pool's threads (0: one per core).
    """

    _instead = "save it (SAE.save) and load it"

    def __init__(
        self,
        d_in: int,
        d_out: int,
        d_sae: int,
        arch: str,
        k: int,
        apply_b_dec_to_input: bool,
        normalize_decoder: bool,
        sparsity_coef: float,
        bandwidth: float,
        n_threads: int,
    ):
        self._lock = threading.Lock()
        self._s = None
        if arch not in _ARCH_CODE:
            raise Error("arch must be one of %s, not %r" % (", ".join(ARCHS), arch))
        c = ffi.new("dcs_sae_config *")
        c.d_in, c.d_out, c.d_sae, c.arch, c.k = d_in, d_out, d_sae, _ARCH_CODE[arch], k
        c.apply_b_dec_to_input, c.normalize_decoder = int(apply_b_dec_to_input), int(normalize_decoder)
        c.sparsity_coef, c.bandwidth, c.n_threads = sparsity_coef, bandwidth, n_threads
        out = ffi.new("dcs_sae **")
        err = ffi.new("char[]", 512)
        st = lib.dcs_sae_new(c, out, err, 512)
        check_status(st, decode_msg(ffi.string(err)))
        self._s = ffi.gc(out[0], lib.dcs_sae_free)
        self.d_in, self.d_out, self.d_sae = d_in, d_out or d_in, d_sae
        self.names: list[str] = []
        self.sizes: list[int] = []
        name = ffi.new("const char **")
        n = ffi.new("int64_t *")
        for i in range(lib.dcs_sae_param_count(self._s)):
            check_status(lib.dcs_sae_param_info(self._s, i, name, n), "")
            self.names.append(ffi.string(name[0]).decode())
            self.sizes.append(int(n[0]))

    # ------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Free the engine's SAE now (later calls raise dclens.Error); safe to call twice."""
        with self._lock:
            if self._s is not None:
                ffi.release(self._s)
                self._s = None

    @property
    def closed(self) -> bool:
        """Whether close() has freed the engine's SAE."""
        return self._s is None

    def _handle(self):
        if self._s is None:
            raise Error("this SAE is closed (close() freed its engine memory)")
        return self._s

    def _check(self, st: int) -> None:
        if st != lib.DCS_OK:
            check_status(st, decode_msg(ffi.string(lib.dcs_sae_errmsg(self._s))))

    # ------------------------------------------------------------ parameters and state

    def get(self, slot: str, i: int) -> np.ndarray:
        """A copy of parameter i's values, gradient or AdamW moment (slot: param|grad|mom|var), flat."""
        out = np.empty(self.sizes[i], np.float32)
        with self._lock:
            s = self._handle()
            self._check(lib.dcs_sae_get(s, SLOTS[slot], i, ffi.from_buffer("float[]", out), out.size))
        return out

    def set(self, slot: str, i: int, values: np.ndarray) -> None:
        """Write parameter i's values (or gradient / moment) from a float32 array of its size."""
        a = np.ascontiguousarray(values, np.float32).ravel()
        with self._lock:
            s = self._handle()
            self._check(lib.dcs_sae_set(s, SLOTS[slot], i, ffi.from_buffer("float[]", a), a.size))

    # ------------------------------------------------------------ passes

    def _rows(self, what: str, x, width: int) -> np.ndarray:
        a = np.ascontiguousarray(x, np.float32)
        if a.ndim != 2 or a.shape[1] != width:
            raise Error("%s must be [N, %d], not %s" % (what, width, list(a.shape)))
        if a.shape[0] >= 2**31:
            raise Error("%s has %d rows: at most 2^31 - 1 per call" % (what, a.shape[0]))
        return a

    def forward(self, x, want=("pre", "acts", "recon")) -> dict[str, np.ndarray]:
        """pre, acts [N, d_sae] and recon [N, d_out] of x [N, d_in] (those named in `want`)."""
        a = self._rows("x", x, self.d_in)
        N = a.shape[0]
        out = {
            "pre": np.empty((N, self.d_sae), np.float32) if "pre" in want else None,
            "acts": np.empty((N, self.d_sae), np.float32) if "acts" in want else None,
            "recon": np.empty((N, self.d_out), np.float32) if "recon" in want else None,
        }
        ptr = {k: ffi.NULL if v is None else ffi.from_buffer("float[]", v) for k, v in out.items()}
        with self._lock:
            s = self._handle()
            self._check(lib.dcs_sae_forward(s, ffi.from_buffer("float[]", a), N, ptr["pre"], ptr["acts"], ptr["recon"]))
        return {k: v for k, v in out.items() if v is not None}

    def _x_target(self, x, target):
        """x's rows [N, d_in] and a pointer to target's [N, d_out] (NULL for None: x itself)."""
        a = self._rows("x", x, self.d_in)
        if target is None:
            return a, ffi.NULL
        tt = self._rows("target", target, self.d_out)
        if tt.shape[0] != a.shape[0]:
            raise Error("target has %d rows, x %d" % (tt.shape[0], a.shape[0]))
        return a, ffi.from_buffer("float[]", tt)

    def grad(self, x, target=None, fired: np.ndarray | None = None) -> dict[str, float]:
        """The loss's gradients on one batch (kept in the engine, see get("grad", i)); its loss,
        mse, sparsity and mean L0. fired [d_sae] int64 (if given) += rows where each feature fired."""
        a, t = self._x_target(x, target)
        f = ffi.NULL
        if fired is not None:
            if fired.dtype != np.int64 or fired.shape != (self.d_sae,) or not fired.flags.c_contiguous:
                raise Error("fired must be a contiguous int64 [%d] array" % self.d_sae)
            f = ffi.from_buffer("int64_t[]", fired)
        st = ffi.new("dcs_sae_stats *")
        with self._lock:
            s = self._handle()
            self._check(lib.dcs_sae_grad(s, ffi.from_buffer("float[]", a), t, a.shape[0], st, f))
        return {"loss": st.loss, "mse": st.mse, "sparsity": st.sparsity, "l0": st.l0}

    def resample(self, x, target, dead: np.ndarray) -> None:
        """Re-initialise the features `dead` (int32 [n]) from the rows of x (target) it
        reconstructs worst (dcs_sae_resample)."""
        a, t = self._x_target(x, target)
        d = np.ascontiguousarray(dead, np.int32)
        with self._lock:
            s = self._handle()
            self._check(
                lib.dcs_sae_resample(
                    s, ffi.from_buffer("float[]", a), t, a.shape[0], ffi.from_buffer("int[]", d), d.size
                )
            )

    def adamw(self, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
        """One AdamW step (step from 1) on the gradients of the last grad()."""
        h = ffi.new("dcs_adamw *")
        h.lr, h.beta1, h.beta2, h.eps, h.weight_decay = lr, beta1, beta2, eps, weight_decay
        with self._lock:
            s = self._handle()
            self._check(lib.dcs_sae_adamw(s, int(step), h))
