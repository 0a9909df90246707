/*
 * load_weights.c -- the loader's shared builder helpers (load.h): a stored
 * tensor taken by name and shape, weights refused when they hold NaN/inf,
 * registered under their canonical names and placed in backend memory
 * (on the CPU, aligned F32 tensors are used in place from the mapped file,
 * F16/BF16 matrices kept as stored), and the tensors around the layers
 * (embedding, final norm, output) of every architecture.
 */
#include "load.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void fmt_shape(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, n - o, "[");
    for (int i = 0; i < ndim && o < n; i++)
        o += (size_t)snprintf(buf + o, n - o, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

/* Find `name`, check its shape, mark it used. Missing: NULL, and an error if
 * required. */
dcs_tensor *dcs_load_take(dcs_builder *b, const char *name, int required, int ndim, ...) {
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
static int weight_finite(dcs_builder *b, const float *x, uint64_t n, const dcs_tensor *t, const char *name) {
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
/* The first element of n 16-bit values (dtype) at d that is NaN or inf, or
 * -1; *what names it. */
static long long first_nonfinite16(const uint8_t *d, uint64_t n, int dtype, const char **what) {
    const uint16_t exp = dtype == DCS_F16 ? 0x7c00u : 0x7f80u;
    for (uint64_t i = 0; i < n; i++) {
        uint16_t u = (uint16_t)(d[2 * i] | (d[2 * i + 1] << 8));
        if ((u & exp) != exp) continue;
        *what = (u & 0x7fffu & (uint16_t)~exp) ? "NaN" : (u & 0x8000u) ? "-inf" : "+inf";
        return (long long)i;
    }
    return -1;
}

int dcs_load_half_finite(dcs_builder *b, const dcs_tensor *t) {
    const char *what = "";
    long long i = first_nonfinite16(t->data, dcs_tensor_numel(t), t->dtype, &what);
    if (i < 0) return 1;
    dcs_seterr(b->e, DCS_ERR_NONFINITE, "%s: tensor '%.200s' holds %s at element %lld", t->file, t->name,
               what, i);
    return 0;
}

static const char *dtype_name(int dtype) {
    return dtype == DCS_F16 ? "float16" : dtype == DCS_BF16 ? "bfloat16" : "float32";
}

/* t (float32) rounded to `dtype` in a malloc'd buffer, or NULL (error set):
 * out of memory, or a value past float16's range (+-65504). */
static uint8_t *narrowed(dcs_builder *b, const dcs_tensor *t, int dtype) {
    uint64_t n = dcs_tensor_numel(t);
    float *f = malloc((size_t)n * sizeof *f);
    uint8_t *h = malloc((size_t)n * 2 + 1);
    if (!f || !h) {
        free(f);
        free(h);
        dcs_seterr(b->e, DCS_ERR_NOMEM, "%s: out of memory rounding '%s' to %s", t->file, t->name,
                   dtype_name(dtype));
        return NULL;
    }
    dcs_tensor_to_f32(t, f);
    const char *what = "";
    if (!weight_finite(b, f, n, t, t->name)) {
        free(f);
        free(h);
        return NULL;
    }
    dcs_narrow(f, n, dtype, h);
    long long i = first_nonfinite16(h, n, dtype, &what);
    if (i >= 0) {
        dcs_seterr(b->e, DCS_ERR_ARG,
                   "dtype='%s': tensor '%.200s' of %s holds %g at element %lld, past float16's range "
                   "(+-65504): load with dtype='bfloat16' or 'float32'",
                   dtype_name(dtype), t->name, t->file, (double)f[i], i);
        free(f);
        free(h);
        return NULL;
    }
    free(f);
    return h;
}

/* The next entry of the model's weight list (not yet counted in
 * n_weights), zeroed, with its name and shape; NULL when out of memory. */
static dcs_named_weight *next_weight(dcs_builder *b, const char *name, int ndim, const int64_t *shape) {
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
    for (int i = 0; i < ndim; i++) w->shape[i] = shape[i];
    return w;
}

/* Register a weight of `n` floats under its canonical name and place it in
 * backend memory: either aliasing `t` or from host floats `src` (copied). */
float *dcs_load_add_weight(dcs_builder *b, const char *name, int ndim, const int64_t *shape,
                           const dcs_tensor *t, const float *src) {
    dcs_model *m = b->m;
    dcs_named_weight *w = next_weight(b, name, ndim, shape);
    if (!w) return NULL;
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= (uint64_t)shape[i];

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
 * otherwise it is placed like dcs_load_add_weight. */
dcs_wmat dcs_load_add_weight_keep(dcs_builder *b, const char *name, int ndim, const int64_t *shape,
                                  const uint8_t *data, int dtype, uint8_t *own, float **slot) {
    dcs_model *m = b->m;
    dcs_wmat r = {NULL, DCS_F32};
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= (uint64_t)shape[i];
    dcs_named_weight *w = next_weight(b, name, ndim, shape);
    if (!w) {
        free(own);
        return r;
    }
    w->slot = slot;
    w->dtype = dtype;
    m->kept_dtype = m->kept_dtype < 0 || m->kept_dtype == dtype ? dtype : 3;
    if (m->device != DCS_DEVICE_CPU) { /* the stored bits, uploaded once */
        void *dev = m->be->ops->alloc(m->be, (size_t)n * 2);
        if (!dev) {
            free(own);
            dcs_err ignored;
            m->be->ops->sync(m->be, &ignored);
            dcs_seterr(b->e, DCS_ERR_NOMEM, "out of device memory for '%s' (%.3f GiB in %s)", name,
                       (double)n * 2 / 1073741824.0, dtype_name(dtype));
            return r;
        }
        m->be->ops->upload(m->be, dev, data ? data : own, (size_t)n * 2);
        free(own);
        w->half = dev;
        w->half_dev = 1;
    } else if (own) {
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

/* A large matrix by stored name, in the type the load asked for
 * (m->want_dtype; dclens.h, dcs_load_options.dtype): as stored (-1), widened
 * to float32, or kept 16-bit (dcs_load_add_weight_keep; a float32 tensor
 * rounded to it; the other 16-bit type refused). NULL .p when missing. */
dcs_wmat dcs_load_keep(dcs_builder *b, const char *canon, const char *stored, int ndim, int64_t d0,
                       int64_t d1, int64_t d2, int64_t d3, float **slot) {
    int64_t shape[5] = {d0, d1, d2, d3, 0};
    dcs_wmat r = {NULL, DCS_F32};
    dcs_tensor *t = dcs_load_take(b, stored, 1, ndim, d0, d1, d2, d3, (int64_t)0);
    if (!t) return r;
    const int want = b->m->want_dtype < 0 ? t->dtype : b->m->want_dtype;
    if (want == DCS_F32) {
        *slot = dcs_load_add_weight(b, canon, ndim, shape, t, NULL);
        r.p = *slot;
        if (r.p) b->m->kept_dtype = b->m->kept_dtype < 0 || b->m->kept_dtype == DCS_F32 ? DCS_F32 : 3;
        return r;
    }
    if (t->dtype == DCS_F32) { /* rounded to the 16-bit type asked for */
        uint8_t *h = narrowed(b, t, want);
        if (!h) return r;
        return dcs_load_add_weight_keep(b, canon, ndim, shape, NULL, want, h, slot);
    }
    if (t->dtype != want) {
        dcs_seterr(b->e, DCS_ERR_ARG,
                   "dtype='%s': %s stores '%.200s' in %s, and %s -> %s would change its values: load with "
                   "dtype='auto' (%s, as stored) or 'float32'",
                   dtype_name(want), t->file, t->name, dtype_name(t->dtype), dtype_name(t->dtype),
                   dtype_name(want), dtype_name(t->dtype));
        return r;
    }
    if (!dcs_load_half_finite(b, t)) return r;
    return dcs_load_add_weight_keep(b, canon, ndim, shape, t->data, t->dtype, NULL, slot);
}

/* dcs_load_take + dcs_load_add_weight under the same shape; canonical name given separately. */
float *dcs_load_as(dcs_builder *b, const char *canon, const char *stored, int required, int ndim, int64_t d0,
                   int64_t d1, int64_t d2, int64_t d3, int64_t d4, int *missing) {
    int64_t shape[5] = {d0, d1, d2, d3, d4};
    dcs_tensor *t = dcs_load_take(b, stored, required, ndim, d0, d1, d2, d3, d4);
    if (!t) {
        if (missing) *missing = 1;
        return NULL;
    }
    return dcs_load_add_weight(b, canon, ndim, shape, t, NULL);
}

/* With tied embeddings, torch .bin files still carry the output matrix under
 * its own name (a view of the embedding's storage): accept and ignore it. */
static void tied_copy_ignored(dcs_builder *b, const char *name) {
    dcs_tensor *t = dcs_tt_find(&b->m->tt, name);
    if (t) t->used = 1;
}

dcs_status dcs_load_stack(dcs_builder *b, const dcs_load_names *names,
                          dcs_status (*layer)(dcs_builder *b, int l)) {
    dcs_model *m = b->m;
    const dcs_config *c = &m->cfg;
    const int64_t D = c->d_model, V = c->vocab;
    dcs_status s;
    m->m_tok_emb = dcs_load_keep(b, "tok_embeddings.weight", names->tok_emb, 2, V, D, 0, 0, &m->tok_emb);
    FAIL_IF(!m->m_tok_emb.p);
    for (int l = 0; l < c->n_layer; l++)
        if ((s = layer(b, l))) return s;
    m->norm_w = dcs_load_as(b, "norm.weight", names->norm_w, 1, 1, D, 0, 0, 0, 0, NULL);
    FAIL_IF(!m->norm_w);
    if (names->norm_b) {
        m->norm_b = dcs_load_as(b, "norm.bias", names->norm_b, 1, 1, D, 0, 0, 0, 0, NULL);
        FAIL_IF(!m->norm_b);
    }
    if (c->tie_embeddings) {
        m->out_w = m->tok_emb;
        m->m_out_w = m->m_tok_emb;
        tied_copy_ignored(b, names->out);
    } else {
        m->m_out_w = dcs_load_keep(b, "output.weight", names->out, 2, V, D, 0, 0, &m->out_w);
        FAIL_IF(!m->m_out_w.p);
    }
    return DCS_OK;
}
