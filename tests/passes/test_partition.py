"""The CPU pool's work partition (cpu.c, exposed as dcs_cpu_partition): 2-D GEMM
tiles and attention query blocks cut by the shape alone, so any n_threads (up to 16
here, oversubscribing this machine's cores) computes the same bits."""

import numpy as np
import pytest

import dclens
from dclens._engine import ffi, lib

from reference import ref_forward
from tolerances import forward_tol, rel_err


def items(op, shape):
    s = ffi.new("int[]", list(shape))
    n = lib.dcs_cpu_partition(op, s, len(shape), ffi.NULL, 0)
    if n < 0:
        return None
    cost = np.zeros(n, np.int64)
    assert lib.dcs_cpu_partition(op, s, len(shape), ffi.cast("int64_t *", cost.ctypes.data), n) == n
    return cost


@pytest.mark.parametrize(
    "M,N,K,batch",
    [
        (512, 3072, 1024, 1),
        (512, 1024, 4096, 1),
        (512, 1024, 1024, 1),
        (1000, 576, 192, 1),
        (1, 50304, 2048, 1),
        (600, 1024, 128, 1),
        (512, 64, 64, 4),
        (7, 5, 3, 2),
        (512, 2048, 8192, 1),
    ],
)
def test_gemm_tiles_cover_the_product(M, N, K, batch):
    """Every output element in exactly one item: the items' work sums to the product's."""
    for op in (lib.DCS_PART_GEMM, lib.DCS_PART_GEMM_W):
        c = items(op, (M, N, K, batch) if op == lib.DCS_PART_GEMM else (M, N, K))
        assert c.sum() == M * N * K * (batch if op == lib.DCS_PART_GEMM else 1)
        assert c.min() > 0


def test_d1024_and_14b_products_give_16_threads_16_equal_items():
    """The issue's shapes (T = 512): one tile per thread at 16 threads, all equal, so the
    dynamic schedule is balanced at 1, 2, 4, 8 and 16 threads."""
    for D, F in ((1024, 4096), (2048, 8192)):
        for N, K in ((3 * D, D), (D, D), (F, D), (D, F)):
            c = items(lib.DCS_PART_GEMM, (512, N, K, 1))
            assert len(c) == 16 and (c == c[0]).all(), (N, K, c)


def test_small_products_still_split_in_two():
    """192..511 rows or columns, below the tile minimums: two halves of >= 96, not one thread
    for all of it (the tiny twins' training products); a tiny product stays whole."""
    assert len(items(lib.DCS_PART_GEMM, (192, 192, 11520, 1))) == 2
    assert len(items(lib.DCS_PART_GEMM, (192, 768, 11520, 1))) == 4
    assert len(items(lib.DCS_PART_GEMM, (100, 100, 100, 1))) == 1


def test_attention_blocks():
    # B = 1, T = 512: 32 blocks of 16 query rows, latest (largest) first
    c = items(lib.DCS_PART_ATTN, (1, 512, 512, 16, 64, 0, 1, 2))
    assert len(c) == 32 and (np.diff(c) < 0).all()
    # the causal sizes pair up: the largest and smallest together equal the 2nd and 2nd smallest
    assert abs((c[0] + c[-1]) - (c[1] + c[-2])) <= 0.01 * c[0]
    assert len(items(lib.DCS_PART_ATTN, (4, 250, 250, 6, 32, 0, 0, 0))) == 32  # blocks of 32 rows
    assert len(items(lib.DCS_PART_ATTN, (1, 512, 512, 16, 64, 0, 1, 2, 32))) == 16  # explicit rows per block


@pytest.mark.parametrize(
    "op,shape",
    [(7, (1, 2, 3, 1)), (0, (1, 2, 3)), (1, (1, 2, 3, 4)), (0, (1, -2, 3, 1)), (2, (1, 2, 3)), (2, (1,) * 10)],
)
def test_bad_partition_queries(op, shape):
    assert items(op, shape) is None


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_thread_counts_same_bits_2d_tiles(tiny_factory, dtype):
    """600 rows (2 x 300): the MLP up product [600, 128] x [128, 1024] is cut into
    304-row x 128-column tiles (both sides cut: gemm_w for float16), the attention
    into 16-row blocks (2 sequences of 300 rows would give only 20 of 32)."""
    d, sd, cfg = tiny_factory(
        model_type="dcpythia", dtype=dtype, dim=128, n_head=4, intermediate=1024, window_size=64, seed=31
    )
    toks = np.random.default_rng(8).integers(0, cfg["vocab_size"], size=(2, 300))
    assert len(items(lib.DCS_PART_GEMM_W, (600, 1024, 128))) == 16
    assert len(items(lib.DCS_PART_ATTN, (2, 300, 300, 4, 32, 0, 1, 2))) == 38
    outs = [dclens.load(d, n_threads=n).forward(toks) for n in (1, 2, 3, 16)]
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])
    assert rel_err(outs[0][1], ref_forward(sd, cfg, toks[1])) <= forward_tol(cfg, 300, outs[0][1].size)
