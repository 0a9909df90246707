/*
 * forward.c -- the full forward pass of DCPythia or Pythia: the one layer
 * (layer.c) with an empty cache and nothing kept, for B sequences of T
 * tokens from position 0, then the logits (all, or at some positions only),
 * the size check before anything is allocated and the NaN check after.
 */
#include "pass.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* First NaN/inf of the logits [M, V] (host memory), or -1. */
static long long first_nonfinite(const float *x, size_t n) {
    const uint32_t *u = (const uint32_t *)(const void *)x;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) { /* branch-free blocks: vectorizes */
        uint32_t any = 0;
        for (size_t k = 0; k < 16; k++) any |= (uint32_t)((u[i + k] & 0x7f800000u) == 0x7f800000u);
        if (any) break;
    }
    for (; i < n; i++)
        if ((u[i] & 0x7f800000u) == 0x7f800000u) return (long long)i;
    return -1;
}

/* ---------------------------------------------------------------- limits */

static const char *fmt_bytes(char *buf, size_t n, uint64_t bytes) {
    static const char *unit[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 6) {
        v /= 1024.0;
        u++;
    }
    snprintf(buf, n, "%.4g %s", v, unit[u]);
    return buf;
}

/* Total physical memory of this machine in bytes (0 if unknown). */
static uint64_t phys_mem_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    return pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : 0;
}

/* Refuse, before anything is allocated, a pass that cannot fit: row counts
 * the kernels take as int must fit an int, and on the CPU the attention
 * map [B, N, T, T] (six of them while a layer's compose branches are
 * hooked) plus the per-token activations must fit in physical memory (a
 * larger calloc may succeed under overcommit and the process then dies
 * when the pages are touched). The CUDA backend reports a failed
 * cudaMalloc itself. B*T <= 2^24 was checked, so no product overflows. */
static dcs_status check_size(dcs_model *m, int B, int T, const dcs_hooks *hooks) {
    const dcs_config *c = &m->cfg;
    const uint64_t M = (uint64_t)B * (uint64_t)T, N = (uint64_t)c->n_head;
    const uint64_t D = (uint64_t)c->d_model;
    if (M * N > INT_MAX)
        return dcs_seterr(
            &m->err, DCS_ERR_ARG,
            "forward: B*T*n_head = %llu rows is more than one pass takes (2^31 - 1; B=%d, T=%d)",
            (unsigned long long)(M * N), B, T);
    int branches = 0, head_out = 0;
    if (hooks && hooks->want && hooks->fn)
        for (int l = 0; l < c->n_layer; l++) {
            for (int ph = 0; ph < 2; ph++)
                for (int k = 0; k < DCS_N_BRANCHES; k++) {
                    const int pt = dcs_branch_points[ph][k];
                    if (dcs_hook_exists(m, pt) && hooks->want[dcs_hook_index(c->n_layer, pt, l)])
                        branches = (c->query_wise || c->key_wise ? 3 : 5) + (c->use_sw ? 1 : 0);
                }
            for (int part = 0; part < 3; part++) /* [M, N, D] as head_out */
                if (hooks->want[dcs_hook_index(c->n_layer, dcs_split_points[part], l)]) head_out = 1;
            if (hooks->want[dcs_hook_index(c->n_layer, DCS_HP_HEAD_OUT, l)]) head_out = 1;
        }
    /* M*T*N <= 2^24 * 2^24 * 2^12 = 2^60 floats: no overflow; totals in double.
     * The layer's activations by the size table the tape allocates from. */
    uint64_t sz[DCS_ACT_COUNT];
    dcs_act_sizes(c, B, T, T, sz);
    const uint64_t map = sz[DCS_ACT_MAP]; /* floats */
    const uint64_t per_pass =
        10 * sz[DCS_ACT_ROW_D] + sz[DCS_ACT_ROW_F] + M * (uint64_t)c->vocab +
        2 * (sz[DCS_ACT_HID] + sz[DCS_ACT_DYN_ALL] + sz[DCS_ACT_GATES]) + (c->moh ? M * (2 * N + 2) : 0) +
        (head_out ? M * N * D : 0) +
        /* DCFormer++'s SwiGLU: w3 x, the group gate */
        (c->model_type == DCS_MODEL_DCFORMER ? sz[DCS_ACT_ROW_F] + M * c->mgate_dim : 0);
    const double total = 4.0 * ((double)map * (1 + branches) + (double)per_pass);
    const uint64_t limit = m->device == DCS_DEVICE_CPU ? phys_mem_bytes() : 0;
    const double cap = (double)((uint64_t)1 << 46); /* fw_alloc's cap, any device */
    if ((limit && total > (double)limit) || 4.0 * (double)map > cap) {
        char b1[32], b2[32], b3[32];
        uint64_t lim = limit && (double)limit < cap ? limit : (uint64_t)1 << 46;
        uint64_t tot = total >= 1.8e19 ? UINT64_MAX : (uint64_t)total;
        return dcs_seterr(&m->err, DCS_ERR_NOMEM,
                          "forward: B=%d, T=%d needs %s for one attention map [B, %d heads, T, T]"
                          " (%s in all for this pass%s), more than the %s %s; use a smaller batch"
                          " or a shorter sequence",
                          B, T, fmt_bytes(b1, sizeof b1, 4 * map), c->n_head, fmt_bytes(b2, sizeof b2, tot),
                          branches ? ", with the hooked compose branches" : "", fmt_bytes(b3, sizeof b3, lim),
                          lim == limit ? "of memory of this machine" : "one pass may allocate");
    }
    return DCS_OK;
}

