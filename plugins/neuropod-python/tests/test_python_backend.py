"""Python packages without requirements: layout, loading in-process and in workers, isolation, errors."""

from __future__ import annotations

import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import neuropod
from neuropod.errors import BackendError, NeuropodError, PackageError, SpecError
from neuropod.packagers import create_python_neuropod

from conftest import write_code

# The original Neuropod's test_python_packaging.py: its test_manifest gives the sha256 of these files
# as the original's packager wrote them (computed by the original, not by us).
ADDITION_MODEL_SOURCE = """
import sys

def addition_model(x, y):
    return {
        "out": x + y
    }

def get_model(_):
    # Test for https://github.com/uber/neuropod/issues/374
    assert hasattr(sys, 'argv'), "sys.argv should exist"

    return addition_model
"""
ORIGINAL_HASHES = {
    "0/code/__init__.py": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "0/code/addition_model.py": "14566dd9b13641f6482f492398cd1b567d132a08facde7b2f86cddd198f93415",
    "0/config.json": "a52f77051501f426b04f865580ee81ad1c242e47c45dcc4108c673a95f12b755",
}
XY_SPEC = [{"name": "x", "dtype": "float32", "shape": ["batch", 2]}, {"name": "y", "dtype": "float32", "shape": ["batch", 2]}]
OUT_SPEC = [{"name": "out", "dtype": "float32", "shape": ["batch", 2]}]
X = np.array([[1, 2], [3, 4]], np.float32)
Y = np.array([[10, 20], [30, 40]], np.float32)


def adder(tmp: Path, **kwargs: Any) -> Path:
    code = write_code(tmp / "model_code", {"addition_model.py": ADDITION_MODEL_SOURCE})
    path: Path = create_python_neuropod(
        tmp / "adder.neuropod", "addition_model", [], [{"python_root": code, "dirs_to_package": [""]}],
        "addition_model", "get_model", XY_SPEC, OUT_SPEC, **kwargs,
    )  # fmt: skip
    return path


def test_layout_is_the_originals(tmp_path: Path) -> None:
    path = adder(tmp_path, test_input_data={"x": X, "y": Y}, test_expected_out={"out": X + Y})
    for rel, digest in ORIGINAL_HASHES.items():
        assert hashlib.sha256((path / rel).read_bytes()).hexdigest() == digest, rel
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert {k: manifest[k] for k in ORIGINAL_HASHES} == ORIGINAL_HASHES
    config = json.loads((path / "config.json").read_text())
    assert config["platform"] == "python" and config["platform_version_semver"] == "*"
    assert not (path / "0" / "requirements.lock").exists()


# The same test's expectation for the root config.json, from get_addition_model_spec (inputs and
# output of shape ("batch_size",)) with the packager's defaults: written by the original's
# write_neuropod_config, its sha256 as the original's own test pins it.
ORIGINAL_CONFIG_SHA256 = "0309cf2117d887218e7edb4c918097a6a427fffcbf0a948115d32414b2b6e144"
# What the original's config has that ours does not: the block we add, as indent=4 lays it out.
EXPORTED_WITH_BLOCK = re.compile(r'\n    "exported_with": \{\n(?:        "[^"\n]*": "[^"\n]*",?\n)+    \},')


