"""What the REST and process tests share: real ONNX packages, private caches, a server in a thread."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADDER_IN = [("x", "float32", ["batch_size", 2]), ("y", "float32", ["batch_size", 2])]
ADDER_OUT = [("out", "float32", ["batch_size", 2]), ("doubled", "float32", ["batch_size", 2])]
ECHO_IN = [("n", "int64", ["batch_size"]), ("s", "string", ["batch_size"])]
ECHO_OUT = [("n1", "int64", ["batch_size"]), ("s_out", "string", ["batch_size"])]


def spec(entries: list[tuple[str, str, list[Any]]]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": t, "shape": s} for n, t, s in entries]


def onnx_package(dest: Path, name: str, nodes: list[Any], inputs: Any, outputs: Any,
                 inits: list[Any] = (), **kw: Any) -> Path:  # type: ignore[assignment]  # fmt: skip
    """Package a real ONNX graph (IR 8, opset 17) of ``nodes`` over (name, dtype, shape) triples."""
    import onnx
    from onnx import TensorProto, helper

    from neuropod.packagers import create_onnx_neuropod

    types = {
        "float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE,
        "int8": TensorProto.INT8, "int16": TensorProto.INT16, "int32": TensorProto.INT32, "int64": TensorProto.INT64,
        "uint8": TensorProto.UINT8, "uint16": TensorProto.UINT16, "uint32": TensorProto.UINT32,
        "uint64": TensorProto.UINT64, "bool": TensorProto.BOOL, "string": TensorProto.STRING,
    }  # fmt: skip

    def info(n: str, t: str, s: list[Any]) -> Any:
        return helper.make_tensor_value_info(n, types[t], s)

    graph = helper.make_graph(nodes, "g", [info(*i) for i in inputs], [info(*o) for o in outputs], initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path: Path = create_onnx_neuropod(
        dest, name, input_spec=spec(inputs), output_spec=spec(outputs), onnx_model=model, **kw
    )
    return path


def adder_and_echo(models: Path, *, echo_as_zip: bool) -> None:
    """``adder`` (out = x + y, doubled = 2 * out, FP32) and ``echo`` (n1 = n + 1, s_out = s, INT64 and BYTES)."""
    from onnx import TensorProto, helper

    onnx_package(models / "adder", "adder",
                 [helper.make_node("Add", ["x", "y"], ["out"]), helper.make_node("Mul", ["out", "two"], ["doubled"])],
                 ADDER_IN, ADDER_OUT, [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])  # fmt: skip
    onnx_package(models / ("echo.zip" if echo_as_zip else "echo"), "echo",
                 [helper.make_node("Add", ["n", "one"], ["n1"]), helper.make_node("Identity", ["s"], ["s_out"])],
                 ECHO_IN, ECHO_OUT, [helper.make_tensor("one", TensorProto.INT64, [], [1])],
                 package_as_zip=echo_as_zip)  # fmt: skip


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_below_ephemeral() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now), below the kernel's ephemeral range:
    for a server started only after other processes start (Ray's), whose outgoing connections
    take ephemeral ports and could take one :func:`free_port` returned before it is bound."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(10_000, max(low, 10_001)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


@dataclass
class ExampleServer:
    """A ``neuropod serve`` that Triton's example clients run against: how its models were built
    (``via``), its URLs, and JSON requests to its REST API."""

    via: str
    http: str  # http://127.0.0.1:PORT
    grpc: str  # 127.0.0.1:PORT

    def post(self, path: str, body: dict[str, object]) -> tuple[int, str]:
        request = urllib.request.Request(
            f"{self.http}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.http}{path}", timeout=30) as r:
            return json.loads(r.read())


@contextlib.contextmanager
def private_caches(root: Path) -> Iterator[None]:
    """A package cache and XDG_CACHE_HOME (onnxruntime's telemetry files) under ``root``, for a module's fixtures."""
    old = {k: os.environ.get(k) for k in ("NEUROPOD_CACHE_DIR", "XDG_CACHE_HOME")}
    os.environ["NEUROPOD_CACHE_DIR"] = str(root / "cache")
    os.environ["XDG_CACHE_HOME"] = str(root / "xdg")
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def serve_in_thread(app: Any, *, log_level: str = "warning") -> Iterator[int]:
    """A real uvicorn server for ``app`` on a free port, in a background thread; yields the port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        yield sock.getsockname()[1]
    finally:
        srv.should_exit = True
        thread.join(10)
        sock.close()


def python_package(dest: Path, name: str, code: str, *, batched: bool = True) -> Path:
    """A Python model package: ``x`` float32 [batch_size, 2] -> ``y`` (same shape); ``code`` defines get_model."""
    from neuropod.packagers import create_python_neuropod

    src = dest.parent / f"{name}_code"
    src.mkdir(parents=True)
    (src / f"{name}_model.py").write_text(code)
    shape: list[Any] = ["batch_size", 2] if batched else [None, 2]
    path: Path = create_python_neuropod(
        dest, name, [], [{"python_root": src, "dirs_to_package": [""]}], f"{name}_model", "get_model",
        [{"name": "x", "dtype": "float32", "shape": shape}], [{"name": "y", "dtype": "float32", "shape": shape}],
    )  # fmt: skip
    return path


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid``, through /proc/<pid>/task/*/children."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                kids = {int(c) for c in task.read_text().split()}
            except OSError:
                continue
            todo += sorted(kids - found)
            found |= kids
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
