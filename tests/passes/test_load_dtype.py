"""load(..., dtype=): the type the weight matrices are kept in (issue 39).

The rounding is checked against numpy's (float16: astype; bfloat16: round to
nearest even on the bits, written here from IEEE 754, not from the engine), the
logits against the float64 reference run on the rounded weights, and every
refusal by its message.
"""

import json
import os
import pickle

import numpy as np
import pytest

import dclens
from dclens.testing.checkpoint import write_safetensors
from dclens.testing.make_tiny import make_tiny

from conftest import rel_err
from reference import ref_forward
from tolerances import forward_tol

# the matrices dtype= applies to (dclens.h, dcs_load_options.dtype); every other tensor stays float32
LARGE = (
    "wqkv.weight",
    "wo.weight",
    "w1.weight",
    "w2.weight",
    "dyn_w_proj.dw1",
    "output.weight",
    "tok_embeddings.weight",
)


def is_large(name):
    return name.endswith(LARGE)


def bf16_round(a):
    """float32 -> bfloat16 -> float32, round to nearest even (NaN-free input)."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


ROUND = {"float16": lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float32), "bfloat16": bf16_round}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        assert v["dtype"] == "F32"
        b, e = v["data_offsets"]
        out[k] = np.frombuffer(data[b:e], "<f4").reshape(v["shape"]).copy()
    return out


@pytest.fixture(scope="module")
def f32_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("f32"))
    make_tiny(d, dim=64, n_head=4, vocab=96, n_layer=2, seed=11)
    return d


def test_bf16_round_reference_is_right():
    # the test's own rounding: ties to even, carries into the exponent
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, -2.5, 1 + 255 / 256, 3.4e38], np.float32)
    want = np.array([1.0, 1.0, 1 + 4 * 2**-8, 1.0, -2.5, 2.0, np.inf], np.float32)
    np.testing.assert_array_equal(bf16_round(x), want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float32_file_rounded_like_numpy(f32_dir, dtype):
    m32 = dclens.load(f32_dir)
    m = dclens.load(f32_dir, dtype=dtype)
    assert m32.dtype == "float32" and m.dtype == dtype
    n_large = 0
    for name in m.weight_names():
        w, w32 = m.weight(name), m32.weight(name)
        if is_large(name):
            n_large += 1
            np.testing.assert_array_equal(w, ROUND[dtype](w32), err_msg=name)
            assert not np.array_equal(w, w32), name  # it was rounded
        else:
            np.testing.assert_array_equal(w, w32, err_msg=name)
    assert n_large == 5 * 2 + 2  # (wqkv, wo, w1, w2, dw1) x 2 layers, embedding, unembedding


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_logits_match_reference_on_rounded_weights(f32_dir, tmp_path, dtype):
    sd = read_safetensors(os.path.join(f32_dir, "model.safetensors"))
    rounded = {k: (ROUND[dtype](v) if is_large(k) else v) for k, v in sd.items()}
    with open(os.path.join(f32_dir, "config.json")) as f:
        cfg = json.load(f)
    toks = (np.arange(40) * 7) % cfg["vocab_size"]
    ref = ref_forward(rounded, cfg, toks)
    got = dclens.load(f32_dir, dtype=dtype).forward(toks)
    tol = forward_tol(cfg, len(toks), len(toks) * cfg["vocab_size"])
    assert rel_err(got, ref) <= tol
    # and the same model from a float32 file holding the rounded values, through the float32 products
    write_safetensors(str(tmp_path / "model.safetensors"), {k: ("F32", v.shape, v) for k, v in rounded.items()})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert rel_err(got, dclens.load(str(tmp_path)).forward(toks)) <= tol


@pytest.mark.parametrize("stored", ["float16", "bfloat16"])
def test_16bit_file_widened_is_exact(tmp_path, stored):
    make_tiny(str(tmp_path), dtype=stored, dim=64, n_head=4, vocab=96, seed=3)
    toks = np.arange(30) % 96
    kept = dclens.load(str(tmp_path))
    wide = dclens.load(str(tmp_path), dtype="float32")
    same = dclens.load(str(tmp_path), dtype=stored)
    assert (kept.dtype, wide.dtype, same.dtype) == (stored, "float32", stored)
    for name in kept.weight_names():
        np.testing.assert_array_equal(kept.weight(name), wide.weight(name), err_msg=name)
    lk = kept.forward(toks)
    assert rel_err(wide.forward(toks), lk) <= 1e-5
    np.testing.assert_array_equal(same.forward(toks), lk)


@pytest.mark.parametrize(("stored", "asked"), [("float16", "bfloat16"), ("bfloat16", "float16")])
def test_other_16bit_type_is_refused(tmp_path, stored, asked):
    make_tiny(str(tmp_path), dtype=stored, dim=32, n_head=4, vocab=64)
    with pytest.raises(dclens.ArgumentError) as e:
        dclens.load(str(tmp_path), dtype=asked)
    msg = str(e.value)
    assert "dtype='%s'" % asked in msg and "stores" in msg and "model.safetensors" in msg
    assert "dtype='auto' (%s, as stored) or 'float32'" % stored in msg
    assert dclens.load(str(tmp_path)).dtype == stored  # nothing left behind


def test_float16_overflow_is_refused(tmp_path):
    make_tiny(str(tmp_path), dim=32, n_head=4, vocab=64, weight_scale=1e6)
    with pytest.raises(dclens.ArgumentError) as e:
        dclens.load(str(tmp_path), dtype="float16")
    msg = str(e.value)
    assert "past float16's range" in msg and "dtype='bfloat16' or 'float32'" in msg
    assert dclens.load(str(tmp_path), dtype="bfloat16").dtype == "bfloat16"


@pytest.mark.parametrize("bad", ["half", "fp16", "float64", "", None, 16, True, np.int32, np.float64, object()])
def test_bad_dtype_argument(f32_dir, bad):
    with pytest.raises(dclens.ArgumentError, match="dtype must be 'auto', 'float32', 'float16' or 'bfloat16'"):
        dclens.load(f32_dir, dtype=bad)


def test_numpy_dtypes_accepted(f32_dir):
    assert dclens.load(f32_dir, dtype=np.float16).dtype == "float16"
    assert dclens.load(f32_dir, dtype=np.dtype("float32")).dtype == "float32"


def test_dtype_survives_pickling(f32_dir):
    m = dclens.load(f32_dir, dtype="bfloat16")
    m2 = pickle.loads(pickle.dumps(m))
    assert m2.dtype == "bfloat16"
    toks = np.arange(12)
    np.testing.assert_array_equal(m2.forward(toks), m.forward(toks))


def test_gradients_of_a_rounded_model(f32_dir):
    """Gradients run through the 16-bit products (as for a 16-bit file): those of a
    float32 file holding the rounded values, to float32 rounding."""
    m16 = dclens.load(f32_dir, dtype="float16")
    m32 = dclens.load(f32_dir)
    toks = np.arange(16) % 96
    wrt = ["blocks.0.resid_pre", "layers.1.attention.wo.weight"]
    g16 = m16.gradients(toks, ("logit", 15, 3), wrt)
    g32 = m32.gradients(toks, ("logit", 15, 3), wrt)
    for k in wrt:
        assert g16[k].dtype == np.float32 and np.isfinite(g16[k]).all()
        assert 0 < rel_err(g16[k], g32[k]) < 0.05, k  # the rounding moves them, a little
