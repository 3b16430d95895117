"""Shared fixtures: a private package cache per test, spec helpers, and AOTInductor compiles made once.

Compiling with AOTInductor takes seconds to tens of seconds, so every
AOTInductor package in the suite comes from :func:`compiled`, which compiles
one program per signature per session and hands out that ``.pt2`` (packagers
take it as ``compiled_package=``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _private_cache(neuropod_cache: Path) -> Path:
    # neuropod.testing's fixture (a pytest plugin wherever neuropod is installed), for every test here.
    return neuropod_cache


def spec(*entries: tuple[str, str, Sequence[Any]]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": t, "shape": list(s)} for n, t, s in entries]


class CompileCache:
    """AOTInductor packages compiled once per session, by a key the caller chooses."""

    def __init__(self, root: Path):
        self.root = root
        self.packages: dict[str, Path] = {}
        self.compiles = 0

    def package(self, key: str, input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]],
                **packager_kwargs: Any) -> Path:  # fmt: skip
        """The package made by ``create_aoti_neuropod(..., **packager_kwargs)`` the first time ``key`` is asked for."""
        if key not in self.packages:
            from neuropod.packagers import create_aoti_neuropod

            self.packages[key] = create_aoti_neuropod(self.root / key, key, input_spec, output_spec, **packager_kwargs)
            self.compiles += 1
        return self.packages[key]

    def pt2(self, key: str, input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]],
            **packager_kwargs: Any) -> Path:  # fmt: skip
        """Its compiled ``.pt2`` (for ``create_aoti_neuropod(..., compiled_package=...)``)."""
        return self.package(key, input_spec, output_spec, **packager_kwargs) / "0" / "data" / "model.pt2"


@pytest.fixture(scope="session")
def op_libraries(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The custom-op libraries of ``oplib.py``, built once per session."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to compile the custom ops")
    from oplib import build

    return build(tmp_path_factory.mktemp("ops"))


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CompileCache]:
    cache = tmp_path_factory.mktemp("aoti-compiled")
    with _env("NEUROPOD_CACHE_DIR", str(cache / "neuropod-cache")):
        yield CompileCache(cache)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# --- the one real network every AOTInductor test shares -------------------------------------------

XY_SPEC = spec(("x", "float32", ["batch", 4]), ("y", "float32", ["batch", 3]))
TWO_LAYER_OUT = spec(("out", "float32", ["batch", 3]), ("norm", "float32", ["batch"]))


def xy(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 4)).astype(np.float32), "y": rng.standard_normal((batch, 3)).astype(np.float32)}


_reference: list[Any] = []


def two_layer_direct(**inputs: np.ndarray) -> dict[str, np.ndarray]:
    """What ``models.TwoLayer`` itself computes (one instance, made once: its weights come from a
    seeded generator that threads would share)."""
    import torch

    import models

    if not _reference:
        _reference.append(models.TwoLayer())
    with torch.no_grad():
        out = _reference[0](**{k: torch.from_numpy(v) for k, v in inputs.items()})
    return {k: v.numpy() for k, v in out.items()}


@pytest.fixture(scope="session")
def two_layer_aoti(compiled: CompileCache) -> Path:
    """``models.TwoLayer``, exported here and compiled by the packager (``exported_program=``), with test data."""
    import torch

    import models

    module = models.TwoLayer().eval()
    batch = torch.export.Dim("batch")
    ex = xy(4)
    program = torch.export.export(
        module, (torch.from_numpy(ex["x"]), torch.from_numpy(ex["y"])), dynamic_shapes={"x": {0: batch}, "y": {0: batch}}
    )
    return compiled.package("two_layer", XY_SPEC, TWO_LAYER_OUT, exported_program=program, test_input_data=ex,
                            test_expected_out=two_layer_direct(**ex))  # fmt: skip
