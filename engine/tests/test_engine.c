/*
 * test_engine.c -- the engine through its public API (dclens.h): loading,
 * the forward pass, hooks, weights, and every bad input of those calls.
 *
 * The test writes its own checkpoints into a temporary directory: a tiny
 * DCPythia (2 layers, dim 16, 4 heads, vocab 50, window 4, fused wqkv, DCMHA
 * with K = 16, R = 2; model-spec.md section 2) and a tiny Pythia (gpt_neox,
 * section 3), as config.json + model.safetensors with small deterministic
 * random F32 weights, plus broken variants of both (config errors, missing /
 * mis-shaped / extra tensors).
 *
 * Checked: hook-free and hooked passes give bit-identical logits; each
 * wanted hook point is called once per layer with its documented shape;
 * the compose branches sum to the composed scores / pattern; the causal and
 * local masks; batching and prefixes; a hook that aborts gives DCS_ERR_HOOK
 * naming the hook and the model stays usable; bad tokens, sizes, hook
 * names and weight names give DCS_ERR_ARG with a message; a pass too large
 * for memory is refused before allocating; load/forward/free cycles (run
 * under LeakSanitizer by `make asan`).
 *
 * Output: one line per failed check, then "engine: N passed, M failed";
 * the exit status is nonzero when a check failed.
 */
#include "dcs_model.h" /* test_keep_16bit looks at the weight fields */
#include "check.h"

#include <dirent.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ================================================================ harness */

static check_counts counts;

static bool check_at(bool ok, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    bool r = check_count(&counts, ok, line, fmt, ap);
    va_end(ap);
    return r;
}

#define CHECK(cond) check_at((cond), __LINE__, "%s", #cond)
#define CHECKF(cond, ...) check_at((cond), __LINE__, __VA_ARGS__)

/* Status `got` must be `want` and, on error, `msg` must contain each of the
 * (up to two) needles. */
static int verbose; /* DCS_TEST_VERBOSE=1: print every expected error */

static void expect_at(int line, const char *what, dcs_status got, dcs_status want, const char *msg,
                      const char *needle1, const char *needle2) {
    if (verbose) printf("| %s | %s | %s |\n", what, dcs_status_name(got), got && msg ? msg : "");
    check_at(got == want, line, "%s: got %s, want %s (%s)", what, dcs_status_name(got), dcs_status_name(want),
             msg ? msg : "");
    if (got == DCS_OK || want == DCS_OK) return;
    if (needle1)
        check_at(msg && strstr(msg, needle1), line, "%s: message lacks '%s': %s", what, needle1,
                 msg ? msg : "(null)");
    if (needle2)
        check_at(msg && strstr(msg, needle2), line, "%s: message lacks '%s': %s", what, needle2,
                 msg ? msg : "(null)");
}
#define EXPECT(what, got, want, msg, n1, n2) expect_at(__LINE__, (what), (got), (want), (msg), (n1), (n2))

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "test_engine: out of memory\n");
        exit(2);
    }
    return p;
}

/* ================================================================ files */

static char tmp_root[256];

static void rm_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[1024];
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode))
            rm_tree(p);
        else
            unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

/* A fresh subdirectory of the temporary root; returned path is static-ish
 * (one of 4 rotating buffers). */
static const char *new_dir(const char *name) {
    static char buf[4][512];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, 512, "%s/%s", tmp_root, name);
    rm_tree(p);
    if (mkdir(p, 0700) != 0) {
        perror(p);
        exit(2);
    }
    return p;
}

#define WRITE_LIT(dir, name, lit) write_file((dir), (name), (lit), sizeof(lit) - 1)

static void write_file(const char *dir, const char *name, const void *data, size_t n) {
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n)) {
        perror(p);
        exit(2);
    }
    fclose(f);
}

/* ================================================================ weights */

/* Deterministic values: a hash of (tensor name, element index), so that a
 * tensor has the same values whatever else the checkpoint holds. */
static uint64_t splitmix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ULL;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ULL;
    return h;
}

static bool ends_with(const char *s, const char *suf) {
    size_t n = strlen(s), k = strlen(suf);
    return n >= k && !strcmp(s + n - k, suf);
}

/* Element i of the tensor whose canonical name is `name`. Norm weights and
 * QK-norm scales are near 1, the rest uniform in [-0.4, 0.4). */
static float value(const char *name, uint64_t i) {
    double u = (double)(splitmix(name_hash(name) ^ splitmix(i)) >> 11) / 9007199254740992.0;
    u = 2.0 * u - 1.0;
    if (ends_with(name, "norm.weight") || ends_with(name, "layernorm.weight") || ends_with(name, ".scale"))
        return (float)(1.0 + 0.1 * u);
    return (float)(0.4 * u);
}

/* ================================================================ checkpoints */

enum { L = 2, D = 16, NH = 4, DH = 4, F = 32, V = 50, WIN = 4, KH = 16, R = 2 };

typedef struct {
    char name[128];
    int ndim;
    int64_t shape[5];
    char src[128];   /* canonical name the values come from ("" = name)    */
    uint64_t offset; /* first element of src                              */
} tspec;

typedef struct {
    tspec t[96];
    int n;
} tlist;

