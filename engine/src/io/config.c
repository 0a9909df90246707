/*
 * config.c -- config.json of a DCPythia or Pythia checkpoint into a
 * dcs_config (model-spec.md sections 2 and 3).
 *
 * Dimensions are required; switches take the published defaults when
 * absent (as Hugging Face's config classes do). Every value is type- and
 * range-checked, and a message names the file and the key.
 *
 * Null versus missing (docs/variants.md): Hugging Face passes a JSON null to
 * the config class as None, which overrides the default. So a missing key
 * takes the default, while null means what None means to the published
 * module: a switch read with `if config.x` is off, "window_size": null is
 * "no window" (every layer global), "window_type": null is the LG pattern,
 * "moh": null is no routing, "intermediate_size": null is 4 * dim; a number
 * the module computes with (norm_eps, rope_base, rotary_pct, ...) cannot be
 * None there, so null is refused with a message.
 */
#include "dcs_io.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

typedef struct {
    const cJSON *root;
    const char *path;
    dcs_err *e;
} cfg_reader;

/* Integer key in [lo, hi]; `required` or else *out = def. */
static dcs_status get_int(cfg_reader *r, const char *key, int required, int def, long lo, long hi, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(r->root, key);
    if (!v) {
        if (required) return dcs_seterr(r->e, DCS_ERR_CONFIG, "%s: missing required key '%s'", r->path, key);
        *out = def;
        return DCS_OK;
    }
    if (cJSON_IsNull(v))
        return dcs_seterr(r->e, DCS_ERR_CONFIG, "%s: '%s' is null; it must be an integer", r->path, key);
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
        return dcs_seterr(r->e, DCS_ERR_CONFIG, "%s: '%s' must be an integer", r->path, key);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return dcs_seterr(r->e, DCS_ERR_CONFIG, "%s: '%s' = %.15g is out of range [%ld, %ld]", r->path, key,
                          v->valuedouble, lo, hi);
    *out = (int)v->valuedouble;
    return DCS_OK;
}

static dcs_status get_float(cfg_reader *r, const char *key, double def, double lo, double hi, float *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(r->root, key);
    if (!v) {
        *out = (float)def;
        return DCS_OK;
    }
    if (cJSON_IsNull(v))
        return dcs_seterr(
            r->e, DCS_ERR_CONFIG,
            "%s: '%s' is null; it must be a number in [%g, %g] (leave the key out for the default %g)",
            r->path, key, lo, hi, def);
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= lo && v->valuedouble <= hi))
        return dcs_seterr(r->e, DCS_ERR_CONFIG, "%s: '%s' must be a number in [%g, %g]", r->path, key, lo,
                          hi);
    *out = (float)v->valuedouble;
    return DCS_OK;
}

/* A norm epsilon of 0 (or one that rounds to 0 in float32) divides 0 by 0
 * on a constant row: NaN logits. */
static dcs_status eps_positive(cfg_reader *r, const char *key, float eps) {
    if (!(eps > 0.0f))
        return dcs_seterr(r->e, DCS_ERR_CONFIG,
                          "%s: '%s' must be a number in (0, 1] "
                          "(0 gives NaN on constant rows; got %g)",
                          r->path, key, (double)eps);
    return DCS_OK;
}

/* A switch: missing -> def; null -> off (None is falsy where the published
 * modules test it). */
static dcs_status get_bool(cfg_reader *r, const char *key, int def, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(r->root, key);
    if (!v || cJSON_IsNull(v)) {
        *out = v ? 0 : def;
        return DCS_OK;
    }
    if (!cJSON_IsBool(v))
        return dcs_seterr(r->e, DCS_ERR_CONFIG, "%s: '%s' must be true or false", r->path, key);
    *out = cJSON_IsTrue(v);
    return DCS_OK;
}

static int is_null(cfg_reader *r, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(r->root, key);
    return v && cJSON_IsNull(v);
}

