"""Pipelines of real python-backend steps: packaging with test data, values against numpy, levels
run side by side, failing steps, max_inflight_requests, decoupled and stateful steps, steps in
workers and on other interpreters, zip packages, nested pipelines, plans, load options, cleanup."""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import neuropod
from neuropod.create import create_package
from neuropod.errors import NeuropodError, NoBackendError, PackageError, PipelineStepError, SequenceError, SpecError
from neuropod.packagers import create_pipeline_neuropod, create_python_neuropod
from neuropod.pipelines import PipelineModel, PipelinePlan

from conftest import write_code

OPS = """
import threading, time
import numpy as np

def scale(_):
    return lambda x: {"y": (x * 2).astype(np.float32)}

def shift(_):
    return lambda a: {"b": (a + 1).astype(np.float32)}

def total(_):
    return lambda p, q: {"s": (p + q).astype(np.float32)}

def identity(_):
    return lambda x: {"y": x}

def sleepy(_):
    def run(x):
        time.sleep(0.2)
        return {"y": x}
    return run

def fragile(_):
    def run(x):
        if x.size and x.flat[0] < 0:
            raise ValueError("a negative first element")
        if x.size and x.flat[0] == 7:
            return {"y": x.astype(np.float64)}  # the wrong dtype: the step's output check refuses it
        return {"y": x}
    return run

def counting(_):
    lock = threading.Lock()
    state = {"now": 0, "peak": 0}
    def run(x):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(0.03)
        with lock:
            state["now"] -= 1
            peak = state["peak"]
        return {"y": x, "peak": np.array([peak], np.int64)}
    return run

def repeat(_):
    def run(x, n):
        for i in range(int(n[0])):
            yield {"y": (x + i).astype(np.float32)}
    return run

def accumulate(_):
    def run(x, acc_in):
        y = acc_in + x
        return {"y": y, "acc_out": y.copy()}
    return run
"""


def t(name: str, *shape: Any, dtype: str = "float32") -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": list(shape) or ["batch", 3]}


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_code(tmp_path_factory.mktemp("code"), {"ops.py": OPS})


def step_pkg(code: Path, path: Path, entry: str, ins: list[Any], outs: list[Any], **kw: Any) -> Path:
    made: Path = create_python_neuropod(
        path, entry, [], [{"python_root": code, "dirs_to_package": [""]}], "ops", entry, ins, outs, **kw
    )
    return made


