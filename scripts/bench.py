"""Benchmarks of the engine, each against a baseline measured in the same run.

    python scripts/bench.py [--quick] [--out BENCHMARKS.json]

1. forward pass: dcscope (C engine, OpenBLAS) vs the numpy reference of
   tests/reference.py on the same generated DCPythia, tokens/s;
2. hooks: a capture-nothing pass vs a capture-everything pass (and one that
   captures a single layer's post-compose branches), same model and tokens;
3. Pythia vs DCPythia of the same size: the cost of DCMHA in the engine
   (the paper's Table 2 puts the extra FLOPs at a few percent for large D).
Prints a Markdown table; BENCHMARKS.md keeps the results with this command.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import dcscope  # noqa: E402
from dcscope.testing.make_tiny import make_tiny  # noqa: E402


def best_of(fn, repeat):
    """Best wall time of `repeat` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller model and fewer repeats")
    p.add_argument("--out", default=None, help="also write the numbers as JSON here")
    a = p.parse_args(argv)
    from reference import ref_forward

    if a.quick:
        dims = dict(n_layer=2, dim=128, n_head=8, vocab=4096)
        B, T, repeat = 2, 128, 3
    else:
        dims = dict(n_layer=4, dim=512, n_head=8, vocab=16384)
        B, T, repeat = 4, 256, 3
    rows = []
    res = {"machine": "%s, %d cores" % (platform.processor() or platform.machine(), os.cpu_count()),
           "dims": dims, "B": B, "T": T}
    with tempfile.TemporaryDirectory() as tmp:
        dcp_dir, neox_dir = os.path.join(tmp, "dcp"), os.path.join(tmp, "neox")
        sd, cfg = make_tiny(dcp_dir, model_type="dcpythia", window_size=64, seed=1, **dims)
        make_tiny(neox_dir, model_type="gpt_neox", seed=1, **dims)
        dcp, neox = dcscope.load(dcp_dir), dcscope.load(neox_dir)
        toks = np.random.default_rng(0).integers(0, dims["vocab"], size=(B, T))
        ntok = B * T

        t_engine = best_of(lambda: dcp.forward(toks), repeat)
        t_ref = best_of(lambda: [ref_forward(sd, cfg, toks[b]) for b in range(B)], 1)
        rows.append(("forward, DCPythia", "numpy reference (tests/reference.py)",
                     ntok / t_engine, ntok / t_ref, t_ref / t_engine))

        t_all = best_of(lambda: dcp.run_with_cache(toks), repeat)
        rows.append(("capture nothing vs capture every hook", "capture every hook",
                     ntok / t_engine, ntok / t_all, t_all / t_engine))
        one = ["blocks.1.attn.post.%s" % b for b in ("skip", "qp", "kp", "qg", "kg")]
        t_one = best_of(lambda: dcp.run_with_cache(toks, names=one), repeat)
        rows.append(("capture nothing vs one layer's post branches", "capture blocks.1.attn.post.*",
                     ntok / t_engine, ntok / t_one, t_one / t_engine))

        t_neox = best_of(lambda: neox.forward(toks), repeat)
        rows.append(("DCPythia vs Pythia of the same size (engine)", "Pythia (MHA) forward",
                     ntok / t_engine, ntok / t_neox, t_neox / t_engine))

    res["rows"] = [dict(zip(("what", "baseline", "tok_s", "baseline_tok_s", "ratio"), r)) for r in rows]
    print("model: DCPythia %s, B=%d, T=%d, on %s" % (dims, B, T, res["machine"]))
    print("| measurement | baseline | dcscope tokens/s | baseline tokens/s | speed ratio |")
    print("|---|---|---:|---:|---:|")
    for what, base, x, y, r in rows:
        print("| %s | %s | %.0f | %.0f | %.2fx |" % (what, base, x, y, r))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