/* "moh": {"shared_heads": hs, "routed_topk": k} (model-spec.md 5); missing
 * or null: no routing. 0 <= hs < N, 1 <= k <= N - hs. */
static dcs_status parse_moh(cfg_reader *r, dcs_config *c) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(r->root, "moh");
    c->moh = 0;
    if (!v || cJSON_IsNull(v)) return DCS_OK;
    if (!cJSON_IsObject(v))
        return dcs_seterr(r->e, DCS_ERR_CONFIG,
                          "%s: 'moh' must be null or an object {\"shared_heads\": hs, \"routed_topk\": k}",
                          r->path);
    cfg_reader sub = {v, r->path, r->e};
    dcs_status s;
    if ((s = get_int(&sub, "shared_heads", 1, 0, 0, c->n_head - 1, &c->moh_shared)) ||
        (s = get_int(&sub, "routed_topk", 1, 0, 1, c->n_head - c->moh_shared, &c->moh_topk))) {
        char msg[sizeof r->e->msg];
        snprintf(msg, sizeof msg, "%s", r->e->msg);
        return dcs_seterr(r->e, s, "%s (in 'moh', n_head %d)", msg, c->n_head);
    }
    c->moh = 1;
    return DCS_OK;
}

/* Local/global pattern from window_type: null = "LG"; 1 = local. */
static dcs_status window_pattern(cfg_reader *r, int *pat, int *len) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(r->root, "window_type");
    const char *name = "LG";
    if (v && !cJSON_IsNull(v)) {
        if (!cJSON_IsString(v))
            return dcs_seterr(r->e, DCS_ERR_CONFIG, "%s: 'window_type' must be null or a string", r->path);
        name = v->valuestring;
    }
    static const struct {
        const char *name;
        const char *lg;
    } known[] = {{"LG", "LG"}, {"LGLL", "LGLL"}, {"LGL6", "LGLLLLLL"}, {"G", "G"}};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        if (strcmp(name, known[i].name) == 0) {
            *len = (int)strlen(known[i].lg);
            for (int j = 0; j < *len; j++) pat[j] = known[i].lg[j] == 'L';
            return DCS_OK;
        }
    }
    return dcs_seterr(r->e, DCS_ERR_CONFIG,
                      "%s: unknown window_type '%s' (expected null, \"LG\", \"LGLL\", \"LGL6\" or \"G\")",
                      r->path, name);
}

