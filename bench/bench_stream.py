"""Streams from ``neuropod serve`` against a bare gRPC stream and a bare SSE endpoint, in one run.

    python bench/bench_stream.py [--responses 1000] [--rounds 9] [--streams 3] [--calls 600]
        [--open-streams 100] [--fast-streams 10] [--json out.json] [--quick] [--strict]

Servers, each a process of its own pinned to CPU core 0 (taskset); this process,
every client, pinned to core 1:

* ``neuropod serve`` (``--quiet``) with two Python-backend packages: ``stream``,
  decoupled, inputs ``COUNT`` int32 [1] and ``DELAY`` uint32 [1], which yields
  COUNT responses as fast as it can (``OUT`` int32 [1] and ``IDX`` uint32 [1],
  both the response's index), DELAY microseconds apart; and ``unary``, the same
  inputs and outputs, an ordinary model answering once (its first response);
* the floors (stream_floor.py): grpcio's threaded server answering
  ModelStreamInfer with the same responses as ModelStreamInferResponse messages
  (built from numpy arrays, serialized), and a Starlette route on uvicorn
  writing them as ``data: {json}`` Server-Sent Events (orjson). No model, no
  checks: what a server cannot do with less. A second gRPC floor runs at
  ``neuropod serve``'s base GIL switch interval (``launcher.GIL_SWITCH_S``,
  0.1 ms against Python's 5 ms; neuropod serve raises it to 2 ms while a
  decoupled model's gRPC stream sends), to show what that interval costs a
  grpcio stream per response.

Clients (stream_clients.py), the same for a floor and for neuropod serve: a bare
grpcio stub (bytes in and out, the end found by ``triton_final_response`` in
the bytes: requests ask for an empty final response) and a raw socket
(HTTP/1.1 keep-alive, events counted by their ``data:`` lines).

Measured:

1. Per-response cost: streams of ``--responses`` responses, one at a time; each
   round runs ``--streams`` streams on every server in a rotating order. The
   figure is a stream's time over its responses, the median over the rounds;
   the ratio is the median of the rounds' ratios to the floor of the same
   protocol. Beside it, the server's CPU time per response (its process group,
   from /proc, over all rounds) and the client's, so a client that cannot keep
   up would show.
   Target: neuropod <= 1.3 x the floor, over gRPC and over SSE.
2. Time to the first response of ``stream`` with COUNT 1 (it yields at once)
   against the latency of one unary call to ``unary`` (ModelInfer over gRPC,
   POST /infer over REST), the two alternating call by call, ``--calls`` pairs,
   medians. Over gRPC the requests go on one long-lived ModelStreamInfer call,
   as tritonclient's start_stream uses it; a row opening a new call per
   request shows what that costs. Target: <= 1.2 x the unary latency.
3. Memory: the resident memory (RSS, the process group) of each server idle,
   then with ``--open-streams`` streams open whose clients read nothing (the
   model yields one response every 100 ms), then after they are closed; per
   stream, and the server's threads.
4. Backpressure: ``--fast-streams`` unread streams of a model yielding as fast
   as it can: the server's RSS and CPU share once the buffers on the way have
   filled (a model held back by its reader waits: no CPU, no memory growth),
   and the client's own RSS growth (a grpcio client that does not read still
   receives into its own memory).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import _common
from _servers import free_port, log_tail, stop_group, wait_ready
from neuropod_serving.server.launcher import GIL_SWITCH_S
from stream_clients import GrpcClient, HttpClient, Timed, grpc_request, grpc_responses, rest_body, sse_responses

HERE = Path(__file__).resolve().parent
SERVER_CORE, CLIENT_CORE = 0, 1
STREAM, UNARY = "stream", "unary"
SSE_PATH = "/v2/models/{}/infer_stream"
INFER_PATH = "/v2/models/{}/infer"
PER_RESPONSE_TARGET = 1.3
FIRST_RESPONSE_TARGET = 1.2
#: Microseconds between the responses of an open, unread stream (the memory measurement).
SLOW_DELAY_US = 100_000
FLOOR, NEUROPOD = "floor", "neuropod serve"
#: The second gRPC floor: the same server at neuropod serve's GIL switch interval.
FLOOR_GIL = f"floor, GIL switch {GIL_SWITCH_S * 1e6:g} us"
PROTOCOLS = {"grpc": "gRPC ModelStreamInfer", "sse": "SSE infer_stream"}

MODEL_CODE = """
import time

