"""SAELens's on-disk format both ways: a directory of ``cfg.json`` + ``sae_weights.safetensors``
(docs/features.md, "The SAELens format").

Hook names are written in TransformerLens's spelling (blocks.3.hook_resid_pre) and read in
either; the safetensors file is written and read with json + numpy (no pickle, no torch).
JumpReLU's threshold is stored as ``threshold`` (not its log), as SAELens does. A BatchTopK
dictionary is written as SAELens writes one after training: architecture ``jumprelu`` with its
one threshold for every feature (``dclens: {"arch": "batchtopk", "k": k}`` lets dclens read it
back as BatchTopK, the threshold's float32 bits unchanged).
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np

from .._core.checks import Error
from .._core.names import canonical, tl_alias
from .sae import SAE, SAEConfig

CFG, WEIGHTS = "cfg.json", "sae_weights.safetensors"
_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
}
_MAX_HEADER = 100 << 20


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write float32 tensors as a safetensors file (8-byte little-endian header length, JSON
    header, then the data in order).

    Parameters
    ----------
    path : str
        The file.
    tensors : dict
        name -> array (written as F32, C order).
    metadata : dict or None
        The header's ``__metadata__`` (strings).
    """
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    blobs, off = [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(np.shape(a)), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Read a safetensors file's tensors as float32 arrays (F32, F64, F16 and BF16 read).

    Parameters
    ----------
    path : str
        The file.

    Returns
    -------
    dict
        name -> float32 array of its shape.

    Raises
    ------
    dclens.Error
        A file that is not safetensors (naming it and what is wrong), or of another dtype.
    """
    with open(path, "rb") as f:
        data = f.read()
    bad = "%s is not a safetensors file: " % path
    if len(data) < 8:
        raise Error(bad + "%d bytes, shorter than the header's length" % len(data))
    n = int.from_bytes(data[:8], "little")
    if n < 2 or n > min(_MAX_HEADER, len(data) - 8):
        raise Error(bad + "header length %d does not fit the file's %d bytes" % (n, len(data)))
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise Error(bad + "its header is not JSON (%s)" % e) from None
    if not isinstance(header, dict):
        raise Error(bad + "its header is not a JSON object")
    body, out = data[8 + n :], {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (a, b) = _DTYPES[t["dtype"]], [int(d) for d in t["shape"]], t["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise Error(
                bad + "tensor %r has no dtype F32/F64/F16/BF16, shape and data_offsets (%r)" % (name, t)
            ) from None
        if not (0 <= a <= b <= len(body)) or b - a != dt.itemsize * math.prod(shape):
            raise Error(bad + "tensor %r's data_offsets %r do not fit its shape %s" % (name, [a, b], shape))
        arr = np.frombuffer(body, dt, math.prod(shape), a)
        if t["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.astype(np.float32).reshape(shape)
    return out


def _layer_of(name: str) -> int:
    m = re.match(r"^blocks\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def saelens_cfg(sae: SAE) -> dict:
    """The cfg.json of `sae` in SAELens's fields.

    Parameters
    ----------
    sae : SAE
        The dictionary.

    Returns
    -------
    dict
        architecture, d_in, d_sae, dtype, device, model_name, hook_name (TransformerLens
        spelling), hook_layer, hook_head_index, activation_fn_str, activation_fn_kwargs,
        apply_b_dec_to_input, finetuning_scaling_factor, context_size, dataset_path,
        normalize_activations, prepend_bos; a transcoder adds d_out, hook_name_out, hook_layer_out.
    """
    c = sae.cfg
    arch = {"relu": "standard", "topk": "topk", "jumprelu": "jumprelu", "batchtopk": "jumprelu"}[c.arch]
    out = {
        "architecture": arch,
        "d_in": c.d_in,
        "d_sae": c.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "model_name": c.model_name,
        "hook_name": tl_alias(c.hook_name) or c.hook_name,
        "hook_layer": _layer_of(c.hook_name),
        "hook_head_index": None,
        "activation_fn_str": "topk" if c.arch == "topk" else "relu",
        "activation_fn_kwargs": {"k": c.k} if c.arch == "topk" else {},
        "apply_b_dec_to_input": c.apply_b_dec_to_input,
        "finetuning_scaling_factor": False,
        "context_size": c.context_size,
        "dataset_path": c.dataset_path,
        "normalize_activations": "none",
        "prepend_bos": c.prepend_bos,
        "dclens": {
            "normalize_decoder": c.normalize_decoder,
            "sparsity_coef": c.sparsity_coef,
            "bandwidth": c.bandwidth,
            **({"arch": "batchtopk", "k": c.k} if c.arch == "batchtopk" else {}),
        },
    }
    if c.is_transcoder:
        out.update(
            d_out=c.width_out,
            hook_name_out=tl_alias(c.hook_name_out) or c.hook_name_out,
            hook_layer_out=_layer_of(c.hook_name_out),
        )
    return out


def save(sae: SAE, directory) -> str:
    """Write `sae` as SAELens does: directory/cfg.json and directory/sae_weights.safetensors.

    Parameters
    ----------
    sae : SAE
        The dictionary.
    directory : str or os.PathLike
        Created if missing.

    Returns
    -------
    str
        The directory.
    """
    d = os.fspath(directory)
    os.makedirs(d, exist_ok=True)
    p = sae.parameters()
    tensors = {k: p[k] for k in ("W_enc", "b_enc", "W_dec", "b_dec")}
    if "log_threshold" in p:
        tensors["threshold"] = np.exp(p["log_threshold"].astype(np.float64)).astype(np.float32)
    if "threshold" in p:  # BatchTopK: its one threshold per feature, as SAELens's JumpReLU reads it
        tensors["threshold"] = np.full(sae.cfg.d_sae, p["threshold"][0], np.float32)
    write_safetensors(os.path.join(d, WEIGHTS), tensors, {"format": "pt"})
    with open(os.path.join(d, CFG), "w", encoding="utf-8") as f:
        json.dump(saelens_cfg(sae), f, indent=2)
    return d


def _config_from(cfg: dict, where: str) -> SAEConfig:
    """An SAEConfig from SAELens's cfg.json fields (older spellings too: hook_point)."""
    arch = cfg.get("architecture", "standard")
    fn = cfg.get("activation_fn_str", "relu")
    kwargs = cfg.get("activation_fn_kwargs") or {}
    if arch == "jumprelu":
        kind = "jumprelu"
    elif arch == "topk" or (arch == "standard" and fn == "topk"):
        kind = "topk"
    elif arch == "standard" and fn == "relu":
        kind = "relu"
    else:
        raise Error(
            "%s: architecture %r with activation_fn_str %r is not one dclens runs (standard/relu, topk, jumprelu)"
            % (where, arch, fn)
        )
    norm = cfg.get("normalize_activations", "none") or "none"
    if norm != "none":
        raise Error("%s: normalize_activations %r: dclens runs only 'none'" % (where, norm))
    if cfg.get("hook_head_index") is not None:
        raise Error(
            "%s: hook_head_index %r: SAEs on one head's slice are not supported" % (where, cfg["hook_head_index"])
        )
    hook = cfg.get("hook_name", cfg.get("hook_point"))
    for key, v in (("d_in", cfg.get("d_in")), ("d_sae", cfg.get("d_sae")), ("hook_name", hook)):
        if v is None:
            raise Error("%s has no %s" % (where, key))
    extra = cfg.get("dclens") or {}
    if kind == "jumprelu" and extra.get("arch") == "batchtopk":
        kind, kwargs = "batchtopk", {"k": extra.get("k", 0)}
    return SAEConfig(
        d_in=int(cfg["d_in"]),
        d_sae=int(cfg["d_sae"]),
        arch=kind,
        k=int(kwargs.get("k", cfg.get("k", 0)) or 0) if kind in ("topk", "batchtopk") else 0,
        hook_name=canonical(str(hook)),
        d_out=int(cfg.get("d_out") or 0),
        hook_name_out=canonical(cfg.get("hook_name_out") or ""),
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)) and not cfg.get("hook_name_out"),
        normalize_decoder=bool(extra.get("normalize_decoder", False)),
        sparsity_coef=float(extra.get("sparsity_coef", 0.0)),
        bandwidth=float(extra.get("bandwidth", 0.001)),
        model_name=str(cfg.get("model_name") or ""),
        dataset_path=str(cfg.get("dataset_path") or ""),
        context_size=int(cfg.get("context_size") or 0),
        prepend_bos=bool(cfg.get("prepend_bos", True)),
    )


