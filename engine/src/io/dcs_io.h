/*
 * dcs_io.h -- the io layer (engine/src/io/, library dclens_io): the error
 * record every layer uses, reading files, the tensor table the weight-file
 * parsers (safetensors, torch zip) fill, sharded-checkpoint indexes, strict
 * JSON and config.json. Includes nothing of the engine but the public header
 * (for dcs_status and dcs_config); the layers above include this.
 */
#ifndef DCS_IO_H
#define DCS_IO_H

#include "dclens.h"
#include <stdarg.h>
#include <stdbool.h>

/* ---------------------------------------------------------------- errors */

typedef struct {
    dcs_status code;
    char msg[1024];
} dcs_err;

/* Set e (if non-NULL) and return code. printf-style message. */
dcs_status dcs_seterr(dcs_err *e, dcs_status code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* ---------------------------------------------------------------- limits */

#define DCS_MAX_NDIM 8
#define DCS_MAX_SHARDS 4096
#define DCS_MAX_HEADER_BYTES (100u << 20) /* safetensors JSON header      */
#define DCS_MAX_PICKLE_BYTES (256u << 20) /* data.pkl                     */
#define DCS_MAX_TENSORS 1000000

/* Checked size arithmetic: returns false on overflow. */
static inline bool dcs_mul_ok(uint64_t a, uint64_t b, uint64_t *out) {
    if (a != 0 && b > UINT64_MAX / a) return false;
    *out = a * b;
    return true;
}
static inline bool dcs_add_ok(uint64_t a, uint64_t b, uint64_t *out) {
    if (b > UINT64_MAX - a) return false;
    *out = a + b;
    return true;
}

/* ---------------------------------------------------------------- files */

typedef struct {
    char *path;          /* owned                                           */
    const uint8_t *data; /* a private copy of the contents (read-only)      */
    uint64_t size;
} dcs_mapped_file;

dcs_status dcs_map_file(const char *path, dcs_mapped_file *f, dcs_err *e);
void dcs_unmap_file(dcs_mapped_file *f);
/* Give back the contents (data NULL, size 0) but keep the path. */
void dcs_release_file_data(dcs_mapped_file *f);

/* Read a whole small file (config.json, index json) into a NUL-terminated
 * malloc'd buffer. */
dcs_status dcs_read_text_file(const char *path, size_t max_bytes, char **out, size_t *len, dcs_err *e);

/* ---------------------------------------------------------------- tensors */

typedef enum { DCS_F32 = 0, DCS_F16 = 1, DCS_BF16 = 2 } dcs_dtype;

static inline size_t dcs_dtype_size(int dt) { return dt == DCS_F32 ? 4 : 2; }

/* A tensor as stored in a checkpoint: a view into a mapped file. The data
 * may be unaligned; read it with dcs_tensor_to_f32. */
typedef struct {
    char *name; /* owned                                          */
    int dtype;  /* dcs_dtype                                      */
    int ndim;
    int64_t shape[DCS_MAX_NDIM];
    const uint8_t *data; /* into a mapped file, nbytes long               */
    uint64_t nbytes;     /* == numel * dtype size (checked by the loader)  */
    const char *file;    /* path of the file holding it (for messages)     */
    int used;            /* set by the model builder                       */
    uint8_t *owned;      /* malloc'd contiguous copy of a strided torch
                              view (data points here), else NULL            */
} dcs_tensor;

/* All tensors of a checkpoint directory, across shards. */
typedef struct {
    dcs_tensor *t;
    int n, cap;
    dcs_mapped_file *files;
    int n_files, cap_files;
    int deferred; /* set while a batch of shards is added: see dcs_tt_finish */
} dcs_tensor_table;

/* Open the weights of a model directory: model.safetensors, sharded
 * safetensors (model.safetensors.index.json), pytorch_model.bin or sharded
 * torch zip (pytorch_model.bin.index.json). Every tensor's extent is checked
 * against its file. Names are unique. */
dcs_status dcs_tt_open_dir(const char *dir, dcs_tensor_table *tt, dcs_err *e);
/* Single files (used by dcs_tt_open_dir and by tests/fuzzers). */
dcs_status dcs_tt_add_safetensors(dcs_tensor_table *tt, const char *path, dcs_err *e);
dcs_status dcs_tt_add_torchzip(dcs_tensor_table *tt, const char *path, dcs_err *e);
/* Parse from memory (the fuzzers' entry points; `path` names the file in
 * messages and in each tensor's `file`, so it and the buffer must outlive
 * the table). On error the table holds the tensors and files it had before
 * (release it with dcs_tt_free as usual). */
dcs_status dcs_tt_parse_safetensors(dcs_tensor_table *tt, const uint8_t *buf, uint64_t len, const char *path,
                                    dcs_err *e);
dcs_status dcs_tt_parse_torchzip(dcs_tensor_table *tt, const uint8_t *buf, uint64_t len, const char *path,
                                 dcs_err *e);
void dcs_tt_free(dcs_tensor_table *tt);
dcs_tensor *dcs_tt_find(const dcs_tensor_table *tt, const char *name);

/* Widen a stored tensor to float32 (exact for F16/BF16). out has numel. */
void dcs_tensor_to_f32(const dcs_tensor *t, float *out);
uint64_t dcs_tensor_numel(const dcs_tensor *t);
/* Widen n values of `dtype` at src (any alignment) to float32 (exact). */
void dcs_widen(const void *src, uint64_t n, int dtype, float *out);
/* Narrow n floats to `dtype` (F16 or BF16) at out (any alignment), rounded
 * to nearest even as torch's .half() / .bfloat16() round; F16 overflow
 * becomes +-inf (the loader refuses it by name). */
void dcs_narrow(const float *src, uint64_t n, int dtype, void *out);

/* Building a table (tensor_table.c, for the file parsers). Between calls t[] is
 * sorted by name (dcs_tt_find bsearches it). A parser records first = tt->n,
 * appends with dcs_tt_new_tensor (owned copy of the name, fields zeroed,
 * `file` set), then calls dcs_tt_commit (names unique across the table,
 * re-sort) or, on error, dcs_tt_rollback (drops t[first..n)). */
dcs_status dcs_tt_new_tensor(dcs_tensor_table *tt, const char *name, size_t name_len, const char *file,
                             dcs_tensor **out, dcs_err *e);
dcs_status dcs_tt_commit(dcs_tensor_table *tt, int first, dcs_err *e);
/* With tt->deferred set, dcs_tt_commit only sorts and checks the file's own
 * tensors; dcs_tt_finish then sorts the table once and refuses a name found
 * in two files (and clears tt->deferred). */
dcs_status dcs_tt_finish(dcs_tensor_table *tt, dcs_err *e);
void dcs_tt_rollback(dcs_tensor_table *tt, int first);
/* Map `path`, keep it in tt->files and run `parse` on it (dcs_tt_add_*). */
typedef dcs_status (*dcs_tt_parse_fn)(dcs_tensor_table *tt, const uint8_t *buf, uint64_t len,
                                      const char *path, dcs_err *e);
dcs_status dcs_tt_add_file(dcs_tensor_table *tt, const char *path, dcs_tt_parse_fn parse, dcs_err *e);
/* Buffers the spec (section 3) says may appear and are ignored; checkpoints
 * store some with dtypes the engine does not load (bool masks), so the
 * parsers skip those instead of refusing the file. */
bool dcs_tt_skippable_buffer(const char *name);

/* A sharded checkpoint's index (model.safetensors.index.json,
 * pytorch_model.bin.index.json): weight_map {tensor name: shard file},
 * sorted by name, names unique, every shard a plain file name (no '/', no
 * ".."). The strings live in the parsed JSON, owned by `json`. */
typedef struct {
    const char *name;
    const char *shard;
} dcs_index_entry;
typedef struct {
    dcs_index_entry *m;
    int n;
    void *json; /* the cJSON tree the strings point into */
} dcs_index;
/* Parse the index text (len bytes, NUL-terminated); `path` names it in
 * messages. On error *out is left empty. Release with dcs_index_free. */
dcs_status dcs_parse_index_json(const char *text, size_t len, const char *path, dcs_index *out, dcs_err *e);
void dcs_index_free(dcs_index *ix);
/* The entry of `name` in the sorted weight_map m[0, n), or NULL. */
const dcs_index_entry *dcs_index_find(const dcs_index_entry *m, int n, const char *name);

/* ---------------------------------------------------------------- JSON */

/* json_strict.c: refuse a NUL byte or an escaped NUL (\u0000) anywhere in
 * the text (len bytes), and a key given twice in one object (root: a
 * cJSON tree). Messages start with `path`. */
dcs_status dcs_json_check_text(const char *text, size_t len, const char *path, dcs_err *e);
dcs_status dcs_json_unique_keys(const void *root, const char *path, dcs_err *e);

/* ---------------------------------------------------------------- config */

/* Parse config.json text into cfg plus the local-layer table. */
dcs_status dcs_parse_config(const char *json_text, const char *path, dcs_config *cfg, int *window_pattern,
                            int *window_pattern_len, dcs_err *e);

#endif /* DCS_IO_H */
