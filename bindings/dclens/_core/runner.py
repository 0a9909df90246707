"""Runner: the engine boundary of the Python package.

Every call the package makes on a loaded model goes through here (tapes.py
holds the gradient tapes' own calls, heatmaps.py the renderer's; no other
module imports the binding, tests/api/test_imports.py): loading (load), the
handle's queries (config, layer plans, weights by name, hook shapes, memory,
the parameter table, the optimizer step, the decoder), always under the
model's lock, and the model-free ones (hook_points, cuda_available,
blas_info). It owns a loaded model's engine handle (dcs_model *), the lock
that lets one engine call at a time run on it, its error messages, its hook
name table and its runs: a forward pass with hooks (run), the hook plan and
the C trampoline shared with the decoder (hook_plan, call_engine; what runs
at a hook is hooks.py's), Ctrl-C handling, and its life across fork() (a
forked child gets a new lock; os.register_at_fork below). Model (model.py) and the analyses use a model's runner instead of
Model's private members; nothing here imports Model, and nothing here calls
back into it: a run takes integer tokens (Model turns text into tokens and
warns of a long prompt first) and the hook functions to run (Model's hooks
in force, Model.hooks_in_force).

Layers of the package (tests/api/test_imports.py refuses any import cycle):
  _binding (over _engine), _checks, names,    the binding, checks, hook names, the attention mask,
  mask, _protocols, warning_types             every warning class
  hooks, cache, memplan, tapes, runner        plumbing: runs, caches, tapes
  routing, grad, attribution, generate        the analyses Model offers as methods (Model imports them)
  batch, weights, model                       Model (and Cache) for the user
  circuits, patching, analysis, ...           the analyses built on Model
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Callable, Union

import numpy as np

from . import names as _names
from .binding import check_status as _check
from .binding import ffi, lib
from .checks import (
    ArgumentError,
    ArgumentTypeError,
    Error,
    UnknownNameError,
    c_str,
    check_str,
    decode_msg,
    token_array,
    unknown_name,
)
from .hooks import HookFn, HookTable, _Run, forget_engine_views, hook_call, own_frame
from .tapes import TapeCache

Names = Union[None, str, Iterable[str], Callable[[str], bool]]


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


# The runners of this process, for the fork handler below (process state, as
# the engine's fork count is: a fork is an event of the whole process).
_LIVE: weakref.WeakSet[Runner] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a forked child: every model's runner gets a new lock (the parent's
    may be held by a thread the child does not have); a runner whose lock was
    held had a call running in such a thread, so the engine forgets that
    call's buffers (dcs_after_fork). The CPU thread pool rebuilds itself."""
    for r in list(_LIVE):
        r.reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------- model-free queries


def hook_points(handle=None) -> list[tuple[int, str, bool]]:
    """The engine's hook points as (point, name, per layer?), in its order: the
    ones `handle`'s model has, or every point (handle None: the table itself)."""
    return [
        (p, ffi.string(lib.dcs_hook_point_name(p)).decode(), bool(lib.dcs_hook_point_is_layered(p)))
        for p in range(lib.DCS_HP_COUNT)
        if handle is None or lib.dcs_hook_exists(handle, p)
    ]


def hook_point_count() -> int:
    """DCS_HP_COUNT: the size of the engine's table of points (the want table's stride)."""
    return int(lib.DCS_HP_COUNT)


def cuda_available(why: bool = False):
    """Whether the CUDA backend can run here; with why=True, the engine's reason
    it cannot ("" when it can)."""
    if not why:
        return bool(lib.dcs_cuda_available(ffi.NULL, 0))
    buf = ffi.new("char[]", 512)
    if lib.dcs_cuda_available(buf, 512):
        return ""
    return ffi.string(buf).decode(errors="replace")


def blas_info() -> tuple[str, str, str]:
    """(library, configuration, core) of the BLAS the engine was linked with and runs."""
    library, config, core = (
        ffi.string(f()).decode(errors="replace") for f in (lib.dcs_blas_library, lib.dcs_blas_config, lib.dcs_blas_core)
    )
    return library, config, core


