/*
 * dcs_math.h -- the per-element math of the forward pass, written once and
 * compiled for both backends: plain static inline C for the CPU, and
 * __host__ __device__ functions when nvcc includes this file. The CPU tests
 * therefore exercise exactly the arithmetic the GPU kernels run.
 */
#ifndef DCS_MATH_H
#define DCS_MATH_H

#include "dcs_backend.h" /* dcs_compose_args, DCS_MAX_R, DCS_N_BRANCHES */

#include <math.h>

#ifdef __CUDACC__
#define DCS_HD __host__ __device__ static inline
#define DCS_HD_ROW DCS_HD
#else
#define DCS_HD static inline
/* inlined into the CPU backend's per-ISA clones, so each is vectorised */
#define DCS_HD_ROW static inline __attribute__((always_inline))
#endif

/* The masked-score value of the reference (fp16 lowest); exp() of it minus
 * any real score underflows to exactly 0 in float32. */
#define DCS_MASK_VALUE (-65504.0f)

/* erf in float32 without branches or calls, so the CPU's per-ISA clones
 * vectorise it (libm's erff is a scalar call: 7% of a D=1024 forward, issue 28):
 *   |x| < 1:      x P(x^2), P of degree 5;
 *   1 <= |x| < 4: Q((|x| - 2.5) / 1.5), Q of degree 12;
 *   |x| >= 4:     1 (erf(4) = 1 - 1.5e-8 rounds to 1).
 * Chebyshev fits, max |error| 1.2e-7 (2 ulp near 1; libm's erff: 1 ulp):
 * `python scripts/fit_erf.py` fits them and checks this float op order. */
DCS_HD float dcs_erf(float x) {
    const float a = fabsf(x), u = a * a;
    float p = -0.000565410592f;
    p = p * u + 0.00492327753f;
    p = p * u + -0.026716385f;
    p = p * u + 0.112803645f;
    p = p * u + -0.376123488f;
    p = p * u + 1.12837911f;
    p = a * p;
    const float t = ((a < 4.0f ? a : 4.0f) - 2.5f) * (1.0f / 1.5f);
    float q = -0.00113001803f;
    q = q * t + 0.00185156765f;
    q = q * t + 0.00342609966f;
    q = q * t + -0.0107976608f;
    q = q * t + 0.00748362578f;
    q = q * t + 0.00981079135f;
    q = q * t + -0.0321643278f;
    q = q * t + 0.0463220701f;
    q = q * t + -0.0436021946f;
    q = q * t + 0.028195845f;
    q = q * t + -0.012255908f;
    q = q * t + 0.003266969f;
    q = q * t + 0.999593079f;
    q = q < 1.0f ? q : 1.0f;
    const float r = a < 1.0f ? p : q; /* a >= 4 (or NaN: gelu stays NaN): Q(1) clipped to 1 */
    return copysignf(r, x);
}

/* exp in float32 without branches or calls (vectorisable, unlike libm's
 * expf): x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite, two-part ln2), e^r by
 * its Taylor polynomial to degree 7 (truncation 6e-9 relative), 2^n from
 * the exponent bits. Within 2 ulp of expf (scripts/fit_erf.py checks it);
 * 0 below -87.33 (expf gives denormals there, < 1.2e-38); NaN stays NaN. */
