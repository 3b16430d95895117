"""Pipelines and model servers, against real ``neuropod serve`` processes: a step that is a served
model (``grpc://`` or ``http://`` URL) inside a pipeline run in this process, and a pipeline package
served as one model and used as a remote model.

The packages are real: ONNX graphs (``scale``: y = 3x; ``adder``: out = x + y, doubled = 2 out;
``times10``), Python models (``slow`` sleeps before answering) and the decoupled ``repeat``
(streaming_models.py). Expected values are computed here with numpy, and against the same models
called by hand.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("grpc")

from onnx import TensorProto, helper

import neuropod
from neuropod.errors import PackageError, PipelineStepError, RemoteError
from neuropod.packagers import create_pipeline_neuropod
from neuropod.testing import served
from streaming_models import repeat_inputs, repeat_package

from conftest import ADDER_IN, ADDER_OUT, free_port, onnx_package, private_caches, python_package

PROTOCOLS = ["grpc", "http"]
PIPE_IN = [{"name": "in", "dtype": "float32", "shape": ["rows", 2]}]
PIPE_OUT = [{"name": "out", "dtype": "float32", "shape": ["rows", 2]}]

SLOW = """
import time


def get_model(data_root):
    def run(x):
        time.sleep(0.3)
        return {"y": x}
    return run
"""


def _adder(dest: Path, name: str) -> Path:
    return onnx_package(dest, name,
                        [helper.make_node("Add", ["x", "y"], ["out"]), helper.make_node("Mul", ["out", "two"], ["doubled"])],
                        ADDER_IN, ADDER_OUT, [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])  # fmt: skip


def _scale_then_add(package: Path, scale: Path, adder: str | Path, name: str = "scale_then_add", **kw: Any) -> Path:
    """``in`` -> scale (3 * in) -> adder (x = scaled, y = in) -> ``out`` = its ``doubled``: 2 * (3 in + in)."""
    return create_pipeline_neuropod(package, name, steps=[
        {"package": str(scale), "input_map": {"x": "in"}, "output_map": {"y": "scaled"}},
        {"package": str(adder), "input_map": {"x": "scaled", "y": "in"}, "output_map": {"doubled": "out"}, **kw},
    ], input_spec=PIPE_IN, output_spec=PIPE_OUT)  # fmt: skip


def _expected(x: np.ndarray) -> np.ndarray:
    return 2 * (3 * x + x)


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    """``scale`` (a local step) and the server's repository: adder, changing (the adder's graph under
    another name, replaced by a test), slow, repeat, and two pipeline packages: ``pipe`` (scale then
    adder, both inside it) and ``stream`` (repeat, then times10 on each of its responses)."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-pipeline-remote-"))
    with private_caches(root):
        models = root / "models"
        onnx_package(root / "scale", "scale", [helper.make_node("Mul", ["x", "k"], ["y"])],
                     [("x", "float32", ["n", 2])], [("y", "float32", ["n", 2])],
                     [helper.make_tensor("k", TensorProto.FLOAT, [], [3.0])])  # fmt: skip
        _adder(models / "adder", "adder")
        _adder(models / "changing", "changing")
        python_package(models / "slow", "slow", SLOW)
        repeat_package(models / "repeat")
        onnx_package(root / "times10", "times10", [helper.make_node("Mul", ["v", "ten"], ["w"])],
                     [("v", "int32", [1])], [("w", "int32", [1])],
                     [helper.make_tensor("ten", TensorProto.INT32, [], [10])])  # fmt: skip
        _scale_then_add(models / "pipe", root / "scale", models / "adder", "pipe")
        create_pipeline_neuropod(models / "stream", "stream", steps=[
            {"package": str(models / "repeat"), "input_map": {"IN": "IN", "DELAY": "DELAY", "WAIT": "WAIT"},
             "output_map": {"OUT": "value", "IDX": "IDX"}},
            {"package": str(root / "times10"), "input_map": {"v": "value"}, "output_map": {"w": "OUT10"}},
        ], input_spec=[{"name": "IN", "dtype": "int32", "shape": ["n"]}, {"name": "DELAY", "dtype": "uint32", "shape": ["n"]},
                       {"name": "WAIT", "dtype": "uint32", "shape": [1]}],
           output_spec=[{"name": "OUT10", "dtype": "int32", "shape": [1]}, {"name": "IDX", "dtype": "uint32", "shape": [1]}])  # fmt: skip
        yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Any]:
    with served(root / "models") as s:
        yield s


def _url(server: Any, protocol: str, model: str) -> str:
    return f"grpc://{server.grpc}/{model}" if protocol == "grpc" else f"{server.http}/{model}"


