/*
 * internal.h -- what the engine's source files share and users never see:
 * the error record, the tensor table the loaders produce, the backend
 * interface (CPU, CUDA) the model graph runs on, and the model itself.
 */
#ifndef DCS_INTERNAL_H
#define DCS_INTERNAL_H

#include "dcscope.h"
#include <stdarg.h>
#include <stdbool.h>

/* The cancel flag of a model: C11 atomic in the C files; the CUDA backend
 * (compiled as C++) only sees the struct, never the flag, so a plain int of
 * the same size and alignment stands in there. */
#ifdef __cplusplus
typedef int dcs_atomic_int;
#else
#include <stdatomic.h>
typedef atomic_int dcs_atomic_int;
_Static_assert(sizeof(atomic_int) == sizeof(int), "atomic_int has the layout of int");
#endif

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
#define DCS_MAX_HEADER_BYTES (100u << 20)   /* safetensors JSON header      */
#define DCS_MAX_PICKLE_BYTES (256u << 20)   /* data.pkl                     */
#define DCS_MAX_TENSORS 1000000
#define DCS_MAX_R 8                          /* dynamic rank                 */
#define DCS_MAX_SW_HEADS 256                 /* heads per group with use_sw  */
#define DCS_POOL_SIZE 48                     /* reusable activation buffers  */

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
dcs_status dcs_read_text_file(const char *path, size_t max_bytes, char **out,
                              size_t *len, dcs_err *e);

/* ---------------------------------------------------------------- tensors */

typedef enum { DCS_F32 = 0, DCS_F16 = 1, DCS_BF16 = 2 } dcs_dtype;

static inline size_t dcs_dtype_size(int dt) { return dt == DCS_F32 ? 4 : 2; }

/* A tensor as stored in a checkpoint: a view into a mapped file. The data
 * may be unaligned; read it with dcs_tensor_to_f32. */
typedef struct {
    char *name;            /* owned                                          */
    int dtype;             /* dcs_dtype                                      */
    int ndim;
    int64_t shape[DCS_MAX_NDIM];
    const uint8_t *data;   /* into a mapped file, nbytes long               */
    uint64_t nbytes;       /* == numel * dtype size (checked by the loader)  */
    const char *file;      /* path of the file holding it (for messages)     */
    int used;              /* set by the model builder                       */
    uint8_t *owned;        /* malloc'd contiguous copy of a strided torch
                              view (data points here), else NULL            */
} dcs_tensor;

/* All tensors of a checkpoint directory, across shards. */
typedef struct {
    dcs_tensor *t;
    int n, cap;
    dcs_mapped_file *files;
    int n_files, cap_files;
    int deferred;          /* set while a batch of shards is added: see dcs_tt_finish */
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
dcs_status dcs_tt_parse_safetensors(dcs_tensor_table *tt, const uint8_t *buf,
                                    uint64_t len, const char *path, dcs_err *e);
dcs_status dcs_tt_parse_torchzip(dcs_tensor_table *tt, const uint8_t *buf,
                                 uint64_t len, const char *path, dcs_err *e);
void dcs_tt_free(dcs_tensor_table *tt);
dcs_tensor *dcs_tt_find(const dcs_tensor_table *tt, const char *name);

/* Widen a stored tensor to float32 (exact for F16/BF16). out has numel. */
void dcs_tensor_to_f32(const dcs_tensor *t, float *out);
uint64_t dcs_tensor_numel(const dcs_tensor *t);
/* Widen n values of `dtype` at src (any alignment) to float32 (exact). */
void dcs_widen(const void *src, uint64_t n, int dtype, float *out);

/* Building a table (tensors.c, for the file parsers). Between calls t[] is
 * sorted by name (dcs_tt_find bsearches it). A parser records first = tt->n,
 * appends with dcs_tt_new_tensor (owned copy of the name, fields zeroed,
 * `file` set), then calls dcs_tt_commit (names unique across the table,
 * re-sort) or, on error, dcs_tt_rollback (drops t[first..n)). */
dcs_status dcs_tt_new_tensor(dcs_tensor_table *tt, const char *name, size_t name_len,
                              const char *file, dcs_tensor **out, dcs_err *e);
dcs_status dcs_tt_commit(dcs_tensor_table *tt, int first, dcs_err *e);
/* With tt->deferred set, dcs_tt_commit only sorts and checks the file's own
 * tensors; dcs_tt_finish then sorts the table once and refuses a name found
 * in two files (and clears tt->deferred). */
dcs_status dcs_tt_finish(dcs_tensor_table *tt, dcs_err *e);
void dcs_tt_rollback(dcs_tensor_table *tt, int first);
/* Map `path`, keep it in tt->files and run `parse` on it (dcs_tt_add_*). */
typedef dcs_status (*dcs_tt_parse_fn)(dcs_tensor_table *tt, const uint8_t *buf,
                                      uint64_t len, const char *path, dcs_err *e);
dcs_status dcs_tt_add_file(dcs_tensor_table *tt, const char *path,
                           dcs_tt_parse_fn parse, dcs_err *e);
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
    void *json;            /* the cJSON tree the strings point into */
} dcs_index;
/* Parse the index text (len bytes, NUL-terminated); `path` names it in
 * messages. On error *out is left empty. Release with dcs_index_free. */
