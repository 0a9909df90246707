"""Integrated gradients: completeness (attributions sum to F(a) - F(a0)) and the
agreement of gradient x activation with the engine's gradients."""

import numpy as np
import pytest

import dclens

from tolerances import f32_tol, forward_depth

# gradients: a forward and a backward pass, so twice the forward's depth; D 32,
# F 128, T <= 8; two passes (batched vs one by one) on both sides
GRAD_TOL = f32_tol(128, 2 * forward_depth(2), 2 * 8 * 24, sides=2)


@pytest.mark.parametrize("mt", ["dcpythia", "gpt_neox"])
def test_ig_completeness(tiny_factory, mt):
    d, sd, cfg = tiny_factory(model_type=mt, vocab=24)
    m = dclens.load(d)
    toks = np.arange(9) % 24
    at = ["blocks.1.attn.head_out", "blocks.1.attn.v", "blocks.1.attn.pattern", "blocks.0.mlp.post"]
    if mt == "dcpythia":
        at += ["blocks.0.attn.post.kp", "blocks.0.attn.dyn.pre.qw2", "blocks.1.attn.scores"]
    target = ("logit_diff", -1, 3, 5)
    r = m.attribute(toks, target, at, steps=64, baseline="zero", progress=False)
    for n in at:
        diff = r.target_value - r.baseline_value[n]
        assert r.attributions[n].shape == m.run_with_cache(toks, [n])[1][n].shape
        # midpoint rule: the gap falls as 1/steps^2; 64 steps leave < 1% here
        assert abs(r.gap[n]) <= 1e-2 * max(abs(diff), 1e-2), (n, r.gap[n], diff)
    # per-head sums of head_out add up to the total attribution
    ph = r.per_head["blocks.1.attn.head_out"]
    assert ph.shape == (m.config.n_head,)
    a = r.attributions["blocks.1.attn.head_out"]
    # the same float32 values summed in two groupings: a reduction of a.size terms
    assert abs(ph.sum() - a.sum()) <= f32_tol(a.size, 1, 1, sides=2) * np.abs(a).sum()
    # more steps -> smaller gap
    r8 = m.attribute(toks, target, at[:1], steps=4, progress=False)
    assert abs(r.gap[at[0]]) < abs(r8.gap[at[0]])


def test_ig_batched_and_mean_baseline(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="dcpythia", vocab=24)
    m = dclens.load(d)
    toks = np.stack([np.arange(8) % 24, (np.arange(8) * 5) % 24])
    at = ["blocks.0.attn.head_out"]
    rb = m.attribute(toks, ("logprob", -1, 2), at, steps=8, baseline="mean", progress=False)
    for b in range(2):
        r1 = m.attribute(toks[b], ("logprob", -1, 2), at, steps=8, baseline="mean", progress=False)
        a1 = r1.attributions[at[0]]
        np.testing.assert_allclose(rb.attributions[at[0]][b], a1, rtol=0, atol=GRAD_TOL * np.abs(a1).max())
        # gap = target - baseline - sum(attributions): each term carries GRAD_TOL
        assert abs(rb.gap[at[0]][b] - r1.gap[at[0]]) < 3 * GRAD_TOL * max(1.0, np.abs(a1).sum(), abs(r1.target_value))


def test_grad_x_act(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="gpt_neox", vocab=24)
    m = dclens.load(d)
    toks = np.arange(7)
    n = "blocks.1.attn.z"
    r = m.attribute(toks, ("logit", 3, 4), [n], method="grad_x_act")
    g = m.gradients(toks, ("logit", 3, 4), [n])[n]
    a = m.run_with_cache(toks, [n])[1][n]
    # grad_x_act runs its own forward + backward: two passes
    np.testing.assert_allclose(r.attributions[n], a * g, rtol=0, atol=GRAD_TOL * np.abs(a * g).max())
    assert r.per_head[n].shape == (m.config.n_head,)
    with pytest.raises(dclens.Error, match="method"):
        m.attribute(toks, ("logit", 3, 4), [n], method="lrp")
    with pytest.raises(dclens.Error, match="steps"):
        m.attribute(toks, ("logit", 3, 4), [n], steps=0)
    with pytest.raises(dclens.Error, match="blocks.7.attn.z"):
        m.attribute(toks, ("logit", 3, 4), ["blocks.7.attn.z"])
