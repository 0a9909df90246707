/*
 * cpu.c -- the CPU backend: host memory, OpenBLAS sgemm, and plain
 * loops around the shared per-element math of dcs_math.h.
 *
 * "Device pointers" here are ordinary host pointers.
 */
/* The element-wise loops (compose rows above all) need the vectoriser's
 * dynamic cost model: -O2's default only vectorises loops without a tail.
 * Vectorising never reorders a float sum here (no -ffast-math). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("vect-cost-model=dynamic")
#endif
#include "dcs_backend.h"
#include "dcs_math.h"
#include "cpu_backward.h"
#include "cpu_gemm_grid.h"
#include "cpu_vec.h"

#include "dcs_blas.h"
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------ thread pool
 * One persistent pool per backend (so per model): n_threads - 1 workers
 * started at creation, parked on a condition variable between jobs; the
 * caller is thread 0. A job is a range of items [0, n) handed out in chunks
 * through an atomic counter (dynamic schedule: the cores are shared, and
 * the blocks of a causal attention differ in size). Everything runs on it,
 * GEMM included: OpenBLAS is called single-threaded from the pool's
 * threads, so the model's n_threads is the one setting for all its work and
 * two models in one process keep their own counts (docs/performance.md). */
#define PAR_MAX_THREADS 64
#define PAR_MIN (1 << 16) /* items x cost below this run on the caller */

typedef dcs_par_fn par_fn;

typedef struct {
    int n; /* threads, the caller included          */
    pthread_t th[PAR_MAX_THREADS];
    int n_started;
    pthread_mutex_t mu, job_mu; /* job_mu: one job at a time             */
    pthread_cond_t go, done;
    atomic_uint gen;   /* written under mu; read without it while spinning */
    atomic_int active; /* likewise                                    */
    int stop;
    par_fn fn;
    void *arg;
    long long n_items, chunk;
    atomic_llong next;
    unsigned forks; /* fork_count when the pool was started  */
} par_pool;

/* Widen n F16/BF16 values to float32 (exact), the backend's fastest way. */
typedef void (*widen_fn)(const uint8_t *src, uint64_t n, int dtype, float *out);

typedef struct {
    int n_threads;
    widen_fn widen;
    par_pool pool;
    float *scratch[PAR_MAX_THREADS]; /* per-thread work buffers           */
    size_t scratch_n[PAR_MAX_THREADS];
    dcs_status status; /* first failure (allocation) */
    char msg[256];
} cpu_ctx;

/* ------------------------------------------------------------ fork safety
 * fork() copies the pool's memory but none of its threads, and a mutex some
 * other thread held at that instant stays held in the child. A child handler
 * (pthread_atfork, installed once) counts the forks; a pool started under an
 * older count is rebuilt by its first use in the child (pool_rebuild: new
 * mutexes, condition variables, threads and scratch, the old ones dropped
 * untouched, never locked or joined). A fork while a pass runs in another
 * thread is covered too: that thread does not exist in the child.
 * OpenBLAS's own fork handlers are left alone (it parks its threads around a
 * fork); the engine calls it single-threaded anyway. fork_count is the
 * process's, not a model's: the one mutable static of the backend. */
static atomic_uint fork_count;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void on_fork_child(void) { atomic_fetch_add(&fork_count, 1); }
static void fork_handler_install(void) { pthread_atfork(NULL, NULL, on_fork_child); }
static int pool_stale(const par_pool *p) { return p->forks != atomic_load(&fork_count); }

static void pool_work(par_pool *p, int tid) {
    for (;;) {
        long long i = atomic_fetch_add(&p->next, p->chunk);
        if (i >= p->n_items) break;
        long long e = i + p->chunk < p->n_items ? i + p->chunk : p->n_items;
        p->fn(p->arg, i, e, tid);
    }
}

/* Waits for a job or its end spin for up to POOL_SPIN_NS before sleeping
 * on the condition variable: a training step hands the pool a job every
 * 0.1-2 ms, and waking a sleeping thread (futex, an IPI in a VM) cost its
 * steps 5-10% of their time in idle waits. Bounded, so an idle pool still
 * sleeps, and yielding every 64 pauses, so a thread with work (another
 * process's, or this pool's when it has more threads than cores) runs first. */
#define POOL_SPIN_NS 100000
static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
static inline void cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}
/* spin while *v == val (at most POOL_SPIN_NS) */
static void spin_while_uint(const atomic_uint *v, unsigned val) {
    const long long t0 = now_ns();
    for (int k = 0; atomic_load(v) == val; k++) {
        cpu_pause();
        if ((k & 63) == 63 && (sched_yield(), now_ns() - t0 > POOL_SPIN_NS)) return;
    }
}
static void spin_while_pos(const atomic_int *v) {
    const long long t0 = now_ns();
    for (int k = 0; atomic_load(v) > 0; k++) {
        cpu_pause();
        if ((k & 63) == 63 && (sched_yield(), now_ns() - t0 > POOL_SPIN_NS)) return;
    }
}

