"""What a pipeline step on another machine costs: a two-step pipeline run in process, against the
same pipeline with its second step served by ``neuropod serve`` (gRPC, then REST).

    python bench/pipeline_remote_step.py [--calls 500] [--rounds 7] [--quick]

The steps are tiny ONNX models: ``scale`` (y = 3 x) then ``adder`` (out = x + y, doubled = 2 out; the
pipeline's ``out`` is its ``doubled``). Two input sizes: 1 x 4 float32 (16 bytes: the round trip
itself) and 1 x 150,528 float32 (a 224 x 224 x 3 image, 588 KiB: the tensors' serialization; the
remote step gets two such tensors and sends one back). Each call is timed on its own; the sides are
interleaved over ``--rounds`` rounds of ``--calls`` calls; the figure is the median call of each side,
and what the served step adds over the local pipeline. Every result is checked against numpy. The
server is pinned to CPU core 0 and this process to core 1 where taskset and two cores allow.

Not part of ``nox -s bench``'s loop (it needs ``neuropod-serving[server,client]``): run it in the
environment of ``nox -s bench_pipelines`` or any with the serving extras.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import neuropod
from _servers import stop_group, wait_ready

SERVER_CORE, CLIENT_CORE = 0, 1
SIZES = {"1 x 4": 4, "1 x 150528 (an image)": 224 * 224 * 3}


def _onnx(
    dest: Path, name: str, nodes: list[Any], inputs: list[str], outputs: list[str], consts: dict[str, float]
) -> None:
    from onnx import TensorProto, helper  # lazy: onnx only where the packages are built

    from neuropod.packagers import create_onnx_neuropod

    def info(n: str) -> Any:
        return helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "width"])

    inits = [helper.make_tensor(k, TensorProto.FLOAT, [], [v]) for k, v in consts.items()]
    graph = helper.make_graph(nodes, name, [info(n) for n in inputs], [info(n) for n in outputs], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    spec = lambda names: [{"name": n, "dtype": "float32", "shape": ["batch", "width"]} for n in names]  # noqa: E731
    create_onnx_neuropod(dest, name, spec(inputs), spec(outputs), onnx_model=model)


def build(tmp: Path) -> None:
    from onnx import helper  # lazy: as in _onnx

    _onnx(tmp / "scale", "scale", [helper.make_node("Mul", ["x", "k"], ["y"])], ["x"], ["y"], {"k": 3.0})
    _onnx(tmp / "served" / "adder", "adder",
          [helper.make_node("Add", ["x", "y"], ["out"]), helper.make_node("Mul", ["out", "two"], ["doubled"])],
          ["x", "y"], ["out", "doubled"], {"two": 2.0})  # fmt: skip


def pipeline(tmp: Path, name: str, adder: str) -> Path:
    from neuropod.packagers import create_pipeline_neuropod

    path: Path = create_pipeline_neuropod(tmp / name, name, steps=[
        {"package": str(tmp / "scale"), "input_map": {"x": "in"}, "output_map": {"y": "scaled"}},
        {"package": adder, "input_map": {"x": "scaled", "y": "in"}, "output_map": {"doubled": "out"}},
    ], input_spec=[{"name": "in", "dtype": "float32", "shape": ["batch", "width"]}],
       output_spec=[{"name": "out", "dtype": "float32", "shape": ["batch", "width"]}])  # fmt: skip
    return path


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def timed_calls(fn: Callable[[], Any], n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="50 calls, 3 rounds")
    args = ap.parse_args()
    calls, rounds = (50, 3) if args.quick else (args.calls, args.rounds)
    pinned = shutil.which("taskset") is not None and len(os.sched_getaffinity(0)) >= 2
    tmp = Path(tempfile.mkdtemp(prefix="neuropod-bench-pipeline-remote-"))
    server = None
    try:
        build(tmp)
        http_port, grpc_port = free_ports(2)
        log = tmp / "serve.log"
        cmd = [sys.executable, "-m", "neuropod", "serve", str(tmp / "served"), "--http-port", str(http_port),
               "--grpc-port", str(grpc_port), "--metrics-port", "0", "--quiet"]  # fmt: skip
        with open(log, "wb") as out:
            server = subprocess.Popen((["taskset", "-c", str(SERVER_CORE)] if pinned else []) + cmd,
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        wait_ready(server, "neuropod serve", log, [f"http://127.0.0.1:{http_port}/v2/health/ready"], 120)
        if pinned:
            os.sched_setaffinity(0, {CLIENT_CORE})
        sides = {
            "local (both steps in process)": pipeline(tmp, "local", str(tmp / "served" / "adder")),
            "adder served, gRPC": pipeline(tmp, "over_grpc", f"grpc://127.0.0.1:{grpc_port}/adder"),
            "adder served, REST": pipeline(tmp, "over_rest", f"http://127.0.0.1:{http_port}/adder"),
        }
        models = {label: neuropod.load_neuropod(path) for label, path in sides.items()}
        print(f"pipeline_remote_step: {calls} calls x {rounds} rounds per side, one call at a time; this process on "
              f"{'core 1, the server on core 0' if pinned else 'every core (no taskset or one core)'}")  # fmt: skip
        for size, width in SIZES.items():
            x = np.random.default_rng(0).standard_normal((1, width)).astype(np.float32)
            expected = 2 * (3 * x + x)
            times: dict[str, list[float]] = {label: [] for label in models}
            inputs = {"in": x}
            for model in models.values():
                np.testing.assert_allclose(model.infer(inputs)["out"], expected, rtol=1e-6)
                timed_calls(lambda m=model, i=inputs: m.infer(i), max(calls // 10, 5))  # warm-up
            for r in range(rounds):
                order = list(models)[r % len(models) :] + list(models)[: r % len(models)]
                for label in order:
                    model = models[label]
                    times[label] += timed_calls(lambda m=model, i=inputs: m.infer(i), calls)
            local = statistics.median(times["local (both steps in process)"])
            print(f"\ninput {size} float32:")
            for label, t in times.items():
                median = statistics.median(t)
                added = "" if median == local else f"  (+{(median - local) * 1e6:,.0f} us over local)"
                print(f"  {label:32s} median {median * 1e6:9,.1f} us per call{added}")
        for model in models.values():
            model.close()
    finally:
        if server is not None:
            stop_group(server)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
