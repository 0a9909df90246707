/*
 * tape.c -- the training / attribution graph: the one layer (layer.c) run
 * with keeping on (every activation its backward reads, dcs_kept), and
 * that backward, op by op in reverse (parameter gradients and gradients at
 * hook points). Every step runs on the model's backend (dcs_backend.h): the
 * products through its gemm / gemm_w, the per-element work through its
 * backward operations (zero, gelu_bw, softmax_bw, layernorm_bw, compose_bw,
 * ..., the math of dcs_math.h), so the same code differentiates a model on
 * the CPU (the pool, ops->parallel) or on CUDA. Host memory is touched only
 * at the edges: tokens, targets, overrides (the pass's hook dispatch), the
 * gradients handed out (download) and parameter gradients (device mirrors
 * on CUDA, uploaded and downloaded around the backward).
 *
 * Shapes: B sequences of T tokens, M = B*T; D, N, Dh, F, V as in layer.c;
 * DCMHA: C slots, K hidden, R rank, RN = R*N. All buffers float32 from the
 * backend's allocator (device memory on CUDA):
 *   kept per layer (pass.h): x, ln1, q, k, v, ..., A, P, Pc, z, ao, h, ln2, u, ug, mo
 *   xL [M, D] leaves the last layer; lnf [M, D]; logits, dlogits [M, V]
 * Hook points may be overridden in the forward (the activation replaced by
 * given data through the pass's hook dispatch, with its write rule;
 * everything downstream recomputed) and have their gradient captured in the
 * backward; an overridden activation is a constant, so no gradient flows
 * upstream of it. Norm statistics are recomputed in the backward from the
 * kept inputs (the forward's own row arithmetic, dcs_layernorm_row).
 */
#include "pass.h"
#include "backward.h"
#include "dcs_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* gradient buffers, reused by every layer */
typedef struct {
    float *dx, *dmo, *dug, *du, *dln2, *dao, *dz, *dv, *dq, *dk, *dqkv, *dln1;
    float *dPc, *dP, *dAc, *dA;
    float *dW, *dG, *dhid, *dw1raw;
    float *dsw[2];                          /* static maps [G, Mg, Mg] (use_sw)   */
    float *dmoh, *dhgate, *dlg, *ds1, *ds0; /* MoH: dh [M, D], head gate, logits */
    float *dw1[2][2], *dw2[2][2], *ddd[2][2];
    float *du3, *dgate; /* DCFormer++'s SwiGLU: [M, F], the group gate [M, E] */
} tgrads;

struct dcs_tape {
    dcs_model *m;
    int B, T, M;
    int B_cap, T_cap; /* the shape its buffers were sized for (dcs_tape_reshape) */
    /* The memory plan (dcs_tape_plan): every layer's activations kept, or
     * (recompute) only each layer's input x (the residual stream
     * checkpoint, L[l].x) and one layer's internals, shared by every L[l]:
     * the backward reruns layer l from its checkpoint before its backward,
     * through the same code (layer.c with keeping on), so the gradients are
     * the same bits as with the full tape. */
    int recompute;
    int first;          /* the first layer it runs (dcs_tape_new_from): the
                               layers below are the caller's, none kept      */
    int held;           /* the layer whose internals the shared buffers hold */
    float *xr;          /* [M, D] residual stream of a recomputed layer */
    uint64_t bytes;     /* the tape's own buffers                       */
    uint64_t pass_peak; /* the largest transient of its passes          */
    uint64_t bw_peak;   /* its last backward's scratch (ops->bw_scratch)
                           and device mirrors of parameter gradients     */
    int dry;            /* planning only: tp_alloc counts, allocates nothing */
    dcs_kept *L;
    float *xL, *lnf, *logits, *dlogits;
    int32_t *tokens; /* [M] host */
    tgrads d;
    const dcs_hook_override *ov;
    int n_ov;
    uint8_t *want;               /* [DCS_HP_COUNT * n_layer]: the overridden points */
    float *kT[2][3], *dkT[2][3]; /* CPU, per phase: transposed key-side dynamic weights and their grads */
    int have_forward;
    dcs_status status; /* allocation failure inside the backward */
    void **allocs;
    int n_allocs, cap_allocs;
};

/* n floats, zero-filled, from the backend's allocator */
static float *tp_alloc(dcs_tape *tp, size_t n) {
    tp->bytes += (uint64_t)(n ? n : 1) * sizeof(float);
    if (tp->dry) return (float *)tp; /* a plan: never dereferenced */
    if (tp->n_allocs == tp->cap_allocs) {
        int cap = tp->cap_allocs ? 2 * tp->cap_allocs : 256;
        void **a = realloc(tp->allocs, sizeof *a * (size_t)cap);
        if (!a) return NULL;
        tp->allocs = a;
        tp->cap_allocs = cap;
    }
    dcs_backend *be = tp->m->be;
    float *p = be->ops->alloc(be, (n ? n : 1) * sizeof(float));
    if (p) tp->allocs[tp->n_allocs++] = p;
    return p;
}

/* ---------------------------------------------------------------- products
 * The per-head products run through the backend's batched gemm. */

/* Per-head products of every sequence: for b < B and head h < N,
 * C[b, h] = alpha op(A[b, h]) op(B[b, h]) (+ beta C), the heads of one
 * sequence as one batched gemm (sequence strides sA, sB, sC; head strides hA,
 * hB, hC). */
typedef struct {
    int tA, tB, M, N, K;
    float alpha, beta;
    const float *A, *Bm;
    float *C;
    int lda, ldb, ldc;
    long long hA, hB, hC; /* head strides   */
    long long sA, sB, sC; /* sequence strides */
    int heads;
} hg_arg;

static void heads_gemm(const dcs_tape *tp, const hg_arg *g, int B) {
    dcs_backend *be = tp->m->be;
    for (int b = 0; b < B; b++)
        be->ops->gemm(be, g->tA, g->tB, g->M, g->N, g->K, g->alpha, g->A + b * g->sA, g->lda, g->hA,
                      g->Bm + b * g->sB, g->ldb, g->hB, g->beta, g->C + b * g->sC, g->ldc, g->hC, g->heads);
}

void dcs_tape_free(dcs_tape *tp) {
    if (!tp) return;
    dcs_model *m = tp->m;
    /* the transients its passes left in the model's pool are sized for
     * this tape's B x T: kept, they would add up over tapes of other sizes
     * (IG chunks) */
    if (!m->freed) dcs_pool_clear(m);
    for (int i = 0; i < tp->n_allocs; i++) m->be->ops->free(m->be, tp->allocs[i]);
    free(tp->tokens);
    free(tp->allocs);
    free(tp->L);
    free(tp->want);
    free(tp);
    /* the model waits for its last tape (dcs_free) */
    if (--m->n_tapes == 0 && m->n_decoders == 0 && m->freed) dcs_model_destroy(m);
}

/* The tape differentiates DCMHA, MHA and the variants of model-spec.md 5
 * (static branch, grouped composition, key-wise only: the per-pair compose
 * backward of dcs_math.h; MoH: through the routing scores of the selected
 * heads, the selection itself being discrete). */
dcs_status dcs_tape_supported(dcs_model *m) {
    (void)m;
    return DCS_OK;
}

/* What any layer of the model computes (the layer plans OR-ed; row_compose
 * only where every composing layer has it): the tape's shared buffers and
 * its gradient buffers serve every layer, so they are sized by it. */
static dcs_layer_plan any_layer(const dcs_model *m) {
    dcs_layer_plan u;
    memset(&u, 0, sizeof u);
    u.row_compose = 1;
    for (int ph = 0; ph < 2; ph++)
        for (int s = 0; s < 2; s++) u.slot[ph][s] = -1;
    for (int l = 0; l < m->cfg.n_layer; l++) {
        const dcs_layer_plan *p = &m->plan[l];
        u.qk_norm |= p->qk_norm;
        u.moh |= p->moh;
        u.dcmha |= p->dcmha;
        u.static_branch |= p->static_branch;
        u.mlp_gate = p->mlp_gate > u.mlp_gate ? p->mlp_gate : u.mlp_gate;
        if (p->mlp == DCS_MLP_SWIGLU) u.mlp = DCS_MLP_SWIGLU;
        if (p->dcmha && !p->row_compose) u.row_compose = 0;
        for (int ph = 0; ph < 2; ph++)
            for (int s = 0; s < 2; s++)
                if (p->slot[ph][s] >= 0) u.slot[ph][s] = p->slot[ph][s];
    }
    u.parallel_residual = 1; /* 0 where any layer keeps h (sequential) */
    for (int l = 0; l < m->cfg.n_layer; l++) u.parallel_residual &= m->plan[l].parallel_residual;
    if (!u.dcmha) u.row_compose = 0;
    return u;
}

