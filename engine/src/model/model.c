/*
 * model.c -- a loaded model's life after dcs_load (load_model.c): freeing
 * it, reading its weights by name, the per-layer facts the graph asks
 * (local window, the layer plan), cancelling a pass, and the pool of
 * activation buffers the forward pass, decoder and tape reuse between
 * passes. Everything of the model layer calls down to here; this file calls
 * nothing of the model layer.
 */
#include "dcs_model.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- lifecycle */

/* A model with live decoders (decode.c) or tapes (tape.c) is only marked:
 * the last of them to go frees it, so they may be freed in any order (a
 * garbage collector's). */
void dcs_free(dcs_model *m) {
    if (!m) return;
    if (m->n_decoders > 0 || m->n_tapes > 0) {
        m->freed = 1;
        return;
    }
    dcs_model_destroy(m);
}

void dcs_model_destroy(dcs_model *m) {
    if (m->be) {
        dcs_pool_clear(m);
        for (int i = 0; i < m->n_weights; i++) {
            if (m->weights[i].owned) m->be->ops->free(m->be, m->weights[i].ptr);
            if (m->weights[i].half_dev) m->be->ops->free(m->be, (void *)(uintptr_t)m->weights[i].half);
        }
        m->be->ops->destroy(m->be);
    }
    for (int i = 0; i < m->n_weights; i++)
        if (m->weights[i].half_owned && !m->weights[i].half_dev) free((void *)(uintptr_t)m->weights[i].half);
    free(m->weights);
    free(m->layers);
    free(m->plan);
    dcs_tt_free(&m->tt);
    free(m->dir);
    free(m);
}

const dcs_config *dcs_model_config(const dcs_model *m) { return &m->cfg; }
const char *dcs_errmsg(const dcs_model *m) { return m ? m->err.msg : "no model"; }
int dcs_model_device(const dcs_model *m) { return m->device; }
int dcs_model_weight_dtype(const dcs_model *m) {
    return !m ? -1 : m->kept_dtype < 0 ? DCS_F32 : m->kept_dtype;
}
const char *dcs_load_warnings(const dcs_model *m) { return m ? m->warnings : ""; }

dcs_status dcs_model_set_attention_rows(dcs_model *m, int rows) {
    if (!m) return DCS_ERR_ARG;
    if (rows < -1)
        return dcs_seterr(&m->err, DCS_ERR_ARG,
                          "attention_rows: %d is not a row count (> 0), 0 (auto) or -1 (full)", rows);
    m->attn_rows = rows;
    return DCS_OK;
}
int dcs_model_attention_rows(const dcs_model *m) { return m ? m->attn_rows : -2; }

dcs_status dcs_model_map_params(dcs_model *m, dcs_err *e) {
    static const char *const suffix[DCS_LP_COUNT] = {
#define DCS_LP_NAME(field, name) name,
        DCS_LAYER_PARAMS(DCS_LP_NAME)
#undef DCS_LP_NAME
    };
    for (int i = 0; i < m->n_weights; i++) {
        dcs_named_weight *w = &m->weights[i];
        int l, n = 0;
        w->layer = w->field = -1;
        if (sscanf(w->name, "layers.%d.%n", &l, &n) != 1 || n == 0) continue;
        for (int f = 0; f < DCS_LP_COUNT; f++)
            if (!strcmp(w->name + n, suffix[f])) {
                w->layer = l;
                w->field = f;
            }
        if (w->field < 0 || l < 0 || l >= m->cfg.n_layer)
            return dcs_seterr(e, DCS_ERR_TENSOR,
                              "%s: a layer weight dcs_model.h's DCS_LAYER_PARAMS does not list", w->name);
    }
    return DCS_OK;
}

const dcs_layer_plan *dcs_layer_plan_of(const dcs_model *m, int layer) {
    return m && m->plan && layer >= 0 && layer < m->cfg.n_layer ? &m->plan[layer] : NULL;
}

