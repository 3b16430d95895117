"""Two real backend environments (onnxruntime 1.20.1 and 1.24.4) beside this
process's onnxruntime: listing, resolution between them, removal, failures,
and two models that need different onnxruntime versions loaded at once.

They download onnxruntime, so they run only with ``NEUROPOD_TEST_ENVS=1``
(``nox -s tests_envs`` sets it). The environments are made once per session
in a temporary ``NEUROPOD_HOME``; the core and the plugin come from where
this process's were installed from (see ``neuropod.envs``).
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import neuropod
from neuropod import cli, envs
from neuropod.errors import NeuropodError
from neuropod_onnx import _installed

from conftest import NEWER, OLD, xy

pytestmark = [
    pytest.mark.envs,
    pytest.mark.skipif(
        os.environ.get("NEUROPOD_TEST_ENVS") != "1",
        reason="creates backend environments (downloads onnxruntime 1.20.1 and 1.24.4): set NEUROPOD_TEST_ENVS=1",
    ),
]

HERE = _installed()[0][1]  # this process's onnxruntime (or onnxruntime-gpu), e.g. 1.31.1
# two_envs (conftest.py): the session's environments of OLD and NEWER, shared with test_compare_environments.py.


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(list(argv), out)
    return code, out.getvalue()


@pytest.fixture
def package(tmp_path: Path) -> Callable[[str], Path]:
    """The demo adder ((x + y) * 2 over [batch_size, 2]) packaged with a given range."""
    from neuropod.packagers import create_onnx_neuropod
    from neuropod_onnx.demo import demo_model_bytes

    def make(version_range: str) -> Path:
        name = "adder_" + "".join(c if c.isalnum() else "_" for c in version_range)
        path: Path = create_onnx_neuropod(
            tmp_path / f"{name}.neuropod", name, onnx_model=demo_model_bytes(),
            input_spec=[{"name": n, "dtype": "float32", "shape": ["batch_size", 2]} for n in ("x", "y")],
            output_spec=[{"name": "out", "dtype": "float32", "shape": ["batch_size", 2]}],
            platform_version_semver=version_range,
        )  # fmt: skip
        return path

    return make


def chosen_row(text: str) -> str:
    rows = [line for line in text.splitlines() if line.lstrip().startswith("* ")]
    assert len(rows) == 1, text
    return rows[0]


def test_both_listed_with_what_they_run(two_envs: dict[str, envs.Environment]) -> None:
    listed = {e.name: e for e in envs.list_environments()}
    assert set(listed) == {f"onnx-{OLD}", f"onnx-{NEWER}"}
    for version, env in two_envs.items():
        # What the environment's own interpreter says is installed there...
        there = subprocess.run(
            [str(env.python), "-c", "import importlib.metadata as m; print(m.version('onnxruntime'))"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        assert there == version
        # ...is what its plugin reported and the record holds.
        (backend, caps), = listed[env.name].backends
        assert (backend.platform, backend.version, backend.framework) == ("onnx", there, "onnxruntime")
        assert backend.location == f"env:onnx-{there}" and backend.plugin == "onnx"
        assert backend.plugin_distribution.startswith("neuropod-onnx ") and caps.cpu
        assert listed[env.name].spec == f"onnx=={version}" and listed[env.name].python_version
    code, text = run_cli("env", "list")
    assert code == 0 and f"onnx-{OLD}" in text and f"onnx=={NEWER} (cpu)" in text
    code, text = run_cli("backends")
    assert "Backend environments" in text and f"env:onnx-{OLD}" in text and f"onnx=={HERE}" in text


def test_range_only_the_old_env_satisfies(two_envs: Any, package: Callable[[str], Path]) -> None:
    code, text = run_cli("explain", str(package("~1.20")), "--quiet-spec")
    assert code == 0 and f"Chosen: onnx=={OLD} on cpu." in text
    assert f"env:onnx-{OLD}" in chosen_row(text)


def test_running_version_runs_in_process(two_envs: Any, package: Callable[[str], Path]) -> None:
    code, text = run_cli("explain", str(package(f"=={HERE}")), "--quiet-spec")
    assert code == 0 and f"Chosen: onnx=={HERE} on cpu." in text and "in-process" in chosen_row(text)


def test_range_only_the_newer_env_satisfies(two_envs: Any, package: Callable[[str], Path]) -> None:
    code, text = run_cli("explain", str(package("~1.24")), "--quiet-spec")
    assert code == 0 and f"Chosen: onnx=={NEWER} on cpu." in text and f"env:onnx-{NEWER}" in chosen_row(text)


def test_any_version_prefers_in_process(two_envs: Any, package: Callable[[str], Path]) -> None:
    code, text = run_cli("explain", str(package("*")), "--quiet-spec")
    assert code == 0 and "in-process" in chosen_row(text)
    assert text.count("+  onnx==") == 2  # both environments could have run it


def test_range_nobody_satisfies_is_rejected_with_every_candidate(two_envs: Any, package: Callable[[str], Path]) -> None:
    with pytest.warns(UserWarning, match="not checked by loading it.*neuropod env create onnx==VERSION"):
        path = package("<1.0")
    code, text = run_cli("explain", str(path), "--quiet-spec")
    assert code == 1 and "No backend can run it" in text and "neuropod env create onnx==VERSION" in text
    for version, where in ((HERE, "in-process"), (OLD, f"env:onnx-{OLD}"), (NEWER, f"env:onnx-{NEWER}")):
        row = next(line for line in text.splitlines() if f"onnx=={version} " in line)
        assert where in row and f"version {version} is not in '<1.0'" in row and row.lstrip().startswith("-")


def test_two_versions_side_by_side(two_envs: dict[str, envs.Environment], package: Callable[[str], Path]) -> None:
    inputs = xy(3)
    want = (inputs["x"] + inputs["y"]) * 2
    with neuropod.load_neuropod(package("~1.20")) as old, neuropod.load_neuropod(package(f"=={HERE}")) as here:
        assert (old.backend.id, old.backend.location) == (f"onnx=={OLD}", f"env:onnx-{OLD}")
        assert (here.backend.id, here.backend.location) == (f"onnx=={HERE}", "in-process")
        # The old one really runs in a worker started from its environment's interpreter.
        assert Path(old.python) == two_envs[OLD].python  # type: ignore[attr-defined]
        for _ in range(3):  # interleaved calls on both
            np.testing.assert_allclose(old.infer(inputs)["out"], want, rtol=1e-6)
            np.testing.assert_allclose(here.infer(inputs)["out"], want, rtol=1e-6)


def test_remove(two_envs: dict[str, envs.Environment]) -> None:
    # A copy of a real environment, so the session's two stay for the other tests.
    source = two_envs[OLD].path
    shutil.copytree(source, source.parent / "doomed", symlinks=True)
    assert envs.get_environment("doomed").ok
    code, text = run_cli("env", "remove", "doomed")
    assert code == 0 and "Removed backend environment 'doomed'" in text
    assert not (source.parent / "doomed").exists()
    assert "doomed" not in {e.name for e in envs.list_environments()}


def test_bad_spec(two_envs: Any) -> None:
    with pytest.raises(NeuropodError, match=r"is not PLATFORM==VERSION.*'onnx==1.20.1'"):
        envs.create_environment("onnxruntime>=1.20", out=io.StringIO())
    with pytest.raises(NeuropodError, match="unknown platform 'onnxruntime'"):
        envs.create_environment("onnxruntime==1.20.1", out=io.StringIO())


def test_failed_install_leaves_no_half_environment(two_envs: Any) -> None:
    before = sorted(os.listdir(envs.envs_dir()))
    out = io.StringIO()
    with pytest.raises(NeuropodError, match=r"(?s)pip install of onnx==0.0.1 .* failed.*onnxruntime==0.0.1") as info:
        envs.create_environment("onnx==0.0.1", out=out)
    assert "No matching distribution found for onnxruntime==0.0.1" in str(info.value)
    # A line per step with its time; pip's output only in the error (or with verbose=True).
    assert re.search(r"^  installing the neuropod core, neuropod-onnx and onnxruntime==0\.0\.1 \.\.\. failed after "
                     r"[0-9]+\.[0-9] s$", out.getvalue(), re.M), out.getvalue()  # fmt: skip
    assert "No matching distribution" not in out.getvalue()
    assert sorted(os.listdir(envs.envs_dir())) == before
