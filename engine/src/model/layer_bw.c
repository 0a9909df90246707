/*
 * layer_bw.c -- the backward of one layer (tape.h), written in layer.c's
 * order with layer.c's function names plus _bw, over the backend interface
 * (so the same code differentiates a model on the CPU or on CUDA): from the
 * gradient at a section's output, the gradient at its input, the
 * parameter gradients accumulated (+=) where asked, and the gradient at
 * every hook point the section passes handed out (dcs_tape_grad_at). The
 * decisions are the forward's, read from the same layer plan.
 */
#include "tape.h"

#include <math.h>
#include <string.h>

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

/* The dynamic weights (layer.c, dynamic_weights): per (group, slot) pair
 * the hidden layer hid = gelu(ln1 dw1), w = hid qkw split into w1 (RMS
 * normalised over each group's heads) and w2, gates g = tanh(ln1 dd). From
 * their gradients (d->dw1, dw2, ddd, filled by the compose backward) into
 * d->dln1 (+=) and the parameter gradients. */
static void dynamic_weights_bw(dcs_tape *tp, int l, const bwctx *bc, float *dh, int params) {
    const dcs_layer_grads *gw = &bc->lg[l]; /* its parameter gradients */
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_plan *pl = &m->plan[l];
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_backend *be = m->be;
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    const int M = tp->M, D = c->d_model, N = c->n_head;
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
            dcs_tape_grad_at(tp, bc->g, bc->n_g, dcs_dyn_points[ph][s][0], l, d->dw1[ph][s]);
            dcs_tape_grad_at(tp, bc->g, bc->n_g, dcs_dyn_points[ph][s][1], l, d->dw2[ph][s]);
            dcs_tape_grad_at(tp, bc->g, bc->n_g, dcs_dyn_points[ph][s][2], l, d->ddd[ph][s]);
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
                be->ops->copy2d(be, d->dG + (size_t)(gr * C + slot) * Mg, GC * Mg, d->ddd[ph][s] + gr * Mg, N,
                                M, Mg);
            }
        }
    /* w[:, gc] = hid[:, gc] qkw[gc] */
    be->ops->gemm(be, 0, 1, M, K, RM2, 1.0f, d->dW, GC * RM2, RM2, lw->qkw, RM2, (long long)K * RM2, 0.0f,
                  d->dhid, GC * K, K, GC);
    float *gq = params ? gw->qkw : NULL;
    if (gq)
        be->ops->gemm(be, 1, 0, K, RM2, M, 1.0f, a->hid, GC * K, K, d->dW, GC * RM2, RM2, 1.0f, gq, RM2,
                      (long long)K * RM2, GC);
    /* hid = gelu(ln1 dw1): dhpre in place of dhid */
    float *dhpre = d->dhid;
    be->ops->gelu_bw(be, dhpre, dhpre, a->hpre, (size_t)M * GC * K);
    /* dln1 += dhpre [M, GC*K] dw1 [D, GC*K]^T */
    if (lw->m_dw1.dtype == DCS_F32 || !be->ops->gemm_w)
        be->ops->gemm(be, 0, 1, M, D, GC * K, 1.0f, dhpre, GC * K, 0, lw->m_dw1.p, GC * K, 0, 1.0f, dh, D, 0,
                      1);
    else
        be->ops->gemm_w(be, 1, M, D, GC * K, dhpre, GC * K, lw->m_dw1, 1.0f, dh, D);
    float *gdw1 = params ? gw->dw1 : NULL;
    if (gdw1)
        be->ops->gemm(be, 1, 0, D, GC * K, M, 1.0f, a->ln1, D, 0, dhpre, GC * K, 0, 1.0f, gdw1, GC * K, 0, 1);
    /* g = tanh(ln1 dd): [M, GC*Mg] = [M, C*N] */
    be->ops->tanh_bw(be, d->dG, a->g, (size_t)M * C * N);
    be->ops->gemm(be, 0, 1, M, D, C * N, 1.0f, d->dG, C * N, 0, lw->dd, C * N, 0, 1.0f, dh, D, 0, 1);
    float *gdd = params ? gw->dd : NULL;
    if (gdd)
        be->ops->gemm(be, 1, 0, D, C * N, M, 1.0f, a->ln1, D, 0, d->dG, C * N, 0, 1.0f, gdd, C * N, 0, 1);
}

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
        if (!dcs_tape_ov(tp, dcs_branch_points[ph][k], l)) on |= 1u << k;
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

