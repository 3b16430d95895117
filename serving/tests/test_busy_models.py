"""Busy models never starve the server, and never each other (real servers, real clients).

``sleeper`` is a Python model that sleeps as many seconds as its first input
value says (0: a fast run), so a test chooses which call is slow. Every check
times what a client waits for: health, metadata and an unrelated model must
answer within :data:`PROMPT_S` while ``sleeper`` is busy, on REST and gRPC;
a model whose queue is full refuses at once (429, RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
httpx = pytest.importorskip("httpx")
grpc = pytest.importorskip("grpc")

from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb  # noqa: E402
from neuropod_serving.server import BatchPolicy, Engine, ModelLimits, ModelRegistry, create_app  # noqa: E402
from neuropod_serving.server.grpc_server import start_grpc_server  # noqa: E402

from conftest import adder_and_echo, private_caches, python_package, serve_in_thread  # noqa: E402

#: What "at once" means here: far below any model's sleep, far above a loaded CI runner's jitter.
PROMPT_S = 0.4
SLOW_S = 1.0

SLEEPER = """
import time

def get_model(data_root):
    def model(x):
        delay = float(x.flat[0])
        if delay > 0:
            time.sleep(delay)
        return {"y": x + 1}
    return model
"""


@pytest.fixture(scope="module")
def repository() -> Iterator[Path]:
    """``sleeper`` (Python) beside ``adder`` and ``echo`` (ONNX, fast)."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-busy-test-"))
    with private_caches(root):
        adder_and_echo(root / "models", echo_as_zip=False)
        python_package(root / "models" / "sleeper", "sleeper", SLEEPER)
        yield root / "models"
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class Server:
    engine: Engine
    http: Any  # httpx.Client
    rest: str  # base URL
    grpc: str  # host:port


@contextmanager
def serving(
    models: Path, *, limits: ModelLimits | None = None, batching: BatchPolicy | None = None
) -> Iterator[Server]:
    """REST (uvicorn in a thread) and gRPC over one engine, as ``neuropod serve`` runs them."""
    engine = Engine(ModelRegistry.load([models]), limits=limits, batching=batching)
    grpc_server, port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
    try:
        with serve_in_thread(create_app(engine)) as http_port:
            base = f"http://127.0.0.1:{http_port}"
            with httpx.Client(base_url=base, timeout=30) as http:
                yield Server(engine, http, base, f"127.0.0.1:{port}")
    finally:
        grpc_server.stop(None)
        engine.close()


@pytest.fixture
def server(repository: Path) -> Iterator[Server]:
    with serving(repository) as s:
        yield s


def _body(delay: float, rows: int = 1) -> dict[str, Any]:
    data = [delay] + [0.0] * (2 * rows - 1)
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 2], "data": data}]}


def _rest_sleep(base: str, delay: float) -> httpx.Response:
    """One call of ``sleeper`` on a connection of its own (a client per slow call, as separate clients)."""
    with httpx.Client(base_url=base, timeout=30) as c:
        return c.post("/v2/models/sleeper/infer", json=_body(delay))


