"""Custom ops for python packages: extension modules in ``0/ops/`` that the code imports by name.

The extension is a real one, compiled here from C with the running Python's
headers (skipped when there is no C compiler).
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import numpy as np

import neuropod
from neuropod.packagers import create_python_neuropod

from conftest import compile_extension

MODEL = """
import numpy as np
import fastops

def get_model(_):
    def model(x):
        return {"out": np.array([fastops.scale(float(v)) for v in x], dtype=np.float64)}
    return model
"""


def _package(tmp: Path, scale: int) -> Path:
    (tmp / "code").mkdir(parents=True)
    (tmp / "code" / "scaler.py").write_text(MODEL)
    x = np.array([1.0, 2.5], np.float64)
    path: Path = create_python_neuropod(
        tmp / "pkg", f"scaler{scale}", [], [{"python_root": tmp / "code", "dirs_to_package": [""]}], "scaler",
        "get_model", [{"name": "x", "dtype": "float64", "shape": [None]}],
        [{"name": "out", "dtype": "float64", "shape": [None]}], custom_ops=[compile_extension(tmp / "ext", "fastops", scale)],
        test_input_data={"x": x}, test_expected_out={"out": x * scale},
    )  # fmt: skip
    return path


def test_custom_op_modules_are_importable_by_the_code_and_isolated(tmp_path: Path) -> None:
    three, five = _package(tmp_path / "a", 3), _package(tmp_path / "b", 5)
    assert [p.name for p in (three / "0" / "ops").iterdir()] == [f"fastops{sysconfig.get_config_var('EXT_SUFFIX')}"]
    x = np.array([0.5, -2.0, 4.0], np.float64)
    with neuropod.load_neuropod(three) as m3, neuropod.load_neuropod(five) as m5:
        np.testing.assert_array_equal(m3.infer({"x": x})["out"], x * 3)
        np.testing.assert_array_equal(m5.infer({"x": x})["out"], x * 5)
        assert "fastops" not in sys.modules and "scaler" not in sys.modules
    with neuropod.load_neuropod(five, use_ope=True) as worker:
        np.testing.assert_array_equal(worker.infer({"x": x})["out"], x * 5)