static void *pool_main(void *arg) {
    par_pool *p = ((void **)arg)[0];
    int tid = (int)(intptr_t)((void **)arg)[1];
    free(arg);
    unsigned seen = 0;
    for (;;) {
        spin_while_uint(&p->gen, seen); /* stop: pool_stop bumps gen too */
        pthread_mutex_lock(&p->mu);
        while (p->gen == seen && !p->stop) pthread_cond_wait(&p->go, &p->mu);
        if (p->stop) break;
        seen = p->gen;
        pthread_mutex_unlock(&p->mu);
        pool_work(p, tid);
        pthread_mutex_lock(&p->mu);
        if (--p->active == 0) pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void pool_start(par_pool *p, int n) {
    memset(p, 0, sizeof *p);
    p->forks = atomic_load(&fork_count);
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->job_mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->next, 0);
    atomic_init(&p->gen, 0);
    atomic_init(&p->active, 0);
    p->n = 1;
    for (int i = 1; i < n && i < PAR_MAX_THREADS; i++) {
        void **a = malloc(2 * sizeof *a);
        if (!a) break;
        a[0] = p;
        a[1] = (void *)(intptr_t)i;
        if (pthread_create(&p->th[i], NULL, pool_main, a) != 0) {
            free(a);
            break;
        }
        p->n = i + 1;
    }
    p->n_started = p->n - 1;
}

static void pool_stop(par_pool *p) {
    if (pool_stale(p)) return; /* a forked child's copy: no threads to stop */
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    p->gen++;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i <= p->n_started; i++) pthread_join(p->th[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->job_mu);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
}

/* First use of a pool in a forked child: start it again. The scratch
 * buffers are forgotten, not freed (a thread of the parent may have been
 * replacing one at the fork); their copied pages cost the child nothing
 * until written. */
static void pool_rebuild(cpu_ctx *c) {
    memset(c->scratch, 0, sizeof c->scratch);
    memset(c->scratch_n, 0, sizeof c->scratch_n);
    pool_start(&c->pool, c->n_threads);
}

/* Run fn over items [0, n) in chunks of `chunk` (0: about 4 per thread).
 * `cost` is the rough work per item: small jobs run on the caller alone,
 * and so does a job started while the pool is busy (a nested call). */
static void parallel_for_chunk(const dcs_backend *be, par_fn fn, void *arg, long long n, long long cost,
                               long long chunk) {
    cpu_ctx *c = be->ctx;
    par_pool *p = &c->pool;
    if (n <= 0) return;
    if (pool_stale(p)) pool_rebuild(c);
    if (p->n <= 1 || n == 1 || n * cost < PAR_MIN || pthread_mutex_trylock(&p->job_mu) != 0) {
        fn(arg, 0, n, 0);
        return;
    }
    if (chunk <= 0) chunk = (n + 4LL * p->n - 1) / (4LL * p->n);
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n_items = n;
    p->chunk = chunk;
    atomic_store(&p->next, 0);
    p->active = p->n - 1;
    p->gen++;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    pool_work(p, 0);
    spin_while_pos(&p->active);
    pthread_mutex_lock(&p->mu);
    while (p->active > 0) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_unlock(&p->job_mu);
}

static void parallel_for(const dcs_backend *be, par_fn fn, void *arg, long long n, long long cost) {
    parallel_for_chunk(be, fn, arg, n, cost, 0);
}

/* ops->parallel: the model's host work on this pool (the tape's backward). */
static void cpu_parallel(dcs_backend *be, dcs_par_fn fn, void *arg, long long n, long long cost) {
    parallel_for_chunk(be, fn, arg, n, cost, 0);
}

/* Thread tid's scratch buffer of at least n floats (NULL: out of memory). */
static float *scratch(const dcs_backend *be, int tid, size_t n) {
    cpu_ctx *c = be->ctx;
    if (c->scratch_n[tid] < n) {
        free(c->scratch[tid]);
        c->scratch[tid] = malloc(n * sizeof(float));
        c->scratch_n[tid] = c->scratch[tid] ? n : 0;
    }
    return c->scratch[tid];
}

static void set_nomem(const dcs_backend *be, const char *what) {
    cpu_ctx *c = be->ctx;
    if (c->status == DCS_OK) { /* first failure wins; racy writers agree */
        c->status = DCS_ERR_NOMEM;
        snprintf(c->msg, sizeof c->msg, "out of memory in %s", what);
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
static void cpu_free(dcs_backend *be, void *p) {
    (void)be;
    free(p);
}
/* A large copy or fill in pieces of SPAN_PIECE bytes on the pool (the
 * tape's kept activations and gradient buffers: megabytes a call, which one
 * core moves at a fraction of the memory's bandwidth); smaller ones, and
 * overlapping copies (memmove), on the caller. */
#define SPAN_PIECE (64 << 10)
#define SPAN_MIN (1 << 20)
typedef struct {
    char *dst;
    const char *src; /* NULL: fill with zeros */
    size_t n;
} span_job;
static void span_items(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const span_job *j = arg;
    const size_t o = (size_t)b * SPAN_PIECE,
                 end = (size_t)e * SPAN_PIECE < j->n ? (size_t)e * SPAN_PIECE : j->n;
    if (j->src)
        memcpy(j->dst + o, j->src + o, end - o);
    else
        memset(j->dst + o, 0, end - o);
}
static void span_run(dcs_backend *be, void *dst, const void *src, size_t bytes) {
    span_job j = {dst, src, bytes};
    parallel_for(be, span_items, &j, (long long)((bytes + SPAN_PIECE - 1) / SPAN_PIECE), PAR_MIN);
}
static void cpu_copy(dcs_backend *be, void *dst, const void *src, size_t bytes) {
    const char *d = dst, *s = src;
    if (bytes >= SPAN_MIN && (d + bytes <= s || s + bytes <= d))
        span_run(be, dst, src, bytes);
    else if (bytes)
        memmove(dst, src, bytes);
}
void cpu_zero(dcs_backend *be, void *p, size_t bytes) {
    if (bytes >= SPAN_MIN)
        span_run(be, p, NULL, bytes);
    else if (bytes)
        memset(p, 0, bytes);
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
    cpu_ctx *c = be->ctx;
    int stale = pool_stale(&c->pool); /* forked child, pool never used: see pool_rebuild */
    pool_stop(&c->pool);
    for (int i = 0; i < PAR_MAX_THREADS && !stale; i++) free(c->scratch[i]);
    free(c);
    free(be);
}

/* ------------------------------------------------------------ widening
 * F16 -> float32 with the CPU's conversion instruction (vcvtph2ps: exact for
 * every half, subnormals included) where it has one, else dcs_widen's
 * portable bit arithmetic; BF16 is a shift either way. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx512f"))) static void widen_avx512(const uint8_t *src, uint64_t n, int dtype,
                                                            float *out) {
    uint64_t i = 0;
    if (dtype == DCS_F16)
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * i))));
    else
        for (; i + 16 <= n; i += 16) {
            __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 2 * i)));
            _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
        }
    if (i < n) dcs_widen(src + 2 * i, n - i, dtype, out + i);
}
__attribute__((target("avx2,f16c"))) static void widen_f16c(const uint8_t *src, uint64_t n, int dtype,
                                                            float *out) {
    uint64_t i = 0;
    if (dtype == DCS_F16)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
    else
        for (; i + 8 <= n; i += 8) {
            __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * i)));
            _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
        }
    if (i < n) dcs_widen(src + 2 * i, n - i, dtype, out + i);
}
#endif
static void widen_plain(const uint8_t *src, uint64_t n, int dtype, float *out) {
    dcs_widen(src, n, dtype, out);
}
static widen_fn pick_widen(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return widen_avx512;
#if defined(__clang__) /* clang's builtin knows no "f16c"; every AVX2 x86 CPU has it */
    if (__builtin_cpu_supports("avx2")) return widen_f16c;
#else
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return widen_f16c;
#endif
#endif
    return widen_plain;
}

/* ------------------------------------------------------------ GEMM
 * Row-major strided batched GEMM: the batch x (tm x tn output tiles) are
 * items of the pool, each one single-threaded OpenBLAS sgemm over the whole
 * of K (never split: each output element is one sgemm's sum). */

#define GEMMW_SCRATCH (4LL << 20) /* floats of a cpu_gemm_w weight tile (tn x K, widened) */

/* cpu_gemm_w's grid: cpu_gemm's, its tiles narrowed to GEMMW_SCRATCH floats of
 * widened weights. */
static dcs_gemm_grid gemmw_grid(int M, int N, int K) {
    dcs_gemm_grid g = gemm_grid(M, N, K, 1);
    int cap = (int)(GEMMW_SCRATCH / (K > 0 ? K : 1)) / 16 * 16;
    if (cap < 16) cap = 16;
    if (g.tn > cap) g.tn = cap, g.gn = (N + cap - 1) / cap;
    return g;
}

/* Tile it of a batch entry: rows [*m0, *m0 + *mt), columns [*n0, *n0 + *nt). */
static void grid_tile(const dcs_gemm_grid *g, int M, int N, long long it, int *m0, int *mt, int *n0,
                      int *nt) {
    const int im = (int)(it / g->gn), in = (int)(it % g->gn);
    *m0 = im * g->tm;
    *n0 = in * g->tn;
    *mt = M - *m0 < g->tm ? M - *m0 : g->tm;
    *nt = N - *n0 < g->tn ? N - *n0 : g->tn;
}

typedef struct {
    int tA, tB, M, N, K;
    float alpha, beta;
    const float *A, *B;
    float *C;
    int lda, ldb, ldc;
    long long sA, sB, sC;
    dcs_gemm_grid g;
} gemm_job;

static void gemm_items(void *arg, long long begin, long long end, int tid) {
    (void)tid;
    const gemm_job *j = arg;
    const long long per = (long long)j->g.gm * j->g.gn;
    for (long long it = begin; it < end; it++) {
        const long long b = it / per;
        int m0, mt, n0, nt;
        grid_tile(&j->g, j->M, j->N, it % per, &m0, &mt, &n0, &nt);
        if (mt <= 0 || nt <= 0) continue;
        const float *A = j->A + b * j->sA + (j->tA ? m0 : (long long)m0 * j->lda);
        const float *B = j->B + b * j->sB + (j->tB ? (long long)n0 * j->ldb : n0);
        float *C = j->C + b * j->sC + (long long)m0 * j->ldc + n0;
        cblas_sgemm(CblasRowMajor, j->tA ? CblasTrans : CblasNoTrans, j->tB ? CblasTrans : CblasNoTrans, mt,
                    nt, j->K, j->alpha, A, j->lda, B, j->ldb, j->beta, C, j->ldc);
    }
}

static void cpu_gemm(dcs_backend *be, int transA, int transB, int M, int N, int K, float alpha,
                     const float *A, int lda, long long sA, const float *B, int ldb, long long sB, float beta,
                     float *C, int ldc, long long sC, int batch) {
    gemm_job j = {
        transA, transB, M, N, K, alpha, beta, A, B, C, lda, ldb, ldc, sA, sB, sC, gemm_grid(M, N, K, batch)};
    const long long per = (long long)j.g.gm * j.g.gn;
    parallel_for_chunk(be, gemm_items, &j, batch * per, 2LL * j.g.tm * j.g.tn * K, 1);
}

/* C [M, N] = A [M, K] op(W), W in F16/BF16: each item is a tm x tn tile of C
 * (gemmw_grid); its thread widens W's tn columns into its scratch (exact;
 * tn x K floats, the widening 1/tm of the tile's multiply-adds) and runs
 * sgemm on it. */
typedef struct {
    int transW, M, N, K, lda, ldc;
    float beta;
    const float *A;
    dcs_wmat W;
    float *C;
    const dcs_backend *be;
    dcs_gemm_grid g;
} gemmw_job;

static void gemmw_items(void *arg, long long begin, long long end, int tid) {
    const gemmw_job *j = arg;
    const size_t es = dcs_dtype_size(j->W.dtype);
    const widen_fn widen = ((const cpu_ctx *)j->be->ctx)->widen;
    float *buf = scratch(j->be, tid, (size_t)j->g.tn * j->K);
    if (!buf) {
        set_nomem(j->be, "gemm (weight tile)");
        return;
    }
    for (long long it = begin; it < end; it++) {
        int m0, mt, n0, nw;
        grid_tile(&j->g, j->M, j->N, it, &m0, &mt, &n0, &nw);
        if (mt <= 0 || nw <= 0) continue;
        const uint8_t *W = j->W.p;
        const float *A = j->A + (size_t)m0 * j->lda;
        float *C = j->C + (size_t)m0 * j->ldc + n0;
        if (j->transW) { /* rows n0.. of W [N, K]: contiguous */
            widen(W + (size_t)n0 * j->K * es, (uint64_t)nw * j->K, j->W.dtype, buf);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, mt, nw, j->K, 1.0f, A, j->lda, buf, j->K,
                        j->beta, C, j->ldc);
        } else { /* columns n0.. of W [K, N] */
            for (int k = 0; k < j->K; k++)
                widen(W + ((size_t)k * j->N + n0) * es, (uint64_t)nw, j->W.dtype, buf + (size_t)k * nw);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, mt, nw, j->K, 1.0f, A, j->lda, buf, nw,
                        j->beta, C, j->ldc);
        }
    }
}

