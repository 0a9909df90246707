/*
 * test_kernels.c -- the CPU backend's fast-path kernels against the plain
 * per-element math of dcs_math.h:
 *   - dcs_compose_row (vectorised across keys) equals dcs_compose_pair_plain bit
 *     for bit, branches included, in place and not, with and without the
 *     key side;
 *   - the backend's compose over [B, N, T, S] equals the pair form;
 *   - fused attention equals scores -> compose -> softmax -> compose -> P v
 *     computed naively in double (global and local windows, query-wise),
 *     and the materialising path's products on its blocks (attention_scores,
 *     attention_pv) give its bits exactly, on any BLAS kernel;
 *   - gemm_w on F16 / BF16 weights equals sgemm on the widened weights bit
 *     for bit; two backends with different thread counts agree;
 *   - LayerNorm forward / backward by groups of rows, the bias gradient's
 *     column sums and the bias / residual adds equal the per-row loops bit
 *     for bit at 1-3 threads, and bias_gelu equals add_bias then gelu.
 * Prints "kernels: N passed, M failed".
 */
#include "dcs_backend.h"
#include "dcs_math.h"
#include "check.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static check_counts counts;

static void check_at(bool ok, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    check_count(&counts, ok, line, fmt, ap);
    va_end(ap);
}
#define CHECKF(cond, ...) check_at((cond), __LINE__, __VA_ARGS__)

static uint64_t rng = 88172645463325252ull;
static float frand(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 11) * 0x1.0p-53) * 2.0f - 1.0f;
}
static float *rand_buf(size_t n) {
    float *p = malloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = frand();
    return p;
}

/* Row vs pair, one (t) row of L keys, N heads. */
static void test_row_vs_pair(int N, int R, int L, int keyside, int inplace, int branches) {
    const long long hs = L + 3; /* head stride > L */
    float *a = rand_buf((size_t)N * hs), *out = calloc((size_t)N * hs, sizeof(float));
    float *qw1 = rand_buf((size_t)R * N), *qw2 = rand_buf((size_t)R * N), *qdd = rand_buf(N);
    float *kw1 = rand_buf((size_t)L * R * N), *kw2 = rand_buf((size_t)L * R * N),
          *kdd = rand_buf((size_t)L * N);
    float *kw1t = malloc(sizeof(float) * L * R * N), *kw2t = malloc(sizeof(float) * L * R * N);
    float *kddt = malloc(sizeof(float) * L * N), *tmp = malloc(sizeof(float) * (2 * R + 2) * L);
    for (int s = 0; s < L; s++)
        for (int i = 0; i < R * N; i++) {
            kw1t[(size_t)i * L + s] = kw1[(size_t)s * R * N + i];
            kw2t[(size_t)i * L + s] = kw2[(size_t)s * R * N + i];
        }
    for (int s = 0; s < L; s++)
        for (int n = 0; n < N; n++) kddt[(size_t)n * L + s] = kdd[(size_t)s * N + n];
    float *want = malloc(sizeof(float) * N * hs), *bw[5], *bg[5];
    for (int k = 0; k < 5; k++) {
        bw[k] = calloc((size_t)N * hs, sizeof(float));
        bg[k] = calloc((size_t)N * hs, sizeof(float));
    }
    for (int s = 0; s < L; s++)
        dcs_compose_pair_plain(a + s, want + s, hs, N, R, qw1, qw2, keyside ? kw1 + (size_t)s * R * N : NULL,
                               keyside ? kw2 + (size_t)s * R * N : NULL, qdd,
                               keyside ? kdd + (size_t)s * N : NULL, bw[0] + s, bw[1] + s, bw[2] + s,
                               bw[3] + s, bw[4] + s, NULL);
    float *dst = out;
    if (inplace) {
        memcpy(out, a, sizeof(float) * N * hs);
        dst = out;
    }
    dcs_compose_row(inplace ? out : a, dst, hs, L, N, R, qw1, qw2, keyside ? kw1t : NULL,
                    keyside ? kw2t : NULL, L, qdd, keyside ? kddt : NULL, tmp, branches ? bg : NULL);
    int same = 1, bsame = 1;
    for (int n = 0; n < N; n++)
        for (int s = 0; s < L; s++) {
            size_t o = (size_t)n * hs + s;
            same &= memcmp(&want[o], &dst[o], sizeof(float)) == 0;
            for (int k = 0; k < 5 && branches; k++) bsame &= memcmp(&bw[k][o], &bg[k][o], sizeof(float)) == 0;
        }
    CHECKF(same, "compose row == pair (N=%d R=%d L=%d key=%d inplace=%d)", N, R, L, keyside, inplace);
    CHECKF(bsame, "compose row branches == pair (N=%d R=%d L=%d key=%d)", N, R, L, keyside);
    free(a);
    free(out);
    free(qw1);
    free(qw2);
    free(qdd);
    free(kw1);
    free(kw2);
    free(kdd);
    free(kw1t);
    free(kw2t);
    free(kddt);
    free(tmp);
    free(want);
    for (int k = 0; k < 5; k++) {
        free(bw[k]);
        free(bg[k]);
    }
}

