/*
 * load_dcpythia.c -- DCPythia and DCFormer++ checkpoints (model_type
 * dcpythia, dcformer) onto the canonical weights: each layer in named parts
 * (norms; q, k, v, fused or from wq / wk / wv; attention output and q/k
 * norms; the dynamic weights of DCMHA; the Mixture-of-Head router; the MLP),
 * the dynamic-weight dims read from layer 0, and the notes said at load
 * (dropped query- or key-wise slots, where the official DCFormer module
 * differs). The shared helpers: load_weights.c.
 */
#include "load.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* In a layer's parts, with b, l, w (the layer's weights) and nm (a name
 * buffer) in scope: P gives a stored name, which is also the canonical one;
 * LOAD1 / LOAD2 load a float32 weight of 1 / 2 dims and KEEP2 a large
 * matrix (kept in its 16-bit dtype on the CPU), returning the error when a
 * required one is missing or wrong. */
#define P(suffix) (snprintf(nm, sizeof nm, "layers.%d.%s", l, suffix), nm)
#define LOAD1(field, suffix, req, d0)                                                                        \
    do {                                                                                                     \
        w->field = dcs_load_as(b, P(suffix), nm, req, 1, d0, 0, 0, 0, 0, NULL);                              \
        FAIL_IF(!w->field && (req));                                                                         \
    } while (0)
#define LOAD2(field, suffix, req, d0, d1)                                                                    \
    do {                                                                                                     \
        w->field = dcs_load_as(b, P(suffix), nm, req, 2, d0, d1, 0, 0, 0, NULL);                             \
        FAIL_IF(!w->field && (req));                                                                         \
    } while (0)
