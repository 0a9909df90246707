/*
 * dclens.h -- the one public header of the dclens engine.
 *
 * The engine loads Hugging Face checkpoints of DCPythia (DCMHA attention,
 * Xiao et al. 2024) and Pythia (GPT-NeoX, plain MHA) and runs exact float32
 * forward passes with hooks on every activation (see shared/docs/hooks.md).
 *
 * Conventions
 *   - Every call that can fail returns a dcs_status. DCS_OK is 0.
 *   - Calls on a model leave a message in the model (dcs_errmsg); dcs_load,
 *     which has no model yet, writes its message into a caller buffer.
 *   - Messages name the file (or hook, or argument) and what is wrong.
 *   - No global mutable state: everything lives in a dcs_model.
 *   - Activations seen by hooks are float32, C-contiguous, on the host.
 */
#ifndef DCLENS_H
#define DCLENS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors */

typedef enum {
    DCS_OK = 0,
    DCS_ERR_IO = 1,          /* file missing, unreadable, truncated          */
    DCS_ERR_FORMAT = 2,      /* malformed safetensors / zip / pickle / JSON   */
    DCS_ERR_CONFIG = 3,      /* config.json missing keys, bad values, type   */
    DCS_ERR_TENSOR = 4,      /* missing, extra or mis-shaped tensors         */
    DCS_ERR_NOMEM = 5,       /* allocation failed or a limit was exceeded    */
    DCS_ERR_ARG = 6,         /* bad argument (token id, sizes, hook name)    */
    DCS_ERR_HOOK = 7,        /* a hook callback asked to abort the pass      */
    DCS_ERR_UNSUPPORTED = 8, /* feature not available (e.g. no CUDA)         */
    DCS_ERR_BACKEND = 9,     /* a backend (CUDA, cuBLAS) call failed         */
    DCS_ERR_NONFINITE = 10,  /* NaN/inf in the weights or in the logits      */
    DCS_ERR_CANCELLED = 11   /* dcs_cancel stopped the forward pass          */
} dcs_status;

const char *dcs_status_name(dcs_status s);

/* ---------------------------------------------------------------- model */

typedef struct dcs_model dcs_model;

typedef enum { DCS_MODEL_DCPYTHIA = 1, DCS_MODEL_GPT_NEOX = 2, DCS_MODEL_DCFORMER = 3 } dcs_model_type;

typedef enum { DCS_DEVICE_CPU = 0, DCS_DEVICE_CUDA = 1 } dcs_device;

/* Dimensions and switches of a loaded model (read-only). */
typedef struct {
    int model_type; /* dcs_model_type                                 */
    int n_layer;    /* L                                              */
    int d_model;    /* D                                              */
    int n_head;     /* N                                              */
    int head_dim;   /* Dh = D / N                                     */
    int d_ff;       /* F                                              */
    int vocab;      /* V                                              */
    int rotary_dim; /* r = Dh * rotary_pct (even)                     */
    float rope_base;
    float norm_eps;
    int parallel_residual;
    int qk_norm;
    int linear_bias;
    int use_dcmha;   /* 0 for gpt_neox or dcpythia with use_dcmha=false */
    int query_wise;  /* key-wise branches absent                       */
    int dyn_rank;    /* R (from the dyn_w_proj.qkw shape)              */
    int dyn_hidden;  /* K (from the dyn_w_proj.dw1 shape)              */
    int dyn_slots;   /* C: 4 (pre-q, pre-k, post-q, post-k) or 2        */
    int window_size; /* local-attention window (t - s <= window_size);
                              0: no local layers ("window_size": null)       */
    int tie_embeddings;
    /* attention variants (model-spec.md section 5)                          */
    int use_sw;         /* static (Talking-Heads) sixth compose branch    */
    int compose_groups; /* G: heads composed within G groups (1: all)     */
    int moh;            /* Mixture-of-Head routing on                     */
    int moh_shared;     /* hs: shared (always-on) heads                   */
    int moh_topk;       /* k: routed heads selected per token             */
    int key_wise;       /* query-wise branches absent (the paper's
                              key-wise-only ablation; "key_wise": true)      */
    /* DCFormer++ (model_type "dcformer", docs/dcformer-spec.md)              */
    int mgate_dim;      /* E: groups of the MLP's softmax gate; 0: none   */
    int official_notes; /* DCS_NOTE_* bits: where the official module's
                              numbers differ (said in dcs_load_warnings)    */
} dcs_config;

/* dcs_config.official_notes (DCFormer++) */
enum {
    DCS_NOTE_TYPED_WINDOW = 1, /* typed window_type, window_size != 256     */
    DCS_NOTE_LOCAL_INFER = 2,  /* local layers: inference keeps w - 1 keys   */
    DCS_NOTE_ROPE_DTYPE = 4,   /* 16-bit torch_dtype: rotary table rounded   */
    DCS_NOTE_TRAINING = 8,     /* is_training: the chunked bf16 path         */
    DCS_NOTE_NO_DCMHA = 16     /* use_dcmha false: its inference composes    */
};

