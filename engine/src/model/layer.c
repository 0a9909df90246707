/*
 * layer.c -- the one layer of DCPythia / DCFormer++ / Pythia, written once over the
 * backend interface (CPU or CUDA), for its three uses (pass.h): T new query
 * positions per sequence, at positions t0 .. t0+T-1, against the keys held
 * in a decoder's cache (if any) and the T new ones; activations the
 * backward reads kept when the pass keeps them (the tape); a hook call at
 * every named activation (shared/docs/hooks.md).
 *
 * Shapes: B sequences of T new tokens, M = B*T rows; S keys per sequence
 * (T in a full pass; the cached + new ones in a decoding step), key j at
 * position kb + j. D model dim, N heads, Dh head dim, F MLP width;
 * DCMHA: C slots, K hidden, R rank, G groups of Mg = N/G heads.
 * Activations are row-major float32 in backend memory:
 *   x, h [M, D]   qkv [M, 3D]   q, z [B, T, N, Dh]   k, v [B, S, N, Dh]
 *   scores/pattern [B, N, T, S]   dynamic weights [B, T|S, R, N], gates [B, T|S, N]
 *
 * Hooks cost nothing when not asked for: optional tensors (compose
 * branches, head_out) are only materialised for the layers whose hooks
 * want them, and nothing is copied to the host otherwise. From q, k, v
 * and the dynamic weights to z, attention itself is attention.c's.
 */
#include "pass.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The buffer of a kept activation, else a new one from the pass. */
static float *act(dcs_pass *p, float *kept, int64_t n1, int64_t n2, int64_t n3) {
    return kept ? kept : dcs_pass_alloc(p, n1, n2, n3);
}

/* ---------------------------------------------------------------- dynamic weights */

/* Dynamic weights of one layer (model-spec 2 step 4) into dw (dcs_dyn_weights, pass.h). */
static void dynamic_weights(dcs_pass *p, int l, const float *h, dcs_dyn_weights *dw) {
    const dcs_config *c = &p->m->cfg;
    const dcs_layer_plan *pl = &p->m->plan[l];
    const dcs_layer_weights *lw = &p->m->layers[l];
    dcs_kept *kp = p->keep ? &p->keep[l] : NULL;
    dcs_kv_cache *kc = p->cache ? &p->cache[l] : NULL;
    const int M = p->M, D = c->d_model, N = c->n_head, R = c->dyn_rank;
    const int C = pl->slots, K = c->dyn_hidden;
    /* G groups of Mg heads (model-spec 5): per group and slot its own hidden
     * layer and [2R, Mg] weights; G = 1 is the plain layout */
    const int G = pl->groups, Mg = N / G, GC = G * C, RM2 = 2 * R * Mg;
    dcs_backend *be = p->be;
    float *hid = act(p, kp ? kp->hid : NULL, M, GC, K); /* [M, G, C, K]      */
    float *w = dcs_pass_alloc(p, M, GC, RM2);           /* [M, G, C, 2R, Mg] */
    float *g = act(p, kp ? kp->g : NULL, M, GC, Mg);    /* [M, G, C, Mg]     */
    if (p->status) return;
    if (lw->m_dw1.dtype == DCS_F32 || !be->ops->gemm_w)
        be->ops->gemm(be, 0, 0, M, GC * K, D, 1.0f, h, D, 0, lw->m_dw1.p, GC * K, 0, 0.0f, hid, GC * K, 0, 1);
    else
        be->ops->gemm_w(be, 0, M, GC * K, D, h, D, lw->m_dw1, 0.0f, hid, GC * K);
    if (kp) be->ops->copy(be, kp->hpre, hid, sizeof(float) * (size_t)M * GC * K);
    be->ops->gelu(be, hid, (size_t)M * GC * K);
    /* w[:, gc] = hid[:, gc] @ qkw[gc], batched over the G*C (group, slot) pairs */
    be->ops->gemm(be, 0, 0, M, RM2, K, 1.0f, hid, GC * K, K, lw->qkw, RM2, (long long)K * RM2, 0.0f, w,
                  GC * RM2, RM2, GC);
    be->ops->gemm(be, 0, 0, M, GC * Mg, D, 1.0f, h, D, 0, lw->dd, GC * Mg, 0, 0.0f, g, GC * Mg, 0, 1);
    be->ops->tanh_(be, g, (size_t)M * GC * Mg);
    for (int phase = 0; phase < 2; phase++)
        for (int side = 0; side < 2; side++) {
            dw->w1[phase][side] = dw->w2[phase][side] = dw->dd[phase][side] = NULL;
            const int slot = pl->slot[phase][side];
            if (slot < 0) continue; /* the side is absent (query- or key-wise) */
            float *w1, *w2, *dd;
            if (side == 1 && kc) { /* the new keys' rows of the cache */
                w1 = kc->kw1[phase] + (size_t)kc->used * R * N;
                w2 = kc->kw2[phase] + (size_t)kc->used * R * N;
                dd = kc->kdd[phase] + (size_t)kc->used * N;
            } else {
                w1 = act(p, kp ? kp->w1[phase][side] : NULL, M, R, N);
                w2 = act(p, kp ? kp->w2[phase][side] : NULL, M, R, N);
                dd = act(p, kp ? kp->dd[phase][side] : NULL, M, N, 1);
            }
            if (p->status) return;
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
                    be->ops->copy2d(be, dd + (size_t)gr * Mg, N, g + (size_t)(gr * C + slot) * Mg, GC * Mg, M,
                                    Mg);
                }
            }
            if (kp) be->ops->copy(be, kp->w1raw[phase][side], w1, sizeof(float) * (size_t)M * R * N);
            /* RMS norm of qw1/kw1 over each group's heads */
            be->ops->rmsnorm(be, w1, M * R * G, Mg, Mg, NULL, 1e-6f);
            dw->w1[phase][side] = w1;
            dw->w2[phase][side] = w2;
            dw->dd[phase][side] = dd;
        }
    dcs_pass_release(p, hid);
    dcs_pass_release(p, w);
    dcs_pass_release(p, g);
    for (int ph = 0; ph < 2; ph++)
        for (int side = 0; side < 2; side++) {
            if (!dw->w1[ph][side]) continue;
            for (int i = 0; i < 3; i++)
                dcs_pass_hook(p, dcs_dyn_points[ph][side][i], l,
                              i == 0   ? dw->w1[ph][side]
                              : i == 1 ? dw->w2[ph][side]
                                       : dw->dd[ph][side]);
        }
    if (kc) /* the compose reads the key side of every held key */
        for (int ph = 0; ph < 2; ph++)
            if (dw->w1[ph][1]) {
                dw->w1[ph][1] = kc->kw1[ph];
                dw->w2[ph][1] = kc->kw2[ph];
                dw->dd[ph][1] = kc->kdd[ph];
            }
}

