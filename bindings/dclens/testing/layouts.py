"""The tensor names and shapes of the two published checkpoint layouts.

    dcpythia_tensors(n_layer=2, dim=32, n_head=4, vocab=64, intermediate=128)
    gpt_neox_tensors(n_layer=2, dim=32, n_head=4, vocab=64, intermediate=128)

each an OrderedDict name -> shape in torch state_dict() order (see
shared/docs/model-spec.md). The one place the test fixtures take them from:
make_tiny checks every state dict it draws against it, the fuzz corpus'
index seeds and the C tests' checkpoints (dclens.testing.fixtures) are
made from it.

* DCPythia ("dcpythia"): tok_embeddings, layers.{l}.attention.wqkv (or
  wq/wk/wv), wo, dyn_w_proj.dw1 [D, G, 4, K], qkw [G, 4, K, 2R, N/G],
  dd [D, G, 4N/G] (K = 4N), q_norm/k_norm.scale [Dh], feed_forward.w1/w2,
  ffn_norm, attention_norm, then norm and output.
* Pythia ("gpt_neox"): Hugging Face GPTNeoXForCausalLM names.
"""

from __future__ import annotations

from collections import OrderedDict

Shape = tuple[int, ...]


def _attention_projections(out, p: str, D: int, fused_qkv: bool, bias: bool) -> None:
    """wqkv [3D, D] (or wq, wk, wv [D, D]) and wo [D, D] of layer prefix p, with biases if asked."""
    if fused_qkv:
        out[p + "attention.wqkv.weight"] = (3 * D, D)
        if bias:
            out[p + "attention.wqkv.bias"] = (3 * D,)
    else:
        for nm in ("wq", "wk", "wv"):
            out[p + "attention.%s.weight" % nm] = (D, D)
            if bias:
                out[p + "attention.%s.bias" % nm] = (D,)
    out[p + "attention.wo.weight"] = (D, D)
    if bias:
        out[p + "attention.wo.bias"] = (D,)


def _dyn_w_proj(
    out, q: str, D: int, N: int, R: int, G: int, *, use_sw: bool, extra_derived: bool, merged_sw: bool
) -> None:
    """dyn_w_proj's tensors (prefix q): dw1 [D, G, 4, K], qkw [G, 4, K, 2R, N/G],
    dd [D, G, 4N/G] (K = 4N); with extra_derived and G = 1 the merged dw_m, qkw_m
    (and sw [2, N, N] when merged_sw); pre/post_proj.w [G, N/G, N/G] with use_sw or
    extra_derived."""
    K, Mg = 4 * N, N // G
    out[q + "dw1"] = (D, G, 4, K)
    out[q + "qkw"] = (G, 4, K, 2 * R, Mg)
    out[q + "dd"] = (D, G, 4 * Mg)
    if extra_derived and G == 1:
        out[q + "dw_m"] = (D, 4 * K + 4 * N)
        out[q + "qkw_m"] = (4, K, 2 * R * N)
        if merged_sw:
            out[q + "sw"] = (2, N, N)
    if use_sw or extra_derived:
        out[q + "pre_proj.w"] = (G, Mg, Mg)
        out[q + "post_proj.w"] = (G, Mg, Mg)


def _qk_norm_scales(out, p: str, Dh: int) -> None:
    """q_norm.scale and k_norm.scale [Dh] of layer prefix p."""
    out[p + "attention.q_norm.scale"] = (Dh,)
    out[p + "attention.k_norm.scale"] = (Dh,)


def _norms(out, names, D: int, bias: bool = True) -> None:
    """weight [D] (and bias [D]) of each norm in names (full prefixes), in order."""
    for n in names:
        out[n + ".weight"] = (D,)
        if bias:
            out[n + ".bias"] = (D,)


def _final_norm_and_unembedding(out, norm: str, unembedding: str, D: int, V: int, bias: bool, tied: bool) -> None:
    """The final norm (weight and bias [D], or weight only) and the untied unembedding [V, D]."""
    _norms(out, (norm,), D, bias)
    if not tied:
        out[unembedding + ".weight"] = (V, D)


