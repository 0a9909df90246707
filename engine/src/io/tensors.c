/*
 * tensors.c -- the tensor table: every tensor of a checkpoint directory, as
 * views into memory-mapped weight files.
 *
 * A model directory holds its weights in one of four layouts (model-spec
 * section 1), tried in this order:
 *   model.safetensors                  one safetensors file
 *   model.safetensors.index.json       {"weight_map": {tensor: shard file}}
 *   pytorch_model.bin                  one PyTorch zip checkpoint
 *   pytorch_model.bin.index.json       the same, for torch zip shards
 * An index is checked both ways: each tensor it names must be in the shard it
 * names, and each tensor of a shard must be named in it.
 *
 * The table keeps t[] sorted by name between calls, so dcs_tt_find is a
 * binary search and duplicate names are found when a file is committed.
 * F16/BF16 data is widened to float32 exactly by dcs_tensor_to_f32.
 */
#include "dcs_io.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ------------------------------------------------------------ building */

dcs_status dcs_tt_new_tensor(dcs_tensor_table *tt, const char *name, size_t name_len,
                              const char *file, dcs_tensor **out, dcs_err *e)
{
    *out = NULL;
    if (name_len == 0)
        return dcs_seterr(e, DCS_ERR_FORMAT, "%s: a tensor has an empty name", file);
    if (memchr(name, '\0', name_len) != NULL)
        return dcs_seterr(e, DCS_ERR_FORMAT, "%s: tensor name '%.200s' contains a NUL byte",
                          file, name);
    if (tt->n >= DCS_MAX_TENSORS)
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: more than %d tensors", file, DCS_MAX_TENSORS);
    if (tt->n == tt->cap) {
        int cap = tt->cap ? tt->cap * 2 : 64;
        if (cap > DCS_MAX_TENSORS)
            cap = DCS_MAX_TENSORS;
        dcs_tensor *t = realloc(tt->t, (size_t)cap * sizeof *t);
        if (t == NULL)
            return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", file);
        tt->t = t;
        tt->cap = cap;
    }
    char *copy = malloc(name_len + 1);
    if (copy == NULL)
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", file);
    memcpy(copy, name, name_len);
    copy[name_len] = '\0';
    dcs_tensor *t = &tt->t[tt->n++];
    memset(t, 0, sizeof *t);
    t->name = copy;
    t->file = file;
    *out = t;
    return DCS_OK;
}

void dcs_tt_rollback(dcs_tensor_table *tt, int first)
{
    for (int i = first; i < tt->n; i++) {
        free(tt->t[i].name);
        free(tt->t[i].owned);
    }
    if (first < tt->n)
        tt->n = first;
}

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp(((const dcs_tensor *)a)->name, ((const dcs_tensor *)b)->name);
}

