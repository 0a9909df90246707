/*
 * decode.c -- incremental decoding: feed tokens a chunk at a time, keeping
 * per layer the keys/values (K/V cache) and the key-side composition
 * weights kw1, kw2, kdd of both phases (KW cache) of the tokens fed so far.
 *
 * Shapes: n new tokens at positions t0 .. t0+n-1, P = t0 + n positions in
 * all; per layer the cache holds `used` consecutive positions starting at
 * `first` (first = 0 on a global layer; a local layer keeps the last
 * window + 1). D model dim, N heads, Dh head dim, R dynamic rank.
 *   backend memory: x, h [n, D], qkv [n, 3D], K/V cache [cap, D]
 *   host memory:    q, new k staging [n, D] (rotary at absolute positions),
 *                   KW cache kw1, kw2 [cap, R, N], kdd [cap, N] per phase,
 *                   attention maps [N, n, P] (keys at absolute positions)
 * The projections run on the backend (CPU or CUDA); the small per-step
 * attention-map work (mask, compose, softmax) runs on the host with the
 * per-element math of dcs_math.h, the same functions the kernels use.
 */
#include "dcs_model.h"
#include "dcs_math.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    float *k, *v;                    /* backend [cap, D]                       */
    float *kw1[2], *kw2[2], *kdd[2]; /* host [cap, R*N], [cap, N] per phase    */
    int first, used, cap;            /* positions first .. first+used-1 held   */
} dec_layer;

struct dcs_decoder {
    dcs_model *m;
    int pos;
    dec_layer *layers;
};

#define DEC_MAX_BUFS 64

/* State of one step. */
typedef struct {
    dcs_decoder *d;
    dcs_model *m;
    dcs_backend *be;
    const dcs_hooks *hooks;
    int n, t0, P;
    void *dev[DEC_MAX_BUFS];   /* backend buffers of this step */
    int n_dev;
    void *host[DEC_MAX_BUFS];  /* host buffers of this step    */
    int n_host;
    float *stage;              /* host staging of a hooked backend activation */
    size_t stage_cap;
    dcs_status status;
} dstep;

/* ---------------------------------------------------------------- memory */

static float *dev_alloc(dstep *s, size_t nfloats) {
    if (s->status) return NULL;
    if (s->n_dev == DEC_MAX_BUFS) {
        s->status = dcs_seterr(&s->m->err, DCS_ERR_NOMEM, "decode: too many buffers");
        return NULL;
    }
    float *p = s->be->ops->alloc(s->be, nfloats * sizeof(float) + sizeof(float));
    if (!p) {
        s->status = dcs_seterr(&s->m->err, DCS_ERR_NOMEM, "decode: out of memory (%zu floats)", nfloats);
        return NULL;
    }
    s->dev[s->n_dev++] = p;
    return p;
}

static float *host_alloc(dstep *s, size_t nfloats) {
    if (s->status) return NULL;
    if (s->n_host == DEC_MAX_BUFS) {
        s->status = dcs_seterr(&s->m->err, DCS_ERR_NOMEM, "decode: too many buffers");
        return NULL;
    }
    float *p = calloc(nfloats + 1, sizeof(float));
    if (!p) {
        s->status = dcs_seterr(&s->m->err, DCS_ERR_NOMEM, "decode: out of host memory (%zu floats)", nfloats);
        return NULL;
    }
    s->host[s->n_host++] = p;
    return p;
}

/* Free the buffers allocated since the marks (per layer: memory stays one
 * layer deep). */
static void release_to(dstep *s, int dev_mark, int host_mark) {
    while (s->n_dev > dev_mark) s->be->ops->free(s->be, s->dev[--s->n_dev]);
    while (s->n_host > host_mark) free(s->host[--s->n_host]);
}

/* ---------------------------------------------------------------- hooks */

static int wants(const dstep *s, int point, int layer) {
    if (!s->hooks || !s->hooks->want || !s->hooks->fn) return 0;
    if (!dcs_hook_exists(s->m, point)) return 0;
    return s->hooks->want[dcs_hook_index(s->m->cfg.n_layer, point, layer)] != 0;
}

static int is_map(int point) { return point >= DCS_HP_SCORES && point <= DCS_HP_PATTERN_COMPOSED; }

