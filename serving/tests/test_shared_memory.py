"""Triton's system and CUDA shared-memory extensions, against `neuropod serve --allow-client-shm`.

The server is the real command (``neuropod.testing.served``) serving real ONNX
packages; it is driven with tritonclient's HTTP and gRPC clients and its
``tritonclient.utils.shared_memory`` helpers, as a Triton user would, and with
raw requests for what tritonclient would never send. Expected outputs are
computed here with numpy. The region registry is also exercised in this
process, where leaks (maps, descriptors) and races (unregistering a region a
request holds, a segment shrunk under the server) can be seen directly.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
grpc = pytest.importorskip("grpc")
httpx = pytest.importorskip("httpx")
pytest.importorskip("tritonclient.http")
pytest.importorskip("tritonclient.grpc")

import tritonclient.grpc as triton_grpc  # noqa: E402
import tritonclient.http as triton_http  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size  # noqa: E402

from neuropod.testing import served  # noqa: E402
from neuropod_serving.protocol import ProtocolError  # noqa: E402
from neuropod_serving.protocol.shm_params import SharedMemoryRequest, SharedTensor  # noqa: E402
from neuropod_serving.server.cuda_ipc import IPC_HANDLE_BYTES, ipc_handle  # noqa: E402
from neuropod_serving.server.shm_regions import SharedMemoryRegistry  # noqa: E402

from conftest import adder_and_echo, private_caches  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory in /dev/shm")


@pytest.fixture(scope="module")
def models() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-shm-"))
    try:
        with private_caches(root):
            adder_and_echo(root / "models", echo_as_zip=False)
            yield root / "models"
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Server:
    def __init__(self, http: str, grpc_url: str) -> None:
        self.http_url = http
        self.grpc_url = grpc_url
        self.http = triton_http.InferenceServerClient(http.removeprefix("http://"))
        self.grpc = triton_grpc.InferenceServerClient(grpc_url)
        self.raw = httpx.Client(base_url=http, timeout=30)

    def close(self) -> None:
        self.http.close()
        self.grpc.close()
        self.raw.close()

    def pid(self) -> int:
        """The server's process id, found by its --http-port among this user's processes."""
        port = self.http_url.rsplit(":", 1)[1]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    args = (entry / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if (
                    b"serve" in args
                    and b"--http-port" in args
                    and args[args.index(b"--http-port") + 1] == port.encode()
                ):
                    return int(entry.name)
        raise AssertionError(f"no neuropod serve process listens on {port}")


@pytest.fixture(scope="module")
def server(models: Path) -> Iterator[Server]:
    with private_caches(models.parent), served(models, options=["--allow-client-shm"]) as where:
        s = Server(where.http, where.grpc)
        try:
            yield s
        finally:
            s.close()


@pytest.fixture
def regions(server: Server) -> Iterator[list[Any]]:
    """Shared memory segments a test creates (``make``); unregistered and destroyed after it."""
    made: list[Any] = []
    yield made
    server.http.unregister_system_shared_memory()
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _key() -> str:
    return f"/neuropod-test-{uuid.uuid4().hex[:12]}"


def _segment(regions: list[Any], size: int) -> tuple[Any, str]:
    key = _key()
    handle = shm.create_shared_memory_region(key.lstrip("/"), key, size)
    regions.append(handle)
    return handle, key


def _xy() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal((3, 2)).astype(np.float32)


# --- metadata -------------------------------------------------------------------------------


def test_server_metadata_lists_the_extensions(server: Server) -> None:
    rest = server.http.get_server_metadata()["extensions"]
    rpc = list(server.grpc.get_server_metadata().extensions)
    for extensions in (rest, rpc):
        assert "system_shared_memory" in extensions and "cuda_shared_memory" in extensions


# --- system shared memory through tritonclient ---------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_in_system_shared_memory(server: Server, regions: list[Any], protocol: str) -> None:
    client, module = (server.http, triton_http) if protocol == "http" else (server.grpc, triton_grpc)
    x, y = _xy()
    inputs_handle, inputs_key = _segment(regions, x.nbytes + y.nbytes)
    outputs_handle, outputs_key = _segment(regions, 2 * x.nbytes + 16)
    shm.set_shared_memory_region(inputs_handle, [x, y])
    client.register_system_shared_memory("in", inputs_key, x.nbytes + y.nbytes)
    client.register_system_shared_memory("out", outputs_key, 2 * x.nbytes + 16)

    tx, ty = module.InferInput("x", [3, 2], "FP32"), module.InferInput("y", [3, 2], "FP32")
    tx.set_shared_memory("in", x.nbytes)
    ty.set_shared_memory("in", y.nbytes, offset=x.nbytes)
    out, doubled = module.InferRequestedOutput("out"), module.InferRequestedOutput("doubled")
    out.set_shared_memory("out", x.nbytes)
    doubled.set_shared_memory("out", x.nbytes + 16, offset=x.nbytes)
    result = client.infer("adder", [tx, ty], outputs=[out, doubled])

    np.testing.assert_array_equal(shm.get_contents_as_numpy(outputs_handle, np.float32, [3, 2]), x + y)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(outputs_handle, np.float32, [3, 2], x.nbytes), 2 * (x + y))
    entry = result.get_output("doubled")
    if protocol == "http":
        # No data and no parameters: Triton's C++ client (perf_analyzer) reads an output's
        # parameters as binary data, and fails on an entry without binary_data_size there.
        assert entry == {"name": "doubled", "datatype": "FP32", "shape": [3, 2]}
    else:
        assert list(entry.shape) == [3, 2] and entry.datatype == "FP32"
        assert entry.parameters["shared_memory_region"].string_param == "out"
        assert entry.parameters["shared_memory_byte_size"].int64_param == x.nbytes


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_shared_memory_mixed_with_tensors_in_the_message(server: Server, regions: list[Any], protocol: str) -> None:
    """One input in a region, one in the message; one output to a region, one in the answer: the
    message's tensors keep their places (gRPC raw contents have no entry for the inputs in regions)."""
    client, module = (server.http, triton_http) if protocol == "http" else (server.grpc, triton_grpc)
    x, y = _xy()
    handle, key = _segment(regions, 64)
    shm.set_shared_memory_region(handle, [y], offset=8)
    client.register_system_shared_memory("mixed", key, 64)
    tx, ty = module.InferInput("x", [3, 2], "FP32"), module.InferInput("y", [3, 2], "FP32")
    tx.set_data_from_numpy(x)
    ty.set_shared_memory("mixed", y.nbytes, offset=8)
    out, doubled = module.InferRequestedOutput("out"), module.InferRequestedOutput("doubled")
    out.set_shared_memory("mixed", 32, offset=32)
    result = client.infer("adder", [ty, tx], outputs=[out, doubled])
    np.testing.assert_array_equal(result.as_numpy("doubled"), 2 * (x + y))
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [3, 2], 32), x + y)


