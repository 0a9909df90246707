/*
 * dcs_backend.h -- the backends layer (engine/src/backends/, library
 * dclens_backends): the interface the model graph runs on (memory, GEMM,
 * row and element kernels, compose, fused attention) and its CPU and CUDA
 * implementations. Includes the io layer below it (errors, dtypes) only.
 */
#ifndef DCS_BACKEND_H
#define DCS_BACKEND_H

#include "dcs_io.h"

/* ---------------------------------------------------------------- backend */

#define DCS_MAX_R 8          /* dynamic rank                 */
#define DCS_KEY_PAD 16       /* compose_bw scratch key rows  */
#define DCS_MAX_SW_HEADS 256 /* heads per group with use_sw  */

/* A backend owns device memory and runs kernels on it. Pointers it hands
 * out are device pointers: the graph passes them to kernels and never
 * dereferences them. All sizes are in elements unless named *_bytes.
 * Kernels do not return errors; a backend records the first failure and
 * reports it from sync(). */
typedef struct dcs_backend dcs_backend;

/* A range of work items [begin, end) run on thread tid (ops->parallel). */
typedef void (*dcs_par_fn)(void *arg, long long begin, long long end, int tid);

/* Arguments of the compose kernel: out = Compose(in) per model-spec 2.6
 * and 5, over [B, N, T, S] tensors. Dynamic weights are [B, T, R, N] (query
 * side) and [B, S, R, N] (key side), gates [B, T, N] / [B, S, N]; the
 * key-side pointers are NULL for query_wise models, the query-side ones
 * for key_wise models. With G groups the N
 * axis is G blocks of N/G heads and heads mix only within their block
 * (each block's [R, N/G] slice is that group's weight). sw: the static
 * (Talking-Heads) map [G, N/G, N/G] or NULL. Branch outputs may be NULL.
 * causal_only: compute only pairs allowed by the mask (s <= t, and
 * t - s <= window when window > 0) and write 0 elsewhere (post-compose).
 * Positions: query t is at t0 + t, key s at kb + s (0, 0: a full pass; an
 * incremental step has t0 = the tokens before it and kb = the first cached
 * key), so one kernel serves the prefill and a decoding step. */
#define DCS_N_BRANCHES 6
typedef struct {
    float *out;      /* [B, N, T, S], may equal in               */
    const float *in; /* [B, N, T, S]                             */
    const float *qw1, *qw2, *kw1, *kw2, *qdd, *kdd;
    const float *sw;           /* [G, N/G, N/G] or NULL                    */
    float *br[DCS_N_BRANCHES]; /* skip, qp, kp, qg, kg, static (or NULL)   */
    int B, N, T, S, R;
    int G; /* composition groups, >= 1                 */
    int causal_only;
    int window; /* <= 0: global                             */
    int t0, kb; /* positions of query 0 and key 0           */
} dcs_compose_args;

/* A weight matrix as the forward pass reads it: float32, or F16/BF16 (as
 * stored, or rounded at load: dcs_load_options.dtype) in backend memory:
 * the CPU widens it per tile inside gemm_w, CUDA rounds the activations to
 * the same type and runs a tensor-core product with float32 accumulation. */
typedef struct {
    const void *p;
    int dtype; /* dcs_dtype                                */
} dcs_wmat;

/* Arguments of the fused attention kernel (model-spec 2 steps 5-10 for one
 * layer, without materialising [B, N, T, S]): per query row, scores ->
 * pre-compose -> mask -> softmax -> post-compose -> weighted sum of v.
 * q, z are [B, T, N, Dh], k, v [B, S, N, Dh], all with row stride ld; query
 * t is at position t0 + t, key s at kb + s (a full pass: S = T, t0 = kb =
 * 0). Dynamic weights per phase (0 pre, 1 post) as in dcs_compose_args
 * ([B, T, R, N], [B, T, N] query side; [B, S, R, N], [B, S, N] key side,
 * NULL for query_wise); compose == 0: plain MHA (C = I).
 * keep (the tape, a full pass only: S = T, t0 = kb = 0; NULL entries
 * otherwise): the maps the backward reads, [B, N, T, T] each: keep[0] the
 * scores A on the keys of the row's query block at least, keep[1] the
 * pattern P, keep[2] the composed pattern Pc (compose only). The pattern
 * the products read (P, or Pc with compose) is written whole, 0 at masked
 * pairs, as the materialising path writes it; A, and P with compose, only
 * where the backward reads them (the allowed pairs, under its mask), the
 * rest left as it was. */
