#!/usr/bin/env python3
"""Issue 15's check, written the way a TransformerLens user writes code, on
generated tiny models (a DCPythia with local + global layers, its
query_wise variant, and a Pythia), with the real GPT-NeoX tokenizer:

  1. batched prompts of different lengths (left and right padding) equal
     their one-by-one results (logits and cached activations);
  2. generate() (the engine's incremental decoder) equals the argmax of
     full forwards, token by token;
  3. patching identities: clean into clean changes nothing, patching the
     residual everywhere reproduces the clean run;
  4. direct logit attribution sums to the logit;
  5. routing from a cache equals the per-query calls.

    python scripts/tl_user_check.py [--tokenizer ../shared/data/gpt-neox-20b-tokenizer.json]

Prints one line per check and "all checks passed"; exits 1 on a failure.
"""

import argparse
import os
import sys
import tempfile

import numpy as np

import dclens
from dclens import patching, routing
from dclens.testing.make_tiny import make_tiny

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TOK = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "data", "gpt-neox-20b-tokenizer.json")

failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        failures.append(what)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def run(model, label):
    prompts = ["When Mary and John went to the store, John gave a drink to", "Hello there", "The cat sat on the mat"]

    # 1. batches ------------------------------------------------------------------
    for side in ("right", "left"):
        tokens, lengths = model.to_tokens(prompts, padding_side=side)
        logits, cache = model.run_with_cache(
            prompts, padding_side=side, names_filter=lambda n: n.endswith(("hook_pattern", "hook_resid_post"))
        )
        T = tokens.shape[1]
        worst = 0.0
        for i, p in enumerate(prompts):
            n = lengths[i]
            sl = slice(0, n) if side == "right" else slice(T - n, T)
            one_logits, one_cache = model.run_with_cache(p, names_filter=lambda n: n.endswith("hook_pattern"))
            worst = max(worst, rel(logits[i, sl], one_logits))
            for l in range(model.config.n_layer):
                worst = max(worst, rel(cache["pattern", l][i][:, sl, sl], one_cache["pattern", l]))
        check(worst <= 1e-5, "%s: batched (%s padding) = one by one (max rel err %.1e)" % (label, side, worst))

    # 2. generation ---------------------------------------------------------------
    prompt = model.to_tokens(prompts[0])
    out = model.generate(prompt, max_new_tokens=10, return_type="tokens")
    seq = list(prompt)
    for _ in range(10):
        seq.append(int(model(np.array(seq))[-1].argmax()))
    check(np.array_equal(out, seq), "%s: generate = argmax of full forwards (%d new tokens)" % (label, 10))
    check(isinstance(model.generate(prompts[1], 3), str), "%s: generate(str) gives text" % label)

    # 3. patching identities ------------------------------------------------------
    clean = model.to_tokens(prompts[0])
    corrupted = model.to_tokens(prompts[0].replace("Mary", "Alice"))
    if corrupted.size == clean.size:
        answer, other = model.to_single_token(" Mary"), model.to_single_token(" John")
        metric = patching.logit_diff(answer, other)
        same = patching.sweep(model, clean, clean, metric, over="layer,head", progress=False)
        check(
            np.abs(same.values - same.clean).max() <= 1e-4 * max(1, abs(same.clean)),
            "%s: patching clean into clean changes nothing" % label,
        )
        _, clean_cache = model.run_with_cache(clean)
        patched = patching.run_patched(model, corrupted, clean_cache, ["blocks.0.hook_resid_pre"])
        check(np.array_equal(patched, model(clean)), "%s: patching the whole residual = the clean run" % label)
        r = patching.sweep(model, clean, corrupted, metric, over="layer,pos", progress=False)
        check(r.values.shape == (model.config.n_layer, clean.size), "%s: layer x position sweep" % label)

    # 4. direct logit attribution ---------------------------------------------------
    logits, cache = model.run_with_cache(prompts[0])
    tok = int(logits[-1].argmax())
    attrs, labels = dclens.cache.dla(cache, token=tok, pos=-1)
    check(
        abs(attrs.sum() - logits[-1, tok]) <= 1e-4 * max(1, abs(logits[-1, tok])),
        "%s: DLA over %d components sums to the logit (%.5f vs %.5f)"
        % (label, len(labels), attrs.sum(), logits[-1, tok]),
    )
    stack = cache.decompose_resid()
    check(rel(stack.sum(0), cache["resid_post", -1]) <= 1e-5, "%s: decompose_resid sums to the residual" % label)

    # 5. routing from a cache -----------------------------------------------------
    toks = model.to_tokens(prompts[0])
    for phase in ("pre", "post"):
        R = routing.routing_matrices(model, cache, phase)
        worst = max(
            rel(R[l, t], model.routing_matrix(toks, l, phase, t))
            for l in range(model.config.n_layer)
            for t in range(len(toks))
        )
        check(
            worst <= 1e-6,
            "%s: routing from a cache (%s) = per-query calls over %d queries x %d layers"
            % (label, phase, len(toks), model.config.n_layer),
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=DEFAULT_TOK)
    a = ap.parse_args()
    if not os.path.exists(a.tokenizer):
        print("tokenizer not found: %s" % a.tokenizer, file=sys.stderr)
        return 2
    kinds = [
        ("dcpythia", dict(model_type="dcpythia", n_layer=3, window_size=4)),
        ("dcpythia query_wise", dict(model_type="dcpythia", n_layer=2, window_size=4, query_wise=True)),
        ("pythia", dict(model_type="gpt_neox", n_layer=2)),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, kw) in enumerate(kinds):
            d = os.path.join(tmp, "m%d" % i)
            make_tiny(d, dim=32, n_head=4, vocab=50304, tokenizer=a.tokenizer, seed=100 + i, **kw)
            run(dclens.load(d), label)
    if failures:
        print("%d check(s) failed" % len(failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
