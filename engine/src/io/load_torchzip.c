/*
 * load_torchzip.c -- reader for PyTorch zip checkpoints (torch.save of a
 * state_dict: pytorch_model.bin and its shards), without torch and without
 * ever executing pickle code.
 *
 * The file is a ZIP archive whose entries are STORED (uncompressed):
 *   <prefix>/data.pkl       the pickled state_dict (protocol 2)
 *   <prefix>/data/<key>     raw little-endian storages, one per key
 *   <prefix>/byteorder, version, .data/serialization_id, ...  (ignored)
 * Large archives use ZIP64 records; torch pads each local header's extra
 * field so data starts 64-byte aligned. We read the End Of Central Directory
 * (and the ZIP64 locator/record), the central directory (with ZIP64 extra
 * fields), then each needed entry's local header, which alone says where
 * its data starts. Every offset is bounds-checked against the buffer.
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
 * ignored. Tensors lie inside their storage, which must lie inside its zip
 * entry. torch.save keeps views as they are: a tensor may be strided
 * (transposed: stride (1, V); expanded: stride 0). Such a view is gathered
 * into a contiguous copy owned by the table, after checking that every
 * element it reaches lies in the storage (strides >= 0, the furthest
 * element offset + sum (size_i - 1) stride_i < numel) and that expanded
 * copies stay small (DCS_MAX_GATHER_BYTES beyond their storages per file). Storage classes other than
 * Float/Half/BFloat16 name dtypes the engine does not load: such tensors are
 * refused, except the ignorable buffers of dcs_tt_skippable_buffer.
 *
 * Memory: all pickle values live in one arena freed at the end (values are
 * shared through the memo, so nothing is freed earlier). The arena, the
 * stack, the mark stack and the memo are bounded below.
 */
#include "dcs_io.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PK_MAX_ARENA (256u << 20)   /* bytes of unpickled values             */
#define PK_MAX_STACK (1u << 20)     /* values on the stack                   */
#define PK_MAX_MARKS (1u << 16)     /* open MARKs                            */
#define PK_MAX_MEMO (1u << 22)      /* memo slots                            */
#define PK_CHUNK (64u << 10)        /* arena chunk size                      */

/* ================================================================ bytes */

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const uint8_t *p) { return rd32(p) | (uint64_t)rd32(p + 4) << 32; }

/* Does [off, off + n) fit in a buffer of len bytes? */
static bool in_bounds(uint64_t off, uint64_t n, uint64_t len)
{
    return off <= len && n <= len - off;
}

/* How much of a (not NUL-terminated) name to print: "%.*s". */
static int shown(size_t name_len)
{
    return name_len > 200 ? 200 : (int)name_len;
}

/* ================================================================ zip */

#define ZIP_EOCD_SIG 0x06054b50u      /* end of central directory, 22 bytes */
#define ZIP64_LOC_SIG 0x07064b50u     /* ZIP64 EOCD locator, 20 bytes       */
#define ZIP64_EOCD_SIG 0x06064b50u    /* ZIP64 EOCD record, 56 bytes        */
#define ZIP_CDIR_SIG 0x02014b50u      /* central directory entry, 46 bytes  */
#define ZIP_LOCAL_SIG 0x04034b50u     /* local file header, 30 bytes        */
#define ZIP64_EXTRA_ID 0x0001u

typedef struct {
    const char *name;        /* into the buffer, not NUL-terminated        */
    size_t name_len;
    uint64_t comp_size, size, local_off;
    uint16_t method, flags;
} zip_entry;

typedef struct {
    const uint8_t *buf;
    uint64_t len;
    const char *path;
    dcs_err *e;
    zip_entry *ent;          /* sorted by name                              */
    size_t n;
} zip_archive;

/* Where the central directory is, from the (ZIP64) end records. */
typedef struct {
    uint64_t n_entries, cd_size, cd_off;
} zip_end;

static dcs_status find_eocd(const zip_archive *z, uint64_t *pos)
{
    if (z->len >= 22) {
        uint64_t lowest = z->len - 22 > 0xffff ? z->len - 22 - 0xffff : 0;
        for (uint64_t p = z->len - 22 + 1; p-- > lowest;)
            if (rd32(z->buf + p) == ZIP_EOCD_SIG && p + 22 + rd16(z->buf + p + 20) <= z->len) {
                *pos = p;
                return DCS_OK;
            }
    }
    return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: not a zip archive, or truncated (no end of "
                      "central directory record)", z->path);
}

static dcs_status read_zip64_end(const zip_archive *z, uint64_t eocd, zip_end *end)
{
    const uint8_t *loc = z->buf + eocd - 20;
    uint64_t rec = rd64(loc + 8);
    if (rd32(loc + 4) != 0 || rd32(loc + 16) > 1 || !in_bounds(rec, 56, eocd - 20) ||
        rd32(z->buf + rec) != ZIP64_EOCD_SIG)
        return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: bad ZIP64 end of central directory "
                          "locator", z->path);
    const uint8_t *r = z->buf + rec;
    if (rd32(r + 16) != 0 || rd32(r + 20) != 0 || rd64(r + 24) != rd64(r + 32))
        return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: multi-disk zip archives are not "
                          "supported", z->path);
    end->n_entries = rd64(r + 32);
    end->cd_size = rd64(r + 40);
    end->cd_off = rd64(r + 48);
    return DCS_OK;
}

static dcs_status read_end(const zip_archive *z, zip_end *end)
{
    uint64_t eocd = 0;
    dcs_status st = find_eocd(z, &eocd);
    if (st != DCS_OK)
        return st;
    const uint8_t *p = z->buf + eocd;
    if (eocd >= 20 && rd32(p - 20) == ZIP64_LOC_SIG) {
        st = read_zip64_end(z, eocd, end);
    } else {
        if (rd16(p + 4) != 0 || rd16(p + 6) != 0 || rd16(p + 8) != rd16(p + 10))
            return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: multi-disk zip archives are not "
                              "supported", z->path);
        end->n_entries = rd16(p + 10);
        end->cd_size = rd32(p + 12);
        end->cd_off = rd32(p + 16);
        if (end->n_entries == 0xffff || end->cd_size == 0xffffffffu ||
            end->cd_off == 0xffffffffu)
            return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip end record needs a ZIP64 record "
                              "that is missing", z->path);
    }
    if (st != DCS_OK)
        return st;
    if (!in_bounds(end->cd_off, end->cd_size, eocd))
        return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip central directory [%llu, +%llu) lies "
                          "outside the archive", z->path, (unsigned long long)end->cd_off,
                          (unsigned long long)end->cd_size);
    if (end->n_entries > end->cd_size / 46)
        return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip central directory of %llu bytes "
                          "cannot hold %llu entries", z->path, (unsigned long long)end->cd_size,
                          (unsigned long long)end->n_entries);
    return DCS_OK;
}

