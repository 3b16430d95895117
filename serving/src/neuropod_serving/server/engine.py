"""What every protocol front end shares: the models, how a request runs, metrics.

This module is the :class:`Engine` and its request path; the models it serves and their
loading, reloading and unloading are :mod:`~neuropod_serving.server.lifecycle`'s, and how many
requests of a model run or wait (and for how long) :mod:`~neuropod_serving.server.admission`'s.

The REST app and the gRPC servicer decode a request into numpy arrays, call
:meth:`Engine.infer`, and encode what it returns; they never touch a model
directly. The engine checks the inputs against the spec (so a bad request is
a :class:`~neuropod.errors.SpecError` before it can join a batch), admits it
within the model's :class:`~neuropod_serving.server.admission.ModelLimits` (a full queue refuses it at once with
:class:`~neuropod_serving.server.registry.ModelBusyError`), runs the model in a
thread of the model's own (or on the calling thread when the model has proved
fast, see :meth:`Engine.infer`), through the model's
:class:`~neuropod_serving.server.batching.Batcher` when batching is on and the
spec allows it, and records metrics.

A request that names a sequence of a stateful model (``options.sequence``) is that sequence's
next step: with batching on and a model whose state can be stacked (``model.sequence_batching``),
it joins the model's :class:`~neuropod_serving.server.sequence_batching.SequenceBatcher`, which
runs the steps of several sequences in one call; otherwise it runs alone, as an unbatched request.
A stateful model never gets the ordinary batcher.

A request that asks more than its outputs (a ``timeout``, classification, parameters for the
model: :class:`~neuropod_serving.protocol.options.RequestOptions`) takes a path of its own
(:meth:`Engine._infer_with`), so a plain request pays one ``None`` check for them: a request
still waiting for a thread, a run slot or its batch when its timeout (or its gRPC call's
deadline) passes is answered with :class:`RequestTimeoutError` and never run.

Every model gets writable input arrays on every server path. The front ends
decode tensors over one writable copy of the request's tensor bytes (binary
REST: the body; gRPC: the raw contents), one allocation and copy a request
(about 0.25 ms per MB); any read-only input left (a caller of the engine's own)
is copied before the model runs. Inputs already writable are passed as they
are, and checking costs about 0.07 µs an input.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from neuropod.errors import NeuropodError, SequenceError, SpecError
from neuropod.sequences import SequenceStep
from neuropod_serving.errors import ModelBusyError, RequestTimeoutError, UnknownModelError
from neuropod_serving.protocol.options import RequestOptions
from neuropod_serving.server.admission import Deadline, NotStarted, Retired, request_deadline, until, wait
from neuropod_serving.server.batching import writable
from neuropod_serving.server.classification import Classifier
from neuropod_serving.server.full_collections import FullCollections
from neuropod_serving.server.inline_runs import INLINE_BELOW_S, SLOW_RUN_S, learn, nbytes
from neuropod_serving.server.lifecycle import ModelLifecycle, Runner
from neuropod_serving.server.model_exits import EXITS, is_users_interrupt, model_exited
from neuropod_serving.server.registry import ServedModel
from neuropod_serving.server.streams import ServedStream

log = logging.getLogger("neuropod_serving.server")

#: Versions a request that named none tries before it is answered that the model was unloaded:
#: each try after the first follows a rollout that swapped the version in the microseconds
#: between its lookup and its admission.
_LATEST_TRIES = 5


#: What :meth:`Engine.infer` raises when the request is at fault, not the model:
#: front ends count these as client failures (4xx, INVALID_ARGUMENT/NOT_FOUND/RESOURCE_EXHAUSTED).
CLIENT_ERRORS = (SpecError, UnknownModelError, ModelBusyError, RequestTimeoutError, SequenceError)


class Engine(ModelLifecycle):
    """The serving core: a registry of models and how their requests run.

    :param batching: the policy for models whose spec has a batch dimension;
        None (or max_batch_size 1) turns batching off. With the server's OPE
        workers it makes :attr:`default_settings`; a model loaded with a config
        of its own (:meth:`load`) is served with its :attr:`ServedModel.settings` instead.
    :param metrics: where to record; nothing is recorded when None.
    :param limits: runs at once and queue of each model (default: :class:`~.admission.ModelLimits`'s).
    :param shared_memory: the regions clients register for tensors in shared memory (Triton's
        shared-memory extensions); None: this server takes no tensors in shared memory.
    :param stream_limits: open streams of one model and their buffers (default: :class:`~.streams.StreamLimits`'s).
    :param sequences: a stateful model's idle limit and bound on live sequences unless its load config
        sets its own (default: :data:`~neuropod_serving.defaults.DEFAULT_MAX_SEQUENCE_IDLE_US`, 1 s,
        and :data:`~neuropod_serving.defaults.DEFAULT_MAX_SEQUENCES`); idle sequences are freed
        every half idle limit even while no request comes.
    """

    # -- requests ----------------------------------------------------------------

    def check(self, served: ServedModel, inputs: Mapping[str, np.ndarray], requested: list[str] | None) -> None:
        """The spec check of one request, before it runs or joins a batch.

        :raises SpecError: an unknown, missing or misfitting input, or an unknown requested output.
        """
        runner = self._runners[(served.name, served.version)]
        self._check_missing(runner, inputs)
        runner.validator.check_inputs(inputs)
        if requested is not None:
            runner.validator.check_requested(requested)

    @staticmethod
    def _check_missing(runner: Runner, inputs: Mapping[str, np.ndarray]) -> None:
        if inputs.keys() >= runner.required:
            return
        missing = runner.required.difference(inputs)
        if missing:
            served = runner.served
            raise SpecError(
                f"model {served.name!r} needs input(s) {', '.join(repr(n) for n in sorted(missing))}, which the "
                f"request did not send; its inputs are: {', '.join(str(s) for s in served.model.inputs)}"
            )

    async def infer(
        self, served: ServedModel, inputs: dict[str, np.ndarray], requested: list[str] | None = None,
        options: RequestOptions | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """Run one request (checked here first) and return the outputs it asked for, in the
        order asked for (else in spec order), as both protocols answer.

        The model runs in a thread of its own, never on the event loop, unless it has proved
        fast: in process, not arbitrary Python code, its recent runs under
        :data:`INLINE_BELOW_S` and none since over :data:`SLOW_RUN_S`, a first input no
        larger than in a run under :data:`INLINE_BELOW_S`, a free run slot and no other
        request of it waiting for one. Then it runs right here, where a thread hop would cost more
        than the model.

        A batched model's request (its batcher without a queue delay) that has proved fast
        the same way runs here too, as a batch of one, when its batcher is idle; when another
        of the model's runs held the loop in this iteration, it is gathered with the others
        arriving in the iteration and runs with them, merged, in the next (see
        :mod:`~neuropod_serving.server.batching`). Otherwise it waits for the batcher's threads.

        The model gets writable input arrays (read-only ones are copied).

        :param options: what the request asks besides its tensors (a timeout, classification,
            parameters for the model); see :meth:`_infer_with`.
        :raises SpecError: the request does not fit the spec.
        :raises UnknownModelError: the model was unloaded before or while it ran.
        :raises ModelBusyError: the model's queue is full (:class:`~.admission.ModelLimits`).
        :raises RequestTimeoutError: its timeout passed while it waited; it was not run.
        :raises NeuropodError: the model failed (BackendError, WorkerError...).
        """
        runner = self._runner(served)
        if requested is not None and requested == runner.output_names:
            requested = None  # every output, in the spec's order (what clients that name them send): as asked for none
        if options is not None:
            return await self._infer_with(runner, served, inputs, requested, options)
        try:
            batcher = runner.batcher
            if batcher is not None:
                self._check_missing(runner, inputs)
                runner.gate.admit(False)
                try:
                    # A fast model's requests run on the loop, as unbatched ones would: alone (the
                    # model's own infer checks the spec), or gathered with the others arriving in
                    # this loop iteration when they come in numbers that make merging pay.
                    how = (
                        batcher.alone_on_loop(asyncio.get_running_loop(), runner.ewma_s)
                        if batcher.runs_alone_at_once
                        and runner.inline_ok
                        and runner.ewma_s < INLINE_BELOW_S
                        and nbytes(inputs) <= runner.inline_bytes
                        else None
                    )
                    if how:
                        outputs = batcher.run_alone(inputs, requested)
                    else:
                        self.check(served, inputs, requested)
                        gathered = None
                        if how is not None:
                            gathered = await batcher.gather(asyncio.get_running_loop(), inputs, requested)
                        if gathered is None:  # queued for the batcher's threads
                            gathered = await asyncio.wrap_future(batcher.submit(inputs, requested))
                        outputs = gathered
                finally:
                    runner.gate.leave(False)
                return _ordered(runner, outputs, requested)
            # Unbatched, the model's own infer checks the spec: only what it does not check here.
            self._check_missing(runner, inputs)
            gate = runner.gate
            # Requests of this model running on its threads do not keep this one off the loop
            # (at high concurrency some always are, and the model would never come back to
            # the loop); requests waiting for a run slot do: they came first.
            inline = (
                runner.inline_ok
                and runner.ewma_s < INLINE_BELOW_S
                and gate.waiting <= 0
                and nbytes(inputs) <= runner.inline_bytes
            )
            if gate.admit(inline):
                # The common small-model case, without a coroutine or thread in between.
                try:
                    outputs = self._run(runner, inputs, requested, None)
                finally:
                    gate.leave(True)
            else:
                queued = time.perf_counter()
                loop = asyncio.get_running_loop()
                try:
                    future = loop.run_in_executor(runner.executor, self._run_queued, runner, inputs, requested, queued)
                except RuntimeError:  # the model's threads stopped: it is being unloaded
                    gate.leave(False)
                    raise Retired(f"model {served.name!r} was unloaded while the request waited") from None
                outputs = await future
            return _ordered(runner, outputs, requested)
        except (SpecError, ModelBusyError, Retired):
            raise
        except NeuropodError as e:
            if self._runners.get((served.name, served.version)) is not runner:
                raise self._closed_under(runner) from e
            raise

    def open_stream(
        self, served: ServedModel, inputs: dict[str, np.ndarray], requested: list[str] | None = None,
        options: RequestOptions | None = None,
    ) -> ServedStream:  # fmt: skip
        """Open a stream of ``served``'s responses to one request (see :mod:`~.streams`): a decoupled
        model's responses as it makes them, any other model's one answer. Its inputs are
        checked here; read the stream on a thread (iterate it) or from the event loop (``async
        for``, ``next_batch``), and close it. It runs outside the model's batcher and run
        slots, within its own limit of open streams.

        :raises SpecError: the request does not fit the spec.
        :raises UnknownModelError: the model was unloaded.
        :raises ModelBusyError: the model has its most streams open.
        """
        runner = self._runner(served)
        if requested is not None and requested == runner.output_names:
            requested = None
        self._check_missing(runner, inputs)
        parameters = options.parameters if options is not None else None
        runner.gate.hold()  # a version that stops serving waits for its streams (as for its requests)
        try:
            return self.streams.open(
                served.name, runner.served.model, writable(inputs), requested, parameters, on_end=runner.gate.release
            )
        except BaseException:  # refused (busy, stopping, the model's error): nothing to wait for
            runner.gate.release()
            raise

    def infer_blocking(
        self, served: ServedModel, inputs: dict[str, np.ndarray], requested: list[str] | None = None,
        options: RequestOptions | None = None, time_left: Callable[[], float | None] | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """:meth:`infer` for a caller on a thread of its own (the gRPC server's workers): the
        model runs on the calling thread once a run slot is free, or the request joins its
        model's batch and waits (it runs on the calling thread, as a batch of one, when its
        batcher has no queue delay and is idle). Same checks, limits, errors and metrics.

        :param time_left: the call's own deadline (gRPC's ``context.time_remaining``): asked
            only when the request has to wait, and a request still waiting when it passes
            is not run, as with a ``timeout`` in ``options``.
        """
        runner = self._runner(served)
        if requested is not None and requested == runner.output_names:
            requested = None  # as in infer: the model's common call, which needs no list of outputs
        if options is not None:
            return self._infer_blocking_with(runner, served, inputs, requested, options, time_left)
        try:
            gate = runner.gate
            batcher = runner.batcher
            if batcher is not None:
                self._check_missing(runner, inputs)
                gate.admit(False)
                try:
                    if batcher.begin_alone():  # idle: it runs on this thread, as an unbatched request runs
                        return _ordered(runner, batcher.run_alone(inputs, requested), requested)
                    self.check(served, inputs, requested)
                    future = batcher.submit(inputs, requested)
                    if time_left is None:
                        outputs = future.result()
                    else:  # the call's own deadline: a request whose caller gave up is not run
                        queued = time.perf_counter()
                        outputs = wait(future, request_deadline(queued, None, time_left), served.name, queued, "its batch")
                finally:
                    gate.leave(False)
            else:
                self._check_missing(runner, inputs)
                if gate.admit(True):
                    try:
                        outputs = self._run(runner, inputs, requested, None)
                    finally:
                        gate.leave(True)
                else:
                    queued = time.perf_counter()
                    deadline = request_deadline(queued, None, time_left)
                    outputs = self._run_queued(runner, inputs, requested, queued, deadline)
            return _ordered(runner, outputs, requested)
        except (SpecError, ModelBusyError, RequestTimeoutError, Retired):
            raise
        except NeuropodError as e:
            if self._runners.get((served.name, served.version)) is not runner:
                raise self._closed_under(runner) from e
            raise

    # -- requests that named no version: the latest when admitted ---------------------------

    async def infer_latest(
        self, served: ServedModel, version: str | None, inputs: dict[str, np.ndarray],
        requested: list[str] | None = None, options: RequestOptions | None = None,
    ) -> tuple[ServedModel, dict[str, np.ndarray]]:  # fmt: skip
        """:meth:`infer` of a request for ``served``, looked up for ``version`` (None: the
        request named none), and the model that ran it. A request that named no version runs on
        the model's latest version when it is admitted: when the version it looked up stopped
        serving first (a rollout swapped it while its body was read, decoded or waited), it is
        run on the version that serves now; a request that named a version gone since is
        answered that it was unloaded."""
        for attempt in range(_LATEST_TRIES):
            served = self.current(served, version)
            try:
                return served, await self.infer(served, inputs, requested, options)
            except Retired:
                if version or attempt == _LATEST_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def infer_blocking_latest(
        self, served: ServedModel, version: str | None, inputs: dict[str, np.ndarray],
        requested: list[str] | None = None, options: RequestOptions | None = None,
        time_left: Callable[[], float | None] | None = None,
    ) -> tuple[ServedModel, dict[str, np.ndarray]]:  # fmt: skip
        """:meth:`infer_blocking` as :meth:`infer_latest` runs :meth:`infer`."""
        for attempt in range(_LATEST_TRIES):
            served = self.current(served, version)
            try:
                return served, self.infer_blocking(served, inputs, requested, options, time_left)
            except Retired:
                if version or attempt == _LATEST_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def open_stream_latest(
        self, served: ServedModel, version: str | None, inputs: dict[str, np.ndarray],
        requested: list[str] | None = None, options: RequestOptions | None = None,
    ) -> tuple[ServedModel, ServedStream]:  # fmt: skip
        """:meth:`open_stream` as :meth:`infer_latest` runs :meth:`infer`: the stream, and the model it runs on."""
        for attempt in range(_LATEST_TRIES):
            served = self.current(served, version)
            try:
                return served, self.open_stream(served, inputs, requested, options)
            except Retired:
                if version or attempt == _LATEST_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    # -- requests with options (a timeout, classification, parameters) ---------------------
    # Apart from the plain path above, so that a plain request pays nothing for them.

    async def _infer_with(
        self, runner: Runner, served: ServedModel, inputs: dict[str, np.ndarray], requested: list[str] | None,
        options: RequestOptions,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """:meth:`infer` of a request with options: never on the event loop; a request still
        waiting (for a thread, a run slot or its batch) when its timeout passes is not run."""
        classes = _classification(runner, served, requested, options)
        queued = time.perf_counter()
        deadline = request_deadline(queued, options, None)
        gate = runner.gate
        step = _step(runner, options)
        try:
            if step is not None and runner.sequencer is not None:
                self.check(served, inputs, requested)
                gate.admit(False)
                try:
                    future = runner.sequencer.submit(inputs, step, requested, options.parameters)
                    outputs = await until(future, deadline, served.name, queued, "its batch")
                finally:
                    gate.leave(False)
            elif runner.batcher is not None and step is None:
                self.check(served, inputs, requested)
                gate.admit(False)
                try:
                    future = runner.batcher.submit(inputs, requested, options.parameters)
                    outputs = await until(future, deadline, served.name, queued, "its batch")
                finally:
                    gate.leave(False)
            else:
                self._check_missing(runner, inputs)
                gate.admit(False)
                try:
                    future = runner.executor.submit(
                        self._run_queued, runner, inputs, requested, queued, deadline, options.parameters, step
                    )
                except RuntimeError:  # the model's threads stopped: it is being unloaded
                    gate.leave(False)
                    raise Retired(f"model {served.name!r} was unloaded while the request waited") from None
                try:
                    outputs = await until(future, deadline, served.name, queued, "a thread")
                except NotStarted as e:
                    gate.leave(False)  # it never reached _run_queued, which would have
                    raise e.error from None
        except (SpecError, ModelBusyError, RequestTimeoutError, SequenceError, Retired):
            raise
        except NeuropodError as e:
            if self._runners.get((served.name, served.version)) is not runner:
                raise self._closed_under(runner) from e
            raise
        ordered = _ordered(runner, outputs, requested)
        return (await classes.apply_async(ordered)) if classes is not None else ordered

    def _infer_blocking_with(
        self, runner: Runner, served: ServedModel, inputs: dict[str, np.ndarray], requested: list[str] | None,
        options: RequestOptions, time_left: Callable[[], float | None] | None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """:meth:`infer_blocking` of a request with options (see :meth:`_infer_with`)."""
        classes = _classification(runner, served, requested, options)
        queued = time.perf_counter()
        gate = runner.gate
        step = _step(runner, options)
        try:
            sequencer = runner.sequencer if step is not None else None
            if sequencer is not None or (runner.batcher is not None and step is None):
                self.check(served, inputs, requested)
                deadline = request_deadline(queued, options, time_left)
                gate.admit(False)
                try:
                    if sequencer is not None:  # a stateful model's step, run with other sequences' steps
                        assert step is not None
                        future = sequencer.submit(inputs, step, requested, options.parameters, here=True)
                    else:
                        assert runner.batcher is not None
                        future = runner.batcher.submit(inputs, requested, options.parameters)
                    outputs = wait(future, deadline, served.name, queued, "its batch")
                finally:
                    gate.leave(False)
            else:
                self._check_missing(runner, inputs)
                if gate.admit(True):
                    try:
                        outputs = self._run(runner, inputs, requested, None, options.parameters, step)
                    finally:
                        gate.leave(True)
                else:
                    deadline = request_deadline(queued, options, time_left)
                    outputs = self._run_queued(runner, inputs, requested, queued, deadline, options.parameters, step)
        except (SpecError, ModelBusyError, RequestTimeoutError, SequenceError, Retired):
            raise
        except NeuropodError as e:
            if self._runners.get((served.name, served.version)) is not runner:
                raise self._closed_under(runner) from e
            raise
        ordered = _ordered(runner, outputs, requested)
        return classes.apply(ordered) if classes is not None else ordered

    def _runner(self, served: ServedModel) -> Runner:
        """The runner of ``served``, or of the model that replaced it in a reload since the
        request looked it up (its spec checks apply then)."""
        runner = self._runners.get((served.name, served.version))
        if runner is None:
            raise Retired(f"model {served.name!r} was unloaded while the request waited")
        return runner

    @staticmethod
    def _closed_under(runner: Runner) -> UnknownModelError:
        """What a NeuropodError (not a SpecError or ModelBusyError) raised while ``runner``
        served a request becomes when the model was closed or replaced under the request
        (its batcher stopped, or the model): then it is not the model's failure. Each
        caller checks in its own ``except`` (not a context manager: this is on every
        request's path)."""
        return UnknownModelError(f"model {runner.served.name!r} was unloaded while the request ran")

    def _run_queued(
        self, runner: Runner, inputs: dict[str, np.ndarray], requested: list[str] | None, queued: float,
        deadline: Deadline | None = None, parameters: Mapping[str, Any] | None = None,
        step: SequenceStep | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """:meth:`_run` once a run slot is free, for an admitted request (leaves the gate after).

        :param deadline: when the request stops waiting for a slot (RequestTimeoutError, not run).
        """
        gate = runner.gate
        try:
            if deadline is None:
                gate.wait_slot()
            elif not gate.wait_slot_until(deadline.at - time.perf_counter()):
                gate.leave(False)
                raise deadline.expired(runner.served.name, queued, "a run slot")
        except RequestTimeoutError:
            raise
        except BaseException:
            gate.leave(False)
            raise
        try:
            return self._run(runner, inputs, requested, queued, parameters, step)
        finally:
            gate.leave(True)

    def _run(
        self, runner: Runner, inputs: dict[str, np.ndarray], requested: list[str] | None, queued: float | None,
        parameters: Mapping[str, Any] | None = None, step: SequenceStep | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """One unbatched run, timed from ``queued`` (when the request was handed to a thread;
        None when it runs where it arrived, without waiting). Only a run that succeeds is
        recorded (queue, input copies, the model's run), as a batch's run is."""
        begun = time.perf_counter()  # the queue ends; copying read-only inputs (compute input) starts
        copied = writable(inputs)
        if copied is inputs:
            started = begun  # nothing was copied: no second clock read on the common path
        else:
            inputs = copied
            started = time.perf_counter()
        cpu = time.thread_time()
        collected = FullCollections.seconds
        ok = False
        try:
            if step is not None:  # a step of a stateful model's sequence
                outputs = runner.served.model.infer(
                    inputs, requested, parameters=parameters, sequence_id=step.sequence_id,
                    sequence_start=step.start, sequence_end=step.end,
                )  # fmt: skip
            elif parameters is None:
                outputs = runner.served.model.infer(inputs, requested)
            else:
                outputs = runner.served.model.infer(inputs, requested, parameters=parameters)
            ok = True
            return outputs
        except EXITS as e:  # the model's sys.exit(): its request fails, the server lives (see model_exits)
            if is_users_interrupt(e):
                raise
            raise model_exited(runner.served.name, e) from e
        finally:
            seconds = learn(runner, inputs, started, cpu, collected, queued is not None)
            if ok:
                self.metrics.ran(
                    runner.served.name, 0.0 if queued is None else begun - queued, seconds, started - begun
                )

    @staticmethod
    def _timed(
        runner: Runner, inputs: dict[str, np.ndarray], requested: list[str] | None,
        parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """One run of a batched model (a batch, or a request its idle batcher runs alone): the
        model's run time, as :meth:`_run` learns it, decides whether its lone requests may run
        on the event loop. The batcher records the metrics."""
        started = time.perf_counter()
        cpu = time.thread_time()
        collected = FullCollections.seconds
        try:
            if parameters is None:
                return runner.served.model.infer(inputs, requested)
            return runner.served.model.infer(inputs, requested, parameters=parameters)
        except EXITS as e:  # as in _run: the batch's requests fail, the batcher's thread lives
            if is_users_interrupt(e):
                raise
            raise model_exited(runner.served.name, e) from e
        finally:
            learn(runner, inputs, started, cpu, collected, True)


def _step(runner: Runner, options: RequestOptions) -> SequenceStep | None:
    """The sequence step a request is, for a stateful model; None for another model (which runs
    a request that names a sequence as any other, as Triton's schedulers do)."""
    step = options.sequence
    if step is None or not runner.served.model.stateful:
        return None
    if not step.start:  # a step's idle time ends when it arrives, not when it runs
        runner.served.model.touch_sequence(step.sequence_id)
    return step


def _classification(
    runner: Runner, served: ServedModel, requested: list[str] | None, options: RequestOptions
) -> Classifier | None:
    """The classification a request asks (checked before it runs), or None."""
    if options.classification is None:
        return None
    return Classifier.of(served, options.classification, requested)


def _ordered(runner: Runner, outputs: dict[str, np.ndarray], requested: list[str] | None) -> dict[str, np.ndarray]:
    names = requested if requested is not None else runner.output_names
    if len(outputs) == len(names) and all(a == b for a, b in zip(outputs, names)):
        return outputs
    if requested is None:
        names = [n for n in names if n in outputs]
    return {n: outputs[n] for n in [*names, *(n for n in outputs if n not in names)]}


__all__ = ["CLIENT_ERRORS", "INLINE_BELOW_S", "SLOW_RUN_S", "Engine"]
