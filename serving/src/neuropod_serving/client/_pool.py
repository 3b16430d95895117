"""The servers of one remote model, and which one takes the next call.

Policy: **least outstanding calls**, ties taken in turn (round robin). A
server whose call failed as unavailable (refused, reset, unreachable,
HTTP 502/503) is skipped for a cool-down that starts at 1 s and doubles
with each further failure, up to 30 s; when every server is cooling down,
the one that failed longest ago is tried. A call that fails as unavailable
is retried at once on another server, or, when each has failed this call,
after a backoff (50 ms, doubling, capped at 1 s and by the call's timeout);
``retries`` bounds the extra attempts. Only "unavailable" is retried: the
server did not run the call, or died running it, and inference has no side
effects. Other errors (the model failed, bad inputs, a timeout) are raised at
once: retrying would repeat them, or double the load of a slow server.
A stream (``infer_stream``) is retried so until its first response arrives,
and counts as outstanding on its server until it ends; a failure after that
ends the stream (the responses already handed out cannot be taken back).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from neuropod.errors import RemoteError
from neuropod_serving.client._target import Target

COOL_DOWN_S = 1.0
MAX_COOL_DOWN_S = 30.0
BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0

_T = TypeVar("_T")


class Transport(Protocol):
    target: Target
    #: The model's outputs that are bytes tensors (set once its spec is known).
    bytes_outputs: frozenset[str]

    def metadata(self, timeout: float | None) -> dict[str, Any]: ...
    def ready(self, timeout: float | None) -> bool: ...
    def server(self, timeout: float | None) -> dict[str, Any]: ...
    def infer(self, inputs: Any, requested: Any, timeout: float | None, parameters: Any = None) -> Any: ...
    def open_stream(self, inputs: Any, requested: Any, timeout: float | None, parameters: Any = None) -> Any: ...
    def decoupled(self, timeout: float | None) -> bool | None: ...
    def config_flags(self, timeout: float | None) -> tuple[bool, bool] | None: ...
    def close(self) -> None: ...


@dataclass(eq=False)
class Server:
    transport: Transport
    outstanding: int = 0
    failures: int = 0
    down_until: float = 0.0
    calls: int = 0


class Pool:
    """The servers of one model; :meth:`call` runs one call on the best of them."""

    def __init__(self, transports: list[Transport], *, retries: int) -> None:
        self.servers = [Server(t) for t in transports]
        self.retries = retries
        self._lock = threading.Lock()
        self._turn = 0

    def _pick(self, tried: set[Server]) -> Server:
        now = time.monotonic()
        with self._lock:
            fresh = [s for s in self.servers if s not in tried] or self.servers
            up = [s for s in fresh if s.down_until <= now]
            if up:
                least = min(s.outstanding for s in up)
                choices = [s for s in up if s.outstanding == least]
                self._turn += 1
                server = choices[self._turn % len(choices)]
            else:
                server = min(fresh, key=lambda s: s.down_until)
            server.outstanding += 1
            server.calls += 1
            return server

    def mark_down(self, server: Server) -> None:
        """Skip ``server`` for its next cool-down."""
        with self._lock:
            self._mark_down(server)

    def _mark_down(self, server: Server) -> None:
        server.down_until = time.monotonic() + min(MAX_COOL_DOWN_S, COOL_DOWN_S * 2**server.failures)
        server.failures += 1

    def _done(self, server: Server, failed: bool) -> None:
        with self._lock:
            server.outstanding -= 1
            if failed:
                self._mark_down(server)
            elif server.failures:
                server.failures = 0
                server.down_until = 0.0

    def call(self, fn: Callable[[Transport, float | None], _T], timeout: float | None) -> _T:
        """``fn(transport, remaining_timeout)`` on the best server, retried as the policy says."""
        result, server = self._attempts(fn, timeout)
        self._done(server, False)
        return result

    def open(self, fn: Callable[[Transport, float | None], _T], timeout: float | None) -> tuple[_T, Server]:
        """:meth:`call` for a call that goes on after ``fn`` returns (a stream: ``fn`` opens it
        and reads its first response, so a server found unavailable is retried as a call is):
        the server counts the call as outstanding until :meth:`release`."""
        return self._attempts(fn, timeout)

    def release(self, server: Server, failed: bool = False) -> None:
        """The end of a call :meth:`open` began on ``server`` (``failed``: it was found unavailable)."""
        self._done(server, failed)

    def _attempts(self, fn: Callable[[Transport, float | None], _T], timeout: float | None) -> tuple[_T, Server]:
        deadline = None if timeout is None else time.monotonic() + timeout
        tried: set[Server] = set()
        attempt = 0
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            server = self._pick(tried)
            try:
                result = fn(server.transport, remaining)
            except RemoteError as e:
                unavailable = e.code == "unavailable"
                self._done(server, unavailable)
                if not unavailable or attempt >= self.retries:
                    raise
                attempt += 1
                tried.add(server)
                if len(tried) >= len(self.servers):
                    tried.clear()
                    pause = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
                    if deadline is not None:
                        pause = min(pause, deadline - time.monotonic())
                        if pause <= 0:
                            raise
                    time.sleep(pause)
                continue
            except BaseException:
                self._done(server, False)
                raise
            return result, server

    def call_on(self, server: Server, fn: Callable[[Transport, float | None], _T], timeout: float | None) -> _T:
        """``fn`` on ``server`` and no other, not retried (a sequence's step: its state lives there)."""
        with self._lock:
            server.outstanding += 1
            server.calls += 1
        try:
            result = fn(server.transport, timeout)
        except RemoteError as e:
            self._done(server, e.code == "unavailable")
            raise
        except BaseException:
            self._done(server, False)
            raise
        self._done(server, False)
        return result

    def close(self) -> None:
        for server in self.servers:
            server.transport.close()