import numpy as np


def get_model(data_root):
    def stream(COUNT, DELAY):
        delay = int(DELAY[0]) / 1e6
        for i in range(int(COUNT[0])):
            if delay:
                time.sleep(delay)
            yield {"OUT": np.array([i], np.int32), "IDX": np.array([i], np.uint32)}

    return stream


def get_unary(data_root):
    def unary(COUNT, DELAY):
        return {"OUT": np.array([0], np.int32), "IDX": np.array([0], np.uint32)}

    return unary
"""


# --- models and servers ---------------------------------------------------------


def build_packages(tmp: Path) -> list[Path]:
    """The decoupled ``stream`` package and its ordinary twin ``unary``."""
    from neuropod_python.packager import create_python_neuropod

    code = tmp / "code"
    (code / "streambench").mkdir(parents=True)
    (code / "streambench" / "__init__.py").write_text(MODEL_CODE)
    inputs = [{"name": "COUNT", "dtype": "int32", "shape": [1]}, {"name": "DELAY", "dtype": "uint32", "shape": [1]}]
    outputs = [{"name": "OUT", "dtype": "int32", "shape": [1]}, {"name": "IDX", "dtype": "uint32", "shape": [1]}]
    spec = [{"python_root": str(code), "dirs_to_package": ["streambench"]}]
    return [
        create_python_neuropod(
            tmp / STREAM, STREAM, [], spec, "streambench", "get_model", inputs, outputs, decoupled=True
        ),
        create_python_neuropod(tmp / UNARY, UNARY, [], spec, "streambench", "get_unary", inputs, outputs),
    ]


@dataclass
class Server:
    """One server process in a process group of its own, on ``cores`` (taskset)."""

    label: str
    http_port: int
    grpc_port: int
    command: list[str]
    log: Path
    models: tuple[str, ...] = ()
    cores: str = str(SERVER_CORE)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        pinned = ["taskset", "-c", self.cores] if shutil.which("taskset") else []
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([*pinned, *self.command], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Its REST health and models' readiness, or for a gRPC-only server a ServerReady call."""
        assert self.proc is not None
        if self.http_port:
            urls = [f"http://127.0.0.1:{self.http_port}/v2/health/ready"]
            urls += [f"http://127.0.0.1:{self.http_port}/v2/models/{m}/ready" for m in self.models]
            wait_ready(self.proc, self.label, self.log, urls, timeout)
        else:
            wait_ready(self.proc, self.label, self.log, (), timeout, ready=lambda: grpc_ready(self.grpc_port))

    def tail(self, lines: int = 30) -> str:
        return log_tail(self.log, lines)

    def pids(self) -> list[int]:
        """The processes of its group."""
        assert self.proc is not None
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[2]) == self.proc.pid:
                            found.append(int(entry))
                except (OSError, IndexError, ValueError):
                    pass
        return found

    def stop(self) -> None:
        """SIGINT to the group (a clean shutdown), SIGKILL after 10 s."""
        if self.proc is not None:
            stop_group(self.proc)
        self.proc = None


def grpc_ready(port: int) -> bool:
    import grpc  # lazy: as in stream_clients

    from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        ready = channel.unary_unary("/inference.GRPCInferenceService/ServerReady",
                                    request_serializer=pb.ServerReadyRequest.SerializeToString,
                                    response_deserializer=pb.ServerReadyResponse.FromString)  # fmt: skip
        try:
            return bool(ready(pb.ServerReadyRequest(), timeout=2).ready)
        except grpc.RpcError:
            return False


