"""The Open Inference Protocol (KServe v2) codec: OIP tensors <-> numpy arrays.

One module for the server, the client and the Ray deployment alike, so the
three can never disagree about a byte. It handles the JSON form of tensors and
Triton's binary tensor data extension (the body is a JSON header of
``Inference-Header-Content-Length`` bytes followed by the raw tensors).

Everything a client sends is untrusted: every fault in it is a
:class:`ProtocolError` that names the tensor and what was expected, and no
other exception escapes the parsers. Numeric arrays decoded from a binary body
are read-only views of that body (no copy), so the body must stay alive as
long as they do; Python's reference counting sees to that.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from neuropod import _json
from neuropod.errors import NeuropodError, PackageError
from neuropod.spec import TensorSpec, parse_spec
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol._forms import MAX_FORM_BYTES, FormCache

if TYPE_CHECKING:
    from neuropod_serving.protocol.shared_memory import SharedMemoryRequest

#: OIP datatype -> the spec dtype it means. BYTES carries UTF-8 text.
DATATYPES: dict[str, str] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
    "BYTES": "string",
}
#: Spec dtype -> OIP datatype.
SPEC_DATATYPES: dict[str, str] = {dtype: datatype for datatype, dtype in DATATYPES.items()}

#: The metadata parameter that carries a tensor's exact spec shape, as a JSON string.
SHAPE_PARAMETER = "neuropod_shape"
#: The HTTP header that says how long the JSON part of a binary body is.
HEADER_LENGTH = "Inference-Header-Content-Length"


def _wire_dtype(dtype: str) -> np.dtype[Any]:
    """The little-endian dtype of ``dtype``: numpy's own instance of it where the host is
    little-endian (an equal copy from newbyteorder would make every decoded array miss the
    spec's compiled checks, which compare dtypes by identity)."""
    native = np.dtype(dtype)
    little = native.newbyteorder("<")
    return native if little == native else little


# Binary tensors are little-endian on the wire whatever the host is.
_WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    datatype: _wire_dtype(dtype) for datatype, dtype in DATATYPES.items() if dtype != "string"
}
_NATIVE_DTYPES: dict[str, np.dtype[Any]] = {
    datatype: np.dtype(dtype) for datatype, dtype in DATATYPES.items() if dtype != "string"
}
# Datatypes whose binary form numpy reads as it is (BOOL needs its 0/1 check).
_FAST_DECODE: dict[object, np.dtype[Any]] = {d: w for d, w in _WIRE_DTYPES.items() if d != "BOOL"}
# Numeric datatypes -> (native dtype, the numpy kinds of JSON data it takes, the spec dtype), the
# kinds as :func:`_numbers_from_json` checks them: true/false for BOOL, integers for integer types.
_JSON_TARGETS: dict[object, tuple[np.dtype[Any], str, str]] = {
    d: (n, "b" if d == "BOOL" else "iu" if n.kind in "iu" else "iuf", DATATYPES[d]) for d, n in _NATIVE_DTYPES.items()
}
# numpy 1.x allows 32 dims (2.x allows 64); the lower bound keeps both working.
_MAX_DIMS = 32
# An element count must fit the int64 every OIP implementation stores it in.
_MAX_ELEMENTS = 2**63 - 1
# The product of a shape's dims, its zeros counted as 1, that numpy can make an array of
# (of any dtype: it checks that product times the item size, even for an empty array).
_MAX_SPAN = 2**63 // 16
_LENGTH = struct.Struct("<I")
# Numpy dtypes whose bytes are already their wire form (little-endian), by dtype.
_FAST_ENCODE: dict[np.dtype[Any], str] = {w: d for d, w in _WIRE_DTYPES.items()}
# One encoder for every body: json.dumps with options builds a new one per call.
# allow_nan: NaN and Infinity are what Triton's and Python's JSON write for them.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_encode_str = json.encoder.encode_basestring


# The shared-memory parameters (neuropod_serving.protocol.shared_memory.KEYS, which imports this module).
_SHARED_KEYS = frozenset({"shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"})


class _InSharedMemory(Exception):
    """An input of the request is in shared memory (:func:`_decode_tensors` without ``shared``)."""


class _Recheck(Exception):
    """A plain JSON request read before its bounds were checked (:func:`_unchecked_request`) holds
    something other than the common case: it is read again the checked way."""


# --- datatypes ---------------------------------------------------------------


def spec_dtype(datatype: object, *, tensor: str = "?") -> str:
    """The spec dtype an OIP datatype means (``"FP32"`` -> ``"float32"``, ``"BYTES"`` -> ``"string"``).

    :raises ProtocolError: an unknown datatype, or BF16 (no spec dtype holds it).
    """
    if isinstance(datatype, str) and datatype in DATATYPES:
        return DATATYPES[datatype]
    if datatype == "BF16":
        raise ProtocolError(
            f"tensor {tensor!r}: datatype BF16 is not supported (Neuropod specs have no bfloat16); "
            "send FP16 or FP32 instead"
        )
    raise ProtocolError(f"tensor {tensor!r}: datatype {_show(datatype)} is not one of {', '.join(DATATYPES)}")


def oip_datatype(dtype: str) -> str:
    """The OIP datatype of a spec dtype (``"float32"`` -> ``"FP32"``, ``"string"`` -> ``"BYTES"``)."""
    try:
        return SPEC_DATATYPES[dtype]
    except KeyError:
        raise ProtocolError(f"spec dtype {dtype!r} has no Open Inference Protocol datatype") from None


def datatype_of(array: np.ndarray[Any, Any], *, tensor: str = "?") -> str:
    """The OIP datatype of a numpy array; unicode and object arrays (of ``str``) are BYTES.

    :raises ProtocolError: a dtype the protocol cannot carry (complex, datetime, raw bytes...).
    """
    kind = array.dtype.kind
    if kind in "UO":
        return "BYTES"
    if kind in "biuf":
        try:
            return SPEC_DATATYPES[array.dtype.newbyteorder("=").name]
        except KeyError:
            pass
    raise ProtocolError(
        f"tensor {tensor!r}: numpy dtype {array.dtype} has no Open Inference Protocol datatype; "
        "use bool, (u)int8-64, float16/32/64, or str"
    )


# --- metadata ----------------------------------------------------------------


def tensor_metadata(spec: TensorSpec) -> dict[str, Any]:
    """The OIP metadata of one spec entry: symbol and null dims are -1, and
    ``parameters.neuropod_shape`` holds the exact spec shape as a JSON string."""
    return {
        "name": spec.name,
        "datatype": oip_datatype(spec.dtype),
        "shape": [d if isinstance(d, int) else -1 for d in spec.shape],
        "parameters": {SHAPE_PARAMETER: json.dumps(list(spec.shape))},
    }


