"""One scored answer of a benchmark line, laid out for a case study.

    p = probe(line, j, tokenizer)       # the j-th scored answer of a line (None if it does not analyse)
    p.ids                               # int32 [T]: the line up to and including the answer
    p.query                             # the position whose logits predict the answer's first token
    p.answer_span                       # (a0, a1): the answer's tokens are ids[a0:a1]
    p.source                            # position of the source item's last token (in the same example)
    p.corrupted                         # int32 [T]: the prompt with one minimal edit at the source
    p.corrupted_answer, p.corrupted_token   # ... its answer, and that answer's first token
    p.corruption                        # the edit: "swap items" | "swap people" | "replace item" | "replace person"
    p.corrupted_reason                  # None, or why this answer has no corrupted prompt (then corrupted is None)
    for p in probes(lines, tokenizer): ...

    p = probe(line, j, tokenizer, model=m, flips=True)   # None unless m's answer flips with the source
    p.flips, p.p_clean, p.p_corrupted   # m's greedy answer: right on the clean prompt, not on the corrupted
    list(probes(lines, tokenizer, model=m, flips=True))  # every such answer

The *source* is the context token the answer is derived from: the item the
task's QK pattern picks (``Ruth has a sweater. Steven has a taxi. Ruth has a
handgun. Ruth does not have a kind of [vehicle]`` -> ``taxi``), or, when the
answer is a person, that item's owner. It is found by solving the example with
the task's template and the word tables (synth_tasks.generate.analyse).

The corrupted prompt is the clean one with one minimal edit in the answer's
example that keeps the number of tokens (every position lines up) and changes
the correct answer (to one starting with another token): the clean / corrupted
pair of activation patching. The first of these that works is used:

  swap items      the source item and another item of the example trade places
                  (``Ruth has a taxi. Steven has a sweater. ...`` -> ``clothing``)
  swap people     the source's person and another person trade places
  replace item    the source item becomes an item of the word tables that is not
                  in the example (the list tasks 56-73, ``There are a sweater, a
                  sweater, a taxi. Which is not sweater? The [taxi]``, where the
                  order of a list does not change the answer, always need this:
                  ``... a sweater, a lion. ...`` -> ``lion``)
  replace person  the source's person becomes another name of the tables

An edit that brings in a new word must also pass the generator's strict rules
(synth_tasks.generate.analyse(strict=True)) with the new answer, so the
corrupted example is one the benchmark could hold. Table words are tried from a
point that depends on the example, so a data set's corruptions do not all use
one word. When no edit works (every word of the same length would leave the
answer's first token as it is) ``corrupted`` is None and ``corrupted_reason``
says why; it is None whenever there is a corrupted prompt.

With a model, a probe also says whether the model's answer *flips* with the
source: its greedy first token at the query is the answer on the clean prompt
and is not on the corrupted one. A model that keeps the clean answer after the
source is swapped is right for a reason other than the source, and patching
such a pair measures nothing (dclens.patching then warns about its baselines).
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from dataclasses import dataclass
from typing import cast

import numpy as np

from . import tables as T
from .dataset import Line
from .generate import _POOLS, _render_slot, analyse, ident, lookup_item
from .tasks import TASKS, slots
from .tokenize import segments

# the item word inside a context slot: "a taxi" -> "taxi", "The sweater is" -> "sweater", "in 2010" -> "2010"
_ITEM = re.compile(r"^(?:(?:an?|The|in|at|on|In|At|On) )?(?P<item>.*?)(?: (?:is|are))?$")


@dataclass
class Probe:
    task_id: str
    lineno: int
    answer_index: int  # which scored answer of the line (0..5)
    k: int  # solved examples before it
    text: str  # the line's text up to the end of the answer
    answer: str
    ids: np.ndarray  # int32 [T]
    answer_span: tuple  # (a0, a1)
    source: int  # token position of the source (last token of the item / person)
    source_text: str
    corrupted: np.ndarray | None = None  # int32 [T]
    corrupted_answer: str | None = None
    corrupted_token: int | None = None  # first token of the corrupted answer
    # how the corrupted prompt was made: "swap items", "swap people", "replace item", "replace person"
    corruption: str | None = None
    corrupted_reason: str | None = None  # why there is no corrupted prompt (None when there is one)
    # with a model (probe(..., model=m)): its answer on both prompts, at the query
    p_clean: float | None = None  # p(answer's first token), clean prompt
    p_corrupted: float | None = None  # p(the same token), corrupted prompt
    p_corrupted_answer: float | None = None  # p(corrupted answer's first token), corrupted prompt
    top_clean: int | None = None  # the model's greedy token, clean prompt
    top_corrupted: int | None = None  # ... corrupted prompt
    flips: bool | None = None  # top_clean is the answer and top_corrupted is not

    @property
    def query(self) -> int:
        return self.answer_span[0] - 1

    @property
    def answer_token(self) -> int:
        return int(self.ids[self.answer_span[0]])


def _encode(tokenizer, text: str):
    e = tokenizer.encode(text, add_special_tokens=False)
    return list(e.ids), list(e.offsets)


def _ids_and_offsets(line: Line, tokenizer):
    """Segment-wise tokens of a line (as the evaluator reads it) and each token's end offset in the text."""
    ids, ends, spans, pos = [], [], {}, 0
    for seg, j in segments(line):
        s_ids, s_off = _encode(tokenizer, seg)
        if j >= 0:
            spans[j] = (len(ids), len(ids) + len(s_ids))
        ids += s_ids
        ends += [pos + e for _, e in s_off]
        pos += len(seg)
    return np.asarray(ids, np.int32), ends, spans


