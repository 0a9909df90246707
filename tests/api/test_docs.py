"""The docs name only what exists: every repository path written in
README.md, BENCHMARKS.md and docs/*.md (in `code` or a link) is a file or
directory of the repository (or of ../shared/ when written so), and every
option given to a `dclens COMMAND` in them is an option of that command's
parser (dclens.cli.parsers())."""

import glob
import os
import re
from pathlib import Path

import pytest

from conftest import ROOT

DOCS = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "BENCHMARKS.md")] + sorted(
    glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
TOP = (
    "engine/",
    "bindings/",
    "docs/",
    "scripts/",
    "tests/",
    "synth_tasks/",
    "notebooks/",
    "../shared/",
    "CMakeLists.txt",
    "CMakePresets.json",
    "Makefile",
    "pyproject.toml",
    "README.md",
    "BENCHMARKS.md",
)
# produced by a command, not kept in the repository
OUTPUTS = ("build/", "demo_out/", "synth_out/", "runs/", "engine/build/")


def _doc_paths(text):
    """Repository paths the text names: `code` spans and link targets."""
    found = set()
    for span in re.findall(r"`([^`\n]+)`", text) + re.findall(r"\]\(([^)\s#]+)", text):
        for tok in re.split(r"[\s,;()]+", span):
            tok = tok.strip("'\".:")
            if tok.startswith(("http", "$", "<", "-")) or any(c in tok for c in "*{}<>|=[]"):
                continue
            if tok.startswith(TOP) and not tok.startswith(OUTPUTS):
                found.add(tok)
    return found


def _resolve(doc, p):
    """p exists (a pytest id file.py::test_x: the file has that test)."""
    p, _, test = p.partition("::")
    here = os.path.dirname(doc)
    for base in (ROOT, here):
        f = os.path.normpath(os.path.join(base, p))
        if os.path.exists(f):
            return (
                not test
                or re.search(r"^def %s\b" % re.escape(test.split("[")[0]), Path(f).read_text(encoding="utf-8"), re.M)
                is not None
            )
    return False


@pytest.mark.parametrize("doc", DOCS, ids=[os.path.relpath(d, ROOT) for d in DOCS])
def test_every_path_the_docs_name_exists(doc):
    text = Path(doc).read_text(encoding="utf-8")
    shared = os.path.join(os.path.dirname(ROOT), "shared")
    missing = []
    for p in sorted(_doc_paths(text)):
        if p.startswith("../shared/") and not os.path.isdir(shared):
            continue  # the shared data are not on this machine
        if not _resolve(doc, p):
            missing.append(p)
    assert not missing, "%s names paths that do not exist: %s" % (os.path.relpath(doc, ROOT), missing)


def _command_uses(text):
    """(command, [options]) for each `dclens COMMAND ...` in the text, up to
    the end of its line or code span."""
    for m in re.finditer(r"(?<![\w./-])dclens (synth|heatmap|info|models|make-tiny|train)\b([^`\n]*)", text):
        rest = m.group(2).split("#")[0]  # a shell comment is not an option
        yield m.group(1), re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)


def test_every_option_the_docs_give_a_command_exists():
    from dclens import cli

    parsers = cli.parsers()
    known = {name: {s for a in p._actions for s in a.option_strings} for name, p in parsers.items()}
    bad = []
    for doc in DOCS:
        text = Path(doc).read_text(encoding="utf-8")
        for cmd, opts in _command_uses(text):
            for o in opts:
                if cmd in known and o not in known[cmd]:
                    bad.append("%s: dclens %s %s" % (os.path.relpath(doc, ROOT), cmd, o))
    assert not bad, bad


def test_the_checks_can_fail(tmp_path):
    """The two scanners see a wrong path and a wrong option."""
    assert "engine/src/nowhere.c" in _doc_paths("see `engine/src/nowhere.c` and [x](docs/api.md)")
    assert not _resolve(str(tmp_path / "x.md"), "engine/src/nowhere.c")
    assert not _resolve(str(tmp_path / "x.md"), "tests/api/test_docs.py::test_no_such_test")
    assert _resolve(str(tmp_path / "x.md"), "tests/api/test_docs.py::test_the_checks_can_fail")
    assert list(_command_uses("run `dclens train --out d --no-such-flag 3`")) == [
        ("train", ["--out", "--no-such-flag"])
    ]
