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

- ``model_transaction_policy``: ``{"decoupled": true}`` for a decoupled model
  (its package's ``config.json`` says so: any number of responses per request,
  served over gRPC ModelStreamInfer and the REST stream endpoints); left out
  for any other model, as protobuf's JSON leaves out a default.

The batching and instance settings are read from one place,
:meth:`Engine.serving <neuropod_serving.server.engine.Engine.serving>`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
    if batching is not None:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": round(batching.max_queue_delay_s * 1e6)}
    if getattr(model, "decoupled", False):
        config["model_transaction_policy"] = {"decoupled": True}
    return config


def model_config_message(config: dict[str, Any]) -> triton_config_pb2.ModelConfigResponse:
    """The gRPC ModelConfigResponse holding a :func:`model_config` dict."""
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
    if "model_transaction_policy" in config:
        message.model_transaction_policy.decoupled = config["model_transaction_policy"]["decoupled"]
    return tc.ModelConfigResponse(config=message)
