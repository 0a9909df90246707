/*
 * backward.c -- the ops of the training / attribution graph, each forward
 * that must keep statistics paired with its backward, llm.c style: plain
 * loops on host float32 arrays, shapes in the comments, checked against
 * finite differences by engine/tests/test_backward.c. Each backward runs
 * the per-row function of dcs_math.h (dcs_*_row_bw, dcs_gelu_grad) that the
 * backends' backward operations run for the tape (cpu_backward.c,
 * cuda_backward.cuh), so those checks cover the tape's math. Backward
 * functions ACCUMULATE into their input gradients (+=) and into parameter
 * gradients (+=, skipped when the gradient pointer is NULL), so a tensor
 * read by several ops gathers every contribution.
 *
 * The per-element math (gelu, allowed, rotary angles, compose of a pair)
 * is the forward's, from dcs_math.h.
 */
/* The row loops below are written to vectorise along s; gcc does that
 * from -O3 (or -ftree-vectorize), the build uses -O2. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("tree-vectorize")
#endif

#include "backward.h"
#include "dcs_math.h"

#include <math.h>
#include <string.h>

/* ---------------------------------------------------------------- LayerNorm */

/* out [M, D] = (x - mean) * rstd * w + b; keeps mean, rstd [M]. The CPU
 * backend's arithmetic: dcs_layernorm_row. */
void dcs_layernorm_fw(float *out, float *mean, float *rstd, const float *x, const float *w, const float *b,
                      int M, int D, float eps) {
    for (int m = 0; m < M; m++)
        dcs_layernorm_row(out + (size_t)m * D, x + (size_t)m * D, w, b, D, eps, &mean[m], &rstd[m]);
}

/* dx [M, D] += dLN/dx . dy; dw, db [D] += (may be NULL). */
void dcs_layernorm_bw(float *dx, float *dw, float *db, const float *dy, const float *x, const float *mean,
                      const float *rstd, const float *w, int M, int D) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * D, *g = dy + (size_t)m * D;
        const float mu = mean[m], rs = rstd[m];
        dcs_layernorm_row_bw(dx + (size_t)m * D, g, xr, w, mu, rs, D);
        for (int i = 0; i < D; i++) {
            if (dw) dw[i] += g[i] * ((xr[i] - mu) * rs);
            if (db) db[i] += g[i];
        }
    }
}

/* ---------------------------------------------------------------- RMS norm */

/* x [rows, width] in place: x * rstd * scale (scale may be NULL); keeps rstd [rows]. */
void dcs_rmsnorm_fw(float *x, float *rstd, int rows, int width, const float *scale, float eps) {
    for (int r = 0; r < rows; r++) {
        float *v = x + (size_t)r * width;
        float ss = 0.0f;
        for (int i = 0; i < width; i++) ss += v[i] * v[i];
        float inv = dcs_rms_inv(ss, width, eps);
        for (int i = 0; i < width; i++) v[i] = v[i] * inv * (scale ? scale[i] : 1.0f);
        rstd[r] = inv;
    }
}

/* Backward from the OUTPUT y (x = y / (rstd * scale) is not needed: with
 * xn = x * rstd, dx = rstd * (dy*s - xn * mean(dy*s*xn))). y [rows, width]
 * is the normalised output; dscale [width] += sum dy * xn. In place on dy
 * is not allowed; dx += . */
void dcs_rmsnorm_bw(float *dx, float *dscale, const float *dy, const float *xn_raw, const float *rstd,
                    int rows, int width, const float *scale) {
    for (int r = 0; r < rows; r++) {
        const float *g = dy + (size_t)r * width, *xr = xn_raw + (size_t)r * width;
        dcs_rmsnorm_row_bw(dx + (size_t)r * width, g, xr, scale, rstd[r], width);
        if (dscale)
            for (int i = 0; i < width; i++) dscale[i] += g[i] * (xr[i] * rstd[r]);
    }
}

/* ---------------------------------------------------------------- rotary */

/* cs [T, rot/2, 2] cos/sin table of model-spec 2 step 3. */
void dcs_rotary_table(float *cs, int T, int rot, float base) {
    int half = rot / 2;
    for (int t = 0; t < T; t++)
        for (int j = 0; j < half; j++)
            dcs_rotary_cs(t, j, rot, base, &cs[((size_t)t * half + j) * 2],
                          &cs[((size_t)t * half + j) * 2 + 1]);
}

/* x [M, N, Dh] in place, position m % T; inverse = 1 rotates by -angle
 * (the backward of a rotation is its transpose). */
void dcs_rotary_apply(float *x, const float *cs, int M, int T, int N, int Dh, int rot, int inverse) {
    int half = rot / 2;
    for (int m = 0; m < M; m++) {
        const float *c = cs + (size_t)(m % T) * half * 2;
        for (int n = 0; n < N; n++) {
            float *h = x + ((size_t)m * N + n) * Dh;
            for (int j = 0; j < half; j++)
                dcs_rotate_pair(&h[j], &h[j + half], c[2 * j], inverse ? -c[2 * j + 1] : c[2 * j + 1]);
        }
    }
}

/* ---------------------------------------------------------------- gelu, tanh */

/* dx [n] += dy * gelu'(x) */
void dcs_gelu_bw(float *dx, const float *dy, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) dx[i] += dy[i] * dcs_gelu_grad(x[i]);
}

/* dx [n] += dy * (1 - y^2), y = tanh(x) */
void dcs_tanh_bw(float *dx, const float *dy, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++) dx[i] += dy[i] * (1.0f - y[i] * y[i]);
}

/* ---------------------------------------------------------------- softmax */

/* x [BN, T, S] in place: masked softmax over s (allowed entries), masked -> 0.
 * The backends' arithmetic: dcs_softmax_row. */
void dcs_softmax_fw(float *x, long long rows_from, long long rows_to, int T, int S, int window) {
    for (long long r = rows_from; r < rows_to; r++)
        dcs_softmax_row(x + (size_t)r * S, S, (int)(r % T), 0, window);
}

/* dA [BN, T, S] = P * (dP - sum_s P dP) on allowed entries, 0 elsewhere
 * (written, not accumulated). */
void dcs_softmax_bw(float *dA, const float *dP, const float *P, long long rows_from, long long rows_to, int T,
                    int S, int window) {
    for (long long r = rows_from; r < rows_to; r++)
        dcs_softmax_row_bw(dA + (size_t)r * S, dP + (size_t)r * S, P + (size_t)r * S, S, (int)(r % T),
                           window);
}

/* ---------------------------------------------------------------- compose */

/* Backward of dcs_compose_pair for one (t, s) pair. g [N] (stride) is
 * dOut, a [N] (stride) the input. da (stride) += ; dqw1, dqw2 [R, N],
 * dqdd [N] (query side) and dkw1, dkw2, dkdd (key side, NULL when
 * query_wise) +=. `on` masks the branches (bit k: skip, qp, kp, qg, kg):
 * a branch replaced by a hook passes no gradient upstream. */
void dcs_compose_pair_bw(const float *a, const float *g, float *da, long long stride, int N, int R,
                         const float *qw1, const float *qw2, const float *kw1, const float *kw2,
                         const float *qdd, const float *kdd, float *dqw1, float *dqw2, float *dkw1,
                         float *dkw2, float *dqdd, float *dkdd, unsigned on) {
    /* one group, no static map: the general pair backward of dcs_math.h */
    dcs_compose_pair_bw_var(a, g, da, stride, N, 1, R, qw1, qw2, kw1, kw2, qdd, kdd, NULL, dqw1, dqw2, dkw1,
                            dkw2, dqdd, dkdd, NULL, on);
}
