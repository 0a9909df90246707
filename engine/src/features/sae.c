/*
 * sae.c -- sparse dictionaries (SAE, transcoder) on a hook's activations:
 * the forward, the backward of the loss and AdamW over the dictionary's
 * parameters (dclens.h, "sparse dictionaries"; docs/features.md).
 *
 * The products run on the backend's sgemm (its ops table), the per-element
 * steps on its pool, row by row or by blocks of columns: every reduction
 * adds in index order, so a result does not depend on the thread count and
 * a resumed training gives the same bits.
 */
#include "dcs_features.h"
#include "dcs_math.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define COL_BLOCK 64 /* columns per work item of the column reductions */

static const char *const PARAM_NAMES[DCS_SAE_MAX_PARAMS] = {"W_enc", "b_enc", "W_dec", "b_dec",
                                                            "log_threshold"};

/* Parameter i's name: BatchTopK's fifth is its one threshold. */
static const char *param_name(const dcs_sae *s, int i) {
    return i == DCS_SAE_LOG_THR && s->c.arch == DCS_SAE_BATCHTOPK ? "threshold" : PARAM_NAMES[i];
}

static void free_scratch(dcs_sae *s) {
    free(s->xin);
    free(s->pre);
    free(s->acts);
    free(s->recon);
    free(s->dacts);
    free(s->row);
    free(s->kept);
    s->xin = s->pre = s->acts = s->recon = s->dacts = NULL;
    s->row = NULL;
    s->kept = NULL;
    s->cap = 0;
}

void dcs_sae_free(dcs_sae *s) {
    if (!s) return;
    for (int w = 0; w < 4; w++)
        for (int i = 0; i < DCS_SAE_MAX_PARAMS; i++) free(s->t[w][i]);
    free_scratch(s);
    if (s->be) s->be->ops->destroy(s->be);
    free(s);
}

const char *dcs_sae_errmsg(const dcs_sae *s) { return s ? s->err.msg : "no SAE"; }

int dcs_sae_param_count(const dcs_sae *s) { return s ? s->n_params : 0; }

static dcs_status check_config(const dcs_sae_config *c, dcs_err *e) {
    if (!c) return dcs_seterr(e, DCS_ERR_ARG, "sae: config is NULL");
    if (c->d_in < 1) return dcs_seterr(e, DCS_ERR_ARG, "sae: d_in must be >= 1, not %d", c->d_in);
    if (c->d_out < 0) return dcs_seterr(e, DCS_ERR_ARG, "sae: d_out must be >= 0, not %d", c->d_out);
    if (c->d_sae < 1) return dcs_seterr(e, DCS_ERR_ARG, "sae: d_sae must be >= 1, not %d", c->d_sae);
    if (c->arch < DCS_SAE_RELU || c->arch > DCS_SAE_BATCHTOPK)
        return dcs_seterr(e, DCS_ERR_ARG,
                          "sae: arch must be DCS_SAE_RELU, _TOPK, _JUMPRELU or _BATCHTOPK, not %d", c->arch);
    if ((c->arch == DCS_SAE_TOPK || c->arch == DCS_SAE_BATCHTOPK) && (c->k < 1 || c->k > c->d_sae))
        return dcs_seterr(e, DCS_ERR_ARG, "sae: k must be in 1..d_sae (%d), not %d", c->d_sae, c->k);
    if (!(c->sparsity_coef >= 0.0f) || !isfinite(c->sparsity_coef))
        return dcs_seterr(e, DCS_ERR_ARG, "sae: sparsity_coef must be finite and >= 0");
    if (c->arch == DCS_SAE_JUMPRELU && (!(c->bandwidth > 0.0f) || !isfinite(c->bandwidth)))
        return dcs_seterr(e, DCS_ERR_ARG, "sae: bandwidth must be finite and > 0 for JumpReLU");
    if (c->apply_b_dec_to_input && c->d_out != 0 && c->d_out != c->d_in)
        return dcs_seterr(e, DCS_ERR_ARG,
                          "sae: apply_b_dec_to_input needs d_out == d_in (a transcoder's b_dec is of "
                          "its output)");
    const int d_out = c->d_out ? c->d_out : c->d_in;
    uint64_t n1, n2;
    if (!dcs_mul_ok((uint64_t)c->d_in, (uint64_t)c->d_sae, &n1) ||
        !dcs_mul_ok((uint64_t)d_out, (uint64_t)c->d_sae, &n2) || n1 > (1ull << 34) || n2 > (1ull << 34))
        return dcs_seterr(e, DCS_ERR_NOMEM, "sae: d_in x d_sae too large");
    return DCS_OK;
}

