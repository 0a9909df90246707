/*
 * test_sae.c -- the sparse dictionaries of engine/src/features/ (dclens.h,
 * "sparse dictionaries"):
 *   - bad configs, batches and arrays: each refused with its code and a
 *     message naming the field (d_in, d_sae, arch, k, sparsity_coef,
 *     bandwidth, apply_b_dec_to_input, an empty batch, NaN in x or target);
 *   - the forward of each architecture against a double reference written
 *     here from the formulas of the header;
 *   - the gradients against central differences of that reference's loss
 *     (ReLU with L1, TopK, JumpReLU's W / b), and JumpReLU's threshold
 *     against the pseudo-derivative written out in double;
 *   - AdamW: its checks, unit decoder rows, and the same bits on 1 and 2
 *     threads.
 */
#include "dclens.h"
#include "sae_check.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { DIN = 6, F = 9, N = 5, DOUT_TC = 4 };

static dcs_sae_config base(int arch) {
    dcs_sae_config c = {.d_in = DIN,
                        .d_sae = F,
                        .arch = arch,
                        .k = 3,
                        .sparsity_coef = 0.01f,
                        .bandwidth = 0.1f,
                        .n_threads = 1};
    return c;
}

/* ------------------------------------------------------------ bad input */

static void expect_new(dcs_sae_config c, const char *needle) {
    dcs_sae *s = (dcs_sae *)1;
    char err[256] = "";
    dcs_status st = dcs_sae_new(&c, &s, err, sizeof err);
    CHECKF(st == DCS_ERR_ARG, "new: got %s, want ARG (%s)", dcs_status_name(st), err);
    CHECKF(s == NULL, "new: out not cleared on failure");
    CHECKF(strstr(err, needle) != NULL, "new: message lacks '%s': %s", needle, err);
}

static void test_bad_config(void) {
    dcs_sae_config c = base(DCS_SAE_RELU);
    c.d_in = 0;
    expect_new(c, "d_in");
    c = base(DCS_SAE_RELU);
    c.d_sae = -1;
    expect_new(c, "d_sae");
    c = base(DCS_SAE_RELU);
    c.arch = 7;
    expect_new(c, "arch");
    c = base(DCS_SAE_TOPK);
    c.k = F + 1;
    expect_new(c, "k must be in 1..d_sae");
    c.k = 0;
    expect_new(c, "k must be");
    c = base(DCS_SAE_RELU);
    c.sparsity_coef = -1.0f;
    expect_new(c, "sparsity_coef");
    c.sparsity_coef = NAN;
    expect_new(c, "sparsity_coef");
    c = base(DCS_SAE_JUMPRELU);
    c.bandwidth = 0.0f;
    expect_new(c, "bandwidth");
    c = base(DCS_SAE_RELU);
    c.d_out = DOUT_TC;
    c.apply_b_dec_to_input = 1;
    expect_new(c, "apply_b_dec_to_input");
    char err[64];
    CHECK(dcs_sae_new(NULL, NULL, err, sizeof err) == DCS_ERR_ARG);
}

