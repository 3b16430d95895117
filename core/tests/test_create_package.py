"""The packaging path every ``create_*_neuropod`` shares: ``create_package`` and ``PackageOptions``."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

import neuropod
from neuropod.create import PackageOptions, create_package, package_options
from neuropod.errors import PackageError
from neuropod.package import read_package

from _toy_backend import ADD_CONFIG, PLATFORM, toy_plugin

X = np.array([[1, 2], [3, 4]], np.float32)
Y = np.array([[7, 8], [9, 10]], np.float32)


def _create(path: Path, op: str = "add", **options: object) -> Path:
    return create_package(
        "create_toy_neuropod", path, "toy_adder", PLATFORM, ADD_CONFIG["input_spec"], ADD_CONFIG["output_spec"],
        {"0/data/op.json": json.dumps({"op": op}).encode()}, options,
        backend_config={"answer": 42}, exported_with={"compiled_for": "toy 1.0.0"},
        device_requirements={"device": "cpu"}, default_version_range="==1.0.0",
    )  # fmt: skip


def test_writes_checks_and_records(tmp_path: Path) -> None:
    with toy_plugin():
        path = _create(tmp_path / "m", test_input_data={"x": X, "y": Y}, test_expected_out={"out": X + Y},
                       input_tensor_device={"x": "CPU"}, package_as_zip=True)  # fmt: skip
        assert zipfile.is_zipfile(path)
        package = read_package(path)
        config = package.config
        assert config.platform_version_semver == "==1.0.0", "the packager's default range"
        assert config.input_tensor_device == {"x": "CPU", "y": "GPU"}
        assert config.exported_with is not None and config.exported_with["compiled_for"] == "toy 1.0.0"
        assert config.exported_with["neuropod"] == neuropod.__version__
        assert config.device_requirements == {"device": "cpu"}
        assert json.loads((package.root / "0" / "config.json").read_text()) == {"answer": 42}
        inputs, expected = package.test_data()
        np.testing.assert_array_equal(inputs["x"], X)
        assert expected is not None
        np.testing.assert_array_equal(expected["out"], X + Y)
        with neuropod.load_neuropod(path) as model:
            np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)


def test_caller_range_wins_over_the_default(tmp_path: Path) -> None:
    with toy_plugin():
        path = _create(tmp_path / "m", platform_version_semver="^1.0")
    assert read_package(path).config.platform_version_semver == "^1.0"


def test_a_package_that_fails_its_test_data_is_removed(tmp_path: Path) -> None:
    with toy_plugin(), pytest.raises(PackageError, match="does not reproduce its expected test output"):
        _create(tmp_path / "m", test_input_data={"x": X, "y": Y}, test_expected_out={"out": X - Y})
    assert not (tmp_path / "m").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".neuropod-")], "no staging left behind"


def test_unknown_keyword_is_a_type_error_naming_the_packager(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"create_toy_neuropod\(\) got an unexpected keyword argument 'test_inputs'"):
        _create(tmp_path / "m", test_inputs={"x": X})
    assert not (tmp_path / "m").exists()


def test_package_options_fills_defaults() -> None:
    opts = package_options("p", {"test_rtol": 0.5}, {"test_rtol": 1e-3, "test_atol": 1e-4})
    assert opts["test_rtol"] == 0.5 and opts["test_atol"] == 1e-4
    assert opts["custom_ops"] == () and opts["package_as_zip"] is False and opts["persist_test_data"] is True
    assert "platform_version_semver" not in opts, "absent means: the packager's default range"
    assert set(opts) <= set(PackageOptions.__annotations__)
