"""A repository load with a ``config`` (Triton's model configuration) changes how that model is served.

Each test serves a fresh copy of a repository (adder, echo, ``fixed``: a model
without a batch dimension) over REST (uvicorn in a thread) and gRPC (the real
gRPC server), loads with tritonclient.http / tritonclient.grpc ``load_model(config=...)``
as a Triton user would, and checks what changed: batches formed (the
``neuropod_batch_size`` histogram), OPE worker processes, the per-model settings
the engine keeps, and that every refusal names the field and leaves the model
loaded before serving.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from onnx import helper  # noqa: E402
from tritonclient.grpc import model_config_pb2 as triton_config  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from neuropod_serving.server import BatchPolicy, Engine, ModelRegistry, create_app  # noqa: E402
from neuropod_serving.server.grpc_server import start_grpc_server  # noqa: E402
from neuropod_serving.server.metrics import ServerMetrics  # noqa: E402

from conftest import adder_and_echo, onnx_package, private_caches, serve_in_thread  # noqa: E402


@pytest.fixture(scope="module")
def packages() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-config-override-"))
    with private_caches(root):
        adder_and_echo(root / "start", echo_as_zip=False)
        onnx_package(root / "start" / "fixed", "fixed", [helper.make_node("Identity", ["x"], ["y"])],
                     [("x", "float32", [3])], [("y", "float32", [3])])  # fmt: skip
        # An image model's interface: channels-first pixels -> the mean of each channel.
        onnx_package(root / "start" / "image", "image",
                     [helper.make_node("ReduceMean", ["pixels"], ["means"], axes=[2, 3], keepdims=0)],
                     [("pixels", "float32", ["batch_size", 3, 4, 5])], [("means", "float32", ["batch_size", 3])])  # fmt: skip
        yield root
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class Server:
    engine: Engine
    metrics: ServerMetrics
    http: Any  # httpx.Client
    triton: Any  # tritonclient.http
    triton_grpc: Any  # tritonclient.grpc


def _serve(packages: Path, tmp_path: Path, batching: BatchPolicy | None = None) -> Iterator[Server]:
    models = tmp_path / "models"
    shutil.copytree(packages / "start", models)
    metrics = ServerMetrics()
    engine = Engine(ModelRegistry.load([models]), batching=batching, metrics=metrics)
    grpc_server, grpc_port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
    try:
        with serve_in_thread(create_app(engine)) as port:
            triton = httpclient.InferenceServerClient(f"127.0.0.1:{port}", concurrency=8)
            triton_grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                try:
                    yield Server(engine, metrics, http, triton, triton_grpc)
                finally:
                    triton.close()
                    triton_grpc.close()
    finally:
        grpc_server.stop(None)
        engine.close()


@pytest.fixture
def server(packages: Path, tmp_path: Path) -> Iterator[Server]:
    yield from _serve(packages, tmp_path)


@pytest.fixture
def batching_server(packages: Path, tmp_path: Path) -> Iterator[Server]:
    yield from _serve(packages, tmp_path, BatchPolicy(8, 0.0))


def _adder_inputs(rows: int, seed: int) -> tuple[list[Any], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((rows, 2)).astype(np.float32), rng.standard_normal((rows, 2)).astype(np.float32)
    inputs = [httpclient.InferInput(n, [rows, 2], "FP32") for n in "xy"]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(y)
    return inputs, x, y


def _adder_ok(s: Server, rows: int = 2, seed: int = 0) -> None:
    inputs, x, y = _adder_inputs(rows, seed)
    result = s.triton.infer("adder", inputs)
    np.testing.assert_allclose(result.as_numpy("out"), x + y, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("doubled"), (x + y) * 2, rtol=1e-6)


def _batches(s: Server) -> tuple[float, float]:
    """Model runs of adder so far, and the rows they ran."""
    registry = s.metrics.registry
    count = registry.get_sample_value("neuropod_batch_size_count", {"model": "adder"}) or 0.0
    rows = registry.get_sample_value("neuropod_batch_size_sum", {"model": "adder"}) or 0.0
    return count, rows


def _load_refused(s: Server, model: str, config: Any, *words: str) -> None:
    """The load is refused with 400 (REST) and INVALID_ARGUMENT (gRPC), both naming ``words``."""
    text = config if isinstance(config, str) else json.dumps(config)
    with pytest.raises(InferenceServerException) as info:
        s.triton.load_model(model, config=text)
    assert info.value.status() == "400", info.value
    rest = info.value.message()
    with pytest.raises(InferenceServerException) as info:
        s.triton_grpc.load_model(model, config=text)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
    for message in (rest, info.value.message()):
        assert f"failed to load model {model!r}" in message, message
        for word in words:
            assert word in message, (word, message)


def test_max_batch_size_and_preferred_size_turn_batching_on(server: Server) -> None:
    """Started without batching; a config with max_batch_size 8, a long delay and a preferred size of 4:
    four one-row requests run as one batch of 4, long before the delay is out."""
    assert server.engine.batched("adder") == (False, "batching off: no --max-batch-size")
    config = {
        "max_batch_size": 8,
        "dynamic_batching": {"max_queue_delay_microseconds": "5000000", "preferred_batch_size": [4]},
    }
    server.triton.load_model("adder", config=json.dumps(config))
    settings = server.engine.get("adder").settings
    assert settings is not None
    assert (settings.max_batch_size, settings.max_queue_delay_us, settings.preferred_batch_sizes) == (
        8,
        5_000_000,
        (4,),
    )
    assert server.engine.batched("adder") == (True, "")
    assert server.engine.get("echo").settings == server.engine.default_settings  # that model only

    before = _batches(server)
    started = time.monotonic()
    pending = []
    expected = []
    for i in range(4):
        inputs, x, y = _adder_inputs(1, seed=i)
        pending.append(server.triton.async_infer("adder", inputs))
        expected.append(x + y)
    for request, want in zip(pending, expected):
        np.testing.assert_allclose(request.get_result(timeout=30).as_numpy("out"), want, rtol=1e-6)
    assert time.monotonic() - started < 4.0, "the preferred size did not cut the 5 s delay short"
    count, rows = _batches(server)
    assert (count - before[0], rows - before[1]) == (1, 4), "the four requests did not run as one batch"


def test_max_batch_size_0_turns_batching_off(batching_server: Server) -> None:
    s = batching_server
    assert s.engine.batched("adder") == (True, "")
    s.triton_grpc.load_model("adder", config=json.dumps({"max_batch_size": 0}))
    assert s.engine.batched("adder") == (False, "batching off: its load config sets max_batch_size 1")
    settings = s.engine.get("adder").settings
    assert settings is not None and settings.overridden == ("max_batch_size",)
    before = _batches(s)
    _adder_ok(s, rows=3)
    assert _batches(s) == before  # unbatched runs are not counted as batches
    # A load without a config serves it with the server's options again.
    s.triton.load_model("adder")
    assert s.engine.batched("adder") == (True, "")
    assert s.engine.get("adder").settings == s.engine.default_settings
    _adder_ok(s, rows=3)
    assert _batches(s)[1] == before[1] + 3


def test_instance_group_count_sets_the_worker_processes(server: Server) -> None:
    config = {"name": "adder", "instance_group": [{"count": 2, "kind": "KIND_CPU"}]}
    server.triton_grpc.load_model("adder", config=json.dumps(config))
    served = server.engine.get("adder")
    assert served.settings is not None and (served.settings.workers, served.settings.device) == (2, "cpu")
    pids = served.model.worker_pids  # type: ignore[attr-defined]
    assert len(pids) == 2 and len(set(pids)) == 2
    for seed in range(4):
        _adder_ok(server, rows=2, seed=seed)
    server.triton.load_model("adder")
    assert not hasattr(server.engine.get("adder").model, "worker_pids")  # in process again
    _adder_ok(server)
    deadline = time.monotonic() + 30
    for pid in pids:  # the replaced model's workers stopped with it
        while _alive(pid):
            assert time.monotonic() < deadline, f"OPE worker {pid} outlived its model"
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_config_that_agrees_with_the_package_is_taken(batching_server: Server) -> None:
    """What a Triton config of this model says (folded batch dim, Triton's platform name, TYPE_*
    names, int64s as strings, fields Triton's backends use) is accepted and applied."""
    config = {
        "name": "adder", "platform": "onnxruntime_onnx", "max_batch_size": 4,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": ["2"]},
                  {"name": "y", "data_type": "TYPE_FP32", "dims": [-1, 2]}],
        "output": [{"name": "out", "data_type": "TYPE_FP32", "dims": [2]}],
        "version_policy": {"latest": {"num_versions": 1}}, "optimization": {}, "parameters": {},
        "dynamic_batching": {"preserve_ordering": False},
    }  # fmt: skip
    r = batching_server.http.post(
        "/v2/repository/models/adder/load", json={"parameters": {"config": json.dumps(config)}}
    )
    assert r.status_code == 200, r.text
    settings = batching_server.engine.get("adder").settings
    assert settings is not None and settings.max_batch_size == 4 and settings.max_queue_delay_us == 0
    _adder_ok(batching_server, rows=4)