def test_bytes_tensors_in_shared_memory(server: Server, regions: list[Any]) -> None:
    """BYTES elements in a region are length-prefixed, as tritonclient writes and reads them."""
    texts = np.array(["", "héllo", "a\0b"], dtype=object)
    serialized = serialize_byte_tensor(texts)
    size = serialized_byte_size(serialized)
    handle, key = _segment(regions, 256)
    shm.set_shared_memory_region(handle, [serialized])
    server.grpc.register_system_shared_memory("strings", key, 256)
    s = triton_grpc.InferInput("s", [3], "BYTES")
    s.set_shared_memory("strings", size)
    n = triton_grpc.InferInput("n", [3], "INT64")
    n.set_data_from_numpy(np.array([1, 2, 3], np.int64))
    s_out, n1 = triton_grpc.InferRequestedOutput("s_out"), triton_grpc.InferRequestedOutput("n1")
    s_out.set_shared_memory("strings", 128, offset=128)
    result = server.grpc.infer("echo", [n, s], outputs=[s_out, n1])
    np.testing.assert_array_equal(result.as_numpy("n1"), [2, 3, 4])
    back = shm.get_contents_as_numpy(handle, np.object_, [3], offset=128)
    assert [b.decode() for b in back] == list(texts)


def test_status_lists_regions_as_triton_does(server: Server, regions: list[Any]) -> None:
    _, key = _segment(regions, 4096)
    server.http.register_system_shared_memory("whole", key, 4096)
    server.grpc.register_system_shared_memory("tail", key, 96, offset=4000)
    listed = server.raw.get("/v2/systemsharedmemory/status").json()
    assert sorted(listed, key=lambda r: r["name"]) == [
        {"name": "tail", "key": key, "offset": 4000, "byte_size": 96},
        {"name": "whole", "key": key, "offset": 0, "byte_size": 4096},
    ]
    assert server.raw.get("/v2/systemsharedmemory/region/tail/status").json() == [
        {"name": "tail", "key": key, "offset": 4000, "byte_size": 96}
    ]
    status = server.grpc.get_system_shared_memory_status("whole")
    assert dict(status.regions).keys() == {"whole"}
    assert (status.regions["whole"].key, status.regions["whole"].byte_size) == (key, 4096)
    server.grpc.unregister_system_shared_memory("tail")
    assert [r["name"] for r in server.http.get_system_shared_memory_status()] == ["whole"]
    server.http.unregister_system_shared_memory()
    assert server.http.get_system_shared_memory_status() == []
    # The segment is the client's: unregistering never removes it.
    assert os.path.exists(f"/dev/shm/{key.lstrip('/')}")


