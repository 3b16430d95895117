"""Triton's gRPC extensions beyond the Open Inference Protocol: the model repository and ModelStreamInfer.

Registered by :func:`neuropod_serving.server.grpc_server.start_grpc_server` on
``inference.GRPCInferenceService`` next to the six OIP methods, with the same
authentication, status codes and access log:

- ``RepositoryIndex``, ``RepositoryModelLoad`` (with a ``config`` parameter,
  see :mod:`~neuropod_serving.server.config_override`) and
  ``RepositoryModelUnload`` call :mod:`~neuropod_serving.server.repository_api`,
  as the REST routes do, so both protocols answer alike.
- ``ModelStreamInfer`` (a bidirectional stream) answers each ModelInferRequest
  with one ModelStreamInferResponse, in order: ``infer_response`` when it ran,
  ``error_message`` (the text a unary ModelInfer would have as its status
  details) when it did not; the stream goes on either way. Requests of one
  stream run one after another on the thread that reads it (open several
  streams, or use ModelInfer, for requests in parallel).

A stream holds a thread of the server's pool for as long as it is open (grpcio's
threaded server reads a stream on one thread), so open streams are bounded:
at most ``max_streams`` (:data:`~neuropod_serving.defaults.DEFAULT_MAX_GRPC_STREAMS`, ``neuropod serve
--max-grpc-streams``) ModelStreamInfer and Health Watch streams at once; one more
is refused at once with RESOURCE_EXHAUSTED. The pool's thread limit is raised by
the same number, so open streams never leave unary calls (health, metadata,
inference) without a thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

import neuropod_serving.server.repository_api as repository_api
from neuropod_serving.protocol import ProtocolError
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol._grpc import triton_repository_pb2 as rpb
from neuropod_serving.protocol._wire import encode_varint
from neuropod_serving.server.engine import Engine
from neuropod_serving.server.grpc_service import InferCall, Refused, Servicer, authenticate, status_of
from neuropod_serving.server.limits import escape_log

log = logging.getLogger("neuropod_serving.server")
access = logging.getLogger("neuropod_serving.access")

#: ModelStreamInferResponse.infer_response: field 2, length-delimited (checked against the descriptor in the tests).
_INFER_RESPONSE_TAG = b"\x12"

Handler = Callable[[Any, grpc.ServicerContext], Any]


class StreamSlots:
    """How many streams may be open at once; :meth:`take` refuses one more at once."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_streams must be at least 1, not {limit}")
        self.limit = limit
        self.open = 0
        self._lock = threading.Lock()

    def take(self, method: str) -> None:
        """:raises Refused: RESOURCE_EXHAUSTED, ``limit`` streams are open."""
        with self._lock:
            if self.open >= self.limit:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{method}: {self.open} streams are open, the most this server takes "
                    "(neuropod serve --max-grpc-streams); close one, or retry later",
                )
            self.open += 1

    def give_back(self) -> None:
        with self._lock:
            self.open -= 1


class RepositoryServicer:
    """The repository RPCs over one engine (the REST routes' logic, in :mod:`.repository_api`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def repository_index(self, request: Any, context: Any) -> Any:
        _one_repository(request.repository_name)
        entries = repository_api.index(self.engine, request.ready)
        return rpb.RepositoryIndexResponse(
            models=[
                rpb.RepositoryIndexResponse.ModelIndex(
                    name=e.name, version=e.version, state=e.state, reason=e.reason
                )
                for e in entries
            ]
        )

    def repository_model_load(self, request: Any, context: Any) -> Any:
        _one_repository(request.repository_name)
        parameters = {key: _parameter(key, value) for key, value in request.parameters.items()}
        repository_api.load(self.engine, request.model_name, parameters)
        return rpb.RepositoryModelLoadResponse()

    def repository_model_unload(self, request: Any, context: Any) -> Any:
        _one_repository(request.repository_name)
        # Triton's one unload parameter, unload_dependents, has nothing to do here: no model depends on another.
        repository_api.unload(self.engine, request.model_name)
        return rpb.RepositoryModelUnloadResponse()


def _one_repository(name: str) -> None:
    if name:
        raise ProtocolError(
            f"this server has one model repository (the paths it was started with); leave repository_name empty, "
            f"not {name!r}"
        )


def _parameter(key: str, value: Any) -> object:
    """A ModelRepositoryParameter's value (the one field set)."""
    which = value.WhichOneof("parameter_choice")
    if which is None:
        raise ProtocolError(f"load parameter {key!r} has no value")
    return getattr(value, which)


