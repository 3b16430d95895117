"""neuropod serve against MLServer, LitServe and a bare floor, side by side in one run.

    python bench/bench_serve.py --mlserver-venv VENV [--litserve-venv VENV] [--duration 2] [--repeats 3]
        [--processes 1,2] [--json out.json] [--baseline-python OTHER_VENV/bin/python [--baseline-only]]

With ``--baseline-python``, ``neuropod serve`` from that interpreter (another
release, e.g. the previous commit installed in a venv of its own) joins the
neuropod cells (binary, JSON, gRPC, batched, MLP), and a last table gives each
cell's requests/s against it. ``--baseline-only`` measures those pairs alone
(no floor, MLServer or second batching delay), about half the time a round.

Servers (all on 127.0.0.1, free ports, pinned to CPU core 0 with taskset):

* ``neuropod serve`` (``--quiet``: no access log) with all three models;
* the same with dynamic batching (``--max-batch-size 32``, ``--max-queue-delay-us``
  0 and ``--batch-delay-us``), tiny and MLP models;
* MLServer 1.7 from its own venv (``--mlserver-venv``, with mlserver, onnxruntime
  and ``uvloop<0.22``) running our onnxruntime runtime (serve_mlserver_onnx.py),
  once with ``parallel_workers: 0`` and once with its default (one worker
  process); ``debug: false``, so no access log either;
* LitServe from its own venv (``--litserve-venv``, with litserve and onnxruntime)
  running serve_litserve_onnx.py: its defaults (an inference worker process fed
  through queues) and its own JSON API (``{"x": [[...]], ...}``), REST only;
* the floor (serve_floor.py): bare Starlette+uvicorn and grpcio endpoints that
  parse the same request and return a response of the same bytes, no model.
  On REST it is measured with the JSON body too (``floor (JSON)``: orjson and one
  numpy conversion per input, the first input answered as JSON).
  Its gRPC side is grpcio's threaded server, as neuropod serve's; a second
  floor on grpc.aio (what MLServer uses) is shown beside it for comparison.

Load (pinned to core 1), closed loop at each concurrency:

* REST: ``wrk -t1 -c N`` with serve_wrk.lua, posting Triton's binary tensor
  extension (``Inference-Header-Content-Length``). MLServer's REST has no binary
  extension, so it gets the same tensors as JSON; neuropod serve is measured
  with that JSON body too, so there is a like-for-like row.
* gRPC: serve_grpc_load.py (grpc.aio, processes x in-flight calls), the request
  built with our generated ``inference.*`` messages, tensors in
  ``raw_input_contents``.

Scaling cells (``--processes``, default 1,2): ``neuropod serve --processes N`` against
the floor forked into N processes sharing its socket (what ``uvicorn --workers N``
does), servers and ``wrk`` free on every core, REST binary on the tiny model at the
highest concurrency. Beside requests/s, the CPU time per request (the server's process
group, user+sys from /proc, over the requests served), so the comparison does not hang
on the clock speed of the minute.

Every cell shows the server's CPU per request (``CPU us/req``: the core share it used over
its requests/s).

Models: ``tiny`` (out = x + y, float32 [batch_size, 2], one row per request),
``small_inputs_100``: the original Neuropod's many-small-tensors case
(dummy_small_input_model: 100 float32 inputs of [10, 5]), here their sum, and
``mlp`` (neuropod serve only, concurrency 32, with and without batching): a
64-2048-2048-2048-16 MLP whose one-row run reads 34 MB of weights, to show what
batching does where the model's run, not the request, is the cost.

Each measurement is a warm-up then ``--duration`` seconds; every round measures
every (protocol, model, concurrency, server) once, servers in a rotating order,
and the table shows medians over ``--repeats`` rounds; a ratio is the median of
the rounds' ratios (each round measures a group's servers seconds apart).
Targets: neuropod >= 2x the faster MLServer's requests/s with a lower p99 in every
cell; >= 0.7 of the floor's requests/s on the tiny model; plain JSON >= 0.9 of the
floor's JSON on both models and >= 2x MLServer on the 100-input one, every
concurrency; batching (no delay) >= 0.95 of unbatched on the tiny model at every
concurrency, and >= 3x on the MLP at the highest; ``--processes 2`` keeps >= 0.9 of
one process's requests per CPU second and gains at least what the floor gains from
a second process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from _servers import free_port, log_tail, stop_group, wait_ready
from neuropod.packagers import create_onnx_neuropod
from neuropod_serving.protocol import HEADER_LENGTH, build_infer_request, parse_infer_response

HERE = Path(__file__).resolve().parent
SERVER_CORE, LOAD_CORE = "0", "1"
TINY, MANY, MLP = "tiny", "small_inputs_100", "mlp"
#: The MLP's widths: about 34 MB of weights, so a one-row run reads them all (~2 ms here) and a
#: 32-row run costs a few times that, not 32: a model where batching pays, unlike the tiny one.
MLP_DIMS = (64, 2048, 2048, 2048, 16)
CONCURRENCIES = (1, 8, 32)
#: The row label of --baseline-python's server.
BASELINE = "baseline"
BATCH = 32


# --- models -------------------------------------------------------------------


@dataclass
class Model:
    name: str
    onnx: bytes
    output: str
    inputs: dict[str, np.ndarray]
    expected: np.ndarray
    package: Path | None = None


def _onnx(nodes: list[Any], inputs: list[Any], outputs: list[Any]) -> bytes:
    model = helper.make_model(helper.make_graph(nodes, "bench", inputs, outputs), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def build_models(tmp: Path) -> dict[str, Model]:
    """Both models as neuropod packages (the project's packager) and as plain .onnx for MLServer."""
    vi, f = helper.make_tensor_value_info, TensorProto.FLOAT
    rng = np.random.default_rng(0)
    tiny_spec = [{"name": n, "dtype": "float32", "shape": ["batch_size", 2]} for n in ("x", "y")]
    xy = {n: rng.standard_normal((1, 2)).astype(np.float32) for n in ("x", "y")}
    tiny = Model(
        TINY,
        _onnx([helper.make_node("Add", ["x", "y"], ["out"])], [vi(n, f, ["batch_size", 2]) for n in ("x", "y")],
              [vi("out", f, ["batch_size", 2])]),
        "out", xy, xy["x"] + xy["y"],
    )  # fmt: skip
    tiny.package = create_onnx_neuropod(
        tmp / "tiny", TINY, tiny_spec, [{"name": "out", "dtype": "float32", "shape": ["batch_size", 2]}], onnx_model=tiny.onnx
    )
    names = [f"small_input{i}" for i in range(100)]
    many_in = {n: rng.standard_normal((10, 5)).astype(np.float32) for n in names}
    many = Model(
        MANY,
        _onnx([helper.make_node("Sum", names, ["output"])], [vi(n, f, [10, 5]) for n in names], [vi("output", f, [10, 5])]),
        "output", many_in, np.sum(np.stack(list(many_in.values())), axis=0, dtype=np.float32),
    )  # fmt: skip
    many.package = create_onnx_neuropod(
        tmp / "many", MANY, [{"name": n, "dtype": "float32", "shape": [10, 5]} for n in names],
        [{"name": "output", "dtype": "float32", "shape": [10, 5]}], onnx_model=many.onnx,
    )  # fmt: skip
    mlp = _mlp(rng)
    mlp.package = create_onnx_neuropod(
        tmp / "mlp", MLP, [{"name": "x", "dtype": "float32", "shape": ["batch_size", MLP_DIMS[0]]}],
        [{"name": "y", "dtype": "float32", "shape": ["batch_size", MLP_DIMS[-1]]}], onnx_model=mlp.onnx,
    )  # fmt: skip
    return {TINY: tiny, MANY: many, MLP: mlp}


def _mlp(rng: np.random.Generator) -> Model:
    """y = relu(relu(relu(x W0) W1) W2) W3, float32, one row of x per request."""
    weights = [(rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32) for a, b in pairwise(MLP_DIMS)]
    nodes, previous = [], "x"
    for i in range(len(weights)):
        last = i == len(weights) - 1
        nodes.append(helper.make_node("MatMul", [previous, f"w{i}"], ["y" if last else f"m{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"m{i}"], [f"h{i}"]))
            previous = f"h{i}"
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", MLP_DIMS[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", MLP_DIMS[-1]])],
        [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    x = rng.standard_normal((1, MLP_DIMS[0])).astype(np.float32)
    expected = x
    for i, w in enumerate(weights):
        expected = expected @ w
        if i < len(weights) - 1:
            expected = np.maximum(expected, 0)
    return Model(MLP, model.SerializeToString(), "y", {"x": x}, expected)


# --- requests -----------------------------------------------------------------


@dataclass
class Bodies:
    """Prepared request files for one model."""

    binary: Path
    binary_header: int
    json: Path
    grpc: Path
    litserve: Path


def write_bodies(model: Model, tmp: Path) -> Bodies:
    binary = build_infer_request(model.inputs, binary=True, binary_outputs=True)
    plain = build_infer_request(model.inputs, binary=False, binary_outputs=False)
    assert binary.json_length is not None and plain.json_length is None
    out = Bodies(tmp / f"{model.name}.bin", binary.json_length, tmp / f"{model.name}.json", tmp / f"{model.name}.grpc",
                 tmp / f"{model.name}.litserve.json")  # fmt: skip
    out.binary.write_bytes(binary.content)
    out.json.write_bytes(plain.content)
    # LitServe's own API: an object of input name to nested lists (what its users send).
    out.litserve.write_text(json.dumps({n: a.tolist() for n, a in model.inputs.items()}))
    out.grpc.write_bytes(grpc_request(model).SerializeToString())
    return out


def grpc_request(model: Model) -> Any:
    from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb

    request = pb.ModelInferRequest(model_name=model.name)
    for name, array in model.inputs.items():
        t = request.inputs.add()
        t.name, t.datatype = name, "FP32"
        t.shape.extend(array.shape)
        request.raw_input_contents.append(array.tobytes())
    return request


# --- servers ------------------------------------------------------------------


@dataclass
class Server:
    """One server process (and whatever it starts), in its own process group on the server core."""

    label: str
    kind: str  # "neuropod", "mlserver", "litserve", "floor"
    models: tuple[str, ...]
    http_port: int
    grpc_port: int
    command: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    #: The cores it may run on (taskset -c): the server core, or every core for the scaling cells.
    cores: str = SERVER_CORE
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["taskset", "-c", self.cores, *self.command], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env={**os.environ, **self.env}, cwd=self.cwd, start_new_session=True,
            )  # fmt: skip

    def wait_ready(self, timeout: float = 120.0) -> None:
        urls = [f"http://127.0.0.1:{self.http_port}/" + ("health" if self.kind == "litserve" else "v2/health/ready")]
        if self.kind in ("neuropod", "mlserver"):
            urls += [f"http://127.0.0.1:{self.http_port}/v2/models/{m}/ready" for m in self.models]
        assert self.proc is not None
        wait_ready(self.proc, self.label, self.log, urls, timeout)

    def tail(self, lines: int = 30) -> str:
        return log_tail(self.log, lines)

    def stop(self) -> None:
        """Stop the whole process group: SIGINT (a clean shutdown), then SIGKILL after 10 s."""
        if self.proc is not None:
            stop_group(self.proc)
        self.proc = None


def neuropod_server(label: str, models: list[Model], tmp: Path, grpc: bool, extra: list[str] = (),  # type: ignore[assignment]
                    python: str = sys.executable) -> Server:  # fmt: skip
    http, grpc_port = free_port(), free_port() if grpc else 0
    cmd = [python, "-m", "neuropod", "serve", *(str(m.package) for m in models), "--quiet",
           "--http-port", str(http), "--grpc-port", str(grpc_port), "--metrics-port", "0", *extra]  # fmt: skip
    return Server(label, "neuropod", tuple(m.name for m in models), http, grpc_port, cmd, tmp / f"{_slug(label)}.log")


def mlserver_server(label: str, models: list[Model], tmp: Path, venv: Path, parallel_workers: int | None) -> Server:
    """MLServer with our ONNX runtime; ``parallel_workers`` None keeps MLServer's default."""
    repo = tmp / f"mlserver-{_slug(label)}"
    repo.mkdir()
    http, grpc = free_port(), free_port()
    settings: dict[str, Any] = {
        "debug": False, "host": "127.0.0.1", "http_port": http, "grpc_port": grpc, "metrics_port": free_port(),
        "metrics_dir": str(repo / ".metrics"), "environments_dir": str(repo / ".envs"),
    }  # fmt: skip
    if parallel_workers is not None:
        settings["parallel_workers"] = parallel_workers
    (repo / "settings.json").write_text(json.dumps(settings, indent=1))
    for m in models:
        folder = repo / m.name
        folder.mkdir()
        (folder / "model.onnx").write_bytes(m.onnx)
        (folder / "model-settings.json").write_text(json.dumps({
            "name": m.name, "implementation": "serve_mlserver_onnx.OnnxRuntime",
            "parameters": {"uri": "./model.onnx", "version": "1"},
        }, indent=1))  # fmt: skip
    cmd = [str(venv / "bin" / "mlserver"), "start", str(repo)]
    env = {"PYTHONPATH": str(HERE)}
    return Server(label, "mlserver", tuple(m.name for m in models), http, grpc, cmd, tmp / f"{_slug(label)}.log", env, repo)


def litserve_server(models: list[Model], tmp: Path, venv: Path) -> Server:
    """LitServe with its defaults (serve_litserve_onnx.py), one endpoint per model, REST only."""
    folder = tmp / "litserve"
    folder.mkdir()
    paths = []
    for m in models:
        (folder / f"{m.name}.onnx").write_bytes(m.onnx)
        paths.append(f"{m.name}={folder / f'{m.name}.onnx'}")
    http = free_port()
    cmd = [str(venv / "bin" / "python"), str(HERE / "serve_litserve_onnx.py"), "--port", str(http), *paths]
    return Server("litserve (JSON)", "litserve", tuple(m.name for m in models), http, 0, cmd, tmp / "litserve.log",
                  cwd=folder)  # fmt: skip


def floor_server(models: list[Model], tmp: Path, grpc: bool, grpc_kind: str = "threads") -> Server:
    """The floor; with ``grpc_kind`` "asyncio" its gRPC side is grpc.aio (a row for comparison, not the floor)."""
    http, grpc_port = free_port(), free_port() if grpc else 0
    cmd = [sys.executable, str(HERE / "serve_floor.py"), "--http-port", str(http), "--grpc-port", str(grpc_port),
           "--grpc-kind", grpc_kind, *(f"--output={m.name}={m.output}" for m in models)]  # fmt: skip
    label = "floor" if grpc_kind == "threads" else f"floor on grpc.{grpc_kind}"
    return Server(label, "floor", tuple(m.name for m in models), http, grpc_port, cmd, tmp / f"{_slug(label)}.log")


def scaling_servers(models: list[Model], tmp: Path, processes: int) -> list[Server]:
    """``neuropod serve --processes N`` and the floor forked into N processes (what ``uvicorn --workers N``
    does), REST only, free to run on every core: the scaling cells."""
    every = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    plural = "es" if processes > 1 else ""
    ours = neuropod_server(f"neuropod --processes {processes}", models, tmp, False, ["--processes", str(processes)])
    http = free_port()
    label = f"floor, {processes} process{plural}"
    cmd = [sys.executable, str(HERE / "serve_floor.py"), "--http-port", str(http), "--processes", str(processes),
           *(f"--output={m.name}={m.output}" for m in models)]  # fmt: skip
    floor = Server(label, "floor", tuple(m.name for m in models), http, 0, cmd, tmp / f"{_slug(label)}.log")
    for s in (ours, floor):
        s.cores = every
    return [ours, floor]


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label)


