"""docs/hooks.md, the hook reference, written from the engine's own table of points (hooks.c).

    python scripts/gen_hook_reference.py           # (re)write docs/hooks.md
    python scripts/gen_hook_reference.py --check   # exit 1 if docs/hooks.md is not what the engine says

For every point: its name, per layer or global, its layout, which models have it, what a
write does, and the C function that computes it and calls its hook (under engine/src/model),
as `dcs_hook_point_*` (dclens.h) give them. tests/api/test_docs.py runs --check, and checks
that each named function names the point (its enum, or the table it fires it from).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "hooks.md")

NEEDS = {
    0: "every model",
    1: "DCMHA",
    2: "DCMHA with a key side (not `query_wise`)",
    3: "DCMHA with the static branch (`use_sw`)",
    4: "Mixture-of-Head routing (`moh`)",
    5: "DCMHA with a query side (not `key_wise`)",
    6: "a gated (SwiGLU) MLP: DCFormer++",
    7: "DCFormer++ with the MLP group gate (`mgate`)",
}
# what a write does, by kind of point (shared/docs/hooks.md's rules, as the engine applies them)
WRITE_MAP = {
    1: "replaces the map; at masked pairs the mask overrides it",
    2: "replaces the map; masked pairs are zeroed again after the write",
}
WRITE_SPECIAL = {
    "attn.q_input": "replaces head n's copy: only head n's q changes",
    "attn.k_input": "replaces head n's copy: only head n's k changes",
    "attn.v_input": "replaces head n's copy: only head n's v changes",
    "attn.head_out": "replaces the heads' terms: attn.out becomes their sum plus the bias",
}

HEADER = """# Hook reference

<!-- written by scripts/gen_hook_reference.py from the engine's table of points
     (engine/src/model/hooks.c); tests/api/test_docs.py checks it against the engine -->

Every point below can be read (`run_with_cache`) and written (`run_with_hooks`, the
interventions). A layer's points are named `blocks.{l}.<point>`; global points stand alone.
Layouts are for one sequence (a batched call adds a leading B): T queries, S keys (S = T in a
full pass), N heads, Dh head dim, D model dim, R dynamic rank, F MLP width, V vocabulary,
E MLP groups, hs shared MoH heads; a dynamic weight's `T|S` is T on the query side, S on the
key side. "Computed in" is the function of `engine/src/model/` that computes the activation
and calls its hook; a function that fires several points from a table names the table
(`dcs_branch_points`, `dcs_dyn_points`, `dcs_split_points` in pass.c). The names and their
meaning are specified in the project's hook document (`shared/docs/hooks.md`); which Python
module reads which is in docs/architecture.md.

| point | per layer | layout | models | a write | computed in |
|---|---|---|---|---|---|
"""


def rows():
    """The table's rows from the engine: (point, layered, layout, needs, write, where)."""
    from dclens._engine import ffi, lib  # (through dclens: its BLAS loads first)

    out = []
    for p in range(lib.DCS_HP_COUNT):
        name = ffi.string(lib.dcs_hook_point_name(p)).decode()
        layout = ffi.string(lib.dcs_hook_point_layout(p)).decode()
        where = ffi.string(lib.dcs_hook_point_source(p)).decode()
        write = WRITE_SPECIAL.get(name) or WRITE_MAP.get(lib.dcs_hook_point_map(p), "replaces the activation")
        layered = "yes" if lib.dcs_hook_point_is_layered(p) else "global"
        out.append((name, layered, layout, NEEDS[lib.dcs_hook_point_needs(p)], write, where))
    return out


def render() -> str:
    # a layout's "T|S" would split the table's cell: Markdown's escaped pipe is one character
    lines = [
        "| `%s` | %s | %s | %s | %s | `%s` (%s) |"
        % (n, lay, shape.replace("|", "\\|"), needs, write, w.split()[1], w.split()[0])
        for n, lay, shape, needs, write, w in rows()
    ]
    return HEADER + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare docs/hooks.md with the engine's table")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        have = ""
        if os.path.exists(OUT):
            with open(OUT, encoding="utf-8") as f:
                have = f.read()
        if have != text:
            print(
                "gen_hook_reference: docs/hooks.md differs from the engine's table: "
                "run python scripts/gen_hook_reference.py"
            )
            return 1
        print("gen_hook_reference: docs/hooks.md is the engine's table (%d points)" % text.count("\n| `"))
        return 0
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    print("gen_hook_reference: wrote %s" % os.path.relpath(OUT, ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