dcs_status dcs_parse_index_json(const char *text, size_t len, const char *path,
                                dcs_index *out, dcs_err *e);
void dcs_index_free(dcs_index *ix);

/* ---------------------------------------------------------------- JSON */

/* json_strict.c: refuse a NUL byte or an escaped NUL (\u0000) anywhere in
 * the text (len bytes), and a key given twice in one object (root: a
 * cJSON tree). Messages start with `path`. */
dcs_status dcs_json_check_text(const char *text, size_t len, const char *path, dcs_err *e);
dcs_status dcs_json_unique_keys(const void *root, const char *path, dcs_err *e);

/* ---------------------------------------------------------------- config */

/* Parse config.json text into cfg plus the local-layer table. */
dcs_status dcs_parse_config(const char *json_text, const char *path,
                            dcs_config *cfg, int *window_pattern,
                            int *window_pattern_len, dcs_err *e);

/* ---------------------------------------------------------------- backend */

/* A backend owns device memory and runs kernels on it. Pointers it hands
 * out are device pointers: the graph passes them to kernels and never
 * dereferences them. All sizes are in elements unless named *_bytes.
 * Kernels do not return errors; a backend records the first failure and
 * reports it from sync(). */
typedef struct dcs_backend dcs_backend;

/* Arguments of the compose kernel: out = Compose(in) per model-spec 2.6
 * and 5, over [B, N, T, S] tensors. Dynamic weights are [B, T, R, N] (query
 * side) and [B, S, R, N] (key side), gates [B, T, N] / [B, S, N]; the
 * key-side pointers are NULL for query_wise models, the query-side ones
 * for key_wise models. With G groups the N
 * axis is G blocks of N/G heads and heads mix only within their block
 * (each block's [R, N/G] slice is that group's weight). sw: the static
 * (Talking-Heads) map [G, N/G, N/G] or NULL. Branch outputs may be NULL.
 * causal_only: compute only pairs allowed by the mask (s <= t, and
 * t - s <= window when window > 0) and write 0 elsewhere (post-compose). */
#define DCS_N_BRANCHES 6
typedef struct {
    float *out;                 /* [B, N, T, S], may equal in               */
    const float *in;            /* [B, N, T, S]                             */
    const float *qw1, *qw2, *kw1, *kw2, *qdd, *kdd;
    const float *sw;            /* [G, N/G, N/G] or NULL                    */
    float *br[DCS_N_BRANCHES];  /* skip, qp, kp, qg, kg, static (or NULL)   */
    int B, N, T, S, R;
    int G;                      /* composition groups, >= 1                 */
    int causal_only;
    int window;                 /* <= 0: global                             */
} dcs_compose_args;

