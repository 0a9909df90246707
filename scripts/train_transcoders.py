"""Per-layer transcoders (MLP input -> MLP output) for a model, trained in the engine on the
synthetic-task training stream (docs/features.md, "Attribution graphs").

    python scripts/train_transcoders.py --model dcpythia-small --out build/transcoders/dcpythia-small
    python scripts/train_transcoders.py --model dcpythia-tiny --out DIR --width 8 --k 16 --steps 600

Each layer l gets a TopK transcoder blocks.{l}.ln_mlp -> blocks.{l}.mlp.out of width
--width x d_model, trained for --steps steps of --seqs sequences of --context tokens (the
synthetic-task training lines, packed, tokenised by the model's tokenizer; the published
file's and the held-out set's examples are excluded by the generator), written in SAELens's
format to OUT/layer_{l}/ with its quality (explained variance, L0, dead features, CE loss
recovered) in OUT/quality.json. A layer whose directory exists is skipped, and a stopped
layer resumes from OUT/layer_{l}.ckpt.npz: rerun the same command to continue.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dclens  # noqa: E402
from dclens import features  # noqa: E402
from synth_tasks import corpus  # noqa: E402


def packed_tokens(model, n_seqs: int, context: int, start: int = 0) -> np.ndarray:
    """[n_seqs, context] int32: training lines start, start + 1, ... tokenised and packed."""
    need = n_seqs * context
    ids: list[int] = []
    for text in corpus.training_texts(start=start):
        ids.extend(int(t) for t in model.to_tokens(text + "\n"))
        if len(ids) >= need:
            break
    return np.asarray(ids[:need], np.int32).reshape(n_seqs, context)


def train_layer(model, layer: int, a, tokens: np.ndarray, out: str) -> dict:
    D = model.config.d_model
    cfg = features.SAEConfig(
        d_in=D,
        d_sae=a.width * D,
        arch="topk",
        k=a.k,
        hook_name="blocks.%d.ln_mlp" % layer,
        hook_name_out="blocks.%d.mlp.out" % layer,
        model_name=a.model,
        dataset_path="synth_tasks training stream",
        context_size=a.context,
    )
    sae = features.SAE(cfg, seed=layer)
    n_train = len(tokens) - a.eval_seqs
    src = features.TokenArrays(tokens[:n_train])
    t0 = time.time()
    features.train_sae(
        model,
        sae,
        src,
        steps=a.steps,
        seqs_per_step=a.seqs,
        lr=a.lr,
        checkpoint=os.path.join(out, "layer_%d.ckpt.npz" % layer),
        checkpoint_every=100,
    )
    q = features.evaluate(model, sae, features.TokenArrays(tokens[n_train:]), n_batches=1, seqs_per_batch=a.eval_seqs)
    features.save(sae, os.path.join(out, "layer_%d" % layer))
    q = {k: (float(v) if isinstance(v, (int, float, np.floating, np.integer)) else v) for k, v in q.items()}
    q["seconds"] = round(time.time() - t0, 1)
    print("layer %d: %s" % (layer, json.dumps(q)), flush=True)
    return q


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dcpythia-small", help="a bundled model's name or a checkpoint directory")
    p.add_argument("--out", required=True, help="the output directory (resumable)")
    p.add_argument("--width", type=int, default=8, help="features per model dimension")
    p.add_argument("--k", type=int, default=16, help="TopK: features kept per token")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--seqs", type=int, default=16, help="sequences per step")
    p.add_argument("--context", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-seqs", type=int, default=32, help="held-back sequences for the quality numbers")
    p.add_argument("--layers", default="all", help="comma-separated layers, or all")
    a = p.parse_args(argv)
    model = dclens.load(a.model)
    os.makedirs(a.out, exist_ok=True)
    n = a.steps * a.seqs + a.eval_seqs
    tokens = packed_tokens(model, n, a.context)
    L = model.config.n_layer
    layers = range(L) if a.layers == "all" else [int(x) for x in a.layers.split(",")]
    qpath = os.path.join(a.out, "quality.json")
    quality = {}
    if os.path.exists(qpath):
        with open(qpath) as f:
            quality = json.load(f)
    for l in layers:
        if os.path.isdir(os.path.join(a.out, "layer_%d" % l)) and str(l) in quality:
            print("layer %d: done (%s)" % (l, os.path.join(a.out, "layer_%d" % l)), flush=True)
            continue
        quality[str(l)] = train_layer(model, l, a, tokens, a.out)
        with open(qpath, "w") as f:
            json.dump(quality, f, indent=1)
    print("wrote %s (%d layers)" % (a.out, len(quality)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
