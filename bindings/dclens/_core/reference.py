"""A model as a reference: what `pickle.dumps(model)` holds.

A loaded Model pickles as its load arguments (the bundled name or absolute
path it was loaded from, device, thread count) and a fingerprint of the files
it was loaded from, never its weights, hooks or caches. Unpickling loads the
model again, on the machine that unpickles it (a worker process, another node
reading the same path), after checking the fingerprint: if the files changed
since the model was loaded, it refuses with a dclens.Error naming them.

The fingerprint of a model directory: for config.json, tokenizer.json and the
weight files of its layout (model.safetensors, or the index and its shards;
pytorch_model.bin, or the index and its shards), the size and a SHA-256 of
the file's header and trailer: a whole file under 1 MiB, else its first and
last 64 KiB (a safetensors header is at the front, a zip's central directory
at the end). Reading it costs a few reads per file, whatever the model size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from .bundled import resolve
from .checks import Error

WHOLE = 1 << 20  # files up to this size are hashed whole
EDGE = 64 << 10  # else their first and last EDGE bytes

# the weight layouts, in the loader's order (engine/src/io/layouts.c)
_LAYOUTS = (
    ("model.safetensors", None),
    ("model.safetensors.index.json", "index"),
    ("pytorch_model.bin", None),
    ("pytorch_model.bin.index.json", "index"),
)

FilePrint = tuple[str, int, str]  # (name in the directory, size, sha256 hex)


def _file_print(directory: str, name: str) -> FilePrint:
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h = hashlib.sha256()
            if size <= WHOLE:
                h.update(f.read(WHOLE + 1))
            else:
                h.update(f.read(EDGE))
                f.seek(size - EDGE)
                h.update(f.read(EDGE))
    except OSError as e:
        raise Error("%s: cannot read it to fingerprint the model: %s" % (path, e.strerror or e)) from None
    return name, size, h.hexdigest()


def _weight_files(directory: str) -> tuple[str, ...]:
    """The weight files the engine reads from `directory` (its first layout present)."""
    for name, kind in _LAYOUTS:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        if kind is None:
            return (name,)
        try:
            with open(path, "rb") as f:
                wm = json.loads(f.read(64 << 20)).get("weight_map", {})
            shards = sorted({v for v in wm.values() if isinstance(v, str)})
        except (OSError, ValueError, AttributeError) as e:
            raise Error("%s: cannot read the weight index to fingerprint the model: %s" % (path, e)) from None
        return (name,) + tuple(shards)
    return ()


def fingerprint(directory) -> tuple[FilePrint, ...]:
    """(name, size, sha256 of header + trailer) of each file a model is loaded from."""
    d = os.fsdecode(directory)
    names = ["config.json"] + (["tokenizer.json"] if os.path.isfile(os.path.join(d, "tokenizer.json")) else [])
    return tuple(_file_print(d, n) for n in names + list(_weight_files(d)))


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """How to load a model again, and what its files looked like when it was.

    source: a bundled model's name (resolved where it is loaded) or an
    absolute directory path; n_threads 0 means all cores of the machine that
    loads it."""

    source: str
    device: str = "cpu"
    n_threads: int = 0
    always_batch: bool = False
    files: tuple[FilePrint, ...] | None = None
    dtype: str = "auto"

    def directory(self) -> str:
        return os.fsdecode(resolve(self.source))

    def check(self) -> str:
        """The model directory, if its files are still those fingerprinted
        (else an Error naming what changed)."""
        d = self.directory()
        if self.files is None:
            return d
        now = {n: (s, h) for n, s, h in fingerprint(d)}
        was = {n: (s, h) for n, s, h in self.files}
        changes = []
        for n in sorted(set(now) | set(was)):
            if n not in now:
                changes.append("%s is gone" % n)
            elif n not in was:
                changes.append("%s is new" % n)
            elif now[n][0] != was[n][0]:
                changes.append("%s: %d bytes, was %d" % (n, now[n][0], was[n][0]))
            elif now[n][1] != was[n][1]:
                changes.append("%s: its header or trailer changed (same size)" % n)
        if changes:
            raise Error(
                "%s: the model's files changed since it was loaded and pickled (%s); "
                "load it again from the new files" % (d, "; ".join(changes))
            )
        return d

    def with_threads(self, n_threads: int) -> ModelRef:
        return dataclasses.replace(self, n_threads=int(n_threads))
