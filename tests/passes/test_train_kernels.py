"""The training step's vectorised kernels keep their scalar arithmetic: AdamW
equals its float32 formula op for op (IEEE float32 in numpy: the same bits,
whatever SIMD width the engine's clone uses; no contraction into FMA), at
1 and 2 threads (the LayerNorm rows, column sums and adds: test_kernels.c);
the backward's output gradients still honour overrides."""

import numpy as np
import pytest

import dclens
from dclens._engine import ffi, lib
from dclens.analysis.grad import Tape, param_table
from dclens.train.loop import read_weights


def test_adamw_bits_are_the_float32_formula(tiny_factory):
    d, _, _ = tiny_factory(model_type="gpt_neox", vocab=24)
    f = np.float32
    got = []
    for threads in (1, 2):
        m = dclens.load(d, n_threads=threads)
        assert lib.dcs_model_make_trainable(m._m) == 0
        P = int(lib.dcs_param_total(m._m))
        r = np.random.default_rng(1)
        g = r.standard_normal(P).astype(f)
        mom = (r.standard_normal(P) * 0.1).astype(f)
        var = np.abs(r.standard_normal(P) * 0.1).astype(f)
        w0 = read_weights(m)
        hp = ffi.new("dcs_adamw *")
        hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay = 0.01, 0.9, 0.95, 1e-8, 0.1
        mom1, var1 = mom.copy(), var.copy()
        p = lambda a: ffi.cast("float *", ffi.from_buffer(a))
        assert lib.dcs_adamw_step(m._m, p(g), p(mom1), p(var1), 3, hp) == 0
        w1 = read_weights(m)
        b1, b2, eps, lr = f(hp.beta1), f(hp.beta2), f(hp.eps), f(hp.lr)
        b1c, b2c = f(1) - np.power(b1, f(3)), f(1) - np.power(b2, f(3))  # the engine: 1 - powf(beta, step)
        for name, off, n, decay in param_table(m):
            s = slice(off, off + n)
            mm = b1 * mom[s] + (f(1) - b1) * g[s]
            vv = b2 * var[s] + (f(1) - b2) * g[s] * g[s]
            upd = (mm / b1c) / (np.sqrt(vv / b2c) + eps)
            w = w0[name].ravel()
            want = w - lr * (upd + (f(hp.weight_decay) if decay else f(0)) * w)
            assert want.dtype == np.float32
            np.testing.assert_array_equal(mom1[s], mm, err_msg=name)
            np.testing.assert_array_equal(var1[s], vv, err_msg=name)
            np.testing.assert_array_equal(w1[name].ravel(), want, err_msg=name)
        got.append(w1)
    for name in got[0]:
        np.testing.assert_array_equal(got[0][name], got[1][name])


@pytest.mark.parametrize("parallel", [True, False])
def test_output_gradients_cut_by_overrides(tiny_factory, parallel):
    """The backward hands the MLP and the attention dx itself as their output
    gradient (no copy) unless an override cuts them: with mlp.out and
    attn.out overridden, the gradient at resid_pre still carries the residual
    path (finite differences of the loss through the same overrides)."""
    d, _, _ = tiny_factory(model_type="gpt_neox", vocab=24, use_parallel_residual=parallel)
    m = dclens.load(d)
    T, D = 6, m.config.d_model
    rng = np.random.default_rng(2)
    toks = rng.integers(0, 24, (1, T)).astype(np.int32)
    ov = {
        m.parse_hook("blocks.0.resid_pre"): rng.standard_normal((1, T, D)).astype(np.float32),
        m.parse_hook("blocks.0.mlp.out"): rng.standard_normal((1, T, D)).astype(np.float32),
        m.parse_hook("blocks.1.attn.out"): rng.standard_normal((1, T, D)).astype(np.float32),
    }
    rp = m.parse_hook("blocks.0.resid_pre")
    tape = Tape(m, 1, T)

    def loss(r):
        tape.forward(toks, {**ov, rp: r}, logits=False)
        return tape.loss(toks)

    loss(ov[rp])
    g = tape.backward(None, None, [rp])[rp].astype(np.float64)
    v = rng.standard_normal((1, T, D)).astype(np.float32)
    eps = 1e-2
    fd = (loss(ov[rp] + eps * v) - loss(ov[rp] - eps * v)) / (2 * eps)
    assert abs(fd - float((g * v).sum())) <= 2e-2 * abs(fd) + 1e-4
