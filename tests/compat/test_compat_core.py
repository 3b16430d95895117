"""Code written for the original Neuropod (0.3), run against ours: the framework-neutral surface.

Models are small ONNX graphs built here (onnxruntime is the lightest
framework); the TorchScript and TensorFlow modules beside this one cover their
packagers. What is checked is what users' code touched: the import paths,
``model.inputs``/``outputs`` as lists of dicts, the builtin exceptions their
``except`` clauses name, the packagers' common keywords, ``load_neuropod``'s
keywords, scalars, the original's words in error messages, and its spec rule
for its own packages.
"""

from __future__ import annotations

import json
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

from neuropod.loader import load_neuropod  # noqa: E402  (the original's import path)
from neuropod.packagers import create_onnx_neuropod  # noqa: E402

ADDITION_SPEC = {
    "input_spec": [
        {"name": "x", "dtype": "float32", "shape": ("batch_size",)},
        {"name": "y", "dtype": "float32", "shape": ("batch_size",)},
    ],
    "output_spec": [{"name": "out", "dtype": "float32", "shape": ("batch_size",)}],
}


def _graph(nodes: list[Any], inputs: list[tuple[str, int, list[Any]]], outputs: list[tuple[str, int, list[Any]]]) -> Any:
    graph = helper.make_graph(
        nodes, "compat",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _adder() -> Any:
    return _graph(
        [helper.make_node("Add", ["x", "y"], ["out"])],
        [("x", TensorProto.FLOAT, ["b"]), ("y", TensorProto.FLOAT, ["b"])],
        [("out", TensorProto.FLOAT, ["b"])],
    )


def _package(path: Path, **kwargs: Any) -> Path:
    x, y = np.arange(5, dtype=np.float32), np.arange(5, dtype=np.float32)
    args: dict[str, Any] = dict(
        neuropod_path=str(path), model_name="addition_model", onnx_model=_adder(),
        test_input_data={"x": x, "y": y}, test_expected_out={"out": x + y}, **ADDITION_SPEC,
    )  # fmt: skip
    args.update(kwargs)
    create_onnx_neuropod(**args)
    return path


# --- model.inputs / outputs are the original's list of dicts ---------------------------------


def test_inputs_and_outputs_compare_and_index_as_dicts(tmp_path: Path) -> None:
    with load_neuropod(_package(tmp_path / "m")) as model:
        assert model.name == "addition_model" and model.platform == "onnx"
        # As the original's tests compared them: lists of dicts, shapes as lists (from JSON) or tuples.
        assert model.inputs == [
            {"name": "x", "dtype": "float32", "shape": ["batch_size"]},
            {"name": "y", "dtype": "float32", "shape": ("batch_size",)},
        ]
        assert model.outputs == [{"name": "out", "dtype": "float32", "shape": ["batch_size"]}]
        assert model.inputs != [{"name": "x", "dtype": "float64", "shape": ["batch_size"]}]
        first = model.inputs[0]
        assert first["name"] == "x" and first["dtype"] == "float32" and first["shape"] == ["batch_size"]
        assert dict(first) == {"name": "x", "dtype": "float32", "shape": ["batch_size"]}
        assert sorted(first) == ["dtype", "name", "shape"] and "shape" in first
        assert {s["name"]: s["shape"] for s in model.inputs} == {"x": ["batch_size"], "y": ["batch_size"]}
        with pytest.raises(KeyError):
            first["size"]
        # The list is the caller's: changing it changes nothing in the model.
        model.inputs.clear()
        assert len(model.inputs) == 2
        # Our own attributes stay.
        assert first.name == "x" and first.shape == ("batch_size",)


# --- exceptions: the builtins the original raised ---------------------------------------------


def test_wrong_expected_output_is_a_value_error_and_nothing_is_left(tmp_path: Path) -> None:
    x = np.arange(5, dtype=np.float32)
    with pytest.raises(ValueError, match="does not reproduce its expected test output"):
        _package(tmp_path / "m", test_input_data={"x": x, "y": x}, test_expected_out={"out": np.zeros(5, np.float32)})
    assert not (tmp_path / "m").exists()


def test_existing_path_is_a_value_error(tmp_path: Path) -> None:
    _package(tmp_path / "m")
    with pytest.raises(ValueError, match="already exists"):
        _package(tmp_path / "m")


def test_unsatisfiable_version_range_is_a_runtime_error(tmp_path: Path) -> None:
    # With test data the packager loads the package, as the original did: no backend fits.
    with pytest.raises(RuntimeError, match="a backend satisfying these requirements was not found"):
        _package(tmp_path / "tested", platform_version_semver="< 1.0.0")
    assert not (tmp_path / "tested").exists()
    # Without test data the package is written (for another machine), and loading it here fails.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        path = _package(tmp_path / "untested", platform_version_semver="< 1.0.0", test_input_data=None, test_expected_out=None)
    with pytest.raises(RuntimeError, match="a backend satisfying these requirements was not found"):
        load_neuropod(path)


@pytest.mark.parametrize("bad", ["not a range", "1.0.0 - ", ">=1.0.0 <"])
def test_bad_version_range_is_a_runtime_error_and_a_value_error(tmp_path: Path, bad: str) -> None:
    for kind in (RuntimeError, ValueError):
        with pytest.raises(kind):
            _package(tmp_path / f"{kind.__name__}", platform_version_semver=bad)


@pytest.mark.parametrize(
    ("inputs", "phrase"),
    [
        (
            {"x": np.zeros(2, np.float64), "y": np.zeros(2, np.float32)},
            "Tensor 'x' in the input spec is expected to be of type float32, but was of type float64",
        ),
        (
            {"x": np.zeros((2, 1), np.float32), "y": np.zeros(2, np.float32)},
            "Tensor 'x' in the input spec is expected to have 1 dimensions, but had 2",
        ),
        (
            {"x": np.zeros(2, np.float32), "y": np.zeros(3, np.float32)},
            "All dims with symbol 'batch_size' should be the same size",
        ),
        (
            {"x": np.zeros(2, np.float32), "z": np.zeros(2, np.float32)},
            "Tensor name(s) 'z' are not found in the input spec",
        ),
    ],
    ids=["dtype", "rank", "symbol", "unknown-name"],
)
def test_inference_errors_are_runtime_errors_in_the_originals_words(tmp_path: Path, inputs: Any, phrase: str) -> None:
    with load_neuropod(_package(tmp_path / "m")) as model:
        with pytest.raises(RuntimeError) as excinfo:
            model.infer(inputs)
        assert phrase in str(excinfo.value)


def test_fixed_dim_message_has_the_originals_words(tmp_path: Path) -> None:
    spec = {
        "input_spec": [{"name": "x", "dtype": "float32", "shape": (2,)}, {"name": "y", "dtype": "float32", "shape": (2,)}],
        "output_spec": [{"name": "out", "dtype": "float32", "shape": (2,)}],
    }
    x = np.ones(2, np.float32)
    path = _package(tmp_path / "m", test_input_data={"x": x, "y": x}, test_expected_out={"out": x + x}, **spec)
    phrase = r"Dim 0 of tensor 'x' in the input spec is expected to be of size 2, but was of size 3"
    with load_neuropod(path) as model, pytest.raises(RuntimeError, match=phrase):
        model.infer({"x": np.ones(3, np.float32), "y": x})


# --- the packagers' common keywords -----------------------------------------------------------


def test_package_as_zip_with_stored_members(tmp_path: Path) -> None:
    path = _package(tmp_path / "m.zip", package_as_zip=True, zip_compression=zipfile.ZIP_STORED)
    with zipfile.ZipFile(path) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
    deflated = _package(tmp_path / "d.zip", package_as_zip=True)  # the original's default compression
    with zipfile.ZipFile(deflated) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_DEFLATED}
    with load_neuropod(path) as model:
        x = np.arange(3, dtype=np.float32)
        np.testing.assert_array_equal(model.infer({"x": x, "y": x})["out"], x + x)


