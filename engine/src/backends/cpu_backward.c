/*
 * cpu_backward.c -- the CPU backend's backward operations (dcs_backend.h,
 * "backward"): host loops over the per-element math of dcs_math.h, the row-
 * independent ones on the backend's pool (ops->parallel), the reductions
 * across rows in row order on the calling thread (deterministic). The same
 * arithmetic, in the same order, as the tape ran before it moved onto the
 * backend interface, so CPU gradients are unchanged bit for bit.
 */
/* The row loops below are written to vectorise along s; gcc does that
 * from -O3 (or -ftree-vectorize), the build uses -O2. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("tree-vectorize")
#endif

#include "cpu_backward.h"
#include "cpu_gemm_grid.h"
#include "cpu_vec.h"
#include "dcs_math.h"

#include "dcs_blas.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

static void par(dcs_backend *be, dcs_par_fn fn, void *arg, long long n, long long cost) {
    be->ops->parallel(be, fn, arg, n, cost);
}

/* ---------------------------------------------------------------- element-wise */

typedef struct {
    float *x;
    const float *y, *z;
    int T, S, window;
} ew_arg;

/* dx [n] = dy * gelu'(x), in the per-ISA clones */
DCS_VEC static void gelu_bw_span(float *dx, const float *dy, const float *x, long long n) {
    for (long long i = 0; i < n; i++) dx[i] = dy[i] * dcs_gelu_grad(x[i]);
}
static void gelu_bw_range(void *p, long long b, long long e, int tid) {
    (void)tid;
    const ew_arg *a = p;
    gelu_bw_span(a->x + b, a->y + b, a->z + b, e - b);
}

void cpu_gelu_bw(dcs_backend *be, float *dx, const float *dy, const float *x, size_t n) {
    ew_arg a = {dx, dy, x, 0, 0, 0};
    par(be, gelu_bw_range, &a, (long long)n, 16);
}

/* dx [M, N] = dy * gelu'(x) (or dy * x, x_is_grad), and db [N] += its
 * column sums (ops->gelu_bw_sum): blocks of GBW_COLS columns on the pool, each block's rows in
 * order, its sums in registers (gelu_bw's and col_sum's bits, one pass). */
#define GBW_COLS 32
typedef struct {
    float *dx, *db;
    const float *dy, *x;
    int M, N, x_is_grad;
} gbw_arg;
/* one row's nw columns: d = dy * gelu'(x), or dy * x where x holds gelu'(x) */
DCS_HD_ROW void gelu_bw_cols(float *d, const float *dy, const float *x, int nw, int x_is_grad) {
    if (x_is_grad)
        for (int o = 0; o < nw; o++) d[o] = dy[o] * x[o];
    else
        for (int o = 0; o < nw; o++) d[o] = dy[o] * dcs_gelu_grad(x[o]);
}
DCS_VEC static void gelu_bw_block(const gbw_arg *a, int n0, int nw) {
    float s[GBW_COLS];
    for (int o = 0; o < nw && a->db; o++) s[o] = a->db[n0 + o];
    for (int m = 0; m < a->M; m++) {
        const size_t r = (size_t)m * a->N + n0;
        float *dx = a->dx + r;
        if (nw == GBW_COLS) /* a whole block: fixed-width loops */
            gelu_bw_cols(dx, a->dy + r, a->x + r, GBW_COLS, a->x_is_grad);
        else
            gelu_bw_cols(dx, a->dy + r, a->x + r, nw, a->x_is_grad);
        if (!a->db) continue;
        if (nw == GBW_COLS)
            for (int o = 0; o < GBW_COLS; o++) s[o] += dx[o];
        else
            for (int o = 0; o < nw; o++) s[o] += dx[o];
    }
    for (int o = 0; o < nw && a->db; o++) a->db[n0 + o] = s[o];
}
static void gelu_bw_blocks(void *p, long long b, long long e, int tid) {
    (void)tid;
    const gbw_arg *a = p;
    for (long long k = b; k < e; k++) {
        const int n0 = (int)k * GBW_COLS, nw = a->N - n0 < GBW_COLS ? a->N - n0 : GBW_COLS;
        gelu_bw_block(a, n0, nw);
    }
}
void cpu_gelu_bw_sum(dcs_backend *be, float *dx, float *db, const float *dy, const float *x, int M, int N,
                     int x_is_grad) {
    gbw_arg a = {dx, db, dy, x, M, N, x_is_grad};
    par(be, gelu_bw_blocks, &a, (N + GBW_COLS - 1) / GBW_COLS, 18LL * GBW_COLS * M);
}

void cpu_tanh_bw(dcs_backend *be, float *dx, const float *y, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) dx[i] *= 1.0f - y[i] * y[i];
}

/* the masked softmax backward of one row (dcs_softmax_row_bw_lanes), in
 * the per-ISA clones; the fused compose backward runs the same */
DCS_VEC static void softmax_bw_row(float *d, const float *g, const float *p, int S, int t, int window) {
    dcs_softmax_row_bw_lanes(d, g, p, S, t, window);
}

static void softmax_bw_rows(void *p, long long b, long long e, int tid) {
    (void)tid;
    const ew_arg *a = p;
    for (long long r = b; r < e; r++) {
        const size_t o = (size_t)r * a->S;
        softmax_bw_row(a->x + o, a->y + o, a->z + o, a->S, (int)(r % a->T), a->window);
    }
}

void cpu_softmax_bw(dcs_backend *be, float *dA, const float *dP, const float *P, int BN, int T, int S,
                    int window) {
    ew_arg a = {dA, dP, P, T, S, window};
    par(be, softmax_bw_rows, &a, (long long)BN * T, (long long)S * 4);
}

void cpu_softmax_rows_bw(dcs_backend *be, float *dg, const float *g, int M, int E) {
    (void)be;
    for (int i = 0; i < M; i++) dcs_softmax_row_bw_inplace(dg + (size_t)i * E, g + (size_t)i * E, E);
}

/* ---------------------------------------------------------------- norms */

/* LayerNorm backward in two passes on the pool: rows (statistics recomputed,
 * dx), then column blocks of dw, db, each element summed over rows in row
 * order (the same bits at any thread count, and as one thread's loop). */
