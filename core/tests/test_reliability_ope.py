"""Issue 11, out-of-process execution: a restart serves the model first loaded or none (item 3),
workers live as long as their process, not their thread (5), timeouts hold (6), strings cross
as bytes (7, 19), a call's tensors share a block and limits are named (8), dropped models stop
their workers (9), a model does not cross fork() (10) and empty()/start_pool() check their
arguments (15).

Each test fails on the code before the fix, except where a docstring says it guards
behaviour that already held.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
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
from neuropod.errors import NeuropodError, PackageError, WorkerError
from neuropod.ope import start_pool

from _ope_toy import OUT, STRING_OUT, STRINGS, XY, adder, gone, install_toy, package, xy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OPE needs Linux")


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    yield from install_toy(tmp_path, monkeypatch)


def _run(script: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a script in a fresh interpreter with this test's environment (the toy backend on PYTHONPATH)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=os.environ, timeout=timeout
    )


def _kill_worker(model: Any) -> None:
    pid = model.worker_pids[0]
    os.kill(pid, signal.SIGKILL)
    assert gone(pid)
    with pytest.raises(WorkerError, match="died"):
        model.infer(xy())


# --- item 3: a restart re-verifies the package ---------------------------------------------


def _legacy_package(root: Path, op: str) -> Path:
    """An original-0.3-style directory package: config.json and the model, no manifest."""
    (root / "0" / "data").mkdir(parents=True)
    (root / "config.json").write_text(
        json.dumps({"name": "legacy_add", "platform": "toyope", "input_spec": XY, "output_spec": OUT})
    )
    (root / "0" / "data" / "op.json").write_text(json.dumps({"op": op}))
    return root


@pytest.mark.parametrize("kind", ["manifest", "manifest rewritten too", "no manifest (0.3)"])
def test_restart_refuses_a_package_changed_on_disk(toy: Path, kind: str) -> None:
    if kind.startswith("manifest"):
        path = package(toy, "add", XY, OUT)
    else:
        path = _legacy_package(toy / "legacy.neuropod", "add")
    with neuropod.load_neuropod(path, use_ope=True, restart=True) as model:
        inputs = xy()
        np.testing.assert_allclose(model.infer(inputs)["out"], inputs["x"] + inputs["y"], rtol=1e-6)
        _kill_worker(model)
        # A deploy writes another model over the package while the worker is down.
        (path / "0" / "data" / "op.json").write_text(json.dumps({"op": "sub"}))
        if kind == "manifest rewritten too":
            manifest = json.loads((path / "manifest.json").read_text())
            from neuropod.package import make_manifest

            manifest["files"] = make_manifest(path)["files"]
            (path / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(PackageError, match=r"Cannot restart the worker for model .*changed: 0/data/op\.json"):
            model.infer(inputs)
        assert model.worker_pids == [], "no worker serves the changed files"
        # Restored files: the restart goes ahead and serves the model that was loaded.
        (path / "0" / "data" / "op.json").write_text(json.dumps({"op": "add"}))
        if kind != "manifest rewritten too":
            np.testing.assert_allclose(model.infer(inputs)["out"], inputs["x"] + inputs["y"], rtol=1e-6)


def test_restart_refuses_an_added_file(toy: Path) -> None:
    path = _legacy_package(toy / "legacy.neuropod", "add")
    with neuropod.load_neuropod(path, use_ope=True, restart=True) as model:
        _kill_worker(model)
        (path / "0" / "data" / "extra.bin").write_bytes(b"x")
        with pytest.raises(PackageError, match="added: 0/data/extra.bin"):
            model.infer(xy())


# --- item 5: a worker outlives the thread that loaded its model ----------------------------


def test_worker_outlives_the_thread_that_loaded_it(toy: Path) -> None:
    package(toy, "add", XY, OUT)
    loaded: list[Any] = []
    thread = threading.Thread(target=lambda: loaded.append(adder(toy)))
    thread.start()
    thread.join()
    model = loaded[0]
    try:
        pid = model.worker_pids[0]
        time.sleep(0.3)  # PR_SET_PDEATHSIG killed the worker as the thread ended
        assert not gone(pid, within=0.1), "the worker died with the thread that started it"
        inputs = xy()
        np.testing.assert_allclose(model.infer(inputs)["out"], inputs["x"] + inputs["y"], rtol=1e-6)
    finally:
        model.close()


def test_worker_dies_with_its_process_when_loaded_from_a_thread(toy: Path) -> None:
    """Guards what held before: a killed parent takes its workers along, even from a thread, even mid-call."""
    path = package(toy, "sleep", [{"name": "x", "dtype": "float32", "shape": [None]}], OUT[:1])
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import threading, numpy as np, neuropod
            box = []
            t = threading.Thread(target=lambda: box.append(neuropod.load_neuropod({str(path)!r}, use_ope=True)))
            t.start(); t.join()
            print(box[0].worker_pids[0], flush=True)
            box[0].infer({{"x": np.ones(2, np.float32)}})  # sleeps in the worker
        """)],
        stdout=subprocess.PIPE, text=True, env=os.environ,
    )  # fmt: skip
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    assert gone(pid), "the worker outlived its killed parent"


