"""The gradient tapes a model keeps between calls (bindings/dclens/_core/tapes.py).

* a call served by a cached tape gives the same bits as one with a fresh
  tape: repeated calls, a smaller T after a larger one (a prefix of the
  buffers), a smaller batch, other hooks and parameters asked, IG (its
  overrides at another hook, its last chunk and baseline on the same tape),
  on the model types and the section-5 variants; the cache is checked to
  have served the call (the test fails if the reuse path is not taken);
* the cache respects max_tape_bytes (a call evicts idle tapes that do not
  fit beside the one it needs), holds at most MAX_IDLE tapes, and
  Model.free_caches() empties it;
* weights changing (an AdamW step) need no invalidation: a cached tape reads
  them at every pass;
* threads never share a tape; a forked child starts with an empty cache;
  a model freed with a cached tape goes after it (dcs_free waits);
* the memory report after a backward adds the backend's backward scratch
  (CPU: layernorm statistics, rotary angles, the compose row kernel's
  per-thread buffers) to the forward's, and stays within the plan's estimate;
* the default budget comes from the model's device (the host's MemAvailable
  for a CPU model, the GPU's free memory for a CUDA one: GPU tests skip
  without a GPU).
"""

import gc
import os
import threading
import warnings

import numpy as np
import pytest

import dclens
from dclens import memplan
from dclens._engine import ffi, lib
from dclens.analysis.attribution import attribute

from test_variants import BASE, VARIANTS

HAVE_GPU = dclens.cuda_available()
needs_gpu = pytest.mark.skipif(
    not HAVE_GPU, reason="no GPU: %s" % ("" if HAVE_GPU else dclens.cuda_unavailable_reason())
)

CONFIGS = {
    "dcpythia": dict(model_type="dcpythia", n_layer=3),
    "dcp-window-serial-qw": dict(
        model_type="dcpythia", window_size=3, use_parallel_residual=False, query_wise=True, n_layer=3
    ),
    "gpt_neox": dict(model_type="gpt_neox", n_layer=3),
    "dcformer": dict(model_type="dcformer", intermediate=64, mgate_dim=4),
    "static": dict(BASE, **VARIANTS["static"]),
    "groups2-key_wise": dict(BASE, **VARIANTS["groups2-key_wise"]),
    "moh-hs2-static": dict(BASE, **VARIANTS["moh-hs2-static"]),
}


def _load(tiny_factory, name, device="cpu"):
    kw = dict(CONFIGS[name])
    kw.setdefault("vocab", 24)
    d, _sd, _cfg = tiny_factory(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dclens.LoadWarning)
        return dclens.load(d, device=device)


def _fresh(m, *args, **kw):
    """gradients with a tape made for this call alone."""
    m.free_caches()
    out = m.gradients(*args, **kw)
    m.free_caches()
    return out


def _same(a, b, what):
    assert a.keys() == b.keys(), what
    for n in a:
        assert a[n].dtype == b[n].dtype and np.array_equal(a[n], b[n]), (what, n)


def _idle(m):
    return list(m.runner.tapes._idle)


