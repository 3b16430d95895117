"""`neuropod serve`'s REST app with real ONNX packages, over real HTTP.

The error matrix goes through Starlette's TestClient; interop goes through
tritonclient.http (a client nobody here wrote) against a uvicorn server
listening on a free port. Expected outputs are computed with numpy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpclient = pytest.importorskip("tritonclient.http")

from onnx import TensorProto, helper  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from neuropod.errors import PackageError  # noqa: E402
from neuropod_serving.cli import add_arguments  # noqa: E402
from neuropod_serving.protocol import HEADER_LENGTH, build_infer_request, parse_infer_response  # noqa: E402
from neuropod_serving.server import Engine, ModelRegistry, create_app, find_packages  # noqa: E402
from neuropod_serving.server.launcher import startup_table  # noqa: E402

from conftest import adder_and_echo, onnx_package, private_caches, serve_in_thread  # noqa: E402


@pytest.fixture(scope="module")
def repo() -> Iterator[Path]:
    """A folder of packages (adder, echo as a zip) and a model that fails at run time."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-serving-test-"))
    with private_caches(root):
        adder_and_echo(root / "models", echo_as_zip=True)
        # Reshape to [2, 2] fails inside onnxruntime for any input that is not 4 elements.
        onnx_package(root / "broken", "broken", [helper.make_node("Reshape", ["v", "shape"], ["w"])],
                     [("v", "float32", [None])], [("w", "float32", [2, 2])],
                     [helper.make_tensor("shape", TensorProto.INT64, [2], [2, 2])])  # fmt: skip
        (root / "models" / "notes.txt").write_text("not a package")
        yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(repo: Path) -> Iterator[Engine]:
    eng = Engine(ModelRegistry.load([repo / "models", repo / "broken"]))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def registry(engine: Engine) -> ModelRegistry:
    return engine.registry


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, max_request_bytes=4096), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[str]:
    """A real uvicorn server on a free port, in a background thread; yields host:port."""
    with serve_in_thread(create_app(engine)) as port:
        yield f"127.0.0.1:{port}"


@pytest.fixture
def triton(server: str) -> Iterator[Any]:
    c = httpclient.InferenceServerClient(server)
    yield c
    c.close()


def _xy(batch: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(batch)
    return rng.standard_normal((batch, 2)).astype(np.float32), rng.standard_normal((batch, 2)).astype(np.float32)


# --- the registry and the CLI --------------------------------------------------------------


def test_registry_finds_dirs_and_zips_by_config_json(repo: Path, registry: ModelRegistry) -> None:
    assert [p.name for p in find_packages(repo / "models")] == ["adder", "echo.zip"]
    assert find_packages(repo / "broken") == [repo / "broken"]
    assert sorted(s.name for s in registry) == ["adder", "broken", "echo"]


def test_registry_name_clash_is_an_error_at_start(repo: Path) -> None:
    with pytest.raises(PackageError, match=r"both named 'adder'.*adder.*adder"):
        ModelRegistry.load([repo / "models" / "adder", repo / "models"])


def test_registry_path_without_packages(repo: Path, tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="holds no Neuropod package"):
        find_packages(tmp_path)
    with pytest.raises(PackageError, match="no such file"):
        find_packages(tmp_path / "missing")


def test_cli_arguments_and_startup_table(registry: ModelRegistry) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["a", "b", "--http-port", "9000", "--workers", "2", "--quiet"])
    assert (args.paths, args.http_port, args.workers, args.quiet, args.host) == (["a", "b"], 9000, 2, True, "127.0.0.1")
    with pytest.raises(SystemExit):
        parser.parse_args(["a", "--workers", "0"])
    table = startup_table(registry).splitlines()
    assert table[0].split() == ["MODEL", "PLATFORM", "BACKEND", "DEVICE", "BATCHED", "INPUTS"]
    adder = next(line for line in table if line.startswith("adder"))
    assert "onnx" in adder and "cpu" in adder and "x: float32[batch_size, 2], y: float32[batch_size, 2]" in adder


def test_cli_module_imports_no_server_library() -> None:
    import subprocess
    import sys

    code = "import sys, neuropod_serving.cli, neuropod_serving.server; print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'uvicorn')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


# --- tritonclient against the listening server ---------------------------------------------


