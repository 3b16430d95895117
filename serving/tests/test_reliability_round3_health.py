"""Bounded work per request on ``neuropod serve``: a large classification, gRPC health Watch.

One real ``neuropod serve`` (the command, in a subprocess, with a bearer token) serves for the
module ``scores`` (an ONNX model whose one output has 1.5 M entries, ``sin(i * x)``) and
``adder``. A classification of that output runs off the event loop, so health checks sent
meanwhile are answered at once; health ``Watch`` of names the server does not know answers
SERVICE_UNKNOWN and ends, and keeps nothing (the server's memory does not grow with them).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from grpc_health_helpers import Status, check, grpc, health_stub, request, served_with_token, watch  # noqa: E402
from neuropod.testing import Served  # noqa: E402
from neuropod_serving.protocol.options import classify  # noqa: E402
from neuropod_serving.server import Engine, ModelRegistry  # noqa: E402
from neuropod_serving.server.grpc_repository import StreamSlots  # noqa: E402
from neuropod_serving.server.health import add_health  # noqa: E402
from neuropod_serving.server.metrics import ServerMetrics  # noqa: E402

from conftest import adder_and_echo, descendants, onnx_package, private_caches  # noqa: E402

TOKEN = "r0und3-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENTRIES = 1_500_000


def _scores_model(models: Path) -> None:
    """``scores`` = sin(range(ENTRIES) * x): float32 [ENTRIES] from a float32 [1]."""
    from onnx import TensorProto, helper

    def scalar(name: str, value: float) -> Any:
        return helper.make_tensor(name, TensorProto.FLOAT, [], [value])

    onnx_package(
        models / "scores", "scores",
        [helper.make_node("Range", ["zero", "count", "one"], ["r"]), helper.make_node("Mul", ["r", "x"], ["rx"]),
         helper.make_node("Sin", ["rx"], ["scores"])],
        [("x", "float32", [1])], [("scores", "float32", [ENTRIES])],
        [scalar("zero", 0.0), scalar("count", float(ENTRIES)), scalar("one", 1.0)],
    )  # fmt: skip


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="neuropod-round3-health-"))
    try:
        with private_caches(path):
            adder_and_echo(path / "models", echo_as_zip=False)
            _scores_model(path / "models")
            yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Served]:
    with private_caches(root), served_with_token(root / "models", TOKEN) as s:
        yield s


# -- classification -------------------------------------------------------------------------


def _reference(values: np.ndarray, count: int, labels: list[str] | None) -> list[str]:
    """The top ``count`` of a 1-D ``values`` as Triton words them, by Python's own sort (NaN first)."""
    floating = values.dtype.kind == "f"
    items = values.tolist()

    def key(i: int) -> tuple[bool, float, int]:
        v = float(items[i])
        return (not math.isnan(v), -v if not math.isnan(v) else 0.0, i)

    out = []
    for i in sorted(range(len(items)), key=key)[:count]:
        text = f"{float(items[i]):f}:{i}" if floating else f"{int(items[i])}:{i}"
        out.append(f"{text}:{labels[i]}" if labels is not None and i < len(labels) else text)
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "uint64", "int8", "bool"])
@pytest.mark.parametrize("count", [1, 3, 40, 200])
def test_classify_matches_a_plain_sort(dtype: str, count: int) -> None:
    """Few classes (chosen by partition) and many (a full sort): ties go to the lower index, NaN ranks highest."""
    rng = np.random.default_rng(count)
    raw = rng.integers(0, 7, size=(3, 100))  # many ties
    values = raw.astype(dtype)
    if dtype.startswith("float"):
        values[0, [5, 50, 99]] = np.nan
        values[1] = rng.standard_normal(100)
    if dtype == "uint64":
        values[2, 7] = np.iinfo(np.uint64).max
    labels = [f"c{i}" for i in range(60)]  # indices past 60 have no label
    got = classify(values, count, labels, batched=True)
    assert got.shape == (3, min(count, 100)) and got.dtype == object
    for r in range(3):
        assert got[r].tolist() == _reference(values[r], count, labels), (dtype, count, r)
    whole = classify(values, count, None, batched=False)
    assert whole.tolist() == _reference(values.ravel(), count, None)


def test_classify_of_an_empty_output() -> None:
    assert classify(np.zeros((2, 0), np.float32), 5, None, batched=True).shape == (2, 0)


CLASSES = 500_000


