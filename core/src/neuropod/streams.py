"""One request's responses from a decoupled model: :class:`ResponseStream`, what
:meth:`NeuropodModel.infer_stream <neuropod.model.NeuropodModel.infer_stream>` returns."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from neuropod.errors import NeuropodError

if TYPE_CHECKING:
    from neuropod.backend import Backend


class ResponseStream:
    """The responses of one request, as the model produces them: iterate it.

    Each item is a dict of output name to numpy array, checked against the model's output
    spec as it comes; a decoupled model's response may hold some of its outputs only. The
    stream ends when the model has no more responses, or with the error that stopped it
    (raised from ``next`` after the responses before it were delivered), after which it is
    done.

    :meth:`close` stops it early (also ``with model.infer_stream(...) as responses:``): the
    model's generator is closed, so its ``finally`` runs, at once, or, when another thread is
    running it, as soon as the response it is working on is ready (that response is dropped).
    """

    __slots__ = ("_check", "_closing", "_done", "_failed", "_lock", "_running", "_source", "responses")

    def __init__(
        self, source: Iterator[Any], check: Callable[[Any], dict[str, Any]],
        failed: Callable[[Exception], NeuropodError],
    ) -> None:  # fmt: skip
        """
        :param source: the backend's iterator of output dicts.
        :param check: one response as it is handed out (its spec check; raises SpecError).
        :param failed: the error for an exception of the backend's (chained to it).
        """
        self._source = source
        self._check = check
        self._failed = failed
        self._lock = threading.Lock()
        self._running = False
        self._closing = False
        self._done = False
        #: Responses handed out so far.
        self.responses = 0

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> dict[str, Any]:
        with self._lock:
            if self._done:
                raise StopIteration
            if self._running:
                raise RuntimeError("a ResponseStream is read by one thread at a time")
            self._running = True
        try:
            item = next(self._source)
        except StopIteration:
            self._end()
            raise
        except NeuropodError:
            self._end()
            raise
        except Exception as e:
            self._end()
            raise self._failed(e) from e
        except BaseException:
            self._end()
            raise
        with self._lock:
            self._running = False
            closing = self._closing
        if closing:  # closed while the model worked on this one: drop it and close the generator now
            self._end()
            raise StopIteration
        try:
            checked = self._check(item)
        except BaseException:
            self._end()
            raise
        self.responses += 1
        return checked

    @property
    def done(self) -> bool:
        """Whether the stream has ended (all responses read, an error, or :meth:`close`)."""
        return self._done

    def close(self) -> None:
        """Stop the stream: the model's generator is closed (its ``finally`` runs), now, or by the
        thread running it once its current response is ready. Safe from any thread, more than once."""
        with self._lock:
            if self._done:
                return
            if self._running:
                self._closing = True
                return
        self._end()

    def _end(self) -> None:
        with self._lock:
            if self._done:
                self._running = False
                return
            self._done = True
            self._running = False
        closer = getattr(self._source, "close", None)
        self._source = iter(())
        if callable(closer):
            try:
                closer()
            except Exception:  # noqa: BLE001 - a generator whose finally raises: the stream is over either way
                pass

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "done" if self._done else "open"
        return f"<ResponseStream {state}, {self.responses} response(s) so far>"


class AsyncResponseStream:
    """A :class:`ResponseStream` for asyncio code: ``async for response in stream``.

    Each response is read on a thread of the event loop's default executor, so the loop never
    waits for the model. ``await stream.aclose()`` (or leaving ``async with``) closes it; so
    does cancelling a task that is waiting for a response (the model's generator is then
    closed as soon as the response it is working on is ready, and that response is dropped).
    """

    __slots__ = ("stream",)

    def __init__(self, stream: ResponseStream) -> None:
        #: The stream read underneath (its ``done`` and ``responses`` hold here too).
        self.stream = stream

    def __aiter__(self) -> AsyncResponseStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        import asyncio  # lazy: asyncio, kept out of loading a model (only async callers need it, and have it)

        try:
            item: dict[str, Any] | None = await asyncio.get_running_loop().run_in_executor(None, next, self.stream, None)
        except asyncio.CancelledError:
            self.stream.close()  # the thread still reading finishes its response, then closes the generator
            raise
        if item is None:  # a response is a dict, never None
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        """Stop the stream, as :meth:`ResponseStream.close` does, without blocking the event loop."""
        import asyncio  # lazy: as in __anext__

        await asyncio.get_running_loop().run_in_executor(None, self.stream.close)

    async def __aenter__(self) -> AsyncResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<Async{repr(self.stream)[1:]}"


def cannot_stream(model: str, backend: Backend) -> NeuropodError:
    """The error for decoupled model ``model`` on a backend whose plugin has no ``infer_stream``
    hook: it cannot run there (raised at load, in this process or in a worker)."""
    return NeuropodError(
        f'Model {model!r} is decoupled (its config.json says "decoupled": true: any number of '
        f"responses a request), and backend {backend.id} cannot stream responses: its plugin "
        f"{backend.plugin!r} has no infer_stream hook. Load it with a backend that streams (python), "
        "or package the model without decoupled=True"
    )


__all__ = ["AsyncResponseStream", "ResponseStream", "cannot_stream"]
