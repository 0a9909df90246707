"""A training run directory's record of its options, the check a resume makes
against it, and the atomic writes its checkpoints go through.

``OUT/run.json`` is written once, before the first step: every option of
:class:`dclens.train.TrainConfig` (data and tokenizer files as absolute paths)
and the vocabulary size. A later sitting with the same ``out`` compares its
options with it and refuses, in one line naming each option, any difference
in an option that shapes the model, the tokenizer, the data or the schedule.
Only the options of :data:`SITTING_OPTIONS` may change between sittings (the
log says which did). A run written before run.json existed ("legacy") is
checked against what its newest checkpoint records instead: the options in
its train_state.json and the architecture in its config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

from .._core.checks import Error

RUN_FILE = "run.json"
# options a resume may change: how long, how fast, where, how often it logs and checkpoints
SITTING_OPTIONS = ("out", "steps", "n_threads", "device", "progress", "log_every", "ckpt_every", "keep")
_PATH_OPTIONS = ("data", "tokenizer")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def options_of(c) -> dict:
    """The options of a TrainConfig as recorded: data / tokenizer files absolute."""
    d = dataclasses.asdict(c)
    for k in _PATH_OPTIONS:
        if isinstance(d[k], str) and os.path.isfile(d[k]):
            d[k] = os.path.abspath(d[k])
    return d


def _same(key: str, was, now) -> bool:
    if was == now:
        return True
    if key in _PATH_OPTIONS and isinstance(was, str) and isinstance(now, str):
        try:
            return os.path.samefile(was, now)
        except OSError:
            return False
    return False


def _effective(d: dict) -> dict:
    """d_ff 0 means 4 * dim: the same model either way."""
    d = dict(d)
    if d.get("d_ff") == 0 and isinstance(d.get("dim"), int):
        d["d_ff"] = 4 * d["dim"]
    return d


def differences(recorded: dict, c) -> tuple[list[str], list[str]]:
    """(refused, accepted): 'flag now (the run: was)' for each option that
    differs, split into options that shape the run and sitting options.
    An option the record lacks (added to TrainConfig since) counts as its default."""
    now = _effective(options_of(c))
    defaults = {f.name: f.default for f in dataclasses.fields(c) if f.default is not dataclasses.MISSING}
    was = _effective(dict(defaults, **{k: v for k, v in recorded.items() if k in now}))
    refused: list[str] = []
    accepted: list[str] = []
    for k in now:
        if k == "out" or _same(k, was.get(k), now[k]):
            continue
        (accepted if k in SITTING_OPTIONS else refused).append(
            "%s %s (the run: %s)" % (flag(k), json.dumps(now[k]), json.dumps(was.get(k)))
        )
    return refused, accepted


def config_differences(ckpt_config: dict, want: dict) -> list[str]:
    """Keys of the model config.json a checkpoint holds that differ from the
    one these options give (architecture keys only: dtype and ids aside)."""
    skip = ("torch_dtype", "architectures", "bos_token_id", "eos_token_id", "initializer_range")
    # keys that annotate the model without shaping its weights, which older
    # checkpoints do not record: compared only where the checkpoint has them
    # (max_position_embeddings: the context trained for, since issue 21)
    if_recorded = ("max_position_embeddings",)
    return [
        "%s %s (the checkpoint: %s)" % (k, json.dumps(want.get(k)), json.dumps(ckpt_config.get(k)))
        for k in sorted(set(want) | set(ckpt_config))
        if k not in skip and not (k in if_recorded and k not in ckpt_config) and ckpt_config.get(k) != want.get(k)
    ]


def read_record(out: str) -> dict | None:
    p = os.path.join(out, RUN_FILE)
    if not os.path.exists(p):
        return None
    try:
        with open(p, encoding="utf-8") as f:
            rec = json.load(f)
        if not isinstance(rec, dict) or not isinstance(rec.get("options"), dict):
            raise ValueError("no 'options' object")
    except (OSError, ValueError) as e:
        raise Error(
            "train: %s is damaged (%s); it records the run's options, so the run cannot be "
            "checked: restore it or start a new --out" % (p, e)
        ) from None
    return rec


def write_json_atomic(path: str, obj) -> None:
    """obj as JSON in path, written to a temporary file, synced, renamed into place."""
    tmp = os.path.join(os.path.dirname(path) or ".", ".tmp-" + os.path.basename(path))
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_record(out: str, c, vocab: int) -> None:
    write_json_atomic(os.path.join(out, RUN_FILE), {"options": options_of(c), "vocab": vocab})


def refuse(out: str, source: str, refused: list[str]) -> None:
    raise Error(
        "train: %s was started with other options (%s), and resuming with these would mix two "
        "runs in one checkpoint: %s; use a new --out, or the run's options (only %s and "
        "--stop-after may change between sittings)"
        % (out, source, ", ".join(refused), ", ".join(flag(k) for k in SITTING_OPTIONS if k not in ("out", "progress")))
    )


def sync_dir(path: str) -> None:
    """fsync a directory, so a rename inside it survives a crash (where the OS allows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sync_tree(path: str) -> None:
    """fsync every file of a directory, then the directory."""
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    sync_dir(path)


def install_dir(tmp: str, final: str) -> None:
    """Rename the finished directory tmp to final (replacing an old final: it is
    moved aside first, so a crash leaves either the old or the new whole)."""
    sync_tree(tmp)
    parent = os.path.dirname(final) or "."
    old = None
    if os.path.lexists(final):
        old = os.path.join(parent, ".old-" + os.path.basename(final))
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    sync_dir(parent)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def staging(out: str, name: str) -> str:
    """A fresh temporary directory in out for a checkpoint called name (hidden,
    so no reader takes it for a checkpoint)."""
    tmp = os.path.join(out, ".tmp-" + name)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def remove_staging(out: str) -> None:
    """Remove the staging and moved-aside directories a killed sitting left."""
    for name in os.listdir(out):
        if name.startswith((".tmp-", ".old-")) and os.path.isdir(os.path.join(out, name)):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)


def load_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ValueError("no %s" % what) from None
    except (OSError, ValueError) as e:
        raise ValueError("%s unreadable: %s" % (what, e)) from None
    if not isinstance(d, dict):
        raise ValueError("%s is not a JSON object" % what)
    return d
