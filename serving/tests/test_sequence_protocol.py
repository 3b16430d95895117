"""Triton's sequence extension on REST and gRPC, as tritonclient speaks it.

One server (REST in a thread, the real gRPC server) serves ONNX accumulators
with implicit state: ``acc`` (numeric ids: its CORRID control is uint64),
``acc_str`` (string ids) and ``plain_acc`` (the same graph packaged without
state or controls, made stateful by a repository load whose Triton config
carries ``sequence_batching``). Each step's OUTPUT is the running sum of the
sequence's INPUTs (numpy's cumsum is the expected value), START resets it, and
ID echoes the id the server filled in. Errors are checked for their status and
their words on both protocols.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
grpc = pytest.importorskip("grpc")
httpx = pytest.importorskip("httpx")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from google.protobuf import json_format  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402
from tritonclient.grpc import model_config_pb2  # noqa: E402
from tritonclient.grpc import service_pb2 as triton_pb  # noqa: E402
from tritonclient.grpc import service_pb2_grpc as triton_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402
from tritonclient.utils import shared_memory as shm  # noqa: E402

from neuropod_serving.errors import ProtocolError  # noqa: E402
from neuropod_serving.server import BatchPolicy, Engine, ModelRegistry, create_app  # noqa: E402
from neuropod_serving.server.grpc_server import start_grpc_server  # noqa: E402
from neuropod_serving.server.model_config import model_config, model_config_message  # noqa: E402
from neuropod_serving.server.sequence_config import sequence_settings  # noqa: E402
from neuropod_serving.server.shm_regions import SharedMemoryRegistry  # noqa: E402

from conftest import onnx_package, private_caches, serve_in_thread  # noqa: E402

B = "batch"


def _accumulator(dest: Path, name: str, id_dtype: str, *, declared: bool) -> Path:
    """OUTPUT = (1 - START) * acc_in + INPUT (int32), the state acc_out = OUTPUT, ID = CORRID."""
    nodes = [
        helper.make_node("Sub", ["one", "START"], ["keep"]),
        helper.make_node("Mul", ["keep", "acc_in"], ["kept"]),
        helper.make_node("Add", ["kept", "INPUT"], ["OUTPUT"]),
        helper.make_node("Identity", ["OUTPUT"], ["acc_out"]),
        helper.make_node("Identity", ["CORRID"], ["ID"]),
    ]
    one = helper.make_tensor("one", TensorProto.INT32, [], [1])
    inputs = [
        ("INPUT", "int32", [B, 1]),
        ("START", "int32", [B, 1]),
        ("CORRID", id_dtype, [B, 1]),
        ("acc_in", "int32", [B, 1]),
    ]
    outputs = [("OUTPUT", "int32", [B, 1]), ("ID", id_dtype, [B, 1]), ("acc_out", "int32", [B, 1])]
    extra: dict[str, Any] = {}
    if declared:
        extra = {
            "state_spec": [{"input_name": "acc_in", "output_name": "acc_out"}],
            "sequence_controls": [
                {"name": "START", "kind": "CONTROL_SEQUENCE_START"},
                {"name": "CORRID", "kind": "CONTROL_SEQUENCE_CORRID"},
            ],
        }
    return onnx_package(dest / name, name, nodes, inputs, outputs, [one], **extra)


@pytest.fixture(scope="module")
def packages() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-seq-protocol-"))
    with private_caches(root):
        _accumulator(root, "acc", "uint64", declared=True)
        _accumulator(root, "acc_str", "string", declared=True)
        _accumulator(root, "plain_acc", "uint64", declared=False)
        yield root
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class Server:
    engine: Engine
    http: Any  # httpx.Client
    rest: Any  # tritonclient.http
    grpc: Any  # tritonclient.grpc
    stub: Any  # Triton's GRPCInferenceService stub
    grpc_url: str


@pytest.fixture(scope="module")
def server(packages: Path) -> Iterator[Server]:
    engine = Engine(ModelRegistry.load([packages]), shared_memory=SharedMemoryRegistry())
    grpc_server, grpc_port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
    try:
        with serve_in_thread(create_app(engine)) as port:
            rest = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
            url = f"127.0.0.1:{grpc_port}"
            client = grpcclient.InferenceServerClient(url)
            channel = grpc.insecure_channel(url)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                try:
                    yield Server(engine, http, rest, client, triton_grpc.GRPCInferenceServiceStub(channel), url)
                finally:
                    rest.close()
                    client.close()
                    channel.close()
    finally:
        grpc_server.stop(None)
        engine.close()


def _inputs(module: Any, value: int) -> list[Any]:
    x = module.InferInput("INPUT", [1, 1], "INT32")
    x.set_data_from_numpy(np.array([[value]], np.int32))
    return [x]


def _steps(values: list[int]) -> list[tuple[int, bool, bool]]:
    return [(v, i == 0, i == len(values) - 1) for i, v in enumerate(values)]


def _rest_step(s: Server, model: str, sid: Any, value: int, start: bool = False, end: bool = False) -> Any:
    return s.rest.infer(model, _inputs(httpclient, value), sequence_id=sid, sequence_start=start, sequence_end=end)


def _grpc_step(s: Server, model: str, sid: Any, value: int, start: bool = False, end: bool = False) -> Any:
    return s.grpc.infer(model, _inputs(grpcclient, value), sequence_id=sid, sequence_start=start, sequence_end=end)


@pytest.mark.parametrize("protocol", ["rest", "grpc"])
def test_interleaved_sequences_are_value_exact(server: Server, protocol: str) -> None:
    step = _rest_step if protocol == "rest" else _grpc_step
    # gRPC: tritonclient sends a numeric id as int64_param, so below 2**63 (larger ones: see the uint64 test).
    ids = [7, 2**63 - 1] if protocol == "grpc" else [7, 2**64 - 1]
    values = {ids[0]: [3, 1, 4, 1, 5], ids[1]: [9, 2, 6, 5, 3]}
    got: dict[int, list[int]] = {sid: [] for sid in ids}
    for i in range(5):
        for sid in ids:
            v, start, end = _steps(values[sid])[i]
            result = step(server, "acc", sid, v, start, end)
            got[sid].append(int(result.as_numpy("OUTPUT")[0, 0]))
            assert int(result.as_numpy("ID")[0, 0]) == sid
            assert result.as_numpy("acc_out") is None  # the state output is never answered
    for sid in ids:
        assert got[sid] == np.cumsum(values[sid]).tolist()
    assert server.engine.get("acc").model.live_sequences == 0  # END freed both


def test_string_ids_on_both_protocols(server: Server) -> None:
    values = [10, 20, 30]
    for step, sid in ((_rest_step, "rest-seq"), (_grpc_step, "grpc-seq")):
        out = []
        for v, start, end in _steps(values):
            result = step(server, "acc_str", sid, v, start, end)
            out.append(int(result.as_numpy("OUTPUT")[0, 0]))
            assert result.as_numpy("ID")[0, 0] == sid.encode()
        assert out == np.cumsum(values).tolist()


def _raw_request(model: str, sid_kind: str, sid: Any, value: int, start: bool, end: bool) -> Any:
    request = triton_pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
    tensor.contents.int_contents.append(value)
    setattr(request.parameters["sequence_id"], sid_kind, sid)
    request.parameters["sequence_start"].bool_param = start
    request.parameters["sequence_end"].bool_param = end
    return request


def _output(response: Any, name: str, dtype: Any) -> Any:
    index = [o.name for o in response.outputs].index(name)
    return np.frombuffer(response.raw_output_contents[index], dtype)[0]


def test_grpc_uint64_ids_and_int64_twos_complement(server: Server) -> None:
    # uint64_param carries any id below 2**64; an int64_param below 0 is read as its two's complement
    # (Triton reads the int64 as a uint64), so both name the same sequence.
    big = 2**64 - 3
    first = server.stub.ModelInfer(_raw_request("acc", "uint64_param", big, 4, True, False))
    assert _output(first, "OUTPUT", np.int32) == 4
    assert _output(first, "ID", np.uint64) == big
    second = server.stub.ModelInfer(_raw_request("acc", "int64_param", big - 2**64, 5, False, True))
    assert _output(second, "OUTPUT", np.int32) == 9
    assert _output(second, "ID", np.uint64) == big


def test_rest_json_body_with_a_large_id(server: Server) -> None:
    sid = 2**64 - 2
    for i, (v, start, end) in enumerate(_steps([2, 3])):
        body = {
            "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [v]}],
            "parameters": {"sequence_id": sid, "sequence_start": start, "sequence_end": end},
        }
        r = server.http.post("/v2/models/acc/infer", content=json.dumps(body))
        assert r.status_code == 200, r.text
        outputs = {o["name"]: o["data"] for o in r.json()["outputs"]}
        assert outputs["OUTPUT"] == [[2, 5][i]]
        assert outputs["ID"] == [sid]


def test_grpc_stream_runs_each_request_as_a_step_in_order(server: Server) -> None:
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        values = {11: [1, 2, 3, 4], 12: [10, 20, 30, 40]}
        for i in range(4):
            for sid, vs in values.items():
                v, start, end = _steps(vs)[i]
                client.async_stream_infer(
                    "acc",
                    _inputs(grpcclient, v),
                    sequence_id=sid,
                    sequence_start=start,
                    sequence_end=end,
                    request_id=f"{sid}-{i}",
                )
        # A step of a sequence that is not live: this request's error, and the stream goes on.
        client.async_stream_infer("acc", _inputs(grpcclient, 1), sequence_id=99, request_id="unknown")
        got: dict[int, list[int]] = {11: [], 12: []}
        order = []
        for _ in range(8):
            result, error = answers.get(timeout=30)
            assert error is None, error
            order.append(result.get_response().id)
            got[int(result.as_numpy("ID")[0, 0])].append(int(result.as_numpy("OUTPUT")[0, 0]))
        result, error = answers.get(timeout=30)
        assert result is None and "99" in str(error) and "not live" in str(error), error
    finally:
        client.stop_stream()
        client.close()
    assert order == [f"{sid}-{i}" for i in range(4) for sid in (11, 12)]
    for sid, vs in values.items():
        assert got[sid] == np.cumsum(vs).tolist()


def _refused(status: str, words: tuple[str, ...], call: Any, *args: Any, **kwargs: Any) -> None:
    """``call(*args, **kwargs)`` fails with tritonclient's ``status``, its message holding ``words``."""
    with pytest.raises(InferenceServerException) as info:
        call(*args, **kwargs)
    assert info.value.status() == status, info.value
    for word in words:
        assert word in info.value.message(), (word, info.value.message())


