"""Sequence batching: steps of different sequences of a stateful model in one run.

Real ONNX models with implicit state: ``acc`` (y = acc_in + x, state acc_out -> acc_in, every
tensor [batch, 4]), ``lookup`` (y = acc_in + table[idx]: onnxruntime fails on an index outside
the 4-row table) and ``flat`` (the accumulator without a batch dimension: its sequences cannot
share a run). Expected values are each sequence's running sum (numpy cumsum of what it sent).
Runs are counted by wrapping the real model's ``infer_sequences``.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from onnx import TensorProto, helper  # noqa: E402

from neuropod.errors import NeuropodError, SequenceError, SequenceLimitError  # noqa: E402
from neuropod.sequences import SequenceStep  # noqa: E402
from neuropod_serving.protocol.options import RequestOptions  # noqa: E402
from neuropod_serving.server import BatchPolicy, Engine, ModelRegistry, create_app  # noqa: E402
from neuropod_serving.server.launcher import startup_table  # noqa: E402
from neuropod_serving.server.metrics import ServerMetrics  # noqa: E402
from neuropod_serving.server.sequence_batching import SequenceBatcher, SequenceLimits  # noqa: E402

from conftest import onnx_package, private_caches, serve_in_thread  # noqa: E402

TABLE = np.arange(12, dtype=np.float32).reshape(4, 3)


@pytest.fixture(scope="module")
def repo() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-seqbatch-test-"))
    models = root / "models"
    acc_nodes = [helper.make_node("Add", ["x", "acc_in"], ["y"]), helper.make_node("Identity", ["y"], ["acc_out"])]
    state = [{"input_name": "acc_in", "output_name": "acc_out"}]
    with private_caches(root):
        onnx_package(models / "acc", "acc", acc_nodes,
                     [("x", "float32", ["batch", 4]), ("acc_in", "float32", ["batch", 4])],
                     [("y", "float32", ["batch", 4]), ("acc_out", "float32", ["batch", 4])], state_spec=state)  # fmt: skip
        onnx_package(models / "flat", "flat", acc_nodes,
                     [("x", "float32", [4]), ("acc_in", "float32", [4])],
                     [("y", "float32", [4]), ("acc_out", "float32", [4])], state_spec=state)  # fmt: skip
        onnx_package(models / "lookup", "lookup",
                     [helper.make_node("Gather", ["table", "idx"], ["row"]), helper.make_node("Add", ["acc_in", "row"], ["y"]),
                      helper.make_node("Identity", ["y"], ["acc_out"])],
                     [("idx", "int64", ["batch"]), ("acc_in", "float32", ["batch", 3])],
                     [("y", "float32", ["batch", 3]), ("acc_out", "float32", ["batch", 3])],
                     [helper.make_tensor("table", TensorProto.FLOAT, [4, 3], TABLE.ravel().tolist())],
                     state_spec=state)  # fmt: skip
        yield root
    shutil.rmtree(root, ignore_errors=True)


class Runs:
    """Wraps a model's real ``infer_sequences``: the sequence ids of each run, and the most runs at once."""

    def __init__(self, model: Any, hold_s: float = 0.0) -> None:
        self.model = model
        self.real = model.infer_sequences
        self.hold_s = hold_s
        self.calls: list[list[int | str]] = []
        self.running: set[int | str] = set()
        self.overlaps: list[int | str] = []
        self.lock = threading.Lock()
        model.infer_sequences = self

    def __call__(self, inputs: Any, steps: list[SequenceStep], *args: Any, **kw: Any) -> Any:
        ids = [s.sequence_id for s in steps]
        with self.lock:
            self.calls.append(ids)
            self.overlaps += [i for i in ids if i in self.running]
            self.running.update(ids)
        try:
            if self.hold_s:
                time.sleep(self.hold_s)
            return self.real(inputs, steps, *args, **kw)
        finally:
            with self.lock:
                self.running.difference_update(ids)


def engine_for(repo: Path, names: list[str], *, delay_s: float = 0.0, size: int = 16, **kw: Any) -> Engine:
    registry = ModelRegistry.load([repo / "models" / n for n in names])
    return Engine(registry, batching=BatchPolicy(size, delay_s), **kw)


def step(sequence_id: int | str, start: bool = False, end: bool = False) -> RequestOptions:
    return RequestOptions(sequence=SequenceStep(sequence_id, start, end))


