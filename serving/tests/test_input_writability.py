"""Models get writable input arrays on every path a request can take.

``inplace`` is a Python model that adds 1 to its input in place (``x += 1``)
and returns it: numpy refuses that on a read-only array, which is what
decoding a request as a view of its bytes gives (gRPC, binary REST). The
contract: in process, the caller's own arrays are passed as they are; on
every server path (JSON, binary REST, gRPC, a remote model over grpc:// or
http://, batched alone or together) the model gets writable arrays, read-only
ones copied first.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
httpx = pytest.importorskip("httpx")
httpclient = pytest.importorskip("tritonclient.http")
grpc = pytest.importorskip("grpc")

import neuropod  # noqa: E402
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb  # noqa: E402
from neuropod_serving.server import BatchPolicy, Engine, ModelRegistry, create_app  # noqa: E402
from neuropod_serving.server.grpc_server import start_grpc_server  # noqa: E402
from neuropod_serving.server.metrics import ServerMetrics  # noqa: E402

from conftest import private_caches, python_package, serve_in_thread  # noqa: E402

INPLACE = """
def get_model(data_root):
    def model(x):
        x += 1  # in place: numpy raises 'assignment destination is read-only' on a read-only array
        return {"y": x}
    return model
"""

X = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)


@pytest.fixture(scope="module")
def models() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-writable-test-"))
    with private_caches(root):
        python_package(root / "code" / "inplace", "inplace", INPLACE)
        (root / "models").mkdir()
        shutil.move(root / "code" / "inplace", root / "models" / "inplace")
        yield root / "models"
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class Server:
    engine: Engine
    metrics: ServerMetrics
    http_port: int
    grpc_port: int


@contextmanager
def serving(models: Path, batching: BatchPolicy | None = None) -> Iterator[Server]:
    metrics = ServerMetrics()
    engine = Engine(ModelRegistry.load([models]), batching=batching, metrics=metrics)
    grpc_server, port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
    try:
        with serve_in_thread(create_app(engine)) as http_port:
            yield Server(engine, metrics, http_port, port)
    finally:
        grpc_server.stop(None)
        engine.close()


@pytest.fixture(scope="module")
def server(models: Path) -> Iterator[Server]:
    with private_caches(models.parent), serving(models) as s:
        yield s


def _grpc_infer(port: int, x: np.ndarray) -> np.ndarray:
    request = pb.ModelInferRequest(model_name="inplace")
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())  # raw bytes: the server decodes a read-only view
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        rpc = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        try:
            reply = rpc(request, timeout=30)
        except grpc.RpcError as e:
            pytest.fail(f"gRPC ModelInfer of a model that edits its input failed: {e.code()} {e.details()}")
    return np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(list(reply.outputs[0].shape))


def test_in_process_the_callers_arrays_are_passed_as_they_are(models: Path) -> None:
    x = X.copy()
    with private_caches(models.parent), neuropod.load_neuropod(models / "inplace") as model:
        out = model.infer({"x": x})
    np.testing.assert_array_equal(out["y"], X + 1)
    np.testing.assert_array_equal(x, X + 1)  # the model edited the caller's own array: no copy in process


def test_json(server: Server) -> None:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": X.ravel().tolist()}]}
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/v2/models/inplace/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == (X + 1).ravel().tolist()


def test_binary_rest(server: Server) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        inp = httpclient.InferInput("x", [2, 2], "FP32")
        inp.set_data_from_numpy(X, binary_data=True)
        result = client.infer("inplace", [inp], outputs=[httpclient.InferRequestedOutput("y", binary_data=True)])
    finally:
        client.close()
    np.testing.assert_array_equal(result.as_numpy("y"), X + 1)


def test_grpc(server: Server) -> None:
    np.testing.assert_array_equal(_grpc_infer(server.grpc_port, X), X + 1)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_remote_model(server: Server, protocol: str) -> None:
    port = server.grpc_port if protocol == "grpc" else server.http_port
    x = X.copy()
    with neuropod.load_neuropod(f"{protocol}://127.0.0.1:{port}/inplace") as model:
        out = model.infer({"x": x})
    np.testing.assert_array_equal(out["y"], X + 1)
    np.testing.assert_array_equal(x, X)  # a remote model never edits the caller's array


def _batches(metrics: ServerMetrics) -> tuple[float, float]:
    """(runs, rows) of model inplace in the neuropod_batch_size histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.name == "neuropod_batch_size":
            values = {s.name: s.value for s in family.samples if s.labels.get("model") == "inplace"}
            return values["neuropod_batch_size_count"], values["neuropod_batch_size_sum"]
    raise AssertionError("no neuropod_batch_size metric")


def test_batched_alone_and_together(models: Path) -> None:
    """A request that runs alone is not concatenated (its read-only view would reach the model);
    two that share a batch are. Both over gRPC, whose inputs are read-only views."""
    with private_caches(models.parent), serving(models, BatchPolicy(4, 0.3)) as s:
        np.testing.assert_array_equal(_grpc_infer(s.grpc_port, X), X + 1)
        assert _batches(s.metrics) == (1, 2), "the first request did not run alone"
        results: dict[int, np.ndarray] = {}

        def call(i: int) -> None:
            results[i] = _grpc_infer(s.grpc_port, X[i : i + 1] * 10)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert _batches(s.metrics) == (2, 4), "the two requests did not share one batch"
        for i in range(2):
            np.testing.assert_array_equal(results[i], X[i : i + 1] * 10 + 1)


def test_read_only_inputs_are_copied_writable_ones_are_not() -> None:
    """The server's copy is of read-only arrays only: writable ones go to the model as they are."""
    from neuropod_serving.server.batching import writable

    w = np.zeros(3, np.float32)
    assert writable({"w": w})["w"] is w
    ro = np.frombuffer(b"\x00" * 12, np.float32)
    out = writable({"w": w, "ro": ro})
    assert out["w"] is w and out["ro"].flags.writeable and not np.shares_memory(out["ro"], ro)
    np.testing.assert_array_equal(out["ro"], ro)
