"""A pipeline across framework releases: a TensorFlow step whose package admits only another
TensorFlow release than this process's (so it runs in a backend environment, in a worker process)
feeding an ONNX step in this process, checked value for value against each step's model run by hand.

It creates a real ``tensorflow==<other>`` environment (pip downloads tensorflow-cpu, about 250 MB), so it
runs only with ``NEUROPOD_TEST_ENVS=1`` (``nox -s tests_envs``). The environment is made once per session
in a temporary ``NEUROPOD_HOME``; the core and the plugin come from where this process's were installed
from (see ``neuropod.envs``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tensorflow as tf
from onnx import ModelProto, TensorProto, helper

import neuropod
from neuropod import envs
from neuropod.packagers import create_onnx_neuropod, create_pipeline_neuropod, create_tensorflow_neuropod

from conftest import spec

pytestmark = [
    pytest.mark.envs,
    pytest.mark.skipif(
        os.environ.get("NEUROPOD_TEST_ENVS") != "1",
        reason="creates a backend environment (downloads tensorflow-cpu): set NEUROPOD_TEST_ENVS=1",
    ),
]

HERE = tf.__version__
OTHER = "2.18.1" if not HERE.startswith("2.18.") else "2.21.0"
OTHER_RANGE = "~" + ".".join(OTHER.split(".")[:2])  # e.g. ~2.18: >=2.18.0, <2.19.0, which this process is not
WEIGHTS = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)
HEAD = np.array([0.5, -1.5, 2.0, 3.0], np.float32)
X_SPEC = spec(("x", "float32", ["batch", 3]))
FEAT_SPEC = spec(("h", "float32", ["batch", 4]))


class Features(tf.Module):
    """The TensorFlow step: h = tanh(x @ W) * 2 + 0.25, a SavedModel with a serving_default signature."""

    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(WEIGHTS)

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
    def serving_default(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"h": tf.tanh(x @ self.w) * 2.0 + 0.25}


def head_model() -> ModelProto:
    """The ONNX step: score = sum(h * k, axis=1), with h from the TensorFlow step."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["h", "k"], ["weighted"]),
            helper.make_node("ReduceSum", ["weighted", "axes"], ["score"], keepdims=0),
        ],
        "head",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["n"])],
        initializer=[
            helper.make_tensor("k", TensorProto.FLOAT, [4], HEAD.tolist()),
            helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def numpy_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.tanh(x.astype(np.float64) @ WEIGHTS.astype(np.float64)) * 2.0 + 0.25
    return h, h @ HEAD.astype(np.float64)


@pytest.fixture(scope="module")
def other_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[envs.Environment]:
    home = tmp_path_factory.mktemp("neuropod-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEUROPOD_HOME", str(home))
        t0 = time.perf_counter()
        env = envs.create_environment(f"tensorflow=={OTHER}", out=sys.stderr)
        print(f"created tensorflow=={OTHER} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        yield env


@pytest.fixture(scope="module")
def packages(other_env: envs.Environment, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The two step packages and the pipeline over them (its test data runs through both steps)."""
    root = tmp_path_factory.mktemp("pipeline")
    feat = create_tensorflow_neuropod(
        root / "feat", "features", X_SPEC, FEAT_SPEC, trackable_obj=Features(), platform_version_semver=OTHER_RANGE
    )
    onnx_model = head_model()
    head = create_onnx_neuropod(
        root / "head",
        "head",
        spec(("h", "float32", ["n", 4])),
        spec(("score", "float32", ["n"])),
        onnx_model=onnx_model,
    )
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    pipe = create_pipeline_neuropod(
        root / "pipe",
        "scored",
        steps=[
            {"package": feat, "name": "feat", "input_map": {"x": "x"}, "output_map": {"h": "features"}},
            {"package": head, "name": "head", "input_map": {"h": "features"}, "output_map": {"score": "score"}},
        ],
        input_spec=X_SPEC,
        output_spec=spec(("features", "float32", ["batch", 4]), ("score", "float32", ["batch"])),
        test_input_data={"x": x},
    )
    return {"feat": feat, "head": head, "pipe": pipe, "onnx_model": onnx_model}


def test_the_plan_puts_the_tensorflow_step_in_the_environment(packages: dict[str, Any]) -> None:
    plan = neuropod.plan(packages["pipe"])
    chosen = {s.step.name: s.resolution.chosen if s.resolution else None for s in plan.steps}
    assert chosen["feat"] is not None and chosen["head"] is not None
    assert (chosen["feat"].backend.id, chosen["feat"].backend.location) == (
        f"tensorflow=={OTHER}",
        f"env:tensorflow-{OTHER}",
    )
    assert (chosen["head"].backend.platform, chosen["head"].backend.location) == ("onnx", "in-process")
    text = plan.explain()
    assert f"step 'feat' (model 'features'): tensorflow=={OTHER} on cpu (env:tensorflow-{OTHER})" in text, text
    assert f"versions '{OTHER_RANGE}'" in text, text


def test_the_pipeline_equals_its_steps_run_by_hand_and_leaves_no_worker(packages: dict[str, Any]) -> None:
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((n, 3)).astype(np.float32) * 2 for n in (1, 4, 33)]
    with neuropod.load_neuropod(packages["feat"]) as feat:  # the TensorFlow step alone, through the same environment
        assert (feat.backend.id, feat.backend.location) == (f"tensorflow=={OTHER}", f"env:tensorflow-{OTHER}")
        by_hand_h = [feat.infer({"x": x})["h"] for x in batches]
    session = ort.InferenceSession(packages["onnx_model"].SerializeToString(), providers=["CPUExecutionProvider"])
    by_hand_score = [session.run(["score"], {"h": h})[0] for h in by_hand_h]

    with neuropod.load_neuropod(packages["pipe"]) as pipe:
        assert pipe.steps["feat"].backend.location == f"env:tensorflow-{OTHER}"
        assert pipe.steps["head"].backend.location == "in-process"
        pids = list(pipe.steps["feat"].worker_pids)  # the TensorFlow step runs in a worker process
        assert pids and os.getpid() not in pids
        outs = [pipe.infer({"x": x}) for x in batches]
        assert {s: v["count"] for s, v in pipe.step_statistics().items()} == {"feat": 3, "head": 3}
    assert all(_gone(pid) for pid in pids), f"the TensorFlow {OTHER} worker outlived the pipeline: {pids}"

    for x, out, h, score in zip(batches, outs, by_hand_h, by_hand_score, strict=True):
        assert out["features"].dtype == np.float32 and out["features"].shape == (len(x), 4)
        assert out["score"].dtype == np.float32 and out["score"].shape == (len(x),)
        np.testing.assert_array_equal(out["features"], h)  # value-exact: the same TensorFlow, the same onnxruntime
        np.testing.assert_array_equal(out["score"], score)
        ref_h, ref_score = numpy_reference(x)  # and both right, computed apart from either framework
        np.testing.assert_allclose(out["features"], ref_h, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["score"], ref_score, rtol=1e-5, atol=1e-5)


def _gone(pid: int, within: float = 5.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # our own zombie child still answers kill(pid, 0): reap it
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False
