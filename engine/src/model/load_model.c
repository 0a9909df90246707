/*
 * load_model.c -- from a checkpoint directory to a ready dcs_model (dcs_load):
 * config.json -> dcs_config, weight files -> tensor table, the backend, the
 * architecture's weights (load_dcpythia.c, load_neox.c: every expected
 * tensor checked by name and shape, widened to float32 or kept 16-bit, and
 * placed in backend memory by load_weights.c), unknown tensors refused, the
 * load notes, the layer plans, and the copies of weight files no weight
 * aliases given back.
 */
#include "load.h"
#include "pass.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CONFIG_BYTES (1u << 20)

/* Every stored tensor must have been used (or be a known derived one). */
static dcs_status check_unused(dcs_builder *b) {
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
            aliased = (!w->owned && p && p >= lo && p < hi) ||                    /* F32 in place */
                      (!w->half_owned && !w->half_dev && h && h >= lo && h < hi); /* F16/BF16 kept */
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
    const int dt = opts ? opts->dtype : DCS_LOAD_AUTO;
    if (dt < DCS_LOAD_AUTO || dt > DCS_LOAD_BF16) {
        s = dcs_seterr(&e, DCS_ERR_ARG, "dcs_load: dtype %d is not one of DCS_LOAD_AUTO, _F32, _F16, _BF16",
                       dt);
        goto done;
    }
    /* AUTO: as stored on the CPU; float32 on a device (docs/cuda.md) */
    m->want_dtype = dt == DCS_LOAD_F32            ? DCS_F32
                    : dt == DCS_LOAD_F16          ? DCS_F16
                    : dt == DCS_LOAD_BF16         ? DCS_BF16
                    : m->device == DCS_DEVICE_CPU ? -1
                                                  : DCS_F32;
    m->kept_dtype = -1;

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
    dcs_builder b = {m, &e};
    s = m->cfg.model_type == DCS_MODEL_GPT_NEOX ? dcs_load_neox(&b) : dcs_load_dcpythia(&b);
    if (!s) s = check_unused(&b);
    if (!s && m->cfg.model_type != DCS_MODEL_GPT_NEOX) dcs_load_dcpythia_notes(m);
    if (!s) s = dcs_model_map_params(m, &e);
    if (!s) s = dcs_plan_layers(m, &e);
    m->act_dtype = (m->kept_dtype == DCS_F16 || m->kept_dtype == DCS_BF16) && m->be->ops->gemm_x
                       ? m->kept_dtype
                       : DCS_F32;
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