class CpuSampler:
    """CPU time of a server's whole process group, sampled every 50 ms in a thread, so the
    share of a core it used inside a load generator's window can be read afterwards."""

    def __init__(self, server: Server) -> None:
        assert server.proc is not None
        self.pgid = server.proc.pid
        self.pids = _group_pids(self.pgid)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while True:
            total = 0
            for pid in self.pids:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    total += int(fields[11]) + int(fields[12])  # utime, stime
                except (OSError, IndexError, ValueError):
                    pass
            self.samples.append((time.monotonic(), total / tick))
            if self._stop.wait(0.05):
                return

    def share(self, t0: float, t1: float) -> float:
        """Cores used between t0 and t1 (monotonic seconds), from the samples nearest them."""
        if not self.samples or t1 <= t0:
            return float("nan")
        a = min(self.samples, key=lambda x: abs(x[0] - t0))
        b = min(self.samples, key=lambda x: abs(x[0] - t1))
        return (b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else float("nan")


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return pids


# --- checks -------------------------------------------------------------------


def check_rest(server: Server, model: Model, body: Path, header: int | None) -> None:
    """One request: the server answers 200 with the expected output (the floor: the first input)."""
    headers = {"Content-Type": "application/json"} if header is None else {
        "Content-Type": "application/octet-stream", HEADER_LENGTH: str(header)}  # fmt: skip
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/models/{model.name}/infer",
                                 data=body.read_bytes(), headers=headers, method="POST")  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            content, length = r.read(), r.headers.get(HEADER_LENGTH)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{server.label}: REST {model.name} answered {e.code}: {e.read()[:500]!r}") from None
    out = parse_infer_response(content, length).outputs[model.output]
    _compare(server, "REST", model, out)


