"""The pytest plugin (pytest's ``pytest11`` entry point ``neuropod.testing``): the ``neuropod_cache``
fixture, the ``gpu`` marker, and the suite's parametrization and ``run_marks``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neuropod.testing.conformance import BackendConformance
from neuropod.testing.gpu import REQUIRE_GPU_ENV, gpu_missing


@pytest.fixture
def neuropod_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private package cache (``NEUROPOD_CACHE_DIR``) for one test."""
    cache = tmp_path_factory.mktemp("neuropod-cache")
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(cache))
    return cache


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "gpu(needs=None): needs an NVIDIA GPU (NVML must see one); needs=callable returning why the test cannot "
        f"run here (a framework without CUDA...) or None. Skipped with the reason elsewhere; {REQUIRE_GPU_ENV}=1 "
        "makes that a failure.",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip ``gpu`` tests where they cannot run, saying why (or fail them under NEUROPOD_REQUIRE_GPU=1)."""

    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    reason = gpu_missing()
    needs = marker.kwargs.get("needs")
    if reason is None and callable(needs):
        reason = needs()
    if reason is None:
        return
    if os.environ.get(REQUIRE_GPU_ENV) == "1":
        pytest.fail(f"GPU test cannot run ({REQUIRE_GPU_ENV}=1): {reason}", pytrace=False)
    pytest.skip(f"needs a GPU: {reason}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run ``test_infer_dtype`` once per dtype the backend claims."""
    cls = metafunc.cls
    if cls is not None and issubclass(cls, BackendConformance) and "conformance_dtype" in metafunc.fixturenames:
        metafunc.parametrize("conformance_dtype", list(cls.dtypes))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give the tests that run a model their backend's ``run_marks``."""
    for item in items:
        cls = getattr(item, "cls", None)
        func = getattr(item, "function", None)
        if cls is None or not issubclass(cls, BackendConformance) or func is None:
            continue
        if getattr(func, "_neuropod_runs_model", False):
            for mark in cls.run_marks:
                item.add_marker(mark)