static dcs_status parse_dcpythia(cfg_reader *r, dcs_config *c, int *pat, int *plen) {
    dcs_status s;
    c->model_type = DCS_MODEL_DCPYTHIA;
    if ((s = get_int(r, "dim", 1, 0, 1, 1 << 16, &c->d_model))) return s;
    if ((s = get_int(r, "n_head", 1, 0, 1, 4096, &c->n_head))) return s;
    if ((s = get_int(r, "n_layer", 1, 0, 1, 1024, &c->n_layer))) return s;
    /* DCPythiaConfig: intermediate_size None (missing or null) = 4 * dim */
    if (is_null(r, "intermediate_size") || !cJSON_GetObjectItemCaseSensitive(r->root, "intermediate_size"))
        c->d_ff = 4 * c->d_model;
    else if ((s = get_int(r, "intermediate_size", 1, 0, 1, 1 << 20, &c->d_ff)))
        return s;
    if ((s = get_int(r, "vocab_size", 1, 0, 1, 1 << 24, &c->vocab))) return s;
    /* n_local_heads (grouped-query K/V heads): -1 or n_head only */
    int kv = -1;
    if ((s = get_int(r, "n_local_heads", 0, -1, -1, 4096, &kv))) return s;
    if (kv != -1 && kv != c->n_head && c->d_model % c->n_head == 0) /* else: not divisible, below */
        return dcs_seterr(
            r->e, DCS_ERR_UNSUPPORTED,
            "%s: n_local_heads %d differs from n_head %d (grouped-query attention is not supported)", r->path,
            kv, c->n_head);
    float pct;
    if ((s = get_float(r, "norm_eps", 1e-5, 0.0, 1.0, &c->norm_eps))) return s;
    if ((s = eps_positive(r, "norm_eps", c->norm_eps))) return s;
    if ((s = get_float(r, "rope_base", 10000.0, 1e-6, 1e30, &c->rope_base))) return s;
    if ((s = get_float(r, "rotary_pct", 0.25, 0.0, 1.0, &pct))) return s;
    /* defaults of DCPythiaConfig (use_qk_norm defaults to False there) */
    if ((s = get_bool(r, "use_qk_norm", 0, &c->qk_norm))) return s;
    if ((s = get_bool(r, "use_parallel_residual", 1, &c->parallel_residual))) return s;
    if ((s = get_bool(r, "use_linear_bias", 1, &c->linear_bias))) return s;
    if ((s = get_bool(r, "query_wise", 0, &c->query_wise))) return s;
    if ((s = get_bool(r, "key_wise", 0, &c->key_wise))) return s;
    if (c->query_wise && c->key_wise)
        return dcs_seterr(r->e, DCS_ERR_CONFIG,
                          "%s: query_wise and key_wise are both true (at most one side may be dropped)",
                          r->path);
    if ((s = get_bool(r, "use_dcmha", 1, &c->use_dcmha))) return s;
    if ((s = get_bool(r, "tie_word_embeddings", 0, &c->tie_embeddings))) return s;
    /* "window_size": null = no window, every layer global (the published
     * module reads it so); missing = 256 */
    if (is_null(r, "window_size"))
        c->window_size = 0;
    else if ((s = get_int(r, "window_size", 0, 256, 1, 1 << 30, &c->window_size)))
        return s;
    if ((s = window_pattern(r, pat, plen))) return s;
    if ((s = get_bool(r, "use_sw", 0, &c->use_sw))) return s;
    /* grouped composition: missing or null = 1 group (all heads) */
    c->compose_groups = 1;
    if (!is_null(r, "compose_groups") &&
        (s = get_int(r, "compose_groups", 0, 1, 1, 4096, &c->compose_groups)))
        return s;
    if (c->n_head % c->compose_groups != 0)
        return dcs_seterr(r->e, DCS_ERR_CONFIG, "%s: compose_groups %d does not divide n_head %d", r->path,
                          c->compose_groups, c->n_head);
    if ((s = parse_moh(r, c))) return s;
    c->rotary_dim = (int)(pct * (float)(c->d_model / c->n_head));
    return DCS_OK;
}

static dcs_status parse_gpt_neox(cfg_reader *r, dcs_config *c, int *pat, int *plen) {
    dcs_status s;
    c->model_type = DCS_MODEL_GPT_NEOX;
    if ((s = get_int(r, "hidden_size", 1, 0, 1, 1 << 16, &c->d_model))) return s;
    if ((s = get_int(r, "num_attention_heads", 1, 0, 1, 4096, &c->n_head))) return s;
    if ((s = get_int(r, "num_hidden_layers", 1, 0, 1, 1024, &c->n_layer))) return s;
    if ((s = get_int(r, "intermediate_size", 1, 0, 1, 1 << 20, &c->d_ff))) return s;
    if ((s = get_int(r, "vocab_size", 1, 0, 1, 1 << 24, &c->vocab))) return s;
    float pct;
    if ((s = get_float(r, "rotary_pct", 0.25, 0.0, 1.0, &pct))) return s;
    if ((s = get_float(r, "rotary_emb_base", 10000.0, 1e-6, 1e30, &c->rope_base))) return s;
    if ((s = get_float(r, "layer_norm_eps", 1e-5, 0.0, 1.0, &c->norm_eps))) return s;
    if ((s = eps_positive(r, "layer_norm_eps", c->norm_eps))) return s;
    if ((s = get_bool(r, "use_parallel_residual", 1, &c->parallel_residual))) return s;
    if ((s = get_bool(r, "tie_word_embeddings", 0, &c->tie_embeddings))) return s;
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(r->root, "hidden_act");
    if (act && !(cJSON_IsString(act) && strcmp(act->valuestring, "gelu") == 0))
        return dcs_seterr(r->e, DCS_ERR_UNSUPPORTED,
                          "%s: hidden_act %s%s%s is not supported (only \"gelu\", the exact erf form)",
                          r->path, cJSON_IsString(act) ? "\"" : "",
                          cJSON_IsString(act) ? act->valuestring : "(not a string)",
                          cJSON_IsString(act) ? "\"" : "");
    c->linear_bias = 1;
    c->qk_norm = 0;
    c->use_dcmha = 0;
    c->window_size = 0;
    *plen = 1;
    pat[0] = 0;
    c->rotary_dim = (int)(pct * (float)(c->d_model / c->n_head));
    return DCS_OK;
}

