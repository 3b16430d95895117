"""What a request asks besides its tensors, through the real `neuropod serve` and Triton's own clients.

* the classification extension (``class_count=k`` on a requested output), REST
  binary and JSON and gRPC, against numpy's ranking of the same outputs;
* the request ``timeout`` (and gRPC's own deadline): a request still waiting for
  a run slot, or in its batch, when it passes is answered and never run;
* request parameters reaching a model that takes them (a python model), and
  ignored by one that does not;
* tensor names with ``/``, ``:`` and ``.`` on ONNX and python packages.

Every server is the real command (:func:`neuropod.testing.served`) in a process
of its own, driven by tritonclient.http and tritonclient.grpc.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("neuropod_python")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from onnx import TensorProto, helper  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

import neuropod  # noqa: E402
from neuropod.packagers import create_python_neuropod  # noqa: E402
from neuropod.testing import Served, served  # noqa: E402

from conftest import onnx_package, private_caches  # noqa: E402

CLASSES = 6
LABELS = [f"class-{i}" for i in range(CLASSES)]
WEIGHTS = np.array([0.5, 2.0, 1.5, 3.0, 0.25, 1.0], np.float32)
# Names as Triton's example models have them.
IN_NAME = "input/x:0"
OUT_NAME = "InceptionV3/Predictions/Softmax:0"
#: How long a slow request runs, and the timeout of one that waits behind it (seconds).
SLOW_S = 1.5
TIMEOUT_US = 300_000

SLOW_CODE = """
import time

RUNS = [0]


def get_model(data_root):
    def run(x, *, parameters=None):
        # Sleeps x[0, 0] seconds; y[:, 1] says how many runs the model has made, this one included,
        # and y[:, 0] the rows of this run times the parameter "scale" (1 without it).
        RUNS[0] += 1
        time.sleep(float(x[0, 0]))
        y = x.copy()
        y[:, 1] = RUNS[0]
        y[:, 0] = len(x) * (parameters or {}).get("scale", 1)
        return {"y": y}

    return run
"""

PARAMS_CODE = """
import json

import numpy as np


def get_model(data_root):
    def run(x, *, parameters=None):
        p = parameters or {}
        return {"y": x * np.float32(p.get("scale", 1.0)),
                "seen": np.array([json.dumps(p, sort_keys=True)], dtype=object)}

    return run
"""

NAMES_CODE = """
def get_model(data_root):
    def run(**inputs):
        return {"InceptionV3/Predictions/Softmax:0": inputs["input/x:0"] * 2, "out.1": inputs["in.1"] + 1}

    return run