def test_config_and_manifest_bytes_are_the_originals(tmp_path: Path) -> None:
    code = write_code(tmp_path / "model_code", {"addition_model.py": ADDITION_MODEL_SOURCE})
    vector = [{"name": "x", "dtype": "float32", "shape": ("batch_size",)},
              {"name": "y", "dtype": "float32", "shape": ("batch_size",)}]  # fmt: skip
    x = np.arange(5, dtype=np.float32)
    path = create_python_neuropod(
        neuropod_path=tmp_path / "test_neuropod", model_name="addition_model", data_paths=[],
        code_path_spec=[{"python_root": code, "dirs_to_package": [""]}], entrypoint_package="addition_model",
        entrypoint="get_model", input_spec=vector, output_spec=[{"name": "out", "dtype": "float32", "shape": ("batch_size",)}],
        test_input_data={"x": x, "y": x}, test_expected_out={"out": x + x}, package_as_zip=False,
        persist_test_data=False,
    )  # fmt: skip
    config_bytes = (path / "config.json").read_bytes()
    assert json.loads(config_bytes)["exported_with"]["neuropod"] == neuropod.__version__
    without_ours, removed = EXPORTED_WITH_BLOCK.subn("", config_bytes.decode("ascii"))
    assert removed == 1
    assert hashlib.sha256(without_ours.encode("ascii")).hexdigest() == ORIGINAL_CONFIG_SHA256
    # The original's manifest layout, byte for byte: sorted keys, four spaces, no final newline.
    hashes = {**ORIGINAL_HASHES, "config.json": hashlib.sha256(config_bytes).hexdigest()}
    expected = (
        '{\n    "files": {\n'
        + ",\n".join(f'        "{rel}": "{hashes[rel]}"' for rel in sorted(hashes))
        + '\n    },\n    "manifest_version": 1\n}'
    )
    assert (path / "manifest.json").read_text(encoding="ascii") == expected
    with neuropod.load_neuropod(path) as model:  # and it still loads, its manifest checked
        np.testing.assert_array_equal(model.infer({"x": x, "y": x})["out"], x + x)


def test_code_path_spec_data_paths_and_zip(tmp_path: Path) -> None:
    root = write_code(tmp_path / "src", {
        "models/scaler/model.py": "import numpy as np\nfrom .weights import load\n"
                                  "def get_model(data_root):\n    w = load(data_root)\n"
                                  "    return lambda x: {'out': x * w}\n",
        "models/scaler/weights.py": "import os\nimport numpy as np\n"
                                    "def load(root):\n    return np.load(os.path.join(root, 'w.npy'))\n",
        "models/scaler/__pycache__/junk.cpython-311.pyc": "not code",
        "models/scaler/stale.pyc": "not code",
        "unrelated/other.py": "raise RuntimeError('not packaged')\n",
    })  # fmt: skip
    weights = tmp_path / "weights.npy"
    w = np.array([2.0, -1.0], np.float32)
    np.save(weights, w)
    path = create_python_neuropod(
        tmp_path / "scaler.zip", "scaler", [{"path": weights, "packaged_name": "w.npy"}],
        [{"python_root": root, "dirs_to_package": ["models"]}], "models.scaler.model", "get_model",
        [{"name": "x", "dtype": "float32", "shape": [None, 2]}], [{"name": "out", "dtype": "float32", "shape": [None, 2]}],
        test_input_data={"x": X}, test_expected_out={"out": X * w}, package_as_zip=True,
    )  # fmt: skip
    names = set(zipfile.ZipFile(path).namelist())
    assert {"0/code/models/__init__.py", "0/code/models/scaler/__init__.py", "0/code/models/scaler/model.py",
            "0/code/models/scaler/weights.py", "0/data/w.npy", "0/config.json"} <= names  # fmt: skip
    assert not any(n.endswith(".pyc") or "__pycache__" in n or "unrelated" in n for n in names)
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_array_equal(model.infer({"x": X})["out"], X * w)


def test_in_process_by_default_and_a_worker_on_request(tmp_path: Path) -> None:
    path = adder(tmp_path)
    with neuropod.load_neuropod(path) as model:
        assert model.backend.location == "in-process" and model.backend.platform == "python"
        assert model.backend.version == ".".join(map(str, sys.version_info[:3]))
        np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)
    with neuropod.load_neuropod(path, use_ope=True) as model:
        assert model.worker_pids
        np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)
        np.testing.assert_array_equal(model.infer({"x": X[:1], "y": Y[:1]}, ["out"])["out"], X[:1] + Y[:1])


