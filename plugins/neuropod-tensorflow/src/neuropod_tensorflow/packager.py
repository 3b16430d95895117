"""``create_tensorflow_neuropod`` and ``create_keras_neuropod``."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuropod.create import create_package
from neuropod.errors import NeuropodError, PackageError
from neuropod.package import FileSource
from neuropod.plugins import import_framework
from neuropod.spec import TensorSpec, parse_spec
from neuropod.strings import TEXT_DTYPES
from neuropod_tensorflow import FRAMEWORK_DISTRIBUTIONS, PLATFORM
from neuropod_tensorflow._quiet import import_tensorflow, quiet_stderr
from neuropod_tensorflow._runtime import SIGNATURE

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from neuropod.create import PackageOptions

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
    init_op_names: str | Sequence[str] = (),
    **options: Unpack[PackageOptions],
) -> Path:
    """Package a TensorFlow model as a Neuropod.

    Give exactly one model source:

    * ``frozen_graph_path`` (a ``.pb`` GraphDef file) or ``graph_def`` (a
      ``tf.compat.v1.GraphDef``), with ``node_name_mapping`` from spec names
      to tensor names (``":0"`` optional) and optional ``init_op_names`` (a
      list of op names, or one name as a str) to run once after loading;
      stored as ``0/data/model.pb``;
    * ``saved_model_dir`` (a SavedModel directory) or ``trackable_obj`` (a
      ``tf.Module`` to save with ``tf.saved_model.save``; its
      ``serving_default`` attribute, if any, becomes the signature); stored
      under ``0/data/savedmodel`` and run through the ``serving_default``
      signature, whose input and output keys are the spec's names.

    :param options: the common keywords (:class:`neuropod.package.PackageOptions`):
        ``platform_version_semver`` (TensorFlow versions), ``custom_ops`` (op
        libraries for ``tf.load_op_library``, loaded before the graph is
        imported), ``test_input_data`` (a package that fails its test data is
        removed; the error is a ValueError), ``package_as_zip``, ...
    :returns: the path written.
    """
    sources = [frozen_graph_path, graph_def, saved_model_dir, trackable_obj]
    given = sum(s is not None for s in sources)
    if given != 1:
        raise PackageError(
            "Exactly one of `frozen_graph_path`, `graph_def`, `saved_model_dir` and `trackable_obj` must be "
            f"provided: create_tensorflow_neuropod got {given}"
        )
    frozen = frozen_graph_path is not None or graph_def is not None
    if frozen and not node_name_mapping:
        raise PackageError(
            "node_name_mapping is required when using `frozen_graph_path` or `graph_def`: "
            "{spec name: graph tensor name, ...}"
        )
    if not frozen and node_name_mapping:
        raise PackageError(
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
                raise PackageError(f"graph_def must be a tf.compat.v1.GraphDef, not {type(graph_def).__name__}")
            files = {FROZEN_GRAPH_PATH: graph_def.SerializeToString()}
        elif saved_model_dir is not None:
            if not (Path(saved_model_dir) / "saved_model.pb").is_file():
                raise PackageError(f"saved_model_dir {saved_model_dir} is not a SavedModel (no saved_model.pb)")
            files = {SAVED_MODEL_PATH: Path(saved_model_dir)}
        else:
            files = {SAVED_MODEL_PATH: _save_trackable(trackable_obj, Path(tmp) / "savedmodel")}
        if frozen:
            mapping = dict(node_name_mapping or {})
            backend_config = {"node_name_mapping": mapping, "init_op_names": _op_names(init_op_names)}
        return create_package(
            "create_tensorflow_neuropod", neuropod_path, model_name, PLATFORM, input_spec, output_spec, files, options,
            backend_config=backend_config, framework_distributions=FRAMEWORK_DISTRIBUTIONS,
        )  # fmt: skip


def _op_names(init_op_names: str | Sequence[str] | None) -> list[str]:
    """``init_op_names`` as a list: one name given as a str is that one op (as the original took it)."""
    if init_op_names is None:
        return []
    names = [init_op_names] if isinstance(init_op_names, str) else list(init_op_names)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise PackageError(f"init_op_names must be op names (non-empty str), not {bad[0]!r}")
    return names


def create_keras_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    sess: Any = None,
    model: Any = None,
    node_name_mapping: Mapping[str, str] | None = None,
    input_spec: Sequence[Mapping[str, Any]] | None = None,
    output_spec: Sequence[Mapping[str, Any]] | None = None,
    **options: Unpack[PackageOptions],
) -> Path:
    """Package a Keras model as a Neuropod (a SavedModel with a ``serving_default`` signature).

    Called as the original Neuropod was, ``create_keras_neuropod(neuropod_path=..., model_name=...,
    sess=None, model=model, ...)`` (or with ``sess`` and ``model`` as the third and fourth
    positional arguments), or as ``create_keras_neuropod(path, name, model)``.

    :param sess: the original's TensorFlow session holding the weights. A Keras 3
        model holds its own weights, so the only accepted value is None; a
        ``tf.compat.v1.Session`` is refused with what to do instead.
    :param model: a built Keras model (functional or sequential).
    :param node_name_mapping: spec name -> Keras input or output name, when
        the spec's names are not the model's (``{"x": "input_1", "out": "fc1000"}``).
        Keras input names are the ``Input`` layers' names; output names are
        ``model.output_names`` (else the names of the layers that produce them).
    :param input_spec: defaults to :func:`infer_keras_input_spec`.
    :param output_spec: defaults to :func:`infer_keras_output_spec`; it may
        name a subset of the model's outputs.
    :param options: the common keywords (:class:`neuropod.package.PackageOptions`).
    :returns: the path written.
    """
    model = _keras_call_style(sess, model)
    tf = import_framework("tensorflow", "keras", "create_keras_neuropod", import_tensorflow)

    in_names, out_names = _keras_names(model)
    mapping = dict(node_name_mapping) if node_name_mapping else None
    if mapping:
        for name, keras_name in mapping.items():
            if keras_name not in in_names and keras_name not in out_names:
                raise PackageError(
                    f"node_name_mapping maps {name!r} to {keras_name!r}, which is neither a Keras input name nor a "
                    f"Keras output name (inputs: {', '.join(map(repr, in_names))}; outputs: "
                    f"{', '.join(map(repr, out_names))})"
                )
    if input_spec is None:
        input_spec = infer_keras_input_spec(model, mapping)
    if output_spec is None:
        output_spec = infer_keras_output_spec(model, mapping)
    inputs, outputs = parse_spec(input_spec, "input_spec"), parse_spec(output_spec, "output_spec")
    in_index = _keras_positions(inputs, "input", in_names, mapping)
    out_index = _keras_positions(outputs, "output", out_names, mapping)
    fed = set(in_index.values())
    unfed = [in_names[i] for i in range(len(in_names)) if i not in fed]
    if unfed:
        raise PackageError(
            f"The input spec does not feed the Keras model's input(s) {', '.join(map(repr, unfed))}; "
            "every input of the model must be in the spec"
        )
    signature = [
        tf.TensorSpec([d if isinstance(d, int) else None for d in s.shape], tf.string if s.dtype in TEXT_DTYPES else s.dtype,
                      name=s.name)
        for s in inputs
    ]  # fmt: skip
    keras_inputs, keras_outputs = list(model.inputs), list(model.outputs)
    # The model is called with its own input structure (a tensor, a list or a dict)
    # and returns its own output structure; both are matched by position in
    # model.inputs / model.outputs, which are those structures flattened.
    in_struct = _structure(model, "input", keras_inputs)
    in_slots = _flat_positions(tf, in_struct, keras_inputs)
    out_slots = _flat_positions(tf, _structure(model, "output", keras_outputs), keras_outputs)
    arg_of_input = {keras: i for i, keras in enumerate(in_index[s.name] for s in inputs)}
    result_of_output = {keras: r for r, keras in enumerate(out_slots)}
    picks = [(s.name, result_of_output[out_index[s.name]]) for s in outputs]

    @tf.function(input_signature=signature)  # type: ignore[untyped-decorator]
    def serve(*args: Any) -> dict[str, Any]:
        flat = [args[arg_of_input[k]] for k in in_slots]
        results = tf.nest.flatten(model(tf.nest.pack_sequence_as(in_struct, flat), training=False))
        return {name: results[slot] for name, slot in picks}

    holder = tf.Module()
    holder.model = model
    holder.serving_default = serve
    with tempfile.TemporaryDirectory(prefix="neuropod-keras-") as tmp:
        saved = _save_trackable(holder, Path(tmp) / "savedmodel")
        return create_package(
            "create_keras_neuropod", neuropod_path, model_name, PLATFORM, inputs, outputs, {SAVED_MODEL_PATH: saved},
            options, framework_distributions=FRAMEWORK_DISTRIBUTIONS,
        )  # fmt: skip


def infer_keras_input_spec(model: Any, node_name_mapping: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The input spec of a Keras model, as the original Neuropod inferred it.

    One entry per model input: ``{"name", "dtype", "shape"}`` with the
    Keras name (or, with ``node_name_mapping`` from spec names to Keras
    names, the spec name that maps to it), the tensor's dtype, and the
    shape as a tuple whose first dim is the symbol ``"batch_size"``
    (``("batch_size", 4)`` for ``Input(shape=(4,))``; unknown dims None).

    :raises PackageError: (a ValueError) ``node_name_mapping`` does not
        cover every input.
    """
    in_names, _ = _keras_names(model)
    return _infer_keras_spec(in_names, list(model.inputs), node_name_mapping)


