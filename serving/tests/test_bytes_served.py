"""bytes tensors served: BYTES carries them as they are, over HTTP (binary and JSON), gRPC and shared memory.

The server is the real ``neuropod serve`` on a Python package whose ``data`` input is a bytes tensor and
whose ``tag`` input is a string tensor; it is driven with tritonclient (HTTP and gRPC), raw HTTP for the
JSON forms, and neuropod's own remote models. Expected values are computed here from the bytes sent.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("grpc")
httpx = pytest.importorskip("httpx")
pytest.importorskip("tritonclient.http")
pytest.importorskip("tritonclient.grpc")

import tritonclient.grpc as triton_grpc  # noqa: E402
import tritonclient.http as triton_http  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size  # noqa: E402

import neuropod  # noqa: E402
from neuropod.packagers import create_python_neuropod  # noqa: E402
from neuropod.spec import to_bytes_array  # noqa: E402
from neuropod.testing import Served, served  # noqa: E402
from neuropod_serving.protocol import DTYPE_PARAMETER  # noqa: E402

from conftest import private_caches  # noqa: E402

BLOBS_SOURCE = """
import numpy as np

def blobs(data, tag):
    flat = data.ravel().tolist()
    assert all(type(b) is bytes for b in flat), [type(b) for b in flat]
    out = np.empty(len(flat), dtype=object)
    out[:] = [b[::-1] for b in flat]
    return {
        "reversed": out.reshape(data.shape),
        "length": np.array([len(b) for b in flat], np.int64).reshape(data.shape),
        "tag_out": tag,
    }

def get_model(_):
    return blobs
