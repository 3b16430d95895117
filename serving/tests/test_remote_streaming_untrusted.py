"""Remote streams trust no server: the real client's ``infer_stream`` against servers written here
to lie, a raw-socket HTTP/1.1 server (Server-Sent Events) and a grpcio server with generic
handlers (``ModelStreamInfer``, and ``ModelConfig`` saying the model is decoupled, as Triton does),
both in threads of the test process. Each lie ends the stream with a RemoteError naming the URL,
after the good responses before it; nothing waits past the stream's deadline.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
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

# n int64 [1] -> count int64 [1], one response per count.
METADATA = {
    "name": "m", "versions": ["1"], "platform": "liar",
    "inputs": [{"name": "n", "datatype": "INT64", "shape": [1]}],
    "outputs": [{"name": "count", "datatype": "INT64", "shape": [1]}],
    "parameters": {"neuropod_backend": "liar==1", "neuropod_decoupled": True},
}  # fmt: skip
N = {"n": np.array([3], np.int64)}
Steps = list[bytes | float]  # what a fake server sends: bytes, or a pause in seconds


def _event(i: int, datatype: str = "INT64") -> bytes:
    answer = {"model_name": "m", "outputs": [{"name": "count", "datatype": datatype, "shape": [1], "data": [i]}]}
    return b"data: " + json.dumps(answer).encode() + b"\n\n"


def _http(status: str, body: bytes, headers: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode("latin-1") + body


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


class FakeSse:
    """GETs get correct server and model metadata (a decoupled model); ``POST .../infer_stream``
    gets ``steps``, then the connection closes."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/m"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ")
                length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                               if k.lower() == "content-length"), 0)  # fmt: skip
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                if method == "POST":
                    for step in self.steps:
                        if isinstance(step, float):
                            time.sleep(step)
                        else:
                            conn.sendall(step)
                    return
                if path == "/v2":
                    body = {"name": "liar", "version": "1", "extensions": ["binary_tensor_data"]}
                    conn.sendall(_http("200 OK", json.dumps(body).encode()))
                elif path.endswith("/ready"):
                    conn.sendall(_http("200 OK", b""))
                else:
                    conn.sendall(_http("200 OK", json.dumps(METADATA).encode()))
        except OSError:
            return
        finally:
            conn.close()

    def close(self) -> None:
        self.listener.close()


@contextlib.contextmanager
def sse(steps: Steps) -> Iterator[Any]:
    fake = FakeSse(steps)
    try:
        with neuropod.load_neuropod(fake.url) as model:
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
    with sse([_http("429 Too Many Requests", b'{"error": "model \'m\' has 3 streams open"}')]) as model:
        with pytest.raises(RemoteError) as caught:
            next(model.infer_stream(N))
        assert caught.value.code == "resource_exhausted" and "3 streams open" in str(caught.value)
    with sse([_http("200 OK", b'{"outputs": []}', "Content-Type: application/json\r\n")]) as model:
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


class FakeStreamGrpc:
    """Metadata without neuropod serve's parameters, and ``ModelConfig`` saying decoupled (as Triton
    says it); ``ModelStreamInfer`` answers each request with ``answers``."""

    def __init__(self, answers: Callable[[], Iterator[bytes]]) -> None:
        def metadata(request: bytes, context: Any) -> bytes:
            response = pb.ModelMetadataResponse(name="m", versions=["1"], platform="liar")
            for key in ("inputs", "outputs"):
                for t in METADATA[key]:  # type: ignore[attr-defined]
                    getattr(response, key).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
            return bytes(response.SerializeToString())

        def config(request: bytes, context: Any) -> bytes:
            policy = tc.ModelTransactionPolicy(decoupled=True)
            return bytes(tc.ModelConfigResponse(config=tc.ModelConfig(name="m", model_transaction_policy=policy))
                         .SerializeToString())  # fmt: skip

        def stream(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
            for _ in requests:
                yield from answers()

        handlers = {
            "ModelMetadata": grpc.unary_unary_rpc_method_handler(metadata),
            "ModelReady": grpc.unary_unary_rpc_method_handler(
                lambda request, context: pb.ModelReadyResponse(ready=True).SerializeToString()
            ),
            "ModelConfig": grpc.unary_unary_rpc_method_handler(config),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream),
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("inference.GRPCInferenceService", handlers),)
        )
        self.url = f"grpc://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}/m"
        self.server.start()


@contextlib.contextmanager
def fake_grpc(answers: Callable[[], Iterator[bytes]]) -> Iterator[Any]:
    fake = FakeStreamGrpc(answers)
    try:
        with neuropod.load_neuropod(fake.url) as model:
            yield model
    finally:
        fake.server.stop(0)


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
