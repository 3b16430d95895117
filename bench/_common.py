"""Timing helpers shared by the benchmarks: interleaved rounds, medians, ratios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def per_call(fn: Callable[[], Any], n: int) -> float:
    """Mean seconds per call of ``fn`` over ``n`` calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def compare(name: str, raw: Callable[[], Any], ours: Callable[[], Any], calls: int, rounds: int) -> dict[str, float]:
    """Time ``raw`` (the framework alone) against ``ours`` (through neuropod).

    Calls are interleaved in rounds (raw first in even rounds, ours first in
    odd ones) so drift in the machine's speed hits both alike; medians over
    rounds make one noisy round harmless. Prints one line and returns the
    medians, the median ratio and the median per-round overhead (seconds).
    """
    for _ in range(3):  # warm up both paths
        per_call(raw, calls)
        per_call(ours, calls)
    raws, nps = [], []
    for r in range(rounds):
        if r % 2 == 0:
            raws.append(per_call(raw, calls))
            nps.append(per_call(ours, calls))
        else:
            nps.append(per_call(ours, calls))
            raws.append(per_call(raw, calls))
    raw_med, np_med = statistics.median(raws), statistics.median(nps)
    overhead = statistics.median(n - r for n, r in zip(nps, raws))
    ratio = statistics.median(n / r for n, r in zip(nps, raws))
    print(
        f"{name:<34} raw {raw_med * 1e6:9.2f} us   neuropod {np_med * 1e6:9.2f} us   "
        f"ratio {ratio:6.3f}   overhead {overhead * 1e6:6.2f} us/call   ({rounds} rounds x {calls} calls)"
    )
    return {"raw": raw_med, "neuropod": np_med, "ratio": ratio, "overhead": overhead}


def verdict(label: str, ok: bool, figure: str) -> None:
    print(f"target {label}: {'met' if ok else 'NOT met'} ({figure})")


def compare_per_call(name: str, raw: Callable[[], Any], ours: Callable[[], Any], calls: int) -> dict[str, float]:
    """Like :func:`compare`, for latency: every call timed on its own, the two sides alternating call by call.

    Returns the median of each side and the median of the per-pair
    differences, which is robust to the machine's slower moments hitting one
    side's block of calls more than the other's.
    """
    for _ in range(min(calls, 200)):
        raw()
        ours()
    raws, nps, diffs = [], [], []
    clock = time.perf_counter
    for i in range(calls):
        if i % 2:
            t0 = clock(); ours(); t1 = clock(); raw(); t2 = clock()  # noqa: E702
            n, r = t1 - t0, t2 - t1
        else:
            t0 = clock(); raw(); t1 = clock(); ours(); t2 = clock()  # noqa: E702
            r, n = t1 - t0, t2 - t1
        raws.append(r)
        nps.append(n)
        diffs.append(n - r)
    raw_med, np_med, overhead = statistics.median(raws), statistics.median(nps), statistics.median(diffs)
    print(
        f"{name:<44} raw {raw_med * 1e6:9.2f} us   neuropod {np_med * 1e6:9.2f} us   "
        f"added {overhead * 1e6:7.2f} us/call (median of {calls} alternating pairs)"
    )
    return {"raw": raw_med, "neuropod": np_med, "ratio": np_med / raw_med, "overhead": overhead}
