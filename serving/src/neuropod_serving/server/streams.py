"""Streams: one request, many responses. :class:`OpenStreams` counts and bounds each model's open
streams and ends them all when the server stops; :class:`ServedStream` is one of them, read by a
front end on a thread of its own (gRPC's threaded server) or from the event loop (REST's
Server-Sent Events).

How a stream runs and how it is held back:

* Read on a thread (``for response in stream``), the model's generator runs on that thread, one
  response per ``next``: it produces no faster than the front end sends (grpcio's threaded
  server blocks a stream's thread while its transport's window is full).
* Read from the event loop (``async for`` or :meth:`ServedStream.next_batch`), the generator runs
  on a thread of the stream's own, at most :attr:`StreamLimits.buffered` responses ahead of the
  reader; then it waits. A reader that drains the buffer takes every response ready at once
  (:meth:`~ServedStream.next_batch`), so a fast model's responses cross from its thread to the
  loop in batches, with one wake-up of the loop for each.
* :meth:`ServedStream.close` (the client went away, cancelled, or the front end is done) closes
  the model's generator, so its ``finally`` runs: at once when it is between responses, or as
  soon as the response it is working on is ready. :meth:`OpenStreams.stop_all` (the server
  stopping) does the same and hands each reader a final error instead of the end.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from neuropod.errors import NeuropodError
from neuropod.streams import ResponseStream
from neuropod_serving.defaults import DEFAULT_MAX_OPEN_STREAMS, DEFAULT_STREAM_BUFFER
from neuropod_serving.errors import ModelBusyError, StreamStoppedError
from neuropod_serving.server.model_exits import EXITS, is_users_interrupt, model_exited

Outputs = dict[str, np.ndarray]


@dataclass(frozen=True)
class StreamLimits:
    """How many streams of each model may be open, and how far a stream's model may run ahead.

    :param max_open: streams of one model open at once; one more is refused at once with
        :class:`~neuropod_serving.errors.ModelBusyError` (HTTP 429, gRPC RESOURCE_EXHAUSTED).
    :param buffered: responses a stream read from the event loop may hold, ready and unsent,
        before its model's generator waits for the reader.
    """

    max_open: int = DEFAULT_MAX_OPEN_STREAMS
    buffered: int = DEFAULT_STREAM_BUFFER

    def __post_init__(self) -> None:
        if self.max_open < 1:
            raise ValueError(f"max_open_streams must be at least 1, not {self.max_open}")
        if self.buffered < 1:
            raise ValueError(f"stream buffer must be at least 1 response, not {self.buffered}")


class OpenStreams:
    """The open streams of one server, by model: opened within :class:`StreamLimits`, timed
    into the metrics (time to the first response, time between responses), ended together when
    the server stops.

    :param on_response: called with ``(model, seconds, first, index)`` for each response as it
        is produced: ``first`` when it is the stream's first (``seconds`` since the stream
        opened), else ``seconds`` since the one before; ``index`` counts the stream's responses
        from 0. When the model fails (or a response breaks the spec) instead, it is called once
        more with ``failed=True`` (the index the failed response would have had).
        :meth:`ServerMetrics.streamed <neuropod_serving.server.metrics.ServerMetrics.streamed>` takes these.
    """

    def __init__(
        self, limits: StreamLimits | None = None, on_response: Callable[..., None] | None = None,
        on_end: Callable[[str, float], None] | None = None,
    ):  # fmt: skip
        self.limits = limits if limits is not None else StreamLimits()
        self.on_response = on_response
        #: Called with ``(model, seconds)`` once per stream that produced a response, when it
        #: closes: the seconds the model spent making its responses (its run, as a unary run's).
        self.on_end = on_end
        self._lock = threading.Lock()
        self._by_model: dict[str, int] = {}
        self._open: set[ServedStream] = set()
        self._stopping: str | None = None

    def open(
        self, name: str, model: Any, inputs: Mapping[str, np.ndarray], requested: list[str] | None,
        parameters: Mapping[str, Any] | None = None, on_end: Callable[[], None] | None = None,
    ) -> ServedStream:  # fmt: skip
        """Open a stream of ``model``'s responses to ``inputs`` (checked now: a SpecError is raised here).

        :param on_end: called once when the stream, opened, closes (not when it fails to open).

        :raises ModelBusyError: ``name`` has :attr:`StreamLimits.max_open` streams open.
        :raises NeuropodError: the server is stopping, or the model refused the request.
        """
        limit = self.limits.max_open
        with self._lock:
            if self._stopping is not None:
                raise NeuropodError(self._stopping)
            count = self._by_model.get(name, 0)
            if count >= limit:
                raise ModelBusyError(
                    f"model {name!r} has {count} streams open, the most it takes (--max-open-streams {limit}); "
                    "close one, or retry later"
                )
            self._by_model[name] = count + 1
        try:
            try:
                responses = model.infer_stream(inputs, requested, parameters=parameters or None)
            except EXITS as e:  # a model that exits as its stream opens (see model_exits)
                if is_users_interrupt(e):
                    raise
                raise model_exited(name, e) from e
        except BaseException:
            self._release(name)
            raise
        stream = ServedStream(self, name, responses)
        stream.on_end = on_end
        with self._lock:
            self._open.add(stream)
        return stream

    def count(self, name: str | None = None) -> int:
        """Streams open now: of model ``name``, or of every model."""
        with self._lock:
            return sum(self._by_model.values()) if name is None else self._by_model.get(name, 0)

    def stop_all(self, reason: str = "the server is stopping") -> None:
        """End every open stream with ``reason`` as its final error, and refuse new ones."""
        with self._lock:
            self._stopping = reason
            streams = list(self._open)
        for stream in streams:
            stream.cancel(reason)

    def _release(self, name: str) -> None:
        with self._lock:
            left = self._by_model.get(name, 1) - 1
            if left > 0:
                self._by_model[name] = left
            else:
                self._by_model.pop(name, None)

    def _closed(self, stream: ServedStream) -> None:
        with self._lock:
            if stream not in self._open:
                return
            self._open.discard(stream)
        self._release(stream.model)
        if stream.on_end is not None:
            stream.on_end()


class ServedStream:
    """One request's responses on the server; see the module's docstring for how it runs.

    Read it one way only: on a thread (iterate it) or from the event loop (``async for``, or
    :meth:`next_batch`). Always :meth:`close` it when done with it (a ``with`` block does).
    """

    def __init__(self, owner: OpenStreams, model: str, responses: ResponseStream) -> None:
        self._owner = owner
        #: The model's name.
        self.model = model
        self._responses = responses
        #: Called once when the stream closes (:meth:`OpenStreams.open`'s ``on_end``).
        self.on_end: Callable[[], None] | None = None
        self._on_response = owner.on_response
        self._buffered = owner.limits.buffered
        #: When the stream opened (``time.perf_counter()``), and when its last response was produced.
        self.opened = self._last = time.perf_counter()
        #: Responses produced so far.
        self.produced = 0
        #: Seconds spent in the model's ``next`` (waits for a slow reader left out).
        self.model_s = 0.0
        #: Why the server ended the stream (its final error), or None.
        self._error: StreamStoppedError | None = None
        self._closed = False
        # Reading from the event loop: the producer thread, its buffer, and the loop's waiter.
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[Outputs] = collections.deque()
        #: Whether a producer thread runs the model (the stream is read from the event loop).
        self._producer = False
        self._finished = False
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- on a thread ---------------------------------------------------------------

    def __iter__(self) -> ServedStream:
        return self

    def __next__(self) -> Outputs:
        try:
            return self._next()
        except BaseException:
            self.close()
            raise

    def _next(self) -> Outputs:
        """The model's next response, timed; at the end, StopIteration, or the error the server
        ended the stream with. Leaves the stream open (the producer's buffer may hold responses)."""
        began = time.perf_counter()
        try:
            item = next(self._responses)
        except StopIteration:
            self.model_s += time.perf_counter() - began
            if self._error is not None:
                raise self._error from None
            raise
        except NeuropodError:  # the model failed, or its response broke the spec
            self._failed(began)
            raise
        except EXITS as e:  # the model's sys.exit(): the stream ends with its error, the server lives
            if is_users_interrupt(e):
                raise
            self._failed(began)
            raise model_exited(self.model, e) from e
        self._timed(began)
        return item

    def _failed(self, began: float) -> None:
        self.model_s += time.perf_counter() - began
        report = self._on_response
        if report is not None:
            report(self.model, time.perf_counter() - self._last, self.produced == 0, self.produced, failed=True)

    def _timed(self, began: float) -> None:
        now = time.perf_counter()
        self.model_s += now - began
        index = self.produced
        self.produced = index + 1
        report = self._on_response
        if report is not None:
            report(self.model, now - self._last, index == 0, index)
        self._last = now

    # -- from the event loop ---------------------------------------------------------

    def __aiter__(self) -> ServedStream:
        return self

    async def __anext__(self) -> Outputs:
        batch = await self.next_batch(1)
        return batch[0]

    async def next_batch(self, most: int | None = None) -> list[Outputs]:
        """The responses ready now (at least one: waits for it; at most ``most``), in order.

        :raises StopAsyncIteration: the stream has ended.
        :raises NeuropodError: the model failed, a response broke the spec, or the server ended
            the stream; the responses before it were returned by earlier calls.
        """
        if not self._producer:
            self._start()
        cond = self._cond
        while True:
            with cond:
                queue = self._queue
                if queue:
                    if most is None or len(queue) <= most:
                        batch = list(queue)
                        queue.clear()
                    else:
                        batch = [queue.popleft() for _ in range(most)]
                    cond.notify()
                    return batch
                if self._finished or self._closed:
                    failure = self._failure if self._finished else None
                    failure = failure or self._error
                    break
                waiter = self._waiter = self._loop.create_future()  # type: ignore[union-attr]
            await waiter
        self.close()
        if failure is not None:
            raise failure
        raise StopAsyncIteration

    def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._producer = True
        _PRODUCERS.run(self._produce, f"neuropod-stream-{self.model}")

    def _produce(self) -> None:
        cond = self._cond
        most = self._buffered
        try:
            while True:
                try:
                    item = self._next()
                except StopIteration:
                    break
                with cond:
                    while len(self._queue) >= most and not self._closed:
                        cond.wait()
                    if self._closed:
                        break
                    self._queue.append(item)
                    waiter, self._waiter = self._waiter, None
                if waiter is not None:
                    self._wake(waiter)
        except BaseException as e:  # noqa: BLE001 - handed to the reader, raised there
            self._failure = e
        finally:
            with cond:
                self._finished = True
                waiter, self._waiter = self._waiter, None
            if waiter is not None:
                self._wake(waiter)

    def _wake(self, waiter: asyncio.Future[None]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(_set, waiter)
        except RuntimeError:  # the loop closed meanwhile
            pass

    # -- ending ----------------------------------------------------------------------

    def cancel(self, reason: str | None = None) -> None:
        """End the stream; with ``reason``, its reader gets that as a final
        :class:`~neuropod_serving.errors.StreamStoppedError` (naming the model) instead of the end. The model's generator is closed (see :meth:`close`)."""
        if reason is not None and self._error is None:
            self._error = StreamStoppedError(f"stream of model {self.model!r} ended: {reason}")
        self.close()

    def close(self) -> None:
        """Stop the stream and let its model go: the generator is closed (its ``finally`` runs) now,
        or by the thread running it as soon as its current response is ready. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        self._responses.close()
        if waiter is not None:
            self._wake(waiter)
        owner = self._owner
        owner._closed(self)
        if owner.on_end is not None and self.produced:
            owner.on_end(self.model, self.model_s)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> ServedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ServedStream of {self.model!r}: {self.produced} response(s), {'closed' if self._closed else 'open'}>"


class _Threads:
    """The threads that run streams' producers. One that finishes a stream waits
    :data:`IDLE_S` for the next before it ends, so a stream opened meanwhile (the common case on
    a busy server) starts on it rather than paying for a new thread (about 50 µs, most of what a
    stream's first response costs beyond a unary call's). A thread is named for the stream it
    runs (``neuropod-stream-<model>``), ``neuropod-stream-idle`` while it waits."""

    #: Seconds an idle thread waits for another stream before it ends.
    IDLE_S = 0.5

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[tuple[Callable[[], None], str] | None]] = []

    def run(self, work: Callable[[], None], name: str) -> None:
        """Run ``work`` on an idle thread, or on a new one."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is not None:
            inbox.put((work, name))
            return
        inbox = queue.SimpleQueue()
        inbox.put((work, name))
        threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()

    def _serve(self, inbox: queue.SimpleQueue[tuple[Callable[[], None], str] | None]) -> None:
        me = threading.current_thread()
        while True:
            try:
                task = inbox.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:
                        self._idle.remove(inbox)
                        return
                task = inbox.get()  # handed a stream as it timed out: run it
            if task is None:
                return
            work, me.name = task
            work()  # _produce: catches everything itself
            me.name = "neuropod-stream-idle"
            with self._lock:
                self._idle.append(inbox)


_PRODUCERS = _Threads()


def _set(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


__all__ = ["OpenStreams", "ServedStream", "StreamLimits"]