def test_server_releases_every_map_and_descriptor(server: Server, regions: list[Any]) -> None:
    pid = server.pid()
    keys = []
    for i in range(5):
        _, key = _segment(regions, 8192)
        keys.append(key)
        server.http.register_system_shared_memory(f"leak{i}", key, 8192)

    def fds() -> list[str]:
        return [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]

    # One descriptor per registered region, and no mapping: copies go through the descriptor.
    assert all(any(k.lstrip("/") in fd for fd in fds()) for k in keys)
    assert not any(k.lstrip("/") in Path(f"/proc/{pid}/maps").read_text() for k in keys)
    server.grpc.unregister_system_shared_memory()
    assert not any(k.lstrip("/") in fd for k in keys for fd in fds())


# --- what a client can get wrong -----------------------------------------------------------


def _infer_json(server: Server, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]] | None = None) -> Any:
    body: dict[str, Any] = {"inputs": inputs}
    if outputs is not None:
        body["outputs"] = outputs
    return server.raw.post("/v2/models/adder/infer", json=body)


def _shm_input(name: str, region: str, size: int, offset: int | None = None, shape: list[int] = [3, 2]) -> dict:  # noqa: B006
    params: dict[str, Any] = {"shared_memory_region": region, "shared_memory_byte_size": size}
    if offset is not None:
        params["shared_memory_offset"] = offset
    return {"name": name, "datatype": "FP32", "shape": shape, "parameters": params}


def _data(name: str, array: np.ndarray) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "shape": list(array.shape), "data": array.ravel().tolist()}


def test_register_refusals(server: Server, regions: list[Any]) -> None:
    _, key = _segment(regions, 100)
    missing = _key()
    cases = [
        ("/v2/systemsharedmemory/region/a/register", {"key": missing, "byte_size": 10}, "does not exist"),
        ("/v2/systemsharedmemory/region/a/register", {"key": key, "byte_size": 101}, "at least 101 bytes, but it is 100"),
        ("/v2/systemsharedmemory/region/a/register", {"key": key, "offset": 96, "byte_size": 8}, "at least 104"),
        ("/v2/systemsharedmemory/region/a/register", {"key": key, "byte_size": 0}, "'byte_size' must be an integer of at least 1"),
        ("/v2/systemsharedmemory/region/a/register", {"key": key, "byte_size": "8"}, "'byte_size' must be"),
        ("/v2/systemsharedmemory/region/a/register", {"key": key, "byte_size": 8, "offset": -1}, "'offset' must be"),
        ("/v2/systemsharedmemory/region/a/register", {"key": "/a/b", "byte_size": 8}, "not the name of a POSIX"),
        ("/v2/systemsharedmemory/region/a/register", {"key": "/..", "byte_size": 8}, "not the name of a POSIX"),
        ("/v2/systemsharedmemory/region/a/register", {"byte_size": 8}, "'key' must be"),
        ("/v2/systemsharedmemory/region/a/register", [1], "JSON object"),
    ]  # fmt: skip
    for path, body, needle in cases:
        answer = server.raw.post(path, json=body)
        assert answer.status_code == 400, (body, answer.text)
        assert needle in answer.json()["error"], (body, answer.json())
    server.http.register_system_shared_memory("twice", key, 100)
    with pytest.raises(InferenceServerException, match="'twice' is already registered"):
        server.http.register_system_shared_memory("twice", key, 50)
    with pytest.raises(InferenceServerException, match="'twice' is already registered") as e:
        server.grpc.register_system_shared_memory("twice", key, 50)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="does not exist") as e:
        server.grpc.register_system_shared_memory("nope", missing, 8)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="a shared memory region's name is a non-empty string") as e:
        server.grpc.register_system_shared_memory("", key, 8)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    answer = server.raw.get("/v2/systemsharedmemory/region/never/status")
    assert answer.status_code == 404 and "no system shared memory region named 'never'" in answer.json()["error"]
    with pytest.raises(InferenceServerException, match="never") as e:
        server.grpc.get_system_shared_memory_status("never")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    # Unregistering a name nobody registered is no error, as in Triton.
    assert server.raw.post("/v2/systemsharedmemory/region/never/unregister").status_code == 200


