/*
 * resample.c -- dead-feature resampling (Anthropic, "Towards
 * Monosemanticity", 2023, in its deterministic form; dclens.h,
 * dcs_sae_resample; docs/features.md): a feature that has not fired is
 * re-initialised from a row the dictionary reconstructs worst.
 */
#include "dcs_features.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define ENC_SCALE 0.2 /* a new encoder column's norm, relative to the live ones' mean */

typedef struct {
    double err;
    int row;
} row_err;

/* Worst first; ties to the lower row. */
static int worse_first(const void *a, const void *b) {
    const row_err *x = a, *y = b;
    if (x->err != y->err) return x->err > y->err ? -1 : 1;
    return (x->row > y->row) - (x->row < y->row);
}

static dcs_status check_args(dcs_sae *s, const float *x, const float *target, int N, const int *dead,
                             int n_dead) {
    const int F = s->c.d_sae;
    if (N < 1)
        return dcs_seterr(&s->err, DCS_ERR_ARG,
                          "sae resample: empty batch (N = %d rows): no rows to resample from", N);
    if (!x) return dcs_seterr(&s->err, DCS_ERR_ARG, "sae resample: x is NULL");
    if (!target && s->c.d_out != s->c.d_in)
        return dcs_seterr(&s->err, DCS_ERR_ARG,
                          "sae resample: a transcoder (d_out %d != d_in %d) needs a target", s->c.d_out,
                          s->c.d_in);
    if (n_dead < 0 || (n_dead > 0 && !dead))
        return dcs_seterr(&s->err, DCS_ERR_ARG, "sae resample: dead must hold n_dead (%d >= 0) features",
                          n_dead);
    for (int j = 0; j < n_dead; j++)
        if (dead[j] < 0 || dead[j] >= F)
            return dcs_seterr(&s->err, DCS_ERR_ARG, "sae resample: dead[%d] = %d is not in 0..%d", j, dead[j],
                              F - 1);
    if (target)
        for (long long i = 0; i < (long long)N * s->c.d_out; i++)
            if (!isfinite(target[i]))
                return dcs_seterr(&s->err, DCS_ERR_NONFINITE,
                                  "sae resample: target row %lld holds NaN or inf", i / s->c.d_out);
    return DCS_OK;
}

/* v [n] scaled to norm `to` (a zero vector stays 0). */
static void scale_to(float *v, int n, int stride, double to) {
    double n2 = 0.0;
    for (int j = 0; j < n; j++) n2 += (double)v[(size_t)j * stride] * v[(size_t)j * stride];
    const double f = n2 > 0.0 ? to / sqrt(n2) : 0.0;
    for (int j = 0; j < n; j++) v[(size_t)j * stride] = (float)(v[(size_t)j * stride] * f);
}

/* The rows of x (target) by reconstruction error, worst first, into order [N]. */
static dcs_status rank_rows(dcs_sae *s, const float *x, const float *target, int N, row_err *order) {
    const int d = s->c.d_out;
    float *recon = malloc((size_t)N * (size_t)d * sizeof(float));
    if (!recon) return dcs_seterr(&s->err, DCS_ERR_NOMEM, "sae resample: out of memory for %d rows", N);
    dcs_status st = dcs_sae_forward(s, x, N, NULL, NULL, recon); /* x checked there */
    for (int r = 0; r < N && st == DCS_OK; r++) {
        double e = 0.0;
        for (int j = 0; j < d; j++) {
            const double diff = (double)target[(size_t)r * d + j] - recon[(size_t)r * d + j];
            e += diff * diff;
        }
        order[r].err = e;
        order[r].row = r;
    }
    free(recon);
    if (st == DCS_OK) qsort(order, (size_t)N, sizeof *order, worse_first);
    return st;
}

dcs_status dcs_sae_resample(dcs_sae *s, const float *x, const float *target, int N, const int *dead,
                            int n_dead) {
    if (!s) return DCS_ERR_ARG;
    dcs_status st = check_args(s, x, target, N, dead, n_dead);
    if (st) return st;
    if (!target) target = x;
    const int F = s->c.d_sae, din = s->c.d_in, dout = s->c.d_out;
    row_err *order = malloc((size_t)N * sizeof *order);
    unsigned char *is_dead = calloc((size_t)F, 1);
    if (!order || !is_dead) {
        free(order);
        free(is_dead);
        return dcs_seterr(&s->err, DCS_ERR_NOMEM, "sae resample: out of memory");
    }
    st = rank_rows(s, x, target, N, order);
    float *const *p = s->t[DCS_SAE_PARAM];
    for (int j = 0; j < n_dead; j++) is_dead[dead[j]] = 1;
    double live = 0.0; /* the live features' mean W_enc column norm */
    int n_live = 0;
    for (int f = 0; f < F && st == DCS_OK; f++) {
        if (is_dead[f]) continue;
        double n2 = 0.0;
        for (int i = 0; i < din; i++)
            n2 += (double)p[DCS_SAE_W_ENC][(size_t)i * F + f] * p[DCS_SAE_W_ENC][(size_t)i * F + f];
        live += sqrt(n2);
        n_live++;
    }
    const double enc_norm = ENC_SCALE * (n_live ? live / n_live : 1.0);
    const float *bdec = p[DCS_SAE_B_DEC];
    for (int j = 0; j < n_dead && st == DCS_OK; j++) {
        const int f = dead[j], r = order[j % N].row;
        float *wd = p[DCS_SAE_W_DEC] + (size_t)f * dout, *we = p[DCS_SAE_W_ENC] + f;
        for (int i = 0; i < dout; i++) wd[i] = target[(size_t)r * dout + i] - bdec[i];
        scale_to(wd, dout, 1, 1.0);
        for (int i = 0; i < din; i++)
            we[(size_t)i * F] = x[(size_t)r * din + i] - (s->c.apply_b_dec_to_input ? bdec[i] : 0.0f);
        scale_to(we, din, F, enc_norm);
        p[DCS_SAE_B_ENC][f] = 0.0f;
        for (int w = DCS_SAE_MOM; w <= DCS_SAE_VAR; w++) {
            memset(s->t[w][DCS_SAE_W_DEC] + (size_t)f * dout, 0, (size_t)dout * sizeof(float));
            for (int i = 0; i < din; i++) s->t[w][DCS_SAE_W_ENC][(size_t)i * F + f] = 0.0f;
            s->t[w][DCS_SAE_B_ENC][f] = 0.0f;
            if (s->c.arch == DCS_SAE_JUMPRELU) s->t[w][DCS_SAE_LOG_THR][f] = 0.0f;
        }
    }
    free(order);
    free(is_dead);
    return st;
}
