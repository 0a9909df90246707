/*
 * dcs_model.h -- the model layer (engine/src/model/, library dclens_model):
 * the model struct, its lifecycle and activation pool (model.c), loading
 * (load_model.c, load_*.c), the forward graph, hooks, decoding, and the tape, backward
 * pass and training. Includes the backends layer below it.
 */
#ifndef DCS_MODEL_H
#define DCS_MODEL_H

#include "dcs_backend.h"

#include <stdatomic.h>

#define DCS_POOL_SIZE 48 /* reusable activation buffers  */

/* ---------------------------------------------------------------- model */

/* A layer's parameters, one list: field, canonical name after
 * "layers.{l}." (dclens.h's weight names), shape. It declares the float*
 * fields of dcs_layer_weights and of the gradients (tape.h), maps each
 * loaded weight to its field (dcs_model_map_params) and rewires them to
 * trainable copies (train.c). */
#define DCS_LAYER_PARAMS(X)                                                                                  \
    X(attn_norm_w, "attention_norm.weight")        /* [D]                                  */                \
    X(attn_norm_b, "attention_norm.bias")          /* [D] (none with RMSNorm)              */                \
    X(ffn_norm_w, "ffn_norm.weight")               /* [D]                                  */                \
    X(ffn_norm_b, "ffn_norm.bias")                 /* [D]                                  */                \
    X(wqkv, "attention.wqkv.weight")               /* [3D, D] rows q, k, v                 */                \
    X(bqkv, "attention.wqkv.bias")                 /* [3D]                                 */                \
    X(wo, "attention.wo.weight")                   /* [D, D]                               */                \
    X(bo, "attention.wo.bias")                     /* [D]                                  */                \
    X(q_scale, "attention.q_norm.scale")           /* [Dh]                                 */                \
    X(k_scale, "attention.k_norm.scale")           /* [Dh]                                 */                \
    X(dw1, "attention.dyn_w_proj.dw1")             /* [D, C*K] (G groups: [D, G*C*K])      */                \
    X(qkw, "attention.dyn_w_proj.qkw")             /* [C, K, 2R*N] ([G*C, K, 2R*N/G])      */                \
    X(dd, "attention.dyn_w_proj.dd")               /* [D, C*N] ([D, G*C*N/G])              */                \
    X(pre_sw, "attention.dyn_w_proj.pre_proj.w")   /* [G, N/G, N/G] static maps (use_sw)   */                \
    X(post_sw, "attention.dyn_w_proj.post_proj.w") /*                                      */                \
    X(moh_wg, "attention.moh.wg.weight")           /* [N - hs, D] router (moh)             */                \
    X(moh_wg1, "attention.moh.wg_1.weight")        /* [hs, D] shared scores (hs > 1)       */                \
    X(moh_wg0, "attention.moh.wg_0.weight")        /* [2, D] balance (hs > 0)              */                \
    X(w1, "feed_forward.w1.weight")                /* [F, D]                               */                \
    X(b1, "feed_forward.w1.bias")                  /* [F]                                  */                \
    X(w2, "feed_forward.w2.weight")                /* [D, F]                               */                \
    X(b2, "feed_forward.w2.bias")                  /* [D]                                  */                \
    X(w3, "feed_forward.w3.weight")                /* [F, D] SwiGLU's linear half (dcformer) */              \
    X(mg, "feed_forward.mg.weight")                /* [E, D] MLP group gate (mgate)        */
enum {
#define DCS_LP_ENUM(field, name) DCS_LP_##field,
    DCS_LAYER_PARAMS(DCS_LP_ENUM)
#undef DCS_LP_ENUM
        DCS_LP_COUNT
};

/* Per-layer weights, device pointers, float32. NULL where absent. On the
 * CPU the large matrices of an F16/BF16 checkpoint stay in their stored
 * dtype (the m_* views below); their float* fields are then NULL until
 * dcs_model_require_f32 widens them. For float32 checkpoints (and on CUDA)
 * the float* fields are always valid. The forward pass reads the m_* views. */
typedef struct {
#define DCS_LP_FIELD(field, name) float *field;
    DCS_LAYER_PARAMS(DCS_LP_FIELD)
#undef DCS_LP_FIELD
    dcs_wmat m_wqkv, m_wo, m_w1, m_w2, m_dw1, m_w3; /* what the forward reads */
} dcs_layer_weights;

