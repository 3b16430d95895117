"""Pipelines served by ``neuropod serve``, driven with tritonclient over REST and gRPC.

One server (in this process: the engine, uvicorn in a thread, the real gRPC server) serves a
repository of python-backend and ONNX step packages, pipeline packages of them, and, by repository
loads with Triton's ensemble configuration, pipelines of the served step models. Expected values are
computed with numpy.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from onnx import TensorProto, helper  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from neuropod.create import create_package  # noqa: E402
from neuropod.packagers import create_pipeline_neuropod, create_python_neuropod  # noqa: E402
from neuropod_serving.server import BatchPolicy, Engine, ModelRegistry, create_app  # noqa: E402
from neuropod_serving.server.grpc_server import start_grpc_server  # noqa: E402
from neuropod_serving.server.metrics import ServerMetrics  # noqa: E402

from conftest import onnx_package, private_caches, serve_in_thread  # noqa: E402

OPS = """
import time
import numpy as np

def fragile(_):
    def run(x):
        if x.size and x.flat[0] < 0:
            raise ValueError("a negative first element")
        return {"y": x}
    return run

def sleepy(_):
    def run(x):
        time.sleep(0.05)
        return {"y": x}
    return run

def repeat(_):
    def run(x, n):
        for i in range(int(n[0])):
            yield {"y": (x + i).astype(np.float32)}
    return run

def accumulate(_):
    def run(x, acc_in):
        y = acc_in + x
        return {"y": y, "acc_out": y.copy()}
    return run
