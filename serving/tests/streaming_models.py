"""The decoupled test model the gRPC, remote and Ray streaming tests share (not a test module).

``repeat`` has the interface of Triton's ``repeat_int32``: inputs ``IN`` int32 [n], ``DELAY``
uint32 [n] (microseconds before each response), ``WAIT`` uint32 [1] (microseconds after the
last); one response per element of ``IN``: ``OUT`` int32 [1] (the element) and ``IDX`` uint32 [1]
(its index). A negative element fails the model there. Request parameters steer it: ``gate`` (a
path: response i > 0 waits until ``<gate>.<i>`` exists, so a test proves responses come as they
are made), ``mark`` (a path its generator's ``finally`` appends ``closed`` to, so a test sees the
server stop it). Packaged with a ``closed_log``, its generator's ``finally`` also appends ``IN[0]``
(or -1 for an empty request) as a line to that file, for clients that send no parameters.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from neuropod.packagers import create_python_neuropod

REPEAT = """
import os, time
import numpy as np


def get_model(data_root):
    def run(IN, DELAY, WAIT, parameters=None):
        p = parameters or {}
        try:
            for i, v in enumerate(IN):
                if i and p.get("gate"):
                    deadline = time.monotonic() + 20
                    while not os.path.exists(f"{p['gate']}.{i}") and time.monotonic() < deadline:
                        time.sleep(0.002)
                time.sleep(int(DELAY[i]) / 1e6)
                if v < 0:
                    raise ValueError(f"negative value {int(v)} at {i}")
                yield {"OUT": np.array([v], np.int32), "IDX": np.array([i], np.uint32)}
            time.sleep(int(WAIT[0]) / 1e6)
        finally:
            if p.get("mark"):
                with open(p["mark"], "a") as f:
                    f.write("closed\\n")
            if CLOSED_LOG:
                with open(CLOSED_LOG, "a") as f:
                    f.write(f"{int(IN[0]) if len(IN) else -1}\\n")
    return run
"""


def repeat_package(dest: Path, name: str = "repeat", closed_log: Path | None = None) -> Path:
    src = dest.parent / f"{name}_code"
    (src / "repeat_model").mkdir(parents=True)
    log = None if closed_log is None else str(closed_log)
    (src / "repeat_model" / "__init__.py").write_text(f"{REPEAT}\nCLOSED_LOG = {log!r}\n")
    path: Path = create_python_neuropod(
        dest, name, [], [{"python_root": src, "dirs_to_package": ["repeat_model"]}], "repeat_model", "get_model",
        [{"name": "IN", "dtype": "int32", "shape": ("n",)}, {"name": "DELAY", "dtype": "uint32", "shape": ("n",)},
         {"name": "WAIT", "dtype": "uint32", "shape": (1,)}],
        [{"name": "OUT", "dtype": "int32", "shape": (1,)}, {"name": "IDX", "dtype": "uint32", "shape": (1,)}],
        decoupled=True,
    )  # fmt: skip
    return path


def repeat_inputs(values: list[int], delay_us: int = 0) -> dict[str, np.ndarray]:
    return {
        "IN": np.array(values, np.int32),
        "DELAY": np.full(len(values), delay_us, np.uint32),
        "WAIT": np.zeros(1, np.uint32),
    }


def wait_for(path: Path, text: str, seconds: float = 3.0) -> bool:
    """Whether ``path`` holds ``text`` within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.01)
    return False
