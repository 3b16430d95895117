"""The TensorRT backend against the core's conformance suite (``neuropod.testing``).

Discovery and device tests run anywhere; the tests that build and run an
engine carry the ``gpu`` marks and skip without an NVIDIA GPU and TensorRT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from neuropod.packagers import create_tensorrt_neuropod
from neuropod.testing import BackendConformance, accumulator_spec

from conftest import needs_gpu


class TestTensorRTConformance(BackendConformance):
    platform = "tensorrt"
    distribution = "neuropod-tensorrt"
    framework_modules = ("tensorrt", "cuda")
    # The I/O types TensorRT engines bind (no strings, no 16-64 bit unsigned ints).
    dtypes = ("float16", "float32", "int8", "int32", "int64", "uint8", "bool")
    custom_ops = True
    device = "cuda:0"
    runs_on_cpu = False
    run_marks = needs_gpu

    def make_package(
        self, tmp_path: Path, name: str, input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]],
        **packager_kwargs: Any,
    ) -> Path:
        """An ONNX graph of Identity nodes, built into an engine for this GPU."""
        onnx = pytest.importorskip("onnx")
        from onnx import helper

        def info(s: dict[str, Any]) -> Any:
            elem = helper.np_dtype_to_tensor_dtype(__import__("numpy").dtype(s["dtype"]))
            return helper.make_tensor_value_info(s["name"], elem, s["shape"])

        graph = helper.make_graph(
            [helper.make_node("Identity", [i["name"]], [o["name"]]) for i, o in zip(input_spec, output_spec)],
            name, [info(s) for s in input_spec], [info(s) for s in output_spec],
        )  # fmt: skip
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        onnx_path = tmp_path / f"{name}.onnx"
        onnx.save(model, str(onnx_path))
        path: Path = create_tensorrt_neuropod(
            tmp_path / name, name, input_spec, output_spec, onnx_path=onnx_path,
            optimization_profile={"batch": (1, 4, 16)}, **packager_kwargs,
        )  # fmt: skip
        return path

    def make_accumulator_package(self, tmp_path: Path, name: str, **packager_kwargs: Any) -> Path:
        """``y = acc_in + x`` (an ONNX Add) and ``acc_out``, an Identity of ``y``, built into an engine."""
        onnx = pytest.importorskip("onnx")
        from onnx import TensorProto, helper

        input_spec, output_spec = accumulator_spec()
        graph = helper.make_graph(
            [helper.make_node("Add", ["acc_in", "x"], ["y"]), helper.make_node("Identity", ["y"], ["acc_out"])],
            name,
            [helper.make_tensor_value_info(s["name"], TensorProto.FLOAT, s["shape"]) for s in input_spec],
            [helper.make_tensor_value_info(s["name"], TensorProto.FLOAT, s["shape"]) for s in output_spec],
        )
        onnx_path = tmp_path / f"{name}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(onnx_path))
        path: Path = create_tensorrt_neuropod(
            tmp_path / name, name, input_spec, output_spec, onnx_path=onnx_path,
            optimization_profile={"batch": (1, 4, 16)}, **packager_kwargs,
        )  # fmt: skip
        return path

    def custom_op_library(self, tmp_path: Path) -> Path | None:
        pytest.skip("no TensorRT plugin library is built by these tests")
