"""The loaded model: compiled expressions, evaluated on each call."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from neuropod.errors import NeuropodError, PackageError
from neuropod.package import Package
from neuropod_numpy_expr import MODEL_FILE
from neuropod_numpy_expr.expr import Evaluator, compile_expression


class ExprModel:
    def __init__(self, name: str, outputs: dict[str, Evaluator], dtypes: dict[str, str]) -> None:
        self.name = name
        self.outputs = outputs
        self.dtypes = dtypes

    @classmethod
    def load(cls, package: Package, device: str, options: Mapping[str, Any]) -> ExprModel:
        name = package.name
        if options:
            raise NeuropodError(f"The numpy-expr backend takes no load options; got {', '.join(map(repr, options))}")
        if device != "cpu":
            raise NeuropodError(f"Model {name!r}: the numpy-expr backend runs on the CPU only, not {device!r}")
        if package.config.custom_ops:
            raise PackageError(f"Model {name!r} has custom ops, which the numpy-expr backend cannot load")
        path = package.data_dir / MODEL_FILE
        try:
            exprs = json.loads(path.read_text())["outputs"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PackageError(f"Model {name!r}: {path} is not a numpy-expr model ({type(e).__name__}: {e})") from None
        inputs = {s.name for s in package.config.input_spec}
        missing = [s.name for s in package.config.output_spec if s.name not in exprs]
        if missing:
            raise PackageError(f"Model {name!r}: no expression for output(s) {', '.join(map(repr, missing))}")
        compiled = {
            out: compile_expression(text, inputs, f"output {out!r} of model {name!r}") for out, text in exprs.items()
        }
        return cls(name, compiled, {s.name: s.dtype for s in package.config.output_spec})

    def run(self, inputs: Mapping[str, np.ndarray], requested: Sequence[str] | None) -> dict[str, np.ndarray]:
        names = list(requested) if requested is not None else list(self.dtypes)
        out = {}
        for name in names:
            try:
                value = self.outputs[name](inputs)
            except KeyError as e:
                raise NeuropodError(f"Model {self.name!r}: output {name!r} needs input {e.args[0]!r}, which was not given") from None
            dtype = self.dtypes[name]
            # Arithmetic can widen (int8 + int8 stays, but 2 * x may not): keep the spec's dtype.
            out[name] = np.asarray(value) if dtype == "string" else np.asarray(value, dtype=dtype)
        return out