def test_errors_name_the_sequence_on_both_protocols(server: Server) -> None:
    for step, bad in ((_rest_step, "400"), (_grpc_step, "StatusCode.INVALID_ARGUMENT")):
        # Never started: the id and the missing sequence_start.
        _refused(bad, ("424242", "not live", "sequence_start"), step, server, "acc", 424242, 1)
        # No sequence at all, in Triton's words.
        _refused(bad, ("must specify a non-zero or non-empty correlation ID",), step, server, "acc", 0, 1)
        # A string id for a model whose ids are numbers.
        _refused(bad, ("numeric sequence ids",), step, server, "acc", "text", 1, True)
        # Ended: its next step is refused too.
        step(server, "acc", 31, 1, True, True)
        _refused(bad, ("31",), step, server, "acc", 31, 1)
    r = server.http.post(
        "/v2/models/acc/infer",
        json={
            "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}],
            "parameters": {"sequence_id": 5, "sequence_start": "yes"},
        },
    )
    assert r.status_code == 400 and "sequence_start must be a bool" in r.json()["error"], r.text
    r = server.http.post(
        "/v2/models/acc/infer",
        json={
            "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}],
            "parameters": {"sequence_id": -4},
        },
    )
    assert r.status_code == 400 and "out of range" in r.json()["error"], r.text
    request = _raw_request("acc", "double_param", 1.5, 1, True, False)
    with pytest.raises(grpc.RpcError) as info:
        server.stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "uint64_param or string_param" in info.value.details()


