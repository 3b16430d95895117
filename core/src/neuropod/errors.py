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


class RemoteError(NeuropodError):
    """A remote model (``load_neuropod("grpc://...")``) failed: the server could not be
    reached or answered with an error.

    :ivar url: the URL of the server that failed (one of the model's URLs).
    :ivar code: what went wrong, as a gRPC status name in lower case, whatever
        the protocol: ``"unavailable"`` (refused, reset, unreachable),
        ``"deadline_exceeded"`` (the call's timeout), ``"not_found"`` (unknown
        model), ``"invalid_argument"`` (the server refused the inputs),
        ``"unauthenticated"``, ``"internal"`` (the model failed on the server),
        ``"tls"`` (the TLS handshake failed), ``"protocol"`` (an answer that does
        not follow the Open Inference Protocol).
    :ivar server_message: the server's own words, when it answered.
    """

    def __init__(self, message: str, *, url: str = "", code: str = "unknown", server_message: str | None = None):
        super().__init__(message)
        self.url = url
        self.code = code
        self.server_message = server_message


__all__ = [
    "BackendError",
    "NeuropodError",
    "NoBackendError",
    "PackageError",
    "PluginNotInstalledError",
    "RemoteError",
    "SpecError",
    "VersionRangeError",
    "WorkerError",
]