/* Call the hook on host data; returns 1 if modified. */
static int hook_host(dstep *s, int point, int layer, float *data) {
    if (s->status || !wants(s, point, layer)) return 0;
    int64_t shape[6];
    int nd = dcs_hook_shape(s->m, point, 1, s->n, shape);
    if (is_map(point)) shape[3] = s->P;
    s->m->err.code = DCS_OK;
    s->m->err.msg[0] = 0;
    int r = s->hooks->fn(s->hooks->user, point, layer, data, shape, nd);
    if (r < 0) {
        if (s->m->err.code != DCS_ERR_HOOK) {
            if (dcs_hook_point_is_layered(point))
                dcs_seterr(&s->m->err, DCS_ERR_HOOK, "hook blocks.%d.%s aborted the decoding step",
                           layer, dcs_hook_point_name(point));
            else
                dcs_seterr(&s->m->err, DCS_ERR_HOOK, "hook %s aborted the decoding step",
                           dcs_hook_point_name(point));
        }
        s->status = DCS_ERR_HOOK;
        return 0;
    }
    return r > 0;
}

/* Call the hook on backend data of nfloats floats; returns 1 if modified. */
static int hook_dev(dstep *s, int point, int layer, float *dev, size_t nfloats) {
    if (s->status || !wants(s, point, layer)) return 0;
    if (s->m->device == DCS_DEVICE_CPU) return hook_host(s, point, layer, dev);
    if (nfloats > s->stage_cap) {
        free(s->stage);
        s->stage = malloc(nfloats * sizeof(float));
        s->stage_cap = s->stage ? nfloats : 0;
        if (!s->stage) {
            s->status = dcs_seterr(&s->m->err, DCS_ERR_NOMEM, "decode: out of host memory");
            return 0;
        }
    }
    s->be->ops->download(s->be, s->stage, dev, nfloats * sizeof(float));
    if ((s->status = s->be->ops->sync(s->be, &s->m->err))) return 0;
    int r = hook_host(s, point, layer, s->stage);
    if (r) s->be->ops->upload(s->be, dev, s->stage, nfloats * sizeof(float));
    return r;
}

/* The documented write rule (hooks.md): after a hook wrote a post-softmax
 * map, its masked cells are zero again -- the mask wins. map [N, n, P]. */
static void zero_masked(float *map, int N, int n, int P, int t0, int window) {
    dcs_mask_map(map, N, n, P, t0, window);
}

/* ---------------------------------------------------------------- cache */

static void layer_free(dcs_backend *be, dec_layer *L) {
    if (L->k) be->ops->free(be, L->k);
    if (L->v) be->ops->free(be, L->v);
    for (int ph = 0; ph < 2; ph++) {
        free(L->kw1[ph]);
        free(L->kw2[ph]);
        free(L->kdd[ph]);
    }
    memset(L, 0, sizeof *L);
}

/* Room for `need` positions in layer L (grows by doubling, copies what is held). */
static dcs_status layer_reserve(dcs_decoder *d, dec_layer *L, int need) {
    dcs_model *m = d->m;
    dcs_backend *be = m->be;
    const dcs_config *c = &m->cfg;
    if (need <= L->cap) return DCS_OK;
    int cap = L->cap ? L->cap : 16;
    while (cap < need) cap *= 2;
    const size_t D = (size_t)c->d_model, RN = (size_t)c->dyn_rank * c->n_head, N = (size_t)c->n_head;
    dec_layer nl = *L;
    nl.cap = cap;
    nl.k = be->ops->alloc(be, (size_t)cap * D * sizeof(float));
    nl.v = be->ops->alloc(be, (size_t)cap * D * sizeof(float));
    int ok = nl.k && nl.v;
    int key_side = c->use_dcmha && !c->query_wise;
    for (int ph = 0; ph < 2; ph++) {
        nl.kw1[ph] = nl.kw2[ph] = nl.kdd[ph] = NULL;
        if (!key_side) continue;
        nl.kw1[ph] = calloc((size_t)cap * RN, sizeof(float));
        nl.kw2[ph] = calloc((size_t)cap * RN, sizeof(float));
        nl.kdd[ph] = calloc((size_t)cap * N, sizeof(float));
        ok = ok && nl.kw1[ph] && nl.kw2[ph] && nl.kdd[ph];
    }
    if (!ok) {
        layer_free(be, &nl);
        return dcs_seterr(&m->err, DCS_ERR_NOMEM, "decode: out of memory for a cache of %d positions", cap);
    }
    if (L->used) {
        be->ops->copy(be, nl.k, L->k, (size_t)L->used * D * sizeof(float));
        be->ops->copy(be, nl.v, L->v, (size_t)L->used * D * sizeof(float));
        for (int ph = 0; ph < 2 && key_side; ph++) {
            memcpy(nl.kw1[ph], L->kw1[ph], (size_t)L->used * RN * sizeof(float));
            memcpy(nl.kw2[ph], L->kw2[ph], (size_t)L->used * RN * sizeof(float));
            memcpy(nl.kdd[ph], L->kdd[ph], (size_t)L->used * N * sizeof(float));
        }
    }
    layer_free(be, L);
    *L = nl;
    return DCS_OK;
}

