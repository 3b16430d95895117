"""gRPC ModelStreamInfer with Triton's decoupled semantics, against the real gRPC server in this process,
driven by tritonclient.grpc: responses as they come, triton_final_response and
triton_enable_empty_final_response, errors on the stream that do not end it, limits, a client that
cancels, a server that stops, the model configuration, ModelInfer's refusal, and the metrics.

The models are python packages (grpc_stream_models.py): repeat_int32 (Triton's interface), tricky (fails
after K responses, or breaks its spec) and echo (an ordinary model). Expected values are the inputs
themselves, or numpy's.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")

from tritonclient.grpc import service_pb2 as triton_pb  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from grpc_stream_models import StreamServer, repeat_inputs, stream_server  # noqa: E402
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb  # noqa: E402
from neuropod_serving.server.grpc_server import start_grpc_server  # noqa: E402
from neuropod_serving.server.grpc_service import SERVICE  # noqa: E402
from neuropod_serving.server.model_config import model_config  # noqa: E402

MAX_OPEN = 3


@pytest.fixture(scope="module")
def server() -> Iterator[StreamServer]:
    with stream_server(max_open=MAX_OPEN) as s:
        yield s


@pytest.fixture
def client(server: StreamServer) -> Iterator[Any]:
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        yield c
    finally:
        c.close()


class Answers:
    """A tritonclient stream's callback: (result, error, seconds since the stream started) in a queue."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.queue: queue.Queue[tuple[Any, Any, float]] = queue.Queue()
        self.started = time.monotonic()
        client.start_stream(callback=self._put)

    def _put(self, result: Any, error: Any) -> None:
        self.queue.put((result, error, time.monotonic() - self.started))

    def take(self, n: int, timeout: float = 30) -> list[tuple[Any, Any, float]]:
        return [self.queue.get(timeout=timeout) for _ in range(n)]

    def none_left(self, wait: float = 0.2) -> bool:
        time.sleep(wait)
        return self.queue.empty()


def _final(result: Any) -> bool | None:
    params = result.get_response().parameters
    return params["triton_final_response"].bool_param if "triton_final_response" in params else None


def _repeat(answers: Answers, values: list[int], request_id: str, delays_us: list[int] | int = 0, **kw: Any) -> None:
    answers.client.async_stream_infer(
        "repeat_int32", repeat_inputs(grpcclient, values, delays_us), request_id=request_id, **kw
    )


def _streams_closed(server: StreamServer) -> None:
    deadline = time.monotonic() + 5
    while server.engine.streams.count():
        assert time.monotonic() < deadline, f"{server.engine.streams.count()} streams still open"
        time.sleep(0.01)


# -- responses as they come ----------------------------------------------------------------------------------


def test_each_response_as_the_model_makes_it(server: StreamServer, client: Any) -> None:
    answers = Answers(client)
    try:
        # The second response comes 300 ms after the first: the first must not wait for it.
        _repeat(answers, [100, 101, 102], "a", [0, 300_000, 0], enable_empty_final_response=True)
        got = answers.take(4)
    finally:
        client.stop_stream()
    assert all(error is None for _, error, _ in got), got
    results = [r for r, _, _ in got]
    assert [r.get_response().id for r in results] == ["a"] * 4
    assert [r.as_numpy("OUT").tolist() for r in results[:3]] == [[100], [101], [102]]
    assert [r.as_numpy("IDX").tolist() for r in results[:3]] == [[0], [1], [2]]
    assert [_final(r) for r in results] == [False, False, False, True]
    assert results[3].as_numpy("OUT") is None and not results[3].get_response().outputs  # the empty final response
    # The second was made 300 ms after the first: the first arrived well before it (not held back for it).
    assert got[1][2] - got[0][2] >= 0.15, "the first response waited for the second"
    _streams_closed(server)


def test_requested_outputs_and_requests_one_after_another(server: StreamServer, client: Any) -> None:
    """Several requests on one stream, each answered in turn with its own id; a requested output only."""
    answers = Answers(client)
    try:
        for i, request_id in enumerate(("first", "second", "third")):
            client.async_stream_infer(
                "repeat_int32", repeat_inputs(grpcclient, [10 * i, 10 * i + 1]), request_id=request_id,
                outputs=[grpcclient.InferRequestedOutput("IDX")],
            )  # fmt: skip
        got = answers.take(6)
        assert answers.none_left()  # no empty final response unless asked for one
    finally:
        client.stop_stream()
    results = [r for r, e, _ in got if e is None]
    assert [(r.get_response().id, r.as_numpy("IDX").tolist()) for r in results] == [
        ("first", [0]), ("first", [1]), ("second", [0]), ("second", [1]), ("third", [0]), ("third", [1]),
    ]  # fmt: skip
    assert all(r.as_numpy("OUT") is None for r in results)  # only what was requested
    assert {_final(r) for r in results} == {False}


