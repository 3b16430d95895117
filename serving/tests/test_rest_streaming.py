"""Streaming over REST: ``infer_stream`` and ``generate_stream`` as Server-Sent Events, ``generate``,
against real Python packages served by uvicorn on a free port, read with httpx and raw sockets.

The decoupled models write what their generators did (each response yielded, the generator closed)
to a trace file named by a request parameter, so the tests see the model's side of a stream: that
a response arrives before the model made the last, that a client reading slowly holds the model
back, that one going away stops it.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from neuropod.spec import TensorSpec  # noqa: E402
from neuropod_serving.errors import ProtocolError  # noqa: E402
from neuropod_serving.protocol.events import EventReader, error_event, event_error  # noqa: E402
from neuropod_serving.protocol.generate import input_shape  # noqa: E402
from neuropod_serving.server import Engine, ModelRegistry, create_app  # noqa: E402
from neuropod_serving.server.metrics import ServerMetrics  # noqa: E402
from neuropod_serving.server.streams import StreamLimits  # noqa: E402

from conftest import private_caches, serve_in_thread  # noqa: E402

MAX_OPEN = 3
BUFFERED = 4
LIMIT = 64 * 1024  # request bytes

REPEAT = """
import time
import numpy as np

def get_model(data_root):
    def run(IN, DELAY, WAIT, parameters=None):
        p = parameters or {}
        trace = p.get("trace")
        blob = int(p.get("blob", 0))

        def note(line):
            if trace:
                with open(trace, "a") as f:
                    f.write(line + "\\n")

        try:
            for i, v in enumerate(IN.tolist()):
                time.sleep(int(DELAY[i]) / 1e6)
                if v < 0:
                    raise ValueError(f"IN[{i}] is negative")
                out = {"OUT": np.array([v, v] if v == 777 else [v], np.int32), "IDX": np.array([i], np.uint32)}
                if blob:
                    out["BLOB"] = np.array(["x" * blob], dtype=object)
                note(f"yield {i}")
                yield out
        finally:
            note("closed")
    return run
"""

TEXTGEN = """
import numpy as np

def get_model(data_root):
    def run(text_input, max_tokens, parameters=None):
        p = parameters or {}
        try:
            for word in str(text_input[0]).split()[: int(max_tokens[0])]:
                yield {"text_output": np.array([word.upper() if p.get("upper") else word], dtype=object)}
        finally:
            if p.get("trace"):
                with open(p["trace"], "a") as f:
                    f.write("closed\\n")
    return run
"""

ECHO = """
import numpy as np

def get_model(data_root):
    def run(text_input, scale):
        text = str(text_input[0])
        return {"text_output": np.array([text], dtype=object), "length": np.array([len(text)], np.int64),
                "scaled": (scale * 2).astype(np.float32)}
    return run
"""


def _package(models: Path, name: str, code: str, inputs: list[Any], outputs: list[Any], decoupled: bool) -> None:
    from neuropod.packagers import create_python_neuropod

    src = models.parent / f"{name}_code"
    src.mkdir(parents=True)
    (src / f"{name}_model.py").write_text(code)

    def spec(entries: list[Any]) -> list[dict[str, Any]]:
        return [{"name": n, "dtype": t, "shape": s} for n, t, s in entries]

    create_python_neuropod(
        models / name, name, [], [{"python_root": src, "dirs_to_package": [""]}], f"{name}_model", "get_model",
        spec(inputs), spec(outputs), decoupled=decoupled,
    )  # fmt: skip


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-rest-streaming-"))
    with private_caches(root):
        models = root / "models"
        _package(models, "repeat", REPEAT,
                 [("IN", "int32", ["n"]), ("DELAY", "uint32", ["n"]), ("WAIT", "uint32", [1])],
                 [("OUT", "int32", [1]), ("IDX", "uint32", [1]), ("BLOB", "string", [1])], decoupled=True)  # fmt: skip
        _package(models, "textgen", TEXTGEN, [("text_input", "string", [1]), ("max_tokens", "int32", [1])],
                 [("text_output", "string", [1])], decoupled=True)  # fmt: skip
        _package(models, "echo", ECHO, [("text_input", "string", [1]), ("scale", "float32", [3])],
                 [("text_output", "string", [1]), ("length", "int64", [1]), ("scaled", "float32", [3])],
                 decoupled=False)  # fmt: skip
        yield root
    shutil.rmtree(root, ignore_errors=True)


def _engine(root: Path) -> Engine:
    limits = StreamLimits(max_open=MAX_OPEN, buffered=BUFFERED)
    return Engine(ModelRegistry.load([root / "models"]), metrics=ServerMetrics(), stream_limits=limits)


@pytest.fixture(scope="module")
def engine(root: Path) -> Iterator[Engine]:
    eng = _engine(root)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base(engine: Engine) -> Iterator[str]:
    with serve_in_thread(create_app(engine, max_request_bytes=LIMIT)) as port:
        yield f"http://127.0.0.1:{port}/v2/models"


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return tmp_path / "trace.txt"


@pytest.fixture(autouse=True)
def settled(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: no stream left open, no stream thread left running."""
    yield
    if "engine" not in request.fixturenames:
        return
    engine = request.getfixturevalue("engine")
    deadline = time.monotonic() + 3
    while engine.streams.count() or _stream_threads():
        assert time.monotonic() < deadline, (engine.streams.count(), _stream_threads())
        time.sleep(0.01)


