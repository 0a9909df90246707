"""Benchmarks of the CPU engine (issue 12), every ratio from one run.

    python scripts/bench.py [--quick] [--sizes 160m,1.4b,6.9b] [--T 128,512,2048]
                            [--out BENCHMARKS.json]
    python scripts/bench.py --mem-6.9b DIR     # the full 6.9B-shaped fp16 memory test

    # issue 28's command: the BLAS kernels a user gets (no machine pin), the
    # forward against the same-run sgemm and the 1 vs 2 thread scaling
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench.py \
        --sizes d1024,1.4b --T 512 --no-extras --scaling 1,2

Which BLAS and kernel ran is printed (the engine's own library, scipy-openblas32's
libscipy_openblas.so by default: dclens.blas, in the engine's process and in the
sgemm subprocess), and so is any
OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE pin found in the environment: a pin set
by a machine's administrator (some EPYC hosts pin a slower Haswell kernel)
changes both the engine and the sgemm it is compared with, but users' machines
have none, so the documented command removes it (env -u; never in tests or CI).

For DCPythia and its Pythia twin at the published widths (random weights,
generated on the fly; layer counts reduced for time, printed), at each T:
  - tokens/s of the prefill (forward with logits_at="last": the layer stack
    plus one unembedding row per sequence, what a prompt pass costs);
  - achieved GFLOP/s (the matmul FLOPs of the pass, causal attention counted
    as half of T x T) next to the GFLOP/s of a plain OpenBLAS sgemm of the same
    shapes (the engine's own libopenblas with its own 2 threads, in a
    subprocess so its spinning threads do not share the cores with the engine);
  - the DCPythia/Pythia time ratio (wall, and process CPU time, which outside
    load on the shared cores disturbs less) next to the paper's theoretical extra FLOPs
    4(2R+1)(1+rho)/((12+rho) Dh), rho = T/D (model-spec.md, Cost), and the
    issue's bound 1 + 1.5 x that;
  - peak RSS (VmHWM) of a fresh process that imports dclens, loads the model
    and runs one pass, against stored weights + the pass's activations (the
    interpreter, numpy and the bindings alone hold the "import" column).
Then: hook-capture overhead (every hook vs none), and the time of one
synthetic-benchmark line (with the unembedding only at the answer positions,
and with full logits).

The --mem-6.9b test writes a DCPythia-6.9B-shaped fp16 checkpoint (32 layers,
13.8 GB, streamed to DIR, never held in memory), runs a T=512 pass in a fresh
process, reports peak RSS against 1.15 x (stored weights + activations), and
deletes the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

# published widths (Pythia / DCPythia), layers used here, dtype of the files
SIZES = {
    "160m": dict(dim=768, n_head=12, intermediate=3072, vocab=50304, n_layer=12, bench_layers=4, dtype="float32"),
    "1.4b": dict(dim=2048, n_head=16, intermediate=8192, vocab=50304, n_layer=24, bench_layers=2, dtype="float32"),
    "6.9b": dict(dim=4096, n_head=32, intermediate=16384, vocab=50432, n_layer=32, bench_layers=2, dtype="float16"),
    # the issue's own ratio check (not in the default set): D=1024, 16 heads, 2 layers, vocab 2048
    "d1024": dict(dim=1024, n_head=16, intermediate=4096, vocab=2048, n_layer=2, bench_layers=2, dtype="float32"),
    # hook overhead on a small model (--hooks-only --sizes small): the copies, not the matmuls
    "small": dict(dim=256, n_head=8, intermediate=1024, vocab=2048, n_layer=2, bench_layers=2, dtype="float32"),
}
R = 2  # dynamic rank
WINDOW = 256  # published window (layers 0, 2, ... local)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def best_of(fn, repeat, clock=time.perf_counter):
    """Best time of `repeat` calls (after one warm-up): wall, or the given clock."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def theory_extra(T, D, Dh):
    rho = T / D
    return 4 * (2 * R + 1) * (1 + rho) / ((12 + rho) * Dh)


