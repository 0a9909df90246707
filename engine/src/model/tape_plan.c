/*
 * tape_plan.c -- the tape's memory plan (tape.h): which buffers a tape
 * holds for B x T tokens, sized by the layer's size table (dcs_act_sizes)
 * and the layer plans; every layer kept, or (recompute) each layer's input
 * and one layer's internals; what a tape would take before anything is
 * allocated (dcs_tape_plan), making, reshaping and freeing one.
 */
#include "tape.h"

#include <stdlib.h>
#include <string.h>

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
    int ok = 1;
    /* x only when with_x (else it is the layer's checkpoint, set later) */
#define KEEP(name, size, cond)                                                                               \
    if ((cond) && (with_x || &a->name != &a->x)) A_(a->name, sz[DCS_ACT_##size]);
    DCS_KEPT(KEEP)
#undef KEEP
    for (int ph = 0; ph < 2; ph++)
        for (int s = 0; s < 2; s++)
            if (pl->slot[ph][s] >= 0) {
#define KEEP_DYN(name, size) A_(a->name[ph][s], sz[DCS_ACT_##size]);
                DCS_KEPT_DYN(KEEP_DYN)
#undef KEEP_DYN
            }
    return ok;
}

/* Every buffer of the tape under its plan (tp->recompute); with tp->dry
 * only their bytes are counted. 1 on success. */
int dcs_tape_alloc(dcs_tape *tp) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const int B = tp->B, T = tp->T;
    const size_t M = (size_t)B * T, D = c->d_model, N = c->n_head, V = c->vocab;
    const size_t Ls = c->n_layer;
    const size_t RN = (size_t)c->dyn_rank * N;
    const dcs_layer_plan any = any_layer(m);
    uint64_t sz[DCS_ACT_COUNT];
    dcs_act_sizes(c, B, T, T, sz);
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
#define GRAD(name, size, cond)                                                                               \
    if (cond) A_(d->name, sz[DCS_ACT_##size]);
    DCS_TGRADS(GRAD)
#undef GRAD
    if (any.dcmha)
        for (int ph = 0; ph < 2; ph++)
            for (int s = 0; s < 2; s++) {
#define GRAD_DYN(name, size) A_(d->name[ph][s], sz[DCS_ACT_##size]);
                DCS_TGRADS_DYN(GRAD_DYN)
#undef GRAD_DYN
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
uint64_t dcs_tape_bw_scratch(const dcs_model *m, int B, int T, int sw_grad) {
    const dcs_config *c = &m->cfg;
    const dcs_layer_plan any = any_layer(m);
    if (!m->be->ops->bw_scratch) return 0;
    int mha = 0;
    for (int l = 0; l < c->n_layer; l++) mha |= !m->plan[l].dcmha;
    const dcs_bw_shape s = {.B = B,
                            .T = T,
                            .D = c->d_model,
                            .N = c->n_head,
                            .R = any.dcmha ? c->dyn_rank : 0,
                            .rot = c->rotary_dim,
                            .G = c->compose_groups > 1 ? c->compose_groups : 1,
                            .use_sw = sw_grad && any.static_branch,
                            .rows_kernel = any.row_compose,
                            .mha = mha};
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
    dcs_tape_alloc(&plan);
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
        /* [M, N, D] held in the pass: head_out, or a split q/k/v input */
        head_out |= points[i] == DCS_HP_HEAD_OUT || dcs_split_part(points[i]) >= 0;
    }
    *bytes = plan.bytes + pass_transient(m, B, T, head_out) + dcs_tape_bw_scratch(m, B, T, 1) + hooks;
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
    if (!tp->L || !tp->want || !dcs_tape_alloc(tp)) {
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
