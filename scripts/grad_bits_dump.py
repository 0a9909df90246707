"""Dump the CPU gradients (every hook and parameter, full tape and recomputed)
and IG attributions of the tiny models of tests/gpu/test_cuda_grad.py to an npz,
to compare two builds bit for bit (issue 23: the backward moved onto the
backend interface without changing a CPU bit).

    python scripts/grad_bits_dump.py new.npz /tmp/models
    BASE=/path/to/old/pkg python scripts/grad_bits_dump.py old.npz /tmp/models
    python -c "import numpy as np; a, b = np.load('old.npz'), np.load('new.npz'); \
        print([k for k in a.files if not np.array_equal(a[k], b[k])])"

BASE: a directory holding another build's dclens package (its bindings/dclens
with its _engine module copied in), imported instead of the installed one.

    python scripts/grad_bits_dump.py --time /tmp/models

times instead one gradient call (B=2, T=128, a 4-layer D=256 DCPythia: layer
2's head_out and every parameter), best and median of 5, for a same-run A/B
of two builds (run it with and without BASE under /work/runs/quiet.sh).
"""

import importlib
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
if os.environ.get("BASE"):  # another build's package, before the installed one's finder
    sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
    sys.path.insert(0, os.environ["BASE"])
dclens = importlib.import_module("dclens")
make_tiny = importlib.import_module("dclens.testing.make_tiny").make_tiny
param_table = importlib.import_module("dclens.grad").param_table
MODELS = importlib.import_module("test_cuda_grad").MODELS
print(dclens.__file__)


def time_one(root):
    import time

    d = os.path.join(root, "mid")
    if not os.path.exists(d):
        os.makedirs(d)
        make_tiny(d, model_type="dcpythia", n_layer=4, dim=256, n_head=8, vocab=1000, window_size=16, seed=26)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = dclens.load(d)
    toks = np.random.default_rng(0).integers(0, 1000, (2, 128))
    wrt = ["blocks.2.attn.head_out"] + [r[0] for r in param_table(m)]
    m.gradients(toks, ("loss",), wrt)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        m.gradients(toks, ("loss",), wrt)
        ts.append(time.perf_counter() - t)
    print("gradients B=2 T=128 D=256 L=4: best %.3f s, median %.3f s" % (min(ts), sorted(ts)[2]))


if sys.argv[1] == "--time":
    time_one(sys.argv[2])
    sys.exit(0)
out = {}
root = sys.argv[2]
for name, kw in sorted(MODELS.items()):
    kw = dict(kw)
    kw.setdefault("vocab", 24)
    d = os.path.join(root, name)
    if not os.path.exists(d):
        os.makedirs(d)
        make_tiny(d, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = dclens.load(d)
    toks = np.random.default_rng(7).integers(0, m.config.vocab, (2, 9))
    wrt = m.hook_names + [r[0] for r in param_table(m)]
    g = m.gradients(toks, ("loss",), wrt)
    low = m.estimate_backward_memory(9, 2)["recompute"]
    g2 = m.gradients(toks, ("logprob", 5, 3), wrt, max_tape_bytes=low)
    for n in wrt:
        out[name + "|" + n] = g[n]
        out[name + "|rc|" + n] = g2[n]
    a = m.attribute(toks[0], ("logprob", 7, 3), ["blocks.1.attn.head_out", "blocks.0.attn.z"], steps=3)
    for n, v in a.attributions.items():
        out[name + "|ig|" + n] = np.asarray(v)
np.savez(sys.argv[1], **out)
print(len(out), "arrays")
