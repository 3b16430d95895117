"""HTTP compression of REST inference bodies: ``Content-Encoding`` in, ``Accept-Encoding`` out.

What tritonclient.http sends with ``request_compression_algorithm`` and
``response_compression_algorithm``: ``gzip`` (RFC 1952) or ``deflate``, which
HTTP defines as the zlib format (RFC 1950; a raw deflate stream, which some
clients send instead, is read too). Request bodies are decompressed a piece at
a time under the same byte limit as uncompressed ones (``--max-request-bytes``),
so a small body that inflates to gigabytes is refused with 413 after at most
that many bytes, not after filling memory. Responses are compressed only when
the request asks and the body is at least :data:`COMPRESS_FROM` bytes (a
smaller one gains nothing), at zlib's fastest level: inference outputs are
mostly numbers, which compress little, and a slower level costs more time
than it saves on a network.

Only requests that carry these headers pay anything: the inference path
compares two more header names per header while it looks for the ones it
reads already.
"""

from __future__ import annotations

import zlib

from neuropod_serving.protocol import ProtocolError

#: Responses smaller than this are sent as they are, whatever the client accepts.
COMPRESS_FROM = 1024
#: zlib level of compressed responses: the fastest.
LEVEL = 1
#: The request encodings this server reads (``identity``: none).
ENCODINGS = ("gzip", "deflate", "identity")
_CHUNK = 1 << 20
_GZIP_WBITS = 16 + zlib.MAX_WBITS
_ZLIB_WBITS = zlib.MAX_WBITS
_RAW_WBITS = -zlib.MAX_WBITS


def decoded_body(body: bytes | bytearray, encoding: bytes, limit: int) -> bytes | bytearray:
    """``body`` decompressed as ``encoding`` (a ``Content-Encoding`` value) says.

    :raises ProtocolError: 415 for an encoding this server does not read, 413 when the
        decompressed body passes ``limit`` bytes, 400 when it is not valid data of its encoding.
    """
    name = encoding.decode("latin-1").strip().lower()
    if name == "identity" or not name:
        return body
    if name == "gzip" or name == "x-gzip":
        return _inflate(body, _GZIP_WBITS, "gzip", limit)
    if name == "deflate":
        try:
            return _inflate(body, _ZLIB_WBITS, "deflate", limit)
        except _NotThisFormat:
            return _inflate(body, _RAW_WBITS, "deflate", limit)
    raise ProtocolError(
        f"Content-Encoding {name!r} is not one this server reads; send the body as it is, or with "
        f"Content-Encoding {', '.join(e for e in ENCODINGS if e != 'identity')}",
        status=415,
    )


class _NotThisFormat(ProtocolError):
    """The data does not start like the format tried (deflate: zlib or raw)."""


def _inflate(body: bytes | bytearray, wbits: int, name: str, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits)
    pieces: list[bytes] = []
    size = 0
    data: bytes | memoryview = memoryview(body)
    try:
        while True:
            want = min(_CHUNK, limit - size + 1)
            piece = inflater.decompress(data, want)
            size += len(piece)
            if size > limit:
                raise ProtocolError(
                    f"the {name} request body decompresses to more than this server's limit of {limit:,} bytes "
                    "(neuropod serve --max-request-bytes)",
                    status=413,
                )
            pieces.append(piece)
            data = inflater.unconsumed_tail
            # Input used up and output not cut short: nothing is left inside zlib either.
            if inflater.eof or (not data and len(piece) < want):
                break
        if not inflater.eof:
            raise ProtocolError(f"the {name} request body ends before its compressed data does (truncated?)")
    except zlib.error as e:
        if wbits == _ZLIB_WBITS and size == 0:
            raise _NotThisFormat(str(e)) from None
        raise ProtocolError(f"the request body is not valid {name} data ({e})") from None
    if inflater.unused_data:
        raise ProtocolError(f"the {name} request body has {len(inflater.unused_data)} bytes after its compressed data")
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def chosen(accept: bytes) -> bytes | None:
    """The encoding to compress a response with for an ``Accept-Encoding`` value: ``b"gzip"``,
    ``b"deflate"``, or None (send it as it is). gzip first when both are accepted; ``q=0`` refuses one."""
    found: list[bytes] = []
    for item in accept.lower().split(b","):
        token, _, params = item.partition(b";")
        token = token.strip()
        if token in (b"gzip", b"deflate") and not _refused(params):
            found.append(token)
    if b"gzip" in found:
        return b"gzip"
    return b"deflate" if found else None


def _refused(params: bytes) -> bool:
    for param in params.split(b";"):
        key, _, value = param.partition(b"=")
        if key.strip() == b"q":
            try:
                return float(value.strip() or b"1") == 0
            except ValueError:
                return True
    return False


def compressed(content: bytes, encoding: bytes) -> bytes:
    """``content`` compressed as ``encoding`` (from :func:`chosen`)."""
    wbits = _GZIP_WBITS if encoding == b"gzip" else _ZLIB_WBITS
    packer = zlib.compressobj(LEVEL, zlib.DEFLATED, wbits)
    return packer.compress(content) + packer.flush()


__all__ = ["COMPRESS_FROM", "ENCODINGS", "chosen", "compressed", "decoded_body"]
