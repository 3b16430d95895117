"""What the comparison tests share: the five frameworks, building a package in a process of its own
(``build_package.py``), and running ``neuropod compare`` (``neuropod.cli.main``) to a :class:`Report`.

(Test modules import this, not conftest: the name ``conftest`` is shared by every test directory.)
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from neuropod.cli import main

HERE = Path(__file__).resolve().parent
BUILD = HERE / "build_package.py"

#: Framework (build_package.py's name) -> the candidate's label, the backend id's platform, and the modules it needs.
FRAMEWORKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "onnx": ("ONNX", "onnx", ("neuropod_onnx", "onnx", "onnxruntime")),
    "torch_export": ("torch.export", "torch_export", ("neuropod_torch", "torch")),
    "torchscript": ("TorchScript", "torchscript", ("neuropod_torchscript", "torch")),
    "jax": ("JAX", "jax", ("neuropod_jax", "jax")),
    "tensorflow": ("TensorFlow", "tensorflow", ("neuropod_tensorflow", "tensorflow")),
}

#: Short timings: the test checks the figures exist, not what they are.
TIMINGS = ["--duration", "0.2", "--warmup", "2", "--batch-sizes", "1,8"]


@dataclass
class Report:
    """One ``neuropod compare`` run: its exit status, the --json file read back, the --html file."""

    exit_code: int
    data: dict[str, Any]
    html: Path
    json: Path
    stdout: str


def missing_modules(framework: str) -> list[str]:
    return [m for m in FRAMEWORKS[framework][2] if importlib.util.find_spec(m) is None]


def build(framework: str, directory: Path, perturb: bool = False) -> subprocess.Popen[str]:
    """Start building one package (``build_package.py`` in a fresh interpreter)."""
    absent = missing_modules(framework)
    if absent:
        pytest.skip(f"{framework} package: {', '.join(absent)} not installed (nox -s tests_compare installs them)")
    args = [sys.executable, str(BUILD), framework, str(directory), *(["--perturb"] if perturb else [])]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(framework: str, proc: subprocess.Popen[str]) -> Path:
    out, err = proc.communicate(timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"building the {framework} package failed ({proc.returncode}):\n{err[-4000:]}")
    return Path(out.strip().splitlines()[-1])


def compare(directory: Path, name: str, candidates: list[str]) -> Report:
    """Run ``neuropod compare`` in ``directory`` (candidates named relative to it, as the report shows them)
    with short timings, writing NAME.json and NAME.html there."""
    out = io.StringIO()
    here = os.getcwd()
    os.chdir(directory)
    try:
        code = main(["compare", *candidates, *TIMINGS, "--json", f"{name}.json", "--html", f"{name}.html"], out=out)
    finally:
        os.chdir(here)
    json_path, html_path = directory / f"{name}.json", directory / f"{name}.html"
    data = json.loads(json_path.read_text()) if json_path.exists() else {}
    return Report(code, data, html_path, json_path, out.getvalue())
