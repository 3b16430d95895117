"""Out-of-process execution with a small backend installed as a real distribution,
so that worker processes find it through its entry point like any plugin."""

from __future__ import annotations

import json
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
from neuropod import plugins
from neuropod.errors import BackendError, NeuropodError, SpecError, WorkerError
from neuropod.package import parse_config, write_package
from neuropod.testing import run_in_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OPE needs Linux")

TOY = '''
"""A toy backend for OPE tests: numpy code chosen by the package's 0/data/op.json."""
import ctypes, json, time
import numpy as np
from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps

@hookimpl
def supported_versions():
    return [Backend("toyope", "1.0.0", "toyope-framework")]

@hookimpl
def device_caps(backend):
    return DeviceCaps() if backend.platform == "toyope" else None

@hookimpl
def load_model(package, backend, device, options):
    if backend.platform != "toyope":
        return None
    return json.loads((package.data_dir / "op.json").read_text())["op"]

@hookimpl
def infer(model, inputs, requested_outputs):
    if model == "add":
        out = {"out": inputs["x"] + inputs["y"]}
    elif model == "upper":
        out = {"out": np.char.upper(inputs["x"].astype(str))}
    elif model == "raise":
        raise RuntimeError("toy framework exploded")
    elif model == "segfault":
        ctypes.string_at(0)
    elif model == "sleep":
        time.sleep(30)
    elif model == "sum100":
        out = {"out": sum(inputs[f"in{i}"] for i in range(100))}
    return {k: v for k, v in out.items() if requested_outputs is None or k in requested_outputs}
'''


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Install the toy backend as a distribution on PYTHONPATH, for this process and its workers."""
    site = tmp_path / "site"
    info = site / "neuropod_toyope-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: neuropod-toyope\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[neuropod.backends]\ntoyope = np_toyope\n")
    (site / "np_toyope.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("NEUROPOD_PLUGINS", "toyope")
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    plugins.reset()
    yield tmp_path
    plugins.reset()
    sys.modules.pop("np_toyope", None)


def package(tmp_path: Path, op: str, inputs: list[dict], outputs: list[dict], name: str | None = None) -> Path:  # type: ignore[type-arg]
    config = parse_config(
        {"name": name or op, "platform": "toyope", "input_spec": inputs, "output_spec": outputs}, "toy config"
    )
    return write_package(tmp_path / f"{name or op}.neuropod", config, {"0/data/op.json": json.dumps({"op": op}).encode()})


XY = [{"name": "x", "dtype": "float32", "shape": ["batch", 2]}, {"name": "y", "dtype": "float32", "shape": ["batch", 2]}]
OUT = [{"name": "out", "dtype": "float32", "shape": ["batch", 2]}]


def adder(tmp_path: Path, **kwargs):  # type: ignore[no-untyped-def]
    path = tmp_path / "add.neuropod"
    if not path.exists():
        package(tmp_path, "add", XY, OUT)
    return neuropod.load_neuropod(path, use_ope=True, **kwargs)


def xy(batch: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((batch, 2)).astype(np.float32) for n in ("x", "y")}


def _gone(pid: int, within: float = 5.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie child still answers kill(pid, 0): reap it
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


def test_infer_in_a_worker_with_the_same_checks(toy: Path) -> None:
    with adder(toy) as model:
        assert model.worker_pids and model.worker_pids[0] != os.getpid()
        inputs = xy(3)
        out = model.infer(inputs)["out"]
        np.testing.assert_allclose(out, inputs["x"] + inputs["y"], rtol=1e-6)
        assert not out.flags.owndata, "the output is a view over shared memory, not a copy"
        with pytest.raises(SpecError, match=r"symbol 'batch' = 3 \(from tensor 'x'\), but was 1"):
            model.infer({"x": inputs["x"], "y": np.zeros((1, 2), np.float32)})
        # Non-contiguous and differently sized inputs in the next calls.
        big = np.arange(16, dtype=np.float32).reshape(4, 4)
        np.testing.assert_array_equal(model.infer({"x": big[:, ::2], "y": big[:, 1::2]})["out"], big[:, ::2] + big[:, 1::2])
        pid = model.worker_pids[0]
    assert _gone(pid), "closing the model ends its worker"


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
        with pytest.raises(WorkerError, match="has stopped; load the model again or pass restart=True"):
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