"""


def _python(dest: Path, name: str, code: str, inputs: list[Any], outputs: list[Any], **kw: Any) -> Path:
    src = dest.parent / f"{name}_code"
    src.mkdir(parents=True)
    (src / f"{name}_model.py").write_text(code)
    path: Path = create_python_neuropod(
        dest, name, [], [{"python_root": src, "dirs_to_package": [""]}], f"{name}_model", "get_model",
        inputs, outputs, **kw,
    )  # fmt: skip
    return path


def _slow(dest: Path) -> Path:
    shape = ["batch_size", 2]
    return _python(dest, "slow", SLOW_CODE, [{"name": "x", "dtype": "float32", "shape": shape}],
                   [{"name": "y", "dtype": "float32", "shape": shape}])  # fmt: skip


@pytest.fixture(scope="module")
def repo() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-options-test-"))
    with private_caches(root):
        models = root / "models"
        w = helper.make_tensor("w", TensorProto.FLOAT, [CLASSES], WEIGHTS.tolist())
        # probs = x * w (labelled), raw = x (no labels); both [batch_size, 6].
        onnx_package(models / "classifier", "classifier",
                     [helper.make_node("Mul", ["x", "w"], ["probs"]), helper.make_node("Identity", ["x"], ["raw"])],
                     [("x", "float32", ["batch_size", CLASSES])],
                     [("probs", "float32", ["batch_size", CLASSES]), ("raw", "float32", ["batch_size", CLASSES])],
                     [w], output_labels={"probs": LABELS})  # fmt: skip
        # No batch dimension: the whole tensor is one row of classes.
        onnx_package(models / "flat", "flat", [helper.make_node("Neg", ["v"], ["n"])],
                     [("v", "int32", [2, 3])], [("n", "int32", [2, 3])])  # fmt: skip
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        onnx_package(models / "names_onnx", "names_onnx",
                     [helper.make_node("Mul", [IN_NAME, "two"], [OUT_NAME]), helper.make_node("Add", ["in.1", "one"], ["out.1"])],
                     [(IN_NAME, "float32", ["batch_size", 3]), ("in.1", "int64", ["batch_size"])],
                     [(OUT_NAME, "float32", ["batch_size", 3]), ("out.1", "int64", ["batch_size"])],
                     [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]), helper.make_tensor("one", TensorProto.INT64, [], [1])],
                     test_input_data={IN_NAME: x, "in.1": np.array([4, 5])},
                     test_expected_out={OUT_NAME: x * 2, "out.1": np.array([5, 6])})  # fmt: skip
        _python(models / "names_python", "names_python", NAMES_CODE,
                [{"name": IN_NAME, "dtype": "float32", "shape": ["batch_size", 3]},
                 {"name": "in.1", "dtype": "int64", "shape": ["batch_size"]}],
                [{"name": OUT_NAME, "dtype": "float32", "shape": ["batch_size", 3]},
                 {"name": "out.1", "dtype": "int64", "shape": ["batch_size"]}],
                test_input_data={IN_NAME: x, "in.1": np.array([4, 5])},
                test_expected_out={OUT_NAME: x * 2, "out.1": np.array([5, 6])})  # fmt: skip
        _python(models / "params", "params", PARAMS_CODE, [{"name": "x", "dtype": "float32", "shape": [None, 2]}],
                [{"name": "y", "dtype": "float32", "shape": [None, 2]},
                 {"name": "seen", "dtype": "string", "shape": [1]}])  # fmt: skip
        _slow(models / "slow")
        _slow(root / "batched" / "slow")
        yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[Served]:
    with private_caches(repo), served(repo / "models", options=["--max-concurrent-runs", "1"]) as s:
        yield s


@pytest.fixture(scope="module")
def batching_server(repo: Path) -> Iterator[Served]:
    with private_caches(repo), served(repo / "batched", options=["--max-batch-size", "4"]) as s:
        yield s


def _http(s: Served) -> Any:
    return httpclient.InferenceServerClient(s.http.removeprefix("http://"), network_timeout=60)


def _grpc(s: Served) -> Any:
    return grpcclient.InferenceServerClient(s.grpc)


def _post(s: Served, model: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"{s.http}/v2/models/{model}/infer", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _texts(array: np.ndarray) -> list[Any]:
    return [v.decode() if isinstance(v, bytes) else v for v in array.ravel().tolist()]


def _expected_classes(values: np.ndarray, k: int, labels: list[str] | None) -> list[str]:
    """Triton's format from numpy's ranking: the k highest of one row, highest first."""
    row = values.ravel()
    order = np.argsort(-row.astype(np.float64), kind="stable")[: min(k, row.size)]
    score = (lambda v: f"{float(v):f}") if row.dtype.kind == "f" else (lambda v: str(int(v)))
    return [f"{score(row[i])}:{i}" + (f":{labels[i]}" if labels else "") for i in order]


# --- classification ------------------------------------------------------------


X = np.array([[0.3, 0.1, 0.9, 0.2, 0.8, 0.5], [1.0, 4.0, 0.5, 0.7, 2.0, 0.1]], np.float32)


@pytest.mark.parametrize("binary", [True, False])
def test_classification_rest_matches_numpy_ranking(server: Served, binary: bool) -> None:
    client = _http(server)
    inp = httpclient.InferInput("x", list(X.shape), "FP32")
    inp.set_data_from_numpy(X, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("probs", binary_data=binary, class_count=3),
               httpclient.InferRequestedOutput("raw", binary_data=binary, class_count=2)]  # fmt: skip
    result = client.infer("classifier", [inp], outputs=outputs)
    probs, raw = result.as_numpy("probs"), result.as_numpy("raw")
    assert probs.shape == (2, 3) and raw.shape == (2, 2)
    assert result.get_output("probs")["datatype"] == "BYTES"
    expected_probs = X * WEIGHTS  # what the model computes, in float32
    for r in range(2):
        assert _texts(probs[r]) == _expected_classes(expected_probs[r], 3, LABELS)
        assert _texts(raw[r]) == _expected_classes(X[r], 2, None)  # no labels for 'raw': score:index
    client.close()


def test_classification_grpc_and_unbatched_output(server: Served) -> None:
    client = _grpc(server)
    inp = grpcclient.InferInput("x", list(X.shape), "FP32")
    inp.set_data_from_numpy(X)
    result = client.infer("classifier", [inp], outputs=[grpcclient.InferRequestedOutput("probs", class_count=4),
                                                         grpcclient.InferRequestedOutput("raw")])  # fmt: skip
    probs = result.as_numpy("probs")
    assert probs.shape == (2, 4)
    for r in range(2):
        assert _texts(probs[r]) == _expected_classes((X * WEIGHTS)[r], 4, LABELS)
    np.testing.assert_array_equal(result.as_numpy("raw"), X)  # an output without class_count is the tensor
    # No batch dimension: the whole [2, 3] tensor is one row; k past its 6 entries answers 6.
    v = np.array([[3, -7, 12], [0, 5, -2]], np.int32)
    flat_in = grpcclient.InferInput("v", [2, 3], "INT32")
    flat_in.set_data_from_numpy(v)
    flat = client.infer("flat", [flat_in], outputs=[grpcclient.InferRequestedOutput("n", class_count=10)]).as_numpy("n")
    assert flat.shape == (6,)
    assert _texts(flat) == _expected_classes(-v, 10, None)
    client.close()


def test_classification_refusals(server: Served) -> None:
    x = {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}
    # A string output cannot be ranked: 400 naming it, on REST and gRPC.
    status, body = _post(
        server, "params", {"inputs": [x], "outputs": [{"name": "seen", "parameters": {"classification": 2}}]}
    )
    assert status == 400 and "'seen'" in body["error"] and "string tensor" in body["error"]
    for bad in (0, -1, "three", 1.5, True):
        status, body = _post(
            server, "params", {"inputs": [x], "outputs": [{"name": "y", "parameters": {"classification": bad}}]}
        )
        assert status == 400 and "output 'y'" in body["error"] and "integer >= 1" in body["error"], (bad, body)
    client = _grpc(server)
    inp = grpcclient.InferInput("x", [1, 2], "FP32")
    inp.set_data_from_numpy(np.ones((1, 2), np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("params", [inp], outputs=[grpcclient.InferRequestedOutput("seen", class_count=2)])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "'seen'" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.infer("params", [inp], outputs=[grpcclient.InferRequestedOutput("y", class_count=-3)])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "output 'y'" in info.value.message()
    client.close()


def test_server_metadata_lists_classification(server: Served) -> None:
    client = _http(server)
    assert "classification" in client.get_server_metadata()["extensions"]
    client.close()


# --- request parameters ------------------------------------------------------------


def test_parameters_reach_a_python_model_on_both_protocols(server: Served) -> None:
    x = np.array([[1.0, 2.0]], np.float32)
    h = _http(server)
    inp = httpclient.InferInput("x", [1, 2], "FP32")
    inp.set_data_from_numpy(x)
    # timeout is the server's (not the model's); the rest reach the model as sent.
    result = h.infer("params", [inp], parameters={"scale": 3, "tag": "abc", "flag": True}, timeout=10_000_000)
    np.testing.assert_array_equal(result.as_numpy("y"), x * 3)
    assert json.loads(_texts(result.as_numpy("seen"))[0]) == {"scale": 3, "tag": "abc", "flag": True}
    plain = h.infer("params", [inp])
    np.testing.assert_array_equal(plain.as_numpy("y"), x)
    assert json.loads(_texts(plain.as_numpy("seen"))[0]) == {}
    h.close()
    g = _grpc(server)
    ginp = grpcclient.InferInput("x", [1, 2], "FP32")
    ginp.set_data_from_numpy(x)
    result = g.infer("params", [ginp], parameters={"scale": 0.5, "tag": "g"})
    np.testing.assert_array_equal(result.as_numpy("y"), x * np.float32(0.5))
    assert json.loads(_texts(result.as_numpy("seen"))[0]) == {"scale": 0.5, "tag": "g"}
    g.close()


def test_parameters_reach_a_model_in_ope_workers(repo: Path) -> None:
    x = np.array([[1.0, 2.0]], np.float32)
    with private_caches(repo), served(repo / "models" / "params", options=["--workers", "2"]) as s:
        g = _grpc(s)
        inp = grpcclient.InferInput("x", [1, 2], "FP32")
        inp.set_data_from_numpy(x)
        result = g.infer("params", [inp], parameters={"scale": 5, "tag": "w"})
        np.testing.assert_array_equal(result.as_numpy("y"), x * 5)
        assert json.loads(_texts(result.as_numpy("seen"))[0]) == {"scale": 5, "tag": "w"}
        g.close()


def test_parameters_are_ignored_by_models_that_do_not_take_them(server: Served) -> None:
    client = _http(server)
    inp = httpclient.InferInput("x", list(X.shape), "FP32")
    inp.set_data_from_numpy(X)
    result = client.infer("classifier", [inp], parameters={"scale": 3})
    np.testing.assert_array_equal(result.as_numpy("probs"), X * WEIGHTS)
    client.close()


def test_bad_parameters_are_refused(server: Served) -> None:
    x = {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}
    status, body = _post(server, "params", {"inputs": [x], "parameters": {"scale": [1, 2]}})
    assert status == 400 and "request parameter 'scale'" in body["error"] and "list" in body["error"]
    for bad in (-1, "soon", 0.5, True):
        status, body = _post(server, "params", {"inputs": [x], "parameters": {"timeout": bad}})
        assert status == 400 and "parameters.timeout" in body["error"] and "microseconds" in body["error"], bad


def test_in_process_and_remote_models_take_parameters(repo: Path, server: Served) -> None:
    x = np.array([[1.0, -2.0]], np.float32)
    with private_caches(repo), neuropod.load_neuropod(repo / "models" / "params") as model:
        out = model.infer({"x": x}, parameters={"scale": 4})
        np.testing.assert_array_equal(out["y"], x * 4)
        assert json.loads(out["seen"][0]) == {"scale": 4}
        np.testing.assert_array_equal(model.infer({"x": x})["y"], x)  # none: the function's default
    for url in (f"grpc://{server.grpc}/params", f"{server.http}/params"):
        with neuropod.load_neuropod(url) as remote:
            out = remote.infer({"x": x}, parameters={"scale": 2, "who": url[:4]})
            np.testing.assert_array_equal(out["y"], x * 2)
            assert json.loads(out["seen"][0]) == {"scale": 2, "who": url[:4]}
            with pytest.raises(TypeError, match=r"parameters\['bad'\] must be a bool, int, float or str"):
                remote.infer({"x": x}, parameters={"bad": [1]})


# --- request timeout -------------------------------------------------------------


def _slow_input(seconds: float, rows: int = 1) -> np.ndarray:
    x = np.zeros((rows, 2), np.float32)
    x[0, 0] = seconds
    return x


def _http_slow(s: Served, seconds: float, **kw: Any) -> np.ndarray:
    client = _http(s)
    try:
        inp = httpclient.InferInput("x", [1, 2], "FP32")
        inp.set_data_from_numpy(_slow_input(seconds))
        return client.infer("slow", [inp], **kw).as_numpy("y")  # type: ignore[no-any-return]
    finally:
        client.close()


def _grpc_slow(s: Served, seconds: float, **kw: Any) -> np.ndarray:
    client = _grpc(s)
    try:
        inp = grpcclient.InferInput("x", [1, 2], "FP32")
        inp.set_data_from_numpy(_slow_input(seconds))
        return client.infer("slow", [inp], **kw).as_numpy("y")  # type: ignore[no-any-return]
    finally:
        client.close()


def _runs(s: Served) -> int:
    """How many runs the slow model has made (this one included)."""
    return int(_http_slow(s, 0.0)[0, 1])


def _behind_a_slow_run(s: Served, waiting: Any) -> tuple[float, BaseException | None, int]:
    """Start a run of SLOW_S seconds, then ``waiting()`` while it runs: how long that took, what
    it raised, and how many runs the model made meanwhile (the slow one, and ``waiting`` if it ran)."""
    before = _runs(s)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(_http_slow, s, SLOW_S)
        time.sleep(0.4)  # the slow request holds the model's one run slot by now
        started = time.monotonic()
        error = None
        try:
            waiting()
        except Exception as e:  # noqa: BLE001 - returned to the test
            error = e
        took = time.monotonic() - started
        slow.result(timeout=60)
    time.sleep(0.3)  # anything left waiting would have run by now
    return took, error, _runs(s) - before - 1


def test_rest_timeout_expires_in_the_queue_and_the_request_is_not_run(server: Served) -> None:
    took, error, runs = _behind_a_slow_run(server, lambda: _http_slow(server, 0.0, timeout=TIMEOUT_US))
    assert isinstance(error, InferenceServerException), error
    assert error.status() == "503" and "request timeout expired" in error.message()
    assert "model 'slow'" in error.message() and f"{TIMEOUT_US} µs" in error.message()
    assert took < SLOW_S - 0.2, f"answered after {took:.2f} s, not at its timeout"
    assert runs == 1  # the slow request only


def test_grpc_timeout_and_deadline_expire_in_the_queue(server: Served) -> None:
    took, error, runs = _behind_a_slow_run(server, lambda: _grpc_slow(server, 0.0, timeout=TIMEOUT_US))
    assert isinstance(error, InferenceServerException), error
    assert error.status() == "StatusCode.UNAVAILABLE" and "request timeout expired" in error.message()
    assert took < SLOW_S - 0.2 and runs == 1
    # The call's own deadline (tritonclient's client_timeout): the client gives up, and the server does not run it.
    took, error, runs = _behind_a_slow_run(server, lambda: _grpc_slow(server, 0.0, client_timeout=0.3))
    assert isinstance(error, InferenceServerException) and error.status() == "StatusCode.DEADLINE_EXCEEDED", error
    assert runs == 1


def test_a_request_that_runs_finishes_past_its_timeout(server: Served) -> None:
    # Nothing in the way: it gets the run slot at once, runs 0.6 s, past its 0.3 s timeout, and answers.
    y = _http_slow(server, 0.6, timeout=TIMEOUT_US)
    assert y.shape == (1, 2)
    y = _grpc_slow(server, 0.6, timeout=TIMEOUT_US)
    assert y.shape == (1, 2)


def test_timeout_expires_in_the_batchers_queue(batching_server: Served) -> None:
    s = batching_server
    took, error, runs = _behind_a_slow_run(s, lambda: _http_slow(s, 0.0, timeout=TIMEOUT_US))
    assert isinstance(error, InferenceServerException) and error.status() == "503", error
    assert "request timeout expired" in error.message() and "its batch" in error.message()
    assert took < SLOW_S - 0.2 and runs == 1
    took, error, runs = _behind_a_slow_run(s, lambda: _grpc_slow(s, 0.0, timeout=TIMEOUT_US))
    assert isinstance(error, InferenceServerException) and error.status() == "StatusCode.UNAVAILABLE", error
    assert runs == 1


def test_batched_requests_share_a_batch_only_with_equal_parameters(batching_server: Served) -> None:
    s = batching_server
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        slow = pool.submit(_http_slow, s, SLOW_S)
        time.sleep(0.4)  # the slow run holds the batcher's one run; these three queue behind it
        scales = (2, 3, 2)
        queued = [pool.submit(_http_slow, s, 0.0, parameters={"scale": k}) for k in scales]
        slow.result(timeout=60)
        got = [f.result(timeout=60) for f in queued]
    # y[0, 0] = rows in the run x its scale: the two requests of scale 2 ran together (2 rows), scale 3 alone.
    assert [float(y[0, 0]) for y in got] == [2 * 2, 1 * 3, 2 * 2]
    assert got[0][0, 1] == got[2][0, 1] != got[1][0, 1]  # the same run, and another one


# --- tensor names with '/', ':' and '.' ---------------------------------------------


@pytest.mark.parametrize("model", ["names_onnx", "names_python"])
def test_tensor_names_with_slashes_colons_and_dots(repo: Path, server: Served, model: str) -> None:
    x = np.array([[1.5, -2.0, 3.0], [0.0, 4.0, -1.0]], np.float32)
    n = np.array([7, -3], np.int64)
    expected = {OUT_NAME: x * 2, "out.1": n + 1}
    with private_caches(repo), neuropod.load_neuropod(repo / "models" / model) as local:
        assert [s.name for s in local.inputs] == [IN_NAME, "in.1"]
        got = local.infer({IN_NAME: x, "in.1": n})
        for k, v in expected.items():
            np.testing.assert_array_equal(got[k], v)
    h = _http(server)
    meta = h.get_model_metadata(model)
    assert [t["name"] for t in meta["outputs"]] == [OUT_NAME, "out.1"]
    for binary in (True, False):
        a = httpclient.InferInput(IN_NAME, list(x.shape), "FP32")
        a.set_data_from_numpy(x, binary_data=binary)
        b = httpclient.InferInput("in.1", [2], "INT64")
        b.set_data_from_numpy(n, binary_data=binary)
        outs = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in expected]
        result = h.infer(model, [a, b], outputs=outs)
        for k, v in expected.items():
            np.testing.assert_array_equal(result.as_numpy(k), v)
    h.close()
    g = _grpc(server)
    a = grpcclient.InferInput(IN_NAME, list(x.shape), "FP32")
    a.set_data_from_numpy(x)
    b = grpcclient.InferInput("in.1", [2], "INT64")
    b.set_data_from_numpy(n)
    result = g.infer(model, [a, b])
    for k, v in expected.items():
        np.testing.assert_array_equal(result.as_numpy(k), v)
    with pytest.raises(InferenceServerException) as info:
        bad = grpcclient.InferInput("input/x:1", list(x.shape), "FP32")
        bad.set_data_from_numpy(x)
        g.infer(model, [bad, b])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "'input/x:1'" in info.value.message()
    g.close()


# --- parsing, without a server -------------------------------------------------------


def test_plain_requests_have_no_options() -> None:
    from neuropod_serving.protocol import build_infer_request, parse_infer_request

    x = {"x": np.ones((1, 2), np.float32)}
    for body in (build_infer_request(x), build_infer_request(x, binary=False), build_infer_request(x, outputs=["y"])):
        assert parse_infer_request(body.content, body.json_length).options is None


def test_rest_options_are_parsed() -> None:
    from neuropod_serving.protocol import build_infer_request, parse_infer_request

    body = build_infer_request({"x": np.ones((1, 2), np.float32)},
                               parameters={"timeout": 2500, "priority": 1, "triton_x": 1, "mine": "v", "n": 2.5})  # fmt: skip
    options = parse_infer_request(body.content, body.json_length).options
    assert options.timeout_s == pytest.approx(0.0025) and options.timeout_us == 2500
    assert dict(options.parameters) == {"mine": "v", "n": 2.5} and options.classification is None
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
           "outputs": [{"name": "y", "parameters": {"classification": 3, "binary_data": False}}, {"name": "z"}]}  # fmt: skip
    options = parse_infer_request(json.dumps(doc).encode()).options
    assert dict(options.classification) == {"y": 3} and options.timeout_s is None and options.parameters is None


def test_grpc_options_from_tritonclients_own_messages() -> None:
    """Wire compatibility: a request built with tritonclient's own classes, read by our codec."""
    from tritonclient.grpc import service_pb2

    from neuropod_serving.protocol import ProtocolError, grpc_codec

    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    request.raw_input_contents.append(np.ones((1, 2), np.float32).tobytes())
    request.parameters["timeout"].int64_param = 5000
    request.parameters["scale"].double_param = 1.5
    request.parameters["sequence_id"].int64_param = 9
    out = request.outputs.add(name="y")
    out.parameters["classification"].int64_param = 4
    request.outputs.add(name="z")
    decoded = grpc_codec.deserialize_model_infer_request(request.SerializeToString()).decode()
    options = decoded.options
    assert options.timeout_us == 5000 and dict(options.parameters) == {"scale": 1.5}
    assert dict(options.classification) == {"y": 4} and list(decoded.outputs) == ["y", "z"]
    # A second message of the same form is read from the remembered plan, options included.
    again = grpc_codec.deserialize_model_infer_request(request.SerializeToString()).decode()
    assert again.options == options
    bad = service_pb2.ModelInferRequest(model_name="m")
    bad.outputs.add(name="y").parameters["classification"].string_param = "3"
    with pytest.raises(ProtocolError, match=r"output 'y': parameters.classification is the number of classes"):
        grpc_codec.deserialize_model_infer_request(bad.SerializeToString()).decode()


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8", "bool"])
def test_classify_ranks_as_numpy_does(dtype: str) -> None:
    from neuropod_serving.protocol.options import classify

    rng = np.random.default_rng(7)
    values = (rng.permutation(12).reshape(3, 4) % (2 if dtype == "bool" else 12)).astype(dtype)
    got = classify(values, 3, ["a", "b", "c", "d"], batched=True)
    assert got.shape == (3, 3)
    for r in range(3):
        # Ties go to the lower index (a stable sort of the negated scores).
        order = np.argsort(-values[r].astype(np.float64), kind="stable")[:3]
        score = (lambda v: f"{float(v):f}") if values.dtype.kind == "f" else (lambda v: str(int(v)))
        assert got[r].tolist() == [f"{score(values[r][i])}:{i}:{'abcd'[i]}" for i in order]
    whole = classify(values, 100, None, batched=False)
    assert whole.shape == (12,) and len(set(whole.tolist())) == 12