def check_litserve(server: Server, model: Model, body: Path) -> None:
    """One request to LitServe's own JSON API: the model's output as nested lists."""
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/predict/{model.name}", data=body.read_bytes(),
                                 headers={"Content-Type": "application/json"}, method="POST")  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{server.label}: {model.name} answered {e.code}: {e.read()[:500]!r}") from None
    _compare(server, "REST", model, np.asarray(answer[model.output], dtype=np.float32))


def check_grpc(server: Server, model: Model) -> None:
    import grpc

    from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb

    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)  # fmt: skip
        try:
            reply = call(grpc_request(model), timeout=30)
        except grpc.RpcError as e:
            raise RuntimeError(f"{server.label}: gRPC {model.name} failed: {e.code()} {e.details()}") from None
    names = [o.name for o in reply.outputs]
    if model.output not in names or len(reply.raw_output_contents) != len(names):
        raise RuntimeError(f"{server.label}: gRPC {model.name}: outputs {names}, {len(reply.raw_output_contents)} raw")
    i = names.index(model.output)
    out = np.frombuffer(reply.raw_output_contents[i], np.float32).reshape(tuple(reply.outputs[i].shape))
    _compare(server, "gRPC", model, out)


def _compare(server: Server, protocol: str, model: Model, out: np.ndarray) -> None:
    expected = next(iter(model.inputs.values())) if server.kind == "floor" else model.expected
    # The MLP sums thousands of products: onnxruntime and numpy add them in different orders.
    tolerance = 1e-3 if model.name == MLP else 1e-5
    if out.shape != expected.shape or not np.allclose(out, expected, rtol=tolerance, atol=tolerance):
        raise RuntimeError(f"{server.label}: {protocol} {model.name} returned {out!r}, expected {expected!r}")


