"""What a hostile client or a careless model or config cannot do to ``neuropod serve``.

One real server (``neuropod.testing.served``, ``--allow-client-shm``) serves real packages:

- a client that truncates its shared memory object while the server copies a tensor through it
  gets an error (or its answer), never a server killed by SIGBUS (``cutter`` truncates its output
  region from a thread while the server writes into it; the client truncates an input region
  while the server reads it);
- a model whose ``infer`` raises ``SystemExit`` or ``KeyboardInterrupt`` (``quitter``) is
  answered with an error at once, on REST and gRPC, and the server keeps serving;
- a repository load whose config holds a number JSON cannot hold (``1e999``, ``-Infinity``,
  ``NaN``) or a fractional dim is a 400 / INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
grpc = pytest.importorskip("grpc")
httpx = pytest.importorskip("httpx")
pytest.importorskip("tritonclient.grpc")

import tritonclient.grpc as triton_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from neuropod.errors import NeuropodError  # noqa: E402
from neuropod.packagers import create_python_neuropod  # noqa: E402
from neuropod.testing import served  # noqa: E402
from neuropod_serving.server import BatchPolicy, Engine, ModelRegistry  # noqa: E402

from conftest import adder_and_echo, private_caches, python_package  # noqa: E402

#: Bytes of the tensors copied through shared memory: a copy long enough (tens of ms) for a
#: truncation to land in it.
BIG = 128 << 20

CUTTER = """
import os
import threading
import time

import numpy as np


def get_model(data_root):
    def model(size, key, cut_after_ms):
        y = np.ones(int(size[0]), np.uint8)
        delay = float(cut_after_ms[0]) / 1000

        def cut():
            time.sleep(delay)
            os.truncate("/dev/shm/" + str(key[0]).lstrip("/"), 0)

        # Truncates the client's output region while the server copies y into it.
        threading.Thread(target=cut, daemon=True).start()
        return {"y": y}
    return model
"""

SINK = """
import numpy as np


def get_model(data_root):
    def model(x):
        return {"n": np.array([x.size], np.int64)}
    return model
"""

QUITTER = """
import sys


def get_model(data_root):
    def model(x):
        how = int(x.flat[0])
        if how == 1:
            raise SystemExit(3)
        if how == 2:
            raise KeyboardInterrupt
        if how == 3:
            sys.exit("the model gave up")
        return {"y": x + 1}
    return model
