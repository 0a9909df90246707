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
#include "cpu_vec.h"
#include "dcs_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static void par(dcs_backend *be, dcs_par_fn fn, void *arg, long long n, long long cost) {
    be->ops->parallel(be, fn, arg, n, cost);
}

void cpu_zero(dcs_backend *be, void *p, size_t bytes) {
    (void)be;
    if (bytes) memset(p, 0, bytes);
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

void cpu_tanh_bw(dcs_backend *be, float *dx, const float *y, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) dx[i] *= 1.0f - y[i] * y[i];
}

static void softmax_bw_rows(void *p, long long b, long long e, int tid) {
    (void)tid;
    const ew_arg *a = p;
    for (long long r = b; r < e; r++) {
        const size_t o = (size_t)r * a->S;
        dcs_softmax_row_bw(a->x + o, a->y + o, a->z + o, a->S, (int)(r % a->T), a->window);
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
static void lnbw_rows(void *p, long long b, long long e, int tid) {
    (void)tid;
    const lnbw_arg *a = p;
    const int D = a->D;
    for (long long m = b; m < e; m++) {
        const float *xr = a->x + (size_t)m * D, *g = a->dy + (size_t)m * D;
        double mud;
        const float rs = dcs_layernorm_stats(xr, D, a->eps, &mud), mu = (float)mud;
        a->mu[m] = mu;
        a->rs[m] = rs;
        dcs_layernorm_row_bw(a->dx + (size_t)m * D, g, xr, a->w, mu, rs, D);
    }
}
static void lnbw_cols(void *p, long long b, long long e, int tid) {
    (void)tid;
    const lnbw_arg *a = p;
    const int D = a->D, i0 = (int)b * LNBW_COLS, i1 = (int)e * LNBW_COLS < D ? (int)e * LNBW_COLS : D;
    for (int m = 0; m < a->M; m++) {
        const float *xr = a->x + (size_t)m * D, *g = a->dy + (size_t)m * D;
        const float mu = a->mu[m], rs = a->rs[m];
        if (a->dw)
            for (int i = i0; i < i1; i++) a->dw[i] += g[i] * ((xr[i] - mu) * rs);
        if (a->db)
            for (int i = i0; i < i1; i++) a->db[i] += g[i];
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

/* RMSNorm backward the same way: rows (dx, each row's 1/rms kept) on the
 * pool, then column blocks of dscale summed over rows in row order. */
typedef struct {
    float *dx, *dscale, *rs;
    const float *dy, *x, *scale;
    int rows, width;
    float eps;
} rmsbw_arg;
static void rmsbw_rows(void *p, long long b, long long e, int tid) {
    (void)tid;
    const rmsbw_arg *a = p;
    const int W = a->width;
    for (long long r = b; r < e; r++) {
        const float *xr = a->x + (size_t)r * W;
        const float rs = dcs_rms_row_inv(xr, W, a->eps);
        if (a->rs) a->rs[r] = rs;
        dcs_rmsnorm_row_bw(a->dx + (size_t)r * W, a->dy + (size_t)r * W, xr, a->scale, rs, W);
    }
}
static void rmsbw_cols(void *p, long long b, long long e, int tid) {
    (void)tid;
    const rmsbw_arg *a = p;
    const int W = a->width, i0 = (int)b * LNBW_COLS, i1 = (int)e * LNBW_COLS < W ? (int)e * LNBW_COLS : W;
    for (int r = 0; r < a->rows; r++) {
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

void cpu_col_sum(dcs_backend *be, float *db, const float *dy, int M, int N) {
    (void)be;
    for (int m = 0; m < M; m++)
        for (int o = 0; o < N; o++) db[o] += dy[(size_t)m * N + o];
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

/* sum_s x[s] y[s] over [s0, s1) in 8 interleaved partial sums (vectorisable;
 * a fixed order, so results do not depend on threads or alignment) */
static inline float dot8(const float *x, const float *y, int s0, int s1) {
    float acc[8] = {0};
    int s = s0;
    for (; s + 8 <= s1; s += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[s + j] * y[s + j];
    float r = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; s < s1; s++) r += x[s] * y[s];
    return r;
}

/* Backward of plain DCMHA's compose for the query row (b, t), vectorised
 * along the keys s in [s0, s1): g = dOut rows (stride TT), a the input. da
 * (stride TT) += ; query-side dqw1, dqw2 [R, N], dqdd [N] += ; key-side
 * dkw1T, dkw2T [R, N, T], dkddT [N, T] += (transposed, NULL when
 * query_wise). `on` masks the branches as in dcs_compose_pair_bw_var, whose
 * sums these are in another order. tmp: 4*R*T floats. In the per-ISA clones
 * (cpu_vec.h): dot8's fixed lanes keep the bits the same in each. */
DCS_VEC static void compose_row_bw(const float *a, const float *g, float *da, long long TT, int N, int R,
                                   int T, int s0, int s1, const float *qw1, const float *qw2,
                                   const float *kw1T, const float *kw2T, const float *qdd, const float *kddT,
                                   float *dqw1, float *dqw2, float *dkw1T, float *dkw2T, float *dqdd,
                                   float *dkddT, unsigned on, float *tmp) {
    float *qi = tmp, *ki = tmp + (size_t)R * T, *gq = tmp + 2 * (size_t)R * T, *gk = tmp + 3 * (size_t)R * T;
    const int keys = kw1T != NULL;
    for (int i = 0; i < R; i++) {
        float *q = qi + (size_t)i * T, *k = ki + (size_t)i * T, *tq = gq + (size_t)i * T,
              *tk = gk + (size_t)i * T;
        for (int s = s0; s < s1; s++) q[s] = 0.0f, k[s] = 0.0f, tq[s] = 0.0f, tk[s] = 0.0f;
        for (int n = 0; n < N; n++) {
            const float *an = a + n * TT, *gn = g + n * TT, w1 = qw1[i * N + n], w2 = qw2[i * N + n];
            for (int s = s0; s < s1; s++) q[s] += an[s] * w1;
            for (int s = s0; s < s1; s++) tq[s] += gn[s] * w2;
            if (keys) {
                const float *k1 = kw1T + ((size_t)i * N + n) * T, *k2 = kw2T + ((size_t)i * N + n) * T;
                for (int s = s0; s < s1; s++) k[s] += an[s] * k1[s];
                for (int s = s0; s < s1; s++) tk[s] += gn[s] * k2[s];
            }
        }
    }
    for (int n = 0; n < N; n++) {
        const float *an = a + n * TT, *gn = g + n * TT;
        float *d = da + n * TT;
        float c = (on & 1) ? 1.0f : 0.0f;
        if (on & 8) {
            c += qdd[n];
            dqdd[n] += dot8(gn, an, s0, s1);
        }
        for (int s = s0; s < s1; s++) d[s] += gn[s] * c;
        if ((on & 16) && keys) {
            const float *kd = kddT + (size_t)n * T;
            float *dkd = dkddT + (size_t)n * T;
            /* one store per loop: each vectorises */
            for (int s = s0; s < s1; s++) d[s] += gn[s] * kd[s];
            for (int s = s0; s < s1; s++) dkd[s] += gn[s] * an[s];
        }
        for (int i = 0; i < R; i++) {
            if (on & 2) {
                const float *tq = gq + (size_t)i * T, *q = qi + (size_t)i * T, w1 = qw1[i * N + n];
                for (int s = s0; s < s1; s++) d[s] += tq[s] * w1;
                dqw1[i * N + n] += dot8(tq, an, s0, s1);
                dqw2[i * N + n] += dot8(q, gn, s0, s1);
            }
            if ((on & 4) && keys) {
                const float *tk = gk + (size_t)i * T, *k = ki + (size_t)i * T;
                const float *k1 = kw1T + ((size_t)i * N + n) * T;
                float *d1 = dkw1T + ((size_t)i * N + n) * T, *d2 = dkw2T + ((size_t)i * N + n) * T;
                for (int s = s0; s < s1; s++) d[s] += tk[s] * k1[s];
                for (int s = s0; s < s1; s++) d1[s] += tk[s] * an[s];
                for (int s = s0; s < s1; s++) d2[s] += k[s] * gn[s];
            }
        }
    }
}

/* the allowed keys of query t: [s0, t] */
static int first_key(int t, int window) { return window > 0 && t > window ? t - window : 0; }

/* x [B, T, C] -> xT [B, C, T] (C = R*N or N), and back */
static void to_keys_T(float *xT, const float *x, int B, int T, int C) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < C; c++) xT[((size_t)b * C + c) * T + t] = x[((size_t)b * T + t) * C + c];
}
static void from_keys_T(float *x, const float *xT, int B, int T, int C) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < C; c++) x[((size_t)b * T + t) * C + c] = xT[((size_t)b * C + c) * T + t];
}

typedef struct {
    const dcs_compose_bw_args *a;
    volatile int failed; /* a chunk could not get its scratch */
} cb_arg;

/* plain DCMHA, sequences [b_from, b_to): key-side gradients of (b, s)
 * gather over the queries t of the same sequence only */
static void compose_bw_seqs(void *p, long long b_from, long long b_to, int tid) {
    (void)tid;
    cb_arg *ca = p;
    const dcs_compose_bw_args *a = ca->a;
    const int T = a->T, N = a->N, R = a->R, RN = R * N;
    const long long TT = (long long)T * T;
    const int keys = a->kw1 != NULL;
    float *const *kT = a->scratch, *const *dkT = a->scratch + 3;
    float *tmp = malloc(sizeof(float) * 4 * (size_t)R * T);
    if (!tmp) {
        ca->failed = 1;
        return;
    }
    for (long long b = b_from; b < b_to; b++)
        for (int t = 0; t < T; t++) {
            const size_t bt = (size_t)b * T + t;
            const long long o = (long long)b * N * TT + (long long)t * T;
            compose_row_bw(a->in + o, a->dOut + o, a->dIn + o, TT, N, R, T, first_key(t, a->window), t + 1,
                           a->qw1 + bt * RN, a->qw2 + bt * RN, keys ? kT[0] + (size_t)b * RN * T : NULL,
                           keys ? kT[1] + (size_t)b * RN * T : NULL, a->qdd + bt * N,
                           keys ? kT[2] + (size_t)b * N * T : NULL, a->dqw1 + bt * RN, a->dqw2 + bt * RN,
                           keys ? dkT[0] + (size_t)b * RN * T : NULL,
                           keys ? dkT[1] + (size_t)b * RN * T : NULL, a->dqdd + bt * N,
                           keys ? dkT[2] + (size_t)b * N * T : NULL, a->on, tmp);
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

/* Plain DCMHA (query side present, one group, no static map) by query rows
 * on the pool (compose_row_bw; the key side transposed into the scratch);
 * every variant pair by pair. */
void cpu_compose_bw(dcs_backend *be, const dcs_compose_bw_args *a) {
    const int B = a->B, T = a->T, N = a->N, R = a->R, M = B * T;
    const size_t RN = (size_t)R * N;
    const int rows = a->qw1 && a->G == 1 && !a->sw && (!a->kw1 || a->scratch[0]);
    if (!rows) {
        compose_bw_pairs(a);
        return;
    }
    memset(a->dIn, 0, sizeof(float) * (size_t)B * N * T * T);
    float *const dyn[3] = {a->dqw1, a->dqw2, a->dqdd};
    for (int i = 0; i < 3; i++) memset(dyn[i], 0, sizeof(float) * (size_t)M * (i < 2 ? RN : (size_t)N));
    cb_arg ca = {a, 0};
    if (a->kw1) {
        to_keys_T(a->scratch[0], a->kw1, B, T, (int)RN);
        to_keys_T(a->scratch[1], a->kw2, B, T, (int)RN);
        to_keys_T(a->scratch[2], a->kdd, B, T, N);
        for (int i = 0; i < 3; i++)
            memset(a->scratch[3 + i], 0, sizeof(float) * (size_t)M * (i < 2 ? RN : (size_t)N));
    }
    par(be, compose_bw_seqs, &ca, B, (long long)T * T * N * R * 4);
    if (ca.failed) { /* no scratch for a chunk: the same sums pair by pair */
        compose_bw_pairs(a);
        return;
    }
    if (a->kw1) {
        from_keys_T(a->dkw1, a->scratch[3], B, T, (int)RN);
        from_keys_T(a->dkw2, a->scratch[4], B, T, (int)RN);
        from_keys_T(a->dkdd, a->scratch[5], B, T, N);
    }
}

/* ---------------------------------------------------------------- scratch */

/* The largest malloc one backward operation above makes for a tape of
 * shape s: layernorm_bw's statistics [2, M], rotary_bw's angles [T, rot/2]
 * (cos, sin), or compose_bw's row kernel's [4, R, T] per chunk, one chunk
 * per thread at a time. */
uint64_t cpu_bw_scratch_bytes(const dcs_bw_shape *s, int n_threads) {
    const uint64_t M = (uint64_t)s->B * s->T;
    uint64_t n = 2 * M;
    const uint64_t rot = 2 * (uint64_t)s->T * (s->rot / 2 > 0 ? s->rot / 2 : 1);
    if (rot > n) n = rot;
    if (s->rows_kernel) {
        const uint64_t cmp = (uint64_t)(n_threads > 0 ? n_threads : 1) * 4 * (uint64_t)s->R * s->T;
        if (cmp > n) n = cmp;
    }
    return n * sizeof(float);
}
