"""Building, loading and running real engines: needs an NVIDIA GPU and TensorRT.

Marked ``gpu``; on machines without them every test here is collected and
skipped with the reason in pytest's summary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import neuropod
from neuropod.errors import NeuropodError, SpecError
from neuropod.packagers import create_tensorrt_neuropod

from conftest import needs_gpu, spec

pytestmark = needs_gpu

IN = spec(("x", "float32", ["batch", 4]), ("y", "float32", ["batch", 4]))
OUT = spec(("out", "float32", ["batch", 4]))


@pytest.fixture
def adder_onnx(tmp_path: Path) -> Path:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["out"])], "adder",
        [vi("x", TensorProto.FLOAT, ["batch", 4]), vi("y", TensorProto.FLOAT, ["batch", 4])],
        [vi("out", TensorProto.FLOAT, ["batch", 4])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "adder.onnx"
    onnx.save(model, str(path))
    return path


def test_build_package_load_and_run(tmp_path: Path, adder_onnx: Path) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    path = create_tensorrt_neuropod(
        tmp_path / "adder", "adder", IN, OUT, onnx_path=adder_onnx, optimization_profile={"batch": (1, 4, 16)},
        test_input_data={"x": x, "y": x}, test_expected_out={"out": x * 2},
    )
    with neuropod.load_neuropod(path) as model:
        assert model.device.startswith("cuda:")
        for batch in (1, 3, 16):
            data = np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)
            np.testing.assert_allclose(model.infer({"x": data, "y": data})["out"], data * 2, rtol=1e-5)
        with pytest.raises(SpecError, match="outside the engine's optimization profile"):
            model.infer({"x": np.zeros((17, 4), np.float32), "y": np.zeros((17, 4), np.float32)})


def test_engine_for_another_tensorrt_is_refused(tmp_path: Path, adder_onnx: Path) -> None:
    path = create_tensorrt_neuropod(tmp_path / "adder", "adder", IN, OUT, onnx_path=adder_onnx,
                                    optimization_profile={"batch": (1, 4, 16)})  # fmt: skip
    engine = path / "0" / "data" / "model.engine"
    other = tmp_path / "other.engine"
    other.write_bytes(engine.read_bytes()[:64] + b"\0" * 64)  # not an engine this TensorRT can open
    with pytest.raises(NeuropodError, match="cannot open this engine"):
        create_tensorrt_neuropod(tmp_path / "bad", "bad", IN, OUT, engine_path=other, compute_capability="8.0")


def test_tensor_names_with_slashes_colons_and_dots(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Add", ["input/x:0", "in.1"], ["InceptionV3/Predictions/Softmax:0"])], "named",
        [vi("input/x:0", TensorProto.FLOAT, ["batch", 4]), vi("in.1", TensorProto.FLOAT, ["batch", 4])],
        [vi("InceptionV3/Predictions/Softmax:0", TensorProto.FLOAT, ["batch", 4])],
    )  # fmt: skip
    source = tmp_path / "named.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(source))
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    path = create_tensorrt_neuropod(
        tmp_path / "named", "named", spec(("input/x:0", "float32", ["batch", 4]), ("in.1", "float32", ["batch", 4])),
        spec(("InceptionV3/Predictions/Softmax:0", "float32", ["batch", 4])), onnx_path=source,
        optimization_profile={"batch": (1, 4, 16)}, test_input_data={"input/x:0": x, "in.1": x},
        test_expected_out={"InceptionV3/Predictions/Softmax:0": x * 2},
    )  # fmt: skip
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_allclose(model.infer({"input/x:0": x, "in.1": x})["InceptionV3/Predictions/Softmax:0"], x * 2)