"""


def t(name: str, *shape: Any, dtype: str = "float32") -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": list(shape) or ["batch", 2]}


ROWS = ("x", "float32", ["batch", 2])


def _python_step(code: Path, path: Path, entry: str, ins: list[Any], outs: list[Any], **kw: Any) -> Path:
    made: Path = create_python_neuropod(
        path, entry, [], [{"python_root": code, "dirs_to_package": [""]}], "ops", entry, ins, outs, **kw
    )
    return made


def _onnx_steps(root: Path) -> dict[str, Path]:
    """``add1`` (y = x + 1) and ``times2`` (b = a * 2), float32 [rows, 2]."""
    one = [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])]
    two = [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])]
    return {
        "add1": onnx_package(root / "add1", "add1", [helper.make_node("Add", ["x", "one"], ["y"])],
                             [ROWS], [("y", "float32", ["batch", 2])], one),
        "times2": onnx_package(root / "times2", "times2", [helper.make_node("Mul", ["a", "two"], ["b"])],
                               [("a", "float32", ["n", 2])], [("b", "float32", ["n", 2])], two),
    }  # fmt: skip


@pytest.fixture(scope="module")
def repository() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-pipelines-served-"))
    with private_caches(root):
        code = root / "code"
        code.mkdir()
        (code / "ops.py").write_text(OPS)
        models = root / "models"
        scratch = root / "steps"
        onnx = _onnx_steps(models)  # served on their own too (the ensembles' steps)
        fragile = _python_step(code, scratch / "fragile", "fragile", [t("x")], [t("y")])
        sleepy = _python_step(code, scratch / "sleepy", "sleepy", [t("x")], [t("y")])
        repeat = _python_step(code, models / "repeat", "repeat", [t("x"), t("n", 1, dtype="int32")], [t("y")],
                              decoupled=True)  # fmt: skip
        acc = _python_step(code, scratch / "acc", "accumulate", [t("x", 1, 2), t("acc_in", 1, 2)],
                           [t("y", 1, 2), t("acc_out", 1, 2)],
                           state_spec=[{"input_name": "acc_in", "output_name": "acc_out"}])  # fmt: skip
        io = {"input_spec": [t("in")], "output_spec": [t("out")]}
        x = np.arange(4, dtype=np.float32).reshape(2, 2)
        create_pipeline_neuropod(models / "pipe", "pipe", [
            {"package": onnx["add1"], "input_map": {"x": "in"}, "output_map": {"y": "mid"}},
            {"package": onnx["times2"], "input_map": {"a": "mid"}, "output_map": {"b": "out"}},
        ], **io, test_input_data={"in": x}, test_expected_out={"out": (x + 1) * 2})  # fmt: skip
        create_pipeline_neuropod(models / "brittle", "brittle", [
            {"package": onnx["add1"], "input_map": {"x": "in"}, "output_map": {"y": "mid"}},
            {"package": fragile, "name": "check", "input_map": {"x": "mid"}, "output_map": {"y": "out"}},
        ], **io)  # fmt: skip
        create_pipeline_neuropod(models / "slow", "slow", [
            {"package": sleepy, "input_map": {"x": "in"}, "output_map": {"y": "out"}},
        ], **io)  # fmt: skip
        # No batch dimension (its requests never share a run): each request is one call inside.
        create_pipeline_neuropod(models / "bounded", "bounded", [
            {"package": sleepy, "input_map": {"x": "in"}, "output_map": {"y": "out"}},
        ], input_spec=[t("in", None, 2)], output_spec=[t("out", None, 2)], max_inflight_requests=1)  # fmt: skip
        create_pipeline_neuropod(models / "stream", "stream", [
            {"package": onnx["add1"], "input_map": {"x": "in"}, "output_map": {"y": "before"}},
            {"package": repeat, "input_map": {"x": "before", "n": "n"}, "output_map": {"y": "each"}},
            {"package": onnx["times2"], "input_map": {"a": "each"}, "output_map": {"b": "out"}},
        ], input_spec=[t("in"), t("n", 1, dtype="int32")], output_spec=[t("out")])  # fmt: skip
        create_pipeline_neuropod(models / "sums", "sums", [
            {"package": acc, "input_map": {"x": "in"}, "output_map": {"y": "sum"}},
            {"package": onnx["times2"], "input_map": {"a": "sum"}, "output_map": {"b": "out"}},
        ], input_spec=[t("in", 1, 2)], output_spec=[t("out", 1, 2)])  # fmt: skip
        yield root
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class Server:
    engine: Engine
    metrics: ServerMetrics
    http: Any  # tritonclient.http
    grpc: Any  # tritonclient.grpc
    grpc_address: str


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[Server]:
    metrics = ServerMetrics()
    registry = ModelRegistry.load([repository / "models"])
    engine = Engine(registry, batching=BatchPolicy(8, 0.005), metrics=metrics)
    metrics.step_statistics = registry.step_statistics  # as neuropod serve's launcher sets it
    grpc_server, grpc_port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
    try:
        with serve_in_thread(create_app(engine)) as port:
            http = httpclient.InferenceServerClient(f"127.0.0.1:{port}", concurrency=8)
            grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            try:
                yield Server(engine, metrics, http, grpc, f"127.0.0.1:{grpc_port}")
            finally:
                http.close()
                grpc.close()
    finally:
        grpc_server.stop(None)
        engine.close()


def _infer(client: Any, model: str, arrays: dict[str, np.ndarray], outputs: tuple[str, ...] = ("out",)) -> Any:
    module = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    inputs = []
    for name, a in arrays.items():
        i = module.InferInput(name, list(a.shape), "FP32" if a.dtype == np.float32 else "INT32")
        i.set_data_from_numpy(a)
        inputs.append(i)
    result = client.infer(model, inputs)
    return {n: result.as_numpy(n) for n in outputs}


def _http_inputs(arrays: dict[str, np.ndarray]) -> list[Any]:
    inputs = []
    for name, a in arrays.items():
        i = httpclient.InferInput(name, list(a.shape), "FP32")
        i.set_data_from_numpy(a)
        inputs.append(i)
    return inputs


def _infer_alone(address: str, model: str, x: np.ndarray) -> np.ndarray:
    """One request on a gRPC client of its own (for a thread of its own)."""
    client = grpcclient.InferenceServerClient(address)
    try:
        out: np.ndarray = _infer(client, model, {"in": x})["out"]
        return out
    finally:
        client.close()


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-9, 9, (n, 2)).astype(np.float32)


def _sample(s: Server, name: str, labels: dict[str, str]) -> float:
    return s.metrics.registry.get_sample_value(name, labels) or 0.0


def _ensemble(name: str, steps: list[dict[str, Any]], *, dtype: str = "TYPE_FP32", **extra: Any) -> str:
    """Triton's ensemble configuration (JSON form) of ``in`` -> ``out``, float32 [batch, 2]."""
    config = {
        "name": name, "platform": "ensemble", "max_batch_size": 8,
        "input": [{"name": "in", "data_type": dtype, "dims": [2]}],
        "output": [{"name": "out", "data_type": "TYPE_FP32", "dims": [2]}],
        "ensemble_scheduling": {"step": [{"model_version": -1, **s} for s in steps], **extra},
    }  # fmt: skip
    return json.dumps(config)


