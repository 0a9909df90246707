"""Independent numpy reference of the DCFormer++ forward pass (model_type "dcformer").

Written from docs/dcformer-spec.md (never from the C engine or the official
module), in float64. The attention layer is DCPythia's (model-spec.md section 2,
reused from tests/reference.py with rotary over the full head width); what is
DCFormer++'s own is here: RMSNorm blocks with a sequential residual, the SwiGLU
MLP with its optional softmax group gate, the final RMSNorm and the untied output.

    logits = ref_forward_dcformer(state_dict, config, tokens)
    logits, cache = ref_forward_dcformer(sd, cfg, tokens, cache=True)
    logits = ref_forward_dcformer(sd, cfg, tokens, interventions={"blocks.0.mlp.gate": f})

Readings (spec sections in brackets):
  * Block [2]: h = x + Attn(RMS_attn(x)); out = h + MLP(RMS_ffn(h)); RMS(x) =
    x / sqrt(mean(x^2) + norm_eps) * weight (no bias, no centring).
  * MLP [3]: pre = RMS_ffn(h) w1^T (hook mlp.pre), lin = RMS_ffn(h) w3^T
    (mlp.pre_linear), gate = softmax(RMS_ffn(h) mg^T) over E = mgate_dim groups
    (mlp.gate, with mgate), post = silu(pre) * lin, hidden unit f scaled by
    gate[f // (F / E)] (mlp.post), out = post w2^T (mlp.out).
  * Layer l is local when window_size is not null and (window_type null: l even;
    else the named pattern, cycled, has L at l); local: t - s <= window_size.
  * rope_base default 500000; rotary on all Dh dims (pairs j, j + Dh/2).
  * intermediate_size null or missing: the multiple of 256 at or above
    int(2 * 4 * dim / 3).
"""

from __future__ import annotations

import numpy as np

from reference import Hyper, _Hooks, _Weights, attention, linear, rms_norm, softmax


class HyperDCFormer(Hyper):
    """DCFormerConfig's keys and defaults (spec section 1)."""

    def __init__(self, config):  # not super().__init__: it reads DCPythia/Pythia keys only
        c = dict(config)
        if c.get("model_type") != "dcformer":
            raise ValueError("not a dcformer config")
        self.model_type = "dcformer"
        self.D, self.N, self.L, self.V = int(c["dim"]), int(c["n_head"]), int(c["n_layer"]), int(c["vocab_size"])
        self.eps = float(c.get("norm_eps", 1e-5))
        self.rope_base = float(c.get("rope_base", 500000.0))
        self.use_qk_norm = bool(c.get("use_qk_norm", False))
        self.parallel = False
        self.use_dcmha = bool(c.get("use_dcmha", True))
        self.query_wise = bool(c.get("query_wise", False))
        self.key_wise = False
        self.window_size = c.get("window_size", 256)
        self.window_type = c.get("window_type")
        self.tie = False
        self.use_sw = False
        self.moh = None
        self.G = 1
        self.Dh = self.D // self.N
        self.rotary_dims = self.Dh
        self.composes = self.use_dcmha
        F = c.get("intermediate_size")
        if F is None:
            n = int(2 * (4 * self.D) / 3)
            F = n if n % 256 == 0 else n + 256 - n % 256
        self.F = int(F)
        self.E = int(c.get("mgate_dim", 44)) if c.get("mgate", False) else 0

    def is_local(self, layer):
        if self.window_size is None:
            return False
        if self.window_type is None:
            return layer % 2 == 0
        pat = {"LG": "LG", "LGLL": "LGLL", "LGL6": "LGLLLLLL"}[self.window_type]
        return pat[layer % len(pat)] == "L"


class _WeightsDCFormer(_Weights):
    """The dcformer state-dict names (spec section 4)."""

    def embed(self):
        return self.get("tok_embeddings.weight")

    def unembed(self):
        return self.get("output.weight")

    def final_norm(self):
        return self.get("norm.weight"), None

    def norms(self, l):
        p = f"layers.{l}."
        return (self.get(p + "attention_norm.weight"), None), (self.get(p + "ffn_norm.weight"), None)

    def out_proj(self, l):
        return self.get(f"layers.{l}.attention.wo.weight"), None

    def swiglu(self, l):
        p = f"layers.{l}.feed_forward."
        mg = self.get(p + "mg.weight") if self.h.E else None
        return self.get(p + "w1.weight"), self.get(p + "w3.weight"), self.get(p + "w2.weight"), mg


def hook_names_dcformer(config):
    """Every hook name of a dcformer model, in forward order."""
    from reference import hook_names

    h = HyperDCFormer(config)
    cfg = dict(config, model_type="dcpythia", use_parallel_residual=False)  # DCPythia's attention hooks
    names = []
    for n in hook_names(cfg):
        names.append(n)
        if n.endswith(".mlp.pre"):
            names.append(n[: -len("pre")] + "pre_linear")
            if h.E:
                names.append(n[: -len("pre")] + "gate")
    return names


def silu(x):
    return x / (1.0 + np.exp(-x))


def mlp_swiglu(hk, W, h, l, x):
    b = f"blocks.{l}.mlp."
    w1, w3, w2, mg = W.swiglu(l)
    pre = hk(b + "pre", linear(x, w1))
    lin = hk(b + "pre_linear", linear(x, w3))
    post = silu(pre) * lin
    if h.E:
        gate = hk(b + "gate", softmax(linear(x, mg)))  # [T, E]
        post = (post.reshape(len(x), h.E, -1) * gate[:, :, None]).reshape(post.shape)
    post = hk(b + "post", post)
    return hk(b + "out", linear(post, w2))


def block(hk, W, h, l, x):
    b = f"blocks.{l}."
    (wa, _), (wf, _) = W.norms(l)
    x = hk(b + "resid_pre", x)
    rn = lambda r: rms_norm(r, h.eps, wa)  # noqa: E731
    mid = x + attention(hk, W, h, l, hk(b + "ln_attn", rn(x)), resid=x, norm=rn)
    out = mlp_swiglu(hk, W, h, l, hk(b + "ln_mlp", rms_norm(hk(b + "mlp_input", mid), h.eps, wf)))
    return hk(b + "resid_post", mid + out)


def ref_forward_dcformer(state_dict, config, tokens, *, cache=False, interventions=None):
    """Logits [T, V] (float64) for a 1-D token sequence (and the hook cache)."""
    h = HyperDCFormer(config)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or tokens.min() < 0 or tokens.max() >= h.V:
        raise ValueError("tokens must be a non-empty 1-D sequence of ids < vocab_size")
    W = _WeightsDCFormer(state_dict, h)
    hk = _Hooks(interventions, cache)
    x = hk("embed", W.embed()[tokens])
    for l in range(h.L):
        x = block(hk, W, h, l, x)
    wn, _ = W.final_norm()
    x = hk("ln_final", rms_norm(x, h.eps, wn))
    logits = hk("logits", x @ W.unembed().T)
    hk.check_all_fired()
    return (logits, hk.cache) if cache else logits