def test_zero_responses(server: StreamServer, client: Any) -> None:
    """A request the model answers with no response at all: nothing is sent (as Triton), unless it
    asked for the empty final response, which then comes alone."""
    answers = Answers(client)
    try:
        _repeat(answers, [], "nothing")
        _repeat(answers, [], "only-final", enable_empty_final_response=True)
        _repeat(answers, [7], "after")
        got = answers.take(2)
        assert answers.none_left()
    finally:
        client.stop_stream()
    (final, e1, _), (after, e2, _) = got
    assert e1 is None and e2 is None
    assert final.get_response().id == "only-final" and _final(final) is True and not final.get_response().outputs
    assert after.get_response().id == "after" and after.as_numpy("OUT").tolist() == [7]


def test_an_ordinary_model_on_the_stream_answers_once_and_finally(server: StreamServer, client: Any) -> None:
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    inputs = [grpcclient.InferInput("x", [3, 2], "FP32")]
    inputs[0].set_data_from_numpy(x)
    answers = Answers(client)
    try:
        client.async_stream_infer("echo", inputs, request_id="e", enable_empty_final_response=True)
        [(result, error, _)] = answers.take(1)
        assert answers.none_left()
    finally:
        client.stop_stream()
    assert error is None and result.get_response().id == "e" and _final(result) is True
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)


# -- bad input and failing models: one error each, the stream goes on ------------------------------------------


def _out(result: Any) -> list[int] | None:
    out = result.as_numpy("OUT")
    return None if out is None else list(out.tolist())


def _tricky(k: int, mode: int) -> list[Any]:
    inputs = [grpcclient.InferInput("K", [1], "INT32"), grpcclient.InferInput("MODE", [1], "INT32")]
    inputs[0].set_data_from_numpy(np.array([k], np.int32))
    inputs[1].set_data_from_numpy(np.array([mode], np.int32))
    return inputs


def test_errors_on_the_stream_leave_it_open(server: StreamServer, client: Any) -> None:
    bad_dtype = repeat_inputs(grpcclient, [1, 2])
    bad_dtype[0] = grpcclient.InferInput("IN", [2], "FP32")
    bad_dtype[0].set_data_from_numpy(np.array([1, 2], np.float32))
    answers = Answers(client)
    try:
        client.async_stream_infer("no_such_model", repeat_inputs(grpcclient, [1]), request_id="unknown")
        client.async_stream_infer("repeat_int32", bad_dtype, request_id="malformed")
        client.async_stream_infer("tricky", _tricky(2, 0), request_id="raises")
        client.async_stream_infer("tricky", _tricky(1, 1), request_id="off-spec")
        _repeat(answers, [42], "fine", enable_empty_final_response=True)
        got = answers.take(2 + 3 + 2 + 2)
        assert answers.none_left()
    finally:
        client.stop_stream()
    kinds = [("error", e.message()) if e is not None else ("ok", _out(r)) for r, e, _ in got]
    assert [k for k, _ in kinds] == ["error", "error", "ok", "ok", "error", "ok", "error", "ok", "ok"], kinds
    unknown, malformed, _, _, raised, _, off_spec, fine, _ = (v for _, v in kinds)
    assert "'no_such_model'" in unknown
    assert "'IN'" in malformed and "FP32" in malformed and "INT32" in malformed
    assert [v for _, v in kinds[2:4]] == [[0], [1]]  # the k responses came first
    assert "'tricky'" in raised and "boom after 2" in raised
    assert "OUT" in off_spec and "float64" in off_spec and "'tricky'" in off_spec
    assert fine == [42]
    _streams_closed(server)
    # The server carries on.
    assert client.is_server_live() and client.is_model_ready("tricky")


def test_error_responses_carry_the_request_id(server: StreamServer) -> None:
    """The error response names the request it answers (infer_response.id) and is that request's final."""
    request = pb.ModelInferRequest(model_name="repeat_int32", id="bad-param")
    request.parameters["triton_enable_empty_final_response"].string_param = "yes"
    for name, datatype, values in (("IN", "INT32", [5]), ("DELAY", "UINT32", [0]), ("WAIT", "UINT32", [0])):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[1])
        (tensor.contents.int_contents if datatype == "INT32" else tensor.contents.uint_contents).extend(values)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")
        [answer] = [triton_pb.ModelStreamInferResponse.FromString(a) for a in call(iter([request.SerializeToString()]))]
    assert "triton_enable_empty_final_response" in answer.error_message and "bool" in answer.error_message
    assert answer.infer_response.id == "bad-param"
    assert answer.infer_response.parameters["triton_final_response"].bool_param is True


