"""What the commands print: text escaped for the terminal, tables, arrays, and the exit statuses."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Sequence
from typing import Any, TextIO, cast

EXIT_ERROR = 2
EXIT_TEST_FAILED = 1

# What a terminal would act on instead of showing: C0/C1 controls, bidirectional-text
# controls (they reorder what follows, "Trojan Source"), line/paragraph separators, and
# lone surrogates (from undecodable bytes in argv or file names; no encoder takes them).
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Paths in OSError messages are shortened to this many characters.
_PATH_LIMIT = 200


def safe(text: object, keep: str = "") -> str:
    r"""``text`` as it can be printed: unsafe characters (see ``_UNSAFE``) become
    ``\xNN`` / ``\uNNNN`` escapes, except those in ``keep`` (e.g. ``"\n"`` for
    our own multi-line output)."""
    text = str(text)
    if text.isprintable():  # the common case; isprintable() is False for every unsafe character
        return text

    def escape(m: re.Match[str]) -> str:
        ch = m.group()
        if ch in keep:
            return ch
        if ch in _SHORT_ESCAPES:
            return _SHORT_ESCAPES[ch]
        return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"

    return _UNSAFE.sub(escape, text)


class SafeWriter(io.TextIOBase):
    """A text stream that cannot be made to fail or to drive the terminal by what is printed:
    unsafe characters are escaped (newlines and tabs kept), and characters the stream's
    encoding lacks are written as backslash escapes instead of raising ``UnicodeEncodeError``."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream

    def write(self, text: str) -> int:
        text = safe(text, keep="\n\t")
        try:
            self._stream.write(text)
        except UnicodeEncodeError:
            encoding = getattr(self._stream, "encoding", None) or "ascii"
            self._stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
        return len(text)

    def flush(self) -> None:
        # Also called when this wrapper is garbage-collected, perhaps after the stream it wraps was closed.
        if not getattr(self._stream, "closed", False):
            self._stream.flush()

    def writable(self) -> bool:
        return True


def safe_stream(stream: TextIO) -> TextIO:
    return stream if isinstance(stream, SafeWriter) else cast(TextIO, SafeWriter(stream))


def short(text: object, limit: int = _PATH_LIMIT) -> str:
    """A path or value for a message: safe, and at most ``limit`` characters (the middle elided)."""
    text = safe(text)
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-(limit // 2):]}"


def describe_os_error(e: OSError) -> str:
    """An ``OSError`` in one line, with its file names shortened (a 5000-character path stays readable)."""
    if e.strerror and e.filename is not None:
        files = f"'{short(_fs_text(e.filename))}'"
        if e.filename2 is not None:
            files += f" -> '{short(_fs_text(e.filename2))}'"
        return f"{e.strerror}: {files}"
    return one_line(str(e) or type(e).__name__)


def show(value: object, limit: int = 100) -> str:
    """A value quoted for a message (``repr`` escapes every unsafe character), at most ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fs_text(name: object) -> str:
    return os.fsdecode(name) if isinstance(name, (str, bytes)) else str(name)


def one_line(text: str) -> str:
    return " ".join(text.split())


def print_table(rows: Sequence[Sequence[str]], out: TextIO, indent: str = "  ") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)


def fmt_array(arr: Any, limit: int = 6) -> str:
    import numpy as np

    a = np.asarray(arr)
    body = np.array2string(a, threshold=limit * 2, edgeitems=limit // 2, separator=", ")
    body = " ".join(body.split())
    kind = a.dtype.name if a.dtype.kind not in "UO" else "string"
    if a.dtype.kind == "O" and a.size and isinstance(a.flat[0], bytes):
        kind = "bytes"
    return f"{kind} {list(a.shape)} {body}"
