"""Segment-wise tokenisation of a benchmark line (the documented protocol).

The text is cut at every answer: the text before the answer without its
trailing space, then the answer with its leading space (`` vehicle``), then the
rest up to the next answer, and so on.  Each segment is encoded on its own, with
no special tokens, and the ids are concatenated; the answer's tokens are then
exactly the tokens of `` <answer>``.  (An answer not preceded by a space is
encoded without one.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dataset import DatasetError, Line


@dataclass
class TokenizedLine:
    line: Line
    ids: np.ndarray  # int32 [T]
    spans: list[tuple[int, int]]  # per answer: token positions [start, end)

    def __len__(self):
        return len(self.ids)


def segments(line: Line) -> list[tuple[str, int]]:
    """[(segment text, answer index or -1)] covering the whole text in order."""
    out: list[tuple[str, int]] = []
    text, pos = line.text, 0
    for j, a in enumerate(line.answers):
        start = a.start - 1 if a.start > 0 and text[a.start - 1] == " " else a.start
        if start < pos:
            raise DatasetError(f"{line.where}: overlapping answers")
        if start > pos:
            out.append((text[pos:start], -1))
        out.append((text[start : a.end], j))
        pos = a.end
    if pos < len(text):
        out.append((text[pos:], -1))
    return out


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    if hasattr(tokenizer, "encode_batch"):
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]


def tokenize_line(line: Line, tokenizer) -> TokenizedLine:
    return tokenize_lines([line], tokenizer)[0]


def tokenize_lines(lines: list[Line], tokenizer) -> list[TokenizedLine]:
    """Tokenise lines segment by segment (one encode_batch call for all)."""
    segs = [segments(l) for l in lines]
    flat = [s for ss in segs for s, _ in ss]
    enc = _encode_batch(tokenizer, flat) if flat else []
    out, n = [], 0
    for line, ss in zip(lines, segs):
        ids: list[int] = []
        spans: list[tuple[int, int] | None] = [None] * len(line.answers)
        for (_, j), e in zip(ss, enc[n : n + len(ss)]):
            if j >= 0:
                if not e:
                    raise DatasetError(f"{line.where}: answer {line.answers[j].text!r} has no tokens")
                if not ids:
                    raise DatasetError(
                        f"{line.where}: answer {line.answers[j].text!r} at the very start of the text cannot be scored"
                    )
                spans[j] = (len(ids), len(ids) + len(e))
            ids.extend(e)
        n += len(ss)
        out.append(TokenizedLine(line, np.asarray(ids, dtype=np.int32), spans))
    return out
