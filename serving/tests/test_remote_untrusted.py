"""The remote client trusts no server: the real client against servers written here to lie.

Each fault is measured where it bites: the client process's peak memory
against answers that claim sizes they do not send, the wall time of a call
against a server that trickles its answer, the error's words against wrong
outputs, the warnings of a token sent without TLS, and a process that has
imported tritonclient.grpc. The liars (liars.py) are a raw-socket HTTP/1.1
server and a grpcio server with generic handlers (answers built from the
protocol's own messages), both in threads of the test process.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("grpc")

import grpc

import neuropod
from neuropod.errors import RemoteError
from neuropod_serving.client import PlainTextTokenWarning
from neuropod_serving.client._target import is_loopback
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb

from liars import FakeGrpc, FakeHttp, Steps, http_message

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="measures memory with ru_maxrss (KiB on Linux)"
)

GiB = 1 << 30
X = np.array([[1, 2], [3, 4]], np.float32)
# One input and one output, any batch: x FP32 [-1, 2] -> y FP32 [-1, 2].
METADATA = {
    "name": "m", "versions": ["1"], "platform": "liar",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
}  # fmt: skip


# --- a lying REST server -------------------------------------------------------


def _json_answer(outputs: list[dict[str, Any]]) -> bytes:
    return http_message(
        "200 OK", json.dumps({"model_name": "m", "outputs": outputs}).encode(), "Content-Type: application/json\r\n"
    )


def _binary_answer(outputs: list[dict[str, Any]], raw: bytes) -> Steps:
    header = json.dumps({"model_name": "m", "outputs": outputs}).encode()
    body = header + raw
    head = (f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n\r\n")  # fmt: skip
    return [head.encode("latin-1") + body]


def _ok_answer() -> bytes:
    return _json_answer([{"name": "y", "datatype": "FP32", "shape": [2, 2], "data": X.ravel().tolist()}])


# --- a lying gRPC server -------------------------------------------------------


def _grpc_answer(outputs: list[tuple[str, str, list[int]]], raws: list[bytes]) -> bytes:
    response = pb.ModelInferResponse(model_name="m")
    for name, datatype, shape in outputs:
        response.outputs.add(name=name, datatype=datatype, shape=shape)
    response.raw_output_contents.extend(raws)
    return response.SerializeToString()


def _ok_grpc() -> bytes:
    return _grpc_answer([("y", "FP32", [2, 2])], [X.tobytes()])


@contextlib.contextmanager
def _servers(http_infer: Callable[[str], Steps], grpc_infer: Callable[[str], bytes],
             host: str = "127.0.0.1") -> Iterator[dict[str, Any]]:  # fmt: skip
    def model_infer(request: bytes, context: Any) -> bytes:
        return grpc_infer(pb.ModelInferRequest.FromString(request).model_name)

    fakes: dict[str, Any] = {
        "http": FakeHttp(http_infer, METADATA, host),
        "grpc": FakeGrpc({"ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer)}, METADATA, host),
    }
    try:
        yield fakes
    finally:
        for fake in fakes.values():
            fake.close()


# --- 1. sizes that are only claimed ------------------------------------------------

# What each lying REST answer claims, and what it sends.
HTTP_LIES: dict[str, Steps] = {
    "ok": [_ok_answer()],
    # 1 GiB announced, 12 bytes sent, then the server closes.
    "content_length": [
        b'HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\nContent-Type: application/json\r\n\r\n{"outputs":['
    ],
    # 1 GiB announced, 12 bytes sent, then nothing until the call's deadline is long past.
    "content_length_stalls": [b'HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n{"outputs":[', 4.0],
    # a chunk of 1 GiB announced, 12 bytes sent.
    "chunk": [b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n40000000\r\n{"outputs":['],
    # a binary output of shape [2**28, 2] FP32 (2 GiB) in a body of 8 bytes.
    "binary_shape": _binary_answer(
        [{"name": "y", "datatype": "FP32", "shape": [1 << 28, 2], "parameters": {"binary_data_size": 2 * GiB}}],
        b"\0" * 8,
    ),
    # a JSON output of shape [2**40, 2] with four numbers.
    "json_shape": [_json_answer([{"name": "y", "datatype": "FP32", "shape": [1 << 40, 2], "data": [1, 2, 3, 4]}])],
}
GRPC_LIES: dict[str, bytes] = {
    "ok": _ok_grpc(),
    "raw_shape": _grpc_answer([("y", "FP32", [1 << 40, 2])], [b"\0" * 12]),
    "bytes_count": _grpc_answer([("y", "BYTES", [1 << 30])], [b"\0" * 12]),
}

_MEASURE = textwrap.dedent("""
    import json, resource, sys, time
    import numpy as np
    import neuropod
    from neuropod.errors import RemoteError

    urls = json.loads(sys.argv[1])
    x = np.array([[1, 2], [3, 4]], np.float32)
    models = {case: neuropod.load_neuropod(url, timeout=1) for case, url in urls.items()}
    for case, model in models.items():
        if case.endswith(":ok"):
            model.infer({"x": x})  # everything a call imports and allocates, before the baseline
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = {}
    for case, model in models.items():
        if case.endswith(":ok"):
            continue
        t0 = time.monotonic()
        try:
            model.infer({"x": x})
            results[case] = {"error": None}
        except RemoteError as e:
            results[case] = {"code": e.code, "error": str(e), "s": time.monotonic() - t0}
    results["grew_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    print(json.dumps(results))
""")


def test_sizes_a_server_only_claims_cost_no_memory() -> None:
    """Answers that announce 1 GiB to terabytes and send a few bytes: the client process's peak
    RSS grows by less than 64 MiB over all of them, and each is a clear RemoteError naming the URL."""
    with _servers(lambda name: HTTP_LIES[name], lambda name: GRPC_LIES[name]) as fakes:
        urls = {f"http:{c}": fakes["http"].url(c) for c in HTTP_LIES}
        urls.update({f"grpc:{c}": fakes["grpc"].url(c) for c in GRPC_LIES})
        proc = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(urls)], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results.pop("grew_kib") < 64 * 1024, results
    expected = {
        "http:content_length": (
            "protocol",
            "closed the connection before the end of the answer it announced (1073741812 bytes short)",
        ),
        "http:content_length_stalls": ("deadline_exceeded", "no answer within 1 s"),
        "http:chunk": ("protocol", "closed the connection before the end of the answer it announced"),
        "http:binary_shape": ("protocol", "binary_data_size 2147483648 runs past the body"),
        "http:json_shape": ("protocol", "holds 2199023255552 elements, but 'data' has 4"),
        "grpc:raw_shape": (
            "protocol",
            "needs 8796093022208 bytes (2199023255552 x 4), but the size of raw_output_contents[0] is 12",
        ),
        "grpc:bytes_count": ("protocol", "holds 1073741824 BYTES elements, which need at least 4294967296 bytes"),
    }
    assert set(results) == set(expected)
    for case, (code, words) in expected.items():
        got = results[case]
        assert got["error"] is not None, f"{case}: the lie was believed"
        assert got["code"] == code and words in got["error"], (case, got)
        assert urls[case] in got["error"], (case, got)
        assert got["s"] < 2.5, (case, got)  # timeout=1: nothing waits much past it


# --- 2. timeout= is a deadline for the whole call ------------------------------------


TRICKLES: dict[str, Steps] = {
    # the status line and headers one byte every 0.1 s, 6 s in all
    "head": [x for b in _ok_answer()[:60] for x in (bytes([b]), 0.1)],
    # the head at once, then the body one byte every 0.3 s
    "body": [_ok_answer()[: _ok_answer().index(b"\r\n\r\n") + 4]]
    + [x for b in b'{"outputs":[{"name"' for x in (0.3, bytes([b]))],
}


@pytest.mark.parametrize("trickle", sorted(TRICKLES))
def test_timeout_is_a_deadline_for_the_whole_rest_call(trickle: str) -> None:
    """Each read of a trickled answer comes well within the timeout; the call still ends at it."""
    with _servers(lambda name: TRICKLES[name], lambda name: _ok_grpc()) as fakes:
        model = neuropod.load_neuropod(fakes["http"].url(trickle), timeout=1)
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as e:
            model.infer({"x": X})
        took = time.monotonic() - t0
        model.close()
    assert e.value.code == "deadline_exceeded" and "no answer within 1 s" in str(e.value), e.value
    assert fakes["http"].url(trickle) in str(e.value)
    assert 0.9 < took < 1.5, took


def test_timeout_is_a_deadline_for_the_whole_grpc_call() -> None:
    def slow(name: str) -> bytes:
        time.sleep(4)
        return _ok_grpc()

    with _servers(lambda name: [_ok_answer()], slow) as fakes:
        model = neuropod.load_neuropod(fakes["grpc"].url("m"), timeout=1)
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as e:
            model.infer({"x": X})
        took = time.monotonic() - t0
        model.close()
    assert e.value.code == "deadline_exceeded" and "no answer within 1 s" in str(e.value), e.value
    assert fakes["grpc"].url("m") in str(e.value)
    assert 0.9 < took < 1.5, took


def test_loading_from_a_server_that_trickles_its_metadata_ends_at_connect_timeout() -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            for b in b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{":
                conn.sendall(bytes([b]))
                time.sleep(0.1)

    threading.Thread(target=trickle, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/m"
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as e:
        neuropod.load_neuropod(url, connect_timeout=1)
    took = time.monotonic() - t0
    listener.close()
    assert e.value.code == "deadline_exceeded" and url in str(e.value) and "no answer within 1 s" in str(e.value)
    assert 0.9 < took < 1.5, took


# --- 3. a process that imported tritonclient.grpc -------------------------------------

_TRITON_FIRST = textwrap.dedent("""
    import sys
    import numpy as np
    import tritonclient.grpc  # its own inference.* protobuf messages, in protobuf's default pool
    import neuropod

    for url in sys.argv[1:]:
        with neuropod.load_neuropod(url) as model:
            out = model.infer({"x": np.array([[1, 2], [3, 4]], np.float32)})
            print(url, out["y"].tolist())
""")
_TRITON_AFTER = textwrap.dedent("""
    import sys
    import numpy as np
    import neuropod

    with neuropod.load_neuropod(sys.argv[1]) as model:
        import tritonclient.grpc

        tritonclient.grpc.InferInput("x", [2, 2], "FP32")  # tritonclient's messages work too
        out = model.infer({"x": np.array([[1, 2], [3, 4]], np.float32)})
        print(sys.argv[1], out["y"].tolist())
""")


def test_remote_models_work_beside_tritonclient_grpc() -> None:
    pytest.importorskip("tritonclient.grpc")
    with _servers(lambda name: [_ok_answer()], lambda name: _ok_grpc()) as fakes:
        urls = [fakes["http"].url("m"), fakes["grpc"].url("m")]
        first = subprocess.run([sys.executable, "-c", _TRITON_FIRST, *urls], capture_output=True, text=True, timeout=60)
        after = subprocess.run([sys.executable, "-c", _TRITON_AFTER, urls[1]], capture_output=True, text=True,
                               timeout=60)  # fmt: skip
    assert first.returncode == 0, first.stderr
    assert after.returncode == 0, after.stderr
    want = str(X.tolist())
    assert first.stdout.splitlines() == [f"{u} {want}" for u in urls]
    assert after.stdout.splitlines() == [f"{urls[1]} {want}"]


# --- 4. wrong outputs name the URL --------------------------------------------------

Y = X.tobytes()
WRONG: dict[str, tuple[Steps, bytes, str]] = {
    # case: (REST answer, gRPC answer, words both errors hold)
    "dtype": ([_json_answer([{"name": "y", "datatype": "FP64", "shape": [2, 2], "data": [1, 2, 3, 4]}])],
              _grpc_answer([("y", "FP64", [2, 2])], [X.astype(np.float64).tobytes()]), "float64"),
    "rank": ([_json_answer([{"name": "y", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]}])],
             _grpc_answer([("y", "FP32", [4])], [Y]), "'y'"),
    "dim": ([_json_answer([{"name": "y", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}])],
            _grpc_answer([("y", "FP32", [1, 4])], [Y]), "'y'"),
    "missing": ([_json_answer([])], _grpc_answer([], []), "did not return output(s) 'y'"),
    "extra": ([_json_answer([{"name": "y", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3, 4]},
                             {"name": "z", "datatype": "FP32", "shape": [1], "data": [1]}])],
              _grpc_answer([("y", "FP32", [2, 2]), ("z", "FP32", [1])], [Y, Y[:4]]), "'z'"),
    "malformed": ([http_message("200 OK", b"{\"outputs\": [", "Content-Type: application/json\r\n")],
                  b"\xff\xff\xff\xff not a message", "Open Inference Protocol"),
}  # fmt: skip


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("case", sorted(WRONG))
def test_wrong_outputs_are_a_remote_error_naming_the_url(protocol: str, case: str) -> None:
    with _servers(lambda name: WRONG[name][0], lambda name: WRONG[name][1]) as fakes:
        url = fakes[protocol].url(case)
        with neuropod.load_neuropod(url, timeout=5) as model, pytest.raises(RemoteError) as e:
            model.infer({"x": X})
    message = str(e.value)
    assert e.value.code == "protocol" and e.value.url == url, message
    assert message.startswith(f"Remote model {url} (infer): the server's answer does not follow"), message
    assert WRONG[case][2] in message, message


# --- 5. a token in plain text ----------------------------------------------------------


def test_which_hosts_are_loopback() -> None:
    for host in ("localhost", "LOCALHOST", "localhost.", "api.localhost", "127.0.0.1", "127.8.9.10", "::1",
                 "[::1]", "::ffff:127.0.0.1"):  # fmt: skip
        assert is_loopback(host), host
    for host in (
        "10.0.0.1",
        "192.168.1.2",
        "example.com",
        "localhost.example.com",
        "::2",
        "0.0.0.0",
        "::ffff:10.0.0.1",
    ):
        assert not is_loopback(host), host


def _own_address() -> str | None:
    """This machine's address on its default route (a UDP connect sends nothing), if not loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never answered
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if is_loopback(address) or address == "0.0.0.0" else address


def test_a_token_without_tls_to_a_loopback_server_does_not_warn() -> None:
    with (
        _servers(lambda name: [_ok_answer()], lambda name: _ok_grpc()) as fakes,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        for protocol in ("http", "grpc"):
            with neuropod.load_neuropod(fakes[protocol].url("m"), auth_token="s3cret") as model:
                np.testing.assert_array_equal(model.infer({"x": X})["y"], X)
    assert not [str(w.message) for w in caught if issubclass(w.category, PlainTextTokenWarning)]


def test_a_token_without_tls_to_another_host_warns_once_per_server() -> None:
    address = _own_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    with _servers(lambda name: [_ok_answer()], lambda name: _ok_grpc(), host=address) as fakes:
        for protocol, secure in (("http", "https"), ("grpc", "grpcs")):
            url = fakes[protocol].url("m")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(3):  # three loads, one warning
                    neuropod.load_neuropod(url, auth_token="s3cret").close()
                neuropod.load_neuropod(url).close()  # no token, nothing to warn about
            mine = [w for w in caught if issubclass(w.category, PlainTextTokenWarning)]
            assert len(mine) == 1, [str(w.message) for w in caught]
            text = str(mine[0].message)
            assert url in text and "plain text" in text and f"{secure}://" in text, text
            assert "s3cret" not in text
            assert Path(mine[0].filename).resolve() == Path(__file__).resolve()  # points at the load_neuropod call
