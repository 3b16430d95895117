"""The Ray Serve deployment against ``neuropod serve`` on one machine (issue 15): requests/s and p50/p99, 1 and 2 replicas.

    python bench/bench_ray.py [--seconds 2] [--rounds 3] [--concurrency 1,8] [--no-floor] [--quick]

Model: the quick start's ``demo_adder`` (``neuropod demo``; ONNX, out = 2 (x + y)),
every request the package's own test inputs (x, y float32 [2, 2]), checked
against its expected outputs on every server before anything is timed.

Servers, on the same machine at once (127.0.0.1, free ports):

* ``neuropod serve PKG --quiet --metrics-port 0`` (REST and gRPC);
* the Ray Serve application of :func:`neuropod_serving.ray.build` on a local
  cluster (``ray.init(num_cpus=2)``): Ray's HTTP and gRPC proxies in front of
  one replica, then (``serve.delete``, redeployed) two. Serve's access log is
  off (``enable_access_log=False``, proxies and replicas), as ``--quiet`` turns
  off neuropod serve's (``--ray-access-log`` keeps Ray's on).

Load, as bench_serve.py does it, pinned to core 1 with taskset (the servers
are not pinned: two replicas need both cores): REST is ``wrk`` posting the
binary tensor extension (serve_wrk.lua), gRPC is serve_grpc_load.py (grpc.aio,
raw_input_contents), closed loop at each concurrency for ``--seconds`` after a
warm-up. Each phase (Ray with 1 replica, then 2) measures ``neuropod serve``
and Ray in ``--rounds`` rounds, the two in a rotating order; a last phase
measures Ray's floor, a deployment with serve_floor.py's handlers and no model
(``--no-floor`` skips it). The tables show medians of rounds; a ratio against
``neuropod serve`` is the median of the rounds' ratios (both measured seconds
apart). ``server CPU`` is the cores the server side used in the window (Ray:
every process of the cluster), ``CPU us/req`` that over requests/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from _common import cpu_model
from bench_serve import (
    HERE,
    LOAD_CORE,
    Bodies,
    Cell,
    CpuSampler,
    Model,
    Server,
    _group_pids,
    _run_load,
    check_grpc,
    check_rest,
    free_port,
    neuropod_server,
    write_bodies,
    wrk,
)

APP = "demo_adder"  # the application, named after its model as `neuropod serve --ray` names them
NP = "neuropod serve"
FLOOR = "Ray Serve floor (no model)"


def ray_label(replicas: int) -> str:
    return f"Ray Serve, {replicas} replica{'s' if replicas > 1 else ''}"


# --- the model ----------------------------------------------------------------


def demo_model(tmp: Path) -> Model:
    """The quick start's package (``neuropod demo --dir``), with its own test inputs and expected outputs."""
    out = subprocess.run([sys.executable, "-m", "neuropod", "demo", "--dir", str(tmp / "demo")],
                         capture_output=True, text=True)  # fmt: skip
    package = tmp / "demo" / f"{APP}.neuropod"
    if out.returncode != 0 or not package.is_dir():
        raise RuntimeError(f"`neuropod demo` failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    with np.load(package / "test_data" / "inputs.npz") as f:
        inputs = {k: f[k] for k in f.files}
    with np.load(package / "test_data" / "expected.npz") as f:
        expected = f["out"]
    onnx = (package / "0" / "data" / "model.onnx").read_bytes()
    return Model(APP, onnx, "out", inputs, expected, package)


# --- servers ------------------------------------------------------------------


@dataclass
class UnpinnedServer(Server):
    """bench_serve's server process, not pinned to core 0: Ray's replicas get both cores, so it does too."""

    def start(self) -> None:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env}, cwd=self.cwd, start_new_session=True,
            )  # fmt: skip


