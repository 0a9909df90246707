"""Training throughput of the engine's tape on the CPU (BENCHMARKS.md).

    python scripts/bench_train.py [--model-type dcpythia|gpt_neox] [--layers 4] [--dim 192]
                                  [--heads 6] [--vocab 1024] [--T 128] [--B 16] [--steps 5]
    python scripts/bench_train.py --vs-torch [--torch-python /work/venvs/torch/bin/python]
                                  [--models gpt_neox,dcpythia] [--no-torch]
    python scripts/bench_train.py --lines [--lines-steps 8]
    python scripts/bench_train.py --gemm-floor [--threads 2]
    python scripts/bench_train.py --ratio [--ratio-rounds 3] [--threads 2]

--gemm-floor: every matrix product of one gpt_neox training step (the
--vs-torch shape) timed alone through the engine's cblas_sgemm on one thread,
summed, divided by the threads: the step's time if everything but its
products were free (the bound on any speed-up of the rest).

--ratio: the two above in one process (the --vs-torch gpt_neox step and
the --gemm-floor floor, alternated, the best of each): step / floor.

--vs-torch: one `dclens train` step (dclens.train.train_step: forward,
cross-entropy, backward, clipping, AdamW) of Pythia (gpt_neox) and DCPythia,
and PyTorch eager training Pythia (scripts/bench_train_torch.py, run with
--torch-python: torch is never a dependency of dclens), the same shape,
threads and tokens, in one run; tokens/s and the ratios, with the CPU and the
OpenBLAS kernel that ran.

--lines: the bundled twins' recipe (seq-len 288, batch 40, the bundled
tokenizer, window 32 LG for DCPythia) on generated training lines: packed
windows, one line per sequence padded to seq-len (--lines), and length-bucketed
lines (--lines --bucket), in real (scored, non-pad) tokens/s.

Times full training steps (forward keeping activations, cross-entropy, backward
with parameter gradients, AdamW) on random tokens, counts their FLOPs (matrix
products only: 6 x params-in-matmuls per token plus attention, plus DCMHA's
compose), and compares the achieved GFLOP/s with a same-run float32 GEMM of
the model's MLP shape, [B*T, D] x [D, 4D], through the engine's own BLAS
(cblas_sgemm of the library the extension links, called with ctypes).
"""

import argparse
import json
import os
import subprocess
import tempfile
import time

import numpy as np

import dclens
import dclens._engine
from dclens._engine import ffi, lib
from dclens.analysis.grad import Tape
from dclens.train.loop import BUCKET_STEPS, TrainConfig, batch, init_weights, model_config, train_step, write_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


class _EngineBlas:
    """The BLAS library the engine links (scipy-openblas32's by default; numpy
    bundles another copy), its functions by their standard names (dclens.blas.symbol
    maps them to the library's prefixed ones)."""

    def __init__(self):
        import ctypes

        path = dclens.blas.path()
        if not path:
            raise RuntimeError("cannot find the engine's BLAS library in /proc/self/maps")
        self.lib = ctypes.CDLL(path)

    def __getattr__(self, name):
        return getattr(self.lib, dclens.blas.symbol(name))


def _engine_blas():
    return _EngineBlas()


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


def step_gemms(L, D, F, N, V, B, T):
    """The matrix products of one gpt_neox training step (forward, backward
    with weight gradients), as (transA, transB, M, N, K, beta, count):
    weights [out, in], y = x W^T (NT), dx = dy W (NN), dW += dy^T x (TN);
    attention per (sequence, head), full T x T as flops_per_token counts it."""
    M, Dh, BN = B * T, D // N, B * N
    lin = [(3 * D, D), (D, D), (F, D), (D, F)]  # qkv, out, up, down: (out, in)
    g = []
    for o, i in lin:
        g += [(0, 1, M, o, i, 0.0, L), (0, 0, M, i, o, 0.0, L), (1, 0, o, i, M, 1.0, L)]
    g += [(0, 1, M, V, D, 0.0, 1), (0, 0, M, D, V, 0.0, 1), (1, 0, V, D, M, 1.0, 1)]  # unembedding
    g += [(0, 1, T, T, Dh, 0.0, L * BN), (0, 0, T, Dh, T, 0.0, L * BN)]  # scores, P V
    g += [(0, 1, T, T, Dh, 0.0, L * BN), (1, 0, T, Dh, T, 0.0, L * BN)]  # dP = dZ V^T, dV = P^T dZ
    g += [(0, 0, T, Dh, T, 0.0, L * BN), (1, 0, T, Dh, T, 0.0, L * BN)]  # dQ = dS K, dK = dS^T Q
    return g


