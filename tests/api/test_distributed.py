"""dclens.distributed on a local Ray cluster of 2 workers (issue 26): the
benchmark, a patching sweep and an IG map give, to the bit, what one process
gives with the same thread count; a worker killed in the middle of a run is
restarted by Ray and the run completes with the same results; errors name
their item. One Ray instance serves the whole module (started through
dclens.distributed.connect, as `--ray local:2` starts it)."""

import json
import os
import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import dclens  # noqa: E402
from dclens import distributed as dd  # noqa: E402
from dclens import patching  # noqa: E402

MODEL = "dcpythia-tiny"
pytestmark = pytest.mark.skipif(
    MODEL not in [b.name for b in dclens.bundled_models()], reason="bundled models not installed"
)


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    # the workers cannot import this test module: its functions travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    c = dd.Cluster("local:2", n_threads=1, init=dict(object_store_memory=96 << 20, log_to_driver=False))
    placement = dd.connect(c)
    assert (placement.workers, placement.n_threads) == (2, 1)
    assert ray.cluster_resources()["CPU"] == 2
    yield c
    ray.shutdown()


@pytest.fixture(scope="module")
def model():
    return dclens.load(MODEL, n_threads=1)


def _results(out_dir):
    with open(os.path.join(out_dir, "results.json")) as f:
        d = json.load(f)
    speed = d.pop("speed")
    return d, speed


def test_synth_command_on_ray_writes_the_single_process_results(cluster, tmp_path, capsys):
    from synth_tasks.cli import main

    # dcpythia-tiny last: its workers stay up for the tests below
    args = [
        "--model",
        "pythia-tiny",
        "--model",
        MODEL,
        "--data",
        "heldout",
        "--limit",
        "30",
        "--no-plots",
        "--no-progress",
        "--batch-tokens",
        "256",
    ]
    # the single-process run takes every core, each Ray worker 1 thread: the same bits
    assert main(args + ["--out", str(tmp_path / "one")]) == 0
    assert main(args + ["--out", str(tmp_path / "ray"), "--ray", "local:2", "--threads", "1"]) == 0
    for name in (MODEL, "pythia-tiny"):
        one, ray_ = tmp_path / "one" / name, tmp_path / "ray" / name
        (a, sa), (b, sb) = _results(one), _results(ray_)
        assert a == b and a["overall"]["n"] > 30  # every field but the timings
        assert (one / "answers.csv").read_bytes() == (ray_ / "answers.csv").read_bytes()
        assert (sb["workers"], sb["n_threads"]) == (2, 1) and sa["batches"] == sb["batches"] > 2
    assert (tmp_path / "one" / "compare.md").read_text() == (tmp_path / "ray" / "compare.md").read_text()
    assert "2 workers of 1 thread(s); the same results as a single-process run" in capsys.readouterr().err


def test_synth_function_equals_evaluate(cluster, model):
    from synth_tasks.corpus import HELDOUT_FILE
    from synth_tasks.dataset import load_dataset, sample_across_tasks
    from synth_tasks.evaluate import evaluate

    lines = sample_across_tasks(load_dataset(HELDOUT_FILE), 12).lines
    want = evaluate(model, lines, batch_tokens=200)
    (got,) = dd.synth(model, lines, ray=cluster, batch_tokens=200, progress=False)
    assert got.model_name == want.model_name == MODEL
    assert got.answers == want.answers and got.summary == want.summary


def test_patching_sweep_on_ray(cluster, model, capsys):
    clean = "Ruth has a sweater. Steven has a taxi. Ruth has a"
    corrupted = "Ruth has a taxi. Steven has a sweater. Ruth has a"
    metric = patching.logit_diff(model.to_single_token(" sweater"), model.to_single_token(" taxi"))
    want = patching.sweep(model, clean, corrupted, metric, over="layer,head", batch_size=5)
    got = patching.sweep(model, clean, corrupted, metric, over="layer,head", batch_size=5, ray=cluster, progress=True)
    assert "(2 workers)" in capsys.readouterr().err  # one bar across the workers
    assert np.array_equal(got.values, want.values) and got.values.shape == (4, 6)
    assert (got.clean, got.corrupted, got.labels) == (want.clean, want.corrupted, want.labels)
    # the composition sweep's cells carry arrays: they travel too
    want = patching.sweep(model, clean, corrupted, metric, over="composition", layers=[1], batch_size=8)
    got = patching.sweep(model, clean, corrupted, metric, over="composition", layers=[1], batch_size=8, ray=cluster)
    assert np.array_equal(got.values, want.values) and got.values.shape == (1, 6, 6)


def _ig(model, prompt):
    toks = model.to_tokens(prompt)
    r = model.attribute(
        toks[:-1], ("logprob", -1, int(toks[-1])), at=["blocks.2.attn.head_out"], method="ig", steps=8, progress=False
    )
    return r.per_head["blocks.2.attn.head_out"], r.gap["blocks.2.attn.head_out"]


