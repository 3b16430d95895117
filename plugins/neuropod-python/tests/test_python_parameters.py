"""Request parameters reach a python model's function when it takes them; names with '/', ':' and '.'."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import neuropod
from neuropod.packagers import create_python_neuropod
from neuropod_python._runtime import takes_parameters

from conftest import write_code

SPEC_IN = [{"name": "x", "dtype": "float32", "shape": [None]}]
SPEC_OUT = [{"name": "y", "dtype": "float32", "shape": [None]}, {"name": "seen", "dtype": "string", "shape": [1]}]


def _package(tmp_path: Path, signature: str, spec_in: list[dict] = SPEC_IN) -> Path:
    code = write_code(
        tmp_path / "src",
        {
            "m.py": f"""
import json
import numpy as np


def get_model(data_root):
    def run({signature}):
        p = locals().get("parameters") or {{}}
        x = locals().get("x")
        if x is None:
            x = locals()["inputs"].get("x", locals()["inputs"].get("parameters"))
        return {{"y": x * np.float32(p.get("scale", 1) if isinstance(p, dict) else 1),
                 "seen": np.array([json.dumps(p if isinstance(p, dict) else "array", sort_keys=True)], dtype=object)}}

    return run
"""
        },
    )
    return create_python_neuropod(tmp_path / "pkg", "params", [], [{"python_root": code, "dirs_to_package": [""]}],
                                  "m", "get_model", spec_in, SPEC_OUT)  # fmt: skip


@pytest.mark.parametrize("use_ope", [False, True])
@pytest.mark.parametrize("signature", ["x, *, parameters=None", "x, parameters=None", "x, parameters"])
def test_a_function_with_a_parameters_keyword_gets_them(tmp_path: Path, signature: str, use_ope: bool) -> None:
    x = np.array([1.0, -2.5], np.float32)
    with neuropod.load_neuropod(_package(tmp_path, signature), use_ope=use_ope) as model:
        out = model.infer({"x": x}, parameters={"scale": 3, "tag": "t", "on": True})
        np.testing.assert_array_equal(out["y"], x * 3)
        assert json.loads(out["seen"][0]) == {"on": True, "scale": 3, "tag": "t"}
        if signature != "x, parameters":  # a required parameter needs a call with parameters
            np.testing.assert_array_equal(model.infer({"x": x})["y"], x)
            np.testing.assert_array_equal(model.infer({"x": x}, parameters={})["y"], x)


@pytest.mark.parametrize("use_ope", [False, True])
def test_other_functions_never_get_them(tmp_path: Path, use_ope: bool) -> None:
    x = np.array([2.0], np.float32)
    with neuropod.load_neuropod(_package(tmp_path, "**inputs"), use_ope=use_ope) as model:
        out = model.infer({"x": x}, parameters={"scale": 5})
        np.testing.assert_array_equal(out["y"], x)  # run as without them
        assert json.loads(out["seen"][0]) == {}


def test_an_input_named_parameters_stays_an_input(tmp_path: Path) -> None:
    x = np.array([4.0], np.float32)
    spec = [{"name": "parameters", "dtype": "float32", "shape": [None]}]
    with neuropod.load_neuropod(_package(tmp_path, "**inputs", spec)) as model:
        out = model.infer({"parameters": x}, parameters={"scale": 5})
        np.testing.assert_array_equal(out["y"], x)


def test_takes_parameters() -> None:
    def kw(x, *, parameters=None): ...
    def pos(x, parameters=None): ...
    def anything(**inputs): ...
    def other(x): ...

    assert takes_parameters(kw, ["x"]) and takes_parameters(pos, ["x"])
    assert not takes_parameters(anything, ["x"]) and not takes_parameters(other, ["x"])
    assert not takes_parameters(kw, ["x", "parameters"])
    assert not takes_parameters(len, ["x"])  # a builtin: no signature to read, no parameters


def test_tensor_names_with_slashes_colons_and_dots(tmp_path: Path) -> None:
    code = write_code(
        tmp_path / "src",
        {
            "n.py": """
def get_model(data_root):
    def run(**inputs):
        return {"InceptionV3/Predictions/Softmax:0": inputs["input/x:0"] * 2}

    return run
"""
        },
    )
    x = np.array([[1.0, 2.0]], np.float32)
    path = create_python_neuropod(
        tmp_path / "names", "names", [], [{"python_root": code, "dirs_to_package": [""]}], "n", "get_model",
        [{"name": "input/x:0", "dtype": "float32", "shape": ["batch", 2]}],
        [{"name": "InceptionV3/Predictions/Softmax:0", "dtype": "float32", "shape": ["batch", 2]}],
        test_input_data={"input/x:0": x}, test_expected_out={"InceptionV3/Predictions/Softmax:0": x * 2},
    )  # fmt: skip
    for use_ope in (False, True):
        with neuropod.load_neuropod(path, use_ope=use_ope) as model:
            out = model.infer({"input/x:0": x})
            np.testing.assert_array_equal(out["InceptionV3/Predictions/Softmax:0"], x * 2)


def test_bad_parameters_are_a_type_error_naming_them(tmp_path: Path) -> None:
    x = np.array([1.0], np.float32)
    with neuropod.load_neuropod(_package(tmp_path, "x, *, parameters=None")) as model:
        with pytest.raises(TypeError, match=r"parameters\['scale'\] must be a bool, int, float or str .* not list"):
            model.infer({"x": x}, parameters={"scale": [1, 2]})
        with pytest.raises(TypeError, match="parameters must be a mapping of str to bool, int, float or str, not list"):
            model.infer({"x": x}, parameters=[("scale", 2)])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="a key must be a non-empty str"):
            model.infer({"x": x}, parameters={1: 2})  # type: ignore[dict-item]