def test_links_and_other_files_are_refused(server: Server, tmp_path: Path) -> None:
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 64)
    link = Path("/dev/shm") / f"neuropod-test-link-{uuid.uuid4().hex[:8]}"
    link.symlink_to(target)
    try:
        answer = server.raw.post(
            "/v2/systemsharedmemory/region/l/register", json={"key": "/" + link.name, "byte_size": 8}
        )
        assert answer.status_code == 400 and "symbolic link" in answer.json()["error"]
    finally:
        link.unlink()
    fifo = Path("/dev/shm") / f"neuropod-test-fifo-{uuid.uuid4().hex[:8]}"
    os.mkfifo(fifo)
    try:
        answer = server.raw.post(
            "/v2/systemsharedmemory/region/f/register", json={"key": "/" + fifo.name, "byte_size": 8}
        )
        assert answer.status_code == 400 and "not a shared memory object" in answer.json()["error"]
    finally:
        fifo.unlink()


def test_infer_refusals_name_the_region_and_what_was_expected(server: Server, regions: list[Any]) -> None:
    x, y = _xy()
    handle, key = _segment(regions, 64)
    shm.set_shared_memory_region(handle, [x, y])
    server.http.register_system_shared_memory("r", key, 48)
    cases = [
        ([_shm_input("x", "nowhere", 24), _data("y", y)], None, "region 'nowhere', which is not registered"),
        ([_shm_input("x", "r", 24, offset=48), _data("y", y)], None, "offset 48 is past the end"),
        ([_shm_input("x", "r", 24, offset=40), _data("y", y)], None, "24 bytes at offset 40 run past the end"),
        ([_shm_input("x", "r", 20), _data("y", y)], None, "shape [3, 2] of FP32 is 24 bytes (6 x 4), but shared_memory_byte_size is 20"),
        ([{**_shm_input("x", "r", 24), "data": [0] * 6}, _data("y", y)], None, "also has 'data'"),
        ([{"name": "x", "datatype": "FP32", "shape": [3, 2], "parameters": {"shared_memory_region": "r"}},
          _data("y", y)], None, "no shared_memory_byte_size"),
        ([{"name": "x", "datatype": "FP32", "shape": [3, 2], "parameters": {"shared_memory_byte_size": 24}},
          _data("y", y)], None, "no shared_memory_region"),
        ([_shm_input("x", "r", -24), _data("y", y)], None, "must be a byte count"),
        ([{**_shm_input("x", "r", 24), "datatype": "INT32"}, _data("y", y)], None, "disagrees with the model's spec"),
        ([_data("x", x), _data("y", y)],
         [{"name": "out", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 20}}],
         "output 'out' is 24 bytes (FP32 of shape [3, 2]), more than the 20 bytes"),
        ([_data("x", x), _data("y", y)],
         [{"name": "out", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 24,
                                         "binary_data": True}}], "binary_data and for shared memory"),
        ([_data("x", x), _data("y", y)],
         [{"name": "out", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 24,
                                         "shared_memory_offset": 30}}], "24 bytes at offset 30 run past the end"),
    ]  # fmt: skip
    for inputs, outputs, needle in cases:
        answer = _infer_json(server, inputs, outputs)
        assert answer.status_code == 400, (inputs, outputs, answer.text)
        assert needle in answer.json()["error"], (needle, answer.json())
    # The server still answers, from the region too.
    answer = _infer_json(server, [_shm_input("x", "r", 24), _shm_input("y", "r", 24, offset=24)])
    assert answer.status_code == 200, answer.text
    got = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in answer.json()["outputs"]}
    np.testing.assert_array_equal(got["out"], x + y)


