/*
 * load_neox.c -- Pythia (gpt_neox) checkpoints mapped onto the canonical
 * (DCPythia) weight names, with the per-head-grouped query_key_value rows
 * reordered to q, k, v blocks (kept in their 16-bit dtype on the CPU). The
 * shared helpers: load_weights.c.
 */
#include "load.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static dcs_status load_neox_layer(dcs_builder *b, int l) {
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
        w->field = dcs_load_as(b, cn, S(stored), 1, nd, d0, d1, 0, 0, 0, NULL);                              \
        FAIL_IF(!w->field);                                                                                  \
    } while (0)
#define KEEP(field, canon, stored, d0, d1)                                                                   \
    do {                                                                                                     \
        C(canon);                                                                                            \
        w->m_##field = dcs_load_keep(b, cn, S(stored), 2, d0, d1, 0, 0, &w->field);                          \
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

    dcs_tensor *tw = dcs_load_take(b, S("attention.query_key_value.weight"), 1, 2, 3 * D, D);
    FAIL_IF(!tw);
    dcs_tensor *tb = dcs_load_take(b, S("attention.query_key_value.bias"), 1, 1, 3 * D);
    FAIL_IF(!tb);
    int64_t sw[2] = {3 * D, D}, sb[1] = {3 * D};
    if (m->device == DCS_DEVICE_CPU && tw->dtype != DCS_F32) {
        /* regrouped in the stored dtype, kept so */
        FAIL_IF(!dcs_load_half_finite(b, tw));
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
        w->m_wqkv =
            dcs_load_add_weight_keep(b, C("attention.wqkv.weight"), 2, sw, NULL, tw->dtype, rg, &w->wqkv);
        if (w->m_wqkv.p) w->bqkv = dcs_load_add_weight(b, C("attention.wqkv.bias"), 1, sb, NULL, hb + 3 * D);
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
    w->wqkv = dcs_load_add_weight(b, C("attention.wqkv.weight"), 2, sw, NULL, fused);
    if (w->wqkv) w->bqkv = dcs_load_add_weight(b, C("attention.wqkv.bias"), 1, sb, NULL, fused + 3 * D * D);
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

dcs_status dcs_load_neox(dcs_builder *b) {
    static const dcs_load_names names = {"gpt_neox.embed_in.weight", "gpt_neox.final_layer_norm.weight",
                                         "gpt_neox.final_layer_norm.bias", "embed_out.weight"};
    return dcs_load_stack(b, &names, load_neox_layer);
}
