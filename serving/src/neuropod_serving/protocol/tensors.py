"""One OIP tensor <-> one numpy array: its JSON ``data`` or its raw bytes (binary data).

Numeric arrays decoded from raw bytes are read-only views of those bytes (no
copy), so the bytes must stay alive as long as they do; Python's reference
counting sees to that.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from neuropod.spec import TensorSpec
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol.datatypes import (
    NATIVE_DTYPES,
    SPEC_DATATYPES,
    WIRE_DTYPES,
    datatype_of,
    oip_datatype,
    spec_dtype,
)
from neuropod_serving.protocol.fields import is_int, kind_of, tensor_name
from neuropod_serving.protocol.shapes import MAX_ELEMENTS, checked_shape

_LENGTH = struct.Struct("<I")


def encode_tensor(name: str, array: np.ndarray[Any, Any], *, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    """One tensor as an OIP JSON object, plus its raw bytes when ``binary``.

    Strings (unicode arrays, or object arrays of ``str``) are BYTES, UTF-8 encoded; object arrays of
    ``bytes`` are BYTES as they are. JSON carries text only: bytes that are not UTF-8 text are refused
    there, with the advice to ask for the tensor as binary data.
    """
    array = np.asarray(array)
    datatype = datatype_of(array, tensor=name)
    obj: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    if datatype == "BYTES":
        elements = _elements(array, name)
        if not binary:
            obj["data"] = elements if not elements or type(elements[0]) is str else _as_text(elements, name)
            return obj, None
        encoded = [e if type(e) is bytes else e.encode("utf-8") for e in elements]
        raw = b"".join(part for e in encoded for part in (_LENGTH.pack(len(e)), e))
    else:
        if not binary:
            obj["data"] = array.ravel().tolist()
            return obj, None
        raw = np.ascontiguousarray(array, dtype=WIRE_DTYPES[datatype]).tobytes()
    obj["parameters"] = {"binary_data_size": len(raw)}
    return obj, raw


def decode_tensor(
    obj: object,
    *,
    binary: memoryview | None = None,
    spec: TensorSpec | None = None,
    where: str = "tensor",
    size_name: str = "binary_data_size",
    exact: bool = False,
) -> np.ndarray[Any, Any]:
    """One OIP tensor object as a numpy array.

    :param binary: this tensor's own raw bytes, for an object with
        ``parameters.binary_data_size`` (whose size the caller has checked).
    :param spec: when given, the datatype must be this spec entry's dtype. A BYTES tensor of a
        ``bytes`` spec entry comes as an object array of the bytes sent (JSON strings UTF-8
        encoded); without a spec, or for ``string``, as an object array of str (UTF-8 text only).
    :param size_name: what errors call the size of ``binary`` (gRPC's raw
        contents are not a ``binary_data_size``).
    :param exact: BYTES as the bytes sent, as for a ``bytes`` spec entry (a client that knows
        the output is bytes, and decodes without a spec).
    """
    if not isinstance(obj, Mapping):
        raise ProtocolError(f"{where} must be an object with name, datatype, shape and data, not {kind_of(obj)}")
    name = tensor_name(obj, where)
    datatype = obj.get("datatype")
    spec_dtype(datatype, tensor=name)  # an unknown datatype is named as such
    if spec is not None and SPEC_DATATYPES.get(spec.dtype) != datatype:
        raise ProtocolError(
            f"tensor {name!r}: datatype {datatype} disagrees with the model's spec ({spec}), "
            f"which needs {oip_datatype(spec.dtype)}"
        )
    assert isinstance(datatype, str)
    shape = checked_shape(obj.get("shape"), name)
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise ProtocolError(f"tensor {name!r}: shape {shape} has {count} elements, more than an int64 can count")
    exact = exact or (spec is not None and spec.dtype == "bytes")
    if binary is not None:
        if datatype == "BYTES":
            return _bytes_from_binary(binary, shape, count, name, size_name, exact=exact)
        itemsize = WIRE_DTYPES[datatype].itemsize
        if len(binary) != count * itemsize:
            raise ProtocolError(
                f"tensor {name!r}: shape {shape} of {datatype} needs {count * itemsize} bytes "
                f"({count} x {itemsize}), but {size_name} is {len(binary)}"
            )
        array = np.frombuffer(binary, dtype=WIRE_DTYPES[datatype]).reshape(shape)
        if datatype == "BOOL" and count and array.view(np.uint8).max() > 1:
            raise ProtocolError(f"tensor {name!r}: BOOL bytes must be 0 or 1")
        return array
    if "data" not in obj:
        raise ProtocolError(f"tensor {name!r} has neither 'data' nor parameters.binary_data_size")
    if datatype == "BYTES":
        return _bytes_from_json(obj["data"], shape, count, name, raw=exact)
    return _numbers_from_json(obj["data"], datatype, shape, count, name)


def _numbers_from_json(data: object, datatype: str, shape: list[int], count: int, name: str) -> np.ndarray[Any, Any]:
    target = NATIVE_DTYPES[datatype]
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
    if kind not in wanted or (kind != "b" and bool_among(parsed, data)):
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


def in_range(parsed: np.ndarray[Any, Any], dtype: np.dtype[Any]) -> bool:
    """Whether the integers ``parsed`` all fit ``dtype`` (an integer dtype)."""
    if np.can_cast(parsed.dtype, dtype):
        return True
    info = np.iinfo(dtype)
    return not (parsed.min() < info.min or parsed.max() > info.max)


#: Up to this many numbers, :func:`bool_among` looks at their types one by one.
_FEW = 64


def bool_among(parsed: np.ndarray[Any, Any], data: object) -> bool:
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


def bools_among(read: list[tuple[np.ndarray[Any, Any], Any]]) -> bool:
    """:func:`bool_among` of each (array, data) pair of ``read``, the arrays looked at in one go."""
    if not read:
        return False
    flat = read[0][0].ravel() if len(read) == 1 else np.concatenate([parsed.ravel() for parsed, _ in read])
    at = np.flatnonzero((flat == 0) | (flat == 1))
    if not at.size:
        return False
    ends = np.cumsum([parsed.size for parsed, _ in read])
    return any(bool_among(*read[k]) for k in sorted(set(np.searchsorted(ends, at, side="right").tolist())))


def _big_ints(data: object, target: np.dtype[Any], datatype: str, shape: list[int], name: str) -> np.ndarray[Any, Any]:
    values = _flatten(data, name)
    if not all(is_int(v) for v in values):
        raise ProtocolError(f"tensor {name!r}: {datatype} data must be JSON integers; it holds other values")
    try:
        return np.array(values, dtype=target).reshape(shape)
    except OverflowError:
        info = np.iinfo(target)
        raise ProtocolError(f"tensor {name!r}: {datatype} data must lie in [{info.min}, {info.max}]") from None


def _bytes_from_json(data: object, shape: list[int], count: int, name: str, *, raw: bool = False) -> np.ndarray[Any, Any]:
    """JSON strings as an object array of str, or of their UTF-8 bytes for a bytes tensor (``raw``: then
    bytes elements, which gRPC's typed ``bytes_contents`` give, are taken as they are)."""
    texts = _flatten(data, name)
    if len(texts) != count:
        raise ProtocolError(f"tensor {name!r}: shape {shape} holds {count} elements, but 'data' has {len(texts)}")
    if raw and all(type(t) is bytes for t in texts):
        return _object_array(texts, shape)
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise ProtocolError(f"tensor {name!r}: BYTES data must be JSON strings; element {bad} is {kind_of(texts[bad])}")
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        # JSON can escape a lone surrogate (\ud800), which no UTF-8 text holds.
        raise ProtocolError(f"tensor {name!r}: BYTES data must be valid Unicode text (it holds a lone surrogate)") from None
    return _object_array([t.encode("utf-8") for t in texts] if raw else texts, shape)


def _bytes_from_binary(
    raw: memoryview, shape: list[int], count: int, name: str, size_name: str = "binary_data_size", *, exact: bool = False
) -> np.ndarray[Any, Any]:
    """Length-prefixed elements as an object array of str (UTF-8 text only), or of bytes as they are (``exact``)."""
    # Each element costs at least its 4-byte length, which bounds the loop by the body.
    if count * _LENGTH.size > len(raw):
        raise ProtocolError(
            f"tensor {name!r}: shape {shape} holds {count} BYTES elements, which need at least "
            f"{count * _LENGTH.size} bytes, but {size_name} is {len(raw)}"
        )
    texts: list[Any] = []
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
            texts.append(bytes(raw[pos : pos + size]) if exact else str(raw[pos : pos + size], "utf-8"))
        except UnicodeDecodeError as e:
            raise ProtocolError(f"tensor {name!r}: BYTES element {i} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        pos += size
    if pos != len(raw):
        raise ProtocolError(
            f"tensor {name!r}: {count} BYTES elements of shape {shape} fill {pos} bytes, "
            f"but {size_name} is {len(raw)}"
        )
    return _object_array(texts, shape)



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


def _object_array(texts: list[Any], shape: list[int]) -> np.ndarray[Any, Any]:
    # Object arrays, not numpy unicode: 'U' arrays drop trailing NUL characters.
    array = np.empty(len(texts), dtype=object)
    array[:] = texts
    return array.reshape(shape)


def _elements(array: np.ndarray[Any, Any], name: str) -> list[Any]:
    """A BYTES tensor's elements: all str (text), or all bytes (a bytes tensor)."""
    texts: list[Any] = array.ravel().tolist()
    if texts and type(texts[0]) is bytes:
        for i, t in enumerate(texts):
            if type(t) is not bytes:
                raise ProtocolError(f"tensor {name!r}: a BYTES tensor of bytes holds bytes, but element {i} is {kind_of(t)}")
        return texts
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ProtocolError(f"tensor {name!r}: a BYTES tensor holds str, but element {i} is {kind_of(t)}")
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError(f"tensor {name!r}: a string holds a lone surrogate, which UTF-8 cannot encode") from None
    return texts  # every element checked above to be a str


def _as_text(elements: list[bytes], name: str) -> list[str]:
    """A bytes tensor's elements as JSON strings: JSON holds text, so each must be UTF-8."""
    try:
        return [e.decode("utf-8") for e in elements]
    except UnicodeDecodeError as e:
        raise ProtocolError(
            f"tensor {name!r}: a BYTES element is not UTF-8 text ({e.reason} at byte {e.start}), which JSON cannot "
            "carry; send it as binary data (Triton's binary tensor extension: for an output, \"parameters\": "
            "{\"binary_data\": true} or binary_data_output; gRPC always carries bytes as they are)"
        ) from None



def _describe_kind(array: np.ndarray[Any, Any]) -> str:
    return {"b": "true/false", "i": "integers", "u": "integers", "f": "numbers with a fraction or exponent",
            "U": "strings"}.get(array.dtype.kind, "null, objects or out-of-range integers")  # fmt: skip


