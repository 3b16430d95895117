"""A loaded pipeline: :class:`PipelineModel`, what ``load_neuropod`` returns for a pipeline package.

It is a :class:`~neuropod.model.NeuropodModel` with the pipeline's own spec: ``infer`` checks the
pipeline's inputs, runs the steps in dependency order (each step is a loaded model, in this process,
in worker processes, in a backend environment or on a server, with its own checks), and checks the
pipeline's outputs. Tensors pass from one in-process step to the next as they are (no copy); steps
in workers take them through their shared memory as any caller's. Steps that do not depend on one
another run at once on a thread each. A decoupled step makes the pipeline decoupled (each of its
responses runs the steps after it); stateful steps make it stateful (a request's sequence goes to each).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from neuropod._args import check_flag
from neuropod.errors import NeuropodError, PipelineStepError, SequenceError, SpecError
from neuropod.model import NeuropodModel
from neuropod.package import Package
from neuropod.pipespec import PipelineStep, Wiring
from neuropod.resolve import Resolution
from neuropod.sequences import Sequence as ModelSequence
from neuropod.sequences import check_sequence_id, new_sequence_id


class _Step:
    """One step as the pipeline runs it: the model, its tensor wiring, and its counters."""

    __slots__ = ("count", "failures", "infer", "ins", "model", "name", "ns", "outs", "stateful")

    def __init__(self, step: PipelineStep, model: NeuropodModel):
        self.name = step.name
        self.model = model
        self.infer = model.infer
        self.ins = tuple(step.input_map.items())
        self.outs = tuple(step.output_map.items())
        self.stateful = model.stateful
        # Counted without a lock: on CPython (3.10 on) a thread switches only at calls and backward
        # jumps, so ``+=`` of an int attribute is not interrupted and calls at once lose no count.
        self.count = 0
        self.failures = 0
        self.ns = 0


#: A sequence step as the pipeline passes it to its stateful steps: (id, start, end).
_Seq = tuple[Any, bool, bool]


class PipelineModel(NeuropodModel):
    """A pipeline package, loaded: its steps' models (:attr:`steps`), run as one model.

    Same ``infer`` (and ``infer_stream``, ``sequence()``) and errors as any model; a step that
    fails raises a :class:`~neuropod.errors.PipelineStepError` naming the pipeline, the step and
    its model (a step's :class:`SpecError` or :class:`SequenceError` keeps its class), and the
    pipeline keeps working. :meth:`step_statistics` counts each step's calls and time.
    """

    def __init__(
        self, package: Package, resolution: Resolution, steps: Mapping[str, NeuropodModel], wiring: Wiring,
        *, owns_steps: bool = True,
    ) -> None:  # fmt: skip
        spec = package.config.pipeline
        assert spec is not None
        by_name = {s.name: s for s in spec.steps}
        #: Step name -> its loaded model, in the order the steps run.
        self.steps: dict[str, NeuropodModel] = {n: steps[n] for n in wiring.order}
        #: The checked wiring: the steps' order and levels, each tensor's producer and dtype.
        self.wiring = wiring
        self._owns_steps = owns_steps
        self._levels = tuple(tuple(_Step(by_name[n], steps[n]) for n in level) for level in wiring.levels)
        self._order = tuple(s for level in self._levels for s in level)
        self._serial = all(len(level) == 1 for level in self._levels)
        self._stateful_steps = tuple(s for s in self._order if s.stateful)
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        inflight = spec.max_inflight_requests
        self._inflight = threading.BoundedSemaphore(inflight) if inflight else None
        super().__init__(package, resolution, None)
        self._output_names = tuple(s.name for s in self._outputs)
        # The fast path of infer (a decoupled pipeline refuses infer as any decoupled model does).
        self._check_fast = None if self.decoupled else self._validator._fast_inputs
        self._check_outputs = self._validator._fast_outputs if self._validator.shared_symbols else None

    # --- NeuropodModel's hooks: a pipeline has no backend hook of its own ---

    def _bind_infer(self) -> None:
        self._infer = None  # type: ignore[assignment]

    def _bind_stream(self) -> Callable[[Any, Any, Any, Any], Any]:
        return self._stream_call

    def _run(self, inputs: dict[str, Any], requested_outputs: list[str] | None, call_options: Any) -> Any:
        return self._execute(inputs, requested_outputs, None, None)

    def _run_with_parameters(
        self, inputs: dict[str, Any], requested_outputs: list[str] | None, call_options: Any,
        parameters: Mapping[str, Any],
    ) -> Any:  # fmt: skip
        return self._execute(inputs, requested_outputs, parameters, None)

    # --- running ---

    def infer(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None = None, *,
        output_device: str | None = None, parameters: Mapping[str, Any] | None = None,
        sequence_id: int | str | None = None, sequence_start: bool = False, sequence_end: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """Run the pipeline on one set of inputs (see :meth:`NeuropodModel.infer`). A stateful
        pipeline's ``sequence_id`` (and flags) go to each of its stateful steps."""
        check = self._check_fast
        if check is not None and sequence_id is None and requested_outputs is None and output_device is None \
                and not parameters and type(inputs) is dict and not self._closed and not self._stateful_steps:  # fmt: skip
            bindings = check(inputs, {})
            if bindings is not None:
                outputs = self._execute(inputs, None, None, None)
                check_outputs = self._check_outputs
                if check_outputs is not None and check_outputs(outputs, bindings) is not None:
                    return outputs
                return self._checked_outputs(outputs, bindings, None, None)
        if sequence_id is not None or self._stateful_steps:
            return self._sequence_step(inputs, requested_outputs, output_device, parameters, sequence_id,
                                       sequence_start, sequence_end)  # fmt: skip
        return self._checked_infer(inputs, requested_outputs, None, output_device, parameters)

    def _execute(
        self, inputs: Mapping[str, Any], requested: Sequence[str] | None, parameters: Mapping[str, Any] | None,
        seq: _Seq | None,
    ) -> dict[str, Any]:  # fmt: skip
        tensors = dict(inputs)
        inflight = self._inflight
        if inflight is not None:
            inflight.acquire()
        try:
            if self._serial and parameters is None and seq is None:
                # The common call, in this frame (no call per step but the model's own).
                clock = time.perf_counter_ns
                for step in self._order:
                    ins = {}
                    for name, tensor in step.ins:
                        ins[name] = tensors[tensor]
                    start = clock()
                    try:
                        out = step.infer(ins)
                    except Exception as e:
                        step.failures += 1
                        raise self._step_failed(step, e) from e
                    step.ns += clock() - start
                    step.count += 1
                    for name, tensor in step.outs:
                        tensors[tensor] = out[name]
            elif self._serial:
                run = self._run_step
                for step in self._order:
                    run(step, tensors, parameters, seq)
            else:
                for level in self._levels:
                    self._run_level(level, tensors, parameters, seq)
        finally:
            if inflight is not None:
                inflight.release()
        outputs = {}
        for name in self._output_names if requested is None else requested:
            outputs[name] = tensors[name]
        return outputs

    def _run_step(
        self, step: _Step, tensors: dict[str, Any], parameters: Mapping[str, Any] | None, seq: _Seq | None
    ) -> None:
        ins = {name: tensors[tensor] for name, tensor in step.ins}
        start = time.perf_counter_ns()
        try:
            if seq is not None and step.stateful:
                out = step.model.infer(ins, parameters=parameters, sequence_id=seq[0], sequence_start=seq[1],
                                       sequence_end=seq[2])  # fmt: skip
            elif parameters:
                out = step.model.infer(ins, parameters=parameters)
            else:
                out = step.infer(ins)
        except Exception as e:
            step.failures += 1
            raise self._step_failed(step, e) from e
        step.ns += time.perf_counter_ns() - start
        step.count += 1
        for name, tensor in step.outs:
            tensors[tensor] = out[name]

    def _run_level(
        self, level: tuple[_Step, ...], tensors: dict[str, Any], parameters: Mapping[str, Any] | None, seq: _Seq | None
    ) -> None:
        if len(level) == 1:
            self._run_step(level[0], tensors, parameters, seq)
            return
        # Steps of one level read only tensors of the levels before, and each writes its own.
        futures = [self._pool().submit(self._run_step, step, tensors, parameters, seq) for step in level[1:]]
        error: BaseException | None = None
        try:
            self._run_step(level[0], tensors, parameters, seq)
        except BaseException as e:  # noqa: BLE001 - raised after the other steps have finished
            error = e
        for future in futures:
            try:
                future.result()
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            raise error

    def _pool(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                if self._closed:
                    raise NeuropodError(f"Model {self.name!r} is closed")
                width = max(len(level) for level in self._levels) - 1
                self._executor = ThreadPoolExecutor(width, thread_name_prefix=f"neuropod-pipeline-{self.name}")
            return self._executor

    def _step_failed(self, step: _Step, e: BaseException) -> NeuropodError:
        message = f"pipeline {self.name!r}, step {step.name!r} (model {step.model.name!r}): {e}"
        if isinstance(e, (SpecError, SequenceError)):
            try:
                same = type(e)(message)
            except Exception:  # noqa: BLE001 - a subclass that takes other arguments
                same = None
            if isinstance(same, NeuropodError):
                return same
        if not isinstance(e, NeuropodError):
            message = f"pipeline {self.name!r}, step {step.name!r} (model {step.model.name!r}): {type(e).__name__}: {e}"
        return PipelineStepError(message, pipeline=self.name, step=step.name, model=step.model.name)

    def step_statistics(self) -> dict[str, dict[str, int]]:
        """Per step: ``count`` (calls that succeeded), ``failures`` and ``ns`` (time in the step's
        model for the successful calls, in nanoseconds)."""
        return {s.name: {"count": s.count, "failures": s.failures, "ns": s.ns} for s in self._order}

    # --- a decoupled step: each of its responses runs the steps after it ---

    def _stream_call(
        self, handle: Any, inputs: dict[str, Any], requested: list[str] | None, parameters: Any
    ) -> Iterator[dict[str, Any]]:
        return self._pipeline_stream(inputs, requested, parameters)

    def _pipeline_stream(
        self, inputs: dict[str, Any], requested: list[str] | None, parameters: Any
    ) -> Iterator[dict[str, Any]]:
        inflight = self._inflight
        if inflight is not None:
            inflight.acquire()  # a stream is inside the pipeline until it ends or is closed
        try:
            yield from self._stream_steps(inputs, requested, parameters)
        finally:
            if inflight is not None:
                inflight.release()

    def _stream_steps(
        self, inputs: dict[str, Any], requested: list[str] | None, parameters: Any
    ) -> Iterator[dict[str, Any]]:
        name = self.wiring.decoupled_step
        assert name is not None
        decoupled = next(s for s in self._order if s.name == name)
        after = self._downstream(decoupled)
        tensors = dict(inputs)
        for step in self._order:
            if step is not decoupled and step not in after:
                self._run_step(step, tensors, parameters, None)
        wanted = self._output_names if requested is None else requested
        before = set(tensors)  # pipeline outputs among these go in the first response only
        first = True
        ins = {n: tensors[t] for n, t in decoupled.ins}
        try:
            stream = decoupled.model.infer_stream(ins, parameters=parameters)
        except Exception as e:
            decoupled.failures += 1
            raise self._step_failed(decoupled, e) from e
        with stream:
            while True:
                start = time.perf_counter_ns()
                try:
                    response = next(stream)
                except StopIteration:
                    break
                except Exception as e:
                    decoupled.failures += 1
                    raise self._step_failed(decoupled, e) from e
                decoupled.ns += time.perf_counter_ns() - start
                decoupled.count += 1
                this = dict(tensors)
                for out, tensor in decoupled.outs:
                    if out in response:
                        this[tensor] = response[out]
                for step in after:
                    missing = [t for _, t in step.ins if t not in this]
                    if missing:
                        raise PipelineStepError(
                            f"pipeline {self.name!r}: a response of decoupled step {name!r} lacks tensor {missing[0]!r}, "
                            f"which step {step.name!r} reads", pipeline=self.name, step=name, model=decoupled.model.name,
                        )  # fmt: skip
                    self._run_step(step, this, parameters, None)
                answer = {n: this[n] for n in wanted if n in this and (first or n not in before)}
                first = False
                yield answer

    def _downstream(self, step: _Step) -> list[_Step]:
        """The steps that read, directly or not, what ``step`` produces, in run order."""
        produced = {t for _, t in step.outs}
        after = []
        for s in self._order:
            if any(t in produced for _, t in s.ins):
                after.append(s)
                produced.update(t for _, t in s.outs)
        return after

    # --- stateful steps: a request's sequence goes to each ---


    @property
    def stateful(self) -> bool:
        """Whether a step of the pipeline is stateful: the pipeline then runs in sequences."""
        return bool(self.wiring.stateful_steps)

    def _sequence_step(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None, output_device: str | None,
        parameters: Mapping[str, Any] | None, sequence_id: Any, start: Any, end: Any,
    ) -> dict[str, Any]:  # fmt: skip
        if not self.stateful:
            raise SequenceError(
                f"pipeline {self.name!r} is not stateful (none of its steps is), so it runs without sequences "
                "(call infer without sequence_id)"
            )
        if sequence_id is None:
            raise SequenceError(
                f"pipeline {self.name!r} has stateful steps ({', '.join(self.wiring.stateful_steps)}): run it in a "
                "sequence (with model.sequence() as seq: seq.infer(inputs)), or call infer(inputs, sequence_id=..., "
                "sequence_start=True) for its first step"
            )
        check_flag("sequence_start", start)
        check_flag("sequence_end", end)
        if self._closed:
            raise NeuropodError(f"Model {self.name!r} is closed")
        if output_device is not None and self._output_device(output_device) is not None:
            raise NeuropodError(f"output_device={output_device!r}: a sequence's step answers with numpy arrays")
        validator = self._validator
        requested = None if requested_outputs is None else validator.check_requested(requested_outputs)
        checked, bindings = validator.check_inputs(inputs)
        outputs = self._execute(checked, requested, parameters or None, (check_sequence_id(sequence_id), start, end))
        return self._checked_outputs(outputs, bindings, requested, None)

    def sequence(self, sequence_id: int | str | None = None) -> ModelSequence:
        """A new sequence of a stateful pipeline (see :meth:`NeuropodModel.sequence`)."""
        if not self.stateful:
            self._sequence_step({}, None, None, None, None, False, False)  # says it is not stateful
        return ModelSequence(self, new_sequence_id() if sequence_id is None else sequence_id)

    def infer_sequences(self, inputs: Mapping[str, Any], steps: Sequence[Any], requested_outputs: Sequence[str] | None = None,
                        *, parameters: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        if len(steps) != 1:
            raise SequenceError(f"pipeline {self.name!r} runs one sequence's step per call, not {len(steps)}")
        s = steps[0]
        return self.infer(inputs, requested_outputs, parameters=parameters, sequence_id=s.sequence_id,
                          sequence_start=s.start, sequence_end=s.end)  # fmt: skip

    def _end_sequence(self, sequence_id: int | str) -> bool:
        ended = False
        for step in self._stateful_steps:
            ended = step.model._end_sequence(sequence_id) or ended
        return ended

    def _sequence_state(self, sequence_id: int | str) -> dict[str, Any]:
        return {
            f"{s.name}/{k}": v for s in self._stateful_steps for k, v in s.model._sequence_state(sequence_id).items()
        }

    @property
    def live_sequences(self) -> int:
        return max((s.model.live_sequences for s in self._stateful_steps), default=0)

    def sweep_sequences(self) -> int:
        return max((s.model.sweep_sequences() for s in self._stateful_steps), default=0)

    def touch_sequence(self, sequence_id: int | str) -> None:
        for step in self._stateful_steps:
            step.model.touch_sequence(sequence_id)

    def configure_sequences(self, *, max_idle_s: float | None = None, max_live: int | None = None) -> None:
        for step in self._stateful_steps:
            step.model.configure_sequences(max_idle_s=max_idle_s, max_live=max_live)

    # --- the end ---

    def close(self) -> None:
        """Close the pipeline, and the steps' models it loaded (not those it was given by a server)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._fast = None
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        if self._owns_steps:
            for model in self.steps.values():
                model.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else " -> ".join(self.steps)
        return f"<PipelineModel {self.name!r} ({state})>"


__all__ = ["PipelineModel"]
