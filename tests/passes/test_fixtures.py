"""The fixture writer (dclens.testing): the C tests' checkpoints load and
agree, and make_tiny's state dicts follow the layout table."""

import json
import os

import numpy as np
import pytest

import dclens
from dclens.testing import fixtures, layouts
from dclens.testing.make_tiny import make_tiny


def test_c_fixtures_load_and_agree(tmp_path):
    names = fixtures.write_fixtures(str(tmp_path))
    toks = np.array([3, 17, 42, 0, 49, 8, 25])
    ref = dclens.load(tmp_path / "dcpythia").forward(toks)
    for n in ("dcpythia_unfused", "dcpythia_unaligned"):
        np.testing.assert_array_equal(dclens.load(tmp_path / n).forward(toks), ref, err_msg=n)
    assert np.isfinite(dclens.load(tmp_path / "dcpythia_bf16").forward(toks)).all()
    m = dclens.load(tmp_path / "neox")
    assert m.config.model_type == "gpt_neox" and m.config.n_layer == 2
    # the values are test_engine.c's value(name, i): norm weights near 1, the rest in [-0.4, 0.4)
    assert np.all(np.abs(fixtures.value("norm.weight", 0, 16) - 1) <= 0.1)
    assert np.abs(fixtures.value("x", 0, 1000)).max() < 0.4
    assert not np.array_equal(fixtures.value("x", 0, 8), fixtures.value("y", 0, 8))
    assert sorted(os.listdir(tmp_path)) == sorted(names)
    index = json.loads((tmp_path / "loaders" / "torch2" / "pytorch_model.bin.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2


@pytest.mark.parametrize(
    "kw",
    [
        dict(model_type="dcpythia", fused_qkv=False, use_linear_bias=False, extra_derived=True),
        dict(model_type="dcpythia", use_sw=True, compose_groups=2, moh={"shared_heads": 1, "routed_topk": 2}),
        dict(
            model_type="dcpythia", use_dcmha=False, write_unused_dyn=False, use_qk_norm=False, tie_word_embeddings=True
        ),
        dict(model_type="gpt_neox", extra_derived=True, tie_word_embeddings=True),
    ],
)
def test_make_tiny_follows_the_layout_table(tmp_path, kw):
    sd, cfg = make_tiny(str(tmp_path), **kw)
    dims = dict(n_layer=2, dim=32, n_head=4, vocab=64, intermediate=128)
    if kw["model_type"] == "gpt_neox":
        want = layouts.gpt_neox_tensors(**dims, extra_derived=True, tie_word_embeddings=True)
    else:
        want = layouts.dcpythia_tensors(
            **dims,
            fused_qkv=kw.get("fused_qkv", True),
            use_qk_norm=kw.get("use_qk_norm", True),
            use_linear_bias=kw.get("use_linear_bias", True),
            dyn=kw.get("use_dcmha", True) or kw.get("write_unused_dyn", True),
            compose_groups=kw.get("compose_groups", 1),
            use_sw=kw.get("use_sw", False),
            moh=kw.get("moh"),
            tie_word_embeddings=kw.get("tie_word_embeddings", False),
            extra_derived=kw.get("extra_derived", False),
        )
    assert [(n, a.shape) for n, a in sd.items()] == list(want.items())
