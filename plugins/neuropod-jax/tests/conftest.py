"""Shared fixtures and helpers: a private package cache per test, spec and model helpers."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

# Test processes (pytest-xdist's workers, worker processes of the models) share one GPU: JAX must not
# take 75% of it in each. The backend sets the same default; a test module may start JAX before it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@pytest.fixture(scope="session", autouse=True)
def _references_on_the_cpu() -> None:
    """Expected outputs that tests compute with JAX itself are computed on the CPU: on a GPU, JAX's float32
    matmuls use TF32 (about 1e-4 off), while most packages here run on the CPU. Loaded models place
    themselves on their own device; test_jax_gpu.py compares GPU runs with tolerances for TF32."""
    if jax_sees_a_gpu():
        import jax

        jax.config.update("jax_default_device", jax.devices("cpu")[0])


@pytest.fixture(autouse=True)
def _private_cache(neuropod_cache: Path) -> Path:
    # neuropod.testing's fixture (a pytest plugin wherever neuropod is installed), for every test here.
    return neuropod_cache


def spec(*entries: tuple[str, str, Sequence[Any]]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": t, "shape": list(s)} for n, t, s in entries]


def jax_cuda_missing() -> str | None:
    """Why JAX here cannot run on a GPU (no CUDA plugin, or no CUDA device), or None when it can."""
    import jax

    from neuropod_jax import cuda_plugin

    if cuda_plugin() is None:
        return f"jax {jax.__version__} has no CUDA plugin installed (pip install jax[cuda12]=={jax.__version__})"
    try:
        jax.devices("cuda")
    except RuntimeError as e:
        return f"jax {jax.__version__} sees no CUDA device: {e}"
    return None


@functools.cache
def jax_sees_a_gpu() -> bool:
    """Whether JAX here has a CUDA device (tests of what a CPU-only host does are skipped where it has)."""
    return jax_cuda_missing() is None


def skip_on_a_gpu_host() -> None:
    """For tests of what a host without a GPU does; test_jax_gpu.py covers a GPU host."""
    if jax_sees_a_gpu():
        pytest.skip("JAX sees a GPU here: test_jax_gpu.py covers what a GPU host does")
