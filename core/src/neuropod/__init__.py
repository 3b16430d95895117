"""Neuropod: one interface to run a machine-learning model, whatever framework built it.

``import neuropod`` is cheap and imports no framework (and not even numpy):
the public names below that need more are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from neuropod._version import __version__
from neuropod.errors import (
    BackendError,
    NeuropodError,
    NoBackendError,
    PackageError,
    PipelineStepError,
    PluginNotInstalledError,
    RemoteError,
    SequenceError,
    SequenceLimitError,
    SpecError,
    VersionRangeError,
    WorkerError,
)
from neuropod.hookspecs import hookimpl

if TYPE_CHECKING:
    from neuropod.backend import Backend, DeviceCaps
    from neuropod.comparison import compare
    from neuropod.loader import load_neuropod, plan
    from neuropod.model import NeuropodModel
    from neuropod.package import Package, read_package
    from neuropod.spec import TensorSpec

_LAZY = {
    "Backend": "neuropod.backend",
    "DeviceCaps": "neuropod.backend",
    "NeuropodModel": "neuropod.model",
    "compare": "neuropod.comparison",
    "load_neuropod": "neuropod.loader",
    "plan": "neuropod.loader",
    "Package": "neuropod.package",
    "read_package": "neuropod.package",
    "TensorSpec": "neuropod.spec",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'neuropod' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Backend",
    "BackendError",
    "DeviceCaps",
    "NeuropodError",
    "NeuropodModel",
    "NoBackendError",
    "Package",
    "PackageError",
    "PipelineStepError",
    "PluginNotInstalledError",
    "RemoteError",
    "SequenceError",
    "SequenceLimitError",
    "SpecError",
    "TensorSpec",
    "VersionRangeError",
    "WorkerError",
    "__version__",
    "compare",
    "hookimpl",
    "load_neuropod",
    "plan",
    "read_package",
]
