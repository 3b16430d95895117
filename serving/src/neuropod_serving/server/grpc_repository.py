"""Triton's gRPC extensions beyond the Open Inference Protocol: the model repository and ModelStreamInfer.

Registered by :func:`neuropod_serving.server.grpc_server.start_grpc_server` on
``inference.GRPCInferenceService`` next to the six OIP methods, with the same
authentication, status codes and access log:

- ``RepositoryIndex``, ``RepositoryModelLoad`` (with a ``config`` parameter,
  see :mod:`~neuropod_serving.server.config_override`) and
  ``RepositoryModelUnload`` call :mod:`~neuropod_serving.server.repository_api`,
  as the REST routes do, so both protocols answer alike.
- ``ModelStreamInfer`` (a bidirectional stream) answers each ModelInferRequest
  as Triton does:

  * a *decoupled* model's request (its package says ``"decoupled": true``) with
    each of its responses as the model makes it (zero or more), each carrying the
    request's id and the response parameter ``triton_final_response: false``;
    with the request parameter ``triton_enable_empty_final_response: true``, an
    empty response (no outputs) with ``triton_final_response: true`` follows the
    last one. Without it nothing marks the end, as with Triton's decoupled models
    that send their final flag alone (``repeat_int32``): a generator cannot tell
    its last response until it has ended, and holding each response back until
    the next one would delay every response by a step;
  * any other model's request with its one answer (``triton_final_response: true``);
    a stateful model's request is a step of the sequence its ``sequence_id``
    names (Triton's ``simple_grpc_sequence_stream_infer_client.py``), run as a
    unary ModelInfer runs it, so one stream can carry interleaved sequences;
  * a request that fails (unknown model, bad input, too many open streams of its
    model, its model raising after some responses, a response off its output
    spec) with ``error_message`` (the text a unary ModelInfer would have as its
    status details), the request's id, and ``triton_final_response: true``, after
    the responses sent before it; the stream goes on with the next request.

  Requests of one stream run one after another on the thread that reads it (open
  several streams, or use ModelInfer, for requests in parallel); a decoupled
  model's generator runs on that thread, one response per message sent, so a
  client that reads slowly holds it back (gRPC's flow control) and the server
  holds no responses for it. A client that cancels or goes away closes the
  generator at once, or right after the response it is working on (its
  ``finally`` runs). A stopping server ends each request in flight with an
  ``error_message`` saying so, then the stream.

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
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError

import neuropod_serving.server.repository_api as repository_api
from neuropod.errors import NeuropodError
from neuropod_serving.errors import StreamStoppedError
from neuropod_serving.protocol import ProtocolError
from neuropod_serving.protocol import grpc_codec as codec
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol._grpc import triton_repository_pb2 as rpb
from neuropod_serving.protocol._wire import encode_varint
from neuropod_serving.server.engine import Engine
from neuropod_serving.server.grpc_service import InferCall, Refused, Servicer, authenticate, status_of
from neuropod_serving.server.limits import escape_log
from neuropod_serving.server.streams import ServedStream

log = logging.getLogger("neuropod_serving.server")
access = logging.getLogger("neuropod_serving.access")

#: ModelStreamInferResponse.infer_response: field 2, length-delimited (checked against the descriptor in the tests).
_INFER_RESPONSE_TAG = b"\x12"
#: The response parameter saying whether a response is its request's last (Triton's).
FINAL_RESPONSE = "triton_final_response"
#: The request parameter asking for an empty response with FINAL_RESPONSE true after a decoupled model's last.
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"

Handler = Callable[[Any, grpc.ServicerContext], Any]


class StreamSlots:
    """How many streams may be open at once (:meth:`take` refuses one more at once), and the
    served streams ModelStreamInfer calls read now, ended with an error when the server stops."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_streams must be at least 1, not {limit}")
        self.limit = limit
        self.open = 0
        self._lock = threading.Lock()
        self._reading: set[ServedStream] = set()
        #: Why the server takes no more stream requests (it is stopping), or None.
        self.stopping: str | None = None

    def follow(self, stream: ServedStream) -> None:
        """``stream`` is read by a call now: :meth:`stop` ends it."""
        with self._lock:
            stopping = self.stopping
            if stopping is None:
                self._reading.add(stream)
        if stopping is not None:
            stream.cancel(stopping)

    def forget(self, stream: ServedStream) -> None:
        with self._lock:
            self._reading.discard(stream)

    def stop(self, reason: str) -> None:
        """End every stream read now with ``reason`` as its request's final error (the
        calls send it as their last response and end), and take no more stream requests."""
        with self._lock:
            self.stopping = reason
            reading = list(self._reading)
            self._reading.clear()
        for stream in reading:
            stream.cancel(reason)

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