/* ZIP64 extended information: the 8-byte values of the fields whose 32-bit
 * header value is 0xffffffff, in the order size, comp_size, local_off. */
static dcs_status read_zip64_extra(const zip_archive *z, const uint8_t *x, size_t xlen,
                                   zip_entry *en)
{
    uint64_t *fields[3] = {&en->size, &en->comp_size, &en->local_off};
    bool need[3] = {en->size == 0xffffffffu, en->comp_size == 0xffffffffu,
                    en->local_off == 0xffffffffu};
    if (!need[0] && !need[1] && !need[2])
        return DCS_OK;
    size_t pos = 0;
    while (pos + 4 <= xlen) {
        uint16_t id = rd16(x + pos), sz = rd16(x + pos + 2);
        if (sz > xlen - pos - 4)
            break;
        if (id == ZIP64_EXTRA_ID) {
            size_t q = pos + 4, qend = pos + 4 + sz;
            for (int i = 0; i < 3; i++) {
                if (!need[i])
                    continue;
                if (q + 8 > qend)
                    break;
                *fields[i] = rd64(x + q);
                need[i] = false;
                q += 8;
            }
            break;
        }
        pos += 4 + (size_t)sz;
    }
    if (need[0] || need[1] || need[2])
        return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip entry '%.*s' lacks the ZIP64 sizes or "
                          "offset its header announces", z->path, shown(en->name_len), en->name);
    return DCS_OK;
}

static int cmp_entry(const void *a, const void *b)
{
    const zip_entry *x = a, *y = b;
    size_t n = x->name_len < y->name_len ? x->name_len : y->name_len;
    int c = memcmp(x->name, y->name, n);
    if (c != 0)
        return c;
    return x->name_len < y->name_len ? -1 : x->name_len > y->name_len;
}

/* Read the central directory into z->ent (sorted; names unique). */
static dcs_status read_central_dir(zip_archive *z, const zip_end *end)
{
    z->ent = calloc(end->n_entries ? (size_t)end->n_entries : 1, sizeof *z->ent);
    if (z->ent == NULL)
        return dcs_seterr(z->e, DCS_ERR_NOMEM, "%s: out of memory", z->path);
    const uint8_t *cd = z->buf + end->cd_off;
    uint64_t pos = 0;
    for (uint64_t i = 0; i < end->n_entries; i++) {
        if (!in_bounds(pos, 46, end->cd_size) || rd32(cd + pos) != ZIP_CDIR_SIG)
            return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip central directory entry %llu is "
                              "damaged", z->path, (unsigned long long)i);
        const uint8_t *h = cd + pos;
        size_t nlen = rd16(h + 28), xlen = rd16(h + 30), clen = rd16(h + 32);
        if (!in_bounds(pos + 46, nlen + xlen + clen, end->cd_size))
            return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip central directory entry %llu runs "
                              "past the directory", z->path, (unsigned long long)i);
        zip_entry *en = &z->ent[z->n++];
        en->flags = rd16(h + 8);
        en->method = rd16(h + 10);
        en->comp_size = rd32(h + 20);
        en->size = rd32(h + 24);
        en->local_off = rd32(h + 42);
        en->name = (const char *)h + 46;
        en->name_len = nlen;
        dcs_status st = read_zip64_extra(z, h + 46 + nlen, xlen, en);
        if (st != DCS_OK)
            return st;
        pos += 46 + nlen + xlen + clen;
    }
    qsort(z->ent, z->n, sizeof *z->ent, cmp_entry);
    for (size_t i = 1; i < z->n; i++)
        if (cmp_entry(&z->ent[i - 1], &z->ent[i]) == 0)
            return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip entry '%.*s' appears twice",
                              z->path, shown(z->ent[i].name_len), z->ent[i].name);
    return DCS_OK;
}

static dcs_status zip_open(zip_archive *z, const uint8_t *buf, uint64_t len, const char *path,
                           dcs_err *e)
{
    memset(z, 0, sizeof *z);
    z->buf = buf;
    z->len = len;
    z->path = path;
    z->e = e;
    zip_end end = {0, 0, 0};
    dcs_status st = read_end(z, &end);
    if (st == DCS_OK)
        st = read_central_dir(z, &end);
    return st;
}

static const zip_entry *zip_find(const zip_archive *z, const char *name, size_t len)
{
    zip_entry key = {.name = name, .name_len = len};
    return z->n ? bsearch(&key, z->ent, z->n, sizeof *z->ent, cmp_entry) : NULL;
}

/* The bytes of a stored entry, located through its local header. */
static dcs_status zip_entry_data(const zip_archive *z, const zip_entry *en,
                                 const uint8_t **data, uint64_t *size)
{
    int nl = shown(en->name_len);
    if (en->flags & 1u)
        return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip entry '%.*s' is encrypted", z->path,
                          nl, en->name);
    if (en->method != 0 || en->comp_size != en->size)
        return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip entry '%.*s' is compressed (method "
                          "%u); torch checkpoints store entries uncompressed", z->path, nl,
                          en->name, en->method);
    if (!in_bounds(en->local_off, 30, z->len) || rd32(z->buf + en->local_off) != ZIP_LOCAL_SIG)
        return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip entry '%.*s': no local header at "
                          "offset %llu", z->path, nl, en->name,
                          (unsigned long long)en->local_off);
    const uint8_t *h = z->buf + en->local_off;
    uint64_t nlen = rd16(h + 26), xlen = rd16(h + 28);
    if (rd16(h + 8) != 0 || nlen != en->name_len ||
        !in_bounds(en->local_off + 30, nlen, z->len) || memcmp(h + 30, en->name, nlen) != 0)
        return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: zip entry '%.*s': local header disagrees "
                          "with the central directory", z->path, nl, en->name);
    uint64_t start = en->local_off + 30 + nlen + xlen;
    if (!in_bounds(start, en->size, z->len))
        return dcs_seterr(z->e, DCS_ERR_IO, "%s: zip entry '%.*s' (%llu bytes at %llu) runs "
                          "past the end of the file (%llu bytes; truncated?)", z->path, nl,
                          en->name, (unsigned long long)en->size, (unsigned long long)start,
                          (unsigned long long)z->len);
    *data = z->buf + start;
    *size = en->size;
    return DCS_OK;
}

/* The one entry "<prefix>/data.pkl" with a prefix free of '/'. */
static dcs_status find_data_pkl(const zip_archive *z, const zip_entry **out)
{
    static const char tail[] = "/data.pkl";
    const size_t tl = sizeof tail - 1;
    *out = NULL;
    for (size_t i = 0; i < z->n; i++) {
        const zip_entry *en = &z->ent[i];
        if (en->name_len <= tl || memcmp(en->name + en->name_len - tl, tail, tl) != 0 ||
            memchr(en->name, '/', en->name_len - tl) != NULL)
            continue;
        if (*out != NULL)
            return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: more than one data.pkl in the zip "
                              "archive", z->path);
        *out = en;
    }
    if (*out == NULL)
        return dcs_seterr(z->e, DCS_ERR_FORMAT, "%s: no <name>/data.pkl in the zip archive "
                          "(not a PyTorch checkpoint?)", z->path);
    return DCS_OK;
}

