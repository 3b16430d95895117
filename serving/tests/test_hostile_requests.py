"""`neuropod serve` against hostile clients: what a request may cost the server, measured on the real process.

One server (the real command, with a bearer token and a short head timeout)
serves the adder and echo packages for the whole module. Each test sends what
a hostile client would and measures what the fault is about: the server's
resident memory after requests whose forms it must not keep, its CPU time for
a body nested millions deep, whether a new client is still answered while a
thousand connections send their heads a byte at a time, and what its access
log holds after a model name with a newline in it.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
grpc = pytest.importorskip("grpc")
httpx = pytest.importorskip("httpx")

from neuropod_serving.protocol import HEADER_LENGTH  # noqa: E402
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb  # noqa: E402

from conftest import adder_and_echo, free_port, private_caches  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the server's memory")

TOKEN = "h0stile-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEAD_TIMEOUT_S = 2.0
MiB = 2**20


class _Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, grpc_port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.grpc = f"127.0.0.1:{grpc_port}"
        self.log = log
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

    def rss(self) -> int:
        """The server's resident memory in bytes (VmRSS)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")

    def cpu(self) -> float:
        """CPU seconds the server has used, user and system."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    # A thousand half-sent connections need as many descriptors here and in the server (which inherits them).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))
    root = Path(tempfile.mkdtemp(prefix="neuropod-hostile-"))
    try:
        with private_caches(root):
            adder_and_echo(root / "models", echo_as_zip=False)
            (root / "token").write_text(TOKEN)
            port, grpc_port = free_port(), free_port()
            log = root / "server.log"
            cmd = [sys.executable, "-m", "neuropod", "serve", str(root / "models"), "--http-port", str(port),
                   "--grpc-port", str(grpc_port), "--metrics-port", "0", "--auth-token-file", str(root / "token"),
                   "--head-timeout", str(HEAD_TIMEOUT_S)]  # fmt: skip
            with log.open("wb") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
            served = _Server(proc, port, grpc_port, log)
            try:
                deadline = time.monotonic() + 60
                while True:
                    assert proc.poll() is None, f"neuropod serve exited:\n{log.read_text()}"
                    try:
                        if served.http.get("/v2/health/ready", timeout=1).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert time.monotonic() < deadline, f"neuropod serve was not ready in 60 s:\n{log.read_text()}"
                    time.sleep(0.1)
                yield served
            finally:
                served.http.close()
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        shutil.rmtree(root, ignore_errors=True)


def _fp32(name: str, shape: list[int], **params: Any) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "shape": shape, "parameters": params}


def _binary_request(header: dict[str, Any], raw: bytes) -> tuple[bytes, dict[str, str]]:
    text = json.dumps(header).encode()
    return text + raw, {**AUTH, HEADER_LENGTH: str(len(text)), "Content-Type": "application/octet-stream"}


def _grown(server: _Server, send: Any, rounds: int) -> int:
    """How much the server's resident memory grew over ``rounds`` calls of ``send`` (after one to warm up)."""
    send(-1)
    before = server.rss()
    for i in range(rounds):
        send(i)
    time.sleep(0.2)
    return server.rss() - before


# --- memory: nothing a client chooses is kept after its answer ---------------------------------


def test_ids_of_binary_responses_are_not_kept(server: _Server) -> None:
    x = np.ones((1, 2), np.float32).tobytes()

    def send(i: int) -> None:
        header = {"id": f"{i}" + "i" * (8 * MiB), "inputs": [_fp32("x", [1, 2], binary_data_size=8),
                  _fp32("y", [1, 2], binary_data_size=8)], "parameters": {"binary_data_output": True}}  # fmt: skip
        body, headers = _binary_request(header, x + x)
        r = server.http.post("/v2/models/adder/infer", content=body, headers=headers)
        assert r.status_code == 200, r.text[:300]
        assert HEADER_LENGTH.lower() in r.headers and len(r.content) > 8 * MiB

    grown = _grown(server, send, 8)
    # Kept, eight 8 MiB ids would cost the server well over 100 MiB (the id, the header, the text).
    assert grown < 40 * MiB, f"the server grew {grown / MiB:.0f} MiB over 8 requests with 8 MiB ids"


def test_refused_binary_headers_are_not_kept(server: _Server) -> None:
    x = np.ones((1, 2), np.float32).tobytes()
    filler = b"[" + b",".join([b"[]"] * 20_000) + b"]"

    def send(i: int) -> None:
        # 60 KiB of empty lists: about 20x that as Python objects, were the header kept.
        header = {"id": str(i), "inputs": [_fp32("x", [1, 2], binary_data_size=8), _fp32("z", [1, 2], binary_data_size=8)],
                  "parameters": {"filler": "FILLER"}}  # fmt: skip
        body, headers = _binary_request(header, x + x)
        body = body.replace(b'"FILLER"', filler)
        headers[HEADER_LENGTH] = str(len(body) - len(x + x))
        r = server.http.post("/v2/models/adder/infer", content=body, headers=headers)
        assert r.status_code == 400 and "'z'" in r.json()["error"], r.text[:300]

    grown = _grown(server, send, 250)
    assert grown < 32 * MiB, f"the server grew {grown / MiB:.0f} MiB over 250 refused requests"


