/*
 * pass.c -- the state of one pass over the layers (pass.h): its memory
 * (the model's activation pool), hook dispatch with the write rule of
 * hooks.md, cancellation, the weight products and the layer plan.
 * The forward, the decoder and the tape all run through it.
 */
#include "pass.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- the layer plan */

/* Configurations the fused attention kernel computes, by explicit checks:
 * DCPythia (dynamic composition with 4 slots, or query-wise with 2, or
 * none) and Pythia. The variants of model-spec 5 (static Talking-Heads
 * branch, MoH routing, grouped composition) and key-wise-only composition
 * take the full path, whose compose handles them; a variant added later
 * must add its switch here. */
static int fused_supported(const dcs_config *c) {
    if (c->model_type != DCS_MODEL_DCPYTHIA && c->model_type != DCS_MODEL_GPT_NEOX &&
        c->model_type != DCS_MODEL_DCFORMER) /* DCFormer++: DCPythia's attention */
        return 0;
    if (c->moh) return 0;
    if (!c->use_dcmha) return 1;
    if (c->key_wise || c->use_sw || c->compose_groups != 1) return 0;
    if (c->dyn_rank < 1 || c->dyn_rank > DCS_MAX_R) return 0;
    /* query_wise: the key side is absent, whatever the slots */
    return c->dyn_slots == 4 || (c->dyn_slots == 2 && c->query_wise);
}

static dcs_layer_plan plan_of(const dcs_model *m, int l) {
    const dcs_config *c = &m->cfg;
    dcs_layer_plan pl;
    memset(&pl, 0, sizeof pl);
    if (c->model_type == DCS_MODEL_DCFORMER) {
        /* DCFormer++: RMSNorm pre-norm, sequential residual, SwiGLU MLP */
        pl.norm = DCS_NORM_RMS;
        pl.mlp = DCS_MLP_SWIGLU;
        pl.mlp_gate = c->mgate_dim > 0 ? c->mgate_dim : 0;
    } else {
        /* DCPythia and Pythia (GPT-NeoX): LayerNorm, GELU MLP, residual per config */
        pl.norm = DCS_NORM_LAYER;
        pl.mlp = DCS_MLP_GELU;
        pl.parallel_residual = c->parallel_residual;
    }
    pl.window = dcs_layer_is_local(m, l) ? c->window_size : 0;
    pl.qk_norm = c->qk_norm;
    pl.moh = c->moh;
    for (int ph = 0; ph < 2; ph++)
        for (int side = 0; side < 2; side++) pl.slot[ph][side] = -1;
    if (c->use_dcmha) {
        pl.dcmha = 1;
        pl.slots = c->dyn_slots;
        pl.groups = c->compose_groups;
        pl.static_branch = c->use_sw;
        for (int ph = 0; ph < 2; ph++)
            for (int side = 0; side < 2; side++)
                if (!((side == 1 && c->query_wise) || (side == 0 && c->key_wise)))
                    pl.slot[ph][side] = c->dyn_slots == 4 ? 2 * ph + side : ph; /* C == 2: one side only */
        pl.row_compose = !(c->use_sw || c->compose_groups > 1 || c->key_wise);
    }
    pl.fused = fused_supported(c);
    return pl;
}

dcs_status dcs_plan_layers(dcs_model *m, dcs_err *e) {
    const int L = m->cfg.n_layer;
    free(m->plan);
    m->plan = calloc((size_t)(L > 0 ? L : 1), sizeof *m->plan);
    if (!m->plan) return dcs_seterr(e, DCS_ERR_NOMEM, "out of memory for the layer plan");
    for (int l = 0; l < L; l++) m->plan[l] = plan_of(m, l);
    return DCS_OK;
}

