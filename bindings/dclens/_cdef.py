"""The C declarations of engine/include/dclens.h that Python uses (cffi cdef).

Kept in one place; tests/api/test_cdef.py checks it against the header.
"""

CDEF = r"""
typedef enum {
    DCS_OK = 0, DCS_ERR_IO = 1, DCS_ERR_FORMAT = 2, DCS_ERR_CONFIG = 3,
    DCS_ERR_TENSOR = 4, DCS_ERR_NOMEM = 5, DCS_ERR_ARG = 6, DCS_ERR_HOOK = 7,
    DCS_ERR_UNSUPPORTED = 8, DCS_ERR_BACKEND = 9, DCS_ERR_NONFINITE = 10,
    DCS_ERR_CANCELLED = 11
} dcs_status;
const char *dcs_status_name(dcs_status s);

typedef struct dcs_model dcs_model;
typedef struct {
    int model_type; int n_layer; int d_model; int n_head; int head_dim; int d_ff;
    int vocab; int rotary_dim; float rope_base; float norm_eps; int parallel_residual;
    int qk_norm; int linear_bias; int use_dcmha; int query_wise; int dyn_rank;
    int dyn_hidden; int dyn_slots; int window_size; int tie_embeddings;
    int use_sw; int compose_groups; int moh; int moh_shared; int moh_topk; int key_wise;
    int mgate_dim; int official_notes;
} dcs_config;
typedef struct { int device; int cuda_device; int n_threads; int dtype; } dcs_load_options;

dcs_status dcs_load(const char *dir, const dcs_load_options *opts, dcs_model **out,
                    char *err, size_t errlen);
void dcs_free(dcs_model *m);
const dcs_config *dcs_model_config(const dcs_model *m);
const char *dcs_errmsg(const dcs_model *m);
int dcs_layer_is_local(const dcs_model *m, int layer);
enum { DCS_NORM_LAYER = 0, DCS_NORM_RMS = 1 };
enum { DCS_MLP_GELU = 0, DCS_MLP_SWIGLU = 1 };
typedef struct {
    int norm; int parallel_residual; int mlp; int mlp_gate; int window; int qk_norm; int moh;
    int dcmha; int slots; int slot[2][2]; int groups; int static_branch; int row_compose; int fused;
} dcs_layer_plan;
const dcs_layer_plan *dcs_layer_plan_of(const dcs_model *m, int layer);
int dcs_model_device(const dcs_model *m);
int dcs_model_weight_dtype(const dcs_model *m);
dcs_status dcs_model_set_attention_rows(dcs_model *m, int rows);
int dcs_model_attention_rows(const dcs_model *m);
const char *dcs_load_warnings(const dcs_model *m);
int dcs_cuda_available(char *why, size_t whylen);
enum { DCS_PART_GEMM = 0, DCS_PART_GEMM_W = 1, DCS_PART_ATTN = 2 };
int64_t dcs_cpu_partition(int op, const int *shape, int n_shape, int64_t *cost, int64_t cap);
const char *dcs_blas_core(void);
const char *dcs_blas_library(void);
const char *dcs_blas_config(void);
dcs_status dcs_weight_shape(dcs_model *m, const char *name, int64_t shape[5], int *ndim);
dcs_status dcs_weight_read(dcs_model *m, const char *name, float *out, size_t n_floats);
int dcs_weight_count(const dcs_model *m);
const char *dcs_weight_name(const dcs_model *m, int i);

#define DCS_HP_COUNT ...
const char *dcs_hook_point_name(int point);
int dcs_hook_point_is_layered(int point);
const char *dcs_hook_point_layout(int point);
const char *dcs_hook_point_source(int point);
int dcs_hook_point_map(int point);
int dcs_hook_point_needs(int point);
int dcs_hook_exists(const dcs_model *m, int point);
dcs_status dcs_hook_parse(dcs_model *m, const char *name, int *point, int *layer);
int dcs_hook_shape(const dcs_model *m, int point, int B, int T, int64_t shape[6]);
typedef int (*dcs_hook_fn)(void *user, int point, int layer, float *data,
                           const int64_t *shape, int ndim);
typedef struct { const uint8_t *want; dcs_hook_fn fn; void *user; } dcs_hooks;
void dcs_set_hook_error(dcs_model *m, const char *msg);
extern "Python" int _dcs_py_hook(void *user, int point, int layer, float *data,
                                 const int64_t *shape, int ndim);

dcs_status dcs_forward(dcs_model *m, const int32_t *tokens, int B, int T,
                       float *logits, const dcs_hooks *hooks);
dcs_status dcs_forward_at(dcs_model *m, const int32_t *tokens, int B, int T,
                          const int32_t *positions, int n_pos, float *logits,
                          const dcs_hooks *hooks);
void dcs_cancel(dcs_model *m, int cancel);
void dcs_after_fork(dcs_model *m);
void dcs_forward_memory(const dcs_model *m, uint64_t *peak_bytes, uint64_t *total_bytes);
dcs_status dcs_device_memory(dcs_model *m, uint64_t *free_bytes, uint64_t *total_bytes);
void dcs_model_trim(dcs_model *m);

typedef struct dcs_decoder dcs_decoder;
dcs_status dcs_decoder_new(dcs_model *m, dcs_decoder **out);
void dcs_decoder_free(dcs_decoder *d);
dcs_status dcs_decoder_step(dcs_decoder *d, const int32_t *tokens, int n, float *logits,
                            const dcs_hooks *hooks);
int dcs_decoder_pos(const dcs_decoder *d);
int dcs_decoder_layer_keys(const dcs_decoder *d, int layer);

typedef struct { const float *data; int rows, cols; const char *title; int mask_window;
                 int own_colormap; int colormap; int own_range; float vmin, vmax; } dcs_panel;
typedef struct {
    const dcs_panel *panels; int n_panels; int grid_cols; int colormap; int auto_range;
    float vmin, vmax; const char *const *row_labels; const char *const *col_labels;
    int mask_upper; int mask_window; int cell_px; const char *title; int axis_titles; int panel_scales;
} dcs_heatmap_spec;
dcs_status dcs_heatmap_png(const dcs_heatmap_spec *spec, uint8_t **png,
                           size_t *png_len, char *err, size_t errlen);
dcs_status dcs_heatmap_geometry(const dcs_heatmap_spec *spec, int panel, int t, int s,
                                int *width, int *height, int *x, int *y, int *cell,
                                char *err, size_t errlen);
void dcs_colormap_rgb(int colormap, float x, float vmin, float vmax, uint8_t rgb[3]);
void dcs_buffer_free(void *p);

typedef struct dcs_tape dcs_tape;
typedef struct { int point; int layer; const float *data; } dcs_hook_override;
typedef struct { int point; int layer; float *grad; } dcs_hook_grad;
dcs_status dcs_tape_new(dcs_model *m, int B, int T, dcs_tape **out);
dcs_status dcs_tape_new_budget(dcs_model *m, int B, int T, uint64_t max_bytes, dcs_tape **out);
dcs_status dcs_tape_new_from(dcs_model *m, int B, int T, int first, uint64_t max_bytes, dcs_tape **out);
dcs_status dcs_tape_forward_from(dcs_tape *tp, const int32_t *tokens, const float *resid,
                                 const dcs_hook_override *ov, int n_ov, float *logits);
dcs_status dcs_tape_plan(dcs_model *m, int B, int T, int first, int recompute, const int *points,
                         int n_points, uint64_t *bytes);
void dcs_tape_memory(const dcs_tape *tp, uint64_t *tape_bytes, uint64_t *pass_peak, int *recompute);
dcs_status dcs_tape_reshape(dcs_tape *tp, int B, int T);
void dcs_tape_free(dcs_tape *tp);
dcs_status dcs_tape_forward(dcs_tape *tp, const int32_t *tokens, const dcs_hook_override *ov,
                            int n_ov, float *logits);
typedef struct { int point; int layer; float *data; } dcs_hook_read;
dcs_status dcs_tape_forward_read(dcs_tape *tp, const int32_t *tokens, const dcs_hook_override *ov, int n_ov,
                                 const dcs_hook_read *reads, int n_reads, float *logits);
dcs_status dcs_tape_loss(dcs_tape *tp, const int32_t *targets, double *loss, int *count);
dcs_status dcs_tape_backward(dcs_tape *tp, const float *dlogits, float *param_grads,
                             const dcs_hook_grad *g, int n_g);
typedef struct { int index; float *grad; } dcs_param_grad;
dcs_status dcs_tape_backward_stage(dcs_tape *tp, const float *dlogits, int resume, int stop,
                                   const dcs_hook_grad *g, int n_g);
dcs_status dcs_tape_backward_params(dcs_tape *tp, const float *dlogits, const dcs_param_grad *pg, int n_pg,
                                    const dcs_hook_grad *g, int n_g);
int dcs_param_count(const dcs_model *m);
int64_t dcs_param_total(const dcs_model *m);
dcs_status dcs_param_info(const dcs_model *m, int i, const char **name, int64_t *offset,
                          int64_t *n, int *decay);
dcs_status dcs_model_make_trainable(dcs_model *m);
typedef struct { float lr, beta1, beta2, eps, weight_decay; } dcs_adamw;
dcs_status dcs_adamw_step(dcs_model *m, const float *grads, float *mom, float *var, int step,
                          const dcs_adamw *h);
typedef struct dcs_sae dcs_sae;
enum { DCS_SAE_RELU = 0, DCS_SAE_TOPK = 1, DCS_SAE_JUMPRELU = 2, DCS_SAE_BATCHTOPK = 3 };
enum { DCS_SAE_PARAM = 0, DCS_SAE_GRAD = 1, DCS_SAE_MOM = 2, DCS_SAE_VAR = 3 };
typedef struct {
    int d_in; int d_out; int d_sae; int arch; int k; int apply_b_dec_to_input;
    int normalize_decoder; float sparsity_coef; float bandwidth; int n_threads;
} dcs_sae_config;
typedef struct { double loss, mse, sparsity, l0; } dcs_sae_stats;
dcs_status dcs_sae_new(const dcs_sae_config *c, dcs_sae **out, char *err, size_t errlen);
void dcs_sae_free(dcs_sae *s);
const char *dcs_sae_errmsg(const dcs_sae *s);
int dcs_sae_param_count(const dcs_sae *s);
dcs_status dcs_sae_param_info(const dcs_sae *s, int i, const char **name, int64_t *n);
dcs_status dcs_sae_get(dcs_sae *s, int what, int i, float *out, int64_t n);
dcs_status dcs_sae_set(dcs_sae *s, int what, int i, const float *in, int64_t n);
dcs_status dcs_sae_forward(dcs_sae *s, const float *x, int N, float *pre, float *acts, float *recon);
dcs_status dcs_sae_grad(dcs_sae *s, const float *x, const float *target, int N, dcs_sae_stats *st,
                        int64_t *fired);
dcs_status dcs_sae_adamw(dcs_sae *s, int step, const dcs_adamw *h);
dcs_status dcs_sae_resample(dcs_sae *s, const float *x, const float *target, int N, const int *dead,
                            int n_dead);
"""