def xs(seq: int, n: int) -> np.ndarray:
    """What sequence ``seq`` sends in its ``n`` steps: distinct per step and sequence, so a step
    out of order or another sequence's state shows in the sums."""
    return (np.arange(n * 4, dtype=np.float32).reshape(n, 1, 4) % 7 + seq * 10 + 1) * np.float32(1 + seq % 3)


# --- the engine -----------------------------------------------------------------------------


@pytest.mark.parametrize("delay_s", [0.0, 0.001])
def test_steps_of_concurrent_sequences_share_runs_value_exact(repo: Path, delay_s: float) -> None:
    """32 sequences from 32 threads, 30 steps each, with gRPC's blocking path: every answer is
    that sequence's running sum; runs hold several sequences, never one twice. Without a queue
    delay, a step that finds the batcher idle runs on its caller's thread, and steps arriving
    while a run holds the slot share the next."""
    metrics = ServerMetrics()
    engine = engine_for(repo, ["acc"], delay_s=delay_s, size=16, metrics=metrics)
    try:
        served = engine.get("acc")
        assert engine.batched("acc") == (True, "sequence batching")
        assert engine._runners[("acc", "1")].batcher is None  # never the ordinary batcher
        # Without a delay, runs this model's length (10 us) rarely overlap another arrival: held for 1 ms, they do.
        runs = Runs(served.model, hold_s=0.001 if delay_s == 0 else 0.0)
        steps = 30

        def client(seq: int) -> None:
            sent = xs(seq, steps)
            want = np.cumsum(sent, axis=0)
            for k in range(steps):
                out = engine.infer_blocking(served, {"x": sent[k]}, None, step(seq, k == 0, k == steps - 1))
                np.testing.assert_array_equal(out["y"], want[k])

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(client, range(1, 33)))
        assert sum(len(c) for c in runs.calls) == 32 * steps
        assert all(len(set(c)) == len(c) <= 16 for c in runs.calls)
        assert len(runs.calls) < 32 * steps / 2, f"{len(runs.calls)} runs for {32 * steps} steps: hardly merged"
        stats = metrics.statistics("acc", "1")
        sizes = {b["batch_size"] for b in stats["batch_stats"]}
        assert max(sizes) > 1 and stats["inference_count"] == 32 * steps
        assert served.model.live_sequences == 0  # every sequence ended
    finally:
        engine.close()


def test_pipelined_steps_of_one_sequence_run_in_order_one_per_run(repo: Path) -> None:
    """Event-loop callers send every step of 4 sequences at once: each run takes one step of a
    sequence at most, and each sequence's steps run in the order sent."""
    engine = engine_for(repo, ["acc"], delay_s=0.002, size=8)
    try:
        served = engine.get("acc")
        runs = Runs(served.model)
        n = 12

        async def main() -> list[list[dict[str, np.ndarray]]]:
            tasks = [
                [asyncio.ensure_future(engine.infer(served, {"x": xs(seq, n)[k]}, None, step(seq, k == 0, k == n - 1)))
                 for k in range(n)]
                for seq in range(1, 5)
            ]  # fmt: skip
            return [list(await asyncio.gather(*t)) for t in tasks]

        answers = asyncio.run(main())
        for seq, outs in zip(range(1, 5), answers):
            want = np.cumsum(xs(seq, n), axis=0)
            for k, out in enumerate(outs):
                np.testing.assert_array_equal(out["y"], want[k])
        assert all(len(set(c)) == len(c) for c in runs.calls)
        assert max(len(c) for c in runs.calls) > 1  # sequences shared runs
    finally:
        engine.close()


def test_steps_with_different_parameters_never_share_a_run(repo: Path) -> None:
    engine = engine_for(repo, ["acc"], delay_s=0.3, size=4)
    try:
        served = engine.get("acc")
        runs = Runs(served.model)
        seen: list[tuple[list[int | str], Any]] = []
        real = runs.real

        def recording(inputs: Any, steps: list[SequenceStep], *args: Any, **kw: Any) -> Any:
            seen.append(([s.sequence_id for s in steps], kw.get("parameters")))
            return real(inputs, steps, *args, **kw)

        runs.real = recording
        one = np.ones((1, 4), np.float32)

        def send(seq: int) -> Any:
            options = RequestOptions(parameters={"p": seq % 2}, sequence=SequenceStep(seq, True))
            return engine.infer_blocking(served, {"x": seq * one}, None, options)

        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(send, [1, 2, 3, 4]))
        for seq, out in zip([1, 2, 3, 4], outs):
            np.testing.assert_array_equal(out["y"], seq * one)
        # Each run's steps share its parameters (1 and 3: p=1; 2 and 4: p=0): at least two runs.
        assert sorted(i for ids, _ in seen for i in ids) == [1, 2, 3, 4] and len(seen) >= 2
        assert all(dict(p) == {"p": i % 2} for ids, p in seen for i in ids), seen
    finally:
        engine.close()


