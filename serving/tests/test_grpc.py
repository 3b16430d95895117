"""The gRPC service against real ONNX models, driven by tritonclient.grpc and by grpc.aio.

The server is the real :func:`start_grpc_server` on 127.0.0.1, on its own threads.
tritonclient.grpc runs in a subprocess (grpc_triton_client.py), as a user's
own process would run it, executing a plan of calls and writing back what
each returned; one plan per server keeps the suite fast. (Our ``inference.*``
messages live in a private protobuf pool, so the two could share a process:
test_remote_untrusted checks that.) The plain grpc.aio client with our own
messages runs in this process. Expected values are computed here with numpy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
grpc = pytest.importorskip("grpc")

from neuropod_serving.protocol import ProtocolError, specs_from_model_metadata  # noqa: E402
from neuropod_serving.protocol import grpc_codec as codec  # noqa: E402
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb  # noqa: E402
from neuropod_serving.server import Engine, ModelRegistry  # noqa: E402
from neuropod_serving.server.grpc_server import start_grpc_server  # noqa: E402
from neuropod_serving.server.grpc_service import SERVICE  # noqa: E402
from neuropod_serving.server.metrics import ServerMetrics  # noqa: E402

from conftest import adder_and_echo, onnx_package, private_caches  # noqa: E402

CLIENT = Path(__file__).with_name("grpc_triton_client.py")
TOKEN = "grpc-t0ken"
LIMIT = 256 * 1024  # max_message_bytes of the small-limit server


def _has_tritonclient_grpc() -> bool:
    # Checked in a subprocess: importing it here would clash with our messages.
    code = "import tritonclient.grpc"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


needs_triton = pytest.mark.skipif(not _has_tritonclient_grpc(), reason="tritonclient[grpc] is not installed")


def _models(models: Path) -> None:
    """adder and echo (conftest), plus ``kinds`` (UINT8 and BOOL) and ``reshaper`` (fails at run time)."""
    from onnx import TensorProto, helper

    adder_and_echo(models, echo_as_zip=True)
    onnx_package(models / "kinds", "kinds",
                 [helper.make_node("BitShift", ["u", "one"], ["u_shifted"], direction="LEFT"),
                  helper.make_node("Not", ["b"], ["b_not"])],
                 [("u", "uint8", ["batch_size"]), ("b", "bool", ["batch_size"])],
                 [("u_shifted", "uint8", ["batch_size"]), ("b_not", "bool", ["batch_size"])],
                 [helper.make_tensor("one", TensorProto.UINT8, [], [1])])  # fmt: skip
    # Any length passes the spec, but onnxruntime can only reshape 3 elements to [3].
    onnx_package(models / "reshaper", "reshaper", [helper.make_node("Reshape", ["x", "three"], ["y"])],
                 [("x", "float32", [None])], [("y", "float32", [3])],
                 [helper.make_tensor("three", TensorProto.INT64, [1], [3])])  # fmt: skip


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="neuropod-grpc-"))
    with private_caches(path):
        _models(path / "models")
        yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(root: Path) -> Iterator[Engine]:
    e = Engine(ModelRegistry.load([root / "models"]), metrics=ServerMetrics())
    try:
        yield e
    finally:
        e.close()


@contextlib.contextmanager
def grpc_in_thread(engine: Engine, **options: Any) -> Iterator[int]:
    """The real gRPC server on 127.0.0.1 (a free port, its own threads); yields the port."""
    server, port = start_grpc_server(engine, "127.0.0.1:0", **options)
    try:
        yield port
    finally:
        server.stop(None)


def run_plan(tmp: Path, port: int, calls: list[dict[str, Any]], arrays: dict[str, np.ndarray] | None = None,
             **connection: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:  # fmt: skip
    """Run ``calls`` with tritonclient.grpc in a subprocess; what each returned, and the output arrays."""
    plan = tmp / "plan.json"
    inputs = tmp / "inputs.npz"
    np.savez(inputs, **(arrays or {}))
    plan.write_text(json.dumps({"url": f"127.0.0.1:{port}", "inputs": str(inputs), "calls": calls, **connection}))
    done = subprocess.run([sys.executable, str(CLIENT), str(plan)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp / "plan.result.json").read_text())
    with np.load(tmp / "plan.npz") as npz:
        outputs = {k: npz[k] for k in npz.files}
    return results, outputs


def _counts(metrics: ServerMetrics, model: str) -> tuple[float, float, float]:
    """gRPC requests, client failures and model failures of ``model`` so far."""

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"model": model, "protocol": "grpc", **labels}) or 0.0

    return (sample("neuropod_requests_total"), sample("neuropod_request_failures_total", reason="client"),
            sample("neuropod_request_failures_total", reason="model"))  # fmt: skip


def _failed(result: dict[str, Any], status: str, *words: str) -> None:
    assert not result["ok"], result
    assert result["status"] == f"StatusCode.{status}", result
    for word in words:
        assert word in result["message"], result


# --- tritonclient.grpc --------------------------------------------------------------


@needs_triton
def test_tritonclient_health_metadata_and_tensors(engine: Engine, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "x": rng.standard_normal((4, 2)).astype(np.float32),
        "y": rng.standard_normal((4, 2)).astype(np.float32),
        "n": np.array([-5, 0, 2**40, 7], dtype=np.int64),
        # BYTES as numpy S (no pickle in .npz): UTF-8 text, an empty element, a NUL inside.
        "s": np.array([b"plain", b"", "h\u00e9 \u2603".encode(), b"a\0b"], dtype="S"),
        "u": np.array([0, 1, 127, 200, 255], dtype=np.uint8),
        "b": np.array([True, False, False, True, True]),
    }  # fmt: skip
    calls = [
        {"id": "live", "call": "is_server_live"},
        {"id": "ready", "call": "is_server_ready"},
        {"id": "model_ready", "call": "is_model_ready", "model": "adder"},
        {"id": "server_md", "call": "get_server_metadata"},
        {"id": "adder_md", "call": "get_model_metadata", "model": "adder"},
        {"id": "echo_md", "call": "get_model_metadata", "model": "echo"},
        {"id": "adder", "call": "infer", "model": "adder", "inputs": [["x", "FP32", "x"], ["y", "FP32", "y"]]},
        {"id": "doubled", "call": "infer", "model": "adder", "inputs": [["x", "FP32", "x"], ["y", "FP32", "y"]],
         "outputs": ["doubled"]},
        {"id": "echo", "call": "infer", "model": "echo", "inputs": [["n", "INT64", "n"], ["s", "BYTES", "s"]]},
        {"id": "kinds", "call": "infer", "model": "kinds", "inputs": [["u", "UINT8", "u"], ["b", "BOOL", "b"]]},
    ]  # fmt: skip
    with grpc_in_thread(engine) as port:
        results, out = run_plan(tmp_path, port, calls, arrays)
    assert all(r["ok"] for r in results.values()), results
    assert [results[k]["value"] for k in ("live", "ready", "model_ready")] == [True, True, True]
    server_md = results["server_md"]["value"]
    # Binary tensors are REST's; the repository RPCs are served (test_grpc_repository.py).
    assert server_md["name"] == "neuropod" and server_md.get("extensions", []) == [
        "classification",
        "model_configuration",
        "model_repository",
        "statistics",
        "sequence",
        "sequence(string_id)",
    ]
    adder_md = results["adder_md"]["value"]
    assert adder_md["name"] == "adder" and adder_md["platform"] == "onnx" and adder_md["versions"] == ["1"]
    # The same tensors as REST's metadata (which also carries the exact shape in parameters).
    rest = engine.get("adder").metadata
    for key in ("inputs", "outputs"):
        assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in adder_md[key]] == [
            (t["name"], t["datatype"], t["shape"]) for t in rest[key]
        ]
    assert [t["datatype"] for t in results["echo_md"]["value"]["inputs"]] == ["INT64", "BYTES"]

    x, y = arrays["x"], arrays["y"]
    assert results["adder"]["value"]["outputs"] == ["out", "doubled"]
    np.testing.assert_allclose(out["adder/out"], x + y, rtol=1e-6)
    np.testing.assert_allclose(out["adder/doubled"], 2 * (x + y), rtol=1e-6)
    assert out["adder/out"].dtype == np.float32
    assert results["doubled"]["value"]["outputs"] == ["doubled"]
    np.testing.assert_allclose(out["doubled/doubled"], 2 * (x + y), rtol=1e-6)
    assert "doubled/out" not in out
    np.testing.assert_array_equal(out["echo/n1"], arrays["n"] + 1)
    assert out["echo/n1"].dtype == np.int64
    assert out["echo/s_out"].tolist() == arrays["s"].tolist()
    np.testing.assert_array_equal(out["kinds/u_shifted"], np.left_shift(arrays["u"], 1))
    assert out["kinds/u_shifted"].dtype == np.uint8
    np.testing.assert_array_equal(out["kinds/b_not"], ~arrays["b"])
    assert out["kinds/b_not"].dtype == np.bool_


@needs_triton
def test_tritonclient_errors_name_the_tensor_and_the_server_keeps_serving(engine: Engine, tmp_path: Path) -> None:
    x = np.ones((2, 2), np.float32)
    arrays = {"x": x, "x3": np.ones((2, 3), np.float32), "x64": x.astype(np.float64), "four": np.arange(4, dtype=np.float32),
              "three": np.arange(3, dtype=np.float32)}  # fmt: skip
    adder = [["x", "FP32", "x"], ["y", "FP32", "x"]]
    calls = [
        {"id": "unknown_model", "call": "infer", "model": "nope", "inputs": adder},
        {"id": "unknown_ready", "call": "is_model_ready", "model": "nope"},
        {"id": "unknown_md", "call": "get_model_metadata", "model": "nope"},
        {"id": "datatype", "call": "infer", "model": "adder", "inputs": [["x", "FP64", "x64"], ["y", "FP32", "x"]]},
        {"id": "shape", "call": "infer", "model": "adder", "inputs": [["x", "FP32", "x3"], ["y", "FP32", "x"]]},
        {"id": "missing", "call": "infer", "model": "adder", "inputs": [["x", "FP32", "x"]]},
        {"id": "unknown_input", "call": "infer", "model": "adder", "inputs": [*adder, ["z", "FP32", "x"]]},
        {"id": "unknown_output", "call": "infer", "model": "adder", "inputs": adder, "outputs": ["nope"]},
        {"id": "model_failure", "call": "infer", "model": "reshaper", "inputs": [["x", "FP32", "four"]]},
        {"id": "after_failure", "call": "infer", "model": "reshaper", "inputs": [["x", "FP32", "three"]]},
        {"id": "adder_after", "call": "infer", "model": "adder", "inputs": adder},
    ]
    metrics = engine.metrics
    assert isinstance(metrics, ServerMetrics)
    before = _counts(metrics, "reshaper")
    with grpc_in_thread(engine) as port:
        results, out = run_plan(tmp_path, port, calls, arrays)
    after = _counts(metrics, "reshaper")
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (2, 0, 1)
    _failed(results["unknown_model"], "NOT_FOUND", "'nope'")
    assert results["unknown_ready"] == {"ok": True, "value": False}  # as Triton: not ready, not an error
    _failed(results["unknown_md"], "NOT_FOUND", "'nope'")
    _failed(results["datatype"], "INVALID_ARGUMENT", "'x'", "FP64", "FP32")
    _failed(results["shape"], "INVALID_ARGUMENT", "'x'")
    _failed(results["missing"], "INVALID_ARGUMENT", "'y'")
    _failed(results["unknown_input"], "INVALID_ARGUMENT", "'z'")
    _failed(results["unknown_output"], "INVALID_ARGUMENT", "'nope'")
    _failed(results["model_failure"], "INTERNAL", "model 'reshaper' failed")
    assert results["after_failure"]["ok"] and results["adder_after"]["ok"], results
    np.testing.assert_array_equal(out["after_failure/y"], arrays["three"])
    np.testing.assert_allclose(out["adder_after/out"], x + x)


@needs_triton
def test_tritonclient_bearer_token(engine: Engine, tmp_path: Path) -> None:
    good = {"authorization": f"Bearer {TOKEN}"}
    bad = {"authorization": "Bearer guess"}
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    adder = [["x", "FP32", "x"], ["y", "FP32", "x"]]
    calls = [
        {"id": "live", "call": "is_server_live"},  # health stays open
        {"id": "ready", "call": "is_server_ready"},
        {"id": "md_none", "call": "get_model_metadata", "model": "adder"},
        {"id": "md_bad", "call": "get_model_metadata", "model": "adder", "headers": bad},
        {"id": "server_md_none", "call": "get_server_metadata"},
        {"id": "ready_none", "call": "is_model_ready", "model": "adder"},
        {"id": "infer_none", "call": "infer", "model": "adder", "inputs": adder},
        {"id": "infer_bad", "call": "infer", "model": "adder", "inputs": adder, "headers": bad},
        {"id": "md_good", "call": "get_model_metadata", "model": "adder", "headers": good},
        {"id": "infer_good", "call": "infer", "model": "adder", "inputs": adder, "headers": good},
    ]
    with grpc_in_thread(engine, auth_token=TOKEN) as port:
        results, out = run_plan(tmp_path, port, calls, {"x": x})
    assert results["live"] == {"ok": True, "value": True} and results["ready"] == {"ok": True, "value": True}
    for key in ("md_none", "server_md_none", "ready_none", "infer_none"):
        _failed(results[key], "UNAUTHENTICATED", "no authorization metadata")
    for key in ("md_bad", "infer_bad"):
        _failed(results[key], "UNAUTHENTICATED", "does not match")
        assert "guess" not in results[key]["message"] and TOKEN not in results[key]["message"]
    assert results["md_good"]["ok"] and results["infer_good"]["ok"], results
    np.testing.assert_allclose(out["infer_good/out"], x + x)


@needs_triton
def test_tritonclient_tls(engine: Engine, tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    calls = [
        {"id": "live", "call": "is_server_live"},
        {"id": "infer", "call": "infer", "model": "adder", "inputs": [["x", "FP32", "x"], ["y", "FP32", "x"]]},
    ]
    with grpc_in_thread(engine, tls=(cert.read_bytes(), key.read_bytes())) as port:
        results, out = run_plan(tmp_path, port, calls, {"x": x}, ssl=True, root_certificates=str(cert))
        plain, _ = run_plan(tmp_path, port, calls[:1])
    assert results["live"] == {"ok": True, "value": True}, results
    np.testing.assert_allclose(out["infer/doubled"], 2 * (x + x))
    # A client without TLS gets no answer from a TLS port.
    _failed(plain["live"], "UNAVAILABLE")


@needs_triton
def test_tritonclient_message_over_the_limit(engine: Engine, tmp_path: Path) -> None:
    big = np.ones((LIMIT // 8 + 1, 2), np.float32)  # x and y together pass LIMIT
    small = np.ones((1, 2), np.float32)
    calls = [
        {"id": "big", "call": "infer", "model": "adder", "inputs": [["x", "FP32", "big"], ["y", "FP32", "big"]]},
        {"id": "small", "call": "infer", "model": "adder", "inputs": [["x", "FP32", "small"], ["y", "FP32", "small"]]},
    ]
    with grpc_in_thread(engine, max_message_bytes=LIMIT) as port:
        results, out = run_plan(tmp_path, port, calls, {"big": big, "small": small})
    _failed(results["big"], "RESOURCE_EXHAUSTED")
    assert results["small"]["ok"], results
    np.testing.assert_allclose(out["small/out"], small + small)


# --- grpc.aio with our own messages -------------------------------------------------


async def _call(channel: Any, method: str, request: Any, response_class: Any) -> tuple[Any, dict[str, Any]]:
    """The reply to one call, and its trailing metadata."""
    rpc = channel.unary_unary(
        f"/{SERVICE}/{method}", request_serializer=type(request).SerializeToString,
        response_deserializer=response_class.FromString,
    )  # fmt: skip
    call = rpc(request)
    reply = await call
    return reply, dict(await call.trailing_metadata() or ())


def test_grpc_aio_client_with_our_messages(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2)).astype(np.float32)
    y = rng.standard_normal((3, 2)).astype(np.float32)
    metrics = engine.metrics
    assert isinstance(metrics, ServerMetrics)

    async def session(port: int) -> dict[str, Any]:
        got: dict[str, Any] = {}
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = codec.build_model_infer_request("adder", {"x": x, "y": y}, outputs=["out"], id="r-1",
                                                      parameters={"a": 1, "b": True, "c": "s", "d": 0.5})  # fmt: skip
            reply, _ = await _call(channel, "ModelInfer", request, pb.ModelInferResponse)
            got["raw"] = codec.parse_model_infer_response(reply)
            # Typed contents (tritonclient never sends them): UINT8 in uint_contents, BOOL in bool_contents.
            typed = pb.ModelInferRequest(model_name="kinds", inputs=[
                pb.ModelInferRequest.InferInputTensor(name="u", datatype="UINT8", shape=[3],
                                                      contents=pb.InferTensorContents(uint_contents=[1, 2, 255])),
                pb.ModelInferRequest.InferInputTensor(name="b", datatype="BOOL", shape=[3],
                                                      contents=pb.InferTensorContents(bool_contents=[True, False, True])),
            ])  # fmt: skip
            reply, _ = await _call(channel, "ModelInfer", typed, pb.ModelInferResponse)
            got["typed"] = codec.parse_model_infer_response(reply)
            reply, trailer = await _call(
                channel, "ModelMetadata", pb.ModelMetadataRequest(name="echo"), pb.ModelMetadataResponse
            )
            shapes = trailer.get(codec.SHAPES_METADATA_KEY)
            got["specs"] = specs_from_model_metadata(codec.model_metadata_from_response(reply, shapes))
            got["plain_specs"] = specs_from_model_metadata(codec.model_metadata_from_response(reply))
            bad = codec.build_model_infer_request("adder", {"x": x, "y": y})
            del bad.raw_input_contents[1]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _call(channel, "ModelInfer", bad, pb.ModelInferResponse)
            got["bad"] = info.value
        return got

    before = _counts(metrics, "adder")
    with caplog.at_level(logging.INFO, logger="neuropod_serving.access"), grpc_in_thread(engine) as port:
        got = asyncio.run(session(port))

    raw = got["raw"]
    assert raw.model_name == "adder" and raw.model_version == "1" and raw.id == "r-1"
    assert list(raw.outputs) == ["out"]
    np.testing.assert_allclose(raw.outputs["out"], x + y, rtol=1e-6)
    np.testing.assert_array_equal(got["typed"].outputs["u_shifted"], np.left_shift(np.array([1, 2, 255], np.uint8), 1))
    np.testing.assert_array_equal(got["typed"].outputs["b_not"], [False, True, False])
    # With the trailer the exact spec (the batch_size symbol) comes back; without it, -1 is any size.
    assert [(s.name, s.dtype, s.shape) for s in got["specs"][0]] == [
        (s.name, s.dtype, s.shape) for s in engine.get("echo").model.inputs
    ]
    assert [s.shape for s in got["plain_specs"][1]] == [(None,), (None,)]
    assert got["bad"].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents has 1 entries but the message has 2 inputs" in got["bad"].details()
    # Metrics: two adder requests over gRPC, one a client failure; one access line per call.
    after = _counts(metrics, "adder")
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (2, 1, 0)
    assert b'neuropod_requests_total{model="adder",protocol="grpc"}' in metrics.render()
    lines = [r.getMessage() for r in caplog.records if r.name == "neuropod_serving.access"]
    assert len(lines) == 4, lines
    assert '"ModelInfer adder" OK' in lines[0] and lines[0].startswith("ipv4:127.0.0.1:")
    assert '"ModelMetadata echo" OK' in lines[2] and '"ModelInfer adder" INVALID_ARGUMENT' in lines[3]


def test_codec_round_trip_and_faults() -> None:
    arrays = {
        "f": np.arange(6, dtype=np.float16).reshape(2, 3),
        "i": np.array([[-(2**31)], [2**31 - 1]], dtype=np.int32),
        "u": np.array([2**64 - 1, 0], dtype=np.uint64),
        "s": np.array(["h\u00e9", "", "a\0"], dtype=object),
        "b": np.array([True, False]),
        "transposed": np.arange(6, dtype=np.float32).reshape(2, 3).T,  # not C-contiguous
        "big_endian": np.arange(3, dtype=">i4"),
    }
    request = codec.build_model_infer_request("m", arrays, outputs=["o1", "o2"], id="7", parameters={"big": 2**63})
    parsed = codec.parse_model_infer_request(pb.ModelInferRequest.FromString(request.SerializeToString()))
    assert parsed.outputs == {"o1": None, "o2": None} and parsed.id == "7" and parsed.parameters == {"big": 2**63}
    response = codec.parse_model_infer_response(codec.build_model_infer_response("m", arrays))
    for got in (parsed.inputs, response.outputs):
        assert list(got) == list(arrays)
        for name, array in arrays.items():
            assert got[name].dtype == array.dtype.newbyteorder("<") and got[name].tolist() == array.tolist(), name

    def tensor(**kw: Any) -> Any:
        return pb.ModelInferRequest.InferInputTensor(**kw)

    faults = [
        (pb.ModelInferRequest(inputs=[tensor(name="t", datatype="FP32", shape=[3])], raw_input_contents=[b"\0" * 8]),
         "tensor 't': shape [3] of FP32 needs 12 bytes (3 x 4), but the size of raw_input_contents[0] is 8"),
        (pb.ModelInferRequest(inputs=[tensor(name="t", datatype="BYTES", shape=[1])], raw_input_contents=[b"\x09\0\0\0ab"]),
         "tensor 't': BYTES element 0 says it is 9 bytes long"),
        (pb.ModelInferRequest(inputs=[tensor(name="t", datatype="BOOL", shape=[1])], raw_input_contents=[b"\x02"]),
         "tensor 't': BOOL bytes must be 0 or 1"),
        (pb.ModelInferRequest(inputs=[tensor(name="t", datatype="INT8", shape=[2],
                                             contents=pb.InferTensorContents(int_contents=[1, 300]))]),
         "tensor 't': INT8 data must lie in [-128, 127]"),
        (pb.ModelInferRequest(inputs=[tensor(name="t", datatype="FP32", shape=[2],
                                             contents=pb.InferTensorContents(fp64_contents=[1, 2]))]),
         "input 't': FP32 contents go in fp32_contents, but the message filled fp64_contents"),
        (pb.ModelInferRequest(inputs=[tensor(name="t", datatype="FP32", shape=[2])]),
         "input 't': shape [2] holds 2 elements, but fp32_contents has 0"),
        (pb.ModelInferRequest(inputs=[tensor(name="t", datatype="FP16", shape=[1],
                                             contents=pb.InferTensorContents(fp32_contents=[1]))]),
         "input 't': FP16 has no typed contents field; send it as raw contents"),
        (pb.ModelInferRequest(inputs=[tensor(name="t", datatype="FP32", shape=[1],
                                             contents=pb.InferTensorContents(fp32_contents=[1]))],
                              raw_input_contents=[b"\0" * 4]),
         "input 't' has typed contents while the message uses raw_input_contents"),
        (pb.ModelInferRequest(inputs=[tensor(name="t", datatype="FP32", shape=[-1])], raw_input_contents=[b""]),
         "tensor 't': shape[0] is -1"),
        (pb.ModelInferRequest(inputs=[tensor(name="t", datatype="BF16", shape=[1])], raw_input_contents=[b"\0\0"]),
         "tensor 't': datatype BF16 is not supported"),
        (pb.ModelInferRequest(inputs=[tensor(name="t", datatype="FP32", shape=[1])] * 2, raw_input_contents=[b"\0" * 4] * 2),
         "input 't' appears twice"),
        (pb.ModelInferRequest(inputs=[tensor(name="t", datatype="BYTES", shape=[1],
                                             contents=pb.InferTensorContents(bytes_contents=[b"\xff"]))]),
         "input 't': BYTES element 0 is not UTF-8 text"),
    ]  # fmt: skip
    for request, message in faults:
        with pytest.raises(ProtocolError) as info:
            codec.parse_model_infer_request(request)
        assert message in str(info.value)
