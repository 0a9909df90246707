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

import numbers
import os
from typing import Optional

import numpy as np


class Error(Exception):
    """Every failure of dclens: the message names the file, hook or argument."""


def check_index(what: str, value, lo: int, hi: int, hint: str = "") -> int:
    """value as an int in [lo, hi), or Error naming `what`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise Error("%s must be an integer, not %s %r" % (what, type(value).__name__, value))
    v = int(value)
    if not lo <= v < hi:
        raise Error("%s %d is out of range [%d, %d)%s" % (what, v, lo, hi, hint))
    return v


def check_str(what: str, value) -> str:
    """value as a str without NUL characters, or Error naming `what`."""
    if not isinstance(value, str):
        raise Error("%s must be a string, not %s %r" % (what, type(value).__name__, value))
    if "\0" in value:
        raise Error("%s %r contains a NUL character" % (what, value))
    return value


def c_str(what: str, value) -> bytes:
    """check_str, encoded for the C engine (UTF-8; names are ASCII)."""
    return check_str(what, value).encode("utf-8", errors="surrogateescape")


def c_path(what: str, value) -> bytes:
    """A path argument (str, bytes, os.PathLike) as file-system bytes for C."""
    try:
        p = os.fspath(value)
    except TypeError:
        raise Error(
            "%s must be a path (str, bytes or os.PathLike), not %s %r" % (what, type(value).__name__, value)
        ) from None
    try:
        b = os.fsencode(p)
    except UnicodeError as e:
        raise Error("%s %r cannot be encoded for the file system: %s" % (what, p, e)) from None
    if b"\0" in b:
        raise Error("%s %r contains a NUL character" % (what, p))
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
    """np.asarray(tokens), with ragged or mixed lists refused as an Error."""
    try:
        a = np.asarray(tokens)
    except (ValueError, TypeError, OverflowError) as e:
        raise Error(
            "tokens must be a [T] or [B, T] array of integers (a ragged list of "
            "sequences must be padded to one length): %s" % e
        ) from None
    if a.dtype == object:
        raise Error(
            "tokens must be a [T] or [B, T] array of integers, got a ragged or mixed list (pad sequences to one length)"
        )
    return a


def check_bytes_budget(what: str, nbytes: int, limit: Optional[int]) -> None:
    """Refuse before allocating when nbytes is more than limit."""
    if limit is not None and nbytes > limit:
        raise Error(
            "%s needs %.1f GiB, more than this machine's %.1f GiB of memory" % (what, nbytes / 2**30, limit / 2**30)
        )


def check_status(status: int, msg: str) -> None:
    """Error(msg) (or the status' name when msg is empty) unless the engine
    call that returned `status` succeeded."""
    from ._engine import ffi, lib

    if status != lib.DCS_OK:
        raise Error(msg or ffi.string(lib.dcs_status_name(status)).decode())
