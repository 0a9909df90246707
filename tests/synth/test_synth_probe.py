"""synth_tasks.probe: the query, answer and source positions of a scored answer, and the
corrupted prompt used for activation patching."""

import dataclasses

import numpy as np
import pytest
from tokenizers import Tokenizer

from synth_tasks import TASKS, Line, load_dataset
from synth_tasks.corpus import HELDOUT_FILE, TOKENIZER_FILE
from synth_tasks.dataset import default_data_path
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
        assert diff.min() >= first  # only inside the answer's example
        if p.corruption.startswith("swap"):
            assert 2 <= len(diff) <= 6
        else:  # one word replaced
            assert 1 <= len(diff) <= 3
        assert p.corrupted_reason is None
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


def test_flips_with_a_model(tok, heldout):
    """flips=True keeps the answers the model gets right (greedy) on the clean prompt and loses
    on the corrupted one; the probabilities are recomputed here from full forwards."""
    import dclens

    m = dclens.load("dcpythia-tiny")
    lines = heldout.lines[:3]
    every = [p for p in probes(lines, tok, model=m) if p.corrupted is not None]
    kept = list(probes(lines, tok, model=m, flips=True))
    assert 0 < len(kept) < len(every)  # some answers flip, some do not
    assert {(p.lineno, p.answer_index) for p in kept} == {(p.lineno, p.answer_index) for p in every if p.flips}
    for p in every[:6]:
        z = np.asarray(m.forward(np.stack([p.ids, p.corrupted]))[:, p.query], np.float64)
        pr = np.exp(z - z.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        assert p.p_clean == pytest.approx(pr[0, p.answer_token], rel=1e-4, abs=1e-7)
        assert p.p_corrupted == pytest.approx(pr[1, p.answer_token], rel=1e-4, abs=1e-7)
        assert p.p_corrupted_answer == pytest.approx(pr[1, p.corrupted_token], rel=1e-4, abs=1e-7)
        flips = pr[0].argmax() == p.answer_token and pr[1].argmax() != p.answer_token
        assert p.flips == flips
    assert probe(lines[0], 0, tok).flips is None  # no model: not scored
    with pytest.raises(ValueError, match="needs a model"):
        probe(lines[0], 0, tok, flips=True)


@pytest.fixture(scope="module")
def published():
    path = default_data_path()
    if path is None:
        pytest.skip("no ../shared/data/synthetic_dataset.jsonl")
    return load_dataset(path)


def test_the_issue_example_task56_has_a_corruption(tok, published):
    """issue 37: probe(line, 0, tok).corrupted was None for task56 ("the-other-obj", a list):
    the order of a list does not change its answer, so the source item is replaced by a
    table item of the same token length instead."""
    line = next(l for l in published.lines if l.task_id == "task56")
    p = probe(line, 0, tok)
    assert p.corrupted is not None and p.corrupted_reason is None
    assert p.corruption == "replace item" and p.corrupted.shape == p.ids.shape
    a0 = p.answer_span[0]
    clean = tok.decode(p.ids[:a0].tolist()).split("\n")[-1]
    corrupted = tok.decode(p.corrupted[:a0].tolist()).split("\n")[-1]
    assert clean.startswith("There are") and corrupted.startswith("There are")
    assert p.source_text in clean and p.source_text not in corrupted
    assert p.corrupted_answer in corrupted  # the new item, which is the new answer (copy)
    assert analyse("task56", corrupted + " " + p.corrupted_answer, strict=True).ok


def test_every_task_has_corruptions_of_equal_length_or_a_reason(tok, published):
    """Every scored answer of the 74 tasks of the published file: a corrupted prompt as long in
    tokens as the clean one (under the bundled tokenizer), equal from the answer on, differing
    before it, with an answer that starts with another token; or, where none exists, a reason."""
    assert {l.task_id for l in published.lines} == set(TASKS)
    seen: dict = {t: [0, 0] for t in TASKS}  # task -> [answers, corrupted]
    first_line = {}
    for line in published.lines:
        first_line.setdefault(line.task_id, line)
        for j in range(len(line.answers)):
            p = probe(line, j, tok)
            assert p is not None  # every published answer solves
            seen[line.task_id][0] += 1
            if p.corrupted is None:
                assert p.corruption is None and p.corrupted_token is None
                assert isinstance(p.corrupted_reason, str) and repr(p.source_text) in p.corrupted_reason
                continue
            seen[line.task_id][1] += 1
            a0 = p.answer_span[0]
            assert p.corrupted_reason is None and p.corruption in CORRUPTIONS
            assert p.corrupted.shape == p.ids.shape and p.corrupted.dtype == np.int32
            assert np.array_equal(p.corrupted[a0:], p.ids[a0:]) and not np.array_equal(p.corrupted, p.ids)
            assert p.corrupted_token != p.answer_token
    for t, (n, c) in seen.items():
        assert n == 72 and c >= 0.95 * n, (t, n, c)  # every family; the misses have a reason
    # the corrupted examples of each task's first line read back as benchmark examples of that
    # task whose answer is the corrupted answer
    for t, line in first_line.items():
        for j in range(len(line.answers)):
            p = probe(line, j, tok)
            ex = tok.decode(p.corrupted[: p.answer_span[0]].tolist()).split("\n")[-1]
            res = analyse(t, ex + " " + p.corrupted_answer)
            assert res.ok and p.corrupted_answer in res.expected, (t, ex, res.problems)
            if TASKS[t].context.startswith("list"):
                assert p.corruption == "replace item"


def test_a_missing_corruption_says_why(tok, published):
    """Rio de Janeiro takes more tokens than any other city of the tables: nothing can replace it."""
    misses = [
        probe(line, j, tok)
        for line in published.lines
        if line.task_id == "task60" and "Rio de Janeiro" in line.text
        for j in range(len(line.answers))
    ]
    misses = [p for p in misses if p.source_text == "Rio de Janeiro"]
    assert misses and all(p.corrupted is None for p in misses)
    assert "no other word of the example or of the city table takes as many tokens" in misses[0].corrupted_reason


CORRUPTIONS = {"swap items", "swap people", "replace item", "replace person"}
