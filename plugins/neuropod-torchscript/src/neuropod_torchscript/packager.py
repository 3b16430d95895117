"""``create_torchscript_neuropod``: package a TorchScript module with its problem spec."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuropod.create import create_package
from neuropod.errors import PackageError
from neuropod.plugins import import_framework
from neuropod.spec import parse_spec
from neuropod.strings import refuse_dtypes
from neuropod_torchscript import FRAMEWORK_DISTRIBUTIONS, PLATFORM

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from neuropod.create import PackageOptions

MODEL_PATH = "0/data/model.pt"


def create_torchscript_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    module: Any = None,
    module_path: str | os.PathLike[str] | None = None,
    **options: Unpack[PackageOptions],
) -> Path:
    """Package a TorchScript module as a Neuropod.

    New PyTorch models should use ``torch.export`` (``neuropod-torch``):
    PyTorch has deprecated TorchScript.

    :param neuropod_path: where to write the package (must not exist).
    :param model_name: the model's name.
    :param input_spec: list of ``{"name", "dtype", "shape"}``.
    :param output_spec: the same, for outputs.
    :param module: a ``torch.jit.ScriptModule`` (from ``torch.jit.script`` or
        ``torch.jit.trace``), saved with ``torch.jit.save``.
    :param module_path: or the path of a file written by ``torch.jit.save``;
        exactly one of the two.
    :param options: the common keywords (:class:`neuropod.package.PackageOptions`):
        ``platform_version_semver`` (torch versions), ``custom_ops`` (loaded
        with ``torch.ops.load_library`` before the module),
        ``input_tensor_device`` (on a GPU, ``"CPU"`` inputs stay on the CPU),
        ``test_input_data``, ``package_as_zip`` (the original's default was
        a zip), ...
    :returns: the path written.
    :raises PackageError: the arguments do not make a package that loads and
        reproduces its test data (also a ``ValueError``).
    """
    if (module is None) == (module_path is None):
        raise PackageError("create_torchscript_neuropod needs exactly one of module= or module_path=")
    refuse_dtypes(model_name, parse_spec(input_spec, "input_spec"), parse_spec(output_spec, "output_spec"), {"bytes"}, PLATFORM)
    source: bytes | Path
    if module_path is not None:
        source = Path(module_path)
        if not source.is_file():
            raise PackageError(f"module_path {source} does not exist")
    else:
        source = _serialize(module)
    return create_package(
        "create_torchscript_neuropod", neuropod_path, model_name, PLATFORM, input_spec, output_spec,
        {MODEL_PATH: source}, options, framework_distributions=FRAMEWORK_DISTRIBUTIONS,
    )  # fmt: skip


def _serialize(module: Any) -> bytes:
    import_framework("torch", PLATFORM, "create_torchscript_neuropod")
    import torch

    if not isinstance(module, torch.jit.ScriptModule):
        kind = type(module).__name__
        hint = " (script or trace it first: torch.jit.script(module))" if isinstance(module, torch.nn.Module) else ""
        raise PackageError(f"module must be a torch.jit.ScriptModule, not {kind}{hint}")
    # lazy: torch (the runtime imports it), kept out of `import neuropod_torchscript.packager`
    from neuropod_torchscript._runtime import quiet_jit_deprecation

    buf = io.BytesIO()
    with quiet_jit_deprecation():
        torch.jit.save(module, buf)
    return buf.getvalue()


__all__ = ["create_torchscript_neuropod"]
