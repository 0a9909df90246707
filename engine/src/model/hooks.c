/*
 * hooks.c -- hook point names, which exist for a model, their shapes, and
 * parsing "blocks.{l}.<point>" names (shared/docs/hooks.md).
 */
#include "dcs_model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { SH_TD, SH_TNDh, SH_TRN, SH_TN, SH_NTS, SH_TND, SH_TF, SH_TV, SH_TNR, SH_TE } shape_kind;

/* An [N, T, S] attention map before the softmax (a write to a masked pair is
 * overridden by the mask) or after it (masked pairs are zeroed again after a
 * write); MAP_NO: not a map. */
typedef enum { MAP_NO, MAP_PRE, MAP_POST } map_kind;

/* Everything the engine knows of a point, in one table: its name, whether
 * it is per layer, its layout, which models have it, whether it is an
 * attention map, and the function that computes it and calls its hook
 * (file and name, under engine/src/model; scripts/gen_hook_reference.py
 * writes docs/hooks.md from this table, and tests/api/test_docs.py checks
 * that each function names the point or the table it fires it from). */
typedef struct {
    const char *name;
    int layered;
    shape_kind shape;
    int needs; /* 0 always, 1 DCMHA, 2 DCMHA without query_wise,
                        3 DCMHA with use_sw, 4 MoH routing,
                        5 DCMHA without key_wise (query-side points),
                        6 a gated (SwiGLU) MLP, 7 its group gate (mgate) */
    map_kind map;
    const char *where;
} point_info;

/* The layouts of shape_kind, as docs/hooks.md writes them */
static const char *const LAYOUTS[] = {
    [SH_TD] = "[T, D]",       [SH_TNDh] = "[T, N, Dh]", [SH_TRN] = "[T|S, R, N]", [SH_TN] = "[T|S, N]",
    [SH_NTS] = "[N, T, S]",   [SH_TND] = "[T, N, D]",   [SH_TF] = "[T, F]",       [SH_TV] = "[T, V]",
    [SH_TNR] = "[T, N - hs]", [SH_TE] = "[T, E]",
};

