"""The model repository extension (index, load, unload) against a real server.

The repository is the folder given at start (``ModelRegistry.load``). Each
test serves its own copy of it from a uvicorn server in a thread, drives it
with tritonclient.http (a client nobody here wrote) and with plain JSON POSTs
as in the KServe/Triton docs, and checks what the index says, what metadata
and inference answer, and the ``neuropod_models_loaded`` gauge.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
httpclient = pytest.importorskip("tritonclient.http")

from onnx import TensorProto, helper  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from neuropod_serving.server import BatchPolicy, Engine, ModelRegistry, create_app  # noqa: E402
from neuropod_serving.server.metrics import ServerMetrics  # noqa: E402

from conftest import ADDER_IN, ADDER_OUT, adder_and_echo, onnx_package, private_caches, serve_in_thread  # noqa: E402


@pytest.fixture(scope="module")
def packages() -> Iterator[Path]:
    """Packages to copy into each test's repository: adder, echo (a zip), ``tripler``
    (out = 3x, doubled = 6x; for a package added after start), and ``needs_future_ort``
    (readable, but no installed onnxruntime satisfies its version range)."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-repository-test-"))
    with private_caches(root):
        adder_and_echo(root / "start", echo_as_zip=True)
        onnx_package(root / "tripler", "tripler",
                     [helper.make_node("Mul", ["x", "three"], ["out"]), helper.make_node("Add", ["out", "out"], ["doubled"])],
                     ADDER_IN[:1], ADDER_OUT, [helper.make_tensor("three", TensorProto.FLOAT, [], [3.0])])  # fmt: skip
        with pytest.warns(UserWarning, match="not checked by loading it"):
            onnx_package(root / "needs_future_ort", "needs_future_ort", [helper.make_node("Identity", ["x"], ["out"])],
                         ADDER_IN[:1], ADDER_OUT[:1], platform_version_semver=">=99")  # fmt: skip
        yield root
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class Server:
    models: Path  # the repository folder
    engine: Engine
    http: Any  # httpx.Client
    triton: Any  # tritonclient.http.InferenceServerClient
    url: str


@pytest.fixture
def server(packages: Path, tmp_path: Path) -> Iterator[Server]:
    """A server over a fresh copy of the start packages, with metrics."""
    models = tmp_path / "models"
    shutil.copytree(packages / "start", models)
    engine = Engine(ModelRegistry.load([models]), metrics=ServerMetrics())
    try:
        with serve_in_thread(create_app(engine)) as port:
            url = f"127.0.0.1:{port}"
            triton = httpclient.InferenceServerClient(url)
            with httpx.Client(base_url=f"http://{url}", timeout=10) as http:
                try:
                    yield Server(models, engine, http, triton, url)
                finally:
                    triton.close()
    finally:
        engine.close()


def _index(s: Server) -> dict[str, dict[str, Any]]:
    """The index through tritonclient, checked against a plain POST with an empty JSON object."""
    entries = s.triton.get_model_repository_index()
    plain = s.http.post("/v2/repository/index", json={})
    assert plain.status_code == 200, plain.text
    assert plain.json() == entries
    by_name = {e["name"]: e for e in entries}
    assert len(by_name) == len(entries), entries
    return by_name


def _loaded_gauge(s: Server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(s.http.get("/metrics").text)}
    return float(families["neuropod_models_loaded"].samples[0].value)


def _adder_ok(s: Server, batch: int = 2) -> None:
    rng = np.random.default_rng(batch)
    x, y = rng.standard_normal((batch, 2)).astype(np.float32), rng.standard_normal((batch, 2)).astype(np.float32)
    inputs = [httpclient.InferInput(n, [batch, 2], "FP32") for n in "xy"]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(y)
    result = s.triton.infer("adder", inputs)
    np.testing.assert_allclose(result.as_numpy("out"), x + y, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("doubled"), (x + y) * 2, rtol=1e-6)


def _echo_ok(s: Server) -> None:
    body = {"inputs": [{"name": "n", "datatype": "INT64", "shape": [2], "data": [5, -7]},
                       {"name": "s", "datatype": "BYTES", "shape": [2], "data": ["a", "bc"]}]}  # fmt: skip
    r = s.http.post("/v2/models/echo/infer", json=body)
    assert r.status_code == 200, r.text
    assert {o["name"]: o["data"] for o in r.json()["outputs"]} == {"n1": [6, -6], "s_out": ["a", "bc"]}


def test_index_lists_every_package_ready(server: Server) -> None:
    index = _index(server)
    assert set(index) == {"adder", "echo"}
    for entry in index.values():
        assert entry["state"] == "READY", entry
        assert entry["version"] == "1"
    # An empty body is the same request (tritonclient sends none).
    r = server.http.post("/v2/repository/index")
    assert r.status_code == 200 and {e["name"] for e in r.json()} == {"adder", "echo"}
    assert server.triton.is_model_ready("adder") and server.triton.is_model_ready("echo")
    assert "model_repository" in server.http.get("/v2").json()["extensions"]