static void test_bad_batches(void) {
    dcs_sae_config c = base(DCS_SAE_RELU);
    c.d_out = DOUT_TC;
    dcs_sae *s = NULL;
    char err[256];
    if (!CHECK(dcs_sae_new(&c, &s, err, sizeof err) == DCS_OK)) return;
    float x[N * DIN] = {0}, t[N * DOUT_TC] = {0}, acts[N * F];
    dcs_status st = dcs_sae_forward(s, x, 0, NULL, acts, NULL);
    CHECKF(st == DCS_ERR_ARG && strstr(dcs_sae_errmsg(s), "empty batch"), "N 0: %s", dcs_sae_errmsg(s));
    st = dcs_sae_grad(s, x, t, 0, NULL, NULL);
    CHECKF(st == DCS_ERR_ARG && strstr(dcs_sae_errmsg(s), "empty batch"), "grad N 0: %s", dcs_sae_errmsg(s));
    x[2 * DIN + 3] = NAN;
    st = dcs_sae_forward(s, x, N, NULL, acts, NULL);
    CHECKF(st == DCS_ERR_NONFINITE && strstr(dcs_sae_errmsg(s), "x row 2"), "NaN x: %s", dcs_sae_errmsg(s));
    x[2 * DIN + 3] = 0.0f;
    t[4 * DOUT_TC] = INFINITY;
    st = dcs_sae_grad(s, x, t, N, NULL, NULL);
    CHECKF(st == DCS_ERR_NONFINITE && strstr(dcs_sae_errmsg(s), "target row 4"), "inf target: %s",
           dcs_sae_errmsg(s));
    st = dcs_sae_grad(s, x, NULL, N, NULL, NULL);
    CHECKF(st == DCS_ERR_ARG && strstr(dcs_sae_errmsg(s), "needs a target"), "no target: %s",
           dcs_sae_errmsg(s));
    float w[DIN * F] = {0};
    st = dcs_sae_set(s, DCS_SAE_PARAM, 0, w, DIN * F - 1);
    CHECKF(st == DCS_ERR_ARG && strstr(dcs_sae_errmsg(s), "W_enc has"), "count: %s", dcs_sae_errmsg(s));
    w[5] = NAN;
    st = dcs_sae_set(s, DCS_SAE_PARAM, 0, w, DIN * F);
    CHECKF(st == DCS_ERR_NONFINITE && strstr(dcs_sae_errmsg(s), "W_enc: element 5"), "NaN W: %s",
           dcs_sae_errmsg(s));
    CHECK(dcs_sae_set(s, 9, 0, w, DIN * F) == DCS_ERR_ARG);
    CHECK(dcs_sae_get(s, DCS_SAE_PARAM, 4, w, F) == DCS_ERR_ARG); /* no threshold: not JumpReLU */
    CHECK(dcs_sae_param_count(s) == 4);
    const char *name = NULL;
    int64_t n = 0;
    CHECK(dcs_sae_param_info(s, 2, &name, &n) == DCS_OK && !strcmp(name, "W_dec") && n == F * DOUT_TC);
    dcs_adamw h = {0.01f, 0.9f, 0.999f, 1e-8f, 0.0f};
    st = dcs_sae_adamw(s, 0, &h);
    CHECKF(st == DCS_ERR_ARG && strstr(dcs_sae_errmsg(s), "step"), "step 0: %s", dcs_sae_errmsg(s));
    h.beta1 = 1.0f;
    st = dcs_sae_adamw(s, 1, &h);
    CHECKF(st == DCS_ERR_ARG && strstr(dcs_sae_errmsg(s), "beta1"), "beta1: %s", dcs_sae_errmsg(s));
    dcs_sae_free(s);
}

/* ------------------------------------------------------------ the double reference */

typedef struct {
    int arch, k, dout, center;
    double coef, eps;
    double we[DIN * F], be[F], wd[F * DIN], bd[DIN], lthr[F];
} ref_sae;

/* pre, acts [N, F] and the loss of x [N, DIN] against t [N, dout]. */
static double ref_loss(const ref_sae *r, const double *x, const double *t, double *pre, double *acts) {
    double loss = 0.0;
    for (int n = 0; n < N; n++) {
        double *p = pre + n * F, *a = acts + n * F;
        for (int f = 0; f < F; f++) {
            p[f] = r->be[f];
            for (int j = 0; j < DIN; j++)
                p[f] += (x[n * DIN + j] - (r->center ? r->bd[j] : 0.0)) * r->we[j * F + f];
        }
        for (int f = 0; f < F; f++) {
            if (r->arch == DCS_SAE_RELU) a[f] = p[f] > 0 ? p[f] : 0;
            if (r->arch == DCS_SAE_JUMPRELU) a[f] = p[f] > exp(r->lthr[f]) ? p[f] : 0;
            if (r->arch == DCS_SAE_TOPK) { /* rank: how many beat f (ties to the lower index) */
                int rank = 0;
                for (int g = 0; g < F; g++) rank += p[g] > p[f] || (p[g] == p[f] && g < f);
                a[f] = rank < r->k && p[f] > 0 ? p[f] : 0;
            }
        }
        for (int d = 0; d < r->dout; d++) {
            double rec = r->bd[d];
            for (int f = 0; f < F; f++) rec += a[f] * r->wd[f * r->dout + d];
            loss += (rec - t[n * r->dout + d]) * (rec - t[n * r->dout + d]) / N;
        }
        for (int f = 0; f < F; f++) {
            if (r->arch == DCS_SAE_RELU) loss += r->coef * a[f] / N;
            if (r->arch == DCS_SAE_JUMPRELU) loss += r->coef * (p[f] > exp(r->lthr[f])) / N;
        }
    }
    return loss;
}

