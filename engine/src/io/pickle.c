/*
 * pickle.c -- the restricted unpickler of torch checkpoints, never executing
 * pickle code.
 *
 * data.pkl is read by a restricted unpickler: a small stack machine over a
 * closed set of values (None, bool, int, float, str, bytes, tuple, list,
 * dict) plus the few objects a state_dict needs:
 *   collections.OrderedDict()                      -> dict
 *   persistent id ('storage', torch.<T>Storage, key, location, numel)
 *                                                  -> storage <prefix>/data/<key>
 *   torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
 *                                   requires_grad, hooks[, metadata])
 *                                                  -> tensor view
 *   torch._utils._rebuild_parameter(tensor, ...)   -> the same tensor
 * Any other global is refused (nothing is ever imported or called), as is
 * any opcode outside the list in unpickle_step. The pickled object must be a
 * dict of name -> tensor; BUILD on a dict (OrderedDict's _metadata) is
 * ignored.
 *
 * Memory: all pickle values live in one arena freed at the end (values are
 * shared through the memo, so nothing is freed earlier). The arena, the
 * stack, the mark stack and the memo are bounded below.
 */
#include "pickle.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PK_MAX_ARENA (256u << 20) /* bytes of unpickled values             */
#define PK_MAX_STACK (1u << 20)   /* values on the stack                   */
#define PK_MAX_MARKS (1u << 16)   /* open MARKs                            */
#define PK_MAX_MEMO (1u << 22)    /* memo slots                            */
#define PK_CHUNK (64u << 10)      /* arena chunk size                      */

static const storage_class storage_classes[] = {
    {"FloatStorage", DCS_F32, 4, "float32"},
    {"HalfStorage", DCS_F16, 2, "float16"},
    {"BFloat16Storage", DCS_BF16, 2, "bfloat16"},
    {"DoubleStorage", -1, 8, "float64"},
    {"LongStorage", -1, 8, "int64"},
    {"IntStorage", -1, 4, "int32"},
    {"ShortStorage", -1, 2, "int16"},
    {"CharStorage", -1, 1, "int8"},
    {"ByteStorage", -1, 1, "uint8"},
    {"BoolStorage", -1, 1, "bool"},
};

const char *const dcs_pv_kind_name[] = {"None",  "bool", "int",  "float",  "str",     "bytes",
                                        "tuple", "list", "dict", "global", "storage", "tensor"};

/* "<path>: <prefix>/data.pkl: <message>" */
dcs_status dcs_pk_err(unpickler *u, dcs_status code, const char *fmt, ...) {
    char msg[800];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return dcs_seterr(u->e, code, "%s: %s: %s", u->path, u->pkl_name, msg);
}

