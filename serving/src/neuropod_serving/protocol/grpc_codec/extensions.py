"""What a ModelInferRequest asks besides its tensors: inputs and outputs in shared memory, and its
options (timeout, classification, parameters for the model)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuropod.spec import TensorSpec
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol import shm_params
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol.grpc_codec.tensors import has_contents, parameters_from_proto
from neuropod_serving.protocol.options import classification_count, request_options


def in_shared_memory(message: Any) -> bool:
    """Whether an input or requested output of a ModelInferRequest is in shared memory."""
    if not hasattr(message, "raw_input_contents"):
        return False
    return any(shm_params.mentions(t.parameters) for t in message.inputs) or any(
        shm_params.mentions(o.parameters) for o in message.outputs
    )


def shared_memory_of(request: Any, specs: Mapping[str, TensorSpec] | None) -> shm_params.SharedMemoryRequest:
    """The inputs and requested outputs of ``request`` that are in shared memory."""
    shared = shm_params.SharedMemoryRequest()
    for i, t in enumerate(request.inputs):
        params = parameters_from_proto(t.parameters)
        if not shm_params.mentions(params):
            continue
        name = t.name
        if not name:
            raise ProtocolError(f"inputs[{i}]: 'name' must be a non-empty string")
        if name in shared.inputs:
            raise ProtocolError(f"input {name!r} appears twice; each input is sent once")
        spec = None
        if specs is not None:
            spec = specs.get(name)
            if spec is None:
                raise ProtocolError(f"input {name!r} is not one of this model's inputs: {', '.join(specs) or '(none)'}")
        carries = "typed contents" if has_contents(t) else None
        shared.inputs[name] = shm_params.shared_input(
            name, t.datatype, list(t.shape), params, spec=spec, carries=carries
        )
    for out in request.outputs:
        params = parameters_from_proto(out.parameters)
        if shm_params.mentions(params):
            shared.outputs[out.name] = shm_params.shared_output(out.name, params)
    return shared


def request_options_of(request: pb.ModelInferRequest, parameters: Mapping[str, Any]) -> Any:
    """The :class:`~neuropod_serving.protocol.options.RequestOptions` of a ModelInferRequest
    (its parameters, already read, and its requested outputs' classification counts), or None
    when it asks nothing of them.

    :raises ProtocolError: a bad ``timeout``, ``classification`` or model parameter.
    """
    classes: dict[str, int] | None = None
    for out in request.outputs:
        if "classification" in out.parameters:
            value = parameters_from_proto(out.parameters)["classification"]
            classes = classes or {}
            classes[out.name] = classification_count(value, out.name)
    if not parameters and classes is None:
        return None
    if "sequence_id" in parameters:
        parameters = _sequence_id(request, parameters)
    return request_options(parameters, classes)


#: The parameter kinds a ModelInferRequest's ``sequence_id`` may take.
_SEQUENCE_ID_KINDS = ("int64_param", "uint64_param", "string_param")


def _sequence_id(request: pb.ModelInferRequest, parameters: Mapping[str, Any]) -> Mapping[str, Any]:
    """``parameters`` with the ``sequence_id`` read as Triton reads it: tritonclient.grpc sends a
    numeric id as ``int64_param`` (one of 2**63 and more as its negative two's complement, as
    Triton's C API takes a uint64), others send ``uint64_param``; a string id is ``string_param``.

    :raises ProtocolError: any other kind of parameter.
    """
    kind = request.parameters["sequence_id"].WhichOneof("parameter_choice")
    if kind not in _SEQUENCE_ID_KINDS:
        raise ProtocolError(
            f"request parameter sequence_id is an int64_param, uint64_param or string_param (the sequence's "
            f"id), not {kind or 'empty'}"
        )
    value = parameters["sequence_id"]
    if kind == "int64_param" and value < 0:
        return {**parameters, "sequence_id": value + (1 << 64)}
    return parameters