/* dcs_load_options.dtype: the type the large matrices (projections, MLP,
 * embedding, unembedding) are kept in. Everything else (norms, biases,
 * activations, hooks, gradients) is float32 whatever the choice.
 *   AUTO: as stored on the CPU; float32 on CUDA (the 16-bit CUDA path is
 *         chosen explicitly until a GPU run has verified it; docs/cuda.md).
 *   F32:  widened to float32 (exact).
 *   F16, BF16: kept in that type; a float32 file is rounded to it (nearest
 *         even); a file stored in the other 16-bit type is refused (its
 *         values would change), as is a float32 value past float16's range. */
enum { DCS_LOAD_AUTO = 0, DCS_LOAD_F32 = 1, DCS_LOAD_F16 = 2, DCS_LOAD_BF16 = 3 };

typedef struct {
    int device;      /* dcs_device                                     */
    int cuda_device; /* GPU ordinal for DCS_DEVICE_CUDA                */
    int n_threads;   /* CPU GEMM threads, 0 = library default          */
    int dtype;       /* DCS_LOAD_*                                     */
} dcs_load_options;

/* Load the model in directory `dir` (config.json + safetensors or torch zip
 * weights, single or sharded). On failure *out is NULL and err holds a
 * message naming the file and what is wrong. opts may be NULL. */
dcs_status dcs_load(const char *dir, const dcs_load_options *opts, dcs_model **out, char *err, size_t errlen);
/* Free a model; with decoders or tapes of it still alive, it goes with the
 * last of them (so they may be freed in any order). */
void dcs_free(dcs_model *m);

const dcs_config *dcs_model_config(const dcs_model *m);
const char *dcs_errmsg(const dcs_model *m); /* last error on this model  */
int dcs_layer_is_local(const dcs_model *m, int layer);
int dcs_model_device(const dcs_model *m);
/* The type the model's large matrices are kept in: 0 float32, 1 float16,
 * 2 bfloat16, 3 mixed (a checkpoint storing some in each, loaded as
 * stored); -1 for a NULL model. */
int dcs_model_weight_dtype(const dcs_model *m);
/* How a pass with no hooked or kept attention map computes attention:
 * rows > 0: by chunks of that many query rows per sequence, on the keys
 * those rows can see (the memory of one [N, rows, keys] map; the CPU's
 * fused kernel is not used); 0 (the default): the fused kernel where the
 * backend has one for the layer, else chunks when the whole [B, N, T, S]
 * map is over 64 MiB (rows to fit that, at most 256), else the full path; -1: the full
 * (materialising) path always. Results agree to float32 rounding. An
 * argument error (nothing changed) for rows < -1; returns DCS_OK else. */
dcs_status dcs_model_set_attention_rows(dcs_model *m, int rows);
int dcs_model_attention_rows(const dcs_model *m); /* -2 for a NULL model */
/* The layer plan: what layer `layer` computes, decided once at load from
 * the configuration and read by the forward (layer.c), the backward
 * (layer_bw.c), the tape's memory plan and Python (Model.plan). NULL for a
 * layer out of range; owned by the model. */
enum { DCS_NORM_LAYER = 0, DCS_NORM_RMS = 1 }; /* LayerNorm; RMSNorm           */
enum { DCS_MLP_GELU = 0, DCS_MLP_SWIGLU = 1 }; /* SwiGLU: w2(silu(w1 x) * w3 x) */
typedef struct {
    int norm;              /* DCS_NORM_*                                        */
    int parallel_residual; /* x + attn(ln1 x) + mlp(ln2 x); else sequential     */
    int mlp;               /* DCS_MLP_*                                         */
    int mlp_gate;          /* E > 0: DCFormer++'s MLP group gate [M, E]; else 0 */
    int window;            /* > 0: a local layer (keys t - s <= window); 0 global */
    int qk_norm;           /* RMS norm of each head's q and k                   */
    int moh;               /* Mixture-of-Head routing of the head outputs       */
    int dcmha;             /* dynamic composition; the fields below are 0 without */
    int slots;             /* C: dynamic-weight slots of the projection          */
    int slot[2][2];        /* [phase 0 pre, 1 post][side 0 query, 1 key]: its
                              slot in [0, C), -1 where that side is absent   */
    int groups;            /* G: heads composed within G groups of N/G          */
    int static_branch;     /* the static (Talking-Heads) branch                 */
    int row_compose;       /* plain DCMHA (no static branch, groups or key-wise):
                              the compose backward's row kernels apply       */
    int fused;             /* the fused attention kernel may compute it (when no
                              hook asks for a map of the layer)             */
} dcs_layer_plan;
const dcs_layer_plan *dcs_layer_plan_of(const dcs_model *m, int layer);

/* Notes from loading (e.g. ignored key-side weights of a query-wise
 * checkpoint), one per line; "" when there are none. Owned by the model. */
const char *dcs_load_warnings(const dcs_model *m);

/* 1 if the library was built with CUDA and a GPU is usable, else 0;
 * why (when 0) is written to `why` if given. */
int dcs_cuda_available(char *why, size_t whylen);

/* The CPU backend's work partition (how its thread pool cuts one operation
 * into items; a function of the shape alone, never of the thread count):
 * op DCS_PART_GEMM, shape {M, N, K, batch}; DCS_PART_GEMM_W (float16/bfloat16
 * weights), shape {M, N, K}; DCS_PART_ATTN (fused attention), shape {B, T, S,
 * N, Dh, window, compose, R[, rows per block: 0 = the engine's rule]}. Writes the first `cap` items' rough work
 * (multiply-adds) to cost, in the order the pool hands them out, and returns
 * the item count; -1 for an unknown op or a bad shape. */