"""


def _python(dest: Path, name: str, code: str, inputs: list[Any], outputs: list[Any]) -> None:
    src = dest.parent.parent / f"{name}_code"
    src.mkdir(parents=True)
    (src / f"{name}_model.py").write_text(code)
    create_python_neuropod(dest, name, [], [{"python_root": src, "dirs_to_package": [""]}], f"{name}_model",
                           "get_model", inputs, outputs)  # fmt: skip


@pytest.fixture(scope="module")
def models() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-rel3-"))
    try:
        with private_caches(root):
            models = root / "models"
            adder_and_echo(models, echo_as_zip=False)
            python_package(models / "quitter", "quitter", QUITTER)
            _python(models / "cutter", "cutter", CUTTER,
                    [{"name": "size", "dtype": "int64", "shape": [1]}, {"name": "key", "dtype": "string", "shape": [1]},
                     {"name": "cut_after_ms", "dtype": "float32", "shape": [1]}],
                    [{"name": "y", "dtype": "uint8", "shape": [None]}])  # fmt: skip
            _python(models / "sink", "sink", SINK, [{"name": "x", "dtype": "uint8", "shape": [None]}],
                    [{"name": "n", "dtype": "int64", "shape": [1]}])  # fmt: skip
            yield models
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Server:
    def __init__(self, http: str, grpc_url: str) -> None:
        self.http = httpx.Client(base_url=http, timeout=60)
        self.grpc = triton_grpc.InferenceServerClient(grpc_url)

    def alive(self) -> None:
        """The server answers health and an ordinary request (it was not killed)."""
        assert self.http.get("/v2/health/live").status_code == 200
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [0, 5]}]}
        r = self.http.post("/v2/models/quitter/infer", json=body)
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [1.0, 6.0], r.text


@pytest.fixture(scope="module")
def server(models: Path) -> Iterator[Server]:
    with private_caches(models.parent), served(models, options=["--allow-client-shm"]) as where:
        s = Server(where.http, where.grpc)
        try:
            yield s
        finally:
            s.http.close()
            s.grpc.close()


@pytest.fixture
def segments(server: Server) -> Iterator[list[str]]:
    """Shared memory objects a test creates (``/dev/shm/<key>``): unregistered and removed after it."""
    made: list[str] = []
    try:
        yield made
        server.http.post("/v2/systemsharedmemory/unregister")
    finally:  # removed even when the server is gone
        for key in made:
            try:
                os.unlink(f"/dev/shm/{key}")
            except FileNotFoundError:
                pass


def _segment(server: Server, segments: list[str], size: int, fill: int | None = None) -> tuple[str, str]:
    """A new shared memory object of ``size`` bytes (each ``fill`` when given), registered whole;
    (its key, its region's name)."""
    key = f"neuropod-rel3-{uuid.uuid4().hex[:12]}"
    fd = os.open(f"/dev/shm/{key}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    segments.append(key)
    try:
        os.ftruncate(fd, size)
        if fill is not None:
            os.pwrite(fd, bytes([fill]) * size, 0)
    finally:
        os.close(fd)
    region = f"r-{key}"
    r = server.http.post(f"/v2/systemsharedmemory/region/{region}/register",
                         json={"key": f"/{key}", "offset": 0, "byte_size": size})  # fmt: skip
    assert r.status_code == 200, r.text
    return key, region


# --- shared memory truncated during a copy ---------------------------------------------------


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory in /dev/shm")
def test_an_output_region_truncated_during_the_copy_does_not_kill_the_server(
    server: Server, segments: list[str]
) -> None:
    for delay_ms in (0.0, 2.0, 8.0, 20.0):
        key, region = _segment(server, segments, BIG)
        body = {
            "inputs": [
                {"name": "size", "datatype": "INT64", "shape": [1], "data": [BIG]},
                {"name": "key", "datatype": "BYTES", "shape": [1], "data": [key]},
                {"name": "cut_after_ms", "datatype": "FP32", "shape": [1], "data": [delay_ms]},
            ],
            "outputs": [{"name": "y", "parameters": {"shared_memory_region": region, "shared_memory_byte_size": BIG}}],
        }
        try:
            r = server.http.post("/v2/models/cutter/infer", json=body)
        except httpx.TransportError as e:
            pytest.fail(f"the server died while writing an output into a region truncated after {delay_ms} ms: {e!r}")
        # Written whole before the truncation took effect, or refused: never a half-written answer.
        if r.status_code == 200:
            (out,) = r.json()["outputs"]
            assert out == {"name": "y", "datatype": "UINT8", "shape": [BIG]}  # its data went to the region
        else:
            assert r.status_code == 400, r.text
            assert region in r.json()["error"] and "shrank" in r.json()["error"], r.text
        server.alive()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory in /dev/shm")
def test_an_input_region_truncated_during_the_copy_is_a_400_not_a_dead_server(
    server: Server, segments: list[str]
) -> None:
    answers: list[int] = []
    for delay_ms in (0.5, 2.0, 5.0, 10.0, 20.0):
        key, region = _segment(server, segments, BIG, fill=7)
        body = {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [BIG],
                            "parameters": {"shared_memory_region": region, "shared_memory_byte_size": BIG}}]}  # fmt: skip
        cutter = threading.Timer(delay_ms / 1000, os.truncate, (f"/dev/shm/{key}", 0))
        cutter.start()
        try:
            r = server.http.post("/v2/models/sink/infer", json=body)
        except httpx.TransportError as e:
            pytest.fail(f"the server died while reading an input from a region truncated after {delay_ms} ms: {e!r}")
        finally:
            cutter.join()
        answers.append(r.status_code)
        if r.status_code == 200:  # read whole before the truncation
            assert r.json()["outputs"][0]["data"] == [BIG]
        else:
            message = r.json()["error"]
            assert r.status_code == 400 and region in message and "shrank" in message, r.text
        server.alive()
    assert 400 in answers, f"no truncation landed before or during a copy: {answers}"


