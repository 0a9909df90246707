#!/usr/bin/env python3
"""Atheris (libFuzzer for Python) target for the benchmark's JSONL task loader.

    python3 engine/fuzz/fuzz_jsonl.py [libFuzzer flags] [CORPUS_DIR ...]

engine/fuzz/run.sh runs it like the C targets (seeds: engine/fuzz/corpus/jsonl/,
made by make_corpus.py from synth_tasks.generate). Needs `pip install atheris`
(in the test extras of pyproject.toml).

The input is a whole file: it is written to a temporary file and read with
synth_tasks.load_dataset, strictly and with skip_bad=True (and a limit). The
loader may only succeed or raise synth_tasks.DatasetError; any other
exception is a bug, and so is a result that breaks the loader's promises:
  * every answer is ``line.text[start:end]``, stripped and non-empty, the
    answers are in order and do not overlap, and no bracket is left in a text;
  * a strict load that succeeds equals the skip_bad load, which skipped
    nothing; a strict load that fails reports the skip_bad load's first error;
  * messages name the file and line; no more lines are kept than the file has.
"""
import os
import sys
import tempfile

import atheris

_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _root not in sys.path:
    sys.path.insert(0, _root)

with atheris.instrument_imports(include=["synth_tasks.dataset"]):
    import synth_tasks.dataset as dataset

# The file each input is written to (run.sh puts it under engine/build/fuzz/;
# libFuzzer ends the process with exit(), so it is overwritten, not removed).
PATH = os.environ.get("FUZZ_JSONL_FILE") or os.path.join(
    tempfile.gettempdir(), "fuzz_jsonl_%d.jsonl" % os.getpid())


def check_lines(ds, n_raw):
    assert len(ds.lines) + len(ds.errors) <= n_raw, (len(ds.lines), len(ds.errors), n_raw)
    for line in ds.lines:
        assert isinstance(line.task_id, str) and line.task_id.strip(), line.task_id
        assert "[" not in line.text and "]" not in line.text, line.text
        assert 1 <= line.lineno <= n_raw and line.source == PATH
        end = 0
        for a in line.answers:
            assert a.text and a.text == a.text.strip(), a
            assert end <= a.start < a.end <= len(line.text), (a, end, len(line.text))
            assert line.text[a.start:a.end] == a.text, (a, line.text)
            assert a.k >= 0 and a.example == a.k + 1, a
            end = a.end
    for msg in ds.errors:
        assert msg.startswith(PATH + ":"), msg


def same(a, b):
    return [(l.task_id, l.text, l.answers, l.lineno) for l in a.lines] == \
           [(l.task_id, l.text, l.answers, l.lineno) for l in b.lines]


def TestOneInput(data: bytes):
    with open(PATH, "wb") as f:
        f.write(data)
    n_raw = data.count(b"\n") + 1             # the loader splits on b"\n" only
    try:
        strict = dataset.load_dataset(PATH)
    except dataset.DatasetError as e:
        strict, strict_err = None, str(e)
        assert strict_err.startswith(PATH + ":"), strict_err
    lenient = dataset.load_dataset(PATH, skip_bad=True)   # must never raise
    check_lines(lenient, n_raw)
    if strict is not None:
        check_lines(strict, n_raw)
        assert not strict.errors and not lenient.errors, lenient.errors
        assert same(strict, lenient)
    else:
        assert lenient.errors and lenient.errors[0] == strict_err, (lenient.errors, strict_err)
    limited = dataset.load_dataset(PATH, skip_bad=True, limit=1)
    check_lines(limited, n_raw)
    assert len(limited.lines) <= 1
    if limited.lines:
        assert same(type(lenient)(lines=lenient.lines[:1]), limited)


def main():
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