def spec_from_metadata(metadata: object, *, where: str = "tensor metadata") -> TensorSpec:
    """Rebuild a spec entry from OIP tensor metadata.

    With ``parameters.neuropod_shape`` (a neuropod server) the exact spec comes
    back; without it (any other server) each -1 becomes ``None``.

    :raises ProtocolError: naming the field that is wrong.
    """
    if not isinstance(metadata, Mapping):
        raise ProtocolError(f"{where} must be an object with name, datatype and shape, not {_kind(metadata)}")
    name = metadata.get("name")
    if not isinstance(name, str):
        raise ProtocolError(f"{where}: 'name' must be a string, not {_show(name)}")
    where = f"{where} {name!r}"
    dtype = spec_dtype(metadata.get("datatype"), tensor=name)
    shape = metadata.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= -1 for d in shape):
        raise ProtocolError(f"{where}: 'shape' must be a list of sizes >= 0 or -1 (any size), not {_show(shape)}")
    dims: list[int | str | None] = [None if d == -1 else d for d in shape]
    parameters = metadata.get("parameters") or {}
    if not isinstance(parameters, Mapping):
        raise ProtocolError(f"{where}: 'parameters' must be an object, not {_kind(parameters)}")
    if SHAPE_PARAMETER in parameters:
        dims = _exact_shape(parameters[SHAPE_PARAMETER], shape, where)
    try:
        return parse_spec([{"name": name, "dtype": dtype, "shape": dims}], where)[0]
    except PackageError as e:
        raise ProtocolError(str(e)) from None


def _exact_shape(value: object, shape: list[int], where: str) -> list[int | str | None]:
    problem = f"{where}: parameters.{SHAPE_PARAMETER} must be a JSON list matching shape {shape}"
    try:
        dims = _json.loads(value) if isinstance(value, str) else None
    except ValueError as e:
        raise ProtocolError(f"{problem}, but it is not JSON ({e}): {_show(value)}") from None
    if not isinstance(dims, list) or len(dims) != len(shape):
        raise ProtocolError(f"{problem}, not {_show(value)}")
    for i, (dim, size) in enumerate(zip(dims, shape)):
        ok = (dim == size) if size >= 0 else (dim is None or isinstance(dim, str))
        if not ok or isinstance(dim, bool):
            raise ProtocolError(f"{problem}: entry {i} is {_show(dim)} where shape says {size}")
    return dims


def model_metadata(
    name: str,
    input_spec: Iterable[TensorSpec],
    output_spec: Iterable[TensorSpec],
    *,
    platform: str,
    versions: Sequence[str] = (),
) -> dict[str, Any]:
    """The body of ``GET /v2/models/{name}``: the model's inputs and outputs as OIP tensor metadata."""
    return {
        "name": name,
        "versions": list(versions),
        "platform": platform,
        "inputs": [tensor_metadata(s) for s in input_spec],
        "outputs": [tensor_metadata(s) for s in output_spec],
    }


