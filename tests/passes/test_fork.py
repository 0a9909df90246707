"""Fork safety (issue 26): a process that has loaded a model forks ("fork"
start method of multiprocessing), and the children run the parent's model,
load their own, and compute the parent's logits (exactly: the same weights,
the same code), also when a thread of the parent was running a pass at the
fork. Before the engine's pthread_atfork handler these children deadlocked
in their first pass (the thread pool's threads are not copied by fork).

A child that hangs is killed after TIMEOUT seconds and the test fails."""

import multiprocessing as mp
import os
import threading

import numpy as np
import pytest

import dclens

from conftest import rel_err
from reference import ref_forward

TIMEOUT = 60
FORK = mp.get_context("fork")
# Python 3.12+ warns that fork() in a multi-threaded process may deadlock the
# child: that is the situation these tests create on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _in_child(fn, *args):
    """fn(*args) run in a forked child; its result, or pytest.fail if it hangs or dies."""
    recv, send = FORK.Pipe(duplex=False)

    def main():
        try:
            send.send(("ok", fn(*args)))
        except BaseException as e:  # noqa: BLE001 -- reported to the parent
            send.send(("error", "%s: %s" % (type(e).__name__, e)))
        finally:
            os._exit(0)

    p = FORK.Process(target=main)
    p.start()
    try:
        if not recv.poll(TIMEOUT):
            pytest.fail("the forked child did not finish its pass in %d s (deadlock)" % TIMEOUT)
        kind, value = recv.recv()
    finally:
        if p.is_alive():
            p.kill()
        p.join()
    assert kind == "ok", value
    return value


@pytest.fixture(scope="module")
def model_and_ref(tiny_factory):
    # big enough that the engine's pool runs every GEMM and attention on 2 threads
    d, sd, cfg = tiny_factory(model_type="dcpythia", dim=128, n_head=4, vocab=256, window_size=16, seed=26)
    model = dclens.load(d, n_threads=2)
    toks = np.random.default_rng(26).integers(0, 256, size=(4, 48)).astype(np.int32)
    return d, model, toks, sd, cfg


def test_forked_child_runs_the_parents_model(model_and_ref):
    d, model, toks, sd, cfg = model_and_ref
    parent = model.forward(toks)
    child = _in_child(lambda: model.forward(toks))
    assert np.array_equal(child, parent)
    for b in range(toks.shape[0]):  # and both are right (the numpy reference)
        assert rel_err(child[b], ref_forward(sd, cfg, toks[b])) <= 1e-4


def test_forked_child_runs_hooks_and_loads_its_own_model(model_and_ref):
    d, model, toks, sd, cfg = model_and_ref
    name = "blocks.1.attn.pattern"
    want_logits, want_cache = model.run_with_cache(toks, names=[name])
    want_plain = model.forward(toks)  # no hooks: the fused attention path

    def child():
        logits, cache = model.run_with_cache(toks, names=[name])
        own = dclens.load(d, n_threads=2)  # a model loaded in the child
        return logits, cache[name], own.forward(toks)

    logits, pattern, own = _in_child(child)
    assert np.array_equal(logits, want_logits)
    assert np.array_equal(pattern, want_cache[name])
    assert np.array_equal(own, want_plain)


def test_fork_inside_a_pass_of_another_thread(model_and_ref):
    """The fork lands inside a pass for sure: a thread's pass is held in a
    hook (model lock taken, half the layers done) while the main thread forks."""
    d, model, toks, sd, cfg = model_and_ref
    want = model.forward(toks)
    point = "blocks.1.attn.pattern"  # hooking a map takes the unfused attention path
    want_hooked = model.run_with_hooks(toks, fwd_hooks=[(point, dclens.read_only(lambda a, n: None))])
    inside, forked, out = threading.Event(), threading.Event(), {}

    def hook(act, name):
        inside.set()
        forked.wait(TIMEOUT)

    def run():
        out["logits"] = model.run_with_hooks(toks, fwd_hooks=[(point, dclens.read_only(hook))])

    t = threading.Thread(target=run)
    t.start()
    try:
        assert inside.wait(TIMEOUT)
        got = _in_child(lambda: model.forward(toks))
    finally:
        forked.set()
        t.join(TIMEOUT)
    assert np.array_equal(got, want)
    assert np.array_equal(out["logits"], want_hooked)  # the parent's pass finished as usual


def test_fork_while_another_thread_runs_passes(model_and_ref):
    """A thread of the parent runs passes back to back while the main thread
    forks four times: forks land anywhere in a pass, the pool's threads busy
    or parked. Each child must run the model and get the same logits."""
    d, model, toks, sd, cfg = model_and_ref
    want = model.forward(toks)
    stop, started = threading.Event(), threading.Event()
    passes = []

    def busy():
        while not stop.is_set():
            started.set()
            passes.append(np.array_equal(model.forward(toks), want))

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        assert started.wait(TIMEOUT)
        for _ in range(4):
            assert np.array_equal(_in_child(lambda: model.forward(toks)), want)
    finally:
        stop.set()
        t.join(TIMEOUT)
    assert passes and all(passes)  # the parent's own passes were undisturbed


def test_fork_pool_gets_pickled_models(model_and_ref):
    """multiprocessing's Pool pickles its arguments: the model travels as a
    reference and is loaded again in the worker."""
    d, model, toks, sd, cfg = model_and_ref
    want = model.forward(toks[:2])
    with FORK.Pool(2) as pool:
        got = pool.starmap(_forward, [(model, toks[:2]), (model, toks[:2])], chunksize=1)
    for g in got:
        assert np.array_equal(g, want)


def _forward(model, toks):
    return model.forward(toks)


def test_cuda_model_refuses_to_run_in_a_forked_child(tiny_factory):
    """CUDA does not survive fork: a CUDA model used in a forked child raises
    instead of crashing, and the child never frees the parent's CUDA memory.
    (No GPU is needed to check the guard: a CPU model labelled as a CUDA one.)"""
    d, sd, cfg = tiny_factory(model_type="dcpythia", seed=27)
    m = dclens.load(d, n_threads=1)
    toks = np.arange(5, dtype=np.int32)
    want = m.forward(toks)
    m.device = "cuda"

    def child():
        try:
            m.forward(toks)
        except dclens.Error as e:
            return str(e)
        return "no error"

    said = _in_child(child)
    assert "a CUDA model cannot be used in a process forked from the one that loaded it" in said
    assert np.array_equal(m.forward(toks), want)  # the parent's model is untouched
    m.device, m.runner.pid = "cuda", -1  # weight reads are guarded too
    with pytest.raises(dclens.Error, match="CUDA model cannot be used in a process forked"):
        m.weight("tok_embeddings.weight")
    m.device = "cpu"
