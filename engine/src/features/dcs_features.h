/*
 * dcs_features.h -- the features layer (engine/src/features/, library
 * dclens_features): sparse dictionaries on a hook's activations (sae.c).
 * Includes the backends layer (GEMM, the thread pool, dcs_math.h's AdamW
 * element) and the io layer (the error record) below it; nothing of the
 * model layer: an SAE is trained on activations, whatever produced them.
 */
#ifndef DCS_FEATURES_H
#define DCS_FEATURES_H

#include "dcs_backend.h"

/* The parameters, in this order (dcs_sae_param_info):
 * W_enc [d_in, F], b_enc [F], W_dec [F, d_out], b_dec [d_out], and for
 * JumpReLU log_threshold [F], for BatchTopK threshold [1] (not trained by
 * AdamW: each step moves it toward the last batch's smallest kept
 * activation). */
enum { DCS_SAE_W_ENC = 0, DCS_SAE_B_ENC = 1, DCS_SAE_W_DEC = 2, DCS_SAE_B_DEC = 3, DCS_SAE_LOG_THR = 4 };
#define DCS_SAE_MAX_PARAMS 5

struct dcs_sae {
    dcs_sae_config c; /* d_out filled in (d_in for an SAE)         */
    dcs_backend *be;  /* its own CPU backend: GEMMs and the pool   */
    dcs_err err;
    int n_params;
    int64_t n[DCS_SAE_MAX_PARAMS];
    /* [what][param]: DCS_SAE_PARAM, _GRAD, _MOM, _VAR (host memory) */
    float *t[4][DCS_SAE_MAX_PARAMS];
    /* scratch for `cap` rows, grown on demand */
    int cap;
    float *xin;   /* [cap, d_in]  x - b_dec (apply_b_dec_to_input)     */
    float *pre;   /* [cap, F]     pre-activations                      */
    float *acts;  /* [cap, F]     feature activations                  */
    float *recon; /* [cap, d_out] reconstruction, then dL/drecon       */
    float *dacts; /* [cap, F]     dL/dacts, then dL/dpre               */
    double *row;  /* [cap, 3]     per-row loss, sparsity, L0           */
    int *kept;    /* [cap, k]     TopK: the kept features of each row  */
    /* BatchTopK: the smallest activation the last dcs_sae_grad kept (< 0:
     * none kept, or no grad since the last step) */
    float batch_min;
};

/* BatchTopK's selection (batchtopk.c): acts [n] = pre where among the K
 * largest positive entries of pre [n] (ties to the lower index), else 0;
 * scratch [n]. Returns the smallest kept value, or -1 when none is kept. */
/* TopK's sparse products (topk_sparse.c), after encode: recon = acts @
 * W_dec (no b_dec); from dR = dL/drecon in s->recon, the gradients of
 * W_dec, W_enc and b_enc (dpre at the kept slots, [N, k], left in
 * s->dacts), and fired [F] (may be NULL) += the rows where each fired. */
void dcs_sae_topk_decode(dcs_sae *s, int N);
void dcs_sae_topk_backward(dcs_sae *s, const float *xin, int N, int64_t *fired);

float dcs_batch_topk(const float *pre, long long n, long long K, float *scratch, float *acts);

#endif /* DCS_FEATURES_H */
