"""create_python_neuropod onto a path that holds a package: it fails before pip resolves anything,
and ``overwrite=True`` replaces the package."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import neuropod
from neuropod.errors import PackageError
from neuropod.packagers import create_python_neuropod

from conftest import write_code


def _package(tmp_path: Path, dest: Path, add: int, **options: Any) -> Path:
    code = write_code(tmp_path / f"code{add}", {"adder.py": f"def get_model(_):\n    return lambda x: {{'out': x + {add}}}\n"})
    path: Path = create_python_neuropod(
        dest, f"add{add}", [], [{"python_root": code, "dirs_to_package": [""]}], "adder", "get_model",
        [{"name": "x", "dtype": "int64", "shape": [None]}], [{"name": "out", "dtype": "int64", "shape": [None]}],
        **options,
    )  # fmt: skip
    return path


def test_an_existing_path_fails_before_the_requirements_are_resolved(tmp_path: Path) -> None:
    dest = _package(tmp_path, tmp_path / "pkg", 1)
    # pip could not resolve this; the error must be about the path, found first.
    with pytest.raises(PackageError) as info:
        _package(tmp_path, dest, 2, requirements="neuropod-no-such-distribution==1.0\n")
    assert str(info.value) == (
        f"{dest} already exists: pass overwrite=True to create_python_neuropod() to replace it (the old package "
        "stays until the new one is written and checked), or choose another path"
    )
    assert json.loads((dest / "config.json").read_text())["name"] == "add1"


def test_overwrite_replaces_the_package(tmp_path: Path) -> None:
    dest = _package(tmp_path, tmp_path / "pkg", 1)
    x = np.arange(4, dtype=np.int64)
    again = _package(tmp_path, dest, 5, overwrite=True, test_input_data={"x": x}, test_expected_out={"out": x + 5})
    assert again == dest and json.loads((dest / "config.json").read_text())["name"] == "add5"
    with neuropod.load_neuropod(dest) as model:
        np.testing.assert_array_equal(model.infer({"x": x})["out"], np.array([5, 6, 7, 8]))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