enum { DCS_PART_GEMM = 0, DCS_PART_GEMM_W = 1, DCS_PART_ATTN = 2 };
int64_t dcs_cpu_partition(int op, const int *shape, int n_shape, int64_t *cost, int64_t cap);

/* The kernel set the CPU backend's OpenBLAS chose when it loaded (its CPU
 * detection, or OPENBLAS_CORETYPE): "Cooperlake", "SkylakeX", "Haswell",
 * "Zen", ... or "Prescott", its generic SSE3 fallback for a CPU it does not
 * recognise; "" where the BLAS cannot say. A static string. */
const char *dcs_blas_core(void);

/* The BLAS the engine was built with: "scipy-openblas32" (PyPI's, the
 * default build) or "system libopenblas"; and the loaded library's own build
 * line (openblas_get_config: version, DYNAMIC_ARCH, kernel set, MAX_THREADS;
 * "" where the BLAS cannot say). Static strings. */
const char *dcs_blas_library(void);
const char *dcs_blas_config(void);

/* Weights, by canonical name (the dcpythia state_dict names, with wqkv
 * fused in q,k,v row order; gpt_neox checkpoints are mapped onto them):
 *   tok_embeddings.weight, output.weight, norm.weight, norm.bias,
 *   layers.{l}.attention_norm.{weight,bias}, layers.{l}.ffn_norm.{weight,bias},
 *   layers.{l}.attention.wqkv.{weight,bias}, layers.{l}.attention.wo.{weight,bias},
 *   layers.{l}.attention.{q_norm,k_norm}.scale,
 *   layers.{l}.attention.dyn_w_proj.{dw1,qkw,dd},
 *   layers.{l}.attention.dyn_w_proj.{pre_proj,post_proj}.w   (use_sw),
 *   layers.{l}.attention.moh.{wg,wg_1,wg_0}.weight             (moh),
 *   layers.{l}.feed_forward.{w1,w2}.{weight,bias},
 *   layers.{l}.feed_forward.{w3,mg}.weight                    (dcformer)
 * dcs_weight_shape writes up to 5 dims; dcs_weight_read widens to float32
 * into `out` (room for the product of the shape). */
dcs_status dcs_weight_shape(dcs_model *m, const char *name, int64_t shape[5], int *ndim);
dcs_status dcs_weight_read(dcs_model *m, const char *name, float *out, size_t n_floats);
/* The canonical names of the model's weights: i in [0, dcs_weight_count);
 * NULL for i out of range. */
int dcs_weight_count(const dcs_model *m);
const char *dcs_weight_name(const dcs_model *m, int i);

/* ---------------------------------------------------------------- hooks */

