"""NVIDIA TensorRT backend for Neuropod (platform ``tensorrt``).

This module holds the hook implementations. It imports neither TensorRT nor
a CUDA binding: those are imported in :func:`load_model` only, so this
plugin installs and plans deployments on machines without a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps, installed_distribution

if TYPE_CHECKING:
    import numpy as np

    from neuropod.package import Package

PLATFORM = "tensorrt"

#: Distributions that provide the ``tensorrt`` module: the CUDA-specific
#: bindings of TensorRT 10+, then the single wheel of older releases.
FRAMEWORK_DISTRIBUTIONS = (
    "tensorrt-cu13-bindings",
    "tensorrt-cu12-bindings",
    "tensorrt-cu11-bindings",
    "tensorrt",
)

_CUDA_IN_NAME = re.compile(r"-cu(\d+)")


@hookimpl
def supported_versions() -> list[Backend]:
    """The installed TensorRT Python bindings, read from their ``.dist-info`` folder."""
    found = installed_distribution(*FRAMEWORK_DISTRIBUTIONS)
    return [Backend(platform=PLATFORM, version=found[1], framework=found[0])] if found else []


@hookimpl
def device_caps(backend: Backend) -> DeviceCaps | None:
    """GPU only, with the CUDA major version the bindings were built for (``-cu12`` in the name).

    The compute capabilities a package can run on are the engine's, recorded
    in the package (``device_requirements``), so they are checked per
    package during resolution rather than listed here.
    """
    if backend.platform != PLATFORM:
        return None
    m = _CUDA_IN_NAME.search(backend.framework)
    return DeviceCaps(
        cpu=False,
        cuda=m.group(1) if m else "12",
        note="an engine runs only on GPUs of the compute capability it was built for",
    )


@hookimpl
def load_model(package: Package, backend: Backend, device: str, options: Mapping[str, Any]) -> Any:
    """Deserialize the package's engine onto ``device`` (a GPU)."""
    if backend.platform != PLATFORM:
        return None
    from neuropod.strings import refuse_dtypes  # lazy: numpy, kept out of plugin discovery

    refuse_dtypes(package.name, package.config.input_spec, package.config.output_spec, {"bytes"}, PLATFORM)
    # lazy: numpy, kept out of `import neuropod_tensorrt` (plugin discovery)
    from neuropod_tensorrt._runtime import TensorRTModel

    return TensorRTModel.load(package, device, options)


@hookimpl
def infer(model: Any, inputs: Mapping[str, np.ndarray], requested_outputs: Sequence[str] | None) -> Any:
    """Run the engine on the inputs."""
    return model.run(inputs, requested_outputs)


__all__ = ["PLATFORM", "device_caps", "infer", "load_model", "supported_versions"]