static void cpu_gemm_w(dcs_backend *be, int transW, int M, int N, int K, const float *A, int lda, dcs_wmat W,
                       float beta, float *C, int ldc) {
    if (W.dtype == DCS_F32) {
        cpu_gemm(be, 0, transW, M, N, K, 1.0f, A, lda, 0, W.p, transW ? K : N, 0, beta, C, ldc, 0, 1);
        return;
    }
    gemmw_job j = {transW, M, N, K, lda, ldc, beta, A, W, C, be, gemmw_grid(M, N, K)};
    parallel_for_chunk(be, gemmw_items, &j, (long long)j.g.gm * j.g.gn, PAR_MIN, 1);
}

/* The vectorised row kernels (GELU here, compose rows below): DCS_VEC,
 * cpu_vec.h. */

/* ------------------------------------------------------------ row kernels
 * Each splits its rows over the pool (above PAR_MIN items x cost). */

/* out [M, D] = table[tokens[m]] (ids were range-checked by the graph). */
static void cpu_embed(dcs_backend *be, float *out, const float *table, const int32_t *tokens, int M, int D) {
    (void)be;
    for (int m = 0; m < M; m++) memcpy(out + (size_t)m * D, table + (size_t)tokens[m] * D, sizeof(float) * D);
}
static void cpu_widen(dcs_backend *be, float *out, dcs_wmat src, size_t n) {
    if (src.dtype == DCS_F32)
        memcpy(out, src.p, n * sizeof *out);
    else
        ((cpu_ctx *)be->ctx)->widen(src.p, n, src.dtype, out);
}

static void cpu_embed_w(dcs_backend *be, float *out, dcs_wmat table, const int32_t *tokens, int M, int D) {
    const size_t es = dcs_dtype_size(table.dtype);
    const widen_fn widen = ((const cpu_ctx *)be->ctx)->widen;
    for (int m = 0; m < M; m++)
        widen((const uint8_t *)table.p + (size_t)tokens[m] * D * es, (uint64_t)D, table.dtype,
              out + (size_t)m * D);
}

typedef struct {
    float *y;
    const float *a, *b, *c;
    int N;
    float eps;
    const float *w;
    int D;
} rows_args;

DCS_VEC static void add_bias_span(float *restrict y, const float *restrict bias, long long rows, int N) {
    for (long long m = 0; m < rows; m++)
        for (int n = 0; n < N; n++) y[m * N + n] += bias[n];
}
static void add_bias_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const rows_args *a = arg;
    add_bias_span(a->y + b * a->N, a->a, e - b, a->N);
}
/* x [M, N] += bias [N] */
static void cpu_add_bias(dcs_backend *be, float *x, const float *bias, int M, int N) {
    rows_args a = {x, bias, NULL, NULL, N, 0, NULL, 0};
    parallel_for(be, add_bias_rows, &a, M, N);
}
DCS_VEC static void add_span(float *restrict y, const float *restrict x, long long n) {
    for (long long i = 0; i < n; i++) y[i] += x[i];
}
static void add_range(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const rows_args *a = arg;
    add_span(a->y + b, a->a + b, e - b);
}
static void cpu_add(dcs_backend *be, float *y, const float *x, size_t n) {
    rows_args a = {y, x, NULL, NULL, 0, 0, NULL, 0};
    parallel_for(be, add_range, &a, (long long)n, 1);
}
/* y += a, then y += b, in one pass (ops->add2: add's bits, twice) */
DCS_VEC static void add2_span(float *restrict y, const float *restrict a, const float *restrict b,
                              long long n) {
    for (long long i = 0; i < n; i++) y[i] = (y[i] + a[i]) + b[i];
}
static void add2_range(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const rows_args *a = arg;
    add2_span(a->y + b, a->a + b, a->b + b, e - b);
}
static void cpu_add2(dcs_backend *be, float *y, const float *a, const float *b, size_t n) {
    rows_args r = {y, a, b, NULL, 0, 0, NULL, 0};
    parallel_for(be, add2_range, &r, (long long)n, 2);
}
/* dcs_softmax_span / dcs_softmax_row in the per-ISA clones (the same bits
 * at every width: the sums run in dcs_math.h's fixed lane order) */