static tspec *add_t(tlist *tl, const char *name, int ndim, int64_t d0, int64_t d1, int64_t d2, int64_t d3,
                    int64_t d4) {
    if (tl->n == (int)(sizeof tl->t / sizeof tl->t[0])) {
        fprintf(stderr, "test_engine: too many tensors\n");
        exit(2);
    }
    tspec *t = &tl->t[tl->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = ndim;
    int64_t s[5] = {d0, d1, d2, d3, d4};
    memcpy(t->shape, s, sizeof s);
    return t;
}

static uint64_t numel(const tspec *t) {
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
    return n;
}

/* The tensors of the tiny DCPythia (unfused: wq, wk, wv [D, D] taking their
 * values from the rows of the fused wqkv, so both load to the same model). */
static void dcpythia_tensors(tlist *tl, bool unfused) {
    char nm[128], src[128];
    tl->n = 0;
    add_t(tl, "tok_embeddings.weight", 2, V, D, 0, 0, 0);
    for (int l = 0; l < L; l++) {
#define T1(suffix, d0) (snprintf(nm, sizeof nm, "layers.%d.%s", l, suffix), add_t(tl, nm, 1, d0, 0, 0, 0, 0))
#define T2(suffix, d0, d1)                                                                                   \
    (snprintf(nm, sizeof nm, "layers.%d.%s", l, suffix), add_t(tl, nm, 2, d0, d1, 0, 0, 0))
        T1("attention_norm.weight", D);
        T1("attention_norm.bias", D);
        T1("ffn_norm.weight", D);
        T1("ffn_norm.bias", D);
        if (!unfused) {
            T2("attention.wqkv.weight", 3 * D, D);
            T1("attention.wqkv.bias", 3 * D);
        } else {
            static const char *parts[3] = {"wq", "wk", "wv"};
            for (int j = 0; j < 3; j++) {
                char sfx[64];
                snprintf(sfx, sizeof sfx, "attention.%s.weight", parts[j]);
                tspec *t = T2(sfx, D, D);
                snprintf(src, sizeof src, "layers.%d.attention.wqkv.weight", l);
                snprintf(t->src, sizeof t->src, "%s", src);
                t->offset = (uint64_t)j * D * D;
                snprintf(sfx, sizeof sfx, "attention.%s.bias", parts[j]);
                t = T1(sfx, D);
                snprintf(src, sizeof src, "layers.%d.attention.wqkv.bias", l);
                snprintf(t->src, sizeof t->src, "%s", src);
                t->offset = (uint64_t)j * D;
            }
        }
        T2("attention.wo.weight", D, D);
        T1("attention.wo.bias", D);
        T1("attention.q_norm.scale", DH);
        T1("attention.k_norm.scale", DH);
        snprintf(nm, sizeof nm, "layers.%d.attention.dyn_w_proj.dw1", l);
        add_t(tl, nm, 4, D, 1, 4, KH, 0);
        snprintf(nm, sizeof nm, "layers.%d.attention.dyn_w_proj.qkw", l);
        add_t(tl, nm, 5, 1, 4, KH, 2 * R, NH);
        snprintf(nm, sizeof nm, "layers.%d.attention.dyn_w_proj.dd", l);
        add_t(tl, nm, 3, D, 1, 4 * NH, 0, 0);
        T2("feed_forward.w1.weight", F, D);
        T1("feed_forward.w1.bias", F);
        T2("feed_forward.w2.weight", D, F);
        T1("feed_forward.w2.bias", D);
#undef T1
#undef T2
    }
    add_t(tl, "norm.weight", 1, D, 0, 0, 0, 0);
    add_t(tl, "norm.bias", 1, D, 0, 0, 0, 0);
    add_t(tl, "output.weight", 2, V, D, 0, 0, 0);
}

static void neox_tensors(tlist *tl) {
    char nm[128];
    tl->n = 0;
    add_t(tl, "gpt_neox.embed_in.weight", 2, V, D, 0, 0, 0);
    for (int l = 0; l < L; l++) {
#define T1(suffix, d0)                                                                                       \
    (snprintf(nm, sizeof nm, "gpt_neox.layers.%d.%s", l, suffix), add_t(tl, nm, 1, d0, 0, 0, 0, 0))
#define T2(suffix, d0, d1)                                                                                   \
    (snprintf(nm, sizeof nm, "gpt_neox.layers.%d.%s", l, suffix), add_t(tl, nm, 2, d0, d1, 0, 0, 0))
        T1("input_layernorm.weight", D);
        T1("input_layernorm.bias", D);
        T1("post_attention_layernorm.weight", D);
        T1("post_attention_layernorm.bias", D);
        T2("attention.query_key_value.weight", 3 * D, D);
        T1("attention.query_key_value.bias", 3 * D);
        T2("attention.dense.weight", D, D);
        T1("attention.dense.bias", D);
        T2("mlp.dense_h_to_4h.weight", F, D);
        T1("mlp.dense_h_to_4h.bias", F);
        T2("mlp.dense_4h_to_h.weight", D, F);
        T1("mlp.dense_4h_to_h.bias", D);
        T1("attention.rotary_emb.inv_freq", DH / 2); /* a buffer: ignored */
#undef T1
#undef T2
    }
    add_t(tl, "gpt_neox.final_layer_norm.weight", 1, D, 0, 0, 0, 0);
    add_t(tl, "gpt_neox.final_layer_norm.bias", 1, D, 0, 0, 0, 0);
    add_t(tl, "embed_out.weight", 2, V, D, 0, 0, 0);
}

static tspec *find_t(tlist *tl, const char *name) {
    for (int i = 0; i < tl->n; i++)
        if (!strcmp(tl->t[i].name, name)) return &tl->t[i];
    return NULL;
}

static void drop_t(tlist *tl, const char *name) {
    tspec *t = find_t(tl, name);
    if (!t) {
        fprintf(stderr, "test_engine: no tensor %s to drop\n", name);
        exit(2);
    }
    *t = tl->t[--tl->n];
}

/* model.safetensors holding the tensors of tl (F32), for the malformed
 * checkpoints of test_config_errors / test_tensor_errors; the valid ones are
 * generated (fixture()). `pad`: pad the header so the data is 8-aligned. */
static void write_safetensors(const char *dir, const tlist *tl, bool pad) {
    const int es = 4;
    size_t hcap = 64 + (size_t)tl->n * 256, hn = 0;
    char *h = xcalloc(hcap, 1);
    uint64_t off = 0;
    hn += (size_t)snprintf(h + hn, hcap - hn, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < tl->n; i++) {
        const tspec *t = &tl->t[i];
        uint64_t bytes = numel(t) * (uint64_t)es;
        hn += (size_t)snprintf(h + hn, hcap - hn, ",\"%s\":{\"dtype\":\"F32\",\"shape\":[", t->name);
        for (int d = 0; d < t->ndim; d++)
            hn += (size_t)snprintf(h + hn, hcap - hn, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        hn += (size_t)snprintf(h + hn, hcap - hn, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                               (unsigned long long)(off + bytes));
        off += bytes;
    }
    hn += (size_t)snprintf(h + hn, hcap - hn, "}");
    while (pad && (8 + hn) % 8) h[hn++] = ' ';
    if (!pad && (8 + hn) % 4 == 0) h[hn++] = ' '; /* make the data misaligned for float reads */
    size_t total = 8 + hn + (size_t)off;
    uint8_t *buf = xcalloc(total, 1);
    uint64_t hlen = hn;
    for (int b = 0; b < 8; b++) buf[b] = (uint8_t)(hlen >> (8 * b));
    memcpy(buf + 8, h, hn);
    uint8_t *p = buf + 8 + hn;
    for (int i = 0; i < tl->n; i++) {
        const tspec *t = &tl->t[i];
        const char *src = t->src[0] ? t->src : t->name;
        uint64_t n = numel(t);
        for (uint64_t j = 0; j < n; j++) {
            float v = value(src, t->offset + j);
            uint32_t u;
            memcpy(&u, &v, 4);
            for (int b = 0; b < es; b++) *p++ = (uint8_t)(u >> (8 * b));
        }
    }
    write_file(dir, "model.safetensors", buf, total);
    free(buf);
    free(h);
}

/* config.json from key/value-text pairs; `edit` (may be NULL) names a key
 * to replace by `val` (NULL: drop it), or adds it when absent. */
typedef struct {
    const char *key, *val;
} kv;

static const kv DCP_CONFIG[] = {{"model_type", "\"dcpythia\""},
                                {"dim", "16"},
                                {"n_head", "4"},
                                {"n_layer", "2"},
                                {"intermediate_size", "32"},
                                {"vocab_size", "50"},
                                {"window_size", "4"},
                                {"window_type", "null"},
                                {"use_qk_norm", "true"},
                                {"use_parallel_residual", "true"},
                                {"use_linear_bias", "true"},
                                {"query_wise", "false"},
                                {"use_dcmha", "true"},
                                {"tie_word_embeddings", "false"},
                                {"rotary_pct", "0.5"},
                                {"rope_base", "10000"},
                                {"norm_eps", "1e-05"},
                                {NULL, NULL}};

static const kv NEOX_CONFIG[] = {{"model_type", "\"gpt_neox\""},
                                 {"hidden_size", "16"},
                                 {"num_attention_heads", "4"},
                                 {"num_hidden_layers", "2"},
                                 {"intermediate_size", "32"},
                                 {"vocab_size", "50"},
                                 {"rotary_pct", "0.5"},
                                 {"rotary_emb_base", "10000"},
                                 {"layer_norm_eps", "1e-05"},
                                 {"use_parallel_residual", "true"},
                                 {"hidden_act", "\"gelu\""},
                                 {"tie_word_embeddings", "false"},
                                 {NULL, NULL}};

static void write_config(const char *dir, const kv *base, const char *edit, const char *val) {
    char buf[4096];
    size_t n = 0;
    bool seen = false;
    n += (size_t)snprintf(buf + n, sizeof buf - n, "{");
    for (const kv *p = base; p->key; p++) {
        const char *v = p->val;
        if (edit && !strcmp(edit, p->key)) {
            seen = true;
            v = val;
        }
        if (v) n += (size_t)snprintf(buf + n, sizeof buf - n, "%s\"%s\": %s", n > 1 ? ", " : "", p->key, v);
    }
    if (edit && !seen && val) n += (size_t)snprintf(buf + n, sizeof buf - n, ", \"%s\": %s", edit, val);
    n += (size_t)snprintf(buf + n, sizeof buf - n, "}\n");
    write_file(dir, "config.json", buf, n);
}

/* A checkpoint directory written before the test by the Python fixture
 * writer (engine/Makefile: make fixtures, i.e. python3 -m
 * dclens.testing.fixtures DIR; DCS_TEST_FIXTURES names DIR, default
 * "fixtures" in the build directory): dcpythia, dcpythia_unfused,
 * dcpythia_unaligned, dcpythia_bf16, neox. Their values are value(). */
static const char *fixture(const char *name) {
    static char buf[4][512];
    static int k;
    const char *root = getenv("DCS_TEST_FIXTURES");
    char *p = buf[k++ % 4];
    snprintf(p, 512, "%s/%s", root && *root ? root : "fixtures", name);
    char cfg[600];
    snprintf(cfg, sizeof cfg, "%s/config.json", p);
    struct stat st;
    if (stat(cfg, &st) != 0) {
        fprintf(stderr,
                "test_engine: no fixture %s: run `make fixtures` (python3 -m dclens.testing.fixtures "
                "DIR; DCS_TEST_FIXTURES=DIR)\n",
                cfg);
        exit(2);
    }
    return p;
}

static dcs_model *load_ok(const char *dir, int line) {
    dcs_model *m = NULL;
    char err[1024] = "";
    dcs_status s = dcs_load(dir, NULL, &m, err, sizeof err);
    check_at(s == DCS_OK && m != NULL, line, "load %s: %s %s", dir, dcs_status_name(s), err);
    return s == DCS_OK ? m : NULL;
}
#define LOAD_OK(dir) load_ok((dir), __LINE__)

/* ================================================================ hooks */

enum { H_READ, H_COUNT, H_CAPTURE, H_ABORT, H_SETERR, H_ZERO, H_SAME, H_NAN };

typedef struct {
    dcs_model *m;
    int mode;
    int B, T;
    int target_point, target_layer; /* H_ABORT, H_SETERR, H_ZERO, H_SAME, H_NAN */
    int counts[DCS_HP_COUNT][L];
    int bad_args;                /* calls with a shape unlike dcs_hook_shape */
    float *cap[DCS_HP_COUNT][L]; /* H_CAPTURE: copies, malloc'd           */
    size_t cap_n[DCS_HP_COUNT][L];
} hctx;

static int hook_fn(void *user, int point, int layer, float *data, const int64_t *shape, int ndim) {
    hctx *h = user;
    if (point < 0 || point >= DCS_HP_COUNT || layer < 0 || layer >= L) {
        h->bad_args++;
        return 0;
    }
    int64_t want[6];
    int nd = dcs_hook_shape(h->m, point, h->B, h->T, want);
    size_t n = 1;
    if (nd != ndim) h->bad_args++;
    for (int i = 0; i < ndim && i < 6; i++) {
        if (nd == ndim && shape[i] != want[i]) h->bad_args++;
        n *= (size_t)shape[i];
    }
    h->counts[point][layer]++;
    bool target = point == h->target_point && layer == h->target_layer;
    switch (h->mode) {
    case H_READ: {
        volatile float s = 0; /* touch every element (ASan checks the extent) */
        for (size_t i = 0; i < n; i++) s += data[i];
        (void)s;
        return 0;
    }
    case H_CAPTURE:
        free(h->cap[point][layer]);
        h->cap[point][layer] = xcalloc(n, sizeof(float));
        memcpy(h->cap[point][layer], data, n * sizeof(float));
        h->cap_n[point][layer] = n;
        return 0;
    case H_ABORT: return target ? -1 : 0;
    case H_SETERR:
        if (!target) return 0;
        dcs_set_hook_error(h->m, "my hook says no: budget exceeded");
        return -3;
    case H_ZERO:
        if (!target) return 0;
        memset(data, 0, n * sizeof(float));
        return 1;
    case H_SAME: return target ? 1 : 0; /* "modified", values unchanged */
    case H_NAN:
        if (!target) return 0;
        data[0] = NAN;
        return 1;
    default: return 0;
    }
}

static void hctx_free(hctx *h) {
    for (int p = 0; p < DCS_HP_COUNT; p++)
        for (int l = 0; l < L; l++) free(h->cap[p][l]);
    memset(h, 0, sizeof *h);
}

/* want[] with every point (of every layer) set, or just one. */
static void want_all(uint8_t *want) { memset(want, 1, (size_t)DCS_HP_COUNT * L); }
static void want_one(uint8_t *want, int point, int layer) {
    memset(want, 0, (size_t)DCS_HP_COUNT * L);
    want[dcs_hook_index(L, point, layer)] = 1;
}

static bool finite_all(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}

static double max_abs_diff(const float *a, const float *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= m)) m = d; /* NaN wins */
    }
    return m;
}

static double max_abs(const float *a, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++)
        if (fabs(a[i]) > m) m = fabs(a[i]);
    return m;
}

/* ================================================================ tests */

enum { T0 = 7 };
static const int32_t TOKS[2][T0] = {{3, 17, 42, 0, 49, 8, 25}, {11, 11, 2, 30, 7, 44, 19}};

/* Plain forward of both models, hook-free. */
static void test_forward_basic(dcs_model *m, const char *what, float *ref) {
    dcs_status s = dcs_forward(m, TOKS[0], 1, T0, ref, NULL);
    CHECKF(s == DCS_OK, "%s forward: %s %s", what, dcs_status_name(s), dcs_errmsg(m));
    CHECKF(finite_all(ref, (size_t)T0 * V), "%s: logits not finite", what);
    CHECKF(max_abs(ref, (size_t)T0 * V) > 1e-3, "%s: logits all zero", what);

    /* repeatable, bit for bit */
    float *again = xcalloc((size_t)T0 * V, sizeof(float));
    CHECK(dcs_forward(m, TOKS[0], 1, T0, again, NULL) == DCS_OK);
    CHECKF(!memcmp(again, ref, sizeof(float) * T0 * V), "%s: second pass differs", what);

    /* no logits wanted: fine */
    CHECK(dcs_forward(m, TOKS[0], 1, T0, NULL, NULL) == DCS_OK);

    /* causal: a prefix gives the same rows */
    CHECK(dcs_forward(m, TOKS[0], 1, 4, again, NULL) == DCS_OK);
    double d = max_abs_diff(again, ref, (size_t)4 * V);
    CHECKF(d <= 1e-5 * max_abs(ref, (size_t)4 * V), "%s: prefix rows differ by %g", what, d);

    /* batch of two: each row as if alone */
    float *two = xcalloc((size_t)2 * T0 * V, sizeof(float));
    float *one = xcalloc((size_t)T0 * V, sizeof(float));
    CHECK(dcs_forward(m, &TOKS[0][0], 2, T0, two, NULL) == DCS_OK);
    CHECK(dcs_forward(m, TOKS[1], 1, T0, one, NULL) == DCS_OK);
    d = max_abs_diff(two, ref, (size_t)T0 * V);
    CHECKF(d <= 1e-5 * max_abs(ref, (size_t)T0 * V), "%s: batch row 0 differs by %g", what, d);
    d = max_abs_diff(two + (size_t)T0 * V, one, (size_t)T0 * V);
    CHECKF(d <= 1e-5 * max_abs(one, (size_t)T0 * V), "%s: batch row 1 differs by %g", what, d);
    free(two);
    free(one);
    free(again);
}

