"""Both platforms on a real GPU: torch.export programs moved to cuda:N, an AOTInductor package compiled
for CUDA (its compute capability recorded, resolution choosing a GPU), device tensors in and out,
memory given back on close. Marked ``gpu``: skipped with the reason where NVML sees no GPU or torch
has no CUDA (``nox -s tests_gpu`` on a GPU machine runs them, and fails instead of skipping)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import neuropod
from neuropod.devices import read_nvml
from neuropod.errors import NoBackendError
from neuropod.packagers import create_aoti_neuropod, create_torch_export_neuropod
from neuropod.testing import assert_gpu_memory_given_back

import models
from conftest import TWO_LAYER_OUT, XY_SPEC, spec, two_layer_direct, xy


def _no_cuda_torch() -> str | None:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable GPU"
    return None


pytestmark = pytest.mark.gpu(needs=_no_cuda_torch)


def _best_gpu() -> str:
    """The GPU resolution should pick: the most free memory on NVML's word, the lowest index on a tie."""
    gpus = read_nvml().gpus
    return max(gpus, key=lambda g: (g.memory_free, -g.index)).device


def test_exported_program_runs_on_the_gpu(tmp_path: Path) -> None:
    path = create_torch_export_neuropod(tmp_path / "m", "m", XY_SPEC, TWO_LAYER_OUT, module=models.TwoLayer(),
                                        example_inputs=xy(4))  # fmt: skip
    inputs = xy(6, seed=6)
    want = two_layer_direct(**inputs)
    with neuropod.load_neuropod(path) as model:  # inputs default to GPU: the package asks for one
        assert model.device == _best_gpu()
        out = model.infer(inputs)
        assert type(out["out"]) is np.ndarray
        np.testing.assert_allclose(out["out"], want["out"], rtol=1e-3, atol=1e-4)
        # Device tensors in, device tensors out, never through the host.
        dev = torch.device(model.device)
        on_gpu = model.infer({k: torch.from_numpy(v).to(dev) for k, v in inputs.items()}, output_device="cuda")
        assert isinstance(on_gpu["out"], torch.Tensor) and on_gpu["out"].device == dev
        np.testing.assert_allclose(on_gpu["out"].cpu().numpy(), want["out"], rtol=1e-3, atol=1e-4)


def test_aoti_compiled_for_cuda(tmp_path: Path) -> None:
    inputs = xy(5, seed=5)
    path = create_aoti_neuropod(tmp_path / "cuda", "cuda", XY_SPEC, TWO_LAYER_OUT, module=models.TwoLayer(),
                                example_inputs=xy(4), device="cuda", test_input_data=inputs,
                                test_expected_out=two_layer_direct(**inputs), test_rtol=1e-3, test_atol=1e-4)  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    major, minor = torch.cuda.get_device_capability(0)
    assert config["device_requirements"] == {"device": "cuda", "compute_capability": f"{major}.{minor}"}
    assert set(config["input_tensor_device"].values()) == {"GPU"}
    with neuropod.load_neuropod(path) as model:
        assert model.device.startswith("cuda:")
        dev = torch.device(model.device)
        out = model.infer({k: torch.from_numpy(v).to(dev) for k, v in inputs.items()}, output_device="cuda")
        assert out["out"].device == dev
        np.testing.assert_allclose(out["out"].cpu().numpy(), two_layer_direct(**inputs)["out"], rtol=1e-3, atol=1e-4)
    with pytest.raises(NoBackendError, match="device='cpu' was requested, but the model needs a GPU"):
        neuropod.load_neuropod(path, device="cpu")


def test_cpu_aoti_package_stays_on_the_cpu_on_a_gpu_host(two_layer_aoti: Path) -> None:
    with neuropod.load_neuropod(two_layer_aoti) as model:
        assert model.device == "cpu"
    with pytest.raises(NoBackendError, match="made for the CPU only"):
        neuropod.load_neuropod(two_layer_aoti, device=_best_gpu())


def test_gpu_memory_is_given_back_on_close(tmp_path: Path) -> None:
    path = create_torch_export_neuropod(tmp_path / "big", "big", spec(("x", "float32", [1, 8192])),
                                        spec(("y", "float32", [1, 8192])), module=models.Big(),
                                        example_inputs={"x": np.ones((1, 8192), np.float32)})  # fmt: skip
    assert_gpu_memory_given_back(path, {"x": np.ones((1, 8192), np.float32)}, min_taken=200 * 2**20)
