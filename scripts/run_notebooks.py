#!/usr/bin/env python3
"""Execute the notebooks top to bottom and save them with their outputs.

    python scripts/run_notebooks.py                    # every notebooks/*.ipynb, in place
    python scripts/run_notebooks.py notebooks/01_quickstart.ipynb
    python scripts/run_notebooks.py --check            # execute copies, change nothing

The rule for committed notebooks (tests/analyses/test_notebooks.py enforces it): they are
saved with the outputs this script writes on the bundled models, so that they
read well on a code host; figures are PNGs at 80 dpi; a notebook file stays
under MAX_NOTEBOOK_BYTES and no single output over MAX_OUTPUT_BYTES; no cell
errors; no timing metadata (diffs stay small). Rerun this script and commit
its result whenever the notebooks, the engine's numbers or the bundled models
change: the test compares the committed key numbers with a fresh run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
MAX_NOTEBOOK_BYTES = 1_500_000
MAX_OUTPUT_BYTES = 250_000
# variables the notebooks read to run on other models: unset, so the bundled models are used
NOTEBOOK_ENV = ("DCLENS_MODEL", "DCLENS_PYTHIA", "DCLENS_DEVICE", "DCLENS_DATA")


def execute(path: str, kernel_name: str = "python3", timeout: int = 600):
    """Run a notebook in a fresh kernel (cwd notebooks/); returns the executed NotebookNode."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
            c.metadata.pop("execution", None)
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name=kernel_name, record_timing=False, resources={"metadata": {"path": NOTEBOOKS}}
    )
    client.execute()
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs = squash_streams(c.outputs)
    return nb


def _as_shown(text: str) -> str:
    """A stream's text as a terminal or Jupyter shows it: on each line only what
    follows its last carriage return (a progress bar's final state)."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))


def squash_streams(outputs: list) -> list:
    """Consecutive outputs of one stream merged and reduced to what is shown
    (a progress bar redrawn a thousand times is saved once, as it ends)."""
    out: list = []
    for o in outputs:
        if (
            o.get("output_type") == "stream"
            and out
            and out[-1].get("output_type") == "stream"
            and out[-1].name == o.name
        ):
            out[-1].text = _as_shown(out[-1].text + o.text)
        else:
            if o.get("output_type") == "stream":
                o.text = _as_shown(o.text)
            out.append(o)
    return out


def output_sizes(nb) -> list:
    """[(cell index, bytes)] of every code cell's outputs."""
    return [(i, len(json.dumps(o))) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.outputs]


def findings(nb) -> dict:
    """The key numbers a notebook prints at its end (after 'key numbers')."""
    for c in reversed(nb.cells):
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            text = o.get("text", "") if o.get("output_type") == "stream" else ""
            if "key numbers" in text:
                return json.loads(text[text.index("\n") + 1 :])
    raise ValueError("no 'key numbers' output")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--check", action="store_true", help="execute copies; write nothing")
    a = ap.parse_args(argv)
    import nbformat

    for k in NOTEBOOK_ENV:
        os.environ.pop(k, None)
    paths = a.paths or sorted(glob.glob(os.path.join(NOTEBOOKS, "*.ipynb")))
    bad = 0
    for p in paths:
        t0 = time.perf_counter()
        nb = execute(p)
        text = nbformat.writes(nb) + "\n"
        big = [(i, n) for i, n in output_sizes(nb) if n > MAX_OUTPUT_BYTES]
        print(
            "%s: %.0f s, %.0f kB%s"
            % (
                os.path.basename(p),
                time.perf_counter() - t0,
                len(text) / 1e3,
                "" if not big else ", outputs over the limit: %s" % big,
            )
        )
        if len(text) > MAX_NOTEBOOK_BYTES or big:
            bad += 1
        if not a.check:
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
