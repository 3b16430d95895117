"""A repository load's ``config``: Triton's model configuration (JSON) as serving settings of one model.

Triton loads a model with the configuration a load request carries instead
of the one in its repository (``POST /v2/repository/models/{m}/load`` with
``{"parameters": {"config": "<JSON>"}}``, gRPC ``parameters["config"].string_param``).
A Neuropod package already says what the model computes, so here the
configuration can only change how the model is served, and must agree with
the package on the rest:

- **applied** (to this model only, until it is loaded again without a config):
  ``max_batch_size`` (0 or 1: no batching; above 1: dynamic batching up to that
  many rows, which needs a batch dimension in the spec),
  ``dynamic_batching.max_queue_delay_microseconds``,
  ``dynamic_batching.preferred_batch_size`` (a batch of one of these sizes runs
  without waiting out the delay), ``instance_group[0].count`` (OPE worker
  processes; 1 runs the model in the server's process) and
  ``instance_group[0].kind``/``gpus`` (``KIND_CPU``: the CPU,
  ``KIND_GPU``: ``cuda:<gpus[0]>``, ``KIND_AUTO``: neuropod's choice), and an
  input's ``format`` (``FORMAT_NCHW``/``FORMAT_NHWC`` for an input of three
  dims besides the batch dimension, or ``FORMAT_NONE``): the image layout a
  package does not record, reported in the model configuration for clients
  that read it (Triton's image examples do); it changes nothing the model runs.
  ``sequence_batching`` makes the model stateful (its ``control_input`` and
  ``state``, checked against the package's spec when it loads) and sets its
  sequences' idle limit, bound and batching delay
  (:mod:`~neuropod_serving.server.sequence_config`); the config's ``input``
  list then leaves out the control and state inputs, as Triton's does.
  A field left out keeps the server's option (``--max-batch-size``,
  ``--max-queue-delay-us``, ``--workers``). Unlike Triton, ``max_batch_size``
  above 1 batches without a ``dynamic_batching`` block, as ``--max-batch-size`` does.
- **checked** against the package: ``name``, ``platform``/``backend`` (the
  package's platform, or Triton's name for it), ``input`` and ``output``
  (names, ``data_type`` and ``dims``: -1 for a symbol or any size; the batch
  dimension may be left out as Triton folds it into ``max_batch_size``).
  Triton's other tensor fields are accepted at their defaults (``false``, ``""``)
  and refused otherwise.
  A field that disagrees is refused, naming it.
- **ignored**: Triton fields about how its own backends treat model files or
  versions (:data:`IGNORED`); a package decides those itself.
- **refused**: every other field, known to Triton (``ensemble_scheduling``...) or not (a misspelt name), naming it. Ignoring
  it would serve something other than what the client asked for. A pipeline package's config may
  hold its own ``ensemble_scheduling`` (checked against its steps); an ensemble configuration under
  a name that is no package makes a pipeline of served models (:mod:`~neuropod_serving.server.ensembles`).

Every refusal is a :class:`~neuropod_serving.protocol.ProtocolError` (400,
gRPC INVALID_ARGUMENT) raised before anything is loaded.
"""

from __future__ import annotations

from typing import Any

from neuropod.package import ModelConfig
from neuropod.spec import TensorSpec
from neuropod_serving.protocol import ProtocolError, oip_datatype
from neuropod_serving.server.batching import batch_symbol
from neuropod_serving.server.ensemble_config import check_package_scheduling, load_config
from neuropod_serving.server.registry import ModelSettings
from neuropod_serving.server.sequence_config import check_listed, sequence_settings
from neuropod_serving.server.sequence_config import only_fields as _only
from neuropod_serving.server.sequence_config import whole_number as _int