typedef struct {
    float *dx, *dw, *db, *mu, *rs;
    const float *dy, *x, *w;
    int M, D;
    float eps;
} lnbw_arg;
#define LNBW_COLS 16
DCS_VEC static void lnbw_span(const lnbw_arg *a, long long b, long long e) {
    const int D = a->D;
    for (long long m = b; m < e; m += DCS_LN_ROWS) { /* rows side by side: the same bits */
        const int n = e - m < DCS_LN_ROWS ? (int)(e - m) : DCS_LN_ROWS;
        const size_t o = (size_t)m * D;
        double mud[DCS_LN_ROWS];
        dcs_layernorm_stats_rows(a->x + o, D, n, a->eps, mud, a->rs + m);
        for (int j = 0; j < n; j++) a->mu[m + j] = (float)mud[j];
        dcs_layernorm_rows_bw(a->dx + o, a->dy + o, a->x + o, a->w, a->mu + m, a->rs + m, D, n);
    }
}
static void lnbw_rows(void *p, long long b, long long e, int tid) {
    (void)tid;
    lnbw_span(p, b, e);
}
/* dw, db [i0, i0 + LNBW_COLS) (a whole block), the sums in registers */
DCS_VEC static void lnbw_block(const lnbw_arg *a, int i0) {
    const int D = a->D;
    float sw[LNBW_COLS], sb[LNBW_COLS];
    for (int i = 0; i < LNBW_COLS; i++)
        sw[i] = a->dw ? a->dw[i0 + i] : 0.0f, sb[i] = a->db ? a->db[i0 + i] : 0.0f;
    for (int m = 0; m < a->M; m++) {
        const float *xr = a->x + (size_t)m * D + i0, *g = a->dy + (size_t)m * D + i0;
        const float mu = a->mu[m], rs = a->rs[m];
        for (int i = 0; i < LNBW_COLS; i++) sw[i] += g[i] * ((xr[i] - mu) * rs);
        for (int i = 0; i < LNBW_COLS; i++) sb[i] += g[i];
    }
    for (int i = 0; i < LNBW_COLS; i++) {
        if (a->dw) a->dw[i0 + i] = sw[i];
        if (a->db) a->db[i0 + i] = sb[i];
    }
}
static void lnbw_cols(void *p, long long b, long long e, int tid) {
    (void)tid;
    const lnbw_arg *a = p;
    const int D = a->D, i0 = (int)b * LNBW_COLS, i1 = (int)e * LNBW_COLS < D ? (int)e * LNBW_COLS : D;
    int f = i0; /* whole blocks in registers, a last partial one in place (the same sums) */
    for (; f + LNBW_COLS <= i1; f += LNBW_COLS) lnbw_block(a, f);
    for (int m = 0; m < a->M && f < i1; m++) {
        const float *xr = a->x + (size_t)m * D, *g = a->dy + (size_t)m * D;
        const float mu = a->mu[m], rs = a->rs[m];
        if (a->dw)
            for (int i = f; i < i1; i++) a->dw[i] += g[i] * ((xr[i] - mu) * rs);
        if (a->db)
            for (int i = f; i < i1; i++) a->db[i] += g[i];
    }
}

void cpu_layernorm_bw(dcs_backend *be, float *dx, float *dw, float *db, const float *dy, const float *x,
                      const float *w, int M, int D, float eps) {
    float *st = malloc(sizeof(float) * 2 * (size_t)(M > 0 ? M : 1));
    lnbw_arg a = {dx, dw, db, st, st ? st + M : NULL, dy, x, w, M, D, eps};
    if (!st) { /* no scratch: one thread, statistics per row (same arithmetic) */
        for (int m = 0; m < M; m++) {
            const float *xr = x + (size_t)m * D, *g = dy + (size_t)m * D;
            double mud;
            const float rs = dcs_layernorm_stats(xr, D, eps, &mud), mu = (float)mud;
            dcs_layernorm_row_bw(dx + (size_t)m * D, g, xr, w, mu, rs, D);
            if (dw)
                for (int i = 0; i < D; i++) dw[i] += g[i] * ((xr[i] - mu) * rs);
            if (db)
                for (int i = 0; i < D; i++) db[i] += g[i];
        }
        return;
    }
    par(be, lnbw_rows, &a, M, 12LL * D);
    if (dw || db) par(be, lnbw_cols, &a, (D + LNBW_COLS - 1) / LNBW_COLS, 3LL * LNBW_COLS * M);
    free(st);
}

/* Two LayerNorms of one x (ops->layernorm2_bw): per group of rows the
 * statistics once (or the forward's, have_stats), then lnbw_span's row
 * backward of the first, then of the second; then each one's column blocks
 * (dw, db), both in one job. The same bits as layernorm_bw of the first,
 * then of the second. */
typedef struct {
    lnbw_arg n[2];
    int have_stats; /* n[0].mu, rs hold them already */
} lnbw2_arg;
DCS_VEC static void lnbw2_span(const lnbw2_arg *a2, long long b, long long e) {
    const lnbw_arg *a = &a2->n[0];
    const int D = a->D;
    for (long long m = b; m < e; m += DCS_LN_ROWS) {
        const int n = e - m < DCS_LN_ROWS ? (int)(e - m) : DCS_LN_ROWS;
        const size_t o = (size_t)m * D;
        if (!a2->have_stats) {
            double mud[DCS_LN_ROWS];
            dcs_layernorm_stats_rows(a->x + o, D, n, a->eps, mud, a->rs + m);
            for (int j = 0; j < n; j++) a->mu[m + j] = (float)mud[j];
        }
        for (int k = 0; k < 2; k++)
            dcs_layernorm_rows_bw(a->dx + o, a2->n[k].dy + o, a->x + o, a2->n[k].w, a->mu + m, a->rs + m, D,
                                  n);
    }
}
static void lnbw2_rows(void *p, long long b, long long e, int tid) {
    (void)tid;
    lnbw2_span(p, b, e);
}
static void lnbw2_cols(void *p, long long b, long long e, int tid) {
    const lnbw2_arg *a2 = p;
    for (int k = 0; k < 2; k++)
        if (a2->n[k].dw || a2->n[k].db) lnbw_cols((void *)&a2->n[k], b, e, tid);
}
int cpu_layernorm2_bw(dcs_backend *be, float *dx, const dcs_norm_bw_side *first,
                      const dcs_norm_bw_side *second, const float *stats, const float *x, int M, int D,
                      float eps) {
    float *st = stats ? (float *)(uintptr_t)stats : malloc(sizeof(float) * 2 * (size_t)(M > 0 ? M : 1));
    if (!st) return 1;
    const dcs_norm_bw_side *sd[2] = {first, second};
    lnbw2_arg a;
    for (int k = 0; k < 2; k++)
        a.n[k] = (lnbw_arg){dx, sd[k]->dw, sd[k]->db, st, st + M, sd[k]->dy, x, sd[k]->w, M, D, eps};
    a.have_stats = stats != NULL; /* read only then */
    par(be, lnbw2_rows, &a, M, (stats ? 16LL : 20LL) * D);
    if (first->dw || first->db || second->dw || second->db)
        par(be, lnbw2_cols, &a, (D + LNBW_COLS - 1) / LNBW_COLS, 6LL * LNBW_COLS * M);
    if (!stats) free(st);
    return 0;
}

/* The norm's backward for G readers of each row (norm_bw_fanout): a row's
 * statistics once, then each reader's row backward (dcs_math.h's). */
typedef struct {
    float *dx;
    const float *dy, *x, *w;
    int G, D, rms;
    float eps;
} fanout_arg;
DCS_VEC static void fanout_span(const fanout_arg *a, long long b, long long e) {
    const int G = a->G, D = a->D;
    for (long long m = b; m < e; m++) {
        const float *xr = a->x + (size_t)m * D;
        double mud = 0;
        const float rs = a->rms ? dcs_rms_row_inv(xr, D, a->eps) : dcs_layernorm_stats(xr, D, a->eps, &mud);
        for (int g = 0; g < G; g++) {
            const size_t o = ((size_t)m * G + g) * D;
            memset(a->dx + o, 0, sizeof(float) * D);
            if (a->rms)
                dcs_rmsnorm_row_bw(a->dx + o, a->dy + o, xr, a->w, rs, D);
            else
                dcs_layernorm_row_bw(a->dx + o, a->dy + o, xr, a->w, (float)mud, rs, D);
        }
    }
}
static void fanout_rows(void *p, long long b, long long e, int tid) {
    (void)tid;
    fanout_span(p, b, e);
}
void cpu_norm_bw_fanout(dcs_backend *be, float *dx, const float *dy, const float *x, const float *w, int M,
                        int G, int D, float eps, int rms) {
    fanout_arg a = {dx, dy, x, w, G, D, rms, eps};
    par(be, fanout_rows, &a, M, 8LL * G * D);
}