def infer_keras_output_spec(model: Any, node_name_mapping: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The output spec of a Keras model, as :func:`infer_keras_input_spec` does for its inputs."""
    _, out_names = _keras_names(model)
    return _infer_keras_spec(out_names, list(model.outputs), node_name_mapping)


def _infer_keras_spec(
    names: Sequence[str], tensors: Sequence[Any], node_name_mapping: Mapping[str, str] | None
) -> list[dict[str, Any]]:
    spec_name = {keras: name for name, keras in (node_name_mapping or {}).items()}
    entries = []
    for keras_name, tensor in zip(names, tensors):
        name = spec_name.get(keras_name) if spec_name else keras_name
        if name is None:
            raise PackageError(
                f"Keras input/output layer {keras_name} is not covered by node_name_mapping "
                f"(it maps {', '.join(map(repr, node_name_mapping or {}))})"
            )
        dims = [d if d is None else int(d) for d in _dims(tensor)]
        dtype = str(getattr(tensor.dtype, "name", tensor.dtype))
        shape = ("batch_size", *dims[1:]) if dims else ()
        entries.append({"name": name, "dtype": dtype, "shape": shape})
    return entries


def _dims(tensor: Any) -> list[Any]:
    shape = tensor.shape
    dims = getattr(shape, "dims", shape)  # a tf.TensorShape (tf.keras 2) or a tuple (Keras 3)
    if dims is None:
        raise PackageError(f"The Keras tensor {getattr(tensor, 'name', tensor)!r} has an unknown rank; give the spec")
    return [getattr(d, "value", d) for d in dims]


def _is_keras_model(obj: Any) -> bool:
    """Whether ``obj`` is a Keras model (Keras 3, tf.keras or tf_keras), without importing Keras."""
    packages = ("keras", "tf_keras", "tensorflow")
    return any(
        c.__name__ in ("Model", "Functional", "Sequential") and c.__module__.split(".")[0] in packages
        for c in type(obj).__mro__
    )


def _keras_call_style(sess: Any, model: Any) -> Any:
    """The model, from the original's ``(path, name, sess, model)`` or our ``(path, name, model)`` call."""
    if model is None and _is_keras_model(sess):
        return sess  # create_keras_neuropod(path, name, model)
    if model is None:
        raise PackageError("create_keras_neuropod needs model= (a built Keras model)")
    if _is_keras_model(sess):
        raise PackageError(
            "create_keras_neuropod got a Keras model as sess (the third positional argument) and model= too; "
            "call it as create_keras_neuropod(path, name, model) or create_keras_neuropod(path, name, sess=None, "
            "model=model)"
        )
    if sess is not None:
        what = "a TensorFlow session" if _is_session(sess) else f"a {type(sess).__name__}"
        raise PackageError(
            f"create_keras_neuropod got {what} as sess. The original Neuropod froze the session's graph; a Keras 3 "
            "model holds its own weights and runs without a session, so sess is not used: pass sess=None (or "
            "leave it out). A model that only exists as a tf.compat.v1 graph in a session: freeze that graph and "
            "package it with create_tensorflow_neuropod(graph_def=..., node_name_mapping=...)"
        )
    if not _is_keras_model(model):
        raise PackageError(f"create_keras_neuropod needs a Keras model as model=, not a {type(model).__name__}")
    return model


def _is_session(obj: Any) -> bool:
    return any(c.__name__ == "BaseSession" and c.__module__.startswith("tensorflow.") for c in type(obj).__mro__)


def _keras_names(model: Any) -> tuple[list[str], list[str]]:
    """The model's input and output names (what ``node_name_mapping`` maps to)."""
    try:
        inputs, outputs = list(model.inputs), list(model.outputs)
    except (AttributeError, ValueError) as e:
        raise PackageError(f"create_keras_neuropod needs a built model with known inputs and outputs: {e}") from e
    if not inputs or not outputs:
        raise PackageError("create_keras_neuropod needs a built model with known inputs and outputs (call it once)")
    given = list(getattr(model, "input_names", None) or [])  # tf.keras 2 has it; Keras 3 does not
    in_names = given if len(given) == len(inputs) else [str(t.name).split(":")[0] for t in inputs]
    given = list(getattr(model, "output_names", None) or [])  # Keras 3 Sequential has none
    if len(given) == len(outputs):
        out_names = [str(n) for n in given]
    else:
        out_names = []
        for i, t in enumerate(outputs):
            layer = getattr(getattr(t, "_keras_history", None), "operation", None) or getattr(t, "node", None)
            out_names.append(str(getattr(layer, "name", None) or f"output_{i}"))
    for kind, names in (("input", in_names), ("output", out_names)):
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise PackageError(
                f"The Keras model has several {kind}s named {', '.join(map(repr, twice))}; name its layers apart"
            )
    return in_names, out_names


def _keras_positions(
    specs: Sequence[TensorSpec], kind: str, names: Sequence[str], mapping: Mapping[str, str] | None
) -> dict[str, int]:
    """Spec name -> position in the model's inputs or outputs, checked as the original did."""
    found = {}
    for s in specs:
        if mapping:
            keras_name = mapping.get(s.name)
            if keras_name is None:
                raise PackageError(f"{kind.capitalize()} {s.name} is not mapped in node_name_mapping.")
            if keras_name not in names:
                raise PackageError(
                    f"{kind.capitalize()} {s.name} mapped to {keras_name} is not in model {kind}s. "
                    f"The model's {kind}s: {', '.join(map(repr, names))}"
                )
        else:
            keras_name = s.name
            if keras_name not in names:
                raise PackageError(
                    f"{kind.capitalize()} {s.name} is not in model {kind}s. The model's {kind}s: "
                    f"{', '.join(map(repr, names))} (give node_name_mapping= to use other names)"
                )
        found[s.name] = list(names).index(keras_name)
    return found


def _structure(model: Any, which: str, flat: list[Any]) -> Any:
    """``model.input`` or ``model.output``: the tensor, list or dict the model takes or gives."""
    try:
        return getattr(model, which)
    except (AttributeError, ValueError):
        return flat if len(flat) > 1 else flat[0]


def _flat_positions(tf: Any, struct: Any, tensors: list[Any]) -> list[int]:
    """For each leaf of ``struct`` flattened, its position in ``tensors`` (matched by identity)."""
    flat = tf.nest.flatten(struct)
    where = {id(t): i for i, t in enumerate(tensors)}
    if len(flat) != len(tensors) or any(id(t) not in where for t in flat):
        return list(range(len(tensors)))
    return [where[id(t)] for t in flat]


def _save_trackable(obj: Any, path: Path) -> Path:
    import tensorflow as tf

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


__all__ = ["create_keras_neuropod", "create_tensorflow_neuropod", "infer_keras_input_spec", "infer_keras_output_spec"]
