/*
 * cuda_backward.cuh -- the CUDA backend's backward operations (dcs_backend.h,
 * "backward"): the kernels of the tape's per-element steps. Part of cuda.cu's
 * translation unit (included there, before the ops table: it uses its
 * context, error record and allocator); not a header of its own.
 *
 * Every kernel runs the DCS_HD function of dcs_math.h that the CPU backend
 * runs (cpu_backward.c), one thread per row / element, so only reduction
 * order and libm ulps differ from the CPU. Nothing uses atomics: a sum
 * across rows (norm weights, biases, the embedding table, the static map)
 * is one thread per output element adding the rows in index order, so the
 * results are the same from run to run. The compose backward splits each
 * pair's outputs over passes that own disjoint rows: queries (dIn and the
 * query-side weights), keys (key-side weights), and per-query partial sums
 * of the static map, reduced in order.
 *
 * Sizes: the grids are ceil(n / threads) blocks of 128 or 256 threads over
 * n < 2^31 * 128 items; every kernel checks its index against n.
 */

static unsigned blocks_for(size_t n, unsigned threads) { return (unsigned)((n + threads - 1) / threads); }

/* A device copy of host data (pageable: staged before return), freed by
 * the caller with cu_free after the kernels that read it (stream order). */
static void *device_copy(dcs_backend *be, const void *host, size_t bytes) {
    cuda_ctx *c = ctx_of(be);
    void *p = cu_alloc(be, bytes);
    if (!p) return NULL;
    if (!ck(c, cudaMemcpyAsync(p, host, bytes, cudaMemcpyHostToDevice, c->stream), "cudaMemcpyAsync (ids)")) {
        cu_free(be, p);
        return NULL;
    }
    return p;
}

/* ------------------------------------------------------------ kernels */

static __global__ void gelu_bw_kernel(float *dx, const float *dy, const float *x, size_t n) {
    GRID_STRIDE(i, n) dx[i] = dy[i] * dcs_gelu_grad(x[i]);
}

static __global__ void tanh_bw_kernel(float *dx, const float *y, size_t n) {
    GRID_STRIDE(i, n) dx[i] *= 1.0f - y[i] * y[i];
}

/* rows of [BN, T, S], query t = row % T: one thread per row */
static __global__ void softmax_bw_kernel(float *dA, const float *dP, const float *P, size_t rows, int T,
                                         int S, int window) {
    size_t r = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const size_t o = r * (size_t)S;
    dcs_softmax_row_bw(dA + o, dP + o, P + o, S, (int)(r % T), window);
}

static __global__ void softmax_rows_bw_kernel(float *dg, const float *g, int M, int E) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= M) return;
    dcs_softmax_row_bw_inplace(dg + (size_t)r * E, g + (size_t)r * E, E);
}

/* LayerNorm rows: dx += row backward; the row's (mu, rs) into st [M, 2] */
static __global__ void layernorm_bw_rows_kernel(float *dx, float *st, const float *dy, const float *x,
                                                const float *w, int M, int D, float eps) {
    int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    const float *xr = x + (size_t)m * D;
    double mud;
    const float rs = dcs_layernorm_stats(xr, D, eps, &mud), mu = (float)mud;
    dcs_layernorm_row_bw(dx + (size_t)m * D, dy + (size_t)m * D, xr, w, mu, rs, D);
    st[2 * (size_t)m] = mu;
    st[2 * (size_t)m + 1] = rs;
}

/* norm_bw_fanout: one thread per (row, reader), the row's statistics
 * recomputed by each (dx written) */
static __global__ void norm_bw_fanout_kernel(float *dx, const float *dy, const float *x, const float *w,
                                             size_t rows, int G, int D, float eps, int rms) {
    size_t r = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float *xr = x + (r / G) * D;
    float *o = dx + r * D;
    for (int i = 0; i < D; i++) o[i] = 0.0f;
    if (rms) {
        dcs_rmsnorm_row_bw(o, dy + r * D, xr, w, dcs_rms_row_inv(xr, D, eps), D);
    } else {
        double mud;
        const float rs = dcs_layernorm_stats(xr, D, eps, &mud);
        dcs_layernorm_row_bw(o, dy + r * D, xr, w, (float)mud, rs, D);
    }
}

