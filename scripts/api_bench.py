#!/usr/bin/env python3
"""Timings behind docs/api.md (issue 15): routing for every query from one
cache vs one pass per query, and generation with the incremental decoder vs
a full forward per new token, on a generated DCPythia.

    python scripts/api_bench.py [--dim 256 --n-layer 4 --n-head 8 --tokens 138 --new 32]
"""

import argparse
import tempfile
import time

import numpy as np

import dclens
from dclens import routing
from dclens.testing.make_tiny import make_tiny


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=138)
    ap.add_argument("--new", type=int, default=32)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        make_tiny(d, "dcpythia", n_layer=a.n_layer, dim=a.dim, n_head=a.n_head, vocab=1024, window_size=32, seed=0)
        m = dclens.load(d)
        toks = np.random.default_rng(0).integers(0, 1024, a.tokens)
        L = m.config.n_layer
        t0 = time.perf_counter()
        per = [[m.routing_matrix(toks, l, "post", t) for t in range(a.tokens)] for l in range(L)]
        t1 = time.perf_counter()
        _, cache = m.run_with_cache(toks)
        R = routing.routing_matrices(m, cache, "post")
        t2 = time.perf_counter()
        err = max(float(np.abs(R[l, t] - per[l][t]).max()) for l in range(L) for t in range(a.tokens))
        print(
            "routing, %d queries x %d layers: per-query calls %.2f s (%d passes), from one cache %.3f s "
            "(1 pass); max |diff| %.1e" % (a.tokens, L, t1 - t0, L * a.tokens, t2 - t1, err)
        )
        prompt = toks[:16]
        t0 = time.perf_counter()
        out = m.generate(prompt, a.new)
        t1 = time.perf_counter()
        seq = list(prompt)
        for _ in range(a.new):
            seq.append(int(m(np.array(seq))[-1].argmax()))
        t2 = time.perf_counter()
        print(
            "generate %d tokens after a 16-token prompt: decoder %.3f s, full forward per token %.3f s; "
            "same tokens: %s" % (a.new, t1 - t0, t2 - t1, bool(np.array_equal(out, seq)))
        )


if __name__ == "__main__":
    main()
