"""Gradients and integrated gradients on a DCPythia-6.9B-shaped fp16 checkpoint
(issue 23): peak RSS against the stored weights, seconds per IG step, and the
backward's achieved GFLOP/s against a same-run OpenBLAS sgemm.

    python scripts/bench_grad.py DIR [--layers 32] [--T 128] [--steps 16]
                                 [--max-tape-gib 2.5] [--check-fd] [--keep]
                                 [--device cuda] [--dtype bfloat16] [--sensitivity]

Writes the checkpoint (bench.write_69b_fp16: D=4096, 32 heads, F=16384,
vocab 50432, fp16, streamed) to DIR, then in a fresh process: loads it, runs
`gradients` w.r.t. blocks.{--hook-layer, default min(16, L-1)}.attn.head_out at T (target: the
logit of token 0 at the last position) through a Tape with the forward and
the backward timed apart, then `attribute(..., steps=STEPS)` on the same
prompt; VmHWM after each. The limit of the issue: peak RSS <= 1.25 x stored
weights + 1 GiB. --device cuda: the same on the GPU (weights and tape in GPU
memory: the GPU's free memory before and after the load and the tape's
peak are reported instead of the RSS limit), against a same-run float32
cuBLAS GEMM of the same shapes through PyTorch (TF32 off) where torch is
installed. --check-fd (meant for --layers 2): central differences of the
float64 reference (tests/reference.py, weights read as stored, fp16) at a few
entries of the gradient, at T=8, step --fd-eps (--fd-only: nothing else). DIR is deleted afterwards unless --keep.
--sensitivity (only that): how much the last logits move when the residual
entering layer 0 is multiplied by (1 + 1e-7 noise), float32's rounding: near
1e-7 a model whose passes can be compared across devices at all; near 1 one
whose rounding differences grow to the size of the logits (the random
checkpoint at 32 layers).

Backward FLOPs counted (activation gradients only, layers from the top down
to the hook's layer): per layer 2T(4D^2 + 2DF) for dx of the linears,
2TD(CK + CN) + 2T CK 2RN for the dynamic-weight projections, 8 T^2 D for
the four per-head products of the attention maps (the tape's maps are full
T x T), and 2TVD for the unembedding; the recomputation of a layer (when the
tape recomputes) is counted as its forward.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import bench  # noqa: E402  (write_69b_fp16, sgemm_gflops, SIZES)

RUN_SRC = r"""
import json, sys, time
import numpy as np
import dclens
from dclens.analysis.grad import Tape, target_value_and_grad

def hwm():
    return int([l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]) * 1024

d, T, steps, budget, layer, dev = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) or None, int(sys.argv[5]), sys.argv[6]
m = dclens.load(d, device=dev, dtype=sys.argv[7])
from dclens import memplan
budget = memplan.check_budget(budget, m)   # None (--max-tape-gib 0): the default, from the device's free memory
L = m.config.n_layer
layer = layer if layer >= 0 else min(16, L - 1)
at = "blocks.%d.attn.head_out" % layer
toks = np.random.default_rng(0).integers(0, m.config.vocab, T)
target = ("logit", -1, 0)
res = {"layer": layer, "load_rss": hwm(), "device": dev, "budget": budget}
res["gpu_free_after_load"] = memplan.device_memory(m)
t0 = time.perf_counter()
tp = Tape(m, 1, T, budget)
lg = tp.forward(toks)
t1 = time.perf_counter()
_, dl = target_value_and_grad(target, lg, toks[None])
g = tp.backward(dl, None, [m.parse_hook(at)])
t2 = time.perf_counter()
res.update(forward_s=t1 - t0, backward_s=t2 - t1, tape=tp.memory(), grad_norm=float(np.linalg.norm(g[m.parse_hook(at)])))
del tp, g
res["grad_rss"] = hwm()
res["gpu_free_after_grad"] = memplan.device_memory(m)
res["last_pass_memory"] = m.last_pass_memory()
res["estimate"] = m.estimate_backward_memory(T, 1, [at], max_tape_bytes=budget)
t0 = time.perf_counter()
r = m.attribute(toks, target, [at], steps=steps, max_tape_bytes=budget, progress=False)
res["ig_s"] = time.perf_counter() - t0
res["ig_rss"] = hwm()
res["ig_last_pass_memory"] = m.last_pass_memory()
res["ig_gap"] = float(r.gap[at])
res["ig_target"] = float(r.target_value)             # F(a)
res["ig_baseline_value"] = float(r.baseline_value[at])  # F(a0)
res["ig_per_head"] = [float(v) for v in r.per_head[at]]  # to compare devices head by head
res["ig_top_heads"] = [int(i) for i in np.argsort(-np.abs(r.per_head[at]))[:3]]
res["ig_batch"] = memplan.ig_batch(m, T, steps, m.parse_hook(at)[0], budget, layer)   # IG's tapes start at the hook's layer
print(json.dumps(res))
"""

SENS_SRC = r"""
import json, sys
import numpy as np
import dclens
m = dclens.load(sys.argv[1], device=sys.argv[3])
toks = np.random.default_rng(0).integers(0, m.config.vocab, int(sys.argv[2]))
base = m.forward(toks)[-1]
rng = np.random.default_rng(1)
def fn(act, name):
    act *= 1 + 1e-7 * rng.standard_normal(act.shape).astype(np.float32)
    return act