int dcs_layer_is_local(const dcs_model *m, int layer) {
    return layer >= 0 && layer < m->cfg.n_layer && m->cfg.window_size > 0 ? m->local[layer] : 0;
}

int dcs_cuda_available(char *why, size_t whylen) {
    return dcs_cuda_probe(why, whylen); /* loads the CUDA plugin (cuda_plugin.c) */
}

int64_t dcs_cpu_partition(int op, const int *shape, int n_shape, int64_t *cost, int64_t cap) {
    return dcs_cpu_items(op, shape, n_shape, cost, cap); /* the rule itself is cpu.c's */
}

const char *dcs_blas_core(void) { return dcs_cpu_blas_core(); }
const char *dcs_blas_library(void) { return dcs_cpu_blas_library(); }
const char *dcs_blas_config(void) { return dcs_cpu_blas_config(); }

/* ---------------------------------------------------------------- weights */

static const dcs_named_weight *find_weight(dcs_model *m, const char *name) {
    if (!name) {
        dcs_seterr(&m->err, DCS_ERR_ARG, "weight name is NULL");
        return NULL;
    }
    for (int i = 0; i < m->n_weights; i++)
        if (strcmp(m->weights[i].name, name) == 0) return &m->weights[i];
    dcs_seterr(&m->err, DCS_ERR_ARG, "%s: no weight named '%.200s'", m->dir, name);
    return NULL;
}

dcs_status dcs_weight_shape(dcs_model *m, const char *name, int64_t shape[5], int *ndim) {
    const dcs_named_weight *w = find_weight(m, name);
    if (!w) return DCS_ERR_ARG;
    *ndim = w->ndim;
    for (int i = 0; i < w->ndim; i++) shape[i] = w->shape[i];
    return DCS_OK;
}

dcs_status dcs_weight_read(dcs_model *m, const char *name, float *out, size_t n_floats) {
    const dcs_named_weight *w = find_weight(m, name);
    if (!w) return DCS_ERR_ARG;
    size_t n = 1;
    for (int i = 0; i < w->ndim; i++) n *= (size_t)w->shape[i];
    if (n != n_floats || !out)
        return dcs_seterr(&m->err, DCS_ERR_ARG, "weight '%.200s' has %zu elements, buffer has %zu%s", name, n,
                          n_floats, out ? "" : " (NULL)");
    if (!w->ptr && w->half_dev) { /* kept in F16/BF16 on the device: fetch, widen */
        uint16_t *tmp = malloc(n * 2);
        if (!tmp) return dcs_seterr(&m->err, DCS_ERR_NOMEM, "out of memory reading weight '%.200s'", name);
        m->be->ops->download(m->be, tmp, w->half, n * 2);
        dcs_status st = m->be->ops->sync(m->be, &m->err);
        if (!st) dcs_widen(tmp, n, w->dtype, out);
        free(tmp);
        return st;
    }
    if (!w->ptr) { /* kept in F16/BF16 (CPU): widen */
        dcs_widen(w->half, n, w->dtype, out);
        return DCS_OK;
    }
    m->be->ops->download(m->be, out, w->ptr, n * sizeof(float));
    return m->be->ops->sync(m->be, &m->err);
}

dcs_status dcs_model_require_f32(dcs_model *m, dcs_err *e) {
    if (!m) return dcs_seterr(e, DCS_ERR_ARG, "dcs_model_require_f32: NULL model");
    for (int i = 0; i < m->n_weights; i++) {
        dcs_named_weight *w = &m->weights[i];
        if (w->ptr || !w->half) continue;
        if (w->half_dev)
            return dcs_seterr(e, DCS_ERR_UNSUPPORTED,
                              "%s: '%s' is kept in %s on the device; training needs float32 weights: "
                              "load the model with dtype='float32'",
                              m->dir, w->name, w->dtype == DCS_F16 ? "float16" : "bfloat16");
        uint64_t n = 1;
        for (int k = 0; k < w->ndim; k++) n *= (uint64_t)w->shape[k];
        float *p = m->be->ops->alloc(m->be, (size_t)n * sizeof(float));
        if (!p) {
            dcs_err ignored;
            m->be->ops->sync(m->be, &ignored);
            return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory widening '%s' to float32", m->dir,
                              w->name);
        }
        dcs_widen(w->half, n, w->dtype, p); /* CPU only: host memory */
        w->ptr = p;
        w->owned = 1;
        if (w->slot) *w->slot = p;
    }
    if (m->cfg.tie_embeddings) m->out_w = m->tok_emb;
    return DCS_OK;
}

