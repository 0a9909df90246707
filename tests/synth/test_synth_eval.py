"""synth_tasks.evaluate against an independent reference evaluator, and the
`synth` command line, on a fake causal model."""

import csv
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from synth_tasks import cli, evaluate, load_dataset
from synth_tasks.evaluate import make_batches

from tolerances import f32_tol, f64_tol

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
PUBLISHED = SHARED / "synthetic_dataset.jsonl"
TOKENIZER = SHARED / "gpt-neox-20b-tokenizer.json"

pytestmark = pytest.mark.skipif(not (PUBLISHED.is_file() and TOKENIZER.is_file()), reason="no ../shared data")


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER))


# nll / ppl: sums of float64 log-softmax terms of float32 logits, which differ
# between a batched and a single pass by float32 rounding (the fake model's
# length-8 products and the log-sum-exp over V; tests/tolerances.py), relative
# to the values compared; accuracies are ratios of counts (float64 only).
NLL = f32_tol(50304, 2, 50304 * 300, sides=2)
ACC = f64_tol(1000, 1)


class FakeModel:
    """A deterministic causal toy LM with the engine's interface.

    logits[t] = (emb[x_t] + mean(emb[x_0..x_t]) + pos[t]) @ W
                + 4 * [v occurred in x_0..x_t] + 8 * [v followed x_t earlier]
    The running mean, the copy and the induction bonus make every position depend on all the
    tokens before it, and pos[t] on the absolute position, so a batching,
    padding or offset bug changes the numbers.
    """

    def __init__(self, tokenizer, vocab=50304, d=8, seed=0, name="fake"):
        rng = np.random.default_rng(seed)
        self.E = rng.standard_normal((vocab, d)).astype(np.float32)
        self.W = (rng.standard_normal((d, vocab)) * 0.7).astype(np.float32)
        self.P = (rng.standard_normal((2048, d)) * 0.5).astype(np.float32)
        self.config = SimpleNamespace(vocab=vocab)
        self.tokenizer = tokenizer
        self.name = name
        self.calls = []

    def forward(self, tokens):
        tokens = np.asarray(tokens)
        one = tokens.ndim == 1
        if one:
            tokens = tokens[None]
        assert tokens.dtype == np.int32
        B, T = tokens.shape
        self.calls.append((B, T))
        h = self.E[tokens]
        mean = np.cumsum(h, axis=1) / np.arange(1, T + 1, dtype=np.float32)[None, :, None]
        logits = (h + mean + self.P[:T]) @ self.W
        for b in range(B):
            follow = {}  # token -> tokens that followed it so far
            for t in range(T):
                x = int(tokens[b, t])
                if t:
                    follow.setdefault(int(tokens[b, t - 1]), set()).add(x)
                logits[b, t, tokens[b, : t + 1]] += 4.0  # copy
                if x in follow:  # induction
                    logits[b, t, list(follow[x])] += 8.0
        logits = logits.astype(np.float32)
        return logits[0] if one else logits


# ---------------------------------------------------------------------------
# the reference evaluator: straight from docs/synthetic-benchmark.md, one line
# at a time, no batching, sharing no code with synth_tasks
# ---------------------------------------------------------------------------


