"""Notebook 02's case study as one function, to ask whether its findings hold in
another model of the same recipe (another training seed, issue 29).

    from synth_tasks.case_study import case_study
    r = case_study(model, line, answer_index)   # a dict of plain numbers
    s = survey({"seed 0": m0, "seed 1": m1}, lines, limit=40)   # the same on many answers
    summarise(s["seed 0"])                      # what the answers have in common

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

from collections.abc import Sequence

import numpy as np

from .evaluate import refuse_hooks
from .probe import probe

BRANCHES = ("skip", "qp", "kp", "qg", "kg")


def _p_at(logits: np.ndarray, pos: int, tok: int) -> float:
    z = logits[pos].astype(np.float64)
    z = np.exp(z - z.max())
    return float(z[tok] / z.sum())


def _refuse_hooks(model, what: str) -> None:
    refuse_hooks(
        model,
        "synth_tasks.case_study.%s" % what,
        "its integrated gradients (model.attribute) run gradient passes, which cannot run Python hooks, "
        "so its numbers would mix the hooked and the un-hooked model",
    )


def _zero_head(name: str, index):
    def fn(act, _name):
        act[index] = 0.0
        return act

    return (name, fn)


def case_study(model, line, answer_index: int, steps: int = 32) -> dict:
    """The case-study numbers of `model` on the answer `answer_index` of `line`
    (a synth_tasks Line); ValueError when that answer does not analyse; a
    dclens.Error when the model has hooks in force (model.attribute's gradient
    passes cannot run them, so its numbers would mix hooked and un-hooked passes)."""
    _refuse_hooks(model, "case_study")
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


# an applied weight on the source below this (a tenth of a unit of attention) counts as "not reading it"
READS_SOURCE = 0.1


def survey(models: dict[str, object], lines: Sequence, limit: int = 40, steps: int = 32, progress=None) -> dict:
    """case_study on the same answers in every model of `models` (label -> model):
    the answers of `lines` that every model gets right (greedy, the benchmark's
    own scoring) and that have a source to analyse, in file order, at most
    `limit` of them. Returns {"answers": [(task_id, line, answer_index)],
    label: [case_study dict per answer]} (models without DCMHA get the IG part)."""
    from .evaluate import evaluate

    for m in models.values():  # before any model runs
        _refuse_hooks(m, "survey")

    right = None
    for m in models.values():
        ok = {(a.task_id, a.line, a.example) for a in evaluate(m, lines, progress=False).answers if a.correct}
        right = ok if right is None else right & ok
    tokenizer = next(iter(models.values())).tokenizer
    picked: list = []
    for line in lines:
        for j, a in enumerate(line.answers):
            if (
                len(picked) < limit
                and (line.task_id, line.lineno, a.example) in right
                and probe(line, j, tokenizer) is not None
            ):
                picked.append((line, j))
    out: dict = {"answers": [(line.task_id, line.lineno, j) for line, j in picked]}
    from dclens import progress as _progress

    bar = _progress.bar(total=len(picked) * len(models), unit="answer", desc="case studies", progress=progress)
    for label, m in models.items():
        out[label] = []
        for line, j in picked:
            out[label].append(case_study(m, line, j, steps=steps))
            bar.update(1)
    bar.close()
    return out


def summarise(results: Sequence[dict]) -> dict:
    """What a model's case studies (one per answer) have in common: how often IG's
    top head reads the source (applied weight >= READS_SOURCE), and for those
    answers the branch that carries that weight, the share of it lent by other
    heads, and how often zeroing the top branch or the head at least halves
    p(answer)."""
    n = len(results)
    out: dict = {"answers": n}
    if n == 0 or "weight" not in results[0]:
        return out
    reads = [r for r in results if r["weight"] >= READS_SOURCE]
    out["reads_source"] = len(reads)
    out["top_branch"] = {b: sum(r["top_branch"] == b for r in reads) for b in BRANCHES}
    out["borrowed_share_median"] = float(np.median([r["borrowed"] / r["weight"] for r in reads])) if reads else None
    out["head_needed"] = sum(r["p_without_head"] <= 0.5 * r["p_answer"] for r in results)
    out["branch_needed"] = sum(r["p_without_branch"] <= 0.5 * r["p_answer"] for r in results)
    out["top_layer"] = {
        str(layer): sum(r["head"][0] == layer for r in results) for layer in sorted({r["head"][0] for r in results})
    }
    return out
