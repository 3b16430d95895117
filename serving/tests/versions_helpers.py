"""What the model-version tests share: a Python model per version (``y = x * K``, sleeping
``x[0, 1]`` seconds first), a server of a repository in a thread or the command in its own
process, and polling waits.

Expected answers are ``x * K`` computed with numpy; the version that answered is the
response's ``model_version``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from conftest import python_package, serve_in_thread

CODE = """
import time

K = {k}

def get_model(data_root):
    def model(x):
        time.sleep(float(x.flat[1]))
        return {{"y": x * K}}
    return model
"""


def build_scalers(stage: Path, factors: tuple[int, ...] = (1, 2, 3)) -> dict[int, Path]:
    """A package named ``scaler`` for each factor K: ``stage/kK/scaler`` (a directory)."""
    built = {}
    for k in factors:
        built[k] = python_package(stage / f"k{k}" / "scaler", "scaler", CODE.format(k=k))
    return built


def zip_of(directory: Path, dest: Path) -> Path:
    """``directory`` (a package) as a zip at ``dest``."""
    made = shutil.make_archive(str(dest.with_suffix("")), "zip", directory)
    Path(made).rename(dest)
    return dest


def place(source: Path, dest: Path) -> Path:
    """Copy ``source`` (file or directory) to ``dest`` all at once: copied beside, then renamed,
    so a poll never sees half of it (as a deployment tool that writes then renames does)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp"
    if source.is_dir():
        shutil.copytree(source, tmp)
    else:
        shutil.copy2(source, tmp)
    tmp.rename(dest)
    return dest


@contextlib.contextmanager
def serving(paths: list[Any], *, policy: str | None = None, poll: float | None = None,
            storage_options: Any = None) -> Iterator[tuple[Any, Any]]:  # fmt: skip
    """(engine, httpx client) of a real server of ``paths`` in a thread."""
    import httpx

    from neuropod_serving.server import Engine, ModelRegistry, create_app
    from neuropod_serving.server.served_versions import VersionPolicy

    registry = ModelRegistry.load(paths, policy=VersionPolicy.parse(policy) if policy else None,
                                  storage_options=storage_options)  # fmt: skip
    engine = Engine(registry)
    try:
        if poll is not None:
            engine.start_polling(poll)
        with serve_in_thread(create_app(engine)) as port, httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=60
        ) as http:
            yield engine, http
    finally:
        engine.close()


@dataclasses.dataclass
class Command:
    http: str  #: ``http://127.0.0.1:<port>``
    output: str = ""  #: its stdout and stderr, once it ended


@contextlib.contextmanager
def serve_command(args: list[str], port: int, poll: float = 0.1) -> Iterator[Command]:
    """``neuropod serve <args>`` (REST on ``port``, no gRPC nor metrics) in its own process, once its
    REST health says ready; terminated when the ``with`` ends, its output then in ``output``."""
    import httpx

    proc = subprocess.Popen(
        [sys.executable, "-m", "neuropod", "serve", *args, "--http-port", str(port), "--grpc-port", "0",
         "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    command = Command(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"{command.http}/v2/health/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(poll)
        yield command
    finally:
        proc.terminate()
        command.output = proc.communicate(timeout=30)[0]


def infer(http: Any, model: str = "scaler", version: str | None = None, seconds: float = 0.0) -> Any:
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, seconds]}]}
    return http.post(path, json=body)


def answer(http: Any, model: str = "scaler", version: str | None = None, seconds: float = 0.0) -> tuple[str, list[float]]:
    """(the version that answered, its ``y``) of one request; asserts it succeeded."""
    r = infer(http, model, version, seconds)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["model_version"], body["outputs"][0]["data"]


def expected(k: int, seconds: float = 0.0) -> list[float]:
    return (np.array([1.0, seconds], np.float32) * k).tolist()


def index(http: Any) -> dict[tuple[str, str], dict[str, Any]]:
    r = http.post("/v2/repository/index", json={})
    assert r.status_code == 200, r.text
    return {(e["name"], e["version"]): e for e in r.json()}


def wait_for(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def in_background(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``call`` on a thread; its result lands in the list."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out
