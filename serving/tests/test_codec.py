"""The Open Inference Protocol codec: round trips, metadata, and every bad input a client can send."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from neuropod.errors import NeuropodError
from neuropod.spec import TensorSpec, parse_spec
from neuropod_serving.protocol import (
    DATATYPES,
    ProtocolError,
    build_infer_request,
    build_infer_response,
    datatype_of,
    decode_tensor,
    encode_tensor,
    model_metadata,
    parse_infer_request,
    parse_infer_response,
    spec_from_metadata,
    specs_from_model_metadata,
    tensor_metadata,
)

NUMERIC = [d for d, s in DATATYPES.items() if s != "string"]
TEXTS = ["plain", "", "nul\x00inside", "trailing nul\x00", "é ü ß", "日本語", "emoji 🙂", "\x00"]


def _sample(datatype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """Values that use each dtype's whole range: its extremes, and for floats NaN-free fractions."""
    dtype = np.dtype(DATATYPES[datatype])
    count = int(np.prod(shape))
    rng = np.random.default_rng(count)
    if dtype.kind == "b":
        values = rng.integers(0, 2, count).astype(bool)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
        values[:2] = [info.min, info.max][: min(2, count)]
    else:
        values = (rng.standard_normal(count) * 1000).astype(dtype)
        values[:2] = [np.finfo(dtype).max, np.finfo(dtype).tiny][: min(2, count)]
    return values.reshape(shape)


def _request_round_trip(inputs: dict[str, np.ndarray[Any, Any]], *, binary: bool) -> dict[str, np.ndarray[Any, Any]]:
    body = build_infer_request(inputs, binary=binary)
    assert (body.json_length is not None) == (binary and bool(inputs))
    json_length = None if body.json_length is None else str(body.json_length)
    return parse_infer_request(body.content, json_length).inputs


def _assert_same(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
    assert got.shape == want.shape
    if want.dtype.kind in "UO":
        assert got.dtype == object
        assert got.tolist() == want.tolist()
    else:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


# --- round trips -------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", NUMERIC)
def test_every_numeric_datatype_round_trips(datatype: str, binary: bool) -> None:
    want = _sample(datatype, (3, 4))
    got = _request_round_trip({"t": want}, binary=binary)["t"]
    _assert_same(got, want)
    assert datatype_of(got) == datatype


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_strings_with_non_ascii_and_nul_round_trip(binary: bool) -> None:
    want = np.array(TEXTS, dtype=object).reshape(2, 4)
    got = _request_round_trip({"s": want}, binary=binary)["s"]
    _assert_same(got, want)


def test_numpy_unicode_arrays_are_sent_as_bytes() -> None:
    want = np.array([["a", "é"], ["日本", ""]])
    got = _request_round_trip({"s": want}, binary=True)["s"]
    _assert_same(got, want)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", [*NUMERIC, "BYTES"])
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 2, 5)])
def test_zero_sized_tensors_round_trip(datatype: str, shape: tuple[int, ...], binary: bool) -> None:
    want = np.empty(shape, dtype=object) if datatype == "BYTES" else np.empty(shape, dtype=DATATYPES[datatype])
    got = _request_round_trip({"t": want}, binary=binary)["t"]
    assert got.shape == shape
    assert got.dtype == (object if datatype == "BYTES" else np.dtype(DATATYPES[datatype]))


def test_scalars_round_trip() -> None:
    for binary in (False, True):
        got = _request_round_trip({"x": np.array(2.5, np.float64)}, binary=binary)["x"]
        assert got.shape == () and got == 2.5


def test_binary_wire_format_is_little_endian_with_length_prefixed_strings() -> None:
    body = build_infer_request(
        {"x": np.array([1, 256], np.dtype(">i4")), "b": np.array([True, False]), "s": np.array(["é", ""], object)}
    )
    assert body.json_length is not None
    header = json.loads(body.content[: body.json_length])
    assert [i["parameters"]["binary_data_size"] for i in header["inputs"]] == [8, 2, 4 + 2 + 4]
    raw = body.content[body.json_length :]
    assert raw == struct.pack("<ii", 1, 256) + b"\x01\x00" + struct.pack("<I", 2) + "é".encode() + struct.pack("<I", 0)


def test_binary_inputs_are_views_of_the_body_not_copies() -> None:
    want = np.arange(1000, dtype=np.float32)
    body = build_infer_request({"x": want})
    got = parse_infer_request(body.content, body.json_length).inputs["x"]
    assert np.shares_memory(got, np.frombuffer(body.content, np.uint8))
    assert not got.flags.writeable