/* A local layer keeps only the last `keep` positions: shift them to slot 0. */
static void layer_trim(dcs_decoder *d, dec_layer *L, int keep, float *tmp_dev) {
    if (L->used <= keep) return;
    dcs_backend *be = d->m->be;
    const dcs_config *c = &d->m->cfg;
    const size_t D = (size_t)c->d_model, RN = (size_t)c->dyn_rank * c->n_head, N = (size_t)c->n_head;
    const size_t drop = (size_t)(L->used - keep);
    /* backend copies may not overlap: through tmp_dev [keep, D] */
    be->ops->copy(be, tmp_dev, L->k + drop * D, (size_t)keep * D * sizeof(float));
    be->ops->copy(be, L->k, tmp_dev, (size_t)keep * D * sizeof(float));
    be->ops->copy(be, tmp_dev, L->v + drop * D, (size_t)keep * D * sizeof(float));
    be->ops->copy(be, L->v, tmp_dev, (size_t)keep * D * sizeof(float));
    for (int ph = 0; ph < 2; ph++) {
        if (!L->kw1[ph]) continue;
        memmove(L->kw1[ph], L->kw1[ph] + drop * RN, (size_t)keep * RN * sizeof(float));
        memmove(L->kw2[ph], L->kw2[ph] + drop * RN, (size_t)keep * RN * sizeof(float));
        memmove(L->kdd[ph], L->kdd[ph] + drop * N, (size_t)keep * N * sizeof(float));
    }
    L->first += (int)drop;
    L->used = keep;
}

/* ---------------------------------------------------------------- layers */

/* y [M, O] = x [M, I] W^T + b (a torch Linear). */
static void linear(dcs_backend *be, float *y, const float *x, const float *W, const float *b, int M, int O,
                   int I) {
    be->ops->gemm(be, 0, 1, M, O, I, 1.0f, x, I, 0, W, I, 0, 0.0f, y, O, 0, 1);
    if (b) be->ops->add_bias(be, y, b, M, O);
}

/* Rotary at absolute positions t0 + i on host rows x [n, N, Dh]. */
static void rotary_host(float *x, int n, int t0, int N, int Dh, int rot, float base) {
    const int half = rot / 2;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < half; j++) {
            float cs, sn;
            dcs_rotary_cs(t0 + i, j, rot, base, &cs, &sn);
            for (int h = 0; h < N; h++) {
                float *v = x + ((size_t)i * N + h) * Dh;
                dcs_rotate_pair(&v[j], &v[j + half], cs, sn);
            }
        }
}

/* Dynamic weights of the n new rows (model-spec 2 step 4): query side into
 * q1/q2/qd [phase] (host [n, R*N], [n, N]), key side appended to the KW
 * cache at slot L->used; with their hooks, in the order of the forward pass. */
