"""A pipeline package served by Ray Serve as one deployment: driven over REST (Ray's HTTP proxy, the
protocol's JSON), gRPC (a remote model through Ray's gRPC proxy) and the deployment's handle; its
steps' statistics in each replica's ``info()`` and in Ray's exported metrics (per step); a decoupled
pipeline streamed through a streaming handle; a pipeline with a stateful step on two replicas, each
sequence's steps routed to the replica holding its state.

One small cluster for the module. The pipeline: ``in`` -> ``scale`` (ONNX, 3 * x) -> ``adder`` (ONNX,
x = scaled, y = in; its ``doubled``) -> ``out`` = 2 * (3 in + in), computed here with numpy.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("onnxruntime")
pytest.importorskip("neuropod_python")  # the decoupled pipeline's first step

from onnx import TensorProto, helper
from ray import serve

import neuropod
from neuropod.errors import SequenceError
from neuropod.packagers import create_pipeline_neuropod
from neuropod_serving import ray as neuropod_ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # serving/tests: the shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_support import by_label, http, replica_infos, scrape, serve_cluster

from streaming_models import repeat_inputs, repeat_package

from conftest import ADDER_IN, ADDER_OUT, free_port_below_ephemeral, onnx_package, private_caches

APP = "scale_then_add"  # the application, named after its model as `neuropod serve --ray` names them
STREAM_APP = "stream"
STATEFUL_APP = "stateful"


@dataclass
class Served:
    root: Path
    http_port: int
    grpc_port: int
    metrics_port: int


def _packages(root: Path) -> tuple[Path, Path, Path]:
    """The two-step pipeline, the decoupled one (repeat, then times10 on each of its responses), and
    the stateful one (scale, then acc: the running sum of its inputs in each sequence)."""
    onnx_package(root / "scale", "scale", [helper.make_node("Mul", ["x", "k"], ["y"])],
                 [("x", "float32", ["n", 2])], [("y", "float32", ["n", 2])],
                 [helper.make_tensor("k", TensorProto.FLOAT, [], [3.0])])  # fmt: skip
    onnx_package(root / "adder", "adder",
                 [helper.make_node("Add", ["x", "y"], ["out"]), helper.make_node("Mul", ["out", "two"], ["doubled"])],
                 ADDER_IN, ADDER_OUT, [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])  # fmt: skip
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    pipe = create_pipeline_neuropod(root / "pipe.neuropod", APP, steps=[
        {"package": str(root / "scale"), "input_map": {"x": "in"}, "output_map": {"y": "scaled"}},
        {"package": str(root / "adder"), "input_map": {"x": "scaled", "y": "in"}, "output_map": {"doubled": "out"}},
    ], input_spec=[{"name": "in", "dtype": "float32", "shape": ["rows", 2]}],
       output_spec=[{"name": "out", "dtype": "float32", "shape": ["rows", 2]}],
       test_input_data={"in": x}, test_expected_out={"out": 2 * (3 * x + x)}, package_as_zip=True)  # fmt: skip
    repeat_package(root / "repeat")
    onnx_package(root / "times10", "times10", [helper.make_node("Mul", ["v", "ten"], ["w"])],
                 [("v", "int32", [1])], [("w", "int32", [1])], [helper.make_tensor("ten", TensorProto.INT32, [], [10])])  # fmt: skip
    stream = create_pipeline_neuropod(root / "stream", STREAM_APP, steps=[
        {"package": str(root / "repeat"), "input_map": {"IN": "IN", "DELAY": "DELAY", "WAIT": "WAIT"},
         "output_map": {"OUT": "value", "IDX": "IDX"}},
        {"package": str(root / "times10"), "input_map": {"v": "value"}, "output_map": {"w": "OUT10"}},
    ], input_spec=[{"name": "IN", "dtype": "int32", "shape": ["n"]}, {"name": "DELAY", "dtype": "uint32", "shape": ["n"]},
                   {"name": "WAIT", "dtype": "uint32", "shape": [1]}],
       output_spec=[{"name": "OUT10", "dtype": "int32", "shape": [1]}, {"name": "IDX", "dtype": "uint32", "shape": [1]}])  # fmt: skip
    onnx_package(root / "acc", "acc",
                 [helper.make_node("Add", ["x", "acc_in"], ["y"]), helper.make_node("Identity", ["y"], ["acc_out"])],
                 [("x", "float32", ["batch", 2]), ("acc_in", "float32", ["batch", 2])],
                 [("y", "float32", ["batch", 2]), ("acc_out", "float32", ["batch", 2])],
                 state_spec=[{"input_name": "acc_in", "output_name": "acc_out"}])  # fmt: skip
    stateful = create_pipeline_neuropod(root / "stateful", STATEFUL_APP, steps=[
        {"package": str(root / "scale"), "input_map": {"x": "in"}, "output_map": {"y": "scaled"}},
        {"package": str(root / "acc"), "input_map": {"x": "scaled"}, "output_map": {"y": "total"}},
    ], input_spec=[{"name": "in", "dtype": "float32", "shape": ["rows", 2]}],
       output_spec=[{"name": "total", "dtype": "float32", "shape": ["rows", 2]}])  # fmt: skip
    return pipe, stream, stateful


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-ray-pipeline-"))
    with private_caches(root):  # before ray.init: Ray's workers inherit the environment
        pipe, stream, stateful = _packages(root)
        ports = Served(root, free_port_below_ephemeral(), free_port_below_ephemeral(), free_port_below_ephemeral())
        try:
            with serve_cluster(
                ports.http_port, ports.grpc_port, num_cpus=2, _metrics_export_port=ports.metrics_port,
                _system_config={"metrics_report_interval_ms": 1000},
            ):  # fmt: skip
                serve.run(neuropod_ray.build(pipe, ray_actor_options={"num_cpus": 0.5}), name=APP, route_prefix="/")
                serve.run(neuropod_ray.build(stream, ray_actor_options={"num_cpus": 0.5}), name=STREAM_APP,
                          route_prefix=f"/v2/models/{STREAM_APP}")  # fmt: skip
                ref = neuropod_ray.publish(stateful)
                assert ref.stateful, "a pipeline with a stateful step is stateful: its sequences need routing"
                serve.run(neuropod_ray.build(ref, num_replicas=2, ray_actor_options={"num_cpus": 0.25},
                                             max_sequence_idle_us=60_000_000),
                          name=STATEFUL_APP, route_prefix=f"/v2/models/{STATEFUL_APP}")  # fmt: skip
                yield ports
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _expected(x: np.ndarray) -> np.ndarray:
    return 2 * (3 * x + x)


def test_one_deployment_serves_the_pipeline_over_rest_grpc_and_its_handle(served: Served) -> None:
    (before,) = replica_infos(APP, 1).values()
    assert before["model"] == APP and before["backend"].startswith("pipeline==")
    assert set(before["steps"]) == {"scale", "adder"}
    rng = np.random.default_rng(0)
    calls = 0
    # REST, the protocol's JSON as any client sends it.
    for rows in (1, 3):
        x = rng.standard_normal((rows, 2)).astype(np.float32)
        body = json.dumps({"inputs": [{"name": "in", "datatype": "FP32", "shape": [rows, 2],
                                       "data": x.ravel().tolist()}]}).encode()  # fmt: skip
        status, reply = http(f"http://127.0.0.1:{served.http_port}/v2/models/{APP}/infer", body)
        assert status == 200, reply
        (out,) = json.loads(reply)["outputs"]
        assert out["name"] == "out" and out["shape"] == [rows, 2]
        np.testing.assert_allclose(np.array(out["data"], np.float32).reshape(rows, 2), _expected(x), rtol=1e-6)
        calls += 1
    # gRPC through Ray's proxy, read by a remote model with the pipeline's spec.
    with neuropod.load_neuropod(f"grpc://127.0.0.1:{served.grpc_port}/{APP}") as remote:
        assert [(s.name, s.shape) for s in remote.inputs] == [("in", ("rows", 2))]
        for rows in (2, 5):
            x = rng.standard_normal((rows, 2)).astype(np.float32)
            np.testing.assert_allclose(remote.infer({"in": x})["out"], _expected(x), rtol=1e-6)
            calls += 1
    # The deployment's handle, numpy in and out.
    handle = serve.get_app_handle(APP)
    x = rng.standard_normal((4, 2)).astype(np.float32)
    np.testing.assert_allclose(handle.infer.remote({"in": x}).result(timeout_s=30)["out"], _expected(x), rtol=1e-6)
    calls += 1

    (after,) = replica_infos(APP, 1).values()
    assert after["replica"] == before["replica"]
    for step in ("scale", "adder"):
        assert after["steps"][step]["count"] - before["steps"][step]["count"] == calls
        assert after["steps"][step]["failures"] == 0 and after["steps"][step]["ns"] > before["steps"][step]["ns"]


def test_each_steps_runs_are_exported_with_a_step_tag(served: Served) -> None:
    handle = serve.get_app_handle(APP)
    x = np.ones((2, 2), np.float32)
    for _ in range(3):
        np.testing.assert_allclose(handle.infer.remote({"in": x}).result(timeout_s=30)["out"], _expected(x))
    (info,) = replica_infos(APP, 1).values()
    runs = {step: float(s["count"]) for step, s in info["steps"].items()}
    deadline = time.monotonic() + 30
    while True:
        samples = scrape(served.metrics_port)
        exported = by_label(samples.get("ray_neuropod_pipeline_step_runs_total", []), "step",
                            model=APP, application=APP, replica=info["replica"])  # fmt: skip
        if exported == runs:
            break
        assert time.monotonic() < deadline, f"Ray's export did not show the steps' runs {runs} within 30 s: {exported}"
        time.sleep(0.5)
    seconds = by_label(samples["ray_neuropod_pipeline_step_seconds_total"], "step", model=APP, application=APP)
    assert set(seconds) == {"scale", "adder"} and all(v > 0 for v in seconds.values())


def test_a_decoupled_pipeline_streams_through_a_streaming_handle(served: Served) -> None:
    handle = serve.get_app_handle(STREAM_APP).options(stream=True)
    values = [5, 0, 9]
    seen = [(r["OUT10"].tolist(), r["IDX"].tolist()) for r in handle.infer_stream.remote(repeat_inputs(values))]
    assert seen == [([10 * v], [i]) for i, v in enumerate(values)]


def test_a_pipeline_with_a_stateful_step_routes_each_sequence_to_its_replica(served: Served) -> None:
    infos = replica_infos(STATEFUL_APP, 2)
    assert len({i["pid"] for i in infos.values()}) == 2
    handle = serve.get_app_handle(STATEFUL_APP)
    rng = np.random.default_rng(3)
    steps = {f"user-{i}": rng.standard_normal((4, 1, 2)).astype(np.float32) for i in range(6)}
    totals: dict[str, list[np.ndarray]] = {seq: [] for seq in steps}
    for k in range(4):  # the sequences' k-th steps all at once: the replicas' queues differ
        calls = {seq: handle.infer.remote({"in": xs[k]}, sequence_id=seq, sequence_start=k == 0, sequence_end=k == 3)
                 for seq, xs in steps.items()}  # fmt: skip
        for seq, call in calls.items():
            totals[seq].append(call.result(timeout_s=60)["total"])
    for seq, xs in steps.items():
        np.testing.assert_allclose(np.concatenate(totals[seq]), np.cumsum(3 * xs, axis=0)[:, 0], rtol=1e-5)
    held = {seq for info in replica_infos(STATEFUL_APP, 2).values() for seq in info["sequences"]}
    assert not held  # every sequence ended


def test_a_failing_step_is_counted_and_exported(served: Served) -> None:
    """A step of a sequence that was never started fails in step ``acc``: REST 400 naming the step, a
    handle call its SequenceError; the replicas export both failures."""
    body = json.dumps({"parameters": {"sequence_id": "ghost"},
                       "inputs": [{"name": "in", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}).encode()  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{served.http_port}/v2/models/{STATEFUL_APP}/infer", body,
        {"Content-Type": "application/json", "Neuropod-Sequence": '["ghost", false, false]'},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 400
    assert "step 'acc'" in json.loads(e.value.read())["error"]
    handle = serve.get_app_handle(STATEFUL_APP)
    with pytest.raises(SequenceError, match="step 'acc'"):
        handle.infer.remote({"in": np.ones((1, 2), np.float32)}, sequence_id="ghost").result(timeout_s=30)
    deadline = time.monotonic() + 30
    while True:
        samples = scrape(served.metrics_port)
        failures = by_label(samples.get("ray_neuropod_pipeline_step_failures_total", []), "step",
                            model=STATEFUL_APP, application=STATEFUL_APP)  # fmt: skip
        if failures.get("acc", 0) >= 2:  # REST's and the handle's
            break
        assert time.monotonic() < deadline, f"the step's failure was not exported within 30 s: {failures}"
        time.sleep(0.5)
    assert "scale" not in failures  # the step before it ran