# --- SystemExit and KeyboardInterrupt in a model's infer -----------------------------------------


@pytest.mark.parametrize(("how", "raised"), [(1, "SystemExit"), (2, "KeyboardInterrupt"), (3, "SystemExit")])
def test_a_model_raising_systemexit_or_keyboardinterrupt_is_an_error_at_once(
    server: Server, how: int, raised: str
) -> None:
    x = np.array([[how, 0]], np.float32)
    r = server.http.post(
        "/v2/models/quitter/infer",
        json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [how, 0]}]},
    )
    assert r.status_code == 500, r.text
    message = r.json()["error"]
    assert "'quitter'" in message and raised in message, message
    inp = triton_grpc.InferInput("x", [1, 2], "FP32")
    inp.set_data_from_numpy(x)
    began = time.monotonic()
    with pytest.raises(InferenceServerException) as info:
        server.grpc.infer("quitter", [inp], client_timeout=20)
    assert time.monotonic() - began < 5, "the gRPC call waited for its deadline"
    assert info.value.status() == "StatusCode.INTERNAL", info.value
    assert "'quitter'" in info.value.message() and raised in info.value.message(), info.value.message()
    server.alive()


def test_a_batched_model_raising_systemexit_fails_its_request_not_its_batcher(models: Path) -> None:
    """On a worker thread, as the gRPC server runs requests; the batch's thread lives on."""
    with private_caches(models.parent):
        engine = Engine(ModelRegistry.load([models / "quitter"]), batching=BatchPolicy(max_batch_size=4))
    try:
        served_model = engine.get("quitter")
        with ThreadPoolExecutor(1) as pool:
            for how in (1, 2):
                call = pool.submit(engine.infer_blocking, served_model, {"x": np.array([[how, 0]], np.float32)})
                with pytest.raises(NeuropodError, match="model 'quitter' raised (SystemExit|KeyboardInterrupt)"):
                    call.result(timeout=30)
            out = pool.submit(engine.infer_blocking, served_model, {"x": np.array([[0, 1]], np.float32)}).result(30)
        np.testing.assert_array_equal(out["y"], [[1, 2]])
    finally:
        engine.close()


def test_a_keyboardinterrupt_on_the_main_thread_stays_the_users(models: Path) -> None:
    """A program of its own running the engine on its main thread keeps its Ctrl-C."""
    with private_caches(models.parent):
        engine = Engine(ModelRegistry.load([models / "quitter"]))
    try:
        served_model = engine.get("quitter")
        with pytest.raises(KeyboardInterrupt):
            engine.infer_blocking(served_model, {"x": np.array([[2, 0]], np.float32)})
        with pytest.raises(NeuropodError, match=r"model 'quitter' raised SystemExit\(3\)"):
            engine.infer_blocking(served_model, {"x": np.array([[1, 0]], np.float32)})
    finally:
        engine.close()


# --- numbers JSON cannot hold in a load's config -------------------------------------------------


@pytest.mark.parametrize("number", ["1e999", "-Infinity", "NaN", "2.5", "true"])
@pytest.mark.parametrize("field", ["input", "output"])
def test_a_load_config_with_an_impossible_dim_is_refused_naming_it(server: Server, field: str, number: str) -> None:
    name = "x" if field == "input" else "out"
    config = f'{{"{field}": [{{"name": "{name}", "data_type": "TYPE_FP32", "dims": [-1, {number}]}}]}}'
    r = server.http.post("/v2/repository/models/adder/load", json={"parameters": {"config": config}})
    assert r.status_code == 400, r.text
    message = r.json()["error"]
    assert f"{field} {name!r}: dims" in message and "whole number" in message, message
    with pytest.raises(InferenceServerException) as info:
        server.grpc.load_model("adder", config=config)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
    assert f"{field} {name!r}: dims" in info.value.message()
    assert server.http.get("/v2/models/adder/ready").status_code == 200


