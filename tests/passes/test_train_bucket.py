"""Length-bucketed line batches (dclens train --lines --bucket, issue 29): the
loss of a batch is the token-weighted mean over its lines whatever the padding
(against tests/reference.py), the gradients do not depend on the padding
length, a tape reshaped to a smaller batch equals a tape made for it, the
batches are a function of (seed, step), and --bucket is recorded in run.json
so a run resumes with the batching it started with."""

import json
import math

import numpy as np
import pytest

import dclens
from dclens._engine import lib
from dclens.analysis.grad import Tape
from dclens.train.loop import BUCKET_ROUND, BUCKET_STEPS, TrainConfig, batch, train

import reference as R
from tolerances import assert_close, f32_tol, forward_depth, forward_tol

LENS = (13, 5, 9, 3)  # tokens of each line (inputs: len - 1)


def _lines(V, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, V, n).astype(np.int32) for n in LENS]


def _padded(lines, T):
    x = np.zeros((len(lines), T), np.int32)
    y = np.full((len(lines), T), -1, np.int32)
    for b, q in enumerate(lines):
        x[b, : len(q) - 1] = q[:-1]
        y[b, : len(q) - 1] = q[1:]
    return x, y


def _loss_grads(m, tape, x, y):
    if x.shape != (tape.B, tape.T):
        tape.reshape(*x.shape)
    g = np.zeros(int(lib.dcs_param_total(m.runner.handle)), np.float32)
    tape.forward(x, logits=False)
    loss = tape.loss(y)
    tape.backward(None, g)
    return loss, g


@pytest.mark.parametrize("mt", ["dcpythia", "gpt_neox"])
def test_batch_loss_is_the_mean_over_its_lines_whatever_the_padding(tiny_factory, mt):
    d, sd, cfg = tiny_factory(model_type=mt)
    m = dclens.load(d)
    lib.dcs_model_make_trainable(m.runner.handle)
    lines = _lines(cfg["vocab_size"])
    # the reference: mean next-token NLL over every line's tokens (float64)
    nll = []
    for q in lines:
        lg = R.ref_forward(sd, cfg, q[:-1])
        lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
        nll.extend(lse - lg[np.arange(len(q) - 1), q[1:]])
    want = float(np.mean(nll))
    longest = max(LENS) - 1
    tape = Tape(m, len(lines), 24)
    full = _loss_grads(m, tape, *_padded(lines, 24))  # padded to the tape's T
    tight = _loss_grads(m, tape, *_padded(lines, longest))  # the same tape reshaped
    fresh = _loss_grads(m, Tape(m, len(lines), longest), *_padded(lines, longest))
    tol = forward_tol(cfg, 24, 1)
    for what, (loss, _) in (("T=24", full), ("T=%d" % longest, tight), ("fresh tape", fresh)):
        assert abs(loss - want) <= tol * max(abs(want), 1.0), (what, loss, want)
    # gradients: padding adds positions whose targets are unscored; the scored
    # positions see only earlier (real) tokens, so the gradients agree to rounding
    L = cfg.get("n_layer") or cfg["num_hidden_layers"]
    gtol = f32_tol(24 * len(lines), 2 * forward_depth(L), full[1].size, sides=2)
    assert_close(tight[1], full[1], gtol, "gradients, T=%d vs T=24" % longest)
    np.testing.assert_array_equal(tight[1], fresh[1])  # same shape, same code: same bits
    assert tight[0] == fresh[0]


def test_reshape_refuses_a_larger_batch(tiny_factory):
    d, _, _ = tiny_factory(model_type="gpt_neox")
    m = dclens.load(d)
    tape = Tape(m, 2, 8)
    for B, T in ((3, 8), (2, 9), (0, 8), (2, 0)):
        with pytest.raises(dclens.Error, match="reshape to B=%d T=%d" % (B, T)):
            tape.reshape(B, T)
    tape.reshape(1, 4)
    assert (tape.B, tape.T) == (1, 4)
    with pytest.raises(dclens.Error, match="loss before forward"):
        tape.loss(np.zeros((1, 4), np.int32))


