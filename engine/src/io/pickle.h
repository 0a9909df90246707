/*
 * pickle.h -- the restricted unpickler of torch checkpoints (pickle.c):
 * the values it builds and the machine's state. The state-dict mapper
 * (torch_state.c) runs it on <prefix>/data.pkl and reads the result.
 */
#ifndef DCS_PICKLE_H
#define DCS_PICKLE_H

#include "zip.h"

#include <stddef.h>

typedef enum {
    PV_NONE,
    PV_BOOL,
    PV_INT,
    PV_FLOAT,
    PV_STR,
    PV_BYTES,
    PV_TUPLE,
    PV_LIST,
    PV_DICT,
    PV_GLOBAL,
    PV_STORAGE,
    PV_TENSOR
} pv_kind;

typedef enum { G_ORDERED_DICT, G_REBUILD_TENSOR, G_REBUILD_PARAMETER, G_STORAGE } glob_kind;

/* A torch storage class: which dtype its elements have. */
typedef struct {
    const char *cls; /* torch.<cls>                                */
    int dtype;       /* dcs_dtype, or -1: a dtype we do not load   */
    size_t elsize;
    const char *dtname;
} storage_class;

typedef struct pv pv;

typedef struct { /* ('storage', cls, key, location, numel)    */
    const storage_class *cls;
    const char *key;
    int64_t numel;
    const uint8_t *data; /* the zip entry <prefix>/data/<key>         */
    uint64_t size;
} pk_storage;

typedef struct { /* _rebuild_tensor_v2 arguments               */
    const pk_storage *storage;
    int64_t offset;
    int ndim;
    int64_t size[DCS_MAX_NDIM], stride[DCS_MAX_NDIM];
} pk_tensor;

struct pv {
    pv_kind kind;
    union {
        int64_t i; /* BOOL, INT        */
        double f;  /* FLOAT            */
        struct {
            char *s;
            size_t len;
        } str; /* STR, BYTES; NUL-terminated */
        struct {
            pv **v;
            size_t n, cap;
        } seq; /* TUPLE, LIST; DICT: key, value, ... */
        struct {
            glob_kind kind;
            const storage_class *cls;
        } glob;
        pk_storage storage;
        pk_tensor tensor;
    } u;
};

/* Names of the pv kinds, for messages. */
extern const char *const dcs_pv_kind_name[];

/* ---------------------------------------------------------------- machine */

typedef struct pk_chunk {
    struct pk_chunk *next;
    size_t used, cap;
    max_align_t mem[];
} pk_chunk;

typedef struct {
    const uint8_t *p; /* data.pkl                                   */
    size_t len, pos, op_pos;
    const char *path;
    const char *pkl_name; /* "<prefix>/data.pkl" for messages (arena)  */
    const zip_archive *zip;
    const char *prefix; /* "<prefix>/" (arena)                       */
    size_t prefix_len;
    pv **stack;
    size_t sp, stack_cap;
    size_t *marks; /* stack heights at each open MARK            */
    size_t n_marks, marks_cap;
    pv **memo; /* slots, NULL when unset                    */
    size_t memo_cap, memo_used;
    pk_chunk *arena;
    size_t arena_bytes;
    uint64_t gathered; /* bytes of strided views copied beyond their storages */
    dcs_err *e;
} unpickler;

/* "<path>: <prefix>/data.pkl: <message>" into u->e; returns code. */
dcs_status dcs_pk_err(unpickler *u, dcs_status code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* n zeroed bytes of the machine's arena (freed with it), or NULL (u->e set). */
void *dcs_pk_alloc(unpickler *u, size_t n);
/* A NUL-terminated copy of s[0, n) in the arena, or NULL. */
char *dcs_pk_strdup(unpickler *u, const void *s, size_t n);
/* Run the machine over u->p[0, u->len) to STOP; *result is the one value
 * left (in the arena). The caller sets p, len, path, pkl_name, zip, prefix
 * and e of a zeroed unpickler, and releases it with dcs_unpickler_free. */
dcs_status dcs_unpickle(unpickler *u, pv **result);
void dcs_unpickler_free(unpickler *u);

#endif /* DCS_PICKLE_H */