@pytest.fixture(scope="module")
def steps(code: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("steps")
    one = ([t("x")], [t("y")])
    return {
        "scale": step_pkg(code, root / "scale", "scale", *one),
        "shift": step_pkg(code, root / "shift", "shift", [t("a", "n", 3)], [t("b", "n", 3)]),
        "total": step_pkg(code, root / "total", "total", [t("p", "m", 3), t("q", "m", 3)], [t("s", "m", 3)]),
        "identity": step_pkg(code, root / "identity", "identity", *one),
        "sleepy": step_pkg(code, root / "sleepy", "sleepy", *one),
        "fragile": step_pkg(code, root / "fragile", "fragile", *one),
        "counting": step_pkg(code, root / "counting", "counting", [t("x")], [t("y"), t("peak", 1, dtype="int64")]),
    }


def diamond(steps: dict[str, Path]) -> list[dict[str, Any]]:
    """in -> scale (x2) and shift (+1) side by side -> total: out = 3 * in + 1."""
    return [
        {"package": steps["scale"], "input_map": {"x": "in"}, "output_map": {"y": "scaled"}},
        {"package": steps["shift"], "input_map": {"a": "in"}, "output_map": {"b": "shifted"}},
        {"package": steps["total"], "input_map": {"p": "scaled", "q": "shifted"}, "output_map": {"s": "out"}},
    ]


IO = {"input_spec": [t("in")], "output_spec": [t("out")]}


def data(rows: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-20, 20, (rows, 3)).astype(np.float32)


@pytest.fixture(scope="module")
def pipe(steps: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    x = data()
    path: Path = create_pipeline_neuropod(
        tmp_path_factory.mktemp("pipe") / "pipe",
        "pipe",
        diamond(steps),
        **IO,
        test_input_data={"in": x},
        test_expected_out={"out": x * 3 + 1},
    )
    return path


def test_packaging_runs_test_data_through_the_pipeline(pipe: Path, steps: dict[str, Path], tmp_path: Path) -> None:
    config = json.loads((pipe / "config.json").read_text())
    assert config["platform"] == "pipeline"
    assert [s["name"] for s in config["pipeline"]["steps"]] == ["scale", "shift", "total"]
    assert (pipe / "0" / "steps" / "total" / "config.json").is_file()
    x = data()
    with pytest.raises(NeuropodError, match="out") as info:
        create_pipeline_neuropod(
            tmp_path / "bad", "bad", diamond(steps), **IO, test_input_data={"in": x}, test_expected_out={"out": x * 3}
        )
    assert "bad" in str(info.value) or "out" in str(info.value)
    assert not (tmp_path / "bad").exists(), "a package whose test data fail is not left behind"


def test_values_against_numpy_and_statistics(pipe: Path) -> None:
    with neuropod.load_neuropod(pipe) as model:
        assert isinstance(model, PipelineModel) and list(model.steps) == ["scale", "shift", "total"]
        assert model.wiring.levels == (("scale", "shift"), ("total",))
        for rows in (1, 2, 5):
            x = data(rows, seed=rows)
            out = model.infer({"in": x})
            assert set(out) == {"out"} and out["out"].dtype == np.float32
            np.testing.assert_array_equal(out["out"], x * 2 + (x + 1))
        stats = model.step_statistics()
        assert {s: v["count"] for s, v in stats.items()} == {"scale": 3, "shift": 3, "total": 3}
        assert all(v["failures"] == 0 and v["ns"] > 0 for v in stats.values())
        with pytest.raises(SpecError, match="in"):
            model.infer({"in": np.zeros((2, 4), np.float32)})  # the pipeline's own spec is checked first
        assert model.step_statistics()["scale"]["count"] == 3


def test_steps_of_one_level_run_side_by_side(steps: dict[str, Path], tmp_path: Path) -> None:
    path = create_pipeline_neuropod(
        tmp_path / "p",
        "side",
        [
            {"package": steps["sleepy"], "name": "left", "input_map": {"x": "in"}, "output_map": {"y": "l"}},
            {"package": steps["sleepy"], "name": "right", "input_map": {"x": "in"}, "output_map": {"y": "r"}},
            {"package": steps["total"], "input_map": {"p": "l", "q": "r"}, "output_map": {"s": "out"}},
        ],
        **IO,
    )
    x = data()
    with neuropod.load_neuropod(path) as model:
        model.infer({"in": x})  # the thread pool starts
        began = time.perf_counter()
        out = model.infer({"in": x})
        took = time.perf_counter() - began
        np.testing.assert_array_equal(out["out"], x + x)
        assert took < 0.35, f"two steps that each sleep 0.2 s took {took:.3f} s together"


@pytest.fixture
def fragile_pipe(steps: dict[str, Path], tmp_path: Path) -> Path:
    path: Path = create_pipeline_neuropod(
        tmp_path / "fp",
        "fp",
        [
            {"package": steps["identity"], "name": "first", "input_map": {"x": "in"}, "output_map": {"y": "t"}},
            {"package": steps["fragile"], "name": "weak", "input_map": {"x": "t"}, "output_map": {"y": "out"}},
        ],
        **IO,
    )
    return path


def test_a_failing_step_names_pipeline_step_and_model(fragile_pipe: Path) -> None:
    with neuropod.load_neuropod(fragile_pipe) as model:
        bad = -np.ones((1, 3), np.float32)
        with pytest.raises(PipelineStepError) as info:
            model.infer({"in": bad})
        e = info.value
        assert (e.pipeline, e.step, e.model) == ("fp", "weak", "fragile")
        assert str(e).startswith("pipeline 'fp', step 'weak' (model 'fragile'): "), str(e)
        assert "a negative first element" in str(e) and e.__cause__ is not None
        x = data()
        np.testing.assert_array_equal(model.infer({"in": x})["out"], x)  # the pipeline carries on
        stats = model.step_statistics()
        assert stats["weak"] == {**stats["weak"], "count": 1, "failures": 1} and stats["first"]["count"] == 2


def test_a_steps_spec_error_keeps_its_class(fragile_pipe: Path) -> None:
    with neuropod.load_neuropod(fragile_pipe) as model:
        with pytest.raises(SpecError) as info:
            model.infer({"in": np.full((1, 3), 7, np.float32)})  # the step answers float64
        assert not isinstance(info.value, PipelineStepError)
        assert str(info.value).startswith("pipeline 'fp', step 'weak' (model 'fragile'): "), str(info.value)
        assert "float" in str(info.value)


def test_max_inflight_requests_bounds_the_calls_inside(steps: dict[str, Path], tmp_path: Path) -> None:
    peaks = {}
    for bound in (2, 0):
        path = create_pipeline_neuropod(
            tmp_path / f"p{bound}",
            "bounded",
            [
                {"package": steps["counting"], "input_map": {"x": "in"}, "output_map": {"y": "out", "peak": "peak"}},
            ],
            input_spec=[t("in")],
            output_spec=[t("out"), t("peak", 1, dtype="int64")],
            max_inflight_requests=bound,
        )
        with neuropod.load_neuropod(path) as model, ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda i: model.infer({"in": data(1, i)}), range(12)))
            assert model.step_statistics()["counting"]["count"] == 12  # calls at once are all counted
        peaks[bound] = max(int(o["peak"][0]) for o in outs)
    assert peaks[2] == 2, peaks
    assert peaks[0] > 2, peaks  # unbounded, more calls are inside at once


