"""A pipeline across framework releases: a TensorFlow step whose package admits only another
TensorFlow release than this process's (so it runs in a backend environment, in a worker process)
feeding an ONNX step in this process, checked value for value against each step's model run by hand.

It creates a real ``tensorflow==<other>`` environment (pip downloads tensorflow-cpu, about 250 MB), so it
runs only with ``NEUROPOD_TEST_ENVS=1`` (``nox -s tests_envs``). The environment is made once per session
in a temporary ``NEUROPOD_HOME``; the core and the plugin come from where this process's were installed
from (see ``neuropod.envs``). This process needs no TensorFlow: the environment's TensorFlow saves the
model, packages it, and runs the SavedModel by hand (``tf.saved_model.load``, no neuropod) for reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import importlib_metadata
import numpy as np
import pytest

import neuropod
from neuropod import envs, packagers

from conftest import spec

# The ONNX step needs onnx and onnxruntime, which tests_envs installs and tests_tensorflow does not.
ort = pytest.importorskip("onnxruntime", reason="the pipeline's ONNX step needs onnxruntime (nox -s tests_envs)")
onnx = pytest.importorskip("onnx", reason="the pipeline's ONNX step is built with onnx (nox -s tests_envs)")
helper = onnx.helper
TensorProto = onnx.TensorProto

pytestmark = [
    pytest.mark.envs,
    pytest.mark.skipif(
        os.environ.get("NEUROPOD_TEST_ENVS") != "1",
        reason="creates a backend environment (downloads tensorflow-cpu): set NEUROPOD_TEST_ENVS=1",
    ),
]


def _installed_tensorflow() -> str | None:
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            pass
    return None


HERE = _installed_tensorflow()  # None: this process has no TensorFlow (as in nox -s tests_envs)
OTHER = "2.21.0" if HERE and HERE.startswith("2.18.") else "2.18.1"
OTHER_RANGE = "~" + ".".join(OTHER.split(".")[:2])  # e.g. ~2.18: >=2.18.0, <2.19.0, which this process is not
WEIGHTS = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)
HEAD = np.array([0.5, -1.5, 2.0, 3.0], np.float32)
X_SPEC = spec(("x", "float32", ["batch", 3]))
FEAT_SPEC = spec(("h", "float32", ["batch", 4]))
BATCHES = [np.random.default_rng(1).standard_normal((n, 3)).astype(np.float32) * 2 for n in (1, 4, 33)]

# Run by the environment's interpreter: the TensorFlow step, h = tanh(x @ W) * 2 + 0.25, saved as a
# SavedModel, run by hand on the batches, then packaged for that TensorFlow release only.
MAKE_STEP = """
import numpy as np, tensorflow as tf
from neuropod.packagers import create_tensorflow_neuropod

class Features(tf.Module):
    def __init__(self):
        super().__init__()
        self.w = tf.Variable(np.load({weights!r}))

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
    def serving_default(self, x):
        return {{"h": tf.tanh(x @ self.w) * 2.0 + 0.25}}

module = Features()
tf.saved_model.save(module, {saved!r}, signatures={{"serving_default": module.serving_default}})
run = tf.saved_model.load({saved!r}).signatures["serving_default"]
batches = np.load({batches!r})
np.savez({by_hand!r}, *[run(x=tf.constant(batches[f"arr_{{i}}"]))["h"].numpy() for i in range(len(batches.files))])
create_tensorflow_neuropod({path!r}, "features", {x_spec!r}, {feat_spec!r}, saved_model_dir={saved!r},
                           platform_version_semver={range!r})