DCS_VEC static void softmax_span(float *row, int len) { dcs_softmax_span(row, len); }
DCS_VEC static void softmax_row(float *row, int S, int t, int s0, int window) {
    dcs_softmax_row(row, S, t, s0, window);
}
DCS_VEC static void gelu_span(float *v, long long n) {
    for (long long i = 0; i < n; i++) v[i] = dcs_gelu(v[i]);
}
static void gelu_range(void *x, long long b, long long e, int tid) {
    (void)tid;
    gelu_span((float *)x + b, e - b);
}
static void cpu_gelu(dcs_backend *be, float *x, size_t n) {
    parallel_for(be, gelu_range, x, (long long)n, 8);
}
/* x [rows, N] += b, y = gelu(x), row by row (y may be x) */
DCS_VEC static void bias_gelu_span(float *y, float *x, const float *b, long long rows, int N) {
    for (long long m = 0; m < rows; m++) {
        float *xr = x + m * N, *yr = y + m * N;
        if (b)
            for (int n = 0; n < N; n++) xr[n] += b[n];
        for (int n = 0; n < N; n++) yr[n] = dcs_gelu(xr[n]);
    }
}
static void bias_gelu_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const rows_args *a = arg;
    bias_gelu_span(a->y + b * a->N, (float *)a->a + b * a->N, a->b, e - b, a->N);
}
static void cpu_bias_gelu(dcs_backend *be, float *y, float *x, const float *b, int M, int N) {
    rows_args a = {y, x, b, NULL, N, 0, NULL, 0};
    parallel_for(be, bias_gelu_rows, &a, M, 9LL * N);
}
/* bias_gelu_span, then x = gelu'(x) (ops->bias_gelu_keep; y apart from x) */
DCS_VEC static void bias_gelu_keep_span(float *restrict y, float *restrict x, const float *b, long long rows,
                                        int N) {
    for (long long m = 0; m < rows; m++) {
        float *xr = x + m * N, *yr = y + m * N;
        if (b)
            for (int n = 0; n < N; n++) xr[n] += b[n];
        for (int n = 0; n < N; n++) {
            const float v = xr[n];
            yr[n] = dcs_gelu(v);
            xr[n] = dcs_gelu_grad(v);
        }
    }
}
static void bias_gelu_keep_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const rows_args *a = arg;
    bias_gelu_keep_span(a->y + b * a->N, (float *)a->a + b * a->N, a->b, e - b, a->N);
}
static void cpu_bias_gelu_keep(dcs_backend *be, float *y, float *x, const float *b, int M, int N) {
    rows_args a = {y, x, b, NULL, N, 0, NULL, 0};
    parallel_for(be, bias_gelu_keep_rows, &a, M, 16LL * N);
}
static void tanh_range(void *x, long long b, long long e, int tid) {
    (void)tid;
    float *v = x;
    for (long long i = b; i < e; i++) v[i] = tanhf(v[i]);
}
static void cpu_tanh(dcs_backend *be, float *x, size_t n) {
    parallel_for(be, tanh_range, x, (long long)n, 8);
}
static void swiglu_range(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const rows_args *a = arg;
    for (long long i = b; i < e; i++) a->y[i] = dcs_swiglu(a->y[i], a->a[i]);
}
static void cpu_swiglu(dcs_backend *be, float *x, const float *b, size_t n) {
    rows_args a = {x, b, NULL, NULL, 0, 0, NULL, 0};
    parallel_for(be, swiglu_range, &a, (long long)n, 8);
}
static void cpu_moh_route(dcs_backend *be, float *g, const float *logits, const float *s1, const float *s0,
                          int M, int N, int hs, int k) {
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

/* out [M, D] = LayerNorm of each row of in (dcs_layernorm_row's bits),
 * DCS_LN_ROWS rows side by side. */
DCS_VEC static void layernorm_span(const rows_args *a, long long b0, long long e0) {
    const int D = a->D;
    for (long long m = b0; m < e0; m += DCS_LN_ROWS) {
        const int n = e0 - m < DCS_LN_ROWS ? (int)(e0 - m) : DCS_LN_ROWS;
        dcs_layernorm_rows(a->y + (size_t)m * D, a->a + (size_t)m * D, a->w, a->b, D, n, a->eps);
    }
}
static void layernorm_rows(void *arg, long long b0, long long e0, int tid) {
    (void)tid;
    layernorm_span(arg, b0, e0);
}
static void cpu_layernorm(dcs_backend *be, float *out, const float *in, const float *w, const float *b, int M,
                          int D, float eps) {
    rows_args a = {out, in, b, NULL, 0, eps, w, D};
    parallel_for(be, layernorm_rows, &a, M, 4LL * D);
}

/* out, out2 [M, D] = two LayerNorms of in (weights w, b and w2, b2), each
 * group of rows' statistics once, kept in stats [2, M] when asked
 * (ops->layernorm2): layernorm's bits. */
typedef struct {
    rows_args n[2];
    float *stats; /* [2, M] or NULL */
    long long M;
} rows2_args;
DCS_VEC static void layernorm2_span(const rows2_args *a2, long long b0, long long e0) {
    const rows_args *a = &a2->n[0];
    const int D = a->D;
    for (long long m = b0; m < e0; m += DCS_LN_ROWS) {
        const int n = e0 - m < DCS_LN_ROWS ? (int)(e0 - m) : DCS_LN_ROWS;
        const float *x = a->a + (size_t)m * D;
        double mu[DCS_LN_ROWS];
        float inv[DCS_LN_ROWS];
        dcs_layernorm_stats_rows(x, D, n, a->eps, mu, inv);
        for (int j = 0; j < n && a2->stats; j++) {
            a2->stats[m + j] = (float)mu[j];
            a2->stats[a2->M + m + j] = inv[j];
        }
        for (int k = 0; k < 2; k++)
            dcs_layernorm_rows_out(a2->n[k].y + (size_t)m * D, x, a2->n[k].w, a2->n[k].b, D, n, mu, inv);
    }
}
static void layernorm2_rows(void *arg, long long b0, long long e0, int tid) {
    (void)tid;
    layernorm2_span(arg, b0, e0);
}
static void cpu_layernorm2(dcs_backend *be, float *out, float *out2, float *stats, const float *in,
                           const float *w, const float *b, const float *w2, const float *b2, int M, int D,
                           float eps) {
    rows2_args a = {{{out, in, b, NULL, 0, eps, w, D}, {out2, in, b2, NULL, 0, eps, w2, D}}, stats, M};
    parallel_for(be, layernorm2_rows, &a, M, 6LL * D);
}

/* x [rows, width] with row stride ld, RMS-normalised in place. */
typedef struct {
    float *x;
    int width, ld;
    const float *scale;
    float eps;
} rms_args;
DCS_VEC static void rms_span(const rms_args *a, long long b, long long e) {
    float t[DCS_RMS_GROUP * DCS_RMS_TW];
    for (long long r = b; r < e; r += DCS_RMS_GROUP) {
        const int n = e - r < DCS_RMS_GROUP ? (int)(e - r) : DCS_RMS_GROUP;
        dcs_rms_rows(a->x + (size_t)r * a->ld, a->ld, a->width, n, a->scale, a->eps, t);
    }
}
static void rms_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    rms_span(arg, b, e);
}
static void cpu_rmsnorm(dcs_backend *be, float *x, int rows, int width, int ld, const float *scale,
                        float eps) {
    rms_args a = {x, width, ld, scale, eps};
    parallel_for(be, rms_rows, &a, rows, 3LL * width);
}

/* x [M, N, Dh]; row m is at position t0 + m % T. Rotate-half on the first rot dims. */
typedef struct {
    float *x;
    int T, t0, N, Dh, rot;
    float base;
    const dcs_backend *be;
} rot_args;
static void rot_rows(void *arg, long long b, long long e, int tid) {
    const rot_args *a = arg;
    const int half = a->rot / 2;
    float *cs = scratch(a->be, tid, 2 * (size_t)half);
    if (!cs) {
        set_nomem(a->be, "rotary");
        return;
    }
    for (long long m = b; m < e; m++) {
        int pos = a->t0 + (int)(m % a->T);
        for (int j = 0; j < half; j++) dcs_rotary_cs(pos, j, a->rot, a->base, &cs[2 * j], &cs[2 * j + 1]);
        for (int n = 0; n < a->N; n++) {
            float *h = a->x + ((size_t)m * a->N + n) * a->Dh;
            for (int j = 0; j < half; j++) dcs_rotate_pair(&h[j], &h[j + half], cs[2 * j], cs[2 * j + 1]);
        }
    }
}
static void cpu_rotary(dcs_backend *be, float *x, int M, int T, int t0, int N, int Dh, int rot, float base) {
    if (rot / 2 == 0) return;
    rot_args a = {x, T, t0, N, Dh, rot, base, be};
    parallel_for(be, rot_rows, &a, M, 40LL * rot + 4LL * N * rot);
}

/* q, k, v [M, D] = the thirds of qkv [M, 3D] + b, q and k rotated (ops->qkv_split):
 * row by row on the pool, add_bias's add, rot_rows' rotation of each pair
 * (the same bits as add_bias, copy2d, rotary, in one pass). */
typedef struct {
    float *dst[3];
    const float *qkv, *b;
    const float *cs; /* [T, half] (cos, sin) at positions t0 + t */
    int T, N, Dh, half;
} split_args;
DCS_VEC static void split_row(float *restrict y, const float *restrict x, const float *restrict b, int D) {
    if (b)
        for (int i = 0; i < D; i++) y[i] = x[i] + b[i];
    else
        memcpy(y, x, sizeof(float) * D);
}
static void split_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const split_args *a = arg;
    const int D = a->N * a->Dh, half = a->half;
    for (long long m = b; m < e; m++) {
        const float *cs = a->cs + 2 * (size_t)(m % a->T) * half;
        for (int part = 0; part < 3; part++) {
            float *y = a->dst[part] + (size_t)m * D;
            split_row(y, a->qkv + (size_t)m * 3 * D + (size_t)part * D, a->b ? a->b + (size_t)part * D : NULL,
                      D);
            for (int n = 0; n < a->N && part < 2 && half > 0; n++) {
                float *h = y + (size_t)n * a->Dh;
                for (int j = 0; j < half; j++) dcs_rotate_pair(&h[j], &h[j + half], cs[2 * j], cs[2 * j + 1]);
            }
        }
    }
}
static int cpu_qkv_split(dcs_backend *be, float *q, float *k, float *v, const float *qkv, const float *b,
                         int M, int T, int t0, int N, int Dh, int rot, float base) {
    const int half = rot / 2;
    float *cs = malloc(sizeof(float) * 2 * (size_t)T * (half > 0 ? half : 1));
    if (!cs) return 1;
    for (int t = 0; t < T; t++)
        for (int j = 0; j < half; j++)
            dcs_rotary_cs(t0 + t, j, rot, base, &cs[2 * ((size_t)t * half + j)],
                          &cs[2 * ((size_t)t * half + j) + 1]);
    split_args a = {{q, k, v}, qkv, b, cs, T, N, Dh, half};
    parallel_for(be, split_rows, &a, M, 6LL * N * Dh);
    free(cs);
    return 0;
}