/* Naive double-precision attention of one sequence: z [T, N, Dh]. */
static void naive_attention(const dcs_attn_args *a, int b, double *z) {
    const int T = a->T, N = a->N, Dh = a->Dh, ld = a->ld, R = a->R;
    double *A = malloc(sizeof(double) * N * T * T), *C = malloc(sizeof(double) * N * T * T);
    for (int n = 0; n < N; n++)
        for (int t = 0; t < T; t++)
            for (int s = 0; s < T; s++) {
                double acc = 0;
                for (int d = 0; d < Dh; d++)
                    acc += (double)a->q[((size_t)b * T + t) * ld + n * Dh + d] *
                           a->k[((size_t)b * T + s) * ld + n * Dh + d];
                A[((size_t)n * T + t) * T + s] = acc * a->scale;
            }
    for (int ph = 0; ph < 2; ph++) {
        if (a->compose)
            for (int t = 0; t < T; t++)
                for (int s = 0; s < T; s++) {
                    const float *qw1 = a->qw1[ph] + ((size_t)b * T + t) * R * N,
                                *qw2 = a->qw2[ph] + ((size_t)b * T + t) * R * N;
                    const float *qdd = a->qdd[ph] + ((size_t)b * T + t) * N;
                    const float *kw1 = a->kw1[ph] ? a->kw1[ph] + ((size_t)b * T + s) * R * N : NULL;
                    const float *kw2 = a->kw2[ph] ? a->kw2[ph] + ((size_t)b * T + s) * R * N : NULL;
                    const float *kdd = a->kdd[ph] ? a->kdd[ph] + ((size_t)b * T + s) * N : NULL;
                    for (int m = 0; m < N; m++) {
                        double v = A[((size_t)m * T + t) * T + s] * (1.0 + qdd[m] + (kdd ? kdd[m] : 0.0));
                        for (int i = 0; i < R; i++) {
                            double sq = 0, sk = 0;
                            for (int n = 0; n < N; n++) {
                                double an = A[((size_t)n * T + t) * T + s];
                                sq += an * qw1[i * N + n];
                                if (kw1) sk += an * kw1[i * N + n];
                            }
                            v += sq * qw2[i * N + m] + (kw2 ? sk * kw2[i * N + m] : 0.0);
                        }
                        C[((size_t)m * T + t) * T + s] = v;
                    }
                }
        else
            memcpy(C, A, sizeof(double) * N * T * T);
        if (ph == 0)
            for (int n = 0; n < N; n++)
                for (int t = 0; t < T; t++) {
                    double *row = C + ((size_t)n * T + t) * T, mx = -INFINITY, sum = 0;
                    for (int s = 0; s < T; s++)
                        if (dcs_allowed(t, s, a->window) && row[s] > mx) mx = row[s];
                    for (int s = 0; s < T; s++) {
                        row[s] = dcs_allowed(t, s, a->window) ? exp(row[s] - mx) : 0.0;
                        sum += row[s];
                    }
                    for (int s = 0; s < T; s++) row[s] /= sum;
                }
        else
            for (int n = 0; n < N; n++)
                for (int t = 0; t < T; t++)
                    for (int s = 0; s < T; s++)
                        if (!dcs_allowed(t, s, a->window)) C[((size_t)n * T + t) * T + s] = 0;
        memcpy(A, C, sizeof(double) * N * T * T);
    }
    for (int t = 0; t < T; t++)
        for (int n = 0; n < N; n++)
            for (int d = 0; d < Dh; d++) {
                double acc = 0;
                for (int s = 0; s < T; s++)
                    acc += A[((size_t)n * T + t) * T + s] * a->v[((size_t)b * T + s) * ld + n * Dh + d];
                z[((size_t)t * N + n) * Dh + d] = acc;
            }
    free(A);
    free(C);
}

