"""Out-of-process execution with a small backend installed as a real distribution,
so that worker processes find it through its entry point like any plugin."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import neuropod
from neuropod.errors import BackendError, NeuropodError, SpecError, WorkerError
from neuropod.testing import run_in_threads

from _ope_toy import OUT, XY, adder, install_toy, package, xy
from _ope_toy import gone as _gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OPE needs Linux")

@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    yield from install_toy(tmp_path, monkeypatch)


def test_infer_in_a_worker_with_the_same_checks(toy: Path) -> None:
    with adder(toy) as model:
        assert model.worker_pids and model.worker_pids[0] != os.getpid()
        inputs = xy(3)
        out = model.infer(inputs)["out"]
        np.testing.assert_allclose(out, inputs["x"] + inputs["y"], rtol=1e-6)
        assert not out.flags.owndata, "the output is a view over shared memory, not a copy"
        with pytest.raises(SpecError, match=r"symbol 'batch' should be the same size. .* size 3 \(from tensor 'x'\), but was of size 1"):
            model.infer({"x": inputs["x"], "y": np.zeros((1, 2), np.float32)})
        # Non-contiguous and differently sized inputs in the next calls.
        big = np.arange(16, dtype=np.float32).reshape(4, 4)
        np.testing.assert_array_equal(model.infer({"x": big[:, ::2], "y": big[:, 1::2]})["out"], big[:, ::2] + big[:, 1::2])
        pid = model.worker_pids[0]
    assert _gone(pid), "closing the model ends its worker"


def test_worker_run_time_counts_the_backends_time_in_the_workers(toy: Path) -> None:
    with adder(toy) as model:
        assert model.worker_run_time == (0, 0.0)
        began = time.perf_counter()
        for batch in (1, 2, 3):
            model.infer(xy(batch))
        took = time.perf_counter() - began
        calls, seconds = model.worker_run_time
        assert calls == 3
        assert 0 < seconds < took, "the backend's own time, measured in the worker: less than the round trips"
        with pytest.raises(NeuropodError):
            model.infer({"x": xy(1)["x"]})  # refused before it is sent: no call
        assert model.worker_run_time[0] == 3


def test_output_blocks_are_reused_only_when_free(toy: Path) -> None:
    with adder(toy) as model:
        first = model.infer(xy(seed=1))["out"]
        kept = first.copy()
        second = model.infer(xy(seed=2))["out"]
        assert not np.shares_memory(first, second), "a block is not reused while an array over it lives"
        np.testing.assert_array_equal(first, kept)
        freed = {first.ctypes.data, second.ctypes.data}
        del first, second
        third_inputs = xy(seed=3)
        third = model.infer(third_inputs)["out"]
        assert third.ctypes.data in freed, "a block no array uses any more is reused"
        np.testing.assert_allclose(third, third_inputs["x"] + third_inputs["y"], rtol=1e-6)


def test_empty_gives_zero_copy_inputs(toy: Path) -> None:
    with adder(toy) as model:
        x = model.empty("x", (3, 2))
        y = model.empty("y", (3, 2))
        x[...] = np.arange(6).reshape(3, 2)
        y[...] = 10
        np.testing.assert_array_equal(model.infer({"x": x, "y": y})["out"], np.arange(6).reshape(3, 2) + 10)
        x[...] = 1  # refill in place and call again
        np.testing.assert_array_equal(model.infer({"x": x, "y": y})["out"], np.full((3, 2), 11))
        for i in range(3):  # one input from empty(), one copied, in calls of the same layout
            x[...] = i
            np.testing.assert_array_equal(model.infer({"x": x, "y": np.full((3, 2), 10 * i, np.float32)})["out"],
                                          np.full((3, 2), 11 * i))  # fmt: skip
        with pytest.raises(SpecError, match="no input named 'z'"):
            model.empty("z", (1,))


def test_strings_cross_as_unicode(toy: Path) -> None:
    spec = [{"name": "x", "dtype": "string", "shape": [None]}]
    with neuropod.load_neuropod(package(toy, "upper", spec, [{"name": "out", "dtype": "string", "shape": [None]}]),
                                use_ope=True) as model:  # fmt: skip
        for given in (np.array(["apple", "Banana"]), np.array(["apple", "Banana"], dtype=object)):
            assert model.infer({"x": given})["out"].tolist() == ["APPLE", "BANANA"]


def test_exception_in_the_worker_comes_back_with_its_traceback(toy: Path) -> None:
    path = package(toy, "raise", [{"name": "x", "dtype": "float32", "shape": [None]}], OUT[:1])
    with neuropod.load_neuropod(path, use_ope=True) as model:
        with pytest.raises(BackendError, match="toy framework exploded") as info:
            model.infer({"x": np.ones(2, np.float32)})
        assert "Traceback" in info.value.worker_traceback  # type: ignore[attr-defined]
        assert model.worker_pids, "the worker survives an exception"


def test_segfault_in_the_worker_is_a_prompt_worker_error(toy: Path) -> None:
    path = package(toy, "segfault", [{"name": "x", "dtype": "float32", "shape": [None]}], OUT[:1])
    with neuropod.load_neuropod(path, use_ope=True) as model:
        start = time.monotonic()
        with pytest.raises(WorkerError, match="killed by signal SIGSEGV") as info:
            model.infer({"x": np.ones(2, np.float32)})
        assert time.monotonic() - start < 10
        assert "Fatal Python error" in str(info.value), "the end of the worker's stderr is in the error"


def test_killed_worker_and_restart(toy: Path) -> None:
    with adder(toy) as model:
        os.kill(model.worker_pids[0], signal.SIGKILL)
        model._pool.workers[0].proc.wait(timeout=5)  # dead before the next call
        with pytest.raises(WorkerError, match="died \\(killed by signal SIGKILL\\)"):
            model.infer(xy())
        with pytest.raises(WorkerError, match=r"has stopped: it died \(killed by signal SIGKILL\)\. Load the model again, or pass restart=True"):
            model.infer(xy())
    with adder(toy, restart=True) as model:
        old = model.worker_pids[0]
        os.kill(old, signal.SIGKILL)
        with pytest.raises(WorkerError, match="It will be restarted on the next call"):
            model.infer(xy())
        inputs = xy()
        np.testing.assert_allclose(model.infer(inputs)["out"], inputs["x"] + inputs["y"], rtol=1e-6)
        assert model.worker_pids[0] != old


def test_timeout_kills_a_stuck_worker(toy: Path) -> None:
    path = package(toy, "sleep", [{"name": "x", "dtype": "float32", "shape": [None]}], OUT[:1])
    with neuropod.load_neuropod(path, use_ope=True, timeout=0.5) as model:
        start = time.monotonic()
        with pytest.raises(WorkerError, match="did not answer within 0.5 s"):
            model.infer({"x": np.ones(2, np.float32)})
        assert time.monotonic() - start < 8


def test_workers_die_with_their_parent_and_leave_no_shared_memory(toy: Path) -> None:
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    path = package(toy, "add", XY, OUT)
    script = textwrap.dedent(f"""
        import os, signal, sys, numpy as np, neuropod
        m = neuropod.load_neuropod({str(path)!r}, use_ope=True, workers=2)
        m.infer({{"x": np.ones((2, 2), np.float32), "y": np.ones((2, 2), np.float32)}})
        print(" ".join(map(str, m.worker_pids)), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    parent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=os.environ)
    assert parent.returncode == -signal.SIGKILL
    pids = [int(p) for p in parent.stdout.split()]
    assert len(pids) == 2
    for pid in pids:
        assert _gone(pid), f"worker {pid} outlived its killed parent"
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after <= before, f"leaked shared memory: {sorted(after - before)}"


