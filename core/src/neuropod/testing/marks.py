""":func:`covers`: what a conformance test exercises (the hooks, and whether it runs a model)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def covers(*hooks: str, runs_model: bool = False) -> Callable[[_F], _F]:
    """Mark a suite test with the hooks it exercises, and whether it runs a model.

    Tests that run a model skip when the backend's framework is not
    installed here, and get the subclass's ``run_marks``.
    """

    def mark(func: _F) -> _F:
        func._neuropod_hooks = frozenset(hooks)  # type: ignore[attr-defined]
        func._neuropod_runs_model = runs_model  # type: ignore[attr-defined]
        return func

    return mark


__all__ = ["covers"]
