/*
 * test_backward.c -- every op backward of backward.c against central finite
 * differences of its forward: LayerNorm (x, weight, bias), RMS norm with and
 * without scale (QK-norm, dynamic w1 norm), rotary, GELU, tanh, masked softmax
 * (global and windowed), and the compose of one (t, s) pair (all five
 * branches, with and without key-wise branches, and with branches cut).
 *
 * Loss L = sum_i w_i y_i (w random), so dL/dy = w. Forwards are float32, the
 * loss is summed in double; eps = 1e-3, tolerance: |fd - analytic| <=
 * 1e-2 * max|analytic| + 1e-3.
 */
#include "backward.h"
#include "dcs_math.h"
#include "check.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int n_pass, n_fail;
#define CHECK(cond, ...)                                                                                     \
    do {                                                                                                     \
        if (cond) {                                                                                          \
            n_pass++;                                                                                        \
        } else {                                                                                             \
            n_fail++;                                                                                        \
            printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                                           \
            printf(__VA_ARGS__);                                                                             \
            printf("\n");                                                                                    \
        }                                                                                                    \
    } while (0)

#define EPS 1e-3f

static unsigned rng_state = 12345u;
static float frand(void) { /* uniform [-1, 1) */
    rng_state = rng_state * 1664525u + 1013904223u;
    return (float)((rng_state >> 8) & 0xFFFFFF) / 8388608.0f - 1.0f;
}
static void fill(float *x, int n, float scale) {
    for (int i = 0; i < n; i++) x[i] = scale * frand();
}

/* An op as forward(params, x) -> y with n_y outputs. */
typedef void (*fw_fn)(void *ctx, const float *x, float *y);

static double loss_of(fw_fn f, void *ctx, const float *x, float *y, int n_y, const float *w) {
    f(ctx, x, y);
    double L = 0;
    for (int i = 0; i < n_y; i++) L += (double)w[i] * y[i];
    return L;
}

/* Compare grad [n] of L w.r.t. the array p (which f reads through ctx or x). */
static void check_grad(const char *what, fw_fn f, void *ctx, const float *x, float *p, int n,
                       const float *grad, int n_y, const float *w) {
    float *y = malloc(sizeof(float) * n_y);
    double mx = 0, worst = 0;
    for (int i = 0; i < n; i++) mx = fmax(mx, fabs(grad[i]));
    for (int i = 0; i < n; i++) {
        float keep = p[i];
        p[i] = keep + EPS;
        double lp = loss_of(f, ctx, x, y, n_y, w);
        p[i] = keep - EPS;
        double lm = loss_of(f, ctx, x, y, n_y, w);
        p[i] = keep;
        double fd = (lp - lm) / (2.0 * EPS);
        worst = fmax(worst, fabs(fd - grad[i]));
    }
    CHECK(worst <= 1e-2 * mx + 1e-3, "%s: max |fd - analytic| %.3g (max |grad| %.3g)", what, worst, mx);
    free(y);
}

/* ---------------------------------------------------------------- LayerNorm */
typedef struct {
    int M, D;
    float *w, *b;
    float mu[8], rs[8];
} ln_ctx;
static void ln_f(void *c, const float *x, float *y) {
    ln_ctx *a = c;
    dcs_layernorm_fw(y, a->mu, a->rs, x, a->w, a->b, a->M, a->D, 1e-5f);
}
static void test_layernorm(void) {
    enum { M = 3, D = 16 };
    float x[M * D], w[D], b[D], y[M * D], wy[M * D], dx[M * D] = {0}, dw[D] = {0}, db[D] = {0};
    fill(x, M * D, 2.0f);
    fill(w, D, 1.0f);
    fill(b, D, 0.5f);
    fill(wy, M * D, 1.0f);
    ln_ctx c = {M, D, w, b, {0}, {0}};
    ln_f(&c, x, y);
    dcs_layernorm_bw(dx, dw, db, wy, x, c.mu, c.rs, w, M, D);
    check_grad("layernorm dx", ln_f, &c, x, x, M * D, dx, M * D, wy);
    check_grad("layernorm dw", ln_f, &c, x, w, D, dw, M * D, wy);
    check_grad("layernorm db", ln_f, &c, x, b, D, db, M * D, wy);
}