/* dw, db [D] += over rows in order: one thread per column */
static __global__ void layernorm_bw_cols_kernel(float *dw, float *db, const float *st, const float *dy,
                                                const float *x, int M, int D) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= D) return;
    float aw = dw ? dw[i] : 0.0f, ab = db ? db[i] : 0.0f;
    for (int m = 0; m < M; m++) {
        const float g = dy[(size_t)m * D + i];
        aw += g * ((x[(size_t)m * D + i] - st[2 * (size_t)m]) * st[2 * (size_t)m + 1]);
        ab += g;
    }
    if (dw) dw[i] = aw;
    if (db) db[i] = ab;
}

static __global__ void rmsnorm_bw_rows_kernel(float *dx, float *rs_out, const float *dy, const float *x,
                                              const float *scale, size_t rows, int width, float eps) {
    size_t r = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float *xr = x + r * width;
    const float rs = dcs_rms_row_inv(xr, width, eps);
    dcs_rmsnorm_row_bw(dx + r * width, dy + r * width, xr, scale, rs, width);
    if (rs_out) rs_out[r] = rs;
}

static __global__ void rmsnorm_bw_cols_kernel(float *dscale, const float *rs, const float *dy, const float *x,
                                              size_t rows, int width) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= width) return;
    float acc = dscale[i];
    for (size_t r = 0; r < rows; r++) acc += dy[r * width + i] * (x[r * width + i] * rs[r]);
    dscale[i] = acc;
}

/* x [M, N, Dh]: one thread per (m, j), rotating pair (j, j + rot/2) of every
 * head back by the angle of position m % T */
static __global__ void rotary_bw_kernel(float *x, int M, int T, int N, int Dh, int rot, float base) {
    const int half = rot / 2;
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)M * half) return;
    int m = (int)(idx / half), j = (int)(idx % half);
    float c, s;
    dcs_rotary_cs(m % T, j, rot, base, &c, &s);
    float *row = x + (size_t)m * N * Dh;
    for (int n = 0; n < N; n++) dcs_rotate_pair(&row[n * Dh + j], &row[n * Dh + j + half], c, -s);
}

static __global__ void col_sum_kernel(float *db, const float *dy, int M, int N) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= N) return;
    float acc = db[o];
    for (int m = 0; m < M; m++) acc += dy[(size_t)m * N + o];
    db[o] = acc;
}

/* dtable[tok[m], j] += dx[m, j]: one thread per column j, tokens in order */
static __global__ void embed_bw_kernel(float *dtable, const float *dx, const int32_t *tok, int M, int D) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= D) return;
    for (int m = 0; m < M; m++) dtable[(size_t)tok[m] * D + j] += dx[(size_t)m * D + j];
}

static __global__ void xent_bw_kernel(float *dlogits, double *loss, const float *logits, const int32_t *tgt,
                                      int M, int V, float inv) {
    int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    float *d = dlogits + (size_t)m * V;
    if (tgt[m] < 0) {
        for (int v = 0; v < V; v++) d[v] = 0.0f;
        loss[m] = 0;
        return;
    }
    loss[m] = dcs_xent_row_bw(d, logits + (size_t)m * V, V, tgt[m], inv);
}

static __global__ void head_gate_bw_kernel(float *dz, float *dgate, const float *zpre, const float *gate,
                                           size_t MN, int Dh) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= MN) return;
    dgate[i] = dcs_head_gate_bw(dz + i * Dh, zpre + i * Dh, gate[i], Dh);
}

