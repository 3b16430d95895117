"""A package with a bytes tensor is refused by the ONNX backend, with what to use instead."""

from __future__ import annotations

from pathlib import Path

import pytest
from onnx import helper

import neuropod
from neuropod.errors import NeuropodError
from neuropod.package.config import ModelConfig
from neuropod.package.write import write_package
from neuropod.packagers import create_onnx_neuropod
from neuropod.spec import parse_spec

from conftest import make_model, spec


def test_a_bytes_tensor_is_refused_at_packaging(tmp_path: Path) -> None:
    # ONNX strings are text: an ONNX model cannot take binary data, so packaging says so and keeps nothing.
    model = make_model([helper.make_node("Identity", ["blob"], ["same"])],
                       [("blob", "string", [None])], [("same", "string", [None])])  # fmt: skip
    path = tmp_path / "identity"
    with pytest.raises(NeuropodError, match=r"Model 'identity': backend onnx cannot take bytes tensors \(input 'blob' "
                       r"\(bytes\), output 'same' \(bytes\)\); use the python or tensorflow backend"):  # fmt: skip
        create_onnx_neuropod(
            path, "identity", spec(("blob", "bytes", [None])), spec(("same", "bytes", [None])), onnx_model=model
        )
    assert not path.exists()


def test_a_package_with_a_bytes_tensor_is_refused_at_load(tmp_path: Path) -> None:
    # A package written by other means (another tool, a hand-edited config.json) meets the same refusal on load.
    model = make_model([helper.make_node("Identity", ["blob"], ["same"])],
                       [("blob", "string", [None])], [("same", "string", [None])])  # fmt: skip
    config = ModelConfig(
        name="identity", platform="onnx", platform_version_semver="*",
        input_spec=parse_spec(spec(("blob", "bytes", [None])), "input_spec"),
        output_spec=parse_spec(spec(("same", "string", [None])), "output_spec"),
    )  # fmt: skip
    path = write_package(tmp_path / "identity", config, {"0/data/model.onnx": model.SerializeToString()})
    with pytest.raises(
        NeuropodError, match=r"backend onnx cannot take bytes tensors \(input 'blob' \(bytes\)\); use the"
    ):
        neuropod.load_neuropod(path)