def neuropod_server(packages: list[Path], tmp: Path, open_streams: int) -> Server:
    http, grpc = free_port(), free_port()
    cmd = [sys.executable, "-m", "neuropod", "serve", *map(str, packages), "--quiet", "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", "0", "--max-grpc-streams", str(open_streams + 16)]  # fmt: skip
    return Server(NEUROPOD, http, grpc, cmd, tmp / "neuropod.log", (STREAM, UNARY))


def floor_servers(tmp: Path) -> dict[str, Server]:
    """The floors by protocol; "grpc_gil" is the gRPC floor at neuropod serve's GIL switch interval."""
    grpc, grpc_gil, http = free_port(), free_port(), free_port()
    floor = [sys.executable, str(HERE / "stream_floor.py")]
    gil = ["--gil-switch-us", f"{GIL_SWITCH_S * 1e6:g}"]
    return {
        "grpc": Server(f"{FLOOR} (grpcio)", 0, grpc, [*floor, "--grpc-port", str(grpc)], tmp / "floor-grpc.log"),
        "grpc_gil": Server(FLOOR_GIL, 0, grpc_gil, [*floor, "--grpc-port", str(grpc_gil), *gil], tmp / "floor-gil.log"),
        "sse": Server(f"{FLOOR} (Starlette)", http, 0, [*floor, "--http-port", str(http)], tmp / "floor-sse.log"),
    }


def group_cpu(server: Server) -> float:
    """CPU seconds (user + system) used so far by the server's process group."""
    assert server.proc is not None
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for pid in server.pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def group_memory(server: Server) -> tuple[int, int]:
    """The server's process group now: resident bytes (VmRSS summed) and threads."""
    assert server.proc is not None
    rss = threads = 0
    for pid in server.pids():
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Threads:"):
                        threads += int(line.split()[1])
        except OSError:
            pass
    return rss, threads


# --- checks -------------------------------------------------------------------


def check_grpc(server: Server, model: str, count: int = 4) -> str | None:
    """Read one stream whole and check it; None when right, else why (the rows are skipped)."""
    try:
        answers = grpc_responses(server.grpc_port, grpc_request(model, count))
    except Exception as e:  # noqa: BLE001 - reported, the rows skipped
        return f"{server.label}: ModelStreamInfer failed: {type(e).__name__}: {e}"[:400]
    got = []
    for a in answers[:-1]:
        raw = dict(zip((o.name for o in a.outputs), a.raw_output_contents))
        got.append((int(np.frombuffer(raw["OUT"], np.int32)[0]), int(np.frombuffer(raw["IDX"], np.uint32)[0])))
    expected = [(i, i) for i in range(count)]
    if got != expected or not answers or answers[-1].outputs:
        return f"{server.label}: ModelStreamInfer answered {got} then {answers[-1] if answers else 'nothing'}, expected {expected} then an empty final response"
    return None


def check_sse(server: Server, model: str, count: int = 4) -> str | None:
    try:
        events = sse_responses(server.http_port, SSE_PATH.format(model), rest_body(count))
    except Exception as e:  # noqa: BLE001 - reported, the rows skipped
        return f"{server.label}: POST {SSE_PATH.format(model)} failed: {type(e).__name__}: {e}"[:400]
    got = [tuple(int(o["data"][0]) for o in sorted(e["outputs"], key=lambda o: o["name"] != "OUT")) for e in events]
    if got != [(i, i) for i in range(count)]:
        return f"{server.label}: SSE events {got}, expected {[(i, i) for i in range(count)]}"
    return None


# --- 1. per-response cost --------------------------------------------------------


@dataclass
class Cell:
    """One (protocol, server) of the per-response measurement: per round, seconds per response."""

    protocol: str
    who: str
    server: Server
    run: Callable[[], Timed]
    wall: list[float] = field(default_factory=list)
    #: CPU seconds of the server's process group and of this process over every round, and the responses.
    cpu: float = 0.0
    client_cpu: float = 0.0
    responses: int = 0


