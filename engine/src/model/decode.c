/*
 * decode.c -- incremental decoding: feed tokens a chunk at a time, keeping
 * per layer the keys/values (K/V cache) and the key-side composition
 * weights kw1, kw2, kdd of both phases (KW cache) of the tokens fed so far.
 * A step is the one layer (layer.c) with n new query positions at t0 =
 * the tokens fed before, against the cache: the same kernels (fused
 * attention, or the materialised maps when a map is hooked) as the
 * prefill, which is a step on an empty cache.
 *
 * Shapes: n new tokens at positions t0 .. t0+n-1, P = t0 + n positions in
 * all; per layer the cache holds `used` consecutive positions starting at
 * `first` (first = 0 on a global layer; a local layer keeps the last
 * window + 1). D model dim, N heads, R dynamic rank. Backend memory:
 *   K/V cache [cap, D], KW cache kw1, kw2 [cap, R, N], kdd [cap, N] per phase
 * Hooks on attention maps see [N, n, P] (keys at absolute positions; keys
 * no longer held read 0).
 */
#include "pass.h"

#include <stdlib.h>
#include <string.h>

struct dcs_decoder {
    dcs_model *m;
    int pos;
    dcs_kv_cache *layers;
};

/* ---------------------------------------------------------------- cache */

static void layer_free(dcs_backend *be, dcs_kv_cache *L) {
    if (L->k) be->ops->free(be, L->k);
    if (L->v) be->ops->free(be, L->v);
    for (int ph = 0; ph < 2; ph++) {
        if (L->kw1[ph]) be->ops->free(be, L->kw1[ph]);
        if (L->kw2[ph]) be->ops->free(be, L->kw2[ph]);
        if (L->kdd[ph]) be->ops->free(be, L->kdd[ph]);
    }
    memset(L, 0, sizeof *L);
}

/* Is there a key side to cache (DCMHA that is not query_wise)? */
static int has_key_side(const dcs_config *c) { return c->use_dcmha && !c->query_wise; }

/* Room for `need` positions in layer L (grows by doubling, copies what is held). */
static dcs_status layer_reserve(dcs_decoder *d, dcs_kv_cache *L, int need) {
    dcs_model *m = d->m;
    dcs_backend *be = m->be;
    const dcs_config *c = &m->cfg;
    if (need <= L->cap) return DCS_OK;
    int cap = L->cap ? L->cap : 16;
    while (cap < need) cap *= 2;
    const size_t D = (size_t)c->d_model, RN = (size_t)c->dyn_rank * c->n_head, N = (size_t)c->n_head;
    dcs_kv_cache nl = *L;
    nl.cap = cap;
    nl.k = be->ops->alloc(be, (size_t)cap * D * sizeof(float));
    nl.v = be->ops->alloc(be, (size_t)cap * D * sizeof(float));
    int ok = nl.k && nl.v;
    const int key_side = has_key_side(c);
    for (int ph = 0; ph < 2; ph++) {
        nl.kw1[ph] = nl.kw2[ph] = nl.kdd[ph] = NULL;
        if (!key_side) continue;
        nl.kw1[ph] = be->ops->alloc(be, (size_t)cap * RN * sizeof(float));
        nl.kw2[ph] = be->ops->alloc(be, (size_t)cap * RN * sizeof(float));
        nl.kdd[ph] = be->ops->alloc(be, (size_t)cap * N * sizeof(float));
        ok = ok && nl.kw1[ph] && nl.kw2[ph] && nl.kdd[ph];
    }
    if (!ok) {
        layer_free(be, &nl);
        dcs_err ignored;
        be->ops->sync(be, &ignored);
        return dcs_seterr(&m->err, DCS_ERR_NOMEM, "decode: out of memory for a cache of %d positions", cap);
    }
    if (L->used) {
        be->ops->copy(be, nl.k, L->k, (size_t)L->used * D * sizeof(float));
        be->ops->copy(be, nl.v, L->v, (size_t)L->used * D * sizeof(float));
        for (int ph = 0; ph < 2 && key_side; ph++) {
            be->ops->copy(be, nl.kw1[ph], L->kw1[ph], (size_t)L->used * RN * sizeof(float));
            be->ops->copy(be, nl.kw2[ph], L->kw2[ph], (size_t)L->used * RN * sizeof(float));
            be->ops->copy(be, nl.kdd[ph], L->kdd[ph], (size_t)L->used * N * sizeof(float));
        }
    }
    layer_free(be, L);
    *L = nl;
    return DCS_OK;
}