def gemm_floor(a, verbose=True):
    """The step's time if everything but its matrix products were free: each
    product of step_gemms timed alone through the engine's cblas_sgemm on one
    thread (as the engine runs it, tile by tile on its pool), summed and
    divided by the thread count (perfect parallel split, no packing shared)."""
    import ctypes

    blas = _engine_blas()
    if hasattr(blas, "openblas_set_num_threads"):
        blas.openblas_set_num_threads(1)
    rng = np.random.default_rng(0)
    P = ctypes.c_void_p
    total_s = total_fl = attn_s = 0.0
    say = print if verbose else (lambda *_: None)
    say("%-3s %5s %5s %5s %5s %6s %9s %8s" % ("op", "M", "N", "K", "beta", "calls", "GFLOP/s", "ms/step"))
    for tA, tB, M, Nn, K, beta, cnt in step_gemms(a.layers, a.dim, 4 * a.dim, a.heads, a.vocab, a.B, a.T):
        A = rng.standard_normal(M * K).astype(np.float32)
        Bm = rng.standard_normal(K * Nn).astype(np.float32)
        C = np.zeros(M * Nn, np.float32)
        args = (101, 112 if tA else 111, 112 if tB else 111, M, Nn, K, ctypes.c_float(1.0), P(A.ctypes.data),
                M if tA else K, P(Bm.ctypes.data), K if tB else Nn, ctypes.c_float(beta), P(C.ctypes.data), Nn)  # fmt: skip
        reps = max(3, int(2e8 / (2 * M * Nn * K)))
        best = np.inf
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                blas.cblas_sgemm(*args)
            best = min(best, (time.perf_counter() - t) / reps)
        fl = 2.0 * M * Nn * K
        total_s += best * cnt
        attn_s += best * cnt if M == a.T else 0.0  # the per-(sequence, head) products
        total_fl += fl * cnt
        say("%-3s %5d %5d %5d %5.0f %6d %9.1f %8.2f" % ("NT"[tA] + "NT"[tB], M, Nn, K, beta, cnt, fl / best / 1e9,
                                                    1e3 * best * cnt))  # fmt: skip
    floor = total_s / a.threads
    say("matrix products of one gpt_neox step: %.2f GFLOP, %.1f GFLOP/s on one thread; on %d threads at that rate: "
          "%.3f s (the step if everything else were free), of which the attention products (full T x T) %.3f s"
          % (total_fl / 1e9, total_fl / total_s / 1e9, a.threads, floor, attn_s / a.threads))  # fmt: skip
    return floor


def machine():
    """'CPU model name; OpenBLAS kernel and build config' of the engine's BLAS."""
    import ctypes

    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    blas = _engine_blas()
    kern = []
    for fn in ("openblas_get_corename", "openblas_get_config"):
        f = getattr(blas, fn, None)
        if f is not None:
            f.restype = ctypes.c_char_p
            kern.append(f().decode().strip())
    pins = ["%s=%s" % (k, os.environ[k]) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ]
    return "CPU: %s (%d cores); OpenBLAS kernel: %s%s" % (
        cpu,
        os.cpu_count(),
        " / ".join(kern) or "?",
        ("; pinned " + " ".join(pins)) if pins else "; no OPENBLAS_CORETYPE pin",
    )


def _trainer(c, vocab):
    """(model, tape, grads, mom, var, hp) of a fresh run of config c."""
    d = tempfile.mkdtemp()
    write_model(d, init_weights(c, vocab), model_config(c, vocab), None)
    m = dclens.load(d, n_threads=c.n_threads)
    lib.dcs_model_make_trainable(m.runner.handle)
    P = int(lib.dcs_param_total(m.runner.handle))
    tape = Tape(m, c.batch_size, c.seq_len)
    hp = ffi.new("dcs_adamw *")
    hp.beta1, hp.beta2, hp.eps, hp.weight_decay = c.beta1, c.beta2, c.eps, c.weight_decay
    return (m, tape) + tuple(np.zeros(P, np.float32) for _ in range(3)) + (hp,)