static void release_dyn(dcs_pass *p, dcs_dyn_weights *dw) {
    for (int ph = 0; ph < 2; ph++)
        for (int s = 0; s < 2; s++) {
            dcs_pass_release(p, dw->w1[ph][s]);
            dcs_pass_release(p, dw->w2[ph][s]);
            dcs_pass_release(p, dw->dd[ph][s]);
            dw->w1[ph][s] = dw->w2[ph][s] = dw->dd[ph][s] = NULL;
        }
}

/* MoH routing of layer l (model-spec 5) on h [M, D] (normed): the router
 * logits and routing scores, each through its hook, then z [M, N, Dh] *= g.
 * A rewritten router_logits feeds the routing computed from it; a rewritten
 * routing is the gate applied. */
static void moh_gate(dcs_pass *p, int l, const float *h, float *z) {
    const dcs_config *c = &p->m->cfg;
    const dcs_layer_weights *lw = &p->m->layers[l];
    dcs_kept *kp = p->keep ? &p->keep[l] : NULL;
    const int M = p->M, D = c->d_model, N = c->n_head, hs = c->moh_shared;
    float *lg = act(p, kp ? kp->rlg : NULL, M, N - hs, 1), *g = act(p, kp ? kp->hgate : NULL, M, N, 1);
    float *s1 = hs > 1 ? act(p, kp ? kp->rs1 : NULL, M, hs, 1) : NULL;
    float *s0 = hs > 0 ? act(p, kp ? kp->rs0 : NULL, M, 2, 1) : NULL;
    if (p->status) return;
    if (kp) p->be->ops->copy(p->be, kp->zpre, z, sizeof(float) * (size_t)M * D);
    dcs_pass_linear(p, lg, h, (dcs_wmat){lw->moh_wg, DCS_F32}, NULL, M, N - hs, D);
    if (s1) dcs_pass_linear(p, s1, h, (dcs_wmat){lw->moh_wg1, DCS_F32}, NULL, M, hs, D);
    if (s0) dcs_pass_linear(p, s0, h, (dcs_wmat){lw->moh_wg0, DCS_F32}, NULL, M, 2, D);
    dcs_pass_hook(p, DCS_HP_ROUTER_LOGITS, l, lg);
    p->be->ops->moh_route(p->be, g, lg, s1, s0, M, N, hs, c->moh_topk);
    dcs_pass_hook(p, DCS_HP_ROUTING, l, g);
    p->be->ops->head_gate(p->be, z, g, M, N, c->head_dim);
    dcs_pass_release(p, lg);
    dcs_pass_release(p, g);
    dcs_pass_release(p, s1);
    dcs_pass_release(p, s0);
}

