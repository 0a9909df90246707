/*
 * attention.c -- one layer's attention from q, k, v and the dynamic weights
 * to z [M, N, Dh] (model-spec 2 steps 5-10), over the backend interface, by
 * one of three paths (dcs_attention picks it):
 *   fused         the backend's kernel, no [B, N, T, S] tensor (the tape's
 *                 kept maps only);
 *   materialising the maps with their hooks: scores, compose (pre), masked
 *                 softmax, compose (post), P v; on a backend with a fused
 *                 kernel, its products on the fused kernel's own query
 *                 blocks, so that the two paths give the same bits;
 *   by chunks     the materialising path's kernels one block of query rows
 *                 at a time, where no map is hooked or kept.
 * Shapes as in layer.c: q, z [B, T, N, Dh], k, v [B, S, N, Dh] (row stride
 * D), maps [B, N, T, S], dynamic weights [B, T|S, R, N] and [B, T|S, N].
 */
#include "pass.h"

#include <math.h>
#include <string.h>

/* The compose arguments of layer l's phase over this pass's whole
 * [B, N, T, S] maps (no branch outputs). */
static dcs_compose_args compose_args(const dcs_pass *p, int l, int phase, float *out, const float *in,
                                     const dcs_dyn_weights *dw, const dcs_keys_view *kv) {
    const dcs_config *c = &p->m->cfg;
    const dcs_layer_plan *pl = &p->m->plan[l];
    dcs_compose_args a;
    memset(&a, 0, sizeof a);
    a.out = out;
    a.in = in;
    a.qw1 = dw->w1[phase][0];
    a.qw2 = dw->w2[phase][0];
    a.qdd = dw->dd[phase][0];
    a.kw1 = dw->w1[phase][1];
    a.kw2 = dw->w2[phase][1];
    a.kdd = dw->dd[phase][1];
    a.B = p->B;
    a.N = c->n_head;
    a.T = p->T;
    a.S = kv->S;
    a.R = c->dyn_rank;
    a.G = pl->groups;
    a.sw = pl->static_branch ? (phase == 0 ? p->m->layers[l].pre_sw : p->m->layers[l].post_sw) : NULL;
    a.causal_only = phase == 1;
    a.window = kv->window;
    a.t0 = p->t0;
    a.kb = kv->kb;
    return a;
}

/* out = Compose(in) [B, N, T, S] (pre: all pairs; post: allowed pairs only),
 * with the branch hooks of this phase: if any is wanted, all branches of the
 * model (five, or three when query_wise or key_wise, plus static with
 * use_sw) are materialised so that a rewritten branch enters the sum. */
static void compose(dcs_pass *p, int l, int phase, float *out, const float *in, const dcs_dyn_weights *dw,
                    const dcs_keys_view *kv) {
    const dcs_config *c = &p->m->cfg;
    const int B = p->B, T = p->T, N = c->n_head, S = kv->S;
    const int *points = dcs_branch_points[phase];
    const int nb = DCS_N_BRANCHES; /* skip, qp, kp, qg, kg, static: consecutive points */
    int any = 0;
    for (int k = 0; k < nb; k++) any |= dcs_pass_wants(p, points[k], l);
    dcs_compose_args a = compose_args(p, l, phase, out, in, dw, kv);
    if (any)
        for (int k = 0; k < nb; k++)
            if (dcs_hook_exists(p->m, points[k])) a.br[k] = dcs_pass_alloc(p, B, N, (int64_t)T * S);
    if (p->status) return;
    p->be->ops->compose(p->be, &a);
    if (!any) return;
    int modified = 0;
    for (int k = 0; k < nb; k++)
        if (a.br[k]) modified |= dcs_pass_hook_map(p, points[k], l, a.br[k], S, kv->kb);
    if (modified) {
        size_t n = (size_t)B * N * T * S;
        p->be->ops->copy(p->be, out, a.br[0], n * sizeof(float));
        for (int k = 1; k < nb; k++)
            if (a.br[k]) p->be->ops->add(p->be, out, a.br[k], n);
    }
    for (int k = 0; k < nb; k++) dcs_pass_release(p, a.br[k]);
}

