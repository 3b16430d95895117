"""Shared helpers for the Python backend's tests: code trees, compiled extensions, a scikit-learn venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path

import pytest

EXTENSION_C = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *scale(PyObject *self, PyObject *arg) { return PyFloat_FromDouble(SCALE * PyFloat_AsDouble(arg)); }
static PyMethodDef methods[] = {{"scale", scale, METH_O, "x * SCALE"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "NAME", NULL, -1, methods};
PyMODINIT_FUNC PyInit_NAME(void) { return PyModule_Create(&mod); }
"""


def compile_extension(tmp: Path, name: str, scale: int) -> Path:
    """A real Python extension module ``name`` with ``scale(x) = x * scale``, built with this Python's headers."""
    cc = shutil.which("gcc") or shutil.which("cc")
    include = sysconfig.get_paths()["include"]
    if cc is None or not (Path(include) / "Python.h").is_file():
        pytest.skip("needs a C compiler and Python's headers to build an extension module")
    tmp.mkdir(parents=True, exist_ok=True)
    src = tmp / f"{name}.c"
    src.write_text(EXTENSION_C.replace("SCALE", str(scale)).replace("NAME", name))
    lib = tmp / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([cc, "-shared", "-fPIC", f"-I{include}", str(src), "-o", str(lib)], check=True)
    return lib


def write_code(root: Path, files: Mapping[str, str]) -> Path:
    """A code tree: relative path -> source."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def lock_envs(home: Path) -> list[str]:
    """The lock environments in a NEUROPOD_HOME, and anything half-built there."""
    envs = home / "envs"
    if not envs.is_dir():
        return []
    return sorted(p.name for p in envs.iterdir() if p.name.startswith(("lock-", ".tmp-", ".trash-")))


@pytest.fixture(scope="session")
def neuropod_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One NEUROPOD_HOME for the session: each lock environment is built once, then reused."""
    home = Path(os.environ.get("NEUROPOD_HOME") or tmp_path_factory.mktemp("neuropod-home"))
    os.environ["NEUROPOD_HOME"] = str(home)
    return home


SKLEARN = "scikit-learn==1.9.1"


@pytest.fixture(scope="session")
def sklearn_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv of its own with scikit-learn (this process has none), to train models as a user would."""
    venv = tmp_path_factory.mktemp("sklearn-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", SKLEARN], check=True)
    return python