def test_triton_health_and_metadata(triton: Any) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("adder") and triton.is_model_ready("adder", "1")
    assert not triton.is_model_ready("nope")
    meta = triton.get_server_metadata()
    # This engine keeps no metrics, so no statistics either (test_triton_extensions.py has a server that does).
    assert meta["name"] == "neuropod"
    assert meta["extensions"] == [
        "binary_tensor_data", "classification", "model_configuration", "model_repository", "sequence",
        "sequence(string_id)", "generate",
    ]  # fmt: skip
    model = triton.get_model_metadata("adder")
    assert model["platform"] == "onnx" and model["versions"] == ["1"]
    assert model["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": [-1, 2],
                                  "parameters": {"neuropod_shape": '["batch_size", 2]'}}  # fmt: skip
    assert [t["name"] for t in triton.get_model_metadata("echo", "1")["outputs"]] == ["n1", "s_out"]


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False])
def test_triton_fp32_all_outputs(triton: Any, binary_in: bool, binary_out: bool) -> None:
    x, y = _xy()
    inputs = [httpclient.InferInput("x", [3, 2], "FP32"), httpclient.InferInput("y", [3, 2], "FP32")]
    inputs[0].set_data_from_numpy(x, binary_data=binary_in)
    inputs[1].set_data_from_numpy(y, binary_data=binary_in)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary_out) for n in ("out", "doubled")]
    result = triton.infer("adder", inputs, outputs=outputs, request_id="r1")
    np.testing.assert_allclose(result.as_numpy("out"), x + y, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("doubled"), (x + y) * 2, rtol=1e-6)
    response = result.get_response()
    assert response["model_name"] == "adder" and response["id"] == "r1"


def test_triton_requested_output_only(triton: Any) -> None:
    x, y = _xy(5)
    inputs = [httpclient.InferInput("x", [5, 2], "FP32"), httpclient.InferInput("y", [5, 2], "FP32")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(y)
    result = triton.infer("adder", inputs, outputs=[httpclient.InferRequestedOutput("doubled")], model_version="1")
    assert [o["name"] for o in result.get_response()["outputs"]] == ["doubled"]
    np.testing.assert_allclose(result.as_numpy("doubled"), (x + y) * 2, rtol=1e-6)
    assert result.as_numpy("out") is None


@pytest.mark.parametrize("binary", [True, False])
def test_triton_int64_and_bytes(triton: Any, binary: bool) -> None:
    n = np.array([-(2**62), 0, 41], dtype=np.int64)
    s = np.array(["héllo", "", "a\x00b"], dtype=object)
    inputs = [httpclient.InferInput("n", [3], "INT64"), httpclient.InferInput("s", [3], "BYTES")]
    inputs[0].set_data_from_numpy(n, binary_data=binary)
    inputs[1].set_data_from_numpy(s, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in ("n1", "s_out")]
    result = triton.infer("echo", inputs, outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("n1"), n + 1)
    got = result.as_numpy("s_out")
    # tritonclient hands BYTES back as bytes objects (binary) or str (JSON).
    assert [v.decode() if isinstance(v, bytes) else v for v in got.tolist()] == s.tolist()


def test_triton_backend_failure_keeps_serving(triton: Any) -> None:
    from tritonclient.utils import InferenceServerException

    v = httpclient.InferInput("v", [3], "FP32")
    v.set_data_from_numpy(np.ones(3, np.float32))
    with pytest.raises(InferenceServerException, match="model 'broken' failed") as info:
        triton.infer("broken", [v])
    assert info.value.status() == "500"
    v = httpclient.InferInput("v", [4], "FP32")
    v.set_data_from_numpy(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(triton.infer("broken", [v]).as_numpy("w"), np.arange(4, dtype=np.float32).reshape(2, 2))
    assert triton.is_server_live()


# --- the error matrix (TestClient) ----------------------------------------------------------


def _post(client: TestClient, model: str, header: dict[str, Any], **kw: Any) -> Any:
    return client.post(f"/v2/models/{model}/infer", content=json.dumps(header), **kw)


def _fp32(name: str, shape: list[int], data: list[float]) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "shape": shape, "data": data}


def test_json_infer_through_testclient(client: TestClient) -> None:
    r = _post(client, "adder", {"inputs": [_fp32("x", [1, 2], [1, 2]), _fp32("y", [1, 2], [3, 4])],
                                "outputs": [{"name": "out"}]})  # fmt: skip
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json()["outputs"] == [{"name": "out", "datatype": "FP32", "shape": [1, 2], "data": [4.0, 6.0]}]


def test_binary_body_through_testclient(client: TestClient) -> None:
    x, y = _xy(2)
    body = build_infer_request({"x": x, "y": y})
    r = client.post("/v2/models/adder/versions/1/infer", content=body.content, headers={HEADER_LENGTH: str(body.json_length)})
    assert r.status_code == 200
    got = parse_infer_response(r.content, r.headers[HEADER_LENGTH])
    np.testing.assert_allclose(got.outputs["doubled"], (x + y) * 2, rtol=1e-6)


@pytest.mark.parametrize(
    ("model", "header", "status", "needle"),
    [
        ("adder", {"inputs": [_fp32("x", [1, 2], [1, 2])]}, 400, "'y'"),  # a missing input
        ("adder", {"inputs": [_fp32("x", [1, 2], [1, 2]), _fp32("z", [1, 2], [1, 2])]}, 400, "'z'"),  # unknown input
        ("adder", {"inputs": [_fp32("x", [1, 3], [1, 2, 3]), _fp32("y", [1, 2], [1, 2])]}, 400, "'x'"),  # bad shape
        ("adder", {"inputs": [{"name": "x", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]},
                              _fp32("y", [1, 2], [1, 2])]}, 400, "'x'"),  # datatype disagrees with the spec
        ("adder", {"inputs": [_fp32("x", [1, 2], [1]), _fp32("y", [1, 2], [1, 2])]}, 400, "'x'"),  # element count
        ("adder", {"inputs": [_fp32("x", [1, 2], [1, 2]), _fp32("y", [1, 2], [1, 2])],
                   "outputs": [{"name": "nope"}]}, 400, "'nope'"),  # unknown requested output
        ("adder", {"inputs": [{"name": "x", "datatype": "BF16", "shape": [1], "data": [1]}]}, 400, "'x'"),
        ("nope", {"inputs": []}, 404, "'nope'"),
        ("broken", {"inputs": [_fp32("v", [3], [1, 2, 3])]}, 500, "'broken'"),
    ],
)
def test_error_matrix(client: TestClient, model: str, header: dict[str, Any], status: int, needle: str) -> None:
    r = _post(client, model, header)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]


