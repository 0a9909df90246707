"""synth_tasks.corpus: training stream and held-out set, disjoint from the published file."""

import importlib
import itertools
import types
from pathlib import Path

import numpy as np
import pytest

from synth_tasks import corpus as C
from synth_tasks.dataset import lines_from_records, load_dataset, parse_texts
from synth_tasks.tasks import TASKS
from synth_tasks.tokenize import tokenize_lines

from conftest import shared_path

G = importlib.import_module("synth_tasks.generate")


@pytest.fixture(scope="module")
def sets():
    pub = C.published_examples(shared_path("data", "synthetic_dataset.jsonl"))
    held = C.heldout_records(published=pub)
    return pub, held, C.training_exclude(pub, held)


@pytest.fixture(scope="module")
def train(sets):
    return list(C.training_records(seed=0, exclude=sets[2], stop=4 * len(TASKS)))


def test_shipped_heldout_file_is_reproduced_by_its_command(sets, tmp_path):
    out = tmp_path / "h.jsonl"
    assert C.main(["heldout", str(out), "--published", shared_path("data", "synthetic_dataset.jsonl")]) == 0
    assert out.read_bytes() == Path(C.HELDOUT_FILE).read_bytes()
    ds = load_dataset(C.HELDOUT_FILE)
    assert len(ds) == 74 * C.HELDOUT_LINES_PER_TASK and ds.n_answers == 6 * len(ds)


def test_three_sets_disjoint_at_the_example_level(sets, train):
    pub, held, excl = sets
    assert len(pub) > 5000 and len(G.examples_of(held)) > 5000
    assert C.overlap(held, pub) == []
    assert C.overlap(train, pub) == [] and C.overlap(train, G.examples_of(held)) == []
    assert excl == frozenset(pub | G.examples_of(held))
    # the check itself can fail: a set overlaps with itself, and a stream without
    # the exclusion list does produce excluded examples for small vocabularies
    assert C.overlap(held, G.examples_of(held[:3])) != []
    free = list(C.training_records(seed=0, exclude=(), stop=20 * 74))
    assert C.overlap(free, pub) != []


def test_stream_is_deterministic_resumable_and_streaming(sets, train):
    excl = sets[2]
    assert train == list(C.training_records(seed=0, exclude=excl, stop=len(train)))
    assert train[100:130] == list(C.training_records(seed=0, exclude=excl, start=100, stop=130))
    other = list(C.training_records(seed=1, exclude=excl, stop=74))
    assert other != train[:74]
    # each chunk of 74 lines has every task once, in a shuffled order
    for c in range(4):
        chunk = [r["task_id"] for r in train[74 * c : 74 * (c + 1)]]
        assert sorted(chunk) == sorted(TASKS) and chunk != list(TASKS)
    endless = C.training_records(seed=0, exclude=excl)
    assert isinstance(endless, types.GeneratorType)
    assert list(itertools.islice(endless, 5)) == train[:5]
    with pytest.raises(KeyError):
        next(C.training_records(exclude=(), task_ids=["task99"]))


def test_training_text_and_tokens_are_what_the_evaluator_scores(sets, train):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(C.TOKENIZER_FILE)
    texts = [C.record_text(r) for r in train[:74]]
    assert texts[0].startswith("\n") and "[" not in "".join(texts)
    assert texts == [parse_texts(r["texts"])[0] for r in train[:74]]
    lines = lines_from_records(train[:74])
    ref = tokenize_lines(lines, tok)
    stream = list(itertools.islice(C.token_stream(tok, seed=0, exclude=sets[2]), 74))
    for tl, (ids, mask) in zip(ref, stream):
        assert ids.dtype == np.int32 and np.array_equal(ids, tl.ids)
        want = np.zeros(len(ids), bool)
        for s, e in tl.spans:
            want[s:e] = True
        assert np.array_equal(mask, want) and mask.sum() >= 6


def test_cli_train_and_check(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert C.main(["train", str(out), "--lines", "10", "--start", "74"]) == 0
    ds = load_dataset(out)
    assert len(ds) == 10
    assert C.main(["check", str(out)]) == 0
    assert "0 shared" in capsys.readouterr().out
    pub = shared_path("data", "synthetic_dataset.jsonl")
    assert C.main(["check", pub]) == 1  # the published file against itself
    txt = tmp_path / "t.txt"
    assert C.main(["train", str(txt), "--lines", "3", "--format", "text"]) == 0
    recs = list(C.training_records(stop=3))
    assert txt.read_text() == "".join(C.record_text(r) for r in recs)
    assert C.main(["check", str(tmp_path / "missing.jsonl")]) == 2
