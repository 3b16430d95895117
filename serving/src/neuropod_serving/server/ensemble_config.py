"""Triton's ensemble configuration in its JSON form: read from a repository load, written for a
served pipeline.

A load whose ``config`` has ``platform: "ensemble"`` (or ``backend: "ensemble"``, or an
``ensemble_scheduling`` block) under a name that is no package of the repository makes a pipeline
of models the server already serves (:mod:`~neuropod_serving.server.ensembles`). What is read here
(:func:`parse_ensemble`), as Triton's ``ModelConfig`` with ``ModelEnsembling``:

- ``name`` (the load's model name, or absent), ``platform`` ``"ensemble"``, ``backend`` ``""`` or ``"ensemble"``;
- ``max_batch_size``: above 0, every input and output gets a leading batch dimension (the symbol
  ``batch_size``) that ``dims`` leave out, as in Triton, and the server may batch the ensemble's
  requests (up to that many rows, and the server's ``--max-batch-size``); 0: no batch dimension;
- ``input`` / ``output``: ``name``, ``data_type`` (``TYPE_*``; ``TYPE_STRING`` is a ``bytes`` tensor
  where the step it feeds, or that makes it, takes bytes, else a ``string`` one), ``dims`` (-1: any size);
- ``ensemble_scheduling``: ``step`` (each ``model_name``, ``model_version`` -1 for the latest loaded
  version or a version number, ``input_map`` {model input: ensemble tensor}, ``output_map`` {model
  output: ensemble tensor}, ``model_namespace`` empty) and ``max_inflight_requests`` (the most
  requests running inside the ensemble at once; 0: no bound);
- Triton's fields about how its own backends treat files and versions are ignored (those
  :data:`~neuropod_serving.server.config_override.IGNORED` lists); any other field is refused, naming it.

Every refusal is a :class:`~neuropod_serving.protocol.ProtocolError` (400, gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from neuropod import _json
from neuropod.pipespec import PipelineSpec
from neuropod_serving.protocol import ProtocolError
from neuropod_serving.server.sequence_config import DTYPES, only_fields, whole_number

#: The platform (and backend) name of Triton's ensembles.
ENSEMBLE = "ensemble"
#: The batch dimension's symbol that ``max_batch_size`` above 0 adds to every tensor.
BATCH_SYMBOL = "batch_size"
#: Triton fields an ensemble configuration may carry that the server ignores (as for any model).
_IGNORED = (
    "version_policy", "optimization", "parameters", "model_warmup", "response_cache",
    "default_model_filename", "cc_model_filenames", "metric_tags", "runtime",
)  # fmt: skip
_FIELDS = ("name", "platform", "backend", "max_batch_size", "input", "output", "ensemble_scheduling", *_IGNORED)
_SCHEDULING = ("step", "max_inflight_requests")
_STEP = ("model_name", "model_version", "input_map", "output_map", "model_namespace")
_TENSOR = ("name", "data_type", "dims", "format", "optional", "is_shape_tensor", "allow_ragged_batch",
           "is_non_linear_format_io", "label_filename")  # fmt: skip
_TENSOR_DEFAULTS = {"format": ("FORMAT_NONE", 0), "optional": (False,), "is_shape_tensor": (False,),
                    "allow_ragged_batch": (False,), "is_non_linear_format_io": (False,), "label_filename": ("",)}  # fmt: skip
#: The most requests ``max_inflight_requests`` may bound (Triton's is a uint32).
MAX_INFLIGHT = 1 << 20


@dataclass(frozen=True)
class EnsembleStep:
    """One step of an ensemble configuration: a served model and its tensors' names."""

    #: The step's name in the pipeline: its model's name (``name#2``... for a model used again).
    name: str
    model_name: str
    #: The model's version; None: its latest loaded version (Triton's -1).
    version: str | None
    input_map: Mapping[str, str]
    output_map: Mapping[str, str]


@dataclass(frozen=True)
class EnsembleTensor:
    """An ``input`` or ``output`` of an ensemble configuration."""

    name: str
    #: Triton's ``TYPE_*`` name.
    data_type: str
    #: Its dims besides the batch dimension (-1: any size).
    dims: tuple[int, ...]


@dataclass(frozen=True)
class EnsembleConfig:
    """An ensemble configuration, read (see the module's docstring)."""

    name: str
    steps: tuple[EnsembleStep, ...]
    inputs: tuple[EnsembleTensor, ...]
    outputs: tuple[EnsembleTensor, ...]
    max_batch_size: int
    max_inflight_requests: int

    @property
    def models(self) -> tuple[str, ...]:
        """The served models it composes, each once."""
        return tuple(dict.fromkeys(s.model_name for s in self.steps))


