"""A reload that fails leaves the model loaded before serving (as Triton does), and says so.

Each test serves its own copy of a repository over REST and gRPC, reloads a
model whose package on disk was broken since it loaded, and checks what a
client sees: the load answer (400 naming the model and saying the old one
keeps serving), readiness on both protocols, inference results from the old
model, and the repository index's ``reason``; then that a fixed package
reloads and clears the reason.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
httpx = pytest.importorskip("httpx")
httpclient = pytest.importorskip("tritonclient.http")
grpc = pytest.importorskip("grpc")

from tritonclient.utils import InferenceServerException  # noqa: E402

from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb  # noqa: E402
from neuropod_serving.server import Engine, ModelRegistry, create_app  # noqa: E402
from neuropod_serving.server.grpc_server import start_grpc_server  # noqa: E402

from conftest import adder_and_echo, private_caches, python_package, serve_in_thread  # noqa: E402

SLEEPER = """
import time

def get_model(data_root):
    def model(x):
        time.sleep(float(x.flat[0]))
        return {"y": x + 1}
    return model
"""


@pytest.fixture(scope="module")
def packages() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-reload-test-"))
    with private_caches(root):
        adder_and_echo(root / "start", echo_as_zip=False)
        python_package(root / "start" / "sleeper", "sleeper", SLEEPER)
        shutil.rmtree(root / "start" / "sleeper_code")
        yield root
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class Server:
    models: Path
    engine: Engine
    http: Any  # httpx.Client
    triton: Any  # tritonclient.http.InferenceServerClient
    grpc: Any  # grpc.Channel


@pytest.fixture
def server(packages: Path, tmp_path: Path) -> Iterator[Server]:
    models = tmp_path / "models"
    shutil.copytree(packages / "start", models)
    engine = Engine(ModelRegistry.load([models]))
    grpc_server, port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        with serve_in_thread(create_app(engine)) as http_port:
            url = f"127.0.0.1:{http_port}"
            triton = httpclient.InferenceServerClient(url)
            with httpx.Client(base_url=f"http://{url}", timeout=30) as http:
                try:
                    yield Server(models, engine, http, triton, channel)
                finally:
                    triton.close()
    finally:
        channel.close()
        grpc_server.stop(None)
        engine.close()


def _grpc(s: Server, method: str, request: Any, response: Any) -> Any:
    rpc = s.grpc.unary_unary(
        f"/inference.GRPCInferenceService/{method}",
        request_serializer=type(request).SerializeToString,
        response_deserializer=response.FromString,
    )
    return rpc(request, timeout=10)


def _adder_serves(s: Server) -> None:
    """adder answers x + y over REST (tritonclient, binary) and gRPC, and every probe says ready."""
    x = np.array([[1.0, 2.0]], np.float32)
    inputs = [httpclient.InferInput(n, [1, 2], "FP32") for n in "xy"]
    for i in inputs:
        i.set_data_from_numpy(x)
    np.testing.assert_array_equal(s.triton.infer("adder", inputs).as_numpy("out"), x + x)
    request = pb.ModelInferRequest(model_name="adder")
    for n in "xy":
        request.inputs.add(name=n, datatype="FP32", shape=[1, 2])
        request.raw_input_contents.append(x.tobytes())
    reply = _grpc(s, "ModelInfer", request, pb.ModelInferResponse)
    np.testing.assert_array_equal(np.frombuffer(reply.raw_output_contents[0], np.float32), [2.0, 4.0])
    assert s.triton.is_server_ready() and s.triton.is_model_ready("adder")
    assert s.http.get("/v2/models/adder").status_code == 200
    assert _grpc(s, "ServerReady", pb.ServerReadyRequest(), pb.ServerReadyResponse).ready
    assert _grpc(s, "ModelReady", pb.ModelReadyRequest(name="adder"), pb.ModelReadyResponse).ready


def _index_entry(s: Server, name: str) -> dict[str, Any]:
    entries = {e["name"]: e for e in s.triton.get_model_repository_index()}
    return entries[name]


def _garble_config(pkg: Path) -> str:
    (pkg / "config.json").write_text("{this is not json")
    return "config.json"


def _corrupt_model_file(pkg: Path) -> str:
    (pkg / "0" / "data" / "model.onnx").write_bytes(b"not an onnx graph")
    return "model.onnx"


@pytest.mark.parametrize("breaks", [_garble_config, _corrupt_model_file], ids=["config", "model-file"])
def test_failed_reload_keeps_the_old_model_serving(server: Server, breaks: Callable[[Path], str]) -> None:
    adder = server.models / "adder"
    saved = server.models.parent / "adder-saved"
    shutil.copytree(adder, saved)
    before = server.engine.get("adder")
    culprit = breaks(adder)

    with pytest.raises(InferenceServerException) as info:
        server.triton.load_model("adder")
    assert info.value.status() == "400"
    message = info.value.message()
    assert "'adder'" in message and "the model loaded before keeps serving" in message, message
    r = server.http.post("/v2/repository/models/adder/load", json={})
    assert r.status_code == 400 and "keeps serving" in r.json()["error"], r.text

    assert server.engine.get("adder") is before
    _adder_serves(server)
    entry = _index_entry(server, "adder")
    assert entry["state"] == "READY", entry
    reason = entry.get("reason", "")
    assert "the last load failed" in reason and "still serving" in reason, entry
    assert culprit in reason, entry
    # Readiness filter still lists it.
    ready = server.http.post("/v2/repository/index", json={"ready": True}).json()
    assert "adder" in {e["name"] for e in ready}, ready

    # The package fixed, a reload takes: a new model, and the index forgets the failure.
    shutil.rmtree(adder)
    shutil.copytree(saved, adder)
    server.triton.load_model("adder")
    assert server.engine.get("adder") is not before
    _adder_serves(server)
    assert _index_entry(server, "adder")["reason"] == ""  # every entry has one: "" when there is nothing to say


def test_failed_first_load_reason_is_listed(server: Server) -> None:
    """A model that never loaded and fails to: UNAVAILABLE, with why, not just 'not loaded'."""
    server.triton.unload_model("adder")
    _garble_config(server.models / "adder")
    with pytest.raises(InferenceServerException):
        server.triton.load_model("adder")
    entries = server.triton.get_model_repository_index()
    unreadable = [e for e in entries if e["state"] == "UNAVAILABLE" and "config.json" in e.get("reason", "")]
    assert unreadable, entries
    assert server.http.get("/v2/models/adder").status_code == 404


def test_requests_in_flight_finish_on_the_old_model_during_a_reload(server: Server) -> None:
    """A successful reload lets requests already running on the old model answer (no 404 "unloaded")."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [0.5, 1.0]}]}
    answers: list[Any] = []

    def slow_call() -> None:
        with httpx.Client(base_url=str(server.http.base_url), timeout=30) as c:
            answers.append(c.post("/v2/models/sleeper/infer", json=body))

    before = server.engine.get("sleeper")
    thread = threading.Thread(target=slow_call)
    thread.start()
    deadline = time.monotonic() + 10
    while server.engine._runners[("sleeper", "1")].gate.pending == 0:
        assert time.monotonic() < deadline, "the slow call never reached the server"
        time.sleep(0.01)
    server.triton.load_model("sleeper")
    thread.join(30)
    assert server.engine.get("sleeper") is not before
    assert len(answers) == 1 and answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["outputs"][0]["data"] == [1.5, 2.0]
