"""gRPC's health checking protocol on ``neuropod serve``, as Kubernetes' gRPC probes and grpc_health_probe call it.

One real ``neuropod serve`` (the command, in a subprocess, with a bearer token)
serves adder and echo for the module. The probes are grpcio-health-checking's
own client stub, without the token: health needs none, like the REST health
routes. Models are unloaded and loaded through the REST repository routes
(with the token), and a Watch stream sees each change.
"""

from __future__ import annotations

import json
import queue
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from grpc_health_helpers import Status, check, grpc, health_stub, request, served_with_token, watch  # noqa: E402
from neuropod.testing import Served, served  # noqa: E402

from conftest import adder_and_echo, private_caches  # noqa: E402

TOKEN = "he4lth-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-health-"))
    try:
        with private_caches(root):
            adder_and_echo(root / "models", echo_as_zip=False)
            with served_with_token(root / "models", TOKEN) as s:
                yield s
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def stub(server: Served) -> Iterator[Any]:
    with health_stub(server.grpc) as stub:
        yield stub


def test_check_without_a_token(server: Served, stub: Any) -> None:
    assert check(stub, "") == Status.SERVING  # what a Kubernetes grpc probe without `service` asks
    assert check(stub, "adder") == Status.SERVING
    assert check(stub, "echo") == Status.SERVING
    with pytest.raises(grpc.RpcError) as info:
        check(stub, "no_such_model")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # The inference service itself still needs the token.
    with grpc.insecure_channel(server.grpc) as channel:
        index = channel.unary_unary("/inference.GRPCInferenceService/RepositoryIndex")
        with pytest.raises(grpc.RpcError) as info:
            index(b"")
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_watch_sees_a_model_unloaded_and_loaded_again(server: Served, stub: Any) -> None:
    seen: queue.Queue[int] = queue.Queue()
    stream = stub.Watch(request("echo"))

    def read() -> None:
        try:
            for response in stream:
                seen.put(int(response.status))
        except grpc.RpcError:
            pass  # cancelled at the end of the test

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.get(timeout=10) == Status.SERVING
        with httpx.Client(base_url=server.http, headers=AUTH, timeout=60) as http:
            assert http.post("/v2/repository/models/echo/unload").status_code == 200
            assert seen.get(timeout=10) == Status.NOT_SERVING
            assert check(stub, "echo") == Status.NOT_SERVING  # known, not loaded
            assert check(stub, "") == Status.SERVING
            assert http.post("/v2/repository/models/echo/load").status_code == 200
            assert seen.get(timeout=10) == Status.SERVING
        assert check(stub, "echo") == Status.SERVING
    finally:
        stream.cancel()
        reader.join(10)


def test_watch_of_an_unknown_service(stub: Any) -> None:
    # One answer, and the stream ends: the server keeps nothing for a name it does not know.
    assert watch(stub, "never_loaded") == [Status.SERVICE_UNKNOWN]


def test_unparsable_http_gets_a_json_error(server: Served) -> None:
    """uvicorn's own answer to bytes that are not HTTP is JSON like every other error."""
    host, port = server.http.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), answer
    assert "not HTTP/1.1" in json.loads(body)["error"]


def test_max_grpc_streams_option(tmp_path: Path) -> None:
    """``neuropod serve --max-grpc-streams 1``: one Watch open, a second stream is refused at once."""
    with private_caches(tmp_path):
        adder_and_echo(tmp_path / "models", echo_as_zip=False)
        with (
            served(tmp_path / "models", options=["--max-grpc-streams", "1"]) as s,
            health_stub(s.grpc) as stub,
        ):
            first = stub.Watch(request("adder"))
            assert int(next(first).status) == Status.SERVING
            with pytest.raises(grpc.RpcError) as info:
                next(stub.Watch(request("echo")))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-grpc-streams" in info.value.details()
            assert check(stub, "echo") == Status.SERVING  # unary calls are not streams
            first.cancel()
