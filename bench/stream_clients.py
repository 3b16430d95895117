"""The clients of bench_stream.py: a bare grpcio stub for ModelStreamInfer and ModelInfer, and a raw
socket for Server-Sent Events and REST, each the same for a floor and for ``neuropod serve``.

Both read the least they can, so that the client (on a core of its own) is not what a stream
waits for: the gRPC side takes each ModelStreamInferResponse as bytes and looks for the
``triton_final_response`` parameter set true in them (:data:`FINAL_TRUE`); the SSE side counts
the lines starting with ``data:`` in what the socket gives (HTTP/1.1 keep-alive, chunked).
:func:`grpc_responses` and :func:`sse_responses` parse a whole stream properly, for the checks.
"""

from __future__ import annotations

import json
import queue
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
#: ``parameters["triton_final_response"]`` = InferParameter(bool_param=True), as a map entry on the wire
#: (the key, then field 2 of the entry: a 2-byte message holding field 1, varint 1).
FINAL_TRUE = FINAL.encode() + b"\x12\x02\x08\x01"
#: Every SSE event's data line starts a line.
DATA_LINE = b"\ndata:"
#: The end of a chunked HTTP/1.1 body.
CHUNKED_END = b"\r\n0\r\n\r\n"


def grpc_request(model: str, count: int, delay_us: int = 0) -> bytes:
    """A ModelInferRequest for ``model`` (inputs COUNT int32 [1], DELAY uint32 [1]) asking for an
    empty final response, serialized."""
    from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb

    request = pb.ModelInferRequest(model_name=model)
    for name, datatype, value in (
        ("COUNT", "INT32", np.array([count], np.int32)),
        ("DELAY", "UINT32", np.array([delay_us], np.uint32)),
    ):
        t = request.inputs.add()
        t.name, t.datatype = name, datatype
        t.shape.append(1)
        request.raw_input_contents.append(value.tobytes())
    request.parameters[EMPTY_FINAL].bool_param = True
    return bytes(request.SerializeToString())


def rest_body(count: int, delay_us: int = 0) -> bytes:
    """The same request as OIP JSON."""
    return json.dumps({"inputs": [
        {"name": "COUNT", "datatype": "INT32", "shape": [1], "data": [count]},
        {"name": "DELAY", "datatype": "UINT32", "shape": [1], "data": [delay_us]},
    ]}, separators=(",", ":")).encode()  # fmt: skip


@dataclass
class Timed:
    """One stream as the client saw it: seconds to the first response and to the end, responses."""

    first: float
    total: float
    responses: int


class GrpcClient:
    """One channel to a server's gRPC port; identity serializers (bytes in, bytes out)."""

    def __init__(self, port: int) -> None:
        import grpc  # lazy: the bench's own modules import without grpc

        self.port = port
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stream = self.channel.stream_stream(STREAM_METHOD)
        self.unary = self.channel.unary_unary(INFER_METHOD)
        self._open: Any = None
        self._requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def one_stream(self, request: bytes, timeout: float = 60.0) -> Timed:
        """A new ModelStreamInfer call carrying ``request``, read to its final response."""
        t0 = time.perf_counter()
        call = self.stream(iter((request,)), timeout=timeout)
        first, n = 0.0, 0
        for message in call:
            if not n:
                first = time.perf_counter()
            if FINAL_TRUE in message:
                break
            n += 1
        end = time.perf_counter()
        for _ in call:  # the request side is closed: the server ends the call (not timed)
            n += 1
        return Timed(first - t0, end - t0, n)

    def on_open_stream(self, request: bytes, timeout: float = 600.0) -> Timed:
        """``request`` on one long-lived ModelStreamInfer call (what tritonclient's
        start_stream / async_stream_infer do), read to its final response."""
        if self._open is None:
            self._open = self.stream(iter(self._requests.get, None), timeout=timeout)
        t0 = time.perf_counter()
        self._requests.put(request)
        first, n = 0.0, 0
        for message in self._open:
            if not n:
                first = time.perf_counter()
            if FINAL_TRUE in message:
                break
            n += 1
        return Timed(first - t0, time.perf_counter() - t0, n)

    def infer(self, request: bytes) -> float:
        t0 = time.perf_counter()
        self.unary(request, timeout=60)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._open is not None:
            self._requests.put(None)
            self._open.cancel()
            self._open = None
        self.channel.close()


