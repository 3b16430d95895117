"""Triton's gRPC repository RPCs and ModelStreamInfer against the real gRPC server, driven by tritonclient.grpc.

The server is :func:`start_grpc_server` on 127.0.0.1 over a fresh copy of a
repository (adder, echo) per test. tritonclient.grpc runs in this process: our
``inference.*`` messages live in private descriptor pools, so its own copies
of the same messages import beside them. Expected values are computed with numpy.
"""

from __future__ import annotations

import contextlib
import json
import queue
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
grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")

from onnx import helper  # noqa: E402
from tritonclient.grpc import service_pb2 as triton_pb  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from neuropod_serving.defaults import DEFAULT_MAX_GRPC_STREAMS  # noqa: E402
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb  # noqa: E402
from neuropod_serving.protocol._grpc import triton_repository_pb2 as rpb  # noqa: E402
from neuropod_serving.server import Engine, ModelRegistry, repository_api  # noqa: E402
from neuropod_serving.server.grpc_repository import (  # noqa: E402
    _INFER_RESPONSE_TAG,
    stream_error,
    stream_response,
)
from neuropod_serving.server.grpc_server import start_grpc_server  # noqa: E402
from neuropod_serving.server.grpc_service import SERVICE  # noqa: E402
from neuropod_serving.server.metrics import ServerMetrics  # noqa: E402

from conftest import ADDER_IN, ADDER_OUT, adder_and_echo, onnx_package, private_caches  # noqa: E402

TOKEN = "rep0-t0ken"


@pytest.fixture(scope="module")
def packages() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-grpc-repository-"))
    with private_caches(root):
        adder_and_echo(root / "start", echo_as_zip=True)
        with pytest.warns(UserWarning, match="not checked by loading it"):
            onnx_package(root / "needs_future_ort", "needs_future_ort", [helper.make_node("Identity", ["x"], ["out"])],
                         ADDER_IN[:1], ADDER_OUT[:1], platform_version_semver=">=99")  # fmt: skip
        yield root
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class Server:
    models: Path
    engine: Engine
    metrics: ServerMetrics
    address: str
    triton: Any  # tritonclient.grpc.InferenceServerClient
    grpc_server: Any  # GrpcServer (stopping it twice is harmless)


