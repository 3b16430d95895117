"""The models an :class:`~neuropod_serving.server.engine.Engine` serves and their lifecycle:
a :class:`Runner` for each loaded version (its spec check, batcher, threads and
:class:`~neuropod_serving.server.admission.Gate`), loading, reloading and unloading models (a
replaced version drains its requests before it is closed), polling the repository, closing.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from neuropod.errors import NeuropodError, PackageError
from neuropod.spec import SpecValidator
from neuropod_serving.defaults import DEFAULT_MAX_CONCURRENT, DEFAULT_MAX_SEQUENCE_IDLE_US, DEFAULT_MAX_SEQUENCES
from neuropod_serving.errors import UnknownModelError
from neuropod_serving.server.admission import Gate, ModelLimits
from neuropod_serving.server.batching import Batcher, BatchPolicy, batch_symbol
from neuropod_serving.server.metrics import NoMetrics, Recorder
from neuropod_serving.server.polling import RepositoryPolling, failed_load
from neuropod_serving.server.registry import (
    MODEL_VERSION,
    Catalog,
    ModelRegistry,
    ModelSettings,
    ServedModel,
)
from neuropod_serving.server.sequence_batching import SequenceBatcher, SequenceLimits
from neuropod_serving.server.served_versions import Found
from neuropod_serving.server.streams import OpenStreams, StreamLimits

if TYPE_CHECKING:
    from neuropod_serving.processes import GroupMember
    from neuropod_serving.server.shm_regions import SharedMemoryRegistry

log = logging.getLogger("neuropod_serving.server")

#: Platforms whose models are arbitrary code (they may sleep or wait on I/O for any
#: input): never run on the event loop, however fast their runs have been.
NEVER_INLINE = frozenset({"python"})


@dataclass(frozen=True)
class ModelServing:
    """How the engine serves one model: the settings its Triton model configuration
    reports (:mod:`neuropod_serving.server.model_config`), read from this one place.

    :param batching: the batch policy of the model's batcher; None when its requests
        are not batched (no batch dimension in its spec, or batching off).
    :param instances: copies of the model that run at once: its OPE workers (1 in process).
    """

    batching: BatchPolicy | None
    instances: int


@dataclass
class Runner:
    """How one served model runs: its validator, batcher and recent run time."""

    served: ServedModel
    #: What its model configuration reports (set where the batcher and workers are chosen).
    serving: ModelServing
    validator: SpecValidator
    required: frozenset[str]
    batcher: Batcher | None
    #: Why the model is not batched ("" when it is, or when batching is off).
    unbatched_reason: str
    #: Whether the model may ever run on the event loop (in process, not arbitrary code, never slow yet).
    inline_ok: bool
    #: The spec's output names, in order: the order outputs go out when none were asked for.
    output_names: list[str]
    gate: Gate
    #: Threads of this model's own for requests from an event loop: a busy model never holds another's.
    executor: concurrent.futures.ThreadPoolExecutor
    #: Requests of this model that may be running or waiting at once (admitted).
    most_in_flight: int
    ewma_s: float = 1.0  # until measured: assume slow (a thread)
    #: The largest first input (bytes) of a run that took under INLINE_BELOW_S: a request
    #: whose first input is larger never runs on the loop (a graph's run time grows with
    #: its input). The first input only, so that the check costs the same for 2 inputs or 100.
    inline_bytes: int = 0
    #: A stateful model's sequence batcher (steps of several sequences in one run); None: its steps
    #: run one at a time (or the model is not stateful).
    sequencer: SequenceBatcher | None = None
    #: A stateful model's idle limit on its sequences in seconds (None: not stateful): how often they are swept.
    sequence_idle_s: float | None = None


def in_several_processes(name: str) -> NeuropodError:
    """Why stateful model ``name`` cannot be served by a server of several processes."""
    return NeuropodError(
        f"model {name!r} is stateful, and this server runs in several processes "
        "(--processes): a sequence's state lives in the one process that started it, while the kernel spreads "
        "requests over the processes, so the steps of a sequence would not find it. Serve stateful models with "
        "--processes 1, or on Ray Serve (--ray), which routes each sequence to the replica holding its state"
    )


class ModelLifecycle(RepositoryPolling):
    """The engine's models: which are served and how (:meth:`get`, :meth:`serving`), and
    loading, reloading, polling, unloading and closing them. :class:`~.engine.Engine` (its
    parameters are documented there) adds the request path.
    """

    if TYPE_CHECKING:

        def _timed(
            self, runner: Runner, inputs: dict[str, np.ndarray], requested: list[str] | None,
            parameters: Mapping[str, Any] | None = None,
        ) -> dict[str, np.ndarray]: ...  # fmt: skip

    def __init__(
        self,
        registry: ModelRegistry,
        *,
        batching: BatchPolicy | None = None,
        metrics: Recorder | None = None,
        limits: ModelLimits | None = None,
        shared_memory: SharedMemoryRegistry | None = None,
        stream_limits: StreamLimits | None = None,
        sequences: SequenceLimits | None = None,
    ) -> None:
        self.registry = registry
        #: Bounds on a stateful model's sequences unless its load config sets its own.
        self.sequence_limits = sequences or SequenceLimits(DEFAULT_MAX_SEQUENCE_IDLE_US, DEFAULT_MAX_SEQUENCES)
        #: Frees the state of idle sequences while no request comes (started with the first stateful model).
        self._sweeper: threading.Thread | None = None
        self.shared_memory = shared_memory
        self.batching = batching if batching is not None and batching.max_batch_size > 1 else None
        self.metrics: Recorder = metrics if metrics is not None else NoMetrics()
        #: OPE workers per model (1 in-process): batches in flight.
        self.workers = max(1, int(registry.load_options.get("workers", 1)))
        self.limits = limits if limits is not None else ModelLimits()
        #: Open streams of decoupled models (any model's, read by the stream front ends), and their limits.
        self.streams = OpenStreams(
            stream_limits, getattr(self.metrics, "streamed", None), getattr(self.metrics, "stream_ended", None)
        )
        #: Runs of one model at once (unbatched).
        self.max_concurrent = self.limits.max_concurrent or max(DEFAULT_MAX_CONCURRENT, 2 * self.workers)
        #: How a model is served unless a repository load's config says otherwise (:attr:`ServedModel.settings`).
        self.default_settings = ModelSettings(
            max_batch_size=self.batching.max_batch_size if self.batching is not None else 1,
            max_queue_delay_us=round(self.batching.max_queue_delay_s * 1e6) if self.batching is not None else 0,
            workers=self.workers,
        )
        #: Called with a model's name and what now serves it (None: unloaded) after every load and
        #: unload (gRPC health's statuses follow them); called under the engine's lock, so keep them short.
        self.listeners: list[Callable[[str, ServedModel | None], None]] = []
        #: This process's place in ``neuropod serve --processes`` (None: a server of one process):
        #: repository operations, metrics and readiness then go through the group.
        self.group: GroupMember | None = None
        self._runners: dict[tuple[str, str], Runner] = {}
        #: Set by :meth:`close`: stops the repository poll (:meth:`start_polling`).
        self._closing = threading.Event()
        self._poller: threading.Thread | None = None
        #: Seconds between polls of the repository; None: it is not polled.
        self.poll_interval_s: float | None = None
        #: What the polls last logged, by what it was about (each said once, not once per poll).
        self._poll_said: dict[str, str] = {}
        self._lock = threading.Lock()
        for served in registry:
            self._start(served)
        self._update_loaded()

    def get(self, name: str, version: str | None = None) -> ServedModel:
        """:raises UnknownModelError: no such model or version is loaded (None: its latest)."""
        return self.registry.get(name, version)

    def current(self, served: ServedModel, version: str | None) -> ServedModel:
        """What a request that looked up ``served`` (naming ``version``; None: none) runs on now,
        just before it is handed to :meth:`~.engine.Engine.infer`: ``served`` while it is loaded
        (or what a reload of its version loaded in its place); once its version was unloaded (a
        poll's swap to a newer one, while the request's body was read and decoded), the latest
        version for a request that named none, so that a rollout fails no request. A request that
        named a version gone since is answered that the version is not found.

        Its inputs were decoded against ``served``'s spec: a new version whose spec they do not
        fit refuses them (SpecError), as any request that does not fit.

        :raises UnknownModelError: every version of the model was unloaded since.
        """
        runner = self._runners.get((served.name, served.version))
        if runner is not None:
            return runner.served
        if version:
            return served  # the engine answers that it was unloaded
        return self.registry.get(served.name)

    def serving(self, name: str, version: str | None = None) -> ModelServing:
        """How model ``name`` (that version; None: its latest) is served (batching, instances).

        :raises UnknownModelError: it is not loaded.
        """
        served = self.registry.get(name, version)
        runner = self._runners.get((served.name, served.version))
        if runner is None:
            raise UnknownModelError(f"Request for unknown model: {name!r} is not found")
        if runner.batcher is not None and not runner.batcher.merging:
            # Its requests run one at a time now (a package the original Neuropod wrote, whose
            # outputs did not keep the batch's rows): described as a model without batching.
            return replace(runner.serving, batching=None)
        return runner.serving

    def batched(self, name: str, version: str | None = None) -> tuple[bool, str]:
        """Whether requests to model ``name`` are batched, and if not, why (for the start-up table)."""
        served = self.registry.get(name, version)
        runner = self._runners[(served.name, served.version)]
        if runner.batcher is not None and not runner.batcher.merging:
            return False, "batching off: its outputs did not keep the batch's rows (a package the original Neuropod wrote)"
        if runner.batcher is not None:
            return True, ""
        if runner.sequencer is not None:
            return True, "sequence batching"
        if runner.unbatched_reason:
            return False, runner.unbatched_reason
        settings = runner.served.settings
        if settings is not None and "max_batch_size" in settings.overridden:
            return False, f"batching off: its load config sets max_batch_size {settings.max_batch_size}"
        return False, "batching off: no --max-batch-size"

    def _start(self, served: ServedModel) -> None:
        model = served.model
        if served.settings is None:
            served.settings = self.default_settings
        settings = served.settings
        workers = settings.workers
        policy = (
            BatchPolicy(settings.max_batch_size, settings.max_queue_delay_us / 1e6, settings.preferred_batch_sizes)
            if settings.max_batch_size > 1
            else None
        )
        max_concurrent = self.limits.max_concurrent or max(DEFAULT_MAX_CONCURRENT, 2 * workers)
        symbol, reason = batch_symbol(model.inputs, model.outputs)
        unbatched = "" if symbol is not None else f"no batch dimension: {reason}"
        stateful = bool(getattr(model, "stateful", False))
        if stateful and self.group is not None:
            raise in_several_processes(model.name)
        sequenced, idle_s = False, None
        if stateful:  # never the ordinary batcher: it would run the model without its sequences
            idle_s = self._configure_sequences(model, settings)
            problem = model.sequence_batching_problem
            unbatched = f"a stateful model whose sequences cannot share a run: {problem}" if problem else ""
            sequenced = policy is not None and model.sequence_batching
        batched = policy is not None and symbol is not None and not stateful
        concurrent_runs = max_concurrent
        queued = f"--max-queued-requests {self.limits.max_queued}"
        limits = f"neuropod serve --max-concurrent-runs {concurrent_runs} {queued}"
        if batched or sequenced:
            assert policy is not None
            # Requests a batcher may hold while running: its batches in flight, full.
            concurrent_runs = workers * policy.max_batch_size
            limits = (
                f"{workers} batch(es) of up to {policy.max_batch_size} at once and {queued}: "
                "neuropod serve --workers, --max-batch-size, --max-queued-requests"
            )
        if settings.overridden:
            limits += f"; this model's load config set {', '.join(settings.overridden)}"
        runner = Runner(
            served=served,
            serving=ModelServing(policy if batched or sequenced else None, workers),
            validator=SpecValidator(model.name, model.inputs, model.outputs, shared_symbols=shared_symbols(model)),
            required=frozenset(s.name for s in model.inputs),
            batcher=None,
            unbatched_reason=unbatched,
            # Out-of-process workers wait on a pipe: always a thread, so N workers run N requests.
            inline_ok=may_run_inline(model),
            output_names=[s.name for s in model.outputs],
            gate=Gate(served.name, concurrent_runs, concurrent_runs + self.limits.max_queued, limits),
            executor=concurrent.futures.ThreadPoolExecutor(
                max_concurrent, thread_name_prefix=f"neuropod-infer-{served.name}"
            ),
            most_in_flight=max(max_concurrent, concurrent_runs) + self.limits.max_queued,
            sequence_idle_s=idle_s,
        )
        if sequenced:
            assert policy is not None
            runner.sequencer = SequenceBatcher(
                served.name, functools.partial(_run_steps, model), policy, inflight=workers,
                observe=functools.partial(_observe, self.metrics, model.name),
                rows=model.state_spec[0].shape[0] if model.state_spec else 1,
            )  # fmt: skip
        if batched:
            assert policy is not None
            # Batched runs are timed as unbatched ones are: whether the model may run on the event
            # loop follows its run time however its requests ran.
            runner.batcher = Batcher(
                model.name, functools.partial(self._timed, runner), policy, inflight=workers,
                observe=functools.partial(_observe, self.metrics, model.name),
                rows_promised=shared_symbols(model),
            )  # fmt: skip
        self._runners[(served.name, served.version)] = runner
        if stateful and self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep, name="neuropod-sequence-sweep", daemon=True)
            self._sweeper.start()

    def _configure_sequences(self, model: Any, settings: ModelSettings) -> float:
        """Bound a stateful model's sequences by its settings (else the server's); its idle limit in seconds."""
        limits = self.sequence_limits
        # 0 is Triton's "not set" for max_sequence_idle_microseconds: the server's then.
        idle_us = settings.max_sequence_idle_us or limits.max_idle_us
        live = settings.max_sequences or limits.max_sequences
        model.configure_sequences(max_idle_s=idle_us / 1e6, max_live=live)
        return idle_us / 1e6

    def _sweep(self) -> None:
        """Free idle sequences' state every half idle limit (of the loaded model with the shortest,
        between 5 ms and 1 s), so that memory is given back even when no request comes."""
        while not self._closing.wait(self._sweep_interval()):
            for runner in list(self._runners.values()):
                if runner.sequence_idle_s is None:
                    continue
                try:
                    runner.served.model.sweep_sequences()
                except Exception:  # a closed or broken model must not stop the sweep of the others
                    log.debug("sweeping the sequences of model %r failed", runner.served.name, exc_info=True)

    def _sweep_interval(self) -> float:
        limits = [r.sequence_idle_s for r in list(self._runners.values()) if r.sequence_idle_s is not None]
        return min(1.0, max(0.005, min(limits, default=2.0) / 2))

    def live_sequences(self) -> dict[str, int]:
        """How many sequences hold state, by stateful model (every version of it together)."""
        live: dict[str, int] = {}
        for runner in list(self._runners.values()):
            if runner.sequence_idle_s is not None:
                name = runner.served.name
                live[name] = live.get(name, 0) + int(runner.served.model.live_sequences)
        return live

    @property
    def most_in_flight(self) -> int:
        """Requests of one model that may be running or waiting at once (admitted): with the
        server's options, or the most of any model loaded with a config of its own."""
        per_batcher = self.workers * self.batching.max_batch_size if self.batching is not None else 0
        default = max(self.max_concurrent, per_batcher) + self.limits.max_queued
        return max([default, *(r.most_in_flight for r in list(self._runners.values()))])

    def load(self, name: str, *, settings: ModelSettings | None = None, drain_s: float = 30.0) -> ServedModel:
        """Load (or reload) the versions of model ``name`` the version policy serves.

        ``settings`` (a load's config override) serve them instead of the server's options; a
        load without them serves them with the server's options again.

        Each version is loaded before the one it replaces stops serving: requests already
        running or queued on a replaced (or dropped) version finish on it, for up to
        ``drain_s`` seconds, before it is closed; new ones go to the new one. A version that
        fails to load replaces nothing: the versions loaded before keep serving, its failure
        is the ``reason`` of its repository index entry, and it is raised.

        :returns: the latest version of the model now served.
        :raises UnknownModelError: no package of the repository has that name.
        :raises PackageError: several packages are one of its versions, or one fails to load.
        """
        with self._lock:
            catalog = self.registry.scan()
            try:
                plan = self.registry.plan(name, catalog)
            except NeuropodError as e:
                if name in self.registry or not isinstance(e, UnknownModelError):
                    self._failed_all(name, e)
                raise
            retired, failures = self._apply(name, plan, catalog, settings, force=True)
        self._retire(retired, drain_s)
        if failures:
            raise PackageError("; ".join(failures))
        return self.registry.get(name)

    def _apply(
        self, name: str, plan: dict[str, Found], catalog: Catalog, settings: ModelSettings | None, *,
        force: bool, removals: bool = True,
    ) -> tuple[list[tuple[ServedModel, Runner | None]], list[str]]:  # fmt: skip
        """Make the loaded versions of ``name`` those of ``plan`` (with the engine's lock held).

        :param force: load every version of the plan again; else only those new or changed
            (and not those whose unchanged files failed before).
        :param removals: unload the loaded versions the repository no longer holds.
        :returns: the models replaced or dropped, with their runners (for :meth:`_retire`),
            and the failures of the plan's versions.
        """
        registry = self.registry
        options = registry.load_options if settings is None else registry.options_for(settings)
        retired: list[tuple[ServedModel, Runner | None]] = []
        failures: list[str] = []
        changed = False
        for version, found in plan.items():
            current = registry.loaded(name, version)
            if not force and current is not None and (current.where, current.stamp) == (found.where, found.stamp):
                continue
            failed = registry.failure(name, version)
            if not force and failed is not None and found.stamp and failed[1] == found.stamp:
                failures.append(failed[0])  # unchanged since it failed: not tried again
                continue
            try:
                served = registry.open(found, name, options)
            except BaseException as raised:  # noqa: BLE001 - a model's code may raise anything while it loads
                e = failed_load(raised)
                kept = f"; still serving the model loaded before from {current.where}" if current is not None else ""
                registry.failed(name, version, f"the last load failed: {e}{kept}", found.stamp)
                if not force:
                    log.error("loading version %s of model %r failed: %s%s", version, name, e, kept)
                failures.append(f"version {version}: {e}" if version != MODEL_VERSION else str(e))
                continue
            served.settings = settings
            old_runner = self._runners.get((name, version))
            # Its runner first: a request that finds it in the registry finds how to run it.
            self._start(served)
            old = registry.put(served)
            if old is not None:
                retired.append((old, old_runner))
            if not force:
                log.info("loaded version %s of model %r from %s", version, name, found.where)
            changed = True
        present = set(catalog.models.get(name, {}))
        dropped = [
            v for v in registry.versions(name)
            # A version no longer served by the policy goes once every version that replaces it
            # loaded: a broken new version replaces nothing.
            if v not in plan and ((v not in present and removals) or (v in present and not failures))
        ]  # fmt: skip
        if dropped:
            if not force:
                log.info("unloading version(s) %s of model %r", ", ".join(dropped), name)
            retired += self._remove(name, dropped)
            changed = True
        if changed or force:
            self._update_loaded()
            self._notify(name, registry.latest(name))
        return retired, failures

    def _failed_all(self, name: str, error: NeuropodError) -> bool:
        """Keep ``error`` as the failure of every loaded version of ``name``; whether it is new."""
        new = False
        for version in self.registry.versions(name):
            served = self.registry.loaded(name, version)
            assert served is not None
            reason = f"the last load failed: {error}; still serving the model loaded before from {served.where}"
            if self.registry.failure(name, version) != (reason, served.stamp):
                new = True
            self.registry.failed(name, version, reason, served.stamp)
        return new

    def _remove(self, name: str, versions: Iterable[str]) -> list[tuple[ServedModel, Runner | None]]:
        """Stop serving those versions of ``name`` (with the engine's lock held); close them with :meth:`_retire`."""
        return [(self.registry.remove(name, v), self._runners.pop((name, v), None)) for v in list(versions)]

    def _retire(self, retired: list[tuple[ServedModel, Runner | None]], drain_s: float) -> None:
        """Close models no longer served, once the requests running or queued on them finished
        (for up to ``drain_s`` seconds each)."""
        for old, runner in retired:
            if runner is not None:
                # Nothing more is admitted; its batchers keep running what they hold while it drains.
                runner.gate.retire()
                if not runner.gate.drain(drain_s):
                    log.warning("model %r version %s stopped serving while requests still ran on it after %g s",
                                old.name, old.version, drain_s)  # fmt: skip
                if runner.batcher is not None:
                    runner.batcher.close()
                if runner.sequencer is not None:
                    runner.sequencer.close()
                runner.executor.shutdown(wait=False)
            old.model.close()

    def unload(self, name: str, drain_s: float = 30.0) -> None:
        """Stop serving every version of model ``name`` and close them once their requests finish.

        :raises UnknownModelError: it is not loaded.
        """
        with self._lock:
            self.registry.get(name)
            retired = self._remove(name, self.registry.versions(name))
            self._update_loaded()
            self._notify(name, None)
        self._retire(retired, drain_s)

    def _notify(self, name: str, served: ServedModel | None) -> None:
        for listener in self.listeners:
            try:
                listener(name, served)
            except Exception:  # a listener's bug must not fail a load that succeeded
                log.exception("a listener of model %r's load or unload failed", name)

    def _stop(self, key: tuple[str, str]) -> None:
        runner = self._runners.pop(key, None)
        if runner is None:
            return
        if runner.batcher is not None:
            runner.batcher.close()
        if runner.sequencer is not None:
            runner.sequencer.close()
        runner.executor.shutdown(wait=False)

    def _update_loaded(self) -> None:
        self.metrics.loaded(len(self.registry))

    def close(self) -> None:
        """End every open stream (with a final error), stop every batcher and thread (the
        repository poll's too) and close every model."""
        self.streams.stop_all("the server is stopping")
        self._closing.set()
        self._stop_polling()
        if self._sweeper is not None:
            self._sweeper.join()
        with self._lock:
            runners = list(self._runners.values())
            for key in list(self._runners):
                self._stop(key)
            for runner in runners:
                runner.executor.shutdown(wait=True)
            self.registry.close()
            if self.shared_memory is not None:
                self.shared_memory.close()


