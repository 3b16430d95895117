"""Running a stateful model: the live sequences of one loaded model and their state
(:class:`SequenceTable`), the step of a sequence a call runs (:class:`SequenceStep`), and what
``model.sequence()`` returns (:class:`Sequence`).

A stateful model's package declares its state pairs and control inputs (:mod:`neuropod.statespec`).
A call names the sequence each of its rows belongs to; the table gives each step its sequence's
state (the initial state on a sequence's first step), the runtime fills the control inputs, the
model runs once for the whole call, and each sequence's new state is kept for its next step, or
dropped at its last. State stays where the model runs: in this process, or in the worker that
holds the sequence.

Sequences are independent of one another; the steps of one sequence run one at a time, in the
order their calls take the sequence (a call for a sequence that another call is running waits for
it). A sequence idle longer than the table's ``max_idle_s`` is freed; ``max_live`` bounds how many
are live at once.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from neuropod.errors import SequenceError, SequenceLimitError, SpecError
from neuropod.spec import DTYPES, TensorSpec
from neuropod.statespec import SequenceControl, StatePair

if TYPE_CHECKING:
    from neuropod.stateful import StatefulModel

#: What :meth:`SequenceTable.run_one` answers for a step it does not take.
NOT_FAST: Any = object()
#: Ids of sequences that ended or expired, remembered (this many) so that a late request is told which.
_REMEMBERED = 4096


class StateMismatchError(SpecError):
    """A stateful model's state output is missing, or does not fit its ``state_spec``."""


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's part of a call: its id (an int >= 1, or a non-empty str), whether this is its
    first step (``start``: a live sequence of that id is restarted) and its last (``end``: its state
    is freed after it), and how many leading rows of the call's inputs are its own (``rows``: 1
    for a sequence per row, as a server's requests are)."""

    sequence_id: int | str
    start: bool = False
    end: bool = False
    rows: int = 1