def test_non_contiguous_arrays_are_encoded_in_row_major_order() -> None:
    base = np.arange(24, dtype=np.int16).reshape(4, 6)
    want = base[::2, ::-3].T
    for binary in (False, True):
        _assert_same(_request_round_trip({"x": want}, binary=binary)["x"], want)


def test_nested_json_data_is_read_in_row_major_order() -> None:
    want = np.arange(12, dtype=np.int64).reshape(2, 3, 2)
    for data in (want.tolist(), want.ravel().tolist(), want.reshape(6, 2).tolist()):
        body = {"inputs": [{"name": "x", "datatype": "INT64", "shape": [2, 3, 2], "data": data}]}
        _assert_same(parse_infer_request(json.dumps(body).encode()).inputs["x"], want)
    strings = {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2, 2], "data": [["a", "b"], ["c", "d"]]}]}
    assert parse_infer_request(json.dumps(strings).encode()).inputs["s"].tolist() == [["a", "b"], ["c", "d"]]


def test_json_numbers_fill_float_tensors_and_bools_fill_bool_tensors() -> None:
    body = {
        "inputs": [
            {"name": "f", "datatype": "FP16", "shape": [3], "data": [1, 2.5, -0.125]},
            {"name": "b", "datatype": "BOOL", "shape": [2], "data": [True, False]},
            {"name": "u", "datatype": "UINT64", "shape": [1], "data": [2**64 - 1]},
        ]
    }
    got = parse_infer_request(json.dumps(body).encode()).inputs
    _assert_same(got["f"], np.array([1, 2.5, -0.125], np.float16))
    _assert_same(got["b"], np.array([True, False]))
    _assert_same(got["u"], np.array([2**64 - 1], np.uint64))


def test_mixed_json_and_binary_inputs_in_one_request() -> None:
    x, y = np.arange(4, dtype=np.float32), np.array(["a", "b"], object)
    header = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 16}},
            {"name": "j", "datatype": "INT8", "shape": [2], "data": [-1, 1]},
            {"name": "y", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 10}},
        ]
    }
    text = json.dumps(header).encode()
    body = text + x.tobytes() + b"".join(struct.pack("<I", 1) + s.encode() for s in y)
    got = parse_infer_request(body, len(text)).inputs
    _assert_same(got["x"], x)
    _assert_same(got["j"], np.array([-1, 1], np.int8))
    _assert_same(got["y"], y)


def test_response_honours_per_output_and_default_binary_choices() -> None:
    outputs = {"a": np.arange(3, dtype=np.int32), "b": np.array(["ok"], object), "c": np.ones(2, np.float64)}
    header = {
        "inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [1]}],
        "outputs": [{"name": "a", "parameters": {"binary_data": True}}, {"name": "b"}, {"name": "c", "parameters": {"binary_data": False}}],
        "parameters": {"binary_data_output": True},
        "id": "req-7",
    }
    request = parse_infer_request(json.dumps(header).encode())
    assert request.outputs == {"a": True, "b": None, "c": False}
    binary = request.binary_outputs(outputs)
    assert binary == {"a", "b"}
    body = build_infer_response("m", outputs, binary=binary, model_version="1", id=request.id)
    assert body.json_length is not None
    sent = json.loads(body.content[: body.json_length])
    assert [("data" in o, "binary_data_size" in o.get("parameters", {})) for o in sent["outputs"]] == [
        (False, True), (False, True), (True, False),
    ]  # fmt: skip
    response = parse_infer_response(body.content, body.json_length)
    assert (response.model_name, response.model_version, response.id) == ("m", "1", "req-7")
    for name, want in outputs.items():
        _assert_same(response.outputs[name], want)


