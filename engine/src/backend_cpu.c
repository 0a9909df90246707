/*
 * backend_cpu.c -- the CPU backend: host memory, OpenBLAS sgemm, and plain
 * loops around the shared per-element math of dcs_math.h.
 *
 * "Device pointers" here are ordinary host pointers.
 */
#include "internal.h"
#include "dcs_math.h"

#include <cblas.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    int n_threads;      /* for the element-wise kernels (GEMM: OpenBLAS's own) */
    dcs_status status;  /* first failure (allocation) */
    char msg[256];
} cpu_ctx;

/* ------------------------------------------------------------ parallel for
 * The element-wise kernels split their rows over the cores: items [0, n)
 * in contiguous chunks, chunk i on thread i (chunk 0 on the caller). Work
 * below PAR_MIN (items x cost) runs on the caller alone: a thread start
 * costs tens of microseconds. */
#define PAR_MAX_THREADS 64
#define PAR_MIN (1 << 20)

typedef void (*par_fn)(void *arg, long long begin, long long end);
typedef struct { par_fn fn; void *arg; long long begin, end; } par_chunk;

static void *par_run(void *p) {
    par_chunk *c = p;
    c->fn(c->arg, c->begin, c->end);
    return NULL;
}

/* `cost` is the rough work per item (for the PAR_MIN threshold). */
static void parallel_for(const dcs_backend *be, par_fn fn, void *arg, long long n, long long cost) {
    const cpu_ctx *c = be->ctx;
    int nt = c->n_threads;
    if (nt > PAR_MAX_THREADS) nt = PAR_MAX_THREADS;
    if (nt > n) nt = (int)n;
    if (nt <= 1 || n * cost < PAR_MIN) {
        fn(arg, 0, n);
        return;
    }
    par_chunk ch[PAR_MAX_THREADS];
    pthread_t th[PAR_MAX_THREADS];
    int started[PAR_MAX_THREADS] = {0};
    for (int i = 0; i < nt; i++) {
        ch[i] = (par_chunk){fn, arg, n * i / nt, n * (i + 1) / nt};
        if (i > 0) started[i] = pthread_create(&th[i], NULL, par_run, &ch[i]) == 0;
    }
    par_run(&ch[0]);
    for (int i = 1; i < nt; i++) {
        if (started[i]) pthread_join(th[i], NULL);
        else par_run(&ch[i]); /* no thread: do the chunk here */
    }
}

static void *cpu_alloc(dcs_backend *be, size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    cpu_ctx *c = be->ctx;
    if (!p && c->status == DCS_OK) {
        c->status = DCS_ERR_NOMEM;
        snprintf(c->msg, sizeof c->msg, "out of memory allocating %zu bytes", bytes);
    }
    return p;
}
static void cpu_free(dcs_backend *be, void *p) { (void)be; free(p); }
static void cpu_copy(dcs_backend *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    if (bytes) memmove(dst, src, bytes);
}
static dcs_status cpu_sync(dcs_backend *be, dcs_err *e) {
    cpu_ctx *c = be->ctx;
    if (c->status == DCS_OK) return DCS_OK;
    dcs_status s = c->status;
    c->status = DCS_OK; /* reported once; the backend stays usable */
    return dcs_seterr(e, s, "cpu backend: %s", c->msg);
}
static void cpu_destroy(dcs_backend *be) {
    if (!be) return;
    free(be->ctx);
    free(be);
}

/* Row-major strided batched GEMM on OpenBLAS. */
static void cpu_gemm(dcs_backend *be, int transA, int transB, int M, int N, int K,
                     float alpha, const float *A, int lda, long long sA,
                     const float *B, int ldb, long long sB, float beta,
                     float *C, int ldc, long long sC, int batch) {
    (void)be;
    for (int b = 0; b < batch; b++)
        cblas_sgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans,
                    transB ? CblasTrans : CblasNoTrans, M, N, K, alpha,
                    A + b * sA, lda, B + b * sB, ldb, beta, C + b * sC, ldc);
}

/* out [M, D] = table[tokens[m]] (ids were range-checked by the graph). */
static void cpu_embed(dcs_backend *be, float *out, const float *table,
                      const int32_t *tokens, int M, int D) {
    (void)be;
    for (int m = 0; m < M; m++)
        memcpy(out + (size_t)m * D, table + (size_t)tokens[m] * D, sizeof(float) * D);
}

