"""``neuropod compare`` on a GPU host: one TorchScript package on the CPU against itself on ``cuda:0``.

Needs an NVIDIA GPU, torch with CUDA and neuropod-torchscript; marked ``gpu`` (skipped with the reason
elsewhere, a failure under ``NEUROPOD_REQUIRE_GPU=1``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from neuropod.cli import main


def _no_cuda_torch() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no usable GPU (CUDA build: {torch.version.cuda})"
    try:
        import neuropod_torchscript  # noqa: F401
    except ImportError:
        return "neuropod-torchscript is not installed"
    return None


pytestmark = pytest.mark.gpu(needs=_no_cuda_torch)


def test_a_package_on_the_cpu_against_itself_on_the_gpu(tmp_path: Path) -> None:
    import torch

    from neuropod.packagers import create_torchscript_neuropod

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(16, 64)
            self.b = torch.nn.Linear(64, 8)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": self.b(torch.tanh(self.a(x)))}

    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    package = create_torchscript_neuropod(
        tmp_path / "mlp.neuropod", "mlp", [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}],
        [{"name": "y", "dtype": "float32", "shape": ["batch", 8]}], module=torch.jit.script(Mlp().eval()),
        test_input_data={"x": x},
    )  # fmt: skip
    report = tmp_path / "report.json"
    status = main([
        "compare", f"{package}@cpu", f"{package}@cuda:0", "--duration", "0.2", "--warmup", "2",
        "--batch-sizes", "1,64", "--json", str(report), "--html", str(tmp_path / "report.html"), "-q",
    ])  # fmt: skip
    data = json.loads(report.read_text())
    assert status == 0, data
    cpu, gpu = data["candidates"]
    assert (cpu["device"], gpu["device"]) == ("cpu", "cuda:0")
    assert gpu["verdict"] == "agrees"
    assert gpu["memory"]["gpu_bytes"] and gpu["memory"]["gpu_bytes"] > 0  # NVML saw the worker's CUDA context
    assert not cpu["memory"]["gpu_bytes"]
    assert data["machine"]["gpus"], data["machine"]
