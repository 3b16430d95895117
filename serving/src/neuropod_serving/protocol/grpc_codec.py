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

import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from neuropod import _json
from neuropod.spec import TensorSpec
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol import shm_params
from neuropod_serving.protocol._forms import MAX_FORM_BYTES, FormCache
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol._wire import WIRE_THRESHOLD, append_raw, encode_varint, split_raw
from neuropod_serving.protocol.datatypes import DATATYPES, FAST_DECODE, datatype_of, spec_dtype
from neuropod_serving.protocol.inference import InferRequest, InferResponse
from neuropod_serving.protocol.metadata import SHAPE_PARAMETER, specs_by_name
from neuropod_serving.protocol.options import classification_count, request_options
from neuropod_serving.protocol.shapes import MAX_DIMS, checked_shape, spannable
from neuropod_serving.protocol.tensors import decode_tensor, encode_tensor

#: gRPC metadata key under which a neuropod server's ModelMetadata reply carries
#: the exact spec shapes (symbol names), as JSON ``{"inputs": {name: shape},
#: "outputs": {...}, "parameters": {...}}``: the proto's TensorMetadata has no
#: ``parameters`` field for ``neuropod_shape`` as REST has (nor has its
#: ModelMetadataResponse for the model's own ``parameters``), and other clients
#: ignore a trailer they do not know.
SHAPES_METADATA_KEY = "neuropod-shapes"

# Which typed field of InferTensorContents holds each datatype (FP16 has none: raw only).
_CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_CONTENTS_FIELDS = tuple(dict.fromkeys(_CONTENTS_FIELD.values()))
# Field numbers of the raw contents in the proto (checked against the descriptor in the tests).
_RAW_INPUT_FIELD = 7
_RAW_OUTPUT_FIELD = 6

# The fast path for numbers out: datatype by numpy dtype where the host's is the
# wire's (little-endian), so that tobytes() is already what goes out.
_FAST_ENCODE: dict[np.dtype[Any], str] = (
    {np.dtype(dtype): datatype for datatype, dtype in DATATYPES.items() if dtype != "string"}
    if sys.byteorder == "little"
    else {}
)


# --- inference requests ------------------------------------------------------


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
    shared = _shared_memory(request, specs) if _in_shared_memory(request) else None
    tensors = request.inputs
    if shared is not None and shared.inputs:
        # Inputs in shared memory have no raw contents: the entries are the other inputs', in order.
        tensors = [t for t in tensors if not shm_params.mentions(t.parameters)]
        if raws and len(raws) != len(tensors):
            raise ProtocolError(
                f"raw_input_contents has {len(raws)} entries, but {len(tensors)} input(s) are not in shared memory: "
                "an input in shared memory has no entry, every other input has one, in the order of the inputs"
            )
    inputs = _decode_tensors(tensors, raws, "input", specs)
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


def _in_shared_memory(message: Any) -> bool:
    """Whether an input or requested output of a ModelInferRequest is in shared memory."""
    if not hasattr(message, "raw_input_contents"):
        return False
    return any(shm_params.mentions(t.parameters) for t in message.inputs) or any(
        shm_params.mentions(o.parameters) for o in message.outputs
    )


def _shared_memory(request: Any, specs: Mapping[str, TensorSpec] | None) -> shm_params.SharedMemoryRequest:
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
        carries = "typed contents" if _has_contents(t) else None
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
    return request_options(parameters, classes)


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
    tensors, raws = _encode_tensors(inputs, pb.ModelInferRequest.InferInputTensor)
    request = pb.ModelInferRequest(
        model_name=model_name,
        model_version=model_version or "",
        id=id or "",
        inputs=tensors,
        outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name=n) for n in outputs or ()],
        raw_input_contents=raws,
    )
    _fill_parameters(request.parameters, parameters or {})
    return request


