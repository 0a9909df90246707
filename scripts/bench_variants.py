"""The attention variants on generated models (docs/variants.md numbers):
forward time of each variant against plain DCMHA, their logit error against the
float64 numpy reference, and how far a null window is from the old 256 fallback.

    python scripts/bench_variants.py [--dim 256] [--n-head 8] [--n-layer 4] [--T 256]
"""

import argparse
import os
import sys
import tempfile
import time
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import dclens  # noqa: E402
from dclens.testing.make_tiny import make_tiny  # noqa: E402

from reference import ref_forward  # noqa: E402


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    variants = {
        "dcmha": {},
        "query_wise": dict(query_wise=True),
        "key_wise": dict(key_wise=True),
        "static (use_sw)": dict(use_sw=True),
        "compose_groups=4": dict(compose_groups=4),
        "moh hs=2,k=3": dict(moh={"shared_heads": 2, "routed_topk": 3}),
    }
    base = dict(model_type="dcpythia", n_layer=a.n_layer, dim=a.dim, n_head=a.n_head, vocab=512, window_size=64, seed=1)
    toks = np.random.default_rng(0).integers(0, 512, size=a.T)
    print("model: dim %d, %d heads, %d layers, T = %d, CPU" % (a.dim, a.n_head, a.n_layer, a.T))
    print("%-18s %10s %12s %14s" % ("variant", "forward s", "vs dcmha", "ref rel err"))
    t0 = None
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in variants.items():
            d = os.path.join(tmp, name.replace(" ", "_"))
            sd, cfg = make_tiny(d, **dict(base, **kw))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", dclens.LoadWarning)
                m = dclens.load(d)
            m.forward(toks)
            best = min(_time(m, toks) for _ in range(a.repeat))
            t0 = best if t0 is None else t0
            err = rel(m.forward(toks), ref_forward(sd, cfg, toks))
            print("%-18s %10.4f %11.2fx %14.2e" % (name, best, best / t0, err))
        d = os.path.join(tmp, "nullwin")
        sd, cfg = make_tiny(d, model_type="dcpythia", n_layer=2, window_size=None, seed=2)
        toks = np.random.default_rng(3).integers(0, 64, size=300)
        got = dclens.load(d).forward(toks)
        print(
            "null window, T = 300: rel. difference to the old 256-window reading %.3f, "
            "to the reference %.1e"
            % (rel(got, ref_forward(sd, dict(cfg, window_size=256), toks)), rel(got, ref_forward(sd, cfg, toks)))
        )


def _time(m, toks):
    t = time.perf_counter()
    m.forward(toks)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