/* x [M, N] += bias [N] */
static void cpu_add_bias(dcs_backend *be, float *x, const float *bias, int M, int N) {
    (void)be;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) x[(size_t)m * N + n] += bias[n];
}
static void cpu_add(dcs_backend *be, float *y, const float *x, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}
static void cpu_add3(dcs_backend *be, float *y, const float *a, const float *b,
                     const float *c, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i] + c[i];
}
static void gelu_range(void *x, long long b, long long e) {
    float *v = x;
    for (long long i = b; i < e; i++) v[i] = dcs_gelu(v[i]);
}
static void cpu_gelu(dcs_backend *be, float *x, size_t n) {
    parallel_for(be, gelu_range, x, (long long)n, 8);
}
static void cpu_tanh(dcs_backend *be, float *x, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) x[i] = tanhf(x[i]);
}
static void cpu_mul(dcs_backend *be, float *y, const float *g, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) y[i] *= g[i];
}

/* MoH routing scores, one row per token (dcs_moh_route_row). */
static void cpu_moh_route(dcs_backend *be, float *g, const float *logits, const float *s1,
                          const float *s0, int M, int N, int hs, int k) {
    (void)be;
    for (int m = 0; m < M; m++)
        dcs_moh_route_row(logits + (size_t)m * (N - hs), s1 ? s1 + (size_t)m * hs : NULL,
                          s0 ? s0 + (size_t)m * 2 : NULL, N, hs, k, g + (size_t)m * N);
}

/* z [M, N, Dh] *= g [M, N] */
static void cpu_head_gate(dcs_backend *be, float *z, const float *g, int M, int N, int Dh) {
    (void)be;
    for (size_t mn = 0; mn < (size_t)M * N; mn++)
        for (int d = 0; d < Dh; d++) z[mn * Dh + d] *= g[mn];
}

/* out [M, D] = (in - mean) / sqrt(var + eps) * w + b, per row. */
static void cpu_layernorm(dcs_backend *be, float *out, const float *in, const float *w,
                          const float *b, int M, int D, float eps) {
    (void)be;
    for (int m = 0; m < M; m++) {
        const float *x = in + (size_t)m * D;
        float *y = out + (size_t)m * D;
        double mean = 0, var = 0;
        for (int i = 0; i < D; i++) mean += x[i];
        mean /= D;
        for (int i = 0; i < D; i++) var += (x[i] - mean) * (x[i] - mean);
        var /= D;
        float inv = (float)(1.0 / sqrt(var + eps));
        for (int i = 0; i < D; i++)
            y[i] = ((float)(x[i] - mean) * inv) * w[i] + (b ? b[i] : 0.0f);
    }
}

/* x [rows, width] with row stride ld, RMS-normalised in place. */
static void cpu_rmsnorm(dcs_backend *be, float *x, int rows, int width, int ld,
                        const float *scale, float eps) {
    (void)be;
    for (int r = 0; r < rows; r++) {
        float *v = x + (size_t)r * ld;
        float ss = 0.0f;
        for (int i = 0; i < width; i++) ss += v[i] * v[i];
        float inv = dcs_rms_inv(ss, width, eps);
        for (int i = 0; i < width; i++) v[i] = v[i] * inv * (scale ? scale[i] : 1.0f);
    }
}

/* x [M, N, Dh]; row m is at position m % T. Rotate-half on the first rot dims. */
static void cpu_rotary(dcs_backend *be, float *x, int M, int T, int N, int Dh,
                       int rot, float base) {
    (void)be;
    int half = rot / 2;
    if (half == 0) return;
    float *cs = malloc(sizeof(float) * 2 * (size_t)half);
    if (!cs) { cpu_ctx *c = be->ctx; c->status = DCS_ERR_NOMEM; snprintf(c->msg, sizeof c->msg, "out of memory in rotary"); return; }
    for (int m = 0; m < M; m++) {
        int pos = m % T;
        for (int j = 0; j < half; j++) dcs_rotary_cs(pos, j, rot, base, &cs[2 * j], &cs[2 * j + 1]);
        for (int n = 0; n < N; n++) {
            float *h = x + ((size_t)m * N + n) * Dh;
            for (int j = 0; j < half; j++) dcs_rotate_pair(&h[j], &h[j + half], cs[2 * j], cs[2 * j + 1]);
        }
    }
    free(cs);
}

static void cpu_copy2d(dcs_backend *be, float *dst, int ld_dst, const float *src,
                       int ld_src, int rows, int cols) {
    (void)be;
    for (int r = 0; r < rows; r++)
        memcpy(dst + (size_t)r * ld_dst, src + (size_t)r * ld_src, sizeof(float) * cols);
}

/* Compose over [B, N, T, S]: each (b, t, s) pair through dcs_compose_pair;
 * the (b, t) rows are split over the cores. */
