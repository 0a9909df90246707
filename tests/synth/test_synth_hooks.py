"""synth_tasks under hooks in force (issue 41): every pass it runs honours `with
model.hooks(...)` and `model.add_hook`, checked against a plain loop of full
forwards over the same lines under the same hooks; calls whose passes cannot
run the hooks (Ray workers, gradient passes) refuse, naming them."""

import numpy as np
import pytest

dclens = pytest.importorskip("dclens")

from dclens import interventions as iv  # noqa: E402
from dclens._core.checks import Error  # noqa: E402
from synth_tasks import evaluate, load_dataset, tokenize_lines  # noqa: E402
from synth_tasks.dataset import default_data_path, sample_across_tasks  # noqa: E402
from synth_tasks.probe import probe  # noqa: E402

pytestmark = pytest.mark.skipif(
    not {"dcpythia-tiny", "dcpythia-small"} <= {b.name for b in dclens.bundled_models()},
    reason="bundled models not installed",
)


@pytest.fixture(scope="module")
def published():
    path = default_data_path()
    if path is None:
        pytest.skip("no ../shared/data/synthetic_dataset.jsonl")
    return load_dataset(path)


@pytest.fixture(scope="module")
def tiny():
    return dclens.load("dcpythia-tiny")


@pytest.fixture(scope="module")
def lines(published):
    return sample_across_tasks(published, 12).lines


def ablate_layer0(model, heads):
    """Zero heads 0..heads-1 of layer 0 (attn.z): moves the accuracy without making it 0."""
    return iv.Hooks([iv.ablate_head(model, 0, h) for h in range(heads)])  # one Hooks: their pairs


def plain_loop(model, lines):
    """Per answer: correct (greedy on every answer token), from one full forward per line
    (no batching, no logits_at): whatever hooks are in force run in those passes."""
    out = []
    for tl in tokenize_lines(list(lines), model.tokenizer):
        logits = np.asarray(model.forward(tl.ids))  # [T, V]
        for s, e in tl.spans:
            out.append(all(int(np.argmax(logits[p - 1])) == int(tl.ids[p]) for p in range(s, e)))
    return out


def correct(res):
    return [a.correct for a in res.answers]


def test_evaluate_runs_the_hooks_of_a_with_block(tiny, lines):
    plain = evaluate(tiny, lines, progress=False)
    hooks = ablate_layer0(tiny, 4)
    with tiny.hooks(hooks):
        hooked = evaluate(tiny, lines, progress=False)
        loop = plain_loop(tiny, lines)
    assert correct(hooked) == loop  # per answer, the same as the plain loop under the hooks
    assert hooked.overall["acc"] == pytest.approx(np.mean(loop))
    assert correct(hooked) != correct(plain)  # the hooks matter on these lines
    assert correct(plain) == plain_loop(tiny, lines)  # and are gone after the block
    assert not tiny.runner.ctx_hooks


def test_evaluate_runs_the_hooks_of_add_hook(tiny, lines):
    plain = evaluate(tiny, lines, progress=False)
    try:
        for name, fn in ablate_layer0(tiny, 4):
            tiny.add_hook(name, fn)
        hooked = evaluate(tiny, lines, progress=False)
        loop = plain_loop(tiny, lines)
    finally:
        tiny.reset_hooks()
    assert correct(hooked) == loop and correct(hooked) != correct(plain)
    again = evaluate(tiny, lines, progress=False)
    assert again.answers == plain.answers  # reset_hooks: the un-hooked model again


def test_a_zeroed_ln_final_reaches_the_scores(tiny, lines):
    """ln_final zeroed: the logits are the unembedding's bias (none here: all 0), every
    answer token has probability 1/V, so its NLL is log V."""

    def zero(act, _name):
        act[...] = 0.0
        return act

    few = lines[:4]
    with tiny.hooks([("ln_final", zero)]):
        res = evaluate(tiny, few, progress=False)
        logits = np.asarray(tiny.forward(tokenize_lines(few, tiny.tokenizer)[0].ids))
    V = tiny.config.vocab
    assert np.all(logits == logits[0, 0])
    for a in res.answers:
        assert a.nll == pytest.approx(a.n_tokens * np.log(V), rel=1e-5)


def test_the_issue_example_task56_on_dcpythia_small(published):
    """issue 41: on dcpythia-small, task56 under a hook that changes its results gives the
    same accuracy through evaluate as through a plain loop."""
    m = dclens.load("dcpythia-small")
    lines56 = [l for l in published.lines if l.task_id == "task56"]
    plain = evaluate(m, lines56, progress=False)
    with m.hooks(ablate_layer0(m, 5)):
        hooked = evaluate(m, lines56, progress=False)
        loop = plain_loop(m, lines56)
    assert len(loop) == 72 == hooked.overall["n"]
    assert correct(hooked) == loop
    assert hooked.overall["acc"] == np.mean(loop) == hooked.per_task["task56"].acc
    assert hooked.overall["acc"] < plain.overall["acc"] - 0.1  # the hook changes the result


def test_probe_scores_under_the_hooks(tiny, lines):
    line = next(l for l in lines if l.task_id == "task0")
    hooks = ablate_layer0(tiny, 4)
    with tiny.hooks(hooks):
        p = probe(line, 0, tiny.tokenizer, model=tiny)
    z = np.asarray(tiny.run_with_hooks(np.stack([p.ids, p.corrupted]), fwd_hooks=hooks)[:, p.query], np.float64)
    pr = np.exp(z - z.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    assert p.p_clean == pytest.approx(pr[0, p.answer_token], rel=1e-4, abs=1e-7)
    assert p.p_corrupted == pytest.approx(pr[1, p.answer_token], rel=1e-4, abs=1e-7)
    assert p.p_clean != pytest.approx(probe(line, 0, tiny.tokenizer, model=tiny).p_clean, rel=1e-3)


def test_ray_synth_refuses_hooks_it_cannot_carry(tiny, lines):
    """The Ray workers load the model again, without the hooks: a dclens.Error naming them,
    raised before any cluster is joined (no Ray needed)."""
    from synth_tasks.distributed import synth

    with (
        tiny.hooks(ablate_layer0(tiny, 2)),
        pytest.raises(Error, match=r"2 hook\(s\) in force.*blocks\.0\.attn\.z.*Ray workers"),
    ):
        synth(tiny, lines, ray="local:2")
    tiny.add_hook("ln_final", lambda a, n: None, read_only=True)
    try:
        with pytest.raises(Error, match=r"dcpythia-tiny has 1 hook\(s\) in force.*ln_final"):
            synth(["pythia-tiny", tiny], lines, ray="local:2")  # any model of the list
    finally:
        tiny.reset_hooks()


def test_case_study_refuses_hooks(tiny, lines):
    """case_study's integrated gradients are gradient passes, which cannot run Python hooks."""
    from synth_tasks.case_study import case_study, survey

    with tiny.hooks(ablate_layer0(tiny, 1)):
        with pytest.raises(Error, match=r"case_study.*blocks\.0\.attn\.z.*gradient"):
            case_study(tiny, lines[0], 0, steps=2)
        with pytest.raises(Error, match=r"survey.*blocks\.0\.attn\.z"):
            survey({"a": tiny}, lines[:2], limit=1, steps=2)