/* A weight matrix as the forward pass reads it: float32, or (CPU backend)
 * F16/BF16 as stored in the checkpoint, widened per tile inside gemm_w. */
typedef struct {
    const void *p;
    int dtype;                  /* dcs_dtype                                */
} dcs_wmat;

/* Arguments of the fused attention kernel (model-spec 2 steps 5-10 for one
 * layer, without materialising [B, N, T, S]): per query row, scores ->
 * pre-compose -> mask -> softmax -> post-compose -> weighted sum of v.
 * q, k, v, z are [B, T, N, Dh] with row stride ld. Dynamic weights per
 * phase (0 pre, 1 post) as in dcs_compose_args ([B, T, R, N], [B, T, N];
 * key side NULL for query_wise); compose == 0: plain MHA (C = I). */
typedef struct {
    float *z;
    const float *q, *k, *v;
    int B, T, N, Dh, ld, R;
    int window;                 /* <= 0: global                             */
    float scale;                /* 1 / sqrt(Dh)                             */
    int compose;
    const float *qw1[2], *qw2[2], *qdd[2], *kw1[2], *kw2[2], *kdd[2];
} dcs_attn_args;

struct dcs_backend {
    const char *name;
    void *ctx;

    /* memory */
    void *(*alloc)(dcs_backend *be, size_t bytes);        /* zero-filled  */
    void (*free)(dcs_backend *be, void *p);
    void (*upload)(dcs_backend *be, void *dst, const void *src_host, size_t bytes);
    void (*download)(dcs_backend *be, void *dst_host, const void *src, size_t bytes);
    void (*copy)(dcs_backend *be, void *dst, const void *src, size_t bytes);
    dcs_status (*sync)(dcs_backend *be, dcs_err *e);     /* first error    */
    void (*destroy)(dcs_backend *be);

    /* Row-major strided batched GEMM, float32:
     * for b < batch: C_b = alpha * op(A_b) op(B_b) + beta * C_b,
     * op(A_b) [M, K], op(B_b) [K, N], X_b = X + b * strideX. */
    void (*gemm)(dcs_backend *be, int transA, int transB, int M, int N, int K,
                 float alpha, const float *A, int lda, long long strideA,
                 const float *B, int ldb, long long strideB, float beta,
                 float *C, int ldc, long long strideC, int batch);

    /* elementwise / row kernels */
    void (*embed)(dcs_backend *be, float *out, const float *table,
                  const int32_t *tokens_host, int M, int D);          /* out [M, D] */
    void (*add_bias)(dcs_backend *be, float *x, const float *bias, int M, int N); /* x[M,N] += b[N] */
    void (*add)(dcs_backend *be, float *y, const float *x, size_t n);  /* y += x */
    void (*add3)(dcs_backend *be, float *y, const float *a, const float *b,
                 const float *c, size_t n);                            /* y = a + b + c */
    void (*gelu)(dcs_backend *be, float *x, size_t n);                 /* exact erf gelu */
    void (*tanh_)(dcs_backend *be, float *x, size_t n);
    void (*layernorm)(dcs_backend *be, float *out, const float *in, const float *w,
                      const float *b, int M, int D, float eps);
    /* x [rows, width] (row stride ld): x = x / sqrt(mean(x^2) + eps) * scale
     * (scale [width] or NULL for none), in place. */
    void (*rmsnorm)(dcs_backend *be, float *x, int rows, int width, int ld,
                    const float *scale, float eps);
    /* x [M, N, Dh], position of row m is m % T: GPT-NeoX rotate-half on the
     * first rot dims. */
    void (*rotary)(dcs_backend *be, float *x, int M, int T, int N, int Dh,
                   int rot, float base);
    /* Copy a [rows, cols] block with row strides (dst ld_dst, src ld_src). */
    void (*copy2d)(dcs_backend *be, float *dst, int ld_dst, const float *src,
                   int ld_src, int rows, int cols);
    void (*compose)(dcs_backend *be, const dcs_compose_args *a);
    /* x [BN, T, S]: softmax over s of the allowed entries (s <= t, and
     * t - s <= window when window > 0); masked entries become 0. */
    void (*softmax_masked)(dcs_backend *be, float *x, int BN, int T, int S, int window);
    /* out[m, n] = in[m, n] * g[m, n] (MoH gating, reserved) */
    void (*mul)(dcs_backend *be, float *y, const float *g, size_t n);

