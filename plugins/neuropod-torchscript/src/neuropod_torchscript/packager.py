"""``create_torchscript_neuropod``: package a TorchScript module with its problem spec."""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from neuropod.errors import PackageError
from neuropod.model import check_packaged
from neuropod.package import packager_config, write_package
from neuropod_torchscript import FRAMEWORK_DISTRIBUTIONS, PLATFORM

MODEL_PATH = "0/data/model.pt"


def create_torchscript_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    module: Any = None,
    module_path: str | os.PathLike[str] | None = None,
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
    """Package a TorchScript module as a Neuropod.

    :param neuropod_path: where to write the package (must not exist).
    :param model_name: the model's name.
    :param input_spec: list of ``{"name", "dtype", "shape"}``.
    :param output_spec: the same, for outputs.
    :param module: a ``torch.jit.ScriptModule`` (from ``torch.jit.script`` or
        ``torch.jit.trace``), saved with ``torch.jit.save``.
    :param module_path: or the path of a file written by ``torch.jit.save``;
        exactly one of the two.
    :param platform_version_semver: the torch versions the model works with.
    :param custom_ops: shared libraries with custom ops; stored in ``0/ops/``
        and loaded with ``torch.ops.load_library`` before the module.
    :param input_tensor_device: input name to ``"CPU"``/``"GPU"``; inputs not
        named get ``default_input_tensor_device``. On a GPU, ``"CPU"`` inputs
        stay on the CPU, as in the original Neuropod.
    :param test_input_data: inputs to store as test data; the new package is
        loaded and run on them before this returns, and with
        ``test_expected_out`` its outputs must match (a package that fails is
        removed; a ``PackageError``, also the ``ValueError`` the original raised).
    :param package_as_zip: write a zip instead of a directory (the original
        Neuropod's default was a zip).
    :param persist_test_data: store the test data in the package (default);
        False checks the new package with it without storing it.
    :param zip_compression: ``zipfile.ZIP_DEFLATED`` or ``zipfile.ZIP_STORED``.
    :param neuropod_load_args: keywords for the ``load_neuropod`` that checks
        the new package, e.g. ``{"visible_gpu": None}``.
    :param test_rtol: relative tolerance of the test output comparison.
    :param test_atol: absolute tolerance of the test output comparison.
    :returns: the path written.
    :raises PackageError: the arguments do not make a package that loads and
        reproduces its test data (also a ``ValueError``).
    """
    if (module is None) == (module_path is None):
        raise PackageError("create_torchscript_neuropod needs exactly one of module= or module_path=")
    source: bytes | Path
    if module_path is not None:
        source = Path(module_path)
        if not source.is_file():
            raise PackageError(f"module_path {source} does not exist")
    else:
        source = _serialize(module)
    config = packager_config(
        model_name, PLATFORM, input_spec, output_spec, platform_version_semver=platform_version_semver,
        framework_distributions=FRAMEWORK_DISTRIBUTIONS, input_tensor_device=input_tensor_device,
        default_input_tensor_device=default_input_tensor_device,
    )  # fmt: skip
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
    # Loads the package once (a spec that does not fit forward fails now, not
    # at deployment) and runs the test data; a package that fails is removed.
    check_packaged(
        path, test_input_data=test_input_data, test_expected_out=test_expected_out,
        neuropod_load_args=neuropod_load_args, backend=PLATFORM, rtol=test_rtol, atol=test_atol,
    )  # fmt: skip
    return path


def _serialize(module: Any) -> bytes:
    import torch

    if not isinstance(module, torch.jit.ScriptModule):
        kind = type(module).__name__
        hint = " (script or trace it first: torch.jit.script(module))" if isinstance(module, torch.nn.Module) else ""
        raise PackageError(f"module must be a torch.jit.ScriptModule, not {kind}{hint}")
    from neuropod_torchscript._runtime import quiet_jit_deprecation

    buf = io.BytesIO()
    with quiet_jit_deprecation():
        torch.jit.save(module, buf)
    return buf.getvalue()


__all__ = ["create_torchscript_neuropod"]