def load_config(text: object, where: str) -> dict[str, Any]:
    """A load's ``config`` parameter as a JSON object. :raises ProtocolError: it is not one."""
    if not isinstance(text, str):
        raise ProtocolError(f"{where} is Triton's model configuration as a JSON string, not {type(text).__name__}")
    try:
        config = _json.loads(text)
    except ValueError as e:
        raise ProtocolError(f"{where} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ProtocolError(f"{where} is a JSON object (Triton's model configuration), not {type(config).__name__}")
    return config


def is_ensemble(config: Mapping[str, Any]) -> bool:
    """Whether a load's config is an ensemble's (its platform or backend, or its scheduling, says so)."""
    return ENSEMBLE in (config.get("platform"), config.get("backend")) or "ensemble_scheduling" in config


def parse_ensemble(config: Mapping[str, Any], name: str) -> EnsembleConfig:
    """Read the ensemble configuration of model ``name`` (a JSON object, see the module's docstring).

    :raises ProtocolError: a field or value this server does not take, named.
    """
    where = f"the ensemble configuration of model {name!r}"
    only_fields(config, _FIELDS, where)
    if config.get("name") not in (None, "", name):
        raise ProtocolError(f"{where}: name {config['name']!r} is not the name it is loaded as ({name!r})")
    for field, allowed in (("platform", ("", ENSEMBLE)), ("backend", ("", ENSEMBLE))):
        if config.get(field, "") not in allowed:
            raise ProtocolError(f'{where}: {field} {config[field]!r} is not an ensemble\'s ("ensemble")')
    batch = whole_number(config.get("max_batch_size", 0), f"{where}: max_batch_size", 0, 1 << 31)
    scheduling = config.get("ensemble_scheduling")
    if not isinstance(scheduling, dict):
        raise ProtocolError(f"{where}: ensemble_scheduling is an object with the ensemble's steps ('step')")
    only_fields(scheduling, _SCHEDULING, f"{where}: ensemble_scheduling")
    entries = scheduling.get("step")
    if not isinstance(entries, list) or not entries:
        raise ProtocolError(f"{where}: ensemble_scheduling.step is a list of at least one step")
    steps: list[EnsembleStep] = []
    used: dict[str, int] = {}
    for i, entry in enumerate(entries):
        here = f"{where}: ensemble_scheduling.step[{i}]"
        if not isinstance(entry, dict):
            raise ProtocolError(f"{here} is an object, not {type(entry).__name__}")
        only_fields(entry, _STEP, here)
        model = entry.get("model_name")
        if not isinstance(model, str) or not model:
            raise ProtocolError(f"{here}.model_name is the name of a model this server serves")
        if entry.get("model_namespace", "") != "":
            raise ProtocolError(
                f"{here}.model_namespace is not supported (this server has one namespace); leave it out"
            )
        version = whole_number(entry.get("model_version", -1), f"{here}.model_version", -1, 1 << 62)
        maps = [_tensor_map(entry.get(key), f"{here}.{key}") for key in ("input_map", "output_map")]
        used[model] = used.get(model, 0) + 1
        step_name = model if used[model] == 1 else f"{model}#{used[model]}"
        steps.append(EnsembleStep(step_name, model, None if version == -1 else str(version), *maps))
    inflight = whole_number(scheduling.get("max_inflight_requests", 0),
                            f"{where}: ensemble_scheduling.max_inflight_requests", 0, MAX_INFLIGHT)  # fmt: skip
    tensors = [_tensors(config.get(field), f"{where}: {field}") for field in ("input", "output")]
    return EnsembleConfig(name, tuple(steps), tensors[0], tensors[1], batch, inflight)


def _tensor_map(value: object, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ProtocolError(f"{where} is an object of tensor names (model tensor -> ensemble tensor), not {value!r}")
    return dict(value)


def _tensors(entries: object, where: str) -> tuple[EnsembleTensor, ...]:
    if not isinstance(entries, list) or not entries:
        raise ProtocolError(f"{where} is a list of at least one tensor ({{name, data_type, dims}})")
    out: list[EnsembleTensor] = []
    for i, entry in enumerate(entries):
        here = f"{where}[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ProtocolError(f"{here} is an object with a 'name'")
        only_fields(entry, _TENSOR, here)
        for key, accepted in _TENSOR_DEFAULTS.items():
            if key in entry and entry[key] not in accepted:
                raise ProtocolError(f"{here}.{key} {entry[key]!r} is not supported by an ensemble here (leave it out)")
        data_type = entry.get("data_type")
        if data_type not in DTYPES:
            raise ProtocolError(f"{here}.data_type is one of Triton's TYPE_* names, not {data_type!r}")
        dims = entry.get("dims")
        if not isinstance(dims, list):
            raise ProtocolError(f"{here}.dims is a list of whole numbers (-1: any size)")
        out.append(EnsembleTensor(entry["name"], data_type,
                                  tuple(whole_number(d, f"{here}.dims", -1, 1 << 62) for d in dims)))  # fmt: skip
    return tuple(out)


def spec_entries(tensors: tuple[EnsembleTensor, ...], batched: bool, dtypes: Mapping[str, str]) -> list[dict[str, Any]]:
    """The spec entries of an ensemble's tensors (``dtypes``: the dtype a ``TYPE_STRING`` tensor
    takes from its step, by name; ``string`` when not given)."""
    entries = []
    for t in tensors:
        dtype = DTYPES[t.data_type]
        if dtype == "string":
            dtype = dtypes.get(t.name, "string")
        shape: list[Any] = [None if d == -1 else d for d in t.dims]
        entries.append({"name": t.name, "dtype": dtype, "shape": [BATCH_SYMBOL, *shape] if batched else shape})
    return entries


def ensemble_scheduling(steps: list[dict[str, Any]], spec: PipelineSpec) -> dict[str, Any]:
    """The ``ensemble_scheduling`` block of a served pipeline's model configuration.

    :param steps: each step's ``model_name`` and ``model_version`` (-1: the latest), in the pipeline's order.
    """
    block: dict[str, Any] = {"step": [
        {**named, "input_map": dict(step.input_map), "output_map": dict(step.output_map)}
        for named, step in zip(steps, spec.steps)
    ]}  # fmt: skip
    if spec.max_inflight_requests:
        block["max_inflight_requests"] = spec.max_inflight_requests
    return block


def check_package_scheduling(block: object, spec: PipelineSpec, where: str) -> None:
    """A pipeline package's load config may hold its ``ensemble_scheduling``: the same steps
    (``model_name``: the step's name), maps and ``max_inflight_requests`` as the package's.

    :raises ProtocolError: it says otherwise (the package decides its steps).
    """
    mine = ensemble_scheduling([{"model_name": s.name, "model_version": -1} for s in spec.steps], spec)
    if not isinstance(block, dict):
        raise ProtocolError(f"{where}: ensemble_scheduling is an object, not {type(block).__name__}")
    given = block.get("step")
    if not isinstance(given, list) or len(given) != len(mine["step"]):
        raise ProtocolError(f"{where}: ensemble_scheduling.step disagrees with the pipeline package's steps "
                            f"({', '.join(s.name for s in spec.steps)})")  # fmt: skip
    for i, (theirs, ours) in enumerate(zip(given, mine["step"])):
        if not isinstance(theirs, dict):
            raise ProtocolError(f"{where}: ensemble_scheduling.step[{i}] is an object")
        version = theirs.get("model_version", -1)
        same = (theirs.get("model_name") == ours["model_name"] and str(version) == "-1"
                and dict(theirs.get("input_map") or {}) == ours["input_map"]
                and dict(theirs.get("output_map") or {}) == ours["output_map"])  # fmt: skip
        if not same:
            raise ProtocolError(
                f"{where}: ensemble_scheduling.step[{i}] disagrees with the pipeline package's step "
                f"{ours['model_name']!r} (model_version -1, input_map {ours['input_map']}, output_map "
                f"{ours['output_map']}); the package decides its steps"
            )
    inflight = block.get("max_inflight_requests", spec.max_inflight_requests)
    if str(inflight) != str(spec.max_inflight_requests):
        raise ProtocolError(f"{where}: ensemble_scheduling.max_inflight_requests {inflight!r} disagrees with the "
                            f"package's {spec.max_inflight_requests}")  # fmt: skip


__all__ = [
    "BATCH_SYMBOL",
    "ENSEMBLE",
    "EnsembleConfig",
    "EnsembleStep",
    "EnsembleTensor",
    "check_package_scheduling",
    "ensemble_scheduling",
    "is_ensemble",
    "load_config",
    "parse_ensemble",
    "spec_entries",
]
