"""The bundled models' published scores, recomputed from their weights.

Each bundled model ships benchmark.json (written by `scripts/train_bundled.py
finish` from `dclens synth` on the stored weights): overall, per task, per k,
per pattern, per transformation and per line, on the published file and the
held-out set. Here the numpy reference of tests/reference.py (float64, written
from the spec, not from the engine) reads the shipped safetensors and scores
lines by the benchmark's protocol; its per-line counts of correct answers and
summed NLL must be the shipped ones, and the shipped aggregates must follow from
the shipped per-line numbers. The reference is slow (seconds a line), so it
scores the two shortest lines of each set.
"""

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

import dclens
from synth_tasks import load_dataset, tokenize_line
from synth_tasks.corpus import HELDOUT_FILE

import reference
from tolerances import f64_tol, forward_tol

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PUBLISHED = os.path.join(os.path.dirname(ROOT), "shared", "data", "synthetic_dataset.jsonl")
NAMES = ("dcpythia-tiny", "pythia-tiny", "dcpythia-small", "pythia-small")


def _model_dir(name):
    for m in dclens.bundled_models():
        if m.name == name:
            return m.path
    pytest.fail("%s is not bundled" % name)


def _bench(name):
    return json.loads(Path(_model_dir(name), "benchmark.json").read_text())


def _data(label):
    if label == "published":
        if not os.path.exists(PUBLISHED):
            pytest.skip("the published benchmark file is not in ../shared/data")
        return load_dataset(PUBLISHED)
    return load_dataset(HELDOUT_FILE)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("label", ["published", "held-out"])
def test_aggregates_follow_from_the_per_line_numbers(name, label):
    b = _bench(name)[label]
    rows = b["per_line"]
    assert len(rows) == b["lines"] == len(_data(label))
    n, correct = sum(r[2] for r in rows), sum(r[3] for r in rows)
    assert n == b["overall"]["n"] and correct == b["overall"]["correct"]
    # the per-line values are written with 6 decimals (each up to 5e-7 off), the
    # total unrounded: len(rows) roundings, plus float64 rounding of the sums
    assert math.isclose(
        sum(r[4] for r in rows), b["overall"]["nll"], rel_tol=f64_tol(len(rows)), abs_tol=len(rows) * 5e-7
    )
    for task, s in b["per_task"].items():
        mine = [r for r in rows if r[0] == task]
        assert sum(r[3] for r in mine) == s["correct"] and sum(r[2] for r in mine) == s["n"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("label", ["published", "held-out"])
def test_shortest_lines_rescored_by_the_numpy_reference(name, label):
    from safetensors.numpy import load_file

    d = _model_dir(name)
    sd = load_file(os.path.join(d, "model.safetensors"))
    cfg = json.loads(Path(d, "config.json").read_text())
    tok = dclens.load(d).tokenizer
    shipped = {(r[0], r[1]): r for r in _bench(name)[label]["per_line"]}
    lines = sorted(_data(label), key=lambda l: len(l.text))[:2]
    for line in lines:
        tl = tokenize_line(line, tok)
        logits = reference.ref_forward(sd, cfg, tl.ids)  # [T, V] float64
        lp = logits - logits.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        correct, nll = 0, 0.0
        tgt_all = [t for a0, a1 in tl.spans for t in tl.ids[a0:a1]]
        for a0, a1 in tl.spans:
            tgt = tl.ids[a0:a1]
            rows = lp[a0 - 1 : a1 - 1]
            correct += int(np.all(rows.argmax(-1) == tgt))
            nll -= float(rows[np.arange(a1 - a0), tgt].sum())
        _, _, n, want_correct, want_nll = shipped[(line.task_id, line.lineno)]
        assert n == len(tl.spans)
        assert correct == want_correct, "%s %s line %d" % (name, label, line.lineno)
        # the shipped nll is the engine's (float32, on the machine that made it),
        # this one float64: per answer token the log-softmax differs by twice the
        # logits' error, forward_tol of the model relative to max |logit|
        tol = 2 * len(tgt_all) * forward_tol(cfg, len(tl.ids), logits.size) * np.abs(logits).max()
        assert abs(nll - want_nll) <= tol, (nll, want_nll, tol)
