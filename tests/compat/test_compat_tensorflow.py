"""Code written for the original Neuropod (0.3), run against ours: TensorFlow and Keras.

The models are built as the original's users built them: TF1-style graphs of
``tf.compat.v1`` placeholders handed over as a ``graph_def`` or a frozen
``.pb`` with a ``node_name_mapping``, TF2 ``tf.Module``s with a
``tf.function`` (``trackable_obj=`` or ``saved_model_dir=``), and Keras models
with ``sess=None``. They are packaged and loaded through the original's import
paths and keywords (always by keyword, as its packagers required), and the
results checked against values computed here with numpy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("neuropod_tensorflow")

from neuropod.backends.keras.packager import infer_keras_input_spec, infer_keras_output_spec  # noqa: E402
from neuropod.loader import load_neuropod  # noqa: E402  (the original's import paths)
from neuropod.packagers import create_keras_neuropod, create_tensorflow_neuropod  # noqa: E402

HERE = Path(__file__).resolve().parent

# The tutorial's addition problem: symbol shapes as tuples, an int64 expectation for a float32 output.
ADDITION_SPEC: dict[str, Any] = {
    "input_spec": [
        {"name": "x", "dtype": "float32", "shape": ("num_inputs",)},
        {"name": "y", "dtype": "float32", "shape": ("num_inputs",)},
    ],
    "output_spec": [{"name": "out", "dtype": "float32", "shape": (None,)}],
}
TEST_INPUT_DATA = {"x": np.arange(5, dtype=np.float32), "y": np.arange(5, dtype=np.float32)}
TEST_EXPECTED_OUT = {"out": np.arange(5) + np.arange(5)}

STRING_SPEC: dict[str, Any] = {
    "input_spec": [
        {"name": "x", "dtype": "string", "shape": ("batch_size",)},
        {"name": "y", "dtype": "string", "shape": ("batch_size",)},
    ],
    "output_spec": [{"name": "out", "dtype": "string", "shape": ("batch_size",)}],
}
WORDS_X, WORDS_Y = np.array(["apple", "banana", "carrot"]), np.array(["sauce", "split", "cake"])
CONCATENATED = np.array(["apple sauce", "banana split", "carrot cake"])


@pytest.fixture(autouse=True)
def _private_cache(neuropod_cache: Path) -> Path:
    # neuropod.testing's fixture: a private package cache for every test here.
    return neuropod_cache


def addition_graph_def() -> Any:
    """The tutorial's TF1 addition graph, in a name scope as its users' graphs were."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.name_scope("some_namespace"):
        x = tf.compat.v1.placeholder(tf.float32, name="in_x")
        y = tf.compat.v1.placeholder(tf.float32, name="in_y")
        tf.add(x, y, name="out")
    return graph.as_graph_def()


ADDITION_MAPPING = {"x": "some_namespace/in_x:0", "y": "some_namespace/in_y", "out": "some_namespace/out:0"}


def _addition(path: Path, **kwargs: Any) -> Path:
    args: dict[str, Any] = {
        "neuropod_path": str(path),
        "model_name": "addition_model",
        "graph_def": addition_graph_def(),
        "node_name_mapping": ADDITION_MAPPING,
        **ADDITION_SPEC,
        "test_input_data": TEST_INPUT_DATA,
        "test_expected_out": TEST_EXPECTED_OUT,
        **kwargs,
    }
    create_tensorflow_neuropod(**args)
    return path