def check_sequence_id(value: Any) -> int | str:
    """A sequence id as a call gives it: an int in [1, 2**64) or a non-empty str.

    :raises SequenceError: anything else (0 and "" mean "no sequence" in Triton's protocol).
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        if 0 < int(value) < 1 << 64:
            return int(value)
        raise SequenceError(f"sequence id {int(value)} is out of range: a numeric id is an integer from 1 to 2**64-1")
    if isinstance(value, str):
        if value:
            return value
        raise SequenceError("sequence id '' is not one: a string id must not be empty")
    raise SequenceError(f"a sequence id is an int >= 1 or a non-empty str, not {type(value).__name__} {value!r:.60}")


def new_sequence_id() -> int:
    """An id for a sequence that its caller did not name: a random 64-bit number with the top bit
    set (so it never equals a small id a caller counts up from)."""
    return secrets.randbits(63) | 1 << 63


class _Live:
    """One live sequence: its state arrays by state input name."""

    __slots__ = ("busy", "state", "used")

    def __init__(self, state: dict[str, np.ndarray], used: float):
        self.state = state
        self.used = used
        self.busy = False


class SequenceTable:
    """The live sequences of one loaded model, and how a call's steps take and give back their state.

    :param model: the model's name, for messages.
    :param pairs: its state pairs; ``initial``: each state input's initial value (one sequence's).
    :param controls: its control inputs, with their specs (``control_specs``: input name to spec).
    :param batching: whether a call may hold more than one sequence (every input, output, state
        and control leads with the batch symbol).
    """

    def __init__(
        self, model: str, pairs: Seq[StatePair], initial: Mapping[str, np.ndarray], controls: Seq[SequenceControl],
        control_specs: Mapping[str, TensorSpec], batching: bool,
    ):  # fmt: skip
        self.model = model
        self.pairs = tuple(pairs)
        self.initial = dict(initial)
        self.controls = tuple(controls)
        self.control_specs = dict(control_specs)
        self.batching = batching
        #: Seconds a sequence may sit idle before it is freed; None: no limit.
        self.max_idle_s: float | None = None
        #: How many sequences may be live at once; None: no limit.
        self.max_live: int | None = None
        self._live: dict[int | str, _Live] = {}
        self._gone: OrderedDict[int | str, str] = OrderedDict()
        self._cond = threading.Condition()
        #: Threads waiting on ``_cond`` (for a busy sequence): only then does a step notify.
        self._waiting = 0
        self._swept = time.monotonic()
        # For run_one: each state's (input, output, numpy dtype, shape), and the controls other
        # than CORRID filled for a step that neither starts nor ends (copied for each step).
        self._fast_pairs = tuple((p.input_name, p.output_name, DTYPES[p.dtype], p.shape) for p in self.pairs)
        self._fast_ok = all(dtype is not None for _, _, dtype, _ in self._fast_pairs)
        middle = SequenceStep(1)
        self._middle_controls = tuple(
            (c.name, self._control(c, [middle])) for c in self.controls if c.kind != "CONTROL_SEQUENCE_CORRID"
        )
        # The same for a sequence's last step (END is 1).
        self._end_controls = tuple(
            (c.name, self._control(c, [SequenceStep(1, end=True)])) for c in self.controls
            if c.kind != "CONTROL_SEQUENCE_CORRID"
        )  # fmt: skip
        self._corrid = next((c for c in self.controls if c.kind == "CONTROL_SEQUENCE_CORRID"), None)
        corrid = self._corrid
        self._string_ids = corrid is not None and self.control_specs[corrid.name].dtype == "string"
        self._numeric_ids = corrid is not None and not self._string_ids
        #: The largest id a numeric CORRID control holds.
        self._id_max = (1 << 64) - 1
        if corrid is not None and self._numeric_ids:
            self._id_max = int(np.iinfo(DTYPES[self.control_specs[corrid.name].dtype]).max)

    def configure(self, *, max_idle_s: float | None = None, max_live: int | None = None) -> None:
        """Set the idle timeout (seconds, None: none) and the bound on live sequences (None: none)."""
        if max_idle_s is not None and not (isinstance(max_idle_s, (int, float)) and max_idle_s > 0):
            raise ValueError(f"max_idle_s must be a number of seconds > 0 or None, not {max_idle_s!r}")
        if max_live is not None and not (
            isinstance(max_live, int) and not isinstance(max_live, bool) and max_live >= 1
        ):
            raise ValueError(f"max_live must be an int >= 1 or None, not {max_live!r}")
        with self._cond:
            self.max_idle_s = max_idle_s
            self.max_live = max_live

    @property
    def live(self) -> int:
        """How many sequences are live now (expired ones not yet swept count until the next call)."""
        return len(self._live)

    def ids(self) -> list[int | str]:
        """The ids of the live sequences."""
        with self._cond:
            return list(self._live)

    # -- a call's steps ------------------------------------------------------------------------

    def take(self, steps: Seq[SequenceStep]) -> list[dict[str, np.ndarray]]:
        """Take the state of each step's sequence for a run (waiting while another call runs one
        of them): a sequence's state, or its initial state on ``start`` (which starts, or
        restarts, it). Give it back with :meth:`give` or :meth:`abandon`.

        :raises SequenceError: a step without ``start`` for a sequence that is not live (never
            started, ended, or expired), naming it; an id of the wrong kind for the model.
        :raises SequenceLimitError: starting a sequence would pass :attr:`max_live`.
        """
        for step in steps:
            self._check_kind(step.sequence_id)
        now = time.monotonic()
        with self._cond:
            self._sweep(now)
            while any((live := self._live.get(s.sequence_id)) is not None and live.busy for s in steps):
                self._wait()
            now = time.monotonic()
            taken: list[dict[str, np.ndarray]] = []
            starting = [s.sequence_id for s in steps if s.start and s.sequence_id not in self._live]
            for step in steps:
                live = self._live.get(step.sequence_id)
                if not step.start and (live is None or self._expired(live, now)):
                    if live is not None:
                        self._forget(step.sequence_id, "expired")
                    raise self._not_live(step.sequence_id)
            if starting and self.max_live is not None and len(self._live) + len(starting) > self.max_live:
                raise SequenceLimitError(
                    f"model {self.model!r} has {len(self._live)} live sequences, its most ({self.max_live}); "
                    f"sequence {starting[0]!r} cannot start until one ends or expires"
                )
            for step in steps:
                live = self._live.get(step.sequence_id)
                if step.start or live is None:
                    # Copies: a model may write to its inputs, and the initial state is shared.
                    live = self._live[step.sequence_id] = _Live({k: v.copy() for k, v in self.initial.items()}, now)
                    self._gone.pop(step.sequence_id, None)
                live.busy = True
                taken.append(live.state)
            return taken

    def give(self, steps: Seq[SequenceStep], states: Seq[dict[str, np.ndarray]]) -> None:
        """Keep each step's new state (and free the sequences that ended)."""
        now = time.monotonic()
        with self._cond:
            for step, state in zip(steps, states):
                live = self._live.get(step.sequence_id)
                if live is None:
                    continue
                if step.end:
                    self._forget(step.sequence_id, "ended")
                else:
                    live.state = state
                    live.used = now
                    live.busy = False
            self._cond.notify_all()

    def abandon(self, steps: Seq[SequenceStep], started: bool = True) -> None:
        """A run failed: its sequences keep the state they had before it (a sequence it started
        is dropped; the next step must start it again)."""
        now = time.monotonic()
        with self._cond:
            for step in steps:
                live = self._live.get(step.sequence_id)
                if live is None:
                    continue
                if step.start and started:
                    self._forget(step.sequence_id, "failed on its first step")
                else:
                    live.used = now
                    live.busy = False
            self._cond.notify_all()

    def touch(self, sequence_id: int | str) -> None:
        """A step of a live sequence has arrived (a server queues it before it runs): its idle time
        starts again now, so that time spent in a queue does not expire it."""
        live = self._live.get(sequence_id)
        if live is None or self.max_idle_s is None:
            return
        now = time.monotonic()
        with self._cond:
            if not live.busy and now - live.used <= self.max_idle_s:
                live.used = now

    def end(self, sequence_id: int | str) -> bool:
        """Free a sequence's state now (waiting for a call that runs it); whether it was live."""
        with self._cond:
            while (live := self._live.get(sequence_id)) is not None and live.busy:
                self._wait()
            if live is None:
                return False
            self._forget(sequence_id, "ended")
            return True

    def state(self, sequence_id: int | str) -> dict[str, np.ndarray]:
        """A copy of a live sequence's state, by state input name.

        :raises SequenceError: it is not live.
        """
        with self._cond:
            live = self._live.get(sequence_id)
            if live is None or self._expired(live, time.monotonic()):
                raise self._not_live(sequence_id)
            return {k: v.copy() for k, v in live.state.items()}

    def clear(self) -> None:
        """Free every sequence (the model is closing)."""
        with self._cond:
            for sequence_id in list(self._live):
                self._forget(sequence_id, "ended when the model closed")
            self._cond.notify_all()

    def _wait(self) -> None:
        self._waiting += 1
        try:
            self._cond.wait()
        finally:
            self._waiting -= 1

    def _claim(self, sequence_id: Any) -> _Live | None:
        """With the lock held, for :meth:`run_one`: a live sequence that no call runs and that is not
        near its idle limit, marked busy; None for any other (the general path takes it)."""
        live = self._live.get(sequence_id)
        if live is None or live.busy:
            return None
        idle = self.max_idle_s
        if idle is not None:
            now = time.monotonic()
            if now - live.used > idle or now - self._swept >= idle / 2:
                return None
        live.busy = True
        return live

    def run_one(self, sequence_id: Any, end: bool, inputs: dict[str, Any], run: Callable[..., Any], handle: Any,
                with_device: bool) -> Any:  # fmt: skip
        """The common step, in as few steps as it takes: one live sequence that is not starting
        and not busy (no other call runs it), numeric states. ``run(handle, full_inputs, None[,
        None])`` runs the model (the fourth argument when ``with_device``); returns the caller's outputs (unchecked), or :data:`NOT_FAST` without running
        anything when the step is not such a one (the caller then takes :meth:`take` and the rest,
        which say what is wrong, if anything).
        """
        cond = self._cond
        with cond:
            live = self._claim(sequence_id) if self._fast_ok else None
            if live is None:
                return NOT_FAST
        done = False
        try:
            full = inputs.copy()
            full.update(live.state)
            for name, array in self._end_controls if end else self._middle_controls:
                full[name] = array.copy()
            if self._corrid is not None:
                full[self._corrid.name] = self._control(self._corrid, [SequenceStep(sequence_id)])
            outputs = run(handle, full, None, None) if with_device else run(handle, full, None)
            if type(outputs) is not dict:
                if not isinstance(outputs, Mapping):
                    return outputs  # not a dict: the caller's checks say so (the state stays as it was)
                outputs = dict(outputs)
            state = {}
            for input_name, output_name, dtype, shape in self._fast_pairs:
                array = outputs.pop(output_name, None)
                if type(array) is not np.ndarray or array.dtype != dtype or array.shape != shape:
                    pair = next(p for p in self.pairs if p.input_name == input_name)
                    array = self._check_state(pair, array, pair.shape, [SequenceStep(sequence_id)])
                state[input_name] = array
            done = True
        finally:
            with cond:
                if not done:
                    live.busy = False
                elif end:
                    self._forget(sequence_id, "ended")
                else:
                    live.state = state
                    live.used = time.monotonic()
                    live.busy = False
                if self._waiting:
                    cond.notify_all()
        return outputs

    # -- the model's inputs and outputs ----------------------------------------------------------

    def inputs(
        self, user: Mapping[str, Any], steps: Seq[SequenceStep], states: Seq[Mapping[str, np.ndarray]]
    ) -> dict[str, Any]:
        """The model's full inputs for a call: the caller's, each state stacked over the steps
        (one sequence: its state as it is), and each control filled per row."""
        full = dict(user)
        if len(steps) == 1:
            for pair in self.pairs:
                full[pair.input_name] = states[0][pair.input_name]
        else:
            for pair in self.pairs:
                full[pair.input_name] = np.concatenate([s[pair.input_name] for s in states], axis=0)
        for control in self.controls:
            full[control.name] = self._control(control, steps)
        return full

    def outputs(
        self, outputs: dict[str, Any], steps: Seq[SequenceStep]
    ) -> tuple[dict[str, Any], list[dict[str, np.ndarray]]]:
        """Split the model's outputs into the caller's and each step's new state.

        :raises SpecError: a state output the model did not return, or of the wrong dtype or shape,
            naming the state.
        """
        per_step: list[dict[str, np.ndarray]] = [{} for _ in steps]
        for pair in self.pairs:
            array = outputs.pop(pair.output_name, None)
            wanted = pair.shape if len(steps) == 1 else (len(steps) * pair.shape[0], *pair.shape[1:])
            array = self._check_state(pair, array, wanted, steps)
            if len(steps) == 1:
                per_step[0][pair.input_name] = array
            else:
                size = pair.shape[0]
                for i in range(len(steps)):
                    per_step[i][pair.input_name] = array[i * size : (i + 1) * size].copy()
        return outputs, per_step

    def _check_state(self, pair: StatePair, array: Any, wanted: tuple[int, ...], steps: Seq[SequenceStep]) -> Any:
        ids = ", ".join(repr(s.sequence_id) for s in steps[:3]) + (", ..." if len(steps) > 3 else "")
        if array is None:
            raise StateMismatchError(
                f"model {self.model!r} returned no state output {pair.output_name!r} (state of input "
                f"{pair.input_name!r}) for sequence(s) {ids}; the state stays as it was"
            )
        if not isinstance(array, np.ndarray):
            array = np.asarray(array)
        want_dtype = DTYPES[pair.dtype]
        ok_dtype = array.dtype.kind in "UO" if want_dtype is None else array.dtype == want_dtype
        if not ok_dtype or array.shape != tuple(wanted):
            raise StateMismatchError(
                f"model {self.model!r}: state output {pair.output_name!r} is {array.dtype} {list(array.shape)}, but "
                f"its state_spec says {pair.dtype} {list(wanted)} (sequence(s) {ids}); the state stays as it was"
            )
        return array

    def _control(self, control: SequenceControl, steps: Seq[SequenceStep]) -> Any:
        spec = self.control_specs[control.name]
        kind = control.kind
        if kind == "CONTROL_SEQUENCE_CORRID":
            values: list[Any] = [s.sequence_id for s in steps]
        elif kind == "CONTROL_SEQUENCE_START":
            values = [1 if s.start else 0 for s in steps]
        elif kind == "CONTROL_SEQUENCE_END":
            values = [1 if s.end else 0 for s in steps]
        else:
            values = [1] * len(steps)
        rows = [v for s, v in zip(steps, values) for _ in range(s.rows)] if self.batching else values[:1]
        dtype = DTYPES[spec.dtype]
        column = np.array([str(v) for v in rows], dtype=object) if dtype is None else np.array(rows, dtype=dtype)
        if not spec.shape:
            return column.reshape(())
        rest = tuple(d if isinstance(d, int) else 1 for d in spec.shape[1:])
        if not self.batching and isinstance(spec.shape[0], int):
            return np.broadcast_to(column.reshape((1,) * len(spec.shape)), (spec.shape[0], *rest)).copy()
        return np.ascontiguousarray(
            np.broadcast_to(column.reshape((len(rows),) + (1,) * len(rest)), (len(rows), *rest))
        )

    # -- bookkeeping -----------------------------------------------------------------------------

    def _check_kind(self, sequence_id: int | str) -> None:
        if self._string_ids and not isinstance(sequence_id, str):
            raise SequenceError(
                f"model {self.model!r} takes string sequence ids (its CORRID control is a string input), not {sequence_id!r}"
            )
        if self._numeric_ids and not isinstance(sequence_id, int):
            raise SequenceError(
                f"model {self.model!r} takes numeric sequence ids (its CORRID control is a number), not {sequence_id!r}"
            )
        if self._numeric_ids and isinstance(sequence_id, int) and sequence_id > self._id_max:
            raise SequenceError(
                f"sequence id {sequence_id} is too large for model {self.model!r}: its CORRID control holds ids up to "
                f"{self._id_max}"
            )

    def new_id(self) -> int | str:
        """An id for a sequence its caller did not name, of the kind the model takes: a str for a
        string CORRID control, a number the control holds for a numeric one."""
        if self._string_ids:
            return f"sequence-{new_sequence_id():x}"
        if self._id_max < (1 << 64) - 1:
            return secrets.randbelow(self._id_max) + 1
        return new_sequence_id()

    def _expired(self, live: _Live, now: float) -> bool:
        return self.max_idle_s is not None and not live.busy and now - live.used > self.max_idle_s

    def _sweep(self, now: float) -> None:
        """Free the sequences idle longer than :attr:`max_idle_s` (at most twice a timeout)."""
        idle = self.max_idle_s
        if idle is None or now - self._swept < idle / 2:
            return
        self._swept = now
        for sequence_id, live in list(self._live.items()):
            if self._expired(live, now):
                self._forget(sequence_id, "expired")

    def sweep(self) -> int:
        """Free expired sequences now (a server calls this from time to time); how many were freed."""
        with self._cond:
            before = len(self._live)
            self._swept = 0.0
            self._sweep(time.monotonic())
            return before - len(self._live)

    def _forget(self, sequence_id: int | str, why: str) -> None:
        self._live.pop(sequence_id, None)
        self._gone[sequence_id] = why
        self._gone.move_to_end(sequence_id)
        while len(self._gone) > _REMEMBERED:
            self._gone.popitem(last=False)

    def _not_live(self, sequence_id: int | str) -> SequenceError:
        why = self._gone.get(sequence_id)
        idle = "no idle limit" if self.max_idle_s is None else f"its idle limit is {self.max_idle_s:g} s"
        if why == "expired":
            what = f"it sat idle longer than the model's idle limit ({self.max_idle_s:g} s) and was freed"
        elif why is not None:
            what = f"it {why}"
        else:
            what = f"it was never started (or ended or expired long ago; {idle})"
        return SequenceError(
            f"sequence {sequence_id!r} is not live on model {self.model!r}: {what}. A sequence's first request "
            "sets sequence_start"
        )