DCS_HD float dcs_exp(float x) {
    /* NaN mapped to 0 here (returned as NaN below): (int)NaN is undefined */
    const float xc = x != x ? 0.0f : (x < -87.33654f ? -87.33654f : (x > 88.7f ? 88.7f : x));
    const float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (xc - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.98412698e-4f; /* 1/7! */
    p = p * r + 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union {
        unsigned i;
        float f;
    } two_n;
    two_n.i = (unsigned)((int)n + 127) << 23; /* n in [-126, 128]: a biased exponent 1..255 */
    const float e = p * two_n.f;
    return x != x ? x : (x < -87.33654f ? 0.0f : e);
}

/* Lanes of the fixed-order partial sums of dcs_softmax_span. */
#define DCS_LANES 16

/* Exact (erf) GELU. */
DCS_HD float dcs_gelu(float x) { return 0.5f * x * (1.0f + dcs_erf(x * 0.70710678118654752f)); }

/* SwiGLU's product of one hidden unit (DCFormer++): silu(a) * b, with
 * silu(a) = a * sigmoid(a) = a / (1 + exp(-a)). */
DCS_HD float dcs_swiglu(float a, float b) { return a / (1.0f + expf(-a)) * b; }

/* The sparse dictionaries' activations (engine/src/features/): ReLU, and
 * JumpReLU's x H(x - threshold). */
DCS_HD float dcs_relu(float x) { return x > 0.0f ? x : 0.0f; }
DCS_HD float dcs_jumprelu(float x, float thr) { return x > thr ? x : 0.0f; }

/* JumpReLU's threshold gradient by the straight-through pseudo-derivative
 * (Rajamanoharan et al. 2024): one row's part for the parameter log theta at
 * pre-activation x, with g = dL/dacts there and l0 the L0 coefficient / rows:
 * d/dtheta of x H(x - theta) ~ -(theta / eps) K((x - theta) / eps), of the
 * L0 term H(x - theta) ~ -(1 / eps) K(...); K(u) = 1 on (-1/2, 1/2), else 0.
 * (The caller multiplies the sum by theta: the parameter is log theta.) */
DCS_HD double dcs_jumprelu_thr_grad(float x, float theta, float eps, float g, float l0) {
    const float u = (x - theta) / eps;
    return (u > -0.5f && u < 0.5f) ? -(double)(theta / eps) * g - l0 / eps : 0.0;
}

/* Is key s visible from query t? Causal, plus a local window when w > 0. */
DCS_HD int dcs_allowed(int t, int s, int window) { return s <= t && (window <= 0 || t - s <= window); }

/* Rotary angle of pair j (j < rot/2) at position pos: pos * base^(-2j/rot).
 * Computed in double so cos/sin are exact to float rounding. */
DCS_HD void dcs_rotary_cs(int pos, int j, int rot, float base, float *c, float *s) {
    double inv = pow((double)base, -2.0 * (double)j / (double)rot);
    double ang = (double)pos * inv;
    *c = (float)cos(ang);
    *s = (float)sin(ang);
}

/* GPT-NeoX rotate-half on one pair (x1 = x[j], x2 = x[j + rot/2]). */
DCS_HD void dcs_rotate_pair(float *x1, float *x2, float c, float s) {
    float a = *x1, b = *x2;
    *x1 = a * c - b * s;
    *x2 = b * c + a * s;
}

/* 1 / sqrt(mean(x^2) + eps) for a sum of squares over n elements. */
DCS_HD float dcs_rms_inv(float sumsq, int n, float eps) { return 1.0f / sqrtf(sumsq / (float)n + eps); }

/* LayerNorm of one row x [D] into y [D] (may alias x):
 *   y = (x - mean) / sqrt(var + eps) * w + b      (w, b [D], each may be NULL)
 * The statistics accumulate in double, in index order, on every backend (the
 * CPU backend, the CUDA kernel, one thread per row, and the tape), so the
 * GPU's rows equal the CPU's up to libm; float accumulation over D = 4096
 * would move the CPU's parity with the reference. mean and rstd (NULL: not
 * wanted) receive the statistics the backward pass needs. */
/* The statistics of dcs_layernorm_row: mean (double) and 1/std of x [D]. */
DCS_HD float dcs_layernorm_stats(const float *x, int D, float eps, double *mean) {
    double mu = 0, var = 0;
    for (int i = 0; i < D; i++) mu += x[i];
    mu /= D;
    for (int i = 0; i < D; i++) var += (x[i] - mu) * (x[i] - mu);
    var /= D;
    *mean = mu;
    return (float)(1.0 / sqrt(var + eps));
}

DCS_HD void dcs_layernorm_row(float *y, const float *x, const float *w, const float *b, int D, float eps,
                              float *mean, float *rstd) {
    double mu;
    float inv = dcs_layernorm_stats(x, D, eps, &mu);
    if (mean) *mean = (float)mu;
    if (rstd) *rstd = inv;
    for (int i = 0; i < D; i++) y[i] = ((float)(x[i] - mu) * inv) * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
}

/* Rows a LayerNorm kernel takes side by side (the CPU's): independent sum
 * chains, so the statistics' double adds overlap instead of waiting on each
 * other; each row's sums keep dcs_layernorm_stats' order (the same bits). */
#define DCS_LN_ROWS 8

/* dcs_layernorm_stats of rows (<= DCS_LN_ROWS) rows x [rows, D], side by side. */
DCS_HD_ROW void dcs_layernorm_stats_rows(const float *x, int D, int rows, float eps, double *mean,
                                         float *rs) {
    double mu[DCS_LN_ROWS], var[DCS_LN_ROWS];
    for (int j = 0; j < rows; j++) mu[j] = 0, var[j] = 0;
    for (int i = 0; i < D; i++)
        for (int j = 0; j < rows; j++) mu[j] += x[(size_t)j * D + i];
    for (int j = 0; j < rows; j++) mu[j] /= D;
    for (int i = 0; i < D; i++)
        for (int j = 0; j < rows; j++) {
            const double c = x[(size_t)j * D + i] - mu[j];
            var[j] += c * c;
        }
    for (int j = 0; j < rows; j++) {
        mean[j] = mu[j];
        rs[j] = (float)(1.0 / sqrt(var[j] / D + eps));
    }
}

/* dcs_layernorm_rows' output y [rows, D] from its statistics mu, inv
 * (dcs_layernorm_stats_rows of x). */
DCS_HD_ROW void dcs_layernorm_rows_out(float *y, const float *x, const float *w, const float *b, int D,
                                       int rows, const double *mu, const float *inv) {
    for (int j = 0; j < rows; j++) {
        const float *xj = x + (size_t)j * D;
        float *yj = y + (size_t)j * D;
        for (int i = 0; i < D; i++)
            yj[i] = ((float)(xj[i] - mu[j]) * inv[j]) * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
    }
}

/* dcs_layernorm_row of rows (<= DCS_LN_ROWS) rows side by side: the same bits. */
DCS_HD_ROW void dcs_layernorm_rows(float *y, const float *x, const float *w, const float *b, int D, int rows,
                                   float eps) {
    double mu[DCS_LN_ROWS];
    float inv[DCS_LN_ROWS];
    dcs_layernorm_stats_rows(x, D, rows, eps, mu, inv);
    dcs_layernorm_rows_out(y, x, w, b, D, rows, mu, inv);
}

/* One AdamW element (decoupled weight decay): mom and var updated in place,
 * the new weight returned; b1c, b2c the bias corrections 1 - beta^step. */
DCS_HD float dcs_adamw_elem(float p, float g, float *mom, float *var, float beta1, float beta2, float b1c,
                            float b2c, float eps, float lr, float wd) {
    const float mm = *mom = beta1 * *mom + (1.0f - beta1) * g;
    const float vv = *var = beta2 * *var + (1.0f - beta2) * g * g;
    const float upd = (mm / b1c) / (sqrtf(vv / b2c) + eps);
    return p - lr * (upd + wd * p);
}

/* Compose one (query t, key s) pair across heads, model-spec 2 step 6 and
 * section 5, within each of G groups of Mg = N/G heads (G = 1: all heads):
 *   out[m] = a[m] + sum_i (sum_n a[n] qw1[i,n]) qw2[i,m]
 *                 + sum_i (sum_n a[n] kw1[i,n]) kw2[i,m]
 *                 + a[m] qdd[m] + a[m] kdd[m] + sum_n a[n] sw[n,m]
 * where n runs over m's group only and sw is that group's [Mg, Mg] block.
 * a and out are strided by `stride` (the N axis of an [N, T, S] tensor);
 * out may alias a. qw1, qw2, kw1, kw2 are [R, N] (kw* NULL: query_wise,
 * qw* NULL: key_wise), qdd, kdd are [N] (NULL likewise), sw [G, Mg, Mg] or NULL (then
 * Mg <= DCS_MAX_SW_HEADS is not needed). The b_* outputs (each may be
 * NULL) receive the skip, qp, kp, qg, kg, static contributions. */
/* The plain case (one group, no static map, query side present): one pass
 * over the heads with no per-element tests of the variants; the same sums in
 * the same order as the general case below. */
DCS_HD void dcs_compose_pair_plain(const float *a, float *out, long long stride, int N, int R,
                                   const float *qw1, const float *qw2, const float *kw1, const float *kw2,
                                   const float *qdd, const float *kdd, float *b_skip, float *b_qp,
                                   float *b_kp, float *b_qg, float *b_kg, float *b_st) {
    float qi[DCS_MAX_R], ki[DCS_MAX_R];
    for (int i = 0; i < R; i++) {
        float sq = 0.0f, sk = 0.0f;
        for (int n = 0; n < N; n++) {
            float an = a[(long long)n * stride];
            sq += an * qw1[i * N + n];
            if (kw1) sk += an * kw1[i * N + n];
        }
        qi[i] = sq;
        ki[i] = sk;
    }
    for (int m = 0; m < N; m++) {
        long long o = (long long)m * stride;
        float am = a[o];
        float qp = 0.0f, kp = 0.0f;
        for (int i = 0; i < R; i++) {
            qp += qi[i] * qw2[i * N + m];
            if (kw2) kp += ki[i] * kw2[i * N + m];
        }
        float qg = am * qdd[m];
        float kg = kdd ? am * kdd[m] : 0.0f;
        if (b_skip) b_skip[o] = am;
        if (b_qp) b_qp[o] = qp;
        if (b_kp) b_kp[o] = kp;
        if (b_qg) b_qg[o] = qg;
        if (b_kg) b_kg[o] = kg;
        if (b_st) b_st[o] = 0.0f;
        out[o] = am + qp + kp + qg + kg;
    }
}

/* The same composition for one query row t over a strip of L keys at once,
 * vectorised across keys (the key axis is contiguous; heads are `hs`
 * apart): a[n*hs + j] is the score of head n at key j of the strip. qw1,
 * qw2 [R, N] and qdd [N] belong to the query t; the key side is transposed,
 * kw1t[(i*N + n)*ks + j], kw2t likewise, kddt[n*ks + j] (all NULL:
 * query_wise). out may alias a. tmp holds (2R + 2) * L floats. br (NULL,
 * or entries NULL) receives the skip, qp, kp, qg, kg contributions laid out
 * like out. Every element goes through exactly the float operations of
 * dcs_compose_pair_plain (the case it covers: one group, no static map,
 * query side present), in the same order, so both give bit-identical results. */
/* dcs_compose_row's rank-2 case with both sides and no branches (the fused
 * forward's), its loops fused: one pass over the keys per source head (both
 * ranks, both sides) and one per target head (issue 28: a third of the
 * memory traffic). Each element sees the same operations in the same order
 * as the general loops below, so the same bits. */
DCS_HD_ROW void dcs_compose_pre_r2(const float *a, long long hs, int L, int N, const float *qw1,
                                   const float *__restrict__ kw1t, long long ks, float *__restrict__ q0,
                                   float *__restrict__ q1, float *__restrict__ k0, float *__restrict__ k1) {
    for (int j = 0; j < L; j++) q0[j] = q1[j] = k0[j] = k1[j] = 0.0f;
    for (int n = 0; n < N; n++) {
        const float *__restrict__ an = a + (long long)n * hs;
        const float *__restrict__ c0 = kw1t + (long long)n * ks, *__restrict__ c1 =
                                                                     kw1t + (long long)(N + n) * ks;
        const float w0 = qw1[n], w1 = qw1[N + n];
        for (int j = 0; j < L; j++) {
            const float x = an[j];
            q0[j] += x * w0;
            q1[j] += x * w1;
            k0[j] += x * c0[j];
            k1[j] += x * c1[j];
        }
    }
}
/* One output of the rank-2 post step from x = a[m, j], the pre step's q0,
 * q1, k0, k1 at j, the query's qw2 (v0, v1) and qdd (qd), the key's kw2
 * (c0, c1) and kdd (kd); zero: 0 of the operands' type. A macro, so the
 * CPU's blocks of keys (GCC vectors, cpu.c) run these operations too. */
#define DCS_COMPOSE_POST_R2(x, q0, q1, k0, k1, v0, v1, c0, c1, qd, kd, zero)                                 \
    ((x) + (((zero) + (q0) * (v0)) + (q1) * (v1)) + (((zero) + (k0) * (c0)) + (k1) * (c1)) + (x) * (qd) +    \
     (x) * (kd))
DCS_HD_ROW void dcs_compose_post_r2(const float *am, float *om, int L, const float *__restrict__ q0,
                                    const float *__restrict__ q1, const float *__restrict__ k0,
                                    const float *__restrict__ k1, float v0, float v1,
                                    const float *__restrict__ c0, const float *__restrict__ c1, float qd,
                                    const float *__restrict__ kd) {
    for (int j = 0; j < L; j++)
        om[j] = DCS_COMPOSE_POST_R2(am[j], q0[j], q1[j], k0[j], k1[j], v0, v1, c0[j], c1[j], qd, kd[j], 0.0f);
}

DCS_HD_ROW void dcs_compose_row(const float *a, float *out, long long hs, int L, int N, int R,
                                const float *qw1, const float *qw2, const float *kw1t, const float *kw2t,
                                long long ks, const float *qdd, const float *kddt, float *tmp,
                                float *const *br) {
    if (R == 2 && kw1t && kw2t && kddt && !br) {
        float *q0 = tmp, *q1 = tmp + L, *k0 = tmp + 2LL * L, *k1 = tmp + 3LL * L;
        dcs_compose_pre_r2(a, hs, L, N, qw1, kw1t, ks, q0, q1, k0, k1);
        for (int m = 0; m < N; m++)
            dcs_compose_post_r2(a + (long long)m * hs, out + (long long)m * hs, L, q0, q1, k0, k1, qw2[m],
                                qw2[N + m], kw2t + (long long)m * ks, kw2t + (long long)(N + m) * ks, qdd[m],
                                kddt + (long long)m * ks);
        return;
    }
    float *qi = tmp, *ki = tmp + (long long)R * L;
    float *qp = tmp + 2LL * R * L, *kp = qp + L;
    for (int i = 0; i < R; i++) {
        float *q = qi + (long long)i * L, *k = ki + (long long)i * L;
        for (int j = 0; j < L; j++) q[j] = 0.0f;
        for (int j = 0; j < L; j++) k[j] = 0.0f;
        for (int n = 0; n < N; n++) {
            const float *an = a + (long long)n * hs;
            const float w = qw1[i * N + n];
            for (int j = 0; j < L; j++) q[j] += an[j] * w;
            if (kw1t) {
                const float *kw = kw1t + (long long)(i * N + n) * ks;
                for (int j = 0; j < L; j++) k[j] += an[j] * kw[j];
            }
        }
    }
    for (int m = 0; m < N; m++) {
        for (int j = 0; j < L; j++) qp[j] = 0.0f;
        for (int j = 0; j < L; j++) kp[j] = 0.0f;
        for (int i = 0; i < R; i++) {
            const float w = qw2[i * N + m];
            const float *q = qi + (long long)i * L;
            for (int j = 0; j < L; j++) qp[j] += q[j] * w;
            if (kw2t) {
                const float *k = ki + (long long)i * L, *kw = kw2t + (long long)(i * N + m) * ks;
                for (int j = 0; j < L; j++) kp[j] += k[j] * kw[j];
            }
        }
        const float *am = a + (long long)m * hs;
        float *om = out + (long long)m * hs;
        const float qd = qdd[m];
        if (br) { /* the branches, before out (which may alias a) */
            const long long o = (long long)m * hs;
            if (br[0])
                for (int j = 0; j < L; j++) br[0][o + j] = am[j];
            if (br[1])
                for (int j = 0; j < L; j++) br[1][o + j] = qp[j];
            if (br[2])
                for (int j = 0; j < L; j++) br[2][o + j] = kp[j];
            if (br[3])
                for (int j = 0; j < L; j++) br[3][o + j] = am[j] * qd;
            if (br[4]) {
                if (kddt)
                    for (int j = 0; j < L; j++) br[4][o + j] = am[j] * kddt[(long long)m * ks + j];
                else
                    for (int j = 0; j < L; j++) br[4][o + j] = 0.0f;
            }
        }
        if (kddt) {
            const float *kd = kddt + (long long)m * ks;
            for (int j = 0; j < L; j++) {
                float x = am[j];
                om[j] = x + qp[j] + kp[j] + x * qd + x * kd[j];
            }
        } else {
            for (int j = 0; j < L; j++) {
                float x = am[j];
                om[j] = x + qp[j] + kp[j] + x * qd + 0.0f;
            }
        }
    }
}

DCS_HD void dcs_compose_pair(const float *a, float *out, long long stride, int N, int G, int R,
                             const float *qw1, const float *qw2, const float *kw1, const float *kw2,
                             const float *qdd, const float *kdd, const float *sw, float *b_skip, float *b_qp,
                             float *b_kp, float *b_qg, float *b_kg, float *b_st) {
    if (G == 1 && !sw && qw1) {
        dcs_compose_pair_plain(a, out, stride, N, R, qw1, qw2, kw1, kw2, qdd, kdd, b_skip, b_qp, b_kp, b_qg,
                               b_kg, b_st);
        return;
    }
    const int Mg = N / G;
    float ag[DCS_MAX_SW_HEADS]; /* the group's inputs when sw (out may alias a) */
    for (int g = 0; g < G; g++) {
        const int n0 = g * Mg;
        float qi[DCS_MAX_R], ki[DCS_MAX_R];
        for (int i = 0; i < R; i++) {
            float sq = 0.0f, sk = 0.0f;
            for (int n = n0; n < n0 + Mg; n++) {
                float an = a[(long long)n * stride];
                if (qw1) sq += an * qw1[i * N + n];
                if (kw1) sk += an * kw1[i * N + n];
            }
            qi[i] = sq;
            ki[i] = sk;
        }
        if (sw)
            for (int n = 0; n < Mg; n++) ag[n] = a[(long long)(n0 + n) * stride];
        const float *W = sw ? sw + (long long)g * Mg * Mg : 0;
        for (int m = n0; m < n0 + Mg; m++) {
            long long o = (long long)m * stride;
            float am = a[o];
            float qp = 0.0f, kp = 0.0f, st = 0.0f;
            for (int i = 0; i < R; i++) {
                if (qw2) qp += qi[i] * qw2[i * N + m];
                if (kw2) kp += ki[i] * kw2[i * N + m];
            }
            float qg = qdd ? am * qdd[m] : 0.0f;
            float kg = kdd ? am * kdd[m] : 0.0f;
            if (W)
                for (int n = 0; n < Mg; n++) st += ag[n] * W[n * Mg + (m - n0)];
            if (b_skip) b_skip[o] = am;
            if (b_qp) b_qp[o] = qp;
            if (b_kp) b_kp[o] = kp;
            if (b_qg) b_qg[o] = qg;
            if (b_kg) b_kg[o] = kg;
            if (b_st) b_st[o] = st;
            float sum = am + qp + kp + qg + kg;
            out[o] = W ? sum + st : sum;
        }
    }
}

/* Compose (dcs_compose_args) at the pair (query t, key s) of sequence b:
 * mixes the pair's N heads (stride T*S) with dcs_compose_pair, or, with
 * causal_only, writes 0 to out and every branch where the mask hides the
 * pair. The CPU backend loops over the pairs of its (b, t) rows; the CUDA
 * kernel runs one pair per thread. */
DCS_HD void dcs_compose_at(const dcs_compose_args *a, int b, int t, int s) {
    const long long TS = (long long)a->T * a->S;                            /* N axis */
    const long long o = (long long)b * a->N * TS + (long long)t * a->S + s; /* head 0 */
    if (a->causal_only && !dcs_allowed(a->t0 + t, a->kb + s, a->window)) {
        for (int n = 0; n < a->N; n++) {
            long long on = o + n * TS;
            a->out[on] = 0.0f;
            for (int k = 0; k < DCS_N_BRANCHES; k++)
                if (a->br[k]) a->br[k][on] = 0.0f;
        }
        return;
    }
    const size_t RN = (size_t)a->R * a->N;
    const size_t qrow = (size_t)b * a->T + t, krow = (size_t)b * a->S + s;
    dcs_compose_pair(a->in + o, a->out + o, TS, a->N, a->G, a->R, a->qw1 ? a->qw1 + qrow * RN : NULL,
                     a->qw2 ? a->qw2 + qrow * RN : NULL, a->kw1 ? a->kw1 + krow * RN : NULL,
                     a->kw2 ? a->kw2 + krow * RN : NULL, a->qdd ? a->qdd + qrow * a->N : NULL,
                     a->kdd ? a->kdd + krow * a->N : NULL, a->sw, a->br[0] ? a->br[0] + o : NULL,
                     a->br[1] ? a->br[1] + o : NULL, a->br[2] ? a->br[2] + o : NULL,
                     a->br[3] ? a->br[3] + o : NULL, a->br[4] ? a->br[4] + o : NULL,
                     a->br[5] ? a->br[5] + o : NULL);
}

/* MoH routing scores of one token (model-spec 5), from its router logits
 * lg [N - hs], shared-head logits s1 [hs] (NULL when hs <= 1) and balance
 * logits s0 [2] (NULL when hs == 0), into g [N]:
 *   p = softmax(lg); the k routed heads with the largest logits (ties: the
 *   lower index) keep p / sum(p over them) * k, the others 0;
 *   shared = softmax(s1) * hs (1 each when hs == 1); a = softmax(s0) * 2;
 *   g = concat(a[0] * shared, a[1] * routed)   (hs == 0: g = routed).
 * Selection is by logit, which orders heads as p does without p's ties from
 * rounding. */
DCS_HD void dcs_moh_route_row(const float *lg, const float *s1, const float *s0, int N, int hs, int k,
                              float *g) {
    const int NR = N - hs;
    float mx = -INFINITY;
    for (int j = 0; j < NR; j++) mx = lg[j] > mx ? lg[j] : mx;
    float sum = 0.0f;
    for (int j = 0; j < NR; j++) sum += expf(lg[j] - mx);
    float sel_sum = 0.0f;
    for (int j = 0; j < NR; j++) {
        int rank = 0;
        for (int q = 0; q < NR; q++) rank += lg[q] > lg[j] || (lg[q] == lg[j] && q < j);
        float p = expf(lg[j] - mx) / sum;
        g[hs + j] = rank < k ? p : 0.0f;
        sel_sum += g[hs + j];
    }
    float a0 = 1.0f, a1 = 1.0f;
    if (hs > 0) {
        float b = s0[0] > s0[1] ? s0[0] : s0[1];
        float e0 = expf(s0[0] - b), e1 = expf(s0[1] - b);
        a0 = e0 / (e0 + e1) * 2.0f;
        a1 = e1 / (e0 + e1) * 2.0f;
    }
    for (int j = 0; j < NR; j++) g[hs + j] = a1 * (g[hs + j] / sel_sum * (float)k);
    if (hs == 1) {
        g[0] = a0 * 1.0f;
    } else if (hs > 1) {
        float b = -INFINITY, z = 0.0f;
        for (int n = 0; n < hs; n++) b = s1[n] > b ? s1[n] : b;
        for (int n = 0; n < hs; n++) z += expf(s1[n] - b);
        for (int n = 0; n < hs; n++) g[n] = a0 * (expf(s1[n] - b) / z * (float)hs);
    }
}

/* Backward of dcs_compose_pair for one pair, every variant (groups, the
 * static map, query or key side absent): from g = dL/dout [N] (stride),
 * accumulates (+=) da [N], the pair's dynamic-weight gradients dqw1, dqw2,
 * dkw1, dkw2 [R, N], dqdd, dkdd [N] (NULL where the side is absent) and dsw
 * [G, Mg, Mg] (NULL without the static map); any output may be NULL (not
 * wanted: the CUDA kernels split one pair's outputs over passes that each
 * own their rows). `on` selects the branches
 * that pass gradient (bit k: skip, qp, kp, qg, kg, static; a branch a hook
 * rewrote is a constant). */
DCS_HD void dcs_compose_pair_bw_var(const float *a, const float *g, float *da, long long stride, int N, int G,
                                    int R, const float *qw1, const float *qw2, const float *kw1,
                                    const float *kw2, const float *qdd, const float *kdd, const float *sw,
                                    float *dqw1, float *dqw2, float *dkw1, float *dkw2, float *dqdd,
                                    float *dkdd, float *dsw, unsigned on) {
    const int Mg = N / G;
    for (int gr = 0; gr < G; gr++) {
        const int n0 = gr * Mg;
        float qi[DCS_MAX_R], ki[DCS_MAX_R], gq[DCS_MAX_R], gk[DCS_MAX_R];
        for (int i = 0; i < R; i++) {
            float sq = 0.0f, sk = 0.0f, tq = 0.0f, tk = 0.0f;
            for (int n = n0; n < n0 + Mg; n++) {
                float an = a[(long long)n * stride], gn = g[(long long)n * stride];
                if (qw1) {
                    sq += an * qw1[i * N + n];
                    tq += gn * qw2[i * N + n];
                }
                if (kw1) {
                    sk += an * kw1[i * N + n];
                    tk += gn * kw2[i * N + n];
                }
            }
            qi[i] = sq;
            ki[i] = sk;
            gq[i] = tq;
            gk[i] = tk;
        }
        const float *W = sw ? sw + (long long)gr * Mg * Mg : 0;
        float *dW = dsw ? dsw + (long long)gr * Mg * Mg : 0;
        for (int n = n0; n < n0 + Mg; n++) {
            const long long o = (long long)n * stride;
            const float an = a[o], gn = g[o];
            float d = (on & 1) ? gn : 0.0f;
            if ((on & 8) && qdd) {
                d += gn * qdd[n];
                if (dqdd) dqdd[n] += gn * an;
            }
            if ((on & 16) && kdd) {
                d += gn * kdd[n];
                if (dkdd) dkdd[n] += gn * an;
            }
            for (int i = 0; i < R; i++) {
                if ((on & 2) && qw1) {
                    d += gq[i] * qw1[i * N + n];
                    if (dqw1) {
                        dqw1[i * N + n] += gq[i] * an;
                        dqw2[i * N + n] += qi[i] * gn;
                    }
                }
                if ((on & 4) && kw1) {
                    d += gk[i] * kw1[i * N + n];
                    if (dkw1) {
                        dkw1[i * N + n] += gk[i] * an;
                        dkw2[i * N + n] += ki[i] * gn;
                    }
                }
            }
            if ((on & 32) && W) /* st[m] = sum_n a[n] W[n, m] */
                for (int m = 0; m < Mg; m++) {
                    const float gm = g[(long long)(n0 + m) * stride];
                    d += gm * W[(n - n0) * Mg + m];
                    if (dW) dW[(n - n0) * Mg + m] += an * gm;
                }
            if (da) da[o] += d;
        }
    }
}

/* Backward of dcs_moh_route_row for one token: from dg [N] to the router
 * logits dlg [N - hs], shared-head logits ds1 [hs] (hs > 1) and balance
 * logits ds0 [2] (hs > 0), all written. The top-k selection is discrete:
 * it has no gradient; the selected heads' scores are k times a softmax
 * over the selected logits (the full softmax's normaliser cancels), and
 * their gradient flows through that; unselected heads get 0. */
DCS_HD void dcs_moh_route_row_bw(const float *lg, const float *s1, const float *s0, int N, int hs, int k,
                                 const float *dg, float *dlg, float *ds1, float *ds0) {
    const int NR = N - hs;
    float mx = -INFINITY;
    for (int j = 0; j < NR; j++) mx = lg[j] > mx ? lg[j] : mx;
    /* r_j = exp(lg_j) / sum over the selected (0 unselected); u = softmax(s0) */
    float ssum = 0.0f;
    for (int j = 0; j < NR; j++) {
        int rank = 0;
        for (int q = 0; q < NR; q++) rank += lg[q] > lg[j] || (lg[q] == lg[j] && q < j);
        dlg[j] = rank < k ? expf(lg[j] - mx) : 0.0f; /* r before normalising */
        ssum += dlg[j];
    }
    float u0 = 0.5f, u1 = 0.5f;
    if (hs > 0) {
        float b = s0[0] > s0[1] ? s0[0] : s0[1];
        float e0 = expf(s0[0] - b), e1 = expf(s0[1] - b);
        u0 = e0 / (e0 + e1);
        u1 = e1 / (e0 + e1);
    }
    const float a0 = 2.0f * u0, a1 = hs > 0 ? 2.0f * u1 : 1.0f;
    float rdot = 0.0f, da1 = 0.0f;
    for (int j = 0; j < NR; j++) {
        float r = dlg[j] / ssum;
        dlg[j] = r;
        rdot += r * dg[hs + j];
        da1 += dg[hs + j] * (float)k * r;
    }
    for (int j = 0; j < NR; j++) dlg[j] = a1 * (float)k * dlg[j] * (dg[hs + j] - rdot);
    if (hs == 0) return;
    float da0 = 0.0f;
    if (hs == 1) {
        da0 = dg[0];
    } else {
        float b = -INFINITY, z = 0.0f, sdot = 0.0f;
        for (int n = 0; n < hs; n++) b = s1[n] > b ? s1[n] : b;
        for (int n = 0; n < hs; n++) z += expf(s1[n] - b);
        for (int n = 0; n < hs; n++) {
            float sg = expf(s1[n] - b) / z;
            sdot += sg * dg[n];
            da0 += dg[n] * (float)hs * sg;
        }
        for (int n = 0; n < hs; n++) ds1[n] = a0 * (float)hs * (expf(s1[n] - b) / z) * (dg[n] - sdot);
    }
    /* a = 2 softmax(s0): ds0_j = 2 u_j (da_j - sum_i u_i da_i) */
    const float ud = u0 * da0 + u1 * da1;
    ds0[0] = 2.0f * u0 * (da0 - ud);
    ds0[1] = 2.0f * u1 * (da1 - ud);
}

/* The five branches summed back (used after a hook rewrote a branch). */
DCS_HD float dcs_sum5(float a, float b, float c, float d, float e) { return a + b + c + d + e; }

/* Softmax of row[0, len) in place: exp(x - max) / sum, summed in index
 * order (the allowed keys of one query; len 0: nothing). */
/* max of row [len] (-INFINITY when empty) in DCS_LANES interleaved partial
 * results (lane k: the elements s = k mod DCS_LANES, in order), combined in
 * lane order: vectorises, and the max is exact in any order. */
DCS_HD_ROW float dcs_lanes_max(const float *row, int len) {
    float m[DCS_LANES];
    for (int k = 0; k < DCS_LANES; k++) m[k] = -INFINITY;
    int s = 0;
    for (; s + DCS_LANES <= len; s += DCS_LANES)
        for (int k = 0; k < DCS_LANES; k++) m[k] = row[s + k] > m[k] ? row[s + k] : m[k];
    for (int k = 0; s + k < len; k++) m[k] = row[s + k] > m[k] ? row[s + k] : m[k];
    float mx = m[0];
    for (int k = 1; k < DCS_LANES; k++) mx = m[k] > mx ? m[k] : mx;
    return mx;
}

DCS_HD_ROW void dcs_softmax_span(float *row, int len) {
    if (len <= 0) return;
    /* max and sum in DCS_LANES interleaved partial results, combined in lane
     * order: a fixed order, so the same bits from the scalar code, every SIMD
     * width and CUDA, and the loops vectorise (issue 28) */
    float acc[DCS_LANES];
    const float mx = dcs_lanes_max(row, len);
    int s;
    for (s = 0; s < len; s++) row[s] = dcs_exp(row[s] - mx);
    for (int k = 0; k < DCS_LANES; k++) acc[k] = 0.0f;
    for (s = 0; s + DCS_LANES <= len; s += DCS_LANES)
        for (int k = 0; k < DCS_LANES; k++) acc[k] += row[s + k];
    for (int k = 0; s + k < len; k++) acc[k] += row[s + k];
    float sum = acc[0];
    for (int k = 1; k < DCS_LANES; k++) sum += acc[k];
    float inv = 1.0f / sum;
    for (s = 0; s < len; s++) row[s] *= inv;
}

/* Masked softmax of one attention row at query position t over keys at
 * positions s0 .. s0+S-1 (row[j] is key s0 + j): the allowed keys
 * (dcs_allowed: s <= t, t - s <= window when window > 0) are one span, which
 * gets dcs_softmax_span; the others become exactly 0 (all of them when no
 * key is allowed). Every masked softmax of the engine is this function: the
 * CPU and CUDA backends (one row per thread), the decoder and the tape. */
DCS_HD_ROW void dcs_softmax_row(float *row, int S, int t, int s0, int window) {
    long long lo = window > 0 ? (long long)t - window : 0, hi = t; /* allowed positions */
    if (lo < s0) lo = s0;
    if (hi > (long long)s0 + S - 1) hi = (long long)s0 + S - 1;
    if (hi < lo) {
        for (int j = 0; j < S; j++) row[j] = 0.0f;
        return;
    }
    int j0 = (int)(lo - s0), j1 = (int)(hi - s0);
    for (int j = 0; j < j0; j++) row[j] = 0.0f;
    for (int j = j1 + 1; j < S; j++) row[j] = 0.0f;
    dcs_softmax_span(row + j0, j1 - j0 + 1);
}

/* ---------------------------------------------------------------- backward
 * The per-element math of the backward pass (the tape, tape.c), compiled for
 * the CPU backend (cpu_backward.c) and the CUDA kernels (cuda_backward.cuh). */

/* d gelu(x) / dx of the exact (erf) GELU (dcs_erf, dcs_exp: no libm call,
 * so the CPU's per-ISA loop vectorises it). */
DCS_HD_ROW float dcs_gelu_grad(float v) {
    float cdf = 0.5f * (1.0f + dcs_erf(v * 0.70710678118654752f));
    float pdf = 0.39894228040143268f * dcs_exp(-0.5f * v * v);
    return cdf + v * pdf;
}

/* LayerNorm backward of one row: dx [D] += dLN/dx . dy from x [D], w [D]
 * and the row's statistics (dcs_layernorm_stats, mu as float). */
DCS_HD void dcs_layernorm_row_bw(float *dx, const float *dy, const float *x, const float *w, float mu,
                                 float rs, int D) {
    double s1 = 0, s2 = 0; /* mean(dy*w), mean(dy*w*xhat) */
    for (int i = 0; i < D; i++) {
        float xh = (x[i] - mu) * rs, gw = dy[i] * w[i];
        s1 += gw;
        s2 += gw * xh;
    }
    float m1 = (float)(s1 / D), m2 = (float)(s2 / D);
    for (int i = 0; i < D; i++) {
        float xh = (x[i] - mu) * rs;
        dx[i] += (dy[i] * w[i] - m1 - xh * m2) * rs;
    }
}

/* dcs_layernorm_row_bw of rows (<= DCS_LN_ROWS) rows x, dy, dx [rows, D]
 * side by side (each row's sums in its own order: the same bits), with
 * their statistics mu (as float), rs. */
DCS_HD_ROW void dcs_layernorm_rows_bw(float *dx, const float *dy, const float *x, const float *w,
                                      const float *mu, const float *rs, int D, int rows) {
    double s1[DCS_LN_ROWS], s2[DCS_LN_ROWS];
    for (int j = 0; j < rows; j++) s1[j] = 0, s2[j] = 0;
    for (int i = 0; i < D; i++)
        for (int j = 0; j < rows; j++) {
            const size_t o = (size_t)j * D + i;
            float xh = (x[o] - mu[j]) * rs[j], gw = dy[o] * w[i];
            s1[j] += gw;
            s2[j] += gw * xh;
        }
    for (int j = 0; j < rows; j++) {
        const float m1 = (float)(s1[j] / D), m2 = (float)(s2[j] / D);
        const size_t o = (size_t)j * D;
        for (int i = 0; i < D; i++) {
            float xh = (x[o + i] - mu[j]) * rs[j];
            dx[o + i] += (dy[o + i] * w[i] - m1 - xh * m2) * rs[j];
        }
    }
}

/* 1/rms of one row x [width] (the forward RMS norm's arithmetic). */
DCS_HD float dcs_rms_row_inv(const float *x, int width, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < width; i++) ss += x[i] * x[i];
    return dcs_rms_inv(ss, width, eps);
}

