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
import subprocess
import sys

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
    assert "dclens" in g["synth_tasks.cli"]
    assert "dclens.analysis.routing" in g["dclens.analysis.patching"]
    assert "dclens._core.runner" in g["dclens.model"]


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The package's layers, bottom up (dclens/__init__.py, docs/architecture.md). A
# module belongs to the layer of the longest prefix that names it, and imports
# only modules of its own layer or a lower one: the core never imports Model or
# an analysis; the analyses Model offers as methods (model.gradients,
# model.flows, model.generate, ...) import neither Model nor an analysis built
# on it; the figures import no analysis, so that an analysis's .plot() may draw
# with them; the explorer is built on the analyses; nothing imports the command line.
LAYERS = [
    ("the engine binding and the plumbing", ["dclens._engine", "dclens._cdef", "dclens._core"]),
    ("generated checkpoints for tests", ["dclens.testing"]),
    (
        "the cache and the analyses Model offers as methods",
        [
            "dclens.cache",
            "dclens.analysis.grad",
            "dclens.analysis.attribution",
            "dclens.analysis.routing",
            "dclens.analysis.generate",
        ],
    ),
    ("Model", ["dclens.model"]),
    ("sparse dictionaries on Model's hooks", ["dclens.features"]),
    ("processes (Ray)", ["dclens.distributed"]),
    (
        "figures: matplotlib from arrays, the engine's PNG renders",
        ["dclens.viz.plots", "dclens.viz.measures", "dclens.viz.heatmaps"],
    ),
    ("the analyses built on Model", ["dclens.analysis"]),
    ("the explorer", ["dclens.viz"]),
    ("training", ["dclens.train"]),
    ("the package's names and its command line", ["dclens", "dclens.__main__", "dclens.cli"]),
]