#define A_(p, n)                                                                                             \
    do {                                                                                                     \
        if (ok && !((p) = tp_alloc(tp, (n)))) ok = 0;                                                        \
    } while (0)

/* The kept activations of a layer of plan pl (sizes from the layer's size
 * table, dcs_act_sizes); x too when with_x (else it is a checkpoint, set
 * later). */
static int alloc_kept(dcs_tape *tp, dcs_kept *a, const uint64_t *sz, int with_x, const dcs_layer_plan *pl) {
    const dcs_config *c = &tp->m->cfg;
    const size_t MD = sz[DCS_ACT_ROW_D], MF = sz[DCS_ACT_ROW_F], BNTT = sz[DCS_ACT_MAP];
    int ok = 1;
    if (with_x) A_(a->x, MD);
    A_(a->ln1, MD);
    A_(a->q, MD);
    A_(a->k, MD);
    A_(a->v, MD);
    if (pl->qk_norm) {
        A_(a->qraw, MD);
        A_(a->kraw, MD);
    }
    A_(a->A, BNTT);
    A_(a->P, BNTT);
    if (pl->dcmha) {
        A_(a->hpre, sz[DCS_ACT_HID]);
        A_(a->hid, sz[DCS_ACT_HID]);
        A_(a->g, sz[DCS_ACT_GATES]);
        A_(a->Pc, BNTT);
        for (int ph = 0; ph < 2; ph++)
            for (int s = 0; s < 2; s++) {
                if (pl->slot[ph][s] < 0) continue;
                A_(a->w1raw[ph][s], sz[DCS_ACT_DYN_W]);
                A_(a->w1[ph][s], sz[DCS_ACT_DYN_W]);
                A_(a->w2[ph][s], sz[DCS_ACT_DYN_W]);
                A_(a->dd[ph][s], sz[DCS_ACT_DYN_D]);
            }
    }
    A_(a->z, MD);
    A_(a->ao, MD);
    if (!pl->parallel_residual) A_(a->h, MD);
    A_(a->ln2, MD);
    A_(a->u, MF);
    A_(a->ug, MF);
    A_(a->mo, MD);
    if (pl->mlp == DCS_MLP_SWIGLU) A_(a->u3, MF);
    if (pl->mlp_gate > 0) A_(a->gate, (MD / (size_t)c->d_model) * (size_t)pl->mlp_gate);
    if (pl->moh) {
        const size_t M = MD / (size_t)c->d_model, N = c->n_head, hs = c->moh_shared;
        A_(a->zpre, MD);
        A_(a->hgate, M * N);
        A_(a->rlg, M * (N - hs));
        if (hs > 1) A_(a->rs1, M * hs);
        if (hs > 0) A_(a->rs0, M * 2);
    }
    return ok;
}

/* Every buffer of the tape under its plan (tp->recompute); with tp->dry
 * only their bytes are counted. 1 on success. */
static int alloc_tape(dcs_tape *tp) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const int B = tp->B, T = tp->T;
    const size_t M = (size_t)B * T, D = c->d_model, N = c->n_head, F = c->d_ff, V = c->vocab;
    const size_t Ls = c->n_layer;
    const size_t C = c->dyn_slots, RN = (size_t)c->dyn_rank * N;
    const dcs_layer_plan any = any_layer(m);
    uint64_t sz[DCS_ACT_COUNT];
    dcs_act_sizes(c, B, T, T, sz);
    const size_t BNTT = sz[DCS_ACT_MAP];
    int ok = 1;
    if (tp->recompute) {
        /* the checkpoints: one [M, D] per layer; one layer's internals */
        dcs_kept shared;
        memset(&shared, 0, sizeof shared);
        ok = alloc_kept(tp, &shared, sz, 0, &any);
        for (size_t l = (size_t)tp->first; ok && l < Ls; l++) {
            float *x = NULL;
            A_(x, M * D);
            if (!tp->dry && ok) {
                tp->L[l] = shared;
                tp->L[l].x = x;
            }
        }
        A_(tp->xr, M * D);
    } else {
        for (size_t l = (size_t)tp->first; ok && l < Ls; l++) {
            dcs_kept dummy, *a = tp->dry ? &dummy : &tp->L[l];
            ok = alloc_kept(tp, a, sz, 1, &m->plan[l]);
        }
    }
    A_(tp->xL, M * D);
    A_(tp->lnf, M * D);
    A_(tp->logits, M * V);
    A_(tp->dlogits, M * V);
    tp->bytes += M * sizeof(int32_t);
    if (ok && !tp->dry && !(tp->tokens = calloc(M, sizeof(int32_t)))) ok = 0;
    tgrads *d = &tp->d;
    if (any.row_compose && any.slot[0][1] >= 0 && m->device == DCS_DEVICE_CPU) /* a key side */
        for (int ph = 0; ph < 2; ph++) /* [B, C, Tp], Tp: T padded (dcs_compose_bw_args) */
            for (int i = 0; i < 3; i++) {
                const size_t Tp = ((size_t)T + DCS_KEY_PAD - 1) / DCS_KEY_PAD * DCS_KEY_PAD;
                A_(tp->kT[ph][i], (size_t)B * Tp * (i < 2 ? RN : N));
                A_(tp->dkT[ph][i], (size_t)B * Tp * (i < 2 ? RN : N));
            }
    A_(d->dx, M * D);
    A_(d->dmo, M * D);
    A_(d->dug, M * F);
    A_(d->du, M * F);
    A_(d->dln2, M * D);
    A_(d->dao, M * D);
    A_(d->dz, M * D);
    A_(d->dv, M * D);
    A_(d->dq, M * D);
    A_(d->dk, M * D);
    A_(d->dqkv, M * 3 * D);
    A_(d->dln1, M * D);
    A_(d->dP, BNTT);
    A_(d->dA, BNTT);
    if (any.mlp == DCS_MLP_SWIGLU) A_(d->du3, M * F);
    if (any.mlp_gate > 0) A_(d->dgate, M * (size_t)any.mlp_gate);
    if (any.moh) {
        const size_t hs = c->moh_shared;
        A_(d->dmoh, M * D);
        A_(d->dhgate, M * N);
        A_(d->dlg, M * (N - hs));
        A_(d->ds1, M * (hs ? hs : 1));
        A_(d->ds0, M * 2);
    }
    if (any.dcmha) {
        A_(d->dPc, BNTT);
        A_(d->dAc, BNTT);
        A_(d->dW, M * C * 2 * RN);
        A_(d->dG, M * C * N);
        A_(d->dhid, sz[DCS_ACT_HID]);
        A_(d->dw1raw, M * RN);
        for (int ph = 0; ph < 2; ph++)
            for (int s = 0; s < 2; s++) {
                A_(d->dw1[ph][s], M * RN);
                A_(d->dw2[ph][s], M * RN);
                A_(d->ddd[ph][s], M * N);
            }
    }
#undef A_
    return ok;
}

/* The transient of one pass of the tape over a layer (keeping on), above
 * the tape's own buffers: qkv [M, 3D] with the dynamic weights before
 * splitting [M, C*2R*N] (released before the maps), or a composed-score
 * map [B, N, T, T]; with head_out overridden or asked for, head_out
 * [M, N, D] and (F16/BF16) the widened wo [D, D]. A bound, not a
 * measurement: dcs_tape_memory reports what a run took. */
static uint64_t pass_transient(const dcs_model *m, int B, int T, int head_out) {
    const dcs_config *c = &m->cfg;
    uint64_t sz[DCS_ACT_COUNT];
    dcs_act_sizes(c, B, T, T, sz);
    uint64_t a = 3 * sz[DCS_ACT_ROW_D], b = sz[DCS_ACT_DYN_ALL] + sz[DCS_ACT_HID] + sz[DCS_ACT_GATES];
    uint64_t t = a > b ? a : b;
    if (any_layer(m).dcmha && sz[DCS_ACT_MAP] > t) t = sz[DCS_ACT_MAP];
    if (head_out) t += sz[DCS_ACT_ROW_D] * (uint64_t)c->n_head + (uint64_t)c->d_model * c->d_model;
    return t * sizeof(float);
}

/* The backend's scratch in one backward operation (ops->bw_scratch: norm
 * statistics, token ids, the static map's partials, ...) for B x T; sw_grad:
 * the static map's gradient may be asked (parameters). Held on top of the
 * tape's buffers and the pool's transients, so the plan adds it. */