static void test_fused_attention(dcs_backend *be, int T, int window, int compose, int keyside) {
    const int B = 2, N = 4, Dh = 8, R = 2, D = N * Dh;
    dcs_attn_args a;
    memset(&a, 0, sizeof a);
    float *q = rand_buf((size_t)B * T * D), *k = rand_buf((size_t)B * T * D),
          *v = rand_buf((size_t)B * T * D);
    float *z = calloc((size_t)B * T * D, sizeof(float));
    a.z = z;
    a.q = q;
    a.k = k;
    a.v = v;
    a.B = B;
    a.T = T;
    a.N = N;
    a.Dh = Dh;
    a.ld = D;
    a.R = R;
    a.window = window;
    a.scale = 0.35f;
    a.compose = compose;
    float *w[2][6] = {{0}};
    for (int ph = 0; ph < 2 && compose; ph++) {
        for (int j = 0; j < 6; j++) {
            size_t n = (size_t)B * T * (j == 2 || j == 5 ? N : R * N);
            w[ph][j] = (j >= 3 && !keyside) ? NULL : rand_buf(n);
            for (size_t i = 0; w[ph][j] && i < n; i++) w[ph][j][i] *= 0.3f;
        }
        a.qw1[ph] = w[ph][0];
        a.qw2[ph] = w[ph][1];
        a.qdd[ph] = w[ph][2];
        a.kw1[ph] = w[ph][3];
        a.kw2[ph] = w[ph][4];
        a.kdd[ph] = w[ph][5];
    }
    be->ops->attention(be, &a);
    dcs_err e = {0};
    CHECKF(be->ops->sync(be, &e) == DCS_OK, "fused attention ran: %s", e.msg);
    double *ref = malloc(sizeof(double) * T * D), err = 0, mx = 0;
    for (int b = 0; b < B; b++) {
        naive_attention(&a, b, ref);
        for (int i = 0; i < T * D; i++) {
            err = fmax(err, fabs(ref[i] - z[(size_t)b * T * D + i]));
            mx = fmax(mx, fabs(ref[i]));
        }
    }
    CHECKF(err <= 1e-5 * mx,
           "fused attention vs naive double (T=%d window=%d compose=%d key=%d): err %g of %g", T, window,
           compose, keyside, err, mx);
    free(q);
    free(k);
    free(v);
    free(z);
    free(ref);
    for (int ph = 0; ph < 2; ph++)
        for (int j = 0; j < 6; j++) free(w[ph][j]);
}

/* The materialising path (attention_scores -> pre-compose -> masked softmax ->
 * post-compose -> attention_pv) gives the fused kernel's z bit for bit: both
 * issue the same sgemm calls on the same query blocks, so this holds on every
 * BLAS kernel (run by `make test-kernels` under the generic one too). */
static void test_attention_paths_same_bits(dcs_backend *be, int T, int window, int compose, int keyside) {
    const int B = 2, N = 4, Dh = 8, R = 2, D = N * Dh;
    const size_t nz = (size_t)B * T * D, nm = (size_t)B * N * T * T;
    float *q = rand_buf(nz), *k = rand_buf(nz), *v = rand_buf(nz);
    float *z1 = calloc(nz, sizeof(float)), *z2 = calloc(nz, sizeof(float)), *map = calloc(nm, sizeof(float));
    float *w[2][6] = {{0}};
    dcs_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = q, a.k = k, a.v = v, a.B = B, a.T = T, a.S = T, a.N = N, a.Dh = Dh, a.ld = D, a.R = R;
    a.window = window, a.scale = 0.35f, a.compose = compose;
    for (int ph = 0; ph < 2 && compose; ph++) {
        for (int j = 0; j < 6; j++) {
            size_t n = (size_t)B * T * (j == 2 || j == 5 ? N : R * N);
            w[ph][j] = (j >= 3 && !keyside) ? NULL : rand_buf(n);
            for (size_t i = 0; w[ph][j] && i < n; i++) w[ph][j][i] *= 0.3f;
        }
        a.qw1[ph] = w[ph][0], a.qw2[ph] = w[ph][1], a.qdd[ph] = w[ph][2];
        a.kw1[ph] = w[ph][3], a.kw2[ph] = w[ph][4], a.kdd[ph] = w[ph][5];
    }
    a.z = z1;
    be->ops->attention(be, &a);
    dcs_attn_args m = a;
    m.z = z2;
    m.compose = 0;
    be->ops->attention_scores(be, &m, map);
    for (int ph = 0; ph < 2; ph++) {
        if (compose) {
            dcs_compose_args c;
            memset(&c, 0, sizeof c);
            c.out = map, c.in = map, c.B = B, c.N = N, c.T = T, c.S = T, c.R = R, c.G = 1;
            c.qw1 = w[ph][0], c.qw2 = w[ph][1], c.qdd = w[ph][2];
            c.kw1 = w[ph][3], c.kw2 = w[ph][4], c.kdd = w[ph][5];
            c.causal_only = ph == 1, c.window = window;
            be->ops->compose(be, &c);
        }
        if (ph == 0) be->ops->softmax_masked(be, map, B * N, T, T, 0, 0, window);
    }
    be->ops->attention_pv(be, &m, map);
    dcs_err e = {0};
    CHECKF(be->ops->sync(be, &e) == DCS_OK, "attention paths ran: %s", e.msg);
    size_t diff = 0;
    for (size_t i = 0; i < nz; i++) diff += memcmp(&z1[i], &z2[i], sizeof(float)) != 0;
    CHECKF(diff == 0,
           "fused z == materialising z bit for bit (T=%d window=%d compose=%d key=%d): %zu of %zu differ", T,
           window, compose, keyside, diff, nz);
    /* every score of the map, masked pairs included: q k^T scale to float32 rounding */
    if (!compose) {
        be->ops->attention_scores(be, &m, map);
        double err = 0, mx = 0;
        for (int b = 0; b < B; b++)
            for (int n = 0; n < N; n++)
                for (int t = 0; t < T; t++)
                    for (int s = 0; s < T; s++) {
                        double acc = 0;
                        for (int d = 0; d < Dh; d++)
                            acc += (double)q[((size_t)b * T + t) * D + n * Dh + d] *
                                   k[((size_t)b * T + s) * D + n * Dh + d];
                        acc *= 0.35f;
                        err = fmax(err, fabs(acc - map[(((size_t)b * N + n) * T + t) * T + s]));
                        mx = fmax(mx, fabs(acc));
                    }
        CHECKF(err <= 1e-5 * mx, "attention_scores: every pair (T=%d window=%d): err %g of %g", T, window,
               err, mx);
    }
    free(q), free(k), free(v), free(z1), free(z2), free(map);
    for (int ph = 0; ph < 2; ph++)
        for (int j = 0; j < 6; j++) free(w[ph][j]);
}

