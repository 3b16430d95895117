"""JAX on a real GPU: programs lowered for CPU and CUDA, for CUDA only, and for the CPU only on a GPU host.
Marked ``gpu``: skipped with the reason where NVML sees no GPU or JAX has no CUDA backend (install
``jax[cuda12]`` or ``jax[cuda13]`` of the same version; ``nox -s tests_gpu`` fails instead of skipping)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import neuropod
from neuropod import plugins
from neuropod.errors import NeuropodError, NoBackendError
from neuropod.package import read_package
from neuropod.packagers import create_jax_neuropod
from neuropod_jax import cuda_plugin

import models
from conftest import jax_cuda_missing, spec

pytestmark = pytest.mark.gpu(needs=jax_cuda_missing)

X_SPEC = spec(("x", "float32", ["batch", 3]))
MLP_OUT = spec(("y", "float32", ["batch", 2]), ("norm", "float32", ["batch"]))


def _package(tmp_path: Path, name: str, **kwargs: Any) -> Path:
    path: Path = create_jax_neuropod(
        tmp_path / name, name, X_SPEC, MLP_OUT, fn=models.mlp, params=models.mlp_params(), **kwargs
    )
    return path


def _check(model: Any, batch: int = 5) -> None:
    x = np.random.default_rng(batch).standard_normal((batch, 3)).astype(np.float32)
    out = model.infer({"x": x})
    ref = models.mlp_numpy(models.mlp_params(), x)
    np.testing.assert_allclose(out["y"], ref["y"], rtol=1e-3, atol=1e-4)  # TF32 matmuls on recent GPUs
    assert type(out["y"]) is np.ndarray


def test_device_caps_say_cuda() -> None:
    (backend,) = [b for b in plugins.installed_backends() if b.platform == "jax"]
    caps = plugins.backend_caps(backend)
    plugin = cuda_plugin()
    assert plugin is not None and caps.cuda == plugin[2] and caps.cpu and not caps.warning


def test_cpu_and_cuda_export_runs_on_the_gpu(tmp_path: Path) -> None:
    path = _package(tmp_path, "both", platforms=("cpu", "cuda"))
    with neuropod.load_neuropod(path) as model:  # inputs default to GPU: the package asks for one
        assert model.device.startswith("cuda:")
        handle = model._handle
        assert handle.device.platform == "gpu" and all(p.devices() == {handle.device} for p in handle._params)
        _check(model)
    with neuropod.load_neuropod(path, device="cpu") as model:  # and the CPU lowering on the CPU
        assert model._handle.device.platform == "cpu"
        _check(model)


def test_cuda_only_export(tmp_path: Path) -> None:
    path = _package(tmp_path, "cuda_only", platforms=("cuda",))
    assert read_package(path).config.device_requirements == {"device": "cuda", "jax_platforms": ["cuda"]}
    with neuropod.load_neuropod(path) as model:
        assert model.device.startswith("cuda:")
        _check(model)
    with pytest.raises(NeuropodError, match="needs a GPU"):
        neuropod.load_neuropod(path, device="cpu")


def test_cpu_only_export_stays_on_the_cpu_of_a_gpu_host(tmp_path: Path) -> None:
    path = _package(tmp_path, "cpu_only")
    with neuropod.load_neuropod(path) as model:
        assert model.device == "cpu" and model._handle.device.platform == "cpu"
        _check(model)
    with pytest.raises(NoBackendError, match="device='cuda:0' was requested, but the model was made for the CPU only"):
        neuropod.load_neuropod(path, device="cuda:0")


def test_program_without_params_runs_on_the_chosen_device(tmp_path: Path) -> None:
    path = create_jax_neuropod(
        tmp_path / "noparams", "noparams", X_SPEC, spec(("y", "float32", ["batch", 3])),
        fn=lambda x: {"y": x * 2}, platforms=("cpu", "cuda"),
    )  # fmt: skip
    x = np.ones((2, 3), np.float32)
    for device in ("cpu", "cuda:0"):
        with neuropod.load_neuropod(path, device=device) as model:
            np.testing.assert_array_equal(model.infer({"x": x})["y"], x * 2)


def test_ope_worker_on_the_gpu(tmp_path: Path) -> None:
    path = _package(tmp_path, "ope", platforms=("cpu", "cuda"))
    with neuropod.load_neuropod(path, use_ope=True) as model:
        assert model.device.startswith("cuda:")
        _check(model)


def test_a_process_loading_a_model_leaves_the_rest_of_the_gpu(tmp_path: Path) -> None:
    """JAX takes 75% of a GPU when its CUDA backend starts unless told otherwise; a process that loads a
    model through Neuropod takes what the model needs, so other models and frameworks fit beside it."""
    path = _package(tmp_path, "both", platforms=("cpu", "cuda"))
    code = (
        "import numpy as np, neuropod\n"
        "from neuropod.devices import read_nvml\n"
        "from neuropod.testing import gpu_memory_used\n"
        "before = gpu_memory_used()\n"
        f"with neuropod.load_neuropod({str(path)!r}, device='cuda:0') as m:\n"
        "    m.infer({'x': np.ones((2, 3), np.float32)})\n"
        "    print(gpu_memory_used() - before, read_nvml().gpus[0].memory_total)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT_")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    taken, total = map(int, done.stdout.split()[-2:])
    assert taken < total // 4, f"a process running one small model took {taken / 2**30:.1f} GiB of {total / 2**30:.1f} GiB"
