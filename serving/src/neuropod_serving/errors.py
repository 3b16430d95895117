"""The errors of neuropod-serving, at the bottom of the package: the codec, the engine, the front ends
and the client raise them, and each front end maps them to its protocol's status.

Imports nothing of neuropod-serving and nothing heavy (only :mod:`neuropod.errors`).
"""

from __future__ import annotations

from neuropod.errors import NeuropodError


class ProtocolError(NeuropodError):
    """A request or response does not follow the Open Inference Protocol.

    :ivar status: the HTTP status a server answers with: 400 (bad request),
        404 (unknown model or tensor, for callers that look those up) or 413
        (too large).
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class RequestTimeoutError(NeuropodError):
    """A request's ``timeout`` (or its gRPC deadline) passed while it waited for a run slot or
    its batch: it was not run. Answered as Triton does: HTTP 503, gRPC UNAVAILABLE; gRPC
    DEADLINE_EXCEEDED when it was the call's own deadline (``call_deadline``)."""

    def __init__(self, message: str, *, call_deadline: bool = False) -> None:
        super().__init__(message)
        self.call_deadline = call_deadline


class UnknownModelError(NeuropodError):
    """A request named a model (or version) the server does not serve; HTTP 404."""


class ModelBusyError(NeuropodError):
    """A model's queue is full: the request is refused at once (HTTP 429, gRPC RESOURCE_EXHAUSTED)
    rather than left to time out; the client may retry later."""


class DecoupledModelError(ProtocolError):
    """A decoupled model (any number of responses per request) was asked for one answer, on an
    endpoint that gives one (REST ``/infer``, gRPC ``ModelInfer``): refused as Triton refuses it,
    HTTP 501 and gRPC UNIMPLEMENTED, in Triton's words and then ours (what to call instead).

    :param endpoint: Triton's name for what was called: ``"HTTP end point"`` or ``"ModelInfer RPC"``.
    :param instead: what to call instead, for the message.
    """

    def __init__(self, model: str, endpoint: str, instead: str) -> None:
        super().__init__(
            f"{endpoint} doesn't support models with decoupled transaction policy: model {model!r} answers each "
            f"request with any number of responses; {instead}",
            status=501,
        )
        self.model = model


class StreamStoppedError(NeuropodError):
    """The server ended an open stream before its model did (the server is stopping): the
    stream's final error (HTTP 503, gRPC UNAVAILABLE), after the responses sent before it."""


__all__ = [
    "DecoupledModelError",
    "ModelBusyError",
    "ProtocolError",
    "RequestTimeoutError",
    "StreamStoppedError",
    "UnknownModelError",
]
