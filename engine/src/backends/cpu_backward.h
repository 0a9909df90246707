/*
 * cpu_backward.h -- the CPU backend's backward operations (cpu_backward.c),
 * the entries of cpu.c's ops table after "backward" in dcs_backend_ops.
 */
#ifndef DCS_CPU_BACKWARD_H
#define DCS_CPU_BACKWARD_H

#include "dcs_backend.h"

void cpu_zero(dcs_backend *be, void *p, size_t bytes); /* cpu.c: on the pool when large */
void cpu_gelu_bw(dcs_backend *be, float *dx, const float *dy, const float *x, size_t n);
void cpu_gelu_bw_sum(dcs_backend *be, float *dx, float *db, const float *dy, const float *x, int M, int N,
                     int x_is_grad);
void cpu_tanh_bw(dcs_backend *be, float *dx, const float *y, size_t n);
void cpu_softmax_bw(dcs_backend *be, float *dA, const float *dP, const float *P, int BN, int T, int S,
                    int window);
void cpu_softmax_rows_bw(dcs_backend *be, float *dg, const float *g, int M, int E);
void cpu_layernorm_bw(dcs_backend *be, float *dx, float *dw, float *db, const float *dy, const float *x,
                      const float *w, int M, int D, float eps);
int cpu_layernorm2_bw(dcs_backend *be, float *dx, const dcs_norm_bw_side *first,
                      const dcs_norm_bw_side *second, const float *stats, const float *x, int M, int D,
                      float eps);
void cpu_norm_bw_fanout(dcs_backend *be, float *dx, const float *dy, const float *x, const float *w, int M,
                        int G, int D, float eps, int rms);
void cpu_rmsnorm_bw(dcs_backend *be, float *dx, float *dscale, const float *dy, const float *x,
                    const float *scale, int rows, int width, float eps);
void cpu_rotary_bw(dcs_backend *be, float *x, int M, int T, int N, int Dh, int rot, float base);
int cpu_qkv_join_bw(dcs_backend *be, float *dqkv, const float *dq, const float *dk, const float *dv, int M,
                    int T, int N, int Dh, int rot, float base);
void cpu_col_sum(dcs_backend *be, float *db, const float *dy, int M, int N);
void cpu_embed_bw(dcs_backend *be, float *dtable, const float *dx, const int32_t *tokens_host, int M, int D);
void cpu_xent_bw(dcs_backend *be, float *dlogits, double *loss_host, const float *logits,
                 const int32_t *targets_host, int M, int V, float inv);
void cpu_compose_bw(dcs_backend *be, const dcs_compose_bw_args *a);
void cpu_compose_softmax_bw(dcs_backend *be, const dcs_compose_bw_args *post, const dcs_compose_bw_args *pre);
int cpu_attention_bw(dcs_backend *be, const dcs_attn_bw_args *a);
void cpu_head_gate_bw(dcs_backend *be, float *dz, float *dgate, const float *zpre, const float *gate, int M,
                      int N, int Dh);
void cpu_moh_route_bw(dcs_backend *be, float *dlg, float *ds1, float *ds0, const float *dg, const float *lg,
                      const float *s1, const float *s0, int M, int N, int hs, int k);
void cpu_swiglu_bw(dcs_backend *be, float *du, float *du3, float *dgate, float *dp, const float *u,
                   const float *u3, const float *gate, int M, int F, int E);
int cpu_mha_bw(dcs_backend *be, const dcs_mha_bw_args *a);
/* ops->bw_scratch of the CPU backend with n_threads threads */
uint64_t cpu_bw_scratch_bytes(const dcs_bw_shape *s, int n_threads);

#endif
