#!/usr/bin/env python3
"""Edge attribution against exact edge patching (issue 37), on a bundled
model and prompt pairs of one synthetic task family.

    python scripts/bench_graph.py [--model dcpythia-small] [--task task56] [--pairs 32]
                                  [--window 48] [--steps 16] [--random 300] [--top 200] [--out FILE.json]

Pairs: the published file's answers of the task (synth_tasks.probe: each
answer's prompt and its equal-length corruption), the last --window tokens
of each prompt (the corruption inside them), the first --pairs of them;
metric per pair: logit(answer) -
logit(corrupted answer) at the answer's position. Prints, and writes as
JSON: the edge count; the time of one forward + backward over the pairs
(the baseline), of EAP and of EAP-IG with --steps; the Spearman rank
correlation of EAP and EAP-IG scores with the exact single-edge effect
(graph.patch_each) over the --top edges of largest exact effect plus
--random random others; the faithfulness of the EAP-IG circuit of the top
5% of edges. Exact effects of every edge take one pass per edge.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "synthetic_dataset.jsonl")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra = np.argsort(np.argsort(a)).astype(np.float64)
    rb = np.argsort(np.argsort(b)).astype(np.float64)
    return float(np.corrcoef(ra, rb)[0, 1])


def pairs(model, task: str, n: int, window: int):
    """The first n answers of the task with a corruption, as the last `window`
    tokens of their prompts (the corruption inside them), so every pair has one
    length."""
    from synth_tasks.dataset import load_dataset
    from synth_tasks.probe import probes

    out = []
    for p in probes(load_dataset(DATA).lines, model.tokenizer, tasks={task}):
        if p.corrupted is None or p.query + 1 < window:
            continue
        a, b = p.query + 1 - window, p.query + 1
        if np.any(p.ids[:a] != p.corrupted[:a]):
            continue  # the edit lies before the window
        out.append((p.ids[a:b], p.corrupted[a:b], int(p.answer_token), int(p.corrupted_token)))
        if len(out) == n:
            break
    if not out:
        raise SystemExit("bench_graph: no answer of %s with a corruption inside %d tokens" % (task, window))
    clean = np.stack([o[0] for o in out]).astype(np.int64)
    corr = np.stack([o[1] for o in out]).astype(np.int64)
    return clean, corr, [o[2] for o in out], [o[3] for o in out]


def main(argv=None) -> int:
    import dclens
    from dclens import graph, patching

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dcpythia-small")
    ap.add_argument("--task", default="task56")
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--window", type=int, default=48, help="the last WINDOW tokens of each prompt")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=200)
    ap.add_argument("--random", type=int, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    m = dclens.load(a.model)
    c, x, good, bad = pairs(m, a.task, a.pairs, a.window)
    B, T = c.shape
    metrics = [patching.logit_diff(gd, bd) for gd, bd in zip(good, bad)]
    g = graph.build(m)
    res = {"model": a.model, "task": a.task, "pairs": B, "T": T, "edges": len(g.edges), "steps": a.steps}
    print("bench_graph: %s, %s, %d pairs of %d tokens, %d edges" % (a.model, a.task, B, T, len(g.edges)))

    def timed(f, reps=3):
        best, out = float("inf"), None
        for _ in range(reps):
            t = time.perf_counter()
            out = f()
            best = min(best, time.perf_counter() - t)
        return best, out

    # the baseline: one forward + backward of the pairs with a gradient at one hook
    tgt = ("logit_diff", -1, good[0], bad[0])
    res["fwd_bwd_s"], _ = timed(lambda: m.gradients(c, tgt, wrt=["blocks.0.resid_pre"]))
    res["eap_s"], eap = timed(lambda: graph.attribute(m, c, x, metrics, method="eap", graph=g, progress=False))
    res["eap_ig_s"], ig = timed(
        lambda: graph.attribute(m, c, x, metrics, method="eap-ig", steps=a.steps, graph=g, progress=False), reps=1
    )
    res["eap_over_fwd_bwd"] = res["eap_s"] / res["fwd_bwd_s"]
    res["eap_ig_over_fwd_bwd"] = res["eap_ig_s"] / res["fwd_bwd_s"]
    print(
        "  forward+backward %.3f s, EAP %.3f s (%.1fx), EAP-IG %d steps %.3f s (%.1fx)"
        % (
            res["fwd_bwd_s"],
            res["eap_s"],
            res["eap_over_fwd_bwd"],
            a.steps,
            res["eap_ig_s"],
            res["eap_ig_over_fwd_bwd"],
        )
    )
    clean_m = graph.patch(m, c, x, metrics, [], graph=g)
    corr_m = graph.patch(m, c, x, metrics, g.edges, graph=g)
    t = time.perf_counter()
    exact = graph.patch_each(m, c, x, metrics, g.edges, graph=g) - clean_m
    res["exact_all_s"] = time.perf_counter() - t
    rng = np.random.default_rng(0)
    top = np.argsort(-np.abs(exact), kind="stable")[: a.top]
    rest = np.setdiff1d(np.arange(len(g.edges)), top)
    pick = np.concatenate([top, rng.choice(rest, size=min(a.random, rest.size), replace=False)])
    res["spearman_eap"] = spearman(eap.scores[pick], exact[pick])
    res["spearman_eap_ig"] = spearman(ig.scores[pick], exact[pick])
    res["spearman_eap_top"] = spearman(eap.scores[top], exact[top])
    res["spearman_eap_ig_top"] = spearman(ig.scores[top], exact[top])
    k = max(1, int(round(0.05 * len(g.edges))))
    circ = ig.circuit(top_n=k)
    res["clean_metric"], res["corrupted_metric"] = clean_m, corr_m
    res["faithfulness_top5pct"] = graph.faithfulness(m, circ, c, x, metrics)
    res["top5pct_edges"] = k
    comp = [i for i, e in enumerate(g.edges) if g.detail[e].kind == "comp"]
    res["composition_edges_in_circuit"] = sum(1 for e in circ.edges if g.detail[e].kind == "comp")
    res["composition_share_of_exact_top"] = float(np.isin(top, comp).mean())
    print("  exact effects of every edge %.1f s; clean %.3f, corrupted %.3f" % (res["exact_all_s"], clean_m, corr_m))
    print(
        "  Spearman with exact (top %d + %d random): EAP %.3f, EAP-IG %.3f; top only: %.3f, %.3f"
        % (
            a.top,
            a.random,
            res["spearman_eap"],
            res["spearman_eap_ig"],
            res["spearman_eap_top"],
            res["spearman_eap_ig_top"],
        )
    )
    print(
        "  faithfulness of the EAP-IG top 5%% (%d edges, %d composition): %.3f"
        % (k, res["composition_edges_in_circuit"], res["faithfulness_top5pct"])
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
