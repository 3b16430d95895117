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
registered here with grpcio's generic handlers (no generated ``_pb2_grpc``):
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
too many streams open         RESOURCE_EXHAUSTED, at once
a package that fails to load  INVALID_ARGUMENT, naming the model and why
the model failed              INTERNAL, naming the model; logged
statistics asked of an        UNIMPLEMENTED, saying why (no ServerMetrics:
engine that keeps none        embedded, or a Ray Serve replica)
============================  ==========================================
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError

from neuropod.errors import NeuropodError, SpecError
from neuropod_serving import __version__
from neuropod_serving.protocol import ProtocolError
from neuropod_serving.protocol import grpc_codec as codec
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol._grpc import triton_config_pb2 as tc
from neuropod_serving.protocol._grpc import triton_shm_pb2 as shm_pb
from neuropod_serving.server import DEFAULT_MAX_REQUEST_BYTES, extensions, shared_memory_api
from neuropod_serving.server.engine import CLIENT_ERRORS, Engine, RequestTimeoutError
from neuropod_serving.server.limits import bearer_refusal, escape_log
from neuropod_serving.server.metrics import ServerMetrics
from neuropod_serving.server.model_config import model_config, model_config_message
from neuropod_serving.server.registry import ModelBusyError, UnknownModelError
from neuropod_serving.server.statistics import NO_STATISTICS, statistics_response

log = logging.getLogger("neuropod_serving.server")
access = logging.getLogger("neuropod_serving.access")

SERVICE = "inference.GRPCInferenceService"
#: Threads answering calls when the caller does not say: enough for every
#: OPE worker to be busy while others decode, and for batches to fill.
MIN_THREADS = 16