void *dcs_pk_alloc(unpickler *u, size_t n) {
    n = (n + 15) & ~(size_t)15;
    pk_chunk *c = u->arena;
    if (c == NULL || c->cap - c->used < n) {
        size_t cap = n > PK_CHUNK ? n : PK_CHUNK;
        if (n > PK_MAX_ARENA || u->arena_bytes + cap > PK_MAX_ARENA) {
            dcs_pk_err(u, DCS_ERR_NOMEM, "unpickling needs more than %u MiB", PK_MAX_ARENA >> 20);
            return NULL;
        }
        c = malloc(sizeof *c + cap);
        if (c == NULL) {
            dcs_pk_err(u, DCS_ERR_NOMEM, "out of memory");
            return NULL;
        }
        c->next = u->arena;
        c->used = 0;
        c->cap = cap;
        u->arena = c;
        u->arena_bytes += cap;
    }
    void *p = (char *)c->mem + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

static pv *new_pv(unpickler *u, pv_kind kind) {
    pv *v = dcs_pk_alloc(u, sizeof *v);
    if (v != NULL) v->kind = kind;
    return v;
}

/* A NUL-terminated arena copy of n bytes. */
char *dcs_pk_strdup(unpickler *u, const void *s, size_t n) {
    if (n >= PK_MAX_ARENA) {
        dcs_pk_err(u, DCS_ERR_NOMEM, "a string of %zu bytes is too long", n);
        return NULL;
    }
    char *c = dcs_pk_alloc(u, n + 1);
    if (c != NULL) memcpy(c, s, n);
    return c;
}

/* Append to a tuple, list or dict (grows by doubling inside the arena). */
static dcs_status seq_push(unpickler *u, pv *seq, pv *item) {
    if (seq->u.seq.n == seq->u.seq.cap) {
        size_t cap = seq->u.seq.cap ? seq->u.seq.cap * 2 : 4;
        if (cap > PK_MAX_ARENA / sizeof(pv *))
            return dcs_pk_err(u, DCS_ERR_NOMEM, "a container is too large");
        pv **v = dcs_pk_alloc(u, cap * sizeof *v);
        if (v == NULL) return DCS_ERR_NOMEM;
        if (seq->u.seq.n) memcpy(v, seq->u.seq.v, seq->u.seq.n * sizeof *v);
        seq->u.seq.v = v;
        seq->u.seq.cap = cap;
    }
    seq->u.seq.v[seq->u.seq.n++] = item;
    return DCS_OK;
}

/* ---------------------------------------------------------------- stack */

static dcs_status push(unpickler *u, pv *v) {
    if (v == NULL) /* allocation failed; error already set */
        return DCS_ERR_NOMEM;
    if (u->sp == u->stack_cap) {
        if (u->stack_cap >= PK_MAX_STACK)
            return dcs_pk_err(u, DCS_ERR_NOMEM, "byte %zu: pickle stack deeper than %u", u->op_pos,
                              PK_MAX_STACK);
        size_t cap = u->stack_cap ? u->stack_cap * 2 : 64;
        pv **s = realloc(u->stack, cap * sizeof *s);
        if (s == NULL) return dcs_pk_err(u, DCS_ERR_NOMEM, "out of memory");
        u->stack = s;
        u->stack_cap = cap;
    }
    u->stack[u->sp++] = v;
    return DCS_OK;
}

/* Height of the stack at the innermost open MARK (0 if none). */
static size_t frame_base(const unpickler *u) { return u->n_marks ? u->marks[u->n_marks - 1] : 0; }

static dcs_status pop(unpickler *u, pv **out) {
    if (u->sp <= frame_base(u))
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: opcode 0x%02x pops an empty stack", u->op_pos,
                          u->p[u->op_pos]);
    *out = u->stack[--u->sp];
    return DCS_OK;
}

static dcs_status top(unpickler *u, pv **out) {
    if (u->sp <= frame_base(u))
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: opcode 0x%02x needs a value on the stack", u->op_pos,
                          u->p[u->op_pos]);
    *out = u->stack[u->sp - 1];
    return DCS_OK;
}

static dcs_status push_mark(unpickler *u) {
    if (u->n_marks == u->marks_cap) {
        if (u->marks_cap >= PK_MAX_MARKS)
            return dcs_pk_err(u, DCS_ERR_NOMEM, "byte %zu: more than %u nested MARKs", u->op_pos,
                              PK_MAX_MARKS);
        size_t cap = u->marks_cap ? u->marks_cap * 2 : 16;
        size_t *m = realloc(u->marks, cap * sizeof *m);
        if (m == NULL) return dcs_pk_err(u, DCS_ERR_NOMEM, "out of memory");
        u->marks = m;
        u->marks_cap = cap;
    }
    u->marks[u->n_marks++] = u->sp;
    return DCS_OK;
}

/* Pop the MARK and everything above it: the *n popped values stay readable
 * at *items (inside u->stack) until the next push. */
static dcs_status pop_mark(unpickler *u, pv ***items, size_t *n) {
    if (u->n_marks == 0)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: opcode 0x%02x without a MARK", u->op_pos,
                          u->p[u->op_pos]);
    size_t base = u->marks[--u->n_marks];
    *items = u->stack + base;
    *n = u->sp - base;
    u->sp = base;
    return DCS_OK;
}