def test_threads_share_a_pool_of_workers(toy: Path) -> None:
    with adder(toy, workers=2) as model:
        assert len(model.worker_pids) == 2

        def work(seed: int) -> None:
            for i in range(30):
                inputs = xy(seed % 3 + 1, seed * 100 + i)
                np.testing.assert_allclose(model.infer(inputs)["out"], inputs["x"] + inputs["y"], rtol=1e-6)

        run_in_threads(work, 4)


def test_many_inputs(toy: Path) -> None:
    spec = [{"name": f"in{i}", "dtype": "float32", "shape": [10, 5]} for i in range(100)]
    path = package(toy, "sum100", spec, [{"name": "out", "dtype": "float32", "shape": [10, 5]}])
    inputs = {f"in{i}": np.full((10, 5), i, np.float32) for i in range(100)}
    with neuropod.load_neuropod(path, use_ope=True) as model:
        for _ in range(3):
            np.testing.assert_array_equal(model.infer(inputs)["out"], np.full((10, 5), sum(range(100))))


def test_a_worker_that_cannot_load_the_model(toy: Path) -> None:
    path = package(toy, "add", XY, OUT)
    with pytest.raises(NeuropodError, match="callback=<built-in function print> cannot be sent to a worker"):
        neuropod.load_neuropod(path, use_ope=True, callback=print)
