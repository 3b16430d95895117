"""One small model packaged for five frameworks, and ``neuropod compare`` run on them once per session.

Each package is built by ``build_package.py`` in a process of its own (torch and TensorFlow must
never be imported in one process); the comparisons run through ``neuropod.cli.main``, whose
candidates each run in a worker process of their own.
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


def _missing(framework: str) -> list[str]:
    return [m for m in FRAMEWORKS[framework][2] if importlib.util.find_spec(m) is None]


def build(framework: str, directory: Path, perturb: bool = False) -> subprocess.Popen[str]:
    """Start building one package (``build_package.py`` in a fresh interpreter)."""
    missing = _missing(framework)
    if missing:
        pytest.skip(f"{framework} package: {', '.join(missing)} not installed (nox -s tests_compare installs them)")
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


@pytest.fixture(scope="session")
def onnx_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model as ONNX, with test data (every comparison's baseline)."""
    return finish("onnx", build("onnx", tmp_path_factory.mktemp("mlp")))


@pytest.fixture(scope="session")
def packages(onnx_package: Path) -> dict[str, Path]:
    """The model packaged for all five frameworks, in one directory (two builds at a time: CI machines have few
    cores)."""
    directory = onnx_package.parent
    others = [f for f in FRAMEWORKS if f != "onnx"]
    for framework in others:  # skip before building anything when a framework is missing
        if _missing(framework):
            build(framework, directory)
    paths = {"onnx": onnx_package}
    for i in range(0, len(others), 2):
        procs = {f: build(f, directory) for f in others[i : i + 2]}
        paths.update({f: finish(f, p) for f, p in procs.items()})
    return paths


@pytest.fixture(scope="session")
def frameworks_report(packages: dict[str, Path]) -> Report:
    """The five packages compared, ONNX (with the test data) as the baseline."""
    directory = packages["onnx"].parent
    candidates = [f"{FRAMEWORKS[f][0]}={packages[f].name}" for f in FRAMEWORKS]
    return compare(directory, "frameworks", candidates)


@pytest.fixture(scope="session")
def perturbed_report(onnx_package: Path) -> Report:
    """The ONNX package against an ONNX package with one weight changed (W2[2, 1] += 0.25)."""
    directory = onnx_package.parent
    perturbed = finish("onnx", build("onnx", directory, perturb=True))
    return compare(directory, "perturbed", [f"ONNX={onnx_package.name}", f"perturbed={perturbed.name}"])