def serialize_model_infer_request(
    model_name: str,
    inputs: Mapping[str, np.ndarray[Any, Any]],
    *,
    outputs: Sequence[str] | None = None,
    model_version: str | None = None,
) -> bytes:
    """A serialized ModelInferRequest, as :func:`build_model_infer_request` builds it, written on
    the wire form directly (see :class:`_Heads`): contiguous numeric arrays are joined in as they
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

    return _REQUEST_HEADS.serialize(key, inputs, pb.ModelInferRequest.InferInputTensor, head, _RAW_INPUT_FIELD)


class ReceivedRequest:
    """A ModelInfer request as received, before it is decoded against a model's spec.

    The message without its raw contents is parsed once per distinct form (model,
    input names, datatypes and shapes...) and kept (:class:`_Reader`); each call then
    only makes numpy arrays over its raw contents, which are views of the received bytes.
    """

    __slots__ = ("_plan", "_raws")

    def __init__(self, data: bytes) -> None:
        self._plan, self._raws = _REQUESTS_READ.read(data, _RAW_INPUT_FIELD, pb.ModelInferRequest)

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


# --- inference responses -----------------------------------------------------


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
    tensors, raws = _encode_tensors(outputs, pb.ModelInferResponse.InferOutputTensor)
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
                                     head, _RAW_OUTPUT_FIELD)  # fmt: skip
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
            made, raw = _encode_tensors({name: array}, kind)
            tensors.extend(made)
            raws.extend(raw)
            continue
        tensor = kind(name=name, datatype=datatype_of(array, tensor=name), shape=array.shape)
        _fill_parameters(tensor.parameters, params)
        tensors.append(tensor)
        raws.append(b"")
    response = pb.ModelInferResponse(
        model_name=model_name, model_version=model_version or "", id=id or "", outputs=tensors, raw_output_contents=raws
    )
    return response.SerializeToString()  # type: ignore[no-any-return]


def parse_model_infer_response(response: pb.ModelInferResponse, raws: Sequence[Any] | None = None) -> InferResponse:
    """Decode a ModelInferResponse (raw or typed contents) into numpy arrays.

    :param raws: the raw output contents when they were split off the message
        (:func:`deserialize_model_infer_response`); the message's own otherwise.
    :raises ProtocolError: for every fault, naming the tensor.
    """
    return InferResponse(
        outputs=_decode_tensors(
            response.outputs, response.raw_output_contents if raws is None else raws, "output", None
        ),
        model_name=response.model_name or None,
        model_version=response.model_version or None,
        id=response.id or None,
        parameters=parameters_from_proto(response.parameters),
    )


def deserialize_model_infer_response(data: bytes) -> InferResponse:
    """Decode a serialized ModelInferResponse. Its numeric outputs are read-only views of
    ``data`` itself (no copy), and the rest of the message is parsed once per distinct form.

    :raises ProtocolError: a malformed message, or any fault in its tensors.
    """
    plan, raws = _RESPONSES_READ.read(data, _RAW_OUTPUT_FIELD, pb.ModelInferResponse)
    arrays = plan.arrays(raws, "output", None)
    if arrays is None:
        decoded = parse_model_infer_response(plan.message, raws)
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


# --- the wire form, planned once per form of message --------------------------

#: Distinct forms of message built per direction (the cache is emptied when full). Received
#: forms are kept within a budget of bytes instead (:class:`_Reader`): clients choose them.
PLAN_LIMIT = 256
_ID_KEY = bytes([3 << 3 | 2])  # field 3 (id), length-delimited: the same number in both messages
# The key of each raw contents entry (field number, length-delimited).
_TAGS = {f: encode_varint(f << 3 | 2) for f in (_RAW_INPUT_FIELD, _RAW_OUTPUT_FIELD)}


class _Heads:
    """Serialized messages without their raw contents, by (key, tensor names, dtypes, shapes).

    The metadata part of an inference message depends only on those, not on the
    tensors' values: it is made by protobuf once, and each call joins it with each
    tensor's length prefix (precomputed for fixed-size tensors) and bytes.
    """

    def __init__(self) -> None:
        self._plans: dict[Any, tuple[bytes, tuple[bytes | None, ...]]] = {}

    def serialize(
        self, key: Any, arrays: Mapping[str, np.ndarray[Any, Any]], kind: Any, head: Any, field: int
    ) -> bytes:
        try:
            form = (key, tuple((name, a.dtype, a.shape) for name, a in arrays.items()))
            plan = self._plans.get(form)
        except (AttributeError, TypeError):  # not arrays (refused below, naming the tensor), or unhashable
            form, plan = None, None
        tag = _TAGS[field]
        if plan is None:
            tensors, raws = _encode_tensors(arrays, kind, views=True)
            made = head(tensors)
            if form is not None:
                prefixes = tuple(
                    tag + encode_varint(memoryview(raw).nbytes) if _FAST_ENCODE.get(a.dtype) is not None else None
                    for raw, a in zip(raws, arrays.values())
                )
                if len(self._plans) >= PLAN_LIMIT:
                    self._plans.clear()
                self._plans[form] = (made, prefixes)
            return append_raw(made, field, raws)
        parts: list[Any] = [plan[0]]
        for (name, array), prefix in zip(arrays.items(), plan[1]):
            if prefix is not None:
                parts.append(prefix)
                parts.append(array.data if array.ndim and array.flags.c_contiguous else array.tobytes())
            else:
                raw = encode_tensor(name, array, binary=True)[1]
                assert raw is not None
                parts.append(tag + encode_varint(len(raw)))
                parts.append(raw)
        return b"".join(parts)


class _Plan:
    """One form of received message: the message without its raw contents, parsed, and
    once it has decoded cleanly, each tensor's name, datatype, wire dtype, shape and size."""

    __slots__ = ("_cache", "_key", "message", "options", "parameters", "requested", "tensors")

    def __init__(self, message: Any, key: bytes | None = None, cache: FormCache[bytes, _Plan] | None = None) -> None:
        self.message = message
        # Where the form is remembered once it has decoded cleanly (learn), and under which bytes.
        self._key = key
        self._cache = cache
        self.parameters = parameters_from_proto(message.parameters)
        request = hasattr(message, "raw_input_contents")
        requested = getattr(message, "outputs", None) if request else None
        self.requested = tuple(o.name for o in requested) if requested else None
        # A request's timeout, classification and parameters for the model, read once per form.
        self.options = request_options_of(message, self.parameters) if request else None
        self.tensors: tuple[tuple[str, str, np.dtype[Any] | None, tuple[int, ...], int, dict[str, Any]], ...] | None = (
            None
        )

    def learn(self, kind: str) -> None:
        """Remember the tensors' forms (after the full decode accepted them)."""
        entries = self.message.inputs if kind == "input" else self.message.outputs
        if any(_has_contents(t) for t in entries) or _in_shared_memory(self.message):
            return  # typed contents or shared memory: every call is decoded the full way
        tensors = []
        for t in entries:
            shape = tuple(t.shape)
            wire = FAST_DECODE.get(t.datatype)
            size = math.prod(shape) * wire.itemsize if wire is not None else -1
            tensors.append(
                (t.name, t.datatype, wire, shape, size, {"name": t.name, "datatype": t.datatype, "shape": list(shape)})
            )
        self.tensors = tuple(tensors)
        if self._cache is not None and self._key is not None:
            self._cache.put(self._key, self, len(self._key))
            self._key = None

    def arrays(
        self, raws: Sequence[memoryview], kind: str, specs: Mapping[str, TensorSpec] | None
    ) -> dict[str, np.ndarray[Any, Any]] | None:
        """The arrays over ``raws`` as this form says, or None when the full decode must
        run (the form is not learnt yet, or anything does not fit: it words the error)."""
        tensors = self.tensors
        if tensors is None or len(raws) != len(tensors):
            return None
        arrays: dict[str, np.ndarray[Any, Any]] = {}
        for (name, datatype, wire, shape, size, obj), raw in zip(tensors, raws):
            spec = None
            if specs is not None:
                spec = specs.get(name)
                if spec is None or spec.dtype != DATATYPES[datatype]:
                    return None
            if wire is not None:
                if len(raw) != size:
                    return None
                arrays[name] = np.ndarray(shape, dtype=wire, buffer=raw)
            else:  # BOOL's 0/1 check, BYTES' reader
                arrays[name] = decode_tensor(obj, binary=raw, spec=spec, where=f"{kind} {name!r}",
                                             size_name=f"the size of raw_{kind}_contents")  # fmt: skip
        return arrays


