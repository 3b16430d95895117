"""Streams through a Ray Serve replica: a decoupled model's responses as it makes them, read from
the replica's event loop (:meth:`ServedStream.next_batch <neuropod_serving.server.streams.ServedStream.next_batch>`:
the model runs on a thread of its own, at most the stream buffer ahead of the reader).

- :func:`handle_stream`: the deployment's ``infer_stream`` generator method, for Ray's streaming
  handles (``handle.options(stream=True).infer_stream.remote(inputs)``): each response a dict of
  numpy arrays.
- :func:`model_stream_infer`: gRPC ``ModelStreamInfer`` through Ray's gRPC proxy (it passes a
  bidirectional stream's requests to the replica as they come), answered as ``neuropod serve``
  answers it (:mod:`neuropod_serving.server.grpc_repository`): each response of a decoupled
  model's request with ``triton_final_response`` false, the empty final response when asked for,
  any other model's one answer with it true, a failed request's ``error_message``.

REST (``infer_stream``, ``generate_stream``) needs nothing here: the replica serves ``neuropod
serve``'s app, and Ray's HTTP proxy passes its Server-Sent Events on as they come.

A caller that goes away (a cancelled handle call, a closed connection, a cancelled gRPC call)
cancels the replica's generator; its ``finally`` closes the served stream, which closes the
model's generator (at once, or right after the response it is working on).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from neuropod.errors import NeuropodError
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol import grpc_codec as codec
from neuropod_serving.protocol.options import request_options
from neuropod_serving.server import Engine
from neuropod_serving.server.grpc_repository import EMPTY_FINAL_RESPONSE, empty_final, stream_error, stream_response
from neuropod_serving.server.grpc_service import InferCall, Servicer, status_of
from neuropod_serving.server.streams import ServedStream


async def _responses(stream: ServedStream) -> AsyncIterator[dict[str, Any]]:
    """``stream``'s responses, each as soon as it is ready (those ready together, in one wake-up)."""
    try:
        while True:
            try:
                batch = await stream.next_batch()
            except StopAsyncIteration:
                return
            for outputs in batch:
                yield outputs
    finally:
        stream.close()


async def handle_stream(
    engine: Engine, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None,
    parameters: Mapping[str, Any] | None,
) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
    """The replica's one model's responses to ``inputs`` (numpy arrays), as they come.

    :raises SpecError: the inputs do not fit the spec (at the first response's wait).
    :raises NeuropodError: the model failed, after the responses before it; too many open streams.
    """
    (served,) = list(engine.registry)
    if not isinstance(inputs, Mapping):
        raise NeuropodError(f"infer_stream takes a dict of input name to numpy array, not {type(inputs).__name__}")
    requested = None if requested_outputs is None else list(requested_outputs)
    options = request_options(parameters) if parameters else None
    stream = engine.open_stream(served, dict(inputs), requested, options)
    async for outputs in _responses(stream):
        yield outputs


async def model_stream_infer(servicer: Servicer, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    """ModelStreamInfer's answers (serialized ModelStreamInferResponses) to ``requests``, one
    request after another; a request that fails gets its ``error_message`` and the stream goes on."""
    engine = servicer.engine
    async for data in requests:
        call = InferCall(bytes(data))
        try:
            request = call.request
            if request is None:
                assert call.error is not None
                raise call.error
            served = engine.get(call.model_name, request.model_version or None)
            if not getattr(served.model, "decoupled", False):
                yield stream_response(await servicer.model_infer_async(call, context), final=True)
                continue
            async for answer in _streamed(engine, served, call):
                yield answer
        except Exception as e:  # noqa: BLE001 - reported in this request's response; the stream goes on
            _, details = status_of(e, "ModelStreamInfer", call.model_name or "?")
            yield stream_error(details, bytes(data))


async def _streamed(engine: Engine, served: Any, call: InferCall) -> AsyncIterator[bytes]:
    """A decoupled model's responses to ``call`` as ModelStreamInferResponses, then the empty final
    response when the request asks for it; counted as one gRPC request in the metrics."""
    started = time.perf_counter()
    failure: str | None = "client"  # until the stream opens; then the model's
    try:
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
        wants_empty_final = decoded.parameters.get(EMPTY_FINAL_RESPONSE, False)
        if not isinstance(wants_empty_final, bool):
            raise ProtocolError(f"request parameter {EMPTY_FINAL_RESPONSE!r} is a bool (bool_param), not "
                                f"{type(wants_empty_final).__name__}")  # fmt: skip
        requested = list(decoded.outputs) if decoded.outputs is not None else None
        stream = engine.open_stream(served, decoded.inputs, requested, options)
        failure = "model"
        async for outputs in _responses(stream):
            try:
                response = codec.serialize_model_infer_response(
                    served.name, outputs, model_version=served.version, id=decoded.id
                )
            except ProtocolError as e:  # an output the protocol cannot carry is the model's fault
                raise NeuropodError(f"its outputs cannot be sent: {e}") from e
            yield stream_response(response, final=False)
        if wants_empty_final:
            yield empty_final(served, decoded.id)
        failure = None
    finally:
        engine.metrics.request(served.name, "grpc", time.perf_counter() - started, failure)


__all__ = ["handle_stream", "model_stream_infer"]
