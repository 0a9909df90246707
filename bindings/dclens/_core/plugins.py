"""Commands and training-data sources that other packages add to dclens.

dclens never imports those packages: each declares what it adds as entry
points in its package metadata, and dclens looks them up by name when they
are used. synth_tasks (this repository's pyproject.toml) adds

    [project.entry-points."dclens.commands"]     dclens synth ...
    synth = "synth_tasks.cli:main"                 fn(argv) -> exit status

    [project.entry-points."dclens.train_data"]   dclens train --data synth:64 / FILE.jsonl
    synth = "synth_tasks.train_data:synth"         fn(arg, seed) -> [text, ...]
    jsonl = "synth_tasks.train_data:jsonl"

so synth_tasks depends on dclens and never the reverse
(tests/api/test_imports.py checks it).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable

from .checks import Error

COMMANDS = "dclens.commands"
TRAIN_DATA = "dclens.train_data"


def _group(group: str):
    eps = entry_points()
    if hasattr(eps, "select"):  # Python >= 3.10
        return list(eps.select(group=group))
    return list(eps.get(group, ()))  # Python 3.9: a dict of groups


def names(group: str) -> list[str]:
    """The names declared in an entry point group, sorted."""
    return sorted({ep.name for ep in _group(group)})


def find(group: str, name: str) -> Callable:
    """The object an entry point of `group` named `name` points to; Error
    naming the group and what it has if none is declared or it cannot load."""
    found = [ep for ep in _group(group) if ep.name == name]
    if not found:
        have = names(group)
        raise Error(
            "no %r in the entry point group %s (declared: %s; is the package that adds it installed?)"
            % (name, group, ", ".join(have) if have else "none")
        )
    ep = found[0]
    try:
        return ep.load()
    except Exception as e:  # noqa: BLE001 -- reported with the entry point named
        raise Error(
            "entry point %s = %s (group %s) cannot be loaded: %s: %s" % (ep.name, ep.value, group, type(e).__name__, e)
        ) from e