/* A weight by canonical name (see dcs_weight_read), in backend memory. */
typedef struct {
    char name[96];
    float *ptr;
    int ndim;
    int64_t shape[5];
    int owned;        /* 0: aliases the mapped checkpoint */
    const void *half; /* stored F16/BF16 data (ptr NULL   */
    int dtype;        /*  until dcs_model_require_f32)    */
    int half_owned;   /* half is a malloc'd copy          */
    int half_dev;     /* half is in device memory (CUDA)  */
    float **slot;     /* model field pointing at ptr      */
    int layer, field; /* its layer and DCS_LP_* field; -1 for the model's own
                         (embedding, final norm, unembedding) */
} dcs_named_weight;

struct dcs_model {
    dcs_config cfg;
    char *dir;
    int device;
    int local[1024]; /* per layer: 1 = local window      */
    dcs_backend *be;
    /* large matrices: want_dtype the dcs_dtype asked (dcs_load_options.dtype,
     * resolved; -1 as stored), kept_dtype what they are kept in (-1 none yet,
     * a dcs_dtype, 3 mixed: dcs_model_weight_dtype), act_dtype the attention
     * products' input type (dcs_heads_*: the kept 16-bit type on a backend
     * with gemm_x, else DCS_F32) */
    int want_dtype, kept_dtype, act_dtype;
    int attn_rows;               /* query rows per attention chunk (dcs_model_set_attention_rows) */
    float *tok_emb;              /* [V, D]                           */
    float *out_w;                /* [V, D] (== tok_emb when tied)    */
    float *norm_w, *norm_b;      /* [D]                              */
    dcs_wmat m_tok_emb, m_out_w; /* what the forward reads           */
    dcs_layer_weights *layers;   /* [L]                              */
    dcs_layer_plan *plan;        /* [L] what each layer computes (pass.c) */
    dcs_named_weight *weights;   /* every weight, by canonical name  */
    int n_weights, cap_weights;
    dcs_tensor_table tt; /* kept open: weights may alias it  */
    dcs_err err;
    char warnings[2048]; /* load notes (dcs_load_warnings)   */
    /* Activation buffers kept between passes (and between layers of one
     * pass) for reuse by size: no allocator or page-fault cost per layer. */
    struct {
        void *p;
        size_t bytes;
    } pool[DCS_POOL_SIZE];
    int n_pool;
    uint64_t last_peak_bytes, last_total_bytes; /* of the last forward pass */
    atomic_int cancel;                          /* dcs_cancel: stop the running pass */
    int n_decoders;                             /* live dcs_decoder objects (decode.c) */
    int n_tapes;                                /* live dcs_tape objects (tape.c)      */
    int freed;                                  /* dcs_free called while either live   */
};

/* ---- model.c: lifecycle, weight reads, the activation pool */

/* Make every float* weight field of the model valid float32: weights kept
 * in F16/BF16 are widened into owned buffers (once; freed with the model).
 * For code that reads dcs_layer_weights directly (decode.c, the tape). */
dcs_status dcs_model_require_f32(dcs_model *m, dcs_err *e);
/* Set each weight's layer and field (DCS_LAYER_PARAMS) from its name, once
 * loaded; an Error names a layer weight the list does not hold. */
dcs_status dcs_model_map_params(dcs_model *m, dcs_err *e);
/* Free everything of the model (dcs_free, or the last decoder of a model
 * dcs_free was called on). */
void dcs_model_destroy(dcs_model *m);

/* Activation buffers kept by the model between passes, reused by size:
 * dcs_pool_take gives a pooled buffer of exactly `bytes` (contents
 * undefined) or NULL when there is none; dcs_pool_put keeps one (or frees
 * it when the pool is full); dcs_pool_clear frees them all. */
void *dcs_pool_take(dcs_model *m, size_t bytes);
void dcs_pool_put(dcs_model *m, void *p, size_t bytes);
void dcs_pool_clear(dcs_model *m);

/* ---- hooks.c */

/* Zero the masked cells of an attention map x [BN, T, S] (queries at
 * positions t0 .. t0+T-1, keys at 0 .. S-1): the write rule of hooks.md for
 * post-softmax maps. */
void dcs_mask_map(float *x, long long BN, int T, int S, int t0, int window);
int dcs_hook_is_post_softmax_map(int point);

/* ---- tape.c */

/* DCS_OK if the tape (gradients, training) handles this model. */
dcs_status dcs_tape_supported(dcs_model *m);

#endif /* DCS_MODEL_H */