class GrpcClient:
    """Plain grpcio calls of GRPCInferenceService (tritonclient.grpc cannot share a process with
    the server's ``inference.*`` messages; test_grpc.py drives it in a subprocess)."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)

    def call(self, method: str, request: Any, response: Any) -> Any:
        rpc = self.channel.unary_unary(
            f"/inference.GRPCInferenceService/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response.FromString,
        )
        return rpc(request, timeout=30)

    def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        request = pb.ModelInferRequest(model_name=model)
        for name, a in inputs.items():
            request.inputs.add(name=name, datatype="FP32", shape=list(a.shape))
            request.raw_input_contents.append(np.ascontiguousarray(a, np.float32).tobytes())
        reply = self.call("ModelInfer", request, pb.ModelInferResponse)
        return {
            o.name: np.frombuffer(raw, np.float32).reshape(list(o.shape))
            for o, raw in zip(reply.outputs, reply.raw_output_contents)
        }

    def close(self) -> None:
        self.channel.close()


def _grpc_sleep(url: str, delay: float) -> dict[str, np.ndarray]:
    client = GrpcClient(url)
    try:
        return client.infer("sleeper", {"x": np.array([[delay, 0.0]], np.float32)})
    finally:
        client.close()


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def _busy(calls: list[Callable[[], Any]], settle: Callable[[], bool]) -> tuple[ThreadPoolExecutor, list[Any]]:
    """Start ``calls`` in threads and wait until ``settle()`` says the server holds them."""
    pool = ThreadPoolExecutor(len(calls))
    futures = [pool.submit(c) for c in calls]
    deadline = time.monotonic() + 10
    while not settle():
        assert time.monotonic() < deadline, "the slow calls never reached the server"
        time.sleep(0.01)
    return pool, futures


def _pending(engine: Engine, name: str) -> int:
    return engine._runners[(name, "1")].gate.pending


def _rest_adder_ok(http: Any) -> None:
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]} for n in "xy"]}
    r = http.post("/v2/models/adder/infer", json=body)
    assert r.status_code == 200, r.text
    assert {o["name"]: o["data"] for o in r.json()["outputs"]} == {"out": [2.0, 4.0], "doubled": [4.0, 8.0]}


def test_rest_health_answers_during_a_slow_call_of_a_usually_fast_model(server: Server) -> None:
    """The model has been fast for dozens of calls; one slow call must still not hold the event loop."""
    for _ in range(60):
        r = server.http.post("/v2/models/sleeper/infer", json=_body(0.0))
        assert r.status_code == 200, r.text
    pool, futures = _busy([lambda: _rest_sleep(server.rest, SLOW_S)], lambda: _pending(server.engine, "sleeper") == 1)
    with pool:
        for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/sleeper", "/v2/models/adder/ready"):
            waited, r = _timed(lambda: server.http.get(path))  # noqa: B023 - called at once
            assert r.status_code == 200, (path, r.text)
            assert waited < PROMPT_S, f"GET {path} took {waited:.2f} s while sleeper ran one slow call"
        assert not futures[0].done(), "the slow call ended before the probes: the test measured nothing"
        assert futures[0].result().status_code == 200


def test_grpc_health_and_metadata_answer_behind_20_slow_calls(server: Server) -> None:
    calls = [lambda: _grpc_sleep(server.grpc, 0.5) for _ in range(20)]
    pool, futures = _busy(calls, lambda: _pending(server.engine, "sleeper") == 20)
    with pool:
        client = GrpcClient(server.grpc)
        try:
            for name, request, response, answered in [
                ("ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse, lambda r: r.live),
                ("ServerReady", pb.ServerReadyRequest(), pb.ServerReadyResponse, lambda r: r.ready),
                ("ServerMetadata", pb.ServerMetadataRequest(), pb.ServerMetadataResponse, lambda r: r.name),
                ("ModelMetadata", pb.ModelMetadataRequest(name="sleeper"), pb.ModelMetadataResponse,
                 lambda r: r.name == "sleeper"),
                ("ModelReady", pb.ModelReadyRequest(name="adder"), pb.ModelReadyResponse, lambda r: r.ready),
            ]:  # fmt: skip
                waited, answer = _timed(lambda: client.call(name, request, response))  # noqa: B023 - called at once
                assert answered(answer), (name, answer)
                assert waited < PROMPT_S, f"gRPC {name} took {waited:.2f} s behind 20 slow calls of sleeper"
        finally:
            client.close()
        assert sum(not f.done() for f in futures) >= 10, "the slow calls ended before the probes"
        for f in futures:
            np.testing.assert_array_equal(f.result()["y"], [[1.5, 1.0]])


@pytest.mark.parametrize("protocol", ["rest", "grpc"])
def test_a_busy_model_does_not_block_another(server: Server, protocol: str) -> None:
    """More slow calls than a model may run at once: another model still answers at once, both protocols."""
    slow = [lambda: _rest_sleep(server.rest, SLOW_S) for _ in range(3)]
    slow += [lambda: _grpc_sleep(server.grpc, SLOW_S) for _ in range(3)]
    pool, futures = _busy(slow, lambda: _pending(server.engine, "sleeper") == 6)
    with pool:
        if protocol == "rest":
            waited, _ = _timed(lambda: _rest_adder_ok(server.http))
        else:
            client = GrpcClient(server.grpc)
            x = np.array([[1.0, 2.0]], np.float32)
            try:
                waited, result = _timed(lambda: client.infer("adder", {"x": x, "y": x}))
            finally:
                client.close()
            np.testing.assert_array_equal(result["out"], [[2.0, 4.0]])
        assert waited < PROMPT_S, f"adder waited {waited:.2f} s behind 6 slow calls of sleeper ({protocol})"
        assert not all(f.done() for f in futures), "the slow calls ended before adder was called"
        for f in futures:
            f.result()


@pytest.mark.parametrize("batched", [False, True], ids=["unbatched", "batched"])
def test_a_full_queue_is_refused_at_once(repository: Path, batched: bool) -> None:
    """One run at once and one waiting (batched: one batch of 2 rows and one waiting): the next
    requests get 429 / RESOURCE_EXHAUSTED at once, naming the model and the flags."""
    batching = BatchPolicy(2, 0.0) if batched else None
    held = 3 if batched else 2
    with serving(repository, limits=ModelLimits(max_concurrent=1, max_queued=1), batching=batching) as s:
        slow = [lambda: _rest_sleep(s.rest, SLOW_S) for _ in range(held)]
        pool, futures = _busy(slow, lambda: _pending(s.engine, "sleeper") == held)
        with pool:
            waited, r = _timed(lambda: s.http.post("/v2/models/sleeper/infer", json=_body(0.0)))
            assert r.status_code == 429, r.text
            message = r.json()["error"]
            assert "'sleeper'" in message and "--max-queued-requests" in message, message
            assert waited < PROMPT_S, f"the refusal took {waited:.2f} s"
            started = time.perf_counter()
            with pytest.raises(grpc.RpcError) as info:
                _grpc_sleep(s.grpc, 0.0)
            waited = time.perf_counter() - started
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
            assert "'sleeper'" in info.value.details()
            assert waited < PROMPT_S, f"the gRPC refusal took {waited:.2f} s"
            _rest_adder_ok(s.http)  # another model is not refused
            assert all(f.result().status_code == 200 for f in futures)
        # Once the queue drained, the model answers again.
        r = s.http.post("/v2/models/sleeper/infer", json=_body(0.0))
        assert r.status_code == 200, r.text


def test_model_runs_at_once_are_bounded(repository: Path) -> None:
    """Two runs at once: four slow calls take two rounds, and the model never runs more than two."""
    with serving(repository, limits=ModelLimits(max_concurrent=2)) as s:
        gate = s.engine._runners[("sleeper", "1")].gate
        most = 0
        stop = threading.Event()

        def watch() -> None:
            nonlocal most
            while not stop.is_set():
                most = max(most, gate.running)
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            started = time.perf_counter()
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda _: _rest_sleep(s.rest, 0.3), range(4)))
            took = time.perf_counter() - started
        finally:
            stop.set()
            watcher.join()
        assert all(r.status_code == 200 for r in results)
        assert most == 2, f"sleeper ran {most} requests at once; its limit is 2"
        assert took >= 0.55, f"four 0.3 s calls with two at once took {took:.2f} s: they were not bounded"


def test_cli_flags_and_defaults(tmp_path: Path) -> None:
    """The flags reach the engine, and the CLI's defaults are neuropod_serving.defaults'."""
    import argparse

    from neuropod_serving import cli, defaults

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([str(tmp_path)])
    assert (args.max_concurrent_runs, args.max_queued_requests) == (None, defaults.DEFAULT_MAX_QUEUED)
    args = parser.parse_args([str(tmp_path), "--max-concurrent-runs", "3", "--max-queued-requests", "0"])
    assert (args.max_concurrent_runs, args.max_queued_requests) == (3, 0)
    with pytest.raises(SystemExit):
        parser.parse_args([str(tmp_path), "--max-concurrent-runs", "0"])
    with pytest.raises(ValueError, match="max_queued"):
        ModelLimits(max_queued=-1)


def test_a_fast_graph_model_runs_on_the_loop_until_an_input_is_larger(repository: Path) -> None:
    """The fast path stays: small requests to a proven-fast ONNX model run on the event loop's
    thread; a first input larger than any it ran fast goes to the model's threads."""
    import asyncio

    engine = Engine(ModelRegistry.load([repository / "adder"]))
    try:
        served = engine.get("adder")
        real = served.model.infer
        threads: list[str] = []

        def recording(inputs: Any, requested: Any = None) -> Any:
            threads.append(threading.current_thread().name)
            return real(inputs, requested)

        served.model.infer = recording  # type: ignore[method-assign]

        async def calls(rows: int, n: int) -> None:
            x = np.ones((rows, 2), np.float32)
            for _ in range(n):
                out = await engine.infer(served, {"x": x, "y": x})
                np.testing.assert_array_equal(out["out"], x + x)

        asyncio.run(calls(2, 100))
        loop_thread = threading.current_thread().name
        assert threads[0] != loop_thread, "a model's first run (not yet measured) must not be on the loop"
        # Most of them, not all: a stall of a loaded machine sends a few back to threads.
        on_loop = threads[-50:].count(loop_thread)
        assert on_loop > 25, f"only {on_loop} of the last 50 runs of a proven-fast model were on the loop"
        threads.clear()
        asyncio.run(calls(50_000, 1))
        assert threads and loop_thread not in threads, f"a 50,000-row request ran on the loop: {threads}"
    finally:
        engine.close()