static void dyn_step(dstep *s, int l, const float *h, dec_layer *L, float *q1[2], float *q2[2],
                     float *qd[2]) {
    const dcs_config *c = &s->m->cfg;
    const dcs_layer_weights *lw = &s->m->layers[l];
    dcs_backend *be = s->be;
    const int n = s->n, D = c->d_model, N = c->n_head, R = c->dyn_rank;
    const int C = c->dyn_slots, K = c->dyn_hidden, RN2 = 2 * R * N, RN = R * N;
    float *hid = dev_alloc(s, (size_t)n * C * K), *w = dev_alloc(s, (size_t)n * C * RN2);
    float *g = dev_alloc(s, (size_t)n * C * N);
    float *w1 = dev_alloc(s, (size_t)n * RN), *w2 = dev_alloc(s, (size_t)n * RN), *dd = dev_alloc(s, (size_t)n * N);
    if (s->status) return;
    be->ops->gemm(be, 0, 0, n, C * K, D, 1.0f, h, D, 0, lw->dw1, C * K, 0, 0.0f, hid, C * K, 0, 1);
    be->ops->gelu(be, hid, (size_t)n * C * K);
    be->ops->gemm(be, 0, 0, n, RN2, K, 1.0f, hid, C * K, K, lw->qkw, RN2, (long long)K * RN2, 0.0f, w, C * RN2,
             RN2, C);
    be->ops->gemm(be, 0, 0, n, C * N, D, 1.0f, h, D, 0, lw->dd, C * N, 0, 0.0f, g, C * N, 0, 1);
    be->ops->tanh_(be, g, (size_t)n * C * N);
    static const int pts[2][6] = {
        {DCS_HP_DYN_PRE_QW1, DCS_HP_DYN_PRE_QW2, DCS_HP_DYN_PRE_QDD, DCS_HP_DYN_PRE_KW1, DCS_HP_DYN_PRE_KW2,
         DCS_HP_DYN_PRE_KDD},
        {DCS_HP_DYN_POST_QW1, DCS_HP_DYN_POST_QW2, DCS_HP_DYN_POST_QDD, DCS_HP_DYN_POST_KW1,
         DCS_HP_DYN_POST_KW2, DCS_HP_DYN_POST_KDD}};
    for (int ph = 0; ph < 2; ph++)
        for (int side = 0; side < 2; side++) {
            if (side == 1 && c->query_wise) continue;
            int slot = C == 4 ? 2 * ph + side : ph;
            be->ops->copy2d(be, w1, RN, w + (size_t)slot * RN2, C * RN2, n, RN);
            be->ops->copy2d(be, w2, RN, w + (size_t)slot * RN2 + RN, C * RN2, n, RN);
            be->ops->copy2d(be, dd, N, g + (size_t)slot * N, C * N, n, N);
            be->ops->rmsnorm(be, w1, n * R, N, N, NULL, 1e-6f);
            float *o1, *o2, *od;
            if (side == 0) {
                o1 = q1[ph];
                o2 = q2[ph];
                od = qd[ph];
            } else {
                o1 = L->kw1[ph] + (size_t)L->used * RN;
                o2 = L->kw2[ph] + (size_t)L->used * RN;
                od = L->kdd[ph] + (size_t)L->used * N;
            }
            be->ops->download(be, o1, w1, (size_t)n * RN * sizeof(float));
            be->ops->download(be, o2, w2, (size_t)n * RN * sizeof(float));
            be->ops->download(be, od, dd, (size_t)n * N * sizeof(float));
            if ((s->status = be->ops->sync(be, &s->m->err))) return;
            hook_host(s, pts[ph][3 * side + 0], l, o1);
            hook_host(s, pts[ph][3 * side + 1], l, o2);
            hook_host(s, pts[ph][3 * side + 2], l, od);
        }
}

/* Compose the host map A [N, n, P] in place (model-spec 2 step 6) for the
 * held keys (pre: every held pair; post: allowed pairs, others 0), with the
 * phase's branch hooks. */
static void compose_host(dstep *s, int l, int phase, float *A, const dec_layer *L, float *q1, float *q2,
                         float *qd, int window) {
    const dcs_config *c = &s->m->cfg;
    const int n = s->n, P = s->P, N = c->n_head, R = c->dyn_rank, t0 = s->t0;
    static const int first[2] = {DCS_HP_PRE_SKIP, DCS_HP_POST_SKIP};
    const size_t map = (size_t)N * n * P;
    int any = 0;
    for (int k = 0; k < 5; k++) any |= wants(s, first[phase] + k, l);
    float *br[5] = {0};
    if (any)
        for (int k = 0; k < 5; k++)
            if (dcs_hook_exists(s->m, first[phase] + k)) br[k] = host_alloc(s, map);
    if (s->status) return;
    const long long stride = (long long)n * P;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < P; j++) {
            const long long o = (long long)i * P + j;
            const int held = j >= L->first && j < L->first + L->used;
            if (!held || (phase == 1 && !dcs_allowed(t0 + i, j, window))) {
                for (int h = 0; h < N; h++) A[o + h * stride] = 0.0f;   /* branches stay 0 */
                continue;
            }
            const int sl = j - L->first;
            const float *k1 = L->kw1[phase] ? L->kw1[phase] + (size_t)sl * R * N : NULL;
            const float *k2 = L->kw2[phase] ? L->kw2[phase] + (size_t)sl * R * N : NULL;
            const float *kd = L->kdd[phase] ? L->kdd[phase] + (size_t)sl * N : NULL;
            dcs_compose_pair_plain(A + o, A + o, stride, N, R, q1 + (size_t)i * R * N, q2 + (size_t)i * R * N,
                                   k1, k2, qd + (size_t)i * N, kd, br[0] ? br[0] + o : NULL,
                                   br[1] ? br[1] + o : NULL, br[2] ? br[2] + o : NULL,
                                   br[3] ? br[3] + o : NULL, br[4] ? br[4] + o : NULL, NULL);
        }
    if (!any) return;
    int modified = 0;
    for (int k = 0; k < 5; k++)
        if (br[k]) modified |= hook_host(s, first[phase] + k, l, br[k]);
    if (modified) {
        for (size_t e = 0; e < map; e++) {
            float v = 0.0f;
            for (int k = 0; k < 5; k++)
                if (br[k]) v += br[k][e];
            A[e] = v;
        }
        if (phase == 1) zero_masked(A, N, n, P, t0, window);
    }
}

