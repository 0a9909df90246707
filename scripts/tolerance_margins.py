"""Measured float32 errors against the bounds of tests/tolerances.py, on the
fast-path cases of tests/passes/test_fast_path.py: fused vs full path (two float32
passes) and engine vs the float64 reference. Run under each OPENBLAS_CORETYPE
to see the margin a kernel leaves:

    OPENBLAS_CORETYPE=Haswell python scripts/tolerance_margins.py
"""

import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import dclens  # noqa: E402
from dclens.testing.make_tiny import make_tiny  # noqa: E402

from reference import ref_forward  # noqa: E402
from tolerances import forward_tol, rel_err  # noqa: E402

CASES = {
    "dcp-global-local": dict(model_type="dcpythia", n_layer=4, window_type="LGLL", window_size=5, seed=21),
    "neox": dict(model_type="gpt_neox", seed=25),
    "dcp-f16": dict(model_type="dcpythia", dtype="float16", window_size=7, seed=26),
    "dcp-bf16-wide": dict(
        model_type="dcpythia", dtype="bfloat16", dim=64, n_head=4, intermediate=1024, window_size=8, seed=27
    ),
}


def main() -> None:
    print("OPENBLAS_CORETYPE=%s" % (os.environ.get("OPENBLAS_CORETYPE") or "(unset: the CPU's own kernels)"))
    print("%-16s %12s %12s %12s %12s" % ("case", "fused/full", "bound", "vs ref", "bound"))
    for name, kw in CASES.items():
        d = tempfile.mkdtemp()
        sd, cfg = make_tiny(d, **kw)
        m = dclens.load(d)
        toks = np.random.default_rng(3).integers(0, m.config.vocab, size=(3, 75))
        fused = m.forward(toks)
        full = m.run_with_hooks(
            toks, fwd_hooks=[("blocks.%d.attn.scores" % l, lambda a, n: None) for l in range(m.config.n_layer)]
        )
        ref = max(rel_err(fused[b], ref_forward(sd, cfg, toks[b])) for b in range(3))
        print(
            "%-16s %12.3g %12.3g %12.3g %12.3g"
            % (
                name,
                rel_err(fused, full),
                forward_tol(cfg, 75, fused.size, 2),
                ref,
                forward_tol(cfg, 75, fused[0].size),
            )
        )


if __name__ == "__main__":
    main()