PROMPTS = [
    "Ruth has a sweater. Steven has a taxi. Ruth has a sweater",
    "The cat sat on the mat. The dog sat on the rug",
    "Mary went to the shop. John went to the park. Mary went to the shop",
    "one two three four five six",
    "a b c d e f g h",
]


def test_ig_map_equals_one_process(cluster, model):
    want = dd.map(model, _ig, PROMPTS)  # in this process
    got = dd.map(model, _ig, PROMPTS, ray=cluster)
    assert len(got) == len(PROMPTS)
    for (a, ga), (b, gb) in zip(got, want):
        assert np.array_equal(a, b) and ga == gb


def _last_logits(model, prompt):
    return model.forward(model.to_tokens(prompt), logits_at="last")


def _halve_resid(act, name):
    act *= 0.5
    return act


def test_hooks_in_force_travel_with_the_work(cluster, model):
    """Issue 41: a hook put in force with `with model.hooks` or add_hook
    applies on the workers too (they load the model without it)."""
    plain = dd.map(model, _last_logits, PROMPTS[:2])
    with model.hooks([("blocks.2.resid_pre", _halve_resid)]):
        want = dd.map(model, _last_logits, PROMPTS[:2])  # in this process, with the hook
        got = dd.map(model, _last_logits, PROMPTS[:2], ray=cluster)
    assert all(np.abs(w - p).max() > 0.1 for w, p in zip(want, plain))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    model.add_hook("blocks.2.resid_pre", _halve_resid)
    try:
        got = dd.map(model, _last_logits, PROMPTS[:2], ray=cluster)
    finally:
        model.reset_hooks()
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # a patching sweep on the workers under the hook equals one process's
    clean = "Ruth has a sweater. Steven has a taxi. Ruth has a"
    corrupted = "Ruth has a taxi. Steven has a sweater. Ruth has a"
    metric = patching.logit_diff(model.to_single_token(" sweater"), model.to_single_token(" taxi"))
    with model.hooks([("blocks.2.resid_pre", _halve_resid)]), pytest.warns(patching.PatchingWarning):
        w = patching.sweep(model, clean, corrupted, metric, over="layer,head", layers=[3], batch_size=3)
        g = patching.sweep(model, clean, corrupted, metric, over="layer,head", layers=[3], batch_size=3, ray=cluster)
    assert np.array_equal(g.values, w.values)


def test_a_worker_killed_mid_run_is_replaced(cluster, model, tmp_path):
    marker = str(tmp_path / "killed")

    def fn(m, prompt):
        if prompt == PROMPTS[2] and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # the worker process dies in the middle of the run
        return _last_logits(m, prompt), os.getpid()

    items = PROMPTS * 2
    got = dd.map(model, fn, items, ray=cluster)
    assert os.path.exists(marker)
    assert len({pid for _, pid in got}) >= 2
    want = dd.map(model, _last_logits, items)
    for (a, _), b in zip(got, want):
        assert np.array_equal(a, b)


def test_a_cluster_keeps_its_workers_between_calls(cluster, model):
    pids = lambda: set(dd.map(model, lambda m, x: os.getpid(), range(6), ray=cluster))
    first = pids()
    assert len(first) == 2 and pids() == first  # loaded once, used again
    assert os.getpid() not in first


def test_an_exception_names_its_item(cluster):
    def fn(m, x):
        if x == 3:
            raise ValueError("no good")
        return x

    for where in (cluster, None):
        with pytest.raises(dclens.Error, match=r"item 3 of 5 \(3\) failed: ValueError: no good"):
            dd.map(MODEL, fn, range(5), ray=where)


@pytest.mark.parametrize(
    "bad, said",
    [
        (5, "ray must be"),
        ("local:0", r"N 0 is out of range"),
        ("local:two", "a local cluster is 'local' or 'local:N'"),
        (dd.Cluster("local:2", workers=3, n_threads=1), r"3 workers of 1 CPUs each need more than the Ray cluster"),
        (dd.Cluster("local:2", n_threads=4), r"2 workers of 4 CPUs each need more than"),
    ],
)
def test_bad_cluster_arguments(cluster, bad, said):
    with pytest.raises(dclens.Error, match=said):
        dd.map(MODEL, lambda m, x: x, [1], ray=bad)


def test_no_items_and_bad_functions(cluster):
    assert dd.map(MODEL, lambda m, x: x, [], ray=cluster) == []
    with pytest.raises(dclens.Error, match="fn must be a function"):
        dd.map(MODEL, 3, [1], ray=cluster)
    with pytest.raises(dclens.Error, match="no such model directory"):
        dd.map("/nonexistent/model", lambda m, x: x, [1], ray=cluster)


def test_changed_files_are_refused_by_the_workers(cluster, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(dclens.bundled.resolve("pythia-tiny"), d)
    m = dclens.load(str(d), n_threads=1)
    with open(d / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(dclens.Error, match="(?s)could not start .*changed since it was loaded"):
        dd.map(m, lambda model, x: x, [1], ray=cluster)
