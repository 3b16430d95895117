"""The protobuf wire path for big tensors (protocol/_wire.py) agrees with protobuf itself."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("google.protobuf")

from neuropod_serving.protocol import ProtocolError, _forms
from neuropod_serving.protocol import grpc_codec as codec
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol._wire import WIRE_THRESHOLD, _varint, append_raw, encode_varint, split_raw
from neuropod_serving.protocol.grpc_codec import infer_request, plans
from neuropod_serving.protocol.grpc_codec.tensors import RAW_INPUT_FIELD, RAW_OUTPUT_FIELD


def test_field_numbers_are_the_protos() -> None:
    assert pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number == RAW_INPUT_FIELD
    assert pb.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number == RAW_OUTPUT_FIELD


@settings(max_examples=200, deadline=None)
@given(
    raws=st.lists(st.binary(max_size=300), max_size=6),
    name=st.text(max_size=20),
    version=st.text(max_size=5),
    params=st.dictionaries(st.text(min_size=1, max_size=5), st.integers(-(2**63), 2**63 - 1), max_size=3),
)
def test_split_and_append_agree_with_protobuf(raws: list[bytes], name: str, version: str, params: dict[str, int]) -> None:
    message = pb.ModelInferResponse(model_name=name, model_version=version, raw_output_contents=raws)
    for key, value in params.items():
        message.parameters[key].int64_param = value
    data = message.SerializeToString()
    rest, views = split_raw(data, RAW_OUTPUT_FIELD)
    assert [bytes(v) for v in views] == raws
    parsed = pb.ModelInferResponse.FromString(rest)
    assert parsed.model_name == name and parsed.model_version == version and not parsed.raw_output_contents
    assert dict(codec.parameters_from_proto(parsed.parameters)) == params
    # Appending them again gives a message protobuf reads as the original.
    head = pb.ModelInferResponse(model_name=name, model_version=version, parameters=message.parameters)
    again = pb.ModelInferResponse.FromString(append_raw(head.SerializeToString(), RAW_OUTPUT_FIELD, raws))
    assert again == message


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**21, 2**35, 2**63 - 1])
def test_varints(value: int) -> None:
    data = encode_varint(value)
    assert _varint(data, 0, len(data)) == (value, len(data))


@pytest.mark.parametrize(
    "data",
    [
        b"\x3a\xff",  # field 7, a length that runs past the end
        b"\x3a\x05abc",  # field 7, 5 bytes promised, 3 given
        b"\x0a",  # field 1 with no length
        b"\x3b",  # wire type 3 (a group): not in this proto
        b"\x08" + b"\xff" * 11,  # a varint longer than 10 bytes
    ],
)
def test_malformed_messages_are_protocol_errors(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed"):
        split_raw(data, RAW_INPUT_FIELD)


def test_big_requests_and_answers_round_trip_without_copies() -> None:
    image = np.random.default_rng(0).integers(0, 255, (600, 800, 3), dtype=np.uint8)
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    data = codec.serialize_model_infer_request("m", {"image": image, "s": np.array(["a", "é"]), "f": small[:, ::2]})
    assert len(data) > WIRE_THRESHOLD
    # Protobuf reads what the wire path wrote, and the wire path reads it as views of the bytes.
    plain = codec.parse_model_infer_request(pb.ModelInferRequest.FromString(data))
    first = codec.deserialize_model_infer_request(data).decode()  # the full decode, which learns the form
    fast = codec.deserialize_model_infer_request(data).decode()  # the form's plan
    for decoded in (plain, first, fast):
        np.testing.assert_array_equal(decoded.inputs["image"], image)
        assert decoded.inputs["s"].tolist() == ["a", "é"]
        np.testing.assert_array_equal(decoded.inputs["f"], small[:, ::2])
    assert fast.inputs["image"].base is not None and not fast.inputs["image"].flags.owndata

    answer = codec.serialize_model_infer_response("m", {"image": image, "x": np.float32(2.5).reshape(())}, id="7")
    assert pb.ModelInferResponse.FromString(answer) == codec.build_model_infer_response(
        "m", {"image": image, "x": np.float32(2.5).reshape(())}, id="7"
    )
    decoded = codec.deserialize_model_infer_response(answer)
    np.testing.assert_array_equal(decoded.outputs["image"], image)
    assert decoded.outputs["x"].shape == () and decoded.outputs["x"] == 2.5 and decoded.id == "7"
    assert not decoded.outputs["image"].flags.owndata and not decoded.outputs["image"].flags.writeable
    # Small messages take protobuf's path and give the same bytes as before.
    assert codec.serialize_model_infer_request("m", {"f": small}) == codec.build_model_infer_request(
        "m", {"f": small}
    ).SerializeToString()


def test_a_malformed_big_request_is_invalid_argument_from_the_server() -> None:
    grpc = pytest.importorskip("grpc")
    from neuropod_serving.server import Engine, ModelRegistry
    from neuropod_serving.server.grpc_server import start_grpc_server

    engine = Engine(ModelRegistry())
    server, port = start_grpc_server(engine, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            body = b"\x0a\x01m" + b"\x3a" + encode_varint(WIRE_THRESHOLD * 2) + b"x" * WIRE_THRESHOLD
            with pytest.raises(grpc.RpcError) as e:
                call(body, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed" in e.value.details()
    finally:
        server.stop(None)
        engine.close()


def _spec(name: str, dtype: str) -> dict[str, object]:
    from neuropod.spec import parse_spec

    return {s.name: s for s in parse_spec([{"name": name, "dtype": dtype, "shape": [None, None]}], "m")}


def test_a_learnt_form_still_checks_every_call() -> None:
    """Once a form of request is learnt, each call is still checked: its datatype against the
    spec it is decoded with, each raw content's size, BOOL's bytes; a fault takes the full
    decode, which words it."""
    ok = np.array([[True, False]])
    data = codec.serialize_model_infer_request("m", {"b": ok})
    for _ in range(2):  # learn, then use the plan
        np.testing.assert_array_equal(codec.deserialize_model_infer_request(data).decode(_spec("b", "bool")).inputs["b"], ok)
    with pytest.raises(ProtocolError, match="disagrees with the model's spec"):
        codec.deserialize_model_infer_request(data).decode(_spec("b", "int8"))
    with pytest.raises(ProtocolError, match="not one of this model's inputs"):
        codec.deserialize_model_infer_request(data).decode(_spec("c", "bool"))
    bad = data[:-1] + b"\x07"  # the same form, a BOOL byte that is not 0 or 1
    with pytest.raises(ProtocolError, match="0 or 1"):
        codec.deserialize_model_infer_request(bad).decode(_spec("b", "bool"))
    short = data[:-3] + b"\x01\x01"  # the same form's metadata, one byte of raw contents for two
    with pytest.raises(ProtocolError, match="needs 2 bytes"):
        codec.deserialize_model_infer_request(short).decode(_spec("b", "bool"))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    dtype=st.sampled_from(["float32", "int64", "uint8", "bool", "float16", "string"]),
)
def test_planned_and_full_decodes_agree(rows: list[int], dtype: str) -> None:
    """Requests and answers of changing shapes and values: every decode (learnt form or not)
    gives what protobuf's own parse gives."""
    from neuropod.testing import sample

    for i, n in enumerate(rows):
        arrays = {"a": sample(dtype, (n, 2) if dtype != "string" else (n,), i), "z": np.arange(n, dtype=np.int32)}
        data = codec.serialize_model_infer_request("m", arrays, outputs=["o"])
        expected = codec.parse_model_infer_request(pb.ModelInferRequest.FromString(data))
        got = codec.deserialize_model_infer_request(data).decode()
        assert got.outputs == expected.outputs == {"o": None}
        answer = codec.deserialize_model_infer_response(codec.serialize_model_infer_response("m", arrays, id=str(i)))
        assert answer.id == str(i)
        for decoded in (got.inputs, answer.outputs):
            for name, want in expected.inputs.items():
                assert decoded[name].dtype == want.dtype and decoded[name].shape == want.shape
                assert decoded[name].tolist() == want.tolist() == arrays[name].tolist()


def test_the_plan_caches_are_bounded() -> None:
    for n in range(plans.PLAN_LIMIT + 10):
        data = codec.serialize_model_infer_request("m", {"a": np.zeros((1, n + 1), np.float32)})
        codec.deserialize_model_infer_request(data).decode()
    assert 0 < infer_request._REQUESTS_READ._plans._used <= _forms.BUDGET  # received forms: bounded in bytes
    assert len(infer_request._REQUEST_HEADS._plans) <= plans.PLAN_LIMIT


def test_lists_are_encoded_the_full_way() -> None:
    data = codec.serialize_model_infer_request("m", {"a": [[1.0, 2.0]], "s": ["x"]})  # type: ignore[dict-item]
    decoded = codec.deserialize_model_infer_request(data).decode()
    assert decoded.inputs["a"].tolist() == [[1.0, 2.0]] and decoded.inputs["s"].tolist() == ["x"]