static uint64_t bw_scratch(const dcs_model *m, int B, int T, int sw_grad) {
    const dcs_config *c = &m->cfg;
    const dcs_layer_plan any = any_layer(m);
    if (!m->be->ops->bw_scratch) return 0;
    const dcs_bw_shape s = {.B = B,
                            .T = T,
                            .D = c->d_model,
                            .N = c->n_head,
                            .R = any.dcmha ? c->dyn_rank : 0,
                            .rot = c->rotary_dim,
                            .G = c->compose_groups > 1 ? c->compose_groups : 1,
                            .use_sw = sw_grad && any.static_branch,
                            .rows_kernel = any.row_compose};
    return m->be->ops->bw_scratch(m->be, &s);
}

static dcs_status check_first(dcs_model *m, int first) {
    if (first < 0 || first >= m->cfg.n_layer)
        return dcs_seterr(&m->err, DCS_ERR_ARG, "tape: first layer %d is out of range (model has %d layers)",
                          first, m->cfg.n_layer);
    return DCS_OK;
}

dcs_status dcs_tape_plan(dcs_model *m, int B, int T, int first, int recompute, const int *points,
                         int n_points, uint64_t *bytes) {
    if (!m || !bytes) return DCS_ERR_ARG;
    if (B < 1 || T < 1 || (int64_t)B * T > (1 << 24))
        return dcs_seterr(&m->err, DCS_ERR_ARG, "tape: bad batch shape B=%d T=%d", B, T);
    dcs_status st = check_first(m, first);
    if (st) return st;
    dcs_tape plan;
    memset(&plan, 0, sizeof plan);
    plan.m = m;
    plan.B = B;
    plan.T = T;
    plan.M = B * T;
    plan.first = first;
    plan.recompute = recompute != 0;
    plan.dry = 1;
    alloc_tape(&plan);
    int head_out = 0;
    uint64_t hooks = 0;
    for (int i = 0; i < n_points; i++) {
        if (points[i] < 0 || points[i] >= DCS_HP_COUNT || !dcs_hook_exists(m, points[i]))
            return dcs_seterr(&m->err, DCS_ERR_ARG, "tape plan: point %d is not a hook of this model",
                              points[i]);
        int64_t shape[6];
        int nd = dcs_hook_shape(m, points[i], B, T, shape);
        uint64_t n = 1;
        for (int k = 0; k < nd; k++) n *= (uint64_t)shape[k];
        hooks += 2 * n * sizeof(float); /* its gradient and an override of it */
        head_out |= points[i] == DCS_HP_HEAD_OUT;
    }
    *bytes = plan.bytes + pass_transient(m, B, T, head_out) + bw_scratch(m, B, T, 1) + hooks;
    return DCS_OK;
}

/* Weights stay in their stored dtype (the backward reads them through
 * gemm_w); the kept activations are sized by the layer's size table. */
dcs_status dcs_tape_new_from(dcs_model *m, int B, int T, int first, uint64_t max_bytes, dcs_tape **out) {
    *out = NULL;
    const dcs_backend_ops *o = m->be->ops;
    if (!o->zero || !o->gelu_bw || !o->tanh_bw || !o->softmax_bw || !o->softmax_rows_bw || !o->layernorm_bw ||
        !o->rmsnorm_bw || !o->rotary_bw || !o->col_sum || !o->embed_bw || !o->xent_bw || !o->compose_bw ||
        !o->head_gate_bw || !o->moh_route_bw || !o->swiglu_bw)
        return dcs_seterr(&m->err, DCS_ERR_UNSUPPORTED,
                          "gradients: the %s backend has no backward operations; load the model with "
                          "device='cpu'",
                          o->name);
    if (B < 1 || T < 1 || (int64_t)B * T > (1 << 24))
        return dcs_seterr(&m->err, DCS_ERR_ARG, "tape: bad batch shape B=%d T=%d", B, T);
    dcs_status st = dcs_tape_supported(m);
    if (!st) st = check_first(m, first);
    if (st) return st;
    uint64_t full = 0, ckpt = 0;
    dcs_tape_plan(m, B, T, first, 0, NULL, 0, &full);
    dcs_tape_plan(m, B, T, first, 1, NULL, 0, &ckpt);
    const int recompute = max_bytes && full > max_bytes;
    if (recompute && ckpt > max_bytes)
        return dcs_seterr(&m->err, DCS_ERR_NOMEM,
                          "tape: B=%d T=%d needs %.1f MiB with recomputation (%.1f MiB keeping every layer), "
                          "more than max_tape_bytes = %.1f MiB; use fewer tokens per call",
                          B, T, ckpt / 1048576.0, full / 1048576.0, max_bytes / 1048576.0);
    dcs_tape *tp = calloc(1, sizeof *tp);
    if (!tp) return dcs_seterr(&m->err, DCS_ERR_NOMEM, "tape: out of memory");
    tp->m = m;
    m->n_tapes++; /* dcs_tape_free counts it out */
    tp->B = tp->B_cap = B;
    tp->T = tp->T_cap = T;
    tp->M = B * T;
    tp->recompute = recompute;
    tp->first = first;
    tp->held = -1;
    const size_t Ls = m->cfg.n_layer;
    tp->L = calloc(Ls ? Ls : 1, sizeof(dcs_kept));
    tp->want = calloc((size_t)DCS_HP_COUNT * (Ls ? Ls : 1), 1);
    if (!tp->L || !tp->want || !alloc_tape(tp)) {
        dcs_tape_free(tp);
        return dcs_seterr(&m->err, DCS_ERR_NOMEM, "tape: out of memory for B=%d T=%d", B, T);
    }
    *out = tp;
    return DCS_OK;
}

dcs_status dcs_tape_new_budget(dcs_model *m, int B, int T, uint64_t max_bytes, dcs_tape **out) {
    return dcs_tape_new_from(m, B, T, 0, max_bytes, out);
}

dcs_status dcs_tape_new(dcs_model *m, int B, int T, dcs_tape **out) {
    return dcs_tape_new_from(m, B, T, 0, 0, out);
}

/* Run the next passes on B x T, within the shape the tape was made for:
 * every buffer is sized by B and T (rows M = B*T, maps [B, N, T, T]), the
 * rotary table by position, so a smaller batch fits a prefix of each. The
 * forward has to run again before a loss or backward. */
dcs_status dcs_tape_reshape(dcs_tape *tp, int B, int T) {
    if (B < 1 || T < 1 || B > tp->B_cap || T > tp->T_cap)
        return dcs_seterr(&tp->m->err, DCS_ERR_ARG,
                          "tape: reshape to B=%d T=%d: outside the tape's B=%d T=%d (1 <= B, 1 <= T)", B, T,
                          tp->B_cap, tp->T_cap);
    tp->B = B;
    tp->T = T;
    tp->M = B * T;
    tp->have_forward = 0;
    tp->held = -1;
    return DCS_OK;
}

void dcs_tape_memory(const dcs_tape *tp, uint64_t *tape_bytes, uint64_t *pass_peak, int *recompute) {
    if (tape_bytes) *tape_bytes = tp->bytes;
    if (pass_peak) *pass_peak = tp->pass_peak + tp->bw_peak;
    if (recompute) *recompute = tp->recompute;
}

/* ---------------------------------------------------------------- hooks */

static size_t hook_numel(const dcs_tape *tp, int point) {
    int64_t shape[6];
    int nd = dcs_hook_shape(tp->m, point, tp->B, tp->T, shape);
    size_t n = 1;
    for (int i = 0; i < nd; i++) n *= (size_t)shape[i];
    return n;
}

static const dcs_hook_override *find_ov(const dcs_tape *tp, int point, int layer) {
    for (int i = 0; i < tp->n_ov; i++)
        if (tp->ov[i].point == point && (!dcs_hook_point_is_layered(point) || tp->ov[i].layer == layer))
            return &tp->ov[i];
    return NULL;
}

/* Forward: the pass's hook at an overridden point writes the given data. */
static int ov_hook(void *user, int point, int layer, float *data, const int64_t *shape, int nd) {
    (void)shape;
    (void)nd;
    dcs_tape *tp = user;
    const dcs_hook_override *o = find_ov(tp, point, layer);
    if (!o) return 0;
    memcpy(data, o->data, hook_numel(tp, point) * sizeof(float));
    return 1;
}

/* Backward: hand out the gradient at (point, layer) and cut it when the
 * activation was overridden. */
static void grad_capture(dcs_tape *tp, const dcs_hook_grad *g, int n_g, int point, int layer,
                         const float *dx) {
    size_t n = 0;
    for (int i = 0; i < n_g; i++)
        if (g[i].point == point && (!dcs_hook_point_is_layered(point) || g[i].layer == layer)) {
            if (!n) n = hook_numel(tp, point);
            tp->m->be->ops->download(tp->m->be, g[i].grad, dx, n * sizeof(float));
        }
}

