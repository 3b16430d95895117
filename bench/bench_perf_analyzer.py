"""Triton's load generator, perf_analyzer, against ``neuropod serve``, beside this project's own load.

    python bench/bench_perf_analyzer.py [--perf-analyzer ../shared/tools/perf-analyzer] [--repeats 3]
        [--duration 2] [--json out.json]

One ``neuropod serve`` (pinned to CPU core 0) serves the ``tiny`` model of
bench_serve.py (out = x + y, float32 [batch_size, 2]). Each round measures, on
core 1 and one after another:

* perf_analyzer over HTTP and over gRPC at concurrency 1 and 8 (binary tensors,
  its default), and with ``--shared-memory system`` (inputs and outputs in POSIX
  shared memory regions it registers with the server);
* the same cells with bench_serve.py's own load generators: wrk with Triton's
  binary tensor extension for HTTP, serve_grpc_load.py (grpc.aio) for gRPC.

The table shows medians over the rounds: requests/s and p99 latency from each
tool, and perf_analyzer's requests/s over ours (the two should agree within the
machine's noise; perf_analyzer's figures include its own client cost, as ours do).
perf_analyzer first reads the model's configuration and, with ``--shared-memory``,
registers regions: every call it makes must be served for it to run at all.

perf_analyzer needs a newer glibc than some hosts have: ``--perf-analyzer``
names a command that runs it (default: ``../shared/tools/perf-analyzer`` beside
the checkout, which fetches it and a newer loader on first use, else
``perf_analyzer`` on PATH).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_serve  # noqa: E402  (this folder's module: models, servers, load generators)

CONCURRENCIES = (1, 8)


@dataclass
class Cell:
    protocol: str  # "http" or "grpc"
    concurrency: int
    tool: str  # "perf_analyzer", "perf_analyzer shm" or "ours"
    rounds: list[dict[str, float]] = field(default_factory=list)

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rounds) if self.rounds else float("nan")


def perf_analyzer_command(arg: str | None) -> list[str]:
    if arg:
        return [arg]
    shared = HERE.parent.parent / "shared" / "tools" / "perf-analyzer"
    if shared.exists():
        return [str(shared)]
    found = shutil.which("perf_analyzer")
    if found:
        return [found]
    raise SystemExit("perf_analyzer not found: give --perf-analyzer (a command that runs it)")


def run_perf_analyzer(cmd: list[str], server: bench_serve.Server, protocol: str, c: int, shm: bool,
                      args: argparse.Namespace, tmp: Path) -> dict[str, float]:  # fmt: skip
    port = server.http_port if protocol == "http" else server.grpc_port
    out = tmp / f"pa-{protocol}-{c}-{'shm' if shm else 'net'}.csv"
    full = [
        "taskset", "-c", bench_serve.LOAD_CORE, *cmd, "-m", "tiny", "-u", f"127.0.0.1:{port}", "-i", protocol,
        "--concurrency-range", f"{c}:{c}", "--measurement-mode", "time_windows",
        "--measurement-interval", str(int(args.duration * 1000)), "--stability-percentage", "100",
        "--max-trials", "8", "-f", str(out),
        # Served unbatched, the model's configuration says dims [-1, 2]: one row a request, as ours sends.
        "--shape", "x:1,2", "--shape", "y:1,2",
    ]  # fmt: skip
    if shm:
        # One row of float32 [1, 2]: 8 bytes an output.
        full += ["--shared-memory", "system", "--output-shared-memory-size", "8"]
    proc = subprocess.run(full, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"perf_analyzer failed ({proc.returncode}): {' '.join(full)}\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\nserver log:\n{server.tail()}")  # fmt: skip
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    row = rows[0]
    return {"rps": float(row["Inferences/Second"]), "p99_ms": float(row["p99 latency"]) / 1e3,
            "server_queue_us": float(row.get("Server Queue", "nan") or "nan"),
            "server_compute_us": float(row.get("Server Compute Infer", "nan") or "nan")}  # fmt: skip


def run_ours(server: bench_serve.Server, model: bench_serve.Model, bodies: bench_serve.Bodies, protocol: str, c: int,
             args: argparse.Namespace) -> dict[str, float]:  # fmt: skip
    if protocol == "http":
        r = bench_serve.rest_load(server, model, bodies.binary, bodies.binary_header, c, args)
    else:
        r = bench_serve.grpc_load(server, bodies.grpc, c, args)
    return {"rps": r["rps"], "p99_ms": r["p99_ms"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--perf-analyzer", help="a command that runs perf_analyzer")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the table shows medians (default 3)")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds measured per cell (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="seconds of warm-up before our own load (default 1)")
    parser.add_argument("--grpc-processes", type=int, default=2, help="our gRPC load processes (default 2)")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    args.duration = max(1, round(args.duration))
    pa = perf_analyzer_command(args.perf_analyzer)
    if shutil.which("wrk") is None or shutil.which("taskset") is None:
        raise SystemExit("needs wrk and taskset (apt-get install wrk util-linux)")

    tmp = Path(tempfile.mkdtemp(prefix="neuropod-bench-pa-"))
    models = bench_serve.build_models(tmp)
    tiny = models[bench_serve.TINY]
    bodies = bench_serve.write_bodies(tiny, tmp)
    # --allow-client-shm: perf_analyzer --shared-memory registers regions of its own.
    server = bench_serve.neuropod_server("neuropod", [tiny], tmp, grpc=True, extra=["--allow-client-shm"])
    cells: dict[tuple[str, int, str], Cell] = {}
    plan = [(p, c, tool) for p in ("http", "grpc") for c in CONCURRENCIES
            for tool in ("perf_analyzer", "perf_analyzer shm", "ours")]  # fmt: skip
    print(f"server on core {bench_serve.SERVER_CORE}, load on core {bench_serve.LOAD_CORE}; {args.repeats} rounds "
          f"x {args.duration} s per cell; medians shown", flush=True)  # fmt: skip
    server.start()
    try:
        server.wait_ready()
        for r in range(args.repeats):
            for protocol, c, tool in plan[r % len(plan) :] + plan[: r % len(plan)]:
                if tool == "ours":
                    result = run_ours(server, tiny, bodies, protocol, c, args)
                else:
                    result = run_perf_analyzer(pa, server, protocol, c, tool.endswith("shm"), args, tmp)
                cells.setdefault((protocol, c, tool), Cell(protocol, c, tool)).rounds.append(result)
            print(f"round {r + 1}/{args.repeats} done", flush=True)
    finally:
        server.stop()

    print()
    print(f"{'protocol':<9}{'c':>3}  {'tool':<20}{'req/s':>9}{'p99 ms':>9}  {'vs ours':>8}")
    for protocol in ("http", "grpc"):
        for c in CONCURRENCIES:
            ours = cells[(protocol, c, "ours")]
            for tool in ("ours", "perf_analyzer", "perf_analyzer shm"):
                cell = cells[(protocol, c, tool)]
                ratio = statistics.median(a["rps"] / b["rps"] for a, b in zip(cell.rounds, ours.rounds))
                print(f"{protocol:<9}{c:>3}  {tool:<20}{cell.median('rps'):>9,.0f}{cell.median('p99_ms'):>9.2f}  "
                      f"{ratio:>8.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"cells": [
            {"protocol": k[0], "concurrency": k[1], "tool": k[2], "rounds": v.rounds} for k, v in cells.items()
        ]}, indent=1))  # fmt: skip
        print(f"results written to {args.json}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
