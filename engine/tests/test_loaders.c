/*
 * test_loaders.c -- tests of the checkpoint readers (safetensors, PyTorch zip,
 * model directories, sharded indexes) and of dcs_tensor_to_f32.
 *
 * Every input is crafted here, in a temporary directory: safetensors files
 * from JSON text, zip archives written byte by byte (stored entries, torch's
 * 64-byte alignment padding, optional ZIP64 records) and pickles assembled
 * opcode by opcode the way torch.save writes them. For each malformed input
 * the test checks the status code and that the message names the file.
 *
 * Output: one line per failed check, then "loaders: N passed, M failed";
 * the exit status is nonzero when a check failed.
 */
#include "dcs_model.h"
#include "check.h"

#include <dirent.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ================================================================ harness */

typedef struct {
    check_counts counts;
    char dir[256]; /* temporary directory of this run */
} harness;

static bool check_at(harness *h, bool ok, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    bool r = check_count(&h->counts, ok, line, fmt, ap);
    va_end(ap);
    return r;
}

#define CHECK(h, cond) check_at((h), (cond), __LINE__, "%s", #cond)
#define CHECKF(h, cond, ...) check_at((h), (cond), __LINE__, __VA_ARGS__)

/* A failed load must give `want` and a message containing the file name
 * (`file`) and, when given, `needle`. */
static void expect_err_at(harness *h, int line, const char *what, dcs_status got, dcs_status want,
                          const dcs_err *e, const char *file, const char *needle) {
    check_at(h, got == want, line, "%s: got %s, want %s (%s)", what, dcs_status_name(got),
             dcs_status_name(want), got ? e->msg : "no message");
    if (got == DCS_OK) return;
    check_at(h, strstr(e->msg, file) != NULL, line, "%s: message does not name '%s': %s", what, file, e->msg);
    if (needle != NULL)
        check_at(h, strstr(e->msg, needle) != NULL, line, "%s: message lacks '%s': %s", what, needle, e->msg);
}
#define EXPECT_ERR(h, what, got, want, e, file, needle)                                                      \
    expect_err_at((h), __LINE__, (what), (got), (want), (e), (file), (needle))

/* ================================================================ bytes */

typedef struct {
    uint8_t *p;
    size_t n, cap;
} bytes;

static void put(bytes *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n) cap *= 2;
        b->p = realloc(b->p, cap);
        if (b->p == NULL) {
            fprintf(stderr, "out of memory\n");
            exit(2);
        }
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void put8(bytes *b, unsigned v) {
    uint8_t c = (uint8_t)v;
    put(b, &c, 1);
}
static void put16(bytes *b, unsigned v) {
    put8(b, v & 0xff);
    put8(b, (v >> 8) & 0xff);
}
static void put32(bytes *b, uint32_t v) {
    put16(b, v & 0xffff);
    put16(b, v >> 16);
}
static void put64(bytes *b, uint64_t v) {
    put32(b, (uint32_t)v);
    put32(b, (uint32_t)(v >> 32));
}
static void puts_(bytes *b, const char *s) { put(b, s, strlen(s)); }
static void bytes_free(bytes *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

static void f16s(bytes *b, const uint16_t *v, int n) {
    for (int i = 0; i < n; i++) put16(b, v[i]);
}
static void f32s(bytes *b, const float *v, int n) {
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &v[i], 4);
        put32(b, u);
    }
}

/* ================================================================ files */

static char *path_in(harness *h, const char *sub, const char *name) {
    static char buf[4][512]; /* a few live at once in one call */
    static int k;
    char *p = buf[k++ % 4];
    if (sub)
        snprintf(p, 512, "%s/%s/%s", h->dir, sub, name);
    else
        snprintf(p, 512, "%s/%s", h->dir, name);
    return p;
}

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (f == NULL || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(2);
    }
}

static void make_dir(harness *h, const char *sub) { mkdir(path_in(h, NULL, sub), 0700); }

static void remove_tree(const char *path) {
    DIR *d = opendir(path);
    if (d == NULL) {
        unlink(path);
        return;
    }
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        char child[1024];
        snprintf(child, sizeof child, "%s/%s", path, de->d_name);
        remove_tree(child);
    }
    closedir(d);
    rmdir(path);
}

/* ================================================================ safetensors */

/* 8-byte header length + JSON + data. */
static void st_bytes(bytes *b, const char *json, const void *data, size_t n) {
    put64(b, strlen(json));
    puts_(b, json);
    put(b, data, n);
}

static void write_st(const char *path, const char *json, const void *data, size_t n) {
    bytes b = {0};
    st_bytes(&b, json, data, n);
    write_file(path, b.p, b.n);
    bytes_free(&b);
}

/* Load one safetensors file into a fresh table; *tt must be freed. */
static dcs_status load_st(dcs_tensor_table *tt, const char *path, dcs_err *e) {
    dcs_tt_free(tt); /* start from an empty table */
    memset(e, 0, sizeof *e);
    return dcs_tt_add_safetensors(tt, path, e);
}

static void to_f32(const dcs_tensor *t, float *out) { dcs_tensor_to_f32(t, out); }

/* ================================================================ zip */

typedef struct {
    const char *name;
    const void *data;
    size_t len;
    int method; /* 0 stored; 8 claims deflate */
} zent;

/* A zip archive as torch writes it: entries STORED, each local header's
 * extra field padded ("FB" block) so data is 64-byte aligned. With zip64,
 * sizes and offsets go through ZIP64 extra fields and end records. */
static void build_zip(bytes *out, const zent *ents, int n, bool zip64) {
    uint64_t offs[64];
    for (int i = 0; i < n; i++) {
        offs[i] = out->n;
        size_t nlen = strlen(ents[i].name);
        size_t x64 = zip64 ? 20 : 0;
        size_t base = out->n + 30 + nlen + x64 + 4;
        size_t pad = (64 - base % 64) % 64;
        put32(out, 0x04034b50);
        put16(out, zip64 ? 45 : 20);
        put16(out, 0); /* flags */
        put16(out, (unsigned)ents[i].method);
        put16(out, 0);
        put16(out, 0); /* time, date */
        put32(out, 0); /* crc (not checked) */
        put32(out, zip64 ? 0xffffffffu : (uint32_t)ents[i].len);
        put32(out, zip64 ? 0xffffffffu : (uint32_t)ents[i].len);
        put16(out, (unsigned)nlen);
        put16(out, (unsigned)(x64 + 4 + pad));
        puts_(out, ents[i].name);
        if (zip64) {
            put16(out, 1);
            put16(out, 16);
            put64(out, ents[i].len);
            put64(out, ents[i].len);
        }
        put16(out, 0x4246); /* "FB" padding block */
        put16(out, (unsigned)pad);
        for (size_t k = 0; k < pad; k++) put8(out, 'Z');
        put(out, ents[i].data, ents[i].len);
    }
    uint64_t cd_off = out->n;
    for (int i = 0; i < n; i++) {
        size_t nlen = strlen(ents[i].name);
        put32(out, 0x02014b50);
        put16(out, 45);
        put16(out, zip64 ? 45 : 20);
        put16(out, 0);
        put16(out, (unsigned)ents[i].method);
        put16(out, 0);
        put16(out, 0);
        put32(out, 0);
        put32(out, zip64 ? 0xffffffffu : (uint32_t)ents[i].len);
        put32(out, zip64 ? 0xffffffffu : (uint32_t)ents[i].len);
        put16(out, (unsigned)nlen);
        put16(out, zip64 ? 28 : 0);
        put16(out, 0); /* comment */
        put16(out, 0); /* disk */
        put16(out, 0);
        put32(out, 0); /* attributes */
        put32(out, zip64 ? 0xffffffffu : (uint32_t)offs[i]);
        puts_(out, ents[i].name);
        if (zip64) {
            put16(out, 1);
            put16(out, 24);
            put64(out, ents[i].len);
            put64(out, ents[i].len);
            put64(out, offs[i]);
        }
    }
    uint64_t cd_size = out->n - cd_off;
    if (zip64) {
        uint64_t rec = out->n;
        put32(out, 0x06064b50);
        put64(out, 44);
        put16(out, 45);
        put16(out, 45);
        put32(out, 0);
        put32(out, 0);
        put64(out, (uint64_t)n);
        put64(out, (uint64_t)n);
        put64(out, cd_size);
        put64(out, cd_off);
        put32(out, 0x07064b50);
        put32(out, 0);
        put64(out, rec);
        put32(out, 1);
    }
    put32(out, 0x06054b50);
    put16(out, 0);
    put16(out, 0);
    put16(out, zip64 ? 0xffff : (unsigned)n);
    put16(out, zip64 ? 0xffff : (unsigned)n);
    put32(out, zip64 ? 0xffffffffu : (uint32_t)cd_size);
    put32(out, zip64 ? 0xffffffffu : (uint32_t)cd_off);
    put16(out, 0);
}

