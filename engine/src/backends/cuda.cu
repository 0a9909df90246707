/*
 * cuda.cu -- the CUDA backend: the dcs_backend interface of dcs_backend.h
 * on one GPU, with cuBLAS for every matrix product and small kernels for the
 * rest. The model graph (forward.c) is the same for every backend; it calls
 * only the function pointers filled in here.
 *
 * Numerics. Activations are float32 and so is all arithmetic, but for the
 * products of weights kept in 16 bits (dtype= at load, cuda_half.cuh:
 * 16-bit inputs, tensor cores, float32 accumulation):
 *   - float32 GEMMs: cublasSgemmStridedBatched under CUBLAS_DEFAULT_MATH
 *     (true fp32 FMA, no TF32 tensor-op math unless asked for explicitly,
 *     which this file never does).
 *   - The per-element math (gelu, masks, rotary angles, RMS/LayerNorm
 *     scaling, the per-pair compose) is the DCS_HD code of dcs_math.h, the
 *     same functions the CPU backend runs. CMakeLists.txt compiles this file with
 *     --fmad=false so nvcc does not contract a*b+c into FMAs the CPU build
 *     does not form either; only reduction order and libm ulps differ.
 *
 * Execution. One stream per backend; every kernel, memset and device copy is
 * queued on it in order. upload/download wait for their copy (the host
 * buffer is free to reuse when they return). sync() waits for the stream.
 *
 * Errors. Kernels return nothing (dcs_backend.h): the first failing CUDA or
 * cuBLAS call is recorded in the context with its error name, and sync()
 * reports it as DCS_ERR_BACKEND "CUDA: ..." and then clears the record, so a
 * model survives e.g. one out-of-memory batch (sticky device faults fail the
 * next call again and are reported again). alloc returns NULL on failure.
 *
 * No global mutable state: the device ordinal, stream, cuBLAS handle, memory
 * pool, token scratch buffer and error record all live in the backend's
 * context.
 */
#include <cuda_runtime.h>
#include <cublas_v2.h>

/* C headers first, outside the extern "C" block below (in C++ <math.h>
 * pulls in templates, which cannot have C linkage). */
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "dcs_backend.h"
}
#include "dcs_math.h"

/* ------------------------------------------------------------ context */

typedef struct {
    int device; /* CUDA ordinal                               */
    char device_name[256];
    cudaStream_t stream;
    cublasHandle_t blas;
    cudaMemPool_t pool; /* stream-ordered pool, or NULL: cudaMalloc   */
    int32_t *tokens;    /* device scratch for embed's token ids       */
    size_t tokens_cap;  /* in elements                                */
    int new_kernels;    /* DCLENS_CUDA_KERNELS=new: cuda_rows.cuh's
                           warp-per-row kernels and pinned staging     */
    void *pinned;       /* pinned host staging for hooks (new_kernels) */
    size_t pinned_cap;  /* in bytes                                   */
    int failed;         /* an error is recorded in err                */
    char err[900];
} cuda_ctx;

static cuda_ctx *ctx_of(dcs_backend *be) { return (cuda_ctx *)be->ctx; }

/* Record the first failure (later ones are consequences, usually). */
static void record(cuda_ctx *c, const char *fmt, ...) {
    if (c->failed) return;
    c->failed = 1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
}

/* Check a CUDA runtime result; on failure record it and clear the runtime's
 * last-error slot (a failed cudaMalloc would otherwise resurface at the next
 * kernel launch check). */
static bool ck(cuda_ctx *c, cudaError_t r, const char *what) {
    if (r == cudaSuccess) return true;
    record(c, "%s failed on device %d (%s): %s (%s)", what, c->device, c->device_name, cudaGetErrorString(r),
           cudaGetErrorName(r));
    (void)cudaGetLastError();
    return false;
}

static bool ck_blas(cuda_ctx *c, cublasStatus_t s, const char *what) {
    if (s == CUBLAS_STATUS_SUCCESS) return true;
    record(c, "%s failed on device %d (%s): %s (%s)", what, c->device, c->device_name, cublasGetStatusName(s),
           cublasGetStatusString(s));
    return false;
}

/* Make this backend's GPU current for the calling thread (several models on
 * different GPUs may share a thread). */