dcs_status dcs_sae_new(const dcs_sae_config *c, dcs_sae **out, char *err, size_t errlen) {
    dcs_err e = {DCS_OK, ""};
    if (out) *out = NULL;
    dcs_status st = out ? check_config(c, &e) : dcs_seterr(&e, DCS_ERR_ARG, "sae: out is NULL");
    dcs_sae *s = NULL;
    if (st == DCS_OK && !(s = calloc(1, sizeof *s))) st = dcs_seterr(&e, DCS_ERR_NOMEM, "sae: out of memory");
    if (st == DCS_OK) {
        s->c = *c;
        if (!s->c.d_out) s->c.d_out = c->d_in;
        if (!(s->be = dcs_backend_cpu_create(c->n_threads, &e))) st = e.code ? e.code : DCS_ERR_NOMEM;
    }
    if (st == DCS_OK) {
        const int64_t F = c->d_sae, din = c->d_in, dout = s->c.d_out;
        s->n_params = c->arch == DCS_SAE_JUMPRELU || c->arch == DCS_SAE_BATCHTOPK ? 5 : 4;
        s->batch_min = -1.0f;
        const int64_t n[DCS_SAE_MAX_PARAMS] = {din * F, F, F * dout, dout,
                                               c->arch == DCS_SAE_BATCHTOPK ? 1 : F};
        for (int i = 0; i < s->n_params && st == DCS_OK; i++) {
            s->n[i] = n[i];
            for (int w = 0; w < 4; w++)
                if (!(s->t[w][i] = calloc((size_t)n[i], sizeof(float)))) {
                    st = dcs_seterr(&e, DCS_ERR_NOMEM, "sae: out of memory for parameter %d", i);
                    break;
                }
        }
    }
    if (st != DCS_OK) {
        dcs_sae_free(s);
        if (err && errlen) snprintf(err, errlen, "%s", e.msg);
        return st;
    }
    *out = s;
    return DCS_OK;
}

dcs_status dcs_sae_param_info(const dcs_sae *s, int i, const char **name, int64_t *n) {
    if (!s || i < 0 || i >= s->n_params) return DCS_ERR_ARG;
    if (name) *name = param_name(s, i);
    if (n) *n = s->n[i];
    return DCS_OK;
}

static dcs_status check_slot(dcs_sae *s, int what, int i, const void *p, int64_t n) {
    if (what < DCS_SAE_PARAM || what > DCS_SAE_VAR)
        return dcs_seterr(&s->err, DCS_ERR_ARG, "sae: what must be DCS_SAE_PARAM.._VAR, not %d", what);
    if (i < 0 || i >= s->n_params)
        return dcs_seterr(&s->err, DCS_ERR_ARG, "sae: parameter index %d not in 0..%d", i, s->n_params - 1);
    if (!p) return dcs_seterr(&s->err, DCS_ERR_ARG, "sae: %s: the array is NULL", param_name(s, i));
    if (n != s->n[i])
        return dcs_seterr(&s->err, DCS_ERR_ARG, "sae: %s has %lld elements, not %lld", param_name(s, i),
                          (long long)s->n[i], (long long)n);
    return DCS_OK;
}

dcs_status dcs_sae_get(dcs_sae *s, int what, int i, float *out, int64_t n) {
    if (!s) return DCS_ERR_ARG;
    dcs_status st = check_slot(s, what, i, out, n);
    if (st) return st;
    memcpy(out, s->t[what][i], (size_t)n * sizeof(float));
    return DCS_OK;
}

