"""ONNX Runtime backend for Neuropod (platform ``onnx``).

This module holds the hook implementations. It imports no framework:
``onnxruntime`` is imported in :func:`load_model` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from neuropod import hookimpl
from neuropod.backend import (
    Backend,
    DeviceCaps,
    cuda_from_requirements,
    installed_distributions,
    shared_module_warning,
)

if TYPE_CHECKING:
    import numpy as np

    from neuropod.package import Package

PLATFORM = "onnx"

#: Distributions that provide the ``onnxruntime`` module, best first. They
#: install the same module, so only one of them can be imported.
FRAMEWORK_DISTRIBUTIONS = ("onnxruntime-gpu", "onnxruntime", "onnxruntime-openvino", "onnxruntime-directml")
_GPU_DISTRIBUTIONS = {"onnxruntime-gpu"}


def _installed() -> list[tuple[str, str]]:
    """(distribution, version) of every installed onnxruntime build, best first."""
    return installed_distributions(*FRAMEWORK_DISTRIBUTIONS)


@hookimpl
def supported_versions() -> list[Backend]:
    """The installed ONNX Runtime build, read from package metadata."""
    found = _installed()
    if not found:
        return []
    dist, version = found[0]
    return [Backend(platform=PLATFORM, version=version, framework=dist)]


@hookimpl
def device_caps(backend: Backend) -> DeviceCaps | None:
    """CPU always; CUDA for ``onnxruntime-gpu``.

    The CUDA major version is the one the wheel's own metadata asks for (its
    ``cuda`` extra requires ``nvidia-cuda-runtime~=13.0``, or
    ``nvidia-cuda-runtime-cu12`` before), ``"unknown"`` when it names none: no
    table of releases to fall out of date. Which GPUs really work is only
    known when the CUDA provider loads, and loading reports it (never falling
    back to the CPU in silence). Two builds installed together (they own the
    same ``onnxruntime`` module) get a warning.
    """
    if backend.platform != PLATFORM:
        return None
    warning = shared_module_warning(_installed(), "onnxruntime")
    if backend.framework in _GPU_DISTRIBUTIONS:
        cuda = cuda_from_requirements(backend.framework) or "unknown"
        note = "" if cuda != "unknown" else "its metadata names no CUDA runtime; the driver is not checked against it"
        return DeviceCaps(cpu=True, cuda=cuda, note=note, warning=warning, device_tensors=True)
    return DeviceCaps(cpu=True, warning=warning, device_tensors=True)


@hookimpl
def load_model(package: Package, backend: Backend, device: str, options: Mapping[str, Any]) -> Any:
    """Create an ONNX Runtime session for the package on ``device``."""
    if backend.platform != PLATFORM:
        return None
    from neuropod.strings import refuse_dtypes  # lazy: numpy, kept out of plugin discovery

    refuse_dtypes(package.name, package.config.input_spec, package.config.output_spec, {"bytes"}, PLATFORM)
    # lazy: onnxruntime and numpy, kept out of `import neuropod_onnx` (plugin discovery)
    from neuropod_onnx._runtime import OnnxModel

    return OnnxModel.load(package, device, options)


@hookimpl
def infer(
    model: Any, inputs: Mapping[str, np.ndarray], requested_outputs: Sequence[str] | None, output_device: str | None
) -> Any:
    """Run the session on the inputs (numpy arrays, or tensors on the model's GPU through IO binding)."""
    return model.run(inputs, requested_outputs, output_device)


__all__ = ["PLATFORM", "device_caps", "infer", "load_model", "supported_versions"]