class _Reader:
    """Received messages split into raw contents (views) and the rest, whose parse is kept per
    form once a message of the form has decoded cleanly (refused ones are not kept)."""

    def __init__(self) -> None:
        self._plans: FormCache[bytes, _Plan] = FormCache()

    def read(self, data: bytes, field: int, message_class: Any) -> tuple[_Plan, list[Any]]:
        name = "raw_input_contents" if field == _RAW_INPUT_FIELD else "raw_output_contents"
        message = None
        if len(data) < WIRE_THRESHOLD:
            # Small: protobuf's C parser finds the raw contents faster than a walk in Python
            # (and copying them costs nothing worth saving); the rest, serialized again, is the key.
            message = _parse(message_class, data)
            raws: list[Any] = list(getattr(message, name))
            if raws:
                message.ClearField(name)
                rest = message.SerializeToString()
            else:
                rest = data
        else:
            rest, raws = split_raw(data, field)
        if raws and field == _RAW_INPUT_FIELD:
            raws = _writable_copy(raws)
        small = len(rest) <= MAX_FORM_BYTES
        plan = self._plans.get(rest) if small else None
        if plan is None:
            message = message if message is not None else _parse(message_class, rest)
            plan = _Plan(message, bytes(rest), self._plans) if small else _Plan(message)
        return plan, raws