/* ---------------------------------------------------------------- memo */

static dcs_status memo_put(unpickler *u, uint64_t idx) {
    pv *v;
    dcs_status st = top(u, &v);
    if (st != DCS_OK) return st;
    if (idx >= PK_MAX_MEMO || idx > u->len)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: memo index %llu is out of range", u->op_pos,
                          (unsigned long long)idx);
    if (idx >= u->memo_cap) {
        size_t cap = u->memo_cap ? u->memo_cap : 64;
        while (cap <= idx) cap *= 2;
        pv **m = realloc(u->memo, cap * sizeof *m);
        if (m == NULL) return dcs_pk_err(u, DCS_ERR_NOMEM, "out of memory");
        memset(m + u->memo_cap, 0, (cap - u->memo_cap) * sizeof *m);
        u->memo = m;
        u->memo_cap = cap;
    }
    u->memo_used += u->memo[idx] == NULL;
    u->memo[idx] = v;
    return DCS_OK;
}

static dcs_status memo_get(unpickler *u, uint64_t idx) {
    if (idx >= u->memo_cap || u->memo[idx] == NULL)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: memo slot %llu is empty", u->op_pos,
                          (unsigned long long)idx);
    return push(u, u->memo[idx]);
}

/* ---------------------------------------------------------------- reading */

static dcs_status take(unpickler *u, uint64_t n, const uint8_t **out) {
    if (n > u->len - u->pos)
        return dcs_pk_err(u, DCS_ERR_FORMAT,
                          "byte %zu: pickle is truncated (opcode 0x%02x needs "
                          "%llu more bytes, %zu left)",
                          u->op_pos, u->p[u->op_pos], (unsigned long long)n, u->len - u->pos);
    *out = u->p + u->pos;
    u->pos += (size_t)n;
    return DCS_OK;
}

/* An unsigned little-endian argument of `width` bytes. */
static dcs_status take_uint(unpickler *u, int width, uint64_t *out) {
    const uint8_t *b;
    dcs_status st = take(u, (uint64_t)width, &b);
    if (st != DCS_OK) return st;
    uint64_t v = 0;
    for (int i = width - 1; i >= 0; i--) v = v << 8 | b[i];
    *out = v;
    return DCS_OK;
}

static dcs_status push_int(unpickler *u, int64_t i) {
    pv *v = new_pv(u, PV_INT);
    if (v != NULL) v->u.i = i;
    return push(u, v);
}

/* LONG1: n bytes of little-endian two's complement, n <= 8 here. */
static dcs_status op_long1(unpickler *u) {
    uint64_t n = 0;
    const uint8_t *b = NULL;
    dcs_status st = take_uint(u, 1, &n);
    if (st != DCS_OK) return st;
    if (n > 8)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: integer of %llu bytes is too large", u->op_pos,
                          (unsigned long long)n);
    if ((st = take(u, n, &b)) != DCS_OK) return st;
    uint64_t v = 0;
    for (int i = (int)n - 1; i >= 0; i--) v = v << 8 | b[i];
    if (n > 0 && n < 8 && (b[n - 1] & 0x80)) v |= ~(uint64_t)0 << (8 * n); /* sign-extend */
    int64_t s;
    memcpy(&s, &v, sizeof s);
    return push_int(u, s);
}

static dcs_status op_binfloat(unpickler *u) {
    const uint8_t *b;
    dcs_status st = take(u, 8, &b);
    if (st != DCS_OK) return st;
    uint64_t bits = 0;
    for (int i = 0; i < 8; i++) /* big-endian */
        bits = bits << 8 | b[i];
    pv *v = new_pv(u, PV_FLOAT);
    if (v != NULL) memcpy(&v->u.f, &bits, sizeof v->u.f);
    return push(u, v);
}