def test_a_decoupled_step_streams_through_the_steps_after_it(
    code: Path, steps: dict[str, Path], tmp_path: Path
) -> None:
    repeat = step_pkg(code, tmp_path / "repeat", "repeat", [t("x"), t("n", 1, dtype="int32")], [t("y")], decoupled=True)
    path = create_pipeline_neuropod(
        tmp_path / "p",
        "stream",
        [
            {"package": steps["shift"], "input_map": {"a": "in"}, "output_map": {"b": "before"}},
            {"package": repeat, "input_map": {"x": "before", "n": "n"}, "output_map": {"y": "each"}},
            {"package": steps["scale"], "input_map": {"x": "each"}, "output_map": {"y": "out"}},
        ],
        input_spec=[t("in"), t("n", 1, dtype="int32")],
        output_spec=[t("out"), t("before")],
        max_inflight_requests=1,
    )
    x = data()
    with neuropod.load_neuropod(path) as model:
        assert model.decoupled and model.wiring.decoupled_step == "repeat"
        with pytest.raises(NeuropodError, match="Model 'stream' is decoupled.*infer_stream") as info:
            model.infer({"in": x, "n": np.array([1], np.int32)})
        assert not isinstance(info.value, PipelineStepError)
        responses = list(model.infer_stream({"in": x, "n": np.array([3], np.int32)}))
        assert len(responses) == 3
        for i, r in enumerate(responses):
            np.testing.assert_array_equal(r["out"], (x + 1 + i) * 2)
        # A pipeline output computed before the stream comes in the first response only.
        assert "before" in responses[0] and all("before" not in r for r in responses[1:])
        np.testing.assert_array_equal(responses[0]["before"], x + 1)
        assert model.step_statistics()["scale"]["count"] == 3
        assert model.step_statistics()["repeat"]["count"] == 3
        assert list(model.infer_stream({"in": x, "n": np.array([0], np.int32)})) == []
        # max_inflight_requests=1: an open stream is inside the pipeline; another waits for it to end.
        first = model.infer_stream({"in": x, "n": np.array([2], np.int32)})
        next(first)
        second: list[Any] = []
        other = threading.Thread(
            target=lambda: second.extend(model.infer_stream({"in": x, "n": np.array([1], np.int32)}))
        )
        other.start()
        other.join(0.3)
        assert second == [], "the second stream ran while the first was open"
        first.close()
        other.join(5)
        assert len(second) == 1


