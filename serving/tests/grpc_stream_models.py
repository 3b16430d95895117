"""Decoupled python packages for the gRPC streaming tests (test_grpc_streaming*.py), and a server over them.

- ``repeat_int32``: streaming_models.py's ``repeat`` (Triton's ``repeat_int32`` interface) under
  that name, packaged with a closed log: its generator's ``finally`` appends ``IN[0]`` (or -1 for
  an empty request) as a line to a file, so a test sees which streams' generators were closed.
- ``tricky``: ``K`` int32 [1], ``MODE`` int32 [1] -> ``OUT`` int32 [1]: ``K`` good responses
  (0, 1, ..., plus the request parameter ``offset`` when given), then with MODE 0 it raises ``RuntimeError("boom after K")``, with MODE 1 it
  yields a response whose ``OUT`` is float64 (off the spec).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neuropod.packagers import create_python_neuropod
from neuropod_serving.server import Engine, ModelRegistry
from neuropod_serving.server.grpc_server import GrpcServer, start_grpc_server
from neuropod_serving.server.metrics import ServerMetrics
from neuropod_serving.server.streams import StreamLimits
from streaming_models import repeat_package

from conftest import private_caches, python_package

TRICKY_CODE = """
import numpy as np

def get_model(data_root):
    def run(K, MODE, parameters=None):
        offset = int((parameters or {}).get("offset", 0))
        for i in range(int(K[0])):
            yield {"OUT": np.array([offset + i], np.int32)}
        if int(MODE[0]) == 0:
            raise RuntimeError(f"boom after {int(K[0])}")
        yield {"OUT": np.array([1.5])}
    return run
"""

ECHO_CODE = """
def get_model(data_root):
    return lambda x: {"y": x * 2}
"""


def _decoupled_package(dest: Path, name: str, code: str, inputs: list[Any], outputs: list[Any]) -> Path:
    src = dest.parent / f"{name}_code"
    src.mkdir(parents=True)
    (src / f"{name}_model.py").write_text(code)
    path: Path = create_python_neuropod(
        dest, name, [], [{"python_root": src, "dirs_to_package": [""]}], f"{name}_model", "get_model",
        inputs, outputs, decoupled=True,
    )  # fmt: skip
    return path


def tricky_package(dest: Path) -> Path:
    return _decoupled_package(
        dest, "tricky", TRICKY_CODE,
        [{"name": "K", "dtype": "int32", "shape": [1]}, {"name": "MODE", "dtype": "int32", "shape": [1]}],
        [{"name": "OUT", "dtype": "int32", "shape": [1]}],
    )  # fmt: skip


@dataclass
class StreamServer:
    engine: Engine
    metrics: ServerMetrics
    grpc: GrpcServer
    port: int
    #: Where repeat_int32's generators write IN[0] when they close.
    closed_log: Path

    def closed(self) -> list[int]:
        """IN[0] of each repeat_int32 stream whose generator has closed, in order."""
        if not self.closed_log.exists():
            return []
        return [int(line) for line in self.closed_log.read_text().split()]

    def wait_closed(self, value: int, within: float) -> float:
        """Seconds until a generator whose IN[0] is ``value`` closed (fails past ``within``)."""
        started = time.monotonic()
        while value not in self.closed():
            assert time.monotonic() - started < within, f"generator {value} not closed within {within}s"
            time.sleep(0.005)
        return time.monotonic() - started


@contextlib.contextmanager
def stream_server(max_open: int = 3) -> Iterator[StreamServer]:
    """A gRPC server (in this process, on 127.0.0.1) over repeat_int32, tricky and echo (an
    ordinary python model, x float32 [batch_size, 2] -> y = 2x), with ServerMetrics and at
    most ``max_open`` open streams per model."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-grpc-streams-"))
    with private_caches(root):
        closed_log = root / "closed.txt"
        paths = [
            repeat_package(root / "models" / "repeat_int32", "repeat_int32", closed_log),
            tricky_package(root / "models" / "tricky"),
            python_package(root / "models" / "echo", "echo", ECHO_CODE),
        ]
        metrics = ServerMetrics()
        engine = Engine(ModelRegistry.load(paths), metrics=metrics, stream_limits=StreamLimits(max_open=max_open))
        server, port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
        try:
            yield StreamServer(engine, metrics, server, port, closed_log)
        finally:
            server.stop(None)
            engine.close()
            shutil.rmtree(root, ignore_errors=True)


def repeat_inputs(client_module: Any, values: list[int], delays_us: list[int] | int = 0, wait_us: int = 0) -> list[Any]:
    """tritonclient InferInputs of a repeat_int32 request (``client_module``: tritonclient.grpc or .aio)."""
    n = len(values)
    delays = np.full(n, delays_us, np.uint32) if isinstance(delays_us, int) else np.array(delays_us, np.uint32)
    inputs = [
        client_module.InferInput("IN", [n], "INT32"),
        client_module.InferInput("DELAY", [n], "UINT32"),
        client_module.InferInput("WAIT", [1], "UINT32"),
    ]
    inputs[0].set_data_from_numpy(np.array(values, np.int32))
    inputs[1].set_data_from_numpy(delays)
    inputs[2].set_data_from_numpy(np.array([wait_us], np.uint32))
    return inputs