def load(cpath: bytes, device: str, n_threads: int, dtype_index: int):
    """dcs_load: the engine handle of the checkpoint at cpath (freed when the
    handle is collected), or the engine's Error naming the file."""
    opts = ffi.new("dcs_load_options *")
    opts.device = 1 if device == "cuda" else 0
    opts.n_threads = n_threads
    opts.dtype = dtype_index
    out = ffi.new("dcs_model **")
    err = ffi.new("char[]", 1024)
    st = lib.dcs_load(cpath, opts, out, err, 1024)
    _check(st, decode_msg(ffi.string(err)))
    return ffi.gc(out[0], lib.dcs_free)


def config_of(handle):
    """The engine's dcs_config of a loaded handle (a struct whose fields Model reads)."""
    return lib.dcs_model_config(handle)


def layer_plan_of(handle, l: int) -> dict[str, Any]:
    """What layer l computes (dcs_layer_plan) as plain values (model.LayerPlan's fields)."""
    p = lib.dcs_layer_plan_of(handle, l)
    return dict(
        norm="rms" if p.norm == lib.DCS_NORM_RMS else "layer",
        parallel_residual=bool(p.parallel_residual),
        mlp="swiglu" if p.mlp == lib.DCS_MLP_SWIGLU else "gelu",
        mlp_gate=int(p.mlp_gate),
        window=int(p.window),
        qk_norm=bool(p.qk_norm),
        moh=bool(p.moh),
        dcmha=bool(p.dcmha),
        slots=int(p.slots),
        slot=((int(p.slot[0][0]), int(p.slot[0][1])), (int(p.slot[1][0]), int(p.slot[1][1]))),
        groups=int(p.groups),
        static_branch=bool(p.static_branch),
        row_compose=bool(p.row_compose),
        fused=bool(p.fused),
    )


def load_warnings_of(handle) -> list[str]:
    """What the engine noted while loading (one line each)."""
    return ffi.string(lib.dcs_load_warnings(handle)).decode(errors="replace").splitlines()


# ---------------------------------------------------------------- the hook trampoline


@own_frame
def _engine_view(data, dims: tuple[int, ...], batched: bool) -> np.ndarray:
    """A float32 view of engine memory (the hook point's activation): short-lived, never handed out."""
    n = 1
    for d in dims:
        n *= d
    arr = np.frombuffer(ffi.buffer(data, n * 4), dtype=np.float32).reshape(dims)
    return arr if batched else arr[0]


@ffi.def_extern()
def _dcs_py_hook(user, point, layer, data, shape, ndim):
    run: _Run = ffi.from_handle(user)
    try:
        if run.cancel:
            raise KeyboardInterrupt()
        dims = tuple(shape[i] for i in range(ndim))
        return hook_call(run, (point, layer), lambda: _engine_view(data, dims, run.batched))
    except BaseException as e:  # noqa: BLE001 -- reported after the pass returns
        forget_engine_views(e)
        run.error = e
        return -1