/* From z [M, N, Dh] to the attention output out [M, D] (hooks z, head_out,
 * attn.out); releases z. */
static void attention_out(dcs_pass *p, int l, float *z, float *out) {
    dcs_model *m = p->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_backend *be = p->be;
    const int M = p->M, D = c->d_model, N = c->n_head, Dh = c->head_dim;
    dcs_pass_hook(p, DCS_HP_Z, l, z);

    /* head_out [M, N, D]: z_n [M, Dh] @ wo[:, n*Dh:(n+1)*Dh]^T, batched over n */
    int from_heads = 0;
    if (dcs_pass_wants(p, DCS_HP_HEAD_OUT, l)) {
        float *ho = dcs_pass_alloc(p, M, N, D), *wtmp = NULL;
        const float *wo = lw->m_wo.p;
        if (lw->m_wo.dtype != DCS_F32) { /* kept F16/BF16: widened for this product */
            wtmp = dcs_pass_alloc(p, D, D, 1);
            if (wtmp) be->ops->widen(be, wtmp, lw->m_wo, (size_t)D * D);
            wo = wtmp;
        }
        if (p->status) return;
        be->ops->gemm(be, 0, 1, M, D, Dh, 1.0f, z, D, Dh, wo, D, Dh, 0.0f, ho, N * D, D, N);
        dcs_pass_release(p, wtmp);
        if (dcs_pass_hook(p, DCS_HP_HEAD_OUT, l, ho)) {
            /* out = sum_n head_out[:, n] + bo: batched over m as [1, N] x [N, D] */
            float *ones = dcs_pass_alloc(p, N, 1, 1);
            float *one_host = malloc(sizeof(float) * (size_t)N);
            if (!p->status && !one_host) p->status = dcs_seterr(&m->err, DCS_ERR_NOMEM, "out of memory");
            if (p->status) {
                free(one_host);
                return;
            }
            for (int n = 0; n < N; n++) one_host[n] = 1.0f;
            be->ops->upload(be, ones, one_host, sizeof(float) * (size_t)N);
            free(one_host);
            be->ops->gemm(be, 0, 0, 1, D, N, 1.0f, ones, N, 0, ho, D, (long long)N * D, 0.0f, out, D, D, M);
            if (lw->bo) be->ops->add_bias(be, out, lw->bo, M, D);
            dcs_pass_release(p, ones);
            from_heads = 1;
        }
        dcs_pass_release(p, ho);
    }
    if (!from_heads) dcs_pass_linear(p, out, z, lw->m_wo, lw->bo, M, D, D);
    dcs_pass_release(p, z);
    dcs_pass_hook(p, DCS_HP_ATTN_OUT, l, out);
}

/* TransformerLens's split q/k/v input (hooks.md): when a hook asks for
 * attn.{q,k,v}_input of layer l (part 0, 1, 2), the residual stream x
 * [M, D] as each head reads it is materialised, [M, N, D], and hooked. A
 * copy the hook wrote is normed and projected per head into that head's
 * rows of dst (q, k or v [M, N, Dh], before q/k norm and rotary), replacing
 * what the shared product gave; a read leaves dst as it is. */
