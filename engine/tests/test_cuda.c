/*
 * test_cuda.c -- every kernel of the CUDA backend against the CPU backend.
 *
 * Both backends get the same random inputs through the dcs_backend vtable
 * (dcs_backend.h); the results are downloaded and compared with a tolerance
 * relative to the largest reference value: 1e-5 (1e-4 for gemm, whose
 * summation order differs between cuBLAS and OpenBLAS). Masked entries
 * (softmax, causal compose) must be exactly 0.
 *
 * Without a usable GPU it prints
 *   cuda: 0 passed, 0 failed, N skipped (no GPU: <why>)
 * and exits 0, so it can run in CI on machines that only have the toolkit.
 * Otherwise it ends with "cuda: N passed, M failed" (one count per test
 * group) and exits 1 if anything failed.
 *
 * Build (see engine/cuda.mk): compiled with -DDCS_WITH_CUDA and linked with
 * the dclens_backends library (CPU + CUDA), OpenBLAS and the CUDA libraries.
 */
#include "dcs_backend.h"
#include "dcs_math.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ harness */

typedef struct {
    dcs_backend *cpu, *gpu;
    uint64_t rng;
    int checks_failed; /* within the current group */
} ctx;

/* A tensor living on both backends. */
typedef struct {
    float *c, *g;
    size_t n;
} pair;

static float frand(ctx *t) { /* uniform in [-1, 1) */
    t->rng = t->rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((t->rng >> 40) * (1.0 / 8388608.0)) - 1.0f;
}

static float *host_rand(ctx *t, size_t n, float scale, float offset) {
    float *h = malloc(n * sizeof(float) + 1);
    if (!h) {
        fprintf(stderr, "out of host memory\n");
        exit(2);
    }
    for (size_t i = 0; i < n; i++) h[i] = offset + scale * frand(t);
    return h;
}

/* Allocate n floats on both backends; fill with host data if given. */
static pair mk(ctx *t, const float *host, size_t n) {
    pair p = {t->cpu->ops->alloc(t->cpu, n * sizeof(float)), t->gpu->ops->alloc(t->gpu, n * sizeof(float)),
              n};
    if (!p.c || !p.g) {
        fprintf(stderr, "allocation of %zu floats failed\n", n);
        exit(2);
    }
    if (host) {
        t->cpu->ops->upload(t->cpu, p.c, host, n * sizeof(float));
        t->gpu->ops->upload(t->gpu, p.g, host, n * sizeof(float));
    }
    return p;
}

static pair mk_rand(ctx *t, size_t n, float scale, float offset) {
    float *h = host_rand(t, n, scale, offset);
    pair p = mk(t, h, n);
    free(h);
    return p;
}

static void rm(ctx *t, pair p) {
    t->cpu->ops->free(t->cpu, p.c);
    t->gpu->ops->free(t->gpu, p.g);
}