class PidsSampler(CpuSampler):
    """bench_serve's CPU sampler over given processes (Ray's cluster is not one process group)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def ray_pids(exclude: set[int]) -> list[int]:
    """Every process this one started (Ray's GCS, raylet, agents, proxy, controller, replicas), but not
    ``exclude`` and what they started. Called before a load generator starts, so it is not among them."""
    parents = _parents()
    found, frontier = [], [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in exclude:
                found.append(pid)
                frontier.append(pid)
    return found


@dataclass
class Target:
    """Something measured: a server's ports and how to sample its CPU."""

    server: Server
    pids: Callable[[], list[int]]

    def sampler(self) -> CpuSampler:
        return PidsSampler(self.pids())


# --- load ---------------------------------------------------------------------


def rest_cell(t: Target, bodies: Bodies, c: int, args: argparse.Namespace) -> dict[str, Any]:
    url = f"http://127.0.0.1:{t.server.http_port}/v2/models/{APP}/infer"
    wrk(url, bodies.binary, bodies.binary_header, c, args.warmup)
    with t.sampler() as cpu:
        r = wrk(url, bodies.binary, bodies.binary_header, c, args.seconds)
    if sum(r["errors"].values()):
        raise RuntimeError(f"{t.server.label}: failed REST requests under load ({r['errors']})")
    return _result(r, cpu, None)


def grpc_cell(t: Target, bodies: Bodies, c: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "serve_grpc_load.py"), "--target", f"127.0.0.1:{t.server.grpc_port}",
           "--request", str(bodies.grpc), "--concurrency", str(c), "--processes", str(args.grpc_processes),
           "--warmup", str(args.warmup), "--duration", str(args.seconds)]  # fmt: skip
    with t.sampler() as cpu:
        r = _run_load(cmd, "GRPC_RESULT ", args.warmup + args.seconds + 60)
    if r["errors"]["rpc"]:
        raise RuntimeError(f"{t.server.label}: {r['errors']['rpc']} failed gRPC calls under load")
    return _result(r, cpu, r["load_cpu"])


def _result(r: dict[str, Any], cpu: CpuSampler, load_cpu: float | None) -> dict[str, Any]:
    share = cpu.share(*r["window"])
    return {"rps": r["rps"], "p50_ms": r["p50_us"] / 1e3, "p99_ms": r["p99_us"] / 1e3, "server_cpu": share,
            "cpu_us": share / r["rps"] * 1e6 if r["rps"] else float("nan"), "load_cpu": load_cpu}  # fmt: skip


