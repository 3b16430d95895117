"""The exceptions Neuropod raises.

Every error a user can cause (a bad package, a tensor that does not fit the
spec, a range nobody can satisfy) is a :class:`NeuropodError`, so callers can
catch one type. A framework's own exception is chained as ``__cause__``.
"""

from __future__ import annotations


class NeuropodError(Exception):
    """Base class of every error Neuropod raises on purpose."""


class PackageError(NeuropodError):
    """A package is missing, malformed, unsafe or has been changed on disk."""


class SpecError(NeuropodError):
    """A tensor does not fit the model's input or output spec."""


class VersionRangeError(NeuropodError, ValueError):
    """A version range string cannot be parsed."""


class NoBackendError(NeuropodError):
    """No installed backend can run the package on this host."""


class PluginNotInstalledError(NoBackendError, ImportError):
    """A feature needs a backend plugin that is not installed.

    Also an :class:`ImportError`, so ``from neuropod.packagers import
    create_x_neuropod`` fails the way Python users expect.
    """


class BackendError(NeuropodError):
    """The framework failed while loading or running a model."""


class WorkerError(NeuropodError):
    """A worker process running a model failed."""


__all__ = [
    "BackendError",
    "NeuropodError",
    "NoBackendError",
    "PackageError",
    "PluginNotInstalledError",
    "SpecError",
    "VersionRangeError",
    "WorkerError",
]
