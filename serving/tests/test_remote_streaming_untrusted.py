"""Remote streams trust no server: the real client's ``infer_stream`` against servers that lie
(liars.py), a raw-socket HTTP/1.1 server (Server-Sent Events) and a grpcio server with generic
handlers (``ModelStreamInfer``, and ``ModelConfig`` saying the model is decoupled, as Triton does),
both in threads of the test process. Each lie ends the stream with a RemoteError naming the URL,
after the good responses before it; nothing waits past the stream's deadline.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("grpc")

import grpc

import neuropod
from neuropod.errors import RemoteError
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol._grpc import triton_config_pb2 as tc
from neuropod_serving.protocol._grpc import triton_repository_pb2 as rpb

from liars import FakeGrpc, FakeHttp, Steps, http_message

# n int64 [1] -> count int64 [1], one response per count.
METADATA = {
    "name": "m", "versions": ["1"], "platform": "liar",
    "inputs": [{"name": "n", "datatype": "INT64", "shape": [1]}],
    "outputs": [{"name": "count", "datatype": "INT64", "shape": [1]}],
    "parameters": {"neuropod_backend": "liar==1", "neuropod_decoupled": True},
}  # fmt: skip
N = {"n": np.array([3], np.int64)}


def _event(i: int, datatype: str = "INT64") -> bytes:
    answer = {"model_name": "m", "outputs": [{"name": "count", "datatype": datatype, "shape": [1], "data": [i]}]}
    return b"data: " + json.dumps(answer).encode() + b"\n\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


@contextlib.contextmanager
def sse(steps: Steps) -> Iterator[Any]:
    fake = FakeHttp(lambda name: steps, METADATA)
    try:
        with neuropod.load_neuropod(fake.url("m")) as model:
            yield model
    finally:
        fake.close()


def _first_then_error(model: Any, **kw: Any) -> RemoteError:
    """The stream's first response (count 0), then the RemoteError that ends it."""
    responses = model.infer_stream(N, **kw)
    assert next(responses)["count"].tolist() == [0]
    with pytest.raises(RemoteError) as caught:
        next(responses)
    assert caught.value.url == model.urls[0] and responses.done
    return caught.value


def test_sse_lies_end_the_stream_after_the_good_responses() -> None:
    with sse([SSE_HEAD, _event(0), b'data: {"outputs": [{"name": "count", "datat']) as model:
        e = _first_then_error(model)
        assert e.code == "protocol" and "in the middle of an event" in str(e)
    with sse([SSE_HEAD, _event(0), b"data: not json\n\n"]) as model:
        assert _first_then_error(model).code == "protocol"
    with sse([SSE_HEAD, _event(0), _event(1, "FP32")]) as model:
        e = _first_then_error(model)
        assert e.code == "protocol" and "does not fit the model's spec" in str(e)
    with sse([SSE_HEAD, _event(0), b'data: {"error": "model \'m\' failed: ValueError: boom"}\n\n']) as model:
        e = _first_then_error(model)
        assert e.code == "internal" and e.server_message == "model 'm' failed: ValueError: boom"


def test_sse_refusals_and_wrong_answers_before_the_stream() -> None:
    with sse([http_message("429 Too Many Requests", b'{"error": "model \'m\' has 3 streams open"}')]) as model:
        with pytest.raises(RemoteError) as caught:
            next(model.infer_stream(N))
        assert caught.value.code == "resource_exhausted" and "3 streams open" in str(caught.value)
    with sse([http_message("200 OK", b'{"outputs": []}', "Content-Type: application/json\r\n")]) as model:
        with pytest.raises(RemoteError, match="not text/event-stream") as caught:
            next(model.infer_stream(N))
        assert caught.value.code == "protocol"


def test_a_trickling_stream_cannot_outlast_its_deadline() -> None:
    # An event every 0.2 s: each read is quick, the stream as a whole is not.
    with sse([SSE_HEAD] + [s for i in range(30) for s in (_event(i), 0.2)]) as model:
        started = time.monotonic()
        got = []
        with pytest.raises(RemoteError) as caught:
            for r in model.infer_stream(N, timeout=1.0):
                got.append(int(r["count"][0]))
        assert caught.value.code == "deadline_exceeded"
        assert time.monotonic() - started < 2.0 and 3 <= len(got) <= 6 and got == list(range(len(got)))


# --- gRPC ----------------------------------------------------------------------------


def _answer(i: int | None, final: bool | None = None, datatype: str = "INT64") -> bytes:
    response = pb.ModelInferResponse(model_name="m")
    if i is not None:
        response.outputs.add(name="count", datatype=datatype, shape=[1])
        response.raw_output_contents.append(np.array([i], np.int64).tobytes())
    if final is not None:
        response.parameters["triton_final_response"].bool_param = final
    return bytes(rpb.ModelStreamInferResponse(infer_response=response.SerializeToString()).SerializeToString())


@contextlib.contextmanager
def fake_grpc(answers: Callable[[], Iterator[bytes]]) -> Iterator[Any]:
    """A model of a server whose metadata has no neuropod serve parameters and whose
    ``ModelConfig`` says decoupled (as Triton says it); ``ModelStreamInfer`` answers each request
    with ``answers``."""

    def config(request: bytes, context: Any) -> bytes:
        policy = tc.ModelTransactionPolicy(decoupled=True)
        return bytes(tc.ModelConfigResponse(config=tc.ModelConfig(name="m", model_transaction_policy=policy))
                     .SerializeToString())  # fmt: skip

    def stream(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        for _ in requests:
            yield from answers()

    fake = FakeGrpc({"ModelConfig": grpc.unary_unary_rpc_method_handler(config),
                     "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream)}, METADATA)  # fmt: skip
    try:
        with neuropod.load_neuropod(fake.url("m")) as model:
            yield model
    finally:
        fake.close()


def test_a_triton_like_grpc_server_says_decoupled_in_its_model_configuration() -> None:
    # Responses flagged not final, then the empty final one (Triton's decoupled semantics).
    with fake_grpc(lambda: iter([_answer(0, False), _answer(1, False), _answer(None, True)])) as model:
        assert model.decoupled
        assert [r["count"].tolist() for r in model.infer_stream(N)] == [[0], [1]]
    # The last response flagged final itself; and a server that never flags one (the call's end ends it).
    with fake_grpc(lambda: iter([_answer(0, False), _answer(1, True)])) as model:
        assert [r["count"].tolist() for r in model.infer_stream(N)] == [[0], [1]]
    with fake_grpc(lambda: iter([_answer(0), _answer(1)])) as model:
        assert [r["count"].tolist() for r in model.infer_stream(N)] == [[0], [1]]


def test_grpc_stream_lies_end_the_stream_after_the_good_responses() -> None:
    with fake_grpc(lambda: iter([_answer(0, False), b"\x12\x40short"])) as model:
        assert _first_then_error(model).code == "protocol"
    with fake_grpc(lambda: iter([_answer(0, True), _answer(1, False)])) as model:
        e = _first_then_error(model)
        assert e.code == "protocol" and "after the one marked final" in str(e)
    with fake_grpc(lambda: iter([_answer(0, False), _answer(1, False, "FP64")])) as model:
        e = _first_then_error(model)
        assert e.code == "protocol" and "does not fit the model's spec" in str(e)
    error = rpb.ModelStreamInferResponse(error_message="model 'm' failed: boom").SerializeToString()
    with fake_grpc(lambda: iter([_answer(0, False), bytes(error)])) as model:
        e = _first_then_error(model)
        assert e.code == "internal" and e.server_message == "model 'm' failed: boom"