static void split_input(dcs_pass *p, int l, int part, const float *x, float *dst) {
    const dcs_config *c = &p->m->cfg;
    const dcs_layer_weights *lw = &p->m->layers[l];
    dcs_backend *be = p->be;
    const int M = p->M, D = c->d_model, N = c->n_head, Dh = c->head_dim, point = dcs_split_points[part];
    if (!dcs_pass_wants(p, point, l)) return;
    float *xin = dcs_pass_alloc(p, M, N, D);
    if (p->status) return;
    for (int n = 0; n < N; n++) be->ops->copy2d(be, xin + (size_t)n * D, (size_t)N * D, x, D, M, D);
    if (dcs_pass_hook(p, point, l, xin)) {
        float *xn = dcs_pass_alloc(p, M, D, 1), *ln = dcs_pass_alloc(p, M, D, 1),
              *y = dcs_pass_alloc(p, M, Dh, 1);
        const size_t es = dcs_dtype_size(lw->m_wqkv.dtype);
        for (int n = 0; n < N && !p->status; n++) {
            const size_t row = (size_t)part * D + (size_t)n * Dh; /* head n's first row of wqkv [3D, D] */
            const dcs_wmat wn = {(const char *)lw->m_wqkv.p + row * D * es, lw->m_wqkv.dtype};
            be->ops->copy2d(be, xn, D, xin + (size_t)n * D, (size_t)N * D, M, D);
            dcs_pass_norm(p, p->m->plan[l].norm, ln, xn, lw->attn_norm_w, lw->attn_norm_b, M);
            dcs_pass_linear(p, y, ln, wn, lw->bqkv ? lw->bqkv + row : NULL, M, Dh, D);
            be->ops->copy2d(be, dst + (size_t)n * Dh, D, y, Dh, M, Dh);
        }
        dcs_pass_release(p, xn);
        dcs_pass_release(p, ln);
        dcs_pass_release(p, y);
    }
    dcs_pass_release(p, xin);
}

/* The residual stream x [M, D] as one more reader of it sees it (hooks.md's
 * split inputs attn.dyn_input, mlp_input): when the point is asked, its hook
 * on a copy; the copy if the hook wrote it (the caller norms that one for
 * its reader and releases it), else x. */
static const float *split_copy(dcs_pass *p, int l, int point, const float *x) {
    if (!dcs_pass_wants(p, point, l)) return x;
    const size_t n = (size_t)p->M * p->m->cfg.d_model;
    float *copy = dcs_pass_alloc(p, (int64_t)n, 1, 1);
    if (p->status) return x;
    p->be->ops->copy(p->be, copy, x, n * sizeof(float));
    if (dcs_pass_hook(p, point, l, copy)) return copy;
    dcs_pass_release(p, copy);
    return x;
}

/* q, k, v [M, D] of layer l from h [M, D] (the normed x) through qkv [M,
 * 3D] (scratch, released): the product, its bias, the split inputs' hooks, q/k norms
 * and rotary. Without a split input asked or q/k norms, the bias, the split
 * and the rotation in one pass (ops->qkv_split, the same bits). */
static void project_qkv(dcs_pass *p, int l, const float *x, const float *h, float *qkv, float *q, float *k,
                        float *v) {
    const dcs_config *c = &p->m->cfg;
    const dcs_layer_plan *pl = &p->m->plan[l];
    const dcs_layer_weights *lw = &p->m->layers[l];
    dcs_kept *kp = p->keep ? &p->keep[l] : NULL;
    dcs_backend *be = p->be;
    const int M = p->M, D = c->d_model, N = c->n_head, Dh = c->head_dim;
    int fuse = be->ops->qkv_split && !pl->qk_norm;
    for (int part = 0; part < 3; part++) fuse = fuse && !dcs_pass_wants(p, dcs_split_points[part], l);
    dcs_pass_linear(p, qkv, h, lw->m_wqkv, fuse ? NULL : lw->bqkv, M, 3 * D, D);
    if (fuse &&
        !be->ops->qkv_split(be, q, k, v, qkv, lw->bqkv, M, p->T, p->t0, N, Dh, c->rotary_dim, c->rope_base)) {
        dcs_pass_release(p, qkv);
        return;
    }
    if (fuse && lw->bqkv) be->ops->add_bias(be, qkv, lw->bqkv, M, 3 * D); /* no scratch for the split */
    be->ops->copy2d(be, q, D, qkv, 3 * D, M, D);
    be->ops->copy2d(be, k, D, qkv + D, 3 * D, M, D);
    be->ops->copy2d(be, v, D, qkv + 2 * D, 3 * D, M, D);
    dcs_pass_release(p, qkv);
    split_input(p, l, 0, x, q);
    split_input(p, l, 1, x, k);
    split_input(p, l, 2, x, v);
    if (p->status) return;
    if (pl->qk_norm) {
        if (kp) {
            be->ops->copy(be, kp->qraw, q, sizeof(float) * (size_t)M * D);
            be->ops->copy(be, kp->kraw, k, sizeof(float) * (size_t)M * D);
        }
        be->ops->rmsnorm(be, q, M * N, Dh, Dh, lw->q_scale, 1e-6f);
        be->ops->rmsnorm(be, k, M * N, Dh, Dh, lw->k_scale, 1e-6f);
    }
    be->ops->rotary(be, q, M, p->T, p->t0, N, Dh, c->rotary_dim, c->rope_base);
    be->ops->rotary(be, k, M, p->T, p->t0, N, Dh, c->rotary_dim, c->rope_base);
}

