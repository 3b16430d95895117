"""The Open Inference Protocol's gRPC messages <-> numpy arrays, for the server and the client.

The gRPC twin of :mod:`neuropod_serving.protocol.inference`, and built on it: the
datatype tables, the spec check, the shape and size checks and the BYTES
element reader are the codec's own, so REST and gRPC refuse the same faults
with the same words.

Tensors travel in ``raw_input_contents`` / ``raw_output_contents`` (one entry
per tensor, in the order of ``inputs`` / ``outputs``): numbers little-endian,
row-major, BOOL one byte each, BYTES elements a 4-byte little-endian length
then the bytes. That is what tritonclient.grpc sends and the only form it
decodes, so everything built here uses it. Parsing also accepts the typed
``contents`` fields (``fp32_contents``...), which other clients may send.

Importing this module imports protobuf and registers the ``inference.*``
messages in protobuf's default pool; import it only where gRPC is used (the
pool cannot hold tritonclient.grpc's copies of the same messages as well).
"""

from __future__ import annotations

from neuropod_serving.protocol.grpc_codec.infer_request import (
    ReceivedRequest,
    build_model_infer_request,
    deserialize_model_infer_request,
    parse_model_infer_request,
    serialize_model_infer_request,
)
from neuropod_serving.protocol.grpc_codec.infer_response import (
    build_model_infer_response,
    deserialize_model_infer_response,
    parse_model_infer_response,
    serialize_model_infer_response,
    serialize_shared_response,
)
from neuropod_serving.protocol.grpc_codec.metadata import (
    SHAPES_METADATA_KEY,
    model_metadata_from_response,
    model_metadata_response,
    shapes_metadata,
)
from neuropod_serving.protocol.grpc_codec.tensors import parameters_from_proto

__all__ = [
    "SHAPES_METADATA_KEY",
    "build_model_infer_request",
    "build_model_infer_response",
    "ReceivedRequest",
    "deserialize_model_infer_request",
    "deserialize_model_infer_response",
    "model_metadata_from_response",
    "model_metadata_response",
    "parameters_from_proto",
    "parse_model_infer_request",
    "parse_model_infer_response",
    "serialize_model_infer_request",
    "serialize_model_infer_response",
    "serialize_shared_response",
    "shapes_metadata",
]
