"""Reports of the synthetic benchmark: results.json, the answers CSV, PNG plots,
the terminal summary and the side-by-side comparison of several models."""

from __future__ import annotations

import csv
import json
import math
import os

from .evaluate import EvalResult
from .tasks import TASKS


def _num(x):
    """JSON has no NaN: write null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _clean(obj):
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return _num(obj)


def results_dict(res: EvalResult, data: str | None = None, extra: dict | None = None) -> dict:
    d = {"model": res.model_name, "data": data, "lines": res.n_lines}
    d.update(res.extra)
    if extra:
        d.update(extra)
    d.update(res.summary)
    d["speed"] = res.speed
    return _clean(d)


def write_results(res: EvalResult, path, data: str | None = None, extra: dict | None = None) -> dict:
    d = results_dict(res, data, extra)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(d, f, indent=1)
        f.write("\n")
    return d


CSV_FIELDS = ["task", "line", "k", "answer", "nll", "n_tokens", "correct", "predicted", "predicted_ids", "answer_ids"]


def write_answers_csv(res: EvalResult, path) -> None:
    """One row per scored answer."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in res.answers:
            w.writerow(
                [
                    r.task_id,
                    r.line,
                    r.k,
                    r.answer,
                    f"{r.nll:.6f}",
                    r.n_tokens,
                    int(r.correct),
                    r.pred_text,
                    " ".join(map(str, r.pred_ids)),
                    " ".join(map(str, r.target_ids)),
                ]
            )


# ---------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _names(results: list[EvalResult]) -> str:
    return ", ".join(r.model_name or "model" for r in results)