/* Hook points. The per-layer ones are instantiated as "blocks.{l}.<name>". */
typedef enum {
    DCS_HP_EMBED = 0,        /* embed                  [T, D]      global */
    DCS_HP_RESID_PRE,        /* resid_pre              [T, D]             */
    DCS_HP_LN_ATTN,          /* ln_attn                [T, D]             */
    DCS_HP_Q_INPUT,          /* attn.q_input           [T, N, D]  (split  */
    DCS_HP_K_INPUT,          /* attn.k_input           [T, N, D]   q/k/v  */
    DCS_HP_V_INPUT,          /* attn.v_input           [T, N, D]   input) */
    DCS_HP_Q,                /* attn.q                 [T, N, Dh]         */
    DCS_HP_K,                /* attn.k                 [T, N, Dh]         */
    DCS_HP_V,                /* attn.v                 [T, N, Dh]         */
    DCS_HP_DYN_INPUT,        /* attn.dyn_input         [T, D]     (DCMHA) */
    DCS_HP_DYN_PRE_QW1,      /* attn.dyn.pre.qw1       [T, R, N]          */
    DCS_HP_DYN_PRE_QW2,      /* attn.dyn.pre.qw2       [T, R, N]          */
    DCS_HP_DYN_PRE_KW1,      /* attn.dyn.pre.kw1       [S, R, N]          */
    DCS_HP_DYN_PRE_KW2,      /* attn.dyn.pre.kw2       [S, R, N]          */
    DCS_HP_DYN_PRE_QDD,      /* attn.dyn.pre.qdd       [T, N]             */
    DCS_HP_DYN_PRE_KDD,      /* attn.dyn.pre.kdd       [S, N]             */
    DCS_HP_DYN_POST_QW1,     /* attn.dyn.post.qw1      [T, R, N]          */
    DCS_HP_DYN_POST_QW2,     /* attn.dyn.post.qw2      [T, R, N]          */
    DCS_HP_DYN_POST_KW1,     /* attn.dyn.post.kw1      [S, R, N]          */
    DCS_HP_DYN_POST_KW2,     /* attn.dyn.post.kw2      [S, R, N]          */
    DCS_HP_DYN_POST_QDD,     /* attn.dyn.post.qdd      [T, N]             */
    DCS_HP_DYN_POST_KDD,     /* attn.dyn.post.kdd      [S, N]             */
    DCS_HP_SCORES,           /* attn.scores            [N, T, S]          */
    DCS_HP_PRE_SKIP,         /* attn.pre.skip          [N, T, S]          */
    DCS_HP_PRE_QP,           /* attn.pre.qp                               */
    DCS_HP_PRE_KP,           /* attn.pre.kp                               */
    DCS_HP_PRE_QG,           /* attn.pre.qg                               */
    DCS_HP_PRE_KG,           /* attn.pre.kg                               */
    DCS_HP_PRE_STATIC,       /* attn.pre.static (use_sw)                  */
    DCS_HP_SCORES_COMPOSED,  /* attn.scores_composed   [N, T, S]          */
    DCS_HP_PATTERN,          /* attn.pattern           [N, T, S]          */
    DCS_HP_POST_SKIP,        /* attn.post.skip         [N, T, S]          */
    DCS_HP_POST_QP,          /* attn.post.qp                              */
    DCS_HP_POST_KP,          /* attn.post.kp                              */
    DCS_HP_POST_QG,          /* attn.post.qg                              */
    DCS_HP_POST_KG,          /* attn.post.kg                              */
    DCS_HP_POST_STATIC,      /* attn.post.static (use_sw)                 */
    DCS_HP_PATTERN_COMPOSED, /* attn.pattern_composed  [N, T, S]          */
    DCS_HP_ROUTER_LOGITS,    /* attn.router_logits     [T, N - hs] (moh)  */
    DCS_HP_ROUTING,          /* attn.routing           [T, N]      (moh)  */
    DCS_HP_Z,                /* attn.z                 [T, N, Dh] (gated) */
    DCS_HP_HEAD_OUT,         /* attn.head_out          [T, N, D]          */
    DCS_HP_ATTN_OUT,         /* attn.out               [T, D]             */
    DCS_HP_MLP_INPUT,        /* mlp_input              [T, D]             */
    DCS_HP_LN_MLP,           /* ln_mlp                 [T, D]             */
    DCS_HP_MLP_PRE,          /* mlp.pre                [T, F]             */
    /* DCFormer++ SwiGLU MLP (model_type dcformer); mlp.pre is w1 x there,
     * mlp.post silu(pre) * pre_linear (* the group gate), what w2 reads   */
    DCS_HP_MLP_PRE_LINEAR, /* mlp.pre_linear         [T, F]  (dcformer) */
    DCS_HP_MLP_GATE,       /* mlp.gate               [T, E]  (mgate)    */
    DCS_HP_MLP_POST,       /* mlp.post               [T, F]             */
    DCS_HP_MLP_OUT,        /* mlp.out                [T, D]             */
    DCS_HP_RESID_POST,     /* resid_post             [T, D]             */
    DCS_HP_LN_FINAL,       /* ln_final               [T, D]      global */
    DCS_HP_LOGITS,         /* logits                 [T, V]      global */
    DCS_HP_COUNT
} dcs_hook_point;

/* The name suffix of a point ("attn.pattern", "embed", ...) and whether it
 * is per layer. */
const char *dcs_hook_point_name(int point);
int dcs_hook_point_is_layered(int point);
/* The rest of the engine's table of points (hooks.c), for tools and the
 * generated reference (docs/hooks.md): the layout ("[T, N, Dh]"; dynamic
 * weights "[T|S, R, N]": query side T, key side S); the function that
 * computes the point and calls its hook ("layer.c attention_out", under
 * engine/src/model); 0 for a point that is no attention map, 1 for a map
 * before the softmax, 2 after it; which models have it (0 every model, 1
 * DCMHA, 2 DCMHA with a key side, 3 with the static branch, 4 MoH, 5 DCMHA
 * with a query side, 6 a gated MLP, 7 its group gate). NULL / 0 / -1 for a
 * point out of range. Static strings. */
const char *dcs_hook_point_layout(int point);
const char *dcs_hook_point_source(int point);
int dcs_hook_point_map(int point);
int dcs_hook_point_needs(int point);

/* Does this model have the point (compose/dyn points exist only with DCMHA,
 * key-wise ones only without query_wise, static ones with use_sw, routing
 * ones with moh)? */
int dcs_hook_exists(const dcs_model *m, int point);

/* Parse a full hook name ("blocks.3.attn.post.kp", "logits") into point and
 * layer (0 for global points). Unknown names, layers out of range and points
 * this model does not have give DCS_ERR_ARG with a message naming the hook. */
dcs_status dcs_hook_parse(dcs_model *m, const char *name, int *point, int *layer);

/* Shape of a point for a batch of B sequences of length T: writes ndim
 * (batch axis first, so 1 + the documented rank) and the dims. */
int dcs_hook_shape(const dcs_model *m, int point, int B, int T, int64_t shape[6]);

/* Index of (point, layer) in the `want` table: point * (n_layer) + layer,
 * global points use layer 0. Table length: DCS_HP_COUNT * n_layer. */
static inline size_t dcs_hook_index(int n_layer, int point, int layer) {
    return (size_t)point * (size_t)n_layer + (size_t)layer;
}

/* Called at every wanted hook point with the activation for the whole batch
 * ([B, ...] layout, float32, contiguous, writable, host memory).
 * Return 0 if the data was only read, 1 if it was modified (the engine then
 * uses the modified values from this point on), negative to abort the forward
 * pass (it returns DCS_ERR_HOOK; put a message in the model with
 * dcs_set_hook_error first if you like). Writes to masked cells (s > t, or
 * t - s > window on a local layer) of any attention map are ignored: the
 * softmax masks the pre-softmax maps, and after a hook modifies a
 * post-softmax map (pattern, post.*, pattern_composed) its masked cells are
 * set back to 0. */
