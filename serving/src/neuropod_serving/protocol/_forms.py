"""Parsed forms of messages, remembered within a budget of bytes.

The codecs parse the metadata part of a message (a binary body's JSON header, a
gRPC message without its raw contents) once per distinct form and reuse it for
the next message of the same form. What a client sends decides the forms, so
the memory they take is bounded in bytes, not in entries: a few huge forms
(a 16 MiB request ``id``) must not be kept where a few hundred small ones are.
"""

from __future__ import annotations

from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

#: Bytes all remembered forms of one cache may cost, estimated by :meth:`FormCache.put`'s caller.
BUDGET = 8 * 2**20
#: A form larger than this is never remembered (it is parsed again each time). Real forms get
#: large: the binary header of a request of 100 small tensors is about 10 KiB, and parsing it
#: again costs more than the rest of the request.
MAX_FORM_BYTES = 64 * 1024
#: How many bytes of memory one byte of parsed JSON or protobuf can become, at most: measured,
#: ``[{},{},...]`` parses to about 24x its text, and a ModelInferRequest of empty tensors (two
#: bytes each on the wire) to about 45x its size.
PARSED_PER_BYTE = 64


class FormCache(Generic[K, V]):
    """A dict of parsed forms whose estimated cost stays under :data:`BUDGET` bytes;
    emptied when the next form would pass it (forms in use are few, and parsed again cheaply)."""

    __slots__ = ("_entries", "_used", "budget")

    def __init__(self, budget: int = BUDGET) -> None:
        self._entries: dict[K, V] = {}
        self._used = 0
        self.budget = budget

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def put(self, key: K, value: V, size: int) -> None:
        """Remember ``value`` under ``key``, which were parsed from ``size`` bytes; a form of more
        than :data:`MAX_FORM_BYTES` is not remembered."""
        if size > MAX_FORM_BYTES:
            return
        cost = size * PARSED_PER_BYTE + 512  # the entry's own objects
        if self._used + cost > self.budget:
            self._entries.clear()
            self._used = 0
        if key not in self._entries:
            self._used += cost
        self._entries[key] = value

    def clear(self) -> None:
        self._entries.clear()
        self._used = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __getitem__(self, key: K) -> V:
        return self._entries[key]


__all__ = ["BUDGET", "MAX_FORM_BYTES", "FormCache"]
