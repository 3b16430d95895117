"""The neuropod command on pipeline packages of python-backend steps: inspect shows the steps and
their levels, explain the plan per step, test and infer run the whole pipeline."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest

from neuropod.cli import main
from neuropod.cli.inspect import _print_pipeline
from neuropod.create import create_package
from neuropod.package import read_package
from neuropod.packagers import create_pipeline_neuropod
from neuropod.pipespec import PipelineStep
from test_pipelines import IO, OPS, data, diamond, step_pkg, t

from conftest import write_code


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out), out.getvalue()


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    code = write_code(root / "code", {"ops.py": OPS})
    steps = {
        "scale": step_pkg(code, root / "scale", "scale", [t("x")], [t("y")]),
        "shift": step_pkg(code, root / "shift", "shift", [t("a", "n", 3)], [t("b", "n", 3)]),
        "total": step_pkg(code, root / "total", "total", [t("p", "m", 3), t("q", "m", 3)], [t("s", "m", 3)]),
    }
    x = data()
    path: Path = create_pipeline_neuropod(
        root / "pipe",
        "pipe",
        diamond(steps),
        **IO,
        max_inflight_requests=4,
        test_input_data={"in": x},
        test_expected_out={"out": x * 3 + 1},
    )
    return path


def test_inspect_shows_the_steps_and_levels(pipe: Path) -> None:
    code, out = run("inspect", str(pipe))
    assert code == 0
    assert "Platform:  pipeline" in out
    assert "Pipeline:  3 steps; at most 4 requests inside at once" in out
    assert "  step scale: model scale, platform python, versions '*' (0/steps/scale)" in out
    assert "  step total: model total, platform python, versions '*' (0/steps/total)" in out
    assert "    inputs:  p <- scaled, q <- shifted\n    outputs: s -> out" in out
    assert "    inputs:  a <- in\n    outputs: b -> shifted" in out
    assert "Levels:    scale, shift | total (steps of one level run side by side)" in out
    assert "0/steps/shift/config.json" in out  # the steps' packages are files of the pipeline's


def test_inspect_json_has_the_pipeline_block_and_levels(pipe: Path) -> None:
    code, out = run("inspect", "--json", str(pipe))
    data = json.loads(out)
    assert code == 0 and data["platform"] == "pipeline"
    block = data["pipeline"]
    assert [s["name"] for s in block["steps"]] == ["scale", "shift", "total"]
    assert block["steps"][2]["input_map"] == {"p": "scaled", "q": "shifted"}
    assert block["levels"] == [["scale", "shift"], ["total"]] and block["max_inflight_requests"] == 4


def test_explain_prints_the_plan_per_step(pipe: Path) -> None:
    code, out = run("explain", str(pipe), "--quiet-spec")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "Pipeline 'pipe': 3 steps (scale, shift -> total); every step can run here."
    assert "Steps:" in lines
    for name in ("scale", "shift", "total"):
        assert any(line.startswith(f"  step {name!r} (model {name!r}): python==") for line in lines), out
        head = lines.index(f"Step {name!r} (0/steps/{name}):")
        assert lines[head + 1] == f"  Model {name!r} needs platform 'python', versions '*'."
        assert lines[head + 2].startswith("  Chosen: python==")
    code, full = run("explain", str(pipe))
    assert code == 0 and "Pipeline:  3 steps" in full and full.endswith(out)


def test_explain_names_the_step_that_cannot_run(pipe: Path, tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="caffe2"):
        odd = create_package("test", tmp_path / "odd", "odd", "caffe2", [t("x")], [t("y")], {}, {})
    with pytest.warns(UserWarning, match="step 'legacy'"):
        path = create_pipeline_neuropod(
            tmp_path / "p",
            "odd_pipe",
            [
                {"package": pipe, "name": "inner", "input_map": {"in": "in"}, "output_map": {"out": "mid"}},
                {"package": odd, "name": "legacy", "input_map": {"x": "mid"}, "output_map": {"y": "out"}},
            ],
            **IO,
        )
    code, out = run("explain", str(path), "--quiet-spec")
    assert code == 1
    assert "It cannot run here: step 'legacy' cannot. Model 'odd' needs platform 'caffe2'" in out
    assert "  step 'legacy' (model 'odd'): no backend can run it here" in out
    assert "  step 'inner' (model 'pipe'): pipeline==" in out
    code, out = run("inspect", str(path))
    assert code == 0 and "  step legacy: model odd, platform caffe2, versions '*' (0/steps/legacy)" in out
    assert "  step inner: model pipe, platform pipeline" in out


def test_test_and_infer_run_the_pipeline(pipe: Path, tmp_path: Path) -> None:
    code, out = run("test", str(pipe))
    assert code == 0 and "PASSED: 1 output(s) match" in out, out
    x = data(5, seed=3)
    np.save(tmp_path / "in.npy", x)
    code, out = run("infer", str(pipe), "-i", f"in={tmp_path / 'in.npy'}", "--output-dir", str(tmp_path / "out"))
    assert code == 0, out
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "out.npy"), x * 2 + (x + 1))


def test_inspect_shows_a_served_step_by_its_url(pipe: Path) -> None:
    """A step served elsewhere (its pipeline needs the server to be made; its display does not)."""
    package = read_package(pipe)
    spec = package.config.pipeline
    assert spec is not None
    far = PipelineStep("far", {"x": "out"}, {"y": "final"}, url="grpc://models.example:8001/m", model_name="m")
    config = dataclasses.replace(package.config, pipeline=dataclasses.replace(spec, steps=(*spec.steps, far)))
    out = io.StringIO()
    _print_pipeline(dataclasses.replace(package, config=config), out)
    text = out.getvalue()
    assert "  step far: model m, served at grpc://models.example:8001/m\n    inputs:  x <- out\n" in text, text
    assert "Levels:    scale, shift | total | far " in text, text