def test_noncontiguous_outputs(tmp_path: Path) -> None:
    # The original's test_noncontiguous_array: outputs that are views of an input.
    code = write_code(tmp_path / "code", {"splitter_model.py": (
        "def split(x):\n    return {'x1': x[:, :2], 'x2': x[:, 2:]}\n\ndef get_model(_):\n    return split\n"
    )})  # fmt: skip
    x = np.arange(16).astype(np.int64).reshape(4, 4)
    path = create_python_neuropod(
        tmp_path / "splitter", "splitter", [], [{"python_root": code, "dirs_to_package": [""]}], "splitter_model",
        "get_model", [{"name": "x", "dtype": "int64", "shape": (4, 4)}],
        [{"name": "x1", "dtype": "int64", "shape": (4, 2)}, {"name": "x2", "dtype": "int64", "shape": (4, 2)}],
        test_input_data={"x": x}, test_expected_out={"x1": x[:, :2], "x2": x[:, 2:]},
    )  # fmt: skip
    for use_ope in (False, True):
        with neuropod.load_neuropod(path, use_ope=use_ope) as model:
            out = model.infer({"x": x})
            np.testing.assert_array_equal(out["x1"], x[:, :2])
            np.testing.assert_array_equal(out["x2"], x[:, 2:])


DUMMY_MODEL_SOURCE = """
import numpy as np

def model(x):
    return {{
        "out": np.array([{}], dtype=np.float32)
    }}

def get_model(_):
    return model
"""


def dummy(tmp: Path, target: float) -> Path:
    # The original's test_python_isolation: two packages, same entrypoint package name.
    code = write_code(tmp / "model_code", {"dummy_model.py": DUMMY_MODEL_SOURCE.format(target)})
    path: Path = create_python_neuropod(
        tmp / "test_neuropod", "dummy_model", [], [{"python_root": code, "dirs_to_package": [""]}], "dummy_model",
        "get_model", [{"name": "x", "dtype": "float32", "shape": (1,)}], [{"name": "out", "dtype": "float32", "shape": (1,)}],
        test_input_data={"x": np.array([0.0], np.float32)}, test_expected_out={"out": np.array([target], np.float32)},
    )  # fmt: skip
    return path


@pytest.mark.parametrize("use_ope", [False, True])
def test_two_packages_with_the_same_entrypoint_package(tmp_path: Path, use_ope: bool) -> None:
    one, two = dummy(tmp_path / "a", 1.0), dummy(tmp_path / "b", 2.0)
    x = {"x": np.array([0], np.float32)}
    with neuropod.load_neuropod(one, use_ope=use_ope) as n1, neuropod.load_neuropod(two, use_ope=use_ope) as n2:
        assert n1.infer(x)["out"][0] == 1.0
        assert n2.infer(x)["out"][0] == 2.0
        assert n1.infer(x)["out"][0] == 1.0
    assert "dummy_model" not in sys.modules


def test_absolute_imports_of_the_codes_own_modules_stay_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Both packages import a sibling module `helpers` by its absolute name; a third `helpers`
    # is already imported in this process and must neither be used nor replaced.
    def make(tag: str, factor: int) -> Path:
        code = write_code(tmp_path / tag / "code", {
            "helpers.py": f"FACTOR = {factor}\n",
            "entry.py": "import helpers\n\ndef get_model(_):\n    return lambda x: {'out': x * helpers.FACTOR}\n",
        })  # fmt: skip
        path: Path = create_python_neuropod(
            tmp_path / tag / "pkg", f"times{factor}", [], [{"python_root": code, "dirs_to_package": [""]}], "entry",
            "get_model", [{"name": "x", "dtype": "int64", "shape": [None]}], [{"name": "out", "dtype": "int64", "shape": [None]}],
        )  # fmt: skip
        return path

    theirs = write_code(tmp_path / "callers", {"helpers.py": "FACTOR = 'the caller'\n"})
    monkeypatch.syspath_prepend(str(theirs))
    import helpers  # type: ignore[import-not-found]

    three, seven = make("a", 3), make("b", 7)
    x = np.arange(4, dtype=np.int64)
    with neuropod.load_neuropod(three) as m3, neuropod.load_neuropod(seven) as m7:
        np.testing.assert_array_equal(m3.infer({"x": x})["out"], x * 3)
        np.testing.assert_array_equal(m7.infer({"x": x})["out"], x * 7)
    assert sys.modules["helpers"] is helpers and helpers.FACTOR == "the caller"
    assert "entry" not in sys.modules
    monkeypatch.delitem(sys.modules, "helpers")


