"""synth_tasks.probe: the query, answer and source positions of a scored answer, and the
corrupted prompt used for activation patching."""

import dataclasses

import numpy as np
import pytest
from tokenizers import Tokenizer

from synth_tasks import Line, load_dataset
from synth_tasks.corpus import HELDOUT_FILE, TOKENIZER_FILE
from synth_tasks.generate import analyse
from synth_tasks.probe import probe, probes


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(TOKENIZER_FILE)


@pytest.fixture(scope="module")
def heldout():
    return load_dataset(HELDOUT_FILE)


def test_every_heldout_answer_has_a_source(tok, heldout):
    ps = list(probes(heldout.lines, tok))
    assert len(ps) == heldout.n_answers  # every generated example solves
    for p in ps:
        text = tok.decode(p.ids[p.answer_span[0] : p.answer_span[1]].tolist())
        assert text.strip() == p.answer
        assert p.query == p.answer_span[0] - 1
        assert p.source < p.query
        assert p.source_text.endswith(tok.decode([int(p.ids[p.source])]).strip())
        # the source lies in the answer's own example (after the last newline before the answer)
        start = p.text.rfind("\n") + 1
        assert len(tok.decode(p.ids[: p.source + 1].tolist())) > start


def test_known_example(tok):
    text = (
        "\n< Ruth has a sweater. Steven has a taxi. Ruth has a handgun. >. Ruth does not have a kind of [ vehicle ]\n"
    )
    from synth_tasks import parse_texts

    body, answers = parse_texts(text)
    p = probe(Line("task0", body, answers), 0, tok)
    assert p.answer == "vehicle" and p.source_text == "taxi"
    assert tok.decode([int(p.ids[p.source])]) == " taxi"
    assert p.corrupted_answer == "clothing"  # taxi <-> sweater
    corrupted = tok.decode(p.corrupted[: p.answer_span[0]].tolist())
    assert "Ruth has a taxi. Steven has a sweater." in corrupted


def test_corrupted_prompts_line_up_and_change_the_answer(tok, heldout):
    n = 0
    for p in probes(heldout.lines[:200], tok):
        if p.corrupted is None:
            continue
        n += 1
        a0 = p.answer_span[0]
        assert p.corrupted.shape == p.ids.shape
        assert np.array_equal(p.corrupted[a0:], p.ids[a0:])
        diff = np.flatnonzero(p.corrupted[:a0] != p.ids[:a0])
        start = p.text.rfind("\n") + 1
        first = next(i for i in range(a0) if len(tok.decode(p.ids[: i + 1].tolist())) > start)
        assert 2 <= len(diff) <= 6 and diff.min() >= first  # only inside the answer's example
        assert p.corrupted_token != p.answer_token
        ex = tok.decode(p.corrupted[:a0].tolist()).split("\n")[-1] + " " + p.corrupted_answer
        res = analyse(p.task_id, ex)
        assert res.ok and p.corrupted_answer in res.expected
    assert n > 100


def test_unsolvable_or_unknown_lines_give_none(tok, heldout):
    line = heldout.lines[0]
    assert probe(dataclasses.replace(line, task_id="task99"), 0, tok) is None
    assert probe(line, len(line.answers), tok) is None
    assert probe(line, -1, tok) is None
    broken = dataclasses.replace(line, text=line.text.replace("has", "hates"))
    assert probe(broken, 0, tok) is None