def test_grpc_infer_refusals(server: Server, regions: list[Any]) -> None:
    _, key = _segment(regions, 64)
    server.grpc.register_system_shared_memory("g", key, 48)
    cases = [("nowhere", 24, 0, "which is not registered"), ("g", 24, 40, "run past the end"),
             ("g", 20, 0, "but shared_memory_byte_size is 20")]  # fmt: skip
    for region, size, offset, needle in cases:
        tx, ty = triton_grpc.InferInput("x", [3, 2], "FP32"), triton_grpc.InferInput("y", [3, 2], "FP32")
        tx.set_shared_memory(region, size, offset=offset)
        ty.set_data_from_numpy(np.zeros((3, 2), np.float32))
        with pytest.raises(InferenceServerException, match=needle) as e:
            server.grpc.infer("adder", [tx, ty])
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    out = triton_grpc.InferRequestedOutput("out")
    out.set_shared_memory("g", 8)
    tx, ty = triton_grpc.InferInput("x", [3, 2], "FP32"), triton_grpc.InferInput("y", [3, 2], "FP32")
    tx.set_data_from_numpy(np.zeros((3, 2), np.float32))
    ty.set_data_from_numpy(np.zeros((3, 2), np.float32))
    with pytest.raises(InferenceServerException, match="more than the 8 bytes") as e:
        server.grpc.infer("adder", [tx, ty], outputs=[out])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_grpc_raw_contents_for_an_input_in_shared_memory_are_refused(server: Server, regions: list[Any]) -> None:
    """What tritonclient never sends: a raw_input_contents entry for an input in a region too."""
    from tritonclient.grpc import service_pb2

    _, key = _segment(regions, 64)
    server.grpc.register_system_shared_memory("extra", key, 64)
    request = service_pb2.ModelInferRequest(model_name="adder")
    for name in ("x", "y"):
        request.inputs.add(name=name, datatype="FP32", shape=[3, 2])
        request.raw_input_contents.append(bytes(24))
    request.inputs[0].parameters["shared_memory_region"].string_param = "extra"
    request.inputs[0].parameters["shared_memory_byte_size"].int64_param = 24
    with grpc.insecure_channel(server.grpc_url) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents has 2 entries, but 1 input(s) are not in shared memory" in e.value.details()


def test_unregistering_while_requests_use_the_region(server: Server, regions: list[Any]) -> None:
    """Requests naming a region race with its unregistration and registration again: each is
    answered (with outputs, or 400 naming the region), and the server keeps serving."""
    x, y = _xy()
    handle, key = _segment(regions, 96)
    shm.set_shared_memory_region(handle, [x, y])
    server.http.register_system_shared_memory("busy", key, 96)
    statuses: list[int] = []
    churn_failures: list[str] = []
    stop = threading.Event()

    def churn() -> None:
        # Its own client: tritonclient.http's (gevent) is not to be shared between threads.
        with httpx.Client(base_url=server.http_url, timeout=30) as client:
            while not stop.is_set():
                gone = client.post("/v2/systemsharedmemory/region/busy/unregister")
                back = client.post("/v2/systemsharedmemory/region/busy/register", json={"key": key, "byte_size": 96})
                if gone.status_code != 200 or back.status_code != 200:
                    churn_failures.append(gone.text + back.text)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        with httpx.Client(base_url=server.http_url, timeout=30) as client:
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                body = {"inputs": [_shm_input("x", "busy", 24), _shm_input("y", "busy", 24, offset=24)],
                        "outputs": [{"name": "out", "parameters": {"shared_memory_region": "busy",
                                                                   "shared_memory_byte_size": 24,
                                                                   "shared_memory_offset": 48}}]}  # fmt: skip
                answer = client.post("/v2/models/adder/infer", json=body)
                statuses.append(answer.status_code)
                assert answer.status_code == 200 or "'busy'" in answer.json()["error"], answer.text
    finally:
        stop.set()
        thread.join()
    assert not churn_failures
    assert 200 in statuses
    assert server.http.is_server_live()


# --- CUDA shared memory: up to the GPU ------------------------------------------------------


def test_cuda_shared_memory_without_a_gpu(server: Server) -> None:
    from neuropod.testing import gpu_missing

    if gpu_missing() is None:
        pytest.skip("this machine has a GPU: test_cuda_shared_memory_on_a_gpu covers it")
    handle = base64.b64encode(bytes(64)).decode()
    answer = server.raw.post("/v2/cudasharedmemory/region/c/register",
                             json={"raw_handle": {"b64": handle}, "device_id": 0, "byte_size": 64})  # fmt: skip
    assert answer.status_code == 400
    assert "CUDA shared memory needs a GPU and the CUDA runtime (libcudart): no GPU found" in answer.json()["error"]
    with pytest.raises(InferenceServerException, match="needs a GPU") as e:
        server.grpc.register_cuda_shared_memory("c", base64.b64encode(bytes(64)), 0, 64)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    bad = server.raw.post("/v2/cudasharedmemory/region/c/register", json={"raw_handle": "zz", "byte_size": 8})
    assert bad.status_code == 400 and "raw_handle must be" in bad.json()["error"]
    assert server.raw.get("/v2/cudasharedmemory/status").json() == []
    assert len(server.grpc.get_cuda_shared_memory_status().regions) == 0
    assert server.raw.post("/v2/cudasharedmemory/unregister").status_code == 200
    server.grpc.unregister_cuda_shared_memory()


