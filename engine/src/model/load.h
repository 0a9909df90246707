/*
 * load.h -- internal to the model library's loader (load_*.c): the builder
 * a checkpoint is loaded through and the helpers every architecture shares
 * (load_weights.c): take a stored tensor by name and shape, refuse NaN/inf,
 * register a weight in backend memory (float32, or kept in its 16-bit dtype
 * on the CPU), and the tensors around the layers. The architectures:
 * load_dcpythia.c (DCPythia, DCFormer++), load_neox.c (GPT-NeoX); their
 * order and the rest of dcs_load: load_model.c.
 */
#ifndef DCS_LOAD_H
#define DCS_LOAD_H

#include "dcs_model.h"

typedef struct {
    dcs_model *m;
    dcs_err *e;
} dcs_builder;

/* Return the error set (or DCS_ERR_TENSOR) from a loader when `cond`. */
#define FAIL_IF(cond)                                                                                        \
    do {                                                                                                     \
        if (cond) return b->e->code ? b->e->code : DCS_ERR_TENSOR;                                           \
    } while (0)

/* Find `name`, check its shape (ndim int64_t dims follow), mark it used.
 * Missing: NULL, and an error if required. */
dcs_tensor *dcs_load_take(dcs_builder *b, const char *name, int required, int ndim, ...);

/* Refuse a weight kept in its 16-bit dtype (F16, BF16) that holds NaN or
 * inf; 1 when finite. */
int dcs_load_half_finite(dcs_builder *b, const dcs_tensor *t);

/* Register a weight under its canonical name and place it in backend
 * memory: either aliasing `t` or from host floats `src` (copied). */
float *dcs_load_add_weight(dcs_builder *b, const char *name, int ndim, const int64_t *shape,
                           const dcs_tensor *t, const float *src);

/* Register a large matrix: on the CPU, F16/BF16 data stays as stored (the
 * mapped bytes when 2-byte aligned, else an owned copy; `own` hands over a
 * malloc'd buffer) and *slot stays NULL until dcs_model_require_f32. */
dcs_wmat dcs_load_add_weight_keep(dcs_builder *b, const char *name, int ndim, const int64_t *shape,
                                  const uint8_t *data, int dtype, uint8_t *own, float **slot);

/* A large matrix by stored name: kept in its dtype on the CPU (see
 * dcs_load_add_weight_keep), float32 elsewhere. NULL .p when missing. */
dcs_wmat dcs_load_keep(dcs_builder *b, const char *canon, const char *stored, int ndim, int64_t d0,
                       int64_t d1, int64_t d2, int64_t d3, float **slot);

/* take + add_weight under the same shape; canonical name given separately.
 * *missing (if given) set when the tensor is not there or wrong. */
float *dcs_load_as(dcs_builder *b, const char *canon, const char *stored, int required, int ndim, int64_t d0,
                   int64_t d1, int64_t d2, int64_t d3, int64_t d4, int *missing);

/* The stored names of the tensors around the layers (norm_b NULL: the
 * final norm has no bias). */
typedef struct {
    const char *tok_emb, *norm_w, *norm_b, *out;
} dcs_load_names;

/* The token embedding, each layer by `layer`, the final norm and the output
 * matrix (with tied embeddings the embedding's; its stored copy ignored),
 * in that order, under their canonical names. */
dcs_status dcs_load_stack(dcs_builder *b, const dcs_load_names *names,
                          dcs_status (*layer)(dcs_builder *b, int l));

/* The architectures (load_dcpythia.c, load_neox.c), and the load notes of
 * a DCPythia / DCFormer++ checkpoint (into m->warnings). */
dcs_status dcs_load_dcpythia(dcs_builder *b);
void dcs_load_dcpythia_notes(dcs_model *m);
dcs_status dcs_load_neox(dcs_builder *b);

#endif