def load(directory, n_threads: int = 0) -> SAE:
    """Read an SAE in SAELens's format (one this module wrote, or SAELens or another tool did).

    Parameters
    ----------
    directory : str or os.PathLike
        Holding cfg.json and sae_weights.safetensors.
    n_threads : int
        The engine pool's threads (0: one per core).

    Returns
    -------
    SAE
        The dictionary, its hook names in dclens's spelling.

    Raises
    ------
    dclens.Error
        A missing file, a cfg.json or weights file that is not SAELens's format (naming the
        file and field), tensors of the wrong shapes, or an architecture dclens does not run.
    """
    d = os.fspath(directory)
    cpath, wpath = os.path.join(d, CFG), os.path.join(d, WEIGHTS)
    for p in (cpath, wpath):
        if not os.path.isfile(p):
            raise Error("%s is not an SAELens directory: %s is missing" % (d, os.path.basename(p)))
    try:
        with open(cpath, encoding="utf-8") as f:
            cfg = json.load(f)
    except (UnicodeDecodeError, ValueError) as e:
        raise Error("%s is not JSON: %s" % (cpath, e)) from None
    if not isinstance(cfg, dict):
        raise Error("%s is not a JSON object" % cpath)
    try:
        c = _config_from(cfg, cpath)
    except (TypeError, ValueError) as e:
        raise Error("%s: a field of the wrong type: %s" % (cpath, e)) from None
    t = read_safetensors(wpath)
    missing = [
        k
        for k in ("W_enc", "b_enc", "W_dec", "b_dec") + (("threshold",) if c.arch in ("jumprelu", "batchtopk") else ())
        if k not in t
    ]
    if missing:
        raise Error("%s has no tensor %s (has %s)" % (wpath, ", ".join(missing), ", ".join(sorted(t)) or "none"))
    if c.arch == "jumprelu" and not (t["threshold"] > 0).all():
        raise Error("%s: threshold must be > 0 everywhere (JumpReLU)" % wpath)
    if c.arch == "batchtopk" and (
        t["threshold"].shape != (c.d_sae,) or not (t["threshold"] == t["threshold"][0]).all()
    ):
        raise Error("%s: a BatchTopK dictionary has one threshold for all %d features" % (wpath, c.d_sae))
    sae = SAE(c, n_threads=n_threads)
    values = {k: t[k] for k in ("W_enc", "b_enc", "W_dec", "b_dec")}
    if c.arch == "jumprelu":
        values["log_threshold"] = np.log(t["threshold"].astype(np.float64)).astype(np.float32)
    if c.arch == "batchtopk":
        values["threshold"] = t["threshold"][:1]
    try:
        sae.set_parameters(**values)
    except Error as e:
        sae.close()
        raise Error("%s does not match %s: %s" % (wpath, cpath, e)) from None
    return sae