def _layer_of(mod: str, layers=None) -> int:
    """The index in LAYERS of the longest prefix naming mod (-1: none)."""
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(layers or LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def _upward_imports(graph, layers=None) -> list[str]:
    bad = []
    for m, ts in sorted(graph.items()):
        if m.split(".")[0] != "dclens":
            continue
        for t in sorted(ts):
            if t.split(".")[0] == "dclens" and _layer_of(t, layers) > _layer_of(m, layers):
                bad.append(
                    "%s (%s) imports %s (%s)"
                    % (m, (layers or LAYERS)[_layer_of(m, layers)][0], t, (layers or LAYERS)[_layer_of(t, layers)][0])
                )
    return bad


def test_every_module_has_a_layer():
    missing = [m for m in _graph() if m.split(".")[0] == "dclens" and _layer_of(m) < 0]
    assert not missing, "modules in no layer of LAYERS: %s" % missing
    assert _layer_of("dclens.analysis.grad") < _layer_of("dclens.model") < _layer_of("dclens.analysis.graph")


def test_layers_import_downwards():
    bad = _upward_imports(_graph())
    assert not bad, "imports against the layers:\n" + "\n".join(bad)
    g = _graph()
    offered = {"dclens.analysis." + a for a in ("grad", "attribution", "routing", "generate")}
    assert offered <= g["dclens.model"]  # Model calls its analyses directly


def test_the_layer_rule_can_fail():
    layers = [("low", ["dclens.a"]), ("high", ["dclens.b"])]
    assert _upward_imports({"dclens.a": {"dclens.b"}, "dclens.b": set()}, layers) == [
        "dclens.a (low) imports dclens.b (high)"
    ]
    assert _upward_imports({"dclens.b": {"dclens.a"}, "dclens.a": set()}, layers) == []


# A function-level import hides an edge of the graph. Allowed only for another
# package (an optional dependency, or a heavy library kept out of `import
# dclens`, which test_import_is_light checks), for dclens.viz.plots (it loads
# matplotlib) and for dclens._engine (loaded after its BLAS, its failure turned
# into a dclens.Error); each says why in a comment on its first line.
LAZY_DCLENS = {"dclens.viz.plots", "dclens._engine"}


def _function_level_imports(mods=None) -> list[str]:
    bad = []
    for mod, path in sorted((mods or _modules()).items()):
        if mod.split(".")[0] != "dclens":
            continue
        is_pkg = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as f:
            src = f.read()
        lines = src.splitlines()
        tree = ast.parse(src, path)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    targets = [".".join(base + ([node.module] if node.module else []))]
                else:
                    targets = [node.module or ""]
                where = "%s:%d %s" % (mod, node.lineno, lines[node.lineno - 1].strip())
                ours = [t for t in targets if t.split(".")[0] in PACKAGES and t not in LAZY_DCLENS]
                if ours:
                    bad.append(where + "  (a module of ours: import it at the top)")
                elif "#" not in lines[node.lineno - 1]:
                    bad.append(where + "  (say why it is imported here, in a comment)")
    return bad


def test_function_level_imports_say_why():
    bad = _function_level_imports()
    assert not bad, "function-level imports:\n" + "\n".join(bad)


def test_the_function_level_rule_can_fail(tmp_path, monkeypatch):
    pkg = tmp_path / "dclens"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text(
        "def f():\n    from . import y\n\n\ndef g():\n    import pandas\n\n\n"
        "def h():\n    import ray  # optional: the distributed extra\n"
    )
    (pkg / "y.py").write_text("")
    monkeypatch.setitem(PACKAGES, "dclens", str(pkg))
    monkeypatch.setitem(PACKAGES, "synth_tasks", str(tmp_path / "none"))
    bad = _function_level_imports()
    assert len(bad) == 2 and "a module of ours" in bad[0] and "say why" in bad[1], bad


def test_import_is_light():
    """`import dclens` loads neither matplotlib nor pandas, ray or torch (they load when used)."""
    code = "import sys, dclens; print(sorted(m for m in ('matplotlib', 'pandas', 'ray', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_old_names_are_the_modules_themselves():
    """dclens.graph, dclens.circuits, ... (the flat modules before the subpackages) are the
    modules in their new homes, by import, by from-import and as attributes."""
    code = (
        "import importlib, sys, dclens\n"
        "assert 'matplotlib' not in sys.modules\n"
        "for old, new in dclens.OLD_NAMES.items():\n"
        "    m = importlib.import_module('dclens.' + old)\n"
        "    assert m is importlib.import_module('dclens.' + new), old\n"
        "    assert m.__name__ == 'dclens.' + new and m.__spec__.name == 'dclens.' + new, old\n"
        "    if old != 'generate':\n"
        "        assert getattr(dclens, old) is m, old\n"
        "assert callable(dclens.generate) and not hasattr(dclens.generate, '__path__')\n"
        "from dclens.graph import Circuit\n"
        "from dclens.plots import plot_heads\n"
        "import dclens.circuits as c\n"
        "assert c is dclens.analysis.qkov and Circuit is dclens.analysis.graph.Circuit\n"
        "assert dclens.analysis.head_output_pca is dclens.analysis.heads.head_output_pca\n"
        "assert dclens.analysis._HEADS == set(dclens.analysis.heads.__all__)\n"
        "from dclens.train import TrainConfig\n"
        "from dclens.cli import main\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


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
# four that call it (every call on a loaded model is a Runner method; _core.dictionaries
# owns the engine's SAEs, which hold no model: dclens.features reaches them through it)
BINDING = "dclens._core.binding"
ENGINE_USERS = {"dclens._core.runner", "dclens._core.tapes", "dclens._core.dictionaries", "dclens.viz.heatmaps"}


def test_one_engine_boundary():
    """Only _core.binding imports dclens._engine; only runner (loaded models and the model-free
    queries), tapes (gradient tapes), dictionaries (the SAEs) and viz.heatmaps (the renderer)
    import the binding, plus the
    package's __init__, which imports it first so that a missing BLAS is a dclens.Error."""
    g = _graph()
    importers = {m for m, ts in g.items() if "dclens._engine" in ts}
    assert importers == {BINDING}, "modules importing dclens._engine: %s" % sorted(importers)
    users = {m for m, ts in g.items() if BINDING in ts} - {"dclens"}
    assert users <= ENGINE_USERS, "modules calling the engine outside the boundary: %s" % sorted(users - ENGINE_USERS)
    assert ENGINE_USERS <= users  # the rule names modules that exist and use it


def test_the_boundary_rule_can_fail(tmp_path, monkeypatch):
    pkg = tmp_path / "dclens"
    for d in ("", "_core", "viz", "analysis"):
        (pkg / d).mkdir(exist_ok=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "_core" / "binding.py").write_text("from .._engine import lib\n")
    for n in ("_core/runner", "_core/tapes", "_core/dictionaries", "viz/heatmaps"):
        (pkg / (n + ".py")).write_text("from .._core.binding import lib\n")
    (pkg / "analysis" / "graph.py").write_text("def f():\n    from .._engine import lib\n")
    monkeypatch.setitem(PACKAGES, "dclens", str(pkg))
    monkeypatch.setitem(PACKAGES, "synth_tasks", str(tmp_path / "none"))
    with pytest.raises(AssertionError, match="dclens.analysis.graph"):
        test_one_engine_boundary()