"""
# JPEG-like, with NULs inside and at the ends, and an empty one: none of it UTF-8 text.
BLOBS = [b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", b"\x00\x00\xfe", b"", b"\x80abc\x00"]


def objects(items: list[Any]) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-bytes-"))
    try:
        with private_caches(root):
            code = root / "code"
            code.mkdir()
            (code / "blobs_model.py").write_text(BLOBS_SOURCE)
            create_python_neuropod(
                root / "models" / "blobs", "blobs", [], [{"python_root": code, "dirs_to_package": [""]}],
                "blobs_model", "get_model",
                [{"name": "data", "dtype": "bytes", "shape": ["batch"]}, {"name": "tag", "dtype": "string", "shape": ["batch"]}],
                [{"name": "reversed", "dtype": "bytes", "shape": ["batch"]},
                 {"name": "length", "dtype": "int64", "shape": ["batch"]},
                 {"name": "tag_out", "dtype": "string", "shape": ["batch"]}],
            )  # fmt: skip
            with served(root / "models", options=["--allow-client-shm"]) as where:
                yield where
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _tags(n: int) -> np.ndarray:
    return objects([f"t{i}" for i in range(n)])


def test_metadata_marks_bytes_tensors(server: Served) -> None:
    with httpx.Client(base_url=server.http, timeout=30) as client:
        meta = client.get("/v2/models/blobs").json()
    inputs = {t["name"]: t for t in meta["inputs"]}
    assert inputs["data"]["datatype"] == inputs["tag"]["datatype"] == "BYTES"
    assert inputs["data"]["parameters"][DTYPE_PARAMETER] == "bytes"
    assert DTYPE_PARAMETER not in inputs["tag"]["parameters"]
    # Triton's model configuration has one type for both: TYPE_STRING.
    with httpx.Client(base_url=server.http, timeout=30) as client:
        config = client.get("/v2/models/blobs/config").json()
    assert {t["name"]: t["data_type"] for t in config["input"]} == {"data": "TYPE_STRING", "tag": "TYPE_STRING"}
    client = triton_grpc.InferenceServerClient(server.grpc)
    try:
        rpc = client.get_model_metadata("blobs", as_json=True)
    finally:
        client.close()
    assert {t["name"]: t["datatype"] for t in rpc["inputs"]} == {"data": "BYTES", "tag": "BYTES"}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tritonclient_sends_and_gets_bytes_exactly(server: Served, protocol: str) -> None:
    lib: Any = triton_http if protocol == "http" else triton_grpc
    url = server.http.removeprefix("http://") if protocol == "http" else server.grpc
    client = lib.InferenceServerClient(url)
    try:
        data = lib.InferInput("data", [len(BLOBS)], "BYTES")
        tag = lib.InferInput("tag", [len(BLOBS)], "BYTES")
        if protocol == "http":
            data.set_data_from_numpy(objects(BLOBS), binary_data=True)
            tag.set_data_from_numpy(_tags(len(BLOBS)), binary_data=True)
            outputs = [lib.InferRequestedOutput(n, binary_data=True) for n in ("reversed", "length", "tag_out")]
        else:
            data.set_data_from_numpy(objects(BLOBS))
            tag.set_data_from_numpy(_tags(len(BLOBS)))
            outputs = [lib.InferRequestedOutput(n) for n in ("reversed", "length", "tag_out")]
        result = client.infer("blobs", [data, tag], outputs=outputs)
        assert result.as_numpy("reversed").tolist() == [b[::-1] for b in BLOBS]  # trailing NULs and all
        assert result.as_numpy("length").tolist() == [len(b) for b in BLOBS]
        assert result.as_numpy("tag_out").tolist() == [t.encode() for t in _tags(len(BLOBS))]
        # A string tensor still takes UTF-8 text only.
        bad = lib.InferInput("tag", [len(BLOBS)], "BYTES")
        bad.set_data_from_numpy(objects(BLOBS), **({"binary_data": True} if protocol == "http" else {}))
        with pytest.raises(InferenceServerException, match="not UTF-8 text"):
            client.infer("blobs", [data, bad])
    finally:
        client.close()


def test_json_strings_are_utf8_bytes_and_json_answers_need_text(server: Served) -> None:
    def body(text: str, **output: Any) -> dict[str, Any]:
        return {
            "inputs": [{"name": "data", "datatype": "BYTES", "shape": [1], "data": [text]},
                       {"name": "tag", "datatype": "BYTES", "shape": [1], "data": ["t"]}],
            "outputs": [{"name": "reversed", **output}, {"name": "length"}],
        }  # fmt: skip

    with httpx.Client(base_url=server.http, timeout=30) as client:
        ok = client.post("/v2/models/blobs/infer", json=body("abc"))
        assert ok.status_code == 200, ok.text
        outputs = {o["name"]: o for o in ok.json()["outputs"]}
        assert outputs["reversed"]["data"] == ["cba"] and outputs["length"]["data"] == [3]
        # "é" is two UTF-8 bytes; reversed, they are not UTF-8 text, which a JSON answer cannot hold.
        refused = client.post("/v2/models/blobs/infer", json=body("é"))
        assert refused.status_code == 400, refused.text
        assert "not UTF-8 text" in refused.text and "binary data" in refused.text
        # Asked for as binary data, the same answer comes whole.
        binary = client.post("/v2/models/blobs/infer", json=body("é", parameters={"binary_data": True}))
        assert binary.status_code == 200, binary.text
        size = int(binary.headers["Inference-Header-Content-Length"])
        assert binary.content[size:] == len(b"\xa9\xc3").to_bytes(4, "little") + "é".encode()[::-1]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_remote_model_rebuilds_bytes_and_gets_them_back(server: Served, protocol: str) -> None:
    url = f"grpc://{server.grpc}/blobs" if protocol == "grpc" else f"{server.http}/blobs"
    with neuropod.load_neuropod(url) as model:
        assert {s.name: s.dtype for s in model.inputs} == {"data": "bytes", "tag": "string"}
        assert {s.name: s.dtype for s in model.outputs} == {"reversed": "bytes", "length": "int64", "tag_out": "string"}
        out = model.infer({"data": to_bytes_array(BLOBS), "tag": np.array(["a", "b", "c", "d"])})
    assert out["reversed"].dtype == object and out["reversed"].tolist() == [b[::-1] for b in BLOBS]
    assert all(type(b) is bytes for b in out["reversed"].flat)
    assert out["tag_out"].tolist() == ["a", "b", "c", "d"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory in /dev/shm")
def test_bytes_in_system_shared_memory(server: Served) -> None:
    client = triton_http.InferenceServerClient(server.http.removeprefix("http://"))
    handles = []
    try:
        serialized = serialize_byte_tensor(objects(BLOBS))
        tags = serialize_byte_tensor(_tags(len(BLOBS)))
        size = serialized_byte_size(serialized)
        tag_size = serialized_byte_size(tags)
        for name, capacity in (("in", size + tag_size), ("out", size)):
            key = f"/neuropod-test-{uuid.uuid4().hex[:12]}"
            handles.append(shm.create_shared_memory_region(key.lstrip("/"), key, capacity))
            client.register_system_shared_memory(name, key, capacity)
        shm.set_shared_memory_region(handles[0], [serialized, tags])
        data = triton_http.InferInput("data", [len(BLOBS)], "BYTES")
        data.set_shared_memory("in", size)
        tag = triton_http.InferInput("tag", [len(BLOBS)], "BYTES")
        tag.set_shared_memory("in", tag_size, offset=size)
        reversed_ = triton_http.InferRequestedOutput("reversed")
        reversed_.set_shared_memory("out", size)
        result = client.infer("blobs", [data, tag], outputs=[reversed_])
        shape = result.get_output("reversed")["shape"]
        got = shm.get_contents_as_numpy(handles[1], np.object_, shape)
        assert got.tolist() == [b[::-1] for b in BLOBS]
    finally:
        client.unregister_system_shared_memory()
        client.close()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)