/* Every hook wanted, read-only: same logits, each point once per layer. */
static void test_hooks_read_and_count(dcs_model *m, const char *what, const float *ref) {
    uint8_t want[DCS_HP_COUNT * L];
    want_all(want);
    float *ref2 = xcalloc((size_t)2 * T0 * V, sizeof(float));
    CHECK(dcs_forward(m, &TOKS[0][0], 2, T0, ref2, NULL) == DCS_OK);
    for (int B = 1; B <= 2; B++) {
        hctx h;
        memset(&h, 0, sizeof h);
        h.m = m;
        h.mode = B == 1 ? H_READ : H_COUNT;
        h.B = B;
        h.T = T0;
        dcs_hooks hk = {want, hook_fn, &h};
        float *lg = xcalloc((size_t)B * T0 * V, sizeof(float));
        dcs_status s = dcs_forward(m, &TOKS[0][0], B, T0, lg, &hk);
        CHECKF(s == DCS_OK, "%s hooked B=%d: %s %s", what, B, dcs_status_name(s), dcs_errmsg(m));
        CHECKF(!memcmp(lg, B == 1 ? ref : ref2, sizeof(float) * (size_t)B * T0 * V),
               "%s: logits with every hook (B=%d) differ from the hook-free pass", what, B);
        CHECKF(h.bad_args == 0, "%s: %d hook calls with a wrong shape or point", what, h.bad_args);
        for (int p = 0; p < DCS_HP_COUNT; p++) {
            int layered = dcs_hook_point_is_layered(p), exists = dcs_hook_exists(m, p);
            for (int l = 0; l < L; l++) {
                int expect = exists && (layered || l == 0) ? 1 : 0;
                CHECKF(h.counts[p][l] == expect, "%s B=%d: %s layer %d called %d times, want %d", what, B,
                       dcs_hook_point_name(p), l, h.counts[p][l], expect);
            }
        }
        free(lg);
        hctx_free(&h);
    }
    free(ref2);

    /* only one point wanted: only it is called */
    hctx h;
    memset(&h, 0, sizeof h);
    h.m = m;
    h.mode = H_COUNT;
    h.B = 1;
    h.T = T0;
    want_one(want, DCS_HP_PATTERN, 1);
    dcs_hooks hk = {want, hook_fn, &h};
    CHECK(dcs_forward(m, TOKS[0], 1, T0, NULL, &hk) == DCS_OK);
    int total = 0;
    for (int p = 0; p < DCS_HP_COUNT; p++)
        for (int l = 0; l < L; l++) total += h.counts[p][l];
    CHECKF(total == 1 && h.counts[DCS_HP_PATTERN][1] == 1, "%s: one wanted point, %d calls", what, total);

    /* hooks struct with want or fn NULL: a plain pass */
    dcs_hooks none = {NULL, hook_fn, &h};
    float *lg = xcalloc((size_t)T0 * V, sizeof(float));
    CHECK(dcs_forward(m, TOKS[0], 1, T0, lg, &none) == DCS_OK);
    CHECK(!memcmp(lg, ref, sizeof(float) * T0 * V));
    dcs_hooks nofn = {want, NULL, &h};
    CHECK(dcs_forward(m, TOKS[0], 1, T0, lg, &nofn) == DCS_OK);
    CHECK(!memcmp(lg, ref, sizeof(float) * T0 * V));
    free(lg);
    hctx_free(&h);
}

/* The masks, and the compose branches summing to what they compose. */
static void test_captured_invariants(dcs_model *m, const char *what, int dcmha) {
    uint8_t want[DCS_HP_COUNT * L];
    want_all(want);
    hctx h;
    memset(&h, 0, sizeof h);
    h.m = m;
    h.mode = H_CAPTURE;
    h.B = 2;
    h.T = T0;
    dcs_hooks hk = {want, hook_fn, &h};
    CHECK(dcs_forward(m, &TOKS[0][0], 2, T0, NULL, &hk) == DCS_OK);
    const size_t map = (size_t)2 * NH * T0 * T0;
    for (int l = 0; l < L; l++) {
        int local = dcs_layer_is_local(m, l);
        int window = local ? WIN : 0;
        const float *P = h.cap[DCS_HP_PATTERN][l];
        const float *PC = h.cap[DCS_HP_PATTERN_COMPOSED][l];
        if (!CHECKF(P && h.cap_n[DCS_HP_PATTERN][l] == map, "%s: pattern %d not captured", what, l)) continue;
        int mask_bad = 0, sum_bad = 0;
        for (size_t bn = 0; bn < (size_t)2 * NH; bn++)
            for (int t = 0; t < T0; t++) {
                double sum = 0;
                for (int s = 0; s < T0; s++) {
                    size_t i = (bn * T0 + (size_t)t) * T0 + (size_t)s;
                    bool allowed = s <= t && (window == 0 || t - s <= window);
                    if (!allowed && (P[i] != 0.0f || (PC && PC[i] != 0.0f))) mask_bad++;
                    sum += P[i];
                }
                if (fabs(sum - 1.0) > 1e-5) sum_bad++;
            }
        CHECKF(mask_bad == 0, "%s layer %d (%s): %d masked entries nonzero", what, l,
               local ? "local" : "global", mask_bad);
        CHECKF(sum_bad == 0, "%s layer %d: %d pattern rows do not sum to 1", what, l, sum_bad);
        if (!dcmha) {
            CHECK(PC == NULL && h.cap[DCS_HP_PRE_SKIP][l] == NULL);
            continue;
        }
        /* branch sums: pre.* == scores_composed, post.* == pattern_composed */
        static const int first[2] = {DCS_HP_PRE_SKIP, DCS_HP_POST_SKIP};
        static const int total[2] = {DCS_HP_SCORES_COMPOSED, DCS_HP_PATTERN_COMPOSED};
        for (int ph = 0; ph < 2; ph++) {
            const float *want_sum = h.cap[total[ph]][l];
            if (!CHECKF(want_sum != NULL, "%s: %s %d missing", what, dcs_hook_point_name(total[ph]), l))
                continue;
            double worst = 0, scale = max_abs(want_sum, map);
            bool all = true;
            for (size_t i = 0; i < map; i++) {
                double s = 0;
                for (int k = 0; k < 5; k++) {
                    const float *br = h.cap[first[ph] + k][l];
                    if (!br) {
                        all = false;
                        continue;
                    }
                    s += br[i];
                }
                double d = fabs(s - want_sum[i]);
                if (d > worst) worst = d;
            }
            CHECKF(all, "%s layer %d: a %s branch is missing", what, l, ph ? "post" : "pre");
            CHECKF(worst <= 1e-5 * (scale > 1 ? scale : 1), "%s layer %d: %s branches sum off by %g", what, l,
                   ph ? "post" : "pre", worst);
            /* skip is the input of the compose */
            const float *in = h.cap[ph ? DCS_HP_PATTERN : DCS_HP_SCORES][l];
            const float *skip = h.cap[first[ph]][l];
            if (in && skip) {
                int bad = 0;
                for (size_t bn = 0; bn < (size_t)2 * NH; bn++)
                    for (int t = 0; t < T0; t++)
                        for (int s = 0; s < T0; s++) {
                            size_t i = (bn * T0 + (size_t)t) * T0 + (size_t)s;
                            bool allowed = s <= t && (window == 0 || t - s <= window);
                            if ((ph == 0 || allowed) && skip[i] != in[i]) bad++;
                        }
                CHECKF(bad == 0, "%s layer %d: %s.skip differs from its input at %d entries", what, l,
                       ph ? "post" : "pre", bad);
            }
        }
    }
    /* the last logits hook equals what the pass returns */
    float *lg = xcalloc((size_t)2 * T0 * V, sizeof(float));
    CHECK(dcs_forward(m, &TOKS[0][0], 2, T0, lg, NULL) == DCS_OK);
    CHECK(h.cap[DCS_HP_LOGITS][0] && !memcmp(lg, h.cap[DCS_HP_LOGITS][0], sizeof(float) * 2 * T0 * V));
    free(lg);
    hctx_free(&h);
}

/* Hooks that abort, set a message, write: DCS_ERR_HOOK naming the hook, and
 * the model stays usable. */
