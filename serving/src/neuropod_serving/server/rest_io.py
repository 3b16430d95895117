"""What every REST route shares on bare ASGI: reading a bounded request body, and answering
with JSON or with the error a failure maps to (the statuses of :func:`failure`)."""

from __future__ import annotations

import json
import logging
from typing import NamedTuple

from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from neuropod.errors import NeuropodError, SequenceError, SequenceLimitError, SpecError
from neuropod.sequences import StateMismatchError
from neuropod_serving.errors import ModelBusyError, ProtocolError, RequestTimeoutError, UnknownModelError
from neuropod_serving.protocol import HEADER_LENGTH
from neuropod_serving.server.compression import decoded_body

log = logging.getLogger("neuropod_serving.server")

#: Bodies up to this size are decoded and encoded on the event loop: a thread
#: hop costs more than parsing them. Larger ones go to a worker thread.
INLINE_BODY_BYTES = 64 * 1024
#: Where a streaming response leaves, in its request's scope, the callable that ends it when the
#: server stops (sse.py sets it; :class:`~neuropod_serving.server.http.OneWriteProtocol` calls it
#: as uvicorn's graceful shutdown begins).
ON_SHUTDOWN = "neuropod.on_shutdown"
# ASGI servers hand header names over lower-cased.
HEADER_LENGTH_KEY = HEADER_LENGTH.lower().encode("ascii")


class TooLarge(Exception):
    """A request body over the server's limit (413)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Disconnected(Exception):
    """The client went away before its request body was complete."""


def failure(exc: BaseException, model: str) -> tuple[int, str] | None:
    """The status and message a REST client gets for ``exc``; None when it is no
    NeuropodError (a bug: the caller answers a bare 500)."""
    if isinstance(exc, ProtocolError):
        return exc.status, str(exc)
    if isinstance(exc, TooLarge):
        return 413, exc.message
    if isinstance(exc, UnknownModelError):
        return 404, str(exc)
    if isinstance(exc, ModelBusyError):
        return 429, str(exc)
    if isinstance(exc, RequestTimeoutError):
        return 503, str(exc)  # as Triton answers a request whose timeout expired in its queue
    if isinstance(exc, SequenceLimitError):
        return 429, str(exc)  # too many live sequences: at once, as Triton's sequence batcher refuses one
    if isinstance(exc, SequenceError):
        return 400, str(exc)  # a sequence the request cannot run (not live, wrong id kind, none named)
    if isinstance(exc, SpecError) and not isinstance(exc, StateMismatchError):
        return 400, str(exc)
    if isinstance(exc, NeuropodError):
        # The model failed, not the request: log it with its cause for the
        # operator, answer 500 naming the model, and keep serving the others.
        log.error("model %r failed: %s", model, exc, exc_info=exc)
        return 500, f"model {model!r} failed: {exc}"
    return None


def answer_to(exc: BaseException, model: str) -> tuple[int, str]:
    """:func:`failure`, with a bug (no NeuropodError) logged and answered 500 naming the model."""
    answer = failure(exc, model)
    if answer is None:
        log.error("request to model %r failed", model, exc_info=exc)
        answer = (500, f"internal error while serving model {model!r}: {type(exc).__name__}")
    return answer


async def send_body(
    send: Send, status: int, content: bytes, json_length: int | None, encoding: bytes | None = None
) -> None:
    """A whole response: JSON, or a binary body with its JSON's length in its header."""
    if json_length is None:
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(content))]
    else:
        headers = [
            (b"content-type", b"application/octet-stream"),
            (b"content-length", b"%d" % len(content)),
            (HEADER_LENGTH_KEY, b"%d" % json_length),
        ]
    if encoding is not None:
        # The binary header's length counts the uncompressed body, as Triton's does.
        headers.append((b"content-encoding", encoding))
        headers.append((b"vary", b"accept-encoding"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


async def send_error(send: Send, status: int, message: str) -> None:
    """The protocol's error answer: ``{"error": message}`` with ``status``."""
    await send_body(send, status, json.dumps({"error": message}).encode(), None)


def check_declared(declared: str | None, limit: int) -> None:
    """Refuse a Content-Length that is no byte count (400) or over ``limit`` (413)."""
    if declared is None:
        return
    # isascii too: str.isdigit() accepts '²', which int() refuses (a 500, not a 400).
    if not (declared.strip().isascii() and declared.strip().isdigit()):
        raise ProtocolError(f"Content-Length must be a byte count, not {declared!r}")
    if int(declared) > limit:
        raise TooLarge(
            f"the request body is {int(declared):,} bytes, more than this server's limit of {limit:,} "
            "(neuropod serve --max-request-bytes)"
        )


def add_chunk(chunks: list[bytes], size: int, chunk: bytes, limit: int) -> int:
    """``chunk`` appended to ``chunks``; the new size. :raises TooLarge: past ``limit``."""
    size += len(chunk)
    if size > limit:
        raise TooLarge(
            f"the request body passed this server's limit of {limit:,} bytes while streaming "
            "(neuropod serve --max-request-bytes)"
        )
    chunks.append(chunk)
    return size


async def receive_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The whole body of a bare ASGI request, refused with 413 before it passes ``limit`` bytes.

    :raises Disconnected: the client went away first.
    """
    check_declared(declared, limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected()
        size = add_chunk(chunks, size, message.get("body", b""), limit)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class RequestHead(NamedTuple):
    """What the bare ASGI routes read of a request's headers (each as sent, None when absent)."""

    #: Content-Length.
    declared: str | None
    #: Inference-Header-Content-Length: the body is that many bytes of JSON, then binary tensors.
    header_length: str | None
    #: Content-Encoding.
    encoding: bytes | None
    #: Accept-Encoding.
    accept: bytes | None


def request_head(scope: Scope) -> RequestHead:
    """The headers of a bare ASGI request that say how to read its body and answer it."""
    declared = header_length = encoding = accept = None
    for key, value in scope["headers"]:
        if key == b"content-length":
            declared = value.decode("latin-1")
        elif key == HEADER_LENGTH_KEY:
            header_length = value.decode("latin-1")
        elif key == b"content-encoding":
            encoding = value
        elif key == b"accept-encoding":
            accept = value
    return RequestHead(declared, header_length, encoding, accept)


async def request_body(receive: Receive, head: RequestHead, limit: int) -> bytes | bytearray:
    """The whole body of a bare ASGI request, inflated when it came compressed; 413 past ``limit``
    bytes, sent or inflated.

    :raises Disconnected: the client went away first.
    """
    body: bytes | bytearray = await receive_body(receive, head.declared, limit)
    if head.encoding is not None:
        body = await inflated(body, head.encoding, limit)
    return body


async def inflated(body: bytes | bytearray, encoding: bytes, limit: int) -> bytes | bytearray:
    """``body`` as sent with Content-Encoding ``encoding``, inflated within ``limit`` (413 past it)."""
    # Bounded by the same limit once decompressed (compression.py): a zip bomb is a 413.
    # 1 KiB inflates to about 1 MB at most (deflate stops near 1032:1): fine on the loop.
    if len(body) <= INLINE_BODY_BYTES // 64:
        return decoded_body(body, encoding, limit)
    return await run_in_threadpool(decoded_body, body, encoding, limit)


__all__ = [
    "HEADER_LENGTH_KEY",
    "INLINE_BODY_BYTES",
    "ON_SHUTDOWN",
    "Disconnected",
    "RequestHead",
    "TooLarge",
    "add_chunk",
    "answer_to",
    "check_declared",
    "inflated",
    "failure",
    "receive_body",
    "request_body",
    "request_head",
    "send_body",
    "send_error",
]