dcs_status dcs_sae_set(dcs_sae *s, int what, int i, const float *in, int64_t n) {
    if (!s) return DCS_ERR_ARG;
    dcs_status st = check_slot(s, what, i, in, n);
    if (st) return st;
    for (int64_t j = 0; j < n; j++)
        if (!isfinite(in[j]))
            return dcs_seterr(&s->err, DCS_ERR_NONFINITE, "sae: %s: element %lld is not finite",
                              param_name(s, i), (long long)j);
    memcpy(s->t[what][i], in, (size_t)n * sizeof(float));
    return DCS_OK;
}

/* Scratch for N rows. */
static dcs_status reserve(dcs_sae *s, int N) {
    if (N <= s->cap) return DCS_OK;
    free_scratch(s);
    const size_t n = (size_t)N, F = (size_t)s->c.d_sae, din = (size_t)s->c.d_in, dout = (size_t)s->c.d_out;
    const size_t k = s->c.arch == DCS_SAE_TOPK ? (size_t)s->c.k : 1;
    s->xin = malloc(n * din * sizeof(float));
    s->pre = malloc(n * F * sizeof(float));
    s->acts = malloc(n * F * sizeof(float));
    s->recon = malloc(n * dout * sizeof(float));
    s->dacts = malloc(n * F * sizeof(float));
    s->row = malloc(n * 3 * sizeof(double));
    s->kept = malloc(n * k * sizeof(int));
    if (!s->xin || !s->pre || !s->acts || !s->recon || !s->dacts || !s->row || !s->kept) {
        free_scratch(s);
        return dcs_seterr(&s->err, DCS_ERR_NOMEM, "sae: out of memory for a batch of %d rows", N);
    }
    s->cap = N;
    return DCS_OK;
}

/* The first row of a [N, d] array holding a NaN or an infinity, or -1. */
static long long first_nonfinite_row(const float *a, int N, int d) {
    for (long long r = 0; r < N; r++)
        for (int j = 0; j < d; j++)
            if (!isfinite(a[r * d + j])) return r;
    return -1;
}

/* ------------------------------------------------------------ per-row steps */

typedef struct {
    dcs_sae *s;
    const float *x, *target;
    int train; /* BatchTopK: the batch's selection (else its threshold) */
} rows_arg;

/* TopK order: a before b when larger, ties to the lower index. */
static int before(float va, int ia, float vb, int ib) { return va > vb || (va == vb && ia < ib); }

/* The k best of v [F] (ReLU'd) into heap [k]: a min-heap by `before`
 * (its root the worst kept), then sorted best first. */
static void topk_row(const float *v, int F, int k, int *heap) {
    for (int f = 0; f < k; f++) { /* the first k, sifted up */
        const float x = dcs_relu(v[f]);
        int i = f;
        while (i > 0) {
            const int p = (i - 1) / 2, hp = heap[p];
            const float vp = dcs_relu(v[hp]);
            if (!before(vp, hp, x, f)) break;
            heap[i] = hp;
            i = p;
        }
        heap[i] = f;
    }
    float vr = dcs_relu(v[heap[0]]); /* the worst kept, >= 0 */
    for (int f = k; f < F; f++) {
        /* every kept index is below f: f wins by a larger value alone (a ReLU'd 0 never) */
        if (!(v[f] > vr)) continue;
        const float x = v[f];
        int i = 0; /* replace the root, sift down */
        for (;;) {
            int c = 2 * i + 1;
            if (c >= k) break;
            if (c + 1 < k) {
                const float v1 = dcs_relu(v[heap[c]]);
                const float v2 = dcs_relu(v[heap[c + 1]]);
                if (before(v1, heap[c], v2, heap[c + 1])) c++; /* the worse child */
            }
            const float vc = dcs_relu(v[heap[c]]);
            if (!before(x, f, vc, heap[c])) break;
            heap[i] = heap[c];
            i = c;
        }
        heap[i] = f;
        vr = dcs_relu(v[heap[0]]);
    }
}