/* Attention of layer l on h [n, D] (normed, backend); result in out [n, D]. */
static void attention(dstep *s, int l, const float *h, float *out) {
    dcs_model *m = s->m;
    const dcs_config *c = &m->cfg;
    const dcs_layer_weights *lw = &m->layers[l];
    dcs_backend *be = s->be;
    dec_layer *L = &s->d->layers[l];
    const int n = s->n, P = s->P, t0 = s->t0, D = c->d_model, N = c->n_head, Dh = c->head_dim;
    const int R = c->dyn_rank;
    const int window = dcs_layer_is_local(m, l) ? c->window_size : 0;
    const size_t map = (size_t)N * n * P;

    /* q [n, D] (backend, host copy), new k, v into cache slots used .. used+n-1 */
    float *qkv = dev_alloc(s, (size_t)n * 3 * D), *q = dev_alloc(s, (size_t)n * D);
    float *hq = host_alloc(s, (size_t)n * D), *hk = host_alloc(s, (size_t)n * D);
    if (s->status) return;
    float *knew = L->k + (size_t)L->used * D, *vnew = L->v + (size_t)L->used * D;
    linear(be, qkv, h, lw->wqkv, lw->bqkv, n, 3 * D, D);
    be->ops->copy2d(be, q, D, qkv, 3 * D, n, D);
    be->ops->copy2d(be, knew, D, qkv + D, 3 * D, n, D);
    be->ops->copy2d(be, vnew, D, qkv + 2 * D, 3 * D, n, D);
    if (c->qk_norm) {
        be->ops->rmsnorm(be, q, n * N, Dh, Dh, lw->q_scale, 1e-6f);
        be->ops->rmsnorm(be, knew, n * N, Dh, Dh, lw->k_scale, 1e-6f);
    }
    be->ops->download(be, hq, q, (size_t)n * D * sizeof(float));
    be->ops->download(be, hk, knew, (size_t)n * D * sizeof(float));
    if ((s->status = be->ops->sync(be, &m->err))) return;
    rotary_host(hq, n, t0, N, Dh, c->rotary_dim, c->rope_base);
    rotary_host(hk, n, t0, N, Dh, c->rotary_dim, c->rope_base);
    hook_host(s, DCS_HP_Q, l, hq);
    hook_host(s, DCS_HP_K, l, hk);
    be->ops->upload(be, q, hq, (size_t)n * D * sizeof(float));
    be->ops->upload(be, knew, hk, (size_t)n * D * sizeof(float));
    hook_dev(s, DCS_HP_V, l, vnew, (size_t)n * D);

    float *q1[2] = {0}, *q2[2] = {0}, *qd[2] = {0};
    if (c->use_dcmha) {
        for (int ph = 0; ph < 2; ph++) {
            q1[ph] = host_alloc(s, (size_t)n * R * N);
            q2[ph] = host_alloc(s, (size_t)n * R * N);
            qd[ph] = host_alloc(s, (size_t)n * N);
        }
        dyn_step(s, l, h, L, q1, q2, qd);
    }
    if (s->status) return;
    L->used += n;    /* the new keys are held from here on (undone on failure by the caller) */
    const int S = L->used;

    /* scores on the held keys [N, n, S] -> host map [N, n, P] at absolute key positions */
    float *Ad = dev_alloc(s, (size_t)N * n * S), *hs = host_alloc(s, (size_t)N * n * S);
    float *A = host_alloc(s, map);
    if (s->status) return;
    be->ops->gemm(be, 0, 1, n, S, Dh, 1.0f / sqrtf((float)Dh), q, D, Dh, L->k, D, Dh, 0.0f, Ad, S, (long long)n * S,
             N);
    be->ops->download(be, hs, Ad, (size_t)N * n * S * sizeof(float));
    if ((s->status = be->ops->sync(be, &m->err))) return;
    for (size_t r = 0; r < (size_t)N * n; r++)
        memcpy(A + r * P + L->first, hs + r * S, (size_t)S * sizeof(float));
    hook_host(s, DCS_HP_SCORES, l, A);
    if (c->use_dcmha) {
        compose_host(s, l, 0, A, L, q1[0], q2[0], qd[0], window);
        hook_host(s, DCS_HP_SCORES_COMPOSED, l, A);
    }
    for (int hh = 0; hh < N; hh++)
        for (int i = 0; i < n; i++) dcs_softmax_row(A + ((size_t)hh * n + i) * P, P, t0 + i, 0, window);
    if (hook_host(s, DCS_HP_PATTERN, l, A)) zero_masked(A, N, n, P, t0, window);
    if (c->use_dcmha) {
        compose_host(s, l, 1, A, L, q1[1], q2[1], qd[1], window);
        if (hook_host(s, DCS_HP_PATTERN_COMPOSED, l, A)) zero_masked(A, N, n, P, t0, window);
    }
    if (s->status) return;

    /* z[:, n] [n, Dh] = P[n] [n, S] @ v[:, n] [S, Dh] on the held keys */
    for (size_t r = 0; r < (size_t)N * n; r++)
        memcpy(hs + r * S, A + r * P + L->first, (size_t)S * sizeof(float));
    be->ops->upload(be, Ad, hs, (size_t)N * n * S * sizeof(float));
    float *z = dev_alloc(s, (size_t)n * D);
    if (s->status) return;
    be->ops->gemm(be, 0, 0, n, Dh, S, 1.0f, Ad, S, (long long)n * S, L->v, D, Dh, 0.0f, z, D, Dh, N);
    hook_dev(s, DCS_HP_Z, l, z, (size_t)n * D);

    int from_heads = 0;
    if (wants(s, DCS_HP_HEAD_OUT, l)) {
        float *ho = dev_alloc(s, (size_t)n * N * D), *ones = dev_alloc(s, (size_t)N);
        float *one_host = host_alloc(s, (size_t)N);
        if (s->status) return;
        be->ops->gemm(be, 0, 1, n, D, Dh, 1.0f, z, D, Dh, lw->wo, D, Dh, 0.0f, ho, N * D, D, N);
        if (hook_dev(s, DCS_HP_HEAD_OUT, l, ho, (size_t)n * N * D)) {
            for (int i = 0; i < N; i++) one_host[i] = 1.0f;
            be->ops->upload(be, ones, one_host, sizeof(float) * (size_t)N);
            be->ops->gemm(be, 0, 0, 1, D, N, 1.0f, ones, N, 0, ho, D, (long long)N * D, 0.0f, out, D, D, n);
            if (lw->bo) be->ops->add_bias(be, out, lw->bo, n, D);
            from_heads = 1;
        }
    }
    if (!from_heads) linear(be, out, z, lw->wo, lw->bo, n, D, D);
    hook_dev(s, DCS_HP_ATTN_OUT, l, out, (size_t)n * D);
}

