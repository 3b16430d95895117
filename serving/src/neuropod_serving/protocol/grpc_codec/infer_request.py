"""ModelInferRequest messages <-> :class:`~neuropod_serving.protocol.inference.InferRequest`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from neuropod.spec import TensorSpec
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol import shm_params
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol.grpc_codec.extensions import in_shared_memory, request_options_of, shared_memory_of
from neuropod_serving.protocol.grpc_codec.plans import Heads, Reader
from neuropod_serving.protocol.grpc_codec.tensors import (
    RAW_INPUT_FIELD,
    decode_tensors,
    encode_tensors,
    fill_parameters,
    parameters_from_proto,
)
from neuropod_serving.protocol.inference import InferRequest
from neuropod_serving.protocol.metadata import specs_by_name


def parse_model_infer_request(
    request: pb.ModelInferRequest,
    *,
    input_spec: Iterable[TensorSpec] | Mapping[str, TensorSpec] | None = None,
    raws: Sequence[Any] | None = None,
) -> InferRequest:
    """Decode a ModelInferRequest into numpy arrays, requested outputs, id and parameters.

    :param raws: the raw input contents when they were split off the message
        (:func:`deserialize_model_infer_request`); the message's own otherwise.

    :param input_spec: the model's input spec (or a dict of it by name): when given, an input the model
        does not have, or whose datatype disagrees with its dtype, is refused
        here. Shapes are left to the model's own spec check.
    :returns: an :class:`InferRequest` whose ``outputs`` maps each requested
        output to None (gRPC outputs are always raw), or is None when the
        request named none (all of them).
    :raises ProtocolError: for every fault, naming the tensor.
    """
    specs = specs_by_name(input_spec)
    raws = request.raw_input_contents if raws is None else raws
    shared = shared_memory_of(request, specs) if in_shared_memory(request) else None
    tensors = request.inputs
    if shared is not None and shared.inputs:
        # Inputs in shared memory have no raw contents: the entries are the other inputs', in order.
        tensors = [t for t in tensors if not shm_params.mentions(t.parameters)]
        if raws and len(raws) != len(tensors):
            raise ProtocolError(
                f"raw_input_contents has {len(raws)} entries, but {len(tensors)} input(s) are not in shared memory: "
                "an input in shared memory has no entry, every other input has one, in the order of the inputs"
            )
    inputs = decode_tensors(tensors, raws, "input", specs)
    outputs: dict[str, bool | None] | None = None
    if request.outputs:
        outputs = {}
        for i, out in enumerate(request.outputs):
            if not out.name:
                raise ProtocolError(f"request outputs[{i}]: 'name' must be a non-empty string")
            if out.name in outputs:
                raise ProtocolError(f"output {out.name!r} is requested twice; ask for each output once")
            outputs[out.name] = None
    if shared is not None:
        twice = next((n for n in shared.inputs if n in inputs), None)
        if twice is not None:
            raise ProtocolError(f"input {twice!r} appears twice; each input is sent once")
    parameters = parameters_from_proto(request.parameters)
    return InferRequest(
        inputs=inputs,
        outputs=outputs,
        id=request.id or None,
        parameters=parameters,
        shared_memory=shared,
        options=request_options_of(request, parameters),
    )



def build_model_infer_request(
    model_name: str,
    inputs: Mapping[str, np.ndarray[Any, Any]],
    *,
    outputs: Sequence[str] | None = None,
    model_version: str | None = None,
    id: str | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> pb.ModelInferRequest:
    """Encode a ModelInferRequest (the client's side of :func:`parse_model_infer_request`).

    :param outputs: the outputs to ask for, in order; None asks for all.
    :raises ProtocolError: an array the protocol cannot carry, naming the tensor.
    """
    tensors, raws = encode_tensors(inputs, pb.ModelInferRequest.InferInputTensor)
    request = pb.ModelInferRequest(
        model_name=model_name,
        model_version=model_version or "",
        id=id or "",
        inputs=tensors,
        outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name=n) for n in outputs or ()],
        raw_input_contents=raws,
    )
    fill_parameters(request.parameters, parameters or {})
    return request


def serialize_model_infer_request(
    model_name: str,
    inputs: Mapping[str, np.ndarray[Any, Any]],
    *,
    outputs: Sequence[str] | None = None,
    model_version: str | None = None,
) -> bytes:
    """A serialized ModelInferRequest, as :func:`build_model_infer_request` builds it, written on
    the wire form directly (see :class:`Heads`): contiguous numeric arrays are joined in as they
    are (their only copy), and the rest of the message is made once per model, outputs and
    input names, dtypes and shapes.

    :raises ProtocolError: an array the protocol cannot carry, naming the tensor.
    """
    key = (model_name, model_version, tuple(outputs) if outputs is not None else None)

    def head(tensors: list[Any]) -> bytes:
        return pb.ModelInferRequest(  # type: ignore[no-any-return]
            model_name=model_name,
            model_version=model_version or "",
            inputs=tensors,
            outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name=n) for n in outputs or ()],
        ).SerializeToString()

    return _REQUEST_HEADS.serialize(key, inputs, pb.ModelInferRequest.InferInputTensor, head, RAW_INPUT_FIELD)


class ReceivedRequest:
    """A ModelInfer request as received, before it is decoded against a model's spec.

    The message without its raw contents is parsed once per distinct form (model,
    input names, datatypes and shapes...) and kept (:class:`Reader`); each call then
    only makes numpy arrays over its raw contents, which are views of the received bytes.
    """

    __slots__ = ("_plan", "_raws")

    def __init__(self, data: bytes) -> None:
        self._plan, self._raws = _REQUESTS_READ.read(data, RAW_INPUT_FIELD, pb.ModelInferRequest)

    @property
    def model_name(self) -> str:
        return str(self._plan.message.model_name)

    @property
    def model_version(self) -> str:
        return str(self._plan.message.model_version)

    def decode(self, input_spec: Iterable[TensorSpec] | Mapping[str, TensorSpec] | None = None) -> InferRequest:
        """The request's arrays, requested outputs, id and parameters (see :func:`parse_model_infer_request`).

        :raises ProtocolError: for every fault, naming the tensor.
        """
        plan = self._plan
        specs = specs_by_name(input_spec)
        arrays = plan.arrays(self._raws, "input", specs)
        if arrays is None:
            decoded = parse_model_infer_request(plan.message, input_spec=specs, raws=self._raws)
            plan.learn("input")
            return decoded
        message = plan.message
        outputs = plan.requested
        return InferRequest(
            inputs=arrays,
            outputs=None if outputs is None else dict.fromkeys(outputs),
            id=message.id or None,
            parameters=dict(plan.parameters),
            options=plan.options,
        )


def deserialize_model_infer_request(data: bytes) -> ReceivedRequest:
    """Read a serialized ModelInferRequest (decode it with :meth:`ReceivedRequest.decode`).

    :raises ProtocolError: the bytes are not a ModelInferRequest.
    """
    return ReceivedRequest(data)



_REQUEST_HEADS = Heads()
_REQUESTS_READ = Reader()