/* MoH head gate backward (model-spec 5): z = zpre * gate per head. In
 * place: dz [M, N, Dh] becomes d zpre; d gate, through the routing scores
 * of the selected heads (dcs_moh_route_row_bw), to the router logits and
 * from them to d->dmoh [M, D] (the router's input ln1) and the router's
 * parameter gradients. */
static void moh_gate_bw(dcs_tape *tp, int l, const bwctx *bc) {
    const dcs_layer_grads *gw = &bc->lg[l]; /* its parameter gradients */
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    dcs_backend *be = m->be;
    const int M = tp->M, D = c->d_model, N = c->n_head, Dh = c->head_dim, hs = c->moh_shared, NR = N - hs;
    be->ops->head_gate_bw(be, d->dz, d->dhgate, a->zpre, a->hgate, M, N, Dh);
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_ROUTING, l, d->dhgate);
    be->ops->moh_route_bw(be, d->dlg, d->ds1, d->ds0, d->dhgate, a->rlg, a->rs1, a->rs0, M, N, hs,
                          c->moh_topk);
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_ROUTER_LOGITS, l, d->dlg);
    lin_bw(be, d->dmoh, 0.0f, gw->moh_wg, NULL, d->dlg, a->ln1, (dcs_wmat){lw->moh_wg, DCS_F32}, M, NR, D);
    if (hs > 1)
        lin_bw(be, d->dmoh, 1.0f, gw->moh_wg1, NULL, d->ds1, a->ln1, (dcs_wmat){lw->moh_wg1, DCS_F32}, M, hs,
               D);
    if (hs > 0)
        lin_bw(be, d->dmoh, 1.0f, gw->moh_wg0, NULL, d->ds0, a->ln1, (dcs_wmat){lw->moh_wg0, DCS_F32}, M, 2,
               D);
}

/* Does a hook ask the gradient at, or override, one of the two maps
 * (pt[0], pt[1]) of layer l, or ask it at one of a phase's branches
 * (`branches`: its row of dcs_branch_points)? Then a fused backward cannot run past them (it writes no
 * gradient map). */
static int maps_hooked_bw(const dcs_tape *tp, int l, const bwctx *bc, int pt0, int pt1, const int *branches) {
    const int pts[2] = {pt0, pt1};
    for (int i = 0; i < 2; i++)
        if (dcs_tape_wants_grad(bc->g, bc->n_g, pts[i], l) || dcs_tape_ov(tp, pts[i], l)) return 1;
    for (int k = 0; k < DCS_N_BRANCHES; k++)
        if (dcs_tape_wants_grad(bc->g, bc->n_g, branches[k], l)) return 1;
    return 0;
}

/* May the backend fuse the post-compose, softmax and pre-compose
 * backward of layer l (compose_softmax_bw)? Not when a hook between them
 * wants its gradient or is overridden (dP, dAc are then not written). */
static int fuse_maps_bw(dcs_tape *tp, int l, const bwctx *bc) {
    if (!tp->m->be->ops->compose_softmax_bw || !tp->kT[0][0] || !tp->m->plan[l].row_compose) return 0;
    return !maps_hooked_bw(tp, l, bc, DCS_HP_PATTERN, DCS_HP_SCORES_COMPOSED, dcs_branch_points[0]);
}

/* May the backend run layer l's attention backward by blocks
 * (attention_bw)? Plain DCMHA on the CPU's row kernel (fuse_maps_bw), and
 * no hook wanting the gradient of a map (scores, the post-compose branches,
 * the composed pattern) or overriding one. */
static int fused_bw_allowed(dcs_tape *tp, int l, const bwctx *bc) {
    if (!tp->m->be->ops->attention_bw || !fuse_maps_bw(tp, l, bc)) return 0;
    return !maps_hooked_bw(tp, l, bc, DCS_HP_SCORES, DCS_HP_PATTERN_COMPOSED, dcs_branch_points[1]);
}

/* The fused attention kernel's backward (layer.c, attention_fused): the
 * per-head products, both compose phases and the softmax by blocks of
 * query rows in the backend, no gradient map written; from d->dz to d->dq,
 * d->dk, d->dv. 0 when the backend has no scratch for it (then the maps'
 * backward does the same). */