def test_a_stateful_step_gives_running_sums(code: Path, steps: dict[str, Path], tmp_path: Path) -> None:
    acc = step_pkg(
        code,
        tmp_path / "acc",
        "accumulate",
        [t("x"), t("acc_in")],
        [t("y"), t("acc_out")],
        state_spec=[{"input_name": "acc_in", "output_name": "acc_out"}],
    )
    path = create_pipeline_neuropod(
        tmp_path / "p",
        "sums",
        [
            {"package": acc, "input_map": {"x": "in"}, "output_map": {"y": "sum"}},
            {"package": steps["scale"], "input_map": {"x": "sum"}, "output_map": {"y": "out"}},
        ],
        **IO,
    )
    xs = [data(1, seed) for seed in range(5)]
    want = np.cumsum(np.stack(xs).astype(np.float64), axis=0).astype(np.float32) * 2
    with neuropod.load_neuropod(path) as model:
        assert model.stateful and model.wiring.stateful_steps == ("accumulate",)
        with pytest.raises(SequenceError, match="stateful steps \\(accumulate\\)"):
            model.infer({"in": xs[0]})
        with model.sequence() as one, model.sequence() as two:
            for x, w in zip(xs, want):
                np.testing.assert_array_equal(one.infer({"in": x})["out"], w)
            np.testing.assert_array_equal(two.infer({"in": xs[0]})["out"], xs[0] * 2)  # its own state
            assert model.live_sequences == 2
        assert model.live_sequences == 0
        out = model.infer({"in": xs[0]}, sequence_id=42, sequence_start=True)
        np.testing.assert_array_equal(out["out"], xs[0] * 2)
        out = model.infer({"in": xs[1]}, sequence_id=42, sequence_end=True)
        np.testing.assert_array_equal(out["out"], (xs[0] + xs[1]) * 2)


@pytest.mark.parametrize("how", ["use_ope", "step_options"])
def test_steps_in_worker_processes_equal_in_process(pipe: Path, how: str) -> None:
    x = data(4, seed=9)
    with neuropod.load_neuropod(pipe) as model:
        here = model.infer({"in": x})["out"]
    options: dict[str, Any] = {"use_ope": True} if how == "use_ope" else {"step_options": {"shift": {"use_ope": True}}}
    with neuropod.load_neuropod(pipe, **options) as model:
        in_workers = {n for n, m in model.steps.items() if getattr(m, "worker_pids", None)}
        assert in_workers == ({"scale", "shift", "total"} if how == "use_ope" else {"shift"}), in_workers
        np.testing.assert_array_equal(model.infer({"in": x})["out"], here)


def test_a_step_pinned_to_another_interpreter(pipe: Path, neuropod_home: Path) -> None:
    from neuropod_python import other_interpreters

    others = [v for v, _ in other_interpreters() if v.startswith("3.12")]
    if not others or sys.version_info[:2] == (3, 12):
        pytest.skip("needs a Python 3.12 beside this one (neuropod backends lists the interpreters)")
    x = data()
    with neuropod.load_neuropod(pipe, step_options={"shift": {"backend": f"python=={others[0]}"}}) as model:
        assert model.steps["shift"].backend.version.startswith("3.12."), model.steps["shift"].backend
        assert model.steps["scale"].backend.version == ".".join(map(str, sys.version_info[:3]))
        np.testing.assert_array_equal(model.infer({"in": x})["out"], x * 3 + 1)


