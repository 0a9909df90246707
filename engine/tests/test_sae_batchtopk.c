/*
 * test_sae_batchtopk.c -- BatchTopK and dead-feature resampling of
 * engine/src/features/ (dclens.h, "sparse dictionaries"):
 *   - the batch's selection: k * N entries, ties to the lower flat index
 *     (every pre-activation equal), the same bits on 1 and 2 threads;
 *   - the inference threshold: each step moves it by DCS_SAE_THRESHOLD_LR
 *     toward the smallest kept activation (found here by sorting), and the
 *     forward thresholds at it;
 *   - resampling: an empty batch and a feature out of range refused by
 *     name; a dead feature's decoder row = the unit (target - b_dec) row of
 *     the worst-reconstructed row, b_enc 0, its moments 0.
 */
#include "dclens.h"
#include "sae_check.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { DIN = 6, F = 9, N = 5, K = 3 };

static dcs_sae *make(int threads) {
    dcs_sae_config c = {.d_in = DIN, .d_sae = F, .arch = DCS_SAE_BATCHTOPK, .k = K, .n_threads = threads};
    dcs_sae *s = NULL;
    char err[256];
    if (!CHECKF(dcs_sae_new(&c, &s, err, sizeof err) == DCS_OK, "new: %s", err)) return NULL;
    rng = 4242;
    float w[DIN * F];
    for (int i = 0; i < 3; i++) { /* W_enc, b_enc, W_dec */
        int64_t n = 0;
        dcs_sae_param_info(s, i, NULL, &n);
        for (int j = 0; j < n; j++) w[j] = urand();
        CHECK(dcs_sae_set(s, DCS_SAE_PARAM, i, w, n) == DCS_OK);
    }
    return s;
}

