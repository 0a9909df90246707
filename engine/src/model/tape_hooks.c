/*
 * tape_hooks.c -- the tape's hook points (tape.h): overrides in its
 * forward (the pass's hook dispatch writes the given data), the gradients
 * handed out at hook points in its backward (cut where an override made
 * the activation a constant), and the buffers of the asked parameter
 * gradients. Called by the driver (tape.c) and the layer backward
 * (layer_bw.c); calls nothing of theirs.
 */
#include "tape.h"

#include <string.h>

size_t dcs_tape_hook_numel(const dcs_tape *tp, int point) {
    int64_t shape[6];
    int nd = dcs_hook_shape(tp->m, point, tp->B, tp->T, shape);
    size_t n = 1;
    for (int i = 0; i < nd; i++) n *= (size_t)shape[i];
    return n;
}

const dcs_hook_override *dcs_tape_ov(const dcs_tape *tp, int point, int layer) {
    for (int i = 0; i < tp->n_ov; i++)
        if (tp->ov[i].point == point && (!dcs_hook_point_is_layered(point) || tp->ov[i].layer == layer))
            return &tp->ov[i];
    return NULL;
}

/* Forward: the pass's hook at an overridden point writes the given data;
 * at a read point (the forward's only) it copies the activation out. */
int dcs_tape_ov_hook(void *user, int point, int layer, float *data, const int64_t *shape, int nd) {
    (void)shape;
    (void)nd;
    dcs_tape *tp = user;
    const dcs_hook_override *o = dcs_tape_ov(tp, point, layer);
    const size_t n = dcs_tape_hook_numel(tp, point);
    if (o) memcpy(data, o->data, n * sizeof(float));
    for (int i = 0; i < tp->n_rd; i++)
        if (tp->rd[i].point == point && (!dcs_hook_point_is_layered(point) || tp->rd[i].layer == layer))
            memcpy(tp->rd[i].data, data, n * sizeof(float));
    return o != NULL;
}

/* Backward: hand out the gradient at (point, layer) and cut it when the
 * activation was overridden. */
void dcs_tape_grad_capture(dcs_tape *tp, const dcs_hook_grad *g, int n_g, int point, int layer,
                           const float *dx) {
    size_t n = 0;
    for (int i = 0; i < n_g; i++)
        if (g[i].point == point && (!dcs_hook_point_is_layered(point) || g[i].layer == layer)) {
            if (!n) n = dcs_tape_hook_numel(tp, point);
            tp->m->be->ops->download(tp->m->be, g[i].grad, dx, n * sizeof(float));
        }
}

void dcs_tape_grad_at(dcs_tape *tp, const dcs_hook_grad *g, int n_g, int point, int layer, float *dx) {
    size_t n = 0;
    for (int i = 0; i < n_g; i++)
        if (g[i].point == point && (!dcs_hook_point_is_layered(point) || g[i].layer == layer)) {
            if (!n) n = dcs_tape_hook_numel(tp, point);
            tp->m->be->ops->download(tp->m->be, g[i].grad, dx, n * sizeof(float));
        }
    if (dcs_tape_ov(tp, point, layer))
        tp->m->be->ops->zero(tp->m->be, dx, dcs_tape_hook_numel(tp, point) * sizeof(float));
}

int dcs_tape_wants_grad(const dcs_hook_grad *g, int n_g, int point, int layer) {
    for (int i = 0; i < n_g; i++)
        if (g[i].point == point && g[i].layer == layer) return 1;
    return 0;
}

/* Every asked parameter gradient by its weight's layer and field
 * (dcs_model_map_params), the model's own by name. */
dcs_status dcs_tape_param_grads(const dcs_model *m, bwctx *bc) {
    bc->tok_emb = bc->out_w = bc->norm_w = bc->norm_b = NULL;
    if (!bc->flat && !bc->n_pg) return DCS_OK; /* no parameter asked: lg stays zero */
    size_t off = 0;
    for (int i = 0; i < m->n_weights; i++) {
        const dcs_named_weight *w = &m->weights[i];
        float *g = bc->dev ? bc->dev[i] : bc->flat ? bc->flat + off : NULL;
        for (int k = 0; k < bc->n_pg && !bc->dev && !bc->flat; k++)
            if (bc->pg[k].index == i) g = bc->pg[k].grad;
        size_t n = 1;
        for (int j = 0; j < w->ndim; j++) n *= (size_t)w->shape[j];
        off += n;
        if (w->layer >= 0) {
            dcs_layer_grads *lg = &bc->lg[w->layer];
            switch (w->field) {
#define DCS_LG_CASE(field, name)                                                                             \
    case DCS_LP_##field: lg->field = g; break;
                DCS_LAYER_PARAMS(DCS_LG_CASE)
#undef DCS_LG_CASE
            default: return DCS_ERR_ARG;
            }
        } else if (!strcmp(w->name, "tok_embeddings.weight"))
            bc->tok_emb = g;
        else if (!strcmp(w->name, "output.weight"))
            bc->out_w = g;
        else if (!strcmp(w->name, "norm.weight"))
            bc->norm_w = g;
        else if (!strcmp(w->name, "norm.bias"))
            bc->norm_b = g;
    }
    if (m->out_w == m->tok_emb && m->m_out_w.p == m->m_tok_emb.p) bc->out_w = bc->tok_emb; /* tied */
    return DCS_OK;
}
