"""The docs name only what exists: every repository path written in
README.md, BENCHMARKS.md and docs/*.md (in `code` or a link) is a file or
directory of the repository (or of ../shared/ when written so), and every
option given to a `dclens COMMAND` in them is an option of that command's
parser (dclens.cli.parsers()); and every public name has a numpy-style docstring
(scripts/check_docstrings.py --strict, what `make docs` runs), a checker shown to fail
on each kind of docstring it refuses."""

import glob
import os
import re
import sys
from pathlib import Path

import numpy as np
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


# ---------------------------------------------------------------- docstrings (scripts/check_docstrings.py)


@pytest.fixture(scope="module")
def checker():
    """scripts/check_docstrings.py as a module."""
    import importlib

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        return importlib.import_module("check_docstrings")
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))


def test_every_public_name_has_a_numpy_docstring(checker, capsys):
    """What `make docs` runs first: every public name has a docstring in numpy style (its
    parameters, returns and raises) and docs/reference/ matches the package."""
    rc = checker.main(["--strict"])
    out = capsys.readouterr().out
    assert rc == 0, out


# a module with one docstring of each kind the checker refuses, and one it accepts
FAKE = '''
"""A module for the checker."""
import dataclasses


class FakeError(Exception):
    """An error."""


def no_doc(a):
    return a


def good(a, b=1, *args, _private=None, **kw):
    """Add.

    Parameters
    ----------
    a : int
        The first.
    b : int
        The second.

    Returns
    -------
    int
        a + b.

    Raises
    ------
    FakeError
        a is negative.
    """
    if a < 0:
        raise FakeError("negative")
    return a + b


def undocumented_parameter(a, b):
    """Add.

    Parameters
    ----------
    a : int
        The first.

    Returns
    -------
    int
        a + b.
    """
    return a + b


def phantom_parameter(a):
    """Nothing.

    Parameters
    ----------
    a : int
        A number.
    c : int
        Not in the signature.
    """


def no_returns(a):
    """Twice a.

    Parameters
    ----------
    a : int
        A number.
    """
    return 2 * a


def returns_nothing(a):
    """Nothing.

    Parameters
    ----------
    a : int
        A number.

    Returns
    -------
    int
        Said, not done.
    """
    print(a)


def unnamed_raise(a):
    """Check.

    Parameters
    ----------
    a : int
        A number.
    """
    if a:
        raise ValueError("a")
    try:
        raise KeyError("caught here, so not raised")
    except KeyError:
        pass


def not_an_exception():
    """Nothing.

    Raises
    ------
    NoSuchError
        Never.
    """


def google_style(a):
    """Google.

    Args:
        a: a number.
    """


def bad_underline(a):
    """Short dashes.

    Parameters
    ------
    a : int
        A number.
    """


def generator(n):
    """Counts.

    Parameters
    ----------
    n : int
        How far.
    """
    yield from range(n)


def bare_parameter(a):
    """A bare name.

    Parameters
    ----------
    a
    """


@dataclasses.dataclass
class Record:
    """A record with a field it does not describe.

    Attributes
    ----------
    x : int
        Described.
    """

    x: int
    y: int


class Thing:
    """A class whose constructor's parameter is not described."""

    def __init__(self, size):
        self.size = size

    def method(self, k):
        """A method.

        Parameters
        ----------
        k : int
            Its one parameter (self is not one).
        """
'''


