"""Resolution against described hosts: range, platform, pins, devices, ordering."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from neuropod import plugins
from neuropod.backend import Backend, DeviceCaps
from neuropod.devices import Host, load_host
from neuropod.errors import NeuropodError, NoBackendError, VersionRangeError
from neuropod.package import parse_config
from neuropod.resolve import parse_backend_pin, resolve

HOSTS = Path(__file__).parent / "hosts"
CPU_HOST = Host(name="cpu box", source="test", note="no GPU in this test")


def config(**overrides: Any):  # type: ignore[no-untyped-def]
    data = {
        "name": "m",
        "platform": "onnx",
        "platform_version_semver": "*",
        "input_spec": [{"name": "x", "dtype": "float32", "shape": [None]}],
        "output_spec": [{"name": "y", "dtype": "float32", "shape": [None]}],
        **overrides,
    }
    return parse_config(data, "test config")


CPU_120 = Backend("onnx", "1.20.1", "onnxruntime", plugin="onnx")
CPU_131 = Backend("onnx", "1.31.1", "onnxruntime", plugin="onnx")
GPU_124 = Backend("onnx", "1.24.4", "onnxruntime-gpu", plugin="onnx")
TORCH = Backend("torchscript", "2.13.0+cpu", "torch", plugin="torchscript")
CAPS = {
    CPU_120: DeviceCaps(),
    CPU_131: DeviceCaps(),
    GPU_124: DeviceCaps(cpu=True, cuda="12"),
    TORCH: DeviceCaps(),
}
ALL = [CPU_120, CPU_131, GPU_124, TORCH]


def test_newest_version_in_range_wins_on_cpu() -> None:
    r = resolve(config(), ALL, CAPS, CPU_HOST)
    assert r.chosen is not None and r.chosen.backend == CPU_131 and r.device == "cpu"
    r = resolve(config(platform_version_semver="~1.20"), ALL, CAPS, CPU_HOST)
    assert r.chosen is not None and r.chosen.backend == CPU_120


def test_every_candidate_has_a_reason_in_the_table() -> None:
    r = resolve(config(platform_version_semver="^1.24"), ALL, CAPS, CPU_HOST)
    table = r.table()
    assert "version 1.20.1 is not in '^1.24' (>=1.24.0, <2.0.0)" in table
    assert "runs platform 'torchscript', not 'onnx'" in table
    assert table.splitlines()[1].lstrip().startswith("*"), "the chosen candidate comes first, marked *"


def test_nothing_fits_lists_all_and_says_what_to_install() -> None:
    r = resolve(config(platform_version_semver=">=2"), ALL, CAPS, CPU_HOST)
    with pytest.raises(NoBackendError) as info:
        r.raise_if_unresolved()
    text = str(info.value)
    assert "No backend can run it on cpu box: a backend satisfying these requirements was not found." in text
    assert "Install a onnx version in '>=2' (>=2.0.0)" in text
    assert text.count("is not in") == 3
    r = resolve(config(platform="tensorflow"), ALL, CAPS, CPU_HOST)
    assert f"No backend for platform 'tensorflow' is installed: {plugins.pip_install('neuropod-tensorflow')}" in r.summary()
    r = resolve(config(platform="tensorflow"), [], {}, CPU_HOST)
    assert "(no backends are installed)" in r.table()


def test_gpu_preferred_when_the_model_asks_and_one_fits() -> None:
    a100s = load_host(HOSTS / "two-a100.json")
    cfg = config(input_tensor_device={"x": "GPU"})
    r = resolve(cfg, ALL, CAPS, a100s)
    assert r.chosen is not None and r.chosen.backend == GPU_124 and r.device == "cuda:0"
    # Without a GPU wish the newest CPU build wins.
    r = resolve(config(), ALL, CAPS, a100s)
    assert r.chosen is not None and r.chosen.backend == CPU_131 and r.device == "cpu"
    # On a CPU host the GPU build still runs, on the CPU.
    r = resolve(cfg, [GPU_124], CAPS, CPU_HOST)
    assert r.device == "cpu" and "host has no GPU" in r.chosen.reason  # type: ignore[union-attr]


def test_gpu_with_most_free_memory_unless_pinned() -> None:
    host = Host(
        name="mixed",
        gpus=(
            _gpu(0, free=10), _gpu(1, free=70), _gpu(2, free=40),
        ),
        cuda_driver_version="12.4",
    )
    cfg = config(input_tensor_device={"x": "GPU"})
    assert resolve(cfg, [GPU_124], CAPS, host).device == "cuda:1"
    assert resolve(cfg, [GPU_124], CAPS, host, device="cuda:2").device == "cuda:2"
    assert resolve(cfg, [GPU_124], CAPS, host, device="gpu:0").device == "cuda:0"
    r = resolve(cfg, [GPU_124], CAPS, host, device="cuda:7")
    assert r.chosen is None and "has no such GPU" in r.candidates[0].reason
    assert resolve(cfg, [GPU_124], CAPS, host, device="cpu").device == "cpu"


def _gpu(index: int, free: int, cc: str = "8.0"):  # type: ignore[no-untyped-def]
    from neuropod.devices import GPU

    return GPU(index, "NVIDIA A100", f"GPU-{index}", cc, 80 * 2**30, free * 2**30)


def test_device_requirements_gpu_only_models() -> None:
    cfg = config(device_requirements={"device": "gpu", "compute_capability": "8.0", "min_free_memory": 50 * 2**30})
    host = Host(name="h", gpus=(_gpu(0, free=20), _gpu(1, free=60), _gpu(2, free=70, cc="9.0")), cuda_driver_version="12.4")
    r = resolve(cfg, [GPU_124], CAPS, host)
    assert r.device == "cuda:1"
    reasons = resolve(cfg, [GPU_124], CAPS, Host(name="h", gpus=(_gpu(0, free=20), _gpu(2, free=70, cc="9.0")))).candidates[0].reason
    assert "cuda:0 has 20.0 GiB free, the model needs 50.0 GiB" in reasons
    assert "cuda:2 is compute capability 9.0, the model was built for 8.0" in reasons
    r = resolve(cfg, [GPU_124, CPU_131], CAPS, CPU_HOST)
    assert r.chosen is None
    assert "needs a GPU" in r.table() and "backend build has no GPU support" in r.table()
    assert "device='cpu' was requested, but the model needs a GPU" in resolve(
        cfg, [GPU_124], CAPS, host, device="cpu"
    ).candidates[0].reason


def test_device_requirements_cpu_only_models() -> None:
    """A program compiled or exported for the CPU alone runs on the CPU even where a GPU fits and its
    inputs say GPU, and a pinned GPU is refused with why."""
    cfg = config(device_requirements={"device": "cpu"}, input_tensor_device={"x": "GPU"})
    host = Host(name="h", gpus=(_gpu(0, free=70),), cuda_driver_version="12.4")
    r = resolve(cfg, [GPU_124], CAPS, host)
    assert r.device == "cpu" and "the model was made for the CPU only" in r.candidates[0].reason
    pinned = resolve(cfg, [GPU_124], CAPS, host, device="cuda:0")
    assert pinned.chosen is None
    assert "device='cuda:0' was requested, but the model was made for the CPU only" in pinned.table()
    gpu_only = {GPU_124: DeviceCaps(cpu=False, cuda="12")}
    assert "runs on GPUs only" in resolve(cfg, [GPU_124], gpu_only, host).table()


def test_old_driver_rejects_a_newer_cuda_build() -> None:
    host = Host(name="old", gpus=(_gpu(0, free=70),), cuda_driver_version="11.4")
    r = resolve(config(device_requirements={"device": "gpu"}), [GPU_124], CAPS, host)
    assert r.chosen is None and "the driver supports CUDA 11.4, the backend needs CUDA 12" in r.table()


def test_backend_compute_capability_list() -> None:
    caps = {GPU_124: DeviceCaps(cpu=False, cuda="12", compute_capabilities=("8.0", "9.0"))}
    t4 = load_host(HOSTS / "t4.json")
    r = resolve(config(), [GPU_124], caps, t4)
    assert r.chosen is None
    assert "compute capability 7.5; the backend has kernels for 8.0, 9.0" in r.table()
    assert resolve(config(), [GPU_124], caps, load_host(HOSTS / "one-h100.json")).device == "cuda:0"


def test_backend_pins() -> None:
    assert parse_backend_pin("onnx==1.31.1") == ("onnx", "==1.31.1")
    assert parse_backend_pin(" onnx ") == ("onnx", None)
    assert parse_backend_pin("onnx>=1.20,<1.25") == ("onnx", ">=1.20,<1.25")
    with pytest.raises(VersionRangeError, match="'==>1'"):
        parse_backend_pin("onnx==>1")
    with pytest.raises(NeuropodError, match="not like 'onnx'"):
        parse_backend_pin("=onnx")
    r = resolve(config(), ALL, CAPS, CPU_HOST, backend="onnx==1.20.1")
    assert r.chosen is not None and r.chosen.backend == CPU_120
    assert "not the requested backend 'onnx==1.20.1'" in r.table()
    r = resolve(config(), ALL, CAPS, CPU_HOST, backend="onnx==9")
    assert r.chosen is None and "Nothing matches backend='onnx==9'" in r.summary()


def test_local_labels_and_prereleases_in_installed_versions() -> None:
    torch_cfg = config(platform="torchscript", platform_version_semver="~2.13")
    assert resolve(torch_cfg, ALL, CAPS, CPU_HOST).chosen is not None  # 2.13.0+cpu is in ~2.13
    rc = Backend("torchscript", "2.14.0rc1", "torch", plugin="torchscript")
    r = resolve(config(platform="torchscript", platform_version_semver=">=2.14"), [rc], {rc: DeviceCaps()}, CPU_HOST)
    assert r.chosen is None, "a prerelease matches only a range that names one"


def test_invalid_device() -> None:
    with pytest.raises(NeuropodError, match="'tpu'"):
        resolve(config(), ALL, CAPS, CPU_HOST, device="tpu")


def test_a_host_file_can_list_the_backends_of_the_machine_it_describes(tmp_path: Path) -> None:
    import json

    from neuropod.loader import plan

    from _toy_backend import write_toy

    host = json.loads((HOSTS / "two-a100.json").read_text())
    host["backends"] = [
        {"platform": "toy", "version": "3.1.0", "framework": "toyframework-gpu", "cpu": False, "cuda": "12.1"},
        {"platform": "toy", "version": "2.0.0", "framework": "toyframework", "cuda": None},
    ]
    host_file = tmp_path / "planned.json"
    host_file.write_text(json.dumps(host))
    package = write_toy(tmp_path / "m", input_tensor_device={"x": "GPU", "y": "GPU"})
    r = plan(package, host=host_file)  # no toy plugin is installed here: the host file's backends are used
    assert r.chosen is not None and r.chosen.backend.version == "3.1.0" and r.device == "cuda:0"
    assert r.chosen.backend.location == "described in planned.json"
    assert load_host(host_file).to_dict()["backends"][0]["cuda"] == "12.1"
    host["backends"] = [{"platform": "toy"}]
    host_file.write_text(json.dumps(host))
    with pytest.raises(NeuropodError, match=r"backends\[0\]\.version is missing"):
        load_host(host_file)
    host["backends"] = [{"platform": "toy", "version": "1", "gpu": True}]
    host_file.write_text(json.dumps(host))
    with pytest.raises(NeuropodError, match="gpu"):
        load_host(host_file)
