"""The ONNX Runtime backend against the core's conformance suite (``neuropod.testing``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from onnx import helper

from neuropod.packagers import create_onnx_neuropod
from neuropod.testing import ALL_DTYPES, BackendConformance, accumulator_spec

from conftest import make_model


class TestOnnxConformance(BackendConformance):
    platform = "onnx"
    distribution = "neuropod-onnx"
    framework_modules = ("onnxruntime", "onnx")
    dtypes = ALL_DTYPES
    custom_ops = True

    def make_package(
        self, tmp_path: Path, name: str, input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]],
        **packager_kwargs: Any,
    ) -> Path:
        """One ONNX Identity node per input/output pair."""
        model = make_model(
            [helper.make_node("Identity", [i["name"]], [o["name"]]) for i, o in zip(input_spec, output_spec)],
            [(s["name"], s["dtype"], s["shape"]) for s in input_spec],
            [(s["name"], s["dtype"], s["shape"]) for s in output_spec],
        )
        path: Path = create_onnx_neuropod(
            tmp_path / name, name, input_spec, output_spec, onnx_model=model, **packager_kwargs
        )
        return path

    def make_accumulator_package(self, tmp_path: Path, name: str, **packager_kwargs: Any) -> Path:
        """``y = acc_in + x`` (an Add node) and ``acc_out``, an Identity of ``y``."""
        input_spec, output_spec = accumulator_spec()
        model = make_model(
            [helper.make_node("Add", ["acc_in", "x"], ["y"]), helper.make_node("Identity", ["y"], ["acc_out"])],
            [(s["name"], s["dtype"], s["shape"]) for s in input_spec],
            [(s["name"], s["dtype"], s["shape"]) for s in output_spec],
        )
        path: Path = create_onnx_neuropod(
            tmp_path / name, name, input_spec, output_spec, onnx_model=model, **packager_kwargs
        )
        return path

    def custom_op_library(self, tmp_path: Path) -> Path | None:
        ortx = pytest.importorskip("onnxruntime_extensions", reason="onnxruntime-extensions gives the op library")
        return Path(ortx.get_library_path())
