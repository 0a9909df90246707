/*
 * cpu_gemm_grid.h -- the CPU backend's tiling of a product into pool items
 * (gemm_grid): cpu.c's cpu_gemm and cpu_gemm_w cut products by it, and an
 * operation that issues the same BLAS calls inside its own items
 * (cpu_backward.c, cpu_mha_bw) follows it, so both compute the same bits.
 */
#ifndef DCS_CPU_GEMM_GRID_H
#define DCS_CPU_GEMM_GRID_H

#include "dcs_backend.h" /* dcs_gemm_grid */

/* How cpu_gemm / cpu_gemm_w cut a product into pool items: a function of the
 * shape alone, never of n_threads, so each tile is the same sgemm call (same
 * kernel, same edge handling, same summation order) whatever n_threads is
 * and every thread count computes the same bits. Tiles of tm x tn (multiples
 * of 16 but for the last row / column of tiles): halve a side of the tile
 * until a batch entry has GEMM_ITEMS / batch tiles (one per thread at 16
 * threads), no side below its minimum and no item below GEMM_MIN_WORK. Which
 * side: each tile packs its own copy of its A rows and its B columns, and
 * single-threaded OpenBLAS (Cooperlake kernels, this EPYC) measured a row
 * split about 4x as costly as a column split (512 x 256 tiles -> 512 x 128:
 * +0-4% over the product; -> 256 x 256: +4-6%; -> 128 x 256: +16%;
 * BENCHMARKS.md), so the columns are halved until tm > GEMM_M_COST tn.
 * Tile sides are multiples of 16 (but the last row / column of tiles). */
#define GEMM_ITEMS 16
#define GEMM_MIN_TN 128
#define GEMM_MIN_TM 256
#define GEMM_M_COST 4
#define GEMM_MIN_HALF 96
#define GEMM_MIN_WORK (1LL << 22) /* K (tm tn + 32 (tm + tn)): multiply-adds plus operand reads */

static inline long long tile_work(int tm, int tn, int K) {
    return (long long)K * ((long long)tm * tn + 32LL * (tm + tn));
}

static inline int half16(int side) { return ((side + 1) / 2 + 15) / 16 * 16; }

static inline dcs_gemm_grid gemm_grid(int M, int N, int K, int batch) {
    dcs_gemm_grid g = {M > 0 ? M : 1, N > 0 ? N : 1, 1, 1};
    const int want = batch >= GEMM_ITEMS ? 1 : (GEMM_ITEMS + batch - 1) / (batch > 0 ? batch : 1);
    while (g.gm * g.gn < want) {
        const int hm = half16(g.tm), hn = half16(g.tn);
        const int can_m = hm >= GEMM_MIN_TM && hm < g.tm && tile_work(hm, g.tn, K) >= GEMM_MIN_WORK;
        const int can_n = hn >= GEMM_MIN_TN && hn < g.tn && tile_work(g.tm, hn, K) >= GEMM_MIN_WORK;
        if (can_m && (!can_n || g.tm > GEMM_M_COST * g.tn))
            g.tm = hm, g.gm = (M + hm - 1) / hm;
        else if (can_n)
            g.tn = hn, g.gn = (N + hn - 1) / hn;
        else
            break;
    }
    /* a product too small for those minimums, 192..511 rows or columns: two
     * halves of at least GEMM_MIN_HALF rather than one thread for all of it */
    if (g.gm * g.gn == 1 && want > 1) {
        const int split_m = g.tm >= g.tn, side = split_m ? g.tm : g.tn, h = half16(side);
        if (h >= GEMM_MIN_HALF && h < side &&
            tile_work(split_m ? h : g.tm, split_m ? g.tn : h, K) >= GEMM_MIN_WORK) {
            if (split_m)
                g.tm = h, g.gm = (M + h - 1) / h;
            else
                g.tn = h, g.gn = (N + h - 1) / h;
        }
    }
    return g;
}

#endif