def test_too_many_live_sequences_is_429_and_resource_exhausted(server: Server) -> None:
    model = server.engine.get("acc").model
    limits = server.engine.sequence_limits
    model.configure_sequences(max_idle_s=limits.max_idle_us / 1e6, max_live=1)
    try:
        _rest_step(server, "acc", 51, 1, True)
        _refused("429", ("live sequences",), _rest_step, server, "acc", 52, 1, True)
        _refused("StatusCode.RESOURCE_EXHAUSTED", ("live sequences",), _grpc_step, server, "acc", 53, 1, True)
        assert int(_grpc_step(server, "acc", 51, 2, False, True).as_numpy("OUTPUT")[0, 0]) == 3
    finally:
        model.configure_sequences(max_idle_s=limits.max_idle_us / 1e6, max_live=limits.max_sequences)


def test_metadata_and_configuration(server: Server) -> None:
    for extensions in (server.rest.get_server_metadata()["extensions"], server.grpc.get_server_metadata().extensions):
        assert {"sequence", "sequence(string_id)"} <= set(extensions)
    metadata = server.rest.get_model_metadata("acc")
    assert metadata["parameters"]["neuropod_stateful"] is True
    assert [t["name"] for t in metadata["inputs"]] == ["INPUT"]  # the server fills the controls and the state
    assert [t["name"] for t in metadata["outputs"]] == ["OUTPUT", "ID"]
    assert "neuropod_stateful" not in server.rest.get_model_metadata("plain_acc").get("parameters", {})

    rest = server.rest.get_model_config("acc")
    theirs = server.grpc.get_model_config("acc", as_json=True)["config"]
    assert [t["name"] for t in rest["input"]] == ["INPUT"]
    assert "dynamic_batching" not in rest
    expected = {
        "control_input": [
            {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]},
            {"name": "CORRID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_UINT64"}]},
        ],
        "state": [
            {
                "input_name": "acc_in",
                "output_name": "acc_out",
                "data_type": "TYPE_INT32",
                "dims": [1, 1],
                "initial_state": [
                    {"data_type": "TYPE_INT32", "dims": [1, 1], "name": "acc_in_initial", "zero_data": True}
                ],
            }
        ],
        "direct": {},
    }
    # The server's idle limit (--max-sequence-idle-us) unless a load config sets the model's own.
    expected["max_sequence_idle_microseconds"] = server.engine.sequence_limits.max_idle_us
    assert rest["sequence_batching"] == expected
    # The gRPC answer is the same configuration in tritonclient's own message.
    message = json_format.ParseDict(theirs, model_config_pb2.ModelConfig())
    assert message.sequence_batching.control_input[1].control[0].data_type == model_config_pb2.TYPE_UINT64
    assert list(message.sequence_batching.state[0].dims) == [1, 1]
    assert message.sequence_batching.state[0].initial_state[0].zero_data is True
    assert message.sequence_batching.WhichOneof("strategy_choice") == "direct"