@pytest.fixture
def server(packages: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    """Indirect parameters are options of start_grpc_server."""
    options = dict(getattr(request, "param", {}))
    models = tmp_path / "models"
    shutil.copytree(packages / "start", models)
    metrics = ServerMetrics()
    engine = Engine(ModelRegistry.load([models]), metrics=metrics)
    grpc_server, port = start_grpc_server(engine, "127.0.0.1:0", access_log=False, **options)
    address = f"127.0.0.1:{port}"
    triton = grpcclient.InferenceServerClient(address)
    try:
        yield Server(models, engine, metrics, address, triton, grpc_server)
    finally:
        triton.close()
        grpc_server.stop(None)
        engine.close()


def _adder_inputs(rows: int, seed: int, datatype: str = "FP32") -> tuple[list[Any], np.ndarray]:
    rng = np.random.default_rng(seed)
    dtype = np.float32 if datatype == "FP32" else np.float64
    x, y = rng.standard_normal((rows, 2)).astype(dtype), rng.standard_normal((rows, 2)).astype(dtype)
    inputs = [grpcclient.InferInput(n, [rows, 2], datatype) for n in "xy"]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(y)
    return inputs, x + y


def _adder_ok(s: Server, rows: int = 2, seed: int = 0) -> None:
    inputs, expected = _adder_inputs(rows, seed)
    result = s.triton.infer("adder", inputs)
    np.testing.assert_allclose(result.as_numpy("out"), expected, rtol=1e-6)


def _index(s: Server, ready: bool = False) -> dict[str, Any]:
    response = s.triton.get_model_repository_index()
    if ready:
        response = s.triton._client_stub.RepositoryIndex(triton_pb.RepositoryIndexRequest(ready=True))
    return {m.name: m for m in response.models}


# -- wire compatibility ----------------------------------------------------------------------------


def test_messages_are_wire_compatible_with_tritonclients() -> None:
    """Our messages, serialized, parse as tritonclient's own classes, and the other way round."""
    ours = rpb.RepositoryIndexResponse(models=[
        rpb.RepositoryIndexResponse.ModelIndex(name="a", version="1", state="READY", reason=""),
        rpb.RepositoryIndexResponse.ModelIndex(name="b", version="1", state="UNAVAILABLE", reason="not loaded"),
    ])  # fmt: skip
    theirs = triton_pb.RepositoryIndexResponse.FromString(ours.SerializeToString())
    assert [(m.name, m.version, m.state, m.reason) for m in theirs.models] == [
        ("a", "1", "READY", ""), ("b", "1", "UNAVAILABLE", "not loaded"),
    ]  # fmt: skip
    assert rpb.RepositoryIndexResponse.FromString(theirs.SerializeToString()) == ours

    load = triton_pb.RepositoryModelLoadRequest(repository_name="", model_name="adder")
    load.parameters["config"].string_param = '{"max_batch_size": 4}'
    load.parameters["file:1/model.onnx"].bytes_param = b"\x00\x01"
    load.parameters["flag"].bool_param = True
    load.parameters["n"].int64_param = -5
    parsed = rpb.RepositoryModelLoadRequest.FromString(load.SerializeToString())
    assert parsed.model_name == "adder"
    assert {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in parsed.parameters.items()} == {
        "config": '{"max_batch_size": 4}', "file:1/model.onnx": b"\x00\x01", "flag": True, "n": -5,
    }  # fmt: skip
    assert triton_pb.RepositoryModelLoadRequest.FromString(parsed.SerializeToString()) == load
    for name in ("RepositoryIndexRequest", "RepositoryModelUnloadRequest", "RepositoryModelLoadResponse",
                 "RepositoryModelUnloadResponse"):  # fmt: skip
        ours_d = getattr(rpb, name).DESCRIPTOR
        theirs_d = getattr(triton_pb, name).DESCRIPTOR
        assert [(f.name, f.number, f.type) for f in ours_d.fields] == [
            (f.name, f.number, f.type) for f in theirs_d.fields
        ]

    # ModelStreamInferResponse: infer_response is bytes here, a message there; the same on the wire.
    answer = pb.ModelInferResponse(model_name="adder", model_version="1", id="7")
    answer.outputs.add(name="out", datatype="FP32", shape=[1, 2])
    answer.raw_output_contents.append(np.array([1.5, -2.0], np.float32).tobytes())
    theirs_stream = triton_pb.ModelStreamInferResponse.FromString(stream_response(answer.SerializeToString()))
    assert theirs_stream.error_message == ""
    assert theirs_stream.infer_response.id == "7" and theirs_stream.infer_response.outputs[0].name == "out"
    assert theirs_stream.infer_response.raw_output_contents[0] == answer.raw_output_contents[0]
    field = triton_pb.ModelStreamInferResponse.DESCRIPTOR.fields_by_name["infer_response"]
    assert bytes([field.number << 3 | 2]) == _INFER_RESPONSE_TAG
    request = pb.ModelInferRequest(model_name="echo", model_version="1", id="req-9")
    failed = triton_pb.ModelStreamInferResponse.FromString(stream_error("it broke", request.SerializeToString()))
    assert failed.error_message == "it broke"
    assert (failed.infer_response.model_name, failed.infer_response.id) == ("echo", "req-9")


# -- the repository ----------------------------------------------------------------------------------


def test_index_lists_every_entry_with_a_reason(server: Server) -> None:
    server.triton.unload_model("echo")
    index = _index(server)
    assert {n: (m.version, m.state) for n, m in index.items()} == {
        "adder": ("1", "READY"),
        "echo": ("1", "UNAVAILABLE"),
    }
    assert index["adder"].reason == "" and index["echo"].reason == "not loaded"
    # The same entries as the REST route's (one function answers both).
    assert [(e.name, e.state, e.reason) for e in repository_api.index(server.engine)] == [
        (m.name, m.state, m.reason) for m in index.values()
    ]
    assert list(_index(server, ready=True)) == ["adder"]
    extensions = server.triton.get_server_metadata().extensions
    assert "model_repository" in extensions


def test_unload_and_load(server: Server) -> None:
    _adder_ok(server)
    server.triton.unload_model("adder")
    assert server.triton.is_model_ready("adder") is False  # not loaded: not ready (as Triton), not an error
    with pytest.raises(InferenceServerException) as info:
        _adder_ok(server)
    assert info.value.status() == "StatusCode.NOT_FOUND" and "'adder'" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        server.triton.unload_model("adder")  # not loaded
    assert info.value.status() == "StatusCode.NOT_FOUND" and "'adder'" in info.value.message()
    server.triton.load_model("adder")
    assert server.triton.is_model_ready("adder")
    for rows in (1, 3):
        _adder_ok(server, rows, seed=rows)
    server.triton.unload_model("echo", unload_dependents=True)  # Triton's parameter: nothing depends on echo
    assert _index(server)["echo"].state == "UNAVAILABLE"


def test_load_failures(server: Server, packages: Path) -> None:
    with pytest.raises(InferenceServerException) as info:
        server.triton.load_model("no_such_model")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "'no_such_model'" in info.value.message() and str(server.models) in info.value.message()
    assert info.value.message().startswith("failed to load model 'no_such_model': ")

    shutil.copytree(packages / "needs_future_ort", server.models / "needs_future_ort")
    with pytest.raises(InferenceServerException) as info:
        server.triton.load_model("needs_future_ort")
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    message = info.value.message()
    assert "failed to load model 'needs_future_ort'" in message and ">=99" in message, message
    entry = _index(server)["needs_future_ort"]
    assert entry.state == "UNAVAILABLE" and ">=99" in entry.reason

    with pytest.raises(InferenceServerException) as info:
        server.triton.load_model("adder", files={"file:1/model.onnx": b"\x00"}, config="{}")
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "file:1/model.onnx" in info.value.message()
    stub = server.triton._client_stub
    for call in (
        lambda: stub.RepositoryIndex(triton_pb.RepositoryIndexRequest(repository_name="elsewhere")),
        lambda: stub.RepositoryModelLoad(triton_pb.RepositoryModelLoadRequest(repository_name="elsewhere", model_name="adder")),
        lambda: stub.RepositoryModelLoad(triton_pb.RepositoryModelLoadRequest(model_name="adder", parameters={"config": triton_pb.ModelRepositoryParameter()})),
    ):  # fmt: skip
        with pytest.raises(grpc.RpcError) as rpc:
            call()
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "repository_name" in rpc.value.details() or "no value" in rpc.value.details(), rpc.value.details()
    # A body that is no message at all.
    with grpc.insecure_channel(server.address) as channel:
        raw = channel.unary_unary(f"/{SERVICE}/RepositoryModelLoad")
        with pytest.raises(grpc.RpcError) as rpc:
            raw(b"\xff\xff\xff")
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "RepositoryModelLoad" in rpc.value.details()
    _adder_ok(server)  # still served


@pytest.mark.parametrize("server", [{"auth_token": TOKEN}], indirect=True, ids=["token"])
def test_repository_and_streams_need_the_token(server: Server) -> None:
    with pytest.raises(InferenceServerException) as info:
        server.triton.get_model_repository_index()
    assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as info:
        server.triton.unload_model("adder")
    assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    assert server.triton.is_model_ready("adder", headers={"authorization": f"Bearer {TOKEN}"})
    headers = {"authorization": f"Bearer {TOKEN}"}
    assert {m.name for m in server.triton.get_model_repository_index(headers=headers).models} == {"adder", "echo"}
    errors: queue.Queue[Any] = queue.Queue()
    server.triton.start_stream(callback=lambda result, error: errors.put(error))
    try:
        inputs, _ = _adder_inputs(1, 0)
        with contextlib.suppress(InferenceServerException):  # the stream may be refused before this is sent
            server.triton.async_stream_infer("adder", inputs)
        error = errors.get(timeout=30)
    finally:
        server.triton.stop_stream()
    assert error is not None and "UNAUTHENTICATED" in str(error.status()), error


# -- ModelStreamInfer --------------------------------------------------------------------------------


def _stream(s: Server, sends: list[tuple[str, list[Any], str]]) -> dict[str, tuple[Any, Any]]:
    """Send ``(model, inputs, request id)`` on one stream; (result, error) by request id."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    s.triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for model, inputs, request_id in sends:
            s.triton.async_stream_infer(model, inputs, request_id=request_id)
        got = [answers.get(timeout=60) for _ in sends]
    finally:
        s.triton.stop_stream()
    by_id: dict[str, tuple[Any, Any]] = {}
    for result, error in got:
        request_id = result.get_response().id if result is not None else f"error-{len(by_id)}"
        by_id[request_id] = (result, error)
    return by_id


def test_stream_answers_every_request_and_goes_on_after_a_bad_one(server: Server) -> None:
    sends: list[tuple[str, list[Any], str]] = []
    expected: dict[str, np.ndarray] = {}
    for i in range(40):
        if i == 17:
            inputs, _ = _adder_inputs(2, i, datatype="FP64")  # the spec says float32
        elif i == 29:
            inputs, _ = _adder_inputs(2, i)
            sends.append(("no_such_model", inputs, str(i)))
            continue
        else:
            inputs, expected[str(i)] = _adder_inputs(1 + i % 3, i)
        sends.append(("adder", inputs, str(i)))
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    server.triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for model, inputs, request_id in sends:
            server.triton.async_stream_infer(model, inputs, request_id=request_id)
        got = [answers.get(timeout=60) for _ in sends]
    finally:
        server.triton.stop_stream()
    results = {r.get_response().id: r for r, e in got if e is None}
    errors = [e.message() for r, e in got if e is not None]
    assert sorted(results, key=int) == sorted(expected, key=int)
    for request_id, want in expected.items():
        np.testing.assert_allclose(results[request_id].as_numpy("out"), want, rtol=1e-6)
        np.testing.assert_allclose(results[request_id].as_numpy("doubled"), want * 2, rtol=1e-6)
    assert len(errors) == 2, errors
    assert any("'x'" in e and "FP64" in e for e in errors), errors
    assert any("'no_such_model'" in e for e in errors), errors
    # Counted as the unary calls are, as gRPC requests.
    assert (
        server.metrics.registry.get_sample_value("neuropod_requests_total", {"model": "adder", "protocol": "grpc"})
        == len(expected) + 1
    )
    _adder_ok(server)


def test_stream_of_strings(server: Server) -> None:
    n = np.array([3, -4, 9], dtype=np.int64)
    s = np.array(["ünïcode", "", "a b"], dtype=object)
    inputs = [grpcclient.InferInput("n", [3], "INT64"), grpcclient.InferInput("s", [3], "BYTES")]
    inputs[0].set_data_from_numpy(n)
    inputs[1].set_data_from_numpy(np.array([v.encode() for v in s], dtype=object))
    answers = _stream(server, [("echo", inputs, "a"), ("echo", inputs, "b")])
    for request_id in ("a", "b"):
        result, error = answers[request_id]
        assert error is None
        np.testing.assert_array_equal(result.as_numpy("n1"), n + 1)
        assert [v.decode() for v in result.as_numpy("s_out")] == list(s)


@pytest.mark.parametrize("server", [{"max_streams": 2}], indirect=True, ids=["2-streams"])
def test_open_streams_are_bounded_and_never_starve_unary_calls(server: Server) -> None:
    """Two streams open (the limit): a third is refused at once with RESOURCE_EXHAUSTED naming the
    flag; unary calls keep answering; once a stream closes, a new one opens."""
    method = f"/{SERVICE}/ModelStreamInfer"
    channel = grpc.insecure_channel(server.address)
    stop = threading.Event()
    request = pb.ModelInferRequest(model_name="echo", id="held")
    t = request.inputs.add(name="n", datatype="INT64", shape=[1])
    t.contents.int64_contents.append(1)
    t = request.inputs.add(name="s", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(b"x")
    data = request.SerializeToString()

    def held() -> Iterator[bytes]:
        yield data
        stop.wait(60)

    try:
        calls = [channel.stream_stream(method)(held()) for _ in range(2)]
        for call in calls:  # each stream answered its first request: both are open on the server
            assert triton_pb.ModelStreamInferResponse.FromString(next(call)).infer_response.id == "held"
        third = channel.stream_stream(method)(iter([data]))
        with pytest.raises(grpc.RpcError) as info:
            next(third)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-grpc-streams" in info.value.details()
        started = time.monotonic()
        for _ in range(5):
            _adder_ok(server)
        assert server.triton.is_server_ready() and time.monotonic() - started < 10
        calls[0].cancel()
        deadline = time.monotonic() + 10
        while True:  # the server gives the slot back when it sees the cancellation
            again = channel.stream_stream(method)(iter([data]))
            try:
                assert triton_pb.ModelStreamInferResponse.FromString(next(again)).infer_response.id == "held"
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        stop.set()
        channel.close()


def test_many_idle_streams_leave_unary_calls_a_thread(server: Server) -> None:
    """More open streams than the pool's base threads: health and inference still answer promptly."""
    method = f"/{SERVICE}/ModelStreamInfer"
    channel = grpc.insecure_channel(server.address)
    stop = threading.Event()

    def idle() -> Iterator[bytes]:
        stop.wait(60)
        yield from ()

    try:
        calls = [channel.stream_stream(method)(idle()) for _ in range(24)]
        time.sleep(0.5)  # the server has taken the streams (each holds a thread)
        started = time.monotonic()
        assert server.triton.is_server_live()
        _adder_ok(server)
        assert time.monotonic() - started < 5
        assert DEFAULT_MAX_GRPC_STREAMS >= 24
        for call in calls:
            call.cancel()
    finally:
        stop.set()
        channel.close()


def test_cli_default_is_the_servers() -> None:
    """`neuropod serve --max-grpc-streams` defaults to the server's own default."""
    import argparse

    from neuropod_serving.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["."]).max_grpc_streams == DEFAULT_MAX_GRPC_STREAMS


