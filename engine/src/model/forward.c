/*
 * forward.c -- the model graph: one forward pass of DCPythia or Pythia,
 * written once over the backend interface (CPU or CUDA), with a hook call
 * at every named activation (shared/docs/hooks.md).
 *
 * Shapes: B sequences of T tokens, M = B*T rows; D model dim, N heads,
 * Dh head dim, F MLP width, V vocab; DCMHA: C slots, K hidden, R rank.
 * Activations are row-major float32 in backend memory:
 *   x, h [M, D]   qkv [M, 3D]   q, k, v, z [B, T, N, Dh]
 *   scores/pattern [B, N, T, T]   dynamic weights [B, T, R, N], gates [B, T, N]
 *
 * Hooks cost nothing when not asked for: optional tensors (compose
 * branches, head_out) are only materialised for the layers whose hooks
 * want them, and nothing is copied to the host otherwise.
 */
#include "dcs_model.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_BUFS 64

/* State of one forward pass. */
typedef struct {
    dcs_model *m;
    dcs_backend *be;
    const dcs_hooks *hooks;
    int B, T, M;
    struct { void *p; size_t bytes; } bufs[MAX_BUFS];  /* in use by this pass */
    int n_bufs;
    uint64_t in_use, peak, total;  /* activation bytes: now, at most, requested */
    float *host;            /* staging for hooks on a non-host backend */
    size_t host_cap;
    dcs_status status;
} fw;

/* ---------------------------------------------------------------- memory */

/* Allocate n1*n2*n3 floats (checked), remembered for the end of the pass. */
static float *fw_alloc(fw *f, int64_t n1, int64_t n2, int64_t n3) {
    uint64_t n, bytes;
    if (f->status) return NULL;
    if (!dcs_mul_ok((uint64_t)n1, (uint64_t)n2, &n) || !dcs_mul_ok(n, (uint64_t)n3, &n) ||
        !dcs_mul_ok(n, sizeof(float), &bytes) || bytes > ((uint64_t)1 << 46)) {
        f->status = dcs_seterr(&f->m->err, DCS_ERR_NOMEM,
                               "forward: activation of %lld x %lld x %lld floats is too large",
                               (long long)n1, (long long)n2, (long long)n3);
        return NULL;
    }
    if (f->n_bufs == MAX_BUFS) {
        f->status = dcs_seterr(&f->m->err, DCS_ERR_NOMEM, "forward: too many buffers");
        return NULL;
    }
    /* a buffer of this size from the model's pool, else a new one */
    float *p = dcs_pool_take(f->m, (size_t)bytes);
    if (!p) p = f->be->ops->alloc(f->be, (size_t)bytes);
    if (!p) {
        f->status = dcs_seterr(&f->m->err, DCS_ERR_NOMEM,
                               "forward: out of memory allocating %llu bytes (B=%d, T=%d)",
                               (unsigned long long)bytes, f->B, f->T);
        return NULL;
    }
    f->bufs[f->n_bufs].p = p;
    f->bufs[f->n_bufs].bytes = (size_t)bytes;
    f->n_bufs++;
    f->total += bytes;
    f->in_use += bytes;
    if (f->in_use > f->peak) f->peak = f->in_use;
    return p;
}

static void fw_release(fw *f, float *p) {
    if (!p) return;
    for (int i = 0; i < f->n_bufs; i++)
        if (f->bufs[i].p == p) {
            dcs_pool_put(f->m, p, f->bufs[i].bytes);
            f->in_use -= f->bufs[i].bytes;
            f->bufs[i] = f->bufs[--f->n_bufs];
            return;
        }
}

/* ---------------------------------------------------------------- hooks */

static int wants(const fw *f, int point, int layer) {
    if (!f->hooks || !f->hooks->want || !f->hooks->fn) return 0;
    if (!dcs_hook_exists(f->m, point)) return 0;
    return f->hooks->want[dcs_hook_index(f->m->cfg.n_layer, point, layer)] != 0;
}

/* Call the hook at (point, layer) on the activation `dev` if wanted.
 * Returns 1 if the hook modified it, 0 otherwise (or on error, with
 * f->status set). */
static int fw_hook(fw *f, int point, int layer, float *dev) {
    if (f->status || !wants(f, point, layer)) return 0;
    int64_t shape[6];
    int nd = dcs_hook_shape(f->m, point, f->B, f->T, shape);
    size_t n = 1;
    for (int i = 0; i < nd; i++) n *= (size_t)shape[i];
    float *data = dev;
    int on_host = f->m->device == DCS_DEVICE_CPU;
    if (!on_host) {
        if (n > f->host_cap) {
            free(f->host);
            f->host = malloc(n * sizeof(float));
            f->host_cap = f->host ? n : 0;
            if (!f->host) {
                f->status = dcs_seterr(&f->m->err, DCS_ERR_NOMEM, "hook %s: out of host memory",
                                       dcs_hook_point_name(point));
                return 0;
            }
        }
        f->be->ops->download(f->be, f->host, dev, n * sizeof(float));
        if ((f->status = f->be->ops->sync(f->be, &f->m->err))) return 0;
        data = f->host;
    }
    f->m->err.code = DCS_OK;
    f->m->err.msg[0] = 0;
    int r = f->hooks->fn(f->hooks->user, point, layer, data, shape, nd);
    if (r < 0) {
        if (f->m->err.code != DCS_ERR_HOOK) {
            if (dcs_hook_point_is_layered(point))
                dcs_seterr(&f->m->err, DCS_ERR_HOOK, "hook blocks.%d.%s aborted the forward pass",
                           layer, dcs_hook_point_name(point));
            else
                dcs_seterr(&f->m->err, DCS_ERR_HOOK, "hook %s aborted the forward pass",
                           dcs_hook_point_name(point));
        }
        f->status = DCS_ERR_HOOK;
        return 0;
    }
    if (r > 0 && dcs_hook_is_post_softmax_map(point))   /* writes to masked cells are ignored */
        dcs_mask_map(data, (long long)f->B * f->m->cfg.n_head, f->T, f->T, 0,
                     dcs_layer_is_local(f->m, layer) ? f->m->cfg.window_size : 0);
    if (r > 0 && !on_host) f->be->ops->upload(f->be, dev, f->host, n * sizeof(float));
    return r > 0;
}

