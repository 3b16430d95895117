"""Triton's model configuration and statistics extensions, and the extensions ServerMetadata lists.

Two real ``neuropod serve`` processes (``neuropod.testing.served``) on free
ports serve real ONNX packages built here: one without batching, one with
``--max-batch-size 8 --max-queue-delay-us 20000 --workers 2`` (OPE). They are
driven with tritonclient.http and tritonclient.grpc, clients nobody here
wrote. Expected configurations are computed from the specs the packages were
built from (with tritonclient's own dtype names), expected counts from the
requests sent, expected outputs with numpy; durations are checked against
``GET /metrics`` of the same server, whose histograms must tell the same story.
The messages of our ``triton_config.proto`` are checked against tritonclient's
own classes, field by field and in bytes both ways.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from onnx import TensorProto, helper  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402
from tritonclient.grpc import model_config_pb2 as triton_config  # noqa: E402
from tritonclient.grpc import service_pb2 as triton_service  # noqa: E402
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

from neuropod.testing import served  # noqa: E402
from neuropod_serving.protocol._grpc import triton_config_pb2 as ours  # noqa: E402
from neuropod_serving.server import Engine, ModelRegistry, create_app  # noqa: E402
from neuropod_serving.server.grpc_server import start_grpc_server  # noqa: E402
from neuropod_serving.server.model_config import instance_group, triton_platform  # noqa: E402

from conftest import ADDER_IN, ADDER_OUT, ECHO_IN, ECHO_OUT, adder_and_echo, onnx_package, private_caches  # noqa: E402

#: ``flat``: a spec without a batch symbol (its first dim is null), so it is never batched.
FLAT_IN = [("v", "float32", [None, 3])]
FLAT_OUT = [("w", "float32", [None, 3])]
SPECS = {"adder": (ADDER_IN, ADDER_OUT), "echo": (ECHO_IN, ECHO_OUT), "flat": (FLAT_IN, FLAT_OUT)}
BATCH = ["--max-batch-size", "8", "--max-queue-delay-us", "20000", "--workers", "2"]


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="neuropod-triton-ext-"))
    with private_caches(path):
        adder_and_echo(path / "models", echo_as_zip=True)
        onnx_package(path / "models" / "flat", "flat", [helper.make_node("Neg", ["v"], ["w"])], FLAT_IN, FLAT_OUT)
        # Any length passes the spec; onnxruntime can reshape only 4 elements to [2, 2].
        onnx_package(path / "models" / "broken", "broken", [helper.make_node("Reshape", ["v", "shape"], ["w"])],
                     [("v", "float32", [None])], [("w", "float32", [2, 2])],
                     [helper.make_tensor("shape", TensorProto.INT64, [2], [2, 2])])  # fmt: skip
        (path / "batched").mkdir()
        for name in ("adder", "flat"):
            shutil.copytree(path / "models" / name, path / "batched" / name)
        yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def plain(root: Path) -> Iterator[Any]:
    """``neuropod serve`` without batching, one copy of each model in process."""
    with served(root / "models") as server:
        yield server


@pytest.fixture(scope="module")
def batched(root: Path) -> Iterator[Any]:
    """``neuropod serve`` batching up to 8 rows, 20 ms queue delay, two OPE workers per model."""
    with served(root / "batched", options=BATCH, timeout=120) as server:
        yield server


def _clients(server: Any) -> tuple[Any, Any]:
    """tritonclient's HTTP and gRPC clients of ``server``."""
    http = httpclient.InferenceServerClient(server.http[len("http://") :])
    return http, grpcclient.InferenceServerClient(server.grpc)


def _triton_type(dtype: str) -> str:
    """Triton's config type of a spec dtype, from tritonclient's own datatype names."""
    return "TYPE_STRING" if dtype == "string" else "TYPE_" + np_to_triton_dtype(np.dtype(dtype))


