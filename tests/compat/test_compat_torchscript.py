"""Code written for the original Neuropod (0.3), run against ours: TorchScript.

The models are written as the original's users wrote them (``torch.jit.ScriptModule``
subclasses with ``@torch.jit.script_method`` and ``# type:`` comments, next to
today's annotated ``torch.jit.script`` modules) and packaged and loaded
through the original's import paths and keywords. Expected values are
computed here with numpy, independently of the models.
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
from typing import Any, Dict, List  # noqa: F401, UP035  (the original's users wrote these in # type: comments)

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("neuropod_torchscript")

from neuropod.loader import load_neuropod  # noqa: E402  (the original's import paths)
from neuropod.packagers import create_torchscript_neuropod  # noqa: E402

# The tutorial's addition problem: symbol shapes as tuples, an int64 expectation for a float32 output.
INPUT_SPEC = [
    {"name": "x", "dtype": "float32", "shape": ("num_inputs",)},
    {"name": "y", "dtype": "float32", "shape": ("num_inputs",)},
]
OUTPUT_SPEC = [{"name": "out", "dtype": "float32", "shape": (None,)}]
TEST_INPUT_DATA = {"x": np.arange(5, dtype=np.float32), "y": np.arange(5, dtype=np.float32)}
TEST_EXPECTED_OUT = {"out": np.arange(5) + np.arange(5)}

STRING_SPEC = {
    "input_spec": [
        {"name": "x", "dtype": "string", "shape": ("batch_size",)},
        {"name": "y", "dtype": "string", "shape": ("batch_size",)},
    ],
    "output_spec": [{"name": "out", "dtype": "string", "shape": ("batch_size",)}],
}
WORDS_X, WORDS_Y = np.array(["apple", "banana", "carrot"]), np.array(["sauce", "split", "cake"])
CONCATENATED = np.array(["apple sauce", "banana split", "carrot cake"])


class AdditionModel(torch.jit.ScriptModule):
    """The tutorial's addition model."""

    @torch.jit.script_method
    def forward(self, x, y):
        return {"out": x + y}


class StringsModel(torch.jit.ScriptModule):
    """Joins two string tensors with a space, one argument per input, returning a dict."""

    @torch.jit.script_method
    def forward(self, x, y):
        # type: (List[str], List[str]) -> Dict[str, List[str]]
        out = [""]
        for i in range(len(x)):
            out.append(x[i] + " " + y[i])
        return {"out": out[1:]}


class StringsModelDictInput(torch.jit.ScriptModule):
    """The same with one dict of every input."""

    @torch.jit.script_method
    def forward(self, data):
        # type: (Dict[str, List[str]]) -> Dict[str, List[str]]
        out = [""]
        for i in range(len(data["x"])):
            out.append(data["x"][i] + " " + data["y"][i])
        return {"out": out[1:]}


class StringsModelListOutput(torch.jit.ScriptModule):
    """The same returning a bare List[str]: the single output of the spec."""

    @torch.jit.script_method
    def forward(self, x, y):
        # type: (List[str], List[str]) -> List[str]
        out = [""]
        for i in range(len(x)):
            out.append(x[i] + " " + y[i])
        return out[1:]


class ScalarModel(torch.nn.Module):
    """0-d in and out: the sum of a vector times a scalar."""

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> Dict[str, torch.Tensor]:  # noqa: UP006
        return {"total": x.sum() * scale}


class DuplicateOutputModel(torch.nn.Module):
    """Returns 'out' in both dicts of a tuple."""

    def forward(self, x: torch.Tensor) -> tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:  # noqa: UP006
        return {"out": x}, {"out": x + 1}


@pytest.fixture(autouse=True)
def _private_cache(neuropod_cache: Path) -> Path:
    # neuropod.testing's fixture: a private package cache for every test here.
    return neuropod_cache


