"""Engine logits against the independent numpy reference (tests/reference.py).

Tolerance: max |dlogit| <= forward_tol(cfg, T, T * V) * max |logit| (tests/tolerances.py:
the float32 rounding of a pass of the checkpoint's depth, longest reduction
max(D, F, T), largest of T * V errors; the reference is float64). For these
sizes it is below the 1e-4 the parity issue asked for (TOL, also asserted).
"""

import numpy as np
import pytest

import dclens

from conftest import rel_err
from reference import ref_forward
from tolerances import forward_tol

TOL = 1e-4

CONFIGS = {
    # name: make_tiny kwargs
    "dcp-f32-st": dict(model_type="dcpythia", dtype="float32", fmt="safetensors"),
    "dcp-f16-torch": dict(model_type="dcpythia", dtype="float16", fmt="torch"),
    "dcp-bf16-st-sharded": dict(model_type="dcpythia", dtype="bfloat16", fmt="safetensors", shards=3),
    "dcp-f16-torch-sharded-unfused": dict(
        model_type="dcpythia", dtype="float16", fmt="torch", shards=2, fused_qkv=False
    ),
    "dcp-query-wise": dict(model_type="dcpythia", query_wise=True, seed=3),
    "dcp-lgll-window4": dict(model_type="dcpythia", n_layer=4, window_type="LGLL", window_size=4, seed=4),
    "dcp-lgl6": dict(model_type="dcpythia", n_layer=3, window_type="LGL6", window_size=3, seed=9),
    "dcp-serial-nobias": dict(model_type="dcpythia", use_parallel_residual=False, use_linear_bias=False, seed=5),
    "dcp-no-dcmha": dict(model_type="dcpythia", use_dcmha=False, seed=6),
    "dcp-no-qknorm-tied": dict(model_type="dcpythia", use_qk_norm=False, tie_word_embeddings=True, seed=7),
    "dcp-derived": dict(model_type="dcpythia", extra_derived=True, seed=8),
    "neox-f32-st": dict(model_type="gpt_neox", dtype="float32", fmt="safetensors"),
    "neox-f16-torch": dict(model_type="gpt_neox", dtype="float16", fmt="torch", shards=2, extra_derived=True),
    "neox-bf16-serial": dict(model_type="gpt_neox", dtype="bfloat16", use_parallel_residual=False, seed=2),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_reference(tiny_factory, name):
    d, sd, cfg = tiny_factory(**CONFIGS[name])
    model = dclens.load(d)
    rng = np.random.default_rng(0)
    V = model.config.vocab
    T = 3 * max(model.config.window_size, 8) + 5  # several times the window
    toks = rng.integers(0, V, size=T)
    got = model.forward(toks)
    want = ref_forward(sd, cfg, toks)
    assert got.shape == (T, V) and got.dtype == np.float32
    tol = forward_tol(cfg, T, got.size)
    assert tol <= TOL and rel_err(got, want) <= tol


def test_batch_of_different_sequences(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="dcpythia", window_size=4, seed=11)
    model = dclens.load(d)
    rng = np.random.default_rng(1)
    toks = rng.integers(0, model.config.vocab, size=(3, 17))
    got = model.forward(toks)
    assert got.shape == (3, 17, model.config.vocab)
    for b in range(3):
        assert rel_err(got[b], ref_forward(sd, cfg, toks[b])) <= forward_tol(cfg, 17, got[b].size)
    # batch rows are independent: each equals its own unbatched pass, up to the
    # summation order of GEMMs with 3x the rows (both sides float32)
    np.testing.assert_allclose(
        got[1], model.forward(toks[1]), rtol=0, atol=forward_tol(cfg, 17, got.size, sides=2) * np.abs(got).max()
    )


def test_right_padding_does_not_change_prefix(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="dcpythia", window_size=4, seed=11)
    model = dclens.load(d)
    toks = np.arange(12) % model.config.vocab
    padded = np.stack([toks, np.concatenate([toks[:7], np.zeros(5, int)])])
    out = model.forward(padded)
    # causal: the prefix sees the same tokens; only GEMM blocking may differ (two sides)
    assert rel_err(out[1, :7], out[0, :7]) <= forward_tol(cfg, 12, out.size, sides=2)


def test_config_fields(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="dcpythia", n_layer=4, window_type="LGLL", window_size=4, seed=4)
    c = dclens.load(d).config
    assert c.model_type == "dcpythia" and c.n_layer == 4 and c.use_dcmha
    assert c.local_layers == (0, 2, 3)
    assert c.head_dim == c.d_model // c.n_head and c.dyn_rank == 2
    assert c["vocab"] == c.vocab


def test_long_batch_uses_threaded_kernels(tiny_factory):
    """Big enough (B*T rows x T keys) that compose, softmax and GELU split
    their rows over the cores in the CPU backend."""
    d, sd, cfg = tiny_factory(model_type="dcpythia", window_size=16, seed=12, intermediate=2048)
    model = dclens.load(d)
    toks = np.random.default_rng(5).integers(0, model.config.vocab, size=(2, 300))
    got = model.forward(toks)
    for b in range(2):
        assert rel_err(got[b], ref_forward(sd, cfg, toks[b])) <= TOL


def test_tied_checkpoint_with_stored_output_copy(tiny_factory, tmp_path):
    """torch .bin files of tied models still carry output.weight: it is ignored."""
    import shutil

    from safetensors.numpy import load_file, save_file

    d, sd, cfg = tiny_factory(model_type="dcpythia", tie_word_embeddings=True, seed=13)
    dst = tmp_path / "tied"
    shutil.copytree(d, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    assert "output.weight" not in tensors
    tensors["output.weight"] = np.full_like(tensors["tok_embeddings.weight"], 7.0)
    save_file(tensors, str(dst / "model.safetensors"))
    toks = np.arange(20) % cfg["vocab_size"]
    assert rel_err(dclens.load(str(dst)).forward(toks), ref_forward(sd, cfg, toks)) <= TOL