/* Move `rows` rows of `width` floats from row `drop` to row 0 (backend
 * copies may not overlap: through tmp, at least rows * width floats). */
static void shift_rows(dcs_backend *be, float *x, size_t drop, size_t rows, size_t width, float *tmp) {
    be->ops->copy(be, tmp, x + drop * width, rows * width * sizeof(float));
    be->ops->copy(be, x, tmp, rows * width * sizeof(float));
}

/* A local layer keeps only the last `keep` positions: shift them to slot 0. */
static void layer_trim(dcs_decoder *d, dcs_kv_cache *L, int keep, float *tmp) {
    if (L->used <= keep) return;
    dcs_backend *be = d->m->be;
    const dcs_config *c = &d->m->cfg;
    const size_t D = (size_t)c->d_model, RN = (size_t)c->dyn_rank * c->n_head, N = (size_t)c->n_head;
    const size_t drop = (size_t)(L->used - keep);
    shift_rows(be, L->k, drop, (size_t)keep, D, tmp);
    shift_rows(be, L->v, drop, (size_t)keep, D, tmp);
    for (int ph = 0; ph < 2; ph++) {
        if (!L->kw1[ph]) continue;
        shift_rows(be, L->kw1[ph], drop, (size_t)keep, RN, tmp);
        shift_rows(be, L->kw2[ph], drop, (size_t)keep, RN, tmp);
        shift_rows(be, L->kdd[ph], drop, (size_t)keep, N, tmp);
    }
    L->first += (int)drop;
    L->used = keep;
}

/* ---------------------------------------------------------------- API */

dcs_status dcs_decoder_new(dcs_model *m, dcs_decoder **out) {
    if (!out) return m ? dcs_seterr(&m->err, DCS_ERR_ARG, "decoder: out is NULL") : DCS_ERR_ARG;
    *out = NULL;
    if (!m) return DCS_ERR_ARG;
    m->err.code = DCS_OK;
    m->err.msg[0] = 0;
    /* Every variant of model-spec.md 5 decodes through the one layer
     * (layer.c): its compose and MoH gate run on the new rows against the
     * cached keys (tests/passes/test_decode.py checks each against full passes). */
    dcs_decoder *d = calloc(1, sizeof *d);
    if (d) d->layers = calloc((size_t)m->cfg.n_layer, sizeof *d->layers);
    if (!d || !d->layers) {
        free(d);
        return dcs_seterr(&m->err, DCS_ERR_NOMEM, "decoder: out of memory");
    }
    d->m = m;
    m->n_decoders++;
    *out = d;
    return DCS_OK;
}

void dcs_decoder_free(dcs_decoder *d) {
    if (!d) return;
    dcs_model *m = d->m;
    for (int l = 0; l < m->cfg.n_layer; l++) layer_free(m->be, &d->layers[l]);
    free(d->layers);
    free(d);
    if (--m->n_decoders == 0 && m->n_tapes == 0 && m->freed) dcs_model_destroy(m);
}

int dcs_decoder_pos(const dcs_decoder *d) { return d ? d->pos : 0; }

int dcs_decoder_layer_keys(const dcs_decoder *d, int layer) {
    if (!d || layer < 0 || layer >= d->m->cfg.n_layer) return -1;
    return d->layers[layer].used;
}

