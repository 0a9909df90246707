/*
 * load_model.c -- from a checkpoint directory to a ready dcs_model:
 * config.json -> dcs_config, weight files -> tensor table, every expected
 * tensor checked by name and shape, unknown tensors refused, weights
 * widened to float32 and placed in backend memory (on the CPU, aligned F32
 * tensors are used in place from the mapped file: zero copy).
 *
 * Pythia (gpt_neox) checkpoints are mapped onto the DCPythia names, with
 * the per-head-grouped query_key_value rows reordered to q, k, v blocks.
 */
#include "dcs_model.h"
#include "pass.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CONFIG_BYTES (1u << 20)

typedef struct {
    dcs_model *m;
    dcs_err *e;
} builder;

static void fmt_shape(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, n - o, "[");
    for (int i = 0; i < ndim && o < n; i++)
        o += (size_t)snprintf(buf + o, n - o, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

/* Find `name`, check its shape, mark it used. Missing: NULL, and an error if
 * required. */
static dcs_tensor *take(builder *b, const char *name, int required, int ndim, ...) {
    dcs_tensor *t = dcs_tt_find(&b->m->tt, name);
    if (!t) {
        if (required) dcs_seterr(b->e, DCS_ERR_TENSOR, "%s: missing tensor '%.200s'", b->m->dir, name);
        return NULL;
    }
    int64_t want[DCS_MAX_NDIM];
    va_list ap;
    va_start(ap, ndim);
    for (int i = 0; i < ndim; i++) want[i] = va_arg(ap, int64_t);
    va_end(ap);
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == want[i];
    if (!ok) {
        char got[128], exp[128];
        fmt_shape(got, sizeof got, t->ndim, t->shape);
        fmt_shape(exp, sizeof exp, ndim, want);
        dcs_seterr(b->e, DCS_ERR_TENSOR, "%s: tensor '%.200s' has shape %s, expected %s", t->file, name, got,
                   exp);
        return NULL;
    }
    t->used = 1;
    return t;
}

/* Index of the first NaN/inf of x[0..n), or -1. Branch-free blocks of 64
 * (the loop vectorizes), so scanning costs a small fraction of a load. */
static long long first_nonfinite(const float *x, uint64_t n) {
    const uint32_t *u = (const uint32_t *)(const void *)x;
    uint64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        uint32_t any = 0;
        for (int k = 0; k < 64; k++) any |= (uint32_t)((u[i + k] & 0x7f800000u) == 0x7f800000u);
        if (any) break;
    }
    for (; i < n; i++)
        if ((u[i] & 0x7f800000u) == 0x7f800000u) return (long long)i;
    return -1;
}

/* Refuse a weight holding NaN or inf (they give all-NaN logits). */
static int weight_finite(builder *b, const float *x, uint64_t n, const dcs_tensor *t, const char *name) {
    long long i = first_nonfinite(x, n);
    if (i < 0) return 1;
    dcs_seterr(b->e, DCS_ERR_NONFINITE, "%s: tensor '%.200s' holds %s at element %lld",
               t ? t->file : b->m->dir, t ? t->name : name,
               x[i] != x[i] ? "NaN"
               : x[i] > 0   ? "+inf"
                            : "-inf",
               i);
    return 0;
}

/* Refuse a weight kept in its 16-bit dtype (F16, BF16) that holds NaN or
 * inf, as weight_finite does for float32 ones, with the stored tensor's file,
 * name and element index. Exponent all ones: F16 bits 0x7c00, BF16 0x7f80;
 * a non-zero mantissa below it is NaN. Read bytewise (the mapped data may be
 * at an odd address), little-endian as stored. */
static int half_finite(builder *b, const dcs_tensor *t) {
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
    const uint16_t exp = t->dtype == DCS_F16 ? 0x7c00u : 0x7f80u;
    const uint8_t *d = t->data;
    for (uint64_t i = 0; i < n; i++) {
        uint16_t u = (uint16_t)(d[2 * i] | (d[2 * i + 1] << 8));
        if ((u & exp) != exp) continue;
        const char *what = (u & 0x7fffu & (uint16_t)~exp) ? "NaN" : (u & 0x8000u) ? "-inf" : "+inf";
        dcs_seterr(b->e, DCS_ERR_NONFINITE, "%s: tensor '%.200s' holds %s at element %llu", t->file, t->name,
                   what, (unsigned long long)i);
        return 0;
    }
    return 1;
}

/* Register a weight of `n` floats under its canonical name and place it in
 * backend memory: either aliasing `t` or from host floats `src` (copied). */
