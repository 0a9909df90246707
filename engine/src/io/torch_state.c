/*
 * torch_state.c -- PyTorch zip checkpoints (torch.save of a state_dict:
 * pytorch_model.bin and its shards) into the tensor table, without torch
 * and without executing pickle code: find <prefix>/data.pkl in the archive
 * (zip.c), run the restricted unpickler on it (pickle.c) and map the
 * resulting dict of name -> tensor view onto table entries.
 *
 * Tensors lie inside their storage, which must lie inside its zip
 * entry. torch.save keeps views as they are: a tensor may be strided
 * (transposed: stride (1, V); expanded: stride 0). Such a view is gathered
 * into a contiguous copy owned by the table, after checking that every
 * element it reaches lies in the storage (strides >= 0, the furthest
 * element offset + sum (size_i - 1) stride_i < numel) and that expanded
 * copies stay small (DCS_MAX_GATHER_BYTES beyond their storages per file). Storage classes other than
 * Float/Half/BFloat16 name dtypes the engine does not load: such tensors are
 * refused, except the ignorable buffers of dcs_tt_skippable_buffer.
 */
#include "pickle.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ================================================================ tensors */

/* torch's is_contiguous: strides are row-major, ignoring dims of size 1. */
static bool is_contiguous(const pk_tensor *t, uint64_t numel) {
    if (numel == 0) return true;
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->size[i] != 1 && t->stride[i] != expect) return false;
        expect *= t->size[i]; /* <= numel <= INT64_MAX: no overflow */
    }
    return true;
}

#define DCS_MAX_GATHER_BYTES (256u << 20)

/* Copy the strided view t (elements of `elsize` bytes at base) into the
 * contiguous buffer out, row-major over its sizes. */
static void gather_view(const pk_tensor *t, const uint8_t *base, size_t elsize, uint64_t numel,
                        uint8_t *out) {
    int64_t idx[DCS_MAX_NDIM] = {0};
    for (uint64_t j = 0; j < numel; j++) {
        int64_t off = t->offset;
        for (int i = 0; i < t->ndim; i++) off += idx[i] * t->stride[i];
        memcpy(out + j * elsize, base + (uint64_t)off * elsize, elsize);
        for (int i = t->ndim - 1; i >= 0; i--) { /* odometer */
            if (++idx[i] < t->size[i]) break;
            idx[i] = 0;
        }
    }
}

/* "(2, 3)" */
static void format_dims(char *buf, size_t cap, const int64_t *d, int n) {
    size_t k = (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < n && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, i ? ", %lld" : "%lld", (long long)d[i]);
    if (k < cap) snprintf(buf + k, cap - k, ")");
}

