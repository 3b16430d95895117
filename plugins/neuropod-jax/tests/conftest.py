"""Shared fixtures and helpers: a private package cache per test, spec and model helpers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _private_cache(neuropod_cache: Path) -> Path:
    # neuropod.testing's fixture (a pytest plugin wherever neuropod is installed), for every test here.
    return neuropod_cache


def spec(*entries: tuple[str, str, Sequence[Any]]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": t, "shape": list(s)} for n, t, s in entries]