static int attention_fused_bw(dcs_tape *tp, int l, const bwctx *bc) {
    dcs_model *m = tp->m;
    const int window = m->plan[l].window, Dh = m->cfg.head_dim, D = m->cfg.d_model;
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    const dcs_compose_bw_args post = compose_bw_args(tp, l, 1, d->dP, d->dPc, a->P, window);
    const dcs_compose_bw_args pre = compose_bw_args(tp, l, 0, d->dA, d->dAc, a->A, window);
    const dcs_attn_bw_args ab = {
        &post, &pre, d->dz, a->q, a->k, a->v, a->Pc, d->dq, d->dk, d->dv, Dh, D, 1.0f / sqrtf((float)Dh)};
    if (m->be->ops->attention_bw(m->be, &ab)) return 0;
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_V, l, d->dv);
    return 1;
}

/* Plain attention's backward per (sequence, head) in the backend
 * (ops->mha_bw: the same products and softmax backward as
 * attention_maps_bw, no gradient map written), when no hook wants the
 * gradient of a map or overrides one and the products run in float32: from
 * d->dz to d->dq, d->dk, d->dv. 0 when it did not run. */
static int mha_fused_bw(dcs_tape *tp, int l, const bwctx *bc, int window) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    dcs_backend *be = m->be;
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    if (!be->ops->mha_bw || (m->act_dtype != DCS_F32 && be->ops->gemm_x)) return 0;
    const int maps[2] = {DCS_HP_PATTERN, DCS_HP_SCORES};
    for (int i = 0; i < 2; i++)
        if (dcs_tape_wants_grad(bc->g, bc->n_g, maps[i], l) || dcs_tape_ov(tp, maps[i], l)) return 0;
    const dcs_mha_bw_args ab = {d->dz,     a->q,        a->k,       a->v,   a->P,
                                d->dq,     d->dk,       d->dv,      tp->B,  tp->T,
                                c->n_head, c->head_dim, c->d_model, window, 1.0f / sqrtf((float)c->head_dim)};
    if (be->ops->mha_bw(be, &ab)) return 0;
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_V, l, d->dv);
    return 1;
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
    /* z = P' v: dP' = dz v^T, dv = P'^T dz (per b, batched over heads) */
    const float *pat = dcmha ? a->Pc : a->P;
    float *dpat = dcmha ? d->dPc : d->dP;
    /* dP'[b, n] = dz[b, :, n] v[b, :, n]^T;  dv[b, :, n] = P'[b, n]^T dz[b, :, n] */
    dcs_heads_map(be, m->act_dtype, B, N, T, T, Dh, D, 1.0f, d->dz, a->v, dpat);
    dcs_heads_rows(be, m->act_dtype, 1, B, N, T, T, Dh, D, 1.0f, pat, d->dz, d->dv);
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_V, l, d->dv);
    int fused = 0;
    if (dcmha) {
        dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_PATTERN_COMPOSED, l, d->dPc);
        for (int k = 0; k < DCS_N_BRANCHES; k++)
            if (dcs_hook_exists(m, dcs_branch_points[1][k]))
                dcs_tape_grad_capture(tp, bc->g, bc->n_g, dcs_branch_points[1][k], l, d->dPc);
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
        dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_PATTERN, l, d->dP);
        float *dpre = dcmha ? d->dAc : d->dA;
        be->ops->softmax_bw(be, dpre, d->dP, a->P, B * N, T, T, window);
    }
    if (dcmha && !fused) {
        dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_SCORES_COMPOSED, l, d->dAc);
        for (int k = 0; k < DCS_N_BRANCHES; k++)
            if (dcs_hook_exists(m, dcs_branch_points[0][k]))
                dcs_tape_grad_capture(tp, bc->g, bc->n_g, dcs_branch_points[0][k], l, d->dAc);
        compose_bw(tp, l, 0, d->dA, d->dAc, a->A, window);
    }
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_SCORES, l, d->dA);

    /* A = q k^T / sqrt(Dh): dq = s dA k, dk = s dA^T q */
    const float sc = 1.0f / sqrtf((float)Dh);
    dcs_heads_rows(be, m->act_dtype, 0, B, N, T, T, Dh, D, sc, d->dA, a->k, d->dq);
    dcs_heads_rows(be, m->act_dtype, 1, B, N, T, T, Dh, D, sc, d->dA, a->q, d->dk);
}