    /* Optional (NULL on backends whose weights are all float32 and that
     * have no fused kernel, e.g. CUDA, which widens F16 at upload):
     * C [M, N] = A [M, K] op(W), W stored in W.dtype, [N, K] when transW
     * (a torch Linear) else [K, N]; F16/BF16 widened tile by tile. */
    void (*gemm_w)(dcs_backend *be, int transW, int M, int N, int K, const float *A, int lda,
                   dcs_wmat W, float *C, int ldc);
    /* out [M, D] = table[tokens[m]] with the table in table.dtype. */
    void (*embed_w)(dcs_backend *be, float *out, dcs_wmat table, const int32_t *tokens_host,
                    int M, int D);
    /* Fused attention (see dcs_attn_args); NULL: the graph uses the full path. */
    void (*attention)(dcs_backend *be, const dcs_attn_args *a);
    /* MoH routing scores (model-spec 5), per row m < M: g [M, N] from the
     * router logits [M, N - hs], the shared-head logits s1 [M, hs] (NULL
     * when hs <= 1) and the balance logits s0 [M, 2] (NULL when hs == 0). */
    void (*moh_route)(dcs_backend *be, float *g, const float *logits, const float *s1,
                      const float *s0, int M, int N, int hs, int k);
    /* z [M, N, Dh] *= g [M, N] broadcast over Dh (MoH head gate). */
    void (*head_gate)(dcs_backend *be, float *z, const float *g, int M, int N, int Dh);
};

dcs_backend *dcs_backend_cpu_create(int n_threads, dcs_err *e);
#ifdef DCS_WITH_CUDA
dcs_backend *dcs_backend_cuda_create(int device, dcs_err *e);
int dcs_cuda_probe(char *why, size_t whylen);
#endif

/* ---------------------------------------------------------------- model */

/* Per-layer weights, device pointers, float32. NULL where absent. On the
 * CPU the large matrices of an F16/BF16 checkpoint stay in their stored
 * dtype (the m_* views below); their float* fields are then NULL until
 * dcs_model_require_f32 widens them. For float32 checkpoints (and on CUDA)
 * the float* fields are always valid. The forward pass reads the m_* views. */
typedef struct {
    float *attn_norm_w, *attn_norm_b;   /* [D]                              */
    float *ffn_norm_w, *ffn_norm_b;     /* [D]                              */
    float *wqkv, *bqkv;                 /* [3D, D], [3D] rows q, k, v       */
    float *wo, *bo;                     /* [D, D], [D]                      */
    float *q_scale, *k_scale;           /* [Dh]                             */
    float *dw1;                         /* [D, C*K]                         */
    float *qkw;                         /* [C, K, 2R*N]                     */
    float *dd;                          /* [D, C*N]  (G groups: [D, G*C*N/G]; dw1
                                           [D, G*C*K], qkw [G*C, K, 2R*N/G]) */
    float *pre_sw, *post_sw;            /* [G, N/G, N/G] static maps (use_sw) */
    float *moh_wg;                      /* [N - hs, D] router (moh)         */
    float *moh_wg1;                     /* [hs, D] shared scores (hs > 1)   */
    float *moh_wg0;                     /* [2, D] balance (hs > 0)          */
    float *w1, *b1;                     /* [F, D], [F]                      */
    float *w2, *b2;                     /* [D, F], [D]                      */
    dcs_wmat m_wqkv, m_wo, m_w1, m_w2, m_dw1;   /* what the forward reads   */
} dcs_layer_weights;