/* pre += b_enc; acts = the activation of pre (rows [b, e)). */
static void act_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const rows_arg *a = arg;
    dcs_sae *s = a->s;
    const int F = s->c.d_sae, k = s->c.k;
    const float *benc = s->t[DCS_SAE_PARAM][DCS_SAE_B_ENC];
    const float *lthr = s->c.arch == DCS_SAE_JUMPRELU ? s->t[DCS_SAE_PARAM][DCS_SAE_LOG_THR] : NULL;
    for (long long r = b; r < e; r++) {
        float *pre = s->pre + r * F, *acts = s->acts + r * F;
        for (int f = 0; f < F; f++) pre[f] += benc[f];
        if (s->c.arch == DCS_SAE_RELU) {
            for (int f = 0; f < F; f++) acts[f] = dcs_relu(pre[f]);
        } else if (s->c.arch == DCS_SAE_JUMPRELU) {
            for (int f = 0; f < F; f++) acts[f] = dcs_jumprelu(pre[f], expf(lthr[f]));
        } else if (s->c.arch == DCS_SAE_BATCHTOPK) {
            const float thr = s->t[DCS_SAE_PARAM][DCS_SAE_LOG_THR][0];
            if (!a->train) /* (training: the batch's selection, after every row) */
                for (int f = 0; f < F; f++) acts[f] = pre[f] > thr ? pre[f] : 0.0f;
        } else {
            int *kept = s->kept + r * k;
            topk_row(pre, F, k, kept);
            memset(acts, 0, (size_t)F * sizeof(float));
            for (int j = 0; j < k; j++) acts[kept[j]] = dcs_relu(pre[kept[j]]);
        }
    }
}

/* xin = x - b_dec (rows [b, e)). */
static void center_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const rows_arg *a = arg;
    const int d = a->s->c.d_in;
    const float *bdec = a->s->t[DCS_SAE_PARAM][DCS_SAE_B_DEC];
    for (long long r = b; r < e; r++)
        for (int j = 0; j < d; j++) a->s->xin[r * d + j] = a->x[r * d + j] - bdec[j];
}

/* recon += b_dec; the row's loss parts (double); then recon becomes
 * dL/drecon = 2 (recon - target) / N (rows [b, e)). */
typedef struct {
    dcs_sae *s;
    const float *target;
    int N, grad;
} loss_arg;
static void loss_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const loss_arg *a = arg;
    dcs_sae *s = a->s;
    const int d = s->c.d_out, F = s->c.d_sae;
    const float *bdec = s->t[DCS_SAE_PARAM][DCS_SAE_B_DEC];
    const float *lthr = s->c.arch == DCS_SAE_JUMPRELU ? s->t[DCS_SAE_PARAM][DCS_SAE_LOG_THR] : NULL;
    const float scale = 2.0f / (float)a->N;
    for (long long r = b; r < e; r++) {
        float *rec = s->recon + r * d;
        const float *t = a->target + r * d;
        double se = 0.0, sp = 0.0, l0 = 0.0;
        for (int j = 0; j < d; j++) {
            rec[j] += bdec[j];
            const float diff = rec[j] - t[j];
            se += (double)diff * diff;
            if (a->grad) rec[j] = scale * diff;
        }
        const float *acts = s->acts + r * F, *pre = s->pre + r * F;
        if (s->c.arch == DCS_SAE_TOPK) /* only the kept can be active */
            for (int j = 0; j < s->c.k; j++) l0 += acts[s->kept[r * s->c.k + j]] != 0.0f;
        else
            for (int f = 0; f < F; f++) {
                l0 += acts[f] != 0.0f;
                if (s->c.arch == DCS_SAE_RELU) sp += acts[f];
                if (lthr) sp += pre[f] > expf(lthr[f]);
            }
        s->row[3 * r] = se;
        s->row[3 * r + 1] = sp;
        s->row[3 * r + 2] = l0;
    }
}