#: Fields that set how the model is served.
APPLIED = ("max_batch_size", "dynamic_batching", "sequence_batching", "instance_group")
#: Fields that must agree with the package.
CHECKED = ("name", "platform", "backend", "input", "output")
#: Triton fields accepted and not used: how Triton's backends treat model files and versions.
IGNORED = (
    "version_policy", "optimization", "parameters", "model_warmup", "response_cache",
    "default_model_filename", "cc_model_filenames", "metric_tags", "runtime",
)  # fmt: skip
#: The largest ``max_batch_size`` a config may set (rows of one concatenated run).
MAX_BATCH_SIZE = 65536
#: The most OPE workers ``instance_group[0].count`` may ask for (processes).
MAX_WORKERS = 64
#: ``dynamic_batching.max_queue_delay_microseconds`` at most (10 s, as ``--max-queue-delay-us``).
MAX_QUEUE_DELAY_US = 10_000_000
#: Triton's platform and backend names of each package platform (the package's own name is accepted too).
TRITON_PLATFORMS = {
    "onnx": ("onnxruntime_onnx", "onnxruntime"),
    "torchscript": ("pytorch_libtorch", "pytorch"),
    "tensorflow": ("tensorflow_savedmodel", "tensorflow_graphdef", "tensorflow"),
    "tensorrt": ("tensorrt_plan", "tensorrt"),
    "python": ("python",),
    "torch": ("pytorch", "torch_aoti"),
    "jax": ("jax",),
    "pipeline": ("ensemble",),
}
_DYNAMIC_BATCHING = ("max_queue_delay_microseconds", "preferred_batch_size", "preserve_ordering")
_INSTANCE_GROUP = ("name", "kind", "count", "gpus")
_KINDS = ("KIND_AUTO", "KIND_CPU", "KIND_GPU")
_FORMATS = ("FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW")
#: Triton's tensor fields that need nothing of the server at their default values.
_TENSOR_DEFAULTS = {
    "is_shape_tensor": False, "allow_ragged_batch": False, "optional": False, "is_non_linear_format_io": False,
    "label_filename": "",
}  # fmt: skip


def settings_from_config(text: object, package: ModelConfig, defaults: ModelSettings) -> ModelSettings:
    """The settings a load's ``config`` gives the model of ``package``; the rest are ``defaults``.

    :param text: the ``config`` parameter: a JSON object in a string.
    :raises ProtocolError: it is not a JSON object, disagrees with the package, or
        holds a field or value this server does not take (each message names it).
    """
    where = f"the load's config for model {package.name!r}"
    config = load_config(text, where)
    known: tuple[str, ...] = (*APPLIED, *CHECKED, *IGNORED)
    if package.pipeline is not None and "ensemble_scheduling" in config:
        # A pipeline package's steps as Triton's ensemble configuration writes them: checked, not applied.
        check_package_scheduling(config["ensemble_scheduling"], package.pipeline, where)
        known = (*known, "ensemble_scheduling")
    for key in config:
        if key not in known:
            raise ProtocolError(
                f"{where}: field {key!r} is not one this server takes; it applies {', '.join(APPLIED)}, "
                f"checks {', '.join(CHECKED)} against the package and ignores {', '.join(IGNORED)}"
            )
    _check_names(config, package, where)
    symbol, no_batch = batch_symbol(package.input_spec, package.output_spec)
    overridden: list[str] = []

    batch = defaults.max_batch_size
    if "max_batch_size" in config:
        triton = _int(config["max_batch_size"], f"{where}: max_batch_size", 0, MAX_BATCH_SIZE)
        if triton > 1 and symbol is None:
            raise ProtocolError(
                f"{where}: max_batch_size {triton} needs a batch dimension, which this model's spec has not "
                f"({no_batch}); use 0"
            )
        batch = max(1, triton)
        overridden.append("max_batch_size")
    formats = _check_tensors(config, package, symbol, symbol is not None and batch > 1, where)
    if formats:
        overridden.append("input.format")

    delay, preferred = defaults.max_queue_delay_us, defaults.preferred_batch_sizes
    dynamic = config.get("dynamic_batching")
    if dynamic is not None:
        if not isinstance(dynamic, dict):
            raise ProtocolError(f"{where}: dynamic_batching is an object, not {type(dynamic).__name__}")
        _only(dynamic, _DYNAMIC_BATCHING, f"{where}: dynamic_batching")
        if batch <= 1:
            raise ProtocolError(f"{where}: dynamic_batching needs max_batch_size above 1 (it is {batch})")
        if "max_queue_delay_microseconds" in dynamic:
            delay = _int(
                dynamic["max_queue_delay_microseconds"],
                f"{where}: dynamic_batching.max_queue_delay_microseconds", 0, MAX_QUEUE_DELAY_US,
            )  # fmt: skip
            overridden.append("dynamic_batching.max_queue_delay_microseconds")
        if "preferred_batch_size" in dynamic:
            sizes = dynamic["preferred_batch_size"]
            field = f"{where}: dynamic_batching.preferred_batch_size"
            if not isinstance(sizes, list):
                raise ProtocolError(f"{field} is a list of batch sizes, not {type(sizes).__name__}")
            preferred = tuple(sorted({_int(n, field, 1, batch) for n in sizes}))
            overridden.append("dynamic_batching.preferred_batch_size")
        if "preserve_ordering" in dynamic and not isinstance(dynamic["preserve_ordering"], bool):
            raise ProtocolError(f"{where}: dynamic_batching.preserve_ordering is true or false")
    preferred = tuple(n for n in preferred if n <= batch)

    sequences, idle, bound = defaults.sequences, defaults.max_sequence_idle_us, defaults.max_sequences
    if "sequence_batching" in config:
        if dynamic is not None:
            # One of Triton's scheduling choices: a stateful model's requests go through its sequence batcher.
            raise ProtocolError(f"{where}: dynamic_batching and sequence_batching exclude each other; use one")
        triton_batch = _int(config.get("max_batch_size", 0), f"{where}: max_batch_size", 0, MAX_BATCH_SIZE)
        found = sequence_settings(config["sequence_batching"], triton_batch, where)
        check_listed(config, found, where)
        sequences = found.sequences
        idle = found.max_sequence_idle_us if found.max_sequence_idle_us is not None else idle
        bound = found.max_sequences if found.max_sequences is not None else bound
        if found.max_queue_delay_us is not None:
            delay = found.max_queue_delay_us
        if found.preferred_batch_sizes is not None:
            preferred = tuple(n for n in found.preferred_batch_sizes if n <= batch)
        overridden.append("sequence_batching")

    workers, device = defaults.workers, defaults.device
    groups = config.get("instance_group")
    if groups is not None:
        workers, device = _instance_group(groups, workers, device, where, overridden)
    return ModelSettings(
        max_batch_size=batch, max_queue_delay_us=delay, preferred_batch_sizes=preferred,
        workers=workers, device=device, overridden=tuple(sorted(overridden)), input_formats=formats,
        sequences=sequences, max_sequence_idle_us=idle, max_sequences=bound,
    )  # fmt: skip