def test_all_json_response_has_no_header_length() -> None:
    body = build_infer_response("m", {"y": np.array([1.5], np.float32)})
    assert body.json_length is None
    assert json.loads(body.content)["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [1], "data": [1.5]}]


def test_encode_tensor_json_form_matches_the_kserve_example() -> None:
    obj, raw = encode_tensor("input0", np.array([[1, 2], [3, 4]], np.int32), binary=False)
    assert raw is None
    assert obj == {"name": "input0", "datatype": "INT32", "shape": [2, 2], "data": [1, 2, 3, 4]}


# --- metadata ----------------------------------------------------------------

SPEC = parse_spec(
    [
        {"name": "x", "dtype": "float32", "shape": ["batch_size", 2, None]},
        {"name": "words", "dtype": "string", "shape": ["batch_size"]},
        {"name": "mask", "dtype": "bool", "shape": []},
    ],
    "test spec",
)


def test_metadata_from_a_spec_maps_symbols_and_nulls_to_minus_one() -> None:
    meta = tensor_metadata(SPEC[0])
    assert meta == {
        "name": "x",
        "datatype": "FP32",
        "shape": [-1, 2, -1],
        "parameters": {"neuropod_shape": '["batch_size", 2, null]'},
    }
    assert tensor_metadata(SPEC[1])["datatype"] == "BYTES"


def test_metadata_round_trips_to_the_exact_spec() -> None:
    meta = model_metadata("m", SPEC, SPEC[:1], platform="onnx", versions=["1"])
    meta = json.loads(json.dumps(meta))  # what a client receives
    assert meta["name"] == "m" and meta["platform"] == "onnx" and meta["versions"] == ["1"]
    assert specs_from_model_metadata(meta) == (SPEC, SPEC[:1])


def test_metadata_from_another_server_reads_minus_one_as_any_size() -> None:
    spec = spec_from_metadata({"name": "x", "datatype": "INT64", "shape": [-1, 3]})
    assert spec == TensorSpec("x", "int64", (None, 3))
    # Triton's models name tensors with '/', ':' and '.'.
    named = spec_from_metadata({"name": "InceptionV3/Predictions/Softmax:0", "datatype": "FP32", "shape": [-1, 3]})
    assert named == TensorSpec("InceptionV3/Predictions/Softmax:0", "float32", (None, 3))


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"name": "x", "datatype": "BF16", "shape": [1]}, "'x': datatype BF16 is not supported"),
        ({"name": "x", "datatype": "FP8", "shape": [1]}, "'x': datatype 'FP8' is not one of"),
        ({"name": "x", "datatype": "FP32", "shape": [-2]}, "'x': 'shape' must be a list of sizes >= 0 or -1"),
        ({"name": "x", "datatype": "FP32", "shape": [-1], "parameters": {"neuropod_shape": "[2]"}}, "entry 0 is 2 where shape says -1"),
        ({"name": "x", "datatype": "FP32", "shape": [3], "parameters": {"neuropod_shape": '["n"]'}}, "entry 0 is 'n' where shape says 3"),
        ({"name": "x", "datatype": "FP32", "shape": [-1], "parameters": {"neuropod_shape": "[[]"}}, "is not JSON"),
        ({"name": "x", "datatype": "FP32", "shape": [-1], "parameters": {"neuropod_shape": '["not a symbol"]'}}, "'x'"),
        ({"name": "a\nb", "datatype": "FP32", "shape": [1]}, "'a\\nb'"),  # '/' is fine (Triton's names have it)
    ],
)
def test_bad_metadata_names_the_tensor(meta: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError, match=None) as info:
        spec_from_metadata(meta)
    assert message in str(info.value)


# --- bad input -----------------------------------------------------------------


def _json_request(*inputs: dict[str, Any], **extra: Any) -> bytes:
    return json.dumps({"inputs": list(inputs), **extra}).encode()