def _first_param(m):
    from dclens.analysis.grad import param_table

    return param_table(m)[1][0]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_tape_gives_the_bits_of_a_fresh_one(tiny_factory, name):
    m = _load(tiny_factory, name)
    ref = _load(tiny_factory, name)  # fresh tapes only
    rng = np.random.default_rng(11)
    long, short = rng.integers(0, 24, 13), rng.integers(0, 24, 6)
    pair = rng.integers(0, 24, (2, 9))
    a, b = "blocks.1.attn.head_out", "blocks.0.resid_post"
    calls = [
        (long, ("logit_diff", -1, 3, 5), [a]),
        (long, ("logit_diff", -1, 3, 5), [a]),  # the same call again
        (short, ("logprob", -2, 7), [a]),  # smaller T: the T=13 tape's prefix
        (short, ("logprob", -2, 7), [b, "embed", _first_param(m)]),  # other hooks, a parameter
        (pair, ("loss",), [a, b]),  # a batch: B=2 > the cached B=1, a new tape
        (long[:9], ("logit", 3, 1), [a]),  # B=1, T=9 on the B=2 tape
        (long, ("logit_diff", -1, 3, 5), [a]),  # T grows again
    ]
    reused = {1, 2, 3, 5, 6}  # calls an idle tape serves (no new tape)
    for i, (toks, target, wrt) in enumerate(calls):
        before = {id(t) for t in _idle(m)}
        got, val = m.gradients(toks, target, wrt, return_value=True)
        want, wval = _fresh(ref, toks, target, wrt, return_value=True)
        _same(got, want, (name, i))
        assert np.array_equal(np.asarray(val), np.asarray(wval)), (name, i)
        idle = _idle(m)
        assert 1 <= len(idle) <= m.runner.tapes.MAX_IDLE, (name, i)
        if i in reused:
            assert {id(t) for t in idle} == before, (name, i)
        if i == 2:  # served by the T=13 tape: a prefix of its buffers
            assert (idle[-1].B_cap, idle[-1].T_cap, idle[-1].T) == (1, 13, 6), (name, i)
    assert sorted((t.B_cap, t.T_cap) for t in _idle(m)) == [(1, 13), (2, 9)]


@pytest.mark.parametrize("name", ["dcpythia", "gpt_neox", "static"])
def test_attribute_repeated_and_after_other_hooks_is_bitwise(tiny_factory, name):
    m = _load(tiny_factory, name)
    ref = _load(tiny_factory, name)
    toks = np.random.default_rng(12).integers(0, 24, 10)
    target = ("logit_diff", -1, 1, 2)
    hooks = ["blocks.1.attn.z", "blocks.0.attn.head_out", "blocks.1.attn.z"]
    for i, at in enumerate(hooks):
        for chunk in (3, None):  # 3: the last of 3 chunks of 7 steps is 1 point (a reshape)
            got = attribute(m, toks, target, [at], steps=7, chunk=chunk)
            ref.free_caches()
            want = attribute(ref, toks, target, [at], steps=7, chunk=chunk)
            ref.free_caches()
            assert np.array_equal(got.attributions[at], want.attributions[at]), (name, i, chunk)
            assert got.gap[at] == want.gap[at] and got.baseline_value[at] == want.baseline_value[at]
    # the layer-0 tape and one from layer 1 are both kept (within the default budget)
    assert sorted(t.first for t in _idle(m)) == [0, 1]


def test_cache_respects_the_budget_and_is_bounded(tiny_factory, monkeypatch):
    m = _load(tiny_factory, "dcpythia")
    toks = np.arange(12) % 24
    wrt = ["blocks.2.attn.head_out"]
    g_big = m.gradients(toks, ("logit", -1, 2), wrt)  # default budget: a full tape, cached
    (t,) = _idle(m)
    assert not t.memory_recompute
    low = m.estimate_backward_memory(12, 1)["recompute"]
    assert low < t.plan_bytes
    g_low = m.gradients(toks, ("logit", -1, 2), wrt, max_tape_bytes=low)
    (t2,) = _idle(m)  # the full tape did not fit the budget: freed, not reused
    assert t2 is not t and t2.memory_recompute and t2.plan_bytes <= low
    _same(g_low, g_big, "recompute vs full")
    # a call with the default budget does not take the recomputing tape (slower) ...
    m.gradients(toks[:8], ("logit", -1, 2), wrt)
    assert sorted((t.memory_recompute, t.T_cap) for t in _idle(m)) == [(False, 8), (True, 12)]
    # ... and never more than MAX_IDLE idle tapes
    for first_T in (5, 7, 9, 11):
        m.attribute(toks[:first_T], ("logit", -1, 2), ["blocks.1.attn.z"], steps=3)
        assert len(_idle(m)) <= m.runner.tapes.MAX_IDLE
    held = m.runner.tapes.held_bytes()
    assert held > 0
    monkeypatch.setattr(memplan, "available_memory", lambda: 3 << 30)
    assert memplan.default_budget(m) == ((3 << 30) + held) // 2  # the idle tapes count as free
    monkeypatch.undo()
    m.free_caches()
    assert _idle(m) == [] and m.runner.tapes.held_bytes() == 0
    # still works after free_caches, and after a budget too small for any tape
    with pytest.raises(dclens.Error, match="max_tape_bytes"):
        m.gradients(toks, ("logit", -1, 2), wrt, max_tape_bytes=1000)
    _same(m.gradients(toks, ("logit", -1, 2), wrt), g_big, "after free_caches")