def test_stream_config_load_round_trip(server: Server) -> None:
    """A load with a config over gRPC, then the stream on the reloaded model."""
    server.triton.load_model("adder", config=json.dumps({"max_batch_size": 4}))
    inputs, expected = _adder_inputs(2, 5)
    answers = _stream(server, [("adder", inputs, "after-reload")])
    result, error = answers["after-reload"]
    assert error is None
    np.testing.assert_allclose(result.as_numpy("out"), expected, rtol=1e-6)


# -- health, in process --------------------------------------------------------------------------------


@pytest.mark.parametrize("server", [{"max_streams": 1}], indirect=True, ids=["1-stream"])
def test_health_watch_counts_as_a_stream_and_sees_the_server_stop(server: Server) -> None:
    health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
    health_pb2_grpc = pytest.importorskip("grpc_health.v1.health_pb2_grpc")
    channel = grpc.insecure_channel(server.address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        # The one stream allowed is the Watch: a ModelStreamInfer is refused, a second Watch too.
        refused = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")(iter([b""]))
        with pytest.raises(grpc.RpcError) as info:
            next(refused)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as info:
            next(stub.Watch(health_pb2.HealthCheckRequest(service="adder")))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (
            stub.Check(health_pb2.HealthCheckRequest(service="adder")).status == health_pb2.HealthCheckResponse.SERVING
        )
        # Unloading through the engine (any protocol) is seen by Check.
        server.engine.unload("echo")
        assert (
            stub.Check(health_pb2.HealthCheckRequest(service="echo")).status
            == health_pb2.HealthCheckResponse.NOT_SERVING
        )
        watch.cancel()
        deadline = time.monotonic() + 10
        while True:  # the slot comes back once the server sees the cancellation
            again = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                assert next(again).status == health_pb2.HealthCheckResponse.SERVING
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.05)
        answers: queue.Queue[int] = queue.Queue()

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):
                for response in again:
                    answers.put(int(response.status))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        # Stopping the server tells watchers first: NOT_SERVING, then the stream ends.
        server.grpc_server.stop(2)
        assert answers.get(timeout=10) == health_pb2.HealthCheckResponse.NOT_SERVING
        reader.join(10)
        assert not server.engine.listeners  # the stopped server follows the engine no more
    finally:
        channel.close()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_grpc_message_compression(server: Server, algorithm: str) -> None:
    """tritonclient.grpc's compression_algorithm is gRPC's own message compression, which grpcio reads."""
    inputs, expected = _adder_inputs(64, 3)
    result = server.triton.infer("adder", inputs, compression_algorithm=algorithm)
    np.testing.assert_allclose(result.as_numpy("out"), expected, rtol=1e-6)