/* The attention output (layer.c, attention_out): out = z wo^T + bo, with
 * head_out [M, N, D] between (its gradient is d out for every head). From
 * d->dao to d->dz (written). */
static void attention_out_bw(dcs_tape *tp, int l, const bwctx *bc) {
    const dcs_layer_grads *gw = &bc->lg[l]; /* its parameter gradients */
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_backend *be = m->be;
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    const int M = tp->M, D = c->d_model, N = c->n_head;
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_ATTN_OUT, l, d->dao);
    if (dcs_tape_wants_grad(bc->g, bc->n_g, DCS_HP_HEAD_OUT, l)) {
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
    float *gbo = gw->bo;
    if (gbo) be->ops->col_sum(be, gbo, d->dao, M, D);
    if (dcs_tape_ov(tp, DCS_HP_HEAD_OUT, l)) be->ops->zero(be, d->dao, sizeof(float) * (size_t)M * D);
    lin_bw(be, d->dz, 0.0f, gw->wo, NULL, d->dao, a->z, lw->m_wo, M, D, D);
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_Z, l, d->dz);
}

/* The split q/k/v input (layer.c, split_input): head n's q (part 0), k or
 * v rows = LN(x) W_n^T + b_n, with x the block input. The gradient at
 * attn.{q,k,v}_input [M, N, D], head n's copy: LN_bw(x, dy_n W_n), dy_n
 * head n's columns of d->dqkv (the gradient of the projection, before q/k
 * norm and rotary). Handed out only: the gradient reaching x through ln1
 * is the sum of these over heads and parts, which the shared path gives. */
static void split_inputs_bw(dcs_tape *tp, int l, const bwctx *bc) {
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_backend *be = m->be;
    const int M = tp->M, D = c->d_model, N = c->n_head, Dh = c->head_dim;
    int asked = 0;
    for (int part = 0; part < 3; part++)
        asked += dcs_tape_wants_grad(bc->g, bc->n_g, dcs_split_points[part], l);
    if (!asked) return;
    /* the backward's buffers [M, N, D] for the parts asked (run_backward) */
    float *dln = bc->split_dln, *dx = bc->split_dx, *dy = NULL, *tmp = NULL;
    const int w16 = lw->m_wqkv.dtype != DCS_F32 && be->ops->gemm_w; /* head by head, scratch dy, tmp */
    if (w16) {
        dy = be->ops->alloc(be, sizeof(float) * (size_t)M * Dh);
        tmp = be->ops->alloc(be, sizeof(float) * (size_t)M * D);
        if (!dy || !tmp) tp->status = DCS_ERR_NOMEM;
    }
    const size_t es = dcs_dtype_size(lw->m_wqkv.dtype);
    for (int part = 0; part < 3 && !tp->status; part++) {
        const int point = dcs_split_points[part];
        const size_t row0 = (size_t)part * D;
        if (!dcs_tape_wants_grad(bc->g, bc->n_g, point, l)) continue;
        if (!w16) {
            /* dln[:, n] [M, D] = dqkv[:, n's Dh columns] W_n [Dh, D], one gemm batched over the heads */
            be->ops->gemm(be, 0, 0, M, D, Dh, 1.0f, tp->d.dqkv + row0, 3 * D, Dh,
                          (const float *)lw->m_wqkv.p + row0 * D, D, (long long)Dh * D, 0.0f, dln, N * D, D,
                          N);
        } else { /* a 16-bit wqkv: head by head through gemm_w */
            for (int n = 0; n < N; n++) {
                const size_t row = row0 + (size_t)n * Dh;
                const dcs_wmat wn = {(const char *)lw->m_wqkv.p + row * D * es, lw->m_wqkv.dtype};
                be->ops->copy2d(be, dy, Dh, tp->d.dqkv + row, 3 * D, M, Dh);
                be->ops->gemm_w(be, 0, M, D, Dh, dy, Dh, wn, 0.0f, tmp, D);
                be->ops->copy2d(be, dln + (size_t)n * D, (size_t)N * D, tmp, D, M, D);
            }
        }
        /* every head's row reads x: the norm's statistics once per token; on
         * the CPU written straight into the first buffer asked (no copy) */
        float *out = dx;
        int own = -1;
        for (int i = 0; i < bc->n_g && own < 0 && m->device == DCS_DEVICE_CPU; i++)
            if (bc->g[i].point == point && bc->g[i].layer == l) own = i, out = bc->g[i].grad;
        be->ops->norm_bw_fanout(be, out, dln, tp->L[l].x, lw->attn_norm_w, M, N, D, c->norm_eps,
                                m->plan[l].norm == DCS_NORM_RMS);
        for (int i = 0; i < bc->n_g; i++) /* [M, N, D], the hook's layout, to the others asked */
            if (i != own && bc->g[i].point == point && bc->g[i].layer == l)
                be->ops->download(be, bc->g[i].grad, out, sizeof(float) * (size_t)M * N * D);
    }
    be->ops->free(be, dy);
    be->ops->free(be, tmp);
}