def test_request_parameters_reach_the_model(client: Any) -> None:
    answers = Answers(client)
    try:
        client.async_stream_infer("tricky", _tricky(2, 1), request_id="p", parameters={"offset": 40})
        got = answers.take(3)
    finally:
        client.stop_stream()
    assert [_out(r) for r, e, _ in got[:2]] == [[40], [41]]
    assert got[2][1] is not None  # then MODE 1's response off the spec


def test_model_infer_on_a_decoupled_model_is_refused_as_triton_refuses_it(client: Any) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.infer("repeat_int32", repeat_inputs(grpcclient, [1, 2]))
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    message = info.value.message()
    assert message.startswith("ModelInfer RPC doesn't support models with decoupled transaction policy")
    assert "'repeat_int32'" in message and "ModelStreamInfer" in message


# -- limits, cancellation, stopping ------------------------------------------------------------------------------------


def _raw_request(values: list[int], delay_us: int, request_id: str) -> bytes:
    request = pb.ModelInferRequest(model_name="repeat_int32", id=request_id)
    n = len(values)
    for name, datatype, contents in (
        ("IN", "INT32", values),
        ("DELAY", "UINT32", [delay_us] * n),
        ("WAIT", "UINT32", [0]),
    ):
        request.inputs.add(name=name, datatype=datatype, shape=[len(contents)])
        request.raw_input_contents.append(np.array(contents, np.int32 if datatype == "INT32" else np.uint32).tobytes())
    return bytes(request.SerializeToString())


def _held_stream(channel: Any, data: bytes, stop: threading.Event) -> Any:
    """A ModelStreamInfer call that sends ``data`` and keeps its request side open until ``stop``."""

    def requests() -> Iterator[bytes]:
        yield data
        stop.wait(60)

    return channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")(requests())


def test_open_streams_per_model_are_bounded_and_cancel_closes_the_generator(server: StreamServer) -> None:
    """MAX_OPEN streams of repeat_int32 in flight: one more is refused on its stream (RESOURCE_EXHAUSTED's words),
    other models still stream; cancelling the calls closes their generators within a second, the count goes
    back to 0, and no thread is left behind."""
    threads_before = {t.ident for t in threading.enumerate()}
    stop = threading.Event()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        values = [1000 + i for i in range(MAX_OPEN)]
        # 500 responses 20 ms apart each: open for 10 s unless cancelled.
        calls = [_held_stream(channel, _raw_request([v] * 500, 20_000, str(v)), stop) for v in values]
        for call in calls:  # each answered once: all are open on the server
            assert triton_pb.ModelStreamInferResponse.FromString(next(call)).infer_response.id in {
                str(v) for v in values
            }
        assert server.engine.streams.count("repeat_int32") == MAX_OPEN
        refused = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")(iter([_raw_request([7], 0, "one-too-many")]))
        [answer] = [triton_pb.ModelStreamInferResponse.FromString(a) for a in refused]
        assert "--max-open-streams" in answer.error_message and f"{MAX_OPEN} streams open" in answer.error_message
        assert answer.infer_response.id == "one-too-many"
        # Another model's streams have their own bound.
        tricky = pb.ModelInferRequest(model_name="tricky", id="t")
        for name in ("K", "MODE"):
            tricky.inputs.add(name=name, datatype="INT32", shape=[1]).contents.int_contents.append(1)
        answers = list(channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")(iter([tricky.SerializeToString()])))
        assert triton_pb.ModelStreamInferResponse.FromString(answers[0]).error_message == ""
        cancelled = time.monotonic()
        for call in calls:
            call.cancel()
        for v in values:
            server.wait_closed(v, within=max(0.0, 1.0 - (time.monotonic() - cancelled)) + 0.05)
        _streams_closed(server)
    finally:
        stop.set()
        channel.close()
    deadline = time.monotonic() + 5
    while True:  # grpcio's own threads come and go; ours (named neuropod-stream-*) must not stay
        left = [
            t for t in threading.enumerate() if t.ident not in threads_before and t.name.startswith("neuropod-stream")
        ]
        if not left:
            break
        assert time.monotonic() < deadline, left
        time.sleep(0.05)


def test_tritonclient_stop_stream_with_cancel_closes_the_generator(server: StreamServer, client: Any) -> None:
    answers = Answers(client)
    _repeat(answers, [2000] * 500, "long", 20_000)
    answers.take(1)
    stopped = time.monotonic()
    client.stop_stream(cancel_requests=True)
    assert server.wait_closed(2000, within=1.0) + (time.monotonic() - stopped) < 1.5
    _streams_closed(server)


def test_a_stopping_server_ends_open_streams_with_an_error(server: StreamServer) -> None:
    """A second gRPC server over the same engine: stopping it (with a grace period) ends the request in flight
    at once with an error_message saying so, then the stream; the generator is closed; the engine serves on."""
    second, port = start_grpc_server(server.engine, "127.0.0.1:0", access_log=False)
    stop = threading.Event()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = _held_stream(channel, _raw_request([3000] * 500, 20_000, "cut"), stop)
        first = triton_pb.ModelStreamInferResponse.FromString(next(call))
        assert first.error_message == "" and first.infer_response.id == "cut"
        started = time.monotonic()
        stopper = threading.Thread(target=second.stop, args=(10,))
        stopper.start()
        rest = [triton_pb.ModelStreamInferResponse.FromString(a) for a in call]
        stopper.join(15)
        assert time.monotonic() - started < 5, "the stream waited for the grace period"
        errors = [a for a in rest if a.error_message]
        assert len(errors) == 1 and rest[-1] is errors[0], [a.error_message for a in rest]
        assert "the server is stopping" in errors[0].error_message and errors[0].infer_response.id == "cut"
        server.wait_closed(3000, within=1.0)
    finally:
        stop.set()
        channel.close()
    _streams_closed(server)
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.port}") as c:
        assert c.is_model_ready("repeat_int32")


