"""MODEL_CARD.md of a bundled model, from its benchmark results and training log.

    card = model_card(name, results={"published": "out/results.json", "held-out": "out_h/results.json"},
                      train_log="loss.csv", model_dir="dclens/models/dcpythia-tiny",
                      command="dclens train ...", seed=0)

Every number in the card comes from the files given: the benchmark's
results.json (``dclens synth``; overall, per k, per QK pattern, per OV
transformation, per task), the training log (a CSV with a header holding at
least ``step`` and ``loss``; ``tokens``, ``lr``, ``val_loss``, ``elapsed_s`` /
``time_s`` are used when present) and the model directory (config.json,
parameter count from the safetensors headers).  The only constants are the
paper's Table 5 numbers on the published file, shown next to the overall row.
The first paragraph after the title is the one-line summary that
``dclens.bundled_models()`` shows.

Command line:
    python -m synth_tasks.cli card OUT.md --name NAME --results published=R.json
        [--results held-out=R2.json] [--train-log LOG.csv] [--model-dir DIR]
        [--command "..."] [--seed S] [--note "..."]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import struct
import sys

# DCFormer paper, Table 5: the published file, mixture of 2-7 shots
PAPER_TABLE5 = {"Pythia-6.9B": {"acc": 0.319, "ppl": 10.05}, "DCPythia-6.9B": {"acc": 0.390, "ppl": 7.36}}


class CardError(ValueError):
    """A results.json / training log / model directory the card cannot use."""


def _load_json(path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise CardError(f"{path}: cannot read results: {e}") from None
    if not isinstance(d, dict) or not isinstance(d.get("overall"), dict):
        raise CardError(f"{path}: not a results.json of dclens synth (no 'overall')")
    return d


def read_train_log(path) -> dict:
    """Summary of a training-log CSV: steps, tokens, first/last/min loss, ..."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise CardError(f"{path}: cannot read the training log: {e}") from None
    if not rows or "step" not in rows[0] or "loss" not in rows[0]:
        raise CardError(f"{path}: training log needs a header with 'step' and 'loss' and at least one row")

    def col(name):
        out = []
        for i, r in enumerate(rows, start=2):
            v = r.get(name)
            if v in (None, ""):
                continue
            try:
                out.append(float(v))
            except ValueError:
                raise CardError(f"{path}:{i}: {name} {v!r} is not a number") from None
        return out

    loss, step = col("loss"), col("step")
    s = {
        "rows": len(rows),
        "steps": int(max(step)),
        "loss_first": loss[0],
        "loss_last": loss[-1],
        "loss_min": min(loss),
    }
    for name, key in (("tokens", "tokens"), ("val_loss", "val_loss_last"), ("lr", "lr_last")):
        v = col(name)
        if v:
            s[key] = v[-1]
    t = col("elapsed_s") or col("time_s")
    if t:
        s["elapsed_s"] = t[-1]
    return s