void dcs_act_sizes(const dcs_config *c, int B, int T, int S, uint64_t sz[DCS_ACT_COUNT]) {
    const uint64_t M = (uint64_t)B * (uint64_t)T, N = (uint64_t)c->n_head;
    const uint64_t G = (uint64_t)(c->compose_groups > 0 ? c->compose_groups : 1);
    const uint64_t C = (uint64_t)c->dyn_slots, K = (uint64_t)c->dyn_hidden, R = (uint64_t)c->dyn_rank;
    sz[DCS_ACT_ROW_D] = M * (uint64_t)c->d_model;
    sz[DCS_ACT_ROW_F] = M * (uint64_t)c->d_ff;
    sz[DCS_ACT_HID] = c->use_dcmha ? M * G * C * K : 0;
    sz[DCS_ACT_GATES] = c->use_dcmha ? M * C * N : 0;
    sz[DCS_ACT_DYN_W] = c->use_dcmha ? M * R * N : 0;
    sz[DCS_ACT_DYN_D] = c->use_dcmha ? M * N : 0;
    sz[DCS_ACT_DYN_ALL] = c->use_dcmha ? M * C * 2 * R * N : 0;
    sz[DCS_ACT_MAP] = (uint64_t)B * N * (uint64_t)T * (uint64_t)S;
    sz[DCS_ACT_MGATE] = M * (uint64_t)(c->mgate_dim > 0 ? c->mgate_dim : 0);
    sz[DCS_ACT_HEADS] = M * N;
    sz[DCS_ACT_ROUTED] = c->moh ? M * (N - (uint64_t)c->moh_shared) : 0;
    sz[DCS_ACT_SHARED] = c->moh ? M * (uint64_t)c->moh_shared : 0;
    sz[DCS_ACT_BALANCE] = M * 2;
    sz[DCS_ACT_ROW_3D] = 3 * sz[DCS_ACT_ROW_D];
    sz[DCS_ACT_SHARED1] = M * (uint64_t)(c->moh && c->moh_shared > 0 ? c->moh_shared : 1);
}

const int dcs_dyn_points[2][2][3] = {{{DCS_HP_DYN_PRE_QW1, DCS_HP_DYN_PRE_QW2, DCS_HP_DYN_PRE_QDD},
                                      {DCS_HP_DYN_PRE_KW1, DCS_HP_DYN_PRE_KW2, DCS_HP_DYN_PRE_KDD}},
                                     {{DCS_HP_DYN_POST_QW1, DCS_HP_DYN_POST_QW2, DCS_HP_DYN_POST_QDD},
                                      {DCS_HP_DYN_POST_KW1, DCS_HP_DYN_POST_KW2, DCS_HP_DYN_POST_KDD}}};
const int dcs_branch_points[2][DCS_N_BRANCHES] = {
    {DCS_HP_PRE_SKIP, DCS_HP_PRE_QP, DCS_HP_PRE_KP, DCS_HP_PRE_QG, DCS_HP_PRE_KG, DCS_HP_PRE_STATIC},
    {DCS_HP_POST_SKIP, DCS_HP_POST_QP, DCS_HP_POST_KP, DCS_HP_POST_QG, DCS_HP_POST_KG, DCS_HP_POST_STATIC}};
const int dcs_split_points[3] = {DCS_HP_Q_INPUT, DCS_HP_K_INPUT, DCS_HP_V_INPUT};

int dcs_split_part(int point) {
    for (int i = 0; i < 3; i++)
        if (dcs_split_points[i] == point) return i;
    return -1;
}

/* ---------------------------------------------------------------- memory */

void dcs_pass_init(dcs_pass *p, dcs_model *m, const dcs_hooks *hooks, int B, int T, int t0,
                   const char *prefix, const char *what) {
    memset(p, 0, sizeof *p);
    p->m = m;
    p->be = m->be;
    p->hooks = hooks;
    p->B = B;
    p->T = T;
    p->t0 = t0;
    p->M = B * T;
    p->prefix = prefix;
    p->what = what;
}

float *dcs_pass_alloc(dcs_pass *p, int64_t n1, int64_t n2, int64_t n3) {
    uint64_t n, bytes;
    if (p->status) return NULL;
    if (!dcs_mul_ok((uint64_t)n1, (uint64_t)n2, &n) || !dcs_mul_ok(n, (uint64_t)n3, &n) ||
        !dcs_mul_ok(n, sizeof(float), &bytes) || bytes > ((uint64_t)1 << 46)) {
        p->status =
            dcs_seterr(&p->m->err, DCS_ERR_NOMEM, "%s: activation of %lld x %lld x %lld floats is too large",
                       p->prefix, (long long)n1, (long long)n2, (long long)n3);
        return NULL;
    }
    if (p->n_bufs == DCS_PASS_MAX_BUFS) {
        p->status = dcs_seterr(&p->m->err, DCS_ERR_NOMEM, "%s: too many buffers", p->prefix);
        return NULL;
    }
    /* a buffer of this size from the model's pool, else a new one */
    float *x = dcs_pool_take(p->m, (size_t)bytes);
    if (!x) x = p->be->ops->alloc(p->be, (size_t)bytes);
    if (!x) {
        p->status =
            dcs_seterr(&p->m->err, DCS_ERR_NOMEM, "%s: out of memory allocating %llu bytes (B=%d, T=%d)",
                       p->prefix, (unsigned long long)bytes, p->B, p->T);
        return NULL;
    }
    p->bufs[p->n_bufs].p = x;
    p->bufs[p->n_bufs].bytes = (size_t)bytes;
    p->n_bufs++;
    p->total += bytes;
    p->in_use += bytes;
    if (p->in_use > p->peak) p->peak = p->in_use;
    return x;
}