static uint16_t f32_to_f16_trunc(float f) /* exact for the small values used */
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, exp = (x >> 23) & 0xff, man = x & 0x7fffff;
    if (exp < 103) return (uint16_t)sign;
    if (exp < 113) return (uint16_t)(sign | ((man | 0x800000u) >> (126 - exp)));
    return (uint16_t)(sign | ((exp - 112) << 10) | (man >> 13));
}

static void test_gemm_w(dcs_backend *be, int dtype, int transW) {
    const int M = 37, N = 300, K = 129;
    float *A = rand_buf((size_t)M * K), *Wf = malloc(sizeof(float) * N * K);
    uint16_t *W16 = malloc(2 * (size_t)N * K);
    for (int i = 0; i < N * K; i++) {
        float f = frand();
        if (dtype == DCS_F16)
            W16[i] = f32_to_f16_trunc(f);
        else {
            uint32_t x;
            memcpy(&x, &f, 4);
            W16[i] = (uint16_t)(x >> 16);
        }
    }
    dcs_widen(W16, (uint64_t)N * K, dtype, Wf);
    float *C1 = malloc(sizeof(float) * M * N), *C2 = malloc(sizeof(float) * M * N);
    dcs_wmat W = {W16, dtype};
    be->ops->gemm_w(be, transW, M, N, K, A, K, W, 0.0f, C1, N);
    /* the same tiles through plain sgemm: columns [n0, n0 + tw) at a time give
     * the same sums as one call, so compare with a tolerance-free reference of
     * per-column sgemm */
    for (int n = 0; n < N; n++)
        for (int m = 0; m < M; m++) {
            double acc = 0;
            for (int k = 0; k < K; k++)
                acc +=
                    (double)A[(size_t)m * K + k] * (transW ? Wf[(size_t)n * K + k] : Wf[(size_t)k * N + n]);
            C2[(size_t)m * N + n] = (float)acc;
        }
    double err = 0;
    for (int i = 0; i < M * N; i++) err = fmax(err, fabs(C1[i] - C2[i]));
    CHECKF(err <= 1e-4, "gemm_w %s transW=%d vs widened reference: err %g", dtype == DCS_F16 ? "F16" : "BF16",
           transW, err);
    free(A);
    free(Wf);
    free(W16);
    free(C1);
    free(C2);
}

/* cpu_gemm / gemm_w cut into 2-D tiles (rows and columns, whole K: 600 x 1024 x 128 gives
 * 2 x 8 tiles of 304 x 128) on every transpose and a strided batch: against a double
 * reference, and the same bits on backends of 1, 2, 3 and 16 threads (the tiles
 * depend on the shape alone). */
