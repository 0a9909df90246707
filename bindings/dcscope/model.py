"""Model: a loaded checkpoint, its forward pass, and hooks (read and write).

Thin layer over the C engine (dcscope._engine): the engine runs the pass and
calls back at every wanted hook point with the activation for the whole batch;
this module turns that into numpy arrays, a cache, and user hook functions.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from ._engine import ffi, lib


class Error(Exception):
    """Every failure of dcscope: the message names the file, hook or argument."""


def _check(status: int, msg: str) -> None:
    if status != lib.DCS_OK:
        raise Error(msg or ffi.string(lib.dcs_status_name(status)).decode())


@dataclasses.dataclass(frozen=True)
class Config:
    """Dimensions and switches of a loaded model."""

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
    local_layers: Tuple[int, ...]
    tie_embeddings: bool

    def __getitem__(self, key):  # dict-style access for notebooks
        return getattr(self, key)


HookFn = Callable[[np.ndarray, str], Optional[np.ndarray]]
Names = Union[None, str, Iterable[str], Callable[[str], bool]]


def cuda_available() -> bool:
    """True if the engine was built with CUDA and a GPU is usable."""
    return bool(lib.dcs_cuda_available(ffi.NULL, 0))


def cuda_unavailable_reason() -> str:
    why = ffi.new("char[]", 512)
    if lib.dcs_cuda_available(why, 512):
        return ""
    return ffi.string(why).decode(errors="replace")


def load(path: Union[str, os.PathLike], device: str = "cpu", n_threads: int = 0) -> "Model":
    """Load a DCPythia or Pythia checkpoint directory (config.json + weights),
    or a bundled model by name (dcscope.bundled_models())."""
    from .bundled import resolve
    return Model(resolve(path), device=device, n_threads=n_threads)


class Cache(dict):
    """Activations by hook name (numpy arrays), from run_with_cache."""

    def layer(self, l: int) -> Dict[str, np.ndarray]:
        """The activations of block l, keyed by the name after 'blocks.{l}.'."""
        p = "blocks.%d." % l
        return {k[len(p):]: v for k, v in self.items() if k.startswith(p)}

    def stack(self, suffix: str) -> np.ndarray:
        """[L, ...]: one per-layer hook across all layers that were captured."""
        keys = sorted((k for k in self if k.startswith("blocks.") and k.split(".", 2)[2] == suffix),
                      key=lambda k: int(k.split(".")[1]))
        if not keys:
            raise Error("cache has no 'blocks.*.%s'" % suffix)
        return np.stack([self[k] for k in keys])


class _Run:
    """State of one forward pass with hooks: what to call where, the cache."""

    def __init__(self, model: "Model", batched: bool):
        self.model = model
        self.batched = batched
        self.capture: Dict[Tuple[int, int], str] = {}
        self.fns: Dict[Tuple[int, int], List[Tuple[str, HookFn]]] = {}
        self.cache = Cache()
        self.error: Optional[BaseException] = None


@ffi.def_extern()
def _dcs_py_hook(user, point, layer, data, shape, ndim):
    run: _Run = ffi.from_handle(user)
    key = (point, layer)
    name = run.model._hook_name(point, layer)
    try:
        dims = tuple(shape[i] for i in range(ndim))
        n = int(np.prod(dims))
        arr = np.frombuffer(ffi.buffer(data, n * 4), dtype=np.float32).reshape(dims)
        view = arr if run.batched else arr[0]
        modified = False
        for fname, fn in run.fns.get(key, ()):
            before = view.copy()
            out = fn(view, name)
            if out is not None and out is not view:
                out = _validate(out, view.shape, name)
                view[...] = out
            if not np.array_equal(before, view, equal_nan=True):
                if not np.all(np.isfinite(view)):
                    raise Error("hook %s: the hook function wrote NaN or inf values" % name)
                modified = True
        if key in run.capture:
            run.cache[name] = view.copy()
        return 1 if modified else 0
    except BaseException as e:  # noqa: BLE001 -- reported after the pass returns
        run.error = e
        return -1


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _validate(out, shape, name: str) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        try:
            out = np.asarray(out)
        except Exception:
            raise Error("hook %s: the hook function returned %s, not an array" % (name, type(out).__name__))
    if out.dtype.kind != "f":
        raise Error("hook %s: the hook function returned dtype %s; a floating array is needed" % (name, out.dtype))
    if out.shape != tuple(shape):
        raise Error("hook %s: the hook function returned shape %s, expected %s" % (name, out.shape, tuple(shape)))
    if not np.all(np.isfinite(out)):
        raise Error("hook %s: the hook function returned NaN or inf values" % name)
    return out


class Model:
    """A loaded DCPythia or Pythia model.

    >>> m = dcscope.load("path/to/model")
    >>> logits = m.forward(m.to_tokens("The cat sat"))
    >>> logits, cache = m.run_with_cache(tokens, names=lambda n: n.endswith("pattern"))
    """

    def __init__(self, path, device: str = "cpu", n_threads: int = 0):
        path = os.fspath(path)
        if device not in ("cpu", "cuda"):
            raise Error("device must be 'cpu' or 'cuda', not %r" % (device,))
        opts = ffi.new("dcs_load_options *")
        opts.device = 1 if device == "cuda" else 0
        opts.n_threads = n_threads
        out = ffi.new("dcs_model **")
        err = ffi.new("char[]", 1024)
        st = lib.dcs_load(path.encode(), opts, out, err, 1024)
        _check(st, ffi.string(err).decode(errors="replace"))
        self._m = ffi.gc(out[0], lib.dcs_free)
        self.path = path
        self.name = os.path.basename(os.path.normpath(path))
        self.device = device
        c = lib.dcs_model_config(self._m)
        self.config = Config(
            model_type="dcpythia" if c.model_type == 1 else "gpt_neox",
            n_layer=c.n_layer, d_model=c.d_model, n_head=c.n_head, head_dim=c.head_dim,
            d_ff=c.d_ff, vocab=c.vocab, rotary_dim=c.rotary_dim, rope_base=c.rope_base,
            norm_eps=c.norm_eps, parallel_residual=bool(c.parallel_residual),
            qk_norm=bool(c.qk_norm), linear_bias=bool(c.linear_bias),
            use_dcmha=bool(c.use_dcmha), query_wise=bool(c.query_wise), dyn_rank=c.dyn_rank,
            dyn_hidden=c.dyn_hidden, window_size=c.window_size,
            local_layers=tuple(l for l in range(c.n_layer) if lib.dcs_layer_is_local(self._m, l)),
            tie_embeddings=bool(c.tie_embeddings))
        self._tokenizer = None
        self._names = self._all_hook_names()

    def __repr__(self) -> str:
        c = self.config
        return "<dcscope.Model %s: %s, %d layers, d_model %d, %d heads, on %s>" % (
            self.name, c.model_type, c.n_layer, c.d_model, c.n_head, self.device)

    # ------------------------------------------------------------ names

    def _hook_name(self, point: int, layer: int) -> str:
        suffix = ffi.string(lib.dcs_hook_point_name(point)).decode()
        return "blocks.%d.%s" % (layer, suffix) if lib.dcs_hook_point_is_layered(point) else suffix

    def _all_hook_names(self) -> List[str]:
        """Every hook this model has, in forward order: embed, then block by
        block in the order of the pass, then ln_final and logits."""
        points = [p for p in range(lib.DCS_HP_COUNT) if lib.dcs_hook_exists(self._m, p)]
        layered = [p for p in points if lib.dcs_hook_point_is_layered(p)]
        glob = [p for p in points if not lib.dcs_hook_point_is_layered(p)]
        names = [self._hook_name(p, 0) for p in glob if p < layered[0]]
        for l in range(self.config.n_layer):
            names += [self._hook_name(p, l) for p in layered]
        names += [self._hook_name(p, 0) for p in glob if p > layered[0]]
        return names

    @property
    def hook_names(self) -> List[str]:
        """Every hook name this model has, in forward order per layer."""
        return list(self._names)

    def parse_hook(self, name: str) -> Tuple[int, int]:
        if not isinstance(name, str):
            raise Error("hook name must be a string, not %r" % (name,))
        p, l = ffi.new("int *"), ffi.new("int *")
        _check(lib.dcs_hook_parse(self._m, name.encode(), p, l), self._errmsg())
        return p[0], l[0]

    def _select(self, names: Names) -> List[str]:
        if names is None:
            return list(self._names)
        if isinstance(names, str):
            names = [names]
        if callable(names):
            return [n for n in self._names if names(n)]
        names = list(names)
        for n in names:
            self.parse_hook(n)
        return names

    def _errmsg(self) -> str:
        return ffi.string(lib.dcs_errmsg(self._m)).decode(errors="replace")

    # ------------------------------------------------------------ tokens

    @property
    def tokenizer(self):
        """The HF `tokenizers.Tokenizer` of the model directory (tokenizer.json)."""
        if self._tokenizer is None:
            p = os.path.join(self.path, "tokenizer.json")
            if not os.path.exists(p):
                raise Error("%s has no tokenizer.json" % self.path)
            from tokenizers import Tokenizer
            try:
                self._tokenizer = Tokenizer.from_file(p)
            except Exception as e:
                raise Error("%s: cannot read the tokenizer: %s" % (p, e))
        return self._tokenizer

    def to_tokens(self, text: str) -> np.ndarray:
        """Token ids of `text` (no BOS is added, as for Pythia)."""
        ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        if ids.size and ids.max() >= self.config.vocab:
            raise Error("tokenizer of %s gives id %d, beyond the model's vocab %d"
                        % (self.path, ids.max(), self.config.vocab))
        return ids

    def to_str_tokens(self, text_or_tokens) -> List[str]:
        """The tokens of a text (or an id array) as strings."""
        if isinstance(text_or_tokens, str):
            text_or_tokens = self.to_tokens(text_or_tokens)
        return [self.tokenizer.decode([int(t)]) for t in np.asarray(text_or_tokens).ravel()]

    # ------------------------------------------------------------ forward

    def _tokens(self, tokens) -> Tuple[np.ndarray, bool]:
        if isinstance(tokens, str):
            tokens = self.to_tokens(tokens)
        a = np.asarray(tokens)
        if a.dtype.kind not in "iu":
            raise Error("tokens must be integers, got dtype %s" % a.dtype)
        if a.ndim not in (1, 2) or a.size == 0:
            raise Error("tokens must be a non-empty [T] or [B, T] array, got shape %s" % (a.shape,))
        if a.min() < 0 or a.max() >= self.config.vocab:
            raise Error("token id %d is out of range [0, %d)" % (a.max() if a.max() >= self.config.vocab else a.min(), self.config.vocab))
        batched = a.ndim == 2
        return np.ascontiguousarray(a.reshape(-1, a.shape[-1]), dtype=np.int32), batched

    def _positions(self, logits_at, B: int, T: int):
        """logits_at -> (int32 [B, n] positions, squeeze?) or (None, False)."""
        if logits_at is None:
            return None, False
        if isinstance(logits_at, str):
            if logits_at != "last":
                raise Error("logits_at must be None, 'last', or positions, got %r" % (logits_at,))
            return np.full((B, 1), T - 1, dtype=np.int32), True
        a = np.asarray(logits_at)
        if a.dtype.kind not in "iu" or a.size == 0 or a.ndim not in (0, 1, 2):
            raise Error("logits_at must be 'last', an integer, [n] or [B, n] integer positions, got %r"
                        % (logits_at,))
        squeeze = a.ndim == 0
        a = a.reshape(1, -1) if a.ndim < 2 else a
        if a.shape[0] == 1 and B > 1:
            a = np.broadcast_to(a, (B, a.shape[1]))
        if a.shape[0] != B:
            raise Error("logits_at has positions for %d sequences, tokens have %d" % (a.shape[0], B))
        if a.shape[1] > T:
            raise Error("logits_at asks for %d positions per sequence, more than T = %d" % (a.shape[1], T))
        if a.min() < 0 or a.max() >= T:
            raise Error("logits_at position %d is out of range [0, %d)"
                        % (a.max() if a.max() >= T else a.min(), T))
        return np.ascontiguousarray(a, dtype=np.int32), squeeze

    def _run(self, tokens, capture: Sequence[str] = (), fns: Sequence[Tuple[str, HookFn]] = (),
             logits: bool = True, logits_at=None):
        toks, batched = self._tokens(tokens)
        B, T = toks.shape
        pos, squeeze = self._positions(logits_at, B, T)
        n_out = T if pos is None else pos.shape[1]
        run = _Run(self, batched)
        L = self.config.n_layer
        want = np.zeros(lib.DCS_HP_COUNT * L, dtype=np.uint8)
        for n in capture:
            p, l = self.parse_hook(n)
            run.capture[(p, l)] = n
            want[p * L + l] = 1
        for n, fn in fns:
            if not callable(fn):
                raise Error("hook %s: %r is not callable" % (n, fn))
            p, l = self.parse_hook(n)
            run.fns.setdefault((p, l), []).append((n, fn))
            want[p * L + l] = 1
        if logits and B * n_out * self.config.vocab * 4 > _physical_memory():
            raise Error("forward: logits of B=%d, T=%d, vocab %d need %.1f GiB, more than this machine's memory"
                        % (B, n_out, self.config.vocab, B * n_out * self.config.vocab * 4 / 2**30))
        out = np.empty((B, n_out, self.config.vocab), dtype=np.float32) if logits else None
        hooks = ffi.NULL
        if want.any():
            handle = ffi.new_handle(run)
            hooks = ffi.new("dcs_hooks *")
            hooks.want = ffi.cast("const uint8_t *", ffi.from_buffer(want))
            hooks.fn = lib._dcs_py_hook
            hooks.user = handle
        st = lib.dcs_forward_at(self._m, ffi.cast("const int32_t *", ffi.from_buffer(toks)), B, T,
                                ffi.cast("const int32_t *", ffi.from_buffer(pos)) if pos is not None else ffi.NULL,
                                0 if pos is None else pos.shape[1],
                                ffi.cast("float *", ffi.from_buffer(out)) if out is not None else ffi.NULL,
                                hooks)
        if run.error is not None:
            e = run.error
            if isinstance(e, Error):
                raise e
            raise Error("%s: %s: %s" % (self._errmsg().replace(" aborted the forward pass", ""),
                                        type(e).__name__, e)) from e
        _check(st, self._errmsg())
        if out is not None and squeeze:
            out = out[:, 0]
        if out is not None and not batched:
            out = out[0]
        return out, run.cache

    def forward(self, tokens, logits_at=None) -> np.ndarray:
        """Logits: [T, V] for a 1-D token array (or a string), [B, T, V] for [B, T].

        logits_at computes the unembedding only where asked: "last" (-> [V] /
        [B, V]), one position (-> [V] / [B, V]), [n] positions for every
        sequence or [B, n] per sequence (-> [n, V] / [B, n, V])."""
        return self._run(tokens, logits_at=logits_at)[0]

    __call__ = forward

    def run_with_cache(self, tokens, names: Names = None) -> Tuple[np.ndarray, Cache]:
        """Logits and a Cache of the named activations (None: every hook).

        names: None, a hook name, a list of names, or a predicate on names."""
        return self._run(tokens, capture=self._select(names))

    def run_with_hooks(self, tokens, fwd_hooks: Sequence[Tuple[str, HookFn]] = (),
                       cache_names: Names = ()) -> np.ndarray:
        """Logits of a pass where fn(activation, name) is called at each named point.

        fn may modify the activation in place, return a replacement array of the
        same shape, or return None to keep it. Writing to a compose branch
        (blocks.{l}.attn.post.kp) changes the composed sum that follows; writing
        to pattern_composed, z, head_out, resid_* changes everything downstream.
        With cache_names, returns (logits, cache) of the hooked pass."""
        fwd_hooks = list(fwd_hooks)
        for item in fwd_hooks:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise Error("fwd_hooks must be a list of (name, fn) pairs, got %r" % (item,))
        cap = self._select(cache_names) if cache_names else ()
        logits, cache = self._run(tokens, capture=cap, fns=fwd_hooks)
        return (logits, cache) if cache_names else logits

    def last_pass_memory(self) -> Dict[str, int]:
        """Activation bytes of the last pass (weights excluded): 'peak' held at
        once and 'total' asked for. Hooks not asked for add nothing."""
        peak, total = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        lib.dcs_forward_memory(self._m, peak, total)
        return {"peak": int(peak[0]), "total": int(total[0])}

    # ------------------------------------------------------------ weights

    def weight(self, name: str) -> np.ndarray:
        """A weight by canonical (dcpythia) name, as a read-only float32 array
        (see dcscope.h). The last few weights read are kept, so per-head
        circuit code can call this in a loop."""
        cache = self.__dict__.setdefault("_weights", {})
        if name in cache:
            cache[name] = cache.pop(name)  # most recently used last
            return cache[name]
        shape = ffi.new("int64_t[5]")
        nd = ffi.new("int *")
        _check(lib.dcs_weight_shape(self._m, name.encode(), shape, nd), self._errmsg())
        dims = tuple(shape[i] for i in range(nd[0]))
        out = np.empty(dims, dtype=np.float32)
        _check(lib.dcs_weight_read(self._m, name.encode(), ffi.cast("float *", ffi.from_buffer(out)), out.size),
               self._errmsg())
        out.flags.writeable = False
        cache[name] = out
        while len(cache) > 6:
            cache.pop(next(iter(cache)))
        return out

    # ------------------------------------------------------------ routing, circuits

    def composition_map(self, tokens, layer: int, phase: str, query: int, key: int) -> np.ndarray:
        """The N x N head-to-head map C[query, key] of a layer and phase (routing.py)."""
        from . import routing
        return routing.composition_map(self, tokens, layer, phase, query, key)

    def routing_matrix(self, tokens, layer: int, phase: str, query: int) -> np.ndarray:
        """Head-to-head routing at a query, weighted by what it routes (routing.py)."""
        from . import routing
        return routing.routing_matrix(self, tokens, layer, phase, query)

    def gates(self, tokens, layer: int):
        """The dynamic gates qdd/kdd of both phases of a layer (routing.py)."""
        from . import routing
        return routing.gates(self, tokens, layer)
