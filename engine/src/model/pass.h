/*
 * pass.h -- one pass over the layers (pass.c) and the one layer (layer.c):
 * "T new query positions per sequence, starting at position t0, against
 * the P cached + T new key positions", with optional keeping of what the
 * backward needs. Its three uses:
 *   the full forward (forward.c)   empty cache, t0 = 0, nothing kept;
 *   the incremental decoder        the decoder's per-layer caches (B = 1);
 *   (decode.c)
 *   the gradient tape (tape.c)     empty cache, every activation the
 *                                  backward reads kept (dcs_kept).
 * Hook dispatch, the memory plan (the model's pool, one size table),
 * cancellation and the fused attention path live here once.
 */
#ifndef DCS_PASS_H
#define DCS_PASS_H

#include "dcs_model.h"

#define DCS_PASS_MAX_BUFS 96

/* ---------------------------------------------------------------- the plan
 * What differs between layers and architectures (the norm, the residual
 * order, the MLP, the attention variant, the fused path) is decided once,
 * at load, in dcs_layer_plan (dclens.h): dcs_plan_layers fills the model's
 * plan[] and every pass and backward read it. A new family or variant adds
 * its switch there and one case where each is computed. */
dcs_status dcs_plan_layers(dcs_model *m, dcs_err *e);

/* ---------------------------------------------------------------- cache
 * One layer's keys held by a decoder: positions first .. first+used-1 in
 * slots 0 .. used-1, backend memory. */
typedef struct {
    float *k, *v;                    /* [cap, D]                              */
    float *kw1[2], *kw2[2], *kdd[2]; /* key-side dynamic weights per phase:
                                        [cap, R, N], [cap, N]; NULL without  */
    int first, used, cap;
} dcs_kv_cache;

/* ---------------------------------------------------------------- kept
 * One layer's activations the backward reads (the tape), [M = B*T rows],
 * one list: name, its row of the size table below, and the condition on
 * the layer plan `pl` (with the configuration `c`) under which the layer
 * computes it. The list is the dcs_kept struct and the tape's allocation
 * (tape_plan.c, in this order); the dynamic weights follow, kept per phase
 * and side where the plan has that side. Norm statistics are kept only for
 * a parallel residual's pair of LayerNorms of x (lnst, when its forward ran
 * them as one, ops->layernorm2); otherwise the backward recomputes them from
 * the inputs. */
#define DCS_LN_PAIR(pl) ((pl)->parallel_residual && (pl)->norm != DCS_NORM_RMS)
#define DCS_KEPT(X)                                                                                          \
    X(x, ROW_D, 1)                                /* the block's input (resid_pre)         */                \
    X(ln1, ROW_D, 1)                              /* ln_attn                               */                \
    X(q, ROW_D, 1)                                /* [M, N, Dh], after norm and rotary     */                \
    X(k, ROW_D, 1)                                /*                                       */                \
    X(v, ROW_D, 1)                                /*                                       */                \
    X(qraw, ROW_D, pl->qk_norm)                   /* q, k before their norms               */                \
    X(kraw, ROW_D, pl->qk_norm)                   /*                                       */                \
    X(A, MAP, 1)                                  /* scores [B, N, T, T]                   */                \
    X(P, MAP, 1)                                  /* pattern                               */                \
    X(hpre, HID, pl->dcmha)                       /* the dynamic-weight MLP, before GELU   */                \
    X(hid, HID, pl->dcmha)                        /* after                                 */                \
    X(g, GATES, pl->dcmha)                        /* the gates [M, C*N]                    */                \
    X(Pc, MAP, pl->dcmha)                         /* the composed pattern                  */                \
    X(z, ROW_D, 1)                                /* [M, N, Dh]                            */                \
    X(ao, ROW_D, 1)                               /* attn.out                              */                \
    X(h, ROW_D, !pl->parallel_residual)           /* x + attn.out (sequential)             */                \
    X(ln2, ROW_D, 1)                              /* ln_mlp                                */                \
    X(lnst, BALANCE, DCS_LN_PAIR(pl))             /* [2, M]: their means, 1/std (ln1, ln2) */                \
    X(u, ROW_F, 1)                                /* mlp.pre                               */                \
    X(ug, ROW_F, 1)                               /* mlp.post                              */                \
    X(mo, ROW_D, 1)                               /* mlp.out                               */                \
    X(u3, ROW_F, pl->mlp == DCS_MLP_SWIGLU)       /* SwiGLU's w3 x                         */                \
    X(gate, MGATE, pl->mlp_gate > 0)              /* the MLP group gate [M, E]             */                \
    X(zpre, ROW_D, pl->moh)                       /* MoH: z before the head gate           */                \
    X(hgate, HEADS, pl->moh)                      /* the head gate [M, N]                  */                \
    X(rlg, ROUTED, pl->moh)                       /* router logits [M, N - hs]             */                \
    X(rs1, SHARED, pl->moh && c->moh_shared > 1)  /* shared scores [M, hs]             */                    \
    X(rs0, BALANCE, pl->moh && c->moh_shared > 0) /* balance [M, 2]                   */