def test_a_cuda_ipc_handle_keeps_every_byte() -> None:
    """IPC handles are opaque bytes with NULs among them; the handle given to the CUDA runtime is all of them."""
    raw = bytes([0, 7, 0, 0, 255, 0, 1]) + bytes(range(1, IPC_HANDLE_BYTES - 6))
    assert len(raw) == IPC_HANDLE_BYTES and bytes(ipc_handle(raw)) == raw


def _cuda_python_missing() -> str | None:
    try:
        import tritonclient.utils.cuda_shared_memory  # noqa: F401  (needs cuda-python)
    except Exception as e:  # noqa: BLE001
        return f"tritonclient.utils.cuda_shared_memory cannot be used ({e})"
    return None


@pytest.mark.gpu(needs=_cuda_python_missing)
def test_cuda_shared_memory_on_a_gpu(server: Server) -> None:
    import tritonclient.utils.cuda_shared_memory as cudashm

    x, y = _xy()
    inputs = cudashm.create_shared_memory_region("gin", x.nbytes + y.nbytes, 0)
    outputs = cudashm.create_shared_memory_region("gout", x.nbytes, 0)
    try:
        cudashm.set_shared_memory_region(inputs, [x, y])
        server.grpc.register_cuda_shared_memory("gin", cudashm.get_raw_handle(inputs), 0, x.nbytes + y.nbytes)
        server.grpc.register_cuda_shared_memory("gout", cudashm.get_raw_handle(outputs), 0, x.nbytes)
        assert {r["name"] for r in server.raw.get("/v2/cudasharedmemory/status").json()} == {"gin", "gout"}
        tx, ty = triton_grpc.InferInput("x", [3, 2], "FP32"), triton_grpc.InferInput("y", [3, 2], "FP32")
        tx.set_shared_memory("gin", x.nbytes)
        ty.set_shared_memory("gin", y.nbytes, offset=x.nbytes)
        out = triton_grpc.InferRequestedOutput("out")
        out.set_shared_memory("gout", x.nbytes)
        server.grpc.infer("adder", [tx, ty], outputs=[out])
        np.testing.assert_array_equal(cudashm.get_contents_as_numpy(outputs, np.float32, [3, 2]), x + y)
    finally:
        server.grpc.unregister_cuda_shared_memory()
        cudashm.destroy_shared_memory_region(inputs)
        cudashm.destroy_shared_memory_region(outputs)


# --- a server without --allow-client-shm ---------------------------------------------------


def test_server_without_the_option_refuses_shared_memory(models: Path, regions: list[Any], server: Server) -> None:
    _, key = _segment(regions, 64)
    with private_caches(models.parent), served(models) as where:
        plain = Server(where.http, where.grpc)
        try:
            assert "system_shared_memory" not in plain.http.get_server_metadata()["extensions"]
            assert "cuda_shared_memory" not in list(plain.grpc.get_server_metadata().extensions)
            with pytest.raises(InferenceServerException, match="--allow-client-shm"):
                plain.http.register_system_shared_memory("r", key, 64)
            with pytest.raises(InferenceServerException, match="--allow-client-shm") as e:
                plain.grpc.get_system_shared_memory_status()
            assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
            answer = plain.raw.post("/v2/models/adder/infer", json={"inputs": [_shm_input("x", "r", 24),
                                                                              _shm_input("y", "r", 24)]})  # fmt: skip
            assert answer.status_code == 400 and "--allow-client-shm" in answer.json()["error"]
        finally:
            plain.close()


def test_registering_needs_the_token(models: Path, regions: list[Any], server: Server, tmp_path: Path) -> None:
    _, key = _segment(regions, 64)
    (tmp_path / "token").write_text("shm-t0ken")
    options = ["--allow-client-shm", "--auth-token-file", str(tmp_path / "token")]
    with private_caches(models.parent), served(models, options=options) as where:
        guarded = Server(where.http, where.grpc)
        try:
            answer = guarded.raw.post("/v2/systemsharedmemory/region/r/register", json={"key": key, "byte_size": 64})
            assert answer.status_code == 401
            with pytest.raises(InferenceServerException) as e:
                guarded.grpc.register_system_shared_memory("r", key, 64)
            assert e.value.status() == "StatusCode.UNAUTHENTICATED"
            headers = {"authorization": "Bearer shm-t0ken"}
            guarded.grpc.register_system_shared_memory("r", key, 64, headers=headers)
            assert [r["name"] for r in guarded.http.get_system_shared_memory_status(headers=headers)] == ["r"]
            guarded.http.unregister_system_shared_memory(headers=headers)
        finally:
            guarded.close()