def _stream_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("neuropod-stream-")]


def _lines(trace: Path) -> list[str]:
    return trace.read_text().split() if trace.exists() else []


def _yields(trace: Path) -> int:
    return trace.read_text().count("yield") if trace.exists() else 0


def _wait_closed(trace: Path, within: float = 1.0) -> float:
    """Seconds until the model's generator wrote "closed" (fails past ``within``)."""
    start = time.monotonic()
    while "closed" not in _lines(trace):
        assert time.monotonic() - start < within, f"the generator did not close within {within} s: {_lines(trace)}"
        time.sleep(0.005)
    return time.monotonic() - start


def _repeat_body(values: list[int], delay_us: int | list[int] = 0, **parameters: Any) -> dict[str, Any]:
    """A repeat request: a response per value, ``delay_us`` before each (one for all, or one each)."""
    n = len(values)
    delays = delay_us if isinstance(delay_us, list) else [delay_us] * n
    body: dict[str, Any] = {
        "inputs": [
            {"name": "IN", "datatype": "INT32", "shape": [n], "data": values},
            {"name": "DELAY", "datatype": "UINT32", "shape": [n], "data": delays},
            {"name": "WAIT", "datatype": "UINT32", "shape": [1], "data": [0]},
        ]
    }
    if parameters:
        body["parameters"] = {k: str(v) if isinstance(v, Path) else v for k, v in parameters.items()}
    return body


def _events(response: Any) -> list[Any]:
    """Every event of a streamed response, parsed."""
    reader = EventReader()
    found = [json.loads(data) for chunk in response.iter_raw() for data in reader.feed(chunk)]
    assert not reader.incomplete
    return found


def _stream(url: str, body: Any) -> tuple[int, str, list[Any]]:
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        if r.status_code != 200:
            return r.status_code, r.headers["content-type"], [r.read().decode()]
        return r.status_code, r.headers["content-type"], _events(r)


# -- infer_stream -------------------------------------------------------------------------