static float *add_weight(builder *b, const char *name, int ndim, const int64_t *shape, const dcs_tensor *t,
                         const float *src) {
    dcs_model *m = b->m;
    if (m->n_weights == m->cap_weights) {
        int cap = m->cap_weights ? 2 * m->cap_weights : 64;
        dcs_named_weight *w = realloc(m->weights, sizeof *w * (size_t)cap);
        if (!w) {
            dcs_seterr(b->e, DCS_ERR_NOMEM, "out of memory");
            return NULL;
        }
        m->weights = w;
        m->cap_weights = cap;
    }
    dcs_named_weight *w = &m->weights[m->n_weights];
    memset(w, 0, sizeof *w);
    snprintf(w->name, sizeof w->name, "%s", name);
    w->ndim = ndim;
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        w->shape[i] = shape[i];
        n *= (uint64_t)shape[i];
    }

    if (t && !src && m->device == DCS_DEVICE_CPU && t->dtype == DCS_F32 &&
        ((uintptr_t)t->data % sizeof(float)) == 0) {
        w->ptr = (float *)(uintptr_t)t->data; /* zero copy; never written */
        w->owned = 0;
        if (!weight_finite(b, w->ptr, n, t, name)) return NULL;
    } else {
        float *host = NULL;
        const float *from = src;
        if (!from) {
            if (m->device == DCS_DEVICE_CPU) {
                w->ptr = m->be->ops->alloc(m->be, n * sizeof(float));
                if (!w->ptr) {
                    dcs_seterr(b->e, DCS_ERR_NOMEM, "%s: out of memory for '%s'", t->file, name);
                    return NULL;
                }
                dcs_tensor_to_f32(t, w->ptr);
                w->owned = 1;
                m->n_weights++; /* freed with the model */
                if (!weight_finite(b, w->ptr, n, t, name)) return NULL;
                return w->ptr;
            }
            host = malloc(n * sizeof(float));
            if (!host) {
                dcs_seterr(b->e, DCS_ERR_NOMEM, "%s: out of memory for '%s'", t->file, name);
                return NULL;
            }
            dcs_tensor_to_f32(t, host);
            from = host;
        }
        if (!weight_finite(b, from, n, t, name)) {
            free(host);
            return NULL;
        }
        w->ptr = m->be->ops->alloc(m->be, n * sizeof(float));
        if (!w->ptr) {
            free(host);
            dcs_seterr(b->e, DCS_ERR_NOMEM, "out of memory for '%s'", name);
            return NULL;
        }
        m->be->ops->upload(m->be, w->ptr, from, n * sizeof(float));
        w->owned = 1;
        free(host);
    }
    m->n_weights++;
    return w->ptr;
}

/* Register a large matrix: on the CPU, F16/BF16 data stays as stored (the
 * mapped bytes when 2-byte aligned, else an owned copy; `own` hands over a
 * malloc'd buffer) and *slot stays NULL until dcs_model_require_f32;
 * otherwise it is placed like add_weight. */
static dcs_wmat add_weight_keep(builder *b, const char *name, int ndim, const int64_t *shape,
                                const uint8_t *data, int dtype, uint8_t *own, float **slot) {
    dcs_model *m = b->m;
    dcs_wmat r = {NULL, DCS_F32};
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= (uint64_t)shape[i];
    if (m->n_weights == m->cap_weights) {
        int cap = m->cap_weights ? 2 * m->cap_weights : 64;
        dcs_named_weight *w = realloc(m->weights, sizeof *w * (size_t)cap);
        if (!w) {
            free(own);
            dcs_seterr(b->e, DCS_ERR_NOMEM, "out of memory");
            return r;
        }
        m->weights = w;
        m->cap_weights = cap;
    }
    dcs_named_weight *w = &m->weights[m->n_weights];
    memset(w, 0, sizeof *w);
    snprintf(w->name, sizeof w->name, "%s", name);
    w->ndim = ndim;
    for (int i = 0; i < ndim; i++) w->shape[i] = shape[i];
    w->slot = slot;
    w->dtype = dtype;
    if (own) {
        w->half = own;
        w->half_owned = 1;
    } else if ((uintptr_t)data % 2 == 0) {
        w->half = data;
    } else {
        uint8_t *copy = malloc((size_t)n * 2);
        if (!copy) {
            dcs_seterr(b->e, DCS_ERR_NOMEM, "out of memory for '%s'", name);
            return r;
        }
        memcpy(copy, data, (size_t)n * 2);
        w->half = copy;
        w->half_owned = 1;
    }
    m->n_weights++;
    *slot = NULL;
    r.p = w->half;
    r.dtype = dtype;
    return r;
}

/* A large matrix by stored name: kept in its dtype on the CPU (see
 * add_weight_keep), float32 elsewhere. NULL .p when missing. */
static dcs_wmat load_keep(builder *b, const char *canon, const char *stored, int ndim, int64_t d0, int64_t d1,
                          int64_t d2, int64_t d3, float **slot) {
    int64_t shape[5] = {d0, d1, d2, d3, 0};
    dcs_wmat r = {NULL, DCS_F32};
    dcs_tensor *t = take(b, stored, 1, ndim, d0, d1, d2, d3, (int64_t)0);
    if (!t) return r;
    if (b->m->device != DCS_DEVICE_CPU || t->dtype == DCS_F32) {
        *slot = add_weight(b, canon, ndim, shape, t, NULL);
        r.p = *slot;
        return r;
    }
    if (!half_finite(b, t)) return r;
    return add_weight_keep(b, canon, ndim, shape, t->data, t->dtype, NULL, slot);
}

/* take + add_weight under the same shape; canonical name given separately. */
static float *load_as(builder *b, const char *canon, const char *stored, int required, int ndim, int64_t d0,
                      int64_t d1, int64_t d2, int64_t d3, int64_t d4, int *missing) {
    int64_t shape[5] = {d0, d1, d2, d3, d4};
    dcs_tensor *t = take(b, stored, required, ndim, d0, d1, d2, d3, d4);
    if (!t) {
        if (missing) *missing = 1;
        return NULL;
    }
    return add_weight(b, canon, ndim, shape, t, NULL);
}

#define FAIL_IF(cond)                                                                                        \
    do {                                                                                                     \
        if (cond) return b->e->code ? b->e->code : DCS_ERR_TENSOR;                                           \
    } while (0)

/* With tied embeddings, torch .bin files still carry the output matrix under
 * its own name (a view of the embedding's storage): accept and ignore it. */
static void tied_copy_ignored(builder *b, const char *name) {
    dcs_tensor *t = dcs_tt_find(&b->m->tt, name);
    if (t) t->used = 1;
}

