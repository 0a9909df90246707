"""Models shipped with the package, loadable by name.

    dclens.bundled_models()            # [BundledModel(name, path, model_type, summary)]
    dclens.load("dcpythia-tiny")       # a bundled name, or any checkpoint directory

A bundled model is a directory ``dclens/models/<name>/`` of the installed
package (package data: config.json, model.safetensors, tokenizer.json,
MODEL_CARD.md).  The registry lists what is actually on disk; with none
installed it is empty.  The environment variable ``DCLENS_MODELS_DIR`` (or the
``models_dir`` argument) points it at another directory laid out the same way,
which is how the tests exercise it.

Resolution (:func:`resolve`): an existing path is used as it is; otherwise a
name without a path separator is looked up among the bundled models; anything
else is a :class:`dclens.Error` naming the path and listing the bundled names.
"""

from __future__ import annotations

import dataclasses
import json
import os

from .checks import NotFoundError, c_path

ENV = "DCLENS_MODELS_DIR"


@dataclasses.dataclass(frozen=True)
class BundledModel:
    """A model shipped with the package (or found under DCLENS_MODELS_DIR), as
    bundled_models() lists it.

    Attributes
    ----------
    name : str
        Its directory's name: what dclens.load() and ``--model`` accept.
    path : str
        The checkpoint directory (config.json, model.safetensors, tokenizer.json,
        MODEL_CARD.md).
    model_type : str
        config.json's model_type ("dcpythia", "gpt_neox", ...), "" if it cannot be read.
    summary : str
        The first paragraph of MODEL_CARD.md after its title (at most 300 characters),
        "" if there is none.
    """

    name: str  # what dclens.load() and --model accept
    path: str  # the checkpoint directory
    model_type: str  # "dcpythia" or "gpt_neox" (config.json), "" if unreadable
    summary: str  # first paragraph of MODEL_CARD.md after its title, "" if none

    def __fspath__(self) -> str:
        """Its checkpoint directory: dclens.load(bundled_models()[0]) loads it."""
        return self.path


def models_dir(models_dir: str | os.PathLike | None = None) -> str:
    """The directory the registry reads: the argument, else $DCLENS_MODELS_DIR,
    else the package's own models/ directory."""
    if models_dir is not None:
        return os.fspath(models_dir)
    return os.environ.get(ENV) or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")


def _summary(card_path: str) -> str:
    try:
        with open(card_path, encoding="utf-8") as f:
            text = f.read(65536)
    except (OSError, UnicodeDecodeError):
        return ""
    para: list[str] = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#") or s.startswith("<!--"):
            if para:
                break
            continue
        if not s:
            if para:
                break
            continue
        para.append(s)
    return " ".join(para)[:300]


def _model_type(config_path: str) -> str:
    try:
        with open(config_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError):
        return ""
    t = cfg.get("model_type", "") if isinstance(cfg, dict) else ""
    return t if isinstance(t, str) else ""


def bundled_models(models_dir_: str | os.PathLike | None = None) -> list[BundledModel]:
    """The bundled models on disk: the directories holding a config.json, by name.

    Parameters
    ----------
    models_dir_ : str or os.PathLike or None
        The directory to list; None: $DCLENS_MODELS_DIR, else the package's own models/.

    Returns
    -------
    list of BundledModel
        Sorted by name; empty when the directory does not exist or holds no model.
    """
    d = models_dir(models_dir_)
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    out = []
    for n in names:
        p = os.path.join(d, n)
        if n.startswith(".") or not os.path.isfile(os.path.join(p, "config.json")):
            continue
        out.append(
            BundledModel(n, p, _model_type(os.path.join(p, "config.json")), _summary(os.path.join(p, "MODEL_CARD.md")))
        )
    return out


def resolve(name_or_path: str | os.PathLike, models_dir_: str | os.PathLike | None = None) -> str | bytes:
    """The checkpoint directory for a path or a bundled model's name."""
    c_path("model path", name_or_path)  # type and NUL: checked in one place
    p = os.fspath(name_or_path)
    if isinstance(p, bytes):
        return p  # a file-system path; names are text
    if os.path.lexists(p):  # a dangling symlink: the loader names it
        return p
    models = bundled_models(models_dir_)
    if p and os.sep not in p and not (os.altsep and os.altsep in p):
        for m in models:
            if m.name == p:
                return m.path
    names = ", ".join(m.name for m in models) or "none installed"
    raise NotFoundError(
        "%s: no such model directory (no %s) and no bundled model of that name; "
        "bundled models: %s; a Hugging Face Hub id is org/name" % (p, os.path.join(p, "config.json"), names)
    )