static void fail(ctx *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(ctx *t, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("    FAIL ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    t->checks_failed++;
}

/* Sync both backends; a backend error fails the check. */
static int sync_both(ctx *t, const char *what) {
    dcs_err e = {0};
    if (t->cpu->ops->sync(t->cpu, &e)) {
        fail(t, "%s: cpu backend: %s", what, e.msg);
        return 0;
    }
    if (t->gpu->ops->sync(t->gpu, &e)) {
        fail(t, "%s: cuda backend: %s", what, e.msg);
        return 0;
    }
    return 1;
}

/* Download both copies; the caller frees *hc and *hg. */
static int fetch(ctx *t, pair p, const char *what, float **hc, float **hg) {
    *hc = malloc(p.n * sizeof(float) + 1);
    *hg = malloc(p.n * sizeof(float) + 1);
    if (!*hc || !*hg) {
        fprintf(stderr, "out of host memory\n");
        exit(2);
    }
    t->cpu->ops->download(t->cpu, *hc, p.c, p.n * sizeof(float));
    t->gpu->ops->download(t->gpu, *hg, p.g, p.n * sizeof(float));
    return sync_both(t, what);
}

/* max|gpu - cpu| <= tol * max|cpu|, no NaN/Inf on either side. */
static void check(ctx *t, pair p, const char *what, double tol) {
    float *hc, *hg;
    if (fetch(t, p, what, &hc, &hg)) {
        double err = 0, ref = 0;
        size_t worst = 0, bad = (size_t)-1;
        for (size_t i = 0; i < p.n; i++) {
            if (!isfinite(hc[i]) || !isfinite(hg[i])) {
                bad = i;
                break;
            }
            double d = fabs((double)hg[i] - hc[i]);
            if (d > err) {
                err = d;
                worst = i;
            }
            if (fabs(hc[i]) > ref) ref = fabs(hc[i]);
        }
        if (bad != (size_t)-1)
            fail(t, "%s: non-finite value at %zu (cpu %g, cuda %g)", what, bad, hc[bad], hg[bad]);
        else if (err > tol * (ref > 0 ? ref : 1e-30))
            fail(t, "%s: max |diff| %.3g at %zu (cpu %.9g, cuda %.9g) > %.0e * max|ref| %.3g", what, err,
                 worst, hc[worst], hg[worst], tol, ref);
        else
            printf("    ok   %-52s rel err %.2e\n", what, ref > 0 ? err / ref : err);
    }
    free(hc);
    free(hg);
}

/* Every entry of x [G, T, S] hidden by the mask must be exactly 0 on the GPU. */
static void check_masked_zero(ctx *t, pair p, int G, int T, int S, int t0, int kb, int window,
                              const char *what) {
    float *hc, *hg;
    if (fetch(t, p, what, &hc, &hg)) {
        size_t nz = 0;
        for (int g = 0; g < G; g++)
            for (int i = 0; i < T; i++)
                for (int s = 0; s < S; s++)
                    if (!dcs_allowed(t0 + i, kb + s, window) && hg[((size_t)g * T + i) * S + s] != 0.0f) nz++;
        if (nz)
            fail(t, "%s: %zu masked entries are not 0", what, nz);
        else
            printf("    ok   %-52s masked entries exactly 0\n", what);
    }
    free(hc);
    free(hg);
}

/* ------------------------------------------------------------ memory */

static void test_memory(ctx *t) {
    const size_t n = 100003;
    pair z = mk(t, NULL, n); /* alloc is zero-filled */
    float *hc, *hg;
    if (fetch(t, z, "alloc", &hc, &hg)) {
        size_t nz = 0;
        for (size_t i = 0; i < n; i++) nz += hg[i] != 0.0f;
        if (nz)
            fail(t, "alloc: %zu of %zu floats not zero", nz, n);
        else
            printf("    ok   alloc is zero-filled\n");
    }
    free(hc);
    free(hg);
    float *h = host_rand(t, n, 10.0f, 0.0f);
    pair a = mk(t, h, n); /* upload / download round trip */
    float *back = malloc(n * sizeof(float));
    t->gpu->ops->download(t->gpu, back, a.g, n * sizeof(float));
    if (sync_both(t, "upload/download")) {
        if (memcmp(back, h, n * sizeof(float)))
            fail(t, "upload/download: data differs");
        else
            printf("    ok   upload/download round trip is exact\n");
    }
    t->cpu->ops->copy(t->cpu, z.c, a.c, n * sizeof(float)); /* device copy */
    t->gpu->ops->copy(t->gpu, z.g, a.g, n * sizeof(float));
    check(t, z, "copy", 0.0);
    free(back);
    free(h);
    rm(t, a);
    rm(t, z);
}

/* The memory plan's operations: free device memory (driver + the pool's
 * unused blocks) drops by an allocation held and comes back when it is
 * freed (the pool keeps the block: still free for the plan); the backward
 * scratch bound covers the static map's partials. */
static void test_mem_info(ctx *t) {
    dcs_err e = {0};
    uint64_t f0 = 0, tot = 0, f1 = 0, f2 = 0;
    if (!t->gpu->ops->mem_info || t->cpu->ops->mem_info) {
        fail(t, "mem_info: the CUDA backend must have it, the CPU backend must not");
        return;
    }
    if (t->gpu->ops->mem_info(t->gpu, &f0, &tot) || t->gpu->ops->sync(t->gpu, &e)) {
        fail(t, "mem_info: failed: %s", e.msg);
        return;
    }
    const size_t n = (size_t)64 << 20; /* 256 MiB */
    void *p = t->gpu->ops->alloc(t->gpu, n * sizeof(float));
    int ok = p && !t->gpu->ops->mem_info(t->gpu, &f1, &tot);
    t->gpu->ops->free(t->gpu, p);
    ok = ok && !t->gpu->ops->mem_info(t->gpu, &f2, &tot) && !t->gpu->ops->sync(t->gpu, &e);
    /* other processes may use the GPU meanwhile: 64 MiB of slack */
    const uint64_t slack = (uint64_t)64 << 20, held = n * sizeof(float);
    if (!ok || !(0 < f0 && f0 <= tot) || f1 + held > f0 + slack || f1 + held + slack < f0 || f2 + slack < f0)
        fail(t, "mem_info: free %llu -> %llu (holding %zu bytes) -> %llu of %llu", (unsigned long long)f0,
             (unsigned long long)f1, held, (unsigned long long)f2, (unsigned long long)tot);
    else
        printf("    ok   mem_info: %.2f GiB free of %.2f GiB, follows a 256 MiB block\n", f0 / 1073741824.0,
               tot / 1073741824.0);
    dcs_bw_shape s = {2, 64, 32, 8, 2, 8, 2, 1, 0};
    const uint64_t part = 4ull * 2 * 64 * 2 * 4 * 4, sc = t->gpu->ops->bw_scratch(t->gpu, &s);
    if (sc < part || sc > part + 4ull * 2 * 64 * 8 + 12ull * 2 * 64)
        fail(t, "bw_scratch: %llu bytes for static-map partials of %llu", (unsigned long long)sc,
             (unsigned long long)part);
    else
        printf("    ok   bw_scratch covers the static map's partials\n");
}

/* ------------------------------------------------------------ gemm */

static void gemm_case(ctx *t, int tA, int tB, int M, int N, int K, int batch, float alpha, float beta,
                      int pad) {
    int lda = (tA ? M : K) + pad, ldb = (tB ? K : N) + pad, ldc = N + pad;
    long long sA = (long long)(tA ? K : M) * lda + pad, sB = (long long)(tB ? N : K) * ldb + pad,
              sC = (long long)M * ldc + pad;
    if (batch == 1) sA = sB = sC = 0;
    pair A = mk_rand(t, (size_t)(sA ? sA * batch : (tA ? K : M) * (long long)lda), 1.0f, 0.0f);
    pair B = mk_rand(t, (size_t)(sB ? sB * batch : (tB ? N : K) * (long long)ldb), 1.0f, 0.0f);
    pair C = mk_rand(t, (size_t)(sC ? sC * batch : (long long)M * ldc), 1.0f, 0.0f);
    t->cpu->ops->gemm(t->cpu, tA, tB, M, N, K, alpha, A.c, lda, sA, B.c, ldb, sB, beta, C.c, ldc, sC, batch);
    t->gpu->ops->gemm(t->gpu, tA, tB, M, N, K, alpha, A.g, lda, sA, B.g, ldb, sB, beta, C.g, ldc, sC, batch);
    char what[128];
    snprintf(what, sizeof what, "gemm tA=%d tB=%d %dx%dx%d batch %d pad %d", tA, tB, M, N, K, batch, pad);
    check(t, C, what, 1e-4);
    rm(t, A);
    rm(t, B);
    rm(t, C);
}

static void test_gemm(ctx *t) {
    for (int tA = 0; tA < 2; tA++)
        for (int tB = 0; tB < 2; tB++) gemm_case(t, tA, tB, 37, 29, 53, 3, 0.7f, 0.3f, 3);
    gemm_case(t, 0, 1, 256, 384, 512, 1, 1.0f, 0.0f, 0); /* a Linear */
    gemm_case(t, 0, 0, 64, 16, 64, 8, 0.125f, 0.0f, 0);  /* P @ v per head */
}

/* ------------------------------------------------------------ row / elementwise */

static void test_embed(ctx *t) {
    const int V = 50, D = 67, M = 40;
    pair table = mk_rand(t, (size_t)V * D, 1.0f, 0.0f), out = mk(t, NULL, (size_t)M * D);
    int32_t tok[40];
    for (int i = 0; i < M; i++) tok[i] = (int32_t)((frand(t) + 1.0f) * 0.5f * V) % V;
    tok[0] = 0;
    tok[1] = V - 1;
    t->cpu->ops->embed(t->cpu, out.c, table.c, tok, M, D);
    t->gpu->ops->embed(t->gpu, out.g, table.g, tok, M, D);
    check(t, out, "embed", 0.0);
    tok[2] = 7; /* a second call reuses the token scratch buffer */
    t->cpu->ops->embed(t->cpu, out.c, table.c, tok, 3, D);
    t->gpu->ops->embed(t->gpu, out.g, table.g, tok, 3, D);
    check(t, out, "embed (second call, fewer tokens)", 0.0);
    rm(t, table);
    rm(t, out);
}

static void test_elementwise(ctx *t) {
    const int M = 33, N = 71;
    const size_t n = (size_t)M * N;
    pair x = mk_rand(t, n, 2.0f, 0.0f), b = mk_rand(t, N, 1.0f, 0.0f);
    t->cpu->ops->add_bias(t->cpu, x.c, b.c, M, N);
    t->gpu->ops->add_bias(t->gpu, x.g, b.g, M, N);
    check(t, x, "add_bias", 1e-5);

    pair y = mk_rand(t, n, 1.0f, 0.0f), z = mk_rand(t, n, 1.0f, 0.0f);
    t->cpu->ops->add(t->cpu, y.c, x.c, n);
    t->gpu->ops->add(t->gpu, y.g, x.g, n);
    check(t, y, "add", 1e-5);

    pair gl = mk_rand(t, 300001, 5.0f, 0.0f); /* > one grid's worth */
    t->cpu->ops->gelu(t->cpu, gl.c, gl.n);
    t->gpu->ops->gelu(t->gpu, gl.g, gl.n);
    check(t, gl, "gelu (erf)", 1e-5);

    pair th = mk_rand(t, 10007, 3.0f, 0.0f);
    t->cpu->ops->tanh_(t->cpu, th.c, th.n);
    t->gpu->ops->tanh_(t->gpu, th.g, th.n);
    check(t, th, "tanh", 1e-5);

    rm(t, x);
    rm(t, b);
    rm(t, y);
    rm(t, z);
    rm(t, gl);
    rm(t, th);
}

static void layernorm_case(ctx *t, int M, int D, int with_bias, int in_place) {
    pair x = mk_rand(t, (size_t)M * D, 2.0f, 3.0f); /* offset: centring matters */
    pair w = mk_rand(t, D, 1.0f, 1.0f), b = mk_rand(t, D, 0.5f, 0.0f);
    pair out = in_place ? x : mk(t, NULL, (size_t)M * D);
    t->cpu->ops->layernorm(t->cpu, out.c, x.c, w.c, with_bias ? b.c : NULL, M, D, 1e-5f);
    t->gpu->ops->layernorm(t->gpu, out.g, x.g, w.g, with_bias ? b.g : NULL, M, D, 1e-5f);
    char what[96];
    snprintf(what, sizeof what, "layernorm M=%d D=%d%s%s", M, D, with_bias ? "" : " no bias",
             in_place ? " in place" : "");
    check(t, out, what, 1e-5);
    if (!in_place) rm(t, out);
    rm(t, x);
    rm(t, w);
    rm(t, b);
}

static void test_layernorm(ctx *t) {
    layernorm_case(t, 17, 4096, 1, 0);
    layernorm_case(t, 29, 50, 1, 0);
    layernorm_case(t, 5, 300, 0, 1);
}

static void rmsnorm_case(ctx *t, int rows, int width, int ld, int with_scale) {
    pair x = mk_rand(t, (size_t)rows * ld, 3.0f, 0.0f), s = mk_rand(t, width, 1.0f, 1.0f);
    t->cpu->ops->rmsnorm(t->cpu, x.c, rows, width, ld, with_scale ? s.c : NULL, 1e-6f);
    t->gpu->ops->rmsnorm(t->gpu, x.g, rows, width, ld, with_scale ? s.g : NULL, 1e-6f);
    char what[96];
    snprintf(what, sizeof what, "rmsnorm rows=%d width=%d ld=%d%s", rows, width, ld,
             with_scale ? " scale" : "");
    check(t, x, what, 1e-5); /* the whole buffer: columns >= width untouched */
    rm(t, x);
    rm(t, s);
}

static void test_rmsnorm(ctx *t) {
    rmsnorm_case(t, 45, 32, 48, 0);    /* dynamic w1 over N */
    rmsnorm_case(t, 300, 128, 128, 1); /* QK-norm over Dh */
    rmsnorm_case(t, 7, 1000, 1003, 1);
}

static void rotary_case(ctx *t, int B, int T, int N, int Dh, int rot, float base) {
    const int M = B * T;
    pair x = mk_rand(t, (size_t)M * N * Dh, 1.0f, 0.0f);
    t->cpu->ops->rotary(t->cpu, x.c, M, T, 0, N, Dh, rot, base);
    t->gpu->ops->rotary(t->gpu, x.g, M, T, 0, N, Dh, rot, base);
    char what[96];
    snprintf(what, sizeof what, "rotary B=%d T=%d N=%d Dh=%d rot=%d base=%g", B, T, N, Dh, rot, base);
    check(t, x, what, 1e-5);
    rm(t, x);
}

static void test_rotary(ctx *t) {
    rotary_case(t, 2, 1500, 3, 16, 8, 10000.0f);  /* positions up to 1499 */
    rotary_case(t, 1, 2100, 2, 32, 32, 10000.0f); /* full rotation, pos > 2000 */
    rotary_case(t, 3, 5, 4, 8, 2, 500.0f);
}

static void test_copy2d(ctx *t) {
    const int rows = 13, cols = 20, ld_src = 37, ld_dst = 25;
    pair src = mk_rand(t, (size_t)rows * ld_src, 1.0f, 0.0f),
         dst = mk_rand(t, (size_t)rows * ld_dst, 1.0f, 0.0f);
    t->cpu->ops->copy2d(t->cpu, dst.c, ld_dst, src.c + 5, ld_src, rows, cols);
    t->gpu->ops->copy2d(t->gpu, dst.g, ld_dst, src.g + 5, ld_src, rows, cols);
    check(t, dst, "copy2d (strided, offset source)", 0.0);
    rm(t, src);
    rm(t, dst);
}

/* ------------------------------------------------------------ compose */

/* branches: bit k set -> branch k is materialised. T queries at positions
 * t0.., S keys at kb.. (a chunk of the chunked attention, or a decoding
 * step; 0, 0 with S = T: a full pass). */
static void compose_case_at(ctx *t, int B, int N, int T, int S, int t0, int kb, int R, int causal, int window,
                            int branches, int in_place, int query_wise, int G, int use_sw) {
    const size_t nA = (size_t)B * N * T * S, nq = (size_t)B * T * R * N, nk = (size_t)B * S * R * N;
    pair in = mk_rand(t, nA, 2.0f, 0.0f);
    pair out = in_place ? in : mk_rand(t, nA, 1.0f, 0.0f);
    pair qw1 = mk_rand(t, nq, 1.0f, 0.0f), qw2 = mk_rand(t, nq, 1.0f, 0.0f);
    pair kw1 = mk_rand(t, nk, 1.0f, 0.0f), kw2 = mk_rand(t, nk, 1.0f, 0.0f);
    pair qdd = mk_rand(t, (size_t)B * T * N, 1.0f, 0.0f), kdd = mk_rand(t, (size_t)B * S * N, 1.0f, 0.0f);
    const int Mg = N / G;
    pair sw = mk_rand(t, (size_t)G * Mg * Mg, 0.5f, 0.0f);
    pair br[DCS_N_BRANCHES];
    memset(br, 0, sizeof br);
    for (int k = 0; k < DCS_N_BRANCHES; k++)
        if (branches >> k & 1) br[k] = mk_rand(t, nA, 1.0f, 0.0f); /* garbage: must be overwritten */
    for (int side = 0; side < 2; side++) {
        dcs_backend *be = side ? t->gpu : t->cpu;
        dcs_compose_args a;
        memset(&a, 0, sizeof a);
        a.out = side ? out.g : out.c;
        a.in = side ? in.g : in.c;
        if (query_wise != 2) { /* 2: key_wise, no query side */
            a.qw1 = side ? qw1.g : qw1.c;
            a.qw2 = side ? qw2.g : qw2.c;
            a.qdd = side ? qdd.g : qdd.c;
        }
        if (query_wise != 1) {
            a.kw1 = side ? kw1.g : kw1.c;
            a.kw2 = side ? kw2.g : kw2.c;
            a.kdd = side ? kdd.g : kdd.c;
        }
        for (int k = 0; k < DCS_N_BRANCHES; k++)
            if (branches >> k & 1) a.br[k] = side ? br[k].g : br[k].c;
        if (use_sw) a.sw = side ? sw.g : sw.c;
        a.B = B;
        a.N = N;
        a.T = T;
        a.S = S;
        a.R = R;
        a.G = G;
        a.causal_only = causal;
        a.window = window;
        a.t0 = t0;
        a.kb = kb;
        be->ops->compose(be, &a);
    }
    static const char *bname[DCS_N_BRANCHES] = {"skip", "qp", "kp", "qg", "kg", "static"};
    char what[200];
    snprintf(what, sizeof what, "compose B=%d N=%d T=%d S=%d@%d,%d R=%d G=%d%s%s%s w=%d%s%s", B, N, T, S, t0,
             kb, R, G, use_sw ? " static" : "", causal ? " causal" : "",
             query_wise == 1   ? " query_wise"
             : query_wise == 2 ? " key_wise"
                               : "",
             window, in_place ? " in place" : "", branches ? " +branches" : "");
    check(t, out, what, 1e-5);
    if (causal) check_masked_zero(t, out, B * N, T, S, t0, kb, window, what);
    for (int k = 0; k < DCS_N_BRANCHES; k++)
        if (branches >> k & 1) {
            char bw[240];
            snprintf(bw, sizeof bw, "  branch %s", bname[k]);
            check(t, br[k], bw, 1e-5);
            if (causal) check_masked_zero(t, br[k], B * N, T, S, t0, kb, window, bw);
            rm(t, br[k]);
        }
    if (!in_place) rm(t, out);
    rm(t, in);
    rm(t, qw1);
    rm(t, qw2);
    rm(t, kw1);
    rm(t, kw2);
    rm(t, qdd);
    rm(t, kdd);
    rm(t, sw);
}

static void compose_case(ctx *t, int B, int N, int T, int R, int causal, int window, int branches,
                         int in_place, int query_wise, int G, int use_sw) {
    compose_case_at(t, B, N, T, T, 0, 0, R, causal, window, branches, in_place, query_wise, G, use_sw);
}

static void test_compose(ctx *t) {
    compose_case(t, 2, 6, 37, 2, 0, 0, 0, 0, 0, 1, 0);  /* pre-compose, no branches      */
    compose_case(t, 2, 6, 37, 2, 0, 5, 31, 1, 0, 1, 0); /* all branches, in place        */
    compose_case(t, 2, 6, 37, 2, 1, 0, 31, 0, 0, 1, 0); /* post, causal, global          */
    compose_case(t, 1, 8, 50, 2, 1, 5, 31, 1, 0, 1, 0); /* post, causal, window 5        */
    compose_case(t, 2, 4, 29, 3, 1, 4, 9, 1, 1, 1, 0);  /* query_wise, skip + qg only    */
    compose_case(t, 1, 32, 40, 2, 1, 0, 0, 1, 0, 1, 0); /* N = 32 as in DCPythia-6.9B    */
    compose_case(t, 2, 6, 23, 2, 0, 0, 63, 1, 0, 1, 1); /* static branch, in place       */
    compose_case(t, 2, 8, 23, 2, 1, 4, 63, 1, 0, 4, 1); /* 4 groups + static, windowed   */
    compose_case(t, 1, 8, 19, 2, 0, 0, 31, 0, 1, 2, 0); /* 2 groups, query_wise          */
    compose_case(t, 2, 6, 21, 2, 1, 3, 63, 1, 2, 1, 1); /* key_wise + static, windowed   */
    /* chunks of the chunked attention (layer.c): T rows at t0 against S keys at kb */
    compose_case_at(t, 1, 8, 5, 19, 14, 0, 2, 1, 0, 0, 1, 0, 1, 0);   /* post, causal, 5 rows at 14      */
    compose_case_at(t, 1, 8, 6, 13, 20, 12, 2, 1, 4, 31, 1, 0, 1, 0); /* windowed, keys from 12, branches */
    compose_case_at(t, 1, 32, 16, 40, 24, 0, 2, 0, 0, 0, 1, 0, 1, 0); /* pre, N = 32                     */
    compose_case_at(t, 1, 8, 7, 15, 9, 3, 2, 1, 3, 0, 1, 2, 2, 1);    /* key_wise, 2 groups, static      */
}

/* ------------------------------------------------------------ MoH */

static void moh_case(ctx *t, int M, int N, int hs, int k) {
    pair lg = mk_rand(t, (size_t)M * (N - hs), 3.0f, 0.0f);
    pair s1 = mk_rand(t, (size_t)M * (hs > 0 ? hs : 1), 2.0f, 0.0f);
    pair s0 = mk_rand(t, (size_t)M * 2, 2.0f, 0.0f);
    pair g = mk_rand(t, (size_t)M * N, 1.0f, 0.0f);
    pair z = mk_rand(t, (size_t)M * N * 5, 1.0f, 0.0f);
    for (int side = 0; side < 2; side++) {
        dcs_backend *be = side ? t->gpu : t->cpu;
        be->ops->moh_route(be, side ? g.g : g.c, side ? lg.g : lg.c, hs > 1 ? (side ? s1.g : s1.c) : NULL,
                           hs > 0 ? (side ? s0.g : s0.c) : NULL, M, N, hs, k);
        be->ops->head_gate(be, side ? z.g : z.c, side ? g.g : g.c, M, N, 5);
    }
    char what[96];
    snprintf(what, sizeof what, "moh_route M=%d N=%d hs=%d k=%d", M, N, hs, k);
    check(t, g, what, 1e-5);
    snprintf(what, sizeof what, "head_gate M=%d N=%d Dh=5", M, N);
    check(t, z, what, 1e-5);
    rm(t, lg);
    rm(t, s1);
    rm(t, s0);
    rm(t, g);
    rm(t, z);
}

static void test_moh(ctx *t) {
    moh_case(t, 300, 8, 0, 2);
    moh_case(t, 300, 8, 1, 3);
    moh_case(t, 257, 12, 4, 4);
}

/* ------------------------------------------------------------ softmax */

/* T query rows at t0.., S keys at kb.. (0, 0 with S = T: a full pass) */
static void softmax_case_at(ctx *t, int BN, int T, int S, int t0, int kb, int window, float scale) {
    pair x = mk_rand(t, (size_t)BN * T * S, scale, 0.0f);
    t->cpu->ops->softmax_masked(t->cpu, x.c, BN, T, S, t0, kb, window);
    t->gpu->ops->softmax_masked(t->gpu, x.g, BN, T, S, t0, kb, window);
    char what[96];
    snprintf(what, sizeof what, "softmax_masked BN=%d T=%d S=%d@%d,%d window=%d", BN, T, S, t0, kb, window);
    check(t, x, what, 1e-5);
    check_masked_zero(t, x, BN, T, S, t0, kb, window, what);
    rm(t, x);
}

static void softmax_case(ctx *t, int BN, int T, int window, float scale) {
    softmax_case_at(t, BN, T, T, 0, 0, window, scale);
}

static void test_softmax(ctx *t) {
    softmax_case(t, 5, 70, 0, 5.0f);
    softmax_case(t, 5, 70, 7, 5.0f);
    softmax_case(t, 2, 300, 256, 20.0f);           /* DCPythia's window, rows > 32 lanes */
    softmax_case_at(t, 8, 5, 19, 14, 0, 0, 5.0f);  /* a chunk: 5 rows at 14, keys 0.. */
    softmax_case_at(t, 8, 6, 13, 20, 12, 4, 5.0f); /* windowed, keys from 12          */
}

/* ------------------------------------------------------------ 16-bit weights */

/* A 16-bit copy of host floats on both backends (the CPU's in host memory,
 * as the loader keeps it; the GPU's uploaded): dcs_wmat views of each. */
typedef struct {
    dcs_wmat c, g;
} wpair;

static wpair mk_half(ctx *t, const float *host, size_t n, int dtype) {
    uint16_t *h = malloc(n * 2 + 2);
    void *dev = t->gpu->ops->alloc(t->gpu, n * 2);
    if (!h || !dev) {
        fprintf(stderr, "allocation of %zu halves failed\n", n);
        exit(2);
    }
    dcs_narrow(host, n, dtype, h);
    t->gpu->ops->upload(t->gpu, dev, h, n * 2);
    wpair w = {{h, dtype}, {dev, dtype}};
    return w;
}

static void rm_half(ctx *t, wpair w) {
    free((void *)(uintptr_t)w.c.p);
    t->gpu->ops->free(t->gpu, (void *)(uintptr_t)w.g.p);
}

/* gemm_w with 16-bit W: the GPU rounds A to W's type first, so the CPU gets
 * A rounded the same way (narrow, widen) and only the summation differs. */
static void gemm_w_case(ctx *t, int dtype, int transW, int M, int N, int K, int lda, float beta) {
    float *a = host_rand(t, (size_t)M * lda, 1.0f, 0.0f), *w = host_rand(t, (size_t)N * K, 0.5f, 0.0f);
    uint16_t *a16 = malloc((size_t)M * lda * 2 + 2);
    float *ar = malloc((size_t)M * lda * sizeof(float) + 4);
    if (!a16 || !ar) exit(2);
    dcs_narrow(a, (size_t)M * lda, dtype, a16);
    dcs_widen(a16, (size_t)M * lda, dtype, ar);
    pair A = mk(t, NULL, (size_t)M * lda), C = mk_rand(t, (size_t)M * N, 1.0f, 0.0f);
    t->cpu->ops->upload(t->cpu, A.c, ar, A.n * sizeof(float));
    t->gpu->ops->upload(t->gpu, A.g, a, A.n * sizeof(float));
    wpair W = mk_half(t, w, (size_t)N * K, dtype);
    t->cpu->ops->gemm_w(t->cpu, transW, M, N, K, A.c, lda, W.c, beta, C.c, N);
    t->gpu->ops->gemm_w(t->gpu, transW, M, N, K, A.g, lda, W.g, beta, C.g, N);
    char what[128];
    snprintf(what, sizeof what, "gemm_w %s transW=%d %dx%dx%d lda %d beta %g",
             dtype == DCS_F16 ? "f16" : "bf16", transW, M, N, K, lda, (double)beta);
    check(t, C, what, 1e-4);
    rm_half(t, W);
    rm(t, A);
    rm(t, C);
    free(a);
    free(w);
    free(a16);
    free(ar);
}

/* gemm_x: A and B rounded to dtype on the GPU; the CPU's gemm gets them
 * rounded the same way (narrow, widen). Head views as the attention uses them:
 * x [T, N*Dh] at stride Dh per head, maps [N, T, S]. */
static void round_host(float *x, size_t n, int dtype) {
    uint16_t *h = malloc(n * 2 + 2);
    if (!h) exit(2);
    dcs_narrow(x, n, dtype, h);
    dcs_widen(h, n, dtype, x);
    free(h);
}

static void gemm_x_case(ctx *t, int dtype, int tA, int T, int S, int N, int Dh) {
    const int D = N * Dh;
    float *x = host_rand(t, (size_t)T * D, 1.0f, 0.0f), *y = host_rand(t, (size_t)S * D, 1.0f, 0.0f);
    float *xr = malloc(sizeof(float) * (size_t)T * D + 4), *yr = malloc(sizeof(float) * (size_t)S * D + 4);
    if (!xr || !yr) exit(2);
    memcpy(xr, x, sizeof(float) * (size_t)T * D);
    memcpy(yr, y, sizeof(float) * (size_t)S * D);
    round_host(xr, (size_t)T * D, dtype);
    round_host(yr, (size_t)S * D, dtype);
    pair X = mk(t, NULL, (size_t)T * D), Y = mk(t, NULL, (size_t)S * D);
    t->cpu->ops->upload(t->cpu, X.c, xr, X.n * sizeof(float));
    t->cpu->ops->upload(t->cpu, Y.c, yr, Y.n * sizeof(float));
    t->gpu->ops->upload(t->gpu, X.g, x, X.n * sizeof(float));
    t->gpu->ops->upload(t->gpu, Y.g, y, Y.n * sizeof(float));
    char what[128];
    if (!tA) { /* scores: map [N, T, S] = x y^T per head */
        pair Mp = mk(t, NULL, (size_t)N * T * S);
        t->cpu->ops->gemm(t->cpu, 0, 1, T, S, Dh, 0.125f, X.c, D, Dh, Y.c, D, Dh, 0.0f, Mp.c, S,
                          (long long)T * S, N);
        t->gpu->ops->gemm_x(t->gpu, dtype, 0, 1, T, S, Dh, 0.125f, X.g, D, Dh, Y.g, D, Dh, 0.0f, Mp.g, S,
                            (long long)T * S, N);
        snprintf(what, sizeof what, "gemm_x %s scores N=%d T=%d S=%d Dh=%d",
                 dtype == DCS_F16 ? "f16" : "bf16", N, T, S, Dh);
        check(t, Mp, what, 1e-4);
        rm(t, Mp);
    } else { /* dk-like: out [S, N*Dh] = map^T x per head, map [N, T, S] from x y^T */
        float *mp = host_rand(t, (size_t)N * T * S, 1.0f, 0.0f),
              *mr = malloc(sizeof(float) * (size_t)N * T * S + 4);
        if (!mr) exit(2);
        memcpy(mr, mp, sizeof(float) * (size_t)N * T * S);
        round_host(mr, (size_t)N * T * S, dtype);
        pair Mp = mk(t, NULL, (size_t)N * T * S), O = mk(t, NULL, (size_t)S * D);
        t->cpu->ops->upload(t->cpu, Mp.c, mr, Mp.n * sizeof(float));
        t->gpu->ops->upload(t->gpu, Mp.g, mp, Mp.n * sizeof(float));
        t->cpu->ops->gemm(t->cpu, 1, 0, S, Dh, T, 1.0f, Mp.c, S, (long long)T * S, X.c, D, Dh, 0.0f, O.c, D,
                          Dh, N);
        t->gpu->ops->gemm_x(t->gpu, dtype, 1, 0, S, Dh, T, 1.0f, Mp.g, S, (long long)T * S, X.g, D, Dh, 0.0f,
                            O.g, D, Dh, N);
        snprintf(what, sizeof what, "gemm_x %s map^T rows N=%d T=%d S=%d Dh=%d",
                 dtype == DCS_F16 ? "f16" : "bf16", N, T, S, Dh);
        check(t, O, what, 1e-4);
        rm(t, Mp);
        rm(t, O);
        free(mp);
        free(mr);
    }
    rm(t, X);
    rm(t, Y);
    free(x);
    free(y);
    free(xr);
    free(yr);
}

static void test_half(ctx *t) {
    for (int dt = DCS_F16; dt <= DCS_BF16; dt++) {
        const size_t n = 10007;
        float *h = host_rand(t, n, 3.0f, 0.0f);
        wpair w = mk_half(t, h, n, dt);
        pair out = mk(t, NULL, n);
        t->cpu->ops->widen(t->cpu, out.c, w.c, n);
        t->gpu->ops->widen(t->gpu, out.g, w.g, n);
        check(t, out, dt == DCS_F16 ? "widen f16" : "widen bf16", 0.0);
        rm(t, out);
        rm_half(t, w);
        free(h);

        const int V = 50, D = 67, M = 40;
        float *tab = host_rand(t, (size_t)V * D, 1.0f, 0.0f);
        wpair tw = mk_half(t, tab, (size_t)V * D, dt);
        pair e = mk(t, NULL, (size_t)M * D);
        int32_t tok[40];
        for (int i = 0; i < M; i++) tok[i] = (int32_t)((frand(t) + 1.0f) * 0.5f * V) % V;
        tok[1] = V - 1;
        t->cpu->ops->embed_w(t->cpu, e.c, tw.c, tok, M, D);
        t->gpu->ops->embed_w(t->gpu, e.g, tw.g, tok, M, D);
        check(t, e, dt == DCS_F16 ? "embed_w f16" : "embed_w bf16", 0.0);
        rm(t, e);
        rm_half(t, tw);
        free(tab);

        gemm_w_case(t, dt, 1, 37, 29, 53, 53, 0.0f);    /* a Linear */
        gemm_w_case(t, dt, 1, 64, 256, 128, 160, 1.0f); /* strided rows, accumulate */
        gemm_w_case(t, dt, 0, 33, 96, 40, 40, 0.0f);    /* [K, N]: dw1, a head's wqkv rows */
        gemm_w_case(t, dt, 1, 256, 512, 1024, 1024, 0.0f);
        gemm_x_case(t, dt, 0, 37, 37, 4, 16);
        gemm_x_case(t, dt, 1, 64, 64, 8, 32);
        gemm_x_case(t, dt, 0, 5, 70, 3, 24); /* a decoding step against a cache */
    }
}

/* ------------------------------------------------------------ errors */

static void test_errors(ctx *t) {
    dcs_err e = {0};
    void *p = t->gpu->ops->alloc(t->gpu, (size_t)1 << 52); /* 4 PiB */
    if (p) {
        fail(t, "alloc of 4 PiB returned a pointer");
        t->gpu->ops->free(t->gpu, p);
    }
    dcs_status st = t->gpu->ops->sync(t->gpu, &e);
    if (st != DCS_ERR_BACKEND || strncmp(e.msg, "CUDA: ", 6))
        fail(t, "sync after a failed alloc: status %d, message '%s'", (int)st, e.msg);
    else
        printf("    ok   failed alloc reported: %s\n", e.msg);
    memset(&e, 0, sizeof e);
    st = t->gpu->ops->sync(t->gpu, &e);
    if (st != DCS_OK)
        fail(t, "the error was not cleared after it was reported: %s", e.msg);
    else
        printf("    ok   error cleared after sync\n");
    pair x = mk_rand(t, 1000, 1.0f, 0.0f); /* still usable */
    t->cpu->ops->gelu(t->cpu, x.c, x.n);
    t->gpu->ops->gelu(t->gpu, x.g, x.n);
    check(t, x, "a kernel after the error", 1e-5);
    rm(t, x);

    memset(&e, 0, sizeof e);
    dcs_backend *bad = dcs_backend_cuda_create(100000, &e);
    if (bad) {
        fail(t, "device 100000 was accepted");
        bad->ops->destroy(bad);
    } else if (e.code != DCS_ERR_ARG)
        fail(t, "device 100000: status %d (%s)", (int)e.code, e.msg);
    else
        printf("    ok   bad device rejected: %s\n", e.msg);
}

/* ------------------------------------------------------------ main */

typedef struct {
    const char *name;
    void (*fn)(ctx *);
} test_case;

static const test_case tests[] = {
    {"memory", test_memory},   {"mem_info", test_mem_info},       {"gemm", test_gemm},
    {"embed", test_embed},     {"elementwise", test_elementwise}, {"layernorm", test_layernorm},
    {"rmsnorm", test_rmsnorm}, {"rotary", test_rotary},           {"copy2d", test_copy2d},
    {"compose", test_compose}, {"softmax_masked", test_softmax},  {"moh", test_moh},
    {"half", test_half},       {"errors", test_errors},
};

int main(void) {
    const int n_tests = (int)(sizeof tests / sizeof tests[0]);
    char why[512];
    if (!dcs_cuda_probe(why, sizeof why)) {
        printf("cuda: 0 passed, 0 failed, %d skipped (no GPU: %s)\n", n_tests, why);
        return 0;
    }
    dcs_err e = {0};
    ctx t;
    memset(&t, 0, sizeof t);
    t.rng = 0x9E3779B97F4A7C15ULL;
    t.cpu = dcs_backend_cpu_create(0, &e);
    if (!t.cpu) {
        printf("cuda: cannot create the cpu backend: %s\ncuda: 0 passed, 1 failed\n", e.msg);
        return 1;
    }
    t.gpu = dcs_backend_cuda_create(0, &e);
    if (!t.gpu) {
        printf("cuda: cannot create the cuda backend: %s\ncuda: 0 passed, 1 failed\n", e.msg);
        t.cpu->ops->destroy(t.cpu);
        return 1;
    }
    int passed = 0, failed = 0;
    for (int i = 0; i < n_tests; i++) {
        printf("%s\n", tests[i].name);
        t.checks_failed = 0;
        tests[i].fn(&t);
        if (t.checks_failed)
            failed++;
        else
            passed++;
    }
    t.gpu->ops->destroy(t.gpu);
    t.cpu->ops->destroy(t.cpu);
    printf("cuda: %d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
