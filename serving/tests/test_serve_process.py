"""`neuropod serve` as a real process, and a fuzz of request bodies against a listening server.

The process tests start the real command (``python -m neuropod serve``) on a
free port with a bearer token, talk to it over HTTP, then SIGTERM it and check
that it exits promptly and leaves no worker process behind. The fuzz throws
random and mutated bodies at an in-thread uvicorn server and checks that
every answer is a client error (never a 500 or a hang for a healthy model).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")


from neuropod_serving.protocol import HEADER_LENGTH, build_infer_request, parse_infer_response  # noqa: E402
from neuropod_serving.server import Engine, ModelRegistry, create_app  # noqa: E402

from conftest import adder_and_echo, alive, descendants, free_port, private_caches, serve_in_thread  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for worker processes")

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def repo() -> Iterator[Path]:
    """A folder with the adder and echo packages, a token file, and a private cache."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-serve-process-"))
    with private_caches(root):
        adder_and_echo(root / "models", echo_as_zip=False)
        (root / "token").write_text(f"{TOKEN}\nsecond line is ignored\n")
        yield root
    shutil.rmtree(root, ignore_errors=True)


class _Served:
    def __init__(self, proc: subprocess.Popen[str], base: str):
        self.proc = proc
        self.base = base
        self.http = httpx.Client(base_url=base, timeout=10)


def _start(repo: Path, *extra: str) -> _Served:
    port = free_port()
    cmd = [sys.executable, "-m", "neuropod", "serve", str(repo / "models"), "--http-port", str(port),
           "--grpc-port", str(free_port()), "--metrics-port", "0",
           "--auth-token-file", str(repo / "token"), *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    served = _Served(proc, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"neuropod serve exited with {proc.returncode} before it was ready:\n{out}\n{err}")
        try:
            if served.http.get("/v2/health/ready", timeout=1).status_code == 200:
                return served
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"neuropod serve was not ready within 30 s:\n{out}\n{err}")
        time.sleep(0.1)


def _stop(served: _Served) -> tuple[str, str, float]:
    """SIGTERM the server; its stdout, stderr and how long it took to exit."""
    served.http.close()
    t0 = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    try:
        out, err = served.proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        out, err = served.proc.communicate()
        pytest.fail(f"neuropod serve did not exit within 10 s of SIGTERM:\n{out}\n{err}")
    return out, err, time.monotonic() - t0


def _check_adder(served: _Served, batch: int = 3) -> None:
    rng = np.random.default_rng(batch)
    x, y = (rng.standard_normal((batch, 2)).astype(np.float32) for _ in range(2))
    header = {"inputs": [{"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
                         for n, a in (("x", x), ("y", y))]}  # fmt: skip
    assert served.http.post("/v2/models/adder/infer", json=header).status_code == 401
    r = served.http.post("/v2/models/adder/infer", json=header, headers=AUTH)
    assert r.status_code == 200, r.text
    got = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}
    np.testing.assert_allclose(got["out"], x + y, rtol=1e-6)
    np.testing.assert_allclose(got["doubled"], (x + y) * 2, rtol=1e-6)
    # And over the binary tensor extension.
    body = build_infer_request({"x": x, "y": y}, binary_outputs=True)
    r = served.http.post("/v2/models/adder/versions/1/infer", content=body.content,
                         headers={**AUTH, HEADER_LENGTH: str(body.json_length)})  # fmt: skip
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(parse_infer_response(r.content, r.headers[HEADER_LENGTH]).outputs["doubled"],
                               (x + y) * 2, rtol=1e-6)  # fmt: skip


def _check_echo(served: _Served) -> None:
    n = np.array([-(2**62), 0, 41], np.int64)
    header = {"inputs": [{"name": "n", "datatype": "INT64", "shape": [3], "data": n.tolist()},
                         {"name": "s", "datatype": "BYTES", "shape": [3], "data": ["héllo", "", "a\x00b"]}]}  # fmt: skip
    r = served.http.post("/v2/models/echo/infer", json=header, headers=AUTH)
    assert r.status_code == 200, r.text
    outputs = {o["name"]: o["data"] for o in r.json()["outputs"]}
    assert outputs == {"n1": (n + 1).tolist(), "s_out": ["héllo", "", "a\x00b"]}