/* A string or bytes value whose length is a `width`-byte prefix. */
static dcs_status op_string(unpickler *u, int width, pv_kind kind) {
    uint64_t n = 0;
    const uint8_t *b = NULL;
    dcs_status st = take_uint(u, width, &n);
    if (st == DCS_OK) st = take(u, n, &b);
    if (st != DCS_OK) return st;
    pv *v = new_pv(u, kind);
    if (v == NULL) return DCS_ERR_NOMEM;
    v->u.str.s = dcs_pk_strdup(u, b, (size_t)n);
    v->u.str.len = (size_t)n;
    return push(u, v->u.str.s ? v : NULL);
}

/* ---------------------------------------------------------------- globals */

static bool is_lit(const char *s, size_t n, const char *lit) {
    return n == strlen(lit) && memcmp(s, lit, n) == 0;
}

/* The error for a global outside the allowed set; unprintable bytes of the
 * name are shown as '?'. */
static dcs_status refuse_global(unpickler *u, const char *mod, size_t ml, const char *name, size_t nl) {
    char shown[160];
    size_t k = 0;
    for (size_t i = 0; i < ml + 1 + nl && k + 1 < sizeof shown; i++) {
        char c = i < ml ? mod[i] : i == ml ? '.' : name[i - ml - 1];
        shown[k++] = (c >= 0x20 && c < 0x7f) ? c : '?';
    }
    shown[k] = '\0';
    return dcs_pk_err(u, DCS_ERR_FORMAT,
                      "pickle references global '%s', which a state_dict never "
                      "needs; refusing to load",
                      shown);
}

/* GLOBAL / STACK_GLOBAL: push one of the allowed globals, refuse the rest. */
static dcs_status resolve_global(unpickler *u, const char *mod, size_t ml, const char *name, size_t nl) {
    pv *g = new_pv(u, PV_GLOBAL);
    if (g == NULL) return DCS_ERR_NOMEM;
    if (is_lit(mod, ml, "collections") && is_lit(name, nl, "OrderedDict")) {
        g->u.glob.kind = G_ORDERED_DICT;
        return push(u, g);
    }
    if (is_lit(mod, ml, "torch._utils") && is_lit(name, nl, "_rebuild_tensor_v2")) {
        g->u.glob.kind = G_REBUILD_TENSOR;
        return push(u, g);
    }
    if (is_lit(mod, ml, "torch._utils") && is_lit(name, nl, "_rebuild_parameter")) {
        g->u.glob.kind = G_REBUILD_PARAMETER;
        return push(u, g);
    }
    if (is_lit(mod, ml, "torch"))
        for (size_t i = 0; i < sizeof storage_classes / sizeof storage_classes[0]; i++)
            if (is_lit(name, nl, storage_classes[i].cls)) {
                g->u.glob.kind = G_STORAGE;
                g->u.glob.cls = &storage_classes[i];
                return push(u, g);
            }
    return refuse_global(u, mod, ml, name, nl);
}

/* GLOBAL: "module\nname\n" */
static dcs_status op_global(unpickler *u) {
    const char *s = (const char *)u->p + u->pos;
    size_t left = u->len - u->pos;
    const char *nl1 = memchr(s, '\n', left);
    const char *nl2 = nl1 ? memchr(nl1 + 1, '\n', left - (size_t)(nl1 + 1 - s)) : NULL;
    if (nl2 == NULL)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: GLOBAL without two newline-ended names", u->op_pos);
    u->pos += (size_t)(nl2 + 1 - s);
    return resolve_global(u, s, (size_t)(nl1 - s), nl1 + 1, (size_t)(nl2 - nl1 - 1));
}

static dcs_status op_stack_global(unpickler *u) {
    pv *name = NULL, *mod = NULL;
    dcs_status st = pop(u, &name);
    if (st == DCS_OK) st = pop(u, &mod);
    if (st != DCS_OK) return st;
    if (name->kind != PV_STR || mod->kind != PV_STR)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: STACK_GLOBAL needs two strings", u->op_pos);
    return resolve_global(u, mod->u.str.s, mod->u.str.len, name->u.str.s, name->u.str.len);
}

/* ---------------------------------------------------------------- torch objects */

