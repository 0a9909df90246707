"""Find a benchmark line where a DCPythia's heads visibly compose (for the heatmaps).

    eff = composition_effect(model, ids, positions)   # [L, N, P]
    pick = most_composed(model, lines)                 # dict: line, layer, head, answer, text, ...

The effect of composition on head n of layer l at query position t is the L1
distance between the attention weights the head applies (``pattern_composed``,
after pre- and post-compose) and the plain-MHA weights of the same queries and
keys (softmax of ``scores`` under the causal and, on local layers, window mask):
0 when no head mixes into another (composed weights need not sum to 1, so it
can exceed 2).  It is measured at the positions
that predict a scored answer's first token.

Command line:
    python -m synth_tasks.cli composed-line --model M [--data FILE|heldout] [--lines N] [--text-out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from dclens import hook_name

from .tokenize import tokenize_lines


def _mask(T: int, local: bool, window: int) -> np.ndarray:
    t = np.arange(T)[:, None]
    s = np.arange(T)[None, :]
    m = s <= t
    if local:
        m &= (t - s) <= window
    return m


def composition_effect(model, ids, positions) -> np.ndarray:
    """[L, N, P]: sum_s |pattern_composed - softmax_masked(scores)| at each query position."""
    cfg = model.config
    if not getattr(cfg, "use_dcmha", False):
        raise ValueError(f"{model.name}: a {cfg.model_type} model without DCMHA has no composition")
    ids = np.asarray(ids, dtype=np.int32)
    pos = np.asarray(list(positions), dtype=np.int64)
    L = cfg.n_layer
    names = [hook_name(l, "attn." + h) for l in range(L) for h in ("scores", "pattern_composed")]
    _, cache = model.run_with_cache(ids, names=names)
    T = len(ids)
    out = np.zeros((L, cfg.n_head, len(pos)))
    for l in range(L):
        sc = cache[hook_name(l, "attn.scores")].astype(np.float64)  # [N, T, S]
        m = _mask(T, l in cfg.local_layers, cfg.window_size)
        sc = np.where(m[None], sc, -np.inf)
        sc -= sc.max(axis=-1, keepdims=True)
        p0 = np.exp(sc)
        p0 /= p0.sum(axis=-1, keepdims=True)
        p1 = cache[hook_name(l, "attn.pattern_composed")].astype(np.float64)
        out[l] = np.abs(p1 - p0)[:, pos, :].sum(axis=-1)
    return out


def most_composed(model, lines, tokenizer=None) -> dict:
    """The (line, layer, head, answer) with the largest composition effect at
    the position predicting the answer; ``text`` is the line up to the end of
    that answer (what to draw)."""
    tok = tokenizer if tokenizer is not None else model.tokenizer
    best = None
    for i, tl in enumerate(tokenize_lines(list(lines), tok)):
        if not tl.spans:
            continue
        eff = composition_effect(model, tl.ids, [s - 1 for s, _ in tl.spans])
        l, n, a = np.unravel_index(int(np.argmax(eff)), eff.shape)
        if best is None or eff[l, n, a] > best["effect"]:
            ans = tl.line.answers[a]
            best = {
                "index": i,
                "line": tl.line.lineno,
                "task_id": tl.line.task_id,
                "layer": int(l),
                "head": int(n),
                "answer": ans.text,
                "k": ans.k,
                "query_position": int(tl.spans[a][0] - 1),
                "effect": float(eff[l, n, a]),
                "mean_effect": float(eff.mean()),
                "text": tl.line.text[: ans.end],
            }
    if best is None:
        raise ValueError("no line with a scored answer")
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m synth_tasks.cli composed-line",
        description="The benchmark line where a DCPythia's heads compose most.",
    )
    ap.add_argument("--model", required=True, help="DCPythia directory or bundled model name")
    ap.add_argument("--data", default="heldout", help="benchmark JSONL, or 'heldout' (default)")
    ap.add_argument("--lines", type=int, default=74, help="look at the first N lines (default 74)")
    ap.add_argument("--text-out", default=None, help="write the chosen text (line up to the answer) here")
    a = ap.parse_args(argv)
    import dclens

    from .corpus import HELDOUT_FILE
    from .dataset import DatasetError, load_dataset

    try:
        ds = load_dataset(HELDOUT_FILE if a.data == "heldout" else a.data, limit=a.lines)
        pick = most_composed(dclens.load(a.model), ds.lines)
        if a.text_out:
            with open(a.text_out, "w", encoding="utf-8") as f:
                f.write(pick["text"])
    except (DatasetError, ValueError, OSError, dclens.Error) as e:
        print(f"composed-line: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(pick, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