def _error(body: bytes, json_length: int | str | None = None, **kwargs: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_infer_request(body, json_length, **kwargs)
    assert isinstance(info.value, NeuropodError)
    return info.value


def _x(**fields: Any) -> dict[str, Any]:
    return {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0], **fields}


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (_x(datatype="FLOAT"), "tensor 'x': datatype 'FLOAT' is not one of BOOL, UINT8"),
        (_x(datatype="BF16"), "tensor 'x': datatype BF16 is not supported"),
        (_x(shape=[3]), "tensor 'x': shape [3] holds 3 elements, but 'data' has 2"),
        (_x(shape=[2, -1]), "tensor 'x': shape[1] is -1; a dim is an integer >= 0"),
        (_x(shape=[2.0]), "tensor 'x': shape[0] is 2.0"),
        (_x(shape=[True, 2]), "tensor 'x': shape[0] is True"),
        (_x(shape="2"), "tensor 'x': 'shape' must be a list"),
        (_x(shape=[1] * 33, data=[1.0]), "tensor 'x': shape has 33 dims"),
        (_x(shape=[2**40, 2**40], data=[]), "tensor 'x': shape [1099511627776, 1099511627776] has"),
        (_x(data=[1.0, "2"]), "tensor 'x': FP32 data must be JSON numbers; got strings"),
        (_x(data=[[1.0], [2.0, 3.0]]), "tensor 'x': 'data' must be a list"),
        (_x(data=[True, False]), "tensor 'x': FP32 data must be JSON numbers"),
        # numpy reads a true or false among numbers as 1 or 0: still refused.
        (_x(data=[1.5, True]), "tensor 'x': FP32 data must be JSON numbers; got true or false among them"),
        (_x(data=[[False], [2.5]], shape=[2, 1]), "tensor 'x': FP32 data must be JSON numbers; got true or false"),
        (_x(datatype="INT64", data=[7, True]), "tensor 'x': INT64 data must be JSON integers; got true or false"),
        (_x(data=[None, None]), "tensor 'x': FP32 data must be JSON numbers; got null"),
        (_x(datatype="INT32", data=[1, 2.5]), "tensor 'x': INT32 data must be JSON integers"),
        (_x(datatype="UINT8", data=[1, 256]), "tensor 'x': UINT8 data must lie in [0, 255]"),
        (_x(datatype="INT8", data=[-129, 0]), "tensor 'x': INT8 data must lie in [-128, 127]"),
        (_x(datatype="UINT64", data=[-1, 2**64]), "tensor 'x': UINT64 data must lie in [0, 18446744073709551615]"),
        (_x(datatype="INT64", data=[1, 2**63]), "tensor 'x': INT64 data must lie in [-9223372036854775808"),
        (_x(datatype="UINT64", data=[1.5, 2**64]), "tensor 'x': UINT64 data must be JSON integers"),
        (_x(datatype="BOOL", data=[0, 1]), "tensor 'x': BOOL data must be true or false"),
        (_x(datatype="BYTES", data=["a", 1]), "tensor 'x': BYTES data must be JSON strings; element 1 is a int"),
        (_x(datatype="BYTES", data=["a", "\ud800"]), "tensor 'x': BYTES data must be valid Unicode"),
        ({"name": "x", "datatype": "FP32", "shape": [1]}, "tensor 'x' has neither 'data' nor parameters.binary_data_size"),
        ({"datatype": "FP32", "shape": [1], "data": [1]}, "inputs[0]: 'name' must be a non-empty string"),
        (_x(parameters={"binary_data_size": -1}), "input 'x': binary_data_size must be a byte count"),
        (_x(parameters=[1]), "input 'x': 'parameters' must be an object"),
    ],
)
def test_bad_json_tensors_name_the_tensor(tensor: dict[str, Any], message: str) -> None:
    error = _error(_json_request(tensor))
    assert message in str(error), str(error)
    assert error.status == 400


def test_numbers_that_equal_true_and_false_are_numbers() -> None:
    body = _json_request(_x(data=[1.0, 0.0]), {**_x(data=[0, 1]), "name": "i", "datatype": "INT64"})
    inputs = parse_infer_request(body).inputs
    assert inputs["x"].tolist() == [1.0, 0.0] and inputs["i"].tolist() == [0, 1]


def test_bad_request_structure() -> None:
    assert "not valid JSON" in str(_error(b'{"inputs": [}'))
    assert "not valid JSON" in str(_error(b""))
    assert "nests more than" in str(_error(b"[" * 100_000 + b"]" * 100_000))
    assert "must be a JSON object, not a list" in str(_error(b"[]"))
    assert "inputs must be a JSON list, not missing" in str(_error(b"{}"))
    assert "JSON is not UTF-8" in str(_error(b'{"inputs": "\xff"}'))
    assert "input 'x' appears twice" in str(_error(_json_request(_x(), _x())))
    assert "request outputs[0]: 'name'" in str(_error(_json_request(_x(), outputs=[{}])))
    error = _error(_json_request(_x(), outputs=[{"name": "y", "parameters": {"binary_data": "yes"}}]))
    assert "output 'y': parameters.binary_data must be true or false" in str(error)
    error = _error(_json_request(_x(), parameters={"binary_data_output": 1}))
    assert "binary_data_output must be true or false" in str(error)
    assert "'id' must be a string" in str(_error(_json_request(_x(), id=5)))


def test_a_json_header_over_the_bound_is_413() -> None:
    from neuropod import _json

    body = b" " * (_json.MAX_BYTES + 1)
    error = _error(body)
    assert error.status == 413 and "send large tensors as binary data" in str(error)


def _binary_request(tensors: list[tuple[dict[str, Any], bytes]], trailing: bytes = b"") -> tuple[bytes, int]:
    text = json.dumps({"inputs": [t for t, _ in tensors]}).encode()
    return text + b"".join(raw for _, raw in tensors) + trailing, len(text)


def _bx(size: int, **fields: Any) -> dict[str, Any]:
    return {"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": size}, **fields}


