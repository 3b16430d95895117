"""A decoupled model's stream in a worker process: :class:`WorkerStream`, the source of the
:class:`~neuropod.streams.ResponseStream` that ``infer_stream`` returns for a model loaded with
``use_ope=True`` (or in a backend environment).

The model's generator runs in the worker; each response crosses as soon as the client asks for
it, one at a time (``"stream"`` with the inputs, then ``"next"``), so the generator never runs
more than one response ahead of the reader. ``"cancel"`` closes the generator (its ``finally``
runs in the worker). A stream holds its worker from its first response to its end (the last
response, an error, ``close()``, or garbage collection of a stream left open); other calls take
the model's other workers, or wait for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from neuropod.errors import NeuropodError, WorkerError

if TYPE_CHECKING:
    import numpy as np

    from neuropod.ope.pool import WorkerPool
    from neuropod.ope.process import WorkerProcess


class _Held:
    """The worker a stream holds; given back exactly once."""

    __slots__ = ("pool", "worker")

    def __init__(self, pool: WorkerPool, worker: WorkerProcess | None):
        self.pool = pool
        self.worker = worker

    def give_back(self, *, abandoned: bool = False) -> None:
        worker, self.worker = self.worker, None
        if worker is None:
            return
        if abandoned:  # from garbage collection: ask the worker to end the stream, read its answer later
            worker.abandon_stream()
        self.pool.stream_ended(worker)

    def abandon(self) -> None:
        self.give_back(abandoned=True)


class WorkerStream:
    """The responses of one request to a decoupled model in a worker: an iterator, and ``close()``.

    Read by one thread at a time (the :class:`~neuropod.streams.ResponseStream` around it sees
    to that). The worker is taken at the first ``next``, so opening a stream never waits.
    """

    __slots__ = ("__weakref__", "_held", "_request")

    def __init__(
        self, pool: WorkerPool, inputs: Mapping[str, np.ndarray], requested: Sequence[str] | None,
        parameters: Mapping[str, Any] | None,
    ) -> None:  # fmt: skip
        self._request: tuple[WorkerPool, Any, Any, Any] | None = (pool, inputs, requested, parameters)
        self._held: _Held | None = None

    def __iter__(self) -> WorkerStream:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        held = self._held
        try:
            if held is None:
                if self._request is None:
                    raise StopIteration
                (pool, inputs, requested, parameters), self._request = self._request, None
                held = self._take(pool)
                assert held.worker is not None
                response = held.worker.open_stream(inputs, requested, parameters)
            else:
                worker = held.worker
                if worker is None:
                    raise StopIteration
                if held.pool.closed:
                    raise WorkerError(f"Model {held.pool.name!r} was closed while this stream was open")
                response = worker.next_response()
        except StopIteration:
            raise
        except NeuropodError:
            self._end()  # the worker ended the stream (its error), or it died (marked failed)
            raise
        except BaseException:
            self._end(broken=True)
            raise
        if response is None:
            self._end()
            raise StopIteration
        return response

    def _take(self, pool: WorkerPool) -> _Held:
        held = self._held = _Held(pool, pool.take_for_stream())
        # A stream dropped while it holds the worker gives it back (and ends the model's generator).
        # Not at interpreter exit: the workers end with this process then.
        weakref.finalize(self, held.abandon).atexit = False
        return held

    def close(self) -> None:
        """End the stream: the worker closes the model's generator (its ``finally`` runs) before this returns."""
        self._request = None
        held = self._held
        if held is None or held.worker is None:
            return
        try:
            held.worker.cancel_stream()
        except NeuropodError:
            pass  # the worker died or was stopped: it is marked failed, and the generator is gone with it
        finally:
            self._end()

    def _end(self, *, broken: bool = False) -> None:
        """Give the worker back. ``broken``: interrupted mid-message (KeyboardInterrupt...), so the
        channel is out of step: the worker is stopped (restarted on the next call when allowed)."""
        self._request = None
        held = self._held
        if held is None:
            return
        worker = held.worker
        if broken and worker is not None:
            worker._failure("was interrupted in the middle of a stream", kill=True)
        held.give_back()


__all__ = ["WorkerStream"]
