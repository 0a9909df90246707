"""Repeated gradient calls with the model's tape cache (bindings/dclens/_core/tapes.py)
against a fresh tape per call, same run, alternating.

    python scripts/bench_tape_cache.py [--model dcpythia-tiny] [--T 71 209] [--calls 12]
                                       [--rounds 3] [--steps 16] [--threads 0]

Per T: `gradients` of the logit of token 0 at the last position w.r.t.
blocks.{L/2}.attn.head_out, and `attribute(..., steps=STEPS)` at the same
hook (T = the first --T). "fresh": Model.free_caches() before every call, so
every call makes its tapes and gives them back with the model's pooled
transients (what every call did before the cache); "cached": the default.
Each round runs CALLS calls of one mode then CALLS of the other (the order
alternating by round), after one warm-up call of each; the table gives the
median and best seconds per call over all rounds, and the ratio of the
medians. Also printed: minor page faults per call (getrusage) and whether the
two modes gave the same bits.

    BASE=/path/to/old/pkg python scripts/bench_tape_cache.py --plain ...

--plain: one column, the calls as they are (no free_caches), for a build
without the cache: BASE names a directory holding another build's dclens
package (put first on sys.path), so the same command times the build before
and this one, one process each, alternated by the caller.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np

if os.environ.get("BASE"):  # another build's package, before the installed one's finder
    sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
    sys.path.insert(0, os.environ["BASE"])
import dclens  # noqa: E402


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _time(fn, calls: int, fresh: bool, m):
    out, ts, f0 = None, [], _faults()
    for _ in range(calls):
        if fresh:
            m.free_caches()
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return out, ts, (_faults() - f0) / calls


def plain(m, name: str, fn, calls: int, rounds: int):
    """--plain: the calls as they are, CALLS x ROUNDS after a warm-up."""
    fn()
    _, ts, pf = _time(fn, calls * rounds, False, m)
    return {"case": name, "median_s": statistics.median(ts), "best_s": min(ts), "faults_per_call": pf}


def bench(m, name: str, fn, calls: int, rounds: int):
    fn()  # warm-up (weights touched, first tape)
    res = {True: [], False: []}
    flt = {True: [], False: []}
    outs = {}
    for r in range(rounds):
        for fresh in (r % 2 == 0, r % 2 != 0):
            o, ts, pf = _time(fn, calls, fresh, m)
            outs[fresh] = o
            res[fresh] += ts
            flt[fresh].append(pf)
    med = {k: statistics.median(v) for k, v in res.items()}
    row = {
        "case": name,
        "fresh_median_s": med[True],
        "fresh_best_s": min(res[True]),
        "cached_median_s": med[False],
        "cached_best_s": min(res[False]),
        "cached_over_fresh": med[False] / med[True],
        "faults_per_call_fresh": statistics.mean(flt[True]),
        "faults_per_call_cached": statistics.mean(flt[False]),
    }
    return row, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dcpythia-tiny")
    ap.add_argument("--T", type=int, nargs="+", default=[71, 209])
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--plain", action="store_true", help="one column: the calls as they are (see above)")
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    a = ap.parse_args()
    m = dclens.load(a.model, n_threads=a.threads)
    at = "blocks.%d.attn.head_out" % (m.config.n_layer // 2)
    rng = np.random.default_rng(0)
    if a.plain:
        rows = []
        for T in a.T:
            toks = rng.integers(0, m.config.vocab, T)
            rows.append(
                plain(
                    m,
                    "gradients T=%d" % T,
                    lambda toks=toks: m.gradients(toks, ("logit", -1, 0), [at]),
                    a.calls,
                    a.rounds,
                )
            )
        toks = rng.integers(0, m.config.vocab, a.T[0])
        ig = lambda: m.attribute(toks, ("logit", -1, 0), [at], steps=a.steps, progress=False)  # noqa: E731
        rows.append(plain(m, "attribute steps=%d T=%d" % (a.steps, a.T[0]), ig, max(2, a.calls // 4), a.rounds))
        for r in rows:
            print(
                "| %s | %s | %.4f (%.4f) | %.0f |"
                % (
                    os.environ.get("BASE") and "before" or "this",
                    r["case"],
                    r["median_s"],
                    r["best_s"],
                    r["faults_per_call"],
                )
            )
        if a.json:
            base = os.environ.get("BASE", "")
            print(json.dumps({"model": a.model, "hook": at, "threads": a.threads, "base": base, "rows": rows}))
        return
    rows = []
    for T in a.T:
        toks = rng.integers(0, m.config.vocab, T)
        row, outs = bench(
            m, "gradients T=%d" % T, lambda toks=toks: m.gradients(toks, ("logit", -1, 0), [at]), a.calls, a.rounds
        )
        row["same_bits"] = bool(np.array_equal(outs[True][at], outs[False][at]))
        rows.append(row)
    toks = rng.integers(0, m.config.vocab, a.T[0])
    row, outs = bench(
        m,
        "attribute steps=%d T=%d" % (a.steps, a.T[0]),
        lambda: m.attribute(toks, ("logit", -1, 0), [at], steps=a.steps, progress=False),
        max(2, a.calls // 4),
        a.rounds,
    )
    row["same_bits"] = bool(np.array_equal(outs[True].attributions[at], outs[False].attributions[at]))
    rows.append(row)
    print(
        "| case | fresh tape per call: median (best), s | cached tape: median (best), s | cached / fresh | "
        "minor faults per call, fresh / cached | same bits |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            "| %s | %.4f (%.4f) | %.4f (%.4f) | %.2f | %.0f / %.0f | %s |"
            % (
                r["case"],
                r["fresh_median_s"],
                r["fresh_best_s"],
                r["cached_median_s"],
                r["cached_best_s"],
                r["cached_over_fresh"],
                r["faults_per_call_fresh"],
                r["faults_per_call_cached"],
                r["same_bits"],
            )
        )
    if a.json:
        print(json.dumps({"model": a.model, "hook": at, "threads": a.threads, "rows": rows}))


if __name__ == "__main__":
    main()