static int desc(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static void test_ties_and_config(void) {
    dcs_sae *s = make(1);
    if (!s) return;
    const char *name = NULL;
    int64_t n = 0;
    CHECK(dcs_sae_param_count(s) == 5 && dcs_sae_param_info(s, 4, &name, &n) == DCS_OK);
    CHECKF(!strcmp(name, "threshold") && n == 1, "param 4: %s [%lld]", name, (long long)n);
    float zero[DIN * F] = {0}, one[F], x[N * DIN];
    for (int f = 0; f < F; f++) one[f] = 1.0f;
    for (int j = 0; j < N * DIN; j++) x[j] = urand();
    CHECK(dcs_sae_set(s, DCS_SAE_PARAM, 0, zero, DIN * F) == DCS_OK);
    CHECK(dcs_sae_set(s, DCS_SAE_PARAM, 1, one, F) == DCS_OK); /* every pre = 1: all tied */
    int64_t fired[F] = {0};
    dcs_sae_stats st;
    CHECK(dcs_sae_grad(s, x, NULL, N, &st, fired) == DCS_OK);
    /* K * N = 15 kept: row 0's 9 features, then row 1's first 6 */
    for (int f = 0; f < F; f++)
        CHECKF(fired[f] == (f < 6 ? 2 : 1), "fired[%d] = %lld", f, (long long)fired[f]);
    CHECKF(st.l0 == (double)K, "l0 %g, want %d", st.l0, K);
    dcs_sae_free(s);
    dcs_sae_config c = {.d_in = DIN, .d_sae = F, .arch = DCS_SAE_BATCHTOPK, .k = F + 1};
    char err[256] = "";
    CHECK(dcs_sae_new(&c, &s, err, sizeof err) == DCS_ERR_ARG && strstr(err, "k must be in 1..d_sae"));
}

static void test_threshold(void) {
    dcs_sae *s = make(1);
    if (!s) return;
    float x[N * DIN], pre[N * F], acts[N * F], thr = -1.0f;
    dcs_adamw h = {0.0f, 0.9f, 0.999f, 1e-8f, 0.0f}; /* lr 0: only the threshold moves */
    float want = 0.0f;
    for (int step = 1; step <= 2; step++) {
        for (int j = 0; j < N * DIN; j++) x[j] = urand();
        CHECK(dcs_sae_forward(s, x, N, pre, NULL, NULL) == DCS_OK);
        qsort(pre, N * F, sizeof(float), desc);
        CHECKF(pre[K * N - 1] > 0.0f, "the test wants K * N positive pre-activations");
        want += DCS_SAE_THRESHOLD_LR * (pre[K * N - 1] - want);
        CHECK(dcs_sae_grad(s, x, NULL, N, NULL, NULL) == DCS_OK);
        CHECK(dcs_sae_adamw(s, step, &h) == DCS_OK);
        CHECK(dcs_sae_get(s, DCS_SAE_PARAM, 4, &thr, 1) == DCS_OK);
        CHECKF(thr == want, "step %d: threshold %.9g, want %.9g", step, thr, want);
    }
    float big = 0.3f;
    CHECK(dcs_sae_set(s, DCS_SAE_PARAM, 4, &big, 1) == DCS_OK);
    CHECK(dcs_sae_forward(s, x, N, pre, acts, NULL) == DCS_OK);
    int bad = 0;
    for (int j = 0; j < N * F; j++) bad += acts[j] != (pre[j] > big ? pre[j] : 0.0f);
    CHECKF(bad == 0, "inference: %d activations not thresholded at 0.3", bad);
    dcs_sae_free(s);
}

static void test_threads(void) {
    dcs_sae *a = make(1), *b = make(2);
    dcs_adamw h = {0.01f, 0.9f, 0.999f, 1e-8f, 0.0f};
    float x[N * DIN], wa[DIN * F], wb[DIN * F], ta, tb;
    for (int step = 1; a && b && step <= 3; step++) {
        for (int j = 0; j < N * DIN; j++) x[j] = urand();
        CHECK(dcs_sae_grad(a, x, NULL, N, NULL, NULL) == DCS_OK && dcs_sae_adamw(a, step, &h) == DCS_OK);
        CHECK(dcs_sae_grad(b, x, NULL, N, NULL, NULL) == DCS_OK && dcs_sae_adamw(b, step, &h) == DCS_OK);
    }
    if (a && b) {
        CHECK(dcs_sae_get(a, DCS_SAE_PARAM, 0, wa, DIN * F) == DCS_OK);
        CHECK(dcs_sae_get(b, DCS_SAE_PARAM, 0, wb, DIN * F) == DCS_OK);
        CHECK(dcs_sae_get(a, DCS_SAE_PARAM, 4, &ta, 1) == DCS_OK &&
              dcs_sae_get(b, DCS_SAE_PARAM, 4, &tb, 1) == DCS_OK);
        CHECKF(!memcmp(wa, wb, sizeof wa) && ta == tb && ta > 0.0f, "1 and 2 threads differ");
    }
    dcs_sae_free(a);
    dcs_sae_free(b);
}

static void test_resample(void) {
    dcs_sae *s = make(1);
    if (!s) return;
    float x[N * DIN], recon[N * DIN], bdec[DIN], v[DIN * F];
    for (int j = 0; j < N * DIN; j++) x[j] = 2.0f * urand();
    for (int j = 0; j < DIN; j++) bdec[j] = 0.1f * urand();
    CHECK(dcs_sae_set(s, DCS_SAE_PARAM, 3, bdec, DIN) == DCS_OK);
    for (int j = 0; j < DIN * F; j++) v[j] = 1.0f;
    CHECK(dcs_sae_set(s, DCS_SAE_MOM, 2, v, F * DIN) == DCS_OK);
    const int dead[2] = {4, F};
    dcs_status st = dcs_sae_resample(s, x, NULL, 0, dead, 1);
    CHECKF(st == DCS_ERR_ARG && strstr(dcs_sae_errmsg(s), "empty batch"), "N 0: %s", dcs_sae_errmsg(s));
    st = dcs_sae_resample(s, x, NULL, N, dead, 2);
    CHECKF(st == DCS_ERR_ARG && strstr(dcs_sae_errmsg(s), "dead[1] = 9"), "bad index: %s", dcs_sae_errmsg(s));
    CHECK(dcs_sae_forward(s, x, N, NULL, NULL, recon) == DCS_OK);
    int worst = 0;
    double we = -1.0;
    for (int r = 0; r < N; r++) {
        double e = 0.0;
        for (int j = 0; j < DIN; j++)
            e +=
                ((double)x[r * DIN + j] - recon[r * DIN + j]) * ((double)x[r * DIN + j] - recon[r * DIN + j]);
        if (e > we) we = e, worst = r;
    }
    CHECK(dcs_sae_resample(s, x, NULL, N, dead, 1) == DCS_OK);
    float wd[F * DIN], be[F], mom[F * DIN];
    CHECK(dcs_sae_get(s, DCS_SAE_PARAM, 2, wd, F * DIN) == DCS_OK);
    CHECK(dcs_sae_get(s, DCS_SAE_PARAM, 1, be, F) == DCS_OK);
    CHECK(dcs_sae_get(s, DCS_SAE_MOM, 2, mom, F * DIN) == DCS_OK);
    double n2 = 0.0, off = 0.0;
    for (int j = 0; j < DIN; j++)
        n2 += ((double)x[worst * DIN + j] - bdec[j]) * ((double)x[worst * DIN + j] - bdec[j]);
    for (int j = 0; j < DIN; j++)
        off = fmax(off, fabs(wd[4 * DIN + j] - ((double)x[worst * DIN + j] - bdec[j]) / sqrt(n2)));
    CHECKF(off < 1e-6, "W_dec row 4 is not the unit worst row (%d): off by %g", worst, off);
    CHECK(be[4] == 0.0f && mom[4 * DIN] == 0.0f && mom[3 * DIN] == 1.0f);
    dcs_sae_free(s);
}

int main(void) {
    test_ties_and_config();
    test_threshold();
    test_threads();
    test_resample();
    return check_report("test_sae_batchtopk", &counts);
}