def _token_ending_at(ends, char_end: int) -> int:
    """The first token whose span reaches char_end (the token holding the item's last character)."""
    for i, e in enumerate(ends):
        if e >= char_end:
            return i
    raise ValueError("offset beyond the text")


def probe(line: Line, j: int, tokenizer, *, model=None, flips: bool = False) -> Probe | None:
    """The j-th scored answer of a line, or None when its example cannot be solved from the tables.
    model (a dclens.Model): also score the clean and corrupted prompts (p_clean, flips, ...);
    flips=True (needs a model): None unless the model's answer flips when the source is corrupted."""
    if flips and model is None:
        raise ValueError("probe(flips=True) needs a model= to tell whether its answer flips")
    task = TASKS.get(line.task_id)
    if task is None or not 0 <= j < len(line.answers):
        return None
    ans = line.answers[j]
    ex_start = line.text.rfind("\n", 0, ans.start) + 1
    ex_end = line.text.find("\n", ans.end)
    ex_end = len(line.text) if ex_end < 0 else ex_end
    example = line.text[ex_start:ex_end]
    res = analyse(line.task_id, example)
    m = task.match(example)
    if not res.ok or res.source is None or m is None:
        return None
    person_answer = [k for n, k, a in slots(task.template) if n == "A"][0] == "person"
    slot = ("p%d" if person_answer else "x%d") % (res.source + 1)
    item = _ITEM.match(m.group(slot))
    src_end = ex_start + m.start(slot) + item.end("item")

    prefix = Line(line.task_id, line.text[: ans.end], line.answers[: j + 1], line.lineno, line.source)
    ids, ends, spans = _ids_and_offsets(prefix, tokenizer)
    p = Probe(
        line.task_id,
        line.lineno,
        j,
        ans.k,
        prefix.text,
        ans.text,
        ids,
        spans[j],
        _token_ending_at(ends, src_end),
        item.group("item"),
    )
    _corrupt(p, line, example, ex_start, m, res.source, tokenizer)
    if model is not None and p.corrupted is not None:
        _score(p, model)
    if flips and not p.flips:
        return None
    return p


def _softmax(z):
    z = np.asarray(z, np.float64)
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _score(p: Probe, model) -> None:
    """The model's answer at the query on the clean and the corrupted prompt (one batched pass)."""
    both = np.stack([p.ids, p.corrupted])[:, : p.query + 1]
    probs = _softmax(model.forward(both, logits_at=p.query))  # [2, V]
    p.p_clean, p.p_corrupted = float(probs[0, p.answer_token]), float(probs[1, p.answer_token])
    p.p_corrupted_answer = float(probs[1, p.corrupted_token])
    p.top_clean, p.top_corrupted = int(probs[0].argmax()), int(probs[1].argmax())
    p.flips = p.top_clean == p.answer_token and p.top_corrupted != p.answer_token


def _edit(text: str, edits) -> str:
    """text with each (start, end, replacement) applied (spans do not overlap)."""
    for a, b, r in sorted(edits, reverse=True):
        text = text[:a] + r + text[b:]
    return text


def n_tok(tokenizer, word: str) -> int:
    """Tokens of a word after a space (as every slot of a template is)."""
    return len(_encode(tokenizer, " " + word)[0])


def _group(m, name: str) -> str | None:
    return m.groupdict().get(name)


