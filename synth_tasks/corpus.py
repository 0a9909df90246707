"""Training and held-out data for the bundled models, kept apart from the published file.

    published = published_examples()                 # plain examples of the published file
    heldout = heldout_records()                      # 12 lines per task, seed HELDOUT_SEED
    for rec in training_records(seed=0):             # endless, deterministic, streaming
        text = record_text(rec)                      # exactly what the evaluator feeds
    for ids, mask in token_stream(tokenizer, seed=0):   # segment-wise ids, answer mask

Three sets, disjoint at the example level (no plain example text, brackets
removed, is in two of them):

* the published file (../shared/data/synthetic_dataset.jsonl) -- the benchmark;
* the held-out set: :func:`synth_tasks.generate.generate` with ``HELDOUT_SEED``,
  ``HELDOUT_LINES_PER_TASK`` lines per task, excluding the published examples;
* the training stream: lines of every task in a seeded order, excluding the
  published and the held-out examples.  Line ``i`` of the stream depends only on
  ``seed`` and ``i`` (chunk ``i // 74``: one line per task, shuffled), so a
  resumed run restarts at its line offset (``start``) and gets the same lines.

The training text of a line is the line's text as the benchmark reads it
(:func:`synth_tasks.dataset.parse_texts`: the ``[ X ]`` brackets removed,
leading and trailing newline kept), and its tokens are cut segment-wise at the
answers exactly as :func:`synth_tasks.tokenize.tokenize_lines` does for scoring.

Command line (``python -m synth_tasks.cli corpus ...``):
    corpus heldout OUT.jsonl [--seed S] [--lines-per-task N]
    corpus train OUT.jsonl --lines N [--seed S] [--start K] [--format jsonl|text]
    corpus check FILE.jsonl [--against A.jsonl ...]   (example-level overlap check)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
from collections.abc import Iterable, Iterator

import numpy as np

from .dataset import DATA_NAME, default_data_path, lines_from_records, parse_texts
from .tasks import TASKS
from .tokenize import tokenize_lines

_gen = importlib.import_module("synth_tasks.generate")  # the package exports a function of that name

HELDOUT_SEED = 1000
HELDOUT_LINES_PER_TASK = 12
TRAIN_SEED = 0

# shipped with the package (tests check that the commands below rewrite them byte for byte):
#   python -m synth_tasks.cli corpus heldout synth_tasks/data/heldout.jsonl
#   python -m synth_tasks.cli tokenizer fit synth_tasks/data/tokenizer.json
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
HELDOUT_FILE = os.path.join(DATA_DIR, "heldout.jsonl")
TOKENIZER_FILE = os.path.join(DATA_DIR, "tokenizer.json")


def _read_records(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(l) for l in f if l.strip()]


def published_path() -> str:
    p = default_data_path()
    if p is None:
        raise FileNotFoundError(f"the published {DATA_NAME} was not found in ../shared/data")
    return p


def published_examples(path=None) -> set[str]:
    """The plain examples (brackets removed) of the published file."""
    return _gen.examples_of(_read_records(path or published_path()))


def heldout_records(
    seed: int = HELDOUT_SEED, lines_per_task: int = HELDOUT_LINES_PER_TASK, published=None
) -> list[dict]:
    """The held-out generated set: ``lines_per_task`` lines per task, none of
    whose examples is in the published file (``published``: its examples;
    default: read from ../shared/data)."""
    excl = published_examples() if published is None else published
    return _gen.generate(lines_per_task=lines_per_task, seed=seed, exclude=excl)


def training_exclude(published=None, heldout=None) -> frozenset[str]:
    """Examples the training stream must not contain: the published file's and
    the default held-out set's."""
    pub = published_examples() if published is None else set(published)
    held = heldout_records(published=pub) if heldout is None else heldout
    return frozenset(pub | _gen.examples_of(held))


def training_records(
    seed: int = TRAIN_SEED, exclude: Iterable[str] | None = None, start: int = 0, stop: int | None = None, task_ids=None
) -> Iterator[dict]:
    """Lines ``start``, ``start + 1``, ... (up to ``stop``, default endless) of the
    training stream: chunk c holds one line of every task, in an order shuffled
    with (seed, c); each line is generated from its own (seed, c, task) RNG.

    exclude: plain examples never to produce (default: :func:`training_exclude`).
    """
    ids = list(TASKS) if task_ids is None else list(task_ids)
    for tid in ids:
        if tid not in TASKS:
            raise KeyError(f"unknown task {tid!r}")
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"bad line range start={start} stop={stop}")
    excl = training_exclude() if exclude is None else frozenset(_gen._unbracket(e) for e in exclude)
    n = len(ids)
    i = start
    while stop is None or i < stop:
        c, j = divmod(i, n)
        order = list(ids)
        random.Random(f"synth_tasks:train-order:{seed}:{c}").shuffle(order)
        tid = order[j]
        rng = random.Random(f"synth_tasks:train:{seed}:{c}:{tid}")
        yield _gen.generate_line(tid, rng, excl)
        i += 1


