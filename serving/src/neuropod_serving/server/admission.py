"""Admission of one model's requests: how many run at once and how many may wait
(:class:`ModelLimits`, enforced by each model's :class:`Gate`), and how long a request with a
``timeout`` (or a gRPC deadline) waits for a run slot or its batch (:class:`Deadline`) before it
is answered with :class:`~neuropod_serving.errors.RequestTimeoutError` and never run.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from neuropod_serving.defaults import DEFAULT_MAX_QUEUED
from neuropod_serving.errors import ModelBusyError, RequestTimeoutError, UnknownModelError
from neuropod_serving.protocol.options import RequestOptions


@dataclass(frozen=True)
class ModelLimits:
    """How many requests of each model run at once and how many may wait.

    :param max_concurrent: runs of one model at once (unbatched requests;
        a batched model runs as many batches as it has OPE workers). None:
        :data:`~neuropod_serving.defaults.DEFAULT_MAX_CONCURRENT`, or 2 per OPE worker when that is more.
    :param max_queued: requests of one model waiting for a run or a batch;
        one more is refused at once with :class:`~neuropod_serving.errors.ModelBusyError`.
    """

    max_concurrent: int | None = None
    max_queued: int = DEFAULT_MAX_QUEUED

    def __post_init__(self) -> None:
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, not {self.max_concurrent}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be 0 or more, not {self.max_queued}")


class Retired(UnknownModelError):
    """The model version a request was about to run on stopped serving first (a reload, a newer
    version, an unload): nothing of the request ran. A request that named no version is run on
    the model's latest version instead (see :meth:`~.engine.Engine.infer_latest`)."""


class Gate:
    """Admission and concurrency of one model's requests: at most ``concurrent`` run
    at once and ``capacity`` (running and waiting) are admitted; the next is refused.

    Lock-free on the hot path: the counters are a deque and a SimpleQueue of run
    slots, whose operations are atomic C calls. Threads admitted at the same instant
    may pass ``capacity`` by their number: the bound is a back-pressure limit, not an
    exact one. ``concurrent`` is exact.

    A model version that stops serving is retired (:meth:`retire`), then drained (:meth:`drain`):
    a request counts itself admitted before it looks at :attr:`retired`, and retirement sets
    :attr:`retired` before it counts the requests left, so every request is either refused
    (:class:`Retired`, before it ran) or waited for: none runs on a closed model.
    """

    __slots__ = ("_held", "_pending", "_slots", "capacity", "concurrent", "limits", "name", "retired")

    def __init__(self, name: str, concurrent: int, capacity: int, limits: str) -> None:
        self.name = name
        #: The options that set these limits, with their values (for the refusal's message).
        self.limits = limits
        self.concurrent = concurrent
        self.capacity = capacity
        self._pending: collections.deque[None] = collections.deque()  # one entry per admitted request
        self._held: collections.deque[None] = collections.deque()  # one entry per open stream (see hold)
        #: Set once the version stopped serving: no request is admitted any more.
        self.retired = False
        self._slots: queue.SimpleQueue[None] = queue.SimpleQueue()  # one entry per free run slot
        for _ in range(concurrent):
            self._slots.put(None)

    @property
    def pending(self) -> int:
        """Requests admitted and not finished (running or waiting)."""
        return len(self._pending)

    @property
    def running(self) -> int:
        """Requests holding a run slot."""
        return self.concurrent - self._slots.qsize()

    @property
    def waiting(self) -> int:
        """Requests admitted and waiting for a run slot (approximate while others come and go)."""
        return len(self._pending) - (self.concurrent - self._slots.qsize())

    def admit(self, run_now: bool) -> bool:
        """Admit one request; with ``run_now``, also take a run slot if one is free
        (True when taken). :raises ModelBusyError: the model's queue is full."""
        if len(self._pending) >= self.capacity:
            raise ModelBusyError(
                f"model {self.name!r} is busy: {len(self._pending)} of its requests are running or waiting, "
                f"the most it takes ({self.limits}); retry later"
            )
        self._pending.append(None)
        if self.retired:  # after counting itself: see the class's docstring
            self._pending.pop()
            raise self._retired()
        if run_now:
            try:
                self._slots.get_nowait()
            except queue.Empty:
                return False
            return True
        return False

    def hold(self) -> None:
        """Keep the version serving while a stream runs on it (outside the run slots and the
        queue's bound; :meth:`release` when it ends). :raises Retired: it stopped serving."""
        self._held.append(None)
        if self.retired:
            self._held.pop()
            raise self._retired()

    def release(self) -> None:
        """A stream :meth:`hold` kept ended."""
        self._held.pop()

    def retire(self) -> None:
        """Admit nothing more: the version stopped serving (then :meth:`drain` it)."""
        self.retired = True

    def _retired(self) -> Retired:
        return Retired(f"model {self.name!r} was unloaded while the request waited")

    def wait_slot(self) -> None:
        """Wait for a run slot (the request was admitted)."""
        self._slots.get()

    def wait_slot_until(self, seconds: float) -> bool:
        """Wait for a run slot for at most ``seconds`` (True when taken; False, and no slot, when
        the time passed first: at once when ``seconds`` <= 0)."""
        if seconds <= 0:
            return False
        try:
            self._slots.get(timeout=min(seconds, threading.TIMEOUT_MAX))
        except queue.Empty:
            return False
        return True

    def leave(self, ran: bool) -> None:
        """The request finished (``ran``: it held a run slot)."""
        self._pending.pop()
        if ran:
            self._slots.put(None)

    def drain(self, timeout: float) -> bool:
        """Wait until no admitted request or held stream is left (True), or ``timeout`` seconds (False)."""
        deadline = time.monotonic() + timeout
        while self._pending or self._held:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True


