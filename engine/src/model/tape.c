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
#include "tape.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- forward */

/* Is (point, layer) a hook point of the layers this tape runs? */
static int runs_point(const dcs_tape *tp, int point, int layer) {
    const int L = tp->m->cfg.n_layer;
    return point >= 0 && point < DCS_HP_COUNT && dcs_hook_exists(tp->m, point) &&
           !(dcs_hook_point_is_layered(point) && (layer < tp->first || layer >= L)) &&
           !(tp->first && point == DCS_HP_EMBED);
}

static dcs_status bad_point(dcs_tape *tp, const char *what, int i, int point, int layer) {
    return dcs_seterr(&tp->m->err, DCS_ERR_ARG,
                      "tape: bad %s %d (point %d, layer %d; the tape runs layers %d..%d)", what, i, point,
                      layer, tp->first, tp->m->cfg.n_layer - 1);
}

/* want[]: the overridden points, and the read ones when `reads` */
static void set_want(dcs_tape *tp, const dcs_hook_read *reads, int n_reads) {
    const int L = tp->m->cfg.n_layer;
    memset(tp->want, 0, (size_t)DCS_HP_COUNT * (L ? L : 1));
    for (int i = 0; i < tp->n_ov; i++)
        tp->want[dcs_hook_index(L, tp->ov[i].point,
                                dcs_hook_point_is_layered(tp->ov[i].point) ? tp->ov[i].layer : 0)] = 1;
    for (int i = 0; i < n_reads; i++)
        tp->want[dcs_hook_index(L, reads[i].point,
                                dcs_hook_point_is_layered(reads[i].point) ? reads[i].layer : 0)] = 1;
}

static dcs_status forward(dcs_tape *tp, const int32_t *tokens, const float *resid,
                          const dcs_hook_override *ov, int n_ov, const dcs_hook_read *reads, int n_reads,
                          float *logits) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    dcs_backend *be = m->be;
    const int M = tp->M, V = c->vocab, L = c->n_layer;
    for (int i = 0; i < M; i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            return dcs_seterr(&m->err, DCS_ERR_ARG,
                              "token id %d at index %d is outside the vocabulary [0, %d)", tokens[i], i, V);
    for (int i = 0; i < n_ov; i++) {
        if (!ov[i].data || !runs_point(tp, ov[i].point, ov[i].layer))
            return bad_point(tp, "override", i, ov[i].point, ov[i].layer);
        const int pt = ov[i].point;
        if (pt == DCS_HP_Q_INPUT || pt == DCS_HP_K_INPUT || pt == DCS_HP_V_INPUT || pt == DCS_HP_DYN_INPUT ||
            pt == DCS_HP_MLP_INPUT)
            return dcs_seterr(&m->err, DCS_ERR_UNSUPPORTED,
                              "tape: an override of %s (layer %d) is not differentiated: the split input is "
                              "read by gradients, not replaced; patch it in a forward pass",
                              dcs_hook_point_name(ov[i].point), ov[i].layer);
    }
    for (int i = 0; i < n_reads; i++)
        if (!reads[i].data || !runs_point(tp, reads[i].point, reads[i].layer))
            return bad_point(tp, "read", i, reads[i].point, reads[i].layer);
    memcpy(tp->tokens, tokens, sizeof(int32_t) * M);
    tp->status = DCS_OK;
    tp->have_forward = 0;
    tp->bw_next = -1;
    tp->ov = ov;
    tp->n_ov = n_ov;
    tp->rd = reads;
    tp->n_rd = n_reads;
    set_want(tp, reads, n_reads);
    dcs_hooks hooks = {tp->want, dcs_tape_ov_hook, tp};
    dcs_pass p;
    dcs_pass_init(&p, m, n_ov || n_reads ? &hooks : NULL, tp->B, tp->T, 0, "tape", "forward pass");
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
    tp->rd = NULL; /* the backward's recomputation reads nothing */
    tp->n_rd = 0;
    set_want(tp, NULL, 0);
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
    return forward(tp, tokens, NULL, ov, n_ov, NULL, 0, logits);
}

dcs_status dcs_tape_forward_read(dcs_tape *tp, const int32_t *tokens, const dcs_hook_override *ov, int n_ov,
                                 const dcs_hook_read *reads, int n_reads, float *logits) {
    if (tp->first)
        return dcs_seterr(&tp->m->err, DCS_ERR_ARG, "tape: it starts at layer %d; use dcs_tape_forward_from",
                          tp->first);
    if (n_reads < 0 || (n_reads && !reads)) return dcs_seterr(&tp->m->err, DCS_ERR_ARG, "tape: bad reads");
    return forward(tp, tokens, NULL, ov, n_ov, reads, n_reads, logits);
}