def _triton_config(**sequence_batching: Any) -> str:
    block = {
        "max_sequence_idle_microseconds": 5_000_000,
        "control_input": [
            {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]},
            {"name": "CORRID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_UINT64"}]},
        ],
        "state": [
            {
                "input_name": "acc_in",
                "output_name": "acc_out",
                "data_type": "TYPE_INT32",
                "dims": [1],
                "initial_state": [{"data_type": "TYPE_INT32", "dims": [1], "zero_data": True, "name": "z"}],
            }
        ],
        "direct": {},
    }
    block.update(sequence_batching)
    return json.dumps(
        {
            "name": "plain_acc",
            "max_batch_size": 1,
            "input": [{"name": "INPUT", "data_type": "TYPE_INT32", "dims": [1]}],
            "output": [{"name": "OUTPUT", "data_type": "TYPE_INT32", "dims": [1]}],
            "sequence_batching": block,
        }
    )


def test_a_load_config_with_sequence_batching_makes_a_model_stateful(server: Server) -> None:
    assert not server.engine.get("plain_acc").stateful
    try:
        server.rest.load_model("plain_acc", config=_triton_config())
        served = server.engine.get("plain_acc")
        assert served.stateful and [t.name for t in served.model.inputs] == ["INPUT"]
        assert served.settings is not None and served.settings.max_sequence_idle_us == 5_000_000
        config = server.rest.get_model_config("plain_acc")
        assert config["sequence_batching"]["max_sequence_idle_microseconds"] == 5_000_000
        assert config["sequence_batching"]["state"][0]["dims"] == [1, 1]
        values = [6, 7, 8]
        for step, sid in ((_rest_step, 2**64 - 9), (_grpc_step, 77)):
            out = [int(step(server, "plain_acc", sid, v, s, e).as_numpy("OUTPUT")[0, 0]) for v, s, e in _steps(values)]
            assert out == np.cumsum(values).tolist()
        # Refused, each naming what is wrong; the model loaded before keeps serving.
        refusals = [
            (
                {
                    "state": [
                        {
                            "input_name": "acc_in",
                            "output_name": "acc_out",
                            "data_type": "TYPE_INT32",
                            "dims": [1],
                            "initial_state": [{"data_file": "init.bin", "name": "z"}],
                        }
                    ]
                },
                "data_file",
            ),
            (
                {
                    "control_input": [
                        {"name": "NOPE", "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]}
                    ]
                },
                "NOPE",
            ),
            (
                {
                    "control_input": [
                        {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [1, 0]}]}
                    ]
                },
                "[0, 1]",
            ),
        ]
        for change, word in refusals:
            for client, status in ((server.rest, "400"), (server.grpc, "StatusCode.INVALID_ARGUMENT")):
                _refused(status, (word,), client.load_model, "plain_acc", config=_triton_config(**change))
        listed = json.loads(_triton_config())
        listed["input"].append({"name": "START", "data_type": "TYPE_INT32", "dims": [1]})
        _refused("400", ("input 'START' is a control or state tensor",), server.rest.load_model, "plain_acc",
                 config=json.dumps(listed))  # fmt: skip
        assert server.engine.get("plain_acc").stateful
    finally:
        server.rest.load_model("plain_acc")  # without a config: the package's own (stateless) declaration
    assert not server.engine.get("plain_acc").stateful