def test_unknown_zip_compression_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="zip_compression must be"):
        _package(tmp_path / "m.zip", package_as_zip=True, zip_compression=99)
    assert not (tmp_path / "m.zip").exists()


def test_persist_test_data_false_still_checks_the_data(tmp_path: Path) -> None:
    path = _package(tmp_path / "m", persist_test_data=False)
    assert not (path / "test_data").exists()
    x = np.arange(5, dtype=np.float32)
    with pytest.raises(ValueError, match="does not reproduce"):
        _package(tmp_path / "bad", persist_test_data=False, test_input_data={"x": x, "y": x},
                 test_expected_out={"out": x})  # fmt: skip
    assert not (tmp_path / "bad").exists()


def test_neuropod_load_args_reach_the_check(tmp_path: Path) -> None:
    _package(tmp_path / "cpu", neuropod_load_args={"visible_gpu": None})
    with pytest.raises(ValueError, match="visible_gpu must be"):
        _package(tmp_path / "bad", neuropod_load_args={"visible_gpu": "zero"})
    assert not (tmp_path / "bad").exists()


def test_original_keywords_with_their_defaults(tmp_path: Path) -> None:
    # Every common keyword of the original's packagers, spelled as it documented them.
    x = np.arange(4, dtype=np.float32)
    path = create_onnx_neuropod(
        neuropod_path=str(tmp_path / "all"), model_name="addition_model", onnx_model=_adder(),
        platform_version_semver="*", input_tensor_device={"x": "CPU"}, default_input_tensor_device="GPU",
        custom_ops=[], package_as_zip=False, test_input_data={"x": x, "y": x}, test_expected_out={"out": x + x},
        persist_test_data=True, zip_compression=zipfile.ZIP_DEFLATED, neuropod_load_args={}, **ADDITION_SPEC,
    )  # fmt: skip
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["input_tensor_device"] == {"x": "CPU", "y": "GPU"}


# --- load_neuropod's keywords -------------------------------------------------------------------