def _corpus(n=300, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(2, 40, n)
    offs = np.zeros(n + 1, np.int64)
    offs[1:] = np.cumsum(lens)
    toks = rng.integers(0, 50, int(offs[-1])).astype(np.int32)
    return toks, np.stack([offs[:-1], offs[1:]], 1)


def test_bucketed_batches():
    toks, offs = _corpus()
    c = TrainConfig(out="-", lines=True, bucket=True, seq_len=32, batch_size=8, seed=3)
    spread_b, spread_u = [], []
    for step in range(1, 2 * BUCKET_STEPS + 1, 7):
        x, y = batch(toks, c, step, offs)
        x2, y2 = batch(toks, c, step, offs)
        np.testing.assert_array_equal(x, x2)  # a function of (seed, step)
        np.testing.assert_array_equal(y, y2)
        n = (y >= 0).sum(1)
        T = x.shape[1]
        assert x.shape == (8, T) and T <= 32 and (T % BUCKET_ROUND == 0 or T == 32)
        assert T == min(32, math.ceil(n.max() / BUCKET_ROUND) * BUCKET_ROUND)
        for b in range(8):  # each line: its tokens, then unscored padding
            assert (y[b, n[b] :] == -1).all() and (x[b, 1 : n[b]] == y[b, : n[b] - 1]).all()
            assert (x[b, n[b] :] == 0).all()
        spread_b.append(n.max() - n.min())
        xu, yu = batch(toks, TrainConfig(out="-", lines=True, seq_len=32, batch_size=8, seed=3), step, offs)
        assert xu.shape == (8, 32)
        nu = (yu >= 0).sum(1)
        spread_u.append(nu.max() - nu.min())
    assert np.mean(spread_b) < 0.25 * np.mean(spread_u), (spread_b, spread_u)
    # the steps of one group take distinct batches of one sorted draw
    seen = {tuple(map(tuple, batch(toks, c, s, offs)[1])) for s in range(1, BUCKET_STEPS + 1)}
    assert len(seen) == BUCKET_STEPS


def test_bucket_needs_lines_and_is_recorded(tmp_path):
    with pytest.raises(dclens.Error, match="--bucket .* needs --lines"):
        TrainConfig(out=str(tmp_path / "x"), bucket=True).check()
    with pytest.raises(dclens.Error, match="bucket must be True or False"):
        TrainConfig(out=str(tmp_path / "x"), lines=True, bucket=1).check()
    recs = ['{"task_id": "t", "texts": "\\nred is [ a colour]\\n%s\\n"}' % ("x " * (i % 9)) for i in range(30)]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(recs) + "\n")
    kw = dict(
        model_type="gpt_neox", n_layer=1, dim=16, n_head=2, seq_len=32, batch_size=4, steps=6, warmup=2,
        data=str(p), tokenizer="bytes", lines=True, ckpt_every=3, log_every=3, progress=False,
    )  # fmt: skip
    once = train(TrainConfig(out=str(tmp_path / "a"), bucket=True, **kw))
    assert json.loads((tmp_path / "a" / "run.json").read_text())["options"]["bucket"] is True
    train(TrainConfig(out=str(tmp_path / "b"), bucket=True, **kw), stop_after=3)
    with pytest.raises(dclens.Error, match="--bucket false \\(the run: true\\)"):
        train(TrainConfig(out=str(tmp_path / "b"), bucket=False, **kw))
    split = train(TrainConfig(out=str(tmp_path / "b"), bucket=True, **kw))
    from dclens.train.loop import read_weights

    wa, wb = read_weights(dclens.load(once)), read_weights(dclens.load(split))
    for k in wa:  # resumed: the same batches, the same weights
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)
    # a run recorded before --bucket existed resumes as unbucketed
    rec = json.loads((tmp_path / "b" / "run.json").read_text())
    assert rec["options"].pop("bucket") is True
    c = TrainConfig(out=str(tmp_path / "b"), bucket=False, **dict(kw, steps=7))
    from dclens import run_record

    assert run_record.differences(rec["options"], c)[0] == []