/* The RMS norm backward's terms: dy s xn (summed, then the mean taken)
 * and the gradient rs (dy s - xn mean) of one element, xn = x rs */
DCS_HD float dcs_rmsnorm_dot_term(float dy, float s, float x, float rs) { return dy * s * x * rs; }
DCS_HD float dcs_rmsnorm_dx(float dy, float s, float x, float rs, float mean) {
    float xn = x * rs, gs = dy * s;
    return rs * (gs - xn * mean);
}

/* RMS norm backward of one row: with xn = x rs, dx [width] += rs (dy s - xn
 * mean(dy s xn)); scale s [width] or NULL (1). */
DCS_HD void dcs_rmsnorm_row_bw(float *dx, const float *dy, const float *x, const float *scale, float rs,
                               int width) {
    float dot = 0.0f;
    for (int i = 0; i < width; i++) dot += dcs_rmsnorm_dot_term(dy[i], scale ? scale[i] : 1.0f, x[i], rs);
    dot /= (float)width;
    for (int i = 0; i < width; i++) dx[i] += dcs_rmsnorm_dx(dy[i], scale ? scale[i] : 1.0f, x[i], rs, dot);
}

/* Rows of a group side by side: t [width, DCS_RMS_GROUP] = x [rows, width]
 * (row stride ld) transposed, the lanes past `rows` 0, so each row's sums
 * over i run in their own order as one lane of a vector (rows of up to
 * DCS_RMS_TW: the qk-norm's head dim, the dynamic weights' heads). */