def test_index_ready_filter(server: Server) -> None:
    """``{"ready": true}`` lists only the models ready for inferencing (the extension's index request)."""
    server.triton.unload_model("echo")
    everything = server.http.post("/v2/repository/index", json={"ready": False}).json()
    assert {e["name"]: e["state"] for e in everything} == {"adder": "READY", "echo": "UNAVAILABLE"}
    ready = server.http.post("/v2/repository/index", json={"ready": True})
    assert ready.status_code == 200, ready.text
    assert [e["name"] for e in ready.json()] == ["adder"]
    bad = server.http.post("/v2/repository/index", json={"ready": "yes"})
    assert bad.status_code == 400 and "ready" in bad.json()["error"], bad.text
    bad = server.http.post("/v2/repository/index", content=b"{not json")
    assert bad.status_code == 400, bad.text


def test_unload_then_load(server: Server) -> None:
    _adder_ok(server)
    assert _loaded_gauge(server) == 2
    server.triton.unload_model("adder")

    assert not server.triton.is_model_ready("adder")
    for path in ("/v2/models/adder", "/v2/models/adder/ready", "/v2/models/adder/versions/1"):
        r = server.http.get(path)
        assert r.status_code == 404, (path, r.text)
        assert "'adder'" in r.json()["error"]
    with pytest.raises(InferenceServerException) as info:
        _adder_ok(server)
    assert info.value.status() == "404" and "adder" in info.value.message()
    index = _index(server)
    assert index["adder"]["state"] == "UNAVAILABLE" and index["echo"]["state"] == "READY"
    assert _loaded_gauge(server) == 1
    _echo_ok(server)  # the other model is untouched
    # Unloading what is not loaded is a 404 naming it.
    r = server.http.post("/v2/repository/models/adder/unload", json={})
    assert r.status_code == 404 and "'adder'" in r.json()["error"], r.text

    # A plain POST as in the docs brings it back.
    r = server.http.post("/v2/repository/models/adder/load", json={})
    assert r.status_code == 200, r.text
    assert server.triton.is_model_ready("adder")
    for batch in (1, 4):
        _adder_ok(server, batch)
    assert _index(server)["adder"]["state"] == "READY"
    assert _loaded_gauge(server) == 2
    assert server.http.get("/v2/models/adder").json()["inputs"][0]["shape"] == [-1, 2]


def test_load_of_a_loaded_model_reloads_it(server: Server) -> None:
    before = server.engine.get("echo")
    server.triton.load_model("echo")
    after = server.engine.get("echo")
    assert after is not before and after.model is not before.model
    _echo_ok(server)
    assert _loaded_gauge(server) == 2


def test_load_unknown_model_is_404_naming_it(server: Server) -> None:
    with pytest.raises(InferenceServerException) as info:
        server.triton.load_model("no_such_model")
    assert info.value.status() == "404"
    # Every failed load starts with the same words (as Triton's do: its clients look for "failed to load").
    assert info.value.message().startswith("failed to load model 'no_such_model': no package named 'no_such_model'")
    r = server.http.post("/v2/repository/models/no_such_model/load", json={})
    assert r.status_code == 404 and "'no_such_model'" in r.json()["error"]
    assert str(server.models) in r.json()["error"]  # says where it looked
    _adder_ok(server)


def test_load_with_files_or_a_bad_config_is_refused(server: Server) -> None:
    """Triton's load can carry files to load instead of the repository's; this server loads packages
    from its repository only, so it says so rather than ignoring them. A config is applied
    (test_config_override.py) unless it holds a field this server does not take."""
    with pytest.raises(InferenceServerException) as info:
        server.triton.load_model("adder", config='{"max_batch_sizes": 8}')
    assert info.value.status() == "400" and "'max_batch_sizes'" in info.value.message()
    assert "failed to load model 'adder'" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        server.triton.load_model("adder", config="{}", files={"file:1/model.onnx": b"\x00"})
    assert info.value.status() == "400" and "file:1/model.onnx" in info.value.message()
    assert info.value.message().startswith("failed to load model 'adder': ")
    r = server.http.post("/v2/repository/models/adder/load", content=b"[1, 2")
    assert r.status_code == 400, r.text
    _adder_ok(server)  # still the original, still served


