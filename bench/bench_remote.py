"""A remote model's ``infer`` against the same model in-process, tritonclient and the bare transport (issue 13).

    python bench/bench_remote.py [--rounds 5] [--calls 2000] [--image-calls 100] [--json out.json] [--quick]

One ``neuropod serve`` (``--quiet``, REST and gRPC) serves four models, and a
floor process (remote_floor.py) serves the same cases with no model; both are
pinned to CPU core 0 with taskset, this process (every client) to core 1.
Per case, sequential calls (one in flight), each timed on its own:

* ``in-process``: ``neuropod.load_neuropod(package).infer(inputs)``;
* ``neuropod grpc://`` / ``neuropod http://``: ``neuropod.load_neuropod(URL).infer(inputs)``,
  the remote model, against ``neuropod serve``;
* ``tritonclient.grpc`` / ``tritonclient.http`` (binary data) against the same
  server with the same inputs, each call building its InferInputs and reading
  its outputs ``as_numpy``; run in a subprocess (remote_triton.py), so that
  each client is timed in a process of its own;
* the floor: a bare grpcio channel (identity serializers) sending the exact
  bytes of a ModelInferRequest built by our protocol code and getting back the
  exact bytes ``neuropod serve`` answered to it, from a bare grpcio threaded
  server; and ``http.client`` (keep-alive) posting the exact binary REST body
  (TCP_NODELAY, as urllib3 sets it) to a bare Starlette route on uvicorn
  (httptools), which answers the exact REST response body. No protobuf, no
  numpy, no model: the transport alone. A second REST floor runs the same
  app on neuropod serve's own uvicorn protocol (OneWriteProtocol: head and
  body in one write): stock uvicorn took about twice as long on a 6.9 MB
  answer here, and a floor slower than the server it bounds says nothing. The
  REST figures are taken against the faster of the two in each round.

Cases: ``tiny`` (out = x + y, two float32 [1, 2]), ``small_inputs_100`` (100
float32 [10, 5] inputs, one [10, 5] output: their sum), both as bench_serve.py
builds them; ``image``: a uint8 [1200, 1920, 3] image (6.9 MB) through
Identity, so the same 6.9 MB go back; and ``image_in``: the same image in, a
3-byte Slice (its first pixel) back, which splits the image's cost into its
way in and its way out.

Each round measures every (case, client) once, clients in a rotating order:
a warm-up, then ``--calls`` calls (``--image-calls`` for the images). The
tables show the medians over ``--rounds`` rounds of each round's p50 and p99;
a difference or ratio is the median of the rounds' differences or ratios.

Targets (issue 13), all at p50:
* our remote call <= the transport floor + 150 us, gRPC and REST, tiny and
  small_inputs_100. The floor runs no model, so the verdict is on ``remote -
  floor - in-process`` (the in-process call is the model's run with neuropod's
  checks, which the server does too: about 0.45 ms for small_inputs_100 here);
  ``remote - floor`` is printed beside it;
* our remote call at least as fast as tritonclient (ratio <= 1), both protocols
  (checked on every case);
* the image copied at most once on each side: ``remote - floor - in-process``
  (what serving adds beyond the transport and the model's own run) is shown in
  microseconds per MB and as a number of copies of the image, a copy being
  ``image.copy()`` timed in this run; at most 2 (one in the client, one in
  the server) passes.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
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
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import neuropod
from bench_serve import MANY, TINY, Model, Server, _onnx, build_models, free_port, neuropod_server
from neuropod.packagers import create_onnx_neuropod
from neuropod_serving.protocol import HEADER_LENGTH, build_infer_request, parse_infer_response

HERE = Path(__file__).resolve().parent
SERVER_CORE, CLIENT_CORE = 0, 1
IMAGE, IMAGE_IN = "image", "image_in"
IMAGE_SHAPE = (1200, 1920, 3)
CASES = (TINY, MANY, IMAGE, IMAGE_IN)
MB = 1e6
GRPC_METHOD = "/inference.GRPCInferenceService/ModelInfer"
#: The targets' numbers.
FLOOR_MARGIN_US = 150.0
MAX_IMAGE_COPIES = 2.0

# Row labels.
IN_PROCESS = "in-process"
COPY = "one image.copy()"
OURS = {"grpc": "neuropod grpc://", "rest": "neuropod http://"}
TRITON = {"grpc": "tritonclient.grpc", "rest": "tritonclient.http"}
FLOOR = {"grpc": "floor (bare grpcio)", "rest": "floor (Starlette+uvicorn, http.client)"}
FLOOR_ONE_WRITE = "floor, neuropod's OneWriteProtocol"
#: The REST floor the figures are taken against: in each round the faster of the two.
REST_FLOOR = "REST floor: the faster in each round"
PROTOCOL_TITLES = {"grpc": "gRPC", "rest": "REST (binary tensors)"}


# --- models -------------------------------------------------------------------


def build_cases(tmp: Path) -> dict[str, Model]:
    """tiny and small_inputs_100 as bench_serve builds them, and the two image models."""
    models = build_models(tmp)
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8)
    vi, u8 = helper.make_tensor_value_info, TensorProto.UINT8
    spec_in = [{"name": "image", "dtype": "uint8", "shape": list(IMAGE_SHAPE)}]

    echo = Model(IMAGE, _onnx([helper.make_node("Identity", ["image"], ["image_out"])], [vi("image", u8, IMAGE_SHAPE)],
                              [vi("image_out", u8, IMAGE_SHAPE)]), "image_out", {"image": image}, image.copy())  # fmt: skip
    echo.package = create_onnx_neuropod(tmp / IMAGE, IMAGE, spec_in,
                                        [{"name": "image_out", "dtype": "uint8", "shape": list(IMAGE_SHAPE)}],
                                        onnx_model=echo.onnx)  # fmt: skip

    # The first pixel: the image goes in, 3 bytes come back.
    bounds = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("starts", [0, 0]), ("ends", [1, 1]))]
    graph = helper.make_graph([helper.make_node("Slice", ["image", "starts", "ends"], ["pixel"])], "bench",
                              [vi("image", u8, IMAGE_SHAPE)], [vi("pixel", u8, [1, 1, 3])], bounds)  # fmt: skip
    sliced = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sliced.ir_version = 8
    first = Model(IMAGE_IN, sliced.SerializeToString(), "pixel", {"image": image}, image[:1, :1].copy())
    first.package = create_onnx_neuropod(tmp / IMAGE_IN, IMAGE_IN, spec_in,
                                         [{"name": "pixel", "dtype": "uint8", "shape": [1, 1, 3]}],
                                         onnx_model=first.onnx)  # fmt: skip
    return {TINY: models[TINY], MANY: models[MANY], IMAGE: echo, IMAGE_IN: first}


def describe(model: Model) -> str:
    shapes = {(str(a.dtype), a.shape) for a in model.inputs.values()}
    ins = (f"{len(model.inputs)} x " if len(model.inputs) > 1 else "") + ", ".join(f"{d} {list(s)}" for d, s in shapes)
    return f"{ins} -> {model.expected.dtype} {list(model.expected.shape)}"


# --- servers ------------------------------------------------------------------


def start(server: Server) -> None:
    """Start ``server`` on the server core (taskset), or unpinned where there is no taskset."""
    if shutil.which("taskset"):
        server.start()
        return
    with open(server.log, "wb") as log:
        server.proc = subprocess.Popen(server.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={**os.environ, **server.env}, start_new_session=True)  # fmt: skip


def pin_threads(pid: int, core: int) -> int:
    """Put every thread of process ``pid`` on ``core``; the number of threads moved.

    taskset pins a process when it starts, but onnxruntime then pins its own
    intra-op threads to cores of its choosing (a server's landed on the
    client's core, a client's in-process model's on both), so after models
    are loaded every thread is put back where the bench means it to be.
    Threads started later inherit their creator's core.
    """
    moved = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if os.sched_getaffinity(int(tid)) != {core}:
                os.sched_setaffinity(int(tid), {core})
                moved += 1
        except OSError:  # the thread ended meanwhile
            pass
    return moved


@dataclass
class Wire:
    """One case's exact request and response bytes, as neuropod serve answered them."""

    grpc_request: bytes
    grpc_response: bytes
    rest_request: bytes
    rest_request_header: int
    rest_response: bytes
    rest_response_header: str


def capture(server: Server, model: Model) -> Wire:
    """Send the case's request to neuropod serve over both protocols, check the answer, keep the bytes."""
    import grpc

    from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
    from neuropod_serving.protocol.grpc_codec import build_model_infer_request, parse_model_infer_response

    request = build_model_infer_request(model.name, model.inputs).SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=_GRPC_OPTIONS) as channel:
        try:
            response = channel.unary_unary(GRPC_METHOD)(request, timeout=60)
        except grpc.RpcError as e:
            raise RuntimeError(f"neuropod serve: gRPC {model.name} failed: {e.code()} {e.details()}") from None
    out = parse_model_infer_response(pb.ModelInferResponse.FromString(response)).outputs
    _check(f"neuropod serve gRPC {model.name}", model, out)

    body = build_infer_request(model.inputs, binary=True, binary_outputs=True)
    assert body.json_length is not None
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.request("POST", f"/v2/models/{model.name}/infer", body.content, _rest_headers(body.json_length))
        r = conn.getresponse()
        content, length = r.read(), r.getheader(HEADER_LENGTH)
    finally:
        conn.close()
    if r.status != 200 or length is None:
        raise RuntimeError(f"neuropod serve: REST {model.name} answered {r.status}: {content[:500]!r}")
    _check(f"neuropod serve REST {model.name}", model, parse_infer_response(content, length).outputs)
    return Wire(request, response, body.content, body.json_length, content, length)