static void cpu_copy2d(dcs_backend *be, float *dst, int ld_dst, const float *src, int ld_src, int rows,
                       int cols) {
    (void)be;
    if (cols <= 32) /* short rows (the dynamic weights' [R, N]): a loop, not a memcpy call per row */
        for (int r = 0; r < rows; r++) {
            float *d = dst + (size_t)r * ld_dst;
            const float *s = src + (size_t)r * ld_src;
            for (int c = 0; c < cols; c++) d[c] = s[c];
        }
    else
        for (int r = 0; r < rows; r++)
            memcpy(dst + (size_t)r * ld_dst, src + (size_t)r * ld_src, sizeof(float) * cols);
}

/* ------------------------------------------------------------ compose
 * (DCS_VEC, the per-ISA clones: see the row kernels above) */

/* dcs_compose_row's rank-2 case (both sides, no branches) on blocks of
 * DCS_KEY_PAD keys, the block's q0, q1, k0, k1 (dcs_compose_pre_r2) in
 * registers across the source heads and the target heads (were arrays in
 * tmp, loaded and stored per head): every element through the same
 * operations in the same order (the sums over n, DCS_COMPOSE_POST_R2), so
 * the same bits. A last partial block runs as the block of the row's last
 * DCS_KEY_PAD keys (overlapping the one before), computed first into `last`
 * [N, DCS_KEY_PAD] and stored after the others, as out may alias a.
 * Rows shorter than a block, or N > CB_MAX_N, are not taken: 0. */
#define CB_MAX_N 64
static inline __attribute__((always_inline)) void
compose_block_r2(const float *a, float *out, long long hs, int j, int N, const float *qw1, const float *qw2,
                 const float *kw1t, const float *kw2t, long long ks, const float *qdd, const float *kddt,
                 long long os) {
    const vkb zero = {0};
    vkb q0 = zero, q1 = zero, k0 = zero, k1 = zero;
    for (int n = 0; n < N; n++) {
        const vkb x = vld(a + n * hs + j);
        q0 += x * qw1[n];
        q1 += x * qw1[N + n];
        k0 += x * vld(kw1t + n * ks + j);
        k1 += x * vld(kw1t + (N + n) * ks + j);
    }
    for (int m = 0; m < N; m++) {
        const vkb x = vld(a + m * hs + j);
        vst(out + m * os,
            DCS_COMPOSE_POST_R2(x, q0, q1, k0, k1, qw2[m], qw2[N + m], vld(kw2t + m * ks + j),
                                vld(kw2t + (N + m) * ks + j), qdd[m], vld(kddt + m * ks + j), zero));
    }
}
DCS_VEC static int compose_blocks_r2(const float *a, float *out, long long hs, int L, int N, const float *qw1,
                                     const float *qw2, const float *kw1t, const float *kw2t, long long ks,
                                     const float *qdd, const float *kddt) {
    const int KP = DCS_KEY_PAD, Lb = L / KP * KP;
    if (L < KP || N > CB_MAX_N) return 0;
    float last[CB_MAX_N * DCS_KEY_PAD];
    if (Lb < L) compose_block_r2(a, last, hs, L - KP, N, qw1, qw2, kw1t, kw2t, ks, qdd, kddt, KP);
    for (int j = 0; j < Lb; j += KP)
        compose_block_r2(a, out + j, hs, j, N, qw1, qw2, kw1t, kw2t, ks, qdd, kddt, hs);
    for (int m = 0; Lb < L && m < N; m++)
        memcpy(out + m * hs + Lb, last + m * KP + (KP - (L - Lb)), sizeof(float) * (L - Lb));
    return L;
}

DCS_VEC static void compose_row(const float *a, float *out, long long hs, int L, int N, int R,
                                const float *qw1, const float *qw2, const float *kw1t, const float *kw2t,
                                long long ks, const float *qdd, const float *kddt, float *tmp,
                                float *const *br) {
    int j = 0;
    if (R == 2 && kw1t && kw2t && kddt && !br)
        j = compose_blocks_r2(a, out, hs, L, N, qw1, qw2, kw1t, kw2t, ks, qdd, kddt);
    if (j < L)
        dcs_compose_row(a + j, out + j, hs, L - j, N, R, qw1, qw2, kw1t ? kw1t + j : NULL,
                        kw2t ? kw2t + j : NULL, ks, qdd, kddt ? kddt + j : NULL, tmp, br);
}

/* Key-side dynamic weights [B, S, R, N] -> [B, R, N, S] (and gates
 * [B, S, N] -> [B, N, S]) so the compose rows read them along keys. */
static void transpose_keys(const float *src, float *dst, int B, int S, int RN) {
    for (int b = 0; b < B; b++)
        for (int s = 0; s < S; s++)
            for (int i = 0; i < RN; i++)
                dst[((size_t)b * RN + i) * S + s] = src[((size_t)b * S + s) * RN + i];
}

/* Compose over [B, N, T, S], per (b, t) row: the allowed keys (or all,
 * pre-compose) at once through dcs_compose_row (the per-pair math of
 * dcs_compose_pair, vectorised across keys; the CUDA backend runs the pair
 * form). kt: transposed key side (kw1t, kw2t, kddt). */
typedef struct {
    const dcs_compose_args *a;
    const float *kw1t, *kw2t, *kddt;
    const dcs_backend *be;
} crow_args;

static void compose_rows(void *arg, long long begin, long long end, int tid) {
    const crow_args *c = arg;
    const dcs_compose_args *a = c->a;
    const int N = a->N, T = a->T, S = a->S, R = a->R;
    const long long TS = (long long)T * S, RN = (long long)R * N;
    float *tmp = scratch(c->be, tid, (size_t)(2 * R + 2) * S);
    if (!tmp) {
        set_nomem(c->be, "compose");
        return;
    }
    for (long long bt = begin; bt < end; bt++) {
        const int b = (int)(bt / T), t = (int)(bt % T);
        const long long o = (long long)b * N * TS + (long long)t * S;
        int lo = 0, hi = S - 1;
        float *br[5] = {NULL, NULL, NULL, NULL, NULL};
        int any = 0; /* no branch wanted: compose_row gets NULL (its fused rank-2 loops) */
        for (int k = 0; k < 5; k++)
            if (a->br[k]) br[k] = a->br[k] + o, any = 1;
        if (a->causal_only) {
            /* allowed keys: positions [q - window, q], q = t0 + t; key j at kb + j */
            const int q = a->t0 + t;
            hi = q - a->kb < S - 1 ? q - a->kb : S - 1;
            lo = a->window > 0 && q - a->window - a->kb > 0 ? q - a->window - a->kb : 0;
            if (hi < lo - 1) hi = lo - 1;
            for (int k = -1; k < 5; k++) {
                float *base = k < 0 ? a->out + o : br[k];
                if (!base) continue;
                for (int n = 0; n < N; n++) {
                    float *row = base + n * TS;
                    for (int s = 0; s < lo; s++) row[s] = 0.0f;
                    for (int s = hi + 1; s < S; s++) row[s] = 0.0f;
                }
            }
        }
        if (a->br[5]) /* static branch: absent here, 0 as in the pair form */
            for (int n = 0; n < N; n++) memset(a->br[5] + o + n * TS, 0, sizeof(float) * S);
        for (int k = 0; k < 5; k++)
            if (br[k]) br[k] += lo;
        const float *k1 = c->kw1t ? c->kw1t + (size_t)b * RN * S + lo : NULL;
        const float *k2 = c->kw2t ? c->kw2t + (size_t)b * RN * S + lo : NULL;
        const float *kd = c->kddt ? c->kddt + (size_t)b * N * S + lo : NULL;
        compose_row(a->in + o + lo, a->out + o + lo, TS, hi - lo + 1, N, R, a->qw1 + ((size_t)b * T + t) * RN,
                    a->qw2 + ((size_t)b * T + t) * RN, k1, k2, S, a->qdd + ((size_t)b * T + t) * N, kd, tmp,
                    any ? br : NULL);
    }
}

