"""The random weights of dclens.testing.make_tiny: one float32 state dict per model
type, drawn from one generator in the published state_dict() order, each layer in
named steps (attention projections, DCMHA compose weights, MoH gates, QK-norm
scales, MLP, norms). The order of the draws is the checkpoints' bytes: a step moved
or a draw added changes every tensor drawn after it.

Like make_tiny, this module imports nothing of the engine and never imports torch.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class _Gen:
    def __init__(self, seed, weight_scale, dyn_scale):
        self.rng = np.random.default_rng(seed)
        self.ws = float(weight_scale)
        self.dyn = float(dyn_scale)

    def normal(self, shape, std):
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def linear(self, out_f, in_f, gain=1.0):
        return self.normal((out_f, in_f), gain * self.ws / np.sqrt(in_f))

    def bias(self, n):
        return self.normal((n,), 0.1)

    def ln(self, n):
        return (1.0 + self.normal((n,), 0.1)).astype(np.float32), self.normal((n,), 0.1)


def _dcpythia_weights(
    g,
    *,
    n_layer,
    dim,
    n_head,
    vocab,
    intermediate,
    rank,
    fused_qkv,
    use_qk_norm,
    use_linear_bias,
    use_dcmha,
    write_unused_dyn,
    tie_word_embeddings,
    extra_derived,
    use_sw,
    moh,
    compose_groups=1,
):
    """Random DCPythia state dict, float32, in torch state_dict() order.

    Scales: LayerNorm outputs are O(1) per dim; linear weights have std gain/sqrt(in),
    so q/k/v and MLP activations are O(1); QK-norm scales ~1.2 make scores O(1-2).
    Dynamic weights: x @ dw1 ~ N(0, 1) per hidden unit, gelu(.) has rms ~0.65; qkw
    std 0.6/sqrt(K) gives w2 entries ~0.4, so qp/kp ~ sqrt(R*N)*0.4*|A| are comparable
    to skip; dd std 1/sqrt(D) gives tanh gates ~ +-0.6 (qg/kg ~ 0.6*skip).
    The output embedding has std 3/sqrt(D): logits of std ~3.

    Each layer draws, in this order: its attention projections, the compose weights,
    the MoH gates, the QK-norm scales, the MLP, then ffn_norm and attention_norm.
    """
    D, V = dim, vocab
    sd = OrderedDict()
    sd["tok_embeddings.weight"] = g.normal((V, D), 1.0)
    for l in range(n_layer):
        p = f"layers.{l}."
        sd.update(_dcpythia_attention(g, p, dim=D, fused_qkv=fused_qkv, use_linear_bias=use_linear_bias))
        if use_dcmha or write_unused_dyn:
            shape = (D, n_head, rank, compose_groups)
            sd.update(_dcmha_compose(g, p + "attention.dyn_w_proj.", shape, use_sw=use_sw, extra_derived=extra_derived))
        if moh is not None:
            sd.update(_moh_gates(g, p, dim=D, n_head=n_head, shared_heads=int(moh["shared_heads"])))
        if use_qk_norm:
            sd.update(_qk_norm_scales(g, p, D // n_head))
        sd.update(_dcpythia_mlp(g, p, dim=D, intermediate=intermediate, use_linear_bias=use_linear_bias))
        sd[p + "ffn_norm.weight"], sd[p + "ffn_norm.bias"] = g.ln(D)
        sd[p + "attention_norm.weight"], sd[p + "attention_norm.bias"] = g.ln(D)
    sd["norm.weight"], sd["norm.bias"] = g.ln(D)
    out = g.normal((V, D), 3.0 / np.sqrt(D))  # drawn even when tied: the later draws stay the same
    if not tie_word_embeddings:
        sd["output.weight"] = out
    return sd


def _dcpythia_attention(g, p, *, dim, fused_qkv, use_linear_bias):
    """One DCPythia layer's q/k/v and output projections (prefix p = "layers.{l}.").
    The fused matrix and its bias are drawn first; unfused wq/wk/wv are its rows."""
    D = dim
    sd = OrderedDict()
    wqkv = g.linear(3 * D, D)
    bqkv = g.bias(3 * D) if use_linear_bias else None
    if fused_qkv:
        sd[p + "attention.wqkv.weight"] = wqkv
        if use_linear_bias:
            sd[p + "attention.wqkv.bias"] = bqkv
    else:
        for i, nm in enumerate(("wq", "wk", "wv")):
            sd[p + f"attention.{nm}.weight"] = np.ascontiguousarray(wqkv[i * D : (i + 1) * D])
            if use_linear_bias:
                sd[p + f"attention.{nm}.bias"] = np.ascontiguousarray(bqkv[i * D : (i + 1) * D])
    sd[p + "attention.wo.weight"] = g.linear(D, D)
    if use_linear_bias:
        sd[p + "attention.wo.bias"] = g.bias(D)
    return sd


def _dcmha_compose(g, q, shape, *, use_sw, extra_derived):
    """One layer's DCMHA compose weights (prefix q = "layers.{l}.attention.dyn_w_proj."):
    dw1, qkw, dd, the static pre/post maps with use_sw, and with extra_derived the
    tensors merge_weights() derives from them and the identity projection buffers;
    shape = (dim D, n_head N, rank R, compose_groups G)."""
    D, N, R, G = shape
    K = 4 * N
    G = int(G)
    Mg = N // G  # heads per composition group: the published layout's G axis
    sd = OrderedDict()
    dw1 = g.normal((D, G, 4, K), g.dyn / np.sqrt(D))
    qkw = g.normal((G, 4, K, 2 * R, Mg), g.dyn * 0.6 / np.sqrt(K))
    dd = g.normal((D, G, 4 * Mg), g.dyn / np.sqrt(D))
    sd[q + "dw1"], sd[q + "qkw"], sd[q + "dd"] = dw1, qkw, dd
    pre_w = post_w = None
    if use_sw:
        pre_w = g.normal((G, Mg, Mg), 0.3)
        post_w = g.normal((G, Mg, Mg), 0.3)
    if extra_derived and G == 1:
        # merge_weights() of the published module: dw_m = [dw1 | dd] flattened,
        # qkw_m = qkw reshaped (4, K, 2R*N), sw = static maps + identity.
        sd[q + "dw_m"] = np.concatenate([dw1.reshape(D, -1), dd[:, 0, :]], axis=-1)
        sd[q + "qkw_m"] = qkw.reshape(4, K, -1).copy()
        eye = np.eye(N, dtype=np.float32)
        if use_sw:
            sd[q + "sw"] = np.stack([pre_w[0], post_w[0]]) + eye
        else:
            sd[q + "sw"] = np.stack([eye, eye])
    if use_sw:
        sd[q + "pre_proj.w"] = pre_w
        sd[q + "post_proj.w"] = post_w
    elif extra_derived:
        # identity buffers of CrossHeadProjection when use_sw is off
        sd[q + "pre_proj.w"] = np.broadcast_to(np.eye(Mg, dtype=np.float32), (G, Mg, Mg)).copy()
        sd[q + "post_proj.w"] = np.broadcast_to(np.eye(Mg, dtype=np.float32), (G, Mg, Mg)).copy()
    return sd


def _moh_gates(g, p, *, dim, n_head, shared_heads):
    """One layer's MoH router weights: wg for the routed heads, wg_1 for more than one
    shared head, wg_0 (shared versus routed) when any head is shared."""
    D, N, hs = dim, n_head, shared_heads
    sd = OrderedDict()
    sd[p + "attention.moh.wg.weight"] = g.linear(N - hs, D, gain=2.0)
    if hs > 1:
        sd[p + "attention.moh.wg_1.weight"] = g.linear(hs, D, gain=2.0)
    if hs > 0:
        sd[p + "attention.moh.wg_0.weight"] = g.linear(2, D, gain=2.0)
    return sd


def _qk_norm_scales(g, p, head_dim):
    """One layer's QK-norm scales (~1.2 +- 0.2), q then k (DCPythia and DCFormer++)."""
    sd = OrderedDict()
    sd[p + "attention.q_norm.scale"] = (1.2 + g.normal((head_dim,), 0.2)).astype(np.float32)
    sd[p + "attention.k_norm.scale"] = (1.2 + g.normal((head_dim,), 0.2)).astype(np.float32)
    return sd


