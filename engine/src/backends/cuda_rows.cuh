/*
 * cuda_rows.cuh -- warp-per-row kernels (included by cuda.cu): LayerNorm
 * forward and backward and the masked softmax forward and backward, one
 * warp of 32 lanes per row instead of one thread per row. The arithmetic is
 * dcs_math.h's (LayerNorm statistics in double, the masked span, dcs_exp);
 * only the order of the sums differs (lane-strided, then a butterfly), so
 * they agree with the CPU to float32 rounding, not bit for bit.
 *
 * Also here: the norm backward of the split inputs (a warp per (row,
 * reader)) and the MLP's bias + GELU in one pass (the CPU's bias_gelu).
 *
 * They run when the backend was created with DCLENS_CUDA_KERNELS=new
 * (cuda_ctx.new_kernels) until a run on a GPU has passed them
 * (scripts/gpu_check.sh runs the CUDA tests both ways); the one-thread-per-row
 * kernels stay the default.
 */

#define ROW_WARPS 8 /* warps (rows) per block */

__device__ static inline double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ static inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

static unsigned row_blocks(size_t rows) { return (unsigned)((rows + ROW_WARPS - 1) / ROW_WARPS); }

/* The row's mean (double) and 1/std, as dcs_layernorm_stats computes them. */
__device__ static inline float ln_stats_warp(const float *x, int D, float eps, int lane, double *mean) {
    double s = 0;
    for (int i = lane; i < D; i += 32) s += x[i];
    const double mu = warp_sum_d(s) / D;
    double v = 0;
    for (int i = lane; i < D; i += 32) v += (x[i] - mu) * (x[i] - mu);
    v = warp_sum_d(v) / D;
    *mean = mu;
    return (float)(1.0 / sqrt(v + eps));
}

/* out [M, D] = LayerNorm(in) * w + b (w, b may be NULL); out may equal in */
static __global__ void layernorm_warp_kernel(float *out, const float *in, const float *w, const float *b,
                                             int M, int D, float eps) {
    const int row = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= M) return; /* the whole warp */
    const float *x = in + (size_t)row * D;
    float *y = out + (size_t)row * D;
    double mu;
    const float inv = ln_stats_warp(x, D, eps, lane, &mu);
    for (int i = lane; i < D; i += 32)
        y[i] = ((float)(x[i] - mu) * inv) * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
}

/* dx [M, D] += the LayerNorm backward of each row (dcs_layernorm_row_bw);
 * the row's (mu, rs) into st [M, 2] for the column sums */
static __global__ void layernorm_bw_warp_kernel(float *dx, float *st, const float *dy, const float *x,
                                                const float *w, int M, int D, float eps) {
    const int row = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= M) return;
    const size_t o = (size_t)row * D;
    double mud;
    const float rs = ln_stats_warp(x + o, D, eps, lane, &mud), mu = (float)mud;
    double s1 = 0, s2 = 0;
    for (int i = lane; i < D; i += 32) {
        const float xh = (x[o + i] - mu) * rs, gw = dy[o + i] * w[i];
        s1 += gw;
        s2 += gw * xh;
    }
    const float m1 = (float)(warp_sum_d(s1) / D), m2 = (float)(warp_sum_d(s2) / D);
    for (int i = lane; i < D; i += 32) {
        const float xh = (x[o + i] - mu) * rs;
        dx[o + i] += (dy[o + i] * w[i] - m1 - xh * m2) * rs;
    }
    if (lane == 0) {
        st[2 * (size_t)row] = mu;
        st[2 * (size_t)row + 1] = rs;
    }
}

/* The allowed keys of query position t over keys kb .. kb+S-1 as row
 * indices [j0, j1] (empty when j1 < j0), as dcs_softmax_row finds them. */
__device__ static inline void allowed_span(int t, int kb, int S, int window, int *j0, int *j1) {
    long long lo = window > 0 ? (long long)t - window : 0, hi = t;
    if (lo < kb) lo = kb;
    if (hi > (long long)kb + S - 1) hi = (long long)kb + S - 1;
    *j0 = (int)(lo - kb);
    *j1 = hi < lo ? *j0 - 1 : (int)(hi - kb);
}