/* ================================================================ values */

typedef enum {
    PV_NONE, PV_BOOL, PV_INT, PV_FLOAT, PV_STR, PV_BYTES, PV_TUPLE, PV_LIST, PV_DICT,
    PV_GLOBAL, PV_STORAGE, PV_TENSOR
} pv_kind;

static const char *const pv_kind_name[] = {
    "None", "bool", "int", "float", "str", "bytes", "tuple", "list", "dict",
    "global", "storage", "tensor"};

typedef enum { G_ORDERED_DICT, G_REBUILD_TENSOR, G_REBUILD_PARAMETER, G_STORAGE } glob_kind;

/* A torch storage class: which dtype its elements have. */
typedef struct {
    const char *cls;        /* torch.<cls>                                */
    int dtype;              /* dcs_dtype, or -1: a dtype we do not load   */
    size_t elsize;
    const char *dtname;
} storage_class;

static const storage_class storage_classes[] = {
    {"FloatStorage", DCS_F32, 4, "float32"},  {"HalfStorage", DCS_F16, 2, "float16"},
    {"BFloat16Storage", DCS_BF16, 2, "bfloat16"}, {"DoubleStorage", -1, 8, "float64"},
    {"LongStorage", -1, 8, "int64"},          {"IntStorage", -1, 4, "int32"},
    {"ShortStorage", -1, 2, "int16"},         {"CharStorage", -1, 1, "int8"},
    {"ByteStorage", -1, 1, "uint8"},          {"BoolStorage", -1, 1, "bool"},
};

typedef struct pv pv;

typedef struct {            /* ('storage', cls, key, location, numel)    */
    const storage_class *cls;
    const char *key;
    int64_t numel;
    const uint8_t *data;    /* the zip entry <prefix>/data/<key>         */
    uint64_t size;
} pk_storage;

typedef struct {            /* _rebuild_tensor_v2 arguments               */
    const pk_storage *storage;
    int64_t offset;
    int ndim;
    int64_t size[DCS_MAX_NDIM], stride[DCS_MAX_NDIM];
} pk_tensor;

struct pv {
    pv_kind kind;
    union {
        int64_t i;                                    /* BOOL, INT        */
        double f;                                     /* FLOAT            */
        struct { char *s; size_t len; } str;          /* STR, BYTES; NUL-terminated */
        struct { pv **v; size_t n, cap; } seq;        /* TUPLE, LIST; DICT: key, value, ... */
        struct { glob_kind kind; const storage_class *cls; } glob;
        pk_storage storage;
        pk_tensor tensor;
    } u;
};

/* ================================================================ unpickler */

typedef struct pk_chunk {
    struct pk_chunk *next;
    size_t used, cap;
    max_align_t mem[];
} pk_chunk;

typedef struct {
    const uint8_t *p;       /* data.pkl                                   */
    size_t len, pos, op_pos;
    const char *path;
    const char *pkl_name;   /* "<prefix>/data.pkl" for messages (arena)  */
    const zip_archive *zip;
    const char *prefix;     /* "<prefix>/" (arena)                       */
    size_t prefix_len;
    pv **stack;
    size_t sp, stack_cap;
    size_t *marks;          /* stack heights at each open MARK            */
    size_t n_marks, marks_cap;
    pv **memo;              /* slots, NULL when unset                    */
    size_t memo_cap, memo_used;
    pk_chunk *arena;
    size_t arena_bytes;
    uint64_t gathered;      /* bytes of strided views copied beyond their storages */
    dcs_err *e;
} unpickler;