def test_serve_process_with_token(repo: Path) -> None:
    served = _start(repo)
    pid = served.proc.pid
    try:
        http = served.http
        for path in ("/v2/health/live", "/v2/health/ready"):
            assert http.get(path).status_code == 200, path
        for path in ("/v2", "/v2/models/adder", "/v2/models/echo/ready"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401, path
            assert http.get(path, headers=AUTH).status_code == 200, path
        assert http.get("/v2/models/adder", headers=AUTH).json()["inputs"][0]["shape"] == [-1, 2]
        assert http.get("/v2/models/nope", headers=AUTH).status_code == 404
        _check_adder(served)
        _check_echo(served)
        children = descendants(pid)
    finally:
        out, err, took = _stop(served)
    assert served.proc.returncode in (0, -signal.SIGTERM), err
    assert took < 10
    lines = out.splitlines()
    assert lines[0].split() == ["MODEL", "PLATFORM", "BACKEND", "DEVICE", "BATCHED", "INPUTS"], out
    assert any(line.startswith("adder") and "onnx" in line and "x: float32[batch_size, 2]" in line for line in lines), (
        out
    )
    assert any(line.startswith("echo") for line in lines), out
    assert "serving 2 model(s)" in out and "bearer token required" in out and TOKEN not in out + err
    deadline = time.monotonic() + 5
    while any(map(alive, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [c for c in children if alive(c)], "processes left behind after SIGTERM"


def test_serve_process_quiet_with_workers(repo: Path) -> None:
    served = _start(repo, "--workers", "2", "--quiet")
    pid = served.proc.pid
    try:
        # Two models, two workers each, every one a child of the server.
        workers = descendants(pid)
        cmdlines = [Path(f"/proc/{w}/cmdline").read_bytes().split(b"\0") for w in workers if alive(w)]
        assert sum(b"neuropod.ope.worker" in c for c in cmdlines) == 4, cmdlines
        for batch in (1, 3, 7):
            _check_adder(served, batch)
        _check_echo(served)
        # Concurrent requests, answered by both workers.
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda b: _check_adder(served, b), range(1, 17)))
        assert descendants(pid) == workers, "a worker was restarted while serving"
    finally:
        out, err, took = _stop(served)
    assert served.proc.returncode in (0, -signal.SIGTERM), err
    assert took < 10
    assert "MODEL" not in out and "serving" not in out, out  # --quiet
    deadline = time.monotonic() + 5
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if alive(w)], "worker processes left behind after SIGTERM"


# --- the fuzz -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_server(repo: Path) -> Iterator[str]:
    """A real uvicorn server in a background thread with a small body limit; yields its base URL."""
    engine = Engine(ModelRegistry.load([repo / "models"]))
    with serve_in_thread(create_app(engine, max_request_bytes=4096), log_level="critical") as port:
        yield f"http://127.0.0.1:{port}"
    engine.close()


@pytest.fixture(scope="module")
def fuzz_client(fuzz_server: str) -> Iterator[Any]:
    with httpx.Client(base_url=fuzz_server, timeout=5) as c:
        yield c


_VALID_X = np.arange(6, dtype=np.float32).reshape(3, 2)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_keys = st.sampled_from(["name", "datatype", "shape", "data", "parameters", "binary_data_size", "inputs", "outputs"])
_weird = _json | st.sampled_from(
    [
        "FP32",
        "FP16",
        "INT64",
        "BYTES",
        "BOOL",
        "BF16",
        "UINT8",
        "x",
        "y",
        "",
        -1,
        0,
        2**63,
        1e308,
        [],
        {},
        [-1, 2],
        [3, -2],
        [2**40, 2**40],
        [0, 2],
        [3],
        [3, 2, 1],
        "NaN",
    ]
)
_header_values = st.sampled_from(
    ["", "-1", "0", "abc", "1e3", "99999999999999999999", "5 6", "+5", "0x10", "1_0", b"\xb2", b"\xd9\xa3"]
) | st.integers(-5, 300).map(str)  # b"\xd9\xa3": an Arabic-Indic digit three in UTF-8