def test_a_full_garbage_collection_in_a_run_leaves_a_fast_model_on_the_loop(repository: Path) -> None:
    """A full collection stops every thread for as long as the heap takes to scan; a proven-fast
    model whose run fell into one is still fast. A run slow by the model's own work moves it off."""
    import asyncio
    import gc

    from neuropod_serving.server.engine import SLOW_RUN_S

    engine = Engine(ModelRegistry.load([repository / "adder"]))
    heap: list[Any] = []
    try:
        served = engine.get("adder")
        runner = engine._runners[("adder", "1")]
        real = served.model.infer
        extra: list[Any] = []  # what the next run does besides the model's own work

        def model(inputs: Any, requested: Any = None) -> Any:
            while extra:
                extra.pop()()
            return real(inputs, requested)

        served.model.infer = model  # type: ignore[method-assign]

        async def calls(n: int) -> None:
            x = np.ones((2, 2), np.float32)
            for _ in range(n):
                await engine.infer(served, {"x": x, "y": x})

        asyncio.run(calls(100))
        assert runner.inline_ok
        # Cyclic objects enough for a full collection to take several times SLOW_RUN_S.
        while True:
            heap.extend([[None] for _ in range(200_000)])
            for cell in heap[-200_000:]:
                cell[0] = cell
            began = time.perf_counter()
            gc.collect()
            if time.perf_counter() - began >= 3 * SLOW_RUN_S or len(heap) >= 4_000_000:
                break
        extra.append(gc.collect)
        asyncio.run(calls(1))
        assert not extra and runner.inline_ok, "a run that fell into a full collection moved the model off the loop"

        def spin() -> None:  # the model's own work, on its thread's CPU
            end = time.thread_time() + 2 * SLOW_RUN_S
            while time.thread_time() < end:
                pass

        extra.append(spin)
        asyncio.run(calls(1))
        assert not extra and not runner.inline_ok, "a run slow by its own work left the model on the loop"
    finally:
        heap.clear()
        engine.close()


