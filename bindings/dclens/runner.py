"""Runner: the bottom of the Python package above the engine binding.

It owns a loaded model's engine handle (dcs_model *), the lock that lets one
engine call at a time run on it, its error messages, its hook name table and
its runs: a forward pass with hooks (run), the hook plan and the trampoline
call shared with the decoder (hook_plan, call_engine), Ctrl-C handling, and
its life across fork() (a forked child gets a new lock; os.register_at_fork
below). Model (model.py) and the analyses use a model's runner instead of
Model's private members; nothing here imports Model, and nothing here calls
back into it: a run takes integer tokens (Model turns text into tokens and
warns of a long prompt first) and the hook functions to run (Model's hooks
in force, Model.hooks_in_force).

Layers of the package (tests/api/test_imports.py refuses any import cycle):
  _engine, _checks, names, mask, _protocols   the binding, checks, hook names, the attention mask
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
from ._checks import (
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
from ._checks import check_status as _check
from ._engine import ffi, lib
from .hooks import HookFn, HookTable, _Run
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
        self.hook_table = HookTable(handle, n_layer)  # name <-> (point, layer)
        self._hooks: list[tuple[str, HookFn]] = [] if hooks is None else hooks  # the model's, read only here
        self.tapes = TapeCache()  # gradient tapes kept between calls (tapes.py)
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
        run = _Run(self.hook_table, batched)
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