def _addition(neuropod_path: Path, **kwargs: Any) -> Path:
    args: dict[str, Any] = dict(
        neuropod_path=str(neuropod_path), model_name="addition_model", module=AdditionModel(),
        input_spec=INPUT_SPEC, output_spec=OUTPUT_SPEC, test_input_data=TEST_INPUT_DATA,
        test_expected_out=TEST_EXPECTED_OUT,
    )  # fmt: skip
    args.update(kwargs)
    create_torchscript_neuropod(**args)
    return neuropod_path


def test_tutorial_addition_model(tmp_path: Path) -> None:
    path = _addition(tmp_path / "addition_model")
    x, y = np.array([1, 2, 3, 4], np.float32), np.array([5, 6, 7, 8], np.float32)
    with load_neuropod(str(path)) as neuropod:
        results = neuropod.infer({"x": x, "y": y})
        np.testing.assert_array_equal(results["out"], np.array([6, 8, 10, 12], np.float32))
        assert neuropod.name == "addition_model" and neuropod.platform == "torchscript"
        assert neuropod.inputs == [
            {"name": "x", "dtype": "float32", "shape": ["num_inputs"]},
            {"name": "y", "dtype": "float32", "shape": ("num_inputs",)},
        ]
        assert neuropod.outputs == [{"name": "out", "dtype": "float32", "shape": [None]}]
        assert neuropod.inputs[0]["name"] == "x" and neuropod.outputs[0]["shape"] == [None]
        assert [dict(spec) for spec in neuropod.inputs] == [
            {"name": name, "dtype": "float32", "shape": ["num_inputs"]} for name in ("x", "y")
        ]


def test_original_import_path_is_the_same_packager() -> None:
    from neuropod.backends.torchscript.packager import create_torchscript_neuropod as from_backends

    assert from_backends is create_torchscript_neuropod