def test_model_code_raising_gives_its_traceback(tmp_path: Path) -> None:
    code = write_code(tmp_path / "code", {"faulty.py": (
        "def check_positive(x):\n    if (x < 0).any():\n        raise ValueError('negative input')\n    return x\n\n"
        "def get_model(_):\n    return lambda x: {'out': check_positive(x)}\n"
    )})  # fmt: skip
    path = create_python_neuropod(
        tmp_path / "faulty", "faulty", [], [{"python_root": code, "dirs_to_package": [""]}], "faulty", "get_model",
        [{"name": "x", "dtype": "float32", "shape": [None]}], [{"name": "out", "dtype": "float32", "shape": [None]}],
    )  # fmt: skip
    for use_ope in (False, True):
        with neuropod.load_neuropod(path, use_ope=use_ope) as model:
            np.testing.assert_array_equal(model.infer({"x": np.ones(2, np.float32)})["out"], np.ones(2, np.float32))
            with pytest.raises(BackendError) as info:
                model.infer({"x": -np.ones(2, np.float32)})
            text = str(info.value)
            assert "Model 'faulty' raised ValueError: negative input" in text
            assert "faulty.py\", line 3, in check_positive" in text
            # the model survives its own exception
            np.testing.assert_array_equal(model.infer({"x": np.ones(1, np.float32)})["out"], np.ones(1, np.float32))


@pytest.mark.parametrize(
    ("entrypoint_package", "entrypoint", "error", "message"),
    [
        ("no_such_module", "get_model", PackageError, "entrypoint_package 'no_such_module' is not in the package's code"),
        ("addition_model", "no_such_function", PackageError, "entrypoint 'no_such_function' is not defined"),
        ("addition_model", "addition_model", BackendError, "addition_model(data_root) raised"),
        ("addition_model", "NOT_CALLABLE", PackageError, "is a int, not a function"),
        ("addition_model", "returns_number", BackendError, "returned int, not a callable"),
    ],
)  # fmt: skip
def test_a_bad_entrypoint_is_a_clear_error_and_no_package_is_left(
    tmp_path: Path, entrypoint_package: str, entrypoint: str, error: type[Exception], message: str
) -> None:
    code = write_code(tmp_path / "code", {
        "addition_model.py": ADDITION_MODEL_SOURCE + "\nNOT_CALLABLE = 3\n\ndef returns_number(_):\n    return 42\n",
    })  # fmt: skip
    dest = tmp_path / "bad"
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        create_python_neuropod(
            dest, "bad", [], [{"python_root": code, "dirs_to_package": [""]}], entrypoint_package, entrypoint,
            XY_SPEC, OUT_SPEC, test_input_data={"x": X, "y": Y},
        )  # fmt: skip
    assert not dest.exists()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("return [x]", "returned list, not a dict of output name to numpy array"),
        ("return {'out': [1.0, 2.0]}", "returned output 'out' as list; outputs must be numpy arrays"),
        ("return {'wrong': x}", "not found in the output spec"),
    ],
)
def test_bad_outputs_are_clear_errors(tmp_path: Path, body: str, message: str) -> None:
    code = write_code(tmp_path / "code", {"m.py": f"def get_model(_):\n    def run(x):\n        {body}\n    return run\n"})
    path = create_python_neuropod(
        tmp_path / "p", "bad_outputs", [], [{"python_root": code, "dirs_to_package": [""]}], "m", "get_model",
        [{"name": "x", "dtype": "float32", "shape": [2]}], [{"name": "out", "dtype": "float32", "shape": [2]}],
    )  # fmt: skip
    with neuropod.load_neuropod(path) as model, pytest.raises(NeuropodError, match=message):
        model.infer({"x": np.ones(2, np.float32)})


