"""Closed-loop gRPC load for bench_serve.py: N processes x M in-flight ModelInfer calls.

    python bench/serve_grpc_load.py --target 127.0.0.1:8001 --request FILE \
        --concurrency 32 --processes 2 --warmup 0.5 --duration 3

FILE holds one serialized ``inference.ModelInferRequest`` (bench_serve.py
builds it with the project's generated messages). Every in-flight slot sends
it, awaits the reply, and sends it again: concurrency = processes x slots.
The bytes go out as they are and replies come back as bytes (no
serializers): like wrk's prepared request, the client spends no time on
protobuf, so the server is what is measured.

All processes warm up together, then count the calls that complete inside
one shared window of ``--duration`` seconds (CLOCK_MONOTONIC is the same
in every process). Prints ``GRPC_WINDOW t0 t1`` (that window, in
``time.monotonic()`` seconds) when it starts, then ``GRPC_RESULT {json}``:
requests/s, p50/p90/p99 and mean latency in microseconds, errors, and the
CPU the load processes used in the window (``load_cpu``, in cores: near 1.0
means the load generator, not the server, may be the limit).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from array import array

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def _child(target: str, request: bytes, slots: int, ready_w: int, go_r: int, out_w: int) -> None:
    """One load process: ``slots`` closed loops on one channel; latencies (seconds) to ``out_w``."""
    import asyncio

    import grpc

    async def run() -> tuple[array, int, float]:
        async with grpc.aio.insecure_channel(target) as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            call = channel.unary_unary(METHOD)
            await call(request)  # one call before the window: connection and server warm
            os.write(ready_w, b"R")
            t0, t1 = struct.unpack("dd", os.read(go_r, 16))
            latencies = array("d")
            errors = 0
            clock = time.monotonic

            async def loop() -> None:
                nonlocal errors
                while True:
                    start = clock()
                    try:
                        await call(request)
                        ok = True
                    except grpc.RpcError:
                        ok = False
                    end = clock()
                    if end > t1:
                        return
                    if end >= t0:
                        if ok:
                            latencies.append(end - start)
                        else:
                            errors += 1

            async def cpu_in_window() -> float:
                # This process's CPU time (every thread, grpc's own included) inside the window.
                await asyncio.sleep(max(0.0, t0 - clock()))
                before = time.process_time()
                await asyncio.sleep(max(0.0, t1 - clock()))
                return time.process_time() - before

            cpu, *_ = await asyncio.gather(cpu_in_window(), *(loop() for _ in range(slots)))
            return latencies, errors, cpu

    try:
        import uvloop

        latencies, errors, cpu = uvloop.run(run())
    except ImportError:
        latencies, errors, cpu = asyncio.run(run())
    data = struct.pack("qd", errors, cpu) + latencies.tobytes()
    view = memoryview(data)
    while view:
        view = view[os.write(out_w, view) :]


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="host:port")
    parser.add_argument("--request", required=True, help="file with one serialized ModelInferRequest")
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--duration", type=float, default=3.0)
    args = parser.parse_args()
    with open(args.request, "rb") as f:
        request = f.read()
    procs = max(1, min(args.processes, args.concurrency))
    slots = [args.concurrency // procs + (1 if i < args.concurrency % procs else 0) for i in range(procs)]

    # Fork before anything imports grpc: its threads do not survive a fork.
    children = []
    for n in slots:
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for fd in (ready_r, go_w, out_r):
                    os.close(fd)
                _child(args.target, request, n, ready_w, go_r, out_w)
            except BaseException as e:  # noqa: BLE001 - report and leave: never fall back into the parent's code
                print(f"serve_grpc_load: load process failed: {e!r}", file=sys.stderr)
                code = 1
            finally:
                os._exit(code)
        for fd in (ready_w, go_r, out_w):
            os.close(fd)
        children.append((pid, ready_r, go_w, out_r))

    failed = False
    for _, ready_r, _, _ in children:
        if os.read(ready_r, 1) != b"R":
            failed = True
    t0 = time.monotonic() + args.warmup
    t1 = t0 + args.duration
    for _, _, go_w, _ in children:
        os.write(go_w, struct.pack("dd", t0, t1))
    print(f"GRPC_WINDOW {t0} {t1}", flush=True)
    latencies = array("d")
    errors, cpu = 0, 0.0
    for pid, _, _, out_r in children:
        chunks = []
        while chunk := os.read(out_r, 1 << 20):
            chunks.append(chunk)
        data = b"".join(chunks)
        _, status = os.waitpid(pid, 0)
        head = struct.calcsize("qd")
        if status != 0 or len(data) < head:
            failed = True
            continue
        e, c = struct.unpack("qd", data[:head])
        errors, cpu = errors + e, cpu + c
        latencies.frombytes(data[head:])
    if failed:
        raise SystemExit("serve_grpc_load: a load process failed (see above)")
    values = sorted(latencies)
    result = {
        "requests": len(values),
        "seconds": args.duration,
        "rps": len(values) / args.duration,
        "p50_us": _percentile(values, 50) * 1e6,
        "p90_us": _percentile(values, 90) * 1e6,
        "p99_us": _percentile(values, 99) * 1e6,
        "mean_us": sum(values) / len(values) * 1e6 if values else float("nan"),
        "max_us": values[-1] * 1e6 if values else float("nan"),
        "errors": {"rpc": errors},
        "load_cpu": cpu / args.duration,
        "processes": procs,
    }
    print("GRPC_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
