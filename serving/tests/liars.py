"""Lying servers for the remote client's tests (not a test module): a raw-socket HTTP/1.1 server
and a grpcio server with generic handlers, both in threads of the test process. Each answers
the server's and the model's metadata and readiness correctly, and a request what the test says.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any

import grpc

from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb

#: What a fake REST server sends: bytes, or a pause in seconds between them.
Steps = list[bytes | float]


def http_message(status: str, body: bytes, headers: str = "") -> bytes:
    """An HTTP/1.1 response: ``status`` line, ``headers`` (each ending in CRLF), Content-Length, ``body``."""
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode("latin-1") + body


class FakeHttp:
    """A raw-socket HTTP/1.1 server. GETs get a correct server metadata and ``metadata`` (the
    model's, named as the path names it); a POST to ``/v2/models/NAME/...`` gets ``answer(NAME)``:
    what to send, then the connection closes."""

    def __init__(self, answer: Callable[[str], Steps], metadata: Mapping[str, Any], host: str = "127.0.0.1") -> None:
        self.answer = answer
        self.metadata = metadata
        self.listener = socket.create_server((host, 0))
        self.base = f"http://{host}:{self.listener.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, model: str) -> str:
        return f"{self.base}/{model}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
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
                parts = path.split("/")  # /v2/models/NAME[/ready|/infer|/infer_stream]
                if method == "POST":
                    for step in self.answer(parts[3]):
                        if isinstance(step, float):
                            time.sleep(step)
                        else:
                            conn.sendall(step)
                    return
                if path == "/v2":
                    conn.sendall(http_message("200 OK", json.dumps({"name": "liar", "version": "1",
                                                                    "extensions": ["binary_tensor_data"]}).encode()))  # fmt: skip
                elif path.endswith("/ready"):
                    conn.sendall(http_message("200 OK", b""))
                else:
                    conn.sendall(http_message("200 OK", json.dumps({**self.metadata, "name": parts[3]}).encode()))
        except OSError:
            return
        finally:
            conn.close()

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class FakeGrpc:
    """A grpcio server with generic handlers: ``ModelMetadata`` from ``metadata`` (the model's,
    named as the request names it; no parameters), ``ModelReady`` true, and ``handlers`` (method
    name -> grpcio handler on bytes) for the rest."""

    def __init__(self, handlers: Mapping[str, Any], metadata: Mapping[str, Any], host: str = "127.0.0.1") -> None:
        def model_metadata(request: bytes, context: Any) -> bytes:
            name = pb.ModelMetadataRequest.FromString(request).name
            response = pb.ModelMetadataResponse(name=name, versions=["1"], platform="liar")
            for key in ("inputs", "outputs"):
                for t in metadata[key]:
                    getattr(response, key).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
            return bytes(response.SerializeToString())

        every = {
            "ModelMetadata": grpc.unary_unary_rpc_method_handler(model_metadata),
            "ModelReady": grpc.unary_unary_rpc_method_handler(
                lambda request, context: pb.ModelReadyResponse(ready=True).SerializeToString()
            ),
            **handlers,
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("inference.GRPCInferenceService", every),)
        )
        self.base = f"grpc://{host}:{self.server.add_insecure_port(f'{host}:0')}"
        self.server.start()

    def url(self, model: str) -> str:
        return f"{self.base}/{model}"

    def close(self) -> None:
        self.server.stop(0)