/* A weight by canonical name (see dcs_weight_read), in backend memory. */
typedef struct {
    char name[96];
    float *ptr;
    int ndim;
    int64_t shape[5];
    int owned;                          /* 0: aliases the mapped checkpoint */
    const void *half;                   /* stored F16/BF16 data (ptr NULL   */
    int dtype;                          /*  until dcs_model_require_f32)    */
    int half_owned;                     /* half is a malloc'd copy          */
    float **slot;                       /* model field pointing at ptr      */
} dcs_named_weight;

struct dcs_model {
    dcs_config cfg;
    char *dir;
    int device;
    int local[1024];                    /* per layer: 1 = local window      */
    dcs_backend *be;
    float *tok_emb;                     /* [V, D]                           */
    float *out_w;                       /* [V, D] (== tok_emb when tied)    */
    float *norm_w, *norm_b;             /* [D]                              */
    dcs_wmat m_tok_emb, m_out_w;        /* what the forward reads           */
    dcs_layer_weights *layers;          /* [L]                              */
    dcs_named_weight *weights;          /* every weight, by canonical name  */
    int n_weights, cap_weights;
    dcs_tensor_table tt;                /* kept open: weights may alias it  */
    dcs_err err;
    char warnings[1024];                /* load notes (dcs_load_warnings)   */
    /* Activation buffers kept between passes (and between layers of one
     * pass) for reuse by size: no allocator or page-fault cost per layer. */
    struct { void *p; size_t bytes; } pool[DCS_POOL_SIZE];
    int n_pool;
    uint64_t last_peak_bytes, last_total_bytes;   /* of the last forward pass */
    dcs_atomic_int cancel;              /* dcs_cancel: stop the running pass */
    int n_decoders;                     /* live dcs_decoder objects (decode.c) */
    int freed;                          /* dcs_free called while decoders live */
};

/* Make every float* weight field of the model valid float32: weights kept
 * in F16/BF16 are widened into owned buffers (once; freed with the model).
 * For code that needs float32 weights (backward pass, weight reads). */
dcs_status dcs_model_require_f32(dcs_model *m, dcs_err *e);
/* Free everything of the model (dcs_free, or the last decoder of a model
 * dcs_free was called on). */
void dcs_model_destroy(dcs_model *m);

/* Does layer l need the materialising attention path (the variants of
 * model-spec.md 5: static branch, grouped composition, MoH routing)? A
 * fused attention path must fall back to the full one where this is 1. */
int dcs_layer_needs_full_path(const dcs_model *m, int layer);

/* Make the model's float* weights valid float32 host arrays (train.c: always
 * so in this build). Called before the tape reads weights. */
dcs_status dcs_model_require_f32(dcs_model *m, dcs_err *e);
/* DCS_OK if the tape (gradients, training) handles this model (tape.c). */
dcs_status dcs_tape_supported(dcs_model *m);

/* Free the model's pooled activation buffers (forward.c). */
void dcs_pool_clear(dcs_model *m);

/* Zero the masked cells of an attention map x [BN, T, S] (queries at
 * positions t0 .. t0+T-1, keys at 0 .. S-1): the write rule of hooks.md for
 * post-softmax maps (hooks.c). */
void dcs_mask_map(float *x, long long BN, int T, int S, int t0, int window);
int dcs_hook_is_post_softmax_map(int point);

/* Make the float* weight fields of the model usable (float32). Callers that
 * read dcs_layer_weights directly (decode.c) call it first. */
dcs_status dcs_model_require_f32(dcs_model *m, dcs_err *e);
/* DCS_OK if the tape (gradients, training) handles this model (tape.c). */
dcs_status dcs_tape_supported(dcs_model *m);

#endif /* DCS_INTERNAL_H */
