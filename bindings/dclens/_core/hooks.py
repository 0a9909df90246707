"""Hooks: what runs when the engine calls back at a hook point.

    @dclens.read_only                      # only reads: no write-back
    def look(act, name):
        seen[name] = act.mean()

    model.run_with_hooks(toks, [("blocks.0.attn.pattern", look)])
    model.run_with_hooks(toks, [(n, fn) for n in names], read_only=True)
    with model.hooks([...], read_only=True): ...

A hook function fn(act, name) may change `act` in place or return a
replacement; either way a hook that is called counts as a write: what it
leaves in `act` is copied back into the engine, which then uses it from
that point on. A read-only hook (dclens.read_only(fn), or read_only=True
where hooks are given) gets a read-only array, and nothing is copied back.
run_with_cache's own capture is read-only.

The engine hands each hook point a pointer into its own (pooled, reused)
activation memory (runner.py's trampoline turns it into a view). No
Python-visible array may outlive that memory, so a hook function gets an
array that owns a copy; the engine memory is only seen through short-lived
views inside runner._engine_view / hook_call, whose frames are cleared if
an exception keeps a traceback. Capture copies
exactly once; a read-only hook adds nothing to that copy; a writing hook
adds a check that it wrote finite values and the copy back.

HookTable: every hook of a model as name <-> (point, layer), built once
when the model is loaded from the engine's points (Runner), so a hook call
looks its name up instead of asking the engine.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import numpy as np

from .checks import Error, check_bool
from .names import tl_alias

HookFn = Callable[[np.ndarray, "HookPoint"], Optional[np.ndarray]]


# ---------------------------------------------------------------- hook points


class HookPoint(str):
    """What a hook function gets as its second argument: the hook's name, a
    str (so fn(act, name) code keeps working), with TransformerLens's
    HookPoint habits: .name (the dclens name), .tl_name (TransformerLens
    spelling, or None) and .layer() (None for embed, ln_final, logits).

    >>> def fn(act, hook):
    ...     print(hook.name, hook.layer())"""

    __slots__ = ()

    @property
    def name(self) -> str:
        """The hook's dclens name, a plain str ("blocks.3.attn.pattern")."""
        return str.__str__(self)

    @property
    def tl_name(self) -> str | None:
        """The hook's TransformerLens name ("blocks.3.attn.hook_pattern"), or None where it has
        none (compose branches, dynamic weights, ...)."""
        return tl_alias(self.name)

    def layer(self) -> int | None:
        """The hook's layer.

        Returns
        -------
        int or None
            l of "blocks.{l}....", None for the hooks outside the blocks (embed, ln_final,
            logits).
        """
        parts = self.split(".")
        return int(parts[1]) if parts[0] == "blocks" and len(parts) > 2 else None

    def __repr__(self) -> str:
        return "HookPoint(%s)" % str.__repr__(self)


# ---------------------------------------------------------------- read-only hooks


class ReadOnlyHook:
    """A hook function declared read-only (see read_only)."""

    read_only = True

    def __init__(self, fn: HookFn):
        if not callable(fn):
            raise Error("read_only: %r is not callable" % (fn,))
        self.fn = fn
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, act: np.ndarray, name: HookPoint):
        return self.fn(act, name)

    def __repr__(self) -> str:
        return "read_only(%r)" % (self.fn,)


def read_only(fn: HookFn) -> ReadOnlyHook:
    """Declare a hook function read-only (a decorator, or a call around a
    lambda): it gets a read-only array (writing raises numpy's ValueError),
    must return None, and the pass skips the copy back into the engine.

    >>> @dclens.read_only
    ... def record(act, name):
    ...     means[name] = act.mean()
    >>> model.run_with_hooks(toks, [("blocks.0.mlp.out", record)])
    >>> model.run_with_hooks(toks, [("blocks.0.mlp.out", dclens.read_only(lambda a, n: keep.append(a)))])

    Parameters
    ----------
    fn : callable
        The hook function, fn(act, name).

    Returns
    -------
    ReadOnlyHook
        fn wrapped (fn itself when it is already read-only); calling it calls fn.

    Raises
    ------
    dclens.Error
        fn is not callable.
    """
    return fn if isinstance(fn, ReadOnlyHook) else ReadOnlyHook(fn)


def is_read_only(fn) -> bool:
    return isinstance(fn, ReadOnlyHook)


