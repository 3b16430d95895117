"""`neuropod serve`'s Prometheus metrics, scraped from a real server and parsed by prometheus-client.

A uvicorn server in a thread serves real ONNX packages (adder, echo, and a
model that fails inside onnxruntime); the test sends known numbers of good,
bad and failing requests, scrapes ``GET /metrics`` and checks every counter
and histogram count against what it sent. Counts, never timings.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
httpclient = pytest.importorskip("tritonclient.http")

from onnx import TensorProto, helper  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from neuropod_serving.server import BatchPolicy, Engine, ModelRegistry, create_app  # noqa: E402
from neuropod_serving.server.app import metrics_only  # noqa: E402
from neuropod_serving.server.metrics import ServerMetrics  # noqa: E402

from conftest import adder_and_echo, onnx_package, private_caches, serve_in_thread  # noqa: E402

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def repo() -> Iterator[Path]:
    """adder and echo, and ``broken``: a Reshape to [2, 2] that fails for any input but 4 elements."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-metrics-test-"))
    with private_caches(root):
        adder_and_echo(root / "models", echo_as_zip=False)
        onnx_package(root / "models" / "broken", "broken", [helper.make_node("Reshape", ["v", "shape"], ["w"])],
                     [("v", "float32", [None])], [("w", "float32", [2, 2])],
                     [helper.make_tensor("shape", TensorProto.INT64, [2], [2, 2])])  # fmt: skip
        yield root
    shutil.rmtree(root, ignore_errors=True)


def _scrape(http: Any) -> tuple[Samples, dict[str, str]]:
    """GET /metrics parsed by prometheus-client: every sample by (name, labels), and each family's type."""
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.headers["content-type"]
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(r.text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types


def _get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _xy(batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, 2)).astype(np.float32), rng.standard_normal((batch, 2)).astype(np.float32)


def _triton_adder(triton: Any, x: np.ndarray, y: np.ndarray) -> None:
    inputs = [httpclient.InferInput(n, list(a.shape), "FP32") for n, a in (("x", x), ("y", y))]
    for i, a in zip(inputs, (x, y)):
        i.set_data_from_numpy(a)
    result = triton.infer("adder", inputs)
    np.testing.assert_allclose(result.as_numpy("doubled"), (x + y) * 2, rtol=1e-6)


def test_counts_and_histograms(repo: Path) -> None:
    good, bad = 7, 3
    engine = Engine(ModelRegistry.load([repo / "models"]), metrics=ServerMetrics())
    try:
        with (
            serve_in_thread(create_app(engine)) as port,
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http,
        ):
            before, types = _scrape(http)
            # Every family is declared before any request, so dashboards see zeros, not gaps.
            assert types["neuropod_requests"] == "counter"
            assert types["neuropod_request_failures"] == "counter"
            for h in ("request_duration_seconds", "queue_duration_seconds", "compute_duration_seconds", "batch_size"):
                assert types[f"neuropod_{h}"] == "histogram", h
            assert types["neuropod_models_loaded"] == "gauge"
            assert _get(before, "neuropod_models_loaded") == 3
            assert _get(before, "neuropod_requests_total", model="adder", protocol="rest") == 0

            triton = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                for i in range(good):
                    _triton_adder(triton, *_xy(i + 1, i))
            finally:
                triton.close()
            for i in range(bad):
                # The spec says float32: an INT64 tensor is the client's fault (400).
                wrong = {"inputs": [{"name": n, "datatype": "INT64", "shape": [1, 2], "data": [i, 1]} for n in "xy"]}
                r = http.post("/v2/models/adder/infer", json=wrong)
                assert r.status_code == 400, r.text
                assert "'x'" in r.json()["error"] or "'y'" in r.json()["error"], r.text
            r = http.post("/v2/models/broken/infer",
                          json={"inputs": [{"name": "v", "datatype": "FP32", "shape": [3], "data": [1, 2, 3]}]})  # fmt: skip
            assert r.status_code == 500, r.text
            assert "broken" in r.json()["error"]
            # A model the server does not serve is a 404 and no series of its own
            # (a client must not be able to grow the label set at will).
            assert http.post("/v2/models/nope/infer", json={"inputs": []}).status_code == 404

            after, _ = _scrape(http)
    finally:
        engine.close()

    rest = {"protocol": "rest"}
    assert _get(after, "neuropod_requests_total", model="adder", **rest) == good + bad
    assert _get(after, "neuropod_request_failures_total", model="adder", reason="client", **rest) == bad
    assert _get(after, "neuropod_request_failures_total", model="adder", reason="model", **rest) == 0
    assert _get(after, "neuropod_requests_total", model="broken", **rest) == 1
    assert _get(after, "neuropod_request_failures_total", model="broken", reason="model", **rest) == 1
    assert _get(after, "neuropod_request_failures_total", model="broken", reason="client", **rest) == 0
    assert not [k for k in after if ("model", "nope") in k[1]], "an unknown model got a series"
    assert _get(after, "neuropod_requests_total", model="echo", **rest) == 0

    # Every request is timed; only those that reached the model are queued and computed.
    assert _get(after, "neuropod_request_duration_seconds_count", model="adder", **rest) == good + bad
    assert _get(after, "neuropod_request_duration_seconds_bucket", model="adder", le="+Inf", **rest) == good + bad
    assert _get(after, "neuropod_request_duration_seconds_sum", model="adder", **rest) > 0
    assert _get(after, "neuropod_compute_duration_seconds_count", model="adder") == good
    assert _get(after, "neuropod_queue_duration_seconds_count", model="adder") == good
    # A run that failed is not a run (as a failed batch is not): it shows in the request counters only.
    assert _get(after, "neuropod_compute_duration_seconds_count", model="broken") == 0
    assert _get(after, "neuropod_request_duration_seconds_count", model="broken", **rest) == 1
    # Without batching, no batch sizes are recorded.
    assert _get(after, "neuropod_batch_size_count", model="adder") == 0
    assert _get(after, "neuropod_models_loaded") == 3