def _run_steps(
    model: Any, inputs: dict[str, np.ndarray], steps: list[Any], requested: list[str] | None,
    parameters: Mapping[str, Any] | None,
) -> dict[str, np.ndarray]:  # fmt: skip
    """One run of a sequence batcher's steps (:class:`~.sequence_batching.SequenceBatcher`)."""
    if parameters is None:
        return model.infer_sequences(inputs, steps, requested)  # type: ignore[no-any-return]
    return model.infer_sequences(inputs, steps, requested, parameters=parameters)  # type: ignore[no-any-return]


def _observe(
    metrics: Recorder, name: str, waited: list[float], seconds: float, rows: int, prepared: float, extracted: float
) -> None:
    """A batched run's metrics, as a batcher's ``observe`` reports them."""
    metrics.computed(name, seconds, rows, len(waited), prepared, extracted, waited)


def may_run_inline(model: Any) -> bool:
    """Whether a model may ever run on the event loop: in process, not arbitrary code; a pipeline
    only when each of its steps may, none is served elsewhere, and nothing bounds its requests in
    flight (a wait on the loop)."""
    steps = getattr(model, "steps", None)
    if isinstance(steps, dict):
        pipeline = model.package.config.pipeline
        local = all(not type(m).__module__.startswith("neuropod_serving.client") for m in steps.values())
        return local and not pipeline.max_inflight_requests and all(map(may_run_inline, steps.values()))
    return in_process(model) and getattr(getattr(model, "backend", None), "platform", None) not in NEVER_INLINE


def in_process(model: Any) -> bool:
    """Whether the model runs in this process (not in OPE workers or a backend environment)."""
    return not type(model).__module__.startswith("neuropod.ope")


def shared_symbols(model: Any) -> bool:
    """Whether a spec symbol has one size across inputs and outputs (False for packages the
    original Neuropod wrote: it checked inputs and outputs separately; see :class:`SpecValidator`)."""
    package = getattr(model, "package", None)
    return not getattr(package, "original_format", False)


__all__ = ["NEVER_INLINE", "ModelLifecycle", "ModelServing", "Runner", "in_process", "may_run_inline", "shared_symbols"]
