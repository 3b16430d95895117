"""The TorchScript backend against the core's conformance suite (``neuropod.testing``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from neuropod.packagers import create_torchscript_neuropod
from neuropod.testing import ALL_DTYPES, BackendConformance, accumulator_spec

from models import Identity, StringIdentity


class Accumulate(torch.nn.Module):
    """The conformance suite's accumulator: ``y = acc_out = acc_in + x``."""

    def forward(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        y = inputs["acc_in"] + inputs["x"]
        return {"y": y, "acc_out": y}


class TestTorchScriptConformance(BackendConformance):
    platform = "torchscript"
    distribution = "neuropod-torchscript"
    framework_modules = ("torch",)
    dtypes = ALL_DTYPES
    custom_ops = True

    def make_package(
        self, tmp_path: Path, name: str, input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]],
        **packager_kwargs: Any,
    ) -> Path:
        """A scripted module that returns ``{"out_<s>": inputs["in_<s>"]}``."""
        strings = input_spec[0]["dtype"] == "string"
        module = torch.jit.script(StringIdentity() if strings else Identity())
        path: Path = create_torchscript_neuropod(
            tmp_path / name, name, input_spec, output_spec, module=module, **packager_kwargs
        )
        return path

    def make_accumulator_package(self, tmp_path: Path, name: str, **packager_kwargs: Any) -> Path:
        input_spec, output_spec = accumulator_spec()
        path: Path = create_torchscript_neuropod(
            tmp_path / name, name, input_spec, output_spec, module=torch.jit.script(Accumulate()), **packager_kwargs
        )
        return path

    def custom_op_library(self, tmp_path: Path) -> Path | None:
        pytest.skip("compiling a torch op library takes about a minute; tests/test_custom_op.py builds and loads one")
