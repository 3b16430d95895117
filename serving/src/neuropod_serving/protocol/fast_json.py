"""Plain JSON request bodies read the quick way: orjson first, the checks after.

Used by :func:`~neuropod_serving.protocol.inference.parse_infer_request` for long
plain JSON bodies; it gives the very answer of the checked way, or None (and the
body is read again the checked way).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from neuropod import _json
from neuropod.spec import TensorSpec
from neuropod_serving.protocol.bodies import orjson_module
from neuropod_serving.protocol.datatypes import JSON_TARGETS
from neuropod_serving.protocol.shapes import MAX_DIMS, plain_count
from neuropod_serving.protocol.tensors import bool_among, bools_among, in_range


class _Recheck(Exception):
    """A plain JSON request read before its bounds were checked (:func:`unchecked_request`) holds
    something other than the common case: it is read again the checked way."""



def unchecked_request(
    body: bytes | bytearray | memoryview, specs: Mapping[str, TensorSpec] | None
) -> tuple[dict[str, Any], dict[str, np.ndarray[Any, Any]]] | None:
    """A plain JSON request's header and inputs read the quick way, or None where that way does not
    give the very answer of the checked one (:func:`split_body` and ``inference._decode_tensors``).

    The checked way scans the text for its depth and for integers of 19 digits or more before
    parsing it (about a third of the time of parsing a body of numbers). Here orjson reads the
    body first (it refuses documents over 1,024 levels deep, infinities and bad UTF-8 by itself),
    and what it gave is checked instead, where that is cheap: every input numeric, flat enough
    and without parameters (``inference._decode_tensors`` with ``unchecked``), every other value of the
    request no deeper than the bound, and no number that may be an integer past 64 bits (which
    orjson reads as a float, and the checked way refuses or keeps exact). Anything else is read
    again the checked way, which words what is wrong: a request costs one parse more, never a
    different answer.
    """
    orjson = orjson_module()
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
    """The inputs of a request read by :func:`unchecked_request`, when every one is what
    ``inference._decode_tensors`` takes its JSON fast path for (and gives the same array for): a
    name, a numeric datatype the spec agrees with, a shape of plain dims, numbers as ``data``
    (at most :data:`MAX_DIMS` levels), no other key and no parameters. Else :class:`_Recheck`.
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
        target = JSON_TARGETS.get(obj.get("datatype"))
        if type(name) is not str or not name or name in names or target is None or type(shape) is not list:
            raise _Recheck()
        if specs is not None:
            spec = specs.get(name)
            if spec is None or spec.dtype != target[2]:
                raise _Recheck()
        count = plain_count(shape) if len(shape) <= MAX_DIMS else 0
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
        if parsed.size != count or kind not in target[1] or parsed.ndim > MAX_DIMS:
            raise _Recheck()
        if kind == "f":
            floats.append(parsed)
        elif target[1] == "iu" and not in_range(parsed, target[0]):
            raise _Recheck()
        if kind != "b":
            numeric.append((parsed, data))
        arrays[name] = parsed.astype(target[0], copy=False).reshape(shape)
    if bools_among(numeric):
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
    if bool_among(parsed, numbers):  # a true or false among the numbers: the per-tensor way says which
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