def test_infer_stream_sends_each_response_as_it_comes(base: str, trace: Path) -> None:
    values = [10, 11, 12, 13, 14]
    body = {**_repeat_body(values, delay_us=150_000, trace=trace), "id": "req-7"}
    received: list[Any] = []
    made_before_first = None
    with httpx.stream("POST", f"{base}/repeat/infer_stream", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        reader = EventReader()
        for chunk in r.iter_raw():
            for data in reader.feed(chunk):
                if not received:
                    made_before_first = _yields(trace)
                received.append(json.loads(data))
    assert made_before_first is not None and made_before_first < len(values)
    assert len(received) == len(values)
    for i, (v, doc) in enumerate(zip(values, received, strict=True)):
        assert doc["model_name"] == "repeat" and doc["model_version"] == "1" and doc["id"] == "req-7"
        outputs = {o["name"]: o for o in doc["outputs"]}
        assert set(outputs) == {"OUT", "IDX"}  # a response holds the outputs the model put in it
        assert outputs["OUT"] == {"name": "OUT", "datatype": "INT32", "shape": [1], "data": [v]}
        assert outputs["IDX"] == {"name": "IDX", "datatype": "UINT32", "shape": [1], "data": [i]}
    _wait_closed(trace)


def test_infer_stream_requested_outputs_only(base: str) -> None:
    body = {**_repeat_body([5, 6]), "outputs": [{"name": "IDX"}]}
    status, _, events = _stream(f"{base}/repeat/versions/1/infer_stream", body)
    assert status == 200
    assert [[o["name"] for o in e["outputs"]] for e in events] == [["IDX"], ["IDX"]]
    assert [e["outputs"][0]["data"] for e in events] == [[0], [1]]


def test_infer_stream_takes_binary_inputs_and_gzip(base: str) -> None:
    from neuropod_serving.protocol import build_infer_request

    inputs = {"IN": np.array([3, 4], np.int32), "DELAY": np.zeros(2, np.uint32), "WAIT": np.zeros(1, np.uint32)}
    body = build_infer_request(inputs, binary=True, binary_outputs=False)
    assert body.json_length is not None
    headers = {"Inference-Header-Content-Length": str(body.json_length), "Content-Encoding": "gzip"}
    with httpx.stream("POST", f"{base}/repeat/infer_stream", content=gzip.compress(body.content), headers=headers) as r:
        assert r.status_code == 200
        events = _events(r)
    assert [e["outputs"][0]["data"] for e in events] == [[3], [4]]


def test_infer_stream_of_an_ordinary_model_is_its_one_answer(base: str) -> None:
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]},
                       {"name": "scale", "datatype": "FP32", "shape": [3], "data": [1, 2, 3]}]}  # fmt: skip
    status, _, events = _stream(f"{base}/echo/infer_stream", body)
    assert status == 200 and len(events) == 1
    outputs = {o["name"]: o["data"] for o in events[0]["outputs"]}
    assert outputs == {"text_output": ["hi"], "length": [2], "scaled": [2.0, 4.0, 6.0]}


def test_an_empty_stream_is_200_without_events(base: str) -> None:
    status, content_type, events = _stream(f"{base}/repeat/infer_stream", _repeat_body([]))
    assert (status, content_type, events) == (200, "text/event-stream; charset=utf-8", [])


# -- failures ------------------------------------------------------------------------------


def test_model_raising_mid_stream_ends_it_with_an_error_event(base: str, trace: Path) -> None:
    status, _, events = _stream(f"{base}/repeat/infer_stream", _repeat_body([1, 2, -1, 3], trace=trace))
    assert status == 200
    assert [e["outputs"][0]["data"] for e in events[:2]] == [[1], [2]]
    assert len(events) == 3 and set(events[2]) == {"error"}
    message = event_error(events[2])
    assert message is not None and "model 'repeat' failed" in message and "IN[2] is negative" in message
    _wait_closed(trace)
    # The server and the model carry on.
    status, _, events = _stream(f"{base}/repeat/infer_stream", _repeat_body([8]))
    assert status == 200 and [e["outputs"][0]["data"] for e in events] == [[8]]


def test_response_off_its_spec_mid_stream_is_an_error_event(base: str) -> None:
    status, _, events = _stream(f"{base}/repeat/infer_stream", _repeat_body([1, 777, 2]))
    assert status == 200 and len(events) == 2
    assert events[0]["outputs"][0]["data"] == [1]
    message = event_error(events[1])
    assert message is not None and "model 'repeat' failed" in message
    assert "'OUT' in the output spec" in message and "size 2" in message


