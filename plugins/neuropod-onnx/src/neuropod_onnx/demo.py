"""The model behind ``neuropod demo``: a small ONNX graph built without the ``onnx`` package.

``out = (x + y) * scale`` with ``x``, ``y`` and ``out`` sharing the symbol
``batch_size``. The graph is serialized here by a few lines of protobuf
encoding, so the demo needs nothing beyond ``onnxruntime``; the tests check
it against the same graph built with ``onnx.helper``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

# Protobuf wire types.
_VARINT, _LEN, _FIXED32 = 0, 2, 5
_FLOAT = 1  # onnx.TensorProto.FLOAT


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, value: int | bytes | str | float, wire: int | None = None) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    if isinstance(value, bytes):
        return _varint(number << 3 | _LEN) + _varint(len(value)) + value
    if isinstance(value, float) or wire == _FIXED32:
        return _varint(number << 3 | _FIXED32) + struct.pack("<f", value)
    return _varint(number << 3 | _VARINT) + _varint(value)


def _value_info(name: str, dims: list[int | str]) -> bytes:
    shape = b"".join(
        _field(1, _field(2, d) if isinstance(d, str) else _field(1, d)) for d in dims  # dim_param / dim_value
    )
    tensor_type = _field(1, _FLOAT) + _field(2, shape)  # elem_type, shape
    return _field(1, name) + _field(2, _field(1, tensor_type))  # name, type.tensor_type


def demo_model_bytes() -> bytes:
    """The serialized ONNX model (IR 8, opset 17)."""
    scale = _field(1, 1) + _field(2, _FLOAT) + _field(4, 2.0) + _field(8, "scale")  # dims, data_type, float_data, name
    nodes = [
        _field(1, "x") + _field(1, "y") + _field(2, "sum") + _field(3, "add") + _field(4, "Add"),
        _field(1, "sum") + _field(1, "scale") + _field(2, "out") + _field(3, "mul") + _field(4, "Mul"),
    ]
    graph = b"".join(_field(1, n) for n in nodes) + _field(2, "demo") + _field(5, scale)
    graph += _field(11, _value_info("x", ["batch_size", 2])) + _field(11, _value_info("y", ["batch_size", 2]))
    graph += _field(12, _value_info("out", ["batch_size", 2]))
    opset = _field(1, "") + _field(2, 17)
    return _field(1, 8) + _field(2, "neuropod-demo") + _field(7, graph) + _field(8, opset)


INPUT_SPEC = [
    {"name": "x", "dtype": "float32", "shape": ["batch_size", 2]},
    {"name": "y", "dtype": "float32", "shape": ["batch_size", 2]},
]
OUTPUT_SPEC = [{"name": "out", "dtype": "float32", "shape": ["batch_size", 2]}]


def build_demo(directory: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Package the demo model in ``directory``.

    :returns: the package path, inputs that fit, and inputs whose
        ``batch_size`` disagree (for showing a spec error).
    """
    import numpy as np

    # lazy: numpy (the packager imports it), kept out of importing this module (as numpy above)
    from neuropod_onnx.packager import create_onnx_neuropod

    x = np.array([[1, 2], [3, 4]], dtype=np.float32)
    y = np.array([[7, 8], [9, 10]], dtype=np.float32)
    path = create_onnx_neuropod(
        Path(directory) / "demo_adder.neuropod",
        "demo_adder",
        INPUT_SPEC,
        OUTPUT_SPEC,
        onnx_model=demo_model_bytes(),
        platform_version_semver=">=1.15",
        test_input_data={"x": x, "y": y},
        test_expected_out={"out": (x + y) * 2},
    )
    bad = {"x": x, "y": np.ones((3, 2), dtype=np.float32)}
    return path, {"x": x, "y": y}, bad