static cuda_ctx *enter(dcs_backend *be) {
    cuda_ctx *c = ctx_of(be);
    ck(c, cudaSetDevice(c->device), "cudaSetDevice");
    return c;
}

/* After a kernel launch: configuration errors show up here. */
static void launched(cuda_ctx *c, const char *kernel) { ck(c, cudaGetLastError(), kernel); }

/* Grid for an elementwise kernel over n elements with a grid-stride loop. */
static const int EW_THREADS = 256;
static unsigned ew_blocks(size_t n) {
    size_t b = (n + EW_THREADS - 1) / EW_THREADS;
    const size_t cap = 65536; /* enough to fill any GPU; the loop does the rest */
    return (unsigned)(b < cap ? b : cap);
}

#define GRID_STRIDE(i, n)                                                                                    \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                                  \
         i += (size_t)gridDim.x * blockDim.x)

/* ------------------------------------------------------------ reductions */

__device__ static inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* ------------------------------------------------------------ kernels */

/* out [M, D] = table [V, D] rows tokens [M]; one block per row. */
static __global__ void embed_kernel(float *out, const float *table, const int32_t *tokens, int D) {
    size_t m = blockIdx.x;
    const float *src = table + (size_t)tokens[m] * D;
    float *dst = out + m * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = src[i];
}

/* x [M, N] += bias [N] */
static __global__ void add_bias_kernel(float *x, const float *bias, size_t total, int N) {
    GRID_STRIDE(i, total) x[i] += bias[i % N];
}

/* y [n] += x [n] */
static __global__ void add_kernel(float *y, const float *x, size_t n) { GRID_STRIDE(i, n) y[i] += x[i]; }

/* y [n] = a + b + c (y may alias any input) */
static __global__ void gelu_kernel(float *x, size_t n) { GRID_STRIDE(i, n) x[i] = dcs_gelu(x[i]); }

/* a [n] = silu(a) * b [n] */
static __global__ void swiglu_kernel(float *a, const float *b, size_t n) {
    GRID_STRIDE(i, n) a[i] = dcs_swiglu(a[i], b[i]);
}

/* x [n] = tanh(x) */
static __global__ void tanh_kernel(float *x, size_t n) { GRID_STRIDE(i, n) x[i] = tanhf(x[i]); }

/* y [n] *= g [n] */
/* out [M, D] = LayerNorm(in [M, D]) * w [D] + b [D]: one thread per row
 * running dcs_layernorm_row, the CPU backend's arithmetic (statistics in
 * double, index order). out may equal in. */
static __global__ void layernorm_kernel(float *out, const float *in, const float *w, const float *b, int M,
                                        int D, float eps) {
    int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    dcs_layernorm_row(out + (size_t)m * D, in + (size_t)m * D, w, b, D, eps, NULL, NULL);
}

/* x [rows, width] at row stride ld, in place: x / rms(x) * scale [width]
 * (scale NULL: none). One warp per row. */
static __global__ void rmsnorm_kernel(float *x, int rows, int width, int ld, const float *scale, float eps) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return; /* whole warp leaves together */
    float *r = x + (size_t)row * ld;
    float ss = 0.0f;
    for (int i = lane; i < width; i += 32) ss += r[i] * r[i];
    float inv = dcs_rms_inv(warp_sum(ss), width, eps);
    for (int i = lane; i < width; i += 32) {
        float v = r[i] * inv;
        if (scale) v *= scale[i];
        r[i] = v;
    }
}

/* x [M, N, Dh], row m at position t0 + m % T: rotate-half on dims [0, rot) of
 * every head. One thread per (m, j), j < rot/2: it computes cos/sin once
 * (in double, dcs_rotary_cs) and rotates pair (j, j + rot/2) of all N heads. */
static __global__ void rotary_kernel(float *x, int M, int T, int t0, int N, int Dh, int rot, float base) {
    int half = rot / 2;
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)M * half) return;
    int m = (int)(idx / half), j = (int)(idx % half);
    float c, s;
    dcs_rotary_cs(t0 + m % T, j, rot, base, &c, &s);
    float *row = x + (size_t)m * N * Dh;
    for (int n = 0; n < N; n++) dcs_rotate_pair(&row[n * Dh + j], &row[n * Dh + j + half], c, s);
}