/* Has dcs_cancel asked this pass to stop? Sets the status if so. */
static int fw_cancelled(fw *f) {
    if (f->status) return 1;
    if (!atomic_load(&f->m->cancel)) return 0;
    f->status = dcs_seterr(&f->m->err, DCS_ERR_CANCELLED, "forward: cancelled");
    return 1;
}

/* First NaN/inf of the logits [M, V] (host memory), or -1. */
static long long first_nonfinite(const float *x, size_t n) {
    const uint32_t *u = (const uint32_t *)(const void *)x;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {          /* branch-free blocks: vectorizes */
        uint32_t any = 0;
        for (size_t k = 0; k < 16; k++) any |= (uint32_t)((u[i + k] & 0x7f800000u) == 0x7f800000u);
        if (any) break;
    }
    for (; i < n; i++)
        if ((u[i] & 0x7f800000u) == 0x7f800000u) return (long long)i;
    return -1;
}

/* ---------------------------------------------------------------- layers */

/* C [M, N] = A [M, K] op(W): W [N, K] when transW (a torch Linear), else
 * [K, N]; float32 or (CPU) F16/BF16 widened tile by tile in the backend. */
static void gemm_wmat(fw *f, int transW, int M, int N, int K, const float *A, int lda,
                      dcs_wmat W, float *C, int ldc) {
    if (W.dtype == DCS_F32 || !f->be->ops->gemm_w)
        f->be->ops->gemm(f->be, 0, transW, M, N, K, 1.0f, A, lda, 0, W.p, transW ? K : N, 0, 0.0f, C,
                    ldc, 0, 1);
    else
        f->be->ops->gemm_w(f->be, transW, M, N, K, A, lda, W, C, ldc);
}

/* y [M, O] = x [M, I] W^T + b, W [O, I] row-major (a torch Linear). */
static void linear(fw *f, float *y, const float *x, dcs_wmat W, const float *b, int M,
                   int O, int I) {
    gemm_wmat(f, 1, M, O, I, x, I, W, y, O);
    if (b) f->be->ops->add_bias(f->be, y, b, M, O);
}

/* W as float32 in backend memory: itself, or (kept F16/BF16, CPU only) a
 * widened copy in an activation buffer the caller releases. */
static const float *wmat_f32(fw *f, dcs_wmat W, int64_t n, float **tmp) {
    *tmp = NULL;
    if (W.dtype == DCS_F32) return W.p;
    *tmp = fw_alloc(f, n, 1, 1);
    if (*tmp) dcs_widen(W.p, (uint64_t)n, W.dtype, *tmp);
    return *tmp;
}

/* Dynamic weights of one layer (model-spec 2 step 4), into per-slot
 * buffers: w1[c], w2[c] [B, T, R, N] (w1 RMS-normalised over N), dd[c]
 * [B, T, N]. Slots used: pre-q, pre-k, post-q, post-k (C = 4), or pre-q,
 * post-q (C = 2, query_wise; pre-k, post-k for key_wise). Key slots are
 * skipped when query_wise, query slots when key_wise. */
typedef struct {
    float *w1[2][2], *w2[2][2], *dd[2][2];   /* [phase][0 query, 1 key] */
} dyn_weights;

