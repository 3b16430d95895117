"""Dynamic batching derived from the problem spec.

A model can be batched when every input and every output has the same symbol
(Neuropod's ``batch_size``) as its first dim, and nowhere else: then requests
can be concatenated along that dim, run once, and the outputs split back by
the rows each request sent. Nothing is configured per model; a model without
such a symbol is never batched.

The batcher is a thread per model (which runs the batches itself when one at
a time may run, else hands them to a pool of ``inflight`` threads), so the
REST server and the gRPC server (and anything else holding an event loop, or
none) hand it requests alike and await a ``concurrent.futures.Future``.
Handing a request to a thread and back costs more than a fast model's run,
so with no queue delay two ways skip the hop (the engine picks them, see
:meth:`~neuropod_serving.server.engine.Engine.infer`):

- a request that finds the batcher idle (nothing waiting, a run slot free)
  runs at once on the caller's thread, as a batch of one
  (:meth:`Batcher.begin_alone`, :meth:`Batcher.run_alone`): the batcher would
  have taken it alone at once;
- on an event loop, a fast model's requests run on the loop: alone, or, when
  one of the model's runs already held the loop in this iteration of it (so
  requests arrive faster than it runs) and lately enough of them did for
  merging to pay (:data:`GATHER_COST_S`), gathered with the others that
  arrive in the iteration and run as batches in the next one
  (``loop.call_soon``), under the same policy (:meth:`Batcher.alone_on_loop`,
  :meth:`Batcher.gather`).
  Gathered requests that find a thread's batch running or waiting join the
  batcher's queue instead.

Policy (Triton's ``dynamic_batching`` in spirit): the oldest waiting request
opens a batch; the batch takes every waiting request with the same other dims
(in arrival order) up to ``max_batch_size`` rows, waiting at most
``max_queue_delay`` after that oldest request arrived for more to come (a lone
request too: with a delay, no request skips the queue). While ``inflight``
batches (or requests run alone) run, new requests queue, so under load batches
grow on their own even with a delay of 0. A request with more rows than
``max_batch_size`` runs alone (never split, never refused). How many requests
may wait is bounded by the :class:`~neuropod_serving.server.engine.Engine`
before they are submitted (its ``ModelLimits``): the same limit as unbatched
requests, so a full queue is refused at once rather than left to grow.

Packages the original Neuropod wrote check a symbol within the inputs and
within the outputs separately (see :class:`neuropod.spec.SpecValidator`): an
output may reuse the batch symbol's name at another size, which only shows
once requests are merged. For such a model (``rows_promised=False``) the
first merged run whose outputs lack the batch's rows is answered by running
each of its requests alone, and the batcher stops merging that model's
requests, with a warning; our packages promise the rows (the spec check
fails otherwise), so for them it stays an error.

The model always gets writable input arrays: a batch of several requests is a
fresh concatenation, and a request that runs alone (in a batch of one or at
once on its caller's thread) has its read-only inputs (views of request
bytes) copied, as unbatched requests do.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from neuropod.errors import BackendError, NeuropodError
from neuropod.spec import TensorSpec

Arrays = dict[str, np.ndarray]

#: What a request gathered on the event loop costs beyond a run of its own there: its future
#: and wake-up, its spec check and batch key, its share of the concatenation and of the next
#: loop iteration (measured on the tiny model of bench_serve.py under uvloop: 8 to 10 µs).
#: Gathering pays when ``k`` requests arriving behind a run of ``run_s`` seconds cost less merged
#: (one run, ``k`` times this) than run one by one: ``k * (run_s - GATHER_COST_S) > run_s``.
GATHER_COST_S = 10e-6
# Weight of the newest loop iteration in the moving average of requests arriving behind a run.
_BURST_EWMA = 0.2

log = logging.getLogger("neuropod_serving.server")


def batch_symbol(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> tuple[str | None, str]:
    """The spec's batch dimension: ``(symbol, "")``, or ``(None, why not)``.

    The symbol must be the first dim of every input and output and appear in
    no other dim (else concatenating along it would change those dims too).
    """
    if not inputs or not outputs:
        return None, "the model has no inputs or no outputs"
    first = None
    for s in (*inputs, *outputs):
        lead = s.shape[0] if s.shape else None
        if not isinstance(lead, str):
            what = "is a scalar" if not s.shape else f"starts with {'None' if lead is None else lead}, not a symbol"
            return None, f"tensor {s.name!r} {what}"
        if first is None:
            first = lead
        elif lead != first:
            return None, f"tensor {s.name!r} starts with {lead!r}, not {first!r} like the others"
        if lead in s.shape[1:]:
            return None, f"tensor {s.name!r} uses {lead!r} past its first dim"
    return first, ""


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int
    max_queue_delay_s: float = 0.0
    #: Sizes (rows) at which a batch runs at once instead of waiting out the delay for more
    #: (Triton's ``dynamic_batching.preferred_batch_size``); ``max_batch_size`` always is one.
    preferred_batch_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, not {self.max_batch_size}")
        if self.max_queue_delay_s < 0:
            raise ValueError(f"max_queue_delay_s must be 0 or more, not {self.max_queue_delay_s}")
        bad = [n for n in self.preferred_batch_sizes if not 1 <= n <= self.max_batch_size]
        if bad:
            raise ValueError(f"preferred batch sizes must be 1 to max_batch_size ({self.max_batch_size}), not {bad}")


@dataclass
class _Item:
    inputs: Arrays
    requested: list[str] | None
    rows: int
    key: tuple[Any, ...]
    arrived: float
    #: A thread's future, or (a request gathered on an event loop) the loop's; same calls.
    future: concurrent.futures.Future[Arrays] | asyncio.Future[Arrays | None] = field(
        default_factory=concurrent.futures.Future
    )
    #: The request's parameters for the model (None: none); part of ``key``, so a batch shares them.
    parameters: Mapping[str, Any] | None = None


def writable(inputs: Arrays) -> Arrays:
    """``inputs`` with every read-only array replaced by a writable copy (the same dict
    when all are writable already): what a model may assume of its inputs on every
    server path, so one that edits an input in place works however the request came.
    Arrays decoded as views of request bytes (gRPC, binary REST) are read-only; the
    copy costs one memcpy of those inputs."""
    for a in inputs.values():
        if not a.flags.writeable:
            return {n: a if a.flags.writeable else a.copy() for n, a in inputs.items()}
    return inputs


def _key(inputs: Mapping[str, np.ndarray]) -> tuple[Any, ...]:
    """What must agree for requests to share a batch: names, dims past the first, dtypes
    (strings by kind only: numpy's '<U3' and '<U7' concatenate fine)."""
    return tuple(
        sorted((n, a.shape[1:], a.dtype.kind if a.dtype.kind in "UO" else a.dtype.str) for n, a in inputs.items())
    )


class Batcher:
    """Batches one model's requests; :meth:`submit` from any thread.

    :param run: runs one (possibly concatenated) set of inputs; the model's ``infer``.
    :param observe: called after every successful run with (queue seconds per
        request, the model's run seconds, rows, seconds preparing its inputs
        (concatenation, copies), seconds splitting its outputs back per request),
        for metrics and statistics.
    :param rows_promised: the spec binds the outputs' batch dim to the inputs'
        (our packages). False for packages the original Neuropod wrote: a
        merged run whose outputs lack the batch's rows is then run request by
        request, and merging stops for this model.
    """

    def __init__(
        self,
        name: str,
        run: Callable[[Arrays, list[str] | None], Arrays],
        policy: BatchPolicy,
        *,
        inflight: int = 1,
        observe: Callable[[list[float], float, int, float, float], None] | None = None,
        rows_promised: bool = True,
    ) -> None:
        self.name = name
        self._rows_promised = rows_promised
        #: False once this model's outputs were found not to follow the batch's rows: each request runs alone.
        self.merging = True
        self.policy = policy
        self._run = run
        self._observe = observe
        self._queue: collections.deque[_Item] = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._inflight = inflight
        #: Runs in flight: batches handed to the pool and requests run where they arrived (:meth:`begin_alone`).
        self._busy = 0
        #: Whether a request that finds the batcher idle may run where it arrived (:meth:`begin_alone`):
        #: only without a queue delay, when the batcher would take it alone at once anyway.
        self.runs_alone_at_once = policy.max_queue_delay_s == 0
        # On the event loop (see alone_on_loop): requests gathered in this iteration, flushed in the
        # next; whether one of this model's runs was on the loop in this iteration; which loop.
        self._gathered: collections.deque[_Item] = collections.deque()
        self._loop_ran = False
        #: Requests that arrived in this iteration after one of the model's runs held the loop,
        #: and their moving average over such iterations.
        self._arrivals = 0
        self._burst = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(inflight, thread_name_prefix=f"neuropod-batch-{name}")
        self._closed = False
        self._thread = threading.Thread(target=self._collect, name=f"neuropod-batcher-{name}", daemon=True)
        self._thread.start()

    def submit(
        self, inputs: Arrays, requested: list[str] | None, parameters: Mapping[str, Any] | None = None
    ) -> concurrent.futures.Future[Arrays]:
        """Queue one request whose inputs already passed the spec check.

        :param parameters: the request's parameters for the model: it shares a batch only
            with requests whose parameters are the same, and the run gets them.
        :returns: its future; cancelling it before its batch runs leaves it out of the run.
        """
        rows = next(iter(inputs.values())).shape[0]
        key = _key(inputs)
        if parameters is not None:
            key = (*key, ("parameters", tuple(sorted(parameters.items()))))
        future: concurrent.futures.Future[Arrays] = concurrent.futures.Future()
        item = _Item(inputs, requested, rows, key, time.perf_counter(), future, parameters)
        with self._cv:
            if self._closed:
                raise NeuropodError(f"model {self.name!r} is unloading")
            self._queue.append(item)
            self._cv.notify()
        return future

    def begin_alone(self) -> bool:
        """Take a run slot for one request to run where it arrived, when the batcher is idle
        (no queue delay, nothing waiting, a slot free): then the batcher would run that request
        alone at once, and running it on the caller's thread spares two thread hops. True:
        call :meth:`run_alone` next (it gives the slot back); False: :meth:`submit` it."""
        if not self.runs_alone_at_once:
            return False
        with self._cv:
            if self._queue or self._busy >= self._inflight or self._closed:
                return False
            self._busy += 1
            return True

    def run_alone(
        self, inputs: Arrays, requested: list[str] | None, parameters: Mapping[str, Any] | None = None
    ) -> Arrays:
        """Run one request on this thread, as a batch of one, after :meth:`begin_alone` returned
        True (it gives the slot back); recorded (``observe``) as that batch, its wait 0."""
        started = time.perf_counter()
        try:
            inputs = writable(inputs)
            ready = time.perf_counter()
            outputs = (
                self._run(inputs, requested) if parameters is None else self._run_with(inputs, requested, parameters)
            )
            ran = time.perf_counter()
        finally:
            self._done()
        if self._observe is not None:
            try:
                self._observe([0.0], ran - ready, next(iter(inputs.values())).shape[0], ready - started, 0.0)
            except Exception:  # metrics must never fail a request that ran
                log.exception("recording metrics of model %r failed", self.name)
        return outputs

    def _run_with(self, inputs: Arrays, requested: list[str] | None, parameters: Mapping[str, Any]) -> Arrays:
        return self._run(inputs, requested, parameters=parameters)  # type: ignore[call-arg]

    def _done(self) -> None:
        """A run in flight ended: a batch waiting for its slot may go."""
        with self._cv:
            self._busy -= 1
            if self._queue:
                self._cv.notify()

    # -- on an event loop -----------------------------------------------------------

    def alone_on_loop(self, loop: asyncio.AbstractEventLoop, run_s: float) -> bool | None:
        """How a fast model's request that arrives on ``loop`` runs (the caller checked that
        the model may run there; the batcher has no queue delay; ``run_s``: the model's recent
        run time). True: alone, now, on the loop (:meth:`run_alone` next; a slot is taken, as
        :meth:`begin_alone`), when the batcher is idle. False: it joins the requests gathered
        in this iteration (:meth:`gather`), which run as batches in the next: one of this
        model's runs held the loop in this iteration, so requests arrive faster than it
        runs, and lately enough of them (see :data:`GATHER_COST_S`) to make merging pay.
        None: a thread's batch is running or waiting (gRPC requests), so it queues there
        (:meth:`submit`)."""
        if loop is not self._loop:
            old = self._loop
            if old is not None and old.is_running() and (self._gathered or self._loop_ran):
                return None  # another loop gathers this model's requests (two servers on one engine)
            # What a loop that stopped left (asyncio.run ended) is awaited by nobody.
            self._loop, self._loop_ran, self._arrivals = loop, False, 0
            self._gathered.clear()
        if self._gathered:
            self._arrivals += 1
            return False
        if self._loop_ran:
            self._arrivals += 1
            burst = self._burst
            if burst * (run_s - GATHER_COST_S) > run_s:
                return False
        if not self.begin_alone():
            return None
        self._ran_on(loop)
        return True

    def gather(
        self, loop: asyncio.AbstractEventLoop, inputs: Arrays, requested: list[str] | None
    ) -> asyncio.Future[Arrays | None]:
        """Gather a request (spec-checked) to run with the others that arrive in this iteration
        of ``loop`` (after :meth:`alone_on_loop` returned False). Its future's result is its
        outputs, or None when it must be queued for a thread after all (:meth:`submit` it):
        a thread's batch was running or waiting when they were flushed, or the batcher closed."""
        rows = next(iter(inputs.values())).shape[0]
        future: asyncio.Future[Arrays | None] = loop.create_future()
        if not self._gathered:
            loop.call_soon(self._flush)
        self._gathered.append(_Item(inputs, requested, rows, _key(inputs), time.perf_counter(), future))
        return future

    def _ran_on(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._loop_ran:
            self._loop_ran = True
            loop.call_soon(self._iteration_over)

    def _iteration_over(self) -> None:
        self._loop_ran = False
        self._burst += _BURST_EWMA * (self._arrivals - self._burst)
        self._arrivals = 0

    def _flush(self) -> None:
        """Run the requests gathered in the loop's last iteration: as batches of the usual
        policy (oldest first, same key, up to max_batch_size rows), each on the loop."""
        gathered = self._gathered
        loop = self._loop
        while gathered:
            if loop is None or not self.begin_alone():
                while gathered:  # to the thread batcher's queue, after what waits there
                    item = gathered.popleft()
                    if not item.future.done():
                        item.future.set_result(None)  # type: ignore[arg-type]
                return
            self._ran_on(loop)
            batch = self._take(gathered[0].key, gathered)
            self._answer([item for item in batch if not item.future.done()])  # done: cancelled, its caller gave up

    def close(self) -> None:
        """Run what is queued, then stop (joins the threads)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
        self._pool.shutdown(wait=True)

    # -- the collector thread -------------------------------------------------

    def _collect(self) -> None:
        policy = self.policy
        while True:
            with self._cv:
                while not self._queue or self._busy >= self._inflight:
                    if self._closed and not self._queue:
                        return
                    self._cv.wait()
                first = self._queue[0]
                deadline = first.arrived + policy.max_queue_delay_s
                while not self._closed and self.merging and first.rows < policy.max_batch_size:
                    waiting = self._rows_waiting(first.key)
                    if waiting >= policy.max_batch_size or waiting in policy.preferred_batch_sizes:
                        break
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                batch = self._take(first.key, self._queue)
                self._busy += 1
            if self._inflight == 1:  # no other batch may start while it runs: no hop to the pool
                try:
                    self._run_batch(batch)
                except Exception:  # the batch is answered already; this thread must live on
                    log.exception("answering a batch of model %r failed", self.name)
                continue
            try:
                self._pool.submit(self._run_batch, batch)
            except RuntimeError as e:  # the pool shut down under us: only at interpreter exit
                self._fail(batch, NeuropodError(f"model {self.name!r} is shutting down ({e})"))
                self._done()

    def _rows_waiting(self, key: tuple[Any, ...]) -> int:
        return sum(item.rows for item in self._queue if item.key == key)

    def _take(self, key: tuple[Any, ...], queue: collections.deque[_Item]) -> list[_Item]:
        """The oldest request of ``queue``, and after it those of the same key that fit in one batch."""
        limit = self.policy.max_batch_size
        batch: list[_Item] = [queue.popleft()]
        rows = batch[0].rows
        if rows >= limit or not self.merging:
            return batch
        kept: list[_Item] = []
        while queue:
            item = queue.popleft()
            if item.key == key and rows + item.rows <= limit:
                batch.append(item)
                rows += item.rows
            else:
                kept.append(item)
                if item.key == key:  # the first that does not fit ends this batch (arrival order)
                    break
        queue.extendleft(reversed(kept))
        return batch

    # -- a pool thread --------------------------------------------------------

    def _run_batch(self, batch: list[_Item]) -> None:
        # RUNNING futures cannot be cancelled, so set_result below cannot race with a
        # cancel (InvalidStateError would leave the rest of the batch unanswered);
        # requests already cancelled (a client that gave up) are not run at all.
        self._answer([item for item in batch if item.future.set_running_or_notify_cancel()])  # type: ignore[union-attr]

    def _answer(self, batch: list[_Item]) -> None:
        """Run ``batch`` (its run slot taken; it may be empty), give the slot back, then answer
        each of its requests (the run's failure: all of them). The slot goes back first: a
        caller that sends its next request as soon as it has its answer finds the batcher idle."""
        failure: BaseException | None = None
        try:
            if not batch:
                return
            started = time.perf_counter()
            waited = [started - item.arrived for item in batch]
            try:
                results, times = self._run_merged(batch, started)
            except BaseException as e:  # noqa: BLE001 - every waiter gets the failure
                failure = e
        finally:
            self._done()
        if failure is not None:
            self._fail(batch, failure)
            return
        if self._observe is not None:
            try:
                prepared, ran, extracted = times
                self._observe(waited, ran, sum(i.rows for i in batch), prepared, extracted)
            except Exception:  # metrics must never leave a batch unanswered
                log.exception("recording metrics of model %r failed", self.name)
        for item, result in zip(batch, results):
            if item.future.done():
                continue
            if isinstance(result, BaseException):  # a request run alone after a merge that did not split
                item.future.set_exception(result)
            else:
                item.future.set_result(result)

    def _run_alone(self, item: _Item) -> Arrays:
        inputs = writable(item.inputs)
        if item.parameters is not None:
            return self._run_with(inputs, item.requested, item.parameters)
        return self._run(inputs, item.requested)

    def _run_merged(
        self, batch: list[_Item], started: float
    ) -> tuple[list[Arrays | BaseException], tuple[float, float, float]]:
        """Each request's outputs (or, for requests run one by one, its own failure), and the
        seconds (from ``started``) spent preparing the model's inputs, running it, and
        splitting its outputs back per request."""
        parameters = batch[0].parameters  # the same for the whole batch (part of its key)
        if len(batch) == 1:
            ready = time.perf_counter()
            outputs = self._run_alone(batch[0])
            return [outputs], (ready - started, time.perf_counter() - ready, 0.0)
        names = list(batch[0].inputs)
        merged = {n: np.concatenate([item.inputs[n] for item in batch]) for n in names}
        wanted: list[str] | None = []
        for item in batch:
            if item.requested is None:
                wanted = None
                break
            assert wanted is not None
            wanted.extend(n for n in item.requested if n not in wanted)
        ready = time.perf_counter()
        outputs = self._run(merged, wanted) if parameters is None else self._run_with(merged, wanted, parameters)
        ran = time.perf_counter()
        total = sum(item.rows for item in batch)
        for n, arr in outputs.items():
            if arr.ndim == 0 or arr.shape[0] != total:
                if not self._rows_promised:
                    return self._unmerge(batch, n, arr, total, started)
                raise BackendError(
                    f"model {self.name!r} returned output {n!r} with shape {list(arr.shape)} for a batch of "
                    f"{total} rows; its spec promises the batch dimension first"
                )
        # Each request's rows as views (slices: np.split costs about 10 µs a batch, a slice 0.1).
        results: list[Arrays | BaseException] = []
        end = 0
        for item in batch:
            begin, end = end, end + item.rows
            names_i = item.requested if item.requested is not None else outputs
            results.append({n: outputs[n][begin:end] for n in names_i})
        return results, (ready - started, ran - ready, time.perf_counter() - ran)

    def _unmerge(
        self, batch: list[_Item], name: str, arr: np.ndarray, total: int, started: float
    ) -> tuple[list[Arrays | BaseException], tuple[float, float, float]]:
        """Stop merging this model's requests and answer ``batch`` by running each alone."""
        if self.merging:
            self.merging = False
            log.warning(
                "model %r returned output %r with shape %s for a batch of %d rows: its package, written by the "
                "original Neuropod, does not bind outputs to the inputs' batch size, so its requests now run one "
                "at a time (no batching)", self.name, name, list(arr.shape), total,
            )  # fmt: skip
        ready = time.perf_counter()
        results: list[Arrays | BaseException] = []
        for item in batch:
            try:
                results.append(self._run_alone(item))
            except Exception as e:  # noqa: BLE001 - each request gets its own failure
                results.append(e)
        return results, (ready - started, time.perf_counter() - ready, 0.0)

    @staticmethod
    def _fail(batch: list[_Item], error: BaseException) -> None:
        for item in batch:
            if not item.future.done():
                item.future.set_exception(error)
