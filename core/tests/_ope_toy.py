"""A small backend installed as a real distribution, so that OPE worker processes find it
through its entry point like any plugin. Shared by test_ope.py and test_reliability_ope.py."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import neuropod
from neuropod import plugins
from neuropod.package import parse_config, write_package

TOY = '''
"""A toy backend for OPE tests: numpy code chosen by the package's 0/data/op.json."""
import ctypes, json, time
import numpy as np
from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps

@hookimpl
def supported_versions():
    return [Backend("toyope", "1.0.0", "toyope-framework")]

@hookimpl
def device_caps(backend):
    return DeviceCaps() if backend.platform == "toyope" else None

@hookimpl
def load_model(package, backend, device, options):
    if backend.platform != "toyope":
        return None
    op = json.loads((package.data_dir / "op.json").read_text())["op"]
    if op == "flaky" and (package.root.parent / "fail-load").exists():
        raise RuntimeError("toy framework cannot load today")
    return op

@hookimpl
def infer(model, inputs, requested_outputs):
    if model in ("add", "flaky"):
        out = {"out": inputs["x"] + inputs["y"]}
    elif model == "sub":
        out = {"out": inputs["x"] - inputs["y"]}
    elif model == "upper":
        out = {"out": np.char.upper(inputs["x"].astype(str))}
    elif model == "echo":
        out = {"out": inputs["x"]}
    elif model == "nul_strings":
        out = {"out": np.array(["a\\x00", "\\x00", "b\\x00c", "", "\\u00e9\\x00"], dtype=object)}
    elif model == "raise":
        raise RuntimeError("toy framework exploded")
    elif model == "segfault":
        ctypes.string_at(0)
    elif model == "sleep":
        time.sleep(30)
    elif model == "sleep_if":
        if inputs["x"].any():
            time.sleep(30)
        out = {"out": inputs["x"]}
    elif model == "sum":
        out = {"out": sum(inputs.values())}
    elif model == "sum100":
        out = {"out": sum(inputs[f"in{i}"] for i in range(100))}
    elif model == "fanout":
        x = inputs["x"]
        out = {f"out{i}": x + i for i in range(int(x.flat[0]))}
    return {k: v for k, v in out.items() if requested_outputs is None or k in requested_outputs}
'''


def install_toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Install the toy backend as a distribution on PYTHONPATH, for this process and its workers."""
    site = tmp_path / "site"
    info = site / "neuropod_toyope-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: neuropod-toyope\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[neuropod.backends]\ntoyope = np_toyope\n")
    (site / "np_toyope.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("NEUROPOD_PLUGINS", "toyope")
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    plugins.reset()
    yield tmp_path
    plugins.reset()
    sys.modules.pop("np_toyope", None)


def package(tmp_path: Path, op: str, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]], name: str | None = None) -> Path:
    config = parse_config(
        {"name": name or op, "platform": "toyope", "input_spec": inputs, "output_spec": outputs}, "toy config"
    )
    return write_package(tmp_path / f"{name or op}.neuropod", config, {"0/data/op.json": json.dumps({"op": op}).encode()})


XY = [{"name": "x", "dtype": "float32", "shape": ["batch", 2]}, {"name": "y", "dtype": "float32", "shape": ["batch", 2]}]
OUT = [{"name": "out", "dtype": "float32", "shape": ["batch", 2]}]
STRINGS = [{"name": "x", "dtype": "string", "shape": [None]}]
STRING_OUT = [{"name": "out", "dtype": "string", "shape": [None]}]


def adder(tmp_path: Path, **kwargs: Any) -> neuropod.NeuropodModel:
    path = tmp_path / "add.neuropod"
    if not path.exists():
        package(tmp_path, "add", XY, OUT)
    return neuropod.load_neuropod(path, use_ope=True, **kwargs)


def xy(batch: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((batch, 2)).astype(np.float32) for n in ("x", "y")}


def gone(pid: int, within: float = 5.0) -> bool:
    """Whether process ``pid`` has ended (reaping it if it is our zombie child) within ``within`` seconds."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie child still answers kill(pid, 0): reap it
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        if _zombie(pid):  # someone else's zombie (its parent has not reaped it yet) is gone as far as we care
            return True
        time.sleep(0.05)
    return False


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