static void test_gemm_tiles(dcs_backend *const *bes, int nb) {
    const int M = 600, N = 1024, K = 128, batch = 2;
    const size_t sz = (size_t)M * K + (size_t)K * N + 64;
    float *A = rand_buf(sz * batch), *B = rand_buf(sz * batch);
    float *C[4];
    CHECKF(dcs_cpu_items(0, (const int[]){M, N, K, 1}, 4, NULL, 0) == 16, "600 x 1024 x 128: 16 tiles");
    for (int tA = 0; tA < 2; tA++)
        for (int tB = 0; tB < 2; tB++) {
            const int lda = tA ? M : K, ldb = tB ? K : N;
            for (int i = 0; i < nb; i++) {
                C[i] = malloc(sizeof(float) * (size_t)M * N * batch);
                bes[i]->ops->gemm(bes[i], tA, tB, M, N, K, 1.0f, A, lda, (long long)sz, B, ldb, (long long)sz,
                                  0.0f, C[i], N, (long long)M * N, batch);
            }
            double err = 0;
            for (int b = 0; b < batch; b++)
                for (int m = 0; m < M; m += 7)
                    for (int n = 0; n < N; n += 3) {
                        double acc = 0;
                        for (int k = 0; k < K; k++)
                            acc += (double)A[b * sz + (tA ? (size_t)k * lda + m : (size_t)m * lda + k)] *
                                   B[b * sz + (tB ? (size_t)n * ldb + k : (size_t)k * ldb + n)];
                        err = fmax(err, fabs(C[0][((size_t)b * M + m) * N + n] - acc));
                    }
            /* worst case of K float32 multiply-adds with |a b| <= 1 (rand_buf in [-1, 1]): K^2 u */
            CHECKF(err <= (double)K * K * 6e-8, "gemm tiles tA=%d tB=%d vs double: err %g", tA, tB, err);
            for (int i = 1; i < nb; i++)
                CHECKF(memcmp(C[i], C[0], sizeof(float) * (size_t)M * N * batch) == 0,
                       "gemm tiles tA=%d tB=%d: backend %d differs from 1 thread", tA, tB, i);
            for (int i = 0; i < nb; i++) free(C[i]);
        }
    free(A);
    free(B);
}

/* embed_w widens with the backend's fastest conversion: every 16-bit
 * pattern must give what dcs_widen gives (NaN as NaN). */
static void test_widen_all(dcs_backend *be, int dtype) {
    const int D = 16, M = 65536 / D;
    uint16_t *table = malloc(65536 * 2);
    int32_t *toks = malloc(sizeof(int32_t) * M);
    float *got = malloc(sizeof(float) * 65536), *want = malloc(sizeof(float) * 65536);
    for (int i = 0; i < 65536; i++) table[i] = (uint16_t)i;
    for (int m = 0; m < M; m++) toks[m] = M - 1 - m;
    dcs_wmat t = {table, dtype};
    be->ops->embed_w(be, got, t, toks, M, D);
    dcs_widen(table, 65536, dtype, want);
    int bad = 0;
    for (int m = 0; m < M; m++)
        for (int d = 0; d < D; d++) {
            float g = got[(size_t)m * D + d], w = want[(size_t)toks[m] * D + d];
            bad += !(isnan(g) ? isnan(w) : memcmp(&g, &w, 4) == 0);
        }
    CHECKF(bad == 0, "%s widening of all 65536 patterns: %d differ", dtype == DCS_F16 ? "F16" : "BF16", bad);
    free(table);
    free(toks);
    free(got);
    free(want);
}

/* dcs_narrow (the loader's dtype= rounding) and the backend's widen op:
 * every finite 16-bit value survives widen -> narrow; a float32 between two
 * neighbours goes to the nearer (ties to the even pattern), past the largest
 * finite value to inf (F16). The reference: the two neighbours by widening
 * adjacent patterns, compared in double. */