def test_threads_never_share_a_tape(tiny_factory):
    m = _load(tiny_factory, "dcpythia")
    ref = _load(tiny_factory, "dcpythia")
    rng = np.random.default_rng(13)
    jobs = [(rng.integers(0, 24, T), ("logprob", -1, 4), ["blocks.1.attn.head_out"]) for T in (5, 9, 13, 7) * 3]
    want = [_fresh(ref, *j) for j in jobs]
    got = [None] * len(jobs)
    errors = []

    def run(idx):
        try:
            for i in idx:
                got[i] = m.gradients(*jobs[i])
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(range(k, len(jobs), 3),)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(len(jobs)):
        _same(got[i], want[i], i)
    assert len(_idle(m)) <= m.runner.tapes.MAX_IDLE


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_starts_with_an_empty_cache(tiny_factory):
    m = _load(tiny_factory, "dcpythia")
    toks = np.arange(9) % 24
    wrt = ["blocks.1.attn.head_out"]
    want = m.gradients(toks, ("logit", -1, 3), wrt)["blocks.1.attn.head_out"]
    assert len(_idle(m)) == 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        code = 1
        try:
            empty = not m.runner.tapes._idle
            g = m.gradients(toks, ("logit", -1, 3), wrt)["blocks.1.attn.head_out"]
            code = 0 if empty and np.array_equal(g, want) and len(m.runner.tapes._idle) == 1 else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    code = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert code == b"\x00", code
    assert len(_idle(m)) == 1  # the parent's tape is untouched


def test_model_freed_with_a_cached_tape(tiny_factory):
    """dcs_free waits for the model's last tape: a cached tape and its model
    may be collected in either order."""
    for _ in range(3):
        m = _load(tiny_factory, "dcpythia")
        m.gradients(np.arange(7) % 24, ("logit", -1, 3), ["blocks.1.attn.head_out"])
        tape = _idle(m)[0]
        del m
        gc.collect()
        assert tape._tp is not None  # still alive, held here: the model's memory too
        tape.memory()
        del tape
        gc.collect()