def test_bad_binary_bodies_name_the_tensor() -> None:
    two = np.ones(2, np.float32).tobytes()
    cases: list[tuple[bytes, int | str | None, str]] = [
        (*_binary_request([(_bx(12), two)]), "input 'x': binary_data_size 12 runs past the body: 8 bytes"),
        (*_binary_request([(_bx(4, shape=[1]), two)]), "holds 8 bytes of binary data after its JSON, but the inputs' binary_data_size add up to 4"),
        (*_binary_request([(_bx(8), two)], b"extra"), "holds 13 bytes of binary data after its JSON, but the inputs' binary_data_size add up to 8"),
        (*_binary_request([(_bx(4, shape=[1]), two[:4]), (_bx(4, name="y"), two[:4])]), "tensor 'y': shape [2] of FP32 needs 8 bytes (2 x 4), but binary_data_size is 4"),
        (*_binary_request([(_bx(8, data=[1, 2]), two)]), "input 'x' has both 'data' and binary_data_size"),
        (*_binary_request([(_bx(2, datatype="BOOL"), b"\x01\x02")]), "tensor 'x': BOOL bytes must be 0 or 1"),
        (*_binary_request([(_bx(6, datatype="BYTES"), struct.pack("<I", 1) + b"a\x00")]), "holds 2 BYTES elements, which need at least 8 bytes"),
        (*_binary_request([(_bx(8, datatype="BYTES"), struct.pack("<I", 9) + b"abcd")]), "tensor 'x': BYTES element 0 says it is 9 bytes long"),
        (*_binary_request([(_bx(10, datatype="BYTES"), struct.pack("<I", 1) + b"\xff" + struct.pack("<I", 1) + b"a")]), "tensor 'x': BYTES element 0 is not UTF-8"),
        (*_binary_request([(_bx(11, datatype="BYTES"), struct.pack("<I", 1) + b"a" + struct.pack("<I", 1) + b"bc")]), "2 BYTES elements of shape [2] fill 10 bytes, but binary_data_size is 11"),
        (*_binary_request([(_bx(8, shape=[2**62, 4]), two)]), "has 18446744073709551616 elements, more than an int64 can count"),
        (_binary_request([(_bx(8), two)])[0], 10_000, "Inference-Header-Content-Length is 10000, but the whole body is only"),
        (_binary_request([(_bx(8), two)])[0], "12abc", "Inference-Header-Content-Length must be a byte count"),
        (_binary_request([(_bx(8), two)])[0], "-1", "Inference-Header-Content-Length must be a byte count"),
        (_binary_request([(_bx(8), b"")])[0], None, "is the Inference-Header-Content-Length header missing?"),
    ]
    for body, length, message in cases:
        error = _error(body, length)
        assert message in str(error), (message, str(error))


def test_the_spec_refuses_unknown_inputs_and_other_datatypes() -> None:
    spec = parse_spec([{"name": "x", "dtype": "int64", "shape": ["batch_size"]}], "test")
    error = _error(_json_request(_x()), input_spec=spec)
    assert "tensor 'x': datatype FP32 disagrees with the model's spec (x: int64 [batch_size]), which needs INT64" in str(error)
    error = _error(_json_request(_x(name="z")), input_spec=spec)
    assert "input 'z' is not one of this model's inputs: x" in str(error)
    ok = parse_infer_request(_json_request(_x(datatype="INT64", data=[1, 2])), input_spec=spec)
    _assert_same(ok.inputs["x"], np.array([1, 2], np.int64))


def test_encoding_refuses_what_the_protocol_cannot_carry() -> None:
    with pytest.raises(ProtocolError, match="tensor 'c': numpy dtype complex64 has no Open Inference Protocol datatype"):
        encode_tensor("c", np.zeros(2, np.complex64), binary=True)
    with pytest.raises(ProtocolError, match="tensor 's': a BYTES tensor holds str, but element 1 is a bytes"):
        encode_tensor("s", np.array(["a", b"b"], object), binary=False)
    with pytest.raises(ProtocolError, match="tensor 's': a string holds a lone surrogate"):
        encode_tensor("s", np.array(["\udc80"], object), binary=True)


def test_decode_tensor_alone_checks_its_object() -> None:
    with pytest.raises(ProtocolError, match="tensor must be an object"):
        decode_tensor([1, 2])