static void test_hook_errors(dcs_model *m, const char *what, const float *ref, int dcmha) {
    uint8_t want[DCS_HP_COUNT * L];
    float *lg = xcalloc((size_t)T0 * V, sizeof(float));
    static const struct {
        int point, layer;
        const char *name;
    } targets[] = {
        {DCS_HP_EMBED, 0, "hook embed aborted"},
        {DCS_HP_LN_ATTN, 0, "hook blocks.0.ln_attn aborted"},
        {DCS_HP_PRE_KP, 1, "hook blocks.1.attn.pre.kp aborted"},
        {DCS_HP_DYN_POST_QDD, 0, "hook blocks.0.attn.dyn.post.qdd aborted"},
        {DCS_HP_PATTERN, 1, "hook blocks.1.attn.pattern aborted"},
        {DCS_HP_HEAD_OUT, 0, "hook blocks.0.attn.head_out aborted"},
        {DCS_HP_RESID_POST, 1, "hook blocks.1.resid_post aborted"},
        {DCS_HP_LOGITS, 0, "hook logits aborted"},
    };
    for (size_t i = 0; i < sizeof targets / sizeof targets[0]; i++) {
        if (!dcs_hook_exists(m, targets[i].point)) continue;
        hctx h;
        memset(&h, 0, sizeof h);
        h.m = m;
        h.mode = H_ABORT;
        h.B = 1;
        h.T = T0;
        h.target_point = targets[i].point;
        h.target_layer = targets[i].layer;
        want_all(want);
        dcs_hooks hk = {want, hook_fn, &h};
        dcs_status s = dcs_forward(m, TOKS[0], 1, T0, lg, &hk);
        EXPECT(targets[i].name, s, DCS_ERR_HOOK, dcs_errmsg(m), targets[i].name, NULL);
        /* nothing after the abort was called */
        CHECKF(h.counts[DCS_HP_LOGITS][0] == (targets[i].point == DCS_HP_LOGITS),
               "%s: hooks ran after an abort at %s", what, targets[i].name);
        /* the model is usable and unchanged */
        memset(lg, 0, sizeof(float) * T0 * V);
        s = dcs_forward(m, TOKS[0], 1, T0, lg, NULL);
        CHECKF(s == DCS_OK && !memcmp(lg, ref, sizeof(float) * T0 * V),
               "%s: pass after an aborted one differs (%s)", what, dcs_errmsg(m));
        CHECKF(dcs_errmsg(m)[0] == 0, "%s: message left after a good pass: %s", what, dcs_errmsg(m));
        hctx_free(&h);
    }

    /* dcs_set_hook_error: the hook's own message is what the caller sees */
    hctx h;
    memset(&h, 0, sizeof h);
    h.m = m;
    h.mode = H_SETERR;
    h.B = 1;
    h.T = T0;
    h.target_point = DCS_HP_MLP_OUT;
    h.target_layer = 1;
    want_one(want, DCS_HP_MLP_OUT, 1);
    dcs_hooks hk = {want, hook_fn, &h};
    dcs_status s = dcs_forward(m, TOKS[0], 1, T0, lg, &hk);
    EXPECT("dcs_set_hook_error", s, DCS_ERR_HOOK, dcs_errmsg(m), "my hook says no: budget exceeded", NULL);
    CHECK(dcs_forward(m, TOKS[0], 1, T0, lg, NULL) == DCS_OK);
    CHECK(!memcmp(lg, ref, sizeof(float) * T0 * V));
    dcs_set_hook_error(m, NULL); /* allowed: a default message */
    CHECK(dcs_errmsg(m)[0] != 0);

    /* writes: zeroing a point changes the logits; rewriting it unchanged
     * (return 1) takes the recompute path and gives the same logits; a NaN
     * written by a C hook propagates to the logits, which the pass reports
     * as DCS_ERR_NONFINITE (the buffer is still filled), and the next pass
     * is clean again */
    static const int writes[] = {DCS_HP_POST_KP, DCS_HP_PRE_QG, DCS_HP_HEAD_OUT, DCS_HP_PATTERN_COMPOSED,
                                 DCS_HP_PATTERN, DCS_HP_Z,      DCS_HP_MLP_OUT,  DCS_HP_RESID_PRE};
    for (size_t i = 0; i < sizeof writes / sizeof writes[0]; i++) {
        int p = writes[i];
        if (!dcs_hook_exists(m, p)) continue;
        for (int mode = H_ZERO; mode <= H_NAN; mode++) {
            hctx_free(&h);
            h.m = m;
            h.mode = mode;
            h.B = 1;
            h.T = T0;
            h.target_point = p;
            h.target_layer = 0;
            want_one(want, p, 0);
            s = dcs_forward(m, TOKS[0], 1, T0, lg, &hk);
            if (mode == H_NAN)
                CHECKF(s == DCS_ERR_NONFINITE && strstr(dcs_errmsg(m), "logits hold NaN or inf"),
                       "%s write NaN %s: %d %s", what, dcs_hook_point_name(p), s, dcs_errmsg(m));
            else
                CHECKF(s == DCS_OK, "%s write %s: %s", what, dcs_hook_point_name(p), dcs_errmsg(m));
            double d = max_abs_diff(lg, ref, (size_t)T0 * V), sc = max_abs(ref, (size_t)T0 * V);
            if (mode == H_ZERO)
                CHECKF(d > 1e-4 * sc, "%s: zeroing %s changed nothing", what, dcs_hook_point_name(p));
            else if (mode == H_SAME)
                CHECKF(d <= 1e-5 * sc, "%s: rewriting %s unchanged moved logits by %g", what,
                       dcs_hook_point_name(p), d);
            else
                CHECKF(!finite_all(lg, (size_t)T0 * V), "%s: NaN written to %s vanished", what,
                       dcs_hook_point_name(p));
            CHECK(dcs_forward(m, TOKS[0], 1, T0, lg, NULL) == DCS_OK);
            CHECKF(!memcmp(lg, ref, sizeof(float) * T0 * V), "%s: pass after writing %s differs", what,
                   dcs_hook_point_name(p));
        }
    }
    (void)dcmha;
    hctx_free(&h);
    free(lg);
}

/* Bad forward arguments. */
static void test_forward_args(dcs_model *m) {
    float *lg = xcalloc((size_t)2 * T0 * V, sizeof(float));
    /* dcs_cancel: a pass started with the flag set stops before its first
     * layer; cleared, the model works again */
    dcs_cancel(m, 1);
    EXPECT("cancelled", dcs_forward(m, TOKS[0], 1, T0, lg, NULL), DCS_ERR_CANCELLED, dcs_errmsg(m),
           "forward: cancelled", NULL);
    dcs_cancel(m, 0);
    CHECK(dcs_forward(m, TOKS[0], 1, T0, lg, NULL) == DCS_OK);
    CHECK(strcmp(dcs_status_name(DCS_ERR_CANCELLED), "DCS_ERR_CANCELLED") == 0);
    CHECK(strcmp(dcs_status_name(DCS_ERR_NONFINITE), "DCS_ERR_NONFINITE") == 0);
    int32_t bad[2][T0];
    memcpy(bad, TOKS, sizeof bad);
    bad[1][5] = V;
    EXPECT("token == vocab", dcs_forward(m, &bad[0][0], 2, T0, lg, NULL), DCS_ERR_ARG, dcs_errmsg(m),
           "token id 50 at [1, 5]", "out of range [0, 50)");
    bad[1][5] = -7;
    EXPECT("negative token", dcs_forward(m, &bad[0][0], 2, T0, lg, NULL), DCS_ERR_ARG, dcs_errmsg(m),
           "token id -7 at [1, 5]", NULL);
    bad[1][5] = 5;
    bad[0][0] = 1 << 30;
    EXPECT("huge token", dcs_forward(m, &bad[0][0], 2, T0, lg, NULL), DCS_ERR_ARG, dcs_errmsg(m), "at [0, 0]",
           NULL);
    EXPECT("T = 0", dcs_forward(m, TOKS[0], 1, 0, lg, NULL), DCS_ERR_ARG, dcs_errmsg(m), "T=0", NULL);
    EXPECT("B = 0", dcs_forward(m, TOKS[0], 0, T0, lg, NULL), DCS_ERR_ARG, dcs_errmsg(m), "B=0", NULL);
    EXPECT("T < 0", dcs_forward(m, TOKS[0], 1, -3, lg, NULL), DCS_ERR_ARG, dcs_errmsg(m), "T=-3", NULL);
    EXPECT("B < 0", dcs_forward(m, TOKS[0], -1, T0, lg, NULL), DCS_ERR_ARG, dcs_errmsg(m), "B=-1", NULL);
    EXPECT("tokens NULL", dcs_forward(m, NULL, 1, T0, lg, NULL), DCS_ERR_ARG, dcs_errmsg(m), "tokens is NULL",
           NULL);
    CHECK(dcs_forward(NULL, TOKS[0], 1, T0, lg, NULL) == DCS_ERR_ARG);

    /* B*T over the per-pass limit (2^24 tokens) */
    size_t big = ((size_t)1 << 24) + 1;
    int32_t *toks = xcalloc(big, sizeof(int32_t));
    EXPECT("B*T > 2^24", dcs_forward(m, toks, 1, (int)big, lg, NULL), DCS_ERR_ARG, dcs_errmsg(m), "16M",
           NULL);
    EXPECT("B*T > 2^24 batched", dcs_forward(m, toks, 4097, 4096, lg, NULL), DCS_ERR_ARG, dcs_errmsg(m),
           "B*T", NULL);
    /* a pass whose attention map cannot fit is refused before allocating:
     * B=64, T=65536, 4 heads: 4 TiB for one map */
    EXPECT("attention map too large", dcs_forward(m, toks, 64, 65536, lg, NULL), DCS_ERR_NOMEM, dcs_errmsg(m),
           "B=64, T=65536 needs 4 TiB for one attention map", NULL);
    EXPECT("attention map too large (B=1)", dcs_forward(m, toks, 1, 1 << 24, lg, NULL), DCS_ERR_NOMEM,
           dcs_errmsg(m), "T=16777216 needs", "attention map");
    free(toks);

    /* the model still works */
    CHECK(dcs_forward(m, TOKS[0], 1, T0, lg, NULL) == DCS_OK);

    /* attention by query chunks (2 rows), and the full path, against the
     * default (fused on the CPU) to float32 rounding; a bad setting is
     * refused and changes nothing */
    float *other = xcalloc((size_t)T0 * V, sizeof(float));
    const int settings[] = {2, -1, 1, T0 + 5};
    for (size_t i = 0; i < sizeof settings / sizeof settings[0]; i++) {
        CHECK(dcs_model_set_attention_rows(m, settings[i]) == DCS_OK);
        CHECK(dcs_model_attention_rows(m) == settings[i]);
        CHECK(dcs_forward(m, TOKS[0], 1, T0, other, NULL) == DCS_OK);
        float amax = 0.0f, dmax = 0.0f;
        for (size_t j = 0; j < (size_t)T0 * V; j++) {
            amax = fmaxf(amax, fabsf(lg[j]));
            dmax = fmaxf(dmax, fabsf(other[j] - lg[j]));
        }
        CHECK(dmax <= 1e-5f * amax);
    }
    EXPECT("attention_rows -2", dcs_model_set_attention_rows(m, -2), DCS_ERR_ARG, dcs_errmsg(m),
           "attention_rows: -2", NULL);
    CHECK(dcs_model_attention_rows(m) == T0 + 5);
    CHECK(dcs_model_set_attention_rows(NULL, 0) == DCS_ERR_ARG);
    CHECK(dcs_model_attention_rows(NULL) == -2);
    CHECK(dcs_model_set_attention_rows(m, 0) == DCS_OK);
    free(other);
    free(lg);
}

/* BF16 weights stay BF16 on the CPU (the float* fields NULL) until
 * dcs_model_require_f32 widens them; passes are the same either way. */
static void test_keep_16bit(void) {
    const char *dir = fixture("dcpythia_bf16");
    dcs_model *m = NULL;
    char err[512];
    CHECK(dcs_load(dir, NULL, &m, err, sizeof err) == DCS_OK);
    if (!m) return;
    CHECK(m->layers[0].w1 == NULL && m->layers[0].m_w1.dtype == DCS_BF16);
    CHECK(m->tok_emb == NULL && m->m_out_w.dtype == DCS_BF16 && m->layers[1].dw1 == NULL);
    CHECK(m->layers[0].attn_norm_w != NULL); /* small tensors: float32 */
    float *a = xcalloc((size_t)T0 * V, sizeof(float)), *b = xcalloc((size_t)T0 * V, sizeof(float));
    CHECK(dcs_forward(m, TOKS[0], 1, T0, a, NULL) == DCS_OK);
    dcs_err e = {0};
    CHECK(dcs_model_require_f32(m, &e) == DCS_OK);
    CHECK(dcs_model_require_f32(m, &e) == DCS_OK); /* once; the second is a no-op */
    const dcs_layer_weights *w = &m->layers[1];
    CHECK(w->wqkv && w->wo && w->w1 && w->w2 && w->dw1 && m->tok_emb && m->out_w);
    /* the widened values are the stored BF16 ones: value() truncated */
    uint64_t bad = 0;
    for (uint64_t j = 0; j < (uint64_t)F * D; j++) {
        float v = value("layers.1.feed_forward.w1.weight", j), t;
        uint32_t u;
        memcpy(&u, &v, 4);
        u &= 0xffff0000u;
        memcpy(&t, &u, 4);
        bad += memcmp(&t, &w->w1[j], 4) != 0;
    }
    CHECK(bad == 0);
    float rd[F * D];
    CHECK(dcs_weight_read(m, "layers.1.feed_forward.w1.weight", rd, (size_t)F * D) == DCS_OK &&
          memcmp(rd, w->w1, sizeof rd) == 0);
    CHECK(dcs_forward(m, TOKS[0], 1, T0, b, NULL) == DCS_OK);
    CHECK(memcmp(a, b, sizeof(float) * (size_t)T0 * V) == 0);
    CHECK(dcs_model_require_f32(NULL, &e) == DCS_ERR_ARG);
    free(a);
    free(b);
    dcs_free(m);
}

