"""The backward pass on CUDA against the CPU's: gradients at every hook and
of every parameter, integrated gradients, and AdamW training steps, on the
tiny models of test_cuda.py and every section-5 variant of test_variants.py
(static branch, grouped composition, key-wise only, MoH).

Every GPU test is skipped (with the engine's reason) where dclens was built
without CUDA or no GPU is usable; the test that needs no GPU checks that the
error there still names CUDA as unavailable.

Tolerance: rel_err(cuda, cpu) per tensor <= backward_tol (tests/tolerances.py:
a forward and its backward, both sides float32 in different summation
orders, over the tiny models' widths). The CUDA backward has no atomics, so
on the GPU recomputation gives the same bits as the full tape (checked).
"""

import warnings

import numpy as np
import pytest

import dclens

from test_grad_variants import NAMES as VARIANT_NAMES
from test_variants import BASE, VARIANTS
from tolerances import assert_close, backward_tol, tiny

HAVE_GPU = dclens.cuda_available()
WHY = "" if HAVE_GPU else dclens.cuda_unavailable_reason()
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no GPU: %s" % WHY)

# tiny models: D 32, F 128 (DCFormer++ 64), 2-4 layers, V <= 64, T <= 15
TOL = backward_tol(tiny(n_layer=4), 16, 64 * 128 * 4 * 16)

MODELS = {
    "dcp": dict(model_type="dcpythia", seed=21),
    "dcp-window-serial": dict(model_type="dcpythia", window_size=3, use_parallel_residual=False, seed=22),
    "dcp-query-wise": dict(model_type="dcpythia", query_wise=True, use_qk_norm=False, seed=23),
    "dcp-f16": dict(model_type="dcpythia", dtype="float16", window_size=4, seed=24),
    "mha": dict(model_type="dcpythia", use_dcmha=False, use_linear_bias=False, seed=25),
    "neox": dict(model_type="gpt_neox", seed=26),
    "dcformer-mgate": dict(
        model_type="dcformer", n_layer=4, window_type="LGLL", window_size=4, intermediate=64, mgate_dim=4, seed=30
    ),
}
for _n in VARIANT_NAMES:
    MODELS["variant-" + _n] = dict(BASE, **VARIANTS[_n])


def _pair(tiny_factory, name):
    kw = dict(MODELS[name])
    kw.setdefault("vocab", 24)
    d, sd, _cfg = tiny_factory(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dclens.LoadWarning)
        return dclens.load(d, device="cpu"), dclens.load(d, device="cuda"), sd


def _params(m):
    from dclens.analysis.grad import param_table

    return [r[0] for r in param_table(m)]


@needs_gpu
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cuda_gradients_match_cpu(tiny_factory, name):
    cpu, gpu, _sd = _pair(tiny_factory, name)
    toks = np.random.default_rng(7).integers(0, cpu.config.vocab, (2, 9))
    wrt = cpu.hook_names + _params(cpu)
    gc = cpu.gradients(toks, ("loss",), wrt)
    gg = gpu.gradients(toks, ("loss",), wrt)
    for n in wrt:
        assert gg[n].shape == gc[n].shape, n
        if np.abs(gc[n]).max() == 0:
            assert np.abs(gg[n]).max() == 0, n
            continue
        assert_close(gg[n], gc[n], TOL, "%s %s" % (name, n))


@needs_gpu
@pytest.mark.parametrize("name", ["dcp", "variant-groups4-static-qw", "variant-moh-hs2-static", "dcformer-mgate"])
def test_cuda_recompute_gives_the_same_bits(tiny_factory, name):
    _cpu, gpu, _sd = _pair(tiny_factory, name)
    toks = np.random.default_rng(8).integers(0, gpu.config.vocab, (2, 8))
    wrt = gpu.hook_names + _params(gpu)
    low = gpu.estimate_backward_memory(8, 2)["recompute"]
    ga = gpu.gradients(toks, ("loss",), wrt)
    gb = gpu.gradients(toks, ("loss",), wrt, max_tape_bytes=low)
    gc = gpu.gradients(toks, ("loss",), wrt)
    for n in wrt:
        assert np.array_equal(ga[n], gb[n]), n  # recomputation
        assert np.array_equal(ga[n], gc[n]), n  # run to run: no atomics


@needs_gpu
@pytest.mark.parametrize("name", ["dcp", "variant-moh-hs1", "dcformer-mgate"])
def test_cuda_attribute_matches_cpu(tiny_factory, name):
    cpu, gpu, _sd = _pair(tiny_factory, name)
    toks = np.random.default_rng(9).integers(0, cpu.config.vocab, 8)
    at = ["blocks.1.attn.head_out", "blocks.0.attn.z"]
    ac = cpu.attribute(toks, ("logprob", 7, 3), at, steps=4)
    ag = gpu.attribute(toks, ("logprob", 7, 3), at, steps=4)
    for n in at:
        assert_close(ag.attributions[n], ac.attributions[n], TOL, "%s %s" % (name, n))
        assert_close(ag.per_head[n], ac.per_head[n], TOL, "%s %s per head" % (name, n))