/* Binary search in the sorted range t[0..n). */
static dcs_tensor *find_sorted(dcs_tensor *t, int n, const char *name)
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(t[mid].name, name);
        if (c == 0)
            return &t[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static int cmp_tensor_name_file(const void *a, const void *b)
{
    const dcs_tensor *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c != 0 ? c : strcmp(x->file, y->file);
}

dcs_status dcs_tt_commit(dcs_tensor_table *tt, int first, dcs_err *e)
{
    int n_added = tt->n - first;
    if (n_added <= 0)
        return DCS_OK;               /* nothing added (tt->t may be NULL) */
    dcs_tensor *added = tt->t + first;
    qsort(added, (size_t)n_added, sizeof *added, cmp_tensor_name);
    for (int i = 1; i < n_added; i++)
        if (strcmp(added[i - 1].name, added[i].name) == 0)
            return dcs_seterr(e, DCS_ERR_FORMAT, "%s: tensor '%.200s' appears twice",
                              added[i].file, added[i].name);
    if (tt->deferred)
        return DCS_OK;               /* dcs_tt_finish sorts and checks once */
    for (int i = 0; i < n_added; i++) {
        const dcs_tensor *old = find_sorted(tt->t, first, added[i].name);
        if (old != NULL)
            return dcs_seterr(e, DCS_ERR_FORMAT, "%s: tensor '%.200s' is also in %s",
                              added[i].file, added[i].name, old->file);
    }
    if (first > 0)
        qsort(tt->t, (size_t)tt->n, sizeof *tt->t, cmp_tensor_name);
    return DCS_OK;
}

/* End of a batch of files added with tt->deferred set (a sharded
 * checkpoint): one sort of the whole table and one pass for names found in
 * two files, instead of a re-sort per file (which made loads quadratic in
 * the shard count). */
dcs_status dcs_tt_finish(dcs_tensor_table *tt, dcs_err *e)
{
    tt->deferred = 0;
    if (tt->n < 2)
        return DCS_OK;
    qsort(tt->t, (size_t)tt->n, sizeof *tt->t, cmp_tensor_name_file);
    for (int i = 1; i < tt->n; i++)
        if (strcmp(tt->t[i - 1].name, tt->t[i].name) == 0)
            return dcs_seterr(e, DCS_ERR_FORMAT, "%s: tensor '%.200s' is also in %s",
                              tt->t[i].file, tt->t[i].name, tt->t[i - 1].file);
    return DCS_OK;
}

dcs_status dcs_tt_add_file(dcs_tensor_table *tt, const char *path,
                           dcs_tt_parse_fn parse, dcs_err *e)
{
    if (tt->n_files >= DCS_MAX_SHARDS)
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: more than %d weight files", path,
                          DCS_MAX_SHARDS);
    if (tt->n_files == tt->cap_files) {     /* doubling: linear in the shard count */
        int cap = tt->cap_files ? 2 * tt->cap_files : 4;
        dcs_mapped_file *files = realloc(tt->files, (size_t)cap * sizeof *files);
        if (files == NULL)
            return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", path);
        tt->files = files;
        tt->cap_files = cap;
    }
    dcs_mapped_file *f = &tt->files[tt->n_files];
    dcs_status st = dcs_map_file(path, f, e);
    if (st != DCS_OK)
        return st;
    st = parse(tt, f->data, f->size, f->path, e);
    if (st != DCS_OK) {
        dcs_unmap_file(f);       /* the parser already dropped its tensors */
        return st;
    }
    tt->n_files++;
    return DCS_OK;
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && memcmp(s + n - k, suffix, k) == 0;
}

bool dcs_tt_skippable_buffer(const char *name)
{
    return ends_with(name, ".attention.bias") || ends_with(name, ".attention.masked_bias") ||
           ends_with(name, ".rotary_emb.inv_freq");
}

/* ------------------------------------------------------------ lookups */

dcs_tensor *dcs_tt_find(const dcs_tensor_table *tt, const char *name)
{
    if (tt == NULL || tt->t == NULL || name == NULL)
        return NULL;
    return find_sorted(tt->t, tt->n, name);
}

void dcs_tt_free(dcs_tensor_table *tt)
{
    if (tt == NULL)
        return;
    dcs_tt_rollback(tt, 0);
    free(tt->t);
    for (int i = 0; i < tt->n_files; i++)
        dcs_unmap_file(&tt->files[i]);
    free(tt->files);
    memset(tt, 0, sizeof *tt);
}

uint64_t dcs_tensor_numel(const dcs_tensor *t)
{
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= (uint64_t)t->shape[i];      /* the loaders checked it fits */
    return n;
}

void dcs_tensor_to_f32(const dcs_tensor *t, float *out)
{
    uint64_t n = dcs_tensor_numel(t);
    switch (t->dtype) {
    case DCS_F32:                                /* same layout; maybe unaligned */
        if (n > 0)
            memcpy(out, t->data, (size_t)n * sizeof *out);
        break;
    case DCS_F16:
    case DCS_BF16:
        dcs_widen(t->data, n, t->dtype, out);
        break;
    default:
        break;
    }
}

/* ------------------------------------------------------------ directories */

/* "dir/name", malloc'd (NULL when out of memory). */
static char *join_path(const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + 1 + b + 1);
    if (p == NULL)
        return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

/* Is `path` exactly "dir/name"? */
static bool path_is(const char *path, const char *dir, const char *name)
{
    size_t a = strlen(dir);
    return strncmp(path, dir, a) == 0 && path[a] == '/' && strcmp(path + a + 1, name) == 0;
}

/* 1 if dir/name exists, 0 if it does not, -1 (e set) on other errors. */
static int file_exists(const char *dir, const char *name, dcs_err *e)
{
    char *p = join_path(dir, name);
    if (p == NULL) {
        dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", dir);
        return -1;
    }
    struct stat st;
    int r = stat(p, &st);
    int err = errno;
    free(p);
    if (r == 0)
        return 1;
    if (err == ENOENT || err == ENOTDIR)
        return 0;
    dcs_seterr(e, DCS_ERR_IO, "%s/%s: %s", dir, name, strerror(err));
    return -1;
}

