"""Load-balance bound of the CPU forward's parallel efficiency, per thread count (issue 28).

    python scripts/partition_bound.py [--sizes d1024,1.4b,6.9b] [--T 512] [--threads 1-16] [--before]

The items come from the engine itself: `dcs_cpu_partition` (dclens.h) returns the
work of every item the CPU pool would get for a product or a fused attention,
by the same rule `cpu_gemm`, `cpu_gemm_w` and `cpu_attention` use (cpu.c). The
script lists the products of one prefill pass (B = 1, logits at the last
position: the forward of layer.c and pass.c, per layer: the fused QKV, out,
MLP up and down projections; DCPythia's dynamic-weight products `dw1`, `qkw`
(batched over its 4 slots) and `dd`; the fused attention, local layers with
bench.py's window; then the unembedding of one row) at bench.py's widths.

Per job, the pool hands the items out in order, one at a time, to whichever
thread is free (its dynamic schedule, chunk 1): the job's time on p threads is
that list schedule's makespan, with each item's time its work (multiply-adds;
the attention's softmax and compose by the rough model in cpu.c). The bound is

    efficiency(p) = sum of the jobs' work / (p x sum of the jobs' makespans)

i.e. what the item sizes alone allow, with perfect cores and memory. Row jobs
(norms, GELU, bias, residual: B x T >= 512 rows cut into 4 chunks per thread)
are left out: they balance to within a row.

--before: the rule of commit 601f27d (1-D GEMM blocks of >= 256 rows or
columns, at most 16 per product; 16-bit weight tiles of >= 128 columns;
attention blocks of 32 query rows), transcribed here for the comparison only.
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import numpy as np  # noqa: E402

import dclens  # noqa: E402
from dclens._engine import ffi, lib  # noqa: E402

from bench import SIZES, WINDOW, R  # noqa: E402

GEMM, GEMM_W, ATTN = lib.DCS_PART_GEMM, lib.DCS_PART_GEMM_W, lib.DCS_PART_ATTN


def engine_items(op: int, shape: tuple[int, ...]) -> np.ndarray:
    """The work of each pool item of one operation, in hand-out order (the engine's rule)."""
    s = ffi.new("int[]", list(shape))
    n = lib.dcs_cpu_partition(op, s, len(shape), ffi.NULL, 0)
    if n < 0:
        raise dclens.Error("dcs_cpu_partition: op %d, shape %s: not a product or attention shape" % (op, shape))
    cost = np.zeros(n, np.int64)
    lib.dcs_cpu_partition(op, s, len(shape), ffi.cast("int64_t *", cost.ctypes.data), n)
    return cost


def before_items(op: int, shape: tuple[int, ...]) -> np.ndarray:
    """The same, by the rule of commit 601f27d (transcribed from its cpu.c)."""
    if op == ATTN:
        return engine_items(ATTN, shape + (32,))
    M, N, K = shape[:3]
    if op == GEMM_W:
        tw = max((4 << 20) // max(K, 1) // 16 * 16, 16)
        per = max(((N + 15) // 16 + 15) // 16 * 16, 128)
        tw = max(min(per, tw, N), 1)
        return np.array([M * min(tw, N - n0) * K for n0 in range(0, N, tw)], np.int64)
    batch = shape[3]
    dim, other = (M, N) if M > N else (N, M)
    bw = dim
    if batch < 16:
        pieces = (16 + batch - 1) // batch
        bw = min(max(((dim + pieces - 1) // pieces + 15) // 16 * 16, 256), dim)
    blocks = [min(bw, dim - lo) * other * K for lo in range(0, dim, bw)]
    return np.array(blocks * batch, np.int64)


def makespan(cost: np.ndarray, p: int) -> int:
    """The pool's dynamic schedule: each item, in order, to the first free thread."""
    free = [0] * p
    for c in cost:
        heapq.heappush(free, heapq.heappop(free) + int(c))
    return max(free)


def forward_jobs(size: str, T: int, dcp: bool) -> list[tuple[str, int, tuple[int, ...]]]:
    """(name, op, shape) of every pool job of one B = 1 prefill pass of the bench's model."""
    s = SIZES[size]
    D, N, F, V, L = s["dim"], s["n_head"], s["intermediate"], s["vocab"], s["bench_layers"]
    Dh, M = D // N, T
    wop = GEMM_W if s["dtype"] != "float32" else GEMM  # the weight matrices' products
    jobs = []
    for layer in range(L):
        jobs.append(("qkv", wop, (M, 3 * D, D) + ((1,) if wop == GEMM else ())))
        if dcp:  # G = 1 group, C = 4 slots, hidden K = 4 N (bench.py's pass_flops)
            C, Kd = 4, 4 * N
            jobs.append(("dw1", wop, (M, C * Kd, D) + ((1,) if wop == GEMM else ())))
            jobs.append(("qkw", GEMM, (M, 2 * R * N, Kd, C)))
            jobs.append(("dd", GEMM, (M, C * N, D, 1)))
        window = WINDOW if dcp and layer % 2 == 0 else 0
        jobs.append(("attention", ATTN, (1, T, T, N, Dh, window, int(dcp), R)))
        jobs.append(("out", wop, (M, D, D) + ((1,) if wop == GEMM else ())))
        jobs.append(("mlp up", wop, (M, F, D) + ((1,) if wop == GEMM else ())))
        jobs.append(("mlp down", wop, (M, D, F) + ((1,) if wop == GEMM else ())))
    jobs.append(("unembed", wop, (1, V, D) + ((1,) if wop == GEMM else ())))
    return jobs


def bound(jobs, items_of, threads):
    costs = [items_of(op, shape) for _, op, shape in jobs]
    work = sum(int(c.sum()) for c in costs)
    return {p: work / (p * sum(makespan(c, p) for c in costs)) for p in threads}, costs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="d1024,1.4b,6.9b")
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--threads", default="1-16", help="a range lo-hi or a comma list")
    ap.add_argument("--before", action="store_true", help="also the rule of commit 601f27d, for comparison")
    ap.add_argument("--items", action="store_true", help="also print each job's item count and sizes")
    a = ap.parse_args(argv)
    if "-" in a.threads:
        lo, hi = map(int, a.threads.split("-"))
        threads = list(range(lo, hi + 1))
    else:
        threads = [int(t) for t in a.threads.split(",")]
    rules = [("after", engine_items)] + ([("before", before_items)] if a.before else [])
    print("| shape, T %d | rule | " % a.T + " | ".join("%d" % p for p in threads) + " |")
    print("|---|---|" + "---:|" * len(threads))
    for size in a.sizes.split(","):
        for model, dcp in (("DCPythia", True), ("Pythia", False)):
            jobs = forward_jobs(size, a.T, dcp)
            for rule, items_of in rules:
                eff, costs = bound(jobs, items_of, threads)
                print(
                    "| %s %s | %s | " % (size, model, rule)
                    + " | ".join("%.0f%%" % (100 * eff[p]) for p in threads)
                    + " |"
                )
                seen = set()
                for (name, _, shape), c in zip(jobs, costs):
                    if a.items and (name, shape) not in seen:
                        seen.add((name, shape))
                        print(
                            "    %-9s %-30s %3d items of %d-%d multiply-adds" % (name, shape, len(c), c.min(), c.max())
                        )


if __name__ == "__main__":
    main()