def reference_evaluate(model, tokenizer, path, n_lines):
    answers = []
    with open(path, encoding="utf-8") as f:
        records = [json.loads(l) for l in f][:n_lines]
    for lineno, rec in enumerate(records, start=1):
        texts = rec["texts"]
        # segments: text before the answer (without its trailing space), then
        # " " + answer, then the rest ...
        segs, pos = [], 0
        for m in re.finditer(r" \[ (.*?) \]", texts):
            segs.append((texts[pos : m.start()], None))
            segs.append((" " + m.group(1), m))
            pos = m.end()
        segs.append((texts[pos:], None))
        ids, spans = [], []
        for s, m in segs:
            e = tokenizer.encode(s).ids if s else []
            if m is not None:
                k = texts[: m.start()].strip("\n").count("\n")  # examples before it
                spans.append((len(ids), len(ids) + len(e), m.group(1), k))
            ids += e
        assert "[" not in tokenizer.decode(ids)
        logits = model.forward(np.array(ids, dtype=np.int32))  # [T, V]
        for s, e, text, k in spans:
            nll, correct = 0.0, True
            for p in range(s, e):
                row = logits[p - 1].astype(np.float64)
                logp = row - (row.max() + math.log(np.exp(row - row.max()).sum()))
                nll -= logp[ids[p]]
                correct = correct and int(np.argmax(logits[p - 1])) == ids[p]
            answers.append(
                dict(
                    task=rec["task_id"], line=lineno, k=k, answer=text, nll=nll, n=e - s, correct=correct, ids=ids[s:e]
                )
            )
    return answers


def ref_stats(rows):
    return (
        sum(r["correct"] for r in rows) / len(rows),
        math.exp(sum(r["nll"] for r in rows) / sum(r["n"] for r in rows)),
        len(rows),
    )