def _valid(binary: bool) -> tuple[dict[str, Any], bytes]:
    """A valid adder request: its JSON header and its binary tail."""
    if not binary:
        inputs = [{"name": n, "datatype": "FP32", "shape": [3, 2], "data": _VALID_X.ravel().tolist()} for n in "xy"]
        return {"inputs": inputs, "outputs": [{"name": "out"}]}, b""
    inputs = [{"name": n, "datatype": "FP32", "shape": [3, 2], "parameters": {"binary_data_size": 24}} for n in "xy"]
    return {"inputs": inputs, "parameters": {"binary_data_output": True}}, _VALID_X.tobytes() * 2


@st.composite
def _mutated(draw: st.DrawFn) -> tuple[str, bytes, dict[str, Any]]:
    binary = draw(st.booleans())
    header, tail = _valid(binary)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["input", "top", "tail"]))
        inputs = header.get("inputs")
        if (
            where == "input"
            and isinstance(inputs, list)
            and len(inputs) == 2
            and all(isinstance(t, dict) for t in inputs)
        ):
            tensor = inputs[draw(st.integers(0, 1))]
            key = draw(_keys)
            if key == "binary_data_size":
                if not isinstance(tensor.get("parameters"), dict):
                    tensor["parameters"] = {}
                tensor["parameters"][key] = draw(_weird)
            elif draw(st.integers(0, 4)) == 0:
                tensor.pop(key, None)
            else:
                tensor[key] = draw(_weird)
        elif where != "tail":
            header[draw(_keys)] = draw(_weird)
        else:
            tail = draw(st.binary(max_size=64))
    try:
        raw = json.dumps(header).encode()
    except ValueError:  # NaN and friends are fine for json.dumps; this is belt and braces
        raw = b"{}"
    headers: dict[str, Any] = {}
    if binary or draw(st.booleans()):
        headers[HEADER_LENGTH] = str(len(raw))
    if draw(st.integers(0, 3)) == 0:
        headers[HEADER_LENGTH] = draw(_header_values)
    model = draw(st.sampled_from(["adder", "adder", "echo", "nope"]))
    return model, raw + tail, headers


_bodies = st.one_of(
    st.tuples(st.just("adder"), st.binary(max_size=300), st.just({})),
    st.tuples(st.sampled_from(["adder", "echo"]), _json.map(lambda v: json.dumps(v).encode()), st.just({})),
    st.tuples(
        st.sampled_from(["adder", "echo"]),
        st.fixed_dictionaries({"inputs": st.lists(st.dictionaries(_keys, _weird, max_size=5), max_size=3)}).map(
            lambda v: json.dumps(v).encode()
        ),
        st.just({}),
    ),
    st.tuples(st.just("adder"), st.binary(max_size=300), _header_values.map(lambda h: {HEADER_LENGTH: h})),
    _mutated(),
)


# FUZZ_N=3000 for a longer hunt (about 50 ms an example).
@settings(
    max_examples=int(os.environ.get("FUZZ_N", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=_bodies)
def test_fuzz_infer_bodies(fuzz_client: Any, case: tuple[str, bytes, dict[str, Any]]) -> None:
    model, body, headers = case
    r = fuzz_client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text, body[:200], headers)
    if r.status_code != 200:
        assert isinstance(r.json()["error"], str) and r.json()["error"]


def test_fuzzed_server_still_serves(fuzz_client: Any) -> None:
    header, _ = _valid(False)
    r = fuzz_client.post("/v2/models/adder/infer", json=header)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"]).reshape(3, 2), _VALID_X * 2)


@pytest.mark.parametrize("value", [b"\xb2", b"\xd9\xa3", b"12x", b"-1"])
def test_bad_content_length_is_400(value: bytes) -> None:
    """uvicorn (h11) refuses these itself; the app must too, behind a server that passes them on."""
    import asyncio

    from starlette.requests import Request

    from neuropod_serving.protocol import ProtocolError
    from neuropod_serving.server.app import _read_body

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    request = Request({"type": "http", "method": "POST", "headers": [(b"content-length", value)]}, receive)
    with pytest.raises(ProtocolError, match="Content-Length must be a byte count") as info:
        asyncio.run(_read_body(request, 100))
    assert info.value.status == 400