def test_failure_before_the_first_response_is_an_http_error(base: str) -> None:
    r = httpx.post(f"{base}/repeat/infer_stream", json=_repeat_body([-5]))
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert "model 'repeat' failed" in r.json()["error"] and "IN[0] is negative" in r.json()["error"]


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("nope/infer_stream", {"inputs": []}, 404, ["nope"]),
        ("repeat/versions/9/infer_stream", {"inputs": []}, 404, ["9"]),
        ("repeat/infer_stream", b"{not json", 400, ["not valid JSON"]),
        ("repeat/infer_stream", b"[1, 2]", 400, ["JSON object"]),
        (
            "repeat/infer_stream",
            {"inputs": [{"name": "X", "datatype": "INT32", "shape": [1], "data": [1]}]},
            400,
            ["'X'", "IN"],
        ),
        (
            "repeat/infer_stream",
            {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [1]}]},
            400,
            ["DELAY"],
        ),
        (
            "repeat/infer_stream",
            {**_repeat_body([1]), "parameters": {"binary_data_output": True}},
            400,
            ["binary_data"],
        ),
        (
            "repeat/infer_stream",
            {**_repeat_body([1]), "outputs": [{"name": "OUT", "parameters": {"classification": 1}}]},
            400,
            ["classification"],
        ),
        (
            "repeat/infer_stream",
            {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1], "data": [1]}]},
            400,
            ["FP32", "INT32"],
        ),
        ("repeat/generate_stream", {"IN": [[1]], "DELAY": [0], "WAIT": 0}, 400, ["'IN'", "flat list"]),
        ("repeat/generate_stream", {"IN": {"a": 1}, "DELAY": [0], "WAIT": 0}, 400, ["'IN'", "a dict"]),
        ("repeat/generate_stream", {"IN": ["a"], "DELAY": [0], "WAIT": 0}, 400, ["'IN'"]),
        ("repeat/generate_stream", {"IN": [1], "DELAY": [0], "WAIT": [0, 0]}, 400, ["'WAIT'", "[1]", "2 value"]),
        (
            "repeat/generate_stream",
            {"IN": [1], "DELAY": [0], "parameters": {"WAIT": 0}, "WAIT": 0},
            400,
            ["'WAIT'", "twice"],
        ),
        ("repeat/generate_stream", {"IN": [1], "DELAY": [0], "WAIT": 0, "top_k": [1, 2]}, 400, ["'top_k'"]),
        ("repeat/generate_stream", {"IN": [1], "DELAY": [0], "WAIT": 0, "parameters": 3}, 400, ["'parameters'"]),
        ("repeat/generate_stream", {"IN": [1], "DELAY": [0]}, 400, ["WAIT"]),
        ("repeat/generate", {"IN": [1], "DELAY": [0], "WAIT": 0, "id": 5}, 400, ["'id'"]),
        ("textgen/generate", {"text_input": 5, "max_tokens": 1}, 400, ["text_input"]),
        ("repeat/infer_stream", b"x" * (LIMIT + 1), 413, ["--max-request-bytes"]),
    ],
)
def test_bad_stream_requests_get_one_clear_error(
    base: str, path: str, body: Any, status: int, words: list[str]
) -> None:
    if isinstance(body, bytes):
        r = httpx.post(f"{base}/{path}", content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(f"{base}/{path}", json=body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    message = r.json()["error"]
    for word in words:
        assert word in message, message


def test_generate_takes_no_binary_body_and_other_methods_get_405(base: str) -> None:
    r = httpx.post(f"{base}/textgen/generate", content=b"{}", headers={"Inference-Header-Content-Length": "2"})
    assert r.status_code == 400 and "one JSON object" in r.json()["error"]
    for route in ("infer_stream", "generate", "generate_stream"):
        r = httpx.get(f"{base}/repeat/{route}")
        assert r.status_code == 405 and "POST" in r.json()["error"]


def test_infer_on_a_decoupled_model_is_tritons_error(base: str) -> None:
    r = httpx.post(f"{base}/repeat/infer", json=_repeat_body([1]))
    assert r.status_code == 501
    message = r.json()["error"]
    assert "doesn't support models with decoupled transaction policy" in message
    assert "/v2/models/repeat/infer_stream" in message and "generate_stream" in message


def test_too_many_open_streams_is_429_and_closing_one_makes_room(base: str, engine: Engine) -> None:
    # The first response at once (a stream's head goes out with it), the second a second later.
    slow = _repeat_body([1, 2], delay_us=[0, 1_000_000])
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(httpx.stream("POST", f"{base}/repeat/infer_stream", json=slow, timeout=30))
                  for _ in range(MAX_OPEN)]  # fmt: skip
        deadline = time.monotonic() + 5
        while engine.streams.count("repeat") < MAX_OPEN:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(f"{base}/repeat/infer_stream", json=_repeat_body([1]))
        assert r.status_code == 429
        assert "model 'repeat' has 3 streams open" in r.json()["error"]
        # Another model's streams are counted apart.
        status, _, events = _stream(f"{base}/textgen/generate_stream", {"text_input": "a", "max_tokens": 1})
        assert status == 200 and events[0]["text_output"] == "a"
        opened[0].close()
        deadline = time.monotonic() + 2
        while engine.streams.count("repeat") >= MAX_OPEN:
            assert time.monotonic() < deadline, "a stream whose client left stayed open"
            time.sleep(0.01)
        status, _, events = _stream(f"{base}/repeat/infer_stream", _repeat_body([4]))
        assert status == 200 and events[0]["outputs"][0]["data"] == [4]


def test_stream_routes_need_the_bearer_token(engine: Engine) -> None:
    with serve_in_thread(create_app(engine, auth_token="s3cret")) as port:
        for route, body in (("infer_stream", _repeat_body([1])), ("generate", {"text_input": "a", "max_tokens": 1})):
            url = f"http://127.0.0.1:{port}/v2/models/{'repeat' if route == 'infer_stream' else 'textgen'}/{route}"
            r = httpx.post(url, json=body)
            assert r.status_code == 401 and "Bearer" in r.json()["error"]
            r = httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200, r.text
        assert r.json()["text_output"] == "a"


def test_streams_are_counted_in_the_metrics(base: str) -> None:
    def sample(metrics: str, name: str, **labels: str) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in metrics.splitlines():
            if line.startswith(f"{name}{{") and line[len(name) + 1 : line.index("}")] == want:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    metrics_url = base.replace("/v2/models", "/metrics")
    before = httpx.get(metrics_url).text
    assert _stream(f"{base}/repeat/infer_stream", _repeat_body([1, 2]))[0] == 200
    assert _stream(f"{base}/repeat/infer_stream", _repeat_body([1, -1]))[0] == 200  # failed after a response
    assert httpx.post(f"{base}/repeat/infer_stream", json={"inputs": []}).status_code == 400
    after = httpx.get(metrics_url).text
    for name, labels, more in [
        ("neuropod_requests_total", {"model": "repeat", "protocol": "rest"}, 3),
        ("neuropod_request_failures_total", {"model": "repeat", "protocol": "rest", "reason": "model"}, 1),
        ("neuropod_request_failures_total", {"model": "repeat", "protocol": "rest", "reason": "client"}, 1),
        ("neuropod_stream_first_response_seconds_count", {"model": "repeat"}, 2),
    ]:
        assert sample(after, name, **labels) - sample(before, name, **labels) == more, (name, labels)


# -- flow control ----------------------------------------------------------------------------


def test_a_client_that_goes_away_stops_the_generator(base: str, engine: Engine, trace: Path) -> None:
    threads = len(threading.enumerate())
    body = _repeat_body(list(range(50)), delay_us=100_000, trace=trace)
    with httpx.stream("POST", f"{base}/repeat/infer_stream", json=body, timeout=30) as r:
        reader = EventReader()
        for chunk in r.iter_raw():
            if reader.feed(chunk):
                break
    left = time.monotonic()
    _wait_closed(trace, within=1.0)
    assert time.monotonic() - left < 1.0
    assert _yields(trace) < 50
    deadline = time.monotonic() + 2
    while engine.streams.count() or len(threading.enumerate()) > threads:
        assert time.monotonic() < deadline, threading.enumerate()
        time.sleep(0.01)


def test_a_slow_reader_holds_the_model_back(base: str, trace: Path) -> None:
    blob = 1 << 20  # each response carries 1 MiB: the socket's buffers hold few of them
    total = 60
    body = json.dumps(_repeat_body(list(range(total)), trace=trace, blob=blob)).encode()
    host, port = base.split("//")[1].split("/")[0].split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # no receive autotuning
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v2/models/repeat/infer_stream HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        # Read nothing more: the model runs until the socket and the stream's buffer are full, then waits.
        made = -1
        while made != _yields(trace):
            made = _yields(trace)
            time.sleep(0.3)
        wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
        in_kernel = 2 + (wmem + 2 * 64 * 1024) // blob  # the socket's buffers hold a few (and parts of two)
        # The stream's buffer, the one its producer holds, one batch (at most BUFFERED) in uvicorn's write buffer.
        assert made <= 2 * BUFFERED + 1 + in_kernel < total, (made, in_kernel)
    # The client left without reading: the generator stops.
    _wait_closed(trace)
    assert _yields(trace) < total


# -- generate ---------------------------------------------------------------------------


def test_generate_stream_maps_fields_to_inputs_and_parameters(base: str) -> None:
    body = {"text_input": "hello streaming world", "max_tokens": 2, "parameters": {"upper": True}, "id": "g1"}
    status, content_type, events = _stream(f"{base}/textgen/generate_stream", body)
    assert status == 200 and content_type == "text/event-stream; charset=utf-8"
    assert events == [
        {"model_name": "textgen", "model_version": "1", "id": "g1", "text_output": "HELLO"},
        {"model_name": "textgen", "model_version": "1", "id": "g1", "text_output": "STREAMING"},
    ]
    # A field that is no input is a parameter too; an input may come inside "parameters".
    status, _, events = _stream(f"{base}/textgen/generate_stream",
                                {"text_input": "a b", "upper": True, "parameters": {"max_tokens": 5}})  # fmt: skip
    assert [e["text_output"] for e in events] == ["A", "B"]


def test_generate_answers_with_the_one_response(base: str, trace: Path) -> None:
    r = httpx.post(f"{base}/textgen/generate", json={"text_input": "solo", "max_tokens": 3})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"model_name": "textgen", "model_version": "1", "text_output": "solo"}
    # More than one response: refused at the second, and the model's generator stops.
    r = httpx.post(
        f"{base}/textgen/generate", json={"text_input": "one two three", "max_tokens": 3, "trace": str(trace)}
    )
    assert r.status_code == 400
    assert "more than one response" in r.json()["error"] and "/v2/models/textgen/generate_stream" in r.json()["error"]
    _wait_closed(trace)
    r = httpx.post(f"{base}/textgen/generate", json={"text_input": "", "max_tokens": 3})
    assert r.status_code == 400 and "no response" in r.json()["error"]


