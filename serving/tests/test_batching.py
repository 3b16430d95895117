"""Spec-derived dynamic batching: ``batch_symbol``, the ``Batcher``, the Engine, REST and the CLI.

Every run goes through a real ONNX model's ``infer``. To make merging
deterministic without timing, a :class:`Recorder` wraps the real ``infer``: it
counts the runs (rows, shapes, requested outputs) and can hold the first run
until released. With one in-flight slot, the requests submitted while the
first run is held queue up, so the next run must see them merged. Expected
outputs are computed with numpy from each request's own inputs.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpclient = pytest.importorskip("tritonclient.http")

from onnx import TensorProto, helper  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from neuropod.errors import BackendError, NeuropodError, SpecError  # noqa: E402
from neuropod.spec import TensorSpec  # noqa: E402
from neuropod_serving.server import BatchPolicy, Engine, ModelRegistry, batch_symbol, create_app  # noqa: E402
from neuropod_serving.server.batching import Batcher  # noqa: E402
from neuropod_serving.server.launcher import startup_table  # noqa: E402
from neuropod_serving.server.metrics import ServerMetrics  # noqa: E402

from conftest import adder_and_echo, onnx_package, private_caches, serve_in_thread  # noqa: E402

Arrays = dict[str, np.ndarray]
LOOKUP_TABLE = np.arange(12, dtype=np.float32).reshape(4, 3)


@pytest.fixture(scope="module")
def repo() -> Iterator[Path]:
    """Packages: adder and echo (strings), and models chosen for what batch_symbol says of them."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-batching-test-"))
    models = root / "models"
    with private_caches(root):
        adder_and_echo(models, echo_as_zip=False)
        # No symbol in front: never batched.
        onnx_package(models / "nolead", "nolead", [helper.make_node("Identity", ["v"], ["w"])],
                     [("v", "float32", [None, 2])], [("w", "float32", [None, 2])])  # fmt: skip
        # The batch symbol also in another dim: concatenating would change that dim too.
        onnx_package(models / "square", "square", [helper.make_node("Identity", ["m"], ["m2"])],
                     [("m", "float32", ["batch_size", "batch_size"])],
                     [("m2", "float32", ["batch_size", "batch_size"])])  # fmt: skip
        # A second symbol dim: only requests with the same n may share a batch.
        onnx_package(models / "scale", "scale", [helper.make_node("Mul", ["a", "three"], ["b"])],
                     [("a", "float32", ["batch_size", "n"])], [("b", "float32", ["batch_size", "n"])],
                     [helper.make_tensor("three", TensorProto.FLOAT, [], [3.0])])  # fmt: skip
        # Batchable, and fails inside onnxruntime for an index outside the 4-row table.
        onnx_package(models / "lookup", "lookup", [helper.make_node("Gather", ["table", "idx"], ["row"])],
                     [("idx", "int64", ["batch_size"])], [("row", "float32", ["batch_size", 3])],
                     [helper.make_tensor("table", TensorProto.FLOAT, [4, 3], LOOKUP_TABLE.ravel().tolist())])  # fmt: skip
        yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def registry(repo: Path) -> Iterator[ModelRegistry]:
    """The models for the Batcher unit tests (engines get registries of their own: Engine.close closes it)."""
    reg = ModelRegistry.load([repo / "models"])
    yield reg
    reg.close()


class Recorder:
    """A model's real ``infer``, counting runs; with ``hold_first`` the first run waits for :attr:`release`."""

    def __init__(self, infer: Callable[..., Arrays], *, hold_first: bool = False) -> None:
        self.infer = infer
        self.runs: list[tuple[int, dict[str, tuple[int, ...]], list[str] | None]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self._lock = threading.Lock()

    def __call__(self, inputs: Arrays, requested: list[str] | None = None) -> Arrays:
        rows = next(iter(inputs.values())).shape[0]
        with self._lock:
            self.runs.append(
                (rows, {n: a.shape for n, a in inputs.items()}, None if requested is None else list(requested))
            )
        self.entered.set()
        if not self.release.wait(30):
            raise AssertionError("the test never released the held run")
        return self.infer(inputs, requested)

    @property
    def rows(self) -> list[int]:
        return [r[0] for r in self.runs]


def _adder_inputs(rows: int, seed: int) -> Arrays:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((rows, 2)).astype(np.float32),
        "y": rng.standard_normal((rows, 2)).astype(np.float32),
    }


def _check_adder(inputs: Arrays, got: Arrays, names: tuple[str, ...] = ("out", "doubled")) -> None:
    assert sorted(got) == sorted(names)
    want = {"out": inputs["x"] + inputs["y"], "doubled": (inputs["x"] + inputs["y"]) * 2}
    for n in names:
        assert got[n].shape == want[n].shape
        np.testing.assert_allclose(got[n], want[n], rtol=1e-6)


def _no_batcher_threads(name: str) -> bool:
    return not [
        t for t in threading.enumerate() if t.name.startswith((f"neuropod-batcher-{name}", f"neuropod-batch-{name}"))
    ]