_STATUS_OF_PROTOCOL_ERROR = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class _Refused(Exception):
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
            raise _Refused(grpc.StatusCode.UNIMPLEMENTED, NO_STATISTICS)
        if request.name:
            models = [self.engine.get(request.name, request.version or None)]
        elif request.version:
            raise ProtocolError(
                f"a ModelStatistics request names version {request.version!r} but no model; "
                "name the model, or leave both empty for every model"
            )
        else:
            models = sorted(self.engine.registry, key=lambda s: s.name)
        return statistics_response([metrics.statistics(s.name, s.version) for s in models])

    def model_infer(self, call: InferCall, context: Any) -> bytes:
        with self._counted(call) as state:
            served, decoded, requested = self._begin(call, state)
            if decoded.shared_memory is not None:
                return self._infer_shared(state, served, decoded, requested, context)
            outputs = self.engine.infer_blocking(
                served, decoded.inputs, requested, decoded.options, context.time_remaining
            )
            return self._finish(state, served, decoded, outputs)

    def _infer_shared(
        self, state: _InferState, served: Any, decoded: Any, requested: list[str] | None, context: Any
    ) -> bytes:
        """:meth:`model_infer` of a request with tensors in shared memory (see :mod:`.shared_memory`)."""
        state.failure = "client"
        held = shared_memory_api.lease(self.engine, decoded)
        try:
            shared_memory_api.read_inputs(held, served, decoded)
            state.failure = "model"
            outputs = self.engine.infer_blocking(
                served, decoded.inputs, requested, decoded.options, context.time_remaining
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
            outputs = await self.engine.infer(served, decoded.inputs, requested, decoded.options)
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
        decoded = request.decode(served.input_specs)
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


def _wrap(
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
    if isinstance(exc, _Refused):
        return exc.code, exc.details
    if isinstance(exc, ModelBusyError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, RequestTimeoutError):
        # UNAVAILABLE as Triton answers an expired request timeout; the call's own deadline is DEADLINE_EXCEEDED.
        code = grpc.StatusCode.DEADLINE_EXCEEDED if exc.call_deadline else grpc.StatusCode.UNAVAILABLE
        return code, str(exc)
    if isinstance(exc, (ProtocolError, SpecError, UnknownModelError)):
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
        raise _Refused(
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


def _handlers(
    engine: Engine, *, auth_token: str | None, access_log: bool, streams: Any = None
) -> dict[str, grpc.RpcMethodHandler]:
    """Every method's handler; with ``streams`` (a :class:`~.grpc_repository.StreamSlots`), also
    Triton's repository RPCs and ModelStreamInfer (:mod:`.grpc_repository`)."""
    servicer = Servicer(engine, extensions.listed(extensions.GRPC, engine) if streams is not None else None)
    expected = None if auth_token is None else f"Bearer {auth_token}".encode()
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _wrap(
                name,
                getattr(servicer, m.handler),
                parse=getattr(m.request, "FromString", m.request),
                model_of=m.model_of,
                expected_auth=None if m.open else expected,
                access_log=access_log,
            ),
            request_deserializer=None,  # the bytes: _wrap parses them after authentication
            response_serializer=None if m.response is None else m.response.SerializeToString,
        )
        for name, m in METHODS.items()
    }
    if streams is not None:
        from neuropod_serving.server import grpc_repository

        handlers.update(
            grpc_repository.handlers(
                engine, servicer, streams, wrap=_wrap, expected_auth=expected, access_log=access_log
            )
        )
    return handlers


def start_grpc_server(
    engine: Engine,
    address: str,
    *,
    auth_token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
    max_message_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    access_log: bool = True,
    threads: int | None = None,
    max_streams: int | None = None,
    reuse_port: bool = False,
) -> tuple[GrpcServer, int]:
    """Start serving ``engine``'s models over gRPC on ``address`` (``host:port``; port 0 picks a free one).

    The server runs on threads of its own until :meth:`GrpcServer.stop`.

    :param auth_token: when given, every method except ServerLive and
        ServerReady needs ``authorization: Bearer <auth_token>`` metadata.
    :param tls: the PEM certificate chain and private key: serve over TLS.
    :param max_message_bytes: larger requests are refused with
        RESOURCE_EXHAUSTED before they reach a handler.
    :param access_log: one INFO line per call on the ``neuropod_serving.access`` logger.
    :param threads: calls answered at once (default: :func:`default_threads`);
        more wait in grpcio's queue.
    :param max_streams: ModelStreamInfer and Health Watch streams open at once (default
        :data:`~.grpc_repository.DEFAULT_MAX_STREAMS`); the pool has that many more threads.
    :param reuse_port: share the port with other processes that set SO_REUSEPORT too
        (``neuropod serve --processes``); otherwise a port in use fails the start.
    :returns: the started server and the port it is bound to.
    :raises NeuropodError: the address cannot be bound.
    """
    if max_message_bytes < 1:
        raise ValueError(f"max_message_bytes must be at least 1, not {max_message_bytes}")
    if auth_token is not None and not auth_token:
        raise ValueError("auth_token is empty: pass None to serve without authentication")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, not {threads}")
    from neuropod_serving.server.grpc_repository import DEFAULT_MAX_STREAMS, StreamSlots
    from neuropod_serving.server.health import add_health

    # Each open stream holds a thread: the pool has one more per stream allowed, so
    # streams never leave unary calls without one.
    streams = StreamSlots(max_streams if max_streams is not None else DEFAULT_MAX_STREAMS)
    handlers = _handlers(engine, auth_token=auth_token, access_log=access_log, streams=streams)
    if threads is not None:
        pool: futures.ThreadPoolExecutor = futures.ThreadPoolExecutor(
            threads + streams.limit, thread_name_prefix="neuropod-grpc"
        )
    else:
        pool = ElasticPool(
            base_threads(engine), default_threads(engine) + streams.limit, thread_name_prefix="neuropod-grpc"
        )
    server = grpc.server(
        pool,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", -1),
            # grpcio sets SO_REUSEPORT by default: a second server on a port in use would
            # silently share it instead of failing the start.
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ],
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    # Registered methods skip the per-call lookup by name (grpcio >= 1.62).
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE, handlers)
    # Open like ServerLive/ServerReady: probes carry no token.
    health = add_health(server, engine, streams)
    followers: list[Callable[..., None]] = []
    if isinstance(pool, ElasticPool):
        elastic = pool

        def grow(name: str, served: Any) -> None:
            # A model loaded with a config of its own may hold more requests than the server's
            # options allow one model: room for them too (threads start only when needed).
            elastic._max_workers = max(elastic._max_workers, default_threads(engine) + streams.limit)

        engine.listeners.append(grow)
        followers.append(grow)

    def forget() -> None:
        health.shut_down()
        for follower in followers:
            with contextlib.suppress(ValueError):
                engine.listeners.remove(follower)

    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            cert, key = tls
            port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    except RuntimeError as e:
        port, reason = 0, str(e)
    else:
        reason = "is the port in use?"
    if not port:
        forget()
        server.stop(None).wait()
        pool.shutdown(wait=False)
        raise NeuropodError(f"gRPC: cannot listen on {address} ({reason})")
    server.start()
    return GrpcServer(server, pool, on_stop=forget), port