static __global__ void moh_route_bw_kernel(float *dlg, float *ds1, float *ds0, const float *dg,
                                           const float *lg, const float *s1, const float *s0, int M, int N,
                                           int hs, int k) {
    int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    const int NR = N - hs;
    dcs_moh_route_row_bw(lg + (size_t)m * NR, hs > 1 ? s1 + (size_t)m * hs : NULL,
                         hs > 0 ? s0 + (size_t)m * 2 : NULL, N, hs, k, dg + (size_t)m * N,
                         dlg + (size_t)m * NR, ds1 + (size_t)m * (hs ? hs : 1), ds0 + (size_t)m * 2);
}

static __global__ void swiglu_gate_bw_kernel(float *dp, float *dgate, const float *u, const float *u3,
                                             const float *gate, int M, int F, int E) {
    int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    const size_t o = (size_t)m * F;
    dcs_swiglu_gate_row_bw(dp + o, dgate + (size_t)m * E, u + o, u3 + o, gate + (size_t)m * E, E, F / E);
}

static __global__ void swiglu_bw_kernel(float *du, float *du3, const float *dp, const float *u,
                                        const float *u3, size_t n) {
    GRID_STRIDE(i, n) dcs_swiglu_bw(dp[i], u[i], u3[i], &du[i], &du3[i]);
}

/* Compose backward: one thread per item of dcs_compose_bw_item's pass
 * (dcs_math.h; 0 queries, 1 keys, 2 the static map's partial sums). */
static __global__ void compose_bw_kernel(dcs_compose_bw_args a, int pass, float *part) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)a.B * a.T) return;
    dcs_compose_bw_item(&a, pass, idx, part);
}

/* The compose backward's passes 0 (queries) and 1 (keys) with a warp per
 * row instead of a thread (DCLENS_CUDA_KERNELS=new): lane l takes the row's
 * pairs l, l + 32, ... (the same pairs dcs_compose_bw_item visits), writes
 * dIn of its pairs (pass 0) and adds its dynamic-weight gradients into its
 * own slot of scratch [B*T, 32, W], W = 2RN + N (dw1, dw2, ddd), which
 * compose_bw_sum_kernel adds up in lane order: no atomics, deterministic,
 * another order of terms than the one-thread-per-row kernel's. */
