"""Server-Sent Events as the streaming routes use them: one ``data:`` line of JSON per event.

The server writes each response as ``data: <JSON>`` and a blank line (``\\n\\n``), as Triton's
``generate_stream`` does; an error that ends a stream is one more event whose JSON is
``{"error": "<message>"}``, after which the stream ends. :class:`EventReader` is the client's
side: it takes the body in chunks as they arrive, split anywhere, and hands back each event's data
(the SSE rules: several ``data:`` lines of one event are joined by newlines, comment lines that
start with ``:`` and other fields are skipped, lines end with CRLF, LF or CR).
"""

from __future__ import annotations

import json
from typing import Any

#: The Content-Type of a stream of events (Triton's, for ``generate_stream``).
EVENT_STREAM = "text/event-stream; charset=utf-8"
#: The key of an error event's JSON object.
ERROR_KEY = "error"


def event(data: bytes) -> bytes:
    """One event carrying ``data`` (JSON without raw newlines: JSON escapes them in strings)."""
    return b"data: " + data + b"\n\n"


def error_event(message: str) -> bytes:
    """The event that ends a stream with ``message``: ``data: {"error": "<message>"}``."""
    return event(json.dumps({ERROR_KEY: message}, ensure_ascii=False).encode("utf-8"))


def event_error(doc: Any) -> str | None:
    """The message of an error event's parsed JSON (``{"error": ...}`` without ``outputs``), or None."""
    if isinstance(doc, dict) and ERROR_KEY in doc and "outputs" not in doc:
        message = doc[ERROR_KEY]
        return message if isinstance(message, str) else json.dumps(message)
    return None


class EventReader:
    """Splits a stream of Server-Sent Events, fed in chunks as they arrive, into the events' data.

    >>> reader = EventReader()
    >>> reader.feed(b'data: {"a": 1}\\n\\nda')
    ['{"a": 1}']
    >>> reader.feed(b'ta: 2\\n\\n')
    ['2']

    :param max_event_bytes: an event (or a line) longer than this raises ValueError, so a peer
        that never ends its event cannot fill the reader's memory.
    """

    def __init__(self, max_event_bytes: int = 256 * 2**20) -> None:
        self._max = max_event_bytes
        self._pending = b""  # an incomplete line
        self._data: list[bytes] = []  # the data lines of the event being read
        self._size = 0
        self._skip_lf = False  # the last chunk ended with CR: an LF first in the next ends that line

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event completed by ``chunk``, in order (decoded UTF-8)."""
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = chunk[-1:] == b"\r"
        text = self._pending + chunk if self._pending else chunk
        if b"\r" in text:
            text = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = text.split(b"\n")
        self._pending = lines.pop()
        if len(self._pending) > self._max:
            raise ValueError(f"a Server-Sent Events line is longer than {self._max:,} bytes")
        done: list[str] = []
        for line in lines:
            if not line:
                if self._data:
                    done.append(b"\n".join(self._data).decode("utf-8"))
                    self._data = []
                    self._size = 0
                continue
            if line.startswith(b"data"):
                if line == b"data":
                    value = b""
                elif line[4:5] == b":":
                    value = line[6:] if line[5:6] == b" " else line[5:]
                else:
                    continue  # another field whose name starts with "data"
                self._size += len(value) + 1
                if self._size > self._max:
                    raise ValueError(f"a Server-Sent Event is longer than {self._max:,} bytes")
                self._data.append(value)
            # Comments (":...") and the fields event, id and retry carry nothing these streams use.
        return done

    @property
    def incomplete(self) -> bool:
        """Whether an event was begun and not ended (a stream cut off in the middle of one)."""
        return bool(self._data or self._pending)


__all__ = ["ERROR_KEY", "EVENT_STREAM", "EventReader", "error_event", "event", "event_error"]
