"""The gRPC half of the Open Inference Protocol: ``inference.GRPCInferenceService`` on grpcio.

The server is grpcio's threaded one (``grpc.server`` with a thread pool), not
its asyncio one: on one core a bare threaded server answers about 1.4x the
small requests a bare ``grpc.aio`` server does at 8 and 32 calls in flight
(about the same at 1; bench_serve.py measures both floors), because grpc.aio
hands every call between its poller thread and the event loop. Each call runs on a pool thread from decoding to encoding; the
model runs on that thread too, or the request waits there for its batch.

Messages go through :mod:`neuropod_serving.protocol.grpc_codec` and requests
through the same :class:`~neuropod_serving.server.engine.Engine` as REST, so
both protocols check, batch, count and refuse alike. The methods are
registered (by :mod:`.grpc_server`) with grpcio's generic handlers (no generated ``_pb2_grpc``):
the Open Inference Protocol's six, Triton's ModelConfig and ModelStatistics
(messages of our own wire-compatible ``triton_config.proto``) and its
shared-memory RPCs, and with them Triton's repository RPCs and ModelStreamInfer
(:mod:`.grpc_repository`) and gRPC's health service (:mod:`.health`):

============================  ==========================================
what went wrong               status (details: the same text as REST's)
============================  ==========================================
bad tensor, spec mismatch     INVALID_ARGUMENT, naming the tensor
unknown model or version      NOT_FOUND
request timeout expired       UNAVAILABLE (waited past its timeout; not run), or
                              DEADLINE_EXCEEDED past the call's own deadline
missing or wrong token        UNAUTHENTICATED (not on ServerLive/Ready)
message over the limit        RESOURCE_EXHAUSTED (refused by grpcio)
the model's queue is full     RESOURCE_EXHAUSTED, at once (retry later)
too many streams open         RESOURCE_EXHAUSTED, at once (both the server's
                              gRPC streams and a model's open streams)
ModelInfer on a decoupled     UNIMPLEMENTED, in Triton's words ("ModelInfer RPC
model                         doesn't support models with decoupled transaction
                              policy") and saying to use ModelStreamInfer
the server is stopping        UNAVAILABLE (a stream's request in flight)
a package that fails to load  INVALID_ARGUMENT, naming the model and why
the model failed              INTERNAL, naming the model; logged
                              (also one that raised SystemExit or
                              KeyboardInterrupt: at once)
statistics asked of an        UNIMPLEMENTED, saying why (no ServerMetrics:
engine that keeps none        embedded, or a Ray Serve replica)
============================  ==========================================
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError

import neuropod_serving.server.extensions as extensions
import neuropod_serving.server.shared_memory_api as shared_memory_api
from neuropod.errors import NeuropodError, SequenceError, SequenceLimitError, SpecError
from neuropod.sequences import StateMismatchError
from neuropod_serving import __version__
from neuropod_serving.errors import (
    DecoupledModelError,
    ModelBusyError,
    RequestTimeoutError,
    StreamStoppedError,
    UnknownModelError,
)
from neuropod_serving.protocol import ProtocolError
from neuropod_serving.protocol import grpc_codec as codec
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol._grpc import triton_config_pb2 as tc
from neuropod_serving.protocol._grpc import triton_shm_pb2 as shm_pb
from neuropod_serving.protocol.options import require_sequence
from neuropod_serving.server.engine import CLIENT_ERRORS, Engine
from neuropod_serving.server.limits import bearer_refusal, escape_log
from neuropod_serving.server.metrics import ServerMetrics
from neuropod_serving.server.model_config import model_config, model_config_message
from neuropod_serving.server.model_exits import EXITS, model_exited
from neuropod_serving.server.statistics import NO_STATISTICS, served_statistics, statistics_response

log = logging.getLogger("neuropod_serving.server")
access = logging.getLogger("neuropod_serving.access")

SERVICE = "inference.GRPCInferenceService"

_STATUS_OF_PROTOCOL_ERROR = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED,
}


class Refused(Exception):
    """End the RPC with ``code`` and ``details`` (raised inside a handler)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


Handler = Callable[[Any, grpc.ServicerContext], Any]


