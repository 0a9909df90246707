"""``dclens synth``: run the synthetic benchmark on one or more models.

    dclens synth --model DIR [--model DIR2] [--data FILE|heldout] [--out DIR] [--limit N]
                  [--batch-tokens N] [--skip-bad-lines] [--device cpu|cuda] [--threads N]
                  [--ray local:N|ADDRESS [--workers N]]     (synth_tasks.distributed)

New data for training / held-out sets:
    python -m synth_tasks.cli generate OUT.jsonl --lines-per-task N --seed S
                                       [--exclude ../shared/data/synthetic_dataset.jsonl]
    python -m synth_tasks.cli corpus heldout|train|check ...   (synth_tasks.corpus)
    python -m synth_tasks.cli tokenizer fit|stats ...          (synth_tasks.fit_tokenizer)
    python -m synth_tasks.cli card OUT.md --name N --results published=R.json ...
                                                               (synth_tasks.model_card)
    python -m synth_tasks.cli composed-line --model M [--data heldout]   (synth_tasks.composition)

One model: OUT/results.json, OUT/answers.csv, OUT/acc_per_task.png,
OUT/acc_per_k.png.  Several models: the same in OUT/<model name>/, plus
OUT/compare.md, OUT/compare.json and combined plots in OUT.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from .dataset import DATA_NAME, default_data_path  # noqa: F401 -- also the command line's API


def load_model(path, device: str = "cpu", n_threads: int = 0, dtype: str = "auto"):
    """Load a checkpoint directory with the dclens engine (imported lazily)."""
    import dclens

    model = dclens.load(path, device=device, n_threads=n_threads, dtype=dtype)
    return model


def check_out_dir(out: str) -> str | None:
    """Why --out cannot take the results (None if it can): checked before the
    evaluation starts, so a long run never ends in a write error. Creates the
    directory, and a probe file in it, to find out."""
    import tempfile

    if os.path.lexists(out) and not os.path.isdir(out):
        return f"--out {out} exists and is not a directory"
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        return f"--out {out} is not writable: {e.strerror or e}"
    return None


def build_parser() -> argparse.ArgumentParser:
    from dclens.cli.commands import HelpFormatter

    ap = argparse.ArgumentParser(
        prog="dclens synth",
        formatter_class=HelpFormatter,
        description="Evaluate models on the 74-task synthetic benchmark (DCFormer paper, "
        "Section 4.3): accuracy and perplexity of the bracketed answers, "
        "overall, per task, per shot count k, per QK pattern and per OV "
        "transformation.",
    )
    ap.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="DIR",
        help="model directory, bundled model name (dclens models) or Hub id (org/name); "
        "repeat to compare models side by side",
    )
    ap.add_argument(
        "--data",
        default=None,
        metavar="FILE",
        help="benchmark JSONL file (default: the published "
        f"../shared/data/{DATA_NAME}); 'heldout': the held-out "
        "generated set shipped with synth_tasks (synth_tasks.corpus)",
    )
    ap.add_argument("--out", default="synth_out", metavar="DIR", help="output directory (default: synth_out)")
    ap.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="evaluate N lines spread across the tasks (round-robin over the "
        "tasks, each in file order), not the first N",
    )
    ap.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        metavar="N",
        help="padded tokens per forward batch (default: 1024 on cpu, "
        "4096 on cuda); lines of similar length are batched together",
    )
    ap.add_argument(
        "--skip-bad-lines", action="store_true", help="skip malformed lines (and say how many) instead of stopping"
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the models run (default: cpu)")
    ap.add_argument(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="the type the weight matrices are kept in (dclens.load's dtype=; default: auto)",
    )
    ap.add_argument(
        "--tokenizer", default=None, metavar="FILE", help="tokenizer.json to use when the model directory has none"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads of each model (default: every core; with --ray local:N, the "
        "cores / N). Results are the same to the bit with any --threads",
    )
    ap.add_argument(
        "--ray",
        default=None,
        metavar="local:N|ADDRESS",
        help="spread the batches over Ray workers, each holding the model: 'local:N' "
        "starts N on this machine, 'auto' or an address joins a cluster "
        "(pip install 'dclens[distributed]'; docs/distributed.md)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="with --ray ADDRESS: how many workers (default: the cluster's CPUs / "
        "--threads, or its GPUs with --device cuda)",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    return ap


def _slug(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"
    return s


def _model_name(model, path) -> str:
    name = getattr(model, "name", None)
    return str(name) if name else os.path.basename(os.path.normpath(str(path))) or str(path)


def _scored(run, where: str, err):
    """(run(), 0), or (None, exit status) with the failure said: 2 for a bad
    line or value, 1 for a dclens failure (named with `where`); anything
    else propagates."""
    from .dataset import DatasetError

    try:
        return run(), 0
    except (DatasetError, ValueError) as e:
        err(str(e))
        return None, 2
    except Exception as e:  # noqa: BLE001
        if not type(e).__module__.startswith("dclens"):
            raise
        err(f"{where}: {e}")
        return None, 1


def main(argv=None) -> int:
    from . import report
    from .dataset import DatasetError, load_dataset
    from .evaluate import evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "synth":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    err = lambda msg: print(f"dclens synth: error: {msg}", file=sys.stderr)

    data = args.data or default_data_path()
    if data == "heldout" and not os.path.exists(data):
        from .corpus import HELDOUT_FILE

        data = HELDOUT_FILE
    if data is None:
        err(f"no --data given and the published {DATA_NAME} was not found in ../shared/data")
        return 2
    if args.limit is not None and args.limit < 1:
        err("--limit must be at least 1")
        return 2
    for opt in ("threads", "workers"):
        if getattr(args, opt) is not None and getattr(args, opt) < 1:
            err(f"--{opt} must be at least 1")
            return 2
    if args.workers is not None and not args.ray:
        err("--workers goes with --ray")
        return 2
    why = check_out_dir(args.out)
    if why:
        err(why)
        return 2
    try:
        ds = load_dataset(data, skip_bad=args.skip_bad_lines)
        if args.limit is not None:
            from .dataset import sample_across_tasks

            n_tasks = len({l.task_id for l in ds.lines})
            ds = sample_across_tasks(ds, args.limit)
            print(
                f"--limit {args.limit}: {len(ds)} lines from {len({l.task_id for l in ds.lines})} of {n_tasks} tasks",
                file=sys.stderr,
            )
    except DatasetError as e:
        err(f"{e} (use --skip-bad-lines to skip bad lines)")
        return 2
    except OSError as e:
        err(f"cannot read {data}: {e}")
        return 2
    if ds.errors:
        for m in ds.errors[:5]:
            print(f"warning: {m}", file=sys.stderr)
        if len(ds.errors) > 5:
            print(f"warning: ... and {len(ds.errors) - 5} more", file=sys.stderr)
        print(f"skipped {ds.skipped} bad line{'s' if ds.skipped != 1 else ''}", file=sys.stderr)
    if not ds.lines:
        err(f"{data}: no lines to evaluate")
        return 2
    print(f"data: {data}: {len(ds)} lines, {ds.n_answers} scored answers", file=sys.stderr)
    from .tasks import TASKS, line_matches

    off = [l for l in ds if l.task_id in TASKS and not line_matches(l.task_id, l.text)]
    if off:
        print(
            f"warning: {len(off)} line(s) of table task ids do not fit that task's template "
            f"(first: {off[0].where}, {off[0].task_id}); their pattern/transformation "
            "labels may not apply",
            file=sys.stderr,
        )

    tokenizer = None
    if args.tokenizer:
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(args.tokenizer)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type
            err(f"cannot read the tokenizer {args.tokenizer}: {e}")
            return 2

    results, names = [], set()
    bt = args.batch_tokens or (4096 if args.device == "cuda" else 1024)
    on_ray = None
    if args.ray:
        from dclens.distributed import Cluster

        from .distributed import synth

        on_ray, status = _scored(
            lambda: synth(
                args.model,
                ds,
                ray=Cluster(args.ray, workers=args.workers, n_threads=args.threads),
                device=args.device,
                dtype=args.dtype,
                batch_tokens=bt,
                tokenizer=tokenizer,
                progress=False if args.no_progress else None,
            ),
            f"--ray {args.ray}",
            err,
        )
        if status:
            return status
        sp = on_ray[0].speed
        print(
            f"--ray {args.ray}: {sp['workers']} workers of {sp['n_threads']} thread(s); "
            "the same results as a single-process run (any thread count)",
            file=sys.stderr,
        )
    for k, path in enumerate(args.model):
        if on_ray is not None:
            res = on_ray[k]
        else:
            try:
                kw = {} if args.threads is None else {"n_threads": args.threads}
                if args.dtype != "auto":
                    kw["dtype"] = args.dtype
                model = load_model(path, args.device, **kw)
            except Exception as e:  # noqa: BLE001 - report any loader failure plainly
                err(f"cannot load model {path}: {e}")
                return 1
            try:
                tok = tokenizer or getattr(model, "tokenizer", None)
            except Exception as e:  # noqa: BLE001 - the engine raises when tokenizer.json is missing
                err(f"{e} (pass --tokenizer FILE)")
                return 2
            if tok is None:
                err(f"{path} has no tokenizer.json (MODEL_DIR has no tokenizer.json; pass --tokenizer FILE)")
                return 2
            res, status = _scored(
                lambda model=model, tok=tok: evaluate(
                    model, ds, tokenizer=tok, batch_tokens=bt, progress=False if args.no_progress else None
                ),
                path,
                err,
            )
            if status:
                return status
            res.model_name = _model_name(model, path)
        name = res.model_name
        i = 2
        while name in names:
            name = f"{res.model_name}_{i}"
            i += 1
        names.add(name)
        res.model_name = name
        res.extra = {"model_dir": str(path), "skipped_lines": ds.skipped, "template_mismatches": len(off)}
        results.append(res)

    os.makedirs(args.out, exist_ok=True)
    multi = len(results) > 1
    for res in results:
        d = os.path.join(args.out, _slug(res.model_name)) if multi else args.out
        report.write_all(res, d, data=data, plots=not args.no_plots)
    print(report.format_summary(results))
    if multi:
        report.write_compare(results, args.out)
        if not args.no_plots:
            report.plot_per_task(results, os.path.join(args.out, "acc_per_task.png"))
            report.plot_per_k(results, os.path.join(args.out, "acc_per_k.png"))
        print(f"\ncomparison written to {os.path.join(args.out, 'compare.md')}")
    print(f"results written to {args.out}")
    return 0


def generate_main(argv=None) -> int:
    """``python -m synth_tasks.cli generate OUT.jsonl [--lines-per-task N] [--seed S]
    [--tasks task0,task5] [--exclude PUBLISHED.jsonl]``: write new data."""
    from .generate import main as gen_main

    return gen_main(argv)


def corpus_main(argv=None) -> int:
    """``python -m synth_tasks.cli corpus heldout|train|check ...``: data for the bundled models."""
    from .corpus import main as corpus_main_

    return corpus_main_(argv)


def tokenizer_main(argv=None) -> int:
    """``python -m synth_tasks.cli tokenizer fit|stats ...``: the task-vocabulary BPE."""
    from .fit_tokenizer import main as tok_main

    return tok_main(argv)


def card_main(argv=None) -> int:
    """``python -m synth_tasks.cli card OUT.md --name N --results LABEL=results.json ...``."""
    from .model_card import main as card_main_

    return card_main_(argv)


def composed_line_main(argv=None) -> int:
    """``python -m synth_tasks.cli composed-line --model M``: where a DCPythia's heads compose most."""
    from .composition import main as comp_main

    return comp_main(argv)


if __name__ == "__main__":
    _argv = sys.argv[1:]
    _sub = {
        "generate": generate_main,
        "corpus": corpus_main,
        "tokenizer": tokenizer_main,
        "card": card_main,
        "composed-line": composed_line_main,
    }
    if _argv and _argv[0] in _sub:
        raise SystemExit(_sub[_argv[0]](_argv[1:]))
    raise SystemExit(main(_argv))