/* Attention of layer l on h [M, D], the normed x; result in out [M, D]. */
static void attention(dcs_pass *p, int l, const float *x, const float *h, float *out) {
    dcs_model *m = p->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_plan *pl = &m->plan[l];
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_kept *kp = p->keep ? &p->keep[l] : NULL;
    dcs_kv_cache *kc = p->cache ? &p->cache[l] : NULL;
    dcs_backend *be = p->be;
    const int M = p->M, D = c->d_model, N = c->n_head, Dh = c->head_dim;

    /* q [B, T, N, Dh]; the new k, v: the cache's next slots, or this pass's */
    float *qkv = dcs_pass_alloc(p, M, 3, D);
    float *q = act(p, kp ? kp->q : NULL, M, D, 1);
    float *k = kc ? kc->k + (size_t)kc->used * D : act(p, kp ? kp->k : NULL, M, D, 1);
    float *v = kc ? kc->v + (size_t)kc->used * D : act(p, kp ? kp->v : NULL, M, D, 1);
    if (p->status) return;
    project_qkv(p, l, x, h, qkv, q, k, v);
    if (p->status) return;
    dcs_pass_hook(p, DCS_HP_Q, l, q);
    dcs_pass_hook(p, DCS_HP_K, l, k);
    dcs_pass_hook(p, DCS_HP_V, l, v);

    dcs_dyn_weights dw;
    memset(&dw, 0, sizeof dw);
    if (pl->dcmha) { /* the dynamic-weight MLP reads h, or its own split input */
        const float *xd = split_copy(p, l, DCS_HP_DYN_INPUT, x);
        float *hd = xd != x ? dcs_pass_alloc(p, M, D, 1) : NULL;
        if (hd) dcs_pass_norm(p, pl->norm, hd, xd, lw->attn_norm_w, lw->attn_norm_b, M);
        if (!p->status) dynamic_weights(p, l, hd ? hd : h, &dw);
        dcs_pass_release(p, (float *)(uintptr_t)(xd != x ? xd : NULL));
        dcs_pass_release(p, hd);
    }
    if (p->status) return;
    dcs_keys_view kv = {k, v, p->T, 0, pl->window};
    if (kc) { /* the new keys are held from here on (undone on failure by the decoder) */
        kc->used += p->T;
        kv.k = kc->k;
        kv.v = kc->v;
        kv.S = kc->used;
        kv.kb = kc->first;
    }
    float *z = act(p, kp ? kp->z : NULL, M, D, 1);
    if (p->status) return;
    dcs_attention(p, l, &dw, q, &kv, z);
    release_dyn(p, &dw);
    dcs_pass_release(p, q);
    dcs_pass_release(p, k);
    dcs_pass_release(p, v);
    if (p->status) return;
    if (pl->moh) moh_gate(p, l, h, z);
    if (p->status) return;
    attention_out(p, l, z, out);
}

/* ---------------------------------------------------------------- MLP, block */

/* The group gate of DCFormer++'s MLP (mgate) on hn [M, D]: g [M, E] =
 * softmax(hn mg^T) per row, through its hook, then u [M, E, F/E] *= g. */
