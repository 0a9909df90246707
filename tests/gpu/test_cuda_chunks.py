"""Attention by query chunks on CUDA (Model.attention_rows; issue 39): the path a
CUDA pass takes where no map is hooked or kept once the [B, N, T, S] map is over
64 MiB, which bounds attention's device memory at long T. Each chunk runs the full
path's CUDA kernels (scores, compose, masked softmax, P v) on a block of query
rows and the keys they see, so the CUDA results agree with the CUDA full path and
with the CPU to test_cuda.py's tolerance, in float32 and (with the 16-bit
products) within the 16-bit tolerance of test_cuda_16bit.py. Skipped without a GPU.
"""

import warnings

import numpy as np
import pytest

import dclens

from conftest import rel_err
from tolerances import forward_tol, tiny

HAVE_GPU = dclens.cuda_available()
needs_gpu = pytest.mark.skipif(
    not HAVE_GPU, reason="no GPU: %s" % ("" if HAVE_GPU else dclens.cuda_unavailable_reason())
)

TOL = forward_tol(tiny(dim=256, n_layer=4, vocab_size=1000), 64, 8 * 64 * 1000, sides=2)
TOL16 = {"float16": 2e-2, "bfloat16": 1e-1}
KW = dict(model_type="dcpythia", n_layer=4, dim=256, n_head=8, vocab=1000, window_type="LGLL", window_size=16)
VARIANTS = {
    "dcpythia": dict(seed=61),
    "static-groups2": dict(use_sw=True, compose_groups=2, seed=62),
    "key_wise": dict(key_wise=True, seed=63),
    "gpt_neox": dict(model_type="gpt_neox", seed=64),
}


def _load(d, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dclens.LoadWarning)
        return dclens.load(d, **kw)


@needs_gpu
@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_cuda_chunks_match_full_path_and_cpu(tiny_factory, name, rows):
    d, _, _ = tiny_factory(**dict(KW, **VARIANTS[name]))
    toks = np.random.default_rng(6).integers(0, 1000, size=(2, 61))
    cpu = _load(d).forward(toks)
    gpu = _load(d, device="cuda")
    gpu.attention_rows = -1
    full = gpu.forward(toks)
    gpu.attention_rows = rows
    chunked = gpu.forward(toks)
    assert rel_err(chunked, full) <= TOL
    assert rel_err(chunked, cpu) <= TOL
    # the decoder: prefill and steps against the cache, by chunks
    gpu.attention_rows = 5
    got = gpu.generate(toks[0, :30], max_new_tokens=8, temperature=0.0)
    np.testing.assert_array_equal(got, _load(d).generate(toks[0, :30], max_new_tokens=8, temperature=0.0))


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_16bit_chunks(tiny_factory, dtype):
    d, _, _ = tiny_factory(**dict(KW, seed=65, dtype=dtype))
    toks = np.random.default_rng(7).integers(0, 1000, size=(2, 61))
    gpu = _load(d, device="cuda", dtype=dtype)
    gpu.attention_rows = -1
    full = gpu.forward(toks)
    gpu.attention_rows = 9
    assert rel_err(gpu.forward(toks), full) <= TOL16[dtype]
    assert rel_err(gpu.forward(toks), _load(d, dtype=dtype).forward(toks)) <= TOL16[dtype]


@needs_gpu
def test_cuda_auto_chunks_long_inputs(tiny_factory):
    """auto on CUDA: a map over 64 MiB runs by chunks (device memory of one
    chunk), the same logits as the full path."""
    d, _, _ = tiny_factory(**dict(KW, seed=66))
    gpu = _load(d, device="cuda")
    N, T = gpu.config.n_head, 1600
    map_bytes = N * T * T * 4
    assert map_bytes > 64 << 20
    toks = np.random.default_rng(8).integers(0, 1000, size=T)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dclens.ContextWarning)
        auto = gpu.forward(toks)
        chunked_peak = gpu.last_pass_memory()["peak"]
        gpu.attention_rows = -1
        full = gpu.forward(toks)
        full_peak = gpu.last_pass_memory()["peak"]
    assert map_bytes <= full_peak and chunked_peak <= full_peak - map_bytes + (64 << 20)
    assert rel_err(auto, full) <= forward_tol(tiny(dim=256, n_layer=4), T, 3 * T * 1000, sides=2)
