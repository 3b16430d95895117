"""Reading JSON that comes from outside the process: bounded before it is parsed.

Configs, manifests, environment records and host files are small documents
with a handful of nesting levels. A file that is megabytes deep would make
``json.loads`` recurse until a ``RecursionError`` (and, near the limit, leave
too little stack for the code that handles it), so its depth and size are
checked with a flat scan first, and every failure is a ``ValueError`` with a
one-line reason that callers wrap in their own error.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

#: Deeper than any document the project writes or reads (a config is 4 levels).
MAX_DEPTH = 64
#: Larger than any config, manifest or record; a manifest of 100k files is ~10 MB.
MAX_BYTES = 64 * 2**20

# A JSON string, so that brackets inside strings are not counted (written as
# an unrolled loop: three times faster than an alternation per character).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_AS_PARENS = str.maketrans("[{]}", "(())")
# Deletes every ASCII character but quotes and brackets (others are left: see below).
_QUOTES_AND_BRACKETS = {c: None for c in range(128) if chr(c) not in '"[]{}'}


def check_bounds(text: str, *, max_depth: int = MAX_DEPTH, max_bytes: int = MAX_BYTES) -> None:
    """Raise ``ValueError`` when ``text`` is larger or nests deeper than the bounds."""
    if len(text) > max_bytes:
        raise ValueError(f"it is {len(text):,} characters long, more than the {max_bytes:,} allowed")
    if len(text) >= _LONG and text.isascii():
        # A long ASCII document (a request body of numbers): its quotes and brackets, picked
        # out by one bytes.translate (a C loop, 5x faster than str.translate's dict), and
        # when no string holds an escape, the depth from them with numpy.
        marks = text.encode("ascii").translate(None, _NOT_MARKS)
        if marks.count(b"[") + marks.count(b"{") <= max_depth:
            return
        if b"\\" not in marks and len(marks) <= _SLICE:
            if _marks_depth(marks) > max_depth:
                raise ValueError(f"it nests more than {max_depth} levels deep")
            return
    elif text.count("[") + text.count("{") <= max_depth:
        return  # the common case (a manifest opens two objects): no scan needed
    # The brackets alone, as bytes of "(" and ")": the depth after each is a running sum,
    # taken by numpy in slices (each pass of a C loop, never a Python step per bracket), so
    # a document megabytes deep costs a flat scan, not one pass per level.
    brackets = _brackets(text).translate(_AS_PARENS).encode("ascii")
    depth = 0
    for start in range(0, len(brackets), _SLICE):
        steps = 81 - 2 * np.frombuffer(brackets, np.uint8, min(_SLICE, len(brackets) - start), start).astype(np.int32)
        levels = np.cumsum(steps, dtype=np.int64)
        if depth + int(levels.max(initial=0)) > max_depth:
            raise ValueError(f"it nests more than {max_depth} levels deep")
        depth += int(levels[-1]) if len(levels) else 0


#: Brackets summed per numpy pass in :func:`check_bounds` (bounds its scratch memory).
_SLICE = 1 << 20
#: ASCII texts from this long on are screened by :func:`_marks_depth`'s way; shorter ones by counting brackets.
_LONG = 4096
# Every byte but quotes, brackets and backslashes (deleted by bytes.translate).
_NOT_MARKS = bytes(c for c in range(256) if c not in b'"[]{}\\')
# +1 for an opening bracket, -1 for a closing one, 0 for the rest (a quote), by byte.
_STEPS = np.zeros(256, np.int64)
_STEPS[[ord("["), ord("{")]] = 1
_STEPS[[ord("]"), ord("}")]] = -1


def _marks_depth(marks: bytes) -> int:
    """The deepest nesting of the quotes and brackets ``marks`` (those of a document without
    escapes, in order): strings run from each odd quote to the next, and their brackets do not count."""
    codes = np.frombuffer(marks, np.uint8)
    quotes = codes == ord('"')
    outside = (np.cumsum(quotes) & 1) == 0  # a closing quote itself is outside, and steps 0
    levels = np.cumsum(np.where(outside, _STEPS[codes], 0))
    return int(levels.max(initial=0))


def loads(text: str, *, max_depth: int = MAX_DEPTH, max_bytes: int = MAX_BYTES) -> Any:
    """``json.loads`` for untrusted text, after checking its depth and size.

    :raises ValueError: too deep, too large, or not JSON (``json.JSONDecodeError``
        is a ``ValueError`` and keeps its line and column).
    """
    check_bounds(text, max_depth=max_depth, max_bytes=max_bytes)
    try:
        return json.loads(text)
    except RecursionError:  # cannot happen within the bounds; kept as a last guard
        raise ValueError(f"it nests more than {max_depth} levels deep") from None


def _brackets(text: str) -> str:
    """The brackets of ``text`` that lie outside JSON strings, in order."""
    if "\\" not in text:
        # No escapes, so no string holds a quote: strings run from each odd
        # quote to the next, and dropping every other piece between quotes
        # drops them (5x faster than the string regex on a request header).
        outside = "".join(text.translate(_QUOTES_AND_BRACKETS).split('"')[::2])
        if outside.isascii():  # else something non-ASCII outside strings: not JSON, scanned the long way
            return outside
    return _NOT_BRACKET.sub("", _STRING.sub("", text))


__all__ = ["MAX_BYTES", "MAX_DEPTH", "check_bounds", "loads"]
