"""The Open Inference Protocol (KServe v2): datatypes, tensor codecs and metadata.

Pure Python and numpy: the server, the client and the Ray deployment all use
this one codec, and importing it imports no framework and no server library.
"""

from __future__ import annotations

from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol.bodies import HEADER_LENGTH, Body
from neuropod_serving.protocol.datatypes import DATATYPES, SPEC_DATATYPES, datatype_of, oip_datatype, spec_dtype
from neuropod_serving.protocol.inference import (
    InferRequest,
    InferResponse,
    build_infer_request,
    build_infer_response,
    parse_infer_request,
    parse_infer_response,
)
from neuropod_serving.protocol.metadata import (
    DTYPE_PARAMETER,
    SHAPE_PARAMETER,
    model_metadata,
    spec_from_metadata,
    specs_from_model_metadata,
    tensor_metadata,
)
from neuropod_serving.protocol.tensors import decode_tensor, encode_tensor

__all__ = [
    "DATATYPES",
    "DTYPE_PARAMETER",
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