/* The variants (groups, static map, key-wise only): each (b, t, s) pair
 * through dcs_compose_pair; the (b, t) rows are split over the cores. */
static void compose_pairs(void *arg, long long begin, long long end, int tid) {
    (void)tid;
    const dcs_compose_args *a = arg;
    for (long long bt = begin; bt < end; bt++)
        for (int s = 0; s < a->S; s++) dcs_compose_at(a, (int)(bt / a->T), (int)(bt % a->T), s);
}

static void cpu_compose(dcs_backend *be, const dcs_compose_args *a) {
    const long long cost = (long long)a->S * a->N * 8;
    if (a->G != 1 || a->sw || !a->qw1 || !a->qw2 || !a->qdd) {
        parallel_for(be, compose_pairs, (void *)a, (long long)a->B * a->T, cost);
        return;
    }
    const size_t RN = (size_t)a->R * a->N, nk = (size_t)a->B * a->S;
    float *kt = NULL;
    crow_args c = {a, NULL, NULL, NULL, be};
    if (a->kw1) {
        kt = malloc(sizeof(float) * nk * (2 * RN + a->N));
        if (!kt) {
            set_nomem(be, "compose");
            return;
        }
        transpose_keys(a->kw1, kt, a->B, a->S, (int)RN);
        transpose_keys(a->kw2, kt + nk * RN, a->B, a->S, (int)RN);
        transpose_keys(a->kdd, kt + 2 * nk * RN, a->B, a->S, a->N);
        c.kw1t = kt;
        c.kw2t = kt + nk * RN;
        c.kddt = kt + 2 * nk * RN;
    }
    parallel_for(be, compose_rows, &c, (long long)a->B * a->T, cost);
    free(kt);
}

/* ------------------------------------------------------------ softmax */

/* x [BN, T, S]: masked softmax over s (dcs_softmax_row; query t at t0 + t,
 * key s at kb + s), rows split over the cores. */
typedef struct {
    float *x;
    int T, S, t0, kb, window;
} softmax_args;

static void softmax_rows(void *arg, long long begin, long long end, int tid) {
    (void)tid;
    const softmax_args *a = arg;
    for (long long r = begin; r < end; r++)
        softmax_row(a->x + (size_t)r * a->S, a->S, a->t0 + (int)(r % a->T), a->kb, a->window);
}

static void cpu_softmax_masked(dcs_backend *be, float *x, int BN, int T, int S, int t0, int kb, int window) {
    softmax_args a = {x, T, S, t0, kb, window};
    parallel_for(be, softmax_rows, &a, (long long)BN * T, (long long)S * 4);
}

/* ------------------------------------------------------------ fused attention
 * Items are (sequence, block of attn_tq query rows), largest (latest) blocks
 * first. Query row r is at position t0 + r, key j at kb + j (a full pass:
 * t0 = kb = 0, S = T; a decoding step: its new rows against the cache). A
 * block's keys are [jmin, j1]: the window of its first query up to its last
 * query, clipped to the S keys. Per block, in the thread's scratch:
 *   S [N, tq, L] = q k^T * scale (one sgemm per head)
 *   per query row, on its allowed keys only: pre-compose, softmax,
 *   post-compose (dcs_compose_row); other keys of the block set to 0
 *   z [tq, N, Dh] = S v (one sgemm per head). */
#define ATT_TQ 32
#define ATT_MIN_TQ 8
#define ATT_ITEMS 32 /* items an attention aims for (2 per thread at 16 threads) */

/* Query rows per block: ATT_TQ, halved (down to ATT_MIN_TQ) while the
 * sequences have fewer than ATT_ITEMS blocks in all. A function of the shape
 * alone (B = 1, T = 512: 32 blocks of 16, whose causal sizes pair up to
 * equal loads on 16 threads); the rows of a block share its sgemm calls, so
 * like the GEMM tiles it must not depend on n_threads. */
static int attn_tq(int B, int T) {
    int tq = ATT_TQ;
    while (tq > ATT_MIN_TQ && (long long)B * ((T + tq - 1) / tq) < ATT_ITEMS) tq /= 2;
    return tq;
}

typedef struct {
    const dcs_attn_args *a;
    const float *kt[2][3]; /* per phase: kw1t, kw2t, kddt [B, R|1, N, S] */
    int nblk, tq;          /* query blocks per sequence, rows per block */
    const dcs_backend *be;
} attn_job;

/* The allowed keys of the query at position q, as key indices [lo, hi]
 * (empty when hi < lo). */
static void attn_keys(const dcs_attn_args *a, int q, int *lo, int *hi) {
    int l = a->window > 0 ? q - a->window - a->kb : 0, h = q - a->kb;
    *lo = l > 0 ? l : 0;
    *hi = h < a->S - 1 ? h : a->S - 1;
}

/* dst [S] = src [L] on the keys [j0, j0 + L), 0 on the others (a kept
 * map's row, a->keep) */
static void keep_row(float *dst, const float *src, int j0, int L, int S) {
    memset(dst, 0, sizeof(float) * (size_t)j0);
    memcpy(dst + j0, src, sizeof(float) * (size_t)L);
    memset(dst + j0 + L, 0, sizeof(float) * (size_t)(S - j0 - L));
}

/* row r0 + r of sequence b, head n, in the kept map x [B, N, T, S] */
static float *kept_at(const dcs_attn_args *a, float *x, int b, int n, int r) {
    return x + (((size_t)b * a->N + n) * a->T + r) * a->S;
}

/* Block blk of sequence b's queries: rows [r0, r0 + tq), keys [jmin, jmin + L)
 * (L <= 0: no row of the block has a key). */
typedef struct {
    int r0, tq, jmin, L;
} attn_block;

static attn_block attn_block_at(const dcs_attn_args *a, int TQ, int blk) {
    attn_block k;
    int jmax, lo_, hi_;
    k.r0 = blk * TQ;
    k.tq = (k.r0 + TQ < a->T ? k.r0 + TQ : a->T) - k.r0;
    attn_keys(a, a->t0 + k.r0, &k.jmin, &hi_);
    attn_keys(a, a->t0 + k.r0 + k.tq - 1, &lo_, &jmax);
    k.L = jmax - k.jmin + 1;
    return k;
}

/* The attention's two products for one block, one sgemm per head, with the
 * shapes, flags and operands that the fused kernel and the materialising
 * path (cpu_attention_scores / _pv) both issue: every BLAS kernel then
 * rounds them alike (a product's bits depend on its shape and flags, not
 * only on its inputs; issue 48). out / map: head n's [tq, L] block at
 * + n * hs, row stride ldm, column 0 = key jmin. */
static void block_scores(const dcs_attn_args *a, int b, attn_block k, float *out, long long hs, int ldm) {
    const int ld = a->ld, Dh = a->Dh;
    const float *qb = a->q + ((size_t)b * a->T + k.r0) * ld, *kb = a->k + ((size_t)b * a->S + k.jmin) * ld;
    for (int n = 0; n < a->N; n++)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, k.tq, k.L, Dh, a->scale, qb + n * Dh, ld,
                    kb + n * Dh, ld, 0.0f, out + n * hs, ldm);
}

static void block_pv(const dcs_attn_args *a, int b, attn_block k, const float *map, long long hs, int ldm) {
    const int ld = a->ld, Dh = a->Dh;
    const float *vb = a->v + ((size_t)b * a->S + k.jmin) * ld;
    float *zb = a->z + ((size_t)b * a->T + k.r0) * ld;
    for (int n = 0; n < a->N; n++)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k.tq, Dh, k.L, 1.0f, map + n * hs, ldm,
                    vb + n * Dh, ld, 0.0f, zb + n * Dh, ld);
}