static void mlp_group_gate(dcs_pass *p, int l, const float *hn, float *u) {
    const dcs_config *c = &p->m->cfg;
    const dcs_layer_weights *lw = &p->m->layers[l];
    const int M = p->M, D = c->d_model, E = p->m->plan[l].mlp_gate;
    dcs_kept *kp = p->keep ? &p->keep[l] : NULL;
    float *g = act(p, kp ? kp->gate : NULL, M, E, 1);
    if (p->status) return;
    dcs_pass_linear(p, g, hn, (dcs_wmat){lw->mg, DCS_F32}, NULL, M, E, D);
    /* a plain row softmax: M rows of one query at position E - 1 over keys
     * 0 .. E-1, all allowed */
    p->be->ops->softmax_masked(p->be, g, M, 1, E, E - 1, 0, 0);
    dcs_pass_hook(p, DCS_HP_MLP_GATE, l, g);
    p->be->ops->head_gate(p->be, u, g, M, E, c->d_ff / E);
    dcs_pass_release(p, g);
}

/* MLP of layer l on hn [M, D] (normed); result in out [M, D].
 *   GELU:   u = w1 hn + b1 (mlp.pre), ug = gelu(u) (mlp.post)
 *   SwiGLU: u = w1 hn (mlp.pre), u3 = w3 hn (mlp.pre_linear),
 *           ug = silu(u) * u3 [* group gate] (mlp.post)
 * then out = w2 ug + b2 (mlp.out). */
static void mlp(dcs_pass *p, int l, const float *hn, float *out) {
    const dcs_config *c = &p->m->cfg;
    const dcs_layer_plan *pl = &p->m->plan[l];
    const dcs_layer_weights *lw = &p->m->layers[l];
    dcs_kept *kp = p->keep ? &p->keep[l] : NULL;
    const int M = p->M, D = c->d_model, F = c->d_ff;
    float *u = act(p, kp ? kp->u : NULL, M, F, 1);
    if (p->status) return;
    /* GELU with no hook on mlp.pre: bias and activation in one pass (the
     * same arithmetic as add_bias then gelu), into the tape's kept ug or in
     * place */
    const int fused =
        pl->mlp != DCS_MLP_SWIGLU && p->be->ops->bias_gelu && !dcs_pass_wants(p, DCS_HP_MLP_PRE, l);
    dcs_pass_linear(p, u, hn, lw->m_w1, fused ? NULL : lw->b1, M, F, D);
    float *ug = u, *u3 = NULL;
    /* the tape's u: gelu'(u) where its backward multiplies by it (no hook reads mlp.pre) */
    const int keep_d = fused && kp && p->be->ops->bias_gelu_keep && p->be->ops->gelu_bw_sum;
    if (kp) kp->u_dgelu = keep_d;
    if (keep_d) {
        ug = kp->ug;
        p->be->ops->bias_gelu_keep(p->be, ug, u, lw->b1, M, F);
    } else if (fused) {
        ug = kp ? kp->ug : u;
        p->be->ops->bias_gelu(p->be, ug, u, lw->b1, M, F);
    } else {
        dcs_pass_hook(p, DCS_HP_MLP_PRE, l, u);
        if (pl->mlp == DCS_MLP_SWIGLU) {
            u3 = act(p, kp ? kp->u3 : NULL, M, F, 1);
            if (p->status) return;
            dcs_pass_linear(p, u3, hn, lw->m_w3, NULL, M, F, D);
            dcs_pass_hook(p, DCS_HP_MLP_PRE_LINEAR, l, u3);
        }
        if (kp) {
            ug = kp->ug;
            p->be->ops->copy(p->be, ug, u, sizeof(float) * (size_t)M * F);
        }
        switch (pl->mlp) {
        case DCS_MLP_SWIGLU:
            p->be->ops->swiglu(p->be, ug, u3, (size_t)M * F);
            dcs_pass_release(p, u3);
            if (pl->mlp_gate > 0) mlp_group_gate(p, l, hn, ug);
            break;
        default: p->be->ops->gelu(p->be, ug, (size_t)M * F);
        }
    }
    dcs_pass_hook(p, DCS_HP_MLP_POST, l, ug);
    dcs_pass_linear(p, out, ug, lw->m_w2, lw->b2, M, D, F);
    dcs_pass_release(p, u);
    dcs_pass_hook(p, DCS_HP_MLP_OUT, l, out);
}

/* h2 [M, D] = the MLP's norm of x (x + attn.out when sequential), through
 * the split input mlp_input when a hook asks for it. */
static void mlp_norm(dcs_pass *p, int l, float *h2, const float *x) {
    const dcs_layer_weights *lw = &p->m->layers[l];
    const float *xm = split_copy(p, l, DCS_HP_MLP_INPUT, x);
    dcs_pass_norm(p, p->m->plan[l].norm, h2, xm, lw->ffn_norm_w, lw->ffn_norm_b, p->M);
    if (xm != x) dcs_pass_release(p, (float *)(uintptr_t)xm);
}