void dcs_pass_release(dcs_pass *p, float *x) {
    if (!x) return;
    for (int i = 0; i < p->n_bufs; i++)
        if (p->bufs[i].p == x) {
            dcs_pool_put(p->m, x, p->bufs[i].bytes);
            p->in_use -= p->bufs[i].bytes;
            p->bufs[i] = p->bufs[--p->n_bufs];
            return;
        }
}

void dcs_pass_end(dcs_pass *p) {
    if (p->status) {
        dcs_err ignored; /* drain a backend error behind the one reported */
        p->be->ops->sync(p->be, &ignored);
    }
    for (int i = 0; i < p->n_bufs; i++) dcs_pool_put(p->m, p->bufs[i].p, p->bufs[i].bytes);
    p->n_bufs = 0;
    if (p->status) dcs_pool_clear(p->m); /* after a failure, give memory back */
    free(p->host);
    p->host = NULL;
    p->host_cap = 0;
}

/* ---------------------------------------------------------------- hooks */

int dcs_pass_wants(const dcs_pass *p, int point, int layer) {
    if (!p->hooks || !p->hooks->want || !p->hooks->fn) return 0;
    if (!dcs_hook_exists(p->m, point)) return 0;
    return p->hooks->want[dcs_hook_index(p->m->cfg.n_layer, point, layer)] != 0;
}

static int is_map(int point) { return dcs_hook_point_map(point) != 0; }

/* Host memory for n floats of staging. */
static float *staging(dcs_pass *p, size_t n, int point) {
    if (p->be->ops->host_staging) { /* the backend's (CUDA: pinned) */
        float *h = p->be->ops->host_staging(p->be, n * sizeof(float));
        if (h) return h;
    }
    if (n > p->host_cap) {
        free(p->host);
        p->host = malloc(n * sizeof(float));
        p->host_cap = p->host ? n : 0;
        if (!p->host) {
            p->status = dcs_seterr(&p->m->err, DCS_ERR_NOMEM, "hook %s: out of host memory",
                                   dcs_hook_point_name(point));
            return NULL;
        }
    }
    return p->host;
}

/* Call the hook on `dev` ([B, ...], backend memory, the hook's full shape). */
static int call_hook(dcs_pass *p, int point, int layer, float *dev) {
    int64_t shape[6];
    int nd = dcs_hook_shape(p->m, point, p->B, p->T, shape);
    if (is_map(point)) shape[3] = p->t0 + p->T;
    size_t n = 1;
    for (int i = 0; i < nd; i++) n *= (size_t)shape[i];
    float *data = dev;
    const int on_host = p->m->device == DCS_DEVICE_CPU;
    if (!on_host) {
        if (!(data = staging(p, n, point))) return 0;
        p->be->ops->download(p->be, data, dev, n * sizeof(float));
        if ((p->status = p->be->ops->sync(p->be, &p->m->err))) return 0;
    }
    p->m->err.code = DCS_OK;
    p->m->err.msg[0] = 0;
    int r = p->hooks->fn(p->hooks->user, point, layer, data, shape, nd);
    if (r < 0) {
        if (p->m->err.code != DCS_ERR_HOOK) {
            if (dcs_hook_point_is_layered(point))
                dcs_seterr(&p->m->err, DCS_ERR_HOOK, "hook blocks.%d.%s aborted the %s", layer,
                           dcs_hook_point_name(point), p->what);
            else
                dcs_seterr(&p->m->err, DCS_ERR_HOOK, "hook %s aborted the %s", dcs_hook_point_name(point),
                           p->what);
        }
        p->status = DCS_ERR_HOOK;
        return 0;
    }
    if (r > 0 && dcs_hook_is_post_softmax_map(point)) /* writes to masked cells are ignored */
        dcs_mask_map(data, (long long)p->B * p->m->cfg.n_head, p->T, (int)shape[3], p->t0,
                     dcs_layer_is_local(p->m, layer) ? p->m->cfg.window_size : 0);
    if (r > 0 && !on_host) p->be->ops->upload(p->be, dev, data, n * sizeof(float));
    return r > 0;
}

int dcs_pass_hook(dcs_pass *p, int point, int layer, float *dev) {
    if (p->status || !dcs_pass_wants(p, point, layer)) return 0;
    return call_hook(p, point, layer, dev);
}

