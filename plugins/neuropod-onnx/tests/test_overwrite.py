"""Packaging onto a path that holds a package: an error that says how to replace it, and ``overwrite=True``."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest

import neuropod
from neuropod.errors import PackageError
from neuropod.packagers import create_onnx_neuropod
from neuropod.testdata import run_test_data

from conftest import ADDER_INPUT_SPEC, ADDER_OUTPUT_SPEC, xy


def _package(path: Path, model: onnx.ModelProto, name: str, **options: object) -> Path:
    return create_onnx_neuropod(path, name, ADDER_INPUT_SPEC, ADDER_OUTPUT_SPEC, onnx_model=model, **options)


def _name(path: Path) -> str:
    if path.is_dir():
        return str(json.loads((path / "config.json").read_text())["name"])
    with zipfile.ZipFile(path) as zf:
        return str(json.loads(zf.read("config.json"))["name"])


def _runs_as_the_adder(path: Path) -> None:
    inputs = xy(3)
    with neuropod.load_neuropod(path) as model:
        out = model.infer(inputs)
    np.testing.assert_allclose(out["out"], inputs["x"] + inputs["y"], rtol=1e-6)
    np.testing.assert_allclose(out["doubled"], (inputs["x"] + inputs["y"]) * 2, rtol=1e-6)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_an_existing_package_is_kept_and_the_error_says_how_to_replace_it(tmp_path: Path, adder_model) -> None:
    path = _package(tmp_path / "adder", adder_model, "first")
    with pytest.raises(PackageError) as info:
        _package(tmp_path / "adder", adder_model, "second")
    assert str(info.value) == (
        f"{tmp_path / 'adder'} already exists: pass overwrite=True to create_onnx_neuropod() to replace it "
        "(the old package stays until the new one is written and checked), or choose another path"
    )
    assert _name(path) == "first"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(("first_zip", "second_zip"), [(False, False), (False, True), (True, True), (True, False)])
def test_overwrite_replaces_the_package(tmp_path: Path, adder_model, first_zip: bool, second_zip: bool) -> None:
    path = tmp_path / "adder.neuropod"
    _package(path, adder_model, "first", package_as_zip=first_zip)
    inputs = xy(2)
    again = _package(path, adder_model, "second", package_as_zip=second_zip, overwrite=True, test_input_data=inputs,
                     test_expected_out={"out": inputs["x"] + inputs["y"]})  # fmt: skip
    assert again == path and path.is_file() is second_zip
    assert _name(path) == "second"
    _runs_as_the_adder(path)
    assert _leftovers(tmp_path) == []


def test_a_new_package_that_fails_its_check_leaves_the_old_one(tmp_path: Path, adder_model) -> None:
    path = _package(tmp_path / "adder", adder_model, "first")
    before = sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))
    inputs = xy(2)
    with pytest.raises(PackageError, match="does not reproduce its expected test output"):
        _package(path, adder_model, "second", overwrite=True, test_input_data=inputs,
                 test_expected_out={"out": inputs["x"] - inputs["y"]})  # fmt: skip
    assert _name(path) == "first"
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*")) == before
    _runs_as_the_adder(path)
    assert _leftovers(tmp_path) == []


def test_overwrite_replaces_only_a_package(tmp_path: Path, adder_model) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("keep me")
    text_file = tmp_path / "model.txt"
    text_file.write_text("not a zip")
    for path in (folder, text_file):
        with pytest.raises(PackageError, match=r"exists and is not a Neuropod package .*remove it yourself"):
            _package(path, adder_model, "adder", overwrite=True)
    assert (folder / "todo.txt").read_text() == "keep me" and text_file.read_text() == "not a zip"
    with pytest.raises(TypeError, match="overwrite must be True or False"):
        _package(tmp_path / "new", adder_model, "adder", overwrite="yes")
    assert not (tmp_path / "new").exists()


def test_demo_run_again_into_the_same_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from neuropod import cli

    demo_dir = tmp_path / "demo"
    assert cli.main(["demo", "onnx", "--dir", str(demo_dir)], io.StringIO()) == 0
    package = demo_dir / "demo_adder.neuropod"
    first = package.stat().st_ino
    capsys.readouterr()
    assert cli.main(["demo", "onnx", "--dir", str(demo_dir)], io.StringIO()) == 2
    assert capsys.readouterr().err == (
        f"neuropod demo: error: --dir {demo_dir} already holds demo_adder.neuropod (from an earlier run?): "
        "pass --overwrite to replace it, or choose another --dir\n"
    )
    assert package.stat().st_ino == first, "the earlier package is left alone"
    out = io.StringIO()
    assert cli.main(["demo", "onnx", "--dir", str(demo_dir), "--overwrite"], out) == 0
    assert f"wrote {package} in" in out.getvalue()
    assert package.stat().st_ino != first
    report = run_test_data(package)  # the demo's own inputs and expected outputs, stored by its builder
    assert report.passed and report.expected is not None
    assert sorted(p.name for p in demo_dir.iterdir()) == ["demo_adder.neuropod"]
