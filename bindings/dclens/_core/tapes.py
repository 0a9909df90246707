"""The engine's gradient tape seen from Python (Tape), and the tapes a model
keeps between calls (TapeCache, lease).

A tape (dcs_tape) holds every buffer of a forward pass that keeps
activations and of its backward. Making one allocates them (the tape's
buffers are tens of MB on the tiny models, GB at 6.9B) and freeing it gives
them back, with the model's pooled pass transients; a fresh tape per call
pays for that every call (zeroing, and page faults on fresh pages: on
dcpythia-tiny 4-7% of a `gradients` call and 6-11% of an `attribute` call,
docs/benchmarks/diary.md "tape reuse").

So Model.gradients and Model.attribute lease a tape from the model's
TapeCache (Runner.tapes) and give it back after the call: an idle tape made
for B' x T' from layer `first` serves a later call of B <= B', T <= T' from
the same layer (dcs_tape_reshape: a prefix of each buffer; the same bits as
a fresh tape, tests/passes/test_tape_cache.py), when it fits the call's budget.

What it may hold: at most MAX_IDLE idle tapes; a call evicts idle tapes
until they and the tape it needs fit its max_tape_bytes (the default budget
counts the idle tapes as available, since they are the caller's to free);
Model.free_caches() frees them all (and the model's pooled transients), and
they go with the model. Threads: a leased tape is out of the cache until it
is given back, so two threads never share one (the second makes its own).
Fork: a child gets an empty cache (Runner.reset_after_fork); the parent's
tapes are freed there on the CPU when no call was running, else left alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from . import memplan
from .binding import check_status as _check
from .binding import ffi, lib
from .checks import EngineObject, Error


def _ptr(a, kind="float *"):
    return ffi.cast(kind, ffi.from_buffer(a))


class Tape(EngineObject):
    """One engine tape for B sequences of T tokens, under the memory budget
    max_tape_bytes (None: memplan.default_budget(model)). It runs on the model's
    device (the engine moves host inputs and outputs: arrays in, gradients out)."""

    def __init__(self, model, B: int, T: int, max_tape_bytes: int | None = None, first_layer: int = 0):
        self.model = model
        self.B, self.T = B, T
        self.B_cap, self.T_cap = B, T  # the shape its buffers hold (reshape within it)
        budget = memplan.check_budget(max_tape_bytes, model)
        out = ffi.new("dcs_tape **")
        with model.runner.engine_lock():  # one engine call at a time per model
            _check(lib.dcs_tape_new_from(model.runner.handle, B, T, first_layer, budget, out), model.runner.errmsg())
        self.first = first_layer  # > 0: forward(resid=...) starts at this layer
        # the engine frees a model after its last tape (dcs_free), so a cached
        # tape and its model may go in either order in one garbage collection
        self._tp = ffi.gc(out[0], lib.dcs_tape_free)
        self._keep: tuple[Any, Any] | None = None
        # what the memory plan counts for it (dcs_tape_plan of its own plan)
        self.plan_bytes = memplan.tape_bytes(model, B, T, self.memory_recompute, (), first_layer)

    def free(self) -> None:
        """Give its memory back now (not at garbage collection); unusable after."""
        if self._tp is not None:
            with self.model.runner.engine_lock():
                ffi.release(self._tp)
            self._tp = None
            self._keep = None

    def reshape(self, B: int, T: int) -> None:
        """Run the next passes on B x T, within the shape the tape was made
        for (length-bucketed batches, a cached tape: the buffers are reused);
        the forward has to run again before loss and backward."""
        with self.model.runner.engine_lock():
            _check(lib.dcs_tape_reshape(self._tp, int(B), int(T)), self.model.runner.errmsg())
        self.B, self.T = int(B), int(T)

    @property
    def memory_recompute(self) -> bool:
        """Does it recompute layers (its plan)?"""
        return bool(self.memory()["recompute"])

    def memory(self) -> dict[str, int]:
        """'tape' bytes of its buffers, 'pass_peak' the largest transient of its
        passes so far, 'recompute' 1 when it recomputes layers."""
        tb, pk, rc = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("int *")
        lib.dcs_tape_memory(self._tp, tb, pk, rc)
        return {"tape": int(tb[0]), "pass_peak": int(pk[0]), "recompute": int(rc[0])}

    def _shape(self, point: int) -> tuple[int, ...]:
        shape = ffi.new("int64_t[6]")
        nd = lib.dcs_hook_shape(self.model.runner.handle, point, self.B, self.T, shape)
        return tuple(int(shape[i]) for i in range(nd))

    def forward(
        self,
        tokens: np.ndarray,
        overrides: dict[tuple[int, int], np.ndarray] | None = None,
        logits: bool = True,
        resid: np.ndarray | None = None,
        reads: Sequence[tuple[int, int]] = (),
    ) -> Any:
        """The tape's forward; from layer `first` (> 0) it starts from resid
        [B, T, D], the residual stream entering that layer. With ``reads``
        ((point, layer) pairs; a tape from layer 0 only) it returns
        (logits, {(point, layer): activation}): the activations as this pass
        computes them, in the hook's batched layout."""
        self.model.runner.refuse_hooks("the gradient tape's forward")
        toks = np.ascontiguousarray(tokens, dtype=np.int32).reshape(self.B, self.T)
        if self.first:
            D = self.model.config.d_model
            if resid is None:
                raise Error("tape from layer %d: resid [B, T, D] is required" % self.first)
            resid = np.ascontiguousarray(resid, dtype=np.float32)
            if resid.shape != (self.B, self.T, D):
                raise Error("tape: resid has shape %s, expected %s" % (resid.shape, (self.B, self.T, D)))
        ov = overrides or {}
        keep = []
        arr = ffi.new("dcs_hook_override[]", max(1, len(ov)))
        for i, ((p, l), data) in enumerate(ov.items()):
            d = np.ascontiguousarray(data, dtype=np.float32)
            if d.shape != self._shape(p):
                raise Error(
                    "override at %s: shape %s, expected %s"
                    % (self.model.runner.hook_table.name[(p, l)], d.shape, self._shape(p))
                )
            keep.append(d)
            arr[i].point, arr[i].layer, arr[i].data = p, l, _ptr(d, "const float *")
        self._keep = (keep, arr)  # the engine reads them again in the backward
        out = np.empty((self.B, self.T, self.model.config.vocab), np.float32) if logits else None
        got = {pl: np.empty(self._shape(pl[0]), np.float32) for pl in reads}
        rd = ffi.new("dcs_hook_read[]", max(1, len(got)))
        for i, ((p, l), a) in enumerate(got.items()):
            rd[i].point, rd[i].layer, rd[i].data = p, l, _ptr(a)
        with self.model.runner.engine_lock():
            lg = _ptr(out) if out is not None else ffi.NULL
            if got:
                if self.first:
                    raise Error("tape from layer %d: reads need a tape from layer 0" % self.first)
                st = lib.dcs_tape_forward_read(self._tp, _ptr(toks, "const int32_t *"), arr, len(ov), rd, len(got), lg)
            elif self.first:
                st = lib.dcs_tape_forward_from(
                    self._tp, _ptr(toks, "const int32_t *"), _ptr(resid, "const float *"), arr, len(ov), lg
                )
            else:
                st = lib.dcs_tape_forward(self._tp, _ptr(toks, "const int32_t *"), arr, len(ov), lg)
            _check(st, self.model.runner.errmsg())
        return (out, got) if reads else out

    def loss(self, targets: np.ndarray) -> float:
        """Mean cross-entropy over targets >= 0 (its gradient goes to the backward)."""
        t = np.ascontiguousarray(targets, dtype=np.int32).reshape(self.B, self.T)
        loss, cnt = ffi.new("double *"), ffi.new("int *")
        with self.model.runner.engine_lock():
            _check(lib.dcs_tape_loss(self._tp, _ptr(t, "const int32_t *"), loss, cnt), self.model.runner.errmsg())
        return float(loss[0])

    def backward(
        self,
        dlogits: np.ndarray | None = None,
        param_grads: np.ndarray | None = None,
        wrt: Sequence[tuple[int, int]] = (),
        params: dict[int, np.ndarray] | None = None,
    ) -> dict[tuple[int, int], np.ndarray]:
        """Gradients at the hooks in wrt; parameter gradients accumulated into
        param_grads (flat, every parameter) or into params (parameter index ->
        float32 buffer of its size: only those)."""
        outs, arr = self._grad_requests(wrt)
        dlogits, dl = _dlogits(dlogits)
        pg = ffi.NULL
        if param_grads is not None:
            assert param_grads.dtype == np.float32 and param_grads.flags.c_contiguous
            pg = _ptr(param_grads)
        with self.model.runner.engine_lock():
            if params:
                pa = ffi.new("dcs_param_grad[]", len(params))
                for i, (idx, buf) in enumerate(params.items()):
                    assert buf.dtype == np.float32 and buf.flags.c_contiguous
                    pa[i].index, pa[i].grad = idx, _ptr(buf)
                st = lib.dcs_tape_backward_params(self._tp, dl, pa, len(params), arr, len(outs))
            else:
                st = lib.dcs_tape_backward(self._tp, dl, pg, arr, len(outs))
            _check(st, self.model.runner.errmsg())
        return outs

    def _grad_requests(self, wrt: Sequence[tuple[int, int]]):
        """A float32 buffer per (point, layer) in wrt, and the dcs_hook_grad
        array that points the engine at them."""
        outs = {pl: np.empty(self._shape(pl[0]), np.float32) for pl in wrt}
        arr = ffi.new("dcs_hook_grad[]", max(1, len(outs)))
        for i, ((p, l), g) in enumerate(outs.items()):
            arr[i].point, arr[i].layer, arr[i].grad = p, l, _ptr(g)
        return outs, arr

    def backward_stage(
        self, dlogits: np.ndarray | None, stop: int, wrt: Sequence[tuple[int, int]] = ()
    ) -> dict[tuple[int, int], np.ndarray]:
        """One stage of a backward run in stages (dcs_tape_backward_stage):
        with dlogits, from the logits; with None, on below the last stage;
        down to layer ``stop``. Gradients at the hooks in wrt (each of a
        layer the stage runs), the same bits as one backward gives."""
        outs, arr = self._grad_requests(wrt)
        resume = dlogits is None
        dlogits, dl = _dlogits(dlogits)
        with self.model.runner.engine_lock():
            st = lib.dcs_tape_backward_stage(self._tp, dl, int(resume), int(stop), arr, len(outs))
            _check(st, self.model.runner.errmsg())
        return outs


