/*
 * tensor_table.c -- the tensor table: every tensor of a checkpoint, as
 * views into its weight files (dcs_tensor_table of dcs_io.h). The file
 * parsers (safetensors.c, torch_state.c) add a file's tensors and commit
 * them; layouts.c adds the files of a model directory.
 *
 * The table keeps t[] sorted by name between calls, so dcs_tt_find is a
 * binary search and duplicate names are found when a file is committed.
 */
#include "dcs_io.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ building */

dcs_status dcs_tt_new_tensor(dcs_tensor_table *tt, const char *name, size_t name_len, const char *file,
                             dcs_tensor **out, dcs_err *e) {
    *out = NULL;
    if (name_len == 0) return dcs_seterr(e, DCS_ERR_FORMAT, "%s: a tensor has an empty name", file);
    if (memchr(name, '\0', name_len) != NULL)
        return dcs_seterr(e, DCS_ERR_FORMAT, "%s: tensor name '%.200s' contains a NUL byte", file, name);
    if (tt->n >= DCS_MAX_TENSORS)
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: more than %d tensors", file, DCS_MAX_TENSORS);
    if (tt->n == tt->cap) {
        int cap = tt->cap ? tt->cap * 2 : 64;
        if (cap > DCS_MAX_TENSORS) cap = DCS_MAX_TENSORS;
        dcs_tensor *t = realloc(tt->t, (size_t)cap * sizeof *t);
        if (t == NULL) return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", file);
        tt->t = t;
        tt->cap = cap;
    }
    char *copy = malloc(name_len + 1);
    if (copy == NULL) return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", file);
    memcpy(copy, name, name_len);
    copy[name_len] = '\0';
    dcs_tensor *t = &tt->t[tt->n++];
    memset(t, 0, sizeof *t);
    t->name = copy;
    t->file = file;
    *out = t;
    return DCS_OK;
}

void dcs_tt_rollback(dcs_tensor_table *tt, int first) {
    for (int i = first; i < tt->n; i++) {
        free(tt->t[i].name);
        free(tt->t[i].owned);
    }
    if (first < tt->n) tt->n = first;
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(((const dcs_tensor *)a)->name, ((const dcs_tensor *)b)->name);
}

/* Binary search in the sorted range t[0..n). */
static dcs_tensor *find_sorted(dcs_tensor *t, int n, const char *name) {
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(t[mid].name, name);
        if (c == 0) return &t[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static int cmp_tensor_name_file(const void *a, const void *b) {
    const dcs_tensor *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c != 0 ? c : strcmp(x->file, y->file);
}

dcs_status dcs_tt_commit(dcs_tensor_table *tt, int first, dcs_err *e) {
    int n_added = tt->n - first;
    if (n_added <= 0) return DCS_OK; /* nothing added (tt->t may be NULL) */
    dcs_tensor *added = tt->t + first;
    qsort(added, (size_t)n_added, sizeof *added, cmp_tensor_name);
    for (int i = 1; i < n_added; i++)
        if (strcmp(added[i - 1].name, added[i].name) == 0)
            return dcs_seterr(e, DCS_ERR_FORMAT, "%s: tensor '%.200s' appears twice", added[i].file,
                              added[i].name);
    if (tt->deferred) return DCS_OK; /* dcs_tt_finish sorts and checks once */
    for (int i = 0; i < n_added; i++) {
        const dcs_tensor *old = find_sorted(tt->t, first, added[i].name);
        if (old != NULL)
            return dcs_seterr(e, DCS_ERR_FORMAT, "%s: tensor '%.200s' is also in %s", added[i].file,
                              added[i].name, old->file);
    }
    if (first > 0) qsort(tt->t, (size_t)tt->n, sizeof *tt->t, cmp_tensor_name);
    return DCS_OK;
}

/* End of a batch of files added with tt->deferred set (a sharded
 * checkpoint): one sort of the whole table and one pass for names found in
 * two files, instead of a re-sort per file (which made loads quadratic in
 * the shard count). */
dcs_status dcs_tt_finish(dcs_tensor_table *tt, dcs_err *e) {
    tt->deferred = 0;
    if (tt->n < 2) return DCS_OK;
    qsort(tt->t, (size_t)tt->n, sizeof *tt->t, cmp_tensor_name_file);
    for (int i = 1; i < tt->n; i++)
        if (strcmp(tt->t[i - 1].name, tt->t[i].name) == 0)
            return dcs_seterr(e, DCS_ERR_FORMAT, "%s: tensor '%.200s' is also in %s", tt->t[i].file,
                              tt->t[i].name, tt->t[i - 1].file);
    return DCS_OK;
}

dcs_status dcs_tt_add_file(dcs_tensor_table *tt, const char *path, dcs_tt_parse_fn parse, dcs_err *e) {
    if (tt->n_files >= DCS_MAX_SHARDS)
        return dcs_seterr(e, DCS_ERR_NOMEM, "%s: more than %d weight files", path, DCS_MAX_SHARDS);
    if (tt->n_files == tt->cap_files) { /* doubling: linear in the shard count */
        int cap = tt->cap_files ? 2 * tt->cap_files : 4;
        dcs_mapped_file *files = realloc(tt->files, (size_t)cap * sizeof *files);
        if (files == NULL) return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", path);
        tt->files = files;
        tt->cap_files = cap;
    }
    dcs_mapped_file *f = &tt->files[tt->n_files];
    dcs_status st = dcs_map_file(path, f, e);
    if (st != DCS_OK) return st;
    st = parse(tt, f->data, f->size, f->path, e);
    if (st != DCS_OK) {
        dcs_unmap_file(f); /* the parser already dropped its tensors */
        return st;
    }
    tt->n_files++;
    return DCS_OK;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && memcmp(s + n - k, suffix, k) == 0;
}

bool dcs_tt_skippable_buffer(const char *name) {
    return ends_with(name, ".attention.bias") || ends_with(name, ".attention.masked_bias") ||
           ends_with(name, ".rotary_emb.inv_freq");
}

/* ------------------------------------------------------------ lookups */

dcs_tensor *dcs_tt_find(const dcs_tensor_table *tt, const char *name) {
    if (tt == NULL || tt->t == NULL || name == NULL) return NULL;
    return find_sorted(tt->t, tt->n, name);
}

void dcs_tt_free(dcs_tensor_table *tt) {
    if (tt == NULL) return;
    dcs_tt_rollback(tt, 0);
    free(tt->t);
    for (int i = 0; i < tt->n_files; i++) dcs_unmap_file(&tt->files[i]);
    free(tt->files);
    memset(tt, 0, sizeof *tt);
}