# --- a served step inside a pipeline run here -------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_served_step_runs_as_the_models_by_hand(root: Path, server: Any, protocol: str, tmp_path: Path) -> None:
    url = _url(server, protocol, "adder")
    package = _scale_then_add(tmp_path / "pipe", root / "scale", url, load_options={"timeout": 30})
    config = json.loads((package / "config.json").read_text())["pipeline"]
    served_step = config["steps"][1]
    assert served_step["url"] == url and "package" not in served_step
    assert [s["name"] for s in served_step["input_spec"]] == ["x", "y"]  # recorded at packaging
    assert sorted(p.name for p in (package / "0" / "steps").iterdir()) == ["scale"]  # the adder stays on the server

    rng = np.random.default_rng(0)
    with neuropod.load_neuropod(package) as pipe, neuropod.load_neuropod(root / "scale") as scale, \
            neuropod.load_neuropod(url) as adder:  # fmt: skip
        assert pipe.steps["adder"].backend.location.startswith(f"remote: {protocol}://")
        assert pipe.steps["scale"].backend.location == scale.backend.location
        for rows in (1, 3, 0, 5):
            x = rng.standard_normal((rows, 2)).astype(np.float32)
            out = pipe.infer({"in": x})
            by_hand = adder.infer({"x": scale.infer({"x": x})["y"], "y": x})["doubled"]
            assert list(out) == ["out"] and out["out"].shape == (rows, 2)
            np.testing.assert_array_equal(out["out"], by_hand)
            np.testing.assert_allclose(out["out"], _expected(x), rtol=1e-6)
        stats = pipe.step_statistics()
        assert stats["adder"]["count"] == stats["scale"]["count"] == 4
        assert stats["adder"]["failures"] == 0 and stats["adder"]["ns"] > 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_packaging_with_the_server_down_names_the_step_and_its_url(root: Path, protocol: str, tmp_path: Path) -> None:
    url = f"{protocol}://127.0.0.1:{free_port()}/adder"
    with pytest.raises(RemoteError, match=r"steps\[1\]: the step served at " + url) as e:
        _scale_then_add(tmp_path / "pipe", root / "scale", url)
    assert e.value.code == "unavailable"
    assert not (tmp_path / "pipe").exists()


def test_a_server_gone_after_packaging(root: Path, tmp_path: Path) -> None:
    """Gone while the pipeline runs: the call fails naming the step (the pipeline stays usable for the
    next call); gone at load: the load fails naming the step and its URL."""
    models = tmp_path / "models"
    shutil.copytree(root / "models" / "adder", models / "adder")
    x = np.ones((2, 2), np.float32)
    with served(models) as short_lived:
        url = _url(short_lived, "grpc", "adder")
        package = _scale_then_add(tmp_path / "pipe", root / "scale", url)
        pipe = neuropod.load_neuropod(package)
        np.testing.assert_allclose(pipe.infer({"in": x})["out"], _expected(x))
    with pipe:
        for _ in range(2):
            with pytest.raises(PipelineStepError, match="pipeline 'scale_then_add', step 'adder' .*cannot reach") as e:
                pipe.infer({"in": x})
            assert e.value.step == "adder" and isinstance(e.value.__cause__, RemoteError)
    with pytest.raises(RemoteError, match=f"pipeline 'scale_then_add': step 'adder' is served at {url}, which cannot"):
        neuropod.load_neuropod(package)