def test_generate_of_an_ordinary_model_flattens_its_outputs(base: str) -> None:
    r = httpx.post(f"{base}/echo/generate", json={"text_input": "hello", "scale": [1, 2, 3]})
    assert r.status_code == 200
    assert r.json() == {"model_name": "echo", "model_version": "1", "text_output": "hello", "length": 5,
                        "scaled": [2.0, 4.0, 6.0]}  # fmt: skip
    status, _, events = _stream(f"{base}/echo/generate_stream", {"text_input": "hey", "scale": [0, 0, 1]})
    assert status == 200 and events == [
        {"model_name": "echo", "model_version": "1", "text_output": "hey", "length": 3, "scaled": [0.0, 0.0, 2.0]}
    ]


# -- the server stopping ----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["graceful", "cancelled", "engine"])
def test_a_stopping_server_ends_open_streams_with_an_error_event(root: Path, trace: Path, how: str) -> None:
    """Each way a server stops ends an open stream at once with an error event: uvicorn's graceful
    shutdown with neuropod serve's protocol (graceful), with uvicorn's own protocol once its wait
    for open responses runs out (cancelled), Engine.close() (engine)."""
    from neuropod_serving.server.http import OneWriteProtocol

    engine = _engine(root)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    protocol: Any = "httptools" if how == "cancelled" else OneWriteProtocol
    config = uvicorn.Config(create_app(engine), log_level="warning", lifespan="off", http=protocol,
                            timeout_graceful_shutdown=0.3)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v2/models/repeat/infer_stream"
        body = _repeat_body(list(range(100)), delay_us=50_000, trace=trace)
        events: list[Any] = []
        stopped = 0.0
        with httpx.stream("POST", url, json=body, timeout=30) as r:
            reader = EventReader()
            for chunk in r.iter_raw():
                for data in reader.feed(chunk):
                    events.append(json.loads(data))
                    if len(events) == 1:
                        stopped = time.monotonic()
                        if how == "engine":
                            engine.close()
                        else:
                            server.should_exit = True
        assert time.monotonic() - stopped < 2.0
        assert len(events) >= 2 and all("outputs" in e for e in events[:-1])
        assert event_error(events[-1]) == "stream of model 'repeat' ended: the server is stopping", events[-1]
        _wait_closed(trace)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        engine.close()
    assert not thread.is_alive()
    assert engine.streams.count() == 0