def test_input_format_is_reported_in_the_model_configuration(batching_server: Server) -> None:
    """A config's input ``format`` (Triton's config.pbtxt names an image input's layout; a package does not)
    is what both protocols' model configuration say afterwards, until a load without it."""
    s = batching_server

    def formats() -> tuple[list[str], list[str]]:
        rest = [t.get("format") for t in s.triton.get_model_config("image")["input"]]
        grpc = [triton_config.ModelInput.Format.Name(t.format) for t in s.triton_grpc.get_model_config("image").config.input]
        return rest, grpc

    assert formats() == (["FORMAT_NONE"], ["FORMAT_NONE"])
    config = {"max_batch_size": 8, "input": [{"name": "pixels", "data_type": "TYPE_FP32", "format": "FORMAT_NCHW",
                                              "dims": [3, 4, 5], "is_shape_tensor": False}]}  # fmt: skip
    s.triton.load_model("image", config=json.dumps(config))
    assert formats() == (["FORMAT_NCHW"], ["FORMAT_NCHW"])
    rest = s.triton.get_model_config("image")
    assert (rest["max_batch_size"], rest["input"][0]["dims"]) == (8, [3, 4, 5])
    settings = s.engine.get("image").settings
    assert settings is not None and settings.input_formats == (("pixels", "FORMAT_NCHW"),)
    assert "input.format" in settings.overridden
    # protobuf's JSON may write the enum as its number: 1 is FORMAT_NHWC.
    s.triton_grpc.load_model("image", config=json.dumps({"input": [{"name": "pixels", "format": 1}]}))
    assert formats() == (["FORMAT_NHWC"], ["FORMAT_NHWC"])
    # The model runs as before: the format is what clients read, not a conversion.
    pixels = np.random.default_rng(3).standard_normal((2, 3, 4, 5)).astype(np.float32)
    request = httpclient.InferInput("pixels", list(pixels.shape), "FP32")
    request.set_data_from_numpy(pixels)
    means = s.triton.infer("image", [request]).as_numpy("means")
    np.testing.assert_allclose(means, pixels.reshape(2, 3, 20).mean(axis=2), rtol=1e-5)
    s.triton.load_model("image")
    assert formats() == (["FORMAT_NONE"], ["FORMAT_NONE"])