/* ---------------------------------------------------------------- RMS norm */
typedef struct {
    int rows, width;
    float *scale;
    float rs[16];
} rms_ctx;
static void rms_f(void *c, const float *x, float *y) {
    rms_ctx *a = c;
    memcpy(y, x, sizeof(float) * a->rows * a->width);
    dcs_rmsnorm_fw(y, a->rs, a->rows, a->width, a->scale, 1e-6f);
}
static void test_rmsnorm(int with_scale) {
    enum { R = 4, W = 8 };
    float x[R * W], s[W], y[R * W], wy[R * W], dx[R * W] = {0}, ds[W] = {0};
    fill(x, R * W, 1.5f);
    fill(s, W, 1.0f);
    fill(wy, R * W, 1.0f);
    rms_ctx c = {R, W, with_scale ? s : NULL, {0}};
    rms_f(&c, x, y);
    dcs_rmsnorm_bw(dx, with_scale ? ds : NULL, wy, x, c.rs, R, W, c.scale);
    check_grad(with_scale ? "rmsnorm(scale) dx" : "rmsnorm dx", rms_f, &c, x, x, R * W, dx, R * W, wy);
    if (with_scale) check_grad("rmsnorm dscale", rms_f, &c, x, s, W, ds, R * W, wy);
}

/* ---------------------------------------------------------------- rotary */
typedef struct {
    int M, T, N, Dh, rot;
    float cs[64];
} rot_ctx;
static void rot_f(void *c, const float *x, float *y) {
    rot_ctx *a = c;
    memcpy(y, x, sizeof(float) * a->M * a->N * a->Dh);
    dcs_rotary_apply(y, a->cs, a->M, a->T, a->N, a->Dh, a->rot, 0);
}
static void test_rotary(void) {
    enum { T = 5, M = 10, N = 2, Dh = 8 };
    rot_ctx c = {M, T, N, Dh, 4, {0}};
    dcs_rotary_table(c.cs, T, 4, 10000.0f);
    float x[M * N * Dh], wy[M * N * Dh], y[M * N * Dh], dx[M * N * Dh];
    fill(x, M * N * Dh, 1.0f);
    fill(wy, M * N * Dh, 1.0f);
    memcpy(dx, wy, sizeof dx);
    dcs_rotary_apply(dx, c.cs, M, T, N, Dh, 4, 1);
    check_grad("rotary dx", rot_f, &c, x, x, M * N * Dh, dx, M * N * Dh, wy);
    (void)y;
}

/* ---------------------------------------------------------------- gelu, tanh */
static void gelu_f(void *c, const float *x, float *y) {
    int n = *(int *)c;
    for (int i = 0; i < n; i++) y[i] = dcs_gelu(x[i]);
}
static void tanh_f(void *c, const float *x, float *y) {
    int n = *(int *)c;
    for (int i = 0; i < n; i++) y[i] = tanhf(x[i]);
}
static void test_pointwise(void) {
    enum { n = 24 };
    int nn = n;
    float x[n], y[n], wy[n], dx[n] = {0}, dt[n] = {0};
    fill(x, n, 3.0f);
    fill(wy, n, 1.0f);
    x[0] = 0.0f; /* near 0 */
    x[1] = 5e-7f;
    x[2] = -2e-6f;
    for (int i = 0; i < n; i++) dx[i] = wy[i] * dcs_gelu_grad(x[i]);
    check_grad("gelu dx", gelu_f, &nn, x, x, n, dx, n, wy);
    tanh_f(&nn, x, y);
    dcs_tanh_bw(dt, wy, y, n);
    check_grad("tanh dx", tanh_f, &nn, x, x, n, dt, n, wy);
}

