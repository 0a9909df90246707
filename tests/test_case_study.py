"""synth_tasks.case_study (notebook 02's case study as one function, for other
training seeds, issue 29) reproduces the numbers notebook 02 committed, on the
model and answer the notebook studies; scripts/seed_case_study.py runs it."""

import json
import os
import subprocess
import sys

import nbformat
import pytest
from conftest import ROOT

import dclens
from synth_tasks import load_dataset
from synth_tasks.case_study import case_study
from synth_tasks.cli import default_data_path
from synth_tasks.corpus import HELDOUT_FILE

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
    (r,) = json.load(open(out))
    assert r["path"] == "dcpythia-tiny" and r["head"] == nb02["head"]
    assert "top branch %s" % nb02["top_branch"] in p.stdout
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "seed_case_study.py"), "dcpythia-tiny", "--line", "99999"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "has no line 99999" in p.stderr