/* Set the sizes of entry `name` in the central directory of a zip. */
static bool patch_cd_size(bytes *z, const char *name, uint32_t size) {
    size_t nlen = strlen(name);
    for (size_t i = 0; i + 46 + nlen <= z->n; i++) {
        const uint8_t *q = z->p + i;
        if (q[0] == 0x50 && q[1] == 0x4b && q[2] == 0x01 && q[3] == 0x02 &&
            (size_t)(q[28] | q[29] << 8) == nlen && memcmp(q + 46, name, nlen) == 0) {
            for (int k = 0; k < 4; k++) z->p[i + 20 + k] = z->p[i + 24 + k] = (uint8_t)(size >> (8 * k));
            return true;
        }
    }
    return false;
}

/* ================================================================ pickle */

static void pk_global(bytes *b, const char *mod, const char *name) {
    put8(b, 'c');
    puts_(b, mod);
    put8(b, '\n');
    puts_(b, name);
    put8(b, '\n');
}

static void pk_str(bytes *b, const char *s) /* BINUNICODE */
{
    put8(b, 'X');
    put32(b, (uint32_t)strlen(s));
    puts_(b, s);
}

static void pk_short_str(bytes *b, const char *s) /* SHORT_BINUNICODE */
{
    put8(b, 0x8c);
    put8(b, (unsigned)strlen(s));
    puts_(b, s);
}

static void pk_int(bytes *b, long long v) {
    if (v >= 0 && v < 256) {
        put8(b, 'K');
        put8(b, (unsigned)v);
    } else if (v >= 0 && v < 65536) {
        put8(b, 'M');
        put16(b, (unsigned)v);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
        put8(b, 'J');
        put32(b, (uint32_t)(int32_t)v);
    } else {
        put8(b, 0x8a); /* LONG1, 8 bytes */
        put8(b, 8);
        put64(b, (uint64_t)v);
    }
}

static void pk_put(bytes *b, int i) {
    put8(b, 'q');
    put8(b, (unsigned)i);
}
static void pk_get(bytes *b, int i) {
    put8(b, 'h');
    put8(b, (unsigned)i);
}

/* One tensor of a torch state_dict. */
typedef struct {
    const char *name;
    const char *cls; /* "HalfStorage", ... */
    const char *key; /* storage key: archive/data/<key> */
    long long numel; /* storage elements (persistent id) */
    long long offset;
    int ndim;
    long long size[4], stride[4];
} tspec;

/* The pickle torch.save writes for OrderedDict(name -> tensor): memo 0 is
 * collections.OrderedDict, memo 1 torch._utils._rebuild_tensor_v2. */
static void pk_state_dict(bytes *b, const tspec *ts, int n, bool with_metadata) {
    put8(b, 0x80);
    put8(b, 2); /* PROTO 2 */
    pk_global(b, "collections", "OrderedDict");
    pk_put(b, 0);
    put8(b, ')');
    put8(b, 'R');
    pk_put(b, 2);
    put8(b, '(');
    for (int i = 0; i < n; i++) {
        pk_str(b, ts[i].name);
        if (i == 0) {
            pk_global(b, "torch._utils", "_rebuild_tensor_v2");
            pk_put(b, 1);
        } else {
            pk_get(b, 1);
        }
        put8(b, '(');
        put8(b, '(');
        pk_str(b, "storage");
        pk_global(b, "torch", ts[i].cls);
        pk_str(b, ts[i].key);
        pk_str(b, "cpu");
        pk_int(b, ts[i].numel);
        put8(b, 't');
        put8(b, 'Q'); /* BINPERSID */
        pk_int(b, ts[i].offset);
        put8(b, '(');
        for (int d = 0; d < ts[i].ndim; d++) pk_int(b, ts[i].size[d]);
        put8(b, 't');
        put8(b, '(');
        for (int d = 0; d < ts[i].ndim; d++) pk_int(b, ts[i].stride[d]);
        put8(b, 't');
        put8(b, 0x89); /* NEWFALSE */
        pk_get(b, 0);
        put8(b, ')');
        put8(b, 'R'); /* OrderedDict() hooks */
        put8(b, 't');
        put8(b, 'R');
    }
    put8(b, 'u');        /* SETITEMS */
    if (with_metadata) { /* sd._metadata = {...} */
        put8(b, '}');
        pk_str(b, "_metadata");
        pk_get(b, 0);
        put8(b, ')');
        put8(b, 'R');
        put8(b, '(');
        pk_str(b, "");
        put8(b, '}');
        pk_str(b, "version");
        pk_int(b, 1);
        put8(b, 's');
        put8(b, 'u');
        put8(b, 's');
        put8(b, 'b'); /* BUILD */
    }
    put8(b, '.');
}

/* Storage contents for a torch zip. */
typedef struct {
    const char *key;
    const void *data;
    size_t len;
} tstorage;

typedef struct {
    bool zip64;
    int pkl_method;        /* compression method claimed for data.pkl */
    const char *byteorder; /* NULL: "little" */
    bool no_pkl;
} zopts;

static void torchzip_bytes(bytes *out, const bytes *pkl, const tstorage *st, int n, const zopts *o) {
    zent ents[40];
    char names[32][64];
    int k = 0;
    if (!o->no_pkl) ents[k++] = (zent){"archive/data.pkl", pkl->p, pkl->n, o->pkl_method};
    const char *bo = o->byteorder ? o->byteorder : "little";
    ents[k++] = (zent){"archive/byteorder", bo, strlen(bo), 0};
    for (int i = 0; i < n; i++) {
        snprintf(names[i], sizeof names[i], "archive/data/%s", st[i].key);
        ents[k++] = (zent){names[i], st[i].data, st[i].len, 0};
    }
    ents[k++] = (zent){"archive/version", "3\n", 2, 0};
    build_zip(out, ents, k, o->zip64);
}

static void write_torchzip(const char *path, const bytes *pkl, const tstorage *st, int n, const zopts *o) {
    bytes z = {0};
    zopts none = {0};
    torchzip_bytes(&z, pkl, st, n, o ? o : &none);
    write_file(path, z.p, z.n);
    bytes_free(&z);
}

/* A torch zip holding exactly `pkl` and two storages "0" (12 halves) and
 * "1" (3 floats); returns the status of loading it. */
static dcs_status load_pickle(harness *h, const char *name, const bytes *pkl, dcs_tensor_table *tt,
                              dcs_err *e) {
    static const uint16_t halves[12] = {0x0000, 0x3800, 0x3c00, 0x3e00, 0x4000, 0x4100,
                                        0x4200, 0x4300, 0x4400, 0x4480, 0x4500, 0x4580};
    static const float floats[3] = {1.0f, 2.0f, 3.0f};
    tstorage st[2] = {{"0", halves, sizeof halves}, {"1", floats, sizeof floats}};
    const char *path = path_in(h, NULL, name);
    write_torchzip(path, pkl, st, 2, NULL);
    dcs_tt_free(tt); /* start from an empty table */
    memset(e, 0, sizeof *e);
    return dcs_tt_add_torchzip(tt, path, e);
}

/* ================================================================ tests: f32 */

/* Independent reference: value = (-1)^s * m * 2^e computed with ldexpf. */
static float f16_reference(uint16_t h) {
    int s = h >> 15, ex = (h >> 10) & 31, m = h & 1023;
    float v;
    if (ex == 31)
        v = m ? NAN : INFINITY;
    else if (ex == 0)
        v = ldexpf((float)m, -24);
    else
        v = ldexpf((float)(1024 + m), ex - 25);
    return s ? -v : v;
}

