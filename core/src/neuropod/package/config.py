"""A package's layout (the names of its files) and its ``config.json``: :class:`ModelConfig`, read and
checked by :func:`parse_config`. The bottom of :mod:`neuropod.package`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from neuropod.errors import NeuropodError, PackageError, VersionRangeError
from neuropod.pipespec import PIPELINE_PLATFORM, PipelineSpec, parse_pipeline
from neuropod.spec import TensorSpec, parse_spec
from neuropod.statespec import (
    SequenceControl,
    StatePair,
    check_state_names,
    parse_sequence_controls,
    parse_state_spec,
)
from neuropod.versions import parse_range

MANIFEST_VERSION = 1
CONFIG = "config.json"
MANIFEST = "manifest.json"
REQUIREMENTS_LOCK = "requirements.lock"
TEST_INPUTS = "test_data/inputs.npz"
TEST_EXPECTED = "test_data/expected.npz"
LEGACY_TEST_DATA = "test_data.pkl"

_KNOWN_KEYS = {
    "name",
    "platform",
    "platform_version_semver",
    "input_spec",
    "output_spec",
    "custom_ops",
    "input_tensor_device",
    "exported_with",
    "device_requirements",
    "output_labels",
    "decoupled",
    "state_spec",
    "sequence_controls",
    "pipeline",
}


@dataclass(frozen=True)
class ModelConfig:
    """The parsed ``config.json`` of a package."""

    name: str
    platform: str
    platform_version_semver: str
    input_spec: tuple[TensorSpec, ...]
    output_spec: tuple[TensorSpec, ...]
    custom_ops: tuple[str, ...] = ()
    input_tensor_device: Mapping[str, str] = field(default_factory=dict)
    exported_with: Mapping[str, Any] | None = None
    device_requirements: Mapping[str, Any] | None = None
    #: Class labels of outputs, by output name: label ``i`` names index ``i`` of a row of the
    #: output (what a server's classification answers, ``score:index:label``).
    output_labels: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: The model answers a request with any number of responses (zero or more), each a dict
    #: holding some or all of its outputs: run it with ``infer_stream``.
    decoupled: bool = False
    #: The state the runtime carries from one request of a sequence to the next (see
    #: :mod:`neuropod.statespec`); empty for a model without.
    state_spec: tuple[StatePair, ...] = ()
    #: The inputs the runtime fills with a sequence's flags and id.
    sequence_controls: tuple[SequenceControl, ...] = ()
    #: A pipeline package's steps and how they wire together (see :mod:`neuropod.pipespec`);
    #: None for a package of one model.
    pipeline: PipelineSpec | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written to ``config.json``."""
        out: dict[str, Any] = {
            "name": self.name,
            "platform": self.platform,
            "platform_version_semver": self.platform_version_semver,
            "input_spec": [s.to_dict() for s in self.input_spec],
            "output_spec": [s.to_dict() for s in self.output_spec],
            "custom_ops": list(self.custom_ops),
            "input_tensor_device": dict(self.input_tensor_device),
        }
        if self.exported_with is not None:
            out["exported_with"] = dict(self.exported_with)
        if self.device_requirements is not None:
            out["device_requirements"] = dict(self.device_requirements)
        if self.output_labels:
            out["output_labels"] = {k: list(v) for k, v in self.output_labels.items()}
        if self.decoupled:
            out["decoupled"] = True
        if self.state_spec:
            out["state_spec"] = [p.to_dict() for p in self.state_spec]
        if self.sequence_controls:
            out["sequence_controls"] = [c.to_dict() for c in self.sequence_controls]
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline.to_dict()
        out.update(self.extra)
        return out


class _RangeError(PackageError, VersionRangeError):
    """A package's (or packager call's) ``platform_version_semver`` does not parse: a
    :class:`PackageError` and a :class:`VersionRangeError`, so also the ``RuntimeError``
    the original Neuropod raised for it."""