/* Compose (model-spec 2 step 6) over [B, N, T, S]: one thread per (b, t, s)
 * pair, mixing that pair's N heads (stride T*S) with dcs_compose_pair.
 * Query-side weights qw1, qw2 [B, T, R, N], qdd [B, T, N]; key side kw1, kw2
 * [B, S, R, N], kdd [B, S, N] (NULL: query_wise). Branch outputs br[0..4]
 * (skip, qp, kp, qg, kg) each NULL or [B, N, T, S]. With causal_only, pairs
 * the mask hides get 0 in out and in every branch. out may equal in. */
static __global__ void compose_kernel(dcs_compose_args a) {
    size_t total = (size_t)a.B * a.T * a.S;
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    dcs_compose_at(&a, (int)(idx / ((size_t)a.S * a.T)), (int)((idx / a.S) % a.T), (int)(idx % a.S));
}

/* MoH routing scores (model-spec 5): one thread per token, dcs_moh_route_row. */
static __global__ void moh_route_kernel(float *g, const float *logits, const float *s1, const float *s0,
                                        int M, int N, int hs, int k) {
    int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    dcs_moh_route_row(logits + (size_t)m * (N - hs), s1 ? s1 + (size_t)m * hs : NULL,
                      s0 ? s0 + (size_t)m * 2 : NULL, N, hs, k, g + (size_t)m * N);
}

/* z [M, N, Dh] *= g [M, N] */
static __global__ void head_gate_kernel(float *z, const float *g, size_t total, int Dh) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) z[i] *= g[i / Dh];
}

/* x [BN, T, S] as BN*T rows of S, row r has query t0 + r % T and keys from
 * kb: one thread per row running dcs_softmax_row (the CPU backend's
 * arithmetic; masked entries exactly 0). */
static __global__ void softmax_masked_kernel(float *x, size_t rows, int T, int S, int t0, int kb,
                                             int window) {
    size_t row = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    dcs_softmax_row(x + row * S, S, t0 + (int)(row % T), kb, window);
}

#include "cuda_rows.cuh" /* the warp-per-row kernels (DCLENS_CUDA_KERNELS=new) */

/* ------------------------------------------------------------ memory */

/* The graph allocates and frees its activations layer by layer, so
 * allocation must be cheap and must not stall the GPU: memory comes from a
 * stream-ordered pool owned by this backend (cudaMallocFromPoolAsync /
 * cudaFreeAsync on the backend's stream) that keeps freed blocks for reuse.
 * On out-of-memory the pool's cached blocks are returned to the driver and
 * the allocation is tried once more. Devices without memory pools use
 * cudaMalloc / cudaFree. */
static cudaError_t raw_alloc(cuda_ctx *c, void **p, size_t n) {
    if (!c->pool) return cudaMalloc(p, n);
    cudaError_t r = cudaMallocFromPoolAsync(p, n, c->pool, c->stream);
    if (r != cudaErrorMemoryAllocation) return r;
    (void)cudaGetLastError();
    cudaStreamSynchronize(c->stream); /* pending frees land in the pool */
    cudaMemPoolTrimTo(c->pool, 0);
    (void)cudaGetLastError();
    return cudaMallocFromPoolAsync(p, n, c->pool, c->stream);
}

static void *cu_alloc(dcs_backend *be, size_t bytes) {
    cuda_ctx *c = enter(be);
    void *p = NULL;
    size_t n = bytes ? bytes : 1; /* a distinct non-NULL pointer for 0 bytes */
    cudaError_t r = raw_alloc(c, &p, n);
    if (r != cudaSuccess) {
        (void)cudaGetLastError();
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        (void)cudaGetLastError();
        record(c,
               "allocating %zu bytes (%.3f GiB) failed on device %d (%s): %s "
               "(%.3f GiB free of %.3f GiB; a smaller batch or sequence, fewer hooks captured, or 16-bit "
               "weights (load's dtype='bfloat16') need less)",
               bytes, bytes / 1073741824.0, c->device, c->device_name, cudaGetErrorString(r),
               fr / 1073741824.0, tot / 1073741824.0);
        return NULL;
    }
    if (!ck(c, cudaMemsetAsync(p, 0, n, c->stream), "cudaMemsetAsync")) {
        if (c->pool)
            cudaFreeAsync(p, c->stream);
        else
            cudaFree(p);
        return NULL;
    }
    return p;
}