def test_package_added_after_start(server: Server, packages: Path) -> None:
    assert "tripler" not in _index(server)
    shutil.copytree(packages / "tripler", server.models / "tripler")
    entry = _index(server)["tripler"]
    assert entry["state"] == "UNAVAILABLE", entry
    assert server.http.get("/v2/models/tripler").status_code == 404
    server.triton.load_model("tripler")
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    inp = httpclient.InferInput("x", [3, 2], "FP32")
    inp.set_data_from_numpy(x)
    result = server.triton.infer("tripler", [inp])
    np.testing.assert_allclose(result.as_numpy("out"), x * 3)
    np.testing.assert_allclose(result.as_numpy("doubled"), x * 6)
    assert _index(server)["tripler"]["state"] == "READY"
    assert _loaded_gauge(server) == 3


def test_package_that_fails_to_load(server: Server, packages: Path) -> None:
    shutil.copytree(packages / "needs_future_ort", server.models / "needs_future_ort")
    assert _index(server)["needs_future_ort"]["state"] == "UNAVAILABLE"
    with pytest.raises(InferenceServerException) as info:
        server.triton.load_model("needs_future_ort")
    assert info.value.status() == "400"
    message = info.value.message()
    assert "failed to load model 'needs_future_ort'" in message and ">=99" in message, message
    r = server.http.post("/v2/repository/models/needs_future_ort/load", json={})
    assert r.status_code == 400 and "failed to load model 'needs_future_ort'" in r.json()["error"]
    # The others keep serving, and nothing half-loaded is left.
    _adder_ok(server)
    _echo_ok(server)
    assert server.http.get("/v2/models/needs_future_ort").status_code == 404
    assert _index(server)["needs_future_ort"]["state"] == "UNAVAILABLE"
    assert _loaded_gauge(server) == 2


def test_unreadable_package_is_listed_with_a_reason(server: Server) -> None:
    (server.models / "garbled").mkdir()
    (server.models / "garbled" / "config.json").write_text("{this is not json")
    entry = _index(server)["garbled"]
    assert entry["state"] == "UNAVAILABLE" and "cannot read the package" in entry["reason"], entry
    r = server.http.post("/v2/repository/models/garbled/load", json={})
    assert r.status_code == 400 and "garbled" in r.json()["error"] and "config.json" in r.json()["error"], r.text
    _adder_ok(server)


@pytest.mark.parametrize("batching", [None, BatchPolicy(8, 0.001)], ids=["unbatched", "batched"])
def test_unload_while_requests_are_in_flight(packages: Path, tmp_path: Path, batching: BatchPolicy | None) -> None:
    """Requests racing unload/load cycles each get 200 with the right sums or a 404 naming the model
    (never a 500 "model failed"); the server neither crashes nor hangs, and serves correctly afterwards."""
    shutil.copytree(packages / "start", tmp_path / "models")
    engine = Engine(ModelRegistry.load([tmp_path / "models"]), batching=batching, metrics=ServerMetrics())
    stop = threading.Event()
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [4, 2], "data": x.ravel().tolist()} for n in "xy"]}

    def hammer(base: str) -> dict[int, int]:
        seen: dict[int, int] = {}
        with httpx.Client(base_url=base, timeout=10) as http:
            while not stop.is_set():
                r = http.post("/v2/models/adder/infer", json=body)
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    out = {o["name"]: o["data"] for o in r.json()["outputs"]}
                    np.testing.assert_allclose(out["doubled"], (x * 4).ravel())
                else:
                    # Unloaded before or while it ran: a 404 like any later request, not a model failure.
                    assert r.status_code == 404, (r.status_code, r.text)
                    assert "'adder'" in r.json()["error"], r.text
        return seen

    try:
        with serve_in_thread(create_app(engine)) as port:
            base = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=base, timeout=10) as http, ThreadPoolExecutor(4) as pool:
                hammers = [pool.submit(hammer, base) for _ in range(4)]
                try:
                    for _ in range(6):
                        assert http.post("/v2/repository/models/adder/unload", json={}).status_code == 200
                        assert http.post("/v2/repository/models/adder/load", json={}).status_code == 200
                finally:
                    stop.set()
                seen: dict[int, int] = {}
                for h in hammers:
                    for status, n in h.result(timeout=30).items():
                        seen[status] = seen.get(status, 0) + n
                assert sum(seen.values()) > 0
                # Afterwards: served, correct, and the other model never noticed.
                r = http.post("/v2/models/adder/infer", json=body)
                assert r.status_code == 200, r.text
                assert http.get("/v2/health/ready").status_code == 200
                index = {e["name"]: e["state"] for e in http.post("/v2/repository/index", json={}).json()}
                assert index == {"adder": "READY", "echo": "READY"}
                metrics = http.get("/metrics").text
                assert 'neuropod_request_failures_total{model="adder",protocol="rest",reason="model"}' not in metrics
    finally:
        stop.set()
        engine.close()