def _rest_headers(json_length: int) -> dict[str, str]:
    return {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(json_length)}


def _check(who: str, model: Model, outputs: dict[str, np.ndarray]) -> None:
    out = outputs.get(model.output)
    expected = model.expected
    if out is None or out.shape != expected.shape or out.dtype != expected.dtype or not np.allclose(out, expected, rtol=1e-5, atol=1e-5):
        raise RuntimeError(f"{who}: output {model.output!r} is {out!r}, expected {expected!r}")


def floor_servers(wires: dict[str, Wire], tmp: Path) -> tuple[Server, Server]:
    """The floor (gRPC, and REST on stock uvicorn), and a REST-only one on neuropod serve's OneWriteProtocol."""
    folder = tmp / "floor-bodies"
    folder.mkdir()
    for case, w in wires.items():
        (folder / f"{case}.grpc").write_bytes(w.grpc_response)
        (folder / f"{case}.rest").write_bytes(w.rest_response)
        (folder / f"{case}.rest-header").write_text(w.rest_response_header)
    http_port, grpc_port, one_write_port = free_port(), free_port(), free_port()
    cmd = [sys.executable, str(HERE / "remote_floor.py"), "--bodies", str(folder), "--http-port"]
    return (
        Server("floor", "floor", (), http_port, grpc_port, [*cmd, str(http_port), "--grpc-port", str(grpc_port)], tmp / "floor.log"),
        Server("floor one-write", "floor", (), one_write_port, 0, [*cmd, str(one_write_port), "--one-write"],
               tmp / "floor-one-write.log"),
    )  # fmt: skip


