"""Bounds of a tensor's shape: how many dims and elements the protocol and numpy take."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol.fields import is_int, show

#: numpy 1.x allows 32 dims (2.x allows 64); the lower bound keeps both working.
MAX_DIMS = 32
#: An element count must fit the int64 every OIP implementation stores it in.
MAX_ELEMENTS = 2**63 - 1
#: The product of a shape's dims, its zeros counted as 1, that numpy can make an array of
#: (of any dtype: it checks that product times the item size, even for an empty array).
MAX_SPAN = 2**63 // 16


def plain_dims(shape: list[Any]) -> bool:
    """Whether every dim is an int >= 0 (not a bool, float or -1) and numpy can make an array of the shape."""
    span = 1
    for d in shape:  # a plain loop: all() over a generator costs more per request
        if type(d) is not int or d < 0:
            return False
        span *= d or 1
    return span <= MAX_SPAN


def plain_count(shape: list[Any]) -> int:
    """The element count of ``shape`` when every dim is an int >= 0 (not a bool, float or -1) and
    numpy can make an array of it (:func:`plain_dims`), else 0."""
    count = span = 1
    for d in shape:
        if type(d) is not int or d < 0:
            return 0
        count *= d
        span *= d or 1
    return count if span <= MAX_SPAN else 0


def spannable(shape: Sequence[int]) -> bool:
    """Whether numpy can make an array of ``shape`` (dims >= 0), however few elements it holds."""
    span = 1
    for d in shape:
        span *= d or 1
    return span <= MAX_SPAN


def checked_shape(shape: object, name: str) -> list[int]:
    """A tensor's ``shape`` as sent: a list of at most :data:`MAX_DIMS` dims >= 0 that numpy can make an array of."""
    if not isinstance(shape, list):
        raise ProtocolError(f"tensor {name!r}: 'shape' must be a list of sizes, not {show(shape)}")
    for i, dim in enumerate(shape):
        if not is_int(dim) or dim < 0:
            raise ProtocolError(f"tensor {name!r}: shape[{i}] is {show(dim)}; a dim is an integer >= 0")
    if len(shape) > MAX_DIMS:
        raise ProtocolError(f"tensor {name!r}: shape has {len(shape)} dims, more than the {MAX_DIMS} supported")
    if not spannable(shape):
        count = math.prod(shape)
        if count > MAX_ELEMENTS:
            raise ProtocolError(f"tensor {name!r}: shape {shape} has {count} elements, more than an int64 can count")
        raise ProtocolError(
            f"tensor {name!r}: shape {shape} is larger than any array can be (the product of its dims, "
            f"zeros counted as 1, passes {MAX_SPAN:,}), even when it holds no elements"
        )
    return shape