/* Is any hook on this layer's [N, T, S] maps asked for? Then the layer
 * runs the full (materialising) path. */
static int attn_map_hooked(const dcs_pass *p, int l) {
    for (int pt = 0; pt < DCS_HP_COUNT; pt++)
        if (dcs_hook_point_map(pt) && dcs_pass_wants(p, pt, l)) return 1;
    return 0;
}

/* The fused kernel's arguments for this pass's queries q and keys kv, z
 * the output (no composition, no kept maps). */
static dcs_attn_args attn_args(const dcs_pass *p, const float *q, const dcs_keys_view *kv, float *z) {
    const dcs_config *c = &p->m->cfg;
    dcs_attn_args a;
    memset(&a, 0, sizeof a);
    a.z = z;
    a.q = q;
    a.k = kv->k;
    a.v = kv->v;
    a.B = p->B;
    a.T = p->T;
    a.S = kv->S;
    a.t0 = p->t0;
    a.kb = kv->kb;
    a.N = c->n_head;
    a.Dh = c->head_dim;
    a.ld = c->d_model;
    a.R = c->dyn_rank;
    a.window = kv->window;
    a.scale = 1.0f / sqrtf((float)c->head_dim);
    return a;
}

/* z [M, N, Dh] (fused: no [B, N, T, S] tensor but the tape's kept maps,
 * kp; local layers touch their window only). */
static void attention_fused(dcs_pass *p, int l, const dcs_dyn_weights *dw, const float *q,
                            const dcs_keys_view *kv, float *z, dcs_kept *kp) {
    const dcs_layer_plan *pl = &p->m->plan[l];
    dcs_attn_args a = attn_args(p, q, kv, z);
    a.compose = pl->dcmha;
    if (kp) {
        a.keep[0] = kp->A;
        a.keep[1] = kp->P;
        a.keep[2] = pl->dcmha ? kp->Pc : NULL;
    }
    for (int ph = 0; ph < 2 && a.compose; ph++) {
        a.qw1[ph] = dw->w1[ph][0];
        a.qw2[ph] = dw->w2[ph][0];
        a.qdd[ph] = dw->dd[ph][0];
        a.kw1[ph] = dw->w1[ph][1];
        a.kw2[ph] = dw->w2[ph][1];
        a.kdd[ph] = dw->dd[ph][1];
    }
    p->be->ops->attention(p->be, &a);
}

/* z [M, N, Dh] through the materialised maps, with their hooks (and the
 * scores, pattern and composed pattern kept for the tape). */
static void attention_maps(dcs_pass *p, int l, const dcs_dyn_weights *dw, const float *q,
                           const dcs_keys_view *kv, float *z) {
    const dcs_config *c = &p->m->cfg;
    const int dcmha = p->m->plan[l].dcmha;
    dcs_kept *kp = p->keep ? &p->keep[l] : NULL;
    dcs_backend *be = p->be;
    const int B = p->B, T = p->T, S = kv->S, kb = kv->kb, N = c->n_head, Dh = c->head_dim, D = c->d_model;
    const long long TS = (long long)T * S;
    const size_t map = (size_t)B * N * TS;

    /* scores A[b, n] [T, S] = q_n k_n^T / sqrt(Dh) */
    float *A = kp ? kp->A : dcs_pass_alloc(p, B, N, TS);
    if (p->status) return;
    /* the products: where the backend has a fused kernel, on its query
     * blocks (the same calls, so the same bits as a fused layer) */
    const dcs_attn_args blocks = attn_args(p, q, kv, z);
    if (be->ops->attention_scores)
        be->ops->attention_scores(be, &blocks, A);
    else
        dcs_heads_map(be, p->m->act_dtype, B, N, T, S, Dh, D, 1.0f / sqrtf((float)Dh), q, kv->k, A);
    dcs_pass_hook_map(p, DCS_HP_SCORES, l, A, S, kb);
    /* kept: each stage in its own buffer; else in place */
    float *cur = A;
    if (dcmha) {
        float *Ac = kp ? dcs_pass_alloc(p, B, N, TS) : A;
        if (p->status) return;
        compose(p, l, 0, Ac, A, dw, kv);
        dcs_pass_hook_map(p, DCS_HP_SCORES_COMPOSED, l, Ac, S, kb);
        cur = Ac;
    }
    float *P = kp ? kp->P : cur;
    if (P != cur) be->ops->copy(be, P, cur, map * sizeof(float));
    if (cur != A) dcs_pass_release(p, cur);
    be->ops->softmax_masked(be, P, B * N, T, S, p->t0, kb, kv->window);
    dcs_pass_hook_map(p, DCS_HP_PATTERN, l, P, S, kb);
    float *Pc = P;
    if (dcmha) {
        Pc = kp ? kp->Pc : P;
        compose(p, l, 1, Pc, P, dw, kv);
        dcs_pass_hook_map(p, DCS_HP_PATTERN_COMPOSED, l, Pc, S, kb);
    }
    if (p->status) return;
    /* z[b, :, n] [T, Dh] = P[b, n] [T, S] @ v[b, :, n] [S, Dh] */
    if (be->ops->attention_pv)
        be->ops->attention_pv(be, &blocks, Pc);
    else
        dcs_heads_rows(be, p->m->act_dtype, 0, B, N, T, S, Dh, D, 1.0f, Pc, kv->v, z);
    dcs_pass_release(p, A);
}

