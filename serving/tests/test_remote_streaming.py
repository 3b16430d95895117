"""Remote models' ``infer_stream`` against a real ``neuropod serve``, over gRPC (ModelStreamInfer)
and REST (``infer_stream``'s Server-Sent Events), and ``neuropod infer --stream``.

The decoupled model is ``repeat`` (streaming_models.py: Triton's ``repeat_int32`` interface, steered
by request parameters).
"""

from __future__ import annotations

import gc
import io
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("grpc")

import neuropod
from neuropod.cli import main
from neuropod.errors import NeuropodError, RemoteError, SpecError
from neuropod.testing import served
from neuropod_serving.client._grpc import GrpcTransport, config_decoupled
from neuropod_serving.client._http import HttpTransport
from neuropod_serving.client._target import parse_url
from neuropod_serving.protocol import ProtocolError
from neuropod_serving.protocol._grpc import triton_config_pb2 as tc
from streaming_models import repeat_inputs, repeat_package, wait_for

from conftest import private_caches, python_package

PROTOCOLS = ["grpc", "http"]
MAX_OPEN = 3  # streams of one model open at once on the test server

DOUBLER = """
def get_model(data_root):
    return lambda x: {"y": x * 2}
"""


@pytest.fixture(scope="module")
def models() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-remote-stream-"))
    with private_caches(root):
        repeat_package(root / "models" / "repeat")
        python_package(root / "models" / "doubler", "doubler", DOUBLER)
        yield root / "models"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(models: Path) -> Iterator[Any]:
    with served(models, options=["--max-open-streams", str(MAX_OPEN)]) as s:
        yield s


def _url(server: Any, protocol: str, model: str) -> str:
    return f"grpc://{server.grpc}/{model}" if protocol == "grpc" else f"{server.http}/{model}"


@pytest.fixture(params=PROTOCOLS)
def repeat(request: pytest.FixtureRequest, server: Any) -> Iterator[Any]:
    with neuropod.load_neuropod(_url(server, request.param, "repeat")) as model:
        yield model


def test_decoupled_model_streams_its_responses_in_order(repeat: Any) -> None:
    assert repeat.decoupled
    values = [7, 3, 11, 5]
    with repeat.infer_stream(repeat_inputs(values)) as responses:
        got = list(responses)
    assert [r["OUT"].tolist() for r in got] == [[v] for v in values]
    assert [r["IDX"].tolist() for r in got] == [[i] for i in range(len(values))]
    assert all(r["OUT"].dtype == np.int32 and r["IDX"].dtype == np.uint32 for r in got)
    assert responses.done and responses.responses == len(values)
    # No responses at all is a stream that ends at once.
    assert list(repeat.infer_stream(repeat_inputs([]))) == []


def test_infer_on_a_decoupled_remote_model_says_to_stream(repeat: Any) -> None:
    with pytest.raises(NeuropodError, match="infer_stream"):
        repeat.infer(repeat_inputs([1]))


def test_responses_arrive_as_the_model_makes_them(repeat: Any, tmp_path: Path) -> None:
    # Response i > 0 is made only once the test has seen response i - 1: a stream that held its
    # responses back until the model ended would never end (the gate waits 20 s, the timeout 15).
    gate = tmp_path / "gate"
    with repeat.infer_stream(repeat_inputs([4, 5, 6]), parameters={"gate": str(gate)}, timeout=15) as responses:
        seen = []
        for i, response in enumerate(responses):
            seen.append(int(response["OUT"][0]))
            Path(f"{gate}.{i + 1}").touch()
    assert seen == [4, 5, 6]


def test_requested_outputs_and_input_checks(repeat: Any) -> None:
    got = list(repeat.infer_stream(repeat_inputs([1, 2]), ["IDX"]))
    assert [sorted(r) for r in got] == [["IDX"], ["IDX"]]
    assert [r["IDX"].tolist() for r in got] == [[0], [1]]
    with pytest.raises(SpecError, match="DELAY"):  # checked here, before anything is sent
        repeat.infer_stream({"IN": np.zeros(2, np.int32), "DELAY": np.zeros(3, np.uint32), "WAIT": np.zeros(1, np.uint32)})
    with pytest.raises(NeuropodError, match="NOPE"):
        repeat.infer_stream(repeat_inputs([1]), ["NOPE"])


