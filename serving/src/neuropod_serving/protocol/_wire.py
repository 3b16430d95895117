"""Protobuf wire format, just enough to move big tensors without copying them.

protobuf's Python messages copy a ``bytes`` field when a message is built,
again when it is serialized, and again (twice) when one is parsed and the
field read. For the repeated ``raw_*_contents`` fields of the inference
messages, which hold the tensors, these two functions work on the wire form
directly: :func:`append_raw` writes the tensors after the rest of a message
with one copy (the join), and :func:`split_raw` finds them in a received
message and hands back views of it (no copy), leaving protobuf to parse only
the small rest. A message is a sequence of fields in any order, and repeated
fields keep their order, so both are plain protobuf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from neuropod_serving.errors import ProtocolError

#: Messages with at least this many bytes of tensors take the wire path;
#: smaller ones are cheaper through protobuf's C parser (the wire walk is
#: Python, per field) and their copies cost nothing worth saving.
WIRE_THRESHOLD = 64 * 1024

_WIRE_LENGTH_DELIMITED = 2


def _varint(data: bytes | memoryview, pos: int, end: int, what: str = "gRPC message") -> tuple[int, int]:
    result = 0
    shift = 0
    while pos < end:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            break
    raise ProtocolError(f"the {what} is malformed: a varint is truncated or longer than 10 bytes")


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def append_raw(head: bytes, field: int, raws: Sequence[Any]) -> bytes:
    """``head`` (a serialized message without ``field``) with each of ``raws``
    (bytes-like, C-contiguous) appended as one more ``field`` entry, in order.
    The only copy of the tensors is the join."""
    key = encode_varint((field << 3) | _WIRE_LENGTH_DELIMITED)
    parts: list[Any] = [head]
    for raw in raws:
        parts.append(key + encode_varint(memoryview(raw).nbytes))
        parts.append(raw)
    return b"".join(parts)


def split_raw(data: bytes, field: int) -> tuple[bytes, list[memoryview]]:
    """Split a serialized message into its other fields (serialized, for
    protobuf to parse) and views of each ``field`` entry (length-delimited), in order.

    :raises ProtocolError: the bytes are not a well-formed message.
    """
    view = memoryview(data)
    end = len(data)
    pos = 0
    raws: list[memoryview] = []
    rest: list[memoryview] = []
    kept_from = 0
    while pos < end:
        start = pos
        key, pos = _varint(data, pos, end)
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos, end)
            continue
        if wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == _WIRE_LENGTH_DELIMITED:
            length, pos = _varint(data, pos, end)
            if key >> 3 == field:
                if pos + length > end:
                    break
                if kept_from < start:
                    rest.append(view[kept_from:start])
                raws.append(view[pos : pos + length])
                pos += length
                kept_from = pos
                continue
            pos += length
        else:
            raise ProtocolError(f"the gRPC message is malformed: wire type {wire_type} at byte {start}")
        if pos > end:
            break
    if pos != end:
        raise ProtocolError("the gRPC message is malformed: a field runs past its end")
    if not raws:
        return data, raws
    if kept_from < end:
        rest.append(view[kept_from:end])
    return b"".join(rest), raws


def wire_fields(data: bytes, what: str) -> dict[int, bytes | int]:
    """A protobuf message's fields on the wire form: field number -> its last value (the bytes of
    a length-delimited field, the value of a varint; fixed-width fields skipped).

    :raises ProtocolError: the bytes are not a message (``what`` names it).
    """
    fields: dict[int, bytes | int] = {}
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos, end, what)
        field, wire = key >> 3, key & 7
        if wire == _WIRE_LENGTH_DELIMITED:
            size, pos = _varint(data, pos, end, what)
            if pos + size > end:
                raise ProtocolError(f"a {what} ends inside one of its fields")
            fields[field] = bytes(data[pos : pos + size])
            pos += size
        elif wire == 0:
            fields[field], pos = _varint(data, pos, end, what)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ProtocolError(f"a {what} holds a field of wire type {wire}")
    if pos > end:
        raise ProtocolError(f"a {what} ends inside one of its fields")
    return fields


__all__ = ["WIRE_THRESHOLD", "append_raw", "encode_varint", "split_raw", "wire_fields"]
