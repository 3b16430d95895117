"""``create_onnx_neuropod``: package an ONNX model with its problem spec."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from neuropod.errors import NeuropodError, PackageError
from neuropod.model import check_packaged
from neuropod.package import ModelConfig, packager_config, write_package
from neuropod_onnx import FRAMEWORK_DISTRIBUTIONS, PLATFORM

MODEL_PATH = "0/data/model.onnx"


def create_onnx_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    onnx_model: Any = None,
    onnx_path: str | os.PathLike[str] | None = None,
    platform_version_semver: str = "*",
    custom_ops: Sequence[str | os.PathLike[str]] = (),
    input_tensor_device: Mapping[str, str] | None = None,
    default_input_tensor_device: str = "GPU",
    test_input_data: Mapping[str, Any] | None = None,
    test_expected_out: Mapping[str, Any] | None = None,
    package_as_zip: bool = False,
    persist_test_data: bool = True,
    zip_compression: int = zipfile.ZIP_DEFLATED,
    neuropod_load_args: Mapping[str, Any] | None = None,
    test_rtol: float = 1e-5,
    test_atol: float = 1e-6,
) -> Path:
    """Package an ONNX model as a Neuropod.

    :param neuropod_path: where to write the package (must not exist).
    :param model_name: the model's name.
    :param input_spec: list of ``{"name", "dtype", "shape"}``.
    :param output_spec: the same, for outputs.
    :param onnx_model: an ``onnx.ModelProto`` (or its serialized bytes).
    :param onnx_path: or the path of a ``.onnx`` file; exactly one of the two.
    :param platform_version_semver: the onnxruntime versions the model works
        with, an npm-style or PEP 440 range.
    :param custom_ops: custom-op shared libraries for ONNX Runtime; they are
        copied into ``0/ops/`` and registered before the session is created.
    :param input_tensor_device: input name to ``"CPU"``/``"GPU"``; inputs not
        named get ``default_input_tensor_device``. A GPU entry makes the
        model prefer a GPU when one fits, as in the original Neuropod.
    :param test_input_data: inputs to store as test data; with
        ``test_expected_out``, the new package is loaded and its outputs are
        checked before this returns (a package that fails is removed).
    :param package_as_zip: write a zip instead of a directory.
    :param persist_test_data: store the test data in the package (default);
        False checks the new package with it without storing it.
    :param zip_compression: ``zipfile.ZIP_DEFLATED`` or ``zipfile.ZIP_STORED``.
    :param neuropod_load_args: keywords for the ``load_neuropod`` that checks
        the new package, e.g. ``{"visible_gpu": None}``.
    :returns: the path written.
    """
    if (onnx_model is None) == (onnx_path is None):
        raise NeuropodError("create_onnx_neuropod needs exactly one of onnx_model= or onnx_path=")
    if onnx_path is not None:
        source: Any = Path(onnx_path)
        if not source.is_file():
            raise PackageError(f"onnx_path {source} does not exist")
    elif isinstance(onnx_model, (bytes, bytearray)):
        source = bytes(onnx_model)
    elif hasattr(onnx_model, "SerializeToString"):
        source = onnx_model.SerializeToString()
    else:
        raise NeuropodError(f"onnx_model must be an onnx.ModelProto or bytes, not {type(onnx_model).__name__}")
    config = packager_config(
        model_name, PLATFORM, input_spec, output_spec, platform_version_semver=platform_version_semver,
        framework_distributions=FRAMEWORK_DISTRIBUTIONS, input_tensor_device=input_tensor_device,
        default_input_tensor_device=default_input_tensor_device,
    )  # fmt: skip
    _check_graph(source, config, custom_ops)
    path = write_package(
        neuropod_path,
        config,
        {MODEL_PATH: source},
        custom_ops=custom_ops,
        test_input_data=test_input_data,
        test_expected_out=test_expected_out,
        package_as_zip=package_as_zip,
        persist_test_data=persist_test_data,
        zip_compression=zip_compression,
    )
    check_packaged(
        path, test_input_data=test_input_data, test_expected_out=test_expected_out,
        neuropod_load_args=neuropod_load_args, backend=PLATFORM, rtol=test_rtol, atol=test_atol,
    )  # fmt: skip
    return path


def _check_graph(source: Any, config: ModelConfig, custom_ops: Sequence[str | os.PathLike[str]]) -> None:
    """Open the model once so a spec that does not match fails before anything is written."""
    from neuropod_onnx._runtime import check_io, create_session

    where = f"Model {config.name!r}"
    model = str(source) if isinstance(source, Path) else source
    sess = create_session(model, "cpu", {}, [Path(p) for p in custom_ops], where)
    check_io(sess, config.input_spec, config.output_spec, where)


__all__ = ["create_onnx_neuropod"]