class AdditionModule(tf.Module):
    """The TF2 form of the addition model: a trackable object with a signature."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x"), tf.TensorSpec([None], tf.float32, name="y")])
    def __call__(self, x: Any, y: Any) -> dict[str, Any]:
        return {"out": x + y}


# --- TensorFlow graphs ------------------------------------------------------------------


def test_tutorial_addition_graph(tmp_path: Path) -> None:
    path = _addition(tmp_path / "addition_model")
    neuropod = load_neuropod(str(path))
    try:
        assert neuropod.inputs == ADDITION_SPEC["input_spec"]
        assert neuropod.outputs == [{"name": "out", "dtype": "float32", "shape": (None,)}]
        assert [spec["name"] for spec in neuropod.inputs] == ["x", "y"]
        assert neuropod.inputs[0]["shape"] == ["num_inputs"] and dict(neuropod.outputs[0])["dtype"] == "float32"
        x, y = np.array([1, 2, 3], np.float32), np.array([10, 20, 30], np.float32)
        out = neuropod.infer({"x": x, "y": y})
        np.testing.assert_array_equal(out["out"], x + y)
        assert out["out"].dtype == np.float32
    finally:
        neuropod.close()


def test_original_import_paths_are_the_same_packagers() -> None:
    from neuropod.backends.keras.packager import create_keras_neuropod as keras_from_backends
    from neuropod.backends.tensorflow.packager import create_tensorflow_neuropod as tf_from_backends

    assert tf_from_backends is create_tensorflow_neuropod
    assert keras_from_backends is create_keras_neuropod


@pytest.mark.parametrize("package_as_zip", [True, False])
@pytest.mark.parametrize("persist_test_data", [True, False])
def test_every_packager_keyword(tmp_path: Path, package_as_zip: bool, persist_test_data: bool) -> None:
    tf.io.write_graph(addition_graph_def(), str(tmp_path), "frozen.pb", as_text=False)
    path = tmp_path / ("addition.zip" if package_as_zip else "addition")
    create_tensorflow_neuropod(
        neuropod_path=str(path),
        model_name="addition_model",
        frozen_graph_path=str(tmp_path / "frozen.pb"),
        node_name_mapping=ADDITION_MAPPING,
        input_spec=ADDITION_SPEC["input_spec"],
        output_spec=ADDITION_SPEC["output_spec"],
        init_op_names=[],
        platform_version_semver="> 1.13.1",
        input_tensor_device={"x": "CPU"},
        default_input_tensor_device="GPU",
        custom_ops=[],
        package_as_zip=package_as_zip,
        test_input_data=TEST_INPUT_DATA,
        test_expected_out=TEST_EXPECTED_OUT,
        persist_test_data=persist_test_data,
        zip_compression=zipfile.ZIP_STORED,
        neuropod_load_args={"visible_gpu": None},
    )
    if package_as_zip:
        assert path.is_file()
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
            config = json.loads(zf.read("config.json"))
            backend_config = json.loads(zf.read("0/config.json"))
    else:
        assert path.is_dir()
        names = [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
        config = json.loads((path / "config.json").read_text())
        backend_config = json.loads((path / "0" / "config.json").read_text())
    assert "0/data/model.pb" in names
    assert any(n.startswith("test_data/") for n in names) == persist_test_data
    assert config["platform"] == "tensorflow" and config["platform_version_semver"] == "> 1.13.1"
    assert config["input_tensor_device"] == {"x": "CPU", "y": "GPU"}
    assert backend_config == {"node_name_mapping": ADDITION_MAPPING, "init_op_names": []}
    neuropod = load_neuropod(str(path), visible_gpu=None)
    try:
        out = neuropod.infer({"x": np.ones(3, np.float32), "y": np.full(3, 2, np.float32)})
        np.testing.assert_array_equal(out["out"], np.full(3, 3, np.float32))
    finally:
        neuropod.close()


def test_init_op_names_as_one_str(tmp_path: Path) -> None:
    """The original wrapped a str in a list: the init op runs once, after loading."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        weight = tf.compat.v1.Variable(4.0, name="weight", use_resource=False)
        tf.multiply(x, weight, name="out")
        tf.compat.v1.variables_initializer([weight], name="init_vars")
    x = np.array([1, 2, 3], np.float32)
    create_tensorflow_neuropod(
        neuropod_path=str(tmp_path / "m"), model_name="weighted", graph_def=graph.as_graph_def(),
        node_name_mapping={"x": "x", "out": "out"}, init_op_names="init_vars",
        input_spec=[{"name": "x", "dtype": "float32", "shape": (None,)}],
        output_spec=[{"name": "out", "dtype": "float32", "shape": (None,)}],
        test_input_data={"x": x}, test_expected_out={"out": x * 4},
    )  # fmt: skip
    assert json.loads((tmp_path / "m" / "0" / "config.json").read_text())["init_op_names"] == ["init_vars"]
    np.testing.assert_array_equal(load_neuropod(str(tmp_path / "m")).infer({"x": x})["out"], x * 4)