def test_a_served_step_whose_model_changed_is_refused_at_load(root: Path, server: Any, tmp_path: Path) -> None:
    url = _url(server, "grpc", "changing")
    package = _scale_then_add(tmp_path / "pipe", root / "scale", url)
    x = np.full((1, 2), 2.0, np.float32)
    with neuropod.load_neuropod(package) as pipe:
        np.testing.assert_allclose(pipe.infer({"in": x})["out"], _expected(x))
    # The server's "changing" is replaced by a model with another output shape, and reloaded.
    changing = root / "models" / "changing"
    shutil.rmtree(changing)
    onnx_package(changing, "changing", [helper.make_node("Add", ["x", "y"], ["doubled"])],
                 ADDER_IN, [("doubled", "float32", [1, 2])])  # fmt: skip
    request = urllib.request.Request(f"{server.http}/v2/repository/models/changing/load", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200
    with neuropod.load_neuropod(url) as now:
        assert [s.shape for s in now.outputs] == [(1, 2)]
    with pytest.raises(
        PackageError, match=f"step 'changing' is served at {url}, whose model no longer has the spec"
    ) as e:
        neuropod.load_neuropod(package)
    assert "doubled: float32 [1, 2]" in str(e.value)


def test_step_options_reach_the_served_step(root: Path, server: Any, tmp_path: Path) -> None:
    """``step_options={"slow": {"timeout": ...}}`` is the served step's load option: its calls get that deadline."""
    url = _url(server, "grpc", "slow")
    package = create_pipeline_neuropod(tmp_path / "pipe", "scale_then_slow", steps=[
        {"package": str(root / "scale"), "input_map": {"x": "in"}, "output_map": {"y": "scaled"}},
        {"package": url, "input_map": {"x": "scaled"}, "output_map": {"y": "out"}},
    ], input_spec=PIPE_IN, output_spec=PIPE_OUT)  # fmt: skip
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    with neuropod.load_neuropod(package, step_options={"slow": {"timeout": 0.05}}) as pipe:
        with pytest.raises(PipelineStepError, match=r"step 'slow' \(model 'slow'\).*no answer within 0.05 s") as e:
            pipe.infer({"in": x})
        assert isinstance(e.value.__cause__, RemoteError) and e.value.__cause__.code == "deadline_exceeded"
    with neuropod.load_neuropod(package, step_options={"slow": {"timeout": 30}}) as pipe:
        np.testing.assert_array_equal(pipe.infer({"in": x})["out"], 3 * x)
    with pytest.raises(PackageError, match="step_options names step 'nope'"):
        neuropod.load_neuropod(package, step_options={"nope": {"timeout": 1}})


def test_a_decoupled_served_step_streams_into_the_steps_after_it(root: Path, server: Any, tmp_path: Path) -> None:
    package = create_pipeline_neuropod(tmp_path / "pipe", "remote_stream", steps=[
        {"package": _url(server, "grpc", "repeat"), "input_map": {"IN": "IN", "DELAY": "DELAY", "WAIT": "WAIT"},
         "output_map": {"OUT": "value", "IDX": "IDX"}},
        {"package": str(root / "times10"), "input_map": {"v": "value"}, "output_map": {"w": "OUT10"}},
    ], input_spec=[{"name": "IN", "dtype": "int32", "shape": ["n"]}, {"name": "DELAY", "dtype": "uint32", "shape": ["n"]},
                   {"name": "WAIT", "dtype": "uint32", "shape": [1]}],
       output_spec=[{"name": "OUT10", "dtype": "int32", "shape": [1]}, {"name": "IDX", "dtype": "uint32", "shape": [1]}])  # fmt: skip
    values = [4, 0, 7, 11]
    with neuropod.load_neuropod(package) as pipe:
        assert pipe.decoupled
        responses = list(pipe.infer_stream(repeat_inputs(values)))
    assert [r["OUT10"].tolist() for r in responses] == [[10 * v] for v in values]
    assert [r["IDX"].tolist() for r in responses] == [[i] for i in range(len(values))]


# --- a pipeline served as one model -----------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_served_pipeline_is_a_remote_model(root: Path, server: Any, protocol: str) -> None:
    rng = np.random.default_rng(1)
    with neuropod.load_neuropod(_url(server, protocol, "pipe")) as remote, \
            neuropod.load_neuropod(root / "models" / "pipe") as here:  # fmt: skip
        assert remote.name == here.name == "pipe"
        assert remote.inputs == here.inputs and remote.outputs == here.outputs
        assert remote.backend.platform == "pipeline"
        for rows in (1, 4):
            x = rng.standard_normal((rows, 2)).astype(np.float32)
            out = remote.infer({"in": x})
            np.testing.assert_array_equal(out["out"], here.infer({"in": x})["out"])
            np.testing.assert_allclose(out["out"], _expected(x), rtol=1e-6)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_served_decoupled_pipeline_streams_to_a_remote_model(server: Any, protocol: str) -> None:
    values = [3, 1, 2]
    with neuropod.load_neuropod(_url(server, protocol, "stream")) as remote:
        assert remote.decoupled
        responses = list(remote.infer_stream(repeat_inputs(values)))
    assert [r["OUT10"].tolist() for r in responses] == [[10 * v] for v in values]
    assert [r["IDX"].tolist() for r in responses] == [[i] for i in range(len(values))]


def test_a_served_pipeline_with_a_step_on_another_server(root: Path, server: Any, tmp_path: Path) -> None:
    """Two machines' worth: a front server serves a pipeline whose ``adder`` step is the first server's."""
    _scale_then_add(tmp_path / "front" / "front", root / "scale", _url(server, "grpc", "adder"), "front")
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    with served(tmp_path / "front") as front, neuropod.load_neuropod(_url(front, "http", "front")) as pipe:
        np.testing.assert_allclose(pipe.infer({"in": x})["out"], _expected(x), rtol=1e-6)
