"""The facade between Model and the analyses built on it.

Model's methods that are analyses (gradients, attribute, generate,
composition_map, ...) call them through this table, so Model imports no
analysis module and every analysis imports only downwards (runner, cache,
hooks, ...). An analysis module registers what Model offers with
@provides("name"); the package's __init__ imports every such module, and
importing any dclens module runs the package's __init__ first.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, TypeVar

from ._checks import Error

F = TypeVar("F", bound=Callable[..., Any])

_TABLE: Dict[str, Callable[..., Any]] = {}


def provides(name: str) -> Callable[[F], F]:
    """Register fn as the analysis Model.<name> delegates to."""

    def register(fn: F) -> F:
        _TABLE[name] = fn
        return fn

    return register


def call(name: str, *args: Any, **kw: Any) -> Any:
    """Run the analysis registered as `name`."""
    fn = _TABLE.get(name)
    if fn is None:
        raise Error("%s: the analysis is not loaded (import dclens first)" % name)
    return fn(*args, **kw)