/* Check one (name, tensor) pair and add it to the table (or skip it). */
static dcs_status add_tensor(unpickler *u, dcs_tensor_table *tt, const pv *key, const pk_tensor *t) {
    const char *name = key->u.str.s;
    const pk_storage *s = t->storage;
    uint64_t numel = 1, end, nbytes;
    for (int i = 0; i < t->ndim; i++)
        if (!dcs_mul_ok(numel, (uint64_t)t->size[i], &numel) || numel > (uint64_t)INT64_MAX)
            return dcs_pk_err(u, DCS_ERR_FORMAT, "tensor '%.200s': size overflows", name);
    int strided = !is_contiguous(t, numel);
    if (strided) {
        /* furthest element: offset + sum (size_i - 1) * stride_i, overflow-checked */
        char sz[200], sd[200];
        format_dims(sz, sizeof sz, t->size, t->ndim);
        format_dims(sd, sizeof sd, t->stride, t->ndim);
        uint64_t last = (uint64_t)t->offset, step;
        for (int i = 0; i < t->ndim; i++) {
            if (t->stride[i] < 0)
                return dcs_pk_err(u, DCS_ERR_FORMAT, "tensor '%.200s': negative stride in %s", name, sd);
            if (!dcs_mul_ok((uint64_t)(t->size[i] - 1), (uint64_t)t->stride[i], &step) ||
                !dcs_add_ok(last, step, &last))
                return dcs_pk_err(u, DCS_ERR_FORMAT, "tensor '%.200s': stride %s for size %s overflows", name,
                                  sd, sz);
        }
        if (last >= (uint64_t)s->numel)
            return dcs_pk_err(u, DCS_ERR_FORMAT,
                              "tensor '%.200s': view of size %s, stride %s at offset "
                              "%lld reaches element %llu, outside storage '%.100s' of %lld elements",
                              name, sz, sd, (long long)t->offset, (unsigned long long)last, s->key,
                              (long long)s->numel);
    } else if (!dcs_add_ok((uint64_t)t->offset, numel, &end) || end > (uint64_t)s->numel)
        return dcs_pk_err(u, DCS_ERR_FORMAT,
                          "tensor '%.200s': elements [%lld, %lld + %llu) lie "
                          "outside storage '%.100s' of %lld elements",
                          name, (long long)t->offset, (long long)t->offset, (unsigned long long)numel, s->key,
                          (long long)s->numel);
    if (s->cls->dtype < 0) {
        if (dcs_tt_skippable_buffer(name)) return DCS_OK;
        return dcs_pk_err(u, DCS_ERR_FORMAT,
                          "tensor '%.200s' has dtype %s (torch.%s); only "
                          "float32, float16 and bfloat16 are supported",
                          name, s->cls->dtname, s->cls->cls);
    }
    uint64_t sbytes = (uint64_t)s->numel * s->cls->elsize; /* checked at BINPERSID */
    if (!dcs_mul_ok(numel, s->cls->elsize, &nbytes))
        return dcs_pk_err(u, DCS_ERR_FORMAT, "tensor '%.200s': size overflows", name);
    if (strided && nbytes > sbytes) { /* an expanded view: bounded extra memory */
        if (nbytes - sbytes > DCS_MAX_GATHER_BYTES - u->gathered)
            return dcs_pk_err(u, DCS_ERR_NOMEM,
                              "tensor '%.200s': expanded views of this file would "
                              "need more than %u MiB beyond their storages",
                              name, DCS_MAX_GATHER_BYTES >> 20);
        u->gathered += nbytes - sbytes;
    }
    uint8_t *copy = NULL;
    if (strided) {
        copy = malloc(nbytes ? (size_t)nbytes : 1);
        if (copy == NULL)
            return dcs_pk_err(u, DCS_ERR_NOMEM,
                              "tensor '%.200s': out of memory for a contiguous "
                              "copy of %llu bytes",
                              name, (unsigned long long)nbytes);
        gather_view(t, s->data, s->cls->elsize, numel, copy);
    }
    dcs_tensor *out;
    dcs_status st = dcs_tt_new_tensor(tt, name, key->u.str.len, u->path, &out, u->e);
    if (st != DCS_OK) {
        free(copy);
        return st;
    }
    out->dtype = s->cls->dtype;
    out->ndim = t->ndim;
    memcpy(out->shape, t->size, (size_t)t->ndim * sizeof t->size[0]);
    out->data = copy ? copy : s->data + (uint64_t)t->offset * s->cls->elsize;
    out->owned = copy;
    out->nbytes = nbytes;
    return DCS_OK;
}

/* The unpickled object must be a dict of name -> tensor. */
static dcs_status add_state_dict(unpickler *u, dcs_tensor_table *tt, const pv *sd) {
    if (sd->kind != PV_DICT)
        return dcs_pk_err(u, DCS_ERR_FORMAT,
                          "pickled object is a %s, not a state_dict (a dict of "
                          "tensors)",
                          dcs_pv_kind_name[sd->kind]);
    for (size_t i = 0; i + 1 < sd->u.seq.n; i += 2) {
        const pv *k = sd->u.seq.v[i], *v = sd->u.seq.v[i + 1];
        if (k->kind != PV_STR)
            return dcs_pk_err(u, DCS_ERR_FORMAT, "state_dict has a %s key, not a str",
                              dcs_pv_kind_name[k->kind]);
        if (v->kind != PV_TENSOR)
            return dcs_pk_err(u, DCS_ERR_FORMAT,
                              "state_dict entry '%.200s' is a %s, not a tensor "
                              "(nested checkpoints such as {'state_dict': ...} are not supported)",
                              k->u.str.s, dcs_pv_kind_name[v->kind]);
        dcs_status st = add_tensor(u, tt, k, &v->u.tensor);
        if (st != DCS_OK) return st;
    }
    return DCS_OK;
}

