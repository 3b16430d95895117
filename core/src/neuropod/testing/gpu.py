"""GPU tests: whether this machine can run them, and whether a closed model gave its GPU memory back."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from neuropod.devices import local_host, parse_device
from neuropod.loader import load_neuropod

#: Set to 1 on a GPU machine (``nox -s tests_gpu`` does): a ``gpu`` test that cannot run there fails
#: instead of skipping, so a GPU run that tested nothing on the GPU cannot pass.
REQUIRE_GPU_ENV = "NEUROPOD_REQUIRE_GPU"


def gpu_missing() -> str | None:
    """Why this machine cannot run GPU tests (NVML sees no GPU), or None when it can."""

    host = local_host()
    return None if host.has_gpu else (host.note or "no GPU")


def gpu_memory_used(device: str = "cuda:0", *, pid: int | None = None) -> int:
    """Bytes in use on a GPU as NVML counts them, for tests that check a closed model gave its memory back:
    process ``pid``'s alone when given, else every process's (the driver's own included). NVML indexes
    GPUs as CUDA does without ``CUDA_VISIBLE_DEVICES``. A ``pid`` that NVML does not list (a process in
    another PID namespace, or one holding no memory there) reads as -1."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(parse_device(device).split(":")[1]))
        if pid is None:
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == pid and isinstance(process.usedGpuMemory, int):
                return int(process.usedGpuMemory)
        return -1
    finally:
        pynvml.nvmlShutdown()


def assert_gpu_memory_given_back(
    path: str | Path, inputs: Mapping[str, Any], *, min_taken: int, tolerance: int = 8 * 2**20, **load_kwargs: Any
) -> None:
    """Load a package onto a GPU, run it, close it: NVML's used memory must come back to where it was.

    A first load, call and close comes before the reading, so what a process
    keeps for its lifetime (the CUDA context, cuBLAS workspaces) is not
    counted. While loaded the model must take at least ``min_taken`` bytes,
    so the check shows something; after ``close()`` used memory must be within
    ``tolerance`` of the reading before. The readings are of this process alone
    where NVML lists it (other processes on the GPU, such as pytest-xdist's
    other workers, come and go meanwhile), else of the whole GPU.
    """
    with load_neuropod(path, **load_kwargs) as model:
        device = model.device
        model.infer(inputs)
    assert device.startswith("cuda:"), f"the model loaded on {device}, not a GPU"
    time.sleep(0.5)
    pid: int | None = os.getpid()
    before = gpu_memory_used(device, pid=pid)
    if before < 0:  # NVML does not list this process (another PID namespace): the whole GPU, then
        pid = None
        before = gpu_memory_used(device)
    model = load_neuropod(path, **load_kwargs)
    model.infer(inputs)
    loaded = gpu_memory_used(device, pid=pid)
    model.close()
    time.sleep(0.5)
    after = gpu_memory_used(device, pid=pid)
    mib = 2**20
    scope = "this process" if pid is not None else "all processes"
    figures = (
        f"before {before / mib:.0f} MiB, loaded {loaded / mib:.0f} MiB, after {after / mib:.0f} MiB on {device}, {scope}"
    )
    assert loaded - before >= min_taken, f"the model took less than {min_taken / mib:.0f} MiB on the GPU ({figures})"
    assert abs(after - before) <= tolerance, f"close() left {(after - before) / mib:.1f} MiB behind ({figures})"