static double *ref_param(ref_sae *r, int i) {
    double *p[5] = {r->we, r->be, r->wd, r->bd, r->lthr};
    return p[i];
}

/* An SAE of `arch` (transcoder: d_out DOUT_TC) with random parameters, the
 * same in s and r. */
static dcs_sae *make(int arch, int transcoder, int center, int threads, ref_sae *r) {
    dcs_sae_config c = base(arch);
    c.d_out = transcoder ? DOUT_TC : 0;
    c.apply_b_dec_to_input = center;
    c.n_threads = threads;
    dcs_sae *s = NULL;
    char err[256];
    if (!CHECKF(dcs_sae_new(&c, &s, err, sizeof err) == DCS_OK, "new: %s", err)) return NULL;
    memset(r, 0, sizeof *r);
    r->arch = arch;
    r->k = c.k;
    r->dout = transcoder ? DOUT_TC : DIN;
    r->center = center;
    r->coef = c.sparsity_coef;
    r->eps = c.bandwidth;
    rng = 88172645463325252ull + (uint64_t)arch * 7 + (uint64_t)transcoder * 131;
    for (int i = 0; i < dcs_sae_param_count(s); i++) {
        int64_t n = 0;
        dcs_sae_param_info(s, i, NULL, &n);
        float v[DIN * F];
        for (int64_t j = 0; j < n; j++) v[j] = i == 4 ? -1.2f + 0.3f * urand() : 0.7f * urand();
        CHECK(dcs_sae_set(s, DCS_SAE_PARAM, i, v, n) == DCS_OK);
        for (int64_t j = 0; j < n; j++) ref_param(r, i)[j] = v[j];
    }
    return s;
}

static void batch(float *x, double *xd, float *t, double *td, int dout) {
    for (int j = 0; j < N * DIN; j++) xd[j] = x[j] = urand();
    for (int j = 0; j < N * dout; j++) td[j] = t[j] = urand();
}

static void test_forward(int arch, int transcoder) {
    ref_sae r;
    dcs_sae *s = make(arch, transcoder, !transcoder, 1, &r);
    if (!s) return;
    float x[N * DIN], t[N * DIN], pre[N * F], acts[N * F], rec[N * DIN];
    double xd[N * DIN], td[N * DIN], pd[N * F], ad[N * F];
    batch(x, xd, t, td, r.dout);
    CHECK(dcs_sae_forward(s, x, N, pre, acts, rec) == DCS_OK);
    ref_loss(&r, xd, td, pd, ad);
    double worst = 0.0;
    int l0 = 0;
    for (int j = 0; j < N * F; j++) {
        worst = fmax(worst, fabs(pre[j] - pd[j]));
        worst = fmax(worst, fabs(acts[j] - ad[j]));
        l0 += acts[j] != 0.0f;
    }
    for (int n = 0; n < N; n++)
        for (int d = 0; d < r.dout; d++) {
            double want = r.bd[d];
            for (int f = 0; f < F; f++) want += ad[n * F + f] * r.wd[f * r.dout + d];
            worst = fmax(worst, fabs(rec[n * r.dout + d] - want));
        }
    CHECKF(worst < 1e-5, "forward arch %d transcoder %d: off by %g", arch, transcoder, worst);
    CHECKF(l0 > 0 && l0 < N * F, "forward arch %d: L0 %d says nothing is tested", arch, l0);
    if (arch == DCS_SAE_TOPK)
        for (int n = 0; n < N; n++) {
            int kept = 0;
            for (int f = 0; f < F; f++) kept += acts[n * F + f] != 0.0f;
            CHECKF(kept <= r.k, "TopK row %d keeps %d > k", n, kept);
        }
    dcs_sae_free(s);
}