static bool is_str(const pv *v, const char *lit) {
    return v->kind == PV_STR && is_lit(v->u.str.s, v->u.str.len, lit);
}

/* BINPERSID: ('storage', torch.<T>Storage, key, location, numel) -> storage */
static dcs_status op_persid(unpickler *u) {
    pv *pid = NULL;
    dcs_status st = pop(u, &pid);
    if (st != DCS_OK) return st;
    if (pid->kind != PV_TUPLE || pid->u.seq.n != 5 || !is_str(pid->u.seq.v[0], "storage") ||
        pid->u.seq.v[1]->kind != PV_GLOBAL || pid->u.seq.v[1]->u.glob.kind != G_STORAGE ||
        pid->u.seq.v[2]->kind != PV_STR || pid->u.seq.v[3]->kind != PV_STR ||
        pid->u.seq.v[4]->kind != PV_INT || pid->u.seq.v[4]->u.i < 0)
        return dcs_pk_err(u, DCS_ERR_FORMAT,
                          "byte %zu: persistent id is not ('storage', "
                          "torch.<T>Storage, key, location, numel)",
                          u->op_pos);
    const storage_class *cls = pid->u.seq.v[1]->u.glob.cls;
    const pv *key = pid->u.seq.v[2];
    int64_t numel = pid->u.seq.v[4]->u.i;

    /* <prefix>data/<key> */
    size_t nlen = u->prefix_len + 5 + key->u.str.len;
    char *ename = dcs_pk_alloc(u, nlen + 1);
    if (ename == NULL) return DCS_ERR_NOMEM;
    memcpy(ename, u->prefix, u->prefix_len);
    memcpy(ename + u->prefix_len, "data/", 5);
    memcpy(ename + u->prefix_len + 5, key->u.str.s, key->u.str.len);
    const zip_entry *en = dcs_zip_find(u->zip, ename, nlen);
    if (en == NULL)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "storage '%.100s' is missing: no zip entry '%.200s'",
                          key->u.str.s, ename);
    pv *s = new_pv(u, PV_STORAGE);
    if (s == NULL) return DCS_ERR_NOMEM;
    s->u.storage.cls = cls;
    s->u.storage.key = key->u.str.s;
    s->u.storage.numel = numel;
    if ((st = dcs_zip_entry_data(u->zip, en, &s->u.storage.data, &s->u.storage.size)) != DCS_OK) return st;
    uint64_t need;
    if (!dcs_mul_ok((uint64_t)numel, cls->elsize, &need) || need > s->u.storage.size)
        return dcs_pk_err(u, DCS_ERR_FORMAT,
                          "storage '%.100s' claims %lld %s elements but its zip "
                          "entry holds %llu bytes",
                          key->u.str.s, (long long)numel, cls->dtname, (unsigned long long)s->u.storage.size);
    return push(u, s);
}

/* A tuple of at most DCS_MAX_NDIM ints (>= 0 when nonneg) into out. */
static bool int_tuple(const pv *t, bool nonneg, int64_t *out, int *n) {
    if (t->kind != PV_TUPLE || t->u.seq.n > DCS_MAX_NDIM) return false;
    for (size_t i = 0; i < t->u.seq.n; i++) {
        const pv *v = t->u.seq.v[i];
        if (v->kind != PV_INT || (nonneg && v->u.i < 0)) return false;
        out[i] = v->u.i;
    }
    *n = (int)t->u.seq.n;
    return true;
}

/* _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata]).
 * Only the structure is checked here; the extent is checked in add_tensor,
 * where the tensor's name is known. */