static void mlp(dstep *s, int l, const float *hn, float *out) {
    const dcs_config *c = &s->m->cfg;
    const dcs_layer_weights *lw = &s->m->layers[l];
    const int n = s->n, D = c->d_model, F = c->d_ff;
    float *u = dev_alloc(s, (size_t)n * F);
    if (s->status) return;
    linear(s->be, u, hn, lw->w1, lw->b1, n, F, D);
    hook_dev(s, DCS_HP_MLP_PRE, l, u, (size_t)n * F);
    s->be->ops->gelu(s->be, u, (size_t)n * F);
    hook_dev(s, DCS_HP_MLP_POST, l, u, (size_t)n * F);
    linear(s->be, out, u, lw->w2, lw->b2, n, D, F);
    hook_dev(s, DCS_HP_MLP_OUT, l, out, (size_t)n * D);
}

static void block(dstep *s, int l, float *x) {
    const dcs_config *c = &s->m->cfg;
    const dcs_layer_weights *lw = &s->m->layers[l];
    dcs_backend *be = s->be;
    const int n = s->n, D = c->d_model;
    const size_t nd = (size_t)n * D;
    hook_dev(s, DCS_HP_RESID_PRE, l, x, nd);
    float *h = dev_alloc(s, nd), *a = dev_alloc(s, nd), *o = dev_alloc(s, nd);
    if (s->status) return;
    be->ops->layernorm(be, h, x, lw->attn_norm_w, lw->attn_norm_b, n, D, c->norm_eps);
    hook_dev(s, DCS_HP_LN_ATTN, l, h, nd);
    attention(s, l, h, a);
    if (s->status) return;
    if (c->parallel_residual) {
        be->ops->layernorm(be, h, x, lw->ffn_norm_w, lw->ffn_norm_b, n, D, c->norm_eps);
        hook_dev(s, DCS_HP_LN_MLP, l, h, nd);
        mlp(s, l, h, o);
        be->ops->add(be, x, a, nd);
        be->ops->add(be, x, o, nd);
    } else {
        be->ops->add(be, x, a, nd);
        be->ops->layernorm(be, h, x, lw->ffn_norm_w, lw->ffn_norm_b, n, D, c->norm_eps);
        hook_dev(s, DCS_HP_LN_MLP, l, h, nd);
        mlp(s, l, h, o);
        be->ops->add(be, x, o, nd);
    }
    hook_dev(s, DCS_HP_RESID_POST, l, x, nd);
}

