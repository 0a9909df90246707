"""synth_tasks.seeds and `train_bundled.py seeds`: several training seeds of the
twins in the bundled benchmark.json and cards (issue 29), on benchmark files
built here with known answers."""

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest

from synth_tasks import seeds as sd

from conftest import ROOT

TWINS = ("dcpythia-tiny", "pythia-tiny")


def _bench(correct, answers=6):
    """A benchmark.json dict whose lines have `correct[i]` right of `answers`."""
    per = [["task%d" % (i % 7), i, answers, int(c), 1.0] for i, c in enumerate(correct)]
    sec = lambda: {  # noqa: E731
        "lines": len(per),
        "overall": {"acc": sum(r[3] for r in per) / (answers * len(per)), "n": answers * len(per)},
        "per_line": copy.deepcopy(per),
    }
    return {"published": sec(), "held-out": sec()}


def test_all_right_minus_all_wrong_is_one_with_no_spread():
    a = {str(s): _bench([6] * 50) for s in range(3)}
    b = {str(s): _bench([0] * 50) for s in range(3)}
    c = sd.combine({"A": a, "B": b}, ["A", "B"])
    for lb in sd.LABELS:
        assert c["difference"][lb] == pytest.approx(
            {"diff": 1.0, "lo": 1.0, "hi": 1.0, "seeds_a": 3, "seeds_b": 3, "lines": 50}
        )
        assert c["spread"]["A"][lb]["sd"] == 0.0 and c["spread"]["B"][lb]["mean"] == 0.0
    assert sorted(c["seeds"]["A"]) == ["0", "1", "2"]
    assert c["seeds"]["A"]["1"]["published"]["overall"]["acc"] == 1.0


def test_point_and_spread_from_per_seed_accuracies():
    rng = np.random.default_rng(3)
    a = {str(s): _bench(rng.integers(0, 7, 80)) for s in range(3)}
    b = {str(s): _bench(rng.integers(0, 7, 80)) for s in range(2)}
    acc = {
        k: [sum(r[3] for r in x["published"]["per_line"]) / (6 * 80) for x in v.values()]
        for k, v in (("a", a), ("b", b))
    }
    c = sd.combine({"A": a, "B": b}, ["A", "B"])
    d = c["difference"]["published"]
    assert d["diff"] == pytest.approx(np.mean(acc["a"]) - np.mean(acc["b"]), abs=1e-12)
    assert d["lo"] <= d["diff"] <= d["hi"]
    assert c["spread"]["A"]["published"]["sd"] == pytest.approx(np.std(acc["a"], ddof=1), abs=1e-12)
    assert c["spread"]["B"]["published"]["min"] == pytest.approx(min(acc["b"]), abs=1e-12)


def test_disagreeing_seeds_widen_the_interval():
    """Seeds whose accuracies differ widen the interval beyond the lines' part alone."""
    rng = np.random.default_rng(0)
    base = rng.integers(2, 5, 200)
    same = {str(s): _bench(base) for s in range(3)}
    apart = {str(s): _bench(np.clip(base + (s - 1) * 2, 0, 6)) for s in range(3)}
    ref = {str(s): _bench(base) for s in range(3)}
    w_same = sd.combine({"A": same, "B": ref}, ["A", "B"])["difference"]["published"]
    w_apart = sd.combine({"A": apart, "B": ref}, ["A", "B"])["difference"]["published"]
    assert w_same["lo"] == w_same["hi"] == 0.0  # identical models: every replicate is 0
    assert w_apart["hi"] - w_apart["lo"] > 0.2  # seeds at about -33, 0, +33 points


def test_lines_must_match():
    a = {"0": _bench([1] * 10)}
    b = {"0": _bench([1] * 11)}
    with pytest.raises(sd.SeedsError, match="same lines"):
        sd.combine({"A": a, "B": b}, ["A", "B"])


def test_train_bundled_seeds_writes_key_and_card_section(tb, tmp_path):
    models = os.path.join(ROOT, "bindings", "dclens", "models")
    for s, shift in (("1", 1), ("2", -1)):
        for t in TWINS:
            b = json.loads(Path(models, t, "benchmark.json").read_text())
            for lb in sd.LABELS:
                for r in b[lb]["per_line"]:
                    r[3] = int(min(max(r[3] + shift, 0), r[2]))
                c = sum(r[3] for r in b[lb]["per_line"])
                b[lb]["overall"] = dict(b[lb]["overall"], correct=c, acc=c / sum(r[2] for r in b[lb]["per_line"]))
            d = tmp_path / ("seed" + s) / "ship" / t
            d.mkdir(parents=True)
            (d / "benchmark.json").write_text(json.dumps(b))
    argv = ["seeds", "--out", str(tmp_path), "--runs", "1=%s" % (tmp_path / "seed1"), "2=%s" % (tmp_path / "seed2")]
    for _ in range(2):  # a rerun replaces what the first wrote
        assert tb.main(argv) == 0
    for t in TWINS:
        out = json.loads((tmp_path / "seeds" / t / "benchmark.json").read_text())
        shipped = json.loads(Path(models, t, "benchmark.json").read_text())
        assert sorted(out["seeds"]) == ["0", "1", "2"]
        assert out["seeds"]["0"]["published"]["overall"] == shipped["published"]["overall"]
        assert out["seeds"]["1"]["held-out"]["overall"]["acc"] > shipped["held-out"]["overall"]["acc"]
        assert out["seeds_difference"]["minus"] == [x for x in TWINS if x != t][0]
        card = (tmp_path / "seeds" / t / "MODEL_CARD.md").read_text()
        assert card.count("## Seeds") == 1 and "| 2 |" in card
    a = json.loads((tmp_path / "seeds" / TWINS[0] / "benchmark.json").read_text())["seeds_difference"]["published"]
    b = json.loads((tmp_path / "seeds" / TWINS[1] / "benchmark.json").read_text())["seeds_difference"]["published"]
    assert a["diff"] == pytest.approx(-b["diff"]) and a["lo"] == pytest.approx(-b["hi"])


def test_train_bundled_seeds_refuses_a_limited_run(tb, tmp_path, capsys):
    models = os.path.join(ROOT, "bindings", "dclens", "models")
    for t in TWINS:
        b = json.loads(Path(models, t, "benchmark.json").read_text())
        b["published"]["lines"] = 3
        b["published"]["per_line"] = b["published"]["per_line"][:3]
        d = tmp_path / "r" / "ship" / t
        d.mkdir(parents=True)
        (d / "benchmark.json").write_text(json.dumps(b))
    assert tb.main(["seeds", "--out", str(tmp_path), "--runs", "1=%s" % (tmp_path / "r")]) == 1
    err = capsys.readouterr().out
    assert "benchmark.json: published scored on 3 lines" in err and "without --limit" in err
    assert tb.main(["seeds", "--out", str(tmp_path), "--runs", "0=%s" % (tmp_path / "r")]) == 2