/* x [BN*T, S] rows, row r at query t0 + r % T: masked softmax in place */
static __global__ void softmax_warp_kernel(float *x, size_t rows, int T, int S, int t0, int kb, int window) {
    const size_t row = (size_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float *r = x + row * S;
    int j0, j1;
    allowed_span(t0 + (int)(row % T), kb, S, window, &j0, &j1);
    float mx = -INFINITY;
    for (int j = j0 + lane; j <= j1; j += 32) mx = fmaxf(mx, r[j]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int j = j0 + lane; j <= j1; j += 32) {
        const float e = dcs_exp(r[j] - mx);
        r[j] = e;
        sum += e;
    }
    sum = warp_sum(sum);
    const float inv = 1.0f / sum;
    __syncwarp(); /* the exponentials other lanes wrote (their j0-relative indices) are read below */
    for (int j = lane; j < S; j += 32) r[j] = j >= j0 && j <= j1 ? r[j] * inv : 0.0f;
}

/* dA = the masked softmax backward of rows P, dP ([BN*T, S], query t = r % T,
 * keys from 0), as dcs_softmax_row_bw; dA may equal dP */
static __global__ void softmax_bw_warp_kernel(float *dA, const float *dP, const float *P, size_t rows, int T,
                                              int S, int window) {
    const size_t row = (size_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const size_t o = row * (size_t)S;
    const int t = (int)(row % T);
    float dot = 0.0f;
    for (int s = lane; s < S; s += 32)
        if (dcs_allowed(t, s, window)) dot += P[o + s] * dP[o + s];
    dot = warp_sum(dot);
    for (int s = lane; s < S; s += 32)
        dA[o + s] = dcs_allowed(t, s, window) ? P[o + s] * (dP[o + s] - dot) : 0.0f;
}

/* norm_bw_fanout with a warp per (row, reader): dx [M, G, D] written (not
 * added) from dy [M, G, D] and the row x [M, D]; rms: RMS norm (its sum of
 * squares in float, as dcs_rms_row_inv), else LayerNorm */
static __global__ void norm_bw_fanout_warp_kernel(float *dx, const float *dy, const float *x, const float *w,
                                                  size_t rows, int G, int D, float eps, int rms) {
    const size_t r = (size_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const float *xr = x + (r / G) * D, *g = dy + r * D;
    float *o = dx + r * D;
    if (rms) {
        float ss = 0.0f;
        for (int i = lane; i < D; i += 32) ss += xr[i] * xr[i];
        const float rs = dcs_rms_inv(warp_sum(ss), D, eps);
        float dot = 0.0f;
        for (int i = lane; i < D; i += 32) dot += dcs_rmsnorm_dot_term(g[i], w ? w[i] : 1.0f, xr[i], rs);
        dot = warp_sum(dot) / (float)D;
        for (int i = lane; i < D; i += 32) o[i] = dcs_rmsnorm_dx(g[i], w ? w[i] : 1.0f, xr[i], rs, dot);
        return;
    }
    double mud;
    const float rs = ln_stats_warp(xr, D, eps, lane, &mud), mu = (float)mud;
    double s1 = 0, s2 = 0;
    for (int i = lane; i < D; i += 32) {
        const float xh = (xr[i] - mu) * rs, gw = g[i] * w[i];
        s1 += gw;
        s2 += gw * xh;
    }
    const float m1 = (float)(warp_sum_d(s1) / D), m2 = (float)(warp_sum_d(s2) / D);
    for (int i = lane; i < D; i += 32) {
        const float xh = (xr[i] - mu) * rs;
        o[i] = (g[i] * w[i] - m1 - xh * m2) * rs;
    }
}

/* x [M, N] += b [N] (b may be NULL), y = gelu(x) (y may be x), one pass */
static __global__ void bias_gelu_kernel(float *y, float *x, const float *b, size_t total, int N) {
    GRID_STRIDE(i, total) {
        const float v = b ? x[i] + b[i % N] : x[i];
        x[i] = v;
        y[i] = dcs_gelu(v);
    }
}
