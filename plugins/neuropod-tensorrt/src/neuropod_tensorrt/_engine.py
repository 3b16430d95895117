"""What a package records about its TensorRT engine, and the checks that need no GPU.

A serialized engine runs only with the TensorRT version that built it and,
unless it was built hardware-compatible, only on GPUs of the compute
capability it was built on. The package records both (``exported_with`` and
``device_requirements`` in ``config.json``) so that resolution can reject a
host before anything is loaded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from neuropod.errors import NeuropodError, SpecError
from neuropod.spec import TensorSpec

ENGINE_PATH = "0/data/model.engine"
_CC = re.compile(r"\d{1,2}\.\d")

#: TensorRT's hardware-compatibility levels (``trt.HardwareCompatibilityLevel``).
HARDWARE_COMPATIBILITY = {"none", "ampere_plus", "same_compute_capability"}


@dataclass(frozen=True)
class EngineInfo:
    """The facts about an engine that resolution and loading need."""

    tensorrt_version: str
    compute_capability: str
    hardware_compatibility: str = "none"
    min_free_memory: int | None = None

    def __post_init__(self) -> None:
        try:
            Version(self.tensorrt_version)
        except InvalidVersion:
            raise NeuropodError(f"tensorrt_version {self.tensorrt_version!r} is not a version such as '10.3.0'") from None
        if not _CC.fullmatch(self.compute_capability):
            raise NeuropodError(f"compute_capability {self.compute_capability!r} must look like '8.0' or '8.6'")
        if self.hardware_compatibility not in HARDWARE_COMPATIBILITY:
            raise NeuropodError(
                f"hardware_compatibility {self.hardware_compatibility!r} must be one of {sorted(HARDWARE_COMPATIBILITY)}"
            )
        if self.min_free_memory is not None and (not isinstance(self.min_free_memory, int) or self.min_free_memory < 0):
            raise NeuropodError(f"min_free_memory must be a number of bytes >= 0, not {self.min_free_memory!r}")

    def default_range(self) -> str:
        """The versions the engine can run on: the same TensorRT major.minor (``~10.3``)."""
        release = Version(self.tensorrt_version).release
        return f"~{release[0]}.{release[1] if len(release) > 1 else 0}"

    def device_requirements(self) -> dict[str, Any]:
        """The ``device_requirements`` entry of ``config.json``."""
        req: dict[str, Any] = {"device": "gpu", "compute_capability": self.compute_capability}
        if self.hardware_compatibility == "ampere_plus":
            # Runs on any Ampere or newer GPU: resolution must not pin the build's CC.
            req["hardware_compatible"] = "ampere_plus"
            req["min_compute_capability"] = "8.0"
        if self.min_free_memory is not None:
            req["min_free_memory"] = self.min_free_memory
        return req


def check_io(
    engine_io: Mapping[str, tuple[str, str, tuple[int, ...]]],
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    where: str,
) -> None:
    """The spec and the engine must agree on tensor names, modes, dtypes and ranks.

    :param engine_io: tensor name -> (``"input"``/``"output"``, numpy dtype
        name, engine shape with -1 for dynamic dims), as read from the engine.
    """
    for kind, specs in (("input", inputs), ("output", outputs)):
        engine_names = [n for n, (mode, _, _) in engine_io.items() if mode == kind]
        spec_names = [s.name for s in specs]
        if sorted(engine_names) != sorted(spec_names):
            raise SpecError(
                f"{where}: the {kind} spec has {', '.join(map(repr, spec_names)) or 'nothing'}, the engine's "
                f"{kind} tensors are {', '.join(map(repr, engine_names)) or 'none'}"
            )
        for spec in specs:
            _, dtype, shape = engine_io[spec.name]
            if dtype != spec.dtype:
                raise SpecError(f"{where}: {kind} {spec.name!r} is {spec.dtype} in the spec, {dtype} in the engine")
            if len(shape) != len(spec.shape):
                raise SpecError(
                    f"{where}: {kind} {spec.name!r} has {len(spec.shape)} dims {spec.describe_shape()} in the spec, "
                    f"{len(shape)} dims {list(shape)} in the engine"
                )
            for axis, (want, have) in enumerate(zip(spec.shape, shape)):
                if isinstance(want, int) and have not in (-1, want):
                    raise SpecError(
                        f"{where}: {kind} {spec.name!r} dim {axis} is {want} in the spec, {have} in the engine"
                    )