def test_a_sequence_is_never_in_two_runs_at_once(repo: Path) -> None:
    """Three runs in flight at once (as with OPE workers): a sequence's next step waits for its run."""
    registry = ModelRegistry.load([repo / "models" / "acc"])
    model = registry.get("acc").model
    runs = Runs(model, hold_s=0.005)
    batcher = SequenceBatcher("acc", lambda i, s, r, p: model.infer_sequences(i, s, r), BatchPolicy(2), inflight=3)
    try:
        n = 10
        futures = {seq: [batcher.submit({"x": xs(seq, n)[k]}, SequenceStep(seq, k == 0), None) for k in range(n)]
                   for seq in range(1, 7)}  # fmt: skip
        for seq, fs in futures.items():
            want = np.cumsum(xs(seq, n), axis=0)
            for k, f in enumerate(fs):
                np.testing.assert_array_equal(f.result(10)["y"], want[k])
        assert runs.overlaps == [] and all(len(c) <= 2 for c in runs.calls)
    finally:
        batcher.close()
        registry.close()


def test_a_step_whose_timeout_passes_while_it_waits_never_runs(repo: Path) -> None:
    """A step queued behind its sequence's running step gives up at its timeout (not run); the
    sequence's next step continues from the state the running step left."""
    from neuropod_serving.errors import RequestTimeoutError

    engine = engine_for(repo, ["acc"], size=4)
    try:
        served = engine.get("acc")
        runs = Runs(served.model, hold_s=0.5)
        one = np.ones((1, 4), np.float32)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(engine.infer_blocking, served, {"x": one}, None, step(5, True))
            deadline = time.monotonic() + 10
            while not runs.calls and time.monotonic() < deadline:  # until the first step runs (held)
                time.sleep(0.005)
            late = RequestOptions(timeout_s=0.05, timeout_us=50_000, sequence=SequenceStep(5))
            with pytest.raises(RequestTimeoutError, match="50000"):
                engine.infer_blocking(served, {"x": 10 * one}, None, late)
            np.testing.assert_array_equal(first.result(10)["y"], one)
        runs.hold_s = 0.0
        np.testing.assert_array_equal(engine.infer_blocking(served, {"x": 2 * one}, None, step(5))["y"], 3 * one)
        assert runs.calls == [[5], [5]]
    finally:
        engine.close()