out = m.run_with_hooks(toks, [("blocks.0.resid_pre", fn)])[-1]
print(json.dumps({"logit": float(base[0]), "perturbed": float(out[0]),
                  "rel": float(np.abs(out - base).max() / np.abs(base).max())}))
"""

FD_SRC = r"""
import json, sys
import numpy as np
import dclens
import reference as R
d = sys.argv[1]
hdr_len = int.from_bytes(open(d + "/model.safetensors", "rb").read(8), "little")
hdr = json.loads(open(d + "/model.safetensors", "rb").read(8 + hdr_len)[8:])
raw = np.memmap(d + "/model.safetensors", np.uint8, "r", offset=8 + hdr_len)
sd = {k: raw[v["data_offsets"][0]:v["data_offsets"][1]].view(np.float16).reshape(v["shape"])
      for k, v in hdr.items() if k != "__metadata__"}
cfg = json.load(open(d + "/config.json"))
m = dclens.load(d)
toks = np.random.default_rng(1).integers(0, m.config.vocab, 8)
at = "blocks.%d.attn.head_out" % (m.config.n_layer - 1)
g = m.gradients(toks, ("logit", -1, 0), [at, "blocks.0.resid_pre"])
f = lambda iv=None: R.ref_forward(sd, cfg, toks, interventions=iv)[-1, 0]
out = []
eps = float(sys.argv[2])
for n in (at, "blocks.0.resid_pre"):
    gn = g[n]
    for ix in [tuple(i) for i in np.argwhere(np.abs(gn) >= np.sort(np.abs(gn).ravel())[-2])[:2]]:
        def pert(s, ix=ix):
            def fn(x):
                x = x.copy(); x[ix] += s; return x
            return fn
        fd = (f({n: pert(eps)}) - f({n: pert(-eps)})) / (2 * eps)
        out.append((n, [int(i) for i in ix], float(fd), float(gn[ix])))
print(json.dumps(out))
"""


CUDA_SGEMM_SRC = r"""
import json, sys, time
import torch
torch.backends.cuda.matmul.allow_tf32 = False
shapes = json.loads(sys.argv[1])
dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[sys.argv[2]]
ts = []
for m, n, k in shapes:
    a = torch.randn(m, k, device="cuda", dtype=dt); b = torch.randn(n, k, device="cuda", dtype=dt)
    for _ in range(3):
        a @ b.T
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(20):
        a @ b.T
    torch.cuda.synchronize(); ts.append((time.perf_counter() - t0) / 20)