def _instance_group(
    groups: object, workers: int, device: str | None, where: str, overridden: list[str]
) -> tuple[int, str | None]:
    if not isinstance(groups, list):
        raise ProtocolError(f"{where}: instance_group is a list, not {type(groups).__name__}")
    if len(groups) > 1:
        raise ProtocolError(f"{where}: instance_group has {len(groups)} groups; this server runs a model as one group")
    if not groups:
        return workers, device
    group = groups[0]
    field = f"{where}: instance_group[0]"
    if not isinstance(group, dict):
        raise ProtocolError(f"{field} is an object, not {type(group).__name__}")
    _only(group, _INSTANCE_GROUP, field)
    if "count" in group:
        workers = _int(group["count"], f"{field}.count", 1, MAX_WORKERS)
        overridden.append("instance_group[0].count")
    kind = group.get("kind", "KIND_AUTO")
    if kind not in _KINDS:
        raise ProtocolError(f"{field}.kind is one of {', '.join(_KINDS)}, not {kind!r}")
    gpus = group.get("gpus")
    if gpus is not None:
        if kind != "KIND_GPU":
            raise ProtocolError(f"{field}.gpus goes with kind KIND_GPU, not {kind}")
        if not isinstance(gpus, list) or len(gpus) != 1:
            raise ProtocolError(f"{field}.gpus names one GPU (a list of one index), not {gpus!r}")
    if kind == "KIND_CPU":
        device = "cpu"
    elif kind == "KIND_GPU":
        device = f"cuda:{_int(gpus[0], f'{field}.gpus[0]', 0, 1023) if gpus else 0}"
    if kind != "KIND_AUTO" or gpus is not None:
        overridden.append("instance_group[0].kind")
    return workers, device


def _check_names(config: dict[str, Any], package: ModelConfig, where: str) -> None:
    name = config.get("name")
    if name not in (None, "", package.name):
        raise ProtocolError(f"{where}: name {name!r} is not the model's name {package.name!r}")
    accepted = (package.platform, *TRITON_PLATFORMS.get(package.platform, ()))
    for field in ("platform", "backend"):
        value = config.get(field)
        if value not in (None, "") and value not in accepted:
            raise ProtocolError(
                f"{where}: {field} {value!r} disagrees with the package, whose platform is {package.platform!r} "
                f"(accepted: {', '.join(repr(a) for a in accepted)})"
            )