static void test_narrow(dcs_backend *be, int dtype) {
    const char *nm = dtype == DCS_F16 ? "F16" : "BF16";
    uint16_t *pat = malloc(65536 * 2), *back = malloc(65536 * 2);
    float *f = malloc(sizeof(float) * 65536), *g = malloc(sizeof(float) * 65536);
    for (int i = 0; i < 65536; i++) pat[i] = (uint16_t)i;
    dcs_widen(pat, 65536, dtype, f);
    dcs_narrow(f, 65536, dtype, back);
    int bad = 0;
    for (int i = 0; i < 65536; i++)
        if (!isnan(f[i])) bad += back[i] != pat[i];
    CHECKF(bad == 0, "%s: widen -> narrow changed %d finite patterns", nm, bad);
    dcs_wmat w = {pat, dtype};
    be->ops->widen(be, g, w, 65536);
    int differ = 0; /* NaN as NaN (F16C quiets signalling NaNs) */
    for (int i = 0; i < 65536; i++) differ += !(isnan(f[i]) ? isnan(g[i]) : memcmp(&f[i], &g[i], 4) == 0);
    CHECKF(differ == 0, "%s: backend widen differs from dcs_widen at %d patterns", nm, differ);
    /* points between neighbours a = pattern k, b = k + 1 (positive, finite) */
    int wrong = 0;
    const uint16_t top = dtype == DCS_F16 ? 0x7bff : 0x7f7f;
    for (uint32_t k = 0; k < top; k += 7) {
        const double a = f[k], b = f[k + 1];
        const double pts[3] = {a + (b - a) * 0.25, a + (b - a) * 0.5, a + (b - a) * 0.75};
        for (int j = 0; j < 3; j++) {
            const float x = (float)pts[j];
            if ((double)x != pts[j]) continue; /* not a float32 */
            uint16_t h;
            dcs_narrow(&x, 1, dtype, &h);
            const uint16_t want = j == 0 ? (uint16_t)k : j == 2 ? (uint16_t)(k + 1) : (uint16_t)(k + (k & 1));
            wrong += h != want;
        }
    }
    CHECKF(wrong == 0, "%s: %d points rounded to the wrong neighbour", nm, wrong);
    const float big = dtype == DCS_F16 ? 65520.0f : 3.4e38f, neg = -big;
    uint16_t hb, hn;
    dcs_narrow(&big, 1, dtype, &hb);
    dcs_narrow(&neg, 1, dtype, &hn);
    CHECKF(hb == (dtype == DCS_F16 ? 0x7c00 : 0x7f80) && hn == (dtype == DCS_F16 ? 0xfc00 : 0xff80),
           "%s: overflow to inf: %04x %04x", nm, hb, hn);
    free(pat);
    free(back);
    free(f);
    free(g);
}

/* The training step's row and column kernels (LayerNorm forward and
 * backward by groups of rows, bias / residual adds, the bias gradient's
 * column sums by blocks on the pool) against the plain per-row loops of
 * dcs_math.h in row order: the same bits, at every thread count, for widths
 * that are and are not multiples of the groups and vector lanes. */