/* The one entry "<prefix>/data.pkl" with a prefix free of '/'. */
static dcs_status find_data_pkl(const zip_archive *z, const zip_entry **out) {
    static const char tail[] = "/data.pkl";
    const size_t tl = sizeof tail - 1;
    *out = NULL;
    for (size_t i = 0; i < z->n; i++) {
        const zip_entry *en = &z->ent[i];
        if (en->name_len <= tl || memcmp(en->name + en->name_len - tl, tail, tl) != 0 ||
            memchr(en->name, '/', en->name_len - tl) != NULL)
            continue;
        if (*out != NULL)
            return dcs_seterr(z->e, DCS_ERR_FORMAT,
                              "%s: more than one data.pkl in the zip "
                              "archive",
                              z->path);
        *out = en;
    }
    if (*out == NULL)
        return dcs_seterr(z->e, DCS_ERR_FORMAT,
                          "%s: no <name>/data.pkl in the zip archive "
                          "(not a PyTorch checkpoint?)",
                          z->path);
    return DCS_OK;
}

/* ================================================================ entry points */

/* <prefix>/byteorder, when present, must say "little". */
static dcs_status check_byteorder(unpickler *u) {
    char *name = dcs_pk_alloc(u, u->prefix_len + sizeof "byteorder");
    if (name == NULL) return DCS_ERR_NOMEM;
    memcpy(name, u->prefix, u->prefix_len);
    memcpy(name + u->prefix_len, "byteorder", sizeof "byteorder");
    const zip_entry *en = dcs_zip_find(u->zip, name, u->prefix_len + 9);
    if (en == NULL) return DCS_OK;
    const uint8_t *d = NULL;
    uint64_t n = 0;
    dcs_status st = dcs_zip_entry_data(u->zip, en, &d, &n);
    if (st != DCS_OK) return st;
    if (n != 6 || memcmp(d, "little", 6) != 0)
        return dcs_seterr(u->e, DCS_ERR_FORMAT,
                          "%s: %s: only little-endian checkpoints are "
                          "supported",
                          u->path, name);
    return DCS_OK;
}

/* Unpickle <prefix>/data.pkl and add its tensors to the table. */
static dcs_status run_unpickler(unpickler *u, const zip_entry *pkl, dcs_tensor_table *tt) {
    size_t plen = pkl->name_len - 8; /* keeps the '/' */
    u->pkl_name = "data.pkl";
    char *pkl_name = dcs_pk_strdup(u, pkl->name, pkl->name_len);
    char *prefix = dcs_pk_strdup(u, pkl->name, plen);
    if (pkl_name == NULL || prefix == NULL) return DCS_ERR_NOMEM;
    u->pkl_name = pkl_name;
    u->prefix = prefix;
    u->prefix_len = plen;
    dcs_status st = check_byteorder(u);
    const uint8_t *data = NULL;
    uint64_t size = 0;
    if (st == DCS_OK) st = dcs_zip_entry_data(u->zip, pkl, &data, &size);
    if (st != DCS_OK) return st;
    if (size > DCS_MAX_PICKLE_BYTES)
        return dcs_pk_err(u, DCS_ERR_NOMEM, "%llu bytes, more than the %u MiB allowed",
                          (unsigned long long)size, DCS_MAX_PICKLE_BYTES >> 20);
    u->p = data;
    u->len = (size_t)size;
    pv *sd = NULL;
    if ((st = dcs_unpickle(u, &sd)) != DCS_OK) return st;
    int first = tt->n;
    st = add_state_dict(u, tt, sd);
    if (st == DCS_OK) st = dcs_tt_commit(tt, first, u->e);
    if (st != DCS_OK) dcs_tt_rollback(tt, first);
    return st;
}

dcs_status dcs_tt_parse_torchzip(dcs_tensor_table *tt, const uint8_t *buf, uint64_t len, const char *path,
                                 dcs_err *e) {
    zip_archive z;
    const zip_entry *pkl = NULL;
    dcs_status st = dcs_zip_open(&z, buf, len, path, e);
    if (st == DCS_OK) st = find_data_pkl(&z, &pkl);
    if (st == DCS_OK) {
        unpickler u;
        memset(&u, 0, sizeof u);
        u.path = path;
        u.zip = &z;
        u.e = e;
        st = run_unpickler(&u, pkl, tt);
        dcs_unpickler_free(&u);
    }
    dcs_zip_close(&z);
    return st;
}

dcs_status dcs_tt_add_torchzip(dcs_tensor_table *tt, const char *path, dcs_err *e) {
    return dcs_tt_add_file(tt, path, dcs_tt_parse_torchzip, e);
}