typedef struct {
    float *z;
    const float *q, *k, *v;
    int B, T, S, t0, kb, N, Dh, ld, R;
    int window;  /* <= 0: global                             */
    float scale; /* 1 / sqrt(Dh)                             */
    int compose;
    const float *qw1[2], *qw2[2], *qdd[2], *kw1[2], *kw2[2], *kdd[2];
    float *keep[3]; /* A, P, Pc [B, N, T, T] or NULL          */
} dcs_attn_args;

/* Arguments of the compose backward (one phase, model-spec 2.6 and 5), over
 * [B, N, T, T] maps of a full pass (t0 = kb = 0): from dOut = dL/d Compose(in)
 * to dIn (written, 0 at masked pairs) and the phase's dynamic-weight
 * gradients (written): dqw1, dqw2 [B, T, R, N],
 * dqdd [B, T, N] query side, dkw* / dkdd key side (NULL with their side),
 * dsw [G, N/G, N/G] += the static map's (NULL: not wanted). Weights as in
 * dcs_compose_args. `on`: bit k set = branch k (skip, qp, kp, qg, kg,
 * static) passes gradient. scratch: the CPU backend's transposed key-side
 * weights and their gradients (6 arrays, [B, R*N, Tp] x 2 and [B, N, Tp]
 * per pair, Tp = T rounded up to a multiple of DCS_KEY_PAD) for plain DCMHA, or NULL (then it goes pair by pair). */
typedef struct {
    float *dIn;
    const float *in, *dOut;
    const float *qw1, *qw2, *kw1, *kw2, *qdd, *kdd;
    const float *sw;
    float *dqw1, *dqw2, *dkw1, *dkw2, *dqdd, *dkdd, *dsw;
    float *scratch[6];
    int B, N, T, R, G;
    int window;
    unsigned on;
} dcs_compose_bw_args;

/* Arguments of the fused attention backward (ops->attention_bw) of a full
 * pass of plain DCMHA: from dz to dq, dk, dv through both compose phases
 * and the masked softmax, with the maps the forward kept (post->in = P,
 * pre->in = A, Pc) and the phases' dynamic weights and their gradients
 * (written) as in compose_softmax_bw; post->dOut, post->dIn, pre->dOut and
 * pre->dIn are not used (no [B, N, T, T] gradient map is written).
 * dz, q, k, v, dq, dk, dv [B, T, N, Dh] with row stride ld. */
typedef struct {
    const dcs_compose_bw_args *post, *pre;
    const float *dz, *q, *k, *v, *Pc;
    float *dq, *dk, *dv;
    int Dh, ld;
    float scale; /* 1 / sqrt(Dh) */
} dcs_attn_bw_args;

/* Arguments of the plain (MHA) attention backward (ops->mha_bw) of a full
 * pass: dz, q, k, v, dq, dk, dv [B, T, N, Dh] with row stride ld (dq, dk,
 * dv written), P [B, N, T, T] the pattern the forward kept; scale 1 /
 * sqrt(Dh); window the layer's (0: none). */
typedef struct {
    const float *dz, *q, *k, *v, *P;
    float *dq, *dk, *dv;
    int B, T, N, Dh, ld, window;
    float scale;
} dcs_mha_bw_args;

/* One of the two norms of ops->layernorm2_bw: its gradient dy [M, D] at
 * the output, its weight w [D], its parameter gradients dw, db [D] (+=,
 * each may be NULL). */
typedef struct {
    const float *dy, *w;
    float *dw, *db;
} dcs_norm_bw_side;

/* The shapes the backward's scratch depends on (ops->bw_scratch): a tape
 * of B sequences of T tokens, width D, N heads, dynamic rank R, `rot`
 * rotary dims; G composition groups; use_sw: the static (Talking-Heads)
 * map's gradient is asked (its per-row partials); rows_kernel: plain
 * DCMHA through compose_bw's row kernel (scratch non-NULL); mha: a
 * layer of plain attention. */