def test_wrong_expected_output_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not reproduce its expected test output"):
        _addition(tmp_path / "m", test_expected_out={"out": TEST_EXPECTED_OUT["out"] + 1})
    assert not (tmp_path / "m").exists()
    with pytest.raises(ValueError, match="Exactly one of `frozen_graph_path`, `graph_def`"):
        _addition(tmp_path / "two", trackable_obj=AdditionModule())
    with pytest.raises(ValueError, match="node_name_mapping is required"):
        _addition(tmp_path / "unmapped", node_name_mapping=None)
    with pytest.raises(ValueError):  # the path exists
        _addition(tmp_path, test_input_data=None, test_expected_out=None)


def test_unsatisfiable_platform_version_semver_is_a_runtime_error(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not checked by loading it": nothing here can run it
        path = _addition(tmp_path / "old", platform_version_semver="1.13.1", test_input_data=None,
                         test_expected_out=None)  # fmt: skip
    with pytest.raises(RuntimeError):
        load_neuropod(str(path))
    with pytest.raises(RuntimeError):  # the packager's own check loads it, and fails the same way
        _addition(tmp_path / "checked", platform_version_semver="1.13.1")
    assert not (tmp_path / "checked").exists()


@pytest.mark.parametrize(
    "inputs",
    [
        {"x": np.arange(3, dtype=np.float64), "y": np.arange(3, dtype=np.float32)},  # wrong dtype
        {"x": np.zeros((3, 1), np.float32), "y": np.zeros(3, np.float32)},  # wrong rank
        {"x": np.zeros(3, np.float32), "y": np.zeros(4, np.float32)},  # num_inputs differs
        {"x": np.zeros(3, np.float32), "z": np.zeros(3, np.float32)},  # not in the spec
    ],
    ids=["dtype", "rank", "symbol", "unknown"],
)
def test_inference_errors_are_runtime_errors(tmp_path: Path, inputs: dict[str, np.ndarray]) -> None:
    neuropod = load_neuropod(str(_addition(tmp_path / "m")))
    with pytest.raises(RuntimeError):
        neuropod.infer(inputs)


# --- TensorFlow 2: trackable objects and SavedModels -----------------------------------------


@pytest.mark.parametrize("source", ["trackable_obj", "saved_model_dir"])
def test_tf2_addition_model(tmp_path: Path, source: str) -> None:
    module = AdditionModule()
    model: dict[str, Any] = {"trackable_obj": module}
    if source == "saved_model_dir":
        tf.saved_model.save(module, str(tmp_path / "saved"))
        model = {"saved_model_dir": str(tmp_path / "saved")}
    create_tensorflow_neuropod(
        neuropod_path=str(tmp_path / "m"), model_name="addition_model", **model, **ADDITION_SPEC,
        test_input_data=TEST_INPUT_DATA, test_expected_out=TEST_EXPECTED_OUT,
    )  # fmt: skip
    neuropod = load_neuropod(str(tmp_path / "m"))
    assert neuropod.outputs == ADDITION_SPEC["output_spec"]
    x = np.linspace(0, 1, 4, dtype=np.float32)
    np.testing.assert_allclose(neuropod.infer({"x": x, "y": 2 * x})["out"], 3 * x, rtol=1e-6)


def test_tf2_spec_that_does_not_match_the_signature_is_a_value_error(tmp_path: Path) -> None:
    only_x = {**ADDITION_SPEC, "input_spec": ADDITION_SPEC["input_spec"][:1]}
    with pytest.raises(ValueError, match="The supplied SavedModel expects inputs that are not in the spec: 'y'"):
        create_tensorflow_neuropod(neuropod_path=str(tmp_path / "m"), model_name="m", trackable_obj=AdditionModule(),
                                   **only_x)  # fmt: skip
    other_out = {**ADDITION_SPEC, "output_spec": [{"name": "sum", "dtype": "float32", "shape": (None,)}]}
    with pytest.raises(ValueError, match="The supplied SavedModel does not return the following outputs in the spec"):
        create_tensorflow_neuropod(neuropod_path=str(tmp_path / "m"), model_name="m", trackable_obj=AdditionModule(),
                                   **other_out)  # fmt: skip
    assert not (tmp_path / "m").exists()


# --- Keras -------------------------------------------------------------------------------


def keras_addition_model(names: dict[str, str] | None = None) -> Any:
    names = names or {"x": "x", "y": "y", "out": "out"}
    x = tf.keras.Input(batch_shape=(None,), name=names["x"])
    y = tf.keras.Input(batch_shape=(None,), name=names["y"])
    out = tf.keras.layers.Add(name=names["out"])([x, y])
    return tf.keras.Model(inputs=[x, y], outputs=[out])


KERAS_SPEC = {
    "input_spec": [
        {"name": "x", "dtype": "float32", "shape": ("batch_size",)},
        {"name": "y", "dtype": "float32", "shape": ("batch_size",)},
    ],
    "output_spec": [{"name": "out", "dtype": "float32", "shape": ("batch_size",)}],
}


@pytest.mark.parametrize("aliased", [False, True], ids=["keras names", "node_name_mapping"])
def test_keras_addition_model_with_sess_none(tmp_path: Path, aliased: bool) -> None:
    mapping = {"x": "x_", "y": "y_", "out": "out_"} if aliased else None
    model = keras_addition_model(mapping)
    create_keras_neuropod(
        neuropod_path=str(tmp_path / "m"), model_name="addition_model", sess=None, model=model,
        node_name_mapping=mapping, **KERAS_SPEC, test_input_data=TEST_INPUT_DATA, test_expected_out=TEST_EXPECTED_OUT,
    )  # fmt: skip
    neuropod = load_neuropod(str(tmp_path / "m"))
    assert neuropod.inputs == KERAS_SPEC["input_spec"] and neuropod.outputs == KERAS_SPEC["output_spec"]
    np.testing.assert_array_equal(neuropod.infer({"x": np.ones(2, np.float32), "y": np.ones(2, np.float32)})["out"], [2, 2])
    with pytest.raises(ValueError):
        create_keras_neuropod(
            neuropod_path=str(tmp_path / "wrong"), model_name="addition_model", sess=None, model=model,
            node_name_mapping=mapping, **KERAS_SPEC, test_input_data=TEST_INPUT_DATA,
            test_expected_out={"out": TEST_EXPECTED_OUT["out"] + 1},
        )  # fmt: skip


def test_keras_positional_sess_and_model_and_inferred_spec(tmp_path: Path) -> None:
    model = keras_addition_model()
    assert infer_keras_input_spec(model) == KERAS_SPEC["input_spec"]
    assert infer_keras_output_spec(model) == KERAS_SPEC["output_spec"]
    mapping = {"a": "x", "b": "y", "total": "out"}
    assert infer_keras_input_spec(model, mapping) == [
        {"name": "a", "dtype": "float32", "shape": ("batch_size",)},
        {"name": "b", "dtype": "float32", "shape": ("batch_size",)},
    ]
    create_keras_neuropod(str(tmp_path / "m"), "addition_model", None, model)  # spec inferred
    neuropod = load_neuropod(str(tmp_path / "m"))
    assert neuropod.inputs == KERAS_SPEC["input_spec"]
    np.testing.assert_array_equal(neuropod.infer({"x": np.ones(2, np.float32), "y": np.ones(2, np.float32)})["out"], [2, 2])


def test_keras_refuses_a_session(tmp_path: Path) -> None:
    """A Keras 3 model is not bound to a session: sess=None is the only value, and a session says so."""
    session = tf.compat.v1.Session()
    try:
        with pytest.raises(ValueError, match="pass sess=None"):
            create_keras_neuropod(neuropod_path=str(tmp_path / "m"), model_name="m", sess=session,
                                  model=keras_addition_model(), **KERAS_SPEC)  # fmt: skip
    finally:
        session.close()
    assert not (tmp_path / "m").exists()


# --- strings and scalars -------------------------------------------------------------------


class StringsModule(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="x"), tf.TensorSpec([None], tf.string, name="y")])
    def __call__(self, x: Any, y: Any) -> dict[str, Any]:
        return {"out": tf.strings.join([x, y], separator=" ")}