/* ---------------------------------------------------------------- softmax */
typedef struct {
    int BN, T, window;
} sm_ctx;
static void sm_f(void *c, const float *x, float *y) {
    sm_ctx *a = c;
    memcpy(y, x, sizeof(float) * a->BN * a->T * a->T);
    dcs_softmax_fw(y, 0, (long long)a->BN * a->T, a->T, a->T, a->window);
}
static void test_softmax(int window) {
    enum { BN = 2, T = 6 };
    float x[BN * T * T], y[BN * T * T], wy[BN * T * T], dx[BN * T * T];
    fill(x, BN * T * T, 3.0f);
    fill(wy, BN * T * T, 1.0f);
    sm_ctx c = {BN, T, window};
    sm_f(&c, x, y);
    dcs_softmax_bw(dx, wy, y, 0, BN * T, T, T, window);
    check_grad(window ? "softmax(window) dx" : "softmax dx", sm_f, &c, x, x, BN * T * T, dx, BN * T * T, wy);
}

/* ---------------------------------------------------------------- compose */
enum { CN = 4, CR = 2 };
typedef struct {
    float qw1[CR * CN], qw2[CR * CN], kw1[CR * CN], kw2[CR * CN], qdd[CN], kdd[CN];
    int keys;
    unsigned on;
} cp_ctx;
static void cp_f(void *c, const float *x, float *y) {
    cp_ctx *a = c;
    float br[5][CN];
    dcs_compose_pair_plain(x, y, 1, CN, CR, a->qw1, a->qw2, a->keys ? a->kw1 : NULL, a->keys ? a->kw2 : NULL,
                           a->qdd, a->keys ? a->kdd : NULL, br[0], br[1], br[2], br[3], br[4], NULL);
    /* only the branches switched on reach the output (the cut ones are constants) */
    for (int m = 0; m < CN; m++) {
        float s = 0;
        for (int k = 0; k < 5; k++)
            if (a->on & (1u << k)) s += br[k][m];
        y[m] = s;
    }
}
static void test_compose(int keys, unsigned on) {
    cp_ctx c;
    c.keys = keys;
    c.on = on;
    fill(c.qw1, CR * CN, 1.0f);
    fill(c.qw2, CR * CN, 1.0f);
    fill(c.kw1, CR * CN, 1.0f);
    fill(c.kw2, CR * CN, 1.0f);
    fill(c.qdd, CN, 0.9f);
    fill(c.kdd, CN, 0.9f);
    float x[CN], y[CN], wy[CN], dx[CN] = {0};
    float d1[CR * CN] = {0}, d2[CR * CN] = {0}, d3[CR * CN] = {0}, d4[CR * CN] = {0}, d5[CN] = {0},
                  d6[CN] = {0};
    fill(x, CN, 1.0f);
    fill(wy, CN, 1.0f);
    cp_f(&c, x, y);
    dcs_compose_pair_bw(x, wy, dx, 1, CN, CR, c.qw1, c.qw2, keys ? c.kw1 : NULL, keys ? c.kw2 : NULL, c.qdd,
                        keys ? c.kdd : NULL, d1, d2, keys ? d3 : NULL, keys ? d4 : NULL, d5, keys ? d6 : NULL,
                        on);
    char what[64];
    snprintf(what, sizeof what, "compose(keys=%d, on=%#x) ", keys, on);
    char w2[96];
#define CG(name, p, n, g)                                                                                    \
    do {                                                                                                     \
        snprintf(w2, sizeof w2, "%s%s", what, name);                                                         \
        check_grad(w2, cp_f, &c, x, p, n, g, CN, wy);                                                        \
    } while (0)
    CG("d a", x, CN, dx);
    CG("d qw1", c.qw1, CR * CN, d1);
    CG("d qw2", c.qw2, CR * CN, d2);
    CG("d qdd", c.qdd, CN, d5);
    if (keys) {
        CG("d kw1", c.kw1, CR * CN, d3);
        CG("d kw2", c.kw2, CR * CN, d4);
        CG("d kdd", c.kdd, CN, d6);
    }
}

/* Every variant (dcs_compose_pair_bw_var): groups, the static map, one side
 * absent, against central differences of dcs_compose_pair. */