class Sequence:
    """One sequence of a stateful model: ``with model.sequence() as seq: seq.infer(inputs)``.

    The first :meth:`infer` starts it (``sequence_start``), ``infer(..., end=True)`` runs its last
    step, and :meth:`close` (leaving the ``with`` block) frees its state if it has not ended.
    """

    def __init__(self, model: StatefulModel, sequence_id: int | str | None = None):
        self.model = model
        #: The sequence's id (a random one when none was given).
        self.id: int | str = new_sequence_id() if sequence_id is None else check_sequence_id(sequence_id)
        self._started = False
        self._ended = False

    @property
    def started(self) -> bool:
        return self._started

    @property
    def ended(self) -> bool:
        return self._ended

    def infer(
        self, inputs: Mapping[str, Any], requested_outputs: Seq[str] | None = None, *,
        parameters: Mapping[str, Any] | None = None, end: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """Run the sequence's next step: the first call starts it; ``end=True`` makes this its last.

        :raises SequenceError: the sequence ended (or expired); start a new one.
        """
        if self._ended:
            raise SequenceError(f"sequence {self.id!r} of model {self.model.name!r} has ended; start a new one")
        start = not self._started
        outputs = self.model.infer(
            inputs, requested_outputs, parameters=parameters, sequence_id=self.id, sequence_start=start,
            sequence_end=bool(end),
        )  # fmt: skip
        self._started = True
        if end:
            self._ended = True
        return outputs

    def state(self) -> dict[str, np.ndarray]:
        """A copy of the sequence's state now, by state input name (the initial state before its
        first step). For a model in a worker, this copies it from there."""
        if not self._started:
            return {p.input_name: np.array(a) for p, a in zip(self.model.state_spec, self.model._initial_states())}
        if self._ended:
            raise SequenceError(f"sequence {self.id!r} of model {self.model.name!r} has ended; it has no state")
        return self.model._sequence_state(self.id)

    def close(self) -> None:
        """End the sequence: free its state where the model runs (no step runs)."""
        if self._started and not self._ended:
            self._ended = True
            self.model._end_sequence(self.id)
        self._ended = True

    def __enter__(self) -> Sequence:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Any]:  # not an iterable: a clear error instead of Python's
        raise TypeError("a Sequence is not iterable; call seq.infer(inputs) for each step")

    def __repr__(self) -> str:
        state = "ended" if self._ended else "live" if self._started else "not started"
        return f"<Sequence {self.id!r} of {self.model.name!r}, {state}>"


__all__ = [
    "Sequence",
    "SequenceStep",
    "NOT_FAST",
    "SequenceTable",
    "StateMismatchError",
    "check_sequence_id",
    "new_sequence_id",
]