def test_importing_the_codec_imports_no_framework_or_server_library() -> None:
    code = (
        "import sys, neuropod_serving, neuropod_serving.protocol\n"
        "bad = {'torch', 'tensorflow', 'onnxruntime', 'tensorrt', 'starlette', 'uvicorn', 'grpc', 'fastapi',"
        " 'prometheus_client', 'ray', 'tritonclient', 'httpx', 'aiohttp'}\n"
        "print(sorted(bad & {m.split('.')[0] for m in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- properties ----------------------------------------------------------------

_DTYPES = st.sampled_from([np.dtype(DATATYPES[d]) for d in NUMERIC])
_SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


@st.composite
def _arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    if draw(st.booleans()):
        return draw(hnp.arrays(_DTYPES, _SHAPES))
    texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
    shape = draw(_SHAPES)
    values = draw(st.lists(texts, min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array.reshape(shape)


@settings(max_examples=300, deadline=None)
@given(arrays=st.lists(_arrays(), min_size=1, max_size=3), binary=st.booleans())
def test_random_arrays_round_trip_through_both_encodings(arrays: list[np.ndarray[Any, Any]], binary: bool) -> None:
    inputs = {f"t{i}": a for i, a in enumerate(arrays)}
    got = _request_round_trip(inputs, binary=binary)
    for name, want in inputs.items():
        if want.dtype.kind == "f":  # NaN != NaN, so compare the bits, which JSON must keep too
            assert got[name].dtype == want.dtype and got[name].shape == want.shape
            np.testing.assert_array_equal(np.isnan(got[name]), np.isnan(want))
            np.testing.assert_array_equal(np.nan_to_num(got[name]), np.nan_to_num(want))
        else:
            _assert_same(got[name], want)
    response = build_infer_response("m", inputs, binary=binary)
    back = parse_infer_response(response.content, response.json_length).outputs
    assert list(back) == list(inputs)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.binary(max_size=400), json_length=st.one_of(st.none(), st.integers(-5, 500), st.text(max_size=5)))
def test_random_bodies_raise_nothing_but_protocol_error(body: bytes, json_length: int | str | None) -> None:
    try:
        parse_infer_request(body, json_length)
    except ProtocolError:
        pass


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
_TENSORS = st.fixed_dictionaries(
    {"name": st.sampled_from(["x", "y", ""]), "datatype": st.sampled_from([*DATATYPES, "BF16", 3])},
    optional={
        "shape": st.lists(st.integers(-2, 4), max_size=3) | _JSON_VALUES,
        "data": _JSON_VALUES,
        "parameters": st.fixed_dictionaries({}, optional={"binary_data_size": st.integers(-2, 40) | _JSON_VALUES}),
    },
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tensors=st.lists(_TENSORS, max_size=3),
    tail=st.binary(max_size=40),
    outputs=st.none() | _JSON_VALUES,
    parameters=st.none() | _JSON_VALUES,
)
def test_random_well_formed_json_raises_nothing_but_protocol_error(
    tensors: list[dict[str, Any]], tail: bytes, outputs: Any, parameters: Any
) -> None:
    text = json.dumps({"inputs": tensors, "outputs": outputs, "parameters": parameters}).encode()
    try:
        parse_infer_request(text + tail, len(text))
    except ProtocolError:
        pass


# --- orjson and Python's json read request JSON alike ---------------------------------------

_JSON_DOCS = [
    '{"a": [1.5, -0.0058760265819728374, 1e-7, 3]}',
    '{"big": 18446744073709551616, "neg": -9223372036854775809}',  # past 64 bits: must stay exact ints
    '{"max": 18446744073709551615, "min": -9223372036854775808}',
    '{"x": 1234567890123456789.5, "e": 1e-1234567890123456789}',
    '{"nan": NaN, "inf": [Infinity, -Infinity]}',  # Python's json reads these; orjson does not
    '{"s": "\\ud800 lone surrogate", "u": "\\u00e9 \u00e9"}',
    '{"dup": 1, "dup": 2}',
    '[[[[[]]]]]',
]


@pytest.mark.parametrize("text", _JSON_DOCS)
def test_request_json_reads_as_pythons_json_does(text: str) -> None:
    import json
    import math

    from neuropod_serving.protocol import bodies

    got, want = bodies._loads(memoryview(text.encode("utf-8", "surrogatepass")), text), json.loads(text)
    assert repr(got) == repr(want)  # same types (int stays int), same values, NaN included
    if isinstance(want, dict) and "nan" in want:
        assert math.isnan(got["nan"])


@pytest.mark.parametrize("text", _JSON_DOCS)
def test_long_request_json_reads_as_pythons_json_does(text: str) -> None:
    """Bodies of 4 kB and more are screened for long integers with numpy: the same reading."""
    import json

    from neuropod_serving.protocol import bodies

    fractions = ", ".join(["0.00012299999798415229", "-1.0000000000000000000001"] * 100)  # long runs after a '.'
    text = f'{{"pad": [{fractions}], "doc": {text}}}'
    assert len(text) >= bodies.LONG_TEXT
    got, want = bodies._loads(memoryview(text.encode("utf-8", "surrogatepass")), text), json.loads(text)
    assert repr(got) == repr(want)


def test_short_and_long_screens_for_long_integers_agree() -> None:
    """Short bodies are screened for integers of 19 digits or more with bytes methods, long ones
    with numpy: both give the same answer on every text (digits, dots, other bytes, UTF-8)."""
    import random

    from neuropod_serving.protocol import bodies

    rng = random.Random(0)
    alphabet = ["1", "9", "0", ".", ",", "e", "-", "[", "\u00e9", "1" * 18, "2" * 19]
    for _ in range(3000):
        raw = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))).encode()
        assert bodies._long_integer_short(raw) == bodies._long_integer(raw), raw


