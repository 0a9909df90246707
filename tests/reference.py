"""Independent numpy reference of the DCPythia and Pythia forward passes.

Written from ../shared/docs/model-spec.md and ../shared/docs/hooks.md only (never
from the C engine), in float64, one short function per step of the spec.

    logits = ref_forward(state_dict, config, tokens)                   # [T, V]
    logits, cache = ref_forward(state_dict, config, tokens, cache=True)
    logits = ref_forward(sd, cfg, tokens, interventions={"blocks.1.attn.post.kp": lambda a: 0 * a})

`state_dict` maps checkpoint tensor names to arrays (any float dtype; widened to
float64), `config` is the parsed config.json, `tokens` a 1-D int sequence.

Readings of the spec chosen where it leaves room (also listed in READINGS below):
  * The cache holds every hook of hooks.md that exists for the model. "Compose"
    names (pre.*, post.*, scores_composed, pattern_composed) and dyn.* names exist
    only for DCPythia with use_dcmha true; Pythia and DCPythia with use_dcmha false
    have q, k, v, scores, pattern, z, head_out, out (pattern is what multiplies v).
    With query_wise the key-wise names (dyn.*.kw1/kw2/kdd, pre/post.kp/kg) are absent.
  * use_dcmha false: plain MHA with the DCPythia layout; QK-norm (if use_qk_norm) and
    the local/global window pattern still apply; dyn_w_proj weights are ignored.
  * query_wise: dw1/qkw/dd still have 4 slots; slots 0 (pre/query) and 2
    (post/query) are used, slots 1 and 3 are ignored.
  * Rotary dims r = int(Dh * rotary_pct) (both models), pairs (j, j + r/2).
  * Window: layer l is local when window_type is null and l is even, or when the
    named pattern (LG / LGLL / LGL6, cycled) has w at l; w = config window_size.
    Local mask: s <= t and t - s <= window_size.
  * Masked scores are replaced by -65504 before the softmax (in float64 their
    exp underflows to exactly 0, so masked pattern entries are exactly 0).
  * tie_word_embeddings true: logits use the input embedding (output.weight /
    embed_out.weight, if present, are ignored).
  * Interventions: a function called on a copy of the activation at that hook; the
    returned array replaces it for everything downstream and is what the cache
    holds. A branch hook (pre.qp, ...) replaces that branch in the sum. Naming a
    hook that does not exist in the model raises KeyError.
  * Static composition (use_sw, section 5): a sixth branch `static` added to the
    five, weights pre_proj.w / post_proj.w [1, N, N], hooks pre.static / post.static.
  * MoH routing (section 5): the hook attn.z holds z after the routing gate (so the
    head_out / out identity still holds); with shared_heads == 0 there is no wg_0
    balance and g = routed scores; top-k ties broken by lower head index.
  * Grouped composition ("compose_groups": G, issue 16): the published layout's
    group axis, dw1 [D, G, 4, K], qkw [G, 4, K, 2R, N/G], dd [D, G, 4N/G],
    pre/post_proj.w [G, N/G, N/G]. Each group computes its own dynamic weights
    (w1 RMS-normalised over its N/G heads) and heads mix only within their group
    (block-diagonal composition maps). dyn.* hooks keep the [T, R, N] / [T, N]
    layouts, group g's values in heads [g N/G, (g+1) N/G).
  * Null config keys (issue 16): "window_size": null means no local layer;
    "compose_groups" / "moh" / "use_sw" null mean their defaults (off, 1 group).
  * query_wise with 4-slot weights: the key slots (1, 3) are ignored (paper, JAX).
  * "key_wise": true (issue 16, the paper's key-wise-only ablation): the query-wise
    branches (qp, qg) and their dyn.* hooks are absent; slots 0 and 2 are ignored.
"""

from __future__ import annotations

import math

import numpy as np

READINGS = __doc__

MASK_VALUE = -65504.0
QK_NORM_EPS = 1e-6
DYN_NORM_EPS = 1e-6
_BRANCHES = ("skip", "qp", "kp", "qg", "kg")

_erf = np.vectorize(math.erf, otypes=[np.float64])


# --------------------------------------------------------------------------- config