typedef int (*dcs_hook_fn)(void *user, int point, int layer, float *data, const int64_t *shape, int ndim);

typedef struct {
    const uint8_t *want; /* [DCS_HP_COUNT * n_layer]; nonzero = call fn   */
    dcs_hook_fn fn;
    void *user;
} dcs_hooks;

void dcs_set_hook_error(dcs_model *m, const char *msg);

/* ---------------------------------------------------------------- forward */

/* tokens: [B, T] int32 row-major; logits: [B, T, V] float32 or NULL.
 * hooks may be NULL: then nothing extra is computed or allocated.
 * Every sequence starts at position 0 (right-pad shorter sequences: under
 * the causal mask padding never changes earlier positions).
 * Logits with a NaN or inf (weights that overflow, a hook that wrote huge
 * values) give DCS_ERR_NONFINITE naming the first such position; the
 * buffer is still filled.
 * A dcs_model is not thread-safe: one call at a time per model (the Python
 * binding holds a per-model lock). Different models run in parallel. */
dcs_status dcs_forward(dcs_model *m, const int32_t *tokens, int B, int T, float *logits,
                       const dcs_hooks *hooks);

/* The same pass with logits only at some positions: positions [B, n_pos]
 * (each in [0, T), per sequence), logits [B, n_pos, V]. The unembedding
 * then costs 2 * B * n_pos * D * V FLOPs instead of 2 * B * T * D * V.
 * positions NULL: as dcs_forward. */
dcs_status dcs_forward_at(dcs_model *m, const int32_t *tokens, int B, int T, const int32_t *positions,
                          int n_pos, float *logits, const dcs_hooks *hooks);

/* Ask a running dcs_forward (or dcs_decoder_step) on m to stop (callable from any thread or a
 * signal handler: it only sets an atomic flag). The pass checks the flag
 * before each layer and between a layer's attention and MLP, and then
 * returns DCS_ERR_CANCELLED ("forward: cancelled"). The flag stays set
 * until dcs_cancel(m, 0): clear it before starting the next pass. */
void dcs_cancel(dcs_model *m, int cancel);

/* Fork safety: after fork(), a child may use the parent's loaded model (and
 * load others). Its CPU thread pool rebuilds itself on first use in the
 * child. For a model that had a call running in another thread of the parent
 * at the fork (that thread does not exist in the child), call this once in
 * the child before using it: it forgets the pooled activation buffers
 * (without freeing them: the vanished call may have been taking or returning
 * one) and clears the cancel flag. CUDA models cannot be used after fork. */
void dcs_after_fork(dcs_model *m);

/* Activation memory of the last dcs_forward on this model (weights
 * excluded): the most held at once, and the sum of every buffer the pass
 * asked for. Hooks that are not asked for add nothing to either. */
void dcs_forward_memory(const dcs_model *m, uint64_t *peak_bytes, uint64_t *total_bytes);
/* Free and total bytes of the memory the model's activations live in, for
 * its memory plans: on CUDA the device's (cudaMemGetInfo, plus what the
 * backend's pool holds unused); DCS_ERR_UNSUPPORTED on a backend whose
 * memory is the host's (the caller reads the host's available memory), a
 * device error as DCS_ERR_BACKEND. */
dcs_status dcs_device_memory(dcs_model *m, uint64_t *free_bytes, uint64_t *total_bytes);
/* Give back the activation buffers the model keeps pooled between passes
 * (they are allocated again by the next pass). Not while a pass runs. */
void dcs_model_trim(dcs_model *m);

/* ---------------------------------------------------------------- decoding */

/* Incremental decoding (generation): a decoder keeps, per layer, the keys
 * and values of the tokens fed so far (K/V cache) and their key-side
 * composition weights kw1, kw2, kdd of both phases (the KW cache, as the
 * published DCFormer module keeps); a local layer keeps only its window
 * (the last window_size + 1 positions). Feeding tokens in any chunking
 * gives the logits a full dcs_forward over the whole text gives at those
 * positions (to float32 rounding).
 *
 * dcs_decoder_step feeds n tokens at positions pos .. pos+n-1 (pos =
 * tokens fed before). logits: [n, V] or NULL. Hooks are called as in
 * dcs_forward with B = 1 and T = n (the new tokens), except the attention
 * maps (scores ... pattern_composed), which are [1, N, n, pos + n]: keys at
 * their absolute positions. On a local layer the keys the decoder no
 * longer keeps (outside every new query's window) read as 0 there and
 * writes to them are ignored; key-side dynamic weights (dyn.*.kw1, kw2,
 * kdd) and k, v are those of the n new tokens (what a hook writes there is
 * what later steps see). Errors are reported as by dcs_forward (dcs_errmsg
 * of the model); after a failed step the decoder is unchanged. A decoder
 * keeps its model alive: dcs_free of a model with live decoders frees it
 * when the last of them is freed (either order is safe); do not call
 * anything else on a model after dcs_free. */
