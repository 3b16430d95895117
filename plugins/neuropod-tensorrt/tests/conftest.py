"""Shared fixtures: a private package cache per test, spec helpers, and the GPU marker."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

HOSTS = Path(__file__).parent / "hosts"


def _gpu_and_tensorrt() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "TensorRT is not installed (its libraries come from NVIDIA's index)"
    from neuropod_tensorrt.packager import _gpu_here

    if _gpu_here() is None:
        return "no NVIDIA GPU with a working driver"
    return None


NO_GPU_REASON = _gpu_and_tensorrt()
needs_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(NO_GPU_REASON is not None, reason=f"needs an NVIDIA GPU and TensorRT: {NO_GPU_REASON}"),
]


@pytest.fixture(autouse=True)
def _private_cache(neuropod_cache: Path) -> Path:
    # neuropod.testing's fixture (a pytest plugin wherever neuropod is installed), for every test here.
    return neuropod_cache


def spec(*entries: tuple[str, str, Sequence[Any]]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": t, "shape": list(s)} for n, t, s in entries]