int dcs_weight_count(const dcs_model *m) { return m ? m->n_weights : 0; }

const char *dcs_weight_name(const dcs_model *m, int i) {
    return m && i >= 0 && i < m->n_weights ? m->weights[i].name : NULL;
}

/* ---------------------------------------------------------------- pool */

/* A pooled buffer of exactly `bytes`, taken out of the pool, or NULL. Every
 * activation is fully written before it is read, so reuse needs no clearing. */
void *dcs_pool_take(dcs_model *m, size_t bytes) {
    for (int i = m->n_pool - 1; i >= 0; i--)
        if (m->pool[i].bytes == bytes) {
            void *p = m->pool[i].p;
            m->pool[i] = m->pool[--m->n_pool];
            return p;
        }
    return NULL;
}

/* Give a buffer back to the model's pool (or free it when the pool is full). */
void dcs_pool_put(dcs_model *m, void *p, size_t bytes) {
    if (m->n_pool < DCS_POOL_SIZE) {
        m->pool[m->n_pool].p = p;
        m->pool[m->n_pool].bytes = bytes;
        m->n_pool++;
    } else {
        m->be->ops->free(m->be, p);
    }
}

/* Free the pooled buffers (dcs_free, or after a failed pass). */
void dcs_pool_clear(dcs_model *m) {
    for (int i = 0; i < m->n_pool; i++) m->be->ops->free(m->be, m->pool[i].p);
    m->n_pool = 0;
}

/* Activation bytes of the last forward pass: at most at once, and in all. */
void dcs_forward_memory(const dcs_model *m, uint64_t *peak_bytes, uint64_t *total_bytes) {
    if (peak_bytes) *peak_bytes = m->last_peak_bytes;
    if (total_bytes) *total_bytes = m->last_total_bytes;
}

dcs_status dcs_device_memory(dcs_model *m, uint64_t *free_bytes, uint64_t *total_bytes) {
    if (!m || !free_bytes || !total_bytes) return DCS_ERR_ARG;
    *free_bytes = *total_bytes = 0;
    if (!m->be->ops->mem_info)
        return dcs_seterr(&m->err, DCS_ERR_UNSUPPORTED, "the %s backend's memory is the host's",
                          m->be->ops->name);
    if (m->be->ops->mem_info(m->be, free_bytes, total_bytes)) {
        *free_bytes = *total_bytes = 0;
        dcs_status st = m->be->ops->sync(m->be, &m->err); /* reports (and clears) the device's error */
        return st ? st : dcs_seterr(&m->err, DCS_ERR_BACKEND, "%s: no memory information", m->be->ops->name);
    }
    return DCS_OK;
}

void dcs_model_trim(dcs_model *m) {
    if (m && m->be) dcs_pool_clear(m);
}

/* ---------------------------------------------------------------- cancel */

void dcs_cancel(dcs_model *m, int cancel) {
    if (m) atomic_store(&m->cancel, cancel ? 1 : 0);
}

/* ---------------------------------------------------------------- fork */

/* In a forked child, for a model whose call was running in a thread of the
 * parent that the child does not have (dclens.h): the pool's entries may be
 * half updated (one listed twice, or one that call held), so they are
 * dropped, not freed; their pages are the parent's copy-on-write. */
void dcs_after_fork(dcs_model *m) {
    if (!m) return;
    m->n_pool = 0;
    atomic_store(&m->cancel, 0);
}
