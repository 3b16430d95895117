"""``create_onnx_neuropod``: package an ONNX model with its problem spec."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuropod.create import create_package, package_options
from neuropod.errors import NeuropodError, PackageError
from neuropod.plugins import import_framework
from neuropod.spec import parse_spec
from neuropod.strings import refuse_dtypes
from neuropod_onnx import FRAMEWORK_DISTRIBUTIONS, PLATFORM

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from neuropod.create import PackageOptions

MODEL_PATH = "0/data/model.onnx"


def create_onnx_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    onnx_model: Any = None,
    onnx_path: str | os.PathLike[str] | None = None,
    **options: Unpack[PackageOptions],
) -> Path:
    """Package an ONNX model as a Neuropod.

    :param neuropod_path: where to write the package (must not exist).
    :param model_name: the model's name.
    :param input_spec: list of ``{"name", "dtype", "shape"}``.
    :param output_spec: the same, for outputs.
    :param onnx_model: an ``onnx.ModelProto`` (or its serialized bytes).
    :param onnx_path: or the path of a ``.onnx`` file; exactly one of the two.
    :param options: the common keywords (:class:`neuropod.package.PackageOptions`):
        ``platform_version_semver`` (onnxruntime versions), ``custom_ops``
        (ONNX Runtime custom-op libraries, registered before the session is
        created), ``test_input_data``, ``package_as_zip``, ...
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
    opts = package_options("create_onnx_neuropod", options)
    _check_graph(source, model_name, input_spec, output_spec, opts["custom_ops"])
    return create_package(
        "create_onnx_neuropod", neuropod_path, model_name, PLATFORM, input_spec, output_spec, {MODEL_PATH: source},
        options, framework_distributions=FRAMEWORK_DISTRIBUTIONS,
    )  # fmt: skip


def _check_graph(
    source: Any, name: str, input_spec: Any, output_spec: Any, custom_ops: Sequence[str | os.PathLike[str]]
) -> None:
    """Open the model once so a spec that does not match fails before anything is written."""
    inputs, outputs = parse_spec(input_spec, "input_spec"), parse_spec(output_spec, "output_spec")
    refuse_dtypes(name, inputs, outputs, {"bytes"}, PLATFORM)
    import_framework("onnxruntime", PLATFORM, "create_onnx_neuropod")
    # lazy: onnxruntime (the runtime imports it), kept out of `import neuropod_onnx.packager`
    from neuropod_onnx._runtime import check_io, create_session

    where = f"Model {name!r}"
    model = str(source) if isinstance(source, Path) else source
    sess = create_session(model, "cpu", {}, [Path(p) for p in custom_ops], where)
    check_io(sess, inputs, outputs, where)


__all__ = ["create_onnx_neuropod"]
