/*
 * backward.h -- ops of the training / attribution graph with their
 * backwards (backward.c). Host float32 arrays; backwards accumulate (+=).
 */
#ifndef DCS_BACKWARD_H
#define DCS_BACKWARD_H

#include <stddef.h>

void dcs_layernorm_fw(float *out, float *mean, float *rstd, const float *x, const float *w, const float *b,
                      int M, int D, float eps);
void dcs_layernorm_bw(float *dx, float *dw, float *db, const float *dy, const float *x, const float *mean,
                      const float *rstd, const float *w, int M, int D);
/* its two halves, for a split over threads: dx of rows [m_from, m_to);
 * dw, db of columns [i_from, i_to), summed over the M rows in row order */
void dcs_layernorm_bw_rows(float *dx, const float *dy, const float *x, const float *mean, const float *rstd,
                           const float *w, int m_from, int m_to, int D);
void dcs_layernorm_bw_params(float *dw, float *db, const float *dy, const float *x, const float *mean,
                             const float *rstd, int M, int D, int i_from, int i_to);
void dcs_rmsnorm_fw(float *x, float *rstd, int rows, int width, const float *scale, float eps);
void dcs_rmsnorm_bw(float *dx, float *dscale, const float *dy, const float *x_raw, const float *rstd,
                    int rows, int width, const float *scale);
void dcs_rotary_table(float *cs, int T, int rot, float base);
void dcs_rotary_apply(float *x, const float *cs, int M, int T, int N, int Dh, int rot, int inverse);
void dcs_tanh_bw(float *dx, const float *dy, const float *y, size_t n);
void dcs_softmax_fw(float *x, long long rows_from, long long rows_to, int T, int S, int window);
void dcs_softmax_bw(float *dA, const float *dP, const float *P, long long rows_from, long long rows_to, int T,
                    int S, int window);
void dcs_compose_pair_bw(const float *a, const float *g, float *da, long long stride, int N, int R,
                         const float *qw1, const float *qw2, const float *kw1, const float *kw2,
                         const float *qdd, const float *kdd, float *dqw1, float *dqw2, float *dkw1,
                         float *dkw2, float *dqdd, float *dkdd, unsigned on);

void dcs_compose_row_fw(const float *a, float *out, long long TT, int N, int R, int T, int s0, int s1,
                        const float *qw1, const float *qw2, const float *kw1T, const float *kw2T,
                        const float *qdd, const float *kddT, float *tmp);
void dcs_compose_row_bw(const float *a, const float *g, float *da, long long TT, int N, int R, int T, int s0,
                        int s1, const float *qw1, const float *qw2, const float *kw1T, const float *kw2T,
                        const float *qdd, const float *kddT, float *dqw1, float *dqw2, float *dkw1T,
                        float *dkw2T, float *dqdd, float *dkddT, unsigned on, float *tmp);
#endif