def dcpythia_tensors(
    *,
    n_layer: int,
    dim: int,
    n_head: int,
    vocab: int,
    intermediate: int,
    rank: int = 2,
    fused_qkv: bool = True,
    use_qk_norm: bool = True,
    use_linear_bias: bool = True,
    dyn: bool = True,
    compose_groups: int = 1,
    use_sw: bool = False,
    moh: dict | None = None,
    tie_word_embeddings: bool = False,
    extra_derived: bool = False,
) -> dict[str, Shape]:
    """DCPythia tensors. dyn: write dyn_w_proj (the published module always
    has it, also with use_dcmha off); extra_derived: also the merged
    dw_m/qkw_m/sw and the identity pre/post_proj.w buffers loaders ignore."""
    D, N, F, V, R = dim, n_head, intermediate, vocab, rank
    Dh, G = D // N, int(compose_groups)
    out: dict[str, Shape] = OrderedDict()
    out["tok_embeddings.weight"] = (V, D)
    for l in range(n_layer):
        p = "layers.%d." % l
        _attention_projections(out, p, D, fused_qkv, use_linear_bias)
        if dyn:
            _dyn_w_proj(
                out, p + "attention.dyn_w_proj.", D, N, R, G, use_sw=use_sw, extra_derived=extra_derived, merged_sw=True
            )
        if moh is not None:
            hs = int(moh["shared_heads"])
            out[p + "attention.moh.wg.weight"] = (N - hs, D)
            if hs > 1:
                out[p + "attention.moh.wg_1.weight"] = (hs, D)
            if hs > 0:
                out[p + "attention.moh.wg_0.weight"] = (2, D)
        if use_qk_norm:
            _qk_norm_scales(out, p, Dh)
        out[p + "feed_forward.w1.weight"] = (F, D)
        if use_linear_bias:
            out[p + "feed_forward.w1.bias"] = (F,)
        out[p + "feed_forward.w2.weight"] = (D, F)
        if use_linear_bias:
            out[p + "feed_forward.w2.bias"] = (D,)
        _norms(out, (p + "ffn_norm", p + "attention_norm"), D)
    _final_norm_and_unembedding(out, "norm", "output", D, V, bias=True, tied=tie_word_embeddings)
    return out


def gpt_neox_tensors(
    *,
    n_layer: int,
    dim: int,
    n_head: int,
    vocab: int,
    intermediate: int,
    rotary_pct: float = 0.25,
    tie_word_embeddings: bool = False,
    extra_derived: bool = False,
) -> dict[str, Shape]:
    """Pythia tensors; query_key_value rows grouped per head (head n owns rows
    [n*3*Dh, (n+1)*3*Dh): its q, k, v). extra_derived: also the buffers older
    Hugging Face versions saved (attention.masked_bias [], rotary_emb.inv_freq
    [r/2], both F32), which loaders ignore."""
    D, F, V = dim, intermediate, vocab
    r = int((D // n_head) * rotary_pct)
    out: dict[str, Shape] = OrderedDict()
    out["gpt_neox.embed_in.weight"] = (V, D)
    for l in range(n_layer):
        p = "gpt_neox.layers.%d." % l
        _norms(out, (p + "input_layernorm", p + "post_attention_layernorm"), D)
        if extra_derived:
            out[p + "attention.masked_bias"] = ()
            out[p + "attention.rotary_emb.inv_freq"] = (len(range(0, r, 2)),)
        out[p + "attention.query_key_value.weight"] = (3 * D, D)
        out[p + "attention.query_key_value.bias"] = (3 * D,)
        out[p + "attention.dense.weight"] = (D, D)
        out[p + "attention.dense.bias"] = (D,)
        out[p + "mlp.dense_h_to_4h.weight"] = (F, D)
        out[p + "mlp.dense_h_to_4h.bias"] = (F,)
        out[p + "mlp.dense_4h_to_h.weight"] = (D, F)
        out[p + "mlp.dense_4h_to_h.bias"] = (D,)
    _final_norm_and_unembedding(
        out, "gpt_neox.final_layer_norm", "embed_out", D, V, bias=True, tied=tie_word_embeddings
    )
    return out


def dcformer_tensors(
    *,
    n_layer: int,
    dim: int,
    n_head: int,
    vocab: int,
    mgate_dim: int = 0,
    intermediate: int,
    rank: int = 2,
    fused_qkv: bool = True,
    use_qk_norm: bool = True,
    extra_derived: bool = False,
) -> dict[str, Shape]:
    """DCFormer++ tensors (docs/dcformer-spec.md), in the official module's
    state_dict() order: no biases, RMSNorm weights only, SwiGLU w1/w3/w2 and
    the group gate mg [E, D] (mgate_dim E > 0), an untied output. extra_derived:
    also the merged dw_m/qkw_m parameters and the identity pre/post_proj.w
    buffers the official module saves (no sw: a plain attribute there)."""
    D, N, F, V, R = dim, n_head, intermediate, vocab, rank
    Dh = D // N
    out: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    out["tok_embeddings.weight"] = (V, D)
    for l in range(n_layer):
        p = "layers.%d." % l
        _attention_projections(out, p, D, fused_qkv, False)
        _dyn_w_proj(
            out, p + "attention.dyn_w_proj.", D, N, R, 1, use_sw=False, extra_derived=extra_derived, merged_sw=False
        )
        if use_qk_norm:
            _qk_norm_scales(out, p, Dh)
        out[p + "feed_forward.w1.weight"] = (F, D)
        out[p + "feed_forward.w3.weight"] = (F, D)
        out[p + "feed_forward.w2.weight"] = (D, F)
        if mgate_dim:
            out[p + "feed_forward.mg.weight"] = (mgate_dim, D)
        _norms(out, (p + "ffn_norm", p + "attention_norm"), D, bias=False)
    _final_norm_and_unembedding(out, "norm", "output", D, V, bias=False, tied=False)
    return out
