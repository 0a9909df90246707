/*
 * test_backend_bw.c -- every backward operation of a backend's ops table
 * (dcs_backend.h, "backward") against central finite differences of the
 * same backend's forward operation(s), through the vtable on the backend's
 * own memory: the CPU backend (dcs_backend_cpu_create) always, the CUDA
 * backend (dcs_backend_cuda_create) too where a GPU is usable, else one line
 * says why it is skipped. Optional operations a backend lacks (NULL) are
 * skipped with a line.
 *
 *   zero, bw_scratch           sanity (not derivatives)
 *   gelu_bw                    gelu                (and bias_gelu / add_bias: + col_sum)
 *   tanh_bw                    tanh_
 *   col_sum                    add_bias
 *   layernorm_bw               layernorm
 *   rmsnorm_bw                 rmsnorm
 *   rotary_bw                  rotary
 *   softmax_bw                 softmax_masked
 *   softmax_rows_bw            softmax_masked of single-query rows (the MLP group gate)
 *   embed_bw                   embed
 *   xent_bw                    its own row losses
 *   head_gate_bw               head_gate
 *   moh_route_bw               moh_route
 *   swiglu_bw                  swiglu (E > 0: swiglu, softmax rows, head_gate; + softmax_rows_bw)
 *   compose_bw                 compose (causal_only), every variant; on the CPU run also the
 *                              CUDA kernels' split (dcs_compose_bw_item) on the host
 *   compose_softmax_bw         compose (pre), softmax_masked, compose (post)
 *   attention_bw               gemm (scores), compose, softmax_masked, compose, gemm (P v)
 *
 * The optional fused operations (qkv_split, qkv_join_bw, layernorm2,
 * layernorm2_bw, add2, bias_gelu_keep, gelu_bw_sum, mha_bw) against the
 * operations they fuse, run one after the other: bit for bit.
 *
 * The check. With dy random, L(x) = <dy, f(x)> (summed in double). For each
 * differentiated input x and a few directions v (two dense ones, uniform in
 * [-1, 1], and one single element), x+ = fl(x + h v), x- = fl(x - h v):
 *   fd = (L(x+) - L(x-)) / 2h     against     bw = <backward(dy), x+ - x-> / 2h
 * (the perturbation as rounded, so the inputs' own rounding costs nothing).
 * Inputs are of order 1, h = 1e-2. The tolerance, per check:
 *   |fd - bw| <= 1e-3 Q + 16 u Y / 2h
 * with Q = sqrt(sum_i (dy_i (y+_i - y-_i))^2) / 2h, the size of the terms
 * fd sums (random signs: the size of fd itself, and of the change one
 * wrong gradient element makes); 1e-3 of it covers the truncation error
 * h^2 f''' / 6 of a smooth op (~1e-5 relative, f''' / f' up to ~10 here,
 * and exactly 0 for the multilinear ones: compose, products). The second
 * term is float32 rounding of the forward: each output within a few ulps
 * (u = 2^-24) of its size |y_i|, allowing 16 for the sums inside an op,
 * independent across outputs, Y = sqrt(sum_i (dy_i max|y+-_i|)^2). Both
 * terms are far below what a wrong backward gives (O(Q)); the run prints
 * the largest |fd - bw| / tolerance seen (0.13 on the CPU when written).
 *
 * Outputs documented as written are filled with NaN first (an op that
 * reads or adds to them fails); outputs documented as accumulated (+=)
 * start from random values, subtracted afterwards.
 *
 * Prints one FAIL line per failed check naming the op, the case, the input
 * and the direction, and "backend_bw: N passed, M failed".
 */
#include "dcs_backend.h"
#include "dcs_math.h"
#include "check.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ harness */

static check_counts counts;
static double worst; /* the largest |fd - bw| / tolerance of a passing check */
static char worst_what[256];