#define DCS_RMS_GROUP 16
#define DCS_RMS_TW 64
DCS_HD_ROW void dcs_rms_group_T(float *t, const float *x, long long ld, int width, int rows) {
    for (int i = 0; i < width; i++)
        for (int j = 0; j < DCS_RMS_GROUP; j++) t[i * DCS_RMS_GROUP + j] = j < rows ? x[j * ld + i] : 0.0f;
}

/* ss [DCS_RMS_GROUP] = each row's sum of squares (dcs_rms_row_inv's order) */
DCS_HD_ROW void dcs_rms_group_ss(float *ss, const float *x, long long ld, int width, int rows, float *t) {
    for (int j = 0; j < DCS_RMS_GROUP; j++) ss[j] = 0.0f;
    if (width <= DCS_RMS_TW) {
        dcs_rms_group_T(t, x, ld, width, rows);
        for (int i = 0; i < width; i++)
            for (int j = 0; j < DCS_RMS_GROUP; j++)
                ss[j] += t[i * DCS_RMS_GROUP + j] * t[i * DCS_RMS_GROUP + j];
        return;
    }
    for (int i = 0; i < width; i++)
        for (int j = 0; j < rows; j++) {
            const float v = x[j * ld + i];
            ss[j] += v * v;
        }
}