def _writable_copy(raws: list[Any]) -> list[memoryview]:
    """Views of one writable copy of ``raws``: a request's tensors decoded over them are
    writable, as a served model may assume of its inputs (see the engine), for one
    allocation and copy of the tensors' bytes rather than a copy per tensor later."""
    if len(raws) == 1:
        return [memoryview(bytearray(raws[0]))]
    views: list[memoryview] = []
    if sum(len(r) for r in raws) < WIRE_THRESHOLD:
        whole = memoryview(bytearray(b"".join(raws)))  # small: join in C, then slice
    else:  # large: one copy, not a join and a copy
        whole = memoryview(bytearray(sum(len(r) for r in raws)))
        at = 0
        for r in raws:
            whole[at : at + len(r)] = r
            at += len(r)
    at = 0
    for r in raws:
        n = len(r)
        views.append(whole[at : at + n])
        at += n
    return views


def _parse(message_class: Any, data: bytes) -> Any:
    try:
        return message_class.FromString(data)
    except DecodeError as e:
        raise ProtocolError(f"the {message_class.DESCRIPTOR.name} cannot be parsed: {e}") from None


_REQUEST_HEADS = _Heads()
_RESPONSE_HEADS = _Heads()
_REQUESTS_READ = _Reader()
_RESPONSES_READ = _Reader()


# --- metadata ----------------------------------------------------------------


def model_metadata_response(metadata: Mapping[str, Any]) -> pb.ModelMetadataResponse:
    """The ModelMetadataResponse of a REST model metadata body (``ServedModel.metadata``).

    Each tensor's ``parameters`` (``neuropod_shape``) has no place in the
    proto's TensorMetadata; :func:`shapes_metadata` carries it beside the reply.
    """
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=metadata["name"],
        versions=metadata.get("versions", []),
        platform=metadata.get("platform", ""),
        inputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in metadata.get("inputs", [])],
        outputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in metadata.get("outputs", [])],
    )


def shapes_metadata(metadata: Mapping[str, Any]) -> str:
    """The value of the :data:`SHAPES_METADATA_KEY` trailer for a REST model metadata body:
    each tensor's exact spec shape, which the proto's TensorMetadata cannot hold,
    and the model-level ``parameters`` (which the proto's ModelMetadataResponse lacks)."""
    shapes: dict[str, Any] = {
        key: {t["name"]: _json.loads(t["parameters"][SHAPE_PARAMETER]) for t in metadata.get(key, [])
              if SHAPE_PARAMETER in (t.get("parameters") or {})}
        for key in ("inputs", "outputs")
    }  # fmt: skip
    if metadata.get("parameters"):
        shapes["parameters"] = metadata["parameters"]  # the model's, e.g. which backend runs it
    return json.dumps(shapes, separators=(",", ":"))