static void test_to_f32(harness *h) {
    /* Known fp16 values, stored one byte past an aligned address. */
    static const uint16_t hv[] = {0x3c00, 0x0001, 0x7c00, 0xfc00, 0x8000,
                                  0x03ff, 0x0400, 0x7bff, 0xc000, 0x3555};
    const float want[] = {1.0f,     0x1p-24f, INFINITY, -INFINITY,      -0.0f, 1023 * 0x1p-24f,
                          0x1p-14f, 65504.0f, -2.0f,    0.333251953125f};
    int n = (int)(sizeof hv / sizeof hv[0]);
    uint8_t raw[1 + 2 * 16];
    for (int i = 0; i < n; i++) {
        raw[1 + 2 * i] = hv[i] & 0xff;
        raw[2 + 2 * i] = hv[i] >> 8;
    }
    dcs_tensor t = {.dtype = DCS_F16, .ndim = 1, .shape = {n}, .data = raw + 1};
    float out[16];
    to_f32(&t, out);
    for (int i = 0; i < n; i++)
        CHECKF(h, out[i] == want[i] && signbit(out[i]) == signbit(want[i]), "fp16 0x%04x -> %a, want %a",
               hv[i], out[i], want[i]);

    uint16_t nan16 = 0x7e00;
    t.data = (const uint8_t *)&nan16;
    t.shape[0] = 1;
    to_f32(&t, out);
    CHECKF(h, isnan(out[0]), "fp16 0x7e00 -> %a, want NaN", out[0]);

    /* All 65536 halves against the reference. */
    uint16_t *all = malloc(65536 * 2);
    float *f = malloc(65536 * sizeof *f);
    for (int i = 0; i < 65536; i++) all[i] = (uint16_t)i;
    dcs_tensor ta = {.dtype = DCS_F16, .ndim = 1, .shape = {65536}, .data = (uint8_t *)all};
    to_f32(&ta, f);
    int bad = 0;
    for (int i = 0; i < 65536; i++) {
        float r = f16_reference((uint16_t)i);
        if (isnan(r) ? !isnan(f[i]) : (f[i] != r || signbit(f[i]) != signbit(r))) bad++;
    }
    CHECKF(h, bad == 0, "%d of 65536 fp16 values widen wrongly", bad);
    free(all);
    free(f);

    /* bf16 = the upper half of a float32. */
    static const uint16_t bv[] = {0x3f80, 0xc000, 0x7f80, 0x0001, 0x3eab};
    const float bwant[] = {1.0f, -2.0f, INFINITY, 0x1p-133f, 0.333984375f};
    for (int i = 0; i < 5; i++) {
        raw[1 + 2 * i] = bv[i] & 0xff;
        raw[2 + 2 * i] = bv[i] >> 8;
    }
    dcs_tensor tb = {.dtype = DCS_BF16, .ndim = 1, .shape = {5}, .data = raw + 1};
    to_f32(&tb, out);
    for (int i = 0; i < 5; i++)
        CHECKF(h, out[i] == bwant[i], "bf16 0x%04x -> %a, want %a", bv[i], out[i], bwant[i]);

    /* f32, unaligned, and a 2-D shape. */
    const float fv[4] = {1.5f, -0.0f, 3.25e-40f, 1e30f};
    memcpy(raw + 3, fv, sizeof fv);
    dcs_tensor tf = {.dtype = DCS_F32, .ndim = 2, .shape = {2, 2}, .data = raw + 3};
    CHECK(h, dcs_tensor_numel(&tf) == 4);
    to_f32(&tf, out);
    CHECK(h, memcmp(out, fv, sizeof fv) == 0);
    dcs_tensor scalar = {.dtype = DCS_F32, .ndim = 0, .data = raw + 3};
    CHECK(h, dcs_tensor_numel(&scalar) == 1);
}

