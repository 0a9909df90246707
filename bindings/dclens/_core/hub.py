"""Hugging Face Hub ids: dclens.load("Caiyun-AI/DCPythia-6.9B", revision=...).

An id ``org/name`` that is not an existing path is resolved with
huggingface_hub.snapshot_download, the local cache first:

1. the snapshot of that revision in the cache (``$HF_HUB_CACHE``, else
   ``$HF_HOME/hub``, else huggingface_hub's default ``~/.cache/huggingface/hub``),
   without touching the network;
2. otherwise, unless offline (``HF_HUB_OFFLINE=1``), a download of the files
   the engine reads (config.json, weights, index, tokenizer.json), with
   huggingface_hub's progress bars (progress=False: none).

Offline with nothing cached is a dclens.NotFoundError naming the id, the
revision and the cache directory it looked in.
"""

from __future__ import annotations

import os
import re

from .checks import ArgumentError, Error, NotFoundError
from .progress import hub_tqdm_class

# the files of a checkpoint directory the engine reads (engine/src/io/layouts.c)
PATTERNS = [
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "tokenizer.json",
]

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_hub_id(name) -> bool:
    """Whether a name is shaped like a Hugging Face Hub model id.

    Parameters
    ----------
    name : object
        What dclens.load was given.

    Returns
    -------
    bool
        True for a string org/name (one slash, not absolute, no '..', letters, digits and
        ``._-``); whether that model exists is for the Hub to say.
    """
    return isinstance(name, str) and bool(_ID.match(name)) and ".." not in name


def _truthy(v: str | None) -> bool:
    return (v or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """Whether the environment forbids the network to the Hub.

    Returns
    -------
    bool
        True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is 1, ON, YES or TRUE.
    """
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))


def cache_dir() -> str | None:
    """The Hub cache directory the environment names now.

    Returns
    -------
    str or None
        $HF_HUB_CACHE, else $HF_HOME/hub, else None (huggingface_hub's default,
        ~/.cache/huggingface/hub).
    """
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def resolve(repo_id: str, revision: str | None = None, progress: bool | None = None, cache: str | None = None) -> str:
    """The local snapshot directory of a Hub model id, from the cache or downloaded.

    The cache first, without the network; then, unless offline(), a download of the files
    the engine reads (PATTERNS).

    Parameters
    ----------
    repo_id : str
        The Hub id, org/name.
    revision : str or None
        A branch, tag or commit; None: the Hub's default branch.
    progress : bool or None
        The download's progress bars (dclens.progress; False: none).
    cache : str or None
        The cache directory; None: cache_dir().

    Returns
    -------
    str
        The snapshot directory (config.json and the weights in it).

    Raises
    ------
    dclens.ArgumentError
        A revision that is not a non-empty string without NUL.
    dclens.NotFoundError
        Offline with nothing cached, or the Hub has no such repository, revision or file
        (or the repository is gated); the message names the id, the revision and the cache.
    dclens.Error
        huggingface_hub is missing, or the download fails otherwise.
    """
    if revision is not None and not (isinstance(revision, str) and revision and "\0" not in revision):
        raise ArgumentError("revision must be a branch, tag or commit (a non-empty string), not %r" % (revision,))
    try:
        import huggingface_hub as hf  # lazy: huggingface_hub loads only for a Hub id
        from huggingface_hub.utils import LocalEntryNotFoundError  # lazy: huggingface_hub loads only for a Hub id
    except ImportError:  # pragma: no cover -- a dependency of the package
        raise Error("%s: loading a Hub id needs huggingface_hub (pip install huggingface_hub)" % repo_id) from None
    cache = cache or cache_dir()
    # an id is also a relative path that does not exist: say both
    where = "%s: no such model directory (no %s), and as a Hugging Face Hub id%s" % (
        repo_id,
        os.path.join(repo_id, "config.json"),
        " at revision %r" % revision if revision else "",
    )
    try:
        return hf.snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=True, allow_patterns=PATTERNS
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as e:
        local_error = e
    if offline():
        raise NotFoundError(
            "%s it is not in the Hugging Face cache (%s) and HF_HUB_OFFLINE is set, so it is "
            "not downloaded (%s)" % (where, cache or "huggingface_hub's default cache", type(local_error).__name__)
        ) from None

    try:
        return hf.snapshot_download(
            repo_id, revision=revision, cache_dir=cache, allow_patterns=PATTERNS, tqdm_class=hub_tqdm_class(progress)
        )
    except Exception as e:  # noqa: BLE001 -- huggingface_hub's errors, reported with the id
        kind = type(e).__name__
        if kind in (
            "RepositoryNotFoundError",
            "RevisionNotFoundError",
            "EntryNotFoundError",
            "LocalEntryNotFoundError",
            "GatedRepoError",
        ):
            raise NotFoundError("%s: %s: %s" % (where, kind, str(e).splitlines()[0] if str(e) else kind)) from None
        raise Error("%s it cannot be downloaded: %s: %s" % (where, kind, e)) from None
