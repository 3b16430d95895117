"""The methods of a loaded model (:class:`~neuropod.model.NeuropodModel`) that run a stateful
model in sequences: :class:`StatefulModel`, its base. How sequences and their state are kept is
:mod:`neuropod.sequences`'; what a package declares is :mod:`neuropod.statespec`'.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from neuropod._args import check_flag, check_parameters
from neuropod.errors import BackendError, NeuropodError, PackageError, SequenceError
from neuropod.package import Package, parse_config
from neuropod.sequences import Sequence as ModelSequence
from neuropod.sequences import SequenceStep, SequenceTable, check_sequence_id
from neuropod.spec import SpecValidator, TensorSpec
from neuropod.statespec import SequenceControl, StatePair, batch_symbol, initial_state, why_not_batched

if TYPE_CHECKING:
    from neuropod.backend import Backend


def check_steps(steps: Iterable[SequenceStep], model_name: str) -> list[SequenceStep]:
    """The steps of a call of several sequences, checked: SequenceStep objects with valid ids,
    each sequence once.

    :raises TypeError: not a non-empty list of SequenceStep.
    :raises SequenceError: an id that is not one, or a sequence twice.
    """
    steps = list(steps)
    if not steps or not all(isinstance(s, SequenceStep) for s in steps):
        raise TypeError("steps must be a non-empty list of neuropod.sequences.SequenceStep")
    ids = [check_sequence_id(s.sequence_id) for s in steps]
    if len(set(ids)) != len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise SequenceError(f"sequence {twice!r} appears more than once in one call of model {model_name!r}")
    return steps


def check_rows(model_name: str, inputs: Mapping[str, Any], steps: Sequence[SequenceStep]) -> None:
    """Every input of a call of several sequences' steps holds their rows (``step.rows`` each).

    :raises SequenceError: one does not, naming it.
    """
    rows = sum(s.rows for s in steps)
    for name, array in inputs.items():
        have = array.shape[0] if getattr(array, "ndim", 0) else 0
        if getattr(array, "ndim", 0) == 0 or have != rows:
            raise SequenceError(
                f"model {model_name!r}: input {name!r} has {have} rows, but the call's {len(steps)} sequence step(s) "
                f"take {rows}, one per sequence"
            )


def run_steps(
    table: SequenceTable, inputs: Mapping[str, Any], requested: list[str] | None, steps: Sequence[SequenceStep],
    call: Callable[[dict[str, Any], list[str] | None], Any], backend_id: str,
) -> dict[str, Any]:  # fmt: skip
    """Run a call of ``steps`` where the state is kept (a model in this process, or a worker): take
    the sequences' state from ``table``, fill the controls, ``call(full_inputs, outputs_wanted)``,
    split the state outputs off and keep them (or, when anything fails, leave each sequence's state
    as it was); the caller's outputs, unchecked."""
    states = table.take(steps)
    done = False
    try:
        full = table.inputs(inputs, steps, states)
        wanted = None if requested is None else [*requested, *(p.output_name for p in table.pairs)]
        outputs = call(full, wanted)
        if not isinstance(outputs, Mapping):
            raise BackendError(
                f"Backend {backend_id} returned {type(outputs).__name__} for model {table.model!r}, "
                "not a dict of output name to numpy array"
            )
        mine, new_states = table.outputs(dict(outputs), steps)
        table.give(steps, new_states)
        done = True
        return mine
    finally:
        if not done:
            table.abandon(steps)


def build_table(model_name: str, config: Any, root: Any, input_spec: Iterable[TensorSpec],
                output_spec: Iterable[TensorSpec]) -> SequenceTable | None:  # fmt: skip
    """The :class:`SequenceTable` of a package's config (None when it declares no state or controls).

    :param root: the package's root directory, where initial-state files are.
    :raises NeuropodError: an initial-state file that is missing or does not fit its state.
    """
    pairs: tuple[StatePair, ...] = config.state_spec
    controls: tuple[SequenceControl, ...] = config.sequence_controls
    if not pairs and not controls:
        return None
    inputs = {s.name: s for s in input_spec}
    outputs = {s.name: s for s in output_spec}
    initial = {p.input_name: initial_state(p, root, model_name) for p in pairs}
    return SequenceTable(model_name, pairs, initial, controls, {c.name: inputs[c.name] for c in controls},
                         batch_symbol(inputs, outputs, pairs) is not None)  # fmt: skip