print(json.dumps({"times": ts, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}))
"""


def cuda_sgemm_gflops(s, T, dtype="float32"):
    """GFLOP/s of cuBLAS GEMMs (PyTorch, TF32 off) over the pass's linear
    shapes in the products' input type (float32, or the 16-bit type the
    weights are kept in), or None where torch is not installed."""
    D, F = s["dim"], s["intermediate"]
    shapes = [(T, 3 * D, D), (T, D, D), (T, F, D), (T, D, F)]
    dtype = "float32" if dtype == "auto" else dtype
    r = subprocess.run(
        [sys.executable, "-c", CUDA_SGEMM_SRC, json.dumps(shapes), dtype], capture_output=True, text=True
    )
    if r.returncode:
        print("no same-run cuBLAS sgemm (torch): %s" % r.stderr.strip().splitlines()[-1:])
        return None
    res = json.loads(r.stdout)
    print("same-run GEMM: %s cuBLAS through torch %s on %s" % (dtype, res["torch"], res["gpu"]))
    return sum(2 * m * n * k for m, n, k in shapes) / sum(res["times"]) / 1e9


def backward_flops(s, L_from, L, T, recompute):
    D, F, V, N = s["dim"], s["intermediate"], s["vocab"], s["n_head"]
    C, K, R = 4, 4 * N, bench.R
    per = 2 * T * (4 * D * D + 2 * D * F) + 2 * T * D * (C * K + C * N) + 2 * T * C * K * 2 * R * N
    bw = (L - L_from) * (per + 8 * T * T * D) + 2 * T * V * D
    if recompute:  # each layer below the top one runs its forward again
        bw += (L - L_from - 1) * (per + 4 * T * T * D)
    return bw


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--max-tape-gib", type=float, default=2.5, help="0: the default budget (the device's free memory)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--hook-layer", type=int, default=-1, help="layer of the head_out hook (default min(16, L-1))")
    p.add_argument("--check-fd", action="store_true")
    p.add_argument("--fd-eps", type=float, default=1e-4, help="step of the central differences")
    p.add_argument("--fd-only", action="store_true", help="with --check-fd: no timing run")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="load's dtype= (the type the weight matrices are kept in; on CUDA the 16-bit products)",
    )
    p.add_argument(
        "--sensitivity",
        action="store_true",
        help="only: the last logits' change when the residual entering layer 0 is multiplied by (1 + 1e-7 noise)",
    )
    a = p.parse_args(argv)
    s = bench.SIZES["6.9b"]
    if not os.path.exists(os.path.join(a.dir, "model.safetensors")):
        t0 = time.perf_counter()
        n = bench.write_69b_fp16(a.dir, a.layers)
        print("wrote %.2f GB in %.0f s" % (n / 1e9, time.perf_counter() - t0), flush=True)
    stored = os.path.getsize(os.path.join(a.dir, "model.safetensors"))
    # tests/ for the reference, ahead of (not instead of) the caller's PYTHONPATH
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH")])),
    )
    try:
        if a.check_fd:
            r = subprocess.run(
                [sys.executable, "-c", FD_SRC, a.dir, str(a.fd_eps)], capture_output=True, text=True, env=env
            )
            if r.returncode:
                raise SystemExit(r.stderr[-3000:])
            for n, ix, fd, g in json.loads(r.stdout):
                print(
                    "fd check %s%s: reference central difference %.6g, engine %.6g, rel err %.2e"
                    % (n, ix, fd, g, abs(fd - g) / max(abs(fd), 1e-12))
                )
        if a.fd_only:
            return
        if a.sensitivity:
            r = subprocess.run(
                [sys.executable, "-c", SENS_SRC, a.dir, str(a.T), a.device], capture_output=True, text=True, env=env
            )
            if r.returncode:
                raise SystemExit(r.stderr[-3000:])
            s = json.loads(r.stdout)
            print(
                "%d layers, T=%d, %s: logit[-1, 0] %.6f; with resid_pre of layer 0 x (1 + 1e-7 noise) %.6f; "
                "max |change| of the last logits / max |logit| = %.3g"
                % (a.layers, a.T, a.device, s["logit"], s["perturbed"], s["rel"])
            )
            return
        budget = int(a.max_tape_gib * 2**30)
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                RUN_SRC,
                a.dir,
                str(a.T),
                str(a.steps),
                str(budget),
                str(a.hook_layer),
                a.device,
                a.dtype,
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        res = json.loads(r.stdout)
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)
    rc = bool(res["tape"]["recompute"])
    fl = backward_flops(s, res["layer"], a.layers, a.T, rc)
    sg = bench.sgemm_gflops(s, a.T, a.threads) if a.device == "cpu" else cuda_sgemm_gflops(s, a.T, a.dtype)
    limit = 1.25 * stored + 2**30
    res.update(
        stored=stored,
        limit=limit,
        backward_gflops=fl / res["backward_s"] / 1e9,
        sgemm_gflops=sg,
        ig_s_per_step=res["ig_s"] / a.steps,
        layers=a.layers,
        T=a.T,
        steps=a.steps,
    )
    print(json.dumps(res, indent=1))
    print(
        "DCPythia-6.9B-shaped fp16, %d layers, T=%d, head_out of layer %d, %s, budget %.2f GiB:"
        % (a.layers, a.T, res["layer"], a.device, res["budget"] / 2**30)
    )
    if a.device == "cpu":
        print(
            "  stored weights %.2f GiB; peak RSS after gradients %.2f GiB, after IG (%d steps) %.2f GiB; "
            "limit 1.25 x stored + 1 GiB = %.2f GiB"
            % (stored / 2**30, res["grad_rss"] / 2**30, a.steps, res["ig_rss"] / 2**30, limit / 2**30)
        )
    else:
        print(
            "  stored weights %.2f GiB; GPU free after load %.2f GiB, after gradients %.2f GiB; "
            "pass peak (tape + scratch) after gradients %.2f GiB, after IG %.2f GiB; host peak RSS %.2f GiB"
            % (
                stored / 2**30,
                res["gpu_free_after_load"] / 2**30,
                res["gpu_free_after_grad"] / 2**30,
                res["last_pass_memory"]["peak"] / 2**30,
                res["ig_last_pass_memory"]["peak"] / 2**30,
                res["ig_rss"] / 2**30,
            )
        )
    vs = " vs sgemm %.1f GFLOP/s (%.0f%%)" % (sg, 100 * res["backward_gflops"] / sg) if sg else ""
    print(
        "  tape %.3f GiB (%s), forward %.3f s, backward %.3f s: %.1f GFLOP/s%s"
        % (
            res["tape"]["tape"] / 2**30,
            "recompute" if rc else "full",
            res["forward_s"],
            res["backward_s"],
            res["backward_gflops"],
            vs,
        )
    )
    print(
        "  IG: %.3f s per step (%d steps, batches of %d%s), gap %.3g"
        % (
            res["ig_s_per_step"],
            a.steps,
            res["ig_batch"][0],
            ", recompute" if res["ig_batch"][1] else "",
            res["ig_gap"],
        )
    )


if __name__ == "__main__":
    main()