static void attn_items(void *arg, long long begin, long long end, int tid) {
    const attn_job *J = arg;
    const dcs_attn_args *a = J->a;
    const int T = a->T, S = a->S, N = a->N, Dh = a->Dh, ld = a->ld, R = a->R, w = a->window;
    const long long RN = (long long)R * N;
    const int TQ = J->tq;
    int Lmax = w > 0 ? (TQ + w < S ? TQ + w : S) : S;
    float *Sc = scratch(J->be, tid, (size_t)N * TQ * Lmax + (size_t)(2 * R + 2) * Lmax);
    if (!Sc) {
        set_nomem(J->be, "attention");
        return;
    }
    float *tmp = Sc + (size_t)N * TQ * Lmax;
    /* the tape's maps (a full pass): A after the scores (the block's keys
     * only), P after the softmax (composed: before the post-compose, the
     * allowed keys only), the pattern at the end (whole rows) */
    float *kA = a->keep[0], *kP = a->keep[1], *kPc = a->compose ? a->keep[2] : a->keep[1];
    for (long long it = begin; it < end; it++) {
        const int b = (int)(it / J->nblk);
        const attn_block blk = attn_block_at(a, TQ, J->nblk - 1 - (int)(it % J->nblk));
        const int r0 = blk.r0, tq = blk.tq, jmin = blk.jmin, L = blk.L;
        float *zb = a->z + ((size_t)b * T + r0) * ld;
        if (L <= 0) { /* no key for any row of the block */
            for (int r = 0; r < tq; r++) memset(zb + (size_t)r * ld, 0, sizeof(float) * (size_t)N * Dh);
            for (int n = 0; kPc && n < N; n++) /* the pattern (A, and P before the post-compose: unread) */
                for (int r = 0; r < tq; r++) keep_row(kept_at(a, kPc, b, n, r0 + r), NULL, 0, 0, S);
            continue;
        }
        const long long hs = (long long)tq * L;
        block_scores(a, b, blk, Sc, hs, L);
        for (int n = 0; kA && n < N; n++)
            for (int r = 0; r < tq; r++)
                memcpy(kept_at(a, kA, b, n, r0 + r) + jmin, Sc + n * hs + (long long)r * L,
                       sizeof(float) * L);
        for (int r = 0; r < tq; r++) {
            int lo, hi;
            attn_keys(a, a->t0 + r0 + r, &lo, &hi);
            const int j0 = lo - jmin, len = hi - lo + 1;
            float *row = Sc + (long long)r * L;
            for (int ph = 0; ph < 2 && len > 0; ph++) {
                if (a->compose) {
                    const size_t tr = (size_t)b * T + r0 + r;
                    const float *k1 = J->kt[ph][0] ? J->kt[ph][0] + (size_t)b * RN * S + lo : NULL;
                    const float *k2 = J->kt[ph][1] ? J->kt[ph][1] + (size_t)b * RN * S + lo : NULL;
                    const float *kd = J->kt[ph][2] ? J->kt[ph][2] + (size_t)b * N * S + lo : NULL;
                    compose_row(row + j0, row + j0, hs, len, N, R, a->qw1[ph] + tr * RN, a->qw2[ph] + tr * RN,
                                k1, k2, S, a->qdd[ph] + tr * N, kd, tmp, NULL);
                }
                if (ph == 0)
                    for (int n = 0; n < N; n++) softmax_span(row + n * hs + j0, len);
                if (ph == 0 && kP && a->compose)
                    for (int n = 0; n < N; n++)
                        memcpy(kept_at(a, kP, b, n, r0 + r) + lo, row + n * hs + j0, sizeof(float) * len);
            }
            for (int n = 0; n < N; n++) {
                float *rn = row + n * hs;
                const int e = len > 0 ? j0 + len : 0;
                for (int j = 0; j < (len > 0 ? j0 : 0); j++) rn[j] = 0.0f;
                for (int j = e; j < L; j++) rn[j] = 0.0f;
                if (kPc) keep_row(kept_at(a, kPc, b, n, r0 + r), rn, jmin, L, S);
            }
        }
        block_pv(a, b, blk, Sc, hs, L);
    }
}

static void cpu_attention(dcs_backend *be, const dcs_attn_args *args) {
    dcs_attn_args full = *args;
    if (full.S <= 0) full.S = full.T; /* S unset: the keys are the queries' own */
    const dcs_attn_args *a = &full;
    attn_job J;
    memset(&J, 0, sizeof J);
    J.a = a;
    J.be = be;
    J.tq = attn_tq(a->B, a->T);
    J.nblk = (a->T + J.tq - 1) / J.tq;
    const size_t RN = (size_t)a->R * a->N, nk = (size_t)a->B * a->S;
    float *kt = NULL;
    if (a->compose && a->kw1[0]) {
        kt = malloc(sizeof(float) * nk * (2 * RN + a->N) * 2);
        if (!kt) {
            set_nomem(be, "attention");
            return;
        }
        for (int ph = 0; ph < 2; ph++) {
            float *base = kt + (size_t)ph * nk * (2 * RN + a->N);
            transpose_keys(a->kw1[ph], base, a->B, a->S, (int)RN);
            transpose_keys(a->kw2[ph], base + nk * RN, a->B, a->S, (int)RN);
            transpose_keys(a->kdd[ph], base + 2 * nk * RN, a->B, a->S, a->N);
            J.kt[ph][0] = base;
            J.kt[ph][1] = base + nk * RN;
            J.kt[ph][2] = base + 2 * nk * RN;
        }
    }
    parallel_for_chunk(be, attn_items, &J, (long long)a->B * J.nblk, PAR_MIN, 1);
    free(kt);
}

/* The materialising path's products on the fused kernel's blocks
 * (ops->attention_scores / attention_pv): items (sequence, block) as in
 * cpu_attention, each block's products by block_scores / block_pv, so a
 * hooked layer and a fused one compute the same bits on any BLAS kernel.
 * The scores of the keys outside a block's span (masked for each of its
 * rows: before the window, or after the block's last query) come from one
 * more sgemm per head on each side. map [B, N, T, S]. */
typedef struct {
    const dcs_attn_args *a;
    float *out;      /* scores: the map written */
    const float *in; /* pv: the map read        */
    int nblk, tq;
} attn_map_job;

static void scores_items(void *arg, long long begin, long long end, int tid) {
    (void)tid;
    const attn_map_job *J = arg;
    const dcs_attn_args *a = J->a;
    const int T = a->T, S = a->S, ld = a->ld, Dh = a->Dh;
    const long long TS = (long long)T * S;
    for (long long it = begin; it < end; it++) {
        const int b = (int)(it / J->nblk);
        attn_block k = attn_block_at(a, J->tq, (int)(it % J->nblk));
        float *out = J->out + (size_t)b * a->N * TS + (size_t)k.r0 * S;
        if (k.L <= 0) k.jmin = S, k.L = 0; /* every key outside: all of them on the left */
        if (k.L > 0) block_scores(a, b, k, out + k.jmin, TS, S);
        const int side[2][2] = {{0, k.jmin}, {k.jmin + k.L, S - k.jmin - k.L}}; /* first key, count */
        const float *qb = a->q + ((size_t)b * T + k.r0) * ld;
        for (int e = 0; e < 2; e++) {
            if (side[e][1] <= 0) continue;
            const float *kb = a->k + ((size_t)b * S + side[e][0]) * ld;
            for (int n = 0; n < a->N; n++)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, k.tq, side[e][1], Dh, a->scale,
                            qb + n * Dh, ld, kb + n * Dh, ld, 0.0f, out + n * TS + side[e][0], S);
        }
    }
}

static void pv_items(void *arg, long long begin, long long end, int tid) {
    (void)tid;
    const attn_map_job *J = arg;
    const dcs_attn_args *a = J->a;
    const long long TS = (long long)a->T * a->S;
    for (long long it = begin; it < end; it++) {
        const int b = (int)(it / J->nblk);
        const attn_block k = attn_block_at(a, J->tq, (int)(it % J->nblk));
        if (k.L <= 0) { /* no key: the rows' pattern is 0, so is z */
            for (int r = 0; r < k.tq; r++)
                memset(a->z + ((size_t)b * a->T + k.r0 + r) * a->ld, 0, sizeof(float) * (size_t)a->N * a->Dh);
            continue;
        }
        block_pv(a, b, k, J->in + (size_t)b * a->N * TS + (size_t)k.r0 * a->S + k.jmin, TS, a->S);
    }
}