int dcs_pass_hook_map(dcs_pass *p, int point, int layer, float *dev, int S, int kb) {
    if (p->status || !dcs_pass_wants(p, point, layer)) return 0;
    const int P = p->t0 + p->T;
    if (kb == 0 && S == P) return call_hook(p, point, layer, dev);
    /* keys held at kb .. kb+S-1 of positions 0 .. P-1: through [B*N*T, P] */
    const long long rows = (long long)p->B * p->m->cfg.n_head * p->T;
    float *full = p->be->ops->alloc(p->be, sizeof(float) * (size_t)rows * P); /* zero-filled */
    if (!full) {
        p->status =
            dcs_seterr(&p->m->err, DCS_ERR_NOMEM, "hook %s: out of memory", dcs_hook_point_name(point));
        return 0;
    }
    p->be->ops->copy2d(p->be, full + kb, P, dev, S, (int)rows, S);
    int r = call_hook(p, point, layer, full);
    if (r) p->be->ops->copy2d(p->be, dev, S, full + kb, P, (int)rows, S);
    p->be->ops->free(p->be, full); /* stream-ordered on CUDA */
    return r;
}

int dcs_pass_cancelled(dcs_pass *p) {
    if (p->status) return 1;
    if (!atomic_load(&p->m->cancel)) return 0;
    p->status = dcs_seterr(&p->m->err, DCS_ERR_CANCELLED, "%s: cancelled", p->prefix);
    return 1;
}

/* ---------------------------------------------------------------- products */

void dcs_pass_linear(dcs_pass *p, float *y, const float *x, dcs_wmat W, const float *b, int M, int O, int I) {
    dcs_backend *be = p->be;
    if (W.dtype == DCS_F32 || !be->ops->gemm_w)
        be->ops->gemm(be, 0, 1, M, O, I, 1.0f, x, I, 0, W.p, I, 0, 0.0f, y, O, 0, 1);
    else
        be->ops->gemm_w(be, 1, M, O, I, x, I, W, 0.0f, y, O);
    if (b) be->ops->add_bias(be, y, b, M, O);
}

void dcs_pass_embed(dcs_pass *p, const int32_t *tokens, float *x) {
    const dcs_model *m = p->m;
    dcs_backend *be = p->be;
    if (p->status) return;
    if (m->m_tok_emb.dtype == DCS_F32 || !be->ops->embed_w)
        be->ops->embed(be, x, m->m_tok_emb.p, tokens, p->M, m->cfg.d_model);
    else
        be->ops->embed_w(be, x, m->m_tok_emb, tokens, p->M, m->cfg.d_model);
    dcs_pass_hook(p, DCS_HP_EMBED, 0, x);
}

/* A product of two activations: through gemm_x with inputs in `dt` (the
 * model's act_dtype) where the backend has it, else float32 gemm. */
static void act_gemm(dcs_backend *be, int dt, int tA, int tB, int M, int N, int K, float alpha,
                     const float *A, int lda, long long sA, const float *B, int ldb, long long sB, float *C,
                     int ldc, long long sC, int batch) {
    if (dt != DCS_F32 && be->ops->gemm_x)
        be->ops->gemm_x(be, dt, tA, tB, M, N, K, alpha, A, lda, sA, B, ldb, sB, 0.0f, C, ldc, sC, batch);
    else
        be->ops->gemm(be, tA, tB, M, N, K, alpha, A, lda, sA, B, ldb, sB, 0.0f, C, ldc, sC, batch);
}

void dcs_heads_map(dcs_backend *be, int dt, int B, int N, int T, int S, int Dh, int D, float alpha,
                   const float *x, const float *y, float *map) {
    const long long TS = (long long)T * S;
    for (int b = 0; b < B; b++)
        act_gemm(be, dt, 0, 1, T, S, Dh, alpha, x + (size_t)b * T * D, D, Dh, y + (size_t)b * S * D, D, Dh,
                 map + (size_t)b * N * TS, S, TS, N);
}

void dcs_heads_rows(dcs_backend *be, int dt, int trans, int B, int N, int T, int S, int Dh, int D,
                    float alpha, const float *map, const float *y, float *out) {
    const long long TS = (long long)T * S;
    const int rows = trans ? S : T, inner = trans ? T : S; /* out's rows; y's rows */
    for (int b = 0; b < B; b++)
        act_gemm(be, dt, trans, 0, rows, Dh, inner, alpha, map + (size_t)b * N * TS, S, TS,
                 y + (size_t)b * inner * D, D, Dh, out + (size_t)b * rows * D, D, Dh, N);
}

void dcs_pass_norm(dcs_pass *p, int kind, float *out, const float *x, const float *w, const float *b, int M) {
    const dcs_config *c = &p->m->cfg;
    const int D = c->d_model;
    switch (kind) {
    case DCS_NORM_RMS:
        p->be->ops->copy(p->be, out, x, sizeof(float) * (size_t)M * D);
        p->be->ops->rmsnorm(p->be, out, M, D, D, w, c->norm_eps);
        break;
    default: p->be->ops->layernorm(p->be, out, x, w, b, M, D, c->norm_eps);
    }
}