def test_zip_pipelines_and_zip_steps(steps: dict[str, Path], tmp_path: Path) -> None:
    x = data()
    # A step package written as a zip by its packager, and a pipeline written as a zip.
    code = write_code(tmp_path / "code", {"ops.py": OPS})
    step_zip = step_pkg(code, tmp_path / "scale.zip", "scale", [t("x")], [t("y")], package_as_zip=True)
    assert Path(step_zip).is_file()
    parts = diamond(steps)
    parts[0]["package"] = step_zip
    path = create_pipeline_neuropod(
        tmp_path / "pipe.zip",
        "zipped",
        parts,
        **IO,
        package_as_zip=True,
        test_input_data={"in": x},
        test_expected_out={"out": x * 3 + 1},
    )
    assert Path(path).is_file()
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_array_equal(model.infer({"in": x})["out"], x * 3 + 1)


def test_a_pipeline_as_a_step_of_another(pipe: Path, steps: dict[str, Path], tmp_path: Path) -> None:
    path = create_pipeline_neuropod(
        tmp_path / "outer",
        "outer",
        [
            {"package": pipe, "name": "inner", "input_map": {"in": "in"}, "output_map": {"out": "mid"}},
            {"package": steps["scale"], "input_map": {"x": "mid"}, "output_map": {"y": "out"}},
        ],
        **IO,
    )
    x = data()
    with neuropod.load_neuropod(path) as model:
        inner = model.steps["inner"]
        assert isinstance(inner, PipelineModel) and list(inner.steps) == ["scale", "shift", "total"]
        np.testing.assert_array_equal(model.infer({"in": x})["out"], (x * 3 + 1) * 2)
    assert inner._closed, "the outer pipeline closes the inner one"


def test_a_step_nothing_here_runs(steps: dict[str, Path], tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="caffe2"):
        odd = create_package("test", tmp_path / "odd", "odd", "caffe2", [t("x")], [t("y")], {}, {})
    with pytest.warns(UserWarning, match="not checked by loading it.*step 'legacy'"):
        path = create_pipeline_neuropod(
            tmp_path / "p",
            "odd_pipe",
            [
                {"package": steps["identity"], "input_map": {"x": "in"}, "output_map": {"y": "mid"}},
                {"package": odd, "name": "legacy", "input_map": {"x": "mid"}, "output_map": {"y": "out"}},
            ],
            **IO,
        )
    plan = neuropod.plan(path)
    assert isinstance(plan, PipelinePlan) and plan.chosen is None
    assert plan.unresolved() is not None and plan.unresolved().step.name == "legacy"  # type: ignore[union-attr]
    text = plan.explain()
    assert "step 'legacy' (model 'odd'): no backend can run it here" in text, text
    assert "caffe2" in text and "step 'identity' (model 'identity'): python==" in text, text
    with pytest.raises(NoBackendError, match="step 'legacy' cannot") as info:
        neuropod.load_neuropod(path)
    assert "caffe2" in str(info.value)


def test_load_options_that_a_pipeline_refuses(pipe: Path) -> None:
    with pytest.raises(PackageError, match="step_options names step 'nope'.*its steps are: scale, shift, total"):
        neuropod.load_neuropod(pipe, step_options={"nope": {"use_ope": True}})
    with pytest.raises(NoBackendError, match="pipeline"):
        neuropod.load_neuropod(pipe, backend="python")
    with pytest.raises(ValueError, match="step_options"):
        neuropod.load_neuropod(pipe, custom_ops=["x"])
    with pytest.raises(NeuropodError, match="shift"):
        neuropod.load_neuropod(pipe, step_options={"shift": {"backend": "onnx"}})


def _pipeline_threads() -> list[str]:
    return [th.name for th in threading.enumerate() if th.name.startswith("neuropod-pipeline")]


def _children() -> set[int]:
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children()} | _proc_children()


def _proc_children() -> set[int]:
    import os

    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return {int(p) for p in path.read_text().split()} if path.is_file() else set()


