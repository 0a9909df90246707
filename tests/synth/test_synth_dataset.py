"""synth_tasks: the loader, the task table and the tokenisation, on the published
file and on malformed inputs."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from synth_tasks import TASKS, DatasetError, load_dataset, parse_texts
from synth_tasks.generate import analyse
from synth_tasks.tasks import PATTERNS, TRANSFORMS, compile_template
from synth_tasks.tokenize import tokenize_lines

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
PUBLISHED = SHARED / "synthetic_dataset.jsonl"
TOKENIZER = SHARED / "gpt-neox-20b-tokenizer.json"

needs_published = pytest.mark.skipif(not PUBLISHED.is_file(), reason="no ../shared data")


@pytest.fixture(scope="module")
def published():
    return load_dataset(PUBLISHED)


@pytest.fixture(scope="module")
def raw_records():
    with open(PUBLISHED, encoding="utf-8") as f:
        return [json.loads(l) for l in f]


# ---------------------------------------------------------------------------
# the published file
# ---------------------------------------------------------------------------


@needs_published
def test_published_counts(published):
    assert len(published) == 888
    assert published.skipped == 0
    assert published.n_answers == 5328
    per_task = Counter(l.task_id for l in published)
    assert len(per_task) == 74 and set(per_task.values()) == {12}
    ks = Counter(a.k for l in published for a in l.answers)
    assert ks == {k: 888 for k in range(2, 8)}
    for l in published:
        assert [a.example for a in l.answers] == [3, 4, 5, 6, 7, 8]
        assert "[" not in l.text and "]" not in l.text
        for a in l.answers:
            assert l.text[a.start : a.end] == a.text
            assert l.text[a.start - 1] == " "
            assert l.text[a.end] == "\n"


@needs_published
def test_brackets_removed_exactly(published, raw_records):
    for i, (l, r) in enumerate(zip(published, raw_records)):
        assert l.lineno == i + 1 and l.task_id == r["task_id"]
        assert l.text == re.sub(r"\[ (.*?) \]", r"\1", r["texts"])
        assert [a.text for a in l.answers] == re.findall(r"\[ (.*?) \]", r["texts"])


@needs_published
def test_limit_and_line_numbers():
    ds = load_dataset(PUBLISHED, limit=5)
    assert len(ds) == 5 and [l.lineno for l in ds] == [1, 2, 3, 4, 5]
    assert ds[0].where.endswith("synthetic_dataset.jsonl:1")


# ---------------------------------------------------------------------------
# the task table
# ---------------------------------------------------------------------------


def test_table_shape():
    assert list(TASKS) == [f"task{i}" for i in range(74)]
    # the labels the benchmark doc names are all used
    for p in ("same-person", "the-other-person", "same-obj", "different-adj", "different-ordinal", "the-other-class"):
        assert p in PATTERNS
    for t in ("copy", "obj->superclass", "obj->capability", "city->country", "adj->opposite", "ordinal->prev"):
        assert t in TRANSFORMS
    for t in TASKS.values():
        assert t.pattern.split("-")[0] in ("same", "the", "different")
        compile_template(t.template)
        assert t.negated == t.pattern.startswith("the-other-")
    # every (pattern, transform) combination belongs to at most 4 tasks
    # (pairs of surface forms, and obj/tool vocabularies)
    combos = Counter((t.pattern, t.transform) for t in TASKS.values())
    assert max(combos.values()) <= 4


@needs_published
def test_every_published_task_is_in_the_table_and_matches_its_template(raw_records):
    seen = set()
    for r in raw_records:
        assert r["task_id"] in TASKS
        seen.add(r["task_id"])
        t = TASKS[r["task_id"]]
        examples = r["texts"][1:-1].split("\n")
        assert len(examples) == 8
        for j, e in enumerate(examples):
            m = t.match(e)
            assert m is not None, (t.task_id, e)
            assert bool(m.group("A_open")) == (j >= 2), (t.task_id, e)
    assert seen == set(TASKS)


@needs_published
def test_line_matches(published):
    from synth_tasks.tasks import line_matches

    assert all(line_matches(l.task_id, l.text) for l in published)
    assert not any(line_matches("task1", l.text) for l in published if l.task_id != "task1")
    assert not line_matches("my_task", published[0].text)


@needs_published
def test_templates_tell_the_forms_apart(raw_records):
    """An example matches its own template; those of other tasks only when the
    two tasks differ just by vocabulary (objects vs tools)."""
    first = {}
    for r in raw_records:
        first.setdefault(r["task_id"], r["texts"][1:-1].split("\n")[2])
    for tid, e in first.items():
        hits = {u for u, t in TASKS.items() if t.match(e)}
        assert tid in hits
        assert all(TASKS[u].template == TASKS[tid].template for u in hits), (tid, hits)


@needs_published
def test_labels_solve_every_published_example(raw_records):
    """The labels are right: for every published example, the QK pattern picks
    one source item and the OV transformation of it (looked up in the
    project's tables) is the published answer."""
    bad = []
    for r in raw_records:
        for e in r["texts"][1:-1].split("\n"):
            a = analyse(r["task_id"], e)
            if not a.ok:
                bad.append((r["task_id"], e, a.problems))
    assert not bad, bad[:5]


# ---------------------------------------------------------------------------
# tokenisation
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    if not TOKENIZER.is_file():
        pytest.skip("no tokenizer")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER))