def _grpc_call(server: _Server, message: bytes, token: str | None, method: str = "ModelInfer") -> Any:
    with grpc.insecure_channel(server.grpc, options=[("grpc.max_send_message_length", -1)]) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        metadata = None if token is None else [("authorization", token)]
        try:
            return call(message, metadata=metadata, timeout=30)
        except grpc.RpcError as e:
            return e


def test_unauthenticated_grpc_calls_are_neither_parsed_nor_kept(server: _Server) -> None:
    # 56 KiB of tensors without contents: several MiB once parsed by protobuf, were the message parsed and kept.
    tensor = pb.ModelInferRequest.InferInputTensor
    message = pb.ModelInferRequest(
        model_name="adder", inputs=[tensor(name="t", datatype="FP32", shape=[1]) for _ in range(4_000)]
    )

    def send(i: int) -> None:
        message.id = str(i)
        e = _grpc_call(server, message.SerializeToString(), None)
        assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAUTHENTICATED, e

    grown = _grown(server, send, 250)
    assert grown < 32 * MiB, f"the server grew {grown / MiB:.0f} MiB over 250 unauthenticated gRPC calls"


def test_unauthenticated_rest_body_is_never_read(server: _Server) -> None:
    # Headers promising 50 MiB, and no body: the 401 comes at once, without waiting for it.
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"POST /v2/models/adder/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 52428800\r\n\r\n")
        started = time.monotonic()
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert time.monotonic() - started < 2


# --- request heads: bounded in size, count and time --------------------------------------------