static dcs_status rebuild_tensor(unpickler *u, const pv *args, pv **out) {
    pv *t = new_pv(u, PV_TENSOR);
    if (t == NULL) return DCS_ERR_NOMEM;
    pk_tensor *tt = &t->u.tensor;
    int nstride = -1;
    pv *const *a = args->u.seq.v;
    if (args->u.seq.n < 6 || args->u.seq.n > 7 || a[0]->kind != PV_STORAGE || a[1]->kind != PV_INT ||
        a[1]->u.i < 0 || !int_tuple(a[2], true, tt->size, &tt->ndim) ||
        !int_tuple(a[3], false, tt->stride, &nstride) || nstride != tt->ndim ||
        (a[4]->kind != PV_BOOL && a[4]->kind != PV_INT))
        return dcs_pk_err(u, DCS_ERR_FORMAT,
                          "byte %zu: _rebuild_tensor_v2 arguments are not "
                          "(storage, offset, size, stride, requires_grad, hooks[, metadata]) with at "
                          "most %d dimensions",
                          u->op_pos, DCS_MAX_NDIM);
    tt->storage = &a[0]->u.storage;
    tt->offset = a[1]->u.i;
    *out = t;
    return DCS_OK;
}

/* REDUCE: call one of the allowed globals. */
static dcs_status op_reduce(unpickler *u) {
    pv *args = NULL, *fn = NULL, *res = NULL;
    dcs_status st = pop(u, &args);
    if (st == DCS_OK) st = pop(u, &fn);
    if (st != DCS_OK) return st;
    if (fn->kind != PV_GLOBAL || args->kind != PV_TUPLE)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: REDUCE of a %s with a %s", u->op_pos,
                          dcs_pv_kind_name[fn->kind], dcs_pv_kind_name[args->kind]);
    switch (fn->u.glob.kind) {
    case G_ORDERED_DICT:
        if (args->u.seq.n != 0)
            return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: OrderedDict called with arguments", u->op_pos);
        res = new_pv(u, PV_DICT);
        break;
    case G_REBUILD_TENSOR:
        if ((st = rebuild_tensor(u, args, &res)) != DCS_OK) return st;
        break;
    case G_REBUILD_PARAMETER:
        if (args->u.seq.n < 1 || args->u.seq.v[0]->kind != PV_TENSOR)
            return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: _rebuild_parameter without a tensor", u->op_pos);
        res = args->u.seq.v[0];
        break;
    case G_STORAGE: return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: a storage class is called", u->op_pos);
    }
    return push(u, res);
}

/* BUILD: only on a dict (OrderedDict's __dict__ such as _metadata); the
 * state is ignored. */
static dcs_status op_build(unpickler *u) {
    pv *state = NULL, *obj = NULL;
    dcs_status st = pop(u, &state);
    if (st == DCS_OK) st = top(u, &obj);
    if (st != DCS_OK) return st;
    if (obj->kind != PV_DICT)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: BUILD on a %s", u->op_pos,
                          dcs_pv_kind_name[obj->kind]);
    return DCS_OK;
}

/* ---------------------------------------------------------------- containers */

static dcs_status op_tuple_n(unpickler *u, size_t n) {
    pv *t = new_pv(u, PV_TUPLE);
    if (t == NULL) return DCS_ERR_NOMEM;
    if (u->sp - frame_base(u) < n)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: TUPLE%zu needs %zu values", u->op_pos, n, n);
    for (size_t i = u->sp - n; i < u->sp; i++) {
        dcs_status st = seq_push(u, t, u->stack[i]);
        if (st != DCS_OK) return st;
    }
    u->sp -= n;
    return push(u, t);
}

/* TUPLE, LIST, DICT: a new container from the items above the MARK. */
static dcs_status op_from_mark(unpickler *u, pv_kind kind) {
    pv **items = NULL;
    size_t n = 0;
    dcs_status st = pop_mark(u, &items, &n);
    if (st != DCS_OK) return st;
    if (kind == PV_DICT && n % 2 != 0)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: DICT with an odd number of items", u->op_pos);
    pv *c = new_pv(u, kind);
    if (c == NULL) return DCS_ERR_NOMEM;
    for (size_t i = 0; i < n && st == DCS_OK; i++) st = seq_push(u, c, items[i]);
    return st == DCS_OK ? push(u, c) : st;
}

/* APPEND/APPENDS (kind PV_LIST) and SETITEM/SETITEMS (PV_DICT): add the
 * items to the container below them. */