def test_sequences_batched_across_ope_workers(repo: Path) -> None:
    """With two OPE workers (two runs in flight), value-exact from 16 threads; the sweep reaches
    state held in the workers."""
    registry = ModelRegistry.load([repo / "models" / "acc"], workers=2)
    engine = Engine(registry, batching=BatchPolicy(8, 0.001), sequences=SequenceLimits(300_000, 100))
    try:
        served = engine.get("acc")
        assert engine.batched("acc") == (True, "sequence batching")
        n = 12

        def client(seq: int) -> None:
            sent = xs(seq, n)
            want = np.cumsum(sent, axis=0)
            for k in range(n):
                out = engine.infer_blocking(served, {"x": sent[k]}, None, step(seq, k == 0, k == n - 1))
                np.testing.assert_array_equal(out["y"], want[k])

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(client, range(1, 17)))
        assert engine.live_sequences() == {"acc": 0}
        engine.infer_blocking(served, {"x": xs(1, 1)[0]}, None, step(99, True))
        assert engine.live_sequences() == {"acc": 1}
        deadline = time.monotonic() + 10
        while engine.live_sequences()["acc"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.live_sequences() == {"acc": 0}
    finally:
        engine.close()


def test_a_failing_run_answers_each_of_its_requests_and_keeps_their_state(repo: Path) -> None:
    # A long delay: the 3 requests of a round make a full batch however slowly their threads start.
    engine = engine_for(repo, ["lookup"], delay_s=5.0, size=3, sequences=SequenceLimits(60_000_000, 10))
    try:
        served = engine.get("lookup")
        runs = Runs(served.model)

        def send(seq: int, idx: int, start: bool = False) -> Any:
            return engine.infer_blocking(served, {"idx": np.array([idx], np.int64)}, None, step(seq, start))

        with ThreadPoolExecutor(3) as pool:  # 3 = max_batch_size: one run, without waiting out the delay
            first = list(pool.map(lambda s: send(s, s, True), [1, 2, 3]))
            bad = [pool.submit(send, s, 9 if s == 2 else 0) for s in [1, 2, 3]]
            errors = [f.exception(10) for f in bad]
        assert sorted(runs.calls[0]) == [1, 2, 3] and sorted(runs.calls[1]) == [1, 2, 3]
        for seq, out in zip([1, 2, 3], first):
            np.testing.assert_array_equal(out["y"], TABLE[seq][None])
        assert all(isinstance(e, NeuropodError) for e in errors), errors
        assert len({str(e) for e in errors}) == 1  # one run's failure, given to each
        with ThreadPoolExecutor(3) as pool:  # each state as it was before the failed run
            again = list(pool.map(lambda s: send(s, 1), [1, 2, 3]))
        for seq, out in zip([1, 2, 3], again):
            np.testing.assert_array_equal(out["y"], (TABLE[seq] + TABLE[1])[None])
    finally:
        engine.close()


def test_a_sequence_error_fails_only_its_own_request(repo: Path) -> None:
    """A step of a sequence never started, and one sequence past the bound on live ones, in runs
    with good steps: only they fail (SequenceError, SequenceLimitError); the others run."""
    engine = engine_for(repo, ["acc"], delay_s=0.5, size=3, sequences=SequenceLimits(1_000_000, 4))
    try:
        served = engine.get("acc")
        one = np.ones((1, 4), np.float32)

        def send(seq: int, start: bool) -> Any:
            return engine.infer_blocking(served, {"x": one}, None, step(seq, start))

        with ThreadPoolExecutor(3) as pool:
            got = [pool.submit(send, 1, True), pool.submit(send, 2, True), pool.submit(send, 77, False)]
            assert isinstance(got[2].exception(10), SequenceError) and "77" in str(got[2].exception())
            np.testing.assert_array_equal(got[0].result()["y"], one)
            np.testing.assert_array_equal(got[1].result()["y"], one)
            # 2 live, bound 4: of 3 new sequences in one run, the third is refused.
            new = [pool.submit(send, s, True) for s in (3, 4, 5)]
            failed = [f for f in new if f.exception(10) is not None]
        assert len(failed) == 1 and isinstance(failed[0].exception(), SequenceLimitError)
        assert served.model.live_sequences == 4
        np.testing.assert_array_equal(send(1, False)["y"], 2 * one)
    finally:
        engine.close()


def test_idle_sequences_are_freed_without_traffic(repo: Path) -> None:
    engine = engine_for(repo, ["acc"], sequences=SequenceLimits(max_idle_us=200_000, max_sequences=10))
    try:
        served = engine.get("acc")
        one = np.ones((1, 4), np.float32)
        for seq in (1, 2):
            engine.infer_blocking(served, {"x": one}, None, step(seq, True))
        assert engine.live_sequences() == {"acc": 2}
        deadline = time.monotonic() + 5
        while served.model.live_sequences and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.live_sequences() == {"acc": 0}  # swept: nothing was sent meanwhile
        with pytest.raises(SequenceError, match=r"idle limit \(0.2 s\)"):
            engine.infer_blocking(served, {"x": one}, None, step(1))
    finally:
        engine.close()


def test_a_load_config_bounds_its_models_sequences(repo: Path) -> None:
    from dataclasses import replace

    engine = engine_for(repo, ["acc"])
    try:
        settings = replace(engine.default_settings, max_sequences=1, max_sequence_idle_us=2_000_000)
        served = engine.load("acc", settings=settings)
        one = np.ones((1, 4), np.float32)
        engine.infer_blocking(served, {"x": one}, None, step(1, True))
        with pytest.raises(SequenceLimitError, match="most \\(1\\)"):
            engine.infer_blocking(served, {"x": one}, None, step(2, True))
        assert engine._runners[("acc", "1")].sequence_idle_s == 2.0
    finally:
        engine.close()


def test_a_stateful_model_that_cannot_stack_sequences_runs_unbatched(repo: Path) -> None:
    engine = engine_for(repo, ["flat", "acc"], size=8)
    try:
        on, why = engine.batched("flat")
        assert not on and "cannot share a run" in why and "'x' [4] does not lead with a batch symbol" in why
        runner = engine._runners[("flat", "1")]
        assert runner.batcher is None and runner.sequencer is None
        table = startup_table(engine.registry, engine)
        assert f"no ({why})" in table and "yes (sequence batching)" in table
        served = engine.get("flat")
        sent = xs(3, 20)[:, 0]
        want = np.cumsum(sent, axis=0)

        def client(seq: int) -> None:
            for k in range(20):
                out = engine.infer_blocking(served, {"x": sent[k] * seq}, None, step(seq, k == 0))
                np.testing.assert_array_equal(out["y"], want[k] * seq)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(client, [1, 2, 3, 4]))
        # A step of one sequence with two rows is refused before it can join a batch.
        with pytest.raises(NeuropodError, match="2 rows"):
            engine.infer_blocking(engine.get("acc"), {"x": np.ones((2, 4), np.float32)}, None, step(9, True))
        with pytest.raises(SequenceError, match="carries state"):  # a request naming no sequence
            engine.infer_blocking(engine.get("acc"), {"x": np.ones((1, 4), np.float32)})
    finally:
        engine.close()


