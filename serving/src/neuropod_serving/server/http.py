"""uvicorn's httptools protocol, writing each small response in one system call.

uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start``, then the body when it sends ``http.response.body``:
two ``send()`` calls, two TCP segments, for a reply of a few hundred bytes. On
loopback and on a fast network each costs several microseconds, a few percent
of a small model's whole request. :class:`OneWriteProtocol` holds the head
until the first body write and sends both together. Everything else (parsing,
keep-alive, pipelining, ``Expect: 100-continue``, flow control, errors) is
uvicorn's own code, unchanged.

Used by ``neuropod serve`` as ``uvicorn.Config(http=OneWriteProtocol)``; when
uvicorn's httptools protocol is not there (no httptools) the server uses
uvicorn's default instead.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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


class OneWriteProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose responses go out in one write (see the module)."""

    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        # Only a cycle made for this request (an upgrade makes none); a HEAD
        # response has no body write to carry its head, so it is left as it is.
        if cycle is not None and cycle is not before and self.scope["method"] != "HEAD":
            cycle.transport = _HeadHolder(cycle.transport, cycle)  # type: ignore[assignment]