/* The gradients against central differences of ref_loss (every parameter but
 * JumpReLU's threshold, whose pseudo-derivative is checked in closed form). */
static void test_grad(int arch, int transcoder) {
    ref_sae r;
    dcs_sae *s = make(arch, transcoder, !transcoder, 1, &r);
    if (!s) return;
    float x[N * DIN], t[N * DIN], g[DIN * F];
    double xd[N * DIN], td[N * DIN], pd[N * F], ad[N * F];
    batch(x, xd, t, td, r.dout);
    dcs_sae_stats st = {0};
    int64_t fired[F] = {0};
    CHECKF(dcs_sae_grad(s, x, transcoder ? t : NULL, N, &st, fired) == DCS_OK, "grad: %s", dcs_sae_errmsg(s));
    const double *tt = transcoder ? td : xd;
    const double loss = ref_loss(&r, xd, tt, pd, ad);
    CHECKF(fabs(st.loss - loss) < 1e-5 * (1 + loss), "loss %g, reference %g", st.loss, loss);
    double l0 = 0.0;
    for (int j = 0; j < N * F; j++) l0 += ad[j] != 0.0;
    CHECKF(fabs(st.l0 - l0 / N) < 1e-12, "L0 %g, reference %g", st.l0, l0 / N);
    int64_t nf = 0;
    for (int f = 0; f < F; f++) nf += fired[f];
    CHECKF(nf == (int64_t)l0, "fired %lld, reference %g", (long long)nf, l0);
    const int np = arch == DCS_SAE_JUMPRELU ? 4 : dcs_sae_param_count(s);
    double worst = 0.0;
    for (int i = 0; i < np; i++) {
        int64_t n = 0;
        dcs_sae_param_info(s, i, NULL, &n);
        CHECK(dcs_sae_get(s, DCS_SAE_GRAD, i, g, n) == DCS_OK);
        double *p = ref_param(&r, i);
        for (int64_t j = 0; j < n; j++) {
            const double h = 1e-6, keep = p[j];
            p[j] = keep + h;
            const double up = ref_loss(&r, xd, tt, pd, ad);
            p[j] = keep - h;
            const double dn = ref_loss(&r, xd, tt, pd, ad);
            p[j] = keep;
            worst = fmax(worst, fabs(g[j] - (up - dn) / (2 * h)));
        }
    }
    CHECKF(worst < 2e-5, "grad arch %d transcoder %d: off by %g", arch, transcoder, worst);
    if (arch == DCS_SAE_JUMPRELU) { /* d loss / d log theta_f, Rajamanoharan et al.'s rectangle */
        ref_loss(&r, xd, tt, pd, ad);
        CHECK(dcs_sae_get(s, DCS_SAE_GRAD, 4, g, F) == DCS_OK);
        double w2 = 0.0, seen = 0.0;
        for (int f = 0; f < F; f++) {
            const double th = exp(r.lthr[f]);
            double want = 0.0;
            for (int n = 0; n < N; n++) {
                const double u = (pd[n * F + f] - th) / r.eps;
                if (!(u > -0.5 && u < 0.5)) continue;
                double dacts = 0.0; /* d mse / d acts */
                for (int d = 0; d < r.dout; d++) {
                    double rec = r.bd[d];
                    for (int e = 0; e < F; e++) rec += ad[n * F + e] * r.wd[e * r.dout + d];
                    dacts += 2.0 * (rec - tt[n * r.dout + d]) / N * r.wd[f * r.dout + d];
                }
                want += -(th / r.eps) * dacts - r.coef / N / r.eps;
                seen += 1;
            }
            w2 = fmax(w2, fabs(g[f] - want * th));
        }
        CHECKF(w2 < 1e-5, "JumpReLU threshold grad off by %g", w2);
        CHECKF(seen > 0, "no pre-activation fell in the rectangle: the threshold check tests nothing");
    }
    dcs_sae_free(s);
}

