/*
 * layouts.c -- the weights of a model directory, in one of four layouts
 * (model-spec section 1), tried in this order:
 *   model.safetensors                  one safetensors file
 *   model.safetensors.index.json       {"weight_map": {tensor: shard file}}
 *   pytorch_model.bin                  one PyTorch zip checkpoint
 *   pytorch_model.bin.index.json       the same, for torch zip shards
 * An index (index.c) is checked both ways: each tensor it names must be in
 * the shard it names, and each tensor of a shard must be named in it.
 */
#include "dcs_io.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* "dir/name", malloc'd (NULL when out of memory). */
static char *join_path(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + 1 + b + 1);
    if (p == NULL) return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

/* Is `path` exactly "dir/name"? */
static bool path_is(const char *path, const char *dir, const char *name) {
    size_t a = strlen(dir);
    return strncmp(path, dir, a) == 0 && path[a] == '/' && strcmp(path + a + 1, name) == 0;
}

/* 1 if dir/name exists, 0 if it does not, -1 (e set) on other errors. */
static int file_exists(const char *dir, const char *name, dcs_err *e) {
    char *p = join_path(dir, name);
    if (p == NULL) {
        dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", dir);
        return -1;
    }
    struct stat st;
    int r = stat(p, &st);
    int err = errno;
    free(p);
    if (r == 0) return 1;
    if (err == ENOENT || err == ENOTDIR) return 0;
    dcs_seterr(e, DCS_ERR_IO, "%s/%s: %s", dir, name, strerror(err));
    return -1;
}

static dcs_status add_one(dcs_tensor_table *tt, const char *dir, const char *name, dcs_tt_parse_fn parse,
                          dcs_err *e) {
    char *p = join_path(dir, name);
    if (p == NULL) return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", dir);
    dcs_status st = dcs_tt_add_file(tt, p, parse, e);
    free(p);
    return st;
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static dcs_status load_shards(dcs_tensor_table *tt, const char *dir, const char *ipath,
                              const dcs_index_entry *m, int n, dcs_tt_parse_fn parse, dcs_err *e) {
    const char **shards = malloc((size_t)n * sizeof *shards);
    if (shards == NULL) return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", ipath);
    for (int i = 0; i < n; i++) shards[i] = m[i].shard;
    qsort(shards, (size_t)n, sizeof *shards, cmp_str_ptr);
    dcs_status st = DCS_OK;
    tt->deferred = 1;
    for (int i = 0; i < n && st == DCS_OK; i++) {
        if (i > 0 && strcmp(shards[i - 1], shards[i]) == 0) continue;
        st = add_one(tt, dir, shards[i], parse, e);
        if (st == DCS_ERR_IO && e != NULL) {
            size_t len = strlen(e->msg);
            snprintf(e->msg + len, sizeof e->msg - len, " (shard named in %s)", ipath);
        }
    }
    free(shards);
    if (st == DCS_OK) st = dcs_tt_finish(tt, e);
    tt->deferred = 0;
    return st;
}

/* The index and the shards must agree tensor by tensor. */
static dcs_status cross_check(const dcs_tensor_table *tt, const char *dir, const char *ipath,
                              const dcs_index_entry *m, int n, dcs_err *e) {
    for (int i = 0; i < tt->n; i++) {
        if (dcs_index_find(m, n, tt->t[i].name) == NULL)
            return dcs_seterr(e, DCS_ERR_TENSOR,
                              "%s: tensor '%.200s' is not in the "
                              "weight_map of %s",
                              tt->t[i].file, tt->t[i].name, ipath);
    }
    for (int i = 0; i < n; i++) {
        const dcs_tensor *t = dcs_tt_find(tt, m[i].name);
        if (t == NULL) {
            if (dcs_tt_skippable_buffer(m[i].name)) continue; /* skipped by the parser on purpose */
            return dcs_seterr(e, DCS_ERR_TENSOR,
                              "%s: tensor '%.200s' is mapped to %s, "
                              "which does not contain it",
                              ipath, m[i].name, m[i].shard);
        }
        if (!path_is(t->file, dir, m[i].shard))
            return dcs_seterr(e, DCS_ERR_TENSOR,
                              "%s: tensor '%.200s' is mapped to %s but "
                              "found in %s",
                              ipath, m[i].name, m[i].shard, t->file);
    }
    return DCS_OK;
}

static dcs_status load_index(dcs_tensor_table *tt, const char *dir, const char *index_name,
                             dcs_tt_parse_fn parse, dcs_err *e) {
    char *ipath = join_path(dir, index_name);
    if (ipath == NULL) return dcs_seterr(e, DCS_ERR_NOMEM, "%s: out of memory", dir);
    char *text = NULL;
    size_t len = 0;
    dcs_index ix = {0};
    dcs_status st = dcs_read_text_file(ipath, DCS_MAX_HEADER_BYTES, &text, &len, e);
    if (st == DCS_OK) st = dcs_parse_index_json(text, len, ipath, &ix, e);
    if (st == DCS_OK) st = load_shards(tt, dir, ipath, ix.m, ix.n, parse, e);
    if (st == DCS_OK) st = cross_check(tt, dir, ipath, ix.m, ix.n, e);
    dcs_index_free(&ix);
    free(text);
    free(ipath);
    return st;
}

dcs_status dcs_tt_open_dir(const char *dir, dcs_tensor_table *tt, dcs_err *e) {
    memset(tt, 0, sizeof *tt);
    struct stat st_dir;
    if (stat(dir, &st_dir) != 0) return dcs_seterr(e, DCS_ERR_IO, "%s: %s", dir, strerror(errno));
    if (!S_ISDIR(st_dir.st_mode)) return dcs_seterr(e, DCS_ERR_IO, "%s: not a directory", dir);

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
        if (exists < 0) return DCS_ERR_IO;
        if (exists == 0) continue;
        dcs_status st = layouts[i].is_index ? load_index(tt, dir, layouts[i].file, layouts[i].parse, e)
                                            : add_one(tt, dir, layouts[i].file, layouts[i].parse, e);
        if (st != DCS_OK) dcs_tt_free(tt);
        return st;
    }
    return dcs_seterr(e, DCS_ERR_IO,
                      "%s: no weights found (looked for model.safetensors, "
                      "model.safetensors.index.json, pytorch_model.bin, "
                      "pytorch_model.bin.index.json)",
                      dir);
}