static void test_norm_rows(dcs_backend *const *bes, int nb) {
    const int M = 301, widths[] = {1, 5, 64, 193}; /* 301 rows: the larger widths fan out */
    const float eps = 1e-5f;
    for (size_t wi = 0; wi < sizeof widths / sizeof *widths; wi++) {
        const int D = widths[wi];
        const size_t n = (size_t)M * D;
        float *x = rand_buf(n), *dy = rand_buf(n), *w = rand_buf(D), *b = rand_buf(D), *dx0 = rand_buf(n);
        for (size_t i = 0; i < n; i++) x[i] = x[i] * 3.0f + (float)(i % 7); /* a mean away from 0 */
        float *y = malloc(n * 4), *want = malloc(n * 4), *dx = malloc(n * 4), *wdx = malloc(n * 4);
        float *dw = malloc(D * 4), *db = malloc(D * 4), *wdw = malloc(D * 4), *wdb = malloc(D * 4);
        /* the plain forms: one row at a time */
        memcpy(wdx, dx0, n * 4);
        for (int i = 0; i < D; i++) wdw[i] = 0.5f, wdb[i] = -0.25f;
        for (int m = 0; m < M; m++) {
            const float *xr = x + (size_t)m * D, *g = dy + (size_t)m * D;
            dcs_layernorm_row(want + (size_t)m * D, xr, w, b, D, eps, NULL, NULL);
            double mud;
            const float rs = dcs_layernorm_stats(xr, D, eps, &mud), mu = (float)mud;
            dcs_layernorm_row_bw(wdx + (size_t)m * D, g, xr, w, mu, rs, D);
            for (int i = 0; i < D; i++) wdw[i] += g[i] * ((xr[i] - mu) * rs), wdb[i] += g[i];
        }
        for (int k = 0; k < nb; k++) {
            dcs_backend *be = bes[k];
            be->ops->layernorm(be, y, x, w, b, M, D, eps);
            CHECKF(memcmp(y, want, n * 4) == 0,
                   "layernorm rows D=%d backend %d: not dcs_layernorm_row's bits", D, k);
            memcpy(dx, dx0, n * 4);
            for (int i = 0; i < D; i++) dw[i] = 0.5f, db[i] = -0.25f;
            be->ops->layernorm_bw(be, dx, dw, db, dy, x, w, M, D, eps);
            CHECKF(memcmp(dx, wdx, n * 4) == 0 && memcmp(dw, wdw, D * 4) == 0 && memcmp(db, wdb, D * 4) == 0,
                   "layernorm_bw rows D=%d backend %d: not the per-row bits", D, k);
            /* RMS norm backward (dscale by column blocks) == row by row */
            memcpy(dx, dx0, n * 4);
            float *rdx = malloc(n * 4), *rdw = malloc(D * 4);
            memcpy(rdx, dx0, n * 4);
            for (int i = 0; i < D; i++) dw[i] = 0.5f, rdw[i] = 0.5f;
            for (int m = 0; m < M; m++) {
                const float *xr = x + (size_t)m * D, *g = dy + (size_t)m * D;
                const float rsr = dcs_rms_row_inv(xr, D, eps);
                dcs_rmsnorm_row_bw(rdx + (size_t)m * D, g, xr, w, rsr, D);
                for (int i = 0; i < D; i++) rdw[i] += g[i] * (xr[i] * rsr);
            }
            be->ops->rmsnorm_bw(be, dx, dw, dy, x, w, M, D, eps);
            CHECKF(memcmp(dx, rdx, n * 4) == 0 && memcmp(dw, rdw, D * 4) == 0,
                   "rmsnorm_bw D=%d backend %d: not the per-row bits", D, k);
            free(rdx), free(rdw);
            for (int i = 0; i < D; i++) db[i] = -0.25f;
            be->ops->col_sum(be, db, dy, M, D);
            float s[256];
            for (int i = 0; i < D; i++) s[i] = -0.25f;
            for (int m = 0; m < M; m++)
                for (int i = 0; i < D; i++) s[i] += dy[(size_t)m * D + i];
            CHECKF(memcmp(db, s, D * 4) == 0, "col_sum D=%d backend %d: not the row-order sums", D, k);
            memcpy(y, x, n * 4);
            be->ops->add_bias(be, y, b, M, D);
            be->ops->add(be, y, dy, n);
            int bad = 0;
            for (size_t i = 0; i < n; i++) {
                const float e = (x[i] + b[i % D]) + dy[i];
                bad += memcmp(&y[i], &e, 4) != 0;
            }
            CHECKF(bad == 0, "add_bias + add D=%d backend %d: %d elements differ", D, k, bad);
            /* bias + GELU in one pass == add_bias then gelu, into another buffer and in place */
            float *u = malloc(n * 4), *u2 = malloc(n * 4), *g = malloc(n * 4);
            memcpy(g, x, n * 4);
            be->ops->add_bias(be, g, b, M, D);
            be->ops->gelu(be, g, n);
            memcpy(u, x, n * 4);
            memcpy(u2, x, n * 4);
            be->ops->bias_gelu(be, y, u, b, M, D);
            be->ops->add_bias(be, u2, b, M, D);
            CHECKF(memcmp(y, g, n * 4) == 0 && memcmp(u, u2, n * 4) == 0,
                   "bias_gelu D=%d backend %d: not add_bias + gelu's bits", D, k);
            be->ops->bias_gelu(be, u2, u2, NULL, M, D);
            CHECKF(memcmp(u2, g, n * 4) == 0, "bias_gelu in place D=%d backend %d", D, k);
            free(u), free(u2), free(g);
        }
        free(x), free(dy), free(w), free(b), free(dx0), free(y), free(want), free(dx), free(wdx);
        free(dw), free(db), free(wdw), free(wdb);
    }
}