_CALL_DEADLINE = "the call's deadline"
#: A call deadline further than this (seconds) is no deadline: MAX_TIMEOUT_US's year.
_NO_CALL_DEADLINE_S = 365 * 24 * 3600.0


@dataclass(frozen=True)
class Deadline:
    """When a waiting request gives up (``time.perf_counter()`` time), and why."""

    at: float
    #: What set it, for the message: "its timeout of N µs" or "the call's deadline".
    what: str

    def expired(self, model: str, queued: float, waiting_for: str) -> RequestTimeoutError:
        waited = (time.perf_counter() - queued) * 1000
        return RequestTimeoutError(
            f"request timeout expired: the request to model {model!r} waited {waited:.0f} ms for {waiting_for}, "
            f"past {self.what}, and was not run",
            call_deadline=self.what == _CALL_DEADLINE,
        )


def request_deadline(
    now: float, options: RequestOptions | None, time_left: Callable[[], float | None] | None
) -> Deadline | None:
    """The earlier of the request's ``timeout`` and the call's own deadline (None: neither)."""
    best = None
    if options is not None and options.timeout_s is not None:
        best = Deadline(now + options.timeout_s, f"its timeout of {options.timeout_us} µs")
    left = time_left() if time_left is not None else None
    # grpcio reports a call without a deadline as one centuries away: past a year, none
    # (waits that long overflow the clocks the waits use).
    if left is not None and left < _NO_CALL_DEADLINE_S and (best is None or now + left < best.at):
        best = Deadline(now + left, _CALL_DEADLINE)
    return best


class NotStarted(Exception):
    """A request's work was cancelled before it started (its deadline passed first)."""

    def __init__(self, error: RequestTimeoutError) -> None:
        super().__init__(str(error))
        self.error = error


async def until(
    future: concurrent.futures.Future[Any], deadline: Deadline | None, model: str, queued: float, waiting_for: str
) -> Any:
    """The result of ``future`` (a batch's, or a run handed to a thread); when ``deadline``
    passes before it starts, it is cancelled (never run) and a RequestTimeoutError raised
    (as :class:`NotStarted` for a thread's run, whose gate the caller leaves). Work already
    running is awaited to its end: a request that runs finishes."""
    wrapped = asyncio.wrap_future(future)
    if deadline is None:
        return await wrapped
    try:
        return await asyncio.wait_for(asyncio.shield(wrapped), max(0.0, deadline.at - time.perf_counter()))
    except (TimeoutError, asyncio.TimeoutError):
        if future.cancel():
            error = deadline.expired(model, queued, waiting_for)
            if waiting_for == "a thread":
                raise NotStarted(error) from None
            raise error from None
        return await wrapped


def wait(
    future: concurrent.futures.Future[Any], deadline: Deadline | None, model: str, queued: float, waiting_for: str
) -> Any:
    """:func:`until` for a caller on a thread of its own."""
    if deadline is None:
        return future.result()
    try:
        return future.result(timeout=max(0.0, deadline.at - time.perf_counter()))
    except concurrent.futures.TimeoutError:
        if future.cancel():
            raise deadline.expired(model, queued, waiting_for) from None
        return future.result()


__all__ = ["Deadline", "Gate", "ModelLimits", "NotStarted", "request_deadline", "until", "wait"]