void dcs_layer(dcs_pass *p, int l, float *x) {
    const dcs_config *c = &p->m->cfg;
    const dcs_layer_plan *pl = &p->m->plan[l];
    const dcs_layer_weights *lw = &p->m->layers[l];
    dcs_kept *kp = p->keep ? &p->keep[l] : NULL;
    dcs_backend *be = p->be;
    const int M = p->M, D = c->d_model;
    const size_t bytes = sizeof(float) * (size_t)M * D;
    dcs_pass_hook(p, DCS_HP_RESID_PRE, l, x);
    if (kp) be->ops->copy(be, kp->x, x, bytes);
    float *h = act(p, kp ? kp->ln1 : NULL, M, D, 1), *a = act(p, kp ? kp->ao : NULL, M, D, 1);
    float *o = act(p, kp ? kp->mo : NULL, M, D, 1), *h2 = kp ? kp->ln2 : h;
    if (p->status) return;
    /* a parallel residual's two norms of x at once when the tape keeps ln2
     * apart from ln1 and nothing reads mlp_input (x does not change before the MLP) */
    const int norms2 = pl->parallel_residual && h2 != h && pl->norm != DCS_NORM_RMS && be->ops->layernorm2 &&
                       !dcs_pass_wants(p, DCS_HP_MLP_INPUT, l);
    if (kp) kp->lnst_set = norms2 && kp->lnst;
    if (norms2)
        be->ops->layernorm2(be, h, h2, kp->lnst, x, lw->attn_norm_w, lw->attn_norm_b, lw->ffn_norm_w,
                            lw->ffn_norm_b, M, D, c->norm_eps);
    else
        dcs_pass_norm(p, pl->norm, h, x, lw->attn_norm_w, lw->attn_norm_b, M);
    dcs_pass_hook(p, DCS_HP_LN_ATTN, l, h);
    attention(p, l, x, h, a);
    if (p->status || dcs_pass_cancelled(p)) return;
    if (pl->parallel_residual) {
        /* out = x + attn(ln1(x)) + mlp(ln2(x)) */
        if (!norms2) mlp_norm(p, l, h2, x);
        dcs_pass_hook(p, DCS_HP_LN_MLP, l, h2);
        mlp(p, l, h2, o);
        if (be->ops->add2)
            be->ops->add2(be, x, a, o, (size_t)M * D);
        else {
            be->ops->add(be, x, a, (size_t)M * D);
            be->ops->add(be, x, o, (size_t)M * D);
        }
    } else {
        /* h = x + attn(ln1(x)); out = h + mlp(ln2(h)) */
        be->ops->add(be, x, a, (size_t)M * D);
        if (kp) be->ops->copy(be, kp->h, x, bytes);
        mlp_norm(p, l, h2, x);
        dcs_pass_hook(p, DCS_HP_LN_MLP, l, h2);
        mlp(p, l, h2, o);
        be->ops->add(be, x, o, (size_t)M * D);
    }
    dcs_pass_release(p, h);
    dcs_pass_release(p, a);
    dcs_pass_release(p, o);
    dcs_pass_hook(p, DCS_HP_RESID_POST, l, x);
}

void dcs_pass_layers(dcs_pass *p, float *x) {
    for (int l = 0; l < p->m->cfg.n_layer && !p->status; l++) {
        if (dcs_pass_cancelled(p)) break;
        dcs_layer(p, l, x);
        if (!p->status) p->status = p->be->ops->sync(p->be, &p->m->err);
    }
}

void dcs_pass_final(dcs_pass *p, const float *x, float *hn, float *lg) {
    dcs_model *m = p->m;
    const dcs_config *c = &m->cfg;
    if (p->status) return;
    dcs_pass_norm(p, m->plan[c->n_layer - 1].norm, hn, x, m->norm_w, m->norm_b, p->M); /* the blocks' kind */
    dcs_pass_hook(p, DCS_HP_LN_FINAL, 0, hn);
    if (!lg) return;
    dcs_pass_linear(p, lg, hn, m->m_out_w, NULL, p->M, c->vocab, c->d_model);
    dcs_pass_hook(p, DCS_HP_LOGITS, 0, lg);
}
