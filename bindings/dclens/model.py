"""Model: a loaded checkpoint, its forward pass, and hooks (read and write).

Thin layer over the C engine (dclens._engine): the engine runs the pass and
calls back at every wanted hook point with the activation for the whole batch;
dclens.hooks turns that into numpy arrays, a cache, and calls of the user's
hook functions, with hook names from the model's HookTable.

Processes: a Model pickles as a reference (dclens.reference: load arguments
and a fingerprint of its files; unpickling loads it again), and survives
fork(): in a forked child its runner's lock is new (os.register_at_fork in
dclens.runner) and the engine rebuilds its thread pool on first use, so the child can run the
parent's model, even one a thread of the parent was running at the fork.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import sys
import threading
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import Any

import numpy as np

from ._core import batch, blas, hub, memplan
from ._core import names as _names
from ._core import runner as _runner
from ._core.bundled import resolve
from ._core.checks import (
    ArgumentError,
    Error,
    NotFoundError,
    c_path,
    c_str,
    check_bool,
    check_index,
    is_choice,
    show_path,
    token_array,
    unknown_name,
)
from ._core.hooks import HookFn, Hooks, flatten_hooks, hook_pairs
from ._core.reference import ModelRef, fingerprint
from ._core.runner import Names, Runner
from ._core.warning_types import ContextWarning, LoadWarning
from ._core.weights import WeightsMixin
from .analysis import attribution, grad, routing
from .analysis.generate import generate as _generate
from .cache import Cache

_MAX_TOKENIZER_BYTES = 256 << 20


# config.json keys that give the context length a model was trained for
_CTX_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "block_size", "max_seq_len", "seq_length")


@dataclasses.dataclass(frozen=True)
class TLConfig:
    """model.cfg: the model's configuration under TransformerLens's
    HookedTransformerConfig field names (model.config has dclens's own,
    with the DCMHA switches). cfg["n_layers"] reads a field too.

    Attributes
    ----------
    model_name : str
        The model's name (model.name).
    n_layers : int
        Blocks.
    d_model : int
        The residual width D.
    n_heads : int
        Attention heads per layer N.
    d_head : int
        The width of a head Dh.
    d_mlp : int
        The MLP's hidden width.
    d_vocab : int
        The vocabulary size V.
    d_vocab_out : int
        The unembedding's outputs (V).
    n_ctx : int or None
        The context the model was trained for (config.json), None if not recorded.
    act_fn : str
        "gelu", or "silu" for a SwiGLU MLP.
    eps : float
        The norms' epsilon.
    normalization_type : str
        "LN" (LayerNorm) or "RMS".
    positional_embedding_type : str
        "rotary".
    rotary_dim : int
        Dimensions of each head that rotary turns.
    rotary_base : float
        Rotary's base.
    parallel_attn_mlp : bool
        Attention and MLP read the same block input (GPT-NeoX's parallel residual).
    original_architecture : str
        config.json's first architecture ("DCPythia", "GPTNeoXForCausalLM", ...).
    window_size : int or None
        The local layers' window, None when every layer is global.
    attn_types : tuple of str
        "global" / "local" per layer.
    use_local_attn : bool
        Some layer is local.
    device : str
        "cpu" or "cuda".
    default_prepend_bos : bool
        to_tokens' prepend_bos default (False: Pythia-style models are trained without a BOS).
    tokenizer_prepends_bos : bool
        False: the tokenizer adds no BOS itself.
    bos_token_id : int or None
        config.json's bos_token_id.
    attention_dir : str
        "causal".
    dtype : str
        "float32", the activations' type.
    gated_mlp : bool
        SwiGLU (DCFormer++): act_fn "silu" on the gated half.
    """

    model_name: str
    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    d_vocab_out: int
    n_ctx: int | None  # the context trained for (config.json), None if not recorded
    act_fn: str
    eps: float
    normalization_type: str
    positional_embedding_type: str
    rotary_dim: int
    rotary_base: float
    parallel_attn_mlp: bool
    original_architecture: str
    window_size: int | None
    attn_types: tuple[str, ...]  # "global" / "local" per layer
    use_local_attn: bool
    device: str
    default_prepend_bos: bool  # False: Pythia-style models are trained without a BOS
    tokenizer_prepends_bos: bool
    bos_token_id: int | None
    attention_dir: str = "causal"
    dtype: str = "float32"
    gated_mlp: bool = False  # SwiGLU (DCFormer++): act_fn "silu" on the gated half

    def __getitem__(self, key):
        return getattr(self, key)

    def to_dict(self) -> dict[str, object]:
        """The fields as a dict.

        Returns
        -------
        dict
            Field name -> value (dataclasses.asdict).
        """
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Config:
    """Dimensions and switches of a loaded model (model.config); config["n_layer"] reads a
    field too.

    Attributes
    ----------
    model_type : str
        "dcpythia", "gpt_neox" (Pythia) or "dcformer" (DCFormer++).
    n_layer : int
        Blocks L.
    d_model : int
        The residual width D.
    n_head : int
        Attention heads per layer N.
    head_dim : int
        The width of a head Dh.
    d_ff : int
        The MLP's hidden width.
    vocab : int
        The vocabulary size V.
    rotary_dim : int
        Dimensions of each head that rotary turns.
    rope_base : float
        Rotary's base.
    norm_eps : float
        The norms' epsilon.
    parallel_residual : bool
        Attention and MLP read the same block input.
    qk_norm : bool
        Queries and keys are normalised (QK-norm).
    linear_bias : bool
        The linear layers have biases.
    use_dcmha : bool
        Dynamically composable multi-head attention (False: plain MHA).
    query_wise : bool
        Only the query-side compose branches (qp, qg).
    dyn_rank : int
        The rank R of the dynamic compose weights.
    dyn_hidden : int
        The hidden width of the dynamic-weight projection.
    window_size : int
        The local layers' window (0: none).
    local_layers : tuple of int
        The layers with local attention.
    tie_embeddings : bool
        The unembedding is the embedding.
    use_sw : bool
        The static (Talking-Heads) compose branch.
    compose_groups : int
        Heads are composed within this many groups.
    moh_shared_heads : int or None
        Mixture-of-Head routing: the heads always on, None when MoH is off.
    moh_routed_topk : int or None
        Mixture-of-Head routing: the routed heads each token selects.
    dyn_slots : int
        C: dynamic-weight slots, 4 (pre/post x query/key) or 2.
    key_wise : bool
        Only the key-side branches (kp, kg).
    norm : str
        The block and final norms: "layer" (LayerNorm) or "rms".
    mlp : str
        "gelu" or "swiglu" (w2(silu(w1 x) * w3 x)).
    mgate_dim : int
        E: groups of the SwiGLU MLP's softmax gate, 0 = none.
    """

    model_type: str
    n_layer: int
    d_model: int
    n_head: int
    head_dim: int
    d_ff: int
    vocab: int
    rotary_dim: int
    rope_base: float
    norm_eps: float
    parallel_residual: bool
    qk_norm: bool
    linear_bias: bool
    use_dcmha: bool
    query_wise: bool
    dyn_rank: int
    dyn_hidden: int
    window_size: int
    local_layers: tuple[int, ...]
    tie_embeddings: bool
    # attention variants (model-spec.md 5)
    use_sw: bool = False  # static (Talking-Heads) compose branch
    compose_groups: int = 1  # heads composed within this many groups
    moh_shared_heads: int | None = None  # MoH routing: None when off
    moh_routed_topk: int | None = None
    dyn_slots: int = 0  # C: 4 (pre/post x query/key) or 2
    key_wise: bool = False  # query-wise branches absent
    # DCFormer++ (model_type "dcformer", docs/dcformer-spec.md)
    norm: str = "layer"  # block / final norms: "layer" (LayerNorm) or "rms"
    mlp: str = "gelu"  # "gelu" or "swiglu" (w2(silu(w1 x) * w3 x))
    mgate_dim: int = 0  # E: groups of the SwiGLU MLP's softmax gate, 0 = none

    def __getitem__(self, key):  # dict-style access for notebooks
        return getattr(self, key)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What one layer computes, as the engine decided it once at load
    (dcs_layer_plan in dclens.h; read by the forward, the backward and the
    tape's memory plan alike): model.plan[l]."""

    norm: str  # "layer" (LayerNorm) or "rms"
    parallel_residual: bool  # x + attn(ln1 x) + mlp(ln2 x); else sequential
    mlp: str  # "gelu" or "swiglu"
    mlp_gate: int  # E > 0: DCFormer++'s MLP group gate; 0 none
    window: int  # > 0: a local layer's window; 0 global
    qk_norm: bool
    moh: bool  # Mixture-of-Head routing
    dcmha: bool  # dynamic composition (the fields below are 0 / False / -1 without)
    slots: int  # C: dynamic-weight slots
    slot: tuple[tuple[int, int], tuple[int, int]]  # [phase pre/post][side query/key] -> slot, -1 absent
    groups: int  # compose groups
    static_branch: bool  # the static (Talking-Heads) branch
    row_compose: bool  # plain DCMHA: the compose backward's row kernels apply
    fused: bool  # the fused attention kernel may compute it when no map hook asks


def _layer_plans(runner: Runner) -> tuple[LayerPlan, ...]:
    return tuple(LayerPlan(**p) for p in runner.layer_plans())


def cuda_available() -> bool:
    """Whether the CUDA backend can run here.

    Returns
    -------
    bool
        True if the engine was built with CUDA and a GPU is usable.
    """
    return _runner.cuda_available()


def cuda_unavailable_reason() -> str:
    """Why device="cuda" cannot be used here.

    Returns
    -------
    str
        The engine's reason (no CUDA plugin built, no driver, no GPU, ...), or "" when
        cuda_available().
    """
    return _runner.cuda_available(why=True)


_LOAD_DTYPES = ("auto", "float32", "float16", "bfloat16")  # index = DCS_LOAD_* (dclens.h)


def weight_dtype_arg(dtype: Any) -> str:
    """load's dtype= as one of _LOAD_DTYPES: a name, or numpy's float16 / float32."""
    if isinstance(dtype, str) and dtype in _LOAD_DTYPES:
        return dtype
    try:
        name = np.dtype(dtype).name if not isinstance(dtype, (str, bool)) and dtype is not None else None
    except TypeError:
        name = None
    if name in ("float16", "float32"):
        return name
    raise ArgumentError(
        "dtype must be 'auto', 'float32', 'float16' or 'bfloat16' (the type the weight matrices are kept in), "
        "not %r" % (dtype,)
    )


def load(
    path: str | os.PathLike,
    device: str = "cpu",
    n_threads: int = 0,
    always_batch: bool = False,
    *,
    dtype: Any = "auto",
    revision: str | None = None,
    progress: bool | None = None,
    prepend_bos: bool | None = None,
) -> Model:
    """Load a DCPythia or Pythia model: a checkpoint directory (config.json +
    weights), a bundled model by name (dclens.bundled_models()), or a Hugging
    Face Hub id "org/name" (revision=: a branch, tag or commit), taken from
    the local Hugging Face cache first and downloaded only when it is not
    there and HF_HUB_OFFLINE is not set (dclens.hub). A Hub model's name is
    its id.

    always_batch=True gives every result a leading batch axis, also for one
    prompt (TransformerLens' habit); by default the batch axis follows the
    input: a string or [T] array gives [T, ...], a list of strings or a
    [B, T] array gives [B, T, ...]. prepend_bos sets the default of
    to_tokens (model.cfg.default_prepend_bos; False unless asked: Pythia-style
    models are trained without a BOS). progress: the download's bar
    (dclens.progress).

    Parameters
    ----------
    path : str or os.PathLike
        A checkpoint directory, a bundled model's name, or a Hub id "org/name".
    device : {"cpu", "cuda"}
        Where the engine runs.
    n_threads : int
        CPU threads (0: all cores).
    always_batch : bool
        Give every result a leading batch axis.
    dtype : {"auto", "float32", "float16", "bfloat16"}
        The type the weight matrices are kept in (model.dtype). "auto": as stored
        on the CPU, float32 on CUDA (the 16-bit CUDA path, tensor-core products
        with float32 accumulation, is asked for by name until a GPU run has
        verified it: docs/cuda.md). "float32" widens 16-bit files (exact);
        "float16" / "bfloat16" keep a file stored in that type and round a
        float32 file to it. Activations, hooks and gradients stay float32.
    revision : str or None
        A Hub id's branch, tag or commit.
    progress : bool or None
        The download's progress bar.
    prepend_bos : bool or None
        to_tokens' default (None: False).

    Returns
    -------
    Model
        The loaded model (a LoadWarning for what it ignores in the checkpoint, a
        BlasWarning where OpenBLAS runs kernels narrower than the CPU's).

    Raises
    ------
    dclens.ArgumentError
        revision= without a Hub id, an unknown device or dtype, a negative n_threads, or
        a dtype the file cannot give unchanged (float16 from a bfloat16 file or back; a
        float32 value past float16's range): the message names the file and the dtype
        to ask for.
    dclens.NotFoundError
        No such directory, bundled model or Hub model (or not cached while offline).
    dclens.Error
        A checkpoint the engine refuses (the message names the file and what is wrong).
    """
    name = None
    directory: str | bytes
    if revision is not None and not hub.is_hub_id(path):
        raise ArgumentError("revision=%r goes with a Hugging Face Hub id (org/name), not %r" % (revision, path))
    if isinstance(path, str) and hub.is_hub_id(path) and not os.path.lexists(path):
        name = path
        directory = hub.resolve(path, revision=revision, progress=progress)
    else:
        directory = resolve(path)
    m = Model(directory, device=device, n_threads=n_threads, dtype=dtype)
    if m.device == "cpu":
        blas.check()  # a BlasWarning where OpenBLAS fell back to kernels narrower than the CPU's
    if name is not None:
        m.name = name
    m.always_batch = bool(always_batch)
    if prepend_bos is not None:
        m.default_prepend_bos = bool(prepend_bos)
    if name is None and isinstance(path, str) and not os.path.lexists(path):  # a bundled name: pickles as the name
        m._ref = dataclasses.replace(m._ref, source=path)
    return m


def from_pretrained(model_name: str | os.PathLike, device: str = "cpu", **kw: Any) -> Model:
    """TransformerLens' name for load (HookedTransformer.from_pretrained).

    Parameters
    ----------
    model_name : str or os.PathLike
        A Hub id, a bundled name or a checkpoint directory.
    device : {"cpu", "cuda"}
        Where the engine runs.
    **kw
        load's other keywords.

    Returns
    -------
    Model
        As load.

    Raises
    ------
    dclens.Error
        As load.
    """
    return load(model_name, device=device, **kw)


def _caller_level() -> int:
    """warnings.warn's stacklevel of the first frame outside dclens (the user's call)."""
    f: FrameType | None = sys._getframe(1)
    level = 1
    pkg = os.path.dirname(os.path.abspath(__file__))
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(pkg + os.sep):
        f, level = f.f_back, level + 1
    return level


def _read_config(path: str) -> dict[str, Any]:
    """config.json of a loaded model as a dict ({} if it cannot be read again:
    the engine has already read and checked it)."""
    try:
        d = json.loads(_read_regular_file(os.path.join(path, "config.json"), 16 << 20))
    except (Error, ValueError, RecursionError):
        return {}
    return d if isinstance(d, dict) else {}


def from_reference(ref: ModelRef) -> Model:
    """Load the model a reference names (what unpickling a Model does), after
    checking that its files are those it was loaded from.

    Parameters
    ----------
    ref : dclens.reference.ModelRef
        The reference (Model.reference()).

    Returns
    -------
    Model
        The model, loaded again.

    Raises
    ------
    dclens.Error
        Not a ModelRef, files that changed since the reference was taken, or a load that
        fails.
    """
    if not isinstance(ref, ModelRef):
        raise Error("from_reference needs a dclens.reference.ModelRef, not %s" % type(ref).__name__)
    m = Model(ref.check(), device=ref.device, n_threads=ref.n_threads, dtype=ref.dtype)
    m.always_batch = ref.always_batch
    m._ref = dataclasses.replace(ref, files=m._ref.files)
    return m


def _read_regular_file(path: str, limit: int) -> str:
    """The text of a regular file of at most `limit` bytes. Opened without
    blocking and checked before reading, so a FIFO or device where a file is
    expected is refused instead of hanging."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if os.path.islink(path) and not os.path.exists(path):
            raise Error("%s: cannot open: a dangling symbolic link (its target does not exist)" % path) from None
        raise (NotFoundError if isinstance(e, FileNotFoundError) else Error)(
            "%s: cannot open: %s" % (path, e.strerror)
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Error("%s: not a regular file" % path)
        if st.st_size > limit:
            raise Error("%s: %d bytes is more than the %d allowed for this file" % (path, st.st_size, limit))
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise Error("%s: file grew past %d bytes while being read" % (path, limit))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Error("%s: not UTF-8 (%s at byte %d)" % (path, e.reason, e.start)) from None


def load_tokenizer(directory: str):
    """The HF `tokenizers.Tokenizer` of a model directory (its tokenizer.json),
    without loading the model (what Model.tokenizer reads).

    Parameters
    ----------
    directory : str
        The model directory.

    Returns
    -------
    tokenizers.Tokenizer
        The tokenizer.

    Raises
    ------
    dclens.NotFoundError
        The directory has no tokenizer.json.
    dclens.Error
        A tokenizer.json that is not a regular file, is over 256 MiB, is not UTF-8, or
        that tokenizers cannot read.
    """
    p = os.path.join(directory, "tokenizer.json")
    if not os.path.lexists(p):
        raise NotFoundError("%s has no tokenizer.json" % directory)
    text = _read_regular_file(p, _MAX_TOKENIZER_BYTES)
    from tokenizers import Tokenizer  # lazy: tokenizers loads with the first tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as e:
        raise Error("%s: cannot read the tokenizer: %s" % (p, e)) from e


# Config's fields that are the engine's dcs_config fields of the same name (numbers, then 0/1 flags)
_ENGINE_CONFIG_NUMBERS = [
    "n_layer",
    "d_model",
    "n_head",
    "head_dim",
    "d_ff",
    "vocab",
    "rotary_dim",
    "rope_base",
    "norm_eps",
    "dyn_rank",
    "dyn_hidden",
    "window_size",
    "compose_groups",
    "dyn_slots",
    "mgate_dim",
]
_ENGINE_CONFIG_FLAGS = [
    "parallel_residual",
    "qk_norm",
    "linear_bias",
    "use_dcmha",
    "query_wise",
    "tie_embeddings",
    "key_wise",
]


class _OfRunner:
    """A Model attribute that lives on its runner (name, device): one copy, the one the
    engine's calls and their messages use; reading and setting go to model.runner."""

    def __set_name__(self, owner, attr: str) -> None:
        self.attr = attr

    def __get__(self, model, owner=None):
        return self if model is None else getattr(model.runner, self.attr)

    def __set__(self, model, value) -> None:
        setattr(model.runner, self.attr, value)


class Model(WeightsMixin):
    """A loaded DCPythia or Pythia model.

    >>> m = dclens.load("path/to/model")
    >>> logits = m.forward(m.to_tokens("The cat sat"))
    >>> logits, cache = m.run_with_cache(tokens, names=lambda n: n.endswith("pattern"))

    dclens.load is the usual way to make one.

    Parameters
    ----------
    path : str or bytes or os.PathLike
        The checkpoint directory (config.json and weights).
    device : {"cpu", "cuda"}
        Where the engine runs.
    n_threads : int
        CPU threads (0: all cores).
    dtype : {"auto", "float32", "float16", "bfloat16"}
        The type the weight matrices are kept in (load's dtype=).

    Raises
    ------
    dclens.ArgumentError
        An unknown device or dtype, a negative n_threads, a dtype the file cannot
        give unchanged, or a path holding a NUL (dclens.ArgumentTypeError: not a path).
    dclens.NotFoundError
        No such directory or weight file.
    dclens.Error
        A checkpoint the engine refuses.
    """

    _instead = "pickle its path and call dclens.load(path) again (model.path)"

    def __init__(self, path, device: str = "cpu", n_threads: int = 0, dtype: Any = "auto"):
        cpath = c_path("model path", path)
        path = show_path(path)
        if not (isinstance(device, str) and device in ("cpu", "cuda")):
            raise ArgumentError("device must be 'cpu' or 'cuda', not %r" % (device,))
        n_threads = check_index("n_threads", n_threads, 0, 1 << 16, " (0: all cores)")
        dtype = weight_dtype_arg(dtype)
        handle = _runner.load(cpath, device, n_threads, _LOAD_DTYPES.index(dtype))
        self._ref = ModelRef(
            source=os.path.abspath(os.fsdecode(path)),
            device=device,
            n_threads=n_threads,
            files=fingerprint(path),
            dtype=dtype,
        )
        # the hooks in force (add_hook, `with model.hooks(...)`): the model's,
        # changed in place only here; its runner reads them (refuse_hooks)
        self._ctx_hooks: list[tuple[str, HookFn]] = []
        # the engine handle, its lock, errors and runs (runner.py); its name
        # and device are the model's (name and device below are properties)
        c = _runner.config_of(handle)
        self.runner = Runner(
            handle, int(c.vocab), int(c.n_layer), device=device, hooks=self._ctx_hooks, new_cache=Cache
        )
        self.path = path
        self.name = os.path.basename(os.path.normpath(path))
        self.plan = _layer_plans(self.runner)  # what each layer computes (LayerPlan)
        first = self.plan[0]
        self.config = Config(
            model_type={1: "dcpythia", 2: "gpt_neox", 3: "dcformer"}[c.model_type],
            **{f: getattr(c, f) for f in _ENGINE_CONFIG_NUMBERS},
            **{f: bool(getattr(c, f)) for f in _ENGINE_CONFIG_FLAGS},
            local_layers=tuple(l for l in range(c.n_layer) if self.plan[l].window > 0),
            use_sw=bool(c.use_sw) and bool(c.use_dcmha),
            moh_shared_heads=c.moh_shared if c.moh else None,
            moh_routed_topk=c.moh_topk if c.moh else None,
            norm=first.norm,
            mlp=first.mlp,
        )
        self.load_warnings = self.runner.load_warnings()
        for w in self.load_warnings:
            warnings.warn(w, LoadWarning, stacklevel=3)
        self._tokenizer = None
        self._raw_config = _read_config(path)
        self.default_prepend_bos = False  # to_tokens' prepend_bos default (load(prepend_bos=))
        self.always_batch = False  # see load()

    from_pretrained = staticmethod(from_pretrained)

    name = _OfRunner()
    """The model's name (its directory's, a bundled name or a Hub id)."""
    device = _OfRunner()
    """ "cpu" or "cuda"."""

    @property
    def dtype(self) -> str:
        """The type the large matrices (projections, MLP, embeddings) are kept in:
        "float32", "float16", "bfloat16", or "mixed" (a checkpoint storing some of
        each, loaded as stored). Norms, biases, activations, hooks and gradients are
        float32 in every case (load's dtype=)."""
        return ("float32", "float16", "bfloat16", "mixed")[self.runner.weight_dtype()]

    @property
    def attention_rows(self) -> int:
        """How a pass with no hooked or kept attention map computes attention.

        0 (the default): the fused kernel where the backend has one for the
        layer (the CPU, for DCPythia, DCFormer++ and Pythia); otherwise, when
        the whole [B, N, T, S] map is over 64 MiB, by chunks of query rows that
        fit it, at most 256 (CUDA, and the variants the fused kernel does not compute);
        otherwise the full path. n > 0: by chunks of n query rows per sequence,
        on the keys those rows can see, so attention takes the memory of one
        [N, n, keys] map (the CPU's fused kernel is not used). -1: the full,
        materialising path always. Results agree to float32 rounding; hooks on
        a layer's maps and gradient tapes take the full or fused path for that
        layer whatever the setting. Not carried by pickle or model_ref (a
        setting of this process's model).

        Raises
        ------
        dclens.Error
            Set to something other than an int >= -1, or from a hook of a
            running pass.
        """
        return self.runner.attention_rows()

    @attention_rows.setter
    def attention_rows(self, value: int) -> None:
        rows = check_index("attention_rows", value, -1, 1 << 31, " (-1 full, 0 auto, n > 0 rows per chunk)")
        r = self.runner
        if r.pass_thread is not None and r.pass_thread == threading.get_ident():
            raise Error("attention_rows: not from a hook of a running pass (set it between passes)")
        r.set_attention_rows(rows)

    @property
    def cfg(self) -> TLConfig:
        """The configuration under TransformerLens's field names (TLConfig)."""
        c, raw = self.config, self._raw_config
        n_ctx = next((raw[k] for k in _CTX_KEYS if isinstance(raw.get(k), int) and raw[k] > 0), None)
        bos = raw.get("bos_token_id")
        local = set(c.local_layers)
        return TLConfig(
            model_name=self.name,
            n_layers=c.n_layer,
            d_model=c.d_model,
            n_heads=c.n_head,
            d_head=c.head_dim,
            d_mlp=c.d_ff,
            d_vocab=c.vocab,
            d_vocab_out=c.vocab,
            n_ctx=n_ctx,
            act_fn="silu" if self.plan[0].mlp == "swiglu" else "gelu",
            eps=c.norm_eps,
            normalization_type="RMS" if self.plan[0].norm == "rms" else "LN",
            positional_embedding_type="rotary",
            rotary_dim=c.rotary_dim,
            rotary_base=c.rope_base,
            parallel_attn_mlp=self.plan[0].parallel_residual,
            gated_mlp=self.plan[0].mlp == "swiglu",
            original_architecture=(
                raw.get("architectures") or ["DCPythia" if c.model_type == "dcpythia" else "GPTNeoXForCausalLM"]
            )[0],
            window_size=c.window_size if local else None,
            attn_types=tuple("local" if l in local else "global" for l in range(c.n_layer)),
            use_local_attn=bool(local),
            device=self.device,
            default_prepend_bos=self.default_prepend_bos,
            tokenizer_prepends_bos=False,
            bos_token_id=bos if isinstance(bos, int) else None,
        )

    def check_context(self, T: int) -> None:
        """Warn (ContextWarning) when T tokens are more than the context the
        model was trained for (cfg.n_ctx, when config.json records it).

        Parameters
        ----------
        T : int
            Tokens of a prompt.

        Warns
        -----
        ContextWarning
            T > cfg.n_ctx.
        """
        n_ctx = self.cfg.n_ctx
        if n_ctx is not None and T > n_ctx:
            warnings.warn(
                "%s: a prompt of %d tokens is longer than the %d-token context the model was trained "
                "for (cfg.n_ctx); positions past %d were never seen in training" % (self.name, T, n_ctx, n_ctx),
                ContextWarning,
                stacklevel=_caller_level(),
            )

    def __repr__(self) -> str:
        c = self.config
        return "<dclens.Model %s: %s, %d layers, d_model %d, %d heads, on %s>" % (
            self.name,
            c.model_type,
            c.n_layer,
            c.d_model,
            c.n_head,
            self.device,
        )

    # ------------------------------------------------------------ processes

    def reference(self) -> ModelRef:
        """What pickling this model keeps (dclens.reference).

        Returns
        -------
        dclens.reference.ModelRef
            Its load arguments and the fingerprint of its files at load time.
        """
        return dataclasses.replace(self._ref, always_batch=bool(self.always_batch))

    def __reduce__(self):
        if self._ctx_hooks:
            warnings.warn(
                "%s: hooks added with add_hook / model.hooks are not pickled; the unpickled model has none" % self.name,
                stacklevel=2,
            )
        return from_reference, (self.reference(),)

    # ------------------------------------------------------------ names

    @property
    def hook_names(self) -> list[str]:
        """Every hook name this model has, in forward order per layer."""
        return list(self.runner.hook_table.names)

    def parse_hook(self, name: str) -> tuple[int, int]:
        """The engine's ids of a hook name of this model.

        Parameters
        ----------
        name : str
            A dclens hook name.

        Returns
        -------
        tuple of int
            (hook point, layer) (the layer -1 for a hook outside the blocks).

        Raises
        ------
        dclens.UnknownNameError
            A name this model does not have (with the closest names).
        dclens.Error
            A name that is not a string or holds a NUL (ArgumentTypeError, ArgumentError).
        """
        return self.runner.parse_hook(name)

    @property
    def _m(self) -> Any:
        """The engine handle (model.runner.handle) under its former name (tests, scripts)."""
        return self.runner.handle

    def _expand_hooks(self, pairs: Sequence[tuple[str, HookFn]]) -> list[tuple[str, HookFn]]:
        """(name, fn) pairs with TransformerLens' predicate names, (lambda name: ..., fn),
        expanded to every hook the predicate accepts (in either spelling)."""
        out: list[tuple[str, HookFn]] = []
        for n, fn in pairs:
            if callable(n) and not isinstance(n, str):
                out += [(m, fn) for m in self.runner.select(n)]
            else:
                out.append((n, fn))
        return out

    def hooks_in_force(self, per_call: Sequence[tuple[str, HookFn]] = ()) -> list[tuple[str, HookFn]]:
        """The hooks a pass runs, written once for every path that computes
        activations (docs/api.md "Which hooks a pass runs"): first the
        model's own hooks (add_hook and `with model.hooks(...)`, in the order
        they were added), then the call's fwd_hooks in the order given; names
        in dclens spelling. A per-call hook thus sees what an intervention in
        force wrote. ``per_call`` may hold ``Hooks`` (what the interventions
        helpers return) as elements: they are flattened.

        Parameters
        ----------
        per_call : sequence of (str, callable)
            The call's fwd_hooks.

        Returns
        -------
        list of (str, callable)
            The model's hooks, then the call's, with canonical names.

        Raises
        ------
        dclens.Error
            A hook whose function is not callable.
        """
        out = [(_names.canonical(n), fn) for n, fn in list(self._ctx_hooks) + flatten_hooks(per_call)]
        for n, fn in out:
            if not callable(fn):
                raise Error("hook %s: %r is not callable" % (n, fn))
        return out

    def token_ids(self, tokens) -> tuple[np.ndarray, bool]:
        """What a run takes: tokens as a checked int32 array, and whether they were batched.

        Parameters
        ----------
        tokens : str or array_like of int
            A string (tokenized), or [T] or [B, T] token ids.

        Returns
        -------
        ids : numpy.ndarray
            [B, T] int32 (B = 1 for one sequence).
        batched : bool
            Whether the tokens had a batch axis.

        Raises
        ------
        dclens.ArgumentError
            An empty array, one of more than 2 axes, or an id outside the vocabulary
            (dclens.ArgumentTypeError: not integers).

        Warns
        -----
        ContextWarning
            Tokens longer than the trained context (check_context).
        """
        if isinstance(tokens, str):
            tokens = self.to_tokens(tokens)
        toks, batched = self.runner.tokens(tokens)
        self.check_context(toks.shape[-1])
        return toks, batched

    # ------------------------------------------------------------ tokens

    @property
    def tokenizer(self):
        """The HF `tokenizers.Tokenizer` of the model directory (tokenizer.json)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    def to_tokens(self, text, padding_side: str = "right", pad_id: int = 0, prepend_bos: bool | None = None):
        """Token ids of `text`: a [T] array.

        prepend_bos: put the BOS token (config.json's bos_token_id) first.
        None: model.cfg.default_prepend_bos, False unless load(prepend_bos=True)
        asked for it: Pythia and DCPythia are trained without a BOS (unlike
        TransformerLens's default for other models).

        A list of strings gives a Padded pair (tokens [B, T], lengths [B]):
        the prompts padded with pad_id to the longest, on the right (default)
        or the left. It unpacks as a tuple and remembers its side
        (.padding_side), so forward / run_with_cache / run_with_hooks read a
        left-padded batch as left-padded without being told again. Those take
        the pair, or tokens with lengths= and padding_side= (docs/api.md).

        Parameters
        ----------
        text : str or list of str
            The text, or texts.
        padding_side : {"right", "left"}
            Where a list's prompts are padded.
        pad_id : int
            The padding's token id.
        prepend_bos : bool or None
            Put the BOS token first (None: model.cfg.default_prepend_bos).

        Returns
        -------
        numpy.ndarray or Padded
            [T] int32 ids; for a list, a Padded (tokens [B, T], lengths [B]).

        Raises
        ------
        dclens.Error
            Text that is not a string or a non-empty list of strings, or a tokenizer id
            beyond the model's vocabulary.
        dclens.ArgumentError
            prepend_bos=True without a usable bos_token_id in config.json.
        """
        if isinstance(text, (list, tuple)):
            if not text or not all(isinstance(t, str) for t in text):
                raise Error("to_tokens: need a string or a non-empty list of strings, got %r" % (text,))
            return batch.pad([self.to_tokens(t, prepend_bos=prepend_bos) for t in text], padding_side, pad_id)
        if not isinstance(text, str):
            raise Error("to_tokens: need a string or a list of strings, not %s" % type(text).__name__)
        ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        if self.default_prepend_bos if prepend_bos is None else prepend_bos:
            bos = self.cfg.bos_token_id
            if bos is None or not 0 <= bos < self.config.vocab:
                raise ArgumentError(
                    "to_tokens: prepend_bos=True, but %s/config.json has no usable bos_token_id (%r)" % (self.path, bos)
                )
            ids = np.concatenate([np.array([bos], np.int32), ids])
        if ids.size and ids.max() >= self.config.vocab:
            raise Error(
                "tokenizer of %s gives id %d, beyond the model's vocab %d" % (self.path, ids.max(), self.config.vocab)
            )
        return ids

    def to_str_tokens(self, text_or_tokens, lengths=None):
        """The tokens of a text (or a [T] id array) as strings.

        Parameters
        ----------
        text_or_tokens : str or list of str or array_like of int
            A text or [T] ids; a list of texts or [B, T] ids gives one list per row.
        lengths : sequence of int or None
            [B] real lengths of [B, T] rows (padding cut off).

        Returns
        -------
        list of str or list of list of str
            One string per token (per row for a batch).

        Raises
        ------
        dclens.Error
            Ids of more than 2 axes.
        """
        if isinstance(text_or_tokens, (list, tuple)) and text_or_tokens and isinstance(text_or_tokens[0], str):
            return [self.to_str_tokens(t) for t in text_or_tokens]
        if isinstance(text_or_tokens, str):
            text_or_tokens = self.to_tokens(text_or_tokens)
        a = token_array(text_or_tokens)
        if a.ndim == 2:
            lens = [a.shape[1]] * a.shape[0] if lengths is None else list(lengths)
            return [self.to_str_tokens(row[:n]) for row, n in zip(a, lens)]
        if a.ndim > 2:
            raise Error("to_str_tokens: need [T] or [B, T] tokens, got shape %s" % (a.shape,))
        return [self.tokenizer.decode([int(t)]) for t in a.ravel()]

    def to_string(self, tokens) -> str | list[str]:
        """Decode token ids to text.

        Parameters
        ----------
        tokens : array_like of int
            [T] or [B, T] ids.

        Returns
        -------
        str or list of str
            The text ([T]), or one per row ([B, T]).

        Raises
        ------
        dclens.Error
            Ids that are not integers, or of more than 2 axes.
        """
        a = token_array(tokens)
        if a.ndim == 2:
            return [str(self.to_string(r)) for r in a]
        if a.ndim > 2 or a.dtype.kind not in "iu":
            raise Error("to_string: need integer [T] or [B, T] tokens, got %s %s" % (a.dtype, a.shape))
        return self.tokenizer.decode([int(t) for t in a.ravel()], skip_special_tokens=False)

    def to_single_token(self, text: str) -> int:
        """The id of a string that is exactly one token.

        Parameters
        ----------
        text : str
            The token's text (a leading space counts: " cat").

        Returns
        -------
        int
            Its id.

        Raises
        ------
        dclens.Error
            The text is not one token (the message lists the tokens it is).
        """
        ids = self.to_tokens(text)
        if ids.size != 1:
            raise Error("to_single_token: %r is %d tokens %s, not one" % (text, ids.size, self.to_str_tokens(ids)))
        return int(ids[0])

    # ------------------------------------------------------------ forward

    def forward(
        self,
        tokens,
        return_type: str | None = "logits",
        *,
        lengths=None,
        padding_side: str | None = None,
        loss_per_token: bool = False,
        logits_at=None,
        prepend_bos: bool | None = None,
    ):
        """Logits: [T, V] for a string or a 1-D token array, [B, T, V] for a list
        of strings or [B, T] tokens (with lengths: padded rows).

        return_type: "logits", "loss" (mean next-token cross-entropy over the
        real tokens; loss_per_token=True gives [T-1] / [B, T-1], 0 at padding),
        "both" (logits, loss) or None.

        logits_at computes the unembedding only where asked (logits only, no
        lengths): "last" or one position (-> [V] / [B, V]), [n] positions for
        every sequence or [B, n] per sequence (-> [n, V] / [B, n, V]).

        Parameters
        ----------
        tokens : str or list of str or array_like of int
            A string or [T] token ids (one sequence), or a list of strings or [B, T] ids.
        return_type : {"logits", "loss", "both", None}
            What to return.
        lengths : array_like of int or None
            [B] real lengths of padded [B, T] rows.
        padding_side : {"right", "left"} or None
            Where the rows are padded (None: right, or as a Padded says).
        loss_per_token : bool
            The loss per predicting position, [T-1] / [B, T-1] (0 at padding).
        logits_at : str or int or array_like of int or None
            Unembed only at these positions.
        prepend_bos : bool or None
            For text: put the BOS token first (None: the model's default).

        Returns
        -------
        numpy.ndarray or float or tuple or None
            float32 logits; or the loss (a float, the mean over the real predicting tokens,
            or per token); or (logits, loss); or None.

        Raises
        ------
        dclens.ArgumentError
            An unknown return_type, logits_at with another return_type, lengths or
            loss_per_token, bad positions, lengths or padding_side, or tokens that are
            not a non-empty [T] / [B, T] array of ids of the vocabulary.
        dclens.Error
            A loss over fewer than 2 tokens, a hook in force that fails, or logits that
            are not finite.
        """
        check_bool("loss_per_token", loss_per_token)
        if logits_at is not None:
            tokens = (
                self.to_tokens(tokens, prepend_bos=prepend_bos) if isinstance(tokens, str) else token_array(tokens)
            )  # tokens are checked (and named) first
            if not is_choice(return_type, ("logits",)) or lengths is not None or loss_per_token:
                raise ArgumentError(
                    "logits_at goes with return_type='logits', no lengths and no loss_per_token "
                    "(got return_type=%r, lengths %s, loss_per_token=%r)"
                    % (return_type, "given" if lengths is not None else "None", loss_per_token)
                )
            fns = self.hooks_in_force()
            self.token_ids(tokens)  # checked, and a ContextWarning for a long prompt
            return self.runner.run(tokens, fns=fns, logits_at=logits_at)[0]
        prompts = (tokens, lengths, padding_side, prepend_bos)
        return batch.call(self, prompts, return_type, loss_per_token=loss_per_token)

    __call__ = forward

    def run_with_cache(
        self,
        tokens,
        names: Names = None,
        *,
        names_filter: Names = None,
        lengths=None,
        padding_side: str | None = None,
        return_type: str | None = "logits",
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
        read_only: bool = False,
        prepend_bos: bool | None = None,
    ) -> tuple[np.ndarray, Cache]:
        """Logits and a Cache of the named activations (None: every hook).

        names (or names_filter, TransformerLens' spelling): None, a hook
        name, a list of names (dclens or TransformerLens spelling), or a
        predicate on names (tried on both spellings). Capture is read-only;
        fwd_hooks run as in run_with_hooks (read_only=True declares them all
        read-only).

        Parameters
        ----------
        tokens : str or list of str or array_like of int
            A string or [T] token ids (one sequence), or a list of strings or [B, T] ids.
        names : str or sequence of str or callable or None
            What to capture (None: every hook but the split inputs attn.{q,k,v}_input,
            attn.dyn_input, mlp_input, which are captured when named).
        names_filter : str or sequence of str or callable or None
            The same, under TransformerLens' name (not with names).
        lengths : array_like of int or None
            [B] real lengths of padded rows.
        padding_side : {"right", "left"} or None
            Where the rows are padded.
        return_type : {"logits", "loss", "both", None}
            What comes first in the result, as for forward.
        fwd_hooks : sequence of (str, callable) or Hooks
            Hooks run in the pass, as run_with_hooks's; the cache holds what they leave.
        read_only : bool
            Declare every hook of fwd_hooks read-only (each gets a read-only array and
            nothing is copied back).
        prepend_bos : bool or None
            For text: put the BOS token first.

        Returns
        -------
        tuple
            (logits, cache): what forward returns for return_type, and a Cache of the
            activations (hooks.md layouts, with a leading [B] for a batch).

        Raises
        ------
        dclens.ArgumentError
            Both names and names_filter, or arguments forward refuses.
        dclens.UnknownNameError
            A name this model does not have.
        dclens.Error
            A predicate that matches no hook, or a hook that fails.
        """
        if names is not None and names_filter is not None:
            raise ArgumentError("run_with_cache: give names or names_filter, not both")
        sel = names if names is not None else names_filter
        prompts = (tokens, lengths, padding_side, prepend_bos)
        fns = self._expand_hooks(hook_pairs(fwd_hooks, read_only))
        return batch.call(self, prompts, return_type, capture=self.runner.select(sel), fns=fns, with_cache=True)

    def resolve_hook(self, name: str) -> str:
        """The dclens name of a hook given in either spelling, checked.

        Parameters
        ----------
        name : str
            A hook name (dclens or TransformerLens spelling).

        Returns
        -------
        str
            Its dclens name.

        Raises
        ------
        dclens.UnknownNameError
            A name this model does not have.
        """
        n = _names.canonical(name)
        self.parse_hook(n)
        return n

    def hook_name(self, name, layer=None) -> str:
        """dclens.hook_name with negative layers counted from the end, checked
        against this model: model.hook_name(-1, "attn.post.kp").

        Parameters
        ----------
        name : str or int
            A short name, suffix or full name (or the layer, in either order).
        layer : int or None
            The layer (negative: from the end).

        Returns
        -------
        str
            The full name, e.g. "blocks.3.attn.post.kp" (dclens's spelling).

        Raises
        ------
        dclens.ArgumentError
            A layer out of range.
        dclens.UnknownNameError
            A name this model does not have.
        dclens.Error
            What dclens.hook_name refuses.
        """
        name, layer = _names.name_and_layer(name, layer)
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool) and layer < 0:
            layer = int(layer) + self.config.n_layer
            if layer < 0:
                raise ArgumentError(
                    "hook_name: layer %d is out of range (model has %d layers)"
                    % (layer - self.config.n_layer, self.config.n_layer)
                )
        n = _names.hook_name(name, layer)
        self.parse_hook(n)
        return n

    # ------------------------------------------------------------ persistent hooks

    def add_hook(self, name: str | Hooks, fn: HookFn | None = None, read_only: bool = False) -> None:
        """Add a hook that every later pass (forward, run_with_*, generate) runs,
        until reset_hooks().

        Parameters
        ----------
        name : str, predicate or Hooks
            A hook name (either spelling), a predicate on names (the hook
            runs at every name it accepts), or a ``Hooks`` (what the
            interventions helpers return; then without ``fn``):
            ``model.add_hook(iv.ablate_head(model, 1, 2))``.
        fn : callable, optional
            fn(act, name); required with a name or predicate.
        read_only : bool
            Declare fn (or every hook of a Hooks) read-only (dclens.read_only).

        Raises
        ------
        dclens.Error
            An unknown hook name, a fn that is not callable, a Hooks with a
            fn, or a name without one.
        """
        if isinstance(name, Hooks):
            if fn is not None:
                raise ArgumentError("add_hook: give a Hooks alone (it holds its functions), not with fn=%r" % (fn,))
            pairs = hook_pairs(name, read_only)
        else:
            if fn is None:
                raise ArgumentError(
                    "add_hook: fn is missing for hook %r (add_hook(name, fn), or add_hook(Hooks))" % (name,)
                )
            pairs = hook_pairs([(name, fn)], read_only)
        pairs = [(self.resolve_hook(n), f) for n, f in self._expand_hooks(pairs)]  # all checked before any is added
        self._ctx_hooks.extend(pairs)

    def reset_hooks(self) -> None:
        """Remove the hooks added with add_hook."""
        self._ctx_hooks.clear()

    def hooks(self, fwd_hooks: Sequence[tuple[str, HookFn]] = (), read_only: bool = False):
        """Context manager: the hooks apply to every pass inside the with block
        (read_only=True: see dclens.read_only).

        ``fwd_hooks`` is a list of (name, fn) pairs or a ``Hooks`` (what the
        interventions helpers return); a Hooks as one element of the list is
        flattened into its pairs.

        >>> with model.hooks(iv.ablate_head(model, 1, 2)):
        ...     logits = model(toks)
        >>> with model.hooks([*iv.ablate_head(model, 1, 2), *iv.disable_branch(model, "post", "kp")]):
        ...     logits = model(toks)

        Parameters
        ----------
        fwd_hooks : sequence of (str, callable) or Hooks
            The hooks (a name may be a predicate).
        read_only : bool
            Declare them read-only.

        Returns
        -------
        contextlib.AbstractContextManager
            Entering it adds the hooks (and gives the model); leaving it removes them.

        Raises
        ------
        dclens.UnknownNameError
            A name this model does not have (checked before the with block).
        """
        pairs = [(self.resolve_hook(n), fn) for n, fn in self._expand_hooks(hook_pairs(fwd_hooks, read_only))]

        @contextlib.contextmanager
        def cm():
            before = len(self._ctx_hooks)
            self._ctx_hooks.extend(pairs)
            try:
                yield self
            finally:
                del self._ctx_hooks[before:]

        return cm()

    def generate(
        self,
        prompt,
        max_new_tokens: int = 20,
        temperature: float = 0.0,
        top_k: int | None = None,
        stop=None,
        *,
        seed: int | None = None,
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
        return_type: str = "auto",
        verbose: bool = False,
    ):
        """Continue a prompt with the engine's incremental decoder (dclens.generate).

        Parameters
        ----------
        prompt : str or array_like of int or list
            A string, [T] token ids, or a list of either.
        max_new_tokens : int
            At most this many new tokens.
        temperature : float
            0: greedy; > 0: sampling.
        top_k : int or None
            Sample among the top_k tokens only.
        stop : str or int or sequence or None
            Stop token ids or strings.
        seed : int or None
            The sampler's seed.
        fwd_hooks : sequence of (str, callable)
            Hooks called at every decoding step.
        return_type : {"auto", "str", "tokens"}
            Text, token ids, or what the prompt was.
        verbose : bool
            Print each new token.

        Returns
        -------
        str or numpy.ndarray or list
            The prompt and its continuation (a list for a list of prompts).

        Raises
        ------
        dclens.Error
            As dclens.generate.
        """
        return _generate(self, prompt, max_new_tokens, temperature, top_k, stop, seed, fwd_hooks, return_type, verbose)

    def run_with_hooks(
        self,
        tokens,
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
        cache_names: Names = (),
        *,
        lengths=None,
        padding_side: str | None = None,
        return_type: str | None = "logits",
        read_only: bool = False,
        prepend_bos: bool | None = None,
    ):
        """Logits of a pass where fn(activation, name) is called at each named point.

        fn may modify the activation in place, return a replacement array of the
        same shape, or return None to keep it. A name may be a predicate
        (lambda name: name.endswith("pattern"), as in TransformerLens): fn then
        runs at every hook it accepts (in either spelling). Writing to a compose branch
        (blocks.{l}.attn.post.kp) changes the composed sum that follows; writing
        to pattern_composed, z, head_out, resid_* changes everything downstream.
        Every hook that is called counts as a write (what it leaves in the
        array is copied back into the engine) unless it is read-only:
        dclens.read_only(fn), or read_only=True for all of fwd_hooks; a
        read-only hook gets a read-only array and costs no copy back.
        fwd_hooks is a list of (name, fn) pairs or a ``Hooks`` (what the
        interventions helpers return: ``fwd_hooks=iv.ablate_head(...)``); a
        Hooks given as one element of the list is flattened into its pairs.
        With cache_names (None meaning every hook, as in run_with_cache),
        returns (logits, cache) of the hooked pass.

        Parameters
        ----------
        tokens : str or list of str or array_like of int
            A string or [T] token ids (one sequence), or a list of strings or [B, T] ids.
        fwd_hooks : sequence of (str, callable) or Hooks
            (name or predicate, fn) pairs; fn(act, name).
        cache_names : str or sequence of str or callable or None
            Also capture these activations (None: every hook; empty: none).
        lengths : array_like of int or None
            [B] real lengths of padded rows.
        padding_side : {"right", "left"} or None
            Where the rows are padded.
        return_type : {"logits", "loss", "both", None}
            What to return, as for forward.
        read_only : bool
            Declare every hook of fwd_hooks read-only.
        prepend_bos : bool or None
            For text: put the BOS token first.

        Returns
        -------
        numpy.ndarray or float or tuple
            What forward returns for return_type; with cache_names, (that, cache).

        Raises
        ------
        dclens.UnknownNameError
            A hook name this model does not have.
        dclens.Error
            A hook function that fails or returns an array of the wrong shape, or arguments
            forward refuses.
        """
        fwd_hooks = self._expand_hooks(hook_pairs(fwd_hooks, read_only))
        want_cache = cache_names is None or bool(cache_names)
        cap = self.runner.select(cache_names) if want_cache else ()
        prompts = (tokens, lengths, padding_side, prepend_bos)
        return batch.call(self, prompts, return_type, capture=cap, fns=fwd_hooks, with_cache=want_cache)

    def last_pass_memory(self) -> dict[str, int]:
        """Activation bytes of the last pass (weights excluded): 'peak' held at
        once and 'total' asked for. Hooks not asked for add nothing. After a
        gradient pass: the tape's buffers plus the largest transient of its
        forward and recomputations, and the scratch of its backward ('peak';
        estimate_backward_memory bounds it; a tape reused from the model's
        cache counts its buffers at the shape it was made for).

        Returns
        -------
        dict of str to int
            {"peak": bytes, "total": bytes}.
        """
        peak, total = self.runner.forward_memory()
        return {"peak": peak, "total": total}

    def free_caches(self) -> None:
        """Give back the memory the model keeps between calls: the gradient
        tapes that gradients / attribute reuse (dclens.tapes, at most two,
        within the max_tape_bytes of the call that made them), the
        activation buffers pooled between passes, and the weights last read
        by Model.weight. Everything is made again when needed; results do
        not change.

        Raises
        ------
        dclens.Error
            Called from a hook of a running pass.
        """
        r = self.runner
        if r.pass_thread is not None and r.pass_thread == threading.get_ident():
            raise Error("free_caches: not from a hook of a running pass (call it after the pass)")
        r.tapes.clear()
        self.__dict__.pop("_weights", None)
        r.trim()

    # ------------------------------------------------------------ weights

    def weight(self, name: str) -> np.ndarray:
        """A weight by canonical (dcpythia) name, as a read-only float32 array
        (see dclens.h). The last few weights read are kept, so per-head
        circuit code can call this in a loop.

        Parameters
        ----------
        name : str
            A canonical weight name ("layers.3.attention.wqkv.weight"; model.weight_names()).

        Returns
        -------
        numpy.ndarray
            The weight, float32 (widened from F16/BF16), read-only, in its stored shape.

        Raises
        ------
        dclens.UnknownNameError
            A weight this model does not have (with the closest names).
        dclens.Error
            A name that is not a string or holds a NUL, or a weight that cannot be read.
        """
        c_str("weight name", name)  # a str without NUL, or the ArgumentError naming it
        cache = self.__dict__.setdefault("_weights", {})
        if name in cache:
            cache[name] = cache.pop(name)  # most recently used last
            return cache[name]
        try:
            out = self.runner.read_weight(name)
        except Error as e:
            if not self._has_weight(name):
                raise unknown_name(
                    "weight", name, self.weight_names(), "", "model.weight_names()", message=str(e)
                ) from None
            raise
        out.flags.writeable = False
        cache[name] = out
        while len(cache) > 6:
            cache.pop(next(iter(cache)))
        return out

    # ------------------------------------------------------------ routing, circuits

    def composition_map(
        self, tokens, layer: int, phase: str, query: int, key: int, cache: Cache | None = None
    ) -> np.ndarray:
        """The N x N head-to-head map C[query, key] of a layer and phase (routing.py).
        With cache= (a run_with_cache of the same tokens) no pass is run.

        Parameters
        ----------
        tokens : str or array_like of int
            The prompt ([T]; with cache=, the cache's).
        layer : int
            The layer whose compose.
        phase : {"pre", "post"}
            Composition of the scores (pre) or of the pattern (post).
        query : int
            The query position (negative: from the end).
        key : int
            The key position.
        cache : Cache or None
            A run_with_cache of the same tokens with the layer's dyn.* hooks.

        Returns
        -------
        numpy.ndarray
            [N, N]: C[source, target] (the identity for plain MHA).

        Raises
        ------
        dclens.Error
            A layer, phase or position out of range, or a cache without the dyn.* it reads.
        """
        if cache is not None:
            return routing.composition_maps(self, cache, layer, phase, query=query, key=key)
        return routing.composition_map(self, tokens, layer, phase, query, key)

    def routing_matrix(self, tokens, layer: int, phase: str, query: int, cache: Cache | None = None) -> np.ndarray:
        """Head-to-head routing at a query, weighted by what it routes (routing.py).
        With cache= no pass is run; routing.routing_matrices gives every query at once.

        Parameters
        ----------
        tokens : str or array_like of int
            The prompt ([T]), run once unless cache= is given.
        layer : int
            The layer routed.
        phase : {"pre", "post"}
            The scores (pre) or the pattern (post) routed.
        query : int
            The query position.
        cache : Cache or None
            A run_with_cache of the same tokens with the layer's pattern or scores and
            dyn.* hooks.

        Returns
        -------
        numpy.ndarray
            [N, N]: R[n, m], how much of source head n's attention lands in target head m.

        Raises
        ------
        dclens.Error
            A layer, phase or query out of range, or a cache without the pattern / scores or
            dyn.* it reads.
        """
        if cache is not None:
            return routing.routing_matrices(self, cache, phase, layers=[layer], queries=[query])[0, 0]
        return routing.routing_matrix(self, tokens, layer, phase, query)

    # what routing.flows / grad.gradients / memplan.estimate do, as methods: one definition each,
    # model.flows(tokens, ...) is routing.flows(model, tokens, ...)
    flows = routing.flows

    def gates(self, tokens, layer: int, cache: Cache | None = None):
        """The dynamic gates qdd/kdd of both phases of a layer (routing.py).

        Parameters
        ----------
        tokens : str or array_like of int
            The prompt ([T]; not run with cache=).
        layer : int
            The layer whose gates.
        cache : Cache or None
            A run_with_cache of the same tokens with the layer's dyn.*.qdd / kdd hooks.

        Returns
        -------
        dict of str to numpy.ndarray
            {"pre.qdd": [T, N], "pre.kdd", "post.qdd", "post.kdd"} (one side only for a
            query-wise or key-wise model): how much each head keeps of its own score or
            weight, per token.

        Raises
        ------
        dclens.Error
            A plain-MHA model (no gates), a layer out of range, or a cache without the gates.
        """
        if cache is not None:
            return routing.gates_from_cache(self, cache, layer)
        return routing.gates(self, tokens, layer)

    # ------------------------------------------------------------ gradients, attribution (grad.py, attribution.py)

    gradients = grad.gradients

    def attribute(
        self,
        tokens,
        target,
        at,
        method: str = "ig",
        steps: int = 32,
        baseline="zero",
        progress: bool | None = None,
        max_tape_bytes: int | None = None,
    ):
        """Integrated gradients or gradient x activation at hook points (dclens.attribution).

        Parameters
        ----------
        tokens : str or array_like of int
            [T] or [B, T] tokens.
        target : str or tuple
            The scalar attributed (dclens.grad's targets).
        at : str or sequence of str
            The hook point(s).
        method : {"ig", "grad_x_act"}
            Integrated gradients or gradient x activation.
        steps : int
            IG's interpolation intervals.
        baseline : {"zero", "mean"} or array_like
            IG's baseline.
        progress : bool or None
            A progress bar over the IG batches.
        max_tape_bytes : int or None
            The tape's memory budget, bytes.

        Returns
        -------
        dclens.attribution.Attribution
            The attributions per hook and their per-head totals.

        Raises
        ------
        dclens.Error
            As dclens.attribution.attribute.
        """
        return attribution.attribute(
            self,
            tokens,
            target,
            at,
            method=method,
            steps=steps,
            baseline=baseline,
            progress=progress,
            max_tape_bytes=max_tape_bytes,
        )

    estimate_backward_memory = memplan.estimate
