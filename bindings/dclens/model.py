"""Model: a loaded checkpoint, its forward pass, and hooks (read and write).

Thin layer over the C engine (dclens._engine): the engine runs the pass and
calls back at every wanted hook point with the activation for the whole batch;
dclens.hooks turns that into numpy arrays, a cache, and calls of the user's
hook functions, with hook names from the model's HookTable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import threading
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import attribution, batch, generate as _generate, grad, memplan, names as _names, routing
from ._checks import Error, c_path, c_str, check_index, check_str, decode_msg, show_path, token_array
from ._checks import check_status as _check
from ._engine import ffi, lib
from .bundled import resolve
from .cache import Cache
from .hooks import HookFn, HookTable, _Run, hook_pairs
from .weights import WeightsMixin

_MAX_TOKENIZER_BYTES = 256 << 20


class LoadWarning(UserWarning):
    """Something about a checkpoint worth knowing, said once when it is loaded
    (e.g. key-side weights of a query-wise checkpoint that are ignored)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Dimensions and switches of a loaded model."""

    model_type: str
    n_layer: int
    d_model: int
    n_head: int
    head_dim: int
    d_ff: int
    vocab: int
    rotary_dim: int
    rope_base: float
    norm_eps: float
    parallel_residual: bool
    qk_norm: bool
    linear_bias: bool
    use_dcmha: bool
    query_wise: bool
    dyn_rank: int
    dyn_hidden: int
    window_size: int
    local_layers: Tuple[int, ...]
    tie_embeddings: bool
    # attention variants (model-spec.md 5)
    use_sw: bool = False  # static (Talking-Heads) compose branch
    compose_groups: int = 1  # heads composed within this many groups
    moh_shared_heads: Optional[int] = None  # MoH routing: None when off
    moh_routed_topk: Optional[int] = None
    dyn_slots: int = 0  # C: 4 (pre/post x query/key) or 2
    key_wise: bool = False  # query-wise branches absent

    def __getitem__(self, key):  # dict-style access for notebooks
        return getattr(self, key)


Names = Union[None, str, Iterable[str], Callable[[str], bool]]


def cuda_available() -> bool:
    """True if the engine was built with CUDA and a GPU is usable."""
    return bool(lib.dcs_cuda_available(ffi.NULL, 0))


def cuda_unavailable_reason() -> str:
    why = ffi.new("char[]", 512)
    if lib.dcs_cuda_available(why, 512):
        return ""
    return ffi.string(why).decode(errors="replace")


def load(path: Union[str, os.PathLike], device: str = "cpu", n_threads: int = 0, always_batch: bool = False) -> "Model":
    """Load a DCPythia or Pythia checkpoint directory (config.json + weights),
    or a bundled model by name (dclens.bundled_models()).

    always_batch=True gives every result a leading batch axis, also for one
    prompt (TransformerLens' habit); by default the batch axis follows the
    input: a string or [T] array gives [T, ...], a list of strings or a
    [B, T] array gives [B, T, ...]."""
    m = Model(resolve(path), device=device, n_threads=n_threads)
    m.always_batch = bool(always_batch)
    return m


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _read_regular_file(path: str, limit: int) -> str:
    """The text of a regular file of at most `limit` bytes. Opened without
    blocking and checked before reading, so a FIFO or device where a file is
    expected is refused instead of hanging."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if os.path.islink(path) and not os.path.exists(path):
            raise Error("%s: cannot open: a dangling symbolic link (its target does not exist)" % path) from None
        raise Error("%s: cannot open: %s" % (path, e.strerror)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Error("%s: not a regular file" % path)
        if st.st_size > limit:
            raise Error("%s: %d bytes is more than the %d allowed for this file" % (path, st.st_size, limit))
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise Error("%s: file grew past %d bytes while being read" % (path, limit))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Error("%s: not UTF-8 (%s at byte %d)" % (path, e.reason, e.start)) from None


class Model(WeightsMixin):
    """A loaded DCPythia or Pythia model.

    >>> m = dclens.load("path/to/model")
    >>> logits = m.forward(m.to_tokens("The cat sat"))
    >>> logits, cache = m.run_with_cache(tokens, names=lambda n: n.endswith("pattern"))
    """

    def __init__(self, path, device: str = "cpu", n_threads: int = 0):
        cpath = c_path("model path", path)
        path = show_path(path)
        if not (isinstance(device, str) and device in ("cpu", "cuda")):
            raise Error("device must be 'cpu' or 'cuda', not %r" % (device,))
        n_threads = check_index("n_threads", n_threads, 0, 1 << 16, " (0: all cores)")
        opts = ffi.new("dcs_load_options *")
        opts.device = 1 if device == "cuda" else 0
        opts.n_threads = n_threads
        out = ffi.new("dcs_model **")
        err = ffi.new("char[]", 1024)
        st = lib.dcs_load(cpath, opts, out, err, 1024)
        _check(st, decode_msg(ffi.string(err)))
        self._m = ffi.gc(out[0], lib.dcs_free)
        # One engine call at a time per model (the engine's pool and error
        # record are per model, and cffi releases the GIL during a pass):
        # other threads wait. _pass_thread is the thread running this
        # model's hooks, which may read weights but not start another pass.
        self._lock = threading.RLock()
        self._pass_thread: Optional[int] = None
        self.path = path
        self.name = os.path.basename(os.path.normpath(path))
        self.device = device
        c = lib.dcs_model_config(self._m)
        self.config = Config(
            model_type="dcpythia" if c.model_type == 1 else "gpt_neox",
            n_layer=c.n_layer,
            d_model=c.d_model,
            n_head=c.n_head,
            head_dim=c.head_dim,
            d_ff=c.d_ff,
            vocab=c.vocab,
            rotary_dim=c.rotary_dim,
            rope_base=c.rope_base,
            norm_eps=c.norm_eps,
            parallel_residual=bool(c.parallel_residual),
            qk_norm=bool(c.qk_norm),
            linear_bias=bool(c.linear_bias),
            use_dcmha=bool(c.use_dcmha),
            query_wise=bool(c.query_wise),
            dyn_rank=c.dyn_rank,
            dyn_hidden=c.dyn_hidden,
            window_size=c.window_size,
            local_layers=tuple(l for l in range(c.n_layer) if lib.dcs_layer_is_local(self._m, l)),
            tie_embeddings=bool(c.tie_embeddings),
            use_sw=bool(c.use_sw) and bool(c.use_dcmha),
            compose_groups=c.compose_groups,
            moh_shared_heads=c.moh_shared if c.moh else None,
            moh_routed_topk=c.moh_topk if c.moh else None,
            dyn_slots=c.dyn_slots,
            key_wise=bool(c.key_wise),
        )
        self.load_warnings = ffi.string(lib.dcs_load_warnings(self._m)).decode(errors="replace").splitlines()
        for w in self.load_warnings:
            warnings.warn(w, LoadWarning, stacklevel=3)
        self._tokenizer = None
        self._hook_table = HookTable(self._m, self.config.n_layer)  # name <-> (point, layer)
        self.always_batch = False  # see load()
        self._ctx_hooks: List[Tuple[str, HookFn]] = []  # add_hook / with model.hooks(...)

    def __repr__(self) -> str:
        c = self.config
        return "<dclens.Model %s: %s, %d layers, d_model %d, %d heads, on %s>" % (
            self.name,
            c.model_type,
            c.n_layer,
            c.d_model,
            c.n_head,
            self.device,
        )

    # ------------------------------------------------------------ names

    @property
    def hook_names(self) -> List[str]:
        """Every hook name this model has, in forward order per layer."""
        return list(self._hook_table.names)

    def parse_hook(self, name: str) -> Tuple[int, int]:
        """(point, layer) of a dclens hook name of this model; an Error naming
        what is wrong with any other name."""
        key = self._hook_table.key.get(name) if isinstance(name, str) else None
        if key is not None:
            return key
        cname = c_str("hook name", name)  # the engine's parser says what is wrong
        p, l = ffi.new("int *"), ffi.new("int *")
        with self._engine_lock():
            _check(lib.dcs_hook_parse(self._m, cname, p, l), self._errmsg())
        return p[0], l[0]

    def _select(self, names: Names) -> List[str]:
        canonical, tl_alias = _names.canonical, _names.tl_alias
        if names is None:
            return list(self._hook_table.names)
        if isinstance(names, str):
            names = [names]
        if callable(names):
            return [n for n in self._hook_table.names if names(n) or (tl_alias(n) is not None and names(tl_alias(n)))]
        try:
            names = list(names)
        except TypeError:
            raise Error(
                "names must be None, a hook name, a list of hook names or a predicate, "
                "not %s %r" % (type(names).__name__, names)
            ) from None
        names = [canonical(check_str("hook name", n)) for n in names]
        for n in names:
            self.parse_hook(n)
        return names

    def _errmsg(self) -> str:
        return decode_msg(ffi.string(lib.dcs_errmsg(self._m)))

    @contextlib.contextmanager
    def _engine_lock(self):
        """Hold the model for one engine call. A hook of a running pass (its
        thread owns the pass) goes through without waiting."""
        if self._pass_thread == threading.get_ident():
            yield
            return
        with self._lock:
            yield

    # ------------------------------------------------------------ tokens

    @property
    def tokenizer(self):
        """The HF `tokenizers.Tokenizer` of the model directory (tokenizer.json)."""
        if self._tokenizer is None:
            p = os.path.join(self.path, "tokenizer.json")
            if not os.path.lexists(p):
                raise Error("%s has no tokenizer.json" % self.path)
            text = _read_regular_file(p, _MAX_TOKENIZER_BYTES)
            from tokenizers import Tokenizer

            try:
                self._tokenizer = Tokenizer.from_str(text)
            except Exception as e:
                raise Error("%s: cannot read the tokenizer: %s" % (p, e))
        return self._tokenizer

    def to_tokens(self, text, padding_side: str = "right", pad_id: int = 0):
        """Token ids of `text` (no BOS is added, as for Pythia): a [T] array.

        A list of strings gives (tokens [B, T], lengths [B]): the prompts
        padded with pad_id to the longest, on the right (default) or the left.
        Every entry point takes that pair (or tokens with lengths=...)."""
        if isinstance(text, (list, tuple)):
            if not text or not all(isinstance(t, str) for t in text):
                raise Error("to_tokens: need a string or a non-empty list of strings, got %r" % (text,))
            return batch.pad([self.to_tokens(t) for t in text], padding_side, pad_id)
        if not isinstance(text, str):
            raise Error("to_tokens: need a string or a list of strings, not %s" % type(text).__name__)
        ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        if ids.size and ids.max() >= self.config.vocab:
            raise Error(
                "tokenizer of %s gives id %d, beyond the model's vocab %d" % (self.path, ids.max(), self.config.vocab)
            )
        return ids

    def to_str_tokens(self, text_or_tokens, lengths=None):
        """The tokens of a text (or a [T] id array) as strings; a list of texts
        or a [B, T] array gives one list per row (cut to `lengths` if given)."""
        if isinstance(text_or_tokens, (list, tuple)) and text_or_tokens and isinstance(text_or_tokens[0], str):
            return [self.to_str_tokens(t) for t in text_or_tokens]
        if isinstance(text_or_tokens, str):
            text_or_tokens = self.to_tokens(text_or_tokens)
        a = np.asarray(text_or_tokens)
        if a.ndim == 2:
            lens = [a.shape[1]] * a.shape[0] if lengths is None else list(lengths)
            return [self.to_str_tokens(row[:n]) for row, n in zip(a, lens)]
        if a.ndim > 2:
            raise Error("to_str_tokens: need [T] or [B, T] tokens, got shape %s" % (a.shape,))
        return [self.tokenizer.decode([int(t)]) for t in a.ravel()]

    def to_string(self, tokens) -> Union[str, List[str]]:
        """Decode token ids to text ([T] -> str, [B, T] -> list of str)."""
        a = np.asarray(tokens)
        if a.ndim == 2:
            return [self.to_string(r) for r in a]
        if a.ndim > 2 or a.dtype.kind not in "iu":
            raise Error("to_string: need integer [T] or [B, T] tokens, got %s %s" % (a.dtype, a.shape))
        return self.tokenizer.decode([int(t) for t in a.ravel()], skip_special_tokens=False)

    def to_single_token(self, text: str) -> int:
        """The id of a string that is exactly one token (else an Error)."""
        ids = self.to_tokens(text)
        if ids.size != 1:
            raise Error("to_single_token: %r is %d tokens %s, not one" % (text, ids.size, self.to_str_tokens(ids)))
        return int(ids[0])

    # ------------------------------------------------------------ forward

    def _tokens(self, tokens) -> Tuple[np.ndarray, bool]:
        if isinstance(tokens, str):
            tokens = self.to_tokens(tokens)
        a = token_array(tokens)
        if a.dtype.kind not in "iu":
            raise Error("tokens must be integers, got dtype %s" % a.dtype)
        if a.ndim not in (1, 2) or a.size == 0:
            raise Error("tokens must be a non-empty [T] or [B, T] array, got shape %s" % (a.shape,))
        if a.min() < 0 or a.max() >= self.config.vocab:
            raise Error(
                "token id %d is out of range [0, %d)"
                % (a.max() if a.max() >= self.config.vocab else a.min(), self.config.vocab)
            )
        batched = a.ndim == 2
        return np.ascontiguousarray(a.reshape(-1, a.shape[-1]), dtype=np.int32), batched

    def _positions(self, logits_at, B: int, T: int):
        """logits_at -> (int32 [B, n] positions, squeeze?) or (None, False)."""
        if logits_at is None:
            return None, False
        if isinstance(logits_at, str):
            if logits_at != "last":
                raise Error("logits_at must be None, 'last', or positions, got %r" % (logits_at,))
            return np.full((B, 1), T - 1, dtype=np.int32), True
        a = np.asarray(logits_at)
        if a.dtype.kind not in "iu" or a.size == 0 or a.ndim not in (0, 1, 2):
            raise Error("logits_at must be 'last', an integer, [n] or [B, n] integer positions, got %r" % (logits_at,))
        squeeze = a.ndim == 0
        a = a.reshape(1, -1) if a.ndim < 2 else a
        if a.shape[0] == 1 and B > 1:
            a = np.broadcast_to(a, (B, a.shape[1]))
        if a.shape[0] != B:
            raise Error("logits_at has positions for %d sequences, tokens have %d" % (a.shape[0], B))
        if a.shape[1] > T:
            raise Error("logits_at asks for %d positions per sequence, more than T = %d" % (a.shape[1], T))
        if a.min() < 0 or a.max() >= T:
            raise Error("logits_at position %d is out of range [0, %d)" % (a.max() if a.max() >= T else a.min(), T))
        return np.ascontiguousarray(a, dtype=np.int32), squeeze

    def _run(
        self,
        tokens,
        capture: Sequence[str] = (),
        fns: Sequence[Tuple[str, HookFn]] = (),
        logits: bool = True,
        logits_at=None,
    ):
        toks, batched = self._tokens(tokens)
        B, T = toks.shape
        pos, squeeze = self._positions(logits_at, B, T)
        n_out = T if pos is None else pos.shape[1]
        run = _Run(self, batched)
        want = self._hook_plan(run, capture, fns)
        self._check_pass_memory(B, n_out, run, logits)
        try:
            out = np.empty((B, n_out, self.config.vocab), dtype=np.float32) if logits else None
        except MemoryError:
            raise Error(
                "forward: no memory for the logits of B=%d, T=%d, vocab %d" % (B, n_out, self.config.vocab)
            ) from None
        ctoks = ffi.cast("const int32_t *", ffi.from_buffer(toks))
        clog = ffi.cast("float *", ffi.from_buffer(out)) if out is not None else ffi.NULL
        cpos = ffi.cast("const int32_t *", ffi.from_buffer(pos)) if pos is not None else ffi.NULL
        n_pos = 0 if pos is None else pos.shape[1]
        self._call_engine(
            run,
            want,
            lambda hooks: lib.dcs_forward_at(self._m, ctoks, B, T, cpos, n_pos, clog, hooks),
            " aborted the forward pass",
        )
        if out is not None and squeeze:
            out = out[:, 0]
        if out is not None and not batched:
            out = out[0]
        return out, run.cache

    def _hook_plan(self, run: "_Run", capture: Sequence[str], fns: Sequence[Tuple[str, HookFn]]) -> np.ndarray:
        """Record in `run` what each hook point captures and calls; return the
        engine's want table [DCS_HP_COUNT * L] (1 = call back at that point)."""
        L = self.config.n_layer
        want = np.zeros(lib.DCS_HP_COUNT * L, dtype=np.uint8)
        for n in capture:
            p, l = self.parse_hook(n)
            run.capture[(p, l)] = n
            want[p * L + l] = 1
        for n, fn in fns:
            if not callable(fn):
                raise Error("hook %s: %r is not callable" % (n, fn))
            p, l = self.parse_hook(n)
            run.add((p, l), fn)
            want[p * L + l] = 1
        return want

    def _call_engine(self, run: "_Run", want: np.ndarray, call, aborted: str) -> None:
        """Run call(hooks) -> dcs_status under the model's lock, interruptibly,
        with the Python hook trampoline where `want` asks for it; raise what
        went wrong: a hook's KeyboardInterrupt/SystemExit as itself, its other
        exceptions and engine failures as Error (`aborted` is the engine's
        phrase for a pass a hook stopped, dropped from the message)."""
        hooks = ffi.NULL
        handle = None
        if want.any():
            handle = ffi.new_handle(run)  # kept alive until the call returns
            hooks = ffi.new("dcs_hooks *")
            hooks.want = ffi.cast("const uint8_t *", ffi.from_buffer(want))
            hooks.fn = lib._dcs_py_hook
            hooks.user = handle
        st, interrupted = self._forward_interruptibly(run, lambda: call(hooks))
        del handle
        if interrupted is not None:
            raise interrupted
        if run.error is not None:
            e = run.error
            if isinstance(e, Error) or not isinstance(e, Exception):
                raise e  # KeyboardInterrupt, SystemExit: as themselves
            raise Error("%s: %s: %s" % (self._errmsg().replace(aborted, ""), type(e).__name__, e)) from e
        if st == lib.DCS_ERR_CANCELLED:
            raise KeyboardInterrupt()
        _check(st, self._errmsg())

    def _check_pass_memory(self, B: int, T: int, run: "_Run", logits: bool) -> None:
        """Refuse, before anything is allocated, a pass whose logits and
        cached activations cannot fit in this machine's memory."""
        V = self.config.vocab
        need = B * T * V * 4 if logits else 0
        if need > _physical_memory():
            raise Error(
                "forward: logits of B=%d, T=%d, vocab %d need %.1f GiB, more than this machine's memory"
                % (B, T, V, need / 2**30)
            )
        shape = ffi.new("int64_t[6]")
        for p, l in run.capture:
            nd = lib.dcs_hook_shape(self._m, p, B, T, shape)
            n = 4
            for i in range(nd):
                n *= shape[i]
            need += n
        if need > _physical_memory():
            raise Error(
                "run_with_cache: caching %d hooks at B=%d, T=%d needs %.1f GiB (with the logits), "
                "more than the %.1f GiB of memory of this machine; cache fewer hooks (names=...) "
                "or a shorter sequence" % (len(run.capture), B, T, need / 2**30, _physical_memory() / 2**30)
            )

    def _forward_interruptibly(self, run: "_Run", call):
        """Run call() (a dcs_forward) holding the model's lock. In the main
        thread the call runs on a helper thread while the main thread waits,
        so Ctrl-C (SIGINT) is seen at once: it asks the engine to stop
        (dcs_cancel; checked before each layer and between attention and
        MLP) and hooks to abort, waits for the pass to end, and returns the
        KeyboardInterrupt. Returns (status, KeyboardInterrupt or None)."""
        me = threading.get_ident()
        if self._pass_thread == me:
            raise Error(
                "forward: this model is already running a pass in this thread (a hook "
                "cannot start another pass on its own model; load a second Model)"
            )
        with self._lock:
            lib.dcs_cancel(self._m, 0)
            if threading.current_thread() is not threading.main_thread():
                self._pass_thread = me
                try:
                    return call(), None
                finally:
                    self._pass_thread = None
            result: Dict[str, object] = {}
            done = threading.Event()

            def work():
                self._pass_thread = threading.get_ident()
                try:
                    result["st"] = call()
                except BaseException as e:  # noqa: BLE001 -- handed to the caller
                    result["exc"] = e
                finally:
                    self._pass_thread = None
                    done.set()

            worker = threading.Thread(target=work, name="dclens-forward", daemon=True)
            interrupted = None
            worker.start()
            while not done.is_set():
                try:
                    done.wait(0.25)
                except KeyboardInterrupt as e:  # Ctrl-C: stop the pass, keep waiting
                    if interrupted is None:
                        interrupted = e
                    run.cancel = True
                    lib.dcs_cancel(self._m, 1)
            worker.join()
            lib.dcs_cancel(self._m, 0)
            if "exc" in result:
                raise result["exc"]
            return result["st"], interrupted

    def forward(
        self,
        tokens,
        return_type: Optional[str] = "logits",
        *,
        lengths=None,
        padding_side: str = "right",
        loss_per_token: bool = False,
        logits_at=None,
    ):
        """Logits: [T, V] for a string or a 1-D token array, [B, T, V] for a list
        of strings or [B, T] tokens (with lengths: padded rows).

        return_type: "logits", "loss" (mean next-token cross-entropy over the
        real tokens; loss_per_token=True gives [T-1] / [B, T-1], 0 at padding),
        "both" (logits, loss) or None.

        logits_at computes the unembedding only where asked (logits only, no
        lengths): "last" or one position (-> [V] / [B, V]), [n] positions for
        every sequence or [B, n] per sequence (-> [n, V] / [B, n, V])."""
        if logits_at is not None:
            if return_type != "logits" or lengths is not None or loss_per_token:
                raise Error("logits_at goes with return_type='logits' and no lengths")
            return self._run(tokens, logits_at=logits_at)[0]
        return batch.call(
            self,
            tokens,
            lengths=lengths,
            padding_side=padding_side,
            return_type=return_type,
            loss_per_token=loss_per_token,
        )

    __call__ = forward

    def run_with_cache(
        self,
        tokens,
        names: Names = None,
        *,
        names_filter: Names = None,
        lengths=None,
        padding_side: str = "right",
        return_type: Optional[str] = "logits",
        fwd_hooks: Sequence[Tuple[str, HookFn]] = (),
        read_only: bool = False,
    ) -> Tuple[np.ndarray, Cache]:
        """Logits and a Cache of the named activations (None: every hook).

        names (or names_filter, TransformerLens' spelling): None, a hook
        name, a list of names (dclens or TransformerLens spelling), or a
        predicate on names (tried on both spellings). Capture is read-only;
        fwd_hooks run as in run_with_hooks (read_only=True declares them all
        read-only)."""
        if names is not None and names_filter is not None:
            raise Error("run_with_cache: give names or names_filter, not both")
        sel = names if names is not None else names_filter
        return batch.call(
            self,
            tokens,
            lengths=lengths,
            padding_side=padding_side,
            return_type=return_type,
            capture=self._select(sel),
            fns=hook_pairs(fwd_hooks, read_only),
            with_cache=True,
        )

    def resolve_hook(self, name: str) -> str:
        """The dclens name of a hook given in either spelling, checked."""
        n = _names.canonical(name)
        self.parse_hook(n)
        return n

    def hook_name(self, name, layer=None) -> str:
        """dclens.hook_name with negative layers counted from the end, checked
        against this model: model.hook_name(-1, "attn.post.kp")."""
        name, layer = _names.name_and_layer(name, layer)
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool) and layer < 0:
            layer = int(layer) + self.config.n_layer
            if layer < 0:
                raise Error(
                    "hook_name: layer %d is out of range (model has %d layers)"
                    % (layer - self.config.n_layer, self.config.n_layer)
                )
        n = _names.hook_name(name, layer)
        self.parse_hook(n)
        return n

    # ------------------------------------------------------------ persistent hooks

    def add_hook(self, name: str, fn: HookFn, read_only: bool = False) -> None:
        """Add a hook that every later pass (forward, run_with_*, generate) runs,
        until reset_hooks() (read_only=True: see dclens.read_only)."""
        ((name, fn),) = hook_pairs([(name, fn)], read_only)
        self._ctx_hooks.append((self.resolve_hook(name), fn))

    def reset_hooks(self) -> None:
        """Remove the hooks added with add_hook."""
        self._ctx_hooks.clear()

    def hooks(self, fwd_hooks: Sequence[Tuple[str, HookFn]] = (), read_only: bool = False):
        """Context manager: the hooks apply to every pass inside the with block
        (read_only=True: see dclens.read_only).

        >>> with model.hooks([iv.ablate_head(model, 1, 2)]):
        ...     logits = model(toks)"""
        pairs = [(self.resolve_hook(n), fn) for n, fn in hook_pairs(fwd_hooks, read_only)]

        @contextlib.contextmanager
        def cm():
            before = len(self._ctx_hooks)
            self._ctx_hooks.extend(pairs)
            try:
                yield self
            finally:
                del self._ctx_hooks[before:]

        return cm()

    def generate(
        self, prompt, max_new_tokens: int = 20, temperature: float = 0.0, top_k: Optional[int] = None, stop=None, **kw
    ):
        """Continue a prompt with the engine's incremental decoder (dclens.generate)."""
        return _generate.generate(self, prompt, max_new_tokens, temperature, top_k, stop, **kw)

    def run_with_hooks(
        self,
        tokens,
        fwd_hooks: Sequence[Tuple[str, HookFn]] = (),
        cache_names: Names = (),
        *,
        lengths=None,
        padding_side: str = "right",
        return_type: Optional[str] = "logits",
        read_only: bool = False,
    ):
        """Logits of a pass where fn(activation, name) is called at each named point.

        fn may modify the activation in place, return a replacement array of the
        same shape, or return None to keep it. Writing to a compose branch
        (blocks.{l}.attn.post.kp) changes the composed sum that follows; writing
        to pattern_composed, z, head_out, resid_* changes everything downstream.
        Every hook that is called counts as a write (what it leaves in the
        array is copied back into the engine) unless it is read-only:
        dclens.read_only(fn), or read_only=True for all of fwd_hooks; a
        read-only hook gets a read-only array and costs no copy back.
        With cache_names (None meaning every hook, as in run_with_cache),
        returns (logits, cache) of the hooked pass."""
        fwd_hooks = hook_pairs(fwd_hooks, read_only)
        want_cache = cache_names is None or bool(cache_names)
        cap = self._select(cache_names) if want_cache else ()
        return batch.call(
            self,
            tokens,
            lengths=lengths,
            padding_side=padding_side,
            return_type=return_type,
            capture=cap,
            fns=fwd_hooks,
            with_cache=want_cache,
        )

    def last_pass_memory(self) -> Dict[str, int]:
        """Activation bytes of the last pass (weights excluded): 'peak' held at
        once and 'total' asked for. Hooks not asked for add nothing. After a
        gradient pass: the tape's buffers plus the largest transient of its
        forward and recomputations ('peak'; estimate_backward_memory bounds it)."""
        peak, total = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        lib.dcs_forward_memory(self._m, peak, total)
        return {"peak": int(peak[0]), "total": int(total[0])}

    # ------------------------------------------------------------ weights

    def weight(self, name: str) -> np.ndarray:
        """A weight by canonical (dcpythia) name, as a read-only float32 array
        (see dclens.h). The last few weights read are kept, so per-head
        circuit code can call this in a loop."""
        cname = c_str("weight name", name)
        cache = self.__dict__.setdefault("_weights", {})
        if name in cache:
            cache[name] = cache.pop(name)  # most recently used last
            return cache[name]
        shape = ffi.new("int64_t[5]")
        nd = ffi.new("int *")
        with self._engine_lock():
            _check(lib.dcs_weight_shape(self._m, cname, shape, nd), self._errmsg())
            dims = tuple(shape[i] for i in range(nd[0]))
            out = np.empty(dims, dtype=np.float32)
            _check(
                lib.dcs_weight_read(self._m, cname, ffi.cast("float *", ffi.from_buffer(out)), out.size), self._errmsg()
            )
        out.flags.writeable = False
        cache[name] = out
        while len(cache) > 6:
            cache.pop(next(iter(cache)))
        return out

    # ------------------------------------------------------------ routing, circuits

    def composition_map(
        self, tokens, layer: int, phase: str, query: int, key: int, cache: Optional[Cache] = None
    ) -> np.ndarray:
        """The N x N head-to-head map C[query, key] of a layer and phase (routing.py).
        With cache= (a run_with_cache of the same tokens) no pass is run."""
        if cache is not None:
            return routing.composition_maps(self, cache, layer, phase, query=query, key=key)
        return routing.composition_map(self, tokens, layer, phase, query, key)

    def routing_matrix(self, tokens, layer: int, phase: str, query: int, cache: Optional[Cache] = None) -> np.ndarray:
        """Head-to-head routing at a query, weighted by what it routes (routing.py).
        With cache= no pass is run; routing.routing_matrices gives every query at once."""
        if cache is not None:
            return routing.routing_matrices(self, cache, phase, layers=[layer], queries=[query])[0, 0]
        return routing.routing_matrix(self, tokens, layer, phase, query)

    def gates(self, tokens, layer: int, cache: Optional[Cache] = None):
        """The dynamic gates qdd/kdd of both phases of a layer (routing.py)."""
        if cache is not None:
            return routing.gates_from_cache(self, cache, layer)
        return routing.gates(self, tokens, layer)

    # ------------------------------------------------------------ gradients, attribution (grad.py, attribution.py)

    def gradients(self, tokens, target, wrt, return_value: bool = False, max_tape_bytes: Optional[int] = None):
        """d target / d activation (hook names) or d parameter (weight names) -> dict (grad.py)."""
        return grad.gradients(self, tokens, target, wrt, return_value=return_value, max_tape_bytes=max_tape_bytes)

    def attribute(
        self,
        tokens,
        target,
        at,
        method: str = "ig",
        steps: int = 32,
        baseline="zero",
        progress: Optional[bool] = None,
        max_tape_bytes: Optional[int] = None,
    ):
        """Integrated gradients or gradient x activation at hook points (attribution.py)."""
        return attribution.attribute(
            self,
            tokens,
            target,
            at,
            method=method,
            steps=steps,
            baseline=baseline,
            progress=progress,
            max_tape_bytes=max_tape_bytes,
        )

    def estimate_backward_memory(self, T: int, B: int = 1, wrt=(), max_tape_bytes: Optional[int] = None):
        """Bytes a gradient pass over B x T tokens would take under each tape plan, before
        anything is allocated, and the plan the budget picks (memplan.py)."""
        return memplan.estimate(self, T, B, wrt, max_tape_bytes)