/* ---------------------------------------------------------------- API */

dcs_status dcs_decoder_new(dcs_model *m, dcs_decoder **out) {
    if (!out) return m ? dcs_seterr(&m->err, DCS_ERR_ARG, "decoder: out is NULL") : DCS_ERR_ARG;
    *out = NULL;
    if (!m) return DCS_ERR_ARG;
    m->err.code = DCS_OK;
    m->err.msg[0] = 0;
    dcs_status st = dcs_model_require_f32(m, &m->err);
    if (st) return st;
    /* The decoder composes with the plain five-branch DCMHA of model-spec.md 2;
     * the variants of section 5 run through dcs_forward only. */
    const dcs_config *c = &m->cfg;
    if (c->use_dcmha && (c->key_wise || c->use_sw || c->compose_groups != 1))
        return dcs_seterr(&m->err, DCS_ERR_UNSUPPORTED,
                          "decoder: incremental decoding supports plain DCMHA and MHA; this model uses %s "
                          "(run full forward passes instead)",
                          c->key_wise ? "key-wise-only composition" : c->use_sw ? "the static (use_sw) branch"
                                                                               : "grouped composition");
    if (c->moh)
        return dcs_seterr(&m->err, DCS_ERR_UNSUPPORTED,
                          "decoder: incremental decoding does not support Mixture-of-Head routing (moh) yet "
                          "(run full forward passes instead)");
    dcs_decoder *d = calloc(1, sizeof *d);
    if (d) d->layers = calloc((size_t)m->cfg.n_layer, sizeof *d->layers);
    if (!d || !d->layers) {
        free(d);
        return dcs_seterr(&m->err, DCS_ERR_NOMEM, "decoder: out of memory");
    }
    d->m = m;
    m->n_decoders++;
    *out = d;
    return DCS_OK;
}

void dcs_decoder_free(dcs_decoder *d) {
    if (!d) return;
    dcs_model *m = d->m;
    for (int l = 0; l < m->cfg.n_layer; l++) layer_free(m->be, &d->layers[l]);
    free(d->layers);
    free(d);
    if (--m->n_decoders == 0 && m->freed) dcs_model_destroy(m);
}

int dcs_decoder_pos(const dcs_decoder *d) { return d ? d->pos : 0; }

int dcs_decoder_layer_keys(const dcs_decoder *d, int layer) {
    if (!d || layer < 0 || layer >= d->m->cfg.n_layer) return -1;
    return d->layers[layer].used;
}

