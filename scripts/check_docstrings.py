"""The public names of dclens, their docstrings, and the API reference pages of the site.

    python scripts/check_docstrings.py            # list public names without a docstring and
                                                  # docstrings not in numpy style; fail if
                                                  # docs/reference/ is out of date
    python scripts/check_docstrings.py --strict   # ... and fail on either too (make docs)
    python scripts/check_docstrings.py --write    # rewrite docs/reference/ from the package

Public: every name of `dclens.__all__`; each public module (the modules of
`dclens.__all__` and EXTRA_MODULES, documented in docs/*.md) with its own public names
(its `__all__`, or the functions and classes it defines whose names do not start with
"_"); the public methods and properties a public class defines. A docstring is missing
when the object has none of its own (an inherited one does not count, nor the
signature that dataclasses and named tuples write in place of one). Constants and type
aliases (patching.Metric) cannot carry a docstring at run time and are not checked.

Style (numpy, https://numpydoc.readthedocs.io/en/latest/format.html; style_problems says
exactly what is checked): sections are a known title over a line of dashes; a function
with parameters has a Parameters section naming each of them and no other; one that
returns a value has Returns (a generator Yields); the exceptions its body raises are named
in Raises. A class documents its constructor's parameters (Parameters, or Attributes for
a dataclass or named tuple). Names in ALLOWED_UNTIL_FIXED are reported without failing
--strict, until they are fixed and removed from it.

docs/reference/ has one page per public module and one for the top level; each page is
a mkdocstrings directive (`::: dclens.patching`) that the site build (`make docs`)
renders from the docstrings (numpy style). `make docs` runs this script first, --strict.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import importlib
import inspect
import os
import re
import sys
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF_DIR = os.path.join(ROOT, "docs", "reference")
# modules outside dclens.__all__ that docs/*.md present as API (dclens.X.name)
EXTRA_MODULES = ["distributed", "explorer", "heatmaps", "plots", "train", "viz.measures"]
# a public module whose names live in one of its submodules (dclens.analysis: the names of
# analysis.heads, looked up on first use, which the site's static reader does not follow)
DOC_HOME = {"analysis": "dclens.analysis.heads"}


def _home(m: str) -> str:
    """The module a page's directive reads: where dclens.<m>'s code is (dclens.graph: dclens.analysis.graph)."""
    return DOC_HOME.get(m) or importlib.import_module("dclens." + m).__name__


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def public_modules():
    import dclens

    mods = [n for n in dclens.__all__ if inspect.ismodule(getattr(dclens, n))]
    return sorted(set(mods) | set(EXTRA_MODULES))


def top_level_names():
    import dclens

    return [n for n in dclens.__all__ if not inspect.ismodule(getattr(dclens, n))]


def module_names(mod):
    """The public names a module defines (its __all__ when it has one)."""
    if hasattr(mod, "__all__"):
        return list(mod.__all__)
    out = []
    for name, obj in vars(mod).items():
        if name.startswith("_") or inspect.ismodule(obj):
            continue
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) != mod.__name__:
            continue  # imported from elsewhere
        if _typing_alias(obj) and (getattr(typing, name, None) is obj or not _assigned(mod, name)):
            continue  # typing.Dict, ... imported, not an alias the module defines
        if not (inspect.isclass(obj) or callable(obj)):
            continue  # a constant: no docstring of its own at run time
        out.append(name)
    return out


def _typing_alias(obj) -> bool:
    return type(obj).__module__ == "typing"


def _assigned(mod, name: str) -> bool:
    """`name = ...` at the top level of the module's source (a type alias it defines)."""
    try:
        src = inspect.getsource(mod)
    except (OSError, TypeError):
        return False
    return re.search(r"^%s\s*(:[^=]*)?=" % re.escape(name), src, re.M) is not None


def _own_doc(obj, name: str) -> str:
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    doc = (doc or "").strip()
    if inspect.isclass(obj) and re.match(r"^%s\(.*\)$" % re.escape(name), doc, re.S):
        return ""  # what @dataclass / NamedTuple write when the class has no docstring
    return doc


