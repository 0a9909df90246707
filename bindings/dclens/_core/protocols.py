"""ModelLike: what the plumbing and the analyses read of a model, as a type.

Modules below Model (cache, generate, routing, grad, ...) annotate their
model arguments with this Protocol instead of importing Model, so the
import graph has no cycle even counting imports made for type checking
(tests/api/test_imports.py). Model satisfies it."""

from __future__ import annotations

from typing import Any, Protocol


class ModelLike(Protocol):
    """A loaded model: its config, device, runner (engine handle, lock,
    errors, runs) and its weights and hooks by name."""

    config: Any
    plan: Any  # the engine's LayerPlan of each layer
    device: str
    name: str
    runner: Any  # a runner.Runner (not imported: runner sits above this module)

    @property
    def hook_names(self) -> Any: ...

    def weight(self, name: str) -> Any: ...

    def resolve_hook(self, name: str) -> str: ...

    def parse_hook(self, name: str) -> Any: ...

    def to_tokens(self, text: Any, padding_side: str = ..., pad_id: int = ...) -> Any: ...

    def to_string(self, tokens: Any) -> Any: ...

    def to_str_tokens(self, text_or_tokens: Any, lengths: Any = ...) -> Any: ...

    def run_with_cache(self, tokens: Any, *args: Any, **kw: Any) -> Any: ...

    def hooks_in_force(self, per_call: Any = ...) -> Any: ...

    def token_ids(self, tokens: Any) -> Any: ...