dcs_status dcs_decoder_step(dcs_decoder *d, const int32_t *tokens, int n, float *logits,
                            const dcs_hooks *hooks) {
    if (!d) return DCS_ERR_ARG;
    dcs_model *m = d->m;
    const dcs_config *c = &m->cfg;
    m->err.code = DCS_OK;
    m->err.msg[0] = 0;
    if (!tokens) return dcs_seterr(&m->err, DCS_ERR_ARG, "decode: tokens is NULL");
    if (n <= 0) return dcs_seterr(&m->err, DCS_ERR_ARG, "decode: need n >= 1 tokens (got %d)", n);
    if ((int64_t)d->pos + n > (1 << 24))
        return dcs_seterr(&m->err, DCS_ERR_ARG, "decode: %lld positions is more than a decoder takes (16M)",
                          (long long)d->pos + n);
    if ((uint64_t)c->n_head * (uint64_t)n * (uint64_t)(d->pos + n) > ((uint64_t)1 << 31))
        return dcs_seterr(&m->err, DCS_ERR_NOMEM,
                          "decode: an attention map of %d heads x %d new x %d positions is too large; feed "
                          "fewer tokens per step", c->n_head, n, d->pos + n);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab)
            return dcs_seterr(&m->err, DCS_ERR_ARG, "decode: token id %d at [%d] is out of range [0, %d)",
                              tokens[i], i, c->vocab);
    dcs_status st = dcs_model_require_f32(m, &m->err);
    if (st) return st;
    /* room first, so that a failure leaves the held positions as they were */
    for (int l = 0; l < c->n_layer; l++)
        if ((st = layer_reserve(d, &d->layers[l], d->layers[l].used + n))) return st;
    int used0[1024];
    int first0[1024];
    for (int l = 0; l < c->n_layer; l++) {
        used0[l] = d->layers[l].used;
        first0[l] = d->layers[l].first;
    }

    dstep s;
    memset(&s, 0, sizeof s);
    s.d = d;
    s.m = m;
    s.be = m->be;
    s.hooks = hooks;
    s.n = n;
    s.t0 = d->pos;
    s.P = d->pos + n;
    const int D = c->d_model, V = c->vocab;
    float *x = dev_alloc(&s, (size_t)n * D);
    if (!s.status) {
        s.be->ops->embed(s.be, x, m->tok_emb, tokens, n, D);
        hook_dev(&s, DCS_HP_EMBED, 0, x, (size_t)n * D);
    }
    int trimmed = 0;
    for (int l = 0; l < c->n_layer && !s.status; l++) {
        if (atomic_load(&m->cancel)) {            /* dcs_cancel: stop between layers */
            s.status = dcs_seterr(&m->err, DCS_ERR_CANCELLED, "decode: cancelled");
            break;
        }
        int dm = s.n_dev, hm = s.n_host;
        block(&s, l, x);
        if (!s.status) s.status = s.be->ops->sync(s.be, &m->err);
        release_to(&s, dm, hm);
    }
    if (!s.status && (logits || wants(&s, DCS_HP_LN_FINAL, 0) || wants(&s, DCS_HP_LOGITS, 0))) {
        float *hn = dev_alloc(&s, (size_t)n * D), *lg = dev_alloc(&s, (size_t)n * V);
        if (!s.status) {
            s.be->ops->layernorm(s.be, hn, x, m->norm_w, m->norm_b, n, D, c->norm_eps);
            hook_dev(&s, DCS_HP_LN_FINAL, 0, hn, (size_t)n * D);
            linear(s.be, lg, hn, m->out_w, NULL, n, V, D);
            hook_dev(&s, DCS_HP_LOGITS, 0, lg, (size_t)n * V);
            if (!s.status && logits) s.be->ops->download(s.be, logits, lg, sizeof(float) * (size_t)n * V);
        }
    }
    if (!s.status) s.status = s.be->ops->sync(s.be, &m->err);
    if (!s.status) {
        /* local layers keep only their window: the last window + 1 positions */
        float *tmp = NULL;
        for (int l = 0; l < c->n_layer && !s.status; l++) {
            if (!dcs_layer_is_local(m, l)) continue;
            if (!tmp) tmp = dev_alloc(&s, (size_t)(c->window_size + 1) * D);
            if (tmp) layer_trim(d, &d->layers[l], c->window_size + 1, tmp);
            trimmed = 1;
        }
        if (trimmed && !s.status) s.status = s.be->ops->sync(s.be, &m->err);
    }
    if (s.status) {
        dcs_err ignored;
        s.be->ops->sync(s.be, &ignored);
        for (int l = 0; l < c->n_layer; l++) {   /* forget this step's keys */
            if (d->layers[l].first == first0[l]) d->layers[l].used = used0[l];
        }
    } else {
        d->pos += n;
    }
    release_to(&s, 0, 0);
    free(s.stage);
    return s.status;
}