CHAIN = [
    {"model_name": "add1", "input_map": {"x": "in"}, "output_map": {"y": "mid"}},
    {"model_name": "times2", "input_map": {"a": "mid"}, "output_map": {"b": "out"}},
]


# --- a pipeline package is one served model: Triton's ensemble ---


def test_a_pipeline_package_is_served_as_an_ensemble(server: Server) -> None:
    for client in (server.http, server.grpc):
        x = _rows(3)
        np.testing.assert_array_equal(_infer(client, "pipe", {"in": x})["out"], (x + 1) * 2)
    metadata = server.http.get_model_metadata("pipe")
    assert metadata["platform"] == "ensemble"
    assert server.grpc.get_model_metadata("pipe").platform == "ensemble"
    config = server.http.get_model_config("pipe")
    assert config["platform"] == "ensemble" and config["max_batch_size"] == 8
    assert config["ensemble_scheduling"]["step"] == [
        {"model_name": "add1", "model_version": -1, "input_map": {"x": "in"}, "output_map": {"y": "mid"}},
        {"model_name": "times2", "model_version": -1, "input_map": {"a": "mid"}, "output_map": {"b": "out"}},
    ]
    assert "add1: model 'add1' on onnx" in config["parameters"]["neuropod_steps"]["string_value"]
    grpc_config = server.grpc.get_model_config("pipe").config
    assert grpc_config.platform == "ensemble" and grpc_config.max_batch_size == 8
    steps = grpc_config.ensemble_scheduling.step
    assert [(s.model_name, s.model_version, dict(s.input_map), dict(s.output_map)) for s in steps] == [
        ("add1", -1, {"x": "in"}, {"y": "mid"}),
        ("times2", -1, {"a": "mid"}, {"b": "out"}),
    ]


def test_a_pipelines_requests_are_batched(server: Server) -> None:
    """Its inputs and outputs lead with one symbol: requests that wait while it runs (a 50 ms step)
    join one batch, each row's answer its own."""
    xs = [_rows(1, seed) for seed in range(6)]
    pending = [server.http.async_infer("slow", _http_inputs({"in": x})) for x in xs]
    answers = [p.get_result().as_numpy("out") for p in pending]
    for x, got in zip(xs, answers):
        np.testing.assert_array_equal(got, x)
    assert _sample(server, "neuropod_batch_size_sum", {"model": "slow"}) == 6
    assert _sample(server, "neuropod_batch_size_count", {"model": "slow"}) < 6, "no two requests shared a run"
    assert server.http.get_model_config("slow")["max_batch_size"] == 8


def _stream(server: Server, model: str, x: np.ndarray, n: int) -> list[np.ndarray]:
    """The ``out`` of each response of one gRPC stream request (``in`` = x, ``n``)."""
    responses: list[Any] = []
    client = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        client.start_stream(callback=lambda result, error: responses.append(error or result))
        inputs = [grpcclient.InferInput("in", list(x.shape), "FP32"), grpcclient.InferInput("n", [1], "INT32")]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(np.array([n], np.int32))
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        deadline = time.monotonic() + 20
        while not any(_final(r) for r in responses) and time.monotonic() < deadline:
            time.sleep(0.01)
        client.stop_stream()
    finally:
        client.close()
    errors = [r for r in responses if isinstance(r, InferenceServerException)]
    assert not errors, errors
    return [r.as_numpy("out") for r in responses if r.as_numpy("out") is not None]