static dcs_status add_items(unpickler *u, pv_kind kind, pv **items, size_t n) {
    pv *c = NULL;
    dcs_status st = top(u, &c);
    if (st != DCS_OK) return st;
    if (c->kind != kind)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: %s into a %s", u->op_pos,
                          kind == PV_LIST ? "APPEND" : "SETITEM", dcs_pv_kind_name[c->kind]);
    if (kind == PV_DICT && n % 2 != 0)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: SETITEMS with an odd number of items", u->op_pos);
    for (size_t i = 0; i < n && st == DCS_OK; i++) st = seq_push(u, c, items[i]);
    return st;
}

static dcs_status op_add_one(unpickler *u, pv_kind kind, size_t n) {
    if (u->sp - frame_base(u) < n + 1)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "byte %zu: opcode 0x%02x needs %zu values", u->op_pos,
                          u->p[u->op_pos], n + 1);
    u->sp -= n;
    return add_items(u, kind, u->stack + u->sp, n);
}

static dcs_status op_add_mark(unpickler *u, pv_kind kind) {
    pv **items = NULL;
    size_t n = 0;
    dcs_status st = pop_mark(u, &items, &n);
    return st == DCS_OK ? add_items(u, kind, items, n) : st;
}

/* ---------------------------------------------------------------- dispatch */

static dcs_status push_kind(unpickler *u, pv_kind kind, int64_t i) {
    pv *v = new_pv(u, kind);
    if (v != NULL) v->u.i = i;
    return push(u, v);
}

