"""Pipelines: what a pipeline adds over calling its steps by hand, in process and served, in one run.

    python bench/bench_pipelines.py [--calls 2000] [--rounds 21] [--served-calls 300] [--rounds-serve 7]
        [--protocols grpc http] [--no-serve] [--quick] [--json PATH] [--strict]

Three tiny ONNX models, one operator each over float32 ["batch", 4] (``y = x + 1``, ``y = x * 2``,
``y = x - 3``), and a pipeline package chaining them (``in`` -> add -> mul -> sub -> ``out``).

1. In process, per call: the onnxruntime sessions neuropod loaded, called one after another
   (``session.run``: the raw framework), the three loaded models called by hand
   (``model.infer``, passing each output on), and the pipeline (``pipeline.infer``). Means of
   ``--calls`` calls per round, the three sides interleaved over ``--rounds`` rounds (the order
   rotating); medians, and the median per-round difference of the pipeline over the models by
   hand: what the pipeline adds. Target: <= 5 us.
2. Through ``neuropod serve`` (the four models in one repository), one client (tritonclient over
   gRPC, then REST), one request at a time: one request to the pipeline against the three models
   called in turn by the client (three round trips, each output sent back as the next input).
   Per-call means of ``--served-calls`` calls per round, the two sides interleaved over
   ``--rounds-serve`` rounds; medians and their ratio. Target: one pipeline request faster than
   three round trips.

Every side's result is checked against numpy's ``(x + 1) * 2 - 3``. The server is pinned to CPU
core 0 and this process (the client) to core 1 where taskset and two cores allow.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import _common
import neuropod
from _servers import free_port_pair, log_tail, stop_group, wait_ready

ADDED_TARGET_US = 5.0
SERVER_CORE, CLIENT_CORE = 0, 1
#: (step name, ONNX operator, its constant): y = x <op> constant.
STEPS = (("add", "Add", 1.0), ("mul", "Mul", 2.0), ("sub", "Sub", 3.0))
PIPELINE = "pipe"
PROTOCOLS = {"grpc": "gRPC", "http": "REST"}


def expected(x: np.ndarray) -> np.ndarray:
    return (x + 1) * 2 - 3


def packages(repo: Path) -> tuple[dict[str, Path], Path]:
    """The three step packages and the pipeline package, side by side in ``repo`` (a model repository)."""
    from onnx import TensorProto, helper, numpy_helper

    from neuropod.packagers import create_onnx_neuropod, create_pipeline_neuropod

    spec_in = [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]
    spec_out = [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}]
    vi = helper.make_tensor_value_info
    steps = {}
    for name, op, constant in STEPS:
        c = numpy_helper.from_array(np.array(constant, np.float32), "c")
        graph = helper.make_graph([helper.make_node(op, ["x", "c"], ["y"])], name,
                                  [vi("x", TensorProto.FLOAT, ["batch", 4])], [vi("y", TensorProto.FLOAT, ["batch", 4])],
                                  initializer=[c])  # fmt: skip
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        steps[name] = create_onnx_neuropod(repo / name, name, spec_in, spec_out, onnx_model=model)
    tensors = ["in", "a", "b", "out"]
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    pipeline = create_pipeline_neuropod(
        repo / PIPELINE, PIPELINE,
        steps=[{"package": steps[name], "input_map": {"x": tensors[i]}, "output_map": {"y": tensors[i + 1]}}
               for i, (name, _, _) in enumerate(STEPS)],
        input_spec=[{"name": "in", "dtype": "float32", "shape": ["batch", 4]}],
        output_spec=[{"name": "out", "dtype": "float32", "shape": ["batch", 4]}],
        test_input_data={"in": x}, test_expected_out={"out": expected(x)},
    )  # fmt: skip
    return steps, pipeline


def interleaved(sides: dict[str, Callable[[], Any]], calls: int, rounds: int) -> dict[str, list[float]]:
    """Per-call seconds of each side, one mean of ``calls`` calls per round, the order rotating."""
    names = list(sides)
    for name in names:  # warm up
        _common.per_call(sides[name], calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(_common.per_call(sides[name], calls))
    return times


# --- 1. in process ----------------------------------------------------------------


def in_process(steps: dict[str, Path], pipeline: Path, calls: int, rounds: int) -> dict[str, float]:
    x = np.full((1, 4), 0.5, np.float32)
    want = expected(x)
    models = [neuropod.load_neuropod(steps[name]) for name, _, _ in STEPS]
    try:
        with neuropod.load_neuropod(pipeline) as pipe:
            sessions = [m._handle.session for m in models]  # the very sessions neuropod runs
            first, second, third = models

            def raw() -> np.ndarray:
                y = x
                for s in sessions:
                    y = s.run(None, {"x": y})[0]
                return y

            def by_hand() -> np.ndarray:
                return third.infer({"x": second.infer({"x": first.infer({"x": x})["y"]})["y"]})["y"]

            def piped() -> np.ndarray:
                return pipe.infer({"in": x})["out"]

            for fn in (raw, by_hand, piped):
                np.testing.assert_array_equal(fn(), want)
            times = interleaved({"raw": raw, "by_hand": by_hand, "pipeline": piped}, calls, rounds)
    finally:
        for m in models:
            m.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    added = statistics.median(p - h for p, h in zip(times["pipeline"], times["by_hand"]))
    ratio = statistics.median(p / h for p, h in zip(times["pipeline"], times["by_hand"]))
    over_raw = statistics.median(p - r for p, r in zip(times["pipeline"], times["raw"]))
    print(f"three tiny ONNX steps (x+1, x*2, x-3; float32 [1, 4]), in process, per call "
          f"({rounds} interleaved rounds x {calls} calls, medians):")  # fmt: skip
    print(f"  onnxruntime, the three sessions called in turn (session.run)   {med['raw'] * 1e6:8.2f} us")
    print(f"  neuropod, the three models called by hand (model.infer)        {med['by_hand'] * 1e6:8.2f} us")
    print(f"  neuropod, the pipeline (pipeline.infer)                        {med['pipeline'] * 1e6:8.2f} us")
    print(f"  added by the pipeline over the models by hand                  {added * 1e6:8.2f} us   ratio {ratio:.3f}")
    print(f"  the pipeline over raw onnxruntime                              {over_raw * 1e6:8.2f} us")
    result = {"raw": med["raw"], "by_hand": med["by_hand"], "neuropod": med["pipeline"], "overhead": added,
              "ratio": ratio}  # fmt: skip
    _common.record("three-step pipeline over the three models by hand (tiny ONNX)", "pipeline_added",
                   method=f"median of {rounds} interleaved rounds of {calls} calls", **result)  # fmt: skip
    _common.verdict(f"a three-step pipeline adds <= {ADDED_TARGET_US:g} us over its models by hand",
                    added * 1e6 <= ADDED_TARGET_US, f"{added * 1e6:.2f} us", key="pipeline_added")  # fmt: skip
    return result


# --- 2. served -----------------------------------------------------------------------


def start_server(repo: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    pinned = (
        ["taskset", "-c", str(SERVER_CORE)] if shutil.which("taskset") and len(os.sched_getaffinity(0)) >= 2 else []
    )
    command = [sys.executable, "-m", "neuropod", "serve", str(repo), "--http-port", str(port), "--grpc-port",
               str(port + 1), "--metrics-port", "0", "--quiet"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen([*pinned, *command], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    urls = [f"http://127.0.0.1:{port}/v2/health/ready"]
    urls += [f"http://127.0.0.1:{port}/v2/models/{name}/ready" for name in (*(s[0] for s in STEPS), PIPELINE)]
    try:
        wait_ready(proc, "neuropod serve", log, urls, 180.0)
    except BaseException:
        stop_group(proc)
        raise
    return proc


def served_sides(protocol: str, port: int) -> tuple[Any, Callable[[], np.ndarray], Callable[[], np.ndarray]]:
    """(the client, one pipeline request, three round trips), over ``protocol``."""
    if protocol == "grpc":
        import tritonclient.grpc as tc
    else:
        import tritonclient.http as tc  # type: ignore[no-redef]
    client = tc.InferenceServerClient(f"127.0.0.1:{port + 1 if protocol == 'grpc' else port}")
    x = np.full((1, 4), 0.5, np.float32)
    pipe_in = tc.InferInput("in", [1, 4], "FP32")
    pipe_in.set_data_from_numpy(x)
    pipe_out = [tc.InferRequestedOutput("out")]
    step_in = tc.InferInput("x", [1, 4], "FP32")
    step_out = [tc.InferRequestedOutput("y")]

    def pipeline() -> np.ndarray:
        return client.infer(PIPELINE, [pipe_in], outputs=pipe_out).as_numpy("out")

    def round_trips() -> np.ndarray:
        y = x
        for name, _, _ in STEPS:
            step_in.set_data_from_numpy(y)
            y = client.infer(name, [step_in], outputs=step_out).as_numpy("y")
        return y

    return client, pipeline, round_trips


def served(tmp: Path, repo: Path, calls: int, rounds: int, protocols: list[str]) -> dict[str, dict[str, float]]:
    port = free_port_pair()
    log = tmp / "serve.log"
    proc = start_server(repo, port, log)
    want = expected(np.full((1, 4), 0.5, np.float32))
    results: dict[str, dict[str, float]] = {}
    print(f"through neuropod serve, one tritonclient client, one request at a time ({rounds} interleaved rounds x "
          f"{calls} calls, medians):")  # fmt: skip
    try:
        for protocol in protocols:
            client, pipeline, round_trips = served_sides(protocol, port)
            try:
                for fn in (pipeline, round_trips):
                    np.testing.assert_array_equal(fn(), want)
                times = interleaved({"three": round_trips, "pipeline": pipeline}, calls, rounds)
            finally:
                client.close()
            three, one = statistics.median(times["three"]), statistics.median(times["pipeline"])
            ratio = statistics.median(t / p for t, p in zip(times["three"], times["pipeline"]))
            name = PROTOCOLS[protocol]
            print(f"  {name:<5} three round trips (the client calls add, mul, sub)  {three * 1e6:8.1f} us")
            print(f"  {name:<5} one pipeline request                               {one * 1e6:8.1f} us   "
                  f"three round trips / pipeline {ratio:.2f}x")  # fmt: skip
            results[protocol] = {"raw": three, "neuropod": one, "ratio": ratio}
            key = f"pipeline_serve_{protocol}"
            _common.record(f"served three-step pipeline ({name}): one request vs three round trips", key,
                           method=f"median of {rounds} interleaved rounds of {calls} calls", **results[protocol])  # fmt: skip
            _common.verdict(f"served ({name}), one pipeline request beats three round trips", ratio > 1.0,
                            f"{ratio:.2f}x", key=key)  # fmt: skip
    except BaseException:
        print(f"neuropod serve: its log ends:\n{log_tail(log)}")
        raise
    finally:
        stop_group(proc)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per round in process (default 2000)")
    parser.add_argument("--rounds", type=int, default=21, help="rounds in process (default 21)")
    parser.add_argument("--served-calls", type=int, default=300, help="calls per round served (default 300)")
    parser.add_argument("--rounds-serve", type=int, default=7, help="rounds served (default 7)")
    parser.add_argument("--protocols", nargs="+", choices=list(PROTOCOLS), default=list(PROTOCOLS),
                        help="the client's protocols (default: grpc http)")  # fmt: skip
    parser.add_argument("--no-serve", action="store_true", help="in process only")
    parser.add_argument("--quick", action="store_true", help="fewer calls and rounds")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    _common.add_json_option(parser)
    args = parser.parse_args()
    if args.quick:
        args.calls, args.rounds, args.served_calls, args.rounds_serve = 500, 7, 100, 3
    import onnxruntime

    pinned = shutil.which("taskset") is not None and len(os.sched_getaffinity(0)) >= 2
    if pinned:
        os.sched_setaffinity(0, {CLIENT_CORE})
    print(f"neuropod {neuropod.__version__}, onnxruntime {onnxruntime.__version__}; this process on "
          f"{'core 1, the server on core 0' if pinned else 'every core (no taskset or one core)'}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-pipelines-") as d:
        tmp = Path(d)
        steps, pipeline = packages(tmp / "repo")
        in_process(steps, pipeline, args.calls, args.rounds)
        if not args.no_serve:
            served(tmp, tmp / "repo", args.served_calls, args.rounds_serve, args.protocols)
    _common.write_json(args.json, "bench_pipelines", {"neuropod": neuropod.__version__,
                                                      "onnxruntime": onnxruntime.__version__})  # fmt: skip
    missed = [t for t in _common.TARGETS if not t["met"]]
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