def _fake(tmp_path, checker):
    import importlib.util

    path = tmp_path / "fake_docstrings.py"
    path.write_text(FAKE)
    spec = importlib.util.spec_from_file_location("fake_docstrings", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    objs = [("fake." + n, getattr(mod, n), "function") for n in dir(mod) if callable(getattr(mod, n))]
    objs = [(q, o, "class" if isinstance(o, type) else k) for q, o, k in objs if not q.endswith("dataclasses")]
    objs.append(("fake.Thing.method", vars(mod.Thing)["method"], "method"))
    return objs


def test_the_docstring_checker_can_fail(tmp_path, checker, monkeypatch, capsys):
    objs = _fake(tmp_path, checker)
    assert checker.missing_docstrings(objs) == [("fake.no_doc", "function")]
    report = {}
    for qual, problem in checker.style_report(objs):
        report.setdefault(qual.split(".", 1)[1], []).append(problem)
    assert "good" not in report and "FakeError" not in report and "Thing.method" not in report, report
    expect = {
        "undocumented_parameter": "parameters not documented: b",
        "phantom_parameter": "documents parameter 'c', which is not in the signature",
        "no_returns": "returns a value but has no Returns section",
        "returns_nothing": "has a Returns section but returns nothing",
        "unnamed_raise": "raises ValueError, which its Raises section does not name",
        "not_an_exception": "Raises names 'NoSuchError', which is no exception class",
        "google_style": "'Args:' is a Google-style header: numpy style is the title over a line of dashes",
        "bad_underline": "section 'Parameters': underline of 6 dashes, not 10",
        "generator": "a generator without a Yields section",
        "bare_parameter": "parameter 'a' has neither a type nor a description",
        "Record": "fields not documented (in Attributes or Parameters): y",
        "Thing": "no Parameters section (for size)",
    }
    for name, problem in expect.items():
        assert problem in report.get(name, []), (name, report.get(name))
    assert report["unnamed_raise"] == [expect["unnamed_raise"]]  # the KeyError caught where it is raised is not
    assert set(report) == set(expect), set(report) ^ set(expect)

    # the command: --strict fails on them, without it they are listed only
    monkeypatch.setattr(checker, "walk", lambda: objs)
    assert checker.main(["--strict"]) == 1
    out = capsys.readouterr().out
    assert "fake.no_doc" in out and "fake.undocumented_parameter: parameters not documented: b" in out
    assert checker.main([]) == 0
    capsys.readouterr()
    # names allowed until fixed do not fail --strict; an allowed name that passes does
    bad = {q for q, _ in checker.style_report(objs)}
    clean = [o for o in objs if o[0] != "fake.no_doc"]
    monkeypatch.setattr(checker, "walk", lambda: clean)
    monkeypatch.setattr(checker, "ALLOWED_UNTIL_FIXED", frozenset(bad))
    assert checker.main(["--strict"]) == 0, capsys.readouterr().out
    monkeypatch.setattr(checker, "ALLOWED_UNTIL_FIXED", frozenset(bad | {"fake.good"}))
    assert checker.main(["--strict"]) == 1
    assert "pass now (remove them): fake.good" in capsys.readouterr().out


# ---------------------------------------------------------------- the hook reference


def _gen_hook_reference():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gen_hook_reference

    return gen_hook_reference


def test_hook_reference_is_the_engines_table(capsys):
    """docs/hooks.md is what scripts/gen_hook_reference.py writes from the engine's table of
    points (hooks.c): a point added, renamed or moved in C without the page fails here."""
    gen = _gen_hook_reference()
    assert gen.main(["--check"]) == 0, capsys.readouterr().out
    import dclens

    text = Path(gen.OUT).read_text()
    model = dclens.load("dcpythia-tiny")
    points = {n.split(".", 2)[2] if n.startswith("blocks.") else n for n in model.hook_names}
    missing = [n for n in points if "| `%s` |" % n not in text]
    assert not missing, missing
    assert text.count("\n| `") == len(gen.rows())


def _c_function_body(path, name):
    src = Path(path).read_text()
    m = re.search(r"^[\w \*]*\b%s\([^;{]*\)\s*\{" % re.escape(name), src, re.M)
    assert m, "%s: no definition of %s" % (path, name)
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        i += 1
    return src[m.end() : i]


def test_each_point_is_computed_where_the_table_says():
    """The table's "computed in" names a function of engine/src/model that names the point:
    its enum, or the table of pass.c it fires the point from (branches, dynamic weights,
    split inputs), whose row holds the enum."""
    from dclens._engine import ffi, lib

    pass_c = Path(ROOT, "engine", "src", "model", "pass.c").read_text()
    tables = {}
    for t in ("dcs_branch_points", "dcs_dyn_points", "dcs_split_points"):
        m = re.search(r"const int %s\[[^=]*=\s*(\{.*?\});" % t, pass_c, re.S)
        assert m, t
        tables[t] = set(re.findall(r"DCS_HP_\w+", m.group(1)))
    enum = Path(ROOT, "engine", "include", "dclens.h").read_text()
    names = re.findall(r"^\s*(DCS_HP_\w+)\b", enum[enum.index("DCS_HP_EMBED = 0") :], re.M)
    bad = []
    for p in range(lib.DCS_HP_COUNT):
        where = ffi.string(lib.dcs_hook_point_source(p)).decode()
        file, fn = where.split()
        body = _c_function_body(os.path.join(ROOT, "engine", "src", "model", file), fn)
        e = names[p]
        if e not in body and not any(t in body and e in pts for t, pts in tables.items()):
            bad.append("%s: %s names neither %s nor a table holding it" % (e, where, e))
    assert not bad, bad


def test_readme_tour_runs(tmp_path, monkeypatch):
    """The README's tour is code a reader pastes: it runs as printed, on the bundled models, and
    writes the two files it names."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"## A tour of the API\n\n```python\n(.*?)```", text, re.S)
    assert m, "README.md has no '## A tour of the API' python block"
    code = m.group(1)
    assert len(code.splitlines()) <= 25, "the tour is a short tour"
    monkeypatch.chdir(tmp_path)
    env: dict = {}
    exec(compile(code, "README.md tour", "exec"), env)
    assert (tmp_path / "layer3.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "explorer.html").stat().st_size > 1000
    top = env["s"].top(5)
    assert len(top) == 5 and all(np.isfinite(score) for _, score in top)
