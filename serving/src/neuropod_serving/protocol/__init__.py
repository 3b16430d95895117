"""The Open Inference Protocol (KServe v2): datatypes, tensor codecs and metadata.

Pure Python and numpy: the server, the client and the Ray deployment all use
this one codec, and importing it imports no framework and no server library.
"""

from __future__ import annotations

from neuropod_serving.protocol.codec import (
    DATATYPES,
    HEADER_LENGTH,
    SHAPE_PARAMETER,
    SPEC_DATATYPES,
    Body,
    InferRequest,
    InferResponse,
    ProtocolError,
    build_infer_request,
    build_infer_response,
    datatype_of,
    decode_tensor,
    encode_tensor,
    model_metadata,
    oip_datatype,
    parse_infer_request,
    parse_infer_response,
    spec_dtype,
    spec_from_metadata,
    specs_from_model_metadata,
    tensor_metadata,
)

__all__ = [
    "DATATYPES",
    "HEADER_LENGTH",
    "SHAPE_PARAMETER",
    "SPEC_DATATYPES",
    "Body",
    "InferRequest",
    "InferResponse",
    "ProtocolError",
    "build_infer_request",
    "build_infer_response",
    "datatype_of",
    "decode_tensor",
    "encode_tensor",
    "model_metadata",
    "oip_datatype",
    "parse_infer_request",
    "parse_infer_response",
    "spec_dtype",
    "spec_from_metadata",
    "specs_from_model_metadata",
    "tensor_metadata",
]