def test_a_decoupled_pipeline_streams_over_grpc(server: Server) -> None:
    x = _rows(2)
    outs = _stream(server, "stream", x, 3)
    assert len(outs) == 3
    for i, got in enumerate(outs):
        np.testing.assert_array_equal(got, (x + 1 + i) * 2)
    assert server.http.get_model_config("stream")["model_transaction_policy"] == {"decoupled": True}


def test_an_ensemble_of_served_models_with_a_decoupled_step_streams(server: Server) -> None:
    config = {
        "platform": "ensemble",
        "max_batch_size": 0,
        "input": [{"name": "in", "data_type": "TYPE_FP32", "dims": [-1, 2]},
                  {"name": "n", "data_type": "TYPE_INT32", "dims": [1]}],
        "output": [{"name": "out", "data_type": "TYPE_FP32", "dims": [-1, 2]}],
        "ensemble_scheduling": {"step": [
            {"model_name": "add1", "model_version": -1, "input_map": {"x": "in"}, "output_map": {"y": "before"}},
            {"model_name": "repeat", "model_version": -1, "input_map": {"x": "before", "n": "n"},
             "output_map": {"y": "each"}},
            {"model_name": "times2", "model_version": -1, "input_map": {"a": "each"}, "output_map": {"b": "out"}},
        ]},
    }  # fmt: skip
    server.grpc.load_model("repeats", config=json.dumps(config))
    try:
        assert server.grpc.get_model_config("repeats").config.model_transaction_policy.decoupled
        x = _rows(3, 4)
        outs = _stream(server, "repeats", x, 2)
        assert len(outs) == 2
        for i, got in enumerate(outs):
            np.testing.assert_array_equal(got, (x + 1 + i) * 2)
    finally:
        server.grpc.unload_model("repeats")


def _final(result: Any) -> bool:
    if isinstance(result, InferenceServerException):
        return True
    flag = result.get_response().parameters.get("triton_final_response")
    return bool(flag is not None and flag.bool_param)


def test_a_stateful_pipelines_sequences(server: Server) -> None:
    xs = [_rows(1, seed) for seed in range(4)]
    want = np.cumsum(np.stack(xs), axis=0) * 2
    for seq_id, client in ((11, server.http), (12, server.grpc)):
        module = httpclient if client is server.http else grpcclient
        for i, (x, w) in enumerate(zip(xs, want)):
            inp = module.InferInput("in", [1, 2], "FP32")
            inp.set_data_from_numpy(x)
            result = client.infer("sums", [inp], sequence_id=seq_id, sequence_start=i == 0,
                                  sequence_end=i == len(xs) - 1)  # fmt: skip
            np.testing.assert_array_equal(result.as_numpy("out"), w)
    assert server.http.get_model_config("sums")["platform"] == "ensemble"


# --- statistics and metrics: the pipeline's and each step's ---


def test_statistics_per_pipeline_and_per_step(server: Server) -> None:
    x = _rows(2)
    for _ in range(3):
        _infer(server.http, "pipe", {"in": x})
    http = {m["name"]: m for m in server.http.get_inference_statistics("pipe")["model_stats"]}
    assert list(http) == ["pipe", "pipe/add1", "pipe/times2"]
    assert http["pipe"]["inference_stats"]["success"]["count"] >= 3
    steps = server.engine.get("pipe").model.step_statistics()  # type: ignore[attr-defined]
    for step in ("add1", "times2"):
        entry = http[f"pipe/{step}"]
        assert entry["inference_stats"]["success"]["count"] == steps[step]["count"] >= 3
        assert entry["inference_stats"]["compute_infer"]["ns"] == steps[step]["ns"] > 0
        labels = {"model": "pipe", "step": step}
        assert _sample(server, "neuropod_pipeline_step_runs_total", labels) == steps[step]["count"]
        assert _sample(server, "neuropod_pipeline_step_duration_seconds_total", labels) == pytest.approx(
            steps[step]["ns"] / 1e9
        )
    grpc = [m.name for m in server.grpc.get_inference_statistics("pipe").model_stats]
    assert grpc == ["pipe", "pipe/add1", "pipe/times2"]
    every = [m["name"] for m in server.http.get_inference_statistics()["model_stats"]]
    assert "pipe/times2" in every and "add1" in every


