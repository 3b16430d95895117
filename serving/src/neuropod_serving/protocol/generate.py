"""The generate extension (``POST /v2/models/{m}/generate`` and ``/generate_stream``): a flat
JSON object in, a flat JSON object out, as Triton maps them.

A request's fields go to the model by name: a field named like one of the model's inputs is that
input (a value, or a list of values, shaped by the input's spec: see :func:`input_shape`), any
other field is a request parameter, and so is each entry of ``parameters`` (or an input, when it
is named like one). ``id`` is the request's id. A response holds ``model_name``,
``model_version``, the request's ``id`` when it had one, and each output by name: a tensor of one
element as that value, any other as the flat list of its values (strings as text).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from neuropod.spec import TensorSpec
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol.bodies import ENCODER, split_body
from neuropod_serving.protocol.datatypes import oip_datatype
from neuropod_serving.protocol.fields import kind_of, show
from neuropod_serving.protocol.inference import InferRequest
from neuropod_serving.protocol.metadata import specs_by_name
from neuropod_serving.protocol.options import request_options
from neuropod_serving.protocol.tensors import decode_tensor, encode_tensor

#: The fields of a generate response that are not outputs (an output of one of these names is left out).
RESERVED = frozenset({"model_name", "model_version", "id"})


def parse_generate_request(
    body: bytes | bytearray | memoryview, input_spec: Iterable[TensorSpec] | Mapping[str, TensorSpec]
) -> InferRequest:
    """Decode a generate request body into the inputs, id and parameters of an inference request.

    :raises ProtocolError: for every fault (not a JSON object, a field that does not convert to
        its input, a parameter that is not a string, number or bool), naming the field.
    """
    header, _, _ = split_body(body, None, "generate request")
    specs = specs_by_name(input_spec) or {}
    inputs: dict[str, np.ndarray[Any, Any]] = {}
    parameters: dict[str, Any] = {}
    request_id: str | None = None
    for key, value in header.items():
        spec = specs.get(key)
        if spec is not None:
            _add_input(inputs, spec, value, key)
        elif key == "parameters":
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ProtocolError(
                    f"'parameters' of a generate request must be an object of parameters (or inputs, by name), "
                    f"not {kind_of(value)}"
                )
            for name, item in value.items():
                inner = specs.get(name)
                if inner is not None:
                    _add_input(inputs, inner, item, f"parameters.{name}")
                else:
                    parameters[name] = item
        elif key == "id":
            if not isinstance(value, str):
                raise ProtocolError(f"'id' of a generate request must be a string, not {show(value)}")
            request_id = value
        else:
            parameters[key] = value
    decoded = InferRequest(inputs=inputs, id=request_id, parameters=parameters)
    if parameters:
        decoded.options = request_options(parameters)
    return decoded


def _add_input(inputs: dict[str, np.ndarray[Any, Any]], spec: TensorSpec, value: object, where: str) -> None:
    name = spec.name
    if name in inputs:
        raise ProtocolError(f"input {name!r} is given twice in the generate request (as {where!r} too); give it once")
    if isinstance(value, list):
        for item in value:
            if isinstance(item, (list, dict)) or item is None:
                raise ProtocolError(
                    f"generate request field {where!r} (input {name!r}) is a value or a flat list of values, "
                    f"but it holds {kind_of(item)}"
                )
        data = value
    elif isinstance(value, (str, int, float)):  # bool is an int
        data = [value]
    else:
        raise ProtocolError(
            f"generate request field {where!r} (input {name!r}, {spec.dtype}) is a value or a flat list of "
            f"values, not {kind_of(value)}"
        )
    shape = input_shape(spec, len(data))
    obj = {"name": name, "datatype": oip_datatype(spec.dtype), "shape": shape, "data": data}
    inputs[name] = decode_tensor(obj, spec=spec, where=f"generate request field {where!r}")


def input_shape(spec: TensorSpec, count: int) -> list[int]:
    """The shape ``count`` values take for input ``spec`` (Triton's rule): the fixed dims of the
    spec divide the count, the innermost free dim takes what is left and any other free dim is 1.
    A ``[1]`` input takes one value, a ``[None]`` input a list, a ``[None, 3]`` input 3k values.

    :raises ProtocolError: the count does not fit the spec's fixed dims.
    """
    left = count
    for dim in spec.shape:
        if isinstance(dim, int):
            if dim == 0 or left % dim:
                raise ProtocolError(_no_shape(spec, count))
            left //= dim
    shape: list[int] = []
    for dim in reversed(spec.shape):
        if isinstance(dim, int):
            shape.append(dim)
        else:
            shape.append(left)
            left = 1
    if left != 1:
        raise ProtocolError(_no_shape(spec, count))
    return shape[::-1]


def _no_shape(spec: TensorSpec, count: int) -> str:
    return f"input {spec.name!r} of shape {spec.describe_shape()} cannot hold {count} value(s) from a generate request"


def generate_response(
    model_name: str, model_version: str | None, outputs: Mapping[str, np.ndarray[Any, Any]], id: str | None = None
) -> bytes:
    """One generate response's JSON: the model, the request's id, each output flattened by name."""
    doc: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        doc["model_version"] = model_version
    if id is not None:
        doc["id"] = id
    for name, array in outputs.items():
        if name in RESERVED:  # as Triton: the response's own fields come first
            continue
        obj, _ = encode_tensor(name, array, binary=False)
        data = obj["data"]
        doc[name] = data[0] if len(data) == 1 else data
    return ENCODER.encode(doc).encode("utf-8")


__all__ = ["RESERVED", "generate_response", "input_shape", "parse_generate_request"]
