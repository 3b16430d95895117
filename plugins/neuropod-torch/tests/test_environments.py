"""AOTInductor packages across torch releases, side by side, through backend environments and workers.

An AOTInductor package runs only on the torch release that compiled it. Here a
package compiled by this process's torch is loaded by a process whose torch is
another release, with nothing done beforehand but ``neuropod env create
aoti==<this release>``: resolution finds the environment, and the model runs
in a worker started from it. And the other way round.

The "other" process is the interpreter of a second environment, made with
``neuropod env create aoti==<other>`` too: it stands for a user's own Python
environment with that torch, neuropod and neuropod-torch installed.

torch 2.14.1 is a CUDA build (about 5 GB with its CUDA libraries), so these
run only with ``NEUROPOD_TEST_ENVS=1`` (``nox -s tests_envs``). Both
environments are made once per session in a temporary ``NEUROPOD_HOME``; the
core and the plugin come from where this process's were installed from
(see ``neuropod.envs``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import importlib_metadata
import numpy as np
import pytest

import neuropod
from neuropod import envs

from conftest import TWO_LAYER_OUT, XY_SPEC, two_layer_direct, xy

pytestmark = [
    pytest.mark.envs,
    pytest.mark.skipif(
        os.environ.get("NEUROPOD_TEST_ENVS") != "1",
        reason="creates backend environments (installs torch 2.13.0 and 2.14.1, about 5 GB): set NEUROPOD_TEST_ENVS=1",
    ),
]

HERE = importlib_metadata.version("torch")  # e.g. 2.13.0+cpu
HERE_RELEASE = HERE.split("+")[0]
OTHER = "2.14.1" if HERE_RELEASE != "2.14.1" else "2.13.0"


class Side:
    """The other torch's interpreter, and the environment of this process's torch release."""

    def __init__(self, home: Path, other: envs.Environment, this: envs.Environment, seconds: dict[str, float]):
        self.home = home
        self.other = other
        self.this = this
        self.seconds = seconds


@pytest.fixture(scope="session")
def side(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Side]:
    home = tmp_path_factory.mktemp("neuropod-home")
    seconds = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEUROPOD_HOME", str(home))
        made = {}
        for release in (OTHER, HERE_RELEASE):
            t0 = time.perf_counter()
            made[release] = envs.create_environment(f"aoti=={release}", out=sys.stderr)
            seconds[release] = time.perf_counter() - t0
            print(f"created aoti=={release} in {seconds[release]:.1f} s", file=sys.stderr)
        yield Side(home, made[OTHER], made[HERE_RELEASE], seconds)


LOAD_AND_RUN = """
import json, sys, time
import numpy as np
import torch
import neuropod
from neuropod.loader import plan

path, inputs_file = sys.argv[1:3]
inputs = dict(np.load(inputs_file))
t0 = time.perf_counter()
with neuropod.load_neuropod(path) as model:
    loaded = time.perf_counter() - t0
    out = model.infer(inputs)
    print(json.dumps({
        "torch": torch.__version__, "backend": model.backend.id, "location": model.backend.location,
        "kind": type(model).__name__, "load_seconds": loaded, "explain": plan(path).explain(),
        "out": out["out"].tolist(), "norm": out["norm"].tolist(),
    }))
"""


def run_in(python: Path, home: Path, code: str, *args: str) -> dict:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["NEUROPOD_HOME"] = str(home)
    done = subprocess.run([str(python), "-c", code, *args], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_the_environments_hold_their_torch(side: Side) -> None:
    for env, release in ((side.other, OTHER), (side.this, HERE_RELEASE)):
        ((backend, caps),) = [(b, c) for b, c in env.backends if b.platform == "aoti"]
        assert backend.version.split("+")[0] == release and backend.location == f"env:{env.name}"
        assert caps.cpu
    print(f"environment creation: {side.seconds}", file=sys.stderr)


def test_package_compiled_here_runs_from_the_other_torch(side: Side, two_layer_aoti: Path, tmp_path: Path) -> None:
    """Compiled by this torch; loaded by a process running the other torch: it runs in a worker
    from the environment of this release."""
    inputs = xy(5, seed=5)
    np.savez(tmp_path / "inputs.npz", **inputs)
    result = run_in(side.other.python, side.home, LOAD_AND_RUN, str(two_layer_aoti), str(tmp_path / "inputs.npz"))
    assert result["torch"].split("+")[0] == OTHER
    assert result["kind"] == "WorkerModel"
    assert result["location"] == f"env:{side.this.name}" and result["backend"].startswith(f"aoti=={HERE_RELEASE}")
    assert f"version {OTHER}" in result["explain"] and f"is not in '=={HERE_RELEASE}'" in result["explain"]
    want = two_layer_direct(**inputs)
    np.testing.assert_allclose(result["out"], want["out"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(result["norm"], want["norm"], rtol=1e-4, atol=1e-5)
    print(f"loaded in a worker from the other torch in {result['load_seconds']:.1f} s", file=sys.stderr)


COMPILE = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
import models
from neuropod.packagers import create_aoti_neuropod
inputs = dict(np.load({inputs!r}))
create_aoti_neuropod({path!r}, "compiled_there", {in_spec!r}, {out_spec!r}, module=models.TwoLayer(), example_inputs=inputs)
print("{{}}")
"""


def test_package_compiled_by_the_other_torch_runs_here(side: Side, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "compiled_there"
    np.savez(tmp_path / "examples.npz", **xy(4))
    code = COMPILE.format(tests=str(Path(__file__).parent), path=str(path), inputs=str(tmp_path / "examples.npz"),
                          in_spec=XY_SPEC, out_spec=TWO_LAYER_OUT)  # fmt: skip
    run_in(side.other.python, side.home, code)
    config = json.loads((path / "config.json").read_text())
    assert config["platform_version_semver"] == f"=={OTHER}"
    monkeypatch.setenv("NEUROPOD_HOME", str(side.home))
    inputs = xy(3, seed=3)
    with neuropod.load_neuropod(path) as model:
        assert (model.backend.location, type(model).__name__) == (f"env:{side.other.name}", "WorkerModel")
        out = model.infer(inputs)
    np.testing.assert_allclose(out["out"], two_layer_direct(**inputs)["out"], rtol=1e-4, atol=1e-5)


def test_without_the_environment_explain_says_how_to_make_it(side: Side, two_layer_aoti: Path, tmp_path: Path) -> None:
    """The other torch's process, with no environment for this release: refused, with the command to run."""
    empty = tmp_path / "empty-home"
    empty.mkdir()
    code = "import sys\nfrom neuropod import cli\nsys.exit(cli.main(['explain', sys.argv[1], '--quiet-spec']))\n"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["NEUROPOD_HOME"] = str(empty)
    done = subprocess.run([str(side.other.python), "-c", code, str(two_layer_aoti)], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"version {OTHER}" in done.stdout and f"is not in '=={HERE_RELEASE}'" in done.stdout
    assert "neuropod env create aoti==" in done.stdout