static void cu_free(dcs_backend *be, void *p) {
    if (!p) return;
    cuda_ctx *c = enter(be);
    if (c->pool)
        ck(c, cudaFreeAsync(p, c->stream), "cudaFreeAsync");
    else
        ck(c, cudaFree(p), "cudaFree");
}

static void cu_upload(dcs_backend *be, void *dst, const void *src_host, size_t bytes) {
    if (!bytes) return;
    cuda_ctx *c = enter(be);
    if (ck(c, cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, c->stream),
           "cudaMemcpyAsync host->device"))
        ck(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize after upload");
}

static void cu_download(dcs_backend *be, void *dst_host, const void *src, size_t bytes) {
    if (!bytes) return;
    cuda_ctx *c = enter(be);
    if (ck(c, cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, c->stream),
           "cudaMemcpyAsync device->host"))
        ck(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize after download");
}

static void cu_copy(dcs_backend *be, void *dst, const void *src, size_t bytes) {
    if (!bytes || dst == src) return;
    cuda_ctx *c = enter(be);
    ck(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream),
       "cudaMemcpyAsync device->device");
}

static dcs_status cu_sync(dcs_backend *be, dcs_err *e) {
    cuda_ctx *c = enter(be);
    ck(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize");
    ck(c, cudaGetLastError(), "CUDA");
    if (!c->failed) return DCS_OK;
    dcs_status st = dcs_seterr(e, DCS_ERR_BACKEND, "CUDA: %s", c->err);
    c->failed = 0;
    c->err[0] = '\0';
    return st;
}

static void cu_destroy(dcs_backend *be) {
    if (!be) return;
    cuda_ctx *c = ctx_of(be);
    if (c) {
        cudaSetDevice(c->device);
        if (c->stream) cudaStreamSynchronize(c->stream);
        if (c->tokens) cudaFree(c->tokens);
        if (c->pinned) cudaFreeHost(c->pinned);
        /* released now, or by the driver once the last block is freed */
        if (c->pool) cudaMemPoolDestroy(c->pool);
        if (c->blas) cublasDestroy(c->blas);
        if (c->stream) cudaStreamDestroy(c->stream);
        (void)cudaGetLastError();
        free(c);
    }
    free(be);
}

/* ------------------------------------------------------------ gemm */

/* Row-major C [M, N] = alpha op(A) [M, K] op(B) [K, N] + beta C, batched.
 * cuBLAS is column-major, and a row-major X with leading dim ld is the
 * column-major X^T with the same ld. So compute C^T = op(B)^T op(A)^T:
 * operands swapped, each keeps its own transpose flag, dims (N, M, K). */
static void cu_gemm(dcs_backend *be, int transA, int transB, int M, int N, int K, float alpha, const float *A,
                    int lda, long long strideA, const float *B, int ldb, long long strideB, float beta,
                    float *C, int ldc, long long strideC, int batch) {
    if (M <= 0 || N <= 0 || batch <= 0) return;
    cuda_ctx *c = enter(be);
    cublasOperation_t opA = transA ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t opB = transB ? CUBLAS_OP_T : CUBLAS_OP_N;
    ck_blas(c,
            cublasSgemmStridedBatched(c->blas, opB, opA, N, M, K, &alpha, B, ldb, strideB, A, lda, strideA,
                                      &beta, C, ldc, strideC, batch),
            "cublasSgemmStridedBatched");
}

/* ------------------------------------------------------------ row / elementwise */

/* The token ids [M] copied to the device scratch buffer (NULL on failure,
 * recorded). From pageable memory: returns once the ids are staged, so the
 * caller may reuse tokens_host; the stream orders the kernel after the copy. */
static const int32_t *stage_tokens(cuda_ctx *c, const int32_t *tokens_host, int M) {
    if ((size_t)M > c->tokens_cap) {
        if (c->tokens) ck(c, cudaFree(c->tokens), "cudaFree");
        c->tokens = NULL;
        c->tokens_cap = 0;
        if (!ck(c, cudaMalloc((void **)&c->tokens, (size_t)M * sizeof(int32_t)), "cudaMalloc (token ids)"))
            return NULL;
        c->tokens_cap = (size_t)M;
    }
    if (!ck(c,
            cudaMemcpyAsync(c->tokens, tokens_host, (size_t)M * sizeof(int32_t), cudaMemcpyHostToDevice,
                            c->stream),
            "cudaMemcpyAsync (token ids)"))
        return NULL;
    return c->tokens;
}

static void cu_embed(dcs_backend *be, float *out, const float *table, const int32_t *tokens_host, int M,
                     int D) {
    if (M <= 0 || D <= 0) return;
    cuda_ctx *c = enter(be);
    const int32_t *tok = stage_tokens(c, tokens_host, M);
    if (!tok) return;
    embed_kernel<<<M, 256, 0, c->stream>>>(out, table, tok, D);
    launched(c, "embed_kernel");
}

static void cu_add_bias(dcs_backend *be, float *x, const float *bias, int M, int N) {
    size_t total = (size_t)(M > 0 ? M : 0) * (size_t)(N > 0 ? N : 0);
    if (!total) return;
    cuda_ctx *c = enter(be);
    add_bias_kernel<<<ew_blocks(total), EW_THREADS, 0, c->stream>>>(x, bias, total, N);
    launched(c, "add_bias_kernel");
}

static void cu_add(dcs_backend *be, float *y, const float *x, size_t n) {
    if (!n) return;
    cuda_ctx *c = enter(be);
    add_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>(y, x, n);
    launched(c, "add_kernel");
}

static void cu_gelu(dcs_backend *be, float *x, size_t n) {
    if (!n) return;
    cuda_ctx *c = enter(be);
    gelu_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>(x, n);
    launched(c, "gelu_kernel");
}

/* The MLP's bias and GELU: one kernel with DCLENS_CUDA_KERNELS=new, else
 * add_bias, a copy when y is not x, and gelu (what the pass does without
 * the op) */
static void cu_bias_gelu(dcs_backend *be, float *y, float *x, const float *b, int M, int N) {
    const size_t total = (size_t)M * N;
    if (!total) return;
    cuda_ctx *c = enter(be);
    if (c->new_kernels) {
        bias_gelu_kernel<<<ew_blocks(total), EW_THREADS, 0, c->stream>>>(y, x, b, total, N);
        launched(c, "bias_gelu_kernel");
        return;
    }
    if (b) cu_add_bias(be, x, b, M, N);
    if (y != x) cu_copy(be, y, x, total * sizeof(float));
    cu_gelu(be, y, total);
}

static void cu_swiglu(dcs_backend *be, float *x, const float *b, size_t n) {
    if (!n) return;
    cuda_ctx *c = enter(be);
    swiglu_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>(x, b, n);
    launched(c, "swiglu_kernel");
}

static void cu_tanh(dcs_backend *be, float *x, size_t n) {
    if (!n) return;
    cuda_ctx *c = enter(be);
    tanh_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>(x, n);
    launched(c, "tanh_kernel");
}

static void cu_layernorm(dcs_backend *be, float *out, const float *in, const float *w, const float *b, int M,
                         int D, float eps) {
    if (M <= 0 || D <= 0) return;
    cuda_ctx *c = enter(be);
    if (c->new_kernels) {
        layernorm_warp_kernel<<<row_blocks((size_t)M), 32 * ROW_WARPS, 0, c->stream>>>(out, in, w, b, M, D,
                                                                                       eps);
        launched(c, "layernorm_warp_kernel");
        return;
    }
    layernorm_kernel<<<(unsigned)((M + 127) / 128), 128, 0, c->stream>>>(out, in, w, b, M, D, eps);
    launched(c, "layernorm_kernel");
}

static void cu_rmsnorm(dcs_backend *be, float *x, int rows, int width, int ld, const float *scale,
                       float eps) {
    if (rows <= 0 || width <= 0) return;
    cuda_ctx *c = enter(be);
    const int warps = 8;
    unsigned blocks = (unsigned)((rows + warps - 1) / warps);
    rmsnorm_kernel<<<blocks, warps * 32, 0, c->stream>>>(x, rows, width, ld, scale, eps);
    launched(c, "rmsnorm_kernel");
}

static void cu_rotary(dcs_backend *be, float *x, int M, int T, int t0, int N, int Dh, int rot, float base) {
    if (M <= 0 || rot < 2 || N <= 0 || T <= 0) return;
    cuda_ctx *c = enter(be);
    size_t total = (size_t)M * (rot / 2);
    unsigned blocks = (unsigned)((total + 255) / 256);
    rotary_kernel<<<blocks, 256, 0, c->stream>>>(x, M, T, t0, N, Dh, rot, base);
    launched(c, "rotary_kernel");
}

static void cu_copy2d(dcs_backend *be, float *dst, int ld_dst, const float *src, int ld_src, int rows,
                      int cols) {
    if (rows <= 0 || cols <= 0) return;
    cuda_ctx *c = enter(be);
    ck(c,
       cudaMemcpy2DAsync(dst, (size_t)ld_dst * sizeof(float), src, (size_t)ld_src * sizeof(float),
                         (size_t)cols * sizeof(float), (size_t)rows, cudaMemcpyDeviceToDevice, c->stream),
       "cudaMemcpy2DAsync");
}

static void cu_compose(dcs_backend *be, const dcs_compose_args *a) {
    size_t total = (size_t)a->B * a->T * a->S;
    if (a->B <= 0 || a->T <= 0 || a->S <= 0 || a->N <= 0) return;
    cuda_ctx *c = enter(be);
    if (a->R < 0 || a->R > DCS_MAX_R) {
        record(c, "compose: dynamic rank R = %d outside [0, %d]", a->R, DCS_MAX_R);
        return;
    }
    unsigned blocks = (unsigned)((total + 127) / 128);
    compose_kernel<<<blocks, 128, 0, c->stream>>>(*a);
    launched(c, "compose_kernel");
}

static void cu_moh_route(dcs_backend *be, float *g, const float *logits, const float *s1, const float *s0,
                         int M, int N, int hs, int k) {
    if (M <= 0) return;
    cuda_ctx *c = enter(be);
    moh_route_kernel<<<(unsigned)((M + 127) / 128), 128, 0, c->stream>>>(g, logits, s1, s0, M, N, hs, k);
    launched(c, "moh_route_kernel");
}

static void cu_head_gate(dcs_backend *be, float *z, const float *g, int M, int N, int Dh) {
    size_t total = (size_t)M * N * Dh;
    if (!total) return;
    cuda_ctx *c = enter(be);
    head_gate_kernel<<<ew_blocks(total), EW_THREADS, 0, c->stream>>>(z, g, total, Dh);
    launched(c, "head_gate_kernel");
}

static void cu_softmax_masked(dcs_backend *be, float *x, int BN, int T, int S, int t0, int kb, int window) {
    if (BN <= 0 || T <= 0 || S <= 0) return;
    cuda_ctx *c = enter(be);
    size_t rows = (size_t)BN * T;
    if (c->new_kernels) {
        softmax_warp_kernel<<<row_blocks(rows), 32 * ROW_WARPS, 0, c->stream>>>(x, rows, T, S, t0, kb,
                                                                                window);
        launched(c, "softmax_warp_kernel");
        return;
    }
    softmax_masked_kernel<<<(unsigned)((rows + 127) / 128), 128, 0, c->stream>>>(x, rows, T, S, t0, kb,
                                                                                 window);
    launched(c, "softmax_masked_kernel");
}

/* Pinned host memory of at least `bytes` for the graph's hook staging
 * (dcs_backend.h host_staging), grown as asked and kept; NULL (the graph then
 * uses its own malloc'd buffer) without DCLENS_CUDA_KERNELS=new or when
 * pinned memory cannot be had. */
static void *cu_host_staging(dcs_backend *be, size_t bytes) {
    cuda_ctx *c = enter(be);
    if (!c->new_kernels) return NULL;
    if (bytes <= c->pinned_cap) return c->pinned;
    if (c->pinned) {
        ck(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize (staging)");
        cudaFreeHost(c->pinned);
    }
    c->pinned = NULL;
    c->pinned_cap = 0;
    if (cudaMallocHost(&c->pinned, bytes) != cudaSuccess) {
        (void)cudaGetLastError(); /* not an error of the pass: the graph falls back */
        c->pinned = NULL;
        return NULL;
    }
    c->pinned_cap = bytes;
    return c->pinned;
}

/* ------------------------------------------------------------ 16-bit weights */

#include "cuda_half.cuh"

/* ------------------------------------------------------------ backward */

#include "cuda_backward.cuh"

/* ------------------------------------------------------------ memory plan */

/* Free and total device memory: the driver's free bytes plus what this
 * backend's pool holds reserved but unused (freed blocks it keeps for
 * reuse: cudaMemPoolAttrReleaseThreshold is UINT64_MAX), which the next
 * allocations take first. Pending frees are waited for so they count.
 * 0 on success; on failure the error is recorded (sync reports it) and 1
 * is returned, the caller falling back to the host's memory. */
static int cu_mem_info(dcs_backend *be, uint64_t *free_bytes, uint64_t *total_bytes) {
    cuda_ctx *c = enter(be);
    if (c->failed) return 1; /* cudaSetDevice (every call's sync reports and clears the record) */
    if (!ck(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize (memory info)")) return 1;
    size_t fr = 0, tot = 0;
    if (!ck(c, cudaMemGetInfo(&fr, &tot), "cudaMemGetInfo")) return 1;
    uint64_t cached = 0;
    if (c->pool) {
        uint64_t reserved = 0, used = 0; /* the attributes' type, cuuint64_t */
        if (!ck(c, cudaMemPoolGetAttribute(c->pool, cudaMemPoolAttrReservedMemCurrent, &reserved),
                "cudaMemPoolGetAttribute (reserved)") ||
            !ck(c, cudaMemPoolGetAttribute(c->pool, cudaMemPoolAttrUsedMemCurrent, &used),
                "cudaMemPoolGetAttribute (used)"))
            return 1;
        cached = reserved > used ? reserved - used : 0;
    }
    if (free_bytes) *free_bytes = (uint64_t)fr + cached;
    if (total_bytes) *total_bytes = (uint64_t)tot;
    return 0;
}

/* ------------------------------------------------------------ public */

static int cu_probe(char *why, size_t whylen) {
    int n = 0;
    cudaError_t r = cudaGetDeviceCount(&n);
    if (r != cudaSuccess) {
        (void)cudaGetLastError();
        if (why && whylen) snprintf(why, whylen, "no CUDA device: %s", cudaGetErrorString(r));
        return 0;
    }
    if (n <= 0) {
        if (why && whylen) snprintf(why, whylen, "no CUDA device: cudaGetDeviceCount found 0 devices");
        return 0;
    }
    if (why && whylen) why[0] = '\0';
    return 1;
}

static const dcs_backend_ops cuda_ops = {
    .name = "cuda",
    .alloc = cu_alloc,
    .free = cu_free,
    .upload = cu_upload,
    .download = cu_download,
    .copy = cu_copy,
    .sync = cu_sync,
    .destroy = cu_destroy,
    .gemm = cu_gemm,
    .embed = cu_embed,
    .add_bias = cu_add_bias,
    .add = cu_add,
    .gelu = cu_gelu,
    .bias_gelu = cu_bias_gelu,
    .tanh_ = cu_tanh,
    .layernorm = cu_layernorm,
    .rmsnorm = cu_rmsnorm,
    .rotary = cu_rotary,
    .copy2d = cu_copy2d,
    .compose = cu_compose,
    .softmax_masked = cu_softmax_masked,
    /* 16-bit weights (cuda_half.cuh); no fused attention: the graph runs
     * the full path */
    .gemm_w = cu_gemm_w,
    .embed_w = cu_embed_w,
    .gemm_x = cu_gemm_x,
    .widen = cu_widen,
    .attention = NULL,
    .moh_route = cu_moh_route,
    .head_gate = cu_head_gate,
    .parallel = NULL, /* no host threads */
    .swiglu = cu_swiglu,
    .zero = cu_zero,
    .gelu_bw = cu_gelu_bw,
    .tanh_bw = cu_tanh_bw,
    .softmax_bw = cu_softmax_bw,
    .softmax_rows_bw = cu_softmax_rows_bw,
    .layernorm_bw = cu_layernorm_bw,
    .rmsnorm_bw = cu_rmsnorm_bw,
    .norm_bw_fanout = cu_norm_bw_fanout,
    .rotary_bw = cu_rotary_bw,
    .col_sum = cu_col_sum,
    .embed_bw = cu_embed_bw,
    .xent_bw = cu_xent_bw,
    .compose_bw = cu_compose_bw,
    .compose_softmax_bw = NULL, /* the tape runs the three */
    .attention_bw = NULL,       /* the tape runs the per-head products */
    .head_gate_bw = cu_head_gate_bw,
    .moh_route_bw = cu_moh_route_bw,
    .swiglu_bw = cu_swiglu_bw,
    .bw_scratch = cu_bw_scratch,
    .mem_info = cu_mem_info,
    .host_staging = cu_host_staging,
};

static dcs_backend *cu_create(int device, dcs_err *e) {
    int n = 0;
    cudaError_t r = cudaGetDeviceCount(&n);
    if (r != cudaSuccess || n <= 0) {
        (void)cudaGetLastError();
        dcs_seterr(e, DCS_ERR_UNSUPPORTED, "CUDA: no CUDA device: %s",
                   r != cudaSuccess ? cudaGetErrorString(r) : "cudaGetDeviceCount found 0 devices");
        return NULL;
    }
    if (device < 0 || device >= n) {
        dcs_seterr(e, DCS_ERR_ARG, "CUDA: device %d does not exist (%d device%s: 0..%d)", device, n,
                   n == 1 ? "" : "s", n - 1);
        return NULL;
    }
    dcs_backend *be = (dcs_backend *)calloc(1, sizeof *be);
    cuda_ctx *c = (cuda_ctx *)calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        dcs_seterr(e, DCS_ERR_NOMEM, "CUDA: out of host memory creating the backend");
        return NULL;
    }
    c->device = device;
    const char *kernels = getenv("DCLENS_CUDA_KERNELS"); /* read once, kept in the context */
    c->new_kernels = kernels && strcmp(kernels, "new") == 0;
    be->ops = &cuda_ops;
    be->ctx = c;

    cudaDeviceProp prop;
    if (ck(c, cudaSetDevice(device), "cudaSetDevice") &&
        ck(c, cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties")) {
        snprintf(c->device_name, sizeof c->device_name, "%.200s, sm_%d%d", prop.name, prop.major, prop.minor);
        if (ck(c, cudaStreamCreate(&c->stream), "cudaStreamCreate") &&
            ck_blas(c, cublasCreate(&c->blas), "cublasCreate") &&
            ck_blas(c, cublasSetStream(c->blas, c->stream), "cublasSetStream"))
            /* true fp32: no TF32 tensor-op math */
            ck_blas(c, cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
        int pools = 0;
        cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device);
        (void)cudaGetLastError();
        if (!c->failed && pools) {
            cudaMemPoolProps props;
            memset(&props, 0, sizeof props);
            props.allocType = cudaMemAllocationTypePinned;
            props.location.type = cudaMemLocationTypeDevice;
            props.location.id = device;
            uint64_t keep = UINT64_MAX; /* keep freed blocks cached */
            if (ck(c, cudaMemPoolCreate(&c->pool, &props), "cudaMemPoolCreate"))
                ck(c, cudaMemPoolSetAttribute(c->pool, cudaMemPoolAttrReleaseThreshold, &keep),
                   "cudaMemPoolSetAttribute");
        }
    }
    if (c->failed) {
        dcs_seterr(e, DCS_ERR_BACKEND, "CUDA: %s", c->err);
        cu_destroy(be);
        return NULL;
    }

    return be;
}

/* The plugin's one exported symbol (dcs_backend.h, "CUDA plugin"): the
 * loader in cuda_plugin.c finds it with dlsym. Everything else in this
 * library is hidden. */
extern "C" __attribute__((visibility("default"))) const dcs_cuda_plugin *dcs_cuda_plugin_v1(void) {
    static const dcs_cuda_plugin plugin = {
        DCS_CUDA_PLUGIN_ABI,
        sizeof(dcs_backend_ops),
        sizeof(dcs_compose_args) + sizeof(dcs_attn_args) + sizeof(dcs_compose_bw_args) + sizeof(dcs_bw_shape),
        cu_create,
        cu_probe,
    };
    return &plugin;
}