/* RMSNorm backward the same way: rows (dx, each row's 1/rms kept) on the
 * pool, then column blocks of dscale summed over rows in row order. */
typedef struct {
    float *dx, *dscale, *rs;
    const float *dy, *x, *scale;
    int rows, width;
    float eps;
} rmsbw_arg;
DCS_VEC static void rmsbw_span(const rmsbw_arg *a, long long b, long long e) {
    const int W = a->width;
    float t[2 * DCS_RMS_GROUP * DCS_RMS_TW];
    for (long long r = b; r < e; r += DCS_RMS_GROUP) {
        const int n = e - r < DCS_RMS_GROUP ? (int)(e - r) : DCS_RMS_GROUP;
        const size_t o = (size_t)r * W;
        float rs[DCS_RMS_GROUP];
        dcs_rmsnorm_rows_bw(a->dx + o, a->dy + o, a->x + o, a->scale, a->eps, W, n, rs, t);
        if (a->rs) memcpy(a->rs + r, rs, sizeof(float) * n);
    }
}
static void rmsbw_rows(void *p, long long b, long long e, int tid) {
    (void)tid;
    rmsbw_span(p, b, e);
}
/* dscale [i0, i0 + LNBW_COLS) (a whole block), the sums in registers */
DCS_VEC static void rmsbw_block(const rmsbw_arg *a, int i0) {
    const int W = a->width;
    float s[LNBW_COLS];
    for (int i = 0; i < LNBW_COLS; i++) s[i] = a->dscale[i0 + i];
    for (int r = 0; r < a->rows; r++) {
        const float *xr = a->x + (size_t)r * W + i0, *g = a->dy + (size_t)r * W + i0;
        const float rs = a->rs[r];
        for (int i = 0; i < LNBW_COLS; i++) s[i] += g[i] * (xr[i] * rs);
    }
    for (int i = 0; i < LNBW_COLS; i++) a->dscale[i0 + i] = s[i];
}
static void rmsbw_cols(void *p, long long b, long long e, int tid) {
    (void)tid;
    const rmsbw_arg *a = p;
    const int W = a->width, i1 = (int)e * LNBW_COLS < W ? (int)e * LNBW_COLS : W;
    int i0 = (int)b * LNBW_COLS; /* whole blocks in registers, a last partial one in place (the same sums) */
    for (; i0 + LNBW_COLS <= i1; i0 += LNBW_COLS) rmsbw_block(a, i0);
    for (int r = 0; r < a->rows && i0 < i1; r++) {
        const float *xr = a->x + (size_t)r * W, *g = a->dy + (size_t)r * W;
        const float rs = a->rs[r];
        for (int i = i0; i < i1; i++) a->dscale[i] += g[i] * (xr[i] * rs);
    }
}

void cpu_rmsnorm_bw(dcs_backend *be, float *dx, float *dscale, const float *dy, const float *x,
                    const float *scale, int rows, int width, float eps) {
    float *rs = dscale ? malloc(sizeof(float) * (size_t)(rows > 0 ? rows : 1)) : NULL;
    rmsbw_arg a = {dx, dscale, rs, dy, x, scale, rows, width, eps};
    if (dscale && !rs) { /* no scratch: one thread, row by row (same arithmetic) */
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (size_t)r * width, *g = dy + (size_t)r * width;
            const float rsr = dcs_rms_row_inv(xr, width, eps);
            dcs_rmsnorm_row_bw(dx + (size_t)r * width, g, xr, scale, rsr, width);
            for (int i = 0; i < width; i++) dscale[i] += g[i] * (xr[i] * rsr);
        }
        return;
    }
    par(be, rmsbw_rows, &a, rows, 8LL * width);
    if (dscale) par(be, rmsbw_cols, &a, (width + LNBW_COLS - 1) / LNBW_COLS, 3LL * LNBW_COLS * rows);
    free(rs);
}

/* ---------------------------------------------------------------- rotary, sums */

/* the angles of the T positions once ([T, half] cos/sin), then every row */
void cpu_rotary_bw(dcs_backend *be, float *x, int M, int T, int N, int Dh, int rot, float base) {
    (void)be;
    const int half = rot / 2;
    float *cs = malloc(sizeof(float) * 2 * (size_t)T * (half > 0 ? half : 1));
    if (cs)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < half; j++)
                dcs_rotary_cs(t, j, rot, base, &cs[2 * ((size_t)t * half + j)],
                              &cs[2 * ((size_t)t * half + j) + 1]);
    for (int m = 0; m < M; m++)
        for (int j = 0; j < half; j++) {
            float c, s;
            if (cs) {
                c = cs[2 * ((size_t)(m % T) * half + j)];
                s = cs[2 * ((size_t)(m % T) * half + j) + 1];
            } else {
                dcs_rotary_cs(m % T, j, rot, base, &c, &s);
            }
            for (int n = 0; n < N; n++) {
                float *h = x + ((size_t)m * N + n) * Dh;
                dcs_rotate_pair(&h[j], &h[j + half], c, -s);
            }
        }
    free(cs);
}

/* dqkv [M, 3D] = [rotary_bw(dq) | rotary_bw(dk) | dv], rows on the pool:
 * each row's three parts copied, then cpu_rotary_bw's rotation of q's and
 * k's pairs (the same bits as rotary_bw then copy2d, one pass). */
typedef struct {
    float *dqkv;
    const float *src[3]; /* dq, dk, dv [M, N, Dh] */
    const float *cs;     /* [T, half] (cos, sin) */
    int T, N, Dh, half;
} join_arg;
static void join_rows(void *p, long long b, long long e, int tid) {
    (void)tid;
    const join_arg *a = p;
    const int D = a->N * a->Dh, half = a->half;
    for (long long m = b; m < e; m++) {
        float *row = a->dqkv + (size_t)m * 3 * D;
        for (int part = 0; part < 3; part++)
            memcpy(row + (size_t)part * D, a->src[part] + (size_t)m * D, sizeof(float) * D);
        const float *cs = a->cs + 2 * (size_t)(m % a->T) * half;
        for (int n = 0; n < 2 * a->N && half > 0; n++) { /* q's heads, then k's */
            float *h = row + (size_t)(n / a->N) * D + (size_t)(n % a->N) * a->Dh;
            for (int j = 0; j < half; j++) dcs_rotate_pair(&h[j], &h[j + half], cs[2 * j], -cs[2 * j + 1]);
        }
    }
}
int cpu_qkv_join_bw(dcs_backend *be, float *dqkv, const float *dq, const float *dk, const float *dv, int M,
                    int T, int N, int Dh, int rot, float base) {
    const int half = rot / 2;
    float *cs = malloc(sizeof(float) * 2 * (size_t)T * (half > 0 ? half : 1));
    if (!cs) return 1;
    for (int t = 0; t < T; t++)
        for (int j = 0; j < half; j++)
            dcs_rotary_cs(t, j, rot, base, &cs[2 * ((size_t)t * half + j)],
                          &cs[2 * ((size_t)t * half + j) + 1]);
    join_arg a = {dqkv, {dq, dk, dv}, cs, T, N, Dh, half};
    par(be, join_rows, &a, M, 6LL * N * Dh);
    free(cs);
    return 0;
}

