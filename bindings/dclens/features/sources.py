"""Token sources for dictionary training: sequences of token ids, read in order from any
position (the data position a checkpoint records), never all held in memory.

A source is an object with ``context_size`` and ``batch(start, n) -> [m, T] int32`` (m <= n,
0 rows at its end). Three kinds: :class:`TokenArrays` (an array or a function of the index, e.g.
a synthetic-task generator), :class:`TextFile` and :class:`JsonlFile` (text through the model's
tokenizer, cut into sequences of context_size tokens).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Callable

import numpy as np

from .._core.checks import Error, token_array


class TokenArrays:
    """Sequences given as an array [S, T], or as a function i -> [T] ids of sequence i.

    Parameters
    ----------
    tokens : array_like or callable
        [S, T] token ids, or fn(i) returning sequence i's [T] ids (a generator of synthetic
        prompts, seeded by i: nothing is kept).
    n : int or None
        With a function: how many sequences there are (None: unbounded).
    context_size : int or None
        With a function: T (None: the length of sequence 0).

    Raises
    ------
    dclens.Error
        Tokens that are not a [S, T] id array, or sequences of another length.
    """

    def __init__(self, tokens, n: int | None = None, context_size: int | None = None):
        self._fn: Callable[[int], np.ndarray] | None = None
        self._arr: np.ndarray | None = None
        if callable(tokens):
            self._fn, self.n = tokens, n
            self.context_size = int(context_size) if context_size else len(self._seq(0))
        else:
            a = token_array(tokens)
            if a.ndim != 2:
                raise Error(
                    "tokens must be [S, T] token ids (or a function of the index), not shape %s" % list(a.shape)
                )
            self._arr, self.n, self.context_size = a, a.shape[0], a.shape[1]

    def _seq(self, i: int) -> np.ndarray:
        assert self._fn is not None
        s = np.asarray(self._fn(i))
        if s.ndim != 1 or s.dtype.kind not in "iu":
            raise Error(
                "the token function gave sequence %d of shape %s / dtype %s, not [T] ids" % (i, list(s.shape), s.dtype)
            )
        return s

    def batch(self, start: int, n: int) -> np.ndarray:
        """Sequences start .. start+n-1 (fewer at the end).

        Parameters
        ----------
        start, n : int
            The first sequence and how many.

        Returns
        -------
        numpy.ndarray
            [m, T] int32 ids, m <= n (0 rows past the end).

        Raises
        ------
        dclens.Error
            The token function gives a sequence that is not [context_size] ids.
        """
        stop = start + n if self.n is None else min(start + n, self.n)
        if stop <= start:
            return np.zeros((0, self.context_size), np.int32)
        if self._arr is not None:
            return self._arr[start:stop]
        rows = [self._seq(i) for i in range(start, stop)]
        for i, r in zip(range(start, stop), rows):
            if len(r) != self.context_size:
                raise Error("sequence %d has %d tokens, not context_size %d" % (i, len(r), self.context_size))
        return np.stack(rows).astype(np.int32)


class _TextSource:
    """Text documents through the model's to_tokens (its BOS first in each when prepend_bos),
    concatenated and cut into sequences of context_size tokens; documents are read one at a
    time from the file."""

    def __init__(self, path, model, context_size: int, prepend_bos: bool = True):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise Error("dataset %s is not a file" % self.path)
        if context_size < 2:
            raise Error("context_size must be >= 2, not %r" % context_size)
        self.model, self.context_size, self.prepend_bos = model, int(context_size), prepend_bos
        self.n = None
        self._it: Iterator[int] | None = None  # the token stream where the last batch stopped, and its position
        self._at = -1

    def documents(self):
        """The documents of the file, one at a time (TextFile, JsonlFile)."""
        return iter(())

    def _tokens(self):
        for doc in self.documents():
            yield from (int(t) for t in self.model.to_tokens(doc, prepend_bos=self.prepend_bos))

    def batch(self, start: int, n: int) -> np.ndarray:
        """Sequences start .. start+n-1 of the file (fewer at its end).

        Parameters
        ----------
        start, n : int
            As for TokenArrays.batch.

        Returns
        -------
        numpy.ndarray
            [m, context_size] int32 ids, as TokenArrays.batch gives them.
        """
        T = self.context_size
        first = start * T
        it = self._it
        if it is None or self._at != first:  # not where the last batch stopped: read from the top
            it, self._at = self._tokens(), 0
            for _ in range(first):
                if next(it, None) is None:
                    break
                self._at += 1
        self._it = it
        out: list[int] = []
        for t in it:
            out.append(t)
            if len(out) == n * T:
                break
        self._at += len(out)
        m = len(out) // T
        return np.asarray(out[: m * T], np.int32).reshape(m, T)


class TextFile(_TextSource):
    """A text file, one document per line (empty lines skipped).

    Parameters
    ----------
    path : str or os.PathLike
        The file.
    model : dclens.Model
        Whose tokenizer reads it.
    context_size : int
        Tokens per sequence.
    prepend_bos : bool
        Put BOS before each document.

    Raises
    ------
    dclens.Error
        A path that is no file, or context_size < 2.
    """

    def __init__(self, path, model, context_size: int, prepend_bos: bool = True):
        super().__init__(path, model, context_size, prepend_bos)

    def documents(self):
        """The lines of the file, one at a time.

        Yields
        ------
        str
            A non-empty line, without its newline.
        """
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if line:
                    yield line


class JsonlFile(_TextSource):
    """A JSONL file: one JSON object per line, its text under `key`.

    Parameters
    ----------
    path : str or os.PathLike
        The JSONL file.
    model, context_size
        As for TextFile.
    key : str
        The field holding the text.
    prepend_bos : bool
        Put BOS before each document.

    Raises
    ------
    dclens.Error
        A path that is no file, context_size < 2; when read, a line that is not an object
        with a string under `key` (naming the line).
    """

    def __init__(self, path, model, context_size: int, key: str = "text", prepend_bos: bool = True):
        super().__init__(path, model, context_size, prepend_bos)
        self.key = key

    def documents(self):
        """The texts of the file's lines, one at a time.

        Yields
        ------
        str
            The text under `key` of a line.

        Raises
        ------
        dclens.Error
            A line that is not JSON or has no string under `key` (naming the line).
        """
        with open(self.path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise Error("%s line %d is not JSON: %s" % (self.path, i, e)) from None
                if not isinstance(obj, dict) or not isinstance(obj.get(self.key), str):
                    raise Error("%s line %d has no string under key %r" % (self.path, i, self.key))
                yield obj[self.key]
