#!/usr/bin/env python3
"""Does notebook 02's case study hold in other training seeds? (issue 29)

    python scripts/seed_case_study.py MODEL [MODEL ...] [--out case_study.json]
        [--task task24 --line 289 --answer 0] [--data FILE] [--survey N]

Runs synth_tasks.case_study (IG's top head, its applied weight on the source
split into branches and into own / borrowed, the effect of zeroing the top
branch and the head) on each MODEL (a bundled name or a directory, e.g. each
seed's `runs/seedS/ship/dcpythia-tiny`) for the answer notebook 02 studies (by
default the one its committed key numbers name), prints one line per model and
writes the dicts as JSON ({"answer": [one dict per model]}). A MODEL may be
written LABEL=PATH (e.g. seed1=runs/seed1/ship/dcpythia-tiny).

--survey N: the same case study on the first N answers that every MODEL gets
right among the lines of tasks 0-55 (facts about people, as notebook 02), taken
first from the first line of each task (the notebook's own set), then the
second line of each, and so on; and what they have in common (synth_tasks.case_study.summarise): JSON
keys "survey" and "summary", one summary line per model printed.
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
    ap.add_argument("--survey", type=int, default=0, metavar="N", help="also survey N answers every model gets right")
    a = ap.parse_args(argv)
    labelled = [m.split("=", 1) if "=" in m else [m, m] for m in a.models]
    nb = notebook_prompt()
    task, lineno = a.task or nb["task"], a.line if a.line is not None else nb["line"]
    answer = a.answer if a.answer is not None else nb["answer"]
    data = a.data or default_data_path() or HELDOUT_FILE
    line = next((x for x in load_dataset(data) if x.task_id == task and x.lineno == lineno), None)
    if line is None:
        print("error: %s has no line %d of %s" % (data, lineno, task), file=sys.stderr)
        return 2
    models = {label: dclens.load(path) for label, path in labelled}
    out = []
    for label, path in labelled:
        r = case_study(models[label], line, answer)
        r["path"], r["label"] = path, label
        out.append(r)
        m = label
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
    result = {"answer": out}
    if a.survey > 0:
        from synth_tasks.case_study import READS_SOURCE, summarise, survey

        # tasks 0-55 (facts about people), as notebook 02: first the first line of each task (the
        # notebook's own set), then the second line of each, and so on
        lines = [x for x in load_dataset(data) if int(x.task_id[4:]) <= 55]
        rank, seen = [], {}
        for x in lines:
            seen[x.task_id] = seen.get(x.task_id, -1) + 1
            rank.append(seen[x.task_id])
        lines = [x for _, _, x in sorted(zip(rank, range(len(lines)), lines), key=lambda r: r[:2])]
        result["survey"] = survey(models, lines, limit=a.survey)
        result["summary"] = {label: summarise(result["survey"][label]) for label in models}
        result["reads_source_threshold"] = READS_SOURCE
        print("survey: %d answers every model gets right" % len(result["survey"]["answers"]))
        for label, sm in result["summary"].items():
            if "reads_source" not in sm:
                print("%s: no DCMHA" % label)
                continue
            print(
                "%s: top head reads the source in %d of %d; there its top branch %s; median borrowed share %s;"
                " zeroing the head halves p in %d, its top branch in %d"
                % (
                    label,
                    sm["reads_source"],
                    sm["answers"],
                    ", ".join("%s %d" % (b, c) for b, c in sm["top_branch"].items() if c),
                    "-" if sm["borrowed_share_median"] is None else "%.0f%%" % (100 * sm["borrowed_share_median"]),
                    sm["head_needed"],
                    sm["branch_needed"],
                )
            )
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