static bool check_at(bool ok, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    bool r = check_count(&counts, ok, line, fmt, ap);
    va_end(ap);
    return r;
}
#define CHECKF(cond, ...) check_at((cond), __LINE__, __VA_ARGS__)

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static float frand(void) { /* uniform in [-1, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 11) * 0x1.0p-53) * 2.0f - 1.0f;
}

/* The backend under test and the buffers of the current case (host and
 * device), all given back by release_all at its end. */
static dcs_backend *be;
#define MAX_BUFS 512
static void *hbufs[MAX_BUFS], *dbufs[MAX_BUFS];
static int n_hbufs, n_dbufs;

static void die(const char *what) {
    fprintf(stderr, "backend_bw: %s\n", what);
    exit(2);
}

static void *hmem(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p || n_hbufs == MAX_BUFS) die("out of host memory");
    return hbufs[n_hbufs++] = p;
}
static float *hrand(size_t n, float scale) {
    float *h = hmem(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = scale * frand();
    return h;
}
static float *dmem(size_t n) { /* n floats of the backend, zero-filled */
    void *p = be->ops->alloc(be, (n ? n : 1) * sizeof(float));
    if (!p || n_dbufs == MAX_BUFS) die("out of backend memory");
    return dbufs[n_dbufs++] = p;
}
static void up(float *d, const float *h, size_t n) { be->ops->upload(be, d, h, n * sizeof(float)); }
static void down(float *h, const float *d, size_t n) { be->ops->download(be, h, d, n * sizeof(float)); }
static float *dput(const float *h, size_t n) {
    float *d = dmem(n);
    up(d, h, n);
    return d;
}
/* an output the op writes: NaN until then */
static float *dnan(size_t n) {
    float *h = hmem(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = NAN;
    return dput(h, n);
}
static float *dget(const float *d, size_t n) {
    float *h = hmem(n * sizeof(float));
    down(h, d, n);
    return h;
}
/* an output the op accumulates into (+=): random values first (*base) */
static float *dbase(size_t n, float **base) {
    *base = hrand(n, 0.5f);
    return dput(*base, n);
}
/* what the op added: the output less its base */
static float *dgot(const float *d, const float *base, size_t n) {
    float *h = dget(d, n);
    for (size_t i = 0; i < n; i++) h[i] -= base[i];
    return h;
}
/* y [n] (double) = the backend's d [n] */
static void y_from(double *y, const float *d, size_t n) {
    float *h = malloc((n ? n : 1) * sizeof(float));
    if (!h) die("out of host memory");
    down(h, d, n);
    for (size_t i = 0; i < n; i++) y[i] = h[i];
    free(h);
}

static void release_all(void) {
    dcs_err e;
    memset(&e, 0, sizeof e);
    dcs_status st = be->ops->sync(be, &e);
    CHECKF(st == DCS_OK, "%s: the backend reports an error: %s", be->ops->name, e.msg);
    for (int i = 0; i < n_dbufs; i++) be->ops->free(be, dbufs[i]);
    for (int i = 0; i < n_hbufs; i++) free(hbufs[i]);
    n_dbufs = n_hbufs = 0;
}

static void skip(const char *op) { printf("  %s: skipped (NULL in the %s backend)\n", op, be->ops->name); }

/* ------------------------------------------------------------ finite differences */

#define FD_IN 16
#define FD_H 1e-2
#define FD_REL 1e-3
#define FD_ULPS 16.0
#define FD_DIRS 3

typedef struct fd fd;
struct fd {
    char what[200]; /* "op [case]" */
    int n;          /* inputs */
    char name[FD_IN][24];
    float *x[FD_IN]; /* host values, perturbed (and restored) by fd_check */
    size_t len[FD_IN];
    const float *g[FD_IN]; /* the backward's gradient (host); NULL: not checked */
    size_t ny;
    const float *dy;                     /* dL/dy [ny] */
    void (*fwd)(const fd *f, double *y); /* y [ny] = the forward at the current x */
    const void *arg;
};

static int fd_input(fd *f, const char *name, float *x, size_t len, const float *g) {
    if (f->n == FD_IN) die("too many inputs");
    snprintf(f->name[f->n], sizeof f->name[0], "%s", name);
    f->x[f->n] = x;
    f->len[f->n] = len;
    f->g[f->n] = g;
    return f->n++;
}

static void fd_check(const fd *f) {
    double *yp = malloc(sizeof(double) * (f->ny ? f->ny : 1)),
           *ym = malloc(sizeof(double) * (f->ny ? f->ny : 1));
    if (!yp || !ym) die("out of host memory");
    for (int i = 0; i < f->n; i++) {
        if (!f->g[i]) continue;
        const size_t n = f->len[i];
        float *x = f->x[i], *x0 = malloc(sizeof(float) * n), *xp = malloc(sizeof(float) * n),
              *xm = malloc(sizeof(float) * n);
        if (!x0 || !xp || !xm) die("out of host memory");
        memcpy(x0, x, sizeof(float) * n);
        for (int dir = 0; dir < FD_DIRS; dir++) {
            const size_t one = (size_t)((frand() + 1.0f) * 0.5f * (float)n) % n;
            for (size_t j = 0; j < n; j++) {
                const float v = dir < FD_DIRS - 1 ? frand() : (j == one ? 1.0f : 0.0f);
                xp[j] = (float)(x0[j] + FD_H * v);
                xm[j] = (float)(x0[j] - FD_H * v);
            }
            memcpy(x, xp, sizeof(float) * n);
            f->fwd(f, yp);
            memcpy(x, xm, sizeof(float) * n);
            f->fwd(f, ym);
            memcpy(x, x0, sizeof(float) * n);
            double fdv = 0, q = 0, yy = 0, bw = 0;
            for (size_t k = 0; k < f->ny; k++) {
                const double t = f->dy[k] * (yp[k] - ym[k]), ymax = fmax(fabs(yp[k]), fabs(ym[k]));
                fdv += t;
                q += t * t;
                yy += f->dy[k] * ymax * f->dy[k] * ymax;
            }
            for (size_t j = 0; j < n; j++) bw += (double)f->g[i][j] * ((double)xp[j] - xm[j]);
            fdv /= 2 * FD_H;
            bw /= 2 * FD_H;
            const double tol =
                FD_REL * sqrt(q) / (2 * FD_H) + FD_ULPS * 0x1.0p-24 * sqrt(yy) / (2 * FD_H) + 1e-30;
            const double err = fabs(fdv - bw);
            const char *dn = dir < FD_DIRS - 1 ? "dense" : "one element";
            if (CHECKF(
                    err <= tol,
                    "%s: %s: d/d %s, %s direction %d: finite differences %.9g, backward %.9g (|diff| %.3g > "
                    "tolerance %.3g)",
                    be->ops->name, f->what, f->name[i], dn, dir, fdv, bw, err, tol) &&
                err / tol > worst) {
                worst = err / tol;
                snprintf(worst_what, sizeof worst_what, "%s: %s, d/d %s", be->ops->name, f->what, f->name[i]);
            }
        }
        free(x0);
        free(xp);
        free(xm);
    }
    free(yp);
    free(ym);
}

/* ------------------------------------------------------------ zero, bw_scratch */

static void test_zero(void) {
    const size_t n = 1000;
    float *h = hrand(n, 1.0f), *d = dput(h, n);
    be->ops->zero(be, d + 3, 500 * sizeof(float));
    float *g = dget(d, n);
    int bad = 0;
    for (size_t i = 0; i < n; i++) bad += g[i] != (i >= 3 && i < 503 ? 0.0f : h[i]);
    CHECKF(bad == 0, "%s: zero [500 floats at 3]: %d wrong", be->ops->name, bad);
    release_all();
}

static void test_bw_scratch(void) {
    if (!be->ops->bw_scratch) {
        skip("bw_scratch");
        return;
    }
    const dcs_bw_shape s = {
        .B = 2, .T = 37, .D = 24, .N = 3, .R = 2, .rot = 8, .G = 1, .use_sw = 0, .rows_kernel = 1};
    const uint64_t n = be->ops->bw_scratch(be, &s);
    CHECKF(n >= 2 * sizeof(float) * s.B * s.T && n < (1u << 30), "%s: bw_scratch [B 2, T 37]: %llu bytes",
           be->ops->name, (unsigned long long)n);
}

/* ------------------------------------------------------------ element-wise */

typedef struct {
    float *x, *b; /* device */
    int M, N;
} ew_arg;

static void gelu_fwd(const fd *f, double *y) {
    const ew_arg *a = f->arg;
    up(a->x, f->x[0], (size_t)a->M);
    be->ops->gelu(be, a->x, (size_t)a->M);
    y_from(y, a->x, (size_t)a->M);
}

/* dx = dy gelu'(x), written; in place (dx = dy) as the tape runs it */
static void test_gelu_bw(int n, int inplace) {
    float *x = hrand(n, 4.0f), *dy = hrand(n, 1.0f);
    x[0] = 0.0f; /* around 0 */
    x[1] = 5e-7f;
    x[2] = -2e-6f;
    float *xd = dput(x, n), *dyd = dput(dy, n), *dx = inplace ? dyd : dnan(n);
    be->ops->gelu_bw(be, dx, dyd, xd, (size_t)n);
    ew_arg a = {dmem(n), NULL, n, 0};
    fd f = {.ny = (size_t)n, .dy = dy, .fwd = gelu_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "gelu_bw [n %d%s]", n, inplace ? ", dx = dy" : "");
    fd_input(&f, "x", x, n, dget(dx, n));
    fd_check(&f);
    release_all();
}

/* The MLP's bias and GELU (bias_gelu, or add_bias then gelu where it is
 * NULL): the tape differentiates it with gelu_bw on the kept pre-activation
 * u = x + b and col_sum for the bias. */
static void bias_gelu_fwd(const fd *f, double *y) {
    const ew_arg *a = f->arg;
    const size_t n = (size_t)a->M * a->N;
    up(a->x, f->x[0], n);
    up(a->b, f->x[1], (size_t)a->N);
    if (be->ops->bias_gelu) {
        be->ops->bias_gelu(be, a->x, a->x, a->b, a->M, a->N);
    } else {
        be->ops->add_bias(be, a->x, a->b, a->M, a->N);
        be->ops->gelu(be, a->x, n);
    }
    y_from(y, a->x, n);
}

static void test_bias_gelu_bw(int M, int N) {
    const size_t n = (size_t)M * N;
    float *x = hrand(n, 3.0f), *b = hrand(N, 1.0f), *dy = hrand(n, 1.0f), *base;
    float *u = dput(x, n), *yd = dmem(n), *bd = dput(b, N);
    if (be->ops->bias_gelu) /* u = x + b in place, y = gelu(u) */
        be->ops->bias_gelu(be, yd, u, bd, M, N);
    else
        be->ops->add_bias(be, u, bd, M, N);
    float *dx = dnan(n), *db = dbase(N, &base);
    be->ops->gelu_bw(be, dx, dput(dy, n), u, n);
    be->ops->col_sum(be, db, dx, M, N);
    ew_arg a = {dmem(n), dmem(N), M, N};
    fd f = {.ny = n, .dy = dy, .fwd = bias_gelu_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "gelu_bw + col_sum [%s, M %d, N %d]",
             be->ops->bias_gelu ? "bias_gelu" : "add_bias, gelu", M, N);
    fd_input(&f, "x", x, n, dget(dx, n));
    fd_input(&f, "b", b, N, dgot(db, base, N));
    fd_check(&f);
    release_all();
}

static void tanh_fwd(const fd *f, double *y) {
    const ew_arg *a = f->arg;
    up(a->x, f->x[0], (size_t)a->M);
    be->ops->tanh_(be, a->x, (size_t)a->M);
    y_from(y, a->x, (size_t)a->M);
}

/* dx *= 1 - y^2 in place, y = tanh(x) the forward's output */
static void test_tanh_bw(int n) {
    float *x = hrand(n, 2.5f), *dy = hrand(n, 1.0f);
    float *y = dput(x, n), *dx = dput(dy, n);
    be->ops->tanh_(be, y, (size_t)n);
    be->ops->tanh_bw(be, dx, y, (size_t)n);
    ew_arg a = {dmem(n), NULL, n, 0};
    fd f = {.ny = (size_t)n, .dy = dy, .fwd = tanh_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "tanh_bw [n %d]", n);
    fd_input(&f, "x", x, n, dget(dx, n));
    fd_check(&f);
    release_all();
}

static void add_bias_fwd(const fd *f, double *y) {
    const ew_arg *a = f->arg;
    const size_t n = (size_t)a->M * a->N;
    up(a->x, f->x[0], n);
    up(a->b, f->x[1], (size_t)a->N);
    be->ops->add_bias(be, a->x, a->b, a->M, a->N);
    y_from(y, a->x, n);
}

/* db [N] += column sums of dy [M, N]: the gradient of add_bias's bias */
static void test_col_sum(int M, int N) {
    const size_t n = (size_t)M * N;
    float *x = hrand(n, 1.0f), *b = hrand(N, 1.0f), *dy = hrand(n, 1.0f), *base;
    float *db = dbase(N, &base);
    be->ops->col_sum(be, db, dput(dy, n), M, N);
    ew_arg a = {dmem(n), dmem(N), M, N};
    fd f = {.ny = n, .dy = dy, .fwd = add_bias_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "col_sum [add_bias, M %d, N %d]", M, N);
    fd_input(&f, "x", x, n, NULL);
    fd_input(&f, "b", b, N, dgot(db, base, N));
    fd_check(&f);
    release_all();
}

/* ------------------------------------------------------------ norms, rotary */

typedef struct {
    float *x, *w, *b, *out; /* device */
    int M, D, ld, T, N, Dh, rot;
    float eps;
} row_arg;

static void layernorm_fwd(const fd *f, double *y) {
    const row_arg *a = f->arg;
    const size_t n = (size_t)a->M * a->D;
    up(a->x, f->x[0], n);
    up(a->w, f->x[1], (size_t)a->D);
    up(a->b, f->x[2], (size_t)a->D);
    be->ops->layernorm(be, a->out, a->x, a->w, a->b, a->M, a->D, a->eps);
    y_from(y, a->out, n);
}

/* dx [M, D] +=; dw, db [D] += (NULL: not asked) */
static void test_layernorm_bw(int M, int D, int params) {
    const size_t n = (size_t)M * D;
    float *x = hrand(n, 2.0f), *w = hrand(D, 1.0f), *b = hrand(D, 0.5f), *dy = hrand(n, 1.0f);
    for (size_t i = 0; i < n; i++) x[i] += 0.5f; /* a mean away from 0 */
    float *bx, *bw, *bb;
    float *dx = dbase(n, &bx), *dw = params ? dbase(D, &bw) : NULL, *db = params ? dbase(D, &bb) : NULL;
    be->ops->layernorm_bw(be, dx, dw, db, dput(dy, n), dput(x, n), dput(w, D), M, D, 1e-5f);
    row_arg a = {.x = dmem(n), .w = dmem(D), .b = dmem(D), .out = dmem(n), .M = M, .D = D, .eps = 1e-5f};
    fd f = {.ny = n, .dy = dy, .fwd = layernorm_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "layernorm_bw [M %d, D %d%s]", M, D, params ? "" : ", dw = db = NULL");
    fd_input(&f, "x", x, n, dgot(dx, bx, n));
    fd_input(&f, "w", w, D, params ? dgot(dw, bw, D) : NULL);
    fd_input(&f, "b", b, D, params ? dgot(db, bb, D) : NULL);
    fd_check(&f);
    release_all();
}

static void rmsnorm_fwd(const fd *f, double *y) {
    const row_arg *a = f->arg;
    const size_t n = (size_t)a->M * a->D;
    up(a->x, f->x[0], n);
    if (a->w) up(a->w, f->x[1], (size_t)a->D);
    be->ops->rmsnorm(be, a->x, a->M, a->D, a->D, a->w, a->eps);
    y_from(y, a->x, n);
}

/* rows [rows, width]: dx +=; dscale [width] += (NULL: not asked); scale
 * NULL: none (the dynamic weights' w1 norm) */
static void test_rmsnorm_bw(int rows, int width, int scaled, int dscale_asked) {
    const size_t n = (size_t)rows * width;
    float *x = hrand(n, 1.5f), *s = hrand(width, 1.0f), *dy = hrand(n, 1.0f), *bx, *bs;
    float *dx = dbase(n, &bx), *ds = scaled && dscale_asked ? dbase(width, &bs) : NULL;
    be->ops->rmsnorm_bw(be, dx, ds, dput(dy, n), dput(x, n), scaled ? dput(s, width) : NULL, rows, width,
                        1e-6f);
    row_arg a = {.x = dmem(n), .w = scaled ? dmem(width) : NULL, .M = rows, .D = width, .eps = 1e-6f};
    fd f = {.ny = n, .dy = dy, .fwd = rmsnorm_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "rmsnorm_bw [rows %d, width %d, %s]", rows, width,
             !scaled        ? "no scale"
             : dscale_asked ? "scale"
                            : "scale, dscale = NULL");
    fd_input(&f, "x", x, n, dgot(dx, bx, n));
    fd_input(&f, "scale", s, width, ds ? dgot(ds, bs, width) : NULL);
    fd_check(&f);
    release_all();
}

static void rotary_fwd(const fd *f, double *y) {
    const row_arg *a = f->arg;
    const size_t n = (size_t)a->M * a->N * a->Dh;
    up(a->x, f->x[0], n);
    be->ops->rotary(be, a->x, a->M, a->T, 0, a->N, a->Dh, a->rot, 10000.0f);
    y_from(y, a->x, n);
}

/* x [M, N, Dh] rotated back in place (position m % T) */
static void test_rotary_bw(int B, int T, int N, int Dh, int rot) {
    const int M = B * T;
    const size_t n = (size_t)M * N * Dh;
    float *x = hrand(n, 1.0f), *dy = hrand(n, 1.0f), *dx = dput(dy, n);
    be->ops->rotary_bw(be, dx, M, T, N, Dh, rot, 10000.0f);
    row_arg a = {.x = dmem(n), .M = M, .T = T, .N = N, .Dh = Dh, .rot = rot};
    fd f = {.ny = n, .dy = dy, .fwd = rotary_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "rotary_bw [B %d, T %d, N %d, Dh %d, rot %d]", B, T, N, Dh, rot);
    fd_input(&f, "x", x, n, dget(dx, n));
    fd_check(&f);
    release_all();
}

/* ------------------------------------------------------------ softmax */

typedef struct {
    float *x;
    int BN, T, S, t0, window;
} sm_arg;

static void softmax_fwd(const fd *f, double *y) {
    const sm_arg *a = f->arg;
    const size_t n = (size_t)a->BN * a->T * a->S;
    up(a->x, f->x[0], n);
    be->ops->softmax_masked(be, a->x, a->BN, a->T, a->S, a->t0, 0, a->window);
    y_from(y, a->x, n);
}

/* dA [BN, T, T] written from dP and the forward's P (a full pass) */
static void test_softmax_bw(int BN, int T, int window) {
    const size_t n = (size_t)BN * T * T;
    float *x = hrand(n, 3.0f), *dy = hrand(n, 1.0f), *P = dput(x, n), *dA = dnan(n);
    be->ops->softmax_masked(be, P, BN, T, T, 0, 0, window);
    be->ops->softmax_bw(be, dA, dput(dy, n), P, BN, T, T, window);
    float *g = dget(dA, n);
    int bad = 0; /* masked entries: exactly 0 */
    for (size_t i = 0; i < n; i++)
        bad += !dcs_allowed((int)(i / T % T), (int)(i % T), window) && g[i] != 0.0f;
    CHECKF(bad == 0, "%s: softmax_bw [BN %d, T %d, window %d]: %d masked entries not 0", be->ops->name, BN, T,
           window, bad);
    sm_arg a = {dmem(n), BN, T, T, 0, window};
    fd f = {.ny = n, .dy = dy, .fwd = softmax_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "softmax_bw [BN %d, T %d, window %d]", BN, T, window);
    fd_input(&f, "x", x, n, g);
    fd_check(&f);
    release_all();
}

/* dg [M, E] in place: the gradient of a plain row softmax (the MLP group
 * gate: softmax_masked of M single-query rows at position E - 1) */
static void test_softmax_rows_bw(int M, int E) {
    const size_t n = (size_t)M * E;
    float *x = hrand(n, 3.0f), *dy = hrand(n, 1.0f), *g = dput(x, n), *dg = dput(dy, n);
    be->ops->softmax_masked(be, g, M, 1, E, E - 1, 0, 0);
    be->ops->softmax_rows_bw(be, dg, g, M, E);
    sm_arg a = {dmem(n), M, 1, E, E - 1, 0};
    fd f = {.ny = n, .dy = dy, .fwd = softmax_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "softmax_rows_bw [M %d, E %d]", M, E);
    fd_input(&f, "x", x, n, dget(dg, n));
    fd_check(&f);
    release_all();
}

/* ------------------------------------------------------------ embedding, cross-entropy */

typedef struct {
    float *table, *out, *dlogits;
    const int32_t *ids;
    int M, V, D;
    float inv;
} tok_arg;

static void embed_fwd(const fd *f, double *y) {
    const tok_arg *a = f->arg;
    up(a->table, f->x[0], (size_t)a->V * a->D);
    be->ops->embed(be, a->out, a->table, a->ids, a->M, a->D);
    y_from(y, a->out, (size_t)a->M * a->D);
}

/* dtable [V, D] += rows of dx by token (repeated tokens add up) */
static void test_embed_bw(int M, int V, int D) {
    const size_t nt = (size_t)V * D, n = (size_t)M * D;
    int32_t *ids = hmem(sizeof(int32_t) * M);
    for (int m = 0; m < M; m++) ids[m] = (int32_t)((m * 7 + m / 3) % (V - 1)); /* repeats; V-1 unused */
    float *table = hrand(nt, 1.0f), *dy = hrand(n, 1.0f), *base, *dt = dbase(nt, &base);
    be->ops->embed_bw(be, dt, dput(dy, n), ids, M, D);
    tok_arg a = {.table = dmem(nt), .out = dmem(n), .ids = ids, .M = M, .V = V, .D = D};
    fd f = {.ny = n, .dy = dy, .fwd = embed_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "embed_bw [M %d, V %d, D %d]", M, V, D);
    fd_input(&f, "table", table, nt, dgot(dt, base, nt));
    fd_check(&f);
    release_all();
}

/* the forward: inv * each row's loss, as xent_bw returns it */
static void xent_fwd(const fd *f, double *y) {
    const tok_arg *a = f->arg;
    up(a->table, f->x[0], (size_t)a->M * a->V);
    be->ops->xent_bw(be, a->dlogits, y, a->table, a->ids, a->M, a->V, a->inv);
    for (int m = 0; m < a->M; m++) y[m] *= a->inv;
}

/* dlogits [M, V] written, rows without a target (< 0) 0 with loss 0; the
 * loss against log-sum-exp in double */
static void test_xent_bw(int M, int V) {
    const size_t n = (size_t)M * V;
    int32_t *tgt = hmem(sizeof(int32_t) * M);
    int with = 0;
    for (int m = 0; m < M; m++) {
        tgt[m] = m == 1 ? -1 : (int32_t)((m * 5 + 3) % V);
        with += tgt[m] >= 0;
    }
    const float inv = 1.0f / (float)with;
    float *lg = hrand(n, 4.0f), *dl = dnan(n);
    double *loss = hmem(sizeof(double) * M);
    be->ops->xent_bw(be, dl, loss, dput(lg, n), tgt, M, V, inv);
    float *g = dget(dl, n);
    for (int m = 0; m < M; m++) {
        double mx = -INFINITY, s = 0;
        for (int v = 0; v < V; v++) mx = fmax(mx, lg[(size_t)m * V + v]);
        for (int v = 0; v < V; v++) s += exp(lg[(size_t)m * V + v] - mx);
        const double want = tgt[m] < 0 ? 0.0 : log(s) + mx - lg[(size_t)m * V + tgt[m]];
        CHECKF(fabs(loss[m] - want) <= 1e-5 * fmax(1.0, fabs(want)),
               "%s: xent_bw [M %d, V %d]: row %d loss %.9g, want %.9g", be->ops->name, M, V, m, loss[m],
               want);
        int bad = 0;
        for (int v = 0; tgt[m] < 0 && v < V; v++) bad += g[(size_t)m * V + v] != 0.0f;
        CHECKF(bad == 0, "%s: xent_bw [M %d, V %d]: row %d without a target: %d gradients not 0",
               be->ops->name, M, V, m, bad);
    }
    float *ones = hmem(sizeof(float) * M);
    for (int m = 0; m < M; m++) ones[m] = 1.0f;
    tok_arg a = {.table = dmem(n), .dlogits = dmem(n), .ids = tgt, .M = M, .V = V, .inv = inv};
    fd f = {.ny = (size_t)M, .dy = ones, .fwd = xent_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "xent_bw [M %d, V %d, row 1 without a target]", M, V);
    fd_input(&f, "logits", lg, n, g);
    fd_check(&f);
    release_all();
}

/* ------------------------------------------------------------ MoH, SwiGLU */

typedef struct {
    float *a, *b, *c, *out; /* device */
    int M, N, Dh, hs, k, F, E;
} gate_arg;

static void head_gate_fwd(const fd *f, double *y) {
    const gate_arg *a = f->arg;
    const size_t n = (size_t)a->M * a->N * a->Dh;
    up(a->a, f->x[0], n);
    up(a->b, f->x[1], (size_t)a->M * a->N);
    be->ops->head_gate(be, a->a, a->b, a->M, a->N, a->Dh);
    y_from(y, a->a, n);
}

/* dz in place (becomes d zpre); dgate [M, N] written */
static void test_head_gate_bw(int M, int N, int Dh) {
    const size_t n = (size_t)M * N * Dh, ng = (size_t)M * N;
    float *z = hrand(n, 1.0f), *gt = hrand(ng, 1.0f), *dy = hrand(n, 1.0f);
    float *dz = dput(dy, n), *dg = dnan(ng);
    be->ops->head_gate_bw(be, dz, dg, dput(z, n), dput(gt, ng), M, N, Dh);
    gate_arg a = {.a = dmem(n), .b = dmem(ng), .M = M, .N = N, .Dh = Dh};
    fd f = {.ny = n, .dy = dy, .fwd = head_gate_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "head_gate_bw [M %d, N %d, Dh %d]", M, N, Dh);
    fd_input(&f, "zpre", z, n, dget(dz, n));
    fd_input(&f, "gate", gt, ng, dget(dg, ng));
    fd_check(&f);
    release_all();
}

static void moh_fwd(const fd *f, double *y) {
    const gate_arg *a = f->arg;
    const int NR = a->N - a->hs;
    up(a->a, f->x[0], (size_t)a->M * NR);
    if (a->hs > 1) up(a->b, f->x[1], (size_t)a->M * a->hs);
    if (a->hs > 0) up(a->c, f->x[2], (size_t)a->M * 2);
    be->ops->moh_route(be, a->out, a->a, a->hs > 1 ? a->b : NULL, a->hs > 0 ? a->c : NULL, a->M, a->N, a->hs,
                       a->k);
    y_from(y, a->out, (size_t)a->M * a->N);
}

/* dlg [M, N - hs], ds1 [M, max(hs, 1)], ds0 [M, 2] written from dg [M, N];
 * the router logits of a row apart (>= 0.6), so h moves no head in or out
 * of the top k (the selection has no gradient) */
static void test_moh_route_bw(int M, int N, int hs, int k) {
    const int NR = N - hs, H1 = hs > 1 ? hs : 1;
    float *lg = hmem(sizeof(float) * M * NR), *s1 = hrand((size_t)M * H1, 1.0f),
          *s0 = hrand((size_t)M * 2, 1.0f);
    for (int m = 0; m < M; m++) {
        int *perm = hmem(sizeof(int) * NR);
        for (int j = 0; j < NR; j++) perm[j] = j;
        for (int j = NR - 1; j > 0; j--) {
            const int r = (int)((frand() + 1.0f) * 0.5f * (float)(j + 1)) % (j + 1), t = perm[j];
            perm[j] = perm[r];
            perm[r] = t;
        }
        for (int j = 0; j < NR; j++) lg[(size_t)m * NR + j] = 0.7f * (float)perm[j] - 1.3f + 0.05f * frand();
    }
    float *dy = hrand((size_t)M * N, 1.0f);
    float *dlg = dnan((size_t)M * NR), *ds1 = dnan((size_t)M * H1), *ds0 = dnan((size_t)M * 2);
    be->ops->moh_route_bw(be, dlg, ds1, ds0, dput(dy, (size_t)M * N), dput(lg, (size_t)M * NR),
                          hs > 1 ? dput(s1, (size_t)M * hs) : NULL, hs > 0 ? dput(s0, (size_t)M * 2) : NULL,
                          M, N, hs, k);
    gate_arg a = {.a = dmem((size_t)M * NR),
                  .b = dmem((size_t)M * H1),
                  .c = dmem((size_t)M * 2),
                  .out = dmem((size_t)M * N),
                  .M = M,
                  .N = N,
                  .hs = hs,
                  .k = k};
    fd f = {.ny = (size_t)M * N, .dy = dy, .fwd = moh_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "moh_route_bw [M %d, N %d, shared %d, top %d]", M, N, hs, k);
    fd_input(&f, "router logits", lg, (size_t)M * NR, dget(dlg, (size_t)M * NR));
    fd_input(&f, "shared logits", s1, (size_t)M * H1, hs > 1 ? dget(ds1, (size_t)M * hs) : NULL);
    fd_input(&f, "balance logits", s0, (size_t)M * 2, hs > 0 ? dget(ds0, (size_t)M * 2) : NULL);
    fd_check(&f);
    release_all();
}

/* pu = silu(u) u3 (swiglu); E > 0: the group gate g = softmax rows of the
 * gate logits (softmax_masked), post = pu * g[group] (head_gate) */
static void swiglu_fwd(const fd *f, double *y) {
    const gate_arg *a = f->arg;
    const size_t n = (size_t)a->M * a->F;
    up(a->a, f->x[0], n);
    up(a->b, f->x[1], n);
    be->ops->swiglu(be, a->a, a->b, n);
    if (a->E > 0) {
        up(a->c, f->x[2], (size_t)a->M * a->E);
        be->ops->softmax_masked(be, a->c, a->M, 1, a->E, a->E - 1, 0, 0);
        be->ops->head_gate(be, a->a, a->c, a->M, a->E, a->F / a->E);
    }
    y_from(y, a->a, n);
}

/* du, du3 [M, F] written from dp (scaled in place by the gate when E > 0,
 * dgate [M, E] written, then softmax_rows_bw to the gate logits) */
static void test_swiglu_bw(int M, int F, int E) {
    const size_t n = (size_t)M * F, ne = (size_t)M * (E > 0 ? E : 1);
    float *u = hrand(n, 2.0f), *u3 = hrand(n, 1.0f), *lg = hrand(ne, 2.0f), *dy = hrand(n, 1.0f);
    float *du = dnan(n), *du3 = dnan(n), *dgate = E > 0 ? dnan(ne) : NULL, *gate = NULL;
    if (E > 0) {
        gate = dput(lg, ne);
        be->ops->softmax_masked(be, gate, M, 1, E, E - 1, 0, 0);
    }
    be->ops->swiglu_bw(be, du, du3, dgate, dput(dy, n), dput(u, n), dput(u3, n), gate, M, F, E);
    if (E > 0) be->ops->softmax_rows_bw(be, dgate, gate, M, E);
    gate_arg a = {.a = dmem(n), .b = dmem(n), .c = dmem(ne), .M = M, .F = F, .E = E};
    fd f = {.ny = n, .dy = dy, .fwd = swiglu_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "swiglu_bw [M %d, F %d, E %d%s]", M, F, E,
             E > 0 ? ": swiglu, softmax rows, head_gate; + softmax_rows_bw" : "");
    fd_input(&f, "u", u, n, dget(du, n));
    fd_input(&f, "u3", u3, n, dget(du3, n));
    if (E > 0) fd_input(&f, "gate logits", lg, ne, dget(dgate, ne));
    fd_check(&f);
    release_all();
}

/* ------------------------------------------------------------ compose */

/* A compose case: B sequences of T tokens, N heads, rank R, G groups; q, k:
 * query / key side present; st: the static map; rows: the row kernel's
 * transposed key scratch given (dcs_compose_bw_args.scratch); on: the
 * branches that pass gradient; Dh: attention's head size. */
typedef struct {
    const char *label;
    int B, N, T, R, G, window;
    int q, k, st, rows;
    unsigned on;
    int Dh;
} shp;

/* one phase's weights: qw1, qw2 [B, T, R, N], qdd [B, T, N], kw1, kw2,
 * kdd likewise, sw [G, N/G, N/G]; host values, device copies, and their
 * gradients (device: written, or += for sw from base) */
typedef struct {
    const char *prefix;
    float *h[7], *d[7], *gd[7], *base_sw;
} phase;

static const char *const wname[7] = {"qw1", "qw2", "qdd", "kw1", "kw2", "kdd", "sw"};

static size_t wlen(const shp *s, int i) {
    const size_t M = (size_t)s->B * s->T, Mg = (size_t)(s->N / s->G);
    return i == 6 ? (size_t)s->G * Mg * Mg : M * (i % 3 < 2 ? (size_t)s->R * s->N : (size_t)s->N);
}
static int wpresent(const shp *s, int i) { return i < 3 ? s->q : i < 6 ? s->k : s->st; }

static void phase_init(phase *p, const shp *s, const char *prefix) {
    p->prefix = prefix;
    for (int i = 0; i < 7; i++) {
        p->h[i] = hrand(wlen(s, i), 0.5f);
        p->d[i] = wpresent(s, i) ? dput(p->h[i], wlen(s, i)) : NULL;
        p->gd[i] = !wpresent(s, i) ? NULL : i == 6 ? dbase(wlen(s, i), &p->base_sw) : dnan(wlen(s, i));
    }
}
/* the current host values (a forward of the finite differences) */
static void phase_upload(const phase *p, const shp *s, const fd *f, const int *idx) {
    for (int i = 0; i < 7; i++)
        if (p->d[i]) up(p->d[i], f->x[idx[i]], wlen(s, i));
}
static void phase_inputs(fd *f, const phase *p, const shp *s, int *idx) {
    for (int i = 0; i < 7; i++) {
        char name[24];
        snprintf(name, sizeof name, "%s%s", p->prefix, wname[i]);
        idx[i] = wpresent(s, i)
                     ? fd_input(f, name, p->h[i], wlen(s, i),
                                i == 6 ? dgot(p->gd[i], p->base_sw, wlen(s, i)) : dget(p->gd[i], wlen(s, i)))
                     : -1;
    }
}

static void compose_run(const shp *s, const phase *p, float *out, const float *in, int causal_only,
                        float **br) {
    dcs_compose_args a;
    memset(&a, 0, sizeof a);
    a.out = out;
    a.in = in;
    a.qw1 = p->d[0], a.qw2 = p->d[1], a.qdd = p->d[2];
    a.kw1 = p->d[3], a.kw2 = p->d[4], a.kdd = p->d[5];
    a.sw = p->d[6];
    for (int k = 0; br && k < DCS_N_BRANCHES; k++) a.br[k] = br[k];
    a.B = s->B, a.N = s->N, a.T = s->T, a.S = s->T, a.R = s->R, a.G = s->G;
    a.causal_only = causal_only;
    a.window = s->window;
    be->ops->compose(be, &a);
}

/* the backward's arguments of one phase (dIn, in, dOut set by the caller);
 * rows: the row kernel's scratch, NaN (the kernel fills what it reads) */
static dcs_compose_bw_args phase_bw(const shp *s, const phase *p) {
    dcs_compose_bw_args ca;
    memset(&ca, 0, sizeof ca);
    ca.qw1 = p->d[0], ca.qw2 = p->d[1], ca.qdd = p->d[2];
    ca.kw1 = p->d[3], ca.kw2 = p->d[4], ca.kdd = p->d[5];
    ca.sw = p->d[6];
    ca.dqw1 = p->gd[0], ca.dqw2 = p->gd[1], ca.dqdd = p->gd[2];
    ca.dkw1 = p->gd[3], ca.dkw2 = p->gd[4], ca.dkdd = p->gd[5];
    ca.dsw = p->gd[6];
    const size_t Tp = (size_t)(s->T + DCS_KEY_PAD - 1) / DCS_KEY_PAD * DCS_KEY_PAD, B = (size_t)s->B;
    for (int i = 0; s->rows && i < 6; i++)
        ca.scratch[i] = dnan(B * Tp * (i % 3 < 2 ? (size_t)s->R * s->N : (size_t)s->N));
    ca.B = s->B, ca.N = s->N, ca.T = s->T, ca.R = s->R, ca.G = s->G;
    ca.window = s->window;
    ca.on = s->on;
    return ca;
}

typedef struct {
    const shp *s;
    const phase *pre, *post;
    float *in, *out, *br[DCS_N_BRANCHES];
    float *q, *k, *v, *Ac, *P, *Pc, *z;
    int i_in, i_q, i_k, i_v, i_pre[7], i_post[7];
} cmp_arg;

static size_t map_len(const shp *s) { return (size_t)s->B * s->N * s->T * s->T; }

/* compose (causal_only: 0 at masked pairs); with branches cut (on), the sum
 * of the branches that pass gradient (the others are a hook's constants) */
static void compose_fwd(const fd *f, double *y) {
    const cmp_arg *a = f->arg;
    const shp *s = a->s;
    const size_t n = map_len(s);
    up(a->in, f->x[a->i_in], n);
    phase_upload(a->post, s, f, a->i_post);
    const int cut = (s->on & 0x3f) != 0x3f;
    compose_run(s, a->post, a->out, a->in, 1, cut ? (float **)a->br : NULL);
    if (!cut) {
        y_from(y, a->out, n);
        return;
    }
    double *t = malloc(sizeof(double) * n);
    if (!t) die("out of host memory");
    for (size_t i = 0; i < n; i++) y[i] = 0;
    for (int k = 0; k < DCS_N_BRANCHES; k++) {
        if (!(s->on & (1u << k))) continue;
        y_from(t, a->br[k], n);
        for (size_t i = 0; i < n; i++) y[i] += t[i];
    }
    free(t);
}

/* The CUDA backend's compose backward (cu_compose_bw) on the host, from
 * the same arguments with host pointers: outputs zeroed, a pass over the
 * queries, one over the keys, the static map's per-row partials summed in
 * row order (dcs_compose_bw_item). */
static void compose_bw_split_host(const dcs_compose_bw_args *a) {
    const size_t M = (size_t)a->B * a->T, RN = (size_t)a->R * a->N, N = (size_t)a->N;
    const size_t Mg = N / a->G, GMM = (size_t)a->G * Mg * Mg;
    memset(a->dIn, 0, sizeof(float) * M * N * a->T);
    float *const dyn[6] = {a->dqw1, a->dqw2, a->dqdd, a->dkw1, a->dkw2, a->dkdd};
    for (int i = 0; i < 6; i++)
        if (dyn[i]) memset(dyn[i], 0, sizeof(float) * M * (i % 3 < 2 ? RN : N));
    for (size_t i = 0; i < M; i++) dcs_compose_bw_item(a, 0, i, NULL);
    for (size_t i = 0; a->kw1 && i < M; i++) dcs_compose_bw_item(a, 1, i, NULL);
    if (a->sw && a->dsw && (a->on & 32)) {
        float *part = hmem(sizeof(float) * M * GMM);
        for (size_t i = 0; i < M; i++) dcs_compose_bw_item(a, 2, i, part);
        for (size_t x = 0; x < GMM; x++)
            for (size_t r = 0; r < M; r++) a->dsw[x] += part[r * GMM + x];
    }
}

/* dIn written (0 at masked pairs), the dynamic-weight gradients written,
 * dsw += */
static void test_compose_bw(shp s) {
    const size_t n = map_len(&s);
    float *in = hrand(n, 1.0f), *dy = hrand(n, 1.0f);
    phase p;
    phase_init(&p, &s, "");
    dcs_compose_bw_args ca = phase_bw(&s, &p);
    ca.dIn = dnan(n);
    ca.in = dput(in, n);
    ca.dOut = dput(dy, n);
    be->ops->compose_bw(be, &ca);
    float *dIn = dget(ca.dIn, n);
    int bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += !dcs_allowed((int)(i / s.T % s.T), (int)(i % s.T), s.window) && dIn[i] != 0.0f;
    CHECKF(bad == 0, "%s: compose_bw [%s]: %d of dIn's masked entries not 0", be->ops->name, s.label, bad);
    cmp_arg a = {.s = &s, .post = &p, .in = dmem(n), .out = dmem(n)};
    for (int k = 0; k < DCS_N_BRANCHES; k++) a.br[k] = dmem(n);
    fd f = {.ny = n, .dy = dy, .fwd = compose_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "compose_bw [%s: B %d, N %d, T %d, R %d, G %d, window %d, on %#x]",
             s.label, s.B, s.N, s.T, s.R, s.G, s.window, s.on);
    a.i_in = fd_input(&f, "in", in, n, dIn);
    phase_inputs(&f, &p, &s, a.i_post);
    fd_check(&f);
    if (!strcmp(be->ops->name, "cpu")) { /* host memory: the CUDA split on the same arguments */
        dcs_compose_bw_args h = ca;
        h.in = in, h.dOut = dy, h.dIn = hmem(sizeof(float) * n);
        const float **w[7] = {&h.qw1, &h.qw2, &h.qdd, &h.kw1, &h.kw2, &h.kdd, &h.sw};
        float **g[7] = {&h.dqw1, &h.dqw2, &h.dqdd, &h.dkw1, &h.dkw2, &h.dkdd, &h.dsw};
        for (int i = 0; i < 7; i++) {
            *w[i] = wpresent(&s, i) ? p.h[i] : NULL;
            *g[i] = wpresent(&s, i) ? hmem(sizeof(float) * wlen(&s, i)) : NULL;
        }
        compose_bw_split_host(&h);
        f.g[a.i_in] = h.dIn;
        for (int i = 0; i < 7; i++)
            if (a.i_post[i] >= 0) f.g[a.i_post[i]] = *g[i];
        snprintf(f.what, sizeof f.what,
                 "compose_bw, CUDA's split on the host [%s: B %d, N %d, T %d, R %d, G %d, window %d, on %#x]",
                 s.label, s.B, s.N, s.T, s.R, s.G, s.window, s.on);
        fd_check(&f);
    }
    release_all();
}

/* scores A -> pre-compose -> Ac -> masked softmax -> P -> post-compose -> Pc
 * (the maps path of layer.c: the pre-compose over every pair, the
 * post-compose causal_only) */
static void maps_forward(const shp *s, const phase *pre, const phase *post, const float *A, float *Ac,
                         float *P, float *Pc) {
    compose_run(s, pre, Ac, A, 0, NULL);
    be->ops->copy(be, P, Ac, map_len(s) * sizeof(float));
    be->ops->softmax_masked(be, P, s->B * s->N, s->T, s->T, 0, 0, s->window);
    compose_run(s, post, Pc, P, 1, NULL);
}

static void compose_softmax_fwd(const fd *f, double *y) {
    const cmp_arg *a = f->arg;
    up(a->in, f->x[a->i_in], map_len(a->s));
    phase_upload(a->pre, a->s, f, a->i_pre);
    phase_upload(a->post, a->s, f, a->i_post);
    maps_forward(a->s, a->pre, a->post, a->in, a->Ac, a->P, a->Pc);
    y_from(y, a->Pc, map_len(a->s));
}

/* dA (pre->dIn) and both phases' gradients from dPc (post->dOut); dP
 * (post->dIn) and dAc (pre->dOut) scratch */
static void test_compose_softmax_bw(shp s) {
    if (!be->ops->compose_softmax_bw) {
        skip("compose_softmax_bw");
        return;
    }
    const size_t n = map_len(&s);
    float *A = hrand(n, 2.0f), *dy = hrand(n, 1.0f);
    phase pre, post;
    phase_init(&pre, &s, "pre ");
    phase_init(&post, &s, "post ");
    float *Ad = dput(A, n), *Ac = dmem(n), *P = dmem(n), *Pc = dmem(n);
    maps_forward(&s, &pre, &post, Ad, Ac, P, Pc);
    dcs_compose_bw_args cpost = phase_bw(&s, &post), cpre = phase_bw(&s, &pre);
    cpost.in = P, cpost.dOut = dput(dy, n), cpost.dIn = dnan(n);
    cpre.in = Ad, cpre.dOut = dnan(n), cpre.dIn = dnan(n);
    be->ops->compose_softmax_bw(be, &cpost, &cpre);
    cmp_arg a = {
        .s = &s, .pre = &pre, .post = &post, .in = dmem(n), .Ac = dmem(n), .P = dmem(n), .Pc = dmem(n)};
    fd f = {.ny = n, .dy = dy, .fwd = compose_softmax_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "compose_softmax_bw [%s: B %d, N %d, T %d, R %d, G %d, window %d]",
             s.label, s.B, s.N, s.T, s.R, s.G, s.window);
    a.i_in = fd_input(&f, "A", A, n, dget(cpre.dIn, n));
    phase_inputs(&f, &pre, &s, a.i_pre);
    phase_inputs(&f, &post, &s, a.i_post);
    fd_check(&f);
    release_all();
}

/* ------------------------------------------------------------ attention */

/* z [B, T, N, Dh] from q, k, v (row stride N Dh) through the forward ops:
 * A = q k^T / sqrt(Dh) per head (gemm), the maps path, z = Pc v (gemm) */
static void attn_forward(const shp *s, const phase *pre, const phase *post, const float *q, const float *k,
                         const float *v, float *A, float *Ac, float *P, float *Pc, float *z) {
    const int T = s->T, N = s->N, Dh = s->Dh, ld = N * Dh;
    const long long TT = (long long)T * T;
    for (int b = 0; b < s->B; b++) {
        const size_t o = (size_t)b * T * ld;
        be->ops->gemm(be, 0, 1, T, T, Dh, 1.0f / sqrtf((float)Dh), q + o, ld, Dh, k + o, ld, Dh, 0.0f,
                      A + (size_t)b * N * TT, T, TT, N);
    }
    maps_forward(s, pre, post, A, Ac, P, Pc);
    for (int b = 0; b < s->B; b++) {
        const size_t o = (size_t)b * T * ld;
        be->ops->gemm(be, 0, 0, T, Dh, T, 1.0f, Pc + (size_t)b * N * TT, T, TT, v + o, ld, Dh, 0.0f, z + o,
                      ld, Dh, N);
    }
}

static void attention_fwd(const fd *f, double *y) {
    const cmp_arg *a = f->arg;
    const shp *s = a->s;
    const size_t nq = (size_t)s->B * s->T * s->N * s->Dh;
    up(a->q, f->x[a->i_q], nq);
    up(a->k, f->x[a->i_k], nq);
    up(a->v, f->x[a->i_v], nq);
    phase_upload(a->pre, s, f, a->i_pre);
    phase_upload(a->post, s, f, a->i_post);
    attn_forward(s, a->pre, a->post, a->q, a->k, a->v, a->in, a->Ac, a->P, a->Pc, a->z);
    y_from(y, a->z, nq);
}

/* dq, dk, dv and both phases' gradients from dz, with the maps A, P, Pc of
 * the forward ops, or (fused) as ops->attention keeps them for the tape:
 * only where the backward reads them, the rest left NaN here */
static void test_attention_bw(shp s, int fused) {
    if (!be->ops->attention_bw) {
        skip("attention_bw");
        return;
    }
    if (fused && !be->ops->attention) {
        skip("attention (its kept maps for attention_bw)");
        return;
    }
    const size_t n = map_len(&s), nq = (size_t)s.B * s.T * s.N * s.Dh;
    float *q = hrand(nq, 1.0f), *k = hrand(nq, 1.0f), *v = hrand(nq, 1.0f), *dy = hrand(nq, 1.0f);
    phase pre, post;
    phase_init(&pre, &s, "pre ");
    phase_init(&post, &s, "post ");
    float *qd = dput(q, nq), *kd = dput(k, nq), *vd = dput(v, nq), *z = dmem(nq);
    float *A = dmem(n), *Ac = dmem(n), *P = dmem(n), *Pc = dmem(n);
    if (!fused) {
        attn_forward(&s, &pre, &post, qd, kd, vd, A, Ac, P, Pc, z);
    } else {
        A = dnan(n), P = dnan(n), Pc = dnan(n);
        dcs_attn_args at;
        memset(&at, 0, sizeof at);
        at.z = z, at.q = qd, at.k = kd, at.v = vd;
        at.B = s.B, at.T = s.T, at.S = s.T, at.N = s.N, at.Dh = s.Dh, at.ld = s.N * s.Dh, at.R = s.R;
        at.window = s.window;
        at.scale = 1.0f / sqrtf((float)s.Dh);
        at.compose = 1;
        for (int ph = 0; ph < 2; ph++) {
            const phase *p = ph ? &post : &pre;
            at.qw1[ph] = p->d[0], at.qw2[ph] = p->d[1], at.qdd[ph] = p->d[2];
            at.kw1[ph] = p->d[3], at.kw2[ph] = p->d[4], at.kdd[ph] = p->d[5];
        }
        at.keep[0] = A, at.keep[1] = P, at.keep[2] = Pc;
        be->ops->attention(be, &at);
    }
    dcs_compose_bw_args cpost = phase_bw(&s, &post), cpre = phase_bw(&s, &pre);
    cpost.in = P; /* dOut, dIn of both phases: not used */
    cpre.in = A;
    float *dq = dnan(nq), *dk = dnan(nq), *dv = dnan(nq);
    const dcs_attn_bw_args ab = {
        &cpost, &cpre, dput(dy, nq), qd, kd, vd, Pc, dq, dk, dv, s.Dh, s.N * s.Dh, 1.0f / sqrtf((float)s.Dh)};
    const int r = be->ops->attention_bw(be, &ab);
    CHECKF(r == 0, "%s: attention_bw [%s]: returned %d (no scratch)", be->ops->name, s.label, r);
    cmp_arg a = {.s = &s,
                 .pre = &pre,
                 .post = &post,
                 .in = dmem(n),
                 .Ac = dmem(n),
                 .P = dmem(n),
                 .Pc = dmem(n),
                 .q = dmem(nq),
                 .k = dmem(nq),
                 .v = dmem(nq),
                 .z = dmem(nq)};
    fd f = {.ny = nq, .dy = dy, .fwd = attention_fwd, .arg = &a};
    snprintf(f.what, sizeof f.what, "attention_bw [%s, maps %s: B %d, T %d, N %d, Dh %d, R %d, window %d]",
             s.label, fused ? "kept by ops->attention" : "of the forward ops", s.B, s.T, s.N, s.Dh, s.R,
             s.window);
    a.i_q = fd_input(&f, "q", q, nq, dget(dq, nq));
    a.i_k = fd_input(&f, "k", k, nq, dget(dk, nq));
    a.i_v = fd_input(&f, "v", v, nq, dget(dv, nq));
    phase_inputs(&f, &pre, &s, a.i_pre);
    phase_inputs(&f, &post, &s, a.i_post);
    fd_check(&f);
    release_all();
}

/* ------------------------------------------------------------ fused = unfused, bit for bit */

/* the n floats of the backend's d equal host h's, bit for bit */
static void same_bits(const char *what, const float *d, const float *h, size_t n) {
    const float *g = dget(d, n);
    CHECKF(memcmp(g, h, n * sizeof(float)) == 0, "%s: %s: not the bits of the ops it fuses", be->ops->name,
           what);
}

/* qkv_split = add_bias, copy2d, rotary; qkv_join_bw = rotary_bw, copy2d */
static void test_qkv_fused(int B, int T, int t0, int N, int Dh, int rot) {
    const int M = B * T, D = N * Dh;
    float *qkv = hrand((size_t)M * 3 * D, 1.0f), *b = hrand((size_t)3 * D, 1.0f);
    float *dq = hrand((size_t)M * D, 1.0f), *dk = hrand((size_t)M * D, 1.0f),
          *dv = hrand((size_t)M * D, 1.0f);
    if (!be->ops->qkv_split)
        skip("qkv_split");
    else {
        float *y = dput(qkv, (size_t)M * 3 * D), *part[3], *out[3];
        be->ops->add_bias(be, y, dput(b, (size_t)3 * D), M, 3 * D);
        for (int i = 0; i < 3; i++) {
            part[i] = dmem((size_t)M * D);
            out[i] = dnan((size_t)M * D);
            be->ops->copy2d(be, part[i], D, y + (size_t)i * D, 3 * D, M, D);
        }
        be->ops->rotary(be, part[0], M, T, t0, N, Dh, rot, 10000.0f);
        be->ops->rotary(be, part[1], M, T, t0, N, Dh, rot, 10000.0f);
        const int r = be->ops->qkv_split(be, out[0], out[1], out[2], dput(qkv, (size_t)M * 3 * D),
                                         dput(b, (size_t)3 * D), M, T, t0, N, Dh, rot, 10000.0f);
        CHECKF(r == 0, "%s: qkv_split returned %d", be->ops->name, r);
        for (int i = 0; i < 3; i++)
            same_bits("qkv_split", out[i], dget(part[i], (size_t)M * D), (size_t)M * D);
    }
    if (!be->ops->qkv_join_bw)
        skip("qkv_join_bw");
    else {
        float *g[3] = {dput(dq, (size_t)M * D), dput(dk, (size_t)M * D), dput(dv, (size_t)M * D)};
        float *ref = dnan((size_t)M * 3 * D), *got = dnan((size_t)M * 3 * D);
        const int r = be->ops->qkv_join_bw(be, got, g[0], g[1], g[2], M, T, N, Dh, rot, 10000.0f);
        CHECKF(r == 0, "%s: qkv_join_bw returned %d", be->ops->name, r);
        be->ops->rotary_bw(be, g[0], M, T, N, Dh, rot, 10000.0f);
        be->ops->rotary_bw(be, g[1], M, T, N, Dh, rot, 10000.0f);
        for (int i = 0; i < 3; i++) be->ops->copy2d(be, ref + (size_t)i * D, 3 * D, g[i], D, M, D);
        same_bits("qkv_join_bw", got, dget(ref, (size_t)M * 3 * D), (size_t)M * 3 * D);
    }
    release_all();
}

/* layernorm2 = layernorm twice; layernorm2_bw = layernorm_bw twice; add2 = add twice */
static void test_norms_fused(int M, int D) {
    const size_t n = (size_t)M * D;
    float *x = hrand(n, 1.0f), *dy1 = hrand(n, 1.0f), *dy2 = hrand(n, 1.0f), *dx0 = hrand(n, 1.0f);
    float *w[2] = {hrand(D, 1.0f), hrand(D, 1.0f)}, *bb[2] = {hrand(D, 1.0f), hrand(D, 1.0f)};
    float *pw0 = hrand(4 * (size_t)D, 1.0f);
    float *xd = dput(x, n), *wd[2] = {dput(w[0], D), dput(w[1], D)},
          *bd[2] = {dput(bb[0], D), dput(bb[1], D)};
    float *st = dmem(2 * (size_t)M); /* layernorm2's statistics, for layernorm2_bw */
    if (!be->ops->layernorm2)
        skip("layernorm2");
    else {
        float *r1 = dnan(n), *r2 = dnan(n), *g1 = dnan(n), *g2 = dnan(n);
        be->ops->layernorm(be, r1, xd, wd[0], bd[0], M, D, 1e-5f);
        be->ops->layernorm(be, r2, xd, wd[1], bd[1], M, D, 1e-5f);
        be->ops->layernorm2(be, g1, g2, st, xd, wd[0], bd[0], wd[1], bd[1], M, D, 1e-5f);
        same_bits("layernorm2 (first)", g1, dget(r1, n), n);
        same_bits("layernorm2 (second)", g2, dget(r2, n), n);
    }
    if (!be->ops->layernorm2_bw)
        skip("layernorm2_bw");
    else {
        float *rx = dput(dx0, n), *gx = dput(dx0, n), *rp = dput(pw0, 4 * (size_t)D),
              *gp = dput(pw0, 4 * (size_t)D);
        float *a1 = dput(dy1, n), *a2 = dput(dy2, n);
        be->ops->layernorm_bw(be, rx, rp, rp + D, a1, xd, wd[0], M, D, 1e-5f);
        be->ops->layernorm_bw(be, rx, rp + 2 * D, rp + 3 * D, a2, xd, wd[1], M, D, 1e-5f);
        const dcs_norm_bw_side s1 = {a1, wd[0], gp, gp + D}, s2 = {a2, wd[1], gp + 2 * D, gp + 3 * D};
        for (int kept = 0; kept < 2 && (kept == 0 || be->ops->layernorm2); kept++) { /* stats from x, kept */
            float *gx2 = dput(dx0, n), *gp2 = dput(pw0, 4 * (size_t)D);
            const dcs_norm_bw_side t1 = {a1, wd[0], gp2, gp2 + D}, t2 = {a2, wd[1], gp2 + 2 * D, gp2 + 3 * D};
            const int r = be->ops->layernorm2_bw(be, kept ? gx2 : gx, kept ? &t1 : &s1, kept ? &t2 : &s2,
                                                 kept ? st : NULL, xd, M, D, 1e-5f);
            CHECKF(r == 0, "%s: layernorm2_bw returned %d", be->ops->name, r);
            same_bits(kept ? "layernorm2_bw (dx, kept stats)" : "layernorm2_bw (dx)", kept ? gx2 : gx,
                      dget(rx, n), n);
            same_bits("layernorm2_bw (dw, db)", kept ? gp2 : gp, dget(rp, 4 * (size_t)D), 4 * (size_t)D);
        }
    }
    if (!be->ops->add2)
        skip("add2");
    else {
        float *ry = dput(dx0, n), *gy = dput(dx0, n), *a1 = dput(dy1, n), *a2 = dput(dy2, n);
        be->ops->add(be, ry, a1, n);
        be->ops->add(be, ry, a2, n);
        be->ops->add2(be, gy, a1, a2, n);
        same_bits("add2", gy, dget(ry, n), n);
    }
    release_all();
}

/* bias_gelu_keep = bias_gelu and x = gelu_bw(1, x); gelu_bw_sum = gelu_bw, col_sum */
static void test_gelu_fused(int M, int N) {
    const size_t n = (size_t)M * N;
    float *x = hrand(n, 2.0f), *b = hrand(N, 1.0f), *dy = hrand(n, 1.0f), *db0 = hrand(N, 1.0f);
    float *ones = hmem(n * sizeof(float));
    for (size_t i = 0; i < n; i++) ones[i] = 1.0f;
    if (!be->ops->bias_gelu_keep || !be->ops->gelu_bw_sum) {
        skip("bias_gelu_keep, gelu_bw_sum");
        release_all();
        return;
    }
    float *rx = dput(x, n), *ry = dnan(n), *gx = dput(x, n), *gy = dnan(n), *bd = dput(b, N);
    be->ops->bias_gelu(be, ry, rx, bd, M, N);
    float *rg = dnan(n);
    be->ops->gelu_bw(be, rg, dput(ones, n), rx, n);
    be->ops->bias_gelu_keep(be, gy, gx, bd, M, N);
    same_bits("bias_gelu_keep (y)", gy, dget(ry, n), n);
    same_bits("bias_gelu_keep (x = gelu'(x + b))", gx, dget(rg, n), n);
    for (int is_grad = 0; is_grad < 2; is_grad++) {
        float *ref = dnan(n), *rdb = dput(db0, N), *got = dput(dy, n), *gdb = dput(db0, N);
        be->ops->gelu_bw(be, ref, dput(dy, n), rx, n);
        be->ops->col_sum(be, rdb, ref, M, N);
        be->ops->gelu_bw_sum(be, got, gdb, got, is_grad ? gx : rx, M, N, is_grad); /* in place */
        same_bits(is_grad ? "gelu_bw_sum (x is gelu')" : "gelu_bw_sum (dx)", got, dget(ref, n), n);
        same_bits("gelu_bw_sum (db)", gdb, dget(rdb, N), N);
    }
    release_all();
}

/* mha_bw = the tape's batched per-head products (per sequence, batch N)
 * around softmax_bw */
static void test_mha_bw(int B, int T, int N, int Dh, int window) {
    const int D = N * Dh;
    const size_t nq = (size_t)B * T * D, TT = (size_t)T * T, nm = (size_t)B * N * TT;
    float *h[4], *d[4]; /* dz, q, k, v */
    for (int i = 0; i < 4; i++) d[i] = dput(h[i] = hrand(nq, 1.0f), nq);
    float *Pd = dput(hrand(nm, 1.0f), nm); /* any map: the backward is linear in dz */
    be->ops->softmax_masked(be, Pd, B * N, T, T, 0, 0, window);
    if (!be->ops->mha_bw) {
        skip("mha_bw");
        release_all();
        return;
    }
    float *dP = dnan(nm), *dA = dnan(nm), *ref[3], *got[3]; /* dq, dk, dv */
    for (int i = 0; i < 3; i++) ref[i] = dnan(nq), got[i] = dnan(nq);
    const float sc = 1.0f / sqrtf((float)Dh);
    for (int b = 0; b < B; b++) {
        const size_t o = (size_t)b * T * D, om = (size_t)b * N * TT;
        be->ops->gemm(be, 0, 1, T, T, Dh, 1.0f, d[0] + o, D, Dh, d[3] + o, D, Dh, 0.0f, dP + om, T, TT, N);
        be->ops->gemm(be, 1, 0, T, Dh, T, 1.0f, Pd + om, T, TT, d[0] + o, D, Dh, 0.0f, ref[2] + o, D, Dh, N);
    }
    be->ops->softmax_bw(be, dA, dP, Pd, B * N, T, T, window);
    for (int b = 0; b < B; b++) {
        const size_t o = (size_t)b * T * D, om = (size_t)b * N * TT;
        be->ops->gemm(be, 0, 0, T, Dh, T, sc, dA + om, T, TT, d[2] + o, D, Dh, 0.0f, ref[0] + o, D, Dh, N);
        be->ops->gemm(be, 1, 0, T, Dh, T, sc, dA + om, T, TT, d[1] + o, D, Dh, 0.0f, ref[1] + o, D, Dh, N);
    }
    const dcs_mha_bw_args a = {d[0], d[1], d[2], d[3], Pd, got[0], got[1], got[2],
                               B,    T,    N,    Dh,   D,  window, sc};
    const int r = be->ops->mha_bw(be, &a);
    CHECKF(r == 0, "%s: mha_bw returned %d", be->ops->name, r);
    const char *name[3] = {"mha_bw (dq)", "mha_bw (dk)", "mha_bw (dv)"};
    for (int i = 0; i < 3; i++) same_bits(name[i], got[i], dget(ref[i], nq), nq);
    release_all();
}

/* ------------------------------------------------------------ main */

static void run_backend(dcs_backend *b) {
    be = b;
    worst = 0;
    worst_what[0] = '\0';
    const int before = counts.failed;
    printf("%s backend\n", be->ops->name);
    test_zero();
    test_bw_scratch();

    test_gelu_bw(37, 0);
    test_gelu_bw(20011, 1); /* on the pool */
    test_bias_gelu_bw(13, 45);
    test_tanh_bw(37);
    test_tanh_bw(1000);
    test_col_sum(13, 45); /* a block of 32 columns and a partial one */
    test_col_sum(200, 7);

    test_layernorm_bw(11, 13, 1);  /* rows past a group of 8, D odd */
    test_layernorm_bw(3, 40, 1);   /* column blocks of 16 and a partial one */
    test_layernorm_bw(257, 48, 1); /* on the pool */
    test_layernorm_bw(9, 16, 0);
    test_rmsnorm_bw(19, 8, 1, 1);   /* the q/k norm: rows past a group of 16 */
    test_rmsnorm_bw(5, 37, 0, 0);   /* no scale (the dynamic weights' w1) */
    test_rmsnorm_bw(17, 70, 1, 0);  /* wider than a transposed tile (64) */
    test_rmsnorm_bw(300, 24, 1, 1); /* on the pool */
    test_rotary_bw(2, 5, 2, 8, 8);
    test_rotary_bw(1, 37, 3, 7, 4); /* partial rotary, Dh odd */

    test_softmax_bw(3, 7, 0);
    test_softmax_bw(2, 19, 3);  /* a local window */
    test_softmax_bw(2, 37, 0);  /* rows past 16 lanes, T not a multiple of them */
    test_softmax_bw(1, 40, 17); /* a window wider than the lanes */
    test_softmax_rows_bw(7, 5);
    test_softmax_rows_bw(3, 19);

    test_embed_bw(13, 11, 9);
    test_xent_bw(5, 37);
    test_xent_bw(3, 16);

    test_head_gate_bw(5, 3, 7);
    test_moh_route_bw(4, 6, 0, 2);
    test_moh_route_bw(4, 6, 1, 2);
    test_moh_route_bw(4, 7, 2, 3);
    test_moh_route_bw(3, 6, 3, 3); /* every routed head selected */
    test_swiglu_bw(3, 10, 0);
    test_swiglu_bw(5, 12, 3); /* DCFormer++'s group gate */
    test_swiglu_bw(4, 14, 2);

    /* label, B, N, T, R, G, window, q, k, st, rows, on */
    const unsigned all = 0x3f;
    const shp cmp[] = {
        {"row kernel", 2, 4, 19, 2, 1, 0, 1, 1, 0, 1, all, 0},
        {"row kernel, local window", 2, 4, 19, 2, 1, 5, 1, 1, 0, 1, all, 0},
        {"row kernel, rank 3, T past two key blocks", 1, 3, 37, 3, 1, 0, 1, 1, 0, 1, all, 0},
        {"row kernel, kp cut", 2, 4, 7, 2, 1, 0, 1, 1, 0, 1, all & ~4u, 0},
        {"row kernel, skip + qg only", 2, 4, 7, 2, 1, 0, 1, 1, 0, 1, 1u | 8u, 0},
        {"pair by pair (no scratch)", 2, 4, 7, 2, 1, 0, 1, 1, 0, 0, all, 0},
        {"query-wise", 2, 4, 11, 2, 1, 0, 1, 0, 0, 0, all, 0},
        {"key-wise, groups", 2, 4, 9, 2, 2, 0, 0, 1, 0, 0, all, 0},
        {"groups + static map, local window", 2, 6, 9, 2, 2, 3, 1, 1, 1, 0, all, 0},
        {"query-wise + static map, N odd", 2, 3, 5, 2, 1, 0, 1, 0, 1, 0, all, 0},
        {"static map, qp and static cut", 1, 4, 6, 2, 2, 0, 1, 1, 1, 0, all & ~2u & ~32u, 0},
        {"static map, kg cut", 1, 4, 6, 1, 1, 2, 1, 1, 1, 0, all & ~16u, 0},
    };
    for (size_t i = 0; i < sizeof cmp / sizeof cmp[0]; i++) test_compose_bw(cmp[i]);

    const shp csm[] = {
        {"row kernel", 2, 3, 19, 2, 1, 0, 1, 1, 0, 1, all, 0},
        {"row kernel, local window", 2, 3, 19, 2, 1, 4, 1, 1, 0, 1, all, 0},
        {"query-wise", 1, 4, 11, 2, 1, 0, 1, 0, 0, 0, all, 0},
        {"no scratch: compose_bw, softmax_bw, compose_bw", 2, 4, 7, 2, 1, 0, 1, 1, 0, 0, all, 0},
        {"groups + static map, local window", 1, 4, 9, 2, 2, 2, 1, 1, 1, 0, all, 0},
    };
    for (size_t i = 0; i < sizeof csm / sizeof csm[0]; i++) test_compose_softmax_bw(csm[i]);

    const shp att[] = {
        {"two query blocks", 2, 3, 37, 2, 1, 0, 1, 1, 0, 1, all, 6},
        {"two query blocks, local window", 1, 3, 37, 2, 1, 5, 1, 1, 0, 1, all, 6},
        {"short", 1, 2, 7, 2, 1, 0, 1, 1, 0, 1, all, 5},
    };
    for (size_t i = 0; i < sizeof att / sizeof att[0]; i++)
        for (int fused = 0; fused < 2; fused++) test_attention_bw(att[i], fused);

    test_qkv_fused(2, 5, 0, 3, 8, 8);
    test_qkv_fused(3, 37, 4, 6, 32, 8); /* on the pool, partial rotary, positions from t0 */
    test_norms_fused(11, 13);
    test_norms_fused(300, 48); /* on the pool */
    test_gelu_fused(13, 45);   /* a block of 32 columns and a partial one */
    test_gelu_fused(300, 96);  /* on the pool */
    test_mha_bw(2, 7, 3, 4, 0);
    test_mha_bw(3, 40, 4, 8, 0);
    test_mha_bw(2, 37, 2, 8, 5); /* a local window */

    printf("  %s: %s; largest |fd - bw| / tolerance %.3g (%s)\n", be->ops->name,
           counts.failed == before ? "ok" : "FAILED", worst, worst_what);
}

int main(void) {
    dcs_err e;
    memset(&e, 0, sizeof e);
    dcs_backend *cpu = dcs_backend_cpu_create(3, &e);
    CHECKF(cpu != NULL, "cannot create the cpu backend: %s", e.msg);
    if (cpu) {
        run_backend(cpu);
        cpu->ops->destroy(cpu);
    }
    char why[512];
    if (!dcs_cuda_probe(why, sizeof why)) {
        printf("cuda backend: skipped (no GPU: %s)\n", why);
    } else {
        memset(&e, 0, sizeof e);
        dcs_backend *gpu = dcs_backend_cuda_create(0, &e);
        CHECKF(gpu != NULL, "cannot create the cuda backend: %s", e.msg);
        if (gpu) {
            run_backend(gpu);
            gpu->ops->destroy(gpu);
        }
    }
    return check_report("backend_bw", &counts);
}