static void dynamic_weights(fw *f, const dcs_layer_weights *lw, const float *h, dyn_weights *dw) {
    const dcs_config *c = &f->m->cfg;
    const int M = f->M, D = c->d_model, N = c->n_head, R = c->dyn_rank;
    const int C = c->dyn_slots, K = c->dyn_hidden;
    /* G groups of Mg heads (model-spec 5): per group and slot its own hidden
     * layer and [2R, Mg] weights; G = 1 is the plain layout */
    const int G = c->compose_groups, Mg = N / G, GC = G * C, RM2 = 2 * R * Mg;
    dcs_backend *be = f->be;
    float *hid = fw_alloc(f, M, GC, K);      /* [M, G, C, K]      */
    float *w = fw_alloc(f, M, GC, RM2);      /* [M, G, C, 2R, Mg] */
    float *g = fw_alloc(f, M, GC, Mg);       /* [M, G, C, Mg]     */
    if (f->status) return;
    gemm_wmat(f, 0, M, GC * K, D, h, D, lw->m_dw1, hid, GC * K);
    be->ops->gelu(be, hid, (size_t)M * GC * K);
    /* w[:, gc] = hid[:, gc] @ qkw[gc], batched over the G*C (group, slot) pairs */
    be->ops->gemm(be, 0, 0, M, RM2, K, 1.0f, hid, GC * K, K, lw->qkw, RM2, (long long)K * RM2, 0.0f,
             w, GC * RM2, RM2, GC);
    be->ops->gemm(be, 0, 0, M, GC * Mg, D, 1.0f, h, D, 0, lw->dd, GC * Mg, 0, 0.0f, g, GC * Mg, 0, 1);
    be->ops->tanh_(be, g, (size_t)M * GC * Mg);
    for (int phase = 0; phase < 2; phase++)
        for (int side = 0; side < 2; side++) {
            dw->w1[phase][side] = dw->w2[phase][side] = dw->dd[phase][side] = NULL;
            if ((side == 1 && c->query_wise) || (side == 0 && c->key_wise)) continue;
            int slot = C == 4 ? 2 * phase + side : phase;   /* C == 2: one side only */
            float *w1 = fw_alloc(f, M, R, N), *w2 = fw_alloc(f, M, R, N), *dd = fw_alloc(f, M, N, 1);
            if (f->status) return;
            if (G == 1) {
                be->ops->copy2d(be, w1, R * N, w + (size_t)slot * RM2, C * RM2, M, R * N);
                be->ops->copy2d(be, w2, R * N, w + (size_t)slot * RM2 + R * N, C * RM2, M, R * N);
                be->ops->copy2d(be, dd, N, g + (size_t)slot * N, C * N, M, N);
            } else {
                /* [M, R, N] with group gr in columns [gr*Mg, (gr+1)*Mg) of each [R, N] row */
                for (int gr = 0; gr < G; gr++) {
                    const size_t src = (size_t)(gr * C + slot) * RM2;
                    for (int i = 0; i < R; i++) {
                        be->ops->copy2d(be, w1 + (size_t)i * N + gr * Mg, R * N, w + src + (size_t)i * Mg,
                                   GC * RM2, M, Mg);
                        be->ops->copy2d(be, w2 + (size_t)i * N + gr * Mg, R * N,
                                   w + src + (size_t)(R + i) * Mg, GC * RM2, M, Mg);
                    }
                    be->ops->copy2d(be, dd + (size_t)gr * Mg, N, g + (size_t)(gr * C + slot) * Mg, GC * Mg, M, Mg);
                }
            }
            /* RMS norm of qw1/kw1 over each group's heads */
            be->ops->rmsnorm(be, w1, M * R * G, Mg, Mg, NULL, 1e-6f);
            dw->w1[phase][side] = w1;
            dw->w2[phase][side] = w2;
            dw->dd[phase][side] = dd;
        }
    fw_release(f, hid);
    fw_release(f, w);
    fw_release(f, g);
}

static void dyn_hooks(fw *f, int l, dyn_weights *dw) {
    static const int pts[2][6] = {
        {DCS_HP_DYN_PRE_QW1, DCS_HP_DYN_PRE_QW2, DCS_HP_DYN_PRE_QDD, DCS_HP_DYN_PRE_KW1,
         DCS_HP_DYN_PRE_KW2, DCS_HP_DYN_PRE_KDD},
        {DCS_HP_DYN_POST_QW1, DCS_HP_DYN_POST_QW2, DCS_HP_DYN_POST_QDD, DCS_HP_DYN_POST_KW1,
         DCS_HP_DYN_POST_KW2, DCS_HP_DYN_POST_KDD}};
    for (int ph = 0; ph < 2; ph++)
        for (int side = 0; side < 2; side++) {
            if (!dw->w1[ph][side]) continue;
            fw_hook(f, pts[ph][3 * side + 0], l, dw->w1[ph][side]);
            fw_hook(f, pts[ph][3 * side + 1], l, dw->w2[ph][side]);
            fw_hook(f, pts[ph][3 * side + 2], l, dw->dd[ph][side]);
        }
}

/* Compose in place (pre: all pairs; post: allowed pairs only), with the
 * branch hooks of this phase: if any is wanted, all branches of the model
 * (five, or three when query_wise or key_wise, plus static with use_sw) are
 * materialised so that a rewritten branch enters the sum. */