/* dacts [N, F] -> dpre (in place), rows [b, e). */
static void dpre_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const loss_arg *a = arg;
    dcs_sae *s = a->s;
    const int F = s->c.d_sae;
    const float *lthr = s->c.arch == DCS_SAE_JUMPRELU ? s->t[DCS_SAE_PARAM][DCS_SAE_LOG_THR] : NULL;
    const float l1 = s->c.sparsity_coef / (float)a->N;
    for (long long r = b; r < e; r++) {
        float *g = s->dacts + r * F;
        const float *pre = s->pre + r * F, *acts = s->acts + r * F;
        if (s->c.arch == DCS_SAE_RELU) {
            for (int f = 0; f < F; f++) g[f] = pre[f] > 0.0f ? g[f] + l1 : 0.0f;
        } else if (lthr) { /* JumpReLU: d acts / d pre = H(pre - threshold) */
            for (int f = 0; f < F; f++) g[f] = pre[f] > expf(lthr[f]) ? g[f] : 0.0f;
        } else { /* TopK: the kept entries with pre > 0 (acts != 0 exactly there) */
            for (int f = 0; f < F; f++) g[f] = acts[f] != 0.0f ? g[f] : 0.0f;
        }
    }
}

/* ------------------------------------------------------------ column reductions */

/* Per block of COL_BLOCK columns, over all rows in index order:
 * out[c] (+)= sum_r sign * a[r, c], or (JumpReLU's threshold) the
 * pseudo-derivative's sum, or fired[c] += the rows with acts != 0. */
enum { COL_SUM = 0, COL_THR = 1, COL_FIRED = 2 };
typedef struct {
    dcs_sae *s;
    const float *a;
    float *out;
    int64_t *fired;
    int N, cols, op, add;
    float sign;
    const float *dacts; /* COL_THR: dL/dacts before the mask */
} col_arg;
static void col_blocks(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const col_arg *a = arg;
    dcs_sae *s = a->s;
    for (long long blk = b; blk < e; blk++) {
        const int c0 = (int)blk * COL_BLOCK, c1 = c0 + COL_BLOCK < a->cols ? c0 + COL_BLOCK : a->cols;
        if (a->op == COL_FIRED) {
            for (int r = 0; r < a->N; r++)
                for (int c = c0; c < c1; c++) a->fired[c] += s->acts[(size_t)r * a->cols + c] != 0.0f;
            continue;
        }
        double acc[COL_BLOCK] = {0};
        if (a->op == COL_SUM) {
            for (int r = 0; r < a->N; r++)
                for (int c = c0; c < c1; c++) acc[c - c0] += a->a[(size_t)r * a->cols + c];
        } else {
            /* the threshold's pseudo-derivative (dcs_math.h); the parameter is log theta */
            const float eps = s->c.bandwidth, l0 = s->c.sparsity_coef / (float)a->N;
            const float *lthr = s->t[DCS_SAE_PARAM][DCS_SAE_LOG_THR];
            for (int r = 0; r < a->N; r++)
                for (int c = c0; c < c1; c++) {
                    const size_t i = (size_t)r * a->cols + c;
                    acc[c - c0] += dcs_jumprelu_thr_grad(s->pre[i], expf(lthr[c]), eps, a->dacts[i], l0);
                }
            for (int c = c0; c < c1; c++) acc[c - c0] *= expf(lthr[c]);
        }
        for (int c = c0; c < c1; c++) a->out[c] = (a->add ? a->out[c] : 0.0f) + a->sign * (float)acc[c - c0];
    }
}

/* db_dec[i] -= W_enc[i, :] . db_enc (rows i in [b, e); in double, in index order). */
static void bdec_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    dcs_sae *s = arg;
    const int F = s->c.d_sae;
    const float *w = s->t[DCS_SAE_PARAM][DCS_SAE_W_ENC], *gb = s->t[DCS_SAE_GRAD][DCS_SAE_B_ENC];
    float *gd = s->t[DCS_SAE_GRAD][DCS_SAE_B_DEC];
    for (long long i = b; i < e; i++) {
        double acc = 0.0;
        for (int f = 0; f < F; f++) acc += (double)w[i * F + f] * gb[f];
        gd[i] -= (float)acc;
    }
}

static void run(dcs_sae *s, dcs_par_fn fn, void *arg, long long n, long long cost) {
    if (s->be->ops->parallel)
        s->be->ops->parallel(s->be, fn, arg, n, cost);
    else
        fn(arg, 0, n, 0);
}

