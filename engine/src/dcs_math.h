/*
 * dcs_math.h -- the per-element math of the forward pass, written once and
 * compiled for both backends: plain static inline C for the CPU, and
 * __host__ __device__ functions when nvcc includes this file. The CPU tests
 * therefore exercise exactly the arithmetic the GPU kernels run.
 */
#ifndef DCS_MATH_H
#define DCS_MATH_H

#include <math.h>

#ifdef __CUDACC__
#define DCS_HD __host__ __device__ static inline
#define DCS_HD_ROW DCS_HD
#else
#define DCS_HD static inline
/* inlined into the CPU backend's per-ISA clones, so each is vectorised */
#define DCS_HD_ROW static inline __attribute__((always_inline))
#endif

#ifndef DCS_MAX_R
#define DCS_MAX_R 8
#endif

/* The masked-score value of the reference (fp16 lowest); exp() of it minus
 * any real score underflows to exactly 0 in float32. */
#define DCS_MASK_VALUE (-65504.0f)

/* Exact (erf) GELU. */
DCS_HD float dcs_gelu(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}

/* Is key s visible from query t? Causal, plus a local window when w > 0. */
DCS_HD int dcs_allowed(int t, int s, int window) {
    return s <= t && (window <= 0 || t - s <= window);
}

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
DCS_HD float dcs_rms_inv(float sumsq, int n, float eps) {
    return 1.0f / sqrtf(sumsq / (float)n + eps);
}

/* Compose one (query t, key s) pair across heads, model-spec 2 step 6:
 *   out[m] = a[m] + sum_i (sum_n a[n] qw1[i,n]) qw2[i,m]
 *                 + sum_i (sum_n a[n] kw1[i,n]) kw2[i,m]
 *                 + a[m] qdd[m] + a[m] kdd[m]
 * a and out are strided by `stride` (the N axis of an [N, T, S] tensor);
 * out may alias a. qw1, qw2, kw1, kw2 are [R, N] (kw* NULL: query_wise),
 * qdd, kdd are [N] (kdd NULL: query_wise). br[0..4] (each may be NULL)
 * receive the skip, qp, kp, qg, kg contributions. */
DCS_HD void dcs_compose_pair(const float *a, float *out, long long stride, int N, int R,
                             const float *qw1, const float *qw2,
                             const float *kw1, const float *kw2,
                             const float *qdd, const float *kdd,
                             float *b_skip, float *b_qp, float *b_kp,
                             float *b_qg, float *b_kg) {
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
 * dcs_compose_pair, in the same order, so both give bit-identical results. */
DCS_HD_ROW void dcs_compose_row(const float *a, float *out, long long hs, int L, int N, int R,
                            const float *qw1, const float *qw2,
                            const float *kw1t, const float *kw2t, long long ks,
                            const float *qdd, const float *kddt, float *tmp,
                            float *const *br) {
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
        if (br) {          /* the branches, before out (which may alias a) */
            const long long o = (long long)m * hs;
            if (br[0]) for (int j = 0; j < L; j++) br[0][o + j] = am[j];
            if (br[1]) for (int j = 0; j < L; j++) br[1][o + j] = qp[j];
            if (br[2]) for (int j = 0; j < L; j++) br[2][o + j] = kp[j];
            if (br[3]) for (int j = 0; j < L; j++) br[3][o + j] = am[j] * qd;
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

/* The five branches summed back (used after a hook rewrote a branch). */
DCS_HD float dcs_sum5(float a, float b, float c, float d, float e) {
    return a + b + c + d + e;
}

#endif /* DCS_MATH_H */