# --- clients ------------------------------------------------------------------


_GRPC_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


class FloorClients:
    """The bare clients: a grpcio channel moving bytes (when the server has gRPC), and an http.client
    keep-alive connection."""

    def __init__(self, server: Server) -> None:
        import grpc

        self._channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=_GRPC_OPTIONS) if server.grpc_port else None
        self._conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
        self.reconnect()

    def reconnect(self) -> None:
        """A new REST connection: uvicorn closes one left idle for 5 s while the other clients run."""
        self._conn.close()
        self._conn.connect()
        # As urllib3 (requests) does: http.client writes the head and the body apart, and Nagle's
        # algorithm must not hold the body back for the head's ACK.
        self._conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def grpc_call(self, case: str, wire: Wire) -> Callable[[], Any]:
        assert self._channel is not None
        try:  # a registered method skips the per-call lookup by name (grpcio >= 1.62), as generated stubs do
            stub = self._channel.unary_unary(f"/floor.Echo/{case}", _registered_method=True)
        except TypeError:
            stub = self._channel.unary_unary(f"/floor.Echo/{case}")
        request = wire.grpc_request
        if stub(request, timeout=60) != wire.grpc_response:
            raise RuntimeError(f"floor: gRPC {case} did not answer the stored response")
        return lambda: stub(request)

    def rest_timer(self, case: str, wire: Wire) -> Callable[[int, int], list[float]]:
        conn, path, body, headers = self._conn, f"/floor/{case}", wire.rest_request, _rest_headers(wire.rest_request_header)

        def call() -> bytes:
            conn.request("POST", path, body, headers)
            return conn.getresponse().read()

        if call() != wire.rest_response:
            raise RuntimeError(f"floor: REST {case} did not answer the stored response")

        def run(warmup: int, calls: int) -> list[float]:
            self.reconnect()
            return timed(call, warmup, calls)

        return run

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._conn.close()


