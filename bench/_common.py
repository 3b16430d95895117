"""Timing helpers shared by the benchmarks: interleaved rounds, medians, ratios.

Every :func:`compare`, :func:`compare_per_call` and :func:`verdict` is also
recorded; a bench given ``--json PATH`` (see :func:`add_json_option`) writes
those records with the machine, the versions and the command line to PATH
through :func:`write_json`, which ``bench/charts.py`` draws.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS: list[dict[str, Any]] = []  # one per compare / compare_per_call / record, in order
TARGETS: list[dict[str, Any]] = []  # one per verdict


def per_call(fn: Callable[[], Any], n: int) -> float:
    """Mean seconds per call of ``fn`` over ``n`` calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def compare(
    name: str, raw: Callable[[], Any], ours: Callable[[], Any], calls: int, rounds: int, key: str | None = None
) -> dict[str, float]:
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
    result = {"raw": raw_med, "neuropod": np_med, "ratio": ratio, "overhead": overhead}
    record(name, key, method=f"median of {rounds} interleaved rounds of {calls} calls", **result)
    return result


def verdict(label: str, ok: bool, figure: str, key: str | None = None) -> None:
    print(f"target {label}: {'met' if ok else 'NOT met'} ({figure})")
    TARGETS.append({"key": key, "target": label, "met": bool(ok), "figure": figure})


def record(name: str, key: str | None = None, **fields: Any) -> None:
    """Keep one result for ``--json`` (seconds for times); ``key`` is the name charts look it up by."""
    RESULTS.append({"key": key, "name": name, **fields})


def compare_per_call(
    name: str, raw: Callable[[], Any], ours: Callable[[], Any], calls: int, key: str | None = None
) -> dict[str, float]:
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
    result = {"raw": raw_med, "neuropod": np_med, "ratio": np_med / raw_med, "overhead": overhead}
    record(name, key, method=f"medians of {calls} alternating call pairs", **result)
    return result


def add_json_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", metavar="PATH", help="also write the results, the machine and the versions to PATH (JSON)")


def cpu_model(fallback: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo; elsewhere what ``platform`` says, then ``fallback``, then the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or fallback or platform.machine()


def machine() -> dict[str, Any]:
    """What ran the bench: CPU model and count, OS, Python."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "arch": platform.machine(),
        "system": platform.platform(terse=True),
        "python": platform.python_version(),
    }


def write_json(path: str | None, bench: str, versions: dict[str, str], **extra: Any) -> None:
    """Write what this run recorded to ``path`` (nothing when ``path`` is None)."""
    if not path:
        return
    import numpy

    import neuropod

    script = os.path.relpath(sys.argv[0]) if os.path.isabs(sys.argv[0]) else sys.argv[0]
    args = list(sys.argv[1:])
    if "--json" in args:  # the command that reproduces the figures, less where this copy went
        i = args.index("--json")
        del args[i : i + 2]
    data = {
        "bench": bench,
        "command": " ".join(["python", script, *args]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "versions": {"neuropod": neuropod.__version__, "numpy": numpy.__version__, **versions},
        "results": RESULTS,
        "targets": TARGETS,
        **extra,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")