typedef struct {
    int B, T, D, N, R, rot, G;
    int use_sw, rows_kernel;
    int mha; /* a layer of plain attention (ops->mha_bw's maps) */
} dcs_bw_shape;

/* The operations of a backend: one static const table per backend
 * (cpu.c, cuda.cu), filled with designated initialisers. Every operation
 * takes the backend it is called on: be->ops->gemm(be, ...). */
typedef struct dcs_backend_ops {
    const char *name;

    /* memory */
    void *(*alloc)(dcs_backend *be, size_t bytes); /* zero-filled  */
    void (*free)(dcs_backend *be, void *p);
    void (*upload)(dcs_backend *be, void *dst, const void *src_host, size_t bytes);
    void (*download)(dcs_backend *be, void *dst_host, const void *src, size_t bytes);
    void (*copy)(dcs_backend *be, void *dst, const void *src, size_t bytes);
    dcs_status (*sync)(dcs_backend *be, dcs_err *e); /* first error    */
    void (*destroy)(dcs_backend *be);

    /* Row-major strided batched GEMM, float32:
     * for b < batch: C_b = alpha * op(A_b) op(B_b) + beta * C_b,
     * op(A_b) [M, K], op(B_b) [K, N], X_b = X + b * strideX. */
    void (*gemm)(dcs_backend *be, int transA, int transB, int M, int N, int K, float alpha, const float *A,
                 int lda, long long strideA, const float *B, int ldb, long long strideB, float beta, float *C,
                 int ldc, long long strideC, int batch);

    /* elementwise / row kernels */
    /* out [M, D] = table [V, D] rows tokens_host[m]. The ids are read (or
     * copied) before embed returns, without waiting for the device. */
    void (*embed)(dcs_backend *be, float *out, const float *table, const int32_t *tokens_host, int M, int D);
    void (*add_bias)(dcs_backend *be, float *x, const float *bias, int M, int N); /* x[M,N] += b[N] */
    void (*add)(dcs_backend *be, float *y, const float *x, size_t n);             /* y += x */
    /* Optional (NULL: add twice): y += a, then y += b, one pass */
    void (*add2)(dcs_backend *be, float *y, const float *a, const float *b, size_t n);
    void (*gelu)(dcs_backend *be, float *x, size_t n); /* exact erf gelu */
    /* Optional (NULL: add_bias, then gelu on a copy or in place): x [M, N] +=
     * b [N] (b NULL: nothing added), y = gelu(x) (y may be x), one pass: the
     * MLP's bias and activation, the same arithmetic as the two ops. */
    void (*bias_gelu)(dcs_backend *be, float *y, float *x, const float *b, int M, int N);
    /* Optional (NULL: bias_gelu): bias_gelu with y apart from x, then x =
     * gelu'(x) (dcs_gelu_grad, the bits gelu_bw computes), for a tape whose
     * backward then multiplies (gelu_bw_sum, x_is_grad) */
    void (*bias_gelu_keep)(dcs_backend *be, float *y, float *x, const float *b, int M, int N);
    void (*tanh_)(dcs_backend *be, float *x, size_t n);
    void (*layernorm)(dcs_backend *be, float *out, const float *in, const float *w, const float *b, int M,
                      int D, float eps);
    /* Optional (NULL: layernorm twice): out, out2 [M, D] = two LayerNorms of
     * in (weights w, b and w2, b2), the statistics once; layernorm's bits.
     * stats [2, M] (NULL: not kept): each row's mean (as float), then each
     * row's 1/std, the statistics layernorm_bw recomputes (the same bits). */
    void (*layernorm2)(dcs_backend *be, float *out, float *out2, float *stats, const float *in,
                       const float *w, const float *b, const float *w2, const float *b2, int M, int D,
                       float eps);
    /* x [rows, width] (row stride ld): x = x / sqrt(mean(x^2) + eps) * scale
     * (scale [width] or NULL for none), in place. */
    void (*rmsnorm)(dcs_backend *be, float *x, int rows, int width, int ld, const float *scale, float eps);
    /* x [M, N, Dh], position of row m is t0 + m % T: GPT-NeoX rotate-half
     * on the first rot dims. */
    void (*rotary)(dcs_backend *be, float *x, int M, int T, int t0, int N, int Dh, int rot, float base);
    /* Optional (NULL, or nonzero returned when out of scratch: add_bias,
     * copy2d, rotary): the attention's input projection split, in one pass
     * over the rows: q, k, v [M, D] (D = N Dh, row stride D) = the thirds of
     * qkv [M, 3D] (the product) + b [3D] (NULL: nothing added), q and k then
     * rotated as rotary (positions t0 + m % T); the same arithmetic. */
    int (*qkv_split)(dcs_backend *be, float *q, float *k, float *v, const float *qkv, const float *b, int M,
                     int T, int t0, int N, int Dh, int rot, float base);
    /* Copy a [rows, cols] block with row strides (dst ld_dst, src ld_src). */
    void (*copy2d)(dcs_backend *be, float *dst, int ld_dst, const float *src, int ld_src, int rows, int cols);
    void (*compose)(dcs_backend *be, const dcs_compose_args *a);
    /* x [BN, T, S], query t at position t0 + t, key s at kb + s: softmax
     * over s of the allowed entries (key <= query, and query - key <=
     * window when window > 0); masked entries become 0. */
    void (*softmax_masked)(dcs_backend *be, float *x, int BN, int T, int S, int t0, int kb, int window);

    /* Optional (NULL on a backend whose weights are all float32):
     * C [M, N] = A [M, K] op(W) + beta C, W stored in W.dtype, [N, K] when
     * transW (a torch Linear) else [K, N]; float32 accumulation (the CPU
     * widens W tile by tile; CUDA rounds A to W's type, tensor cores).
     * The backward reads the same weights through it: dx = dy W is
     * transW = 0 on a Linear's [O, I] matrix. */
    void (*gemm_w)(dcs_backend *be, int transW, int M, int N, int K, const float *A, int lda, dcs_wmat W,
                   float beta, float *C, int ldc);
    /* out [M, D] = table[tokens[m]] with the table in table.dtype. */
    void (*embed_w)(dcs_backend *be, float *out, dcs_wmat table, const int32_t *tokens_host, int M, int D);
    /* Optional (NULL: gemm): gemm with A and B rounded to `dtype` (F16 or
     * BF16) first, float32 accumulation and output (CUDA: tensor cores). The
     * attention products of a model whose weights are kept in that type
     * (dcs_model.act_dtype: scores, P v and their backward) use it. */
    void (*gemm_x)(dcs_backend *be, int dtype, int transA, int transB, int M, int N, int K, float alpha,
                   const float *A, int lda, long long strideA, const float *B, int ldb, long long strideB,
                   float beta, float *C, int ldc, long long strideC, int batch);
    /* out [n] = src [n] widened to float32 (exact); the backends with gemm_w
     * have it (a product gemm_w cannot express, e.g. head_out's column
     * blocks of wo, widens its weight first). */
    void (*widen)(dcs_backend *be, float *out, dcs_wmat src, size_t n);
    /* Fused attention (see dcs_attn_args); NULL: the graph uses the full
     * path. A backend that has it writes the tape's maps (keep) too. */
    void (*attention)(dcs_backend *be, const dcs_attn_args *a);
    /* Optional, with attention (NULL: the graph's own batched products): the
     * materialising path's two products on the fused kernel's own query
     * blocks, so that a layer with hooked maps and a fused one issue the same
     * BLAS calls and agree bit for bit on any kernel. a as for attention (q,
     * k, v, z, shapes; no compose, no keep):
     *   attention_scores: map [B, N, T, S] = scale q k^T, every pair;
     *   attention_pv:     z = map v, each block over its span of keys
     *                     (map 0 at the masked pairs, as the pattern is). */
    void (*attention_scores)(dcs_backend *be, const dcs_attn_args *a, float *map);
    void (*attention_pv)(dcs_backend *be, const dcs_attn_args *a, const float *map);
    /* MoH routing scores (model-spec 5), per row m < M: g [M, N] from the
     * router logits [M, N - hs], the shared-head logits s1 [M, hs] (NULL
     * when hs <= 1) and the balance logits s0 [M, 2] (NULL when hs == 0). */
    void (*moh_route)(dcs_backend *be, float *g, const float *logits, const float *s1, const float *s0, int M,
                      int N, int hs, int k);
    /* z [M, N, Dh] *= g [M, N] broadcast over Dh (MoH head gate). */
    void (*head_gate)(dcs_backend *be, float *z, const float *g, int M, int N, int Dh);
    /* Host work on the backend's threads (NULL where there are none, CUDA):
     * fn over items [0, n) in chunks, tid < the thread count; cost is the
     * rough work per item (small jobs run on the caller). The tape's
     * element-wise backward runs here, on the model's one pool. */
    void (*parallel)(dcs_backend *be, dcs_par_fn fn, void *arg, long long n, long long cost);
    /* a [n] = silu(a) * b [n] (dcs_swiglu; DCFormer++'s gated MLP). */
    void (*swiglu)(dcs_backend *be, float *a, const float *b, size_t n);

    /* ------------------------------------------------------------ backward
     * The tape's per-element steps (tape.c), on device memory; the math of
     * each is dcs_math.h's (dcs_*_bw). Reductions across rows (norm weights,
     * biases, the embedding table, the static map) add the rows in index
     * order on every backend: deterministic. */
    void (*zero)(dcs_backend *be, void *p, size_t bytes);
    /* dx [n] = dy [n] * gelu'(x [n]) (dx may equal dy) */
    void (*gelu_bw)(dcs_backend *be, float *dx, const float *dy, const float *x, size_t n);
    /* Optional (NULL: gelu_bw, then col_sum): dx [M, N] = dy * gelu'(x)
     * (dx may equal dy; x_is_grad: x holds gelu'(x) already, bias_gelu_keep's),
     * then db [N] (NULL: none) += the column sums of dx, one pass */
    void (*gelu_bw_sum)(dcs_backend *be, float *dx, float *db, const float *dy, const float *x, int M, int N,
                        int x_is_grad);
    /* dx [n] *= 1 - y [n]^2 (y = tanh) */
    void (*tanh_bw)(dcs_backend *be, float *dx, const float *y, size_t n);
    /* dA [BN, T, S] = masked softmax backward of rows P, dP (full pass: query
     * t = row % T, keys 0..S-1) */
    void (*softmax_bw)(dcs_backend *be, float *dA, const float *dP, const float *P, int BN, int T, int S,
                       int window);
    /* in place per row of dg [M, E]: the unmasked softmax backward with g */
    void (*softmax_rows_bw)(dcs_backend *be, float *dg, const float *g, int M, int E);
    /* LayerNorm of x [M, D] (statistics recomputed): dx [M, D] +=; dw, db [D]
     * += (each may be NULL) */
    void (*layernorm_bw)(dcs_backend *be, float *dx, float *dw, float *db, const float *dy, const float *x,
                         const float *w, int M, int D, float eps);
    /* Optional (NULL, or nonzero returned when out of scratch: layernorm_bw
     * twice): two LayerNorms of the same x [M, D] (a parallel residual's two
     * norms), the statistics once (or stats [2, M], layernorm2's, NULL:
     * from x): dx += the first's backward, then the second's; each side's
     * dw, db += (each may be NULL); the same bits. */
    int (*layernorm2_bw)(dcs_backend *be, float *dx, const dcs_norm_bw_side *first,
                         const dcs_norm_bw_side *second, const float *stats, const float *x, int M, int D,
                         float eps);
    /* RMS norm of x [rows, width] (rstd recomputed, scale [width] or NULL):
     * dx +=; dscale [width] += (may be NULL) */
    void (*rmsnorm_bw)(dcs_backend *be, float *dx, float *dscale, const float *dy, const float *x,
                       const float *scale, int rows, int width, float eps);
    /* the norm's backward for G readers of each row x [M, D] (the split
     * inputs: one per head): dx [M, G, D] = norm_bw(x[m], dy [M, G, D])
     * (written, not added), each row's statistics computed once; rms: RMS
     * norm, else LayerNorm; w [D] the norm's weight (no gradient of it) */
    void (*norm_bw_fanout)(dcs_backend *be, float *dx, const float *dy, const float *x, const float *w, int M,
                           int G, int D, float eps, int rms);
    /* x [M, N, Dh] rotated back (by -angle) in place: rotary's backward,
     * position m % T */
    void (*rotary_bw)(dcs_backend *be, float *x, int M, int T, int N, int Dh, int rot, float base);
    /* Optional (NULL, or nonzero returned when out of scratch: rotary_bw on
     * dq and dk, then three copy2d): dqkv [M, 3D] = [rotary_bw(dq) |
     * rotary_bw(dk) | dv] in one pass over the rows, dq, dk, dv [M, N, Dh]
     * (D = N Dh) read only; the same arithmetic. */
    int (*qkv_join_bw)(dcs_backend *be, float *dqkv, const float *dq, const float *dk, const float *dv, int M,
                       int T, int N, int Dh, int rot, float base);
    /* db [N] += column sums of dy [M, N] */
    void (*col_sum)(dcs_backend *be, float *db, const float *dy, int M, int N);
    /* dtable [V, D] row tokens_host[m] += dx [m] (ids read before return) */
    void (*embed_bw)(dcs_backend *be, float *dtable, const float *dx, const int32_t *tokens_host, int M,
                     int D);
    /* dlogits [M, V] = cross-entropy gradient rows (dcs_xent_row_bw) scaled
     * by inv, 0 where targets_host[m] < 0; loss_host [M] (host) receives each
     * row's loss (0 without a target) before return */
    void (*xent_bw)(dcs_backend *be, float *dlogits, double *loss_host, const float *logits,
                    const int32_t *targets_host, int M, int V, float inv);
    void (*compose_bw)(dcs_backend *be, const dcs_compose_bw_args *a);
    /* optional (NULL: the tape runs compose_bw, softmax_bw, compose_bw):
     * the post-compose backward (post: in = P, dOut = dPc, dIn = dP), the
     * masked softmax backward of P (window: post->window) to dAc = pre->dOut,
     * and the pre-compose backward (pre: dIn = dA) in one pass; dA and both
     * phases' dynamic-weight gradients written as by those three, the same
     * bits; dP and dAc are scratch, their contents unspecified after */
    void (*compose_softmax_bw)(dcs_backend *be, const dcs_compose_bw_args *post,
                               const dcs_compose_bw_args *pre);
    /* optional (NULL: the tape runs the per-head products around
     * compose_softmax_bw): the attention backward of dcs_attn_bw_args, by
     * blocks of query rows whose gradient maps stay in cache; 0 when done,
     * else (no scratch) the caller runs its unfused path, which writes
     * every output again */
    int (*attention_bw)(dcs_backend *be, const dcs_attn_bw_args *a);
    /* optional (NULL: the tape's batched per-head products around
     * softmax_bw): plain attention's backward per (sequence, head): dP = dz
     * v^T, dv = P^T dz, dA = softmax_bw(dP, P), dq = scale dA k, dk = scale
     * dA^T q, each product through the same BLAS calls as gemm's (the same
     * bits), dP and dA in the thread's scratch (no [B, N, T, T] map
     * written); 0 when done, else (no scratch) the caller runs its path */
    int (*mha_bw)(dcs_backend *be, const dcs_mha_bw_args *a);
    /* MoH: dz [M, N, Dh] *= gate [M, N] (becomes d zpre); dgate = <dz, zpre> */
    void (*head_gate_bw)(dcs_backend *be, float *dz, float *dgate, const float *zpre, const float *gate,
                         int M, int N, int Dh);
    /* MoH routing backward per row (dcs_moh_route_row_bw): dlg [M, N-hs],
     * ds1 [M, max(hs,1)], ds0 [M, 2] written from dg [M, N] */
    void (*moh_route_bw)(dcs_backend *be, float *dlg, float *ds1, float *ds0, const float *dg,
                         const float *lg, const float *s1, const float *s0, int M, int N, int hs, int k);
    /* DCFormer++'s SwiGLU backward: from dp [M, F] (scaled in place by the
     * group gate when E > 0, dgate [M, E] written) to du, du3 [M, F] */
    void (*swiglu_bw)(dcs_backend *be, float *du, float *du3, float *dgate, float *dp, const float *u,
                      const float *u3, const float *gate, int M, int F, int E);
    /* Bytes of the largest scratch one backward operation above takes for
     * a tape of shape s (taken and given back inside the operation, in
     * stream order on a device; the CPU's per-thread buffers counted for
     * every thread): what the tape's memory plan and report add above its
     * own buffers (tape.c). NULL: none. */
    uint64_t (*bw_scratch)(dcs_backend *be, const dcs_bw_shape *s);

    /* ------------------------------------------------------------ memory plan
     * Bytes of the backend's memory free now (on a device: the driver's free
     * memory plus what the backend's own allocator holds unused) and in all;
     * 0 on success. NULL: the backend's memory is the host's (the caller
     * reads the host's available memory). */
    int (*mem_info)(dcs_backend *be, uint64_t *free_bytes, uint64_t *total_bytes);

    /* Optional: host memory of at least `bytes` owned by the backend (CUDA:
     * pinned, so downloads to it run at full speed), valid until the next
     * call or destroy; NULL: the caller uses its own buffer. The graph stages
     * the hooks' tensors in it. */
    void *(*host_staging)(dcs_backend *be, size_t bytes);
} dcs_backend_ops;