def _raw(server: _Server, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


@pytest.mark.parametrize(
    "head",
    [
        b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",  # one huge header
        b"GET /v2 HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(150)) + b"\r\n",  # too many
        b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Endless: " + b"a" * 200_000,  # a line that never ends
        b"GET /v2?" + b"q" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # a huge request line
    ],
    ids=["huge-header", "150-headers", "endless-line", "huge-url"],
)
def test_oversized_heads_get_431(server: _Server, head: bytes) -> None:
    answer = _raw(server, head)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"--max-head-bytes" in answer


def test_heads_within_the_limits_are_served(server: _Server) -> None:
    big = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 60_000 + b"\r\nConnection: close\r\n\r\n"
    many = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(90))
    for head in (big, many + b"Connection: close\r\n\r\n"):
        answer = _raw(server, head)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def test_half_sent_heads_time_out_and_others_are_answered(server: _Server) -> None:
    slow: list[socket.socket] = []
    try:
        for i in range(1000):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            # Half the connections send part of a head, the others nothing at all.
            if i % 2:
                s.sendall(b"POST /v2/models/adder/infer HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow.append(s)
        opened = time.monotonic()
        # A new client is answered at once while the thousand are open.
        started = time.monotonic()
        r = httpx.get(f"http://127.0.0.1:{server.port}/v2/health/ready", timeout=5)
        assert r.status_code == 200 and time.monotonic() - started < 1.0
        r = httpx.get(f"http://127.0.0.1:{server.port}/v2/models/adder", headers=AUTH, timeout=5)
        assert r.status_code == 200
        # Each half-sent connection is answered 408 and closed once its head has taken too long.
        for s in slow[::50] + slow[1::50]:
            s.settimeout(HEAD_TIMEOUT_S + 5 - (time.monotonic() - opened))
            answer = s.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            assert s.recv(4096) == b""  # closed
        assert time.monotonic() - opened < HEAD_TIMEOUT_S + 3
    finally:
        for s in slow:
            s.close()


# --- JSON nesting: refused before it costs more than a flat body -------------------------------


def test_deeply_nested_body_costs_no_more_than_a_flat_one(server: _Server) -> None:
    n = 12 * MiB
    nested = b'{"inputs":' + b"[" * n + b"]" * n + b"}"
    rows = (len(nested) - 200) // 8  # "1.0,1.0," per row: a flat body of about the same size
    flat = (
        b'{"inputs":[{"name":"x","datatype":"FP32","shape":[%d,2],"data":[' % rows
        + b"1.0," * (2 * rows - 1)
        + b'1.0]},{"name":"y","datatype":"FP32","shape":[1,2],"data":[1,2]}]}'
    )

    def cost(body: bytes) -> tuple[float, httpx.Response]:
        before = server.cpu()
        r = server.http.post("/v2/models/adder/infer", content=body, headers=AUTH)
        return server.cpu() - before, r

    flat_cpu, r = cost(flat)
    assert r.status_code == 400, r.text[:300]  # x and y disagree on batch_size: refused after parsing
    nested_cpu, r = cost(nested)
    assert r.status_code == 400 and "nests more than" in r.json()["error"], r.text[:300]
    assert nested_cpu <= 1.5 * flat_cpu + 0.2, (
        f"a nested body cost {nested_cpu:.2f} s of CPU, a flat one {flat_cpu:.2f} s"
    )


# --- client errors are 400s, never 500s ---------------------------------------------------------


def test_shape_no_array_can_have_is_a_client_error(server: _Server) -> None:
    for shape in ([0, 2**62], [2**62, 0]):
        body = {"inputs": [_fp32("x", shape) | {"data": []}, _fp32("y", [1, 2]) | {"data": [1, 2]}]}
        r = server.http.post("/v2/models/adder/infer", json=body, headers=AUTH)
        assert r.status_code == 400 and "larger than any array" in r.json()["error"], r.text
        tensor = pb.ModelInferRequest.InferInputTensor
        message = pb.ModelInferRequest(
            model_name="adder",
            inputs=[tensor(name="x", datatype="FP32", shape=shape), tensor(name="y", datatype="FP32", shape=[1, 2])],
            raw_input_contents=[b"", np.ones((1, 2), np.float32).tobytes()],
        )
        e = _grpc_call(server, message.SerializeToString(), f"Bearer {TOKEN}")
        assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        assert "larger than any array" in e.details()


def test_deeply_nested_repository_body_is_400(server: _Server) -> None:
    body = b'{"parameters":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = server.http.post("/v2/repository/models/adder/load", content=body, headers=AUTH)
    assert r.status_code == 400 and "nests more than" in r.json()["error"], r.text[:300]


def test_bearer_scheme_is_case_insensitive(server: _Server) -> None:
    # tritonclient.grpc's generated module clashes with ours in one process: gRPC is driven raw here.
    import tritonclient.http as httpclient

    ready = pb.ModelReadyRequest(name="adder").SerializeToString()
    for scheme in ("bearer", "BEARER", "Bearer"):
        auth = {"authorization": f"{scheme}  {TOKEN}"}
        assert httpclient.InferenceServerClient(f"127.0.0.1:{server.port}").is_model_ready("adder", headers=auth)
        answer = _grpc_call(server, ready, f"{scheme} {TOKEN}", "ModelReady")
        assert pb.ModelReadyResponse.FromString(answer).ready, answer
    r = server.http.get("/v2/models/adder", headers={"Authorization": f"Basic {TOKEN}"})
    assert r.status_code == 401
    e = _grpc_call(server, ready, f"Basic {TOKEN}", "ModelReady")
    assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAUTHENTICATED


def test_an_output_requested_twice_is_refused_alike(server: _Server) -> None:
    body = {"inputs": [_fp32("x", [1, 2]) | {"data": [1, 2]}, _fp32("y", [1, 2]) | {"data": [1, 2]}],
            "outputs": [{"name": "out"}, {"name": "out"}]}  # fmt: skip
    r = server.http.post("/v2/models/adder/infer", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    tensor = pb.ModelInferRequest.InferInputTensor
    raw = np.ones((1, 2), np.float32).tobytes()
    out = pb.ModelInferRequest.InferRequestedOutputTensor
    message = pb.ModelInferRequest(
        model_name="adder",
        inputs=[tensor(name="x", datatype="FP32", shape=[1, 2]), tensor(name="y", datatype="FP32", shape=[1, 2])],
        raw_input_contents=[raw, raw],
        outputs=[out(name="out"), out(name="out")],
    )
    e = _grpc_call(server, message.SerializeToString(), f"Bearer {TOKEN}")
    assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
    assert e.details() == r.json()["error"] == "output 'out' is requested twice; ask for each output once"


def test_control_characters_in_a_model_name_cannot_forge_log_lines(server: _Server) -> None:
    forged = 'FORGED-LINE 127.0.0.1 - "GET /v2 HTTP/1.1" 200'
    r = server.http.get("/v2/models/a%0A" + forged.replace(" ", "%20").replace('"', "%22") + "/ready", headers=AUTH)
    assert r.status_code == 404
    message = pb.ModelMetadataRequest(name="b\n" + forged)
    e = _grpc_call(server, message.SerializeToString(), f"Bearer {TOKEN}", "ModelMetadata")
    assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.NOT_FOUND
    deadline = time.monotonic() + 5
    while (text := server.log.read_text(errors="replace")).count("FORGED-LINE") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [line for line in text.splitlines() if "FORGED-LINE" in line]
    assert len(lines) == 2, text[-2000:]  # one line per request: neither name started a line of its own
    assert not [line for line in lines if line.startswith("FORGED-LINE")]
    rest, grpc_line = sorted(lines, key=lambda line: "ModelMetadata" in line)
    assert "a%0AFORGED-LINE" in rest and "b\\nFORGED-LINE" in grpc_line, lines