/* db [N] += the column sums of dy [M, N], each column summed in row order
 * (the same bits at any thread count): blocks of COLSUM_COLS columns on the
 * pool, a block's sums in registers. */
#define COLSUM_COLS 32
typedef struct {
    float *db;
    const float *dy;
    int M, N;
} colsum_arg;
DCS_VEC static void col_sum_block(float *restrict db, const float *restrict dy, int M, int N, int n0,
                                  int nw) {
    float s[COLSUM_COLS];
    if (nw == COLSUM_COLS) { /* a whole block: fixed-width loops, the sums in registers */
        for (int o = 0; o < COLSUM_COLS; o++) s[o] = db[n0 + o];
        for (int m = 0; m < M; m++)
            for (int o = 0; o < COLSUM_COLS; o++) s[o] += dy[(size_t)m * N + n0 + o];
        for (int o = 0; o < COLSUM_COLS; o++) db[n0 + o] = s[o];
        return;
    }
    for (int m = 0; m < M; m++)
        for (int o = 0; o < nw; o++) db[n0 + o] += dy[(size_t)m * N + n0 + o];
}
static void col_sum_blocks(void *p, long long b, long long e, int tid) {
    (void)tid;
    const colsum_arg *a = p;
    for (long long k = b; k < e; k++) {
        const int n0 = (int)k * COLSUM_COLS, nw = a->N - n0 < COLSUM_COLS ? a->N - n0 : COLSUM_COLS;
        col_sum_block(a->db, a->dy, a->M, a->N, n0, nw);
    }
}
void cpu_col_sum(dcs_backend *be, float *db, const float *dy, int M, int N) {
    colsum_arg a = {db, dy, M, N};
    par(be, col_sum_blocks, &a, (N + COLSUM_COLS - 1) / COLSUM_COLS, (long long)COLSUM_COLS * M);
}

void cpu_embed_bw(dcs_backend *be, float *dtable, const float *dx, const int32_t *tokens_host, int M, int D) {
    (void)be;
    for (int i = 0; i < M; i++) {
        float *row = dtable + (size_t)tokens_host[i] * D;
        const float *src = dx + (size_t)i * D;
        for (int j = 0; j < D; j++) row[j] += src[j];
    }
}

/* cross-entropy rows on the pool: each row's loss and dlogits independent
 * (the caller sums loss_host in row order) */
typedef struct {
    float *dlogits;
    double *loss;
    const float *logits;
    const int32_t *targets;
    int V;
    float inv;
} xent_arg;
DCS_VEC static double xent_row(float *d, const float *lg, int V, int tgt, float inv) {
    return dcs_xent_row_bw(d, lg, V, tgt, inv);
}
static void xent_rows(void *p, long long b, long long e, int tid) {
    (void)tid;
    const xent_arg *a = p;
    for (long long i = b; i < e; i++) {
        float *d = a->dlogits + (size_t)i * a->V;
        if (a->targets[i] < 0) {
            memset(d, 0, sizeof(float) * a->V);
            a->loss[i] = 0;
            continue;
        }
        a->loss[i] = xent_row(d, a->logits + (size_t)i * a->V, a->V, a->targets[i], a->inv);
    }
}

void cpu_xent_bw(dcs_backend *be, float *dlogits, double *loss_host, const float *logits,
                 const int32_t *targets_host, int M, int V, float inv) {
    xent_arg a = {dlogits, loss_host, logits, targets_host, V, inv};
    par(be, xent_rows, &a, M, 6LL * V);
}

/* ---------------------------------------------------------------- MoH, SwiGLU */

void cpu_head_gate_bw(dcs_backend *be, float *dz, float *dgate, const float *zpre, const float *gate, int M,
                      int N, int Dh) {
    (void)be;
    for (size_t i = 0; i < (size_t)M * N; i++)
        dgate[i] = dcs_head_gate_bw(dz + i * Dh, zpre + i * Dh, gate[i], Dh);
}

void cpu_moh_route_bw(dcs_backend *be, float *dlg, float *ds1, float *ds0, const float *dg, const float *lg,
                      const float *s1, const float *s0, int M, int N, int hs, int k) {
    (void)be;
    const int NR = N - hs;
    for (int mm = 0; mm < M; mm++)
        dcs_moh_route_row_bw(lg + (size_t)mm * NR, hs > 1 ? s1 + (size_t)mm * hs : NULL,
                             hs > 0 ? s0 + (size_t)mm * 2 : NULL, N, hs, k, dg + (size_t)mm * N,
                             dlg + (size_t)mm * NR, ds1 + (size_t)mm * (hs ? hs : 1), ds0 + (size_t)mm * 2);
}

void cpu_swiglu_bw(dcs_backend *be, float *du, float *du3, float *dgate, float *dp, const float *u,
                   const float *u3, const float *gate, int M, int F, int E) {
    (void)be;
    const int W = E > 0 ? F / E : F;
    for (int i = 0; i < M; i++) {
        const size_t o = (size_t)i * F;
        if (E > 0)
            dcs_swiglu_gate_row_bw(dp + o, dgate + (size_t)i * E, u + o, u3 + o, gate + (size_t)i * E, E, W);
        for (int j = 0; j < F; j++) dcs_swiglu_bw(dp[o + j], u[o + j], u3[o + j], &du[o + j], &du3[o + j]);
    }
}

/* ---------------------------------------------------------------- compose */

/* The row kernel's keys run in aligned blocks of KB = DCS_KEY_PAD (one
 * vector of the widest clone): the allowed keys [s0, s1) of a row widened
 * to [S0, S1), S0 = s0 rounded down, S1 = s1 rounded up to KB, the keys
 * outside [s0, s1) zero-padded, so every loop runs whole blocks (no scalar
 * tails) and the padding adds exact zeros. */
#define KB DCS_KEY_PAD

/* the key side's row stride: T rounded up to KB */
static int key_stride(int T) { return (T + KB - 1) / KB * KB; }

/* x [S1 - S0] = src [S0, S1) over the keys [s0, s1), 0 elsewhere; src is
 * readable over [S0, lim) */
static inline void load_keys(float *x, const float *src, int S0, int S1, int s0, int s1, int lim) {
    for (int b = S0; b < S1; b += KB) {
        float *xb = x + (b - S0);
        const float *sb = src + b;
        if (b >= s0 && b + KB <= s1)
            for (int j = 0; j < KB; j++) xb[j] = sb[j];
        else if (b + KB <= lim)
            for (int j = 0; j < KB; j++) {
                const float v = sb[j];
                xb[j] = b + j >= s0 && b + j < s1 ? v : 0.0f;
            }
        else
            for (int j = 0; j < KB; j++) xb[j] = b + j >= s0 && b + j < s1 ? sb[j] : 0.0f;
    }
}

