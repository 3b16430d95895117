"""Decoupled models (many responses a request) in this process and in worker processes, with a
small streaming backend installed as a real distribution (no framework needed): its models are
generators chosen by the package's ``0/data/op.json``."""

from __future__ import annotations

import asyncio
import gc
import json
import os
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
from neuropod import plugins
from neuropod.errors import BackendError, NeuropodError, PackageError, SpecError
from neuropod.package import parse_config, write_package
from neuropod.testdata import run_test_data
from neuropod.testing import run_in_threads

from _ope_toy import TOY, gone

STREAM_TOY = '''
"""A streaming toy backend: each model is a generator over the input x (int32 [n])."""
import json, os, time
import numpy as np
from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps

@hookimpl
def supported_versions():
    return [Backend("toystream", "1.0.0", "toystream-framework")]

@hookimpl
def device_caps(backend):
    return DeviceCaps() if backend.platform == "toystream" else None

@hookimpl
def load_model(package, backend, device, options):
    if backend.platform != "toystream":
        return None
    op = json.loads((package.data_dir / "op.json").read_text())["op"]
    return {"op": op, "log": str(package.root.parent / "log")}

def _log(model, line):
    with open(model["log"], "a") as f:
        f.write(f"{line}\\n")

@hookimpl
def infer(model, inputs, requested_outputs):
    raise RuntimeError("a decoupled model is never run with infer")

@hookimpl
def infer_stream(model, inputs, requested_outputs, parameters=None):
    op, x = model["op"], inputs["x"]
    delay = float(inputs["delay"][0]) if "delay" in inputs else 0.0
    scale = int((parameters or {}).get("scale", 1))
    try:
        for i, v in enumerate(x.tolist()):
            if op == "raise" and i == int(x[0]):
                raise RuntimeError("toy stream exploded")
            if i:
                time.sleep(delay)
            _log(model, f"produced {i}")
            if op == "bad" and i == int(x[0]):
                yield {"out": np.array([v], np.float64), "idx": np.array([i], np.uint32)}
            elif op == "partial":
                yield {"out": np.array([v], np.int32)} if i % 2 == 0 else {"idx": np.array([i], np.uint32)}
            else:
                yield {"out": np.array([v * scale], np.int32), "idx": np.array([i], np.uint32)}
    finally:
        _log(model, "finally")
'''