typedef struct dcs_decoder dcs_decoder;
dcs_status dcs_decoder_new(dcs_model *m, dcs_decoder **out);
void dcs_decoder_free(dcs_decoder *d);
dcs_status dcs_decoder_step(dcs_decoder *d, const int32_t *tokens, int n, float *logits,
                            const dcs_hooks *hooks);
int dcs_decoder_pos(const dcs_decoder *d); /* tokens fed so far */
/* Key positions layer l holds between steps (window_size + 1 at most on a
 * local layer, pos on a global one); -1 for a bad layer. */
int dcs_decoder_layer_keys(const dcs_decoder *d, int layer);

/* ---------------------------------------------------------------- heatmaps */

typedef enum { DCS_CMAP_SEQUENTIAL = 0, DCS_CMAP_DIVERGING = 1 } dcs_colormap;

/* One [rows, cols] map (row-major floats) with its title. */
typedef struct {
    const float *data;
    int rows, cols;
    const char *title;
    int mask_window;  /* > 0: this panel's local window (overrides
                                    the spec's), < 0: none, 0: the spec's   */
    int own_colormap; /* 1: `colormap` below, not the spec's (needs
                                    the spec's panel_scales)                */
    int colormap;     /* dcs_colormap, with own_colormap          */
    int own_range;    /* 1 (with panel_scales): vmin/vmax below    */
    float vmin, vmax;
} dcs_panel;

typedef struct {
    const dcs_panel *panels;
    int n_panels;
    int grid_cols;                 /* panels per row, <= 0: all in one row     */
    int colormap;                  /* dcs_colormap                             */
    int auto_range;                /* 1: range from the data (diverging: +-max|x|) */
    float vmin, vmax;              /* used when auto_range == 0                */
    const char *const *row_labels; /* rows strings (query tokens) or NULL   */
    const char *const *col_labels; /* cols strings (key tokens) or NULL     */
    int mask_upper;                /* 1: draw s > t cells as masked (causal)   */
    int mask_window;               /* > 0 (with mask_upper): also mask cells
                                    with t - s > mask_window (local layers) */
    int cell_px;                   /* pixels per cell, <= 0: chosen from size  */
    const char *title;             /* figure title or NULL                     */
    int axis_titles;               /* 1: "query" / "key" axis titles           */
    int panel_scales;              /* 1: each panel its own colour range (from
                                    its data, its own_range, or the spec's
                                    fixed vmin/vmax) and its own colour bar;
                                    0: one range and one bar for all         */
} dcs_heatmap_spec;

/* Render to PNG bytes (malloc'd; free with dcs_buffer_free). */
dcs_status dcs_heatmap_png(const dcs_heatmap_spec *spec, uint8_t **png, size_t *png_len, char *err,
                           size_t errlen);
/* Geometry of the picture dcs_heatmap_png draws for `spec`: its width and
 * height, and the top-left pixel (x, y) and side (cell) of cell (t, s) of
 * panel p. Any output pointer may be NULL. */
dcs_status dcs_heatmap_geometry(const dcs_heatmap_spec *spec, int panel, int t, int s, int *width,
                                int *height, int *x, int *y, int *cell, char *err, size_t errlen);
/* The RGB colour of value x in [vmin, vmax] under the colour map. */
void dcs_colormap_rgb(int colormap, float x, float vmin, float vmax, uint8_t rgb[3]);
void dcs_buffer_free(void *p);

/* ---------------------------------------------------------------- gradients, training */

/* A tape runs a forward pass that keeps every activation the backward needs
 * (B sequences of T tokens, CPU only), then the backward: gradients w.r.t.
 * the parameters and at hook points (in the hook's batched layout). */
typedef struct dcs_tape dcs_tape;

/* Replace the activation at a hook point in dcs_tape_forward by `data`
 * (the hook's batched layout); it is then a constant of the pass. */
typedef struct {
    int point;
    int layer;
    const float *data;
} dcs_hook_override;
/* Receive the gradient at a hook point in dcs_tape_backward. */
typedef struct {
    int point;
    int layer;
    float *grad;
} dcs_hook_grad;

dcs_status dcs_tape_new(dcs_model *m, int B, int T, dcs_tape **out);
/* The memory plan. Weights stay in their stored dtype (F16/BF16 matrices
 * are widened tile by tile in the backward's products, as in the forward).
 * The tape keeps every layer's activations when that fits in max_bytes (0:
 * no budget), else only each layer's input (a checkpoint of the residual
 * stream) and one layer's internals, recomputed layer by layer in the
 * backward (the same results, bit for bit); DCS_ERR_NOMEM, with both sizes,
 * when neither fits. */
dcs_status dcs_tape_new_budget(dcs_model *m, int B, int T, uint64_t max_bytes, dcs_tape **out);
/* A tape over layers first..L-1 only (first > 0: the layers below are
 * computed once by the caller, e.g. an integrated-gradients run at a hook of
 * layer `first`): dcs_tape_forward_from takes the residual stream entering
 * layer `first`, resid [B, T, D]; overrides and gradients are then allowed
 * at layers >= first (not embed), parameter gradients not at all. */
dcs_status dcs_tape_new_from(dcs_model *m, int B, int T, int first, uint64_t max_bytes, dcs_tape **out);
dcs_status dcs_tape_forward_from(dcs_tape *tp, const int32_t *tokens, const float *resid,
                                 const dcs_hook_override *ov, int n_ov, float *logits);
