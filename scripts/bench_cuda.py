"""CUDA backend vs the CPU backend on the same generated model, in one run.

    python scripts/bench_cuda.py [--dim 1024] [--layers 4] [--T 512 2048]
    python scripts/bench_cuda.py --variants [--dim 4096 --heads 32 --layers 4 --vocab 50432 --T 128 2048]

For a DCPythia and its Pythia twin (random weights, make_tiny), at each T:
tokens/s of a plain forward on the CPU backend (all cores) and on CUDA, their
ratio, the CUDA/CPU logit difference (max |cuda - cpu| / max |cpu|), and the
cost of capturing every hook on CUDA (capture-all time / plain time).
--variants (issue 39): the CUDA paths against each other on one DCPythia,
no CPU: float32 weights with the verified kernels (the default), float32
with DCLENS_CUDA_KERNELS=new (warp-per-row LayerNorm / softmax / compose
backward, pinned hook staging), and float16 / bfloat16 weights on tensor
cores with the new kernels: forward tokens/s, capture-all / plain (target
<= 5x), a gradient step (forward + backward w.r.t. the middle layer's
attn.z) and the logit difference from the default path.
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
    p.add_argument("--variants", action="store_true", help="the CUDA paths against each other (no CPU)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="--variants on the CPU: a dry run")
    a = p.parse_args(argv)
    if a.variants and a.device == "cpu":
        return variants(a)
    if not dclens.cuda_available():
        print("no GPU: %s" % dclens.cuda_unavailable_reason())
        return 0
    if a.variants:
        return variants(a)
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


VARIANTS = [  # name, DCLENS_CUDA_KERNELS, dtype
    ("fp32, verified kernels", "", "float32"),
    ("fp32, new kernels", "new", "float32"),
    ("fp16, new kernels", "new", "float16"),
    ("bf16, new kernels", "new", "bfloat16"),
]


def variants(a):
    """The CUDA paths on one random DCPythia, each loaded in turn (the kernel
    choice is read when the backend is created)."""
    dims = dict(n_layer=a.layers, dim=a.dim, n_head=a.heads, vocab=a.vocab)
    print("| path | T | tok/s | capture-all / plain | gradient step s | max rel logit diff vs default |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, "dcp")
        make_tiny(d, model_type="dcpythia", window_size=256, seed=1, **dims)  # float32: each dtype rounds it
        base = {}
        for name, kernels, dtype in VARIANTS:
            os.environ["DCLENS_CUDA_KERNELS"] = kernels
            m = dclens.load(d, device=a.device, dtype=dtype)
            z = "blocks.%d.attn.z" % (a.layers // 2)
            for T in a.T:
                toks = np.random.default_rng(T).integers(0, a.vocab, size=(a.B, T))
                lg = m.forward(toks)
                base.setdefault(T, lg)
                diff = float(np.abs(lg - base[T]).max() / np.abs(base[T]).max())
                t = best_of(lambda m=m, toks=toks: m.forward(toks), a.repeat)
                t_all = best_of(lambda m=m, toks=toks: m.run_with_cache(toks), max(1, a.repeat // 2))
                t_g = best_of(lambda m=m, toks=toks, z=z: m.gradients(toks[0], ("logit", -1, 0), [z]), a.repeat)
                print(
                    "| %s | %d | %.0f | %.2fx | %.3f | %.1e |" % (name, T, a.B * T / t, t_all / t, t_g, diff),
                    flush=True,
                )
            m = None
        os.environ.pop("DCLENS_CUDA_KERNELS", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