X = [{"name": "x", "dtype": "int32", "shape": ["n"]}, {"name": "delay", "dtype": "float32", "shape": [1]}]
OUT = [{"name": "out", "dtype": "int32", "shape": [1]}, {"name": "idx", "dtype": "uint32", "shape": [1]}]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="worker processes need Linux")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The streaming toy backend and the OPE toy backend (no infer_stream), installed for this
    process and its workers."""
    site = tmp_path / "site"
    for name, module, source in (("toystream", "np_toystream", STREAM_TOY), ("toyope", "np_toyope", TOY)):
        info = site / f"neuropod_{name}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: neuropod-{name}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[neuropod.backends]\n{name} = {module}\n")
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("NEUROPOD_PLUGINS", "toystream,toyope")
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    plugins.reset()
    threads = set(threading.enumerate())
    yield tmp_path
    plugins.reset()
    for module in ("np_toystream", "np_toyope"):
        sys.modules.pop(module, None)
    gc.collect()
    assert set(threading.enumerate()) <= threads, "no thread left behind"


def make(tmp: Path, op: str, platform: str = "toystream", decoupled: bool = True, **extra: Any) -> Path:
    """A package of the toy ``op`` in its own directory (its generators log to ``<dir>/log``)."""
    root = tmp / op / f"{op}.neuropod"
    root.parent.mkdir(parents=True, exist_ok=True)
    config = parse_config(
        {"name": op, "platform": platform, "input_spec": X, "output_spec": OUT, "decoupled": decoupled}, "toy config"
    )
    return write_package(root, config, {"0/data/op.json": json.dumps({"op": op}).encode()}, **extra)


def log(package: Path) -> list[str]:
    path = package.parent / "log"
    return path.read_text().splitlines() if path.exists() else []


def wait_for(predicate: Any, within: float = 1.0) -> bool:
    end = time.monotonic() + within
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def inputs(values: list[int], delay: float = 0.0) -> dict[str, np.ndarray]:
    return {"x": np.array(values, np.int32), "delay": np.array([delay], np.float32)}


def expected(values: list[int], scale: int = 1) -> list[dict[str, list[int]]]:
    return [{"out": [v * scale], "idx": [i]} for i, v in enumerate(values)]


def plain(responses: Any) -> list[dict[str, list[int]]]:
    return [{k: v.tolist() for k, v in r.items()} for r in responses]


@pytest.fixture(params=[False, True], ids=["in-process", "worker"])
def use_ope(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def test_responses_come_in_order_one_at_a_time(site: Path, use_ope: bool) -> None:
    path = make(site, "repeat")
    with neuropod.load_neuropod(path, use_ope=use_ope) as model:
        assert model.decoupled
        values = [5, -3, 7, 11]
        stream = model.infer_stream(inputs(values, delay=0.02))
        first = next(stream)
        assert plain([first]) == expected(values)[:1]
        # Pulled one at a time: the generator has made only the response handed out.
        assert log(path) == ["produced 0"], "the first response arrives before the next is produced"
        rest = list(stream)
        assert plain([first, *rest]) == expected(values)
        assert stream.done and stream.responses == len(values)
        assert log(path)[-1] == "finally"
        # Subsets of the outputs, and request parameters reaching the generator.
        assert plain(model.infer_stream(inputs([2, 4]), ["idx"])) == [{"idx": [0]}, {"idx": [1]}]
        assert plain(model.infer_stream(inputs([2, 4]), parameters={"scale": 3})) == expected([2, 4], 3)
        assert plain(model.infer_stream(inputs([]))) == [], "zero responses is a stream too"
        with pytest.raises(NeuropodError, match=r"Model 'repeat' is decoupled.*infer_stream"):
            model.infer(inputs([1]))
        with pytest.raises(SpecError, match="'x'"):
            model.infer_stream({"x": np.zeros(2, np.float32), "delay": np.zeros(1, np.float32)})


def test_a_response_may_hold_some_outputs(site: Path, use_ope: bool) -> None:
    with neuropod.load_neuropod(make(site, "partial"), use_ope=use_ope) as model:
        got = plain(model.infer_stream(inputs([4, 5, 6])))
        assert got == [{"out": [4]}, {"idx": [1]}, {"out": [6]}]
        assert plain(model.infer_stream(inputs([4, 5, 6]), ["idx"])) == [{}, {"idx": [1]}, {}]


def test_an_error_after_k_responses_comes_after_them(site: Path, use_ope: bool) -> None:
    with neuropod.load_neuropod(make(site, "raise"), use_ope=use_ope) as model:
        stream = model.infer_stream(inputs([2, 8, 9, 10]))
        got = [next(stream), next(stream)]
        assert plain(got) == expected([2, 8])
        with pytest.raises(BackendError, match=r"(?s)model 'raise'.*toy stream exploded"):
            next(stream)
        assert stream.done and list(stream) == []
        # The model (and its worker) carries on.
        assert plain(model.infer_stream(inputs([9]))) == expected([9])


def test_a_response_off_the_spec_ends_the_stream_with_a_spec_error(site: Path, use_ope: bool) -> None:
    path = make(site, "bad")
    with neuropod.load_neuropod(path, use_ope=use_ope) as model:
        stream = model.infer_stream(inputs([1, 5, 6]))
        assert plain([next(stream)]) == expected([1])
        with pytest.raises(SpecError, match=r"'out'.*int32.*float64|'out'.*float64.*int32"):
            next(stream)
        assert stream.done
        assert wait_for(lambda: log(path)[-1:] == ["finally"]), "the generator was closed"
        assert plain(model.infer_stream(inputs([9]))) == expected([9])


def test_close_runs_the_generators_finally(site: Path, use_ope: bool) -> None:
    path = make(site, "repeat")
    with neuropod.load_neuropod(path, use_ope=use_ope) as model:
        with model.infer_stream(inputs([1, 2, 3])) as stream:
            assert plain([next(stream)]) == expected([1])
        assert stream.done
        assert wait_for(lambda: log(path) == ["produced 0", "finally"])
        stream.close()  # again: nothing more
        assert plain(model.infer_stream(inputs([3]))) == expected([3])


def test_an_ordinary_model_streams_its_one_answer(site: Path, use_ope: bool) -> None:
    path = make(site, "add", platform="toyope", decoupled=False)
    spec = [
        {"name": "x", "dtype": "float32", "shape": ["batch", 2]},
        {"name": "y", "dtype": "float32", "shape": ["batch", 2]},
    ]
    config = parse_config({"name": "add", "platform": "toyope", "input_spec": spec,
                           "output_spec": [{"name": "out", "dtype": "float32", "shape": ["batch", 2]}]}, "toy")  # fmt: skip
    path = write_package(path.parent / "add2.neuropod", config, {"0/data/op.json": b'{"op": "add"}'})
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    with neuropod.load_neuropod(path, use_ope=use_ope) as model:
        assert not model.decoupled
        (only,) = list(model.infer_stream({"x": x, "y": x}))
        np.testing.assert_array_equal(only["out"], x + x)


def test_a_decoupled_package_needs_a_backend_that_streams(site: Path, use_ope: bool) -> None:
    path = make(site, "add", platform="toyope")
    with pytest.raises(NeuropodError, match=r"Model 'add' is decoupled.*plugin 'toyope' has no infer_stream hook"):
        neuropod.load_neuropod(path, use_ope=use_ope)


def test_decoupled_must_be_true_or_false(site: Path) -> None:
    with pytest.raises(PackageError, match=r"'decoupled' must be true or false, not 'yes'"):
        parse_config(
            {"name": "m", "platform": "toystream", "input_spec": X, "output_spec": OUT, "decoupled": "yes"}, "c"
        )


def test_test_data_of_a_decoupled_package_are_its_joined_responses(site: Path) -> None:
    values = [3, 1, 4]
    path = make(site, "repeat", test_input_data=inputs(values),
                test_expected_out={"out": np.array(values, np.int32), "idx": np.arange(3, dtype=np.uint32)})  # fmt: skip
    report = run_test_data(path)
    assert report.passed, report


# -- in worker processes ---------------------------------------------------------------------------


def test_a_stream_holds_its_worker_and_gives_it_back(site: Path) -> None:
    path = make(site, "repeat")
    with neuropod.load_neuropod(path, use_ope=True) as model:
        (pid,) = model.worker_pids
        stream = model.infer_stream(inputs([1, 2, 3]))
        other = model.infer_stream(inputs([7]))  # opening waits for nothing: the worker is taken at the first next
        assert plain([next(stream)]) == expected([1])
        with pytest.raises(NeuropodError, match=r"Every worker of model 'repeat' \(1\) is held by a stream"):
            next(other)  # this thread would wait for itself for ever
        assert other.done
        # Another thread waits for the worker until the stream ends.
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.extend(plain(model.infer_stream(inputs([7])))))
        reader.start()
        time.sleep(0.05)
        assert not got
        assert plain(stream) == expected([1, 2, 3])[1:]
        reader.join(5)
        assert got == expected([7])
        assert model.worker_pids == [pid], "the same worker throughout"


def test_streams_from_several_threads_share_the_workers(site: Path) -> None:
    with neuropod.load_neuropod(make(site, "repeat"), use_ope=True, workers=2) as model:

        def work(n: int) -> None:
            for r in range(5):
                values = [n * 100 + r * 10 + i for i in range(n + 1)]
                assert plain(model.infer_stream(inputs(values))) == expected(values)

        run_in_threads(work, 4)


def test_a_stream_dropped_unread_gives_its_worker_back(site: Path) -> None:
    path = make(site, "repeat")
    with neuropod.load_neuropod(path, use_ope=True) as model:
        stream = model.infer_stream(inputs([1, 2, 3]))
        next(stream)
        del stream
        gc.collect()
        assert wait_for(lambda: log(path)[-1:] == ["finally"]), "the worker closed the generator"
        assert plain(model.infer_stream(inputs([5, 6]))) == expected([5, 6])
        model.infer_stream(inputs([1, 2]))  # never read: holds nothing


def test_a_worker_that_dies_mid_stream(site: Path) -> None:
    path = make(site, "repeat")
    with neuropod.load_neuropod(path, use_ope=True, restart=True) as model:
        (pid,) = model.worker_pids
        stream = model.infer_stream(inputs([1, 2, 3]))
        next(stream)
        os.kill(pid, 9)
        with pytest.raises(neuropod.errors.WorkerError, match=r"worker for model 'repeat' .*died.*restarted"):
            next(stream)
        assert stream.done
        assert plain(model.infer_stream(inputs([4]))) == expected([4]), "restarted"
        assert model.worker_pids != [pid]
        new = model.worker_pids[0]
    assert gone(pid) and gone(new)


def test_closing_the_model_ends_an_open_stream(site: Path) -> None:
    path = make(site, "repeat")
    model = neuropod.load_neuropod(path, use_ope=True)
    (pid,) = model.worker_pids
    stream = model.infer_stream(inputs([1, 2, 3]))
    next(stream)
    # Another thread waits for the worker the stream holds; closing the model answers it too.
    errors: list[BaseException] = []

    def wait_for_the_worker() -> None:
        try:
            model.infer_stream(inputs([4])).__next__()
        except BaseException as e:  # noqa: BLE001 - kept for the assertion below
            errors.append(e)

    waiting = threading.Thread(target=wait_for_the_worker)
    waiting.start()
    time.sleep(0.05)
    model.close()
    waiting.join(5)
    assert not waiting.is_alive() and len(errors) == 1
    assert isinstance(errors[0], NeuropodError) and "is closed" in str(errors[0])
    with pytest.raises(neuropod.errors.WorkerError, match="closed"):
        next(stream)
    stream.close()
    assert gone(pid)


def test_ainfer_stream_for_asyncio(site: Path, use_ope: bool) -> None:
    path = make(site, "repeat")

    async def main(model: neuropod.NeuropodModel) -> None:
        got = [r async for r in model.ainfer_stream(inputs([3, 4]), ["out"])]
        assert plain(got) == [{"out": [3]}, {"out": [4]}]
        async with model.ainfer_stream(inputs([5, 6, 7])) as stream:
            assert plain([await stream.__anext__()]) == expected([5])
        assert stream.stream.done
        # A task cancelled while it waits for a response: the generator is closed after it.
        slow = model.ainfer_stream(inputs([1, 2, 3], delay=0.2))
        assert plain([await slow.__anext__()]) == expected([1])
        task = asyncio.ensure_future(slow.__anext__())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(wait_for, lambda: log(path)[-1:] == ["finally"], 2.0)
        assert plain(model.infer_stream(inputs([8]))) == expected([8])

    with neuropod.load_neuropod(path, use_ope=use_ope) as model:
        asyncio.run(main(model))
    assert log(path).count("finally") == 4
