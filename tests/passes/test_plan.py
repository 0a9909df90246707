"""The layer plan (issue 38): what each layer computes, decided once at load
(dcs_layer_plan) and read by the forward, the backward, the tape's memory
plan and Python (Model.plan, Config, TLConfig)."""

import warnings

import pytest

import dclens

CASES = {
    # name: (make_tiny kwargs, expected plan fields)
    "dcpythia": (
        dict(model_type="dcpythia", window_size=5, seed=21),
        dict(
            norm="layer",
            mlp="gelu",
            parallel_residual=True,
            dcmha=True,
            slots=4,
            slot=((0, 1), (2, 3)),
            groups=1,
            row_compose=True,
            fused=True,
        ),
    ),
    "query_wise": (
        dict(model_type="dcpythia", query_wise=True, seed=31),
        # the generated file keeps all four slots (write_unused_dyn); the key side is unused
        dict(dcmha=True, slots=4, slot=((0, -1), (2, -1)), row_compose=True, fused=True),
    ),
    "key_wise": (
        dict(model_type="dcpythia", key_wise=True, seed=32),
        dict(dcmha=True, slots=4, slot=((-1, 1), (-1, 3)), row_compose=False, fused=False),
    ),
    "groups2-static": (
        dict(model_type="dcpythia", compose_groups=2, use_sw=True, seed=36),
        dict(groups=2, static_branch=True, row_compose=False, fused=False),
    ),
    "moh": (
        dict(model_type="dcpythia", moh={"shared_heads": 1, "routed_topk": 2}, seed=40),
        dict(moh=True, fused=False),
    ),
    "sequential": (dict(model_type="dcpythia", use_parallel_residual=False, seed=46), dict(parallel_residual=False)),
    "dcformer": (
        dict(model_type="dcformer", seed=47),
        dict(norm="rms", mlp="swiglu", parallel_residual=False, dcmha=True, fused=True),
    ),
    "gpt_neox": (
        dict(model_type="gpt_neox", seed=23),
        dict(norm="layer", mlp="gelu", dcmha=False, slots=0, slot=((-1, -1), (-1, -1)), groups=0, fused=True),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_plan_says_what_the_config_says(tiny_factory, name):
    kw, want = CASES[name]
    d, _, _ = tiny_factory(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = dclens.load(d)
    assert len(m.plan) == m.config.n_layer
    for l, p in enumerate(m.plan):
        for k, v in want.items():
            assert getattr(p, k) == v, (name, l, k)
        assert (p.window > 0) == (l in m.config.local_layers)
        assert p.qk_norm == m.config.qk_norm
    assert m.config.norm == m.plan[0].norm and m.config.mlp == m.plan[0].mlp
    # TransformerLens's names follow the plan (DCFormer++ is RMSNorm + SwiGLU, not LN + GELU)
    swiglu = m.plan[0].mlp == "swiglu"
    assert m.cfg.act_fn == ("silu" if swiglu else "gelu") and m.cfg.gated_mlp == swiglu
    assert m.cfg.normalization_type == ("RMS" if m.plan[0].norm == "rms" else "LN")
    assert m.cfg.parallel_attn_mlp == m.plan[0].parallel_residual