def grpc_responses(port: int, request: bytes, timeout: float = 10.0) -> list[Any]:
    """Every ModelStreamInferResponse of one call, parsed (tritonclient's view of them is the same).

    :raises RuntimeError: a response carries an error_message.
    """
    import grpc  # lazy: as above

    from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
    from neuropod_serving.protocol._grpc import triton_repository_pb2 as rpb

    out = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(STREAM_METHOD)(iter((request,)), timeout=timeout)
        for message in call:
            reply = rpb.ModelStreamInferResponse.FromString(message)
            if reply.error_message:
                call.cancel()
                raise RuntimeError(f"error_message: {reply.error_message}")
            answer = pb.ModelInferResponse.FromString(reply.infer_response)
            out.append(answer)
            if FINAL in answer.parameters and answer.parameters[FINAL].bool_param:
                if FINAL_TRUE not in message:
                    raise RuntimeError(f"the final response's bytes do not hold {FINAL_TRUE!r}: {message!r}")
                break
        call.cancel()
    return out


class HttpClient:
    """A raw HTTP/1.1 keep-alive connection (TCP_NODELAY); reconnects when the server closed it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        return sock

    def _send(self, path: str, body: bytes, accept: str) -> tuple[socket.socket, bytes]:
        """Send a POST; the socket and the first bytes of the answer (reconnecting once if the kept-alive
        connection was closed meanwhile)."""
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAccept: {accept}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        for _attempt in (0, 1):
            sock = self.sock or self._connect()
            try:
                sock.sendall(head + body)
                data = sock.recv(1 << 18)
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            if data:
                return sock, data
            sock.close()
            self.sock = None
        raise RuntimeError(f"127.0.0.1:{self.port} closed the connection without an answer to POST {path}")

    def _head(self, sock: socket.socket, data: bytes, path: str) -> tuple[dict[str, str], bytes]:
        while b"\r\n\r\n" not in data:
            more = sock.recv(1 << 18)
            if not more:
                raise RuntimeError(f"POST {path}: the connection closed inside the answer's head")
            data += more
        head, body = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        headers[":status"] = status[1]
        return headers, body

    def sse(self, path: str, body: bytes) -> Timed:
        """POST ``path`` and read the event stream to its end, counting data lines."""
        t0 = time.perf_counter()
        sock, data = self._send(path, body, "text/event-stream")
        headers, rest = self._head(sock, data, path)
        if headers[":status"] != "200":
            raise RuntimeError(f"POST {path} answered {headers[':status']}: {self._rest(sock, headers, rest)[:300]!r}")
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        length = int(headers.get("content-length", -1))
        seen, first, got = 0, 0.0, len(rest)
        carry = b"\r\n\n"  # a data line at the very start of the body starts a line too
        data = rest
        while True:
            seen += (carry + data).count(DATA_LINE)
            if seen and not first:
                first = time.perf_counter()
            carry = (carry + data)[-7:]
            if chunked and carry.endswith(CHUNKED_END):
                break
            if length >= 0 and got >= length:
                break
            data = sock.recv(1 << 18)
            if not data:
                self.sock = None  # the server closed it: the end of an unchunked, unsized body
                break
            got += len(data)
        if headers.get("connection", "").lower() == "close":
            sock.close()
            self.sock = None
        return Timed(first - t0, time.perf_counter() - t0, seen)

    def post(self, path: str, body: bytes) -> tuple[float, bytes]:
        """POST ``path`` (a plain request with a Content-Length answer): seconds and the answer's body."""
        t0 = time.perf_counter()
        sock, data = self._send(path, body, "application/json")
        headers, rest = self._head(sock, data, path)
        answer = self._rest(sock, headers, rest)
        elapsed = time.perf_counter() - t0
        if headers[":status"] != "200":
            raise RuntimeError(f"POST {path} answered {headers[':status']}: {answer[:300]!r}")
        return elapsed, answer

    def _rest(self, sock: socket.socket, headers: dict[str, str], body: bytes) -> bytes:
        length = int(headers.get("content-length", 0))
        while len(body) < length:
            more = sock.recv(1 << 18)
            if not more:
                break
            body += more
        return body

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def sse_responses(port: int, path: str, body: bytes, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Every event of one SSE answer, its data parsed as JSON (httpx, as a user's client reads it).

    :raises RuntimeError: the answer is not 200 text/event-stream.
    """
    import httpx  # lazy: only the checks use it

    events = []
    with (
        httpx.Client(timeout=timeout) as client,
        client.stream(
            "POST", f"http://127.0.0.1:{port}{path}", content=body, headers={"Content-Type": "application/json"}
        ) as answer,
    ):
        if answer.status_code != 200:
            raise RuntimeError(f"POST {path} answered {answer.status_code}: {answer.read()[:300]!r}")
        kind = answer.headers.get("content-type", "")
        if not kind.startswith("text/event-stream"):
            raise RuntimeError(f"POST {path} answered content-type {kind!r}, not text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


__all__ = [
    "FINAL_TRUE",
    "GrpcClient",
    "HttpClient",
    "Timed",
    "grpc_request",
    "grpc_responses",
    "rest_body",
    "sse_responses",
]