def test_sequence_settings_dims_follow_max_batch_size() -> None:
    block = {
        "state": [{"input_name": "h", "output_name": "h_out", "data_type": "TYPE_FP32", "dims": ["4"]}],
        "oldest": {"max_candidate_sequences": 16, "max_queue_delay_microseconds": 100, "preferred_batch_size": [4, 2]},
    }
    batched = sequence_settings(block, 8, "config")
    assert json.loads(batched.sequences) == {
        "state_spec": [
            {"input_name": "h", "output_name": "h_out", "dtype": "float32", "shape": [1, 4], "initial_state": "zero"}
        ]
    }
    assert (batched.max_sequences, batched.max_queue_delay_us, batched.preferred_batch_sizes) == (16, 100, (2, 4))
    assert json.loads(sequence_settings(block, 0, "config").sequences)["state_spec"][0]["shape"] == [4]
    for bad, word in (
        ({"iterative_sequence": True, **block}, "iterative_sequence"),
        ({"oldest": {}, "direct": {}, **block}, "both oldest and direct"),
        ({}, "nothing makes the model stateful"),
        ({"state": [{**block["state"][0], "dims": [-1]}]}, "dims"),
    ):
        with pytest.raises(ProtocolError, match=word.replace("(", r"\(")):
            sequence_settings(bad, 8, "config")


def test_one_sequence_across_both_protocols_with_inputs_in_shared_memory(server: Server) -> None:
    key = f"/neuropod_seq_protocol_{os.getpid()}"
    handle = shm.create_shared_memory_region("seq_in", key, 4)
    try:
        server.rest.register_system_shared_memory("seq_in", key, 4)
        values = [5, 6, 7]
        out = []
        for (v, start, end), (module, client) in zip(
            _steps(values), [(httpclient, server.rest), (grpcclient, server.grpc), (httpclient, server.rest)]
        ):
            shm.set_shared_memory_region(handle, [np.array([[v]], np.int32)])
            x = module.InferInput("INPUT", [1, 1], "INT32")
            x.set_shared_memory("seq_in", 4)
            result = client.infer("acc", [x], sequence_id=61, sequence_start=start, sequence_end=end)
            out.append(int(result.as_numpy("OUTPUT")[0, 0]))
        assert out == np.cumsum(values).tolist()
    finally:
        server.rest.unregister_system_shared_memory("seq_in")
        shm.destroy_shared_memory_region(handle)


def test_configuration_of_a_sequence_batched_model(packages: Path) -> None:
    engine = Engine(ModelRegistry.load([packages / "acc"]), batching=BatchPolicy(8, 0.0005))
    try:
        config = model_config(engine, engine.get("acc"))
    finally:
        engine.close()
    limits = engine.sequence_limits
    assert config["max_batch_size"] == 8 and "dynamic_batching" not in config
    block = config["sequence_batching"]
    # Sequences share runs (Triton's oldest strategy); a state's dims leave out the batch dimension.
    assert block["oldest"] == {"max_queue_delay_microseconds": 500, "max_candidate_sequences": limits.max_sequences}
    assert block["max_sequence_idle_microseconds"] == limits.max_idle_us
    assert block["state"][0]["dims"] == [1] and block["state"][0]["initial_state"][0]["dims"] == [1]
    assert [t["dims"] for t in config["input"]] == [[1]]
    # The gRPC message, read back by tritonclient's own class, holds the same block.
    wire = model_config_message(config).SerializeToString()
    theirs = triton_pb.ModelConfigResponse.FromString(wire).config
    assert theirs.sequence_batching == json_format.ParseDict(block, model_config_pb2.ModelSequenceBatching())
    assert theirs.sequence_batching.WhichOneof("strategy_choice") == "oldest"