@pytest.mark.parametrize("kind", ["graph", "tf2"])
def test_string_concat_model(tmp_path: Path, kind: str) -> None:
    if kind == "graph":
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.string, [None], name="x")
            y = tf.compat.v1.placeholder(tf.string, [None], name="y")
            tf.strings.join([x, y], separator=" ", name="out")
        model: dict[str, Any] = {"graph_def": graph.as_graph_def(), "node_name_mapping": {"x": "x", "y": "y", "out": "out"}}
    else:
        model = {"trackable_obj": StringsModule()}
    create_tensorflow_neuropod(
        neuropod_path=str(tmp_path / "m"), model_name="strings_model", **model, **STRING_SPEC,
        test_input_data={"x": WORDS_X, "y": WORDS_Y}, test_expected_out={"out": CONCATENATED},
    )  # fmt: skip
    out = load_neuropod(str(tmp_path / "m")).infer({"x": WORDS_X, "y": WORDS_Y})["out"]
    assert out.dtype.kind == "U" and out.tolist() == CONCATENATED.tolist()


class ScalarModule(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([], tf.float32, name="x"), tf.TensorSpec([], tf.float32, name="y")])
    def __call__(self, x: Any, y: Any) -> dict[str, Any]:
        return {"out": x * y}


@pytest.mark.parametrize("kind", ["graph", "tf2"])
def test_scalars(tmp_path: Path, kind: str) -> None:
    if kind == "graph":
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [], name="x")
            y = tf.compat.v1.placeholder(tf.float32, [], name="y")
            tf.multiply(x, y, name="out")
        model: dict[str, Any] = {"graph_def": graph.as_graph_def(), "node_name_mapping": {"x": "x", "y": "y", "out": "out"}}
    else:
        model = {"trackable_obj": ScalarModule()}
    spec = {
        "input_spec": [{"name": "x", "dtype": "float32", "shape": ()}, {"name": "y", "dtype": "float32", "shape": ()}],
        "output_spec": [{"name": "out", "dtype": "float32", "shape": ()}],
    }
    create_tensorflow_neuropod(
        neuropod_path=str(tmp_path / "m"), model_name="scalars", **model, **spec,
        test_input_data={"x": np.float32(3), "y": np.array(4, np.float32)}, test_expected_out={"out": np.float32(12)},
    )  # fmt: skip
    neuropod = load_neuropod(str(tmp_path / "m"))
    assert neuropod.inputs[0] == {"name": "x", "dtype": "float32", "shape": ()}
    out = neuropod.infer({"x": np.float32(1.5), "y": np.float32(2)})["out"]
    assert isinstance(out, np.ndarray) and out.shape == () and out.dtype == np.float32 and out == 3
    with pytest.raises(RuntimeError):
        neuropod.infer({"x": np.ones(1, np.float32), "y": np.float32(2)})