def test_bad_packaging_arguments(tmp_path: Path) -> None:
    code = write_code(tmp_path / "code", {"addition_model.py": ADDITION_MODEL_SOURCE})
    spec = [{"python_root": code, "dirs_to_package": [""]}]
    args = ("addition_model", "get_model", XY_SPEC, OUT_SPEC)
    with pytest.raises(PackageError, match="is not a file"):
        create_python_neuropod(tmp_path / "a", "m", [{"path": tmp_path / "missing", "packaged_name": "w"}], spec, *args)
    with pytest.raises(ValueError, match="must be a relative path inside 0/data"):
        create_python_neuropod(tmp_path / "b", "m", [{"path": code / "addition_model.py", "packaged_name": "../w"}], spec, *args)
    with pytest.raises(PackageError, match="is not a directory"):
        create_python_neuropod(tmp_path / "c", "m", [], [{"python_root": tmp_path / "nope", "dirs_to_package": [""]}], *args)
    with pytest.raises(ValueError, match="cannot be inside python_root"):
        create_python_neuropod(code / "inside", "m", [], spec, *args)
    with pytest.raises(ValueError, match="is not a module path"):
        create_python_neuropod(tmp_path / "d", "m", [], spec, "addition-model", "get_model", XY_SPEC, OUT_SPEC)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code"]


def test_an_original_package_loads_unchanged(tmp_path: Path) -> None:
    # The layout of the original's test_data/pytorch_addition_model, written by hand: no manifest,
    # no exported_with, a data file the code ignores, and numpy code instead of torch.
    root = tmp_path / "addition_model"
    write_code(root, {
        "config.json": json.dumps({
            "name": "addition_model", "platform": "python",
            "input_spec": [{"dtype": "float32", "shape": [None, None], "name": "x"},
                           {"dtype": "float32", "shape": [None, None], "name": "y"}],
            "output_spec": [{"dtype": "float32", "shape": [None, None], "name": "out"}],
        }, indent=4),
        "0/config.json": '{"entrypoint": "get_model", "entrypoint_package": "addition_model"}',
        "0/code/__init__.py": "",
        "0/code/addition_model.py": "class AdditionModel:\n    def __call__(self, x, y):\n        return {'out': x + y}\n\n"
                                    "def get_model(_):\n    return AdditionModel()\n",
    })  # fmt: skip
    (root / "0" / "data").mkdir()
    (root / "0" / "data" / "random_content").write_bytes(bytes(range(256)))
    with neuropod.load_neuropod(root) as model:
        assert model.package.original_format
        np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)