# --- a step that fails ---


def test_a_failing_step_names_pipeline_step_and_model_and_the_next_request_succeeds(server: Server) -> None:
    bad = np.full((1, 2), -5, np.float32)  # -5 + 1 < 0: the check step raises
    for client in (server.http, server.grpc):
        with pytest.raises(InferenceServerException) as info:
            _infer(client, "brittle", {"in": bad})
        text = str(info.value)
        assert "pipeline 'brittle', step 'check' (model 'fragile')" in text and "negative first element" in text, text
        assert info.value.status() == ("500" if client is server.http else "StatusCode.INTERNAL")
        x = _rows(2) + 20
        np.testing.assert_array_equal(_infer(client, "brittle", {"in": x})["out"], x + 1)
    assert _sample(server, "neuropod_pipeline_step_failures_total", {"model": "brittle", "step": "check"}) == 2
    assert _sample(server, "neuropod_request_failures_total",
                   {"model": "brittle", "protocol": "rest", "reason": "model"}) == 1  # fmt: skip


def test_a_pipeline_whose_step_cannot_run_here_fails_to_load_naming_the_step(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "ops.py").write_text(OPS)
    fine = _python_step(code, tmp_path / "fine", "fragile", [t("x")], [t("y")])
    with pytest.warns(UserWarning, match="caffe2"):
        odd = create_package("test", tmp_path / "odd", "odd", "caffe2", [t("x")], [t("y")], {}, {})
    with pytest.warns(UserWarning, match="step 'legacy'"):
        create_pipeline_neuropod(tmp_path / "models" / "odd_pipe", "odd_pipe", [
            {"package": fine, "input_map": {"x": "in"}, "output_map": {"y": "mid"}},
            {"package": odd, "name": "legacy", "input_map": {"x": "mid"}, "output_map": {"y": "out"}},
        ], input_spec=[t("in")], output_spec=[t("out")])  # fmt: skip
    with pytest.raises(Exception, match="step 'legacy' cannot") as info:
        ModelRegistry.load([tmp_path / "models"])
    assert "caffe2" in str(info.value)


# --- backpressure: max_inflight_requests ---


def test_max_inflight_requests_bounds_the_pipeline_and_holds_no_other_model(server: Server) -> None:
    """Six requests to a pipeline of one 50 ms step bounded to one at a time take six turns; the
    server answers another model meanwhile, over REST and gRPC (the waiting requests hold only the
    pipeline's threads: its steps' calls need none of the server's)."""
    xs = [_rows(1, seed) for seed in range(6)]
    assert server.http.get_model_config("bounded")["max_batch_size"] == 0
    started = time.perf_counter()
    with ThreadPoolExecutor(6) as pool:
        bounded = [pool.submit(_infer_alone, server.grpc_address, "bounded", x) for x in xs]
        time.sleep(0.03)
        other_started = time.perf_counter()
        other = _infer(server.http, "pipe", {"in": xs[0]})["out"]
        np.testing.assert_array_equal(_infer(server.grpc, "pipe", {"in": xs[1]})["out"], (xs[1] + 1) * 2)
        other_s = time.perf_counter() - other_started
        answers = [f.result(30) for f in bounded]
    elapsed = time.perf_counter() - started
    for x, got in zip(xs, answers):
        np.testing.assert_array_equal(got, x)
    np.testing.assert_array_equal(other, (xs[0] + 1) * 2)
    assert elapsed >= 6 * 0.05 * 0.9, f"{elapsed:.3f} s: the requests ran side by side"
    assert other_s < 0.25, f"another model waited {other_s:.3f} s behind the bounded pipeline"
    assert server.http.get_model_config("bounded")["ensemble_scheduling"]["max_inflight_requests"] == 1