static dcs_status add_one(dcs_tensor_table *tt, const char *dir, const char *name,
                          dcs_tt_parse_fn parse, dcs_err *e)
{
    char *p = join_path(dir, name);
    if (p == NULL)
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", dir);
    dcs_status st = dcs_tt_add_file(tt, p, parse, e);
    free(p);
    return st;
}

static int cmp_map_name(const void *a, const void *b)
{
    return strcmp(((const dcs_index_entry *)a)->name, ((const dcs_index_entry *)b)->name);
}

static int cmp_str_ptr(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A shard must be a plain file name in the model directory. */
static bool plain_file_name(const char *s)
{
    return s[0] != '\0' && strchr(s, '/') == NULL && strstr(s, "..") == NULL &&
           strcmp(s, ".") != 0;
}

void dcs_index_free(dcs_index *ix)
{
    if (ix == NULL)
        return;
    free(ix->m);
    cJSON_Delete((cJSON *)ix->json);
    memset(ix, 0, sizeof *ix);
}

/* Parse the index JSON and read weight_map into a sorted array; names
 * unique, shards plain. */
dcs_status dcs_parse_index_json(const char *text, size_t len, const char *ipath,
                                dcs_index *out, dcs_err *e)
{
    memset(out, 0, sizeof *out);
    dcs_status st = dcs_json_check_text(text, len, ipath, e);
    if (st != DCS_OK)
        return st;
    cJSON *root = cJSON_ParseWithLength(text, len);
    if (root == NULL)
        return dcs_seterr(e, DCS_ERR_FORMAT, "%s: not valid JSON", ipath);
    st = dcs_json_unique_keys(root, ipath, e);
    if (st != DCS_OK) {
        cJSON_Delete(root);
        return st;
    }
    dcs_index_entry *m = NULL;
    int n = 0, i = 0;
    const cJSON *wm = cJSON_IsObject(root) ? cJSON_GetObjectItemCaseSensitive(root, "weight_map")
                                           : NULL;
    if (!cJSON_IsObject(wm)) {
        st = dcs_seterr(e, DCS_ERR_FORMAT, "%s: no \"weight_map\" object", ipath);
        goto done;
    }
    n = cJSON_GetArraySize(wm);
    if (n <= 0) {
        st = dcs_seterr(e, DCS_ERR_FORMAT, "%s: \"weight_map\" is empty", ipath);
        goto done;
    }
    if (n > DCS_MAX_TENSORS) {
        st = dcs_seterr(e, DCS_ERR_NOMEM, "%s: more than %d tensors", ipath, DCS_MAX_TENSORS);
        goto done;
    }
    m = malloc((size_t)n * sizeof *m);
    if (m == NULL) {
        st = dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", ipath);
        goto done;
    }
    for (const cJSON *it = wm->child; it != NULL && i < n; it = it->next, i++) {
        if (!cJSON_IsString(it) || it->valuestring == NULL) {
            st = dcs_seterr(e, DCS_ERR_FORMAT, "%s: weight_map['%.200s'] is not a string",
                            ipath, it->string);
            goto done;
        }
        if (!plain_file_name(it->valuestring)) {
            st = dcs_seterr(e, DCS_ERR_FORMAT, "%s: weight_map['%.200s'] = '%.200s' is not "
                            "a plain file name in the model directory", ipath,
                            it->string, it->valuestring);
            goto done;
        }
        m[i].name = it->string;
        m[i].shard = it->valuestring;
    }
    qsort(m, (size_t)n, sizeof *m, cmp_map_name);
    for (i = 1; i < n; i++)
        if (strcmp(m[i - 1].name, m[i].name) == 0) {
            st = dcs_seterr(e, DCS_ERR_FORMAT, "%s: tensor '%.200s' appears twice "
                            "in weight_map", ipath, m[i].name);
            goto done;
        }
done:
    if (st != DCS_OK) {
        free(m);
        cJSON_Delete(root);
        return st;
    }
    out->m = m;
    out->n = n;
    out->json = root;
    return DCS_OK;
}

/* Map every distinct shard of the map once. */
static dcs_status load_shards(dcs_tensor_table *tt, const char *dir, const char *ipath,
                              const dcs_index_entry *m, int n, dcs_tt_parse_fn parse, dcs_err *e)
{
    const char **shards = malloc((size_t)n * sizeof *shards);
    if (shards == NULL)
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", ipath);
    for (int i = 0; i < n; i++)
        shards[i] = m[i].shard;
    qsort(shards, (size_t)n, sizeof *shards, cmp_str_ptr);
    dcs_status st = DCS_OK;
    tt->deferred = 1;
    for (int i = 0; i < n && st == DCS_OK; i++) {
        if (i > 0 && strcmp(shards[i - 1], shards[i]) == 0)
            continue;
        st = add_one(tt, dir, shards[i], parse, e);
        if (st == DCS_ERR_IO && e != NULL) {
            size_t len = strlen(e->msg);
            snprintf(e->msg + len, sizeof e->msg - len, " (shard named in %s)", ipath);
        }
    }
    free(shards);
    if (st == DCS_OK)
        st = dcs_tt_finish(tt, e);
    tt->deferred = 0;
    return st;
}

/* The index and the shards must agree tensor by tensor. */
static dcs_status cross_check(const dcs_tensor_table *tt, const char *dir, const char *ipath,
                              const dcs_index_entry *m, int n, dcs_err *e)
{
    for (int i = 0; i < tt->n; i++) {
        dcs_index_entry key = {tt->t[i].name, NULL};
        if (bsearch(&key, m, (size_t)n, sizeof *m, cmp_map_name) == NULL)
            return dcs_seterr(e, DCS_ERR_TENSOR, "%s: tensor '%.200s' is not in the "
                              "weight_map of %s", tt->t[i].file, tt->t[i].name, ipath);
    }
    for (int i = 0; i < n; i++) {
        const dcs_tensor *t = dcs_tt_find(tt, m[i].name);
        if (t == NULL) {
            if (dcs_tt_skippable_buffer(m[i].name))
                continue;                /* skipped by the parser on purpose */
            return dcs_seterr(e, DCS_ERR_TENSOR, "%s: tensor '%.200s' is mapped to %s, "
                              "which does not contain it", ipath, m[i].name, m[i].shard);
        }
        if (!path_is(t->file, dir, m[i].shard))
            return dcs_seterr(e, DCS_ERR_TENSOR, "%s: tensor '%.200s' is mapped to %s but "
                              "found in %s", ipath, m[i].name, m[i].shard, t->file);
    }
    return DCS_OK;
}

static dcs_status load_index(dcs_tensor_table *tt, const char *dir, const char *index_name,
                             dcs_tt_parse_fn parse, dcs_err *e)
{
    char *ipath = join_path(dir, index_name);
    if (ipath == NULL)
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", dir);
    char *text = NULL;
    size_t len = 0;
    dcs_index ix = {0};
    dcs_status st = dcs_read_text_file(ipath, DCS_MAX_HEADER_BYTES, &text, &len, e);
    if (st == DCS_OK)
        st = dcs_parse_index_json(text, len, ipath, &ix, e);
    if (st == DCS_OK)
        st = load_shards(tt, dir, ipath, ix.m, ix.n, parse, e);
    if (st == DCS_OK)
        st = cross_check(tt, dir, ipath, ix.m, ix.n, e);
    dcs_index_free(&ix);
    free(text);
    free(ipath);
    return st;
}

dcs_status dcs_tt_open_dir(const char *dir, dcs_tensor_table *tt, dcs_err *e)
{
    memset(tt, 0, sizeof *tt);
    struct stat st_dir;
    if (stat(dir, &st_dir) != 0)
        return dcs_seterr(e, DCS_ERR_IO, "%s: %s", dir, strerror(errno));
    if (!S_ISDIR(st_dir.st_mode))
        return dcs_seterr(e, DCS_ERR_IO, "%s: not a directory", dir);

    static const struct {
        const char *file;
        bool is_index;
        dcs_tt_parse_fn parse;
    } layouts[] = {
        {"model.safetensors", false, dcs_tt_parse_safetensors},
        {"model.safetensors.index.json", true, dcs_tt_parse_safetensors},
        {"pytorch_model.bin", false, dcs_tt_parse_torchzip},
        {"pytorch_model.bin.index.json", true, dcs_tt_parse_torchzip},
    };
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        int exists = file_exists(dir, layouts[i].file, e);
        if (exists < 0)
            return DCS_ERR_IO;
        if (exists == 0)
            continue;
        dcs_status st = layouts[i].is_index
                            ? load_index(tt, dir, layouts[i].file, layouts[i].parse, e)
                            : add_one(tt, dir, layouts[i].file, layouts[i].parse, e);
        if (st != DCS_OK)
            dcs_tt_free(tt);
        return st;
    }
    return dcs_seterr(e, DCS_ERR_IO, "%s: no weights found (looked for model.safetensors, "
                      "model.safetensors.index.json, pytorch_model.bin, "
                      "pytorch_model.bin.index.json)", dir);
}