/* A split input read by one reader's norm (layer.c, split_copy: attn.dyn_input,
 * mlp_input). Called twice: with dh NULL it gives a zeroed [M, D] buffer
 * for the reader's backward to accumulate the gradient of its normed input
 * into; with that buffer it hands out the gradient at the split input,
 * LN_bw(x, dh) (norm weight w, no parameter gradient: the caller's
 * backward adds those). NULL with tp->status set when out of memory. */
static float *split_grad(dcs_tape *tp, int l, const bwctx *bc, int point, const float *w, const float *x,
                         float *dh) {
    dcs_backend *be = tp->m->be;
    const size_t bytes = sizeof(float) * (size_t)tp->M * tp->m->cfg.d_model;
    if (!dh) {
        float *z = be->ops->alloc(be, bytes);
        if (!z)
            tp->status = DCS_ERR_NOMEM;
        else
            be->ops->zero(be, z, bytes);
        return z;
    }
    float *dx = be->ops->alloc(be, bytes);
    if (!dx) {
        tp->status = DCS_ERR_NOMEM;
        return NULL;
    }
    be->ops->zero(be, dx, bytes);
    norm_bw(tp, tp->m->plan[l].norm, dx, NULL, NULL, dh, x, w);
    dcs_tape_grad_capture(tp, bc->g, bc->n_g, point, l, dx);
    be->ops->free(be, dx);
    return dh;
}

/* d->dqkv [M, 3D] from d->dq, d->dk (rotated back in place, then through
 * the q/k norms when the layer has them) and d->dv, op by op (layer.c,
 * project_qkv). */
static void qkv_grad_bw(dcs_tape *tp, int l, const bwctx *bc) {
    const dcs_layer_grads *gw = &bc->lg[l]; /* its parameter gradients */
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_backend *be = m->be;
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    const int T = tp->T, M = tp->M, D = c->d_model, N = c->n_head, Dh = c->head_dim;
    be->ops->rotary_bw(be, d->dq, M, T, N, Dh, c->rotary_dim, c->rope_base);
    be->ops->rotary_bw(be, d->dk, M, T, N, Dh, c->rotary_dim, c->rope_base);
    if (m->plan[l].qk_norm) {
        be->ops->zero(be, d->dln1, sizeof(float) * (size_t)M * D); /* scratch */
        be->ops->rmsnorm_bw(be, d->dln1, gw->q_scale, d->dq, a->qraw, lw->q_scale, M * N, Dh, 1e-6f);
        be->ops->copy2d(be, d->dqkv, 3 * D, d->dln1, D, M, D);
        be->ops->zero(be, d->dln1, sizeof(float) * (size_t)M * D);
        be->ops->rmsnorm_bw(be, d->dln1, gw->k_scale, d->dk, a->kraw, lw->k_scale, M * N, Dh, 1e-6f);
        be->ops->copy2d(be, d->dqkv + D, 3 * D, d->dln1, D, M, D);
    } else {
        be->ops->copy2d(be, d->dqkv, 3 * D, d->dq, D, M, D);
        be->ops->copy2d(be, d->dqkv + D, 3 * D, d->dk, D, M, D);
    }
    be->ops->copy2d(be, d->dqkv + 2 * D, 3 * D, d->dv, D, M, D);
}

/* Attention of layer l (layer.c, attention): from d->dao to d->dln1
 * (written), through the output, the MoH gate, the maps (or the fused
 * kernel), rotary and q/k norms, the qkv product and the dynamic weights. */