/* ---------------------------------------------------------------- attention by query chunks
 * The full path's steps (scores, pre-compose, masked softmax, post-compose,
 * P v) on the backend's own kernels, one sequence and one block of tc query
 * rows at a time, on the keys those rows can see only: the [N, tc, L] map
 * of one chunk is all the memory attention takes, and the causal half the
 * full path computes and throws away is skipped. Each element is the full
 * path's (compose mixes heads at one (query, key) pair; softmax and P v run
 * over every allowed key of a row), so the results agree to float32
 * rounding. For a backend with no fused kernel (CUDA) and for the variants
 * the fused kernel does not compute; never with a kept or hooked map. */

/* Query rows per chunk for layer l with keys kv; 0: not chunked.
 * Model.attention_rows (dcs_model_set_attention_rows): < 0 never, > 0 that
 * many rows, 0 (auto) where the fused kernel does not apply and the whole
 * [B, N, T, S] map is over DCS_ATTN_CHUNK_BYTES, as many rows as fit it, at
 * most DCS_ATTN_CHUNK_ROWS (each row of a chunk computes the keys up to the
 * chunk's last row: half a chunk of masked pairs per row on average). */
static int chunk_rows(const dcs_pass *p, int l, const dcs_keys_view *kv) {
    const dcs_model *m = p->m;
    const int rows = m->attn_rows, T = p->T;
    if (rows < 0) return 0;
    if (rows > 0) return rows < T ? rows : T;
    if (p->be->ops->attention && m->plan[l].fused) return 0;
    const uint64_t row_bytes = (uint64_t)m->cfg.n_head * (uint64_t)kv->S * sizeof(float);
    if ((uint64_t)p->B * (uint64_t)T * row_bytes <= DCS_ATTN_CHUNK_BYTES) return 0;
    uint64_t tc = DCS_ATTN_CHUNK_BYTES / row_bytes;
    if (tc > DCS_ATTN_CHUNK_ROWS) tc = DCS_ATTN_CHUNK_ROWS; /* a chunk's rows see its last row's keys */
    if (tc >= 16) tc -= tc % 16;
    return tc < 1 ? 1 : tc < (uint64_t)T ? (int)tc : T;
}

/* One chunk's compose of phase ph, in place on map [N, n, L]: query rows
 * from qrow (pass-wide row index) at position pos0, keys from krow (index
 * into the key side) at position kb. */