static const point_info POINTS[DCS_HP_COUNT] = {
    [DCS_HP_EMBED] = {"embed", 0, SH_TD, 0, MAP_NO, "pass.c dcs_pass_embed"},
    [DCS_HP_RESID_PRE] = {"resid_pre", 1, SH_TD, 0, MAP_NO, "layer.c dcs_layer"},
    [DCS_HP_LN_ATTN] = {"ln_attn", 1, SH_TD, 0, MAP_NO, "layer.c dcs_layer"},
    [DCS_HP_Q_INPUT] = {"attn.q_input", 1, SH_TND, 0, MAP_NO, "layer.c split_input"},
    [DCS_HP_K_INPUT] = {"attn.k_input", 1, SH_TND, 0, MAP_NO, "layer.c split_input"},
    [DCS_HP_V_INPUT] = {"attn.v_input", 1, SH_TND, 0, MAP_NO, "layer.c split_input"},
    [DCS_HP_Q] = {"attn.q", 1, SH_TNDh, 0, MAP_NO, "layer.c attention"},
    [DCS_HP_K] = {"attn.k", 1, SH_TNDh, 0, MAP_NO, "layer.c attention"},
    [DCS_HP_V] = {"attn.v", 1, SH_TNDh, 0, MAP_NO, "layer.c attention"},
    [DCS_HP_DYN_INPUT] = {"attn.dyn_input", 1, SH_TD, 1, MAP_NO, "layer.c attention"},
    [DCS_HP_DYN_PRE_QW1] = {"attn.dyn.pre.qw1", 1, SH_TRN, 5, MAP_NO, "layer.c dynamic_weights"},
    [DCS_HP_DYN_PRE_QW2] = {"attn.dyn.pre.qw2", 1, SH_TRN, 5, MAP_NO, "layer.c dynamic_weights"},
    [DCS_HP_DYN_PRE_KW1] = {"attn.dyn.pre.kw1", 1, SH_TRN, 2, MAP_NO, "layer.c dynamic_weights"},
    [DCS_HP_DYN_PRE_KW2] = {"attn.dyn.pre.kw2", 1, SH_TRN, 2, MAP_NO, "layer.c dynamic_weights"},
    [DCS_HP_DYN_PRE_QDD] = {"attn.dyn.pre.qdd", 1, SH_TN, 5, MAP_NO, "layer.c dynamic_weights"},
    [DCS_HP_DYN_PRE_KDD] = {"attn.dyn.pre.kdd", 1, SH_TN, 2, MAP_NO, "layer.c dynamic_weights"},
    [DCS_HP_DYN_POST_QW1] = {"attn.dyn.post.qw1", 1, SH_TRN, 5, MAP_NO, "layer.c dynamic_weights"},
    [DCS_HP_DYN_POST_QW2] = {"attn.dyn.post.qw2", 1, SH_TRN, 5, MAP_NO, "layer.c dynamic_weights"},
    [DCS_HP_DYN_POST_KW1] = {"attn.dyn.post.kw1", 1, SH_TRN, 2, MAP_NO, "layer.c dynamic_weights"},
    [DCS_HP_DYN_POST_KW2] = {"attn.dyn.post.kw2", 1, SH_TRN, 2, MAP_NO, "layer.c dynamic_weights"},
    [DCS_HP_DYN_POST_QDD] = {"attn.dyn.post.qdd", 1, SH_TN, 5, MAP_NO, "layer.c dynamic_weights"},
    [DCS_HP_DYN_POST_KDD] = {"attn.dyn.post.kdd", 1, SH_TN, 2, MAP_NO, "layer.c dynamic_weights"},
    [DCS_HP_SCORES] = {"attn.scores", 1, SH_NTS, 0, MAP_PRE, "attention.c attention_maps"},
    [DCS_HP_PRE_SKIP] = {"attn.pre.skip", 1, SH_NTS, 1, MAP_PRE, "attention.c compose"},
    [DCS_HP_PRE_QP] = {"attn.pre.qp", 1, SH_NTS, 5, MAP_PRE, "attention.c compose"},
    [DCS_HP_PRE_KP] = {"attn.pre.kp", 1, SH_NTS, 2, MAP_PRE, "attention.c compose"},
    [DCS_HP_PRE_QG] = {"attn.pre.qg", 1, SH_NTS, 5, MAP_PRE, "attention.c compose"},
    [DCS_HP_PRE_KG] = {"attn.pre.kg", 1, SH_NTS, 2, MAP_PRE, "attention.c compose"},
    [DCS_HP_PRE_STATIC] = {"attn.pre.static", 1, SH_NTS, 3, MAP_PRE, "attention.c compose"},
    [DCS_HP_SCORES_COMPOSED] = {"attn.scores_composed", 1, SH_NTS, 1, MAP_PRE, "attention.c attention_maps"},
    [DCS_HP_PATTERN] = {"attn.pattern", 1, SH_NTS, 0, MAP_POST, "attention.c attention_maps"},
    [DCS_HP_POST_SKIP] = {"attn.post.skip", 1, SH_NTS, 1, MAP_POST, "attention.c compose"},
    [DCS_HP_POST_QP] = {"attn.post.qp", 1, SH_NTS, 5, MAP_POST, "attention.c compose"},
    [DCS_HP_POST_KP] = {"attn.post.kp", 1, SH_NTS, 2, MAP_POST, "attention.c compose"},
    [DCS_HP_POST_QG] = {"attn.post.qg", 1, SH_NTS, 5, MAP_POST, "attention.c compose"},
    [DCS_HP_POST_KG] = {"attn.post.kg", 1, SH_NTS, 2, MAP_POST, "attention.c compose"},
    [DCS_HP_POST_STATIC] = {"attn.post.static", 1, SH_NTS, 3, MAP_POST, "attention.c compose"},
    [DCS_HP_PATTERN_COMPOSED] = {"attn.pattern_composed", 1, SH_NTS, 1, MAP_POST,
                                 "attention.c attention_maps"},
    [DCS_HP_ROUTER_LOGITS] = {"attn.router_logits", 1, SH_TNR, 4, MAP_NO, "layer.c moh_gate"},
    [DCS_HP_ROUTING] = {"attn.routing", 1, SH_TN, 4, MAP_NO, "layer.c moh_gate"},
    [DCS_HP_Z] = {"attn.z", 1, SH_TNDh, 0, MAP_NO, "layer.c attention_out"},
    [DCS_HP_HEAD_OUT] = {"attn.head_out", 1, SH_TND, 0, MAP_NO, "layer.c attention_out"},
    [DCS_HP_ATTN_OUT] = {"attn.out", 1, SH_TD, 0, MAP_NO, "layer.c attention_out"},
    [DCS_HP_MLP_INPUT] = {"mlp_input", 1, SH_TD, 0, MAP_NO, "layer.c mlp_norm"},
    [DCS_HP_LN_MLP] = {"ln_mlp", 1, SH_TD, 0, MAP_NO, "layer.c dcs_layer"},
    [DCS_HP_MLP_PRE] = {"mlp.pre", 1, SH_TF, 0, MAP_NO, "layer.c mlp"},
    [DCS_HP_MLP_POST] = {"mlp.post", 1, SH_TF, 0, MAP_NO, "layer.c mlp"},
    [DCS_HP_MLP_OUT] = {"mlp.out", 1, SH_TD, 0, MAP_NO, "layer.c mlp"},
    [DCS_HP_RESID_POST] = {"resid_post", 1, SH_TD, 0, MAP_NO, "layer.c dcs_layer"},
    [DCS_HP_LN_FINAL] = {"ln_final", 0, SH_TD, 0, MAP_NO, "layer.c dcs_pass_final"},
    [DCS_HP_LOGITS] = {"logits", 0, SH_TV, 0, MAP_NO, "layer.c dcs_pass_final"},
    [DCS_HP_MLP_PRE_LINEAR] = {"mlp.pre_linear", 1, SH_TF, 6, MAP_NO, "layer.c mlp"},
    [DCS_HP_MLP_GATE] = {"mlp.gate", 1, SH_TE, 7, MAP_NO, "layer.c mlp_group_gate"},
};