def _train_step(m, toks):
    """One AdamW step from fresh optimiser state: (loss, flat gradient, the
    weights after the step by name)."""
    from dclens._engine import ffi, lib
    from dclens.analysis.grad import Tape

    assert lib.dcs_model_make_trainable(m._m) == 0, m.runner.errmsg()
    P = int(lib.dcs_param_total(m._m))
    grads, mom, var = (np.zeros(P, np.float32) for _ in range(3))
    tape = Tape(m, toks.shape[0], toks.shape[1] - 1)
    hp = ffi.new("dcs_adamw *")
    hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay = 1e-2, 0.9, 0.95, 1e-8, 0.01
    p = lambda a: ffi.cast("float *", ffi.from_buffer(a))
    tape.forward(toks[:, :-1], logits=False)
    loss = tape.loss(toks[:, 1:])
    tape.backward(None, grads)
    assert lib.dcs_adamw_step(m._m, p(grads), p(mom), p(var), 1, hp) == 0, m.runner.errmsg()
    return loss, grads, {n: np.array(m.weight(n)) for n in _params(m)}


@needs_gpu
@pytest.mark.parametrize("name", ["dcp", "variant-groups2-key_wise", "variant-moh-hs2-static", "dcformer-mgate"])
def test_cuda_train_step_matches_cpu(tiny_factory, name):
    """One AdamW step on each device (the weights downloaded, stepped on the
    host, uploaded): the loss and the flat gradient agree within TOL; the
    trained weights agree where the gradient is far above rounding (AdamW's
    first step moves a weight by about lr * sign(g): an entry whose gradient
    is at rounding level may step either way on either device)."""
    cpu, gpu, _sd = _pair(tiny_factory, name)
    toks = np.random.default_rng(10).integers(0, cpu.config.vocab, (2, 9))
    lc, gc, wc = _train_step(cpu, toks)
    lg, gg, wg = _train_step(gpu, toks)
    assert abs(lg - lc) <= TOL * abs(lc), (lg, lc)
    assert_close(gg, gc, TOL, name + " flat gradient")
    from dclens.analysis.grad import param_table

    stable = np.abs(gc) > 1e3 * TOL * np.abs(gc).max()
    for n, off, k, _decay in param_table(cpu):  # the flat layout is each weight's own (dcs_adamw_step)
        assert wc[n].size == k, n
        sel = stable[off : off + k].reshape(wc[n].shape)
        if sel.any():
            assert_close(wg[n][sel], wc[n][sel], TOL, name + " trained " + n)


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is usable here")
def test_cuda_gradients_without_a_gpu_name_why(tiny_factory):
    """Where CUDA is unavailable, a model cannot be put on it, so gradients
    there fail first with the engine's reason."""
    d, _sd, _cfg = tiny_factory(model_type="dcpythia", vocab=24, seed=31)
    with pytest.raises(dclens.Error) as ei:
        dclens.load(d, device="cuda").gradients(np.arange(5), ("logit", 0, 1), ["blocks.0.attn.z"])
    msg = str(ei.value)
    assert "cuda" in msg.lower() and "not available" in msg


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is usable here")
def test_train_on_cuda_without_a_gpu_is_refused_before_writing(tmp_path):
    from dclens.train.loop import TrainConfig, train

    out = tmp_path / "run"
    with pytest.raises(dclens.Error, match="device 'cuda' is not available"):
        train(TrainConfig(out=str(out), device="cuda", steps=1))
    assert not out.exists()
    with pytest.raises(dclens.Error, match="--device"):
        TrainConfig(out=str(out), device="gpu").check()


@needs_gpu
def test_train_runs_on_cuda(tmp_path):
    """dclens.train with device='cuda': a few steps of a small run, the loss falls
    and the checkpoint loads on the CPU."""
    from dclens.train.loop import TrainConfig, train

    c = TrainConfig(
        out=str(tmp_path / "run"),
        device="cuda",
        n_layer=2,
        dim=32,
        n_head=4,
        seq_len=32,
        batch_size=4,
        steps=12,
        lr=3e-3,
        warmup=2,
        log_every=1,
        ckpt_every=12,
        progress=False,
    )
    final = train(c)
    m = dclens.load(final)
    assert m.config.n_layer == 2
    losses = [float(x.split(",")[1]) for x in (tmp_path / "run" / "loss.csv").read_text().split()[1:]]
    assert losses[-1] < losses[0], losses
