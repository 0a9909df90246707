"""The evaluator: one forward pass per line, NLL and greedy correctness per answer.

Protocol (docs/synthetic-benchmark.md): each line is read with the brackets
removed, as one sequence, no BOS.  For a scored answer whose tokens sit at
positions [s, e): NLL = sum_{p in [s, e)} -log softmax(logits[p - 1])[ids[p]];
it is correct when ids[p] is the arg-max of logits[p - 1] for every p.
Accuracy = mean correctness over answers; perplexity = exp(sum NLL / number of
answer tokens).  Reported overall, per task, per shot count k, per QK pattern
and per OV transformation (for tasks in the table).

Lines are sorted by token length and batched (right-padded with token 0; the
causal mask makes the padding invisible to the real positions).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from dclens import progress as _progress

from .dataset import Dataset
from .tasks import TASKS
from .tokenize import TokenizedLine, tokenize_lines


@dataclass
class AnswerResult:
    task_id: str
    line: int  # line number in the file
    k: int  # shot count
    example: int  # example number within the line (1-based)
    answer: str
    nll: float  # sum over the answer's tokens
    n_tokens: int
    correct: bool
    target_ids: list[int]
    pred_ids: list[int]  # arg-max token at each answer position
    pred_text: str = ""


@dataclass(frozen=True)
class TaskResult:
    """One task's results: the row ``summary["per_task"][task_id]`` as a record."""

    task_id: str
    acc: float  # accuracy: the fraction of its answers scored correct (greedy, every token)
    ppl: float  # perplexity: exp(nll / tokens)
    n: int  # scored answers
    correct: int  # of them correct
    tokens: int  # answer tokens
    nll: float  # summed over the answer tokens
    pattern: str | None  # QK pattern (synth_tasks.TASKS; None for a task outside the table)
    transform: str | None  # OV transformation

    @property
    def accuracy(self) -> float:
        return self.acc

    @property
    def perplexity(self) -> float:
        return self.ppl


@dataclass
class EvalResult:
    """What evaluate() returns.

    answers      one AnswerResult per scored answer, in file order
    summary      dict (what results.json holds): "overall", "per_task",
                 "per_k", "per_pattern", "per_transform", each {"acc", "ppl",
                 "n", "correct", "tokens", "nll"} (per_task rows add
                 "pattern" and "transform")
    per_task     the same per-task rows typed: task id -> TaskResult, in task
                 order (``res.per_task["task56"].acc``, ``.n``, ``.ppl``, ...)
    overall      summary["overall"]
    speed        lines, batches, tokens, padded_tokens, forward_s, wall_s, tokens_per_s
    """

    model_name: str
    answers: list[AnswerResult]
    summary: dict  # overall / per_task / per_k / per_pattern / per_transform
    speed: dict
    n_lines: int
    extra: dict = field(default_factory=dict)

    @property
    def overall(self) -> dict:
        return self.summary["overall"]

    @property
    def per_task(self) -> dict[str, TaskResult]:
        """task id -> TaskResult (accuracy, n, perplexity, ... of summary["per_task"])."""
        return {
            tid: TaskResult(
                task_id=tid,
                acc=r["acc"],
                ppl=r["ppl"],
                n=r["n"],
                correct=r["correct"],
                tokens=r["tokens"],
                nll=r["nll"],
                pattern=r.get("pattern"),
                transform=r.get("transform"),
            )
            for tid, r in self.summary["per_task"].items()
        }


# ---------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------


def stats(rows: list[AnswerResult]) -> dict:
    n = len(rows)
    tokens = sum(r.n_tokens for r in rows)
    nll = sum(r.nll for r in rows)
    correct = sum(1 for r in rows if r.correct)
    return {
        "acc": correct / n if n else float("nan"),
        "ppl": math.exp(nll / tokens) if tokens else float("nan"),
        "n": n,
        "correct": correct,
        "tokens": tokens,
        "nll": nll,
    }


def _task_key(t: str):
    return (0, int(t[4:]), t) if t.startswith("task") and t[4:].isdigit() else (1, 0, t)