static void grad_at(dcs_tape *tp, const dcs_hook_grad *g, int n_g, int point, int layer, float *dx) {
    size_t n = 0;
    for (int i = 0; i < n_g; i++)
        if (g[i].point == point && (!dcs_hook_point_is_layered(point) || g[i].layer == layer)) {
            if (!n) n = hook_numel(tp, point);
            tp->m->be->ops->download(tp->m->be, g[i].grad, dx, n * sizeof(float));
        }
    if (find_ov(tp, point, layer)) tp->m->be->ops->zero(tp->m->be, dx, hook_numel(tp, point) * sizeof(float));
}

static int wants_grad(const dcs_hook_grad *g, int n_g, int point, int layer) {
    for (int i = 0; i < n_g; i++)
        if (g[i].point == point && g[i].layer == layer) return 1;
    return 0;
}

/* ---------------------------------------------------------------- helpers */

/* dx [M, I] (= or +=, beta) dy [M, O] W; dW [O, I] += dy^T x; db [O] += colsum dy.
 * W [O, I] in its stored dtype: an F16/BF16 matrix is widened tile by tile
 * inside gemm_w (as in the forward), never as a whole. */
static void lin_bw(dcs_backend *be, float *dx, float beta, float *dW, float *db, const float *dy,
                   const float *x, dcs_wmat W, int M, int O, int I) {
    if (dx && (W.dtype == DCS_F32 || !be->ops->gemm_w))
        be->ops->gemm(be, 0, 0, M, I, O, 1.0f, dy, O, 0, W.p, I, 0, beta, dx, I, 0, 1);
    else if (dx)
        be->ops->gemm_w(be, 0, M, I, O, dy, O, W, beta, dx, I);
    if (dW) be->ops->gemm(be, 1, 0, O, I, M, 1.0f, dy, O, 0, x, I, 0, 1.0f, dW, I, 0, 1);
    if (db) be->ops->col_sum(be, db, dy, M, O);
}

/* dx += the backward of the block's norm (LayerNorm, or DCFormer++'s
 * RMSNorm) of x [M, D] with weight w, bias b, from dy; dw, db += its
 * parameter gradients. Statistics recomputed from x. */
static void norm_bw(dcs_tape *tp, int kind, float *dx, float *dw, float *db, const float *dy, const float *x,
                    const float *w) {
    dcs_model *m = tp->m;
    dcs_backend *be = m->be;
    const int M = tp->M, D = m->cfg.d_model;
    if (kind == DCS_NORM_RMS)
        be->ops->rmsnorm_bw(be, dx, dw, dy, x, w, M, D, m->cfg.norm_eps);
    else
        be->ops->layernorm_bw(be, dx, dw, db, dy, x, w, M, D, m->cfg.norm_eps);
}

/* Where the backward accumulates parameter gradients: one flat array of
 * every parameter (training), or buffers for the parameters asked for. */
typedef struct {
    float *flat;
    const dcs_param_grad *pg;
    int n_pg;
    const dcs_hook_grad *g;
    int n_g;
    float **dev; /* [n_weights] device mirrors of the asked gradients (CUDA) */
} bwctx;

/* The gradient buffer of weight `w` (its float32 array or its stored
 * F16/BF16 data: a weight gradient never reads the weight); NULL: none
 * asked. */
static float *gptr(const dcs_model *m, const bwctx *bc, const void *w) {
    if ((!bc->flat && !bc->n_pg) || !w) return NULL;
    size_t off = 0;
    for (int i = 0; i < m->n_weights; i++) {
        if ((const void *)m->weights[i].ptr == w || m->weights[i].half == w) {
            if (bc->dev) return bc->dev[i];
            if (bc->flat) return bc->flat + off;
            for (int k = 0; k < bc->n_pg; k++)
                if (bc->pg[k].index == i) return bc->pg[k].grad;
            return NULL;
        }
        size_t n = 1;
        for (int j = 0; j < m->weights[i].ndim; j++) n *= (size_t)m->weights[i].shape[j];
        off += n;
    }
    return NULL;
}

/* ---------------------------------------------------------------- forward */

static dcs_status forward(dcs_tape *tp, const int32_t *tokens, const float *resid,
                          const dcs_hook_override *ov, int n_ov, float *logits) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    dcs_backend *be = m->be;
    const int M = tp->M, V = c->vocab, L = c->n_layer;
    for (int i = 0; i < M; i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            return dcs_seterr(&m->err, DCS_ERR_ARG,
                              "token id %d at index %d is outside the vocabulary [0, %d)", tokens[i], i, V);
    for (int i = 0; i < n_ov; i++)
        if (!ov[i].data || ov[i].point < 0 || ov[i].point >= DCS_HP_COUNT ||
            !dcs_hook_exists(m, ov[i].point) ||
            (dcs_hook_point_is_layered(ov[i].point) && (ov[i].layer < tp->first || ov[i].layer >= L)) ||
            (tp->first && ov[i].point == DCS_HP_EMBED))
            return dcs_seterr(&m->err, DCS_ERR_ARG,
                              "tape: bad override %d (point %d, layer %d; the tape runs "
                              "layers %d..%d)",
                              i, ov[i].point, ov[i].layer, tp->first, L - 1);
    memcpy(tp->tokens, tokens, sizeof(int32_t) * M);
    tp->status = DCS_OK;
    tp->have_forward = 0;
    tp->ov = ov;
    tp->n_ov = n_ov;
    memset(tp->want, 0, (size_t)DCS_HP_COUNT * (L ? L : 1));
    for (int i = 0; i < n_ov; i++)
        tp->want[dcs_hook_index(L, ov[i].point, dcs_hook_point_is_layered(ov[i].point) ? ov[i].layer : 0)] =
            1;
    dcs_hooks hooks = {tp->want, ov_hook, tp};
    dcs_pass p;
    dcs_pass_init(&p, m, n_ov ? &hooks : NULL, tp->B, tp->T, 0, "tape", "forward pass");
    p.keep = tp->L;
    /* the residual stream runs in xL, which leaves the last layer */
    if (!tp->first) {
        dcs_pass_embed(&p, tokens, tp->xL);
        dcs_pass_layers(&p, tp->xL);
    } else {
        be->ops->upload(be, tp->xL, resid, sizeof(float) * (size_t)M * c->d_model);
        for (int l = tp->first; l < L && !p.status && !dcs_pass_cancelled(&p); l++) {
            dcs_layer(&p, l, tp->xL);
            if (!p.status) p.status = be->ops->sync(be, &m->err);
        }
    }
    dcs_pass_final(&p, tp->xL, tp->lnf, tp->logits);
    if (!p.status) p.status = be->ops->sync(be, &m->err);
    tp->pass_peak = p.peak;
    tp->bw_peak = 0;
    dcs_pass_end(&p);
    tp->held = L - 1; /* the shared internals (recompute) hold the last layer */
    m->last_peak_bytes = tp->bytes + tp->pass_peak;
    m->last_total_bytes = tp->bytes + p.total;
    if (p.status) return p.status;
    if (logits) be->ops->download(be, logits, tp->logits, sizeof(float) * (size_t)M * V);
    tp->have_forward = 1;
    return DCS_OK;
}

dcs_status dcs_tape_forward(dcs_tape *tp, const int32_t *tokens, const dcs_hook_override *ov, int n_ov,
                            float *logits) {
    if (tp->first)
        return dcs_seterr(&tp->m->err, DCS_ERR_ARG, "tape: it starts at layer %d; use dcs_tape_forward_from",
                          tp->first);
    return forward(tp, tokens, NULL, ov, n_ov, logits);
}

dcs_status dcs_tape_forward_from(dcs_tape *tp, const int32_t *tokens, const float *resid,
                                 const dcs_hook_override *ov, int n_ov, float *logits) {
    if (!resid) return dcs_seterr(&tp->m->err, DCS_ERR_ARG, "tape: resid is NULL");
    return forward(tp, tokens, tp->first ? resid : NULL, ov, n_ov, logits);
}

/* Mean next-token cross-entropy over the positions with targets[i] >= 0;
 * writes its gradient to the tape's dlogits. */
dcs_status dcs_tape_loss(dcs_tape *tp, const int32_t *targets, double *loss, int *count) {
    dcs_model *m = tp->m;
    const int M = tp->M, V = m->cfg.vocab;
    if (!tp->have_forward) return dcs_seterr(&m->err, DCS_ERR_ARG, "tape: loss before forward");
    int cnt = 0;
    for (int i = 0; i < M; i++) {
        if (targets[i] >= V)
            return dcs_seterr(&m->err, DCS_ERR_ARG, "target id %d at index %d is outside the vocabulary",
                              targets[i], i);
        cnt += targets[i] >= 0;
    }
    if (!cnt) return dcs_seterr(&m->err, DCS_ERR_ARG, "loss: no position has a target");
    double *rows = malloc(sizeof(double) * (size_t)M);
    if (!rows) return dcs_seterr(&m->err, DCS_ERR_NOMEM, "loss: out of memory");
    m->be->ops->xent_bw(m->be, tp->dlogits, rows, tp->logits, targets, M, V, 1.0f / (float)cnt);
    double total = 0;
    for (int i = 0; i < M; i++) total += rows[i];
    free(rows);
    *loss = total / cnt;
    if (count) *count = cnt;
    return DCS_OK;
}

