"""Kernel time of a CUDA gradient pass and of a plain forward, through
torch.profiler (CUPTI records every kernel of the process, the engine's and
cuBLAS's included; torch is only the profiler here, never a dependency):

    python scripts/profile_cuda.py DIR LAYERS T     # e.g. /tmp/gp 4 128

Writes a DCPythia-6.9B-shaped fp16 checkpoint of LAYERS layers to DIR
(bench.write_69b_fp16), loads it on CUDA, times one tape forward + backward
w.r.t. the last layer's attn.head_out (target: the logit of token 0 at the
last position) and one plain forward, then prints the kernels of each by
their own GPU time (docs/benchmarks/diary.md, "a lent GPU machine")."""

import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "scripts")
import dclens
from dclens.analysis.grad import Tape, target_value_and_grad

import bench

d, L, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
bench.write_69b_fp16(d, L)
m = dclens.load(d, device="cuda")
torch.zeros(1, device="cuda")  # torch's context: the same primary context
at = "blocks.%d.attn.head_out" % (L - 1)
toks = np.random.default_rng(0).integers(0, m.config.vocab, T)


def step():
    tp = Tape(m, 1, T, None)
    lg = tp.forward(toks)
    _, dl = target_value_and_grad(("logit", -1, 0), lg, toks[None])
    tp.backward(dl, None, [m.parse_hook(at)])


step()
t0 = time.perf_counter()
step()
print("gradient step %.3f s" % (time.perf_counter() - t0))
plain = lambda: m.forward(toks)
plain()
t0 = time.perf_counter()
plain()
print("plain forward %.3f s" % (time.perf_counter() - t0))
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
with profile(activities=[ProfilerActivity.CUDA]) as prof2:
    plain()
print(prof2.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