/* per phase and side: w1 before its RMS norm, w1, w2 [M, R, N], gates dd [M, N] */
#define DCS_KEPT_DYN(X) X(w1raw, DYN_W) X(w1, DYN_W) X(w2, DYN_W) X(dd, DYN_D)

typedef struct {
#define DCS_KEPT_FIELD(name, size, cond) float *name;
#define DCS_KEPT_DYN_FIELD(name, size) float *name[2][2];
    DCS_KEPT(DCS_KEPT_FIELD)
    DCS_KEPT_DYN(DCS_KEPT_DYN_FIELD)
#undef DCS_KEPT_FIELD
#undef DCS_KEPT_DYN_FIELD
    int u_dgelu;  /* the last forward kept gelu'(u) in u (ops->bias_gelu_keep), not u */
    int lnst_set; /* the last forward wrote lnst (ops->layernorm2) */
} dcs_kept;

/* The size table: floats of each kept activation of one layer for B
 * sequences of T positions. Plans the tape's buffers and the forward's
 * memory check alike. */
enum {
    DCS_ACT_ROW_D,   /* x, ln1, q, k, v, z, ao, ln2, mo, h, qraw, kraw: M*D */
    DCS_ACT_ROW_F,   /* u, ug, u3: M*F                                  */
    DCS_ACT_HID,     /* hpre, hid: M*G*C*K                              */
    DCS_ACT_GATES,   /* g: M*G*C*(N/G)                                  */
    DCS_ACT_DYN_W,   /* w1raw, w1, w2 per phase and side: M*R*N         */
    DCS_ACT_DYN_D,   /* dd per phase and side: M*N                      */
    DCS_ACT_DYN_ALL, /* the dynamic weights before splitting: M*G*C*2R*(N/G) */
    DCS_ACT_MAP,     /* A, P, Pc: B*N*T*S                               */
    DCS_ACT_MGATE,   /* gate: M*E                                       */
    DCS_ACT_HEADS,   /* hgate: M*N                                      */
    DCS_ACT_ROUTED,  /* rlg: M*(N - hs)                                 */
    DCS_ACT_SHARED,  /* rs1: M*hs                                       */
    DCS_ACT_BALANCE, /* rs0, lnst: M*2                                  */
    DCS_ACT_ROW_3D,  /* the qkv gradient: M*3D                          */
    DCS_ACT_SHARED1, /* the shared scores' gradient: M*max(hs, 1)       */
    DCS_ACT_COUNT
};
void dcs_act_sizes(const dcs_config *c, int B, int T, int S, uint64_t sizes[DCS_ACT_COUNT]);

/* The hook points fired from tables (the layer, the tape's backward and the
 * pass planning read the same ones; hooks.c's table names the function that
 * fires each): the dynamic weights [phase][0 query, 1 key][w1, w2, dd]; the
 * compose branches [phase][skip, qp, kp, qg, kg, static] (dcs_compose_args.br
 * order); the split q/k/v inputs [part]. dcs_split_part: a point's part, or
 * -1 for a point that is no split input. */
extern const int dcs_dyn_points[2][2][3];
extern const int dcs_branch_points[2][DCS_N_BRANCHES];
extern const int dcs_split_points[3];
int dcs_split_part(int point);

/* ---------------------------------------------------------------- pass */
typedef struct {
    dcs_model *m;
    dcs_backend *be;
    const dcs_hooks *hooks;
    int B, T, t0, M;     /* B sequences of T new positions from t0; M = B*T */
    const char *prefix;  /* "forward", "decode", "tape": error messages  */
    const char *what;    /* "forward pass", "decoding step"             */
    dcs_kv_cache *cache; /* [n_layer] (B = 1) or NULL                   */
    dcs_kept *keep;      /* [n_layer] or NULL                           */
    struct {
        void *p;
        size_t bytes;
    } bufs[DCS_PASS_MAX_BUFS]; /* in use */
    int n_bufs;
    uint64_t in_use, peak, total; /* activation bytes: now, at most, asked */
    float *host;                  /* staging for hooks on a non-host backend     */
    size_t host_cap;
    dcs_status status;
} dcs_pass;

void dcs_pass_init(dcs_pass *p, dcs_model *m, const dcs_hooks *hooks, int B, int T, int t0,
                   const char *prefix, const char *what);
/* Give every buffer back to the model's pool (all of it after a failure). */
void dcs_pass_end(dcs_pass *p);