class TritonWorker:
    """remote_triton.py in a subprocess on this process's core, driven one JSON line at a time."""

    def __init__(self, server: Server, models: dict[str, Model], tmp: Path) -> None:
        cases: dict[str, Any] = {}
        arrays: dict[str, np.ndarray] = {}
        for case, m in models.items():
            cases[case] = {"model": m.name, "inputs": [[n, _datatype(a)] for n, a in m.inputs.items()], "outputs": [m.output]}
            arrays.update({f"{case}/{n}": a for n, a in m.inputs.items()})
            arrays[f"{case}/{m.output}/expected"] = m.expected
        (tmp / "triton-cases.json").write_text(json.dumps(cases))
        np.savez(tmp / "triton-arrays.npz", **arrays)  # type: ignore[arg-type]
        cmd = [sys.executable, str(HERE / "remote_triton.py"), "--grpc", f"127.0.0.1:{server.grpc_port}",
               "--http", f"127.0.0.1:{server.http_port}", "--cases", str(tmp / "triton-cases.json"),
               "--arrays", str(tmp / "triton-arrays.npz")]  # fmt: skip
        self.log = tmp / "triton.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        self._read(120)

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise RuntimeError(f"tritonclient worker gave no answer in {timeout:.0f} s:\n{self._tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tritonclient worker exited ({self.proc.poll()}):\n{self._tail()}")
        reply: dict[str, Any] = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"tritonclient worker: {reply['error']}")
        return reply

    def _tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])

    def run(self, protocol: str, case: str, warmup: int, calls: int) -> list[float]:
        assert self.proc.stdin is not None
        order = {"protocol": "grpc" if protocol == "grpc" else "http", "case": case, "warmup": warmup, "calls": calls}
        self.proc.stdin.write(json.dumps(order) + "\n")
        self.proc.stdin.flush()
        seconds: list[float] = self._read(300)["seconds"]
        return seconds

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _datatype(array: np.ndarray) -> str:
    return {"float32": "FP32", "uint8": "UINT8"}[str(array.dtype)]


def remote_models(server: Server, models: dict[str, Model], stack: ExitStack) -> tuple[dict[tuple[str, str], Any], str | None]:
    """Our remote models by (protocol, case), each checked once; empty with the reason when they cannot load."""
    out: dict[tuple[str, str], Any] = {}
    urls = {"grpc": f"grpc://127.0.0.1:{server.grpc_port}", "rest": f"http://127.0.0.1:{server.http_port}"}
    for protocol, base in urls.items():
        for case, m in models.items():
            url = f"{base}/{m.name}"
            try:
                model = neuropod.load_neuropod(url)
            except Exception as e:  # noqa: BLE001 (the client missing or broken: the rest is still measured)
                return {}, f"load_neuropod({url!r}) failed: {type(e).__name__}: {e}"
            stack.callback(model.close)
            _check(f"neuropod remote {url}", m, model.infer(m.inputs))
            out[protocol, case] = model
    return out, None


# --- timing -------------------------------------------------------------------


