"""A stateful model's sequences in worker processes: :class:`WorkerSequences`.

A sequence's state lives in the worker that ran its first step, never in the caller's process:
each step sends the caller's inputs and the step (``"steps"``), the worker takes the sequence's
state from its own :class:`~neuropod.sequences.SequenceTable`, runs the model, keeps the new state
and answers with the caller's outputs only. ``seq.state()`` copies a state back, only when asked.

The caller's process keeps the books and nothing else: which sequences are live, which worker
holds each (a new sequence goes to the worker holding the fewest), when each was last used. So
the bound on live sequences holds across all the workers of a model, a sequence idle too long
expires with the same :class:`~neuropod.errors.SequenceError` as in-process, and the steps of one
sequence run one at a time. A sequence that ends, expires or is freed is freed in its worker too:
at once for ``end`` and ``seq.close()``, with that worker's next message otherwise.

A call with steps of sequences held by several workers (``infer_sequences``) is split by worker:
each worker runs its part, all at once, and the outputs are put back in the call's order. Such a
call is not all-or-nothing: when one part fails, the sequences of the other parts have taken
their step.

A worker that stops (killed, crashed, or timed out) takes its sequences' state with it: the call
that was running gets a :class:`~neuropod.errors.WorkerError` naming its sequences, and a later
step of any sequence the worker held (without ``sequence_start``) a ``SequenceError`` saying its
state was lost; the worker restarts (with ``restart=True``) as for any call, and new sequences
work.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from neuropod.errors import NeuropodError, WorkerError
from neuropod.sequences import NOT_FAST, SequenceStep, SequenceTable

if TYPE_CHECKING:
    from neuropod.ope.pool import WorkerPool
    from neuropod.ope.process import WorkerProcess

#: Why a sequence is not live after its worker stopped (``SequenceError``: "it <LOST>").
LOST = "lost its state when the worker process that held it stopped (it died, was killed or timed out)"


def declaration(config: Any) -> str | None:
    """A model config's state pairs and control inputs as the JSON its workers get (None: not stateful)."""
    if not config.state_spec and not config.sequence_controls:
        return None
    return json.dumps({
        "state_spec": [p.to_dict() for p in config.state_spec],
        "sequence_controls": [c.to_dict() for c in config.sequence_controls],
    })  # fmt: skip


class _Pin:
    """The worker that holds a sequence's state, and which of its processes (-1: none yet)."""

    __slots__ = ("generation", "worker")

    def __init__(self, worker: WorkerProcess):
        self.worker = worker
        self.generation = -1


