/*
 * train.c -- what training adds to a loaded model: the parameter table
 * (every weight by canonical name, in load order, laid out in one flat
 * float array for gradients and optimizer state), writable weights, and
 * the AdamW update (decoupled weight decay, Loshchilov & Hutter 2019).
 */
/* The AdamW loop vectorises (cpu_vec.h's clones) only
 * with -ftree-vectorize (the build uses -O2) and, for sqrtf, without errno
 * (CMakeLists.txt: -fno-math-errno for this file; sqrtf's argument is never
 * negative here); the same IEEE operations either way. */
#pragma GCC optimize("tree-vectorize")

#include "cpu_vec.h"
#include "dcs_math.h"
#include "dcs_model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* dcs_model_require_f32 (load_model.c) makes every float* weight a valid
 * float32 host array (F16/BF16 checkpoints keep their matrices 16-bit until
 * it is called). */

static size_t numel(const dcs_named_weight *w) {
    size_t n = 1;
    for (int j = 0; j < w->ndim; j++) n *= (size_t)w->shape[j];
    return n;
}

int dcs_param_count(const dcs_model *m) { return m->n_weights; }

int64_t dcs_param_total(const dcs_model *m) {
    int64_t t = 0;
    for (int i = 0; i < m->n_weights; i++) t += (int64_t)numel(&m->weights[i]);
    return t;
}

/* Name, offset in the flat layout, size, and whether weight decay applies
 * (matrices: yes; norms, biases, QK-norm scales: no). */
dcs_status dcs_param_info(const dcs_model *m, int i, const char **name, int64_t *offset, int64_t *n,
                          int *decay) {
    if (i < 0 || i >= m->n_weights) return DCS_ERR_ARG;
    int64_t off = 0;
    for (int j = 0; j < i; j++) off += (int64_t)numel(&m->weights[j]);
    const dcs_named_weight *w = &m->weights[i];
    *name = w->name;
    *offset = off;
    *n = (int64_t)numel(w);
    *decay = w->ndim >= 2;
    return DCS_OK;
}

/* Replace pointer `from` by `to` in every weight field of the model. */
static void rewire(dcs_model *m, float *from, float *to) {
    float **top[] = {&m->tok_emb, &m->out_w, &m->norm_w, &m->norm_b};
    for (size_t i = 0; i < sizeof top / sizeof *top; i++)
        if (*top[i] == from) *top[i] = to;
    for (int l = 0; l < m->cfg.n_layer; l++) {
        dcs_layer_weights *w = &m->layers[l];
#define REWIRE(field, name)                                                                                  \
    if (w->field == from) w->field = to;
        DCS_LAYER_PARAMS(REWIRE)
#undef REWIRE
    }
}

/* Make every weight an owned, writable host array (weights of a float32
 * safetensors file alias the read-only mapping until then). */
dcs_status dcs_model_make_trainable(dcs_model *m) {
    dcs_status st = dcs_tape_supported(m);
    if (st) return st;
    st = dcs_model_require_f32(m, &m->err);
    if (st) return st;
    for (int i = 0; i < m->n_weights; i++) {
        dcs_named_weight *w = &m->weights[i];
        if (w->owned) continue;
        size_t n = numel(w);
        float *p = m->be->ops->alloc(m->be, n * sizeof(float));
        if (!p) return dcs_seterr(&m->err, DCS_ERR_NOMEM, "out of memory copying '%s'", w->name);
        m->be->ops->copy(m->be, p, w->ptr, n * sizeof(float));
        rewire(m, w->ptr, p);
        w->ptr = p;
        w->owned = 1;
    }
    /* the layer reads the m_* views: point them at the trained float32 arrays */
    m->m_tok_emb = (dcs_wmat){m->tok_emb, DCS_F32};
    m->m_out_w = (dcs_wmat){m->out_w, DCS_F32};
    for (int l = 0; l < m->cfg.n_layer; l++) {
        dcs_layer_weights *w = &m->layers[l];
        w->m_wqkv = (dcs_wmat){w->wqkv, DCS_F32};
        w->m_wo = (dcs_wmat){w->wo, DCS_F32};
        w->m_w1 = (dcs_wmat){w->w1, DCS_F32};
        w->m_w2 = (dcs_wmat){w->w2, DCS_F32};
        w->m_w3 = (dcs_wmat){w->w3, DCS_F32}; /* NULL but for dcformer */
        w->m_dw1 = (dcs_wmat){w->dw1, DCS_F32};
    }
    return DCS_OK;
}

/* AdamW on one weight's elements [b, e) (element-wise: any split gives the
 * same bits). */
typedef struct {
    const float *g;
    float *mom, *var, *p;
    float b1c, b2c, wd;
    const dcs_adamw *h;
} adamw_arg;
DCS_VEC static void adamw_span(const adamw_arg *a, long long b, long long e) {
    const float *restrict g = a->g;
    float *restrict mom = a->mom, *restrict var = a->var, *restrict p = a->p;
    const float b1 = a->h->beta1, b2 = a->h->beta2, b1c = a->b1c, b2c = a->b2c, eps = a->h->eps,
                lr = a->h->lr, wd = a->wd;
    for (long long j = b; j < e; j++)
        p[j] = dcs_adamw_elem(p[j], g[j], &mom[j], &var[j], b1, b2, b1c, b2c, eps, lr, wd);
}
static void adamw_range(void *arg, long long b, long long e, int tid) {
    (void)tid;
    adamw_span(arg, b, e);
}

/* One AdamW step on every parameter: grads, mom, var flat [dcs_param_total];
 * step counts from 1. Each weight's elements on the model's pool. */
dcs_status dcs_adamw_step(dcs_model *m, const float *grads, float *mom, float *var, int step,
                          const dcs_adamw *h) {
    if (step < 1) return dcs_seterr(&m->err, DCS_ERR_ARG, "adamw: step must be >= 1");
    for (int i = 0; i < m->n_weights; i++)
        if (!m->weights[i].owned)
            return dcs_seterr(&m->err, DCS_ERR_ARG,
                              "adamw: weights are read-only; call dcs_model_make_trainable");
    const float b1c = 1.0f - powf(h->beta1, (float)step), b2c = 1.0f - powf(h->beta2, (float)step);
    /* weights on a device: each downloaded, stepped on the host, uploaded
     * (the optimiser state stays on the host, in the caller's arrays) */
    dcs_backend *be = m->be;
    const int dev = m->device != DCS_DEVICE_CPU;
    float *host = NULL;
    if (dev) {
        size_t mx = 1;
        for (int i = 0; i < m->n_weights; i++) mx = numel(&m->weights[i]) > mx ? numel(&m->weights[i]) : mx;
        if (!(host = malloc(mx * sizeof(float))))
            return dcs_seterr(&m->err, DCS_ERR_NOMEM, "adamw: out of memory");
    }
    size_t off = 0;
    for (int i = 0; i < m->n_weights; i++) {
        dcs_named_weight *w = &m->weights[i];
        size_t n = numel(w);
        float *p = dev ? host : w->ptr;
        if (dev) be->ops->download(be, host, w->ptr, n * sizeof(float));
        adamw_arg a = {
            grads + off, mom + off, var + off, p, b1c, b2c, w->ndim >= 2 ? h->weight_decay : 0.0f, h};
        if (be->ops->parallel)
            be->ops->parallel(be, adamw_range, &a, (long long)n, 8);
        else
            adamw_range(&a, 0, (long long)n, 0);
        if (dev) be->ops->upload(be, w->ptr, host, n * sizeof(float));
        off += n;
    }
    free(host);
    return dev ? be->ops->sync(be, &m->err) : DCS_OK;
}