@needs_published
def test_segmentwise_tokenisation(published, tokenizer):
    toks = tokenize_lines(published.lines, tokenizer)
    multi = 0
    for tl in toks:
        assert tl.ids.dtype.name == "int32"
        for a, (s, e) in zip(tl.line.answers, tl.spans):
            assert 0 < s < e <= len(tl.ids)
            assert tl.ids[s:e].tolist() == tokenizer.encode(" " + a.text, add_special_tokens=False).ids
            multi += (e - s) > 1
        # the pieces glue back to the text
        assert tokenizer.decode(tl.ids.tolist()) == tl.line.text
    assert multi > 100  # "Washington, D.C", "10 o'clock", ...


def test_segments_with_answer_not_after_space(tokenizer):
    text, answers = parse_texts("\nQ: 1+1=[2]\nnext (x)[ y ] z\n")
    assert text == "\nQ: 1+1=2\nnext (x)y z\n"
    from synth_tasks.dataset import Line

    (tl,) = tokenize_lines([Line("t", text, answers, 1, "f")], tokenizer)
    assert [tokenizer.decode(tl.ids[s:e].tolist()) for s, e in tl.spans] == ["2", "y"]


# ---------------------------------------------------------------------------
# malformed input
# ---------------------------------------------------------------------------

GOOD = {"task_id": "task0", "texts": "\nA b c\nD e f\nG h [ i ]\nJ k [ l m ]\n"}


def _write(tmp_path, lines, name="data.jsonl"):
    p = tmp_path / name
    p.write_text("".join(l if isinstance(l, str) else json.dumps(l) + "\n" for l in lines), encoding="utf-8")
    return p


def test_parse_texts_basic():
    text, ans = parse_texts(GOOD["texts"])
    assert text == "\nA b c\nD e f\nG h i\nJ k l m\n"
    assert [(a.text, a.k, a.example) for a in ans] == [("i", 2, 3), ("l m", 3, 4)]
    assert [text[a.start : a.end] for a in ans] == ["i", "l m"]


@pytest.mark.parametrize(
    "bad, message",
    [
        ("this is not json\n", r"data\.jsonl:2: not JSON \(Expecting value"),
        ('{"task_id": "task0", "texts": "\\nA [ b ]\\n"\n', r"data\.jsonl:2: not JSON"),
        ('["task0", "x"]\n', r"data\.jsonl:2: not a JSON object"),
        ({"task_id": "task0"}, r"data\.jsonl:2: missing 'texts'"),
        ({"texts": "\nA [ b ]\n"}, r"data\.jsonl:2: missing 'task_id'"),
        ({"task_id": "task0", "texts": 5}, r"data\.jsonl:2: 'texts' is not a string"),
        ({"task_id": 3, "texts": "\nA [ b ]\n"}, r"data\.jsonl:2: 'task_id' is not a string"),
        ({"task_id": "task0", "texts": "\nA b\nC d\nE [ f\n"}, r"data\.jsonl:2: unbalanced brackets in example 3"),
        ({"task_id": "task0", "texts": "\nA b\nC d ]\n"}, r"data\.jsonl:2: unbalanced brackets in example 2"),
        ({"task_id": "task0", "texts": "\nA [ b [ c ] ]\n"}, r"data\.jsonl:2: unbalanced brackets in example 1"),
        ({"task_id": "task0", "texts": "\nA b\nC d\nE f\nG [ ]\n"}, r"data\.jsonl:2: empty answer in example 4"),
        ({"task_id": "task0", "texts": "\nA []\n"}, r"data\.jsonl:2: empty answer in example 1"),
    ],
)
def test_malformed_lines(tmp_path, bad, message):
    p = _write(tmp_path, [GOOD, bad, GOOD])
    with pytest.raises(DatasetError, match=message):
        load_dataset(p)
    # DatasetError is a ValueError
    with pytest.raises(ValueError):
        load_dataset(p)
    ds = load_dataset(p, skip_bad=True)
    assert len(ds) == 2 and ds.skipped == 1
    assert re.search(message, ds.errors[0])
    assert [l.lineno for l in ds] == [1, 3]


def test_skip_counts_and_blank_lines(tmp_path):
    p = _write(
        tmp_path, [GOOD, "\n", "nope\n", {"task_id": "t"}, "   \n", GOOD, {"task_id": "t", "texts": "\nx [ ]\n"}]
    )
    with pytest.raises(DatasetError, match=r"data\.jsonl:3: not JSON"):
        load_dataset(p)
    ds = load_dataset(p, skip_bad=True)
    assert len(ds) == 2 and ds.skipped == 3
    assert [e.split(": ")[0] for e in ds.errors] == [f"{p}:3", f"{p}:4", f"{p}:7"]
    assert [l.lineno for l in ds] == [1, 6]


def test_not_utf8(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"task_id": "\xff"}\n')
    with pytest.raises(DatasetError, match=r"data\.jsonl:2: not UTF-8"):
        load_dataset(p)


def test_deeply_nested_json_is_a_dataset_error(tmp_path):
    """Found by fuzzing: json.loads raised RecursionError past the loader."""
    import synth_tasks

    p = tmp_path / "deep.jsonl"
    p.write_text("[" * 100000 + "\n")
    with pytest.raises(synth_tasks.DatasetError, match="deep.jsonl:1"):
        synth_tasks.load_dataset(str(p))
