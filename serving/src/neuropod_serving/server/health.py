"""gRPC's health checking protocol (``grpc.health.v1.Health``), what Kubernetes' gRPC probes and
``grpc_health_probe`` call, on the same port as the inference service.

The messages are our own copy of gRPC's (:mod:`~neuropod_serving.protocol._grpc.grpc_health_pb2`,
wire-compatible, in a private descriptor pool), so the service works with every protobuf
runtime the inference messages work with; no other package is needed for it.

- service ``""``: the server. SERVING while it serves (models load before the port
  opens, as ServerReady says), NOT_SERVING once it is shutting down.
- service ``"<model>"``: that model. SERVING while it is loaded, NOT_SERVING once
  unloaded (or while the server shuts down).
- any other name: ``Check`` answers NOT_FOUND; ``Watch`` answers SERVICE_UNKNOWN and ends the
  stream at once (where gRPC's own implementation keeps it open, and the name, for as long as
  the client likes: a server that anyone may ask without a token keeps nothing per name it
  does not know). A name longer than :data:`MAX_SERVICE_CHARS` is INVALID_ARGUMENT.

Like the REST health routes and ServerLive/ServerReady, the service needs no
token with ``--auth-token-file``: probes carry none. A ``Watch`` stream holds
no thread of the server's pool (updates are sent from one thread of this
module's), but it counts against the open streams bound (``--max-grpc-streams``);
when it closes, nothing of it is kept.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from neuropod_serving.protocol._grpc.grpc_health_pb2 import HealthCheckRequest, HealthCheckResponse
from neuropod_serving.server.engine import Engine
from neuropod_serving.server.grpc_repository import StreamSlots
from neuropod_serving.server.grpc_service import Refused
from neuropod_serving.server.registry import ServedModel

SERVICE = "grpc.health.v1.Health"
SERVING = HealthCheckResponse.SERVING
NOT_SERVING = HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = HealthCheckResponse.SERVICE_UNKNOWN
#: Seconds a stopping server waits for Watch streams to be told NOT_SERVING.
SHUTDOWN_NOTICE_S = 2.0
#: The longest service name asked about (a model name is far shorter): longer is INVALID_ARGUMENT.
MAX_SERVICE_CHARS = 1024

_Send = Callable[[Any], None]
_Status = HealthCheckResponse.ServingStatus


class ModelHealth:
    """The statuses of the server and of each model of ``engine``, kept in step with its loads and unloads.

    ``Check`` answers from this class's table, updated at once; ``Watch`` streams are told on a
    thread of their own, in order, so a watcher that stops reading can hold only that thread,
    never a load, an unload or a stop of the server (which waits :data:`SHUTDOWN_NOTICE_S` at
    most for watchers to be told). Only known services (the server, models loaded here) are
    watched, and a watcher is forgotten when its call ends.
    """

    def __init__(self, engine: Engine, slots: StreamSlots) -> None:
        self._engine = engine
        self._slots = slots
        self._statuses: dict[str, _Status] = {}
        #: Service -> the send callbacks of its open Watch calls (no entry once none is open).
        self._watchers: dict[str, set[_Send]] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._notices = futures.ThreadPoolExecutor(1, thread_name_prefix="neuropod-health")
        self._update("", SERVING)
        for served in engine.registry:
            self._update(served.name, SERVING)
        engine.listeners.append(self._changed)

    def _update(self, service: str, status: _Status) -> None:
        self._statuses[service] = status
        self._notices.submit(self._tell, service, status)

    def _changed(self, name: str, served: ServedModel | None) -> None:
        self._update(name, SERVING if served is not None else NOT_SERVING)

    def _tell(self, service: str, status: _Status) -> None:
        with self._lock:
            if self._stopped:
                return
            for send in tuple(self._watchers.get(service, ())):
                send(HealthCheckResponse(status=status))

    def Check(self, request: HealthCheckRequest, context: grpc.ServicerContext) -> HealthCheckResponse:
        service = request.service
        if len(service) > MAX_SERVICE_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _too_long(service))
        status = self._statuses.get(service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"no service {service!r} here: the server is '', a model is its name")
            return HealthCheckResponse()
        return HealthCheckResponse(status=status)

    def Watch(self, request: HealthCheckRequest, context: grpc.ServicerContext, send_response_callback: _Send) -> None:
        service = request.service
        if len(service) > MAX_SERVICE_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _too_long(service))
        if service not in self._statuses:
            send_response_callback(HealthCheckResponse(status=SERVICE_UNKNOWN))
            send_response_callback(None)  # ends the call: nothing is kept for a name not known here
            return
        try:
            self._slots.take("Health/Watch")
        except Refused as e:
            context.abort(e.code, e.details)
        with self._lock:
            status = NOT_SERVING if self._stopped else self._statuses[service]
            send_response_callback(HealthCheckResponse(status=status))
            self._watchers.setdefault(service, set()).add(send_response_callback)
        closed = functools.partial(self._closed, service, send_response_callback)
        if not context.add_callback(closed):
            closed()  # the call ended already

    # grpcio calls Watch with a callback that sends each response, instead of on a thread of
    # its pool that would iterate it for as long as the stream stays open.
    Watch.experimental_non_blocking = True  # type: ignore[attr-defined]

    def _closed(self, service: str, send: _Send) -> None:
        with self._lock:
            watchers = self._watchers.get(service)
            if watchers is not None:
                watchers.discard(send)
                if not watchers:
                    del self._watchers[service]
        self._slots.give_back()

    def open_watches(self) -> int:
        """How many Watch calls are open now (each one's service is kept until it closes)."""
        with self._lock:
            return sum(len(w) for w in self._watchers.values())

    def _stop(self) -> None:
        with self._lock:
            self._stopped = True
            for watchers in self._watchers.values():
                for send in tuple(watchers):
                    send(HealthCheckResponse(status=NOT_SERVING))

    def shut_down(self) -> None:
        """Every status NOT_SERVING (watchers are told), and stop following the engine."""
        try:
            self._engine.listeners.remove(self._changed)
        except ValueError:
            pass
        for service in self._statuses:
            self._statuses[service] = NOT_SERVING
        try:
            self._notices.submit(self._stop).result(SHUTDOWN_NOTICE_S)
        except (futures.TimeoutError, RuntimeError):
            pass  # a watcher that does not read; or shut down already
        self._notices.shutdown(wait=False)


def _too_long(service: str) -> str:
    return (
        f"a health service name is at most {MAX_SERVICE_CHARS} characters (the server is '', a model is "
        f"its name), not {len(service)}: {service[:64]!r}..."
    )


def add_health(server: grpc.Server, engine: Engine, slots: StreamSlots) -> ModelHealth:
    """Serve the health checking protocol for ``engine`` on ``server`` (not started yet)."""
    servicer = ModelHealth(engine, slots)
    handlers = {
        "Check": grpc.unary_unary_rpc_method_handler(
            servicer.Check,
            request_deserializer=HealthCheckRequest.FromString,
            response_serializer=HealthCheckResponse.SerializeToString,
        ),
        "Watch": grpc.unary_stream_rpc_method_handler(
            servicer.Watch,
            request_deserializer=HealthCheckRequest.FromString,
            response_serializer=HealthCheckResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    return servicer


__all__ = ["MAX_SERVICE_CHARS", "SERVICE", "ModelHealth", "add_health"]
