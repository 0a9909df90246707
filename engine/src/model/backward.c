/*
 * backward.c -- the ops of the training / attribution graph (tape.c), each
 * forward that must keep statistics paired with its backward, llm.c style:
 * plain loops on host float32 arrays, shapes in the comments. Backward
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
void dcs_layernorm_bw_rows(float *dx, const float *dy, const float *x, const float *mean, const float *rstd,
                           const float *w, int m_from, int m_to, int D) {
    for (int m = m_from; m < m_to; m++) {
        const float *xr = x + (size_t)m * D, *g = dy + (size_t)m * D;
        float *dxr = dx + (size_t)m * D;
        const float mu = mean[m], rs = rstd[m];
        double s1 = 0, s2 = 0; /* mean(dy*w), mean(dy*w*xhat) */
        for (int i = 0; i < D; i++) {
            float xh = (xr[i] - mu) * rs, gw = g[i] * w[i];
            s1 += gw;
            s2 += gw * xh;
        }
        float m1 = (float)(s1 / D), m2 = (float)(s2 / D);
        for (int i = 0; i < D; i++) {
            float xh = (xr[i] - mu) * rs;
            dxr[i] += (g[i] * w[i] - m1 - xh * m2) * rs;
        }
    }
}

void dcs_layernorm_bw_params(float *dw, float *db, const float *dy, const float *x, const float *mean,
                             const float *rstd, int M, int D, int i_from, int i_to) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * D, *g = dy + (size_t)m * D;
        const float mu = mean[m], rs = rstd[m];
        for (int i = i_from; i < i_to; i++) {
            if (dw) dw[i] += g[i] * ((xr[i] - mu) * rs);
            if (db) db[i] += g[i];
        }
    }
}

void dcs_layernorm_bw(float *dx, float *dw, float *db, const float *dy, const float *x, const float *mean,
                      const float *rstd, const float *w, int M, int D) {
    dcs_layernorm_bw_rows(dx, dy, x, mean, rstd, w, 0, M, D);
    if (dw || db) dcs_layernorm_bw_params(dw, db, dy, x, mean, rstd, M, D, 0, D);
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
        float *d = dx + (size_t)r * width;
        const float rs = rstd[r];
        float dot = 0.0f;
        for (int i = 0; i < width; i++) dot += g[i] * (scale ? scale[i] : 1.0f) * xr[i] * rs;
        dot /= (float)width;
        for (int i = 0; i < width; i++) {
            float xn = xr[i] * rs, gs = g[i] * (scale ? scale[i] : 1.0f);
            d[i] += rs * (gs - xn * dot);
            if (dscale) dscale[i] += g[i] * xn;
        }
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
    for (long long r = rows_from; r < rows_to; r++) {
        const int t = (int)(r % T);
        const float *p = P + (size_t)r * S, *g = dP + (size_t)r * S;
        float *d = dA + (size_t)r * S;
        float dot = 0.0f;
        for (int s = 0; s < S; s++)
            if (dcs_allowed(t, s, window)) dot += p[s] * g[s];
        for (int s = 0; s < S; s++) d[s] = dcs_allowed(t, s, window) ? p[s] * (g[s] - dot) : 0.0f;
    }
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

/* ---------------------------------------------------------------- compose, by rows */

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

/* Compose of one query row (b, t) over its allowed keys s in [s0, s1),
 * vectorised along s. a, out: [N] rows of stride TT starting at (t, 0), so
 * a[n*TT + s]. Query-side weights of t: qw1, qw2 [R, N], qdd [N]; key-side
 * weights transposed to [R, N, T] (kw1T, kw2T) and [N, T] (kddT) so that s
 * runs contiguously (NULL: query_wise). tmp: 2*R*T floats. Same sums as
 * dcs_compose_pair, in a different order. */
void dcs_compose_row_fw(const float *a, float *out, long long TT, int N, int R, int T, int s0, int s1,
                        const float *qw1, const float *qw2, const float *kw1T, const float *kw2T,
                        const float *qdd, const float *kddT, float *tmp) {
    float *qi = tmp, *ki = tmp + (size_t)R * T;
    for (int i = 0; i < R; i++) {
        float *q = qi + (size_t)i * T, *k = ki + (size_t)i * T;
        for (int s = s0; s < s1; s++) q[s] = 0.0f, k[s] = 0.0f;
        for (int n = 0; n < N; n++) {
            const float *an = a + n * TT, w = qw1[i * N + n];
            for (int s = s0; s < s1; s++) q[s] += an[s] * w;
            if (kw1T) {
                const float *kw = kw1T + ((size_t)i * N + n) * T;
                for (int s = s0; s < s1; s++) k[s] += an[s] * kw[s];
            }
        }
    }
    for (int m = 0; m < N; m++) {
        const float *am = a + m * TT;
        float *o = out + m * TT;
        const float g = 1.0f + qdd[m];
        if (kddT) {
            const float *kd = kddT + (size_t)m * T;
            for (int s = s0; s < s1; s++) o[s] = am[s] * (g + kd[s]);
        } else {
            for (int s = s0; s < s1; s++) o[s] = am[s] * g;
        }
        for (int i = 0; i < R; i++) {
            const float *q = qi + (size_t)i * T, w = qw2[i * N + m];
            for (int s = s0; s < s1; s++) o[s] += q[s] * w;
            if (kw2T) {
                const float *k = ki + (size_t)i * T, *kw = kw2T + ((size_t)i * N + m) * T;
                for (int s = s0; s < s1; s++) o[s] += k[s] * kw[s];
            }
        }
    }
}

/* Backward of dcs_compose_row_fw for the row (b, t): g = dOut rows (stride
 * TT). da (stride TT) += ; query-side dqw1, dqw2 [R, N], dqdd [N] += ;
 * key-side dkw1T, dkw2T [R, N, T], dkddT [N, T] += (transposed, NULL when
 * query_wise). `on` masks the branches as in dcs_compose_pair_bw. tmp:
 * 4*R*T floats. */
void dcs_compose_row_bw(const float *a, const float *g, float *da, long long TT, int N, int R, int T, int s0,
                        int s1, const float *qw1, const float *qw2, const float *kw1T, const float *kw2T,
                        const float *qdd, const float *kddT, float *dqw1, float *dqw2, float *dkw1T,
                        float *dkw2T, float *dqdd, float *dkddT, unsigned on, float *tmp) {
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
