"""Attention by query chunks (Model.attention_rows) against the full path, in one run.

    python scripts/bench_attention_chunks.py [--device cpu|cuda] [--dim 1024 --heads 16]
        [--layers 2] [--vocab 8192] [--dtype float32] [--variant static] [--B 1] [--T 2048]
        [--rows 0 64 256] [--json out.json]

On one generated checkpoint (random weights, make_tiny; --variant dcpythia, or
static: the Talking-Heads branch, which the CPU's fused kernel does not compute),
for each T: a plain forward with attention_rows = -1 (the full path, which
materialises every [B, N, T, S] map: the baseline, and CUDA's only path before),
then with each --rows (0: auto, the engine's rule; n: chunks of n query rows).
Per setting: seconds (best of --repeat), the pass's activation peak
(Model.last_pass_memory, weights excluded), the ratio of both to the baseline's,
and the logit difference from it (max |x - full| / max |full|).

The weights' bytes are printed once, so the device memory a forward needs is
weights + peak (plus the CUDA context and cuBLAS workspace on a GPU); --layers
changes the weights only (the pool is reused layer after layer), so a 2-layer
checkpoint at a large model's widths gives that model's activation peak.
BENCHMARKS.md keeps the results with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings

import numpy as np
from bench_cuda import best_of  # scripts/ is the script's own directory on sys.path

import dclens
from dclens.testing.make_tiny import make_tiny


def weight_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith((".safetensors", ".bin")))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--ff", type=int, default=0, help="MLP width (0: 4 x dim)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--variant", default="static", choices=["static", "dcpythia"])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, nargs="+", default=[2048])
    p.add_argument("--rows", type=int, nargs="+", default=[0, 64, 256])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    if a.device == "cuda" and not dclens.cuda_available():
        print("no GPU: %s" % dclens.cuda_unavailable_reason())
        return 0
    kw = dict(n_layer=a.layers, dim=a.dim, n_head=a.heads, vocab=a.vocab, window_size=256, seed=1, dtype=a.dtype)
    if a.ff:
        kw["intermediate"] = a.ff
    if a.variant == "static":
        kw["use_sw"] = True
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny(tmp, model_type="dcpythia", **kw)
        wb = weight_bytes(tmp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = dclens.load(tmp, device=a.device, dtype=a.dtype)
        print(
            "%s, %s, %d layers, d_model %d, %d heads, %s weights: %.2f GiB; CPU BLAS kernel %s"
            % (a.variant, a.device, a.layers, a.dim, a.heads, m.dtype, wb / 2**30, dclens.blas.kernel())
        )
        print("| T | B | attention_rows | s | vs full | activation peak MiB | vs full | max rel logit diff |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|")
        for T in a.T:
            toks = np.random.default_rng(T).integers(0, a.vocab, size=(a.B, T))
            base = None
            for rows in [-1] + a.rows:
                m.attention_rows = rows
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", dclens.ContextWarning)
                    lg = m.forward(toks)
                    peak = m.last_pass_memory()["peak"]
                    t = best_of(lambda toks=toks: m.forward(toks), a.repeat)
                if base is None:
                    base = (lg, t, peak)
                diff = float(np.abs(lg - base[0]).max() / np.abs(base[0]).max())
                name = {-1: "-1 (full)", 0: "0 (auto)"}.get(rows, str(rows))
                print(
                    "| %d | %d | %s | %.3f | %.2fx | %.0f | %.2fx | %.1e |"
                    % (T, a.B, name, t, t / base[1], peak / 2**20, peak / base[2], diff),
                    flush=True,
                )
                rows_out.append(dict(T=T, B=a.B, rows=rows, s=t, peak=peak, diff=diff, weight_bytes=wb))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), results=rows_out), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
