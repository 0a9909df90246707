"""The backward in stages (dcs_tape_backward_stage, Tape.backward_stage):
what edge attribution runs when every receiver's gradient does not fit in
memory at once. The stages together hand out the bits one backward gives,
with and without recomputation; a stage refuses what it cannot do."""

import warnings

import numpy as np
import pytest

import dclens
from dclens import memplan, tapes

CONFIGS = {
    "dcpythia": dict(model_type="dcpythia", n_layer=3, window_size=5, vocab=24, seed=5),
    "gpt_neox": dict(model_type="gpt_neox", n_layer=3, vocab=24, seed=6),
    "dcformer": dict(model_type="dcformer", n_layer=3, intermediate=64, mgate_dim=4, vocab=24, seed=7),
}


def _load(tiny_factory, name):
    d, _sd, _cfg = tiny_factory(**CONFIGS[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dclens.LoadWarning)
        return dclens.load(d)


def _by_layer(m):
    """Hook names whose gradients the stages hand out, by layer (the top's
    resid_post, every layer's split inputs and one inner point, embed)."""
    L = m.config.n_layer
    out = {l: ["blocks.%d.attn.%s_input" % (l, p) for p in "qkv"] + ["blocks.%d.mlp_input" % l] for l in range(L)}
    out[L - 1].append("blocks.%d.resid_post" % (L - 1))
    out[1].append("blocks.1.attn.pattern")
    out[0].append("embed")
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("budget", ["full", "recompute"])
@pytest.mark.parametrize("stops", [(2, 1, 0), (1, 0), (2, 0)], ids=["a-layer-each", "two-one", "one-two"])
def test_stages_hand_out_one_backwards_bits(tiny_factory, name, budget, stops):
    m = _load(tiny_factory, name)
    by = _by_layer(m)
    toks = np.random.default_rng(3).integers(0, m.config.vocab, (2, 9))
    B, T = toks.shape
    full = memplan.tape_bytes(m, B, T, False, (), 0)
    cap = memplan.check_budget(None, m) if budget == "full" else full - 1
    dl = np.random.default_rng(4).standard_normal((B, T, m.config.vocab)).astype(np.float32)
    everything = [m.parse_hook(n) for l in sorted(by, reverse=True) for n in by[l]]
    with tapes.lease(m, B, T, cap) as tp:
        assert tp.memory_recompute == (budget == "recompute")
        tp.forward(toks)
        whole = tp.backward(dl, None, everything)
        staged, top = {}, m.config.n_layer - 1
        for i, stop in enumerate(stops):
            pts = [m.parse_hook(n) for l in range(stop, top + 1) for n in by[l]]
            staged.update(tp.backward_stage(dl if i == 0 else None, stop, pts))
            top = stop - 1
    assert set(staged) == set(whole)
    for p in whole:
        np.testing.assert_array_equal(staged[p], whole[p], err_msg=str(p))


def test_a_stage_refuses_what_it_cannot_do(tiny_factory):
    m = _load(tiny_factory, "dcpythia")
    toks = np.random.default_rng(3).integers(0, m.config.vocab, (1, 7))
    dl = np.ones((1, 7, m.config.vocab), np.float32)
    q = lambda l: m.parse_hook("blocks.%d.attn.q_input" % l)  # noqa: E731
    with tapes.lease(m, 1, 7, memplan.check_budget(None, m)) as tp:
        tp.forward(toks)
        with pytest.raises(dclens.Error, match="nothing to resume"):
            tp.backward_stage(None, 1)
        with pytest.raises(dclens.Error, match="stop layer 3 outside 0..2"):
            tp.backward_stage(dl, 3)
        with pytest.raises(dclens.Error, match="gradient request 0 is of layer 0, outside this stage"):
            tp.backward_stage(dl, 1, [q(0)])
        with pytest.raises(dclens.Error, match="nothing to resume"):  # a failed stage is not resumed
            tp.backward_stage(None, 0)
        tp.backward_stage(dl, 2, [q(2)])
        with pytest.raises(dclens.Error, match="gradient request 0 is of layer 2, outside this stage"):
            tp.backward_stage(None, 0, [q(2)])  # above where the last stopped
        tp.backward_stage(dl, 2, [q(2)])
        with pytest.raises(dclens.Error, match="stop layer 2 outside 0..1"):
            tp.backward_stage(None, 2)
        tp.backward_stage(None, 0, [q(0)])
        with pytest.raises(dclens.Error, match="nothing to resume"):  # it reached layer 0
            tp.backward_stage(None, 0)
        tp.backward_stage(dl, 2)
        tp.forward(toks)  # a forward ends the staged backward
        with pytest.raises(dclens.Error, match="nothing to resume"):
            tp.backward_stage(None, 0)
        tp.backward_stage(dl, 2)
        tp.backward(dl)  # and so does a whole one
        with pytest.raises(dclens.Error, match="nothing to resume"):
            tp.backward_stage(None, 0)
