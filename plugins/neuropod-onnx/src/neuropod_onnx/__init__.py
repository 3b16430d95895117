"""ONNX Runtime backend for Neuropod (platform ``onnx``).

This module holds the hook implementations. It imports no framework:
``onnxruntime`` is imported in :func:`load_model` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps, installed_distribution

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
    return [found for dist in FRAMEWORK_DISTRIBUTIONS if (found := installed_distribution(dist))]


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

    The CUDA major version is inferred from the release: ``onnxruntime-gpu``
    on PyPI targets CUDA 12 from 1.19 on and CUDA 11.8 before. Which GPUs
    really work is only known when the CUDA provider loads, and loading
    reports it (never falling back to the CPU in silence).
    """
    if backend.platform != PLATFORM:
        return None
    others = [d for d, _ in _installed() if d != backend.framework]
    note = f"also installed: {', '.join(others)} (they share one module; keep one)" if others else ""
    if backend.framework in _GPU_DISTRIBUTIONS:
        cuda = "12" if Version(backend.version).release >= (1, 19) else "11.8"
        return DeviceCaps(cpu=True, cuda=cuda, note=note)
    return DeviceCaps(cpu=True, note=note)


@hookimpl
def load_model(package: Package, backend: Backend, device: str, options: Mapping[str, Any]) -> Any:
    """Create an ONNX Runtime session for the package on ``device``."""
    if backend.platform != PLATFORM:
        return None
    from neuropod_onnx._runtime import OnnxModel

    return OnnxModel.load(package, device, options)


@hookimpl
def infer(model: Any, inputs: Mapping[str, np.ndarray], requested_outputs: Sequence[str] | None) -> Any:
    """Run the session on the inputs."""
    return model.run(inputs, requested_outputs)


__all__ = ["PLATFORM", "device_caps", "infer", "load_model", "supported_versions"]
