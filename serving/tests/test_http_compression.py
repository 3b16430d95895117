"""HTTP compression of REST inference and JSON errors on every route, against a real server.

The REST app runs on uvicorn in a thread with a small ``max_request_bytes``
(so that a zip bomb can be shown to stop at the bound) and is driven by
tritonclient.http with its compression options, and by raw requests for what
tritonclient cannot send (a bomb, a truncated or unknown encoding). Expected
outputs are computed with numpy.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
httpclient = pytest.importorskip("tritonclient.http")

from tritonclient.utils import InferenceServerException  # noqa: E402

from neuropod_serving.protocol import ProtocolError  # noqa: E402
from neuropod_serving.server import Engine, ModelRegistry, create_app  # noqa: E402
from neuropod_serving.server.compression import COMPRESS_FROM, chosen, compressed, decoded_body  # noqa: E402

from conftest import adder_and_echo, private_caches, serve_in_thread  # noqa: E402

LIMIT = 1 << 20  # max_request_bytes of the server


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-compression-"))
    try:
        with private_caches(root):
            adder_and_echo(root / "models", echo_as_zip=False)
            engine = Engine(ModelRegistry.load([root / "models"]))
            try:
                with serve_in_thread(create_app(engine, max_request_bytes=LIMIT)) as port:
                    yield f"127.0.0.1:{port}"
            finally:
                engine.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def http(base: str) -> Iterator[Any]:
    # No Accept-Encoding unless a test sends one (httpx would ask for gzip on every request).
    with httpx.Client(base_url=f"http://{base}", timeout=60, headers={"Accept-Encoding": "identity"}) as client:
        yield client


def _adder(rows: int, seed: int = 0, binary: bool = True) -> tuple[list[Any], np.ndarray]:
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((rows, 2)).astype(np.float32), rng.standard_normal((rows, 2)).astype(np.float32)
    inputs = [httpclient.InferInput(n, [rows, 2], "FP32") for n in "xy"]
    inputs[0].set_data_from_numpy(x, binary_data=binary)
    inputs[1].set_data_from_numpy(y, binary_data=binary)
    return inputs, x + y


@pytest.mark.parametrize("request_algorithm", [None, "gzip", "deflate"])
@pytest.mark.parametrize("response_algorithm", [None, "gzip", "deflate"])
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_compression(
    base: str, request_algorithm: str | None, response_algorithm: str | None, binary: bool
) -> None:
    client = httpclient.InferenceServerClient(base)
    try:
        for rows in (1, 300):  # a small answer (sent as it is) and one above COMPRESS_FROM
            inputs, expected = _adder(rows, seed=rows, binary=binary)
            outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("out", "doubled")]
            result = client.infer(
                "adder", inputs, outputs=outputs,
                request_compression_algorithm=request_algorithm, response_compression_algorithm=response_algorithm,
            )  # fmt: skip
            np.testing.assert_allclose(result.as_numpy("out"), expected, rtol=1e-6)
            np.testing.assert_allclose(result.as_numpy("doubled"), expected * 2, rtol=1e-6)
    finally:
        client.close()


def _binary_body(rows: int) -> tuple[bytes, dict[str, str], np.ndarray]:
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    header = {"inputs": [{"name": n, "datatype": "FP32", "shape": [rows, 2], "parameters": {"binary_data_size": x.nbytes}}
                         for n in "xy"], "parameters": {"binary_data_output": True}}  # fmt: skip
    text = json.dumps(header).encode()
    return text + x.tobytes() * 2, {"Inference-Header-Content-Length": str(len(text))}, x * 2


def test_response_is_compressed_only_when_asked_and_large(http: Any) -> None:
    body, headers, expected = _binary_body(400)
    plain = http.post("/v2/models/adder/infer", content=body, headers=headers)
    assert plain.status_code == 200 and "content-encoding" not in plain.headers
    for encoding, decompress in (("gzip", gzip.decompress), ("deflate", zlib.decompress)):
        with http.stream(
            "POST", "/v2/models/adder/infer", content=body, headers={**headers, "Accept-Encoding": encoding}
        ) as r:
            assert r.status_code == 200 and r.headers["content-encoding"] == encoding
            assert r.headers["vary"] == "accept-encoding"
            raw = b"".join(r.iter_raw())
        assert decompress(raw) == plain.content
        assert int(r.headers["content-length"]) == len(raw) < len(plain.content)
    length = int(plain.headers["inference-header-content-length"])
    out = np.frombuffer(plain.content[length : length + expected.nbytes], np.float32).reshape(expected.shape)
    np.testing.assert_array_equal(out, expected)
    # Refused with q=0, gzip preferred when both are accepted; a small answer is sent as it is.
    r = http.post("/v2/models/adder/infer", content=body, headers={**headers, "Accept-Encoding": "gzip;q=0, deflate"})
    assert r.headers["content-encoding"] == "deflate"
    r = http.post("/v2/models/adder/infer", content=body, headers={**headers, "Accept-Encoding": "br;q=1, gzip;q=0"})
    assert "content-encoding" not in r.headers
    small, small_headers, _ = _binary_body(1)
    r = http.post("/v2/models/adder/infer", content=small, headers={**small_headers, "Accept-Encoding": "gzip"})
    assert r.status_code == 200 and len(r.content) < COMPRESS_FROM and "content-encoding" not in r.headers


def test_zip_bomb_is_refused_at_the_bound(http: Any) -> None:
    """A 10 KiB gzip body that inflates to 10 MiB (ten times the limit) is a 413, not 10 MiB of memory."""
    bomb = gzip.compress(b"\0" * (10 * LIMIT))
    assert len(bomb) < 16 * 1024
    r = http.post("/v2/models/adder/infer", content=bomb, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413, r.text
    assert "decompresses to more than" in r.json()["error"] and f"{LIMIT:,}" in r.json()["error"]
    r = http.post(
        "/v2/repository/index", content=zlib.compress(b" " * (2 * LIMIT)), headers={"Content-Encoding": "deflate"}
    )
    assert r.status_code == 413, r.text
    # Exactly at the limit is fine (the body is then a bad request for its JSON, not for its size).
    r = http.post("/v2/models/adder/infer", content=gzip.compress(b" " * LIMIT), headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "decompresses" not in r.json()["error"], r.text


@pytest.mark.parametrize(
    ("encoding", "body", "status", "words"),
    [
        ("br", b"{}", 415, ["'br'", "gzip", "deflate"]),
        ("gzip, gzip", b"{}", 415, ["'gzip, gzip'"]),
        ("gzip", gzip.compress(b'{"inputs": []}')[:-12], 400, ["truncated"]),
        ("gzip", b"not gzip at all", 400, ["not valid gzip"]),
        ("deflate", b"not deflate at all", 400, ["not valid deflate"]),
        ("gzip", gzip.compress(b"{}") + b"junk", 400, ["after its compressed data"]),
    ],
)
def test_bad_encodings(http: Any, encoding: str, body: bytes, status: int, words: list[str]) -> None:
    r = http.post("/v2/models/adder/infer", content=body, headers={"Content-Encoding": encoding})
    assert r.status_code == status, r.text
    for word in words:
        assert word in r.json()["error"], (word, r.json())
    assert http.get("/v2/health/ready").status_code == 200


def test_raw_deflate_and_identity(http: Any) -> None:
    body = json.dumps(
        {"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]} for n in "xy"]}
    ).encode()
    packer = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    raw = packer.compress(body) + packer.flush()
    for encoding, content in (("deflate", raw), ("identity", body), ("GZIP", gzip.compress(body))):
        r = http.post("/v2/models/adder/infer", content=content, headers={"Content-Encoding": encoding})
        assert r.status_code == 200, (encoding, r.text)
        assert {o["name"]: o["data"] for o in r.json()["outputs"]}["out"] == [2.0, 4.0]


def test_codec_helpers() -> None:
    assert chosen(b"gzip, deflate") == b"gzip" and chosen(b"deflate") == b"deflate"
    assert chosen(b"identity") is None and chosen(b"gzip;q=0.0") is None and chosen(b"*") is None
    assert chosen(b"GZIP ; q=0.5") == b"gzip" and chosen(b"gzip;q=abc") is None
    data = os.urandom(5000) + b"\0" * 5000
    for encoding in (b"gzip", b"deflate"):
        assert decoded_body(compressed(data, encoding), encoding, len(data)) == data
        with pytest.raises(ProtocolError) as info:
            decoded_body(compressed(data, encoding), encoding, len(data) - 1)
        assert info.value.status == 413


# -- JSON errors everywhere -----------------------------------------------------------------------


def test_unknown_routes_and_methods_answer_json(http: Any, base: str) -> None:
    r = http.get("/no/such/route")
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    assert "'/no/such/route'" in r.json()["error"]
    r = http.post("/v2/health/live")
    assert r.status_code == 405 and "POST" in r.json()["error"] and "GET" in r.json()["error"], r.text
    assert "GET" in r.headers["allow"]
    r = http.get("/v2/models/adder/infer")
    assert r.status_code == 405 and "POST" in r.json()["error"], r.text
    # tritonclient shows our message, not "Parse error at offset 1".
    client = httpclient.InferenceServerClient(base)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.get_trace_settings()
        assert info.value.status() == "404" and "no route" in info.value.message(), info.value
    finally:
        client.close()


def test_index_entries_all_have_a_reason(http: Any) -> None:
    entries = http.post("/v2/repository/index").json()
    assert entries and all(e["reason"] == "" for e in entries if e["state"] == "READY"), entries
    python = os.environ.get("NEUROPOD_TEST_MLSERVER_PYTHON")
    if not python:
        pytest.skip("MLServer's types check needs NEUROPOD_TEST_MLSERVER_PYTHON (a venv with mlserver)")
    check = (
        "import json, sys\n"
        "from mlserver.types import RepositoryIndexResponse\n"
        "r = RepositoryIndexResponse.model_validate(json.loads(sys.stdin.read()))\n"
        "print(json.dumps([[i.name, getattr(i.state, 'value', i.state), i.reason] for i in r.root]))\n"
    )
    done = subprocess.run([python, "-c", check], input=json.dumps(entries), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [[e["name"], e["state"], e["reason"]] for e in entries]


def test_the_real_command(tmp_path: Path) -> None:
    """``neuropod serve`` (uvicorn with this project's one-write httptools protocol): compression both
    ways through tritonclient, and JSON for a route that does not exist."""
    from neuropod.testing import served

    with private_caches(tmp_path):
        adder_and_echo(tmp_path / "models", echo_as_zip=False)
        with served(tmp_path / "models") as s:
            client = httpclient.InferenceServerClient(s.http.removeprefix("http://"))
            try:
                inputs, expected = _adder(500, seed=9)
                result = client.infer(
                    "adder", inputs, request_compression_algorithm="gzip", response_compression_algorithm="deflate"
                )
                np.testing.assert_allclose(result.as_numpy("out"), expected, rtol=1e-6)
                with pytest.raises(InferenceServerException) as info:
                    client.get_log_settings()
                assert info.value.status() == "404" and "no route" in info.value.message()
            finally:
                client.close()
            body, headers, doubled = _binary_body(400)
            with httpx.Client(base_url=s.http, timeout=60) as http:
                plain = http.post("/v2/models/adder/infer", content=body, headers={**headers, "Accept-Encoding": "identity"})
                with http.stream(
                    "POST", "/v2/models/adder/infer", content=gzip.compress(body),
                    headers={**headers, "Content-Encoding": "gzip", "Accept-Encoding": "gzip"},
                ) as r:  # fmt: skip
                    assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
                    raw = b"".join(r.iter_raw())
            assert gzip.decompress(raw) == plain.content and len(raw) < len(plain.content)
            start = int(plain.headers["inference-header-content-length"])
            out = np.frombuffer(plain.content[start : start + doubled.nbytes], np.float32).reshape(doubled.shape)
            np.testing.assert_array_equal(out, doubled)