@pytest.mark.parametrize(
    ("model", "config", "words"),
    [
        # Unbatched (this server has no --max-batch-size), the image input has 4 dims, not an image's 3.
        ("image", {"input": [{"name": "pixels", "format": "FORMAT_NCHW"}]}, ["input 'pixels'", "FORMAT_NCHW", "3 dims"]),
        ("adder", {"input": [{"name": "x", "format": "FORMAT_NHWC"}]}, ["input 'x'", "FORMAT_NHWC", "3 dims"]),
        ("adder", {"input": [{"name": "x", "format": "NCHW"}]}, ["input 'x'", "'NCHW'", "FORMAT_NONE"]),
        ("adder", {"input": [{"name": "x", "format": 7}]}, ["input 'x'", "not 7"]),
        ("adder", {"output": [{"name": "out", "format": "FORMAT_NONE"}]}, ["output 'out'", "'format'"]),
        ("adder", {"input": [{"name": "x", "optional": True}]}, ["input 'x'", "'optional' = True"]),
        ("adder", {"input": [{"name": "x", "reshape": {"shape": [2]}}]}, ["input 'x'", "'reshape'"]),
        ("adder", {"max_batch_sizes": 8}, ["'max_batch_sizes'", "max_batch_size"]),
        ("adder", {"sequence_batching": {}}, ["sequence_batching declares no control_input and no state"]),
        ("adder", {"name": "other"}, ["name 'other'", "'adder'"]),
        ("adder", {"platform": "tensorflow_savedmodel"}, ["platform 'tensorflow_savedmodel'", "'onnx'"]),
        ("adder", {"input": [{"name": "x", "data_type": "TYPE_INT32"}]}, ["input 'x'", "TYPE_INT32", "TYPE_FP32"]),
        ("adder", {"input": [{"name": "x", "dims": [3]}]}, ["input 'x'", "dims [3]", "batch_size"]),
        ("adder", {"output": [{"name": "nope"}]}, ["output 'nope'", "'out'"]),
        ("fixed", {"max_batch_size": 8}, ["max_batch_size 8", "batch dimension"]),
        ("adder", {"max_batch_size": 0, "dynamic_batching": {}}, ["dynamic_batching", "max_batch_size"]),
        ("adder", {"max_batch_size": 2, "dynamic_batching": {"priority_levels": 2}}, ["'priority_levels'"]),
        (
            "adder",
            {"max_batch_size": 4, "dynamic_batching": {"preferred_batch_size": [8]}},
            ["preferred_batch_size", "1 to 4"],
        ),
        ("adder", {"max_batch_size": -1}, ["max_batch_size", "not -1"]),
        ("adder", {"max_batch_size": 2.5}, ["max_batch_size", "whole number"]),
        ("adder", {"instance_group": [{"count": 0}]}, ["instance_group[0].count", "not 0"]),
        ("adder", {"instance_group": [{"count": 1}, {"count": 1}]}, ["2 groups"]),
        ("adder", {"instance_group": [{"kind": "KIND_TPU"}]}, ["KIND_TPU", "KIND_CPU"]),
        ("adder", "[1, 2]", ["JSON object", "list"]),
        ("adder", "{not json", ["not JSON"]),
    ],
)
def test_config_refusals_name_the_field(server: Server, model: str, config: Any, words: list[str]) -> None:
    before = server.engine.get(model)
    _load_refused(server, model, config, *words)
    assert server.engine.get(model) is before  # nothing was loaded; the model loaded before serves
    if model == "adder":
        _adder_ok(server)