dcs_status dcs_parse_config(const char *json_text, const char *path, dcs_config *cfg, int *pat, int *plen,
                            dcs_err *e) {
    memset(cfg, 0, sizeof *cfg);
    const char *end = NULL;
    if ((unsigned char)json_text[0] == 0xEF && (unsigned char)json_text[1] == 0xBB &&
        (unsigned char)json_text[2] == 0xBF)
        return dcs_seterr(e, DCS_ERR_CONFIG,
                          "%s: starts with a UTF-8 byte-order mark (BOM); "
                          "save it as plain UTF-8 JSON without one",
                          path);
    if (dcs_json_check_text(json_text, strlen(json_text), path, e) != DCS_OK) {
        if (e) e->code = DCS_ERR_CONFIG; /* a config error, like any other */
        return DCS_ERR_CONFIG;
    }
    cJSON *root = cJSON_ParseWithOpts(json_text, &end, 0);
    if (!root)
        return dcs_seterr(e, DCS_ERR_CONFIG, "%s: not valid JSON (at byte %ld)", path,
                          end ? (long)(end - json_text) : -1L);
    dcs_status s;
    if (dcs_json_unique_keys(root, path, e) != DCS_OK) {
        cJSON_Delete(root);
        if (e) e->code = DCS_ERR_CONFIG;
        return DCS_ERR_CONFIG;
    }
    cfg_reader r = {root, path, e};
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!cJSON_IsObject(root)) {
        s = dcs_seterr(e, DCS_ERR_CONFIG, "%s: the top level must be a JSON object", path);
    } else if (!mt) {
        s = dcs_seterr(e, DCS_ERR_CONFIG, "%s: missing required key 'model_type'", path);
    } else if (!cJSON_IsString(mt)) {
        s = dcs_seterr(e, DCS_ERR_CONFIG, "%s: 'model_type' must be a string", path);
    } else if (strcmp(mt->valuestring, "dcpythia") == 0) {
        s = parse_dcpythia(&r, cfg, pat, plen);
    } else if (strcmp(mt->valuestring, "gpt_neox") == 0) {
        s = parse_gpt_neox(&r, cfg, pat, plen);
    } else {
        s = dcs_seterr(e, DCS_ERR_CONFIG,
                       "%s: unknown model_type '%.64s' (dclens knows 'dcpythia' and 'gpt_neox')", path,
                       mt->valuestring);
    }
    if (s == DCS_OK && cfg->d_model % cfg->n_head != 0)
        s = dcs_seterr(e, DCS_ERR_CONFIG, "%s: dim %d is not divisible by n_head %d", path, cfg->d_model,
                       cfg->n_head);
    if (s == DCS_OK) {
        cfg->head_dim = cfg->d_model / cfg->n_head;
        cfg->rotary_dim &= ~1; /* rotate-half needs an even count */
    }
    cJSON_Delete(root);
    return s;
}