/* "<path>: <prefix>/data.pkl: <message>" */
static dcs_status pk_err(unpickler *u, dcs_status code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static dcs_status pk_err(unpickler *u, dcs_status code, const char *fmt, ...)
{
    char msg[800];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return dcs_seterr(u->e, code, "%s: %s: %s", u->path, u->pkl_name, msg);
}

static void *pk_alloc(unpickler *u, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    pk_chunk *c = u->arena;
    if (c == NULL || c->cap - c->used < n) {
        size_t cap = n > PK_CHUNK ? n : PK_CHUNK;
        if (n > PK_MAX_ARENA || u->arena_bytes + cap > PK_MAX_ARENA) {
            pk_err(u, DCS_ERR_NOMEM, "unpickling needs more than %u MiB", PK_MAX_ARENA >> 20);
            return NULL;
        }
        c = malloc(sizeof *c + cap);
        if (c == NULL) {
            pk_err(u, DCS_ERR_NOMEM, "out of memory");
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

static pv *new_pv(unpickler *u, pv_kind kind)
{
    pv *v = pk_alloc(u, sizeof *v);
    if (v != NULL)
        v->kind = kind;
    return v;
}

/* A NUL-terminated arena copy of n bytes. */
static char *pk_strdup(unpickler *u, const void *s, size_t n)
{
    if (n >= PK_MAX_ARENA) {
        pk_err(u, DCS_ERR_NOMEM, "a string of %zu bytes is too long", n);
        return NULL;
    }
    char *c = pk_alloc(u, n + 1);
    if (c != NULL)
        memcpy(c, s, n);
    return c;
}

/* Append to a tuple, list or dict (grows by doubling inside the arena). */
static dcs_status seq_push(unpickler *u, pv *seq, pv *item)
{
    if (seq->u.seq.n == seq->u.seq.cap) {
        size_t cap = seq->u.seq.cap ? seq->u.seq.cap * 2 : 4;
        if (cap > PK_MAX_ARENA / sizeof(pv *))
            return pk_err(u, DCS_ERR_NOMEM, "a container is too large");
        pv **v = pk_alloc(u, cap * sizeof *v);
        if (v == NULL)
            return DCS_ERR_NOMEM;
        if (seq->u.seq.n)
            memcpy(v, seq->u.seq.v, seq->u.seq.n * sizeof *v);
        seq->u.seq.v = v;
        seq->u.seq.cap = cap;
    }
    seq->u.seq.v[seq->u.seq.n++] = item;
    return DCS_OK;
}

/* ---------------------------------------------------------------- stack */

static dcs_status push(unpickler *u, pv *v)
{
    if (v == NULL)                   /* allocation failed; error already set */
        return DCS_ERR_NOMEM;
    if (u->sp == u->stack_cap) {
        if (u->stack_cap >= PK_MAX_STACK)
            return pk_err(u, DCS_ERR_NOMEM, "byte %zu: pickle stack deeper than %u", u->op_pos,
                          PK_MAX_STACK);
        size_t cap = u->stack_cap ? u->stack_cap * 2 : 64;
        pv **s = realloc(u->stack, cap * sizeof *s);
        if (s == NULL)
            return pk_err(u, DCS_ERR_NOMEM, "out of memory");
        u->stack = s;
        u->stack_cap = cap;
    }
    u->stack[u->sp++] = v;
    return DCS_OK;
}

/* Height of the stack at the innermost open MARK (0 if none). */
static size_t frame_base(const unpickler *u)
{
    return u->n_marks ? u->marks[u->n_marks - 1] : 0;
}

static dcs_status pop(unpickler *u, pv **out)
{
    if (u->sp <= frame_base(u))
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: opcode 0x%02x pops an empty stack",
                      u->op_pos, u->p[u->op_pos]);
    *out = u->stack[--u->sp];
    return DCS_OK;
}

static dcs_status top(unpickler *u, pv **out)
{
    if (u->sp <= frame_base(u))
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: opcode 0x%02x needs a value on the stack",
                      u->op_pos, u->p[u->op_pos]);
    *out = u->stack[u->sp - 1];
    return DCS_OK;
}

static dcs_status push_mark(unpickler *u)
{
    if (u->n_marks == u->marks_cap) {
        if (u->marks_cap >= PK_MAX_MARKS)
            return pk_err(u, DCS_ERR_NOMEM, "byte %zu: more than %u nested MARKs", u->op_pos,
                          PK_MAX_MARKS);
        size_t cap = u->marks_cap ? u->marks_cap * 2 : 16;
        size_t *m = realloc(u->marks, cap * sizeof *m);
        if (m == NULL)
            return pk_err(u, DCS_ERR_NOMEM, "out of memory");
        u->marks = m;
        u->marks_cap = cap;
    }
    u->marks[u->n_marks++] = u->sp;
    return DCS_OK;
}

/* Pop the MARK and everything above it: the *n popped values stay readable
 * at *items (inside u->stack) until the next push. */
static dcs_status pop_mark(unpickler *u, pv ***items, size_t *n)
{
    if (u->n_marks == 0)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: opcode 0x%02x without a MARK", u->op_pos,
                      u->p[u->op_pos]);
    size_t base = u->marks[--u->n_marks];
    *items = u->stack + base;
    *n = u->sp - base;
    u->sp = base;
    return DCS_OK;
}

/* ---------------------------------------------------------------- memo */

static dcs_status memo_put(unpickler *u, uint64_t idx)
{
    pv *v;
    dcs_status st = top(u, &v);
    if (st != DCS_OK)
        return st;
    if (idx >= PK_MAX_MEMO || idx > u->len)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: memo index %llu is out of range",
                      u->op_pos, (unsigned long long)idx);
    if (idx >= u->memo_cap) {
        size_t cap = u->memo_cap ? u->memo_cap : 64;
        while (cap <= idx)
            cap *= 2;
        pv **m = realloc(u->memo, cap * sizeof *m);
        if (m == NULL)
            return pk_err(u, DCS_ERR_NOMEM, "out of memory");
        memset(m + u->memo_cap, 0, (cap - u->memo_cap) * sizeof *m);
        u->memo = m;
        u->memo_cap = cap;
    }
    u->memo_used += u->memo[idx] == NULL;
    u->memo[idx] = v;
    return DCS_OK;
}

static dcs_status memo_get(unpickler *u, uint64_t idx)
{
    if (idx >= u->memo_cap || u->memo[idx] == NULL)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: memo slot %llu is empty", u->op_pos,
                      (unsigned long long)idx);
    return push(u, u->memo[idx]);
}

/* ---------------------------------------------------------------- reading */

static dcs_status take(unpickler *u, uint64_t n, const uint8_t **out)
{
    if (n > u->len - u->pos)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: pickle is truncated (opcode 0x%02x needs "
                      "%llu more bytes, %zu left)", u->op_pos, u->p[u->op_pos],
                      (unsigned long long)n, u->len - u->pos);
    *out = u->p + u->pos;
    u->pos += (size_t)n;
    return DCS_OK;
}

/* An unsigned little-endian argument of `width` bytes. */
static dcs_status take_uint(unpickler *u, int width, uint64_t *out)
{
    const uint8_t *b;
    dcs_status st = take(u, (uint64_t)width, &b);
    if (st != DCS_OK)
        return st;
    uint64_t v = 0;
    for (int i = width - 1; i >= 0; i--)
        v = v << 8 | b[i];
    *out = v;
    return DCS_OK;
}

static dcs_status push_int(unpickler *u, int64_t i)
{
    pv *v = new_pv(u, PV_INT);
    if (v != NULL)
        v->u.i = i;
    return push(u, v);
}

/* LONG1: n bytes of little-endian two's complement, n <= 8 here. */
static dcs_status op_long1(unpickler *u)
{
    uint64_t n = 0;
    const uint8_t *b = NULL;
    dcs_status st = take_uint(u, 1, &n);
    if (st != DCS_OK)
        return st;
    if (n > 8)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: integer of %llu bytes is too large",
                      u->op_pos, (unsigned long long)n);
    if ((st = take(u, n, &b)) != DCS_OK)
        return st;
    uint64_t v = 0;
    for (int i = (int)n - 1; i >= 0; i--)
        v = v << 8 | b[i];
    if (n > 0 && n < 8 && (b[n - 1] & 0x80))
        v |= ~(uint64_t)0 << (8 * n);        /* sign-extend */
    int64_t s;
    memcpy(&s, &v, sizeof s);
    return push_int(u, s);
}

static dcs_status op_binfloat(unpickler *u)
{
    const uint8_t *b;
    dcs_status st = take(u, 8, &b);
    if (st != DCS_OK)
        return st;
    uint64_t bits = 0;
    for (int i = 0; i < 8; i++)                  /* big-endian */
        bits = bits << 8 | b[i];
    pv *v = new_pv(u, PV_FLOAT);
    if (v != NULL)
        memcpy(&v->u.f, &bits, sizeof v->u.f);
    return push(u, v);
}

/* A string or bytes value whose length is a `width`-byte prefix. */
static dcs_status op_string(unpickler *u, int width, pv_kind kind)
{
    uint64_t n = 0;
    const uint8_t *b = NULL;
    dcs_status st = take_uint(u, width, &n);
    if (st == DCS_OK)
        st = take(u, n, &b);
    if (st != DCS_OK)
        return st;
    pv *v = new_pv(u, kind);
    if (v == NULL)
        return DCS_ERR_NOMEM;
    v->u.str.s = pk_strdup(u, b, (size_t)n);
    v->u.str.len = (size_t)n;
    return push(u, v->u.str.s ? v : NULL);
}

/* ---------------------------------------------------------------- globals */

static bool is_lit(const char *s, size_t n, const char *lit)
{
    return n == strlen(lit) && memcmp(s, lit, n) == 0;
}

/* The error for a global outside the allowed set; unprintable bytes of the
 * name are shown as '?'. */