def measure_round(cell: Cell, streams: int, responses: int) -> None:
    walls = []
    cpu0, me0 = group_cpu(cell.server), time.process_time()
    for _ in range(streams):
        t = cell.run()
        if t.responses != responses:
            raise RuntimeError(f"{cell.who} {cell.protocol}: a stream gave {t.responses} responses, not {responses}")
        walls.append(t.total / responses)
    cell.cpu += group_cpu(cell.server) - cpu0
    cell.client_cpu += time.process_time() - me0
    cell.responses += streams * responses
    cell.wall.append(statistics.median(walls))


def per_response(cells: list[Cell], rounds: int, streams: int, responses: int) -> None:
    for cell in cells:  # warm-up
        for _ in range(2):
            cell.run()
    for r in range(rounds):
        k = r % len(cells)
        for cell in cells[k:] + cells[:k]:
            measure_round(cell, streams, responses)


def _ratios(cell: Cell, floor: Cell) -> tuple[float, float]:
    """``cell`` over ``floor``: the median of the rounds' wall ratios, and the ratio of CPU per response."""
    wall = statistics.median(a / b for a, b in zip(cell.wall, floor.wall))
    return wall, (cell.cpu / cell.responses) / (floor.cpu / floor.responses)


def report_per_response(cells: list[Cell], responses: int) -> None:
    print(f"\n1. Per-response cost, streams of {responses} responses, us per response "
          "(wall: median over rounds; CPU: over all rounds)")  # fmt: skip
    print(f"   {'':<48} {'wall':>8} {'server CPU':>11} {'client CPU':>11} {'x floor':>8}  (CPU)")
    for protocol, title in PROTOCOLS.items():
        floor = next((c for c in cells if c.protocol == protocol and c.who == FLOOR), None)
        gil = next((c for c in cells if c.protocol == protocol and c.who == FLOOR_GIL), None)
        for cell in (c for c in cells if c.protocol == protocol):
            wall = statistics.median(cell.wall) * 1e6
            cpu, client = cell.cpu / cell.responses * 1e6, cell.client_cpu / cell.responses * 1e6
            ratio = cpu_ratio = None
            shown = ""
            if floor is not None and cell is not floor:
                ratio, cpu_ratio = _ratios(cell, floor)
                shown = f"{ratio:8.2f}  ({cpu_ratio:.2f})"
            print(f"   {title + ', ' + cell.who:<48} {wall:8.2f} {cpu:11.2f} {client:11.2f} {shown}")
            kind = {FLOOR: "floor", FLOOR_GIL: "floor_gil"}.get(cell.who, "neuropod")
            key = f"stream.{protocol}.{kind}"
            _common.record(f"{title}, {cell.who}: seconds per response", key, wall=wall / 1e6, server_cpu=cpu / 1e6,
                           client_cpu=client / 1e6, ratio=ratio, cpu_ratio=cpu_ratio, responses=responses,
                           method=f"median over {len(cell.wall)} rounds of the median stream")  # fmt: skip
            if cell.who != NEUROPOD or ratio is None or floor is None:
                continue
            _common.verdict(f"{title}: per response <= {PER_RESPONSE_TARGET} x the floor", ratio <= PER_RESPONSE_TARGET,
                            f"{ratio:.2f} x ({wall:.2f} us against the floor's {statistics.median(floor.wall) * 1e6:.2f} us; "
                            f"server CPU {cpu_ratio:.2f} x)", key=f"{key}.ratio")  # fmt: skip
            if gil is not None:
                same, same_cpu = _ratios(cell, gil)
                print(f"   {'':<48} {'':>8} {'':>11} {'':>11} {same:8.2f}  ({same_cpu:.2f}) x the {FLOOR_GIL}")
                _common.record(f"{title}, {NEUROPOD} against the {FLOOR_GIL}", f"{key}.against_floor_gil",
                               ratio=same, cpu_ratio=same_cpu)  # fmt: skip


# --- 2. time to the first response ------------------------------------------------


