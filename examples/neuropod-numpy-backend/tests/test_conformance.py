"""The numpy-expr backend against Neuropod's backend conformance suite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuropod_numpy_expr.packager import create_numpy_expr_neuropod

from neuropod.testing import ALL_DTYPES, BackendConformance, accumulator_spec


class TestNumpyExprConformance(BackendConformance):
    platform = "numpy-expr"
    distribution = "neuropod-numpy-expr"
    framework_modules = ()  # numpy is the framework, and the core imports it anyway
    dtypes = ALL_DTYPES

    def make_package(
        self, tmp_path: Path, name: str, input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]],
        **packager_kwargs: Any,
    ) -> Path:
        """Each output's expression is its input's name: a copy."""
        expressions = {o["name"]: i["name"] for i, o in zip(input_spec, output_spec)}
        return create_numpy_expr_neuropod(
            tmp_path / name, name, input_spec, output_spec, expressions=expressions, **packager_kwargs
        )

    def make_accumulator_package(self, tmp_path: Path, name: str, **packager_kwargs: Any) -> Path:
        """The suite's stateful model: y and the new state acc_out are both acc_in + x."""
        input_spec, output_spec = accumulator_spec()
        return create_numpy_expr_neuropod(
            tmp_path / name, name, input_spec, output_spec,
            expressions={"y": "acc_in + x", "acc_out": "acc_in + x"}, **packager_kwargs,
        )