def _dcpythia_mlp(g, p, *, dim, intermediate, use_linear_bias):
    """One DCPythia layer's MLP: w1 (and its bias), then w2 (and its bias)."""
    D, F = dim, intermediate
    sd = OrderedDict()
    sd[p + "feed_forward.w1.weight"] = g.linear(F, D)
    if use_linear_bias:
        sd[p + "feed_forward.w1.bias"] = g.bias(F)
    sd[p + "feed_forward.w2.weight"] = g.linear(D, F)
    if use_linear_bias:
        sd[p + "feed_forward.w2.bias"] = g.bias(D)
    return sd


def _dcformer_weights(
    g, *, n_layer, dim, n_head, vocab, intermediate, rank, fused_qkv, use_qk_norm, mgate_dim, extra_derived
):
    """Random DCFormer++ state dict, float32, in the official state_dict() order.
    Scales as _dcpythia_weights (RMSNorm weights 1 +- 0.1); the group gate mg has
    std 2/sqrt(D), so its softmax over E groups is far from uniform."""
    D, N, F, V, R = dim, n_head, intermediate, vocab, rank
    Dh, K = D // N, 4 * N
    sd = OrderedDict()
    sd["tok_embeddings.weight"] = g.normal((V, D), 1.0)
    for l in range(n_layer):
        p = f"layers.{l}."
        wqkv = g.linear(3 * D, D)
        if fused_qkv:
            sd[p + "attention.wqkv.weight"] = wqkv
        else:
            for i, nm in enumerate(("wq", "wk", "wv")):
                sd[p + f"attention.{nm}.weight"] = np.ascontiguousarray(wqkv[i * D : (i + 1) * D])
        sd[p + "attention.wo.weight"] = g.linear(D, D)
        q = p + "attention.dyn_w_proj."
        dw1 = g.normal((D, 1, 4, K), g.dyn / np.sqrt(D))
        qkw = g.normal((1, 4, K, 2 * R, N), g.dyn * 0.6 / np.sqrt(K))
        dd = g.normal((D, 1, 4 * N), g.dyn / np.sqrt(D))
        sd[q + "dw1"], sd[q + "qkw"], sd[q + "dd"] = dw1, qkw, dd
        if extra_derived:  # merge_weights() of the official module, and its identity buffers
            sd[q + "dw_m"] = np.concatenate([dw1.reshape(D, -1), dd[:, 0, :]], axis=-1)
            sd[q + "qkw_m"] = qkw.reshape(4, K, -1).copy()
            sd[q + "pre_proj.w"] = np.eye(N, dtype=np.float32)[None].copy()
            sd[q + "post_proj.w"] = np.eye(N, dtype=np.float32)[None].copy()
        if use_qk_norm:
            sd.update(_qk_norm_scales(g, p, Dh))
        sd[p + "feed_forward.w1.weight"] = g.linear(F, D)
        sd[p + "feed_forward.w3.weight"] = g.linear(F, D)
        sd[p + "feed_forward.w2.weight"] = g.linear(D, F)
        if mgate_dim:
            sd[p + "feed_forward.mg.weight"] = g.linear(mgate_dim, D, gain=2.0)
        sd[p + "ffn_norm.weight"] = (1.0 + g.normal((D,), 0.1)).astype(np.float32)
        sd[p + "attention_norm.weight"] = (1.0 + g.normal((D,), 0.1)).astype(np.float32)
    sd["norm.weight"] = (1.0 + g.normal((D,), 0.1)).astype(np.float32)
    sd["output.weight"] = g.normal((V, D), 3.0 / np.sqrt(D))
    return sd


