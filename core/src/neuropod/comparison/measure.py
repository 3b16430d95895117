"""Speed and memory of one candidate, measured inside its own process (see :mod:`.worker`).

Scenarios after MLPerf's: SingleStream (one call at a time: latency percentiles), Offline (calls
of a batch size back to back: throughput) and Server (calls arriving at a fixed mean rate, as a
Poisson process, onto a few threads: latency counted from when each call was due).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from neuropod.comparison.results import SAMPLES_KEPT, Latency, Throughput

Call = Callable[[dict[str, Any]], Any]

#: At least this many timed calls per measurement, however long they take.
MIN_CALLS = 20
#: Threads that serve calls in the Server scenario.
SERVER_THREADS = 8
#: How often the GPU memory of a candidate's processes is sampled while it runs.
GPU_SAMPLE_S = 0.1


def latency_of(times: list[float], *, rate: float | None = None, achieved: float | None = None) -> Latency:
    ordered = sorted(times)
    step = max(1, len(ordered) // SAMPLES_KEPT)
    return Latency(
        count=len(ordered), p50=_pct(ordered, 50), p90=_pct(ordered, 90), p99=_pct(ordered, 99),
        mean=statistics.fmean(ordered), stdev=statistics.pstdev(ordered) if len(ordered) > 1 else 0.0,
        min=ordered[0], max=ordered[-1], samples=ordered[::step][:SAMPLES_KEPT], rate=rate, achieved_rate=achieved,
    )  # fmt: skip


def _pct(ordered: list[float], q: float) -> float:
    return float(np.percentile(ordered, q))


def single_stream(call: Call, inputs: dict[str, Any], *, warmup: int, duration: float) -> Latency:
    for _ in range(warmup):
        call(inputs)
    times: list[float] = []
    end = time.perf_counter() + duration
    while len(times) < MIN_CALLS or time.perf_counter() < end:
        t0 = time.perf_counter()
        call(inputs)
        times.append(time.perf_counter() - t0)
    return latency_of(times)


def offline(call: Call, inputs: dict[str, Any], batch_size: int, *, duration: float) -> Throughput:
    for _ in range(2):
        call(inputs)
    times: list[float] = []
    start = time.perf_counter()
    end = start + duration
    while len(times) < MIN_CALLS // 2 or time.perf_counter() < end:
        t0 = time.perf_counter()
        call(inputs)
        times.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    return Throughput(batch_size=batch_size, calls=len(times), seconds=elapsed,
                      items_per_s=batch_size * len(times) / elapsed, p50=_pct(sorted(times), 50))  # fmt: skip


def server(call: Call, inputs: dict[str, Any], rate: float, *, duration: float, seed: int = 0) -> Latency:
    """Calls due at Poisson arrival times of mean ``rate`` per second for ``duration`` seconds, served by
    :data:`SERVER_THREADS` threads; each latency runs from when the call was due to when it returned."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=max(MIN_CALLS, int(rate * duration * 1.5) + 1))
    due = np.cumsum(gaps)
    due = due[due <= max(duration, due[min(MIN_CALLS, len(due)) - 1])]
    times: list[float] = []
    lock = threading.Lock()
    done_at: list[float] = []

    def one(at: float) -> None:
        call(inputs)
        now = time.perf_counter()
        with lock:
            times.append(now - at)
            done_at.append(now)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=SERVER_THREADS, thread_name_prefix="neuropod-compare") as pool:
        futures = []
        for offset in due:
            at = start + float(offset)
            _sleep_until(at)
            futures.append(pool.submit(one, at))
        for f in futures:
            f.result()
    achieved = len(times) / (max(done_at) - start) if done_at else 0.0
    return latency_of(times, rate=rate, achieved=achieved)


def _sleep_until(at: float) -> None:
    """Sleep until ``at`` (``perf_counter``). Not spun: a spinning thread would hold the GIL for the
    interpreter's switch interval (5 ms) while the calls' threads wait for it."""
    left = at - time.perf_counter()
    if left > 0:
        time.sleep(left)


# --- memory ------------------------------------------------------------------------------------


def process_tree(pid: int | None = None) -> list[int]:
    """``pid`` (this process by default) and every process below it (Linux; elsewhere only ``pid``)."""
    root = os.getpid() if pid is None else pid
    if not os.path.isdir("/proc"):
        return [root]
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1:
            parents.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(parents.get(p, []))
    return tree


def _status_bytes(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_now() -> int | None:
    """This process's resident memory now."""
    return _status_bytes(os.getpid(), "VmRSS")


def peak_rss(tree: list[int]) -> tuple[int | None, str | None]:
    """The sum of each process's peak resident memory (``VmHWM``), and a note where it is not what it says."""
    values = [v for v in (_status_bytes(p, "VmHWM") for p in tree) if v is not None]
    if values:
        note = None if len(tree) == 1 else f"summed over {len(tree)} processes (the candidate's and its workers')"
        return sum(values), note
    try:
        import resource
    except ImportError:  # Windows
        return None, "peak memory is not measured on this platform"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak if sys.platform == "darwin" else peak * 1024), "this process only (no /proc to find its workers)"


class GpuMemory:
    """Peak GPU memory held by this process and its workers, sampled through NVML (nothing without it):
    at each :meth:`sample`, and every :data:`GPU_SAMPLE_S` seconds on a thread between :meth:`start`
    and :meth:`stop`."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._nvml: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001  # no NVIDIA driver, no GPU, no library: no GPU figure
            self._nvml = None

    def sample(self, tree: list[int]) -> None:
        if self._nvml is None:
            return
        pids, used = set(tree), 0
        for handle in self._handles:
            try:
                procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:  # noqa: BLE001  # a device that does not say: counted as nothing
                continue
            used += sum(int(p.usedGpuMemory or 0) for p in procs if p.pid in pids)
        self.peak = used if self.peak is None else max(self.peak, used)

    def start(self) -> None:
        if self._nvml is None or self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(GPU_SAMPLE_S):
                self.sample(process_tree())

        self._thread = threading.Thread(target=loop, name="neuropod-compare-gpu", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