/* vkb: a block of KB keys as one vector (cpu_vec.h) */

/* the lanes of *v summed in a fixed tree: lane j += lane j + w for w = KB/2,
 * ..., 1 (halves added until one is left), in registers: each step one
 * shuffle and one add of the whole vector (the lanes past w unused) */
#if KB != 16
#error "sum_lanes shuffles 16 lanes"
#endif
#if defined(__clang__)
#define VSHUF(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
typedef int vkb_i __attribute__((vector_size(KB * sizeof(int))));
#define VSHUF(v, ...) __builtin_shuffle(v, (vkb_i){__VA_ARGS__})
#endif
static inline float sum_lanes(const vkb *v) {
    vkb h = *v;
    h += VSHUF(h, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
    h += VSHUF(h, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
    h += VSHUF(h, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    h += VSHUF(h, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
    return h[0];
}

/* Backward of plain DCMHA's compose for the query row (b, t) over the keys
 * [s0, s1): g = dOut rows (head stride sg), a the input's (sa). The row of
 * da (sd) over all T keys is written (0 outside [s0, s1)); query-side dqw1,
 * dqw2 [R, N], dqdd [N] += ; key-side dkw1T, dkw2T [R, N, Tp], dkddT [N,
 * Tp] += (transposed, row stride Tp = key_stride(T), NULL when
 * query_wise; read and written over [S0, S1), the padding's terms exact
 * zeros). `on` masks the branches as in dcs_compose_pair_bw_var, whose sums
 * these are in another order: da and the key side's per key in its order
 * of terms, the dot products over keys in KB lanes (lane j: the keys S0 +
 * j mod KB) summed by sum_lanes, so the bits are the same in each clone
 * (cpu_vec.h). Each loop runs over the row's blocks with its accumulators
 * in registers; tmp: row_tmp_floats(N, R, T). */
DCS_VEC static void compose_row_bw(const float *a, long long sa, const float *g, long long sg, float *da,
                                   long long sd, int N, int R, int T, int s0, int s1, const float *qw1,
                                   const float *qw2, const float *kw1T, const float *kw2T, const float *qdd,
                                   const float *kddT, float *dqw1, float *dqw2, float *dkw1T, float *dkw2T,
                                   float *dqdd, float *dkddT, unsigned on, float *tmp) {
    const int Tp = key_stride(T), S0 = s0 / KB * KB, S1 = (s1 + KB - 1) / KB * KB, W = S1 - S0;
    /* A, G [N, W]: a, g padded; qi, ki, gq, gk [R, W]; D [W]: a row of da */
    float *A = tmp, *G = A + (size_t)N * W, *qi = G + (size_t)N * W, *ki = qi + (size_t)R * W,
          *gq = ki + (size_t)R * W, *gk = gq + (size_t)R * W, *D = gk + (size_t)R * W;
    const int keys = kw1T != NULL;
    for (int n = 0; n < N; n++) {
        load_keys(A + (size_t)n * W, a + n * sa, S0, S1, s0, s1, T);
        load_keys(G + (size_t)n * W, g + n * sg, S0, S1, s0, s1, T);
    }
    const vkb zero = {0};
    for (int i = 0; i < R; i++)
        for (int b = 0; b < W; b += KB) {
            vkb q = zero, k = zero, tq = zero, tk = zero;
            for (int n = 0; n < N; n++) {
                const vkb an = vld(A + (size_t)n * W + b), gn = vld(G + (size_t)n * W + b);
                q += an * qw1[i * N + n];
                tq += gn * qw2[i * N + n];
                if (keys) {
                    const size_t o = ((size_t)i * N + n) * Tp + S0 + b;
                    k += an * vld(kw1T + o);
                    tk += gn * vld(kw2T + o);
                }
            }
            const size_t o = (size_t)i * W + b;
            vst(qi + o, q);
            vst(ki + o, k);
            vst(gq + o, tq);
            vst(gk + o, tk);
        }
    for (int n = 0; n < N; n++) {
        const float *An = A + (size_t)n * W, *Gn = G + (size_t)n * W;
        const float c = ((on & 1) ? 1.0f : 0.0f) + ((on & 8) ? qdd[n] : 0.0f);
        const int kd_on = (on & 16) && keys, kp_on = (on & 4) && keys;
        const float *kd = kd_on ? kddT + (size_t)n * Tp + S0 : NULL;
        float *dkd = kd_on ? dkddT + (size_t)n * Tp + S0 : NULL;
        vkb pdd = zero;
        for (int b = 0; b < W; b += KB) {
            const vkb an = vld(An + b), gn = vld(Gn + b);
            vkb d = zero + gn * c;
            if (on & 8) pdd += gn * an;
            if (kd_on) {
                d += gn * vld(kd + b);
                vst(dkd + b, vld(dkd + b) + gn * an);
            }
            vst(D + b, d);
        }
        if (on & 8) dqdd[n] += sum_lanes(&pdd);
        for (int i = 0; i < R; i++) {
            const size_t o = (size_t)i * W, ok = ((size_t)i * N + n) * Tp + S0;
            const float *tq = gq + o, *q = qi + o, *tk = gk + o, *k = ki + o, w1 = qw1[i * N + n];
            const float *k1 = kp_on ? kw1T + ok : NULL;
            float *d1 = kp_on ? dkw1T + ok : NULL, *d2 = kp_on ? dkw2T + ok : NULL;
            vkb p1 = zero, p2 = zero;
            for (int b = 0; b < W; b += KB) {
                const vkb an = vld(An + b), gn = vld(Gn + b);
                vkb d = vld(D + b);
                if (on & 2) {
                    const vkb tqb = vld(tq + b);
                    d += tqb * w1;
                    p1 += tqb * an;
                    p2 += vld(q + b) * gn;
                }
                if (kp_on) {
                    const vkb tkb = vld(tk + b);
                    d += tkb * vld(k1 + b);
                    vst(d1 + b, vld(d1 + b) + tkb * an);
                    vst(d2 + b, vld(d2 + b) + vld(k + b) * gn);
                }
                vst(D + b, d);
            }
            if (on & 2) {
                dqw1[i * N + n] += sum_lanes(&p1);
                dqw2[i * N + n] += sum_lanes(&p2);
            }
        }
        float *dn = da + n * sd;
        memset(dn, 0, sizeof(float) * S0);
        memcpy(dn + S0, D, sizeof(float) * (size_t)((S1 < T ? S1 : T) - S0));
        if (S1 < T) memset(dn + S1, 0, sizeof(float) * (size_t)(T - S1));
    }
}

/* the allowed keys of query t: [s0, t] */
static int first_key(int t, int window) { return window > 0 && t > window ? t - window : 0; }

/* x [B, T, C] -> xT [B, C, Tp] (C = R*N or N; Tp = key_stride(T), the
 * padding 0), and back */
static void to_keys_T(float *xT, const float *x, int B, int T, int C) {
    const int Tp = key_stride(T);
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++)
            for (int c = 0; c < C; c++) xT[((size_t)b * C + c) * Tp + t] = x[((size_t)b * T + t) * C + c];
        for (int c = 0; c < C; c++)
            for (int t = T; t < Tp; t++) xT[((size_t)b * C + c) * Tp + t] = 0.0f;
    }
}
static void from_keys_T(float *x, const float *xT, int B, int T, int C) {
    const int Tp = key_stride(T);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < C; c++) x[((size_t)b * T + t) * C + c] = xT[((size_t)b * C + c) * Tp + t];
}

/* the row kernel's scratch per thread: its tmp, and the fused backward's
 * rows of dP and dAc [2, N, T] */
static size_t row_tmp_floats(int N, int R, int T) {
    return (2 * (size_t)N + 4 * (size_t)R + 1) * key_stride(T);
}

/* row (b, t) of one phase: compose_row_bw with the phase's weights; in, g,
 * d: the row's input, dOut, dIn (head strides si, sg, sd) */
static void row_bw(const dcs_compose_bw_args *a, long long b, int t, const float *in, long long si,
                   const float *g, long long sg, float *d, long long sd, float *tmp) {
    const int T = a->T, N = a->N, R = a->R, RN = R * N, Tp = key_stride(T);
    const int keys = a->kw1 != NULL;
    float *const *kT = a->scratch, *const *dkT = a->scratch + 3;
    const size_t bt = (size_t)b * T + t;
    compose_row_bw(in, si, g, sg, d, sd, N, R, T, first_key(t, a->window), t + 1, a->qw1 + bt * RN,
                   a->qw2 + bt * RN, keys ? kT[0] + (size_t)b * RN * Tp : NULL,
                   keys ? kT[1] + (size_t)b * RN * Tp : NULL, a->qdd + bt * N,
                   keys ? kT[2] + (size_t)b * N * Tp : NULL, a->dqw1 + bt * RN, a->dqw2 + bt * RN,
                   keys ? dkT[0] + (size_t)b * RN * Tp : NULL, keys ? dkT[1] + (size_t)b * RN * Tp : NULL,
                   a->dqdd + bt * N, keys ? dkT[2] + (size_t)b * N * Tp : NULL, a->on, tmp);
}

typedef struct {
    const dcs_compose_bw_args *a, *pre; /* pre: the fused backward's second phase */
    volatile int failed;                /* a chunk could not get its scratch */
} cb_arg;

/* plain DCMHA, sequences [b_from, b_to): key-side gradients of (b, s)
 * gather over the queries t of the same sequence only */
static void compose_bw_seqs(void *p, long long b_from, long long b_to, int tid) {
    (void)tid;
    cb_arg *ca = p;
    const dcs_compose_bw_args *a = ca->a;
    const int T = a->T, N = a->N;
    const long long TT = (long long)T * T;
    float *tmp = malloc(sizeof(float) * row_tmp_floats(N, a->R, T));
    if (!tmp) {
        ca->failed = 1;
        return;
    }
    for (long long b = b_from; b < b_to; b++)
        for (int t = 0; t < T; t++) {
            const long long o = (long long)b * N * TT + (long long)t * T;
            row_bw(a, b, t, a->in + o, TT, a->dOut + o, TT, a->dIn + o, TT, tmp);
        }
    free(tmp);
}

/* row (b, t) of the fused backward: the post phase from dPc's row g (head
 * stride sg) into dP's row [N, T] (dP: then dAc's [N, T]), its masked
 * softmax backward into dAc's, the pre phase from it into dA's row d (head
 * stride sd) */
static void fused_row(const dcs_compose_bw_args *post, const dcs_compose_bw_args *pre, long long b, int t,
                      const float *g, long long sg, float *d, long long sd, float *tmp, float *dP) {
    const int T = post->T, N = post->N;
    const long long TT = (long long)T * T, o = b * N * TT + (long long)t * T;
    float *dAc = dP + (size_t)N * T;
    row_bw(post, b, t, post->in + o, TT, g, sg, dP, T, tmp);
    for (int n = 0; n < N; n++)
        softmax_bw_row(dAc + (size_t)n * T, dP + (size_t)n * T, post->in + o + n * TT, T, t, post->window);
    row_bw(pre, b, t, pre->in + o, TT, dAc, T, d, sd, tmp);
}

/* the fused backward, sequences [b_from, b_to): per row (b, t), the post
 * phase into dP's row [N, T], its masked softmax backward into dAc's, the
 * pre phase from it (each row in L1 instead of four passes over the maps) */
static void compose_softmax_bw_seqs(void *p, long long b_from, long long b_to, int tid) {
    (void)tid;
    cb_arg *ca = p;
    const dcs_compose_bw_args *post = ca->a, *pre = ca->pre;
    const int T = post->T, N = post->N;
    const long long TT = (long long)T * T;
    const size_t nt = row_tmp_floats(N, post->R > pre->R ? post->R : pre->R, T);
    float *tmp = malloc(sizeof(float) * (nt + 2 * (size_t)N * T));
    if (!tmp) {
        ca->failed = 1;
        return;
    }
    float *dP = tmp + nt;
    for (long long b = b_from; b < b_to; b++)
        for (int t = 0; t < T; t++) {
            const long long o = (long long)b * N * TT + (long long)t * T;
            fused_row(post, pre, b, t, post->dOut + o, TT, pre->dIn + o, TT, tmp, dP);
        }
    free(tmp);
}

/* every variant: pair by pair (dcs_compose_pair_bw_var), on the caller's
 * thread (the static map's gradient sums over all pairs); dIn and the
 * dynamic-weight gradients zeroed first */
static void compose_bw_pairs(const dcs_compose_bw_args *a) {
    const int B = a->B, T = a->T, N = a->N, R = a->R, M = B * T;
    const long long TT = (long long)T * T;
    const size_t RN = (size_t)R * N;
    memset(a->dIn, 0, sizeof(float) * (size_t)B * N * TT);
    float *const dyn[6] = {a->dqw1, a->dqw2, a->dqdd, a->dkw1, a->dkw2, a->dkdd};
    for (int i = 0; i < 6; i++)
        if (dyn[i]) memset(dyn[i], 0, sizeof(float) * (size_t)M * (i % 3 < 2 ? RN : (size_t)N));
    const int qs = a->qw1 != NULL, ks = a->kw1 != NULL;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int s = first_key(t, a->window); s <= t; s++) {
                const long long o = (long long)b * N * TT + (long long)t * T + s;
                const size_t q = (size_t)b * T + t, k = (size_t)b * T + s;
                dcs_compose_pair_bw_var(
                    a->in + o, a->dOut + o, a->dIn + o, TT, N, a->G, R, qs ? a->qw1 + q * RN : NULL,
                    qs ? a->qw2 + q * RN : NULL, ks ? a->kw1 + k * RN : NULL, ks ? a->kw2 + k * RN : NULL,
                    a->qdd ? a->qdd + q * N : NULL, a->kdd ? a->kdd + k * N : NULL, a->sw,
                    qs ? a->dqw1 + q * RN : NULL, qs ? a->dqw2 + q * RN : NULL, ks ? a->dkw1 + k * RN : NULL,
                    ks ? a->dkw2 + k * RN : NULL, a->qdd ? a->dqdd + q * N : NULL,
                    a->kdd ? a->dkdd + k * N : NULL, a->dsw, a->on);
            }
}

