"""tritonclient's per-call latency against a server, for bench_remote.py, in a process of its own.

    python bench/remote_triton.py --grpc HOST:PORT --http HOST:PORT --cases CASES.json --arrays ARRAYS.npz

tritonclient.grpc registers its own ``inference.*`` protobuf messages, which
cannot share a process with neuropod_serving's, so bench_remote.py starts this
once and drives it over stdin/stdout, one JSON object a line:

    {"protocol": "grpc" | "http", "case": NAME, "warmup": W, "calls": N}
    -> {"ok": true, "seconds": [N per-call latencies]}  or  {"ok": false, "error": "..."}

Each call is what a user of tritonclient writes: InferInput objects filled
with ``set_data_from_numpy`` (binary data over HTTP), ``infer``, then
``as_numpy`` on every output. Before the first timed run of a case and
protocol, the outputs are compared with the expected arrays.

``CASES.json``: ``{case: {"model": name, "inputs": [[name, datatype], ...],
"outputs": [name, ...]}}``; ``ARRAYS.npz``: ``CASE/INPUT`` and
``CASE/OUTPUT/expected``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


class Caller:
    """One protocol's client and the calls of every case, inputs prepared as arrays."""

    def __init__(self, protocol: str, url: str, cases: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        if protocol == "grpc":
            import tritonclient.grpc as module
        else:
            import tritonclient.http as module
        self.protocol, self.module, self.cases, self.arrays = protocol, module, cases, arrays
        self.client = module.InferenceServerClient(url)
        self.checked: set[str] = set()

    def call(self, case: str) -> dict[str, np.ndarray]:
        m, spec = self.module, self.cases[case]
        binary = {} if self.protocol == "grpc" else {"binary_data": True}
        inputs = []
        for name, datatype in spec["inputs"]:
            array = self.arrays[f"{case}/{name}"]
            tensor = m.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array, **binary)
            inputs.append(tensor)
        outputs = [m.InferRequestedOutput(n, **binary) for n in spec["outputs"]]
        result = self.client.infer(spec["model"], inputs, outputs=outputs)
        return {n: result.as_numpy(n) for n in spec["outputs"]}

    def check(self, case: str) -> None:
        got = self.call(case)
        for name, array in got.items():
            expected = self.arrays[f"{case}/{name}/expected"]
            if array is None or array.shape != expected.shape or not np.allclose(array, expected, rtol=1e-5, atol=1e-5):
                raise RuntimeError(f"tritonclient.{self.protocol} {case}: output {name!r} is {array!r}, expected {expected!r}")
        self.checked.add(case)

    def run(self, case: str, warmup: int, calls: int) -> list[float]:
        if case not in self.checked:
            self.check(case)
        for _ in range(warmup):
            self.call(case)
        clock, out = time.perf_counter, []
        for _ in range(calls):
            t0 = clock()
            self.call(case)
            out.append(clock() - t0)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc", required=True, help="HOST:PORT of the gRPC endpoint")
    parser.add_argument("--http", required=True, help="HOST:PORT of the REST endpoint")
    parser.add_argument("--cases", type=Path, required=True)
    parser.add_argument("--arrays", type=Path, required=True)
    args = parser.parse_args()
    cases = json.loads(args.cases.read_text())
    with np.load(args.arrays) as npz:
        arrays = {k: npz[k] for k in npz.files}
    callers = {"grpc": Caller("grpc", args.grpc, cases, arrays), "http": Caller("http", args.http, cases, arrays)}
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        order = json.loads(line)
        try:
            seconds = callers[order["protocol"]].run(order["case"], order["warmup"], order["calls"])
        except Exception as e:  # noqa: BLE001 (reported to the bench, which stops with it)
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
        else:
            print(json.dumps({"ok": True, "seconds": seconds}), flush=True)
    for caller in callers.values():
        caller.client.close()


if __name__ == "__main__":
    main()