/* The forward RMS norm of `rows` <= DCS_RMS_GROUP rows (stride ld) in
 * place: x = x / rms(x) * scale (scale NULL: 1), each row's sum of squares
 * in its own order (dcs_rms_row_inv's bits), the rows' chains side by side;
 * t: DCS_RMS_GROUP * DCS_RMS_TW floats of scratch. */
DCS_HD_ROW void dcs_rms_rows(float *x, long long ld, int width, int rows, const float *scale, float eps,
                             float *t) {
    float ss[DCS_RMS_GROUP];
    dcs_rms_group_ss(ss, x, ld, width, rows, t);
    for (int j = 0; j < rows; j++) {
        const float inv = dcs_rms_inv(ss[j], width, eps);
        float *v = x + j * ld;
        if (scale)
            for (int i = 0; i < width; i++) v[i] = v[i] * inv * scale[i];
        else
            for (int i = 0; i < width; i++) v[i] = v[i] * inv * 1.0f;
    }
}

/* dcs_rms_row_inv and dcs_rmsnorm_row_bw of `rows` <= DCS_RMS_GROUP rows
 * (stride width) together: each row's sums in its own order (the same
 * bits), the rows side by side; rs [rows] written; t: 2 * DCS_RMS_GROUP *
 * DCS_RMS_TW floats of scratch. */