/* A backend: its operations and its state (device, streams, threads). */
struct dcs_backend {
    const dcs_backend_ops *ops;
    void *ctx;
};

dcs_backend *dcs_backend_cpu_create(int n_threads, dcs_err *e);

/* A product's output tiles in the CPU pool: gm x gn tiles of tm x tn (the
 * last row / column of tiles narrower). */
typedef struct {
    int tm, tn, gm, gn;
} dcs_gemm_grid;

/* dcs_cpu_partition (dclens.h): the CPU pool's items for one operation, by
 * the rule cpu_gemm / cpu_gemm_w / cpu_attention use. */
int64_t dcs_cpu_items(int op, const int *shape, int n_shape, int64_t *cost, int64_t cap);

/* dcs_blas_core (dclens.h): the kernel set of the CPU backend's BLAS. */
const char *dcs_cpu_blas_core(void);
/* dcs_blas_library (dclens.h): which BLAS, and its build line. */
const char *dcs_cpu_blas_library(void);
const char *dcs_cpu_blas_config(void);

/* ---------------------------------------------------------------- CUDA plugin
 *
 * The CUDA backend (cuda.cu) is a separate shared library, the plugin
 * libdclens_cuda.so, loaded with dlopen by cuda_plugin.c the first time a
 * CUDA model or the CUDA probe is asked for. So the engine itself (and the
 * Python module) needs no CUDA library and imports anywhere; where the
 * plugin or the CUDA runtime is missing, the probe says why.
 *
 * The plugin exports one symbol, DCS_CUDA_PLUGIN_SYMBOL, a function that
 * returns its table below. The loader refuses a plugin whose abi or struct
 * sizes differ from its own (a plugin left over from another build). */
