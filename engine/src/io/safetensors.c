/*
 * safetensors.c -- reader for the safetensors format.
 *
 * Layout of a file of L bytes:
 *   [0, 8)          N, the header length, u64 little-endian
 *   [8, 8+N)        JSON header (often padded with spaces):
 *                     { "<tensor name>": { "dtype": "F32" | "F16" | "BF16",
 *                                          "shape": [d0, d1, ...],
 *                                          "data_offsets": [begin, end] },
 *                       ...,
 *                       "__metadata__": { ... }            (optional) }
 *   [8+N, L)        data region; begin/end are relative to its start, and
 *                   end - begin == prod(shape) * dtype size. Tensors are
 *                   not necessarily aligned in memory.
 *
 * Everything in the header is checked before a tensor enters the table:
 * header length (against the file and DCS_MAX_HEADER_BYTES), JSON syntax,
 * each entry's keys and types, dtype, shape (non-negative integers below
 * 2^53, at most DCS_MAX_NDIM dims, no overflow of numel * dtype size), the
 * offsets (inside the data region, matching the size, not overlapping) and
 * name uniqueness. Other dtypes (BOOL, I64, F64, ...) are refused, except
 * for the ignorable buffers of dcs_tt_skippable_buffer, which are skipped.
 */
#include "dcs_io.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_EXACT_INT 9007199254740992.0 /* 2^53: doubles are exact below */

/* What the parse of one file needs to report and bound things. */
typedef struct {
    const char *path;
    const uint8_t *data; /* data region */
    uint64_t data_len;
    dcs_err *e;
} st_file;

/* dtype name -> dcs_dtype, or -1 with *elsize the size of another known
 * safetensors dtype (0 if the name is unknown). */
static int parse_dtype(const char *s, size_t *elsize) {
    static const struct {
        const char *name;
        int dtype;
        size_t size;
    } table[] = {
        {"F32", DCS_F32, 4}, {"F16", DCS_F16, 2}, {"BF16", DCS_BF16, 2}, {"F64", -1, 8},
        {"I64", -1, 8},      {"U64", -1, 8},      {"I32", -1, 4},        {"U32", -1, 4},
        {"I16", -1, 2},      {"U16", -1, 2},      {"I8", -1, 1},         {"U8", -1, 1},
        {"BOOL", -1, 1},     {"F8_E4M3", -1, 1},  {"F8_E5M2", -1, 1},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(s, table[i].name) == 0) {
            *elsize = table[i].size;
            return table[i].dtype;
        }
    *elsize = 0;
    return -1;
}

/* A JSON number that is an integer in [0, 2^53). */
static bool json_uint(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= 0.0 && d < MAX_EXACT_INT) || floor(d) != d) return false;
    *out = (uint64_t)d;
    return true;
}

/* The three keys of a tensor entry; a key given twice is an error. */
typedef struct {
    const cJSON *dtype, *shape, *offsets;
} st_entry;

static dcs_status read_entry_keys(const st_file *f, const cJSON *obj, st_entry *en) {
    const char *name = obj->string;
    memset(en, 0, sizeof *en);
    if (!cJSON_IsObject(obj))
        return dcs_seterr(f->e, DCS_ERR_FORMAT,
                          "%s: tensor '%.200s': entry is not a JSON "
                          "object",
                          f->path, name);
    for (const cJSON *k = obj->child; k != NULL; k = k->next) {
        const cJSON **slot = strcmp(k->string, "dtype") == 0          ? &en->dtype
                             : strcmp(k->string, "shape") == 0        ? &en->shape
                             : strcmp(k->string, "data_offsets") == 0 ? &en->offsets
                                                                      : NULL;
        if (slot == NULL) continue; /* unknown keys are ignored */
        if (*slot != NULL)
            return dcs_seterr(f->e, DCS_ERR_FORMAT,
                              "%s: tensor '%.200s': key '%s' given "
                              "twice",
                              f->path, name, k->string);
        *slot = k;
    }
    const char *missing = en->dtype == NULL     ? "dtype"
                          : en->shape == NULL   ? "shape"
                          : en->offsets == NULL ? "data_offsets"
                                                : NULL;
    if (missing != NULL)
        return dcs_seterr(f->e, DCS_ERR_FORMAT, "%s: tensor '%.200s': no '%s'", f->path, name, missing);
    if (!cJSON_IsString(en->dtype) || en->dtype->valuestring == NULL)
        return dcs_seterr(f->e, DCS_ERR_FORMAT, "%s: tensor '%.200s': dtype is not a string", f->path, name);
    if (!cJSON_IsArray(en->shape))
        return dcs_seterr(f->e, DCS_ERR_FORMAT, "%s: tensor '%.200s': shape is not an array", f->path, name);
    if (!cJSON_IsArray(en->offsets) || cJSON_GetArraySize(en->offsets) != 2)
        return dcs_seterr(f->e, DCS_ERR_FORMAT,
                          "%s: tensor '%.200s': data_offsets is not "
                          "an array [begin, end]",
                          f->path, name);
    return DCS_OK;
}

