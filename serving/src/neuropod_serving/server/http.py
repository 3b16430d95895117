"""uvicorn's httptools protocol, writing each small response in one system call.

uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start``, then the body when it sends ``http.response.body``:
two ``send()`` calls, two TCP segments, for a reply of a few hundred bytes. On
loopback and on a fast network each costs several microseconds, a few percent
of a small model's whole request. :class:`OneWriteProtocol` holds the head
until the first body write and sends both together. Everything else (parsing,
keep-alive, pipelining, ``Expect: 100-continue``, flow control, errors) is
uvicorn's own code, unchanged.

It also bounds request heads, which uvicorn's httptools protocol does not: a
head (request line and headers) of more than ``max_head_bytes`` or with more
than ``max_headers`` headers gets ``431 Request Header Fields Too Large``, and
a head not complete within ``head_timeout_s`` of its first byte (or of the
connection, when nothing came) gets ``408 Request Timeout``, so connections that
send their heads a byte at a time cannot hold the server's memory or sockets.

When uvicorn's graceful shutdown begins, a response still streaming (Server-Sent
Events) is told at once, through the callable its app put in the request's scope
under :data:`ON_SHUTDOWN`, so it can end with a last error event.

Used by ``neuropod serve`` as ``uvicorn.Config(http=OneWriteProtocol.with_limits(...))``;
when uvicorn's httptools protocol is not there (no httptools) the server uses
uvicorn's default instead.
"""

from __future__ import annotations

import json
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from neuropod_serving.defaults import DEFAULT_HEAD_TIMEOUT_S, DEFAULT_MAX_HEAD_BYTES, DEFAULT_MAX_HEADERS
from neuropod_serving.server.rest_io import ON_SHUTDOWN

#: A head held for a body longer than this is written alone first (joining them would copy the body).
JOIN_BELOW = 64 * 1024


class _HeadHolder:
    """What one request's response cycle writes to: the connection's transport,
    except that the write of the response head is held until the next write."""

    __slots__ = ("_cycle", "_held", "_holding", "_transport")

    def __init__(self, transport: Any, cycle: Any) -> None:
        self._transport = transport
        self._cycle = cycle
        self._held: bytes | None = None
        self._holding = True  # until the head has gone by

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) < JOIN_BELOW:
                self._transport.write(held + data)
                return
            self._transport.write(held)
        elif self._holding and self._cycle.response_started:
            # The first write after http.response.start is the head (a
            # "100 Continue" goes out before the response starts, unheld).
            self._holding = False
            self._held = bytes(data)
            return
        self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._transport.write(held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


#: Seconds a connection refused with 431 stays open, dropping what its client still sends.
_LINGER_S = 1.0


class _HeadRefused(Exception):
    """Raised in a parser callback to stop parsing a head over the limits."""


class OneWriteProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose responses go out in one write, with bounded request heads (see the module)."""

    max_head_bytes = DEFAULT_MAX_HEAD_BYTES
    max_headers = DEFAULT_MAX_HEADERS
    head_timeout_s = DEFAULT_HEAD_TIMEOUT_S

    @classmethod
    def with_limits(
        cls,
        *,
        max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
        max_headers: int = DEFAULT_MAX_HEADERS,
        head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S,
    ) -> type[OneWriteProtocol]:
        """This protocol with other limits on request heads (uvicorn makes one per connection from the class)."""
        limits = {"max_head_bytes": max_head_bytes, "max_headers": max_headers, "head_timeout_s": head_timeout_s}
        return type(cls.__name__, (cls,), limits)

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._in_head = True  # the bytes coming are a request head
        self._head_bytes = 0  # received since the head began (with what came beside it)
        self._refusal: bytes | None = None
        self._refused = False
        # When the head now coming began (a connection that sends nothing counts from its start);
        # None between requests. One timer per connection checks it: none is armed per request.
        self._head_since: float | None = self.loop.time()
        self._head_timer: Any = self.loop.call_later(self.head_timeout_s, self._check_head)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's, except that a head over the limits gets 431 (uvicorn would answer 400).
        if self._refused:
            return  # what a refused client still sends, until the connection closes
        self._unset_keepalive_if_required()
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_since is None:
                self._head_since = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(431, self._refusal)
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        if self._in_head and self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
            # A head still incomplete past the limit (one long line, never ended).
            self._refuse(431, self._too_large(f"more than {self.max_head_bytes:,} bytes"))

    def _check_complete_head(self) -> None:
        """Refuse a complete head over the limits. Its exact size is only added up when more
        than the limit came while it was coming: the common request pays two comparisons."""
        if len(self.headers) > self.max_headers:
            self._refusal = self._too_large(f"more than {self.max_headers} headers")
            raise _HeadRefused()
        if self._head_bytes > self.max_head_bytes:
            size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)  # ": ", CRLF
            if size > self.max_head_bytes:
                self._refusal = self._too_large(f"more than {self.max_head_bytes:,} bytes")
                raise _HeadRefused()

    def _too_large(self, what: str) -> bytes:
        return (
            f"the request line and headers are {what}, over this server's limit "
            "(neuropod serve --max-head-bytes / --max-headers)"
        ).encode()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # whatever comes next is the next request's head
        self._head_bytes = 0
        self._head_since = None

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _check_head(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._refused:
            return
        since = self._head_since
        now = self.loop.time()
        responding = self.cycle is not None and not self.cycle.response_complete
        if since is None or responding or now - since < self.head_timeout_s:
            # No head coming, a response still being made for the request before it (pipelining),
            # or not late yet: look again when it could be late.
            wait = since + self.head_timeout_s - now if since is not None and not responding else self.head_timeout_s
            self._head_timer = self.loop.call_later(max(wait, 0.01), self._check_head)
            return
        message = f"the request head was not complete within {self.head_timeout_s:g} s (neuropod serve --head-timeout)"
        self._refuse(408, message.encode())

    def _refuse(self, status: int, message: bytes) -> None:
        """Answer ``status`` with ``message`` and close the connection (the request never reaches the app)."""
        self._stop_head_timer()
        self._in_head = False
        reason = b"Request Header Fields Too Large" if status == 431 else b"Request Timeout"
        body = json.dumps({"error": message.decode()}).encode()
        transport = self.transport
        transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, reason, len(body), body)
        )
        if status == 408 or not transport.can_write_eof():
            transport.close()
            return
        # A client still sending its head would get a reset, not the answer, if the socket closed
        # with its bytes unread: end the answer, drop what comes for a moment, then close.
        self._refused = True
        transport.write_eof()
        self.loop.call_later(_LINGER_S, transport.close)

    def shutdown(self) -> None:
        # uvicorn's graceful shutdown begins: a response still streaming (Server-Sent Events) is
        # ended now by what its app left in the scope, instead of being cut off when the wait ends.
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            stop = cycle.scope.get(ON_SHUTDOWN)
            if callable(stop):
                stop()
        super().shutdown()

    def send_400_response(self, msg: str) -> None:
        # uvicorn answers a request it cannot parse in plain text; here it is JSON like every other error.
        body = json.dumps({"error": f"{msg} The request is not HTTP/1.1 this server can parse."}).encode()
        self.transport.write(
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()

    def on_headers_complete(self) -> None:
        self._check_complete_head()
        self._in_head = False
        self._head_since = None
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        # Only a cycle made for this request (an upgrade makes none); a HEAD
        # response has no body write to carry its head, so it is left as it is.
        if cycle is not None and cycle is not before and self.scope["method"] != "HEAD":
            cycle.transport = _HeadHolder(cycle.transport, cycle)  # type: ignore[assignment]