/* One dcpythia (or dcformer: RMSNorm weights only, SwiGLU) layer. */
static dcs_status load_dcpythia_layer(builder *b, int l) {
    dcs_model *m = b->m;
    const dcs_config *c = &m->cfg;
    dcs_layer_weights *w = &m->layers[l];
    const int64_t D = c->d_model, F = c->d_ff, Dh = c->head_dim, N = c->n_head;
    const int bias = c->linear_bias;
    char nm[160], cn[160];
#define P(suffix) (snprintf(nm, sizeof nm, "layers.%d.%s", l, suffix), nm)
#define LOAD1(field, suffix, req, d0)                                                                        \
    do {                                                                                                     \
        w->field = load_as(b, P(suffix), nm, req, 1, d0, 0, 0, 0, 0, NULL);                                  \
        FAIL_IF(!w->field && (req));                                                                         \
    } while (0)
#define LOAD2(field, suffix, req, d0, d1)                                                                    \
    do {                                                                                                     \
        w->field = load_as(b, P(suffix), nm, req, 2, d0, d1, 0, 0, 0, NULL);                                 \
        FAIL_IF(!w->field && (req));                                                                         \
    } while (0)

    /* DCFormer++: RMSNorm, a weight only */
    const int norm_bias = c->model_type != DCS_MODEL_DCFORMER;
    LOAD1(attn_norm_w, "attention_norm.weight", 1, D);
    if (norm_bias) LOAD1(attn_norm_b, "attention_norm.bias", 1, D);
    LOAD1(ffn_norm_w, "ffn_norm.weight", 1, D);
    if (norm_bias) LOAD1(ffn_norm_b, "ffn_norm.bias", 1, D);

    /* q, k, v: fused wqkv or separate wq / wk / wv */
    snprintf(nm, sizeof nm, "layers.%d.attention.wqkv.weight", l);
#define KEEP2(field, suffix, d0, d1)                                                                         \
    do {                                                                                                     \
        w->m_##field = load_keep(b, P(suffix), nm, 2, d0, d1, 0, 0, &w->field);                              \
        FAIL_IF(!w->m_##field.p);                                                                            \
    } while (0)
    /* the stored dtype of the unfused parts, when all three share a 16-bit one */
    int parts_dtype = -1;
    if (m->device == DCS_DEVICE_CPU && !dcs_tt_find(&m->tt, nm)) {
        static const char *pn[3] = {"wq", "wk", "wv"};
        for (int j = 0; j < 3; j++) {
            snprintf(cn, sizeof cn, "layers.%d.attention.%s.weight", l, pn[j]);
            dcs_tensor *t = dcs_tt_find(&m->tt, cn);
            int dt = t && t->dtype != DCS_F32 && t->ndim == 2 && t->shape[0] == D && t->shape[1] == D
                         ? t->dtype
                         : -2;
            parts_dtype = j == 0 || parts_dtype == dt ? dt : -2;
        }
        if (parts_dtype < 0) parts_dtype = -1;
    }
    snprintf(nm, sizeof nm, "layers.%d.attention.wqkv.weight", l);
    if (dcs_tt_find(&m->tt, nm)) {
        KEEP2(wqkv, "attention.wqkv.weight", 3 * D, D);
        if (bias) LOAD1(bqkv, "attention.wqkv.bias", 1, 3 * D);
    } else if (parts_dtype >= 0) {
        /* wq, wk, wv concatenated in their 16-bit dtype */
        static const char *pn[3] = {"wq", "wk", "wv"};
        uint8_t *cat = malloc((size_t)(3 * D * D) * 2);
        if (!cat) return dcs_seterr(b->e, DCS_ERR_NOMEM, "out of memory");
        for (int j = 0; j < 3; j++) {
            snprintf(nm, sizeof nm, "layers.%d.attention.%s.weight", l, pn[j]);
            dcs_tensor *t = take(b, nm, 1, 2, D, D);
            if (!t || !half_finite(b, t)) {
                free(cat);
                return b->e->code;
            }
            memcpy(cat + (size_t)j * D * D * 2, t->data, (size_t)(D * D) * 2);
        }
        int64_t sw[2] = {3 * D, D};
        snprintf(cn, sizeof cn, "layers.%d.attention.wqkv.weight", l);
        w->m_wqkv = add_weight_keep(b, cn, 2, sw, NULL, parts_dtype, cat, &w->wqkv);
        FAIL_IF(!w->m_wqkv.p);
        if (bias) {
            float *hb = malloc(sizeof(float) * (size_t)(3 * D));
            if (!hb) return dcs_seterr(b->e, DCS_ERR_NOMEM, "out of memory");
            for (int j = 0; j < 3; j++) {
                snprintf(nm, sizeof nm, "layers.%d.attention.%s.bias", l, pn[j]);
                dcs_tensor *t = take(b, nm, 1, 1, D);
                if (!t) {
                    free(hb);
                    return b->e->code;
                }
                dcs_tensor_to_f32(t, hb + j * D);
            }
            int64_t sb[1] = {3 * D};
            snprintf(cn, sizeof cn, "layers.%d.attention.wqkv.bias", l);
            w->bqkv = add_weight(b, cn, 1, sb, NULL, hb);
            free(hb);
            FAIL_IF(!w->bqkv);
        }
    } else {
        static const char *parts[3] = {"wq", "wk", "wv"};
        float *host = malloc(sizeof(float) * (size_t)(3 * D * D + 3 * D));
        if (!host) return dcs_seterr(b->e, DCS_ERR_NOMEM, "out of memory");
        for (int j = 0; j < 3; j++) {
            snprintf(nm, sizeof nm, "layers.%d.attention.%s.weight", l, parts[j]);
            dcs_tensor *t = take(b, nm, 1, 2, D, D);
            if (!t) {
                free(host);
                if (b->e->code == DCS_ERR_TENSOR && strstr(b->e->msg, "missing"))
                    dcs_seterr(
                        b->e, DCS_ERR_TENSOR,
                        "%s: missing tensor 'layers.%d.attention.wqkv.weight' (or its parts wq, wk, wv)",
                        m->dir, l);
                return b->e->code;
            }
            dcs_tensor_to_f32(t, host + j * D * D);
            if (bias) {
                snprintf(nm, sizeof nm, "layers.%d.attention.%s.bias", l, parts[j]);
                t = take(b, nm, 1, 1, D);
                if (!t) {
                    free(host);
                    return b->e->code;
                }
                dcs_tensor_to_f32(t, host + 3 * D * D + j * D);
            }
        }
        int64_t sw[2] = {3 * D, D}, sb[1] = {3 * D};
        snprintf(cn, sizeof cn, "layers.%d.attention.wqkv.weight", l);
        w->wqkv = add_weight(b, cn, 2, sw, NULL, host);
        if (w->wqkv && bias) {
            snprintf(cn, sizeof cn, "layers.%d.attention.wqkv.bias", l);
            w->bqkv = add_weight(b, cn, 1, sb, NULL, host + 3 * D * D);
        }
        free(host);
        FAIL_IF(!w->wqkv || (bias && !w->bqkv));
        w->m_wqkv = (dcs_wmat){w->wqkv, DCS_F32};
    }
    KEEP2(wo, "attention.wo.weight", D, D);
    if (bias) LOAD1(bo, "attention.wo.bias", 1, D);
    if (c->qk_norm) {
        LOAD1(q_scale, "attention.q_norm.scale", 1, Dh);
        LOAD1(k_scale, "attention.k_norm.scale", 1, Dh);
    }
    if (c->use_dcmha) {
        /* G groups of Mg heads: dw1 [D, G, C, K], qkw [G, C, K, 2R, Mg], dd [D, G, C*Mg] */
        const int64_t C = c->dyn_slots, K = c->dyn_hidden, R = c->dyn_rank;
        const int64_t G = c->compose_groups, Mg = N / G;
        w->m_dw1 = load_keep(b, P("attention.dyn_w_proj.dw1"), nm, 4, D, G, C, K, &w->dw1);
        FAIL_IF(!w->m_dw1.p);
        w->qkw = load_as(b, P("attention.dyn_w_proj.qkw"), nm, 1, 5, G, C, K, 2 * R, Mg, NULL);
        FAIL_IF(!w->qkw);
        w->dd = load_as(b, P("attention.dyn_w_proj.dd"), nm, 1, 3, D, G, C * Mg, 0, 0, NULL);
        FAIL_IF(!w->dd);
        if (c->use_sw) { /* static (Talking-Heads) maps, model-spec 5 */
            w->pre_sw = load_as(b, P("attention.dyn_w_proj.pre_proj.w"), nm, 1, 3, G, Mg, Mg, 0, 0, NULL);
            FAIL_IF(!w->pre_sw);
            w->post_sw = load_as(b, P("attention.dyn_w_proj.post_proj.w"), nm, 1, 3, G, Mg, Mg, 0, 0, NULL);
            FAIL_IF(!w->post_sw);
        }
    }
    if (c->moh) { /* Mixture-of-Head router, model-spec 5 */
        const int64_t hs = c->moh_shared;
        w->moh_wg = load_as(b, P("attention.moh.wg.weight"), nm, 1, 2, N - hs, D, 0, 0, 0, NULL);
        FAIL_IF(!w->moh_wg);
        if (hs > 1) {
            w->moh_wg1 = load_as(b, P("attention.moh.wg_1.weight"), nm, 1, 2, hs, D, 0, 0, 0, NULL);
            FAIL_IF(!w->moh_wg1);
        }
        if (hs > 0) {
            w->moh_wg0 = load_as(b, P("attention.moh.wg_0.weight"), nm, 1, 2, 2, D, 0, 0, 0, NULL);
            FAIL_IF(!w->moh_wg0);
        }
    }
    KEEP2(w1, "feed_forward.w1.weight", F, D);
    if (bias) LOAD1(b1, "feed_forward.w1.bias", 1, F);
    KEEP2(w2, "feed_forward.w2.weight", D, F);
    if (bias) LOAD1(b2, "feed_forward.w2.bias", 1, D);
    if (c->model_type == DCS_MODEL_DCFORMER) { /* SwiGLU's w3, the group gate mg */
        KEEP2(w3, "feed_forward.w3.weight", F, D);
        if (c->mgate_dim > 0) LOAD2(mg, "feed_forward.mg.weight", 1, c->mgate_dim, D);
    }
#undef P
#undef LOAD1
#undef LOAD2
#undef KEEP2
    /* Accepted and ignored: derived tensors that carry no new information,
     * and the weights of switches the config turns off (so a DCPythia
     * checkpoint loads as plain MHA with use_dcmha false). */
    static const char *ignored[] = {"dyn_w_proj.dw_m", "dyn_w_proj.qkw_m", "dyn_w_proj.sw",
                                    "dyn_w_proj.pre_proj.w", "dyn_w_proj.post_proj.w", "dyn_w_proj.dw1",
                                    "dyn_w_proj.qkw", "dyn_w_proj.dd", "q_norm.scale", "k_norm.scale",
                                    /* DCFormer's decoding caches, saved after setup_caches */
                                    "kv_cache.k_cache", "kv_cache.v_cache", "kv_cache.kw_cache",
                                    "kv_cache.kw_sub_cache"};
    for (size_t i = 0; i < sizeof ignored / sizeof ignored[0]; i++) {
        snprintf(nm, sizeof nm, "layers.%d.attention.%s", l, ignored[i]);
        dcs_tensor *t = dcs_tt_find(&m->tt, nm);
        if (t) t->used = 1;
    }
    return DCS_OK;
}

/* The dynamic-weight dims C, K, R from layer 0's tensors. */
static dcs_status dcpythia_dyn_dims(builder *b) {
    dcs_model *m = b->m;
    dcs_config *c = &m->cfg;
    if (!c->use_dcmha) return DCS_OK;
    dcs_tensor *dw1 = dcs_tt_find(&m->tt, "layers.0.attention.dyn_w_proj.dw1");
    dcs_tensor *qkw = dcs_tt_find(&m->tt, "layers.0.attention.dyn_w_proj.qkw");
    if (!dw1)
        return dcs_seterr(b->e, DCS_ERR_TENSOR, "%s: missing tensor 'layers.0.attention.dyn_w_proj.dw1'",
                          m->dir);
    if (!qkw)
        return dcs_seterr(b->e, DCS_ERR_TENSOR, "%s: missing tensor 'layers.0.attention.dyn_w_proj.qkw'",
                          m->dir);
    if (dw1->ndim != 4 || (dw1->shape[2] != 4 && dw1->shape[2] != 2) || dw1->shape[3] < 1 ||
        dw1->shape[3] > (1 << 20))
        return dcs_seterr(b->e, DCS_ERR_TENSOR,
                          "%s: tensor 'layers.0.attention.dyn_w_proj.dw1' must have shape [D, G, 4, K]",
                          dw1->file);
    if (dw1->shape[1] != c->compose_groups)
        return dcs_seterr(b->e, DCS_ERR_TENSOR,
                          "%s: tensor 'layers.0.attention.dyn_w_proj.dw1' has %lld groups (axis 1), "
                          "the config %d (compose_groups; missing or null means 1)",
                          dw1->file, (long long)dw1->shape[1], c->compose_groups);
    if (c->use_sw && c->n_head / c->compose_groups > DCS_MAX_SW_HEADS)
        return dcs_seterr(b->e, DCS_ERR_UNSUPPORTED,
                          "%s: use_sw with %d heads per composition group (at most %d supported)", m->dir,
                          c->n_head / c->compose_groups, DCS_MAX_SW_HEADS);
    if (qkw->ndim != 5 || qkw->shape[3] % 2 != 0 || qkw->shape[3] < 2 || qkw->shape[3] / 2 > DCS_MAX_R)
        return dcs_seterr(
            b->e, DCS_ERR_TENSOR,
            "%s: tensor 'layers.0.attention.dyn_w_proj.qkw' must have shape [1, 4, K, 2R, N] with 1 <= R <= %d",
            qkw->file, DCS_MAX_R);
    c->dyn_slots = (int)dw1->shape[2];
    c->dyn_hidden = (int)dw1->shape[3];
    c->dyn_rank = (int)(qkw->shape[3] / 2);
    if (c->dyn_slots == 2 && !c->query_wise && !c->key_wise)
        return dcs_seterr(
            b->e, DCS_ERR_TENSOR,
            "%s: dyn_w_proj.dw1 has 2 slots (one side) but the config has query_wise false and key_wise false",
            dw1->file);
    return DCS_OK;
}

/* Does any dropped-side slot (key: 1, 3; query: 0, 2) of a 4-slot layer
 * carry weight? That side's branches act iff the hidden and qkw slots are
 * both nonzero, or dd is. */
static int side_slots_used(const dcs_model *m, int l, int side) {
    const dcs_config *c = &m->cfg;
    const int64_t C = c->dyn_slots, K = c->dyn_hidden, Mg = c->n_head / c->compose_groups;
    const int64_t RM = 2 * (int64_t)c->dyn_rank * Mg;
    const char *names[3] = {"dw1", "qkw", "dd"};
    const int64_t per_slot[3] = {K, K * RM, Mg}; /* contiguous run of one slot */
    int nz[3] = {0, 0, 0};
    for (int i = 0; i < 3; i++) {
        char nm[160];
        snprintf(nm, sizeof nm, "layers.%d.attention.dyn_w_proj.%s", l, names[i]);
        const dcs_tensor *t = dcs_tt_find(&m->tt, nm);
        if (!t) continue;
        uint64_t n = dcs_tensor_numel(t);
        float *v = malloc(sizeof(float) * (n ? n : 1));
        if (!v) return 1; /* cannot check: say so */
        dcs_tensor_to_f32(t, v);
        for (uint64_t j = 0; j < n && !nz[i]; j++)
            if (v[j] != 0.0f && ((int64_t)(j / (uint64_t)per_slot[i]) % C) % 2 == side) nz[i] = 1;
        free(v);
    }
    return (nz[0] && nz[1]) || nz[2];
}

/* A query-wise checkpoint with 4 slots carries key-side weights: they are
 * ignored (model-spec 2 step 6), said once at load. Likewise the query-side
 * weights of a key-wise-only checkpoint. */
static void query_wise_note(dcs_model *m) {
    const dcs_config *c = &m->cfg;
    if (!c->use_dcmha || !(c->query_wise || c->key_wise) || c->dyn_slots != 4) return;
    int used = 0;
    for (int l = 0; l < c->n_layer && !used; l++) used = side_slots_used(m, l, c->query_wise ? 1 : 0);
    if (!used) return;
    size_t o = strlen(m->warnings);
    if (c->key_wise) {
        snprintf(m->warnings + o, sizeof m->warnings - o,
                 "%s: key_wise is set but dyn_w_proj carries query-wise weights (slots 0 and 2 of "
                 "dw1/qkw/dd); they are ignored (key-wise-only composition).\n",
                 m->dir);
        return;
    }
    snprintf(m->warnings + o, sizeof m->warnings - o,
             "%s: query_wise is set but dyn_w_proj carries key-wise weights (slots 1 and 3 of "
             "dw1/qkw/dd); they are ignored, as in the DCFormer paper and its JAX training code. "
             "The published PyTorch module still applies them in prefill and training (only its "
             "decoding drops them), so its logits for this checkpoint differ from dclens's.\n",
             m->dir);
}

/* Where the official DCFormer module's numbers differ from the engine's
 * (docs/dcformer-spec.md, "The official module"), one line each. */
static void dcformer_notes(dcs_model *m) {
    static const struct {
        int bit;
        const char *text;
    } notes[] = {
        {DCS_NOTE_LOCAL_INFER,
         "local layers keep window_size past keys (t - s <= window_size, as DCPythia and "
         "the official training masks); the official inference masks keep window_size - 1"},
        {DCS_NOTE_TYPED_WINDOW,
         "window_type names a pattern and window_size is not 256: the official module's "
         "typed patterns write 256 (its cache size) but mask with window_size; dclens "
         "uses window_size"},
        {DCS_NOTE_ROPE_DTYPE, "torch_dtype is 16-bit: the official module rounds its rotary table to it; "
                              "dclens computes rotary in float32"},
        {DCS_NOTE_TRAINING,
         "is_training is true: the official module then runs its chunked training path "
         "(softmax probabilities rounded to bfloat16); dclens computes the exact float32 forward"},
        {DCS_NOTE_NO_DCMHA, "use_dcmha is false: dclens runs plain attention; the official inference path "
                            "composes heads regardless"},
    };
    for (size_t i = 0; i < sizeof notes / sizeof notes[0]; i++) {
        if (!(m->cfg.official_notes & notes[i].bit)) continue;
        size_t o = strlen(m->warnings);
        snprintf(m->warnings + o, sizeof m->warnings - o, "dcformer: %s.\n", notes[i].text);
    }
}

static dcs_status load_dcpythia(builder *b) {
    dcs_model *m = b->m;
    const dcs_config *c = &m->cfg;
    const int64_t D = c->d_model, V = c->vocab;
    dcs_status s;
    if ((s = dcpythia_dyn_dims(b))) return s;
    m->m_tok_emb = load_keep(b, "tok_embeddings.weight", "tok_embeddings.weight", 2, V, D, 0, 0, &m->tok_emb);
    FAIL_IF(!m->m_tok_emb.p);
    for (int l = 0; l < c->n_layer; l++)
        if ((s = load_dcpythia_layer(b, l))) return s;
    m->norm_w = load_as(b, "norm.weight", "norm.weight", 1, 1, D, 0, 0, 0, 0, NULL);
    FAIL_IF(!m->norm_w);
    if (c->model_type != DCS_MODEL_DCFORMER) { /* DCFormer++'s final RMSNorm: no bias */
        m->norm_b = load_as(b, "norm.bias", "norm.bias", 1, 1, D, 0, 0, 0, 0, NULL);
        FAIL_IF(!m->norm_b);
    }
    if (c->tie_embeddings) {
        m->out_w = m->tok_emb;
        m->m_out_w = m->m_tok_emb;
        tied_copy_ignored(b, "output.weight");
    } else {
        m->m_out_w = load_keep(b, "output.weight", "output.weight", 2, V, D, 0, 0, &m->out_w);
        FAIL_IF(!m->m_out_w.p);
    }
    return DCS_OK;
}

/* GPT-NeoX query_key_value rows [n*3*Dh + j*Dh + d] -> [j*D + n*Dh + d],
 * rows of row_bytes bytes. */
static void neox_regroup(const void *src, void *dst, int N, int Dh, size_t row_bytes) {
    for (int n = 0; n < N; n++)
        for (int j = 0; j < 3; j++)
            for (int d = 0; d < Dh; d++)
                memcpy((uint8_t *)dst + ((size_t)j * N * Dh + (size_t)n * Dh + d) * row_bytes,
                       (const uint8_t *)src + ((size_t)n * 3 * Dh + (size_t)j * Dh + d) * row_bytes,
                       row_bytes);
}

static dcs_status load_neox_layer(builder *b, int l) {
    dcs_model *m = b->m;
    const dcs_config *c = &m->cfg;
    dcs_layer_weights *w = &m->layers[l];
    const int64_t D = c->d_model, F = c->d_ff;
    char nm[160], cn[160];
#define S(suffix) (snprintf(nm, sizeof nm, "gpt_neox.layers.%d.%s", l, suffix), nm)
#define C(suffix) (snprintf(cn, sizeof cn, "layers.%d.%s", l, suffix), cn)
#define LOAD(field, canon, stored, nd, d0, d1)                                                               \
    do {                                                                                                     \
        C(canon);                                                                                            \
        w->field = load_as(b, cn, S(stored), 1, nd, d0, d1, 0, 0, 0, NULL);                                  \
        FAIL_IF(!w->field);                                                                                  \
    } while (0)
#define KEEP(field, canon, stored, d0, d1)                                                                   \
    do {                                                                                                     \
        C(canon);                                                                                            \
        w->m_##field = load_keep(b, cn, S(stored), 2, d0, d1, 0, 0, &w->field);                              \
        FAIL_IF(!w->m_##field.p);                                                                            \
    } while (0)
    LOAD(attn_norm_w, "attention_norm.weight", "input_layernorm.weight", 1, D, 0);
    LOAD(attn_norm_b, "attention_norm.bias", "input_layernorm.bias", 1, D, 0);
    LOAD(ffn_norm_w, "ffn_norm.weight", "post_attention_layernorm.weight", 1, D, 0);
    LOAD(ffn_norm_b, "ffn_norm.bias", "post_attention_layernorm.bias", 1, D, 0);
    KEEP(wo, "attention.wo.weight", "attention.dense.weight", D, D);
    LOAD(bo, "attention.wo.bias", "attention.dense.bias", 1, D, 0);
    KEEP(w1, "feed_forward.w1.weight", "mlp.dense_h_to_4h.weight", F, D);
    LOAD(b1, "feed_forward.w1.bias", "mlp.dense_h_to_4h.bias", 1, F, 0);
    KEEP(w2, "feed_forward.w2.weight", "mlp.dense_4h_to_h.weight", D, F);
    LOAD(b2, "feed_forward.w2.bias", "mlp.dense_4h_to_h.bias", 1, D, 0);

    dcs_tensor *tw = take(b, S("attention.query_key_value.weight"), 1, 2, 3 * D, D);
    FAIL_IF(!tw);
    dcs_tensor *tb = take(b, S("attention.query_key_value.bias"), 1, 1, 3 * D);
    FAIL_IF(!tb);
    int64_t sw[2] = {3 * D, D}, sb[1] = {3 * D};
    if (m->device == DCS_DEVICE_CPU && tw->dtype != DCS_F32) {
        /* regrouped in the stored dtype, kept so */
        FAIL_IF(!half_finite(b, tw));
        uint8_t *rg = malloc((size_t)(3 * D * D) * 2);
        float *hb = malloc(sizeof(float) * (size_t)(6 * D));
        if (!rg || !hb) {
            free(rg);
            free(hb);
            return dcs_seterr(b->e, DCS_ERR_NOMEM, "out of memory");
        }
        neox_regroup(tw->data, rg, c->n_head, c->head_dim, (size_t)D * 2);
        dcs_tensor_to_f32(tb, hb);
        neox_regroup(hb, hb + 3 * D, c->n_head, c->head_dim, sizeof(float));
        w->m_wqkv = add_weight_keep(b, C("attention.wqkv.weight"), 2, sw, NULL, tw->dtype, rg, &w->wqkv);
        if (w->m_wqkv.p) w->bqkv = add_weight(b, C("attention.wqkv.bias"), 1, sb, NULL, hb + 3 * D);
        free(hb);
        FAIL_IF(!w->m_wqkv.p || !w->bqkv);
        goto buffers;
    }
    float *raw = malloc(sizeof(float) * (size_t)(3 * D * D + 3 * D));
    float *fused = malloc(sizeof(float) * (size_t)(3 * D * D + 3 * D));
    if (!raw || !fused) {
        free(raw);
        free(fused);
        return dcs_seterr(b->e, DCS_ERR_NOMEM, "out of memory");
    }
    dcs_tensor_to_f32(tw, raw);
    dcs_tensor_to_f32(tb, raw + 3 * D * D);
    neox_regroup(raw, fused, c->n_head, c->head_dim, sizeof(float) * (size_t)D);
    neox_regroup(raw + 3 * D * D, fused + 3 * D * D, c->n_head, c->head_dim, sizeof(float));
    w->wqkv = add_weight(b, C("attention.wqkv.weight"), 2, sw, NULL, fused);
    if (w->wqkv) w->bqkv = add_weight(b, C("attention.wqkv.bias"), 1, sb, NULL, fused + 3 * D * D);
    free(raw);
    free(fused);
    FAIL_IF(!w->wqkv || !w->bqkv);
    w->m_wqkv = (dcs_wmat){w->wqkv, DCS_F32};
buffers:;
    /* buffers that may appear and carry nothing */
    static const char *buffers[] = {"attention.bias", "attention.masked_bias",
                                    "attention.rotary_emb.inv_freq"};
    for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++) {
        dcs_tensor *t = dcs_tt_find(&m->tt, S(buffers[i]));
        if (t) t->used = 1;
    }
#undef S
#undef C
#undef LOAD
#undef KEEP
    return DCS_OK;
}

static dcs_status load_neox(builder *b) {
    dcs_model *m = b->m;
    const dcs_config *c = &m->cfg;
    const int64_t D = c->d_model, V = c->vocab;
    dcs_status s;
    m->m_tok_emb =
        load_keep(b, "tok_embeddings.weight", "gpt_neox.embed_in.weight", 2, V, D, 0, 0, &m->tok_emb);
    FAIL_IF(!m->m_tok_emb.p);
    for (int l = 0; l < c->n_layer; l++)
        if ((s = load_neox_layer(b, l))) return s;
    m->norm_w = load_as(b, "norm.weight", "gpt_neox.final_layer_norm.weight", 1, 1, D, 0, 0, 0, 0, NULL);
    FAIL_IF(!m->norm_w);
    m->norm_b = load_as(b, "norm.bias", "gpt_neox.final_layer_norm.bias", 1, 1, D, 0, 0, 0, 0, NULL);
    FAIL_IF(!m->norm_b);
    if (c->tie_embeddings) {
        m->out_w = m->tok_emb;
        m->m_out_w = m->m_tok_emb;
        tied_copy_ignored(b, "embed_out.weight");
    } else {
        m->m_out_w = load_keep(b, "output.weight", "embed_out.weight", 2, V, D, 0, 0, &m->out_w);
        FAIL_IF(!m->m_out_w.p);
    }
    return DCS_OK;
}

/* Every stored tensor must have been used (or be a known derived one). */
static dcs_status check_unused(builder *b) {
    const dcs_tensor_table *tt = &b->m->tt;
    for (int i = 0; i < tt->n; i++)
        if (!tt->t[i].used)
            return dcs_seterr(b->e, DCS_ERR_TENSOR,
                              "%s: unexpected tensor '%.200s' (not part of a %s model with this config)",
                              tt->t[i].file, tt->t[i].name,
                              b->m->cfg.model_type == DCS_MODEL_DCPYTHIA   ? "dcpythia"
                              : b->m->cfg.model_type == DCS_MODEL_DCFORMER ? "dcformer"
                                                                           : "gpt_neox");
    return DCS_OK;
}

/* Weight files are read into private memory (files.c). Once every weight
 * is in place, the copy of a file no weight aliases (neither an F32 weight
 * used in place nor an F16/BF16 matrix kept as stored; unaligned data,
 * CUDA uploads) is given back, so a loaded model holds its
 * weights once. Tensors of a released file lose their data pointer. */
static void release_unaliased_files(dcs_model *m) {
    dcs_tensor_table *tt = &m->tt;
    for (int i = 0; i < tt->n_files; i++) {
        dcs_mapped_file *f = &tt->files[i];
        if (!f->data) continue;
        const uint8_t *lo = f->data, *hi = f->data + f->size;
        int aliased = 0;
        for (int k = 0; k < m->n_weights && !aliased; k++) {
            const dcs_named_weight *w = &m->weights[k];
            const uint8_t *p = (const uint8_t *)w->ptr, *h = (const uint8_t *)w->half;
            aliased = (!w->owned && p && p >= lo && p < hi) ||    /* F32 in place     */
                      (!w->half_owned && h && h >= lo && h < hi); /* F16/BF16 kept    */
        }
        if (aliased) continue;
        for (int k = 0; k < tt->n; k++)
            if (tt->t[k].data >= lo && tt->t[k].data < hi) tt->t[k].data = NULL;
        dcs_release_file_data(f);
    }
}

static dcs_status make_backend(dcs_model *m, const dcs_load_options *o, dcs_err *e) {
    if (m->device == DCS_DEVICE_CPU) {
        m->be = dcs_backend_cpu_create(o ? o->n_threads : 0, e);
        return m->be ? DCS_OK : e->code;
    }
    if (m->device == DCS_DEVICE_CUDA) {
        /* the CUDA plugin (cuda_plugin.c), loaded now */
        char why[768];
        if (!dcs_cuda_probe(why, sizeof why))
            return dcs_seterr(e, DCS_ERR_UNSUPPORTED, "device 'cuda' is not available: %s", why);
        m->be = dcs_backend_cuda_create(o ? o->cuda_device : 0, e);
        return m->be ? DCS_OK : e->code;
    }
    return dcs_seterr(e, DCS_ERR_ARG, "unknown device %d", m->device);
}

dcs_status dcs_load(const char *dir, const dcs_load_options *opts, dcs_model **out, char *errbuf,
                    size_t errlen) {
    dcs_err e = {0};
    dcs_model *m = NULL;
    char *text = NULL;
    char path[4096];
    dcs_status s = DCS_OK;
    if (out) *out = NULL;
    if (!dir || !out) {
        s = dcs_seterr(&e, DCS_ERR_ARG, "dcs_load: NULL directory or output");
        goto done;
    }
    m = calloc(1, sizeof *m);
    if (!m || !(m->dir = strdup(dir))) {
        s = dcs_seterr(&e, DCS_ERR_NOMEM, "out of memory");
        goto done;
    }
    m->device = opts ? opts->device : DCS_DEVICE_CPU;

    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path) {
        s = dcs_seterr(&e, DCS_ERR_ARG, "%.64s...: path too long", dir);
        goto done;
    }
    size_t len;
    if ((s = dcs_read_text_file(path, MAX_CONFIG_BYTES, &text, &len, &e))) goto done;
    if (strlen(text) != len) {
        s = dcs_seterr(&e, DCS_ERR_CONFIG, "%s: contains a NUL byte", path);
        goto done;
    }
    int pat[16], plen = 1;
    if ((s = dcs_parse_config(text, path, &m->cfg, pat, &plen, &e))) goto done;
    if (m->cfg.n_layer > (int)(sizeof m->local / sizeof m->local[0])) {
        s = dcs_seterr(&e, DCS_ERR_CONFIG, "%s: n_layer %d exceeds the supported %d", path, m->cfg.n_layer,
                       (int)(sizeof m->local / sizeof m->local[0]));
        goto done;
    }
    for (int l = 0; l < m->cfg.n_layer; l++) m->local[l] = pat[l % plen];

    if ((s = dcs_tt_open_dir(dir, &m->tt, &e))) goto done;
    if ((s = make_backend(m, opts, &e))) goto done;
    m->layers = calloc((size_t)m->cfg.n_layer, sizeof *m->layers);
    if (!m->layers) {
        s = dcs_seterr(&e, DCS_ERR_NOMEM, "out of memory");
        goto done;
    }
    builder b = {m, &e};
    s = m->cfg.model_type == DCS_MODEL_GPT_NEOX ? load_neox(&b) : load_dcpythia(&b);
    if (!s) s = check_unused(&b);
    if (!s && m->cfg.model_type != DCS_MODEL_GPT_NEOX) query_wise_note(m);
    if (!s && m->cfg.model_type == DCS_MODEL_DCFORMER) dcformer_notes(m);
    if (!s) s = dcs_model_map_params(m, &e);
    if (!s) s = dcs_plan_layers(m, &e);
    if (!s) s = m->be->ops->sync(m->be, &e);
    if (!s) release_unaliased_files(m);
done:
    free(text);
    if (s != DCS_OK) {
        if (errbuf && errlen) snprintf(errbuf, errlen, "%s", e.msg);
        dcs_free(m);
        return s;
    }
    *out = m;
    return DCS_OK;
}