#define DCS_CUDA_PLUGIN_ABI 5
#define DCS_CUDA_PLUGIN_SYMBOL "dcs_cuda_plugin_v1"
#define DCS_CUDA_PLUGIN_FILE "libdclens_cuda.so"
typedef struct {
    int abi;          /* DCS_CUDA_PLUGIN_ABI                     */
    size_t ops_size;  /* sizeof(dcs_backend_ops)                 */
    size_t args_size; /* sizeof of dcs_compose_args, dcs_attn_args, dcs_compose_bw_args, dcs_bw_shape */
    /* a backend on GPU `device` (its ops: the plugin's static table) */
    dcs_backend *(*create)(int device, dcs_err *e);
    /* 1 if a GPU is usable, else 0 and why */
    int (*probe)(char *why, size_t whylen);
} dcs_cuda_plugin;
typedef const dcs_cuda_plugin *(*dcs_cuda_plugin_fn)(void);

/* cuda_plugin.c: load the plugin (the file named by $DCLENS_CUDA_PLUGIN, else
 * DCS_CUDA_PLUGIN_FILE beside the binary holding the engine) and call it. */
dcs_backend *dcs_backend_cuda_create(int device, dcs_err *e);
int dcs_cuda_probe(char *why, size_t whylen);

#endif /* DCS_BACKEND_H */