def _candidates(task, example: str, m, src: int, tokenizer):
    """(kind, edits of the example) in the order they are tried: the source item swapped with
    another item of the example; the source's person swapped with another person of the example;
    the source item replaced by an item of the word tables that takes as many tokens; the
    source's person replaced by a person of the tables that takes as many tokens. Table
    candidates are tried from a point of the table that depends on the example (crc32), so
    that the corruptions of a data set do not all use one word."""
    width = lambda s: n_tok(tokenizer, s)  # noqa: E731
    start = zlib.crc32(example.encode("utf-8"))
    kinds = {n: k for n, k, _ in slots(task.template)}
    for who, name in (("items", "x"), ("people", "p")):
        s_slot = "%s%d" % (name, src + 1)
        if _group(m, s_slot) is None:
            continue
        for other in range(3):
            o_slot = "%s%d" % (name, other + 1)
            if other == src or m.group(s_slot) == m.group(o_slot) or width(m.group(s_slot)) != width(m.group(o_slot)):
                continue  # the same word, or the positions between them would shift
            yield "swap " + who, [(*m.span(s_slot), m.group(o_slot)), (*m.span(o_slot), m.group(s_slot))]
    xs = "x%d" % (src + 1)
    x_kind, old = kinds[xs], m.group(xs)
    have = {ident(x) for x in (lookup_item(task.vocab, m.group("x%d" % (i + 1))) for i in range(3)) if x is not None}
    source = lookup_item(task.vocab, old)
    pool = list(cast(list, _POOLS[task.vocab]))
    if task.vocab == "ordinal":  # one scale per example
        pool = [x for x in pool if x.kind == getattr(source, "kind", None)]
    for i in range(len(pool)):
        x = pool[(start + i) % len(pool)]
        new = _render_slot(x_kind, x)
        if ident(x) not in have and _group(m, "q") != ident(x) and width(new) == width(old):
            yield "replace item", [(*m.span(xs), new)]
    ps = "p%d" % (src + 1)
    if _group(m, ps) is not None:
        people = set(m.group("p%d" % (i + 1)) for i in range(3)) | {_group(m, "q"), _group(m, "A")}
        for i in range(len(T.PEOPLE)):
            name = T.PEOPLE[(start + i) % len(T.PEOPLE)]
            if name not in people and width(name) == width(m.group(ps)):
                yield "replace person", [(*m.span(ps), name)]


def _corrupt(p: Probe, line: Line, example: str, ex_start: int, m, src: int, tokenizer) -> None:
    """The first candidate edit (_candidates) of the answer's example that keeps the number of
    tokens before the answer (every position lines up), still solves, and whose answer starts
    with another token; swaps are checked as the benchmark's analysis reads them, edits that
    bring in a word of the tables by the generator's strict rules too. None found: the reason
    in p.corrupted_reason."""
    task = TASKS[line.task_id]
    ans = line.answers[p.answer_index]
    a0, a_start = p.answer_span[0], ans.start - ex_start  # the answer's offset in the example
    tried: dict[str, int] = {}
    for kind, edits in _candidates(task, example, m, src, tokenizer):
        tried[kind] = tried.get(kind, 0) + 1
        edited = _edit(example, edits)
        res = analyse(line.task_id, edited)
        if res.source is None or not res.expected:
            continue
        new_answer = sorted(res.expected)[0]
        tok = _encode(tokenizer, " " + new_answer)[0]
        if not tok or tok[0] == p.answer_token:
            continue
        shift = len(edited) - len(example)
        if not kind.startswith("swap"):  # a new word: a well-formed example of the task with the new answer
            solved = edited[: a_start + shift] + new_answer + edited[a_start + shift + len(ans.text) :]
            if not analyse(line.task_id, solved, strict=True).ok:
                continue
        text = line.text[:ex_start] + edited + line.text[ex_start + len(example) : ans.end]
        moved = dataclasses.replace(ans, start=ans.start + shift, end=ans.end + shift)
        ids, _, spans = _ids_and_offsets(Line(line.task_id, text, line.answers[: p.answer_index] + [moved]), tokenizer)
        if spans[p.answer_index][0] != a0:
            continue
        corrupted = p.ids.copy()
        corrupted[:a0] = ids[:a0]
        p.corrupted, p.corrupted_answer, p.corrupted_token = corrupted, new_answer, int(tok[0])
        p.corruption = kind
        return
    slot = m.group("x%d" % (src + 1))
    written = "" if slot == p.source_text else "%r: " % slot
    p.corrupted_reason = (
        "no other word of the example or of the %s table takes as many tokens as the source %r (%s%d tokens), "
        "so no edit keeps the positions" % (task.vocab, p.source_text, written, n_tok(tokenizer, slot))
        if not tried
        else "no edit of the source %r keeps the %d tokens before the answer, still solves and changes "
        "the answer's first token %r (tried: %s)"
        % (p.source_text, a0, _decode1(tokenizer, p.answer_token), ", ".join("%s x%d" % kv for kv in tried.items()))
    )


def _decode1(tokenizer, tok: int) -> str:
    try:
        return tokenizer.decode([tok])
    except Exception:  # noqa: BLE001 -- only for a message
        return str(tok)


def probes(lines, tokenizer, tasks=None, *, model=None, flips: bool = False):
    """Every scored answer of `lines` (optionally only of `tasks`) that solves from the tables
    (model=, flips=True: only those whose answer the model gets right and loses when the
    source is corrupted)."""
    for line in lines:
        if tasks is not None and line.task_id not in tasks:
            continue
        for j in range(len(line.answers)):
            p = probe(line, j, tokenizer, model=model, flips=flips)
            if p is not None:
                yield p