class Hooks(list[tuple[Any, HookFn]]):
    """A list of (name, fn) hook pairs: what every ``dclens.interventions``
    helper returns, and what every place that takes hooks accepts
    (``run_with_hooks``, ``run_with_cache``, ``with model.hooks(...)``,
    ``add_hook``, ``generate`` and ``Decoder.step``).

    >>> model.run_with_hooks(toks, fwd_hooks=iv.ablate_head(model, 1, 2))
    >>> model.run_with_hooks(toks, fwd_hooks=[*iv.disable_branch(model, "post", "kp"), *iv.ablate_head(model, 1, 2)])
    >>> model.run_with_hooks(toks, fwd_hooks=[iv.ablate_head(model, 1, 2)])   # nested: flattened

    A ``Hooks`` given as one element of a hooks list stands for its pairs
    (the list is flattened), so code written when some helpers returned one
    pair and others a list keeps working. Adding a ``Hooks`` to a list gives
    a ``Hooks``; its repr lists every hook point with what the hook does.

    Parameters
    ----------
    pairs : iterable of (name, fn) or Hooks, optional
        The hooks; a ``Hooks`` among them is flattened into its pairs.

    Raises
    ------
    dclens.Error
        An element that is neither a (name, fn) pair with a callable fn nor
        a ``Hooks``.
    """

    def __init__(self, pairs=()):
        super().__init__(flatten_hooks(pairs, "Hooks"))

    def __add__(self, other):
        return Hooks(list(self) + list(other))

    def __radd__(self, other):
        return Hooks(list(other) + list(self))

    def __getitem__(self, i):
        got = super().__getitem__(i)
        return Hooks(got) if isinstance(i, slice) else got

    def __repr__(self) -> str:
        if not self:
            return "Hooks([])"
        shown = [(n if isinstance(n, str) else repr(n), _describe(fn)) for n, fn in list(self)[:12]]
        w = max(len(n) for n, _ in shown)
        lines = ["  %-*s  %s" % (w, n, d) for n, d in shown]
        if len(self) > 12:
            lines.append("  ... %d more" % (len(self) - 12))
        return "Hooks(%d hook%s:\n%s)" % (len(self), "" if len(self) == 1 else "s", "\n".join(lines))


