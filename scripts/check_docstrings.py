"""The public names of dclens, their docstrings, and the API reference pages of the site.

    python scripts/check_docstrings.py            # list public names without a docstring;
                                                  # fail if docs/reference/ is out of date
    python scripts/check_docstrings.py --strict   # ... and fail on a missing docstring too
    python scripts/check_docstrings.py --write    # rewrite docs/reference/ from the package

Public: every name of `dclens.__all__`; each public module (the modules of
`dclens.__all__` and EXTRA_MODULES, documented in docs/*.md) with its own public names
(its `__all__`, or the functions and classes it defines whose names do not start with
"_"); the public methods and properties a public class defines. A docstring is missing
when the object has none of its own (an inherited one does not count, nor the
signature that dataclasses and named tuples write in place of one). Constants and type
aliases (patching.Metric) cannot carry a docstring at run time and are not checked.

docs/reference/ has one page per public module and one for the top level; each page is
a mkdocstrings directive (`::: dclens.patching`) that the site build (`make docs`)
renders from the docstrings (numpy style). `make docs` runs this script first.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF_DIR = os.path.join(ROOT, "docs", "reference")
# modules outside dclens.__all__ that docs/*.md present as API (dclens.X.name)
EXTRA_MODULES = ["distributed", "explorer", "heatmaps", "plots", "train"]


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


def missing_docstrings():
    """[(qualified name, kind)] of the public names without a docstring of their own."""
    import dclens

    missing, seen = [], set()

    def check(qual, obj, name):
        if inspect.ismodule(obj):
            if not (obj.__doc__ or "").strip():
                missing.append((qual, "module"))
            return
        if _typing_alias(obj) or not (inspect.isclass(obj) or callable(obj)):
            return  # a type alias (patching.Metric) or a constant: no docstring of its own at run time
        key = id(obj)
        if key in seen:
            return
        seen.add(key)
        if not _own_doc(obj, name):
            missing.append((qual, "class" if inspect.isclass(obj) else "function"))
        if inspect.isclass(obj):
            for mname, member in vars(obj).items():
                if mname.startswith("_"):
                    continue
                if isinstance(member, property):
                    if not (member.__doc__ or "").strip():
                        missing.append(("%s.%s" % (qual, mname), "property"))
                elif isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
                    fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                    if not (fn.__doc__ or "").strip():
                        missing.append(("%s.%s" % (qual, mname), "method"))

    for name in top_level_names():
        check("dclens." + name, getattr(dclens, name), name)
    for m in public_modules():
        mod = importlib.import_module("dclens." + m)
        check("dclens." + m, mod, m)
        for name in module_names(mod):
            check("dclens.%s.%s" % (m, name), getattr(mod, name), name)
    return missing


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
        mod = importlib.import_module("dclens." + m)
        index.append("| [`dclens.%s`](%s.md) | %s |\n" % (m, m, _summary(mod).replace("|", "\\|")))
        members = module_names(mod)
        opts = "    options:\n      members:\n" + "".join("        - %s\n" % n for n in members) if members else ""
        out["%s.md" % m] = head + "# `dclens.%s`\n\n::: dclens.%s\n%s" % (m, m, opts)
    out["index.md"] = "".join(index)
    return out


def nav_lines():
    return ["      - reference/index.md\n", "      - dclens: reference/dclens.md\n"] + [
        "      - dclens.%s: reference/%s.md\n" % (m, m) for m in public_modules()
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite docs/reference/ from the package")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a public name has no docstring")
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
    missing = missing_docstrings()
    print("check_docstrings: %d public names without a docstring" % len(missing) + (":" if missing else ""))
    for qual, kind in missing:
        print("  %-9s %s" % (kind, qual))
    if missing and args.strict:
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
