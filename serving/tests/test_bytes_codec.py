"""The codec's side of bytes tensors: BYTES as the bytes sent for a bytes spec, and metadata that says which."""

from __future__ import annotations

import numpy as np
import pytest

from neuropod.spec import TensorSpec, to_bytes_array
from neuropod_serving.protocol import DTYPE_PARAMETER, ProtocolError, decode_tensor, encode_tensor
from neuropod_serving.protocol.grpc_codec.metadata import (
    model_metadata_from_response,
    model_metadata_response,
    shapes_metadata,
)
from neuropod_serving.protocol.metadata import (
    model_metadata,
    spec_from_metadata,
    specs_from_model_metadata,
    tensor_metadata,
)

BLOB = TensorSpec("blob", "bytes", ("batch",))
TEXT = TensorSpec("text", "string", ("batch",))
ITEMS = [b"\xff\xd8\xff", b"a\x00\x00", b""]


def test_binary_bytes_come_back_as_sent() -> None:
    obj, raw = encode_tensor("blob", to_bytes_array(ITEMS), binary=True)
    assert obj["datatype"] == "BYTES" and raw is not None
    # Length-prefixed, little-endian, computed here by hand.
    assert raw == b"".join(len(b).to_bytes(4, "little") + b for b in ITEMS)
    decoded = decode_tensor(obj, binary=memoryview(raw), spec=BLOB)
    assert decoded.dtype == object and decoded.tolist() == ITEMS
    # The same bytes for a string tensor are refused, as before.
    with pytest.raises(ProtocolError, match="not UTF-8 text"):
        decode_tensor({**obj, "name": "text"}, binary=memoryview(raw), spec=TEXT)


def test_json_carries_utf8_text_only() -> None:
    obj = {"name": "blob", "datatype": "BYTES", "shape": [2], "data": ["abc", "é"]}
    assert decode_tensor(obj, spec=BLOB).tolist() == [b"abc", "é".encode()]
    assert encode_tensor("blob", to_bytes_array([b"abc"]), binary=False)[0]["data"] == ["abc"]
    with pytest.raises(ProtocolError, match=r"tensor 'blob': a BYTES element is not UTF-8 text .* binary data"):
        encode_tensor("blob", to_bytes_array(ITEMS), binary=False)
    with pytest.raises(ProtocolError, match="holds bytes, but element 1 is a str"):
        encode_tensor("blob", np.array([b"x", "y"], dtype=object), binary=True)


def test_metadata_marks_bytes_and_rebuilds_the_spec() -> None:
    meta = tensor_metadata(BLOB)
    assert meta["datatype"] == "BYTES" and meta["parameters"][DTYPE_PARAMETER] == "bytes"
    assert spec_from_metadata(meta) == BLOB
    assert DTYPE_PARAMETER not in tensor_metadata(TEXT)["parameters"]
    assert spec_from_metadata(tensor_metadata(TEXT)) == TEXT
    with pytest.raises(ProtocolError, match=r"parameters.neuropod_dtype may only say \"bytes\", of a BYTES tensor"):
        spec_from_metadata({**meta, "datatype": "FP32"})
    # Without the parameter (another server), BYTES is text.
    assert spec_from_metadata({"name": "x", "datatype": "BYTES", "shape": [-1]}).dtype == "string"


def test_grpc_metadata_carries_the_mark_in_its_trailer() -> None:
    rest = model_metadata("m", [BLOB, TEXT], [TensorSpec("out", "bytes", ())], platform="python")
    rebuilt = model_metadata_from_response(model_metadata_response(rest), shapes_metadata(rest))
    assert specs_from_model_metadata(rebuilt) == ((BLOB, TEXT), (TensorSpec("out", "bytes", ()),))
    with pytest.raises(ProtocolError, match="'bytes' must be an object"):
        model_metadata_from_response(model_metadata_response(rest), '{"bytes": ["blob"]}')
