"""Triton's model configuration of a served model, derived from its package and the serve options.

Nothing is configured per model: the configuration ``GET
/v2/models/{m}/config`` and gRPC ``ModelConfig`` answer is what the server
does with the package. Both front ends call :func:`model_config` (a plain
dict, the JSON Triton answers: protobuf's JSON form of
``inference.ModelConfig`` with its snake_case field names) and gRPC turns it
into the message with :func:`model_config_message`.

- ``platform`` / ``backend``: Triton's names where the package's platform is
  one Triton runs (:data:`TRITON_PLATFORMS`), else the package's own platform
  for both. ``parameters`` carry the package's own platform, the backend that
  runs it (``onnx==1.20.1``) and its device.
- ``max_batch_size``: ``--max-batch-size`` when the model is batched (its spec
  has a batch dimension and batching is on), else 0. When it is above 0 the
  batch dimension is left out of ``dims``, as in Triton.
- ``input`` / ``output``: ``TYPE_*`` data types (``string`` is TYPE_STRING),
  ``dims`` with -1 for a symbol or a ``null`` (any size) dim; an input's
  ``format`` is ``FORMAT_NONE`` unless the load's config declared its layout
  (``FORMAT_NCHW``/``FORMAT_NHWC``).
- ``dynamic_batching``: present when the model is batched, with
  ``max_queue_delay_microseconds`` from ``--max-queue-delay-us``.
- ``instance_group``: one group; ``count`` is the model's copies that run at
  once (``--workers``, 1 in process), ``kind`` KIND_GPU (with ``gpus``) when
  the model runs on a GPU, else KIND_CPU.

- ``sequence_batching`` (instead of ``dynamic_batching``) for a stateful model:
  ``control_input`` (each input the server fills, with its ``CONTROL_SEQUENCE_*``
  kind and false/true values in its type: ``int32_false_true``,
  ``fp32_false_true`` or ``bool_false_true``; the id's ``data_type``),
  ``state`` (``input_name``, ``output_name``, ``data_type``, ``dims`` of one
  sequence's state, without the batch dimension when ``max_batch_size`` is
  above 0, and its ``initial_state``: ``zero_data``, or ``data_file`` naming the
  package's array), ``max_sequence_idle_microseconds`` (the model's idle
  limit: its load config's, else ``--max-sequence-idle-us``), and ``oldest`` when requests of several sequences run as one batch
  (``max_queue_delay_microseconds``, ``preferred_batch_size``, and
  ``max_candidate_sequences``: the bound on live sequences, its load config's
  else ``--max-sequences``),
  else ``direct``. Its ``input``/``output`` lists leave the state and control
  tensors out, as Triton's do.
- ``model_transaction_policy``: ``{"decoupled": true}`` for a decoupled model
  (its package's ``config.json`` says so: any number of responses per request,
  served over gRPC ModelStreamInfer and the REST stream endpoints); left out
  for any other model, as protobuf's JSON leaves out a default.
- A pipeline (a pipeline package, or one a load's ensemble configuration made of served models)
  is Triton's ensemble: ``platform`` ``"ensemble"``, ``backend`` ``""``, and
  ``ensemble_scheduling`` with its ``step`` list (``model_name``: a package's step name, or the
  served model a configuration named; ``model_version``; ``input_map``; ``output_map``) and
  ``max_inflight_requests`` when bounded; parameter ``neuropod_steps`` says what runs each step.

The batching and instance settings are read from one place,
:meth:`Engine.serving <neuropod_serving.server.engine.Engine.serving>`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from neuropod_serving.server.ensemble_config import ensemble_scheduling

if TYPE_CHECKING:
    from neuropod.spec import TensorSpec
    from neuropod_serving.protocol._grpc import triton_config_pb2
    from neuropod_serving.server.engine import Engine
    from neuropod_serving.server.registry import ServedModel

#: A package's platform -> Triton's (platform, backend) for the same kind of model.
#: TensorFlow is either: see :func:`triton_platform`.
TRITON_PLATFORMS: dict[str, tuple[str, str]] = {
    "onnx": ("onnxruntime_onnx", "onnxruntime"),
    "torchscript": ("pytorch_libtorch", "pytorch"),
    "tensorflow": ("tensorflow_savedmodel", "tensorflow"),
    "tensorrt": ("tensorrt_plan", "tensorrt"),
    "python": ("python", "python"),
    # A pipeline package, or a pipeline a load's ensemble configuration made of served models.
    "pipeline": ("ensemble", ""),
}
_TF_GRAPHDEF = ("tensorflow_graphdef", "tensorflow")

#: Spec dtype -> Triton's DataType name.
TRITON_TYPES: dict[str, str] = {
    "bool": "TYPE_BOOL",
    "uint8": "TYPE_UINT8",
    "uint16": "TYPE_UINT16",
    "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64",
    "int8": "TYPE_INT8",
    "int16": "TYPE_INT16",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
    "string": "TYPE_STRING",
    "bytes": "TYPE_STRING",
}


def triton_platform(platform: str, data_dir: Any = None) -> tuple[str, str]:
    """Triton's (platform, backend) for a package platform, or (platform, platform) when Triton
    has none. ``data_dir`` (the package's ``0/data``) tells a TensorFlow frozen graph
    (``model.pb``: tensorflow_graphdef) from a SavedModel."""
    if platform == "tensorflow" and data_dir is not None and (data_dir / "model.pb").is_file():
        return _TF_GRAPHDEF
    return TRITON_PLATFORMS.get(platform, (platform, platform))


def _tensor(spec: TensorSpec, batched: bool, formats: dict[str, str] | None = None) -> dict[str, Any]:
    """One ``input`` (``formats`` given: with its ``format``) or ``output`` entry."""
    shape = spec.shape[1:] if batched else spec.shape
    entry: dict[str, Any] = {"name": spec.name, "data_type": TRITON_TYPES[spec.dtype]}
    if formats is not None:
        entry["format"] = formats.get(spec.name, "FORMAT_NONE")
    entry["dims"] = [d if isinstance(d, int) else -1 for d in shape]
    return entry


def instance_group(name: str, device: str, count: int) -> dict[str, Any]:
    """The one instance group of a model running ``count`` copies on ``device`` (``cpu``, ``cuda:1``)."""
    group: dict[str, Any] = {"name": name, "kind": "KIND_CPU", "count": count}
    if device.startswith("cuda"):
        index = device.partition(":")[2]
        group["kind"] = "KIND_GPU"
        group["gpus"] = [int(index) if index.isdigit() else 0]
    return group


def model_config(engine: Engine, served: ServedModel) -> dict[str, Any]:
    """The Triton model configuration of ``served`` as ``engine`` serves it (JSON-ready).

    :raises UnknownModelError: the model was unloaded meanwhile.
    """
    serving = engine.serving(served.name, served.version)
    model = served.model
    package = getattr(model, "package", None)
    platform, backend = triton_platform(model.platform, getattr(package, "data_dir", None))
    batching = serving.batching
    device = str(model.device)
    formats = dict(served.settings.input_formats) if served.settings is not None else {}
    config: dict[str, Any] = {
        "name": served.name,
        "platform": platform,
        "backend": backend,
        "max_batch_size": batching.max_batch_size if batching is not None else 0,
        "input": [_tensor(s, batching is not None, formats) for s in model.inputs],
        "output": [_tensor(s, batching is not None) for s in model.outputs],
        "instance_group": [instance_group(served.name, device, serving.instances)],
        "parameters": {
            "neuropod_platform": {"string_value": model.platform},
            "neuropod_backend": {"string_value": model.backend.id},
            "neuropod_device": {"string_value": device},
        },
    }
    if getattr(model, "stateful", False):
        # One of Triton's scheduling choices: a stateful model's is the sequence batcher.
        config["sequence_batching"] = sequence_batching(engine, served, batching)
    elif batching is not None:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": round(batching.max_queue_delay_s * 1e6)}
    if getattr(model, "decoupled", False):
        config["model_transaction_policy"] = {"decoupled": True}
    pipeline = getattr(getattr(package, "config", None), "pipeline", None)
    if pipeline is not None:
        _ensemble(config, served, pipeline)
    return config


def _ensemble(config: dict[str, Any], served: ServedModel, pipeline: Any) -> None:
    """A pipeline's ``ensemble_scheduling``: its steps (a package's by step name, an ensemble
    configuration's by the served models it named), and what runs each step."""
    if served.ensemble is not None:
        named = [{"model_name": s.model_name, "model_version": int(s.version) if s.version else -1}
                 for s in served.ensemble.steps]  # fmt: skip
    else:
        named = [{"model_name": s.name, "model_version": -1} for s in pipeline.steps]
    config["ensemble_scheduling"] = ensemble_scheduling(named, pipeline)
    steps = getattr(served.model, "steps", {})
    config["parameters"]["neuropod_steps"] = {"string_value": "; ".join(
        f"{name}: model {m.name!r} on {m.backend.id} ({m.device})" for name, m in steps.items()
    )}  # fmt: skip


def sequence_batching(engine: Engine, served: ServedModel, batching: Any) -> dict[str, Any]:
    """A stateful model's ``sequence_batching`` block (see the module's docstring).

    :param batching: how its requests are batched (None: one sequence's step a run).
    """
    model = served.model
    settings = served.settings
    limits = getattr(engine, "sequence_limits", None)  # the server's (--max-sequence-idle-us, --max-sequences)
    specs = {s.name: s for s in model.package.config.input_spec}
    block: dict[str, Any] = {}
    idle = _setting(settings, "max_sequence_idle_us", limits, "max_idle_us")
    if idle is not None:
        block["max_sequence_idle_microseconds"] = idle
    controls = []
    for control in model.sequence_controls:
        dtype = specs[control.name].dtype
        entry: dict[str, Any] = {"kind": control.kind}
        if control.kind == "CONTROL_SEQUENCE_CORRID":
            entry["data_type"] = TRITON_TYPES[dtype]
        elif dtype == "bool":
            entry["bool_false_true"] = [False, True]
        elif dtype.startswith("float"):
            entry["fp32_false_true"] = [0.0, 1.0]
        else:
            entry["int32_false_true"] = [0, 1]
        controls.append({"name": control.name, "control": [entry]})
    if controls:
        block["control_input"] = controls
    states = []
    for pair in model.state_spec:
        # Triton's dims of a state leave out the batch dimension when the model batches (max_batch_size > 0).
        dims = list(pair.shape[1:] if batching is not None else pair.shape)
        initial: dict[str, Any] = {"data_type": TRITON_TYPES[pair.dtype], "dims": dims}
        initial["name"] = f"{pair.input_name}_initial"
        if pair.initial_state == "zero":
            initial["zero_data"] = True
        else:
            initial["data_file"] = str(pair.initial_state)
        states.append({
            "input_name": pair.input_name, "output_name": pair.output_name, "data_type": TRITON_TYPES[pair.dtype],
            "dims": dims, "initial_state": [initial],
        })  # fmt: skip
    if states:
        block["state"] = states
    if batching is None:
        block["direct"] = {}
        return block
    oldest: dict[str, Any] = {"max_queue_delay_microseconds": round(batching.max_queue_delay_s * 1e6)}
    bound = _setting(settings, "max_sequences", limits, "max_sequences")
    if bound is not None:
        oldest["max_candidate_sequences"] = bound
    preferred = settings.preferred_batch_sizes if settings is not None else ()
    if preferred:
        oldest["preferred_batch_size"] = list(preferred)
    block["oldest"] = oldest
    return block


def _setting(settings: Any, name: str, limits: Any, limit: str) -> Any:
    """A model's setting ``name``: its own (0 or None: not set), else the server's ``limit`` (None: neither)."""
    value = getattr(settings, name, None)
    return value if value else getattr(limits, limit, None)


def model_config_message(config: dict[str, Any]) -> triton_config_pb2.ModelConfigResponse:
    """The gRPC ModelConfigResponse holding a :func:`model_config` dict."""
    # lazy: protobuf, kept out of a REST-only server (the REST app imports this module)
    from google.protobuf import json_format

    # lazy: protobuf, kept out of a REST-only server (the REST app imports this module)
    from neuropod_serving.protocol._grpc import triton_config_pb2 as tc

    def tensors(entries: list[dict[str, Any]], kind: Any) -> list[Any]:
        return [kind(name=t["name"], data_type=tc.DataType.Value(t["data_type"]), dims=t["dims"],
                     **({"format": tc.ModelInput.Format.Value(t["format"])} if "format" in t else {}))
                for t in entries]  # fmt: skip

    message = tc.ModelConfig(
        name=config["name"],
        platform=config["platform"],
        backend=config["backend"],
        max_batch_size=config["max_batch_size"],
        input=tensors(config["input"], tc.ModelInput),
        output=tensors(config["output"], tc.ModelOutput),
        instance_group=[
            tc.ModelInstanceGroup(
                name=g["name"],
                kind=tc.ModelInstanceGroup.Kind.Value(g["kind"]),
                count=g["count"],
                gpus=g.get("gpus", []),
            )
            for g in config["instance_group"]
        ],
    )
    for key, value in config["parameters"].items():
        message.parameters[key].string_value = value["string_value"]
    if "dynamic_batching" in config:
        message.dynamic_batching.max_queue_delay_microseconds = config["dynamic_batching"][
            "max_queue_delay_microseconds"
        ]
    if "sequence_batching" in config:
        json_format.ParseDict(config["sequence_batching"], message.sequence_batching)
    if "model_transaction_policy" in config:
        message.model_transaction_policy.decoupled = config["model_transaction_policy"]["decoupled"]
    if "ensemble_scheduling" in config:
        json_format.ParseDict(config["ensemble_scheduling"], message.ensemble_scheduling)
    return tc.ModelConfigResponse(config=message)