#: The repository RPCs: method name -> (servicer method, request class, response class, names a model).
REPOSITORY_METHODS: dict[str, tuple[str, Any, Any, bool]] = {
    "RepositoryIndex": ("repository_index", rpb.RepositoryIndexRequest, rpb.RepositoryIndexResponse, False),
    "RepositoryModelLoad": ("repository_model_load", rpb.RepositoryModelLoadRequest, rpb.RepositoryModelLoadResponse, True),
    "RepositoryModelUnload": (
        "repository_model_unload", rpb.RepositoryModelUnloadRequest, rpb.RepositoryModelUnloadResponse, True,
    ),
}  # fmt: skip


def stream_response(infer_response: bytes) -> bytes:
    """A ModelStreamInferResponse carrying the serialized ModelInferResponse ``infer_response``
    (written on the wire form: the response is not parsed again)."""
    return b"".join((_INFER_RESPONSE_TAG, encode_varint(len(infer_response)), infer_response))


def stream_error(message: str, data: bytes) -> bytes:
    """A ModelStreamInferResponse for the request ``data`` that failed: ``error_message``, and the
    request's model, version and id in ``infer_response`` so that a client can tell which request
    it answers (parsed again here: only failures pay for it)."""
    answer = pb.ModelInferResponse()
    try:
        request = pb.ModelInferRequest.FromString(data)
    except DecodeError:
        pass  # not a ModelInferRequest at all: the message says so
    else:
        answer = pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        )
    reply = rpb.ModelStreamInferResponse(error_message=message, infer_response=answer.SerializeToString())
    return bytes(reply.SerializeToString())


def model_stream_infer(
    servicer: Servicer, slots: StreamSlots, *, expected_auth: bytes | None, access_log: bool
) -> Callable[[Iterator[bytes], grpc.ServicerContext], Iterator[bytes]]:
    """The ModelStreamInfer handler: each request through :meth:`Servicer.model_infer`, as a unary
    ModelInfer runs (same checks, limits, metrics); its failure becomes that response's ``error_message``."""

    def stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            if expected_auth is not None:
                authenticate(context, expected_auth)
            slots.take("ModelStreamInfer")
        except Refused as e:
            context.abort(e.code, e.details)
        try:
            for data in requests:
                started = time.perf_counter()
                call = InferCall(data)
                code = "OK"
                try:
                    answer = stream_response(servicer.model_infer(call, context))
                except Exception as e:  # noqa: BLE001 - reported in this response; the stream goes on
                    status, details = status_of(e, "ModelStreamInfer", call.model_name or "?")
                    code = status.name
                    answer = stream_error(details, data)
                if access_log and access.isEnabledFor(logging.INFO):
                    access.info(
                        '%s "ModelStreamInfer %s" %s %.2fms', context.peer(), escape_log(call.model_name) or "-",
                        code, (time.perf_counter() - started) * 1000,
                    )  # fmt: skip
                yield answer
        finally:
            slots.give_back()

    return stream


def handlers(
    engine: Engine,
    servicer: Servicer,
    slots: StreamSlots,
    *,
    wrap: Callable[..., Handler],
    expected_auth: bytes | None,
    access_log: bool,
) -> dict[str, grpc.RpcMethodHandler]:
    """The RpcMethodHandlers of the repository RPCs and ModelStreamInfer, by method name;
    ``wrap`` is grpc_service's (authentication, status codes, access log)."""
    ours = RepositoryServicer(engine)
    found: dict[str, grpc.RpcMethodHandler] = {
        name: grpc.unary_unary_rpc_method_handler(
            wrap(
                name,
                getattr(ours, method),
                parse=request.FromString,
                model_of=(lambda r: str(r.model_name)) if names_model else None,
                expected_auth=expected_auth,
                access_log=access_log,
            ),
            request_deserializer=None,
            response_serializer=response.SerializeToString,
        )
        for name, (method, request, response, names_model) in REPOSITORY_METHODS.items()
    }
    found["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        model_stream_infer(servicer, slots, expected_auth=expected_auth, access_log=access_log),
        request_deserializer=None,  # bytes: each request is parsed by InferCall, as ModelInfer's
        response_serializer=None,
    )
    return found


__all__ = [
    "REPOSITORY_METHODS",
    "RepositoryServicer",
    "StreamSlots",
    "handlers",
    "model_stream_infer",
    "stream_error",
    "stream_response",
]