/* Bytes a tape for B x T from layer `first` would take, before anything is
 * allocated: its buffers under the plan (recompute 0: every layer kept; 1: checkpoints),
 * a bound on one layer's transient, the backend's backward scratch
 * (ops->bw_scratch, the static map's partials counted), and for each hook point in `points`
 * its gradient and an override of it. */
dcs_status dcs_tape_plan(dcs_model *m, int B, int T, int first, int recompute, const int *points,
                         int n_points, uint64_t *bytes);
/* What a tape holds: its own buffers, the largest transient of its passes
 * so far (its last forward and recomputations, plus its last backward's
 * scratch: ops->bw_scratch, device mirrors of parameter gradients), and
 * whether it recomputes. */
void dcs_tape_memory(const dcs_tape *tp, uint64_t *tape_bytes, uint64_t *pass_peak, int *recompute);
/* The next passes on B x T with 1 <= B <= the tape's B and 1 <= T <= its T
 * (length-bucketed training batches); DCS_ERR_ARG outside. */
dcs_status dcs_tape_reshape(dcs_tape *tp, int B, int T);
void dcs_tape_free(dcs_tape *tp);
/* tokens [B, T]; logits [B, T, V] or NULL. `ov` must outlive the backward. */
dcs_status dcs_tape_forward(dcs_tape *tp, const int32_t *tokens, const dcs_hook_override *ov, int n_ov,
                            float *logits);
/* Copy the activation at a hook point of dcs_tape_forward_read into `data`
 * (the hook's batched layout: dcs_hook_shape with the tape's B, T). */
typedef struct {
    int point;
    int layer;
    float *data;
} dcs_hook_read;
/* dcs_tape_forward that also hands out the activations at `reads` as the
 * pass computes them (an overridden point: the override's data), so a
 * caller needing both a gradient and the forward's values (edge attribution)
 * runs one pass; the backward's recomputation reads nothing. */
dcs_status dcs_tape_forward_read(dcs_tape *tp, const int32_t *tokens, const dcs_hook_override *ov, int n_ov,
                                 const dcs_hook_read *reads, int n_reads, float *logits);
/* Mean cross-entropy over positions with targets [B, T] >= 0 (-1: none);
 * its gradient becomes the tape's dlogits. */
dcs_status dcs_tape_loss(dcs_tape *tp, const int32_t *targets, double *loss, int *count);
/* Backward from dlogits [B, T, V] (NULL: the one of dcs_tape_loss).
 * param_grads: flat [dcs_param_total] accumulated (+=), or NULL. */
dcs_status dcs_tape_backward(dcs_tape *tp, const float *dlogits, float *param_grads, const dcs_hook_grad *g,
                             int n_g);
/* The same with gradients of the parameters in `pg` only (index as in
 * dcs_param_info, grad [its size] accumulated +=): nothing is allocated for
 * the others. */
typedef struct {
    int index;
    float *grad;
} dcs_param_grad;
dcs_status dcs_tape_backward_params(dcs_tape *tp, const float *dlogits, const dcs_param_grad *pg, int n_pg,
                                    const dcs_hook_grad *g, int n_g);

/* The backward in stages, for hook gradients that do not fit in memory at
 * once: each stage hands out the gradients asked of the layers it runs and
 * may free them before the next. resume 0: start at the logits (dlogits as
 * in dcs_tape_backward); resume 1: go on below the layer the last stage
 * stopped at (dlogits NULL). Runs down to layer `stop` (inclusive; the
 * embedding's gradient in the stage that reaches layer 0). The gradients
 * equal those of one dcs_tape_backward (the same bits); no parameter
 * gradients. Every request must be of a layer this stage runs. */
dcs_status dcs_tape_backward_stage(dcs_tape *tp, const float *dlogits, int resume, int stop,
                                   const dcs_hook_grad *g, int n_g);

/* Parameters: every weight by canonical name, in one flat layout. */
int dcs_param_count(const dcs_model *m);
int64_t dcs_param_total(const dcs_model *m);
dcs_status dcs_param_info(const dcs_model *m, int i, const char **name, int64_t *offset, int64_t *n,
                          int *decay);
/* Copy weights that alias the checkpoint file into writable memory. */
dcs_status dcs_model_make_trainable(dcs_model *m);

typedef struct {
    float lr, beta1, beta2, eps, weight_decay;
} dcs_adamw;
/* AdamW on every parameter (decay only where dcs_param_info says so);
 * mom, var flat [dcs_param_total]; step from 1. */
dcs_status dcs_adamw_step(dcs_model *m, const float *grads, float *mom, float *var, int step,
                          const dcs_adamw *h);