# --- item 6: timeouts ------------------------------------------------------------------


SLEEP_IF = [{"name": "x", "dtype": "float32", "shape": [None]}]


@pytest.mark.parametrize("restart", [False, True])
def test_timeout_is_honoured_and_the_worker_replaced_or_refused(toy: Path, restart: bool) -> None:
    path = package(toy, "sleep_if", SLEEP_IF, [{"name": "out", "dtype": "float32", "shape": [None]}])
    with neuropod.load_neuropod(path, use_ope=True, timeout=0.5, restart=restart) as model:
        pid = model.worker_pids[0]
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            model.infer({"x": np.ones(2, np.float32)})
        took = time.monotonic() - start
        assert took < 1.5, f"a 0.5 s timeout returned after {took:.1f} s"
        assert "did not answer within 0.5 s (killed)" in str(info.value)
        assert gone(pid, within=0.5), "the stuck worker was killed"
        quick = {"x": np.zeros(2, np.float32)}
        if restart:
            np.testing.assert_array_equal(model.infer(quick)["out"], quick["x"])
            assert model.worker_pids and model.worker_pids[0] != pid
        else:
            with pytest.raises(WorkerError, match=r"has stopped: it did not answer within 0\.5 s"):
                model.infer(quick)


# --- items 7 and 19: strings ------------------------------------------------------------------


def test_strings_cross_as_the_same_kind_of_array_byte_for_byte(toy: Path) -> None:
    path = package(toy, "echo", STRINGS, STRING_OUT)
    texts = ["a\x00", "\x00", "a\x00b", "", "\u00e9t\u00e9 \U0001f600", "\ud800 lone surrogate", "x" * 1000]
    given = [
        np.array(texts, dtype=object),
        np.array(["abc", "a\x00b", "", "\u00e9"]),  # unicode arrays can hold an inner NUL, never a trailing one
        np.array([], dtype=object),
        np.array(["one"]),
    ]
    with neuropod.load_neuropod(path) as local, neuropod.load_neuropod(path, use_ope=True) as remote:
        for arr in given:
            want = local.infer({"x": arr})["out"]
            got = remote.infer({"x": arr})["out"]
            assert got.dtype.kind == want.dtype.kind == arr.dtype.kind
            assert got.tolist() == want.tolist() == arr.tolist()


def test_strings_made_in_the_worker_keep_their_nuls(toy: Path) -> None:
    path = package(toy, "nul_strings", STRINGS, STRING_OUT)
    expected = ["a\x00", "\x00", "b\x00c", "", "\u00e9\x00"]
    with neuropod.load_neuropod(path, use_ope=True) as model:
        out = model.infer({"x": np.array(["unused"])})["out"]
        assert out.dtype == object
        assert out.tolist() == expected


def test_one_long_string_does_not_pad_the_others(toy: Path) -> None:
    path = package(toy, "echo", STRINGS, STRING_OUT)
    result = _run(f"""
        import os, resource, numpy as np, neuropod
        def peak(pid):  # kB
            with open(f"/proc/{{pid}}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
        m = neuropod.load_neuropod({str(path)!r}, use_ope=True)
        worker = m.worker_pids[0]
        m.infer({{"x": np.array(["warm", "up"], dtype=object)}})
        before = peak(os.getpid()), peak(worker)
        texts = ["s%d" % i for i in range(500)] + ["L" * 100_000]
        out = m.infer({{"x": np.array(texts, dtype=object)}})["out"]
        assert out.tolist() == texts
        after = peak(os.getpid()), peak(worker)
        print((after[0] - before[0]) // 1024, (after[1] - before[1]) // 1024)
    """)
    assert result.returncode == 0, result.stderr
    client_mb, worker_mb = map(int, result.stdout.split())
    # Padded to the longest, 501 strings of 100,000 characters are 200 MB of UCS-4 on each side.
    assert client_mb < 20 and worker_mb < 20, f"peak memory grew by {client_mb} MB (client), {worker_mb} MB (worker)"


# --- item 8: descriptors and limits ----------------------------------------------------------