static void test_status_names(harness *h) {
    CHECK(h, strcmp(dcs_status_name(DCS_OK), "DCS_OK") == 0);
    CHECK(h, strcmp(dcs_status_name(DCS_ERR_FORMAT), "DCS_ERR_FORMAT") == 0);
    CHECK(h, strcmp(dcs_status_name(DCS_ERR_BACKEND), "DCS_ERR_BACKEND") == 0);
    CHECK(h, strcmp(dcs_status_name((dcs_status)99), "DCS_ERR_UNKNOWN") == 0);
    dcs_err e;
    CHECK(h, dcs_seterr(&e, DCS_ERR_ARG, "x=%d", 5) == DCS_ERR_ARG);
    CHECK(h, e.code == DCS_ERR_ARG && strcmp(e.msg, "x=5") == 0);
    CHECK(h, dcs_seterr(NULL, DCS_ERR_IO, "ignored") == DCS_ERR_IO);
    char longname[3000];
    memset(longname, 'a', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    dcs_seterr(&e, DCS_ERR_IO, "%s", longname);
    CHECK(h, strlen(e.msg) == sizeof e.msg - 1);
}

/* ================================================================ tests: files */

static void test_files(harness *h) {
    dcs_err e = {0};
    dcs_mapped_file f;
    const char *p = path_in(h, NULL, "text.json");
    write_file(p, "{\"a\": 1}", 8);
    CHECK(h, dcs_map_file(p, &f, &e) == DCS_OK && f.size == 8 && memcmp(f.data, "{\"a\"", 4) == 0);
    CHECK(h, f.path != NULL && strcmp(f.path, p) == 0);
    dcs_unmap_file(&f);
    CHECK(h, f.data == NULL && f.path == NULL);

    const char *empty = path_in(h, NULL, "empty.bin");
    write_file(empty, "", 0);
    CHECK(h, dcs_map_file(empty, &f, &e) == DCS_OK && f.size == 0 && f.data == NULL);
    dcs_unmap_file(&f);

    const char *missing = path_in(h, NULL, "missing.bin");
    EXPECT_ERR(h, "map missing", dcs_map_file(missing, &f, &e), DCS_ERR_IO, &e, missing, "No such file");
    EXPECT_ERR(h, "map directory", dcs_map_file(h->dir, &f, &e), DCS_ERR_IO, &e, h->dir,
               "not a regular file");

    char *text = NULL;
    size_t len = 0;
    CHECK(h, dcs_read_text_file(p, 100, &text, &len, &e) == DCS_OK && len == 8 &&
                 strcmp(text, "{\"a\": 1}") == 0);
    free(text);
    EXPECT_ERR(h, "text too big", dcs_read_text_file(p, 7, &text, &len, &e), DCS_ERR_NOMEM, &e, p,
               "more than the 7");
    CHECK(h, text == NULL);
    EXPECT_ERR(h, "text missing", dcs_read_text_file(missing, 7, &text, &len, &e), DCS_ERR_IO, &e, missing,
               NULL);
}

/* ================================================================ tests: safetensors */

static void test_safetensors_valid(harness *h) {
    /* F16 [3], BF16 [1,3], F32 [1] at odd offsets, an empty [0,4], a scalar:
     * header length 7 mod 8 too, so nothing is aligned. */
    bytes data = {0};
    const uint16_t hv[3] = {0x3c00, 0xc000, 0x3800}; /* 1, -2, 0.5 */
    const uint16_t bv[3] = {0x3f80, 0x4000, 0x4040}; /* 1, 2, 3 */
    const float fv[2] = {7.0f, -1.25f};
    put8(&data, 0xee);      /* gap: offset 1 */
    f16s(&data, hv, 3);     /* [1, 7) */
    f16s(&data, bv, 3);     /* [7, 13) */
    f32s(&data, fv, 1);     /* [13, 17) */
    f32s(&data, fv + 1, 1); /* [17, 21) */
    const char *json = "{\"__metadata__\":{\"format\":\"pt\"},"
                       "\"w.f16\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[1,7]},"
                       "\"w.bf16\":{\"shape\":[1,3],\"dtype\":\"BF16\",\"data_offsets\":[7,13]},"
                       "\"w.f32\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[13,17]},"
                       "\"scalar\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[17,21]},"
                       "\"empty\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[21,21]}}  ";
    const char *p = path_in(h, NULL, "valid.safetensors");
    write_st(p, json, data.p, data.n);
    bytes_free(&data);

    dcs_tensor_table tt = {0};
    dcs_err e;
    dcs_status st = load_st(&tt, p, &e);
    CHECKF(h, st == DCS_OK, "valid safetensors: %s", e.msg);
    CHECK(h, tt.n == 5 && tt.n_files == 1);
    float out[8];
    dcs_tensor *t = dcs_tt_find(&tt, "w.f16");
    if (CHECK(h, t != NULL)) {
        CHECK(h, t->dtype == DCS_F16 && t->ndim == 1 && t->shape[0] == 3 && t->nbytes == 6);
        CHECK(h, t->file != NULL && strcmp(t->file, p) == 0);
        to_f32(t, out);
        CHECK(h, out[0] == 1.0f && out[1] == -2.0f && out[2] == 0.5f);
    }
    t = dcs_tt_find(&tt, "w.bf16");
    if (CHECK(h, t != NULL)) {
        CHECK(h, t->dtype == DCS_BF16 && t->ndim == 2 && t->shape[0] == 1 && t->shape[1] == 3);
        to_f32(t, out);
        CHECK(h, out[0] == 1.0f && out[1] == 2.0f && out[2] == 3.0f);
    }
    t = dcs_tt_find(&tt, "w.f32");
    if (CHECK(h, t != NULL)) {
        to_f32(t, out);
        CHECK(h, t->dtype == DCS_F32 && out[0] == 7.0f);
    }
    t = dcs_tt_find(&tt, "scalar");
    if (CHECK(h, t != NULL)) {
        to_f32(t, out);
        CHECK(h, t->ndim == 0 && dcs_tensor_numel(t) == 1 && out[0] == -1.25f);
    }
    t = dcs_tt_find(&tt, "empty");
    CHECK(h, t != NULL && dcs_tensor_numel(t) == 0 && t->nbytes == 0);
    CHECK(h, dcs_tt_find(&tt, "__metadata__") == NULL);
    CHECK(h, dcs_tt_find(&tt, "w.f1") == NULL && dcs_tt_find(&tt, "zzz") == NULL);
    for (int i = 1; i < tt.n; i++) CHECK(h, strcmp(tt.t[i - 1].name, tt.t[i].name) < 0);
    dcs_tt_free(&tt);
    CHECK(h, tt.n == 0 && tt.t == NULL && tt.files == NULL);
    dcs_tt_free(&tt); /* twice is fine */

    /* Ignorable buffers with other dtypes are skipped; others refused. */
    const char *pb = path_in(h, NULL, "buffers.safetensors");
    write_st(pb,
             "{\"gpt_neox.layers.0.attention.bias\":{\"dtype\":\"BOOL\",\"shape\":[1,1,2,2],"
             "\"data_offsets\":[0,4]},"
             "\"gpt_neox.layers.0.attention.masked_bias\":{\"dtype\":\"F32\",\"shape\":[],"
             "\"data_offsets\":[4,8]}}",
             "\1\0\1\1\0\0\0\0", 8);
    st = load_st(&tt, pb, &e);
    CHECKF(h, st == DCS_OK, "bool buffer: %s", e.msg);
    CHECK(h, tt.n == 1 && dcs_tt_find(&tt, "gpt_neox.layers.0.attention.masked_bias") != NULL);
    dcs_tt_free(&tt);

    /* Many tensors: lookups by binary search. */
    bytes json2 = {0}, d2 = {0};
    puts_(&json2, "{");
    for (int i = 0; i < 1000; i++) {
        char ent[160];
        snprintf(ent, sizeof ent,
                 "%s\"layers.%d.w\":{\"dtype\":\"F32\",\"shape\":[1],"
                 "\"data_offsets\":[%d,%d]}",
                 i ? "," : "", i, 4 * i, 4 * i + 4);
        puts_(&json2, ent);
        float v = (float)i;
        f32s(&d2, &v, 1);
    }
    puts_(&json2, "}");
    put8(&json2, 0);
    const char *pm = path_in(h, NULL, "many.safetensors");
    write_st(pm, (const char *)json2.p, d2.p, d2.n);
    bytes_free(&json2);
    bytes_free(&d2);
    st = load_st(&tt, pm, &e);
    CHECKF(h, st == DCS_OK && tt.n == 1000, "1000 tensors: %s", e.msg);
    int found = 0;
    for (int i = 0; i < 1000; i++) {
        char name[32];
        snprintf(name, sizeof name, "layers.%d.w", i);
        t = dcs_tt_find(&tt, name);
        if (t != NULL) {
            to_f32(t, out);
            found += out[0] == (float)i;
        }
    }
    CHECK(h, found == 1000);
    dcs_tt_free(&tt);
}

/* One malformed header: (JSON, data length, expected status, needle). */
typedef struct {
    const char *what;
    const char *json;
    size_t data_len;
    dcs_status want;
    const char *needle;
} st_case;

static void test_safetensors_bad(harness *h) {
    static const st_case cases[] = {
        {"bad JSON", "{\"a\":{\"dtype\":\"F32\",", 0, DCS_ERR_FORMAT, "not valid JSON"},
        {"not an object", "[1,2]", 0, DCS_ERR_FORMAT, "not a JSON object"},
        {"junk after JSON", "{} x", 0, DCS_ERR_FORMAT, "after its JSON"},
        {"entry not an object", "{\"a\":5}", 0, DCS_ERR_FORMAT, "'a'"},
        {"no dtype", "{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DCS_ERR_FORMAT, "no 'dtype'"},
        {"no shape", "{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, DCS_ERR_FORMAT, "no 'shape'"},
        {"no offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, DCS_ERR_FORMAT, "no 'data_offsets'"},
        {"dtype twice",
         "{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F16\",\"shape\":[1],"
         "\"data_offsets\":[0,4]}}",
         4, DCS_ERR_FORMAT, "twice"},
        {"dtype not string", "{\"a\":{\"dtype\":1,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DCS_ERR_FORMAT,
         "dtype"},
        {"offsets past data",
         "{\"layers.0.attention.wo.weight\":{\"dtype\":\"F32\","
         "\"shape\":[2],\"data_offsets\":[10,99]}}",
         64, DCS_ERR_IO,
         "tensor 'layers.0.attention.wo.weight': data_offsets [10, 99] exceed the data region "
         "(64 bytes"},
        {"offsets reversed", "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", 8,
         DCS_ERR_FORMAT, "end before"},
        {"size mismatch", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 8,
         DCS_ERR_FORMAT, "need 8"},
        {"three offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8,
         DCS_ERR_FORMAT, "data_offsets"},
        {"negative offset", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 8,
         DCS_ERR_FORMAT, "data_offsets"},
        {"overlap",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         8, DCS_ERR_FORMAT, "overlap"},
        {"unknown dtype", "{\"a\":{\"dtype\":\"Q7\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
         DCS_ERR_FORMAT, "'Q7'"},
        {"int64 tensor", "{\"step\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8,
         DCS_ERR_FORMAT, "tensor 'step' has dtype 'I64'"},
        {"bool tensor", "{\"mask\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
         DCS_ERR_FORMAT, "'BOOL'"},
        {"negative dim", "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4,
         DCS_ERR_FORMAT, "shape[0]"},
        {"fractional dim", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4,
         DCS_ERR_FORMAT, "shape[0]"},
        {"string dim", "{\"a\":{\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]}}", 4,
         DCS_ERR_FORMAT, "shape[0]"},
        {"huge dim", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1e300],\"data_offsets\":[0,4]}}", 4,
         DCS_ERR_FORMAT, "below 2^53"},
        {"nine dims",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],"
         "\"data_offsets\":[0,4]}}",
         4, DCS_ERR_FORMAT, "9 dimensions"},
        {"numel overflow",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[4503599627370496,"
         "4503599627370496],\"data_offsets\":[0,4]}}",
         4, DCS_ERR_FORMAT, "overflows"},
        {"bytes overflow",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[4503599627370496,4096],"
         "\"data_offsets\":[0,4]}}",
         4, DCS_ERR_FORMAT, "overflows"},
        {"duplicate name",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         8, DCS_ERR_FORMAT, "'a' appears twice"},
        {"empty name", "{\"\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DCS_ERR_FORMAT,
         "empty name"},
    };
    static const uint8_t zeros[64];
    dcs_tensor_table tt = {0};
    dcs_err e;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "bad%zu.safetensors", i);
        const char *p = path_in(h, NULL, name);
        write_st(p, cases[i].json, zeros, cases[i].data_len);
        dcs_status st = load_st(&tt, p, &e);
        EXPECT_ERR(h, cases[i].what, st, cases[i].want, &e, p, cases[i].needle);
        CHECKF(h, tt.n == 0 && tt.n_files == 0, "%s: table not left empty", cases[i].what);
        dcs_tt_free(&tt);
    }

    /* Broken framing. */
    const char *p = path_in(h, NULL, "short.safetensors");
    write_file(p, "\x05\0\0", 3);
    EXPECT_ERR(h, "5-byte file", load_st(&tt, p, &e), DCS_ERR_IO, &e, p, "truncated");
    bytes b = {0};
    put64(&b, 1000);
    puts_(&b, "{}");
    p = path_in(h, NULL, "pastend.safetensors");
    write_file(p, b.p, b.n);
    EXPECT_ERR(h, "header past EOF", load_st(&tt, p, &e), DCS_ERR_IO, &e, p, "past the end");
    bytes_free(&b);
    put64(&b, (uint64_t)1 << 40);
    puts_(&b, "{}");
    p = path_in(h, NULL, "absurd.safetensors");
    write_file(p, b.p, b.n);
    EXPECT_ERR(h, "absurd header", load_st(&tt, p, &e), DCS_ERR_FORMAT, &e, p, "limit");
    bytes_free(&b);
    p = path_in(h, NULL, "nothere.safetensors");
    EXPECT_ERR(h, "missing file", load_st(&tt, p, &e), DCS_ERR_IO, &e, p, NULL);
    dcs_tt_free(&tt);

    /* A failed file leaves an existing table as it was; a name in two files
     * is refused. */
    const char *p1 = path_in(h, NULL, "one.safetensors");
    const char *p2 = path_in(h, NULL, "two.safetensors");
    const char *pbad = path_in(h, NULL, "bad0.safetensors");
    write_st(p1, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", zeros, 4);
    write_st(p2,
             "{\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
             "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
             zeros, 8);
    CHECK(h, load_st(&tt, p1, &e) == DCS_OK && tt.n == 1);
    EXPECT_ERR(h, "bad second file", dcs_tt_add_safetensors(&tt, pbad, &e), DCS_ERR_FORMAT, &e, pbad, NULL);
    CHECK(h, tt.n == 1 && tt.n_files == 1 && dcs_tt_find(&tt, "a") != NULL);
    EXPECT_ERR(h, "name in two files", dcs_tt_add_safetensors(&tt, p2, &e), DCS_ERR_FORMAT, &e, p2,
               "also in");
    CHECK(h, tt.n == 1 && tt.n_files == 1 && dcs_tt_find(&tt, "b") == NULL);
    dcs_tt_free(&tt);

    /* From memory, as the fuzzer calls it. */
    bytes m = {0};
    st_bytes(&m, "{\"x\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]}}", zeros, 4);
    dcs_tt_free(&tt);
    CHECK(h, dcs_tt_parse_safetensors(&tt, m.p, m.n, "mem", &e) == DCS_OK && tt.n == 1);
    dcs_tt_free(&tt);
    for (size_t cut = 0; cut < m.n; cut++) { /* every truncation fails cleanly */
        dcs_status st = dcs_tt_parse_safetensors(&tt, m.p, cut, "mem", &e);
        CHECKF(h, st != DCS_OK && tt.n == 0, "truncated to %zu bytes: %s", cut, dcs_status_name(st));
    }
    dcs_tt_free(&tt);
    bytes_free(&m);
}

/* ================================================================ tests: directories */

static void write_two_shards(harness *h, const char *sub) {
    static const float v[2] = {1.0f, 2.0f};
    write_st(path_in(h, sub, "model-00001-of-00002.safetensors"),
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
             "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
             v, 8);
    write_st(path_in(h, sub, "model-00002-of-00002.safetensors"),
             "{\"c\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", v + 1, 4);
}

static void write_index(harness *h, const char *sub, const char *name, const char *json) {
    write_file(path_in(h, sub, name), json, strlen(json));
}

static const char good_index[] =
    "{\"metadata\":{\"total_size\":12},\"weight_map\":{"
    "\"a\":\"model-00001-of-00002.safetensors\",\"b\":\"model-00001-of-00002.safetensors\","
    "\"c\":\"model-00002-of-00002.safetensors\"}}";

/* Open sub as a model directory; expect failure `want` naming `file`. */
static void expect_dir_err(harness *h, int line, const char *what, const char *sub, dcs_status want,
                           const char *file, const char *needle) {
    dcs_tensor_table tt = {0};
    dcs_err e = {0};
    dcs_status st = dcs_tt_open_dir(path_in(h, NULL, sub), &tt, &e);
    expect_err_at(h, line, what, st, want, &e, file, needle);
    check_at(h, tt.n == 0 && tt.t == NULL && tt.files == NULL, line, "%s: table not freed", what);
    dcs_tt_free(&tt);
}
#define EXPECT_DIR_ERR(h, what, sub, want, file, needle)                                                     \
    expect_dir_err((h), __LINE__, (what), (sub), (want), (file), (needle))

static void test_dirs(harness *h) {
    dcs_tensor_table tt = {0};
    dcs_err e = {0};
    float out[1];

    make_dir(h, "sharded");
    write_two_shards(h, "sharded");
    write_index(h, "sharded", "model.safetensors.index.json", good_index);
    dcs_status st = dcs_tt_open_dir(path_in(h, NULL, "sharded"), &tt, &e);
    CHECKF(h, st == DCS_OK, "sharded: %s", e.msg);
    CHECK(h, tt.n == 3 && tt.n_files == 2);
    dcs_tensor *t = dcs_tt_find(&tt, "c");
    if (CHECK(h, t != NULL)) {
        to_f32(t, out);
        CHECK(h, out[0] == 2.0f && strstr(t->file, "model-00002-of-00002.safetensors") != NULL);
    }
    t = dcs_tt_find(&tt, "a");
    CHECK(h, t != NULL && strstr(t->file, "model-00001-of-00002.safetensors") != NULL);
    dcs_tt_free(&tt);

    make_dir(h, "single");
    write_st(path_in(h, "single", "model.safetensors"),
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", out, 4);
    write_file(path_in(h, "single", "pytorch_model.bin"), "junk", 4); /* not looked at */
    st = dcs_tt_open_dir(path_in(h, NULL, "single"), &tt, &e);
    CHECKF(h, st == DCS_OK && tt.n == 1, "single: %s", e.msg);
    dcs_tt_free(&tt);

    make_dir(h, "empty");
    EXPECT_DIR_ERR(h, "no weights", "empty", DCS_ERR_IO, path_in(h, NULL, "empty"),
                   "no weights found (looked for model.safetensors, "
                   "model.safetensors.index.json, pytorch_model.bin, "
                   "pytorch_model.bin.index.json)");
    EXPECT_DIR_ERR(h, "no directory", "nodir", DCS_ERR_IO, "nodir", NULL);

    make_dir(h, "noshard");
    write_two_shards(h, "noshard");
    unlink(path_in(h, "noshard", "model-00002-of-00002.safetensors"));
    write_index(h, "noshard", "model.safetensors.index.json", good_index);
    EXPECT_DIR_ERR(h, "shard missing", "noshard", DCS_ERR_IO, "model-00002-of-00002.safetensors",
                   "model.safetensors.index.json");

    make_dir(h, "dotdot");
    write_index(h, "dotdot", "model.safetensors.index.json",
                "{\"weight_map\":{\"a\":\"../sharded/model-00001-of-00002.safetensors\"}}");
    EXPECT_DIR_ERR(h, "shard outside the dir", "dotdot", DCS_ERR_FORMAT, "model.safetensors.index.json",
                   "not a plain file name");

    make_dir(h, "extra");
    write_two_shards(h, "extra");
    write_index(h, "extra", "model.safetensors.index.json",
                "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                "\"c\":\"model-00002-of-00002.safetensors\"}}");
    EXPECT_DIR_ERR(h, "tensor not in index", "extra", DCS_ERR_TENSOR, "model-00001-of-00002.safetensors",
                   "'b' is not in the weight_map");

    make_dir(h, "absent");
    write_two_shards(h, "absent");
    write_index(h, "absent", "model.safetensors.index.json",
                "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                "\"b\":\"model-00001-of-00002.safetensors\","
                "\"c\":\"model-00002-of-00002.safetensors\","
                "\"d\":\"model-00002-of-00002.safetensors\"}}");
    EXPECT_DIR_ERR(h, "indexed tensor absent", "absent", DCS_ERR_TENSOR, "model.safetensors.index.json",
                   "'d' is mapped to");

    make_dir(h, "moved");
    write_two_shards(h, "moved");
    write_index(h, "moved", "model.safetensors.index.json",
                "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                "\"b\":\"model-00002-of-00002.safetensors\","
                "\"c\":\"model-00002-of-00002.safetensors\"}}");
    EXPECT_DIR_ERR(h, "tensor in the wrong shard", "moved", DCS_ERR_TENSOR, "model.safetensors.index.json",
                   "found in");

    make_dir(h, "badidx");
    write_index(h, "badidx", "model.safetensors.index.json", "{\"weight_map\": [}");
    EXPECT_DIR_ERR(h, "index not JSON", "badidx", DCS_ERR_FORMAT, "model.safetensors.index.json", "JSON");
    make_dir(h, "nomap");
    write_index(h, "nomap", "model.safetensors.index.json", "{\"metadata\":{}}");
    EXPECT_DIR_ERR(h, "index without weight_map", "nomap", DCS_ERR_FORMAT, "model.safetensors.index.json",
                   "weight_map");
    make_dir(h, "numshard");
    write_index(h, "numshard", "model.safetensors.index.json", "{\"weight_map\":{\"a\":3}}");
    EXPECT_DIR_ERR(h, "shard not a string", "numshard", DCS_ERR_FORMAT, "model.safetensors.index.json",
                   "not a string");
    make_dir(h, "badshard");
    write_two_shards(h, "badshard");
    write_file(path_in(h, "badshard", "model-00002-of-00002.safetensors"), "\1\0\0\0\0\0\0\0{", 9);
    write_index(h, "badshard", "model.safetensors.index.json", good_index);
    EXPECT_DIR_ERR(h, "bad shard", "badshard", DCS_ERR_FORMAT, "model-00002-of-00002.safetensors", "JSON");
}

/* ================================================================ tests: torch zip */

static const uint16_t kHalves[12] = {0x0000, 0x3800, 0x3c00, 0x3e00, 0x4000, 0x4100,
                                     0x4200, 0x4300, 0x4400, 0x4480, 0x4500, 0x4580};
/* = 0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 5.5 */

static const tspec kSpecs[] = {
    {"layers.0.attention.wqkv.weight", "HalfStorage", "0", 12, 0, 2, {3, 2}, {2, 1}},
    {"layers.0.attention.wo.weight", "HalfStorage", "0", 12, 6, 2, {2, 3}, {3, 1}},
    {"norm.weight", "FloatStorage", "1", 3, 0, 1, {3}, {1}},
    {"scalar", "FloatStorage", "1", 3, 2, 0, {0}, {0}},
    {"col", "FloatStorage", "1", 3, 1, 2, {2, 1}, {1, 7}}, /* size-1 dim: any stride */
};

static void check_torch_tensors(harness *h, const dcs_tensor_table *tt, const char *what) {
    float out[8];
    CHECKF(h, tt->n == 5, "%s: %d tensors", what, tt->n);
    const dcs_tensor *t = dcs_tt_find(tt, "layers.0.attention.wo.weight");
    if (CHECKF(h, t != NULL, "%s: wo missing", what)) {
        CHECK(h, t->dtype == DCS_F16 && t->ndim == 2 && t->shape[0] == 2 && t->shape[1] == 3);
        CHECK(h, t->nbytes == 12 && ((uintptr_t)t->data % 4) == 0); /* 64-aligned + 12 */
        to_f32(t, out);
        CHECKF(h, out[0] == 3.0f && out[5] == 5.5f, "%s: wo = %g .. %g", what, out[0], out[5]);
    }
    t = dcs_tt_find(tt, "layers.0.attention.wqkv.weight");
    if (CHECK(h, t != NULL)) {
        to_f32(t, out);
        CHECK(h, out[0] == 0.0f && out[1] == 0.5f && out[5] == 2.5f);
    }
    t = dcs_tt_find(tt, "norm.weight");
    if (CHECK(h, t != NULL)) {
        to_f32(t, out);
        CHECK(h, t->dtype == DCS_F32 && out[0] == 1.0f && out[2] == 3.0f);
    }
    t = dcs_tt_find(tt, "scalar");
    if (CHECK(h, t != NULL)) {
        to_f32(t, out);
        CHECK(h, t->ndim == 0 && out[0] == 3.0f);
    }
    t = dcs_tt_find(tt, "col");
    if (CHECK(h, t != NULL)) {
        to_f32(t, out);
        CHECK(h, out[0] == 2.0f && out[1] == 3.0f);
    }
}

/* A file or directory written before the test by the Python fixture writer
 * (engine/Makefile: make fixtures, i.e. python3 -m dclens.testing.fixtures
 * DIR; DCS_TEST_FIXTURES names DIR, default "fixtures" in the build
 * directory). Valid inputs come from there; malformed ones are built here. */
static const char *fixture(const char *name) {
    static char buf[4][512];
    static int k;
    const char *root = getenv("DCS_TEST_FIXTURES");
    char *p = buf[k++ % 4];
    snprintf(p, 512, "%s/loaders/%s", root && *root ? root : "fixtures", name);
    struct stat st;
    if (stat(p, &st) != 0) {
        fprintf(stderr,
                "test_loaders: no fixture %s: run `make fixtures` (python3 -m dclens.testing.fixtures "
                "DIR; DCS_TEST_FIXTURES=DIR)\n",
                p);
        exit(2);
    }
    return p;
}

static void read_whole(const char *path, bytes *out) {
    FILE *f = fopen(path, "rb");
    uint8_t chunk[4096];
    size_t n;
    if (f == NULL) {
        fprintf(stderr, "cannot read %s\n", path);
        exit(2);
    }
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) put(out, chunk, n);
    fclose(f);
}

static void test_torchzip_valid(harness *h) {
    dcs_tensor_table tt = {0};
    dcs_err e = {0};
    CHECKF(h, dcs_tt_open_dir(fixture("torch1"), &tt, &e) == DCS_OK, "torch dir: %s", e.msg);
    check_torch_tensors(h, &tt, "torch dir");
    dcs_tt_free(&tt);

    /* ZIP64 records and extra fields, from memory. */
    bytes z = {0};
    read_whole(fixture("zip64.bin"), &z);
    CHECKF(h, dcs_tt_parse_torchzip(&tt, z.p, z.n, "zip64.bin", &e) == DCS_OK, "zip64: %s", e.msg);
    check_torch_tensors(h, &tt, "zip64");
    dcs_tt_free(&tt);
    for (size_t cut = 0; cut + 1 < z.n; cut += 7) { /* truncations fail cleanly */
        dcs_status s = dcs_tt_parse_torchzip(&tt, z.p, cut, "zip64.bin", &e);
        CHECKF(h, s != DCS_OK && tt.n == 0, "zip64 cut to %zu: %s", cut, dcs_status_name(s));
    }
    bytes_free(&z);

    /* sharded, the second shard with zip64 end records */
    CHECKF(h, dcs_tt_open_dir(fixture("torch2"), &tt, &e) == DCS_OK, "torch shards: %s", e.msg);
    check_torch_tensors(h, &tt, "torch shards");
    CHECK(h, tt.n_files == 2);
    dcs_tt_free(&tt);

    /* Protocol 4 style: FRAME, SHORT_BINUNICODE, MEMOIZE, STACK_GLOBAL,
     * LONG1, _rebuild_parameter, a 7-argument _rebuild_tensor_v2 and an
     * EMPTY_DICT top level filled by SETITEM. */
    bytes p = {0};
    put8(&p, 0x80);
    put8(&p, 4);
    put8(&p, 0x95);
    put64(&p, 0);
    put8(&p, '}');
    put8(&p, 0x94); /* memo 0: the dict */
    pk_short_str(&p, "norm.weight");
    put8(&p, 0x94);
    pk_short_str(&p, "torch._utils");
    put8(&p, 0x94);
    pk_short_str(&p, "_rebuild_parameter");
    put8(&p, 0x94);
    put8(&p, 0x93);
    put8(&p, 0x94); /* _rebuild_parameter */
    pk_short_str(&p, "torch._utils");
    pk_short_str(&p, "_rebuild_tensor_v2");
    put8(&p, 0x93);
    put8(&p, '('); /* args of _rebuild_tensor_v2 */
    put8(&p, '(');
    pk_short_str(&p, "storage");
    pk_short_str(&p, "torch");
    pk_short_str(&p, "FloatStorage");
    put8(&p, 0x93);
    pk_short_str(&p, "1");
    pk_short_str(&p, "cpu");
    put8(&p, 0x8a);
    put8(&p, 1);
    put8(&p, 3);
    put8(&p, 't');
    put8(&p, 'Q');
    put8(&p, 0x8a);
    put8(&p, 0);
    put8(&p, 'K');
    put8(&p, 3);
    put8(&p, 0x85);
    put8(&p, 'K');
    put8(&p, 1);
    put8(&p, 0x85);
    put8(&p, 0x88);
    put8(&p, '}');
    put8(&p, 'N');
    put8(&p, 't');
    put8(&p, 'R'); /* tensor */
    put8(&p, 0x88);
    put8(&p, '}');
    put8(&p, 0x87); /* (tensor, True, {}) */
    put8(&p, 'R');  /* parameter */
    put8(&p, 's');  /* d['norm.weight'] = p */
    put8(&p, '.');
    CHECKF(h, load_pickle(h, "proto4.bin", &p, &tt, &e) == DCS_OK, "protocol 4: %s", e.msg);
    const dcs_tensor *t = dcs_tt_find(&tt, "norm.weight");
    float out[3];
    if (CHECK(h, tt.n == 1 && t != NULL)) {
        to_f32(t, out);
        CHECK(h, t->dtype == DCS_F32 && out[2] == 3.0f);
    }
    dcs_tt_free(&tt);
    bytes_free(&p);

    /* A bool buffer named as the spec's ignorable ones is skipped. */
    static const tspec buf[] = {
        {"gpt_neox.layers.0.attention.bias", "BoolStorage", "0", 4, 0, 2, {2, 2}, {2, 1}},
        {"gpt_neox.layers.0.attention.masked_bias", "FloatStorage", "1", 3, 0, 0, {0}, {0}},
    };
    pk_state_dict(&p, buf, 2, false);
    CHECKF(h, load_pickle(h, "buffers.bin", &p, &tt, &e) == DCS_OK, "buffers: %s", e.msg);
    CHECK(h, tt.n == 1 && dcs_tt_find(&tt, "gpt_neox.layers.0.attention.masked_bias") != NULL);
    dcs_tt_free(&tt);
    bytes_free(&p);
}

/* The os.system pickle (protocol 0 style, as exploits are written). */
static void evil_pickle(bytes *p, const char *mod, const char *name, const char *arg) {
    put8(p, 0x80);
    put8(p, 2);
    pk_global(p, mod, name);
    put8(p, '(');
    pk_str(p, arg);
    put8(p, 't');
    put8(p, 'R');
    put8(p, '.');
}

static void test_torchzip_bad(harness *h) {
    dcs_tensor_table tt = {0};
    dcs_err e = {0};
    bytes p = {0};
    char cmd[600];
    const char *marker = path_in(h, NULL, "pwned");
    snprintf(cmd, sizeof cmd, "touch %s", marker);

    evil_pickle(&p, "os", "system", cmd);
    EXPECT_ERR(h, "os.system", load_pickle(h, "evil.bin", &p, &tt, &e), DCS_ERR_FORMAT, &e, "evil.bin",
               "pickle references global 'os.system', which a state_dict never "
               "needs; refusing to load");
    CHECK(h, strstr(e.msg, "data.pkl") != NULL);
    CHECK(h, access(marker, F_OK) != 0); /* nothing ran */
    CHECK(h, tt.n == 0);
    dcs_tt_free(&tt);
    bytes_free(&p);
    evil_pickle(&p, "posix", "system", cmd);
    EXPECT_ERR(h, "posix.system", load_pickle(h, "evil2.bin", &p, &tt, &e), DCS_ERR_FORMAT, &e, "evil2.bin",
               "'posix.system'");
    bytes_free(&p);
    evil_pickle(&p, "builtins", "eval", "__import__('os').system('true')");
    EXPECT_ERR(h, "builtins.eval", load_pickle(h, "evil3.bin", &p, &tt, &e), DCS_ERR_FORMAT, &e, "evil3.bin",
               "'builtins.eval'");
    bytes_free(&p);
    /* STACK_GLOBAL route, and a storage-like name outside torch. */
    put8(&p, 0x80);
    put8(&p, 4);
    pk_short_str(&p, "subprocess");
    pk_short_str(&p, "Popen");
    put8(&p, 0x93);
    put8(&p, '.');
    EXPECT_ERR(h, "stack global", load_pickle(h, "evil4.bin", &p, &tt, &e), DCS_ERR_FORMAT, &e, "evil4.bin",
               "'subprocess.Popen'");
    bytes_free(&p);
    evil_pickle(&p, "numpy", "FloatStorage", "x");
    EXPECT_ERR(h, "numpy.FloatStorage", load_pickle(h, "evil5.bin", &p, &tt, &e), DCS_ERR_FORMAT, &e,
               "evil5.bin", "'numpy.FloatStorage'");
    bytes_free(&p);

    /* Tensors the engine cannot load or must not trust. */
    struct {
        const char *what, *file;
        tspec spec;
        const char *needle;
    } tcases[] = {
        {"float64 tensor",
         "f64.bin",
         {"w", "DoubleStorage", "0", 3, 0, 1, {3}, {1}},
         "tensor 'w' has dtype float64"},
        {"int64 tensor",
         "i64.bin",
         {"step", "LongStorage", "0", 3, 0, 1, {3}, {1}},
         "tensor 'step' has dtype int64"},
        {"storage key missing", "nokey.bin", {"w", "HalfStorage", "9", 3, 0, 1, {3}, {1}}, "archive/data/9"},
        {"strided view past storage",
         "stride.bin",
         {"w", "HalfStorage", "0", 12, 0, 2, {3, 2}, {1, 11}},
         "reaches element 13, outside storage '0'"},
        {"negative stride",
         "negstride.bin",
         {"w", "HalfStorage", "0", 12, 11, 2, {3, 2}, {-1, 3}},
         "negative stride"},
        {"past storage", "extent.bin", {"w", "HalfStorage", "0", 12, 8, 1, {5}, {1}}, "outside storage '0'"},
        {"storage bigger than entry",
         "numel.bin",
         {"w", "HalfStorage", "0", 13, 0, 1, {3}, {1}},
         "claims 13"},
        {"negative dim",
         "negdim.bin",
         {"w", "HalfStorage", "0", 12, 0, 1, {-1}, {1}},
         "_rebuild_tensor_v2 arguments"},
        {"size overflow",
         "bigdim.bin",
         {"w", "HalfStorage", "0", 12, 0, 2, {1LL << 40, 1LL << 40}, {1LL << 40, 1}},
         "overflows"},
    };
    for (size_t i = 0; i < sizeof tcases / sizeof tcases[0]; i++) {
        pk_state_dict(&p, &tcases[i].spec, 1, false);
        EXPECT_ERR(h, tcases[i].what, load_pickle(h, tcases[i].file, &p, &tt, &e), DCS_ERR_FORMAT, &e,
                   tcases[i].file, tcases[i].needle);
        CHECK(h, tt.n == 0);
        dcs_tt_free(&tt);
        bytes_free(&p);
    }

    /* Strided views (torch.save keeps them): gathered into contiguous copies. */
    static const tspec views[] = {
        {"t", "HalfStorage", "0", 12, 0, 2, {3, 2}, {1, 3}}, /* transposed [2, 3] */
        {"x", "HalfStorage", "0", 12, 6, 2, {4, 3}, {0, 1}}, /* expanded rows      */
        {"s", "HalfStorage", "0", 12, 5, 1, {5}, {0}},       /* expanded scalar    */
    };
    pk_state_dict(&p, views, 3, false);
    if (CHECK(h, load_pickle(h, "views.bin", &p, &tt, &e) == DCS_OK) && CHECK(h, tt.n == 3)) {
        float v[12];
        const dcs_tensor *t = dcs_tt_find(&tt, "t");
        to_f32(t, v); /* storage [[0, .5, 1], [1.5, 2, 2.5]] read transposed */
        CHECK(h, t->owned && t->nbytes == 12 && v[0] == 0.0f && v[1] == 1.5f && v[2] == 0.5f && v[5] == 2.5f);
        t = dcs_tt_find(&tt, "x");
        to_f32(t, v);
        CHECK(h, t->shape[0] == 4 && v[0] == 3.0f && v[2] == 4.0f && v[9] == 3.0f && v[11] == 4.0f);
        t = dcs_tt_find(&tt, "s");
        to_f32(t, v);
        CHECK(h, v[0] == 2.5f && v[4] == 2.5f);
    }
    dcs_tt_free(&tt);
    bytes_free(&p);

    static const tspec huge[] = {
        /* 2^27 x 3 floats expanded from 3: 1.5 GiB */
        {"w", "FloatStorage", "0", 3, 0, 2, {1LL << 27, 3}, {0, 1}},
    };
    pk_state_dict(&p, huge, 1, false);
    EXPECT_ERR(h, "huge expanded view", load_pickle(h, "huge.bin", &p, &tt, &e), DCS_ERR_NOMEM, &e,
               "huge.bin", "more than 256 MiB beyond their storages");
    CHECK(h, tt.n == 0);
    dcs_tt_free(&tt);
    bytes_free(&p);

    static const tspec dup[] = {
        {"w", "HalfStorage", "0", 12, 0, 1, {3}, {1}},
        {"w", "HalfStorage", "0", 12, 3, 1, {3}, {1}},
    };
    pk_state_dict(&p, dup, 2, false);
    EXPECT_ERR(h, "duplicate name", load_pickle(h, "dup.bin", &p, &tt, &e), DCS_ERR_FORMAT, &e, "dup.bin",
               "'w' appears twice");
    bytes_free(&p);

    /* Broken pickles. */
    pk_state_dict(&p, kSpecs, 5, true);
    size_t full = p.n;
    bytes cut = {0};
    put(&cut, p.p, full / 2);
    EXPECT_ERR(h, "truncated pickle", load_pickle(h, "trunc.bin", &cut, &tt, &e), DCS_ERR_FORMAT, &e,
               "trunc.bin", NULL);
    bytes_free(&cut);
    for (size_t n = 0; n < full; n++) { /* every cut fails cleanly */
        put(&cut, p.p, n);
        dcs_status s = load_pickle(h, "cut.bin", &cut, &tt, &e);
        CHECKF(h, s == DCS_ERR_FORMAT && tt.n == 0, "pickle cut to %zu bytes: %s", n, dcs_status_name(s));
        dcs_tt_free(&tt);
        bytes_free(&cut);
    }
    bytes_free(&p);

#define PK(lit) lit, sizeof(lit) - 1
    static const struct {
        const char *what, *file;
        const char *pkl;
        size_t len;
        const char *needle;
    } pcases[] = {
        {"NEWOBJ", "newobj.bin", PK("\x80\x02}\x81."), "opcode 0x81"},
        {"INST", "inst.bin", PK("\x80\x02(ios\nsystem\n."), "opcode 0x69 ('i')"},
        {"empty pickle", "nopkl.bin", PK(""), "without STOP"},
        {"REDUCE on empty stack", "reduce.bin", PK("\x80\x02R."), "empty stack"},
        {"memo miss", "memo.bin", PK("\x80\x02h\x05."), "memo slot 5"},
        {"not a dict", "list.bin", PK("\x80\x02]."), "is a list"},
        {"nested dict", "nested.bin", PK("\x80\x02}X\x0a\0\0\0state_dict}s."), "'state_dict' is a dict"},
        {"int value", "intval.bin", PK("\x80\x02}X\x01\0\0\0aK\x01s."), "'a' is a int"},
        {"two results", "two.bin", PK("\x80\x02}}."), "STOP with 2 values"},
        {"protocol 9", "proto9.bin", PK("\x80\x09}."), "protocol 9"},
        {"SETITEMS odd", "odd.bin", PK("\x80\x02}(K\x01u."), "odd"},
        {"APPEND to dict", "append.bin",
         PK("\x80\x02}K\x01"
            "a."),
         "APPEND into a dict"},
        {"BUILD on list", "build.bin", PK("\x80\x02]}b."), "BUILD on a list"},
        {"bad persistent id", "pid.bin", PK("\x80\x02K\x01Q."), "persistent id"},
        {"storage called", "callstorage.bin", PK("\x80\x02\x63torch\nHalfStorage\n)R."),
         "storage class is called"},
        {"LONG1 too long", "long.bin", PK("\x80\x02\x8a\x09"), "9 bytes"},
        {"memo index huge", "memoidx.bin", PK("\x80\x02}r\xff\xff\xff\x7f."), "memo index"},
        {"POP_MARK without MARK", "popmark.bin", PK("\x80\x02}1."), "without a MARK"},
    };
    for (size_t i = 0; i < sizeof pcases / sizeof pcases[0]; i++) {
        bytes q = {0};
        put(&q, pcases[i].pkl, pcases[i].len);
        EXPECT_ERR(h, pcases[i].what, load_pickle(h, pcases[i].file, &q, &tt, &e), DCS_ERR_FORMAT, &e,
                   pcases[i].file, pcases[i].needle);
        CHECK(h, tt.n == 0);
        dcs_tt_free(&tt);
        bytes_free(&q);
    }

    /* Limits: stack depth and MARK nesting. */
    bytes deep = {0};
    put8(&deep, 0x80);
    put8(&deep, 2);
    for (int i = 0; i < (1 << 20) + 1; i++) put8(&deep, 'N');
    put8(&deep, '.');
    EXPECT_ERR(h, "stack limit", load_pickle(h, "deep.bin", &deep, &tt, &e), DCS_ERR_NOMEM, &e, "deep.bin",
               "stack deeper than");
    bytes_free(&deep);
    put8(&deep, 0x80);
    put8(&deep, 2);
    for (int i = 0; i < (1 << 16) + 1; i++) put8(&deep, '(');
    put8(&deep, '.');
    EXPECT_ERR(h, "MARK limit", load_pickle(h, "marks.bin", &deep, &tt, &e), DCS_ERR_NOMEM, &e, "marks.bin",
               "nested MARKs");
    bytes_free(&deep);
    dcs_tt_free(&tt);

    /* Broken archives. */
    pk_state_dict(&p, kSpecs, 5, false);
    static const float floats[3] = {1.0f, 2.0f, 3.0f};
    tstorage st[2] = {{"0", kHalves, sizeof kHalves}, {"1", floats, sizeof floats}};
    const char *path = path_in(h, NULL, "deflate.bin");
    zopts deflate = {.pkl_method = 8};
    write_torchzip(path, &p, st, 2, &deflate);
    dcs_tt_free(&tt);
    EXPECT_ERR(h, "compressed entry", dcs_tt_add_torchzip(&tt, path, &e), DCS_ERR_FORMAT, &e, "deflate.bin",
               "'archive/data.pkl' is compressed (method 8)");
    path = path_in(h, NULL, "bigendian.bin");
    zopts big = {.byteorder = "big"};
    write_torchzip(path, &p, st, 2, &big);
    EXPECT_ERR(h, "big endian", dcs_tt_add_torchzip(&tt, path, &e), DCS_ERR_FORMAT, &e, "bigendian.bin",
               "little-endian");
    path = path_in(h, NULL, "nopkl.bin");
    zopts nopkl = {.no_pkl = true};
    write_torchzip(path, &p, st, 2, &nopkl);
    EXPECT_ERR(h, "no data.pkl", dcs_tt_add_torchzip(&tt, path, &e), DCS_ERR_FORMAT, &e, "nopkl.bin",
               "data.pkl");
    path = path_in(h, NULL, "random.bin");
    write_file(path, "this is not a zip archive at all, just text......", 48);
    EXPECT_ERR(h, "not a zip", dcs_tt_add_torchzip(&tt, path, &e), DCS_ERR_FORMAT, &e, "random.bin",
               "not a zip archive");

    /* A storage entry whose size runs past the end of the file. */
    bytes z = {0};
    zopts none = {0};
    torchzip_bytes(&z, &p, st, 2, &none);
    bytes big_entry = {0};
    put(&big_entry, z.p, z.n);
    if (CHECK(h, patch_cd_size(&big_entry, "archive/data/0", 1000000))) {
        dcs_tt_free(&tt);
        EXPECT_ERR(h, "entry past EOF", dcs_tt_parse_torchzip(&tt, big_entry.p, big_entry.n, "past.bin", &e),
                   DCS_ERR_IO, &e, "past.bin", "'archive/data/0' (1000000 bytes");
    }
    bytes_free(&big_entry);
    dcs_tt_free(&tt);
    for (size_t n = 0; n < z.n; n++) { /* every cut fails cleanly */
        dcs_status s = dcs_tt_parse_torchzip(&tt, z.p, n, "cut.bin", &e);
        CHECKF(h, s != DCS_OK && tt.n == 0, "zip cut to %zu bytes: %s", n, dcs_status_name(s));
    }
    /* Flip every byte of the archive: never a crash (ASan), tables stay sane. */
    for (size_t i = 0; i < z.n; i++) {
        uint8_t save = z.p[i];
        z.p[i] ^= 0xff;
        dcs_status s = dcs_tt_parse_torchzip(&tt, z.p, z.n, "flip.bin", &e);
        if (s == DCS_OK) dcs_tt_free(&tt);
        CHECK(h, tt.n == 0);
        z.p[i] = save;
    }
    bytes_free(&z);
    bytes_free(&p);
    dcs_tt_free(&tt);
}

/* ================================================================ main */

int main(void) {
    harness h = {0};
    snprintf(h.dir, sizeof h.dir, "%s/dcs_loaders_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (mkdtemp(h.dir) == NULL) {
        perror("mkdtemp");
        return 2;
    }
    test_status_names(&h);
    test_to_f32(&h);
    test_files(&h);
    test_safetensors_valid(&h);
    test_safetensors_bad(&h);
    test_dirs(&h);
    test_torchzip_valid(&h);
    test_torchzip_bad(&h);
    remove_tree(h.dir);
    return check_report("loaders", &h.counts);
}