# --- a Triton ensemble configuration sent with a load ---


def test_an_ensemble_configuration_makes_a_pipeline_of_served_models(server: Server) -> None:
    server.http.load_model("chain", config=_ensemble("chain", CHAIN, max_inflight_requests=4))
    try:
        for client in (server.http, server.grpc):
            x = _rows(3, 5)
            np.testing.assert_array_equal(_infer(client, "chain", {"in": x})["out"], (x + 1) * 2)
        config = server.http.get_model_config("chain")
        assert config["platform"] == "ensemble" and config["max_batch_size"] == 8
        assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == ["add1", "times2"]
        assert config["ensemble_scheduling"]["max_inflight_requests"] == 4
        assert server.grpc.get_model_config("chain").config.ensemble_scheduling.max_inflight_requests == 4
        assert server.http.get_model_metadata("chain")["platform"] == "ensemble"
        names = [m["name"] for m in server.http.get_inference_statistics("chain")["model_stats"]]
        assert names == ["chain", "chain/add1", "chain/times2"]
        assert server.http.is_model_ready("chain")
        index = {m["name"]: m for m in server.http.get_model_repository_index()}
        assert index["chain"]["state"] == "READY"
        # The same over gRPC's RepositoryModelLoad, replacing it.
        server.grpc.load_model("chain", config=_ensemble("chain", CHAIN))
        assert "max_inflight_requests" not in server.http.get_model_config("chain")["ensemble_scheduling"]
        x = _rows(2, 6)
        np.testing.assert_array_equal(_infer(server.grpc, "chain", {"in": x})["out"], (x + 1) * 2)
    finally:
        server.http.unload_model("chain")


@pytest.mark.parametrize(
    ("steps", "dtype", "message"),
    [
        ([CHAIN[1]], "TYPE_FP32", "tensor 'mid'"),  # times2 reads 'mid', which nothing makes
        (CHAIN, "TYPE_INT32", "'in'"),  # the ensemble's int32 'in' into add1's float32 'x'
        (
            [{"model_name": "nowhere", "input_map": {"x": "in"}, "output_map": {"y": "out"}}],
            "TYPE_FP32",
            "model 'nowhere'",
        ),
        (
            [
                {**CHAIN[0], "input_map": {"x": "back"}},
                CHAIN[1],
                {"model_name": "add1", "input_map": {"x": "out"}, "output_map": {"y": "back"}},
            ],
            "TYPE_FP32",
            "->",
        ),
    ],
    ids=["unfed-input", "dtype", "unknown-model", "cycle"],
)
def test_a_wiring_error_is_refused_naming_the_tensor(server: Server, steps: Any, dtype: str, message: str) -> None:
    for client in (server.http, server.grpc):
        with pytest.raises(InferenceServerException) as info:
            client.load_model("miswired", config=_ensemble("miswired", steps, dtype=dtype))
        text = str(info.value)
        assert message in text and "failed to load model 'miswired'" in text, text
        if client is server.grpc:
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        else:
            assert info.value.status() == "400"
    assert not server.http.is_model_ready("miswired")


def test_reloading_a_composing_model_rebuilds_the_ensemble_and_unloading_it_is_refused(server: Server) -> None:
    server.http.load_model("chained", config=_ensemble("chained", CHAIN))
    try:
        before = server.engine.get("chained").model
        old_step = server.engine.get("add1").model
        server.http.load_model("add1")  # a reload: a new model, the old one closed
        after = server.engine.get("chained").model
        assert after is not before and after.steps["add1"] is server.engine.get("add1").model  # type: ignore[attr-defined]
        assert after.steps["add1"] is not old_step  # type: ignore[attr-defined]
        x = _rows(2, 9)
        np.testing.assert_array_equal(_infer(server.http, "chained", {"in": x})["out"], (x + 1) * 2)
        with pytest.raises(InferenceServerException, match="ensemble\\(s\\) 'chained' use it as a step"):
            server.http.unload_model("times2")
        assert server.http.is_model_ready("times2")
        # A load without a config rebuilds the ensemble from its configuration.
        server.http.load_model("chained")
        np.testing.assert_array_equal(_infer(server.grpc, "chained", {"in": x})["out"], (x + 1) * 2)
    finally:
        server.http.unload_model("chained")
    server.http.unload_model("times2")  # no ensemble uses it now
    server.http.load_model("times2")
    assert server.http.is_model_ready("times2")