def walk():
    """Every public object, once: [(qualified name, object, kind)], kind one of "module",
    "class", "function", "method", "property" (the top level first, then each public module)."""
    import dclens

    out, seen = [], set()

    def visit(qual, obj, name):
        if inspect.ismodule(obj):
            out.append((qual, obj, "module"))
            return
        if _typing_alias(obj) or not (inspect.isclass(obj) or callable(obj)):
            return  # a type alias (patching.Metric) or a constant: no docstring of its own at run time
        if id(obj) in seen:
            return
        seen.add(id(obj))
        out.append((qual, obj, "class" if inspect.isclass(obj) else "function"))
        if inspect.isclass(obj):
            for mname, member in vars(obj).items():
                if mname.startswith("_"):
                    continue
                if inspect.isfunction(member) and "." not in member.__qualname__:
                    continue  # a module's function set as a method too (Cache's analyses): checked as the function
                if isinstance(member, property):
                    out.append(("%s.%s" % (qual, mname), member, "property"))
                elif isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
                    out.append(("%s.%s" % (qual, mname), member, "method"))

    for name in top_level_names():
        visit("dclens." + name, getattr(dclens, name), name)
    for m in public_modules():
        mod = importlib.import_module(_home(m))
        visit("dclens." + m, mod, m)
        for name in module_names(mod):
            visit("dclens.%s.%s" % (m, name), getattr(mod, name), name)
    return out


def _doc_of(qual: str, obj, kind: str) -> str:
    if kind == "class":
        return _own_doc(obj, qual.rsplit(".", 1)[1])
    fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    return (getattr(fn, "__doc__", None) or "").strip()


def missing_docstrings(objects=None):
    """[(qualified name, kind)] of the public names without a docstring of their own."""
    return [
        (qual, kind) for qual, obj, kind in (walk() if objects is None else objects) if not _doc_of(qual, obj, kind)
    ]


# ---------------------------------------------------------------- numpy style

# the sections of numpydoc (https://numpydoc.readthedocs.io/en/latest/format.html)
SECTIONS = (
    "Parameters",
    "Other Parameters",
    "Returns",
    "Yields",
    "Receives",
    "Raises",
    "Warns",
    "Warnings",
    "See Also",
    "Notes",
    "References",
    "Examples",
    "Attributes",
    "Methods",
)
_GOOGLE = re.compile(r"^\s*(Args|Arguments|Params|Parameters|Returns?|Raises|Yields?|Attributes|Examples?|Notes?):\s*$")
_DASHES = re.compile(r"^-{3,}$")

# Public names of files that other people are editing now, whose docstrings do not pass the
# style check yet: their problems are printed but do not fail --strict. Empty it as they are
# fixed (an entry whose name has no problem left fails --strict: the list only shrinks).
ALLOWED_UNTIL_FIXED: frozenset = frozenset()


def parse_sections(doc: str):
    """A numpy-style docstring's sections: ({title: [lines]}, [problems of form])."""
    lines = inspect.cleandoc(doc).splitlines()
    sections: dict = {}
    problems = []
    current = None
    i = 0
    while i < len(lines):
        line = lines[i]
        title = line.strip()
        under = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if title and _DASHES.match(under) and not _DASHES.match(title):
            if title not in SECTIONS:
                problems.append("unknown section %r (numpy's are: %s)" % (title, ", ".join(SECTIONS)))
            elif len(under) != len(title):
                problems.append("section %r: underline of %d dashes, not %d" % (title, len(under), len(title)))
            if line != title:
                problems.append("section %r is indented" % title)
            if title in sections:
                problems.append("section %r twice" % title)
            current = title
            sections[title] = []
            i += 2
            continue
        if _GOOGLE.match(line):
            problems.append("%r is a Google-style header: numpy style is the title over a line of dashes" % title)
        elif line == title and title in SECTIONS:
            problems.append("section %r without its underline of dashes" % title)
        if current is not None:
            sections[current].append(line)
        i += 1
    return sections, problems


def section_entries(lines):
    """The entries of a Parameters / Returns / Raises / Attributes section: [(entry line,
    has a description)]. An entry is a line at the section's least indentation; its
    description is the more indented lines under it."""
    body = [l for l in lines if l.strip()]
    if not body:
        return []
    base = min(len(l) - len(l.lstrip()) for l in body)
    out = []
    for l in body:
        if len(l) - len(l.lstrip()) == base:
            out.append([l.strip(), False])
        elif out:
            out[-1][1] = True
    return [(e, d) for e, d in out]


