"""The import graph of bindings/dclens and synth_tasks has no cycle, and
the core package never imports synth_tasks (synth_tasks depends on
dclens, not the reverse; `dclens synth` is found through the
dclens.commands entry point group).

Read from the source with ast, so every import counts: module level,
inside functions and under `if TYPE_CHECKING:` alike (an import made only
for type checking still says which module depends on which). Importing a
submodule is an edge to that submodule, not to its parent package."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = {"dclens": os.path.join(ROOT, "bindings", "dclens"), "synth_tasks": os.path.join(ROOT, "synth_tasks")}


def _modules() -> dict[str, str]:
    """module name -> file, for every .py file of the two packages."""
    out = {}
    for pkg, top in PACKAGES.items():
        for d, dirs, files in os.walk(top):
            dirs[:] = [x for x in dirs if x != "__pycache__" and os.path.exists(os.path.join(d, x, "__init__.py"))]
            rel = os.path.relpath(d, top)
            parts = [pkg] + ([] if rel == "." else rel.split(os.sep))
            for f in files:
                if f.endswith(".py"):
                    name = ".".join(parts if f == "__init__.py" else parts + [f[:-3]])
                    out[name] = os.path.join(d, f)
    return out


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, wherever it is."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module
                # `from pkg import sub` imports the submodule pkg.sub
                targets = [src + "." + a.name if src + "." + a.name in mods else src for a in node.names]
            for t in targets:
                if t.split(".")[0] not in PACKAGES:
                    continue
                if t not in mods:  # a compiled module (dclens._engine): imports nothing of ours
                    graph.setdefault(t, set())
                if t != mod:
                    graph[mod].add(t)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the DFS path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state:
                c = visit(n)
                if c:
                    return c
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            c = visit(m)
            if c:
                return c
    return None


def test_graph_sees_the_packages():
    g = _graph()
    assert "dclens.model" in g and "synth_tasks.cli" in g and "dclens.testing.make_tiny" in g
    # it sees imports inside functions too
    assert "dclens" in g["synth_tasks.cli"]
    assert "dclens.routing" in g["dclens.patching"]  # from a function body


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# the analyses Model offers as methods (model.gradients, model.flows, ...):
# Model imports them, so they sit below it and import neither Model nor an
# analysis built on it
OFFERED = ["routing", "grad", "attribution", "generate", "memplan"]
# the analyses built on Model (they may import it)
ABOVE = [
    "circuits",
    "patching",
    "analysis",
    "interventions",
    "heatmaps",
    "plots",
    "explorer",
    "prompting",
    "graph",
    "distributed",
    "distributed.workers",
]


def test_layers_import_downwards():
    """The package's layers, bottom up (runner.py's docstring):
    the binding, checks, names, mask; the plumbing (hooks, cache, memplan,
    tapes, runner), which imports neither Model nor an analysis; the analyses Model
    offers as methods, which import no Model; Model (batch, weights, model),
    which imports those and no other analysis; the analyses built on Model."""
    g = _graph()
    offered = {"dclens." + a for a in OFFERED}
    above = {"dclens." + a for a in ABOVE if "dclens." + a in g}
    model_layer = {"dclens.model", "dclens.batch", "dclens.weights"}
    below = {"dclens.runner", "dclens.hooks", "dclens.cache", "dclens.tapes", "dclens._protocols", "dclens.mask"}
    for m in below:
        bad = g[m] & ((offered - {"dclens.memplan"}) | above | model_layer)  # tapes plans its memory (memplan)
        assert not bad, "%s imports %s" % (m, sorted(bad))
    assert not g["dclens.mask"], sorted(g["dclens.mask"])  # numpy only
    for m in offered:
        bad = g[m] & (above | model_layer)
        assert not bad, "%s imports %s" % (m, sorted(bad))
    for m in model_layer:
        assert not g[m] & above, (m, sorted(g[m] & above))
    assert offered <= g["dclens.model"]  # Model calls its analyses directly


def _model_private_members() -> set[str]:
    """The _names Model defines (methods, properties, attributes it sets on self)."""
    with open(os.path.join(PACKAGES["dclens"], "model.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")
    out = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            out.add(node.attr)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def test_no_module_reaches_into_models_private_members():
    """Only model.py touches Model's _members; the other modules (the new ones
    included) go through model.runner and the public API."""
    private = _model_private_members()
    assert {"_m", "_ctx_hooks", "_ref"} <= private  # the reader sees them
    bad = []
    for mod, path in _modules().items():
        if mod.split(".")[0] != "dclens" or mod == "dclens.model":
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                bad.append("%s:%d .%s" % (mod, node.lineno, node.attr))
    assert not bad, bad


def test_dclens_does_not_import_synth_tasks():
    bad = sorted(
        (m, t)
        for m, ts in _graph().items()
        if m.split(".")[0] == "dclens"
        for t in ts
        if t.split(".")[0] == "synth_tasks"
    )
    assert not bad, "dclens imports synth_tasks: %s" % bad


def test_cycle_finder_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize(
    "src,expect",
    [
        ("from .model import Error", {"dclens.model"}),
        ("def f():\n    from . import routing", {"dclens.routing"}),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .model import Model", {"dclens.model"}),
    ],
)
def test_import_reader(src, expect, tmp_path, monkeypatch):
    pkg = tmp_path / "dclens"
    pkg.mkdir()
    for n in ("__init__", "model", "routing", "x"):
        (pkg / (n + ".py")).write_text("")
    (pkg / "x.py").write_text(src)
    monkeypatch.setitem(PACKAGES, "dclens", str(pkg))
    monkeypatch.setitem(PACKAGES, "synth_tasks", str(tmp_path / "none"))
    assert _graph()["dclens.x"] == expect


# the engine boundary: the one module that imports the compiled binding, and the
# three that call it (every call on a loaded model is a Runner method)
BINDING = "dclens._binding"
ENGINE_USERS = {"dclens.runner", "dclens.tapes", "dclens.heatmaps"}


def test_one_engine_boundary():
    """Only _binding imports dclens._engine; only runner (loaded models and the model-free
    queries), tapes (gradient tapes) and heatmaps (the renderer) import _binding, plus the
    package's __init__, which imports it first so that a missing BLAS is a dclens.Error."""
    g = _graph()
    importers = {m for m, ts in g.items() if "dclens._engine" in ts}
    assert importers == {BINDING}, "modules importing dclens._engine: %s" % sorted(importers)
    users = {m for m, ts in g.items() if BINDING in ts} - {"dclens"}
    assert users <= ENGINE_USERS, "modules calling the engine outside the boundary: %s" % sorted(users - ENGINE_USERS)
    assert ENGINE_USERS <= users  # the rule names modules that exist and use it


def test_the_boundary_rule_can_fail(tmp_path, monkeypatch):
    pkg = tmp_path / "dclens"
    pkg.mkdir()
    for n in ("__init__", "_binding", "runner", "tapes", "heatmaps"):
        (pkg / (n + ".py")).write_text(
            "from ._binding import lib\n" if n != "_binding" else "from ._engine import lib\n"
        )
    (pkg / "graph.py").write_text("def f():\n    from ._engine import lib\n")
    monkeypatch.setitem(PACKAGES, "dclens", str(pkg))
    monkeypatch.setitem(PACKAGES, "synth_tasks", str(tmp_path / "none"))
    with pytest.raises(AssertionError, match="dclens.graph"):
        test_one_engine_boundary()