def test_a_pipeline_packages_load_config_may_repeat_its_steps(server: Server) -> None:
    same = {"step": [
        {"model_name": "add1", "model_version": -1, "input_map": {"x": "in"}, "output_map": {"y": "mid"}},
        {"model_name": "times2", "model_version": -1, "input_map": {"a": "mid"}, "output_map": {"b": "out"}},
    ]}  # fmt: skip
    server.http.load_model("pipe", config=json.dumps({"platform": "ensemble", "ensemble_scheduling": same}))
    other = {"step": [{**same["step"][0], "model_name": "other"}, same["step"][1]]}
    with pytest.raises(InferenceServerException, match="disagrees with the pipeline package's step 'add1'"):
        server.http.load_model("pipe", config=json.dumps({"platform": "ensemble", "ensemble_scheduling": other}))
    x = _rows(2)
    np.testing.assert_array_equal(_infer(server.http, "pipe", {"in": x})["out"], (x + 1) * 2)


def test_a_composing_model_reloaded_with_another_spec_stops_the_ensemble(server: Server, repository: Path) -> None:
    """The ensemble must not run a closed model: when the new version no longer wires, it stops serving."""
    server.http.load_model("fragile_chain", config=_ensemble("fragile_chain", CHAIN))
    assert server.http.is_model_ready("fragile_chain")
    original = repository / "models" / "times2"
    kept = repository / "times2.kept"
    shutil.move(original, kept)
    try:
        # times2 now takes float64: the ensemble's float32 'mid' no longer fits.
        onnx_package(original, "times2", [helper.make_node("Mul", ["a", "two"], ["b"])],
                     [("a", "float64", ["n", 2])], [("b", "float64", ["n", 2])],
                     [helper.make_tensor("two", TensorProto.DOUBLE, [], [2.0])])  # fmt: skip
        server.http.load_model("times2")
        assert not server.http.is_model_ready("fragile_chain")
        with pytest.raises(InferenceServerException, match="fragile_chain"):
            _infer(server.http, "fragile_chain", {"in": _rows(1)})
    finally:
        shutil.rmtree(original, ignore_errors=True)
        shutil.move(kept, original)
        server.http.load_model("times2")
    x = _rows(2, 3)
    np.testing.assert_array_equal(_infer(server.http, "pipe", {"in": x})["out"], (x + 1) * 2)
    np.testing.assert_array_equal(_infer(server.grpc, "times2", {"a": x}, ("b",))["b"], x * 2)


def test_one_served_model_may_run_several_steps(server: Server) -> None:
    twice = [
        {"model_name": "add1", "input_map": {"x": "in"}, "output_map": {"y": "mid"}},
        {"model_name": "add1", "input_map": {"x": "mid"}, "output_map": {"y": "out"}},
    ]
    server.http.load_model("plus2", config=_ensemble("plus2", twice))
    try:
        x = _rows(2, 8)
        np.testing.assert_array_equal(_infer(server.grpc, "plus2", {"in": x})["out"], x + 2)
        names = [m["name"] for m in server.http.get_inference_statistics("plus2")["model_stats"]]
        assert names == ["plus2", "plus2/add1", "plus2/add1#2"]
        steps = server.http.get_model_config("plus2")["ensemble_scheduling"]["step"]
        assert [s["model_name"] for s in steps] == ["add1", "add1"]
    finally:
        server.http.unload_model("plus2")
