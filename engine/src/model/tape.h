/*
 * tape.h -- the gradient tape's state, shared by its four files:
 *   tape_plan.c  the memory plan: which buffers a tape holds, their sizes,
 *                allocation, reshaping, what a tape would take;
 *   tape.c       the driver: forward with overrides, the loss, the order of
 *                the backward over the layers, gradients handed out at hook
 *                points and for parameters (device mirrors on CUDA);
 *   tape_hooks.c overrides and gradients at hook points, parameter gradients;
 *   layer_bw.c   the backward of one layer, section by section in layer.c's
 *                order, each function the forward's name plus _bw.
 * Shapes: B sequences of T tokens, M = B*T; D, N, Dh, F, V as in layer.c.
 */
#ifndef DCS_TAPE_H
#define DCS_TAPE_H

#include "pass.h"

/* The backward's gradient buffers, reused by every layer, one list: name,
 * size-table row (pass.h), condition on `any`, the union of the layers'
 * plans (tape_plan.c). It is the tgrads struct and the tape's allocation. */
#define DCS_TGRADS(X)                                                                                        \
    X(dx, ROW_D, 1)                          /* the residual stream's gradient */                            \
    X(dmo, ROW_D, 1)                         /* mlp.out                        */                            \
    X(dug, ROW_F, 1)                         /* mlp.post                       */                            \
    X(du, ROW_F, 1)                          /* mlp.pre                        */                            \
    X(dln2, ROW_D, 1)                        /* ln_mlp                         */                            \
    X(dao, ROW_D, 1)                         /* attn.out                       */                            \
    X(dz, ROW_D, 1)                          /* attn.z                         */                            \
    X(dv, ROW_D, 1)                          /* attn.v, q, k                   */                            \
    X(dq, ROW_D, 1)                          /*                                */                            \
    X(dk, ROW_D, 1)                          /*                                */                            \
    X(dqkv, ROW_3D, 1)                       /* the q, k, v projection         */                            \
    X(dln1, ROW_D, 1)                        /* ln_attn                        */                            \
    X(dP, MAP, 1)                            /* pattern, scores                */                            \
    X(dA, MAP, 1)                            /*                                */                            \
    X(du3, ROW_F, any.mlp == DCS_MLP_SWIGLU) /* SwiGLU's w3 x               */                               \
    X(dgate, MGATE, any.mlp_gate > 0)        /* the MLP group gate             */                            \
    X(dmoh, ROW_D, any.moh)                  /* MoH: the router's input        */                            \
    X(dhgate, HEADS, any.moh)                /* the head gate                  */                            \
    X(dlg, ROUTED, any.moh)                  /* router logits                  */                            \
    X(ds1, SHARED1, any.moh)                 /* shared scores                  */                            \
    X(ds0, BALANCE, any.moh)                 /* balance                        */                            \
    X(dPc, MAP, any.dcmha)                   /* composed pattern, scores       */                            \
    X(dAc, MAP, any.dcmha)                   /*                                */                            \
    X(dW, DYN_ALL, any.dcmha)                /* the dynamic weights, unsplit   */                            \
    X(dG, GATES, any.dcmha)                  /* the gates, unsplit             */                            \
    X(dhid, HID, any.dcmha)                  /* the dynamic-weight MLP's hidden */                           \
    X(dw1raw, DYN_W, any.dcmha)              /* w1 before its RMS norm         */
/* per phase and side (DCMHA) */
#define DCS_TGRADS_DYN(X) X(dw1, DYN_W) X(dw2, DYN_W) X(ddd, DYN_D)

typedef struct {
#define DCS_TG_FIELD(name, size, cond) float *name;
#define DCS_TG_DYN_FIELD(name, size) float *name[2][2];
    DCS_TGRADS(DCS_TG_FIELD)
    DCS_TGRADS_DYN(DCS_TG_DYN_FIELD)
#undef DCS_TG_FIELD
#undef DCS_TG_DYN_FIELD
    float *dsw[2]; /* the static maps' parameter gradients [G, Mg, Mg] (use_sw), per layer */
} tgrads;