static void attention_bw(dcs_tape *tp, int l, const bwctx *bc) {
    const dcs_layer_grads *gw = &bc->lg[l]; /* its parameter gradients */
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_plan *pl = &m->plan[l];
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_backend *be = m->be;
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    const int T = tp->T, M = tp->M, D = c->d_model, N = c->n_head, Dh = c->head_dim;
    attention_out_bw(tp, l, bc);
    if (pl->moh) moh_gate_bw(tp, l, bc);
    d->dsw[0] = pl->static_branch ? gw->pre_sw : NULL;
    d->dsw[1] = pl->static_branch ? gw->post_sw : NULL;
    if (pl->dcmha ? !fused_bw_allowed(tp, l, bc) || !attention_fused_bw(tp, l, bc)
                  : !mha_fused_bw(tp, l, bc, pl->window))
        attention_maps_bw(tp, l, bc, pl->window);
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_Q, l, d->dq);
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_K, l, d->dk);
    /* dqkv [M, 3D]: without q/k norms rotary's backward and the join in one pass */
    if (pl->qk_norm || !be->ops->qkv_join_bw ||
        be->ops->qkv_join_bw(be, d->dqkv, d->dq, d->dk, d->dv, M, T, N, Dh, c->rotary_dim, c->rope_base))
        qkv_grad_bw(tp, l, bc);
    split_inputs_bw(tp, l, bc);
    lin_bw(be, d->dln1, 0.0f, gw->wqkv, gw->bqkv, d->dqkv, a->ln1, lw->m_wqkv, M, 3 * D, D);

    if (pl->dcmha) dynamic_weights_bw(tp, l, bc, d->dln1, 1);
    if (pl->dcmha && dcs_tape_wants_grad(bc->g, bc->n_g, DCS_HP_DYN_INPUT, l)) {
        /* its part alone again, for the split input attn.dyn_input (no
         * parameter gradient twice; nothing else changes) */
        float *dh = split_grad(tp, l, bc, DCS_HP_DYN_INPUT, lw->attn_norm_w, a->x, NULL);
        if (dh) {
            dynamic_weights_bw(tp, l, bc, dh, 0);
            split_grad(tp, l, bc, DCS_HP_DYN_INPUT, lw->attn_norm_w, a->x, dh);
            be->ops->free(be, dh);
        }
    }
    if (pl->moh) /* the router read ln1 too */
        be->ops->add(be, d->dln1, d->dmoh, (size_t)M * D);
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_LN_ATTN, l, d->dln1);
}

/* DCFormer++'s MLP group gate (layer.c, mlp_group_gate): g = softmax(ln2
 * mg^T) per row, u [M, E, F/E] *= g. From d->dgate (the swiglu op's) into
 * d->dln2 (written) and mg's gradient. */
static void mlp_group_gate_bw(dcs_tape *tp, int l, const bwctx *bc) {
    const dcs_layer_grads *gw = &bc->lg[l]; /* its parameter gradients */
    dcs_model *m = tp->m;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    const int M = tp->M, D = m->cfg.d_model, E = m->plan[l].mlp_gate;
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_MLP_GATE, l, d->dgate);
    m->be->ops->softmax_rows_bw(m->be, d->dgate, a->gate, M, E);
    lin_bw(m->be, d->dln2, 0.0f, gw->mg, NULL, d->dgate, a->ln2, (dcs_wmat){lw->mg, DCS_F32}, M, E, D);
}

/* DCFormer++'s gated MLP, from d post (in d->dug) to d->du (w1 x) and
 * d->du3 (w3 x), with the group gate's gradient into d->dln2 (written):
 *   pu = silu(u) * u3, post = pu * gate[group], gate = softmax(ln2 mg^T). */
static void swiglu_bw(dcs_tape *tp, int l, const bwctx *bc) {
    const dcs_layer_grads *gw = &bc->lg[l]; /* its parameter gradients */
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    dcs_backend *be = m->be;
    const int M = tp->M, D = c->d_model, F = c->d_ff, E = m->plan[l].mlp_gate;
    be->ops->zero(be, d->dln2, sizeof(float) * (size_t)M * D);
    be->ops->swiglu_bw(be, d->du, d->du3, d->dgate, d->dug, a->u, a->u3, a->gate, M, F, E);
    if (E > 0) mlp_group_gate_bw(tp, l, bc);
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_MLP_PRE_LINEAR, l, d->du3);
    lin_bw(m->be, d->dln2, 1.0f, gw->w3, NULL, d->du3, a->ln2, lw->m_w3, M, F, D);
}