static void compose(fw *f, int l, int phase, float *A, const dyn_weights *dw, int window) {
    const dcs_config *c = &f->m->cfg;
    const int B = f->B, T = f->T, N = c->n_head;
    static const int first[2] = {DCS_HP_PRE_SKIP, DCS_HP_POST_SKIP};
    const int nb = DCS_N_BRANCHES;   /* skip, qp, kp, qg, kg, static: consecutive points */
    int any = 0;
    for (int k = 0; k < nb; k++) any |= wants(f, first[phase] + k, l);
    dcs_compose_args a = {0};
    a.out = A;
    a.in = A;
    a.qw1 = dw->w1[phase][0];
    a.qw2 = dw->w2[phase][0];
    a.qdd = dw->dd[phase][0];
    a.kw1 = dw->w1[phase][1];
    a.kw2 = dw->w2[phase][1];
    a.kdd = dw->dd[phase][1];
    a.B = B;
    a.N = N;
    a.T = T;
    a.S = T;
    a.R = c->dyn_rank;
    a.G = c->compose_groups;
    a.sw = c->use_sw ? (phase == 0 ? f->m->layers[l].pre_sw : f->m->layers[l].post_sw) : NULL;
    a.causal_only = phase == 1;
    a.window = window;
    if (any)
        for (int k = 0; k < nb; k++)
            if (dcs_hook_exists(f->m, first[phase] + k)) a.br[k] = fw_alloc(f, B, N, (int64_t)T * T);
    if (f->status) return;
    f->be->ops->compose(f->be, &a);
    if (!any) return;
    int modified = 0;
    for (int k = 0; k < nb; k++)
        if (a.br[k]) modified |= fw_hook(f, first[phase] + k, l, a.br[k]);
    if (modified) {
        size_t n = (size_t)B * N * T * T;
        f->be->ops->copy(f->be, A, a.br[0], n * sizeof(float));
        for (int k = 1; k < nb; k++)
            if (a.br[k]) f->be->ops->add(f->be, A, a.br[k], n);
    }
    for (int k = 0; k < nb; k++) fw_release(f, a.br[k]);
}

/* MoH routing of layer l (model-spec 5) on h [M, D] (normed): the router
 * logits and routing scores, each through its hook, then z [M, N, Dh] *= g.
 * A rewritten router_logits feeds the routing computed from it; a rewritten
 * routing is the gate applied. */
static void moh_gate(fw *f, int l, const float *h, float *z) {
    const dcs_config *c = &f->m->cfg;
    const dcs_layer_weights *lw = &f->m->layers[l];
    const int M = f->M, D = c->d_model, N = c->n_head, hs = c->moh_shared;
    float *lg = fw_alloc(f, M, N - hs, 1), *g = fw_alloc(f, M, N, 1);
    float *s1 = hs > 1 ? fw_alloc(f, M, hs, 1) : NULL, *s0 = hs > 0 ? fw_alloc(f, M, 2, 1) : NULL;
    if (f->status) return;
    linear(f, lg, h, (dcs_wmat){lw->moh_wg, DCS_F32}, NULL, M, N - hs, D);
    if (s1) linear(f, s1, h, (dcs_wmat){lw->moh_wg1, DCS_F32}, NULL, M, hs, D);
    if (s0) linear(f, s0, h, (dcs_wmat){lw->moh_wg0, DCS_F32}, NULL, M, 2, D);
    fw_hook(f, DCS_HP_ROUTER_LOGITS, l, lg);
    f->be->ops->moh_route(f->be, g, lg, s1, s0, M, N, hs, c->moh_topk);
    fw_hook(f, DCS_HP_ROUTING, l, g);
    f->be->ops->head_gate(f->be, z, g, M, N, c->head_dim);
    fw_release(f, lg);
    fw_release(f, g);
    fw_release(f, s1);
    fw_release(f, s0);
}

static void release_dyn(fw *f, dyn_weights *dw) {
    for (int ph = 0; ph < 2; ph++)
        for (int s = 0; s < 2; s++) {
            fw_release(f, dw->w1[ph][s]);
            fw_release(f, dw->w2[ph][s]);
            fw_release(f, dw->dd[ph][s]);
            dw->w1[ph][s] = dw->w2[ph][s] = dw->dd[ph][s] = NULL;
        }
}

/* Is any hook on this layer's [N, T, S] maps asked for? Then the layer
 * runs the full (materialising) path. */
static int attn_map_hooked(const fw *f, int l) {
    for (int p = DCS_HP_SCORES; p <= DCS_HP_PATTERN_COMPOSED; p++)
        if (wants(f, p, l)) return 1;
    return 0;
}

/* Configurations the fused kernel computes, by explicit checks: DCPythia
 * (dynamic composition with 4 slots, or query-wise with 2, or none) and
 * Pythia. The variants of model-spec 5 (static Talking-Heads branch, MoH
 * routing, grouped composition: dcs_layer_needs_full_path) and key-wise-only
 * composition take the full path, whose compose handles them; a variant
 * added later must add its switch here. */
static int fused_supported(const dcs_model *m, int l) {
    const dcs_config *c = &m->cfg;
    if (c->model_type != DCS_MODEL_DCPYTHIA && c->model_type != DCS_MODEL_GPT_NEOX) return 0;
    if (dcs_layer_needs_full_path(m, l) || c->moh) return 0;
    if (!c->use_dcmha) return 1;
    if (c->key_wise || c->use_sw || c->compose_groups != 1) return 0;
    if (c->dyn_rank < 1 || c->dyn_rank > DCS_MAX_R) return 0;
    /* query_wise: the key side is absent (dw.*[ph][1] NULL), whatever the slots */
    return c->dyn_slots == 4 || (c->dyn_slots == 2 && c->query_wise);
}

static void attention_out(fw *f, int l, float *z, float *out);