def _entry_names(entry: str):
    """'a, b : int' -> ['a', 'b']; '**kwargs' -> ['**kwargs']."""
    return [n.strip() for n in entry.split(" : ")[0].rstrip(":").split(",") if n.strip()]


def _signature_params(fn, skip_first: bool):
    """([parameters a docstring must name], {those it may name}) of fn's signature: the
    second holds the '*args' and '**kwargs' spellings and the private (_name) parameters."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None, set()
    if skip_first and params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    # may be documented, need not be: *args, **kwargs and private parameters (_groups)
    optional = {"*" + p.name for p in params if p.kind == p.VAR_POSITIONAL}
    optional |= {"**" + p.name for p in params if p.kind == p.VAR_KEYWORD}
    optional |= {n for n in named if n.startswith("_")}
    return [n for n in named if not n.startswith("_")], optional


class _Body(ast.NodeVisitor):
    """What a function's own body does (nested functions, lambdas and classes left out):
    returns a value, yields, and the exceptions it raises that no enclosing try catches."""

    def __init__(self, resolve):
        self.resolve = resolve
        self.returns = self.yields = False
        self.raises = []  # exception classes
        self.only_raises = False
        self._caught = []

    def visit_FunctionDef(self, node):  # a nested function: not this one's body
        pass

    visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = visit_FunctionDef

    def visit_Return(self, node):
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            self.returns = True

    def visit_Yield(self, node):
        self.yields = True

    visit_YieldFrom = visit_Yield

    def visit_Try(self, node):
        caught = []
        for h in node.handlers:
            types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
            for t in types:
                c = self.resolve(t) if t is not None else BaseException
                if c is not None:
                    caught.append(c)
        self._caught.append(tuple(caught))
        for n in node.body:
            self.visit(n)
        self._caught.pop()
        for n in node.handlers + node.orelse + node.finalbody:
            self.visit(n)

    visit_TryStar = visit_Try

    def visit_Raise(self, node):
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        c = self.resolve(exc) if exc is not None else None
        if c is None or not (inspect.isclass(c) and issubclass(c, BaseException)):
            return  # a re-raise, or an exception object made elsewhere
        if any(issubclass(c, k) for caught in self._caught for k in caught):
            return  # caught right here
        self.raises.append(c)


def _resolver(namespace):
    """A function from an AST name (a, a.b.c) to the object it names in `namespace` (or builtins)."""

    def resolve(node):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        obj = namespace.get(node.id, getattr(builtins, node.id, None))
        for p in reversed(parts):
            obj = getattr(obj, p, None)
        return obj

    return resolve


_TREES: dict = {}


def _function_node(fn):
    """The ast node of fn's definition, found in its file's tree by its first line (its
    first decorator's); None when it has no Python source."""
    try:
        path = inspect.getsourcefile(fn)
        first = fn.__code__.co_firstlineno
    except (TypeError, AttributeError):
        return None
    if not path:
        return None
    if path not in _TREES:
        try:
            _TREES[path] = ast.parse(_read(path))
        except (OSError, SyntaxError, UnicodeDecodeError):
            _TREES[path] = None
    if _TREES[path] is None:
        return None
    for node in ast.walk(_TREES[path]):
        defs = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if defs and min([node.lineno] + [d.lineno for d in node.decorator_list]) == first:
            return node
    return None


def _body(fn):
    """_Body of fn's source, or None when it has no Python source."""
    fn = inspect.unwrap(fn)
    node = _function_node(fn)
    if node is None:
        return None
    b = _Body(_resolver(getattr(fn, "__globals__", {})))
    for n in node.body:
        b.visit(n)
    stmts = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    b.only_raises = len(stmts) == 1 and isinstance(stmts[0], ast.Raise)
    return b


def _exception_named(name: str, namespace):
    """The exception class a Raises entry names ('Error', 'dclens.Error', 'ValueError'), or None."""
    import dclens

    last = name.strip("`").split(".")[-1]
    for ns in (namespace, vars(dclens), vars(builtins)):
        c = ns.get(last)
        if inspect.isclass(c) and issubclass(c, BaseException):
            return c
    return None


def _check_raises(sections, raised, namespace, problems):
    documented = []
    for entry, described in section_entries(sections.get("Raises", [])):
        for name in _entry_names(entry):
            c = _exception_named(name, namespace)
            if c is None:
                problems.append("Raises names %r, which is no exception class" % name)
            else:
                documented.append(c)
            if not described:
                problems.append("Raises: %r says nothing about when" % name)
    for c in dict.fromkeys(raised):
        if not any(issubclass(c, d) for d in documented):
            problems.append("raises %s, which its Raises section does not name" % c.__name__)


def _check_parameters(sections, named, var, problems, free_names=False):
    """named: the signature's parameters that must be documented; var: those that may be
    (*args, **kwargs, private ones)."""
    entries = section_entries(sections.get("Parameters", [])) + section_entries(sections.get("Other Parameters", []))
    documented = []
    for entry, described in entries:
        for name in _entry_names(entry):
            documented.append(name)
            if not described and " : " not in entry:
                problems.append("parameter %r has neither a type nor a description" % name)
            if name not in named and name not in var and not free_names:
                problems.append("documents parameter %r, which is not in the signature" % name)
    if free_names:
        documented += [n for e, _ in section_entries(sections.get("Attributes", [])) for n in _entry_names(e)]
    undocumented = [n for n in named if n not in documented]
    if not undocumented:
        return
    if free_names:
        problems.append("fields not documented (in Attributes or Parameters): %s" % ", ".join(undocumented))
    elif "Parameters" in sections:
        problems.append("parameters not documented: %s" % ", ".join(undocumented))
    else:
        problems.append("no Parameters section (for %s)" % ", ".join(undocumented))


def style_problems(qual: str, obj, kind: str):
    """What is wrong with the numpy style of a public object's docstring ([] when nothing is).

    - a section is a known numpy title over a line of as many dashes (no Google-style `Args:`);
    - a function or method with parameters (self, cls, *args, **kwargs aside) has a Parameters
      section naming each, each with a type or a description, and names no parameter it does not have;
      a class documents its constructor's parameters (its own __init__, or a dataclass's or
      named tuple's fields) in Parameters or Attributes;
    - one that returns a value has a Returns section (a generator: Yields), and one that
      returns nothing has none;
    - an exception its body raises (and does not catch) is named in Raises, or a base class of
      it is; every name in Raises is an exception class.
    """
    doc = _doc_of(qual, obj, kind)
    if not doc or kind == "module":
        return []
    sections, problems = parse_sections(doc)
    if kind == "property":
        if "Parameters" in sections:
            problems.append("a property has no parameters")
        return problems
    if kind == "class":
        namespace = vars(sys.modules.get(obj.__module__, builtins))
        record = dataclasses.is_dataclass(obj) or hasattr(obj, "_fields")
        if "__init__" in vars(obj) or record:
            init = obj if record else vars(obj)["__init__"]
            named, var = _signature_params(init, skip_first=not record)
            if named is not None:
                _check_parameters(sections, named, var, problems, free_names=record)
        elif "Parameters" in sections:
            problems.append("documents Parameters, but the class has no constructor of its own")
        raised = []
        for special in ("__init__", "__post_init__"):
            if inspect.isfunction(vars(obj).get(special)):
                b = _body(vars(obj)[special])
                raised += b.raises if b else []
        _check_raises(sections, raised, namespace, problems)
        for s in ("Returns", "Yields"):
            if s in sections:
                problems.append("a class has no %s section (its methods do)" % s)
        return problems
    fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    named, var = _signature_params(fn, skip_first=kind == "method" and not isinstance(obj, staticmethod))
    if named is not None:
        _check_parameters(sections, named, var, problems)
    b = _body(fn)
    if b is not None:
        if b.yields and "Yields" not in sections:
            problems.append("a generator without a Yields section")
        elif b.returns and not b.yields and "Returns" not in sections:
            problems.append("returns a value but has no Returns section")
        elif not b.returns and not b.yields and not b.only_raises and "Returns" in sections:
            problems.append("has a Returns section but returns nothing")
        for s in ("Returns", "Yields"):
            if s in sections and not section_entries(sections[s]):
                problems.append("an empty %s section" % s)
        _check_raises(sections, b.raises, getattr(inspect.unwrap(fn), "__globals__", {}), problems)
    return problems


def style_report(objects=None):
    """[(qualified name, problem)] of every public object's docstring (missing ones aside)."""
    return [
        (qual, p)
        for qual, obj, kind in (walk() if objects is None else objects)
        for p in style_problems(qual, obj, kind)
    ]


# ---------------------------------------------------------------- the reference pages


def _summary(mod) -> str:
    doc = (mod.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split())


def pages():
    """{file name in docs/reference/: its text}."""
    import dclens

    head = "<!-- written by scripts/check_docstrings.py --write: edit the docstrings, not this page -->\n"
    out = {}
    names = top_level_names()
    out["dclens.md"] = (
        head
        + "# `dclens`\n\nThe names of `dclens.__all__` (the modules among them have their own pages).\n\n"
        + "::: dclens\n    options:\n      show_root_heading: false\n      members:\n"
        + "".join("        - %s\n" % n for n in names)
    )
    index = [
        head,
        "# API reference\n\n",
        "Generated from the package's docstrings (numpy style) by mkdocstrings: the top level "
        "[`dclens`](dclens.md) (`dclens.__all__`) and each public module. "
        "`python scripts/check_docstrings.py` lists the public names that have no docstring yet.\n\n",
        "| module | what it is |\n|---|---|\n",
        "| [`dclens`](dclens.md) | %s |\n" % _summary(dclens).replace("|", "\\|"),
    ]
    for m in public_modules():
        mod = importlib.import_module(_home(m))
        index.append("| [`dclens.%s`](%s.md) | %s |\n" % (m, m, _summary(mod).replace("|", "\\|")))
        members = module_names(mod)
        opts = "    options:\n      members:\n" + "".join("        - %s\n" % n for n in members) if members else ""
        where = "" if _home(m) == "dclens." + m else "In `%s`.\n\n" % _home(m)
        out["%s.md" % m] = head + "# `dclens.%s`\n\n%s::: %s\n%s" % (m, where, _home(m), opts)
    out["index.md"] = "".join(index)
    return out


def nav_lines():
    return ["      - reference/index.md\n", "      - dclens: reference/dclens.md\n"] + [
        "      - dclens.%s: reference/%s.md\n" % (m, m) for m in public_modules()
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite docs/reference/ from the package")
    ap.add_argument(
        "--strict", action="store_true", help="exit 1 when a public name has no docstring or one not in numpy style"
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(ROOT, "bindings"))
    want = pages()
    if args.write:
        os.makedirs(REF_DIR, exist_ok=True)
        for f in os.listdir(REF_DIR):
            if f.endswith(".md") and f not in want:
                os.remove(os.path.join(REF_DIR, f))
        for f, text in want.items():
            with open(os.path.join(REF_DIR, f), "w", encoding="utf-8") as fh:
                fh.write(text)
        print("check_docstrings: wrote %d pages in docs/reference/; mkdocs.yml's nav lists them as:" % len(want))
        print("".join(nav_lines()), end="")
    rc = 0
    have = {f for f in os.listdir(REF_DIR) if f.endswith(".md")} if os.path.isdir(REF_DIR) else set()
    stale = sorted(
        f for f in set(want) | have if f not in want or f not in have or _read(os.path.join(REF_DIR, f)) != want[f]
    )
    if stale:
        print(
            "check_docstrings: docs/reference/ is out of date with the package (%s): "
            "run python scripts/check_docstrings.py --write (and list new pages in mkdocs.yml's nav)" % ", ".join(stale)
        )
        rc = 1
    objects = walk()
    missing = missing_docstrings(objects)
    print("check_docstrings: %d public names without a docstring" % len(missing) + (":" if missing else ""))
    for qual, kind in missing:
        print("  %-9s %s" % (kind, qual))
    style = style_report(objects)
    failing = [(q, p) for q, p in style if q not in ALLOWED_UNTIL_FIXED]
    allowed = [(q, p) for q, p in style if q in ALLOWED_UNTIL_FIXED]
    print("check_docstrings: %d problems of numpy style" % len(failing) + (":" if failing else ""))
    for qual, problem in failing:
        print("  %s: %s" % (qual, problem))
    if allowed:
        print("check_docstrings: %d more in ALLOWED_UNTIL_FIXED (not failing --strict):" % len(allowed))
        for qual, problem in allowed:
            print("  %s: %s" % (qual, problem))
    fixed = sorted(ALLOWED_UNTIL_FIXED - {q for q, _ in allowed})
    if fixed:
        print("check_docstrings: ALLOWED_UNTIL_FIXED names that pass now (remove them): %s" % ", ".join(fixed))
    if args.strict and (missing or failing or fixed):
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