struct dcs_tape {
    dcs_model *m;
    int B, T, M;
    int B_cap, T_cap; /* the shape its buffers were sized for (dcs_tape_reshape) */
    /* The memory plan (dcs_tape_plan): every layer's activations kept, or
     * (recompute) only each layer's input x (the residual stream
     * checkpoint, L[l].x) and one layer's internals, shared by every L[l]:
     * the backward reruns layer l from its checkpoint before its backward,
     * through the same code (layer.c with keeping on), so the gradients are
     * the same bits as with the full tape. */
    int recompute;
    int first;          /* the first layer it runs (dcs_tape_new_from): the
                               layers below are the caller's, none kept      */
    int held;           /* the layer whose internals the shared buffers hold */
    float *xr;          /* [M, D] residual stream of a recomputed layer */
    uint64_t bytes;     /* the tape's own buffers                       */
    uint64_t pass_peak; /* the largest transient of its passes          */
    uint64_t bw_peak;   /* its last backward's scratch (ops->bw_scratch)
                           and device mirrors of parameter gradients     */
    int dry;            /* planning only: tp_alloc counts, allocates nothing */
    dcs_kept *L;
    float *xL, *lnf, *logits, *dlogits;
    int32_t *tokens; /* [M] host */
    tgrads d;
    const dcs_hook_override *ov;
    int n_ov;
    const dcs_hook_read *rd; /* the forward's reads (dcs_tape_forward_read; none after it) */
    int n_rd;
    uint8_t *want; /* [DCS_HP_COUNT * n_layer]: the overridden (and, in the forward, read) points */
    float *kT[2][3], *dkT[2][3]; /* CPU, per phase: transposed key-side dynamic weights and their grads */
    int have_forward;
    int bw_next;       /* a staged backward's next layer (dcs_tape_backward_stage); -1: none pending */
    dcs_status status; /* allocation failure inside the backward */
    void **allocs;
    int n_allocs, cap_allocs;
};

/* The gradient buffers of one layer's parameters (DCS_LAYER_PARAMS: the
 * fields of dcs_layer_weights); NULL where none is asked. */
typedef struct {
#define DCS_LG_FIELD(field, name) float *field;
    DCS_LAYER_PARAMS(DCS_LG_FIELD)
#undef DCS_LG_FIELD
} dcs_layer_grads;

/* Where the backward accumulates parameter gradients: one flat array of
 * every parameter (training), or buffers for the parameters asked for;
 * each found once per backward (dcs_tape_param_grads) by the weight's
 * layer and field. */
typedef struct {
    float *flat;
    const dcs_param_grad *pg;
    int n_pg;
    const dcs_hook_grad *g;
    int n_g;
    float **dev;                              /* [n_weights] device mirrors of the asked gradients (CUDA) */
    dcs_layer_grads *lg;                      /* [n_layer] */
    float *tok_emb, *out_w, *norm_w, *norm_b; /* the model's own */
    float *split_dln, *split_dx; /* [M, N, D] each: the split q/k/v inputs' scratch for every layer
                                    (run_backward; NULL when none is asked; dx on a device only) */
} bwctx;

/* ---- tape_plan.c */

/* Every buffer of the tape under its plan (tp->recompute); with tp->dry
 * only their bytes are counted. 1 on success. */
int dcs_tape_alloc(dcs_tape *tp);
/* The backend's scratch in one backward operation for B x T (sw_grad: the
 * static map's gradient may be asked). */
uint64_t dcs_tape_bw_scratch(const dcs_model *m, int B, int T, int sw_grad);

/* ---- tape_hooks.c: the tape's hook points */

size_t dcs_tape_hook_numel(const dcs_tape *tp, int point);
/* The pass's hook in the tape's forward and recomputation: an overridden
 * point gets the given data (dcs_hooks.fn, user = the tape). */
int dcs_tape_ov_hook(void *user, int point, int layer, float *data, const int64_t *shape, int nd);
/* The override of (point, layer) in this forward, or NULL. */
const dcs_hook_override *dcs_tape_ov(const dcs_tape *tp, int point, int layer);
/* Hand out the gradient dx at (point, layer) where asked. */
void dcs_tape_grad_capture(dcs_tape *tp, const dcs_hook_grad *g, int n_g, int point, int layer,
                           const float *dx);
/* The same, then cut it (zero dx) when the activation was overridden. */
void dcs_tape_grad_at(dcs_tape *tp, const dcs_hook_grad *g, int n_g, int point, int layer, float *dx);
int dcs_tape_wants_grad(const dcs_hook_grad *g, int n_g, int point, int layer);
/* Fill bc->lg and the model's own gradient pointers from bc->flat, pg or
 * dev (every weight's buffer, NULL where none is asked). */
dcs_status dcs_tape_param_grads(const dcs_model *m, bwctx *bc);

/* ---- layer_bw.c: the backward of layer.c's functions */

/* Block l: from d->dx, the gradient at its output (resid_post), to d->dx at
 * its input (resid_pre), parameter gradients accumulated. */
void dcs_layer_bw(dcs_tape *tp, int l, const bwctx *bc);
/* The final norm and unembedding: from dlogits to d->dx at the last
 * residual stream (written). */
void dcs_pass_final_bw(dcs_tape *tp, const bwctx *bc);
/* The embedding: d->dx into the embedding's gradient. */
void dcs_pass_embed_bw(dcs_tape *tp, const bwctx *bc);

#endif /* DCS_TAPE_H */