/* the row kernel's case: plain DCMHA (query side present, one group, no
 * static map), the key side's scratch given */
static int rows_ok(const dcs_compose_bw_args *a) {
    return a->qw1 && a->G == 1 && !a->sw && (!a->kw1 || a->scratch[0]);
}

/* before the row kernel, for sequence b: the phase's dynamic-weight
 * gradients zeroed, its key side transposed into the scratch ([B, C,
 * key_stride(T)]) */
static void rows_begin_seq(const dcs_compose_bw_args *a, long long b) {
    const int T = a->T, N = a->N, Tp = key_stride(T);
    const size_t RN = (size_t)a->R * N, rows = (size_t)b * T;
    memset(a->dqw1 + rows * RN, 0, sizeof(float) * T * RN);
    memset(a->dqw2 + rows * RN, 0, sizeof(float) * T * RN);
    memset(a->dqdd + rows * N, 0, sizeof(float) * T * N);
    if (a->kw1) {
        to_keys_T(a->scratch[0] + b * RN * Tp, a->kw1 + rows * RN, 1, T, (int)RN);
        to_keys_T(a->scratch[1] + b * RN * Tp, a->kw2 + rows * RN, 1, T, (int)RN);
        to_keys_T(a->scratch[2] + b * N * Tp, a->kdd + rows * N, 1, T, N);
        memset(a->scratch[3] + b * RN * Tp, 0, sizeof(float) * Tp * RN);
        memset(a->scratch[4] + b * RN * Tp, 0, sizeof(float) * Tp * RN);
        memset(a->scratch[5] + b * N * Tp, 0, sizeof(float) * Tp * N);
    }
}