def test_stream_survives_bytes_that_are_no_request(server: Server) -> None:
    """A message that does not parse is answered with its error, and the next request runs."""
    good = pb.ModelInferRequest(model_name="echo", id="good")
    t = good.inputs.add(name="n", datatype="INT64", shape=[2])
    t.contents.int64_contents.extend([4, 5])
    t = good.inputs.add(name="s", datatype="BYTES", shape=[2])
    t.contents.bytes_contents.extend([b"p", b"q"])
    data = good.SerializeToString()
    with grpc.insecure_channel(server.address) as channel:
        stream = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")
        answers = [
            triton_pb.ModelStreamInferResponse.FromString(a) for a in stream(iter([data, b"\xff\xff\xff", data]))
        ]
    assert [a.error_message == "" for a in answers] == [True, False, True]
    assert "ModelInferRequest" in answers[1].error_message or "parse" in answers[1].error_message, answers[1]
    for a in (answers[0], answers[2]):
        assert a.infer_response.id == "good"
        n1 = np.frombuffer(a.infer_response.raw_output_contents[0], np.int64)
        np.testing.assert_array_equal(n1, [5, 6])


def test_pool_grows_for_a_model_loaded_with_more_in_flight(server: Server) -> None:
    """A config that lets one model hold more requests than the server's options (here 64-row batches)
    raises the gRPC pool's thread limit, so that model's waiting calls leave threads for the others."""
    pool = server.grpc_server._pool
    before = pool._max_workers
    server.triton.load_model("adder", config=json.dumps({"max_batch_size": 64}))
    assert server.engine.most_in_flight >= 64
    assert pool._max_workers >= before + 64 - 4  # the model's batch less the default runs at once
    _adder_ok(server, rows=3)