class Runner:
    """The engine side of one loaded model: handle, lock, errors, runs.

    name and device are the model's (messages, the fork guard); hooks is the
    model's list of hooks in force (add_hook, `with model.hooks`), which the
    model changes and the runner only reads (ctx_hooks, refuse_hooks)."""

    def __init__(
        self,
        handle: Any,
        vocab: int,
        n_layer: int,
        *,
        name: str = "",
        device: str = "cpu",
        hooks: list[tuple[str, HookFn]] | None = None,
        new_cache: Callable[[], Any] = dict,
    ):
        self.handle = handle
        self.vocab = vocab
        self.n_layer = n_layer
        self.name = name
        self.device = device
        self.pid = os.getpid()  # the process that loaded it (CUDA does not survive fork)
        # One engine call at a time per model (the engine's pool and error
        # record are per model, and cffi releases the GIL during a pass):
        # other threads wait. pass_thread is the thread running this
        # model's hooks, which may read weights but not start another pass.
        self.lock = threading.RLock()
        self.pass_thread: int | None = None
        points = hook_points(handle)
        self.hook_table = HookTable(points, n_layer)  # name <-> (point, layer)
        self._layered = {p: per_layer for p, _, per_layer in points}
        self._hooks: list[tuple[str, HookFn]] = [] if hooks is None else hooks  # the model's, read only here
        self.tapes = TapeCache()  # gradient tapes kept between calls (tapes.py)
        self.new_cache = new_cache  # what a run fills (Model gives dclens.Cache: it sits above the core)
        _LIVE.add(self)

    def reset_after_fork(self) -> None:
        """In a forked child (see _after_fork_in_child)."""
        held = not self.lock.acquire(blocking=False)
        if not held:
            self.lock.release()
        self.lock = threading.RLock()
        self.pass_thread = None
        # the parent's idle tapes: never reused here (a new cache); freed on
        # the CPU when no call was running (tapes.TapeCache.forget)
        tapes, self.tapes = self.tapes, TapeCache()
        tapes.forget(free=self.device != "cuda" and not held)
        if self.device == "cuda":
            ffi.gc(self.handle, None)  # the child has no CUDA context: never free (or use) the parent's
        elif held:
            lib.dcs_after_fork(self.handle)

    def check_process(self) -> None:
        if self.device == "cuda" and os.getpid() != self.pid:
            raise Error(
                "%s: a CUDA model cannot be used in a process forked from the one that loaded it "
                "(CUDA does not survive fork); load it in the child, use the 'spawn' start "
                "method, or pass the model pickled (it loads again)" % self.name
            )

    def errmsg(self) -> str:
        return decode_msg(ffi.string(lib.dcs_errmsg(self.handle)))

    @contextlib.contextmanager
    def engine_lock(self) -> Iterator[None]:
        """Hold the model for one engine call. A hook of a running pass (its
        thread owns the pass) goes through without waiting."""
        if self.pass_thread == threading.get_ident():
            yield
            return
        self.check_process()
        with self.lock:
            yield

    @property
    def ctx_hooks(self) -> tuple[tuple[str, HookFn], ...]:
        """The model's hooks in force (add_hook, `with model.hooks(...)`), read-only."""
        return tuple(self._hooks)

    def refuse_hooks(self, what: str) -> None:
        """An Error naming the model's hooks in force, for a call that cannot
        run them (a gradient tape runs no Python function): such a call
        refuses rather than computing the un-hooked model."""
        hooks = self._hooks
        if not hooks:
            return
        shown = ", ".join(sorted({n for n, _ in hooks})[:6])
        more = len({n for n, _ in hooks}) - 6
        raise Error(
            "%s: %d hook%s in force on %s (%s%s, from add_hook or `with model.hooks(...)`); a gradient pass "
            "cannot run Python hook functions and would compute the model without them. Call it outside the "
            "with block or after model.reset_hooks(); for a patched or ablated model, give the patched "
            "activations as values (docs/api.md, 'Which hooks a pass runs')"
            % (
                what,
                len(hooks),
                "" if len(hooks) == 1 else "s",
                self.name,
                shown,
                ", and %d more" % more if more > 0 else "",
            )
        )

    def parse_hook(self, name: str) -> tuple[int, int]:
        """(point, layer) of a hook name of this model (dclens's, or the
        TransformerLens spelling unknown_hook suggests); an Error naming what is
        wrong with any other name."""
        if isinstance(name, str):
            key = self.hook_table.key.get(name) or self.hook_table.key.get(_names.canonical(name))
            if key is not None:
                return key
        cname = c_str("hook name", name)  # the engine's parser says what is wrong
        p, l = ffi.new("int *"), ffi.new("int *")
        with self.engine_lock():
            st = lib.dcs_hook_parse(self.handle, cname, p, l)
        if st != lib.DCS_OK:
            raise self.unknown_hook(name, self.errmsg())
        return p[0], l[0]

    def unknown_hook(self, name: str, engine_msg: str) -> UnknownNameError:
        """The engine's reason, the closest names and where every name is listed."""
        known = list(self.hook_table.names)
        known += [a for a in map(_names.tl_alias, known) if a]
        return unknown_name(
            "hook",
            name,
            known,
            "",
            "dclens.hook_names(model), or `dclens info --model %s --hooks`," % self.name,
            message="%s: %s" % (self.name, engine_msg),
        )

    def select(self, names: Names) -> list[str]:
        """The hooks a capture names: None is every hook but the split inputs
        (attn.{q,k,v}_input, attn.dyn_input, mlp_input: copies of the
        residual stream, N of them per head input, captured when named or
        matched by a predicate, as TransformerLens has them only on request)."""
        canonical, tl_alias = _names.canonical, _names.tl_alias
        if names is None:
            return [n for n in self.hook_table.names if not n.endswith(_names.SPLIT_INPUTS)]
        if isinstance(names, str):
            names = [names]
        if callable(names):
            pred = names
            out = [n for n in self.hook_table.names if pred(n) or ((a := tl_alias(n)) is not None and pred(a))]
            if not out:
                raise Error(self.no_match(pred))
            return out
        try:
            names = list(names)
        except TypeError:
            raise ArgumentError(
                "names must be None, a hook name, a list of hook names or a predicate, "
                "not %s %r" % (type(names).__name__, names)
            ) from None
        names = [canonical(check_str("hook name", n)) for n in names]
        for n in names:
            self.parse_hook(n)
        return names

    def no_match(self, pred: Callable[[str], bool]) -> str:
        """The message for a hook predicate that matches no hook of this model."""
        close = _names.suggest(_names.predicate_strings(pred), self.hook_table.names)
        return (
            "the hook filter %s matches no hook of %s (%d hooks, e.g. blocks.0.attn.pattern / "
            "blocks.0.attn.hook_pattern)%s"
            % (
                getattr(pred, "__name__", repr(pred)),
                self.name,
                len(self.hook_table.names),
                "; closest to what it mentions: " + ", ".join(close) if close else "",
            )
        )

    def tokens(self, tokens) -> tuple[np.ndarray, bool]:
        """Token ids ([T] or [B, T] integers) checked, as a contiguous int32
        [B, T] array, and whether they were batched. Text is the model's to
        tokenize (Model.token_ids)."""
        if isinstance(tokens, str):
            raise ArgumentTypeError("tokens: the runner takes token ids, not text (tokenize with model.to_tokens)")
        a = token_array(tokens)
        if a.dtype.kind not in "iu":
            raise ArgumentTypeError("tokens must be integers, got dtype %s" % a.dtype)
        if a.ndim not in (1, 2) or a.size == 0:
            raise ArgumentError("tokens must be a non-empty [T] or [B, T] array, got shape %s" % (a.shape,))
        if a.min() < 0 or a.max() >= self.vocab:
            raise ArgumentError(
                "token id %d is out of range [0, %d)" % (a.max() if a.max() >= self.vocab else a.min(), self.vocab)
            )
        batched = a.ndim == 2
        return np.ascontiguousarray(a.reshape(-1, a.shape[-1]), dtype=np.int32), batched

    def positions(self, logits_at, B: int, T: int):
        """logits_at -> (int32 [B, n] positions, squeeze?) or (None, False)."""
        if logits_at is None:
            return None, False
        if isinstance(logits_at, str):
            if logits_at != "last":
                raise ArgumentError("logits_at must be None, 'last', or positions, got %r" % (logits_at,))
            return np.full((B, 1), T - 1, dtype=np.int32), True
        a = np.asarray(logits_at)
        if a.dtype.kind not in "iu" or a.size == 0 or a.ndim not in (0, 1, 2):
            raise ArgumentError(
                "logits_at must be 'last', an integer, [n] or [B, n] integer positions, got %r" % (logits_at,)
            )
        squeeze = a.ndim == 0
        a = a.reshape(1, -1) if a.ndim < 2 else a
        if a.shape[0] == 1 and B > 1:
            a = np.broadcast_to(a, (B, a.shape[1]))
        if a.shape[0] != B:
            raise Error("logits_at has positions for %d sequences, tokens have %d" % (a.shape[0], B))
        if a.shape[1] > T:
            raise ArgumentError("logits_at asks for %d positions per sequence, more than T = %d" % (a.shape[1], T))
        if a.min() < 0 or a.max() >= T:
            raise ArgumentError(
                "logits_at position %d is out of range [0, %d)" % (a.max() if a.max() >= T else a.min(), T)
            )
        return np.ascontiguousarray(a, dtype=np.int32), squeeze

    def run(
        self,
        tokens,
        capture: Sequence[str] = (),
        fns: Sequence[tuple[str, HookFn]] = (),
        logits: bool = True,
        logits_at=None,
    ):
        """One forward pass over token ids ([T] or [B, T]): (logits, cache).
        capture: hook names to cache; fns: the (name, fn) hooks to run, all
        of them (the caller combines the model's hooks in force with its
        own: Model.hooks_in_force)."""
        toks, batched = self.tokens(tokens)
        B, T = toks.shape
        pos, squeeze = self.positions(logits_at, B, T)
        n_out = T if pos is None else pos.shape[1]
        run = self.new_run(batched)
        want = self.hook_plan(run, capture, fns)
        self.check_pass_memory(B, n_out, run, logits)
        try:
            out = np.empty((B, n_out, self.vocab), dtype=np.float32) if logits else None
        except MemoryError:
            raise Error("forward: no memory for the logits of B=%d, T=%d, vocab %d" % (B, n_out, self.vocab)) from None
        ctoks = ffi.cast("const int32_t *", ffi.from_buffer(toks))
        clog = ffi.cast("float *", ffi.from_buffer(out)) if out is not None else ffi.NULL
        cpos = ffi.cast("const int32_t *", ffi.from_buffer(pos)) if pos is not None else ffi.NULL
        n_pos = 0 if pos is None else pos.shape[1]
        self.call_engine(
            run,
            want,
            lambda hooks: lib.dcs_forward_at(self.handle, ctoks, B, T, cpos, n_pos, clog, hooks),
            " aborted the forward pass",
        )
        if out is not None and squeeze:
            out = out[:, 0]
        if out is not None and not batched:
            out = out[0]
        return out, run.cache

    def new_run(self, batched: bool) -> _Run:
        """The state of one pass with hooks: what runs where, and the cache it fills."""
        return _Run(self.hook_table, batched, self.new_cache())

    def hook_plan(self, run: _Run, capture: Sequence[str], fns: Sequence[tuple[str, HookFn]]) -> np.ndarray:
        """Record in `run` what each hook point captures and calls; return the
        engine's want table [DCS_HP_COUNT * L] (1 = call back at that point)."""
        L = self.n_layer
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

    def call_engine(self, run: _Run, want: np.ndarray, call, aborted: str) -> None:
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
        st, interrupted = self.forward_interruptibly(run, lambda: call(hooks))
        del handle
        if interrupted is not None:
            raise interrupted
        if run.error is not None:
            e = run.error
            if isinstance(e, Error) or not isinstance(e, Exception):
                raise e  # KeyboardInterrupt, SystemExit: as themselves
            raise Error("%s: %s: %s" % (self.errmsg().replace(aborted, ""), type(e).__name__, e)) from e
        if st == lib.DCS_ERR_CANCELLED:
            raise KeyboardInterrupt()
        _check(st, self.errmsg())

    def check_pass_memory(self, B: int, T: int, run: _Run, logits: bool) -> None:
        """Refuse, before anything is allocated, a pass whose logits and
        cached activations cannot fit in this machine's memory."""
        V = self.vocab
        need = B * T * V * 4 if logits else 0
        if need > _physical_memory():
            raise Error(
                "forward: logits of B=%d, T=%d, vocab %d need %.1f GiB, more than this machine's memory"
                % (B, T, V, need / 2**30)
            )
        shape = ffi.new("int64_t[6]")
        for p, _ in run.capture:
            nd = lib.dcs_hook_shape(self.handle, p, B, T, shape)
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

    def forward_interruptibly(self, run: _Run, call):
        """Run call() (a dcs_forward) holding the model's lock. In the main
        thread the call runs on a helper thread while the main thread waits,
        so Ctrl-C (SIGINT) is seen at once: it asks the engine to stop
        (dcs_cancel; checked before each layer and between attention and
        MLP) and hooks to abort, waits for the pass to end, and returns the
        KeyboardInterrupt. Returns (status, KeyboardInterrupt or None)."""
        me = threading.get_ident()
        self.check_process()
        if self.pass_thread == me:
            raise Error(
                "forward: this model is already running a pass in this thread (a hook "
                "cannot start another pass on its own model; load a second Model)"
            )
        with self.lock:
            lib.dcs_cancel(self.handle, 0)
            if threading.current_thread() is not threading.main_thread():
                self.pass_thread = me
                try:
                    return call(), None
                finally:
                    self.pass_thread = None
            result: dict[str, Any] = {}
            done = threading.Event()

            def work():
                self.pass_thread = threading.get_ident()
                try:
                    result["st"] = call()
                except BaseException as e:  # noqa: BLE001 -- handed to the caller
                    result["exc"] = e
                finally:
                    self.pass_thread = None
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
                    lib.dcs_cancel(self.handle, 1)
            worker.join()
            lib.dcs_cancel(self.handle, 0)
            if "exc" in result:
                raise result["exc"]
            return result["st"], interrupted

    # ------------------------------------------------------------ the handle's queries
    # Each holds the model's lock (engine_lock: a hook of the running pass goes through).

    def config(self):
        """The engine's dcs_config of this model."""
        return config_of(self.handle)

    def layer_plans(self) -> list[dict[str, Any]]:
        """What each layer computes (layer_plan_of), layer by layer."""
        with self.engine_lock():
            return [layer_plan_of(self.handle, l) for l in range(self.n_layer)]

    def load_warnings(self) -> list[str]:
        """What the engine noted while loading this model."""
        return load_warnings_of(self.handle)

    def weight_dtype(self) -> int:
        """dcs_model_weight_dtype: 0 float32, 1 float16, 2 bfloat16, 3 mixed."""
        return int(lib.dcs_model_weight_dtype(self.handle))

    def attention_rows(self) -> int:
        """The model's attention_rows setting (Model.attention_rows)."""
        return int(lib.dcs_model_attention_rows(self.handle))

    def set_attention_rows(self, rows: int) -> None:
        """Set attention_rows (checked by the caller), between passes."""
        with self.engine_lock():
            _check(lib.dcs_model_set_attention_rows(self.handle, rows), self.errmsg())

    def forward_memory(self) -> tuple[int, int]:
        """(peak, total) bytes of the last pass's buffers (dcs_forward_memory)."""
        peak, total = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        lib.dcs_forward_memory(self.handle, peak, total)
        return int(peak[0]), int(total[0])

    def trim(self) -> None:
        """Give back the activation buffers pooled between passes (dcs_model_trim)."""
        with self.engine_lock():
            lib.dcs_model_trim(self.handle)

    def device_memory(self) -> int | None:
        """Free bytes of the model's device (dcs_device_memory), or None where it cannot say."""
        free, total = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        with self.engine_lock():
            st = lib.dcs_device_memory(self.handle, free, total)
        return int(free[0]) if st == lib.DCS_OK else None

    # ------------------------------------------------------------ weights

    def weight_names(self) -> list[str]:
        """The canonical names of every weight, in the engine's order."""
        with self.engine_lock():
            return [
                ffi.string(lib.dcs_weight_name(self.handle, i)).decode()
                for i in range(lib.dcs_weight_count(self.handle))
            ]

    def _weight_dims(self, cname: bytes) -> tuple[int, ...]:
        shape, nd = ffi.new("int64_t[5]"), ffi.new("int *")
        _check(lib.dcs_weight_shape(self.handle, cname, shape, nd), self.errmsg())
        return tuple(int(shape[i]) for i in range(nd[0]))

    def weight_shape(self, name: str) -> tuple[int, ...]:
        """A weight's stored shape, without reading it; the engine's Error for a name it lacks."""
        with self.engine_lock():
            return self._weight_dims(c_str("weight name", name))

    def read_weight(self, name: str) -> np.ndarray:
        """A fresh float32 copy of a weight by canonical name (widened from F16/BF16), its
        shape and its values read under one hold of the lock; the engine's Error for a name
        it lacks. The package's one read of a weight (Model.weight, grad, train)."""
        cname = c_str("weight name", name)
        with self.engine_lock():
            out = np.empty(self._weight_dims(cname), dtype=np.float32)
            _check(
                lib.dcs_weight_read(self.handle, cname, ffi.cast("float *", ffi.from_buffer(out)), out.size),
                self.errmsg(),
            )
        return out

    # ------------------------------------------------------------ hook points

    def point_is_layered(self, point: int) -> bool:
        """Whether hook point `point` of this model is per layer (blocks.{l}.*) or global."""
        return self._layered[point]

    def hook_shape(self, point: int, B: int, T: int) -> tuple[int, ...]:
        """The [B, ...] shape of hook point `point` in a pass of B x T tokens (dcs_hook_shape)."""
        shape = ffi.new("int64_t[6]")
        nd = lib.dcs_hook_shape(self.handle, int(point), int(B), int(T), shape)
        return tuple(int(shape[i]) for i in range(nd))

    # ------------------------------------------------------------ training

    def param_table(self) -> list[tuple[str, int, int, bool]]:
        """(name, offset, elements, weight-decayed) of every parameter in the flat layout."""
        rows = []
        nm, off, n, dec = ffi.new("const char **"), ffi.new("int64_t *"), ffi.new("int64_t *"), ffi.new("int *")
        with self.engine_lock():
            for i in range(lib.dcs_param_count(self.handle)):
                _check(lib.dcs_param_info(self.handle, i, nm, off, n, dec), self.errmsg())
                rows.append((ffi.string(nm[0]).decode(), int(off[0]), int(n[0]), bool(dec[0])))
        return rows

    def param_total(self) -> int:
        """Elements of the flat parameter vector (dcs_param_total)."""
        return int(lib.dcs_param_total(self.handle))

    def tape_plan(self, B: int, T: int, first: int, recompute: bool, points: Sequence[int]) -> int:
        """Bytes a gradient tape of this shape would hold (dcs_tape_plan)."""
        out = ffi.new("uint64_t *")
        pts = ffi.new("int[]", [int(p) for p in points] or [0])
        with self.engine_lock():
            _check(
                lib.dcs_tape_plan(self.handle, int(B), int(T), int(first), int(recompute), pts, len(points), out),
                self.errmsg(),
            )
        return int(out[0])

    def make_trainable(self) -> None:
        """Give the model float32 master weights the optimizer can step (dcs_model_make_trainable)."""
        with self.engine_lock():
            _check(lib.dcs_model_make_trainable(self.handle), self.errmsg())

    def adamw_step(self, grads: np.ndarray, mom: np.ndarray, var: np.ndarray, step: int, hp: Any) -> None:
        """One AdamW step on the flat parameters (float32 [P] grads, moments), in place;
        hp has lr, beta1, beta2, eps and weight_decay (train.AdamW, or a dcs_adamw)."""
        c = ffi.new("dcs_adamw *")
        c.lr, c.beta1, c.beta2, c.eps, c.weight_decay = hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay

        def f(a):
            return ffi.cast("float *", ffi.from_buffer(a))

        with self.engine_lock():
            _check(lib.dcs_adamw_step(self.handle, f(grads), f(mom), f(var), step, c), self.errmsg())

    # ------------------------------------------------------------ the decoder

    def new_decoder(self) -> EngineDecoder:
        """An incremental decoder over this model (dcs_decoder_new)."""
        return EngineDecoder(self)