enum { VN = 6, VG = 2, VM = VN / VG };
typedef struct {
    float qw1[CR * VN], qw2[CR * VN], kw1[CR * VN], kw2[CR * VN], qdd[VN], kdd[VN], sw[VG * VM * VM];
    int q, k, st;
} cv_ctx;
static void cv_f(void *c, const float *x, float *y) {
    cv_ctx *a = c;
    dcs_compose_pair(x, y, 1, VN, VG, CR, a->q ? a->qw1 : NULL, a->q ? a->qw2 : NULL, a->k ? a->kw1 : NULL,
                     a->k ? a->kw2 : NULL, a->q ? a->qdd : NULL, a->k ? a->kdd : NULL, a->st ? a->sw : NULL,
                     NULL, NULL, NULL, NULL, NULL, NULL);
}
static void test_compose_var(int q, int k, int st) {
    cv_ctx c = {.q = q, .k = k, .st = st};
    fill(c.qw1, CR * VN, 1.0f);
    fill(c.qw2, CR * VN, 1.0f);
    fill(c.kw1, CR * VN, 1.0f);
    fill(c.kw2, CR * VN, 1.0f);
    fill(c.qdd, VN, 0.9f);
    fill(c.kdd, VN, 0.9f);
    fill(c.sw, VG * VM * VM, 1.0f);
    float x[VN], y[VN], wy[VN], dx[VN] = {0};
    float d1[CR * VN] = {0}, d2[CR * VN] = {0}, d3[CR * VN] = {0}, d4[CR * VN] = {0}, d5[VN] = {0},
                  d6[VN] = {0};
    float dsw[VG * VM * VM] = {0};
    fill(x, VN, 1.0f);
    fill(wy, VN, 1.0f);
    cv_f(&c, x, y);
    dcs_compose_pair_bw_var(x, wy, dx, 1, VN, VG, CR, q ? c.qw1 : NULL, q ? c.qw2 : NULL, k ? c.kw1 : NULL,
                            k ? c.kw2 : NULL, q ? c.qdd : NULL, k ? c.kdd : NULL, st ? c.sw : NULL, d1, d2,
                            d3, d4, d5, d6, st ? dsw : NULL, 0x3f);
    char w[96];
#define VG_(name, p, n, g)                                                                                   \
    do {                                                                                                     \
        snprintf(w, sizeof w, "compose variant (q=%d k=%d static=%d) %s", q, k, st, name);                   \
        check_grad(w, cv_f, &c, x, p, n, g, VN, wy);                                                         \
    } while (0)
    VG_("d a", x, VN, dx);
    if (q) {
        VG_("d qw1", c.qw1, CR * VN, d1);
        VG_("d qw2", c.qw2, CR * VN, d2);
        VG_("d qdd", c.qdd, VN, d5);
    }
    if (k) {
        VG_("d kw1", c.kw1, CR * VN, d3);
        VG_("d kw2", c.kw2, CR * VN, d4);
        VG_("d kdd", c.kdd, VN, d6);
    }
    if (st) VG_("d sw", c.sw, VG * VM * VM, dsw);
#undef VG_
}

/* MoH routing scores (dcs_moh_route_row_bw) against central differences of
 * dcs_moh_route_row, away from selection ties. */