def timed(fn: Callable[[], Any], warmup: int, calls: int) -> list[float]:
    """Seconds taken by each of ``calls`` calls of ``fn``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    clock, out = time.perf_counter, []
    for _ in range(calls):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def _timer(fn: Callable[[], Any]) -> Callable[[int, int], list[float]]:
    return partial(timed, fn)


@dataclass
class Row:
    """One client on one case: each round's p50 and p99 (seconds)."""

    case: str
    label: str
    protocol: str | None  # None: in-process rows shown under both protocols
    run: Callable[[int, int], list[float]] = field(repr=False)
    rounds: list[tuple[float, float]] = field(default_factory=list)

    def measure(self, warmup: int, calls: int) -> None:
        seconds = np.asarray(self.run(warmup, calls))
        self.rounds.append((float(np.percentile(seconds, 50)), float(np.percentile(seconds, 99))))

    @property
    def p50(self) -> float:
        return statistics.median(r[0] for r in self.rounds)

    @property
    def p99(self) -> float:
        return statistics.median(r[1] for r in self.rounds)


def per_round(a: Row, b: Row, fn: Callable[[float, float], float]) -> float:
    """The median over rounds of ``fn(a's p50, b's p50)``: both were measured seconds apart in each round."""
    return statistics.median(fn(x[0], y[0]) for x, y in zip(a.rounds, b.rounds))


# --- the report ---------------------------------------------------------------


def report(rows: list[Row], models: dict[str, Model], wires: dict[str, Wire], missing: str | None) -> list[dict[str, Any]]:
    def get(case: str, label: str) -> Row | None:
        return next((r for r in rows if (r.case, r.label) == (case, label)), None)

    targets: list[dict[str, Any]] = []
    floor_checks: list[dict[str, Any]] = []
    triton_checks: list[dict[str, Any]] = []
    copy_checks: list[dict[str, Any]] = []
    for protocol in ("grpc", "rest"):
        for case in CASES:
            m, w = models[case], wires[case]
            sizes = (len(w.grpc_request), len(w.grpc_response)) if protocol == "grpc" else (len(w.rest_request), len(w.rest_response))
            print(f"\n{PROTOCOL_TITLES[protocol]} | {case}: {describe(m)} | request {_size(sizes[0])}, response {_size(sizes[1])}")
            print(f"  {'client':<42} {'p50 us':>9} {'p99 us':>9}")
            shown = [get(case, IN_PROCESS), get(case, OURS[protocol]), get(case, TRITON[protocol]), get(case, FLOOR[protocol])]
            if protocol == "rest":
                shown.append(get(case, FLOOR_ONE_WRITE))
            if case in (IMAGE, IMAGE_IN):
                shown.append(get(case, COPY))
            for r in shown:
                if r is not None:
                    print(f"  {r.label:<42} {r.p50 * 1e6:9.1f} {r.p99 * 1e6:9.1f}")
            floor_label = FLOOR[protocol] if protocol == "grpc" else REST_FLOOR
            ours, triton, floor, inproc = (get(case, x) for x in (OURS[protocol], TRITON[protocol], floor_label, IN_PROCESS))
            assert triton is not None and floor is not None and inproc is not None
            if protocol == "rest":
                faster = [FLOOR_ONE_WRITE if b < a else "stock" for a, b in zip(
                    get(case, FLOOR["rest"]).rounds, get(case, FLOOR_ONE_WRITE).rounds)]  # type: ignore[union-attr]
                print(f"  REST floor below: the faster of the two floors in each round (one-write in {faster.count(FLOOR_ONE_WRITE)}"
                      f" of {len(faster)} rounds)")  # fmt: skip
            if ours is None:
                print(f"  {OURS[protocol]}: not measured ({missing})")
                continue
            added = per_round(ours, floor, lambda a, b: a - b)
            # What serving adds beyond the transport and the model's own run (the floor runs no model).
            beyond = statistics.median(o[0] - f[0] - i[0] for o, f, i in zip(ours.rounds, floor.rounds, inproc.rounds))
            ratio = per_round(ours, triton, lambda a, b: a / b)
            where = f"{protocol} {case}"
            print(f"  remote - floor: {added * 1e6:+.1f} us   remote - floor - in-process: {beyond * 1e6:+.1f} us   "
                  f"remote / tritonclient: {ratio:.3f}   tritonclient - floor: "
                  f"{per_round(triton, floor, lambda a, b: a - b) * 1e6:+.1f} us   (p50s)")  # fmt: skip
            if case in (TINY, MANY):
                floor_checks.append({"cell": where, "remote_minus_floor_us": added * 1e6, "beyond_model_us": beyond * 1e6,
                                     "pass": beyond * 1e6 <= FLOOR_MARGIN_US})  # fmt: skip
            triton_checks.append({"cell": where, "ratio": ratio, "pass": ratio <= 1.0})
            if case in (IMAGE, IMAGE_IN):
                copy = get(case, COPY)
                assert copy is not None
                moved = (sum(a.nbytes for a in m.inputs.values()) + m.expected.nbytes) / MB
                image_mb = m.inputs["image"].nbytes / MB
                copies = statistics.median(
                    (o[0] - f[0] - i[0]) / c[0] for o, f, i, c in zip(ours.rounds, floor.rounds, inproc.rounds, copy.rounds)
                )  # fmt: skip
                print(f"  tensor bytes moved: {moved:.2f} MB   remote - floor: {added / moved * 1e6:.1f} us/MB   "
                      f"remote - floor - in-process: {beyond / moved * 1e6:.1f} us/MB = {copies:.2f} copies of the image "
                      f"(one copy: {copy.p50 * 1e6:.0f} us, {copy.p50 / image_mb * 1e6:.1f} us/MB)")  # fmt: skip
                copy_checks.append({"cell": where, "mb_moved": moved, "remote_minus_floor_us_per_mb": added / moved * 1e6,
                                    "beyond_model_us": beyond * 1e6, "beyond_model_us_per_mb": beyond / moved * 1e6,
                                    "copy_us": copy.p50 * 1e6, "copies": copies, "pass": copies <= MAX_IMAGE_COPIES})  # fmt: skip

    print()
    if missing is not None:
        print(f"----  our remote model was not measured: {missing}")
        return targets
    for title, checks, key, fmt in (
        (f"remote p50 - floor p50 - in-process p50 <= {FLOOR_MARGIN_US:.0f} us (tiny, small_inputs_100; gRPC, REST)",
         floor_checks, "beyond_model_us", "{:+.1f} us"),
        ("remote p50 <= tritonclient p50 (every case; gRPC, REST)", triton_checks, "ratio", "{:.3f}x"),
        (f"image copied at most once on each side (<= {MAX_IMAGE_COPIES:.0f} copies beyond floor and model run)",
         copy_checks, "copies", "{:.2f} copies"),
    ):  # fmt: skip
        ok = all(c["pass"] for c in checks)
        targets.append({"target": title, "pass": ok, "cells": checks})
        cells = ", ".join(f"{c['cell']} {fmt.format(c[key])}{'' if c['pass'] else ' MISS'}" for c in checks)
        print(f"{'PASS' if ok else 'MISS'}  {title}: {cells}")
    return targets


