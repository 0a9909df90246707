#!/usr/bin/env python3
"""Does notebook 02's case study hold in other training seeds? (issue 29)

    python scripts/seed_case_study.py MODEL [MODEL ...] [--out case_study.json]
        [--task task24 --line 289 --answer 0] [--data FILE]

Runs synth_tasks.case_study (IG's top head, its applied weight on the source
split into branches and into own / borrowed, the effect of zeroing the top
branch and the head) on each MODEL (a bundled name or a directory, e.g. each
seed's `runs/seedS/ship/dcpythia-tiny`) for the answer notebook 02 studies (by
default the one its committed key numbers name), prints one line per model and
writes the dicts as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "02_head_composition.ipynb")


def notebook_prompt() -> dict:
    """task_id, line, answer_index of notebook 02's committed key numbers."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import nbformat
    from run_notebooks import findings

    f = findings(nbformat.read(NOTEBOOK, as_version=4))
    return {"task": f["task_id"], "line": f["line"], "answer": f["answer_index"]}


def main(argv=None) -> int:
    import dclens
    from synth_tasks import load_dataset
    from synth_tasks.case_study import case_study
    from synth_tasks.cli import default_data_path
    from synth_tasks.corpus import HELDOUT_FILE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    ap.add_argument("--task", default=None, help="default: notebook 02's")
    ap.add_argument("--line", type=int, default=None)
    ap.add_argument("--answer", type=int, default=None)
    ap.add_argument("--data", default=None, help="default: the published file, else the held-out set")
    a = ap.parse_args(argv)
    nb = notebook_prompt()
    task, lineno = a.task or nb["task"], a.line if a.line is not None else nb["line"]
    answer = a.answer if a.answer is not None else nb["answer"]
    data = a.data or default_data_path() or HELDOUT_FILE
    line = next((x for x in load_dataset(data) if x.task_id == task and x.lineno == lineno), None)
    if line is None:
        print("error: %s has no line %d of %s" % (data, lineno, task), file=sys.stderr)
        return 2
    out = []
    for m in a.models:
        r = case_study(dclens.load(m), line, answer)
        r["path"] = m
        out.append(r)
        msg = "%s: p(answer) %.3f, top head L%dH%d (IG %.2f, %.0f%% of |IG|)" % (
            m,
            r["p_answer"],
            *r["head"],
            r["ig"],
            100 * r["ig_share"],
        )
        if "top_branch" in r:
            msg += (
                "; weight on the source %.2f, top branch %s (%.0f%%), borrowed %.0f%%; p without branch %.3f, without head %.3f"
                % (
                    r["weight"],
                    r["top_branch"],
                    100 * r["top_branch_share"],
                    100 * r["borrowed"] / r["weight"],
                    r["p_without_branch"],
                    r["p_without_head"],
                )
            )
        print(msg)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