/* Attention of layer l on h [M, D] (normed); result in out [M, D]. */
static void attention(fw *f, int l, const float *h, float *out) {
    dcs_model *m = f->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_backend *be = f->be;
    const int B = f->B, T = f->T, M = f->M, D = c->d_model, N = c->n_head, Dh = c->head_dim;
    const int window = dcs_layer_is_local(m, l) ? c->window_size : 0;
    const long long TT = (long long)T * T;

    /* q, k, v [B, T, N, Dh] */
    float *qkv = fw_alloc(f, M, 3, D);
    float *q = fw_alloc(f, M, D, 1), *k = fw_alloc(f, M, D, 1), *v = fw_alloc(f, M, D, 1);
    if (f->status) return;
    linear(f, qkv, h, lw->m_wqkv, lw->bqkv, M, 3 * D, D);
    be->ops->copy2d(be, q, D, qkv, 3 * D, M, D);
    be->ops->copy2d(be, k, D, qkv + D, 3 * D, M, D);
    be->ops->copy2d(be, v, D, qkv + 2 * D, 3 * D, M, D);
    fw_release(f, qkv);
    if (c->qk_norm) {
        be->ops->rmsnorm(be, q, M * N, Dh, Dh, lw->q_scale, 1e-6f);
        be->ops->rmsnorm(be, k, M * N, Dh, Dh, lw->k_scale, 1e-6f);
    }
    be->ops->rotary(be, q, M, T, N, Dh, c->rotary_dim, c->rope_base);
    be->ops->rotary(be, k, M, T, N, Dh, c->rotary_dim, c->rope_base);
    fw_hook(f, DCS_HP_Q, l, q);
    fw_hook(f, DCS_HP_K, l, k);
    fw_hook(f, DCS_HP_V, l, v);

    dyn_weights dw;
    memset(&dw, 0, sizeof dw);
    if (c->use_dcmha) {
        dynamic_weights(f, lw, h, &dw);
        dyn_hooks(f, l, &dw);
    }
    float *z = NULL;
    if (f->status) return;
    if (be->ops->attention && fused_supported(m, l) && !attn_map_hooked(f, l)) {
        /* fused: no [B, N, T, S] tensor; local layers touch their window only */
        z = fw_alloc(f, M, D, 1);
        if (f->status) return;
        dcs_attn_args a;
        memset(&a, 0, sizeof a);
        a.z = z;
        a.q = q;
        a.k = k;
        a.v = v;
        a.B = B;
        a.T = T;
        a.N = N;
        a.Dh = Dh;
        a.ld = D;
        a.R = c->dyn_rank;
        a.window = window;
        a.scale = 1.0f / sqrtf((float)Dh);
        a.compose = c->use_dcmha;
        for (int ph = 0; ph < 2 && a.compose; ph++) {
            a.qw1[ph] = dw.w1[ph][0];
            a.qw2[ph] = dw.w2[ph][0];
            a.qdd[ph] = dw.dd[ph][0];
            a.kw1[ph] = dw.w1[ph][1];
            a.kw2[ph] = dw.w2[ph][1];
            a.kdd[ph] = dw.dd[ph][1];
        }
        be->ops->attention(be, &a);
        release_dyn(f, &dw);
        fw_release(f, q);
        fw_release(f, k);
        fw_release(f, v);
        attention_out(f, l, z, out);
        return;
    }

    /* scores A[b, n] [T, S] = q_n k_n^T / sqrt(Dh) */
    float *A = fw_alloc(f, B, N, TT);
    if (f->status) return;
    for (int b = 0; b < B; b++)
        be->ops->gemm(be, 0, 1, T, T, Dh, 1.0f / sqrtf((float)Dh), q + (size_t)b * T * D, D, Dh,
                 k + (size_t)b * T * D, D, Dh, 0.0f, A + (size_t)b * N * TT, T, TT, N);
    fw_release(f, q);
    fw_release(f, k);
    fw_hook(f, DCS_HP_SCORES, l, A);
    if (c->use_dcmha) {
        compose(f, l, 0, A, &dw, window);
        fw_hook(f, DCS_HP_SCORES_COMPOSED, l, A);
    }
    be->ops->softmax_masked(be, A, B * N, T, T, window);
    fw_hook(f, DCS_HP_PATTERN, l, A);
    if (c->use_dcmha) {
        compose(f, l, 1, A, &dw, window);
        fw_hook(f, DCS_HP_PATTERN_COMPOSED, l, A);
        release_dyn(f, &dw);
    }
    if (f->status) return;

    /* z[b, :, n] [T, Dh] = P[b, n] [T, S] @ v[b, :, n] [S, Dh] */
    z = fw_alloc(f, M, D, 1);
    if (f->status) return;
    for (int b = 0; b < B; b++)
        be->ops->gemm(be, 0, 0, T, Dh, T, 1.0f, A + (size_t)b * N * TT, T, TT, v + (size_t)b * T * D, D,
                 Dh, 0.0f, z + (size_t)b * T * D, D, Dh, N);
    fw_release(f, A);
    fw_release(f, v);
    if (c->moh) moh_gate(f, l, h, z);
    if (f->status) return;
    attention_out(f, l, z, out);
}

/* From z [M, N, Dh] to the attention output out [M, D] (hooks z, head_out,
 * attn.out); releases z. */