class Hyper:
    """The hyper-parameters the forward pass needs, read from either config layout."""

    def __init__(self, config):
        c = dict(config)
        self.model_type = c.get("model_type")
        if self.model_type == "dcpythia":
            self.D = int(c["dim"])
            self.N = int(c["n_head"])
            self.L = int(c["n_layer"])
            self.V = int(c["vocab_size"])
            self.eps = float(c.get("norm_eps", 1e-5))
            self.rope_base = float(c.get("rope_base", 10000))
            self.rotary_pct = float(c.get("rotary_pct", 0.25))
            self.use_qk_norm = bool(c.get("use_qk_norm", False))
            self.parallel = bool(c.get("use_parallel_residual", True))
            self.use_dcmha = bool(c.get("use_dcmha", True))
            self.query_wise = bool(c.get("query_wise", False))
            self.key_wise = bool(c.get("key_wise", False))  # key-wise-only ablation (issue 16)
            self.window_size = c.get("window_size", 256)
            self.window_type = c.get("window_type")
            self.tie = bool(c.get("tie_word_embeddings", False))
            self.use_sw = bool(c.get("use_sw", False))
            self.moh = c.get("moh")
            self.G = int(c.get("compose_groups") or 1)
        elif self.model_type == "gpt_neox":
            self.D = int(c["hidden_size"])
            self.N = int(c["num_attention_heads"])
            self.L = int(c["num_hidden_layers"])
            self.V = int(c["vocab_size"])
            self.eps = float(c.get("layer_norm_eps", 1e-5))
            self.rope_base = float(c.get("rotary_emb_base", 10000))
            self.rotary_pct = float(c.get("rotary_pct", 0.25))
            self.use_qk_norm = False
            self.parallel = bool(c.get("use_parallel_residual", True))
            self.use_dcmha = False
            self.query_wise = False
            self.key_wise = False
            self.window_size = None
            self.window_type = None
            self.tie = bool(c.get("tie_word_embeddings", False))
            self.use_sw = False
            self.moh = None
            self.G = 1
            act = c.get("hidden_act", "gelu")
            if act != "gelu":
                raise ValueError(f"reference supports hidden_act 'gelu' only, not {act!r}")
        else:
            raise ValueError(f"unknown model_type {self.model_type!r}")
        if self.D % self.N:
            raise ValueError("hidden size must be a multiple of the number of heads")
        self.Dh = self.D // self.N
        self.rotary_dims = int(self.Dh * self.rotary_pct)
        self.composes = self.model_type == "dcpythia" and self.use_dcmha

    def is_local(self, layer):
        """model-spec.md 2 step 7: which layers use the sliding window."""
        if self.model_type != "dcpythia" or self.window_size is None:
            return False
        if self.window_type is None:
            return layer % 2 == 0
        patterns = {
            "LG": ["w", None],
            "LGLL": ["w", None, "w", "w"],
            "LGL6": ["w", None, "w", "w", "w", "w", "w", "w"],
        }
        if self.window_type not in patterns:
            raise ValueError(f"unknown window_type {self.window_type!r}")
        pat = patterns[self.window_type]
        return pat[layer % len(pat)] is not None

    def branches(self):
        names = ["skip", "qp", "kp", "qg", "kg"]
        if self.query_wise:
            names = ["skip", "qp", "qg"]
        if self.key_wise:
            names = ["skip", "kp", "kg"]
        if self.use_sw:
            names.append("static")
        return names


def hook_names(config):
    """Every hook name of hooks.md that exists for this model, in forward order."""
    h = Hyper(config)
    names = ["embed"]
    for l in range(h.L):
        b = f"blocks.{l}."
        a = b + "attn."
        names += [
            b + "resid_pre",
            b + "ln_attn",
            a + "q_input",
            a + "k_input",
            a + "v_input",
            a + "q",
            a + "k",
            a + "v",
        ]
        if h.composes:
            names.append(a + "dyn_input")
            for phase in ("pre", "post"):
                dyn = ["qw1", "qw2", "qdd"] if h.query_wise else ["qw1", "qw2", "kw1", "kw2", "qdd", "kdd"]
                if h.key_wise:
                    dyn = ["kw1", "kw2", "kdd"]
                names += [f"{a}dyn.{phase}.{n}" for n in dyn]
        names.append(a + "scores")
        if h.composes:
            names += [a + "pre." + br for br in h.branches()] + [a + "scores_composed"]
        names.append(a + "pattern")
        if h.composes:
            names += [a + "post." + br for br in h.branches()] + [a + "pattern_composed"]
        if h.moh is not None:
            names += [a + "router_logits", a + "routing"]
        names += [
            a + "z",
            a + "head_out",
            a + "out",
            b + "mlp_input",
            b + "ln_mlp",
            b + "mlp.pre",
            b + "mlp.post",
            b + "mlp.out",
            b + "resid_post",
        ]
    names += ["ln_final", "logits"]
    return names