const char *dcs_hook_point_name(int p) { return p >= 0 && p < DCS_HP_COUNT ? POINTS[p].name : NULL; }
int dcs_hook_point_is_layered(int p) { return p >= 0 && p < DCS_HP_COUNT && POINTS[p].layered; }
const char *dcs_hook_point_layout(int p) {
    return p >= 0 && p < DCS_HP_COUNT ? LAYOUTS[POINTS[p].shape] : NULL;
}
const char *dcs_hook_point_source(int p) { return p >= 0 && p < DCS_HP_COUNT ? POINTS[p].where : NULL; }
int dcs_hook_point_map(int p) { return p >= 0 && p < DCS_HP_COUNT ? (int)POINTS[p].map : 0; }
int dcs_hook_point_needs(int p) { return p >= 0 && p < DCS_HP_COUNT ? POINTS[p].needs : -1; }

int dcs_hook_exists(const dcs_model *m, int p) {
    if (p < 0 || p >= DCS_HP_COUNT) return 0;
    switch (POINTS[p].needs) {
    case 1: return m->cfg.use_dcmha;
    case 2: return m->cfg.use_dcmha && !m->cfg.query_wise;
    case 3: return m->cfg.use_dcmha && m->cfg.use_sw;
    case 4: return m->cfg.moh;
    case 5: return m->cfg.use_dcmha && !m->cfg.key_wise;
    case 6: return m->cfg.model_type == DCS_MODEL_DCFORMER;
    case 7: return m->cfg.model_type == DCS_MODEL_DCFORMER && m->cfg.mgate_dim > 0;
    default: return 1;
    }
}

int dcs_hook_shape(const dcs_model *m, int p, int B, int T, int64_t sh[6]) {
    if (p < 0 || p >= DCS_HP_COUNT) return 0;
    const dcs_config *c = &m->cfg;
    sh[0] = B;
    switch (POINTS[p].shape) {
    case SH_TD:
        sh[1] = T;
        sh[2] = c->d_model;
        return 3;
    case SH_TNDh:
        sh[1] = T;
        sh[2] = c->n_head;
        sh[3] = c->head_dim;
        return 4;
    case SH_TRN:
        sh[1] = T;
        sh[2] = c->dyn_rank;
        sh[3] = c->n_head;
        return 4;
    case SH_TN:
        sh[1] = T;
        sh[2] = c->n_head;
        return 3;
    case SH_NTS:
        sh[1] = c->n_head;
        sh[2] = T;
        sh[3] = T;
        return 4;
    case SH_TND:
        sh[1] = T;
        sh[2] = c->n_head;
        sh[3] = c->d_model;
        return 4;
    case SH_TF:
        sh[1] = T;
        sh[2] = c->d_ff;
        return 3;
    case SH_TV:
        sh[1] = T;
        sh[2] = c->vocab;
        return 3;
    case SH_TNR:
        sh[1] = T;
        sh[2] = c->n_head - c->moh_shared;
        return 3;
    case SH_TE:
        sh[1] = T;
        sh[2] = c->mgate_dim;
        return 3;
    }
    return 0;
}

