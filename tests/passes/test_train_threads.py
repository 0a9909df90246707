"""A training step's gradients, loss and updated weights are the same bits with 1, 2
and 3 threads (issue 29's throughput work keeps that): D 192 so the pool cuts the
weight-gradient products (an even number of row or column blocks), the RMSNorm
backward of DCPythia's qk-norm runs on the pool (rows, then dscale by columns in
row order), and the vectorised cross-entropy and GELU backward split rows over it."""

import numpy as np
import pytest

import dclens
from dclens._engine import ffi, lib
from dclens.analysis.grad import Tape
from dclens.train.loop import TrainConfig, init_weights, model_config, train_step, write_model

V, B, T = 300, 2, 24


def _step(d, c, n_threads):
    m = dclens.load(d, n_threads=n_threads)
    lib.dcs_model_make_trainable(m.runner.handle)
    P = int(lib.dcs_param_total(m.runner.handle))
    g, mom, var = (np.zeros(P, np.float32) for _ in range(3))
    hp = ffi.new("dcs_adamw *")
    hp.beta1, hp.beta2, hp.eps, hp.weight_decay = c.beta1, c.beta2, c.eps, c.weight_decay
    rng = np.random.default_rng(5)
    x, y = (rng.integers(0, V, (B, T)).astype(np.int32) for _ in range(2))
    loss, gn = train_step(c, m, Tape(m, B, T), x, y, g, mom, var, hp, 1)
    return loss, gn, g, mom, var


@pytest.mark.parametrize("mt", ["gpt_neox", "dcpythia"])
def test_train_step_same_bits_at_any_thread_count(tmp_path, mt):
    c = TrainConfig(out="-", model_type=mt, n_layer=1, dim=192, n_head=6, seq_len=T, batch_size=B, lr=1e-3,
                    warmup=0)  # fmt: skip
    write_model(str(tmp_path), init_weights(c, V), model_config(c, V), None)
    runs = [_step(str(tmp_path), c, n) for n in (1, 2, 3)]
    loss, gn, g = runs[0][:3]
    assert np.isfinite(loss) and gn > 0 and np.count_nonzero(g) > g.size // 2
    for r in runs[1:]:
        assert r[0] == loss and r[1] == gn
        assert all(np.array_equal(a, b) for a, b in zip(r[2:], runs[0][2:]))
