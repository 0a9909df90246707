"""SAE training speed and memory (issue 50, BENCHMARKS.md "Sparse dictionaries (issue 50)").

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_sae.py            # d_in 256, 16x
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_sae.py --d-in 4096 --d-sae 65536 \\
        --memory-only

Speed: tokens/s of one training step (forward, loss, backward, AdamW) of the engine's SAE
(dclens.features, engine/src/features/sae.c) against the same step written here in float32
numpy (numpy's own BLAS, its threads), both on one batch of --rows rows in the same process,
alternated, best of --repeats runs of --steps steps each; the ratio engine / numpy.

Memory: the bytes one dictionary holds in the engine, from its allocation sizes (dcs_sae_new:
parameters, gradients and both AdamW moments; reserve: the scratch for a batch), at the given
widths; and, for a small case (--check-*), that formula against the growth of the process's
peak RSS (VmHWM) over one step in a fresh subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from dclens import features as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402  (scripts/: its machine line)


def machine() -> str:
    """bench_train's line (CPU, cores, the engine's OpenBLAS kernel and pins) and numpy's version."""
    return "%s; numpy %s" % (bench_train.machine(), np.__version__)


# ---------------------------------------------------------------- the numpy step


class NumpySAE:
    """The engine's SAE step (ReLU + L1, or TopK) in float32 numpy: the same formulas
    (docs/features.md), written as a numpy user would (dense products; TopK by argpartition)."""

    def __init__(self, p: dict, l1: float, k: int = 0):
        self.p = {k: np.array(v, np.float32) for k, v in p.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.l1 = np.float32(l1 if not k else 0.0)
        self.k = k

    def step(self, x: np.ndarray, t: int, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.0) -> float:
        p, N = self.p, np.float32(x.shape[0])
        xin = x - p["b_dec"]
        pre = xin @ p["W_enc"]
        pre += p["b_enc"]
        if self.k:  # the k largest per row, ReLU'd
            idx = np.argpartition(-pre, self.k - 1, axis=1)[:, : self.k]
            acts = np.zeros_like(pre)
            np.put_along_axis(acts, idx, np.maximum(np.take_along_axis(pre, idx, 1), 0), 1)
        else:
            acts = np.maximum(pre, 0)
        recon = acts @ p["W_dec"]
        recon += p["b_dec"]
        diff = recon - x
        loss = float(np.einsum("ij,ij->", diff, diff) / N + self.l1 * acts.sum() / N)
        dR = diff * (2 / N)
        g = {"W_dec": acts.T @ dR, "b_dec": dR.sum(0)}
        dP = dR @ p["W_dec"].T
        if self.k:
            dP *= acts != 0
        else:
            dP += self.l1 / N
            dP *= pre > 0
        g["W_enc"] = xin.T @ dP
        g["b_enc"] = dP.sum(0)
        g["b_dec"] -= (dP @ p["W_enc"].T).sum(0)
        c1, c2 = np.float32(1 - b1**t), np.float32(1 - b2**t)
        for k, gk in g.items():
            m, v, w = self.m[k], self.v[k], p[k]
            m *= b1
            m += (1 - b1) * gk
            v *= b2
            v += (1 - b2) * gk * gk
            if wd and k in ("W_enc", "W_dec"):
                w *= np.float32(1 - lr * wd)
            w -= lr * (m / c1) / (np.sqrt(v / c2) + eps)
        return loss


# ---------------------------------------------------------------- memory


def engine_bytes(d_in: int, d_sae: int, rows: int, d_out: int = 0, arch: str = "relu", k: int = 0) -> dict:
    """The engine's allocations for one dictionary (sae.c: dcs_sae_new and reserve)."""
    dout = d_out or d_in
    F_ = d_sae
    n_param = d_in * F_ + F_ + F_ * dout + dout + (F_ if arch == "jumprelu" else 1 if arch == "batchtopk" else 0)
    params = 4 * 4 * n_param  # param, grad, mom, var; float32
    kk = k if arch == "topk" else 1
    # xin [rows, d_in], pre, acts, dacts [rows, F], recon [rows, d_out]; row [rows, 3] doubles; kept
    scratch = 4 * rows * (d_in + 3 * F_ + dout) + 8 * 3 * rows + 4 * rows * kk
    return {"parameters+grads+adam": params, "scratch": scratch, "total": params + scratch}


def _rss_child(d_in: int, d_sae: int, rows: int) -> None:
    """One step in this fresh process; print the growth of peak RSS (bytes) over it."""

    def hwm() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM"):
                    return int(line.split()[1]) * 1024
        return 0

    from dclens._core.dictionaries import EngineSAE

    x = np.random.default_rng(0).standard_normal((rows, d_in)).astype(np.float32)
    base = hwm()
    e = EngineSAE(d_in, 0, d_sae, "relu", 0, True, False, 1e-3, 0.001, 0)  # zero parameters: no init temporaries
    e.grad(x)
    e.adamw(1, 1e-3, 0.9, 0.999, 1e-8, 0.0)
    print(json.dumps({"rss_growth": hwm() - base}))


def measured_growth(d_in: int, d_sae: int, rows: int) -> int:
    """Peak-RSS growth of one engine step at these widths, in a fresh subprocess."""
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child", str(d_in), str(d_sae), str(rows)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(json.loads(out.strip().splitlines()[-1])["rss_growth"])


# ---------------------------------------------------------------- speed


def speed(a) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.rows, a.d_in)).astype(np.float32)
    cfg = F.SAEConfig(
        d_in=a.d_in, d_sae=a.d_sae, arch=a.arch, k=a.k, sparsity_coef=a.l1, hook_name="blocks.0.resid_post"
    )
    sae = F.SAE(cfg, seed=0)
    kk = a.k if a.arch == "topk" else 0
    ref = NumpySAE(sae.parameters(), a.l1, kk)
    same = F.SAE(sae.cfg, seed=0)  # one step of each from the same parameters: the same step?
    same.loss_and_grads(x)
    same.step(1, 1e-3)
    twin = NumpySAE(sae.parameters(), a.l1, kk)
    twin.step(x, 1)
    diff = max(float(np.abs(v - twin.p[k]).max()) for k, v in same.parameters().items())
    print("  one step, engine vs numpy: max |parameter difference| %.2g (lr 1e-3)" % diff)
    same.close()
    del twin
    e = sae._e  # the engine's calls alone (SAE.loss_and_grads also copies the gradients out)
    t_eng, t_np = [], []
    step = 0
    for run in range(a.repeats + 1):  # run 0 warms both up
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step += 1
            e.grad(x)
            e.adamw(step, 1e-3, 0.9, 0.999, 1e-8, 0.0)
        t1 = time.perf_counter()
        for i in range(a.steps):
            ref.step(x, step - a.steps + 1 + i)
        t2 = time.perf_counter()
        if run:
            t_eng.append(t1 - t0)
            t_np.append(t2 - t1)
    tok = a.rows * a.steps
    be, bn = tok / min(t_eng), tok / min(t_np)
    print(
        "d_in %d, d_sae %d (%dx), %d rows/step, %s, AdamW; best of %d runs of %d steps"
        % (a.d_in, a.d_sae, a.d_sae // a.d_in, a.rows, "TopK k=%d" % a.k if kk else "ReLU + L1", a.repeats, a.steps)
    )
    print("  engine: %8.0f tokens/s  (%.3f s/step; runs %s)" % (be, min(t_eng) / a.steps, _fmt(t_eng)))
    print("  numpy : %8.0f tokens/s  (%.3f s/step; runs %s)" % (bn, min(t_np) / a.steps, _fmt(t_np)))
    print("  ratio engine / numpy: %.2fx (target >= 5x: %s)" % (be / bn, "met" if be / bn >= 5 else "not met"))


def _fmt(ts) -> str:
    return ", ".join("%.2f" % t for t in ts)


def memory(a) -> None:
    m = engine_bytes(a.mem_d_in, a.mem_d_sae, a.mem_rows)  # ReLU / JumpReLU / BatchTopK within 0.1%
    print(
        "memory, one dictionary at d_in %d, d_sae %d, a batch of %d rows (ReLU; TopK adds 4 k bytes/row):"
        % (a.mem_d_in, a.mem_d_sae, a.mem_rows)
    )
    for k, v in m.items():
        print("  %-22s %8.2f GiB" % (k, v / 2**30))
    c = engine_bytes(a.check_d_in, a.check_d_sae, a.check_rows)["total"]
    g = measured_growth(a.check_d_in, a.check_d_sae, a.check_rows)
    print(
        "  check at d_in %d, d_sae %d, %d rows: formula %.1f MiB, peak-RSS growth over one step %.1f MiB (%+.1f%%)"
        % (a.check_d_in, a.check_d_sae, a.check_rows, c / 2**20, g / 2**20, 100 * (g - c) / c)
    )


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--rss-child":
        _rss_child(*(int(v) for v in sys.argv[2:]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-in", type=int, default=256)
    ap.add_argument("--d-sae", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=4096, help="tokens per step")
    ap.add_argument("--arch", choices=("relu", "topk"), default="topk")
    ap.add_argument("--k", type=int, default=32, help="TopK's k")
    ap.add_argument("--l1", type=float, default=1e-3, help="ReLU's L1 coefficient")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mem-d-in", type=int, default=4096, help="the 6.9B models' d_model")
    ap.add_argument("--mem-d-sae", type=int, default=65536)
    ap.add_argument("--mem-rows", type=int, default=4096)
    ap.add_argument("--check-d-in", type=int, default=512)
    ap.add_argument("--check-d-sae", type=int, default=8192)
    ap.add_argument("--check-rows", type=int, default=1024)
    ap.add_argument("--memory-only", action="store_true")
    a = ap.parse_args()
    print(machine())
    if not a.memory_only:
        speed(a)
    memory(a)


if __name__ == "__main__":
    main()