static void mlp_bw(dcs_tape *tp, int l, const bwctx *bc) {
    const dcs_layer_grads *gw = &bc->lg[l]; /* its parameter gradients */
    dcs_model *m = tp->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_backend *be = m->be;
    dcs_kept *a = &tp->L[l];
    tgrads *d = &tp->d;
    const int M = tp->M, D = c->d_model, F = c->d_ff;
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_MLP_OUT, l, d->dmo);
    lin_bw(be, d->dug, 0.0f, gw->w2, gw->b2, d->dmo, a->ug, lw->m_w2, M, D, F);
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_MLP_POST, l, d->dug);
    float beta = 0.0f, *du = d->du, *gb1 = gw->b1;
    if (m->plan[l].mlp == DCS_MLP_SWIGLU) {
        swiglu_bw(tp, l, bc);
        beta = 1.0f;
    } else { /* GELU, in place: d->dug is read no more, and its lines are in cache */
        du = d->dug;
        /* no hook at mlp.pre: b1's gradient in the same pass */
        const int sum = gb1 && !dcs_tape_wants_grad(bc->g, bc->n_g, DCS_HP_MLP_PRE, l) &&
                        !dcs_tape_ov(tp, DCS_HP_MLP_PRE, l);
        if (be->ops->gelu_bw_sum && (sum || a->u_dgelu)) {
            be->ops->gelu_bw_sum(be, du, sum ? gb1 : NULL, d->dug, a->u, M, F, a->u_dgelu);
            if (sum) gb1 = NULL;
        } else
            be->ops->gelu_bw(be, du, d->dug, a->u, (size_t)M * F);
    }
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_MLP_PRE, l, du);
    lin_bw(be, d->dln2, beta, gw->w1, gb1, du, a->ln2, lw->m_w1, M, F, D);
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_LN_MLP, l, d->dln2);
}

/* The MLP's norm of x (layer.c, mlp_norm): d->dx += its backward from
 * d->dln2, through the split input mlp_input when its gradient is asked. */
static void mlp_norm_bw(dcs_tape *tp, int l, const bwctx *bc, const float *x) {
    const dcs_layer_grads *gw = &bc->lg[l];
    const dcs_layer_weights *lw = &tp->m->layers[l];
    const int norm = tp->m->plan[l].norm;
    tgrads *d = &tp->d;
    norm_bw(tp, norm, d->dx, gw->ffn_norm_w, gw->ffn_norm_b, d->dln2, x, lw->ffn_norm_w);
    if (!dcs_tape_wants_grad(bc->g, bc->n_g, DCS_HP_MLP_INPUT, l)) return;
    /* its part alone again (no parameter gradient twice; nothing else changes) */
    dcs_backend *be = tp->m->be;
    const size_t n = (size_t)tp->M * tp->m->cfg.d_model;
    float *dm = be->ops->alloc(be, n * sizeof(float));
    if (!dm) {
        tp->status = DCS_ERR_NOMEM;
        return;
    }
    be->ops->zero(be, dm, n * sizeof(float));
    norm_bw(tp, norm, dm, NULL, NULL, d->dln2, x, lw->ffn_norm_w);
    dcs_tape_grad_capture(tp, bc->g, bc->n_g, DCS_HP_MLP_INPUT, l, dm);
    be->ops->free(be, dm);
}

/* A parallel residual's two LayerNorms of x (the MLP's, then the
 * attention's: mlp_norm_bw then norm_bw) in one backward pass
 * (ops->layernorm2_bw, the same bits); 0 where it cannot run (RMS norms,
 * the split input mlp_input asked, no such op or no scratch). */
static int norms_bw(dcs_tape *tp, int l, const bwctx *bc) {
    const dcs_layer_grads *gw = &bc->lg[l];
    dcs_model *m = tp->m;
    const dcs_layer_weights *lw = &m->layers[l];
    tgrads *d = &tp->d;
    if (m->plan[l].norm == DCS_NORM_RMS || !m->be->ops->layernorm2_bw ||
        dcs_tape_wants_grad(bc->g, bc->n_g, DCS_HP_MLP_INPUT, l))
        return 0;
    const dcs_norm_bw_side mlp = {d->dln2, lw->ffn_norm_w, gw->ffn_norm_w, gw->ffn_norm_b};
    const dcs_norm_bw_side attn = {d->dln1, lw->attn_norm_w, gw->attn_norm_w, gw->attn_norm_b};
    const float *st = tp->L[l].lnst_set ? tp->L[l].lnst : NULL; /* the forward's statistics */
    return !m->be->ops->layernorm2_bw(m->be, d->dx, &mlp, &attn, st, tp->L[l].x, tp->M, m->cfg.d_model,
                                      m->cfg.norm_eps);
}