def test_a_large_classification_leaves_health_answered(server: Served) -> None:
    """Health checks sent while the server ranks 500 000 classes of a 1.5 M entry output answer at once."""
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [0.001]}]}
    with httpx.Client(base_url=server.http, headers=AUTH, timeout=120) as http:
        raw = http.post("/v2/models/scores/infer", json=body)
        assert raw.status_code == 200, raw.text
        values = np.asarray(raw.json()["outputs"][0]["data"], dtype=np.float32)
        assert values.shape == (ENTRIES,)
        order = np.lexsort((np.arange(ENTRIES), -values.astype(np.float64)))[:CLASSES]
        floats = values.tolist()
        expected = [f"{floats[i]:f}:{i}" for i in order.tolist()]

        answer: dict[str, Any] = {}

        def classification() -> None:
            began = time.perf_counter()
            r = http.post(
                "/v2/models/scores/infer",
                json={**body, "outputs": [{"name": "scores", "parameters": {"classification": CLASSES}}]},
            )
            answer["seconds"] = time.perf_counter() - began
            answer["response"] = r

        latencies = []
        with httpx.Client(base_url=server.http, timeout=120) as probe:  # health needs no token
            thread = threading.Thread(target=classification)
            thread.start()
            while thread.is_alive():
                began = time.perf_counter()
                assert probe.get("/v2/health/ready").status_code == 200
                latencies.append(time.perf_counter() - began)
                time.sleep(0.005)
            thread.join()
    r = answer["response"]
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["datatype"] == "BYTES" and out["shape"] == [CLASSES]
    assert out["data"] == expected
    seconds = answer["seconds"]
    assert len(latencies) >= 3, (latencies, seconds)
    # The classification took `seconds`; on the event loop it held every health check that long.
    assert max(latencies) < seconds / 4, (
        f"a health check took {max(latencies):.3f} s during a {seconds:.3f} s classification"
    )


# -- gRPC health Watch ----------------------------------------------------------------------


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _server_pid() -> int:
    """The ``neuropod serve`` this module started (the one descendant of this process listening)."""
    pids = [p for p in descendants(os.getpid()) if b"serve" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(pids) == 1, pids
    return pids[0]


def test_watch_of_unknown_names_keeps_nothing(server: Served) -> None:
    """Watch of 200 unique names of 1 MiB each (no token: health needs none) leaves the server's memory as it was."""
    pid = _server_pid()
    with health_stub(server.grpc, options=[("grpc.max_send_message_length", -1)]) as stub:

        def first(service: str) -> Any:
            """The first answer of a Watch of ``service`` (a status or an error code); then the call is cancelled."""
            call = stub.Watch(request(service), timeout=10)
            try:
                return int(next(call).status)
            except grpc.RpcError as e:
                return e.code()
            finally:
                call.cancel()

        for i in range(20):  # warm the server's allocator up with the same calls
            first(f"{i:08d}" + "w" * (1 << 20))
        before = _rss_bytes(pid)
        answers = [first(f"{i:08d}" + "n" * (1 << 20)) for i in range(200)]
        grown = _rss_bytes(pid) - before
        assert grown < 40 << 20, f"the server grew {grown >> 20} MiB over 200 Watch calls of unknown names"
        # A name that long is no service here: refused, and nothing of it is kept.
        assert all(a == grpc.StatusCode.INVALID_ARGUMENT for a in answers), answers[:3]
        # A name of an ordinary length that is no model: SERVICE_UNKNOWN, and the stream ends.
        assert watch(stub, "no_such_model") == [Status.SERVICE_UNKNOWN]
        assert watch(stub, "adder" * 200) == [Status.SERVICE_UNKNOWN]
        # The server and its models still answer as before.
        assert check(stub, "adder") == Status.SERVING
        with pytest.raises(grpc.RpcError) as info:
            check(stub, "x" * (1 << 20))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(info.value.details()) < 400 and "at most 1024 characters" in info.value.details()


def test_a_closed_watch_leaves_nothing_behind(root: Path) -> None:
    """The real health service in process: watches of a model and of unknown names, closed; none is kept."""
    engine = Engine(ModelRegistry.load([root / "models"]), metrics=ServerMetrics())
    server = grpc.server(futures.ThreadPoolExecutor(4))
    slots = StreamSlots(8)
    health = add_health(server, engine, slots)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with health_stub(f"127.0.0.1:{port}") as stub:
            watches = [stub.Watch(request(s), timeout=30) for s in ("adder", "", "adder")]
            try:
                assert [int(next(w).status) for w in watches] == [Status.SERVING] * 3
                for i in range(50):
                    assert watch(stub, f"unknown-{i}", timeout=5) == [Status.SERVICE_UNKNOWN]
                assert health.open_watches() == 3 and slots.open == 3  # unknown names hold no stream slot
            finally:
                for w in watches:
                    w.cancel()
            deadline = time.monotonic() + 10
            while (health.open_watches() or slots.open) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert health.open_watches() == 0 and slots.open == 0
    finally:
        health.shut_down()
        server.stop(None).wait()
        engine.close()


def test_the_server_needs_no_grpc_health_package() -> None:
    """The server's gRPC side imports no grpcio-health-checking: that package's releases follow
    grpcio's protobuf (1.85: protobuf >= 7.35), which tritonclient (protobuf < 7) refuses, and a
    venv holding both could not start ``neuropod serve``. Its health messages are its own."""
    code = (
        "import sys, neuropod_serving.server.grpc_server, neuropod_serving.server.launcher as l; "
        "bad = sorted(m for m in sys.modules if m.startswith('grpc_health.')); "  # grpc imports the bare package
        "assert not bad and 'grpc_health' not in l.SERVER_MODULES, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
