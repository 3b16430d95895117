"""The expression whitelist, and a model that computes something."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from neuropod_numpy_expr.expr import compile_expression
from neuropod_numpy_expr.packager import create_numpy_expr_neuropod

import neuropod
from neuropod.errors import PackageError

SPEC = [{"name": n, "dtype": "float64", "shape": ["batch"]} for n in ("x", "y")]


def test_arithmetic_and_functions() -> None:
    f = compile_expression("sqrt(x * x + y * y) - -1 / 2 + maximum(x, 0) ** 2", {"x", "y"}, "test")
    x, y = np.array([3.0, -1.0]), np.array([4.0, 0.0])
    np.testing.assert_allclose(f({"x": x, "y": y}), np.sqrt(x * x + y * y) + 0.5 + np.maximum(x, 0) ** 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("__import__('os').system('true')", "not allowed"),
        ("x.__class__", "not allowed"),
        ("(lambda: 1)()", "not allowed"),
        ("x[0]", "not allowed"),
        ("'text'", "not allowed"),
        ("open('/etc/passwd')", "not allowed"),
        ("z + 1", "uses 'z', which is not an input"),
        ("x +", "is not an expression"),
    ],
)
def test_anything_else_is_refused(text: str, message: str) -> None:
    with pytest.raises(PackageError, match=message):
        compile_expression(text, {"x", "y"}, "output 'out'")


def test_package_and_run(tmp_path: Path) -> None:
    x, y = np.array([1.0, 2.0, 3.0]), np.array([0.5, 0.5, 2.0])
    path = create_numpy_expr_neuropod(
        tmp_path / "hyp", "hyp", SPEC, [{"name": "out", "dtype": "float64", "shape": ["batch"]}],
        expressions={"out": "sqrt(x * x + y * y)"},
        test_input_data={"x": x, "y": y}, test_expected_out={"out": np.hypot(x, y)},
    )  # fmt: skip
    with neuropod.load_neuropod(path) as model:
        assert model.backend.platform == "numpy-expr"
        np.testing.assert_allclose(model.infer({"x": x, "y": y})["out"], np.hypot(x, y))


def test_unsafe_expression_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="not allowed"):
        create_numpy_expr_neuropod(
            tmp_path / "bad", "bad", SPEC, [{"name": "out", "dtype": "float64", "shape": ["batch"]}],
            expressions={"out": "__import__('os')"},
        )
    assert not (tmp_path / "bad").exists()
