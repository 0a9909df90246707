"""A/B forward time of two dclens builds on one generated model, in
alternating separate processes (the shared machine is noisy: compare minima).

    # build the other engine somewhere (no install):
    git archive <commit> | tar -x -C /tmp/old && cd /tmp/old && \\
        cmake -S . -B /tmp/oldbuild -G Ninja -DDCLENS_PYTHON=ON -DDCLENS_CUDA=OFF -DDCLENS_TESTS=OFF \\
              -DPython_EXECUTABLE=$(command -v python) && cmake --build /tmp/oldbuild --target _engine
    cp -r /tmp/old/bindings/dclens /tmp/oldpkg/ && cp /tmp/oldbuild/_engine*.so /tmp/oldpkg/dclens/
    python scripts/ab_forward.py /tmp/oldpkg [--rounds 6]
"""

import argparse
import os
import subprocess
import sys
import tempfile

CODE = r"""
import sys, time, numpy as np, dclens
m = dclens.load(sys.argv[1], n_threads=1)
t = np.random.default_rng(0).integers(0, 512, int(sys.argv[2]))
m.forward(t)
best = 1e9
for _ in range(7):
    a = time.perf_counter(); m.forward(t); best = min(best, time.perf_counter() - a)
print(best)
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("other_pkg_dir", help="directory holding the other build's dclens package")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--T", type=int, default=256)
    a = ap.parse_args()
    from dclens.testing.make_tiny import make_tiny

    d = tempfile.mkdtemp(prefix="ab-forward-")
    make_tiny(d, model_type="dcpythia", n_layer=4, dim=256, n_head=8, vocab=512, window_size=64, seed=1)
    res = {"other": [], "this": []}
    order = [("this", None), ("other", a.other_pkg_dir)]
    for r in range(a.rounds):
        for name, pp in order if r % 2 == 0 else order[::-1]:
            env = dict(os.environ)
            if pp:
                env["PYTHONPATH"] = pp
            out = subprocess.run(
                [sys.executable, "-c", CODE, d, str(a.T)],
                capture_output=True,
                text=True,
                env=env,
                cwd=tempfile.gettempdir(),
                check=True,
            )
            res[name].append(float(out.stdout.strip()))
    for k, v in res.items():
        print("%-6s min %.4f s  median %.4f s  (%d rounds)" % (k, min(v), sorted(v)[len(v) // 2], len(v)))


if __name__ == "__main__":
    main()
