"""CUDA backend vs the CPU backend on the same generated model, in one run.

    python scripts/bench_cuda.py [--dim 1024] [--layers 4] [--T 512 2048]

For a DCPythia and its Pythia twin (random weights, make_tiny), at each T:
tokens/s of a plain forward on the CPU backend (all cores) and on CUDA, their
ratio, the CUDA/CPU logit difference (max |cuda - cpu| / max |cpu|), and the
cost of capturing every hook on CUDA (capture-all time / plain time).
Needs a GPU (exits 0 with a message otherwise). BENCHMARKS.md keeps the
results with the command.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

import dclens
from dclens.testing.make_tiny import make_tiny


def best_of(fn, repeat):
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    if not dclens.cuda_available():
        print("no GPU: %s" % dclens.cuda_unavailable_reason())
        return 0
    dims = dict(n_layer=a.layers, dim=a.dim, n_head=a.heads, vocab=a.vocab)
    print(
        "| model | T | CPU tok/s (%d cores) | CUDA tok/s | CUDA/CPU speed | max rel diff | CUDA capture-all / plain |"
        % os.cpu_count()
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for mt in ("dcpythia", "gpt_neox"):
            d = os.path.join(tmp, mt)
            make_tiny(d, model_type=mt, window_size=256, seed=1, **dims)
            cpu = dclens.load(d, n_threads=os.cpu_count())
            gpu = dclens.load(d, device="cuda")
            for T in a.T:
                toks = np.random.default_rng(T).integers(0, a.vocab, size=(a.B, T))
                ntok = a.B * T
                lc = cpu.forward(toks)
                lg = gpu.forward(toks)
                diff = float(np.abs(lg - lc).max() / np.abs(lc).max())
                t_cpu = best_of(lambda m=cpu, toks=toks: m.forward(toks), max(1, a.repeat // 2))
                t_gpu = best_of(lambda m=gpu, toks=toks: m.forward(toks), a.repeat)
                t_all = best_of(lambda m=gpu, toks=toks: m.run_with_cache(toks), a.repeat)
                print(
                    "| %s D=%d L=%d | %d | %.0f | %.0f | %.1fx | %.1e | %.2fx |"
                    % (mt, a.dim, a.layers, T, ntok / t_cpu, ntok / t_gpu, t_cpu / t_gpu, diff, t_all / t_gpu),
                    flush=True,
                )
            cpu = gpu = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
