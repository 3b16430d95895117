"""The core on a real GPU host: NVML facts, resolution, fresh free memory, GPU workers, the CLI, and `neuropod compare` on the CPU against cuda:0.

Needs an NVIDIA GPU, torch with CUDA and neuropod-torchscript (neuropod-python too for the worker
environment check). Every test is marked ``gpu``: skipped with the reason elsewhere, a failure under
``NEUROPOD_REQUIRE_GPU=1`` (``nox -s tests_gpu``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import neuropod
from neuropod import devices
from neuropod.cli import main as cli_main
from neuropod.devices import local_host, read_nvml
from neuropod.errors import NoBackendError, WorkerError


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
SPEC_IN = [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]
SPEC_OUT = [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}]


@pytest.fixture
def doubler(tmp_path: Path) -> Path:
    """A TorchScript package that asks for a GPU (inputs default to GPU): y = 2x."""
    import torch

    from neuropod.packagers import create_torchscript_neuropod

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": x * 2}

    return create_torchscript_neuropod(tmp_path / "double.neuropod", "double", SPEC_IN, SPEC_OUT,
                                       module=torch.jit.script(Double()))  # fmt: skip


def _nvml_processes(index: int) -> set[int]:
    """PIDs with a CUDA context on GPU ``index``, as NVML sees them."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    finally:
        pynvml.nvmlShutdown()


def _within(seconds: float, condition: Callable[[], bool]) -> bool:
    """Whether ``condition`` holds within ``seconds`` (NVML's process list lags process exit a little)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_nvml_facts_match_torch() -> None:
    import torch

    host = local_host()
    assert host.source == "nvml" and host.has_gpu and host.driver_version and host.cuda_driver_version
    assert len(host.gpus) == torch.cuda.device_count()  # (no CUDA_VISIBLE_DEVICES in this process)
    for gpu in host.gpus:
        props = torch.cuda.get_device_properties(gpu.index)
        assert gpu.name == props.name
        assert gpu.compute_capability == f"{props.major}.{props.minor}"
        assert gpu.memory_total == props.total_memory or abs(gpu.memory_total - props.total_memory) < 2**30
        assert 0 < gpu.memory_free <= gpu.memory_total


def test_resolution_picks_the_gpu_with_the_most_free_memory_and_honours_a_pin(doubler: Path) -> None:
    gpus = read_nvml().gpus
    best = max(gpus, key=lambda g: (g.memory_free, -g.index))
    resolution = neuropod.plan(doubler)
    assert resolution.chosen is not None and resolution.chosen.device == best.device
    assert best.name in resolution.chosen.reason
    for gpu in gpus:
        with neuropod.load_neuropod(doubler, device=gpu.device) as model:
            assert model.device == gpu.device
            np.testing.assert_array_equal(model.infer({"x": np.ones((2, 4), np.float32)})["y"], np.full((2, 4), 2, np.float32))
    with pytest.raises(NoBackendError, match=f"device='cuda:{len(gpus)}' was requested, but the host has no such GPU"):
        neuropod.load_neuropod(doubler, device=f"cuda:{len(gpus)}")


def test_free_memory_is_current_in_a_long_lived_process() -> None:
    import torch

    gpu = local_host().gpus[0]
    before = gpu.memory_free
    block = torch.empty(2**30, dtype=torch.uint8, device=f"cuda:{gpu.index}")  # 1 GiB
    try:
        time.sleep(devices.HOST_MAX_AGE + 0.1)
        after = local_host().gpus[0].memory_free
        assert before - after >= 0.9 * 2**30, f"local_host() still says {after / 2**30:.2f} GiB free after 1 GiB was taken"
    finally:
        del block
        torch.cuda.empty_cache()


def test_gpu_workers_two_of_them_and_a_kill(doubler: Path) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with neuropod.load_neuropod(doubler, use_ope=True, workers=2, restart=True) as model:
        assert model.device.startswith("cuda:")
        index = int(model.device.split(":")[1])
        for _ in range(4):  # calls go to both workers
            np.testing.assert_array_equal(model.infer({"x": x})["y"], x * 2)
        pids = set(model.worker_pids)
        assert len(pids) == 2
        assert _within(10, lambda: pids <= _nvml_processes(index)), "both workers hold a CUDA context on the chosen GPU"
        victim = sorted(pids)[0]
        os.kill(victim, signal.SIGKILL)
        results = []
        for _ in range(6):  # a call may land on the dead worker once; restart=True starts a new one
            try:
                results.append(model.infer({"x": x})["y"])
            except WorkerError:
                continue
        assert results and all(np.array_equal(r, x * 2) for r in results)
        assert _within(10, lambda: victim not in _nvml_processes(index)), "the killed worker's GPU context is gone"
        assert len(set(model.worker_pids)) == 2 and victim not in model.worker_pids
    assert _within(10, lambda: not pids & _nvml_processes(index)), "close() stopped the workers and freed their GPU memory"


def test_a_worker_sees_exactly_the_chosen_gpu(tmp_path: Path) -> None:
    pytest.importorskip("neuropod_python", reason="needs neuropod-python (a model that reports its environment)")
    from neuropod.packagers import create_python_neuropod

    code = tmp_path / "code"
    code.mkdir()
    (code / "probe.py").write_text(
        "import os\nimport numpy as np\n\n"
        "def get_model(data_root):\n"
        "    def run(x):\n"
        "        import torch\n"
        "        seen = os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')\n"
        "        return {'visible': np.array([seen]), 'count': np.array([torch.cuda.device_count()], np.int64)}\n"
        "    return run\n"
    )
    path = create_python_neuropod(
        tmp_path / "probe.neuropod", "probe", [], [{"python_root": code, "dirs_to_package": [""]}], "probe", "get_model",
        [{"name": "x", "dtype": "float32", "shape": [1]}],
        [{"name": "visible", "dtype": "string", "shape": [1]}, {"name": "count", "dtype": "int64", "shape": [1]}],
    )  # fmt: skip
    for gpu in read_nvml().gpus:
        with neuropod.load_neuropod(path, device=gpu.device, use_ope=True) as model:
            out = model.infer({"x": np.zeros(1, np.float32)})
            assert out["visible"].tolist() == [gpu.uuid] and out["count"].tolist() == [1]


def test_backends_and_explain_on_a_gpu_host(doubler: Path) -> None:
    host = read_nvml()
    run = [sys.executable, "-m", "neuropod"]
    text = subprocess.run([*run, "backends"], capture_output=True, text=True, check=True).stdout
    import torch

    assert "torchscript==" in text and f"cuda {torch.version.cuda}" in text
    for gpu in host.gpus:
        assert f"{gpu.device}  {gpu.name} (cc {gpu.compute_capability}," in text
    data = json.loads(subprocess.run([*run, "backends", "--json"], capture_output=True, text=True, check=True).stdout)
    assert [g["uuid"] for g in data["host"]["gpus"]] == [g.uuid for g in host.gpus]
    assert data["host"]["driver_version"] == host.driver_version
    explained = subprocess.run([*run, "explain", str(doubler)], capture_output=True, text=True)
    assert explained.returncode == 0, explained.stdout + explained.stderr
    best = max(host.gpus, key=lambda g: (g.memory_free, -g.index))
    assert f"ok: {best.device} {best.name}" in explained.stdout


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
    status = cli_main([
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
