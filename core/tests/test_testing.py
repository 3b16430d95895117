"""Meta-tests of the backend conformance suite (``neuropod.testing``): every
hook is exercised, the suite stays framework-free, and its pytest plugin
parametrizes and marks a backend's subclass."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import importlib_metadata

from neuropod import hookspecs
from neuropod.testing import BackendConformance, hooks_covered

HOOKS = {name for name, f in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(f, "neuropod_spec")}


def test_the_hooks_are_those_of_the_design() -> None:
    """The four every backend implements, and the optional ``infer_stream`` (decoupled models)."""
    assert {"supported_versions", "device_caps", "load_model", "infer", "infer_stream"} == HOOKS


def test_every_hook_is_exercised_by_the_suite() -> None:
    covered = hooks_covered()
    assert set().union(*covered.values()) == HOOKS, f"hooks without a conformance test: {HOOKS - set().union(*covered.values())}"
    assert not set().union(*covered.values()) - HOOKS, "a test claims a hook that does not exist"


def test_every_suite_test_says_which_hooks_it_exercises() -> None:
    tests = {n for n in dir(BackendConformance) if n.startswith("test_")}
    assert len(tests) >= 10
    assert tests == set(hooks_covered()), f"without @covers: {tests - set(hooks_covered())}"


def test_suite_is_a_pytest_plugin_through_pytests_entry_point() -> None:
    eps = {ep.name: ep.value for ep in importlib_metadata.entry_points(group="pytest11")}
    assert eps.get("neuropod") == "neuropod.testing"


def test_import_neuropod_does_not_import_the_suite_and_the_suite_imports_no_framework() -> None:
    code = (
        "import sys, neuropod\n"
        "assert 'neuropod.testing' not in sys.modules and 'pytest' not in sys.modules\n"
        "import neuropod.testing\n"
        "bad = [m for m in ('torch', 'tensorflow', 'onnxruntime', 'onnx', 'tensorrt') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


SUBCLASS = """
    import pytest
    from neuropod.testing import BackendConformance

    class TestMine(BackendConformance):
        platform = "mine"
        distribution = "neuropod-mine"
        dtypes = ("float32", "string")
        run_marks = [pytest.mark.skip(reason="needs the Mine accelerator")]
"""


def test_subclass_is_parametrized_over_its_dtypes_and_run_tests_get_its_marks(tmp_path: Path) -> None:
    (tmp_path / "test_mine.py").write_text(textwrap.dedent(SUBCLASS))
    run = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tmp_path / "test_mine.py")]
    collected = subprocess.run([*run, "--collect-only"], capture_output=True, text=True, cwd=tmp_path).stdout
    assert "test_mine.py::TestMine::test_infer_dtype[float32]" in collected
    assert "test_mine.py::TestMine::test_infer_dtype[string]" in collected
    assert "test_infer_dtype[int8]" not in collected
    assert collected.count("::TestMine::") == len(hooks_covered()) + 1  # one test per dtype
    # The tests that run a model skip with the backend's reason; the discovery
    # tests run and fail, since no "mine" plugin is installed.
    proc = subprocess.run([*run, "-rs", "-k", "dtype or threads or discovered"], capture_output=True, text=True, cwd=tmp_path)
    assert "3 skipped" in proc.stdout and "needs the Mine accelerator" in proc.stdout, proc.stdout
    assert "1 failed" in proc.stdout and "no entry point 'mine' in group 'neuropod.backends'" in proc.stdout
