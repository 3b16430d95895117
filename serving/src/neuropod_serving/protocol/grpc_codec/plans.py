"""The wire form of inference messages, planned once per form of message.

A message's metadata part depends only on its tensors' names, datatypes and shapes: it is
serialized (:class:`Heads`) or parsed (:class:`Reader`) once per form, and each message then
only joins or slices its raw contents."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from neuropod.spec import TensorSpec
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol._forms import MAX_FORM_BYTES, FormCache
from neuropod_serving.protocol._wire import WIRE_THRESHOLD, append_raw, encode_varint, split_raw
from neuropod_serving.protocol.datatypes import FAST_DECODE, SPEC_DATATYPES
from neuropod_serving.protocol.grpc_codec.extensions import in_shared_memory, request_options_of
from neuropod_serving.protocol.grpc_codec.tensors import (
    FAST_ENCODE,
    RAW_INPUT_FIELD,
    RAW_OUTPUT_FIELD,
    encode_tensors,
    has_contents,
    parameters_from_proto,
)
from neuropod_serving.protocol.tensors import decode_tensor, encode_tensor

#: Distinct forms of message built per direction (the cache is emptied when full). Received
#: forms are kept within a budget of bytes instead (:class:`Reader`): clients choose them.
PLAN_LIMIT = 256
# The key of each raw contents entry (field number, length-delimited).
_TAGS = {f: encode_varint(f << 3 | 2) for f in (RAW_INPUT_FIELD, RAW_OUTPUT_FIELD)}


class Heads:
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
            tensors, raws = encode_tensors(arrays, kind, views=True)
            made = head(tensors)
            if form is not None:
                prefixes = tuple(
                    tag + encode_varint(memoryview(raw).nbytes) if FAST_ENCODE.get(a.dtype) is not None else None
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


class Plan:
    """One form of received message: the message without its raw contents, parsed, and
    once it has decoded cleanly, each tensor's name, datatype, wire dtype, shape and size."""

    __slots__ = ("_cache", "_key", "message", "options", "parameters", "requested", "tensors")

    def __init__(self, message: Any, key: bytes | None = None, cache: FormCache[bytes, Plan] | None = None) -> None:
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
        if any(has_contents(t) for t in entries) or in_shared_memory(self.message):
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
                if spec is None or SPEC_DATATYPES.get(spec.dtype) != datatype:
                    return None
            if wire is not None:
                if len(raw) != size:
                    return None
                arrays[name] = np.ndarray(shape, dtype=wire, buffer=raw)
            else:  # BOOL's 0/1 check, BYTES' reader
                arrays[name] = decode_tensor(obj, binary=raw, spec=spec, where=f"{kind} {name!r}",
                                             size_name=f"the size of raw_{kind}_contents")  # fmt: skip
        return arrays


class Reader:
    """Received messages split into raw contents (views) and the rest, whose parse is kept per
    form once a message of the form has decoded cleanly (refused ones are not kept)."""

    def __init__(self) -> None:
        self._plans: FormCache[bytes, Plan] = FormCache()

    def read(self, data: bytes, field: int, message_class: Any) -> tuple[Plan, list[Any]]:
        name = "raw_input_contents" if field == RAW_INPUT_FIELD else "raw_output_contents"
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
        if raws and field == RAW_INPUT_FIELD:
            raws = _writable_copy(raws)
        small = len(rest) <= MAX_FORM_BYTES
        plan = self._plans.get(rest) if small else None
        if plan is None:
            message = message if message is not None else _parse(message_class, rest)
            plan = Plan(message, bytes(rest), self._plans) if small else Plan(message)
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
