"""TorchScript on a real GPU: cuda:N, inputs the package keeps on the CPU, device tensors in and out,
memory given back on close. Marked ``gpu``: skipped with the reason where NVML sees no GPU or torch
has no CUDA (``nox -s tests_gpu`` on a GPU machine runs them, and fails instead of skipping)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import neuropod
from neuropod.devices import read_nvml
from neuropod.errors import NeuropodError, SpecError
from neuropod.packagers import create_torchscript_neuropod
from neuropod.testing import assert_gpu_memory_given_back

import models
from conftest import spec


def _no_cuda_torch() -> str | None:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable GPU"
    return None


pytestmark = pytest.mark.gpu(needs=_no_cuda_torch)

XY = spec(("x", "float32", ["batch", 2]), ("y", "float32", ["batch", 2]))
ADDER_OUT = spec(("out", "float32", ["batch", 2]), ("doubled", "float32", ["batch", 2]))
WHERE_OUT = spec(("out", "float32", ["batch", 2]), ("x_on_gpu", "int64", []), ("y_on_gpu", "int64", []))


def _package(tmp_path: Path, module: torch.nn.Module, in_spec: Any, out_spec: Any, name: str = "m", **kwargs: Any) -> Path:
    return create_torchscript_neuropod(
        tmp_path / f"{name}.neuropod", name, in_spec, out_spec, module=torch.jit.script(module), **kwargs
    )


def _xy(batch: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    return {n: rng.standard_normal((batch, 2)).astype(np.float32) for n in ("x", "y")}


def _best_gpu() -> str:
    """The GPU resolution should pick: the most free memory on NVML's word, the lowest index on a tie."""
    gpus = read_nvml().gpus
    return max(gpus, key=lambda g: (g.memory_free, -g.index)).device


def test_runs_on_the_gpu_with_the_most_free_memory(tmp_path: Path) -> None:
    inputs = _xy()
    path = _package(tmp_path, models.Adder(), XY, ADDER_OUT)  # inputs default to GPU: the package asks for one
    with neuropod.load_neuropod(path) as model:
        assert model.device == _best_gpu()
        assert model._handle.device == torch.device(model.device)
        out = model.infer(inputs)
        assert type(out["out"]) is np.ndarray
        np.testing.assert_allclose(out["out"], inputs["x"] + inputs["y"], rtol=1e-6)
    last = f"cuda:{torch.cuda.device_count() - 1}"
    with neuropod.load_neuropod(path, device=last) as model:  # a pinned GPU is honoured
        assert model.device == last and model._handle.device == torch.device(last)
        np.testing.assert_allclose(model.infer(inputs)["doubled"], (inputs["x"] + inputs["y"]) * 2, rtol=1e-6)


def test_inputs_the_package_keeps_on_the_cpu(tmp_path: Path) -> None:
    path = _package(tmp_path, models.WhereAreMyInputs(), XY, WHERE_OUT, input_tensor_device={"x": "GPU", "y": "CPU"})
    inputs = _xy()
    with neuropod.load_neuropod(path) as model:
        assert model.device.startswith("cuda:")
        for given in (inputs, {"x": torch.from_numpy(inputs["x"]).to(model.device),
                               "y": torch.from_numpy(inputs["y"]).to(model.device)}):  # fmt: skip
            out = model.infer(given)
            assert (int(out["x_on_gpu"]), int(out["y_on_gpu"])) == (1, 0)
            np.testing.assert_allclose(out["out"], inputs["x"] + inputs["y"], rtol=1e-6)


class _OnlyCudaArrayInterface:
    """A GPU array that speaks only the CUDA array interface (as Numba's do)."""

    def __init__(self, t: torch.Tensor):
        self._t = t
        self.__cuda_array_interface__ = t.__cuda_array_interface__


class _OnlyDLPack:
    """A GPU array that speaks only DLPack (as JAX's do)."""

    def __init__(self, t: torch.Tensor):
        self._t = t
        self.shape, self.dtype = tuple(t.shape), str(t.dtype)

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._t.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._t.__dlpack_device__()


def test_device_tensors_in_and_out_without_a_copy(tmp_path: Path) -> None:
    identity = spec(("in_a", "float32", ["n", 3]), ("in_b", "int64", ["n"]))
    path = _package(tmp_path, models.Identity(), identity, spec(("out_a", "float32", ["n", 3]), ("out_b", "int64", ["n"])))
    with neuropod.load_neuropod(path) as model:
        dev = torch.device(model.device)
        a = torch.randn(4, 3, device=dev)
        b = torch.arange(4, device=dev)
        out = model.infer({"in_a": a, "in_b": b}, output_device="cuda")
        # The model returned its inputs: the same GPU memory came back, never through the host.
        assert isinstance(out["out_a"], torch.Tensor) and out["out_a"].device == dev
        assert out["out_a"].data_ptr() == a.data_ptr() and out["out_b"].data_ptr() == b.data_ptr()
        # Numpy outputs of device inputs; other producers through their protocol.
        host = model.infer({"in_a": _OnlyCudaArrayInterface(a), "in_b": _OnlyDLPack(b)})
        np.testing.assert_array_equal(host["out_a"], a.cpu().numpy())
        np.testing.assert_array_equal(host["out_b"], b.cpu().numpy())
        # Spec checks read the GPU tensor's metadata.
        with pytest.raises(SpecError, match=r"'in_b' .* type int64, but was of type int32 \(a torch tensor on cuda:"):
            model.infer({"in_a": a, "in_b": b.int()})
        with pytest.raises(SpecError, match=r"symbol 'n'"):
            model.infer({"in_a": a, "in_b": b[:2]})
        if torch.cuda.device_count() > 1:
            other = torch.device(f"cuda:{(dev.index + 1) % torch.cuda.device_count()}")
            with pytest.raises(NeuropodError, match="move the tensor there first"):
                model.infer({"in_a": a.to(other), "in_b": b})
    with neuropod.load_neuropod(path, device="cpu") as model, pytest.raises(NeuropodError, match="the model runs on the cpu"):
        model.infer({"in_a": a, "in_b": b})
    with neuropod.load_neuropod(path, use_ope=True) as model:
        with pytest.raises(NeuropodError, match="runs in a worker process"):
            model.infer({"in_a": a, "in_b": b})
        np.testing.assert_array_equal(model.infer({"in_a": a.cpu(), "in_b": b.cpu()})["out_a"], a.cpu().numpy())


def test_gpu_memory_is_given_back_on_close(tmp_path: Path) -> None:
    path = _package(tmp_path, models.Big(), spec(("x", "float32", [1, 8192])), spec(("y", "float32", [1, 8192])))
    assert_gpu_memory_given_back(path, {"x": np.ones((1, 8192), np.float32)}, min_taken=200 * 2**20)


def test_cupy_arrays_in_and_out(tmp_path: Path) -> None:
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (an optional producer of GPU arrays)")
    path = _package(tmp_path, models.Adder(), XY, ADDER_OUT)
    inputs = _xy()
    with neuropod.load_neuropod(path) as model:
        with cupy.cuda.Device(int(model.device.split(":")[1])):
            x, y = cupy.asarray(inputs["x"]), cupy.asarray(inputs["y"])
        out = model.infer({"x": x, "y": y}, output_device="cuda")
        assert isinstance(out["out"], torch.Tensor) and out["out"].device == torch.device(model.device)
        np.testing.assert_allclose(cupy.asnumpy(cupy.from_dlpack(out["doubled"])), (inputs["x"] + inputs["y"]) * 2, rtol=1e-6)