static void attention_out(fw *f, int l, float *z, float *out) {
    dcs_model *m = f->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_backend *be = f->be;
    const int M = f->M, D = c->d_model, N = c->n_head, Dh = c->head_dim;
    fw_hook(f, DCS_HP_Z, l, z);

    /* head_out [M, N, D]: z_n [M, Dh] @ wo[:, n*Dh:(n+1)*Dh]^T, batched over n */
    int from_heads = 0;
    if (wants(f, DCS_HP_HEAD_OUT, l)) {
        float *ho = fw_alloc(f, M, N, D), *wtmp;
        const float *wo = wmat_f32(f, lw->m_wo, (int64_t)D * D, &wtmp);
        if (f->status) return;
        be->ops->gemm(be, 0, 1, M, D, Dh, 1.0f, z, D, Dh, wo, D, Dh, 0.0f, ho, N * D, D, N);
        fw_release(f, wtmp);
        if (fw_hook(f, DCS_HP_HEAD_OUT, l, ho)) {
            /* out = sum_n head_out[:, n] + bo: a [M, N*D] x [N*D] ones-free sum via gemm */
            float *ones = fw_alloc(f, N, 1, 1);
            float *one_host = malloc(sizeof(float) * (size_t)N);
            if (!f->status && !one_host)
                f->status = dcs_seterr(&m->err, DCS_ERR_NOMEM, "out of memory");
            if (f->status) { free(one_host); return; }
            for (int n = 0; n < N; n++) one_host[n] = 1.0f;
            be->ops->upload(be, ones, one_host, sizeof(float) * (size_t)N);
            free(one_host);
            /* out [M, D] = sum_n ho[m, n, :] : batched over m as [1, N] x [N, D] */
            be->ops->gemm(be, 0, 0, 1, D, N, 1.0f, ones, N, 0, ho, D, (long long)N * D, 0.0f, out, D, D, M);
            if (lw->bo) be->ops->add_bias(be, out, lw->bo, M, D);
            fw_release(f, ones);
            from_heads = 1;
        }
        fw_release(f, ho);
    }
    if (!from_heads) linear(f, out, z, lw->m_wo, lw->bo, M, D, D);
    fw_release(f, z);
    fw_hook(f, DCS_HP_ATTN_OUT, l, out);
}

/* MLP of layer l on hn [M, D] (normed); result in out [M, D]. */
static void mlp(fw *f, int l, const float *hn, float *out) {
    const dcs_config *c = &f->m->cfg;
    const dcs_layer_weights *lw = &f->m->layers[l];
    const int M = f->M, D = c->d_model, F = c->d_ff;
    float *u = fw_alloc(f, M, F, 1);
    if (f->status) return;
    linear(f, u, hn, lw->m_w1, lw->b1, M, F, D);
    fw_hook(f, DCS_HP_MLP_PRE, l, u);
    f->be->ops->gelu(f->be, u, (size_t)M * F);
    fw_hook(f, DCS_HP_MLP_POST, l, u);
    linear(f, out, u, lw->m_w2, lw->b2, M, D, F);
    fw_release(f, u);
    fw_hook(f, DCS_HP_MLP_OUT, l, out);
}

/* Block l: x [M, D] -> x (in place). */
static void block(fw *f, int l, float *x) {
    const dcs_config *c = &f->m->cfg;
    const dcs_layer_weights *lw = &f->m->layers[l];
    dcs_backend *be = f->be;
    const int M = f->M, D = c->d_model;
    fw_hook(f, DCS_HP_RESID_PRE, l, x);
    float *h = fw_alloc(f, M, D, 1), *a = fw_alloc(f, M, D, 1), *o = fw_alloc(f, M, D, 1);
    if (f->status) return;
    be->ops->layernorm(be, h, x, lw->attn_norm_w, lw->attn_norm_b, M, D, c->norm_eps);
    fw_hook(f, DCS_HP_LN_ATTN, l, h);
    attention(f, l, h, a);
    if (f->status || fw_cancelled(f)) return;
    if (c->parallel_residual) {
        /* out = x + attn(ln1(x)) + mlp(ln2(x)) */
        be->ops->layernorm(be, h, x, lw->ffn_norm_w, lw->ffn_norm_b, M, D, c->norm_eps);
        fw_hook(f, DCS_HP_LN_MLP, l, h);
        mlp(f, l, h, o);
        be->ops->add(be, x, a, (size_t)M * D);
        be->ops->add(be, x, o, (size_t)M * D);
    } else {
        /* h = x + attn(ln1(x)); out = h + mlp(ln2(h)) */
        be->ops->add(be, x, a, (size_t)M * D);
        be->ops->layernorm(be, h, x, lw->ffn_norm_w, lw->ffn_norm_b, M, D, c->norm_eps);
        fw_hook(f, DCS_HP_LN_MLP, l, h);
        mlp(f, l, h, o);
        be->ops->add(be, x, o, (size_t)M * D);
    }
    fw_release(f, h);
    fw_release(f, a);
    fw_release(f, o);
    fw_hook(f, DCS_HP_RESID_POST, l, x);
}

/* ---------------------------------------------------------------- limits */

static const char *fmt_bytes(char *buf, size_t n, uint64_t bytes) {
    static const char *unit[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 6) { v /= 1024.0; u++; }
    snprintf(buf, n, "%.4g %s", v, unit[u]);
    return buf;
}

/* Total physical memory of this machine in bytes (0 if unknown). */
static uint64_t phys_mem_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    return pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : 0;
}