def test_every_number_of_a_load_config_refuses_non_finite_values(server: Server) -> None:
    """Each numeric field of a model's and an ensemble's load config, given 1e999, is a 400 naming it."""
    state = {"input_name": "x", "output_name": "out", "data_type": "TYPE_FP32", "dims": [2]}
    ensemble = {
        "platform": "ensemble", "max_batch_size": 4,
        "ensemble_scheduling": {"step": [{"model_name": "adder", "input_map": {"x": "x", "y": "y"},
                                          "output_map": {"out": "o"}}]},
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [2]},
                  {"name": "y", "data_type": "TYPE_FP32", "dims": [2]}],
        "output": [{"name": "o", "data_type": "TYPE_FP32", "dims": [2]}],
    }  # fmt: skip
    INF = float("inf")
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("adder", {"max_batch_size": INF}, "max_batch_size"),
        ("adder", {"max_batch_size": 4, "dynamic_batching": {"max_queue_delay_microseconds": INF}},
         "dynamic_batching.max_queue_delay_microseconds"),
        ("adder", {"max_batch_size": 4, "dynamic_batching": {"preferred_batch_size": [INF]}},
         "dynamic_batching.preferred_batch_size"),
        ("adder", {"instance_group": [{"count": INF}]}, "instance_group[0].count"),
        ("adder", {"instance_group": [{"kind": "KIND_GPU", "gpus": [INF]}]}, "instance_group[0].gpus[0]"),
        ("adder", {"input": [{"name": "x", "format": INF}]}, "format"),
        ("adder", {"sequence_batching": {"max_sequence_idle_microseconds": INF, "state": [state]}},
         "sequence_batching.max_sequence_idle_microseconds"),
        ("adder", {"sequence_batching": {"state": [{**state, "dims": [INF]}]}}, "sequence_batching.state[0].dims"),
        ("adder", {"sequence_batching": {"oldest": {"max_candidate_sequences": INF}, "state": [state]}},
         "sequence_batching.oldest.max_candidate_sequences"),
        ("adder", {"sequence_batching": {"direct": {"max_queue_delay_microseconds": INF}, "state": [state]}},
         "sequence_batching.direct.max_queue_delay_microseconds"),
        ("adder", {"max_batch_size": 4, "dynamic_batching": {"preserve_ordering": float("nan")}},
         "dynamic_batching.preserve_ordering"),
        ("adder", {"sequence_batching": {"control_input": [
            {"name": "y", "control": [{"kind": "CONTROL_SEQUENCE_START", "fp32_false_true": [INF, 1]}]}]}},
         "fp32_false_true"),
        ("ens", {**ensemble, "max_batch_size": INF}, "max_batch_size"),
        ("ens", {**ensemble, "ensemble_scheduling": {**ensemble["ensemble_scheduling"], "max_inflight_requests": INF}},
         "ensemble_scheduling.max_inflight_requests"),
        ("ens", {**ensemble, "ensemble_scheduling": {"step": [
            {**ensemble["ensemble_scheduling"]["step"][0], "model_version": INF}]}},
         "ensemble_scheduling.step[0].model_version"),
        ("ens", {**ensemble, "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [INF]}, ensemble["input"][1]]},
         "input[0].dims"),
    ]  # fmt: skip
    for model, config, field in cases:
        text = json.dumps(config)  # Python writes inf as Infinity, which JSON parsers of the server accept
        r = server.http.post(f"/v2/repository/models/{model}/load", json={"parameters": {"config": text}})
        assert r.status_code == 400, (field, r.text)
        assert field in r.json()["error"], (field, r.text)
    assert server.http.get("/v2/models/adder/ready").status_code == 200