def test_backward_scratch_in_the_memory_report(tiny_factory):
    """CPU: after the backward the tape reports its forward's peak plus the
    largest scratch of the CPU backward operations (cpu_backward.c: layernorm
    statistics [2, M], rotary angles [T, rot/2] x 2, and for plain DCMHA the
    compose row kernel's [2N + 4R + 1, Tp] plus the fused backward's [2, N, T]
    and the attention backward's blocks of dPc, dA [2, N, min(32, T), T] per
    thread, Tp = T rounded up to 16 keys), and that stays within the
    estimate."""
    kw = dict(CONFIGS["dcpythia"], vocab=24)
    d, _sd, cfg = tiny_factory(**kw)
    from dclens.analysis.grad import Tape

    for n_threads in (1, 3):
        m = dclens.load(d, n_threads=n_threads)
        B, T = 2, 11
        toks = np.arange(B * T).reshape(B, T) % 24
        tp = Tape(m, B, T)
        tp.forward(toks)
        fwd = tp.memory()
        tp.backward(np.ones((B, T, 24), np.float32), None, [m.parse_hook("blocks.1.attn.head_out")])
        bwd = tp.memory()
        c = m.config
        rot = c.rotary_dim
        R = c.dyn_rank
        N, Tp = c.n_head, (T + 15) // 16 * 16
        per_thread = (2 * N + 4 * R + 1) * Tp + 2 * N * T + 2 * N * min(32, T) * T
        want = 4 * max(2 * B * T, 2 * T * max(rot // 2, 1), n_threads * per_thread)
        assert bwd["tape"] == fwd["tape"]
        assert bwd["pass_peak"] - fwd["pass_peak"] == want, (n_threads, bwd, fwd, want)
        assert m.last_pass_memory()["peak"] == bwd["tape"] + bwd["pass_peak"]
        est = m.estimate_backward_memory(T, B, ["blocks.1.attn.head_out"])
        assert m.last_pass_memory()["peak"] <= est["full"]
        # a parameter asked for counts its float32 gradient (CPU: no device mirror)
        from dclens.analysis.grad import param_table

        name, _, size, _ = param_table(m)[2]
        est_p = m.estimate_backward_memory(T, B, ["blocks.1.attn.head_out", name])
        assert est_p["full"] - est["full"] == est_p["recompute"] - est["recompute"] == 4 * size


def test_default_budget_follows_the_device(tiny_factory):
    m = _load(tiny_factory, "dcpythia")
    fr, tot = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    assert lib.dcs_device_memory(m.runner.handle, fr, tot) == lib.DCS_ERR_UNSUPPORTED  # the host's memory
    assert "host" in m.runner.errmsg()
    assert memplan.device_memory(m) is None
    host = memplan.available_memory()
    assert abs(memplan.default_budget(m) - host // 2) < (1 << 30)  # MemAvailable moves (other processes)
    est = m.estimate_backward_memory(8)
    assert abs(est["budget"] - host // 2) < (1 << 30)


@needs_gpu
def test_cuda_default_budget_is_the_gpus(tiny_factory):
    gpu = _load(tiny_factory, "dcpythia", device="cuda")
    fr, tot = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    assert lib.dcs_device_memory(gpu.runner.handle, fr, tot) == lib.DCS_OK, gpu.runner.errmsg()
    free, total = int(fr[0]), int(tot[0])
    assert 0 < free <= total
    dev = memplan.device_memory(gpu)
    assert dev is not None and 0 < dev <= total
    budget = memplan.default_budget(gpu)
    assert budget <= max(256 << 20, (total + 1) // 2)  # never the host's (128 GiB hosts, 80 GiB GPUs)
    assert abs(budget - dev // 2) < (256 << 20)


@needs_gpu
@pytest.mark.parametrize("name", ["dcpythia", "static", "dcformer"])
def test_cuda_cached_tape_and_scratch(tiny_factory, name):
    gpu = _load(tiny_factory, name, device="cuda")
    ref = _load(tiny_factory, name, device="cuda")
    rng = np.random.default_rng(14)
    long, short = rng.integers(0, 24, 13), rng.integers(0, 24, 6)
    wrt = ["blocks.1.attn.head_out", _first_param(gpu)]
    for toks in (long, short, long):
        _same(gpu.gradients(toks, ("logprob", -1, 3), wrt), _fresh(ref, toks, ("logprob", -1, 3), wrt), name)
    (t,) = _idle(gpu)
    assert t.T_cap == 13
    # the report counts the CUDA backward's scratch and the parameter mirror
    from dclens.analysis.grad import Tape, param_table

    tp = Tape(gpu, 1, 13)
    tp.forward(long)
    fwd = tp.memory()["pass_peak"]
    tp.backward(np.ones((1, 13, 24), np.float32), None, [gpu.parse_hook("blocks.1.attn.head_out")])
    M, N = 13, gpu.config.n_head
    assert tp.memory()["pass_peak"] - fwd >= 4 * max(2 * M, M * N) + 4 * M
    assert gpu.last_pass_memory()["peak"] <= gpu.estimate_backward_memory(13, 1, ["blocks.1.attn.head_out"])["full"]
    # a parameter's gradient: the host array and the device mirror
    name, _, size, _ = param_table(gpu)[2]
    est = gpu.estimate_backward_memory(13, 1, ["blocks.1.attn.head_out"])
    est_p = gpu.estimate_backward_memory(13, 1, ["blocks.1.attn.head_out", name])
    assert est_p["full"] - est["full"] == 8 * size
    tp.forward(long)
    tp.backward(np.ones((1, 13, 24), np.float32), None, [], params={2: np.zeros(size, np.float32)})
    assert tp.memory()["pass_peak"] - fwd >= 4 * size + 4 * max(2 * M, M * N) + 4 * M


def test_free_caches_refused_from_a_hook(tiny_factory):
    m = _load(tiny_factory, "dcpythia")
    toks = np.arange(6) % 24
    g = m.gradients(toks, ("logit", -1, 3), ["blocks.1.attn.head_out"])

    def hook(act, hook):
        m.free_caches()

    with pytest.raises(dclens.Error, match="free_caches: not from a hook"):
        m.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.z", hook)])
    assert len(_idle(m)) == 1  # untouched
    m.free_caches()
    _same(m.gradients(toks, ("logit", -1, 3), ["blocks.1.attn.head_out"]), g, "after")


def test_ig_tape_and_the_idle_ones_fit_the_budget(tiny_factory):
    """IG's tape, what IG holds besides (memplan.ig_extra) and the idle tapes
    fit max_tape_bytes together: a budget that holds one batch of every
    point evicts the layer-0 tape of F(a) before IG makes its own."""
    m = _load(tiny_factory, "dcpythia")
    toks = np.arange(10) % 24
    at, steps = "blocks.1.attn.z", 5
    p = m.parse_hook(at)[0]
    budget = memplan.tape_bytes(m, steps, 10, False, (), 1) + memplan.ig_extra(m, 10, steps, p)
    assert memplan.ig_batch(m, 10, steps, p, budget, 1) == (steps, False)
    want = attribute(m, toks, ("logit", -1, 2), [at], steps=steps, chunk=steps).attributions[at]
    assert sorted(t.first for t in _idle(m)) == [0, 1]  # the default budget holds both
    m.free_caches()
    got = attribute(m, toks, ("logit", -1, 2), [at], steps=steps, max_tape_bytes=budget)
    (t,) = _idle(m)  # the layer-0 tape went first
    assert t.first == 1 and t.plan_bytes + memplan.ig_extra(m, 10, steps, p) <= budget
    assert np.array_equal(got.attributions[at], want)


def test_cached_tape_follows_a_weight_change(tiny_factory):
    """A tape holds no weight (every pass reads them): after the weights
    change (training's writable copy, an AdamW step) a cached tape gives
    the bits of a fresh one, with the new weights."""
    m = _load(tiny_factory, "dcpythia")
    toks = np.arange(9) % 24
    args = (toks, ("logprob", -1, 4), ["blocks.1.attn.head_out"])
    before = m.gradients(*args)
    h = m.runner.handle
    assert lib.dcs_model_make_trainable(h) == lib.DCS_OK, m.runner.errmsg()
    P = lib.dcs_param_total(h)
    grads, mom, var = (np.full(P, 0.01, np.float32), np.zeros(P, np.float32), np.zeros(P, np.float32))
    hp = ffi.new("dcs_adamw *")
    hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay = 0.05, 0.9, 0.95, 1e-8, 0.0

    def ptr(a):
        return ffi.cast("float *", ffi.from_buffer(a))

    assert lib.dcs_adamw_step(h, ptr(grads), ptr(mom), ptr(var), 1, hp) == lib.DCS_OK, m.runner.errmsg()
    (t,) = _idle(m)
    after = m.gradients(*args)
    assert _idle(m) == [t]  # the cached tape served it
    assert not np.array_equal(after["blocks.1.attn.head_out"], before["blocks.1.attn.head_out"])
    _same(after, _fresh(m, *args), "after a weight change")