static void attention_map_op(dcs_backend *be, const dcs_attn_args *args, float *out, const float *in,
                             par_fn fn) {
    dcs_attn_args full = *args;
    if (full.S <= 0) full.S = full.T;
    attn_map_job J = {&full, out, in, 0, attn_tq(full.B, full.T)};
    J.nblk = (full.T + J.tq - 1) / J.tq;
    const long long cost = 2LL * full.N * J.tq * full.S * full.Dh;
    parallel_for_chunk(be, fn, &J, (long long)full.B * J.nblk, cost, 1);
}

static void cpu_attention_scores(dcs_backend *be, const dcs_attn_args *a, float *map) {
    attention_map_op(be, a, map, NULL, scores_items);
}

static void cpu_attention_pv(dcs_backend *be, const dcs_attn_args *a, const float *map) {
    attention_map_op(be, a, NULL, map, pv_items);
}

static uint64_t cpu_bw_scratch(dcs_backend *be, const dcs_bw_shape *s) {
    return cpu_bw_scratch_bytes(s, ((cpu_ctx *)be->ctx)->n_threads);
}

static const dcs_backend_ops cpu_ops = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .copy = cpu_copy,
    .sync = cpu_sync,
    .destroy = cpu_destroy,
    .gemm = cpu_gemm,
    .embed = cpu_embed,
    .add_bias = cpu_add_bias,
    .add = cpu_add,
    .add2 = cpu_add2,
    .gelu = cpu_gelu,
    .bias_gelu = cpu_bias_gelu,
    .bias_gelu_keep = cpu_bias_gelu_keep,
    .tanh_ = cpu_tanh,
    .layernorm = cpu_layernorm,
    .layernorm2 = cpu_layernorm2,
    .rmsnorm = cpu_rmsnorm,
    .rotary = cpu_rotary,
    .qkv_split = cpu_qkv_split,
    .copy2d = cpu_copy2d,
    .compose = cpu_compose,
    .softmax_masked = cpu_softmax_masked,
    .gemm_w = cpu_gemm_w,
    .embed_w = cpu_embed_w,
    .widen = cpu_widen,
    .attention = cpu_attention,
    .attention_scores = cpu_attention_scores,
    .attention_pv = cpu_attention_pv,
    .moh_route = cpu_moh_route,
    .head_gate = cpu_head_gate,
    .parallel = cpu_parallel,
    .swiglu = cpu_swiglu,
    .zero = cpu_zero,
    .gelu_bw = cpu_gelu_bw,
    .gelu_bw_sum = cpu_gelu_bw_sum,
    .tanh_bw = cpu_tanh_bw,
    .softmax_bw = cpu_softmax_bw,
    .softmax_rows_bw = cpu_softmax_rows_bw,
    .layernorm_bw = cpu_layernorm_bw,
    .layernorm2_bw = cpu_layernorm2_bw,
    .rmsnorm_bw = cpu_rmsnorm_bw,
    .norm_bw_fanout = cpu_norm_bw_fanout,
    .rotary_bw = cpu_rotary_bw,
    .qkv_join_bw = cpu_qkv_join_bw,
    .col_sum = cpu_col_sum,
    .embed_bw = cpu_embed_bw,
    .xent_bw = cpu_xent_bw,
    .compose_bw = cpu_compose_bw,
    .compose_softmax_bw = cpu_compose_softmax_bw,
    .attention_bw = cpu_attention_bw,
    .mha_bw = cpu_mha_bw,
    .head_gate_bw = cpu_head_gate_bw,
    .moh_route_bw = cpu_moh_route_bw,
    .swiglu_bw = cpu_swiglu_bw,
    .bw_scratch = cpu_bw_scratch,
    .mem_info = NULL, /* the host's memory: the caller reads MemAvailable */
};

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
    if (c->n_threads > PAR_MAX_THREADS) c->n_threads = PAR_MAX_THREADS;
    c->widen = pick_widen();
#ifdef OPENBLAS_VERSION
    /* every sgemm is one item of a pool thread: OpenBLAS runs each on the
     * calling thread (the process's libopenblas is the engine's alone:
     * numpy wheels bring their own, symbol-prefixed) */
    openblas_set_num_threads(1);
#endif
    pthread_once(&fork_once, fork_handler_install);
    pool_start(&c->pool, c->n_threads);
    be->ops = &cpu_ops;
    be->ctx = c;
    return be;
}

/* the kernel set OpenBLAS chose at load (dcs_blas_core in dclens.h) */
const char *dcs_cpu_blas_core(void) {
#ifdef OPENBLAS_VERSION
    const char *core = openblas_get_corename();
    return core ? core : "";
#else
    return "";
#endif
}

/* which BLAS (dcs_blas_library in dclens.h) and its build line */
const char *dcs_cpu_blas_library(void) { return DCS_BLAS_NAME; }
const char *dcs_cpu_blas_config(void) {
#ifdef OPENBLAS_VERSION
    const char *cfg = openblas_get_config();
    return cfg ? cfg : "";
#else
    return "";
#endif
}

/* ------------------------------------------------------------ partition
 * dcs_cpu_items: the items cpu_gemm (op 0), cpu_gemm_w (op 1) and
 * cpu_attention (op 2, its causal pass t0 = kb = 0) hand the pool, from the
 * same grid / attn_tq rules, with each item's rough work in multiply-adds:
 * a tile's mt nt K; an attention block's two sgemms per head (2 N tq L Dh)
 * plus, per allowed (row, key), N (4 + compose ? 2 (4 R + 3) : 0) for the
 * softmax and both composes (a model of dcs_compose_row's work, not a count).
 * Only the first cap items are visited: a huge shape costs nothing. */
int64_t dcs_cpu_items(int op, const int *s, int n, int64_t *cost, int64_t cap) {
    if (!s || n < 1) return -1;
    for (int i = 0; i < n; i++)
        if (s[i] < 0) return -1;
    if (op == DCS_PART_GEMM || op == DCS_PART_GEMM_W) {
        if (n != (op == DCS_PART_GEMM ? 4 : 3)) return -1;
        const int M = s[0], N = s[1], K = s[2], batch = op == DCS_PART_GEMM ? s[3] : 1;
        const dcs_gemm_grid g = op == DCS_PART_GEMM ? gemm_grid(M, N, K, batch) : gemmw_grid(M, N, K);
        const int64_t per = (int64_t)g.gm * g.gn, count = batch * per;
        for (int64_t it = 0; cost && it < count && it < cap; it++) {
            int m0, mt, n0, nt;
            grid_tile(&g, M, N, it % per, &m0, &mt, &n0, &nt);
            cost[it] = mt > 0 && nt > 0 ? (int64_t)mt * nt * K : 0;
        }
        return count;
    }
    if (op != DCS_PART_ATTN || (n != 8 && n != 9)) return -1;
    dcs_attn_args a;
    memset(&a, 0, sizeof a);
    const int B = s[0], T = s[1], N = s[3], Dh = s[4], R = s[7];
    a.S = s[2] > 0 ? s[2] : T;
    a.window = s[5];
    const int64_t per_key = (int64_t)N * (4 + (s[6] ? 2 * (4 * R + 3) : 0));
    const int tq = n == 9 && s[8] > 0 ? s[8] : attn_tq(B, T), nblk = T > 0 ? (T + tq - 1) / tq : 0;
    for (int64_t it = 0; cost && it < (int64_t)B * nblk && it < cap; it++) {
        const int blk = nblk - 1 - (int)(it % nblk), r0 = blk * tq, r1 = (r0 + tq < T ? r0 + tq : T) - 1;
        int jmin, jmax, lo, hi;
        attn_keys(&a, r0, &jmin, &hi);
        attn_keys(&a, r1, &lo, &jmax);
        int64_t w = jmax >= jmin ? 2LL * N * (r1 - r0 + 1) * (jmax - jmin + 1) * Dh : 0;
        for (int r = r0; r <= r1; r++) {
            attn_keys(&a, r, &lo, &hi);
            if (hi >= lo) w += per_key * (hi - lo + 1);
        }
        cost[it] = w;
    }
    return (int64_t)B * nblk;
}
