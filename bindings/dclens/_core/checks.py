"""Argument checks shared by every public function: one place that decides
what a layer, head, position, count, name or path may be, so that a float
layer, a bool, a NUL inside a name or a non-UTF-8 path is refused the same
way everywhere with a dclens.Error naming the argument.

Integers: Python ints and numpy integers only (bool, float, numpy floats,
strings are refused even when integral: ``layer=0.5`` and ``layer=1.0``
alike), in [lo, hi). Strings: str only, no NUL (C would cut the string
there). Paths: str, bytes or os.PathLike; encoded with the file-system
encoding (so non-UTF-8 names from os.listdir round-trip); no NUL.
"""

from __future__ import annotations

import difflib
import numbers
import os
import re
import traceback

import numpy as np


class Error(Exception):
    """Every failure of dclens: the message names the file, hook or argument.

    Where a failure means what a builtin exception means, it is raised as a
    subclass of both (so ``except FileNotFoundError`` / ``ValueError`` /
    ``KeyError`` / ``TypeError`` catch it as they would elsewhere):
    NotFoundError, ArgumentError, ArgumentTypeError, UnknownNameError.

    In IPython / Jupyter a dclens.Error shows the caller's frames and its
    one-line message, not the package's frames (_render_traceback_): a user
    error reads as one line under the cell that made it."""

    __module__ = "dclens"  # printed and pickled as its public name, dclens.Error

    def _render_traceback_(self) -> list:
        """What IPython shows for this exception: the frames outside dclens
        (and IPython), then 'ErrorClass: message'."""
        pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # dclens/
        frames = [
            f
            for f in traceback.extract_tb(self.__traceback__)
            if not os.path.abspath(f.filename).startswith(pkg) and "IPython" not in f.filename
        ]
        lines = traceback.format_list(frames) + ["%s: %s" % (type(self).__name__, self)]
        return [ln.rstrip("\n") for ln in "".join(lines).splitlines()]


class NotFoundError(Error, FileNotFoundError):
    """A file, directory or model that does not exist (a FileNotFoundError)."""

    __module__ = "dclens"  # printed and pickled as its public name, dclens.NotFoundError

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ArgumentError(Error, ValueError):
    """An argument of the right type with a value that is not allowed (a ValueError)."""

    __module__ = "dclens"  # printed and pickled as its public name, dclens.ArgumentError


class ArgumentTypeError(Error, TypeError):
    """An argument of the wrong type (a TypeError)."""

    __module__ = "dclens"  # printed and pickled as its public name, dclens.ArgumentTypeError


class UnknownNameError(Error, KeyError):
    """A hook, weight or cache name the model does not have (a KeyError).

    Parameters
    ----------
    message : str
        The whole message: the name, where it was asked for, the closest names.
    name : str
        The name asked for (kept as .name).
    suggestions : iterable of str
        The closest names the model has, best first (kept as the list .suggestions).
    """

    __module__ = "dclens"  # printed and pickled as its public name, dclens.UnknownNameError

    def __init__(self, message: str, name: str = "", suggestions=()):
        super().__init__(message)
        self.name = name
        self.suggestions = list(suggestions)

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


def did_you_mean(name: str, known, n: int = 3):
    """The names of `known` closest to `name` (difflib), best first."""
    if not isinstance(name, str):
        return []
    known = list(known)
    m = re.match(r"^((?:blocks|layers)\.\d+\.)", name)
    if m:  # a name of one layer: suggest names of that layer (and the unlayered ones)
        same = [k for k in known if k.startswith(m.group(1)) or not re.match(r"^(blocks|layers)\.\d+\.", k)]
        known = same if any(k.startswith(m.group(1)) for k in same) else known
    return difflib.get_close_matches(name, known, n=n, cutoff=0.6)


def unknown_name(kind: str, name, known, where: str, listing: str, message: str = "") -> UnknownNameError:
    """UnknownNameError for a `kind` ("hook", "weight") `name` not among
    `known`: what was asked (or `message`, e.g. the engine's), where, the
    closest names, and how to list them all."""
    close = did_you_mean(name, known)
    hint = "; did you mean %s?" % " or ".join(repr(c) for c in close) if close else ""
    head = message or "unknown %s %r%s" % (kind, name, where)
    return UnknownNameError("%s%s (%s lists every one)" % (head, hint, listing), name=name, suggestions=close)


class EngineObject:
    """Base of the classes that hold engine memory (a model, a decoder, a
    tape): pickling or copying one is refused with an Error saying what to do
    instead, not cffi's TypeError about a CData object."""

    _instead = "make a new one"

    def __reduce_ex__(self, protocol):
        raise Error(
            "a dclens.%s cannot be pickled or copied: it holds the engine's memory; %s"
            % (type(self).__name__, self._instead)
        )


def is_choice(value, choices) -> bool:
    """value is one of `choices` (strings, or None): a str or None compared
    with each, never a numpy array's elementwise == (whose truth is an error)."""
    return (value is None or isinstance(value, str)) and value in choices