# -- configuration, metadata, metrics and statistics ----------------------------------------------------------------


def test_model_configuration_says_decoupled(server: StreamServer, client: Any) -> None:
    assert client.get_model_config("repeat_int32").config.model_transaction_policy.decoupled is True
    assert client.get_model_config("echo").config.model_transaction_policy.decoupled is False
    assert model_config(server.engine, server.engine.get("repeat_int32"))["model_transaction_policy"] == {
        "decoupled": True
    }
    assert "model_transaction_policy" not in model_config(server.engine, server.engine.get("echo"))


def _sample(server: StreamServer, name: str, model: str) -> float:
    return server.metrics.registry.get_sample_value(name, {"model": model}) or 0.0


def test_time_to_first_response_and_between_responses(server: StreamServer, client: Any) -> None:
    """Per model: a first-response histogram (one per stream that answered) and a gap histogram (the
    responses after the first), and Triton's response_stats per response index; a model failing after k
    responses counts a fail at index k."""
    first = "neuropod_stream_first_response_seconds"
    gap = "neuropod_stream_response_gap_seconds"
    before = {f"{k}_{s}": _sample(server, f"{k}_{s}", "repeat_int32") for k in (first, gap) for s in ("count", "sum")}
    counts_before = client.get_inference_statistics("repeat_int32").model_stats[0]
    inferences_before, executions_before = counts_before.inference_count, counts_before.execution_count
    compute_before = counts_before.inference_stats.compute_infer.ns
    stats_before = counts_before.response_stats
    index_2_before = stats_before["2"].success.count if "2" in stats_before else 0
    tricky_before = client.get_inference_statistics("tricky").model_stats[0].response_stats
    fail_before = tricky_before["3"].fail.count if "3" in tricky_before else 0
    answers = Answers(client)
    try:
        _repeat(answers, [1, 2, 3], "m1", [20_000, 30_000, 30_000])
        _repeat(answers, [4, 5], "m2", [0, 30_000])
        client.async_stream_infer("tricky", _tricky(3, 0), request_id="fails")
        answers.take(3 + 2 + 3 + 1)
    finally:
        client.stop_stream()
    assert _sample(server, f"{first}_count", "repeat_int32") - before[f"{first}_count"] == 2
    assert _sample(server, f"{gap}_count", "repeat_int32") - before[f"{gap}_count"] == 3
    assert _sample(server, f"{first}_sum", "repeat_int32") - before[f"{first}_sum"] >= 0.02
    assert _sample(server, f"{gap}_sum", "repeat_int32") - before[f"{gap}_sum"] >= 0.09
    model_stats = client.get_inference_statistics("repeat_int32").model_stats[0]
    # Each request is one inference and one execution of the model, however many responses it made.
    assert model_stats.inference_count - inferences_before == 2
    assert model_stats.execution_count - executions_before == 2
    # The model's time making the responses (the DELAY before each: 110 ms in all), its waits left out.
    assert model_stats.inference_stats.compute_infer.ns - compute_before >= 100_000_000
    stats = model_stats.response_stats
    assert stats["2"].success.count - index_2_before == 1 and stats["2"].compute_infer.ns >= 30_000_000
    tricky = client.get_inference_statistics("tricky").model_stats[0].response_stats
    assert tricky["3"].fail.count - fail_before == 1
    assert "neuropod_stream_first_response_seconds_bucket" in server.metrics.render().decode()
