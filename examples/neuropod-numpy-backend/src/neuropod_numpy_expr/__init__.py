"""A Neuropod backend for platform ``numpy-expr``: each output is a numpy
expression of the inputs, stored in the package as ``0/data/model.json``
(``{"outputs": {"out": "x + y"}}``).

This module holds the four hook implementations. Like every backend, it
imports no framework at module level: numpy is imported in ``load_model``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps, installed_distribution

if TYPE_CHECKING:
    import numpy as np

    from neuropod.package import Package

PLATFORM = "numpy-expr"
MODEL_FILE = "model.json"


@hookimpl
def supported_versions() -> list[Backend]:
    """numpy is the framework: its installed version, read from package metadata."""
    found = installed_distribution("numpy")
    return [Backend(platform=PLATFORM, version=found[1], framework=found[0])] if found else []


@hookimpl
def device_caps(backend: Backend) -> DeviceCaps | None:
    """numpy runs on the CPU only."""
    if backend.platform != PLATFORM:
        return None
    return DeviceCaps(cpu=True)


@hookimpl
def load_model(package: Package, backend: Backend, device: str, options: Mapping[str, Any]) -> Any:
    """Read and compile the package's expressions."""
    if backend.platform != PLATFORM:
        return None
    from neuropod_numpy_expr._model import ExprModel

    return ExprModel.load(package, device, options)


@hookimpl
def infer(model: Any, inputs: Mapping[str, np.ndarray], requested_outputs: Sequence[str] | None) -> Any:
    """Evaluate the requested outputs' expressions."""
    return model.run(inputs, requested_outputs)


__all__ = ["MODEL_FILE", "PLATFORM", "device_caps", "infer", "load_model", "supported_versions"]