def count_params(model_dir) -> int | None:
    """Number of stored parameters, from the safetensors headers (no weights read)."""
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        return None
    n = 0
    for fn in files:
        with open(os.path.join(model_dir, fn), "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > 100_000_000:
                raise CardError(f"{fn}: safetensors header of {hlen} bytes")
            header = json.loads(f.read(hlen))
        for k, v in header.items():
            if k != "__metadata__":
                n += math.prod(v["shape"])
    return n


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def _ppl(x):
    if x is None:
        return "-"
    return f"{x:.3g}" if x >= 1e4 else f"{x:.2f}"


def _table(header, rows) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def _group_table(results: dict, key: str, label: str, extra=None) -> list[str]:
    names = list(results)
    keys = []
    for r in results.values():
        for k in r.get(key, {}):
            if k not in keys:
                keys.append(k)
    header = (
        [label] + (extra[0] if extra else []) + [f"{n} acc" for n in names] + [f"{n} PPL" for n in names] + ["answers"]
    )
    rows = []
    for k in keys:
        cells = [k] + (extra[1](k, results) if extra else [])
        cells += [_pct(results[n].get(key, {}).get(k, {}).get("acc")) for n in names]
        cells += [_ppl(results[n].get(key, {}).get(k, {}).get("ppl")) for n in names]
        cells.append("/".join(str(results[n].get(key, {}).get(k, {}).get("n", "-")) for n in names))
        rows.append(cells)
    return _table(header, rows)


def model_card(
    name: str,
    results: dict,
    train_log=None,
    model_dir=None,
    command: str | None = None,
    seed: int | None = None,
    note: str | None = None,
) -> str:
    """The card's Markdown.  results: {label: results.json path or dict}, e.g.
    {"published": ..., "held-out": ...}; the first is the headline."""
    if not results:
        raise CardError("at least one results.json is needed")
    res = {k: (v if isinstance(v, dict) else _load_json(v)) for k, v in results.items()}
    for k, v in res.items():
        if not isinstance(v.get("overall"), dict):
            raise CardError(f"results {k!r}: no 'overall'")
    cfg = None
    n_params = None
    if model_dir is not None:
        try:
            with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise CardError(f"{model_dir}: cannot read config.json: {e}") from None
        n_params = count_params(model_dir)
    log = read_train_log(train_log) if train_log is not None else None

    first = next(iter(res))
    o = res[first]["overall"]
    mtype = (cfg or {}).get("model_type", "")
    arch = {"dcpythia": "DCPythia (DCMHA)", "gpt_neox": "Pythia-style MHA (gpt_neox)"}.get(mtype, mtype or "model")
    size = f"{n_params / 1e6:.2f}M-parameter " if n_params else ""
    trained = ""
    if log and "tokens" in log:
        t = log["tokens"]
        trained = f", trained on {t / 1e6:.1f}M" if t >= 1e6 else f", trained on {int(t):,}"
        trained += " tokens of generated task lines"
    L = [
        f"# {name}",
        "",
        f"A {size}{arch}{trained}. On the {first} set: accuracy {_pct(o.get('acc'))}, "
        f"perplexity {_ppl(o.get('ppl'))} over {o.get('n')} scored answers "
        f"(paper, Table 5, published file: Pythia-6.9B 31.9% / 10.05, DCPythia-6.9B 39.0% / 7.36).",
        "",
    ]
    if note:
        L += [note, ""]

    if cfg is not None:
        L += ["## Model", ""]
        keys = [
            "model_type",
            "n_layer",
            "num_hidden_layers",
            "dim",
            "hidden_size",
            "n_head",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
            "window_size",
            "window_type",
            "query_wise",
            "use_dcmha",
            "rotary_pct",
            "use_parallel_residual",
            "tie_word_embeddings",
            "torch_dtype",
        ]
        L += _table(["key", "value"], [[k, json.dumps(cfg[k])] for k in keys if k in cfg])
        if n_params:
            L += ["", f"Parameters: {n_params:,} (from the safetensors headers)."]
        L.append("")

    L += ["## Training", ""]
    if command:
        L += ["Command:", "", "```", command, "```", ""]
    if seed is not None:
        L += [f"Seed: {seed}", ""]
    L += [
        "Data: lines of the synthetic-task generator (`synth_tasks.corpus` training stream), "
        "disjoint at the example level from the published file and from the held-out set "
        "(`synth_tasks/data/heldout.jsonl`); tokenizer `synth_tasks/data/tokenizer.json`.",
        "",
    ]
    if log:
        rows = [
            ["steps", log["steps"]],
            ["loss, first logged", f"{log['loss_first']:.4f}"],
            ["loss, last logged", f"{log['loss_last']:.4f}"],
            ["loss, lowest", f"{log['loss_min']:.4f}"],
        ]
        if "tokens" in log:
            rows.append(["tokens", f"{int(log['tokens']):,}"])
        if "val_loss_last" in log:
            rows.append(["validation loss, last", f"{log['val_loss_last']:.4f}"])
        if "elapsed_s" in log:
            rows.append(["training time", f"{log['elapsed_s'] / 60:.1f} min"])
            if "tokens" in log and log["elapsed_s"] > 0:
                rows.append(["tokens/s", f"{log['tokens'] / log['elapsed_s']:.0f}"])
        L += _table(["", ""], rows)
        L += [
            "",
            f"Loss curve: `{os.path.basename(str(train_log))}`"
            + (" and `loss.png`" if os.path.exists(os.path.splitext(str(train_log))[0] + ".png") else "")
            + " in this directory.",
            "",
        ]
    else:
        L += ["No training log was given.", ""]

    L += ["## Results", "", "Overall, next to the paper's Table 5 (those are on the published file):", ""]
    rows = []
    for k, v in res.items():
        ov = v["overall"]
        rows.append(
            [
                f"{name} ({k})",
                _pct(ov.get("acc")),
                _ppl(ov.get("ppl")),
                ov.get("n", "-"),
                os.path.basename(str(v.get("data") or "-")),
            ]
        )
    for m, s in PAPER_TABLE5.items():
        rows.append([f"{m} (paper, published)", _pct(s["acc"]), _ppl(s["ppl"]), 5328, "synthetic_dataset.jsonl"])
    L += _table(["model (data)", "accuracy", "perplexity", "answers", "file"], rows) + [""]
    L += ["Per shot count k:", ""] + _group_table(res, "per_k", "k") + [""]
    L += ["Per QK pattern:", ""] + _group_table(res, "per_pattern", "pattern") + [""]
    L += ["Per OV transformation:", ""] + _group_table(res, "per_transform", "transformation") + [""]

    def task_cols(tid, rr):
        for r in rr.values():
            t = r.get("per_task", {}).get(tid)
            if t:
                return [t.get("pattern") or "-", t.get("transform") or "-"]
        return ["-", "-"]

    L += ["Per task:", ""] + _group_table(res, "per_task", "task", (["pattern", "transformation"], task_cols))
    L += [
        "",
        "Numbers from `dclens synth` (results.json: "
        + ", ".join(f"{k}: `{v.get('data')}`" for k, v in res.items())
        + ").",
        "",
    ]
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m synth_tasks.cli card", description="Write a bundled model's MODEL_CARD.md."
    )
    ap.add_argument("out")
    ap.add_argument("--name", required=True)
    ap.add_argument(
        "--results",
        action="append",
        required=True,
        metavar="LABEL=FILE",
        help="a results.json of dclens synth, labelled (first: headline)",
    )
    ap.add_argument("--train-log", default=None, metavar="CSV")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--command", default=None, help="the training command")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--note", default=None)
    a = ap.parse_args(argv)
    results = {}
    for r in a.results:
        label, sep, path = r.partition("=")
        if not sep or not label or not path:
            ap.error(f"--results {r!r}: expected LABEL=FILE")
        results[label] = path
    try:
        text = model_card(a.name, results, a.train_log, a.model_dir, a.command, a.seed, a.note)
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    except (CardError, OSError) as e:
        print(f"card: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