def record_text(rec: dict) -> str:
    """The text the benchmark feeds the model for this record (brackets removed)."""
    return parse_texts(rec["texts"])[0]


def training_texts(seed: int = TRAIN_SEED, exclude=None, start: int = 0, stop: int | None = None) -> Iterator[str]:
    for rec in training_records(seed, exclude, start, stop):
        yield record_text(rec)


def token_stream(
    tokenizer, seed: int = TRAIN_SEED, exclude=None, start: int = 0, stop: int | None = None, chunk: int = 74
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids int32 [T], answer_mask bool [T]) per training line, tokenised
    segment-wise as the evaluator does; answer_mask[p] is True where token p
    belongs to a bracketed (scored) answer."""
    recs = training_records(seed, exclude, start, stop)
    while True:
        batch = [r for _, r in zip(range(chunk), recs)]
        if not batch:
            return
        for tl in tokenize_lines(lines_from_records(batch, "<training stream>"), tokenizer):
            mask = np.zeros(len(tl.ids), dtype=bool)
            for s, e in tl.spans:
                mask[s:e] = True
            yield tl.ids, mask


def overlap(records: Iterable[dict], examples: Iterable[str]) -> list[str]:
    """Plain examples of ``records`` that are also in ``examples`` (sorted)."""
    ex = examples if isinstance(examples, (set, frozenset)) else set(examples)
    return sorted(_gen.examples_of(records) & ex)


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


def _write_records(path, recs, fmt: str) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            if fmt == "jsonl":
                f.write(json.dumps({"task_id": r["task_id"], "texts": r["texts"]}) + "\n")
            else:  # texts back to back: a blank line between two lines
                f.write(record_text(r))
            n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m synth_tasks.cli corpus",
        description="Training / held-out data disjoint from the published file.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("heldout", help="write the held-out generated set (JSONL)")
    h.add_argument("out")
    h.add_argument("--seed", type=int, default=HELDOUT_SEED)
    h.add_argument("--lines-per-task", type=int, default=HELDOUT_LINES_PER_TASK)
    h.add_argument("--published", default=None, help="published JSONL (default ../shared/data)")
    t = sub.add_parser("train", help="write lines of the training stream")
    t.add_argument("out")
    t.add_argument("--lines", type=int, required=True)
    t.add_argument("--seed", type=int, default=TRAIN_SEED)
    t.add_argument("--start", type=int, default=0, help="first line index of the stream")
    t.add_argument(
        "--format",
        choices=["jsonl", "text"],
        default="jsonl",
        help="jsonl: published format (brackets); text: the fed texts back to back",
    )
    t.add_argument("--published", default=None)
    c = sub.add_parser("check", help="example-level overlap of a JSONL file with others")
    c.add_argument("file")
    c.add_argument(
        "--against",
        action="append",
        default=None,
        help="JSONL files (default: the published file and the default held-out set)",
    )
    a = ap.parse_args(argv)
    try:
        pub = published_examples(getattr(a, "published", None))
        if a.cmd == "heldout":
            recs = heldout_records(a.seed, a.lines_per_task, pub)
            n = _write_records(a.out, recs, "jsonl")
            print(f"wrote {n} held-out lines (seed {a.seed}) to {a.out}")
        elif a.cmd == "train":
            if a.lines < 0 or a.start < 0:
                ap.error("--lines and --start must be >= 0")
            recs = training_records(a.seed, training_exclude(pub), a.start, a.start + a.lines)
            n = _write_records(a.out, recs, a.format)
            print(f"wrote training lines {a.start}..{a.start + n - 1} (seed {a.seed}) to {a.out}")
        else:
            recs = _read_records(a.file)
            if a.against:
                sets = {p: _gen.examples_of(_read_records(p)) for p in a.against}
            else:
                sets = {"published": pub, "held-out": _gen.examples_of(heldout_records(published=pub))}
            bad = 0
            for name, ex in sets.items():
                o = overlap(recs, ex)
                bad += len(o)
                print(f"{a.file} vs {name}: {len(o)} shared example(s)" + (f", e.g. {o[0]!r}" if o else ""))
            return 1 if bad else 0
    except (OSError, ValueError, KeyError) as e:
        print(f"corpus: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