dcs_status dcs_tape_forward_from(dcs_tape *tp, const int32_t *tokens, const float *resid,
                                 const dcs_hook_override *ov, int n_ov, float *logits) {
    if (!resid) return dcs_seterr(&tp->m->err, DCS_ERR_ARG, "tape: resid is NULL");
    return forward(tp, tokens, tp->first ? resid : NULL, ov, n_ov, NULL, 0, logits);
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

/* Recompute plan: layer l's internals again, from its checkpoint, into the
 * shared buffers, through the forward's own code and hooks (overrides
 * included), so they are the same bits the forward computed. */
static dcs_status recompute_layer(dcs_tape *tp, int l) {
    dcs_model *m = tp->m;
    dcs_backend *be = m->be;
    dcs_hooks hooks = {tp->want, dcs_tape_ov_hook, tp};
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

/* A stage of a staged backward: from the logits (resume 0) or below the
 * last stage (resume 1: from layer top) down to layer stop. NULL: the whole
 * backward. */
typedef struct {
    int resume, stop, top;
} bw_stage;

static dcs_status run_backward(dcs_tape *tp, const float *dlogits, const bwctx *bc, const bw_stage *sg);

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

/* Where a gradient request sits in the backward's order: its layer, 0 for
 * the embedding, n_layer for the final norm and logits. */
static int request_layer(const dcs_hook_grad *r, int L) {
    return dcs_hook_point_is_layered(r->point) ? r->layer : r->point == DCS_HP_EMBED ? 0 : L;
}

static dcs_status backward(dcs_tape *tp, const float *dlogits, float *param_grads, const dcs_param_grad *pg,
                           int n_pg, const dcs_hook_grad *g, int n_g, bw_stage *sg) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    dcs_backend *be = m->be;
    const int L = c->n_layer;
    if (!tp->have_forward) return dcs_seterr(&m->err, DCS_ERR_ARG, "tape: backward before forward");
    if (sg) { /* a stage: where it runs, and every request inside it */
        if (sg->resume && tp->bw_next < 0)
            return dcs_seterr(&m->err, DCS_ERR_ARG,
                              "tape: backward stage: nothing to resume (no earlier stage "
                              "since the forward, or it reached the lowest layer)");
        if (sg->resume && dlogits)
            return dcs_seterr(&m->err, DCS_ERR_ARG, "tape: backward stage: dlogits given to a resumed stage");
        const int top = sg->top = sg->resume ? tp->bw_next : L - 1;
        if (sg->stop < tp->first || sg->stop > top)
            return dcs_seterr(&m->err, DCS_ERR_ARG, "tape: backward stage: stop layer %d outside %d..%d",
                              sg->stop, tp->first, top);
        for (int i = 0; i < n_g; i++) {
            const int at = request_layer(&g[i], L);
            if (at < sg->stop || at > (sg->resume ? top : L))
                return dcs_seterr(
                    &m->err, DCS_ERR_ARG,
                    "tape: backward stage: gradient request %d is of layer %d, outside this stage "
                    "(layers %d..%d)",
                    i, at, sg->stop, top);
        }
    }
    tp->bw_next = -1; /* a failed stage cannot be resumed */
    for (int i = 0; i < n_g; i++)
        if (!g[i].grad || !runs_point(tp, g[i].point, g[i].layer))
            return bad_point(tp, "gradient request", i, g[i].point, g[i].layer);
    if (tp->first && (param_grads || n_pg))
        return dcs_seterr(&m->err, DCS_ERR_ARG,
                          "tape: parameter gradients need a tape from layer 0 (this one "
                          "starts at %d)",
                          tp->first);
    for (int i = 0; i < n_pg; i++)
        if (!pg[i].grad || pg[i].index < 0 || pg[i].index >= m->n_weights)
            return dcs_seterr(&m->err, DCS_ERR_ARG, "tape: bad parameter gradient request %d (index %d)", i,
                              pg[i].index);
    bwctx bcv = {param_grads, pg, n_pg, g, n_g, NULL, NULL, NULL, NULL, NULL, NULL};
    const int params = param_grads || n_pg;
    tp->bw_peak = dcs_tape_bw_scratch(m, tp->B, tp->T, params);
    if (!(bcv.lg = calloc((size_t)(L ? L : 1), sizeof *bcv.lg)))
        return dcs_seterr(&m->err, DCS_ERR_NOMEM, "tape: out of memory");
    if (m->device == DCS_DEVICE_CPU || !params) {
        dcs_status st = dcs_tape_param_grads(m, &bcv);
        if (!st) st = run_backward(tp, dlogits, &bcv, sg);
        m->last_peak_bytes = tp->bytes + tp->pass_peak + tp->bw_peak;
        free(bcv.lg);
        return st;
    }
    /* on a device: the asked parameter gradients in device mirrors, uploaded
     * (the backward accumulates), run, downloaded */
    bcv.dev = calloc((size_t)m->n_weights, sizeof(float *));
    if (!bcv.dev) {
        free(bcv.lg);
        return dcs_seterr(&m->err, DCS_ERR_NOMEM, "tape: out of memory");
    }
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
    if (!st) st = dcs_tape_param_grads(m, &bcv);
    if (!st) st = run_backward(tp, dlogits, &bcv, sg);
    m->last_peak_bytes = tp->bytes + tp->pass_peak + tp->bw_peak;
    off = 0;
    for (int i = 0; i < m->n_weights; i++) {
        float *host = host_grad(m, param_grads, pg, n_pg, i, &off, &n);
        if (!bcv.dev[i]) continue;
        if (!st) be->ops->download(be, host, bcv.dev[i], n * sizeof(float));
        be->ops->free(be, bcv.dev[i]);
    }
    free(bcv.dev);
    free(bcv.lg);
    dcs_status s2 = be->ops->sync(be, &m->err);
    return st ? st : s2;
}

/* The backward proper (backward() checked its arguments), or one stage of it. */
static dcs_status run_backward(dcs_tape *tp, const float *dlogits, const bwctx *bc, const bw_stage *sg) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    dcs_backend *be = m->be;
    const int M = tp->M, V = c->vocab, L = c->n_layer;
    const dcs_hook_grad *g = bc->g;
    const int n_g = bc->n_g;
    /* the backward stops below the lowest layer anything is asked of
     * (parameters and the embedding: all of them) */
    int lowest = bc->flat || bc->n_pg ? 0 : L;
    for (int i = 0; i < n_g; i++) {
        const int at = request_layer(&g[i], L);
        if (at < lowest) lowest = at;
    }
    const int fresh = !sg || !sg->resume, top = sg ? sg->top : L - 1;
    if (sg) lowest = sg->stop;
    /* the split q/k/v inputs' scratch, once for every layer (fresh pages per
     * layer cost more than the norm's backward they hold) */
    bwctx bs = *bc;
    const size_t split = sizeof(float) * (size_t)M * c->n_head * c->d_model;
    for (int i = 0; i < n_g && !bs.split_dln; i++)
        if (dcs_split_part(g[i].point) >= 0) {
            const int host = m->device == DCS_DEVICE_CPU; /* the norm's backward writes the caller's buffer */
            bs.split_dln = be->ops->alloc(be, split);
            bs.split_dx = host ? NULL : be->ops->alloc(be, split);
            if (!bs.split_dln || (!host && !bs.split_dx)) {
                be->ops->free(be, bs.split_dln);
                be->ops->free(be, bs.split_dx);
                return dcs_seterr(&m->err, DCS_ERR_NOMEM, "tape: no memory for the split inputs' gradients");
            }
            tp->bw_peak += (host ? 1 : 2) * split;
        }
    dcs_status st = DCS_OK;
    tp->status = DCS_OK;
    if (fresh) {
        if (dlogits) be->ops->upload(be, tp->dlogits, dlogits, sizeof(float) * (size_t)M * V);
        dcs_pass_final_bw(tp, &bs);
    }
    for (int l = top; l >= lowest && !st; l--) {
        if (tp->recompute && tp->held != l) st = recompute_layer(tp, l);
        if (!st) dcs_layer_bw(tp, l, &bs);
    }
    be->ops->free(be, bs.split_dln);
    be->ops->free(be, bs.split_dx);
    if (st) return st;
    if (tp->status) return dcs_seterr(&m->err, tp->status, "tape: out of memory in the backward");
    if (!sg || lowest == 0) dcs_pass_embed_bw(tp, &bs);
    st = be->ops->sync(be, &m->err);
    if (!st && sg && lowest > tp->first) tp->bw_next = lowest - 1; /* d->dx: the gradient above it */
    return st;
}

dcs_status dcs_tape_backward(dcs_tape *tp, const float *dlogits, float *param_grads, const dcs_hook_grad *g,
                             int n_g) {
    return backward(tp, dlogits, param_grads, NULL, 0, g, n_g, NULL);
}

dcs_status dcs_tape_backward_stage(dcs_tape *tp, const float *dlogits, int resume, int stop,
                                   const dcs_hook_grad *g, int n_g) {
    if (n_g < 0 || (n_g && !g))
        return dcs_seterr(&tp->m->err, DCS_ERR_ARG, "tape: bad gradient request list (%d)", n_g);
    bw_stage sg = {resume != 0, stop, -1};
    return backward(tp, dlogits, NULL, NULL, 0, g, n_g, &sg);
}

dcs_status dcs_tape_backward_params(dcs_tape *tp, const float *dlogits, const dcs_param_grad *pg, int n_pg,
                                    const dcs_hook_grad *g, int n_g) {
    if (n_pg < 0 || (n_pg && !pg))
        return dcs_seterr(&tp->m->err, DCS_ERR_ARG, "tape: bad parameter gradient list (%d)", n_pg);
    return backward(tp, dlogits, NULL, pg, n_pg, g, n_g, NULL);
}
