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
from neuropod_serving.protocol.options import request_options
from neuropod_serving.server import Engine
from neuropod_serving.server.grpc_repository import (
    decoupled_model,
    empty_final,
    open_stream_request,
    stream_answer,
    stream_error,
    stream_response,
)
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
            served = decoupled_model(engine, call)
            if served is None:
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
        served, request, stream = open_stream_request(engine, served, call)
        failure = "model"
        async for outputs in _responses(stream):
            yield stream_answer(served, outputs, request.id)
        if request.empty_final:
            yield empty_final(served, request.id)
        failure = None
    finally:
        engine.metrics.request(served.name, "grpc", time.perf_counter() - started, failure)


__all__ = ["handle_stream", "model_stream_infer"]
