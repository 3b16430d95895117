"""``create_tensorflow_neuropod`` and ``create_keras_neuropod``."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from neuropod.errors import NeuropodError, PackageError
from neuropod.model import check_packaged
from neuropod.package import FileSource, packager_config, write_package
from neuropod.spec import TensorSpec, parse_spec
from neuropod_tensorflow import FRAMEWORK_DISTRIBUTIONS, PLATFORM

FROZEN_GRAPH_PATH = "0/data/model.pb"
SAVED_MODEL_PATH = "0/data/savedmodel"


def create_tensorflow_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    node_name_mapping: Mapping[str, str] | None = None,
    frozen_graph_path: str | os.PathLike[str] | None = None,
    graph_def: Any = None,
    saved_model_dir: str | os.PathLike[str] | None = None,
    trackable_obj: Any = None,
    init_op_names: Sequence[str] = (),
    platform_version_semver: str = "*",
    custom_ops: Sequence[str | os.PathLike[str]] = (),
    input_tensor_device: Mapping[str, str] | None = None,
    default_input_tensor_device: str = "GPU",
    test_input_data: Mapping[str, Any] | None = None,
    test_expected_out: Mapping[str, Any] | None = None,
    package_as_zip: bool = False,
    test_rtol: float = 1e-5,
    test_atol: float = 1e-6,
) -> Path:
    """Package a TensorFlow model as a Neuropod.

    Give exactly one model source:

    * ``frozen_graph_path`` (a ``.pb`` GraphDef file) or ``graph_def`` (a
      ``tf.compat.v1.GraphDef``), with ``node_name_mapping`` from spec names
      to tensor names (``":0"`` optional) and optional ``init_op_names`` to
      run once after loading; stored as ``0/data/model.pb``;
    * ``saved_model_dir`` (a SavedModel directory) or ``trackable_obj`` (a
      ``tf.Module`` to save with ``tf.saved_model.save``; its
      ``serving_default`` attribute, if any, becomes the signature); stored
      under ``0/data/savedmodel`` and run through the ``serving_default``
      signature, whose input and output keys are the spec's names.

    :param custom_ops: op libraries (``tf.load_op_library``) stored in
        ``0/ops/`` and loaded before the graph is imported.
    :param test_input_data: inputs stored as test data; with
        ``test_expected_out`` the new package is loaded and checked before
        this returns (a package that fails is removed).
    :returns: the path written.
    """
    sources = [frozen_graph_path, graph_def, saved_model_dir, trackable_obj]
    if sum(s is not None for s in sources) != 1:
        raise NeuropodError(
            "create_tensorflow_neuropod needs exactly one of frozen_graph_path=, graph_def=, saved_model_dir= "
            "or trackable_obj="
        )
    frozen = frozen_graph_path is not None or graph_def is not None
    if frozen and not node_name_mapping:
        raise NeuropodError("A frozen graph needs node_name_mapping={spec name: graph tensor name, ...}")
    if not frozen and node_name_mapping:
        raise NeuropodError(
            "node_name_mapping is for frozen graphs; a SavedModel is called through its serving_default signature, "
            "whose keys must be the spec's names"
        )
    with tempfile.TemporaryDirectory(prefix="neuropod-tf-") as tmp:
        files: dict[str, FileSource]
        backend_config: dict[str, Any] | None = None
        if frozen_graph_path is not None:
            if not Path(frozen_graph_path).is_file():
                raise PackageError(f"frozen_graph_path {frozen_graph_path} does not exist")
            files = {FROZEN_GRAPH_PATH: Path(frozen_graph_path)}
        elif graph_def is not None:
            if not hasattr(graph_def, "SerializeToString"):
                raise NeuropodError(f"graph_def must be a tf.compat.v1.GraphDef, not {type(graph_def).__name__}")
            files = {FROZEN_GRAPH_PATH: graph_def.SerializeToString()}
        elif saved_model_dir is not None:
            if not (Path(saved_model_dir) / "saved_model.pb").is_file():
                raise PackageError(f"saved_model_dir {saved_model_dir} is not a SavedModel (no saved_model.pb)")
            files = {SAVED_MODEL_PATH: Path(saved_model_dir)}
        else:
            files = {SAVED_MODEL_PATH: _save_trackable(trackable_obj, Path(tmp) / "savedmodel")}
        if frozen:
            backend_config = {"node_name_mapping": dict(node_name_mapping or {}), "init_op_names": list(init_op_names)}
        return _write(
            neuropod_path, model_name, parse_spec(input_spec, "input_spec"), parse_spec(output_spec, "output_spec"),
            files, backend_config, platform_version_semver, custom_ops, input_tensor_device,
            default_input_tensor_device, test_input_data, test_expected_out, package_as_zip, test_rtol, test_atol,
        )  # fmt: skip


def create_keras_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    model: Any,
    input_spec: Sequence[Mapping[str, Any]] | None = None,
    output_spec: Sequence[Mapping[str, Any]] | None = None,
    platform_version_semver: str = "*",
    custom_ops: Sequence[str | os.PathLike[str]] = (),
    input_tensor_device: Mapping[str, str] | None = None,
    default_input_tensor_device: str = "GPU",
    test_input_data: Mapping[str, Any] | None = None,
    test_expected_out: Mapping[str, Any] | None = None,
    package_as_zip: bool = False,
    test_rtol: float = 1e-5,
    test_atol: float = 1e-6,
) -> Path:
    """Package a Keras model as a Neuropod (a SavedModel with a ``serving_default`` signature).

    :param model: a built Keras model (functional or sequential).
    :param input_spec: defaults to the model's inputs: their names, dtypes
        and shapes, with the first dim as the symbol ``batch_size``.
    :param output_spec: defaults to the model's outputs likewise, named by
        ``model.output_names`` (else ``output_0``, ``output_1``, ...).
    :returns: the path written.
    """
    import tensorflow as tf

    keras_inputs = list(getattr(model, "inputs", None) or [])
    keras_outputs = list(getattr(model, "outputs", None) or [])
    if not keras_inputs or not keras_outputs:
        raise NeuropodError("create_keras_neuropod needs a built model with known inputs and outputs (call it once)")
    inputs = parse_spec(input_spec, "input_spec") if input_spec is not None else _keras_spec(keras_inputs, None)
    names = list(getattr(model, "output_names", None) or [f"output_{i}" for i in range(len(keras_outputs))])
    outputs = parse_spec(output_spec, "output_spec") if output_spec is not None else _keras_spec(keras_outputs, names)
    if len(inputs) != len(keras_inputs) or len(outputs) != len(keras_outputs):
        raise NeuropodError(
            f"The spec has {len(inputs)} inputs and {len(outputs)} outputs, the Keras model "
            f"{len(keras_inputs)} and {len(keras_outputs)}"
        )
    signature = [
        tf.TensorSpec([d if isinstance(d, int) else None for d in s.shape], s.dtype if s.dtype != "string" else tf.string, name=s.name)
        for s in inputs
    ]
    output_names = [s.name for s in outputs]

    @tf.function(input_signature=signature)  # type: ignore[untyped-decorator]
    def serve(*args: Any) -> dict[str, Any]:
        result = model(list(args) if len(args) > 1 else args[0], training=False)
        results = list(result) if isinstance(result, (list, tuple)) else [result]
        return dict(zip(output_names, results))

    holder = tf.Module()
    holder.model = model
    holder.serving_default = serve
    with tempfile.TemporaryDirectory(prefix="neuropod-keras-") as tmp:
        saved = _save_trackable(holder, Path(tmp) / "savedmodel")
        return _write(
            neuropod_path, model_name, inputs, outputs, {SAVED_MODEL_PATH: saved}, None, platform_version_semver,
            custom_ops, input_tensor_device, default_input_tensor_device, test_input_data, test_expected_out,
            package_as_zip, test_rtol, test_atol,
        )  # fmt: skip


def _keras_spec(tensors: list[Any], names: list[str] | None) -> tuple[TensorSpec, ...]:
    entries = []
    for i, t in enumerate(tensors):
        dims = list(t.shape)
        shape = ["batch_size" if j == 0 else (int(d) if d is not None else None) for j, d in enumerate(dims)]
        dtype = str(getattr(t.dtype, "name", t.dtype))
        name = names[i] if names else str(getattr(t, "name", f"input_{i}")).split(":")[0]
        entries.append({"name": name, "dtype": "string" if dtype == "string" else dtype, "shape": shape})
    return parse_spec(entries, "the Keras model's spec")


def _save_trackable(obj: Any, path: Path) -> Path:
    import tensorflow as tf

    from neuropod_tensorflow._runtime import SIGNATURE, quiet_stderr

    signatures = getattr(obj, SIGNATURE, None)
    kwargs: dict[str, Any] = {}
    if signatures is not None and hasattr(signatures, "get_concrete_function"):
        kwargs["signatures"] = {SIGNATURE: signatures.get_concrete_function()}
    with quiet_stderr("saving the model"):
        try:
            tf.saved_model.save(obj, str(path), **kwargs)
        except Exception as e:
            raise NeuropodError(f"tf.saved_model.save failed: {type(e).__name__}: {e}") from e
    return path


def _write(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
    files: Mapping[str, FileSource],
    backend_config: Mapping[str, Any] | None,
    platform_version_semver: str,
    custom_ops: Sequence[str | os.PathLike[str]],
    input_tensor_device: Mapping[str, str] | None,
    default_input_tensor_device: str,
    test_input_data: Mapping[str, Any] | None,
    test_expected_out: Mapping[str, Any] | None,
    package_as_zip: bool,
    rtol: float,
    atol: float,
) -> Path:
    config = packager_config(
        model_name, PLATFORM, inputs, outputs, platform_version_semver=platform_version_semver,
        framework_distributions=FRAMEWORK_DISTRIBUTIONS, input_tensor_device=input_tensor_device,
        default_input_tensor_device=default_input_tensor_device,
    )  # fmt: skip
    path = write_package(
        neuropod_path, config, files, backend_config=backend_config, custom_ops=custom_ops,
        test_input_data=test_input_data, test_expected_out=test_expected_out, package_as_zip=package_as_zip,
    )  # fmt: skip
    # Loads the package once (a mapping or signature that does not fit fails
    # now) and runs the test data; a package that fails is removed.
    check_packaged(path, backend=PLATFORM, rtol=rtol, atol=atol)
    return path


__all__ = ["create_keras_neuropod", "create_tensorflow_neuropod"]