static void compose_rows(void *arg, long long begin, long long end) {
    const dcs_compose_args *a = arg;
    const int N = a->N, T = a->T, S = a->S, R = a->R;
    const long long TS = (long long)T * S;
    for (long long bt = begin; bt < end; bt++) {
        const int b = (int)(bt / T), t = (int)(bt % T);
        const long long base = (long long)b * N * TS;
        const float *qw1 = a->qw1 ? a->qw1 + ((size_t)b * T + t) * R * N : NULL;
        const float *qw2 = a->qw2 ? a->qw2 + ((size_t)b * T + t) * R * N : NULL;
        const float *qdd = a->qdd ? a->qdd + ((size_t)b * T + t) * N : NULL;
        for (int s = 0; s < S; s++) {
            long long o = base + (long long)t * S + s;
            if (a->causal_only && !dcs_allowed(t, s, a->window)) {
                for (int n = 0; n < N; n++) {
                    long long on = o + n * TS;
                    a->out[on] = 0.0f;
                    for (int k = 0; k < DCS_N_BRANCHES; k++)
                        if (a->br[k]) a->br[k][on] = 0.0f;
                }
                continue;
            }
            const float *kw1 = a->kw1 ? a->kw1 + ((size_t)b * S + s) * R * N : NULL;
            const float *kw2 = a->kw2 ? a->kw2 + ((size_t)b * S + s) * R * N : NULL;
            const float *kdd = a->kdd ? a->kdd + ((size_t)b * S + s) * N : NULL;
            dcs_compose_pair(a->in + o, a->out + o, TS, N, a->G, R, qw1, qw2, kw1, kw2, qdd, kdd,
                             a->sw, a->br[0] ? a->br[0] + o : NULL, a->br[1] ? a->br[1] + o : NULL,
                             a->br[2] ? a->br[2] + o : NULL, a->br[3] ? a->br[3] + o : NULL,
                             a->br[4] ? a->br[4] + o : NULL, a->br[5] ? a->br[5] + o : NULL);
        }
    }
}

static void cpu_compose(dcs_backend *be, const dcs_compose_args *a) {
    parallel_for(be, compose_rows, (void *)a, (long long)a->B * a->T, (long long)a->S * a->N * 8);
}

/* x [BN, T, S]: masked softmax over s, rows split over the cores. */
typedef struct { float *x; int T, S, window; } softmax_args;

static void softmax_rows(void *arg, long long begin, long long end) {
    const softmax_args *a = arg;
    const int T = a->T, S = a->S, window = a->window;
    for (long long r = begin; r < end; r++) {
        const int t = (int)(r % T);
        float *row = a->x + (size_t)r * S;
        float mx = -INFINITY;
        for (int s = 0; s < S; s++)
            if (dcs_allowed(t, s, window) && row[s] > mx) mx = row[s];
        float sum = 0.0f;
        for (int s = 0; s < S; s++) {
            float e = dcs_allowed(t, s, window) ? expf(row[s] - mx) : 0.0f;
            row[s] = e;
            sum += e;
        }
        float inv = 1.0f / sum;
        for (int s = 0; s < S; s++) row[s] *= inv;
    }
}

static void cpu_softmax_masked(dcs_backend *be, float *x, int BN, int T, int S, int window) {
    softmax_args a = {x, T, S, window};
    parallel_for(be, softmax_rows, &a, (long long)BN * T, (long long)S * 4);
}

dcs_backend *dcs_backend_cpu_create(int n_threads, dcs_err *e) {
    dcs_backend *be = calloc(1, sizeof *be);
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        dcs_seterr(e, DCS_ERR_NOMEM, "out of memory creating the cpu backend");
        return NULL;
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    c->n_threads = n_threads > 0 ? n_threads : (cores > 0 ? (int)cores : 1);
#ifdef OPENBLAS_VERSION
    if (n_threads > 0) openblas_set_num_threads(n_threads);
#endif
    be->name = "cpu";
    be->ctx = c;
    be->alloc = cpu_alloc;
    be->free = cpu_free;
    be->upload = cpu_copy;
    be->download = cpu_copy;
    be->copy = cpu_copy;
    be->sync = cpu_sync;
    be->destroy = cpu_destroy;
    be->gemm = cpu_gemm;
    be->embed = cpu_embed;
    be->add_bias = cpu_add_bias;
    be->add = cpu_add;
    be->add3 = cpu_add3;
    be->gelu = cpu_gelu;
    be->tanh_ = cpu_tanh;
    be->layernorm = cpu_layernorm;
    be->rmsnorm = cpu_rmsnorm;
    be->rotary = cpu_rotary;
    be->copy2d = cpu_copy2d;
    be->compose = cpu_compose;
    be->softmax_masked = cpu_softmax_masked;
    be->mul = cpu_mul;
    be->moh_route = cpu_moh_route;
    be->head_gate = cpu_head_gate;
    return be;
}
