"""What every protocol front end shares: the models, how a request runs, metrics.

The REST app and the gRPC servicer decode a request into numpy arrays, call
:meth:`Engine.infer`, and encode what it returns; they never touch a model
directly. The engine checks the inputs against the spec (so a bad request is
a :class:`~neuropod.errors.SpecError` before it can join a batch), runs the
model in a thread (or on the calling thread when its recent runs took under
:data:`INLINE_BELOW_S`, where a thread hop would cost more than the model),
through the model's :class:`~neuropod_serving.server.batching.Batcher` when
batching is on and the spec allows it, and records metrics.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from neuropod.errors import NeuropodError, SpecError
from neuropod.spec import SpecValidator
from neuropod_serving.server.batching import Batcher, BatchPolicy, batch_symbol
from neuropod_serving.server.metrics import NoMetrics, Recorder
from neuropod_serving.server.registry import ModelRegistry, ServedModel, UnknownModelError

log = logging.getLogger("neuropod_serving.server")

#: A model whose recent runs took less than this runs on the event loop's
#: thread. Handing a request to a thread and back costs 50 to 250 µs on a busy
#: core (the result wakes the loop through its self-pipe; measured on the
#: 100-input model of bench_serve.py, 0.26 ms a run: 0.96 -> 0.73 ms a request
#: inline), while holding the loop for under a millisecond delays nothing a
#: network client would notice. Slower models run in threads.
INLINE_BELOW_S = 0.001
# Weight of the newest run in the moving average of a model's run time.
_EWMA = 0.2
#: What :meth:`Engine.infer` raises when the request is at fault, not the model:
#: front ends count these as client failures (4xx, INVALID_ARGUMENT/NOT_FOUND).
CLIENT_ERRORS = (SpecError, UnknownModelError)


@dataclass
class _Runner:
    """How one served model runs: its validator, batcher and recent run time."""

    served: ServedModel
    validator: SpecValidator
    required: frozenset[str]
    batcher: Batcher | None
    #: Why the model is not batched ("" when it is, or when batching is off).
    unbatched_reason: str
    inline_ok: bool
    #: The spec's output names, in order: the order outputs go out when none were asked for.
    output_names: list[str]
    ewma_s: float = 1.0  # until measured: assume slow (a thread)


class Engine:
    """The serving core: a registry of models and how their requests run.

    :param batching: the policy for models whose spec has a batch dimension;
        None (or max_batch_size 1) turns batching off.
    :param metrics: where to record; nothing is recorded when None.
    :param threads: threads for unbatched requests (default: 2 per OPE
        worker, at least 4).
    """

    def __init__(
        self,
        registry: ModelRegistry,
        *,
        batching: BatchPolicy | None = None,
        metrics: Recorder | None = None,
        threads: int | None = None,
    ) -> None:
        self.registry = registry
        self.batching = batching if batching is not None and batching.max_batch_size > 1 else None
        self.metrics: Recorder = metrics if metrics is not None else NoMetrics()
        #: OPE workers per model (1 in-process): batches in flight, and the thread pool's size.
        self.workers = max(1, int(registry.load_options.get("workers", 1)))
        self._executor = concurrent.futures.ThreadPoolExecutor(
            threads or max(4, 2 * self.workers), thread_name_prefix="neuropod-infer"
        )
        self._runners: dict[str, _Runner] = {}
        self._lock = threading.Lock()
        for served in registry:
            self._start(served)
        self._update_loaded()

    # -- models ----------------------------------------------------------------

    def get(self, name: str, version: str | None = None) -> ServedModel:
        """:raises UnknownModelError: no such model or version is loaded."""
        return self.registry.get(name, version)

    def batched(self, name: str) -> tuple[bool, str]:
        """Whether requests to model ``name`` are batched, and if not, why (for the start-up table)."""
        runner = self._runners[name]
        if runner.batcher is not None:
            return True, ""
        return False, runner.unbatched_reason or "batching off: no --max-batch-size"

    def _start(self, served: ServedModel) -> None:
        model = served.model
        symbol, reason = batch_symbol(model.inputs, model.outputs)
        batcher = None
        if self.batching is not None and symbol is not None:
            name = model.name
            metrics = self.metrics

            def observe(waited: list[float], seconds: float, rows: int) -> None:
                for w in waited:
                    metrics.queued(name, w)
                metrics.computed(name, seconds, rows)

            batcher = Batcher(name, model.infer, self.batching, inflight=self.workers, observe=observe)
        self._runners[served.name] = _Runner(
            served=served,
            validator=SpecValidator(model.name, model.inputs, model.outputs, shared_symbols=_shared_symbols(model)),
            required=frozenset(s.name for s in model.inputs),
            batcher=batcher,
            unbatched_reason="" if symbol is not None else f"no batch dimension: {reason}",
            # Out-of-process workers wait on a pipe: always a thread, so N workers run N requests.
            inline_ok=_in_process(model),
            output_names=[s.name for s in model.outputs],
        )

    def load(self, name: str) -> ServedModel:
        """Load (or reload) model ``name`` from the repository; see :meth:`ModelRegistry.load_model`."""
        with self._lock:
            self._stop(name)
            served = self.registry.load_model(name)
            self._start(served)
            self._update_loaded()
            return served

    def unload(self, name: str) -> None:
        """Stop serving model ``name`` and close it. :raises UnknownModelError: it is not loaded."""
        with self._lock:
            self.registry.get(name)
            self._stop(name)
            self.registry.unload_model(name)
            self._update_loaded()

    def _stop(self, name: str) -> None:
        runner = self._runners.pop(name, None)
        if runner is not None and runner.batcher is not None:
            runner.batcher.close()

    def _update_loaded(self) -> None:
        self.metrics.loaded(len(self.registry))

    def close(self) -> None:
        """Stop every batcher and thread and close every model."""
        with self._lock:
            for name in list(self._runners):
                self._stop(name)
            self._executor.shutdown(wait=True)
            self.registry.close()

    # -- requests ----------------------------------------------------------------

    def check(self, served: ServedModel, inputs: Mapping[str, np.ndarray], requested: list[str] | None) -> None:
        """The spec check of one request, before it runs or joins a batch.

        :raises SpecError: an unknown, missing or misfitting input, or an unknown requested output.
        """
        runner = self._runners[served.name]
        self._check_missing(runner, inputs)
        runner.validator.check_inputs(inputs)
        if requested is not None:
            runner.validator.check_requested(requested)

    @staticmethod
    def _check_missing(runner: _Runner, inputs: Mapping[str, np.ndarray]) -> None:
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
        self, served: ServedModel, inputs: dict[str, np.ndarray], requested: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run one request (checked here first) and return the outputs it asked for, in the
        order asked for (else in spec order), as both protocols answer.

        :raises SpecError: the request does not fit the spec.
        :raises UnknownModelError: the model was unloaded before or while it ran.
        :raises NeuropodError: the model failed (BackendError, WorkerError...).
        """
        runner = self._runner(served)
        with self._unloaded_under(runner):
            if runner.batcher is None and runner.inline_ok and runner.ewma_s < INLINE_BELOW_S:
                # The common small-model case, without a coroutine or thread in between.
                self._check_missing(runner, inputs)
                outputs = self._run(runner, inputs, requested, None)
            else:
                outputs = await self._infer(runner, served, inputs, requested)
            return _ordered(runner, outputs, requested)

    def infer_blocking(
        self, served: ServedModel, inputs: dict[str, np.ndarray], requested: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """:meth:`infer` for a caller on a thread of its own (the gRPC server's workers): the
        model runs on the calling thread, or the request joins its model's batch and waits.
        Same checks, errors and metrics."""
        runner = self._runner(served)
        with self._unloaded_under(runner):
            if runner.batcher is not None:
                self.check(served, inputs, requested)
                outputs = runner.batcher.submit(inputs, requested).result()
            else:
                self._check_missing(runner, inputs)
                outputs = self._run(runner, inputs, requested, None)
            return _ordered(runner, outputs, requested)

    def _runner(self, served: ServedModel) -> _Runner:
        runner = self._runners.get(served.name)
        if runner is None or runner.served is not served:
            raise UnknownModelError(f"model {served.name!r} was unloaded while the request waited")
        return runner

    @contextlib.contextmanager
    def _unloaded_under(self, runner: _Runner) -> Iterator[None]:
        """A NeuropodError (not a SpecError) raised inside becomes an UnknownModelError when
        the model was closed under the request (its batcher stopped, or the model): then
        it is not the model's failure."""
        try:
            yield
        except SpecError:
            raise
        except NeuropodError as e:
            if self._runners.get(runner.served.name) is not runner:
                raise UnknownModelError(f"model {runner.served.name!r} was unloaded while the request ran") from e
            raise

    async def _infer(
        self, runner: _Runner, served: ServedModel, inputs: dict[str, np.ndarray], requested: list[str] | None
    ) -> dict[str, np.ndarray]:
        if runner.batcher is not None:
            self.check(served, inputs, requested)
            return await asyncio.wrap_future(runner.batcher.submit(inputs, requested))
        # Unbatched, the model's own infer checks the spec: only what it does not check here.
        self._check_missing(runner, inputs)
        queued = time.perf_counter()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._run, runner, inputs, requested, queued)

    def _run(
        self, runner: _Runner, inputs: dict[str, np.ndarray], requested: list[str] | None, queued: float | None
    ) -> dict[str, np.ndarray]:
        """One unbatched run, timed from ``queued`` (when the request was handed to a thread;
        None when it runs where it arrived, without waiting)."""
        started = time.perf_counter()
        try:
            return runner.served.model.infer(inputs, requested)
        finally:
            seconds = time.perf_counter() - started
            runner.ewma_s += _EWMA * (seconds - runner.ewma_s)
            self.metrics.ran(runner.served.name, 0.0 if queued is None else started - queued, seconds)


def _ordered(runner: _Runner, outputs: dict[str, np.ndarray], requested: list[str] | None) -> dict[str, np.ndarray]:
    names = requested if requested is not None else runner.output_names
    if len(outputs) == len(names) and all(a == b for a, b in zip(outputs, names)):
        return outputs
    if requested is None:
        names = [n for n in names if n in outputs]
    return {n: outputs[n] for n in [*names, *(n for n in outputs if n not in names)]}


def _in_process(model: Any) -> bool:
    """Whether the model runs in this process (not in OPE workers or a backend environment)."""
    return not type(model).__module__.startswith("neuropod.ope")


def _shared_symbols(model: Any) -> bool:
    """Whether a spec symbol has one size across inputs and outputs (False for packages the
    original Neuropod wrote: it checked inputs and outputs separately; see :class:`SpecValidator`)."""
    package = getattr(model, "package", None)
    return not getattr(package, "original_format", False)