/* n1*n2*n3 floats (checked) from the model's pool or the backend, kept
 * until dcs_pass_release or the end of the pass; NULL with p->status set. */
float *dcs_pass_alloc(dcs_pass *p, int64_t n1, int64_t n2, int64_t n3);
/* Back to the pool; pointers this pass did not allocate (kept or cached
 * activations) are left alone. */
void dcs_pass_release(dcs_pass *p, float *x);

int dcs_pass_wants(const dcs_pass *p, int point, int layer);
/* The hook at (point, layer) on `dev` (not an attention map) if wanted;
 * 1 if it modified the data. */
int dcs_pass_hook(dcs_pass *p, int point, int layer, float *dev);
/* The same for an attention map [B, N, T, S] whose key j is at position
 * kb + j: the hook sees [B, N, T, t0 + T] (keys not held read 0). */
int dcs_pass_hook_map(dcs_pass *p, int point, int layer, float *dev, int S, int kb);
/* Has dcs_cancel asked this pass to stop? Sets the status if so. */
int dcs_pass_cancelled(dcs_pass *p);

/* y [M, O] = x [M, I] W^T + b (a torch Linear, W [O, I]), W float32 or
 * (CPU) F16/BF16. */
void dcs_pass_linear(dcs_pass *p, float *y, const float *x, dcs_wmat W, const float *b, int M, int O, int I);
/* The attention's per-head products, for each of B sequences one gemm
 * batched over the N heads. Rows are [B, T|S, N, Dh] with row stride D;
 * maps [B, N, T, S]; written (beta 0).
 *   dcs_heads_map:  map[b, n] = alpha x[b, :, n] y[b, :, n]^T  (x: T rows, y: S rows)
 *   dcs_heads_rows: out[b, :, n] = alpha op(map[b, n]) y[b, :, n], op = transpose
 *                   when trans (out: T rows from y's S, or S rows from y's T)
 * dt: the inputs' type (the model's act_dtype): DCS_F32, or F16 / BF16 through
 * the backend's gemm_x where it has one (a 16-bit model on CUDA). */
void dcs_heads_map(dcs_backend *be, int dt, int B, int N, int T, int S, int Dh, int D, float alpha,
                   const float *x, const float *y, float *map);
void dcs_heads_rows(dcs_backend *be, int dt, int trans, int B, int N, int T, int S, int Dh, int D,
                    float alpha, const float *map, const float *y, float *out);

/* out [M, D] = the norm of x of the given kind (DCS_NORM_*, the layer plan's). */
void dcs_pass_norm(dcs_pass *p, int kind, float *out, const float *x, const float *w, const float *b, int M);

/* x [M, D] = the embedding rows of tokens (host ids, in range), with the
 * embed hook. */
void dcs_pass_embed(dcs_pass *p, const int32_t *tokens, float *x);

/* ---- attention.c */

/* The dynamic weights of one layer (model-spec 2 step 4), per phase (0 pre,
 * 1 post) and side (0 query, 1 key): w1, w2 [B, T|S, R, N] (w1 RMS-normed
 * over each group's heads), dd [B, T|S, N]; NULL for an absent side
 * (query_wise, key_wise). A decoding step's key side is the cache's, every
 * held key. Written by layer.c's dynamic_weights. */
typedef struct {
    float *w1[2][2], *w2[2][2], *dd[2][2];
} dcs_dyn_weights;

/* The keys of layer l in this pass: S per sequence, key j at position kb + j. */
typedef struct {
    const float *k, *v; /* [B, S, N, Dh] */
    int S, kb, window;
} dcs_keys_view;

/* z [M, N, Dh] of layer l from q [M, N, Dh], the keys kv and the dynamic
 * weights dw (ignored without DCMHA), with the hooks of the attention maps:
 * by query chunks, the fused kernel or the materialising path. */
void dcs_attention(dcs_pass *p, int l, const dcs_dyn_weights *dw, const float *q, const dcs_keys_view *kv,
                   float *z);

/* ---- layer.c */

/* The attention map one chunk of the chunked path may take when
 * dcs_model_set_attention_rows is 0 (auto): 64 MiB, in at most 256 query
 * rows (layer.c's chunk_rows). */
#define DCS_ATTN_CHUNK_BYTES ((uint64_t)64 << 20)
#define DCS_ATTN_CHUNK_ROWS 256

/* Block l on the residual stream x [M, D] (in place). */
void dcs_layer(dcs_pass *p, int l, float *x);
/* Every block, with cancellation and a sync after each. */
void dcs_pass_layers(dcs_pass *p, float *x);
/* The final norm and unembedding of x [M, D]: hn [M, D], lg [M, V] (lg NULL:
 * the norm only), with their hooks. */
void dcs_pass_final(dcs_pass *p, const float *x, float *hn, float *lg);

#endif /* DCS_PASS_H */