def model_metadata_from_response(response: pb.ModelMetadataResponse, shapes: str | None = None) -> dict[str, Any]:
    """The REST form of a ModelMetadataResponse, ready for
    :func:`~neuropod_serving.protocol.metadata.specs_from_model_metadata`.

    :param shapes: the :data:`SHAPES_METADATA_KEY` trailer, when the server sent
        one (a neuropod server): each tensor gets its ``neuropod_shape`` back,
        so the exact spec (symbol names) is rebuilt. Without it, -1 dims mean
        any size.
    :raises ProtocolError: ``shapes`` is not the JSON a neuropod server sends.
    """
    exact: dict[str, Any] = {"inputs": {}, "outputs": {}}
    parameters: dict[str, Any] | None = None
    if shapes is not None:
        try:
            parsed = _json.loads(shapes)
        except ValueError as e:
            raise ProtocolError(f"the {SHAPES_METADATA_KEY} trailer is not JSON ({e})") from None
        if not isinstance(parsed, dict) or not all(isinstance(parsed.get(k, {}), dict) for k in exact):
            raise ProtocolError(f"the {SHAPES_METADATA_KEY} trailer must be an object of inputs and outputs")
        exact.update({k: parsed.get(k, {}) for k in exact})
        if isinstance(parsed.get("parameters"), dict):
            parameters = parsed["parameters"]

    def tensor(t: pb.ModelMetadataResponse.TensorMetadata, key: str) -> dict[str, Any]:
        out: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if t.name in exact[key]:
            out["parameters"] = {SHAPE_PARAMETER: json.dumps(exact[key][t.name])}
        return out

    out: dict[str, Any] = {
        "name": response.name,
        "versions": list(response.versions),
        "platform": response.platform,
        "inputs": [tensor(t, "inputs") for t in response.inputs],
        "outputs": [tensor(t, "outputs") for t in response.outputs],
    }
    if parameters is not None:
        out["parameters"] = parameters
    return out


# --- parameters --------------------------------------------------------------