static __global__ void compose_bw_warp_kernel(dcs_compose_bw_args a, int pass, float *scratch) {
    const size_t idx = (size_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (idx >= (size_t)a.B * a.T) return;
    const int N = a.N, T = a.T, b = (int)(idx / T), r = (int)(idx % T);
    const size_t RN = (size_t)a.R * N, W = 2 * RN + N;
    float *mine = scratch + (idx * 32 + lane) * W;
    const long long TT = (long long)T * T;
    const int qs = a.qw1 != NULL, ks = a.kw1 != NULL, p0 = pass == 0, p1 = pass == 1;
    const int lo = p0 ? (a.window > 0 && r > a.window ? r - a.window : 0) : r;
    const int hi = p0 ? r : (a.window > 0 && r + a.window < T - 1 ? r + a.window : T - 1);
    for (int j = lo + lane; j <= hi; j += 32) {
        const int t = p0 ? r : j, s = p0 ? j : r;
        const size_t q = (size_t)b * T + t, k = (size_t)b * T + s;
        const long long o = (long long)b * N * TT + (long long)t * T + s;
        dcs_compose_pair_bw_var(
            a.in + o, a.dOut + o, p0 ? a.dIn + o : NULL, TT, N, a.G, a.R, qs ? a.qw1 + q * RN : NULL,
            qs ? a.qw2 + q * RN : NULL, ks ? a.kw1 + k * RN : NULL, ks ? a.kw2 + k * RN : NULL,
            a.qdd ? a.qdd + q * N : NULL, a.kdd ? a.kdd + k * N : NULL, a.sw, p0 && qs ? mine : NULL,
            p0 && qs ? mine + RN : NULL, p1 && ks ? mine : NULL, p1 && ks ? mine + RN : NULL,
            p0 && a.qdd ? mine + 2 * RN : NULL, p1 && a.kdd ? mine + 2 * RN : NULL, NULL, a.on);
    }
}

/* d1, d2 [rows, RN], ddd [rows, N] (each may be NULL) = the lanes' slots of
 * scratch [rows, 32, 2RN + N] summed in lane order */
static __global__ void compose_bw_sum_kernel(float *d1, float *d2, float *ddd, const float *scratch,
                                             size_t rows, size_t RN, size_t N) {
    const size_t W = 2 * RN + N, total = rows * W;
    GRID_STRIDE(i, total) {
        const size_t row = i / W, e = i % W;
        float acc = 0.0f;
        for (int l = 0; l < 32; l++) acc += scratch[(row * 32 + l) * W + e];
        if (e < RN) {
            if (d1) d1[row * RN + e] = acc;
        } else if (e < 2 * RN) {
            if (d2) d2[row * RN + e - RN] = acc;
        } else if (ddd) {
            ddd[row * N + e - 2 * RN] = acc;
        }
    }
}

/* Passes 0 and 1 of the compose backward through the warp kernels; 0 when
 * their scratch cannot be had (the caller runs the thread-per-row kernel). */
static int compose_bw_warps(dcs_backend *be, cuda_ctx *c, const dcs_compose_bw_args *a) {
    const size_t M = (size_t)a->B * a->T, RN = (size_t)a->R * a->N, W = 2 * RN + a->N;
    void *scratch = NULL;
    if (raw_alloc(c, &scratch, sizeof(float) * M * 32 * W) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && !a->kw1) break;
        ck(c, cudaMemsetAsync(scratch, 0, sizeof(float) * M * 32 * W, c->stream), "cudaMemsetAsync");
        compose_bw_warp_kernel<<<row_blocks(M), 32 * ROW_WARPS, 0, c->stream>>>(*a, pass, (float *)scratch);
        launched(c, pass ? "compose_bw_warp_kernel (keys)" : "compose_bw_warp_kernel (queries)");
        compose_bw_sum_kernel<<<ew_blocks(M * W), EW_THREADS, 0, c->stream>>>(
            pass ? a->dkw1 : a->dqw1, pass ? a->dkw2 : a->dqw2, pass ? a->dkdd : a->dqdd,
            (const float *)scratch, M, RN, (size_t)a->N);
        launched(c, "compose_bw_sum_kernel");
    }
    cu_free(be, scratch);
    return 1;
}

/* dsw [n] += part [rows, n] summed over rows in order */
static __global__ void sum_rows_kernel(float *dsw, const float *part, size_t rows, size_t n) {
    size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    float acc = dsw[e];
    for (size_t r = 0; r < rows; r++) acc += part[r * n + e];
    dsw[e] = acc;
}

/* ------------------------------------------------------------ operations */

static void cu_zero(dcs_backend *be, void *p, size_t bytes) {
    if (!bytes) return;
    cuda_ctx *c = enter(be);
    ck(c, cudaMemsetAsync(p, 0, bytes, c->stream), "cudaMemsetAsync");
}

static void cu_gelu_bw(dcs_backend *be, float *dx, const float *dy, const float *x, size_t n) {
    if (!n) return;
    cuda_ctx *c = enter(be);
    gelu_bw_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>(dx, dy, x, n);
    launched(c, "gelu_bw_kernel");
}

static void cu_tanh_bw(dcs_backend *be, float *dx, const float *y, size_t n) {
    if (!n) return;
    cuda_ctx *c = enter(be);
    tanh_bw_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>(dx, y, n);
    launched(c, "tanh_bw_kernel");
}

