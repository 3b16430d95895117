"""The Python backend against the core's conformance suite (``neuropod.testing``)."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from neuropod.backend import Backend
from neuropod.packagers import create_python_neuropod
from neuropod.testing import ALL_DTYPES, BackendConformance, accumulator_spec

from conftest import compile_extension

# Output out_<s> is a copy of input in_<s>: the model's own code, no framework.
COPY_MODEL = """
def get_model(data_root):
    def model(**inputs):
        return {"out_" + name[len("in_"):]: value.copy() for name, value in inputs.items()}
    return model
"""

# y = acc_out = acc_in + x: the conformance suite's accumulator (acc_out -> acc_in is its state).
ACCUMULATOR_MODEL = """
def get_model(data_root):
    def model(x, acc_in):
        y = acc_in + x
        return {"y": y, "acc_out": y.copy()}
    return model
"""


class TestPythonConformance(BackendConformance):
    platform = "python"
    distribution = "neuropod-python"
    # Listing backends must not import numpy either: the plugin reads nothing but names and PATH.
    framework_modules = ("numpy", "torch", "sklearn")
    dtypes = ALL_DTYPES
    custom_ops = True

    def make_package(
        self, tmp_path: Path, name: str, input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]],
        **packager_kwargs: Any,
    ) -> Path:
        code = tmp_path / f"{name}_code"
        code.mkdir()
        (code / "copy_model.py").write_text(COPY_MODEL)
        path: Path = create_python_neuropod(
            tmp_path / name, name, [], [{"python_root": code, "dirs_to_package": [""]}], "copy_model", "get_model",
            input_spec, output_spec, **packager_kwargs,
        )  # fmt: skip
        return path

    def make_accumulator_package(self, tmp_path: Path, name: str, **packager_kwargs: Any) -> Path:
        code = tmp_path / f"{name}_code"
        code.mkdir()
        (code / "accumulator.py").write_text(ACCUMULATOR_MODEL)
        input_spec, output_spec = accumulator_spec()
        path: Path = create_python_neuropod(
            tmp_path / name, name, [], [{"python_root": code, "dirs_to_package": [""]}], "accumulator", "get_model",
            input_spec, output_spec, **packager_kwargs,
        )  # fmt: skip
        return path

    def custom_op_library(self, tmp_path: Path) -> Path | None:
        """A real extension module (the python backend's custom ops are importable modules)."""
        return compile_extension(tmp_path, "fastops", 3)

    def framework_version(self, backend: Backend) -> str:
        return platform.python_version()
