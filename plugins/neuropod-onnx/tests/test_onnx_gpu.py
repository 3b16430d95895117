"""ONNX Runtime on a real GPU: the CUDA provider (never a silent CPU fallback), device tensors through
IO binding, memory given back on close. Marked ``gpu``: skipped with the reason where NVML sees no GPU
or onnxruntime has no CUDA provider (``nox -s tests_gpu`` runs them on a GPU machine, and fails
instead of skipping)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import neuropod
from neuropod.devices import read_nvml
from neuropod.errors import NeuropodError, NoBackendError, SpecError
from neuropod.packagers import create_onnx_neuropod
from neuropod.testing import assert_gpu_memory_given_back

from conftest import make_model, spec, xy


def _no_cuda_provider() -> str | None:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no CUDA provider (pip install 'neuropod-onnx[gpu]')"
    return None


pytestmark = pytest.mark.gpu(needs=_no_cuda_provider)


def _torch_cuda() -> object | None:
    """torch, when a CUDA build is installed beside onnxruntime-gpu (for device tensors to hand over)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _best_gpu() -> str:
    return max(read_nvml().gpus, key=lambda g: (g.memory_free, -g.index)).device


def test_the_cuda_provider_runs_it(make_adder: Callable[..., Path]) -> None:
    inputs = xy(5)
    with neuropod.load_neuropod(make_adder()) as model:  # the package asks for a GPU (inputs default to GPU)
        assert model.device == _best_gpu()
        session = model._handle.session
        assert session.get_providers()[0] == "CUDAExecutionProvider"
        assert session.get_provider_options()["CUDAExecutionProvider"]["device_id"] == model.device.split(":")[1]
        out = model.infer(inputs)
        np.testing.assert_allclose(out["out"], inputs["x"] + inputs["y"], rtol=1e-6)
        np.testing.assert_allclose(out["doubled"], (inputs["x"] + inputs["y"]) * 2, rtol=1e-6)
    with neuropod.load_neuropod(make_adder(), device="cpu") as model:
        assert model._handle.session.get_providers() == ["CPUExecutionProvider"]
    count = len(read_nvml().gpus)
    with pytest.raises(NoBackendError, match=f"device='cuda:{count}' was requested, but the host has no such GPU"):
        neuropod.load_neuropod(make_adder(), device=f"cuda:{count}")


def test_no_silent_cpu_fallback_when_the_cuda_provider_cannot_start(make_adder: Callable[..., Path]) -> None:
    # NVML sees the GPU, so resolution picks it; CUDA sees none, so the provider cannot start.
    # The load must fail saying so, not run on the CPU.
    path = make_adder()
    code = (
        "import sys, neuropod\n"
        "try:\n"
        "    m = neuropod.load_neuropod(sys.argv[1], device='cuda:0')\n"
        "except neuropod.NeuropodError as e:\n"
        "    print('refused:', e); sys.exit(3)\n"
        "print('loaded on', m.device, m._handle.session.get_providers())\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "refused:" in done.stdout and "CUDA" in done.stdout, done.stdout


def test_device_tensors_in_and_out(make_adder: Callable[..., Path]) -> None:
    torch = _torch_cuda()
    if torch is None:
        pytest.skip("needs torch with CUDA beside onnxruntime-gpu, to make and read GPU tensors")
    inputs = xy(4)
    want = inputs["x"] + inputs["y"]
    with neuropod.load_neuropod(make_adder()) as model:
        dev = torch.device(model.device)  # type: ignore[attr-defined]
        x = torch.from_numpy(inputs["x"]).to(dev)  # type: ignore[attr-defined]
        y = torch.from_numpy(inputs["y"]).to(dev)  # type: ignore[attr-defined]
        host = model.infer({"x": x, "y": y})
        assert type(host["out"]) is np.ndarray
        np.testing.assert_allclose(host["out"], want, rtol=1e-6)
        out = model.infer({"x": x, "y": y}, output_device="cuda")
        value = out["doubled"]
        assert isinstance(value, ort.OrtValue) and value.device_name().lower() == "cuda"
        back = torch.from_dlpack(value)  # type: ignore[attr-defined]
        assert back.device == dev
        np.testing.assert_allclose(back.cpu().numpy(), want * 2, rtol=1e-6)
        # Mixed: a numpy input beside a device input; a non-contiguous device input.
        np.testing.assert_allclose(model.infer({"x": x, "y": inputs["y"]})["out"], want, rtol=1e-6)
        yt = torch.from_numpy(inputs["y"].T.copy()).to(dev).T  # type: ignore[attr-defined]
        np.testing.assert_allclose(model.infer({"x": x, "y": yt})["out"], want, rtol=1e-6)
        with pytest.raises(SpecError, match=r"'x' .* float32, but was of type float64 \(a torch tensor on cuda:"):
            model.infer({"x": x.double(), "y": y})
    with neuropod.load_neuropod(make_adder(), device="cpu") as model, pytest.raises(NeuropodError, match="runs on the cpu"):
        model.infer({"x": x, "y": y})


def test_gpu_memory_is_given_back_on_close(tmp_path: Path) -> None:
    # A 256 MiB weight: the session's CUDA allocations come and go with it.
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8192, 8192)).astype(np.float32), "w")
    model_proto = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", "float32", [1, 8192])],
                             [("y", "float32", [1, 8192])], [w])  # fmt: skip
    path = create_onnx_neuropod(tmp_path / "big.neuropod", "big", spec(("x", "float32", [1, 8192])),
                                spec(("y", "float32", [1, 8192])), onnx_model=model_proto)  # fmt: skip
    assert_gpu_memory_given_back(path, {"x": np.ones((1, 8192), np.float32)}, min_taken=200 * 2**20)


def test_cupy_arrays_in_and_out(make_adder: Callable[..., Path]) -> None:
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (an optional producer of GPU arrays)")
    inputs = xy(3)
    with neuropod.load_neuropod(make_adder()) as model:
        with cupy.cuda.Device(int(model.device.split(":")[1])):
            x, y = cupy.asarray(inputs["x"]), cupy.asarray(inputs["y"])
        out = model.infer({"x": x, "y": y}, output_device="cuda")
        np.testing.assert_allclose(cupy.asnumpy(cupy.from_dlpack(out["out"])), inputs["x"] + inputs["y"], rtol=1e-6)
        np.testing.assert_allclose(model.infer({"x": x, "y": y})["doubled"], (inputs["x"] + inputs["y"]) * 2, rtol=1e-6)
