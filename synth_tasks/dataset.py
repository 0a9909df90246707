"""Loader for the published JSONL format of the synthetic benchmark.

A file holds one JSON object per line: ``{"task_id": "task0", "texts": "\\n<ex 1>\\n...\\n<ex 8>\\n"}``.
The examples of ``texts`` are separated by newlines; an answer to be scored is
marked with brackets, ``... a kind of [ vehicle ]``.  The model reads the text
with the brackets removed (``... a kind of vehicle``).  An answer in the k-th
example (counting from 0) has k solved examples before it: its shot count is k.

Bad input (not JSON, no ``task_id`` / ``texts``, unbalanced brackets, an empty
answer) raises :class:`DatasetError` naming the file and line, e.g.
``data.jsonl:17: unbalanced brackets in example 3``, unless ``skip_bad=True``:
then bad lines are left out, their errors collected in ``Dataset.errors``.
Blank lines are ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

DATA_NAME = "synthetic_dataset.jsonl"


def default_data_path() -> str | None:
    """The published file at <repo>/../shared/data/, if it is there."""
    repo = Path(__file__).resolve().parent.parent
    for base in (repo.parent, Path.cwd().parent):
        p = base / "shared" / "data" / DATA_NAME
        if p.is_file():
            return str(p)
    return None


class DatasetError(ValueError):
    """A malformed line of a benchmark file (the message names file and line)."""


@dataclass(frozen=True)
class Example:
    """One scored answer: ``text`` is the answer (without brackets), at
    ``line.text[start:end]``; ``k`` is its shot count (solved examples before it)
    and ``example`` the 1-based number of the example holding it."""

    text: str
    start: int
    end: int
    k: int
    example: int


Answer = Example


@dataclass
class Line:
    """One record: its task, the text with brackets removed, the scored answers."""

    task_id: str
    text: str
    answers: list[Example]
    lineno: int = 0  # 1-based line number in the file (0: not from a file)
    source: str = ""  # file name

    @property
    def where(self) -> str:
        return f"{self.source}:{self.lineno}"


@dataclass
class Dataset:
    lines: list[Line]
    path: str = ""
    errors: list[str] = field(default_factory=list)  # messages of skipped lines

    @property
    def skipped(self) -> int:
        return len(self.errors)

    @property
    def n_answers(self) -> int:
        return sum(len(l.answers) for l in self.lines)

    def __len__(self):
        return len(self.lines)

    def __iter__(self):
        return iter(self.lines)

    def __getitem__(self, i):
        return self.lines[i]


def parse_texts(texts: str) -> tuple[str, list[Example]]:
    """Remove the brackets of ``texts``; returns (text, answers).

    Raises ValueError (without file/line: the caller adds them) for unbalanced
    brackets or an empty answer.  Brackets are ``[`` ... ``]`` within one example;
    the answer is what they enclose with surrounding whitespace stripped, and the
    model reads it in place of the brackets: ``of [ vehicle ]`` -> ``of vehicle``.
    """
    out: list[str] = []
    answers: list[Example] = []
    pos = 0  # length of the output so far
    n_examples = 0  # non-blank examples seen so far
    for piece in texts.split("\n"):
        if out:
            out.append("\n")
            pos += 1
        if not piece.strip():
            out.append(piece)
            pos += len(piece)
            continue
        n_examples += 1
        k = n_examples - 1
        i = 0
        while i < len(piece):
            o = piece.find("[", i)
            c = piece.find("]", i)
            if o < 0 and c < 0:
                out.append(piece[i:])
                pos += len(piece) - i
                break
            if o < 0 or (0 <= c < o):
                raise ValueError(f"unbalanced brackets in example {n_examples}")
            c = piece.find("]", o + 1)
            o2 = piece.find("[", o + 1)
            if c < 0 or (0 <= o2 < c):
                raise ValueError(f"unbalanced brackets in example {n_examples}")
            inner = piece[o + 1 : c]
            ans = inner.strip()
            if not ans:
                raise ValueError(f"empty answer in example {n_examples}")
            before = piece[i:o]
            out.append(before)
            pos += len(before)
            answers.append(Example(ans, pos, pos + len(ans), k, n_examples))
            out.append(ans)
            pos += len(ans)
            i = c + 1
    return "".join(out), answers


def parse_record(obj, lineno: int = 0, source: str = "") -> Line:
    """A decoded JSON record -> Line (ValueError with a short message if bad)."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    for key in ("task_id", "texts"):
        if key not in obj:
            raise ValueError(f"missing '{key}'")
    task_id, texts = obj["task_id"], obj["texts"]
    if not isinstance(task_id, str):
        raise ValueError("'task_id' is not a string")
    if not task_id.strip():
        raise ValueError("empty 'task_id'")
    if not isinstance(texts, str):
        raise ValueError("'texts' is not a string")
    text, answers = parse_texts(texts)
    return Line(task_id=task_id, text=text, answers=answers, lineno=lineno, source=source)


