"""synth_tasks.generate: new data in the published format, for all 74 tasks."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from synth_tasks import TASKS, analyse, generate, load_dataset, write_jsonl
from synth_tasks.generate import examples_of
from synth_tasks.generate import main as generate_main
from synth_tasks.tables import CITIES, OBJECTS, OPPOSITES, PEOPLE

PUBLISHED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "synthetic_dataset.jsonl"


@pytest.fixture(scope="module")
def lines():
    return generate(lines_per_task=6, seed=7)


def test_all_tasks_any_number_of_lines(lines):
    counts = Counter(r["task_id"] for r in lines)
    assert list(counts) == list(TASKS) and set(counts.values()) == {6}
    assert len(generate(["task3", "task70"], lines_per_task=1)) == 2
    assert len(generate("task12", lines_per_task=31)) == 31
    assert generate(lines_per_task=0) == []
    with pytest.raises(KeyError):
        generate(["task74"])


def test_published_layout(lines):
    for r in lines:
        assert set(r) == {"task_id", "texts"}
        texts = r["texts"]
        assert texts.startswith("\n") and texts.endswith("\n") and "\n\n" not in texts
        examples = texts[1:-1].split("\n")
        assert len(examples) == 8
        for j, e in enumerate(examples):
            if j < 2:
                assert "[" not in e and "]" not in e
            else:
                assert re.fullmatch(r".* \[ [^\[\]]+ \]", e), e
        assert len(texts) < 1300


def test_every_example_matches_its_task_template_and_is_solved(lines):
    for r in lines:
        t = TASKS[r["task_id"]]
        for j, e in enumerate(r["texts"][1:-1].split("\n")):
            m = t.match(e)
            assert m is not None, (t.task_id, e)
            assert bool(m.group("A_open")) == (j >= 2)
            a = analyse(t.task_id, e, strict=True)
            assert a.ok, (t.task_id, e, a.problems)


def test_same_template_as_published_lines(lines):
    """Generated and published lines of a task match the same template and
    that template only (up to tasks that differ only by vocabulary)."""
    if not PUBLISHED.is_file():
        pytest.skip("no ../shared data")
    for r in lines[::6]:
        e = r["texts"][1:-1].split("\n")[4]
        hits = {u for u, t in TASKS.items() if t.match(e)}
        assert all(TASKS[u].template == TASKS[r["task_id"]].template for u in hits)


def test_one_verb_per_line(lines):
    verbs = re.compile(
        r"\b(has|possesses|owns|have|possess|own|wants to go to|wants to visit|"
        r"longs for|yearns for|want to go to|want to visit|long for|yearn for|"
        r"arrived|appeared|showed up|arrive|appear|show up)\b"
    )
    for r in lines:
        qs = [e.split(">. ", 1)[1] for e in r["texts"][1:-1].split("\n") if ">. " in e]
        found = {tuple(verbs.findall(q)) for q in qs}
        assert len(found) <= 1, (r["task_id"], found)


def test_loader_reads_generated_data(tmp_path, lines):
    p = tmp_path / "gen.jsonl"
    write_jsonl(p, lines)
    raw = p.read_text(encoding="utf-8").splitlines()
    assert len(raw) == len(lines)
    assert json.loads(raw[0]) == lines[0]
    assert raw[0] == json.dumps(lines[0])  # the published file's own style
    ds = load_dataset(p)
    assert len(ds) == len(lines) and ds.n_answers == 6 * len(lines)
    assert Counter(a.k for l in ds for a in l.answers) == {k: len(lines) for k in range(2, 8)}


def test_seeded_and_deterministic():
    a = generate(lines_per_task=2, seed=11)
    assert a == generate(lines_per_task=2, seed=11)
    assert a != generate(lines_per_task=2, seed=12)
    # a task's lines do not depend on which other tasks are generated
    sub = generate(["task5", "task60"], lines_per_task=2, seed=11)
    assert sub == [r for r in a if r["task_id"] in ("task5", "task60")]


def test_diverse(lines):
    many = generate(["task0", "task26", "task42", "task50", "task69"], lines_per_task=40, seed=3)
    for tid in ("task0", "task26", "task42", "task50", "task69"):
        ex = [e for r in many if r["task_id"] == tid for e in r["texts"][1:-1].split("\n")]
        assert len(set(ex)) >= 0.95 * len(ex)
    text = "".join(r["texts"] for r in many)
    used_people = {p for p in PEOPLE if p in text}
    assert len(used_people) > 60
    answers = Counter(re.findall(r"\[ (.*?) \]", text))
    assert len(answers) > 100


def test_tables_are_consistent():
    for name, o in OBJECTS.items():
        assert o.superclass or o.capability
        assert o.a_form.endswith(name)
    for c in CITIES.values():
        assert c.country
    for a, opp in OPPOSITES.items():
        for b in opp:
            assert a in OPPOSITES[b]


def test_hold_out_and_command_line(tmp_path):
    if not PUBLISHED.is_file():
        pytest.skip("no ../shared data")
    with open(PUBLISHED, encoding="utf-8") as f:
        published = [json.loads(l) for l in f]
    held = examples_of(published)
    out = tmp_path / "train.jsonl"
    assert generate_main([str(out), "--lines-per-task", "3", "--seed", "5", "--exclude", str(PUBLISHED)]) == 0
    gen = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(gen) == 3 * 74
    assert not (examples_of(gen) & held)