dcs_status dcs_decoder_step(dcs_decoder *d, const int32_t *tokens, int n, float *logits,
                            const dcs_hooks *hooks) {
    if (!d) return DCS_ERR_ARG;
    dcs_model *m = d->m;
    const dcs_config *c = &m->cfg;
    m->err.code = DCS_OK;
    m->err.msg[0] = 0;
    if (!tokens) return dcs_seterr(&m->err, DCS_ERR_ARG, "decode: tokens is NULL");
    if (n <= 0) return dcs_seterr(&m->err, DCS_ERR_ARG, "decode: need n >= 1 tokens (got %d)", n);
    if ((int64_t)d->pos + n > (1 << 24))
        return dcs_seterr(&m->err, DCS_ERR_ARG, "decode: %lld positions is more than a decoder takes (16M)",
                          (long long)d->pos + n);
    if ((uint64_t)c->n_head * (uint64_t)n * (uint64_t)(d->pos + n) > ((uint64_t)1 << 31))
        return dcs_seterr(&m->err, DCS_ERR_NOMEM,
                          "decode: an attention map of %d heads x %d new x %d positions is too large; feed "
                          "fewer tokens per step",
                          c->n_head, n, d->pos + n);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab)
            return dcs_seterr(&m->err, DCS_ERR_ARG, "decode: token id %d at [%d] is out of range [0, %d)",
                              tokens[i], i, c->vocab);
    dcs_status st;
    /* room first, so that a failure leaves the held positions as they were */
    for (int l = 0; l < c->n_layer; l++)
        if ((st = layer_reserve(d, &d->layers[l], d->layers[l].used + n))) return st;
    int used0[1024];
    int first0[1024];
    for (int l = 0; l < c->n_layer; l++) {
        used0[l] = d->layers[l].used;
        first0[l] = d->layers[l].first;
    }

    dcs_pass s;
    dcs_pass_init(&s, m, hooks, 1, n, d->pos, "decode", "decoding step");
    s.cache = d->layers;
    dcs_backend *be = s.be;
    const int D = c->d_model, V = c->vocab;
    float *x = dcs_pass_alloc(&s, n, D, 1);
    dcs_pass_embed(&s, tokens, x);
    dcs_pass_layers(&s, x);
    if (!s.status &&
        (logits || dcs_pass_wants(&s, DCS_HP_LN_FINAL, 0) || dcs_pass_wants(&s, DCS_HP_LOGITS, 0))) {
        float *hn = dcs_pass_alloc(&s, n, D, 1), *lg = dcs_pass_alloc(&s, n, V, 1);
        dcs_pass_final(&s, x, hn, lg);
        if (!s.status && logits) be->ops->download(be, logits, lg, sizeof(float) * (size_t)n * V);
    }
    if (!s.status) s.status = be->ops->sync(be, &m->err);
    if (!s.status) {
        /* local layers keep only their window: the last window + 1 positions */
        const size_t RN = (size_t)c->dyn_rank * c->n_head,
                     W = (size_t)c->d_model > RN ? (size_t)c->d_model : RN;
        float *tmp = NULL;
        int trimmed = 0;
        for (int l = 0; l < c->n_layer && !s.status; l++) {
            if (!dcs_layer_is_local(m, l)) continue;
            if (!tmp) tmp = dcs_pass_alloc(&s, c->window_size + 1, (int64_t)W, 1);
            if (tmp) layer_trim(d, &d->layers[l], c->window_size + 1, tmp);
            trimmed = 1;
        }
        if (trimmed && !s.status) s.status = be->ops->sync(be, &m->err);
    }
    if (s.status) {
        for (int l = 0; l < c->n_layer; l++) /* forget this step's keys */
            if (d->layers[l].first == first0[l]) d->layers[l].used = used0[l];
    } else {
        d->pos += n;
    }
    dcs_pass_end(&s);
    return s.status;
}
