"""ModelInferResponse messages <-> :class:`~neuropod_serving.protocol.inference.InferResponse`."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol._wire import encode_varint
from neuropod_serving.protocol.datatypes import datatype_of
from neuropod_serving.protocol.grpc_codec.plans import Heads, Reader
from neuropod_serving.protocol.grpc_codec.tensors import (
    RAW_OUTPUT_FIELD,
    decode_tensors,
    encode_tensors,
    fill_parameters,
    parameters_from_proto,
)
from neuropod_serving.protocol.inference import InferResponse

_ID_KEY = bytes([3 << 3 | 2])  # field 3 (id), length-delimited: the same number in both messages


def build_model_infer_response(
    model_name: str,
    outputs: Mapping[str, np.ndarray[Any, Any]],
    *,
    model_version: str | None = None,
    id: str | None = None,
) -> pb.ModelInferResponse:
    """Encode a ModelInferResponse, every tensor in ``raw_output_contents``, in the order of ``outputs``.

    :raises ProtocolError: an output the protocol cannot carry, naming it.
    """
    tensors, raws = encode_tensors(outputs, pb.ModelInferResponse.InferOutputTensor)
    return pb.ModelInferResponse(
        model_name=model_name,
        model_version=model_version or "",
        id=id or "",
        outputs=tensors,
        raw_output_contents=raws,
    )


def serialize_model_infer_response(
    model_name: str,
    outputs: Mapping[str, np.ndarray[Any, Any]],
    *,
    model_version: str | None = None,
    id: str | None = None,
) -> bytes:
    """A serialized ModelInferResponse, as :func:`build_model_infer_response` builds it, written
    on the wire form directly (as :func:`serialize_model_infer_request`)."""

    def head(tensors: list[Any]) -> bytes:
        return pb.ModelInferResponse(  # type: ignore[no-any-return]
            model_name=model_name, model_version=model_version or "", outputs=tensors
        ).SerializeToString()

    data = _RESPONSE_HEADS.serialize((model_name, model_version), outputs, pb.ModelInferResponse.InferOutputTensor,
                                     head, RAW_OUTPUT_FIELD)  # fmt: skip
    if id:
        # A field may come anywhere in a message: the id (which differs per call) goes last.
        text = id.encode("utf-8")
        data += _ID_KEY + encode_varint(len(text)) + text
    return data


def serialize_shared_response(
    model_name: str,
    outputs: Mapping[str, np.ndarray[Any, Any]],
    shared: Mapping[str, Mapping[str, Any]],
    *,
    model_version: str | None = None,
    id: str | None = None,
) -> bytes:
    """A serialized ModelInferResponse for a request whose outputs ``shared`` were written to
    shared memory: those carry the parameters given (where they were written) and an empty
    ``raw_output_contents`` entry, so that every other output's entry keeps its place (as
    Triton answers, and tritonclient reads); the others as usual.

    :raises ProtocolError: an output the protocol cannot carry, naming it.
    """
    kind = pb.ModelInferResponse.InferOutputTensor
    tensors: list[Any] = []
    raws: list[Any] = []
    for name, array in outputs.items():
        params = shared.get(name)
        if params is None:
            made, raw = encode_tensors({name: array}, kind)
            tensors.extend(made)
            raws.extend(raw)
            continue
        tensor = kind(name=name, datatype=datatype_of(array, tensor=name), shape=array.shape)
        fill_parameters(tensor.parameters, params)
        tensors.append(tensor)
        raws.append(b"")
    response = pb.ModelInferResponse(
        model_name=model_name, model_version=model_version or "", id=id or "", outputs=tensors, raw_output_contents=raws
    )
    return response.SerializeToString()  # type: ignore[no-any-return]


def parse_model_infer_response(
    response: pb.ModelInferResponse, raws: Sequence[Any] | None = None, bytes_outputs: Collection[str] = ()
) -> InferResponse:
    """Decode a ModelInferResponse (raw or typed contents) into numpy arrays.

    :param raws: the raw output contents when they were split off the message
        (:func:`deserialize_model_infer_response`); the message's own otherwise.
    :param bytes_outputs: the outputs that are ``bytes`` tensors: their BYTES come as the bytes sent.
    :raises ProtocolError: for every fault, naming the tensor.
    """
    return InferResponse(
        outputs=decode_tensors(
            response.outputs, response.raw_output_contents if raws is None else raws, "output", None, bytes_outputs
        ),
        model_name=response.model_name or None,
        model_version=response.model_version or None,
        id=response.id or None,
        parameters=parameters_from_proto(response.parameters),
    )


def deserialize_model_infer_response(data: bytes, bytes_outputs: Collection[str] = ()) -> InferResponse:
    """Decode a serialized ModelInferResponse. Its numeric outputs are read-only views of
    ``data`` itself (no copy), and the rest of the message is parsed once per distinct form.

    :param bytes_outputs: the outputs that are ``bytes`` tensors: their BYTES come as the bytes sent
        (read the full way: a learnt form reads BYTES as text).
    :raises ProtocolError: a malformed message, or any fault in its tensors.
    """
    plan, raws = _RESPONSES_READ.read(data, RAW_OUTPUT_FIELD, pb.ModelInferResponse)
    arrays = None if bytes_outputs else plan.arrays(raws, "output", None)
    if arrays is None:
        decoded = parse_model_infer_response(plan.message, raws, bytes_outputs)
        plan.learn("output")
        return decoded
    message = plan.message
    return InferResponse(
        outputs=arrays,
        model_name=message.model_name or None,
        model_version=message.model_version or None,
        id=message.id or None,
        parameters=dict(plan.parameters),
    )



_RESPONSE_HEADS = Heads()
_RESPONSES_READ = Reader()
