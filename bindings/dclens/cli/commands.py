"""The dclens command line (also python -m dclens): look inside attention heads that talk to each other.

dclens --version
dclens synth --model DIR [--model DIR2] [--data FILE] [--out DIR] [--limit N]   (synth_tasks)
dclens heatmap --model DIR --text "..." --layer L [--head H] [--hook pattern] --out FILE.png
dclens explore --model DIR --text "..." [--twin DIR] [--layers 0,2-3] [--ig TOKEN] --out page.html
dclens info --model DIR
dclens models                            (the bundled models: every --model takes their names)
dclens make-tiny OUT_DIR [options]      (a generated checkpoint, see dclens.testing)
dclens train --out DIR [options]        (train a small model, see dclens.train)
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from .. import __version__
from .._core import blas, plugins
from .._core.bundled import bundled_models, models_dir
from .._core.checks import Error
from .._core.help import HelpFormatter
from ..model import load
from ..testing import make_tiny
from ..train import loop
from ..viz.explorer import explore
from ..viz.heatmaps import attention_heatmap


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)


MODEL_HELP = "checkpoint directory, bundled model name (dclens models) or Hugging Face Hub id (org/name)"


def _heatmap_parser() -> argparse.ArgumentParser:
    p = _parser("dclens heatmap", "Render attention heatmaps to PNG.")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) with a Hub id")
    p.add_argument("--text", required=True, help="the prompt")
    p.add_argument("--layer", required=True, help="layer index, or 'all' (with --head)")
    p.add_argument("--head", type=int, default=None, help="one head (default: all heads of the layer)")
    p.add_argument(
        "--hook",
        default=None,
        help="pattern, pattern_composed, scores, scores_composed, pre.kp, post.qg, ..., or branches "
        "(default: DCPythia's composed weights beside its softmax pattern; Pythia's pattern)",
    )
    p.add_argument("--phase", default="post", choices=["pre", "post"], help="with --hook branches")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="the type the weight matrices are kept in (dclens.load's dtype=)",
    )
    p.add_argument("--out", required=True, help="output PNG file")
    p.add_argument(
        "--grid-cols",
        type=int,
        default=None,
        help="panels per grid row (default: about sqrt(panels), fewer when the picture would pass 1800 px "
        "at cells of 10 px: dclens.heatmaps.MAX_WIDTH)",
    )
    p.add_argument("--cell-px", type=int, default=0, help="pixels per cell (0: chosen from the size)")
    p.add_argument(
        "--scale", default="own", choices=["own", "shared"], help="a colour range per panel (default) or one for all"
    )
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="show the N positions up to --query (default: 64 when the prompt is longer)",
    )
    p.add_argument("--query", type=int, default=None, help="the last position shown (default: the last token)")
    return p


def _heatmap(argv: list[str]) -> int:
    a = _heatmap_parser().parse_args(argv)
    layer = a.layer if a.layer == "all" else _int(a.layer, "--layer")
    _model_dir(a.model)
    model = load(a.model, device=a.device, revision=a.revision, dtype=a.dtype)
    if (a.grid_cols is not None and a.grid_cols < 0) or a.cell_px < 0:
        raise Error("--grid-cols and --cell-px must be >= 0")
    png = attention_heatmap(
        model,
        a.text,
        layer=layer,
        head=a.head,
        hook=a.hook,
        phase=a.phase,
        grid_cols=a.grid_cols or 0,
        cell_px=a.cell_px,
        scale=a.scale,
        window=a.window,
        query=a.query,
    )
    png.save(a.out)
    print("wrote %s (%d bytes)" % (a.out, len(png)))
    return 0


def _explore_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dclens explore",
        formatter_class=HelpFormatter,
        description="Write the interactive composition explorer: one self-contained HTML page (docs/explorer.md).",
    )
    p.add_argument("--model", required=True, help="checkpoint directory or bundled model name")
    p.add_argument("--text", required=True, help="the prompt")
    p.add_argument("--twin", default=None, help="a second model with the same tokenizer (the MHA twin)")
    p.add_argument("--layers", default=None, help="layers to embed, e.g. 0,2-3 (default: all)")
    p.add_argument(
        "--ig",
        default=None,
        metavar="TOKEN",
        help="rank heads by integrated gradients of log p(TOKEN) at the last position",
    )
    p.add_argument("--out", required=True, help="output HTML file")
    return p


def _explore(argv: list[str]) -> int:
    a = _explore_parser().parse_args(argv)
    layers = _layer_list(a.layers) if a.layers is not None else None
    for m in (a.model, a.twin):
        if m is not None:
            _model_dir(m)
    model = load(a.model)
    twin = load(a.twin) if a.twin is not None else None
    target = ("logprob", -1, model.to_single_token(a.ig)) if a.ig is not None else None
    ex = explore(model, a.text, layers=layers, twin=twin, attribution=target)
    ex.save(a.out)
    print(
        "wrote %s (%d bytes; %d tokens, layers %s)" % (a.out, len(ex), ex.n_tokens, ",".join(str(l) for l in ex.layers))
    )
    return 0


def _layer_list(s: str) -> list[int]:
    """'0,2-3' -> [0, 2, 3]."""
    out = []
    for part in s.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
        except ValueError:
            raise Error("--layers must be layer numbers and ranges like 0,2-3, not %r" % s) from None
    return out


def _model_dir(path: str) -> None:
    """--model must name a directory (config.json and weights inside)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        if os.path.islink(path) and not os.path.exists(path):
            raise Error("--model %s is a dangling symbolic link" % path)
        raise Error("--model %s is a file; it must be a checkpoint directory (config.json and weights inside)" % path)


