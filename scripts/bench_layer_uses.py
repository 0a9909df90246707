"""The one layer's three uses, timed (issue 30): a prefill forward, incremental
decoding (one token a step after a prompt), and a gradient (tape forward +
backward), on one random DCPythia and its Pythia twin.

    python scripts/bench_layer_uses.py [--threads 2] [--repeat 3]

Prints, per model: forward tokens/s (B=4, T=256), decode tokens/s (prompt 64,
then 128 single-token steps), gradient wall seconds (B=4, T=128, d logit /
d every parameter and one hook). Best of --repeat after a warm-up; process
CPU seconds next to wall, since the machine's cores may be shared.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

import dclens
from dclens.analysis.generate import Decoder
from dclens.testing.make_tiny import make_tiny


def _best(fn, repeat):
    fn()
    wall, cpu = [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return min(wall), min(cpu)


def _decode(m, seq):
    """seq[:64] as a prompt, then the rest one token a step."""
    dec = Decoder(m)
    dec.step(seq[:64])
    for t in seq[64:]:
        dec.step([t])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    kw = dict(n_layer=4, dim=256, n_head=8, vocab=2048, intermediate=1024, window_size=64, seed=1)
    for mt in ("dcpythia", "gpt_neox"):
        d = tempfile.mkdtemp()
        make_tiny(d, mt, **kw)
        m = dclens.load(d, n_threads=a.threads)
        rng = np.random.default_rng(0)
        toks = rng.integers(0, 2048, size=(4, 256))
        fw, fc = _best(lambda m=m, toks=toks: m.forward(toks), a.repeat)
        seq = rng.integers(0, 2048, size=192)
        dw, dc = _best(lambda m=m, seq=seq: _decode(m, seq), a.repeat)
        gt = rng.integers(0, 2048, size=(4, 128))
        pnames = [r[0] for r in dclens.grad.param_table(m)]
        gw, gc = _best(
            lambda m=m, gt=gt, pnames=pnames: m.gradients(gt, ("logit", 127, 5), pnames + ["blocks.1.attn.z"]), a.repeat
        )
        print(
            "%-9s forward %7.0f tok/s (cpu %.3f s) | decode %6.0f tok/s (cpu %.3f s) | gradient %.3f s (cpu %.3f s)"
            % (mt, toks.size / fw, fc, 192 / dw, dc, gw, gc)
        )


if __name__ == "__main__":
    main()