def test_visible_gpu(tmp_path: Path) -> None:
    path = _package(tmp_path / "m")
    x = np.arange(2, dtype=np.float32)
    with load_neuropod(path, visible_gpu=None) as model:
        assert model.device == "cpu"
        np.testing.assert_array_equal(model.infer({"x": x, "y": x})["out"], x + x)
    # The original's default was GPU 0, falling back to the CPU on a host without it.
    with load_neuropod(path, visible_gpu=0) as model:
        assert model.device in ("cpu", "cuda:0")
    with pytest.raises(ValueError, match="visible_gpu must be a GPU index"):
        load_neuropod(path, visible_gpu=-1)
    with pytest.raises(ValueError, match="not both"):
        load_neuropod(path, visible_gpu=0, device="cpu")


def test_load_custom_ops_flag(tmp_path: Path) -> None:
    path = _package(tmp_path / "m")
    with load_neuropod(path, load_custom_ops=True) as model:
        assert model.infer({"x": np.ones(1, np.float32), "y": np.ones(1, np.float32)})["out"][0] == 2
    with pytest.raises(TypeError, match="load_custom_ops"):
        load_neuropod(path, load_custom_ops="yes")


# --- scalars --------------------------------------------------------------------------------


def test_scalars_end_to_end(tmp_path: Path) -> None:
    model_proto = _graph(
        [helper.make_node("Mul", ["x", "y"], ["out"])],
        [("x", TensorProto.FLOAT, []), ("y", TensorProto.FLOAT, [])],
        [("out", TensorProto.FLOAT, [])],
    )
    spec = {
        "input_spec": [{"name": "x", "dtype": "float32", "shape": ()}, {"name": "y", "dtype": "float32", "shape": []}],
        "output_spec": [{"name": "out", "dtype": "float32", "shape": ()}],
    }
    x, y = np.float32(1.5), np.array(4.0, np.float32)
    path = _package(tmp_path / "m", onnx_model=model_proto, test_input_data={"x": x, "y": y},
                    test_expected_out={"out": np.float32(6.0)}, **spec)  # fmt: skip
    # The test data is stored 0-d, not as shape (1,).
    with np.load(Path(path) / "test_data" / "inputs.npz") as data:
        assert data["x"].shape == () and data["y"].shape == ()
    with np.load(Path(path) / "test_data" / "expected.npz") as data:
        assert data["out"].shape == () and data["out"] == 6.0
    with load_neuropod(path) as model:
        out = model.infer({"x": np.float32(2.0), "y": np.float32(3.0)})["out"]  # numpy scalars as inputs
        assert isinstance(out, np.ndarray) and out.shape == () and out == 6.0
        with pytest.raises(RuntimeError, match="is expected to have 0 dimensions, but had 1"):
            model.infer({"x": np.ones(1, np.float32), "y": y})


# --- the original's spec rule for its own packages ------------------------------------------------


def _doubler(path: Path) -> Path:
    """x: [n] -> y: concat(x, x) of [2n], with the spec saying y is ['n']: a symbol reused on the
    output side with another meaning, as some packages the original wrote do."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return create_onnx_neuropod(
            str(path), "doubler",
            [{"name": "x", "dtype": "float32", "shape": ["n"]}], [{"name": "y", "dtype": "float32", "shape": ["n"]}],
            onnx_model=_graph(
                [helper.make_node("Concat", ["x", "x"], ["y"], axis=0)],
                [("x", TensorProto.FLOAT, ["n"])], [("y", TensorProto.FLOAT, ["m"])],
            ),
        )  # fmt: skip


def test_symbols_are_checked_per_side_in_the_originals_packages(tmp_path: Path) -> None:
    ours = Path(_doubler(tmp_path / "ours"))
    x = np.arange(3, dtype=np.float32)
    with load_neuropod(ours) as model, pytest.raises(RuntimeError, match="symbol 'n' should be the same size"):
        model.infer({"x": x})
    # The same package as the original wrote it: no exported_with in config.json, no manifest.
    config = json.loads((ours / "config.json").read_text())
    del config["exported_with"]
    (ours / "config.json").write_text(json.dumps(config))
    (ours / "manifest.json").unlink()
    with load_neuropod(ours) as model:
        np.testing.assert_array_equal(model.infer({"x": x})["y"], np.concatenate([x, x]))
        # Within one side the symbol still binds.
        assert model.infer({"x": np.zeros(0, np.float32)})["y"].shape == (0,)


# --- import paths ---------------------------------------------------------------------------


def test_original_import_paths() -> None:
    import neuropod.loader
    from neuropod import load_neuropod as ours

    assert neuropod.loader.load_neuropod is ours
    try:
        from neuropod.backends.keras.packager import infer_keras_input_spec
    except ImportError as e:  # neuropod-tensorflow is not installed: the error says what to install
        assert neuropod.plugins.pip_install("neuropod-tensorflow") in str(e)
    else:
        assert callable(infer_keras_input_spec)
    with pytest.raises(AttributeError):
        import neuropod.backends.torchscript.packager as p

        p.no_such_thing  # noqa: B018
