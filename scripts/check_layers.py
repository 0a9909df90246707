"""Check the engine's layering (docs/architecture.md); a ctest of every preset.

    python scripts/check_layers.py [BUILD_DIR]

1. Includes: a file of engine/src/<layer>/ may include headers of its own
   layer and of the layers below it (io < backends < model; features beside
   model, on io and backends; render beside them, on the public header
   alone), never one above. Tests and fuzzers are
   held to the layer of the library they link (fuzzers: io).
2. No include cycle among the engine's headers.
3. With BUILD_DIR (a CMake build of the engine): no cycle of calls between
   the engine's files (nm on the members of libdclens_<layer>.a: file A uses
   a symbol file B defines, B one of A's, ...), and no file calls into a
   layer above its own.
Prints each violation and exits 1 if there is any.
"""

import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "engine", "src")
RANK = {"io": 0, "backends": 1, "model": 2, "features": 2, "render": 0}
# which layers each layer may include or call (render: only the public header)
ALLOWED = {
    "io": {"io"},
    "backends": {"io", "backends"},
    "model": {"io", "backends", "model"},
    "features": {"io", "backends", "features"},
    "render": {"render"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_of(path):
    rel = os.path.relpath(path, SRC).split(os.sep)
    return rel[0] if len(rel) > 1 and rel[0] in RANK else None


def engine_headers():
    # .cuh: CUDA code included into a .cu of its layer (cuda_backward.cuh)
    hs = glob.glob(os.path.join(SRC, "*", "*.h")) + glob.glob(os.path.join(SRC, "*", "*.cuh"))
    return {os.path.basename(h): h for h in hs}


def check_includes(problems):
    headers = engine_headers()
    files = glob.glob(os.path.join(SRC, "*", "*.[ch]")) + glob.glob(os.path.join(SRC, "*", "*.cu*"))
    graph = {}
    for f in files:
        mine = layer_of(f)
        deps = []
        with open(f, encoding="utf-8") as fh:
            for name in INCLUDE.findall(fh.read()):
                if name == "dclens.h":
                    continue  # the public header: types for every layer
                h = headers.get(name)
                if h is None:
                    problems.append('%s: includes "%s", which is no engine header' % (rel(f), name))
                    continue
                if layer_of(h) not in ALLOWED[mine]:
                    problems.append("%s (layer %s) includes %s (layer %s)" % (rel(f), mine, rel(h), layer_of(h)))
                deps.append(h)
        graph[f] = deps
    for cyc in cycles(graph):
        problems.append("include cycle: " + " -> ".join(rel(x) for x in cyc))
    return len(files)


def cycles(graph):
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def check_objects(build, problems):
    """Calls between the members of the layer libraries of a build."""
    defined, used = {}, {}
    for layer in RANK:
        lib = os.path.join(build, "libdclens_%s.a" % layer)
        if not os.path.exists(lib):
            problems.append("%s: missing; build the engine first" % lib)
            continue
        out = subprocess.run(["nm", "-A", "-P", lib], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            # "lib.a[member.c.o]: symbol type ..."
            m = re.match(r"^.*\[(.+?)\]:?\s+(\S+)\s+(\S)", line)
            if not m:
                continue
            obj = "%s/%s" % (layer, re.sub(r"\.o$", "", m.group(1)))
            sym, kind = m.group(2), m.group(3)
            defined.setdefault(obj, set())
            used.setdefault(obj, set())
            if kind == "U":
                used[obj].add(sym)
            elif kind in "TDBRVW":
                defined[obj].add(sym)
    owner = {}
    for o, syms in defined.items():
        for s in syms:
            owner.setdefault(s, o)
    graph = {o: sorted({owner[s] for s in used[o] if s in owner and owner[s] != o}) for o in defined}
    for o, deps in graph.items():
        mine = o.split("/")[0]
        for d in deps:
            theirs = d.split("/")[0]
            if theirs not in ALLOWED[mine]:
                problems.append("%s (layer %s) calls into %s (layer %s)" % (o, mine, d, theirs))
    for cyc in cycles(graph):
        problems.append("call cycle between files: " + " <-> ".join(cyc))
    return len(defined)


def rel(p):
    return os.path.relpath(p, ROOT)


def main(argv):
    problems = []
    n_files = check_includes(problems)
    n_objs = check_objects(argv[1], problems) if len(argv) > 1 else 0
    for p in problems:
        print("check_layers: " + p)
    print(
        "check_layers: %d sources%s, %d problem(s)"
        % (n_files, ", %d objects" % n_objs if n_objs else "", len(problems))
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