static int find_point(const char *suffix, int layered) {
    for (int p = 0; p < DCS_HP_COUNT; p++)
        if (POINTS[p].layered == layered && strcmp(POINTS[p].name, suffix) == 0) return p;
    return -1;
}

dcs_status dcs_hook_parse(dcs_model *m, const char *name, int *point, int *layer) {
    if (!name) return dcs_seterr(&m->err, DCS_ERR_ARG, "hook name is NULL");
    int p = -1, l = 0;
    if (strncmp(name, "blocks.", 7) == 0) {
        const char *s = name + 7;
        char *end;
        if (*s < '0' || *s > '9')
            return dcs_seterr(&m->err, DCS_ERR_ARG, "unknown hook '%.200s': expected blocks.<layer>.<point>",
                              name);
        long v = strtol(s, &end, 10);
        if (*end != '.')
            return dcs_seterr(&m->err, DCS_ERR_ARG, "unknown hook '%.200s': expected blocks.<layer>.<point>",
                              name);
        if (v < 0 || v >= m->cfg.n_layer)
            return dcs_seterr(&m->err, DCS_ERR_ARG,
                              "hook '%.200s': layer %ld is out of range (model has %d layers)", name, v,
                              m->cfg.n_layer);
        l = (int)v;
        p = find_point(end + 1, 1);
    } else {
        p = find_point(name, 0);
    }
    if (p < 0) return dcs_seterr(&m->err, DCS_ERR_ARG, "unknown hook '%.200s'", name);
    if (!dcs_hook_exists(m, p)) {
        const char *why = "query_wise: no key-wise branches";
        if (POINTS[p].needs == 4)
            why = "no Mixture-of-Head routing ('moh' is not in the config)";
        else if (POINTS[p].needs == 6)
            why = "the MLP is not gated (SwiGLU MLPs are dcformer's)";
        else if (POINTS[p].needs == 7)
            why = "no MLP group gate ('mgate' is off)";
        else if (POINTS[p].needs == 5 && m->cfg.use_dcmha)
            why = "key_wise: no query-wise branches";
        else if (!m->cfg.use_dcmha)
            why = "no DCMHA composition: plain multi-head attention";
        else if (POINTS[p].needs == 3)
            why = "no static composition branch (use_sw is off)";
        return dcs_seterr(&m->err, DCS_ERR_ARG, "hook '%.200s' does not exist in this model (%s)", name, why);
    }
    *point = p;
    *layer = l;
    return DCS_OK;
}

void dcs_set_hook_error(dcs_model *m, const char *msg) {
    dcs_seterr(&m->err, DCS_ERR_HOOK, "%s", msg ? msg : "hook aborted the forward pass");
}

/* The write rule of hooks.md: after a hook wrote a post-softmax attention
 * map (pattern, post.*, pattern_composed), its masked cells are zero again,
 * so a write there is ignored, as it is for the pre-softmax maps (the mask
 * overrides them). x [BN, T, S], query i at position t0 + i, key j at j. */
void dcs_mask_map(float *x, long long BN, int T, int S, int t0, int window) {
    for (long long r = 0; r < BN; r++)
        for (int i = 0; i < T; i++) {
            float *row = x + ((size_t)r * T + i) * S;
            for (int j = 0; j < S; j++)
                if (!(j <= t0 + i && (window <= 0 || t0 + i - j <= window))) row[j] = 0.0f;
        }
}

int dcs_hook_is_post_softmax_map(int point) { return dcs_hook_point_map(point) == MAP_POST; }