@pytest.fixture(scope="module")
def subset_path(tmp_path_factory, tokenizer):
    """Published lines of very different lengths (the 5 shortest, the 5 longest
    and 14 spread over the file, i.e. over the tasks), kept in a file so that
    both evaluators read the same lines."""
    with open(PUBLISHED, encoding="utf-8") as f:
        lines = f.readlines()
    n_tok = [len(tokenizer.encode(re.sub(r"\[ (.*?) \]", r"\1", json.loads(l)["texts"])).ids) for l in lines]
    order = sorted(range(len(lines)), key=lambda i: n_tok[i])
    pick = set(order[:5]) | set(order[-5:]) | set(range(3, len(lines), 64))
    p = tmp_path_factory.mktemp("synth") / "subset.jsonl"
    p.write_text("".join(lines[i] for i in sorted(pick)), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def model(tokenizer):
    return FakeModel(tokenizer)


@pytest.fixture(scope="module")
def both(model, tokenizer, subset_path):
    ds = load_dataset(subset_path)
    model.calls.clear()
    res = evaluate(model, ds, batch_tokens=1200)
    calls = list(model.calls)
    ref = reference_evaluate(model, tokenizer, subset_path, len(ds))
    return ds, res, ref, calls


def test_batches_are_real(both):
    ds, res, ref, calls = both
    assert len(calls) < len(ds)  # several lines per forward
    assert any(B > 1 for B, T in calls)
    assert res.speed["tokens"] < res.speed["padded_tokens"]  # padding happened
    assert res.speed["tokens_per_s"] > 0 and res.speed["batches"] == len(calls)
    lengths = [T for B, T in calls]
    assert max(lengths) > 250 and max(lengths) - min(lengths) > 80


def test_per_answer_against_reference(both):
    ds, res, ref, calls = both
    assert len(res.answers) == len(ref) == 6 * len(ds)
    n_correct = 0
    for a, r in zip(res.answers, ref):
        assert (a.task_id, a.line, a.k, a.answer) == (r["task"], r["line"], r["k"], r["answer"])
        assert a.target_ids == r["ids"] and a.n_tokens == r["n"]
        assert a.nll == pytest.approx(r["nll"], rel=NLL)
        assert a.correct == r["correct"]
        n_correct += a.correct
    # the fake model gets some right and some wrong, so correctness is tested
    assert 0 < n_correct < len(ref)
    assert any(a.n_tokens > 1 for a in res.answers)


def test_aggregates_against_reference(both):
    ds, res, ref, calls = both
    s = res.summary
    acc, ppl, n = ref_stats(ref)
    assert s["overall"]["n"] == n
    assert s["overall"]["acc"] == pytest.approx(acc, rel=ACC)
    assert s["overall"]["ppl"] == pytest.approx(ppl, rel=NLL)
    for task in {r["task"] for r in ref}:
        acc, ppl, n = ref_stats([r for r in ref if r["task"] == task])
        got = s["per_task"][task]
        assert (got["n"], got["acc"]) == (n, pytest.approx(acc))
        assert got["ppl"] == pytest.approx(ppl, rel=NLL)
    assert sorted(s["per_k"]) == ["2", "3", "4", "5", "6", "7"]
    for k in range(2, 8):
        acc, ppl, n = ref_stats([r for r in ref if r["k"] == k])
        got = s["per_k"][str(k)]
        assert (got["n"], got["acc"]) == (n, pytest.approx(acc))
        assert got["ppl"] == pytest.approx(ppl, rel=NLL)
    from synth_tasks import TASKS

    for group, attr in (("per_pattern", "pattern"), ("per_transform", "transform")):
        assert sum(v["n"] for v in s[group].values()) == s["overall"]["n"]
        for label, got in s[group].items():
            rows = [r for r in ref if getattr(TASKS[r["task"]], attr) == label]
            acc, ppl, n = ref_stats(rows)
            assert (got["n"], got["acc"]) == (n, pytest.approx(acc))
            assert got["ppl"] == pytest.approx(ppl, rel=NLL)


def test_batch_size_does_not_change_results(model, subset_path):
    ds = load_dataset(subset_path, limit=8)
    a = evaluate(model, ds, batch_tokens=1)  # one line per forward
    b = evaluate(model, ds, batch_tokens=100000, max_batch=64)  # all in one
    for x, y in zip(a.answers, b.answers):
        assert x.nll == pytest.approx(y.nll, rel=NLL) and x.correct == y.correct


def test_make_batches():
    lengths = [10, 300, 12, 290, 11, 150]
    bs = make_batches(lengths, batch_tokens=600)
    assert sorted(i for b in bs for i in b) == list(range(6))
    for b in bs:
        assert len(b) * max(lengths[i] for i in b) <= 600 or len(b) == 1
    assert bs[0] == [1, 3]  # the long ones together


def test_no_tokenizer(tokenizer, subset_path):
    m = FakeModel(None, vocab=50304)
    with pytest.raises(ValueError, match="MODEL_DIR has no tokenizer.json"):
        evaluate(m, load_dataset(subset_path, limit=1))


def test_vocab_too_small(tokenizer, subset_path):
    m = FakeModel(tokenizer, vocab=1000)
    with pytest.raises(ValueError, match="vocabulary"):
        evaluate(m, load_dataset(subset_path, limit=1))


# ---------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------


@pytest.fixture
def fake_loader(monkeypatch, tokenizer):
    models = {}

    def load(path, device="cpu"):
        seed = 0 if "A" in str(path) else 1
        models[path] = FakeModel(tokenizer, seed=seed, name=Path(path).name)
        return models[path]

    monkeypatch.setattr(cli, "load_model", load)
    return models


def test_cli_dtype_reaches_the_loader(tmp_path, monkeypatch, tokenizer, subset_path):
    seen = []

    def load(path, device="cpu", **kw):
        seen.append(kw)
        return FakeModel(tokenizer, seed=0, name=Path(path).name)

    monkeypatch.setattr(cli, "load_model", load)
    args = ["synth", "--model", "modelA", "--data", str(subset_path), "--limit", "2", "--no-progress", "--no-plots"]
    assert cli.main(args + ["--out", str(tmp_path / "a"), "--dtype", "bfloat16"]) == 0
    assert cli.main(args + ["--out", str(tmp_path / "b")]) == 0
    assert seen == [{"dtype": "bfloat16"}, {}]


def test_cli_one_model(tmp_path, fake_loader, subset_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(
        ["synth", "--model", "modelA", "--data", str(subset_path), "--out", str(out), "--limit", "6", "--no-progress"]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "overall" in text and "tokens/s" in text and "k=7" in text
    d = json.loads((out / "results.json").read_text())
    assert d["overall"]["n"] == 36 and set(d["overall"]) >= {"acc", "ppl", "n"}
    for key in ("per_task", "per_k", "per_pattern", "per_transform", "speed"):
        assert d[key]
    assert d["model"] == "modelA" and d["lines"] == 6
    with open(out / "answers.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 36
    assert set(rows[0]) >= {"task", "line", "k", "answer", "nll", "correct", "predicted"}
    # same numbers as the library
    ref = evaluate(fake_loader["modelA"], load_dataset(subset_path, limit=6))
    assert [float(r["nll"]) for r in rows] == pytest.approx([a.nll for a in ref.answers], rel=NLL)
    assert [int(r["correct"]) for r in rows] == [int(a.correct) for a in ref.answers]
    for png in ("acc_per_task.png", "acc_per_k.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_two_models(tmp_path, fake_loader, subset_path, capsys):
    out = tmp_path / "cmp"
    rc = cli.main(
        [
            "--model",
            "runs/modelA",
            "--model",
            "runs/modelB",
            "--data",
            str(subset_path),
            "--out",
            str(out),
            "--limit",
            "4",
            "--no-progress",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "modelA acc" in text and "modelB acc" in text
    cmp_ = json.loads((out / "compare.json").read_text())
    assert cmp_["models"] == ["modelA", "modelB"]
    assert set(cmp_["overall"]) == {"modelA", "modelB"}
    a = json.loads((out / "modelA" / "results.json").read_text())
    assert cmp_["overall"]["modelA"]["acc"] == a["overall"]["acc"]
    assert "| all |" in (out / "compare.md").read_text()
    assert (out / "modelB" / "answers.csv").is_file()
    assert (out / "acc_per_k.png").is_file()


def test_cli_bad_data(tmp_path, fake_loader, capsys):
    p = tmp_path / "data.jsonl"
    good = json.dumps({"task_id": "task0", "texts": "\nA b\nC d\nE f [ g ]\n"})
    p.write_text(good + "\n" + "{oops\n" + good + "\n" + '{"task_id": "task0"}\n')
    rc = cli.main(["--model", "modelA", "--data", str(p), "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "data.jsonl:2: not JSON" in err
    rc = cli.main(
        [
            "--model",
            "modelA",
            "--data",
            str(p),
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
            "--skip-bad-lines",
            "--no-plots",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "skipped 2 bad lines" in err and "data.jsonl:4: missing 'texts'" in err
    assert "2 line(s) of table task ids do not fit" in err
    d = json.loads((tmp_path / "o" / "results.json").read_text())
    assert d["overall"]["n"] == 2 and d["skipped_lines"] == 2
    assert d["template_mismatches"] == 2


def test_cli_model_without_tokenizer(tmp_path, monkeypatch, subset_path, capsys):
    monkeypatch.setattr(cli, "load_model", lambda p, device="cpu": FakeModel(None))
    rc = cli.main(["--model", "m", "--data", str(subset_path), "--out", str(tmp_path)])
    assert rc == 2
    assert "has no tokenizer.json" in capsys.readouterr().err


def test_cli_default_data_is_the_published_file():
    assert Path(cli.default_data_path()).resolve() == PUBLISHED.resolve()


def test_cli_on_a_generated_tiny_engine_model(tiny_factory, tmp_path, tokenizer, subset_path):
    """`dclens synth` end to end on a real (generated) checkpoint, checked
    against the reference evaluator on the same model."""
    dclens = pytest.importorskip("dclens")
    d, _, _ = tiny_factory(vocab=50304, tokenizer=str(TOKENIZER))
    out = tmp_path / "tiny"
    rc = cli.main(
        [
            "--model",
            d,
            "--data",
            str(subset_path),
            "--limit",
            "6",
            "--out",
            str(out),
            "--no-progress",
            "--no-plots",
            "--batch-tokens",
            "700",
        ]
    )
    assert rc == 0
    ref = reference_evaluate(dclens.load(d), tokenizer, subset_path, 6)
    with open(out / "answers.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(ref) == 36
    for row, r in zip(rows, ref):
        assert (row["task"], int(row["line"]), int(row["k"]), row["answer"]) == (
            r["task"],
            r["line"],
            r["k"],
            r["answer"],
        )
        assert float(row["nll"]) == pytest.approx(r["nll"], rel=NLL)
        assert bool(int(row["correct"])) == r["correct"]
    got = json.loads((out / "results.json").read_text())["overall"]
    acc, ppl, n = ref_stats(ref)
    assert got["n"] == n and got["acc"] == pytest.approx(acc)
    assert got["ppl"] == pytest.approx(ppl, rel=NLL)


# ---------------------------------------------------------------------------
# per-task results, typed (issue 37)
# ---------------------------------------------------------------------------


def test_per_task_is_typed_and_equals_the_summary(both):
    import dataclasses

    from synth_tasks import TASKS, TaskResult

    ds, res, ref, calls = both
    pt = res.per_task
    assert list(pt) == list(res.summary["per_task"])  # the same tasks, in task order
    assert len(pt) > 10
    for tid, r in pt.items():
        assert isinstance(r, TaskResult) and r.task_id == tid
        row = dataclasses.asdict(r)
        del row["task_id"]
        assert row == res.summary["per_task"][tid]  # every field of the summary row, nothing else
        assert (r.accuracy, r.perplexity) == (r.acc, r.ppl)
        assert (r.pattern, r.transform) == (TASKS[tid].pattern, TASKS[tid].transform)
        rows = [a for a in res.answers if a.task_id == tid]
        assert r.n == len(rows) and r.correct == sum(a.correct for a in rows)
    assert sum(r.n for r in pt.values()) == res.overall["n"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        pt[next(iter(pt))].acc = 1.0  # type: ignore[misc]


# ---------------------------------------------------------------------------
# the progress log (issue 37): each quarter's line shows the count at that quarter
# ---------------------------------------------------------------------------

_QUARTER = re.compile(r"^synth fake: (\d+)% \((\d+)/(\d+) line\)")


class ZeroModel:
    """Logits 0 at the positions asked (logits_at=): the cheapest model evaluate takes."""

    def __init__(self, tokenizer, vocab=50304):
        self.config, self.tokenizer, self.name = SimpleNamespace(vocab=vocab), tokenizer, "fake"

    def forward(self, tokens, logits_at=None):
        return np.zeros((tokens.shape[0], np.shape(logits_at)[1], self.config.vocab), np.float32)


@pytest.mark.parametrize(
    "n_lines, batch_tokens",
    [(24, 100000), (24, 1200), (10, 100000), (7, 1)],  # one batch of all; uneven batches; 10 and 7 lines
)
def test_progress_log_counts_agree_with_the_percentages(tokenizer, subset_path, capsys, n_lines, batch_tokens):
    ds = load_dataset(subset_path, limit=n_lines)
    capsys.readouterr()
    evaluate(ZeroModel(tokenizer), ds, batch_tokens=batch_tokens, progress=None)  # not a terminal: plain lines
    log = capsys.readouterr().err.splitlines()
    assert 3 <= len(log) <= 6 and log[0] == "synth fake: start" and log[-1].startswith("synth fake: done, ")
    quarters = [tuple(int(x) for x in _QUARTER.match(line).groups()) for line in log[1:-1]]
    assert [q[0] for q in quarters] == [25, 50, 75]  # each quarter once
    counts = [n for _, n, _ in quarters]
    assert counts == sorted(set(counts))  # never the same count twice
    for pct, n, total in quarters:
        assert total == n_lines
        # n is the first count at or past pct%: pct% of the lines, rounded up
        assert n * 100 >= pct * total > (n - 1) * 100, (pct, n, total)
    assert "%d/%d line" % (n_lines, n_lines) in log[-1]