def _dlogits(dlogits: np.ndarray | None):
    """(the float32 C-order array, its pointer), or (None, NULL): keep the
    array alive while the engine reads the pointer."""
    if dlogits is None:
        return None, ffi.NULL
    a = np.ascontiguousarray(dlogits, dtype=np.float32)
    return a, _ptr(a, "const float *")


class TapeCache:
    """The idle tapes of one model (see the module docstring)."""

    MAX_IDLE = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _idle only; never held across an engine call
        self._idle: list[Tape] = []  # least recently used first

    def held_bytes(self) -> int:
        """What the idle tapes count in the memory plan (dcs_tape_plan)."""
        with self._lock:
            return sum(t.plan_bytes for t in self._idle)

    def take(self, model, B: int, T: int, budget: int, first: int = 0, extra: int = 0) -> Tape:
        """A tape for B x T from layer `first` under `budget`: an idle one
        that holds the shape, takes the plan a new one would (no
        recomputation where a new tape keeps every layer) and fits the
        budget; else a new one, once the idle tapes left fit beside it and
        `extra` bytes the caller holds besides (IG: memplan.ig_extra)."""
        full = memplan.tape_bytes(model, B, T, False, (), first)
        recompute = full > budget  # the plan dcs_tape_new_from takes
        need = memplan.tape_bytes(model, B, T, True, (), first) if recompute else full
        drop: list[Tape] = []
        with self._lock:
            fits = [
                t
                for t in self._idle
                if t.first == first
                and t.B_cap >= B
                and t.T_cap >= T
                and t.plan_bytes <= budget
                and (recompute or not t.memory_recompute)
            ]
            pick = min(fits, key=lambda t: t.plan_bytes) if fits else None
            if pick is not None:
                self._idle.remove(pick)
            else:
                while self._idle and sum(t.plan_bytes for t in self._idle) + need + extra > budget:
                    drop.append(self._idle.pop(max(range(len(self._idle)), key=lambda i: self._idle[i].plan_bytes)))
        for t in drop:  # outside the cache's lock: freeing takes the model's
            t.free()
        if pick is None:
            return Tape(model, B, T, budget, first)
        if (pick.B, pick.T) != (B, T):
            pick.reshape(B, T)
        return pick

    def give(self, tape: Tape) -> None:
        """A leased tape back, as the most recently used; idle tapes it
        covers (same layers and plan, no larger shape) go."""
        if tape._tp is None:
            return
        # idle: no backward without a new forward (the engine forgets the
        # last one), and the call's override arrays are not kept alive
        tape.reshape(tape.B, tape.T)
        tape._keep = None
        rc = tape.memory_recompute
        with self._lock:
            drop = [
                t
                for t in self._idle
                if t.first == tape.first
                and t.B_cap <= tape.B_cap
                and t.T_cap <= tape.T_cap
                and t.memory_recompute == rc
            ]
            self._idle = [t for t in self._idle if t not in drop] + [tape]
            over = self._idle[: max(0, len(self._idle) - self.MAX_IDLE)]
            del self._idle[: len(over)]
            drop += over
        for t in drop:
            t.free()

    def clear(self) -> None:
        """Free every idle tape (Model.free_caches)."""
        with self._lock:
            drop, self._idle = self._idle, []
        for t in drop:
            t.free()

    def forget(self, free: bool) -> None:
        """In a forked child (Runner.reset_after_fork): free the idle tapes
        (free: a CPU model with no call running at the fork), else leave
        their memory alone (a CUDA model's belongs to the parent's context;
        a call that was running may have been using the model's pool)."""
        drop, self._idle = self._idle, []
        for t in drop:
            if free:
                t.free()
            elif t._tp is not None:
                ffi.gc(t._tp, None)  # never freed in this process
                t._tp = None


@contextlib.contextmanager
def lease(model, B: int, T: int, budget: int, first: int = 0, extra: int = 0) -> Iterator[Tape]:
    """A tape from the model's cache for one call (TapeCache.take), given
    back after it (freed instead when the call raised)."""
    cache: TapeCache = model.runner.tapes
    tape = cache.take(model, B, T, budget, first, extra)
    try:
        yield tape
    except BaseException:
        tape.free()
        raise
    cache.give(tape)