/* after it: the key side's gradients of sequence b back from the scratch */
static void rows_end_seq(const dcs_compose_bw_args *a, long long b) {
    const int T = a->T, N = a->N, Tp = key_stride(T);
    const size_t RN = (size_t)a->R * N, rows = (size_t)b * T;
    if (a->kw1) {
        from_keys_T(a->dkw1 + rows * RN, a->scratch[3] + b * RN * Tp, 1, T, (int)RN);
        from_keys_T(a->dkw2 + rows * RN, a->scratch[4] + b * RN * Tp, 1, T, (int)RN);
        from_keys_T(a->dkdd + rows * N, a->scratch[5] + b * N * Tp, 1, T, N);
    }
}

static void rows_begin(const dcs_compose_bw_args *a) {
    for (long long b = 0; b < a->B; b++) rows_begin_seq(a, b);
}
static void rows_end(const dcs_compose_bw_args *a) {
    for (long long b = 0; b < a->B; b++) rows_end_seq(a, b);
}

/* Plain DCMHA by query rows on the pool (compose_row_bw; dIn: every row
 * written whole by it); every variant pair by pair. */
void cpu_compose_bw(dcs_backend *be, const dcs_compose_bw_args *a) {
    if (!rows_ok(a)) {
        compose_bw_pairs(a);
        return;
    }
    rows_begin(a);
    cb_arg ca = {a, NULL, 0};
    par(be, compose_bw_seqs, &ca, a->B, (long long)a->T * a->T * a->N * a->R * 4);
    if (ca.failed) { /* no scratch for a chunk: the same sums pair by pair */
        compose_bw_pairs(a);
        return;
    }
    rows_end(a);
}

/* Both phases by rows, the softmax backward between them (the same
 * per-row arithmetic as cpu_compose_bw, cpu_softmax_bw, cpu_compose_bw:
 * the same bits), or those three when a phase is not plain DCMHA. */
void cpu_compose_softmax_bw(dcs_backend *be, const dcs_compose_bw_args *post,
                            const dcs_compose_bw_args *pre) {
    const int B = post->B, T = post->T, N = post->N;
    if (rows_ok(post) && rows_ok(pre)) {
        rows_begin(post);
        rows_begin(pre);
        cb_arg ca = {post, pre, 0};
        par(be, compose_softmax_bw_seqs, &ca, B, (long long)T * T * N * (post->R + pre->R) * 4);
        if (!ca.failed) {
            rows_end(post);
            rows_end(pre);
            return;
        }
    }
    cpu_compose_bw(be, post);
    /* pre->dOut is dAc, the tape's buffer (dcs_backend.h): written here */
    cpu_softmax_bw(be, (float *)pre->dOut, post->dIn, post->in, B * N, T, T, post->window);
    cpu_compose_bw(be, pre);
}

/* ---------------------------------------------------------------- attention
 * cpu_attention_bw: per sequence (the pool's items: its key side
 * transposed, its dynamic-weight gradients zeroed and at the end moved back
 * on its thread, rows_begin_seq / rows_end_seq), per block of ATB_TQ
 * query rows [r0, r1] in order, over the keys [Ja, Jb) the block's rows
 * reach (their first allowed key rounded down to KB, their last + 1 up to
 * KB, at most T), per head n (cblas_sgemm; the BLAS runs one thread):
 *   dPc [N, tq, T] = dz_blk v[Ja:Jb]^T     (scratch, keys [Ja, Jb))
 *   rows: fused_row -> dA [N, tq, T]       (scratch, every key written)
 *   dv[Ja:Jb] += Pc_blk^T dz_blk           (dv, dk of the sequence zeroed
 *   dq_blk = s dA k[Ja:Jb]                  before its first block)
 *   dk[Ja:Jb] += s dA^T q_blk
 * so the gradient maps never leave the cache. A function of the shape
 * alone (blocks, key ranges, order of the sums), so the same bits at any
 * thread count. The keys of [Ja, Jb) outside a row's allowed ones: dPc
 * there is read only under the row kernel's mask, dA there is exactly 0. */
#define ATB_TQ 32

/* the rows of a block's scratch: ATB_TQ, or T when shorter */
static int atb_rows(int T) { return T < ATB_TQ ? T : ATB_TQ; }

typedef struct {
    const dcs_attn_bw_args *a;
    volatile int failed;
} ab_arg;