# --- the registry in this process: leaks and races ------------------------------------------


def _open_on(key: str) -> int:
    """Descriptors of this process open on the shared memory object ``key``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == f"/dev/shm/{key.lstrip('/')}"
        except OSError:
            pass
    return count


def test_registry_limits_and_releases(regions: list[Any], server: Server) -> None:
    _, key = _segment(regions, 4096)
    registry = SharedMemoryRegistry(max_regions=2)
    before = _open_on(key)  # tritonclient's own
    registry.register_system("a", key, 0, 100)
    registry.register_system("b", key, 100, 100)
    with pytest.raises(ProtocolError, match="2 regions are registered, the most this server keeps"):
        registry.register_system("c", key, 0, 8)
    assert _open_on(key) == before + 2  # one per region, kept while it is registered
    registry.close()
    assert _open_on(key) == before
    assert len(registry) == 0


def test_a_request_holds_its_region_past_unregistration(regions: list[Any], server: Server) -> None:
    handle, key = _segment(regions, 64)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    shm.set_shared_memory_region(handle, [x])
    registry = SharedMemoryRegistry()
    registry.register_system("held", key, 0, 64)
    region = registry._regions["held"]
    request = SharedMemoryRequest(
        inputs={"x": SharedTensor("x", "held", 0, 24, "FP32", (3, 2))},
        outputs={"out": SharedTensor("out", "held", 32, 32)},
    )
    lease = registry.lease(request)
    registry.unregister("system", "held")
    assert registry.status("system") == []
    with pytest.raises(ProtocolError, match="'held', which is not registered"):
        registry.lease(request)
    got = lease.read_inputs()["x"]
    np.testing.assert_array_equal(got, x)
    assert got.flags.writeable
    got += 1  # the model's own copy: the region is unchanged
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [3, 2]), x)
    written = lease.write_outputs({"out": x * 3})
    assert written["out"]["shared_memory_byte_size"] == 24
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [3, 2], 32), x * 3)
    assert not region.closed
    lease.release()
    assert region.closed


def test_inputs_read_from_a_region_are_own_arrays_starting_on_a_cache_line(regions: list[Any], server: Server) -> None:
    # The kernel copies out of a shared memory object faster into memory that starts on a cache line.
    data = np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8)
    handle, key = _segment(regions, data.nbytes)
    shm.set_shared_memory_region(handle, [data])
    registry = SharedMemoryRegistry()
    try:
        registry.register_system("lines", key, 0, data.nbytes)
        for offset, size in [(0, 5000), (3, 100), (17, 4096), (4999, 1), (64, 0)]:
            tensor = SharedTensor("x", "lines", offset, size, "UINT8", (size,))
            lease = registry.lease(SharedMemoryRequest(inputs={"x": tensor}))
            try:
                got = lease.read_inputs()["x"]
            finally:
                lease.release()
            np.testing.assert_array_equal(got, data[offset : offset + size])
            assert got.flags.writeable and got.flags.c_contiguous
            assert got.ctypes.data % 64 == 0 or size == 0, (offset, size)
    finally:
        registry.close()


def test_bad_bytes_in_a_region_are_refused_by_name(regions: list[Any], server: Server) -> None:
    handle, key = _segment(regions, 64)
    shm.set_shared_memory_region(handle, [np.array([0, 1, 2], np.uint8), np.array([200], "<u4").view(np.uint8)])
    registry = SharedMemoryRegistry()
    try:
        registry.register_system("bad", key, 0, 64)
        cases = [
            (SharedTensor("b", "bad", 0, 3, "BOOL", (3,)), "BOOL bytes must be 0 or 1"),
            (SharedTensor("s", "bad", 3, 8, "BYTES", (1,)), "BYTES element 0 says it is 200 bytes long"),
        ]
        for tensor, needle in cases:
            lease = registry.lease(SharedMemoryRequest(inputs={tensor.name: tensor}))
            try:
                with pytest.raises(ProtocolError, match=needle):
                    lease.read_inputs()
            finally:
                lease.release()
    finally:
        registry.close()


def test_the_engine_closes_its_regions(models: Path, regions: list[Any], server: Server) -> None:
    from neuropod_serving.server import Engine, ModelRegistry

    _, key = _segment(regions, 4096)
    before = _open_on(key)
    with private_caches(models.parent):
        engine = Engine(ModelRegistry.load([models]), shared_memory=SharedMemoryRegistry())
    assert engine.shared_memory is not None
    engine.shared_memory.register_system("kept", key, 0, 4096)
    assert _open_on(key) == before + 1
    engine.close()  # as neuropod serve does when it stops
    assert _open_on(key) == before


def test_a_segment_shrunk_after_registration_is_refused_not_a_crash(regions: list[Any], server: Server) -> None:
    _, key = _segment(regions, 8192)
    registry = SharedMemoryRegistry()
    try:
        registry.register_system("shrinks", key, 4096, 4096)
        lease = registry.lease(
            SharedMemoryRequest(inputs={"x": SharedTensor("x", "shrinks", 0, 4096, "UINT8", (4096,))})
        )
        os.truncate(f"/dev/shm/{key.lstrip('/')}", 100)
        with pytest.raises(ProtocolError, match="the client shrank it to 100"):
            lease.read_inputs()
        lease.release()
    finally:
        registry.close()


# --- our messages are Triton's, on the wire ---------------------------------------------------


def test_messages_are_wire_compatible_with_tritonclient() -> None:
    from tritonclient.grpc import service_pb2 as theirs

    from neuropod_serving.protocol._grpc import triton_shm_pb2 as ours

    def both_ways(mine: Any, cls: str) -> Any:
        parsed = getattr(theirs, cls).FromString(mine.SerializeToString())
        back = getattr(ours, cls).FromString(parsed.SerializeToString())
        assert back == mine
        return parsed

    parsed = both_ways(ours.SystemSharedMemoryRegisterRequest(name="r", key="/k", offset=2**40, byte_size=7),
                       "SystemSharedMemoryRegisterRequest")  # fmt: skip
    assert (parsed.name, parsed.key, parsed.offset, parsed.byte_size) == ("r", "/k", 2**40, 7)
    status = ours.SystemSharedMemoryStatusResponse()
    status.regions["r"].name, status.regions["r"].key, status.regions["r"].byte_size = "r", "/k", 9
    parsed = both_ways(status, "SystemSharedMemoryStatusResponse")
    assert (parsed.regions["r"].key, parsed.regions["r"].byte_size) == ("/k", 9)
    parsed = both_ways(ours.CudaSharedMemoryRegisterRequest(name="c", raw_handle=b"\1" * 64, device_id=3, byte_size=5),
                       "CudaSharedMemoryRegisterRequest")  # fmt: skip
    assert (parsed.raw_handle, parsed.device_id, parsed.byte_size) == (b"\1" * 64, 3, 5)
    cuda = ours.CudaSharedMemoryStatusResponse()
    cuda.regions["c"].name, cuda.regions["c"].device_id, cuda.regions["c"].byte_size = "c", 1, 5
    assert both_ways(cuda, "CudaSharedMemoryStatusResponse").regions["c"].device_id == 1
    for cls in ("SystemSharedMemoryStatusRequest", "SystemSharedMemoryUnregisterRequest",
                "CudaSharedMemoryStatusRequest", "CudaSharedMemoryUnregisterRequest"):  # fmt: skip
        assert both_ways(getattr(ours, cls)(name="n"), cls).name == "n"
    for cls in ("SystemSharedMemoryRegisterResponse", "SystemSharedMemoryUnregisterResponse",
                "CudaSharedMemoryRegisterResponse", "CudaSharedMemoryUnregisterResponse"):  # fmt: skip
        both_ways(getattr(ours, cls)(), cls)
    # The field numbers, one by one, against tritonclient's descriptors.
    for message in ours.DESCRIPTOR.message_types_by_name.values():
        other = getattr(theirs, message.name).DESCRIPTOR
        for f in message.fields:
            assert (f.number, f.type) == (other.fields_by_name[f.name].number, other.fields_by_name[f.name].type)


def test_json_response_has_no_data_for_outputs_in_shared_memory(server: Server, regions: list[Any]) -> None:
    x, y = _xy()
    _, key = _segment(regions, 64)
    server.http.register_system_shared_memory("j", key, 64)
    answer = _infer_json(server, [_data("x", x), _data("y", y)],
                         [{"name": "out", "parameters": {"shared_memory_region": "j", "shared_memory_byte_size": 64}},
                          {"name": "doubled"}])  # fmt: skip
    assert answer.status_code == 200, answer.text
    out, doubled = answer.json()["outputs"]
    assert out == {"name": "out", "datatype": "FP32", "shape": [3, 2]}  # no parameters: see above
    np.testing.assert_allclose(np.array(doubled["data"], np.float32).reshape(3, 2), 2 * (x + y), rtol=1e-6)
    assert json.loads(answer.content)  # a plain JSON body: nothing binary was asked for
