"""A stateful model in worker processes: each sequence's state stays in the worker that holds it
(neuropod.ope.sequences), with real ONNX and Python-backend accumulators."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import neuropod
from neuropod.errors import SequenceError, SequenceLimitError, WorkerError
from neuropod.package import read_package
from neuropod.sequences import SequenceStep, StateMismatchError
from neuropod.testing import run_in_threads

from _ope_toy import gone

pytest.importorskip("onnxruntime", reason="needs onnxruntime (nox -s tests_onnx runs this file with it)")
onnx = pytest.importorskip("onnx", reason="needs onnx (nox -s tests_onnx runs this file with it)")
pytest.importorskip("neuropod_onnx", reason="needs neuropod-onnx")
TensorProto, helper = onnx.TensorProto, onnx.helper
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OPE needs Linux")

STATE = [{"input_name": "acc_in", "output_name": "acc_out"}]


def accumulator(path: Path, *, width: int = 4, x_width: int = 4, y_width: int = 4, declare: bool = True) -> Path:
    """An ONNX accumulator: ``acc_out = acc_in + x`` (x broadcast over the state's width), and
    ``y = acc_out[:, :y_width]``; ``declare``: its package declares the state pair."""
    from neuropod_onnx.packager import create_onnx_neuropod  # lazy: the ONNX plugin, only where it is installed

    def value(name: str, width: int) -> Any:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", width])

    def const(name: str, value: int) -> Any:
        return helper.make_tensor(name, TensorProto.INT64, [1], [value])

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["acc_in", "x"], ["acc_out"]),
            helper.make_node("Slice", ["acc_out", "zero", "end", "one"], ["y"]),
        ],
        "acc",
        [value("x", x_width), value("acc_in", width)],
        [value("y", y_width), value("acc_out", width)],
        initializer=[const("zero", 0), const("end", y_width), const("one", 1)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    spec = [{"name": n, "dtype": "float32", "shape": ["batch", w]} for n, w in (("x", x_width), ("acc_in", width))]
    out = [{"name": n, "dtype": "float32", "shape": ["batch", w]} for n, w in (("y", y_width), ("acc_out", width))]
    extra = {"state_spec": STATE} if declare else {}
    return Path(create_onnx_neuropod(path, path.name, spec, out, onnx_model=model, **extra))


@pytest.fixture(scope="module")
def acc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return accumulator(tmp_path_factory.mktemp("acc") / "acc")


@pytest.fixture(scope="module")
def pair(acc: Path) -> Iterator[neuropod.NeuropodModel]:
    """The accumulator in two workers, shared by the tests that leave no sequence live."""
    with neuropod.load_neuropod(acc, use_ope=True, workers=2) as model:
        yield model


def steps_of(n: int, seed: int) -> np.ndarray:
    """``n`` steps' inputs of one sequence: small integers as float32, so sums are exact."""
    return np.random.default_rng(seed).integers(-50, 50, (n, 1, 4)).astype(np.float32)


def test_a_sequence_runs_with_its_state_in_the_worker(pair: neuropod.NeuropodModel) -> None:
    model = pair
    assert model.stateful and model.inputs[0].name == "x" and len(model.inputs) == 1
    xs = steps_of(20, 1)
    with model.sequence() as seq:
        got = [seq.infer({"x": x})["y"] for x in xs]
        np.testing.assert_array_equal(np.concatenate(got), np.cumsum(xs, axis=0)[:, 0])
        state = seq.state()  # copied from the worker, only when asked
        np.testing.assert_array_equal(state["acc_in"], xs.sum(axis=0))
        state["acc_in"][...] = 1000  # a copy: the sequence's state does not change
        assert sum(model.worker_sequences) == 1 and model.live_sequences == 1
        np.testing.assert_array_equal(seq.infer({"x": xs[0]})["y"], xs.sum(axis=0) + xs[0])
    # Leaving the block frees the state in the worker at once.
    assert model.worker_sequences == [0, 0] and model.live_sequences == 0
    with pytest.raises(SequenceError, match=r"sequence 5 is not live on model 'acc': it was never started"):
        model.infer({"x": xs[0]}, sequence_id=5)
    # A step with end=True frees it too; and a sequence's first step in the worker is the initial state.
    with model.sequence(7) as seq:
        assert seq.state()["acc_in"].tolist() == [[0.0] * 4]
        seq.infer({"x": xs[0]})
        np.testing.assert_array_equal(seq.infer({"x": xs[1]}, end=True)["y"], xs[0] + xs[1])
        assert model.worker_sequences == [0, 0]
        with pytest.raises(SequenceError, match="has ended"):
            seq.infer({"x": xs[0]})


def test_no_state_crosses_between_the_processes_per_step(tmp_path: Path) -> None:
    width = 1 << 20  # 4 MiB of state; x and y are 4 bytes and 16 bytes a step
    path = accumulator(tmp_path / "big", width=width, x_width=1)
    with neuropod.load_neuropod(path, use_ope=True) as model, model.sequence() as seq:
        for i in range(1, 6):
            y = seq.infer({"x": np.full((1, 1), i, np.float32)})["y"]
            assert y.tolist() == [[i * (i + 1) / 2] * 4]
        (worker,) = model._pool.workers
        assert worker.arena is not None and worker.arena.size <= 4096, "only x crossed to the worker"
        assert max(b.size for b in worker.out_blocks.values()) <= 4096, "only y came back"
        state = seq.state()["acc_in"]  # the 4 MiB cross once, when asked
        assert state.shape == (1, width) and (state == 15).all()


def test_interleaved_sequences_from_threads_over_two_workers(pair: neuropod.NeuropodModel) -> None:
    model = pair
    together = threading.Barrier(6, timeout=60)  # broken, not hung, if a thread fails first
    counts: list[int] = []

    def work(n: int) -> None:
        xs = steps_of(40, 100 + n)
        with model.sequence() as seq:
            for i, x in enumerate(xs):
                y = seq.infer({"x": x})["y"]
                np.testing.assert_array_equal(y, xs[: i + 1].sum(axis=0), err_msg=f"sequence {n}, step {i}")
                if i == 0:  # all six live at once: three on each worker
                    together.wait()
                    if n == 0:
                        counts.extend(model.worker_sequences)
                    together.wait()

    run_in_threads(work, 6)
    assert counts == [3, 3]
    assert model.worker_sequences == [0, 0] and model.live_sequences == 0


def test_one_call_of_sequences_held_by_two_workers(pair: neuropod.NeuropodModel) -> None:
    model = pair
    assert model.sequence_batching
    xs = {i: steps_of(3, i) for i in (1, 2, 3)}
    first = model.infer_sequences(
        {"x": np.concatenate([xs[i][0] for i in (1, 2, 3)])}, [SequenceStep(i, start=True) for i in (1, 2, 3)]
    )
    np.testing.assert_array_equal(first["y"], np.concatenate([xs[i][0] for i in (1, 2, 3)]))
    assert sorted(model.worker_sequences) == [1, 2], "new sequences went to the worker holding fewer"
    for step, order in ((1, (3, 1, 2)), (2, (2, 3, 1))):  # each call in another order, split by worker
        out = model.infer_sequences(
            {"x": np.concatenate([xs[i][step] for i in order])},
            [SequenceStep(i, end=step == 2) for i in order],
        )
        np.testing.assert_array_equal(out["y"], np.concatenate([xs[i][: step + 1].sum(axis=0) for i in order]))
    assert model.worker_sequences == [0, 0] and model.live_sequences == 0


def test_idle_limit_and_bound_on_live_sequences_hold_across_workers(pair: neuropod.NeuropodModel) -> None:
    model = pair
    x = np.ones((1, 4), np.float32)
    model.configure_sequences(max_live=2)
    model.infer({"x": x}, sequence_id=1, sequence_start=True)
    model.infer({"x": x}, sequence_id=2, sequence_start=True)
    assert model.worker_sequences == [1, 1]
    with pytest.raises(SequenceLimitError, match=r"has 2 live sequences, its most \(2\); sequence 3 cannot start"):
        model.infer({"x": x}, sequence_id=3, sequence_start=True)
    model.infer({"x": x}, sequence_id=1, sequence_end=True)
    model.infer({"x": x}, sequence_id=3, sequence_start=True)
    assert sorted(model.worker_sequences) == [1, 1]

    model.configure_sequences(max_idle_s=0.05)
    time.sleep(0.15)
    with pytest.raises(
        SequenceError, match=r"sequence 2 is not live .* sat idle longer than the model's idle limit \(0.05 s\)"
    ):
        model.infer({"x": x}, sequence_id=2)
    assert model.live_sequences == 0
    assert model.worker_sequences == [0, 0], "expired sequences are freed in their workers"
    assert model.infer({"x": x}, sequence_id=2, sequence_start=True)["y"].tolist() == [[1.0] * 4]
    # A server's sweep frees expired sequences in their workers with no step coming.
    model.infer({"x": x}, sequence_id=4, sequence_start=True)
    assert model.worker_sequences == [1, 1]
    time.sleep(0.15)
    assert model.sweep_sequences() == 2
    assert model.live_sequences == 0 and model.worker_sequences == [0, 0]
    model.configure_sequences()


def test_a_killed_worker_ends_its_sequences_with_a_clear_error(acc: Path) -> None:
    fds = len(os.listdir("/proc/self/fd"))
    with neuropod.load_neuropod(acc, use_ope=True, workers=2, restart=True) as model:
        xs = steps_of(3, 7)
        model.infer({"x": xs[0]}, sequence_id=1, sequence_start=True)
        model.infer({"x": xs[0]}, sequence_id=2, sequence_start=True)
        model.infer({"x": xs[0]}, sequence_id=3, sequence_start=True)  # with sequence 1, on the first worker
        first = model._pool.workers[0].proc.pid
        os.kill(first, signal.SIGKILL)
        assert gone(first)
        with pytest.raises(WorkerError, match=r"(?s)died .*Sequence\(s\) 1 of model 'acc' "
                           r"lost their state with that worker: start them again"):  # fmt: skip
            model.infer({"x": xs[1]}, sequence_id=1)
        with pytest.raises(SequenceError, match=r"sequence 3 is not live on model 'acc': it lost its state when the "
                           r"worker process that held it stopped"):  # fmt: skip
            model.infer({"x": xs[1]}, sequence_id=3)
        # The other worker's sequence goes on; the first worker restarts and takes new sequences.
        np.testing.assert_array_equal(model.infer({"x": xs[1]}, sequence_id=2)["y"], xs[0] + xs[1])
        np.testing.assert_array_equal(model.infer({"x": xs[2]}, sequence_id=1, sequence_start=True)["y"], xs[2])
        np.testing.assert_array_equal(model.infer({"x": xs[2]}, sequence_id=1)["y"], 2 * xs[2])
        assert model.live_sequences == 2 and model.worker_sequences == [1, 1]
        assert first not in model.worker_pids
        pids = model.worker_pids
    for pid in pids:
        assert gone(pid)
    assert len(os.listdir("/proc/self/fd")) <= fds, "no pipe, socket or shared-memory descriptor left open"


def test_a_worker_killed_during_a_step(tmp_path: Path) -> None:
    from neuropod.packagers import create_python_neuropod  # lazy: the Python plugin's packager

    (tmp_path / "src" / "fragile").mkdir(parents=True)
    (tmp_path / "src" / "fragile" / "model.py").write_text(
        textwrap.dedent("""
        import os, signal

        def get_model(data_root):
            def run(x, acc_in):
                if (x < 0).any():
                    os.kill(os.getpid(), signal.SIGKILL)
                if (x > 100).any():  # a state output that does not fit the state
                    return {"y": acc_in + x, "acc_out": (acc_in + x)[:, :1]}
                if (x == 7).all():  # the input itself as the new state (in the worker, a view of shared memory)
                    return {"y": acc_in + x, "acc_out": x}
                return {"y": acc_in + x, "acc_out": acc_in + x}
            return run
    """)
    )
    spec = [{"name": n, "dtype": "float64", "shape": ["batch", 2]} for n in ("x", "acc_in")]
    create_python_neuropod(
        neuropod_path=str(tmp_path / "fragile.neuropod"), model_name="fragile", data_paths=[],
        code_path_spec=[{"python_root": str(tmp_path / "src"), "dirs_to_package": ["fragile"]}],
        entrypoint_package="fragile.model", entrypoint="get_model", input_spec=spec,
        output_spec=[{"name": n, "dtype": "float64", "shape": ["batch", 2]} for n in ("y", "acc_out")],
        state_spec=STATE,
    )  # fmt: skip
    ok = np.ones((1, 2))
    with neuropod.load_neuropod(tmp_path / "fragile.neuropod", use_ope=True, restart=True) as model:
        with model.sequence("a") as seq:
            seq.infer({"x": ok})
            with pytest.raises(
                StateMismatchError, match=r"state output 'acc_out' is float64 \[1, 1\], but its state_spec"
            ):
                seq.infer({"x": 1000 * ok})
            assert seq.state()["acc_in"].tolist() == [[1.0, 1.0]], "the state stays as it was"
            with pytest.raises(WorkerError, match=r"(?s)died .*Sequence\(s\) 'a' of model 'fragile' lost their state"):
                seq.infer({"x": -ok})
            with pytest.raises(SequenceError, match="'a' is not live .* lost its state"):
                seq.infer({"x": ok})
        with model.sequence("a") as seq:  # the same id again, from its start, in the new worker
            assert seq.infer({"x": ok})["y"].tolist() == [[1.0, 1.0]]
            assert seq.infer({"x": ok})["y"].tolist() == [[2.0, 2.0]]
            # A state that is a view of the step's input is kept as it was, not as the next input.
            assert seq.infer({"x": 7 * ok})["y"].tolist() == [[9.0, 9.0]]
            assert seq.infer({"x": ok})["y"].tolist() == [[8.0, 8.0]]
        assert model.worker_sequences == [0]


def test_sequences_given_at_load_run_in_the_worker(tmp_path: Path) -> None:
    path = accumulator(tmp_path / "plain", x_width=1, declare=False)
    assert not read_package(path).config.state_spec
    # Its state and a control input filled by the worker (x: 1 on each step), declared at load:
    # each step adds 1 to the state.
    declared = {"state_spec": STATE, "sequence_controls": [{"name": "x", "kind": "CONTROL_SEQUENCE_READY"}]}
    with neuropod.load_neuropod(path, use_ope=True, sequences=declared) as model:
        assert model.stateful and model.inputs == []
        with model.sequence() as seq:
            got = [seq.infer({})["y"].tolist() for _ in range(3)]
            assert model.worker_sequences == [1]
        assert got == [[[float(n)] * 4] for n in (1, 2, 3)]
        assert model.worker_sequences == [0]