# --- a real server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[tuple[Engine, int, int]]:
    from neuropod_serving.server.grpc_server import start_grpc_server

    metrics = ServerMetrics()
    engine = engine_for(repo, ["acc"], delay_s=0.001, size=16, metrics=metrics,
                        sequences=SequenceLimits(1_000_000, 40))  # fmt: skip
    metrics.live_sequences = engine.live_sequences
    grpc_server, grpc_port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
    try:
        with serve_in_thread(create_app(engine)) as http_port:
            yield engine, http_port, grpc_port
    finally:
        grpc_server.stop(0)
        engine.close()


def test_tritonclients_sequences_are_batched_and_exact(server: tuple[Engine, int, int]) -> None:
    """16 REST and 16 gRPC clients, a sequence each (int ids over REST, string ids over gRPC)."""
    engine, http_port, grpc_port = server
    runs = Runs(engine.get("acc").model)
    n = 15

    def client(i: int) -> None:
        grpc = i % 2 == 1
        if grpc:
            c: Any = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            seq: int | str = f"client-{i}"
        else:
            c = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
            seq = 1000 + i
        mod = grpcclient if grpc else httpclient
        sent = xs(i, n)
        want = np.cumsum(sent, axis=0)
        try:
            for k in range(n):
                x = mod.InferInput("x", [1, 4], "FP32")
                x.set_data_from_numpy(sent[k])
                result = c.infer("acc", [x], sequence_id=seq, sequence_start=k == 0, sequence_end=k == n - 1)
                np.testing.assert_array_equal(result.as_numpy("y"), want[k])
        finally:
            c.close()

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(client, range(32)))
    assert sum(len(c) for c in runs.calls) == 32 * n and len(runs.calls) < 32 * n
    assert all(len(set(c)) == len(c) for c in runs.calls)
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/acc/stats") as r:
        import json

        stats = json.load(r)["model_stats"][0]
    assert max(b["batch_size"] for b in stats["batch_stats"]) > 1


def test_live_sequences_gauge_and_the_bound_over_rest(server: tuple[Engine, int, int]) -> None:
    engine, http_port, _ = server
    c = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    x = httpclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    try:
        for seq in range(1, 41):
            c.infer("acc", [x], sequence_id=seq, sequence_start=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics") as r:
            text = r.read().decode()
        assert 'neuropod_sequences_live{model="acc"} 40.0' in text
        with pytest.raises(httpclient.InferenceServerException) as info:
            c.infer("acc", [x], sequence_id=41, sequence_start=True)
        assert info.value.status() == "429" and "40" in info.value.message()
        for seq in range(1, 41):
            c.infer("acc", [x], sequence_id=seq, sequence_end=True)
        assert engine.live_sequences() == {"acc": 0}
    finally:
        c.close()


def test_cli_flags() -> None:
    import argparse

    from neuropod_serving import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["p"])
    assert (args.max_sequence_idle_us, args.max_sequences) == (1_000_000, 1024)
    args = parser.parse_args(["p", "--max-sequence-idle-us", "5000", "--max-sequences", "3"])
    assert (args.max_sequence_idle_us, args.max_sequences) == (5000, 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["p", "--max-sequences", "0"])