def _expected_config(name: str, max_batch: int, delay_us: int, workers: int) -> dict[str, Any]:
    inputs, outputs = SPECS[name]
    batched = max_batch > 0

    def tensors(entries: list[tuple[str, str, list[Any]]], inputs: bool) -> list[dict[str, Any]]:
        return [
            {"name": n, "data_type": _triton_type(t), **({"format": "FORMAT_NONE"} if inputs else {}),
             "dims": [d if isinstance(d, int) else -1 for d in s[batched:]]}
            for n, t, s in entries
        ]  # fmt: skip

    config = {
        "name": name,
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "max_batch_size": max_batch,
        "input": tensors(inputs, True),
        "output": tensors(outputs, False),
        "instance_group": [{"name": name, "kind": "KIND_CPU", "count": workers}],
    }
    if batched:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": delay_us}
    return config


def _grpc_config_as_dict(response: Any) -> dict[str, Any]:
    """tritonclient's ModelConfigResponse in the REST form, read field by field from its own classes."""
    c = response.config

    def tensors(entries: Any) -> list[dict[str, Any]]:
        return [{"name": t.name, "data_type": triton_config.DataType.Name(t.data_type),
                 **({"format": triton_config.ModelInput.Format.Name(t.format)} if hasattr(t, "format") else {}),
                 "dims": list(t.dims)}
                for t in entries]  # fmt: skip

    out: dict[str, Any] = {
        "name": c.name,
        "platform": c.platform,
        "backend": c.backend,
        "max_batch_size": c.max_batch_size,
        "input": tensors(c.input),
        "output": tensors(c.output),
        "instance_group": [
            {"name": g.name, "kind": triton_config.ModelInstanceGroup.Kind.Name(g.kind), "count": g.count}
            for g in c.instance_group
        ],
    }
    if c.HasField("dynamic_batching"):
        out["dynamic_batching"] = {"max_queue_delay_microseconds": c.dynamic_batching.max_queue_delay_microseconds}
    return out


def _without_parameters(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != "parameters"}