def _size(n: int) -> str:
    return f"{n:,} B" if n < 100_000 else f"{n / MB:.2f} MB"


def write_json(path: Path, rows: list[Row], targets: list[dict[str, Any]], args: argparse.Namespace, missing: str | None) -> None:
    data = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "server_core": SERVER_CORE, "client_core": CLIENT_CORE, "pinned": shutil.which("taskset") is not None},
        "settings": {"rounds": args.rounds, "calls": args.calls, "image_calls": args.image_calls, "warmup": args.warmup},
        "remote_not_measured": missing,
        "rows": [{"case": r.case, "client": r.label, "protocol": r.protocol, "p50_us": r.p50 * 1e6, "p99_us": r.p99 * 1e6,
                  "rounds_us": [[a * 1e6, b * 1e6] for a, b in r.rounds]} for r in rows],
        "targets": targets,
    }  # fmt: skip
    path.write_text(json.dumps(data, indent=1))
    print(f"results written to {path}")


# --- main ---------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds; tables show medians over them (default 5)")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per client and round, small cases (default 2000)")
    parser.add_argument("--image-calls", type=int, default=100, help="the same for the image cases (default 100)")
    parser.add_argument("--warmup", type=float, default=0.1, help="untimed calls before each measurement, as a share of the timed ones (default 0.1)")
    parser.add_argument("--json", type=Path, help="write every figure here as JSON")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: 2 rounds of 200 calls (20 for the images)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed (default: report only)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.calls, args.image_calls = 2, 200, 20
    pinned = shutil.which("taskset") is not None and len(os.sched_getaffinity(0)) >= 2
    if pinned:
        os.sched_setaffinity(0, {CLIENT_CORE})  # every client here and in the tritonclient worker
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        os.environ.setdefault("NEUROPOD_CACHE_DIR", str(tmp / "cache"))
        os.environ.setdefault("NEUROPOD_HOME", str(tmp / "home"))
        models = build_cases(tmp)
        server = neuropod_server("neuropod serve", list(models.values()), tmp, grpc=True)
        stack.callback(server.stop)
        start(server)
        server.wait_ready()
        wires = {case: capture(server, m) for case, m in models.items()}
        floor, one_write = floor_servers(wires, tmp)
        for s in (floor, one_write):
            stack.callback(s.stop)
            start(s)
        for s in (floor, one_write):
            s.wait_ready()
        print(f"neuropod serve and the floor {'pinned to core 0, clients to core 1 (taskset)' if pinned else 'NOT pinned (no taskset or one core)'}; "
              f"{args.rounds} rounds x {args.calls} calls ({args.image_calls} for the images) after {args.warmup:.0%} as many untimed; "
              "medians over rounds shown")  # fmt: skip

        floors, one_write_floor = FloorClients(floor), FloorClients(one_write)
        stack.callback(floors.close)
        stack.callback(one_write_floor.close)
        triton = TritonWorker(server, models, tmp)
        stack.callback(triton.close)
        remote, missing = remote_models(server, models, stack)

        rows: list[Row] = []
        for case, m in models.items():
            local = neuropod.load_neuropod(m.package)
            _check(f"in-process {case}", m, local.infer(m.inputs))
            rows.append(Row(case, IN_PROCESS, None, _timer(partial(local.infer, m.inputs))))
            if case in (IMAGE, IMAGE_IN):
                rows.append(Row(case, COPY, None, _timer(m.inputs["image"].copy)))
            for protocol in ("grpc", "rest"):
                if (protocol, case) in remote:
                    rows.append(Row(case, OURS[protocol], protocol, _timer(partial(remote[protocol, case].infer, m.inputs))))
                rows.append(Row(case, TRITON[protocol], protocol, partial(triton.run, protocol, case)))
                if protocol == "grpc":
                    rows.append(Row(case, FLOOR[protocol], protocol, _timer(floors.grpc_call(case, wires[case]))))
                else:
                    rows.append(Row(case, FLOOR[protocol], protocol, floors.rest_timer(case, wires[case])))
                    rows.append(Row(case, FLOOR_ONE_WRITE, protocol, one_write_floor.rest_timer(case, wires[case])))

        if pinned:
            for s in (server, floor, one_write):
                assert s.proc is not None
                pin_threads(s.proc.pid, SERVER_CORE)
            for pid in (os.getpid(), triton.proc.pid):
                pin_threads(pid, CLIENT_CORE)
            print("every thread of the servers re-pinned to core 0 and of the clients to core 1 "
                  "(onnxruntime pins its intra-op threads itself)")  # fmt: skip
        started = time.monotonic()
        for r in range(args.rounds):
            for case in CASES:
                group = [row for row in rows if row.case == case]
                k = r % len(group)
                calls = args.image_calls if case in (IMAGE, IMAGE_IN) else args.calls
                for row in group[k:] + group[:k]:
                    row.measure(max(1, round(calls * args.warmup)), calls)
            print(f"round {r + 1}/{args.rounds} done ({time.monotonic() - started:.0f} s)", flush=True)
        for case in CASES:
            a, b = (next(x for x in rows if (x.case, x.label) == (case, label)) for label in (FLOOR["rest"], FLOOR_ONE_WRITE))
            faster = Row(case, REST_FLOOR, "rest", a.run)
            faster.rounds = [min(x, y) for x, y in zip(a.rounds, b.rounds)]  # by p50
            rows.append(faster)
        targets = report(rows, models, wires, missing)
        if args.json:
            write_json(args.json, rows, targets, args, missing)
        failed = missing is not None or not all(t["pass"] for t in targets)
        return 1 if args.strict and failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench_remote: interrupted; every server was stopped", file=sys.stderr)
        sys.exit(130)
    except RuntimeError as e:  # a server or client failed to start or answered wrongly
        print(f"bench_remote: {e}", file=sys.stderr)
        sys.exit(2)