/* Execute one opcode. *stop is set by STOP. */
static dcs_status unpickle_step(unpickler *u, bool *stop) {
    const uint8_t *b = NULL;
    uint64_t x = 0;
    pv *v = NULL;
    dcs_status st;
    u->op_pos = u->pos;
    if (u->pos >= u->len)
        return dcs_pk_err(u, DCS_ERR_FORMAT, "pickle ends at byte %zu without STOP", u->len);
    uint8_t op = u->p[u->pos++];
    switch (op) {
    case 0x80: /* PROTO */
        if ((st = take_uint(u, 1, &x)) != DCS_OK) return st;
        if (x > 5)
            return dcs_pk_err(u, DCS_ERR_FORMAT, "pickle protocol %llu is not supported",
                              (unsigned long long)x);
        return DCS_OK;
    case 0x95: /* FRAME: a length hint; the frame's opcodes follow inline */ return take(u, 8, &b);
    case '.': /* STOP */ *stop = true; return DCS_OK;
    case '(': return push_mark(u); /* MARK */
    case '0':                      /* POP: the top value, or the innermost MARK if nothing is above it */
        if (u->sp > frame_base(u)) {
            u->sp--;
            return DCS_OK;
        }
        if (u->n_marks > 0) {
            u->n_marks--;
            return DCS_OK;
        }
        return pop(u, &v); /* reports the empty stack */
    case '1': {            /* POP_MARK */
        pv **items;
        size_t n;
        return pop_mark(u, &items, &n);
    }
    case '2': /* DUP */ return (st = top(u, &v)) != DCS_OK ? st : push(u, v);
    case 'N': return push_kind(u, PV_NONE, 0);  /* NONE */
    case 0x88: return push_kind(u, PV_BOOL, 1); /* NEWTRUE */
    case 0x89: return push_kind(u, PV_BOOL, 0); /* NEWFALSE */
    case 'K':                                   /* BININT1 */
    case 'M':                                   /* BININT2 */
        if ((st = take_uint(u, op == 'K' ? 1 : 2, &x)) != DCS_OK) return st;
        return push_int(u, (int64_t)x);
    case 'J': /* BININT: signed 32-bit */
        if ((st = take_uint(u, 4, &x)) != DCS_OK) return st;
        return push_int(u, (int64_t)(int32_t)(uint32_t)x);
    case 0x8a: return op_long1(u);                 /* LONG1 */
    case 'G': return op_binfloat(u);               /* BINFLOAT */
    case 'X': return op_string(u, 4, PV_STR);      /* BINUNICODE */
    case 0x8c: return op_string(u, 1, PV_STR);     /* SHORT_BINUNICODE */
    case 0x8d: return op_string(u, 8, PV_STR);     /* BINUNICODE8 */
    case 'U': return op_string(u, 1, PV_STR);      /* SHORT_BINSTRING */
    case 'T': return op_string(u, 4, PV_STR);      /* BINSTRING */
    case 'C': return op_string(u, 1, PV_BYTES);    /* SHORT_BINBYTES */
    case 'B': return op_string(u, 4, PV_BYTES);    /* BINBYTES */
    case 0x8e: return op_string(u, 8, PV_BYTES);   /* BINBYTES8 */
    case ')': return push(u, new_pv(u, PV_TUPLE)); /* EMPTY_TUPLE */
    case 0x85: return op_tuple_n(u, 1);            /* TUPLE1 */
    case 0x86: return op_tuple_n(u, 2);            /* TUPLE2 */
    case 0x87: return op_tuple_n(u, 3);            /* TUPLE3 */
    case 't': return op_from_mark(u, PV_TUPLE);    /* TUPLE */
    case ']': return push(u, new_pv(u, PV_LIST));  /* EMPTY_LIST */
    case 'l': return op_from_mark(u, PV_LIST);     /* LIST */
    case 'a': return op_add_one(u, PV_LIST, 1);    /* APPEND */
    case 'e': return op_add_mark(u, PV_LIST);      /* APPENDS */
    case '}': return push(u, new_pv(u, PV_DICT));  /* EMPTY_DICT */
    case 'd': return op_from_mark(u, PV_DICT);     /* DICT */
    case 's': return op_add_one(u, PV_DICT, 2);    /* SETITEM */
    case 'u': return op_add_mark(u, PV_DICT);      /* SETITEMS */
    case 'c': return op_global(u);                 /* GLOBAL */
    case 0x93: return op_stack_global(u);          /* STACK_GLOBAL */
    case 'R': return op_reduce(u);                 /* REDUCE */
    case 'b': return op_build(u);                  /* BUILD */
    case 'Q': return op_persid(u);                 /* BINPERSID */
    case 'q':                                      /* BINPUT */
    case 'r':                                      /* LONG_BINPUT */
        if ((st = take_uint(u, op == 'q' ? 1 : 4, &x)) != DCS_OK) return st;
        return memo_put(u, x);
    case 0x94: return memo_put(u, u->memo_used); /* MEMOIZE: len(memo) */
    case 'h':                                    /* BINGET */
    case 'j':                                    /* LONG_BINGET */
        if ((st = take_uint(u, op == 'h' ? 1 : 4, &x)) != DCS_OK) return st;
        return memo_get(u, x);
    default:
        return dcs_pk_err(u, DCS_ERR_FORMAT,
                          "byte %zu: pickle opcode 0x%02x ('%c') is not "
                          "supported",
                          u->op_pos, op, (op >= 0x20 && op < 0x7f) ? op : '?');
    }
}

void dcs_unpickler_free(unpickler *u) {
    while (u->arena != NULL) {
        pk_chunk *next = u->arena->next;
        free(u->arena);
        u->arena = next;
    }
    free(u->stack);
    free(u->marks);
    free(u->memo);
}

/* Run the machine to STOP; *result is the single value left. */
dcs_status dcs_unpickle(unpickler *u, pv **result) {
    bool stop = false;
    while (!stop) {
        dcs_status st = unpickle_step(u, &stop);
        if (st != DCS_OK) return st;
    }
    if (u->n_marks != 0 || u->sp != 1)
        return dcs_pk_err(u, DCS_ERR_FORMAT,
                          "byte %zu: STOP with %zu values and %zu open MARKs on "
                          "the stack (expected one value)",
                          u->op_pos, u->sp, u->n_marks);
    *result = u->stack[0];
    return DCS_OK;
}