/* ------------------------------------------------------------ AdamW */

static void train(dcs_sae *s, float *out, int64_t n_out) {
    dcs_adamw h = {0.01f, 0.9f, 0.999f, 1e-8f, 0.01f};
    float x[N * DIN];
    rng = 12345;
    for (int step = 1; step <= 4; step++) {
        for (int j = 0; j < N * DIN; j++) x[j] = urand();
        CHECK(dcs_sae_grad(s, x, NULL, N, NULL, NULL) == DCS_OK);
        CHECK(dcs_sae_adamw(s, step, &h) == DCS_OK);
    }
    int64_t off = 0;
    for (int i = 0; i < dcs_sae_param_count(s); i++) {
        int64_t n = 0;
        dcs_sae_param_info(s, i, NULL, &n);
        for (int w = DCS_SAE_PARAM; w <= DCS_SAE_VAR && off + n <= n_out; w++, off += n)
            CHECK(dcs_sae_get(s, w, i, out + off, n) == DCS_OK);
    }
}

static void test_adamw_threads(int arch) {
    enum { TOT = 4 * (2 * DIN * F + F + DIN + F) };
    static float a[TOT], b[TOT];
    ref_sae r;
    dcs_sae *s1 = make(arch, 0, 1, 1, &r), *s2 = make(arch, 0, 1, 2, &r);
    if (s1 && s2) {
        memset(a, 0, sizeof a);
        memset(b, 0, sizeof b);
        train(s1, a, TOT);
        train(s2, b, TOT);
        CHECKF(!memcmp(a, b, sizeof a), "arch %d: 1 and 2 threads differ", arch);
        float w0[DIN * F];
        CHECK(dcs_sae_get(s1, DCS_SAE_PARAM, 0, w0, DIN * F) == DCS_OK);
        CHECKF(fabsf(w0[0] - (float)r.we[0]) > 0.0f, "training moved nothing");
    }
    dcs_sae_free(s1);
    dcs_sae_free(s2);
}

static void test_unit_decoder(void) {
    dcs_sae_config c = base(DCS_SAE_RELU);
    c.normalize_decoder = 1;
    dcs_sae *s = NULL;
    char err[256];
    if (!CHECK(dcs_sae_new(&c, &s, err, sizeof err) == DCS_OK)) return;
    float w[F * DIN], x[N * DIN];
    for (int j = 0; j < F * DIN; j++) w[j] = 3.0f * urand();
    for (int j = 0; j < N * DIN; j++) x[j] = urand();
    CHECK(dcs_sae_set(s, DCS_SAE_PARAM, 2, w, F * DIN) == DCS_OK);
    CHECK(dcs_sae_set(s, DCS_SAE_PARAM, 0, w, F * DIN) == DCS_OK);
    dcs_adamw h = {0.01f, 0.9f, 0.999f, 1e-8f, 0.0f};
    CHECK(dcs_sae_grad(s, x, NULL, N, NULL, NULL) == DCS_OK);
    CHECK(dcs_sae_adamw(s, 1, &h) == DCS_OK);
    CHECK(dcs_sae_get(s, DCS_SAE_PARAM, 2, w, F * DIN) == DCS_OK);
    double worst = 0.0;
    for (int f = 0; f < F; f++) {
        double n2 = 0.0;
        for (int d = 0; d < DIN; d++) n2 += (double)w[f * DIN + d] * w[f * DIN + d];
        worst = fmax(worst, fabs(sqrt(n2) - 1.0));
    }
    CHECKF(worst < 1e-6, "decoder rows not unit after a step: off by %g", worst);
    dcs_sae_free(s);
}

int main(void) {
    test_bad_config();
    test_bad_batches();
    for (int arch = DCS_SAE_RELU; arch <= DCS_SAE_JUMPRELU; arch++)
        for (int tc = 0; tc < 2; tc++) {
            test_forward(arch, tc);
            test_grad(arch, tc);
        }
    for (int arch = DCS_SAE_RELU; arch <= DCS_SAE_JUMPRELU; arch++) test_adamw_threads(arch);
    test_unit_decoder();
    return check_report("test_sae", &counts);
}
