/*
 * topk_sparse.c -- TopK's products through its kept features alone: of
 * acts [N, F] only k entries per row are not 0 (s->kept [N, k], best
 * first), so the decoder's product, the decoder's gradient, dL/dacts and
 * the encoder's gradient cost N k d instead of N F d (the encoder's own
 * product, x @ W_enc, stays a GEMM). Each output element adds its terms in
 * a fixed order (rows, then kept slots), whatever the thread count.
 */
#include "dcs_features.h"

#include <string.h>

#define COLS 64     /* W_enc rows per work item */
#define DEC_COLS 16 /* W_dec columns per work item: F x DEC_COLS floats stay in cache */

/* fn over [0, n) on the SAE's pool (or here, without one). */
static void par(dcs_sae *s, dcs_par_fn fn, void *arg, long long n, long long cost) {
    if (s->be->ops->parallel)
        s->be->ops->parallel(s->be, fn, arg, n, cost);
    else
        fn(arg, 0, n, 0);
}

/* recon [N, d_out] = acts @ W_dec (rows [b, e)). */
static void decode_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    dcs_sae *s = arg;
    const int F = s->c.d_sae, d = s->c.d_out, k = s->c.k;
    const float *wd = s->t[DCS_SAE_PARAM][DCS_SAE_W_DEC];
    for (long long r = b; r < e; r++) {
        float *out = s->recon + r * d;
        memset(out, 0, (size_t)d * sizeof(float));
        for (int j = 0; j < k; j++) {
            const int f = s->kept[r * k + j];
            const float a = s->acts[r * F + f];
            if (a == 0.0f) continue;
            const float *w = wd + (size_t)f * d;
            for (int c = 0; c < d; c++) out[c] += a * w[c];
        }
    }
}

void dcs_sae_topk_decode(dcs_sae *s, int N) { par(s, decode_rows, s, N, 2LL * s->c.k * s->c.d_out); }

typedef struct {
    dcs_sae *s;
    const float *xin;
    int N;
} bw_arg;

/* dW_dec [F, d_out] (columns of block [b, e)) = acts^T @ dR, dR in s->recon. */
static void dwdec_cols(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const bw_arg *a = arg;
    dcs_sae *s = a->s;
    const int F = s->c.d_sae, d = s->c.d_out, k = s->c.k;
    float *g = s->t[DCS_SAE_GRAD][DCS_SAE_W_DEC];
    const int c0 = (int)b * DEC_COLS, c1 = (int)e * DEC_COLS < d ? (int)e * DEC_COLS : d;
    for (int f = 0; f < F; f++) memset(g + (size_t)f * d + c0, 0, (size_t)(c1 - c0) * sizeof(float));
    for (long long r = 0; r < a->N; r++)
        for (int j = 0; j < k; j++) {
            const int f = s->kept[r * k + j];
            const float v = s->acts[r * F + f];
            if (v == 0.0f) continue;
            const float *dr = s->recon + r * d;
            float *gf = g + (size_t)f * d;
            for (int c = c0; c < c1; c++) gf[c] += v * dr[c];
        }
}

/* dpre at the kept slots, [N, k] in s->dacts (rows [b, e)): dR[r] . W_dec[f] where
 * acts != 0, else 0 (dpre is 0 off the kept features). */
static void dpre_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const bw_arg *a = arg;
    dcs_sae *s = a->s;
    const int F = s->c.d_sae, d = s->c.d_out, k = s->c.k;
    const float *wd = s->t[DCS_SAE_PARAM][DCS_SAE_W_DEC];
    for (long long r = b; r < e; r++) {
        const float *dr = s->recon + r * d;
        for (int j = 0; j < k; j++) {
            const int f = s->kept[r * k + j];
            float acc = 0.0f;
            if (s->acts[r * F + f] != 0.0f) {
                const float *w = wd + (size_t)f * d;
                for (int c = 0; c < d; c++) acc += dr[c] * w[c];
            }
            s->dacts[r * k + j] = acc;
        }
    }
}

/* dW_enc [d_in, F] (its rows [b, e) of blocks of COLS) = xin^T @ dpre. */
static void dwenc_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const bw_arg *a = arg;
    dcs_sae *s = a->s;
    const int F = s->c.d_sae, din = s->c.d_in, k = s->c.k;
    float *g = s->t[DCS_SAE_GRAD][DCS_SAE_W_ENC];
    const int i0 = (int)b * COLS, i1 = (int)e * COLS < din ? (int)e * COLS : din;
    for (int i = i0; i < i1; i++) {
        float *gi = g + (size_t)i * F; /* one row of dW_enc: in cache over every (r, j) */
        memset(gi, 0, (size_t)F * sizeof(float));
        for (long long r = 0; r < a->N; r++) {
            const float xi = a->xin[r * din + i];
            for (int j = 0; j < k; j++) {
                const int f = s->kept[r * k + j];
                gi[f] += xi * s->dacts[r * k + j];
            }
        }
    }
}

void dcs_sae_topk_backward(dcs_sae *s, const float *xin, int N, int64_t *fired) {
    bw_arg a = {s, xin, N};
    const int F = s->c.d_sae, k = s->c.k;
    const long long cost = (long long)N * k * COLS;
    par(s, dwdec_cols, &a, (s->c.d_out + DEC_COLS - 1) / DEC_COLS, (long long)N * k * DEC_COLS);
    par(s, dpre_rows, &a, N, 2LL * k * s->c.d_out);
    par(s, dwenc_rows, &a, (s->c.d_in + COLS - 1) / COLS, cost);
    float *gb = s->t[DCS_SAE_GRAD][DCS_SAE_B_ENC]; /* db_enc = sum_r dpre, in row order */
    memset(gb, 0, (size_t)F * sizeof(float));
    for (long long i = 0; i < (long long)N * k; i++) {
        gb[s->kept[i]] += s->dacts[i];
        if (fired) fired[s->kept[i]] += s->acts[(i / k) * F + s->kept[i]] != 0.0f;
    }
}