@pytest.mark.parametrize("use_ope", [False, True], ids=["in-process", "worker"])
def test_an_original_package_may_reuse_an_input_symbol_at_another_size(tmp_path: Path, use_ope: bool) -> None:
    # The original checked a symbol within the inputs and within the outputs, never across:
    # its packages may say "batch_size" for an output of another size. Ours bind it across both.
    source = "import numpy as np\n\ndef get_model(_):\n    return lambda x, w: {'y': np.concatenate([x, w])}\n"
    code = write_code(tmp_path / "code", {"joiner.py": source})
    pair = [{"name": "x", "dtype": "float32", "shape": ["batch_size"]},
            {"name": "w", "dtype": "float32", "shape": ["batch_size"]}]  # fmt: skip
    joined = [{"name": "y", "dtype": "float32", "shape": ["batch_size"]}]
    ours = create_python_neuropod(tmp_path / "ours", "joiner", [], [{"python_root": code, "dirs_to_package": [""]}],
                                  "joiner", "get_model", pair, joined)  # fmt: skip
    x, w = np.arange(3, dtype=np.float32), np.full(3, 7, np.float32)
    shared = pytest.raises(SpecError, match="symbol 'batch_size' should be the same size.*but was of size 6")
    with neuropod.load_neuropod(ours, use_ope=use_ope) as model, shared:
        model.infer({"x": x, "w": w})
    # The same model as the original wrote it: no exported_with, no manifest.
    original = write_code(tmp_path / "original", {
        "config.json": json.dumps({"name": "joiner", "platform": "python", "input_spec": pair, "output_spec": joined},
                                  indent=4),
        "0/config.json": '{"entrypoint": "get_model", "entrypoint_package": "joiner"}',
        "0/code/__init__.py": "",
        "0/code/joiner.py": source,
    })  # fmt: skip
    with neuropod.load_neuropod(original, use_ope=use_ope) as model:
        assert model.package.original_format
        np.testing.assert_array_equal(model.infer({"x": x, "w": w})["y"], [0, 1, 2, 7, 7, 7])
        # Within the inputs the symbol still binds.
        with pytest.raises(SpecError, match="symbol 'batch_size' should be the same size.*'w'.*but was of size 2"):
            model.infer({"x": x, "w": w[:2]})


VERSION_MODEL = """
import sys
import numpy as np

def get_model(_):
    return lambda x: {"version": np.array(sys.version_info[:2], dtype=np.int32), "out": x * 2}
"""


def test_a_package_for_another_python_runs_on_it(tmp_path: Path, neuropod_home: Path) -> None:
    from neuropod_python import other_interpreters

    others = [v for v, _ in other_interpreters() if v.startswith("3.12")]
    if not others:
        pytest.skip("needs python3.12 on PATH (or in pyenv) beside this Python")
    if sys.version_info[:2] == (3, 12):
        pytest.skip("this process already runs Python 3.12")
    code = write_code(tmp_path / "code", {"version_model.py": VERSION_MODEL})
    path = create_python_neuropod(
        tmp_path / "v312", "v312", [], [{"python_root": code, "dirs_to_package": [""]}], "version_model", "get_model",
        [{"name": "x", "dtype": "float32", "shape": [None]}],
        [{"name": "version", "dtype": "int32", "shape": [2]}, {"name": "out", "dtype": "float32", "shape": [None]}],
        platform_version_semver="==3.12.*",
    )  # fmt: skip
    plan = neuropod.plan(path)
    assert plan.chosen is not None and plan.chosen.backend.location.startswith("python:")
    with neuropod.load_neuropod(path) as model:
        assert model.backend.location.startswith("env:lock-py3.12-") and model.backend.version.startswith("3.12.")
        out = model.infer({"x": np.ones(3, np.float32)})
        assert out["version"].tolist() == [3, 12]
        np.testing.assert_array_equal(out["out"], np.full(3, 2, np.float32))
    with pytest.raises(NeuropodError, match="allows no Python on this machine"):
        create_python_neuropod(
            tmp_path / "v2", "v2", [], [{"python_root": code, "dirs_to_package": [""]}], "version_model", "get_model",
            [{"name": "x", "dtype": "float32", "shape": [None]}], [{"name": "out", "dtype": "float32", "shape": [None]}],
            requirements="six", platform_version_semver="<3",
        )  # fmt: skip


def test_the_originals_import_paths() -> None:
    from neuropod.backends.python.packager import create_python_neuropod as original_python
    from neuropod.backends.pytorch.packager import create_pytorch_neuropod as original_pytorch
    from neuropod.packagers import create_pytorch_neuropod

    assert original_python is create_python_neuropod and original_pytorch is create_pytorch_neuropod