MAX_LINE_BYTES = 16 << 20  # the published lines are ~1.2 kB; a line is never this long


def _no_duplicate_keys(pairs):
    """json object_pairs_hook: a key given twice is refused (json would keep
    the last silently; the engine's JSON readers refuse too)."""
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"key {k!r} appears twice in one JSON object")
        seen[k] = v
    return seen


def _open_regular(path):
    """Open a regular file for reading without blocking on a FIFO; devices
    (/dev/zero), FIFOs and directories are refused."""
    import stat

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DatasetError(
                f"{os.fsdecode(os.fspath(path))}: not a regular file "
                "(a FIFO, device or directory cannot be read as a dataset)"
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _lines(f, source: str):
    """(lineno, raw bytes) of each line, each read with a bound: a line over
    MAX_LINE_BYTES is a DatasetError instead of a read until memory runs out."""
    lineno = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES:
            raise DatasetError(
                f"{source}:{lineno}: line longer than {MAX_LINE_BYTES} bytes (not a benchmark JSONL file?)"
            )
        yield lineno, raw


def load_dataset(path, skip_bad: bool = False, limit: int | None = None) -> Dataset:
    """Read a benchmark JSONL file.

    skip_bad: leave bad lines out (their messages go to ``Dataset.errors``)
    instead of raising :class:`DatasetError` at the first one.
    limit: keep only the first ``limit`` good lines.
    """
    source = os.fspath(path)
    ds = Dataset(lines=[], path=source)
    with _open_regular(path) as f:
        for lineno, raw in _lines(f, source):
            if limit is not None and len(ds.lines) >= limit:
                break
            try:
                try:
                    s = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
                if not s.strip():
                    continue
                try:
                    obj = json.loads(s, object_pairs_hook=_no_duplicate_keys)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not JSON ({e})") from None
                except RecursionError:  # json's decoder recurses per nesting level
                    raise ValueError("not JSON the loader can read (nested too deeply)") from None
                ds.lines.append(parse_record(obj, lineno, source))
            except ValueError as e:
                msg = f"{source}:{lineno}: {e}"
                if not skip_bad:
                    raise DatasetError(msg) from None
                ds.errors.append(msg)
    return ds


def lines_from_records(records, source: str = "<records>") -> list[Line]:
    """Parse in-memory records (e.g. the output of :func:`synth_tasks.generate`)."""
    out = []
    for i, r in enumerate(records, start=1):
        try:
            out.append(parse_record(r, i, source))
        except ValueError as e:
            raise DatasetError(f"{source}:{i}: {e}") from None
    return out


def sample_across_tasks(ds: Dataset, n: int) -> Dataset:
    """n lines spread over the tasks: round-robin over the tasks (in order of
    first appearance), each task's lines in file order; the chosen lines keep
    their file order. Deterministic, so a --limit run is repeatable."""
    if n >= len(ds.lines):
        return ds
    by_task: dict[str, list[int]] = {}
    for i, line in enumerate(ds.lines):
        by_task.setdefault(line.task_id, []).append(i)
    queues = list(by_task.values())
    chosen: list[int] = []
    depth = 0
    while len(chosen) < n:
        for q in queues:
            if depth < len(q):
                chosen.append(q[depth])
                if len(chosen) == n:
                    break
        depth += 1
    chosen.sort()
    return Dataset(lines=[ds.lines[i] for i in chosen], path=ds.path, errors=ds.errors)
