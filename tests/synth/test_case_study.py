"""synth_tasks.case_study (notebook 02's case study as one function, for other
training seeds, issue 29) reproduces the numbers notebook 02 committed, on the
model and answer the notebook studies; scripts/seed_case_study.py runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import dclens
from synth_tasks import load_dataset
from synth_tasks.case_study import case_study
from synth_tasks.cli import default_data_path
from synth_tasks.corpus import HELDOUT_FILE

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from run_notebooks import findings  # noqa: E402

PRINTED = 1e-4  # the notebook prints 4 decimals


@pytest.fixture(scope="module")
def nb02():
    return findings(nbformat.read(os.path.join(ROOT, "notebooks", "02_head_composition.ipynb"), as_version=4))


def test_reproduces_notebook_02(nb02):
    data = load_dataset(default_data_path() or HELDOUT_FILE)
    line = next((x for x in data if x.task_id == nb02["task_id"] and x.lineno == nb02["line"]), None)
    if line is None:
        pytest.skip("notebook 02's line is in the published file, not in ../shared/data here")
    r = case_study(dclens.load(nb02["model"]), line, nb02["answer_index"])
    assert r["head"] == nb02["head"] and r["top_branch"] == nb02["top_branch"] and r["lender"] == nb02["lender"]
    for k in ("p_answer", "ig", "own", "borrowed", "lent_by_lender", "p_without_branch", "p_without_head"):
        assert abs(r[k] - nb02[k]) <= PRINTED + 1e-3 * abs(nb02[k]), k
    for b, v in nb02["branches"].items():
        assert abs(r["branches"][b] - v) <= PRINTED + 1e-3 * abs(v), b
    assert abs(sum(r["branches"].values()) - r["weight"]) < 1e-5
    assert abs(r["own"] + r["borrowed"] - r["weight"]) < 1e-4
    t = case_study(dclens.load(nb02["twin"]), line, nb02["answer_index"])
    assert abs(t["p_answer"] - nb02["p_answer_twin"]) <= PRINTED and "top_branch" not in t


def test_script_writes_json(tmp_path, nb02):
    data = default_data_path() or HELDOUT_FILE
    if not any(x.task_id == nb02["task_id"] and x.lineno == nb02["line"] for x in load_dataset(data)):
        pytest.skip("notebook 02's line is not in %s" % data)
    out = tmp_path / "cs.json"
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "seed_case_study.py"), "dcpythia-tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    (r,) = json.loads(Path(out).read_text())["answer"]
    assert r["path"] == "dcpythia-tiny" and r["head"] == nb02["head"]
    assert "top branch %s" % nb02["top_branch"] in p.stdout
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "seed_case_study.py"), "dcpythia-tiny", "--line", "99999"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "has no line 99999" in p.stderr


def test_summarise_counts():
    """summarise on hand-made case studies: exact counts."""
    from synth_tasks.case_study import summarise

    def r(w, top, borrowed, p, p_branch, p_head, layer):
        return {
            "weight": w,
            "top_branch": top,
            "borrowed": borrowed,
            "p_answer": p,
            "p_without_branch": p_branch,
            "p_without_head": p_head,
            "head": [layer, 0],
        }

    rs = [
        r(2.0, "kp", 1.8, 0.8, 0.1, 0.7, 0),
        r(0.05, "qp", 0.0, 0.5, 0.5, 0.2, 1),
        r(1.0, "qp", 0.5, 0.6, 0.3, 0.31, 0),
    ]
    s = summarise(rs)
    assert s["answers"] == 3 and s["reads_source"] == 2
    assert s["top_branch"] == {"skip": 0, "qp": 1, "kp": 1, "qg": 0, "kg": 0}
    assert abs(s["borrowed_share_median"] - 0.7) < 1e-12  # median of 0.9 and 0.5
    assert s["head_needed"] == 1 and s["branch_needed"] == 2  # <= half of p: 0.2 <= 0.25; 0.1, 0.3 <= 0.3
    assert s["top_layer"] == {"0": 2, "1": 1}
    assert summarise([{"p_answer": 0.5, "head": [0, 1]}]) == {"answers": 1}  # an MHA model: IG part only


def test_survey_is_case_study_on_common_answers():
    """survey picks answers every model gets right, in file order, and gives case_study's numbers."""
    from synth_tasks.case_study import survey
    from synth_tasks.evaluate import evaluate

    data = load_dataset(default_data_path() or HELDOUT_FILE)
    lines = [x for x in data if x.task_id in ("task0", "task1", "task24")][:4]
    m, t = dclens.load("dcpythia-tiny"), dclens.load("pythia-tiny")
    s = survey({"dc": m, "mha": t}, lines, limit=2, steps=8, progress=False)
    ok = [
        {(a.task_id, a.line, a.example) for a in evaluate(x, lines, progress=False).answers if a.correct}
        for x in (m, t)
    ]
    assert 0 < len(s["answers"]) <= 2
    for (task, lineno, j), rd, rm in zip(s["answers"], s["dc"], s["mha"]):
        line = next(x for x in lines if x.task_id == task and x.lineno == lineno)
        key = (task, lineno, line.answers[j].example)
        assert key in ok[0] and key in ok[1]
        again = case_study(m, line, j, steps=8)
        assert rd["head"] == again["head"] and rd["top_branch"] == again["top_branch"]
        assert rd["p_answer"] == again["p_answer"] and "top_branch" not in rm


def test_committed_seed_survey_matches_the_bundled_model():
    """docs/training/seeds-2026-11-25/case_study.json (notebook 02 section 9 reads it): its seed-0
    parts were made from the bundled dcpythia-tiny; two of its survey answers recomputed here."""
    path = os.path.join(ROOT, "docs", "training", "seeds-2026-11-25", "case_study.json")
    cs = json.loads(Path(path).read_text())
    data = load_dataset(default_data_path() or HELDOUT_FILE)
    (task, lineno, j), *_ = cs["survey"]["answers"]
    if not any(x.task_id == task and x.lineno == lineno for x in data):
        pytest.skip("the survey's lines are in the published file, not in ../shared/data here")
    m = dclens.load("dcpythia-tiny")
    for i in (0, len(cs["survey"]["answers"]) - 1):
        task, lineno, j = cs["survey"]["answers"][i]
        line = next(x for x in data if x.task_id == task and x.lineno == lineno)
        r, c = case_study(m, line, j), cs["survey"]["seed0"][i]
        assert r["head"] == c["head"] and r["top_branch"] == c["top_branch"]
        for k in ("p_answer", "weight", "borrowed", "p_without_branch", "p_without_head"):
            assert abs(r[k] - c[k]) <= 1e-4 + 1e-3 * abs(c[k]), (i, k)
    # the summary is what summarise() makes of the entries
    from synth_tasks.case_study import summarise

    for label, s in cs["summary"].items():
        assert summarise(cs["survey"][label]) == s