static void columns(dcs_sae *s, col_arg *a) {
    run(s, col_blocks, a, (a->cols + COL_BLOCK - 1) / COL_BLOCK, (long long)a->N * COL_BLOCK);
}

/* ------------------------------------------------------------ forward, backward */

static dcs_status check_batch(dcs_sae *s, const float *x, int N, const char *what) {
    if (N < 1) return dcs_seterr(&s->err, DCS_ERR_ARG, "sae %s: empty batch (N = %d rows)", what, N);
    if (!x) return dcs_seterr(&s->err, DCS_ERR_ARG, "sae %s: x is NULL", what);
    long long r = first_nonfinite_row(x, N, s->c.d_in);
    if (r >= 0) return dcs_seterr(&s->err, DCS_ERR_NONFINITE, "sae %s: x row %lld holds NaN or inf", what, r);
    return reserve(s, N);
}

/* pre, acts of x [N, d_in] (x checked); the input the products read.
 * train: BatchTopK's selection over the batch (dcs_sae_grad). */
static const float *encode(dcs_sae *s, const float *x, int N, int train) {
    dcs_backend *be = s->be;
    const int din = s->c.d_in, F = s->c.d_sae;
    rows_arg ra = {s, x, NULL, train};
    const float *xin = x;
    if (s->c.apply_b_dec_to_input) {
        run(s, center_rows, &ra, N, din);
        xin = s->xin;
    }
    /* pre [N, F] = xin [N, d_in] @ W_enc [d_in, F] */
    be->ops->gemm(be, 0, 0, N, F, din, 1.0f, xin, din, 0, s->t[DCS_SAE_PARAM][DCS_SAE_W_ENC], F, 0, 0.0f,
                  s->pre, F, 0, 1);
    run(s, act_rows, &ra, N, 4LL * F);
    if (train && s->c.arch == DCS_SAE_BATCHTOPK) {
        /* scratch: dacts, written only later by the backward (the CPU's GEMM and pool
         * calls have returned with their results) */
        const long long n = (long long)N * F;
        s->batch_min = dcs_batch_topk(s->pre, n, (long long)s->c.k * N, s->dacts, s->acts);
    }
    return xin;
}

/* recon [N, d_out] = acts [N, F] @ W_dec [F, d_out] (b_dec added by loss_rows or here) */
static void decode(dcs_sae *s, int N) {
    dcs_backend *be = s->be;
    if (s->c.arch == DCS_SAE_TOPK) {
        dcs_sae_topk_decode(s, N);
        return;
    }
    be->ops->gemm(be, 0, 0, N, s->c.d_out, s->c.d_sae, 1.0f, s->acts, s->c.d_sae, 0,
                  s->t[DCS_SAE_PARAM][DCS_SAE_W_DEC], s->c.d_out, 0, 0.0f, s->recon, s->c.d_out, 0, 1);
}

dcs_status dcs_sae_forward(dcs_sae *s, const float *x, int N, float *pre, float *acts, float *recon) {
    if (!s) return DCS_ERR_ARG;
    dcs_status st = check_batch(s, x, N, "forward");
    if (st) return st;
    encode(s, x, N, 0);
    const size_t F = (size_t)s->c.d_sae, d = (size_t)s->c.d_out;
    if (recon) {
        decode(s, N);
        const float *bdec = s->t[DCS_SAE_PARAM][DCS_SAE_B_DEC];
        for (size_t r = 0; r < (size_t)N; r++)
            for (size_t j = 0; j < d; j++) recon[r * d + j] = s->recon[r * d + j] + bdec[j];
    }
    if (pre) memcpy(pre, s->pre, (size_t)N * F * sizeof(float));
    if (acts) memcpy(acts, s->acts, (size_t)N * F * sizeof(float));
    return s->be->ops->sync(s->be, &s->err);
}