def test_config_of_a_model_not_in_the_repository_is_404(server: Server) -> None:
    with pytest.raises(InferenceServerException) as info:
        server.triton.load_model("no_such_model", config="{}")
    assert info.value.status() == "404" and "'no_such_model'" in info.value.message()
    r = server.http.post("/v2/repository/models/adder/load", json={"parameters": {"config": {"max_batch_size": 0}}})
    assert r.status_code == 400 and "JSON string" in r.json()["error"], r.text
    r = server.http.post("/v2/repository/models/adder/load", json={"parameters": [1]})
    assert r.status_code == 400 and "'parameters'" in r.json()["error"], r.text


def test_concurrent_requests_during_a_config_reload(server: Server) -> None:
    """Requests racing a reload with a config all answer 200 with the right sums."""
    stop = threading.Event()
    failures: list[str] = []
    answered: list[int] = []

    def hammer(seed: int) -> None:
        # Its own client: tritonclient.http's (gevent) cannot be shared between threads.
        x = np.random.default_rng(seed).standard_normal((2, 2)).astype(np.float32)
        body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [2, 2], "data": x.ravel().tolist()} for n in "xy"]}
        with httpx.Client(base_url=str(server.http.base_url), timeout=60) as http:
            while not stop.is_set():
                r = http.post("/v2/models/adder/infer", json=body)
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text}")
                    continue
                out = {o["name"]: o["data"] for o in r.json()["outputs"]}
                if not np.allclose(out["out"], (x + x).ravel(), rtol=1e-6):
                    failures.append(f"wrong sums: {out}")
                answered.append(1)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        for config in ({"max_batch_size": 4}, {"max_batch_size": 0}):
            server.triton.load_model("adder", config=json.dumps(config))
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not failures, failures[:3]
    assert answered, "no request ran during the reloads"


def test_kind_gpu_without_a_gpu_fails_to_load_and_keeps_the_model(server: Server) -> None:
    """KIND_GPU loads onto cuda:<gpus[0]>; on a machine without one the load fails saying so,
    and the model loaded before keeps serving. (On a GPU machine the GPU test suite covers it.)"""
    from neuropod.testing import gpu_missing

    if gpu_missing() is None:
        pytest.skip("this machine has a GPU: the load would succeed")
    before = server.engine.get("adder")
    config = {"instance_group": [{"kind": "KIND_GPU", "gpus": [0]}]}
    with pytest.raises(InferenceServerException) as info:
        server.triton.load_model("adder", config=json.dumps(config))
    message = info.value.message()
    assert info.value.status() == "400" and "failed to load model 'adder'" in message, message
    assert "cuda:0" in message and "keeps serving" in message, message
    assert server.engine.get("adder") is before
    _adder_ok(server)


def _no_cuda_provider() -> str | None:
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        return None
    return "this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"


@pytest.mark.gpu(needs=_no_cuda_provider)
def test_kind_gpu_loads_onto_the_gpu(server: Server) -> None:
    config = {"instance_group": [{"kind": "KIND_GPU", "gpus": [0]}]}
    server.triton_grpc.load_model("adder", config=json.dumps(config))
    assert server.engine.get("adder").model.device == "cuda:0"
    _adder_ok(server)
