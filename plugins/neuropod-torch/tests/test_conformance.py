"""Both backends against the core's conformance suite (``neuropod.testing``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from neuropod.packagers import create_aoti_neuropod, create_torch_export_neuropod
from neuropod.testing import NUMERIC_DTYPES, BackendConformance, accumulator_spec, sample

from conftest import CompileCache
from models import COPIES


class _CustomOps:
    """The conformance library of ``oplib.py`` (built once per session) for ``test_custom_ops``."""

    custom_ops = True

    @pytest.fixture(autouse=True)
    def _keep_request(self, request: pytest.FixtureRequest) -> None:
        self._request = request

    def custom_op_library(self, tmp_path: Path) -> Path | None:
        libraries = self._request.getfixturevalue("op_libraries")
        path: Path = libraries.conformance_lib
        return path


def _examples(input_spec: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    # A batch of 4: torch specializes sizes 0 and 1, so an example of 1 would fix the symbol.
    return {s["name"]: sample(s["dtype"], (4, 3), i) for i, s in enumerate(input_spec)}


class Accumulate(torch.nn.Module):
    """The conformance suite's accumulator: ``y = acc_out = acc_in + x``."""

    def forward(self, x: Tensor, acc_in: Tensor) -> dict[str, Tensor]:
        y = acc_in + x
        return {"y": y, "acc_out": y.clone()}


def _accumulator_examples() -> dict[str, np.ndarray]:
    return {s["name"]: sample("float32", (4, 4), i) for i, s in enumerate(accumulator_spec()[0])}


class TestTorchExportConformance(_CustomOps, BackendConformance):
    platform = "torch_export"
    distribution = "neuropod-torch"
    framework_modules = ("torch",)
    dtypes = NUMERIC_DTYPES  # torch.export programs take tensors only: no strings

    def make_package(
        self, tmp_path: Path, name: str, input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]],
        **packager_kwargs: Any,
    ) -> Path:
        """An exported module that returns ``{"out_<s>": in_<s>}``."""
        module = COPIES[len(input_spec)]()
        packager_kwargs.setdefault("example_inputs", _examples(input_spec))
        path: Path = create_torch_export_neuropod(
            tmp_path / name, name, input_spec, output_spec, module=module, **packager_kwargs
        )
        return path

    def make_accumulator_package(self, tmp_path: Path, name: str, **packager_kwargs: Any) -> Path:
        input_spec, output_spec = accumulator_spec()
        path: Path = create_torch_export_neuropod(
            tmp_path / name, name, input_spec, output_spec, module=Accumulate(),
            example_inputs=_accumulator_examples(), **packager_kwargs,
        )  # fmt: skip
        return path


class TestAotiConformance(_CustomOps, BackendConformance):
    platform = "aoti"
    distribution = "neuropod-torch"
    framework_modules = ("torch",)
    # Each dtype is one more compile; the conversions per dtype are the torch_export suite's (same code).
    dtypes = ("float32",)

    @pytest.fixture(autouse=True)
    def _compiles(self, compiled: CompileCache) -> None:
        self.compiled = compiled

    def make_package(
        self, tmp_path: Path, name: str, input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]],
        **packager_kwargs: Any,
    ) -> Path:
        """A compiled module that returns ``{"out_<s>": in_<s>}``: compiled once per signature per session."""
        key = f"copy{len(input_spec)}-{input_spec[0]['dtype']}"
        pt2 = self.compiled.pt2(key, input_spec, output_spec, module=COPIES[len(input_spec)](),
                                example_inputs=_examples(input_spec))  # fmt: skip
        path: Path = create_aoti_neuropod(
            tmp_path / name, name, input_spec, output_spec, compiled_package=pt2, **packager_kwargs
        )
        return path

    def make_accumulator_package(self, tmp_path: Path, name: str, **packager_kwargs: Any) -> Path:
        """The accumulator compiled once per session."""
        input_spec, output_spec = accumulator_spec()
        pt2 = self.compiled.pt2("accumulator", input_spec, output_spec, module=Accumulate(),
                                example_inputs=_accumulator_examples())  # fmt: skip
        path: Path = create_aoti_neuropod(
            tmp_path / name, name, input_spec, output_spec, compiled_package=pt2, **packager_kwargs
        )
        return path