static dcs_status refuse_global(unpickler *u, const char *mod, size_t ml, const char *name,
                                size_t nl)
{
    char shown[160];
    size_t k = 0;
    for (size_t i = 0; i < ml + 1 + nl && k + 1 < sizeof shown; i++) {
        char c = i < ml ? mod[i] : i == ml ? '.' : name[i - ml - 1];
        shown[k++] = (c >= 0x20 && c < 0x7f) ? c : '?';
    }
    shown[k] = '\0';
    return pk_err(u, DCS_ERR_FORMAT, "pickle references global '%s', which a state_dict never "
                  "needs; refusing to load", shown);
}

/* GLOBAL / STACK_GLOBAL: push one of the allowed globals, refuse the rest. */
static dcs_status resolve_global(unpickler *u, const char *mod, size_t ml, const char *name,
                                 size_t nl)
{
    pv *g = new_pv(u, PV_GLOBAL);
    if (g == NULL)
        return DCS_ERR_NOMEM;
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
static dcs_status op_global(unpickler *u)
{
    const char *s = (const char *)u->p + u->pos;
    size_t left = u->len - u->pos;
    const char *nl1 = memchr(s, '\n', left);
    const char *nl2 = nl1 ? memchr(nl1 + 1, '\n', left - (size_t)(nl1 + 1 - s)) : NULL;
    if (nl2 == NULL)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: GLOBAL without two newline-ended names",
                      u->op_pos);
    u->pos += (size_t)(nl2 + 1 - s);
    return resolve_global(u, s, (size_t)(nl1 - s), nl1 + 1, (size_t)(nl2 - nl1 - 1));
}

static dcs_status op_stack_global(unpickler *u)
{
    pv *name = NULL, *mod = NULL;
    dcs_status st = pop(u, &name);
    if (st == DCS_OK)
        st = pop(u, &mod);
    if (st != DCS_OK)
        return st;
    if (name->kind != PV_STR || mod->kind != PV_STR)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: STACK_GLOBAL needs two strings", u->op_pos);
    return resolve_global(u, mod->u.str.s, mod->u.str.len, name->u.str.s, name->u.str.len);
}

/* ---------------------------------------------------------------- torch objects */

static bool is_str(const pv *v, const char *lit)
{
    return v->kind == PV_STR && is_lit(v->u.str.s, v->u.str.len, lit);
}

/* BINPERSID: ('storage', torch.<T>Storage, key, location, numel) -> storage */
static dcs_status op_persid(unpickler *u)
{
    pv *pid = NULL;
    dcs_status st = pop(u, &pid);
    if (st != DCS_OK)
        return st;
    if (pid->kind != PV_TUPLE || pid->u.seq.n != 5 || !is_str(pid->u.seq.v[0], "storage") ||
        pid->u.seq.v[1]->kind != PV_GLOBAL || pid->u.seq.v[1]->u.glob.kind != G_STORAGE ||
        pid->u.seq.v[2]->kind != PV_STR || pid->u.seq.v[3]->kind != PV_STR ||
        pid->u.seq.v[4]->kind != PV_INT || pid->u.seq.v[4]->u.i < 0)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: persistent id is not ('storage', "
                      "torch.<T>Storage, key, location, numel)", u->op_pos);
    const storage_class *cls = pid->u.seq.v[1]->u.glob.cls;
    const pv *key = pid->u.seq.v[2];
    int64_t numel = pid->u.seq.v[4]->u.i;

    /* <prefix>data/<key> */
    size_t nlen = u->prefix_len + 5 + key->u.str.len;
    char *ename = pk_alloc(u, nlen + 1);
    if (ename == NULL)
        return DCS_ERR_NOMEM;
    memcpy(ename, u->prefix, u->prefix_len);
    memcpy(ename + u->prefix_len, "data/", 5);
    memcpy(ename + u->prefix_len + 5, key->u.str.s, key->u.str.len);
    const zip_entry *en = zip_find(u->zip, ename, nlen);
    if (en == NULL)
        return pk_err(u, DCS_ERR_FORMAT, "storage '%.100s' is missing: no zip entry '%.200s'",
                      key->u.str.s, ename);
    pv *s = new_pv(u, PV_STORAGE);
    if (s == NULL)
        return DCS_ERR_NOMEM;
    s->u.storage.cls = cls;
    s->u.storage.key = key->u.str.s;
    s->u.storage.numel = numel;
    if ((st = zip_entry_data(u->zip, en, &s->u.storage.data, &s->u.storage.size)) != DCS_OK)
        return st;
    uint64_t need;
    if (!dcs_mul_ok((uint64_t)numel, cls->elsize, &need) || need > s->u.storage.size)
        return pk_err(u, DCS_ERR_FORMAT, "storage '%.100s' claims %lld %s elements but its zip "
                      "entry holds %llu bytes", key->u.str.s, (long long)numel, cls->dtname,
                      (unsigned long long)s->u.storage.size);
    return push(u, s);
}

/* A tuple of at most DCS_MAX_NDIM ints (>= 0 when nonneg) into out. */
static bool int_tuple(const pv *t, bool nonneg, int64_t *out, int *n)
{
    if (t->kind != PV_TUPLE || t->u.seq.n > DCS_MAX_NDIM)
        return false;
    for (size_t i = 0; i < t->u.seq.n; i++) {
        const pv *v = t->u.seq.v[i];
        if (v->kind != PV_INT || (nonneg && v->u.i < 0))
            return false;
        out[i] = v->u.i;
    }
    *n = (int)t->u.seq.n;
    return true;
}

/* _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata]).
 * Only the structure is checked here; the extent is checked in add_tensor,
 * where the tensor's name is known. */
static dcs_status rebuild_tensor(unpickler *u, const pv *args, pv **out)
{
    pv *t = new_pv(u, PV_TENSOR);
    if (t == NULL)
        return DCS_ERR_NOMEM;
    pk_tensor *tt = &t->u.tensor;
    int nstride = -1;
    pv *const *a = args->u.seq.v;
    if (args->u.seq.n < 6 || args->u.seq.n > 7 || a[0]->kind != PV_STORAGE ||
        a[1]->kind != PV_INT || a[1]->u.i < 0 || !int_tuple(a[2], true, tt->size, &tt->ndim) ||
        !int_tuple(a[3], false, tt->stride, &nstride) || nstride != tt->ndim ||
        (a[4]->kind != PV_BOOL && a[4]->kind != PV_INT))
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: _rebuild_tensor_v2 arguments are not "
                      "(storage, offset, size, stride, requires_grad, hooks[, metadata]) with at "
                      "most %d dimensions", u->op_pos, DCS_MAX_NDIM);
    tt->storage = &a[0]->u.storage;
    tt->offset = a[1]->u.i;
    *out = t;
    return DCS_OK;
}