dcs_status dcs_sae_grad(dcs_sae *s, const float *x, const float *target, int N, dcs_sae_stats *stats,
                        int64_t *fired) {
    if (!s) return DCS_ERR_ARG;
    dcs_status st = check_batch(s, x, N, "grad");
    if (st) return st;
    const int din = s->c.d_in, dout = s->c.d_out, F = s->c.d_sae;
    if (!target) {
        if (dout != din)
            return dcs_seterr(&s->err, DCS_ERR_ARG,
                              "sae grad: a transcoder (d_out %d != d_in %d) needs a target", dout, din);
        target = x;
    } else {
        long long r = first_nonfinite_row(target, N, dout);
        if (r >= 0)
            return dcs_seterr(&s->err, DCS_ERR_NONFINITE, "sae grad: target row %lld holds NaN or inf", r);
    }
    dcs_backend *be = s->be;
    float **g = s->t[DCS_SAE_GRAD];
    float *const *p = s->t[DCS_SAE_PARAM];
    const float *xin = encode(s, x, N, 1);
    decode(s, N);
    loss_arg la = {s, target, N, 1};
    run(s, loss_rows, &la, N, 2LL * (dout + F));
    /* s->recon is now dR = dL/drecon [N, d_out] */
    /* dW_dec [F, d_out] = acts^T [F, N] @ dR [N, d_out] (TopK: below, through its kept features) */
    if (s->c.arch != DCS_SAE_TOPK)
        be->ops->gemm(be, 1, 0, F, dout, N, 1.0f, s->acts, F, 0, s->recon, dout, 0, 0.0f, g[DCS_SAE_W_DEC],
                      dout, 0, 1);
    col_arg ca = {
        .s = s, .a = s->recon, .out = g[DCS_SAE_B_DEC], .N = N, .cols = dout, .op = COL_SUM, .sign = 1};
    columns(s, &ca);               /* db_dec = sum_r dR */
    if (s->c.arch == DCS_SAE_TOPK) /* dW_dec, dW_enc, db_enc, fired */
        dcs_sae_topk_backward(s, xin, N, fired);
    else /* dacts [N, F] = dR [N, d_out] @ W_dec^T [d_out, F] */
        be->ops->gemm(be, 0, 1, N, F, dout, 1.0f, s->recon, dout, 0, p[DCS_SAE_W_DEC], dout, 0, 0.0f,
                      s->dacts, F, 0, 1);
    if (s->c.arch == DCS_SAE_JUMPRELU) { /* the threshold's pseudo-gradient reads dacts before the mask */
        col_arg ct = {.s = s,
                      .out = g[DCS_SAE_LOG_THR],
                      .N = N,
                      .cols = F,
                      .op = COL_THR,
                      .sign = 1,
                      .dacts = s->dacts};
        columns(s, &ct);
    }
    if (s->c.arch != DCS_SAE_TOPK) {
        run(s, dpre_rows, &la, N, 2LL * F); /* s->dacts is now dpre */
        /* dW_enc [d_in, F] = xin^T [d_in, N] @ dpre [N, F] */
        be->ops->gemm(be, 1, 0, din, F, N, 1.0f, xin, din, 0, s->dacts, F, 0, 0.0f, g[DCS_SAE_W_ENC], F, 0,
                      1);
    }
    col_arg cb = {
        .s = s, .a = s->dacts, .out = g[DCS_SAE_B_ENC], .N = N, .cols = F, .op = COL_SUM, .sign = 1};
    if (s->c.arch != DCS_SAE_TOPK) columns(s, &cb); /* db_enc = sum_r dpre */
    if (s->c.apply_b_dec_to_input) /* xin = x - b_dec: db_dec -= sum_r dpre W_enc^T = W_enc db_enc */
        run(s, bdec_rows, s, din, 2LL * F);
    if (fired && s->c.arch != DCS_SAE_TOPK) {
        col_arg cf = {.s = s, .fired = fired, .N = N, .cols = F, .op = COL_FIRED};
        columns(s, &cf);
    }
    st = be->ops->sync(be, &s->err);
    if (st) return st;
    double se = 0.0, sp = 0.0, l0 = 0.0;
    for (int r = 0; r < N; r++) {
        se += s->row[3 * r];
        sp += s->row[3 * r + 1];
        l0 += s->row[3 * r + 2];
    }
    if (stats) {
        stats->mse = se / N;
        stats->sparsity = (double)s->c.sparsity_coef * sp / N;
        const int no_penalty = s->c.arch == DCS_SAE_TOPK || s->c.arch == DCS_SAE_BATCHTOPK;
        stats->loss = no_penalty ? stats->mse : stats->mse + stats->sparsity;
        stats->l0 = l0 / N;
    }
    if (!isfinite(se))
        return dcs_seterr(&s->err, DCS_ERR_NONFINITE, "sae grad: the loss is not finite (diverged?)");
    return DCS_OK;
}