def with_sequences(package: Package, sequences: Any, *, given: str = "given at load") -> Package:
    """``package`` as a stateful model: its config's ``state_spec`` and ``sequence_controls``
    replaced by those of ``sequences`` (a mapping with either or both keys, or its JSON text), checked
    against its specs as a package's own are (``load_neuropod(..., sequences=...)``, and a
    stateful model's worker, which gets them from its client).

    :param given: where they came from, for messages.

    :raises PackageError: they do not fit the model's specs, naming what is wrong.
    """
    if isinstance(sequences, str):
        try:
            sequences = json.loads(sequences)
        except ValueError as e:
            raise PackageError(f"sequences: not JSON ({e})") from None
    if not isinstance(sequences, Mapping) or not set(sequences) <= {"state_spec", "sequence_controls"}:
        raise PackageError(
            f"sequences must be a mapping with 'state_spec' and/or 'sequence_controls', not {sequences!r:.100}"
        )
    config = package.config
    data = config.to_dict()
    data.pop("state_spec", None)
    data.pop("sequence_controls", None)
    data.update({k: v for k, v in sequences.items() if v is not None})
    amended = parse_config(data, f"model {config.name!r} with the sequences {given}")
    return replace(package, config=amended)


def caller_specs(package: Package) -> tuple[SequenceTable | None, tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """A package's sequence table (None when it is not stateful) and its inputs and outputs as
    callers see them: without the state inputs and outputs and the control inputs, which are the
    runtime's."""
    config = package.config
    table = build_table(package.name, config, package.root, config.input_spec, config.output_spec)
    hidden = {p.input_name for p in config.state_spec} | {c.name for c in config.sequence_controls}
    hidden_out = {p.output_name for p in config.state_spec}
    inputs = tuple(s for s in config.input_spec if s.name not in hidden)
    outputs = tuple(s for s in config.output_spec if s.name not in hidden_out)
    return table, inputs, outputs


class StatefulModel:
    """What :class:`~neuropod.model.NeuropodModel` does for a stateful model (see
    :attr:`stateful`); its other models only answer that they are not."""

    if TYPE_CHECKING:
        package: Package
        backend: Backend

        @property
        def name(self) -> str: ...

        _sequences: SequenceTable | None
        _inputs: tuple[TensorSpec, ...]
        _validator: SpecValidator
        _closed: bool
        _handle: Any
        _infer: Callable[..., Any]
        _infer_with_parameters: Callable[[Any, Any, Any, Any], Any] | None
        _run_is_the_hook: bool

        def _run_failed(self, e: Exception) -> BackendError: ...
        def _checked_outputs(
            self, outputs: Any, bindings: Any, requested: Any, output_device: Any
        ) -> dict[str, Any]: ...
        def _output_device(self, output_device: str) -> str | None: ...
        def _fast_call_unchecked(self) -> tuple[Any, ...]: ...
        def infer(
            self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None = None, *,
            output_device: str | None = None, parameters: Mapping[str, Any] | None = None,
            sequence_id: int | str | None = None, sequence_start: bool = False, sequence_end: bool = False,
        ) -> dict[str, Any]: ...  # fmt: skip

    def _fast_step_call(self) -> tuple[Any, ...] | None:
        """What a live sequence's common step needs, looked up once (see ``infer``): the compiled
        input check, the table, the hook and how to call it, the handle, the compiled output check,
        and (batch symbol, rows) to check for a batch-leading model; None: no such path."""
        table = self._sequences
        if table is None or not self._run_is_the_hook or self._validator._fast_inputs is None:
            return None
        fast = self._fast_call_unchecked()
        # A batch-leading model's step has the state's rows (normally 1): (symbol, rows) to check.
        lead = self._inputs[0].shape[0] if table.batching and self._inputs and self._inputs[0].shape else None
        rows = (lead, table.pairs[0].shape[0] if table.pairs else 1) if isinstance(lead, str) else None
        return (fast[0], table, fast[1], fast[2], fast[3], fast[4], rows)

    @property
    def stateful(self) -> bool:
        """Whether the model runs in sequences: it carries state from one request of a sequence to
        the next (:attr:`state_spec`), or takes control inputs (:attr:`sequence_controls`). Run it
        with :meth:`sequence`, or :meth:`infer` with a ``sequence_id``."""
        return self._sequences is not None

    @property
    def state_spec(self) -> tuple[StatePair, ...]:
        """The state pairs the runtime carries between the steps of a sequence (empty for none)."""
        return self.package.config.state_spec

    @property
    def sequence_controls(self) -> tuple[SequenceControl, ...]:
        """The inputs the runtime fills with a sequence's flags and id (empty for none)."""
        return self.package.config.sequence_controls

    @property
    def sequence_batching(self) -> bool:
        """Whether one call (:meth:`infer_sequences`) can run many sequences at once: every input,
        output, state and control leads with the batch symbol (see :attr:`sequence_batching_problem`)."""
        return self._sequences is not None and self._sequences.batching

    @property
    def sequence_batching_problem(self) -> str | None:
        """Why a stateful model's calls cannot run many sequences at once (None: they can, or the
        model is not stateful)."""
        if self._sequences is None or self._sequences.batching:
            return None
        config = self.package.config
        return why_not_batched(
            {s.name: s for s in config.input_spec}, {s.name: s for s in config.output_spec}, config.state_spec
        )

    @property
    def live_sequences(self) -> int:
        """How many sequences hold state now."""
        return 0 if self._sequences is None else self._sequences.live

    def sweep_sequences(self) -> int:
        """Free the state of sequences idle past their limit now (a server calls this from time to
        time, so that memory comes back without traffic); how many were freed."""
        return 0 if self._sequences is None else self._sequences.sweep()

    def touch_sequence(self, sequence_id: int | str) -> None:
        """Say that a step of a live sequence has arrived, before it runs: its idle time starts
        again (a server calls this when it queues a step, so that time in its queue does not
        count as the sequence sitting idle). Nothing happens for a sequence that is not live."""
        if self._sequences is not None:
            self._sequences.touch(sequence_id)

    def configure_sequences(self, *, max_idle_s: float | None = None, max_live: int | None = None) -> None:
        """Bound a stateful model's sequences: one idle longer than ``max_idle_s`` seconds is freed
        (its next step without ``sequence_start`` is a :class:`SequenceError` saying so), and no
        more than ``max_live`` are live at once (starting one more is a
        :class:`~neuropod.errors.SequenceLimitError`). None: no limit (the default)."""
        self._stateful_table().configure(max_idle_s=max_idle_s, max_live=max_live)

    def sequence(self, sequence_id: int | str | None = None) -> ModelSequence:
        """A new sequence of this stateful model: ``with model.sequence() as seq: seq.infer(inputs)``.

        Its first ``infer`` starts it from the initial state, each later one continues from the
        state the one before left, ``seq.infer(..., end=True)`` is its last step, and leaving the
        ``with`` block (``seq.close()``) frees its state.

        :param sequence_id: its id (an int >= 1 or a non-empty str, what a ``CORRID`` control
            input gets); a random 64-bit one when None.
        :raises SequenceError: the model is not stateful.
        """
        table = self._stateful_table()
        return ModelSequence(self, table.new_id() if sequence_id is None else sequence_id)

    def infer_sequences(
        self, inputs: Mapping[str, Any], steps: Sequence[SequenceStep], requested_outputs: Sequence[str] | None = None,
        *, parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Run one step of each of several sequences in one call of the model: ``inputs`` stack
        the steps' rows along the batch symbol, in ``steps`` order (``step.rows`` rows each, the
        state's leading dim, normally 1); their states are stacked the same way, and the
        outputs are too. A sequence may appear once in ``steps``.

        :raises SequenceError: the model is not stateful or cannot stack sequences
            (:attr:`sequence_batching_problem`), a step's sequence is not live without ``start``,
            a sequence appears twice, or the rows do not add up.
        :raises SequenceLimitError: a new sequence would pass the bound on live sequences.
        """
        table = self._stateful_table()
        steps = check_steps(steps, self.name)
        if len(steps) > 1 and not table.batching:
            raise SequenceError(
                f"model {self.name!r} cannot run {len(steps)} sequences in one call: {self.sequence_batching_problem}; "
                "run one step at a time"
            )
        return self._step(inputs, requested_outputs, parameters, steps)

    def _stateful_table(self) -> SequenceTable:
        if self._closed:
            raise NeuropodError(f"Model {self.name!r} is closed")
        if self._sequences is None:
            raise SequenceError(
                f"model {self.name!r} is not stateful: it was packaged without state_spec or sequence_controls, so "
                "it runs without sequences (call infer without sequence_id)"
            )
        return self._sequences

    def _infer_step(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None, output_device: str | None,
        parameters: Mapping[str, Any] | None, sequence_id: Any, start: Any, end: Any,
    ) -> dict[str, Any]:  # fmt: skip
        """:meth:`infer` with a sequence (or of a stateful model without one, which refuses)."""
        table = self._stateful_table()
        if sequence_id is None:
            raise SequenceError(
                f"model {self.name!r} carries state from one request of a sequence to the next: run it in a "
                "sequence (with model.sequence() as seq: seq.infer(inputs)), or call infer(inputs, sequence_id=..., "
                "sequence_start=True) for its first step"
            )
        check_flag("sequence_start", start)
        check_flag("sequence_end", end)
        if output_device is not None and self._output_device(output_device) is not None:
            raise NeuropodError(f"output_device={output_device!r}: a sequence's step answers with numpy arrays")
        rows = table.pairs[0].shape[0] if table.batching and table.pairs else 1
        step = SequenceStep(check_sequence_id(sequence_id), bool(start), bool(end), rows)
        return self._step(inputs, requested_outputs, parameters, [step])

    def _step(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None,
        parameters: Mapping[str, Any] | None, steps: list[SequenceStep],
    ) -> dict[str, Any]:  # fmt: skip
        validator = self._validator
        requested = None if requested_outputs is None else validator.check_requested(requested_outputs)
        if parameters:
            check_parameters(parameters)
        checked, bindings = validator.check_inputs(inputs)
        table = self._sequences
        assert table is not None
        if len(steps) > 1 or table.batching:
            check_rows(self.name, checked, steps)
        outputs = self._run_steps(checked, requested, steps, parameters or None)
        return self._checked_outputs(outputs, bindings, requested, None)

    def _run_steps(
        self, inputs: dict[str, Any], requested: list[str] | None, steps: list[SequenceStep],
        parameters: Mapping[str, Any] | None,
    ) -> dict[str, Any]:  # fmt: skip
        """Run checked caller inputs as one step of each of ``steps``' sequences: their state is
        taken from (and kept in) this model's table, controls are filled, the state outputs are
        split off; the caller's outputs, unchecked. A subclass that runs the model elsewhere (a
        worker, which keeps the state there) overrides this."""
        table = self._sequences
        assert table is not None

        def call(full: dict[str, Any], wanted: list[str] | None) -> Any:
            try:
                if parameters and self._infer_with_parameters is not None:
                    return self._infer_with_parameters(self._handle, full, wanted, parameters)
                return self._infer(self._handle, full, wanted)
            except NeuropodError:
                raise
            except Exception as e:
                raise self._run_failed(e) from e

        return run_steps(table, inputs, requested, steps, call, self.backend.id)

    def _end_sequence(self, sequence_id: int | str) -> bool:
        """Free a sequence's state where the model runs; whether it was live."""
        return self._stateful_table().end(sequence_id)

    def _sequence_state(self, sequence_id: int | str) -> dict[str, Any]:
        """A copy of a live sequence's state where the model runs."""
        return self._stateful_table().state(sequence_id)

    def _initial_states(self) -> list[Any]:
        table = self._stateful_table()
        return [table.initial[p.input_name] for p in table.pairs]


__all__ = ["StatefulModel", "build_table", "caller_specs", "check_rows", "check_steps", "run_steps", "with_sequences"]