def test_json_output_numbers_read_back_as_the_same_values() -> None:
    """Numeric JSON outputs (written by orjson) hold the same numbers as Python's json writes;
    NaN and infinities are still written NaN, Infinity and -Infinity."""
    rng = np.random.default_rng(0)
    outputs = {
        "f32": (rng.standard_normal(200) * 10.0 ** rng.integers(-30, 30, 200)).astype(np.float32),
        "f64": rng.standard_normal((4, 5)) * 1e-5,
        "f16": np.array([0.1, 65504, -2.5e-7], np.float16),
        "u64": np.array([0, 2**64 - 1], np.uint64),
        "i64": np.array([-(2**63), 2**63 - 1], np.int64),
        "b": np.array([[True, False]]),
        "scalar": np.array(3.25),
    }
    body = build_infer_response("m", outputs)
    got = {o["name"]: o for o in json.loads(body.content)["outputs"]}
    for name, array in outputs.items():
        assert got[name]["shape"] == list(array.shape)
        assert got[name]["data"] == array.ravel().tolist()
        assert [type(v) for v in got[name]["data"]] == [type(v) for v in array.ravel().tolist()]
    special = build_infer_response("m", {"y": np.array([np.nan, np.inf, -np.inf, 1.5], np.float32)})
    assert b'"data":[NaN,Infinity,-Infinity,1.5]' in special.content


# --- known headers: a binary body's header parsed once per form ------------------------------


def test_a_known_header_still_checks_every_body() -> None:
    """The second body with the same header takes the remembered plan; each is still checked
    against the spec it is decoded with and for its size, and a fault is worded by the full decode."""
    from neuropod_serving.protocol import bodies

    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    body = build_infer_request({"x": x}, binary=True)
    specs = {s.name: s for s in parse_spec([{"name": "x", "dtype": "float32", "shape": [None, 2]}], "m")}
    for _ in range(2):
        np.testing.assert_array_equal(parse_infer_request(body.content, body.json_length, input_spec=specs).inputs["x"], x)
    header = bytes(body.content[: body.json_length])
    assert bodies._KNOWN[header].plans["inputs"]
    wrong = {s.name: s for s in parse_spec([{"name": "x", "dtype": "int32", "shape": [None, 2]}], "m")}
    with pytest.raises(ProtocolError, match="disagrees with the model's spec"):
        parse_infer_request(body.content, body.json_length, input_spec=wrong)
    with pytest.raises(ProtocolError, match="not one of this model's inputs"):
        parse_infer_request(body.content, body.json_length, input_spec={"y": specs["x"]})
    with pytest.raises(ProtocolError, match="runs past the body"):
        parse_infer_request(body.content[:-4], body.json_length, input_spec=specs)
    with pytest.raises(ProtocolError, match="add up to 24"):
        parse_infer_request(body.content + b"\0" * 4, body.json_length, input_spec=specs)
    # The same parameters come back each time, and changing one request's does not change the next's.
    first = parse_infer_request(body.content, body.json_length)
    first.parameters["mutated"] = True
    assert "mutated" not in parse_infer_request(body.content, body.json_length).parameters


