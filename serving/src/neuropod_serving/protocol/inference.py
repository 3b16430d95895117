"""Inference requests and responses (``POST /v2/models/{m}/infer``): decoded, and encoded as bodies.

Everything a client sends is untrusted: every fault in it is a
:class:`~neuropod_serving.errors.ProtocolError` that names the tensor and what was
expected, and no other exception escapes the parsers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from neuropod.spec import TensorSpec
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol.bodies import (
    ENCODER,
    HEADER_LENGTH,
    LONG_TEXT,
    Body,
    KnownHeader,
    build_body,
    remember,
    split_body,
)
from neuropod_serving.protocol.datatypes import DATATYPES, FAST_DECODE, JSON_TARGETS, datatype_of
from neuropod_serving.protocol.fast_json import unchecked_request
from neuropod_serving.protocol.fields import is_int, json_list, kind_of, optional_str, parameters_of, show, tensor_name
from neuropod_serving.protocol.metadata import specs_by_name
from neuropod_serving.protocol.options import classification_count, request_options
from neuropod_serving.protocol.shapes import MAX_DIMS, plain_count, plain_dims
from neuropod_serving.protocol.shm_params import KEYS, SharedMemoryRequest, shared_input, shared_output
from neuropod_serving.protocol.tensors import bool_among, decode_tensor, encode_tensor, in_range


class _InSharedMemory(Exception):
    """An input of the request is in shared memory (:func:`_decode_tensors` without ``shared``)."""



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
    if json_length is None and len(body) >= LONG_TEXT:
        # (A short body's checks cost less than this way's own.)
        unchecked = unchecked_request(body, specs)
        if unchecked is not None:
            return _request(*unchecked, None, None)
    header, binary, known = split_body(body, json_length, "request")
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
    known: KnownHeader | None,
) -> InferRequest:
    """The request of ``header`` with its decoded ``inputs``: its outputs, parameters and id read."""
    outputs: dict[str, bool | None] | None = None
    shared_outputs: dict[str, Any] | None = None
    classes: dict[str, int] | None = None
    if header.get("outputs") is not None:
        outputs = {}
        for i, out in enumerate(json_list(header["outputs"], "request 'outputs'")):
            where = f"request outputs[{i}]"
            if not isinstance(out, Mapping):
                raise ProtocolError(f"{where} must be an object with a 'name', not {kind_of(out)}")
            name = tensor_name(out, where)
            if name in outputs:  # as gRPC: answering once would hide a client's mistake
                raise ProtocolError(f"output {name!r} is requested twice; ask for each output once")
            params = parameters_of(out, f"output {name!r}")
            choice = params.get("binary_data")
            if choice is not None and not isinstance(choice, bool):
                raise ProtocolError(f"output {name!r}: parameters.binary_data must be true or false, not {show(choice)}")
            if params and not KEYS.isdisjoint(params):
                shared_outputs = _shared_output(shared_outputs, name, params, choice)
            outputs[name] = choice
            if len(params) > (choice is not None) and params.get("classification") is not None:
                classes = classes or {}
                classes[name] = classification_count(params["classification"], name)
    parameters = parameters_of(header, "request")
    choice = parameters.get("binary_data_output")
    if choice is not None and not isinstance(choice, bool):
        raise ProtocolError(f"request parameters.binary_data_output must be true or false, not {show(choice)}")
    decoded = InferRequest(inputs=inputs, outputs=outputs, id=optional_str(header, "id"), parameters=dict(parameters))
    if shared_inputs is not None or shared_outputs is not None:
        decoded.shared_memory = SharedMemoryRequest(shared_inputs or {}, shared_outputs or {})
    if len(parameters) > (choice is not None) or classes is not None:
        # Only a request that says more than binary_data_output: plain requests skip this.
        decoded.options = request_options(parameters, classes)
    remember(known)
    return decoded


def _shared_output(
    shared: dict[str, Any] | None, name: str, params: Mapping[str, Any], binary: bool | None
) -> dict[str, Any]:
    """``shared`` (made when None) with requested output ``name`` in shared memory added."""
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
    bytes_outputs: Collection[str] = (),
) -> InferResponse:
    """Decode an inference response body (the client's side of :func:`build_infer_response`).

    :param bytes_outputs: the outputs that are ``bytes`` tensors: their BYTES come as the bytes sent.

    :raises ProtocolError: for every fault in the body, naming the tensor.
    """
    header, binary, known = split_body(body, json_length, "response")
    specs = None if output_spec is None else {s.name: s for s in output_spec}
    decoded = InferResponse(
        outputs=_decode_tensors(header, "outputs", binary, specs, required=False, known=known, exact=bytes_outputs),
        model_name=optional_str(header, "model_name"),
        model_version=optional_str(header, "model_version"),
        id=optional_str(header, "id"),
        parameters=dict(parameters_of(header, "response")),
    )
    remember(known)
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
    return build_body(header, "inputs", inputs, set(inputs) if binary else set())


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
    return build_body(header, "outputs", outputs, names, _response_head(model_name, model_version) if id is None else None)


@functools.lru_cache(maxsize=256)
def _response_head(model_name: str, model_version: str | None) -> str:
    """The JSON of a response header without an id, written once per model and version."""
    header = {"model_name": model_name}
    if model_version is not None:
        header["model_version"] = model_version
    return ENCODER.encode(header)


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
    text = ENCODER.encode(header).encode("utf-8")
    return Body(b"".join([text, *raws]), len(text)) if raws else Body(text, None)



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
    known: KnownHeader | None = None,
    shared: dict[str, Any] | None = None,
    exact: Collection[str] = (),
) -> dict[str, np.ndarray[Any, Any]]:
    """The tensors of ``header[key]`` as arrays (binary ones views of ``binary``).

    :param shared: where inputs in shared memory go (as
        :class:`~neuropod_serving.protocol.shm_params.SharedTensor`); when None, the
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
        entries = json_list(header.get(key), f"{kind}s")
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
                target = JSON_TARGETS.get(datatype)
                if (
                    target is not None and (params is None or (type(params) is dict and not params))
                    and (not shared or name not in shared) and len(shape) <= MAX_DIMS
                ):  # fmt: skip
                    spec = specs.get(name) if specs is not None else None
                    count = plain_count(shape) if specs is None or (spec is not None and spec.dtype == target[2]) else 0
                    if count:
                        try:
                            parsed = np.array(obj["data"])
                        except (ValueError, TypeError, OverflowError, RecursionError):
                            parsed = None
                        if (
                            parsed is not None and parsed.size == count and parsed.dtype.kind in target[1]
                            and (target[1] != "iu" or in_range(parsed, target[0]))
                            and (parsed.dtype.kind == "b" or not bool_among(parsed, obj["data"]))
                        ):  # fmt: skip
                            arrays[name] = parsed.astype(target[0], copy=False).reshape(shape)
                            fast = None  # a JSON tensor: the header is not planned
                            continue
            elif type(params) is dict:
                spec = specs.get(name) if specs is not None else None
                wire = FAST_DECODE.get(datatype)
                size = params.get("binary_data_size")
                if (
                    wire is not None and type(size) is int and len(params) == 1 and (specs is None or spec is not None)
                    and (spec is None or spec.dtype == DATATYPES[datatype])
                    and 0 <= size <= available - pos and len(shape) <= MAX_DIMS and plain_dims(shape)
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
            raise ProtocolError(f"{where} must be an object with name, datatype, shape and data, not {kind_of(obj)}")
        name = tensor_name(obj, where)
        if name in arrays or (shared and name in shared):
            raise ProtocolError(f"{kind} {name!r} appears twice; each {kind} is sent once")
        spec = None
        if specs is not None:
            if name not in specs:
                raise ProtocolError(
                    f"{kind} {name!r} is not one of this model's {kind}s: {', '.join(specs) or '(none)'}"
                )
            spec = specs[name]
        params = parameters_of(obj, f"{kind} {name!r}")
        if params and not KEYS.isdisjoint(params):
            if key != "inputs":
                raise ProtocolError(f"{kind} {name!r} was written to shared memory, which this client does not read")
            if shared is None:
                raise _InSharedMemory()
            carries = "'data'" if "data" in obj else "binary_data_size" if "binary_data_size" in params else None
            shared[name] = shared_input(name, obj.get("datatype"), obj.get("shape"), params, spec=spec, carries=carries)
            continue
        size = params.get("binary_data_size")
        raw = None
        if size is not None:
            if not is_int(size) or size < 0:
                raise ProtocolError(f"{kind} {name!r}: binary_data_size must be a byte count, not {show(size)}")
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
        arrays[name] = decode_tensor(obj, binary=raw, spec=spec, where=where, exact=name in exact)
    if pos != len(binary):
        raise ProtocolError(
            f"the body holds {len(binary)} bytes of binary data after its JSON, but the {kind}s' "
            f"binary_data_size add up to {pos}"
        )
    if fast is not None and known is not None:
        known.plans[key] = tuple(fast)
    return arrays


