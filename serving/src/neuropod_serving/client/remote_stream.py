"""One request's responses from a remote model, as they arrive: what
:meth:`RemoteModel.infer_stream <neuropod_serving.client.remote_model.RemoteModel.infer_stream>` returns.

A stream is opened on the pool's best server when it is first read (the call is sent and its
first response awaited there, so a server found unavailable is retried as a call is), then read
response by response from that server's transport (gRPC ``ModelStreamInfer``, or REST
``infer_stream``'s Server-Sent Events). Closing it, from any thread, cancels the call at once (a
thread blocked reading it gets the end) and the server stops the model's generator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from neuropod.errors import NeuropodError, RemoteError
from neuropod.streams import ResponseStream
from neuropod_serving.client._pool import Pool, Server, Transport
from neuropod_serving.client._target import Target

Outputs = dict[str, np.ndarray]


class TransportStream(Protocol):
    """A transport's stream of one request's responses (``GrpcStream``, ``HttpStream``)."""

    def __next__(self) -> Outputs: ...
    def cancel(self) -> None: ...


#: ``open(transport, remaining_timeout)`` -> the transport's stream of the request.
Opener = Callable[[Transport, "float | None"], TransportStream]
#: ``check(target, outputs)`` -> the response as handed out (raises RemoteError for a misfit).
Check = Callable[[Target, Outputs], Outputs]

_END = object()


class StreamSource:
    """The iterator a :class:`RemoteResponseStream` reads: opens the call on first ``next``,
    checks each response, and gives its server back to the pool when the stream ends."""

    def __init__(self, pool: Pool, opener: Opener, timeout: float | None, check: Check) -> None:
        self._pool = pool
        self._opener = opener
        self._timeout = timeout
        self._check = check
        self._lock = threading.Lock()
        self._current: TransportStream | None = None
        self._target: Target | None = None
        self._server: Server | None = None
        self._cancelled = False
        self._done = False

    def __iter__(self) -> Iterator[Outputs]:
        return self

    def _open(self, transport: Transport, remaining: float | None) -> tuple[TransportStream, Any]:
        """Open the call on ``transport`` and read its first response (``_END`` when there is none)."""
        stream = self._opener(transport, remaining)
        with self._lock:
            self._current = stream
            cancelled = self._cancelled
        if cancelled:
            stream.cancel()
            return stream, _END
        try:
            return stream, next(stream)
        except StopIteration:
            return stream, _END
        except BaseException:
            stream.cancel()
            raise

    def __next__(self) -> Outputs:
        if self._done:
            raise StopIteration
        try:
            if self._server is None:
                (_, item), server = self._pool.open(self._open, self._timeout)
                self._server = server
                self._target = server.transport.target
            else:
                assert self._current is not None
                item = next(self._current)
        except StopIteration:
            self._finish(False)
            raise
        except RemoteError as e:
            self._finish(e.code == "unavailable")
            raise
        except BaseException:
            self._finish(False)
            raise
        if item is _END:
            self._finish(False)
            raise StopIteration
        assert self._target is not None
        return self._check(self._target, item)

    def _finish(self, failed: bool) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            server, self._server = self._server, None
            stream = self._current
        if stream is not None:
            stream.cancel()  # ended already, or an error: frees the call
        if server is not None:
            self._pool.release(server, failed)

    def cancel(self) -> None:
        """Cancel the call now, from any thread: a thread reading it gets the end."""
        with self._lock:
            self._cancelled = True
            stream = self._current
        if stream is not None:
            stream.cancel()

    def close(self) -> None:
        """The stream is over (its end, an error, or :meth:`RemoteResponseStream.close`)."""
        self.cancel()
        self._finish(False)

    def __del__(self) -> None:
        # A stream dropped unclosed: its call is cancelled (the server stops the model) and its
        # server no longer counts it as outstanding.
        if not self._done:
            self.close()


class RemoteResponseStream(ResponseStream):
    """A :class:`~neuropod.streams.ResponseStream` of a remote model's responses; :meth:`close`
    also cancels the call at once, so a thread blocked waiting for the next response gets the end."""

    __slots__ = ("_cancel",)

    def __init__(self, source: StreamSource, failed: Callable[[Exception], NeuropodError]) -> None:
        super().__init__(source, _as_is, failed)
        self._cancel = source.cancel

    def close(self) -> None:
        self._cancel()
        super().close()


def _as_is(outputs: Outputs) -> Outputs:
    return outputs


def one_answer(call: Callable[[], Outputs]) -> Iterator[Outputs]:
    """A model that answers once, as a stream of one response (run when it is read)."""
    yield call()


def requested_only(outputs: Outputs, requested: list[str] | None) -> Outputs:
    """A response with only the requested outputs it holds."""
    if requested is None or all(k in requested for k in outputs):
        return outputs
    return {k: outputs[k] for k in requested if k in outputs}


__all__ = ["RemoteResponseStream", "StreamSource", "TransportStream", "one_answer", "requested_only"]

