"""One scored answer of a benchmark line, laid out for a case study.

    p = probe(line, j, tokenizer)       # the j-th scored answer of a line (None if it does not analyse)
    p.ids                               # int32 [T]: the line up to and including the answer
    p.query                             # the position whose logits predict the answer's first token
    p.answer_span                       # (a0, a1): the answer's tokens are ids[a0:a1]
    p.source                            # position of the source item's last token (in the same example)
    p.corrupted                         # int32 [T]: the prompt with the source item swapped for another
    p.corrupted_token                   # ... whose answer starts with this token (None: no such swap)
    for p in probes(lines, tokenizer): ...

The *source* is the context token the answer is derived from: the item the
task's QK pattern picks (``Ruth has a sweater. Steven has a taxi. Ruth has a
handgun. Ruth does not have a kind of [vehicle]`` -> ``taxi``), or, when the
answer is a person, that item's owner. It is found by solving the example with
the task's template and the word tables (synth_tasks.generate.analyse).

The corrupted prompt swaps the source item with another context item of the
same example when both take the same number of tokens, so that every position
lines up and the answer changes (``Ruth has a taxi. Steven has a sweater. ...``
-> ``clothing``): the clean / corrupted pair of activation patching.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .dataset import Line
from .generate import analyse
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


def probe(line: Line, j: int, tokenizer) -> Probe | None:
    """The j-th scored answer of a line, or None when its example cannot be solved from the tables."""
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
    return p


def _corrupt(p: Probe, line: Line, example: str, ex_start: int, m, src: int, tokenizer) -> None:
    """Swap the source item with another item of the example; keep the first swap that takes as many
    tokens (positions line up), still solves, and whose answer starts with another token."""
    a0, end = p.answer_span[0], len(p.text)
    for other in range(3):
        xs, xo = "x%d" % (src + 1), "x%d" % (other + 1)
        if (
            other == src
            or m.group(xs) == m.group(xo)
            or len(_encode(tokenizer, " " + m.group(xs))[0]) != len(_encode(tokenizer, " " + m.group(xo))[0])
        ):
            continue  # the same item, or the positions between them would shift
        (s1, e1), (s2, e2) = sorted([m.span(xs), m.span(xo)])
        swapped = example[:s1] + example[s2:e2] + example[e1:s2] + example[s1:e1] + example[e2:]
        res = analyse(line.task_id, swapped)  # same length: the answer's offsets do not move
        if res.source is None or not res.expected:
            continue
        new_answer = sorted(res.expected)[0]
        text = (line.text[:ex_start] + swapped + line.text[ex_start + len(example) :])[:end]
        ids, _, spans = _ids_and_offsets(Line(line.task_id, text, line.answers[: p.answer_index + 1]), tokenizer)
        tok = _encode(tokenizer, " " + new_answer)[0]
        if spans[p.answer_index][0] != a0 or not tok or tok[0] == p.answer_token:
            continue
        corrupted = p.ids.copy()
        corrupted[:a0] = ids[:a0]
        p.corrupted, p.corrupted_answer, p.corrupted_token = corrupted, new_answer, int(tok[0])
        return


def probes(lines, tokenizer, tasks=None):
    """Every scored answer of `lines` (optionally only of `tasks`) that solves from the tables."""
    for line in lines:
        if tasks is not None and line.task_id not in tasks:
            continue
        for j in range(len(line.answers)):
            p = probe(line, j, tokenizer)
            if p is not None:
                yield p
