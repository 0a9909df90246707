"""Forward speed of DCFormer++ beside DCPythia at the same shape (issue 27).

    python scripts/bench_dcformer.py [--dim 1024] [--n-head 16] [--n-layer 2] [--T 128,512] [--repeat 3]
    python scripts/bench_dcformer.py --mem-8b DIR [--T 64]   # 16-bit weights kept as stored

Random weights (make_tiny, float32, window 256 on the local layers of the LG
pattern), the same D, N, L, vocabulary and tokens: DCPythia (LayerNorm, GELU
MLP of width 4D, parallel residual) and DCFormer++ (RMSNorm, SwiGLU MLP of
DCFormerConfig's default width, the multiple of 256 at or above 8D/3, so the
two MLPs hold about the same parameters; sequential residual), the latter
with and without the mgate group gate (44 groups when they divide the
width). Prefill with logits at the last position, models loaded side by side
and run interleaved, best of --repeat after a warm-up.

--mem-8b writes a 2-layer DCFormer-8B-shaped float16 safetensors checkpoint
(the official config: D 4096, 32 heads, F 5632, mgate 44, vocab 152064, q/k
norm, LGLL; about 3 GiB, streamed to DIR), runs one pass in a fresh process
(scripts/bench.py's peak_rss: VmHWM after load + forward) and prints the peak
RSS against the stored weights; DIR is deleted afterwards.
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
    ap.add_argument("--mem-8b", dest="mem8b", metavar="DIR", help="only the DCFormer-8B-shaped fp16 memory test")
    a = ap.parse_args(argv)
    if a.mem8b:
        return mem_8b(a.mem8b, int(a.T.split(",")[0]) if a.T != "128,512" else 64)
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


def mem_8b(d, T):
    """Peak RSS of load + one pass of a 2-layer DCFormer-8B-shaped fp16 checkpoint."""
    import json
    import shutil

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench import peak_rss, stream_f16_safetensors

    D, N, F, V, E, L = 4096, 32, 5632, 152064, 44, 2
    Dh, K = D // N, 4 * N
    os.makedirs(d, exist_ok=True)
    cfg = {
        "model_type": "dcformer",
        "dim": D,
        "n_head": N,
        "head_dim": Dh,
        "n_layer": L,
        "n_local_heads": N,
        "intermediate_size": F,
        "vocab_size": V,
        "norm_eps": 1e-6,
        "rope_base": 500000.0,
        "mgate": True,
        "mgate_dim": E,
        "use_qk_norm": True,
        "window_size": 256,
        "window_type": "LGLL",
        "query_wise": False,
        "use_dcmha": True,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = [("tok_embeddings.weight", (V, D), 0.02)]
    for l in range(L):
        p = "layers.%d." % l
        tensors += [
            (p + "attention.wqkv.weight", (3 * D, D), 0.02),
            (p + "attention.wo.weight", (D, D), 0.02),
            (p + "attention.dyn_w_proj.dw1", (D, 1, 4, K), 0.02),
            (p + "attention.dyn_w_proj.qkw", (1, 4, K, 4, N), 0.05),
            (p + "attention.dyn_w_proj.dd", (D, 1, 4 * N), 0.02),
            (p + "attention.q_norm.scale", (Dh,), 1.0),
            (p + "attention.k_norm.scale", (Dh,), 1.0),
            (p + "feed_forward.w1.weight", (F, D), 0.02),
            (p + "feed_forward.w3.weight", (F, D), 0.02),
            (p + "feed_forward.w2.weight", (D, F), 0.02),
            (p + "feed_forward.mg.weight", (E, D), 0.02),
            (p + "ffn_norm.weight", (D,), 1.0),
            (p + "attention_norm.weight", (D,), 1.0),
        ]
    tensors += [("norm.weight", (D,), 1.0), ("output.weight", (V, D), 0.02)]
    try:
        stream_f16_safetensors(os.path.join(d, "model.safetensors"), tensors)
        r = peak_rss(d, T)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    gib = 1024.0**3
    print(
        "DCFormer-8B-shaped, 2 layers, fp16 safetensors, T=%d: peak RSS %.3f GiB (import %.3f GiB); "
        "stored weights %.3f GiB; activations %.3f GiB; peak / weights %.3f; "
        "(peak - import) / weights %.3f"
        % (
            T,
            r["maxrss"] / gib,
            r["import_rss"] / gib,
            r["stored"] / gib,
            r["act_peak"] / gib,
            r["maxrss"] / r["stored"],
            (r["maxrss"] - r["import_rss"]) / r["stored"],
        )
    )


if __name__ == "__main__":
    main()
