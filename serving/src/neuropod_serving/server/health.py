"""gRPC's health checking protocol (``grpc.health.v1.Health``), what Kubernetes' gRPC probes and
``grpc_health_probe`` call, on the same port as the inference service.

Built on grpcio-health-checking (gRPC's own implementation, in the ``[server]`` extra):

- service ``""``: the server. SERVING while it serves (models load before the port
  opens, as ServerReady says), NOT_SERVING once it is shutting down.
- service ``"<model>"``: that model. SERVING while it is loaded, NOT_SERVING once
  unloaded (or while the server shuts down). ``Check`` of a name that was never
  loaded here answers NOT_FOUND; ``Watch`` of one answers SERVICE_UNKNOWN and
  keeps the stream open, as the protocol says, and sends SERVING when it loads.

Like the REST health routes and ServerLive/ServerReady, the service needs no
token with ``--auth-token-file``: probes carry none. A ``Watch`` stream holds
no thread of the server's pool (updates are sent from one thread of this
module's), but it counts against the open streams bound (``--max-grpc-streams``).
"""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from neuropod_serving.server.engine import Engine
from neuropod_serving.server.grpc_repository import StreamSlots
from neuropod_serving.server.grpc_service import Refused
from neuropod_serving.server.registry import ServedModel

SERVICE = "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: Seconds a stopping server waits for Watch streams to be told NOT_SERVING.
SHUTDOWN_NOTICE_S = 2.0


class ModelHealth(health.HealthServicer):  # type: ignore[misc]  # grpcio-health-checking ships no types
    """The statuses of the server and of each model of ``engine``, kept in step with its loads and unloads.

    ``Check`` answers from this class's own table, updated at once; ``Watch`` streams are
    told by grpcio-health-checking's own code on a thread of their own, in order, so a
    watcher that stops reading can hold only that thread, never a load, an unload or a
    stop of the server (which waits :data:`SHUTDOWN_NOTICE_S` at most for watchers to be told).
    """

    def __init__(self, engine: Engine, slots: StreamSlots) -> None:
        super().__init__(experimental_non_blocking=True)
        self._engine = engine
        self._slots = slots
        self._statuses: dict[str, int] = {}
        self._notices = futures.ThreadPoolExecutor(1, thread_name_prefix="neuropod-health")
        self._update("", SERVING)
        for served in engine.registry:
            self._update(served.name, SERVING)
        engine.listeners.append(self._changed)

    def _update(self, service: str, status: int) -> None:
        self._statuses[service] = status
        self._notices.submit(self.set, service, status)

    def _changed(self, name: str, served: ServedModel | None) -> None:
        self._update(name, SERVING if served is not None else NOT_SERVING)

    def Check(self, request: Any, context: Any) -> Any:
        status = self._statuses.get(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"no service {request.service!r} here: the server is '', a model is its name")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request: Any, context: Any, send_response_callback: Any = None) -> Any:
        try:
            self._slots.take("Health/Watch")
        except Refused as e:
            context.abort(e.code, e.details)
        if not context.add_callback(self._slots.give_back):
            self._slots.give_back()  # the call ended already
        return super().Watch(request, context, send_response_callback)

    def shut_down(self) -> None:
        """Every status NOT_SERVING (watchers are told), and stop following the engine."""
        try:
            self._engine.listeners.remove(self._changed)
        except ValueError:
            pass
        for service in self._statuses:
            self._statuses[service] = NOT_SERVING
        try:
            self._notices.submit(self.enter_graceful_shutdown).result(SHUTDOWN_NOTICE_S)
        except (futures.TimeoutError, RuntimeError):
            pass  # a watcher that does not read; or shut down already
        self._notices.shutdown(wait=False)


def add_health(server: grpc.Server, engine: Engine, slots: StreamSlots) -> ModelHealth:
    """Serve the health checking protocol for ``engine`` on ``server`` (not started yet)."""
    servicer = ModelHealth(engine, slots)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


__all__ = ["SERVICE", "ModelHealth", "add_health"]
