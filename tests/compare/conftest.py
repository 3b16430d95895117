"""One small model packaged for five frameworks, and ``neuropod compare`` run on them once per session.

Each package is built by ``build_package.py`` in a process of its own (torch and TensorFlow must
never be imported in one process); the comparisons run through ``neuropod.cli.main``, whose
candidates each run in a worker process of their own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compare_support import FRAMEWORKS, Report, build, compare, finish, missing_modules


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
        if missing_modules(framework):
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
