"""A decoupled model whose generator raises ``SystemExit`` or ``KeyboardInterrupt`` mid-stream: the
stream ends with an error at once (REST Server-Sent Events and gRPC ModelStreamInfer) and the
server keeps serving.

The model (``stopper``, a python package): ``HOW`` int32 [1] -> ``OUT`` int32 [1]. It yields
``OUT = 7`` first; then ``HOW`` 1 raises ``SystemExit(3)``, 2 raises ``KeyboardInterrupt``, 3
calls ``sys.exit("...")``, anything else yields ``OUT = 8`` and ends. The server is the real
``neuropod serve`` in a subprocess, so a stream that kills it fails the test.
"""

from __future__ import annotations

import json
import queue
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
pytest.importorskip("grpc")
httpx = pytest.importorskip("httpx")
pytest.importorskip("tritonclient.grpc")

import tritonclient.grpc as triton_grpc  # noqa: E402

from neuropod.packagers import create_python_neuropod  # noqa: E402
from neuropod.testing import served  # noqa: E402
from neuropod_serving.protocol.events import EventReader, event_error  # noqa: E402

from conftest import private_caches  # noqa: E402

STOPPER = """
import sys

import numpy as np


def get_model(data_root):
    def run(HOW):
        yield {"OUT": np.array([7], np.int32)}
        how = int(HOW[0])
        if how == 1:
            raise SystemExit(3)
        if how == 2:
            raise KeyboardInterrupt
        if how == 3:
            sys.exit("the model gave up")
        yield {"OUT": np.array([8], np.int32)}
    return run
"""

#: Seconds an error may take to arrive: "at once", far below the clients' timeouts (30 s).
PROMPT_S = 5.0

CASES = [(1, "SystemExit"), (2, "KeyboardInterrupt"), (3, "SystemExit")]


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-stream-exits-"))
    try:
        with private_caches(root):
            src = root / "stopper_code"
            src.mkdir()
            (src / "stopper_model.py").write_text(STOPPER)
            create_python_neuropod(
                root / "models" / "stopper", "stopper", [], [{"python_root": src, "dirs_to_package": [""]}],
                "stopper_model", "get_model", [{"name": "HOW", "dtype": "int32", "shape": [1]}],
                [{"name": "OUT", "dtype": "int32", "shape": [1]}], decoupled=True,
            )  # fmt: skip
            with served(root / "models") as where:
                yield where
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _sse(base: str, how: int) -> tuple[list[Any], float]:
    """The events of one infer_stream of ``stopper``, and the seconds they took."""
    body = {"inputs": [{"name": "HOW", "datatype": "INT32", "shape": [1], "data": [how]}]}
    began = time.monotonic()
    reader = EventReader()
    with httpx.stream("POST", f"{base}/v2/models/stopper/infer_stream", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(data) for chunk in r.iter_raw() for data in reader.feed(chunk)]
    assert not reader.incomplete, "the stream was cut mid-event"
    return events, time.monotonic() - began


@pytest.mark.parametrize(("how", "raised"), CASES)
def test_sse_stream_ends_with_an_error_event_and_the_server_serves_on(server: Any, how: int, raised: str) -> None:
    events, took = _sse(server.http, how)
    assert took < PROMPT_S, f"the stream took {took:.1f}s to end"
    assert len(events) == 2, events
    assert events[0]["outputs"][0]["data"] == [7]
    message = event_error(events[1])
    assert message is not None and "'stopper'" in message and raised in message, events[1]
    events, _ = _sse(server.http, 0)  # the server carries on
    assert [e["outputs"][0]["data"] for e in events] == [[7], [8]]


@pytest.mark.parametrize(("how", "raised"), CASES)
def test_grpc_stream_answers_an_error_and_the_server_serves_on(server: Any, how: int, raised: str) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = triton_grpc.InferenceServerClient(server.grpc)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        done = False
        try:
            for value in (how, 0):  # the second request on the same stream still runs
                inp = triton_grpc.InferInput("HOW", [1], "INT32")
                inp.set_data_from_numpy(np.array([value], np.int32))
                began = time.monotonic()
                client.async_stream_infer("stopper", [inp], request_id=f"r{value}")
                got = [answers.get(timeout=PROMPT_S) for _ in range(2)]
                assert time.monotonic() - began < PROMPT_S
                first, second = got
                assert first[1] is None and first[0].as_numpy("OUT").tolist() == [7]
                if value == how:
                    assert second[0] is None and second[1] is not None, second
                    message = second[1].message()
                    assert "'stopper'" in message and raised in message, message
                else:
                    assert second[1] is None and second[0].as_numpy("OUT").tolist() == [8], second
            done = True
        finally:
            client.stop_stream(cancel_requests=not done)  # a failed test cancels: nothing to wait for
        assert client.is_server_live() and client.is_model_ready("stopper")
    finally:
        client.close()