class Servicer(shared_memory_api.SharedMemoryRpcs):
    """The RPCs of GRPCInferenceService over one engine."""

    def __init__(self, engine: Engine, served_extensions: list[str] | None = None) -> None:
        self.engine = engine
        self.metrics = engine.metrics
        #: What ServerMetadata lists: by default what this servicer's own methods serve (a Ray
        #: Serve replica's); neuropod serve's gRPC server, which adds the repository RPCs, says.
        self.extensions = (
            served_extensions
            if served_extensions is not None
            else [e for e in extensions.listed(extensions.GRPC, engine) if e not in extensions.SERVER_ONLY]
        )

    def server_live(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    def server_ready(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        # Models load before the port opens, so a listening server is ready; one of several
        # processes is once they all listen (and until one stops).
        return pb.ServerReadyResponse(ready=self.engine.group is None or self.engine.group.ready)

    def server_metadata(self, request: pb.ServerMetadataRequest, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="neuropod", version=__version__, extensions=self.extensions)

    def model_ready(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        # As Triton: a model that is not loaded (or not known) is not ready, which is an answer, not an error.
        try:
            self.engine.get(request.name, request.version or None)
        except UnknownModelError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    def model_metadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        metadata = self.engine.get(request.name, request.version or None).metadata
        # The exact spec shapes (symbol names) ride in a trailer: TensorMetadata has no parameters.
        # A list: Ray Serve's context (neuropod_serving.ray) adds its own trailers to it.
        context.set_trailing_metadata([(codec.SHAPES_METADATA_KEY, codec.shapes_metadata(metadata))])
        return codec.model_metadata_response(metadata)

    def model_config(self, request: tc.ModelConfigRequest, context: Any) -> tc.ModelConfigResponse:
        served = self.engine.get(request.name, request.version or None)
        return model_config_message(model_config(self.engine, served))

    def model_statistics(self, request: tc.ModelStatisticsRequest, context: Any) -> tc.ModelStatisticsResponse:
        metrics = self.metrics
        if not isinstance(metrics, ServerMetrics):
            raise Refused(grpc.StatusCode.UNIMPLEMENTED, NO_STATISTICS)
        if request.name:
            models = [self.engine.get(request.name, request.version or None)]
        elif request.version:
            raise ProtocolError(
                f"a ModelStatistics request names version {request.version!r} but no model; "
                "name the model, or leave both empty for every model"
            )
        else:
            models = sorted(self.engine.registry, key=lambda s: s.name)
        return statistics_response(served_statistics(metrics, models))

    def model_infer(self, call: InferCall, context: Any) -> bytes:
        with self._counted(call) as state:
            served, decoded, requested = self._begin(call, state)
            if decoded.shared_memory is not None:
                return self._infer_shared(state, served, decoded, requested, context, _version(call))
            served, outputs = self.engine.infer_blocking_latest(
                served, _version(call), decoded.inputs, requested, decoded.options, context.time_remaining
            )
            return self._finish(state, served, decoded, outputs)

    def _infer_shared(
        self, state: _InferState, served: Any, decoded: Any, requested: list[str] | None, context: Any,
        version: str | None,
    ) -> bytes:  # fmt: skip
        """:meth:`model_infer` of a request with tensors in shared memory (see :mod:`.shm_regions`)."""
        state.failure = "client"
        held = shared_memory_api.lease(self.engine, decoded)
        try:
            shared_memory_api.read_inputs(held, served, decoded)
            state.failure = "model"
            served, outputs = self.engine.infer_blocking_latest(
                served, version, decoded.inputs, requested, decoded.options, context.time_remaining
            )
            state.failure = "client"  # an output that does not fit where the request put it
            response = shared_memory_api.grpc_message(held, served, decoded, outputs)
        finally:
            held.release()
        state.failure = None
        return response

    async def model_infer_async(self, call: InferCall, context: Any) -> bytes:
        """:meth:`model_infer` for a caller on an event loop (the Ray Serve deployment):
        the model runs through :meth:`Engine.infer`, never blocking the loop on a batch."""
        with self._counted(call) as state:
            served, decoded, requested = self._begin(call, state)
            if decoded.shared_memory is not None:
                state.failure = "client"
                shared_memory_api.registry_of(self.engine)  # Ray's replicas take no shared memory: refused
            served, outputs = await self.engine.infer_latest(
                served, _version(call), decoded.inputs, requested, decoded.options
            )
            return self._finish(state, served, decoded, outputs)

    @contextlib.contextmanager
    def _counted(self, call: InferCall) -> Iterator[_InferState]:
        """Count one ModelInfer in the metrics, as failed by the client, the model or neither."""
        started = time.perf_counter()
        state = _InferState(call)
        try:
            yield state
        except CLIENT_ERRORS:
            state.failure = "client"
            raise
        finally:
            if state.model in self.engine.registry:
                self.metrics.request(state.model, "grpc", time.perf_counter() - started, state.failure)

    def _begin(self, call: InferCall, state: _InferState) -> tuple[Any, Any, list[str] | None]:
        """The model and the decoded request of ``call``; afterwards a failure is the model's."""
        request = call.request
        if request is None:
            assert call.error is not None
            raise call.error
        served = self.engine.get(call.model_name, request.model_version or None)
        if getattr(served.model, "decoupled", False):
            raise DecoupledModelError(
                served.name, "ModelInfer RPC",
                "send its requests on ModelStreamInfer (tritonclient.grpc: start_stream, then async_stream_infer)",
            )  # fmt: skip
        decoded = request.decode(served.input_specs)
        if served.stateful:
            require_sequence(served.name, decoded.options)
        state.failure = "model"
        return served, decoded, list(decoded.outputs) if decoded.outputs is not None else None

    def _finish(self, state: _InferState, served: Any, decoded: Any, outputs: dict[str, Any]) -> bytes:
        try:
            response = codec.serialize_model_infer_response(
                served.name, outputs, model_version=served.version, id=decoded.id
            )
        except ProtocolError as e:
            # An output the protocol cannot carry is the model's fault, not the request's.
            raise NeuropodError(f"its outputs cannot be sent: {e}") from e
        state.failure = None
        return response


def _version(call: InferCall) -> str | None:
    """The version ``call`` names (None: none, its model's latest)."""
    return call.request.model_version or None if call.request is not None else None


class _InferState:
    """What one ModelInfer call has come to: who is at fault if it fails now."""

    __slots__ = ("failure", "model")

    def __init__(self, call: InferCall) -> None:
        self.model = call.model_name
        self.failure: str | None = "client"


class InferCall:
    """A ModelInfer request as received (:class:`grpc_codec.ReceivedRequest`: raw contents
    are views of the received bytes, the rest is parsed once per form of request). A request
    that cannot be parsed keeps its error, raised by the handler (INVALID_ARGUMENT) rather
    than by grpcio's deserializer (INTERNAL, with no message)."""

    __slots__ = ("error", "request")

    def __init__(self, data: bytes) -> None:
        self.request: codec.ReceivedRequest | None = None
        self.error: ProtocolError | None = None
        try:
            self.request = codec.ReceivedRequest(data)
        except ProtocolError as e:
            self.error = e

    @property
    def model_name(self) -> str:
        return self.request.model_name if self.request is not None else ""


def wrap(
    method: str,
    handler: Handler,
    *,
    parse: Callable[[bytes], Any],
    model_of: Callable[[Any], str] | None,
    expected_auth: bytes | None,
    access_log: bool,
) -> Handler:
    """``handler`` with authentication, errors mapped to status codes, and the access log.

    The RPC takes the request's bytes (grpcio deserializes nothing) and ``parse`` reads them
    only after the token is checked: a call without it costs no more than its metadata.
    """

    def rpc(data: bytes, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        details = ""
        request = None
        try:
            if expected_auth is not None:
                authenticate(context, expected_auth)
            request = _parsed(parse, data, method)
            return handler(request, context)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status (status_of logs the unexpected)
            code, details = status_of(e, method, _model(model_of, request) or "?")
        except EXITS as e:  # a model's sys.exit(): answered at once, the worker thread lives (see model_exits)
            model = _model(model_of, request) or "?"
            code, details = status_of(model_exited(model, e), method, model)
        finally:
            if access_log and access.isEnabledFor(logging.INFO):
                access.info(
                    '%s "%s %s" %s %.2fms',
                    context.peer(), method, escape_log(_model(model_of, request)) or "-",
                    code.name, (time.perf_counter() - started) * 1000,
                )  # fmt: skip
        context.abort(code, details)  # raises: the RPC ends with this status

    return rpc


def _parsed(parse: Callable[[bytes], Any], data: bytes, method: str) -> Any:
    try:
        return parse(data)
    except DecodeError as e:
        raise ProtocolError(f"the {method} request cannot be parsed: {e}") from None


def _model(model_of: Callable[[Any], str] | None, request: Any) -> str:
    """The model ``request`` names, "" before it is parsed or for a server-level RPC."""
    return model_of(request) if model_of is not None and request is not None else ""


def status_of(exc: Exception, method: str, model: str) -> tuple[grpc.StatusCode, str]:
    """The status code and details a gRPC client gets for ``exc`` raised by ``method``.

    A model's failure and any unexpected error are logged here with their cause
    for the operator; the client gets INTERNAL naming the model (or the method).
    """
    if isinstance(exc, Refused):
        return exc.code, exc.details
    if isinstance(exc, (ModelBusyError, SequenceLimitError)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, SequenceError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, StreamStoppedError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)  # as Triton answers once it is shutting down
    if isinstance(exc, RequestTimeoutError):
        # UNAVAILABLE as Triton answers an expired request timeout; the call's own deadline is DEADLINE_EXCEEDED.
        code = grpc.StatusCode.DEADLINE_EXCEEDED if exc.call_deadline else grpc.StatusCode.UNAVAILABLE
        return code, str(exc)
    if isinstance(exc, (ProtocolError, SpecError, UnknownModelError)) and not isinstance(exc, StateMismatchError):
        code = (
            grpc.StatusCode.NOT_FOUND
            if isinstance(exc, UnknownModelError)
            else _STATUS_OF_PROTOCOL_ERROR.get(getattr(exc, "status", 400), grpc.StatusCode.INVALID_ARGUMENT)
        )
        return code, str(exc)
    if isinstance(exc, NeuropodError):
        # The model failed, not the request: answer INTERNAL naming the model, and keep serving.
        log.error("model %r failed: %s", model, exc, exc_info=exc)
        return grpc.StatusCode.INTERNAL, f"model {model!r} failed: {exc}"
    log.exception("gRPC %s failed", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"{method} failed: {type(exc).__name__}: {exc}"


def authenticate(context: grpc.ServicerContext, expected: bytes) -> None:
    given = b""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            given = value.encode() if isinstance(value, str) else bytes(value)
            break
    reason = bearer_refusal(given, expected)
    if reason is not None:
        reason = "no authorization metadata" if not given else reason
        raise Refused(
            grpc.StatusCode.UNAUTHENTICATED,
            f"this server needs 'authorization: Bearer <token>' in the call's metadata ({reason})",
        )


class Method(NamedTuple):
    """One RPC of the service, as both servers (``neuropod serve``'s and Ray Serve's proxy) register it."""

    #: The servicer's method that answers it.
    handler: str
    #: Parses the request bytes (``FromString``, or a class taking the bytes).
    request: Any
    #: Serializes the answer; None when the handler returns bytes already.
    response: Any
    #: The model a request names (for errors and the access log), None for server-level RPCs.
    model_of: Callable[[Any], str] | None
    #: Answered without the bearer token (health probes).
    open: bool

    def parse(self, data: bytes) -> Any:
        return getattr(self.request, "FromString", self.request)(data)


def _by_name(request: Any) -> str:
    return str(request.name)


def _by_call(request: Any) -> str:
    return str(request.model_name)


#: The RPCs of GRPCInferenceService served, by method name.
METHODS: dict[str, Method] = {
    "ServerLive": Method("server_live", pb.ServerLiveRequest, pb.ServerLiveResponse, None, True),
    "ServerReady": Method("server_ready", pb.ServerReadyRequest, pb.ServerReadyResponse, None, True),
    "ModelReady": Method("model_ready", pb.ModelReadyRequest, pb.ModelReadyResponse, _by_name, False),
    "ServerMetadata": Method("server_metadata", pb.ServerMetadataRequest, pb.ServerMetadataResponse, None, False),
    "ModelMetadata": Method("model_metadata", pb.ModelMetadataRequest, pb.ModelMetadataResponse, _by_name, False),
    # Requests are parsed by InferCall, answers serialized by the codec (bytes): big tensors
    # then skip protobuf's copies (grpc_codec.serialize_model_infer_response).
    "ModelInfer": Method("model_infer", InferCall, None, _by_call, False),
    "ModelConfig": Method("model_config", tc.ModelConfigRequest, tc.ModelConfigResponse, _by_name, False),
    "ModelStatistics": Method(
        "model_statistics", tc.ModelStatisticsRequest, tc.ModelStatisticsResponse, _by_name, False
    ),
    # Triton's shared-memory extensions (shared_memory_api.SharedMemoryRpcs).
    "SystemSharedMemoryStatus": Method("system_shared_memory_status", shm_pb.SystemSharedMemoryStatusRequest,
                                       shm_pb.SystemSharedMemoryStatusResponse, None, False),
    "SystemSharedMemoryRegister": Method("system_shared_memory_register", shm_pb.SystemSharedMemoryRegisterRequest,
                                         shm_pb.SystemSharedMemoryRegisterResponse, None, False),
    "SystemSharedMemoryUnregister": Method("system_shared_memory_unregister",
                                           shm_pb.SystemSharedMemoryUnregisterRequest,
                                           shm_pb.SystemSharedMemoryUnregisterResponse, None, False),
    "CudaSharedMemoryStatus": Method("cuda_shared_memory_status", shm_pb.CudaSharedMemoryStatusRequest,
                                     shm_pb.CudaSharedMemoryStatusResponse, None, False),
    "CudaSharedMemoryRegister": Method("cuda_shared_memory_register", shm_pb.CudaSharedMemoryRegisterRequest,
                                       shm_pb.CudaSharedMemoryRegisterResponse, None, False),
    "CudaSharedMemoryUnregister": Method("cuda_shared_memory_unregister", shm_pb.CudaSharedMemoryUnregisterRequest,
                                         shm_pb.CudaSharedMemoryUnregisterResponse, None, False),
}  # fmt: skip


__all__ = [
    "METHODS",
    "SERVICE",
    "InferCall",
    "Method",
    "Refused",
    "Servicer",
    "authenticate",
    "status_of",
    "wrap",
]