def test_close_stops_the_generator_on_the_server(repeat: Any, tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    threads = threading.active_count()
    responses = repeat.infer_stream(repeat_inputs(list(range(100)), 50_000), parameters={"mark": str(mark)})
    first = next(responses)
    assert first["OUT"].tolist() == [0]
    closed = time.monotonic()
    responses.close()
    assert responses.done
    assert list(responses) == []
    # The server saw the call end and closed the model's generator (its finally ran), within a second.
    assert wait_for(mark, "closed", 3.0), "the model's generator was not closed on the server"
    assert time.monotonic() - closed < 2.0
    assert [s.outstanding for s in repeat._pool.servers] == [0]  # the pool counts the stream no more
    deadline = time.monotonic() + 3
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.02)
    assert threading.active_count() <= threads, [t.name for t in threading.enumerate()]


def test_a_dropped_stream_is_cancelled(repeat: Any, tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    responses = repeat.infer_stream(repeat_inputs(list(range(100)), 50_000), parameters={"mark": str(mark)})
    assert next(responses)["OUT"].tolist() == [0]
    del responses
    gc.collect()
    assert wait_for(mark, "closed", 3.0), "a stream dropped unclosed went on on the server"
    assert [s.outstanding for s in repeat._pool.servers] == [0]


def test_close_from_another_thread_ends_a_blocked_read(repeat: Any, tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    inputs = repeat_inputs([1, 2, 3])
    inputs["DELAY"][1:] = 700_000  # 0.7 s for each response after the first
    responses = repeat.infer_stream(inputs, parameters={"mark": str(mark)})
    assert next(responses)["OUT"].tolist() == [1]
    ended = threading.Event()
    seen: list[Any] = []

    def read() -> None:
        seen.extend(responses)  # blocks: the model is making its second response
        ended.set()

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.2)
    assert not ended.is_set()
    responses.close()
    assert ended.wait(2.0), "close() did not end the blocked read"
    reader.join(2)
    assert seen == []
    # The server closes the generator once the response it is making is ready.
    assert wait_for(mark, "closed", 3.0)


def test_an_error_mid_stream_comes_after_the_responses_before_it(repeat: Any) -> None:
    responses = repeat.infer_stream(repeat_inputs([1, 2, -5, 4]))
    assert [int(next(responses)["OUT"][0]) for _ in range(2)] == [1, 2]
    with pytest.raises(RemoteError) as caught:
        next(responses)
    assert caught.value.code == "internal"
    assert "negative value -5 at 2" in str(caught.value) and caught.value.url in repeat.urls
    assert responses.done and list(responses) == []
    # The server and the model carry on.
    assert [int(r["OUT"][0]) for r in repeat.infer_stream(repeat_inputs([9]))] == [9]


def test_a_model_with_its_most_streams_open_refuses_one_more(repeat: Any) -> None:
    held = [repeat.infer_stream(repeat_inputs(list(range(100)), 50_000)) for _ in range(MAX_OPEN)]
    try:
        assert [int(next(s)["OUT"][0]) for s in held] == [0] * MAX_OPEN
        with pytest.raises(RemoteError) as caught:
            next(repeat.infer_stream(repeat_inputs([1])))
        assert caught.value.code == "resource_exhausted"
        assert f"--max-open-streams {MAX_OPEN}" in str(caught.value)
    finally:
        for s in held:
            s.close()
    # Closed streams give their places back (once the server has closed their generators).
    deadline = time.monotonic() + 3
    while True:
        try:
            assert [int(r["OUT"][0]) for r in repeat.infer_stream(repeat_inputs([5]))] == [5]
            break
        except RemoteError as e:
            assert e.code == "resource_exhausted" and time.monotonic() < deadline
            time.sleep(0.05)


def test_a_deadline_for_the_whole_stream(repeat: Any) -> None:
    responses = repeat.infer_stream(repeat_inputs(list(range(50)), 40_000), timeout=0.5)
    got = []
    with pytest.raises(RemoteError) as caught:
        for r in responses:
            got.append(int(r["OUT"][0]))
    assert caught.value.code == "deadline_exceeded"
    assert 1 <= len(got) < 50 and got == list(range(len(got)))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_model_configuration_says_which_models_are_decoupled(server: Any, protocol: str) -> None:
    # What loading asks a server that does not send neuropod serve's metadata parameter (Triton):
    # its model configuration's model_transaction_policy.
    for model, expected in (("repeat", True), ("doubler", False)):
        target = parse_url(_url(server, protocol, model))
        transport = GrpcTransport(target) if protocol == "grpc" else HttpTransport(target)
        try:
            assert transport.decoupled(10) is expected
        finally:
            transport.close()


def test_a_model_config_response_read_on_the_wire() -> None:
    def config(**policy: Any) -> bytes:
        fields = {"model_transaction_policy": tc.ModelTransactionPolicy(**policy)} if policy else {}
        return bytes(tc.ModelConfigResponse(config=tc.ModelConfig(name="m", max_batch_size=8, **fields)).SerializeToString())

    assert config_decoupled(config(decoupled=True)) is True
    assert config_decoupled(config(decoupled=False)) is False
    assert config_decoupled(config()) is False
    with pytest.raises(ProtocolError, match="ModelConfigResponse"):
        config_decoupled(b"\x0a\x05ab")  # a field longer than the message


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_ordinary_model_streams_its_one_answer(server: Any, protocol: str) -> None:
    x = np.array([[1, 2], [3, 4]], np.float32)
    with neuropod.load_neuropod(_url(server, protocol, "doubler")) as model:
        assert not model.decoupled
        got = list(model.infer_stream({"x": x}))
        assert len(got) == 1
        np.testing.assert_array_equal(got[0]["y"], x * 2)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cli_infer_stream(server: Any, protocol: str, tmp_path: Path) -> None:
    for name, value in repeat_inputs([3, 1, 2]).items():
        np.save(tmp_path / f"{name}.npy", value)
    args = ["infer", _url(server, protocol, "repeat")] + [
        a for name in ("IN", "DELAY", "WAIT") for a in ("-i", f"{name}={tmp_path / name}.npy")
    ]
    out = io.StringIO()
    assert main([*args, "--stream"], out=out) == 0
    text = out.getvalue()
    assert "responses as they arrive" in text and text.rstrip().endswith("3 responses")
    blocks = text.split("response ")[1:]
    assert [b.split(":")[0] for b in blocks] == ["1", "2", "3"]
    assert [b.split("OUT: int32 [1] [")[1][0] for b in blocks] == ["3", "1", "2"]
    # A decoupled model streams without --stream; --output-dir writes response N to DIR/N/.
    out = io.StringIO()
    assert main([*args, "-o", "OUT", "--output-dir", str(tmp_path / "out")], out=out) == 0
    assert [np.load(tmp_path / "out" / str(n) / "OUT.npy").tolist() for n in (1, 2, 3)] == [[3], [1], [2]]
    assert not (tmp_path / "out" / "1" / "IDX.npy").exists()


class _Flushes(io.StringIO):
    """Output that records how much had been written at each flush."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[int] = []

    def flush(self) -> None:
        self.flushed.append(len(self.getvalue()))


def test_cli_infer_stream_of_local_models(models: Path, tmp_path: Path) -> None:
    for name, value in repeat_inputs([6, 5]).items():
        np.save(tmp_path / f"{name}.npy", value)
    out = _Flushes()
    args = [a for name in ("IN", "DELAY", "WAIT") for a in ("-i", f"{name}={tmp_path / name}.npy")]
    assert main(["infer", str(models / "repeat"), *args, "-o", "IDX"], out=out) == 0
    text = out.getvalue()
    assert "Model 'repeat' with python==" in text and text.rstrip().endswith("2 responses")
    assert "IDX: uint32 [1] [1]" in text and "OUT" not in text
    # Flushed after the first line and after each response, before the next is waited for.
    assert [text[:n].rstrip().rsplit("\n", 1)[-1] for n in out.flushed[:3]] == [
        text.splitlines()[0], "  IDX: uint32 [1] [0]", "  IDX: uint32 [1] [1]"
    ]
    # --stream on an ordinary model: its one answer, as one response.
    np.save(tmp_path / "x.npy", np.array([[1, 2]], np.float32))
    out = io.StringIO()
    assert main(["infer", str(models / "doubler"), "-i", f"x={tmp_path / 'x.npy'}", "--stream"], out=out) == 0
    text = out.getvalue()
    assert "response 1:\n  y: float32 [1, 2] [[2., 4.]]" in text and text.rstrip().endswith("1 response")