def test_hundreds_of_tensors_under_a_low_open_file_limit(toy: Path) -> None:
    many = package(toy, "sum", [{"name": f"in{i}", "dtype": "float32", "shape": [3]} for i in range(400)],
                   [{"name": "out", "dtype": "float32", "shape": [3]}], name="many_in")  # fmt: skip
    fan = package(toy, "fanout", [{"name": "x", "dtype": "float32", "shape": [1]}],
                  [{"name": f"out{i}", "dtype": "float32", "shape": [1]} for i in range(300)])  # fmt: skip
    result = _run(f"""
        import resource, numpy as np, neuropod
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))  # the workers inherit it too
        with neuropod.load_neuropod({str(many)!r}, use_ope=True) as m:
            inputs = {{f"in{{i}}": np.full(3, i, np.float32) for i in range(400)}}
            for _ in range(3):
                assert m.infer(inputs)["out"].tolist() == [sum(range(400))] * 3
        with neuropod.load_neuropod({str(fan)!r}, use_ope=True) as m:
            kept = [m.infer({{"x": np.array([300], np.float32)}}) for _ in range(3)]
            assert all(out[f"out{{i}}"].tolist() == [300 + i] for out in kept for i in range(300))
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_a_system_limit_is_named(toy: Path) -> None:
    path = package(toy, "add", XY, OUT)
    result = _run(f"""
        import resource, neuropod
        from neuropod.errors import NeuropodError
        m = neuropod.load_neuropod({str(path)!r}, use_ope=True)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        kept = []
        try:
            for _ in range(200):
                kept.append(m.empty("x", (2, 2)))
        except NeuropodError as e:
            print(type(e).__name__, e)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("WorkerError"), result.stdout + result.stderr[-3000:]
    assert "RLIMIT_NOFILE" in result.stdout and "ulimit -n" in result.stdout and "64" in result.stdout


def test_empty_arrays_dropped_by_the_caller_are_released_in_the_worker(toy: Path) -> None:
    with adder(toy) as model:
        worker = model.worker_pids[0]
        fds = len(os.listdir(f"/proc/{worker}/fd"))
        for i in range(50):
            x = model.empty("x", (2, 2))
            y = model.empty("y", (2, 2))
            x[...] = i
            y[...] = 1
            np.testing.assert_array_equal(model.infer({"x": x, "y": y})["out"], np.full((2, 2), i + 1))
            del x, y
        maps = Path(f"/proc/{worker}/maps").read_text().count("/memfd:neuropod-")
        assert maps <= 6, f"the worker still maps {maps} blocks of arrays the caller dropped"
        assert len(os.listdir(f"/proc/{worker}/fd")) <= fds + 2


# --- item 9: dropped models, failed restarts -------------------------------------------------


def test_a_dropped_model_stops_its_worker(toy: Path) -> None:
    model = adder(toy)
    pid = model.worker_pids[0]
    del model
    gc.collect()
    assert gone(pid), "a model dropped without close() left its worker running"


def test_workers_stop_at_interpreter_exit(toy: Path) -> None:
    """Guards what held before (then through PR_SET_PDEATHSIG): a model never closed ends with its process."""
    path = package(toy, "add", XY, OUT)
    result = _run(f"""
        import neuropod
        m = neuropod.load_neuropod({str(path)!r}, use_ope=True)
        print(m.worker_pids[0])
    """)
    assert result.returncode == 0, result.stderr
    assert gone(int(result.stdout))


def test_a_failed_restart_leaves_nothing_half_built(toy: Path) -> None:
    path = package(toy, "flaky", XY, OUT)
    with neuropod.load_neuropod(path, use_ope=True, restart=True) as model:
        _kill_worker(model)
        (toy / "fail-load").touch()
        for _ in range(2):  # each call tries again, and says why it failed
            with pytest.raises(NeuropodError, match="toy framework cannot load today") as info:
                model.infer(xy())
            assert "NoneType" not in str(info.value)
            assert model.worker_pids == []
        (toy / "fail-load").unlink()
        inputs = xy()
        np.testing.assert_allclose(model.infer(inputs)["out"], inputs["x"] + inputs["y"], rtol=1e-6)


# --- item 10: fork ----------------------------------------------------------------------


def test_a_forked_child_is_told_and_leaves_the_parents_worker_alone(toy: Path) -> None:
    path = package(toy, "add", XY, OUT)
    result = _run(f"""
        import os, sys, numpy as np, neuropod
        from neuropod.errors import WorkerError
        m = neuropod.load_neuropod({str(path)!r}, use_ope=True)
        x = {{"x": np.ones((2, 2), np.float32), "y": np.ones((2, 2), np.float32)}}
        m.infer(x)
        pid = os.fork()
        if pid == 0:
            try:
                m.infer(x)
                print("child: no error", flush=True)
            except WorkerError as e:
                print("child:", e, flush=True)
            sys.exit(0)  # a normal exit: finalizers run in the child
        os.waitpid(pid, 0)
        assert m.infer(x)["out"].tolist() == [[2, 2], [2, 2]]
        m.close()
        print("parent: ok", flush=True)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    child, parent = result.stdout.strip().splitlines()
    assert "cannot cross fork()" in child and "Load the model again in the child" in child, child
    assert parent == "parent: ok"


# --- item 15: argument checks ----------------------------------------------------------------


EMPTY_CASES = [
    ((-1, 2), None, ValueError, r"shape\[0\] is -1"),
    ((1.5, 2), None, TypeError, r"shape\[0\] is float 1\.5"),
    (("3", 2), None, TypeError, r"shape\[0\] is str '3'"),
    ((True, 2), None, TypeError, r"shape\[0\] is True"),
    ("32", None, TypeError, "shape must be a tuple of ints"),
    ((2**62, 2), None, ValueError, "more than this machine's memory"),
    ((2**40, 2**40), None, ValueError, "more than this machine's memory"),
    ((2, 2), "notadtype", TypeError, "dtype 'notadtype' is not a numpy dtype"),
    ((2, 2), "complex64", ValueError, "dtype must be float32"),
    ((2, 2), np.float64, ValueError, "dtype must be float32"),
]


def test_empty_checks_its_arguments_before_allocating(toy: Path) -> None:
    with adder(toy) as model:
        fds = len(os.listdir("/proc/self/fd"))
        for shape, dtype, error, match in EMPTY_CASES:
            with pytest.raises(error, match=match):
                model.empty("x", shape, dtype)
            assert len(os.listdir("/proc/self/fd")) == fds, f"empty({shape!r}, {dtype!r}) allocated before failing"
        assert model.empty("x", 3).shape == (3,)  # an int is a 1-d shape, as for numpy


def test_empty_for_a_string_input(toy: Path) -> None:
    with neuropod.load_neuropod(package(toy, "echo", STRINGS, STRING_OUT), use_ope=True) as model:
        with pytest.raises(ValueError, match="string tensor; give a dtype such as '<U16'"):
            model.empty("x", (2,))
        x = model.empty("x", (2,), "<U5")
        x[...] = ["ab", "cd\x00e"]
        assert model.infer({"x": x})["out"].tolist() == ["ab", "cd\x00e"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"workers": True}, TypeError, "workers must be an int"),
        ({"workers": 1.5}, TypeError, "workers must be an int"),
        ({"workers": "2"}, TypeError, "workers must be an int"),
        ({"workers": 0}, ValueError, "workers must be at least 1"),
        ({"timeout": float("nan")}, ValueError, "timeout must be a positive, finite number"),
        ({"timeout": float("inf")}, ValueError, "timeout must be a positive, finite number"),
        ({"timeout": -1}, ValueError, "timeout must be a positive, finite number"),
        ({"timeout": "1"}, TypeError, "timeout must be a number of seconds"),
        ({"restart": "yes"}, TypeError, "restart must be True or False"),
    ],
)
def test_start_pool_checks_its_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    # Checked before anything starts: the interpreter named here does not exist.
    with pytest.raises(error, match=match):
        start_pool("m", "/nonexistent/python", "/nonexistent", "toyope==1.0.0", "cpu", {}, **kwargs)


def test_a_call_keeps_working_while_its_outputs_are_held(toy: Path) -> None:
    """Guards what held before: outputs kept (or views of them) are never overwritten by later calls."""
    with adder(toy) as model:
        kept = []
        for seed in range(20):
            inputs = xy(seed=seed)
            kept.append((model.infer(inputs)["out"][1:], (inputs["x"] + inputs["y"])[1:]))
        for view, want in kept:
            np.testing.assert_allclose(view, want, rtol=1e-6)


def test_empty_arrays_dropped_between_repeated_calls(toy: Path) -> None:
    """The worker forgets a dropped empty() block even on the call that reuses last call's layout."""
    with adder(toy) as model:
        for i in range(5):
            x = model.empty("x", (2, 2))
            x[...] = i
            y = np.ones((2, 2), np.float32)
            model.infer({"x": x, "y": y})
            plain = {"x": np.full((2, 2), i, np.float32), "y": y}
            model.infer(plain)
            del x
            np.testing.assert_array_equal(model.infer(plain)["out"], np.full((2, 2), i + 1))