def specs_from_model_metadata(metadata: object) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The input and output specs in a model metadata body (see :func:`spec_from_metadata`)."""
    if not isinstance(metadata, Mapping):
        raise ProtocolError(f"model metadata must be an object, not {_kind(metadata)}")
    specs: list[tuple[TensorSpec, ...]] = []
    for key in ("inputs", "outputs"):
        entries = metadata.get(key, [])
        if not isinstance(entries, list):
            raise ProtocolError(f"model metadata: {key!r} must be a list, not {_kind(entries)}")
        specs.append(tuple(spec_from_metadata(e, where=f"model metadata {key}[{i}]") for i, e in enumerate(entries)))
    return specs[0], specs[1]


# --- bodies ------------------------------------------------------------------


class Body(NamedTuple):
    """An encoded request or response body.

    ``json_length`` is None for a plain JSON body (``Content-Type:
    application/json``); otherwise the body holds binary tensors and
    ``json_length`` goes in the ``Inference-Header-Content-Length`` header.
    """

    content: bytes
    json_length: int | None


@dataclass
class InferRequest:
    """A decoded ``POST /v2/models/{m}/infer`` request."""

    inputs: dict[str, np.ndarray[Any, Any]]
    #: Requested outputs in order, each with its own ``binary_data`` choice
    #: (None when it made none); None when the request named no outputs (all of them).
    outputs: dict[str, bool | None] | None = None
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    #: The inputs and requested outputs that are in shared memory regions (Triton's shared-memory
    #: extensions), None when none are: such inputs are not in ``inputs`` until the server reads them.
    shared_memory: SharedMemoryRequest | None = None
    #: What the request asks besides its tensors (a timeout, classification, parameters for the
    #: model: :class:`~neuropod_serving.protocol.options.RequestOptions`); None when nothing.
    options: Any = None

    @property
    def binary_data_output(self) -> bool:
        """Whether outputs that made no choice of their own go back binary."""
        return self.parameters.get("binary_data_output") is True

    def binary_outputs(self, names: Iterable[str]) -> set[str]:
        """Which of ``names`` the response should carry as binary data."""
        default = self.binary_data_output
        chosen = self.outputs or {}
        return {n for n in names if (default if chosen.get(n) is None else chosen[n])}


@dataclass
class InferResponse:
    """A decoded inference response."""

    outputs: dict[str, np.ndarray[Any, Any]]
    model_name: str | None = None
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


def parse_infer_request(
    body: bytes | bytearray | memoryview,
    json_length: int | str | None = None,
    *,
    input_spec: Iterable[TensorSpec] | Mapping[str, TensorSpec] | None = None,
) -> InferRequest:
    """Decode an inference request body.

    :param body: the whole HTTP body.
    :param json_length: the ``Inference-Header-Content-Length`` header (as sent,
        a string, or an int), or None when the request had none (plain JSON).
    :param input_spec: the model's input spec (or a dict of it by name): when given, an input the model
        does not have, or whose datatype disagrees with its dtype, is refused
        here. Shapes are left to the model's own spec check.
    :raises ProtocolError: for every fault in the body, naming the tensor.
    """
    specs = specs_by_name(input_spec)
    if json_length is None and len(body) >= _LONG_TEXT:
        # (A short body's checks cost less than this way's own.)
        unchecked = _unchecked_request(body, specs)
        if unchecked is not None:
            return _request(*unchecked, None, None)
    header, binary, known = _split(body, json_length, "request")
    shared_inputs: dict[str, Any] | None = None
    try:
        inputs = _decode_tensors(header, "inputs", binary, specs, required=True, known=known)
    except _InSharedMemory:
        # Decoded again, taking the inputs in shared memory aside (no cost to other requests).
        shared_inputs = {}
        inputs = _decode_tensors(header, "inputs", binary, specs, required=True, shared=shared_inputs)
    return _request(header, inputs, shared_inputs, known)


def _request(
    header: dict[str, Any],
    inputs: dict[str, np.ndarray[Any, Any]],
    shared_inputs: dict[str, Any] | None,
    known: _KnownHeader | None,
) -> InferRequest:
    """The request of ``header`` with its decoded ``inputs``: its outputs, parameters and id read."""
    outputs: dict[str, bool | None] | None = None
    shared_outputs: dict[str, Any] | None = None
    classes: dict[str, int] | None = None
    if header.get("outputs") is not None:
        outputs = {}
        for i, out in enumerate(_list(header["outputs"], "request 'outputs'")):
            where = f"request outputs[{i}]"
            if not isinstance(out, Mapping):
                raise ProtocolError(f"{where} must be an object with a 'name', not {_kind(out)}")
            name = _name(out, where)
            if name in outputs:  # as gRPC: answering once would hide a client's mistake
                raise ProtocolError(f"output {name!r} is requested twice; ask for each output once")
            params = _parameters(out, f"output {name!r}")
            choice = params.get("binary_data")
            if choice is not None and not isinstance(choice, bool):
                raise ProtocolError(f"output {name!r}: parameters.binary_data must be true or false, not {_show(choice)}")
            if params and not _SHARED_KEYS.isdisjoint(params):
                shared_outputs = _shared_output(shared_outputs, name, params, choice)
            outputs[name] = choice
            if len(params) > (choice is not None) and params.get("classification") is not None:
                from neuropod_serving.protocol.options import classification_count

                classes = classes or {}
                classes[name] = classification_count(params["classification"], name)
    parameters = _parameters(header, "request")
    choice = parameters.get("binary_data_output")
    if choice is not None and not isinstance(choice, bool):
        raise ProtocolError(f"request parameters.binary_data_output must be true or false, not {_show(choice)}")
    decoded = InferRequest(inputs=inputs, outputs=outputs, id=_optional_str(header, "id"), parameters=dict(parameters))
    if shared_inputs is not None or shared_outputs is not None:
        from neuropod_serving.protocol.shared_memory import SharedMemoryRequest

        decoded.shared_memory = SharedMemoryRequest(shared_inputs or {}, shared_outputs or {})
    if len(parameters) > (choice is not None) or classes is not None:
        # Only a request that says more than binary_data_output: plain requests skip this.
        from neuropod_serving.protocol.options import request_options

        decoded.options = request_options(parameters, classes)
    _remember(known)
    return decoded


def _shared_output(
    shared: dict[str, Any] | None, name: str, params: Mapping[str, Any], binary: bool | None
) -> dict[str, Any]:
    """``shared`` (made when None) with requested output ``name`` in shared memory added."""
    from neuropod_serving.protocol.shared_memory import shared_output

    if binary:
        raise ProtocolError(f"output {name!r} asks for binary_data and for shared memory; an output goes back one way")
    shared = {} if shared is None else shared
    shared[name] = shared_output(name, params)
    return shared


def parse_infer_response(
    body: bytes | bytearray | memoryview,
    json_length: int | str | None = None,
    *,
    output_spec: Iterable[TensorSpec] | None = None,
) -> InferResponse:
    """Decode an inference response body (the client's side of :func:`build_infer_response`).

    :raises ProtocolError: for every fault in the body, naming the tensor.
    """
    header, binary, known = _split(body, json_length, "response")
    specs = None if output_spec is None else {s.name: s for s in output_spec}
    decoded = InferResponse(
        outputs=_decode_tensors(header, "outputs", binary, specs, required=False, known=known),
        model_name=_optional_str(header, "model_name"),
        model_version=_optional_str(header, "model_version"),
        id=_optional_str(header, "id"),
        parameters=dict(_parameters(header, "response")),
    )
    _remember(known)
    return decoded


def build_infer_request(
    inputs: Mapping[str, np.ndarray[Any, Any]],
    *,
    binary: bool = True,
    outputs: Sequence[str] | None = None,
    binary_outputs: bool = True,
    id: str | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> Body:
    """Encode an inference request (the client's side of :func:`parse_infer_request`).

    :param binary: send the inputs as binary data rather than JSON.
    :param outputs: the outputs to ask for, in order; None asks for all.
    :param binary_outputs: ask for the outputs back as binary data.
    """
    header: dict[str, Any] = {}
    if id is not None:
        header["id"] = id
    params = dict(parameters or {})
    if outputs is None:
        params["binary_data_output"] = binary_outputs
    else:
        header["outputs"] = [{"name": n, "parameters": {"binary_data": binary_outputs}} for n in outputs]
    if params:
        header["parameters"] = params
    return _build(header, "inputs", inputs, set(inputs) if binary else set())


def build_infer_response(
    model_name: str,
    outputs: Mapping[str, np.ndarray[Any, Any]],
    *,
    binary: Collection[str] | bool = False,
    model_version: str | None = None,
    id: str | None = None,
) -> Body:
    """Encode an inference response.

    :param outputs: the tensors to send, in the order they go out (the
        requested outputs, or all of them).
    :param binary: which outputs go as binary data (the names, usually
        :meth:`InferRequest.binary_outputs`), or True/False for all or none.
    """
    header: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        header["model_version"] = model_version
    if id is not None:
        header["id"] = id
    names = set(outputs) if binary is True else set() if binary is False else set(binary)
    return _build(header, "outputs", outputs, names, _response_head(model_name, model_version) if id is None else None)


@functools.lru_cache(maxsize=256)
def _response_head(model_name: str, model_version: str | None) -> str:
    """The JSON of a response header without an id, written once per model and version."""
    header = {"model_name": model_name}
    if model_version is not None:
        header["model_version"] = model_version
    return _ENCODER.encode(header)


def build_shared_response(
    model_name: str,
    outputs: Mapping[str, np.ndarray[Any, Any]],
    shared: Mapping[str, Mapping[str, Any]],
    *,
    binary: Collection[str] = (),
    model_version: str | None = None,
    id: str | None = None,
) -> Body:
    """:func:`build_infer_response` for a request whose outputs ``shared`` were written to shared
    memory: those are listed with their name, datatype and shape only, without data or
    parameters (Triton's C++ client, perf_analyzer's, reads any output's ``parameters`` as
    binary data and needs ``binary_data_size`` there); the others as usual.
    """
    header: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        header["model_version"] = model_version
    if id is not None:
        header["id"] = id
    entries: list[dict[str, Any]] = []
    raws: list[bytes] = []
    for name, array in outputs.items():
        params = shared.get(name)
        if params is None:
            obj, raw = encode_tensor(name, array, binary=name in binary)
            if raw is not None:
                raws.append(raw)
        else:
            obj = {"name": name, "datatype": datatype_of(array, tensor=name), "shape": list(array.shape)}
        entries.append(obj)
    header["outputs"] = entries
    text = _ENCODER.encode(header).encode("utf-8")
    return Body(b"".join([text, *raws]), len(text)) if raws else Body(text, None)


# --- single tensors ----------------------------------------------------------


def encode_tensor(name: str, array: np.ndarray[Any, Any], *, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    """One tensor as an OIP JSON object, plus its raw bytes when ``binary``.

    Strings (unicode arrays, or object arrays of ``str``) are BYTES, UTF-8 encoded.
    """
    array = np.asarray(array)
    datatype = datatype_of(array, tensor=name)
    obj: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    if datatype == "BYTES":
        texts = _texts(array, name)
        if not binary:
            obj["data"] = texts
            return obj, None
        encoded = [t.encode("utf-8") for t in texts]
        raw = b"".join(part for e in encoded for part in (_LENGTH.pack(len(e)), e))
    else:
        if not binary:
            obj["data"] = array.ravel().tolist()
            return obj, None
        raw = np.ascontiguousarray(array, dtype=_WIRE_DTYPES[datatype]).tobytes()
    obj["parameters"] = {"binary_data_size": len(raw)}
    return obj, raw


def decode_tensor(
    obj: object,
    *,
    binary: memoryview | None = None,
    spec: TensorSpec | None = None,
    where: str = "tensor",
    size_name: str = "binary_data_size",
) -> np.ndarray[Any, Any]:
    """One OIP tensor object as a numpy array.

    :param binary: this tensor's own raw bytes, for an object with
        ``parameters.binary_data_size`` (whose size the caller has checked).
    :param spec: when given, the datatype must be this spec entry's dtype.
    :param size_name: what errors call the size of ``binary`` (gRPC's raw
        contents are not a ``binary_data_size``).
    """
    if not isinstance(obj, Mapping):
        raise ProtocolError(f"{where} must be an object with name, datatype, shape and data, not {_kind(obj)}")
    name = _name(obj, where)
    datatype = obj.get("datatype")
    dtype = spec_dtype(datatype, tensor=name)
    if spec is not None and spec.dtype != dtype:
        raise ProtocolError(
            f"tensor {name!r}: datatype {datatype} disagrees with the model's spec ({spec}), "
            f"which needs {oip_datatype(spec.dtype)}"
        )
    assert isinstance(datatype, str)
    shape = _shape(obj.get("shape"), name)
    count = math.prod(shape)
    if count > _MAX_ELEMENTS:
        raise ProtocolError(f"tensor {name!r}: shape {shape} has {count} elements, more than an int64 can count")
    if binary is not None:
        if datatype == "BYTES":
            return _bytes_from_binary(binary, shape, count, name, size_name)
        itemsize = _WIRE_DTYPES[datatype].itemsize
        if len(binary) != count * itemsize:
            raise ProtocolError(
                f"tensor {name!r}: shape {shape} of {datatype} needs {count * itemsize} bytes "
                f"({count} x {itemsize}), but {size_name} is {len(binary)}"
            )
        array = np.frombuffer(binary, dtype=_WIRE_DTYPES[datatype]).reshape(shape)
        if datatype == "BOOL" and count and array.view(np.uint8).max() > 1:
            raise ProtocolError(f"tensor {name!r}: BOOL bytes must be 0 or 1")
        return array
    if "data" not in obj:
        raise ProtocolError(f"tensor {name!r} has neither 'data' nor parameters.binary_data_size")
    if datatype == "BYTES":
        return _bytes_from_json(obj["data"], shape, count, name)
    return _numbers_from_json(obj["data"], datatype, shape, count, name)


def _numbers_from_json(data: object, datatype: str, shape: list[int], count: int, name: str) -> np.ndarray[Any, Any]:
    target = _NATIVE_DTYPES[datatype]
    try:
        parsed = np.array(data)
    except (ValueError, TypeError, OverflowError, RecursionError):
        # Ragged nesting, mostly: numpy refuses lists of unequal lengths.
        raise ProtocolError(f"tensor {name!r}: 'data' must be a list, nested lists of equal lengths, of numbers") from None
    if parsed.size != count:
        raise ProtocolError(f"tensor {name!r}: shape {shape} holds {count} elements, but 'data' has {parsed.size}")
    if count == 0:
        return np.zeros(shape, target)
    kind = parsed.dtype.kind
    wanted = "b" if datatype == "BOOL" else "iu" if target.kind in "iu" else "iuf"
    if wanted == "iu" and kind in "fO":
        # numpy turns ints past int64 mixed with smaller ones into float64 (or
        # objects), which would round them: look at the JSON values themselves.
        return _big_ints(data, target, datatype, shape, name)
    if kind not in wanted or (kind != "b" and _bool_among(parsed, data)):
        what = {"b": "true or false", "iu": "JSON integers", "iuf": "JSON numbers"}[wanted]
        got = _describe_kind(parsed) if kind not in wanted else "true or false among them"
        raise ProtocolError(f"tensor {name!r}: {datatype} data must be {what}; got {got}")
    # Only integer targets have a range to check: JSON integers sent for an FP
    # tensor ([1, 2] for FP32) are plain numbers and convert like any other.
    if kind in "iu" and target.kind in "iu" and not np.can_cast(parsed.dtype, target):
        info = np.iinfo(target)
        if parsed.min() < info.min or parsed.max() > info.max:
            raise ProtocolError(f"tensor {name!r}: {datatype} data must lie in [{info.min}, {info.max}]")
    return parsed.astype(target, copy=False).reshape(shape)


def _in_range(parsed: np.ndarray[Any, Any], dtype: np.dtype[Any]) -> bool:
    """Whether the integers ``parsed`` all fit ``dtype`` (an integer dtype)."""
    if np.can_cast(parsed.dtype, dtype):
        return True
    info = np.iinfo(dtype)
    return not (parsed.min() < info.min or parsed.max() > info.max)


#: Up to this many numbers, :func:`_bool_among` looks at their types one by one.
_FEW = 64


def _bool_among(parsed: np.ndarray[Any, Any], data: object) -> bool:
    """Whether JSON ``data``, which numpy read as the numbers ``parsed``, holds a true or false: numpy
    reads them as 1 and 0 among numbers, so only the elements equal to 0 or 1 are looked at (none, in
    most tensors of floats: then this is a few vector operations)."""
    if parsed.size <= _FEW and type(data) is list:
        # A few numbers: their types looked at directly cost less than numpy's calls.
        return bool in map(type, data if parsed.ndim == 1 else _flatten(data, ""))
    flat = parsed.ravel()
    at = np.flatnonzero((flat == 0) | (flat == 1))
    if not at.size:
        return False
    values = data if parsed.ndim == 1 and type(data) is list else _flatten(data, "")
    return any(type(values[i]) is bool for i in at.tolist())


def _bools_among(read: list[tuple[np.ndarray[Any, Any], Any]]) -> bool:
    """:func:`_bool_among` of each (array, data) pair of ``read``, the arrays looked at in one go."""
    if not read:
        return False
    flat = read[0][0].ravel() if len(read) == 1 else np.concatenate([parsed.ravel() for parsed, _ in read])
    at = np.flatnonzero((flat == 0) | (flat == 1))
    if not at.size:
        return False
    ends = np.cumsum([parsed.size for parsed, _ in read])
    return any(_bool_among(*read[k]) for k in sorted(set(np.searchsorted(ends, at, side="right").tolist())))


def _big_ints(data: object, target: np.dtype[Any], datatype: str, shape: list[int], name: str) -> np.ndarray[Any, Any]:
    values = _flatten(data, name)
    if not all(_is_int(v) for v in values):
        raise ProtocolError(f"tensor {name!r}: {datatype} data must be JSON integers; it holds other values")
    try:
        return np.array(values, dtype=target).reshape(shape)
    except OverflowError:
        info = np.iinfo(target)
        raise ProtocolError(f"tensor {name!r}: {datatype} data must lie in [{info.min}, {info.max}]") from None


def _bytes_from_json(data: object, shape: list[int], count: int, name: str) -> np.ndarray[Any, Any]:
    texts = _flatten(data, name)
    if len(texts) != count:
        raise ProtocolError(f"tensor {name!r}: shape {shape} holds {count} elements, but 'data' has {len(texts)}")
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise ProtocolError(f"tensor {name!r}: BYTES data must be JSON strings; element {bad} is {_kind(texts[bad])}")
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        # JSON can escape a lone surrogate (\ud800), which no UTF-8 text holds.
        raise ProtocolError(f"tensor {name!r}: BYTES data must be valid Unicode text (it holds a lone surrogate)") from None
    return _object_array(texts, shape)


def _bytes_from_binary(
    raw: memoryview, shape: list[int], count: int, name: str, size_name: str = "binary_data_size"
) -> np.ndarray[Any, Any]:
    # Each element costs at least its 4-byte length, which bounds the loop by the body.
    if count * _LENGTH.size > len(raw):
        raise ProtocolError(
            f"tensor {name!r}: shape {shape} holds {count} BYTES elements, which need at least "
            f"{count * _LENGTH.size} bytes, but {size_name} is {len(raw)}"
        )
    texts: list[str] = []
    pos = 0
    for i in range(count):
        if pos + _LENGTH.size > len(raw):
            raise ProtocolError(f"tensor {name!r}: BYTES element {i} runs past {size_name} ({len(raw)})")
        (size,) = _LENGTH.unpack_from(raw, pos)
        pos += _LENGTH.size
        if pos + size > len(raw):
            raise ProtocolError(
                f"tensor {name!r}: BYTES element {i} says it is {size} bytes long, "
                f"which runs past {size_name} ({len(raw)})"
            )
        try:
            texts.append(str(raw[pos : pos + size], "utf-8"))
        except UnicodeDecodeError as e:
            raise ProtocolError(f"tensor {name!r}: BYTES element {i} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        pos += size
    if pos != len(raw):
        raise ProtocolError(
            f"tensor {name!r}: {count} BYTES elements of shape {shape} fill {pos} bytes, "
            f"but {size_name} is {len(raw)}"
        )
    return _object_array(texts, shape)


# --- helpers -----------------------------------------------------------------


class _KnownHeader:
    """The JSON header of a binary body, parsed, and once a decode of it took the fast path for
    every tensor, each tensor's name, datatype, wire dtype, shape and size (``plans``, by key)."""

    __slots__ = ("doc", "key", "plans")

    def __init__(self, doc: dict[str, Any], key: bytes | None) -> None:
        self.doc = doc
        #: The header's bytes until it is remembered (:func:`_remember`), then None.
        self.key = key
        self.plans: dict[str, tuple[tuple[str, str, np.dtype[Any], tuple[int, ...], int], ...]] = {}


#: Headers of binary bodies remembered by their bytes, within a budget of bytes
#: (:class:`~neuropod_serving.protocol._forms.FormCache`), once a body with the header
#: decoded cleanly. A binary body's header depends only on the tensors' names, datatypes and
#: shapes, not their values, so a client sending the same form of request again costs no JSON
#: parse and no per-tensor checks beyond the spec's datatypes.
_KNOWN: FormCache[bytes, _KnownHeader] = FormCache()


def _remember(known: _KnownHeader | None) -> None:
    """Keep a header that has just decoded cleanly for the next body of its form."""
    if known is not None and known.key is not None:
        _KNOWN.put(known.key, known, len(known.key))
        known.key = None


def _split(
    body: bytes | bytearray | memoryview, json_length: int | str | None, what: str
) -> tuple[dict[str, Any], memoryview, _KnownHeader | None]:
    view = memoryview(body)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    length = len(view) if json_length is None else _header_length(json_length, len(view))
    key = None
    if json_length is not None and length <= MAX_FORM_BYTES:
        key = bytes(view[:length])
        known = _KNOWN.get(key)
        if known is not None:
            return known.doc, view[length:], known
    if length > _json.MAX_BYTES:
        raise ProtocolError(
            f"the {what}'s JSON is {length:,} bytes, more than the {_json.MAX_BYTES:,} allowed; "
            "send large tensors as binary data",
            status=413,
        )
    try:
        text = str(view[:length], "utf-8")
        _json.check_bounds(text)
        header = _loads(view[:length], text)
    except UnicodeDecodeError as e:
        raise ProtocolError(f"the {what}'s JSON is not UTF-8 ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise ProtocolError(f"the {what} is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"the {what} must be a JSON object, not {_kind(header)}")
    if key is None:
        return header, view[length:], None
    # Remembered only once a body decodes cleanly with it: refused ones cost nothing after their answer.
    return header, view[length:], _KnownHeader(header, key)


def _loads(raw: memoryview, text: str) -> Any:
    """The JSON ``text`` (whose bounds were checked), by orjson when it takes it: about 5x
    Python's json on a body of numbers (100 tensors of [10, 5]: 2.0 -> 0.4 ms)."""
    orjson = _orjson_module()
    if orjson is not None and not (_long_integer(raw) if len(text) >= _LONG_TEXT else _long_integer_short(bytes(raw))):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            # NaN/Infinity, integers past 64 bits, lone surrogates: Python's json
            # reads them (as before), or words the error.
            pass
    return _json.loads(text)


def _unchecked_request(
    body: bytes | bytearray | memoryview, specs: Mapping[str, TensorSpec] | None
) -> tuple[dict[str, Any], dict[str, np.ndarray[Any, Any]]] | None:
    """A plain JSON request's header and inputs read the quick way, or None where that way does not
    give the very answer of the checked one (:func:`_split` and :func:`_decode_tensors`).

    The checked way scans the text for its depth and for integers of 19 digits or more before
    parsing it (about a third of the time of parsing a body of numbers). Here orjson reads the
    body first (it refuses documents over 1,024 levels deep, infinities and bad UTF-8 by itself),
    and what it gave is checked instead, where that is cheap: every input numeric, flat enough
    and without parameters (:func:`_decode_tensors` with ``unchecked``), every other value of the
    request no deeper than the bound, and no number that may be an integer past 64 bits (which
    orjson reads as a float, and the checked way refuses or keeps exact). Anything else is read
    again the checked way, which words what is wrong: a request costs one parse more, never a
    different answer.
    """
    orjson = _orjson_module()
    if orjson is None or len(body) > _json.MAX_BYTES:
        return None
    try:
        header = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(header) is not dict or type(header.get("inputs")) is not list:
        return None
    floats: list[np.ndarray[Any, Any]] = []
    try:
        # A number past float32 that was an integer of 40 digits is read again, not warned about.
        with np.errstate(over="ignore"):
            inputs = _json_inputs(header["inputs"], specs, floats)
    except _Recheck:
        return None
    for key, value in header.items():
        if key != "inputs" and not _bounded(value, _json.MAX_DEPTH - 1):
            return None
    if floats:
        values = floats[0] if len(floats) == 1 else np.concatenate([f.ravel() for f in floats])
        if not np.abs(values).max() < _INT_AS_FLOAT:
            return None
    return header, inputs


def _json_inputs(
    entries: list[Any], specs: Mapping[str, TensorSpec] | None, floats: list[np.ndarray[Any, Any]]
) -> dict[str, np.ndarray[Any, Any]]:
    """The inputs of a request read by :func:`_unchecked_request`, when every one is what
    :func:`_decode_tensors` takes its JSON fast path for (and gives the same array for): a
    name, a numeric datatype the spec agrees with, a shape of plain dims, numbers as ``data``
    (at most :data:`_MAX_DIMS` levels), no other key and no parameters. Else :class:`_Recheck`.
    Float arrays as read are added to ``floats`` (for the caller's range check)."""
    plan: list[tuple[str, list[Any], int, tuple[np.dtype[Any], str, str], Any]] = []
    names: set[str] = set()
    for obj in entries:
        if type(obj) is not dict:
            raise _Recheck()
        params = obj.get("parameters", _NONE)
        if len(obj) != (4 if params is _NONE else 5) or (params is not _NONE and params is not None and params != {}):
            raise _Recheck()
        name = obj.get("name")
        shape = obj.get("shape")
        target = _JSON_TARGETS.get(obj.get("datatype"))
        if type(name) is not str or not name or name in names or target is None or type(shape) is not list:
            raise _Recheck()
        if specs is not None:
            spec = specs.get(name)
            if spec is None or spec.dtype != target[2]:
                raise _Recheck()
        count = _count(shape) if len(shape) <= _MAX_DIMS else 0
        if not count or "data" not in obj:
            raise _Recheck()
        names.add(name)
        plan.append((name, shape, count, target, obj["data"]))
    joined = _joined(plan) if len(plan) > 1 else None
    if joined is not None:
        return joined
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    numeric: list[tuple[np.ndarray[Any, Any], Any]] = []  # a true or false among numbers is refused
    for name, shape, count, target, data in plan:
        try:
            parsed = np.array(data)
        except (ValueError, TypeError, OverflowError, RecursionError):
            raise _Recheck() from None
        kind = parsed.dtype.kind
        if parsed.size != count or kind not in target[1] or parsed.ndim > _MAX_DIMS:
            raise _Recheck()
        if kind == "f":
            floats.append(parsed)
        elif target[1] == "iu" and not _in_range(parsed, target[0]):
            raise _Recheck()
        if kind != "b":
            numeric.append((parsed, data))
        arrays[name] = parsed.astype(target[0], copy=False).reshape(shape)
    if _bools_among(numeric):
        raise _Recheck()
    return arrays


def _joined(plan: list[tuple[str, list[Any], int, tuple[np.dtype[Any], str, str], Any]]) -> dict[str, np.ndarray[Any, Any]] | None:
    """The inputs of :func:`_json_inputs`'s ``plan`` made by one numpy conversion of all their numbers
    (a request of many small tensors spends most of its decoding in numpy's per-call costs), or None
    where that might not give the very arrays that one conversion per tensor gives: only FP32 or FP64
    tensors, all of one datatype, each ``data`` a flat list of its element count, together read as
    floats below 2**53 in magnitude (so an integer among them converts exactly, as it would in an
    integer array of its own, and none needs the caller's range check), with no true or false among
    them (a tensor of bools alone, which the per-tensor way refuses, reads as 1 and 0 here). The
    arrays are views of one buffer."""
    target = plan[0][3]
    if target[0] not in _JOINABLE:
        return None
    numbers: list[Any] = []
    for _, _, count, dtype, data in plan:
        if dtype is not target or type(data) is not list or len(data) != count:
            return None
        numbers += data
    try:
        parsed = np.array(numbers)
    except (ValueError, TypeError, OverflowError, RecursionError):
        return None
    if parsed.dtype.kind != "f" or parsed.ndim != 1 or not np.abs(parsed).max() < _EXACT_INTEGERS:
        return None
    if _bool_among(parsed, numbers):  # a true or false among the numbers: the per-tensor way says which
        return None
    flat = parsed.astype(target[0], copy=False)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    at = 0
    for name, shape, count, _, _ in plan:
        arrays[name] = flat[at : at + count].reshape(shape)
        at += count
    return arrays


_JOINABLE = (np.dtype(np.float32), np.dtype(np.float64))
# Every integer below this in magnitude is a float64 exactly.
_EXACT_INTEGERS = 2.0**53


_NONE = object()
# orjson reads an integer outside [-2**63, 2**64) as a float, so no float below 2**63 in
# magnitude was one: what the checked way keeps exact, or refuses, is never read as a float.
_INT_AS_FLOAT = 2.0**63


def _bounded(value: Any, depth: int) -> bool:
    """Whether ``value`` (parsed by orjson) nests at most ``depth`` levels deep and holds no
    float that may have been an integer past 64 bits."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is float:
        return bool(abs(value) < _INT_AS_FLOAT)
    if depth <= 0:
        return False
    if kind is dict:
        return all(_bounded(v, depth - 1) for v in value.values())
    return kind is list and all(_bounded(v, depth - 1) for v in value)


# A run of 19 digits or more can be an integer past 64 bits, which orjson reads
# as a float (rounded): such documents go to Python's json, which keeps it exact.
_RUN = 19
# In _long_integer's marks: a digit is 2, a '.' 0 and any other byte 1.
_RUN_START = b"\x01" + b"\x02" * _RUN
_DOT = ord(".")


# Texts from this long on are screened by numpy (_long_integer), shorter ones by bytes methods
# (_long_integer_short), which cost less than numpy's calls on a small body.
_LONG_TEXT = 4096
_DIGITS_AS_D = bytes.maketrans(b"0123456789", b"dddddddddd")
_D_RUN = b"d" * _RUN
_D = ord("d")


def _long_integer_short(raw: bytes) -> bool:
    """:func:`_long_integer` of a short body (the same answer) with bytes methods: one
    translate and a find, about 0.3 us on a 250-byte request (numpy's calls cost 4)."""
    masked = raw.translate(_DIGITS_AS_D)
    at = masked.find(_D_RUN)
    while at >= 0:
        if at == 0 or masked[at - 1] != _DOT:
            return True
        end = at + _RUN
        while end < len(masked) and masked[end] == _D:
            end += 1
        at = masked.find(_D_RUN, end)
    return False


def _long_integer(raw: bytes | bytearray | memoryview) -> bool:
    """Whether the UTF-8 JSON ``raw`` may hold an integer of 19 digits or more (a fraction's
    digits, after a '.', do not count): a run of 19 ASCII digits at the start or after a byte
    that is not a '.'. Its bytes are marked by numpy (a few vector passes) and the run found
    by one bytes.find: 10x less than a str.translate of 100 kB."""
    codes = np.frombuffer(raw, np.uint8)
    # uint8 wraps below '0': one comparison finds the digits.
    marks = ((codes != _DOT).view(np.uint8) + ((codes - 48) < 10).view(np.uint8)).tobytes()
    return marks.startswith(_RUN_START[1:]) or _RUN_START in marks


@functools.cache
def _orjson_module() -> Any:
    """orjson (a dependency of neuropod-serving, imported on first use), or None without it."""
    try:
        import orjson
    except ImportError:
        return None
    return orjson


def _header_length(value: int | str, body_size: int) -> int:
    text = str(value).strip()
    if not text.isascii() or not text.isdigit():
        raise ProtocolError(f"{HEADER_LENGTH} must be a byte count, not {_show(value)}")
    length = int(text)
    if length > body_size:
        raise ProtocolError(f"{HEADER_LENGTH} is {length}, but the whole body is only {body_size} bytes")
    return length


def _planned(
    plan: tuple[tuple[str, str, np.dtype[Any], tuple[int, ...], int], ...],
    binary: memoryview,
    specs: Mapping[str, TensorSpec] | None,
) -> dict[str, np.ndarray[Any, Any]] | None:
    """The arrays of a known header's binary body, or None when anything does not fit (the
    full decode then words it): every tensor must still be in the spec with its datatype,
    and the body must hold exactly the sizes the header says."""
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    pos = 0
    available = len(binary)
    for name, datatype, wire, shape, size in plan:
        if specs is not None:
            spec = specs.get(name)
            if spec is None or spec.dtype != DATATYPES[datatype]:
                return None
        if pos + size > available:
            return None
        arrays[name] = np.ndarray(shape, dtype=wire, buffer=binary, offset=pos)
        pos += size
    return arrays if pos == available else None


def _decode_tensors(
    header: Mapping[str, Any],
    key: str,
    binary: memoryview,
    specs: Mapping[str, TensorSpec] | None,
    *,
    required: bool,
    known: _KnownHeader | None = None,
    shared: dict[str, Any] | None = None,
) -> dict[str, np.ndarray[Any, Any]]:
    """The tensors of ``header[key]`` as arrays (binary ones views of ``binary``).

    :param shared: where inputs in shared memory go (as
        :class:`~neuropod_serving.protocol.shared_memory.SharedTensor`); when None, the
        first one met raises :class:`_InSharedMemory` (the caller decodes again with a dict).
    """
    if known is not None:
        plan = known.plans.get(key)
        if plan is not None:
            planned = _planned(plan, binary, specs)
            if planned is not None:
                return planned
    kind = key[:-1]  # "input" / "output"
    fast: list[tuple[str, str, np.dtype[Any], tuple[int, ...], int]] | None = [] if known is not None else None
    if key not in header and not required:
        entries: list[Any] = []
    else:
        entries = _list(header.get(key), f"{kind}s")
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    pos = 0
    available = len(binary)
    for i, obj in enumerate(entries):
        if type(obj) is dict:
            # The common binary case, checked without building any message;
            # anything unusual (or wrong) goes the full way below, which words the error.
            name: Any = obj.get("name")
            params = obj.get("parameters")
            datatype: Any = obj.get("datatype")
            shape = obj.get("shape")
            if type(name) is not str or type(datatype) is not str or type(shape) is not list or not name or name in arrays:
                pass
            elif "data" in obj:
                # The common JSON case: numbers without parameters, one numpy conversion, the checks of
                # _numbers_from_json; anything else, and any data that does not convert cleanly, goes
                # the full way below, which words what is wrong.
                target = _JSON_TARGETS.get(datatype)
                if (
                    target is not None and (params is None or (type(params) is dict and not params))
                    and (not shared or name not in shared) and len(shape) <= _MAX_DIMS
                ):  # fmt: skip
                    spec = specs.get(name) if specs is not None else None
                    count = _count(shape) if specs is None or (spec is not None and spec.dtype == target[2]) else 0
                    if count:
                        try:
                            parsed = np.array(obj["data"])
                        except (ValueError, TypeError, OverflowError, RecursionError):
                            parsed = None
                        if (
                            parsed is not None and parsed.size == count and parsed.dtype.kind in target[1]
                            and (target[1] != "iu" or _in_range(parsed, target[0]))
                            and (parsed.dtype.kind == "b" or not _bool_among(parsed, obj["data"]))
                        ):  # fmt: skip
                            arrays[name] = parsed.astype(target[0], copy=False).reshape(shape)
                            fast = None  # a JSON tensor: the header is not planned
                            continue
            elif type(params) is dict:
                spec = specs.get(name) if specs is not None else None
                wire = _FAST_DECODE.get(datatype)
                size = params.get("binary_data_size")
                if (
                    wire is not None and type(size) is int and len(params) == 1 and (specs is None or spec is not None)
                    and (spec is None or spec.dtype == DATATYPES[datatype])
                    and 0 <= size <= available - pos and len(shape) <= _MAX_DIMS and _plain_dims(shape)
                    and size == math.prod(shape) * wire.itemsize
                ):  # fmt: skip
                    arrays[name] = np.ndarray(shape, dtype=wire, buffer=binary, offset=pos)
                    pos += size
                    if fast is not None:
                        fast.append((name, datatype, wire, tuple(shape), size))
                    continue
        fast = None  # this tensor takes the full way: the header is not planned
        where = f"{key}[{i}]"
        if not isinstance(obj, Mapping):
            raise ProtocolError(f"{where} must be an object with name, datatype, shape and data, not {_kind(obj)}")
        name = _name(obj, where)
        if name in arrays or (shared and name in shared):
            raise ProtocolError(f"{kind} {name!r} appears twice; each {kind} is sent once")
        spec = None
        if specs is not None:
            if name not in specs:
                raise ProtocolError(
                    f"{kind} {name!r} is not one of this model's {kind}s: {', '.join(specs) or '(none)'}"
                )
            spec = specs[name]
        params = _parameters(obj, f"{kind} {name!r}")
        if params and not _SHARED_KEYS.isdisjoint(params):
            if key != "inputs":
                raise ProtocolError(f"{kind} {name!r} was written to shared memory, which this client does not read")
            if shared is None:
                raise _InSharedMemory()
            from neuropod_serving.protocol.shared_memory import shared_input

            carries = "'data'" if "data" in obj else "binary_data_size" if "binary_data_size" in params else None
            shared[name] = shared_input(name, obj.get("datatype"), obj.get("shape"), params, spec=spec, carries=carries)
            continue
        size = params.get("binary_data_size")
        raw = None
        if size is not None:
            if not _is_int(size) or size < 0:
                raise ProtocolError(f"{kind} {name!r}: binary_data_size must be a byte count, not {_show(size)}")
            if "data" in obj:
                raise ProtocolError(f"{kind} {name!r} has both 'data' and binary_data_size; send one")
            if pos + size > len(binary):
                raise ProtocolError(
                    f"{kind} {name!r}: binary_data_size {size} runs past the body: "
                    f"{len(binary) - pos} bytes of binary data are left after the {kind}s before it"
                    + ("" if len(binary) else f" (is the {HEADER_LENGTH} header missing?)")
                )
            raw = binary[pos : pos + size]
            pos += size
        arrays[name] = decode_tensor(obj, binary=raw, spec=spec, where=where)
    if pos != len(binary):
        raise ProtocolError(
            f"the body holds {len(binary)} bytes of binary data after its JSON, but the {kind}s' "
            f"binary_data_size add up to {pos}"
        )
    if fast is not None and known is not None:
        known.plans[key] = tuple(fast)
    return arrays


#: JSON headers of binary bodies built, by (header, key, tensor names, dtypes, shapes), within a budget of bytes.
_BUILT: FormCache[Any, bytes] = FormCache()


def _build(
    header: dict[str, Any], key: str, tensors: Mapping[str, np.ndarray[Any, Any]], binary: set[str],
    head: str | None = None,
) -> Body:  # fmt: skip
    """The body of ``header`` with ``tensors`` under ``key`` (``binary``: those sent as binary
    data); ``head``: the JSON of ``header``, when the caller has it."""
    if head is None:
        head = _ENCODER.encode(header)
    form: Any = None
    if tensors and all(type(a) is np.ndarray and a.dtype in _FAST_ENCODE and type(n) is str and n in binary
                       for n, a in tensors.items()):  # fmt: skip
        # Every tensor binary and numeric: the JSON depends only on their names, dtypes and shapes.
        form = (head, key, tuple((n, a.dtype, a.shape) for n, a in tensors.items()))
        known = _BUILT.get(form)
        if known is not None:
            return Body(b"".join([known, *(a.data if a.ndim and a.flags.c_contiguous else a.tobytes()
                                           for a in tensors.values())]), len(known))  # fmt: skip
    parts: list[str] = []
    raws: list[Any] = []
    orjson = _orjson_module()
    for name, array in tensors.items():
        if orjson is not None and type(array) is np.ndarray and type(name) is str and name not in binary:
            datatype = _FAST_ENCODE.get(array.dtype)
            if datatype is not None:
                # A numeric tensor as JSON data: its numbers by orjson (the same shortest digits that
                # round-trip as Python's repr, written in a few µs instead of ~0.3 µs a number).
                data = orjson.dumps(array.ravel().tolist())
                if b"null" not in data:  # orjson writes NaN and infinities as null: the full way writes them
                    parts.append(
                        f'{{"name":{_encode_str(name)},"datatype":"{datatype}",'
                        f'"shape":[{",".join(map(str, array.shape))}],"data":{data.decode("ascii")}}}'
                    )
                    continue
        datatype = _FAST_ENCODE.get(array.dtype) if type(array) is np.ndarray and name in binary else None
        if datatype is not None and type(name) is str and array.flags.c_contiguous:
            # The common case, formatted directly: a binary numeric tensor whose
            # memory is already its wire form (sent without a copy).
            parts.append(
                f'{{"name":{_encode_str(name)},"datatype":"{datatype}","shape":[{",".join(map(str, array.shape))}],'
                f'"parameters":{{"binary_data_size":{array.nbytes}}}}}'
            )
            raws.append(array.data if array.ndim else array.tobytes())
            continue
        obj, raw = encode_tensor(name, array, binary=name in binary)
        parts.append(_ENCODER.encode(obj))
        if raw is not None:
            raws.append(raw)
    tensor_list = f'"{key}":[{",".join(parts)}]}}'
    text = (head[:-1] + ("," if len(head) > 2 else "") + tensor_list).encode("utf-8")
    if not raws:
        return Body(text, None)
    if form is not None:
        _BUILT.put(form, text, len(text) + len(form[0]))
    return Body(b"".join([text, *raws]), len(text))


def specs_by_name(spec: Iterable[TensorSpec] | Mapping[str, TensorSpec] | None) -> Mapping[str, TensorSpec] | None:
    """A spec (a sequence of tensors, or already a dict of them by name) as a dict by name."""
    if spec is None or type(spec) is dict:
        return spec
    return {s.name: s for s in cast("Iterable[TensorSpec]", spec)}


def _plain_dims(shape: list[Any]) -> bool:
    """Whether every dim is an int >= 0 (not a bool, float or -1) and numpy can make an array of the shape."""
    span = 1
    for d in shape:  # a plain loop: all() over a generator costs more per request
        if type(d) is not int or d < 0:
            return False
        span *= d or 1
    return span <= _MAX_SPAN


def _count(shape: list[Any]) -> int:
    """The element count of ``shape`` when every dim is an int >= 0 (not a bool, float or -1) and
    numpy can make an array of it (:func:`_plain_dims`), else 0."""
    count = span = 1
    for d in shape:
        if type(d) is not int or d < 0:
            return 0
        count *= d
        span *= d or 1
    return count if span <= _MAX_SPAN else 0


def _spannable(shape: Sequence[int]) -> bool:
    """Whether numpy can make an array of ``shape`` (dims >= 0), however few elements it holds."""
    span = 1
    for d in shape:
        span *= d or 1
    return span <= _MAX_SPAN


def _shape(shape: object, name: str) -> list[int]:
    if not isinstance(shape, list):
        raise ProtocolError(f"tensor {name!r}: 'shape' must be a list of sizes, not {_show(shape)}")
    for i, dim in enumerate(shape):
        if not _is_int(dim) or dim < 0:
            raise ProtocolError(f"tensor {name!r}: shape[{i}] is {_show(dim)}; a dim is an integer >= 0")
    if len(shape) > _MAX_DIMS:
        raise ProtocolError(f"tensor {name!r}: shape has {len(shape)} dims, more than the {_MAX_DIMS} supported")
    if not _spannable(shape):
        count = math.prod(shape)
        if count > _MAX_ELEMENTS:
            raise ProtocolError(f"tensor {name!r}: shape {shape} has {count} elements, more than an int64 can count")
        raise ProtocolError(
            f"tensor {name!r}: shape {shape} is larger than any array can be (the product of its dims, "
            f"zeros counted as 1, passes {_MAX_SPAN:,}), even when it holds no elements"
        )
    return shape


def _flatten(data: object, name: str) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    stack: list[Iterable[Any]] = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def _object_array(texts: list[str], shape: list[int]) -> np.ndarray[Any, Any]:
    # Object arrays, not numpy unicode: 'U' arrays drop trailing NUL characters.
    array = np.empty(len(texts), dtype=object)
    array[:] = texts
    return array.reshape(shape)


def _texts(array: np.ndarray[Any, Any], name: str) -> list[str]:
    texts: list[Any] = array.ravel().tolist()
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ProtocolError(f"tensor {name!r}: a BYTES tensor holds str, but element {i} is {_kind(t)}")
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError(f"tensor {name!r}: a string holds a lone surrogate, which UTF-8 cannot encode") from None
    return texts  # every element checked above to be a str


def _name(obj: Mapping[str, Any], where: str) -> str:
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{where}: 'name' must be a non-empty string, not {_show(name)}")
    return name


def _parameters(obj: Mapping[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ProtocolError(f"{where}: 'parameters' must be an object, not {_kind(params)}")
    return params


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProtocolError(f"{what} must be a JSON list, not {_show(value)}")
    return value


def _optional_str(obj: Mapping[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ProtocolError(f"{key!r} must be a string, not {_show(value)}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe_kind(array: np.ndarray[Any, Any]) -> str:
    return {"b": "true/false", "i": "integers", "u": "integers", "f": "numbers with a fraction or exponent",
            "U": "strings"}.get(array.dtype.kind, "null, objects or out-of-range integers")  # fmt: skip


def _kind(value: object) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _show(value: object, limit: int = 80) -> str:
    text = "missing" if value is None else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    "build_shared_response",
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
