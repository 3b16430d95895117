"""Request and response bodies: plain JSON, or Triton's binary tensor data extension.

A binary body is a JSON header of ``Inference-Header-Content-Length`` bytes
followed by the raw tensors. This module splits a body into its header (parsed,
and remembered by its bytes once it decodes cleanly) and its binary part, and
joins encoded tensors into a body.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from neuropod import _json
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol._forms import MAX_FORM_BYTES, FormCache
from neuropod_serving.protocol.datatypes import WIRE_DTYPES
from neuropod_serving.protocol.fields import kind_of, show
from neuropod_serving.protocol.tensors import encode_tensor

#: The HTTP header that says how long the JSON part of a binary body is.
HEADER_LENGTH = "Inference-Header-Content-Length"

# Numpy dtypes whose bytes are already their wire form (little-endian), by dtype.
_FAST_ENCODE: dict[np.dtype[Any], str] = {w: d for d, w in WIRE_DTYPES.items()}
# One encoder for every body: json.dumps with options builds a new one per call.
# allow_nan: NaN and Infinity are what Triton's and Python's JSON write for them.
ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_encode_str = json.encoder.encode_basestring


class Body(NamedTuple):
    """An encoded request or response body.

    ``json_length`` is None for a plain JSON body (``Content-Type:
    application/json``); otherwise the body holds binary tensors and
    ``json_length`` goes in the ``Inference-Header-Content-Length`` header.
    """

    content: bytes
    json_length: int | None



class KnownHeader:
    """The JSON header of a binary body, parsed, and once a decode of it took the fast path for
    every tensor, each tensor's name, datatype, wire dtype, shape and size (``plans``, by key)."""

    __slots__ = ("doc", "key", "plans")

    def __init__(self, doc: dict[str, Any], key: bytes | None) -> None:
        self.doc = doc
        #: The header's bytes until it is remembered (:func:`remember`), then None.
        self.key = key
        self.plans: dict[str, tuple[tuple[str, str, np.dtype[Any], tuple[int, ...], int], ...]] = {}


#: Headers of binary bodies remembered by their bytes, within a budget of bytes
#: (:class:`~neuropod_serving.protocol._forms.FormCache`), once a body with the header
#: decoded cleanly. A binary body's header depends only on the tensors' names, datatypes and
#: shapes, not their values, so a client sending the same form of request again costs no JSON
#: parse and no per-tensor checks beyond the spec's datatypes.
_KNOWN: FormCache[bytes, KnownHeader] = FormCache()


def remember(known: KnownHeader | None) -> None:
    """Keep a header that has just decoded cleanly for the next body of its form."""
    if known is not None and known.key is not None:
        _KNOWN.put(known.key, known, len(known.key))
        known.key = None


def split_body(
    body: bytes | bytearray | memoryview, json_length: int | str | None, what: str
) -> tuple[dict[str, Any], memoryview, KnownHeader | None]:
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
        raise ProtocolError(f"the {what} must be a JSON object, not {kind_of(header)}")
    if key is None:
        return header, view[length:], None
    # Remembered only once a body decodes cleanly with it: refused ones cost nothing after their answer.
    return header, view[length:], KnownHeader(header, key)


def _loads(raw: memoryview, text: str) -> Any:
    """The JSON ``text`` (whose bounds were checked), by orjson when it takes it: about 5x
    Python's json on a body of numbers (100 tensors of [10, 5]: 2.0 -> 0.4 ms)."""
    orjson = orjson_module()
    if orjson is not None and not (_long_integer(raw) if len(text) >= LONG_TEXT else _long_integer_short(bytes(raw))):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            # NaN/Infinity, integers past 64 bits, lone surrogates: Python's json
            # reads them (as before), or words the error.
            pass
    return _json.loads(text)




# A run of 19 digits or more can be an integer past 64 bits, which orjson reads
# as a float (rounded): such documents go to Python's json, which keeps it exact.
_RUN = 19
# In _long_integer's marks: a digit is 2, a '.' 0 and any other byte 1.
_RUN_START = b"\x01" + b"\x02" * _RUN
_DOT = ord(".")


# Texts from this long on are screened by numpy (_long_integer), shorter ones by bytes methods
# (_long_integer_short), which cost less than numpy's calls on a small body.
LONG_TEXT = 4096
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
def orjson_module() -> Any:
    """orjson (a dependency of neuropod-serving, imported on first use), or None without it."""
    try:
        import orjson
    except ImportError:
        return None
    return orjson


def _header_length(value: int | str, body_size: int) -> int:
    text = str(value).strip()
    if not text.isascii() or not text.isdigit():
        raise ProtocolError(f"{HEADER_LENGTH} must be a byte count, not {show(value)}")
    length = int(text)
    if length > body_size:
        raise ProtocolError(f"{HEADER_LENGTH} is {length}, but the whole body is only {body_size} bytes")
    return length



#: JSON headers of binary bodies built, by (header, key, tensor names, dtypes, shapes), within a budget of bytes.
_BUILT: FormCache[Any, bytes] = FormCache()


def build_body(
    header: dict[str, Any], key: str, tensors: Mapping[str, np.ndarray[Any, Any]], binary: set[str],
    head: str | None = None,
) -> Body:  # fmt: skip
    """The body of ``header`` with ``tensors`` under ``key`` (``binary``: those sent as binary
    data); ``head``: the JSON of ``header``, when the caller has it."""
    if head is None:
        head = ENCODER.encode(header)
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
    orjson = orjson_module()
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
        parts.append(ENCODER.encode(obj))
        if raw is not None:
            raws.append(raw)
    tensor_list = f'"{key}":[{",".join(parts)}]}}'
    text = (head[:-1] + ("," if len(head) > 2 else "") + tensor_list).encode("utf-8")
    if not raws:
        return Body(text, None)
    if form is not None:
        _BUILT.put(form, text, len(text) + len(form[0]))
    return Body(b"".join([text, *raws]), len(text))