def check(server: Server, model: Model, bodies: Bodies, timeout: float = 60.0) -> None:
    """The server answers REST and gRPC with the package's expected outputs (retried while Ray's proxies
    learn the application's route)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check_rest(server, model, bodies.binary, bodies.binary_header)
            check_grpc(server, model)
            return
        except (RuntimeError, OSError) as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.label} did not answer correctly within {timeout:g} s: {e}") from None
            time.sleep(0.5)


# --- Ray ----------------------------------------------------------------------


def start_ray(http_port: int, grpc_port: int, access_log: bool) -> None:
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from neuropod_serving import ray as neuropod_ray

    # The cluster's processes are this one's children: they inherit its affinity (both cores) and environment.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    if access_log:
        neuropod_ray.start(http_port=http_port, grpc_port=grpc_port)
    else:
        # What neuropod_ray.start() does, plus Serve's global logging config (proxies, controller),
        # which start() does not take.
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port},
            grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[neuropod_ray.GRPC_SERVICER]),
            logging_config=_logging(access_log),
        )


def _logging(access_log: bool) -> dict[str, Any] | None:
    """Serve's logging config: Ray's default, or its access log off."""
    return None if access_log else {"enable_access_log": False}


def deploy(package: Path, replicas: int, access_log: bool) -> list[int]:
    """The package as application APP at / with ``replicas`` replicas; their pids once all run."""
    from ray import serve

    from neuropod_serving import ray as neuropod_ray

    app = neuropod_ray.build(package, num_replicas=replicas)
    serve.run(app, name=APP, route_prefix="/", logging_config=_logging(access_log))
    deployment = serve.status().applications[APP].deployments[neuropod_ray.DEPLOYMENT_NAME]
    running = deployment.replica_states.get("RUNNING", 0)
    if running != replicas:
        raise RuntimeError(f"Ray Serve runs {running} replicas of {APP}, not {replicas}: {deployment.replica_states}")
    handle = serve.get_app_handle(APP)
    pids: set[int] = set()
    for _ in range(40):  # the handle spreads calls over the replicas
        pids.add(handle.info.remote().result()["pid"])
        if len(pids) == replicas:
            break
    return sorted(pids)


class _InferCall:
    """What grpcio hands a generic handler to find ``ModelInfer`` (public grpc API)."""

    method = "/inference.GRPCInferenceService/ModelInfer"
    invocation_metadata = ()


def floor_app() -> Any:
    """Ray's floor: one replica of a deployment with no model behind Ray's proxies, answering as
    serve_floor.py does (its Starlette app for REST; its ModelInfer handler for gRPC)."""
    from ray import serve

    @serve.deployment(name="Floor", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=8)
    @serve.ingress()
    class Floor:
        def __init__(self) -> None:
            from serve_floor import _grpc_handler

            self._infer = _grpc_handler({APP: "out"}, False).service(_InferCall())

        def __serve_build_asgi_app__(self) -> Any:
            from serve_floor import rest_app

            return rest_app({APP: "out"})

        # Named as the RPC; Ray's gRPC proxy passes the request's bytes, and the call's context by this name.
        async def ModelInfer(self, request: bytes, grpc_context: Any) -> Any:
            return self._infer.unary_unary(self._infer.request_deserializer(request), grpc_context)

    return Floor.bind()


def deploy_floor(access_log: bool) -> None:
    from ray import serve

    serve.run(floor_app(), name=APP, route_prefix="/", logging_config=_logging(access_log))


def undeploy() -> None:
    from ray import serve

    serve.delete(APP)


def stop_ray() -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


# --- the run ------------------------------------------------------------------


@dataclass
class Phase:
    """One deployment on the cluster and its measurements."""

    label: str  # its row
    replicas: int
    paired: bool  # neuropod serve measured beside it, round by round


def measure_phase(
    phase: Phase, targets: dict[str, Target], bodies: Bodies, args: argparse.Namespace, cells: dict[tuple, Cell]
) -> None:
    """``args.rounds`` rounds of every (protocol, concurrency), the servers in a rotating order."""
    labels = [NP, phase.label] if phase.paired else [phase.label]
    for r in range(args.rounds):
        for protocol in args.protocols:
            for c in args.concurrency:
                for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                    cell = cells.setdefault((phase.label, protocol, c, label), Cell(protocol, APP, c, label))
                    run = rest_cell if protocol == "rest" else grpc_cell
                    cell.rounds.append(run(targets[label], bodies, c, args))
        print(f"  {phase.label}: round {r + 1}/{args.rounds} done", flush=True)


def report(
    cells: dict[tuple, Cell], phases: list[Phase], args: argparse.Namespace, replica_pids: dict[str, list[int]]
) -> None:
    print()
    print(f"machine: {os.cpu_count()} cores ({cpu_model('unknown CPU')}), {platform.system()} {platform.release()}, "
          f"Python {platform.python_version()}")  # fmt: skip
    print("versions: " + ", ".join(f"{k} {v}" for k, v in _versions().items()))
    print(f"model: {APP} (the quick start's), x and y float32 [2, 2] per request; {args.rounds} rounds x "
          f"{args.seconds} s per cell after {args.warmup} s warm-up; medians of rounds")  # fmt: skip
    print("Ray replica pids: " + "; ".join(f"{k}: {v}" for k, v in replica_pids.items()))
    for protocol in args.protocols:
        title = "REST (wrk, binary tensor extension)" if protocol == "rest" else "gRPC (serve_grpc_load.py, grpc.aio)"
        print(f"\n{title}")
        print(f"  {'server':<28} {'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'server CPU':>10} "
              f"{'CPU us/req':>10}" + (f" {'load CPU':>8}" if protocol == "grpc" else ""))  # fmt: skip
        for c in args.concurrency:
            rows = [_merged(cells, protocol, c)] + [cells[(p.label, protocol, c, p.label)] for p in phases]
            for x in rows:
                load = f" {x.median('load_cpu'):8.0%}" if protocol == "grpc" else ""
                print(f"  {x.server:<28} {c:>4} {x.median('rps'):9,.0f} {x.median('p50_ms'):8.2f} "
                      f"{x.median('p99_ms'):8.2f} {x.median('server_cpu'):10.0%} {x.median('cpu_us'):10.0f}{load}")  # fmt: skip

    paired = [p for p in phases if p.paired]
    by_replicas = {p.replicas: p for p in paired}
    floor = next((p for p in phases if not p.paired), None)
    print("\nRatios (req/s: above 1 is more; p99: above 1 is slower)")
    head = f"  {'protocol':<8} {'conc':>4}"
    for p in paired:
        head += f" {f'Ray {p.replicas}r / np req/s':>18} {f'Ray {p.replicas}r / np p99':>16}"
    if {1, 2} <= set(by_replicas):
        head += f" {'Ray 2r / 1r req/s':>17} {'np drift':>9}"
    if floor is not None and 1 in by_replicas:
        head += f" {'Ray 1r / floor':>14}"
    print(head)
    for protocol in args.protocols:
        for c in args.concurrency:
            line = f"  {protocol:<8} {c:>4}"
            get = functools.partial(_cell, cells, protocol, c)
            for p in paired:
                ray_cell, np_cell = get(p, p.label), get(p, NP)
                p99 = statistics.median(a["p99_ms"] / b["p99_ms"] for a, b in zip(ray_cell.rounds, np_cell.rounds))
                line += f" {ray_cell.over(np_cell):17.3f}x {p99:15.2f}x"
            if {1, 2} <= set(by_replicas):
                one, two = by_replicas[1], by_replicas[2]
                gain = get(two, two.label).median("rps") / get(one, one.label).median("rps")
                drift = get(two, NP).median("rps") / get(one, NP).median("rps")
                line += f" {gain:16.2f}x {drift:8.2f}x"
            if floor is not None and 1 in by_replicas:
                one = by_replicas[1]
                line += f" {get(one, one.label).median('rps') / get(floor, floor.label).median('rps'):13.2f}x"
            print(line)
    cores = os.cpu_count() or 0
    notes = [
        f"{cores} cores in all. The load generator is pinned to core {LOAD_CORE}; the servers are not."
        + (" With 2 replicas, the two replicas, Ray's proxy (and controller, raylet, GCS) and the load generator "
           "share these 2 cores, so the 2-replica rows show contention, not what a second core or machine would add."
           if cores <= 2 else ""),
        "A Ray request takes one more hop than a neuropod serve one: client -> Ray's proxy (HTTP or gRPC) -> "
        "replica (the same Engine, REST app and gRPC servicer as neuropod serve), each its own process.",
        f"Serve's access log: {'on (Ray default)' if args.ray_access_log else 'off, as with neuropod serve --quiet'}.",
        "Ratios to neuropod serve are medians of per-round ratios (measured seconds apart); ratios between phases "
        "are ratios of medians from phases minutes apart. 'np drift' is neuropod serve's req/s in the 2-replica "
        "phase over the 1-replica phase (how much the machine moved between them).",
    ]  # fmt: skip
    if floor is not None:
        notes.insert(2, f"'{FLOOR}': a Ray Serve deployment with serve_floor.py's handlers (parse the request, "
                        "answer the first input's bytes, no model): what Ray's proxy and replica cost on their own.")  # fmt: skip
    print("\nNotes:")
    for note in notes:
        print(textwrap.fill(note, 110, initial_indent="  * ", subsequent_indent="    "))


def _cell(cells: dict[tuple, Cell], protocol: str, c: int, phase: Phase, label: str) -> Cell:
    return cells[(phase.label, protocol, c, label)]


def _merged(cells: dict[tuple, Cell], protocol: str, c: int) -> Cell:
    """neuropod serve's rounds from every phase, as one row."""
    merged = Cell(protocol, APP, c, NP)
    for key, cell in cells.items():
        if key[1:] == (protocol, c, NP):
            merged.rounds += cell.rounds
    return merged


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("ray", "onnxruntime", "neuropod", "neuropod-serving", "grpcio", "uvicorn"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=2, help="seconds measured per cell and round (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="seconds of warm-up before each measurement (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per phase; tables show medians (default 3)")
    parser.add_argument("--concurrency", default="1,8", help="requests in flight, comma-separated (default 1,8)")
    parser.add_argument("--protocols", default="rest,grpc", help="rest, grpc or both (default)")
    parser.add_argument("--replicas", default="1,2", help="Ray replica counts, a phase each (default 1,2)")
    parser.add_argument("--no-floor", action="store_true", help="skip Ray's floor (a deployment with no model)")
    parser.add_argument("--grpc-processes", type=int, default=2, help="gRPC load processes (default 2)")
    parser.add_argument("--ray-access-log", action="store_true", help="keep Ray Serve's access log on (its default)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 1 s per cell")
    parser.add_argument("--json", type=Path, help="write every round's figures here as JSON")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.warmup, args.rounds = 1, 1, 1
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.protocols = [p.strip() for p in args.protocols.split(",")]
    args.replicas = [int(n) for n in args.replicas.split(",")]
    if not set(args.protocols) <= {"rest", "grpc"}:
        raise SystemExit(f"bench_ray: --protocols takes rest and/or grpc, not {','.join(args.protocols)}")
    if "rest" in args.protocols and shutil.which("wrk") is None:
        raise SystemExit("bench_ray: wrk is not installed (Debian: apt-get install wrk)")
    if shutil.which("taskset") is None:
        raise SystemExit("bench_ray: taskset is not installed (Debian: util-linux)")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench_ray: needs two CPU cores (the load generator runs on core 1)")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise SystemExit("bench_ray: Ray is not installed: pip install 'neuropod-serving[ray]'") from None
    phases = [Phase(ray_label(n), n, True) for n in args.replicas]
    if not args.no_floor:
        phases.append(Phase(FLOOR, 1, False))

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers as Ctrl-C does
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp_name:
        tmp = Path(tmp_name)
        # Before ray.init: Ray's workers inherit the environment (caches, and bench/ for the floor's imports).
        os.environ.setdefault("NEUROPOD_CACHE_DIR", str(tmp / "cache"))
        os.environ.setdefault("NEUROPOD_HOME", str(tmp / "home"))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        model = demo_model(tmp)
        bodies = write_bodies(model, tmp)
        base = neuropod_server(NP, [model], tmp, grpc=True)
        np_server = UnpinnedServer(**{f.name: getattr(base, f.name) for f in fields(base)})
        cells: dict[tuple, Cell] = {}
        replica_pids: dict[str, list[int]] = {}
        try:
            np_server.start()
            http_port, grpc_port = free_port(), free_port()
            start_ray(http_port, grpc_port, args.ray_access_log)
            np_server.wait_ready()
            check(np_server, model, bodies)
            assert np_server.proc is not None
            np_pid = np_server.proc.pid
            np_target = Target(np_server, lambda: _group_pids(np_pid))
            print(f"started in {time.monotonic() - started:.0f} s; measuring", flush=True)
            for phase in phases:
                t0 = time.monotonic()
                if phase.paired:
                    replica_pids[phase.label] = deploy(model.package, phase.replicas, args.ray_access_log)  # type: ignore[arg-type]
                else:
                    deploy_floor(args.ray_access_log)
                kind = "ray" if phase.paired else "floor"  # a floor answers the first input (bench_serve's check)
                ray_server = Server(phase.label, kind, (APP,), http_port, grpc_port, [], tmp / "ray.log")
                check(ray_server, model, bodies)
                print(f"  {phase.label} deployed in {time.monotonic() - t0:.1f} s", flush=True)
                ray_target = Target(ray_server, lambda: ray_pids(exclude={np_pid}))
                measure_phase(phase, {NP: np_target, phase.label: ray_target}, bodies, args, cells)
                undeploy()
        finally:
            np_server.stop()
            stop_ray()
        report(cells, phases, args, replica_pids)
        if args.json:
            data = [{"phase": k[0], "protocol": k[1], "concurrency": k[2], "server": k[3], "rounds": v.rounds}
                    for k, v in cells.items()]  # fmt: skip
            args.json.write_text(json.dumps({"versions": _versions(), "cpus": os.cpu_count(), "cells": data}, indent=1))
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench_ray: interrupted; every server was stopped", file=sys.stderr)
        sys.exit(130)
    except RuntimeError as e:  # a server failed to start, answered wrongly or failed under load
        print(f"bench_ray: {e}", file=sys.stderr)
        sys.exit(2)