/* shape -> dims, and numel * elsize -> *nbytes, all checked. */
static dcs_status read_shape(const st_file *f, const char *name, const cJSON *shape, size_t elsize,
                             int64_t dims[DCS_MAX_NDIM], int *ndim, uint64_t *nbytes) {
    int n = cJSON_GetArraySize(shape);
    if (n > DCS_MAX_NDIM)
        return dcs_seterr(f->e, DCS_ERR_FORMAT,
                          "%s: tensor '%.200s': %d dimensions (at most "
                          "%d supported)",
                          f->path, name, n, DCS_MAX_NDIM);
    uint64_t numel = 1;
    int i = 0;
    for (const cJSON *d = shape->child; d != NULL; d = d->next, i++) {
        uint64_t v;
        if (!json_uint(d, &v))
            return dcs_seterr(f->e, DCS_ERR_FORMAT,
                              "%s: tensor '%.200s': shape[%d] is not a "
                              "non-negative integer below 2^53",
                              f->path, name, i);
        if (!dcs_mul_ok(numel, v, &numel))
            return dcs_seterr(f->e, DCS_ERR_FORMAT,
                              "%s: tensor '%.200s': shape overflows "
                              "64 bits",
                              f->path, name);
        dims[i] = (int64_t)v;
    }
    *ndim = n;
    if (!dcs_mul_ok(numel, elsize, nbytes))
        return dcs_seterr(f->e, DCS_ERR_FORMAT,
                          "%s: tensor '%.200s': size in bytes "
                          "overflows 64 bits",
                          f->path, name);
    return DCS_OK;
}

/* data_offsets -> [begin, end) inside the data region, of length nbytes. */
static dcs_status read_offsets(const st_file *f, const char *name, const cJSON *offsets, uint64_t nbytes,
                               uint64_t *begin_out) {
    uint64_t begin, end;
    if (!json_uint(offsets->child, &begin) || !json_uint(offsets->child->next, &end))
        return dcs_seterr(f->e, DCS_ERR_FORMAT,
                          "%s: tensor '%.200s': data_offsets are not "
                          "non-negative integers below 2^53",
                          f->path, name);
    if (begin > end)
        return dcs_seterr(f->e, DCS_ERR_FORMAT,
                          "%s: tensor '%.200s': data_offsets [%llu, "
                          "%llu] end before they begin",
                          f->path, name, (unsigned long long)begin, (unsigned long long)end);
    if (end > f->data_len)
        return dcs_seterr(f->e, DCS_ERR_IO,
                          "%s: tensor '%.200s': data_offsets [%llu, %llu] "
                          "exceed the data region (%llu bytes; truncated file?)",
                          f->path, name, (unsigned long long)begin, (unsigned long long)end,
                          (unsigned long long)f->data_len);
    if (end - begin != nbytes)
        return dcs_seterr(f->e, DCS_ERR_FORMAT,
                          "%s: tensor '%.200s': data_offsets [%llu, "
                          "%llu] hold %llu bytes but dtype and shape need %llu",
                          f->path, name, (unsigned long long)begin, (unsigned long long)end,
                          (unsigned long long)(end - begin), (unsigned long long)nbytes);
    *begin_out = begin;
    return DCS_OK;
}

/* Check one header entry and add it to the table (or skip it). */
static dcs_status add_entry(dcs_tensor_table *tt, const st_file *f, const cJSON *obj) {
    const char *name = obj->string;
    st_entry en;
    dcs_status st = read_entry_keys(f, obj, &en);
    if (st != DCS_OK) return st;
    size_t elsize;
    int dtype = parse_dtype(en.dtype->valuestring, &elsize);
    bool skip = false;
    if (dtype < 0) {
        if (elsize == 0 || !dcs_tt_skippable_buffer(name))
            return dcs_seterr(f->e, DCS_ERR_FORMAT,
                              "%s: tensor '%.200s' has dtype '%.40s'; "
                              "only F32, F16 and BF16 are supported",
                              f->path, name, en.dtype->valuestring);
        skip = true; /* checked like the others, not kept */
    }
    int64_t dims[DCS_MAX_NDIM];
    int ndim = 0;
    uint64_t nbytes = 0, begin = 0;
    st = read_shape(f, name, en.shape, elsize, dims, &ndim, &nbytes);
    if (st == DCS_OK) st = read_offsets(f, name, en.offsets, nbytes, &begin);
    if (st != DCS_OK || skip) return st;
    dcs_tensor *t;
    st = dcs_tt_new_tensor(tt, name, strlen(name), f->path, &t, f->e);
    if (st != DCS_OK) return st;
    t->dtype = dtype;
    t->ndim = ndim;
    memcpy(t->shape, dims, (size_t)ndim * sizeof dims[0]);
    t->data = f->data + begin;
    t->nbytes = nbytes;
    return DCS_OK;
}

static int cmp_by_data(const void *a, const void *b) {
    const dcs_tensor *x = *(const dcs_tensor *const *)a, *y = *(const dcs_tensor *const *)b;
    return x->data < y->data ? -1 : x->data > y->data;
}