def _http_get(base: str, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"{base}{path}", timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _metrics(base: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """One sample, summed over the labels not given (e.g. both protocols)."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def _adder_inputs(client: Any, rows: int, seed: int) -> tuple[list[Any], np.ndarray]:
    rng = np.random.default_rng(seed)
    x, y = (rng.standard_normal((rows, 2)).astype(np.float32) for _ in range(2))
    inputs = [client.InferInput("x", [rows, 2], "FP32"), client.InferInput("y", [rows, 2], "FP32")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(y)
    return inputs, x + y


def _check_agrees_with_metrics(stat: dict[str, Any], samples: Any, model: str) -> None:
    """What /metrics says of ``model`` is what its Triton statistics say."""
    inference = stat["inference_stats"]
    requests = _metric(samples, "neuropod_requests_total", model=model)
    failures = _metric(samples, "neuropod_request_failures_total", model=model)
    assert inference["success"]["count"] + inference["fail"]["count"] == requests
    assert inference["fail"]["count"] == failures
    total_ns = inference["success"]["ns"] + inference["fail"]["ns"]
    assert total_ns / 1e9 == pytest.approx(
        _metric(samples, "neuropod_request_duration_seconds_sum", model=model), abs=1e-6
    )
    assert inference["queue"]["count"] == _metric(samples, "neuropod_queue_duration_seconds_count", model=model)
    assert inference["queue"]["ns"] / 1e9 == pytest.approx(
        _metric(samples, "neuropod_queue_duration_seconds_sum", model=model), abs=1e-6
    )
    runs = _metric(samples, "neuropod_compute_duration_seconds_count", model=model)
    assert stat["execution_count"] == runs == sum(b["compute_infer"]["count"] for b in stat["batch_stats"])
    assert sum(b["compute_infer"]["ns"] for b in stat["batch_stats"]) / 1e9 == pytest.approx(
        _metric(samples, "neuropod_compute_duration_seconds_sum", model=model), abs=1e-6
    )
    # perf_analyzer's server-side breakdown: no part of a request takes longer than the request.
    parts = sum(inference[k]["ns"] for k in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert parts <= inference["success"]["ns"]


PER_REQUEST = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
)
PER_RUN = ("compute_input", "compute_infer", "compute_output")


def _grpc_stats_as_dict(response: Any) -> list[dict[str, Any]]:
    """tritonclient's ModelStatisticsResponse in the REST form, read from its own classes."""

    def duration(d: Any) -> dict[str, int]:
        return {"count": d.count, "ns": d.ns}

    return [
        {
            "name": m.name,
            "version": m.version,
            "last_inference": m.last_inference,
            "inference_count": m.inference_count,
            "execution_count": m.execution_count,
            "inference_stats": {k: duration(getattr(m.inference_stats, k)) for k in PER_REQUEST},
            "batch_stats": [
                {"batch_size": b.batch_size, **{k: duration(getattr(b, k)) for k in PER_RUN}} for b in m.batch_stats
            ],
        }
        for m in response.model_stats
    ]


# --- model configuration ----------------------------------------------------------------------------------


def test_config_without_batching_on_both_protocols(plain: Any) -> None:
    http, grpc = _clients(plain)
    try:
        for name in ("adder", "echo", "flat"):  # (broken's spec is not in SPECS)
            expected = _expected_config(name, 0, 0, 1)
            config = http.get_model_config(name)
            assert _without_parameters(config) == expected
            assert config["parameters"]["neuropod_platform"] == {"string_value": "onnx"}
            assert config["parameters"]["neuropod_backend"]["string_value"].startswith("onnx==")
            assert config["parameters"]["neuropod_device"] == {"string_value": "cpu"}
            assert http.get_model_config(name, "1") == config
            response = grpc.get_model_config(name)
            assert _grpc_config_as_dict(response) == expected
            assert response.config.parameters["neuropod_device"].string_value == "cpu"
            assert _grpc_config_as_dict(grpc.get_model_config(name, "1")) == expected
    finally:
        http.close()
        grpc.close()


def test_config_with_batching_and_workers(batched: Any) -> None:
    http, grpc = _clients(batched)
    try:
        # adder has the batch symbol: its batch dim folds into max_batch_size; flat is never batched.
        for name, max_batch in (("adder", 8), ("flat", 0)):
            expected = _expected_config(name, max_batch, 20000, 2)
            assert _without_parameters(http.get_model_config(name)) == expected
            assert _grpc_config_as_dict(grpc.get_model_config(name)) == expected
        assert http.get_model_config("adder")["input"][0]["dims"] == [2]
    finally:
        http.close()
        grpc.close()


def test_config_and_stats_of_unknown_models_and_versions(plain: Any) -> None:
    for path in ("/v2/models/nope/config", "/v2/models/nope/stats", "/v2/models/nope/versions/1/config"):
        status, body = _http_get(plain.http, path)
        assert status == 404 and "'nope'" in body["error"], (path, body)
    for path in ("/v2/models/adder/versions/2/config", "/v2/models/adder/versions/2/stats"):
        status, body = _http_get(plain.http, path)
        assert status == 404 and "'2'" in body["error"] and "adder" in body["error"], (path, body)
    http, grpc = _clients(plain)
    try:
        with pytest.raises(InferenceServerException, match="nope"):
            http.get_model_config("nope")
        with pytest.raises(InferenceServerException, match="nope") as e:
            grpc.get_model_config("nope")
        assert e.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(InferenceServerException, match="version") as e:
            grpc.get_model_config("adder", "2")
        assert e.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(InferenceServerException, match="nope") as e:
            grpc.get_inference_statistics("nope")
        assert e.value.status() == "StatusCode.NOT_FOUND"
        # Triton's words, which its clients and examples look for (as its HTTP client's message does).
        for call in (http.get_model_metadata, grpc.get_model_metadata, http.get_model_config, grpc.get_model_config):
            with pytest.raises(InferenceServerException) as e:
                call("nope")
            assert e.value.message().startswith("Request for unknown model: 'nope' is not found"), e.value
        with pytest.raises(InferenceServerException) as e:
            grpc.get_model_metadata("adder", "2")
        assert e.value.message().startswith("Request for unknown model: 'adder' version '2' is not found"), e.value
        # Readiness of a model not loaded is an answer (not ready) on both protocols, as in Triton.
        assert http.is_model_ready("nope") is False and grpc.is_model_ready("nope") is False
        assert grpc.is_model_ready("adder", "2") is False and grpc.is_model_ready("adder") is True
        # A version without a model names nothing: refused, not answered with every model.
        with pytest.raises(InferenceServerException, match="no model") as e:
            grpc.get_inference_statistics("", "1")
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        # Other methods than GET are not routes of these extensions.
        request = urllib.request.Request(f"{plain.http}/v2/models/adder/config", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=10)
        assert raised.value.code == 405
    finally:
        http.close()
        grpc.close()


# --- statistics ----------------------------------------------------------------------------------------------


def test_stats_without_batching(plain: Any) -> None:
    http, grpc = _clients(plain)
    try:
        before = http.get_inference_statistics("adder")["model_stats"][0]
        assert before["name"] == "adder" and before["version"] == "1"
        started_ms = time.time() * 1000
        rows = [1, 2, 3, 4, 5]
        for i, n in enumerate(rows):
            inputs, expected = _adder_inputs(httpclient, n, i)
            np.testing.assert_allclose(http.infer("adder", inputs).as_numpy("out"), expected, rtol=1e-6)
        for i in range(3):
            inputs, expected = _adder_inputs(grpcclient, 2, 10 + i)
            np.testing.assert_allclose(grpc.infer("adder", inputs).as_numpy("out"), expected, rtol=1e-6)
        for _ in range(2):  # the spec says FP32: refused, and counted as failed requests of adder
            wrong = [httpclient.InferInput(n, [1, 2], "INT64") for n in "xy"]
            for w in wrong:
                w.set_data_from_numpy(np.ones((1, 2), np.int64))
            with pytest.raises(InferenceServerException, match="float32"):
                http.infer("adder", wrong)
        ended_ms = time.time() * 1000

        stat = http.get_inference_statistics("adder")["model_stats"][0]
        samples = _metrics(plain.http)
    finally:
        http.close()
        grpc.close()
    good = len(rows) + 3
    delta = {k: stat[k] - before[k] for k in ("inference_count", "execution_count")}
    # Not batched (max_batch_size 0): each request is one inference and one run, whatever its rows.
    assert delta == {"inference_count": good, "execution_count": good}
    inference = stat["inference_stats"]
    assert inference["success"]["count"] - before["inference_stats"]["success"]["count"] == good
    assert inference["fail"]["count"] - before["inference_stats"]["fail"]["count"] == 2
    for key in ("success", "fail", "compute_infer"):
        assert inference[key]["ns"] > before["inference_stats"][key]["ns"], key
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[key]["count"] == stat["execution_count"], key  # one of each per run
    assert inference["compute_output"]["ns"] == 0  # nothing to split: outputs are handed over as they are
    # Every front end decodes into writable memory (REST's body, one copy of gRPC's raw contents):
    # an unbatched run has no inputs to make.
    assert inference["compute_input"]["ns"] == before["inference_stats"]["compute_input"]["ns"] == 0
    assert inference["cache_hit"] == inference["cache_miss"] == {"count": 0, "ns": 0}
    [one] = stat["batch_stats"]
    assert one["batch_size"] == 1 and one["compute_infer"]["count"] == stat["execution_count"]
    assert started_ms - 1 <= stat["last_inference"] <= ended_ms + 1
    _check_agrees_with_metrics(stat, samples, "adder")


def test_stats_of_a_model_that_fails(plain: Any) -> None:
    """A run that fails is a failed request, not an inference nor an execution."""
    http, _ = _clients(plain)
    try:
        v = httpclient.InferInput("v", [3], "FP32")
        v.set_data_from_numpy(np.arange(3, dtype=np.float32))
        with pytest.raises(InferenceServerException, match="broken") as e:
            http.infer("broken", [v])
        assert e.value.status() == "500"
        stat = http.get_inference_statistics("broken")["model_stats"][0]
        samples = _metrics(plain.http)
    finally:
        http.close()
    assert (stat["inference_count"], stat["execution_count"], stat["batch_stats"]) == (0, 0, [])
    inference = stat["inference_stats"]
    assert inference["fail"]["count"] == 1 and inference["fail"]["ns"] > 0
    assert inference["success"] == inference["queue"] == inference["compute_infer"] == {"count": 0, "ns": 0}
    assert stat["last_inference"] > 0
    assert _metric(samples, "neuropod_request_failures_total", model="broken", reason="model") == 1
    _check_agrees_with_metrics(stat, samples, "broken")


def test_stats_all_models_and_grpc_agree_with_rest(plain: Any) -> None:
    http, grpc = _clients(plain)
    try:
        inputs, expected = _adder_inputs(grpcclient, 1, 99)
        np.testing.assert_allclose(grpc.infer("adder", inputs).as_numpy("doubled"), 2 * expected, rtol=1e-6)
        every = http.get_inference_statistics()["model_stats"]
        assert [m["name"] for m in every] == ["adder", "broken", "echo", "flat"]
        # Statistics requests are not inferences: asking again changes nothing.
        assert _grpc_stats_as_dict(grpc.get_inference_statistics()) == every
        assert _grpc_stats_as_dict(grpc.get_inference_statistics("adder", "1")) == [every[0]]
        assert http.get_inference_statistics("adder", "1")["model_stats"] == [every[0]]
        status, body = _http_get(plain.http, "/v2/models/stats")
        assert status == 200 and body == {"model_stats": every}
    finally:
        http.close()
        grpc.close()
    flat = next(m for m in every if m["name"] == "flat")
    assert flat["inference_count"] == flat["execution_count"] == flat["last_inference"] == 0
    assert flat["batch_stats"] == [] and flat["inference_stats"]["success"] == {"count": 0, "ns": 0}


def test_stats_with_batching(batched: Any) -> None:
    http, grpc = _clients(batched)
    rows = [1 + i % 3 for i in range(12)]

    def send(i: int) -> None:
        # Half over REST (a client per call: tritonclient.http's is not thread-safe), half over gRPC.
        rest = i % 2 == 1
        client = httpclient.InferenceServerClient(batched.http[len("http://") :]) if rest else grpc
        try:
            inputs, expected = _adder_inputs(httpclient if rest else grpcclient, rows[i], 200 + i)
            np.testing.assert_allclose(client.infer("adder", inputs).as_numpy("out"), expected, rtol=1e-6)
        finally:
            if rest:
                client.close()

    try:
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(send, range(len(rows))))
        stat = http.get_inference_statistics("adder")["model_stats"][0]
        grpc_stat = _grpc_stats_as_dict(grpc.get_inference_statistics("adder"))[0]
        samples = _metrics(batched.http)
    finally:
        http.close()
        grpc.close()
    assert grpc_stat == stat
    # Every row sent is one inference; runs are batches, fewer when requests were merged.
    assert stat["inference_count"] == sum(rows)
    assert 1 <= stat["execution_count"] <= len(rows)
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in stat["batch_stats"]) == sum(rows)
    assert all(1 <= b["batch_size"] <= 8 for b in stat["batch_stats"])
    inference = stat["inference_stats"]
    # Per request: each request counts its batch's durations, as in Triton.
    for key in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[key]["count"] == len(rows), key
    assert inference["compute_infer"]["ns"] >= sum(b["compute_infer"]["ns"] for b in stat["batch_stats"]) > 0
    assert inference["queue"]["ns"] > 0 and inference["fail"]["count"] == 0
    assert _metric(samples, "neuropod_batch_size_sum", model="adder") == stat["inference_count"]
    _check_agrees_with_metrics(stat, samples, "adder")