static void cu_softmax_bw(dcs_backend *be, float *dA, const float *dP, const float *P, int BN, int T, int S,
                          int window) {
    if (BN <= 0 || T <= 0 || S <= 0) return;
    cuda_ctx *c = enter(be);
    size_t rows = (size_t)BN * T;
    if (c->new_kernels) {
        softmax_bw_warp_kernel<<<row_blocks(rows), 32 * ROW_WARPS, 0, c->stream>>>(dA, dP, P, rows, T, S,
                                                                                   window);
        launched(c, "softmax_bw_warp_kernel");
        return;
    }
    softmax_bw_kernel<<<blocks_for(rows, 128), 128, 0, c->stream>>>(dA, dP, P, rows, T, S, window);
    launched(c, "softmax_bw_kernel");
}

static void cu_softmax_rows_bw(dcs_backend *be, float *dg, const float *g, int M, int E) {
    if (M <= 0 || E <= 0) return;
    cuda_ctx *c = enter(be);
    softmax_rows_bw_kernel<<<blocks_for((size_t)M, 128), 128, 0, c->stream>>>(dg, g, M, E);
    launched(c, "softmax_rows_bw_kernel");
}

static void cu_layernorm_bw(dcs_backend *be, float *dx, float *dw, float *db, const float *dy, const float *x,
                            const float *w, int M, int D, float eps) {
    if (M <= 0 || D <= 0) return;
    cuda_ctx *c = enter(be);
    float *st = (float *)cu_alloc(be, sizeof(float) * 2 * (size_t)M);
    if (!st) return;
    if (c->new_kernels) {
        layernorm_bw_warp_kernel<<<row_blocks((size_t)M), 32 * ROW_WARPS, 0, c->stream>>>(dx, st, dy, x, w, M,
                                                                                          D, eps);
        launched(c, "layernorm_bw_warp_kernel");
    } else {
        layernorm_bw_rows_kernel<<<blocks_for((size_t)M, 128), 128, 0, c->stream>>>(dx, st, dy, x, w, M, D,
                                                                                    eps);
        launched(c, "layernorm_bw_rows_kernel");
    }
    if (dw || db) {
        layernorm_bw_cols_kernel<<<blocks_for((size_t)D, 128), 128, 0, c->stream>>>(dw, db, st, dy, x, M, D);
        launched(c, "layernorm_bw_cols_kernel");
    }
    cu_free(be, st);
}

static void cu_norm_bw_fanout(dcs_backend *be, float *dx, const float *dy, const float *x, const float *w,
                              int M, int G, int D, float eps, int rms) {
    if (M <= 0 || G <= 0 || D <= 0) return;
    cuda_ctx *c = enter(be);
    const size_t rows = (size_t)M * G;
    if (c->new_kernels) {
        norm_bw_fanout_warp_kernel<<<row_blocks(rows), 32 * ROW_WARPS, 0, c->stream>>>(dx, dy, x, w, rows, G,
                                                                                       D, eps, rms);
        launched(c, "norm_bw_fanout_warp_kernel");
        return;
    }
    norm_bw_fanout_kernel<<<blocks_for(rows, 128), 128, 0, c->stream>>>(dx, dy, x, w, rows, G, D, eps, rms);
    launched(c, "norm_bw_fanout_kernel");
}

static void cu_rmsnorm_bw(dcs_backend *be, float *dx, float *dscale, const float *dy, const float *x,
                          const float *scale, int rows, int width, float eps) {
    if (rows <= 0 || width <= 0) return;
    cuda_ctx *c = enter(be);
    float *rs = NULL;
    if (dscale && !(rs = (float *)cu_alloc(be, sizeof(float) * (size_t)rows))) return;
    rmsnorm_bw_rows_kernel<<<blocks_for((size_t)rows, 128), 128, 0, c->stream>>>(dx, rs, dy, x, scale,
                                                                                 (size_t)rows, width, eps);
    launched(c, "rmsnorm_bw_rows_kernel");
    if (dscale) {
        rmsnorm_bw_cols_kernel<<<blocks_for((size_t)width, 128), 128, 0, c->stream>>>(dscale, rs, dy, x,
                                                                                      (size_t)rows, width);
        launched(c, "rmsnorm_bw_cols_kernel");
        cu_free(be, rs);
    }
}