int main(void) {
    for (int N = 1; N <= 17; N += 4)
        for (int R = 1; R <= 3; R++)
            for (int key = 0; key < 2; key++) {
                test_row_vs_pair(N, R, 1, key, 0, 1);
                test_row_vs_pair(N, R, 37, key, 1, 1);
                test_row_vs_pair(N, R, 64, key, 0, 0);
            }
    dcs_err e = {0};
    dcs_backend *b1 = dcs_backend_cpu_create(1, &e), *b2 = dcs_backend_cpu_create(2, &e);
    dcs_backend *b3 = dcs_backend_cpu_create(3, &e);
    CHECKF(b1 && b2 && b3, "cpu backends: %s", e.msg);
    if (!b1 || !b2 || !b3) return check_report("kernels", &counts);
    dcs_backend *bes[3] = {b1, b2, b3};
    dcs_backend *b16 = dcs_backend_cpu_create(16, &e);
    CHECKF(b16 != NULL, "cpu backend of 16 threads: %s", e.msg);
    if (b16) {
        dcs_backend *all[4] = {b1, b2, b3, b16};
        test_gemm_tiles(all, 4);
        b16->ops->destroy(b16);
    }
    test_norm_rows(bes, 3);
    for (int i = 0; i < 3; i++) {
        test_fused_attention(bes[i], 70, 0, 1, 1);  /* global, 3 query blocks */
        test_fused_attention(bes[i], 70, 5, 1, 1);  /* local window           */
        test_fused_attention(bes[i], 33, 40, 1, 0); /* query-wise, window > T */
        test_fused_attention(bes[i], 45, 0, 0, 0);  /* plain MHA              */
        test_attention_paths_same_bits(bes[i], 70, 0, 1, 1);
        test_attention_paths_same_bits(bes[i], 70, 5, 1, 1);
        test_attention_paths_same_bits(bes[i], 19, 5, 1, 1); /* issue 48's shape: 16 + 3 rows */
        test_attention_paths_same_bits(bes[i], 33, 40, 1, 0);
        test_attention_paths_same_bits(bes[i], 45, 0, 0, 0);
        test_attention_paths_same_bits(bes[i], 300, 7, 0, 0); /* keys on both sides of a block */
        test_gemm_w(bes[i], DCS_F16, 1);
        test_gemm_w(bes[i], DCS_BF16, 1);
        test_gemm_w(bes[i], DCS_F16, 0);
        test_widen_all(bes[i], DCS_F16);
        test_narrow(bes[i], DCS_F16);
        test_narrow(bes[i], DCS_BF16);
        test_widen_all(bes[i], DCS_BF16);
    }
    /* backend compose over [B, N, T, S] == pair form, threaded or not */
    {
        const int B = 2, N = 5, T = 40, R = 2;
        const size_t nm = (size_t)B * N * T * T;
        float *in = rand_buf(nm), *o1 = malloc(nm * 4), *o2 = malloc(nm * 4), *br[5];
        float *qw1 = rand_buf((size_t)B * T * R * N), *qw2 = rand_buf((size_t)B * T * R * N);
        float *kw1 = rand_buf((size_t)B * T * R * N), *kw2 = rand_buf((size_t)B * T * R * N);
        float *qdd = rand_buf((size_t)B * T * N), *kdd = rand_buf((size_t)B * T * N);
        float *wb[5];
        for (int k = 0; k < 5; k++) {
            br[k] = malloc(nm * 4);
            wb[k] = malloc(nm * 4);
        }
        for (int causal = 0; causal < 2; causal++) {
            dcs_compose_args a = {.out = o1,
                                  .in = in,
                                  .qw1 = qw1,
                                  .qw2 = qw2,
                                  .kw1 = kw1,
                                  .kw2 = kw2,
                                  .qdd = qdd,
                                  .kdd = kdd,
                                  .br = {br[0], NULL, br[2], NULL, br[4], NULL},
                                  .B = B,
                                  .N = N,
                                  .T = T,
                                  .S = T,
                                  .R = R,
                                  .G = 1,
                                  .causal_only = causal,
                                  .window = causal ? 7 : 0};
            b2->ops->compose(b2, &a);
            for (int b = 0; b < B; b++)
                for (int t = 0; t < T; t++)
                    for (int s = 0; s < T; s++) {
                        size_t o = (size_t)b * N * T * T + (size_t)t * T + s;
                        if (causal && !dcs_allowed(t, s, 7)) {
                            for (int n = 0; n < N; n++)
                                for (int k = -1; k < 5; k++)
                                    (k < 0 ? o2 : wb[k])[o + (size_t)n * T * T] = 0.0f;
                            continue;
                        }
                        dcs_compose_pair_plain(
                            in + o, o2 + o, (long long)T * T, N, R, qw1 + ((size_t)b * T + t) * R * N,
                            qw2 + ((size_t)b * T + t) * R * N, kw1 + ((size_t)b * T + s) * R * N,
                            kw2 + ((size_t)b * T + s) * R * N, qdd + ((size_t)b * T + t) * N,
                            kdd + ((size_t)b * T + s) * N, wb[0] + o, wb[1] + o, wb[2] + o, wb[3] + o,
                            wb[4] + o, NULL);
                    }
            int same = memcmp(o1, o2, nm * 4) == 0 && memcmp(br[0], wb[0], nm * 4) == 0 &&
                       memcmp(br[2], wb[2], nm * 4) == 0 && memcmp(br[4], wb[4], nm * 4) == 0;
            CHECKF(same, "backend compose (causal=%d) == pair form, bit for bit", causal);
        }
        free(in);
        free(o1);
        free(o2);
        free(qw1);
        free(qw2);
        free(kw1);
        free(kw2);
        free(qdd);
        free(kdd);
        for (int k = 0; k < 5; k++) {
            free(br[k]);
            free(wb[k]);
        }
    }
    for (int i = 0; i < 3; i++) bes[i]->ops->destroy(bes[i]);
    return check_report("kernels", &counts);
}
