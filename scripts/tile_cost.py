"""What cutting one product into output tiles costs single-threaded OpenBLAS (issue 28).

    python scripts/tile_cost.py [--shapes 512x3072x1024,...] [--tiles 512x256,...] [--rounds 5]

Each tile is one cblas_sgemm over the whole of K (as the CPU pool's items are,
cpu.c), so each re-packs its rows of A and its columns of B: the time of all
tiles of M x N x K, one after another on one thread of the engine's own
libopenblas, over the time of one call for the whole product. Every tiling is
timed once per round, rounds interleaved, best of the rounds (the cores are shared).
Run it without the machine's OpenBLAS pin, as bench.py's command of record does.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import openblas_path  # noqa: E402


def _tiled(sgemm, A, B, C, tm, tn):
    """Seconds of C = A B^T as tm x tn output tiles, one sgemm each (A [M, K], B [N, K])."""
    (M, K), N = A.shape, B.shape[0]
    t0 = time.perf_counter()
    for m0 in range(0, M, tm):
        for n0 in range(0, N, tn):
            mt, nt = min(tm, M - m0), min(tn, N - n0)
            sgemm(
                101,
                111,
                112,
                mt,
                nt,
                K,
                1.0,
                A.ctypes.data + 4 * m0 * K,
                K,
                B.ctypes.data + 4 * n0 * K,
                K,
                0.0,
                C.ctypes.data + 4 * (m0 * N + n0),
                N,
            )
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="512x3072x1024,512x1024x4096,512x1024x1024,512x2048x8192")
    ap.add_argument("--tiles", default="512x256,512x192,512x128,512x64,256x512,256x256,256x128,128x256")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    import dclens

    lib = ctypes.CDLL(openblas_path())
    sym = dclens.blas.symbol  # scipy-openblas32's prefixed names
    getattr(lib, sym("openblas_set_num_threads"))(1)
    corename = getattr(lib, sym("openblas_get_corename"))
    corename.restype = ctypes.c_char_p
    P = ctypes.c_void_p
    sgemm = getattr(lib, sym("cblas_sgemm"))
    sgemm.argtypes = [ctypes.c_int] * 6 + [
        ctypes.c_float,
        P,
        ctypes.c_int,
        P,
        ctypes.c_int,
        ctypes.c_float,
        P,
        ctypes.c_int,
    ]
    tiles = [tuple(map(int, t.split("x"))) for t in a.tiles.split(",")]
    print("OpenBLAS kernel: %s; 1 thread; time of the tiles / time of one call" % corename().decode())
    print("| M x N x K | one call GFLOP/s | " + " | ".join("%dx%d" % t for t in tiles) + " |")
    print("|---|---:|" + "---:|" * len(tiles))
    for shape in a.shapes.split(","):
        M, N, K = map(int, shape.split("x"))
        A = np.random.default_rng(0).standard_normal((M, K), dtype=np.float32)
        B = np.random.default_rng(1).standard_normal((N, K), dtype=np.float32)  # [N, K]: the weights' layout
        C = np.empty((M, N), np.float32)
        best = {t: float("inf") for t in [(M, N)] + tiles}
        for _ in range(a.rounds):
            for t in best:
                best[t] = min(best[t], _tiled(sgemm, A, B, C, *t))
        one = best[(M, N)]
        print(
            "| %s | %.1f | " % (shape, 2 * M * N * K / one / 1e9)
            + " | ".join("%.3f" % (best[t] / one) for t in tiles)
            + " |"
        )


if __name__ == "__main__":
    main()