@pytest.mark.parametrize("package_as_zip", [True, False])
@pytest.mark.parametrize("persist_test_data", [True, False])
def test_every_packager_keyword(tmp_path: Path, package_as_zip: bool, persist_test_data: bool) -> None:
    module_path = tmp_path / "addition.pt"
    torch.jit.save(AdditionModel(), str(module_path))
    path = tmp_path / ("addition.zip" if package_as_zip else "addition")
    create_torchscript_neuropod(
        neuropod_path=str(path),
        model_name="addition_model",
        module_path=str(module_path),
        input_spec=INPUT_SPEC,
        output_spec=OUTPUT_SPEC,
        platform_version_semver=">= 1.1.0",
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
    else:
        assert path.is_dir()
        names = [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
        config = json.loads((path / "config.json").read_text())
    assert "0/data/model.pt" in names
    assert any(n.startswith("test_data/") for n in names) == persist_test_data
    assert config["platform"] == "torchscript" and config["platform_version_semver"] == ">= 1.1.0"
    assert config["input_tensor_device"] == {"x": "CPU", "y": "GPU"}
    for visible_gpu in (None, 0):  # 0, the original's default, is the CPU on a host without that GPU
        if visible_gpu == 0 and torch.cuda.is_available():
            continue
        with load_neuropod(str(path), visible_gpu=visible_gpu) as neuropod:
            out = neuropod.infer({"x": np.ones(3, np.float32), "y": np.full(3, 2, np.float32)})
            np.testing.assert_array_equal(out["out"], np.full(3, 3, np.float32))


def test_packager_defaults_write_a_directory(tmp_path: Path) -> None:
    """Ours writes a directory unless package_as_zip=True (the original wrote a zip): a documented difference."""
    path = _addition(tmp_path / "addition_model")
    assert path.is_dir() and (path / "config.json").is_file()


def test_wrong_expected_output_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not reproduce its expected test output"):
        _addition(tmp_path / "m", test_expected_out={"out": TEST_EXPECTED_OUT["out"] + 1})
    assert not (tmp_path / "m").exists()
    with pytest.raises(ValueError):
        _addition(tmp_path / "both", module_path=str(tmp_path / "m.pt"))  # module and module_path
    with pytest.raises(ValueError):  # the path exists
        _addition(tmp_path, test_input_data=None, test_expected_out=None)


def test_unsatisfiable_platform_version_semver_is_a_runtime_error(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not checked by loading it": nothing here can run it
        path = _addition(tmp_path / "old", platform_version_semver="< 1.0.0", test_input_data=None,
                         test_expected_out=None)  # fmt: skip
    with pytest.raises(RuntimeError):
        load_neuropod(str(path))
    # With test data the packager's own check loads it, and fails the same way.
    with pytest.raises(RuntimeError):
        _addition(tmp_path / "checked", platform_version_semver="< 1.0.0")
    assert not (tmp_path / "checked").exists()


@pytest.mark.parametrize(
    "inputs",
    [
        {"x": np.arange(3, dtype=np.float64), "y": np.arange(3, dtype=np.float32)},  # wrong dtype
        {"x": np.zeros((3, 1), np.float32), "y": np.zeros(3, np.float32)},  # wrong rank
        {"x": np.zeros(3, np.float32), "y": np.zeros(4, np.float32)},  # num_inputs differs
        {"x": np.zeros(3, np.float32)},  # y missing
    ],
    ids=["dtype", "rank", "symbol", "missing"],
)
def test_inference_errors_are_runtime_errors(tmp_path: Path, inputs: dict[str, np.ndarray]) -> None:
    with load_neuropod(str(_addition(tmp_path / "m"))) as neuropod, pytest.raises(RuntimeError):
        neuropod.infer(inputs)


def test_output_returned_twice_is_a_runtime_error(tmp_path: Path) -> None:
    path = tmp_path / "dup"
    create_torchscript_neuropod(
        neuropod_path=str(path), model_name="dup", module=torch.jit.script(DuplicateOutputModel()),
        input_spec=[{"name": "x", "dtype": "float32", "shape": (2,)}],
        output_spec=[{"name": "out", "dtype": "float32", "shape": (2,)}],
    )  # fmt: skip
    with load_neuropod(str(path)) as neuropod, pytest.raises(RuntimeError, match="already returned by this model"):
        neuropod.infer({"x": np.zeros(2, np.float32)})


def test_scalars(tmp_path: Path) -> None:
    x = np.array([1, 2, 3.5], np.float32)
    path = tmp_path / "scalar"
    create_torchscript_neuropod(
        neuropod_path=str(path), model_name="scalar", module=torch.jit.script(ScalarModel()),
        input_spec=[{"name": "x", "dtype": "float32", "shape": (None,)}, {"name": "scale", "dtype": "float32", "shape": ()}],
        output_spec=[{"name": "total", "dtype": "float32", "shape": ()}],
        test_input_data={"x": x, "scale": np.float32(2)}, test_expected_out={"total": np.float32(13)},
    )  # fmt: skip
    with load_neuropod(str(path)) as neuropod:
        assert neuropod.inputs[1] == {"name": "scale", "dtype": "float32", "shape": []}
        for scale in (np.float32(0.5), np.array(0.5, np.float32)):
            total = neuropod.infer({"x": x, "scale": scale})["total"]
            assert isinstance(total, np.ndarray) and total.shape == () and total.dtype == np.float32
            assert total == np.float32(3.25)


@pytest.mark.parametrize("model", [StringsModel, StringsModelDictInput, StringsModelListOutput])
def test_string_concat_models(tmp_path: Path, model: type) -> None:
    path = tmp_path / "strings"
    create_torchscript_neuropod(
        neuropod_path=str(path), model_name="strings_model", module=model(), **STRING_SPEC,
        test_input_data={"x": WORDS_X, "y": WORDS_Y}, test_expected_out={"out": CONCATENATED},
    )  # fmt: skip
    with load_neuropod(str(path)) as neuropod:
        out = neuropod.infer({"x": WORDS_X[:2], "y": WORDS_Y[:2]})["out"]
        assert out.dtype.type == np.str_ and (out == CONCATENATED[:2]).all()
    with pytest.raises(ValueError):
        create_torchscript_neuropod(
            neuropod_path=str(tmp_path / "fails"), model_name="strings_model", module=model(), **STRING_SPEC,
            test_input_data={"x": WORDS_X, "y": WORDS_Y}, test_expected_out={"out": WORDS_X},
        )  # fmt: skip


# --- custom ops loaded before packaging, as the original's users built them -------------------

ADDITION_OP = r"""
#include <ATen/core/Tensor.h>
#include <torch/library.h>

at::Tensor add(const at::Tensor& x, const at::Tensor& y) { return x.add(y); }

TORCH_LIBRARY(neuropod_compat_ops, m) { m.def("add(Tensor x, Tensor y) -> Tensor", add); }
"""

CUSTOM_OP_WORKFLOW = r"""
import json, shutil, sys
import numpy as np
import torch
from neuropod.loader import load_neuropod
from neuropod.packagers import create_torchscript_neuropod

lib, work = sys.argv[1:3]
torch.ops.load_library(lib)  # to build the model, as the original's users did
copy = work + "/addition_op_copy.so"
shutil.copyfile(lib, copy)


class CustomOpModel(torch.jit.ScriptModule):
    @torch.jit.script_method
    def forward(self, x, y):
        return {"out": torch.ops.neuropod_compat_ops.add(x, y)}


spec = dict(
    input_spec=[{"name": n, "dtype": "float32", "shape": ("num_inputs",)} for n in ("x", "y")],
    output_spec=[{"name": "out", "dtype": "float32", "shape": (None,)}],
)
x, y = np.arange(5, dtype=np.float32), np.arange(5, dtype=np.float32) * 10
result = {}
path = work + "/custom_op_model"
create_torchscript_neuropod(
    neuropod_path=path, model_name="addition_model", module=CustomOpModel(), custom_ops=[lib, copy],
    test_input_data={"x": x, "y": y}, test_expected_out={"out": x + y}, **spec,
)
try:
    create_torchscript_neuropod(
        neuropod_path=work + "/fails", model_name="addition_model", module=CustomOpModel(), custom_ops=[lib, copy],
        test_input_data={"x": x, "y": y}, test_expected_out={"out": x - y}, **spec,
    )
except ValueError as e:
    result["wrong_expected"] = type(e).__name__
for load_custom_ops in (True, False):
    with load_neuropod(path, load_custom_ops=load_custom_ops) as model:
        result[f"out_{load_custom_ops}"] = model.infer({"x": x, "y": y})["out"].tolist()
        result[f"kind_{load_custom_ops}"] = type(model).__name__
print(json.dumps(result))
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the custom op")
def test_custom_op_loaded_before_packaging(tmp_path: Path) -> None:
    """The original's custom-op workflow: load the op, build the model with it, package the
    library (twice, under two names, as the original's own test did) and load the package in
    the same process. Run in a subprocess: a second registration of an op aborts the process."""
    from torch.utils import cpp_extension

    source, lib = tmp_path / "addition_op.cc", tmp_path / "addition_op.so"
    source.write_text(ADDITION_OP)
    abi = int(torch.compiled_with_cxx11_abi())
    cmd = ["g++", "-shared", "-fPIC", "-O0", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", str(source), "-o", str(lib)]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [f"-L{p}" for p in cpp_extension.library_paths()] + ["-ltorch", "-ltorch_cpu", "-lc10"]
    cmd += [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    subprocess.run(cmd, check=True, timeout=600)
    script = tmp_path / "workflow.py"
    script.write_text(textwrap.dedent(CUSTOM_OP_WORKFLOW))
    done = subprocess.run(
        [sys.executable, str(script), str(lib), str(tmp_path)], capture_output=True, text=True, timeout=300,
        env=os.environ.copy(),
    )  # fmt: skip
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected = (np.arange(5) * 11).astype(np.float32).tolist()
    assert result == {
        "wrong_expected": "PackageError",
        "out_True": expected, "kind_True": "NeuropodModel",
        "out_False": expected, "kind_False": "NeuropodModel",
    }  # fmt: skip