/* REDUCE: call one of the allowed globals. */
static dcs_status op_reduce(unpickler *u)
{
    pv *args = NULL, *fn = NULL, *res = NULL;
    dcs_status st = pop(u, &args);
    if (st == DCS_OK)
        st = pop(u, &fn);
    if (st != DCS_OK)
        return st;
    if (fn->kind != PV_GLOBAL || args->kind != PV_TUPLE)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: REDUCE of a %s with a %s", u->op_pos,
                      pv_kind_name[fn->kind], pv_kind_name[args->kind]);
    switch (fn->u.glob.kind) {
    case G_ORDERED_DICT:
        if (args->u.seq.n != 0)
            return pk_err(u, DCS_ERR_FORMAT, "byte %zu: OrderedDict called with arguments",
                          u->op_pos);
        res = new_pv(u, PV_DICT);
        break;
    case G_REBUILD_TENSOR:
        if ((st = rebuild_tensor(u, args, &res)) != DCS_OK)
            return st;
        break;
    case G_REBUILD_PARAMETER:
        if (args->u.seq.n < 1 || args->u.seq.v[0]->kind != PV_TENSOR)
            return pk_err(u, DCS_ERR_FORMAT, "byte %zu: _rebuild_parameter without a tensor",
                          u->op_pos);
        res = args->u.seq.v[0];
        break;
    case G_STORAGE:
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: a storage class is called", u->op_pos);
    }
    return push(u, res);
}

/* BUILD: only on a dict (OrderedDict's __dict__ such as _metadata); the
 * state is ignored. */
static dcs_status op_build(unpickler *u)
{
    pv *state = NULL, *obj = NULL;
    dcs_status st = pop(u, &state);
    if (st == DCS_OK)
        st = top(u, &obj);
    if (st != DCS_OK)
        return st;
    if (obj->kind != PV_DICT)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: BUILD on a %s", u->op_pos,
                      pv_kind_name[obj->kind]);
    return DCS_OK;
}

/* ---------------------------------------------------------------- containers */

static dcs_status op_tuple_n(unpickler *u, size_t n)
{
    pv *t = new_pv(u, PV_TUPLE);
    if (t == NULL)
        return DCS_ERR_NOMEM;
    if (u->sp - frame_base(u) < n)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: TUPLE%zu needs %zu values", u->op_pos, n, n);
    for (size_t i = u->sp - n; i < u->sp; i++) {
        dcs_status st = seq_push(u, t, u->stack[i]);
        if (st != DCS_OK)
            return st;
    }
    u->sp -= n;
    return push(u, t);
}

/* TUPLE, LIST, DICT: a new container from the items above the MARK. */
static dcs_status op_from_mark(unpickler *u, pv_kind kind)
{
    pv **items = NULL;
    size_t n = 0;
    dcs_status st = pop_mark(u, &items, &n);
    if (st != DCS_OK)
        return st;
    if (kind == PV_DICT && n % 2 != 0)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: DICT with an odd number of items", u->op_pos);
    pv *c = new_pv(u, kind);
    if (c == NULL)
        return DCS_ERR_NOMEM;
    for (size_t i = 0; i < n && st == DCS_OK; i++)
        st = seq_push(u, c, items[i]);
    return st == DCS_OK ? push(u, c) : st;
}

/* APPEND/APPENDS (kind PV_LIST) and SETITEM/SETITEMS (PV_DICT): add the
 * items to the container below them. */
static dcs_status add_items(unpickler *u, pv_kind kind, pv **items, size_t n)
{
    pv *c = NULL;
    dcs_status st = top(u, &c);
    if (st != DCS_OK)
        return st;
    if (c->kind != kind)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: %s into a %s", u->op_pos,
                      kind == PV_LIST ? "APPEND" : "SETITEM", pv_kind_name[c->kind]);
    if (kind == PV_DICT && n % 2 != 0)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: SETITEMS with an odd number of items",
                      u->op_pos);
    for (size_t i = 0; i < n && st == DCS_OK; i++)
        st = seq_push(u, c, items[i]);
    return st;
}

static dcs_status op_add_one(unpickler *u, pv_kind kind, size_t n)
{
    if (u->sp - frame_base(u) < n + 1)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: opcode 0x%02x needs %zu values", u->op_pos,
                      u->p[u->op_pos], n + 1);
    u->sp -= n;
    return add_items(u, kind, u->stack + u->sp, n);
}

static dcs_status op_add_mark(unpickler *u, pv_kind kind)
{
    pv **items = NULL;
    size_t n = 0;
    dcs_status st = pop_mark(u, &items, &n);
    return st == DCS_OK ? add_items(u, kind, items, n) : st;
}

/* ---------------------------------------------------------------- dispatch */

static dcs_status push_kind(unpickler *u, pv_kind kind, int64_t i)
{
    pv *v = new_pv(u, kind);
    if (v != NULL)
        v->u.i = i;
    return push(u, v);
}