def aggregate(rows: list[AnswerResult], tasks=None) -> dict:
    """The summary dict of results.json (without model/data/speed fields)."""
    tasks = TASKS if tasks is None else tasks
    groups: dict[str, dict] = {"per_task": {}, "per_k": {}, "per_pattern": {}, "per_transform": {}}
    for r in rows:
        groups["per_task"].setdefault(r.task_id, []).append(r)
        groups["per_k"].setdefault(r.k, []).append(r)
        t = tasks.get(r.task_id)
        if t is not None:
            groups["per_pattern"].setdefault(t.pattern, []).append(r)
            groups["per_transform"].setdefault(t.transform, []).append(r)
    out = {"overall": stats(rows)}
    per_task = {}
    for tid in sorted(groups["per_task"], key=_task_key):
        s = stats(groups["per_task"][tid])
        t = tasks.get(tid)
        s["pattern"] = t.pattern if t else None
        s["transform"] = t.transform if t else None
        per_task[tid] = s
    out["per_task"] = per_task
    out["per_k"] = {str(k): stats(groups["per_k"][k]) for k in sorted(groups["per_k"])}
    out["per_pattern"] = {p: stats(v) for p, v in sorted(groups["per_pattern"].items())}
    out["per_transform"] = {p: stats(v) for p, v in sorted(groups["per_transform"].items())}
    return out


# ---------------------------------------------------------------------------
# batching and scoring
# ---------------------------------------------------------------------------