# --- load ---------------------------------------------------------------------


def _run_load(cmd: list[str], marker: str, timeout: float, cores: str = LOAD_CORE) -> dict[str, Any]:
    """Run a load generator on ``cores``; its result line as a dict, with ``window`` (monotonic t0, t1)."""
    started = time.monotonic()
    proc = subprocess.Popen(["taskset", "-c", cores, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    ended = time.monotonic()
    window = next((ln.split()[1:] for ln in out.splitlines() if ln.startswith("GRPC_WINDOW ")), None)
    line = next((ln for ln in out.splitlines() if ln.startswith(marker)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"load generator failed ({proc.returncode}): {' '.join(cmd)}\n{out[-2000:]}\n{err[-2000:]}")
    result: dict[str, Any] = json.loads(line[len(marker):])
    # wrk measures from its start to its end (connecting takes microseconds on loopback).
    result["window"] = (float(window[0]), float(window[1])) if window else (started + 0.02, ended - 0.02)
    return result


def wrk(url: str, body: Path, header: int | None, connections: int, seconds: int, cores: str = LOAD_CORE) -> dict[str, Any]:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s", "--latency",
           "-s", str(HERE / "serve_wrk.lua"), url, "--", str(body), "" if header is None else str(header)]  # fmt: skip
    return _run_load(cmd, "WRK_RESULT ", seconds + 30, cores)


def rest_load(server: Server, model: Model, body: Path, header: int | None, c: int, args: argparse.Namespace) -> dict[str, Any]:
    path = f"predict/{model.name}" if server.kind == "litserve" else f"v2/models/{model.name}/infer"
    url = f"http://127.0.0.1:{server.http_port}/{path}"
    # The scaling cells' servers run on every core, and so does their load.
    cores = LOAD_CORE if server.cores == SERVER_CORE else server.cores
    wrk(url, body, header, c, args.warmup, cores)
    with CpuSampler(server) as cpu:
        r = wrk(url, body, header, c, args.duration, cores)
    errors = sum(r["errors"].values())
    if errors:
        raise RuntimeError(f"{server.label}: {errors} failed REST requests under load ({r['errors']}):\n{server.tail()}")
    share = cpu.share(*r["window"])
    return {"rps": r["rps"], "p50_ms": r["p50_us"] / 1e3, "p99_ms": r["p99_us"] / 1e3,
            "server_cpu": share, "cpu_us": share / r["rps"] * 1e6 if r["rps"] else float("nan"),
            "load_cpu": None}  # fmt: skip


def grpc_load(server: Server, body: Path, c: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "serve_grpc_load.py"), "--target", f"127.0.0.1:{server.grpc_port}",
           "--request", str(body), "--concurrency", str(c), "--processes", str(args.grpc_processes),
           "--warmup", str(args.warmup), "--duration", str(args.duration)]  # fmt: skip
    with CpuSampler(server) as cpu:
        r = _run_load(cmd, "GRPC_RESULT ", args.warmup + args.duration + 60)
    if r["errors"]["rpc"]:
        raise RuntimeError(f"{server.label}: {r['errors']['rpc']} failed gRPC calls under load:\n{server.tail()}")
    share = cpu.share(*r["window"])
    return {"rps": r["rps"], "p50_ms": r["p50_us"] / 1e3, "p99_ms": r["p99_us"] / 1e3,
            "server_cpu": share, "cpu_us": share / r["rps"] * 1e6 if r["rps"] else float("nan"),
            "load_cpu": r["load_cpu"]}  # fmt: skip


# --- the plan -----------------------------------------------------------------


@dataclass
class Cell:
    """One measurement: a server under one protocol/model/concurrency (``variant``: the REST body)."""

    protocol: str  # "rest" or "grpc"
    model: str
    concurrency: int
    server: str  # row label
    rounds: list[dict[str, float]] = field(default_factory=list)

    def median(self, key: str) -> float:
        values = [r[key] for r in self.rounds if r.get(key) is not None and r[key] == r[key]]  # NaN != NaN
        return statistics.median(values) if values else float("nan")

    def over(self, other: Cell) -> float:
        """This cell's requests/s over ``other``'s: the median of the rounds' ratios. Both were
        measured seconds apart in each round, so a ratio does not mix the machine's slow and
        fast minutes as a ratio of medians (taken from different rounds) can."""
        ratios = [a["rps"] / b["rps"] for a, b in zip(self.rounds, other.rounds) if b["rps"]]
        return statistics.median(ratios) if ratios else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mlserver-venv", type=Path, help="a venv with mlserver 1.7, onnxruntime and uvloop<0.22 "
                        "(without it MLServer is not measured)")  # fmt: skip
    parser.add_argument("--litserve-venv", type=Path, help="a venv with litserve and onnxruntime (without it "
                        "LitServe is not measured)")  # fmt: skip
    parser.add_argument("--processes", default="1,2", help="the scaling cells' server process counts, servers and "
                        "load on every core (default 1,2; 'none' skips them)")  # fmt: skip
    parser.add_argument("--duration", type=int, default=2, help="seconds measured per cell and round (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="seconds of warm-up before each measurement (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the table shows medians (default 3)")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)), help="default 1,8,32")
    parser.add_argument("--protocols", default="rest,grpc", help="rest, grpc or both (default)")
    parser.add_argument("--batch-delay-us", type=int, default=2000,
                        help="the --max-queue-delay-us tried beside 0 (default 2000)")  # fmt: skip
    parser.add_argument("--grpc-processes", type=int, default=2, help="gRPC load processes (default 2)")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--baseline-only", action="store_true", help="with --baseline-python: measure only the "
                        "cells that have a baseline (no floor, MLServer or second batching delay), so more rounds "
                        "fit in the same time")  # fmt: skip
    parser.add_argument("--baseline-python", help="also run `neuropod serve` from this interpreter (a venv holding "
                        "another release, e.g. the previous commit's) in the same cells, and print each cell's "
                        "ratio against it")  # fmt: skip
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed (default: report only)")
    args = parser.parse_args()
    if args.baseline_only and not args.baseline_python:
        raise SystemExit("bench_serve: --baseline-only needs --baseline-python")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    protocols = [p.strip() for p in args.protocols.split(",")]
    if shutil.which("wrk") is None and "rest" in protocols:
        raise SystemExit("bench_serve: wrk is not installed (Debian: apt-get install wrk)")
    if shutil.which("taskset") is None:
        raise SystemExit("bench_serve: taskset is not installed (Debian: util-linux)")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench_serve: needs two CPU cores (server on core 0, load on core 1)")
    mlserver = args.mlserver_venv
    if mlserver is not None and not (mlserver / "bin" / "mlserver").is_file():
        raise SystemExit(f"bench_serve: {mlserver}/bin/mlserver not found: --mlserver-venv must be a venv with mlserver")
    litserve = args.litserve_venv
    if litserve is not None and not (litserve / "bin" / "python").is_file():
        raise SystemExit(f"bench_serve: {litserve}/bin/python not found: --litserve-venv must be a venv with litserve")
    process_counts = [] if args.processes == "none" else [int(n) for n in args.processes.split(",")]

    # This process (sampling, waiting) stays off the server's core.
    os.sched_setaffinity(0, {int(LOAD_CORE)})
    # SIGTERM stops the servers too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        os.environ.setdefault("NEUROPOD_CACHE_DIR", str(tmp / "cache"))
        os.environ.setdefault("NEUROPOD_HOME", str(tmp / "home"))
        models = build_models(tmp)
        bodies = {name: write_bodies(m, tmp) for name, m in models.items()}
        grpc = "grpc" in protocols
        both = [models[TINY], models[MANY]]
        servers = [neuropod_server("neuropod", [*both, models[MLP]], tmp, grpc)]
        batched = []
        for delay in (0, args.batch_delay_us):
            s = neuropod_server(f"neuropod batch {BATCH}, delay {delay} us", [models[TINY], models[MLP]], tmp, grpc,
                                ["--max-batch-size", str(BATCH), "--max-queue-delay-us", str(delay)])  # fmt: skip
            batched.append(s)
        servers += batched
        baseline: list[Server] = []
        if args.baseline_python:
            baseline.append(neuropod_server(BASELINE, [*both, models[MLP]], tmp, grpc, python=args.baseline_python))
            baseline.append(neuropod_server(f"{BASELINE} batch {BATCH}, delay 0 us", [models[TINY], models[MLP]], tmp,
                                            grpc, ["--max-batch-size", str(BATCH), "--max-queue-delay-us", "0"],
                                            python=args.baseline_python))  # fmt: skip
        servers += baseline
        if mlserver is not None:
            servers.append(mlserver_server("mlserver parallel_workers=0", both, tmp, mlserver, 0))
            servers.append(mlserver_server("mlserver default (1 worker)", both, tmp, mlserver, None))
        if litserve is not None:
            servers.append(litserve_server(both, tmp, litserve))
        floor = floor_server(both, tmp, grpc)
        servers.append(floor)
        scaling = [] if args.baseline_only else [s for n in process_counts for s in scaling_servers([models[TINY]], tmp, n)]
        servers += scaling
        aio_floor = floor_server(both, tmp, grpc, "asyncio") if grpc else None
        if aio_floor is not None:
            servers.append(aio_floor)
        for s in servers:
            stack.callback(s.stop)
            s.start()
        for s in servers:
            s.wait_ready()
        print(f"servers pinned to core {SERVER_CORE}, load generators to core {LOAD_CORE} (taskset); "
              f"{args.repeats} rounds x {args.duration} s per cell after {args.warmup} s warm-up; medians shown, "
              "ratios are medians of the rounds' ratios")  # fmt: skip

        # Every server answers correctly before anything is timed.
        for s in servers:
            for name in s.models:
                m, b = models[name], bodies[name]
                if s.kind == "litserve":
                    check_litserve(s, m, b.litserve)
                    continue
                if s.kind != "mlserver":
                    check_rest(s, m, b.binary, b.binary_header)
                check_rest(s, m, b.json, None)
                if grpc and s.grpc_port:
                    check_grpc(s, m)

        # The plan: (cell, how to measure it).
        plan: list[tuple[Cell, Any]] = []
        by_label = {s.label: s for s in servers}

        def add(protocol: str, model: str, c: int, label: str, server: Server, variant: str = "binary") -> None:
            m, b = models[model], bodies[model]
            cell = Cell(protocol, model, c, label)
            if protocol == "grpc":
                run = lambda: grpc_load(server, b.grpc, c, args)  # noqa: E731
            elif protocol == "scaling":
                run = lambda: rest_load(server, m, b.binary, b.binary_header, c, args)  # noqa: E731
            elif variant == "json":
                run = lambda: rest_load(server, m, b.json, None, c, args)  # noqa: E731
            elif variant == "litserve":
                run = lambda: rest_load(server, m, b.litserve, None, c, args)  # noqa: E731
            else:
                run = lambda: rest_load(server, m, b.binary, b.binary_header, c, args)  # noqa: E731
            plan.append((cell, run))

        for protocol in protocols:
            for model in (TINY, MANY):
                for c in concurrencies:
                    add(protocol, model, c, "neuropod", by_label["neuropod"])
                    if baseline:
                        add(protocol, model, c, BASELINE, baseline[0])
                    if protocol == "rest":
                        add(protocol, model, c, "neuropod (JSON)", by_label["neuropod"], "json")
                        if baseline:
                            add(protocol, model, c, f"{BASELINE} (JSON)", baseline[0], "json")
                    if args.baseline_only:
                        if model == TINY and c == max(concurrencies):
                            add(protocol, model, c, batched[0].label, batched[0])
                            add(protocol, model, c, baseline[1].label, baseline[1])
                        continue
                    for s in servers:
                        if s.kind == "mlserver":
                            add(protocol, model, c, s.label + (" (JSON)" if protocol == "rest" else ""), s,
                                "json" if protocol == "rest" else "binary")  # fmt: skip
                        if s.kind == "litserve" and protocol == "rest":
                            add(protocol, model, c, s.label, s, "litserve")
                    add(protocol, model, c, "floor", floor)
                    if protocol == "rest":
                        add(protocol, model, c, "floor (JSON)", floor, "json")
                    if protocol == "grpc" and aio_floor is not None:
                        add(protocol, model, c, aio_floor.label, aio_floor)
                    if model == TINY:
                        # Batching with no delay at every concurrency (it must never lose); the
                        # second delay and the baseline at the highest only.
                        for s in [*batched[:1], *([*batched[1:], *baseline[1:]] if c == max(concurrencies) else [])]:
                            add(protocol, model, c, s.label, s)
            # Where batching pays: a model whose run, not the request, is the cost.
            c = max(concurrencies)
            for s in [by_label["neuropod"], *(batched[:1] if args.baseline_only else batched), *baseline]:
                add(protocol, MLP, c, s.label, s)
        # One server process per core: servers and load free on every core (REST, binary, tiny model).
        for s in scaling:
            add("scaling", TINY, max(concurrencies), s.label, s)
        started = time.monotonic()
        for r in range(args.repeats):
            for cell, run in _rotated(plan, r):
                cell.rounds.append(run())
            print(f"round {r + 1}/{args.repeats} done ({time.monotonic() - started:.0f} s)", flush=True)
        cells = [cell for cell, _ in plan]
        targets = [] if args.baseline_only else report(cells, protocols, concurrencies, mlserver is not None,
                                                       process_counts)  # fmt: skip
        if baseline:
            report_baseline(cells)
        if args.json:
            write_json(args.json, cells, targets, args)
        return 1 if args.strict and not all(t["pass"] for t in targets) else 0


def _rotated(plan: list[tuple[Cell, Any]], r: int) -> list[tuple[Cell, Any]]:
    """The plan with the servers of each (protocol, model, concurrency) group in a rotated order for round ``r``."""
    groups: dict[tuple[str, str, int], list[tuple[Cell, Any]]] = {}
    for item in plan:
        c = item[0]
        groups.setdefault((c.protocol, c.model, c.concurrency), []).append(item)
    out = []
    for items in groups.values():
        k = r % len(items)
        out += items[k:] + items[:k]
    return out


# --- the report ---------------------------------------------------------------


PROTOCOL_TITLES = {"rest": "REST (binary tensors; MLServer has no binary extension: JSON)", "grpc": "gRPC (raw_input_contents)",
                   "scaling": "REST (binary tensors), servers and load free on every core"}  # fmt: skip


def report(cells: list[Cell], protocols: list[str], concurrencies: list[int], have_mlserver: bool,
           process_counts: list[int]) -> list[dict[str, Any]]:  # fmt: skip
    def get(protocol: str, model: str, c: int, label: str) -> Cell | None:
        return next((x for x in cells if (x.protocol, x.model, x.concurrency, x.server) == (protocol, model, c, label)), None)

    targets: list[dict[str, Any]] = []
    vs_ml: list[tuple[float, bool, str]] = []
    vs_floor: list[tuple[float, str]] = []
    batching: list[tuple[float, str]] = []
    json_vs_floor: list[tuple[float, str]] = []
    json_vs_ml: list[tuple[float, str]] = []
    for protocol in protocols:
        for model in (TINY, MANY):
            for c in concurrencies:
                group = [x for x in cells if (x.protocol, x.model, x.concurrency) == (protocol, model, c)]
                _print_group(group, protocol, model, c)
                np_cell, fl = get(protocol, model, c, "neuropod"), get(protocol, model, c, "floor")
                assert np_cell is not None and fl is not None
                notes = []
                where = f"{protocol} {model} c={c}"
                mls = [x for x in group if x.server.startswith("mlserver")]
                if mls:
                    for ml in mls:
                        notes.append(f"neuropod / {ml.server.split(' (JSON)')[0]}: {np_cell.over(ml):.2f}x")
                    best = max(mls, key=lambda x: x.median("rps"))
                    p99_ok = np_cell.median("p99_ms") < min(x.median("p99_ms") for x in mls)
                    vs_ml.append((np_cell.over(best), p99_ok, where))
                    if protocol == "rest":
                        js = get(protocol, model, c, "neuropod (JSON)")
                        assert js is not None
                        notes.append(f"neuropod JSON / faster mlserver: {js.over(best):.2f}x")
                        if model == MANY:
                            json_vs_ml.append((js.over(best), where))
                lit = get(protocol, model, c, "litserve (JSON)")
                js = get(protocol, model, c, "neuropod (JSON)")
                if lit is not None and js is not None:
                    notes.append(f"neuropod JSON / litserve: {js.over(lit):.2f}x")
                frac = np_cell.over(fl)
                notes.append(f"neuropod / floor: {frac:.2f}")
                js, fl_js = get(protocol, model, c, "neuropod (JSON)"), get(protocol, model, c, "floor (JSON)")
                if js is not None and fl_js is not None:
                    notes.append(f"neuropod JSON / floor JSON: {js.over(fl_js):.2f}")
                    json_vs_floor.append((js.over(fl_js), where))
                if model == TINY:
                    vs_floor.append((frac, where))
                for x in group:
                    if x.server.startswith("neuropod batch"):
                        gain = x.over(np_cell)
                        notes.append(f"{x.server} / unbatched: {gain:.2f}x req/s, p99 {x.median('p99_ms'):.2f} "
                                     f"vs {np_cell.median('p99_ms'):.2f} ms")  # fmt: skip
                        batching.append((gain, f"{where} {x.server}"))
                for n in notes:
                    print(f"  {n}")

    # The MLP: what batching does where the model's run is the cost (shown, no target).
    mlp_gains: list[tuple[float, str]] = []
    for protocol in protocols:
        c = max(concurrencies)
        group = [x for x in cells if (x.protocol, x.model, x.concurrency) == (protocol, MLP, c)]
        base = get(protocol, MLP, c, "neuropod")
        if not group or base is None:
            continue
        _print_group(group, protocol, MLP, c)
        for x in group:
            if x.server.startswith("neuropod batch"):
                gain = x.over(base)
                print(f"  {x.server} / unbatched: {gain:.2f}x req/s, p99 {x.median('p99_ms'):.2f} "
                      f"vs {base.median('p99_ms'):.2f} ms")  # fmt: skip
                mlp_gains.append((gain, f"{protocol} {x.server}"))

    print()
    if have_mlserver:
        worst = min(vs_ml)
        ok = all(r >= 2 and p for r, p, _ in vs_ml)
        p99_misses = [w for _, p, w in vs_ml if not p]
        targets.append({"target": "neuropod >= 2x the faster MLServer's req/s and a lower p99, every cell", "pass": ok,
                        "worst_ratio": worst[0], "worst_cell": worst[2], "p99_not_lower": p99_misses})  # fmt: skip
        print(f"{'PASS' if ok else 'MISS'}  neuropod >= 2x MLServer req/s with lower p99 in all {len(vs_ml)} cells: "
              f"lowest ratio {worst[0]:.2f}x ({worst[2]}); p99 not lower in {len(p99_misses)} "
              f"{'' if not p99_misses else '(' + ', '.join(p99_misses) + ')'}")  # fmt: skip
    else:
        print("----  neuropod vs MLServer: not measured (no --mlserver-venv)")
    worst_f = min(vs_floor)
    ok = worst_f[0] >= 0.7
    targets.append({"target": "neuropod >= 0.7 of the floor's req/s on the tiny model", "pass": ok,
                    "worst_fraction": worst_f[0], "worst_cell": worst_f[1]})  # fmt: skip
    print(f"{'PASS' if ok else 'MISS'}  neuropod >= 0.7 of the floor (tiny): lowest {worst_f[0]:.2f} ({worst_f[1]})")
    if json_vs_floor:
        worst = min(json_vs_floor)
        ok = worst[0] >= 0.9
        targets.append({"target": "neuropod JSON >= 0.9 of the floor's JSON req/s, both models, every concurrency",
                        "pass": ok, "worst_fraction": worst[0], "worst_cell": worst[1], "all": json_vs_floor})  # fmt: skip
        print(f"{'PASS' if ok else 'MISS'}  neuropod JSON >= 0.9 of the floor's JSON: lowest {worst[0]:.2f} ({worst[1]}); "
              "all: " + ", ".join(f"{r:.2f}" for r, _ in json_vs_floor))  # fmt: skip
    if json_vs_ml:
        worst = min(json_vs_ml)
        ok = worst[0] >= 2
        targets.append({"target": f"neuropod JSON >= 2x the faster MLServer on {MANY}, every concurrency", "pass": ok,
                        "worst_ratio": worst[0], "worst_cell": worst[1]})  # fmt: skip
        print(f"{'PASS' if ok else 'MISS'}  neuropod JSON >= 2x MLServer ({MANY}): lowest {worst[0]:.2f}x ({worst[1]})")
    no_delay = [(g, w) for g, w in batching if "delay 0 us" in w]
    if no_delay:
        worst = min(no_delay)
        ok = worst[0] >= 0.95
        targets.append({"target": "batching (delay 0) >= 0.95 of unbatched req/s on the tiny model, every concurrency",
                        "pass": ok, "worst_ratio": worst[0], "worst_cell": worst[1], "all": no_delay})  # fmt: skip
        print(f"{'PASS' if ok else 'MISS'}  batching never loses (tiny, >= 0.95 of unbatched): lowest {worst[0]:.2f}x "
              f"({worst[1]}); all: " + ", ".join(f"{g:.2f}x" for g, _ in no_delay))  # fmt: skip
    if mlp_gains:
        best_m = max(mlp_gains)
        ok = best_m[0] >= 3
        targets.append({"target": f"batching >= 3x req/s on the {MLP} model, concurrency {max(concurrencies)}",
                        "pass": ok, "best_gain": best_m[0], "best_config": best_m[1], "all": mlp_gains})  # fmt: skip
        print(f"{'PASS' if ok else 'MISS'}  batching >= 3x on the {MLP} model (c={max(concurrencies)}): best "
              f"{best_m[0]:.2f}x; all: " + ", ".join(f"{g:.2f}x ({w})" for g, w in mlp_gains))  # fmt: skip
    if batching:
        best_b = max(batching)
        print(f"INFO  batching on the tiny model, best: {best_b[0]:.2f}x ({best_b[1]})")
    targets += report_scaling(cells, process_counts, max(concurrencies))
    return targets


def report_scaling(cells: list[Cell], process_counts: list[int], c: int) -> list[dict[str, Any]]:
    """``neuropod serve --processes N`` against N=1, beside the floor forked into as many processes: the gain in
    req/s, and CPU time per request (from /proc, so it does not hang on the clock speed of the minute)."""
    group = [x for x in cells if x.protocol == "scaling"]
    if not group or len(process_counts) < 2:
        return []
    _print_group(group, "scaling", TINY, c)
    one, most = min(process_counts), max(process_counts)

    def cell(kind: str, n: int) -> Cell:
        plural = "es" if n > 1 else ""
        label = f"neuropod --processes {n}" if kind == "neuropod" else f"floor, {n} process{plural}"
        return next(x for x in group if x.server == label)

    ours_1, ours_n, floor_1, floor_n = cell("neuropod", one), cell("neuropod", most), cell("floor", one), cell("floor", most)
    gain, floor_gain = ours_n.over(ours_1), floor_n.over(floor_1)
    # Requests per CPU second of N processes over one process's: 1 / (CPU per request) ratio, per round.
    efficiency = statistics.median(a["cpu_us"] and b["cpu_us"] / a["cpu_us"]
                                   for a, b in zip(ours_n.rounds, ours_1.rounds))  # fmt: skip
    floor_eff = statistics.median(a["cpu_us"] and b["cpu_us"] / a["cpu_us"]
                                  for a, b in zip(floor_n.rounds, floor_1.rounds))  # fmt: skip
    print(f"  neuropod {most} processes / 1: {gain:.2f}x req/s (floor: {floor_gain:.2f}x); requests per CPU second "
          f"{efficiency:.2f} of one process's (floor: {floor_eff:.2f})")  # fmt: skip
    ok_eff, ok_gain = efficiency >= 0.9, gain >= floor_gain
    print(f"{'PASS' if ok_eff else 'MISS'}  --processes {most} keeps >= 0.9 of one process's requests per CPU second: "
          f"{efficiency:.2f}")  # fmt: skip
    print(f"{'PASS' if ok_gain else 'MISS'}  --processes {most} gains at least the floor's {floor_gain:.2f}x: {gain:.2f}x")
    return [
        {"target": f"--processes {most}: >= 0.9 of one process's requests per CPU second", "pass": ok_eff,
         "ratio": efficiency, "floor_ratio": floor_eff},
        {"target": f"--processes {most}: req/s gain over 1 >= the floor's", "pass": ok_gain, "gain": gain,
         "floor_gain": floor_gain},
    ]  # fmt: skip


def report_baseline(cells: list[Cell]) -> None:
    """Each neuropod cell's requests/s over the same cell served by ``--baseline-python``'s neuropod."""
    by_key = {(x.protocol, x.model, x.concurrency, x.server): x for x in cells}
    pairs = [("neuropod", BASELINE), ("neuropod (JSON)", f"{BASELINE} (JSON)"),
             (f"neuropod batch {BATCH}, delay 0 us", f"{BASELINE} batch {BATCH}, delay 0 us")]  # fmt: skip
    ratios: list[tuple[float, str]] = []
    print("\nAgainst the baseline (--baseline-python), requests/s ratio (median of the rounds' ratios):")
    for x in cells:
        for ours, theirs in pairs:
            other = by_key.get((x.protocol, x.model, x.concurrency, theirs))
            if x.server == ours and other is not None:
                r = x.over(other)
                where = f"{x.protocol} {x.model} c={x.concurrency} {ours}"
                ratios.append((r, where))
                print(f"  {where:<60} {x.median('rps'):9,.0f} vs {other.median('rps'):9,.0f} req/s: {r:.3f}")
    if ratios:
        values = sorted(r for r, _ in ratios)
        worst = min(ratios)
        print(f"INFO  against the baseline: median {statistics.median(values):.3f}, lowest {worst[0]:.3f} ({worst[1]}), "
              f"{len(ratios)} cells")  # fmt: skip


def _print_group(group: list[Cell], protocol: str, model: str, c: int) -> None:
    print(f"\n{PROTOCOL_TITLES[protocol]} | model {model} | concurrency {c}")
    print(f"  {'server':<40} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'server CPU':>10} {'CPU us/req':>10} "
          f"{'load CPU':>8}")  # fmt: skip
    for x in group:
        load = "" if protocol == "rest" else f"{x.median('load_cpu'):8.0%}"
        print(f"  {x.server:<40} {x.median('rps'):9,.0f} {x.median('p50_ms'):8.2f} {x.median('p99_ms'):8.2f}"
              f" {x.median('server_cpu'):10.0%} {x.median('cpu_us'):10,.0f} {load:>8}")  # fmt: skip


def _no_nan(value: Any) -> Any:
    """NaN (not measured) as null: JSON has no NaN."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return value


def _versions(args: argparse.Namespace) -> dict[str, str]:
    """neuropod's, onnxruntime's and the peers' releases (each peer's from its own venv)."""
    import onnxruntime

    import neuropod

    found = {"neuropod": neuropod.__version__, "onnxruntime": onnxruntime.__version__}
    for name, venv in (("mlserver", args.mlserver_venv), ("litserve", args.litserve_venv)):
        if venv is not None:
            out = subprocess.run([str(venv / "bin" / "python"), "-c", f"import {name}; print({name}.__version__)"],
                                 capture_output=True, text=True)  # fmt: skip
            found[name] = out.stdout.strip() or "?"
    return found


def write_json(path: Path, cells: list[Cell], targets: list[dict[str, Any]], args: argparse.Namespace) -> None:
    import datetime

    from _common import machine

    argv = list(sys.argv[1:])
    for option in ("--json", "--mlserver-venv", "--litserve-venv"):  # where this copy went; local venv paths
        if option in argv:
            i = argv.index(option)
            del argv[i : i + 2]
    data = {
        "bench": "serve",
        "command": " ".join(["nox -s bench_serve --", *argv]).rstrip(" -"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": _versions(args),
        "machine": {**machine(), "server_core": SERVER_CORE, "load_core": LOAD_CORE},
        "settings": {"duration_s": args.duration, "warmup_s": args.warmup, "repeats": args.repeats,
                     "batch_delay_us": args.batch_delay_us, "grpc_processes": args.grpc_processes},
        "cells": [{"protocol": c.protocol, "model": c.model, "concurrency": c.concurrency, "server": c.server,
                   "rps": c.median("rps"), "p50_ms": c.median("p50_ms"), "p99_ms": c.median("p99_ms"),
                   "server_cpu": c.median("server_cpu"), "cpu_us": c.median("cpu_us"), "load_cpu": c.median("load_cpu"),
                   "rounds": c.rounds} for c in cells],
        "targets": targets,
    }  # fmt: skip
    path.write_text(json.dumps(_no_nan(data), indent=1))
    print(f"results written to {path}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench_serve: interrupted; every server was stopped", file=sys.stderr)
        sys.exit(130)
    except RuntimeError as e:  # a server failed to start, answered wrongly or failed under load
        print(f"bench_serve: {e}", file=sys.stderr)
        sys.exit(2)
