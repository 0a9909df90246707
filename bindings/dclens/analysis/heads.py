"""Head diversity and redundancy, composition statistics and MoH head load,
over a dataset, for any model dclens loads (issue 16).

    from dclens import analysis
    data = ["The cat sat on the mat.", ...]            # strings or 1-D token arrays
    pca = analysis.head_output_pca(model, data)          # {layer: PCAResult}
    pca[3].n_components_90, pca[3].ratio                 # redundancy of layer 3's heads
    analysis.qk_ov_diversity(model)                      # DCFormer Figure 5 measure
    S = analysis.head_similarity(model, 3, data)         # [N, N] cosine similarity
    stats = analysis.composition_stats(model, data)      # {(layer, phase): CompositionStats}
    analysis.head_load(model, data)                      # [L, N - hs] (MoH models)
    fig = analysis.plot_pca(pca)                         # figures (dclens.viz.measures)

Measures (all exact accumulations over every token of every sequence):

* head_output_pca, mode "heads": each head's output over the dataset (its
  attn.head_out rows z_n W_O,n, all tokens and dims flattened) is one sample;
  PCA across the N heads (centred over heads). ratio[i] is the fraction of
  the variance among the heads on component i, n_components_90 how many
  components cover 90%: few means redundant heads (DEACON's view). Mode
  "tokens": each token is a sample, its features the concatenated per-head
  mixed values attn.z [N * Dh]; PCA across tokens (centred): how many
  directions the heads' joint output really uses.
* qk_ov_diversity: circuits.head_diversity per layer (DCFormer Figure 5,
  Cordonnier et al. 2020): mean cumulative captured variance of the
  concatenated per-head QK (OV) matrices; lower = more diverse.
* head_similarity: cosine similarity between heads, of their outputs over the
  dataset (kind "output": <h_n, h_m> / |h_n| |h_m| with h_n head n's
  head_out over all tokens), or of their QK / OV circuit matrices (Frobenius).
* composition_stats: for each DCMHA layer and phase, over every (query t,
  key s) pair the mask allows, the mean |entry| of each branch's term of the
  composition map C[t,s] - I (qp: qw1^T qw2, kp: kw1^T kw2, qg: diag(qdd),
  kg: diag(kdd), static: W; block-diagonal with compose_groups) and of their
  sum ("total": mean |C - I|); and which head pairs route most: pair_flow[n, m]
  = mean over queries t of |sum_s X[n,t,s] (C[t,s] - I)[n,m]|, X the phase's
  input (masked scores for pre, the pattern for post), with the top
  off-diagonal pairs.
* head_load: MoH models: per layer, the fraction of tokens whose top-k routed
  heads (largest router logit, ties to the lower index, as the engine
  selects) include each routed head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from .._core import progress as _progress
from .._core.checks import check_index, check_layers, is_choice
from .._core.mask import allowed, layer_window
from .._core.names import PHASES, hook_name
from ..model import Error, Model
from ..viz.measures import plot_composition_stats, plot_diversity, plot_head_load, plot_pca, plot_similarity  # noqa: F401  (analysis.plot_pca, ...)
from . import qkov as circuits
from .routing import _dyn_names, static_map

__all__ = [
    "PCAResult",
    "CompositionStats",
    "iter_dataset",
    "head_output_pca",
    "qk_ov_diversity",
    "head_similarity",
    "composition_stats",
    "head_load",
    "plot_pca",
    "plot_similarity",
    "plot_composition_stats",
    "plot_head_load",
    "plot_diversity",
]


# ------------------------------------------------------------ dataset


def iter_dataset(model: Model, dataset, progress: bool | None = None, desc: str = "dataset") -> Iterator[np.ndarray]:
    """The dataset's sequences, one at a time, as token arrays, with a progress bar.

    Parameters
    ----------
    model : dclens.Model
        The model whose tokenizer reads the strings.
    dataset : str or array_like or iterable
        Strings (tokenized with the model's tokenizer) or 1-D token arrays, or one of
        them; a 2-D token array gives its rows.
    progress : bool or None
        dclens.progress's bar over the sequences (None: a bar where someone watches, a few
        plain lines in a log; False: nothing).
    desc : str
        The bar's label.

    Yields
    ------
    numpy.ndarray
        [T] int32 token ids of one sequence.

    Raises
    ------
    dclens.Error
        A dataset that is not a string, a token array or an iterable of them (a dict or a
        set), an item that is not a string or a non-empty 1-D integer array, or an empty
        dataset (raised once iterated to its end).
    """
    if isinstance(dataset, (str, bytes)):
        dataset = [dataset]
    if isinstance(dataset, np.ndarray) and dataset.ndim == 1 and dataset.dtype.kind in "iu":
        dataset = [dataset]
    if (
        isinstance(dataset, (dict, set, bytes))
        or not hasattr(dataset, "__iter__")
        or (isinstance(dataset, np.ndarray) and dataset.ndim == 0)
    ):
        raise Error(
            "dataset must be a string, a token array or a list of them, not %s %r" % (type(dataset).__name__, dataset)
        )
    try:
        total = len(dataset)
    except TypeError:
        total = None
    it = _progress.bar(dataset, total=total, desc=desc, unit="seq", progress=progress)
    n = 0
    for item in it:
        toks = model.to_tokens(item) if isinstance(item, str) else np.asarray(item)
        if toks.ndim != 1 or toks.size == 0 or toks.dtype.kind not in "iu":
            raise Error(
                "dataset item %d: need a string or a non-empty 1-D integer token array, got %s"
                % (n, getattr(toks, "shape", type(item).__name__))
            )
        n += 1
        yield toks.astype(np.int32)
    if n == 0:
        raise Error("the dataset is empty")


def _layers(model: Model, layers: Iterable[int] | None) -> list[int]:
    return check_layers(layers, model.config.n_layer)


# ------------------------------------------------------------ PCA of head outputs


@dataclasses.dataclass
class PCAResult:
    """Principal components of one layer's head outputs (head_output_pca).

    Attributes
    ----------
    layer : int
        The layer.
    mode : str
        "heads" (each head's output over the dataset is a sample) or "tokens" (each token
        is a sample, its features the heads' concatenated attn.z).
    variance : numpy.ndarray
        The variance on each component, descending: [N] (mode "heads") or [N * Dh].
    ratio : numpy.ndarray
        The fraction of the total variance on each component.
    cumulative : numpy.ndarray
        The cumulative sum of `ratio`.
    n_components_90 : int
        How many components hold 90 % of the variance (few: redundant heads).
    n_samples : int
        The samples: N heads (mode "heads") or the dataset's tokens (mode "tokens").
    """

    layer: int
    mode: str  # "heads" or "tokens"
    variance: np.ndarray  # variance on each component, descending
    ratio: np.ndarray  # fraction of the total variance per component
    cumulative: np.ndarray  # cumulative fraction
    n_components_90: int  # components needed for 90% of the variance
    n_samples: int  # heads (mode "heads") or tokens (mode "tokens")


def _pca_from_scatter(scatter: np.ndarray, n: int, layer: int, mode: str) -> PCAResult:
    ev = np.clip(np.linalg.eigvalsh(scatter)[::-1], 0.0, None)
    total = ev.sum()
    ratio = ev / total if total > 0 else np.zeros_like(ev)
    cum = np.cumsum(ratio)
    k = int(np.searchsorted(cum, 0.9 - 1e-12) + 1) if total > 0 else 0
    return PCAResult(layer, mode, ev / max(n - 1, 1), ratio, cum, min(k, len(ev)), n)


def head_output_pca(
    model: Model, dataset, layers: Iterable[int] | None = None, mode: str = "heads", progress: bool | None = None
) -> dict[int, PCAResult]:
    """PCA of the per-head outputs of each layer over a dataset (the module's docstring).

    Parameters
    ----------
    model : dclens.Model
        The model.
    dataset : str or array_like or iterable
        The sequences, as for iter_dataset.
    layers : iterable of int or None
        The layers (None: all).
    mode : {"heads", "tokens"}
        "heads": PCA across the N heads of their attn.head_out over every token (centred over
        heads); "tokens": PCA across tokens of the concatenated attn.z [N * Dh] (centred).
    progress : bool or None
        The bar over the sequences, as for iter_dataset.

    Returns
    -------
    dict of int to PCAResult
        Layer -> its principal components.

    Raises
    ------
    dclens.Error
        An unknown mode, a layer out of range, or a bad dataset (iter_dataset).
    """
    if not is_choice(mode, ("heads", "tokens")):
        raise Error("mode must be 'heads' or 'tokens', not %r" % (mode,))
    layers = _layers(model, layers)
    N, D = model.config.n_head, model.config.d_model
    point = "attn.head_out" if mode == "heads" else "attn.z"
    names = [hook_name(l, point) for l in layers]
    if mode == "heads":
        gram = {l: np.zeros((N, N)) for l in layers}
    else:
        sums = {l: np.zeros(D) for l in layers}
        gram = {l: np.zeros((D, D)) for l in layers}
    n_tok = 0
    for toks in iter_dataset(model, dataset, progress, "head-output PCA"):
        _, cache = model.run_with_cache(toks, names=names)
        n_tok += len(toks)
        for l, nm in zip(layers, names):
            a = cache[nm].astype(np.float64)
            if mode == "heads":  # [T, N, D]: Gram over heads
                gram[l] += np.einsum("tnd,tmd->nm", a, a)
            else:  # [T, N, Dh] -> [T, D]
                x = a.reshape(len(toks), -1)
                sums[l] += x.sum(0)
                gram[l] += x.T @ x
    out = {}
    for l in layers:
        if mode == "heads":
            J = np.eye(N) - 1.0 / N
            out[l] = _pca_from_scatter(J @ gram[l] @ J, N, l, mode)
        else:
            mu = sums[l] / n_tok
            out[l] = _pca_from_scatter(gram[l] - n_tok * np.outer(mu, mu), n_tok, l, mode)
    return out


# ------------------------------------------------------------ diversity, similarity


def qk_ov_diversity(model: Model, layers: Iterable[int] | None = None) -> dict[str, np.ndarray]:
    """QK and OV head diversity of each layer (DCFormer Figure 5; circuits.head_diversity).

    Parameters
    ----------
    model : dclens.Model
        The model.
    layers : iterable of int or None
        The layers (None: all).

    Returns
    -------
    dict of str to numpy.ndarray
        {"qk": [len(layers)], "ov": [len(layers)]}: the mean cumulative captured variance of
        the layer's concatenated per-head QK (OV) matrices; lower = more diverse heads.

    Raises
    ------
    dclens.Error
        A layer out of range.
    """
    layers = _layers(model, layers)
    return {kind: np.array([circuits.head_diversity(model, l, kind) for l in layers]) for kind in ("qk", "ov")}


def head_similarity(
    model: Model, layer: int, dataset=None, kind: str = "output", progress: bool | None = None
) -> np.ndarray:
    """Cosine similarity between the heads of a layer.

    Parameters
    ----------
    model : dclens.Model
        The model.
    layer : int
        The layer.
    dataset : str or array_like or iterable or None
        For kind "output": strings or 1-D token arrays (or one of them); not read otherwise.
    kind : {"output", "qk", "ov"}
        "output": <h_n, h_m> / |h_n| |h_m| with h_n head n's attn.head_out over every token
        of the dataset; "qk" / "ov": the Frobenius cosine of the heads' QK (OV) circuit
        matrices.
    progress : bool or None
        The bar over the sequences, as for iter_dataset.

    Returns
    -------
    numpy.ndarray
        [N, N] float64 in [-1, 1]; 0 where a head's output (or matrix) is zero.

    Raises
    ------
    dclens.Error
        An unknown kind, kind "output" without a dataset, a layer out of range, or a bad
        dataset (iter_dataset).
    """
    (layer,) = _layers(model, [layer])
    if not is_choice(kind, ("output", "qk", "ov")):
        raise Error("kind must be 'output', 'qk' or 'ov', not %r" % (kind,))
    N = model.config.n_head
    if kind == "output":
        if dataset is None:
            raise Error("head_similarity(kind='output') needs a dataset")
        name = hook_name(layer, "attn.head_out")
        G = np.zeros((N, N))
        for toks in iter_dataset(model, dataset, progress, "head similarity"):
            a = model.run_with_cache(toks, names=[name])[1][name].astype(np.float64)
            G += np.einsum("tnd,tmd->nm", a, a)
    elif kind in ("qk", "ov"):
        f = circuits.qk_circuit if kind == "qk" else circuits.ov_circuit
        fm = [f(model, layer, n) for n in range(N)]
        A = [x.A.astype(np.float64) for x in fm]
        B = [x.B.astype(np.float64) for x in fm]
        G = np.empty((N, N))
        for n in range(N):  # <A_n B_n, A_m B_m>_F = sum((A_n^T A_m) * (B_n B_m^T))
            for m in range(n, N):
                G[n, m] = G[m, n] = np.sum((A[n].T @ A[m]) * (B[n] @ B[m].T))
    else:
        raise Error("kind must be 'output', 'qk' or 'ov', not %r" % (kind,))
    d = np.sqrt(np.clip(np.diag(G), 0.0, None))
    with np.errstate(invalid="ignore", divide="ignore"):
        S = G / np.outer(d, d)
    return np.where(np.outer(d, d) > 0, S, 0.0)


# ------------------------------------------------------------ composition statistics


@dataclasses.dataclass
class CompositionStats:
    """Composition-map statistics of one DCMHA layer and phase over a dataset
    (composition_stats).

    Attributes
    ----------
    layer : int
        The layer.
    phase : str
        "pre" (composition of the scores) or "post" (of the pattern).
    mean_abs : dict of str to float
        Branch ("qp", "kp", "qg", "kg", "static" where the model has them) and "total" ->
        the mean |entry| of that term of C[t, s] - I over the allowed (query, key) pairs.
    pair_flow : numpy.ndarray
        [N, N]: pair_flow[n, m], the mean over queries t of |sum_s X[n, t, s] (C[t, s] - I)[n, m]|,
        what source head n routes into target head m (X: the phase's input).
    top_pairs : list of tuple
        The largest off-diagonal (source n, target m, flow), descending.
    n_pairs : int
        The (query, key) pairs averaged over.
    n_queries : int
        The query positions averaged over.
    """

    layer: int
    phase: str
    mean_abs: dict[str, float]  # branch (qp, kp, qg, kg, static) and "total" -> mean |entry|
    pair_flow: np.ndarray  # [N, N] mean over queries of |routed flow n -> m|
    top_pairs: list[tuple[int, int, float]]  # (source n, target m, flow), off-diagonal, descending
    n_pairs: int  # (query, key) pairs averaged over
    n_queries: int


def _side_terms(cache, p: str, side: str, block: np.ndarray, weight: np.ndarray, sums: dict[str, float]):
    """The query- (side "q") or key-side ("k") part of C - I of one layer and
    phase ([T, N, N]: projection plus gate, from the cache's dyn.* hooks
    under prefix p); adds their |entries|, weighted by how many allowed
    pairs each position is in, to sums["qp"] / sums["qg"] (or "kp" / "kg")."""
    w1, w2 = cache[p + side + "w1"].astype(np.float64), cache[p + side + "w2"]
    proj = np.einsum("tin,tim->tnm", w1, w2) * block
    gate = cache[p + side + "dd"][:, :, None] * np.eye(block.shape[0])
    sums[side + "p"] += float(weight @ np.abs(proj).sum((1, 2)))
    sums[side + "g"] += float(weight @ np.abs(gate).sum((1, 2)))
    return proj + gate


def composition_stats(
    model: Model,
    dataset,
    layers: Iterable[int] | None = None,
    phases: Sequence[str] = ("pre", "post"),
    top: int = 10,
    chunk: int = 64,
    progress: bool | None = None,
) -> dict[tuple[int, str], CompositionStats]:
    """Mean |C - I| per branch and the head pairs that route most, over a dataset.

    C[t, s] is the composition map of a DCMHA layer and phase at query t and key s (the
    module's docstring): every pair the mask allows is counted exactly.

    Parameters
    ----------
    model : dclens.Model
        A DCMHA model (DCPythia, DCFormer++).
    dataset : str or array_like or iterable
        The sequences, as for iter_dataset.
    layers : iterable of int or None
        The layers (None: all).
    phases : sequence of str
        Of "pre" and "post".
    top : int
        How many off-diagonal head pairs to keep in top_pairs (>= 1).
    chunk : int
        Query positions per block of the [chunk, S, N, N] computation (>= 1; memory only).
    progress : bool or None
        The bar over the sequences, as for iter_dataset.

    Returns
    -------
    dict of tuple to CompositionStats
        (layer, phase) -> its statistics.

    Raises
    ------
    dclens.Error
        A model without dynamic composition (plain MHA), a phase other than "pre" / "post",
        a top or chunk below 1, a layer out of range, or a bad dataset (iter_dataset).
    """
    c = model.config
    if not c.use_dcmha:
        raise Error("%s has no dynamic composition (plain multi-head attention)" % model.name)
    layers = _layers(model, layers)
    top = check_index("top", top, 1, 2**31)
    chunk = check_index("chunk", chunk, 1, 2**31)
    for ph in phases:
        if not is_choice(ph, PHASES):
            raise Error("phase must be 'pre' or 'post', not %r" % (ph,))

    N, G = c.n_head, c.compose_groups
    block = np.kron(np.eye(G), np.ones((N // G, N // G)))
    statics = {(l, ph): static_map(model, l, ph) for l in layers for ph in phases}
    names = []
    for l in layers:
        for ph in phases:
            names += _dyn_names(l, ph, c.query_wise, c.key_wise)
            names.append(hook_name(l, "attn.%s" % ("scores" if ph == "pre" else "pattern")))
    branch_names = [
        b for b in ("qp", "kp", "qg", "kg") if not (c.query_wise and b[0] == "k") and not (c.key_wise and b[0] == "q")
    ] + (["static"] if c.use_sw else [])
    acc: dict[tuple[int, str], dict[str, Any]] = {
        (l, ph): dict(sums={b: 0.0 for b in branch_names + ["total"]}, flow=np.zeros((N, N)), pairs=0, queries=0)
        for l in layers
        for ph in phases
    }
    for toks in iter_dataset(model, dataset, progress, "composition stats"):
        _, cache = model.run_with_cache(toks, names=names)
        T = len(toks)
        for l in layers:
            ok = allowed(T, T, layer_window(model, l))  # [T, S]
            n_t, n_s = ok.sum(1), ok.sum(0)  # allowed keys per query, queries per key
            for ph in phases:
                a = acc[(l, ph)]
                p = hook_name(l, "attn.dyn.%s." % ph)
                # the query-side part of C - I [T, N, N] and the key-side part [S, N, N]
                terms_q = np.zeros((T, N, N)) if c.key_wise else _side_terms(cache, p, "q", block, n_t, a["sums"])
                terms_k = np.zeros((T, N, N)) if c.query_wise else _side_terms(cache, p, "k", block, n_s, a["sums"])
                W = statics[(l, ph)]
                if W is not None:
                    a["sums"]["static"] += float(ok.sum() * np.abs(W).sum())
                X = cache[hook_name(l, "attn.%s" % ("scores" if ph == "pre" else "pattern"))].astype(np.float64)
                X = np.where(ok[None], X, 0.0)  # [N, T, S], only allowed pairs
                for t0 in range(0, T, chunk):
                    t1 = min(T, t0 + chunk)
                    cmi = terms_q[t0:t1, None] + terms_k[None, :]  # [c, S, N, N] = C - I
                    if W is not None:
                        cmi = cmi + W
                    m = ok[t0:t1]
                    a["sums"]["total"] += float(np.abs(cmi[m]).sum())
                    flow = np.einsum("nts,tsnm->tnm", X[:, t0:t1], cmi)  # [c, N, N]
                    a["flow"] += np.abs(flow).sum(0)
                a["pairs"] += int(ok.sum())
                a["queries"] += T
    out = {}
    for (l, ph), a in acc.items():
        denom = a["pairs"] * N * N
        mean_abs = {b: v / denom for b, v in a["sums"].items()}
        flow = a["flow"] / a["queries"]
        off = [(n, m, float(flow[n, m])) for n in range(N) for m in range(N) if n != m]
        off.sort(key=lambda x: -x[2])
        out[(l, ph)] = CompositionStats(l, ph, mean_abs, flow, off[:top], a["pairs"], a["queries"])
    return out


# ------------------------------------------------------------ MoH head load


def head_load(model: Model, dataset, progress: bool | None = None) -> np.ndarray:
    """How often each routed head is selected, per layer, in a Mixture-of-Head model.

    A token selects its top-k routed heads (the largest router logits, ties to the lower
    index, as the engine selects).

    Parameters
    ----------
    model : dclens.Model
        A Mixture-of-Head model (config.moh_shared_heads set).
    dataset : str or array_like or iterable
        The sequences, as for iter_dataset.
    progress : bool or None
        The bar over the sequences, as for iter_dataset.

    Returns
    -------
    numpy.ndarray
        [L, N - hs] float64: the fraction of the dataset's tokens that select each routed
        head (hs: the shared heads, always on).

    Raises
    ------
    dclens.Error
        A model without Mixture-of-Head routing, or a bad dataset (iter_dataset).
    """
    c = model.config
    if c.moh_shared_heads is None:
        raise Error("%s has no Mixture-of-Head routing ('moh' is not in its config)" % model.name)
    k = c.moh_routed_topk
    names = [hook_name(l, "attn.router_logits") for l in range(c.n_layer)]
    counts = np.zeros((c.n_layer, c.n_head - c.moh_shared_heads))
    n_tok = 0
    for toks in iter_dataset(model, dataset, progress, "head load"):
        _, cache = model.run_with_cache(toks, names=names)
        for l, nm in enumerate(names):
            lg = cache[nm]
            top = np.argsort(-lg, axis=-1, kind="stable")[:, :k]  # larger logit, then lower index
            np.add.at(counts[l], top.ravel(), 1)
        n_tok += len(toks)
    return counts / n_tok