def _gpt_neox_weights(g, *, n_layer, dim, n_head, vocab, intermediate, rotary_pct, tie_word_embeddings, extra_derived):
    """Random Pythia state dict, float32, in Hugging Face state_dict() order."""
    D, N, F, V = dim, n_head, intermediate, vocab
    Dh = D // N
    r = int(Dh * rotary_pct)
    sd = OrderedDict()
    sd["gpt_neox.embed_in.weight"] = g.normal((V, D), 1.0)
    for l in range(n_layer):
        p = f"gpt_neox.layers.{l}."
        sd[p + "input_layernorm.weight"], sd[p + "input_layernorm.bias"] = g.ln(D)
        sd[p + "post_attention_layernorm.weight"], sd[p + "post_attention_layernorm.bias"] = g.ln(D)
        if extra_derived:
            # buffers HF used to save; loaders must ignore them (attention.bias, a bool
            # causal mask, is not written: safetensors/torch bool storages are out of scope)
            sd[p + "attention.masked_bias"] = np.array(-1e9, dtype=np.float32)
            sd[p + "attention.rotary_emb.inv_freq"] = (
                1.0 / (10000.0 ** (np.arange(0, r, 2, dtype=np.float64) / r))
            ).astype(np.float32)
        # rows grouped per head: [N, (q, k, v), Dh, D]
        sd[p + "attention.query_key_value.weight"] = g.linear(3 * D, D, gain=1.2)
        sd[p + "attention.query_key_value.bias"] = g.bias(3 * D)
        sd[p + "attention.dense.weight"] = g.linear(D, D)
        sd[p + "attention.dense.bias"] = g.bias(D)
        sd[p + "mlp.dense_h_to_4h.weight"] = g.linear(F, D)
        sd[p + "mlp.dense_h_to_4h.bias"] = g.bias(F)
        sd[p + "mlp.dense_4h_to_h.weight"] = g.linear(D, F)
        sd[p + "mlp.dense_4h_to_h.bias"] = g.bias(D)
    sd["gpt_neox.final_layer_norm.weight"], sd["gpt_neox.final_layer_norm.bias"] = g.ln(D)
    out = g.normal((V, D), 3.0 / np.sqrt(D))
    if not tie_word_embeddings:
        sd["embed_out.weight"] = out
    return sd
