"""Time the attribution graph of one prompt (dclens.features.attribution_graph) and report its
replacement and completeness scores (BENCHMARKS.md, "Attribution graphs").

    python scripts/train_transcoders.py --model dcpythia-small --out build/transcoders/dcpythia-small
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \\
        python scripts/bench_attribution_graph.py --model dcpythia-small --transcoders build/transcoders/dcpythia-small

The prompt: --tokens tokens of the synthetic-task held-out lines, packed (the first
held-out records, tokenised by the model's tokenizer), cut to exactly --tokens. The graph
is built --repeat times; the best time is reported, with the node counts, the scores, and
the machine and OpenBLAS kernel.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dclens  # noqa: E402
from dclens import features  # noqa: E402
from dclens._core import blas  # noqa: E402
from synth_tasks import corpus  # noqa: E402


def prompt_tokens(model, n: int) -> np.ndarray:
    ids: list[int] = []
    for rec in corpus.heldout_records():
        ids.extend(int(t) for t in model.to_tokens(corpus.record_text(rec) + "\n"))
        if len(ids) >= n:
            return np.asarray(ids[:n], np.int32)
    raise SystemExit("the held-out set has fewer than %d tokens" % n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dcpythia-small")
    p.add_argument("--transcoders", required=True, help="scripts/train_transcoders.py's output directory")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--compose", choices=("auto", "on", "off"), default="auto")
    a = p.parse_args(argv)
    model = dclens.load(a.model)
    tcs = [features.load(os.path.join(a.transcoders, "layer_%d" % l)) for l in range(model.config.n_layer)]
    toks = prompt_tokens(model, a.tokens)
    compose = {"auto": None, "on": True, "off": False}[a.compose]
    best, g = float("inf"), None
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        g = features.attribution_graph(model, toks, tcs, compose=compose, progress=False)
        best = min(best, time.perf_counter() - t0)
    assert g is not None
    r, c = g.scores()
    kept, _ = g.prune()
    counts = ", ".join("%d %s" % (len(v), k) for k, v in g.index.items())
    print(
        "machine: %s, %d cores; OpenBLAS %s, kernel %s"
        % (os.uname().machine, os.cpu_count(), blas.library(), blas.kernel())
    )
    print("model %s, %d tokens, transcoders %s (width %d)" % (a.model, a.tokens, a.transcoders, tcs[0].cfg.d_sae))
    print("graph: %d nodes (%s); pruned (0.8, 0.98): %d nodes" % (len(g), counts, int(kept.sum())))
    print("time: best of %d %.2f s" % (a.repeat, best))
    print("replacement score %.3f, completeness score %.3f" % (r, c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