enum { RN_ = 6 };
typedef struct {
    int hs, k;
    float lg[RN_], s1[RN_], s0[2];
} mr_ctx;
static void mr_f(void *c, const float *x, float *y) {
    (void)x;
    mr_ctx *a = c;
    dcs_moh_route_row(a->lg, a->hs > 1 ? a->s1 : NULL, a->hs > 0 ? a->s0 : NULL, RN_, a->hs, a->k, y);
}
static void test_moh_route(int hs, int k) {
    mr_ctx c = {.hs = hs, .k = k};
    for (int j = 0; j < RN_; j++) c.lg[j] = 0.7f * (float)j - 1.3f + 0.1f * frand(); /* distinct logits */
    fill(c.s1, RN_, 1.0f);
    fill(c.s0, 2, 1.0f);
    float y[RN_], wy[RN_], dlg[RN_], ds1[RN_], ds0[2];
    fill(wy, RN_, 1.0f);
    mr_f(&c, NULL, y);
    dcs_moh_route_row_bw(c.lg, hs > 1 ? c.s1 : NULL, hs > 0 ? c.s0 : NULL, RN_, hs, k, wy, dlg, ds1, ds0);
    char w[64];
    snprintf(w, sizeof w, "moh route (hs=%d k=%d) d logits", hs, k);
    check_grad(w, mr_f, &c, NULL, c.lg, RN_ - hs, dlg, RN_, wy);
    if (hs > 1) {
        snprintf(w, sizeof w, "moh route (hs=%d k=%d) d shared", hs, k);
        check_grad(w, mr_f, &c, NULL, c.s1, hs, ds1, RN_, wy);
    }
    if (hs > 0) {
        snprintf(w, sizeof w, "moh route (hs=%d k=%d) d balance", hs, k);
        check_grad(w, mr_f, &c, NULL, c.s0, 2, ds0, RN_, wy);
    }
}

/* The compose backward as the CUDA backend splits it (dcs_compose_bw_item:
 * a pass over queries, one over keys, per-query partial sums of the static
 * map reduced in row order), run here on the host item by item, against
 * the CPU backend's compose_bw (the row kernel for plain DCMHA, pair by
 * pair for the variants): the same outputs up to summation order. */