/* AdamW on one parameter's elements [b, e). */
typedef struct {
    float *p, *g, *m, *v;
    float b1c, b2c, wd;
    const dcs_adamw *h;
} adam_arg;
static void adam_range(void *arg, long long b, long long e, int tid) {
    (void)tid;
    const adam_arg *a = arg;
    for (long long j = b; j < e; j++)
        a->p[j] = dcs_adamw_elem(a->p[j], a->g[j], &a->m[j], &a->v[j], a->h->beta1, a->h->beta2, a->b1c,
                                 a->b2c, a->h->eps, a->h->lr, a->wd);
}

/* W_dec's rows [b, e) scaled to unit norm (a zero row stays). */
static void unit_rows(void *arg, long long b, long long e, int tid) {
    (void)tid;
    dcs_sae *s = arg;
    const int d = s->c.d_out;
    float *w = s->t[DCS_SAE_PARAM][DCS_SAE_W_DEC];
    for (long long r = b; r < e; r++) {
        double n2 = 0.0;
        for (int j = 0; j < d; j++) n2 += (double)w[r * d + j] * w[r * d + j];
        if (n2 > 0.0) {
            const float inv = (float)(1.0 / sqrt(n2));
            for (int j = 0; j < d; j++) w[r * d + j] *= inv;
        }
    }
}

dcs_status dcs_sae_adamw(dcs_sae *s, int step, const dcs_adamw *h) {
    if (!s) return DCS_ERR_ARG;
    if (step < 1) return dcs_seterr(&s->err, DCS_ERR_ARG, "sae adamw: step must be >= 1, not %d", step);
    if (!h) return dcs_seterr(&s->err, DCS_ERR_ARG, "sae adamw: hyperparameters are NULL");
    if (!(h->lr >= 0.0f) || !(h->beta1 >= 0.0f && h->beta1 < 1.0f) ||
        !(h->beta2 >= 0.0f && h->beta2 < 1.0f) || !(h->eps > 0.0f) || !(h->weight_decay >= 0.0f))
        return dcs_seterr(&s->err, DCS_ERR_ARG,
                          "sae adamw: need lr >= 0, 0 <= beta1, beta2 < 1, eps > 0, weight_decay >= 0");
    const float b1c = 1.0f - powf(h->beta1, (float)step), b2c = 1.0f - powf(h->beta2, (float)step);
    const int n_trained = s->c.arch == DCS_SAE_BATCHTOPK ? 4 : s->n_params; /* not its threshold */
    for (int i = 0; i < n_trained; i++) {
        const int matrix = i == DCS_SAE_W_ENC || i == DCS_SAE_W_DEC;
        adam_arg a = {s->t[DCS_SAE_PARAM][i],
                      s->t[DCS_SAE_GRAD][i],
                      s->t[DCS_SAE_MOM][i],
                      s->t[DCS_SAE_VAR][i],
                      b1c,
                      b2c,
                      matrix ? h->weight_decay : 0.0f,
                      h};
        run(s, adam_range, &a, s->n[i], 8);
    }
    if (s->c.normalize_decoder) run(s, unit_rows, s, s->c.d_sae, 2LL * s->c.d_out);
    if (s->c.arch == DCS_SAE_BATCHTOPK && s->batch_min >= 0.0f) { /* SAELens's running estimate */
        float *thr = s->t[DCS_SAE_PARAM][DCS_SAE_LOG_THR];
        thr[0] += DCS_SAE_THRESHOLD_LR * (s->batch_min - thr[0]);
        s->batch_min = -1.0f;
    }
    return s->be->ops->sync(s->be, &s->err);
}