static void cu_rotary_bw(dcs_backend *be, float *x, int M, int T, int N, int Dh, int rot, float base) {
    if (M <= 0 || rot < 2 || N <= 0 || T <= 0) return;
    cuda_ctx *c = enter(be);
    size_t total = (size_t)M * (rot / 2);
    rotary_bw_kernel<<<blocks_for(total, 256), 256, 0, c->stream>>>(x, M, T, N, Dh, rot, base);
    launched(c, "rotary_bw_kernel");
}

static void cu_col_sum(dcs_backend *be, float *db, const float *dy, int M, int N) {
    if (M <= 0 || N <= 0) return;
    cuda_ctx *c = enter(be);
    col_sum_kernel<<<blocks_for((size_t)N, 128), 128, 0, c->stream>>>(db, dy, M, N);
    launched(c, "col_sum_kernel");
}

static void cu_embed_bw(dcs_backend *be, float *dtable, const float *dx, const int32_t *tokens_host, int M,
                        int D) {
    if (M <= 0 || D <= 0) return;
    cuda_ctx *c = enter(be);
    int32_t *tok = (int32_t *)device_copy(be, tokens_host, sizeof(int32_t) * (size_t)M);
    if (!tok) return;
    embed_bw_kernel<<<blocks_for((size_t)D, 128), 128, 0, c->stream>>>(dtable, dx, tok, M, D);
    launched(c, "embed_bw_kernel");
    cu_free(be, tok);
}

static void cu_xent_bw(dcs_backend *be, float *dlogits, double *loss_host, const float *logits,
                       const int32_t *targets_host, int M, int V, float inv) {
    if (M <= 0) return;
    cuda_ctx *c = enter(be);
    for (int i = 0; i < M; i++) loss_host[i] = 0; /* what a failure leaves */
    int32_t *tgt = (int32_t *)device_copy(be, targets_host, sizeof(int32_t) * (size_t)M);
    double *loss = (double *)cu_alloc(be, sizeof(double) * (size_t)M);
    if (tgt && loss) {
        xent_bw_kernel<<<blocks_for((size_t)M, 128), 128, 0, c->stream>>>(dlogits, loss, logits, tgt, M, V,
                                                                          inv);
        launched(c, "xent_bw_kernel");
        cu_download(be, loss_host, loss, sizeof(double) * (size_t)M);
    }
    cu_free(be, tgt);
    cu_free(be, loss);
}

static void cu_compose_bw(dcs_backend *be, const dcs_compose_bw_args *a) {
    if (a->B <= 0 || a->T <= 0 || a->N <= 0) return;
    cuda_ctx *c = enter(be);
    if (a->R < 0 || a->R > DCS_MAX_R || a->G < 1 || a->N % a->G) {
        record(c, "compose_bw: rank R = %d outside [0, %d] or %d heads in %d groups", a->R, DCS_MAX_R, a->N,
               a->G);
        return;
    }
    const size_t M = (size_t)a->B * a->T, RN = (size_t)a->R * a->N, N = (size_t)a->N;
    const size_t Mg = N / a->G, GMM = (size_t)a->G * Mg * Mg;
    ck(c, cudaMemsetAsync(a->dIn, 0, sizeof(float) * M * N * a->T, c->stream), "cudaMemsetAsync");
    float *const dyn[6] = {a->dqw1, a->dqw2, a->dqdd, a->dkw1, a->dkw2, a->dkdd};
    for (int i = 0; i < 6; i++)
        if (dyn[i])
            ck(c, cudaMemsetAsync(dyn[i], 0, sizeof(float) * M * (i % 3 < 2 ? RN : N), c->stream),
               "cudaMemsetAsync");
    const unsigned blocks = blocks_for(M, 64);
    if (!c->new_kernels || !compose_bw_warps(be, c, a)) {
        compose_bw_kernel<<<blocks, 64, 0, c->stream>>>(*a, 0, NULL);
        launched(c, "compose_bw_kernel (queries)");
        if (a->kw1) {
            compose_bw_kernel<<<blocks, 64, 0, c->stream>>>(*a, 1, NULL);
            launched(c, "compose_bw_kernel (keys)");
        }
    }
    if (a->sw && a->dsw && (a->on & 32)) {
        float *part = (float *)cu_alloc(be, sizeof(float) * M * GMM);
        if (!part) return;
        compose_bw_kernel<<<blocks, 64, 0, c->stream>>>(*a, 2, part);
        launched(c, "compose_bw_kernel (static map)");
        sum_rows_kernel<<<blocks_for(GMM, 128), 128, 0, c->stream>>>(a->dsw, part, M, GMM);
        launched(c, "sum_rows_kernel");
        cu_free(be, part);
    }
}