class GrpcServer:
    """A started gRPC server and its thread pool."""

    def __init__(
        self, server: grpc.Server, pool: futures.ThreadPoolExecutor, *, on_stop: Callable[[], None] | None = None
    ) -> None:
        self.server = server
        self._pool = pool
        self._on_stop = on_stop

    def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, give those running ``grace`` seconds (None: cancel them now), then stop the threads.

        gRPC health says NOT_SERVING first, for every service, so that watchers see the server go.
        """
        if self._on_stop is not None:
            self._on_stop()
        self.server.stop(grace).wait()
        self._pool.shutdown(wait=True)


#: Seconds calls may wait for a thread before the pool grows past its base (see :class:`ElasticPool`).
GROW_AFTER_S = 0.005


class ElasticPool(futures.ThreadPoolExecutor):
    """A thread pool of ``base`` threads that grows toward ``max_workers`` only while
    its threads are stuck: when calls wait and no thread has taken a new call for
    :data:`GROW_AFTER_S`.

    Calls of fast models come and go faster than that, so under any load they share the
    base threads, as many as contend for the GIL at a profit (every thread more costs
    throughput: 32 threads serve a small model about 15% slower than 16). Slow calls (a
    model's long runs, or requests waiting for a run slot) hold their threads, the pool
    grows, and health, metadata and other models' calls find a thread within
    milliseconds however many slow calls are in flight.
    """

    def __init__(self, base: int, max_workers: int, *, grow_after_s: float = GROW_AFTER_S, **kwargs: Any) -> None:
        super().__init__(max(base, max_workers), **kwargs)
        self._base = base
        self._grow_after_s = grow_after_s
        self._grow_lock = threading.Lock()
        self._grow_armed = False
        self._taken = 0  # calls taken by a thread so far (the pool's progress)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        return super().submit(self._take, fn, args, kwargs)

    def _take(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._taken += 1  # a racy count is enough: it only has to change while threads take calls
        return fn(*args, **kwargs)

    def _adjust_thread_count(self) -> None:
        if len(self._threads) < self._base:
            super()._adjust_thread_count()
            return
        if self._idle_semaphore.acquire(timeout=0):
            return  # an idle thread takes the call
        self._arm()

    def _arm(self) -> None:
        with self._grow_lock:
            if self._grow_armed:
                return
            self._grow_armed = True
        timer = threading.Timer(self._grow_after_s, self._look, (self._taken,))
        timer.daemon = True
        timer.start()

    def _look(self, taken: int) -> None:
        """Calls still waiting: grow if no thread took one since ``taken`` was counted
        (a thread for each waiting call, so that a health check behind many slow calls
        waits one look, not one per call); look again while calls wait."""
        with self._grow_lock:
            self._grow_armed = False
        # The lock submit() holds when it adds threads: one thread adds at a time, none after shutdown.
        with self._shutdown_lock:
            waiting = self._work_queue.qsize()
            if self._shutdown or waiting == 0:
                return
            if self._taken == taken:
                for _ in range(min(waiting, self._max_workers - len(self._threads))):
                    super()._adjust_thread_count()
        if self._work_queue.qsize() and len(self._threads) < self._max_workers:
            self._arm()


def base_threads(engine: Engine) -> int:
    """The threads a gRPC pool keeps for calls that come and go quickly: a thread per
    request that can be waiting in a batch or running in an OPE worker, twice over, and
    at least :data:`MIN_THREADS`."""
    per_model = engine.workers * (engine.batching.max_batch_size if engine.batching is not None else 1)
    return max(MIN_THREADS, 2 * per_model)


def default_threads(engine: Engine) -> int:
    """Pool threads for ``engine``: a thread per request that can be waiting in a
    batch or running in an OPE worker, twice over, and at least :data:`MIN_THREADS`;
    and on top, one for every request each model of the repository may hold
    (running or queued, :class:`~neuropod_serving.server.engine.ModelLimits`), so that
    busy models never leave health, metadata or another model's calls without a
    thread. grpcio starts threads only when none is idle: the headroom costs nothing
    while models keep up."""
    per_model = engine.workers * (engine.batching.max_batch_size if engine.batching is not None else 1)
    models = max(len(engine.registry), len({e.name for e in engine.registry.index()}))
    return max(MIN_THREADS, 2 * per_model) + models * engine.most_in_flight


__all__ = [
    "METHODS",
    "SERVICE",
    "GrpcServer",
    "Method",
    "Servicer",
    "authenticate",
    "ElasticPool",
    "base_threads",
    "default_threads",
    "start_grpc_server",
    "status_of",
]