# --- custom ops ------------------------------------------------------------------------------

CUSTOM_OP_USER = r"""
import os, sys, warnings
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
from neuropod.loader import load_neuropod
from neuropod.packagers import create_tensorflow_neuropod

lib, out_path = sys.argv[1:3]
ops = tf.load_op_library(lib)  # loaded to build the model, as the original's users did
graph = tf.Graph()
with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
    ops.compat_double_plus_three(x, name="y")
x = np.array([0, 1, 2.5], np.float32)
with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)  # no fallback to a worker process: this process runs it
    create_tensorflow_neuropod(
        neuropod_path=out_path, model_name="custom_op_model", graph_def=graph.as_graph_def(),
        node_name_mapping={"x": "x", "y": "y"}, custom_ops=[lib],
        input_spec=[{"name": "x", "dtype": "float32", "shape": (None,)}],
        output_spec=[{"name": "y", "dtype": "float32", "shape": (None,)}],
        test_input_data={"x": x}, test_expected_out={"y": x * 2 + 3},
    )
    neuropod = load_neuropod(out_path)
    print("OUT", neuropod.infer({"x": x})["y"].tolist())
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the custom op")
def test_custom_op_loaded_before_packaging(tmp_path: Path) -> None:
    """The original's workflow: load the op library, build the model with it, package it with
    ``custom_ops=[that library]``, load the package in the same process. In a subprocess:
    a second registration of an op could take the process down."""
    lib = tmp_path / "libcompat_double_plus_three.so"
    cmd = ["g++", "-shared", "-fPIC", "-O1", "-w", "-std=c++17", str(HERE / "tensorflow_custom_op.cc"), "-o", str(lib)]
    subprocess.run(cmd + tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags(), check=True, timeout=600)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CUSTOM_OP_USER), str(lib), str(tmp_path / "pkg")],
        capture_output=True, text=True, timeout=400, env=env,
    )  # fmt: skip
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "OUT [3.0, 5.0, 8.0]" in done.stdout.splitlines()
    assert (tmp_path / "pkg" / "0" / "ops" / lib.name).read_bytes() == lib.read_bytes()