@pytest.mark.parametrize("use_ope", [False, True], ids=["in-process", "workers"])
def test_nothing_is_left_after_close(pipe: Path, use_ope: bool) -> None:
    before_threads, before_children = _pipeline_threads(), _children()
    model = neuropod.load_neuropod(pipe, use_ope=use_ope)
    model.infer({"in": data()})
    assert len(_pipeline_threads()) > len(before_threads), "a level of two steps runs on the pool"
    model.close()
    model.close()  # twice is fine
    assert _pipeline_threads() == before_threads
    deadline = time.monotonic() + 5
    while _children() - before_children and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _children() - before_children == set()
    with pytest.raises(NeuropodError, match="closed"):
        model.infer({"in": data()})


def test_a_step_failing_beside_another(steps: dict[str, Path], tmp_path: Path) -> None:
    parts = [
        {"package": steps["identity"], "name": "ok", "input_map": {"x": "in"}, "output_map": {"y": "l"}},
        {"package": steps["fragile"], "name": "weak", "input_map": {"x": "in"}, "output_map": {"y": "r"}},
        {"package": steps["total"], "input_map": {"p": "l", "q": "r"}, "output_map": {"s": "out"}},
    ]
    path = create_pipeline_neuropod(tmp_path / "p", "beside", parts, **IO)
    with neuropod.load_neuropod(path) as model:
        assert model.wiring.levels == (("ok", "weak"), ("total",))
        for _ in range(2):  # the step on the pool's thread fails the call; the pool keeps working
            with pytest.raises(PipelineStepError, match="pipeline 'beside', step 'weak' \\(model 'fragile'\\)"):
                model.infer({"in": -np.ones((1, 3), np.float32)})
        x = data()
        np.testing.assert_array_equal(model.infer({"in": x})["out"], x + x)
        stats = model.step_statistics()
        assert (stats["ok"]["count"], stats["weak"]["failures"], stats["total"]["count"]) == (3, 2, 1), stats


def test_packaging_refuses_steps_that_do_not_fit(steps: dict[str, Path], tmp_path: Path) -> None:
    """The wiring check on real packages, through the packager: nothing is written."""
    chain = [
        {"package": steps["scale"], "input_map": {"x": "in"}, "output_map": {"y": "mid"}},
        {"package": steps["scale"], "input_map": {"x": "mid"}, "output_map": {"y": "out"}},
    ]
    with pytest.raises(PackageError, match="two steps are named 'scale'; give one a 'name'"):
        create_pipeline_neuropod(tmp_path / "a", "a", chain, **IO)
    chain[1]["name"] = "again"
    with pytest.raises(
        PackageError, match="tensor 'in' is int32 \\(pipeline input 'in'\\), but step 'scale' input 'x'"
    ):
        create_pipeline_neuropod(
            tmp_path / "b", "b", chain, input_spec=[t("in", dtype="int32")], output_spec=[t("out")]
        )
    with pytest.raises(PackageError, match="step 'again' input 'x' reads tensor 'midd'"):
        create_pipeline_neuropod(tmp_path / "c", "c", [chain[0], {**chain[1], "input_map": {"x": "midd"}}], **IO)
    with pytest.raises(PackageError, match="steps\\[1\\]: unknown key 'inputs'"):
        create_pipeline_neuropod(tmp_path / "d", "d", [chain[0], {**chain[1], "inputs": {}}], **IO)
    with pytest.raises(PackageError, match="steps\\[0\\]: .*/nowhere"):
        create_pipeline_neuropod(tmp_path / "e", "e", [{**chain[0], "package": tmp_path / "nowhere"}, chain[1]], **IO)
    with pytest.raises(TypeError, match="state_spec"):
        create_pipeline_neuropod(tmp_path / "f", "f", chain, **IO, state_spec=[])
    assert not any((tmp_path / n).exists() for n in "abcdef")
    made = create_pipeline_neuropod(tmp_path / "g", "g", chain, **IO)
    x = data()
    with neuropod.load_neuropod(made) as model:
        np.testing.assert_array_equal(model.infer({"in": x})["out"], x * 4)