static void test_hook_names(dcs_model *m, int dcmha) {
    int p = -1, l = -1;
    CHECK(dcs_hook_parse(m, "embed", &p, &l) == DCS_OK && p == DCS_HP_EMBED && l == 0);
    CHECK(dcs_hook_parse(m, "logits", &p, &l) == DCS_OK && p == DCS_HP_LOGITS && l == 0);
    CHECK(dcs_hook_parse(m, "blocks.1.attn.pattern", &p, &l) == DCS_OK && p == DCS_HP_PATTERN && l == 1);
    CHECK(dcs_hook_parse(m, "blocks.0.resid_post", &p, &l) == DCS_OK && p == DCS_HP_RESID_POST && l == 0);
    if (dcmha) {
        CHECK(dcs_hook_parse(m, "blocks.1.attn.post.kp", &p, &l) == DCS_OK && p == DCS_HP_POST_KP && l == 1);
        CHECK(dcs_hook_parse(m, "blocks.0.attn.dyn.pre.kw2", &p, &l) == DCS_OK && p == DCS_HP_DYN_PRE_KW2);
    } else {
        EXPECT("post.kp on neox", dcs_hook_parse(m, "blocks.0.attn.post.kp", &p, &l), DCS_ERR_ARG,
               dcs_errmsg(m), "blocks.0.attn.post.kp", "does not exist in this model");
        EXPECT("dyn on neox", dcs_hook_parse(m, "blocks.1.attn.dyn.pre.qw1", &p, &l), DCS_ERR_ARG,
               dcs_errmsg(m), "blocks.1.attn.dyn.pre.qw1", "no DCMHA");
        EXPECT("scores_composed on neox", dcs_hook_parse(m, "blocks.0.attn.scores_composed", &p, &l),
               DCS_ERR_ARG, dcs_errmsg(m), "scores_composed", NULL);
    }
    /* every point by its name, round trip */
    for (int q = 0; q < DCS_HP_COUNT; q++) {
        char nm[128];
        if (dcs_hook_point_is_layered(q))
            snprintf(nm, sizeof nm, "blocks.1.%s", dcs_hook_point_name(q));
        else
            snprintf(nm, sizeof nm, "%s", dcs_hook_point_name(q));
        dcs_status s = dcs_hook_parse(m, nm, &p, &l);
        if (dcs_hook_exists(m, q))
            CHECKF(s == DCS_OK && p == q && l == (dcs_hook_point_is_layered(q) ? 1 : 0), "parse %s: %s", nm,
                   dcs_errmsg(m));
        else
            CHECKF(s == DCS_ERR_ARG, "parse %s of an absent point: %s", nm, dcs_status_name(s));
    }
    CHECK(dcs_hook_point_name(-1) == NULL && dcs_hook_point_name(DCS_HP_COUNT) == NULL);
    CHECK(!dcs_hook_exists(m, -1) && !dcs_hook_exists(m, DCS_HP_COUNT));

    static const struct {
        const char *name, *n1, *n2;
    } bad[] = {
        {"blocks.0.attn.nope", "unknown hook 'blocks.0.attn.nope'", NULL},
        {"blocks.2.attn.z", "layer 2 is out of range", "2 layers"},
        {"blocks.99999999999999999999.attn.z", "out of range", NULL},
        {"blocks.x.attn.z", "blocks.x.attn.z", "expected blocks.<layer>.<point>"},
        {"blocks.-1.attn.z", "blocks.-1.attn.z", NULL},
        {"blocks.+1.attn.z", "blocks.+1.attn.z", NULL},
        {"blocks.1attn.z", "blocks.1attn.z", NULL},
        {"blocks.0", "blocks.0", NULL},
        {"blocks.0.", "blocks.0.", NULL},
        {"blocks.", "blocks.", NULL},
        {"blocks.0.embed", "blocks.0.embed", NULL}, /* a global point with a layer */
        {"attn.z", "unknown hook 'attn.z'", NULL},  /* a layered point without one */
        {"", "unknown hook ''", NULL},
        {"Logits", "unknown hook 'Logits'", NULL},
        {"logits ", "unknown hook", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        EXPECT(bad[i].name, dcs_hook_parse(m, bad[i].name, &p, &l), DCS_ERR_ARG, dcs_errmsg(m), bad[i].n1,
               bad[i].n2);
    EXPECT("NULL hook name", dcs_hook_parse(m, NULL, &p, &l), DCS_ERR_ARG, dcs_errmsg(m), "NULL", NULL);
    /* a very long name is cut in the message, not overflowing it */
    char longname[4096];
    memset(longname, 'a', sizeof longname - 1);
    longname[sizeof longname - 1] = 0;
    memcpy(longname, "blocks.0.", 9);
    EXPECT("long hook name", dcs_hook_parse(m, longname, &p, &l), DCS_ERR_ARG, dcs_errmsg(m), "unknown hook",
           NULL);
}

static void test_weights(dcs_model *m, int dcmha) {
    int64_t shape[5];
    int nd = 0;
    CHECK(dcs_weight_shape(m, "tok_embeddings.weight", shape, &nd) == DCS_OK && nd == 2 && shape[0] == V &&
          shape[1] == D);
    float *w = xcalloc((size_t)V * D, sizeof(float));
    CHECK(dcs_weight_read(m, "tok_embeddings.weight", w, (size_t)V * D) == DCS_OK);
    const char *stored = dcmha ? "tok_embeddings.weight" : "gpt_neox.embed_in.weight";
    int bad = 0;
    for (int i = 0; i < V * D; i++) bad += w[i] != value(stored, (uint64_t)i);
    CHECKF(bad == 0, "tok_embeddings.weight: %d values differ from the file", bad);
    free(w);

    /* fused q, k, v rows (neox: regrouped from per-head blocks) */
    CHECK(dcs_weight_shape(m, "layers.1.attention.wqkv.weight", shape, &nd) == DCS_OK && nd == 2 &&
          shape[0] == 3 * D && shape[1] == D);
    float *qkv = xcalloc((size_t)3 * D * D, sizeof(float));
    CHECK(dcs_weight_read(m, "layers.1.attention.wqkv.weight", qkv, (size_t)3 * D * D) == DCS_OK);
    bad = 0;
    for (int j = 0; j < 3; j++)
        for (int n = 0; n < NH; n++)
            for (int d = 0; d < DH; d++)
                for (int c = 0; c < D; c++) {
                    int row = j * D + n * DH + d;
                    int src = dcmha ? row : n * 3 * DH + j * DH + d;
                    float v = value(dcmha ? "layers.1.attention.wqkv.weight"
                                          : "gpt_neox.layers.1.attention.query_key_value.weight",
                                    (uint64_t)src * D + (uint64_t)c);
                    bad += qkv[(size_t)row * D + (size_t)c] != v;
                }
    CHECKF(bad == 0, "wqkv: %d values not where the q, k, v row order puts them", bad);
    free(qkv);
    if (dcmha) {
        CHECK(dcs_weight_shape(m, "layers.0.attention.dyn_w_proj.qkw", shape, &nd) == DCS_OK && nd == 5 &&
              shape[2] == KH && shape[3] == 2 * R && shape[4] == NH);
        CHECK(dcs_weight_shape(m, "layers.0.attention.q_norm.scale", shape, &nd) == DCS_OK && nd == 1 &&
              shape[0] == DH);
    }

    float buf[D];
    EXPECT("unknown weight", dcs_weight_shape(m, "layers.7.attention.wo.weight", shape, &nd), DCS_ERR_ARG,
           dcs_errmsg(m), "no weight named 'layers.7.attention.wo.weight'", NULL);
    EXPECT("unknown weight read", dcs_weight_read(m, "nope", buf, D), DCS_ERR_ARG, dcs_errmsg(m),
           "no weight named 'nope'", NULL);
    EXPECT("stored (not canonical) name", dcs_weight_read(m, "gpt_neox.final_layer_norm.weight", buf, D),
           DCS_ERR_ARG, dcs_errmsg(m), "no weight named", NULL);
    EXPECT("buffer too small", dcs_weight_read(m, "norm.weight", buf, D - 1), DCS_ERR_ARG, dcs_errmsg(m),
           "'norm.weight' has 16 elements, buffer has 15", NULL);
    EXPECT("buffer too large", dcs_weight_read(m, "norm.weight", buf, D + 1), DCS_ERR_ARG, dcs_errmsg(m),
           "buffer has 17", NULL);
    EXPECT("NULL buffer", dcs_weight_read(m, "norm.weight", NULL, D), DCS_ERR_ARG, dcs_errmsg(m), "NULL",
           NULL);
    EXPECT("NULL name", dcs_weight_shape(m, NULL, shape, &nd), DCS_ERR_ARG, dcs_errmsg(m), "NULL", NULL);
    CHECK(dcs_weight_read(m, "norm.weight", buf, D) == DCS_OK);
    CHECK(buf[3] == value(dcmha ? "norm.weight" : "gpt_neox.final_layer_norm.weight", 3));
}

/* dcs_load on a directory; expect `want` and the needles in the message. */
static void expect_load(int line, const char *what, const char *dir, dcs_status want, const char *n1,
                        const char *n2) {
    dcs_model *m = (dcs_model *)1;
    char err[1024];
    memset(err, 'x', sizeof err);
    err[sizeof err - 1] = 0;
    dcs_status s = dcs_load(dir, NULL, &m, err, sizeof err);
    expect_at(line, what, s, want, err, n1, n2);
    if (s != DCS_OK)
        check_at(m == NULL, line, "%s: *out not NULL on failure", what);
    else
        dcs_free(m);
}
#define EXPECT_LOAD(what, dir, want, n1, n2) expect_load(__LINE__, (what), (dir), (want), (n1), (n2))

static void test_config_errors(void) {
    static tlist tl;
    dcpythia_tensors(&tl, false);
    const char *dir = new_dir("cfg");
    write_safetensors(dir, &tl, true);
    static const struct {
        const char *key, *val; /* val NULL: key removed */
        dcs_status want;
        const char *needle;
    } cases[] = {
        {"dim", NULL, DCS_ERR_CONFIG, "missing required key 'dim'"},
        {"n_head", NULL, DCS_ERR_CONFIG, "missing required key 'n_head'"},
        {"n_layer", NULL, DCS_ERR_CONFIG, "missing required key 'n_layer'"},
        /* DCPythiaConfig: intermediate_size missing or null = 4 * dim (here 64, the file has 32) */
        {"intermediate_size", NULL, DCS_ERR_TENSOR,
         "'layers.0.feed_forward.w1.weight' has shape [32, 16], expected [64, 16]"},
        {"intermediate_size", "null", DCS_ERR_TENSOR, "expected [64, 16]"},
        {"vocab_size", NULL, DCS_ERR_CONFIG, "missing required key 'vocab_size'"},
        {"model_type", NULL, DCS_ERR_CONFIG, "missing required key 'model_type'"},
        {"dim", "null", DCS_ERR_CONFIG, "'dim' is null; it must be an integer"},
        {"norm_eps", "null", DCS_ERR_CONFIG, "'norm_eps' is null"},
        {"rotary_pct", "null", DCS_ERR_CONFIG, "'rotary_pct' is null"},
        {"n_local_heads", "2", DCS_ERR_UNSUPPORTED, "n_local_heads 2 differs from n_head"},
        {"compose_groups", "3", DCS_ERR_CONFIG, "compose_groups 3 does not divide n_head"},
        {"compose_groups", "2", DCS_ERR_TENSOR, "has 1 groups (axis 1), the config 2"},
        {"moh", "[1, 2]", DCS_ERR_CONFIG, "'moh' must be null or an object"},
        {"moh", "{\"shared_heads\": 2}", DCS_ERR_CONFIG, "missing required key 'routed_topk' (in 'moh'"},
        {"moh", "{\"shared_heads\": 1, \"routed_topk\": 9}", DCS_ERR_CONFIG,
         "'routed_topk' = 9 is out of range"},
        {"dim", "\"16\"", DCS_ERR_CONFIG, "'dim' must be an integer"},
        {"dim", "16.5", DCS_ERR_CONFIG, "'dim' must be an integer"},
        {"dim", "true", DCS_ERR_CONFIG, "'dim' must be an integer"},
        {"dim", "[16]", DCS_ERR_CONFIG, "'dim' must be an integer"},
        {"dim", "0", DCS_ERR_CONFIG, "'dim' = 0 is out of range"},
        {"dim", "-16", DCS_ERR_CONFIG, "'dim' = -16 is out of range"},
        {"dim", "1e300", DCS_ERR_CONFIG, "'dim'"},
        {"dim", "4294967312", DCS_ERR_CONFIG, "'dim' = 4294967312 is out of range"},
        {"n_head", "5", DCS_ERR_CONFIG, "dim 16 is not divisible by n_head 5"},
        {"n_head", "32", DCS_ERR_CONFIG, "not divisible by n_head 32"},
        {"n_head", "0", DCS_ERR_CONFIG, "'n_head' = 0 is out of range"},
        {"n_head", "\"four\"", DCS_ERR_CONFIG, "'n_head' must be an integer"},
        {"n_layer", "100000", DCS_ERR_CONFIG, "'n_layer' = 100000 is out of range"},
        {"vocab_size", "1e10", DCS_ERR_CONFIG, "'vocab_size'"},
        {"intermediate_size", "1e308", DCS_ERR_CONFIG, "'intermediate_size'"},
        {"window_size", "0", DCS_ERR_CONFIG, "'window_size' = 0 is out of range"},
        {"window_size", "1e30", DCS_ERR_CONFIG, "'window_size'"},
        {"window_type", "\"LLG\"", DCS_ERR_CONFIG, "unknown window_type 'LLG'"},
        {"window_type", "4", DCS_ERR_CONFIG, "'window_type' must be null or a string"},
        {"model_type", "\"llama\"", DCS_ERR_CONFIG, "unknown model_type 'llama'"},
        {"model_type", "7", DCS_ERR_CONFIG, "'model_type' must be a string"},
        {"model_type", "\"\"", DCS_ERR_CONFIG, "unknown model_type ''"},
        {"norm_eps", "-1", DCS_ERR_CONFIG, "'norm_eps' must be a number in"},
        {"norm_eps", "\"small\"", DCS_ERR_CONFIG, "'norm_eps' must be a number"},
        {"rope_base", "0", DCS_ERR_CONFIG, "'rope_base' must be a number"},
        {"rotary_pct", "1.5", DCS_ERR_CONFIG, "'rotary_pct' must be a number in [0, 1]"},
        {"use_qk_norm", "\"yes\"", DCS_ERR_CONFIG, "'use_qk_norm' must be true or false"},
        {"use_dcmha", "1", DCS_ERR_CONFIG, "'use_dcmha' must be true or false"},
        {"use_sw", "true", DCS_ERR_TENSOR, "missing tensor 'layers.0.attention.dyn_w_proj.pre_proj.w'"},
        {"moh", "{\"shared_heads\": 2, \"routed_topk\": 1}", DCS_ERR_TENSOR,
         "missing tensor 'layers.0.attention.moh.wg.weight'"},
        /* null switches: off; null window: no local layers; null moh: none */
        {"use_sw", "null", DCS_OK, NULL},
        {"moh", "null", DCS_OK, NULL},
        {"window_size", "null", DCS_OK, NULL},
        {"compose_groups", "null", DCS_OK, NULL},
        /* consistent config, inconsistent weights: not a config error */
        {"n_layer", "1", DCS_ERR_TENSOR, "unexpected tensor 'layers.1."},
        {"n_layer", "3", DCS_ERR_TENSOR, "missing tensor 'layers.2.attention_norm.weight'"},
        {"dim", "32", DCS_ERR_TENSOR, "'tok_embeddings.weight' has shape [50, 16], expected [50, 32]"},
        /* switches off with their weights present: accepted, the weights
         * ignored (ablations: no QK-norm; no key-wise branches; tied) */
        {"use_qk_norm", "false", DCS_OK, NULL},
        {"query_wise", "true", DCS_OK, NULL},
        /* tied: a stored output.weight (torch .bin files keep the view) is ignored */
        {"tie_word_embeddings", "true", DCS_OK, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char what[256];
        snprintf(what, sizeof what, "config %s = %s", cases[i].key, cases[i].val ? cases[i].val : "(absent)");
        write_config(dir, DCP_CONFIG, cases[i].key, cases[i].val);
        expect_load(__LINE__, what, dir, cases[i].want, cases[i].want == DCS_ERR_TENSOR ? dir : "config.json",
                    cases[i].needle);
    }
    /* switches that are fine: use_dcmha false loads the same file as MHA
     * (the dyn_w_proj tensors are accepted and ignored) */
    write_config(dir, DCP_CONFIG, "use_dcmha", "false");
    dcs_model *m = LOAD_OK(dir);
    if (m) {
        CHECK(!dcs_model_config(m)->use_dcmha && !dcs_hook_exists(m, DCS_HP_POST_KP));
        float lg[T0 * V];
        CHECK(dcs_forward(m, TOKS[0], 1, T0, lg, NULL) == DCS_OK && finite_all(lg, (size_t)T0 * V));
        dcs_free(m);
    }
    for (int k = 0; k < 4; k++) {
        static const char *wt[4] = {"\"LG\"", "\"LGLL\"", "\"LGL6\"", "\"G\""};
        write_config(dir, DCP_CONFIG, "window_type", wt[k]);
        m = LOAD_OK(dir);
        if (m) {
            CHECKF(dcs_layer_is_local(m, 0) == (k < 3) && !dcs_layer_is_local(m, 1),
                   "window_type %s: local layers wrong", wt[k]);
            dcs_free(m);
        }
    }

    /* whole-file errors */
    WRITE_LIT(dir, "config.json", "{\"model_type\": \"dcpythia\", \"dim\": 16,,}");
    EXPECT_LOAD("config: bad JSON", dir, DCS_ERR_CONFIG, "config.json", "not valid JSON");
    write_file(dir, "config.json", "", 0);
    EXPECT_LOAD("config: empty", dir, DCS_ERR_CONFIG, "config.json", "not valid JSON");
    WRITE_LIT(dir, "config.json", "[1, 2, 3]");
    EXPECT_LOAD("config: an array", dir, DCS_ERR_CONFIG, "config.json", "must be a JSON object");
    WRITE_LIT(dir, "config.json", "\"dcpythia\"");
    EXPECT_LOAD("config: a string", dir, DCS_ERR_CONFIG, "config.json", "must be a JSON object");
    WRITE_LIT(dir, "config.json", "{\"model_type\": \"dcpy\0thia\"}");
    EXPECT_LOAD("config: NUL byte", dir, DCS_ERR_CONFIG, "config.json", "NUL");
    {
        /* deep nesting: cJSON's nesting limit, not a stack overflow */
        size_t n = 200000;
        char *deep = xcalloc(2 * n + 1, 1);
        memset(deep, '[', n);
        memset(deep + n, ']', n);
        write_file(dir, "config.json", deep, 2 * n);
        EXPECT_LOAD("config: 200000 nested arrays", dir, DCS_ERR_CONFIG, "config.json", NULL);
        free(deep);
    }
    {
        /* over the 1 MiB limit */
        size_t n = (1u << 20) + 100;
        char *huge = xcalloc(n, 1);
        memset(huge, ' ', n);
        memcpy(huge, "{\"model_type\": \"dcpythia\"", 25);
        huge[n - 1] = '}';
        write_file(dir, "config.json", huge, n);
        dcs_model *mm = NULL;
        char err[1024] = "";
        dcs_status s = dcs_load(dir, NULL, &mm, err, sizeof err);
        expect_at(__LINE__, "config: over 1 MiB", s, s ? s : DCS_ERR_IO, err, "config.json", NULL);
        CHECK(s != DCS_OK && mm == NULL);
        free(huge);
    }
    char p[600];
    snprintf(p, sizeof p, "%s/config.json", dir);
    unlink(p);
    EXPECT_LOAD("config: missing", dir, DCS_ERR_IO, "config.json", NULL);
    mkdir(p, 0700);
    {
        dcs_model *mm = NULL;
        char err[1024] = "";
        dcs_status s = dcs_load(dir, NULL, &mm, err, sizeof err);
        expect_at(__LINE__, "config.json is a directory", s, s ? s : DCS_ERR_IO, err, "config.json", NULL);
        CHECK(s != DCS_OK && mm == NULL);
    }
    rmdir(p);

    /* gpt_neox config errors */
    neox_tensors(&tl);
    write_safetensors(dir, &tl, true);
    write_config(dir, NEOX_CONFIG, "hidden_size", NULL);
    EXPECT_LOAD("neox: no hidden_size", dir, DCS_ERR_CONFIG, "config.json", "'hidden_size'");
    write_config(dir, NEOX_CONFIG, "num_attention_heads", "3");
    EXPECT_LOAD("neox: heads 3", dir, DCS_ERR_CONFIG, "config.json", "not divisible by n_head 3");
    write_config(dir, NEOX_CONFIG, "hidden_act", "\"relu\"");
    EXPECT_LOAD("neox: relu", dir, DCS_ERR_UNSUPPORTED, "config.json", "hidden_act \"relu\"");
    write_config(dir, NEOX_CONFIG, "hidden_act", "\"gelu_new\"");
    EXPECT_LOAD("neox: gelu_new", dir, DCS_ERR_UNSUPPORTED, "config.json", "gelu_new");
    write_config(dir, NEOX_CONFIG, "hidden_act", "3");
    EXPECT_LOAD("neox: act 3", dir, DCS_ERR_UNSUPPORTED, "config.json", "not a string");
    write_config(dir, NEOX_CONFIG, "layer_norm_eps", "2");
    EXPECT_LOAD("neox: eps 2", dir, DCS_ERR_CONFIG, "config.json", "'layer_norm_eps'");
    write_config(dir, NEOX_CONFIG, "model_type", "\"dcpythia\"");
    EXPECT_LOAD("neox config called dcpythia", dir, DCS_ERR_CONFIG, "config.json",
                "missing required key 'dim'");

    /* bad arguments to dcs_load */
    dcs_model *mm = NULL;
    char err[256];
    CHECK(dcs_load(NULL, NULL, &mm, err, sizeof err) == DCS_ERR_ARG && mm == NULL);
    CHECK(dcs_load(dir, NULL, NULL, err, sizeof err) == DCS_ERR_ARG);
    CHECK(dcs_load(dir, NULL, &mm, NULL, 0) != DCS_OK && mm == NULL); /* no error buffer: fine */
    char longdir[5000];
    memset(longdir, 'd', sizeof longdir - 1);
    longdir[0] = '/';
    longdir[sizeof longdir - 1] = 0;
    CHECK(dcs_load(longdir, NULL, &mm, err, sizeof err) == DCS_ERR_ARG && strstr(err, "too long"));
    char small[16];
    CHECK(dcs_load(longdir, NULL, &mm, small, sizeof small) == DCS_ERR_ARG && strlen(small) == 15);
    EXPECT_LOAD("no such directory", "/nonexistent/dclens/model", DCS_ERR_IO, "config.json", NULL);
}

static void test_tensor_errors(void) {
    static tlist tl;
    const char *dir = new_dir("tens");
    write_config(dir, DCP_CONFIG, NULL, NULL);

    static const char *drops[] = {
        "layers.1.attention.wo.weight",
        "tok_embeddings.weight",
        "output.weight",
        "norm.bias",
        "layers.0.attention.q_norm.scale",
        "layers.1.attention.dyn_w_proj.dd",
        "layers.0.attention.dyn_w_proj.dw1",
        "layers.0.attention.dyn_w_proj.qkw",
        "layers.1.feed_forward.w2.bias",
        "layers.0.attention.wqkv.bias",
    };
    for (size_t i = 0; i < sizeof drops / sizeof drops[0]; i++) {
        dcpythia_tensors(&tl, false);
        drop_t(&tl, drops[i]);
        write_safetensors(dir, &tl, true);
        char what[160], needle[160];
        snprintf(what, sizeof what, "missing %s", drops[i]);
        snprintf(needle, sizeof needle, "missing tensor '%s'", drops[i]);
        EXPECT_LOAD(what, dir, DCS_ERR_TENSOR, dir, needle);
    }
    /* wqkv weight missing: the message names both spellings */
    dcpythia_tensors(&tl, false);
    drop_t(&tl, "layers.1.attention.wqkv.weight");
    write_safetensors(dir, &tl, true);
    EXPECT_LOAD("missing wqkv", dir, DCS_ERR_TENSOR, "layers.1.attention.wqkv.weight", "wq, wk, wv");
    dcpythia_tensors(&tl, true);
    drop_t(&tl, "layers.0.attention.wk.weight");
    write_safetensors(dir, &tl, true);
    EXPECT_LOAD("missing wk", dir, DCS_ERR_TENSOR, "layers.0.attention.wqkv.weight", "wq, wk, wv");
    dcpythia_tensors(&tl, true);
    drop_t(&tl, "layers.1.attention.wv.bias");
    write_safetensors(dir, &tl, true);
    EXPECT_LOAD("missing wv.bias", dir, DCS_ERR_TENSOR, "missing tensor 'layers.1.attention.wv.bias'", NULL);

    static const struct {
        const char *name;
        int ndim;
        int64_t s[5];
        const char *needle;
    } shapes[] = {
        {"norm.weight", 2, {8, 2}, "'norm.weight' has shape [8, 2], expected [16]"},
        {"tok_embeddings.weight",
         2,
         {51, 16},
         "'tok_embeddings.weight' has shape [51, 16], expected [50, 16]"},
        {"layers.1.attention.wqkv.weight", 2, {16, 48}, "has shape [16, 48], expected [48, 16]"},
        {"layers.0.feed_forward.w1.weight", 3, {32, 16, 1}, "expected [32, 16]"},
        {"layers.1.attention.q_norm.scale", 1, {8}, "'layers.1.attention.q_norm.scale' has shape [8]"},
        {"layers.0.attention.wk.weight", 2, {16, 15}, "'layers.0.attention.wk.weight' has shape [16, 15]"},
        {"layers.1.attention.dyn_w_proj.qkw", 5, {1, 4, 16, 4, 5}, "dyn_w_proj.qkw' has shape"},
        {"layers.1.attention.dyn_w_proj.dw1", 4, {16, 1, 4, 8}, "dyn_w_proj.dw1' has shape"},
        {"layers.0.attention.dyn_w_proj.dw1", 4, {16, 1, 3, 16}, "dyn_w_proj.dw1' must have shape"},
        {"layers.0.attention.dyn_w_proj.dw1", 3, {16, 1, 4}, "dyn_w_proj.dw1' must have shape"},
        {"layers.0.attention.dyn_w_proj.qkw", 5, {1, 4, 16, 3, 4}, "dyn_w_proj.qkw' must have shape"},
        {"layers.0.attention.dyn_w_proj.qkw", 5, {1, 4, 16, 18, 4}, "1 <= R <= 8"},
        {"layers.0.attention.dyn_w_proj.dd",
         3,
         {16, 1, 8},
         "dyn_w_proj.dd' has shape [16, 1, 8], expected [16, 1, 16]"},
        {"output.weight", 1, {800}, "'output.weight' has shape [800]"},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        dcpythia_tensors(&tl, strstr(shapes[i].name, ".wk.") != NULL);
        tspec *t = find_t(&tl, shapes[i].name);
        if (!CHECKF(t != NULL, "no tensor %s", shapes[i].name)) continue;
        t->ndim = shapes[i].ndim;
        memcpy(t->shape, shapes[i].s, sizeof t->shape);
        write_safetensors(dir, &tl, true);
        char what[160];
        snprintf(what, sizeof what, "mis-shaped %s", shapes[i].name);
        EXPECT_LOAD(what, dir, DCS_ERR_TENSOR, "model.safetensors", shapes[i].needle);
    }
    /* dw1 with 2 slots (query-wise) while the config is not query-wise */
    dcpythia_tensors(&tl, false);
    find_t(&tl, "layers.0.attention.dyn_w_proj.dw1")->shape[2] = 2;
    write_safetensors(dir, &tl, true);
    EXPECT_LOAD("2-slot dw1", dir, DCS_ERR_TENSOR, "model.safetensors", "query_wise false");

    static const char *extras[] = {"layers.0.attention.surprise", "layers.2.attention.wo.weight",
                                   "lm_head.weight", "gpt_neox.embed_in.weight"};
    for (size_t i = 0; i < sizeof extras / sizeof extras[0]; i++) {
        dcpythia_tensors(&tl, false);
        add_t(&tl, extras[i], 1, 2, 0, 0, 0, 0);
        write_safetensors(dir, &tl, true);
        char what[160], needle[160];
        snprintf(what, sizeof what, "extra %s", extras[i]);
        snprintf(needle, sizeof needle, "unexpected tensor '%s'", extras[i]);
        EXPECT_LOAD(what, dir, DCS_ERR_TENSOR, "model.safetensors", needle);
    }
    /* both fused and unfused q, k, v: the unfused parts are extra */
    dcpythia_tensors(&tl, false);
    add_t(&tl, "layers.0.attention.wq.weight", 2, D, D, 0, 0, 0);
    write_safetensors(dir, &tl, true);
    EXPECT_LOAD("wqkv and wq", dir, DCS_ERR_TENSOR, "unexpected tensor 'layers.0.attention.wq.weight'", NULL);
    /* derived tensors of the published module are accepted and ignored */
    dcpythia_tensors(&tl, false);
    add_t(&tl, "layers.0.attention.dyn_w_proj.dw_m", 2, 1, 4, 0, 0, 0);
    add_t(&tl, "layers.1.attention.dyn_w_proj.sw", 2, 4, 4, 0, 0, 0);
    write_safetensors(dir, &tl, true);
    EXPECT_LOAD("derived tensors", dir, DCS_OK, NULL, NULL);

    /* gpt_neox */
    write_config(dir, NEOX_CONFIG, NULL, NULL);
    static const char *ndrops[] = {"gpt_neox.layers.1.attention.query_key_value.bias",
                                   "gpt_neox.layers.0.attention.query_key_value.weight",
                                   "gpt_neox.final_layer_norm.weight", "embed_out.weight",
                                   "gpt_neox.layers.1.mlp.dense_4h_to_h.weight"};
    for (size_t i = 0; i < sizeof ndrops / sizeof ndrops[0]; i++) {
        neox_tensors(&tl);
        drop_t(&tl, ndrops[i]);
        write_safetensors(dir, &tl, true);
        char what[160], needle[160];
        snprintf(what, sizeof what, "neox: missing %s", ndrops[i]);
        snprintf(needle, sizeof needle, "missing tensor '%s'", ndrops[i]);
        EXPECT_LOAD(what, dir, DCS_ERR_TENSOR, dir, needle);
    }
    neox_tensors(&tl);
    find_t(&tl, "gpt_neox.layers.0.attention.query_key_value.weight")->shape[0] = 32;
    write_safetensors(dir, &tl, true);
    EXPECT_LOAD("neox: short qkv", dir, DCS_ERR_TENSOR, "query_key_value.weight' has shape [32, 16]", NULL);
    neox_tensors(&tl);
    add_t(&tl, "gpt_neox.layers.0.attention.wqkv.weight", 2, 3 * D, D, 0, 0, 0);
    write_safetensors(dir, &tl, true);
    EXPECT_LOAD("neox: dcpythia name", dir, DCS_ERR_TENSOR, "unexpected tensor", "gpt_neox");
    neox_tensors(&tl);
    add_t(&tl, "gpt_neox.layers.1.attention.masked_bias", 1, 1, 0, 0, 0, 0);
    write_safetensors(dir, &tl, true);
    EXPECT_LOAD("neox: masked_bias buffer", dir, DCS_OK, NULL, NULL);

    /* no weights at all */
    char p[600];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    unlink(p);
    dcs_model *m = NULL;
    char err[1024] = "";
    dcs_status s = dcs_load(dir, NULL, &m, err, sizeof err);
    expect_at(__LINE__, "no weight files", s, s ? s : DCS_ERR_IO, err, dir, NULL);
    CHECK(s != DCS_OK && m == NULL);
}

static void test_devices(const char *dir) {
    dcs_load_options o = {0};
    dcs_model *m = NULL;
    char err[1024] = "";
    o.device = 7;
    EXPECT("device 7", dcs_load(dir, &o, &m, err, sizeof err), DCS_ERR_ARG, err, "unknown device 7", NULL);
    CHECK(m == NULL);
    char why[256] = "";
    if (!dcs_cuda_available(why, sizeof why)) {
        CHECK(why[0] != 0);
        o.device = DCS_DEVICE_CUDA;
        EXPECT("cuda without cuda", dcs_load(dir, &o, &m, err, sizeof err), DCS_ERR_UNSUPPORTED, err, "cuda",
               NULL);
        CHECK(m == NULL);
    }
    o.device = DCS_DEVICE_CPU;
    o.n_threads = 1;
    CHECK(dcs_load(dir, &o, &m, err, sizeof err) == DCS_OK && m && dcs_model_device(m) == DCS_DEVICE_CPU);
    dcs_free(m);
    dcs_free(NULL);
}

/* Repeated load / forward (with and without hooks) / free: LeakSanitizer
 * in the asan build reports anything not given back. */
static void test_cycles(const char *dcp, const char *neox, const float *ref_dcp) {
    uint8_t want[DCS_HP_COUNT * L];
    want_all(want);
    int ok = 0;
    for (int i = 0; i < 20; i++) {
        dcs_model *m = NULL;
        char err[1024];
        if (dcs_load(i % 2 ? neox : dcp, NULL, &m, err, sizeof err) != DCS_OK) continue;
        float lg[2 * T0 * V];
        hctx h;
        memset(&h, 0, sizeof h);
        h.m = m;
        h.mode = i % 4 == 0 ? H_CAPTURE : i % 4 == 2 ? H_ABORT : H_READ;
        h.B = 2;
        h.T = T0;
        h.target_point = DCS_HP_PATTERN_COMPOSED;
        h.target_layer = 1;
        dcs_hooks hk = {want, hook_fn, &h};
        dcs_status s1 = dcs_forward(m, &TOKS[0][0], 2, T0, lg, i % 3 ? &hk : NULL);
        dcs_status s2 = dcs_forward(m, TOKS[0], 1, T0, lg, NULL);
        if ((s1 == DCS_OK || s1 == DCS_ERR_HOOK) && s2 == DCS_OK &&
            (i % 2 || !memcmp(lg, ref_dcp, sizeof(float) * T0 * V)))
            ok++;
        hctx_free(&h);
        dcs_free(m);
    }
    CHECKF(ok == 20, "load/forward/free cycles: %d of 20 ok", ok);
}

/* Incremental decoding (decode.c): any chunking gives the full pass's
 * logits; local layers keep their window; bad arguments; a decoder freed
 * after its model (LeakSanitizer and ASan check the order is safe). */
/* A model freed while a tape (and a decoder) of it live goes with the last
 * of them (dcs_free: a garbage collector frees in any order); the memory
 * plan's device query says a CPU model's memory is the host's; trimming the
 * pool changes no result. */
static void test_tape_lifetime(const char *dir, const float *ref) {
    dcs_model *m = LOAD_OK(dir);
    if (!m) return;
    uint64_t fr = 1, tot = 1;
    CHECK(dcs_device_memory(m, &fr, &tot) == DCS_ERR_UNSUPPORTED && fr == 0 && tot == 0);
    CHECKF(strstr(dcs_errmsg(m), "host") != NULL, "device memory: %s", dcs_errmsg(m));
    CHECK(dcs_device_memory(m, NULL, &tot) == DCS_ERR_ARG);
    float lg[T0 * V];
    CHECK(dcs_forward(m, TOKS[0], 1, T0, lg, NULL) == DCS_OK);
    dcs_model_trim(m);
    dcs_model_trim(NULL);
    float lg2[T0 * V];
    CHECK(dcs_forward(m, TOKS[0], 1, T0, lg2, NULL) == DCS_OK && !memcmp(lg, lg2, sizeof lg));
    CHECK(!memcmp(lg, ref, sizeof lg));
    for (int order = 0; order < 2; order++) {
        dcs_model *mm = order ? LOAD_OK(dir) : m;
        if (!mm) continue;
        dcs_tape *a = NULL, *b = NULL;
        dcs_decoder *d = NULL;
        CHECK(dcs_tape_new(mm, 1, T0, &a) == DCS_OK && dcs_tape_new(mm, 1, 2, &b) == DCS_OK);
        CHECK(dcs_decoder_new(mm, &d) == DCS_OK);
        if (a) CHECK(dcs_tape_forward(a, TOKS[0], NULL, 0, lg2) == DCS_OK);
        dcs_free(mm); /* marked: the tapes and the decoder still hold it */
        uint64_t tb = 0, pk = 0;
        int rc = -1;
        if (a) dcs_tape_memory(a, &tb, &pk, &rc);
        CHECK(tb > 0 && rc == 0);
        if (order) { /* the decoder last */
            dcs_tape_free(a);
            dcs_tape_free(b);
            dcs_decoder_free(d);
        } else { /* a tape last */
            dcs_tape_free(b);
            dcs_decoder_free(d);
            dcs_tape_free(a);
        }
    }
}

static void test_decoder(const char *dir, const char *what, const float *ref) {
    dcs_model *m = LOAD_OK(dir);
    if (!m) return;
    const int chunks[4] = {3, 1, 2, 1};
    for (int k = 0; k < 2; k++) {
        dcs_decoder *d = NULL;
        CHECK(dcs_decoder_new(m, &d) == DCS_OK && d);
        if (!d) break;
        float *lg = xcalloc((size_t)T0 * V, sizeof(float));
        int at = 0;
        for (int i = 0; i < 4 && at < T0; i++) {
            int n = k == 0 ? chunks[i] : T0;
            dcs_status s = dcs_decoder_step(d, TOKS[0] + at, n, lg + (size_t)at * V, NULL);
            CHECKF(s == DCS_OK, "%s decode: %s", what, dcs_errmsg(m));
            at += n;
        }
        CHECK(dcs_decoder_pos(d) == T0);
        double diff = max_abs_diff(lg, ref, (size_t)T0 * V);
        CHECKF(diff <= 2e-5 * max_abs(ref, (size_t)T0 * V), "%s: decoded logits differ by %g", what, diff);
        for (int l = 0; l < L; l++) {
            int want = dcs_layer_is_local(m, l) ? WIN + 1 : T0;
            CHECKF(dcs_decoder_layer_keys(d, l) == (want < T0 ? want : T0), "%s: layer %d holds %d keys",
                   what, l, dcs_decoder_layer_keys(d, l));
        }
        CHECK(dcs_decoder_layer_keys(d, L) == -1);
        int32_t bad = V;
        EXPECT("decode bad token", dcs_decoder_step(d, &bad, 1, NULL, NULL), DCS_ERR_ARG, dcs_errmsg(m),
               "out of range", NULL);
        EXPECT("decode n=0", dcs_decoder_step(d, TOKS[0], 0, NULL, NULL), DCS_ERR_ARG, dcs_errmsg(m),
               "n >= 1", NULL);
        CHECK(dcs_decoder_pos(d) == T0);
        free(lg);
        if (k == 0) {
            dcs_decoder_free(d);
        } else {
            dcs_free(m); /* model first: the decoder keeps it alive */
            CHECK(dcs_decoder_step(d, TOKS[1], 1, NULL, NULL) == DCS_OK);
            dcs_decoder_free(d);
            m = NULL;
        }
    }
    if (m) dcs_free(m);
}

int main(void) {
    verbose = getenv("DCS_TEST_VERBOSE") && atoi(getenv("DCS_TEST_VERBOSE")) > 0;
    const char *tmp = getenv("TMPDIR");
    snprintf(tmp_root, sizeof tmp_root, "%s/dcs_engine_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(tmp_root)) {
        perror("mkdtemp");
        return 2;
    }

    test_keep_16bit();
    char dcp_dir[512], neox_dir[512];
    snprintf(dcp_dir, sizeof dcp_dir, "%s", fixture("dcpythia"));
    snprintf(neox_dir, sizeof neox_dir, "%s", fixture("neox"));

    float *ref_dcp = xcalloc((size_t)T0 * V, sizeof(float));
    float *ref_neox = xcalloc((size_t)T0 * V, sizeof(float));

    dcs_model *m = LOAD_OK(dcp_dir);
    if (m) {
        const dcs_config *c = dcs_model_config(m);
        CHECK(c->model_type == DCS_MODEL_DCPYTHIA && c->n_layer == L && c->d_model == D && c->n_head == NH &&
              c->head_dim == DH && c->d_ff == F && c->vocab == V);
        CHECK(c->use_dcmha && !c->query_wise && c->dyn_rank == R && c->dyn_hidden == KH &&
              c->dyn_slots == 4 && c->window_size == WIN && c->rotary_dim == 2 && c->qk_norm);
        CHECK(dcs_layer_is_local(m, 0) && !dcs_layer_is_local(m, 1));
        CHECK(!dcs_layer_is_local(m, -1) && !dcs_layer_is_local(m, L));
        CHECK(dcs_errmsg(m) != NULL && dcs_errmsg(NULL) != NULL);
        test_forward_basic(m, "dcpythia", ref_dcp);
        test_decoder(dcp_dir, "dcpythia", ref_dcp);
        test_hooks_read_and_count(m, "dcpythia", ref_dcp);
        test_captured_invariants(m, "dcpythia", 1);
        test_hook_errors(m, "dcpythia", ref_dcp, 1);
        test_forward_args(m);
        test_hook_names(m, 1);
        test_weights(m, 1);
        dcs_free(m);
    }

    /* the same model, unfused q/k/v or unaligned data: the same logits */
    const char *variants[2] = {fixture("dcpythia_unfused"), fixture("dcpythia_unaligned")};
    for (int i = 0; i < 2; i++) {
        m = LOAD_OK(variants[i]);
        if (!m) continue;
        float lg[T0 * V];
        CHECK(dcs_forward(m, TOKS[0], 1, T0, lg, NULL) == DCS_OK);
        CHECKF(!memcmp(lg, ref_dcp, sizeof lg), "%s: logits differ from the fused, aligned checkpoint",
               i ? "unaligned" : "unfused");
        dcs_free(m);
    }

    m = LOAD_OK(neox_dir);
    if (m) {
        const dcs_config *c = dcs_model_config(m);
        CHECK(c->model_type == DCS_MODEL_GPT_NEOX && c->n_layer == L && c->d_model == D && c->n_head == NH &&
              !c->use_dcmha && !c->qk_norm && c->window_size == 0);
        CHECK(!dcs_layer_is_local(m, 0) && !dcs_layer_is_local(m, 1));
        test_forward_basic(m, "neox", ref_neox);
        test_decoder(neox_dir, "neox", ref_neox);
        test_hooks_read_and_count(m, "neox", ref_neox);
        test_captured_invariants(m, "neox", 0);
        test_hook_errors(m, "neox", ref_neox, 0);
        test_forward_args(m);
        test_hook_names(m, 0);
        test_weights(m, 0);
        dcs_free(m);
    }

    test_config_errors();
    test_tensor_errors();
    test_devices(dcp_dir);
    test_tape_lifetime(dcp_dir, ref_dcp);
    test_cycles(dcp_dir, neox_dir, ref_dcp);

    free(ref_dcp);
    free(ref_neox);
    rm_tree(tmp_root);
    return check_report("engine", &counts);
}
