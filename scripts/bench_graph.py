#!/usr/bin/env python3
"""Edge attribution against exact edge patching (issue 37), on a bundled
model and prompt pairs of one synthetic task family.

    python scripts/bench_graph.py [--model dcpythia-small] [--task task56] [--pairs 32]
                                  [--window 48] [--steps 16] [--random 300] [--top 200] [--out FILE.json]
                                  [--exact-cache FILE.npz] [--time-only]
    python scripts/bench_graph.py --big DIR [--T 128] [--steps 16]   # the 6.9B-shaped fp16 checkpoint

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
5% of edges. Exact effects of every edge take one pass per edge (~15 min
on dcpythia-small): --exact-cache keeps them in a file and reuses them when
the edges and pairs are the same (a rerun after a change to attribution).

--big DIR: a DCPythia-6.9B-shaped fp16 checkpoint (32 layers, D 4096, 32
heads; written to DIR by scripts/bench.py's writer when absent, 13 GB), one
pair of T random tokens differing in one position, metric logit(a) -
logit(b) at the last position: the time of one forward + backward, of EAP
and of EAP-IG with --steps, the number of edges, the backward chunks and
the peak resident memory (the stored weights included).
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
    ap.add_argument("--act-steps", type=int, default=4, help="EAP-IG-activations: runs per node")
    ap.add_argument("--top", type=int, default=200)
    ap.add_argument("--random", type=int, default=300)
    ap.add_argument("--out", default=None)
    ap.add_argument("--exact-cache", default=None, help="keep / reuse the exact effects in this .npz")
    ap.add_argument("--big", default=None, metavar="DIR", help="the 6.9B-shaped fp16 run (module docstring)")
    ap.add_argument("--T", type=int, default=128, help="--big: tokens of the pair")
    ap.add_argument("--pause", type=float, default=0.5, help="seconds before each timed call (0: back to back)")
    ap.add_argument("--time-only", action="store_true", help="only the timings (no exact effects, no Spearman)")
    a = ap.parse_args(argv)
    if a.big:
        return big(a)
    m = dclens.load(a.model)
    c, x, good, bad = pairs(m, a.task, a.pairs, a.window)
    B, T = c.shape
    metrics = [patching.logit_diff(gd, bd) for gd, bd in zip(good, bad)]
    g = graph.build(m)
    res = {"model": a.model, "task": a.task, "pairs": B, "T": T, "edges": len(g.edges), "steps": a.steps}
    res["pause_s"] = a.pause
    print("bench_graph: %s, %s, %d pairs of %d tokens, %d edges" % (a.model, a.task, B, T, len(g.edges)))

    def timed(f, reps=3):  # best of reps, each after a pause: numpy's BLAS threads, which spin a
        best, out = float("inf"), None  # while after the scoring's products, are idle again (BENCHMARKS.md)
        for _ in range(reps):
            time.sleep(a.pause)
            t = time.perf_counter()
            out = f()
            best = min(best, time.perf_counter() - t)
        return best, out

    # the baseline: one forward + backward of the pairs with a gradient at one hook
    tgt = ("logit_diff", -1, good[0], bad[0])
    res["fwd_bwd_s"], _ = timed(lambda: m.gradients(c, tgt, wrt=["blocks.0.resid_pre"]))
    res["eap_s"], eap = timed(lambda: graph.attribute_edges(m, c, x, metrics, method="eap", graph=g, progress=False))
    res["eap_ig_s"], ig = timed(
        lambda: graph.attribute_edges(m, c, x, metrics, method="eap-ig", steps=a.steps, graph=g, progress=False), reps=1
    )
    res["eap_over_fwd_bwd"] = res["eap_s"] / res["fwd_bwd_s"]
    res["eap_ig_over_fwd_bwd"] = res["eap_ig_s"] / res["fwd_bwd_s"]
    res["act_steps"] = a.act_steps
    res["eap_ig_act_s"], act = timed(
        lambda: graph.attribute_edges(
            m, c, x, metrics, method="eap-ig-activations", steps=a.act_steps, graph=g, progress=False
        ),
        reps=1,
    )
    res["eap_ig_act_over_fwd_bwd"] = res["eap_ig_act_s"] / res["fwd_bwd_s"]
    print(
        "  EAP-IG-activations %d steps per node %.3f s (%.1fx)"
        % (a.act_steps, res["eap_ig_act_s"], res["eap_ig_act_over_fwd_bwd"])
    )
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
    res["blas"] = "%s, kernel %s" % (dclens.blas.library(), dclens.blas.kernel())
    print("  BLAS: %s" % res["blas"])
    if a.time_only:  # the timings alone: no exact patching of every edge (~20 min)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    clean_m = graph.patch(m, c, x, metrics, [], graph=g)
    corr_m = graph.patch(m, c, x, metrics, g.edges, graph=g)
    exact = None
    key = np.frombuffer(("\n".join(g.edges)).encode(), np.uint8)
    if a.exact_cache and os.path.exists(a.exact_cache):
        z = np.load(a.exact_cache)
        if np.array_equal(z["key"], key) and np.array_equal(z["clean"], c) and np.array_equal(z["corrupted"], x):
            exact, res["exact_all_s"] = z["exact"], float(z["seconds"])
            print("  exact effects read from %s" % a.exact_cache)
    if exact is None:
        t = time.perf_counter()
        exact = graph.patch_each(m, c, x, metrics, g.edges, graph=g) - clean_m
        res["exact_all_s"] = time.perf_counter() - t
        if a.exact_cache:
            np.savez(a.exact_cache, exact=exact, key=key, clean=c, corrupted=x, seconds=res["exact_all_s"])
    rng = np.random.default_rng(0)
    top = np.argsort(-np.abs(exact), kind="stable")[: a.top]
    rest = np.setdiff1d(np.arange(len(g.edges)), top)
    pick = np.concatenate([top, rng.choice(rest, size=min(a.random, rest.size), replace=False)])
    res["spearman_eap"] = spearman(eap.scores[pick], exact[pick])
    res["spearman_eap_ig"] = spearman(ig.scores[pick], exact[pick])
    res["spearman_eap_top"] = spearman(eap.scores[top], exact[top])
    res["spearman_eap_ig_top"] = spearman(ig.scores[top], exact[top])
    res["spearman_eap_ig_act"] = spearman(act.scores[pick], exact[pick])
    res["spearman_eap_ig_act_top"] = spearman(act.scores[top], exact[top])
    kinds = np.array([g.detail[e].kind for e in g.edges])
    for kind in ("resid", "comp"):  # within each kind of edge, over the same sample
        k_ = pick[kinds[pick] == kind]
        res["spearman_eap_%s" % kind] = spearman(eap.scores[k_], exact[k_])
        res["spearman_eap_ig_%s" % kind] = spearman(ig.scores[k_], exact[k_])
        res["spearman_eap_ig_act_%s" % kind] = spearman(act.scores[k_], exact[k_])
    k = max(1, int(round(0.05 * len(g.edges))))
    circ = ig.circuit(top_n=k)
    res["faithfulness_top5pct_act"] = graph.faithfulness(m, act.circuit(top_n=k), c, x, metrics)
    res["faithfulness_top5pct_eap"] = graph.faithfulness(m, eap.circuit(top_n=k), c, x, metrics)
    res["clean_metric"], res["corrupted_metric"] = clean_m, corr_m
    res["faithfulness_top5pct"] = graph.faithfulness(m, circ, c, x, metrics)
    res["top5pct_edges"] = k
    comp = [i for i, e in enumerate(g.edges) if g.detail[e].kind == "comp"]
    res["composition_edges_in_circuit"] = sum(1 for e in circ.edges if g.detail[e].kind == "comp")
    res["composition_share_of_exact_top"] = float(np.isin(top, comp).mean())
    print("  exact effects of every edge %.1f s; clean %.3f, corrupted %.3f" % (res["exact_all_s"], clean_m, corr_m))
    for label, key in (("EAP", "eap"), ("EAP-IG", "eap_ig"), ("EAP-IG-activations", "eap_ig_act")):
        print(
            "  Spearman with exact, %s: %.3f over the top %d + %d random (top only %.3f; residual %.3f, "
            "composition %.3f)"
            % (
                label,
                res["spearman_" + key],
                a.top,
                a.random,
                res["spearman_%s_top" % key],
                res["spearman_%s_resid" % key],
                res["spearman_%s_comp" % key],
            )
        )
    print(
        "  faithfulness of the top 5%% (%d edges): EAP %.3f, EAP-IG-activations %.3f; EAP-IG %.3f (%d composition edges)"
        % (
            k,
            res["faithfulness_top5pct_eap"],
            res["faithfulness_top5pct_act"],
            res["faithfulness_top5pct"],
            res["composition_edges_in_circuit"],
        )
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def big(a) -> int:
    """The 6.9B-shaped run (module docstring)."""
    import resource

    import dclens
    from dclens import graph, memplan

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench import write_69b_fp16

    if not os.path.exists(os.path.join(a.big, "model.safetensors")):
        print("bench_graph: writing the 6.9B-shaped fp16 checkpoint to %s" % a.big, flush=True)
        write_69b_fp16(a.big)
    m = dclens.load(a.big)
    rng = np.random.default_rng(0)
    c = rng.integers(0, m.config.vocab, size=(1, a.T))
    x = c.copy()
    x[0, a.T // 2] = (x[0, a.T // 2] + 1) % m.config.vocab
    tgt = ("logit_diff", -1, 11, 12)
    g = graph.build(m)
    res = {"T": a.T, "edges": len(g.edges), "steps": a.steps, "layers": m.config.n_layer}
    res["comp_edges"] = sum(1 for e in g.edges if g.detail[e].kind == "comp")
    print(
        "bench_graph --big: %d layers, T %d, %d edges (%d composition)"
        % (m.config.n_layer, a.T, res["edges"], res["comp_edges"]),
        flush=True,
    )
    t = time.perf_counter()
    m.gradients(c, tgt, wrt=["blocks.0.resid_pre"])
    res["fwd_bwd_s"] = time.perf_counter() - t
    print("  forward + backward %.1f s" % res["fwd_bwd_s"], flush=True)
    t = time.perf_counter()
    eap = graph.attribute_edges(m, c, x, tgt, graph=g, progress=True)
    res["eap_s"] = time.perf_counter() - t
    res["eap_over_fwd_bwd"] = res["eap_s"] / res["fwd_bwd_s"]
    print("  EAP %.1f s (%.1fx); top edges %s" % (res["eap_s"], res["eap_over_fwd_bwd"], eap.top(3)), flush=True)
    t = time.perf_counter()
    graph.attribute_edges(m, c, x, tgt, method="eap-ig", steps=a.steps, graph=g, progress=True)
    res["eap_ig_s"] = time.perf_counter() - t
    res["eap_ig_over_fwd_bwd"] = res["eap_ig_s"] / res["fwd_bwd_s"]
    res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    res["stored_gib"] = sum(os.path.getsize(os.path.join(a.big, f)) for f in os.listdir(a.big)) / 2**30
    res["tape_budget_gib"] = memplan.check_budget(None, m) / 2**30
    print(
        "  EAP-IG %d steps %.1f s (%.1fx); peak RSS %.2f GiB (stored weights %.2f GiB included)"
        % (a.steps, res["eap_ig_s"], res["eap_ig_over_fwd_bwd"], res["peak_rss_gib"], res["stored_gib"]),
        flush=True,
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