/* No two tensors of t[first..n) share bytes (empty tensors share none). */
static dcs_status check_overlaps(const dcs_tensor_table *tt, int first, const st_file *f) {
    int n = tt->n - first;
    if (n < 2) return DCS_OK;
    const dcs_tensor **v = malloc((size_t)n * sizeof *v);
    if (v == NULL) return dcs_seterr(f->e, DCS_ERR_NOMEM, "%s: out of memory", f->path);
    int m = 0;
    for (int i = 0; i < n; i++)
        if (tt->t[first + i].nbytes > 0) v[m++] = &tt->t[first + i];
    qsort(v, (size_t)m, sizeof *v, cmp_by_data);
    dcs_status st = DCS_OK;
    for (int i = 1; i < m && st == DCS_OK; i++)
        if (v[i - 1]->data + v[i - 1]->nbytes > v[i]->data)
            st = dcs_seterr(f->e, DCS_ERR_FORMAT,
                            "%s: tensors '%.200s' and '%.200s' overlap "
                            "in the data region",
                            f->path, v[i - 1]->name, v[i]->name);
    free(v);
    return st;
}

/* Parse the JSON header (copied so it is NUL-terminated) into *root. */
static dcs_status parse_header(const uint8_t *buf, uint64_t hlen, const char *path, cJSON **root,
                               dcs_err *e) {
    char *text = malloc((size_t)hlen + 1);
    if (text == NULL)
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory for a %llu-byte header", path,
                          (unsigned long long)hlen);
    memcpy(text, buf + 8, (size_t)hlen);
    text[hlen] = '\0';
    const char *end = NULL;
    /* a NUL (raw or \u0000) would cut a tensor name or dtype short */
    dcs_status st = dcs_json_check_text(text, (size_t)hlen, path, e);
    if (st != DCS_OK) {
        free(text);
        *root = NULL;
        return st;
    }
    *root = cJSON_ParseWithLengthOpts(text, (size_t)hlen, &end, 0);
    if (*root == NULL) {
        size_t at = end != NULL && end >= text && end <= text + hlen ? (size_t)(end - text) : 0;
        st = dcs_seterr(e, DCS_ERR_FORMAT,
                        "%s: header is not valid JSON (error near byte %zu "
                        "of the header)",
                        path, at);
    } else {
        for (const char *p = end; st == DCS_OK && p < text + hlen; p++)
            if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r')
                st = dcs_seterr(e, DCS_ERR_FORMAT,
                                "%s: header has bytes after its JSON "
                                "object (at byte %zu)",
                                path, (size_t)(p - text));
        if (st == DCS_OK && !cJSON_IsObject(*root))
            st = dcs_seterr(e, DCS_ERR_FORMAT, "%s: header is not a JSON object", path);
        if (st == DCS_OK) st = dcs_json_unique_keys(*root, path, e);
        if (st != DCS_OK) {
            cJSON_Delete(*root);
            *root = NULL;
        }
    }
    free(text);
    return st;
}

dcs_status dcs_tt_parse_safetensors(dcs_tensor_table *tt, const uint8_t *buf, uint64_t len, const char *path,
                                    dcs_err *e) {
    if (len < 8)
        return dcs_seterr(e, DCS_ERR_IO,
                          "%s: truncated: %llu bytes, less than the 8-byte "
                          "header length of a safetensors file",
                          path, (unsigned long long)len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | buf[i];
    if (hlen > DCS_MAX_HEADER_BYTES)
        return dcs_seterr(e, DCS_ERR_FORMAT,
                          "%s: header length %llu is over the %u-byte limit "
                          "(not a safetensors file?)",
                          path, (unsigned long long)hlen, DCS_MAX_HEADER_BYTES);
    if (hlen > len - 8)
        return dcs_seterr(e, DCS_ERR_IO,
                          "%s: header length %llu runs past the end of the "
                          "file (%llu bytes; truncated?)",
                          path, (unsigned long long)hlen, (unsigned long long)len);
    cJSON *root;
    dcs_status st = parse_header(buf, hlen, path, &root, e);
    if (st != DCS_OK) return st;
    st_file f = {path, buf + 8 + hlen, len - 8 - hlen, e};
    int first = tt->n;
    for (const cJSON *it = root->child; it != NULL && st == DCS_OK; it = it->next) {
        if (strcmp(it->string, "__metadata__") == 0) continue; /* free-form; nothing we need */
        st = add_entry(tt, &f, it);
    }
    if (st == DCS_OK) st = check_overlaps(tt, first, &f);
    if (st == DCS_OK) st = dcs_tt_commit(tt, first, e);
    if (st != DCS_OK) dcs_tt_rollback(tt, first);
    cJSON_Delete(root);
    return st;
}

dcs_status dcs_tt_add_safetensors(dcs_tensor_table *tt, const char *path, dcs_err *e) {
    return dcs_tt_add_file(tt, path, dcs_tt_parse_safetensors, e);
}