/* ---------------------------------------------------------------- backward */

/* The arguments of one compose phase's backward (the backend's
 * compose_bw): dIn from dOut over allowed pairs; the phase's
 * dynamic-weight gradients. */
static dcs_compose_bw_args compose_bw_args(dcs_tape *tp, int l, int ph, float *dIn, const float *dOut,
                                           const float *in, int window) {
    const dcs_config *c = &tp->m->cfg;
    const dcs_layer_plan *pl = &tp->m->plan[l];
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    unsigned on = 0;
    for (int k = 0; k < DCS_N_BRANCHES; k++)
        if (!find_ov(tp, dcs_branch_first[ph] + k, l)) on |= 1u << k;
    dcs_compose_bw_args ca;
    memset(&ca, 0, sizeof ca);
    ca.dIn = dIn;
    ca.in = in;
    ca.dOut = dOut;
    ca.qw1 = a->w1[ph][0];
    ca.qw2 = a->w2[ph][0];
    ca.qdd = a->dd[ph][0];
    ca.kw1 = a->w1[ph][1];
    ca.kw2 = a->w2[ph][1];
    ca.kdd = a->dd[ph][1];
    ca.sw = pl->static_branch ? (ph == 0 ? tp->m->layers[l].pre_sw : tp->m->layers[l].post_sw) : NULL;
    if (ca.qw1) {
        ca.dqw1 = d->dw1[ph][0];
        ca.dqw2 = d->dw2[ph][0];
        ca.dqdd = d->ddd[ph][0];
    }
    if (ca.kw1) {
        ca.dkw1 = d->dw1[ph][1];
        ca.dkw2 = d->dw2[ph][1];
        ca.dkdd = d->ddd[ph][1];
    }
    ca.dsw = d->dsw[ph];
    /* the CPU's row kernel of plain DCMHA reads the key side transposed */
    if (tp->kT[ph][0] && pl->row_compose)
        for (int i = 0; i < 3; i++) {
            ca.scratch[i] = tp->kT[ph][i];
            ca.scratch[3 + i] = tp->dkT[ph][i];
        }
    ca.B = tp->B;
    ca.N = c->n_head;
    ca.T = tp->T;
    ca.R = c->dyn_rank;
    ca.G = pl->groups;
    ca.window = window;
    ca.on = on;
    return ca;
}

/* Backward of one compose phase: dIn written, the phase's dynamic-weight
 * gradients written. */
static void compose_bw(dcs_tape *tp, int l, int ph, float *dIn, const float *dOut, const float *in,
                       int window) {
    const dcs_compose_bw_args ca = compose_bw_args(tp, l, ph, dIn, dOut, in, window);
    tp->m->be->ops->compose_bw(tp->m->be, &ca);
}

/* May the backend fuse the post-compose, softmax and pre-compose
 * backward of layer l (compose_softmax_bw)? Not when a hook between them
 * wants its gradient or is overridden (dP, dAc are then not written). */
static int fuse_maps_bw(dcs_tape *tp, int l, const bwctx *bc) {
    if (!tp->m->be->ops->compose_softmax_bw || !tp->kT[0][0] || !tp->m->plan[l].row_compose) return 0;
    const int pts[2] = {DCS_HP_PATTERN, DCS_HP_SCORES_COMPOSED};
    for (int i = 0; i < 2; i++)
        if (wants_grad(bc->g, bc->n_g, pts[i], l) || find_ov(tp, pts[i], l)) return 0;
    for (int k = 0; k < DCS_N_BRANCHES; k++)
        if (wants_grad(bc->g, bc->n_g, DCS_HP_PRE_SKIP + k, l)) return 0;
    return 1;
}

#define GP(w) gptr(m, bc, (w))

/* MoH head gate backward (model-spec 5): z = zpre * gate per head. In
 * place: dz [M, N, Dh] becomes d zpre; d gate, through the routing scores
 * of the selected heads (dcs_moh_route_row_bw), to the router logits and
 * from them to d->dmoh [M, D] (the router's input ln1) and the router's
 * parameter gradients. */
static void moh_bw(dcs_tape *tp, int l, const bwctx *bc) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    dcs_backend *be = m->be;
    const int M = tp->M, D = c->d_model, N = c->n_head, Dh = c->head_dim, hs = c->moh_shared, NR = N - hs;
    be->ops->head_gate_bw(be, d->dz, d->dhgate, a->zpre, a->hgate, M, N, Dh);
    grad_at(tp, bc->g, bc->n_g, DCS_HP_ROUTING, l, d->dhgate);
    be->ops->moh_route_bw(be, d->dlg, d->ds1, d->ds0, d->dhgate, a->rlg, a->rs1, a->rs0, M, N, hs,
                          c->moh_topk);
    grad_at(tp, bc->g, bc->n_g, DCS_HP_ROUTER_LOGITS, l, d->dlg);
    lin_bw(be, d->dmoh, 0.0f, GP(lw->moh_wg), NULL, d->dlg, a->ln1, (dcs_wmat){lw->moh_wg, DCS_F32}, M, NR,
           D);
    if (hs > 1)
        lin_bw(be, d->dmoh, 1.0f, GP(lw->moh_wg1), NULL, d->ds1, a->ln1, (dcs_wmat){lw->moh_wg1, DCS_F32}, M,
               hs, D);
    if (hs > 0)
        lin_bw(be, d->dmoh, 1.0f, GP(lw->moh_wg0), NULL, d->ds0, a->ln1, (dcs_wmat){lw->moh_wg0, DCS_F32}, M,
               2, D);
}

/* The attention backward through the [B, N, T, T] gradient maps, with
 * their hooks: from d->dz to d->dq, d->dk, d->dv (written). */
static void attention_maps_bw(dcs_tape *tp, int l, const bwctx *bc, int window) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const int dcmha = m->plan[l].dcmha;
    dcs_backend *be = m->be;
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    const int B = tp->B, T = tp->T, D = c->d_model, N = c->n_head, Dh = c->head_dim;
    const long long TT = (long long)T * T;
    /* z = P' v: dP' = dz v^T, dv = P'^T dz (per b, batched over heads) */
    const float *pat = dcmha ? a->Pc : a->P;
    float *dpat = dcmha ? d->dPc : d->dP;
    /* dP'[b, n] = dz[b, :, n] v[b, :, n]^T;  dv[b, :, n] = P'[b, n]^T dz[b, :, n] */
    hg_arg g1 = {0,
                 1,
                 T,
                 T,
                 Dh,
                 1.0f,
                 0.0f,
                 d->dz,
                 a->v,
                 dpat,
                 D,
                 D,
                 T,
                 Dh,
                 Dh,
                 TT,
                 (long long)T * D,
                 (long long)T * D,
                 N * TT,
                 N};
    heads_gemm(tp, &g1, B);
    hg_arg g2 = {1,
                 0,
                 T,
                 Dh,
                 T,
                 1.0f,
                 0.0f,
                 pat,
                 d->dz,
                 d->dv,
                 T,
                 D,
                 D,
                 TT,
                 Dh,
                 Dh,
                 N * TT,
                 (long long)T * D,
                 (long long)T * D,
                 N};
    heads_gemm(tp, &g2, B);
    grad_at(tp, bc->g, bc->n_g, DCS_HP_V, l, d->dv);
    int fused = 0;
    if (dcmha) {
        grad_at(tp, bc->g, bc->n_g, DCS_HP_PATTERN_COMPOSED, l, d->dPc);
        for (int k = 0; k < DCS_N_BRANCHES; k++)
            if (dcs_hook_exists(m, DCS_HP_POST_SKIP + k))
                grad_capture(tp, bc->g, bc->n_g, DCS_HP_POST_SKIP + k, l, d->dPc);
        /* an overridden branch passes no gradient upstream: `on` in compose_bw */
        fused = fuse_maps_bw(tp, l, bc);
        if (fused) { /* dP, dAc not written: no hook between wants them */
            const dcs_compose_bw_args post = compose_bw_args(tp, l, 1, d->dP, d->dPc, a->P, window);
            const dcs_compose_bw_args pre = compose_bw_args(tp, l, 0, d->dA, d->dAc, a->A, window);
            be->ops->compose_softmax_bw(be, &post, &pre);
        } else
            compose_bw(tp, l, 1, d->dP, d->dPc, a->P, window);
    }
    if (!fused) {
        grad_at(tp, bc->g, bc->n_g, DCS_HP_PATTERN, l, d->dP);
        float *dpre = dcmha ? d->dAc : d->dA;
        be->ops->softmax_bw(be, dpre, d->dP, a->P, B * N, T, T, window);
    }
    if (dcmha && !fused) {
        grad_at(tp, bc->g, bc->n_g, DCS_HP_SCORES_COMPOSED, l, d->dAc);
        for (int k = 0; k < DCS_N_BRANCHES; k++)
            if (dcs_hook_exists(m, DCS_HP_PRE_SKIP + k))
                grad_capture(tp, bc->g, bc->n_g, DCS_HP_PRE_SKIP + k, l, d->dAc);
        compose_bw(tp, l, 0, d->dA, d->dAc, a->A, window);
    }
    grad_at(tp, bc->g, bc->n_g, DCS_HP_SCORES, l, d->dA);

    /* A = q k^T / sqrt(Dh): dq = s dA k, dk = s dA^T q */
    const float sc = 1.0f / sqrtf((float)Dh);
    hg_arg g3 = {0,
                 0,
                 T,
                 Dh,
                 T,
                 sc,
                 0.0f,
                 d->dA,
                 a->k,
                 d->dq,
                 T,
                 D,
                 D,
                 TT,
                 Dh,
                 Dh,
                 N * TT,
                 (long long)T * D,
                 (long long)T * D,
                 N};
    heads_gemm(tp, &g3, B);
    hg_arg g4 = {1,
                 0,
                 T,
                 Dh,
                 T,
                 sc,
                 0.0f,
                 d->dA,
                 a->q,
                 d->dk,
                 T,
                 D,
                 D,
                 TT,
                 Dh,
                 Dh,
                 N * TT,
                 (long long)T * D,
                 (long long)T * D,
                 N};
    heads_gemm(tp, &g4, B);
}

