"""neuropod serve on plain OIP JSON requests against the floor's JSON route, alone (a few minutes).

    python bench/bench_serve_json.py [--baseline-src DIR] [--repeats 3] [--duration 3] [--concurrency 1,8]

bench_serve.py's REST JSON cells without the rest of its plan: its two models
(``tiny`` and ``small_inputs_100``, 100 float32 inputs of [10, 5]), its request
bodies (``build_infer_request(binary=False, binary_outputs=False)``), its servers
pinned to core 0 and ``wrk`` to core 1, against ``neuropod serve`` and the floor
(serve_floor.py: orjson and one numpy conversion per input, no model). With
``--baseline-src DIR``, a second ``neuropod serve`` runs the code in ``DIR`` (a
tree of this repository, e.g. ``git archive main core serving plugins/neuropod-onnx``
unpacked there) through ``PYTHONPATH``, measured in the same rounds.

Every round measures each (model, concurrency) on every server, servers in a rotating
order; the table shows medians of requests/s, p50, the server's CPU per request (its
CPU share over requests/s) and the median of the rounds' ratios to the floor.
The floor runs no model: its CPU per request is the HTTP and JSON work alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve as bs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-src", type=Path, help="a tree of this repository to run as a second neuropod serve")
    parser.add_argument("--duration", type=int, default=3, help="seconds measured per cell and round (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="seconds of warm-up before each (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians shown (default 3)")
    parser.add_argument("--concurrency", default="1,8", help="default 1,8")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    os.sched_setaffinity(0, {int(bs.LOAD_CORE)})
    with tempfile.TemporaryDirectory(prefix="bench-serve-json-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        os.environ.setdefault("NEUROPOD_CACHE_DIR", str(tmp / "cache"))
        os.environ.setdefault("NEUROPOD_HOME", str(tmp / "home"))
        models = bs.build_models(tmp)
        names = [bs.MANY, bs.TINY]
        served = [models[n] for n in names]
        bodies = {n: bs.write_bodies(models[n], tmp) for n in names}
        servers = [bs.neuropod_server("neuropod", served, tmp, False)]
        if args.baseline_src is not None:
            src = args.baseline_src.resolve()
            baseline = bs.neuropod_server("neuropod (baseline)", served, tmp, False)
            baseline.env = {"PYTHONPATH": f"{src}/core/src:{src}/serving/src:{src}/plugins/neuropod-onnx/src"}
            servers.append(baseline)
        floor = bs.floor_server(served, tmp, False)
        servers.append(floor)
        for s in servers:
            stack.callback(s.stop)
            s.start()
        for s in servers:
            s.wait_ready()
            for n in names:
                bs.check_rest(s, models[n], bodies[n].json, None)
        results: dict[tuple[str, int, str], list[dict]] = {}
        for r in range(args.repeats):
            for n in names:
                for c in concurrencies:
                    k = r % len(servers)
                    for s in servers[k:] + servers[:k]:
                        res = bs.rest_load(s, models[n], bodies[n].json, None, c, args)
                        results.setdefault((n, c, s.label), []).append(res)
            print(f"round {r + 1}/{args.repeats} done", flush=True)
        for n in names:
            for c in concurrencies:
                print(f"\nREST JSON | model {n} | concurrency {c}")
                print(f"  {'server':<22} {'req/s':>8} {'p50 ms':>7} {'CPU us/req':>10} {'/ floor':>8}")
                base = results[(n, c, floor.label)]
                for s in servers:
                    rs = results[(n, c, s.label)]
                    rps = statistics.median(x["rps"] for x in rs)
                    cpu = statistics.median(x["server_cpu"] / x["rps"] * 1e6 for x in rs)
                    ratio = statistics.median(x["rps"] / b["rps"] for x, b in zip(rs, base))
                    p50 = statistics.median(x["p50_ms"] for x in rs)
                    print(f"  {s.label:<22} {rps:8,.0f} {p50:7.2f} {cpu:10,.0f} {ratio:8.2f}")


if __name__ == "__main__":
    main()