/* Execute one opcode. *stop is set by STOP. */
static dcs_status unpickle_step(unpickler *u, bool *stop)
{
    const uint8_t *b = NULL;
    uint64_t x = 0;
    pv *v = NULL;
    dcs_status st;
    u->op_pos = u->pos;
    if (u->pos >= u->len)
        return pk_err(u, DCS_ERR_FORMAT, "pickle ends at byte %zu without STOP", u->len);
    uint8_t op = u->p[u->pos++];
    switch (op) {
    case 0x80: /* PROTO */
        if ((st = take_uint(u, 1, &x)) != DCS_OK)
            return st;
        if (x > 5)
            return pk_err(u, DCS_ERR_FORMAT, "pickle protocol %llu is not supported",
                          (unsigned long long)x);
        return DCS_OK;
    case 0x95: /* FRAME: a length hint; the frame's opcodes follow inline */
        return take(u, 8, &b);
    case '.': /* STOP */
        *stop = true;
        return DCS_OK;
    case '(': return push_mark(u);                                /* MARK */
    case '0': /* POP: the top value, or the innermost MARK if nothing is above it */
        if (u->sp > frame_base(u)) {
            u->sp--;
            return DCS_OK;
        }
        if (u->n_marks > 0) {
            u->n_marks--;
            return DCS_OK;
        }
        return pop(u, &v);                   /* reports the empty stack */
    case '1': { /* POP_MARK */
        pv **items;
        size_t n;
        return pop_mark(u, &items, &n);
    }
    case '2': /* DUP */
        return (st = top(u, &v)) != DCS_OK ? st : push(u, v);
    case 'N': return push_kind(u, PV_NONE, 0);                     /* NONE */
    case 0x88: return push_kind(u, PV_BOOL, 1);                    /* NEWTRUE */
    case 0x89: return push_kind(u, PV_BOOL, 0);                    /* NEWFALSE */
    case 'K': /* BININT1 */
    case 'M': /* BININT2 */
        if ((st = take_uint(u, op == 'K' ? 1 : 2, &x)) != DCS_OK)
            return st;
        return push_int(u, (int64_t)x);
    case 'J': /* BININT: signed 32-bit */
        if ((st = take_uint(u, 4, &x)) != DCS_OK)
            return st;
        return push_int(u, (int64_t)(int32_t)(uint32_t)x);
    case 0x8a: return op_long1(u);                                 /* LONG1 */
    case 'G': return op_binfloat(u);                               /* BINFLOAT */
    case 'X': return op_string(u, 4, PV_STR);                      /* BINUNICODE */
    case 0x8c: return op_string(u, 1, PV_STR);                     /* SHORT_BINUNICODE */
    case 0x8d: return op_string(u, 8, PV_STR);                     /* BINUNICODE8 */
    case 'U': return op_string(u, 1, PV_STR);                      /* SHORT_BINSTRING */
    case 'T': return op_string(u, 4, PV_STR);                      /* BINSTRING */
    case 'C': return op_string(u, 1, PV_BYTES);                    /* SHORT_BINBYTES */
    case 'B': return op_string(u, 4, PV_BYTES);                    /* BINBYTES */
    case 0x8e: return op_string(u, 8, PV_BYTES);                   /* BINBYTES8 */
    case ')': return push(u, new_pv(u, PV_TUPLE));                 /* EMPTY_TUPLE */
    case 0x85: return op_tuple_n(u, 1);                            /* TUPLE1 */
    case 0x86: return op_tuple_n(u, 2);                            /* TUPLE2 */
    case 0x87: return op_tuple_n(u, 3);                            /* TUPLE3 */
    case 't': return op_from_mark(u, PV_TUPLE);                    /* TUPLE */
    case ']': return push(u, new_pv(u, PV_LIST));                  /* EMPTY_LIST */
    case 'l': return op_from_mark(u, PV_LIST);                     /* LIST */
    case 'a': return op_add_one(u, PV_LIST, 1);                    /* APPEND */
    case 'e': return op_add_mark(u, PV_LIST);                      /* APPENDS */
    case '}': return push(u, new_pv(u, PV_DICT));                  /* EMPTY_DICT */
    case 'd': return op_from_mark(u, PV_DICT);                     /* DICT */
    case 's': return op_add_one(u, PV_DICT, 2);                    /* SETITEM */
    case 'u': return op_add_mark(u, PV_DICT);                      /* SETITEMS */
    case 'c': return op_global(u);                                 /* GLOBAL */
    case 0x93: return op_stack_global(u);                          /* STACK_GLOBAL */
    case 'R': return op_reduce(u);                                 /* REDUCE */
    case 'b': return op_build(u);                                  /* BUILD */
    case 'Q': return op_persid(u);                                 /* BINPERSID */
    case 'q': /* BINPUT */
    case 'r': /* LONG_BINPUT */
        if ((st = take_uint(u, op == 'q' ? 1 : 4, &x)) != DCS_OK)
            return st;
        return memo_put(u, x);
    case 0x94: return memo_put(u, u->memo_used);                  /* MEMOIZE: len(memo) */
    case 'h': /* BINGET */
    case 'j': /* LONG_BINGET */
        if ((st = take_uint(u, op == 'h' ? 1 : 4, &x)) != DCS_OK)
            return st;
        return memo_get(u, x);
    default:
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: pickle opcode 0x%02x ('%c') is not "
                      "supported", u->op_pos, op, (op >= 0x20 && op < 0x7f) ? op : '?');
    }
}

static void unpickler_free(unpickler *u)
{
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
static dcs_status unpickle(unpickler *u, pv **result)
{
    bool stop = false;
    while (!stop) {
        dcs_status st = unpickle_step(u, &stop);
        if (st != DCS_OK)
            return st;
    }
    if (u->n_marks != 0 || u->sp != 1)
        return pk_err(u, DCS_ERR_FORMAT, "byte %zu: STOP with %zu values and %zu open MARKs on "
                      "the stack (expected one value)", u->op_pos, u->sp, u->n_marks);
    *result = u->stack[0];
    return DCS_OK;
}

/* ================================================================ tensors */

/* torch's is_contiguous: strides are row-major, ignoring dims of size 1. */
static bool is_contiguous(const pk_tensor *t, uint64_t numel)
{
    if (numel == 0)
        return true;
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->size[i] != 1 && t->stride[i] != expect)
            return false;
        expect *= t->size[i];        /* <= numel <= INT64_MAX: no overflow */
    }
    return true;
}

#define DCS_MAX_GATHER_BYTES (256u << 20)

/* Copy the strided view t (elements of `elsize` bytes at base) into the
 * contiguous buffer out, row-major over its sizes. */
static void gather_view(const pk_tensor *t, const uint8_t *base, size_t elsize, uint64_t numel,
                        uint8_t *out)
{
    int64_t idx[DCS_MAX_NDIM] = {0};
    for (uint64_t j = 0; j < numel; j++) {
        int64_t off = t->offset;
        for (int i = 0; i < t->ndim; i++)
            off += idx[i] * t->stride[i];
        memcpy(out + j * elsize, base + (uint64_t)off * elsize, elsize);
        for (int i = t->ndim - 1; i >= 0; i--) {     /* odometer */
            if (++idx[i] < t->size[i])
                break;
            idx[i] = 0;
        }
    }
}

/* "(2, 3)" */
static void format_dims(char *buf, size_t cap, const int64_t *d, int n)
{
    size_t k = (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < n && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, i ? ", %lld" : "%lld", (long long)d[i]);
    if (k < cap)
        snprintf(buf + k, cap - k, ")");
}