DCS_HD_ROW void dcs_rmsnorm_rows_bw(float *dx, const float *dy, const float *x, const float *scale, float eps,
                                    int width, int rows, float *rs, float *t) {
    float ss[DCS_RMS_GROUP], dot[DCS_RMS_GROUP], r[DCS_RMS_GROUP];
    dcs_rms_group_ss(ss, x, width, width, rows, t);
    for (int j = 0; j < DCS_RMS_GROUP; j++) r[j] = dcs_rms_inv(ss[j], width, eps), dot[j] = 0.0f;
    for (int j = 0; j < rows; j++) rs[j] = r[j];
    if (width <= DCS_RMS_TW) { /* t holds x transposed */
        float *g = t + DCS_RMS_GROUP * DCS_RMS_TW;
        dcs_rms_group_T(g, dy, width, width, rows);
        for (int i = 0; i < width; i++) {
            const float s = scale ? scale[i] : 1.0f;
            const float *xi = t + i * DCS_RMS_GROUP, *gi = g + i * DCS_RMS_GROUP;
            for (int j = 0; j < DCS_RMS_GROUP; j++) dot[j] += dcs_rmsnorm_dot_term(gi[j], s, xi[j], r[j]);
        }
    } else
        for (int i = 0; i < width; i++) {
            const float s = scale ? scale[i] : 1.0f;
            for (int j = 0; j < rows; j++) {
                const size_t o = (size_t)j * width + i;
                dot[j] += dcs_rmsnorm_dot_term(dy[o], s, x[o], r[j]);
            }
        }
    for (int j = 0; j < rows; j++) {
        const float mean = dot[j] / (float)width;
        float *dxj = dx + (size_t)j * width;
        const float *dyj = dy + (size_t)j * width, *xj = x + (size_t)j * width;
        if (scale)
            for (int i = 0; i < width; i++) dxj[i] += dcs_rmsnorm_dx(dyj[i], scale[i], xj[i], r[j], mean);
        else
            for (int i = 0; i < width; i++) dxj[i] += dcs_rmsnorm_dx(dyj[i], 1.0f, xj[i], r[j], mean);
    }
}