#define KEEP2(field, suffix, d0, d1)                                                                         \
    do {                                                                                                     \
        w->m_##field = dcs_load_keep(b, P(suffix), nm, 2, d0, d1, 0, 0, &w->field);                          \
        FAIL_IF(!w->m_##field.p);                                                                            \
    } while (0)

/* The unfused parts of wqkv, in row order. */
static const char *const qkv_parts[3] = {"wq", "wk", "wv"};

/* A linear map: "layers.{l}.{name}.weight" [rows, cols] (kept in its dtype
 * on the CPU) and, with linear_bias, its "{name}.bias" [rows]. */
static dcs_status load_linear(dcs_builder *b, int l, const char *name, int64_t rows, int64_t cols,
                              dcs_wmat *mat, float **weight, float **bias) {
    char nm[160];
    snprintf(nm, sizeof nm, "layers.%d.%s.weight", l, name);
    *mat = dcs_load_keep(b, nm, nm, 2, rows, cols, 0, 0, weight);
    FAIL_IF(!mat->p);
    if (!b->m->cfg.linear_bias) return DCS_OK;
    snprintf(nm, sizeof nm, "layers.%d.%s.bias", l, name);
    *bias = dcs_load_as(b, nm, nm, 1, 1, rows, 0, 0, 0, 0, NULL);
    FAIL_IF(!*bias);
    return DCS_OK;
}

/* The attention and MLP norms (DCFormer++: RMSNorm, a weight only). */
static dcs_status load_norms(dcs_builder *b, int l) {
    const dcs_config *c = &b->m->cfg;
    dcs_layer_weights *w = &b->m->layers[l];
    const int64_t D = c->d_model;
    char nm[160];
    const int norm_bias = c->model_type != DCS_MODEL_DCFORMER;
    LOAD1(attn_norm_w, "attention_norm.weight", 1, D);
    if (norm_bias) LOAD1(attn_norm_b, "attention_norm.bias", 1, D);
    LOAD1(ffn_norm_w, "ffn_norm.weight", 1, D);
    if (norm_bias) LOAD1(ffn_norm_b, "ffn_norm.bias", 1, D);
    return DCS_OK;
}

/* On the CPU, with no fused wqkv stored: the dtype of wq, wk, wv when all
 * three are [D, D] in one 16-bit dtype; else -1. */
static int qkv_parts_dtype(const dcs_model *m, int l) {
    const int64_t D = m->cfg.d_model;
    char nm[160];
    snprintf(nm, sizeof nm, "layers.%d.attention.wqkv.weight", l);
    if (m->device != DCS_DEVICE_CPU || dcs_tt_find(&m->tt, nm)) return -1;
    int parts_dtype = -1;
    for (int j = 0; j < 3; j++) {
        snprintf(nm, sizeof nm, "layers.%d.attention.%s.weight", l, qkv_parts[j]);
        dcs_tensor *t = dcs_tt_find(&m->tt, nm);
        int dt =
            t && t->dtype != DCS_F32 && t->ndim == 2 && t->shape[0] == D && t->shape[1] == D ? t->dtype : -2;
        parts_dtype = j == 0 || parts_dtype == dt ? dt : -2;
    }
    return parts_dtype < 0 ? -1 : parts_dtype;
}

/* wq, wk, wv concatenated into wqkv in their 16-bit dtype (biases, with
 * linear_bias, widened to float32). */
static dcs_status load_qkv_half(dcs_builder *b, int l, int dtype) {
    dcs_layer_weights *w = &b->m->layers[l];
    const int64_t D = b->m->cfg.d_model;
    char nm[160], cn[160];
    uint8_t *cat = malloc((size_t)(3 * D * D) * 2);
    if (!cat) return dcs_seterr(b->e, DCS_ERR_NOMEM, "out of memory");
    for (int j = 0; j < 3; j++) {
        snprintf(nm, sizeof nm, "layers.%d.attention.%s.weight", l, qkv_parts[j]);
        dcs_tensor *t = dcs_load_take(b, nm, 1, 2, D, D);
        if (!t || !dcs_load_half_finite(b, t)) {
            free(cat);
            return b->e->code;
        }
        memcpy(cat + (size_t)j * D * D * 2, t->data, (size_t)(D * D) * 2);
    }
    int64_t sw[2] = {3 * D, D};
    snprintf(cn, sizeof cn, "layers.%d.attention.wqkv.weight", l);
    w->m_wqkv = dcs_load_add_weight_keep(b, cn, 2, sw, NULL, dtype, cat, &w->wqkv);
    FAIL_IF(!w->m_wqkv.p);
    if (!b->m->cfg.linear_bias) return DCS_OK;
    float *hb = malloc(sizeof(float) * (size_t)(3 * D));
    if (!hb) return dcs_seterr(b->e, DCS_ERR_NOMEM, "out of memory");
    for (int j = 0; j < 3; j++) {
        snprintf(nm, sizeof nm, "layers.%d.attention.%s.bias", l, qkv_parts[j]);
        dcs_tensor *t = dcs_load_take(b, nm, 1, 1, D);
        if (!t) {
            free(hb);
            return b->e->code;
        }
        dcs_tensor_to_f32(t, hb + j * D);
    }
    int64_t sb[1] = {3 * D};
    snprintf(cn, sizeof cn, "layers.%d.attention.wqkv.bias", l);
    w->bqkv = dcs_load_add_weight(b, cn, 1, sb, NULL, hb);
    free(hb);
    FAIL_IF(!w->bqkv);
    return DCS_OK;
}

/* wq, wk, wv (and their biases, with linear_bias) concatenated into wqkv
 * in float32. */
static dcs_status load_qkv_f32(dcs_builder *b, int l) {
    dcs_layer_weights *w = &b->m->layers[l];
    const int64_t D = b->m->cfg.d_model;
    const int bias = b->m->cfg.linear_bias;
    char nm[160], cn[160];
    float *host = malloc(sizeof(float) * (size_t)(3 * D * D + 3 * D));
    if (!host) return dcs_seterr(b->e, DCS_ERR_NOMEM, "out of memory");
    for (int j = 0; j < 3; j++) {
        snprintf(nm, sizeof nm, "layers.%d.attention.%s.weight", l, qkv_parts[j]);
        dcs_tensor *t = dcs_load_take(b, nm, 1, 2, D, D);
        if (!t) {
            free(host);
            if (b->e->code == DCS_ERR_TENSOR && strstr(b->e->msg, "missing"))
                dcs_seterr(b->e, DCS_ERR_TENSOR,
                           "%s: missing tensor 'layers.%d.attention.wqkv.weight' (or its parts wq, wk, wv)",
                           b->m->dir, l);
            return b->e->code;
        }
        dcs_tensor_to_f32(t, host + j * D * D);
        if (bias) {
            snprintf(nm, sizeof nm, "layers.%d.attention.%s.bias", l, qkv_parts[j]);
            t = dcs_load_take(b, nm, 1, 1, D);
            if (!t) {
                free(host);
                return b->e->code;
            }
            dcs_tensor_to_f32(t, host + 3 * D * D + j * D);
        }
    }
    int64_t sw[2] = {3 * D, D}, sb[1] = {3 * D};
    snprintf(cn, sizeof cn, "layers.%d.attention.wqkv.weight", l);
    w->wqkv = dcs_load_add_weight(b, cn, 2, sw, NULL, host);
    if (w->wqkv && bias) {
        snprintf(cn, sizeof cn, "layers.%d.attention.wqkv.bias", l);
        w->bqkv = dcs_load_add_weight(b, cn, 1, sb, NULL, host + 3 * D * D);
    }
    free(host);
    FAIL_IF(!w->wqkv || (bias && !w->bqkv));
    w->m_wqkv = (dcs_wmat){w->wqkv, DCS_F32};
    return DCS_OK;
}

/* q, k, v: the fused wqkv as stored, or its parts wq / wk / wv
 * concatenated (kept 16-bit on the CPU when they share such a dtype). */
static dcs_status load_qkv(dcs_builder *b, int l) {
    dcs_layer_weights *w = &b->m->layers[l];
    const int64_t D = b->m->cfg.d_model;
    char nm[160];
    const int parts_dtype = qkv_parts_dtype(b->m, l);
    snprintf(nm, sizeof nm, "layers.%d.attention.wqkv.weight", l);
    if (!dcs_tt_find(&b->m->tt, nm))
        return parts_dtype >= 0 ? load_qkv_half(b, l, parts_dtype) : load_qkv_f32(b, l);
    return load_linear(b, l, "attention.wqkv", 3 * D, D, &w->m_wqkv, &w->wqkv, &w->bqkv);
}

/* The attention's output projection and the q/k norms' scales (qk_norm). */
static dcs_status load_attn_out(dcs_builder *b, int l) {
    const dcs_config *c = &b->m->cfg;
    dcs_layer_weights *w = &b->m->layers[l];
    const int64_t D = c->d_model, Dh = c->head_dim;
    char nm[160];
    dcs_status s = load_linear(b, l, "attention.wo", D, D, &w->m_wo, &w->wo, &w->bo);
    if (s) return s;
    if (c->qk_norm) {
        LOAD1(q_scale, "attention.q_norm.scale", 1, Dh);
        LOAD1(k_scale, "attention.k_norm.scale", 1, Dh);
    }
    return DCS_OK;
}

/* DCMHA's dynamic weights (use_dcmha), G groups of Mg heads: dw1
 * [D, G, C, K], qkw [G, C, K, 2R, Mg], dd [D, G, C*Mg]; with use_sw the
 * static (Talking-Heads) maps, model-spec 5. */
static dcs_status load_dcmha(dcs_builder *b, int l) {
    const dcs_config *c = &b->m->cfg;
    if (!c->use_dcmha) return DCS_OK;
    dcs_layer_weights *w = &b->m->layers[l];
    const int64_t D = c->d_model, N = c->n_head;
    const int64_t C = c->dyn_slots, K = c->dyn_hidden, R = c->dyn_rank;
    const int64_t G = c->compose_groups, Mg = N / G;
    char nm[160];
    w->m_dw1 = dcs_load_keep(b, P("attention.dyn_w_proj.dw1"), nm, 4, D, G, C, K, &w->dw1);
    FAIL_IF(!w->m_dw1.p);
    w->qkw = dcs_load_as(b, P("attention.dyn_w_proj.qkw"), nm, 1, 5, G, C, K, 2 * R, Mg, NULL);
    FAIL_IF(!w->qkw);
    w->dd = dcs_load_as(b, P("attention.dyn_w_proj.dd"), nm, 1, 3, D, G, C * Mg, 0, 0, NULL);
    FAIL_IF(!w->dd);
    if (c->use_sw) {
        w->pre_sw = dcs_load_as(b, P("attention.dyn_w_proj.pre_proj.w"), nm, 1, 3, G, Mg, Mg, 0, 0, NULL);
        FAIL_IF(!w->pre_sw);
        w->post_sw = dcs_load_as(b, P("attention.dyn_w_proj.post_proj.w"), nm, 1, 3, G, Mg, Mg, 0, 0, NULL);
        FAIL_IF(!w->post_sw);
    }
    return DCS_OK;
}

/* The Mixture-of-Head router (moh), model-spec 5. */
static dcs_status load_moh(dcs_builder *b, int l) {
    const dcs_config *c = &b->m->cfg;
    if (!c->moh) return DCS_OK;
    dcs_layer_weights *w = &b->m->layers[l];
    const int64_t D = c->d_model, N = c->n_head, hs = c->moh_shared;
    char nm[160];
    w->moh_wg = dcs_load_as(b, P("attention.moh.wg.weight"), nm, 1, 2, N - hs, D, 0, 0, 0, NULL);
    FAIL_IF(!w->moh_wg);
    if (hs > 1) {
        w->moh_wg1 = dcs_load_as(b, P("attention.moh.wg_1.weight"), nm, 1, 2, hs, D, 0, 0, 0, NULL);
        FAIL_IF(!w->moh_wg1);
    }
    if (hs > 0) {
        w->moh_wg0 = dcs_load_as(b, P("attention.moh.wg_0.weight"), nm, 1, 2, 2, D, 0, 0, 0, NULL);
        FAIL_IF(!w->moh_wg0);
    }
    return DCS_OK;
}

/* The MLP: w1, w2 (and biases, with linear_bias); DCFormer++'s SwiGLU w3
 * and the group gate mg. */
static dcs_status load_mlp(dcs_builder *b, int l) {
    const dcs_config *c = &b->m->cfg;
    dcs_layer_weights *w = &b->m->layers[l];
    const int64_t D = c->d_model, F = c->d_ff;
    char nm[160];
    dcs_status s;
    if ((s = load_linear(b, l, "feed_forward.w1", F, D, &w->m_w1, &w->w1, &w->b1)) ||
        (s = load_linear(b, l, "feed_forward.w2", D, F, &w->m_w2, &w->w2, &w->b2)))
        return s;
    if (c->model_type == DCS_MODEL_DCFORMER) {
        KEEP2(w3, "feed_forward.w3.weight", F, D);
        if (c->mgate_dim > 0) LOAD2(mg, "feed_forward.mg.weight", 1, c->mgate_dim, D);
    }
    return DCS_OK;
}

#undef P
#undef LOAD1
#undef LOAD2
#undef KEEP2

/* Accepted and ignored: derived tensors that carry no new information,
 * and the weights of switches the config turns off (so a DCPythia
 * checkpoint loads as plain MHA with use_dcmha false). */
static void ignore_unneeded(dcs_model *m, int l) {
    static const char *ignored[] = {"dyn_w_proj.dw_m", "dyn_w_proj.qkw_m", "dyn_w_proj.sw",
                                    "dyn_w_proj.pre_proj.w", "dyn_w_proj.post_proj.w", "dyn_w_proj.dw1",
                                    "dyn_w_proj.qkw", "dyn_w_proj.dd", "q_norm.scale", "k_norm.scale",
                                    /* DCFormer's decoding caches, saved after setup_caches */
                                    "kv_cache.k_cache", "kv_cache.v_cache", "kv_cache.kw_cache",
                                    "kv_cache.kw_sub_cache"};
    char nm[160];
    for (size_t i = 0; i < sizeof ignored / sizeof ignored[0]; i++) {
        snprintf(nm, sizeof nm, "layers.%d.attention.%s", l, ignored[i]);
        dcs_tensor *t = dcs_tt_find(&m->tt, nm);
        if (t) t->used = 1;
    }
}

/* One dcpythia (or dcformer: RMSNorm weights only, SwiGLU) layer, its
 * weights registered in this order. */
static dcs_status load_dcpythia_layer(dcs_builder *b, int l) {
    dcs_status s;
    if ((s = load_norms(b, l)) || (s = load_qkv(b, l)) || (s = load_attn_out(b, l)) ||
        (s = load_dcmha(b, l)) || (s = load_moh(b, l)) || (s = load_mlp(b, l)))
        return s;
    ignore_unneeded(b->m, l);
    return DCS_OK;
}

/* The dynamic-weight dims C, K, R from layer 0's tensors. */
static dcs_status dcpythia_dyn_dims(dcs_builder *b) {
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

dcs_status dcs_load_dcpythia(dcs_builder *b) {
    dcs_load_names names = {"tok_embeddings.weight", "norm.weight", "norm.bias", "output.weight"};
    if (b->m->cfg.model_type == DCS_MODEL_DCFORMER) names.norm_b = NULL; /* DCFormer++'s final RMSNorm */
    dcs_status s = dcpythia_dyn_dims(b);
    return s ? s : dcs_load_stack(b, &names, load_dcpythia_layer);
}

void dcs_load_dcpythia_notes(dcs_model *m) {
    query_wise_note(m);
    if (m->cfg.model_type == DCS_MODEL_DCFORMER) dcformer_notes(m);
}
