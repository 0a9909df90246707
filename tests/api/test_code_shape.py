"""No function of the package or the engine is longer than 150 code lines
(docstrings, comments and blank lines not counted): issue 49's bound, so that a
body that grows past it is split into named steps (graph.attribute_edges: prepare,
read, gradients, score)."""

from __future__ import annotations

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 150


def python_lengths(src: str) -> dict[str, int]:
    lines = src.splitlines()
    out = {}
    for n in ast.walk(ast.parse(src)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = n.body
            start = body[0].lineno
            if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0].value, "value", None), str):
                start = body[0].end_lineno + 1
            code = [ln for ln in lines[start - 1 : n.end_lineno] if ln.strip() and not ln.strip().startswith("#")]
            out["%s:%d" % (n.name, n.lineno)] = len(code)
    return out


def c_lengths(src: str) -> dict[str, int]:
    lines = src.splitlines()
    out, i = {}, 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"^[A-Za-z].*\)\s*\{\s*$", line) and not line.startswith(("typedef", "struct", "static const")):
            depth, j, n = 0, i, 0
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                s = lines[j].strip()
                if s and not s.startswith(("//", "/*", "*")):
                    n += 1
                if depth == 0 and j > i:
                    break
                j += 1
            out["%s:%d" % (line.split("(")[0].split()[-1].lstrip("*"), i + 1)] = n
            i = j
        i += 1
    return out


def test_no_function_over_150_code_lines():
    long = []
    for f in glob.glob(os.path.join(ROOT, "bindings", "dclens", "**", "*.py"), recursive=True):
        with open(f, encoding="utf-8") as fh:
            long += [
                "%s %s: %d" % (os.path.relpath(f, ROOT), k, v)
                for k, v in python_lengths(fh.read()).items()
                if v > LIMIT
            ]
    for f in glob.glob(os.path.join(ROOT, "engine", "src", "**", "*.c*"), recursive=True):
        with open(f, encoding="utf-8") as fh:
            long += [
                "%s %s: %d" % (os.path.relpath(f, ROOT), k, v) for k, v in c_lengths(fh.read()).items() if v > LIMIT
            ]
    assert not long, "functions over %d code lines: %s" % (LIMIT, long)


def test_the_length_rule_can_fail():
    body = "".join("    x%d = %d\n" % (i, i) for i in range(LIMIT + 1))
    assert python_lengths('def f():\n    """doc"""\n' + body) == {"f:1": LIMIT + 1}
    c = "int f(void) {\n" + "".join("  int x%d = %d;\n" % (i, i) for i in range(LIMIT)) + "}\n"
    assert c_lengths(c) == {"f:1": LIMIT + 2}
