"""Golden outputs of the engine, for refactors that must not change a bit
(issue 38: "logits, every hook, gradients and training steps bit-identical
to before on the CPU").

    python scripts/golden.py dump OUT.npz     # before the change
    python scripts/golden.py check OUT.npz    # after: every array bit for bit
    python scripts/golden.py dump --small tests/data/golden.npz   # what tests/passes/test_golden.py reads

For each variant of a generated tiny checkpoint (the attention family of
model-spec 5, DCFormer++, Pythia, a 16-bit torch file): logits of a batch,
every hook of one sequence, the gradients of a loss at every hook point and
every parameter (a tape that keeps every layer, and one that recomputes under
a small budget), and two AdamW training steps. Bits depend on the BLAS
kernels: compare dumps made on the same machine with the same OpenBLAS core
(check prints each array's largest difference when it is not exact).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

VARIANTS = {
    "dcpythia": dict(model_type="dcpythia", window_size=5, seed=21),
    "query_wise": dict(model_type="dcpythia", query_wise=True, seed=31),
    "key_wise": dict(model_type="dcpythia", key_wise=True, seed=32),
    "groups2-static": dict(model_type="dcpythia", compose_groups=2, use_sw=True, seed=36),
    "groups4-static-qw": dict(
        model_type="dcpythia", compose_groups=4, use_sw=True, query_wise=True, n_head=8, dim=64, seed=37
    ),
    "moh-hs2-static": dict(model_type="dcpythia", moh={"shared_heads": 2, "routed_topk": 1}, use_sw=True, seed=41),
    "sequential-f16-torch": dict(
        model_type="dcpythia", use_parallel_residual=False, dtype="float16", fmt="torch", seed=46
    ),
    "dcformer": dict(model_type="dcformer", seed=47),
    "gpt_neox": dict(model_type="gpt_neox", seed=23),
}
B, T = 2, 13


# the hooks a small dump keeps (tests/data/golden.npz): one of each kind
SMALL_HOOKS = (
    "embed",
    "blocks.1.attn.scores",
    "blocks.1.attn.pattern_composed",
    "blocks.1.attn.dyn.post.qw1",
    "blocks.1.attn.z",
    "blocks.2.mlp.out",
    "blocks.2.resid_post",
)


def outputs(name: str, kw: dict, workdir: str, small: bool = False) -> dict:
    import dclens
    from dclens._core.memplan import param_table
    from dclens._core.tapes import Tape
    from dclens._engine import ffi, lib
    from dclens.testing.make_tiny import make_tiny

    d = os.path.join(workdir, name)
    os.makedirs(d, exist_ok=True)
    make_tiny(d, n_layer=3, **kw)
    m = dclens.load(d, n_threads=1)
    rng = np.random.default_rng(7)
    toks = rng.integers(0, m.config.vocab, size=(B, T)).astype(np.int32)
    out = {"logits": m.forward(toks)}
    # the split inputs (added after the first dumps) are left out: their own tests check them
    hooks = [h for h in m.hook_names if (not small or h in SMALL_HOOKS) and not h.endswith(dclens.names.SPLIT_INPUTS)]
    _, cache = m.run_with_cache(toks[0], names=hooks)
    for k in hooks:
        out["hook/" + k] = cache[k]
    params = [r[0] for r in param_table(m)]
    wrt = hooks + params
    est = m.estimate_backward_memory(T, B, wrt)
    for budget, tag in ((None, "kept"), ((est["full"] + est["recompute"]) // 2, "recompute")):
        try:
            g = m.gradients(toks, "loss", wrt=wrt, max_tape_bytes=budget)
        except dclens.Error as e:  # a budget the plan cannot meet: say so in the dump
            out["grad_%s/error" % tag] = np.frombuffer(str(e).encode(), np.uint8)
            continue
        for k, v in g.items():
            out["grad_%s/%s" % (tag, k)] = v
    # no map gradient asked: the backward may take its fused attention path
    few = ["blocks.0.resid_pre", "blocks.1.attn.z", "blocks.2.mlp.out"]
    for k, v in m.gradients(toks, ("logit_diff", -1, 1, 2), wrt=few).items():
        out["grad_few/" + k] = v
    # two training steps (the tape, the loss, the flat parameter gradient, AdamW)
    lib.dcs_model_make_trainable(m.runner.handle)
    n = int(lib.dcs_param_total(m.runner.handle))
    grads, mom, var = (np.zeros(n, np.float32) for _ in range(3))
    hp = ffi.new("dcs_adamw *")
    hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay = 1e-3, 0.9, 0.95, 1e-8, 0.1
    tape = Tape(m, B, T)
    y = np.roll(toks, -1, axis=1)
    y[:, -1] = -1
    for step in (1, 2):
        tape.forward(toks, logits=False)
        out["train/loss%d" % step] = np.array([tape.loss(y)])
        grads[:] = 0
        tape.backward(None, grads)
        out["train/grads%d" % step] = grads.copy()
        ptr = lambda a: ffi.cast("float *", ffi.from_buffer(a))  # noqa: E731
        assert lib.dcs_adamw_step(m.runner.handle, ptr(grads), ptr(mom), ptr(var), step, hp) == lib.DCS_OK
    out["train/logits_after"] = m.forward(toks)
    return {"%s/%s" % (name, k): np.asarray(v) for k, v in out.items()}


BIG = 256  # a small dump keeps arrays past this many values as a digest and a sample


def shrink(out: dict) -> dict:
    """A small dump's arrays: each big one as its SHA-256 (the bits) and 128
    evenly spaced values (for a tolerance where the bits cannot match)."""
    import hashlib

    small = {}
    for k, v in out.items():
        if v.size <= BIG:
            small[k] = v
            continue
        small[k + "#sha256"] = np.frombuffer(hashlib.sha256(np.ascontiguousarray(v).tobytes()).digest(), np.uint8)
        small[k + "#sample"] = np.ascontiguousarray(v.reshape(-1)[:: -(-v.size // 128)])
    return small


def machine() -> str:
    """What decides the bits besides the code: OpenBLAS's kernel and the vector
    extensions the engine's own clones dispatch on."""
    import dclens

    flags = dclens.blas.cpu_flags() & {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
    return "%s %s" % (dclens.blas.kernel() or "?", ",".join(sorted(flags)))


def collect(small: bool = False) -> dict:
    allout = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in VARIANTS.items():
            print("golden: %s" % name, file=sys.stderr, flush=True)
            o = outputs(name, kw, tmp, small)
            allout.update(shrink(o) if small else o)
    return allout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["dump", "check"])
    ap.add_argument("file")
    ap.add_argument("--small", action="store_true", help="a few hooks of each kind (tests/data/golden.npz)")
    a = ap.parse_args(argv)
    if a.mode == "check":
        a.small = a.small or any(k.endswith("#sha256") for k in np.load(a.file).files)  # every dump has blas_core
    got = collect(a.small)
    if a.mode == "dump":
        got["blas_core"] = np.frombuffer(machine().encode(), np.uint8)
    if a.mode == "dump":
        np.savez_compressed(a.file, **got)
        print("golden: %d arrays written to %s" % (len(got), a.file))
        return 0
    want = dict(np.load(a.file))
    want.pop("blas_core", None)
    bad = 0
    for k in sorted(set(want) | set(got)):
        if k not in got or k not in want:
            print("golden: %s only in %s" % (k, "the dump" if k in want else "this build"))
            bad += 1
        elif want[k].shape != got[k].shape or want[k].dtype != got[k].dtype:
            print("golden: %s: %s %s vs %s %s" % (k, want[k].dtype, want[k].shape, got[k].dtype, got[k].shape))
            bad += 1
        elif not np.array_equal(want[k].view(np.uint8), got[k].view(np.uint8)):
            diff = np.abs(want[k].astype(np.float64) - got[k].astype(np.float64)).max() if want[k].size else 0
            print("golden: %s differs (largest %g)" % (k, diff))
            bad += 1
    print("golden: %d of %d arrays bit-identical" % (len(want) - bad, len(want)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