print(tf.__version__)
"""


def head_model() -> onnx.ModelProto:
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
    """The two step packages, the pipeline over them (its test data runs through both steps) and the
    TensorFlow step's outputs on BATCHES from the environment's TensorFlow run by hand."""
    root = tmp_path_factory.mktemp("pipeline")
    np.save(root / "weights.npy", WEIGHTS)
    np.savez(root / "batches.npz", *BATCHES)
    feat = root / "feat"
    code = MAKE_STEP.format(
        weights=str(root / "weights.npy"), saved=str(root / "saved"), batches=str(root / "batches.npz"),
        by_hand=str(root / "by_hand.npz"), path=str(feat), x_spec=X_SPEC, feat_spec=FEAT_SPEC, range=OTHER_RANGE,
    )  # fmt: skip
    made = subprocess.run([str(other_env.python), "-c", code], capture_output=True, text=True, check=False)
    assert made.returncode == 0, made.stderr[-3000:]
    assert made.stdout.split()[-1] == OTHER
    with np.load(root / "by_hand.npz") as by_hand:
        tf_by_hand = [by_hand[f"arr_{i}"] for i in range(len(BATCHES))]

    onnx_model = head_model()
    head = packagers.create_onnx_neuropod(
        root / "head",
        "head",
        spec(("h", "float32", ["n", 4])),
        spec(("score", "float32", ["n"])),
        onnx_model=onnx_model,
    )
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    pipe = packagers.create_pipeline_neuropod(
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
    return {"feat": feat, "head": head, "pipe": pipe, "onnx_model": onnx_model, "tf_by_hand": tf_by_hand}


def test_the_plan_puts_the_tensorflow_step_in_the_environment(packages: dict[str, Any]) -> None:
    plan = neuropod.plan(packages["pipe"])
    chosen = {s.step.name: s.resolution.chosen if s.resolution else None for s in plan.steps}
    assert chosen["feat"] is not None and chosen["head"] is not None
    feat, head = chosen["feat"].backend, chosen["head"].backend
    assert (feat.id, feat.location) == (f"tensorflow=={OTHER}", f"env:tensorflow-{OTHER}")
    assert (head.platform, head.location) == ("onnx", "in-process")
    text = plan.explain()
    assert f"step 'feat' (model 'features'): tensorflow=={OTHER} on cpu (env:tensorflow-{OTHER})" in text, text
    assert f"versions '{OTHER_RANGE}'" in text, text


def test_the_pipeline_equals_its_steps_run_by_hand_and_leaves_no_worker(packages: dict[str, Any]) -> None:
    with neuropod.load_neuropod(packages["feat"]) as feat:  # the TensorFlow step alone, through the same environment
        assert (feat.backend.id, feat.backend.location) == (f"tensorflow=={OTHER}", f"env:tensorflow-{OTHER}")
        step_alone = [feat.infer({"x": x})["h"] for x in BATCHES]
    session = ort.InferenceSession(packages["onnx_model"].SerializeToString(), providers=["CPUExecutionProvider"])
    by_hand_score = [session.run(["score"], {"h": h})[0] for h in packages["tf_by_hand"]]

    with neuropod.load_neuropod(packages["pipe"]) as pipe:
        assert pipe.steps["feat"].backend.location == f"env:tensorflow-{OTHER}"
        assert pipe.steps["head"].backend.location == "in-process"
        pids = list(pipe.steps["feat"].worker_pids)  # the TensorFlow step runs in a worker process
        assert pids and os.getpid() not in pids
        outs = [pipe.infer({"x": x}) for x in BATCHES]
        assert {s: v["count"] for s, v in pipe.step_statistics().items()} == {"feat": 3, "head": 3}
    assert all(_gone(pid) for pid in pids), f"the TensorFlow {OTHER} worker outlived the pipeline: {pids}"

    for x, out, h, alone, score in zip(BATCHES, outs, packages["tf_by_hand"], step_alone, by_hand_score, strict=True):
        assert out["features"].dtype == np.float32 and out["features"].shape == (len(x), 4)
        assert out["score"].dtype == np.float32 and out["score"].shape == (len(x),)
        # Value-exact: TensorFlow OTHER's SavedModel run by hand, the step's package alone, onnxruntime by hand.
        np.testing.assert_array_equal(out["features"], h)
        np.testing.assert_array_equal(out["features"], alone)
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
