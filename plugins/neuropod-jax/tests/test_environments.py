"""A real backend environment with another JAX release beside this process's: a package only that
release may load runs there in a worker, and a package that release wrote loads here.

It downloads jax and jaxlib (about 100 MB), so it runs only with ``NEUROPOD_TEST_ENVS=1``. The
environment is made once per session in a temporary ``NEUROPOD_HOME``; the core and the plugin come
from where this process's were installed from (see ``neuropod.envs``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import importlib_metadata
import jax
import numpy as np
import pytest

import neuropod
from neuropod import envs
from neuropod.package import read_package
from neuropod.packagers import create_jax_neuropod
from neuropod.versions import satisfies

import models
from conftest import spec

pytestmark = [
    pytest.mark.envs,
    pytest.mark.skipif(
        os.environ.get("NEUROPOD_TEST_ENVS") != "1",
        reason="creates a backend environment (downloads jax and jaxlib): set NEUROPOD_TEST_ENVS=1",
    ),
]

HERE = importlib_metadata.version("jax")
OTHER = "0.9.2" if HERE != "0.9.2" else "0.10.2"
X_SPEC = spec(("x", "float32", ["batch", 3]))
MLP_OUT = spec(("y", "float32", ["batch", 2]), ("norm", "float32", ["batch"]))


@pytest.fixture(scope="session")
def other_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[envs.Environment]:
    home = tmp_path_factory.mktemp("neuropod-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEUROPOD_HOME", str(home))
        t0 = time.perf_counter()
        env = envs.create_environment(f"jax=={OTHER}", out=sys.stderr)
        print(f"created jax=={OTHER} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        yield env


def test_the_environment_offers_its_jax(other_env: envs.Environment) -> None:
    there = subprocess.run(
        [str(other_env.python), "-c", "import importlib.metadata as m; print(m.version('jax'), m.version('jaxlib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert there == [OTHER, OTHER]
    ((backend, caps),) = other_env.backends
    assert (backend.platform, backend.version, backend.framework) == ("jax", OTHER, "jax")
    assert backend.location == f"env:jax-{OTHER}" and caps.cpu


def test_a_package_only_the_other_release_may_load_runs_there(other_env: envs.Environment, tmp_path: Path) -> None:
    params = models.mlp_params()
    path = create_jax_neuropod(
        tmp_path / "pinned", "pinned", X_SPEC, MLP_OUT, fn=models.mlp, params=params, platform_version_semver=f"=={OTHER}"
    )
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    with neuropod.load_neuropod(path) as model:
        assert (model.backend.id, model.backend.location) == (f"jax=={OTHER}", f"env:jax-{OTHER}")
        out = model.infer({"x": x})
    np.testing.assert_allclose(out["y"], np.asarray(jax.jit(models.mlp)(params, x)["y"]), rtol=1e-6, atol=1e-6)


WRITE = """
import sys
sys.path.insert(0, {tests!r})
import models
from neuropod.packagers import create_jax_neuropod
create_jax_neuropod({path!r}, "written_there", {x_spec!r}, {out_spec!r}, fn=models.mlp, params=models.mlp_params())
"""


def test_a_package_the_other_release_wrote_loads_here(other_env: envs.Environment, tmp_path: Path) -> None:
    path = tmp_path / "written_there"
    code = WRITE.format(tests=str(Path(__file__).parent), path=str(path), x_spec=X_SPEC, out_spec=MLP_OUT)
    subprocess.run([str(other_env.python), "-c", code], check=True, capture_output=True, text=True)
    config = read_package(path).config
    assert config.exported_with and config.exported_with["platform_version"] == OTHER
    x = np.random.default_rng(1).standard_normal((3, 3)).astype(np.float32)
    with neuropod.load_neuropod(path) as model:
        # The writer's range decides: in this process when it holds this JAX, else in the environment.
        here_ok = satisfies(HERE, config.platform_version_semver)
        assert model.backend.location == ("in-process" if here_ok else f"env:jax-{OTHER}")
        out = model.infer({"x": x})
    ref = models.mlp_numpy(models.mlp_params(), x)
    np.testing.assert_allclose(out["y"], ref["y"], rtol=1e-4, atol=1e-5)