class EngineDecoder:
    """The engine's incremental decoder (K/V + dynamic-weight caches) of one model;
    generate.Decoder is its Python face. The engine keeps the model alive until its
    last decoder is freed, whatever order the garbage collector finalizes them in."""

    def __init__(self, runner: Runner):
        self.runner = runner
        out = ffi.new("dcs_decoder **")
        with runner.engine_lock():
            _check(lib.dcs_decoder_new(runner.handle, out), runner.errmsg())
        self._d = ffi.gc(out[0], lib.dcs_decoder_free)

    def pos(self) -> int:
        """Tokens fed so far."""
        return int(lib.dcs_decoder_pos(self._d))

    def layer_keys(self, layer: int) -> int:
        """Key positions layer `layer` holds now (-1 for a layer out of range)."""
        return int(lib.dcs_decoder_layer_keys(self._d, layer))

    def step(self, run: _Run, want: np.ndarray, toks: np.ndarray, out: np.ndarray | None) -> None:
        """Feed int32 [n] tokens with run's hooks (Runner.hook_plan), logits into out [n, V]."""
        ctoks = ffi.cast("const int32_t *", ffi.from_buffer(toks))
        clog = ffi.cast("float *", ffi.from_buffer(out)) if out is not None else ffi.NULL
        n = int(toks.size)
        # the model's lock, and Ctrl-C stops the step (see Runner.call_engine)
        self.runner.call_engine(
            run, want, lambda hooks: lib.dcs_decoder_step(self._d, ctoks, n, clog, hooks), " aborted the decoding step"
        )
