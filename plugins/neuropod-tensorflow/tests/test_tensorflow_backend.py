"""The TensorFlow backend end to end: frozen graphs, SavedModels, Keras, the original packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import importlib_metadata
import numpy as np
import pytest
import tensorflow as tf

import neuropod
from neuropod import plugins
from neuropod.errors import NeuropodError, NoBackendError, PackageError, SpecError
from neuropod.package import read_package
from neuropod.packagers import create_keras_neuropod, create_tensorflow_neuropod
from neuropod.testing import run_in_threads
from neuropod_tensorflow._runtime import load
from neuropod_tensorflow.packager import infer_keras_input_spec, infer_keras_output_spec

import models
from conftest import FIXTURES, needs_fixtures, spec


def _installed_tf() -> tuple[str, str]:
    for dist in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly", "tf-nightly-cpu"):
        try:
            return dist, importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            continue
    raise RuntimeError("no TensorFlow distribution is installed")


TF_DIST, TF_VERSION = _installed_tf()
XY = spec(("x", "float32", ["batch", 2]), ("y", "float32", ["batch", 2]))
OUT = spec(("out", "float32", ["batch", 2]), ("doubled", "float32", ["batch", 2]))


def xy(batch: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    return {n: rng.standard_normal((batch, 2)).astype(np.float32) for n in ("x", "y")}


def frozen_adder(tmp_path: Path, **kwargs) -> Path:  # type: ignore[no-untyped-def]
    return create_tensorflow_neuropod(
        tmp_path / "adder.neuropod", "adder", XY, OUT, node_name_mapping=models.ADDER_MAPPING,
        graph_def=models.adder_graph_def(), **kwargs,
    )


# --- discovery --------------------------------------------------------------


def test_found_with_the_distribution_that_provides_tensorflow() -> None:
    (backend,) = [b for b in plugins.installed_backends() if b.platform == "tensorflow"]
    assert (backend.framework, backend.version) == (TF_DIST, TF_VERSION)
    assert backend.version.split("+")[0] == tf.__version__.split("+")[0]


def test_discovery_does_not_import_tensorflow() -> None:
    code = (
        "import sys, neuropod.plugins as p\n"
        "b = [b for b in p.installed_backends() if b.platform == 'tensorflow'][0]\n"
        "print(p.backend_caps(b).gpu)\n"
        "assert 'tensorflow' not in sys.modules, 'discovery imported tensorflow'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == str(tf.test.is_built_with_cuda()), "build_info.py read as text agrees with TensorFlow itself"


# --- frozen graphs ----------------------------------------------------------------


def test_frozen_graph_with_shared_symbol_and_requested_outputs(tmp_path: Path) -> None:
    inputs = xy(3)
    total = inputs["x"] + inputs["y"]
    path = frozen_adder(tmp_path, test_input_data=inputs, test_expected_out={"out": total, "doubled": total * 2})
    backend_config = json.loads((path / "0" / "config.json").read_text())
    assert backend_config["node_name_mapping"] == models.ADDER_MAPPING
    config = json.loads((path / "config.json").read_text())
    assert config["exported_with"]["platform_version"] == TF_VERSION
    with neuropod.load_neuropod(path) as model:
        out = model.infer(inputs)
        np.testing.assert_allclose(out["out"], total, rtol=1e-6)
        np.testing.assert_allclose(out["doubled"], total * 2, rtol=1e-6)
        assert list(model.infer(inputs, requested_outputs=["doubled"])) == ["doubled"]
        with pytest.raises(SpecError, match=r"symbol 'batch' should be the same size.*expected to be of size 3 \(from tensor 'x'\), but was of size 1"):
            model.infer({"x": inputs["x"], "y": np.zeros((1, 2), np.float32)})


def test_frozen_graph_strings(tmp_path: Path) -> None:
    path = create_tensorflow_neuropod(
        tmp_path / "s", "strings", spec(("a", "string", ["n"]), ("b", "string", ["n"])),
        spec(("joined", "string", ["n"])), node_name_mapping=models.STRINGS_MAPPING,
        graph_def=models.adder_graph_def(),
    )
    with neuropod.load_neuropod(path) as model:
        out = model.infer({"a": np.array(["apple", "banana"]), "b": np.array(["sauce", "pudding"], dtype=object)})
    assert out["joined"].dtype.kind == "U" and out["joined"].tolist() == ["apple sauce", "banana pudding"]


def test_frozen_graph_from_a_file_and_as_zip(tmp_path: Path) -> None:
    pb = tmp_path / "graph.pb"
    pb.write_bytes(models.adder_graph_def().SerializeToString())
    path = create_tensorflow_neuropod(
        tmp_path / "adder.zip", "adder", XY, OUT, node_name_mapping=models.ADDER_MAPPING, frozen_graph_path=pb,
        package_as_zip=True,
    )
    inputs = xy()
    with neuropod.load_neuropod(path, intra_op_num_threads=1, inter_op_num_threads=1) as model:
        np.testing.assert_allclose(model.infer(inputs)["out"], inputs["x"] + inputs["y"], rtol=1e-6)


def test_node_missing_from_the_graph(tmp_path: Path) -> None:
    for kind, mapping, message in [
        ("input", {**models.ADDER_MAPPING, "x": "in/typo"}, "input 'x' maps to 'in/typo:0'.*placeholders: in/x, in/y, in/a, in/b"),
        ("output", {**models.ADDER_MAPPING, "out": "out/nope"}, "output 'out' maps to 'out/nope:0'.*out/total"),
    ]:  # fmt: skip
        with pytest.raises(SpecError, match=message):
            create_tensorflow_neuropod(
                tmp_path / kind, "adder", XY, OUT, node_name_mapping=mapping, graph_def=models.adder_graph_def()
            )
        assert not (tmp_path / kind).exists(), "a package that cannot load is not kept"
    with pytest.raises(PackageError, match="node_name_mapping has no entry for output 'doubled'"):
        create_tensorflow_neuropod(
            tmp_path / "partial", "adder", XY, OUT, node_name_mapping={"x": "in/x", "y": "in/y", "out": "out/total"},
            graph_def=models.adder_graph_def(),
        )


def test_init_op_names_as_a_str_or_a_list(tmp_path: Path) -> None:
    x = np.array([1, 2], np.float32)
    for i, names in enumerate(["init", ["init"]]):
        path = create_tensorflow_neuropod(
            tmp_path / str(i), "counter", spec(("x", "float32", [None])), spec(("out", "float32", [None])),
            node_name_mapping={"x": "x", "out": "out"}, graph_def=models.counter_graph_def(), init_op_names=names,
            test_input_data={"x": x}, test_expected_out={"out": x * 2},
        )  # fmt: skip
        assert json.loads((path / "0" / "config.json").read_text())["init_op_names"] == ["init"]
    with pytest.raises(PackageError, match="init_op_names must be op names"):
        create_tensorflow_neuropod(tmp_path / "bad", "c", spec(("x", "float32", [None])), spec(("out", "float32", [None])),
                                   node_name_mapping={"x": "x", "out": "out"}, graph_def=models.counter_graph_def(),
                                   init_op_names=["init", ""])  # fmt: skip


def test_packager_keywords_of_the_original(tmp_path: Path) -> None:
    inputs = xy(2)
    total = inputs["x"] + inputs["y"]
    expected = {"out": total, "doubled": total * 2}
    path = frozen_adder(tmp_path, package_as_zip=True, zip_compression=zipfile.ZIP_STORED, persist_test_data=False,
                        test_input_data=inputs, test_expected_out=expected, neuropod_load_args={"intra_op_num_threads": 1})  # fmt: skip
    with zipfile.ZipFile(path) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
        assert not [n for n in zf.namelist() if n.startswith("test_data")], "persist_test_data=False"
    # The test data is still checked when it is not kept, with neuropod_load_args given to load_neuropod.
    with pytest.raises(ValueError, match="does not reproduce its expected test output"):
        create_tensorflow_neuropod(tmp_path / "wrong", "adder", XY, OUT, node_name_mapping=models.ADDER_MAPPING,
                                   graph_def=models.adder_graph_def(), persist_test_data=False,
                                   test_input_data=inputs, test_expected_out={"out": total + 1})  # fmt: skip
    with pytest.raises(NeuropodError, match="Unknown TensorFlow load option.*'threads'"):
        create_tensorflow_neuropod(tmp_path / "args", "adder", XY, OUT, node_name_mapping=models.ADDER_MAPPING,
                                   graph_def=models.adder_graph_def(), neuropod_load_args={"threads": 1})  # fmt: skip
    assert not (tmp_path / "wrong").exists() and not (tmp_path / "args").exists()


# --- SavedModels and Keras ---------------------------------------------------------------


def test_saved_model_through_serving_default(tmp_path: Path) -> None:
    x, shift = np.array([1, 2, 3], np.float32), np.array([0.5, 0.5, 0.5], np.float32)
    path = create_tensorflow_neuropod(
        tmp_path / "scaler", "scaler", spec(("x", "float32", ["n"]), ("shift", "float32", ["n"])),
        spec(("y", "float32", ["n"]), ("label", "string", ["n"])), trackable_obj=models.Scaler(),
        test_input_data={"x": x, "shift": shift}, test_expected_out={"y": x * 3 + shift},
    )
    assert (path / "0" / "data" / "savedmodel" / "saved_model.pb").is_file()
    with neuropod.load_neuropod(path) as model:
        out = model.infer({"x": x, "shift": shift})
        np.testing.assert_allclose(out["y"], x * 3 + shift)
        assert out["label"].dtype.kind == "U" and [float(v) for v in out["label"]] == [1.0, 2.0, 3.0]
        assert list(model.infer({"x": x, "shift": shift}, requested_outputs=["y"])) == ["y"]
        with pytest.raises(SpecError, match="needs input\\(s\\) 'shift'"):
            model.infer({"x": x})


def test_saved_model_dir_and_signature_problems(tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    tf.saved_model.save(models.Scaler(), str(saved))
    in_spec = spec(("x", "float32", ["n"]), ("shift", "float32", ["n"]))
    path = create_tensorflow_neuropod(tmp_path / "ok", "scaler", in_spec, spec(("y", "float32", ["n"])), saved_model_dir=saved)
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_allclose(model.infer({"x": np.ones(2, np.float32), "shift": np.zeros(2, np.float32)})["y"], [3, 3])
    with pytest.raises(ValueError, match="input keys do not match the input spec. The supplied SavedModel is missing the "
                       "following inputs in the spec: 'bias'. The supplied SavedModel expects inputs that are not in "
                       "the spec: 'shift'. Signature keys: 'shift', 'x'"):  # fmt: skip
        create_tensorflow_neuropod(tmp_path / "keys", "scaler", spec(("x", "float32", ["n"]), ("bias", "float32", ["n"])),
                                   spec(("y", "float32", ["n"])), saved_model_dir=saved)  # fmt: skip
    with pytest.raises(PackageError, match="output keys do not match.*does not return the following outputs in the spec: 'z'"):
        create_tensorflow_neuropod(tmp_path / "out", "scaler", in_spec, spec(("z", "float32", ["n"])), saved_model_dir=saved)
    other = models.save_without_serving_default(tmp_path / "other")
    with pytest.raises(PackageError, match="has no 'serving_default' signature \\(it has: 'other'\\)"):
        create_tensorflow_neuropod(tmp_path / "nosig", "m", spec(("x", "float32", [None])),
                                   spec(("y", "float32", [None])), saved_model_dir=other)  # fmt: skip
    assert not any((tmp_path / n).exists() for n in ("keys", "out", "nosig"))


@pytest.mark.parametrize("kind", ["frozen graph", "saved model"])
def test_scalar_inputs_and_outputs(tmp_path: Path, kind: str) -> None:
    source = {"graph_def": models.scalar_graph_def(), "node_name_mapping": {n: n for n in ("x", "scaled", "text")}}
    if kind == "saved model":
        source = {"trackable_obj": models.ScalarModule()}
    out_spec = spec(("scaled", "float32", []), ("text", "string", []))
    path = create_tensorflow_neuropod(
        tmp_path / "scalar", "scalar", spec(("x", "float32", [])), out_spec, **source,  # type: ignore[arg-type]
        test_input_data={"x": np.float32(2)}, test_expected_out={"scaled": np.float32(5), "text": "2.0"},
    )  # fmt: skip
    # The backend itself gives 0-d arrays, not the numpy scalars TensorFlow returns.
    handle = load(read_package(path), "cpu", {})
    try:
        raw = handle.run({"x": np.array(4, np.float32)}, None)
    finally:
        handle.close()
    assert [type(v) for v in raw.values()] == [np.ndarray, np.ndarray]
    with neuropod.load_neuropod(path) as model:
        for x in (np.array(4, np.float32), np.float32(4)):
            out = model.infer({"x": x})
            assert type(out["scaled"]) is np.ndarray and out["scaled"].shape == () and out["scaled"] == 10
            assert type(out["text"]) is np.ndarray and out["text"].shape == () and out["text"].item() == "4.0"
        with pytest.raises(SpecError, match="expected to have 0 dimensions, but had 1"):
            model.infer({"x": np.ones(1, np.float32)})


def test_keras_model_with_inferred_spec(tmp_path: Path) -> None:
    keras = models.keras_model()
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    expected = keras(x, training=False).numpy()
    path = create_keras_neuropod(tmp_path / "keras", "keras", keras, test_input_data={"features": x},
                                 test_expected_out={"scores": expected})  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    assert config["input_spec"] == [{"name": "features", "dtype": "float32", "shape": ["batch_size", 4]}]
    assert config["output_spec"] == [{"name": "scores", "dtype": "float32", "shape": ["batch_size", 2]}]
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_allclose(model.infer({"features": x})["scores"], expected, rtol=1e-5, atol=1e-6)


def test_keras_node_name_mapping_and_the_original_call_styles(tmp_path: Path) -> None:
    model = models.keras_two_in_two_out()
    a, b = np.full((1, 2), 5, np.float32), np.ones((1, 2), np.float32)
    mapping = {"left": "a", "right": "b", "plus": "sum", "minus": "diff"}
    assert infer_keras_input_spec(model, mapping) == [
        {"name": "left", "dtype": "float32", "shape": ("batch_size", 2)},
        {"name": "right", "dtype": "float32", "shape": ("batch_size", 2)},
    ]
    assert infer_keras_output_spec(model) == [
        {"name": "diff", "dtype": "float32", "shape": ("batch_size", 2)},
        {"name": "sum", "dtype": "float32", "shape": ("batch_size", 2)},
    ]
    expected = {"plus": a + b, "minus": a - b}
    calls = {
        "positional sess": lambda p: create_keras_neuropod(p, "m", None, model, mapping),
        "keywords": lambda p: create_keras_neuropod(neuropod_path=p, model_name="m", sess=None, model=model,
                                                    node_name_mapping=mapping),
        "ours": lambda p: create_keras_neuropod(p, "m", model, node_name_mapping=mapping),
    }  # fmt: skip
    for i, (style, call) in enumerate(calls.items()):
        path = call(tmp_path / str(i))
        with neuropod.load_neuropod(path) as m:
            assert [s["name"] for s in m.inputs] == ["left", "right"], style
            out = m.infer({"left": a, "right": b})
            assert out.keys() == expected.keys(), style
            for name in expected:
                np.testing.assert_array_equal(out[name], expected[name])
    # Only the outputs the spec names; the spec's own names map to the model's.
    path = create_keras_neuropod(tmp_path / "subset", "m", model=model, node_name_mapping={**mapping, "d": "diff"},
                                 output_spec=[{"name": "d", "dtype": "float32", "shape": [None, 2]}],
                                 test_input_data={"left": a, "right": b}, test_expected_out={"d": a - b})  # fmt: skip
    assert json.loads((path / "config.json").read_text())["output_spec"][0]["name"] == "d"


def test_keras_specs_keep_unknown_dims_and_dtypes(tmp_path: Path) -> None:
    # Sequences of any length, integer ids and text: the spec says what each Keras input and
    # output tensor says, the first dim named "batch_size" and every other unknown dim None.
    seq = tf.keras.Input((None, 3), name="seq")
    ids = tf.keras.Input((), dtype="int32", name="ids")
    words = tf.keras.Input((2,), dtype="string", name="words")
    pooled = tf.keras.layers.GlobalAveragePooling1D(name="pooled")(tf.keras.layers.Dense(4, name="proj")(seq))
    same_ids = tf.keras.layers.Identity(name="same_ids")(ids)
    model = tf.keras.Model([seq, ids, words], [pooled, same_ids])

    def from_tensors(names: list[str], tensors: list[object]) -> list[dict[str, object]]:
        return [{"name": n, "dtype": t.dtype, "shape": ("batch_size", *t.shape[1:])}  # type: ignore[attr-defined]
                for n, t in zip(names, tensors)]  # fmt: skip

    from neuropod.backends.keras.packager import infer_keras_input_spec as original_input_spec
    from neuropod.backends.keras.packager import infer_keras_output_spec as original_output_spec

    inferred_in, inferred_out = original_input_spec(model), original_output_spec(model)
    assert inferred_in == from_tensors(["seq", "ids", "words"], model.inputs)
    assert inferred_out == from_tensors(["pooled", "same_ids"], model.outputs)
    assert [s["shape"] for s in inferred_in] == [("batch_size", None, 3), ("batch_size",), ("batch_size", 2)]
    assert [s["dtype"] for s in inferred_in + inferred_out] == ["float32", "int32", "string", "float32", "int32"]
    # Packaged with those specs, it takes sequences of any length.
    numbers = tf.keras.Model([seq, ids], [pooled, same_ids])
    path = create_keras_neuropod(tmp_path / "seq", "seq", None, numbers)
    config = json.loads((path / "config.json").read_text())
    assert config["input_spec"] == [{**s, "shape": list(s["shape"])} for s in inferred_in[:2]]
    with neuropod.load_neuropod(path) as m:
        for length in (1, 5):
            x = np.random.default_rng(length).standard_normal((2, length, 3)).astype(np.float32)
            i = np.array([3, -4], np.int32)
            out = m.infer({"seq": x, "ids": i})
            want = numbers([x, i], training=False)
            np.testing.assert_allclose(out["pooled"], want[0].numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(out["same_ids"], i)


def test_sequential_keras_model(tmp_path: Path) -> None:
    model = tf.keras.Sequential([tf.keras.Input((3,), name="features"), tf.keras.layers.Dense(2, name="logits")])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert infer_keras_output_spec(model) == [{"name": "logits", "dtype": "float32", "shape": ("batch_size", 2)}]
    create_keras_neuropod(tmp_path / "seq", "seq", model, test_input_data={"features": x},
                          test_expected_out={"logits": model(x).numpy()})  # fmt: skip


def test_keras_argument_errors(tmp_path: Path) -> None:
    model = models.keras_model()
    session = tf.compat.v1.Session()
    try:
        with pytest.raises(PackageError, match="got a TensorFlow session as sess.*pass sess=None"):
            create_keras_neuropod(tmp_path / "s", "m", session, model)
    finally:
        session.close()
    with pytest.raises(PackageError, match="got a Keras model as sess .*and model= too"):
        create_keras_neuropod(tmp_path / "s", "m", model, model)
    with pytest.raises(PackageError, match="needs model="):
        create_keras_neuropod(tmp_path / "s", "m")
    with pytest.raises(ValueError, match="Input x is not in model inputs. The model's inputs: 'features'"):
        create_keras_neuropod(tmp_path / "s", "m", model, input_spec=spec(("x", "float32", [None, 4])))
    with pytest.raises(ValueError, match="Output y is not mapped in node_name_mapping"):
        create_keras_neuropod(tmp_path / "s", "m", model, node_name_mapping={"x": "features", "out": "scores"},
                              output_spec=spec(("y", "float32", [None, 2])))  # fmt: skip
    with pytest.raises(ValueError, match="Input x mapped to scores is not in model inputs"):
        create_keras_neuropod(tmp_path / "s", "m", model, node_name_mapping={"x": "scores", "out": "scores"},
                              input_spec=spec(("x", "float32", [None, 4])))  # fmt: skip
    with pytest.raises(ValueError, match="maps 'x' to 'nope', which is neither a Keras input name nor a Keras output"):
        create_keras_neuropod(tmp_path / "s", "m", model, node_name_mapping={"x": "nope", "out": "scores"})
    with pytest.raises(ValueError, match="Keras input/output layer scores is not covered by node_name_mapping"):
        infer_keras_output_spec(model, {"x": "features"})
    two = models.keras_two_in_two_out()
    with pytest.raises(PackageError, match="does not feed the Keras model's input\\(s\\) 'b'"):
        create_keras_neuropod(tmp_path / "s", "m", two, input_spec=spec(("a", "float32", [None, 2])))
    assert not (tmp_path / "s").exists()


# --- the original Neuropod packages ----------------------------------------------------


@needs_fixtures
def test_original_addition_and_strings_packages() -> None:
    with neuropod.load_neuropod(FIXTURES / "tf_addition_model") as m:
        out = m.infer({"x": np.array([[1, 2], [3, 4]], np.float32), "y": np.array([[7, 8], [9, 10]], np.float32)})
        np.testing.assert_array_equal(out["out"], [[8, 10], [12, 14]])
    with neuropod.load_neuropod(FIXTURES / "tf_strings_model") as m:
        out = m.infer({"x": np.array(["apple", "banana", "carrot"]), "y": np.array(["sauce", "pudding", "cake"])})
        assert out["out"].tolist() == ["apple sauce", "banana pudding", "carrot cake"]


@needs_fixtures
def test_original_object_detection_package() -> None:
    image = np.random.default_rng(0).integers(0, 255, (1200, 1920, 3), dtype=np.uint8)
    with neuropod.load_neuropod(FIXTURES / "dummy_object_detection") as m:
        out = m.infer({"image": image})
        with pytest.raises(SpecError, match="Dim 0 of tensor .image. in the input spec is expected to be of size 1200, but was of size 600"):
            m.infer({"image": image[:600]})
    boxes, probs = out["boxes"], out["object_class_probability"]
    assert boxes.dtype == np.float32 and boxes.ndim == 2 and boxes.shape[1] == 4
    assert probs.shape[0] == boxes.shape[0], "one num_detections across both outputs"
    assert probs.shape == (28, 67)


@needs_fixtures
def test_original_many_small_inputs_package() -> None:
    inputs = {f"small_input{i}": np.full((10, 5), i, np.float32) for i in range(100)}
    with neuropod.load_neuropod(FIXTURES / "dummy_small_input_model") as m:
        out = m.infer(inputs)
        config = json.loads((FIXTURES / "dummy_small_input_model" / "config.json").read_text())
        assert set(out) == {o["name"] for o in config["output_spec"]}
        assert all(v.dtype == np.float32 for v in out.values())


# --- resolution, options, errors --------------------------------------------------------


def test_range_that_excludes_the_installed_tensorflow(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="not checked by loading it"):
        path = frozen_adder(tmp_path, platform_version_semver="<2.0")
    with pytest.raises(NoBackendError) as info:
        neuropod.load_neuropod(path)
    assert f"version {TF_VERSION} is not in '<2.0'" in str(info.value)


def test_gpu_on_a_machine_without_one(tmp_path: Path) -> None:
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU is available here")
    path = frozen_adder(tmp_path)
    with pytest.raises(NoBackendError, match="device='cuda:0' was requested"):
        neuropod.load_neuropod(path, device="cuda:0")


def test_caller_thread_and_pool_give_the_same_results(tmp_path: Path) -> None:
    path = frozen_adder(tmp_path)
    inputs = xy(4)
    with neuropod.load_neuropod(path) as caller, neuropod.load_neuropod(path, inter_op_thread_pool="pool") as pool:
        for outputs in (None, ["doubled"]):
            a, b = caller.infer(inputs, outputs), pool.infer(inputs, outputs)
            assert a.keys() == b.keys()
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])

        def work(batch: int) -> None:  # several threads on one caller-thread session
            for _ in range(50):
                data = xy(batch)
                np.testing.assert_allclose(caller.infer(data)["out"], data["x"] + data["y"], rtol=1e-6)

        run_in_threads(lambda i: work(i + 1), 4)
    with pytest.raises(NeuropodError, match="inter_op_thread_pool must be 'caller' or 'pool', not 'both'"):
        neuropod.load_neuropod(path, inter_op_thread_pool="both")


def test_load_options_and_argument_errors(tmp_path: Path) -> None:
    path = frozen_adder(tmp_path)
    with pytest.raises(NeuropodError, match="Unknown TensorFlow load option.*'threads'"):
        neuropod.load_neuropod(path, threads=1)
    # ValueErrors, as the original Neuropod raised, with its words.
    with pytest.raises(PackageError, match="Exactly one of `frozen_graph_path`, .* must be provided: .* got 0"):
        create_tensorflow_neuropod(tmp_path / "x", "x", XY, OUT)
    with pytest.raises(ValueError, match="node_name_mapping is required when using `frozen_graph_path` or `graph_def`"):
        create_tensorflow_neuropod(tmp_path / "x", "x", XY, OUT, graph_def=models.adder_graph_def())
    with pytest.raises(ValueError, match="node_name_mapping is for frozen graphs"):
        create_tensorflow_neuropod(tmp_path / "x", "x", XY, OUT, node_name_mapping={"x": "a"}, saved_model_dir=tmp_path)
    with pytest.raises(PackageError, match="is not a SavedModel"):
        create_tensorflow_neuropod(tmp_path / "x", "x", XY, OUT, saved_model_dir=tmp_path)


def test_tensorflow_stays_quiet(tmp_path: Path) -> None:
    """Loading and running print nothing on stderr unless the user asks for TensorFlow's logs."""
    path = frozen_adder(tmp_path)
    code = (
        "import sys, numpy as np, neuropod\n"
        f"m = neuropod.load_neuropod({str(path)!r})\n"
        "m.infer({'x': np.ones((1, 2), np.float32), 'y': np.ones((1, 2), np.float32)})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert quiet.stderr.strip() == ""
    loud = subprocess.run([sys.executable, "-c", code], env={**env, "TF_CPP_MIN_LOG_LEVEL": "0"},
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert loud.stderr.strip() != "", "asked for, TensorFlow's log lines come through"