static void compose_chunk(dcs_pass *p, int l, int ph, float *map, const dcs_dyn_weights *dw,
                          const dcs_keys_view *kv, int n, int L, int pos0, int kb, size_t qrow, size_t krow) {
    const size_t N = (size_t)p->m->cfg.n_head, RN = (size_t)p->m->cfg.dyn_rank * N;
    dcs_compose_args a = compose_args(p, l, ph, map, map, dw, kv);
    a.B = 1;
    a.T = n;
    a.S = L;
    a.t0 = pos0;
    a.kb = kb;
    if (a.qw1) a.qw1 += qrow * RN, a.qw2 += qrow * RN, a.qdd += qrow * N;
    if (a.kw1) a.kw1 += krow * RN, a.kw2 += krow * RN, a.kdd += krow * N;
    p->be->ops->compose(p->be, &a);
}

/* z [M, N, Dh] chunk by chunk of tc query rows (see above). */
static void attention_chunked(dcs_pass *p, int l, const dcs_dyn_weights *dw, const float *q,
                              const dcs_keys_view *kv, float *z, int tc) {
    const dcs_config *c = &p->m->cfg;
    const int dcmha = p->m->plan[l].dcmha, dt = p->m->act_dtype;
    dcs_backend *be = p->be;
    const int B = p->B, T = p->T, S = kv->S, N = c->n_head, Dh = c->head_dim, D = c->d_model, w = kv->window;
    const float scale = 1.0f / sqrtf((float)Dh);
    const int Lmax = w > 0 && tc + w < S ? tc + w : S; /* keys a chunk can see */
    float *map = dcs_pass_alloc(p, N, tc, Lmax);       /* [N, tc, L] */
    if (p->status) return;
    for (int b = 0; b < B; b++)
        for (int r0 = 0; r0 < T; r0 += tc) {
            const int n = T - r0 < tc ? T - r0 : tc, pos0 = p->t0 + r0;
            /* keys [j0, j1]: the window of the first row to the last row's own key */
            int j0 = w > 0 ? pos0 - w - kv->kb : 0, j1 = pos0 + n - 1 - kv->kb;
            if (j0 < 0) j0 = 0;
            if (j1 > S - 1) j1 = S - 1;
            float *zc = z + ((size_t)b * T + r0) * D;
            if (j1 < j0) { /* no key for any row: the full path's softmax gives 0 */
                be->ops->zero(be, zc, sizeof(float) * (size_t)n * D);
                continue;
            }
            const int L = j1 - j0 + 1, kb = kv->kb + j0;
            const size_t qrow = (size_t)b * T + r0, krow = (size_t)b * S + j0;
            dcs_heads_map(be, dt, 1, N, n, L, Dh, D, scale, q + qrow * D, kv->k + krow * D, map);
            if (dcmha) compose_chunk(p, l, 0, map, dw, kv, n, L, pos0, kb, qrow, krow);
            be->ops->softmax_masked(be, map, N, n, L, pos0, kb, w);
            if (dcmha) compose_chunk(p, l, 1, map, dw, kv, n, L, pos0, kb, qrow, krow);
            dcs_heads_rows(be, dt, 0, 1, N, n, L, Dh, D, 1.0f, map, kv->v + krow * D, zc);
        }
    dcs_pass_release(p, map);
}

/* z of layer l: by query chunks where no map is kept or hooked
 * (chunk_rows); the tape (kept maps) takes the fused kernel in a full pass
 * (no cache, t0 = 0), which writes them row block by row block while they
 * are in cache, instead of a pass over [B, N, T, S] per step; else the
 * materialising path. */
void dcs_attention(dcs_pass *p, int l, const dcs_dyn_weights *dw, const float *q, const dcs_keys_view *kv,
                   float *z) {
    const dcs_model *m = p->m;
    dcs_kept *kp = p->keep ? &p->keep[l] : NULL;
    const int maps_free = !attn_map_hooked(p, l), tc = maps_free && !kp ? chunk_rows(p, l, kv) : 0;
    if (tc > 0)
        attention_chunked(p, l, dw, q, kv, z, tc);
    else if (p->be->ops->attention && m->plan[l].fused && m->attn_rows >= 0 && maps_free &&
             (!kp || (!p->cache && p->t0 == 0)))
        attention_fused(p, l, dw, q, kv, z, kp);
    else
        attention_maps(p, l, dw, q, kv, z);
}