def _final_parameter(final: bool) -> bytes:
    """ModelInferResponse's ``parameters`` entry ``triton_final_response: final`` in wire form,
    appended to a serialized response (a map entry may come anywhere in a message)."""
    answer = pb.ModelInferResponse()
    answer.parameters[FINAL_RESPONSE].bool_param = final
    return bytes(answer.SerializeToString())


_FINAL = _final_parameter(True)
_NOT_FINAL = _final_parameter(False)


def stream_response(infer_response: bytes, final: bool | None = None) -> bytes:
    """A ModelStreamInferResponse carrying the serialized ModelInferResponse ``infer_response``
    (written on the wire form: the response is not parsed again), with the response parameter
    ``triton_final_response`` set to ``final`` unless it is None."""
    extra = b"" if final is None else _FINAL if final else _NOT_FINAL
    size = encode_varint(len(infer_response) + len(extra))
    return b"".join((_INFER_RESPONSE_TAG, size, infer_response, extra))


def stream_error(message: str, data: bytes) -> bytes:
    """A ModelStreamInferResponse for the request ``data`` that failed: ``error_message``, and the
    request's model, version and id in ``infer_response`` so that a client can tell which request
    it answers, with ``triton_final_response`` true (nothing more comes for that request). The
    request is parsed again here: only failures pay for it."""
    answer = pb.ModelInferResponse()
    try:
        request = pb.ModelInferRequest.FromString(data)
    except DecodeError:
        pass  # not a ModelInferRequest at all: the message says so
    else:
        answer = pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        )
    answer.parameters[FINAL_RESPONSE].bool_param = True
    reply = rpb.ModelStreamInferResponse(error_message=message, infer_response=answer.SerializeToString())
    return bytes(reply.SerializeToString())


def empty_final(served: Any, request_id: str | None) -> bytes:
    """The empty response that ends a request's responses when it asked for one
    (``triton_enable_empty_final_response``): no outputs, ``triton_final_response`` true."""
    answer = pb.ModelInferResponse(model_name=served.name, model_version=served.version, id=request_id or "")
    return stream_response(answer.SerializeToString(), final=True)


class StreamRequest(NamedTuple):
    """A decoupled model's ModelStreamInfer request, decoded and checked (:func:`stream_request`)."""

    inputs: dict[str, Any]
    #: The outputs asked for, None: all.
    requested: list[str] | None
    options: Any
    id: str | None
    #: The request asks for the empty final response after the model's last (``triton_enable_empty_final_response``).
    empty_final: bool


