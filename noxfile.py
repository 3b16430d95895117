"""Every test, lint, type, benchmark and build session.

    nox -t ci                      what CI runs (README's test command)
    nox -s tests_core              core tests on Python 3.10 to 3.13
    nox -s tests_onnx              the ONNX plugin on onnxruntime 1.31.1, 1.24.4 and 1.20.1
    nox -s tests_envs              two real backend environments (onnxruntime 1.20.1, 1.24.4) beside 1.31.1
    nox -s tests_torchscript       the TorchScript plugin on torch 2.13.0 and 2.14.1
    nox -s tests_tensorflow        the TensorFlow plugin on tensorflow-cpu 2.21.0, 2.18.1 and 2.16.2
    nox -s tests_tensorrt          the TensorRT plugin (GPU tests skip without a GPU and TensorRT)
    nox -s lint types              ruff, mypy
    nox -s bench                   benchmarks (print ratios against the raw framework)
    nox -s build                   wheels for the core and every plugin into dist/

Plugins are discovered from ``plugins/``; each is installed next to the core
from source, never from PyPI (PyPI's old ``neuropod`` 0.2 is another project).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import nox
from packaging.version import Version

ROOT = Path(__file__).parent
CORE = ROOT / "core"
PLUGINS = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file())
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
DEFAULT_PYTHON = "3.11"

# onnxruntime releases the ONNX plugin is tested against; the first is the
# one benchmarks use.
ONNXRUNTIME_VERSIONS = ["1.31.1", "1.24.4", "1.20.1"]
ONNXRUNTIME_DEFAULT = ONNXRUNTIME_VERSIONS[0]



def _find_pythons() -> None:
    """Put pyenv's interpreters on PATH when ``python3.X`` is not there (pyenv
    shims only answer for the active version), so every listed Python runs."""
    import glob
    import subprocess

    missing = []
    for version in PYTHONS:
        exe = shutil.which(f"python{version}")
        ok = exe is not None and subprocess.run([exe, "--version"], capture_output=True).returncode == 0
        if not ok:
            missing.append(version)
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    dirs = [sorted(glob.glob(f"{root}/versions/{v}.*/bin"))[-1:] for v in missing]
    extra = [d[0] for d in dirs if d]
    if extra:
        os.environ["PATH"] = os.pathsep.join([*extra, os.environ.get("PATH", "")])


_find_pythons()

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True


def _pytest(session: nox.Session, *paths: str, env: dict[str, str] | None = None) -> None:
    # A private package cache and NEUROPOD_HOME (backend environments) per run,
    # removed afterwards: tests leave nothing behind and see none of the user's.
    with tempfile.TemporaryDirectory(prefix="neuropod-cache-") as cache, \
            tempfile.TemporaryDirectory(prefix="neuropod-home-") as home:  # fmt: skip
        session.run(
            "python", "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *paths, *session.posargs,
            env={"NEUROPOD_CACHE_DIR": cache, "NEUROPOD_HOME": home, **(env or {})},
        )


@nox.session(python=PYTHONS, tags=["ci"])
def tests_core(session: nox.Session) -> None:
    """The core's tests, with no backend framework installed."""
    session.install(f"{CORE}[test]")
    _pytest(session, "core/tests")


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
@nox.parametrize("onnxruntime", ONNXRUNTIME_VERSIONS)
def tests_onnx(session: nox.Session, onnxruntime: str) -> None:
    """The ONNX plugin against one onnxruntime release (all three run in CI: they are small)."""
    _install_onnx(session, onnxruntime)
    _pytest(session, "plugins/neuropod-onnx/tests")


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def tests_envs(session: nox.Session) -> None:
    """Two real backend environments (onnxruntime 1.20.1 and 1.24.4) beside this session's 1.31.1:
    creation, listing, resolution between them, and both models running at once (downloads ~30 MB)."""
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-onnx'}[test]", f"onnxruntime=={ONNXRUNTIME_DEFAULT}")
    _pytest(session, "plugins/neuropod-onnx/tests/test_environments.py", env={"NEUROPOD_TEST_ENVS": "1"})


# torch releases the TorchScript plugin is tested against. 2.13.0 (a CPU
# build) is the default and the one CI runs; 2.14.1 is a CUDA build of
# several GB (CPU-tested here), run by `nox -s tests_torchscript`.
TORCH_VERSIONS = [nox.param("2.13.0", tags=["ci"]), "2.14.1"]
TORCH_DEFAULT = "2.13.0"