/* May the backend run layer l's attention backward by blocks
 * (attention_bw)? Plain DCMHA on the CPU's row kernel (fuse_maps_bw), and
 * no hook wanting the gradient of a map (scores, the post-compose branches,
 * the composed pattern) or overriding one. */
static int attn_bw_fused(dcs_tape *tp, int l, const bwctx *bc) {
    if (!tp->m->be->ops->attention_bw || !fuse_maps_bw(tp, l, bc)) return 0;
    const int pts[2] = {DCS_HP_SCORES, DCS_HP_PATTERN_COMPOSED};
    for (int i = 0; i < 2; i++)
        if (wants_grad(bc->g, bc->n_g, pts[i], l) || find_ov(tp, pts[i], l)) return 0;
    for (int k = 0; k < DCS_N_BRANCHES; k++)
        if (wants_grad(bc->g, bc->n_g, DCS_HP_POST_SKIP + k, l)) return 0;
    return 1;
}

/* Attention backward: from tp->d.dao to tp->d.dln1 (written). */
static void attention_bw(dcs_tape *tp, int l, const bwctx *bc) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_plan *pl = &m->plan[l];
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_backend *be = m->be;
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    const int T = tp->T, M = tp->M, D = c->d_model, N = c->n_head, Dh = c->head_dim;
    const int window = pl->window;

    grad_at(tp, bc->g, bc->n_g, DCS_HP_ATTN_OUT, l, d->dao);
    if (wants_grad(bc->g, bc->n_g, DCS_HP_HEAD_OUT, l)) {
        /* d head_out[:, n] = d out for every head n (host: the row [D] of
         * each token downloaded into its head 0, then copied) */
        for (int i = 0; i < bc->n_g; i++)
            if (bc->g[i].point == DCS_HP_HEAD_OUT && bc->g[i].layer == l) {
                float *h = bc->g[i].grad;
                for (int mm = 0; mm < M; mm++)
                    be->ops->download(be, h + (size_t)mm * N * D, d->dao + (size_t)mm * D, sizeof(float) * D);
                for (int mm = 0; mm < M; mm++)
                    for (int n = 1; n < N; n++)
                        memcpy(h + ((size_t)mm * N + n) * D, h + (size_t)mm * N * D, sizeof(float) * D);
            }
    }
    float *gbo = GP(lw->bo);
    if (gbo) be->ops->col_sum(be, gbo, d->dao, M, D);
    if (find_ov(tp, DCS_HP_HEAD_OUT, l)) be->ops->zero(be, d->dao, sizeof(float) * (size_t)M * D);
    lin_bw(be, d->dz, 0.0f, GP(lw->m_wo.p), NULL, d->dao, a->z, lw->m_wo, M, D, D);
    grad_at(tp, bc->g, bc->n_g, DCS_HP_Z, l, d->dz);
    if (pl->moh) moh_bw(tp, l, bc);
    d->dsw[0] = pl->static_branch ? GP(lw->pre_sw) : NULL;
    d->dsw[1] = pl->static_branch ? GP(lw->post_sw) : NULL;

    if (!attn_bw_fused(tp, l, bc)) {
        attention_maps_bw(tp, l, bc, window);
    } else {
        /* the per-head products, both compose phases and the softmax by
         * blocks of query rows in the backend (no gradient map written) */
        const dcs_compose_bw_args post = compose_bw_args(tp, l, 1, d->dP, d->dPc, a->P, window);
        const dcs_compose_bw_args pre = compose_bw_args(tp, l, 0, d->dA, d->dAc, a->A, window);
        const dcs_attn_bw_args ab = {
            &post, &pre, d->dz, a->q, a->k, a->v, a->Pc, d->dq, d->dk, d->dv, Dh, D, 1.0f / sqrtf((float)Dh)};
        if (be->ops->attention_bw(be, &ab)) /* no scratch: the same through the maps */
            attention_maps_bw(tp, l, bc, window);
        else
            grad_at(tp, bc->g, bc->n_g, DCS_HP_V, l, d->dv);
    }
    grad_at(tp, bc->g, bc->n_g, DCS_HP_Q, l, d->dq);
    grad_at(tp, bc->g, bc->n_g, DCS_HP_K, l, d->dk);
    be->ops->rotary_bw(be, d->dq, M, T, N, Dh, c->rotary_dim, c->rope_base);
    be->ops->rotary_bw(be, d->dk, M, T, N, Dh, c->rotary_dim, c->rope_base);
    /* dqkv [M, 3D] */
    if (pl->qk_norm) {
        be->ops->zero(be, d->dln1, sizeof(float) * (size_t)M * D); /* scratch */
        be->ops->rmsnorm_bw(be, d->dln1, GP(lw->q_scale), d->dq, a->qraw, lw->q_scale, M * N, Dh, 1e-6f);
        be->ops->copy2d(be, d->dqkv, 3 * D, d->dln1, D, M, D);
        be->ops->zero(be, d->dln1, sizeof(float) * (size_t)M * D);
        be->ops->rmsnorm_bw(be, d->dln1, GP(lw->k_scale), d->dk, a->kraw, lw->k_scale, M * N, Dh, 1e-6f);
        be->ops->copy2d(be, d->dqkv + D, 3 * D, d->dln1, D, M, D);
    } else {
        be->ops->copy2d(be, d->dqkv, 3 * D, d->dq, D, M, D);
        be->ops->copy2d(be, d->dqkv + D, 3 * D, d->dk, D, M, D);
    }
    be->ops->copy2d(be, d->dqkv + 2 * D, 3 * D, d->dv, D, M, D);
    lin_bw(be, d->dln1, 0.0f, GP(lw->m_wqkv.p), GP(lw->bqkv), d->dqkv, a->ln1, lw->m_wqkv, M, 3 * D, D);

    if (pl->dcmha) {
        /* G groups of Mg heads (G = 1: the plain layout): per (group, slot)
         * pair gc < GC the hidden layer hid [M, GC, K], w [M, GC, 2R, Mg],
         * gates g [M, GC, Mg] (layer.c, dynamic_weights) */
        const int C = pl->slots, K = c->dyn_hidden, R = c->dyn_rank, RN = R * N;
        const int G = pl->groups, Mg = N / G, GC = G * C, RM2 = 2 * R * Mg;
        be->ops->zero(be, d->dW, sizeof(float) * (size_t)M * GC * RM2);
        be->ops->zero(be, d->dG, sizeof(float) * (size_t)M * GC * Mg);
        for (int ph = 0; ph < 2; ph++)
            for (int s = 0; s < 2; s++) {
                const int slot = pl->slot[ph][s];
                if (slot < 0) continue;
                grad_at(tp, bc->g, bc->n_g, dcs_dyn_points[ph][s][0], l, d->dw1[ph][s]);
                grad_at(tp, bc->g, bc->n_g, dcs_dyn_points[ph][s][1], l, d->dw2[ph][s]);
                grad_at(tp, bc->g, bc->n_g, dcs_dyn_points[ph][s][2], l, d->ddd[ph][s]);
                be->ops->zero(be, d->dw1raw, sizeof(float) * (size_t)M * RN);
                be->ops->rmsnorm_bw(be, d->dw1raw, NULL, d->dw1[ph][s], a->w1raw[ph][s], NULL, M * R * G, Mg,
                                    1e-6f);
                if (G == 1) { /* dW[:, slot] = [dw1raw | dw2] rows of R*N */
                    be->ops->copy2d(be, d->dW + (size_t)slot * RM2, GC * RM2, d->dw1raw, RN, M, RN);
                    be->ops->copy2d(be, d->dW + (size_t)slot * RM2 + RN, GC * RM2, d->dw2[ph][s], RN, M, RN);
                    be->ops->copy2d(be, d->dG + (size_t)slot * N, GC * N, d->ddd[ph][s], N, M, N);
                }
                for (int gr = 0; gr < G && G > 1; gr++) {
                    const size_t dst = (size_t)(gr * C + slot) * RM2;
                    for (int i = 0; i < R; i++) {
                        be->ops->copy2d(be, d->dW + dst + (size_t)i * Mg, GC * RM2,
                                        d->dw1raw + (size_t)i * N + gr * Mg, RN, M, Mg);
                        be->ops->copy2d(be, d->dW + dst + (size_t)(R + i) * Mg, GC * RM2,
                                        d->dw2[ph][s] + (size_t)i * N + gr * Mg, RN, M, Mg);
                    }
                    be->ops->copy2d(be, d->dG + (size_t)(gr * C + slot) * Mg, GC * Mg,
                                    d->ddd[ph][s] + gr * Mg, N, M, Mg);
                }
            }
        /* w[:, gc] = hid[:, gc] qkw[gc] */
        be->ops->gemm(be, 0, 1, M, K, RM2, 1.0f, d->dW, GC * RM2, RM2, lw->qkw, RM2, (long long)K * RM2, 0.0f,
                      d->dhid, GC * K, K, GC);
        float *gq = GP(lw->qkw);
        if (gq)
            be->ops->gemm(be, 1, 0, K, RM2, M, 1.0f, a->hid, GC * K, K, d->dW, GC * RM2, RM2, 1.0f, gq, RM2,
                          (long long)K * RM2, GC);
        /* hid = gelu(ln1 dw1): dhpre in place of dhid */
        float *dhpre = d->dhid;
        be->ops->gelu_bw(be, dhpre, dhpre, a->hpre, (size_t)M * GC * K);
        /* dln1 += dhpre [M, GC*K] dw1 [D, GC*K]^T */
        if (lw->m_dw1.dtype == DCS_F32 || !be->ops->gemm_w)
            be->ops->gemm(be, 0, 1, M, D, GC * K, 1.0f, dhpre, GC * K, 0, lw->m_dw1.p, GC * K, 0, 1.0f,
                          d->dln1, D, 0, 1);
        else
            be->ops->gemm_w(be, 1, M, D, GC * K, dhpre, GC * K, lw->m_dw1, 1.0f, d->dln1, D);
        float *gdw1 = GP(lw->m_dw1.p);
        if (gdw1)
            be->ops->gemm(be, 1, 0, D, GC * K, M, 1.0f, a->ln1, D, 0, dhpre, GC * K, 0, 1.0f, gdw1, GC * K, 0,
                          1);
        /* g = tanh(ln1 dd): [M, GC*Mg] = [M, C*N] */
        be->ops->tanh_bw(be, d->dG, a->g, (size_t)M * C * N);
        be->ops->gemm(be, 0, 1, M, D, C * N, 1.0f, d->dG, C * N, 0, lw->dd, C * N, 0, 1.0f, d->dln1, D, 0, 1);
        float *gdd = GP(lw->dd);
        if (gdd)
            be->ops->gemm(be, 1, 0, D, C * N, M, 1.0f, a->ln1, D, 0, d->dG, C * N, 0, 1.0f, gdd, C * N, 0, 1);
    }
    if (pl->moh) /* the router read ln1 too */
        be->ops->add(be, d->dln1, d->dmoh, (size_t)M * D);
    grad_at(tp, bc->g, bc->n_g, DCS_HP_LN_ATTN, l, d->dln1);
}