/* Block l (layer.c, dcs_layer): out = x + attn(ln1 x) + mlp(ln2 x) with a
 * parallel residual, else h = x + attn(ln1 x), out = h + mlp(ln2 h). From
 * d->dx at resid_post to d->dx at resid_pre. */
void dcs_layer_bw(dcs_tape *tp, int l, const bwctx *bc) {
    const dcs_layer_grads *gw = &bc->lg[l]; /* its parameter gradients */
    dcs_model *m = tp->m;
    dcs_backend *be = m->be;
    tgrads *d = &tp->d;
    dcs_kept *a = &tp->L[l];
    const dcs_layer_weights *lw = &m->layers[l];
    const dcs_layer_plan *pl = &m->plan[l];
    const int M = tp->M, D = m->cfg.d_model;
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_RESID_POST, l, d->dx);
    /* the MLP's and the attention's output gradients are dx as it stands
     * when they run (read only, before dx changes); a copy only where an
     * override cuts them (grad_at zeroes its buffer) */
    float *const dmo = d->dmo, *const dao = d->dao;
    const int cut_mo = dcs_tape_ov(tp, DCS_HP_MLP_OUT, l) != NULL;
    const int cut_ao = dcs_tape_ov(tp, DCS_HP_ATTN_OUT, l) || dcs_tape_ov(tp, DCS_HP_HEAD_OUT, l);
    if (cut_mo)
        be->ops->copy(be, dmo, d->dx, sizeof(float) * (size_t)M * D);
    else
        d->dmo = d->dx;
    mlp_bw(tp, l, bc);
    if (!pl->parallel_residual) mlp_norm_bw(tp, l, bc, a->h);
    if (cut_ao)
        be->ops->copy(be, dao, d->dx, sizeof(float) * (size_t)M * D);
    else
        d->dao = d->dx;
    attention_bw(tp, l, bc);
    d->dmo = dmo;
    d->dao = dao;
    if (!pl->parallel_residual || !norms_bw(tp, l, bc)) {
        if (pl->parallel_residual) mlp_norm_bw(tp, l, bc, a->x);
        norm_bw(tp, pl->norm, d->dx, gw->attn_norm_w, gw->attn_norm_b, d->dln1, a->x, lw->attn_norm_w);
    }
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_RESID_PRE, l, d->dx);
}

/* The final norm and unembedding (layer.c, dcs_pass_final), from the
 * tape's dlogits to d->dx at the last residual stream. */
void dcs_pass_final_bw(dcs_tape *tp, const bwctx *bc) {
    dcs_model *m = tp->m;
    dcs_backend *be = m->be;
    tgrads *d = &tp->d;
    const int M = tp->M, D = m->cfg.d_model, V = m->cfg.vocab, L = m->cfg.n_layer;
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_LOGITS, 0, tp->dlogits);
    lin_bw(be, d->dln1, 0.0f, bc->out_w, NULL, tp->dlogits, tp->lnf, m->m_out_w, M, V, D);
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_LN_FINAL, 0, d->dln1);
    be->ops->zero(be, d->dx, sizeof(float) * (size_t)M * D);
    norm_bw(tp, m->plan[L - 1].norm, d->dx, bc->norm_w, bc->norm_b, d->dln1, tp->xL, m->norm_w);
}

/* The embedding (pass.c, dcs_pass_embed): d->dx into its rows. */
void dcs_pass_embed_bw(dcs_tape *tp, const bwctx *bc) {
    dcs_model *m = tp->m;
    dcs_tape_grad_at(tp, bc->g, bc->n_g, DCS_HP_EMBED, 0, tp->d.dx);
    float *ge = bc->tok_emb;
    if (ge) m->be->ops->embed_bw(m->be, ge, tp->d.dx, tp->tokens, tp->M, m->cfg.d_model);
}
