"""Training throughput of the engine's tape on the CPU (BENCHMARKS.md).

    python scripts/bench_train.py [--model-type dcpythia|gpt_neox] [--layers 4] [--dim 192]
                                  [--heads 6] [--vocab 1024] [--T 128] [--B 16] [--steps 5]

Times full training steps (forward keeping activations, cross-entropy, backward
with parameter gradients, AdamW) on random tokens, counts their FLOPs (matrix
products only: 6 x params-in-matmuls per token plus attention, plus DCMHA's
compose), and compares the achieved GFLOP/s with a same-run float32 GEMM of
the model's MLP shape, [B*T, D] x [D, 4D], through the engine's own BLAS
(cblas_sgemm of the library the extension links, called with ctypes).
"""

import argparse
import math
import os
import sys
import tempfile
import time

import numpy as np

import dclens
import dclens._engine
from dclens._engine import ffi, lib
from dclens.grad import Tape
from dclens.train import TrainConfig, init_weights, model_config, write_model


def flops_per_token(c, V, T):
    D, L, F, N = c.dim, c.n_layer, c.d_ff or 4 * c.dim, c.n_head
    mat = L * (3 * D * D + D * D + 2 * D * F) + V * D  # weights in matmuls (fw MACs)
    attn = L * 2 * T * D  # q.k and p.v MACs (full T x T, as computed)
    dyn = 0
    if c.model_type == "dcpythia":
        K, R = 4 * N, c.rank
        dyn = L * (D * 4 * K + 4 * K * 2 * R * N + D * 4 * N)  # dynamic-weight MLP MACs
        dyn += L * 2 * (T / 2) * (4 * R * N + 2 * N)  # compose, two phases, allowed pairs
    return 2 * 3 * (mat + attn + dyn)  # fw + 2x bw, 2 FLOPs per MAC


def _engine_blas():
    """The BLAS library the engine extension links (numpy may bundle another)."""
    import ctypes
    import subprocess

    so = dclens._engine.__file__
    for line in subprocess.run(["ldd", so], capture_output=True, text=True).stdout.splitlines():
        if "blas" in line and "=>" in line:
            return ctypes.CDLL(line.split("=>")[1].split("(")[0].strip())
    raise RuntimeError("cannot find the BLAS library of %s" % so)


def sgemm_gflops(M, K, Nn, reps=10):
    """float32 GEMM [M, K] x [K, Nn] through the engine's own cblas_sgemm."""
    import ctypes

    blas = _engine_blas()
    a = np.random.default_rng(0).standard_normal((M, K)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((K, Nn)).astype(np.float32)
    c = np.zeros((M, Nn), np.float32)
    P = ctypes.c_void_p
    args = (
        101,
        111,
        111,
        M,
        Nn,
        K,
        ctypes.c_float(1.0),
        P(a.ctypes.data),
        K,
        P(b.ctypes.data),
        Nn,
        ctypes.c_float(0.0),
        P(c.ctypes.data),
        Nn,
    )  # RowMajor, NoTrans, NoTrans
    blas.cblas_sgemm(*args)
    t = time.perf_counter()
    for _ in range(reps):
        blas.cblas_sgemm(*args)
    return 2 * M * K * Nn * reps / (time.perf_counter() - t) / 1e9


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-type", default="dcpythia")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--B", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    c = TrainConfig(
        out="-", model_type=a.model_type, n_layer=a.layers, dim=a.dim, n_head=a.heads, seq_len=a.T, batch_size=a.B
    )
    d = tempfile.mkdtemp()
    write_model(d, init_weights(c, a.vocab), model_config(c, a.vocab), None)
    m = dclens.load(d)
    lib.dcs_model_make_trainable(m._m)
    P = int(lib.dcs_param_total(m._m))
    tape = Tape(m, a.B, a.T)
    g, mom, var = (np.zeros(P, np.float32) for _ in range(3))
    hp = ffi.new("dcs_adamw *")
    hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay = 1e-3, 0.9, 0.95, 1e-8, 0.1
    x = np.random.default_rng(0).integers(0, a.vocab, (a.B, a.T)).astype(np.int32)
    times = []
    for s in range(a.steps + 1):
        t = time.perf_counter()
        tape.forward(x, logits=False)
        tape.loss(x)
        g[:] = 0
        tape.backward(None, g)
        lib.dcs_adamw_step(
            m._m,
            ffi.cast("float *", ffi.from_buffer(g)),
            ffi.cast("float *", ffi.from_buffer(mom)),
            ffi.cast("float *", ffi.from_buffer(var)),
            s + 1,
            hp,
        )
        times.append(time.perf_counter() - t)
    dt = float(np.median(times[1:]))
    tok = a.B * a.T
    fl = flops_per_token(c, a.vocab, a.T) * tok
    ref = sgemm_gflops(a.B * a.T, a.dim, 4 * a.dim)
    print(
        "%s L=%d D=%d N=%d V=%d params=%d B=%d T=%d: step %.3f s, %.0f tokens/s, %.1f GFLOP/s "
        "(same-run sgemm [%d x %d] x [%d x %d]: %.1f GFLOP/s, %.0f%%), threads=%s"
        % (
            a.model_type,
            a.layers,
            a.dim,
            a.heads,
            a.vocab,
            P,
            a.B,
            a.T,
            dt,
            tok / dt,
            fl / dt / 1e9,
            a.B * a.T,
            a.dim,
            a.dim,
            4 * a.dim,
            ref,
            100 * fl / dt / 1e9 / ref,
            os.cpu_count(),
        )
    )


if __name__ == "__main__":
    main()
