"""Streaming over REST on bare ASGI: ``POST /v2/models/{m}[/versions/{v}]/infer_stream`` and
``/generate_stream`` answer with Server-Sent Events, ``/generate`` with one JSON object.

A stream answers 200 with ``text/event-stream`` once its first response is ready, and sends each
response as one event (``data: <JSON>`` and a blank line): an inference response on
``infer_stream``, a generate response on ``generate_stream``. The responses ready at once go out
in one write. A request that fails before the first response (unknown model, bad body, too many
open streams, the model failed at once) gets the usual JSON error and status instead; a failure
after it (the model raised, a response broke its spec, the server is stopping) is a last event
``data: {"error": "<message>"}``, then the end.

Flow: the model runs at most :attr:`~neuropod_serving.server.streams.StreamLimits.buffered`
responses ahead of what the client has taken (uvicorn holds ``send`` while the socket is full), a
client that goes away closes the stream (its model's generator's ``finally`` runs), and a server
that stops ends each open stream with an error event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.types import Message, Receive, Scope, Send

from neuropod.errors import NeuropodError
from neuropod_serving.errors import DecoupledModelError, ProtocolError, StreamStoppedError
from neuropod_serving.protocol import InferRequest, build_infer_response, parse_infer_request
from neuropod_serving.protocol.bodies import ENCODER, orjson_module
from neuropod_serving.protocol.datatypes import NATIVE_DTYPES
from neuropod_serving.protocol.events import EVENT_STREAM, error_event, event
from neuropod_serving.protocol.generate import generate_response, parse_generate_request
from neuropod_serving.server.engine import CLIENT_ERRORS, Engine
from neuropod_serving.server.registry import ServedModel
from neuropod_serving.server.rest_io import (
    INLINE_BODY_BYTES,
    ON_SHUTDOWN,
    Disconnected,
    answer_to,
    log,
    request_body,
    request_head,
    send_body,
    send_error,
)
from neuropod_serving.server.streams import Outputs, ServedStream

#: The last path segments this module answers.
ROUTES = frozenset({"infer_stream", "generate_stream", "generate"})
STOPPING = "the server is stopping"

_NOTHING: Message = {"type": "http.response.body", "body": b"", "more_body": True}
_HEADERS = [
    (b"content-type", EVENT_STREAM.encode("ascii")),
    (b"cache-control", b"no-cache"),
    # Proxies that buffer responses (nginx) pass each event on at once.
    (b"x-accel-buffering", b"no"),
]


def refuse_decoupled(served: ServedModel) -> None:
    """What ``POST .../infer`` answers for a decoupled model: Triton's error (501), naming the routes to use.

    :raises DecoupledModelError: ``served`` is decoupled.
    """
    if getattr(served.model, "decoupled", False):
        base = f"/v2/models/{served.name}"
        raise DecoupledModelError(
            served.name,
            "HTTP end point",
            f"POST {base}/infer_stream or {base}/generate_stream for its responses as Server-Sent Events "
            "(or gRPC ModelStreamInfer)",
        )


class StreamRoutes:
    """Answers the streaming routes of ``engine``'s models (called by the REST app's raw router)."""

    def __init__(self, engine: Engine, limit: int) -> None:
        self.engine = engine
        self.limit = limit

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, route: str, name: str, version: str | None
    ) -> None:
        engine = self.engine
        started = time.perf_counter()
        failure: str | None = "client"
        try:
            try:
                served = engine.get(name, version)
                request = await self._request(scope, receive, served, route)
                if route == "generate" and not getattr(served.model, "decoupled", False):
                    # One answer from an ordinary model: through its batcher and run slots, as /infer.
                    failure = "model"
                    try:
                        served, outputs = await engine.infer_latest(
                            served, version, request.inputs, None, request.options
                        )
                    except CLIENT_ERRORS:
                        failure = "client"
                        raise
                    failure = None
                    await send_body(
                        send, 200, generate_response(served.name, served.version, outputs, request.id), None
                    )
                    return
                served, stream = engine.open_stream_latest(
                    served, version, request.inputs, _requested(request), request.options
                )
            except Disconnected:
                return
            except Exception as e:  # noqa: BLE001 - answered; answer_to logs what is no NeuropodError
                await send_error(send, *answer_to(e, name))
                return
            failure = await _Answer(served, stream, request, route, scope, receive, send).run()
        finally:
            if name in engine.registry:
                engine.metrics.request(name, "rest", time.perf_counter() - started, failure)

    async def _request(self, scope: Scope, receive: Receive, served: ServedModel, route: str) -> InferRequest:
        head = request_head(scope)
        header_length = head.header_length
        body = await request_body(receive, head, self.limit)
        if route != "infer_stream":
            if header_length is not None:
                raise ProtocolError(f"a {route} request is one JSON object; it takes no binary tensors")
            if len(body) <= INLINE_BODY_BYTES:
                return parse_generate_request(body, served.input_specs)
            return await run_in_threadpool(parse_generate_request, body, served.input_specs)
        if header_length is not None:
            body = bytearray(body)  # binary inputs are views of it: writable, as /infer's
        if len(body) <= INLINE_BODY_BYTES:
            request = parse_infer_request(body, header_length, input_spec=served.input_specs)
        else:
            request = await run_in_threadpool(parse_infer_request, body, header_length, input_spec=served.input_specs)
        _check_streamable(request)
        return request


def _check_streamable(request: InferRequest) -> None:
    """Refuse what an infer request may ask that a stream of events cannot give."""
    if request.shared_memory is not None:
        raise ProtocolError("a streamed request's tensors go in its body: shared memory is for POST .../infer")
    wants_binary = request.binary_data_output or any((request.outputs or {}).values())
    if wants_binary:
        raise ProtocolError(
            "the responses of infer_stream are JSON events: ask for no binary_data outputs "
            "(binary_data_output false, or leave it out)"
        )
    options = request.options
    if options is not None and options.classification:
        raise ProtocolError("the classification extension is for POST .../infer; infer_stream sends the outputs")


def _requested(request: InferRequest) -> list[str] | None:
    return list(request.outputs) if request.outputs is not None else None


class _Answer:
    """One open stream sent to its client: as events, or (``/generate``) as its one response."""

    def __init__(
        self, served: ServedModel, stream: ServedStream, request: InferRequest, route: str,
        scope: Scope, receive: Receive, send: Send,
    ) -> None:  # fmt: skip
        self.served = served
        self.stream = stream
        self.request_id = request.id
        self.route = route
        self.scope = scope
        self.receive = receive
        self.send = send
        self.started = False  # the response's head went out
        self.encode: Callable[[list[Outputs]], bytes] = (
            _InferEvents(served.name, served.version, request.id) if route == "infer_stream" else self._generate_events
        )

    async def run(self) -> str | None:
        """Send the stream; the failure to count (None, ``"client"`` or ``"model"``)."""
        stream = self.stream
        watcher = asyncio.ensure_future(_watch(self.receive, stream))
        # uvicorn's graceful shutdown (neuropod serve's protocol) ends the stream with an error event at once.
        self.scope[ON_SHUTDOWN] = lambda: stream.cancel(STOPPING)
        try:
            if self.route == "generate":
                return await self._one()
            return await self._events()
        except asyncio.CancelledError:
            # uvicorn cancels a response still going once its graceful shutdown stops waiting (with
            # a protocol that has not ended the stream as the shutdown began: h11, or an
            # embedder's): end it as a stopping server does, and let the task end answered (an
            # exception here would only be logged, with the connection cut mid-stream).
            stream.close()
            message = f"stream of model {self.served.name!r} ended: {STOPPING}"
            try:
                if self.started:
                    await self._write(error_event(message))
                    await self._end()
                else:
                    await send_error(self.send, 503, message)
            except Exception:  # noqa: BLE001 - the connection is going away too: nothing more to tell
                pass
            return "model"
        finally:
            self.scope.pop(ON_SHUTDOWN, None)
            stream.close()
            watcher.cancel()

    async def _events(self) -> str | None:
        stream = self.stream
        while True:
            try:
                batch = await stream.next_batch()
            except StopAsyncIteration:
                break
            except NeuropodError as e:
                status, message = _stream_failure(e, self.served.name)
                if not self.started:
                    await send_error(self.send, status, message)
                else:
                    await self._write(error_event(message))
                    await self._end()
                return "model"
            if sum(a.nbytes for outputs in batch for a in outputs.values()) <= INLINE_BODY_BYTES:
                chunk = self.encode(batch)
            else:
                chunk = await run_in_threadpool(self.encode, batch)
            await self._write(chunk)
        await self._end()
        return None

    async def _one(self) -> str | None:
        """``/generate`` of a decoupled model: its one response, or an error when it made none or more."""
        stream = self.stream
        responses: list[Outputs] = []
        try:
            while len(responses) < 2:
                responses += await stream.next_batch(2 - len(responses))
        except StopAsyncIteration:
            pass
        except NeuropodError as e:
            await send_error(self.send, *_stream_failure(e, self.served.name))
            return "model"
        finally:
            stream.close()  # a second response ends it: the model's generator stops
        name = self.served.name
        if len(responses) != 1:
            count = "no response" if not responses else "more than one response"
            await send_error(
                self.send,
                400,
                f"model {name!r} answered this request with {count}; POST .../generate answers with exactly one "
                f"(Triton's rule): POST /v2/models/{name}/generate_stream for every response the model makes",
            )
            return "client"
        content = generate_response(name, self.served.version, responses[0], self.request_id)
        await send_body(self.send, 200, content, None)
        return None

    def _generate_events(self, batch: list[Outputs]) -> bytes:
        name, version, request_id = self.served.name, self.served.version, self.request_id
        return b"".join(event(generate_response(name, version, outputs, request_id)) for outputs in batch)

    async def _write(self, chunk: bytes) -> None:
        if not self.started:
            self.started = True
            await self.send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
        # An empty write returns once the connection's write buffer has drained (uvicorn's flow
        # control), so the next batch is taken only then: responses made meanwhile wait in the
        # stream's buffer, which holds the model back, not in this coroutine.
        await self.send(_NOTHING)

    async def _end(self) -> None:
        if not self.started:  # no response at all: an empty stream
            self.started = True
            await self.send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})


class _InferEvents:
    """The events of one ``infer_stream``: each response's inference response, the JSON ``/infer``
    answers with. Numeric tensors are written by orjson straight from numpy, inside JSON made once
    per output's name, dtype and shape (a stream's responses mostly repeat their forms); anything
    else (text, NaN, no orjson) by the codec's :func:`build_infer_response`."""

    __slots__ = ("_forms", "_head", "_id", "_name", "_orjson", "_version")

    def __init__(self, name: str, version: str, request_id: str | None) -> None:
        self._name, self._version, self._id = name, version, request_id
        head: dict[str, Any] = {"model_name": name, "model_version": version}
        if request_id is not None:
            head["id"] = request_id
        self._head = b"data: " + ENCODER.encode(head)[:-1].encode("utf-8") + b',"outputs":['
        self._forms: dict[tuple[str, np.dtype[Any], tuple[int, ...]], bytes] = {}
        self._orjson = orjson_module()

    def __call__(self, batch: list[Outputs]) -> bytes:
        parts = []
        for outputs in batch:
            fast = self._fast(outputs) if self._orjson is not None else None
            if fast is None:
                fast = event(
                    build_infer_response(self._name, outputs, model_version=self._version, id=self._id).content
                )
            parts.append(fast)
        return b"".join(parts)

    def _fast(self, outputs: Outputs) -> bytes | None:
        orjson = self._orjson
        pieces = []
        for name, array in outputs.items():
            if type(array) is not np.ndarray:
                return None
            form = (name, array.dtype, array.shape)
            prefix = self._forms.get(form)
            if prefix is None:
                datatype = _NUMERIC.get(array.dtype)
                if datatype is None or type(name) is not str:
                    return None
                shape = ",".join(map(str, array.shape))
                prefix = f'{{"name":{ENCODER.encode(name)},"datatype":"{datatype}","shape":[{shape}],"data":'.encode()
                if len(self._forms) < _MAX_FORMS:
                    self._forms[form] = prefix
            try:
                if array.dtype.kind == "f" and array.dtype.itemsize < 8:
                    # As the codec writes them: the float64 digits of each value (orjson's own for
                    # float32 are its shortest, another text of the same number).
                    data = orjson.dumps(array.ravel().tolist())
                else:
                    data = orjson.dumps(array.ravel(), option=orjson.OPT_SERIALIZE_NUMPY)
            except TypeError:  # orjson.JSONEncodeError: a dtype or byte order orjson does not write
                return None
            if array.dtype.kind == "f" and b"null" in data:  # NaN and infinities: the codec writes them
                return None
            pieces.append(prefix + data + b"}")
        return self._head + b",".join(pieces) + b"]}\n\n"


#: Numeric dtypes (this host's byte order) and their OIP datatypes.
_NUMERIC: dict[np.dtype[Any], str] = {dtype: datatype for datatype, dtype in NATIVE_DTYPES.items()}
#: Output forms remembered per stream (a model whose shapes vary still gets the right JSON, made each time).
_MAX_FORMS = 64


def _stream_failure(e: NeuropodError, model: str) -> tuple[int, str]:
    """The status and message of an error that ended a stream (its inputs were checked when it
    opened, so it is the model's doing, or the server's)."""
    if isinstance(e, StreamStoppedError):
        return 503, str(e)
    # A response off its spec is the model's fault here, not the request's (not answer_to's 400).
    log.error("model %r failed: %s", model, e, exc_info=e)
    return 500, f"model {model!r} failed: {e}"


async def _watch(receive: Receive, stream: ServedStream) -> None:
    """Close ``stream`` when its client goes away (its body was read: the next message is the disconnect)."""
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            stream.close()
            return


__all__ = ["ROUTES", "STOPPING", "StreamRoutes", "refuse_decoupled"]
