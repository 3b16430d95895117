"""Sequence batching: one step of each of several sequences of a stateful model in one run.

A stateful model (its package declares ``state_spec`` or ``sequence_controls``) whose inputs,
outputs, states and controls all lead with the batch symbol (``model.sequence_batching``) can run
one step of many sequences in one call, :meth:`~neuropod.model.NeuropodModel.infer_sequences`:
the core stacks the sequences' states along the batch dimension, fills the control inputs per
row, runs the model once and keeps each sequence's new state. The :class:`SequenceBatcher` feeds
it the server's requests, as Triton's ``oldest`` sequence batcher does, in the manner of
continuous batching: sequences join and leave between runs.

Policy: the oldest waiting request whose sequence is not in a run opens a batch; the batch takes
the waiting requests after it (in arrival order) of other sequences that share its batch key
(input names, dims past the first and dtypes, requested outputs, parameters), one request per
sequence, up to ``max_batch_size`` sequences, waiting at most ``max_queue_delay`` after that
oldest request for more to come (unless a preferred batch size is reached first). A sequence is in at most one batch in flight: a request of a
sequence whose earlier request waits or runs waits for a later batch, so the steps of a sequence
run in the order they arrived. A request that cannot join a batch (its key differs) holds back
the later requests of its sequence too.

A failed run answers every request in it with the failure (the core keeps each sequence's state
as it was before the run; a sequence the run started is dropped). A
:class:`~neuropod.errors.SequenceError` of one of them (a sequence that is not live, or one more
than the bound on live sequences) is raised before anything runs: then each request of that batch
runs alone, so that only the requests at fault fail.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from neuropod.errors import NeuropodError, SequenceError, SpecError
from neuropod.sequences import SequenceStep
from neuropod_serving.server.batching import BatchPolicy, writable

Arrays = dict[str, np.ndarray]
#: Runs one step of each of several sequences: (stacked inputs, steps, requested outputs, parameters) -> outputs.
RunSteps = Callable[[Arrays, list[SequenceStep], list[str] | None, Mapping[str, Any] | None], Arrays]

log = logging.getLogger("neuropod_serving.server")


@dataclass(eq=False)  # compared by identity (its arrays have no one truth value)
class _Item:
    inputs: Arrays
    step: SequenceStep
    requested: list[str] | None
    parameters: Mapping[str, Any] | None
    key: tuple[Any, ...]
    rows: int
    arrived: float
    future: concurrent.futures.Future[Arrays] = field(default_factory=concurrent.futures.Future)


def _key(
    inputs: Mapping[str, np.ndarray], requested: list[str] | None, parameters: Mapping[str, Any] | None
) -> tuple[Any, ...]:
    """What must agree for requests to share a run: input names, dims past the first and dtypes
    (strings by kind), the outputs asked for, the parameters."""
    shapes = tuple(
        sorted((n, a.shape[1:], a.dtype.kind if a.dtype.kind in "UO" else a.dtype.str) for n, a in inputs.items())
    )
    wanted = None if requested is None else tuple(requested)
    given = None if not parameters else tuple(sorted((k, repr(v)) for k, v in parameters.items()))
    return (shapes, wanted, given)


class SequenceBatcher:
    """Batches one stateful model's sequence steps; :meth:`submit` from any thread.

    :param run: runs one step of each of several sequences (the model's ``infer_sequences``).
    :param policy: ``max_batch_size`` is the most sequences in one run; ``max_queue_delay_s``
        how long the oldest waiting request waits for more.
    :param inflight: runs at once (the model's OPE workers; 1 in process).
    :param rows: the rows of one sequence's step (its states' leading dim, normally 1).
    :param observe: called after every successful run with (queue seconds per request, the
        model's run seconds, rows, seconds stacking the inputs, seconds splitting the outputs),
        as :class:`~neuropod_serving.server.batching.Batcher`'s.
    """

    def __init__(
        self,
        name: str,
        run: RunSteps,
        policy: BatchPolicy,
        *,
        inflight: int = 1,
        observe: Callable[[list[float], float, int, float, float], None] | None = None,
        rows: int = 1,
    ) -> None:
        self.name = name
        self.rows = rows
        self.policy = policy
        self._run = run
        self._observe = observe
        self._inflight = inflight
        self._queue: collections.deque[_Item] = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        #: Runs in flight, and the sequences in them.
        self._busy = 0
        self._running: set[int | str] = set()
        self._closed = False
        #: The collector is waiting out a queue delay for a batch to fill: woken only once it may be full.
        self._filling = False
        #: The fewest waiting requests that may make a batch worth running before the delay is out.
        self._enough = min((*policy.preferred_batch_sizes, policy.max_batch_size))
        #: Whether a step that finds the batcher idle may run on its caller's thread (no queue delay).
        self._idle = policy.max_queue_delay_s == 0
        #: Sequences in the latest run. A step runs alone on its caller's thread only after a run of
        #: one: when runs hold several, steps come in numbers (each client sends its next step when
        #: its answer comes), and the first of them running alone would leave the others to wait
        #: for it, then run without it, halving the batches.
        self._last_run = 1
        self._pool = concurrent.futures.ThreadPoolExecutor(inflight, thread_name_prefix=f"neuropod-seqbatch-{name}")
        self._thread = threading.Thread(target=self._collect, name=f"neuropod-sequencer-{name}", daemon=True)
        self._thread.start()

    def submit(
        self, inputs: Arrays, step: SequenceStep, requested: list[str] | None,
        parameters: Mapping[str, Any] | None = None, *, here: bool = False,
    ) -> concurrent.futures.Future[Arrays]:  # fmt: skip
        """Queue one step of a sequence (its inputs already passed the spec check).

        :param here: a caller on a thread of its own (gRPC's): when the batcher is idle (no queue
            delay, nothing waiting, a run slot free), the step runs at once on this thread, as a
            batch of one: the collector would have taken it alone at once, and two thread hops
            are spared. The future it returns is then done.
        :returns: its future; cancelling it before its batch runs leaves it out of the run.
        :raises SpecError: its inputs do not hold one step's rows (:attr:`rows`).
        :raises NeuropodError: the batcher is closing (the model is being unloaded).
        """
        for name, array in inputs.items():
            rows = array.shape[0] if array.ndim else 0
            if rows != self.rows:
                raise SpecError(
                    f"model {self.name!r}: input {name!r} has {rows} rows, but one step of a sequence takes "
                    f"{self.rows} (its state's leading dim); send each sequence's steps as requests of their own"
                )
            break
        if step.rows != self.rows:
            step = replace(step, rows=self.rows)
        item = _Item(inputs, step, requested, parameters or None, _key(inputs, requested, parameters), self.rows,
                     time.perf_counter())  # fmt: skip
        with self._cv:
            if self._closed:
                raise NeuropodError(f"model {self.name!r} is unloading")
            alone = (
                here and self._idle and not self._queue and self._busy < self._inflight and self._last_run <= 1
                and step.sequence_id not in self._running
            )  # fmt: skip
            if alone:
                self._busy += 1
                self._running.add(step.sequence_id)
            else:
                self._queue.append(item)
                if not self._filling or len(self._queue) >= self._enough:
                    self._cv.notify()
        if alone:
            self._run_batch([item])
        return item.future

    def close(self) -> None:
        """Run what is queued, then stop (joins the threads)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        self._pool.shutdown(wait=True)

    @property
    def waiting(self) -> int:
        """Requests queued and not yet in a run."""
        return len(self._queue)

    # -- the collector thread -------------------------------------------------------------------

    def _collect(self) -> None:
        policy = self.policy
        while True:
            with self._cv:
                while True:
                    first = self._oldest() if self._busy < self._inflight else None
                    if first is not None:
                        break
                    if self._closed and not self._queue and not self._busy:
                        return
                    self._cv.wait()
                deadline = first.arrived + policy.max_queue_delay_s
                while not self._closed and policy.max_queue_delay_s > 0:
                    # Only a queue this long may hold a full (or preferred) batch: counting costs a pass over it.
                    if len(self._queue) >= self._enough and self._full(len(self._eligible(first))):
                        break
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._filling = True
                    self._cv.wait(left)
                    self._filling = False
                    if first.future.cancelled():
                        break
                if first.future.cancelled():  # its caller gave up while it waited: choose again
                    continue
                batch = self._eligible(first)
                taken = {id(item) for item in batch}
                self._queue = collections.deque(item for item in self._queue if id(item) not in taken)
                self._running.update(item.step.sequence_id for item in batch)
                self._busy += 1
            if self._inflight == 1:  # no other run may start while this one runs: no hop to the pool
                self._run_batch(batch)
                continue
            try:
                self._pool.submit(self._run_batch, batch)
            except RuntimeError as e:  # the pool shut down under us: only at interpreter exit
                self._finish(batch, None, NeuropodError(f"model {self.name!r} is shutting down ({e})"))

    def _full(self, sequences: int) -> bool:
        """Whether a batch of this many sequences runs without waiting out the delay (Triton's
        ``oldest.preferred_batch_size``, or ``max_batch_size``)."""
        return sequences >= self.policy.max_batch_size or sequences in self.policy.preferred_batch_sizes

    def _oldest(self) -> _Item | None:
        """The oldest waiting request whose sequence is in no run (requests given up are dropped)."""
        for item in list(self._queue):
            if item.future.cancelled():
                self._queue.remove(item)
                continue
            if item.step.sequence_id not in self._running:
                return item
        return None

    def _eligible(self, first: _Item) -> list[_Item]:
        """The batch ``first`` opens now: it and the later waiting requests of its key, one per
        sequence, in arrival order, none of a sequence in a run or with an earlier request left out."""
        limit = self.policy.max_batch_size
        batch = [first]
        held: set[int | str] = set(self._running)
        seen: set[int | str] = {first.step.sequence_id}
        started = False
        for item in self._queue:
            if item is first:
                started = True
                continue
            sequence_id = item.step.sequence_id
            if not started:  # older than first: its sequence is in a run, and so are its later steps
                held.add(sequence_id)
                continue
            if item.future.cancelled():  # its caller gave up: it will not run, and holds nothing back
                continue
            if sequence_id in held or sequence_id in seen or item.key != first.key:
                held.add(sequence_id)  # its later steps wait for it
                continue
            seen.add(sequence_id)
            batch.append(item)
            if len(batch) >= limit:
                break
        return batch

    # -- a run -------------------------------------------------------------------------------------

    def _run_batch(self, batch: list[_Item]) -> None:
        # Futures set running cannot be cancelled, so answering below cannot race a caller that
        # gives up; a request already given up is not run.
        live = [item for item in batch if item.future.set_running_or_notify_cancel()]
        self._last_run = len(live)
        results: list[Arrays | BaseException] = []
        times = (0.0, 0.0, 0.0)
        failure: BaseException | None = None
        started = time.perf_counter()
        try:
            if live:
                results, times = self._run_merged(live)
        except BaseException as e:  # noqa: BLE001 - every waiter gets the failure
            failure = e
        waited = [started - item.arrived for item in live]
        self._finish(batch, live, failure)
        if failure is not None or not live:
            return
        if self._observe is not None:
            try:
                prepared, ran, extracted = times
                self._observe(waited, ran, sum(i.rows for i in live), prepared, extracted)
            except Exception:  # metrics must never leave a batch unanswered
                log.exception("recording metrics of model %r failed", self.name)
        for item, result in zip(live, results):
            if isinstance(result, BaseException):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)

    def _finish(self, batch: list[_Item], live: list[_Item] | None, failure: BaseException | None) -> None:
        """The run of ``batch`` ended: its sequences may run again (the next batch may go), then,
        on ``failure``, each request still waiting gets it."""
        with self._cv:
            self._busy -= 1
            self._running.difference_update(item.step.sequence_id for item in batch)
            self._cv.notify_all()
        if failure is not None:
            for item in batch if live is None else live:
                if not item.future.done():
                    item.future.set_exception(failure)

    def _run_merged(self, batch: list[_Item]) -> tuple[list[Arrays | BaseException], tuple[float, float, float]]:
        """Each request's outputs (or, when a sequence error sent them to run one by one, its own
        failure), and the seconds spent stacking the inputs, running, and splitting the outputs."""
        started = time.perf_counter()
        first = batch[0]
        if len(batch) == 1:
            inputs = writable(first.inputs)
        else:
            inputs = {n: np.concatenate([item.inputs[n] for item in batch]) for n in first.inputs}
        steps = [item.step for item in batch]
        ready = time.perf_counter()
        try:
            outputs = self._run(inputs, steps, first.requested, first.parameters)
        except SequenceError:
            if len(batch) == 1:
                raise
            # Raised before any step ran (a sequence not live, the bound on live sequences): each alone.
            return self._one_by_one(batch), (ready - started, time.perf_counter() - ready, 0.0)
        ran = time.perf_counter()
        if len(batch) == 1:
            return [outputs], (ready - started, ran - ready, 0.0)
        results: list[Arrays | BaseException] = []
        end = 0
        for item in batch:  # each request's rows as views (slices cost about 0.1 µs)
            begin, end = end, end + item.rows
            results.append({n: a[begin:end] for n, a in outputs.items()})
        return results, (ready - started, ran - ready, time.perf_counter() - ran)

    def _one_by_one(self, batch: list[_Item]) -> list[Arrays | BaseException]:
        results: list[Arrays | BaseException] = []
        for item in batch:
            try:
                results.append(self._run(writable(item.inputs), [item.step], item.requested, item.parameters))
            except Exception as e:  # noqa: BLE001 - each request gets its own failure
                results.append(e)
        return results


@dataclass(frozen=True)
class SequenceLimits:
    """The server's bounds on each stateful model's sequences (a model's load config may set its own).

    :param max_idle_us: microseconds a sequence may sit idle before its state is freed (Triton's
        ``max_sequence_idle_microseconds``).
    :param max_sequences: sequences of one model live at once; one more is refused at once.
    """

    max_idle_us: int
    max_sequences: int

    def __post_init__(self) -> None:
        if self.max_idle_us < 1:
            raise ValueError(f"max_idle_us must be at least 1, not {self.max_idle_us}")
        if self.max_sequences < 1:
            raise ValueError(f"max_sequences must be at least 1, not {self.max_sequences}")


__all__ = ["SequenceBatcher", "SequenceLimits"]