/* DCFormer++'s gated MLP, from d post (in d->dug) to d->du (w1 x) and
 * d->du3 (w3 x), with the group gate's gradient into d->dln2 (written):
 *   pu = silu(u) * u3, post = pu * gate[group], gate = softmax(ln2 mg^T). */
static void swiglu_bw(dcs_tape *tp, int l, const bwctx *bc) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    dcs_backend *be = m->be;
    const int M = tp->M, D = c->d_model, F = c->d_ff, E = m->plan[l].mlp_gate;
    be->ops->zero(be, d->dln2, sizeof(float) * (size_t)M * D);
    be->ops->swiglu_bw(be, d->du, d->du3, d->dgate, d->dug, a->u, a->u3, a->gate, M, F, E);
    if (E > 0) {
        grad_at(tp, bc->g, bc->n_g, DCS_HP_MLP_GATE, l, d->dgate);
        be->ops->softmax_rows_bw(be, d->dgate, a->gate, M, E);
        lin_bw(m->be, d->dln2, 0.0f, GP(lw->mg), NULL, d->dgate, a->ln2, (dcs_wmat){lw->mg, DCS_F32}, M, E,
               D);
    }
    grad_at(tp, bc->g, bc->n_g, DCS_HP_MLP_PRE_LINEAR, l, d->du3);
    lin_bw(m->be, d->dln2, 1.0f, GP(lw->m_w3.p), NULL, d->du3, a->ln2, lw->m_w3, M, F, D);
}

static void mlp_bw(dcs_tape *tp, int l, const bwctx *bc) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_backend *be = m->be;
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    const int M = tp->M, D = c->d_model, F = c->d_ff;
    grad_at(tp, bc->g, bc->n_g, DCS_HP_MLP_OUT, l, d->dmo);
    lin_bw(be, d->dug, 0.0f, GP(lw->m_w2.p), GP(lw->b2), d->dmo, a->ug, lw->m_w2, M, D, F);
    grad_at(tp, bc->g, bc->n_g, DCS_HP_MLP_POST, l, d->dug);
    float beta = 0.0f;
    if (m->plan[l].mlp == DCS_MLP_SWIGLU) {
        swiglu_bw(tp, l, bc);
        beta = 1.0f;
    } else {
        be->ops->gelu_bw(be, d->du, d->dug, a->u, (size_t)M * F);
    }
    grad_at(tp, bc->g, bc->n_g, DCS_HP_MLP_PRE, l, d->du);
    lin_bw(be, d->dln2, beta, GP(lw->m_w1.p), GP(lw->b1), d->du, a->ln2, lw->m_w1, M, F, D);
    grad_at(tp, bc->g, bc->n_g, DCS_HP_LN_MLP, l, d->dln2);
}

/* Recompute plan: layer l's internals again, from its checkpoint, into the
 * shared buffers, through the forward's own code and hooks (overrides
 * included), so they are the same bits the forward computed. */
static dcs_status recompute_layer(dcs_tape *tp, int l) {
    dcs_model *m = tp->m;
    dcs_backend *be = m->be;
    dcs_hooks hooks = {tp->want, ov_hook, tp};
    dcs_pass p;
    dcs_pass_init(&p, m, tp->n_ov ? &hooks : NULL, tp->B, tp->T, 0, "tape", "recomputation");
    p.keep = tp->L;
    be->ops->copy(be, tp->xr, tp->L[l].x, sizeof(float) * (size_t)tp->M * m->cfg.d_model);
    dcs_layer(&p, l, tp->xr);
    if (!p.status) p.status = be->ops->sync(be, &m->err);
    if (p.peak > tp->pass_peak) tp->pass_peak = p.peak;
    dcs_pass_end(&p);
    tp->held = p.status ? -1 : l;
    return p.status;
}

static dcs_status run_backward(dcs_tape *tp, const float *dlogits, const bwctx *bc);

/* The caller's gradient buffer of weight i (in the flat array at *off, or
 * its dcs_param_grad; NULL: not asked); *off advances past it, *n its size. */