def test_batch_sizes_add_up_to_the_rows_sent(repo: Path) -> None:
    """With batching on, the batch-size histogram sums to every row sent, however they were merged."""
    engine = Engine(
        ModelRegistry.load([repo / "models" / "adder"]),
        batching=BatchPolicy(16, 0.002),
        metrics=ServerMetrics(),
    )
    rows = [1 + i % 4 for i in range(24)]
    try:
        with (
            serve_in_thread(create_app(engine)) as port,
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http,
        ):

            def send(i: int) -> None:
                x, y = _xy(rows[i], 100 + i)
                body = {"inputs": [{"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
                                   for n, a in (("x", x), ("y", y))]}  # fmt: skip
                r = http.post("/v2/models/adder/infer", json=body)
                assert r.status_code == 200, r.text
                out = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}
                np.testing.assert_allclose(out["out"], x + y, rtol=1e-6)

            with ThreadPoolExecutor(8) as pool:
                list(pool.map(send, range(len(rows))))
            samples, _ = _scrape(http)
    finally:
        engine.close()
    runs = _get(samples, "neuropod_batch_size_count", model="adder")
    assert 1 <= runs <= len(rows)
    assert _get(samples, "neuropod_batch_size_sum", model="adder") == sum(rows)
    assert _get(samples, "neuropod_compute_duration_seconds_count", model="adder") == runs
    # Each request waited once (in the batcher's queue).
    assert _get(samples, "neuropod_queue_duration_seconds_count", model="adder") == len(rows)
    assert _get(samples, "neuropod_requests_total", model="adder", protocol="rest") == len(rows)


def test_metrics_port_routing(repo: Path) -> None:
    """metrics_only: connections to the metrics port get only /metrics (the process test covers real ports)."""
    from starlette.testclient import TestClient

    engine = Engine(ModelRegistry.load([repo / "models" / "adder"]), metrics=ServerMetrics())
    try:
        app = create_app(engine)
        # TestClient's connections arrive on ('testserver', 80).
        with TestClient(metrics_only(app, port=80)) as c:
            r = c.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
            assert "neuropod_models_loaded 1.0" in r.text
            for path in ("/v2/health/ready", "/v2", "/v2/models/adder", "/nope"):
                r = c.get(path)
                assert r.status_code == 404, path
                assert r.json()["error"] == "port 80 serves only GET /metrics", path
            assert c.post("/v2/models/adder/infer", json={}).status_code == 404
        # Other ports pass through to the whole app, /metrics included.
        with TestClient(metrics_only(app, port=8002)) as c:
            assert c.get("/v2/health/ready").status_code == 200
            assert c.get("/metrics").status_code == 200
    finally:
        engine.close()


def test_no_metrics_without_server_metrics(repo: Path) -> None:
    engine = Engine(ModelRegistry.load([repo / "models" / "adder"]))
    try:
        from starlette.testclient import TestClient

        with TestClient(create_app(engine)) as c:
            r = c.get("/metrics")
            assert r.status_code == 404 and "no metrics" in r.json()["error"]
    finally:
        engine.close()