def stream_request(served: Any, call: InferCall) -> StreamRequest:
    """``call`` decoded for ``served``, a decoupled model: what :meth:`Engine.open_stream` takes.

    :raises ProtocolError: the request does not fit (its tensors; shared memory, classification
        or a non-bool ``triton_enable_empty_final_response``, which a stream does not take).
    """
    assert call.request is not None
    decoded = call.request.decode(served.input_specs)
    if decoded.shared_memory is not None:
        raise ProtocolError(
            f"model {served.name!r} is decoupled: its inputs and outputs travel in the stream's messages, "
            "not in shared memory regions; send the tensors in the request"
        )
    options = decoded.options
    if options is not None and options.classification:
        raise ProtocolError(
            f"model {served.name!r} is decoupled: the classification extension is not served on its streams; "
            "request the outputs themselves"
        )
    empty_final = decoded.parameters.get(EMPTY_FINAL_RESPONSE, False)
    if not isinstance(empty_final, bool):
        raise ProtocolError(
            f"request parameter {EMPTY_FINAL_RESPONSE!r} is a bool (bool_param), not {type(empty_final).__name__}"
        )
    requested = list(decoded.outputs) if decoded.outputs is not None else None
    return StreamRequest(decoded.inputs, requested, options, decoded.id, empty_final)


def open_stream_request(engine: Engine, served: Any, call: InferCall) -> tuple[Any, StreamRequest, ServedStream]:
    """``call`` decoded for ``served`` (:func:`stream_request`) and its stream opened
    (:meth:`Engine.open_stream_latest`): the model it runs on (the latest version, when the call
    named none), the request and the stream. A failure here is the client's, every later one the model's.

    :raises ProtocolError: as :func:`stream_request`; as :meth:`Engine.open_stream` (spec, busy model).
    """
    request = stream_request(served, call)
    assert call.request is not None  # stream_request raised the call's error otherwise
    version = call.request.model_version or None
    served, stream = engine.open_stream_latest(served, version, request.inputs, request.requested, request.options)
    return served, request, stream


def stream_answer(served: Any, outputs: dict[str, Any], request_id: str | None) -> bytes:
    """One response of a decoupled model as a ModelStreamInferResponse (``triton_final_response`` false).

    :raises NeuropodError: an output the protocol cannot carry (the model's fault, not the request's).
    """
    try:
        response = codec.serialize_model_infer_response(
            served.name, outputs, model_version=served.version, id=request_id
        )
    except ProtocolError as e:
        raise NeuropodError(f"its outputs cannot be sent: {e}") from e
    return stream_response(response, final=False)


class _SwitchInterval:
    """Python's GIL switch interval raised to :attr:`SECONDS` while any decoupled model's gRPC
    stream sends responses, and put back when the last one ends.

    ``neuropod serve`` runs at 0.1 ms (``launcher.GIL_SWITCH_S``: unary gRPC calls get the GIL
    back sooner), but grpcio hands each response of a stream between the thread running the call
    and its completion-queue thread, several switches a response, and at 0.1 ms each costs more
    CPU: a 1,000-response stream costs about 1.5 times what it does at 2 ms or more
    (``bench/bench_stream.py``). While streams are open, unary calls run at this interval too.
    """

    #: The interval while a stream sends (seconds); never lowered below what it already is.
    SECONDS = 0.002

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._saved = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._open == 0:
                self._saved = sys.getswitchinterval()
                if self._saved < self.SECONDS:
                    sys.setswitchinterval(self.SECONDS)
            self._open += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                sys.setswitchinterval(self._saved)


#: The one switch interval guard of this process's gRPC streams.
STREAMING_SWITCH = _SwitchInterval()


class _Reading:
    """The served stream a ModelStreamInfer call reads now, closed from grpcio's thread when the
    client cancels or goes away (``context.add_callback``), and by the server stopping (through
    :class:`StreamSlots`)."""

    __slots__ = ("_slots", "gone", "stream")

    def __init__(self, slots: StreamSlots) -> None:
        self._slots = slots
        self.stream: ServedStream | None = None
        #: The call has ended (the client cancelled or went away).
        self.gone = False

    def hold(self, stream: ServedStream) -> None:
        self.stream = stream
        self._slots.follow(stream)
        if self.gone:
            stream.close()

    def release(self, stream: ServedStream) -> None:
        self.stream = None
        stream.close()
        self._slots.forget(stream)

    def call_ended(self) -> None:
        self.gone = True
        stream = self.stream
        if stream is not None:
            stream.close()  # the model's generator closes at once, or right after its current response