static float *host_grad(const dcs_model *m, float *flat, const dcs_param_grad *pg, int n_pg, int i,
                        size_t *off, size_t *n) {
    *n = 1;
    for (int j = 0; j < m->weights[i].ndim; j++) *n *= (size_t)m->weights[i].shape[j];
    float *host = flat ? flat + *off : NULL;
    for (int k = 0; k < n_pg && !host; k++)
        if (pg[k].index == i) host = pg[k].grad;
    *off += *n;
    return host;
}

static dcs_status backward(dcs_tape *tp, const float *dlogits, float *param_grads, const dcs_param_grad *pg,
                           int n_pg, const dcs_hook_grad *g, int n_g) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    dcs_backend *be = m->be;
    const int L = c->n_layer;
    if (!tp->have_forward) return dcs_seterr(&m->err, DCS_ERR_ARG, "tape: backward before forward");
    for (int i = 0; i < n_g; i++)
        if (!g[i].grad || g[i].point < 0 || g[i].point >= DCS_HP_COUNT || !dcs_hook_exists(m, g[i].point) ||
            (dcs_hook_point_is_layered(g[i].point) && (g[i].layer < tp->first || g[i].layer >= L)) ||
            (tp->first && g[i].point == DCS_HP_EMBED))
            return dcs_seterr(&m->err, DCS_ERR_ARG,
                              "tape: bad gradient request %d (point %d, layer %d; the tape "
                              "runs layers %d..%d)",
                              i, g[i].point, g[i].layer, tp->first, L - 1);
    if (tp->first && (param_grads || n_pg))
        return dcs_seterr(&m->err, DCS_ERR_ARG,
                          "tape: parameter gradients need a tape from layer 0 (this one "
                          "starts at %d)",
                          tp->first);
    for (int i = 0; i < n_pg; i++)
        if (!pg[i].grad || pg[i].index < 0 || pg[i].index >= m->n_weights)
            return dcs_seterr(&m->err, DCS_ERR_ARG, "tape: bad parameter gradient request %d (index %d)", i,
                              pg[i].index);
    bwctx bcv = {param_grads, pg, n_pg, g, n_g, NULL};
    const int params = param_grads || n_pg;
    tp->bw_peak = bw_scratch(m, tp->B, tp->T, params);
    if (m->device == DCS_DEVICE_CPU || !params) {
        dcs_status st = run_backward(tp, dlogits, &bcv);
        m->last_peak_bytes = tp->bytes + tp->pass_peak + tp->bw_peak;
        return st;
    }
    /* on a device: the asked parameter gradients in device mirrors, uploaded
     * (the backward accumulates), run, downloaded */
    bcv.dev = calloc((size_t)m->n_weights, sizeof(float *));
    if (!bcv.dev) return dcs_seterr(&m->err, DCS_ERR_NOMEM, "tape: out of memory");
    dcs_status st = DCS_OK;
    size_t off = 0, n;
    for (int i = 0; i < m->n_weights && !st; i++) {
        float *host = host_grad(m, param_grads, pg, n_pg, i, &off, &n);
        if (!host) continue;
        if (!(bcv.dev[i] = be->ops->alloc(be, n * sizeof(float))))
            st = dcs_seterr(&m->err, DCS_ERR_NOMEM, "tape: no device memory for the gradient of '%s'",
                            m->weights[i].name);
        else {
            be->ops->upload(be, bcv.dev[i], host, n * sizeof(float));
            tp->bw_peak += n * sizeof(float); /* held through the whole backward */
        }
    }
    if (!st) st = run_backward(tp, dlogits, &bcv);
    m->last_peak_bytes = tp->bytes + tp->pass_peak + tp->bw_peak;
    off = 0;
    for (int i = 0; i < m->n_weights; i++) {
        float *host = host_grad(m, param_grads, pg, n_pg, i, &off, &n);
        if (!bcv.dev[i]) continue;
        if (!st) be->ops->download(be, host, bcv.dev[i], n * sizeof(float));
        be->ops->free(be, bcv.dev[i]);
    }
    free(bcv.dev);
    dcs_status s2 = be->ops->sync(be, &m->err);
    return st ? st : s2;
}

/* The backward proper (backward() checked its arguments). */
static dcs_status run_backward(dcs_tape *tp, const float *dlogits, const bwctx *bc) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    dcs_backend *be = m->be;
    const int M = tp->M, D = c->d_model, V = c->vocab, L = c->n_layer;
    tgrads *d = &tp->d;
    const dcs_hook_grad *g = bc->g;
    const int n_g = bc->n_g;
    /* the backward stops below the lowest layer anything is asked of
     * (parameters and the embedding: all of them) */
    int lowest = bc->flat || bc->n_pg ? 0 : L;
    for (int i = 0; i < n_g; i++) {
        int at = dcs_hook_point_is_layered(g[i].point) ? g[i].layer : g[i].point == DCS_HP_EMBED ? 0 : L;
        if (at < lowest) lowest = at;
    }
    tp->status = DCS_OK;
    if (dlogits) be->ops->upload(be, tp->dlogits, dlogits, sizeof(float) * (size_t)M * V);
    grad_at(tp, g, n_g, DCS_HP_LOGITS, 0, tp->dlogits);
    lin_bw(be, d->dln1, 0.0f, GP(m->m_out_w.p), NULL, tp->dlogits, tp->lnf, m->m_out_w, M, V, D);
    grad_at(tp, g, n_g, DCS_HP_LN_FINAL, 0, d->dln1);
    be->ops->zero(be, d->dx, sizeof(float) * (size_t)M * D);
    norm_bw(tp, m->plan[L - 1].norm, d->dx, GP(m->norm_w), GP(m->norm_b), d->dln1, tp->xL, m->norm_w);
    for (int l = L - 1; l >= lowest; l--) {
        if (tp->recompute && tp->held != l) {
            dcs_status st = recompute_layer(tp, l);
            if (st) return st;
        }
        dcs_kept *a = &tp->L[l];
        const dcs_layer_weights *lw = &m->layers[l];
        const dcs_layer_plan *pl = &m->plan[l];
        grad_at(tp, g, n_g, DCS_HP_RESID_POST, l, d->dx);
        /* the MLP's and the attention's output gradients are dx as it stands
         * when they run (read only, before dx changes); a copy only where an
         * override cuts them (grad_at zeroes its buffer) */
        float *const dmo = d->dmo, *const dao = d->dao;
        const int cut_mo = find_ov(tp, DCS_HP_MLP_OUT, l) != NULL;
        const int cut_ao = find_ov(tp, DCS_HP_ATTN_OUT, l) || find_ov(tp, DCS_HP_HEAD_OUT, l);
        if (cut_mo)
            be->ops->copy(be, dmo, d->dx, sizeof(float) * (size_t)M * D);
        else
            d->dmo = d->dx;
        mlp_bw(tp, l, bc);
        if (!pl->parallel_residual)
            norm_bw(tp, pl->norm, d->dx, GP(lw->ffn_norm_w), GP(lw->ffn_norm_b), d->dln2, a->h,
                    lw->ffn_norm_w);
        if (cut_ao)
            be->ops->copy(be, dao, d->dx, sizeof(float) * (size_t)M * D);
        else
            d->dao = d->dx;
        attention_bw(tp, l, bc);
        d->dmo = dmo;
        d->dao = dao;
        if (pl->parallel_residual)
            norm_bw(tp, pl->norm, d->dx, GP(lw->ffn_norm_w), GP(lw->ffn_norm_b), d->dln2, a->x,
                    lw->ffn_norm_w);
        norm_bw(tp, pl->norm, d->dx, GP(lw->attn_norm_w), GP(lw->attn_norm_b), d->dln1, a->x,
                lw->attn_norm_w);
        grad_at(tp, g, n_g, DCS_HP_RESID_PRE, l, d->dx);
    }
    if (tp->status) return dcs_seterr(&m->err, tp->status, "tape: out of memory in the backward");
    grad_at(tp, g, n_g, DCS_HP_EMBED, 0, d->dx);
    float *ge = GP(m->m_tok_emb.p);
    if (ge) be->ops->embed_bw(be, ge, d->dx, tp->tokens, M, D);
    return be->ops->sync(be, &m->err);
}

dcs_status dcs_tape_backward(dcs_tape *tp, const float *dlogits, float *param_grads, const dcs_hook_grad *g,
                             int n_g) {
    return backward(tp, dlogits, param_grads, NULL, 0, g, n_g);
}

dcs_status dcs_tape_backward_params(dcs_tape *tp, const float *dlogits, const dcs_param_grad *pg, int n_pg,
                                    const dcs_hook_grad *g, int n_g) {
    if (n_pg < 0 || (n_pg && !pg))
        return dcs_seterr(&tp->m->err, DCS_ERR_ARG, "tape: bad parameter gradient list (%d)", n_pg);
    return backward(tp, dlogits, NULL, pg, n_pg, g, n_g);
}
