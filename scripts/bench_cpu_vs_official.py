"""Prefill on the CPU: dclens against the official DCPythia module, float32, the same weights and
threads, one run (issue 48).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE VENV/bin/python scripts/bench_cpu_vs_official.py \\
        --module DCFormer/pytorch/dcpythia --dclens-python python3 \\
        [--dim 1024] [--heads 16] [--layers 2] [--T 512 2048] [--threads 2] [--repeat 3] [--out F.json]

VENV holds torch and transformers from PyPI (never a dependency of dclens); dclens runs in a
process of --dclens-python. `--module` is `pytorch/dcpythia` of github.com/Caiyun-AI/DCFormer (the
official module, imported from that path; none of its code is in this project).

1. The official model at DCPythia-6.9B's config.json with --dim / --heads / --layers (head dim
   D / heads, MLP 4D, vocab 50257, window 256 on the even layers), in float32, every parameter
   drawn at random as scripts/bench_cuda_vs_official.py draws them, written as one safetensors
   file with its config.json: both sides run the same weights.
2. The module, eager, torch.set_num_threads(--threads): the prefill of one sequence of T random
   tokens to its full logits [1, T, V] (`model(x, return_tensor=True)` under no_grad), the fastest
   of --repeat calls after a first.
3. dclens in a fresh process: `load(ckpt, n_threads=--threads)`, `forward(tokens)` (full logits
   too), timed the same way; which BLAS library and kernel ran; its logits against the module's at
   the smallest T (max |diff| / max |module|: the module rounds its rotary table to float16, so
   ~1e-5 is expected).
The ratio is the module's time over dclens's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, sys, time
import numpy as np
import dclens
job = json.load(open(sys.argv[1]))
m = dclens.load(job["ckpt"], n_threads=job["threads"])
out = dict(blas=dict(library=dclens.blas.library(), kernel=dclens.blas.kernel(), config=dclens.blas.config()),
           rows=[])
for T in job["T"]:
    x = np.load(job["tokens"] % T)
    t0 = time.perf_counter(); y = m.forward(x); first = time.perf_counter() - t0
    ts = []
    for _ in range(job["repeat"]):
        t0 = time.perf_counter(); m.forward(x); ts.append(time.perf_counter() - t0)
    if T == min(job["T"]):
        np.save(job["logits"], y)
    out["rows"].append(dict(T=T, s=min(ts), first_s=first))
print("RESULT " + json.dumps(out))
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", required=True, help="the official pytorch/dcpythia folder")
    p.add_argument("--dclens-python", default=sys.executable)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--T", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="the results as JSON")
    a = p.parse_args(argv)

    import bench_cuda_vs_official as off
    import torch

    torch.set_num_threads(a.threads)
    Config, Model = off.import_official(a.module, None)
    with open(os.path.join(a.module, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(dim=a.dim, n_head=a.heads, n_local_heads=a.heads, head_dim=a.dim // a.heads)
    cfg.update(intermediate_size=4 * a.dim, n_layer=a.layers, block_size=max(2048, *a.T), torch_dtype="float32")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = Model(Config(**cfg))
    finally:
        torch.set_default_dtype(old)
    model = model.float().eval()
    off.draw_weights(model, cfg["n_head"], a.seed)
    model.requires_grad_(False)
    model.setup_caches(1, cfg["block_size"], set_kv_cache=False)
    res = dict(
        setup=dict(
            dim=a.dim,
            heads=a.heads,
            layers=a.layers,
            vocab=cfg["vocab_size"],
            threads=a.threads,
            T=a.T,
            torch=torch.__version__,
            pins={k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ},
        ),
        official=[],
    )
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        off.save_checkpoint(model, cfg, ckpt)
        ref = None
        for T in a.T:
            x = off.tokens(cfg["vocab_size"], 1, T)
            np.save(os.path.join(tmp, "tokens_%d.npy" % T), x)
            xt = torch.from_numpy(x)

            def call(xt=xt, m=model):
                with torch.no_grad():
                    return m(xt, return_tensor=True)

            t0 = time.perf_counter()
            y = call()
            first = time.perf_counter() - t0
            ts = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                call()
                ts.append(time.perf_counter() - t0)
            if T == min(a.T):
                ref = (y.logits if hasattr(y, "logits") else y).float().numpy()
            res["official"].append(dict(T=T, s=min(ts), first_s=first))
            print("official module T=%d: %.3f s (%.0f tok/s)" % (T, min(ts), T / min(ts)), flush=True)
        del model, call  # its memory back before dclens runs
        job = dict(
            ckpt=ckpt,
            threads=a.threads,
            T=a.T,
            repeat=a.repeat,
            tokens=os.path.join(tmp, "tokens_%d.npy"),
            logits=os.path.join(tmp, "dclens_logits.npy"),
        )
        with open(os.path.join(tmp, "job.json"), "w") as f:
            json.dump(job, f)
        r = subprocess.run(
            [a.dclens_python, "-c", WORKER, os.path.join(tmp, "job.json")], capture_output=True, text=True
        )
        lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        if r.returncode or not lines:
            print("dclens side failed (%s):\n%s" % (r.returncode, r.stderr[-3000:]))
            return 1
        res["dclens"] = json.loads(lines[-1][len("RESULT ") :])
        got = np.load(job["logits"]).reshape(ref.shape)
        res["logits_rel_diff"] = float(np.abs(got - ref).max() / np.abs(ref).max())
    b = res["dclens"]["blas"]
    print(
        "dclens BLAS: %s, kernel %s (%s); pins: %s"
        % (b["library"], b["kernel"], b["config"], res["setup"]["pins"] or "none (unpinned, as users run)")
    )
    print(
        "D %d, %d heads, %d layers, vocab %d, float32, %d threads, batch 1, full logits"
        % (a.dim, a.heads, a.layers, cfg["vocab_size"], a.threads)
    )
    print("%6s %12s %12s %8s" % ("T", "official s", "dclens s", "ratio"))
    for o, d in zip(res["official"], res["dclens"]["rows"]):
        d["ratio"] = o["s"] / d["s"]
        print("%6d %12.3f %12.3f %7.2fx" % (o["T"], o["s"], d["s"], d["ratio"]))
    print("logits at T %d: max |dclens - module| / max |module| = %.2e" % (min(a.T), res["logits_rel_diff"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
