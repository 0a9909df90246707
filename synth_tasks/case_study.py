"""Notebook 02's case study as one function, to ask whether its findings hold in
another model of the same recipe (another training seed, issue 29).

    from synth_tasks.case_study import case_study
    r = case_study(model, line, answer_index)   # a dict of plain numbers

On one scored answer of a benchmark line (`synth_tasks.probe`): p(answer) at the
query; the head most important for log p(answer) by integrated gradients over
every head's output (32 steps); that head's applied (composed) weight from the
query to the source token split into the five compose branches and, through
`model.flows`, into its own part and the part lent by the other heads (the
largest lender named); and two interventions: p(answer) with the top branch of
that head zeroed, and with the head's output zeroed. Head numbers are not
comparable between seeds (heads are interchangeable at initialisation): the
comparable findings are the branch that carries the weight, the borrowed share,
and the interventions' effects.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from .probe import probe

BRANCHES = ("skip", "qp", "kp", "qg", "kg")


def _p_at(logits: np.ndarray, pos: int, tok: int) -> float:
    z = logits[pos].astype(np.float64)
    z = np.exp(z - z.max())
    return float(z[tok] / z.sum())


def _zero_head(name: str, index):
    def fn(act, _name):
        act[index] = 0.0
        return act

    return (name, fn)


def case_study(model, line, answer_index: int, steps: int = 32) -> Dict:
    """The case-study numbers of `model` on the answer `answer_index` of `line`
    (a synth_tasks Line); ValueError when that answer does not analyse."""
    P = probe(line, answer_index, model.tokenizer)
    if P is None:
        raise ValueError("%s line %d answer %d: no source to analyse" % (line.task_id, line.lineno, answer_index))
    Q, SRC, TOK = P.query, P.source, P.answer_token
    L = model.config.n_layer
    base = _p_at(model.forward(P.ids), Q, TOK)
    at = ["blocks.%d.attn.head_out" % layer for layer in range(L)]
    r = model.attribute(P.ids, ("logprob", Q, TOK), at=at, method="ig", steps=steps, progress=False)
    ig = np.stack([r.per_head[n] for n in at])  # [L, N]
    ls, hs = (int(i) for i in np.unravel_index(int(np.argmax(ig)), ig.shape))
    out = {
        "model": model.name,
        "task_id": P.task_id,
        "line": P.lineno,
        "answer_index": P.answer_index,
        "answer": P.answer,
        "p_answer": base,
        "head": [ls, hs],
        "ig": float(ig[ls, hs]),
        "ig_share": float(ig[ls, hs] / np.abs(ig).sum()),
    }
    if not model.config.use_dcmha:
        return out
    cache = model.run_with_cache(P.ids, names=lambda n: n.startswith("blocks.%d." % ls))[1]
    lay = cache.layer(ls)
    br = {b: float(lay["attn.post." + b][hs, Q, SRC]) for b in BRANCHES}
    w = float(lay["attn.pattern_composed"][hs, Q, SRC])
    top = max(br, key=lambda b: abs(br[b]))
    F = model.flows(P.ids, ls, "post", hs, Q, cache=cache)[:, :, SRC]  # [N source, 5]
    own = float(F[hs].sum())
    lent = {n: float(F[n].sum()) for n in range(F.shape[0]) if n != hs}
    lender = max(lent, key=lambda n: abs(lent[n]))
    pre = "blocks.%d.attn." % ls
    hooks = {
        "p_without_branch": [_zero_head(pre + "post." + top, (hs,))],
        "p_without_head": [_zero_head(pre + "z", (slice(None), hs))],
    }
    out.update(
        {
            "weight": w,
            "branches": br,
            "top_branch": top,
            "top_branch_share": abs(br[top]) / sum(abs(v) for v in br.values()),
            "own": own,
            "borrowed": float(sum(lent.values())),
            "lender": int(lender),
            "lent_by_lender": lent[lender],
        }
    )
    for k, h in hooks.items():
        out[k] = _p_at(model.run_with_hooks(P.ids, fwd_hooks=h), Q, TOK)
    return out
