"""Starting the gRPC server: grpcio's threaded server over an :class:`ElasticPool`, with
``inference.GRPCInferenceService`` (:mod:`.grpc_service`), Triton's repository RPCs and
ModelStreamInfer (:mod:`.grpc_repository`) and gRPC's health service (:mod:`.health`).

The server is grpcio's threaded one (``grpc.server`` with a thread pool), not its asyncio
one: see :mod:`.grpc_service` for why.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

import neuropod_serving.server.extensions as extensions
import neuropod_serving.server.grpc_repository as grpc_repository
from neuropod.errors import NeuropodError
from neuropod_serving.defaults import DEFAULT_MAX_GRPC_STREAMS, DEFAULT_MAX_REQUEST_BYTES
from neuropod_serving.server.engine import Engine
from neuropod_serving.server.grpc_repository import StreamSlots
from neuropod_serving.server.grpc_service import METHODS, SERVICE, Servicer, wrap
from neuropod_serving.server.health import add_health

#: Threads answering calls when the caller does not say: enough for every
#: OPE worker to be busy while others decode, and for batches to fill.
MIN_THREADS = 16


def _handlers(
    engine: Engine, *, auth_token: str | None, access_log: bool, streams: Any = None
) -> dict[str, grpc.RpcMethodHandler]:
    """Every method's handler; with ``streams`` (a :class:`~.grpc_repository.StreamSlots`), also
    Triton's repository RPCs and ModelStreamInfer (:mod:`.grpc_repository`)."""
    servicer = Servicer(engine, extensions.listed(extensions.GRPC, engine) if streams is not None else None)
    expected = None if auth_token is None else f"Bearer {auth_token}".encode()
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            wrap(
                name,
                getattr(servicer, m.handler),
                parse=getattr(m.request, "FromString", m.request),
                model_of=m.model_of,
                expected_auth=None if m.open else expected,
                access_log=access_log,
            ),
            request_deserializer=None,  # the bytes: wrap parses them after authentication
            response_serializer=None if m.response is None else m.response.SerializeToString,
        )
        for name, m in METHODS.items()
    }
    if streams is not None:
        handlers.update(
            grpc_repository.handlers(
                engine, servicer, streams, wrap=wrap, expected_auth=expected, access_log=access_log
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
        :data:`~neuropod_serving.defaults.DEFAULT_MAX_GRPC_STREAMS`); the pool has that many more threads.
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
    # Each open stream holds a thread: the pool has one more per stream allowed, so
    # streams never leave unary calls without one.
    streams = StreamSlots(max_streams if max_streams is not None else DEFAULT_MAX_GRPC_STREAMS)
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
        # Streams read now end at once with an error saying so, not silently at the end of the grace period.
        streams.stop("the server is stopping")
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

        gRPC health says NOT_SERVING first, for every service, so that watchers see the server go;
        each ModelStreamInfer request in flight ends at once with an ``error_message`` saying the
        server is stopping (its model's generator is closed), and its stream with it.
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
    (running or queued, :class:`~neuropod_serving.server.admission.ModelLimits`), so that
    busy models never leave health, metadata or another model's calls without a
    thread. grpcio starts threads only when none is idle: the headroom costs nothing
    while models keep up."""
    per_model = engine.workers * (engine.batching.max_batch_size if engine.batching is not None else 1)
    models = max(len(engine.registry), len({e.name for e in engine.registry.index()}))
    return max(MIN_THREADS, 2 * per_model) + models * engine.most_in_flight


__all__ = [
    "MIN_THREADS",
    "GrpcServer",
    "ElasticPool",
    "base_threads",
    "default_threads",
    "start_grpc_server",
]
