"""Forward speed of DCFormer++ beside DCPythia at the same shape (issue 27).

    python scripts/bench_dcformer.py [--dim 1024] [--n-head 16] [--n-layer 2] [--T 128,512] [--repeat 3]

Random weights (make_tiny, float32, window 256 on the local layers of the LG
pattern), the same D, N, L, vocabulary and tokens: DCPythia (LayerNorm, GELU
MLP of width 4D, parallel residual) and DCFormer++ (RMSNorm, SwiGLU MLP of
DCFormerConfig's default width, the multiple of 256 at or above 8D/3, so the
two MLPs hold about the same parameters; sequential residual), the latter
with and without the mgate group gate (44 groups when they divide the
width). Prefill with logits at the last position, models loaded side by side
and run interleaved, best of --repeat after a warm-up.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--T", default="128,512")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    import dclens
    from dclens.testing.make_tiny import make_tiny
    D = a.dim
    n = int(2 * 4 * D / 3)
    F = n if n % 256 == 0 else n + 256 - n % 256
    E = 44 if F % 44 == 0 else next(e for e in (32, 16, 8, 4, 2, 1) if F % e == 0)
    base = dict(n_layer=a.n_layer, dim=D, n_head=a.n_head, vocab=a.vocab, window_size=256, seed=1)
    kinds = {
        "dcpythia (F=%d)" % (4 * D): dict(model_type="dcpythia", intermediate=4 * D),
        "dcformer (F=%d)" % F: dict(model_type="dcformer", intermediate=F),
        "dcformer + mgate E=%d" % E: dict(model_type="dcformer", intermediate=F, mgate_dim=E),
    }
    tmp = tempfile.mkdtemp()
    models = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (name, kw) in enumerate(kinds.items()):
            d = os.path.join(tmp, str(i))
            make_tiny(d, **base, **kw)
            models[name] = dclens.load(d)
    print("D=%d, N=%d, %d layers, vocab %d, float32, %d threads" % (D, a.n_head, a.n_layer, a.vocab, os.cpu_count()))
    print("| model | T | best s | tokens/s | / dcpythia |")
    print("|---|---|---|---|---|")
    for T in [int(t) for t in a.T.split(",")]:
        toks = np.random.default_rng(0).integers(0, a.vocab, size=(1, T))
        best = {k: float("inf") for k in models}
        for m in models.values():
            m.forward(toks, logits_at="last")
        for _ in range(a.repeat):
            for k, m in models.items():
                t0 = time.perf_counter()
                m.forward(toks, logits_at="last")
                best[k] = min(best[k], time.perf_counter() - t0)
        ref = best[next(iter(models))]
        for k in models:
            print("| %s | %d | %.4f | %.0f | %.2f |" % (k, T, best[k], T / best[k], best[k] / ref))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