dcs_status dcs_forward(dcs_model *m, const int32_t *tokens, int B, int T, float *logits,
                       const dcs_hooks *hooks) {
    return dcs_forward_at(m, tokens, B, T, NULL, 0, logits, hooks);
}

dcs_status dcs_forward_at(dcs_model *m, const int32_t *tokens, int B, int T, const int32_t *positions,
                          int n_pos, float *logits, const dcs_hooks *hooks) {
    if (!m) return DCS_ERR_ARG;
    const dcs_config *c = &m->cfg;
    m->err.code = DCS_OK;
    m->err.msg[0] = 0;
    if (!tokens) return dcs_seterr(&m->err, DCS_ERR_ARG, "forward: tokens is NULL");
    if (B <= 0 || T <= 0)
        return dcs_seterr(&m->err, DCS_ERR_ARG, "forward: need B >= 1 and T >= 1 tokens (got B=%d, T=%d)", B,
                          T);
    if ((int64_t)B * T > (1 << 24))
        return dcs_seterr(&m->err, DCS_ERR_ARG,
                          "forward: B*T = %lld tokens is more than one pass takes (16M)", (long long)B * T);
    for (int64_t i = 0; i < (int64_t)B * T; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab)
            return dcs_seterr(&m->err, DCS_ERR_ARG,
                              "forward: token id %d at [%lld, %lld] is out of range [0, %d)", tokens[i],
                              (long long)(i / T), (long long)(i % T), c->vocab);
    if (positions) {
        if (n_pos <= 0 || n_pos > T)
            return dcs_seterr(&m->err, DCS_ERR_ARG,
                              "forward: logits_at needs 1 to T = %d positions per sequence (got %d)", T,
                              n_pos);
        for (int64_t i = 0; i < (int64_t)B * n_pos; i++)
            if (positions[i] < 0 || positions[i] >= T)
                return dcs_seterr(&m->err, DCS_ERR_ARG,
                                  "forward: logits_at position %d of sequence %lld is out of range [0, %d)",
                                  positions[i], (long long)(i / n_pos), T);
    }
    dcs_status st = check_size(m, B, T, hooks);
    if (st) return st;
    dcs_pass f;
    dcs_pass_init(&f, m, hooks, B, T, 0, "forward", "forward pass");
    dcs_backend *be = f.be;
    const int M = f.M, D = c->d_model, V = c->vocab;

    float *x = dcs_pass_alloc(&f, M, D, 1);
    dcs_pass_embed(&f, tokens, x);
    dcs_pass_layers(&f, x);
    const int final_hooked = dcs_pass_wants(&f, DCS_HP_LN_FINAL, 0) || dcs_pass_wants(&f, DCS_HP_LOGITS, 0);
    if (!f.status && positions && logits && !final_hooked) {
        /* logits only at the asked positions: [B, n_pos] rows of x */
        const int P = B * n_pos;
        float *xs = dcs_pass_alloc(&f, P, D, 1), *hn = dcs_pass_alloc(&f, P, D, 1);
        int direct = m->device == DCS_DEVICE_CPU;
        float *lg = direct ? logits : dcs_pass_alloc(&f, P, V, 1);
        if (!f.status) {
            for (int b = 0; b < B; b++)
                for (int i = 0; i < n_pos; i++)
                    be->ops->copy(be, xs + ((size_t)b * n_pos + i) * D,
                                  x + ((size_t)b * T + positions[b * n_pos + i]) * D, sizeof(float) * D);
            dcs_pass_norm(&f, m->plan[m->cfg.n_layer - 1].norm, hn, xs, m->norm_w, m->norm_b, P);
            dcs_pass_linear(&f, lg, hn, m->m_out_w, NULL, P, V, D);
            if (!direct) be->ops->download(be, logits, lg, sizeof(float) * (size_t)P * V);
        }
    } else if (!f.status && (logits || final_hooked)) {
        float *hn = dcs_pass_alloc(&f, M, D, 1);
        /* on the host, logits go straight into the caller's buffer */
        int direct = logits && !positions && m->device == DCS_DEVICE_CPU;
        float *lg = direct ? logits : dcs_pass_alloc(&f, M, V, 1);
        dcs_pass_final(&f, x, hn, lg);
        if (!f.status && logits && positions) { /* hooked final: gather rows */
            if ((f.status = be->ops->sync(be, &m->err)) == DCS_OK)
                for (int b = 0; b < B; b++)
                    for (int i = 0; i < n_pos; i++)
                        be->ops->download(be, logits + ((size_t)b * n_pos + i) * V,
                                          lg + ((size_t)b * T + positions[b * n_pos + i]) * V,
                                          sizeof(float) * (size_t)V);
        } else if (!f.status && logits && !direct)
            be->ops->download(be, logits, lg, sizeof(float) * (size_t)M * V);
    }
    if (!f.status) {
        f.status = be->ops->sync(be, &m->err);
        const int rows = positions ? n_pos : T; /* logits rows per sequence */
        long long bad = !f.status && logits ? first_nonfinite(logits, (size_t)B * rows * V) : -1;
        if (bad >= 0) {
            const long long b = bad / V / rows, r = bad / V % rows;
            f.status = dcs_seterr(&m->err, DCS_ERR_NONFINITE,
                                  "forward: the logits hold NaN or inf (first at batch %lld, position "
                                  "%lld, token %lld): non-finite weights, an overflow, or a hook that "
                                  "wrote huge values",
                                  b, positions ? (long long)positions[b * n_pos + r] : r, bad % V);
        }
    }
    m->last_peak_bytes = f.peak;
    m->last_total_bytes = f.total;
    dcs_pass_end(&f);
    return f.status;
}
