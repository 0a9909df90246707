"""Several training seeds of the twins side by side (issue 29): each seed's
overall scores, their mean and spread, and DCMHA minus MHA with a 95% interval
over seeds and lines.

Input: one `benchmark.json` per twin and seed, as `scripts/train_bundled.py
finish` writes it (`{"published": {"overall": ..., "per_line": [[task, line,
answers, correct, nll], ...]}, "held-out": ...}`). Every seed must have been
scored on the same lines (whole sets, no --limit).

The interval resamples both sources of variation at once (a two-stage
bootstrap): each replicate draws the seeds of each twin with replacement (the
twins' seeds are independent runs) and the benchmark lines with replacement
(the same lines for every model: a line's answers move together), and takes the
difference of the two twins' mean accuracies over their drawn seeds on the drawn
lines. With one seed per twin it is the paired line bootstrap.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

LABELS = ("published", "held-out")


class SeedsError(ValueError):
    """A benchmark.json that cannot be combined with the others (names the file)."""


def load_bench(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            b = json.load(f)
    except (OSError, ValueError) as e:
        raise SeedsError(f"{path}: cannot read benchmark.json: {e}") from None
    for label in LABELS:
        sec = b.get(label) if isinstance(b, dict) else None
        if not isinstance(sec, dict) or not isinstance(sec.get("overall"), dict) or not sec.get("per_line"):
            raise SeedsError(f"{path}: no {label!r} section with 'overall' and 'per_line'")
    return b


def _lines(bench: dict, label: str) -> tuple[list[tuple[str, int]], np.ndarray, np.ndarray]:
    """(line keys, correct answers [L], answers [L]) of one set."""
    rows = bench[label]["per_line"]
    keys = [(str(r[0]), int(r[1])) for r in rows]
    return keys, np.array([r[3] for r in rows], float), np.array([r[2] for r in rows], float)


def accuracy(bench: dict, label: str) -> float:
    _, c, n = _lines(bench, label)
    return float(c.sum() / n.sum())


def spread(values: Sequence[float]) -> dict[str, float]:
    """mean, sample standard deviation (0 for one value), min, max."""
    v = np.asarray(values, float)
    sd = float(v.std(ddof=1)) if len(v) > 1 else 0.0
    return {"mean": float(v.mean()), "sd": sd, "min": float(v.min()), "max": float(v.max()), "n": int(len(v))}


def diff_interval(
    a: Sequence[dict], b: Sequence[dict], label: str, n_boot: int = 4000, seed: int = 0
) -> dict[str, float]:
    """Mean accuracy of the seeds `a` minus that of the seeds `b` on `label`,
    with its 95% two-stage bootstrap interval (module docstring)."""
    la = [_lines(x, label) for x in a]
    lb = [_lines(x, label) for x in b]
    keys = la[0][0]
    for k, _, _ in la + lb:
        if k != keys:
            raise SeedsError(f"{label}: the seeds were not scored on the same lines")
    ca, na = np.stack([x[1] for x in la]), np.stack([x[2] for x in la])  # [Sa, L]
    cb, nb = np.stack([x[1] for x in lb]), np.stack([x[2] for x in lb])  # [Sb, L]
    point = float((ca.sum(1) / na.sum(1)).mean() - (cb.sum(1) / nb.sum(1)).mean())
    rng = np.random.default_rng(seed)
    L = len(keys)
    diffs = []
    for k in [512] * (n_boot // 512) + ([n_boot % 512] if n_boot % 512 else []):  # replicates in chunks
        lines = rng.integers(0, L, (k, 1, L))
        sa = rng.integers(0, len(la), (k, len(la), 1))
        sb = rng.integers(0, len(lb), (k, len(lb), 1))
        acc_a = ca[sa, lines].sum(-1) / na[sa, lines].sum(-1)  # [k, Sa]
        acc_b = cb[sb, lines].sum(-1) / nb[sb, lines].sum(-1)  # [k, Sb]
        diffs.append(acc_a.mean(1) - acc_b.mean(1))
    lo, hi = np.percentile(np.concatenate(diffs), [2.5, 97.5])
    return {"diff": point, "lo": float(lo), "hi": float(hi), "seeds_a": len(la), "seeds_b": len(lb), "lines": L}


def combine(benches: dict[str, dict[str, dict]], order: Sequence[str]) -> dict:
    """benches: {twin: {seed: benchmark.json dict}}; order: the twins, DCMHA
    first. The `"seeds"` entry of each twin, every twin's spread per set and
    the difference of the first twin minus the second with its interval."""
    twins = list(order)
    seeds_of = {t: sorted(benches[t], key=int) for t in twins}
    out: dict = {"seeds": {}, "spread": {}, "difference": {}}
    for t in twins:
        out["seeds"][t] = {s: {lb: {"overall": benches[t][s][lb]["overall"]} for lb in LABELS} for s in seeds_of[t]}
        out["spread"][t] = {lb: spread([accuracy(benches[t][s], lb) for s in seeds_of[t]]) for lb in LABELS}
    a, b = twins[0], twins[1]
    for lb in LABELS:
        out["difference"][lb] = diff_interval(
            [benches[a][s] for s in seeds_of[a]], [benches[b][s] for s in seeds_of[b]], lb
        )
    return out


def as_seen_from(combined: dict, name: str) -> dict:
    """The difference of `combined` as `name` minus the other twin."""
    twins = list(combined["seeds"])
    other = [t for t in twins if t != name][0]
    if name == twins[0]:
        return {"minus": other, **combined["difference"]}
    flip = {
        lb: dict(v, diff=-v["diff"], lo=-v["hi"], hi=-v["lo"], seeds_a=v["seeds_b"], seeds_b=v["seeds_a"])
        for lb, v in combined["difference"].items()
    }
    return {"minus": other, **flip}


def card_section(name: str, combined: dict) -> str:
    """The model card's Markdown section on seeds (between markers, so that a
    rerun replaces it)."""
    d = as_seen_from(combined, name)
    lines = [
        "<!-- seeds -->",
        "## Seeds",
        "",
        "Seed 0 is the bundled model; the others were trained with the same recipe but for `--seed`"
        " (initialisation and the order of the training lines) and scored on the same sets"
        " (`python scripts/train_bundled.py seeds`).",
        "",
        "| seed | published accuracy | held-out accuracy |",
        "|---|---|---|",
    ]
    for s, e in combined["seeds"][name].items():
        accs = " | ".join(f"{100 * e[lb]['overall']['acc']:.1f}%" for lb in LABELS)
        lines.append(f"| {s} | {accs} |")
    sp = combined["spread"][name]
    cells = [
        f"{100 * sp[lb]['mean']:.1f} ± {100 * sp[lb]['sd']:.1f}% ({100 * sp[lb]['min']:.1f}-{100 * sp[lb]['max']:.1f})"
        for lb in LABELS
    ]
    lines.append("| mean ± sd (min-max) | " + " | ".join(cells) + " |")
    parts = [
        f"{lb} {100 * d[lb]['diff']:+.1f} points [{100 * d[lb]['lo']:+.1f}, {100 * d[lb]['hi']:+.1f}]" for lb in LABELS
    ]
    lines += [
        "",
        f"{name} minus {d['minus']}, mean over seeds ({d['published']['seeds_a']} and {d['published']['seeds_b']}),"
        " 95% interval over seeds and lines: " + "; ".join(parts) + ".",
        "<!-- /seeds -->",
    ]
    return "\n".join(lines) + "\n"


def replace_section(card: str, section: str) -> str:
    """card with its seeds section replaced (or appended), and the one-seed
    caveat of the comparison paragraph dropped."""
    start, end = card.find("<!-- seeds -->"), card.find("<!-- /seeds -->")
    if start >= 0 and end > start:
        card = card[:start] + card[end + len("<!-- /seeds -->") :].lstrip("\n")
    card = card.replace(" One seed per twin: the spread over seeds was not measured.", " Seeds: see below.")
    return card.rstrip("\n") + "\n\n" + section


def write(model_dirs: dict[str, str], combined: dict) -> None:
    """Add the `"seeds"` key (with `"seeds_spread"` and `"seeds_difference"`)
    to each twin's benchmark.json and the seeds section to its MODEL_CARD.md."""
    for t, d in model_dirs.items():
        p = os.path.join(d, "benchmark.json")
        b = load_bench(p)
        b["seeds"] = combined["seeds"][t]
        b["seeds_spread"] = combined["spread"][t]
        b["seeds_difference"] = as_seen_from(combined, t)
        tmp = p + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(b, f, indent=1)
            f.write("\n")
        os.replace(tmp, p)
        cp = os.path.join(d, "MODEL_CARD.md")
        if os.path.exists(cp):
            card = Path(cp).read_text(encoding="utf-8")
            with open(cp, "w", encoding="utf-8") as f:
                f.write(replace_section(card, card_section(t, combined)))