def _describe(fn) -> str:
    """What a hook function does, for Hooks' repr: its name (the interventions
    helpers name theirs after the call that made them)."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return name + (" [read-only]" if is_read_only(fn) else "")


def flatten_hooks(fwd_hooks, what: str = "fwd_hooks") -> list:
    """The (name, fn) pairs of a hooks list, each ``Hooks`` element replaced
    by its pairs (not checked further here: hook_pairs does).

    Parameters
    ----------
    fwd_hooks : list or tuple of (name, fn) pairs and Hooks
    what : str
        The argument's name, for errors.

    Returns
    -------
    list
        The pairs, in order.

    Raises
    ------
    dclens.Error
        ``fwd_hooks`` is one (name, fn) pair rather than a list of them, or
        not a list or tuple (or Hooks, or other iterable for ``Hooks(...)``).
    """
    if isinstance(fwd_hooks, tuple) and len(fwd_hooks) == 2 and isinstance(fwd_hooks[0], str):
        raise Error("%s must be a list of (name, fn) pairs, got one pair %r: put it in a list" % (what, fwd_hooks))
    if isinstance(fwd_hooks, (str, bytes, dict)) or not (
        isinstance(fwd_hooks, (list, tuple)) or (what == "Hooks" and hasattr(fwd_hooks, "__iter__"))
    ):
        raise Error("%s must be a list of (name, fn) pairs, not %s %r" % (what, type(fwd_hooks).__name__, fwd_hooks))
    out: list = []
    for item in fwd_hooks:
        if isinstance(item, Hooks):
            out += flatten_hooks(item, what)  # (a Hooks appended into a Hooks too)
        elif isinstance(item, tuple) and len(item) == 2 and callable(item[1]):
            out.append(item)
        elif isinstance(item, tuple) and len(item) == 2:
            raise Error("hook %s: %r is not callable" % (item[0], item[1]))
        else:
            raise Error("%s must be a list of (name, fn) pairs (or Hooks), got %r" % (what, item))
    return out


def hook_pairs(fwd_hooks, read_only_all: bool = False) -> list[tuple[str, HookFn]]:
    """fwd_hooks as a list of (name, fn) pairs, fn checked callable and, with
    read_only_all, declared read-only (names are resolved by the caller).

    Parameters
    ----------
    fwd_hooks : list or tuple of (name, fn) pairs, Hooks among them allowed
        A ``Hooks`` (what the interventions helpers return) is a list of
        pairs itself; one given as an element is flattened into its pairs.
    read_only_all : bool
        Declare every fn read-only (dclens.read_only).

    Returns
    -------
    list of (name, fn)

    Raises
    ------
    dclens.Error
        Not a list of pairs (flatten_hooks), or an fn that is not callable.
    """
    read_only_all = check_bool("read_only", read_only_all)
    return [(n, read_only(fn) if read_only_all else fn) for n, fn in flatten_hooks(fwd_hooks)]


# ---------------------------------------------------------------- name table


class HookTable:
    """Every hook of a model, name <-> (point, layer), in forward order.

    points: the model's hook points as (point, name, per layer?), in the engine's
    order (Runner.hook_points)."""

    def __init__(self, points: list[tuple[int, str, bool]], n_layer: int):
        suffix = {p: name for p, name, _ in points}
        layered = [p for p, _, per_layer in points if per_layer]
        glob = [p for p, _, per_layer in points if not per_layer]
        keys = [(p, 0) for p in glob if p < layered[0]]
        keys += [(p, l) for l in range(n_layer) for p in layered]
        keys += [(p, 0) for p in glob if p > layered[0]]
        self.names: list[str] = [suffix[p] if p in glob else "blocks.%d.%s" % (l, suffix[p]) for p, l in keys]
        self.key: dict[str, tuple[int, int]] = dict(zip(self.names, keys))
        self.name: dict[tuple[int, int], str] = dict(zip(keys, self.names))
        # what hook functions get: the same names as HookPoint objects
        self.point: dict[tuple[int, int], HookPoint] = {k: HookPoint(n) for k, n in self.name.items()}


# ---------------------------------------------------------------- one pass


class _Run:
    """State of one forward pass with hooks: what to call where, the cache."""

    def __init__(self, table: HookTable, batched: bool, cache: Any):
        self.batched = batched
        self.names = table.name
        self.points = table.point
        self.capture: dict[tuple[int, int], str] = {}
        self.fns: dict[tuple[int, int], list[HookFn]] = {}
        self.writes: set = set()  # points where a hook that may write is called
        self.cache = cache  # a dclens.Cache (Runner.new_run: the Model layer's class)
        self.error: BaseException | None = None
        self.cancel = False  # set on Ctrl-C: the next hook call aborts the pass

    def add(self, key: tuple[int, int], fn: HookFn) -> None:
        self.fns.setdefault(key, []).append(fn)
        if not is_read_only(fn):
            self.writes.add(key)


def _validate(out, shape, name: str) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        try:
            out = np.asarray(out)
        except Exception as e:
            raise Error("hook %s: the hook function returned %s, not an array" % (name, type(out).__name__)) from e
    if out.dtype.kind != "f":
        raise Error("hook %s: the hook function returned dtype %s; a floating array is needed" % (name, out.dtype))
    if out.shape != tuple(shape):
        raise Error("hook %s: the hook function returned shape %s, expected %s" % (name, out.shape, tuple(shape)))
    if not np.all(np.isfinite(out)):
        raise Error("hook %s: the hook function returned NaN or inf values" % name)
    return out


def hook_call(run: _Run, key: tuple[int, int], view: Callable[[], np.ndarray]) -> int:
    """Run the hooks of `run` at key = (point, layer) on the activation that
    view() shows (a view of engine memory, runner.py); 1 if the activation was
    written back, 0 if not."""
    name = run.names[key]
    work = view().copy()  # owned by Python: the one copy
    fns = run.fns.get(key, ())
    if key in run.capture and key not in run.writes:
        run.cache[name] = work  # read-only hooks see it read-only
    if not fns:
        return 0
    seen = work.view()
    seen.flags.writeable = False
    hp = run.points[key]
    for fn in fns:
        if is_read_only(fn):
            if fn(seen, hp) is not None:
                raise Error(
                    "hook %s: %r is read-only but returned an array (a hook that changes the "
                    "activation must not be declared read-only)" % (name, getattr(fn, "fn", fn))
                )
        else:
            out = fn(work, hp)
            if out is not None and out is not work:
                work[...] = _validate(out, work.shape, name)
        if run.cancel:
            raise KeyboardInterrupt()
    if key not in run.writes:
        return 0
    src = view()
    if not np.isfinite(work).all():
        # the pass itself may have made inf (huge weights): only what the hooks wrote is refused
        bad = ~np.isfinite(work)
        if not np.array_equal(work[bad], src[bad], equal_nan=True):
            del src
            raise Error("hook %s: the hook function wrote NaN or inf values" % name)
    src[...] = work
    del src
    if key in run.capture:
        run.cache[name] = work.copy()  # the hook may keep `work`
    return 1


_OWN_FRAMES: set = set()


def own_frame(fn: Callable) -> Callable:
    """Mark fn's frames as ones that may hold views of engine memory: forget_engine_views clears them."""
    _OWN_FRAMES.add(fn.__code__)
    return fn


def forget_engine_views(e: BaseException) -> None:
    """Clear the locals of the hook frames (own_frame) kept by e's traceback
    (they may hold views of engine memory); user frames are left alone."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in _OWN_FRAMES:
            with contextlib.suppress(RuntimeError):  # still executing
                tb.tb_frame.clear()
        tb = tb.tb_next


own_frame(hook_call)
