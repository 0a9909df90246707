"""The dclens command line.

dclens synth --model DIR [--model DIR2] [--data FILE] [--out DIR] [--limit N]   (synth_tasks)
dclens heatmap --model DIR --text "..." --layer L [--head H] [--hook pattern] --out FILE.png
dclens info --model DIR
dclens models                            (the bundled models: every --model takes their names)
dclens make-tiny OUT_DIR [options]      (a generated checkpoint, see dclens.testing)
dclens train --out DIR [options]        (train a small model, see dclens.train)
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import numpy as np

from . import plugins
from ._checks import Error


def _heatmap(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="dclens heatmap", description="Render attention heatmaps to PNG.")
    p.add_argument("--model", required=True, help="checkpoint directory or bundled model name")
    p.add_argument("--text", required=True, help="the prompt")
    p.add_argument("--layer", required=True, help="layer index, or 'all' (with --head)")
    p.add_argument("--head", type=int, default=None, help="one head (default: all heads of the layer)")
    p.add_argument(
        "--hook",
        default="pattern",
        help="pattern, pattern_composed, scores, scores_composed, pre.kp, post.qg, ..., or branches",
    )
    p.add_argument("--phase", default="post", choices=["pre", "post"], help="with --hook branches")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", required=True, help="output PNG file")
    p.add_argument(
        "--grid-cols",
        type=int,
        default=None,
        help="panels per grid row (default: about sqrt(panels), so 32 heads make a 6x6 grid)",
    )
    p.add_argument("--cell-px", type=int, default=0, help="pixels per cell (default: chosen from the size)")
    a = p.parse_args(argv)
    from .heatmaps import attention_heatmap
    from .model import load

    layer = a.layer if a.layer == "all" else _int(a.layer, "--layer")
    _model_dir(a.model)
    model = load(a.model, device=a.device)
    n_panels = (
        model.config.n_layer
        if layer == "all"
        else (6 if a.hook == "branches" else (1 if a.head is not None else model.config.n_head))
    )
    grid = (
        a.grid_cols
        if a.grid_cols is not None
        else (n_panels if a.hook == "branches" else max(1, int(np.ceil(np.sqrt(n_panels)))))
    )  # 32 heads: 6 x 6
    if grid < 0 or a.cell_px < 0:
        raise Error("--grid-cols and --cell-px must be >= 0")
    png = attention_heatmap(
        model, a.text, layer=layer, head=a.head, hook=a.hook, phase=a.phase, grid_cols=grid, cell_px=a.cell_px
    )
    png.save(a.out)
    print("wrote %s (%d bytes)" % (a.out, len(png)))
    return 0


def _model_dir(path: str) -> None:
    """--model must name a directory (config.json and weights inside)."""
    import os

    if os.path.lexists(path) and not os.path.isdir(path):
        if os.path.islink(path) and not os.path.exists(path):
            raise Error("--model %s is a dangling symbolic link" % path)
        raise Error("--model %s is a file; it must be a checkpoint directory (config.json and weights inside)" % path)


def _int(s: str, what: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise Error("%s must be an integer or 'all', not %r" % (what, s))


def _info(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="dclens info", description="Print a model's config and hook names.")
    p.add_argument("--model", required=True, help="checkpoint directory or bundled model name")
    p.add_argument("--hooks", action="store_true", help="also list every hook name")
    a = p.parse_args(argv)
    from .model import load

    _model_dir(a.model)
    m = load(a.model)
    print(m)
    for k, v in vars(m.config).items():
        if isinstance(v, float):
            v = "%.6g" % v  # float32 values print as written (1e-05, not 9.99999974e-06)
        print("  %-18s %s" % (k, v))
    print("\nhooks (per layer: blocks.{l}.<name>; T = S = tokens; batched calls add a leading B):")
    for name, shape in _hook_shapes(m):
        print("  %-28s %s" % (name, shape))
    if a.hooks:
        print("\n".join(m.hook_names))
    return 0


def _hook_shapes(m):
    """(name pattern, shape with symbols and sizes) of each hook point of the model."""
    c = m.config
    sym = {
        "T": "T",
        "S": "S",
        "N": "N=%d" % c.n_head,
        "Dh": "Dh=%d" % c.head_dim,
        "D": "D=%d" % c.d_model,
        "R": "R=%d" % c.dyn_rank,
        "F": "F=%d" % c.d_ff,
        "V": "V=%d" % c.vocab,
    }
    out, seen = [], set()
    for n in m.hook_names:
        key = n.split(".", 2)[2] if n.startswith("blocks.") else n
        if key in seen:
            continue
        seen.add(key)
        out.append(
            ("blocks.{l}." + key if n.startswith("blocks.") else key, "[%s]" % ", ".join(sym[x] for x in _layout(key)))
        )
    return out


def _layout(suffix):
    if suffix in ("attn.q", "attn.k", "attn.v", "attn.z"):
        return ("T", "N", "Dh")
    if suffix == "attn.head_out":
        return ("T", "N", "D")
    if suffix.startswith("attn.dyn."):
        side = "S" if suffix.split(".")[-1][0] == "k" else "T"
        return (side, "R", "N") if suffix[-1] in "12" else (side, "N")
    if suffix.startswith(("attn.pre.", "attn.post.")) or suffix in (
        "attn.scores",
        "attn.scores_composed",
        "attn.pattern",
        "attn.pattern_composed",
    ):
        return ("N", "T", "S")
    if suffix in ("mlp.pre", "mlp.post"):
        return ("T", "F")
    if suffix == "logits":
        return ("T", "V")
    return ("T", "D")


def _models(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="dclens models", description="List the bundled models.")
    p.parse_args(argv)
    from .bundled import bundled_models, models_dir

    ms = bundled_models()
    if not ms:
        print("no bundled models in %s" % models_dir())
    for m in ms:
        print("%-16s %-9s %s\n  %s" % (m.name, m.model_type, m.path, m.summary))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = {"heatmap": _heatmap, "info": _info, "models": _models, "make-tiny": _make_tiny, "train": _train}
    # commands other packages add (synth: synth_tasks), looked up by name
    added = [n for n in plugins.names(plugins.COMMANDS) if n not in cmds]
    if argv and argv[0] not in cmds and argv[0] not in added and argv[0] not in ("-h", "--help"):
        print(
            "dclens: unknown command %r (commands: %s; dclens --help)" % (argv[0], ", ".join(added + list(cmds))),
            file=sys.stderr,
        )
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    try:
        fn = cmds[cmd] if cmd in cmds else plugins.find(plugins.COMMANDS, cmd)
        return fn(rest) or 0
    except Error as e:
        msg = str(e)
        if msg.startswith(cmd + ": "):  # "heatmap: ..." under "dclens heatmap"
            msg = msg[len(cmd) + 2 :]
        print("dclens %s: error: %s" % (cmd, msg), file=sys.stderr)
        return 1


def _make_tiny(argv: List[str]) -> int:
    from .testing.make_tiny import main as tiny_main

    return tiny_main(argv) or 0


def _train(argv: List[str]) -> int:
    from .train import main as train_main

    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