def test_neuropod_serve_applies_the_flags(repository: Path, tmp_path: Path) -> None:
    """The real command with --max-concurrent-runs 1 --max-queued-requests 0: a second call
    while one runs is a 429 at once."""
    from neuropod.testing import served

    options = ["--max-concurrent-runs", "1", "--max-queued-requests", "0"]
    with served(repository / "sleeper", timeout=30, options=options) as server:
        base = server.http
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(_rest_sleep, base, SLOW_S)
            # Until the slow call holds the model's one slot, quick calls pass; then they are refused.
            while True:
                waited, r = _timed(lambda: httpx.post(f"{base}/v2/models/sleeper/infer", json=_body(0.0), timeout=30))
                assert not slow.done(), f"no call was refused while the slow one ran (last: {r.status_code})"
                if r.status_code != 200:
                    break
                time.sleep(0.02)
            assert r.status_code == 429, r.text
            assert waited < PROMPT_S, f"the refusal took {waited:.2f} s"
            assert slow.result().status_code == 200


def test_the_grpc_pool_grows_past_its_base_only_for_calls_that_wait() -> None:
    """Fast calls share the base threads (more threads would only contend for the GIL);
    calls held long grow the pool, so a quick call behind them still finds a thread at once."""
    import threading
    import time

    from neuropod_serving.server.grpc_server import ElasticPool

    pool = ElasticPool(2, 12, thread_name_prefix="test-elastic")
    try:
        for _ in range(200):
            done = [pool.submit(time.sleep, 0) for _ in range(8)]
            for f in done:
                f.result(timeout=5)
        assert len(pool._threads) == 2, "calls that come and go quickly stay on the base threads"
        release = threading.Event()
        held = [pool.submit(release.wait, 10) for _ in range(8)]
        started = time.perf_counter()
        pool.submit(lambda: None).result(timeout=5)
        waited = time.perf_counter() - started
        assert waited < 0.5, f"a quick call behind 8 held ones waited {waited:.3f} s for a thread"
        # The pool records a new thread once it runs: the count may lag the call it ran.
        deadline = time.monotonic() + 2
        while len(pool._threads) < 9 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 9 <= len(pool._threads) <= 12
        release.set()
        for f in held:
            assert f.result(timeout=5) is True
    finally:
        pool.shutdown(wait=True)
