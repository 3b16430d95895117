"""A backend's packages served: ``neuropod serve`` in a subprocess, and one Open Inference Protocol call."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

# Open Inference Protocol datatypes of the numeric spec dtypes (the JSON form sends numbers as numbers).
_OIP_DATATYPES = {
    "float16": "FP16", "float32": "FP32", "float64": "FP64", "int8": "INT8", "int16": "INT16", "int32": "INT32",
    "int64": "INT64", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64", "bool": "BOOL",
}  # fmt: skip


class Served(NamedTuple):
    """Where :func:`served` serves: ``http`` is the REST base URL, ``grpc`` the gRPC ``host:port``."""

    http: str
    grpc: str


@contextlib.contextmanager
def served(models: Path, *, timeout: float = 60.0, options: Sequence[str] = ()) -> Iterator[Served]:
    """``neuropod serve models [options...]`` in a subprocess on free ports, until the block ends.

    For a backend's tests that its packages serve: the server is the real
    command (``neuropod-serving`` must be installed), stopped with SIGTERM
    and waited for at the end. Drive it with :func:`oip_infer`, or load
    ``f"grpc://{s.grpc}/<model>"`` / ``f"{s.http}/<model>"`` as remote models.
    """

    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "neuropod", "serve", str(models), "--http-port", str(ports[0]),
           "--grpc-port", str(ports[1]), "--metrics-port", "0", "--quiet", *options]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{ports[0]}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"neuropod serve exited with {proc.returncode} before it was ready:\n{out}\n{err}")
            try:
                with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"neuropod serve was not ready within {timeout:g} s")
            time.sleep(0.1)
        yield Served(base, f"127.0.0.1:{ports[1]}")
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def oip_infer(base: str, model: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One Open Inference Protocol REST call in its plain JSON form (numeric tensors), outputs as arrays.

    Written against the protocol, not neuropod's client, so a test that uses
    it checks what any OIP client (Triton's, KServe's) would get.
    """

    body = {"inputs": [
        {"name": name, "datatype": _OIP_DATATYPES[str(a.dtype)], "shape": list(a.shape), "data": a.ravel().tolist()}
        for name, a in inputs.items()
    ]}  # fmt: skip
    request = urllib.request.Request(
        f"{base}/v2/models/{model}/infer", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        reply = json.loads(r.read())
    dtypes = {v: k for k, v in _OIP_DATATYPES.items()}
    return {o["name"]: np.array(o["data"], dtypes[o["datatype"]]).reshape(o["shape"]) for o in reply["outputs"]}