# --- the extensions listed ------------------------------------------------------------------------------------


def test_server_metadata_lists_what_is_served(plain: Any) -> None:
    http, grpc = _clients(plain)
    try:
        rest = http.get_server_metadata()["extensions"]
        over_grpc = list(grpc.get_server_metadata().extensions)
    finally:
        http.close()
        grpc.close()
    assert rest == [
        "binary_tensor_data", "classification", "model_configuration", "model_repository", "statistics",
        "sequence", "sequence(string_id)", "generate",
    ]  # fmt: skip
    # binary_tensor_data is a REST body format; gRPC carries tensors as raw bytes.
    assert over_grpc == [
        "classification", "model_configuration", "model_repository", "statistics", "sequence", "sequence(string_id)"
    ]
    # What is listed answers.
    assert _http_get(plain.http, "/v2/models/adder/config")[0] == 200
    assert _http_get(plain.http, "/v2/models/stats")[0] == 200


@pytest.fixture(scope="module")
def bare(root: Path) -> Iterator[Engine]:
    """An in-process engine serving adder, built without metrics."""
    engine = Engine(ModelRegistry.load([root / "models" / "adder"]))
    try:
        yield engine
    finally:
        engine.close()


def test_no_statistics_where_none_are_kept(bare: Engine) -> None:
    """An engine built without ServerMetrics (as embedded, or a Ray Serve replica) neither lists
    nor answers statistics, on either protocol; its configuration is still served."""
    with TestClient(create_app(bare)) as client:
        assert "statistics" not in client.get("/v2").json()["extensions"]
        r = client.get("/v2/models/stats")
        assert r.status_code == 404 and "keeps no statistics" in r.json()["error"]
        assert client.get("/v2/models/adder/stats").status_code == 404
        assert client.get("/v2/models/adder/config").json()["name"] == "adder"
    server, port = start_grpc_server(bare, "127.0.0.1:0")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        assert list(grpc.get_server_metadata().extensions) == [
            "classification", "model_configuration", "model_repository", "sequence", "sequence(string_id)"
        ]
        with pytest.raises(InferenceServerException, match="keeps no statistics") as e:
            grpc.get_inference_statistics("adder")
        assert e.value.status() == "StatusCode.UNIMPLEMENTED"
    finally:
        grpc.close()
        server.stop(None)