@nox.session(python=DEFAULT_PYTHON)
@nox.parametrize("torch", TORCH_VERSIONS)
def tests_torchscript(session: nox.Session, torch: str) -> None:
    """The TorchScript plugin against one torch release (needs g++ for the custom-op test)."""
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-torchscript'}[test]", f"torch=={torch}")
    _pytest(session, "plugins/neuropod-torchscript/tests")


# TensorFlow releases the TensorFlow plugin is tested against, as
# tensorflow-cpu; the newest is the default and the one CI runs.
TENSORFLOW_VERSIONS = [nox.param("2.21.0", tags=["ci"]), "2.18.1", "2.16.2"]
TENSORFLOW_DEFAULT = "2.21.0"


@nox.session(python=DEFAULT_PYTHON)
@nox.parametrize("tensorflow", TENSORFLOW_VERSIONS)
def tests_tensorflow(session: nox.Session, tensorflow: str) -> None:
    """The TensorFlow plugin against one tensorflow-cpu release (needs g++ for the custom-op test)."""
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-tensorflow'}[test]", f"tensorflow-cpu=={tensorflow}")
    _pytest(session, "plugins/neuropod-tensorflow/tests")


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def tests_tensorrt(session: nox.Session) -> None:
    """The TensorRT plugin without TensorRT: planning and packaging tests run, GPU tests skip with the reason."""
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-tensorrt'}[test]")
    _pytest(session, "plugins/neuropod-tensorrt/tests")


def _install_onnx(session: nox.Session, onnxruntime: str) -> None:
    # onnxruntime-extensions ships the custom-op library the tests register;
    # its newest releases follow onnxruntime, so older runtimes get an older one.
    extensions = "onnxruntime-extensions" if Version(onnxruntime) >= Version("1.24") else "onnxruntime-extensions<0.14"
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-onnx'}[test]", f"onnxruntime=={onnxruntime}", extensions)


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff over the whole repository."""
    session.install("ruff==0.17.6")  # pinned: a new rule must not break CI overnight
    session.run("ruff", "check", ".")


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def types(session: nox.Session) -> None:
    """mypy (strict) over the core and the plugins."""
    session.install("mypy==2.4.1", f"{CORE}", *[str(p) for p in PLUGINS], f"torch=={TORCH_DEFAULT}")
    session.run("mypy", "core/src/neuropod", *[str(next((p / "src").iterdir())) for p in PLUGINS])


@nox.session(python=DEFAULT_PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks: our call against the raw framework call, same run."""
    session.install(
        f"{CORE}", f"{ROOT / 'plugins/neuropod-onnx'}", f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx",
        f"{ROOT / 'plugins/neuropod-torchscript'}", f"torch=={TORCH_DEFAULT}",
        f"{ROOT / 'plugins/neuropod-tensorflow'}", f"tensorflow-cpu=={TENSORFLOW_DEFAULT}",
    )
    for script in sorted((ROOT / "bench").glob("bench_*.py")):
        session.run("python", str(script), *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def build(session: nox.Session) -> None:
    """Wheels and sdists for the core and every plugin, into dist/."""
    session.install("build", "twine")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for project in [CORE, *PLUGINS]:
        session.run("python", "-m", "build", "--outdir", str(dist), str(project))
    session.run("twine", "check", "--strict", *sorted(str(p) for p in dist.iterdir()))
    _check_plugin_needs_our_core(session, dist)


def _check_plugin_needs_our_core(session: nox.Session, dist: Path) -> None:
    """A plugin wheel offered without our core must fail to install, not pull another `neuropod`."""
    wheels = Path(tempfile.mkdtemp(prefix="plugin-only-"))
    for whl in dist.glob("neuropod_onnx-*.whl"):
        shutil.copy(whl, wheels)
    venv = Path(tempfile.mkdtemp(prefix="venv-")) / "v"
    session.run("python", "-m", "venv", str(venv))
    py = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    out = session.run(
        str(py), "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(wheels), "neuropod-onnx",
        success_codes=[1], silent=True, external=True,
    )
    if "No matching distribution found for neuropod" not in str(out):
        session.error(f"installing the plugin alone did not fail on the missing core:\n{out}")
    session.log("ok: the plugin alone fails with 'No matching distribution found for neuropod<0.5,>=0.4'")