def decoupled_model(engine: Engine, call: InferCall) -> Any:
    """The decoupled model ``call`` names, or None when it names another (answered as ModelInfer is).

    :raises ProtocolError: the request could not be read; as :meth:`Engine.get` for the model.
    """
    request = call.request
    if request is None:
        assert call.error is not None
        raise call.error
    served = engine.get(call.model_name, request.model_version or None)
    return served if getattr(served.model, "decoupled", False) else None


def _streamed(engine: Engine, served: Any, call: InferCall, reading: _Reading) -> Iterator[bytes]:
    """A decoupled model's responses to ``call``, each a ModelStreamInferResponse as it comes
    (``triton_final_response`` false), then the empty final response when the request asks for
    it; counted as one gRPC request, from its arrival to its last response."""
    started = time.perf_counter()
    failure: str | None = "client"  # until the stream opens; then the model's
    try:
        served, request, stream = open_stream_request(engine, served, call)
        failure = "model"
        reading.hold(stream)
        try:
            with STREAMING_SWITCH:
                for outputs in stream:
                    yield stream_answer(served, outputs, request.id)
        finally:
            reading.release(stream)
        if reading.gone:
            failure = "client"  # cancelled: nothing more is sent
            return
        if request.empty_final:
            yield empty_final(served, request.id)
        failure = None
    except GeneratorExit:  # the client went away while a response was being sent
        failure = "client"
        raise
    finally:
        engine.metrics.request(served.name, "grpc", time.perf_counter() - started, failure)


def model_stream_infer(
    servicer: Servicer, slots: StreamSlots, *, expected_auth: bytes | None, access_log: bool
) -> Callable[[Iterator[bytes], grpc.ServicerContext], Iterator[bytes]]:
    """The ModelStreamInfer handler: a decoupled model's request through :func:`_streamed`, any
    other model's through :meth:`Servicer.model_infer`, as a unary ModelInfer runs (same checks,
    limits, metrics); a failure becomes that request's ``error_message``, and the stream goes on."""
    engine = servicer.engine

    def stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            if expected_auth is not None:
                authenticate(context, expected_auth)
            slots.take("ModelStreamInfer")
        except Refused as e:
            context.abort(e.code, e.details)
        reading = _Reading(slots)
        try:
            if not context.add_callback(reading.call_ended):
                reading.call_ended()  # the call has ended already
            for data in requests:
                started = time.perf_counter()
                call = InferCall(data)
                code = "OK"
                try:
                    if slots.stopping is not None:
                        raise StreamStoppedError(f"ModelStreamInfer takes no more requests: {slots.stopping}")
                    served = decoupled_model(engine, call)
                    if served is None:
                        yield stream_response(servicer.model_infer(call, context), final=True)
                    else:
                        yield from _streamed(engine, served, call, reading)
                except Exception as e:  # noqa: BLE001 - reported in this response; the stream goes on
                    status, details = status_of(e, "ModelStreamInfer", call.model_name or "?")
                    code = status.name
                    yield stream_error(details, data)
                if access_log and access.isEnabledFor(logging.INFO):
                    access.info(
                        '%s "ModelStreamInfer %s" %s %.2fms', context.peer(), escape_log(call.model_name) or "-",
                        code, (time.perf_counter() - started) * 1000,
                    )  # fmt: skip
                if slots.stopping is not None or reading.gone:
                    return  # the server is stopping: this request's final error was the stream's last word
        finally:
            stream_now = reading.stream
            if stream_now is not None:
                reading.release(stream_now)
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
    "EMPTY_FINAL_RESPONSE",
    "FINAL_RESPONSE",
    "REPOSITORY_METHODS",
    "RepositoryServicer",
    "StreamRequest",
    "StreamSlots",
    "decoupled_model",
    "empty_final",
    "handlers",
    "model_stream_infer",
    "open_stream_request",
    "stream_answer",
    "stream_error",
    "stream_request",
    "stream_response",
]