/* Check one (name, tensor) pair and add it to the table (or skip it). */
static dcs_status add_tensor(unpickler *u, dcs_tensor_table *tt, const pv *key, const pk_tensor *t)
{
    const char *name = key->u.str.s;
    const pk_storage *s = t->storage;
    uint64_t numel = 1, end, nbytes;
    for (int i = 0; i < t->ndim; i++)
        if (!dcs_mul_ok(numel, (uint64_t)t->size[i], &numel) || numel > (uint64_t)INT64_MAX)
            return pk_err(u, DCS_ERR_FORMAT, "tensor '%.200s': size overflows", name);
    int strided = !is_contiguous(t, numel);
    if (strided) {
        /* furthest element: offset + sum (size_i - 1) * stride_i, overflow-checked */
        char sz[200], sd[200];
        format_dims(sz, sizeof sz, t->size, t->ndim);
        format_dims(sd, sizeof sd, t->stride, t->ndim);
        uint64_t last = (uint64_t)t->offset, step;
        for (int i = 0; i < t->ndim; i++) {
            if (t->stride[i] < 0)
                return pk_err(u, DCS_ERR_FORMAT, "tensor '%.200s': negative stride in %s", name, sd);
            if (!dcs_mul_ok((uint64_t)(t->size[i] - 1), (uint64_t)t->stride[i], &step) ||
                !dcs_add_ok(last, step, &last))
                return pk_err(u, DCS_ERR_FORMAT, "tensor '%.200s': stride %s for size %s overflows",
                              name, sd, sz);
        }
        if (last >= (uint64_t)s->numel)
            return pk_err(u, DCS_ERR_FORMAT, "tensor '%.200s': view of size %s, stride %s at offset "
                          "%lld reaches element %llu, outside storage '%.100s' of %lld elements",
                          name, sz, sd, (long long)t->offset, (unsigned long long)last, s->key,
                          (long long)s->numel);
    } else if (!dcs_add_ok((uint64_t)t->offset, numel, &end) || end > (uint64_t)s->numel)
        return pk_err(u, DCS_ERR_FORMAT, "tensor '%.200s': elements [%lld, %lld + %llu) lie "
                      "outside storage '%.100s' of %lld elements", name, (long long)t->offset,
                      (long long)t->offset, (unsigned long long)numel, s->key,
                      (long long)s->numel);
    if (s->cls->dtype < 0) {
        if (dcs_tt_skippable_buffer(name))
            return DCS_OK;
        return pk_err(u, DCS_ERR_FORMAT, "tensor '%.200s' has dtype %s (torch.%s); only "
                      "float32, float16 and bfloat16 are supported", name, s->cls->dtname,
                      s->cls->cls);
    }
    uint64_t sbytes = (uint64_t)s->numel * s->cls->elsize;   /* checked at BINPERSID */
    if (!dcs_mul_ok(numel, s->cls->elsize, &nbytes))
        return pk_err(u, DCS_ERR_FORMAT, "tensor '%.200s': size overflows", name);
    if (strided && nbytes > sbytes) {    /* an expanded view: bounded extra memory */
        if (nbytes - sbytes > DCS_MAX_GATHER_BYTES - u->gathered)
            return pk_err(u, DCS_ERR_NOMEM, "tensor '%.200s': expanded views of this file would "
                          "need more than %u MiB beyond their storages", name,
                          DCS_MAX_GATHER_BYTES >> 20);
        u->gathered += nbytes - sbytes;
    }
    uint8_t *copy = NULL;
    if (strided) {
        copy = malloc(nbytes ? (size_t)nbytes : 1);
        if (copy == NULL)
            return pk_err(u, DCS_ERR_NOMEM, "tensor '%.200s': out of memory for a contiguous "
                          "copy of %llu bytes", name, (unsigned long long)nbytes);
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
static dcs_status add_state_dict(unpickler *u, dcs_tensor_table *tt, const pv *sd)
{
    if (sd->kind != PV_DICT)
        return pk_err(u, DCS_ERR_FORMAT, "pickled object is a %s, not a state_dict (a dict of "
                      "tensors)", pv_kind_name[sd->kind]);
    for (size_t i = 0; i + 1 < sd->u.seq.n; i += 2) {
        const pv *k = sd->u.seq.v[i], *v = sd->u.seq.v[i + 1];
        if (k->kind != PV_STR)
            return pk_err(u, DCS_ERR_FORMAT, "state_dict has a %s key, not a str",
                          pv_kind_name[k->kind]);
        if (v->kind != PV_TENSOR)
            return pk_err(u, DCS_ERR_FORMAT, "state_dict entry '%.200s' is a %s, not a tensor "
                          "(nested checkpoints such as {'state_dict': ...} are not supported)",
                          k->u.str.s, pv_kind_name[v->kind]);
        dcs_status st = add_tensor(u, tt, k, &v->u.tensor);
        if (st != DCS_OK)
            return st;
    }
    return DCS_OK;
}

/* ================================================================ entry points */

/* <prefix>/byteorder, when present, must say "little". */
static dcs_status check_byteorder(unpickler *u)
{
    char *name = pk_alloc(u, u->prefix_len + sizeof "byteorder");
    if (name == NULL)
        return DCS_ERR_NOMEM;
    memcpy(name, u->prefix, u->prefix_len);
    memcpy(name + u->prefix_len, "byteorder", sizeof "byteorder");
    const zip_entry *en = zip_find(u->zip, name, u->prefix_len + 9);
    if (en == NULL)
        return DCS_OK;
    const uint8_t *d = NULL;
    uint64_t n = 0;
    dcs_status st = zip_entry_data(u->zip, en, &d, &n);
    if (st != DCS_OK)
        return st;
    if (n != 6 || memcmp(d, "little", 6) != 0)
        return dcs_seterr(u->e, DCS_ERR_FORMAT, "%s: %s: only little-endian checkpoints are "
                          "supported", u->path, name);
    return DCS_OK;
}

/* Unpickle <prefix>/data.pkl and add its tensors to the table. */
static dcs_status run_unpickler(unpickler *u, const zip_entry *pkl, dcs_tensor_table *tt)
{
    size_t plen = pkl->name_len - 8;                /* keeps the '/' */
    u->pkl_name = "data.pkl";
    char *pkl_name = pk_strdup(u, pkl->name, pkl->name_len);
    char *prefix = pk_strdup(u, pkl->name, plen);
    if (pkl_name == NULL || prefix == NULL)
        return DCS_ERR_NOMEM;
    u->pkl_name = pkl_name;
    u->prefix = prefix;
    u->prefix_len = plen;
    dcs_status st = check_byteorder(u);
    const uint8_t *data = NULL;
    uint64_t size = 0;
    if (st == DCS_OK)
        st = zip_entry_data(u->zip, pkl, &data, &size);
    if (st != DCS_OK)
        return st;
    if (size > DCS_MAX_PICKLE_BYTES)
        return pk_err(u, DCS_ERR_NOMEM, "%llu bytes, more than the %u MiB allowed",
                      (unsigned long long)size, DCS_MAX_PICKLE_BYTES >> 20);
    u->p = data;
    u->len = (size_t)size;
    pv *sd = NULL;
    if ((st = unpickle(u, &sd)) != DCS_OK)
        return st;
    int first = tt->n;
    st = add_state_dict(u, tt, sd);
    if (st == DCS_OK)
        st = dcs_tt_commit(tt, first, u->e);
    if (st != DCS_OK)
        dcs_tt_rollback(tt, first);
    return st;
}

dcs_status dcs_tt_parse_torchzip(dcs_tensor_table *tt, const uint8_t *buf, uint64_t len,
                                 const char *path, dcs_err *e)
{
    zip_archive z;
    const zip_entry *pkl = NULL;
    dcs_status st = zip_open(&z, buf, len, path, e);
    if (st == DCS_OK)
        st = find_data_pkl(&z, &pkl);
    if (st == DCS_OK) {
        unpickler u;
        memset(&u, 0, sizeof u);
        u.path = path;
        u.zip = &z;
        u.e = e;
        st = run_unpickler(&u, pkl, tt);
        unpickler_free(&u);
    }
    free(z.ent);
    return st;
}

dcs_status dcs_tt_add_torchzip(dcs_tensor_table *tt, const char *path, dcs_err *e)
{
    return dcs_tt_add_file(tt, path, dcs_tt_parse_torchzip, e);
}
