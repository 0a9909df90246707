/*
 * cuda_half.cuh -- the CUDA backend's 16-bit weights (included by cuda.cu):
 * weight matrices kept on the device in F16 or BF16 (dcs_load_options.dtype)
 * and read through gemm_w, embed_w and widen (dcs_backend.h).
 *
 * gemm_w rounds the float32 activations A [M, K] to the weight's type (to
 * nearest even, into a stream-ordered scratch buffer) and runs one
 * cublasGemmEx with 16-bit inputs, float32 output and CUBLAS_COMPUTE_32F:
 * tensor cores, float32 accumulation. What the hooks and the analyses read
 * stays float32; only the products' inputs are 16-bit.
 *
 * gemm_x does the same for a product of two activations (the attention
 * scores, P v and their backward, for a model whose weights are kept in 16
 * bits): both operands' spans rounded, one cublasGemmStridedBatchedEx.
 */

#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ static inline float half_to_f32(uint16_t u, int dtype) {
    return dtype == DCS_F16 ? __half2float(__ushort_as_half(u)) : __uint_as_float((uint32_t)u << 16);
}

__device__ static inline uint16_t f32_to_half(float x, int dtype) {
    return dtype == DCS_F16 ? __half_as_ushort(__float2half_rn(x))
                            : __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

/* out [n] = src [n] widened */
static __global__ void widen16_kernel(float *out, const uint16_t *src, size_t n, int dtype) {
    GRID_STRIDE(i, n) out[i] = half_to_f32(src[i], dtype);
}

/* out [M, K] (contiguous) = A [M, K] (row stride lda) rounded to dtype */
static __global__ void narrow_rows_kernel(uint16_t *out, const float *A, int M, int K, int lda, int dtype) {
    const size_t n = (size_t)M * K;
    GRID_STRIDE(i, n) out[i] = f32_to_half(A[(i / K) * (size_t)lda + i % K], dtype);
}

/* out [M, D] = table [V, D] (16-bit) rows tokens [M], widened; a block per row */
static __global__ void embed16_kernel(float *out, const uint16_t *table, const int32_t *tokens, int D,
                                      int dtype) {
    size_t m = blockIdx.x;
    const uint16_t *src = table + (size_t)tokens[m] * D;
    float *dst = out + m * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = half_to_f32(src[i], dtype);
}

static void cu_widen(dcs_backend *be, float *out, dcs_wmat src, size_t n) {
    if (!n) return;
    if (src.dtype == DCS_F32) {
        cu_copy(be, out, src.p, n * sizeof(float));
        return;
    }
    cuda_ctx *c = enter(be);
    widen16_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>(out, (const uint16_t *)src.p, n, src.dtype);
    launched(c, "widen16_kernel");
}

/* C [M, N] = A [M, K] op(W) + beta C; W [N, K] when transW (a torch Linear),
 * else [K, N]. Row-major as cu_gemm maps it: C^T = op(W)^T A^T, where the
 * stored W seen column-major is W^T, so transW takes CUBLAS_OP_T (ld K) and
 * the other case CUBLAS_OP_N (ld N). */
static void cu_gemm_w(dcs_backend *be, int transW, int M, int N, int K, const float *A, int lda, dcs_wmat W,
                      float beta, float *C, int ldc) {
    if (M <= 0 || N <= 0) return;
    if (W.dtype == DCS_F32) {
        cu_gemm(be, 0, transW, M, N, K, 1.0f, A, lda, 0, (const float *)W.p, transW ? K : N, 0, beta, C, ldc,
                0, 1);
        return;
    }
    cuda_ctx *c = enter(be);
    void *a16 = NULL;
    const size_t n = (size_t)M * (size_t)K;
    if (!ck(c, raw_alloc(c, &a16, n * 2 + 16), "allocating gemm_w's 16-bit activations")) return;
    narrow_rows_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>((uint16_t *)a16, A, M, K, lda, W.dtype);
    launched(c, "narrow_rows_kernel");
    const cudaDataType t = W.dtype == DCS_F16 ? CUDA_R_16F : CUDA_R_16BF;
    const float alpha = 1.0f;
    ck_blas(c,
            cublasGemmEx(c->blas, transW ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &alpha, W.p, t,
                         transW ? K : N, a16, t, K, &beta, C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            "cublasGemmEx (16-bit weights)");
    cu_free(be, a16);
}

static void cu_embed_w(dcs_backend *be, float *out, dcs_wmat table, const int32_t *tokens_host, int M,
                       int D) {
    if (M <= 0 || D <= 0) return;
    if (table.dtype == DCS_F32) {
        cu_embed(be, out, (const float *)table.p, tokens_host, M, D);
        return;
    }
    cuda_ctx *c = enter(be);
    const int32_t *tok = stage_tokens(c, tokens_host, M);
    if (!tok) return;
    embed16_kernel<<<M, 256, 0, c->stream>>>(out, (const uint16_t *)table.p, tok, D, table.dtype);
    launched(c, "embed16_kernel");
}

/* out [n] = in [n] rounded to dtype */
static __global__ void narrow_kernel(uint16_t *out, const float *in, size_t n, int dtype) {
    GRID_STRIDE(i, n) out[i] = f32_to_half(in[i], dtype);
}

/* Elements from X to the last one a strided batch reads: `rows` rows of
 * `cols` at row stride ld, `batch` matrices stride apart. */
static size_t batch_span(int rows, int cols, int ld, long long stride, int batch) {
    size_t one = (size_t)(rows - 1) * (size_t)ld + (size_t)cols;
    return batch > 1 && stride > 0 ? (size_t)(batch - 1) * (size_t)stride + one : one;
}

/* X's span rounded to dtype in a new stream-ordered buffer (same offsets), or
 * NULL (recorded). */
static uint16_t *narrowed_span(cuda_ctx *c, const float *X, size_t n, int dtype) {
    void *h = NULL;
    if (!ck(c, raw_alloc(c, &h, n * 2 + 16), "allocating gemm_x's 16-bit operand")) return NULL;
    narrow_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>((uint16_t *)h, X, n, dtype);
    launched(c, "narrow_kernel");
    return (uint16_t *)h;
}

/* gemm (cu_gemm's row-major mapping) with A and B rounded to dtype */
static void cu_gemm_x(dcs_backend *be, int dtype, int transA, int transB, int M, int N, int K, float alpha,
                      const float *A, int lda, long long strideA, const float *B, int ldb, long long strideB,
                      float beta, float *C, int ldc, long long strideC, int batch) {
    if (M <= 0 || N <= 0 || batch <= 0) return;
    if (dtype != DCS_F16 && dtype != DCS_BF16) {
        cu_gemm(be, transA, transB, M, N, K, alpha, A, lda, strideA, B, ldb, strideB, beta, C, ldc, strideC,
                batch);
        return;
    }
    cuda_ctx *c = enter(be);
    const size_t nA = batch_span(transA ? K : M, transA ? M : K, lda, strideA, batch);
    const size_t nB = batch_span(transB ? N : K, transB ? K : N, ldb, strideB, batch);
    uint16_t *a16 = narrowed_span(c, A, nA, dtype), *b16 = a16 ? narrowed_span(c, B, nB, dtype) : NULL;
    if (a16 && b16) {
        const cudaDataType t = dtype == DCS_F16 ? CUDA_R_16F : CUDA_R_16BF;
        ck_blas(c,
                cublasGemmStridedBatchedEx(c->blas, transB ? CUBLAS_OP_T : CUBLAS_OP_N,
                                           transA ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, b16, t, ldb,
                                           strideB, a16, t, lda, strideA, &beta, C, CUDA_R_32F, ldc, strideC,
                                           batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "cublasGemmStridedBatchedEx (16-bit activations)");
    }
    cu_free(be, a16); /* NULL: nothing */
    cu_free(be, b16);
}