def test_known_headers_keep_only_clean_small_forms_within_a_byte_budget() -> None:
    """A header is remembered once a body decodes with it; a refused one, or one over the form
    limit (a huge id), is not; and all remembered forms stay within the cache's byte budget."""
    from neuropod_serving.protocol import _forms, bodies

    x = np.ones((1, 2), np.float32)
    specs = {s.name: s for s in parse_spec([{"name": "x", "dtype": "float32", "shape": [None, 2]}], "m")}
    refused = build_infer_request({"z": x}, binary=True, id="refused")
    with pytest.raises(ProtocolError, match="not one of this model's inputs"):
        parse_infer_request(refused.content, refused.json_length, input_spec=specs)
    assert bytes(refused.content[: refused.json_length]) not in bodies._KNOWN
    huge = build_infer_request({"x": x}, binary=True, id="i" * (_forms.MAX_FORM_BYTES + 1))
    parse_infer_request(huge.content, huge.json_length, input_spec=specs)
    assert bytes(huge.content[: huge.json_length]) not in bodies._KNOWN
    for i in range(3000):
        body = build_infer_request({"x": x}, binary=True, id=f"{i:0500d}")
        parse_infer_request(body.content, body.json_length, input_spec=specs)
        assert bodies._KNOWN._used <= _forms.BUDGET
    assert 0 < len(bodies._KNOWN) < 3000


def test_a_shape_no_array_can_have_is_a_protocol_error() -> None:
    for shape in ([0, 2**62], [2**62, 0], [0, 2**40, 2**40]):
        with pytest.raises(ProtocolError, match="larger than any array can be"):
            parse_infer_request(json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": []}]}).encode())
        header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": shape,
                                         "parameters": {"binary_data_size": 0}}]}).encode()  # fmt: skip
        with pytest.raises(ProtocolError, match="larger than any array can be"):
            parse_infer_request(header, len(header))
    assert parse_infer_request(json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [0, 2**20],
                                                       "data": []}]}).encode()).inputs["x"].shape == (0, 2**20)  # fmt: skip


def test_an_output_requested_twice_is_refused() -> None:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}], "outputs": [{"name": "o"}, {"name": "o"}]}
    with pytest.raises(ProtocolError, match="output 'o' is requested twice; ask for each output once"):
        parse_infer_request(json.dumps(body).encode())


def test_nesting_is_refused_in_linear_time() -> None:
    """Millions of brackets deep costs one scan, not one pass per level (about 0.1 s for 8 MiB here)."""
    import time

    n = 4 * 2**20
    started = time.process_time()
    with pytest.raises(ProtocolError, match="nests more than 64 levels deep"):
        parse_infer_request(b'{"inputs":' + b"[" * n + b"]" * n + b"}")
    assert time.process_time() - started < 2.0


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(0, 3), min_size=1, max_size=4), dtype=st.sampled_from(["float32", "int64", "uint8", "bool", "string"]))
def test_known_and_fresh_decodes_agree(rows: list[int], dtype: str) -> None:
    from neuropod.testing import sample

    for i, n in enumerate(rows):
        arrays = {"a": sample(dtype, (n, 2) if dtype != "string" else (n,), i), "z": np.arange(n, dtype=np.int32)}
        body = build_infer_request(arrays, binary=True, outputs=["o"])
        for _ in range(2):
            got = parse_infer_request(body.content, body.json_length)
            assert list(got.outputs or {}) == ["o"]
            for name, want in arrays.items():
                assert got.inputs[name].shape == want.shape and got.inputs[name].tolist() == want.tolist()
        answer = build_infer_response("m", arrays, binary=True)
        for _ in range(2):
            back = parse_infer_response(bytearray(answer.content), answer.json_length).outputs
            assert all(back[k].tolist() == v.tolist() for k, v in arrays.items())


@pytest.mark.parametrize("datatype", [d for d in NUMERIC if d != "BOOL"])
def test_decoded_arrays_carry_numpys_own_dtype(datatype: str) -> None:
    """Binary tensors, REST and gRPC, decode to arrays of numpy's own dtype instance (not an
    equal copy): a model's compiled spec check compares dtypes by identity, so an equal copy
    would send every served request through the general checks."""
    from neuropod_serving.protocol import grpc_codec

    array = _sample(datatype, (2, 3))
    native = np.dtype(DATATYPES[datatype])
    body = build_infer_request({"x": array}, binary=True)
    rest = parse_infer_request(body.content, str(body.json_length)).inputs["x"]
    grpc = grpc_codec.deserialize_model_infer_request(
        grpc_codec.serialize_model_infer_request("m", {"x": array})
    ).decode(None).inputs["x"]
    for decoded in (rest, grpc):
        assert np.array_equal(decoded, array)
        if native.byteorder in ("=", "|") and np.little_endian:
            assert decoded.dtype is native
