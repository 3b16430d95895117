"""load_neuropod and the loaded model, through a throwaway backend registered in code."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest

import neuropod
from neuropod.errors import BackendError, NeuropodError, NoBackendError, PackageError, SpecError
from neuropod.testdata import compare_outputs, run_test_data
from neuropod.testing import run_in_threads

from _toy_backend import toy_plugin, write_toy


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))


X = np.array([[1, 2], [3, 4]], np.float32)
Y = np.array([[7, 8], [9, 10]], np.float32)


def test_load_and_infer(tmp_path: Path) -> None:
    path = write_toy(tmp_path / "m")
    with toy_plugin() as plugin:
        with neuropod.load_neuropod(path) as model:
            assert (model.name, model.platform, model.device, model.backend.id) == ("toy_adder", "toy", "cpu", "toy==1.0.0")
            np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)
            assert "toy==1.0.0 on cpu" in repr(model)
        assert plugin.loaded[0].closed, "close() reaches the backend's handle"
        assert "closed" in repr(model)
        with pytest.raises(NeuropodError, match="'toy_adder' is closed"):
            model.infer({"x": X, "y": Y})


def test_outputs_are_checked_against_the_spec(tmp_path: Path) -> None:
    with toy_plugin():
        with neuropod.load_neuropod(write_toy(tmp_path / "a", op="wrong_shape")) as model, pytest.raises(
            SpecError, match=r"symbol 'batch_size' .* tensor 'out' in the output spec .* size 2 \(from tensor 'x'\), but was of size 3"
        ):
            model.infer({"x": X, "y": Y})
        with neuropod.load_neuropod(write_toy(tmp_path / "b", op="extra")) as model, pytest.raises(
            SpecError, match="returned a tensor 'extra' that is not in its output spec"
        ):
            model.infer({"x": X, "y": Y})


def test_framework_exception_is_wrapped_and_chained(tmp_path: Path) -> None:
    with toy_plugin(), neuropod.load_neuropod(write_toy(tmp_path / "m", op="raise")) as model:
        with pytest.raises(BackendError, match="Backend toy==1.0.0 failed to run model 'toy_adder': RuntimeError: toy framework exploded") as info:
            model.infer({"x": X, "y": Y})
        assert isinstance(info.value.__cause__, RuntimeError)


def test_load_options_reach_the_backend(tmp_path: Path) -> None:
    with toy_plugin(), pytest.raises(NeuropodError, match=r"toy backend takes no options, got \['threads'\]"):
        neuropod.load_neuropod(write_toy(tmp_path / "m"), threads=4)


def test_no_backend_for_platform(tmp_path: Path) -> None:
    path = write_toy(tmp_path / "m")
    with pytest.raises(NoBackendError, match="No backend for platform 'toy' is installed"):
        neuropod.load_neuropod(path)


def test_unknown_platform(tmp_path: Path) -> None:
    path = write_toy(tmp_path / "m", platform="caffe")
    with toy_plugin(), pytest.raises(NoBackendError) as info:
        neuropod.load_neuropod(path)
    text = str(info.value)
    assert "needs platform 'caffe'" in text
    assert "no known Neuropod plugin runs platform 'caffe' (known: aoti, jax, onnx, python, tensorflow, tensorrt, torch_export, torchscript)" in text
    assert "runs platform 'toy', not 'caffe'" in text


def test_missing_package() -> None:
    with pytest.raises(PackageError, match="No Neuropod package at /nonexistent"):
        neuropod.load_neuropod("/nonexistent/model")


def test_run_test_data(tmp_path: Path) -> None:
    with toy_plugin():
        report = run_test_data(write_toy(tmp_path / "m"))
        assert report.passed and report.backend == "toy==1.0.0"
        np.testing.assert_array_equal(report.outputs["out"], X + Y)


def test_compare_outputs() -> None:
    assert compare_outputs({"a": np.ones(2)}, {"a": np.ones(2)}) == []
    assert compare_outputs({"a": np.ones(2)}, {"b": np.ones(2)}) == ["output 'b' is missing"]
    assert "shape (3,), expected (2,)" in compare_outputs({"a": np.ones(3)}, {"a": np.ones(2)})[0]
    assert "max abs difference 1" in compare_outputs({"a": np.ones(2)}, {"a": np.zeros(2)})[0]
    assert compare_outputs({"s": np.array(["a"], dtype=object)}, {"s": np.array(["a"])}) == []
    assert "expected ['b']" in compare_outputs({"s": np.array(["a"])}, {"s": np.array(["b"])})[0]


def test_threads_share_one_model(tmp_path: Path) -> None:
    with toy_plugin(), neuropod.load_neuropod(write_toy(tmp_path / "m")) as model:

        def work(n: int) -> None:
            x = np.full((n + 1, 2), n + 1, np.float32)
            for _ in range(200):
                assert model.infer({"x": x, "y": x})["out"][0, 0] == 2 * (n + 1)

        run_in_threads(work, 4)


def test_import_neuropod_imports_no_framework_or_numpy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, neuropod\n"
        "from neuropod import hookimpl, NeuropodError\n"
        "heavy = [m for m in ('numpy', 'torch', 'tensorflow', 'onnxruntime', 'pynvml') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lazy_public_names() -> None:
    assert neuropod.load_neuropod is neuropod.loader.load_neuropod
    assert "load_neuropod" in dir(neuropod)
    with pytest.raises(AttributeError):
        neuropod.not_a_thing  # noqa: B018


# --- the common call: the same answers and errors as the general path ---------------------------

# Inputs that fit the toy adder's spec (x, y: float32 [batch_size, 2]) or miss it one way each.
_CALLS = {
    "fits": {"x": X, "y": Y},
    "non-contiguous": {"x": np.asfortranarray(X), "y": Y},
    "a numpy scalar": {"x": np.float32(1), "y": Y},
    "wrong dtype": {"x": X.astype(np.float64), "y": Y},
    "wrong rank": {"x": X[0], "y": Y},
    "wrong fixed dim": {"x": np.zeros((2, 3), np.float32), "y": Y},
    "symbol mismatch": {"x": X, "y": np.zeros((3, 2), np.float32)},
    "missing input": {"x": X},
    "unknown input": {"x": X, "y": Y, "z": X},
    "a list, not an array": {"x": X.tolist(), "y": Y},
    "a read-only mapping": MappingProxyType({"x": X, "y": Y}),
    "not a mapping": [X, Y],
}


def _answer(model: neuropod.NeuropodModel, inputs: object) -> object:
    try:
        return model.infer(inputs)  # type: ignore[arg-type]
    except NeuropodError as e:
        return type(e), str(e)


@pytest.mark.parametrize("with_device", [False, True], ids=["infer(model, inputs, requested)", "+ output_device"])
@pytest.mark.parametrize("op", ["add", "wrong_shape", "extra", "raise", "mapping", "list", "float64"])
def test_the_common_call_answers_as_the_general_checks(tmp_path: Path, op: str, with_device: bool) -> None:
    """infer's path for the common call (checks compiled for the model, the hook called directly) gives
    every call the very outputs or error that the general checks give with every fast path switched off."""
    path = write_toy(tmp_path / "m", op=op)
    with (
        toy_plugin(with_device=with_device),
        neuropod.load_neuropod(path) as model,
        neuropod.load_neuropod(path) as general,
    ):
        assert model._fast is not None
        general._fast = None
        general._validator._fast_inputs = general._validator._fast_outputs = None
        for what, inputs in _CALLS.items():
            fast, slow = _answer(model, inputs), _answer(general, inputs)
            if isinstance(slow, dict):
                assert isinstance(fast, dict) and fast.keys() == slow.keys(), what
                for name in slow:
                    np.testing.assert_array_equal(fast[name], slow[name])
            else:
                assert fast == slow, what
        if op == "add":
            assert isinstance(_answer(model, _CALLS["fits"]), dict)
    with pytest.raises(NeuropodError, match="'toy_adder' is closed"):
        model.infer(_CALLS["fits"])