# -- the codec ---------------------------------------------------------------------------------


def test_event_reader_takes_chunks_split_anywhere() -> None:
    wire = b'data: {"a": 1}\r\n\r\n: a comment\ndata:x\ndata: y\nevent: z\n\n' + error_event("boom \u00e9\nnext")
    expected = ['{"a": 1}', "x\ny", json.dumps({"error": "boom \u00e9\nnext"}, ensure_ascii=False)]
    for size in (1, 2, 3, 7, len(wire)):
        reader = EventReader()
        got = [d for i in range(0, len(wire), size) for d in reader.feed(wire[i : i + size])]
        assert got == expected, size
        assert not reader.incomplete
    assert event_error(json.loads(expected[2])) == "boom \u00e9\nnext"
    assert event_error({"error": "x", "outputs": []}) is None
    reader = EventReader(max_event_bytes=10)
    with pytest.raises(ValueError, match="longer than 10"):
        reader.feed(b"data: " + b"x" * 20 + b"\n")
    reader = EventReader()
    reader.feed(b"data: cut")
    assert reader.incomplete


def test_infer_events_are_the_codecs_inference_responses() -> None:
    """The events' own encoder (numeric tensors straight from numpy) writes what the codec writes."""
    from neuropod_serving.protocol import build_infer_response, parse_infer_response
    from neuropod_serving.protocol.events import event
    from neuropod_serving.server.sse import _InferEvents

    responses = [
        {"x": np.array([0.1, 2.5, -3], np.float32), "b": np.array([True, False]), "h": np.array([1.5], np.float16)},
        {"n": np.array([np.nan, np.inf], np.float32), "s": np.array(["a", "\u00e9"], dtype=object)},
        {"z": np.zeros((2, 0), np.int64), "d": np.ones((), np.float64), "big": np.array([2**63 + 5], np.uint64)},
        {"be": np.array([1, 2], ">i4"), "m": np.arange(6, dtype=np.int8).reshape(2, 3)[:, ::2]},
    ]
    for request_id in (None, 'r"1'):
        encode = _InferEvents("m", "2", request_id)
        for _ in range(2):  # the second time from the forms it remembered
            wire = encode(responses)
            codec = [event(build_infer_response("m", r, model_version="2", id=request_id).content) for r in responses]
            assert wire == b"".join(codec)
    reader = EventReader()
    for data, expected in zip(reader.feed(wire), responses, strict=True):
        decoded = parse_infer_response(data.encode())
        assert decoded.model_name == "m" and decoded.id == 'r"1'
        for name, array in expected.items():
            np.testing.assert_array_equal(decoded.outputs[name], array)


@pytest.mark.parametrize(
    ("shape", "count", "expected"),
    [((1,), 1, [1]), ((None,), 4, [4]), (("n",), 0, [0]), ((None, 3), 6, [2, 3]), ((None, None), 5, [1, 5]),
     ((), 1, []), ((2, 2), 4, [2, 2]), ((2,), 3, None), ((), 2, None), ((None, 3), 4, None)],
)  # fmt: skip
def test_generate_input_shapes_follow_tritons_rule(
    shape: tuple[Any, ...], count: int, expected: list[int] | None
) -> None:
    spec = TensorSpec("t", "int32", shape)
    if expected is None:
        with pytest.raises(ProtocolError, match=f"cannot hold {count} value"):
            input_shape(spec, count)
    else:
        assert input_shape(spec, count) == expected