/* Masked softmax backward of one row at query t (keys 0..S-1, the allowed
 * ones dcs_allowed): d [S] = p (g - <p, g>) where allowed, else 0. */
DCS_HD void dcs_softmax_row_bw(float *d, const float *g, const float *p, int S, int t, int window) {
    float dot = 0.0f;
    for (int s = 0; s < S; s++)
        if (dcs_allowed(t, s, window)) dot += p[s] * g[s];
    for (int s = 0; s < S; s++) d[s] = dcs_allowed(t, s, window) ? p[s] * (g[s] - dot) : 0.0f;
}

/* The same over the allowed span only, the CPU's form: the dot in
 * DCS_LANES interleaved partial sums (lane k: the allowed keys lo + k mod
 * DCS_LANES, in order) combined in lane order, as dcs_softmax_span sums
 * (so its loops vectorise; another order of terms than
 * dcs_softmax_row_bw's, fixed); d 0 outside the span. */
DCS_HD_ROW void dcs_softmax_row_bw_lanes(float *d, const float *g, const float *p, int S, int t, int window) {
    const int lo = window > 0 && t - window > 0 ? t - window : 0, hi = t < S - 1 ? t : S - 1;
    for (int s = 0; s < lo && s < S; s++) d[s] = 0.0f;
    for (int s = hi + 1 > lo ? hi + 1 : lo; s < S; s++) d[s] = 0.0f;
    const int len = hi - lo + 1;
    if (len <= 0) return;
    const float *pl = p + lo, *gl = g + lo;
    float acc[DCS_LANES];
    for (int k = 0; k < DCS_LANES; k++) acc[k] = 0.0f;
    int s = 0;
    for (; s + DCS_LANES <= len; s += DCS_LANES)
        for (int k = 0; k < DCS_LANES; k++) acc[k] += pl[s + k] * gl[s + k];
    for (int k = 0; s + k < len; k++) acc[k] += pl[s + k] * gl[s + k];
    float dot = acc[0];
    for (int k = 1; k < DCS_LANES; k++) dot += acc[k];
    float *dl = d + lo;
    for (s = 0; s < len; s++) dl[s] = pl[s] * (gl[s] - dot);
}

