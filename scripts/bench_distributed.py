"""The synthetic benchmark in one process and over 1 and 2 Ray workers on
this machine (BENCHMARKS.md, issue 26).

    python scripts/bench_distributed.py [--model dcpythia-tiny] [--data heldout] [--limit N]

Runs, on the same lines and batches (evaluate.plan):
  one process, model n_threads=1 and n_threads=2 (synth_tasks.evaluate)
  Ray local:1 and local:2, one thread per worker (synth_tasks.distributed),
  on a Cluster object: cold (workers start and load the model) once, then
  warm (the Cluster's workers kept); warm runs are the best of --repeat
and checks that every 1-thread run gives the same answers and summary, to
the bit. Prints a markdown table of wall seconds and lines per second, and
Ray's own start-up time. Needs Ray (pip install 'dclens[distributed]').
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dcpythia-tiny")
    ap.add_argument("--data", default="heldout", help="benchmark JSONL, or 'heldout'")
    ap.add_argument("--limit", type=int, default=None, help="lines spread across the tasks")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many warm runs")
    a = ap.parse_args(argv)

    import dclens
    from dclens import distributed as dd
    from synth_tasks.corpus import HELDOUT_FILE
    from synth_tasks.dataset import load_dataset, sample_across_tasks
    from synth_tasks.distributed import synth
    from synth_tasks.evaluate import evaluate

    ds = load_dataset(HELDOUT_FILE if a.data == "heldout" else a.data)
    if a.limit:
        ds = sample_across_tasks(ds, a.limit)
    n = len(ds)
    rows, results = [], {}

    def timed(label, fn, repeat=1):
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            res = fn()
            best = min(best, time.perf_counter() - t)
        s = best
        rows.append((label, s, n / s))
        results[label] = res
        print("%-44s %7.2f s  %6.1f lines/s" % (label, s, n / s), file=sys.stderr)

    for threads in (1, 2):
        m = dclens.load(a.model, n_threads=threads)
        evaluate(m, ds.lines[:8], batch_tokens=a.batch_tokens)  # warm-up
        timed("one process, n_threads=%d" % threads, lambda m=m: evaluate(m, ds, batch_tokens=a.batch_tokens), a.repeat)
    import ray

    t = time.perf_counter()
    dd.connect(dd.Cluster("local:2", n_threads=1, init=dict(log_to_driver=False)))
    ray_start = time.perf_counter() - t
    for w in (1, 2):
        c = dd.Cluster("local:%d" % w, n_threads=1)
        for when, repeat in (("cold: workers start, load the model", 1), ("warm: the Cluster's workers", a.repeat)):
            timed(
                "Ray local:%d, n_threads=1, %s" % (w, when),
                lambda c=c: synth(a.model, ds, ray=c, batch_tokens=a.batch_tokens, progress=False)[0],
                repeat,
            )
        c.release()
    ray.shutdown()

    ref = results["one process, n_threads=1"]
    for label, r in results.items():
        if "n_threads=1" in label:
            assert r.answers == ref.answers and r.summary == ref.summary, label
    print(
        "\n%d lines (%d answers) of %s, model %s, batch_tokens %d; Ray start-up (ray.init, 2 CPUs) %.1f s"
        % (n, len(ref.answers), a.data, a.model, a.batch_tokens, ray_start)
    )
    print("every n_threads=1 run gives the same answers and summary, to the bit\n")
    print("| run | wall s | lines/s |\n|---|---|---|")
    for label, s, lps in rows:
        print("| %s | %.2f | %.1f |" % (label, s, lps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