def plot_per_task(results: list[EvalResult], path) -> None:
    """Accuracy and perplexity per task, grouped bars (one colour per model),
    the model name(s) in the title."""
    plt = _plt()
    tasks = []
    for r in results:
        for t in r.summary["per_task"]:
            if t not in tasks:
                tasks.append(t)
    n = len(results)
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(min(24, max(10, 0.15 * len(tasks) * n + 2)), 7.5))
    width = 0.8 / n
    for ax, key, label in ((axes[0], "acc", "accuracy"), (axes[1], "ppl", "perplexity (log)")):
        for j, r in enumerate(results):
            pt = r.summary["per_task"]
            ys = [pt[t].get(key, float("nan")) if t in pt else float("nan") for t in tasks]
            xs = [i + (j - (n - 1) / 2) * width for i in range(len(tasks))]
            ax.bar(xs, ys, width=width, label=r.model_name)
        ax.set_ylabel(label)
    axes[0].set_ylim(0, 1)
    axes[1].set_yscale("log")
    axes[1].set_xticks(range(len(tasks)))
    axes[1].set_xticklabels([t.replace("task", "") for t in tasks], rotation=90, fontsize=7)
    axes[1].set_xlim(-0.6, len(tasks) - 0.4)
    axes[1].set_xlabel("task")
    axes[0].set_title("Synthetic benchmark per task: %s" % _names(results))
    if n > 1:
        axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_per_k(results: list[EvalResult], path) -> None:
    """Accuracy and perplexity against the shot count k (the paper's
    Figure 6), the model name(s) in the title."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for r in results:
        ks = sorted(r.summary["per_k"], key=int)
        for ax, key in ((axes[0], "acc"), (axes[1], "ppl")):
            ax.plot(
                [int(k) for k in ks],
                [r.summary["per_k"][k].get(key, float("nan")) for k in ks],
                marker="o",
                label=r.model_name,
            )
    for ax, label in ((axes[0], "accuracy"), (axes[1], "perplexity (log)")):
        ax.set_xlabel("k (solved examples in the prompt)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylim(bottom=0)
    axes[1].set_yscale("log")
    fig.suptitle("Accuracy and perplexity vs. number of shots: %s" % _names(results))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------
# terminal / markdown tables
# ---------------------------------------------------------------------------


def _fmt_acc(s):
    return "-" if s is None or s.get("acc") is None or s["acc"] != s["acc"] else f"{100 * s['acc']:.1f}%"


def _fmt_ppl(s):
    return "-" if s is None or s.get("ppl") is None or s["ppl"] != s["ppl"] else f"{s['ppl']:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(
        str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(r, widths))
    )
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def _sections(results: list[EvalResult], with_tasks: bool):
    yield "overall", [("all", [r.summary["overall"] for r in results])]
    keys = []
    for r in results:
        keys += [k for k in r.summary["per_k"] if k not in keys]
    yield "per k (shots)", [(f"k={k}", [r.summary["per_k"].get(k) for r in results]) for k in sorted(keys, key=int)]
    for sec, title in (("per_pattern", "per QK pattern"), ("per_transform", "per OV transformation")):
        names = []
        for r in results:
            names += [p for p in r.summary[sec] if p not in names]
        if names:
            yield title, [(p, [r.summary[sec].get(p) for r in results]) for p in names]
    if with_tasks:
        names = []
        for r in results:
            names += [p for p in r.summary["per_task"] if p not in names]
        yield "per task", [(t, [r.summary["per_task"].get(t) for r in results]) for t in names]


def format_summary(results, with_tasks: bool = False) -> str:
    """A plain-text table: rows overall / per k / per pattern / per transform
    (/ per task), columns acc, ppl and n for each model."""
    if isinstance(results, EvalResult):
        results = [results]
    multi = len(results) > 1
    header = [""]
    for r in results:
        pre = f"{r.model_name} " if multi else ""
        header += [pre + "acc", pre + "ppl"]
    header.append("n")
    out = []
    for title, rows in _sections(results, with_tasks):
        body = []
        for name, ss in rows:
            row = [name]
            for s in ss:
                row += [_fmt_acc(s), _fmt_ppl(s)]
            row.append(str(next((s["n"] for s in ss if s), 0)))
            body.append(row)
        out.append(f"{title}:\n" + _table(header, body))
    sp = [r.speed for r in results]
    out.append(
        "speed: "
        + "; ".join(
            f"{r.model_name}: {s['tokens']} tokens in {s['forward_s']:.2f}s forward "
            f"({s['tokens_per_s']:.0f} tokens/s, {s['batches']} batches)"
            for r, s in zip(results, sp)
        )
    )
    return "\n\n".join(out)


def compare_markdown(results: list[EvalResult]) -> str:
    names = [r.model_name for r in results]
    lines = ["# Synthetic benchmark: model comparison", ""]
    for title, rows in _sections(results, with_tasks=True):
        lines.append(f"## {title}")
        lines.append("")
        head = "| | " + " | ".join(f"{n} acc | {n} ppl" for n in names) + " | n |"
        lines.append(head)
        lines.append("|" + "---|" * (2 * len(names) + 2))
        for name, ss in rows:
            label = name
            if title == "per task" and name in TASKS:
                t = TASKS[name]
                label = f"{name} ({t.pattern}, {t.transform})"
            cells = []
            for s in ss:
                cells += [_fmt_acc(s), _fmt_ppl(s)]
            n = next((s["n"] for s in ss if s), 0)
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {n} |")
        lines.append("")
    return "\n".join(lines)


def compare_dict(results: list[EvalResult]) -> dict:
    def pick(s):
        return None if s is None else {"acc": s["acc"], "ppl": s["ppl"], "n": s["n"]}

    out = {"models": [r.model_name for r in results]}
    out["overall"] = {r.model_name: pick(r.summary["overall"]) for r in results}
    for sec in ("per_k", "per_pattern", "per_transform", "per_task"):
        keys = []
        for r in results:
            keys += [k for k in r.summary[sec] if k not in keys]
        out[sec] = {k: {r.model_name: pick(r.summary[sec].get(k)) for r in results} for k in keys}
    return _clean(out)


def write_compare(results: list[EvalResult], out_dir) -> tuple[str, dict]:
    md = compare_markdown(results)
    d = compare_dict(results)
    with open(os.path.join(out_dir, "compare.md"), "w", encoding="utf-8") as f:
        f.write(md)
    with open(os.path.join(out_dir, "compare.json"), "w", encoding="utf-8") as f:
        json.dump(d, f, indent=1)
        f.write("\n")
    return md, d


def write_all(res: EvalResult, out_dir, data: str | None = None, extra: dict | None = None, plots: bool = True) -> dict:
    """results.json, answers.csv and the two plots of one model in out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    d = write_results(res, os.path.join(out_dir, "results.json"), data, extra)
    write_answers_csv(res, os.path.join(out_dir, "answers.csv"))
    if plots:
        plot_per_task([res], os.path.join(out_dir, "acc_per_task.png"))
        plot_per_k([res], os.path.join(out_dir, "acc_per_k.png"))
    return d