static void cu_head_gate_bw(dcs_backend *be, float *dz, float *dgate, const float *zpre, const float *gate,
                            int M, int N, int Dh) {
    size_t MN = (size_t)M * N;
    if (!MN || Dh <= 0) return;
    cuda_ctx *c = enter(be);
    head_gate_bw_kernel<<<blocks_for(MN, 128), 128, 0, c->stream>>>(dz, dgate, zpre, gate, MN, Dh);
    launched(c, "head_gate_bw_kernel");
}

static void cu_moh_route_bw(dcs_backend *be, float *dlg, float *ds1, float *ds0, const float *dg,
                            const float *lg, const float *s1, const float *s0, int M, int N, int hs, int k) {
    if (M <= 0) return;
    cuda_ctx *c = enter(be);
    moh_route_bw_kernel<<<blocks_for((size_t)M, 128), 128, 0, c->stream>>>(dlg, ds1, ds0, dg, lg, s1, s0, M,
                                                                           N, hs, k);
    launched(c, "moh_route_bw_kernel");
}

static void cu_swiglu_bw(dcs_backend *be, float *du, float *du3, float *dgate, float *dp, const float *u,
                         const float *u3, const float *gate, int M, int F, int E) {
    if (M <= 0 || F <= 0) return;
    cuda_ctx *c = enter(be);
    if (E > 0) {
        swiglu_gate_bw_kernel<<<blocks_for((size_t)M, 128), 128, 0, c->stream>>>(dp, dgate, u, u3, gate, M, F,
                                                                                 E);
        launched(c, "swiglu_gate_bw_kernel");
    }
    size_t n = (size_t)M * F;
    swiglu_bw_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>(du, du3, dp, u, u3, n);
    launched(c, "swiglu_bw_kernel");
}

/* The largest scratch one operation above takes (ops->bw_scratch), in
 * bytes, for a tape of shape s: layernorm_bw's statistics [M, 2], rmsnorm_bw's
 * rstd [rows] (rows up to M*N: the q/k norms), embed_bw's token ids [M],
 * xent_bw's targets [M] and row losses [M] (double), compose_bw's
 * static-map partials [M, G, N/G, N/G] (only when that map's gradient is
 * asked); and the forward's token ids (cu_embed's scratch, [M], kept by
 * the context). */
static uint64_t cu_bw_scratch(dcs_backend *be, const dcs_bw_shape *s) {
    (void)be;
    const uint64_t M = (uint64_t)(s->B > 0 ? s->B : 0) * (uint64_t)(s->T > 0 ? s->T : 0);
    const uint64_t N = s->N > 0 ? (uint64_t)s->N : 1, G = s->G > 0 ? (uint64_t)s->G : 1;
    uint64_t n = 2 * M * sizeof(float);
    if (M * N * sizeof(float) > n) n = M * N * sizeof(float);
    if (M * (sizeof(int32_t) + sizeof(double)) > n) n = M * (sizeof(int32_t) + sizeof(double));
    if (s->use_sw) {
        const uint64_t Mg = N / G, part = M * G * Mg * Mg * sizeof(float);
        if (part > n) n = part;
    }
    return n + M * sizeof(int32_t);
}