static void test_compose_bw_split(int q, int k, int G, int st, int window) {
    enum { B = 2, T = 7, N = 4, R = 2 };
    const int M = B * T, RN = R * N, Mg = N / G, GMM = G * Mg * Mg;
    const size_t map = (size_t)B * N * T * T;
    dcs_err e;
    dcs_backend *be = dcs_backend_cpu_create(2, &e);
    CHECK(be != NULL, "cpu backend");
    if (!be) return;
    float *in = malloc(sizeof(float) * map), *dOut = malloc(sizeof(float) * map);
    float *w[6], *g[2][6], *dIn[2], *dsw[2], *sw = malloc(sizeof(float) * GMM);
    fill(in, (int)map, 1.0f);
    fill(dOut, (int)map, 1.0f);
    fill(sw, GMM, 0.5f);
    for (int i = 0; i < 6; i++) {
        const int n = M * (i % 3 < 2 ? RN : N);
        w[i] = malloc(sizeof(float) * n);
        fill(w[i], n, 0.5f);
        for (int v = 0; v < 2; v++) g[v][i] = calloc(n, sizeof(float));
    }
    for (int v = 0; v < 2; v++) {
        dIn[v] = calloc(map, sizeof(float));
        dsw[v] = calloc(GMM, sizeof(float));
    }
    dcs_compose_bw_args a[2];
    for (int v = 0; v < 2; v++) {
        memset(&a[v], 0, sizeof a[v]);
        a[v].dIn = dIn[v];
        a[v].in = in;
        a[v].dOut = dOut;
        if (q) {
            a[v].qw1 = w[0], a[v].qw2 = w[1], a[v].qdd = w[2];
            a[v].dqw1 = g[v][0], a[v].dqw2 = g[v][1], a[v].dqdd = g[v][2];
        }
        if (k) {
            a[v].kw1 = w[3], a[v].kw2 = w[4], a[v].kdd = w[5];
            a[v].dkw1 = g[v][3], a[v].dkw2 = g[v][4], a[v].dkdd = g[v][5];
        }
        a[v].sw = st ? sw : NULL;
        a[v].dsw = st ? dsw[v] : NULL;
        a[v].B = B, a[v].N = N, a[v].T = T, a[v].R = R, a[v].G = G;
        a[v].window = window;
        a[v].on = 0x3f;
    }
    float *scr[6];
    /* [B, C, Tp]: the key rows padded to DCS_KEY_PAD (dcs_compose_bw_args) */
    const size_t Tp = (T + DCS_KEY_PAD - 1) / DCS_KEY_PAD * DCS_KEY_PAD;
    for (int i = 0; i < 6; i++) scr[i] = calloc((size_t)B * Tp * RN, sizeof(float));
    if (q && k && G == 1 && !st)
        for (int i = 0; i < 6; i++) a[0].scratch[i] = scr[i]; /* the row kernel */
    be->ops->compose_bw(be, &a[0]);
    /* the CUDA split, outputs zeroed as cu_compose_bw zeroes them */
    float *part = calloc((size_t)M * GMM, sizeof(float));
    for (size_t i = 0; i < (size_t)M; i++) dcs_compose_bw_item(&a[1], 0, i, NULL);
    if (k)
        for (size_t i = 0; i < (size_t)M; i++) dcs_compose_bw_item(&a[1], 1, i, NULL);
    if (st) {
        for (size_t i = 0; i < (size_t)M; i++) dcs_compose_bw_item(&a[1], 2, i, part);
        for (int x = 0; x < GMM; x++)
            for (int r = 0; r < M; r++) dsw[1][x] += part[(size_t)r * GMM + x];
    }
    const float *got[8] = {dIn[1], g[1][0], g[1][1], g[1][2], g[1][3], g[1][4], g[1][5], dsw[1]};
    const float *want[8] = {dIn[0], g[0][0], g[0][1], g[0][2], g[0][3], g[0][4], g[0][5], dsw[0]};
    const size_t len[8] = {map,           (size_t)M * RN, (size_t)M * RN,
                           (size_t)M * N, (size_t)M * RN, (size_t)M * RN,
                           (size_t)M * N, (size_t)GMM};
    for (int j = 0; j < 8; j++) {
        double mx = 0, err = 0;
        for (size_t i = 0; i < len[j]; i++) {
            mx = fmax(mx, fabs(want[j][i]));
            err = fmax(err, fabs((double)got[j][i] - want[j][i]));
        }
        /* float32 sums of at most T*N*R terms of order 1, in two orders */
        CHECK(err <= 1e-5 * fmax(mx, 1.0),
              "compose_bw split q=%d k=%d G=%d st=%d window=%d output %d: err %.3g "
              "(max %.3g)",
              q, k, G, st, window, j, err, mx);
    }
    free(part);
    for (int i = 0; i < 6; i++) {
        free(w[i]);
        free(g[0][i]);
        free(g[1][i]);
        free(scr[i]);
    }
    for (int v = 0; v < 2; v++) {
        free(dIn[v]);
        free(dsw[v]);
    }
    free(in);
    free(dOut);
    free(sw);
    be->ops->destroy(be);
}

int main(void) {
    test_layernorm();
    test_rmsnorm(0);
    test_rmsnorm(1);
    test_rotary();
    test_pointwise();
    test_softmax(0);
    test_softmax(2);
    test_compose(1, 0x1f);
    test_compose(0, 0x1f);
    test_compose(1, 0x1f & ~0x4u); /* kp cut by a hook */
    test_compose(1, 0x1u | 0x8u);  /* skip + qg only  */
    test_compose_var(1, 1, 1);     /* groups + static      */
    test_compose_var(0, 1, 0);     /* key-wise only        */
    test_compose_var(1, 0, 1);     /* query-wise + static  */
    test_moh_route(0, 2);
    test_moh_route(1, 2);
    test_moh_route(2, 1);
    test_compose_bw_split(1, 1, 1, 0, 0); /* plain DCMHA: the row kernel   */
    test_compose_bw_split(1, 1, 1, 0, 3); /* windowed                      */
    test_compose_bw_split(1, 0, 1, 0, 0); /* query-wise                    */
    test_compose_bw_split(0, 1, 2, 0, 0); /* key-wise, groups              */
    test_compose_bw_split(1, 1, 2, 1, 2); /* groups + static map, windowed */
    test_compose_bw_split(1, 0, 1, 1, 0); /* query-wise + static map       */
    (void)check_count;
    check_counts cc = {n_pass, n_fail};
    return check_report("test_backward", &cc);
}