def pass_flops(s, L, T, dcp):
    """Matmul FLOPs of one prefill pass (logits at one position)."""
    D, F, V, N = s["dim"], s["intermediate"], s["vocab"], s["n_head"]
    lin = 2 * T * (4 * D * D + 2 * D * F)
    att = 2 * T * (T + 1) * D  # q k^T and P v, causal half
    if dcp:  # local layers: keys within the window
        att_local = 4 * D * sum(min(t, WINDOW) + 1 for t in range(T))
        att = (att * (L // 2) + att_local * ((L + 1) // 2)) / L
        C, K = 4, 4 * N
        lin += 2 * T * D * (C * K + C * N) + 2 * T * C * K * 2 * R * N
    return L * (lin + att) + 2 * D * V


SGEMM_SRC = r"""
import ctypes, ctypes.util, json, sys, time
import numpy as np
lib = ctypes.CDLL(sys.argv[1])
pre = sys.argv[4]  # "scipy_" for scipy-openblas32's prefixed names
getattr(lib, pre + "openblas_set_num_threads")(int(sys.argv[2]))
shapes = json.loads(sys.argv[3])
P = ctypes.c_void_p
f = getattr(lib, pre + "cblas_sgemm")
f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, P, ctypes.c_int, P, ctypes.c_int, ctypes.c_float, P, ctypes.c_int]
out = []
getattr(lib, pre + "openblas_get_corename").restype = ctypes.c_char_p
core = getattr(lib, pre + "openblas_get_corename")().decode()
for M, N, K in shapes:
    a = np.random.default_rng(0).standard_normal((M, K), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((N, K), dtype=np.float32)
    c = np.empty((M, N), np.float32)
    call = lambda: f(101, 111, 112, M, N, K, 1.0, a.ctypes.data, K, b.ctypes.data, K, 0.0, c.ctypes.data, N)
    call()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter(); call(); ts.append(time.perf_counter() - t0)
    out.append(min(ts))
print(json.dumps({"times": out, "core": core}))
"""


def openblas_path():
    """The engine's BLAS library file, as this process mapped it (dclens.blas.path)."""
    import dclens

    path = dclens.blas.path()
    if not path:
        raise RuntimeError("cannot find the engine's BLAS library in /proc/self/maps")
    return path


def blas_prefix():
    import dclens

    return dclens.blas.symbol("")


def sgemm_gflops(s, T, threads):
    """GFLOP/s of a plain sgemm over the pass's linear shapes (x W^T, M = T)."""
    D, F = s["dim"], s["intermediate"]
    shapes = [(T, 3 * D, D), (T, D, D), (T, F, D), (T, D, F)]
    r = subprocess.run(
        [sys.executable, "-c", SGEMM_SRC, openblas_path(), str(threads), json.dumps(shapes), blas_prefix()],
        capture_output=True,
        text=True,
        check=True,
    )
    res = json.loads(r.stdout)
    if res["core"] != blas_info()["core"]:
        raise RuntimeError(
            "the sgemm subprocess ran OpenBLAS kernel %s, the engine %s" % (res["core"], blas_info()["core"])
        )
    flops = sum(2 * m * n * k for m, n, k in shapes)
    return flops / sum(res["times"]) / 1e9


PINS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def blas_info():
    """The BLAS the engine links, as loaded in this process: which library, its file,
    its kernel (core name), build config, and the pin variables present in the
    environment."""
    import dclens

    pins = {k: os.environ[k] for k in PINS if k in os.environ}
    return dict(
        library=dclens.blas.library(),
        path=openblas_path(),
        core=dclens.blas.kernel(),
        config=dclens.blas.config(),
        pins=pins,
    )


def blas_line(info):
    pins = ", ".join("%s=%s" % kv for kv in info["pins"].items()) or "none (unpinned, as on users' machines)"
    return "BLAS that ran: %s, kernel %s (%s; %s); environment pin: %s" % (
        info.get("library", "?"),
        info["core"],
        info["config"],
        info["path"],
        pins,
    )


RSS_SRC = r"""
import json, resource, sys, time
import numpy as np
import dclens
rss0 = int([l for l in open("/proc/self/status") if l.startswith("VmRSS:")][0].split()[1]) * 1024
m = dclens.load(sys.argv[1])
T = int(sys.argv[2])
toks = np.random.default_rng(0).integers(0, m.config.vocab, size=(1, T))
t0 = time.perf_counter()
m.forward(toks, logits_at="last")
dt = time.perf_counter() - t0
mem = m.last_pass_memory()
# VmHWM: this process image's peak (ru_maxrss keeps the forking parent's peak across exec)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({"maxrss": int(hwm.split()[1]) * 1024, "import_rss": rss0,
                  "act_peak": mem["peak"], "pass_s": dt}))
"""


def peak_rss(d, T):
    r = subprocess.run([sys.executable, "-c", RSS_SRC, d, str(T)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    res = json.loads(r.stdout)
    res["stored"] = sum(
        os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith((".safetensors", ".bin"))
    )
    return res


def make_pair(tmp, name, s, L):
    from dclens.testing.make_tiny import make_tiny

    kw = dict(
        n_layer=L,
        dim=s["dim"],
        n_head=s["n_head"],
        intermediate=s["intermediate"],
        vocab=s["vocab"],
        dtype=s["dtype"],
        seed=1,
    )
    dirs = {}
    for mt in ("dcpythia", "gpt_neox"):
        d = os.path.join(tmp, "%s-%s" % (name, mt))
        extra = dict(window_size=WINDOW) if mt == "dcpythia" else {}
        make_tiny(d, model_type=mt, **kw, **extra)
        dirs[mt] = d
    return dirs


def time_pair(dirs, name, s, Ts, repeat, threads):
    """Rows of the forward table for the generated pair in `dirs` at
    `threads` threads: both models loaded, runs interleaved (DCPythia,
    Pythia, DCPythia, ...): the cores are shared, and a ratio of two
    best-of-n taken side by side is what stays stable under outside load.
    The sgemm runs after, in a subprocess, on the same thread count."""
    import dclens

    L = s["bench_layers"]
    D, N = s["dim"], s["n_head"]
    models = {mt: dclens.load(dirs[mt], n_threads=threads) for mt in ("dcpythia", "gpt_neox")}
    times, cpu = {}, {}
    for T in Ts:
        toks = np.random.default_rng(0).integers(0, s["vocab"], size=(1, T))
        for m in models.values():
            m.forward(toks, logits_at="last")  # warm-up
        for _ in range(repeat):
            for mt, m in models.items():
                t0, c0 = time.perf_counter(), time.process_time()
                m.forward(toks, logits_at="last")
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                times[mt, T] = min(times.get((mt, T), dt), dt)
                cpu[mt, T] = min(cpu.get((mt, T), dc), dc)
        log(
            "   %d thread(s), T=%d: DCPythia %.3f s, Pythia %.3f s"
            % (threads, T, times["dcpythia", T], times["gpt_neox", T])
        )
    del models
    rows = []
    for T in Ts:
        sg = sgemm_gflops(s, T, threads)
        td, tn = times["dcpythia", T], times["gpt_neox", T]
        th = theory_extra(T, D, D // N)
        rows.append(
            dict(
                size=name,
                layers=L,
                dtype=s["dtype"],
                T=T,
                threads=threads,
                dcp_s=td,
                neox_s=tn,
                dcp_tok_s=T / td,
                neox_tok_s=T / tn,
                dcp_gflops=pass_flops(s, L, T, True) / td / 1e9,
                neox_gflops=pass_flops(s, L, T, False) / tn / 1e9,
                sgemm_gflops=sg,
                ratio=td / tn,
                cpu_ratio=cpu["dcpythia", T] / cpu["gpt_neox", T],
                theory=th,
                bound=1 + 1.5 * th,
            )
        )
        log("   %d thread(s), T=%d: sgemm %.1f GFLOP/s" % (threads, T, sg))
    return rows


def bench_size(tmp, name, s, Ts, repeat, threads_list, rss=True):
    """The forward table's rows at each thread count of threads_list (the
    pair generated once), then (rss) the peak RSS rows."""
    L = s["bench_layers"]
    log("== %s-shaped: generating %d-layer DCPythia and Pythia (%s)" % (name, L, s["dtype"]))
    dirs = make_pair(tmp, name, s, L)
    rows = []
    for threads in threads_list:
        rows += time_pair(dirs, name, s, Ts, repeat, threads)
    for mt in ("dcpythia", "gpt_neox") if rss else ():
        r = peak_rss(dirs[mt], 512 if 512 in Ts else Ts[0])
        rows_rss = dict(size=name, model=mt, T=512 if 512 in Ts else Ts[0], **r)
        rows_rss["ratio"] = r["maxrss"] / (r["stored"] + r["act_peak"])
        rows.append(rows_rss)
        log(
            "   peak RSS %s: %.2f GiB (stored %.2f GiB + activations %.2f GiB)"
            % (mt, r["maxrss"] / 2**30, r["stored"] / 2**30, r["act_peak"] / 2**30)
        )
    for d in dirs.values():
        shutil.rmtree(d)
    return rows


def scaling_rows(rows):
    """Parallel efficiency t(1) / (k t(k)) of each model and of the sgemm,
    per (size, T), from time_pair rows that include 1 thread."""
    out = []
    one = {(r["size"], r["T"]): r for r in rows if r["threads"] == 1}
    for r in rows:
        b = one.get((r["size"], r["T"]))
        if b is None or r["threads"] == 1:
            continue
        k = r["threads"]
        out.append(
            dict(
                size=r["size"],
                T=r["T"],
                threads=k,
                dcp_eff=b["dcp_s"] / (k * r["dcp_s"]),
                neox_eff=b["neox_s"] / (k * r["neox_s"]),
                sgemm_eff=r["sgemm_gflops"] / (k * b["sgemm_gflops"]),
            )
        )
    return out


def bench_hooks(tmp, repeat, threads, Ts=(256, 512), clock=time.perf_counter, size="160m"):
    """Capture every hook vs capture nothing, and a hook function at every
    hook point: one that may write (the default: copied back) and one
    declared read-only (dclens.read_only: no copy back; absent before it
    existed) (`size` widths, 160M by default, 2 layers). clock: wall time, or time.process_time
    (--hooks-only: CPU time, which load on shared cores disturbs less)."""
    import dclens
    from dclens.testing.make_tiny import make_tiny

    s = SIZES[size]
    d = os.path.join(tmp, "hooks")
    make_tiny(
        d,
        model_type="dcpythia",
        n_layer=2,
        dim=s["dim"],
        n_head=s["n_head"],
        intermediate=s["intermediate"],
        vocab=s["vocab"],
        window_size=WINDOW,
        seed=2,
    )
    m = dclens.load(d, n_threads=threads)
    names = m.hook_names

    def noop(act, name):
        return None

    look = dclens.read_only(noop) if hasattr(dclens, "read_only") else None
    out = []
    for T in Ts:
        toks = np.random.default_rng(0).integers(0, s["vocab"], size=(1, T))
        t0 = best_of(lambda toks=toks: m.forward(toks), repeat, clock)
        t1 = best_of(lambda toks=toks: m.run_with_cache(toks), repeat, clock)
        t2 = best_of(lambda toks=toks: m.run_with_hooks(toks, [(n, noop) for n in names]), repeat, clock)
        t3 = (
            best_of(lambda toks=toks: m.run_with_hooks(toks, [(n, look) for n in names]), repeat, clock)
            if look
            else None
        )
        out.append(
            dict(
                T=T,
                plain_s=t0,
                capture_all_s=t1,
                ratio=t1 / t0,
                hooks=len(names),
                fn_all_s=t2,
                fn_ratio=t2 / t0,
                read_only_all_s=t3,
                read_only_ratio=t3 / t0 if t3 else None,
            )
        )
        log(
            "   hooks T=%d: plain %.3f s, capture all %d hooks %.3f s (%.2fx), a function at every hook %.3f s "
            "(%.2fx), read-only %s"
            % (T, t0, len(names), t1, t1 / t0, t2, t2 / t0, "%.3f s (%.2fx)" % (t3, t3 / t0) if t3 else "n/a")
        )
    m = None  # drop the model before its files go
    shutil.rmtree(d)
    return out


class _DenseLogits:
    """The same model without logits_at (the evaluator then takes all logits)."""

    def __init__(self, m):
        self.m, self.config, self.tokenizer, self.name = m, m.config, m.tokenizer, "dense"

    def forward(self, tokens):
        return self.m.forward(tokens)


def bench_synth_line(tmp, threads, n_lines):
    """Seconds per synthetic-benchmark line, 160M widths (4 layers)."""
    import dclens
    from dclens.testing.make_tiny import make_tiny
    from synth_tasks import evaluate, load_dataset

    data = os.path.join(os.path.dirname(ROOT), "shared", "data", "synthetic_dataset.jsonl")
    tok = os.path.join(os.path.dirname(ROOT), "shared", "data", "gpt-neox-20b-tokenizer.json")
    if not (os.path.exists(data) and os.path.exists(tok)):
        log("   synthetic line: shared data not found, skipped")
        return None
    s = SIZES["160m"]
    d = os.path.join(tmp, "synth")
    make_tiny(
        d,
        model_type="dcpythia",
        n_layer=4,
        dim=s["dim"],
        n_head=s["n_head"],
        intermediate=s["intermediate"],
        vocab=s["vocab"],
        window_size=WINDOW,
        seed=3,
        tokenizer=tok,
    )
    m = dclens.load(d, n_threads=threads)
    lines = load_dataset(data).lines[:n_lines]
    evaluate(m, lines[:2])
    t0 = time.perf_counter()
    evaluate(m, lines)
    sparse = (time.perf_counter() - t0) / len(lines)
    t0 = time.perf_counter()
    evaluate(_DenseLogits(m), lines)
    dense = (time.perf_counter() - t0) / len(lines)
    log("   synthetic line: %.3f s (logits at answers), %.3f s (all logits)" % (sparse, dense))
    m = None  # drop the model before its files go
    shutil.rmtree(d)
    return dict(lines=len(lines), s_per_line=sparse, s_per_line_all_logits=dense)


# ------------------------------------------------------------ 6.9B memory test


def write_69b_fp16(d, n_layer=32):
    """A DCPythia-6.9B-shaped fp16 safetensors checkpoint, streamed: every
    tensor is written from one reused random block, so Python never holds
    more than a few MB of it."""
    s = SIZES["6.9b"]
    D, N, F, V = s["dim"], s["n_head"], s["intermediate"], s["vocab"]
    Dh, K = D // N, 4 * N
    os.makedirs(d, exist_ok=True)
    cfg = {
        "model_type": "dcpythia",
        "dim": D,
        "n_head": N,
        "head_dim": Dh,
        "n_layer": n_layer,
        "intermediate_size": F,
        "vocab_size": V,
        "norm_eps": 1e-5,
        "rope_base": 10000,
        "rotary_pct": 0.25,
        "use_qk_norm": True,
        "use_parallel_residual": True,
        "use_linear_bias": True,
        "window_size": 256,
        "window_type": None,
        "query_wise": False,
        "use_dcmha": True,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = [("tok_embeddings.weight", (V, D), 0.02)]
    for l in range(n_layer):
        p = "layers.%d." % l
        tensors += [
            (p + "attention_norm.weight", (D,), 1.0),
            (p + "attention_norm.bias", (D,), 0.0),
            (p + "ffn_norm.weight", (D,), 1.0),
            (p + "ffn_norm.bias", (D,), 0.0),
            (p + "attention.wqkv.weight", (3 * D, D), 0.02),
            (p + "attention.wqkv.bias", (3 * D,), 0.0),
            (p + "attention.wo.weight", (D, D), 0.02),
            (p + "attention.wo.bias", (D,), 0.0),
            (p + "attention.q_norm.scale", (Dh,), 1.0),
            (p + "attention.k_norm.scale", (Dh,), 1.0),
            (p + "attention.dyn_w_proj.dw1", (D, 1, 4, K), 0.02),
            (p + "attention.dyn_w_proj.qkw", (1, 4, K, 2 * R, N), 0.05),
            (p + "attention.dyn_w_proj.dd", (D, 1, 4 * N), 0.02),
            (p + "feed_forward.w1.weight", (F, D), 0.02),
            (p + "feed_forward.w1.bias", (F,), 0.0),
            (p + "feed_forward.w2.weight", (D, F), 0.01),
            (p + "feed_forward.w2.bias", (D,), 0.0),
        ]
    tensors += [("norm.weight", (D,), 1.0), ("norm.bias", (D,), 0.0), ("output.weight", (V, D), 0.02)]
    return stream_f16_safetensors(os.path.join(d, "model.safetensors"), tensors)


def stream_f16_safetensors(path, tensors):
    """Write [(name, shape, scale)] as one F16 safetensors file, streamed:
    every tensor from one reused random block (scale 0 or 1: that constant),
    so Python never holds more than a few MB. Returns the data bytes."""
    header, off = {}, 0
    for name, shape, _ in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    block = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float16)  # 8 MB
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for i, (_, shape, scale) in enumerate(tensors):
            n = int(np.prod(shape))
            if scale in (0.0, 1.0):
                chunk = np.full(min(n, block.size), scale, np.float16)
            else:
                chunk = (np.roll(block, i * 7919) * np.float16(scale)).astype(np.float16)
            left = n
            while left:
                k = min(left, chunk.size)
                f.write(chunk[:k].tobytes())
                left -= k
    return off


def mem_69b(d, T=512):
    st = os.statvfs(os.path.dirname(os.path.abspath(d)) or ".")
    if st.f_bavail * st.f_frsize < 16 * 2**30:
        raise SystemExit("--mem-6.9b needs 16 GiB free disk at %s" % d)
    log("== 6.9B-shaped fp16 memory test: writing 32 layers to %s" % d)
    t0 = time.perf_counter()
    nbytes = write_69b_fp16(d)
    log("   wrote %.2f GB in %.0f s; one T=%d pass in a fresh process" % (nbytes / 1e9, time.perf_counter() - t0, T))
    try:
        r = peak_rss(d, T)
    finally:
        shutil.rmtree(d)
    r["T"] = T
    r["limit"] = 1.15 * (r["stored"] + r["act_peak"])
    r["ratio"] = r["maxrss"] / (r["stored"] + r["act_peak"])
    print(
        "6.9B-shaped DCPythia, fp16 safetensors, 32 layers, T=%d: peak RSS %.2f GiB; stored weights %.2f GiB"
        " + activations %.3f GiB; ratio %.3f (target <= 1.15); pass %.1f s"
        % (T, r["maxrss"] / 2**30, r["stored"] / 2**30, r["act_peak"] / 2**30, r["ratio"], r["pass_s"])
    )
    return r


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="160M and 1.4B widths, T=128,512, one repeat")
    p.add_argument("--sizes", default="160m,1.4b,6.9b")
    p.add_argument("--T", default="128,512,2048", help="sequence lengths (comma separated)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--synth-lines", type=int, default=16)
    p.add_argument("--mem-6.9b", dest="mem69", metavar="DIR", help="run only the 6.9B fp16 memory test in DIR")
    p.add_argument("--out", default=None, help="also write the numbers as JSON here")
    p.add_argument(
        "--scaling",
        default=None,
        metavar="1,2,...",
        help="time the forward at each of these thread counts (include 1) and print the parallel efficiency",
    )
    p.add_argument("--no-extras", action="store_true", help="only the forward table(s): no peak RSS, hooks, synth line")
    p.add_argument(
        "--hooks-only",
        action="store_true",
        help="only the hook measurements, at --T, on the first of --sizes, in CPU time",
    )
    a = p.parse_args(argv)
    if a.hooks_only:
        with tempfile.TemporaryDirectory(dir=os.environ.get("DCLENS_BENCH_TMP")) as tmp:
            size = a.sizes.split(",")[0]
            rows = bench_hooks(tmp, a.repeat, a.threads, [int(t) for t in a.T.split(",")], time.process_time, size)
        print(
            "%s widths (%s); process CPU time, %d thread(s), best of %d"
            % (size, ", ".join("%s %s" % kv for kv in SIZES[size].items()), a.threads, a.repeat)
        )
        _print_hooks(rows, size)
        return 0
    if a.mem69:
        r = mem_69b(a.mem69)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(r, f, indent=1)
        return 0
    sizes = a.sizes.split(",")
    Ts = [int(t) for t in a.T.split(",")]
    repeat = a.repeat
    if a.quick:
        sizes, Ts, repeat = ["160m", "1.4b"], [128, 512], 1
    threads_list = [int(t) for t in a.scaling.split(",")] if a.scaling else [a.threads]
    res = {
        "machine": "%s, %d cores" % (platform.processor() or platform.machine(), os.cpu_count()),
        "blas": blas_info(),
        "threads": threads_list,
        "window": WINDOW,
        "rows": [],
        "rss": [],
    }
    with tempfile.TemporaryDirectory(dir=os.environ.get("DCLENS_BENCH_TMP")) as tmp:
        for name in sizes:
            for r in bench_size(tmp, name, SIZES[name], Ts, repeat, threads_list, rss=not a.no_extras):
                (res["rss"] if "maxrss" in r else res["rows"]).append(r)
        res["scaling"] = scaling_rows(res["rows"])
        res["hooks"] = res["synth"] = None
        if not a.no_extras:
            log("== hook capture")
            res["hooks"] = bench_hooks(tmp, repeat, threads_list[-1])
            log("== synthetic benchmark line")
            res["synth"] = bench_synth_line(tmp, threads_list[-1], a.synth_lines)

    print(
        "Machine: %s; %s thread(s); DCPythia window %d (even layers local); prefill = forward(logits_at='last')"
        % (res["machine"], ",".join(map(str, threads_list)), WINDOW)
    )
    print(blas_line(res["blas"]))
    print()
    print(
        "| shape (layers, weights) | threads | T | DCPythia tok/s | Pythia tok/s | DCPythia GFLOP/s | Pythia GFLOP/s"
        " | sgemm GFLOP/s (same shapes) | Pythia / sgemm | DCPythia / sgemm | DCPythia / Pythia time"
        " | same, CPU time | theory extra FLOPs | bound 1 + 1.5 x theory |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        print(
            "| %s (%d, %s) | %d | %d | %.0f | %.0f | %.1f | %.1f | %.1f | %.0f%% | %.0f%% | %.3f | %.3f | %.2f%% | %.3f |"
            % (
                r["size"],
                r["layers"],
                r["dtype"],
                r["threads"],
                r["T"],
                r["dcp_tok_s"],
                r["neox_tok_s"],
                r["dcp_gflops"],
                r["neox_gflops"],
                r["sgemm_gflops"],
                100 * r["neox_gflops"] / r["sgemm_gflops"],
                100 * r["dcp_gflops"] / r["sgemm_gflops"],
                r["ratio"],
                r["cpu_ratio"],
                100 * r["theory"],
                r["bound"],
            )
        )
    if res["scaling"]:
        print()
        print("| parallel efficiency t(1) / (k t(k)) | T | k threads | DCPythia | Pythia | sgemm (same shapes) |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in res["scaling"]:
            print(
                "| %s | %d | %d | %.0f%% | %.0f%% | %.0f%% |"
                % (r["size"], r["T"], r["threads"], 100 * r["dcp_eff"], 100 * r["neox_eff"], 100 * r["sgemm_eff"])
            )
    if res["rss"]:
        _print_rss(res["rss"])
    if res["hooks"]:
        print()
        _print_hooks(res["hooks"])
    if res["synth"]:
        s = res["synth"]
        print()
        print(
            "Synthetic benchmark (160M widths, 4 layers, %d lines): %.3f s per line with logits at the answer"
            " positions, %.3f s with all logits." % (s["lines"], s["s_per_line"], s["s_per_line_all_logits"])
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _print_rss(rows):
    print()
    print(
        "| peak RSS (fresh process, load + one pass) | T | peak RSS GiB | of which import GiB | stored weights GiB | activations GiB | RSS / (weights + activations) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            "| %s %s | %d | %.2f | %.2f | %.2f | %.3f | %.3f |"
            % (
                r["size"],
                r["model"],
                r["T"],
                r["maxrss"] / 2**30,
                r["import_rss"] / 2**30,
                r["stored"] / 2**30,
                r["act_peak"] / 2**30,
                r["ratio"],
            )
        )


def _print_hooks(rows, size="160m"):
    print("| hooks (%s widths, 2 layers, DCPythia) | T | plain s | every hook s | ratio |" % size)
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            "| run_with_cache() of all %d hooks vs forward() | %d | %.3f | %.3f | %.2fx |"
            % (r["hooks"], r["T"], r["plain_s"], r["capture_all_s"], r["ratio"])
        )
        print(
            "| run_with_hooks(): a function at all %d hooks | %d | %.3f | %.3f | %.2fx |"
            % (r["hooks"], r["T"], r["plain_s"], r["fn_all_s"], r["fn_ratio"])
        )
        if r["read_only_all_s"]:
            print(
                "| same, dclens.read_only(function) | %d | %.3f | %.3f | %.2fx |"
                % (r["T"], r["plain_s"], r["read_only_all_s"], r["read_only_ratio"])
            )


if __name__ == "__main__":
    sys.exit(main())
