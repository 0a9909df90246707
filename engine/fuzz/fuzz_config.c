/*
 * fuzz_config.c -- libFuzzer target for config.json handling (dcs_parse_config).
 *
 * The input is the whole config.json. As dcs_load does, it is copied into a
 * NUL-terminated buffer and refused if it holds a NUL byte. Whatever the
 * parser accepts must be sane: a known model type, every dimension inside
 * the range the loader checks, head_dim * n_head == d_model, an even rotary
 * dim no larger than head_dim, finite floats, a local/global pattern of
 * 1..8 entries that are 0 or 1, composition groups dividing n_head, and MoH
 * sizes with 0 <= shared < n_head, 1 <= top-k <= n_head - shared. A refused config must name the file.
 * Build and run with engine/fuzz/run.sh.
 */
#include "dcs_io.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define PATH "fuzz/config.json"

static void check_config(const dcs_config *c, const int *pat, int plen) {
    if (c->model_type != DCS_MODEL_DCPYTHIA && c->model_type != DCS_MODEL_GPT_NEOX) abort();
    if (c->d_model < 1 || c->d_model > (1 << 16) || c->n_head < 1 || c->n_head > 4096 || c->n_layer < 1 ||
        c->n_layer > 1024 || c->d_ff < 1 || c->d_ff > (1 << 20) || c->vocab < 1 || c->vocab > (1 << 24))
        abort();
    if (c->head_dim < 1 || c->head_dim * c->n_head != c->d_model) abort();
    if (c->rotary_dim < 0 || c->rotary_dim > c->head_dim || (c->rotary_dim & 1)) abort();
    if (!isfinite(c->rope_base) || !(c->rope_base > 0) || !isfinite(c->norm_eps) || !(c->norm_eps > 0) ||
        c->norm_eps > 1)
        abort();
    int flags[] = {c->parallel_residual, c->qk_norm, c->linear_bias, c->use_dcmha, c->query_wise,
                   c->tie_embeddings,    c->use_sw,  c->key_wise,    c->moh};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        if (flags[i] != 0 && flags[i] != 1) abort();
    if (c->query_wise && c->key_wise) abort();
    /* window_size 0: "window_size": null, no local layer */
    if (c->window_size < 0) abort();
    if (c->model_type == DCS_MODEL_DCPYTHIA && (c->compose_groups < 1 || c->n_head % c->compose_groups != 0))
        abort();
    if (c->moh && (c->moh_shared < 0 || c->moh_shared >= c->n_head || c->moh_topk < 1 ||
                   c->moh_topk > c->n_head - c->moh_shared))
        abort();
    if (plen < 1 || plen > 8) abort();
    for (int i = 0; i < plen; i++)
        if (pat[i] != 0 && pat[i] != 1) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (memchr(data, '\0', size) != NULL) return 0; /* dcs_load refuses these before parsing */
    char *text = malloc(size + 1);
    if (text == NULL) abort();
    memcpy(text, data, size);
    text[size] = '\0';
    dcs_config cfg;
    int pat[16], plen = -1;
    dcs_err e;
    memset(&e, 0, sizeof e);
    dcs_status s = dcs_parse_config(text, PATH, &cfg, pat, &plen, &e);
    if (s == DCS_OK)
        check_config(&cfg, pat, plen);
    else if ((s != DCS_ERR_CONFIG && s != DCS_ERR_UNSUPPORTED) || e.code != s || strstr(e.msg, PATH) == NULL)
        abort(); /* errors are config errors naming the file */
    free(text);
    return 0;
}