def first_response(label: str, stream: Callable[[], Timed], unary: Callable[[], float], calls: int, key: str,
                   target: bool) -> None:  # fmt: skip
    for _ in range(min(calls, 100)):
        stream()
        unary()
    firsts, unaries = [], []
    for i in range(calls):
        if i % 2:
            unaries.append(unary())
            firsts.append(stream().first)
        else:
            firsts.append(stream().first)
            unaries.append(unary())
    first, one = statistics.median(firsts), statistics.median(unaries)
    ratio = first / one
    print(f"   {label:<58} first {first * 1e6:8.1f} us   unary {one * 1e6:8.1f} us   ratio {ratio:5.2f}")
    _common.record(label, key, first=first, unary=one, ratio=ratio, method=f"medians of {calls} alternating pairs")
    if target:
        _common.verdict(f"{label}: first response <= {FIRST_RESPONSE_TARGET} x a unary call", ratio <= FIRST_RESPONSE_TARGET,
                        f"{ratio:.2f} x ({first * 1e6:.0f} us against {one * 1e6:.0f} us)", key=f"{key}.ratio")  # fmt: skip


# --- 3. memory of open streams -------------------------------------------------------


def unread(server: Server, protocol: str, model: str, count: int, delay_us: int) -> Callable[[], None]:
    """Open ``count`` streams of 10**7 responses, ``delay_us`` apart, whose client reads nothing; what closes them."""
    if protocol == "grpc":
        client = GrpcClient(server.grpc_port)
        request = grpc_request(model, 10**7, delay_us)
        calls = [client.stream(iter((request,)), timeout=600) for _ in range(count)]

        def close() -> None:
            for call in calls:
                call.cancel()
            client.close()

        return close
    body = rest_body(10**7, delay_us)
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", server.http_port))
        sock.sendall((f"POST {SSE_PATH.format(model)} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)  # fmt: skip
        sockets.append(sock)

    def close_sockets() -> None:
        for sock in sockets:
            sock.close()

    return close_sockets


def open_streams(server: Server, protocol: str, model: str, count: int, settle: float) -> dict[str, float]:
    """RSS idle, with ``count`` unread slow streams open, and after they are closed."""
    idle, idle_threads = group_memory(server)
    close = unread(server, protocol, model, count, SLOW_DELAY_US)
    time.sleep(settle)
    busy, busy_threads = group_memory(server)
    close()
    time.sleep(settle)
    after, after_threads = group_memory(server)
    return {"idle": idle, "open": busy, "after": after, "per_stream": (busy - idle) / count, "threads_idle": idle_threads,
            "threads_open": busy_threads, "threads_after": after_threads}  # fmt: skip


def _own_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def backpressure(server: Server, protocol: str, model: str, count: int, wait: float) -> dict[str, float]:
    """``count`` unread streams of a model yielding as fast as it can: the server's RSS before, after
    ``wait`` seconds (the buffers on the way filled) and ``wait`` seconds later, its CPU share over
    those last seconds (0 when the model waits), and what the client's own memory grew meanwhile."""
    before = group_memory(server)[0]
    close = unread(server, protocol, model, count, 0)
    time.sleep(wait)
    filled, cpu, own = group_memory(server)[0], group_cpu(server), _own_rss()
    time.sleep(wait)
    later, cpu_share, own_growth = group_memory(server)[0], (group_cpu(server) - cpu) / wait, _own_rss() - own
    close()
    time.sleep(1.0)
    return {"before": before, "filled": filled, "later": later, "cpu_share": cpu_share, "client_growth": own_growth}


def report_backpressure(rows: list[tuple[str, str, dict[str, float]]], count: int, wait: float) -> None:
    mb = 1 << 20
    print(f"\n4. Backpressure: {count} unread streams of a model yielding as fast as it can; server RSS before, "
          f"after {wait:g} s and {wait:g} s later, its CPU share over those last seconds, the client's RSS growth then")  # fmt: skip
    print(f"   {'':<40} {'before':>8} {'filled':>8} {'later':>8} {'CPU share':>10} {'client +MiB':>12}")
    for protocol, who, m in rows:
        print(f"   {PROTOCOLS[protocol] + ', ' + who:<40} {m['before'] / mb:8.1f} {m['filled'] / mb:8.1f} "
              f"{m['later'] / mb:8.1f} {m['cpu_share']:10.2f} {m['client_growth'] / mb:12.1f}")  # fmt: skip
        _common.record(f"{PROTOCOLS[protocol]}, {who}: {count} unread streams of a fast model",
                       f"stream.backpressure.{protocol}.{'floor' if who == FLOOR else 'neuropod'}", streams=count, **m)  # fmt: skip


def report_memory(rows: list[tuple[str, str, dict[str, float]]], count: int) -> None:
    mb = 1 << 20
    print(
        f"\n3. Memory: {count} open streams whose clients read nothing (one response every {SLOW_DELAY_US // 1000} ms)"
    )
    print(f"   {'':<40} {'idle MiB':>9} {'open MiB':>9} {'KiB/stream':>11} {'closed MiB':>11} {'threads':>16}")
    for protocol, who, m in rows:
        print(f"   {PROTOCOLS[protocol] + ', ' + who:<40} {m['idle'] / mb:9.1f} {m['open'] / mb:9.1f} "
              f"{m['per_stream'] / 1024:11.1f} {m['after'] / mb:11.1f} "
              f"{m['threads_idle']:>4.0f} > {m['threads_open']:>4.0f} > {m['threads_after']:>4.0f}")  # fmt: skip
        _common.record(f"{PROTOCOLS[protocol]}, {who}: memory of {count} open streams",
                       f"stream.memory.{protocol}.{'floor' if who == FLOOR else 'neuropod'}", streams=count, **m)  # fmt: skip


# --- main -------------------------------------------------------------------------


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("neuropod-serving", "grpcio", "starlette", "uvicorn", "protobuf")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=1000, help="responses per stream (default 1000)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of the per-response measurement (default 9)")
    parser.add_argument("--streams", type=int, default=3, help="streams per server and round (default 3)")
    parser.add_argument("--calls", type=int, default=600, help="pairs of calls for the first response (default 600)")
    parser.add_argument("--open-streams", type=int, default=100, help="open streams for the memory (default 100)")
    parser.add_argument("--fast-streams", type=int, default=10, help="unread streams of a fast model (default 10)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 3 rounds of 2 streams, 100 pairs, 20 open streams"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed or a side was skipped")
    _common.add_json_option(parser)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.streams, args.calls, args.open_streams = 3, 2, 100, 20
    pinned = shutil.which("taskset") is not None and len(os.sched_getaffinity(0)) >= 2
    if pinned:
        os.sched_setaffinity(0, {CLIENT_CORE})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    skipped: list[str] = []

    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        os.environ.setdefault("NEUROPOD_CACHE_DIR", str(tmp / "cache"))
        os.environ.setdefault("NEUROPOD_HOME", str(tmp / "home"))
        ours = neuropod_server(build_packages(tmp), tmp, args.open_streams)
        floors = floor_servers(tmp)
        servers = [ours, *floors.values()]
        for s in servers:
            stack.callback(s.stop)
            if not pinned:
                s.cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
            s.start()
        for s in servers:
            s.wait_ready()
        load = os.getloadavg()
        print(f"servers {'on core 0, clients on core 1 (taskset)' if pinned else 'NOT pinned (no taskset or one core)'}; "
              f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")  # fmt: skip

        for reason in (
            check_grpc(floors["grpc"], STREAM),
            check_grpc(floors["grpc_gil"], STREAM),
            check_sse(floors["sse"], STREAM),
        ):
            if reason:
                raise RuntimeError(f"the floor answered wrongly: {reason}")
        reasons = {"grpc": check_grpc(ours, STREAM), "sse": check_sse(ours, STREAM)}
        ready = {protocol: reason is None for protocol, reason in reasons.items()}
        for protocol, reason in reasons.items():
            if reason:
                skipped.append(f"{PROTOCOLS[protocol]}, neuropod serve: skipped: {reason}")
                print(skipped[-1])

        grpc_servers = ((FLOOR, floors["grpc"]), (FLOOR_GIL, floors["grpc_gil"]), (NEUROPOD, ours))
        grpc_clients = {who: GrpcClient(s.grpc_port) for who, s in grpc_servers}
        http_clients = {who: HttpClient(s.http_port) for who, s in ((FLOOR, floors["sse"]), (NEUROPOD, ours))}
        for c in (*grpc_clients.values(), *http_clients.values()):
            stack.callback(c.close)
        many_grpc = grpc_request(STREAM, args.responses)
        many_rest = rest_body(args.responses)
        cells = []
        for who, server in grpc_servers:
            if who != NEUROPOD or ready["grpc"]:
                cells.append(Cell("grpc", who, server, lambda c=grpc_clients[who]: c.one_stream(many_grpc)))
        for who, server in ((FLOOR, floors["sse"]), (NEUROPOD, ours)):
            if who == FLOOR or ready["sse"]:
                cells.append(
                    Cell("sse", who, server, lambda c=http_clients[who]: c.sse(SSE_PATH.format(STREAM), many_rest))
                )
        per_response(cells, args.rounds, args.streams, args.responses)
        report_per_response(cells, args.responses)

        print(
            "\n2. Time to the first response (COUNT 1: the model yields at once) against a unary call of the same shape"
        )
        one_grpc, one_rest = grpc_request(STREAM, 1), rest_body(1)
        unary_grpc, unary_rest = grpc_request(UNARY, 1), rest_body(1)
        g, h = grpc_clients[NEUROPOD], http_clients[NEUROPOD]
        if ready["grpc"]:
            first_response("gRPC: stream on an open ModelStreamInfer vs ModelInfer", lambda: g.on_open_stream(one_grpc),
                           lambda: g.infer(unary_grpc), args.calls, "stream.first.grpc", True)  # fmt: skip
            first_response("gRPC: a new ModelStreamInfer call each vs ModelInfer", lambda: g.one_stream(one_grpc),
                           lambda: g.infer(unary_grpc), args.calls, "stream.first.grpc_new_call", False)  # fmt: skip
        if ready["sse"]:
            first_response("REST: SSE infer_stream vs POST infer", lambda: h.sse(SSE_PATH.format(STREAM), one_rest),
                           lambda: h.post(INFER_PATH.format(UNARY), unary_rest)[0], args.calls, "stream.first.sse", True)  # fmt: skip
        fg, fh = grpc_clients[FLOOR], http_clients[FLOOR]
        print(f"   floors, first response (no unary call to compare):"
              f" gRPC open call {statistics.median(fg.on_open_stream(one_grpc).first for _ in range(args.calls // 2)) * 1e6:.1f} us,"
              f" new call {statistics.median(fg.one_stream(one_grpc).first for _ in range(args.calls // 2)) * 1e6:.1f} us,"
              f" SSE {statistics.median(fh.sse(SSE_PATH.format(STREAM), one_rest).first for _ in range(args.calls // 2)) * 1e6:.1f} us")  # fmt: skip

        memory = []
        for protocol in PROTOCOLS:
            for who, server in ((FLOOR, floors[protocol]), (NEUROPOD, ours)):
                if who == FLOOR or ready[protocol]:
                    memory.append((protocol, who, open_streams(server, protocol, STREAM, args.open_streams, 2.0)))
        report_memory(memory, args.open_streams)
        pressed = []
        for protocol in PROTOCOLS:
            for who, server in ((FLOOR, floors[protocol]), (NEUROPOD, ours)):
                if who == FLOOR or ready[protocol]:
                    pressed.append((protocol, who, backpressure(server, protocol, STREAM, args.fast_streams, 3.0)))
        report_backpressure(pressed, args.fast_streams, 3.0)
        load = os.getloadavg()
        print(f"\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        for line in skipped:
            print(line)
        _common.write_json(args.json, "stream", versions(), skipped=skipped, pinned=pinned)
        missed = any(not t["met"] for t in _common.TARGETS)
        return 1 if args.strict and (missed or skipped) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench_stream: interrupted; every server was stopped", file=sys.stderr)
        sys.exit(130)
    except RuntimeError as e:  # a server failed to start or answered wrongly
        print(f"bench_stream: {e}", file=sys.stderr)
        sys.exit(2)