def _int(s: str, what: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise Error("%s must be an integer or 'all', not %r" % (what, s)) from None


def _info_parser() -> argparse.ArgumentParser:
    p = _parser("dclens info", "Print a model's config and hook names.")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) with a Hub id")
    p.add_argument("--hooks", action="store_true", help="also list every hook name")
    return p


def _info(argv: list[str]) -> int:
    a = _info_parser().parse_args(argv)
    _model_dir(a.model)
    m = load(a.model, revision=a.revision)
    print(m)
    pin = os.environ.get("OPENBLAS_CORETYPE")
    print("  %-18s %s" % ("cpu blas kernel", blas.kernel() + (" (OPENBLAS_CORETYPE=%s)" % pin if pin else "")))
    print("  %-18s %s (%s)" % ("cpu blas library", blas.library(), blas.path() or "path unknown"))
    print("  %-18s %s" % ("cpu blas build", blas.config()))
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
        "E": "E=%d" % c.mgate_dim,
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
    if suffix == "mlp.gate":
        return ("T", "E")
    if suffix in ("mlp.pre", "mlp.post", "mlp.pre_linear"):
        return ("T", "F")
    if suffix == "logits":
        return ("T", "V")
    return ("T", "D")


def _models_parser() -> argparse.ArgumentParser:
    return _parser("dclens models", "List the bundled models.")


def _models(argv: list[str]) -> int:
    _models_parser().parse_args(argv)
    ms = bundled_models()
    if not ms:
        print("no bundled models in %s" % models_dir())
    for m in ms:
        print("%-16s %-9s %s\n  %s" % (m.name, m.model_type, m.path, m.summary))
    return 0


COMMANDS = {  # name: (one line of help, run(argv) -> status, parser())
    "heatmap": ("render attention heatmaps to PNG", lambda a: _heatmap(a), lambda: _heatmap_parser()),
    "explore": ("write the interactive composition explorer (HTML)", lambda a: _explore(a), lambda: _explore_parser()),
    "info": ("print a model's config and hook names", lambda a: _info(a), lambda: _info_parser()),
    "models": ("list the bundled models", lambda a: _models(a), lambda: _models_parser()),
    "make-tiny": ("write a generated (random) checkpoint", lambda a: _make_tiny(a), lambda: _make_tiny_parser()),
    "train": ("train a small DCPythia / Pythia on the CPU", lambda a: _train(a), lambda: _train_parser()),
}


def parsers() -> dict:
    """name -> argparse parser of every command (plugins' commands included
    when they expose build_parser next to main)."""
    out = {n: c[2]() for n, c in COMMANDS.items()}
    for n in plugins.names(plugins.COMMANDS):
        if n not in out:
            mod = __import__(plugins.find(plugins.COMMANDS, n).__module__, fromlist=["build_parser"])
            if hasattr(mod, "build_parser"):
                out[n] = mod.build_parser()
    return out


def _top_parser(added: list[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dclens",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="dclens COMMAND --help: the options of a command, with their defaults",
    )
    p.add_argument("--version", action="version", version="dclens %s" % __version__)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for n in added:
        sub.add_parser(n, help="(added by an installed package)", add_help=False)
    for n, c in COMMANDS.items():
        sub.add_parser(n, help=c[0], add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    """dclens (and python -m dclens): dispatch to a command's own parser."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # commands other packages add (synth: synth_tasks), looked up by name
    added = [n for n in plugins.names(plugins.COMMANDS) if n not in COMMANDS]
    if not argv or argv[0].startswith("-"):
        top = _top_parser(added)
        if not argv:
            top.print_help(sys.stderr)
            return 2
        top.parse_args(argv)  # --version, --help exit here; anything else is an error
        return 2
    if argv[0] not in COMMANDS and argv[0] not in added:
        close = difflib.get_close_matches(argv[0], added + list(COMMANDS), n=1)
        print(
            "dclens: unknown command %r%s (commands: %s; dclens --help)"
            % (argv[0], "; did you mean %r?" % close[0] if close else "", ", ".join(added + list(COMMANDS))),
            file=sys.stderr,
        )
        return 2
    cmd, rest = argv[0], argv[1:]
    try:
        fn = COMMANDS[cmd][1] if cmd in COMMANDS else plugins.find(plugins.COMMANDS, cmd)
        return fn(rest) or 0
    except Error as e:
        msg = str(e)
        if msg.startswith(cmd + ": "):  # "heatmap: ..." under "dclens heatmap"
            msg = msg[len(cmd) + 2 :]
        print("dclens %s: error: %s" % (cmd, msg), file=sys.stderr)
        return 1


def _make_tiny_parser() -> argparse.ArgumentParser:
    return make_tiny.build_parser()


def _train_parser() -> argparse.ArgumentParser:
    return loop.build_parser()


def _make_tiny(argv: list[str]) -> int:
    return make_tiny.main(argv) or 0


def _train(argv: list[str]) -> int:
    return loop.main(argv)