/* Unmasked softmax backward of one row in place: dg [E] = g (dg - <g, dg>),
 * the dot in double (DCFormer++'s MLP group gate). */
DCS_HD void dcs_softmax_row_bw_inplace(float *dg, const float *g, int E) {
    double dot = 0;
    for (int e = 0; e < E; e++) dot += (double)g[e] * dg[e];
    for (int e = 0; e < E; e++) dg[e] = g[e] * (dg[e] - (float)dot);
}

/* Next-token cross-entropy of one row of logits lg [V] with target tgt:
 * d [V] = (softmax(lg) - onehot(tgt)) * inv; returns the row's loss
 * log(sum exp) - lg[tgt], the sum in double, in DCS_LANES partial sums
 * combined in lane order (a fixed order; with dcs_exp, the loops vectorise). */
DCS_HD_ROW double dcs_xent_row_bw(float *d, const float *lg, int V, int tgt, float inv) {
    const float mx = dcs_lanes_max(lg, V);
    for (int v = 0; v < V; v++) d[v] = dcs_exp(lg[v] - mx);
    double acc[DCS_LANES];
    for (int k = 0; k < DCS_LANES; k++) acc[k] = 0.0;
    int v = 0;
    for (; v + DCS_LANES <= V; v += DCS_LANES)
        for (int k = 0; k < DCS_LANES; k++) acc[k] += (double)d[v + k];
    for (int k = 0; v + k < V; k++) acc[k] += (double)d[v + k];
    double s = acc[0];
    for (int k = 1; k < DCS_LANES; k++) s += acc[k];
    float is = (float)(1.0 / s);
    for (int v = 0; v < V; v++) d[v] *= is * inv;
    d[tgt] -= inv;
    return (log(s) + mx) - lg[tgt];
}

/* SwiGLU backward of one hidden unit: from dp = dL/d(silu(u) u3) to du, du3. */
DCS_HD void dcs_swiglu_bw(float dp, float u, float u3, float *du, float *du3) {
    const float sg = 1.0f / (1.0f + expf(-u));
    *du = dp * u3 * sg * (1.0f + u * (1.0f - sg));
    *du3 = dp * u * sg;
}

/* MoH head gate backward of one (token, head): z = zpre * gt over Dh; dz
 * [Dh] becomes d zpre in place; returns d gt = <dz, zpre>. */
DCS_HD float dcs_head_gate_bw(float *dz, const float *zp, float gt, int Dh) {
    float s = 0.0f;
    for (int j = 0; j < Dh; j++) {
        s += dz[j] * zp[j];
        dz[j] *= gt;
    }
    return s;
}

/* DCFormer++'s MLP group gate backward of one token: post [F] = pu * g[e]
 * over E groups of W units (pu = silu(u) u3): dg [E] = <dp, pu> over the
 * group (double), then dp [F] *= g[e] in place. */
DCS_HD void dcs_swiglu_gate_row_bw(float *dp, float *dg, const float *u, const float *u3, const float *g,
                                   int E, int W) {
    for (int e = 0; e < E; e++) {
        double acc = 0;
        for (int j = e * W; j < (e + 1) * W; j++) {
            acc += (double)dp[j] * dcs_swiglu(u[j], u3[j]);
            dp[j] *= g[e];
        }
        dg[e] = (float)acc;
    }
}

/* The compose backward split into passes whose items own disjoint outputs
 * (no atomics; the CUDA backend runs one thread per item): an item is a
 * sequence position idx = b*T + r of a dcs_compose_bw_args. pass 0: query
 * t = r over its allowed keys, writing dIn (+=) and the query-side
 * gradients of row idx; pass 1: key s = r over the queries that see it,
 * the key-side gradients of row idx; pass 2: query t = r into its own
 * [G, Mg, Mg] slice of part [B*T, G, Mg, Mg] (the static map's gradient,
 * summed over the rows in order afterwards). The caller zeroes dIn, the
 * gradients and part first. */
DCS_HD void dcs_compose_bw_pair(const dcs_compose_bw_args *a, int pass, int b, int t, int s, float *part) {
    const int N = a->N, T = a->T;
    const size_t RN = (size_t)a->R * N, q = (size_t)b * T + t, k = (size_t)b * T + s;
    const long long TT = (long long)T * T, o = (long long)b * N * TT + (long long)t * T + s;
    const int qs = a->qw1 != NULL, ks = a->kw1 != NULL, p0 = pass == 0, p1 = pass == 1;
    dcs_compose_pair_bw_var(a->in + o, a->dOut + o, p0 ? a->dIn + o : NULL, TT, N, a->G, a->R,
                            qs ? a->qw1 + q * RN : NULL, qs ? a->qw2 + q * RN : NULL,
                            ks ? a->kw1 + k * RN : NULL, ks ? a->kw2 + k * RN : NULL,
                            a->qdd ? a->qdd + q * N : NULL, a->kdd ? a->kdd + k * N : NULL, a->sw,
                            p0 && qs ? a->dqw1 + q * RN : NULL, p0 && qs ? a->dqw2 + q * RN : NULL,
                            p1 && ks ? a->dkw1 + k * RN : NULL, p1 && ks ? a->dkw2 + k * RN : NULL,
                            p0 && a->qdd ? a->dqdd + q * N : NULL, p1 && a->kdd ? a->dkdd + k * N : NULL,
                            pass == 2 ? part : NULL, a->on);
}

DCS_HD void dcs_compose_bw_item(const dcs_compose_bw_args *a, int pass, size_t idx, float *part) {
    const int b = (int)(idx / a->T), r = (int)(idx % a->T);
    if (pass == 1) { /* key s = r: queries t in [s, s + window] */
        const int t1 = a->window > 0 && r + a->window < a->T - 1 ? r + a->window : a->T - 1;
        for (int t = r; t <= t1; t++) dcs_compose_bw_pair(a, 1, b, t, r, NULL);
        return;
    }
    const int s0 = a->window > 0 && r > a->window ? r - a->window : 0; /* query t = r */
    const int Mg = a->N / a->G;
    float *mine = pass == 2 ? part + idx * (size_t)a->G * Mg * Mg : NULL;
    for (int s = s0; s <= r; s++) dcs_compose_bw_pair(a, pass, b, r, s, mine);
}

#endif /* DCS_MATH_H */