# --------------------------------------------------------------------------- hooks


class _Hooks:
    """Applies interventions and records the cache."""

    def __init__(self, interventions, want_cache):
        self.interventions = dict(interventions or {})
        self.cache = {} if want_cache else None
        self.fired = set()

    def __call__(self, name, value):
        fn = self.interventions.get(name)
        if fn is not None:
            new = np.asarray(fn(np.array(value, dtype=np.float64, copy=True)), dtype=np.float64)
            if new.shape != value.shape:
                raise ValueError(f"intervention at {name} returned shape {new.shape}, expected {value.shape}")
            value = new
            self.fired.add(name)
        if self.cache is not None:
            self.cache[name] = np.array(value, dtype=np.float64, copy=True)
        return value

    def check_all_fired(self):
        missing = set(self.interventions) - self.fired
        if missing:
            raise KeyError(f"intervention hook(s) not in this model: {sorted(missing)}")


# --------------------------------------------------------------------------- primitives


def layer_norm(x, w, b, eps):
    """LayerNorm over the last axis, with weight and bias."""
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu(x):
    """Exact (erf) gelu."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def linear(x, w, b=None):
    """y = x W^T + b, W stored [out, in]."""
    y = x @ w.T
    return y if b is None else y + b


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def rms_norm(x, eps, scale=None):
    """x / sqrt(mean(x^2 over last axis) + eps) * scale."""
    y = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)
    return y if scale is None else y * scale


def rotary(x, r, base):
    """GPT-NeoX rotate-half on the first r dims of x [T, N, Dh]; positions 0..T-1.
    Pair (x[j], x[j + r/2]), j < r/2, is rotated by angle pos * base^(-2j/r)."""
    if r == 0:
        return x
    T = x.shape[0]
    half = r // 2
    inv_freq = base ** (-2.0 * np.arange(half) / r)  # [r/2]
    ang = np.arange(T)[:, None] * inv_freq[None, :]  # [T, r/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]  # [T, 1, r/2]
    x1, x2 = x[..., :half], x[..., half:r]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:r] = x2 * cos + x1 * sin
    return out


def attention_mask(T, local, window_size):
    """[T, S] bool: causal s <= t, and t - s <= window_size on local layers."""
    t = np.arange(T)[:, None]
    s = np.arange(T)[None, :]
    m = s <= t
    if local:
        m &= (t - s) <= window_size
    return m


# --------------------------------------------------------------------------- weights


class _Weights:
    """float64 views of the checkpoint tensors a layer needs, by role."""

    def __init__(self, sd, h):
        self.sd = sd
        self.h = h

    def get(self, name, required=True):
        if name in self.sd:
            return np.asarray(self.sd[name], dtype=np.float64)
        if required:
            raise KeyError(f"missing tensor {name!r}")
        return None

    # -- embeddings
    def embed(self):
        return self.get("tok_embeddings.weight" if self.h.model_type == "dcpythia" else "gpt_neox.embed_in.weight")

    def unembed(self):
        if self.h.tie:
            return self.embed()
        return self.get("output.weight" if self.h.model_type == "dcpythia" else "embed_out.weight")

    def final_norm(self):
        p = "norm." if self.h.model_type == "dcpythia" else "gpt_neox.final_layer_norm."
        return self.get(p + "weight"), self.get(p + "bias")

    # -- per layer
    def norms(self, l):
        if self.h.model_type == "dcpythia":
            p = f"layers.{l}."
            return (
                (self.get(p + "attention_norm.weight"), self.get(p + "attention_norm.bias")),
                (self.get(p + "ffn_norm.weight"), self.get(p + "ffn_norm.bias")),
            )
        p = f"gpt_neox.layers.{l}."
        return (
            (self.get(p + "input_layernorm.weight"), self.get(p + "input_layernorm.bias")),
            (self.get(p + "post_attention_layernorm.weight"), self.get(p + "post_attention_layernorm.bias")),
        )

    def qkv(self, l, x):
        """q, k, v [T, N, Dh] from the normed input x [T, D] (step 1)."""
        T, N, Dh, D = x.shape[0], self.h.N, self.h.Dh, self.h.D
        if self.h.model_type == "gpt_neox":
            p = f"gpt_neox.layers.{l}.attention.query_key_value."
            qkv = linear(x, self.get(p + "weight"), self.get(p + "bias", required=False))  # [T, 3D]
            qkv = qkv.reshape(T, N, 3, Dh)  # rows grouped per head: q, k, v of head n
            return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        p = f"layers.{l}.attention."
        if p + "wqkv.weight" in self.sd:
            qkv = linear(x, self.get(p + "wqkv.weight"), self.get(p + "wqkv.bias", required=False))  # [T, 3D]
            q, k, v = qkv[:, :D], qkv[:, D : 2 * D], qkv[:, 2 * D :]
        else:
            q, k, v = (
                linear(x, self.get(p + n + ".weight"), self.get(p + n + ".bias", required=False))
                for n in ("wq", "wk", "wv")
            )
        return q.reshape(T, N, Dh), k.reshape(T, N, Dh), v.reshape(T, N, Dh)

    def qk_norm_scales(self, l):
        p = f"layers.{l}.attention."
        return self.get(p + "q_norm.scale"), self.get(p + "k_norm.scale")

    def out_proj(self, l):
        p = f"layers.{l}.attention.wo." if self.h.model_type == "dcpythia" else f"gpt_neox.layers.{l}.attention.dense."
        return self.get(p + "weight"), self.get(p + "bias", required=False)

    def mlp(self, l):
        if self.h.model_type == "dcpythia":
            p = f"layers.{l}.feed_forward."
            n1, n2 = "w1", "w2"
        else:
            p = f"gpt_neox.layers.{l}.mlp."
            n1, n2 = "dense_h_to_4h", "dense_4h_to_h"
        return (
            self.get(p + n1 + ".weight"),
            self.get(p + n1 + ".bias", required=False),
            self.get(p + n2 + ".weight"),
            self.get(p + n2 + ".bias", required=False),
        )

    def dyn(self, l):
        p = f"layers.{l}.attention.dyn_w_proj."
        return self.get(p + "dw1"), self.get(p + "qkw"), self.get(p + "dd")

    def static(self, l, phase):
        return self.get(f"layers.{l}.attention.dyn_w_proj.{phase}_proj.w")  # [G, N/G, N/G]

    def moh(self, l):
        p = f"layers.{l}.attention.moh."
        return (
            self.get(p + "wg.weight"),
            self.get(p + "wg_1.weight", required=False),
            self.get(p + "wg_0.weight", required=False),
        )


# --------------------------------------------------------------------------- DCMHA pieces


def dynamic_weights(x, dw1, qkw, dd, R):
    """model-spec.md 2 step 4, per composition group (dw1 [D, G, 4, K], qkw
    [G, 4, K, 2R, Mg], dd [D, G, 4 Mg]). x [T, D] -> per slot c (0 pre/q, 1 pre/k,
    2 post/q, 3 post/k): w1 [T, 4, R, N] (RMS-normalised over each group's heads),
    w2 [T, 4, R, N], g [T, 4, N], group g's values in heads [g Mg, (g+1) Mg)."""
    T = x.shape[0]
    G, C, Mg = qkw.shape[0], qkw.shape[1], qkw.shape[4]
    hid = gelu(np.einsum("td,dgck->tgck", x, dw1))  # [T, G, C, K]
    w = np.einsum("tgck,gckrm->tgcrm", hid, qkw)  # [T, G, C, 2R, Mg]
    w1 = rms_norm(w[:, :, :, :R, :], DYN_NORM_EPS)  # over the group's heads, no scale
    w2 = w[:, :, :, R:, :]
    to_n = lambda a: a.transpose(0, 2, 3, 1, 4).reshape(T, C, R, G * Mg)  # [T, C, R, N]
    g = np.tanh(np.einsum("td,dgj->tgj", x, dd)).reshape(T, G, C, Mg)
    return to_n(w1), to_n(w2), g.transpose(0, 2, 1, 3).reshape(T, C, G * Mg)


def compose_branches(A, dw, query_wise, static=None, G=1):
    """Step 6 (and 9): the branches of Compose for A [N, T, S], heads mixing within
    G groups. dw: dict with qw1, qw2 [T, R, N], qdd [T, N] and (unless query_wise)
    kw1, kw2 [S, R, N], kdd [S, N]; static [G, N/G, N/G] or None. Returns an
    ordered dict branch name -> [N, T, S]."""
    N, T, S = A.shape
    Mg = N // G
    Ag = A.reshape(G, Mg, T, S)
    grp = lambda w: w.reshape(w.shape[0], w.shape[1], G, Mg)  # [T, R, N] -> [T, R, G, Mg]
    out = {"skip": A}
    if "qw1" in dw:  # absent for key-wise-only composition
        hidden = np.einsum("gnts,tign->gits", Ag, grp(dw["qw1"]))  # sum_n A[n,t,s] qw1[t,i,n], n in g
        out["qp"] = np.einsum("gits,tigm->gmts", hidden, grp(dw["qw2"])).reshape(N, T, S)
    if not query_wise:
        hidden = np.einsum("gnts,sign->gits", Ag, grp(dw["kw1"]))  # sum_n A[n,t,s] kw1[s,i,n]
        out["kp"] = np.einsum("gits,sigm->gmts", hidden, grp(dw["kw2"])).reshape(N, T, S)
    if "qdd" in dw:
        out["qg"] = A * dw["qdd"].T[:, :, None]  # A[m,t,s] qdd[t,m]
    if not query_wise:
        out["kg"] = A * dw["kdd"].T[:, None, :]  # A[m,t,s] kdd[s,m]
    if static is not None:
        static = np.asarray(static).reshape(G, Mg, Mg)
        out["static"] = np.einsum("gnts,gnm->gmts", Ag, static).reshape(N, T, S)  # sum_n A[n] W[n,m]
    return out


def _compose(hk, prefix, A, dw, query_wise, static, G=1):
    """Run the branches through their hooks and sum them."""
    branches = compose_branches(A, dw, query_wise, static, G)
    total = np.zeros_like(A)
    for name, val in branches.items():
        total = total + hk(prefix + name, val)
    return total


def ref_composition_map(cache, layer, phase, t, s, N=None, static=None, G=1):
    """C[t,s] [N, N] from the cached dynamic weights of `layer`/`phase` ("pre"/"post"):
    C = I + qw1[t]^T qw2[t] + kw1[s]^T kw2[s] + diag(qdd[t]) + diag(kdd[s]) (+ static),
    C[n, m] = weight of source head n into target head m, so that
    scores_composed[:, t, s] == C^T @ scores[:, t, s]. Key-wise terms are skipped
    when the cache has none (query_wise). With G groups the dynamic projections
    act within groups (C block-diagonal); static is [N, N] or [G, N/G, N/G]."""
    p = f"blocks.{layer}.attn.dyn.{phase}."
    if N is None:
        N = cache[p + ("qdd" if p + "qdd" in cache else "kdd")].shape[1]
    block = np.kron(np.eye(G), np.ones((N // G, N // G)))  # 1 within a group
    C = np.eye(N)
    if p + "qw1" in cache:  # absent for key-wise-only composition
        qw1, qw2, qdd = cache[p + "qw1"][t], cache[p + "qw2"][t], cache[p + "qdd"][t]  # [R, N], [R, N], [N]
        C = C + (qw1.T @ qw2) * block + np.diag(qdd)
    if p + "kw1" in cache:
        kw1, kw2, kdd = cache[p + "kw1"][s], cache[p + "kw2"][s], cache[p + "kdd"][s]
        C = C + (kw1.T @ kw2) * block + np.diag(kdd)
    if static is not None:
        static = np.asarray(static)
        if static.ndim == 3:  # [G, Mg, Mg] blocks
            full = np.zeros((N, N))
            Mg = N // static.shape[0]
            for g in range(static.shape[0]):
                full[g * Mg : (g + 1) * Mg, g * Mg : (g + 1) * Mg] = static[g]
            static = full
        C = C + static
    return C


def _moh_gates(hk, a, x, wg, wg_1, wg_0, hs, k):
    """model-spec.md 5, MoH: routing scores g [T, N] from x [T, D]."""
    T = x.shape[0]
    logits = hk(a + "router_logits", x @ wg.T)  # [T, N - hs]
    p = softmax(logits)
    order = np.argsort(-p, axis=-1, kind="stable")[:, :k]  # top-k routed heads
    sel = np.zeros_like(p, dtype=bool)
    np.put_along_axis(sel, order, True, axis=-1)
    routed = np.where(sel, p, 0.0)
    routed = routed / routed.sum(-1, keepdims=True) * k
    if hs == 0:
        return hk(a + "routing", routed)
    shared = softmax(x @ wg_1.T) * hs if hs > 1 else np.ones((T, 1)) * hs
    bal = softmax(x @ wg_0.T) * 2  # [T, 2]: shared vs routed
    g = np.concatenate([bal[:, :1] * shared, bal[:, 1:2] * routed], axis=-1)
    return hk(a + "routing", g)


# --------------------------------------------------------------------------- layers


def split_inputs(hk, W, h, l, q, k, v, resid, norm):
    """hooks.md's attn.{q,k,v}_input [T, N, D]: the residual stream as each
    head's Q, K, V input reads it, one copy per head, before the attention
    norm. A copy an intervention rewrote is normed and projected per head:
    head n's q (k, v) is then norm(copy n) through head n's rows (all heads
    from their copies); otherwise q, k, v stay as the shared path gave them."""
    a = f"blocks.{l}.attn."
    out = []
    for part, (name, y) in enumerate((("q_input", q), ("k_input", k), ("v_input", v))):
        copies = hk(a + name, np.broadcast_to(resid[:, None, :], (resid.shape[0], h.N, h.D)).copy())
        if a + name in hk.interventions:
            y = np.stack([W.qkv(l, norm(copies[:, n]))[part][:, n] for n in range(h.N)], axis=1)
        out.append(y)
    return out


def attention(hk, W, h, l, x, resid=None, norm=None):
    """One attention layer on the normed input x [T, D] -> out [T, D]; resid
    (the un-normed block input) and norm give the split q/k/v inputs."""
    a = f"blocks.{l}.attn."
    T, N, Dh = x.shape[0], h.N, h.Dh

    # 1-3: projections (through the split inputs), QK-norm, rotary
    q, k, v = W.qkv(l, x)  # [T, N, Dh] each
    if resid is not None:
        q, k, v = split_inputs(hk, W, h, l, q, k, v, resid, norm)
    if h.use_qk_norm:
        qs, ks = W.qk_norm_scales(l)
        q, k = rms_norm(q, QK_NORM_EPS, qs), rms_norm(k, QK_NORM_EPS, ks)
    q = hk(a + "q", rotary(q, h.rotary_dims, h.rope_base))
    k = hk(a + "k", rotary(k, h.rotary_dims, h.rope_base))
    v = hk(a + "v", v)

    # 4: dynamic weights
    if h.composes:
        dw1, qkw, dd = W.dyn(l)
        R = qkw.shape[3] // 2
        xd = x  # the dynamic-weight MLP reads the normed input, or its own split input
        if resid is not None:
            copy = hk(a + "dyn_input", np.array(resid, copy=True))
            if a + "dyn_input" in hk.interventions:
                xd = norm(copy)
        w1, w2, g = dynamic_weights(xd, dw1, qkw, dd, R)
        dyn = {}
        for phase, (cq, ck) in (("pre", (0, 1)), ("post", (2, 3))):
            p = f"{a}dyn.{phase}."
            d = {}
            if not h.key_wise:
                d["qw1"] = hk(p + "qw1", w1[:, cq])
                d["qw2"] = hk(p + "qw2", w2[:, cq])
            if not h.query_wise:
                d["kw1"] = hk(p + "kw1", w1[:, ck])
                d["kw2"] = hk(p + "kw2", w2[:, ck])
            if not h.key_wise:
                d["qdd"] = hk(p + "qdd", g[:, cq])
            if not h.query_wise:
                d["kdd"] = hk(p + "kdd", g[:, ck])
            dyn[phase] = d

    # 5: scores
    A = hk(a + "scores", np.einsum("tnd,snd->nts", q, k) / math.sqrt(Dh))  # [N, T, S]

    # 6: pre-compose
    if h.composes:
        static = W.static(l, "pre") if h.use_sw else None
        A = hk(a + "scores_composed", _compose(hk, a + "pre.", A, dyn["pre"], h.query_wise, static, h.G))

    # 7-8: mask, softmax
    mask = attention_mask(T, h.is_local(l), h.window_size)  # [T, S]
    P = hk(a + "pattern", softmax(np.where(mask[None], A, MASK_VALUE), axis=-1))  # [N, T, S]

    # 9: post-compose
    if h.composes:
        static = W.static(l, "post") if h.use_sw else None
        P = hk(a + "pattern_composed", _compose(hk, a + "post.", P, dyn["post"], h.query_wise, static, h.G))

    # 10: values, (MoH gate), output projection
    z = np.einsum("nts,snd->tnd", P, v)  # [T, N, Dh]
    if h.moh is not None:
        wg, wg_1, wg_0 = W.moh(l)
        gates = _moh_gates(hk, a, x, wg, wg_1, wg_0, int(h.moh["shared_heads"]), int(h.moh["routed_topk"]))
        z = z * gates[:, :, None]
    z = hk(a + "z", z)
    wo, bo = W.out_proj(l)
    head_out = hk(a + "head_out", np.einsum("tnd,end->tne", z, wo.reshape(h.D, N, Dh)))  # [T, N, D]
    out = head_out.sum(1)
    if bo is not None:
        out = out + bo
    return hk(a + "out", out)


def mlp(hk, W, l, x):
    b = f"blocks.{l}."
    w1, b1, w2, b2 = W.mlp(l)
    pre = hk(b + "mlp.pre", linear(x, w1, b1))
    post = hk(b + "mlp.post", gelu(pre))
    return hk(b + "mlp.out", linear(post, w2, b2))


def block(hk, W, h, l, x):
    """h = x + Attn(LN_attn(x)); out = h + MLP(LN_ffn(x or h))."""
    b = f"blocks.{l}."
    (wa, ba), (wf, bf) = W.norms(l)
    x = hk(b + "resid_pre", x)
    ln = lambda r: layer_norm(r, wa, ba, h.eps)  # noqa: E731
    attn_out = attention(hk, W, h, l, hk(b + "ln_attn", ln(x)), resid=x, norm=ln)
    mid = x + attn_out
    mlp_in = x if h.parallel else mid
    mlp_out = mlp(hk, W, l, hk(b + "ln_mlp", layer_norm(hk(b + "mlp_input", mlp_in), wf, bf, h.eps)))
    return hk(b + "resid_post", mid + mlp_out)


# --------------------------------------------------------------------------- model


def ref_forward(state_dict, config, tokens, *, cache=False, interventions=None):
    """Logits [T, V] (float64) for a 1-D token sequence; with cache=True also the
    dict hook name -> activation (layouts of hooks.md, one sequence)."""
    h = Hyper(config)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError("tokens must be 1-D")
    if tokens.size == 0:
        raise ValueError("empty token sequence")
    if tokens.min() < 0 or tokens.max() >= h.V:
        raise ValueError("token id out of range")
    W = _Weights(state_dict, h)
    hk = _Hooks(interventions, cache)

    x = hk("embed", W.embed()[tokens])  # [T, D]
    for l in range(h.L):
        x = block(hk, W, h, l, x)
    wn, bn = W.final_norm()
    x = hk("ln_final", layer_norm(x, wn, bn, h.eps))
    logits = hk("logits", x @ W.unembed().T)  # [T, V], no bias
    hk.check_all_fired()
    return (logits, hk.cache) if cache else logits