def is_finite_number(v) -> bool:
    """v is a real number (not a bool), finite as a float64 (a Python int past
    float64's range is not)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Real, np.number)):
        return False
    try:
        return bool(np.isfinite(float(v)))
    except (OverflowError, TypeError, ValueError):
        return False


def check_bool(what: str, value) -> bool:
    """value as a bool (Python or numpy bool only), or Error naming `what`."""
    if not isinstance(value, (bool, np.bool_)):
        raise Error("%s must be True or False, not %s %r" % (what, type(value).__name__, value))
    return bool(value)


def check_int_list(what: str, value, lo: int, hi: int, wrap: bool = False) -> list:
    """A list / tuple / range / 1-D integer array of integers in [lo, hi) (with
    wrap, negative ones from the end, [-hi, hi)), or Error naming `what`."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and (value.dtype.kind in "iu" or value.size == 0):
        value = value.tolist()
    if not isinstance(value, (list, tuple, range)):
        raise Error("%s must be a list of integers, not %s %r" % (what, type(value).__name__, value))
    if wrap:
        return [check_index(what[:-1] if what.endswith("s") else what, v, -hi, hi) % hi for v in value]
    return [check_index(what[:-1] if what.endswith("s") else what, v, lo, hi) for v in value]


def check_layers(layers, n_layer: int, negative: bool = False) -> list:
    """`layers` (None: all; a list / tuple / range / 1-D integer array) as a list
    of layer indices in [0, n_layer) (with negative, [-n_layer, n_layer) from
    the end), or Error naming 'layers'."""
    if layers is None:
        return list(range(n_layer))
    if isinstance(layers, np.ndarray) and layers.ndim == 1 and (layers.dtype.kind in "iu" or layers.size == 0):
        layers = layers.tolist()
    if not isinstance(layers, (list, tuple, range)):
        raise Error("layers must be None or a list of layer indices, not %s %r" % (type(layers).__name__, layers))
    lo = -n_layer if negative else 0
    return [check_index("layer", l, lo, n_layer, " (model has %d layers)" % n_layer) % n_layer for l in layers]


def check_index(what: str, value, lo: int, hi: int, hint: str = "") -> int:
    """value as an int in [lo, hi), or Error naming `what`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise ArgumentTypeError("%s must be an integer, not %s %r" % (what, type(value).__name__, value))
    v = int(value)
    if not lo <= v < hi:
        raise ArgumentError("%s %d is out of range [%d, %d)%s" % (what, v, lo, hi, hint))
    return v


def check_str(what: str, value) -> str:
    """value as a str without NUL characters, or Error naming `what`."""
    if not isinstance(value, str):
        raise ArgumentTypeError("%s must be a string, not %s %r" % (what, type(value).__name__, value))
    if "\0" in value:
        raise ArgumentError("%s %r contains a NUL character" % (what, value))
    return value


def c_str(what: str, value) -> bytes:
    """check_str, encoded for the C engine (UTF-8; names are ASCII)."""
    return check_str(what, value).encode("utf-8", errors="surrogateescape")


def c_path(what: str, value) -> bytes:
    """A path argument (str, bytes, os.PathLike) as file-system bytes for C."""
    try:
        p = os.fspath(value)
    except TypeError:
        raise ArgumentTypeError(
            "%s must be a path (str, bytes or os.PathLike), not %s %r" % (what, type(value).__name__, value)
        ) from None
    try:
        b = os.fsencode(p)
    except UnicodeError as e:
        raise Error("%s %r cannot be encoded for the file system: %s" % (what, p, e)) from None
    if b"\0" in b:
        raise ArgumentError("%s %r contains a NUL character" % (what, p))
    return b


def show_path(value) -> str:
    """A path for messages and Model.path: str, decoded with the file-system
    encoding (non-UTF-8 bytes survive as surrogate escapes)."""
    p = os.fspath(value)
    return os.fsdecode(p) if isinstance(p, bytes) else p


def decode_msg(raw: bytes) -> str:
    """An engine message (it may quote a non-UTF-8 path) as text."""
    return raw.decode("utf-8", errors="replace")


def token_array(tokens) -> np.ndarray:
    """np.asarray(tokens), with ragged or mixed lists refused as an Error
    (and a padded (tokens, lengths) pair, where a call takes no padding)."""
    if isinstance(tokens, tuple) and len(tokens) == 2 and np.ndim(tokens[0]) == 2 and np.ndim(tokens[1]) == 1:
        raise ArgumentError(
            "tokens: a padded batch (tokens, lengths) is not taken here (its padding would be read as tokens); "
            "forward, run_with_cache and run_with_hooks take it, or give this call the prompts one at a time"
        )
    try:
        a = np.asarray(tokens)
    except (ValueError, TypeError, OverflowError) as e:
        raise ArgumentError(
            "tokens must be a [T] or [B, T] array of integers (a ragged list of "
            "sequences must be padded to one length): %s" % e
        ) from None
    if a.dtype == object:
        raise ArgumentError(
            "tokens must be a [T] or [B, T] array of integers, got a ragged or mixed list (pad sequences to one length)"
        )
    return a


def check_bytes_budget(what: str, nbytes: int, limit: int | None) -> None:
    """Refuse before allocating when nbytes is more than limit."""
    if limit is not None and nbytes > limit:
        raise Error(
            "%s needs %.1f GiB, more than this machine's %.1f GiB of memory" % (what, nbytes / 2**30, limit / 2**30)
        )


def metric_value(metric, logits) -> float:
    """metric(logits) as a float (patching's and graph's metrics), or an Error
    saying the metric returned something else than a number."""
    v = metric(logits)
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
    if not ok and isinstance(v, np.ndarray):
        ok = v.ndim == 0 and v.dtype.kind in "fiu"
    if not ok:
        shown = repr(v)
        raise Error(
            "metric must return a number (a float) for the logits, got %s %s"
            % (type(v).__name__, shown if len(shown) <= 80 else shown[:77] + "...")
        )
    return float(v)
