"""The exceptions Neuropod raises.

Every error a user can cause (a bad package, a tensor that does not fit the
spec, a range nobody can satisfy) is a :class:`NeuropodError`, so callers can
catch one type. A framework's own exception is chained as ``__cause__``.

Each class is also the builtin exception the original Neuropod (0.3) raised
for the same fault, so code written for it keeps its ``except`` clauses:
``ValueError`` for a package or packager argument that is wrong (including
test data that a new package does not reproduce) and ``RuntimeError`` for
what its C++ core reported (no backend for a version range, a tensor that
does not fit the spec, a model that fails to load or run).
"""

from __future__ import annotations


class NeuropodError(Exception):
    """Base class of every error Neuropod raises on purpose."""


class PackageError(NeuropodError, ValueError):
    """A package is missing, malformed, unsafe or has been changed on disk, or a
    packager's arguments (or test data) do not make a sound package.

    Also a :class:`ValueError`, as the original Neuropod's packagers raised.
    """


class SpecError(NeuropodError, RuntimeError):
    """A tensor does not fit the model's input or output spec.

    Also a :class:`RuntimeError`, as the original Neuropod's core raised.
    """


class VersionRangeError(NeuropodError, ValueError, RuntimeError):
    """A version range string cannot be parsed.

    A :class:`ValueError`, and a :class:`RuntimeError` as the original
    Neuropod raised for a bad ``platform_version_semver``.
    """


class NoBackendError(NeuropodError, RuntimeError):
    """No installed backend can run the package on this host.

    Also a :class:`RuntimeError`, as the original Neuropod raised.
    """


class PluginNotInstalledError(NoBackendError, ImportError):
    """A feature needs a backend plugin that is not installed.

    Also an :class:`ImportError`, so ``from neuropod.packagers import
    create_x_neuropod`` fails the way Python users expect.
    """


class BackendError(NeuropodError, RuntimeError):
    """The framework failed while loading or running a model.

    Also a :class:`RuntimeError`, as the original Neuropod raised.
    """


class PipelineStepError(BackendError):
    """A step of a pipeline failed to run: the message names the pipeline, the step and the step's
    model; the step's own error is chained as ``__cause__``. (A step's :class:`SpecError` or
    :class:`SequenceError` keeps its class, with the same names in its message.)"""

    def __init__(self, message: str, *, pipeline: str = "", step: str = "", model: str = ""):
        super().__init__(message)
        self.pipeline = pipeline
        self.step = step
        self.model = model


class InProcessConflictError(BackendError):
    """This process cannot hold the model, for example because its custom ops
    register op names that a library loaded here from another file has
    registered already (frameworks abort or fail on a second registration).

    Raised by a backend's ``load_model`` before it loads anything;
    ``load_neuropod`` then runs the model in a worker process instead, with a
    warning saying why.
    """


class WorkerError(NeuropodError, RuntimeError):
    """A worker process running a model failed. Also a :class:`RuntimeError`."""


class SequenceError(NeuropodError, ValueError):
    """A request of a stateful model names a sequence it cannot run: one that is not live (never
    started, ended, or freed after sitting idle) without ``sequence_start``, an id of the wrong
    kind, or a stateful model called without a sequence. Also a :class:`ValueError`."""


class SequenceLimitError(SequenceError):
    """A new sequence would pass the model's bound on live sequences (a server answers 429 /
    RESOURCE_EXHAUSTED)."""


class RemoteError(NeuropodError, RuntimeError):
    """A remote model (``load_neuropod("grpc://...")``) failed: the server could not be
    reached or answered with an error.

    :ivar url: the URL of the server that failed (one of the model's URLs).
    :ivar code: what went wrong, as a gRPC status name in lower case, whatever
        the protocol: ``"unavailable"`` (refused, reset, unreachable),
        ``"deadline_exceeded"`` (the call's timeout), ``"not_found"`` (unknown
        model), ``"invalid_argument"`` (the server refused the inputs),
        ``"unauthenticated"``, ``"internal"`` (the model failed on the server),
        ``"tls"`` (the TLS handshake failed), ``"protocol"`` (an answer that does
        not follow the Open Inference Protocol, or whose outputs do not fit the
        model's output spec).
    :ivar server_message: the server's own words, when it answered.
    """

    def __init__(self, message: str, *, url: str = "", code: str = "unknown", server_message: str | None = None):
        super().__init__(message)
        self.url = url
        self.code = code
        self.server_message = server_message


__all__ = [
    "BackendError",
    "InProcessConflictError",
    "NeuropodError",
    "NoBackendError",
    "PackageError",
    "PipelineStepError",
    "PluginNotInstalledError",
    "RemoteError",
    "SequenceError",
    "SequenceLimitError",
    "SpecError",
    "VersionRangeError",
    "WorkerError",
]