def make_batches(lengths, batch_tokens: int = 2048, max_batch: int = 64) -> list[list[int]]:
    """Group indices of lines of similar length: sorted longest first, each batch
    holding as many lines as fit in ``batch_tokens`` padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur, cur_max = [], [], 0
    for i in order:
        L = max(int(lengths[i]), 1)
        new_max = max(cur_max, L)
        if cur and ((len(cur) + 1) * new_max > batch_tokens or len(cur) >= max_batch):
            batches.append(cur)
            cur, new_max = [], L
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


def _require_finite(logits: np.ndarray, lines) -> None:
    """No score is ever computed from NaN/inf logits (non-finite weights, an
    overflow): that would report accuracy 0 as if it were a result."""
    if np.isfinite(logits).all():
        return
    b = int(np.argwhere(~np.isfinite(logits))[0][0])
    raise ValueError(
        f"{lines[b].where}: the model gave NaN or inf logits; no score is "
        "reported (non-finite weights or an overflow in the model)"
    )


def _score(logits_row: np.ndarray, ids: np.ndarray, span: tuple[int, int], rows=None):
    """NLL (float64) and greedy predictions of the answer at token span [s, e)
    (rows: the logits of positions s-1 .. e-2, when given instead of logits_row)."""
    s, e = span
    if rows is None:
        rows = logits_row[s - 1 : e - 1]
    rows = np.asarray(rows, dtype=np.float64)
    tgt = ids[s:e].astype(np.int64)
    m = rows.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(rows - m).sum(axis=-1))
    lp = rows[np.arange(len(tgt)), tgt] - lse
    pred = rows.argmax(axis=-1)
    return float(-lp.sum()), pred.astype(np.int64), tgt


def _takes_logits_at(model) -> bool:
    """Does model.forward accept logits_at= (dclens models do)?"""
    import inspect

    try:
        return "logits_at" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _answer_positions(lines) -> np.ndarray:
    """[B, n] int32: the positions whose logits score the answers of each
    tokenized line of a batch (s-1 .. e-2 of every answer span), padded by
    repeating the last one."""
    per = []
    for tl in lines:
        p = sorted({q for s, e in tl.spans for q in range(s - 1, e - 1)})
        per.append(p or [0])
    n = max(len(p) for p in per)
    return np.array([p + [p[-1]] * (n - len(p)) for p in per], dtype=np.int32)


def hooks_in_force(model) -> list:
    """The (name, fn) hooks a model runs on every pass: those added with
    add_hook or ``with model.hooks(...)`` (a dclens model's runner.ctx_hooks;
    [] for a model without)."""
    return list(getattr(getattr(model, "runner", None), "ctx_hooks", None) or [])


def refuse_hooks(model, what: str, why: str) -> None:
    """A dclens.Error naming the hooks in force when ``model`` has any: for a
    call that cannot run them (``why``), instead of results of the un-hooked
    model passed off as hooked ones."""
    hooks = hooks_in_force(model)
    if not hooks:
        return
    from dclens._core.checks import Error

    names = []
    for n, fn in hooks:
        label = "%s (%s)" % (n, getattr(fn, "__name__", type(fn).__name__))
        if label not in names:
            names.append(label)
    raise Error(
        "%s: %s has %d hook(s) in force, added with add_hook or `with model.hooks(...)`: %s; %s. "
        "Leave the with block or call model.reset_hooks() to run without them"
        % (what, getattr(model, "name", None) or "the model", len(hooks), ", ".join(names), why)
    )


def get_tokenizer(model, tokenizer=None):
    if tokenizer is not None:
        return tokenizer
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        name = getattr(model, "name", None) or "the model directory"
        raise ValueError(f"{name}: MODEL_DIR has no tokenizer.json (give a tokenizer explicitly)")
    return tok


@dataclass
class Plan:
    """What a run scores, before any model runs: the tokenized lines (file
    order) and the batches of their indices. evaluate() runs the batches
    here; synth_tasks.distributed hands them to workers. Either way a batch
    is the same forward pass, so the results are the same to the bit."""

    toks: list[TokenizedLine]
    batches: list[list[int]]
    tokenizer: object
    t_wall: float  # when the run started (perf_counter)


def plan(lines, tokenizer, batch_tokens: int = 2048, max_batch: int = 64) -> Plan:
    """Tokenize ``lines`` (a Dataset or a list of Line) and batch them."""
    if isinstance(lines, Dataset):
        lines = lines.lines
    t_wall = time.perf_counter()
    toks = tokenize_lines(list(lines), tokenizer)
    return Plan(toks, make_batches([len(t) for t in toks], batch_tokens, max_batch), tokenizer, t_wall)


@dataclass
class BatchScores:
    answers: list[list[AnswerResult]]  # per line of the batch, in batch order
    tokens: int  # real tokens
    padded_tokens: int
    forward_s: float


def score_batch(model, lines: list[TokenizedLine], sparse: bool | None = None) -> BatchScores:
    """One forward pass over a batch of tokenized lines; NLL and greedy
    correctness of each of their answers. sparse: ask for the logits at the
    answer positions only (None: when model.forward takes logits_at=)."""
    if sparse is None:
        sparse = _takes_logits_at(model)
    T = max(max(len(t) for t in lines), 1)
    arr = np.zeros((len(lines), T), dtype=np.int32)
    for b, tl in enumerate(lines):
        arr[b, : len(tl)] = tl.ids
    pos = _answer_positions(lines) if sparse else None
    t0 = time.perf_counter()
    logits = np.asarray(model.forward(arr) if pos is None else model.forward(arr, logits_at=pos))
    fwd_s = time.perf_counter() - t0
    n_rows = T if pos is None else pos.shape[1]
    if logits.ndim != 3 or logits.shape[0] != len(lines) or logits.shape[1] != n_rows:
        raise ValueError(f"model.forward returned shape {logits.shape}, expected ({len(lines)}, {n_rows}, V)")
    V = logits.shape[2]
    _require_finite(logits, [tl.line for tl in lines])
    out: list[list[AnswerResult]] = []
    for b, tl in enumerate(lines):
        if len(tl.ids) and int(tl.ids.max()) >= V:
            raise ValueError(f"token id {int(tl.ids.max())} >= logits width {V}")
        row_of = None if pos is None else {int(q): j for j, q in enumerate(pos[b])}
        rs = []
        for a, span in zip(tl.line.answers, tl.spans):
            rows = None if pos is None else logits[b][[row_of[q] for q in range(span[0] - 1, span[1] - 1)]]
            nll, pred, tgt = _score(logits[b], tl.ids, span, rows)
            rs.append(
                AnswerResult(
                    task_id=tl.line.task_id,
                    line=tl.line.lineno,
                    k=a.k,
                    example=a.example,
                    answer=a.text,
                    nll=nll,
                    n_tokens=len(tgt),
                    correct=bool(np.all(pred == tgt)),
                    target_ids=[int(x) for x in tgt],
                    pred_ids=[int(x) for x in pred],
                )
            )
        out.append(rs)
    return BatchScores(out, sum(len(tl) for tl in lines), int(arr.size), fwd_s)


def finish(
    p: Plan, scored: list[BatchScores], name: str, tasks=None, decode: bool = True, speed_extra: dict | None = None
) -> EvalResult:
    """The EvalResult of a plan from the scores of its batches (in p.batches
    order): answers in file order, predictions decoded, the summary."""
    results: list[list[AnswerResult]] = [[] for _ in p.toks]
    for batch, sc in zip(p.batches, scored):
        for i, rs in zip(batch, sc.answers):
            results[i] = rs
    rows = [r for rs in results for r in rs]  # file order
    if decode:
        for r in rows:
            try:
                r.pred_text = p.tokenizer.decode(r.pred_ids)
            except Exception:  # ids outside the tokenizer
                r.pred_text = ""
    fwd_s = sum(sc.forward_s for sc in scored)
    n_tok = sum(sc.tokens for sc in scored)
    speed = {
        "lines": len(p.toks),
        "batches": len(p.batches),
        "tokens": n_tok,
        "padded_tokens": sum(sc.padded_tokens for sc in scored),
        "forward_s": fwd_s,
        "wall_s": time.perf_counter() - p.t_wall,
        "tokens_per_s": n_tok / fwd_s if fwd_s > 0 else float("nan"),
    }
    speed.update(speed_extra or {})
    return EvalResult(model_name=name, answers=rows, summary=aggregate(rows, tasks), speed=speed, n_lines=len(p.toks))


def evaluate(
    model,
    lines,
    tokenizer=None,
    batch_tokens: int = 2048,
    max_batch: int = 64,
    progress: bool | None = None,
    tasks=None,
    decode: bool = True,
) -> EvalResult:
    """Evaluate ``model`` (``model.forward(int32 [B, T]) -> float32 [B, T, V]``)
    on ``lines`` (a Dataset or a list of Line).

    Every pass is ``model.forward`` (with logits_at= on a dclens model), so
    the hooks in force (``with model.hooks(...)``, ``model.add_hook``) run on
    every line: the result is that of the hooked model.

    progress: see dclens.progress; in a log, a few plain lines whose count is
    of lines ("25% (6/24 line)")."""
    p = plan(lines, get_tokenizer(model, tokenizer), batch_tokens, max_batch)
    toks = p.toks
    vocab = getattr(getattr(model, "config", None), "vocab", None)
    if toks and vocab is not None:
        mx = max((int(t.ids.max()) for t in toks if len(t.ids)), default=-1)
        if mx >= int(vocab):
            raise ValueError(f"token id {mx} is outside the model's vocabulary ({vocab}); wrong tokenizer?")
    name = getattr(model, "name", None) or "model"

    # dclens.progress: a bar where someone watches, a few plain lines in a log
    bar = _progress.bar(total=len(toks), unit="line", desc=f"synth {name}", progress=progress, leave=True)
    sparse = _takes_logits_at(model)  # logits only at the answer positions
    scored: list[BatchScores] = []
    n_tok, fwd_s = 0, 0.0
    try:
        for batch in p.batches:
            scored.append(score_batch(model, [toks[i] for i in batch], sparse))
            if bar is not None:
                n_tok, fwd_s = n_tok + scored[-1].tokens, fwd_s + scored[-1].forward_s
                bar.set_postfix(tok_s=f"{n_tok / max(fwd_s, 1e-9):.0f}")
                # the bar counts lines, one at a time: a batch of many short lines can pass
                # several quarters of the plain log at once, and each quarter's line must show
                # the count at that quarter, not the count after the batch ("25% (12/24)"
                # then "50% (12/24)")
                for _ in batch:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return finish(p, scored, name, tasks, decode)