/* ---------------------------------------------------------------- sparse dictionaries
 *
 * An SAE (or a transcoder) of width F on d_in-dim activations, SAELens's
 * conventions (engine/src/features/sae.c, docs/features.md):
 *   pre   = (x - b_dec) @ W_enc + b_enc                   [N, F]
 *           (b_dec subtracted only with apply_b_dec_to_input)
 *   acts  = ReLU(pre) | TopK(k) of ReLU(pre) per row | pre * (pre > threshold)
 *           (JumpReLU, threshold = exp(log_threshold) per feature)
 *           | BatchTopK: in training (dcs_sae_grad) the k * N largest
 *           positive pre of the batch (ties to the lower index row * F + f),
 *           at inference (dcs_sae_forward) pre * (pre > threshold), one
 *           threshold [1] that each dcs_sae_adamw moves by
 *           DCS_SAE_THRESHOLD_LR toward the last batch's smallest kept
 *           activation (SAELens's running estimate)
 *   recon = acts @ W_dec + b_dec                          [N, d_out]
 *   loss  = mean over rows of sum over d_out of (recon - target)^2
 *           + sparsity_coef * mean over rows of sum over F of
 *             acts (ReLU: L1) or (pre > threshold) (JumpReLU: L0)
 * target = x for an SAE (d_out = d_in), another tensor for a transcoder.
 * Gradients: TopK through the kept entries; JumpReLU's threshold by the
 * straight-through pseudo-derivative of Rajamanoharan et al. 2024 (a
 * rectangle kernel of width `bandwidth`). Everything is on the host, on the
 * SAE's own CPU pool; calls on an SAE leave their message in it
 * (dcs_sae_errmsg). */
typedef struct dcs_sae dcs_sae;

enum { DCS_SAE_RELU = 0, DCS_SAE_TOPK = 1, DCS_SAE_JUMPRELU = 2, DCS_SAE_BATCHTOPK = 3 };
#define DCS_SAE_THRESHOLD_LR 0.01f
/* what dcs_sae_get / dcs_sae_set read or write */
enum { DCS_SAE_PARAM = 0, DCS_SAE_GRAD = 1, DCS_SAE_MOM = 2, DCS_SAE_VAR = 3 };

typedef struct {
    int d_in;                 /* input width                                  */
    int d_out;                /* 0: d_in (an SAE); else a transcoder's output */
    int d_sae;                /* F, the dictionary's width                    */
    int arch;                 /* DCS_SAE_*                                    */
    int k;                    /* (Batch)TopK: features per row (1 <= k <= F)  */
    int apply_b_dec_to_input; /* subtract b_dec from x (an SAE only)          */
    int normalize_decoder;    /* unit-norm rows of W_dec after each step      */
    float sparsity_coef;      /* ReLU: L1, JumpReLU: L0 coefficient (>= 0)    */
    float bandwidth;          /* JumpReLU: the pseudo-derivative's width (> 0) */
    int n_threads;            /* the pool's threads, 0 = library default      */
} dcs_sae_config;

/* Per batch (dcs_sae_grad): the loss and its parts, the mean L0. */
typedef struct {
    double loss, mse, sparsity, l0;
} dcs_sae_stats;

/* A new SAE with zero parameters and optimizer state; on failure *out is
 * NULL and err holds a message naming the field. */
dcs_status dcs_sae_new(const dcs_sae_config *c, dcs_sae **out, char *err, size_t errlen);
void dcs_sae_free(dcs_sae *s);
const char *dcs_sae_errmsg(const dcs_sae *s);
/* Parameters: W_enc [d_in, F], b_enc [F], W_dec [F, d_out], b_dec [d_out]
 * (+ log_threshold [F] for JumpReLU, threshold [1] for BatchTopK): name
 * and element count of the i-th. */
int dcs_sae_param_count(const dcs_sae *s);
dcs_status dcs_sae_param_info(const dcs_sae *s, int i, const char **name, int64_t *n);
/* Copy parameter i's values, gradient or AdamW moments (what: DCS_SAE_*)
 * out of / into a float32 array of n (= its count) elements. */
dcs_status dcs_sae_get(dcs_sae *s, int what, int i, float *out, int64_t n);
dcs_status dcs_sae_set(dcs_sae *s, int what, int i, const float *in, int64_t n);
/* x [N, d_in] -> pre, acts [N, F], recon [N, d_out] (each may be NULL). */
dcs_status dcs_sae_forward(dcs_sae *s, const float *x, int N, float *pre, float *acts, float *recon);
/* The gradients of the loss on one batch (written, see DCS_SAE_GRAD);
 * target [N, d_out] or NULL (= x, an SAE); st (may be NULL) receives the
 * loss; fired [F] (may be NULL) += the rows where each feature is active. */
dcs_status dcs_sae_grad(dcs_sae *s, const float *x, const float *target, int N, dcs_sae_stats *st,
                        int64_t *fired);
/* One AdamW step (step from 1; weight decay on W_enc and W_dec only) on the
 * gradients of the last dcs_sae_grad, then unit-norm decoder rows if asked. */
dcs_status dcs_sae_adamw(dcs_sae *s, int step, const dcs_adamw *h);
/* Dead-feature resampling (resample.c): each feature dead[j] (j < n_dead)
 * is re-initialised from the row of x [N, d_in] (target [N, d_out] or NULL
 * = x) with the (j mod N)-th worst reconstruction (squared error, ties to
 * the lower row): W_dec row = the unit target row - b_dec, W_enc column =
 * the unit (centred) input row times 0.2 x the mean norm of the live
 * features' W_enc columns (1 when none lives), b_enc = 0, and the AdamW
 * moments of those entries 0. An empty batch is an error. */
dcs_status dcs_sae_resample(dcs_sae *s, const float *x, const float *target, int N, const int *dead,
                            int n_dead);

#ifdef __cplusplus
}
#endif
#endif /* DCLENS_H */