def time_steps(c, vocab, runs, rounds):
    """Seconds of each `dclens train` step of each list of batches [(x, y)] in
    runs (one model and tape for all: the tape reshapes to each batch), the
    best of `rounds` passes, the lists interleaved within each pass (a shared
    machine: the least disturbed, every list alike), after one warm-up step;
    with the scored tokens of each batch."""
    m, tape, g, mom, var, hp = _trainer(c, vocab)
    train_step(c, m, tape, *runs[0][0], g, mom, var, hp, 1)
    secs = [np.full(len(bs), np.inf) for bs in runs]
    step = 2
    for _ in range(rounds):
        for k, bs in enumerate(runs):
            for i, (x, y) in enumerate(bs):
                t = time.perf_counter()
                train_step(c, m, tape, x, y, g, mom, var, hp, step)
                secs[k][i] = min(secs[k][i], time.perf_counter() - t)
                step += 1
    return [(s, np.array([int((y >= 0).sum()) for _, y in bs])) for s, bs in zip(secs, runs)]


def vs_torch(a):
    """dclens Pythia and DCPythia, PyTorch Pythia: tokens/s of a training step."""
    print(machine())
    rng = np.random.default_rng(0)
    bs = [
        (rng.integers(0, a.vocab, (a.B, a.T)).astype(np.int32), rng.integers(0, a.vocab, (a.B, a.T)).astype(np.int32))
        for _ in range(a.steps)
    ]
    shape = "L=%d D=%d N=%d V=%d B=%d T=%d threads=%d" % (a.layers, a.dim, a.heads, a.vocab, a.B, a.T, a.threads)
    res = {}
    for mt in a.models.split(","):
        c = TrainConfig(
            out="-", model_type=mt, n_layer=a.layers, dim=a.dim, n_head=a.heads, seq_len=a.T,
            batch_size=a.B, n_threads=a.threads, lr=1e-3, warmup=0,
        )  # fmt: skip
        [(secs, _)] = time_steps(c, a.vocab, [bs], 1)
        res[mt] = a.B * a.T / secs.min()
        print("dclens %-9s %s: step %.3f s (best of %d; median %.3f), %.0f tokens/s" % (
            mt, shape, secs.min(), len(secs), np.median(secs), res[mt]))  # fmt: skip
    if a.no_torch or len(res) < 2:
        return
    cmd = [a.torch_python, os.path.join(ROOT, "scripts", "bench_train_torch.py")]
    for k in ("layers", "dim", "heads", "vocab", "T", "B", "steps", "threads"):
        cmd += ["--" + k, str(getattr(a, k))]
    for attn in ("eager", "sdpa"):
        out = subprocess.run(cmd + ["--attn", attn], capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        res["torch-" + attn] = r["tokens_per_s"]
        print("torch  gpt_neox  %s: step %.3f s (best of %d; median %.3f), %.0f tokens/s (torch %s, transformers %s, attention %s, "
              "%d threads, %s)" % (shape, r["step_s"], a.steps, r["median_step_s"], r["tokens_per_s"], r["torch"], r["transformers"], attn,
                                   r["threads"], r["capability"]))  # fmt: skip
    best = max(res["torch-eager"], res["torch-sdpa"])
    print("dclens Pythia / PyTorch Pythia (the faster of eager, sdpa attention): %.2fx (target >= 1.5x)"
          % (res["gpt_neox"] / best))  # fmt: skip
    print("dclens DCPythia / dclens Pythia: %.2fx (target >= 0.9x)" % (res["dcpythia"] / res["gpt_neox"]))


def step_vs_floor(a):
    """--ratio: the gpt_neox step of --vs-torch and its GEMM floor (--gemm-floor)
    in one process, alternated for --ratio-rounds rounds (a shared machine);
    the best of each, and their ratio."""
    print(machine())
    rng = np.random.default_rng(0)
    bs = [
        (rng.integers(0, a.vocab, (a.B, a.T)).astype(np.int32), rng.integers(0, a.vocab, (a.B, a.T)).astype(np.int32))
        for _ in range(a.steps)
    ]
    c = TrainConfig(
        out="-", model_type="gpt_neox", n_layer=a.layers, dim=a.dim, n_head=a.heads, seq_len=a.T,
        batch_size=a.B, n_threads=a.threads, lr=1e-3, warmup=0,
    )  # fmt: skip
    floor = step = np.inf
    for r in range(a.ratio_rounds):
        f = gemm_floor(a, verbose=False)
        [(secs, _)] = time_steps(c, a.vocab, [bs], 1)
        floor, step = min(floor, f), min(step, secs.min())
        print("round %d: floor %.4f s, step %.4f s (best of %d), %.3fx" % (
            r + 1, f, secs.min(), len(secs), secs.min() / f))  # fmt: skip
    print("gpt_neox L=%d D=%d N=%d V=%d B=%d T=%d threads=%d: step %.4f s / GEMM floor %.4f s = %.3fx "
          "(the best of %d rounds each; target <= 1.25x)" % (a.layers, a.dim, a.heads, a.vocab, a.B, a.T, a.threads,
                                                             step, floor, step / floor, a.ratio_rounds))  # fmt: skip


def lines_bench(a):
    """Real tokens/s of the twins' recipe: packed, --lines, --lines --bucket."""
    import itertools

    from dclens.train.loop import _tokenize
    from synth_tasks import corpus

    print(machine())
    texts = list(itertools.islice(corpus.training_texts(stop=a.corpus_lines), a.corpus_lines))
    tok = os.path.join(ROOT, "synth_tasks", "data", "tokenizer.json")
    res = {}
    modes = ("packed", "lines", "bucket")
    for mt in ("gpt_neox", "dcpythia"):
        runs = []
        for mode in modes:
            c = TrainConfig(
                out="-", model_type=mt, n_layer=4, dim=192, n_head=6, seq_len=288, batch_size=40,
                window_size=32 if mt == "dcpythia" else None, lines=mode != "packed", bucket=mode == "bucket",
                tokenizer=tok, n_threads=a.threads, lr=1e-3, warmup=0,
            )  # fmt: skip
            toks, offs, vocab, _ = _tokenize(c, texts, os.path.join(tempfile.mkdtemp(), "tokenizer.json"))
            o2 = np.stack([offs[:-1], offs[1:]], 1) if c.lines else None
            runs.append([batch(toks, c, s, o2) for s in range(1, a.lines_steps + 1)])
        for mode, bs, (secs, real) in zip(modes, runs, time_steps(c, vocab, runs, a.rounds)):
            T = [x.shape[1] for x, _ in bs]
            res[mt, mode] = real.sum() / secs.sum()
            print("dclens %-9s %-6s B=40 T=%s: %.0f real tokens/s, %.0f%% of the batch tokens scored" % (
                mt, mode, T[0] if mode != "bucket" else "%d..%d (mean %.0f)" % (min(T), max(T), np.mean(T)),
                res[mt, mode], 100 * real.sum() / sum(x.size for x, _ in bs)))  # fmt: skip
        group = [batch(toks, c, s, o2)[1] for s in range(1, BUCKET_STEPS + 1)]  # c: the bucket config
        print("dclens %-9s bucket: %.1f%% of the batch tokens scored over all %d batches of a group (mean T %.0f)" % (
            mt, 100 * sum((y >= 0).sum() for y in group) / sum(y.size for y in group), BUCKET_STEPS,
            np.mean([y.shape[1] for y in group])))  # fmt: skip
        for mode in ("lines", "bucket"):
            print("dclens %s --%s / packed, real tokens/s: %.2fx (target >= 0.9x)" % (
                mt, "lines --bucket" if mode == "bucket" else "lines", res[mt, mode] / res[mt, "packed"]))  # fmt: skip


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vs-torch", action="store_true", help="dclens vs PyTorch eager, one run")
    p.add_argument("--torch-python", default="/work/venvs/torch/bin/python", help="python of the torch venv")
    p.add_argument("--models", default="gpt_neox,dcpythia", help="--vs-torch: the dclens model types to time")
    p.add_argument("--no-torch", action="store_true", help="--vs-torch: the dclens steps only (no ratios)")
    p.add_argument("--gemm-floor", action="store_true", help="the step's matrix products alone (gpt_neox shapes)")
    p.add_argument("--ratio", action="store_true", help="the gpt_neox step / its GEMM floor, in one process")
    p.add_argument("--ratio-rounds", type=int, default=3, help="--ratio: alternated rounds of floor and step")
    p.add_argument("--lines", action="store_true", help="the twins' recipe: packed vs lines vs bucketed lines")
    p.add_argument("--lines-steps", type=int, default=8)
    p.add_argument("--corpus-lines", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=2, help="--lines: passes over the steps, the best of each kept")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-type", default="dcpythia")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--B", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    if a.gemm_floor:
        if a.vocab == 1024:
            a.vocab = 2210
        print(machine())
        return gemm_floor(a)
    if a.ratio:
        if a.vocab == 1024:
            a.vocab = 2210
        return step_vs_floor(a)
    if a.vs_torch or a.lines:
        if a.vocab == 1024:  # the bundled tokenizer's vocabulary (the training's [M, 2210] unembedding)
            a.vocab = 2210
        return vs_torch(a) if a.vs_torch else lines_bench(a)
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