@pytest.fixture
def make_batcher() -> Iterator[Callable[..., Batcher]]:
    """Batchers that are closed (and their threads joined) when the test ends."""
    made: list[Batcher] = []

    def make(name: str, run: Callable[..., Arrays], policy: BatchPolicy, **kw: Any) -> Batcher:
        b = Batcher(name, run, policy, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def _hold(batcher: Batcher, rec: Recorder, opener: Arrays) -> Future[Arrays]:
    """Submit ``opener`` and wait until its run has started and holds the one in-flight slot."""
    fut = batcher.submit(opener, None)
    assert rec.entered.wait(10), "the first run never started"
    return fut


# --- batch_symbol --------------------------------------------------------------------------


def test_batch_symbol_of_real_models(registry: ModelRegistry) -> None:
    def of(name: str) -> tuple[str | None, str]:
        m = registry.get(name).model
        return batch_symbol(m.inputs, m.outputs)

    assert of("adder") == ("batch_size", "")
    assert of("echo") == ("batch_size", "")
    assert of("lookup") == ("batch_size", "")
    assert of("scale") == ("batch_size", "")  # 'n' elsewhere is fine: requests with other n are not merged
    assert of("nolead") == (None, "tensor 'v' starts with None, not a symbol")
    assert of("square") == (None, "tensor 'm' uses 'batch_size' past its first dim")


def test_batch_symbol_edge_cases() -> None:
    b = TensorSpec("b", "float32", ("batch_size", 2))
    assert batch_symbol([TensorSpec("s", "float32", ())], [b]) == (None, "tensor 's' is a scalar")
    assert batch_symbol([b], [TensorSpec("o", "float32", (3, "batch_size"))]) == (
        None, "tensor 'o' starts with 3, not a symbol"
    )  # fmt: skip
    assert batch_symbol([b], [TensorSpec("o", "float32", ("n", 2))]) == (
        None, "tensor 'o' starts with 'n', not 'batch_size' like the others"
    )  # fmt: skip
    assert batch_symbol([b], []) == (None, "the model has no inputs or no outputs")
    # The symbol need not be called batch_size.
    assert batch_symbol([TensorSpec("i", "int64", ("rows",))], [TensorSpec("o", "int64", ("rows", None))]) == (
        "rows",
        "",
    )


def test_batch_policy_bounds() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BatchPolicy(0)
    with pytest.raises(ValueError, match="0 or more"):
        BatchPolicy(4, -0.001)


# --- the Batcher, driving real models --------------------------------------------------------


def test_concurrent_submits_are_merged_and_each_gets_its_own_rows(
    registry: ModelRegistry, make_batcher: Callable[..., Batcher]
) -> None:
    rec = Recorder(registry.get("adder").model.infer, hold_first=True)
    batcher = make_batcher("adder", rec, BatchPolicy(8))
    opener = _adder_inputs(1, 0)
    first = _hold(batcher, rec, opener)
    requests = [_adder_inputs(1 + i % 3, seed=100 + i) for i in range(24)]
    start = threading.Barrier(len(requests))

    def send(inputs: Arrays) -> Future[Arrays]:
        start.wait()
        return batcher.submit(inputs, None)

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = list(pool.map(send, requests))
    rec.release.set()  # every request is queued: the runs after the first merge them
    _check_adder(opener, first.result(10))
    for inputs, fut in zip(requests, futures):
        _check_adder(inputs, fut.result(10))
    total = sum(r["x"].shape[0] for r in requests)
    assert rec.rows[0] == 1 and sum(rec.rows[1:]) == total
    assert max(rec.rows) <= 8, rec.rows
    assert len(rec.runs) - 1 < len(requests), f"nothing merged: {rec.rows}"
    # All of them were waiting, so at most one run after the first can have room left
    # for a request of up to 3 rows.
    assert sum(1 for r in rec.rows[1:] if r <= 8 - 3) <= 1, rec.rows


def test_other_dims_differ_never_merged(registry: ModelRegistry, make_batcher: Callable[..., Batcher]) -> None:
    rec = Recorder(registry.get("scale").model.infer, hold_first=True)
    batcher = make_batcher("scale", rec, BatchPolicy(16))
    rng = np.random.default_rng(7)
    first = _hold(batcher, rec, {"a": np.ones((1, 3), np.float32)})
    sent = [{"a": rng.standard_normal((rows, n)).astype(np.float32)} for rows, n in ((2, 3), (1, 5), (1, 3), (2, 5))]
    futures = [batcher.submit(a, None) for a in sent]
    rec.release.set()
    np.testing.assert_allclose(first.result(10)["b"], np.full((1, 3), 3.0, np.float32))
    for a, fut in zip(sent, futures):
        got = fut.result(10)["b"]
        assert got.shape == a["a"].shape
        np.testing.assert_allclose(got, a["a"] * 3, rtol=1e-6)
    # After the held run: one run of the two n=3 requests, one of the two n=5 requests.
    assert [shapes["a"] for _, shapes, _ in rec.runs] == [(1, 3), (3, 3), (3, 5)]


def test_request_over_max_batch_size_runs_alone_and_whole(
    registry: ModelRegistry, make_batcher: Callable[..., Batcher]
) -> None:
    rec = Recorder(registry.get("adder").model.infer, hold_first=True)
    batcher = make_batcher("adder", rec, BatchPolicy(4))
    first = _hold(batcher, rec, _adder_inputs(1, 0))
    sent = [_adder_inputs(1, 1), _adder_inputs(6, 2), _adder_inputs(1, 3), _adder_inputs(2, 4)]
    futures = [batcher.submit(i, None) for i in sent]
    rec.release.set()
    first.result(10)
    for inputs, fut in zip(sent, futures):
        _check_adder(inputs, fut.result(10))
    assert rec.rows.count(6) == 1 and sum(rec.rows) == 1 + 10
    assert all(r <= 4 for r in rec.rows if r != 6), rec.rows
    # Never split: one request's rows are one run's rows or part of them, and the big one ran by itself.
    assert 6 in rec.rows


def test_requested_outputs_are_honoured_per_request_when_merged(
    registry: ModelRegistry, make_batcher: Callable[..., Batcher]
) -> None:
    rec = Recorder(registry.get("adder").model.infer, hold_first=True)
    batcher = make_batcher("adder", rec, BatchPolicy(8))
    first = _hold(batcher, rec, _adder_inputs(1, 0))
    only_out, everything, only_doubled = _adder_inputs(2, 1), _adder_inputs(1, 2), _adder_inputs(3, 3)
    f1 = batcher.submit(only_out, ["out"])
    f2 = batcher.submit(everything, None)
    f3 = batcher.submit(only_doubled, ["doubled"])
    rec.release.set()
    first.result(10)
    _check_adder(only_out, f1.result(10), ("out",))
    _check_adder(everything, f2.result(10), ("out", "doubled"))
    _check_adder(only_doubled, f3.result(10), ("doubled",))
    assert rec.runs[1][0] == 6 and rec.runs[1][2] is None  # one merged run; someone wanted everything
    # When every request names its outputs, the merged run asks for their union only.
    rec2 = Recorder(registry.get("adder").model.infer, hold_first=True)
    batcher2 = make_batcher("adder2", rec2, BatchPolicy(8))
    first = _hold(batcher2, rec2, _adder_inputs(1, 0))
    a, b = _adder_inputs(1, 5), _adder_inputs(1, 6)
    fa, fb = batcher2.submit(a, ["out"]), batcher2.submit(b, ["out"])
    rec2.release.set()
    first.result(10)
    _check_adder(a, fa.result(10), ("out",))
    _check_adder(b, fb.result(10), ("out",))
    assert rec2.runs[1] == (2, {"x": (2, 2), "y": (2, 2)}, ["out"])


def test_string_tensors_of_different_lengths_merge(
    registry: ModelRegistry, make_batcher: Callable[..., Batcher]
) -> None:
    rec = Recorder(registry.get("echo").model.infer, hold_first=True)
    batcher = make_batcher("echo", rec, BatchPolicy(8))
    first = _hold(batcher, rec, {"n": np.array([0], np.int64), "s": np.array(["x"])})
    sent = [
        {"n": np.array([1, 2], np.int64), "s": np.array(["a", "héllo wörld"])},  # <U11
        {"n": np.array([3], np.int64), "s": np.array([""])},  # <U1
        {"n": np.zeros(0, np.int64), "s": np.array([], dtype=str)},  # no rows at all
        {"n": np.array([-(2**62), 5, 6], np.int64), "s": np.array(["a\x00b", "ü", "three"])},
    ]
    futures = [batcher.submit(i, None) for i in sent]
    rec.release.set()
    assert first.result(10)["s_out"].tolist() == ["x"]
    for inputs, fut in zip(sent, futures):
        got = fut.result(10)
        np.testing.assert_array_equal(got["n1"], inputs["n"] + 1)
        assert got["s_out"].tolist() == inputs["s"].tolist()
    assert rec.rows == [1, 6]


def test_model_failure_fails_its_batch_and_the_batcher_keeps_serving(
    registry: ModelRegistry, make_batcher: Callable[..., Batcher]
) -> None:
    rec = Recorder(registry.get("lookup").model.infer, hold_first=True)
    batcher = make_batcher("lookup", rec, BatchPolicy(8))
    first = _hold(batcher, rec, {"idx": np.array([3], np.int64)})
    good1 = batcher.submit({"idx": np.array([0, 1], np.int64)}, None)
    bad = batcher.submit({"idx": np.array([10], np.int64)}, None)  # onnxruntime: index out of the table
    good2 = batcher.submit({"idx": np.array([2], np.int64)}, None)
    rec.release.set()
    np.testing.assert_array_equal(first.result(10)["row"], LOOKUP_TABLE[[3]])
    errors = []
    for fut in (good1, bad, good2):
        with pytest.raises(BackendError, match="failed to run model 'lookup'") as info:
            fut.result(10)
        errors.append(info.value)
    assert errors[0] is errors[1] is errors[2]  # the one failure of the one merged run
    assert rec.rows == [1, 4]
    # The next requests are served.
    again = [batcher.submit({"idx": np.array([i], np.int64)}, None) for i in (1, 2)]
    for i, fut in zip((1, 2), again):
        np.testing.assert_array_equal(fut.result(10)["row"], LOOKUP_TABLE[[i]])


def test_run_function_raising_fails_the_batch_only(
    registry: ModelRegistry, make_batcher: Callable[..., Batcher]
) -> None:
    infer = registry.get("adder").model.infer

    def run(inputs: Arrays, requested: list[str] | None) -> Arrays:
        if np.isnan(inputs["x"]).any():
            raise ValueError("x holds a NaN")
        return infer(inputs, requested)

    rec = Recorder(run, hold_first=True)
    batcher = make_batcher("adder", rec, BatchPolicy(8))
    first = _hold(batcher, rec, _adder_inputs(1, 0))
    poisoned = _adder_inputs(1, 1)
    poisoned["x"][0, 0] = np.nan
    futures = [batcher.submit(i, None) for i in (_adder_inputs(1, 2), poisoned)]
    rec.release.set()
    first.result(10)
    for fut in futures:
        with pytest.raises(ValueError, match="x holds a NaN"):
            fut.result(10)
    later = _adder_inputs(2, 3)
    _check_adder(later, batcher.submit(later, None).result(10))


def test_output_without_the_batch_rows_is_a_backend_error(
    registry: ModelRegistry, make_batcher: Callable[..., Batcher]
) -> None:
    infer = registry.get("adder").model.infer

    def first_row_only(inputs: Arrays, requested: list[str] | None) -> Arrays:
        return {n: a[:1] for n, a in infer(inputs, requested).items()}

    rec = Recorder(first_row_only, hold_first=True)
    batcher = make_batcher("adder", rec, BatchPolicy(8))
    first = _hold(batcher, rec, _adder_inputs(1, 0))
    futures = [batcher.submit(_adder_inputs(1, i), None) for i in (1, 2)]
    rec.release.set()
    first.result(10)
    for fut in futures:
        with pytest.raises(BackendError, match=r"output '\w+' with shape \[1, 2\] for a batch of 2 rows"):
            fut.result(10)


def test_close_answers_what_is_queued_then_stops(registry: ModelRegistry) -> None:
    rec = Recorder(registry.get("adder").model.infer, hold_first=True)
    batcher = Batcher("closing", rec, BatchPolicy(8))
    try:
        first = _hold(batcher, rec, _adder_inputs(1, 0))
        queued = [_adder_inputs(1 + i, 10 + i) for i in range(3)]
        futures = [batcher.submit(i, None) for i in queued]
        closer = threading.Thread(target=batcher.close)
        closer.start()
        # Until close() marks the batcher closed, a request is accepted (and must be answered);
        # after it, refused.
        accepted: list[tuple[Arrays, Future[Arrays]]] = []
        deadline = time.monotonic() + 10
        while True:
            late = _adder_inputs(1, 50 + len(accepted))
            try:
                accepted.append((late, batcher.submit(late, None)))
            except NeuropodError as e:
                assert "'closing' is unloading" in str(e)
                break
            assert time.monotonic() < deadline, "submit was never refused after close()"
            time.sleep(0.001)
        rec.release.set()
        closer.join(10)
        assert not closer.is_alive()
    finally:
        rec.release.set()
        batcher.close()
    _check_adder(_adder_inputs(1, 0), first.result(0))
    for inputs, fut in [*zip(queued, futures), *accepted]:
        _check_adder(inputs, fut.result(0))
    assert rec.rows[0] == 1 and sum(rec.rows) == 1 + 6 + len(accepted)  # the refused one never ran
    assert _no_batcher_threads("closing"), [t.name for t in threading.enumerate()]


def test_cancelled_request_is_not_run(registry: ModelRegistry, make_batcher: Callable[..., Batcher]) -> None:
    # A client that gave up (a gRPC deadline, a cancelled task) costs no compute, and
    # cancelling cannot race with the batch setting its result.
    rec = Recorder(registry.get("adder").model.infer, hold_first=True)
    batcher = make_batcher("adder", rec, BatchPolicy(8))
    first = _hold(batcher, rec, _adder_inputs(1, 0))
    keep1, gone, keep2 = _adder_inputs(1, 1), _adder_inputs(3, 2), _adder_inputs(2, 3)
    f1, fg, f2 = (batcher.submit(i, None) for i in (keep1, gone, keep2))
    assert fg.cancel()
    rec.release.set()
    first.result(10)
    _check_adder(keep1, f1.result(10))
    _check_adder(keep2, f2.result(10))
    assert fg.cancelled()
    assert rec.rows == [1, 3]
    assert not first.cancel() and not f1.cancel()  # done futures stay answered


def test_max_queue_delay_merges_requests_that_arrive_within_it(
    registry: ModelRegistry, make_batcher: Callable[..., Batcher]
) -> None:
    rec = Recorder(registry.get("adder").model.infer)
    observed: list[tuple[list[float], float, int]] = []
    batcher = make_batcher(
        "adder", rec, BatchPolicy(8, max_queue_delay_s=1.0), observe=lambda w, s, r, *_: observed.append((w, s, r))
    )
    a, b = _adder_inputs(1, 1), _adder_inputs(2, 2)
    fa = batcher.submit(a, None)
    time.sleep(0.01)
    fb = batcher.submit(b, None)
    _check_adder(a, fa.result(10))
    _check_adder(b, fb.result(10))
    assert rec.rows == [3]
    # The observer saw one run: a queue wait per request, its compute time and its rows.
    [(waited, seconds, rows)] = observed
    assert len(waited) == 2 and all(w >= 0 for w in waited) and seconds >= 0 and rows == 3
    # A batch that fills up does not wait out the delay; a lone request is answered when it ends.
    batcher2 = make_batcher("adder2", Recorder(registry.get("adder").model.infer), BatchPolicy(2, max_queue_delay_s=60))
    f1, f2 = batcher2.submit(a, None), batcher2.submit(_adder_inputs(1, 3), None)
    _check_adder(a, f1.result(30))
    _check_adder(_adder_inputs(1, 3), f2.result(30))


def test_observe_gets_one_wait_per_request(registry: ModelRegistry, make_batcher: Callable[..., Batcher]) -> None:
    rec = Recorder(registry.get("adder").model.infer, hold_first=True)
    observed: list[tuple[list[float], float, int]] = []
    batcher = make_batcher("adder", rec, BatchPolicy(4), observe=lambda w, s, r, *_: observed.append((w, s, r)))
    first = _hold(batcher, rec, _adder_inputs(1, 0))
    futures = [batcher.submit(_adder_inputs(1, i), None) for i in range(1, 7)]
    rec.release.set()
    first.result(10)
    for fut in futures:
        fut.result(10)
    assert [(len(w), r) for w, _, r in observed] == [(1, 1), (4, 4), (2, 2)]
    assert all(w >= 0 for waits, _, _ in observed for w in waits)


# --- the Engine -------------------------------------------------------------------------------


def _batch_size_histogram(text: str, model: str) -> dict[str, float]:
    """``neuropod_batch_size``'s samples for ``model``: count, sum and le=<bound> buckets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "neuropod_batch_size":
            continue
        for s in family.samples:
            if s.labels.get("model") != model:
                continue
            if s.name.endswith("_bucket"):
                out[f"le={s.labels['le']}"] = s.value
            elif s.name.endswith(("_count", "_sum")):
                out[s.name.rsplit("_", 1)[1]] = s.value
    return out


def _held_engine(repo: Path, policy: BatchPolicy, model: str = "adder") -> tuple[Engine, Recorder]:
    """An engine whose ``model`` runs through a Recorder around its real infer, holding the first run."""
    registry = ModelRegistry.load([repo / "models"])
    served = registry.get(model)
    rec = Recorder(served.model.infer, hold_first=True)
    served.model.infer = rec  # type: ignore[method-assign]  # the batcher binds it when the engine starts
    return Engine(registry, batching=policy, metrics=ServerMetrics()), rec


def test_engine_merges_concurrent_requests(repo: Path) -> None:
    engine, rec = _held_engine(repo, BatchPolicy(8, 0.002))
    try:
        adder = engine.get("adder")
        requests = [_adder_inputs(1 + i % 2, seed=200 + i) for i in range(32)]

        async def main() -> list[Arrays]:
            tasks = [asyncio.create_task(engine.infer(adder, r)) for r in requests]
            await asyncio.sleep(0)  # each task ran up to its await: every request is submitted
            await asyncio.get_running_loop().run_in_executor(None, rec.entered.wait, 10)
            rec.release.set()
            return await asyncio.gather(*tasks)

        for inputs, got in zip(requests, asyncio.run(main())):
            _check_adder(inputs, got)
        assert engine.batched("adder") == (True, "")
        assert isinstance(engine.metrics, ServerMetrics)
        hist = _batch_size_histogram(engine.metrics.render().decode(), "adder")
        rows = sum(r["x"].shape[0] for r in requests)
        assert hist["sum"] == rows and hist["count"] == len(rec.runs) < len(requests)
        assert hist["count"] - hist["le=1.0"] > 0, hist  # runs of more than one row
        assert max(rec.rows) <= 8
    finally:
        rec.release.set()
        engine.close()
    assert _no_batcher_threads("adder")


def test_engine_without_batch_symbol_serves_unbatched(repo: Path) -> None:
    engine = Engine(ModelRegistry.load([repo / "models"]), batching=BatchPolicy(8), metrics=ServerMetrics())
    try:
        assert engine.batched("nolead") == (False, "no batch dimension: tensor 'v' starts with None, not a symbol")
        assert engine.batched("square") == (
            False,
            "no batch dimension: tensor 'm' uses 'batch_size' past its first dim",
        )
        assert engine.batched("echo") == (True, "")
        v = np.arange(6, dtype=np.float32).reshape(3, 2)
        m = np.arange(4, dtype=np.float32).reshape(2, 2)

        async def main() -> tuple[list[Arrays], Arrays]:
            return (
                await asyncio.gather(*(engine.infer(engine.get("nolead"), {"v": v + i}) for i in range(4))),
                await engine.infer(engine.get("square"), {"m": m}),
            )

        outs, sq = asyncio.run(main())
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out["w"], v + i)
        np.testing.assert_array_equal(sq["m2"], m)
        assert isinstance(engine.metrics, ServerMetrics)
        assert _batch_size_histogram(engine.metrics.render().decode(), "nolead") == {}  # never ran as a batch
    finally:
        engine.close()
    # Batching off: no model is batched, and the engine says why.
    for policy in (None, BatchPolicy(1)):
        engine = Engine(ModelRegistry.load([repo / "models" / "adder"]), batching=policy)
        try:
            assert engine.batched("adder") == (False, "batching off: no --max-batch-size")
        finally:
            engine.close()


def test_engine_bad_request_is_a_spec_error_before_batching(repo: Path) -> None:
    engine, rec = _held_engine(repo, BatchPolicy(8))
    try:
        adder = engine.get("adder")
        good = [_adder_inputs(1, 300 + i) for i in range(5)]
        x = np.ones((2, 2), np.float32)

        async def main() -> list[Arrays]:
            tasks = [asyncio.create_task(engine.infer(adder, g)) for g in good]
            await asyncio.sleep(0)
            await asyncio.get_running_loop().run_in_executor(None, rec.entered.wait, 10)
            # While the first run is held, bad requests fail at once: they never join a batch.
            with pytest.raises(SpecError, match=r"Dim 1 of tensor 'y'"):
                await engine.infer(adder, {"x": x, "y": np.ones((2, 3), np.float32)})
            with pytest.raises(SpecError, match=r"batch_size"):
                await engine.infer(adder, {"x": x, "y": np.ones((3, 2), np.float32)})
            with pytest.raises(SpecError, match=r"needs input\(s\) 'y'"):
                await engine.infer(adder, {"x": x})
            with pytest.raises(SpecError, match="no input named 'z'"):
                await engine.infer(adder, {"x": x, "y": x, "z": x})
            with pytest.raises(SpecError, match="'nope'"):
                await engine.infer(adder, {"x": x, "y": x}, ["nope"])
            with pytest.raises(SpecError, match="'x'"):
                await engine.infer(adder, {"x": x.astype(np.float64), "y": x})
            assert not any(t.done() for t in tasks)
            rec.release.set()
            return await asyncio.gather(*tasks)

        for inputs, got in zip(good, asyncio.run(main())):
            _check_adder(inputs, got)
        assert sum(rec.rows) == len(good)  # only the good rows ever ran
    finally:
        rec.release.set()
        engine.close()


def test_engine_infer_blocking_merges_requests_from_threads(repo: Path) -> None:
    # The gRPC server's way in: each request on a thread of its own, waiting for its batch there.
    engine, rec = _held_engine(repo, BatchPolicy(8, 0.002))
    try:
        adder = engine.get("adder")
        requests = [_adder_inputs(1 + i % 2, seed=500 + i) for i in range(24)]
        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(engine.infer_blocking, adder, r) for r in requests]
            assert rec.entered.wait(10)
            time.sleep(0.05)  # the other threads reach the batcher while the first run is held
            rec.release.set()
            answers = [f.result(30) for f in futures]
        for inputs, got in zip(requests, answers):
            _check_adder(inputs, got)
        assert len(rec.runs) < len(requests) and max(rec.rows) <= 8
        with pytest.raises(SpecError, match=r"needs input\(s\) 'y'"):
            engine.infer_blocking(adder, {"x": np.ones((1, 2), np.float32)})
    finally:
        rec.release.set()
        engine.close()


def test_grpc_concurrent_clients_are_batched(repo: Path) -> None:
    grpc = pytest.importorskip("grpc")
    from neuropod_serving.protocol import grpc_codec
    from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
    from neuropod_serving.server.grpc_server import start_grpc_server

    engine = Engine(ModelRegistry.load([repo / "models"]), batching=BatchPolicy(8, 10.0), metrics=ServerMetrics())
    n = 16
    try:
        server, port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                infer = channel.unary_unary(
                    "/inference.GRPCInferenceService/ModelInfer",
                    request_serializer=pb.ModelInferRequest.SerializeToString,
                    response_deserializer=pb.ModelInferResponse.FromString,
                )
                start = threading.Barrier(n)

                def call(i: int) -> tuple[Arrays, Arrays]:
                    inputs = _adder_inputs(1, 600 + i)
                    request = pb.ModelInferRequest(model_name="adder")
                    for name, array in inputs.items():
                        t = request.inputs.add()
                        t.name, t.datatype = name, "FP32"
                        t.shape.extend(array.shape)
                        request.raw_input_contents.append(array.tobytes())
                    start.wait()
                    return inputs, grpc_codec.parse_model_infer_response(infer(request, timeout=60)).outputs

                with ThreadPoolExecutor(n) as pool:
                    answers = list(pool.map(call, range(n)))
        finally:
            server.stop(None)
        for inputs, got in answers:
            _check_adder(inputs, got)
        hist = _batch_size_histogram(engine.metrics.render().decode(), "adder")  # type: ignore[union-attr]
        assert hist["sum"] == n and 0 < hist["count"] < n, hist
        assert hist["le=1.0"] < hist["count"], hist
    finally:
        engine.close()


# --- REST with the real server --------------------------------------------------------------


def test_rest_concurrent_clients_are_batched(repo: Path) -> None:
    # 16 one-row requests, batches of 8: a batch closes when its 8 rows are waiting, long
    # before the (generous) delay, so the runs are merged whatever the scheduling.
    engine = Engine(ModelRegistry.load([repo / "models"]), batching=BatchPolicy(8, 10.0), metrics=ServerMetrics())
    n = 16
    try:
        with serve_in_thread(create_app(engine)) as port:
            url = f"127.0.0.1:{port}"
            start = threading.Barrier(n)

            def call(i: int) -> tuple[Arrays, Arrays]:
                inputs = _adder_inputs(1, 400 + i)
                client = httpclient.InferenceServerClient(url, network_timeout=60)
                try:
                    tensors = []
                    for name in ("x", "y"):
                        t = httpclient.InferInput(name, [1, 2], "FP32")
                        t.set_data_from_numpy(inputs[name], binary_data=i % 2 == 0)
                        tensors.append(t)
                    start.wait()
                    result = client.infer("adder", tensors)
                    return inputs, {k: result.as_numpy(k) for k in ("out", "doubled")}
                finally:
                    client.close()

            with ThreadPoolExecutor(n) as pool:
                answers = list(pool.map(call, range(n)))
            with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as r:
                text = r.read().decode()
        for inputs, got in answers:
            _check_adder(inputs, got)
        hist = _batch_size_histogram(text, "adder")
        assert hist["sum"] == n and 0 < hist["count"] < n, hist
        assert hist["le=1.0"] < hist["count"], hist
        requests = next(f for f in text_string_to_metric_families(text) if f.name == "neuropod_requests")
        assert [(s.labels, s.value) for s in requests.samples if s.name == "neuropod_requests_total"] == [
            ({"model": "adder", "protocol": "rest"}, n)
        ]
    finally:
        engine.close()


# --- requests that find their batcher idle, and requests gathered on the event loop -------------


class _Threads:
    """A model's real ``infer`` that notes the thread of every run and its rows; ``fail_merged``
    makes a run of more than one row fail (as a model failure)."""

    def __init__(self, infer: Callable[..., Arrays]) -> None:
        self.infer = infer
        self.runs: list[tuple[int, int]] = []  # (thread ident, rows)
        self.fail_merged = False

    def __call__(self, inputs: Arrays, requested: list[str] | None = None) -> Arrays:
        rows = next(iter(inputs.values())).shape[0]
        self.runs.append((threading.get_ident(), rows))
        if self.fail_merged and rows > 1:
            raise BackendError("the model failed on a merged run")
        return self.infer(inputs, requested)


def _fast_engine(repo: Path, policy: BatchPolicy, monkeypatch: pytest.MonkeyPatch) -> tuple[Engine, _Threads]:
    """An engine batching ``adder`` whose runs have proved fast (so it may run on the event loop).
    Any run under 10 s counts as fast here, so that a busy machine descheduling a run for a few
    milliseconds cannot move ``adder`` off the loop in the middle of a test."""
    from neuropod_serving.server import engine as engine_module

    monkeypatch.setattr(engine_module, "INLINE_BELOW_S", 10.0)
    INLINE_BELOW_S = engine_module.INLINE_BELOW_S

    registry = ModelRegistry.load([repo / "models" / "adder"])
    served = registry.get("adder")
    threads = _Threads(served.model.infer)
    served.model.infer = threads  # type: ignore[method-assign]
    engine = Engine(registry, batching=policy, metrics=ServerMetrics())
    runner = engine._runners[("adder", "1")]

    async def warm() -> None:
        for _ in range(1000):  # a new model is assumed slow until its runs (on threads) show otherwise
            if runner.ewma_s < INLINE_BELOW_S and runner.inline_bytes:
                return
            await engine.infer(served, _adder_inputs(3, 0))  # up to 3 rows may run on the loop then

    asyncio.run(warm())
    assert runner.ewma_s < INLINE_BELOW_S and runner.inline_bytes, "adder never ran under INLINE_BELOW_S"
    threads.runs.clear()
    return engine, threads


def _teach_bursts(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``adder``'s requests that arrive together on the loop be gathered: merging is then
    taken to cost nothing (GATHER_COST_S), and one burst of them has been seen."""
    from neuropod_serving.server import batching

    monkeypatch.setattr(batching, "GATHER_COST_S", 0.0)
    adder = engine.get("adder")

    async def burst() -> None:
        await asyncio.gather(*(engine.infer(adder, _adder_inputs(1, seed=i)) for i in range(8)))

    asyncio.run(burst())


def _stats(engine: Engine) -> dict[str, Any]:
    assert isinstance(engine.metrics, ServerMetrics)
    return engine.metrics.statistics("adder", "1")


def test_lone_request_runs_at_once_where_it_arrives_when_the_batcher_is_idle(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Delay 0 takes what is waiting: a request alone, nothing in flight, runs at once (no
    # thread hop), on the event loop for a fast model and on a gRPC thread on its own.
    engine, threads = _fast_engine(repo, BatchPolicy(8), monkeypatch)
    try:
        adder = engine.get("adder")
        before = _stats(engine)
        requests = [_adder_inputs(1 + i % 3, seed=700 + i) for i in range(6)]

        async def one_by_one() -> tuple[list[Arrays], int]:
            return [await engine.infer(adder, r) for r in requests], threading.get_ident()

        answers, loop_thread = asyncio.run(one_by_one())
        for inputs, got in zip(requests, answers):
            _check_adder(inputs, got)
        assert threads.runs == [(loop_thread, r["x"].shape[0]) for r in requests]
        threads.runs.clear()
        with ThreadPoolExecutor(1) as pool:
            got, caller = pool.submit(
                lambda: (engine.infer_blocking(adder, requests[0]), threading.get_ident())
            ).result()
        _check_adder(requests[0], got)
        assert threads.runs == [(caller, 1)]
        # Each ran as a batch of its own rows, waited 0, and the statistics say so.
        after = _stats(engine)
        assert after["execution_count"] - before["execution_count"] == 7
        assert after["inference_count"] - before["inference_count"] == sum(r["x"].shape[0] for r in requests) + 1
        assert after["inference_stats"]["queue"]["count"] - before["inference_stats"]["queue"]["count"] == 7
        sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
        old = {b["batch_size"]: b["compute_infer"]["count"] for b in before["batch_stats"]}
        assert {k: v - old.get(k, 0) for k, v in sizes.items()} == {1: 3, 2: 2, 3: 2}
    finally:
        engine.close()
    assert _no_batcher_threads("adder")


def test_lone_request_waits_out_a_queue_delay(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With a delay, a lone request waits for company as Triton's dynamic batcher does (the
    # documented policy): never on the event loop, however fast the model.
    engine, threads = _fast_engine(repo, BatchPolicy(8, 0.05), monkeypatch)
    try:
        adder = engine.get("adder")
        inputs = _adder_inputs(1, 800)

        async def one() -> tuple[Arrays, float, int]:
            began = time.perf_counter()
            got = await engine.infer(adder, inputs)
            return got, time.perf_counter() - began, threading.get_ident()

        got, took, loop_thread = asyncio.run(one())
        _check_adder(inputs, got)
        assert took >= 0.045
        assert [t for t, _ in threads.runs] != [loop_thread]
    finally:
        engine.close()


def test_requests_arriving_together_on_the_loop_are_merged(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Eight requests reach the engine in one iteration of the loop: the first runs alone at
    # once, the seven that arrive while it held the loop run in the next iteration, merged
    # in batches of at most max_batch_size rows, on the loop.
    engine, threads = _fast_engine(repo, BatchPolicy(4), monkeypatch)
    try:
        adder = engine.get("adder")
        # Before merging pays (no burst seen yet), they run one by one on the loop.
        requests = [_adder_inputs(1, seed=950 + i) for i in range(8)]

        async def first_burst() -> tuple[list[Arrays], int]:
            return list(await asyncio.gather(*(engine.infer(adder, r) for r in requests))), threading.get_ident()

        answers, loop_thread = asyncio.run(first_burst())
        for inputs, got in zip(requests, answers):
            _check_adder(inputs, got)
        assert threads.runs == [(loop_thread, 1)] * 8
        threads.runs.clear()
        _teach_bursts(engine, monkeypatch)
        threads.runs.clear()
        before = _stats(engine)
        requests = [_adder_inputs(1, seed=900 + i) for i in range(8)]

        async def together() -> tuple[list[Arrays], int]:
            return list(await asyncio.gather(*(engine.infer(adder, r) for r in requests))), threading.get_ident()

        answers, loop_thread = asyncio.run(together())
        for inputs, got in zip(requests, answers):
            _check_adder(inputs, got)
        assert threads.runs == [(loop_thread, 1), (loop_thread, 4), (loop_thread, 3)]
        after = _stats(engine)
        assert after["execution_count"] - before["execution_count"] == 3
        assert after["inference_count"] - before["inference_count"] == 8
        assert after["inference_stats"]["queue"]["count"] - before["inference_stats"]["queue"]["count"] == 8
        sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
        old = {b["batch_size"]: b["compute_infer"]["count"] for b in before["batch_stats"]}
        assert {k: v - old.get(k, 0) for k, v in sizes.items() if v != old.get(k, 0)} == {1: 1, 3: 1, 4: 1}
    finally:
        engine.close()


def test_errors_in_requests_gathered_on_the_loop(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A bad request among those arriving together fails alone (checked before it joins); a
    # model failure fails every request of its merged run, and the model keeps serving.
    engine, threads = _fast_engine(repo, BatchPolicy(8), monkeypatch)
    try:
        _teach_bursts(engine, monkeypatch)
        threads.runs.clear()
        adder = engine.get("adder")
        good = [_adder_inputs(1, seed=1000 + i) for i in range(5)]
        bad = {"x": np.ones((1, 2), np.float32), "y": np.ones((1, 3), np.float32)}

        async def together(batch: list[Arrays]) -> list[Any]:
            return list(await asyncio.gather(*(engine.infer(adder, r) for r in batch), return_exceptions=True))

        answers = asyncio.run(together([good[0], good[1], bad, good[2]]))
        assert isinstance(answers[2], SpecError) and "Dim 1 of tensor 'y'" in str(answers[2])
        for inputs, got in zip([good[0], good[1], good[2]], [answers[0], answers[1], answers[3]]):
            _check_adder(inputs, got)
        assert [rows for _, rows in threads.runs] == [1, 2]  # the bad one never ran
        threads.runs.clear()
        threads.fail_merged = True
        answers = asyncio.run(together(good))
        _check_adder(good[0], answers[0])  # alone: its run has one row
        assert all(isinstance(a, BackendError) and "merged run" in str(a) for a in answers[1:]), answers
        assert [rows for _, rows in threads.runs] == [1, 4]
        threads.fail_merged = False
        for inputs, got in zip(good, asyncio.run(together(good))):
            _check_adder(inputs, got)
    finally:
        engine.close()


def test_rest_and_grpc_clients_at_once_share_the_batcher(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # REST requests run on the event loop (alone or gathered), gRPC requests on their threads
    # (alone when the batcher is idle, else queued for its batches): every answer is right
    # and the statistics count every request and row once.
    grpc = pytest.importorskip("grpc")
    from neuropod_serving.protocol import grpc_codec
    from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
    from neuropod_serving.server.grpc_server import start_grpc_server

    engine, threads = _fast_engine(repo, BatchPolicy(8), monkeypatch)
    before = _stats(engine)
    n, rounds = 8, 5
    try:
        server, port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
        try:
            with serve_in_thread(create_app(engine)) as http_port, grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                infer = ch.unary_unary(
                    "/inference.GRPCInferenceService/ModelInfer",
                    request_serializer=pb.ModelInferRequest.SerializeToString,
                    response_deserializer=pb.ModelInferResponse.FromString,
                )
                start = threading.Barrier(2 * n)

                def over_grpc(i: int) -> list[tuple[Arrays, Arrays]]:
                    start.wait()
                    out = []
                    for r in range(rounds):
                        inputs = _adder_inputs(1 + r % 2, 1100 + 10 * i + r)
                        request = pb.ModelInferRequest(model_name="adder")
                        for name, array in inputs.items():
                            t = request.inputs.add()
                            t.name, t.datatype = name, "FP32"
                            t.shape.extend(array.shape)
                            request.raw_input_contents.append(array.tobytes())
                        reply = grpc_codec.parse_model_infer_response(infer(request, timeout=60))
                        out.append((inputs, reply.outputs))
                    return out

                def over_rest(i: int) -> list[tuple[Arrays, Arrays]]:
                    client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=60)
                    try:
                        start.wait()
                        out = []
                        for r in range(rounds):
                            inputs = _adder_inputs(1 + r % 2, 1300 + 10 * i + r)
                            tensors = []
                            for name in ("x", "y"):
                                t = httpclient.InferInput(name, list(inputs[name].shape), "FP32")
                                t.set_data_from_numpy(inputs[name], binary_data=True)
                                tensors.append(t)
                            result = client.infer("adder", tensors)
                            out.append((inputs, {k: result.as_numpy(k) for k in ("out", "doubled")}))
                        return out
                    finally:
                        client.close()

                with ThreadPoolExecutor(2 * n) as pool:
                    futures = [pool.submit(over_grpc, i) for i in range(n)] + [
                        pool.submit(over_rest, i) for i in range(n)
                    ]
                    answers = [a for f in futures for a in f.result(120)]
        finally:
            server.stop(None)
        for inputs, got in answers:
            _check_adder(inputs, got)
        rows = sum(inputs["x"].shape[0] for inputs, _ in answers)
        after = _stats(engine)
        assert len(answers) == 2 * n * rounds
        assert after["inference_count"] - before["inference_count"] == rows == sum(r for _, r in threads.runs)
        assert after["execution_count"] - before["execution_count"] == len(threads.runs)
        assert after["inference_stats"]["queue"]["count"] - before["inference_stats"]["queue"]["count"] == len(answers)
        assert max(r for _, r in threads.runs) <= 8
    finally:
        engine.close()


# --- the CLI ----------------------------------------------------------------------------------


def test_startup_table_says_which_models_are_batched(repo: Path) -> None:
    engine = Engine(ModelRegistry.load([repo / "models"]), batching=BatchPolicy(8))
    try:
        table = startup_table(engine.registry, engine).splitlines()
    finally:
        engine.close()
    header = table[0].split()
    assert header == ["MODEL", "PLATFORM", "BACKEND", "DEVICE", "BATCHED", "INPUTS"]
    col = table[0].index("BATCHED")
    batched = {line.split()[0]: line[col:] for line in table[1:]}
    assert batched["adder"].startswith("yes ")
    assert batched["echo"].startswith("yes ")
    assert batched["nolead"].startswith("no (no batch dimension: tensor 'v' starts with None, not a symbol)")
    assert batched["square"].startswith("no (no batch dimension: tensor 'm' uses 'batch_size' past its first dim)")


def test_serve_command_max_batch_size_table(repo: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    models = repo / "models"
    cmd = [sys.executable, "-m", "neuropod", "serve", str(models / "adder"), str(models / "nolead"),
           "--http-port", str(port), "--grpc-port", "0", "--metrics-port", "0", "--max-batch-size", "8"]  # fmt: skip
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ))
        lines: list[str] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # the table, then the "serving ..." line (flushed) once it listens
                lines.append(line.rstrip("\n"))
                if line.startswith("serving "):
                    break
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            err.seek(0)
            stderr = err.read()
    assert lines and lines[-1].startswith("serving 2 model(s)"), f"{lines}\n{stderr}"
    header = lines[0]
    assert header.split() == ["MODEL", "PLATFORM", "BACKEND", "DEVICE", "BATCHED", "INPUTS"], lines
    col = header.index("BATCHED")
    rows = {line.split()[0]: line[col:] for line in lines[1:-1]}
    assert rows["adder"].startswith("yes "), lines
    assert rows["nolead"].startswith("no (no batch dimension: tensor 'v' starts with None, not a symbol)"), lines