def _check_tensors(
    config: dict[str, Any], package: ModelConfig, symbol: str | None, batched: bool, where: str
) -> tuple[tuple[str, str], ...]:
    """Check the config's tensors against the package; returns the inputs' declared formats.

    :param symbol: the spec's batch dimension, if it has one.
    :param batched: whether the model is batched as configured (its batch dimension then is not an image dim).
    """
    formats: list[tuple[str, str]] = []
    for field, specs in (("input", package.input_spec), ("output", package.output_spec)):
        entries = config.get(field)
        if entries is None:
            continue
        if not isinstance(entries, list):
            raise ProtocolError(f"{where}: {field} is a list of tensors, not {type(entries).__name__}")
        by_name = {s.name: s for s in specs}
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise ProtocolError(f"{where}: {field}[{i}] is an object with a 'name'")
            spec = by_name.get(entry["name"])
            if spec is None:
                raise ProtocolError(
                    f"{where}: {field} {entry['name']!r} is not one of the model's {field}s "
                    f"({', '.join(repr(n) for n in by_name)})"
                )
            what = f"{where}: {field} {spec.name!r}"
            _check_tensor(entry, spec, symbol, what)
            for key, value in entry.items():
                if key in ("name", "data_type", "dims") or (key == "format" and field == "input"):
                    continue
                if key not in _TENSOR_DEFAULTS or value != _TENSOR_DEFAULTS[key]:
                    raise ProtocolError(
                        f"{what}: field {key!r} {'= ' + repr(value) + ' ' if key in _TENSOR_DEFAULTS else ''}"
                        f"is not one this server takes (it takes name, data_type, dims"
                        f"{', format' if field == 'input' else ''})"
                    )
            if field == "input" and "format" in entry:
                formats.append((spec.name, _format(entry["format"], spec, batched, what)))
    return tuple(formats)


def _format(value: object, spec: TensorSpec, batched: bool, where: str) -> str:
    """Triton's ``ModelInput.Format`` (its name; protobuf's JSON may also give the number)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(_FORMATS):
        value = _FORMATS[value]
    if value not in _FORMATS:
        raise ProtocolError(f"{where}: format is one of {', '.join(_FORMATS)}, not {value!r}")
    dims = list(spec.shape[1:] if batched else spec.shape)
    if value != "FORMAT_NONE" and len(dims) != 3:
        # As Triton: a layout names three dims (channels, height, width) besides the batch dimension.
        raise ProtocolError(
            f"{where}: format {value} is for an image input of 3 dims besides the batch dimension, "
            f"and this one's shape is {list(spec.shape)}"
        )
    return str(value)


def _check_tensor(entry: dict[str, Any], spec: TensorSpec, symbol: str | None, where: str) -> None:
    expected_type = "TYPE_STRING" if spec.dtype in ("string", "bytes") else f"TYPE_{oip_datatype(spec.dtype)}"
    data_type = entry.get("data_type")
    if data_type is not None and data_type != expected_type:
        raise ProtocolError(
            f"{where}: data_type {data_type!r} disagrees with the package's {spec.dtype} ({expected_type})"
        )
    dims = entry.get("dims")
    if dims is None:
        return
    full = [d if isinstance(d, int) else -1 for d in spec.shape]
    if not isinstance(dims, list):
        raise ProtocolError(f"{where}: dims is a list of whole numbers (-1: any size), not {dims!r}")
    # Each a whole number, also as protobuf's JSON writes int64 (a string of digits); never a
    # fraction, a bool or a number JSON cannot hold (1e999, -Infinity, NaN), named.
    given = [_int(d, f"{where}: dims[{i}]", -1, 1 << 62) for i, d in enumerate(dims)]
    folded = full[1:] if symbol is not None else None
    if given != full and given != folded:
        also = f" (or {folded} without the batch dimension)" if folded is not None else ""
        raise ProtocolError(
            f"{where}: dims {given} disagree with the package's shape {list(spec.shape)}, which is {full}{also}"
        )


__all__ = ["APPLIED", "CHECKED", "IGNORED", "TRITON_PLATFORMS", "settings_from_config"]