def parameters_from_proto(parameters: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    """A ``map<string, InferParameter>`` as a plain dict of bool, int, float and str."""
    out: dict[str, Any] = {}
    for key, value in parameters.items():
        choice = value.WhichOneof("parameter_choice")
        out[key] = None if choice is None else getattr(value, choice)
    return out


def _fill_parameters(target: Any, parameters: Mapping[str, Any]) -> None:
    for key, value in parameters.items():
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            param.int64_param = value
        elif isinstance(value, int) and 0 <= value < 2**64:
            param.uint64_param = value
        elif isinstance(value, float):
            param.double_param = value
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise ProtocolError(
                f"parameter {key!r}: gRPC parameters are bool, int64, uint64, float or str, not {value!r}"
            )


# --- tensors -----------------------------------------------------------------


def _encode_tensors(
    arrays: Mapping[str, np.ndarray[Any, Any]], kind: Any, *, views: bool = False
) -> tuple[list[Any], list[Any]]:
    """Tensor messages and their raw bytes; with ``views``, a C-contiguous
    numeric array's bytes are its own memory (no copy)."""
    tensors: list[Any] = []
    raws: list[Any] = []
    for name, array in arrays.items():
        datatype = _FAST_ENCODE.get(array.dtype) if isinstance(array, np.ndarray) else None
        if datatype is not None:
            # tobytes() is row-major whatever the strides; the dtype is already the wire's.
            tensors.append(kind(name=name, datatype=datatype, shape=array.shape))
            raws.append(array.data if views and array.ndim and array.flags.c_contiguous else array.tobytes())
            continue
        obj, raw = encode_tensor(name, array, binary=True)
        tensors.append(kind(name=name, datatype=obj["datatype"], shape=obj["shape"]))
        assert raw is not None  # binary=True always gives the raw bytes
        raws.append(raw)
    return tensors, raws


def _decode_tensors(
    tensors: Sequence[Any], raws: Sequence[Any], kind: str, specs: Mapping[str, TensorSpec] | None
) -> dict[str, np.ndarray[Any, Any]]:
    field = f"raw_{kind}_contents"
    if raws and len(raws) != len(tensors):
        raise ProtocolError(
            f"{field} has {len(raws)} entries but the message has {len(tensors)} {kind}s: "
            f"with raw contents, every {kind} needs exactly one entry, in the order of the {kind}s"
        )
    raws = list(raws)  # indexing a protobuf repeated field costs more than a list's
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for i, t in enumerate(tensors):
        name = t.name
        if not name:
            raise ProtocolError(f"{kind}s[{i}]: 'name' must be a non-empty string")
        if name in arrays:
            raise ProtocolError(f"{kind} {name!r} appears twice; each {kind} is sent once")
        spec = None
        if specs is not None:
            spec = specs.get(name)
            if spec is None:
                raise ProtocolError(
                    f"{kind} {name!r} is not one of this model's {kind}s: {', '.join(specs) or '(none)'}"
                )
        datatype = t.datatype
        if raws:
            # The common case without building the codec's tensor object; anything
            # unusual (or wrong) goes the full way below, which words the error.
            wire = FAST_DECODE.get(datatype)
            if wire is not None and (spec is None or spec.dtype == DATATYPES[datatype]):
                shape = tuple(t.shape)
                raw = raws[i]
                if (
                    len(shape) <= MAX_DIMS
                    and min(shape, default=0) >= 0
                    and math.prod(shape) * wire.itemsize == len(raw)
                    and spannable(shape)
                    and not _has_contents(t)
                ):
                    arrays[name] = np.frombuffer(raw, dtype=wire).reshape(shape)
                    continue
        obj: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(t.shape)}
        where = f"{kind}s[{i}]"
        if raws:
            if _has_contents(t):
                raise ProtocolError(
                    f"{kind} {name!r} has typed contents while the message uses {field}; "
                    "send every tensor one way (raw contents, which tritonclient sends, or typed contents)"
                )
            arrays[name] = decode_tensor(
                obj, binary=memoryview(raws[i]), spec=spec, where=where, size_name=f"the size of {field}[{i}]"
            )
        else:
            obj["data"] = _typed_contents(t, kind)
            arrays[name] = decode_tensor(obj, spec=spec, where=where)
    return arrays


def _has_contents(tensor: Any) -> bool:
    """Whether a tensor carries typed contents. MLServer sets an empty ``contents`` beside raw
    contents, so a present but empty message does not count."""
    return bool(tensor.HasField("contents") and tensor.contents.ListFields())


def _typed_contents(tensor: Any, kind: str) -> list[Any]:
    """A tensor's typed contents as the codec's JSON ``data`` (a flat list), checked for the right field and count."""
    name = tensor.name
    datatype = tensor.datatype
    spec_dtype(datatype, tensor=name)  # an unknown datatype is named as such, not as a missing field
    contents = tensor.contents
    filled = [f for f in _CONTENTS_FIELDS if len(getattr(contents, f))]
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise ProtocolError(f"{kind} {name!r}: {datatype} has no typed contents field; send it as raw contents")
    wrong = [f for f in filled if f != field]
    if wrong:
        raise ProtocolError(
            f"{kind} {name!r}: {datatype} contents go in {field}, but the message filled {', '.join(wrong)}"
        )
    values = getattr(contents, field)
    count = math.prod(checked_shape(list(tensor.shape), name))
    if len(values) != count:
        raise ProtocolError(
            f"{kind} {name!r}: shape {list(tensor.shape)} holds {count} elements, but {field} has {len(values)}"
            + ("" if tensor.HasField("contents") else " (the message has neither raw nor typed contents for it)")
        )
    if datatype != "BYTES":
        return list(values)
    texts: list[str] = []
    for i, raw in enumerate(values):
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ProtocolError(
                f"{kind} {name!r}: BYTES element {i} is not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
    return texts


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