static void attn_bw_seqs(void *p, long long b_from, long long b_to, int tid) {
    (void)tid;
    ab_arg *ab = p;
    const dcs_attn_bw_args *a = ab->a;
    const dcs_compose_bw_args *post = a->post, *pre = a->pre;
    const int T = post->T, N = post->N, Dh = a->Dh, ld = a->ld;
    const long long TT = (long long)T * T, blk = (long long)atb_rows(T) * T;
    const size_t nt = row_tmp_floats(N, post->R > pre->R ? post->R : pre->R, T);
    float *tmp = malloc(sizeof(float) * (nt + 2 * (size_t)N * T + 2 * (size_t)N * blk));
    if (!tmp) {
        ab->failed = 1;
        return;
    }
    float *dP = tmp + nt, *dPc = dP + 2 * (size_t)N * T, *dA = dPc + (size_t)N * blk;
    for (long long b = b_from; b < b_to; b++) {
        const size_t sq = (size_t)b * T * ld; /* the sequence's first row */
        rows_begin_seq(post, b);
        rows_begin_seq(pre, b);
        memset(a->dv + sq, 0, sizeof(float) * (size_t)T * ld);
        memset(a->dk + sq, 0, sizeof(float) * (size_t)T * ld);
        for (int r0 = 0; r0 < T; r0 += ATB_TQ) {
            const int tq = r0 + ATB_TQ < T ? ATB_TQ : T - r0, r1 = r0 + tq - 1; /* <= atb_rows(T) */
            const int Ja = first_key(r0, post->window) / KB * KB,
                      Jb = key_stride(r1 + 1) < T ? key_stride(r1 + 1) : T;
            const int Lk = Jb - Ja;
            const float *dzb = a->dz + sq + (size_t)r0 * ld, *qb = a->q + sq + (size_t)r0 * ld;
            for (int n = 0; n < N; n++)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, tq, Lk, Dh, 1.0f, dzb + n * Dh, ld,
                            a->v + sq + (size_t)Ja * ld + n * Dh, ld, 0.0f, dPc + n * blk + Ja, T);
            for (int r = 0; r < tq; r++)
                fused_row(post, pre, b, r0 + r, dPc + (long long)r * T, blk, dA + (long long)r * T, blk, tmp,
                          dP);
            for (int n = 0; n < N; n++) {
                const float *Pc = a->Pc + ((size_t)b * N + n) * TT + (size_t)r0 * T + Ja;
                const size_t kn = sq + (size_t)Ja * ld + n * Dh;
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Lk, Dh, tq, 1.0f, Pc, T, dzb + n * Dh,
                            ld, 1.0f, a->dv + kn, ld);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, tq, Dh, Lk, a->scale,
                            dA + n * blk + Ja, T, a->k + kn, ld, 0.0f, a->dq + sq + (size_t)r0 * ld + n * Dh,
                            ld);
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Lk, Dh, tq, a->scale, dA + n * blk + Ja,
                            T, qb + n * Dh, ld, 1.0f, a->dk + kn, ld);
            }
        }
        rows_end_seq(post, b);
        rows_end_seq(pre, b);
    }
    free(tmp);
}

int cpu_attention_bw(dcs_backend *be, const dcs_attn_bw_args *a) {
    const dcs_compose_bw_args *post = a->post, *pre = a->pre;
    const int B = post->B, T = post->T, N = post->N;
    ab_arg ab = {a, 0};
    par(be, attn_bw_seqs, &ab, B, (long long)T * T * N * (post->R + pre->R + a->Dh) * 4);
    return ab.failed; /* no scratch for a chunk: the caller's unfused path overwrites it all */
}

/* ---------------------------------------------------------------- plain attention */

/* C = alpha op(A) op(B) + beta C of one batch entry, tile by tile as
 * cpu_gemm's items over grid g (the same cblas_sgemm calls, on this thread) */
static void gemm_tiles(const dcs_gemm_grid *g, int tA, int tB, int M, int N, int K, float alpha,
                       const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    for (int im = 0; im < g->gm; im++)
        for (int in = 0; in < g->gn; in++) {
            const int m0 = im * g->tm, n0 = in * g->tn;
            const int mt = M - m0 < g->tm ? M - m0 : g->tm, nt = N - n0 < g->tn ? N - n0 : g->tn;
            if (mt <= 0 || nt <= 0) continue;
            cblas_sgemm(CblasRowMajor, tA ? CblasTrans : CblasNoTrans, tB ? CblasTrans : CblasNoTrans, mt, nt,
                        K, alpha, A + (tA ? m0 : (long long)m0 * lda), lda,
                        B + (tB ? (long long)n0 * ldb : n0), ldb, beta, C + (long long)m0 * ldc + n0, ldc);
        }
}

/* The grids of the tape's batched products (pass.c, dcs_heads_map,
 * dcs_heads_rows: batch N per sequence): dP = dz v^T [T, T], and the rows
 * products dv, dk [T, Dh] (inner T) and dq [T, Dh] (inner T). */
typedef struct {
    const dcs_mha_bw_args *a;
    dcs_gemm_grid map, rows;
    int failed;
} mha_arg;

/* (sequence, head) items [b_from, b_to): attention_maps_bw's steps for
 * plain attention, one item's maps in this chunk's scratch */
static void mha_items(void *p, long long from, long long to, int tid) {
    (void)tid;
    mha_arg *ma = p;
    const dcs_mha_bw_args *a = ma->a;
    const int T = a->T, N = a->N, Dh = a->Dh, ld = a->ld;
    const long long TT = (long long)T * T;
    float *dP = malloc(sizeof(float) * 2 * (size_t)TT);
    if (!dP) {
        ma->failed = 1;
        return;
    }
    float *dA = dP + TT;
    for (long long it = from; it < to; it++) {
        const int b = (int)(it / N), n = (int)(it % N);
        const size_t o = (size_t)b * T * ld + (size_t)n * Dh; /* head n of the sequence's first row */
        const float *P = a->P + (size_t)it * TT;
        gemm_tiles(&ma->map, 0, 1, T, T, Dh, 1.0f, a->dz + o, ld, a->v + o, ld, 0.0f, dP, T);
        gemm_tiles(&ma->rows, 1, 0, T, Dh, T, 1.0f, P, T, a->dz + o, ld, 0.0f, a->dv + o, ld);
        for (int r = 0; r < T; r++)
            softmax_bw_row(dA + (size_t)r * T, dP + (size_t)r * T, P + (size_t)r * T, T, r, a->window);
        gemm_tiles(&ma->rows, 0, 0, T, Dh, T, a->scale, dA, T, a->k + o, ld, 0.0f, a->dq + o, ld);
        gemm_tiles(&ma->rows, 1, 0, T, Dh, T, a->scale, dA, T, a->q + o, ld, 0.0f, a->dk + o, ld);
    }
    free(dP);
}

int cpu_mha_bw(dcs_backend *be, const dcs_mha_bw_args *a) {
    const int T = a->T, N = a->N, Dh = a->Dh;
    mha_arg ma = {a, gemm_grid(T, T, Dh, N), gemm_grid(T, Dh, T, N), 0};
    par(be, mha_items, &ma, (long long)a->B * N, 10LL * T * T * Dh);
    return ma.failed; /* no scratch for a chunk: the caller's path overwrites it all */
}

/* ---------------------------------------------------------------- scratch */

/* The largest malloc one backward operation above makes for a tape of
 * shape s: layernorm_bw's statistics [2, M], rotary_bw's angles [T, rot/2]
 * (cos, sin), or compose_bw's row kernel's [2N + 4R + 1, key_stride(T)] per
 * chunk (with the fused backward's rows of dP and dAc [2, N, T], and
 * attention_bw's blocks of dPc and dA [2, N, min(ATB_TQ, T), T]), or mha_bw's
 * maps dP, dA [2, T, T], one chunk per thread at a time. */
uint64_t cpu_bw_scratch_bytes(const dcs_bw_shape *s, int n_threads) {
    const uint64_t M = (uint64_t)s->B * s->T;
    uint64_t n = 2 * M;
    const uint64_t rot = 2 * (uint64_t)s->T * (s->rot / 2 > 0 ? s->rot / 2 : 1);
    if (rot > n) n = rot;
    const uint64_t mha = s->mha ? (uint64_t)(n_threads > 0 ? n_threads : 1) * 2 * (uint64_t)s->T * s->T : 0;
    if (mha > n) n = mha;
    if (s->rows_kernel) {
        const uint64_t cmp =
            (uint64_t)(n_threads > 0 ? n_threads : 1) *
            (row_tmp_floats(s->N, s->R, s->T) + 2 * (uint64_t)s->N * s->T * (1 + atb_rows(s->T)));
        if (cmp > n) n = cmp;
    }
    return n * sizeof(float);
}