/* Refuse, before anything is allocated, a pass that cannot fit: row counts
 * the kernels take as int must fit an int, and on the CPU the attention
 * map [B, N, T, T] (six of them while a layer's compose branches are
 * hooked) plus the per-token activations must fit in physical memory (a
 * larger calloc may succeed under overcommit and the process then dies
 * when the pages are touched). The CUDA backend reports a failed
 * cudaMalloc itself. B*T <= 2^24 was checked, so no product overflows. */
static dcs_status check_size(dcs_model *m, int B, int T, const dcs_hooks *hooks) {
    const dcs_config *c = &m->cfg;
    const uint64_t M = (uint64_t)B * (uint64_t)T, N = (uint64_t)c->n_head;
    const uint64_t D = (uint64_t)c->d_model;
    if (M * N > INT_MAX)
        return dcs_seterr(&m->err, DCS_ERR_ARG,
                          "forward: B*T*n_head = %llu rows is more than one pass takes (2^31 - 1; B=%d, T=%d)",
                          (unsigned long long)(M * N), B, T);
    int branches = 0, head_out = 0;
    if (hooks && hooks->want && hooks->fn)
        for (int l = 0; l < c->n_layer; l++) {
            for (int p = DCS_HP_PRE_SKIP; p <= DCS_HP_POST_STATIC; p++)
                if (p != DCS_HP_SCORES_COMPOSED && p != DCS_HP_PATTERN &&
                    dcs_hook_exists(m, p) && hooks->want[dcs_hook_index(c->n_layer, p, l)])
                    branches = (c->query_wise || c->key_wise ? 3 : 5) + (c->use_sw ? 1 : 0);
            if (hooks->want[dcs_hook_index(c->n_layer, DCS_HP_HEAD_OUT, l)]) head_out = 1;
        }
    /* M*T*N <= 2^24 * 2^24 * 2^12 = 2^60 floats: no overflow; totals in double */
    const uint64_t map = M * (uint64_t)T * N;                       /* floats */
    const uint64_t slots = (uint64_t)c->dyn_slots, K = (uint64_t)c->dyn_hidden;
    const uint64_t RN = (uint64_t)c->dyn_rank * N;
    const uint64_t per_token = 10 * D + (uint64_t)c->d_ff + (uint64_t)c->vocab +
                               (c->use_dcmha ? 2 * slots * (K * (uint64_t)c->compose_groups + 2 * RN + N) : 0) +
                               (c->moh ? 2 * N + 2 : 0) +
                               (head_out ? N * D : 0);
    const double total = 4.0 * ((double)map * (1 + branches) + (double)M * (double)per_token);
    const uint64_t limit = m->device == DCS_DEVICE_CPU ? phys_mem_bytes() : 0;
    const double cap = (double)((uint64_t)1 << 46);     /* fw_alloc's cap, any device */
    if ((limit && total > (double)limit) || 4.0 * (double)map > cap) {
        char b1[32], b2[32], b3[32];
        uint64_t lim = limit && (double)limit < cap ? limit : (uint64_t)1 << 46;
        uint64_t tot = total >= 1.8e19 ? UINT64_MAX : (uint64_t)total;
        return dcs_seterr(&m->err, DCS_ERR_NOMEM,
                          "forward: B=%d, T=%d needs %s for one attention map [B, %d heads, T, T]"
                          " (%s in all for this pass%s), more than the %s %s; use a smaller batch"
                          " or a shorter sequence",
                          B, T, fmt_bytes(b1, sizeof b1, 4 * map), c->n_head,
                          fmt_bytes(b2, sizeof b2, tot),
                          branches ? ", with the hooked compose branches" : "",
                          fmt_bytes(b3, sizeof b3, lim),
                          lim == limit ? "of memory of this machine" : "one pass may allocate");
    }
    return DCS_OK;
}

dcs_status dcs_forward(dcs_model *m, const int32_t *tokens, int B, int T, float *logits,
                       const dcs_hooks *hooks) {
    return dcs_forward_at(m, tokens, B, T, NULL, 0, logits, hooks);
}

