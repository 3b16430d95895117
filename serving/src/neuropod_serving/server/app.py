"""The REST half of the Open Inference Protocol (KServe v2) on Starlette.

Every request body goes through the one codec (:mod:`neuropod_serving.protocol`);
this module only routes, bounds, authenticates and maps errors to statuses.
Decoding, inference and encoding run in a worker thread, so a large tensor or
a slow model never blocks the event loop (health checks keep answering).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import neuropod_serving.server.extensions as extensions
import neuropod_serving.server.repository_api as repository_api
import neuropod_serving.server.rest_io as rest_io
import neuropod_serving.server.shared_memory_api as shared_memory_api
from neuropod import _json
from neuropod.errors import NeuropodError
from neuropod_serving import __version__
from neuropod_serving.defaults import DEFAULT_MAX_REQUEST_BYTES
from neuropod_serving.protocol import (
    InferRequest,
    ProtocolError,
    build_infer_response,
    parse_infer_request,
)
from neuropod_serving.protocol.options import require_sequence
from neuropod_serving.server.admission import Retired
from neuropod_serving.server.classification import answers_small
from neuropod_serving.server.compression import COMPRESS_FROM, chosen, compressed, decoded_body
from neuropod_serving.server.engine import CLIENT_ERRORS, Engine
from neuropod_serving.server.limits import bearer_refusal
from neuropod_serving.server.metrics import CONTENT_TYPE, ServerMetrics
from neuropod_serving.server.model_config import model_config
from neuropod_serving.server.model_exits import EXITS, model_exited
from neuropod_serving.server.registry import ServedModel
from neuropod_serving.server.rest_io import (
    INLINE_BODY_BYTES,
    Disconnected,
    TooLarge,
    add_chunk,
    answer_to,
    check_declared,
    request_body,
    request_head,
    send_body,
    send_error,
)
from neuropod_serving.server.sse import ROUTES as STREAM_ROUTES
from neuropod_serving.server.sse import StreamRoutes, refuse_decoupled
from neuropod_serving.server.statistics import NO_STATISTICS, served_statistics

log = logging.getLogger("neuropod_serving.server")
# Load balancers and orchestrators probe these without credentials.
_OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class _BearerAuth:
    """Every route but health needs ``Authorization: Bearer <token>``.

    Pure ASGI rather than Starlette's BaseHTTPMiddleware, which would wrap
    every response in an extra task and stream.
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        # Checked on the headers alone: a request without the token is refused before its body is read.
        reason = bearer_refusal(given, self.expected)
        if reason is not None:
            response = _error(
                401,
                f"this server needs 'Authorization: Bearer <token>' ({reason})",
                headers={"WWW-Authenticate": 'Bearer realm="neuropod"'},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 before it passes ``limit`` bytes.

    Content-Length is checked before reading anything; a chunked body (no
    Content-Length) is counted as it streams, so neither kind is ever held
    in memory past the limit.
    """
    check_declared(request.headers.get("content-length"), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size = add_chunk(chunks, size, chunk, limit)
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    encoding = request.headers.get("content-encoding")
    if encoding is not None:
        return bytes(await run_in_threadpool(decoded_body, body, encoding.encode("latin-1"), limit))
    return body


class _RawInfer:
    """``POST /v2/models/{m}[/versions/{v}]/infer`` straight on ASGI: the hot path
    skips Starlette's routing, Request and Response objects (about a fifth of a
    small request's time). Every other request goes to ``app``."""

    def __init__(self, app: ASGIApp, engine: Engine, limit: int) -> None:
        self.app = app
        self.engine = engine
        self.limit = limit
        self.streams = StreamRoutes(engine, limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            parts = scope["path"].split("/")
            n = len(parts)
            if (
                (n == 5 or (n == 7 and parts[4] == "versions"))
                and parts[1] == "v2"
                and parts[2] == "models"
                and parts[3]
            ):
                last = parts[-1]
                if last == "infer":
                    await self._infer(scope, receive, send, parts[3], parts[5] if n == 7 else None)
                    return
                if last in STREAM_ROUTES:  # infer_stream, generate, generate_stream (sse.py)
                    await self.streams(scope, receive, send, last, parts[3], parts[5] if n == 7 else None)
                    return
        await self.app(scope, receive, send)

    async def _infer(self, scope: Scope, receive: Receive, send: Send, name: str, version: str | None) -> None:
        engine = self.engine
        started = time.perf_counter()
        failure: str | None = "client"
        held = None  # the shared memory regions the request uses, if any
        response_encoding: bytes | None = None
        try:
            s = engine.get(name, version)
            refuse_decoupled(s)
            head = request_head(scope)
            header_length = head.header_length
            body = await request_body(receive, head, self.limit)
            if header_length is not None:
                # Binary tensors are decoded as views of the body: of a bytearray they are
                # writable, which a model may assume (one copy of the body instead of a copy
                # per tensor before the run).
                body = bytearray(body)
            small = len(body) <= INLINE_BODY_BYTES or (
                header_length is None and len(body) <= INLINE_JSON_BYTES and _commas(body) <= INLINE_JSON_VALUES
            )
            decoded = (
                _decode(s, body, header_length) if small else await run_in_threadpool(_decode, s, body, header_length)
            )
            if s.stateful:
                require_sequence(s.name, decoded.options)
            requested = list(decoded.outputs) if decoded.outputs is not None else None
            if decoded.shared_memory is not None:
                held = shared_memory_api.lease(engine, decoded)
                if held.input_bytes <= shared_memory_api.INLINE_BYTES:
                    shared_memory_api.read_inputs(held, s, decoded)
                else:
                    await run_in_threadpool(shared_memory_api.read_inputs, held, s, decoded)
                small = small and held.output_bytes <= shared_memory_api.INLINE_BYTES
            failure = "model"
            try:
                # A version swapped while the body came: the latest, if none was named.
                s = engine.current(s, version)
                try:
                    outputs = await engine.infer(s, decoded.inputs, requested, decoded.options)
                except Retired:  # swapped before it was admitted (rare): again, as infer_latest does
                    if version:
                        raise
                    s, outputs = await engine.infer_latest(s, version, decoded.inputs, requested, decoded.options)
            except CLIENT_ERRORS:
                failure = "client"
                raise
            small = small and answers_small(decoded.options, outputs)  # many classes: encoded off the loop
            if held is None:
                content, json_length = (
                    _encode(s, decoded, outputs) if small else await run_in_threadpool(_encode, s, decoded, outputs)
                )
            else:
                failure = "client"  # an output that does not fit where the request put it
                content, json_length = (
                    shared_memory_api.rest_body(held, s, decoded, outputs)
                    if small
                    else await run_in_threadpool(shared_memory_api.rest_body, held, s, decoded, outputs)
                )
            if head.accept is not None and len(content) >= COMPRESS_FROM:
                response_encoding = chosen(head.accept)
                if response_encoding is not None:
                    content = (
                        compressed(content, response_encoding)
                        if len(content) <= INLINE_BODY_BYTES
                        else await run_in_threadpool(compressed, content, response_encoding)
                    )
            failure = None
        except Disconnected:
            return
        except Exception as e:  # noqa: BLE001 - answered; answer_to logs what is no NeuropodError
            await send_error(send, *answer_to(e, name))
            return
        except EXITS as e:  # a model's sys.exit() that reached here another way (see model_exits)
            await send_error(send, *answer_to(model_exited(name, e), name))
            return
        finally:
            if held is not None:
                held.release()
            if name in engine.registry:
                engine.metrics.request(name, "rest", time.perf_counter() - started, failure)
        await send_body(send, 200, content, json_length, response_encoding)


#: Plain JSON bodies (no binary tensors) up to this size also stay on the loop when they hold at
#: most :data:`INLINE_JSON_VALUES` commas (about one per number). Their decode is the parse of every
#: number, about 50 ns each (100 FP32 tensors of [10, 5], 104 kB, 5,500 commas: 0.4 to 0.6 ms;
#: 128 kB of one-digit integers: 3 ms), while handing it to a thread and back cost 0.25 ms of the
#: former's 1.2 ms. Counting the commas costs about 0.01 ms.
INLINE_JSON_BYTES = 128 * 1024
#: See :data:`INLINE_JSON_BYTES`: a body of up to this many numbers decodes in about a millisecond.
INLINE_JSON_VALUES = 16 * 1024


def _commas(body: bytes | bytearray) -> int:
    """The commas in ``body`` (numpy's vector compare: bytes.count takes 5x longer)."""
    return int(np.count_nonzero(np.frombuffer(body, np.uint8) == _COMMA))


_COMMA = ord(",")


def _decode(served: ServedModel, body: bytes | bytearray, json_length: str | None) -> InferRequest:
    return parse_infer_request(body, json_length, input_spec=served.input_specs)


def _encode(served: ServedModel, request: InferRequest, outputs: dict[str, Any]) -> tuple[bytes, int | None]:
    # Engine.infer put the outputs in the order they are sent.
    response = build_infer_response(
        served.name,
        outputs,
        binary=request.binary_outputs(outputs),
        model_version=served.version,
        id=request.id,
    )
    return response.content, response.json_length


def _repository_body(body: bytes) -> dict[str, Any]:
    """A repository request's JSON object ({} for an empty body). :raises ProtocolError: not a JSON object."""
    if not body.strip():
        return {}
    try:
        # Bounded in depth and size before parsing: a body nested thousands deep is a 400, not a RecursionError.
        value = _json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ProtocolError(
            f"a repository request body is a JSON object in UTF-8 ({e.reason} at byte {e.start})"
        ) from None
    except ValueError as e:
        raise ProtocolError(f"a repository request body is a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"a repository request body is a JSON object, not {type(value).__name__}")
    return value


def metrics_only(app: ASGIApp, *, port: int) -> ASGIApp:
    """``app``, except that connections to ``port`` get only ``GET /metrics`` (404 for the rest),
    so one uvicorn server answers on the REST port and on the metrics port."""

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if scope["type"] == "http" and server is not None and server[1] == port and scope["path"] != "/metrics":
            await _error(404, f"port {port} serves only GET /metrics")(scope, receive, send)
            return
        await app(scope, receive, send)

    return route


def create_app(
    engine: Engine,
    *,
    auth_token: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> ASGIApp:
    """The REST app serving every model of ``engine``, and its metrics at ``/metrics``.

    :param auth_token: when given, every route except the health probes needs
        ``Authorization: Bearer <auth_token>``.
    :param max_request_bytes: larger request bodies get 413 without being read.
    """
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be at least 1, not {max_request_bytes}")
    if auth_token is not None and not auth_token:
        raise ValueError("auth_token is empty: pass None to serve without authentication")

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        # Models load before the server listens, so a listening server is ready; one of
        # several processes is once they all listen (and until one stops).
        if engine.group is not None and not engine.group.ready:
            return JSONResponse({"ready": False}, status_code=503)
        return JSONResponse({"ready": True})

    served_extensions = extensions.listed(extensions.REST, engine)

    async def server_metadata(request: Request) -> Response:
        return JSONResponse({"name": "neuropod", "version": __version__, "extensions": served_extensions})

    def served(request: Request) -> ServedModel:
        params = request.path_params
        return engine.get(params["model"], params.get("version"))

    async def metadata(request: Request) -> Response:
        return JSONResponse(served(request).metadata)

    async def model_ready(request: Request) -> Response:
        s = served(request)
        return JSONResponse({"name": s.name, "ready": True})

    metrics = engine.metrics

    async def infer(request: Request) -> Response:
        # POSTs to these paths never get here (_RawInfer answers them); the
        # routes stay so that other methods get Starlette's 405.
        raise AssertionError("POST .../infer and the streaming routes are handled by _RawInfer")

    async def config(request: Request) -> Response:
        return JSONResponse(model_config(engine, served(request)))

    async def statistics(request: Request) -> Response:
        if not isinstance(metrics, ServerMetrics):
            return _error(404, NO_STATISTICS)
        name = request.path_params.get("model")
        models = (
            [served(request)] if name is not None else sorted(engine.registry, key=lambda s: (s.name, int(s.version)))
        )
        return JSONResponse({"model_stats": served_statistics(metrics, models)})

    async def prometheus(request: Request) -> Response:
        if not isinstance(metrics, ServerMetrics):
            # Metrics kept elsewhere (Ray's metrics agents) say where; none kept at all, that.
            return _error(404, getattr(metrics, "elsewhere", "this server keeps no metrics"))
        if engine.group is not None:  # every process's, summed
            try:
                return Response(await run_in_threadpool(engine.group.metrics), media_type=CONTENT_TYPE)
            except NeuropodError as e:
                return _error(503, f"the metrics of the server processes could not be collected: {e}")
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def repository_index(request: Request) -> Response:
        ready = _repository_body(await _read_body(request, max_request_bytes)).get("ready", False)
        if not isinstance(ready, bool):
            raise ProtocolError(f"'ready' in a repository index request is true or false, not {ready!r}")
        entries = await run_in_threadpool(repository_api.index, engine, ready)
        return JSONResponse([e.to_json() for e in entries])

    async def repository_load(request: Request) -> Response:
        params = _repository_body(await _read_body(request, max_request_bytes)).get("parameters")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ProtocolError(f"'parameters' of a load request is a JSON object, not {type(params).__name__}")
        await run_in_threadpool(repository_api.load, engine, request.path_params["model"], params)
        return JSONResponse({})

    async def repository_unload(request: Request) -> Response:
        await _read_body(request, max_request_bytes)
        await run_in_threadpool(repository_api.unload, engine, request.path_params["model"])
        return JSONResponse({})

    async def on_failure(request: Request, exc: Exception) -> Response:
        answer = rest_io.failure(exc, request.path_params.get("model", "?"))
        assert answer is not None  # registered for NeuropodError and TooLarge only
        return _error(*answer)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        # Starlette's own answers (no such route, a method the route does not take) are plain
        # text; clients of the protocol parse every error as {"error": ...}.
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message = (
                f"no route {request.url.path!r} on this server (the Open Inference Protocol's routes are under /v2)"
            )
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not a method of {request.url.path!r}" + (
                f"; it takes {allowed}" if allowed else ""
            )
        else:
            message = str(exc.detail)
        return _error(exc.status_code, message, headers=dict(exc.headers) if exc.headers else None)

    async def on_bug(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(500, f"internal error while answering {request.method} {request.url.path}: {type(exc).__name__}")

    # Starlette tries routes in order, a regex each: infer, the hot path, first.
    routes = [
        Route("/v2/models/{model}/infer", infer, methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/infer", infer, methods=["POST"]),
        # As infer: POSTs go to StreamRoutes (sse.py); the routes give other methods their 405.
        *(
            Route(f"/v2/models/{{model}}{versioned}/{kind}", infer, methods=["POST"])
            for kind in sorted(STREAM_ROUTES)
            for versioned in ("", "/versions/{version}")
        ),
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2", server_metadata, methods=["GET"]),
        # Before /v2/models/{model}, which "stats" would match too (as in Triton, it means all models).
        Route("/v2/models/stats", statistics, methods=["GET"]),
        Route("/v2/models/{model}/stats", statistics, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}/stats", statistics, methods=["GET"]),
        Route("/v2/models/{model}/config", config, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}/config", config, methods=["GET"]),
        Route("/v2/models/{model}", metadata, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}", metadata, methods=["GET"]),
        Route("/v2/models/{model}/ready", model_ready, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}/ready", model_ready, methods=["GET"]),
        Route("/v2/repository/index", repository_index, methods=["POST"]),
        Route("/v2/repository/models/{model}/load", repository_load, methods=["POST"]),
        Route("/v2/repository/models/{model}/unload", repository_unload, methods=["POST"]),
        Route("/metrics", prometheus, methods=["GET"]),
        *shared_memory_api.routes(engine, lambda request: _read_body(request, max_request_bytes)),
    ]
    handlers: dict[Any, Any] = {
        NeuropodError: on_failure,
        TooLarge: on_failure,
        HTTPException: on_http_error,
        Exception: on_bug,
    }
    app: ASGIApp = _RawInfer(Starlette(routes=routes, exception_handlers=handlers), engine, max_request_bytes)
    if auth_token is not None:
        app = _BearerAuth(app, auth_token)
    return app