class WorkerSequences(SequenceTable):
    """The books of a stateful model's sequences whose state its workers keep (see the module).

    It is the model's sequence table with no state in it: liveness, the idle limit and the bound
    on live sequences are the base class's, and each sequence is pinned to a worker.

    :param table: the model's own table (its state pairs, controls and batching are taken; its
        initial states are not kept).
    """

    def __init__(self, table: SequenceTable, pool: WorkerPool):
        super().__init__(table.model, table.pairs, {}, table.controls, table.control_specs, table.batching)
        self.pool = pool
        self._pins: dict[int | str, _Pin] = {}
        self._load: dict[WorkerProcess, int] = {w: 0 for w in pool.workers}
        #: Sequences forgotten here that a worker still holds: freed with its next message.
        self._ended: dict[WorkerProcess, list[int | str]] = {}
        #: A step's rows (the state's leading dim when calls stack sequences), as the model counts them.
        self._rows = table.pairs[0].shape[0] if table.batching and table.pairs else 1

    def _forget(self, sequence_id: int | str, why: str) -> None:
        # Called with the table's lock held, whenever a sequence stops being live.
        super()._forget(sequence_id, why)
        pin = self._pins.pop(sequence_id, None)
        if pin is not None:
            worker = pin.worker
            self._load[worker] -= 1
            if why != LOST and pin.generation == worker.generation and not worker.failed:
                self._ended.setdefault(worker, []).append(sequence_id)

    # -- steps -----------------------------------------------------------------------------------

    def run(
        self, inputs: dict[str, Any], requested: list[str] | None, steps: list[SequenceStep],
        parameters: Mapping[str, Any] | None,
    ) -> dict[str, Any]:  # fmt: skip
        """One step of each of ``steps``' sequences, run by the workers that hold them (the
        caller's outputs, unchecked)."""
        try:
            self.take(steps)  # liveness, limits, and one call at a time per sequence (no state here)
        except BaseException:
            if self._ended:  # sequences that expired just now: free them in their workers
                self._flush_all()
            raise
        settled: list[SequenceStep] = []
        try:
            groups = self._route(steps)
            if len(groups) == 1:
                worker = next(iter(groups))
                (result,) = self._run_parts([(worker, steps, inputs)], requested, parameters)
                if isinstance(result, BaseException):
                    raise result
                self._settle(steps, settled)
                outputs: dict[str, Any] = result
                return outputs
            return self._run_split(groups, inputs, requested, steps, parameters, settled)
        finally:
            if len(settled) < len(steps):
                self.abandon([s for s in steps if s not in settled])
            if self._ended:
                self._flush_all()

    def run_one(self, sequence_id: Any, end: bool, inputs: dict[str, Any], run: Any, handle: Any,
                with_device: bool) -> Any:  # fmt: skip
        """The common step (see :meth:`SequenceTable.run_one`): one live sequence that is not
        starting and not busy, whose worker is up: sent to that worker, the outputs back (``run``,
        ``handle`` and ``with_device`` are not used: the worker runs the model). :data:`NOT_FAST`
        without sending anything otherwise; :meth:`run` then says what is wrong, if anything."""
        cond = self._cond
        with cond:
            pin = self._pins.get(sequence_id)
            live = self._claim(sequence_id) if pin is not None else None
            if live is None or pin is None:
                return NOT_FAST
        worker, pool = pin.worker, self.pool
        outputs: Any = NOT_FAST
        error: BaseException | None = None
        worker.lock.acquire()
        try:
            if not pool.closed and not worker.failed and pin.generation == worker.generation \
                    and pool.forgotten.empty() and os.getpid() == pool.pid and worker.alive:  # fmt: skip
                ended: list[int | str] = []
                if self._ended:
                    with cond:
                        ended = self._ended.pop(worker, [])
                worker.post_steps(inputs, None, [(sequence_id, False, end, self._rows)], None, ended)
                outputs = worker.steps_answer()
        except BaseException as e:  # noqa: BLE001 - raised below, once the books are straight
            error = e
        finally:
            pool.give_back(worker)
            with cond:
                if outputs is not NOT_FAST and end:
                    if self._pins.pop(sequence_id, None) is not None:
                        self._load[worker] -= 1
                    self._forget(sequence_id, "ended")
                else:
                    if outputs is not NOT_FAST:
                        live.used = time.monotonic()
                    live.busy = False
                if self._waiting:
                    cond.notify_all()
        if error is not None:
            raise self._lost_with(worker, [SequenceStep(sequence_id)], error)
        return outputs

    def _route(self, steps: list[SequenceStep]) -> dict[WorkerProcess, list[int]]:
        """Each step's worker (by index in ``steps``): its sequence's, or for a new sequence the
        worker that holds the fewest (one that has stopped for good only when all have)."""
        groups: dict[WorkerProcess, list[int]] = {}
        restart = self.pool.restart
        with self._cond:
            for i, step in enumerate(steps):
                pin = self._pins.get(step.sequence_id)
                if pin is None:
                    worker = min(self.pool.workers, key=lambda w: (w.failed and not restart, self._load[w]))
                    pin = self._pins[step.sequence_id] = _Pin(worker)
                    self._load[worker] += 1
                groups.setdefault(pin.worker, []).append(i)
        return groups

    def _run_split(
        self, groups: dict[WorkerProcess, list[int]], inputs: dict[str, Any], requested: list[str] | None,
        steps: list[SequenceStep], parameters: Mapping[str, Any] | None, settled: list[SequenceStep],
    ) -> dict[str, Any]:  # fmt: skip
        """A call whose sequences several workers hold: each gets its steps' rows, and the outputs
        come back in the call's order."""
        starts = np.cumsum([0, *(s.rows for s in steps)])
        workers = sorted(groups, key=self.pool.workers.index)  # locks in one order: no deadlock
        rows = [np.concatenate([np.arange(starts[i], starts[i + 1]) for i in groups[w]]) for w in workers]
        parts = [
            (w, [steps[i] for i in groups[w]], {name: np.asarray(a)[r] for name, a in inputs.items()})
            for w, r in zip(workers, rows)
        ]
        results = self._run_parts(parts, requested, parameters)
        for (_, part_steps, _), result in zip(parts, results):
            if not isinstance(result, BaseException):
                self._settle(part_steps, settled)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        order = np.argsort(np.concatenate(rows), kind="stable")
        outputs: list[dict[str, Any]] = results
        return {name: np.concatenate([out[name] for out in outputs])[order] for name in outputs[0]}

    def _run_parts(
        self, parts: Sequence[tuple[WorkerProcess, list[SequenceStep], Mapping[str, Any]]], requested: list[str] | None,
        parameters: Mapping[str, Any] | None,
    ) -> list[Any]:  # fmt: skip
        """Send each part to its worker, then read the answers: each part's outputs, or the
        exception it raised (the workers run at once)."""
        results: list[Any] = [None] * len(parts)
        taken: list[WorkerProcess] = []
        posted: list[int] = []
        try:
            for k, (worker, steps, inputs) in enumerate(parts):
                try:
                    self.pool.take_worker(worker)
                    taken.append(worker)
                    self._check_pins(worker, steps)
                    with self._cond:
                        ended = self._ended.pop(worker, [])
                    tuples = [(s.sequence_id, s.start, s.end, s.rows) for s in steps]
                    worker.post_steps(inputs, requested, tuples, parameters, ended)
                    posted.append(k)
                except BaseException as e:  # noqa: BLE001 - raised by run() once every answer is read
                    results[k] = self._lost_with(worker, steps, e)
            for k in posted:
                worker, steps, _ = parts[k]
                try:
                    results[k] = worker.steps_answer()
                except BaseException as e:  # noqa: BLE001 - as above
                    results[k] = self._lost_with(worker, steps, e)
        finally:
            for worker in taken:
                self.pool.give_back(worker)
        return results

    def _check_pins(self, worker: WorkerProcess, steps: list[SequenceStep]) -> None:
        """With ``worker`` taken: a step's sequence whose state went with an earlier process of
        the worker is not live (a SequenceError saying so); a starting one is pinned to this one."""
        generation = worker.generation
        with self._cond:
            for step in steps:
                pin = self._pins.get(step.sequence_id)
                if pin is not None and step.start:
                    pin.generation = generation
                elif pin is None or pin.generation != generation:
                    self._lose_worker(worker)
                    self._forget(step.sequence_id, LOST)
                    raise self._not_live(step.sequence_id)

    def _lost_with(self, worker: WorkerProcess, steps: list[SequenceStep], error: BaseException) -> BaseException:
        """``error`` from a part of a call; when the worker stopped, its sequences are forgotten,
        and a WorkerError names this call's, whose state went with it."""
        if not worker.failed:
            return error
        with self._cond:
            self._lose_worker(worker)
        if not isinstance(error, WorkerError):
            return error
        mine = [s.sequence_id for s in steps]
        if not mine:
            return error
        names = ", ".join(map(repr, mine[:5])) + (f" and {len(mine) - 5} more" if len(mine) > 5 else "")
        new = WorkerError(
            f"{error}\nSequence(s) {names} of model {self.model!r} lost their state with that worker: start them "
            "again (sequence_start=True, or a new model.sequence())"
        )
        new.__cause__ = error
        return new

    def _lose_worker(self, worker: WorkerProcess) -> set[int | str]:
        """Forget the sequences whose state went with a process of ``worker`` that stopped (lock held)."""
        stale = {
            sequence_id for sequence_id, pin in self._pins.items()
            if pin.worker is worker and pin.generation >= 0 and (worker.failed or pin.generation != worker.generation)
        }  # fmt: skip
        for sequence_id in stale:
            self._forget(sequence_id, LOST)
        self._ended.pop(worker, None)
        if stale:
            self._cond.notify_all()  # a call waiting for one of them must see it gone
        return stale

    def _settle(self, steps: list[SequenceStep], settled: list[SequenceStep]) -> None:
        """Steps a worker ran: their sequences live on (or end: the worker freed those already)."""
        with self._cond:
            for step in steps:
                if step.end:
                    pin = self._pins.pop(step.sequence_id, None)
                    if pin is not None:
                        self._load[pin.worker] -= 1
        self.give(steps, [{} for _ in steps])
        settled.extend(steps)

    # -- ending, copying, counting ------------------------------------------------------------

    def sweep(self) -> int:
        """Free expired sequences now (see :meth:`SequenceTable.sweep`), in their workers too (a
        worker busy with a call frees them with its next message); how many were freed."""
        freed = super().sweep()
        if self._ended:
            self._flush_all()
        return freed

    def end_sequence(self, sequence_id: int | str) -> bool:
        """Free a sequence now, in its worker too (waiting for a call that runs it); whether it was live."""
        with self._cond:
            pin = self._pins.get(sequence_id)
        ended = self.end(sequence_id)
        if ended and pin is not None:
            self._flush(pin.worker, wait=True)
        return ended

    def copy_state(self, sequence_id: int | str) -> dict[str, np.ndarray]:
        """A copy of a live sequence's state, from its worker.

        :raises SequenceError: it is not live (or its worker stopped).
        """
        self.state(sequence_id)  # not live (never started, ended, expired): the base class says which
        with self._cond:
            pin = self._pins.get(sequence_id)
        if pin is None or pin.generation < 0:
            raise self._not_live(sequence_id)
        worker = pin.worker
        self.pool.take_worker(worker)
        try:
            self._check_pins(worker, [SequenceStep(sequence_id)])
            return worker.sequence_state(sequence_id)
        except NeuropodError as e:
            raise self._lost_with(worker, [SequenceStep(sequence_id)], e) from None
        finally:
            self.pool.give_back(worker)

    def worker_counts(self) -> list[int]:
        """How many sequences each worker holds the state of now."""
        counts = []
        for worker in self.pool.workers:
            self.pool.take_worker(worker)
            try:
                counts.append(worker.live_sequences([]))
            except NeuropodError as e:
                raise self._lost_with(worker, [], e) from None
            finally:
                self.pool.give_back(worker)
        return counts

    def _flush(self, worker: WorkerProcess, wait: bool) -> None:
        """Free in ``worker`` the sequences forgotten here (skipped when it is busy and not ``wait``:
        its next message frees them)."""
        with self._cond:
            ended = self._ended.pop(worker, None)
        if not ended or worker.failed:
            return
        try:
            taken = self.pool.take_worker(worker, wait)
        except NeuropodError:  # closed, or the worker stopped: the state went with it
            with self._cond:
                self._lose_worker(worker)  # (only if it stopped)
            return
        if taken is None:
            with self._cond:
                self._ended.setdefault(worker, [])[:0] = ended
            return
        try:
            worker.end_sequences(ended)
        except NeuropodError:
            with self._cond:
                self._lose_worker(worker)
        finally:
            self.pool.give_back(worker)

    def _flush_all(self) -> None:
        for worker in list(self._ended):
            self._flush(worker, wait=False)


__all__ = ["LOST", "WorkerSequences", "declaration"]