def test_malformed_bodies(client: TestClient) -> None:
    r = client.post("/v2/models/adder/infer", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = client.post("/v2/models/adder/infer", content=b"{}", headers={HEADER_LENGTH: "99"})
    assert r.status_code == 400 and HEADER_LENGTH in r.json()["error"]
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2],
                                   "parameters": {"binary_data_size": 80}}]}).encode()  # fmt: skip
    r = client.post("/v2/models/adder/infer", content=body + b"\0" * 8, headers={HEADER_LENGTH: str(len(body))})
    assert r.status_code == 400 and "'x'" in r.json()["error"]


def test_unknown_model_and_version_are_404(client: TestClient) -> None:
    assert client.get("/v2/models/nope").status_code == 404
    assert client.get("/v2/models/nope/ready").status_code == 404
    r = client.get("/v2/models/adder/versions/7")
    assert r.status_code == 404 and "version" in r.json()["error"]


def test_body_over_limit_is_413_from_content_length(client: TestClient) -> None:
    r = client.post("/v2/models/adder/infer", content=b" " * 5000)
    assert r.status_code == 413 and "4,096" in r.json()["error"]


def test_chunked_body_over_limit_is_413_while_streaming(client: TestClient) -> None:
    sent = []

    def chunks() -> Iterator[bytes]:
        for _ in range(100):
            sent.append(1)
            yield b" " * 1000

    r = client.post("/v2/models/adder/infer", content=chunks())
    assert r.status_code == 413 and "while streaming" in r.json()["error"]


def test_auth_token(engine: Engine) -> None:
    with TestClient(create_app(engine, auth_token="s3cret")) as c:
        assert c.get("/v2/health/live").status_code == 200
        assert c.get("/v2/health/ready").status_code == 200
        for path in ("/v2", "/v2/models/adder", "/v2/models/adder/ready"):
            r = c.get(path)
            assert r.status_code == 401 and "Bearer" in r.json()["error"], path
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        r = _post(c, "adder", {"inputs": []})
        assert r.status_code == 401