def test_config_and_stats_need_the_token(bare: Engine) -> None:
    """Like every route but health, the new ones are behind --auth-token-file on both protocols."""
    with TestClient(create_app(bare, auth_token="s3cret")) as client:
        for path in ("/v2/models/adder/config", "/v2/models/stats", "/v2/models/adder/versions/1/stats"):
            r = client.get(path)
            assert r.status_code == 401 and "Bearer" in r.json()["error"], path
        r = client.get("/v2/models/adder/config", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["max_batch_size"] == 0
    server, port = start_grpc_server(bare, "127.0.0.1:0", auth_token="s3cret")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        for call in (
            lambda **kw: grpc.get_model_config("adder", **kw),
            lambda **kw: grpc.get_inference_statistics(**kw),
        ):
            with pytest.raises(InferenceServerException) as e:
                call()
            assert e.value.status() == "StatusCode.UNAUTHENTICATED"
        config = grpc.get_model_config("adder", headers={"authorization": "Bearer s3cret"})
        assert config.config.name == "adder"
    finally:
        grpc.close()
        server.stop(None)


# --- the platform names, and the wire ---------------------------------------------------------------------------


def test_triton_platform_names(tmp_path: Path) -> None:
    assert triton_platform("onnx") == ("onnxruntime_onnx", "onnxruntime")
    assert triton_platform("torchscript") == ("pytorch_libtorch", "pytorch")
    assert triton_platform("tensorrt") == ("tensorrt_plan", "tensorrt")
    assert triton_platform("python") == ("python", "python")
    # TensorFlow: a frozen graph (0/data/model.pb) or a SavedModel.
    (tmp_path / "model.pb").write_bytes(b"")
    assert triton_platform("tensorflow", tmp_path) == ("tensorflow_graphdef", "tensorflow")
    assert triton_platform("tensorflow", tmp_path / "saved") == ("tensorflow_savedmodel", "tensorflow")
    # No Triton backend runs these: the package's own platform.
    assert triton_platform("jax") == ("jax", "jax")


def test_instance_group_of_a_device() -> None:
    # The GPU case cannot be served here (no GPU): its derivation from the model's device string.
    assert instance_group("m", "cpu", 2) == {"name": "m", "kind": "KIND_CPU", "count": 2}
    assert instance_group("m", "cuda:1", 1) == {"name": "m", "kind": "KIND_GPU", "count": 1, "gpus": [1]}
    assert instance_group("m", "cuda", 3) == {"name": "m", "kind": "KIND_GPU", "count": 3, "gpus": [0]}


def _same_fields(ours_descriptor: Any, theirs_descriptor: Any, seen: set[str]) -> None:
    """Every field of our message is theirs: same name, number, type, label; nested messages and enums too."""
    if ours_descriptor.full_name in seen:
        return
    seen.add(ours_descriptor.full_name)
    assert ours_descriptor.full_name == theirs_descriptor.full_name
    for field in ours_descriptor.fields:
        theirs = theirs_descriptor.fields_by_name.get(field.name)
        assert theirs is not None, f"{ours_descriptor.full_name}.{field.name} is not in tritonclient's message"
        where = f"{ours_descriptor.full_name}.{field.name}"
        assert (field.number, field.type) == (theirs.number, theirs.type), where
        assert field.is_repeated == theirs.is_repeated, where
        if field.message_type is not None:
            _same_fields(field.message_type, theirs.message_type, seen)
        if field.enum_type is not None:
            assert field.enum_type.full_name == theirs.enum_type.full_name, where
            for value in field.enum_type.values:
                assert theirs.enum_type.values_by_name[value.name].number == value.number, f"{where}: {value.name}"


def test_wire_compatible_with_tritonclient() -> None:
    seen: set[str] = set()
    for name in ("ModelConfigRequest", "ModelConfigResponse", "ModelStatisticsRequest", "ModelStatisticsResponse"):
        _same_fields(getattr(ours, name).DESCRIPTOR, getattr(triton_service, name).DESCRIPTOR, seen)
    assert {"inference.ModelConfig", "inference.ModelStatistics", "inference.InferStatistics"} <= seen

    # Ours -> bytes -> tritonclient's.
    config = ours.ModelConfig(
        name="m", platform="onnxruntime_onnx", backend="onnxruntime", max_batch_size=8,
        input=[ours.ModelInput(name="x", data_type=ours.TYPE_FP32, format=ours.ModelInput.FORMAT_NHWC, dims=[-1, 2])],
        output=[ours.ModelOutput(name="s", data_type=ours.TYPE_STRING, dims=[-1])],
        instance_group=[ours.ModelInstanceGroup(name="m", kind=ours.ModelInstanceGroup.KIND_GPU, count=2, gpus=[1])],
        dynamic_batching=ours.ModelDynamicBatching(max_queue_delay_microseconds=2**40),
    )  # fmt: skip
    config.parameters["k"].string_value = "v"
    theirs = triton_service.ModelConfigResponse.FromString(ours.ModelConfigResponse(config=config).SerializeToString())
    c = theirs.config
    assert (c.name, c.platform, c.backend, c.max_batch_size) == ("m", "onnxruntime_onnx", "onnxruntime", 8)
    assert (c.input[0].name, c.input[0].data_type, list(c.input[0].dims)) == ("x", triton_config.TYPE_FP32, [-1, 2])
    assert c.input[0].format == triton_config.ModelInput.FORMAT_NHWC
    assert (c.output[0].data_type, list(c.output[0].dims)) == (triton_config.TYPE_STRING, [-1])
    group = c.instance_group[0]
    assert (group.kind, group.count, list(group.gpus)) == (triton_config.ModelInstanceGroup.KIND_GPU, 2, [1])
    assert c.dynamic_batching.max_queue_delay_microseconds == 2**40
    assert c.parameters["k"].string_value == "v"

    # tritonclient's -> bytes -> ours, with fields we do not declare kept as unknown ones.
    stats = triton_service.ModelStatisticsResponse()
    m = stats.model_stats.add(name="m", version="1", last_inference=2**41, inference_count=10, execution_count=3)
    m.inference_stats.compute_infer.count = 10
    m.inference_stats.compute_infer.ns = 2**50
    m.batch_stats.add(batch_size=4).compute_output.ns = 7
    back = ours.ModelStatisticsResponse.FromString(stats.SerializeToString())
    b = back.model_stats[0]
    assert (b.name, b.version, b.last_inference, b.inference_count, b.execution_count) == ("m", "1", 2**41, 10, 3)
    assert (b.inference_stats.compute_infer.count, b.inference_stats.compute_infer.ns) == (10, 2**50)
    assert (b.batch_stats[0].batch_size, b.batch_stats[0].compute_output.ns) == (4, 7)
    assert back.SerializeToString() == stats.SerializeToString()
    request = triton_service.ModelStatisticsRequest(name="m", version="1").SerializeToString()
    assert ours.ModelStatisticsRequest.FromString(request).name == "m"