def parse_config(data: Any, where: str) -> ModelConfig:
    """Check and read the JSON value of a ``config.json``.

    :param where: the file, for error messages.
    :raises PackageError: naming the file and the field that is wrong.
    """
    if not isinstance(data, dict):
        raise PackageError(f"{where}: the top level must be a JSON object, not {type(data).__name__}")
    for key in ("name", "platform", "input_spec", "output_spec"):
        if key not in data:
            raise PackageError(f"{where}: required field {key!r} is missing")
    name, platform = data["name"], data["platform"]
    if not isinstance(name, str) or not name:
        raise PackageError(f"{where}: 'name' must be a non-empty string, not {name!r}")
    if not isinstance(platform, str) or not platform:
        raise PackageError(f"{where}: 'platform' must be a non-empty string such as 'onnx', not {platform!r}")
    semver = data.get("platform_version_semver", "*")
    if semver is None:
        semver = "*"
    if not isinstance(semver, str):
        raise PackageError(f"{where}: 'platform_version_semver' must be a string such as '^1.20', not {semver!r}")
    try:
        parse_range(semver)
    except NeuropodError as e:
        raise _RangeError(f"{where}: platform_version_semver: {e}") from None
    # Only a missing or null field means "none": `or []` would let "", 0 or {} through.
    custom_ops = data.get("custom_ops")
    if custom_ops is None:
        custom_ops = []
    if not isinstance(custom_ops, list) or not all(isinstance(o, str) and _is_plain_name(o) for o in custom_ops):
        raise PackageError(f"{where}: 'custom_ops' must be a list of file names in 0/ops/, not {custom_ops!r}")
    devices = data.get("input_tensor_device")
    if devices is None:
        devices = {}
    if not isinstance(devices, dict) or not all(isinstance(v, str) for v in devices.values()):
        raise PackageError(f"{where}: 'input_tensor_device' must map input names to \"CPU\" or \"GPU\"")
    for key in ("exported_with", "device_requirements"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise PackageError(f"{where}: {key!r} must be an object, not {type(data[key]).__name__}")
    output_spec = parse_spec(data["output_spec"], f"{where}: output_spec")
    decoupled = data.get("decoupled", False)
    if decoupled is None:
        decoupled = False
    if not isinstance(decoupled, bool):
        raise PackageError(f"{where}: 'decoupled' must be true or false, not {decoupled!r}")
    input_spec = parse_spec(data["input_spec"], f"{where}: input_spec")
    state_spec = parse_state_spec(data.get("state_spec"), input_spec, output_spec, f"{where}: state_spec")
    controls = parse_sequence_controls(data.get("sequence_controls"), input_spec, f"{where}: sequence_controls")
    check_state_names(state_spec, controls, where)
    if decoupled and (state_spec or controls):
        raise PackageError(f"{where}: a decoupled model cannot also carry sequence state or controls")
    pipeline = parse_pipeline(data.get("pipeline"), f"{where}: pipeline")
    if (pipeline is None) != (platform != PIPELINE_PLATFORM):
        raise PackageError(
            f"{where}: a package of platform {PIPELINE_PLATFORM!r} needs a 'pipeline' block, and only such a package has one"
        )
    if pipeline is not None and (state_spec or controls):
        raise PackageError(f"{where}: a pipeline carries no state of its own; its stateful steps declare theirs")
    return ModelConfig(
        name=name,
        platform=platform,
        platform_version_semver=semver,
        input_spec=input_spec,
        output_spec=output_spec,
        custom_ops=tuple(custom_ops),
        input_tensor_device=dict(devices),
        exported_with=data.get("exported_with"),
        device_requirements=data.get("device_requirements"),
        output_labels=parse_output_labels(data.get("output_labels"), output_spec, f"{where}: output_labels"),
        decoupled=decoupled,
        state_spec=state_spec,
        sequence_controls=controls,
        pipeline=pipeline,
        extra={k: v for k, v in data.items() if k not in _KNOWN_KEYS},
    )


def parse_output_labels(value: Any, output_spec: Iterable[TensorSpec], where: str) -> dict[str, tuple[str, ...]]:
    """Check ``output_labels`` (``config.json``, or the packager option of that name): an object of
    output name to a list of label strings, one per class index. Absent or null: no labels.

    :raises PackageError: not such an object, an unknown output, a label that is not a string
        (or holds a line break), or a string output (classification needs numbers).
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PackageError(f"{where} must map output names to lists of class labels, not {type(value).__name__}")
    outputs = {s.name: s for s in output_spec}
    labels: dict[str, tuple[str, ...]] = {}
    for name, entries in value.items():
        spec = outputs.get(name)
        if spec is None:
            raise PackageError(
                f"{where}: {name!r} is not an output of the model; its outputs are: {', '.join(outputs) or '(none)'}"
            )
        if spec.dtype == "string":
            raise PackageError(f"{where}: output {name!r} is a string tensor; class labels name the indices of numbers")
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence) or not entries:
            raise PackageError(f"{where}: the labels of output {name!r} must be a non-empty list of strings")
        for i, label in enumerate(entries):
            if not isinstance(label, str) or "\n" in label or "\r" in label:
                raise PackageError(
                    f"{where}: label {i} of output {name!r} must be a string without line breaks, not {label!r:.80}"
                )
        labels[name] = tuple(entries)
    return labels


def _is_plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


__all__ = [
    "CONFIG",
    "LEGACY_TEST_DATA",
    "MANIFEST",
    "MANIFEST_VERSION",
    "REQUIREMENTS_LOCK",
    "TEST_EXPECTED",
    "TEST_INPUTS",
    "ModelConfig",
    "parse_config",
    "parse_output_labels",
]