dcs_status dcs_forward_at(dcs_model *m, const int32_t *tokens, int B, int T,
                          const int32_t *positions, int n_pos, float *logits,
                          const dcs_hooks *hooks) {
    if (!m) return DCS_ERR_ARG;
    const dcs_config *c = &m->cfg;
    m->err.code = DCS_OK;
    m->err.msg[0] = 0;
    if (!tokens)
        return dcs_seterr(&m->err, DCS_ERR_ARG, "forward: tokens is NULL");
    if (B <= 0 || T <= 0)
        return dcs_seterr(&m->err, DCS_ERR_ARG, "forward: need B >= 1 and T >= 1 tokens (got B=%d, T=%d)", B, T);
    if ((int64_t)B * T > (1 << 24))
        return dcs_seterr(&m->err, DCS_ERR_ARG, "forward: B*T = %lld tokens is more than one pass takes (16M)",
                          (long long)B * T);
    for (int64_t i = 0; i < (int64_t)B * T; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab)
            return dcs_seterr(&m->err, DCS_ERR_ARG,
                              "forward: token id %d at [%lld, %lld] is out of range [0, %d)", tokens[i],
                              (long long)(i / T), (long long)(i % T), c->vocab);
    if (positions) {
        if (n_pos <= 0 || n_pos > T)
            return dcs_seterr(&m->err, DCS_ERR_ARG,
                              "forward: logits_at needs 1 to T = %d positions per sequence (got %d)", T, n_pos);
        for (int64_t i = 0; i < (int64_t)B * n_pos; i++)
            if (positions[i] < 0 || positions[i] >= T)
                return dcs_seterr(&m->err, DCS_ERR_ARG,
                                  "forward: logits_at position %d of sequence %lld is out of range [0, %d)",
                                  positions[i], (long long)(i / n_pos), T);
    }
    dcs_status st = check_size(m, B, T, hooks);
    if (st) return st;
    fw f;
    memset(&f, 0, sizeof f);
    f.m = m;
    f.be = m->be;
    f.hooks = hooks;
    f.B = B;
    f.T = T;
    f.M = B * T;
    const int M = f.M, D = c->d_model, V = c->vocab;

    float *x = fw_alloc(&f, M, D, 1);
    if (!f.status) {
        if (m->m_tok_emb.dtype == DCS_F32 || !f.be->ops->embed_w)
            f.be->ops->embed(f.be, x, m->m_tok_emb.p, tokens, M, D);
        else
            f.be->ops->embed_w(f.be, x, m->m_tok_emb, tokens, M, D);
        fw_hook(&f, DCS_HP_EMBED, 0, x);
    }
    for (int l = 0; l < c->n_layer && !f.status; l++) {
        if (fw_cancelled(&f)) break;
        block(&f, l, x);
        if (!f.status) f.status = f.be->ops->sync(f.be, &m->err);
    }
    const int final_hooked = wants(&f, DCS_HP_LN_FINAL, 0) || wants(&f, DCS_HP_LOGITS, 0);
    if (!f.status && positions && logits && !final_hooked) {
        /* logits only at the asked positions: [B, n_pos] rows of x */
        const int P = B * n_pos;
        float *xs = fw_alloc(&f, P, D, 1), *hn = fw_alloc(&f, P, D, 1);
        int direct = m->device == DCS_DEVICE_CPU;
        float *lg = direct ? logits : fw_alloc(&f, P, V, 1);
        if (!f.status) {
            for (int b = 0; b < B; b++)
                for (int i = 0; i < n_pos; i++)
                    f.be->ops->copy(f.be, xs + ((size_t)b * n_pos + i) * D,
                               x + ((size_t)b * T + positions[b * n_pos + i]) * D, sizeof(float) * D);
            f.be->ops->layernorm(f.be, hn, xs, m->norm_w, m->norm_b, P, D, c->norm_eps);
            linear(&f, lg, hn, m->m_out_w, NULL, P, V, D);
            if (!direct) f.be->ops->download(f.be, logits, lg, sizeof(float) * (size_t)P * V);
        }
    } else if (!f.status && (logits || final_hooked)) {
        float *hn = fw_alloc(&f, M, D, 1);
        /* on the host, logits go straight into the caller's buffer */
        int direct = logits && !positions && m->device == DCS_DEVICE_CPU;
        float *lg = direct ? logits : fw_alloc(&f, M, V, 1);
        if (!f.status) {
            f.be->ops->layernorm(f.be, hn, x, m->norm_w, m->norm_b, M, D, c->norm_eps);
            fw_hook(&f, DCS_HP_LN_FINAL, 0, hn);
            linear(&f, lg, hn, m->m_out_w, NULL, M, V, D);
            fw_hook(&f, DCS_HP_LOGITS, 0, lg);
            if (!f.status && logits && positions) {     /* hooked final: gather rows */
                if ((f.status = f.be->ops->sync(f.be, &m->err)) == DCS_OK)
                    for (int b = 0; b < B; b++)
                        for (int i = 0; i < n_pos; i++)
                            f.be->ops->download(f.be, logits + ((size_t)b * n_pos + i) * V,
                                           lg + ((size_t)b * T + positions[b * n_pos + i]) * V,
                                           sizeof(float) * (size_t)V);
            } else if (!f.status && logits && !direct)
                f.be->ops->download(f.be, logits, lg, sizeof(float) * (size_t)M * V);
        }
    }
    if (!f.status) {
        f.status = f.be->ops->sync(f.be, &m->err);
        const int rows = positions ? n_pos : T;     /* logits rows per sequence */
        long long bad = !f.status && logits ? first_nonfinite(logits, (size_t)B * rows * V) : -1;
        if (bad >= 0) {
            const long long b = bad / V / rows, r = bad / V % rows;
            f.status = dcs_seterr(&m->err, DCS_ERR_NONFINITE,
                                  "forward: the logits hold NaN or inf (first at batch %lld, position "
                                  "%lld, token %lld): non-finite weights, an overflow, or a hook that "
                                  "wrote huge values", b, positions ? (long long)positions[b * n_pos + r] : r,
                                  bad % V);
        }
    } else {
        dcs_err ignored; /* drain a backend error behind the one reported */
        f.be->ops->sync(f.be, &ignored);
    }
    m->last_peak_bytes = f.peak;
    m->last_total_bytes = f.total;
    for (int i = 0; i < f.n_bufs; i++) dcs_pool_put(m, f.bufs[i].p, f.bufs[i].bytes);
    if (f.status) dcs_pool_clear(m); /* after a failure, give memory back */
    free(f.host);
    return f.status;
}
